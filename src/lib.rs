//! trainkit: train transformer language models on one GPU (or the CPU), with mixed
//! precision, activation recomputation, gradient accumulation and memory accounting as
//! pluggable policies.
//!
//! The core loop, [`Trainer`], is generic over five policy traits: [`Precision`],
//! [`CheckpointPolicy`], [`Optimizer`], [`AccumulationSchedule`] and [`MemoryObserver`].
//! Each ships with implementations and can be written by users in their own crates; each
//! is serializable by a `kind` tag, so a strategy choice lives in a config file.
#![warn(missing_docs)]

pub mod accumulate;
pub mod adapter;
pub mod checkpoint;
pub mod collective;
pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod estimate;
mod mapped;
pub mod memory;
pub mod model;
pub mod ops;
pub mod optim;
pub mod param;
pub mod placement;
pub mod precision;
mod rng;
pub mod save;
pub mod tensor;
pub mod trainer;

pub use accumulate::{AccumulationSchedule, Constant, Ramp, TokensPerStep};
pub use adapter::{Adapter, FullFineTune, Lora};
pub use checkpoint::{
    ActivationSite, Budget, CheckpointPolicy, Full, NoRecompute, Retention, Selective, SiteCost,
    Tags,
};
pub use device::{Backend, Blas, CpuBackend, Device, MetaBackend};
pub use error::{Error, Result};
pub use estimate::Preset;
pub use memory::{
    LogObserver, MemoryCategory, MemoryEvent, MemoryObserver, Observers, PeakTracker, Phase,
    Timeline,
};
pub use model::{
    Gpt2, Gpt2Config, KvCache, Llama, LlamaConfig, Model, ModelConfig, Qwen2, Qwen2Config, Qwen3,
    Qwen3Config,
};
pub use optim::{AdamW, AdamW8bit, LrSchedule, Optimizer, Param, Sgd};
pub use placement::{Placement, StreamAll, StreamFrozen, WeightPlacement};
pub use precision::{Fp32, LossScale, MixedBf16, MixedFp16, Precision, PureBf16};
pub use rng::Rng;
pub use tensor::{DType, Tensor};
pub use trainer::{Evaluation, SamplingOptions, StepStats, Trainer, TrainerOptions};

/// Everything a training script needs, in one import.
pub mod prelude {
    pub use crate::accumulate::{AccumulationSchedule, Constant, Ramp, TokensPerStep};
    pub use crate::checkpoint::{
        Budget, CheckpointPolicy, Full, NoRecompute, Retention, Selective, Tags,
    };
    pub use crate::data::{Batch, ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
    pub use crate::device::{Backend, Device};
    pub use crate::error::{Error, Result};
    pub use crate::memory::{LogObserver, MemoryCategory, MemoryObserver, PeakTracker, Timeline};
    pub use crate::model::{Gpt2, Gpt2Config, Model};
    pub use crate::optim::{AdamW, AdamW8bit, LrSchedule, Optimizer, Sgd};
    pub use crate::precision::{Fp32, LossScale, MixedBf16, MixedFp16, Precision, PureBf16};
    pub use crate::tensor::DType;
    pub use crate::trainer::{StepStats, Trainer, TrainerOptions};
}
