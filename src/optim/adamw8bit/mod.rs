//! AdamW with 8-bit moments (block-wise quantized, as bitsandbytes' `AdamW8bit`).
//!
//! The optimizer ([`AdamW8bit`]) and its kernel: one fused update of a parameter with
//! quantized moments ([`update`], an [`OpKernel`] call with its operand checks and FLOP
//! count), the CPU twin (`cpu.rs`) and the CUDA launch (`cuda.rs`, over
//! `kernels/adamw8bit.cu`). The block quantization itself is
//! [`quantize_block`]'s.

pub(crate) mod cpu;
pub(crate) mod cuda;
mod quantize;

pub use quantize::{code_table, code_value, dequantize_block, quantize_block, QUANT_BLOCK};

use super::adamw::{self, check_scale, AdamWStep};
use super::{state_layout, AdamW, GradScale, Optimizer, ParamUpdate, StateSlot};
use crate::device::cpu::elementwise::{cast, same_len};
use crate::device::cpu::{each, ensure, ensure_f32, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// Floating-point operations per element of an update: AdamW's 15, two products to
/// dequantize, two maxima and two divisions to requantize (the comparisons of the code
/// search are not counted).
const FLOPS: u64 = 21;

/// The two block-wise quantized moments of one parameter, as [`update`]
/// reads and rewrites them: for each moment, one u8 code per element of the parameter and
/// one f32 absolute maximum per block of [`QUANT_BLOCK`]
/// elements (the last block may be shorter). The first moment uses the signed dynamic
/// code, the second the unsigned one ([`code_value`]); a block whose
/// maximum is 0 holds zeros whatever its codes.
#[derive(Debug)]
pub struct QuantizedMoments<'a> {
    /// Codes of the first moment (u8, as many as the parameter's elements).
    pub m: &'a mut Tensor,
    /// Absolute maximum of the first moment per block (f32).
    pub m_absmax: &'a mut Tensor,
    /// Codes of the second moment (u8).
    pub v: &'a mut Tensor,
    /// Maximum of the second moment per block (f32).
    pub v_absmax: &'a mut Tensor,
}

impl QuantizedMoments<'_> {
    /// The same four tensors, borrowed again for one kernel run.
    fn reborrow(&mut self) -> QuantizedMoments<'_> {
        QuantizedMoments {
            m: self.m,
            m_absmax: self.m_absmax,
            v: self.v,
            v_absmax: self.v_absmax,
        }
    }
}

/// One AdamW update of `param` (f32) from `grad` with 8-bit moments: per block of
/// [`QUANT_BLOCK`] elements, the moments are dequantized,
/// updated in f32 exactly as [`adamw::update`] updates them (the value from the
/// unquantized new moments) and requantized to the nearest code with the block's new
/// absolute maximum, in one pass. `scale` and `compute` are as in [`adamw::update`]:
/// a multiplier that is not finite skips the update, leaving codes and maxima as they
/// were.
pub fn update(
    be: &dyn Backend,
    param: &mut Tensor,
    grad: &Tensor,
    moments: QuantizedMoments<'_>,
    hp: &AdamWStep,
    scale: Option<&Tensor>,
    compute: Option<&mut Tensor>,
) -> Result<()> {
    be.run(&mut Update {
        param,
        grad,
        moments,
        hp,
        scale,
        compute,
    })
}

/// The call of [`update`].
struct Update<'a> {
    param: &'a mut Tensor,
    grad: &'a Tensor,
    moments: QuantizedMoments<'a>,
    hp: &'a AdamWStep,
    scale: Option<&'a Tensor>,
    compute: Option<&'a mut Tensor>,
}

