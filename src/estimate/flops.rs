//! Compute efficiency: model FLOPs per token, model FLOPs utilisation (MFU), and the
//! peak throughput of common NVIDIA GPUs.
//!
//! Peaks are the vendors' datasheet figures for dense math (without 2:4 structured
//! sparsity, which datasheets mark with an asterisk and which training does not use), in
//! FLOP/s. Tensor-core figures are for fp32 accumulation where a datasheet distinguishes
//! it (GeForce cards run fp16 with fp16 accumulation at twice that rate; training
//! accumulates in fp32).

use serde::{Deserialize, Serialize};

/// Training FLOPs per token, llm.c's estimate: `6N` for the matrix multiplications of
/// forward and backward plus `6·L·h·s` for attention's scores and weighted sum.
pub fn flops_per_token(params: u64, layers: u64, hidden: u64, seq_len: u64) -> f64 {
    6.0 * params as f64 + 6.0 * layers as f64 * hidden as f64 * seq_len as f64
}

/// Model FLOPs utilisation: the fraction of `peak_flops` (FLOP/s) that `tokens_per_second`
/// tokens of `flops_per_token` each amount to. 0 when the peak is not positive.
pub fn mfu(tokens_per_second: f64, flops_per_token: f64, peak_flops: f64) -> f64 {
    if peak_flops > 0.0 {
        tokens_per_second * flops_per_token / peak_flops
    } else {
        0.0
    }
}

/// The number format of the math a peak refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MathDtype {
    /// bf16 inputs on tensor cores (fp32 accumulation).
    Bf16,
    /// fp16 inputs on tensor cores (fp32 accumulation).
    Fp16,
    /// TF32 on tensor cores (f32 matmuls with tensor cores allowed).
    Tf32,
    /// Plain f32 on the CUDA cores (no tensor cores).
    Fp32,
}

impl MathDtype {
    /// The math trainkit's CUDA products run for a compute dtype: bf16 and fp16 on tensor
    /// cores, f32 on the CUDA cores, or on TF32 tensor cores where `tf32` allows it
    /// ([`crate::config::TrainingConfig::tf32`]).
    pub fn of_products(dtype: crate::tensor::DType, tf32: bool) -> MathDtype {
        match dtype {
            crate::tensor::DType::Bf16 => MathDtype::Bf16,
            crate::tensor::DType::F16 => MathDtype::Fp16,
            _ if tf32 => MathDtype::Tf32,
            _ => MathDtype::Fp32,
        }
    }
}

/// Peak dense throughput of one GPU model, in FLOP/s per format (`None`: no such math).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuPeak {
    /// The model, as it reads in CUDA device names.
    pub name: &'static str,
    /// Substrings of the CUDA device name that identify it (any one, ignoring case, not
    /// inside a longer word or number).
    pub matches: &'static [&'static str],
    /// bf16 tensor-core peak.
    pub bf16: Option<f64>,
    /// fp16 tensor-core peak.
    pub fp16: Option<f64>,
    /// TF32 tensor-core peak.
    pub tf32: Option<f64>,
    /// f32 CUDA-core peak.
    pub fp32: Option<f64>,
    /// Where the figures come from.
    pub source: &'static str,
}

impl GpuPeak {
    /// The peak for one format.
    pub fn get(&self, dtype: MathDtype) -> Option<f64> {
        match dtype {
            MathDtype::Bf16 => self.bf16,
            MathDtype::Fp16 => self.fp16,
            MathDtype::Tf32 => self.tf32,
            MathDtype::Fp32 => self.fp32,
        }
    }
}

const T: f64 = 1e12;

const fn gpu(
    name: &'static str,
    matches: &'static [&'static str],
    tensor16: [Option<f64>; 2],
    tf32: Option<f64>,
    fp32: Option<f64>,
    source: &'static str,
) -> GpuPeak {
    GpuPeak {
        name,
        matches,
        bf16: tensor16[0],
        fp16: tensor16[1],
        tf32,
        fp32,
        source,
    }
}

const fn both(x: f64) -> [Option<f64>; 2] {
    [Some(x * T), Some(x * T)]
}

const fn tf(x: f64) -> Option<f64> {
    Some(x * T)
}

