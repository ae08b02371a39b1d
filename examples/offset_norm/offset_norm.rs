//! A fused op written outside trainkit, with kernels of its own, put into an existing
//! model family without retyping the model: Gemma's RMS norm, whose gain is stored as an
//! offset from one, `out = x · rstd · (1 + w)` with `rstd = 1/√(mean(x²) + eps)`.
//!
//! It is what a downstream crate writes against trainkit's public kernel door:
//! - two kernel calls ([`forward`], [`backward`]), each an [`OpKernel`]: its operand check,
//!   its FLOPs, its CPU twin and its CUDA launch; [`Backend::run`] records its ledger span
//!   and dispatches it to whichever backend holds the tensors;
//! - the CUDA C source ([`KERNELS`]), templated over the activation and gradient dtypes
//!   (f32, bf16, f16), loaded by [`CudaBackend::load_kernels`] and launched by
//!   [`CudaBackend::launch_kernel`] with one thread per row (forward, input gradient) or per
//!   column (weight gradient);
//! - a graph node ([`OffsetRmsNorm`]) and an [`OpOverride`] ([`OffsetNorms`]) that puts it
//!   in place of every RMS norm of a Llama (`Llama::with_override`).
//!
//! Sums run in the same order in both twins and NVRTC keeps every rounding (`--fmad=false`),
//! so the CUDA kernels give the CPU's results bit for bit.

use trainkit::device::cpu::{read, write};
use trainkit::device::cuda::{device_ptr, Args, CudaBackend, KernelFile, BLOCK};
use trainkit::device::{Backend, CpuBackend, OpKernel};
use trainkit::model::OpOverride;
use trainkit::ops::{downcast, BackwardCx, ForwardCx, Op, RmsNorm, Saves};
use trainkit::{DType, Error, Result, Tensor};

/// The CUDA kernels, compiled on first use (trainkit prepends its `common.cuh`, which
/// gives `i64`, `bf16`, `f16`, `load`, `store` and `TK_FOR_EACH`).
pub const KERNELS: KernelFile = KernelFile {
    name: "offset_rmsnorm.cu",
    source: r#"
// out[r, :] = x[r, :] * rstd[r] * (1 + w), one thread per row; rstd kept in f32.
template <typename T>
__device__ void forward_impl(T* out, float* rstd, const T* x, const T* w, i64 rows, i64 c,
                             float eps) {
    TK_FOR_EACH(r, rows) {
        const T* xr = x + r * c;
        float acc = 0.0f;
        for (i64 i = 0; i < c; i++) {
            const float v = load(xr, i);
            acc += v * v;
        }
        const float s = 1.0f / sqrtf(acc / (float)c + eps);
        for (i64 i = 0; i < c; i++) {
            store(out, r * c + i, load(xr, i) * s * (1.0f + load(w, i)));
        }
        rstd[r] = s;
    }
}

// dx[r, :] += rstd * (g·dy − x·k), g = 1 + w, k = mean(g·dy·x) · rstd², one thread per row.
template <typename T>
__device__ void dx_impl(T* dx, const T* dy, const T* x, const T* w, const float* rstd,
                        i64 rows, i64 c) {
    TK_FOR_EACH(r, rows) {
        const float s = rstd[r];
        float acc = 0.0f;
        for (i64 i = 0; i < c; i++) {
            acc += (1.0f + load(w, i)) * load(dy, r * c + i) * load(x, r * c + i);
        }
        const float k = acc / (float)c * s * s;
        for (i64 i = 0; i < c; i++) {
            const float g = s * ((1.0f + load(w, i)) * load(dy, r * c + i) - load(x, r * c + i) * k);
            store(dx, r * c + i, load(dx, r * c + i) + g);
        }
    }
}

// dw[i] += Σ_rows dy · x · rstd, rows in order, one thread per column.
template <typename T, typename G>
__device__ void dw_impl(G* dw, const T* dy, const T* x, const float* rstd, i64 rows, i64 c) {
    TK_FOR_EACH(i, c) {
        float acc = 0.0f;
        for (i64 r = 0; r < rows; r++) {
            acc += load(dy, r * c + i) * load(x, r * c + i) * rstd[r];
        }
        store(dw, i, load(dw, i) + acc);
    }
}

#define OFFSET_RMSNORM(T, N)                                                                   \
    extern "C" __global__ void offset_rmsnorm_##N(T* out, float* rstd, const T* x, const T* w, \
                                                  i64 rows, i64 c, float eps) {                \
        forward_impl(out, rstd, x, w, rows, c, eps);                                           \
    }                                                                                          \
    extern "C" __global__ void offset_rmsnorm_dx_##N(T* dx, const T* dy, const T* x,           \
                                                     const T* w, const float* rstd, i64 rows,  \
                                                     i64 c) {                                  \
        dx_impl(dx, dy, x, w, rstd, rows, c);                                                  \
    }
