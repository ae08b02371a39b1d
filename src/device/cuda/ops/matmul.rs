//! Matrix products through cuBLASLt (the `Gpu` layer's `gemm`), with the bias and GELU
//! epilogues; a product cuBLASLt has no algorithm for runs as the plain kernel of
//! `kernels/matmul.cu`.
//!
//! CPU twin: `src/device/cpu/matmul.rs`.

use super::super::backend::{ptr, CudaBackend, BLOCK};
use super::super::gpu::{Args, DevicePtr, Gemm, GemmRun, MatrixLayout, MatrixType};
use super::super::KernelFile;
use super::elementwise::launch_cast;
use crate::device::cpu::{self, ensure};
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};
use std::sync::atomic::Ordering;

/// The kernels of `kernels/matmul.cu`: the plain product, per operand and output type.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "matmul.cu",
    source: include_str!("../../../../kernels/matmul.cu"),
    kernels: &[
        "gemm_plain_f32_f32",
        "gemm_plain_bf16_bf16",
        "gemm_plain_bf16_f32",
        "gemm_plain_f16_f16",
        "gemm_plain_f16_f32",
    ],
};
inventory::submit!(KERNELS);

/// The cuBLASLt workspace (allocated once, in the ledger).
pub(crate) fn gemm_workspace(be: &CudaBackend) -> Result<(DevicePtr, usize)> {
    let bytes = be.gpu.gemm_workspace_bytes();
    if bytes == 0 {
        return Ok((0, 0));
    }
    let mut w = be.gemm_workspace.lock().unwrap_or_else(|p| p.into_inner());
    if w.is_none() {
        *w = Some(be.scratch(bytes, "cublaslt.workspace")?);
    }
    let t = w.as_ref().expect("set above");
    Ok((ptr(t)?, bytes))
}

/// What a product's epilogue does beyond `op(a)·op(b)`: none of these, or one of them (the
/// GELU with its bias).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Epilogue {
    /// The address of the pre-GELU values when the epilogue applies GELU (0: no GELU).
    pub gelu_aux: DevicePtr,
    /// The address of the pre-GELU values when the epilogue multiplies the product by
    /// GELU's derivative there (0: no such epilogue).
    pub dgelu_aux: DevicePtr,
    /// Where the epilogue writes the sums of one operand over the product's inner
    /// dimension (0: none), in `out`'s dtype: of `op(b)`, one per column of `out`, or with
    /// `bias_grad_of_a` of `op(a)`, one per row of `out`.
    pub bias_grad: DevicePtr,
    /// See `bias_grad`.
    pub bias_grad_of_a: bool,
    /// A tensor of `out`'s dtype and shape added to the product (cuBLASLt's C with beta
    /// 1, D being `out`), or 0 for none. Not with accumulation into `out`.
    pub c: DevicePtr,
}

