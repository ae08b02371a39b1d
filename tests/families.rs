//! A model family written outside the crate: a short `impl Family` over Llama's config
//! that turns on three things of trainkit's shape vocabulary Llama does not use, Gemma's
//! RMS norm gains stored as offsets from 1 (`x · rstd · (1 + w)`), an embedding
//! multiplied by a constant, and a GeGLU MLP. Each equals its composed reference (Llama
//! with the gains `1 + w`, Llama with the embedding scaled, the tanh GELU times the up
//! projection), the GeGLU kernels give the CPU's results bit for bit on the CUDA emulator,
//! and the family trains with every recompute policy bitwise equal, gradients that match
//! finite differences, the exact memory prediction equal to the ledger, and the CPU's
//! losses on the emulator.

use crate::common;

use common::{corpus_loader, cpu, grads, randn, values};
use std::sync::Arc;
use trainkit::device::cuda::CudaBackend;
use trainkit::estimate::{predict, MicroBatch};
use trainkit::model::{Decoder, Family, Mlp, Shape};
use trainkit::ops::{gelu, glu, Gate};
use trainkit::{
    AdamW, Backend, CheckpointPolicy, CpuBackend, DType, Fp32, Full, Llama, LlamaConfig,
    MemoryCategory, MixedBf16, Model, NoRecompute, Precision, Result, Rng, Selective, Tensor,
    Trainer,
};

/// The downstream family: Llama's config, with norm gains stored as offsets from 1, the
/// embedding scaled and a GeGLU MLP when asked.
#[derive(Clone, Debug, PartialEq)]
struct Gemmaish {
    base: LlamaConfig,
    offset: bool,
    scale: Option<f32>,
    geglu: bool,
}

impl Family for Gemmaish {
    const MODEL_TYPE: &'static str = "gemmaish";

    fn shape(&self) -> Shape {
        Shape {
            norm_offset: self.offset,
            embedding_scale: self.scale,
            mlp: if self.geglu { Mlp::GeGlu } else { Mlp::SwiGlu },
            ..Family::shape(&self.base)
        }
    }

    fn validate(&self) -> Result<()> {
        Family::validate(&self.base)
    }

    fn hf_config(&self) -> serde_json::Value {
        Family::hf_config(&self.base)
    }
}

fn base(tied: bool) -> LlamaConfig {
    LlamaConfig {
        tie_word_embeddings: tied,
        ..common::tiny_llama_config()
    }
}

fn trainer(model: Box<dyn Model>, be: Arc<dyn Backend>) -> impl FnMut() -> f64 {
    let mut t = Trainer::builder(model, be, corpus_loader(8_000, 4, 2, 16))
        .build()
        .unwrap();
    move || t.step().unwrap().loss
}

/// Loss of `model` on one batch, after setting every parameter to `set(name, values)`.
fn loss_with(model: Box<dyn Model>, set: impl Fn(&str, &mut Vec<f32>), from: &[Vec<f32>]) -> f64 {
    let mut t = Trainer::builder(model, cpu(), corpus_loader(8_000, 4, 2, 16))
        .build()
        .unwrap();
    let batch = corpus_loader(8_000, 5, 2, 16).next_batch();
    let be = t.backend().clone();
    for (i, v) in from.iter().enumerate() {
        let mut v = v.clone();
        let name = t.params()[i].name().to_string();
        set(&name, &mut v);
        t.params_mut()[i].set_value(be.as_ref(), &v).unwrap();
    }
    t.loss_on(&batch).unwrap()
}

/// Random values for every parameter of `model`, drawn as the trainer initialises them,
/// then moved so that the norm gains are not all equal.
fn random_values(model: Box<dyn Model>) -> Vec<Vec<f32>> {
    let t = Trainer::builder(model, cpu(), corpus_loader(8_000, 4, 2, 16))
        .build()
        .unwrap();
    values(&t)
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            v.iter()
                .enumerate()
                .map(|(j, x)| x + 0.05 * (((i * 31 + j * 7) % 13) as f32 - 6.0) / 6.0)
                .collect()
        })
        .collect()
}

fn is_norm(name: &str) -> bool {
    name.ends_with("layernorm.weight") || name == "model.norm.weight"
}

