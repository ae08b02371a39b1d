//! LoRA: a low-rank update beside a linear projection, `y = x·op(W) (+ b) + s·(x Aᵀ) Bᵀ`,
//! without ever forming `ΔW = s·B·A`.
//!
//! The family: two graph nodes and the column kernels they need.
//! - [`LoraDown`] computes each adapter's low-rank intermediate `h = s·x Aᵀ` (`[.., r]`),
//!   an activation of its own (tagged [`crate::checkpoint::Tags::LOW_RANK`]), so every
//!   recompute policy, the byte budget and offloading handle it like any other.
//! - [`LoraProjection`] is a projection ([`Base`]: plain, added to the residual, or with
//!   GPT-2's GELU after it) that adds `h Bᵀ` to the output columns each adapter covers (a
//!   block of a fused projection: the queries of `qkv_proj`, the gate of `gate_up_proj`).
//!   Its backward computes `dB = dy_colsᵀ h` and `dh = dy_cols B`; a frozen base weight
//!   costs no weight-gradient product.
//! - [`add_cols`] and [`take_cols`] move a block of columns between a fused projection's
//!   output (or its gradient) and a block-wide tensor: the CPU twin (`cpu.rs`) and the
//!   CUDA launches (`cuda.rs`, over `kernels/lora.cu`).
//! - [`dropout`] zeroes elements of an update's input in training (PEFT's
//!   `lora_dropout`): `h = s·(m ⊙ x / (1 − p)) Aᵀ`. The mask `m` is a counter-based draw
//!   ([`Keep`]) keyed by the pass's random key ([`ForwardCx::rng_key`]) and the adapter, so
//!   it is never stored: backward and a recomputation draw it again, bit for bit.
//!   Evaluation (no key) and `p = 0` use no mask, exactly the plain update.
//! - [`dora`]: DoRA's magnitude and direction (PEFT's `use_dora`), applied by
//!   [`LoraProjection`] to the blocks of its DoRA adapters.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub mod dora;

use super::linear::fused::{matmul_bias_gelu, matmul_residual};
use super::linear::product::{
    input_grad, param_grads, product_shape, project, weight_product, with_width,
};
use super::{gelu, BackwardCx, ForwardCx, Op, Saves};
use crate::device::cpu::{ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::memory::MemoryCategory;
use crate::tensor::{DType, Tensor};

/// One low-rank update of a projection: the output columns it adds to, its rank and its
/// scale (`α/r`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adapted {
    /// The first output column it adds to.
    pub offset: usize,
    /// How many columns (its `B` is `[width, rank]`).
    pub width: usize,
    /// The rank `r` (its `A` is `[rank, in]`).
    pub rank: usize,
    /// The scale `s` of `B·A`.
    pub scale: f32,
    /// The dropout probability of its input in training (0: none).
    pub dropout: f32,
    /// Whether it is DoRA's ([`dora`]): its block of the output rescaled per feature by a
    /// trained magnitude over the detached norm of `W + s·B·A`.
    pub dora: bool,
}

impl Adapted {
    /// Whether it covers every one of the projection's `cols` output columns (no block of
    /// a fused projection to add to or take from).
    fn covers(&self, cols: usize) -> bool {
        self.offset == 0 && self.width == cols
    }

    /// Whether it is DoRA's with dropout: the base projection then also runs on the
    /// dropped input (the `z` of [`LoraDown`]).
    pub fn drops_base_input(&self) -> bool {
        self.dora && self.dropout > 0.0
    }
}

/// Where one adapted block lies in a projection's base weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its first output feature.
    pub offset: usize,
    /// Its output features.
    pub width: usize,
    /// The projection's input features.
    pub in_features: usize,
    /// Whether the weight is stored `[out, in]` (else `[in, out]`, GPT-2's `Conv1D`).
    pub transposed: bool,
}

/// One dropout mask, drawn without state: element `i` is kept when the top 24 bits of
/// the `(i + 1)`-th number of the SplitMix64 stream seeded with `key` reach `threshold`
/// (`p · 2²⁴`, rounded), and a kept element is scaled by `scale` (`1/(1 − p)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Keep {
    /// The stream's seed.
    pub key: u64,
    /// Draws below it are dropped.
    pub threshold: u64,
    /// The factor of a kept element (`1/(1 − p)` rounded to f32 once, on the host).
    pub scale: f32,
}