/// Peak dense throughput of common NVIDIA GPUs. Earlier entries win, so a variant with
/// its own figures comes before the family name that would also match it.
pub const GPU_PEAKS: &[GpuPeak] = &[
    gpu(
        "H100 NVL",
        &["H100 NVL"],
        both(835.5),
        tf(417.5),
        tf(60.0),
        "NVIDIA H100 datasheet (NVL column, per GPU): 1671 bf16/fp16 and 835 TF32 TFLOP/s \
         with sparsity, halved",
    ),
    gpu(
        "H100 PCIe",
        &["H100 PCIe"],
        both(756.5),
        tf(378.0),
        tf(51.0),
        "NVIDIA H100 datasheet (PCIe column): 1513 bf16/fp16 and 756 TF32 TFLOP/s with \
         sparsity, halved",
    ),
    gpu(
        "H100 SXM",
        &["H100 SXM", "H100 80GB HBM3", "H100"],
        both(989.5),
        tf(494.5),
        tf(67.0),
        "NVIDIA H100 datasheet (SXM column): 1979 bf16/fp16 and 989 TF32 TFLOP/s with \
         sparsity, halved; any other H100 is taken as the SXM part",
    ),
    gpu(
        "GH200",
        &["GH200"],
        both(989.5),
        tf(494.5),
        tf(67.0),
        "NVIDIA GH200 datasheet: the H100 SXM's tensor-core rates",
    ),
    gpu(
        "H200 NVL",
        &["H200 NVL"],
        both(835.5),
        tf(417.5),
        tf(60.0),
        "NVIDIA H200 datasheet (NVL column): 1671 bf16/fp16 and 835 TF32 TFLOP/s with \
         sparsity, halved",
    ),
    gpu(
        "H200",
        &["H200"],
        both(989.5),
        tf(494.5),
        tf(67.0),
        "NVIDIA H200 datasheet (SXM column): 1979 bf16/fp16 and 989 TF32 TFLOP/s with \
         sparsity, halved",
    ),
    gpu(
        "A100",
        &["A100"],
        both(312.0),
        tf(156.0),
        tf(19.5),
        "NVIDIA A100 datasheet (SXM and PCIe, 40 and 80 GB alike)",
    ),
    gpu(
        "A10G",
        &["A10G"],
        both(70.0),
        tf(35.0),
        tf(35.0),
        "no NVIDIA datasheet (an AWS-only part); the figures AWS users report for it, \
         about half the A10's tensor rate",
    ),
    gpu(
        "A10",
        &["A10"],
        both(125.0),
        tf(62.5),
        tf(31.2),
        "NVIDIA A10 datasheet",
    ),
    gpu(
        "L40S",
        &["L40S"],
        both(362.05),
        tf(183.0),
        tf(91.6),
        "NVIDIA L40S datasheet",
    ),
    gpu(
        "L40",
        &["L40"],
        both(181.05),
        tf(90.5),
        tf(90.5),
        "NVIDIA L40 datasheet",
    ),
    gpu(
        "L4",
        &["L4"],
        both(121.0),
        tf(60.0),
        tf(30.3),
        "NVIDIA L4 datasheet: 242 bf16/fp16 and 120 TF32 TFLOP/s with sparsity, halved",
    ),
    gpu(
        "RTX 4090 D",
        &["RTX 4090 D"],
        [None, None],
        None,
        None,
        "a variant with fewer cores than the RTX 4090; not listed",
    ),
    gpu(
        "RTX 4090",
        &["RTX 4090"],
        both(165.2),
        tf(82.6),
        tf(82.6),
        "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): fp16/bf16 with fp32 \
         accumulate; fp16 accumulate is 330.3",
    ),
    gpu(
        "RTX 3090 Ti",
        &["RTX 3090 Ti"],
        [None, None],
        None,
        None,
        "faster than the RTX 3090 and not in the Ampere whitepaper; not listed",
    ),
    gpu(
        "RTX 3090",
        &["RTX 3090"],
        both(71.0),
        tf(35.6),
        tf(35.6),
        "NVIDIA Ampere GA102 whitepaper (RTX 3090): fp16/bf16 with fp32 accumulate; fp16 \
         accumulate is 142",
    ),
    gpu(
        "V100S",
        &["V100S"],
        [None, tf(130.0)],
        None,
        tf(16.4),
        "NVIDIA V100S datasheet (no bf16 or TF32 on Volta)",
    ),
    gpu(
        "V100 PCIe",
        &["V100-PCIE", "V100 PCIe"],
        [None, tf(112.0)],
        None,
        tf(14.0),
        "NVIDIA V100 datasheet (PCIe column; no bf16 or TF32 on Volta)",
    ),
    gpu(
        "V100 SXM2",
        &["V100"],
        [None, tf(125.0)],
        None,
        tf(15.7),
        "NVIDIA V100 datasheet (SXM2 column; no bf16 or TF32 on Volta); any other V100 \
         is taken as the SXM2 part",
    ),
    gpu(
        "T4",
        &["T4"],
        [None, tf(65.0)],
        None,
        tf(8.1),
        "NVIDIA T4 datasheet: mixed fp16/fp32 (no bf16 or TF32 on Turing)",
    ),
];