OFFSET_RMSNORM(float, f32)
OFFSET_RMSNORM(bf16, bf16)
OFFSET_RMSNORM(f16, f16)

#define OFFSET_RMSNORM_DW(T, N, G, M)                                                          \
    extern "C" __global__ void offset_rmsnorm_dw_##N##_##M(G* dw, const T* dy, const T* x,     \
                                                           const float* rstd, i64 rows,        \
                                                           i64 c) {                            \
        dw_impl(dw, dy, x, rstd, rows, c);                                                     \
    }
OFFSET_RMSNORM_DW(float, f32, float, f32)
OFFSET_RMSNORM_DW(bf16, bf16, float, f32)
OFFSET_RMSNORM_DW(bf16, bf16, bf16, bf16)
OFFSET_RMSNORM_DW(f16, f16, float, f32)
"#,
    kernels: &[
        "offset_rmsnorm_f32",
        "offset_rmsnorm_bf16",
        "offset_rmsnorm_f16",
        "offset_rmsnorm_dx_f32",
        "offset_rmsnorm_dx_bf16",
        "offset_rmsnorm_dx_f16",
        "offset_rmsnorm_dw_f32_f32",
        "offset_rmsnorm_dw_bf16_f32",
        "offset_rmsnorm_dw_bf16_bf16",
        "offset_rmsnorm_dw_f16_f32",
    ],
};

/// Normalizes each row of `x` (`[rows, C]`) into `out` with the gain `1 + weight` and
/// writes each row's reciprocal RMS to `rstd` (`[rows]` f32).
pub fn forward(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<()> {
    be.run(&mut Forward {
        out,
        rstd,
        x,
        weight,
        eps,
    })
}

/// Backward of [`forward`]: accumulates into `dx` and `dweight`.
pub fn backward(
    be: &(impl Backend + ?Sized),
    dx: &mut Tensor,
    dweight: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<()> {
    be.run(&mut Backward {
        dx,
        dweight,
        dout,
        x,
        weight,
        rstd,
    })
}

/// Fails with a shape error naming `op` unless `ok`.
fn ensure(ok: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::shape(op, message()))
    }
}

/// The shared operand check: `x` and the tensors shaped as it, `rstd` f32 with one value
/// per row, the weight and its gradient with one per column. Returns `(rows, C)`.
fn check(
    op: &'static str,
    like_x: &[&Tensor],
    x: &Tensor,
    rstd: &Tensor,
    weights: &[&Tensor],
) -> Result<(usize, usize)> {
    let (rows, c) = x.rows_cols();
    for t in like_x.iter().chain(weights).chain([&x, &rstd]) {
        ensure(t.dtype().is_float(), op, || {
            format!(
                "`{}` is {}: it takes f32, bf16 or f16",
                t.label(),
                t.dtype()
            )
        })?;
    }
    for t in like_x {
        ensure(t.shape() == x.shape(), op, || {
            format!("`{}` is {:?}, `x` is {:?}", t.label(), t.shape(), x.shape())
        })?;
    }
    ensure(
        rstd.shape() == [rows] && rstd.dtype() == DType::F32,
        op,
        || format!("`{}` must be [{rows}] f32", rstd.label()),
    )?;
    for t in weights {
        ensure(t.numel() == c, op, || {
            format!("`{}` has {} elements for rows of {c}", t.label(), t.numel())
        })?;
    }
    Ok((rows, c))
}