/// A norm whose gains are offsets from 1 is Llama's norm with the gains `1 + w`.
#[test]
fn offset_gains_equal_llamas_norm_with_the_gains_plus_one() {
    let family = Gemmaish {
        base: base(true),
        offset: true,
        scale: None,
        geglu: false,
    };
    let v = random_values(Box::new(Decoder::new(family.clone()).unwrap()));
    let offset = loss_with(Box::new(Decoder::new(family).unwrap()), |_, _| {}, &v);
    let plain = loss_with(
        Box::new(Llama::new(base(true)).unwrap()),
        |name, v| {
            if is_norm(name) {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
        },
        &v,
    );
    assert!(
        ((offset - plain) / plain).abs() < 1e-6,
        "{offset} vs {plain}"
    );
}

/// A scaled embedding is Llama with the embedding's values scaled (an untied head, so
/// that only the input side changes).
#[test]
fn a_scaled_embedding_equals_llama_with_the_embedding_scaled() {
    let family = Gemmaish {
        base: base(false),
        offset: false,
        scale: Some(4.0),
        geglu: false,
    };
    let v = random_values(Box::new(Decoder::new(family.clone()).unwrap()));
    let scaled = loss_with(Box::new(Decoder::new(family).unwrap()), |_, _| {}, &v);
    let plain = loss_with(
        Box::new(Llama::new(base(false)).unwrap()),
        |name, v| {
            if name == "model.embed_tokens.weight" {
                v.iter_mut().for_each(|x| *x *= 4.0);
            }
        },
        &v,
    );
    assert!(
        ((scaled - plain) / plain).abs() < 1e-6,
        "{scaled} vs {plain}"
    );
    // A freshly initialised offset norm starts at the gains 1: its stored gains are 0.
    let model = Decoder::new(Gemmaish {
        base: base(true),
        offset: true,
        scale: Some(2.0),
        geglu: false,
    })
    .unwrap();
    let norms: Vec<_> = model
        .init_params()
        .into_iter()
        .filter(|p| is_norm(&p.name))
        .collect();
    assert_eq!(norms.len(), 5);
    assert!(norms
        .iter()
        .all(|p| p.init == trainkit::model::Init::Constant(0.0)));
}

fn family() -> Gemmaish {
    Gemmaish {
        base: base(true),
        offset: true,
        scale: Some(5.656_854),
        geglu: true,
    }
}

fn up(be: &dyn Backend, v: &[f32], shape: &[usize], dt: DType) -> Tensor {
    be.upload(v, shape, dt, MemoryCategory::Workspace, "t")
        .unwrap()
}

/// GeGLU's forward and backward on `be`: out, dgate_up.
fn geglu_on(be: &dyn Backend, rows: usize, f: usize, dt: DType) -> [Vec<f32>; 2] {
    let mut rng = Rng::new(3);
    let gu = up(be, &randn(&mut rng, rows * 2 * f, 2.0), &[rows, 2 * f], dt);
    let d = up(be, &randn(&mut rng, rows * f, 1.0), &[rows, f], dt);
    let mut out = up(be, &vec![0.0; rows * f], &[rows, f], dt);
    glu::forward(be, Gate::Gelu, &mut out, &gu).unwrap();
    let mut dgu = up(be, &vec![0.0; rows * 2 * f], &[rows, 2 * f], dt);
    glu::backward(be, Gate::Gelu, &mut dgu, &d, &gu).unwrap();
    [be.to_f32(&out).unwrap(), be.to_f32(&dgu).unwrap()]
}

/// GeGLU equals its composed reference, trainkit's tanh GELU of the gate times the up
/// projection, and its backward matches central differences of `Σ dout · out`.
#[test]
fn geglu_matches_the_gelu_of_the_gate_times_the_up_projection() {
    let be = CpuBackend::new();
    let (rows, f) = (5, 24);
    let mut rng = Rng::new(3);
    let gus = randn(&mut rng, rows * 2 * f, 2.0);
    let ds = randn(&mut rng, rows * f, 1.0);
    let [out, dgu] = geglu_on(&be, rows, f, DType::F32);
    let (gate, upv): (Vec<f32>, Vec<f32>) = (
        gus.chunks(2 * f).flat_map(|r| r[..f].to_vec()).collect(),
        gus.chunks(2 * f).flat_map(|r| r[f..].to_vec()).collect(),
    );
    let g = up(&be, &gate, &[rows, f], DType::F32);
    let mut act = up(&be, &vec![0.0; rows * f], &[rows, f], DType::F32);
    gelu::forward(&be, &mut act, &g).unwrap();
    let act = be.to_f32(&act).unwrap();
    for i in 0..rows * f {
        assert_eq!(out[i], act[i] * upv[i], "element {i}");
    }
    let loss = |gus: &[f32]| -> f64 {
        let mut l = 0.0;
        for r in 0..rows {
            for i in 0..f {
                let (x, u) = (gus[r * 2 * f + i] as f64, gus[r * 2 * f + f + i] as f64);
                let gelu = 0.5
                    * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3)))
                            .tanh());
                l += ds[r * f + i] as f64 * gelu * u;
            }
        }
        l
    };
    for at in [0, 7, f + 3, 2 * f + 5, rows * 2 * f - 1] {
        let h = 1e-3;
        let (mut p, mut m) = (gus.clone(), gus.clone());
        p[at] += h;
        m[at] -= h;
        let numeric = (loss(&p) - loss(&m)) / (2.0 * h as f64);
        let analytic = dgu[at] as f64;
        assert!(
            (numeric - analytic).abs() < 2e-3 * (1.0 + numeric.abs()),
            "dgate_up[{at}]: {analytic} vs {numeric}"
        );
    }
}

