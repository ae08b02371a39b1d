//! The activation stash: what a layer's forward leaves for its backward.

use crate::checkpoint::{ActivationKind, ActivationSite, CheckpointPolicy, Retention};
use crate::tensor::Tensor;

/// Bytes the checkpoint policy kept and dropped during forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StashStats {
    /// Activation bytes kept for backward.
    pub kept_bytes: u64,
    /// Activation bytes freed after forward, to be recomputed in backward.
    pub dropped_bytes: u64,
    /// Activation bytes recomputed in backward.
    pub recomputed_bytes: u64,
}

/// The saved activations of one layer, one slot per [`ActivationKind`].
#[derive(Debug, Default)]
pub struct LayerStash {
    slots: [Option<Tensor>; ActivationKind::ALL.len()],
}

impl LayerStash {
    /// An empty stash.
    pub fn new() -> Self {
        Self::default()
    }

    /// The activation of `kind`, if present.
    pub fn get(&self, kind: ActivationKind) -> Option<&Tensor> {
        self.slots[kind.index()].as_ref()
    }

    /// Whether `kind` is present.
    pub fn has(&self, kind: ActivationKind) -> bool {
        self.slots[kind.index()].is_some()
    }

    /// Stores `t` as `kind` (replacing nothing: a present slot keeps its tensor).
    pub fn put(&mut self, kind: ActivationKind, t: Tensor) {
        let slot = &mut self.slots[kind.index()];
        if slot.is_none() {
            *slot = Some(t);
        }
    }

    /// Frees `kind`.
    pub fn free(&mut self, kind: ActivationKind) {
        self.slots[kind.index()] = None;
    }

    /// Takes `kind` out of the stash.
    pub fn take(&mut self, kind: ActivationKind) -> Option<Tensor> {
        self.slots[kind.index()].take()
    }

    /// Frees every slot.
    pub fn clear(&mut self) {
        for s in &mut self.slots {
            *s = None;
        }
    }

    /// After forward no longer needs `kind`: asks `policy` whether to keep it, frees it if
    /// not, and counts the bytes.
    pub fn settle(
        &mut self,
        kind: ActivationKind,
        layer: usize,
        n_layer: usize,
        policy: &dyn CheckpointPolicy,
        stats: &mut StashStats,
    ) {
        let Some(t) = self.get(kind) else { return };
        let site = ActivationSite {
            layer,
            n_layer,
            kind,
            bytes: t.bytes(),
        };
        match policy.retain(&site) {
            Retention::Keep => stats.kept_bytes += site.bytes,
            Retention::Recompute => {
                stats.dropped_bytes += site.bytes;
                self.free(kind);
            }
        }
    }
}
