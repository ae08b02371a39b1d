//! The `Backend` trait: every op the models and optimizers need, one call per kernel.

use super::{CustomKernel, Device};
use crate::error::Result;
use crate::memory::{Ledger, MemoryCategory};
use crate::tensor::{DType, Tensor};
use std::fmt::Debug;

/// Hyper-parameters of one fused AdamW update (PyTorch semantics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the bias-corrected root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay (0 for tensors that take none).
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Multiplies the gradient before use (global-norm clipping, loss-scale removal).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The per-step constants of the update, computed on the host as PyTorch does (bias
    /// corrections in f64): `(step_size, bc2_sqrt, decay)` with
    /// `step_size = lr / (1 − beta1^step)`, `bc2_sqrt = sqrt(1 − beta2^step)` and
    /// `decay = 1 − lr · weight_decay`. Every backend uses these exact values.
    pub fn constants(&self) -> (f32, f32, f32) {
        let exponent = self.step.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - (self.beta1 as f64).powi(exponent);
        let bc2 = 1.0 - (self.beta2 as f64).powi(exponent);
        let step_size = (self.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = 1.0 - self.lr * self.weight_decay;
        (step_size, bc2_sqrt, decay)
    }
}

/// The seam between model code and hardware: a device's buffers and ops.
///
/// Model and optimizer code is written once against this trait; `CpuBackend` is the
/// reference, GPU backends implement the same ops. Shapes follow one convention: a tensor
/// used as a matrix has all leading dimensions as rows and its last dimension as columns.
/// Outputs are written in the output tensor's dtype; arithmetic is f32, and bf16 values
/// are rounded (to nearest even) only when stored. Unless a method says it accumulates,
/// it overwrites its output.
pub trait Backend: Debug + Send + Sync {
    /// Short name: `cpu`, `cuda`.
    fn name(&self) -> &'static str;

    /// The device this backend runs on.
    fn device(&self) -> Device;

    /// The ledger that counts every buffer this backend allocates.
    fn ledger(&self) -> &Ledger;

    /// Whether tensors hold elements: false for the meta backend, whose tensors have a
    /// shape and ledger bytes only (so initial values need not be drawn for it).
    fn holds_data(&self) -> bool {
        true
    }

    /// Waits until queued work is done (no-op on the CPU).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The device's own memory numbers (a GPU's pool and `cuMemGetInfo`), to show beside
    /// the ledger's; `None` on the CPU.
    fn device_memory(&self) -> Option<super::cuda::GpuMemory> {
        None
    }

    /// Starts a new high-water mark of [`Backend::device_memory`] (no-op on the CPU).
    fn reset_device_peak(&self) {}

    /// A zero-filled tensor.
    fn zeros(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor>;

    /// A tensor for an op to overwrite entirely: its contents are unspecified (stale
    /// values of a reused buffer, never uninitialized memory). Backends without a cheaper
    /// way return zeros.
    fn empty(
        &self,
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor> {
        self.zeros(shape, dtype, category, label)
    }

    /// A tensor holding `data` (host values, row-major), rounded to `dtype`.
    fn upload(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        category: MemoryCategory,
        label: &str,
    ) -> Result<Tensor>;

    /// The elements as f32, in row-major order.
    fn to_f32(&self, t: &Tensor) -> Result<Vec<f32>>;

    /// A new tensor with the same dtype, shape and elements.
    fn copy(&self, t: &Tensor, category: MemoryCategory, label: &str) -> Result<Tensor>;

    /// `dst = src`, converting (and rounding) to `dst`'s dtype.
    fn cast(&self, dst: &mut Tensor, src: &Tensor) -> Result<()>;

    /// Every element set to `value`.
    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()>;

    /// `out = a + b`, element-wise.
    fn add(&self, out: &mut Tensor, a: &Tensor, b: &Tensor) -> Result<()>;

    /// `y += alpha * x`, element-wise.
    fn axpy(&self, y: &mut Tensor, alpha: f32, x: &Tensor) -> Result<()>;

    /// `x *= alpha`, element-wise.
    fn scale(&self, x: &mut Tensor, alpha: f32) -> Result<()>;

    /// Sum of squares of all elements, accumulated in f64 in a fixed order.
    fn sum_squares(&self, x: &Tensor) -> Result<f64>;

    /// The sum of squares of every element of every tensor in `xs`, accumulated in f64:
    /// the squared global gradient norm. A GPU backend computes it with a single read back
    /// to the host; the default sums [`Backend::sum_squares`] tensor by tensor.
    fn sum_squares_all(&self, xs: &[&Tensor]) -> Result<f64> {
        let mut sum = 0f64;
        for x in xs {
            sum += self.sum_squares(x)?;
        }
        Ok(sum)
    }

    /// `out (+)= op(a) · op(b) (+ bias)` with f32 accumulation, where `op` transposes when
    /// `trans_a` / `trans_b` is set. `out` is `[m, n]`, `op(a)` is `[m, k]`, `op(b)` is
    /// `[k, n]`; `bias` (length n) is added to every row. With `accumulate` the product is
    /// added to `out`'s contents and rounded once.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        out: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()>;

    /// `pre = a · b + bias` and `out = gelu(pre)`: the first layer of an MLP. The
    /// default runs [`Backend::matmul`] then [`Backend::gelu`]; a GPU backend applies the
    /// bias and the GELU in the product's epilogue, writing both outputs from its
    /// accumulator, a pass over `pre` fewer.
    fn matmul_bias_gelu(
        &self,
        out: &mut Tensor,
        pre: &mut Tensor,
        a: &Tensor,
        b: &Tensor,
        bias: &Tensor,
    ) -> Result<()> {
        self.matmul(pre, a, b, Some(bias), false, false, false)?;
        self.gelu(out, pre)
    }

    /// `dbias += column sums of dout` (the bias gradient of a matmul).
    fn bias_backward(&self, dbias: &mut Tensor, dout: &Tensor) -> Result<()>;

    /// `out[b, t] = wte[tokens[b, t]] + wpe[t]`; `out` is `[B, T, C]`.
    fn embedding(&self, out: &mut Tensor, tokens: &[u32], wte: &Tensor, wpe: &Tensor)
        -> Result<()>;

    /// `dwte[tokens[b, t]] += dout[b, t]` and `dwpe[t] += dout[b, t]`.
    fn embedding_backward(
        &self,
        dwte: &mut Tensor,
        dwpe: &mut Tensor,
        dout: &Tensor,
        tokens: &[u32],
    ) -> Result<()>;

    /// Layer normalization of each row of `x`: `out = (x - mean) · rstd · weight + bias`,
    /// statistics in f32, written to `stats` as `[rows, 2]` = (mean, rstd).
    #[allow(clippy::too_many_arguments)]
    fn layernorm(
        &self,
        out: &mut Tensor,
        stats: &mut Tensor,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
    ) -> Result<()>;

    /// Backward of [`Backend::layernorm`]: accumulates into `dx`, `dweight` and `dbias`.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        dx: &mut Tensor,
        dweight: &mut Tensor,
        dbias: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        stats: &Tensor,
    ) -> Result<()>;

    /// GELU with the tanh approximation, element-wise.
    fn gelu(&self, out: &mut Tensor, x: &Tensor) -> Result<()>;

    /// `dx = gelu'(x) · dout`.
    fn gelu_backward(&self, dx: &mut Tensor, x: &Tensor, dout: &Tensor) -> Result<()>;

    /// Causal attention scores: `scores[b, h, i, j] = scale · q_i · k_j` for `j <= i`, and
    /// 0 above the diagonal; `qkv` is `[B, T, 3C]` (q, k, v blocks, heads contiguous in
    /// each), `scores` is `[B, H, T, T]`, scale = 1/sqrt(C/H).
    fn attention_scores(&self, scores: &mut Tensor, qkv: &Tensor, n_head: usize) -> Result<()>;

    /// Backward of [`Backend::attention_scores`]: writes the q and k blocks of `dqkv`
    /// (entries of `dscores` above the diagonal are ignored).
    fn attention_scores_backward(
        &self,
        dqkv: &mut Tensor,
        dscores: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()>;

    /// Row softmax of causal scores over `j <= i` (statistics in f32); 0 above the diagonal.
    fn softmax_causal(&self, probs: &mut Tensor, scores: &Tensor) -> Result<()>;

    /// Backward of [`Backend::softmax_causal`]:
    /// `dscores = probs · (dprobs - Σ probs · dprobs)` on `j <= i`, 0 above.
    fn softmax_causal_backward(
        &self,
        dscores: &mut Tensor,
        dprobs: &Tensor,
        probs: &Tensor,
    ) -> Result<()>;

    /// `out[b, t, head h] = Σ_j probs[b, h, t, j] · v[b, j, head h]`; `out` is `[B, T, C]`.
    fn attention_values(
        &self,
        out: &mut Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()>;

    /// Backward of [`Backend::attention_values`]: writes `dprobs` (0 above the diagonal) and
    /// the v block of `dqkv`.
    fn attention_values_backward(
        &self,
        dprobs: &mut Tensor,
        dqkv: &mut Tensor,
        dout: &Tensor,
        probs: &Tensor,
        qkv: &Tensor,
        n_head: usize,
    ) -> Result<()>;

    /// Cross-entropy of each row of `logits` (`[rows, Vp]`, columns from `vocab` on are
    /// padding and ignored) against `targets`, in f32. Each row's loss is added to
    /// `losses[row]` (f32, at least `rows` elements), which stays on the device: a
    /// training step reads its losses once, at its end. With `grad_scale`, `logits` is
    /// overwritten by its gradient `grad_scale · (softmax - onehot)` (0 on padding
    /// columns).
    fn cross_entropy(
        &self,
        logits: &mut Tensor,
        targets: &[u32],
        vocab: usize,
        grad_scale: Option<f32>,
        losses: &mut Tensor,
    ) -> Result<()>;

    /// The end of a step's backward, on the device: writes the step's [`StepRecord`] to
    /// `record` (f32, 3 elements) from the gradients `grads` (scaled by `loss_scale`)
    /// and the per-row losses `losses`. The squared norm and the loss sum are accumulated
    /// in f64; the multiplier is PyTorch's `clip_grad_norm_` coefficient (see
    /// [`crate::optim::clip_coefficient`], 1 when `max_norm <= 0`) divided by
    /// `loss_scale`, or NaN when the loss or the norm is not finite, which tells the
    /// optimizer to skip the update.
    ///
    /// [`StepRecord`]: crate::optim::StepRecord
    fn grad_guard(
        &self,
        record: &mut Tensor,
        grads: &[&Tensor],
        losses: &Tensor,
        max_norm: f32,
        loss_scale: f32,
    ) -> Result<()>;

    /// One AdamW update of `param` (f32) from `grad`, with moments `m` and `v` (f32).
    /// With `scale` (a one-element f32 tensor, see [`crate::optim::GradScale`]), the
    /// gradient is also multiplied by its value, read on the device; when that value is
    /// not finite nothing is written: the update is skipped. With `compute`, the updated
    /// values are also written there, rounded to its dtype (the compute weights of mixed
    /// precision), in the same pass on a GPU.
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamWStep,
        scale: Option<&Tensor>,
        compute: Option<&mut Tensor>,
    ) -> Result<()>;

    /// Runs a kernel written outside trainkit ([`CustomKernel`]) element-wise over the
    /// elements of `outputs[0]`: each output is read and written, each input read, and
    /// `scalars` passed by value (see [`crate::device::custom`] for the convention). The
    /// CPU backend runs the kernel's CPU twin, the CUDA backend compiles its CUDA source
    /// (once, through NVRTC and the kernel cache) and launches it, the meta backend checks
    /// the operands only. This default runs the CPU twin on host copies read with
    /// [`Backend::to_f32`] and written back with [`Backend::upload`] and [`Backend::cast`].
    fn custom(
        &self,
        kernel: &dyn CustomKernel,
        outputs: &mut [&mut Tensor],
        inputs: &[&Tensor],
        scalars: &[f32],
    ) -> Result<()> {
        super::custom::run_on_host(
            kernel,
            outputs,
            inputs,
            scalars,
            &|t| self.to_f32(t),
            &|t, v| {
                let tmp = self.upload(
                    v,
                    t.shape(),
                    t.dtype(),
                    MemoryCategory::Workspace,
                    t.label(),
                )?;
                self.cast(t, &tmp)
            },
        )
    }
}