/// GeGLU's CUDA kernels on the emulator give the CPU's results bit for bit, in f32, bf16
/// and f16.
#[test]
fn geglu_kernels_match_the_cpu_bit_for_bit_on_the_emulator() {
    let Some(emu) = emulated() else { return };
    let be = CpuBackend::new();
    for dt in [DType::F32, DType::Bf16, DType::F16] {
        let want = geglu_on(&be, 9, 40, dt);
        let got = geglu_on(&emu, 9, 40, dt);
        for (w, g) in want.iter().zip(&got) {
            assert!(
                w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dt:?}"
            );
        }
    }
}

fn emulated() -> Option<CudaBackend> {
    match CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}");
            }
            eprintln!("families: CUDA emulator check SKIPPED: {e}");
            None
        }
    }
}

/// Gradients of the offset gains and the scaled embedding against central differences.
#[test]
fn gradients_match_finite_differences() {
    let (b, t) = (2, 12);
    let batch = corpus_loader(4_000, 7, b, t).next_batch();
    let mut trainer = common::gradient_probe(Decoder::new(family()).unwrap(), b, t);
    trainer.step().unwrap();
    let g = grads(&trainer);
    let names: Vec<String> = trainer.params().iter().map(|p| p.name().into()).collect();
    for (name, at) in [
        (
            "model.embed_tokens.weight",
            batch.inputs[2] as usize * 32 + 3,
        ),
        ("model.layers.0.input_layernorm.weight", 5),
        ("model.layers.1.post_attention_layernorm.weight", 17),
        ("model.norm.weight", 30),
        ("model.layers.1.self_attn.qkv_proj.weight", 77),
        ("model.layers.0.mlp.gate_up_proj.weight", 40),
        ("model.layers.0.mlp.gate_up_proj.weight", 48 * 32 + 40),
    ] {
        let i = names.iter().position(|n| n == name).unwrap();
        let analytic = g[i][at] as f64;
        common::check_central_difference("family", &mut trainer, &batch, (i, at), analytic);
    }
}

type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f64>);

fn run(precision: Box<dyn Precision>, policy: Box<dyn CheckpointPolicy>) -> Run {
    let model = Decoder::new(family()).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 2, 16))
        .precision(precision)
        .checkpoint(policy)
        .build()
        .unwrap();
    let losses = (0..2).map(|_| t.step().unwrap().loss).collect();
    (grads(&t), values(&t), losses)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Recomputation changes memory, never results, and the meta backend predicts the
/// ledger, category by category and in total.
#[test]
fn recompute_is_exact_and_the_prediction_equals_the_ledger() {
    for precision in [
        Box::new(Fp32) as Box<dyn Precision>,
        Box::new(MixedBf16 { fp32_grads: true }),
    ] {
        let (g0, v0, l0) = run(precision.clone(), Box::new(NoRecompute));
        for policy in [
            Box::new(Full) as Box<dyn CheckpointPolicy>,
            Box::new(Selective),
        ] {
            let what = format!("{precision:?} {policy:?}");
            let (g, v, l) = run(precision.clone(), policy.clone());
            assert_eq!(l, l0, "{what}: losses");
            assert!(bits(&g) == bits(&g0), "{what}: gradients");
            assert!(bits(&v) == bits(&v0), "{what}: weights");
            let predicted = predict(
                Box::new(Decoder::new(family()).unwrap()),
                MicroBatch {
                    batch_size: 2,
                    seq_len: 16,
                },
                precision.as_ref(),
                policy.as_ref(),
                &AdamW::default(),
            )
            .unwrap();
            let mut t = Trainer::builder(
                Decoder::new(family()).unwrap(),
                cpu(),
                corpus_loader(8_000, 3, 2, 16),
            )
            .precision(precision.clone())
            .checkpoint(policy)
            .build()
            .unwrap();
            for step in 1..=2 {
                let s = t.step().unwrap();
                common::step_matches_prediction(&s, &predicted, step, 1, &what);
            }
        }
    }
}

/// On the CUDA emulator the family gives the CPU's losses.
#[test]
fn the_family_on_the_emulator_tracks_the_cpu() {
    let Some(emu) = emulated() else { return };
    let emu = Arc::new(emu) as Arc<dyn Backend>;
    let mut on_cpu = trainer(Box::new(Decoder::new(family()).unwrap()), cpu());
    let mut on_emu = trainer(Box::new(Decoder::new(family()).unwrap()), emu);
    for step in 0..2 {
        let (want, got) = (on_cpu(), on_emu());
        assert!(
            ((got - want) / want).abs() < 1e-5,
            "step {step}: {got} vs {want}"
        );
    }
}

/// A family that does not say how `train`'s shape flags set its fields takes none: a
/// given one is refused by name, none given changes nothing.
#[test]
fn a_downstream_family_refuses_the_shape_flags_it_does_not_take() {
    use trainkit::model::ShapeFlags;
    let mut f = family();
    Family::reshape(&mut f, &ShapeFlags::default()).unwrap();
    assert_eq!(f, family());
    let err = Family::reshape(
        &mut f,
        &ShapeFlags {
            ffn: Some(64),
            ..ShapeFlags::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--ffn") && err.contains("no shape flags"),
        "{err}"
    );
}
