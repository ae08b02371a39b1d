//! What a buffer is for: the eight categories of training memory (six on the device, two
//! in host memory held for it).

use serde::{Deserialize, Serialize};

/// The role of a buffer in training. Every tensor carries one; the ledger sums bytes by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryCategory {
    /// Parameters in the compute dtype (the weights forward and backward read).
    Weights,
    /// The f32 master copy of the parameters, where the precision keeps one apart.
    MasterWeights,
    /// Parameter gradients (accumulated across micro-batches).
    Gradients,
    /// Optimizer state (Adam's moments, momentum buffers, ...).
    OptimizerState,
    /// Activations kept for backward, recomputed activations and activation gradients.
    Activations,
    /// Scratch space of ops (logits of the loss, reductions, ...).
    Workspace,
    /// Host memory held for the device: activations offloaded between their forward and
    /// their backward ([`crate::Retention::Offload`]). Reported beside the others but not
    /// part of the device's total ([`CategoryBytes::total`]).
    Offloaded,
    /// Host memory held for the device: weights that live in page-locked host memory
    /// and are copied to the device ahead of the ops that read them
    /// ([`crate::placement::Placement::Streamed`]); their copies on the device, while
    /// there, count as [`MemoryCategory::Weights`]. Not part of the device's total.
    Streamed,
}

impl MemoryCategory {
    /// All categories, in the order reports print them.
    pub const ALL: [MemoryCategory; 8] = [
        MemoryCategory::Weights,
        MemoryCategory::MasterWeights,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::Activations,
        MemoryCategory::Workspace,
        MemoryCategory::Offloaded,
        MemoryCategory::Streamed,
    ];

    /// Whether the category's buffers live in device memory (all but
    /// [`MemoryCategory::Offloaded`] and [`MemoryCategory::Streamed`], which are host
    /// memory).
    pub fn on_device(self) -> bool {
        !matches!(self, MemoryCategory::Offloaded | MemoryCategory::Streamed)
    }

    /// The category a buffer made as `self` in host memory held for a device is counted
    /// under: [`MemoryCategory::Streamed`] stays itself, every other category is
    /// [`MemoryCategory::Offloaded`].
    pub fn in_host_memory(self) -> MemoryCategory {
        match self {
            MemoryCategory::Streamed => MemoryCategory::Streamed,
            _ => MemoryCategory::Offloaded,
        }
    }

    /// Position in [`MemoryCategory::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The snake_case name used in logs and JSON.
    pub fn name(self) -> &'static str {
        match self {
            MemoryCategory::Weights => "weights",
            MemoryCategory::MasterWeights => "master_weights",
            MemoryCategory::Gradients => "gradients",
            MemoryCategory::OptimizerState => "optimizer_state",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Workspace => "workspace",
            MemoryCategory::Offloaded => "offloaded",
            MemoryCategory::Streamed => "streamed",
        }
    }
}

impl std::fmt::Display for MemoryCategory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes per category, indexed by [`MemoryCategory::index`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryBytes(pub [u64; 8]);

impl CategoryBytes {
    /// Bytes of one category.
    pub fn get(&self, category: MemoryCategory) -> u64 {
        self.0[category.index()]
    }

    /// Mutable bytes of one category.
    pub fn get_mut(&mut self, category: MemoryCategory) -> &mut u64 {
        &mut self.0[category.index()]
    }

    /// Sum over the device's categories: every category but
    /// [`MemoryCategory::Offloaded`] and [`MemoryCategory::Streamed`], whose bytes are in
    /// host memory ([`Self::host`]).
    pub fn total(&self) -> u64 {
        self.iter()
            .filter(|(c, _)| c.on_device())
            .map(|(_, b)| b)
            .sum()
    }

    /// Host memory held for the device: the [`MemoryCategory::Offloaded`] and
    /// [`MemoryCategory::Streamed`] bytes.
    pub fn host(&self) -> u64 {
        self.iter()
            .filter(|(c, _)| !c.on_device())
            .map(|(_, b)| b)
            .sum()
    }

    /// Element-wise maximum with `other`.
    pub fn max_with(&mut self, other: &CategoryBytes) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a = (*a).max(*b);
        }
    }

    /// `(category, bytes)` pairs in report order.
    pub fn iter(&self) -> impl Iterator<Item = (MemoryCategory, u64)> + '_ {
        MemoryCategory::ALL.iter().map(|c| (*c, self.get(*c)))
    }
}

/// Human-readable bytes: `1.50 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}