impl Keep {
    /// The mask of dropout probability `p` (in `[0, 1)`) drawn from stream `key`.
    pub fn new(p: f32, key: u64) -> Keep {
        let p = f64::from(p);
        Keep {
            key,
            threshold: (p * (1u64 << 24) as f64).round() as u64,
            scale: (1.0 / (1.0 - p)) as f32,
        }
    }

    /// The mask of adapter `j` of a node whose pass key is `node_key`.
    fn of_adapter(p: f32, node_key: u64, j: usize) -> Keep {
        use crate::rng::{mix64, GAMMA};
        Keep::new(p, mix64(node_key ^ (j as u64 + 1).wrapping_mul(GAMMA)))
    }
}

/// `dst[r, offset..offset + width] += src[r, ..]` where `dst` is `[rows, cols]` and `src`
/// `[rows, width]` (one dtype): an update added to its block of a fused projection.
pub fn add_cols(
    be: &(impl Backend + ?Sized),
    dst: &mut Tensor,
    offset: usize,
    src: &Tensor,
) -> Result<()> {
    be.run(&mut AddCols {
        wide: dst,
        block: src,
        offset,
    })
}

/// `dst[r, ..] = src[r, offset..offset + width]` where `src` is `[rows, cols]` and `dst`
/// `[rows, width]` (one dtype): the gradient of an update's block taken out.
pub fn take_cols(
    be: &(impl Backend + ?Sized),
    dst: &mut Tensor,
    src: &Tensor,
    offset: usize,
) -> Result<()> {
    be.run(&mut TakeCols { dst, src, offset })
}

/// `dst = m ⊙ src · scale`, or `dst += m ⊙ src · scale` when `accumulate`, with the
/// mask `m` that `keep` draws (see [`Keep`]); `dst` and `src` of one shape and dtype.
pub fn dropout(
    be: &(impl Backend + ?Sized),
    dst: &mut Tensor,
    src: &Tensor,
    keep: Keep,
    accumulate: bool,
) -> Result<()> {
    be.run(&mut Dropout {
        dst,
        src,
        keep,
        accumulate,
    })
}

struct Dropout<'a> {
    dst: &'a mut Tensor,
    src: &'a Tensor,
    keep: Keep,
    accumulate: bool,
}

impl OpKernel for Dropout<'_> {
    fn name(&self) -> &'static str {
        "lora_dropout"
    }
    fn label(&self) -> &str {
        self.dst.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("lora_dropout", &[self.dst, self.src])?;
        ensure(
            self.dst.shape() == self.src.shape() && self.dst.dtype() == self.src.dtype(),
            "lora_dropout",
            || {
                format!(
                    "`{}` {:?} ({}) and `{}` {:?} ({}) must be of one shape and dtype",
                    self.dst.label(),
                    self.dst.shape(),
                    self.dst.dtype(),
                    self.src.label(),
                    self.src.shape(),
                    self.src.dtype()
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        self.src.numel() as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::dropout(self.dst, self.src, &self.keep, self.accumulate);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::dropout(be, self.dst, self.src, self.keep, self.accumulate)
    }
}

/// The check of both column calls: `wide` is `[rows, cols]`, `block` `[rows, width]`,
/// and the block's columns lie inside `wide`'s.
fn check_cols(op: &'static str, wide: &Tensor, block: &Tensor, offset: usize) -> Result<()> {
    ensure_float(op, &[wide, block])?;
    let (rows, cols) = wide.rows_cols();
    let (rows2, width) = block.rows_cols();
    ensure(
        rows == rows2 && offset + width <= cols && wide.dtype() == block.dtype(),
        op,
        || {
            format!(
                "`{}` {:?} ({}) must be columns {offset}..{} of `{}` {:?} ({}), row for row, \
                 in one dtype",
                block.label(),
                block.shape(),
                block.dtype(),
                offset + width,
                wide.label(),
                wide.shape(),
                wide.dtype()
            )
        },
    )
}

struct AddCols<'a> {
    wide: &'a mut Tensor,
    block: &'a Tensor,
    offset: usize,
}

impl OpKernel for AddCols<'_> {
    fn name(&self) -> &'static str {
        "lora_add_cols"
    }
    fn label(&self) -> &str {
        self.wide.label()
    }
    fn check(&self) -> Result<()> {
        check_cols("lora_add_cols", self.wide, self.block, self.offset)
    }
    fn flops(&self) -> u64 {
        self.block.numel() as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::add_cols(self.wide, self.offset, self.block);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::add_cols(be, self.wide, self.offset, self.block)
    }
}