/// The device operands of a launch in `dtype`: each tensor, or a cast copy of it.
fn operands<'a>(
    be: &CudaBackend,
    dtype: DType,
    ts: &[&'a Tensor],
) -> Result<Vec<trainkit::device::cuda::Operand<'a>>> {
    ts.iter().map(|t| be.as_dtype(t, dtype)).collect()
}

struct Forward<'a> {
    out: &'a mut Tensor,
    rstd: &'a mut Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    eps: f32,
}

impl OpKernel for Forward<'_> {
    fn name(&self) -> &'static str {
        "offset_rmsnorm"
    }

    fn label(&self) -> &str {
        self.out.label()
    }

    fn check(&self) -> Result<()> {
        check(self.name(), &[self.out], self.x, self.rstd, &[self.weight]).map(drop)
    }

    fn flops(&self) -> u64 {
        5 * self.x.numel() as u64
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let (rows, c) = self.x.rows_cols();
        let (x, w) = (read(self.x), read(self.weight));
        let mut rstd = vec![0f32; rows];
        write(self.out, false, |out| {
            for r in 0..rows {
                let xr = &x[r * c..(r + 1) * c];
                let mut acc = 0f32;
                for v in xr {
                    acc += v * v;
                }
                let s = 1.0 / (acc / c as f32 + self.eps).sqrt();
                for i in 0..c {
                    out[r * c + i] = xr[i] * s * (1.0 + w[i]);
                }
                rstd[r] = s;
            }
        });
        write(self.rstd, false, |o| o.copy_from_slice(&rstd));
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        be.load_kernels(&KERNELS)?;
        let (rows, c) = self.x.rows_cols();
        let dt = self.x.dtype();
        if self.out.dtype() != dt {
            return Err(Error::shape("offset_rmsnorm", "`out` must have x's dtype"));
        }
        let w = operands(be, dt, &[self.weight])?;
        let args = Args::new()
            .ptr(device_ptr(self.out)?)
            .ptr(device_ptr(self.rstd)?)
            .ptr(device_ptr(self.x)?)
            .ptr(device_ptr(&w[0])?)
            .i64(rows)
            .i64(c)
            .f32(self.eps);
        // SAFETY: the arguments follow the kernel's parameters; the check gave every tensor
        // the sizes the kernel indexes (rows × c, rows, c).
        unsafe { be.launch_kernel(&format!("offset_rmsnorm_{dt}"), be.grid(rows), BLOCK, args) }
    }
}

struct Backward<'a> {
    dx: &'a mut Tensor,
    dweight: &'a mut Tensor,
    dout: &'a Tensor,
    x: &'a Tensor,
    weight: &'a Tensor,
    rstd: &'a Tensor,
}

