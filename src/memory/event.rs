//! The memory event stream: allocations, frees, phase boundaries, op spans and step ends.

use super::MemoryCategory;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// A span of the training step, reported at its beginning and end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "phase", content = "layer")]
pub enum Phase {
    /// One micro-batch (forward, loss and backward).
    MicroBatch(usize),
    /// Token and position embedding.
    Embedding,
    /// Forward of transformer layer i.
    Forward(usize),
    /// Final norm, classifier and loss (forward and backward fused).
    Loss,
    /// Backward of transformer layer i (including any recomputation it needs).
    Backward(usize),
    /// Backward of the embeddings.
    EmbeddingBackward,
    /// Gradient clipping and the optimizer update.
    Optimizer,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::MicroBatch(i) => write!(f, "micro-batch {i}"),
            Phase::Embedding => f.write_str("embedding"),
            Phase::Forward(i) => write!(f, "forward {i}"),
            Phase::Loss => f.write_str("loss"),
            Phase::Backward(i) => write!(f, "backward {i}"),
            Phase::EmbeddingBackward => f.write_str("embedding backward"),
            Phase::Optimizer => f.write_str("optimizer"),
        }
    }
}

/// What the device itself reports about its memory (GPU backends), beside the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Bytes the allocator holds from the device.
    pub reserved: u64,
    /// Free bytes on the device.
    pub free: u64,
    /// Total bytes on the device.
    pub total: u64,
}

/// One entry of the memory event stream that a [`super::MemoryObserver`] receives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum MemoryEvent {
    /// A buffer was allocated.
    Alloc {
        /// Unique id of the buffer (matches its `Free`).
        id: u64,
        /// What the buffer is for.
        category: MemoryCategory,
        /// Exact bytes.
        bytes: u64,
        /// Name of the buffer, e.g. `h.3.qkv` or `h.3.attn.c_attn.weight`.
        label: String,
        /// Microseconds since the ledger was created.
        time_us: u64,
    },
    /// A buffer was freed.
    Free {
        /// Id given at allocation.
        id: u64,
        /// What the buffer was for.
        category: MemoryCategory,
        /// Exact bytes.
        bytes: u64,
        /// Name of the buffer.
        label: String,
        /// Microseconds since the ledger was created.
        time_us: u64,
    },
    /// A phase began.
    PhaseBegin {
        /// The phase.
        phase: Phase,
        /// Microseconds since the ledger was created.
        time_us: u64,
    },
    /// A phase ended.
    PhaseEnd {
        /// The phase.
        phase: Phase,
        /// Microseconds since the ledger was created.
        time_us: u64,
    },
    /// A backend op ran (reported when it ends, so after the allocations it made).
    Op {
        /// The op: the [`crate::Backend`] method, e.g. `matmul` or `attention_scores`.
        name: Cow<'static, str>,
        /// Label of the tensor the op wrote (its first output), e.g. `h.3.qkv`.
        label: String,
        /// Floating-point operations the op executed (see [`crate::Backend`]'s methods).
        flops: u64,
        /// When the op started, in microseconds since the ledger was created.
        time_us: u64,
        /// How long it ran, in microseconds.
        duration_us: u64,
    },
    /// An optimizer step ended.
    StepEnd {
        /// The step that ended (1-based).
        step: u64,
        /// The device's own numbers, where the backend knows them.
        device: Option<DeviceMemory>,
        /// Microseconds since the ledger was created.
        time_us: u64,
    },
}