struct TakeCols<'a> {
    dst: &'a mut Tensor,
    src: &'a Tensor,
    offset: usize,
}

impl OpKernel for TakeCols<'_> {
    fn name(&self) -> &'static str {
        "lora_take_cols"
    }
    fn label(&self) -> &str {
        self.dst.label()
    }
    fn check(&self) -> Result<()> {
        check_cols("lora_take_cols", self.src, self.dst, self.offset)
    }
    fn flops(&self) -> u64 {
        0
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::take_cols(self.dst, self.src, self.offset);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::take_cols(be, self.dst, self.src, self.offset)
    }
}

/// Each adapter's low-rank intermediate `h_j = s_j · x A_jᵀ` (`[.., rank_j]`) of one
/// projection's input.
///
/// Input: `x`. Parameters: `A_1, …, A_n` (`[rank_j, in]`). Outputs: `h_1, …, h_n`.
/// Backward reads `x`: `dA_j += s_j · dh_jᵀ x` and `dx += s_j · dh_j A_j`.
///
/// With an adapter's dropout `p > 0` in a pass that has a random key
/// ([`ForwardCx::rng_key`]), `x` is replaced by `x_j = m_j ⊙ x / (1 − p)` (a mask of its
/// own per adapter, as PEFT's one dropout module per adapted projection):
/// `dA_j += s_j · dh_jᵀ x_j` and `dx += m_j ⊙ (s_j · dh_j A_j) / (1 − p)`, the mask drawn
/// again in backward. Each costs a transient buffer of `x`'s size.
///
/// A DoRA adapter with dropout also gets, after every `h`, an output
/// `z_j = (x_j − x)·W_jᵀ` (`[.., width_j]`, its block of the base product of what the
/// dropout took away; zeros where no dropout acts): PEFT's DoRA runs the base projection
/// on the dropped input, and [`LoraProjection`] adds `(g − 1) ⊙ z_j`. The base weight `W`
/// is then the last parameter, and backward adds `(m_j ⊙ t / (1 − p)) − t` to `dx`,
/// `t = dz_j·W_j`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraDown {
    /// The adapters, in parameter order.
    pub adapters: Vec<Adapted>,
    /// Whether the base weight (a parameter when an adapter is DoRA's with dropout) is
    /// stored `[out, in]`.
    pub transposed: bool,
}

impl LoraDown {
    /// The adapters that are DoRA's with dropout, by index, in order: each has a `z`
    /// output.
    fn dropped_dora(&self) -> impl Iterator<Item = usize> + '_ {
        self.adapters
            .iter()
            .enumerate()
            .filter(|(_, a)| a.drops_base_input())
            .map(|(j, _)| j)
    }

    /// `z = (x_j − x)·op(W)ᵀ`'s block of adapter `a` into `out` (`x_j` the dropped input),
    /// or zeros without a mask.
    fn dropped_base(
        &self,
        be: &dyn Backend,
        out: &mut Tensor,
        x: &Tensor,
        w: &Tensor,
        (a, keep): (&Adapted, Option<Keep>),
        label: &str,
    ) -> Result<()> {
        let Some(keep) = keep else {
            return be.fill(out, 0.0);
        };
        let mut diff = dropped_input(be, x, keep, label)?;
        be.axpy(&mut diff, -1.0, x)?;
        let cols = product_shape(x, w, self.transposed);
        if cols.last().is_some_and(|&c| a.covers(c)) {
            return weight_product(be, out, &diff, w, None, self.transposed, false);
        }
        let mut full = be.empty(
            &cols,
            x.dtype(),
            MemoryCategory::Workspace,
            &format!("{label}.dora_dropped"),
        )?;
        weight_product(be, &mut full, &diff, w, None, self.transposed, false)?;
        take_cols(be, out, &full, a.offset)
    }
}