impl OpKernel for Backward<'_> {
    fn name(&self) -> &'static str {
        "offset_rmsnorm_backward"
    }

    fn label(&self) -> &str {
        self.dx.label()
    }

    fn check(&self) -> Result<()> {
        let (like_x, weights) = ([&*self.dx, self.dout], [self.weight, &*self.dweight]);
        check(self.name(), &like_x, self.x, self.rstd, &weights).map(drop)
    }

    fn flops(&self) -> u64 {
        12 * self.x.numel() as u64
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let (rows, c) = self.x.rows_cols();
        let (x, d, w, s) = (
            read(self.x),
            read(self.dout),
            read(self.weight),
            read(self.rstd),
        );
        write(self.dx, true, |dx| {
            for r in 0..rows {
                let (xr, dr) = (&x[r * c..(r + 1) * c], &d[r * c..(r + 1) * c]);
                let mut acc = 0f32;
                for i in 0..c {
                    acc += (1.0 + w[i]) * dr[i] * xr[i];
                }
                let k = acc / c as f32 * s[r] * s[r];
                for i in 0..c {
                    dx[r * c + i] += s[r] * ((1.0 + w[i]) * dr[i] - xr[i] * k);
                }
            }
        });
        write(self.dweight, true, |dw| {
            for (i, dw) in dw.iter_mut().enumerate() {
                let mut acc = 0f32;
                for r in 0..rows {
                    acc += d[r * c + i] * x[r * c + i] * s[r];
                }
                *dw += acc;
            }
        });
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        be.load_kernels(&KERNELS)?;
        let (rows, c) = self.x.rows_cols();
        let (dt, gt) = (self.x.dtype(), self.dweight.dtype());
        if self.dx.dtype() != dt {
            return Err(Error::shape(
                "offset_rmsnorm_backward",
                "`dx` must have x's dtype",
            ));
        }
        let ops = operands(be, dt, &[self.dout, self.weight])?;
        let args = Args::new()
            .ptr(device_ptr(self.dx)?)
            .ptr(device_ptr(&ops[0])?)
            .ptr(device_ptr(self.x)?)
            .ptr(device_ptr(&ops[1])?)
            .ptr(device_ptr(self.rstd)?)
            .i64(rows)
            .i64(c);
        // SAFETY: as in the forward: the arguments follow the kernel's parameters, and the
        // check sized every tensor.
        unsafe {
            be.launch_kernel(
                &format!("offset_rmsnorm_dx_{dt}"),
                be.grid(rows),
                BLOCK,
                args,
            )?;
        }
        let kernel = format!("offset_rmsnorm_dw_{dt}_{gt}");
        if !KERNELS.kernels.contains(&kernel.as_str()) {
            return Err(Error::shape(
                "offset_rmsnorm_backward",
                format!("no kernel for {dt} activations with a {gt} weight gradient"),
            ));
        }
        let args = Args::new()
            .ptr(device_ptr(self.dweight)?)
            .ptr(device_ptr(&ops[0])?)
            .ptr(device_ptr(self.x)?)
            .ptr(device_ptr(self.rstd)?)
            .i64(rows)
            .i64(c);
        // SAFETY: as above.
        unsafe { be.launch_kernel(&kernel, be.grid(c), BLOCK, args) }
    }
}

/// The graph node: as trainkit's [`RmsNorm`] (input `x`, parameter the gain, outputs `out`
/// and `rstd`, backward reading `x` and `rstd`), with the gain offset from one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OffsetRmsNorm {
    /// Added to the mean square.
    pub eps: f32,
}

impl Op for OffsetRmsNorm {
    fn name(&self) -> &'static str {
        "offset_rmsnorm"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let x = inputs[0];
        let (rows, _) = x.rows_cols();
        Ok(vec![(x.shape().to_vec(), dtype), (vec![rows], DType::F32)])
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0b10,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let x = cx.input(0)?;
        let mut out = cx.alloc(0)?;
        let mut rstd = cx.alloc(1)?;
        forward(cx.backend, &mut out, &mut rstd, x, cx.weights[0], self.eps)?;
        cx.outputs[0] = Some(out);
        cx.outputs[1] = Some(rstd);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let dx = cx.grads_in[0].accumulate(be)?;
        let (weight, dweight) = cx.params[0].weight_and_grad(be)?;
        let (x, rstd) = (cx.inputs[0].get()?, cx.outputs[1].get()?);
        backward(be, dx, dweight, &dout, x, weight, rstd)?;
        cx.inputs[0].release();
        cx.outputs[1].release();
        Ok(())
    }
}

/// Puts an [`OffsetRmsNorm`] in place of every [`RmsNorm`] of a model, with its epsilon.
#[derive(Debug)]
pub struct OffsetNorms;

impl OpOverride for OffsetNorms {
    fn replace(&self, op: &dyn Op) -> Option<Box<dyn Op>> {
        let norm = downcast::<RmsNorm>(op)?;
        Some(Box::new(OffsetRmsNorm { eps: norm.eps }))
    }
}