impl OpKernel for Update<'_> {
    fn name(&self) -> &'static str {
        "adamw8bit"
    }

    fn label(&self) -> &str {
        self.param.label()
    }

    fn check(&self) -> Result<()> {
        check(self.param, self.grad, &self.moments)?;
        if let Some(s) = self.scale {
            check_scale(s)?;
        }
        if let Some(c) = &self.compute {
            ensure_float("adamw8bit", &[c])?;
            same_len(c, self.param, "adamw8bit")?;
        }
        Ok(())
    }

    fn flops(&self) -> u64 {
        each(self.param.numel(), FLOPS)
    }

    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        let moments = self.moments.reborrow();
        cpu::update(self.param, self.grad, moments, self.hp, self.scale)?;
        if let Some(c) = self.compute.as_deref_mut() {
            cast(c, self.param);
        }
        Ok(())
    }

    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::update(
            be,
            self.param,
            self.grad,
            self.moments.reborrow(),
            self.hp,
            self.scale,
            self.compute.as_deref_mut(),
        )
    }
}

/// Checks the 8-bit AdamW operands (the contract every backend shares): f32 value, f32
/// or bf16 gradient of as many elements, u8 codes of as many elements, and one f32
/// absolute maximum per block of [`QUANT_BLOCK`] elements for each moment.
fn check(param: &Tensor, grad: &Tensor, moments: &QuantizedMoments<'_>) -> Result<()> {
    const OP: &str = "adamw8bit";
    ensure_f32(param, OP)?;
    ensure_float(OP, &[grad])?;
    let n = param.numel();
    let blocks = n.div_ceil(QUANT_BLOCK);
    ensure(grad.numel() == n, OP, || {
        format!("`{}`: the gradient must have {n} elements", param.label())
    })?;
    for codes in [&*moments.m, &*moments.v] {
        ensure(codes.dtype() == DType::U8 && codes.numel() == n, OP, || {
            format!(
                "`{}`: the moment codes `{}` must be u8 with {n} elements, not {} {:?}",
                param.label(),
                codes.label(),
                codes.dtype(),
                codes.shape()
            )
        })?;
    }
    for absmax in [&*moments.m_absmax, &*moments.v_absmax] {
        ensure(
            absmax.dtype() == DType::F32 && absmax.numel() == blocks,
            OP,
            || {
                format!(
                    "`{}`: the block maxima `{}` must be f32 with {blocks} elements (one per \
                     {QUANT_BLOCK}), not {} {:?}",
                    param.label(),
                    absmax.label(),
                    absmax.dtype(),
                    absmax.shape()
                )
            },
        )?;
    }
    Ok(())
}

/// [`AdamW`] whose two moments are stored in 8 bits: block-wise quantized over blocks of
/// [`QUANT_BLOCK`] elements with a dynamic non-linear code (signed for the first moment,
/// unsigned for the second, see [`code_value`]) and one f32 absolute
/// maximum per block. Each step dequantizes a block, updates it in f32 with AdamW's
/// arithmetic (PyTorch semantics: decoupled decay on tensors of rank >= 2, bias
/// correction, eps outside the square root) and requantizes it, in one pass
/// ([`update`]).
///
/// State: 2 bytes of codes per element plus 8 bytes per block of 256, about 2.03 bytes
/// per parameter instead of AdamW's 8. Tensors with fewer than `min_8bit_size` elements
/// (biases, norms) keep f32 moments and take the plain AdamW update, where quantizing
/// would save little and cost accuracy. The state slots of a parameter are
/// `exp_avg.codes`, `exp_avg.absmax`, `exp_avg_sq.codes`, `exp_avg_sq.absmax` (8-bit) or
/// `exp_avg`, `exp_avg_sq` (f32), and a checkpoint stores them as they are, so a resumed
/// run continues bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamW8bit {
    /// Base learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Numerical floor added to the root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay for matrices and embeddings.
    pub weight_decay: f32,
    /// Tensors with fewer elements keep f32 moments (bitsandbytes' `min_8bit_size`).
    pub min_8bit_size: usize,
}

impl Default for AdamW8bit {
    fn default() -> Self {
        let a = AdamW::default();
        AdamW8bit {
            lr: a.lr,
            beta1: a.beta1,
            beta2: a.beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
            min_8bit_size: Self::MIN_8BIT_SIZE,
        }
    }
}

impl AdamW8bit {
    /// The default `min_8bit_size`: tensors under 4096 elements keep f32 moments.
    pub const MIN_8BIT_SIZE: usize = 4096;

