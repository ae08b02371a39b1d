//! The fused AdamW update (PyTorch semantics), reading the step's gradient multiplier on
//! the device and writing the bf16 or f16 compute copy in the same pass.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/adamw.cu`, listed once in
//! [`KERNELS`].

use super::{AdamWStep, AdamWTensor};
use crate::device::cuda::ops::elementwise::launch_cast;
use crate::device::cuda::{device_ptr as ptr, Args, CudaBackend, KernelFile, BLOCK};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The kernels of `kernels/adamw.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "adamw.cu",
    source: include_str!("../../../kernels/adamw.cu"),
    kernels: &[
        "adamw_f32_bf16",
        "adamw_f32_f16",
        "adamw_bf16_bf16",
        "adamw_f16_f16",
        "adamw_f32_bf16_bf16m",
        "adamw_bf16_bf16_bf16m",
        "adamw_multi_f32_bf16",
        "adamw_multi_f32_f16",
        "adamw_multi_bf16_bf16",
        "adamw_multi_f16_f16",
        "adamw_multi_f32_bf16_bf16m",
        "adamw_multi_bf16_bf16_bf16m",
    ],
};
inventory::submit!(KERNELS);

/// The kernel suffix `{G}_{C}` for a gradient of dtype `grad` and the device pointer of the
/// compute copy the kernel writes in its pass (0 for none), or, for a copy no kernel
/// writes (f32, or a 16-bit dtype other than a 16-bit gradient's), the copy to cast after.
pub(crate) fn compute_copy(
    grad: DType,
    compute: Option<&mut Tensor>,
) -> Result<(String, u64, Option<&mut Tensor>)> {
    let half = |d: DType| matches!(d, DType::Bf16 | DType::F16);
    Ok(match compute {
        Some(c) if half(c.dtype()) && (grad == DType::F32 || grad == c.dtype()) => {
            (format!("{grad}_{}", c.dtype()), ptr(c)?, None)
        }
        other => {
            let c = if half(grad) { grad } else { DType::Bf16 };
            (format!("{grad}_{c}"), 0, other)
        }
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    be: &CudaBackend,
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
    let n = param.numel();
    let scale = match scale {
        Some(s) => ptr(s)?,
        None => 0,
    };
    if n == 0 {
        return Ok(());
    }
    // The kernel writes a 16-bit compute copy in its pass; another is cast after.
    let (suffix, fused, after) = compute_copy(grad.dtype(), compute)?;
    // bf16 moments (with an f32 or bf16 gradient: the shared check).
    let moments = if m.dtype() == DType::Bf16 {
        "_bf16m"
    } else {
        ""
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    be.launch(
        &format!("adamw_{suffix}{moments}"),
        be.grid(n),
        BLOCK,
        Args::new()
            .ptr(ptr(param)?)
            .ptr(ptr(grad)?)
            .ptr(ptr(m)?)
            .ptr(ptr(v)?)
            .ptr(scale)
            .ptr(fused)
            .i64(n)
            .f32(hp.beta1)
            .f32(hp.beta2)
            .f32(hp.eps)
            .f32(hp.grad_scale)
            .f32(step_size)
            .f32(bc2_sqrt)
            .f32(decay),
    )?;
    match after {
        Some(c) => launch_cast(be, c, param),
        None => Ok(()),
    }
}

/// Tensors a launch of `adamw_multi_*` takes (the kernels' TK_ADAMW_TENSORS).
const MULTI_TENSORS: usize = 32;
/// Elements a block of `adamw_multi_*` updates (the kernels' TK_ADAMW_CHUNK).
const MULTI_CHUNK: usize = 2048;

/// One tensor of an `adamw_multi_*` launch: the kernels' `AdamWTensor`.
struct Entry {
    /// Device pointers: value, gradient, moments, compute copy (0 for none).
    ptrs: [u64; 5],
    n: usize,
    decay: f32,
}

/// The kernels' `AdamWTable` for `entries` (at most [`MULTI_TENSORS`]), as the launch
/// passes it by value: per tensor five pointers, `n` (i64), its decay factor (f32) and 4
/// unused bytes; then the count (i64).
fn table(entries: &[Entry]) -> Vec<u8> {
    let mut b = Vec::with_capacity(MULTI_TENSORS * 56 + 8);
    for i in 0..MULTI_TENSORS {
        match entries.get(i) {
            Some(e) => {
                for p in e.ptrs {
                    b.extend(p.to_le_bytes());
                }
                b.extend((e.n as i64).to_le_bytes());
                b.extend(e.decay.to_bits().to_le_bytes());
                b.extend(0u32.to_le_bytes());
            }
            None => b.extend([0u8; 56]),
        }
    }
    b.extend((entries.len() as i64).to_le_bytes());
    b
}

/// [`update`] of many tensors, those of the same dtypes [`MULTI_TENSORS`] to a launch of
/// `adamw_multi_*` (each element updated as `adamw_*` updates it); a tensor whose compute
/// copy no kernel writes in its pass goes through [`update`] and its cast.
pub(crate) fn update_many(
    be: &CudaBackend,
    tensors: &mut [AdamWTensor<'_>],
    hp: &AdamWStep,
    scale: Option<&Tensor>,
) -> Result<()> {
    let scale_ptr = match scale {
        Some(s) => ptr(s)?,
        None => 0,
    };
    let (step_size, bc2_sqrt, decay) = hp.constants();
    let no_decay = AdamWStep {
        weight_decay: 0.0,
        ..*hp
    };
    let no_decay_factor = no_decay.constants().2;
    // The kernel of each group and its tensors, in the order first met.
    let mut groups: Vec<(String, Vec<Entry>)> = Vec::new();
    for t in tensors.iter_mut() {
        let n = t.param.numel();
        if n == 0 {
            continue;
        }
        let moments = if t.m.dtype() == DType::Bf16 {
            "_bf16m"
        } else {
            ""
        };
        let (suffix, fused, after) = compute_copy(t.grad.dtype(), t.compute.as_deref_mut())?;
        if after.is_some() {
            let hp = if t.decays { *hp } else { no_decay };
            update(
                be,
                t.param,
                t.grad,
                t.m,
                t.v,
                &hp,
                scale,
                t.compute.as_deref_mut(),
            )?;
            continue;
        }
        let entry = Entry {
            ptrs: [ptr(t.param)?, ptr(t.grad)?, ptr(t.m)?, ptr(t.v)?, fused],
            n,
            decay: if t.decays { decay } else { no_decay_factor },
        };
        let kernel = format!("adamw_multi_{suffix}{moments}");
        match groups.iter_mut().find(|(k, _)| *k == kernel) {
            Some((_, entries)) => entries.push(entry),
            None => groups.push((kernel, vec![entry])),
        }
    }
    for (kernel, entries) in &groups {
        for part in entries.chunks(MULTI_TENSORS) {
            let blocks: usize = part.iter().map(|e| e.n.div_ceil(MULTI_CHUNK)).sum();
            let grid = u32::try_from(blocks).map_err(|_| crate::error::Error::Backend {
                backend: "cuda",
                message: format!(
                    "adamw: {blocks} blocks of {MULTI_CHUNK} elements are more than one \
                         launch takes"
                ),
            })?;
            be.launch(
                kernel,
                grid,
                BLOCK,
                Args::new()
                    .bytes(&table(part))
                    .ptr(scale_ptr)
                    .f32(hp.beta1)
                    .f32(hp.beta2)
                    .f32(hp.eps)
                    .f32(hp.grad_scale)
                    .f32(step_size)
                    .f32(bc2_sqrt),
            )?;
        }
    }
    Ok(())
}
