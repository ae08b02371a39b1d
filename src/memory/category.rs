//! What a buffer is for: the seven categories of training memory (six on the device, one
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
}

impl MemoryCategory {
    /// All categories, in the order reports print them.
    pub const ALL: [MemoryCategory; 7] = [
        MemoryCategory::Weights,
        MemoryCategory::MasterWeights,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::Activations,
        MemoryCategory::Workspace,
        MemoryCategory::Offloaded,
    ];

    /// Whether the category's buffers live in device memory (all but
    /// [`MemoryCategory::Offloaded`], which is host memory).
    pub fn on_device(self) -> bool {
        self != MemoryCategory::Offloaded
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
pub struct CategoryBytes(pub [u64; 7]);

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
    /// [`MemoryCategory::Offloaded`], whose bytes are in host memory ([`Self::host`]).
    pub fn total(&self) -> u64 {
        self.iter()
            .filter(|(c, _)| c.on_device())
            .map(|(_, b)| b)
            .sum()
    }

    /// Host memory held for the device: the [`MemoryCategory::Offloaded`] bytes.
    pub fn host(&self) -> u64 {
        self.get(MemoryCategory::Offloaded)
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