impl Op for LoraDown {
    fn name(&self) -> &'static str {
        "lora_down"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        let z = self
            .dropped_dora()
            .map(|j| (with_width(inputs[0].shape(), self.adapters[j].width), dtype));
        Ok(self
            .adapters
            .iter()
            .map(|a| (with_width(inputs[0].shape(), a.rank), dtype))
            .chain(z)
            .collect())
    }

    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let x = cx.input(0)?;
        for (j, a) in self.adapters.iter().enumerate() {
            if !cx.wanted[j] {
                continue;
            }
            let mut h = cx.alloc(j)?;
            match keep(a, cx.rng_key, j) {
                Some(keep) => {
                    let dropped = dropped_input(be, x, keep, &cx.labels[j])?;
                    be.matmul(&mut h, &dropped, cx.weights[j], None, false, true, false)?;
                }
                None => be.matmul(&mut h, x, cx.weights[j], None, false, true, false)?,
            }
            be.scale(&mut h, a.scale)?;
            cx.outputs[j] = Some(h);
        }
        let n = self.adapters.len();
        let dropped: Vec<usize> = self.dropped_dora().collect();
        for (k, &j) in dropped.iter().enumerate() {
            if !cx.wanted[n + k] {
                continue;
            }
            let a = &self.adapters[j];
            let mut z = cx.alloc(n + k)?;
            let w = cx.weights[n];
            let label = cx.labels[n + k].clone();
            self.dropped_base(be, &mut z, x, w, (a, keep(a, cx.rng_key, j)), &label)?;
            cx.outputs[n + k] = Some(z);
        }
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        for (j, a) in self.adapters.iter().enumerate() {
            let Some(mut dh) = cx.grads_out[j].take() else {
                continue;
            };
            be.scale(&mut dh, a.scale)?;
            let x = cx.inputs[0].get()?;
            let Some(keep) = keep(a, cx.rng_key, j) else {
                if cx.params[j].wants_grad() {
                    be.matmul(cx.params[j].grad_mut(be)?, &dh, x, None, true, false, true)?;
                }
                let (buf, fresh) = cx.grads_in[0].buffer(be)?;
                be.matmul(buf, &dh, cx.params[j].weight(), None, false, false, !fresh)?;
                continue;
            };
            let label = &cx.grad_labels_out[j];
            if cx.params[j].wants_grad() {
                let dropped = dropped_input(be, x, keep, label)?;
                be.matmul(
                    cx.params[j].grad_mut(be)?,
                    &dh,
                    &dropped,
                    None,
                    true,
                    false,
                    true,
                )?;
            }
            let mut dx = be.empty(
                x.shape(),
                x.dtype(),
                MemoryCategory::Workspace,
                &format!("{label}.dropout_grad"),
            )?;
            be.matmul(
                &mut dx,
                &dh,
                cx.params[j].weight(),
                None,
                false,
                false,
                false,
            )?;
            let (buf, fresh) = cx.grads_in[0].buffer(be)?;
            dropout(be, buf, &dx, keep, !fresh)?;
        }
        // DoRA with dropout: `dx += m ⊙ t / (1 − p) − t`, `t = dz·op(W)` over the block.
        let n = self.adapters.len();
        let dropped: Vec<usize> = self.dropped_dora().collect();
        for (k, &j) in dropped.iter().enumerate() {
            let Some(dz) = cx.grads_out[n + k].take() else {
                continue;
            };
            let a = &self.adapters[j];
            let Some(keep) = keep(a, cx.rng_key, j) else {
                continue;
            };
            let w = cx.params[n].weight();
            let x = cx.inputs[0].get()?;
            let label = &cx.grad_labels_out[n + k];
            let cols = product_shape(x, w, self.transposed);
            let mut t = be.empty(x.shape(), x.dtype(), MemoryCategory::Workspace, label)?;
            if cols.last().is_some_and(|&c| a.covers(c)) {
                weight_product(be, &mut t, &dz, w, None, !self.transposed, false)?;
            } else {
                let mut full = be.zeros(&cols, dz.dtype(), MemoryCategory::Workspace, label)?;
                add_cols(be, &mut full, a.offset, &dz)?;
                weight_product(be, &mut t, &full, w, None, !self.transposed, false)?;
            }
            let (buf, fresh) = cx.grads_in[0].buffer(be)?;
            dropout(be, buf, &t, keep, !fresh)?;
            be.axpy(buf, -1.0, &t)?;
        }
        cx.inputs[0].release();
        Ok(())
    }
}

