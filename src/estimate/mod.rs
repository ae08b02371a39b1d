//! Memory estimation: trainkit's exact model of its own training memory, and autofit,
//! which uses it to choose a setup that fits a budget.

mod autofit;
mod budget;
mod exact;

pub use autofit::{autofit, FitCandidate, FitPlan, FitRequest, Recompute};
pub use budget::{host_available_memory, parse_bytes};
pub use exact::{predict_gpt2, ActivationProfile, MemoryPrediction, MicroBatch};