/// The product of [`Backend::matmul_kernel`] on checked operands, with `epilogue`'s extras
/// (the caller checks the fused form applies).
///
/// [`Backend::matmul_kernel`]: crate::device::Backend::matmul_kernel
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    be: &CudaBackend,
    out: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    epilogue: Epilogue,
) -> Result<()> {
    let (m, n, k) = cpu::matmul::shape(a, b, trans_a, trans_b);
    if m == 0 || n == 0 {
        return Ok(());
    }
    ensure(k > 0, "matmul", || {
        format!(
            "`{}` and `{}` have an empty inner dimension",
            a.label(),
            b.label()
        )
    })?;
    let operand = operand_dtype(a, b);
    let a = be.as_dtype(a, operand)?;
    let b = be.as_dtype(b, operand)?;
    if through_f32(operand, out.dtype()) {
        // f32 operands into bf16 or f16: the product in f32, then added or cast.
        let mut tmp = be.alloc(
            out.shape(),
            DType::F32,
            MemoryCategory::Workspace,
            &format!("{}.f32", out.label()),
            false,
        )?;
        if epilogue.bias_grad != 0 || epilogue.c != 0 {
            return Err(Error::Backend {
                backend: "cuda",
                message: "a bias-gradient epilogue or an added C takes no f32 operands into \
                          a 16-bit output"
                    .into(),
            });
        }
        gemm(
            be, &mut tmp, &a, &b, bias, trans_a, trans_b, false, epilogue,
        )?;
        return if accumulate {
            let n_el = out.numel();
            let o = ptr(out)?;
            let t = out.dtype();
            be.launch(
                &format!("add_{t}_{t}_f32"),
                be.grid(n_el),
                BLOCK,
                Args::new().ptr(o).ptr(o).ptr(ptr(&tmp)?).i64(n_el),
            )
        } else {
            launch_cast(be, out, &tmp)
        };
    }
    let bias = match bias {
        Some(t) => Some(be.as_dtype(t, out.dtype())?),
        None => None,
    };
    // Row-major X[r, c] is column-major Xᵀ (r columns of c): out = op(a)·op(b) is
    // outᵀ = op(b)ᵀ·op(a)ᵀ, so cuBLASLt's A is our b and its B is our a, each with its
    // own transpose flag, and D is outᵀ, n × m.
    let colmajor = |t: &Tensor| -> Result<MatrixLayout> {
        let (r, c) = t.rows_cols();
        Ok(MatrixLayout {
            ty: MatrixType::try_from(t.dtype())?,
            rows: c as u64,
            cols: r as u64,
            ld: c as i64,
        })
    };
    let (workspace, workspace_bytes) = gemm_workspace(be)?;
    let g = Gemm {
        trans_a: trans_b,
        trans_b: trans_a,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        a: ptr(&b)?,
        a_layout: colmajor(&b)?,
        b: ptr(&a)?,
        b_layout: colmajor(&a)?,
        d: ptr(out)?,
        c: epilogue.c,
        d_layout: colmajor(out)?,
        bias: match &bias {
            Some(t) => ptr(t)?,
            None => 0,
        },
        gelu_aux: epilogue.gelu_aux,
        dgelu_aux: epilogue.dgelu_aux,
        // cuBLASLt's A is our b and its B our a.
        bias_grad: epilogue.bias_grad,
        bias_grad_of_b: epilogue.bias_grad_of_a,
        alpha: 1.0,
        beta: if accumulate || epilogue.c != 0 {
            1.0
        } else {
            0.0
        },
        allow_tf32: be.options.allow_tf32,
        workspace,
        workspace_bytes,
    };
    // SAFETY: the layouts are the tensors' own shapes, checked above.
    match unsafe { be.gpu.gemm(&g) }.map_err(|e| be.explain(e))? {
        GemmRun::Done => Ok(()),
        // The callers of an epilogue run the product and the epilogue apart.
        GemmRun::NoAlgorithm if g.gelu_aux != 0 || g.dgelu_aux != 0 || g.bias_grad != 0 => {
            Err(Error::Backend {
                backend: "cuda",
                message: "cuBLASLt has no algorithm for this product with its epilogue".into(),
            })
        }
        GemmRun::NoAlgorithm if g.c != 0 => {
            // The plain kernel adds to D: D takes C's values first.
            be.gpu.copy(g.d, g.c, g.d_layout.bytes())?;
            plain_gemm(be, &Gemm { c: 0, ..g })
        }
        GemmRun::NoAlgorithm => plain_gemm(be, &g),
    }
}

/// The product `g` by the plain kernel (`kernels/matmul.cu`), for one cuBLASLt has no
/// algorithm for (said once per process).
fn plain_gemm(be: &CudaBackend, g: &Gemm) -> Result<()> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        log::warn!(
            "cuBLASLt has no algorithm for a product ({:?} × {:?} → {:?}); such products run \
             as trainkit's plain kernel, more slowly",
            g.a_layout,
            g.b_layout,
            g.d_layout
        );
    }
    let name = |t: MatrixType| match t {
        MatrixType::F32 => "f32",
        MatrixType::Bf16 => "bf16",
        MatrixType::F16 => "f16",
    };
    let kernel = format!("gemm_plain_{}_{}", name(g.a_layout.ty), name(g.d_layout.ty));
    const TILE: u64 = 16;
    let tiles = g.m.div_ceil(TILE) * g.n.div_ceil(TILE);
    be.launch(
        &kernel,
        be.grid(tiles as usize * BLOCK as usize),
        BLOCK,
        Args::new()
            .i32(g.trans_a as i32)
            .i32(g.trans_b as i32)
            .i64(g.m as usize)
            .i64(g.n as usize)
            .i64(g.k as usize)
            .ptr(g.a)
            .i64(g.a_layout.ld as usize)
            .ptr(g.b)
            .i64(g.b_layout.ld as usize)
            .ptr(g.d)
            .i64(g.d_layout.ld as usize)
            .ptr(g.bias)
            .f32(g.alpha)
            .f32(g.beta),
    )
}