/// The mask of adapter `j` (`a`) in a pass keyed `rng_key`: `None` where no dropout
/// acts (no dropout, or no key: evaluation).
fn keep(a: &Adapted, rng_key: Option<u64>, j: usize) -> Option<Keep> {
    match rng_key {
        Some(key) if a.dropout > 0.0 => Some(Keep::of_adapter(a.dropout, key, j)),
        _ => None,
    }
}

/// `m ⊙ x / (1 − p)` in a transient buffer (labelled after `label`).
fn dropped_input(be: &dyn Backend, x: &Tensor, keep: Keep, label: &str) -> Result<Tensor> {
    let mut out = be.empty(
        x.shape(),
        x.dtype(),
        MemoryCategory::Workspace,
        &format!("{label}.dropout"),
    )?;
    dropout(be, &mut out, x, keep, false)?;
    Ok(out)
}

/// What a [`LoraProjection`] is without its adapters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// `y = x · op(W) (+ b)` ([`super::Linear`]). Inputs: `x`, then the `h_j`.
    Linear,
    /// `y = residual + x · op(W) (+ b)` ([`super::LinearResidual`]). Inputs: `residual`,
    /// `x`, then the `h_j`.
    Residual,
    /// `pre = x · op(W) + b`, `out = gelu(pre)` ([`super::LinearGelu`]): the update is
    /// added to `pre`. Inputs: `x`, then the `h_j`; outputs `pre`, `out`.
    Gelu,
}

/// A linear projection with low-rank updates: the base product, then `h_j B_jᵀ` added to
/// the columns each adapter covers (see the module documentation). With no update it is a
/// frozen projection: its backward computes the input's gradient alone and it saves no
/// input for a weight gradient. The plain projections ([`super::Linear`],
/// [`super::LinearResidual`], [`super::LinearGelu`]) are this node with no update and a base
/// that trains.
///
/// Inputs: as [`Base`] says, then `h_1, …, h_n` (from [`LoraDown`]). Parameters: `W`, `b`
/// when `bias`, then `B_1, …, B_n` (`[width_j, rank_j]`), then for each DoRA adapter in
/// order its `A_j` (read for the norm, its gradient is [`LoraDown`]'s) and its magnitude
/// `m_j` (`[width_j]`). Backward reads the `h_j`, and `x` when the base trains or an
/// adapter is DoRA's (whose base must be frozen).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraProjection {
    /// The projection without its adapters.
    pub base: Base,
    /// Whether a bias parameter follows the weight.
    pub bias: bool,
    /// Whether the weight is stored `[out, in]`.
    pub transposed: bool,
    /// Whether the base weight or bias trains (its backward then reads `x`).
    pub base_trains: bool,
    /// The adapters, in parameter order.
    pub adapters: Vec<Adapted>,
}

impl LoraProjection {
    /// Which input is `x`.
    fn x(&self) -> usize {
        match self.base {
            Base::Residual => 1,
            _ => 0,
        }
    }

    /// Which parameter is `B_1`.
    fn first_b(&self) -> usize {
        1 + usize::from(self.bias)
    }

    /// The parameters `(A_j, m_j)` of adapter `j` when it is DoRA's.
    fn dora_params(&self, j: usize) -> Option<(usize, usize)> {
        if !self.adapters[j].dora {
            return None;
        }
        let before = self.adapters[..j].iter().filter(|a| a.dora).count();
        let at = self.first_b() + self.adapters.len() + 2 * before;
        Some((at, at + 1))
    }

    /// Whether any adapter is DoRA's.
    fn has_dora(&self) -> bool {
        self.adapters.iter().any(|a| a.dora)
    }

    /// The input holding `z_j` (see [`LoraDown`]) when adapter `j` is DoRA's with dropout.
    fn z_input(&self, j: usize) -> Option<usize> {
        let a = &self.adapters[j];
        if !a.drops_base_input() {
            return None;
        }
        let before = self.adapters[..j]
            .iter()
            .filter(|a| a.drops_base_input())
            .count();
        Some(self.x() + 1 + self.adapters.len() + before)
    }

    /// `(g − 1) ⊙ t` column by column (`t` is `[rows, width]`, `g = m / n`), a new tensor.
    fn minus_one(
        be: &dyn Backend,
        t: &Tensor,
        m: &Tensor,
        n: &Tensor,
        label: &str,
    ) -> Result<Tensor> {
        let mut out = be.empty(t.shape(), t.dtype(), MemoryCategory::Workspace, label)?;
        be.copy_rows(&mut out, 0, t, 0, t.rows_cols().0, false)?;
        dora::scale_cols(be, &mut out, m, n, None, 0)?;
        be.axpy(&mut out, -1.0, t)?;
        Ok(out)
    }