/// Whether `needle` occurs in `haystack` (ignoring ASCII case) with no letter or digit
/// right before or after it.
fn contains_word(haystack: &str, needle: &str) -> bool {
    let (h, n) = (haystack.to_ascii_lowercase(), needle.to_ascii_lowercase());
    let bytes = h.as_bytes();
    h.match_indices(&n).any(|(at, _)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + n.len()).copied();
        !before.is_some_and(|b| b.is_ascii_alphanumeric())
            && !after.is_some_and(|b| b.is_ascii_alphanumeric())
    })
}

/// The table entry a CUDA device name (`NVIDIA H100 80GB HBM3`, `Tesla T4`, ...) matches.
pub fn gpu_peak(device_name: &str) -> Option<&'static GpuPeak> {
    GPU_PEAKS
        .iter()
        .find(|g| g.matches.iter().any(|m| contains_word(device_name, m)))
}

/// Peak dense FLOP/s of the GPU a CUDA device name names, for one number format; `None`
/// for an unknown GPU or a format it has no fast path for (bf16 on a V100).
pub fn peak_flops(device_name: &str, dtype: MathDtype) -> Option<f64> {
    gpu_peak(device_name)?.get(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tflops(name: &str, dtype: MathDtype) -> Option<f64> {
        peak_flops(name, dtype).map(|f| f / T)
    }

    #[test]
    fn cuda_device_names_find_their_peaks() {
        use MathDtype::*;
        for (device, dtype, want) in [
            ("NVIDIA H100 80GB HBM3", Bf16, Some(989.5)),
            ("NVIDIA H100 PCIe", Bf16, Some(756.5)),
            ("NVIDIA H100 NVL", Bf16, Some(835.5)),
            ("NVIDIA H200", Bf16, Some(989.5)),
            ("NVIDIA GH200 480GB", Tf32, Some(494.5)),
            ("NVIDIA A100-SXM4-80GB", Bf16, Some(312.0)),
            ("NVIDIA A100-PCIE-40GB", Tf32, Some(156.0)),
            ("NVIDIA A10G", Bf16, Some(70.0)),
            ("NVIDIA A10", Bf16, Some(125.0)),
            ("NVIDIA L4", Bf16, Some(121.0)),
            ("NVIDIA L40S", Bf16, Some(362.05)),
            ("NVIDIA GeForce RTX 4090", Bf16, Some(165.2)),
            ("NVIDIA GeForce RTX 3090", Bf16, Some(71.0)),
            ("NVIDIA GeForce RTX 3090 Ti", Bf16, None),
            ("Tesla V100-SXM2-16GB", Fp16, Some(125.0)),
            ("Tesla V100-SXM2-16GB", Bf16, None),
            ("Tesla V100-PCIE-32GB", Fp16, Some(112.0)),
            ("Tesla T4", Fp16, Some(65.0)),
            ("Tesla T4", Fp32, Some(8.1)),
            ("NVIDIA RTX 6000 Ada Generation", Bf16, None),
            ("", Bf16, None),
        ] {
            assert_eq!(tflops(device, dtype), want, "{device} {dtype:?}");
        }
    }

    #[test]
    fn every_entry_is_reachable_by_its_own_name() {
        for g in GPU_PEAKS {
            let found = gpu_peak(&format!("NVIDIA {}", g.matches[0])).unwrap();
            assert_eq!(found.name, g.name);
        }
    }

    #[test]
    fn flops_and_mfu() {
        // GPT-2 small at 1024 tokens: 6N + 6·L·h·s.
        let f = flops_per_token(124_439_808, 12, 768, 1024);
        assert_eq!(f, 6.0 * 124_439_808.0 + 6.0 * 12.0 * 768.0 * 1024.0);
        let gpt2 = crate::model::Gpt2Config::gpt2_124m();
        let model = crate::model::Gpt2::new(gpt2).unwrap();
        assert_eq!(crate::model::Model::flops_per_token(&model, 1024), f);
        assert!((mfu(1000.0, 1e9, 4e12) - 0.25).abs() < 1e-12);
        assert_eq!(mfu(1000.0, 1e9, 0.0), 0.0);
    }

    #[test]
    fn a_run_compares_with_the_peak_of_its_compute_dtype() {
        use crate::tensor::DType;
        let h100 = "NVIDIA H100 80GB HBM3 (sm_90; cuBLASLt 13.0)";
        let of = |d: DType| tflops(h100, MathDtype::of_products(d, false));
        assert_eq!(of(DType::Bf16), Some(989.5));
        assert_eq!(of(DType::F16), Some(989.5));
        assert_eq!(of(DType::F32), tflops(h100, MathDtype::Fp32));
        assert!(of(DType::F32).unwrap() < 100.0);
        // With TF32 allowed f32 products compare with the TF32 peak; bf16's stay bf16.
        let tf32 = |d: DType| tflops(h100, MathDtype::of_products(d, true));
        assert_eq!(tf32(DType::F32), Some(494.5));
        assert_eq!(tf32(DType::Bf16), Some(989.5));
    }
}
