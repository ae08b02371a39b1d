//! NF4: frozen projection weights in 4.127 bits per element, as QLoRA stores them.
//!
//! - [`format`]: bitsandbytes' NF4 with double-quantized absmaxes, on the host:
//!   quantization (when a checkpoint is loaded) and the reference dequantization.
//! - [`DType::Nf4`](crate::tensor::DType::Nf4) is the packed dtype: the ledger and the
//!   meta backend count its exact bytes; uploading f32 values to it quantizes them.

pub mod format;

pub use format::{dequantize, dynamic_code, pack, quantize, Layout, BLOCK, CODE, STATS_BLOCK};