    /// Where adapter `a` lies in the base weight `w`.
    fn block(&self, a: &Adapted, w: &Tensor) -> Block {
        let (rows, cols) = w.rows_cols();
        Block {
            offset: a.offset,
            width: a.width,
            in_features: if self.transposed { cols } else { rows },
            transposed: self.transposed,
        }
    }

    /// DoRA's rescaling of its adapters' blocks of `y` (the base product with every update
    /// added, bias included).
    fn scale_dora(&self, cx: &ForwardCx<'_>, y: &mut Tensor) -> Result<()> {
        let be = cx.backend;
        let w = cx.weights[0];
        for (j, a) in self.adapters.iter().enumerate() {
            let Some((ai, mi)) = self.dora_params(j) else {
                continue;
            };
            let b = cx.weights[self.first_b() + j];
            let n = dora::weight_norm(
                be,
                w,
                cx.weights[ai],
                b,
                a.scale,
                self.block(a, w),
                y.label(),
            )?;
            let bias = self.bias.then(|| cx.weights[1]);
            dora::scale_cols(be, y, cx.weights[mi], &n, bias, a.offset)?;
            // With dropout in training, the base on the dropped input: `+ (g − 1) ⊙ z`.
            if let (Some(zi), Some(_)) = (self.z_input(j), cx.rng_key) {
                let label = format!("{}.dora_dropped", y.label());
                let t = Self::minus_one(be, cx.input(zi)?, cx.weights[mi], &n, &label)?;
                if a.covers(y.rows_cols().1) {
                    be.axpy(y, 1.0, &t)?;
                } else {
                    add_cols(be, y, a.offset, &t)?;
                }
            }
        }
        Ok(())
    }

    /// DoRA's backward: each DoRA adapter's magnitude gradient from the unscaled `dy`, and
    /// `dy` with their blocks rescaled (what the rest of the backward propagates).
    fn dora_backward(&self, cx: &mut BackwardCx<'_>, dy: &Tensor) -> Result<Tensor> {
        let be = cx.backend;
        if self.base_trains {
            return Err(crate::error::Error::config(
                "adapter",
                "a DoRA adapter's base projection must be frozen (its norm is taken from the \
                 base weight)",
            ));
        }
        let (rows, cols) = dy.rows_cols();
        let label = cx.grad_labels_out[0].clone();
        let mut scaled = be.empty(dy.shape(), dy.dtype(), MemoryCategory::Activations, &label)?;
        be.copy_rows(&mut scaled, 0, dy, 0, rows, false)?;
        let xi = self.x();
        let mut base: Option<Tensor> = None;
        for (j, a) in self.adapters.iter().enumerate() {
            let Some((ai, mi)) = self.dora_params(j) else {
                continue;
            };
            let w = cx.params[0].weight();
            let bj = self.first_b() + j;
            let n = dora::weight_norm(
                be,
                w,
                cx.params[ai].weight(),
                cx.params[bj].weight(),
                a.scale,
                self.block(a, w),
                &label,
            )?;
            // The block before the scaling: x·op(W) (no bias) and the update.
            if base.is_none() {
                let mut u = be.empty(
                    dy.shape(),
                    dy.dtype(),
                    MemoryCategory::Workspace,
                    &format!("{label}.dora_base_out"),
                )?;
                weight_product(
                    be,
                    &mut u,
                    cx.inputs[xi].get()?,
                    w,
                    None,
                    self.transposed,
                    false,
                )?;
                base = Some(u);
            }
            let u = base.as_ref().expect("computed above");
            let mut v = be.empty(
                &with_width(dy.shape(), a.width),
                dy.dtype(),
                MemoryCategory::Workspace,
                &format!("{label}.dora_direction"),
            )?;
            if a.covers(cols) {
                be.copy_rows(&mut v, 0, u, 0, rows, false)?;
            } else {
                take_cols(be, &mut v, u, a.offset)?;
            }
            let h = cx.inputs[xi + 1 + j].get()?;
            be.matmul(&mut v, h, cx.params[bj].weight(), None, false, true, true)?;
            if let Some(zi) = self.z_input(j) {
                if cx.rng_key.is_some() {
                    // The block's output before the scaling also holds `z`'s share, and
                    // `z`'s gradient is `(g − 1) ⊙ dy`.
                    let z = cx.inputs[zi].get()?;
                    be.axpy(&mut v, 1.0, z)?;
                    let mut dy_j = be.empty(
                        &with_width(dy.shape(), a.width),
                        dy.dtype(),
                        MemoryCategory::Workspace,
                        &format!("{label}.dora_dropped"),
                    )?;
                    take_cols(be, &mut dy_j, dy, a.offset)?;
                    let dz = Self::minus_one(be, &dy_j, cx.params[mi].weight(), &n, &label)?;
                    cx.grads_in[zi].add(be, dz)?;
                }
                cx.inputs[zi].release();
            }
            if cx.params[mi].wants_grad() {
                let mut dm = be.empty(
                    &[a.width],
                    DType::F32,
                    MemoryCategory::Workspace,
                    &format!("{label}.dora_magnitude"),
                )?;
                dora::magnitude_grad(be, &mut dm, dy, &v, &n, a.offset)?;
                be.axpy(cx.params[mi].grad_mut(be)?, 1.0, &dm)?;
            }
            dora::scale_cols(be, &mut scaled, cx.params[mi].weight(), &n, None, a.offset)?;
        }
        Ok(scaled)
    }