    /// The same hyper-parameters as `adamw`, with the default `min_8bit_size`.
    pub fn from_adamw(adamw: &AdamW) -> Self {
        AdamW8bit {
            lr: adamw.lr,
            beta1: adamw.beta1,
            beta2: adamw.beta2,
            eps: adamw.eps,
            weight_decay: adamw.weight_decay,
            min_8bit_size: Self::MIN_8BIT_SIZE,
        }
    }

    /// Whether a tensor of `numel` elements gets 8-bit moments.
    pub fn quantizes(&self, numel: usize) -> bool {
        numel >= self.min_8bit_size
    }

    /// Exact bytes of state for a tensor of `numel` elements: `2·numel + 8·blocks` when
    /// quantized, `8·numel` otherwise.
    pub fn state_bytes(&self, numel: usize) -> u64 {
        if self.quantizes(numel) {
            2 * numel as u64 + 8 * numel.div_ceil(QUANT_BLOCK) as u64
        } else {
            8 * numel as u64
        }
    }

    fn adamw(&self) -> AdamW {
        AdamW {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            state_dtype: Some(DType::F32),
        }
    }
}

#[typetag::serde(name = "adamw8bit")]
impl Optimizer for AdamW8bit {
    fn learning_rate(&self) -> f32 {
        self.lr
    }

    /// Two 8-bit moments (codes and per-block absmax each) for a tensor of at least
    /// `min_8bit_size` elements, two f32 moments for a smaller one.
    fn state_slots(&self, shape: &[usize], _kept: DType) -> Vec<StateSlot> {
        if !self.quantizes(shape.iter().product()) {
            return ["exp_avg", "exp_avg_sq"]
                .map(|m| StateSlot::new(m, shape, DType::F32))
                .to_vec();
        }
        let blocks = [shape.iter().product::<usize>().div_ceil(QUANT_BLOCK)];
        let mut slots = Vec::with_capacity(4);
        for m in ["exp_avg", "exp_avg_sq"] {
            slots.push(StateSlot::new(&format!("{m}.codes"), shape, DType::U8));
            slots.push(StateSlot::new(&format!("{m}.absmax"), &blocks, DType::F32));
        }
        slots
    }