/// [`crate::ops::linear::matmul_bias_gelu`] with cuBLASLt's GELU epilogue: `Ok(true)`
/// when it wrote both outputs, `Ok(false)` when the fused form does not apply or the
/// library refused it (nothing written: the call runs the product and the GELU one after
/// the other).
pub(crate) fn matmul_bias_gelu(
    be: &CudaBackend,
    out: &mut Tensor,
    pre: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    bias: &Tensor,
) -> Result<bool> {
    // cuBLASLt's GELU_AUX_BIAS epilogue writes both outputs from the accumulator:
    // when the operands are of one dtype (or bf16 into f32), both outputs share D's
    // dtype and shape, and the rows are a multiple of 8 elements (the aux's leading
    // dimension). Otherwise the product and the GELU run as two ops.
    let operand = operand_dtype(a, b);
    let (_, cols) = pre.rows_cols();
    let fused = out.dtype() == pre.dtype()
        && out.shape() == pre.shape()
        && !through_f32(operand, pre.dtype())
        && cols % 8 == 0
        && be.gelu_epilogue.load(Ordering::Relaxed);
    if fused {
        let aux = ptr(pre)?;
        let epilogue = Epilogue {
            gelu_aux: aux,
            ..Epilogue::default()
        };
        match gemm(be, out, a, b, Some(bias), false, false, false, epilogue) {
            Ok(()) => return Ok(true),
            // Nothing was written: say so once and run the two ops, which report the
            // error again if it was not the epilogue's.
            Err(e) => {
                if be.gelu_epilogue.swap(false, Ordering::Relaxed) {
                    log::warn!(
                        "cuBLASLt ran no product with the GELU epilogue ({e}); the MLP's \
                         product and GELU now run as two ops"
                    );
                }
            }
        }
    }
    Ok(false)
}

/// [`crate::ops::linear::matmul_dgelu`] with cuBLASLt's DGELU epilogue: `dpre = gelu'(pre)
/// ⊙ (dy · op(w))` from the accumulator in one product. `Ok(true)` when it wrote
/// `dpre`, `Ok(false)` when the fused form does not apply or the library refused it
/// (nothing written: the call runs the product and the GELU's backward in place).
pub(crate) fn matmul_dgelu(
    be: &CudaBackend,
    dpre: &mut Tensor,
    dy: &Tensor,
    w: &Tensor,
    pre: &Tensor,
    trans_w: bool,
) -> Result<bool> {
    // The aux (pre) shares D's dtype, shape and leading dimension (a multiple of 8).
    let operand = operand_dtype(dy, w);
    let (_, cols) = dpre.rows_cols();
    let fused = dpre.dtype() == pre.dtype()
        && dpre.shape() == pre.shape()
        && !through_f32(operand, dpre.dtype())
        && cols % 8 == 0
        && be.dgelu_epilogue.load(Ordering::Relaxed);
    if !fused {
        return Ok(false);
    }
    let epilogue = Epilogue {
        dgelu_aux: ptr(pre)?,
        ..Epilogue::default()
    };
    match gemm(be, dpre, dy, w, None, false, trans_w, false, epilogue) {
        Ok(()) => Ok(true),
        Err(e) => {
            if be.dgelu_epilogue.swap(false, Ordering::Relaxed) {
                log::warn!(
                    "cuBLASLt ran no product with the GELU-gradient epilogue ({e}); the \
                     MLP's input gradient and the GELU's backward now run as two ops"
                );
            }
            Ok(false)
        }
    }
}