    /// Adds each adapter's `h_j B_jᵀ` to its columns of `y` (the base product).
    fn add_updates(&self, cx: &ForwardCx<'_>, y: &mut Tensor) -> Result<()> {
        let be = cx.backend;
        let cols = y.rows_cols().1;
        for (j, a) in self.adapters.iter().enumerate() {
            let h = cx.input(self.x() + 1 + j)?;
            let b = cx.weights[self.first_b() + j];
            if a.covers(cols) {
                be.matmul(y, h, b, None, false, true, true)?;
            } else {
                let mut t = be.empty(
                    &with_width(y.shape(), a.width),
                    y.dtype(),
                    MemoryCategory::Activations,
                    &format!("{}.update", y.label()),
                )?;
                be.matmul(&mut t, h, b, None, false, true, false)?;
                add_cols(be, y, a.offset, &t)?;
            }
        }
        Ok(())
    }
}

impl Op for LoraProjection {
    fn name(&self) -> &'static str {
        "lora_projection"
    }

    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(match self.base {
            Base::Linear => vec![(product_shape(inputs[0], weights[0], self.transposed), dtype)],
            Base::Residual => vec![(inputs[0].shape().to_vec(), dtype)],
            Base::Gelu => {
                let shape = product_shape(inputs[0], weights[0], self.transposed);
                vec![(shape.clone(), dtype), (shape, dtype)]
            }
        })
    }

    fn saves(&self) -> Saves {
        let zs = (0..self.adapters.len())
            .filter_map(|j| self.z_input(j))
            .fold(0u32, |acc, i| acc | 1 << i);
        let hs = zs | ((1u32 << self.adapters.len()) - 1) << (self.x() + 1);
        let x = if self.base_trains || self.has_dora() {
            1 << self.x()
        } else {
            0
        };
        Saves {
            inputs: hs | x,
            outputs: u32::from(self.base == Base::Gelu),
        }
    }

    fn inputs_needed(&self, wanted: &[bool], present: &[bool]) -> u32 {
        // GPT-2's GELU alone, from a pre-activation that is still there, needs no input.
        if self.base == Base::Gelu && !wanted[0] && present[0] {
            0
        } else {
            u32::MAX
        }
    }

    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        if self.base == Base::Gelu && cx.wanted[1] && !cx.wanted[0] {
            if let Some(pre) = cx.present[0] {
                let mut out = cx.alloc(1)?;
                gelu::forward(be, &mut out, pre)?;
                cx.outputs[1] = Some(out);
                return Ok(());
            }
        }
        let x = cx.input(self.x())?;
        if self.base == Base::Gelu
            && self.adapters.is_empty()
            && !self.transposed
            && cx.wanted[1]
            && cx.weights[0].dtype().is_float()
        {
            // No update: GPT-2's fused product, bias and GELU.
            let mut pre = cx.alloc(0)?;
            let mut out = cx.alloc(1)?;
            matmul_bias_gelu(be, &mut out, &mut pre, x, cx.weights[0], cx.weights[1])?;
            cx.outputs[0] = Some(pre);
            cx.outputs[1] = Some(out);
            return Ok(());
        }
        if self.base == Base::Residual
            && self.adapters.is_empty()
            && cx.weights[0].dtype().is_float()
        {
            // No update: the product with the residual added in the same call.
            let mut y = cx.alloc(0)?;
            let bias = self.bias.then(|| cx.weights[1]);
            let residual = cx.input(0)?;
            matmul_residual(
                be,
                &mut y,
                x,
                cx.weights[0],
                bias,
                residual,
                self.transposed,
            )?;
            cx.outputs[0] = Some(y);
            return Ok(());
        }
        let mut y = project(cx, 0, x, self.bias, self.transposed)?;
        self.add_updates(cx, &mut y)?;
        self.scale_dora(cx, &mut y)?;
        match self.base {
            Base::Linear => {}
            Base::Residual => be.axpy(&mut y, 1.0, cx.input(0)?)?,
            Base::Gelu => {
                if cx.wanted[1] {
                    let mut out = cx.alloc(1)?;
                    gelu::forward(be, &mut out, &y)?;
                    cx.outputs[1] = Some(out);
                }
            }
        }
        cx.outputs[0] = Some(y);
        Ok(())
    }

    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dora = self.adapters.iter().filter(|a| a.dora).count();
        if cx.params.len() < self.first_b() + self.adapters.len() + 2 * dora {
            return Err(super::missing("the weight of a linear layer"));
        }
        let dy = match self.base {
            // The reader of the GELU's output carried its gradient through the GELU
            // ([`super::GeluLinearResidual`]): `pre`'s gradient comes as it is.
            Base::Gelu if cx.grads_out[1].is_none() && cx.grads_out[0].is_some() => {
                cx.outputs[0].release();
                cx.take_grad_out(0)?
            }
            Base::Gelu => {
                let dout = cx.take_grad_out(1)?;
                let pre = cx.outputs[0].get()?;
                let mut dpre = be.empty(
                    pre.shape(),
                    pre.dtype(),
                    MemoryCategory::Activations,
                    &cx.grad_labels_out[0],
                )?;
                gelu::backward(be, &mut dpre, pre, &dout)?;
                cx.outputs[0].release();
                dpre
            }
            _ => cx.take_grad_out(0)?,
        };
        // DoRA: the magnitudes' gradients, then the rest propagates the rescaled `dy`
        // (the residual's gradient is the unscaled one).
        let (dy, unscaled) = if self.has_dora() {
            let scaled = self.dora_backward(cx, &dy)?;
            (scaled, Some(dy))
        } else {
            (dy, None)
        };
        let xi = self.x();
        let cols = dy.rows_cols().1;
        for (j, a) in self.adapters.iter().enumerate() {
            let part;
            let dy_j = if a.covers(cols) {
                &dy
            } else {
                let mut t = be.empty(
                    &with_width(dy.shape(), a.width),
                    dy.dtype(),
                    MemoryCategory::Activations,
                    &format!("{}.cols", dy.label()),
                )?;
                take_cols(be, &mut t, &dy, a.offset)?;
                part = t;
                &part
            };
            let hi = xi + 1 + j;
            let bi = self.first_b() + j;
            if cx.params[bi].wants_grad() {
                let h = cx.inputs[hi].get()?;
                be.matmul(
                    cx.params[bi].grad_mut(be)?,
                    dy_j,
                    h,
                    None,
                    true,
                    false,
                    true,
                )?;
            }
            cx.inputs[hi].release();
            let b = cx.params[bi].weight();
            cx.grads_in[hi]
                .overwrite(be, |dh| be.matmul(dh, dy_j, b, None, false, false, false))?;
        }
        input_grad(
            be,
            cx.params[0].weight(),
            &dy,
            &mut cx.grads_in[xi],
            self.transposed,
        )?;
        if self.base_trains {
            let (w, rest) = cx.params.split_at_mut(1);
            let bias = if self.bias { Some(&mut rest[0]) } else { None };
            param_grads(
                be,
                &mut w[0],
                bias,
                cx.inputs[xi].get()?,
                &dy,
                self.transposed,
            )?;
        }
        cx.inputs[xi].release();
        match self.base {
            Base::Residual => cx.grads_in[0].add(be, unscaled.unwrap_or(dy)),
            _ => Ok(()),
        }
    }
}
