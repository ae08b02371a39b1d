//! Memory and compute estimates: the Ultra-Scale Playbook's formulas for parameters,
//! model state and activations, named model presets, FLOPs per token and GPU peaks for
//! MFU, the activation-versus-sequence-length figure; and trainkit's exact model of its
//! own training memory, with autofit, which uses it to choose the cheapest setup that fits a
//! budget, and what each memory technique saves.
//!
//! ```
//! use trainkit::estimate::preset;
//! use trainkit::{AdamW, MixedBf16, Selective};
//!
//! let llama = preset("llama-8b")?;
//! let params = llama.shape.exact_params()?;
//! let bf16 = MixedBf16 { fp32_grads: false };
//! let state = trainkit::estimate::model_state_bytes(params, &bf16, &AdamW::default())?.total();
//! let acts = llama.shape.activation_shape(4096, 1).bytes(&Selective, &bf16)?;
//! assert_eq!(state, 16 * params);
//! assert!(acts < state);
//! # Ok::<(), trainkit::Error>(())
//! ```

mod autofit;
mod budget;
mod exact;
pub mod flops;
pub mod formulas;
pub mod plot;
pub mod presets;
mod techniques;

pub use crate::model::{Mlp, Norm, Shape};
pub use autofit::{
    autofit, policy_name, technique_savings, FitAttempt, FitCandidate, FitPlan, FitRequest,
    TechniqueSaving, TechniqueSavings,
};
pub use budget::{host_available_memory, parse_bytes};
pub use exact::{
    predict, predict_gpt2, predict_rank, predict_shape, predict_with, ActivationProfile,
    MemoryPrediction, MicroBatch, HOST_LINK_BYTES_PER_S,
};
pub use flops::{flops_per_token, gpu_peak, mfu, peak_flops, GpuPeak, MathDtype, GPU_PEAKS};
pub use formulas::{
    bytes_per_param, model_state_bytes, playbook_params, ActivationShape, PlaybookActivation,
    PLAYBOOK_LAYER,
};
pub use plot::ActivationSweep;
pub use presets::{find_preset, preset, preset_names, Preset, PRESETS};
pub use techniques::{Technique, Techniques};