    fn writes_compute(&self) -> bool {
        true
    }

    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        step: u64,
    ) -> Result<()> {
        self.adamw().validate()?;
        for p in params.iter_mut() {
            let hp = AdamWStep {
                lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: if p.decays { self.weight_decay } else { 0.0 },
                step,
                grad_scale: 1.0,
            };
            let scale = Some(grad_scale.tensor());
            let compute = p.compute.as_deref_mut();
            // The layout the state has (a resumed run keeps the one it was saved with).
            match &mut *p.state {
                [m, m_absmax, v, v_absmax] => {
                    let moments = QuantizedMoments {
                        m,
                        m_absmax,
                        v,
                        v_absmax,
                    };
                    update(backend, p.values, p.grad, moments, &hp, scale, compute)?
                }
                [m, v] => adamw::update(backend, p.values, p.grad, m, v, &hp, scale, compute)?,
                other => {
                    return Err(state_layout(
                        "adamw8bit",
                        p.name,
                        other.len(),
                        "4 (8-bit moments) or 2 (f32 moments)",
                    ))
                }
            }
        }
        Ok(())
    }

    /// 2: the codes' two bytes per parameter (the exact figure adds 8 bytes per block of
    /// 256 elements, about 0.03 per parameter, and 8 per element of tensors under
    /// `min_8bit_size`; see [`AdamW8bit::state_bytes`]).
    fn state_bytes_per_param(&self) -> usize {
        2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryCategory;
    use crate::optim::Param;
    use crate::trainer::update_params;

    use crate::device::CpuBackend;
    use crate::precision::Fp32;
    use crate::rng::Rng;

    fn param(be: &dyn Backend, name: &str, shape: &[usize], init: &[f32]) -> Param {
        Param::new(be, name, shape, init, &Fp32).unwrap()
    }

    fn set_grad(be: &dyn Backend, p: &mut Param, g: &[f32]) {
        let shape = p.shape().to_vec();
        let t = be
            .upload(g, &shape, DType::F32, MemoryCategory::Gradients, "g")
            .unwrap();
        be.cast(p.grad_mut(be).unwrap(), &t).unwrap();
    }

    fn scale(be: &dyn Backend, value: f32) -> Tensor {
        be.upload(&[value], &[1], DType::F32, MemoryCategory::Workspace, "s")
            .unwrap()
    }

    fn randn(rng: &mut Rng, n: usize, s: f64) -> Vec<f32> {
        (0..n).map(|_| (rng.normal() * s) as f32).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The nearest code in f64 (ties to the lower), with the unsigned code's floor.
    fn nearest(table: &[f32; 256], signed: bool, x: f64) -> usize {
        let mut best = 0;
        for (i, c) in table.iter().enumerate() {
            if (*c as f64 - x).abs() < (table[best] as f64 - x).abs() {
                best = i;
            }
        }
        if !signed && best == 0 && x > 0.0 {
            best = 1;
        }
        best
    }

    /// Step 2 of a quantized tensor (a partial last block, a scaled gradient) against an
    /// f64 reference of dequantize → AdamW → requantize from the codes step 1 left.
    #[test]
    fn one_update_matches_an_f64_reference() {
        let be = CpuBackend::new();
        let mut rng = Rng::new(5);
        let shape = [40usize, 130]; // 5200 elements: 20 full blocks and one of 80
        let n = 5200;
        let mut opt = AdamW8bit::default();
        let mut params = vec![param(&be, "w", &shape, &randn(&mut rng, n, 0.5))];
        set_grad(&be, &mut params[0], &randn(&mut rng, n, 0.1));
        let one = scale(&be, 1.0);
        update_params(
            &be,
            &mut opt,
            &mut params,
            1e-3,
            GradScale::new(&one).unwrap(),
            1,
            0,
        )
        .unwrap();
        let state: Vec<Vec<f32>> = params[0]
            .state()
            .iter()
            .map(|t| be.to_f32(t).unwrap())
            .collect();
        assert_eq!(params[0].state()[0].dtype(), DType::U8);
        let p0 = be.to_f32(params[0].value()).unwrap();
        let g = randn(&mut rng, n, 0.1);
        set_grad(&be, &mut params[0], &g);
        let (lr, clip, step) = (2e-3f32, 0.5f32, 2u64);
        let s = scale(&be, clip);
        update_params(
            &be,
            &mut opt,
            &mut params,
            lr,
            GradScale::new(&s).unwrap(),
            step,
            0,
        )
        .unwrap();

        let (signed, unsigned) = (code_table(true), code_table(false));
        let (b1, b2, eps, wd) = (
            opt.beta1 as f64,
            opt.beta2 as f64,
            opt.eps as f64,
            opt.weight_decay as f64,
        );
        let bc1 = 1.0 - b1.powi(step as i32);
        let bc2 = 1.0 - b2.powi(step as i32);
        let (mut m, mut v, mut p) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
        for i in 0..n {
            let b = i / QUANT_BLOCK;
            let gi = g[i] as f64 * clip as f64;
            let m_old = signed[state[0][i] as usize] as f64 * state[1][b] as f64;
            let v_old = unsigned[state[2][i] as usize] as f64 * state[3][b] as f64;
            m[i] = b1 * m_old + (1.0 - b1) * gi;
            v[i] = b2 * v_old + (1.0 - b2) * gi * gi;
            p[i] = p0[i] as f64 * (1.0 - lr as f64 * wd)
                - lr as f64 / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
        }
        let got_p = be.to_f32(params[0].value()).unwrap();
        for i in 0..n {
            assert!(
                (got_p[i] as f64 - p[i]).abs() <= 1e-6 * p[i].abs().max(1e-3),
                "value {i}: {} vs {}",
                got_p[i],
                p[i]
            );
        }
        let got: Vec<Vec<f32>> = params[0]
            .state()
            .iter()
            .map(|t| be.to_f32(t).unwrap())
            .collect();
        let mut off_by_one = 0;
        for (block, start) in (0..n).step_by(QUANT_BLOCK).enumerate() {
            let end = (start + QUANT_BLOCK).min(n);
            let m_max = m[start..end].iter().fold(0f64, |a, x| a.max(x.abs()));
            let v_max = v[start..end].iter().fold(0f64, |a, x| a.max(*x));
            assert!(
                (got[1][block] as f64 - m_max).abs() <= 1e-6 * m_max,
                "m absmax {block}"
            );
            assert!(
                (got[3][block] as f64 - v_max).abs() <= 1e-6 * v_max,
                "v absmax {block}"
            );
            for i in start..end {
                for (codes, table, signed, want) in [
                    (&got[0], &signed, true, m[i] / m_max),
                    (&got[2], &unsigned, false, v[i] / v_max),
                ] {
                    let want = nearest(table, signed, want) as i32;
                    let c = codes[i] as i32;
                    // f32 and f64 may fall on either side of a midpoint.
                    assert!((c - want).abs() <= 1, "code {i}: {c} vs {want}");
                    off_by_one += (c != want) as usize;
                }
            }
        }
        assert!(off_by_one * 1000 < 2 * n, "{off_by_one} codes off by one");
    }

    /// Tensors under `min_8bit_size` keep f32 moments and take AdamW's update bit for bit;
    /// the ledger holds exactly [`AdamW8bit::state_bytes`] for each tensor.
    #[test]
    fn small_tensors_keep_f32_state_and_adamw_math() {
        let mut rng = Rng::new(9);
        let shapes: [&[usize]; 3] = [&[10], &[64, 32], &[64, 64]];
        let inits: Vec<Vec<f32>> = shapes
            .iter()
            .map(|s| randn(&mut rng, s.iter().product(), 1.0))
            .collect();
        let grads: Vec<Vec<f32>> = inits
            .iter()
            .map(|v| randn(&mut rng, v.len(), 0.1))
            .collect();
        let run = |opt: &mut dyn Optimizer| {
            let be = CpuBackend::new();
            let mut params: Vec<Param> = shapes
                .iter()
                .zip(&inits)
                .map(|(s, v)| param(&be, "p", s, v))
                .collect();
            let one = scale(&be, 1.0);
            for step in 1..=3 {
                for (p, g) in params.iter_mut().zip(&grads) {
                    set_grad(&be, p, g);
                }
                update_params(
                    &be,
                    opt,
                    &mut params,
                    1e-2,
                    GradScale::new(&one).unwrap(),
                    step,
                    0,
                )
                .unwrap();
            }
            let state = be
                .ledger()
                .snapshot()
                .live
                .get(MemoryCategory::OptimizerState);
            let values: Vec<Vec<f32>> = params
                .iter()
                .map(|p| be.to_f32(p.value()).unwrap())
                .collect();
            let dtypes: Vec<DType> = params.iter().map(|p| p.state()[0].dtype()).collect();
            (values, dtypes, state)
        };
        let mut q = AdamW8bit::default();
        let (v8, d8, bytes8) = run(&mut q);
        let (v32, _, bytes32) = run(&mut AdamW::default());
        assert_eq!(d8, [DType::F32, DType::F32, DType::U8]);
        for i in 0..2 {
            assert_eq!(
                bits(&v8[i]),
                bits(&v32[i]),
                "tensor {i}: the f32 path is AdamW's"
            );
        }
        assert_ne!(bits(&v8[2]), bits(&v32[2]));
        let want: u64 = shapes
            .iter()
            .map(|s| q.state_bytes(s.iter().product()))
            .sum();
        assert_eq!(bytes8, want);
        assert_eq!(want, 8 * 10 + 8 * 2048 + 2 * 4096 + 8 * 16);
        assert_eq!(bytes32, 8 * (10 + 2048 + 4096));
    }

    /// A multiplier that is not finite skips the update: values, codes and maxima stay
    /// bitwise as they were.
    #[test]
    fn a_non_finite_scale_leaves_values_and_state_untouched() {
        let be = CpuBackend::new();
        let mut rng = Rng::new(2);
        let n = 4096 + 100;
        let mut opt = AdamW8bit::default();
        let mut params = vec![param(&be, "w", &[n], &randn(&mut rng, n, 1.0))];
        set_grad(&be, &mut params[0], &randn(&mut rng, n, 0.1));
        let one = scale(&be, 1.0);
        update_params(
            &be,
            &mut opt,
            &mut params,
            1e-2,
            GradScale::new(&one).unwrap(),
            1,
            0,
        )
        .unwrap();
        let read = |p: &Param| -> Vec<Vec<u32>> {
            std::iter::once(p.value())
                .chain(p.state())
                .map(|t| bits(&be.to_f32(t).unwrap()))
                .collect()
        };
        let before = read(&params[0]);
        for bad in [f32::NAN, f32::INFINITY] {
            let s = scale(&be, bad);
            update_params(
                &be,
                &mut opt,
                &mut params,
                1e-2,
                GradScale::new(&s).unwrap(),
                2,
                0,
            )
            .unwrap();
            assert_eq!(read(&params[0]), before, "{bad}");
        }
    }

    #[test]
    fn bad_operands_and_settings_are_errors() {
        let be = CpuBackend::new();
        let mut params = vec![param(&be, "w", &[8], &[0.5; 8])];
        set_grad(&be, &mut params[0], &[0.1; 8]);
        let one = scale(&be, 1.0);
        let mut opt = AdamW8bit {
            beta2: 1.5,
            ..AdamW8bit::default()
        };
        let err = update_params(
            &be,
            &mut opt,
            &mut params,
            1e-2,
            GradScale::new(&one).unwrap(),
            1,
            0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("optimizer.beta2"), "{err}");
        // Codes of the wrong dtype or size are refused by the op's shared check.
        let mut p = be
            .upload(
                &[0.0; 300],
                &[300],
                DType::F32,
                MemoryCategory::Weights,
                "p",
            )
            .unwrap();
        let g = be
            .upload(
                &[0.0; 300],
                &[300],
                DType::F32,
                MemoryCategory::Gradients,
                "g",
            )
            .unwrap();
        let z = |dtype, n: usize, l: &str| {
            be.zeros(&[n], dtype, MemoryCategory::OptimizerState, l)
                .unwrap()
        };
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
            grad_scale: 1.0,
        };
        for (m_dtype, blocks, want) in
            [(DType::F32, 2, "must be u8"), (DType::U8, 1, "one per 256")]
        {
            let (mut m, mut ma) = (z(m_dtype, 300, "m"), z(DType::F32, blocks, "ma"));
            let (mut v, mut va) = (z(DType::U8, 300, "v"), z(DType::F32, 2, "va"));
            let moments = QuantizedMoments {
                m: &mut m,
                m_absmax: &mut ma,
                v: &mut v,
                v_absmax: &mut va,
            };
            let err = update(&be, &mut p, &g, moments, &hp, None, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
        }
        // Arithmetic ops refuse u8 codes with an error naming the op.
        let mut codes = z(DType::U8, 300, "codes");
        let err = be.scale(&mut codes, 2.0).unwrap_err().to_string();
        assert!(err.contains("scale") && err.contains("u8"), "{err}");
        let err = be.add(&mut p, &codes, &g).unwrap_err().to_string();
        assert!(err.contains("add") && err.contains("codes"), "{err}");
        let err = be
            .upload(&[1.5], &[1], DType::U8, MemoryCategory::Workspace, "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("integers 0 to 255"), "{err}");
        let c = be
            .upload(
                &[0.0, 7.0, 255.0],
                &[3],
                DType::U8,
                MemoryCategory::Workspace,
                "x",
            )
            .unwrap();
        assert_eq!(c.bytes(), 3);
        assert_eq!(be.to_f32(&c).unwrap(), [0.0, 7.0, 255.0]);
    }
}
