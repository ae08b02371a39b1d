//! Memory estimation: trainkit's exact model of its own training memory.

mod exact;

pub use exact::{predict_gpt2, ActivationProfile, MemoryPrediction, MicroBatch};