/// [`crate::ops::linear::matmul_residual`] as one product: `y = x · op(w) (+ bias) +
/// residual`, the residual read as cuBLASLt's C (beta 1, D being `y`), so that the sum is
/// rounded once, from the f32 accumulator, and the residual add is no pass of its own.
/// `Ok(true)` when it wrote `y`, `Ok(false)` when the form does not apply (the residual
/// in another dtype or shape than `y`, f32 operands into a 16-bit `y`, an empty `y`):
/// nothing was written, and the call runs the product and the add one after the other.
pub(crate) fn matmul_residual(
    be: &CudaBackend,
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    trans_w: bool,
) -> Result<bool> {
    let operand = operand_dtype(x, w);
    let fused = residual.dtype() == y.dtype()
        && residual.shape() == y.shape()
        && !through_f32(operand, y.dtype())
        && y.numel() > 0;
    if !fused {
        return Ok(false);
    }
    let epilogue = Epilogue {
        c: ptr(residual)?,
        ..Epilogue::default()
    };
    gemm(be, y, x, w, bias, false, trans_w, false, epilogue)?;
    Ok(true)
}

/// Whether a product of `operand` operands into an `out` output runs through an f32
/// temporary (f32 operands into bf16 or f16: cuBLASLt writes f32, cast or added after),
/// which carries no epilogue and no C of its own.
fn through_f32(operand: DType, out: DType) -> bool {
    operand == DType::F32 && out != DType::F32
}

/// The dtype both operands of a product are brought to: cuBLASLt multiplies equal
/// operand types (bf16 × bf16 may write f32 or bf16, f32 × f32 writes f32), so mixed
/// operands are multiplied in f32.
fn operand_dtype(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == b.dtype() {
        a.dtype()
    } else {
        DType::F32
    }
}

/// [`crate::ops::linear::weight_bias_grad`]: the weight gradient's product with cuBLASLt's
/// bias-gradient epilogue (`BGRADA` when `dy` is cuBLASLt's A, `BGRADB` when it is its B),
/// which sums `dy` over the rows while it multiplies, into a workspace vector that is then
/// added to `dbias`. `Ok(false)` when the fused form does not apply (operands of two
/// dtypes, gradients of two dtypes) or the library refused it: nothing was written, and
/// the call runs the product and the bias gradient one after the other.
pub(crate) fn weight_bias_grad(
    be: &CudaBackend,
    dw: &mut Tensor,
    dbias: &mut Tensor,
    x: &Tensor,
    dy: &Tensor,
    transposed: bool,
) -> Result<bool> {
    let fused = x.dtype() == dy.dtype()
        && dbias.dtype() == dw.dtype()
        && !through_f32(x.dtype(), dw.dtype())
        && dw.numel() > 0
        && dy.numel() > 0
        && be.bias_grad_epilogue.load(Ordering::Relaxed);
    if !fused {
        return Ok(false);
    }
    let n = dbias.numel();
    let sums = be.alloc(
        &[n],
        dbias.dtype(),
        MemoryCategory::Workspace,
        &format!("{}.sums", dbias.label()),
        false,
    )?;
    // dW = op(a)·b with a = x (dy = b: its column sums) or, for weights stored [out, in],
    // a = dy (op(a) = dyᵀ: its row sums).
    let (a, b) = if transposed { (dy, x) } else { (x, dy) };
    let epilogue = Epilogue {
        bias_grad: ptr(&sums)?,
        bias_grad_of_a: transposed,
        ..Epilogue::default()
    };
    if let Err(e) = gemm(be, dw, a, b, None, true, false, true, epilogue) {
        // Nothing was written: say so once and run the two ops, which report the error
        // again if it was not the epilogue's.
        if be.bias_grad_epilogue.swap(false, Ordering::Relaxed) {
            log::warn!(
                "cuBLASLt ran no product with the bias-gradient epilogue ({e}); weight and \
                 bias gradients now run as two ops"
            );
        }
        return Ok(false);
    }
    let t = dbias.dtype();
    let d = ptr(dbias)?;
    be.launch(
        &format!("add_{t}_{t}_{t}"),
        be.grid(n),
        BLOCK,
        Args::new().ptr(d).ptr(d).ptr(ptr(&sums)?).i64(n),
    )?;
    Ok(true)
}
