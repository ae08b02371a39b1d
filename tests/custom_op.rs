//! An op node and a model written outside trainkit, as a downstream crate would: a
//! squared-ReLU activation (`relu(x)²`, Primer's) whose forward and backward are
//! `CustomKernel`s with CUDA C source and CPU twins, and a GPT-2 whose MLP uses it, built
//! as a graph of trainkit's op nodes plus this one and run by trainkit's executor.
//!
//! It checks the op against its composed reference and finite differences, trains on the
//! CPU, keeps recomputation bitwise exact and the exact memory prediction byte-equal to the
//! ledger (the executor and the meta backend treat the user's node as their own), gives
//! the CPU's losses on the CUDA emulator, and compiles with NVRTC.
//!
//! On a GPU (the GPU bundle runs this binary there), the same model trains with the op and
//! with Lion (examples/lion/lion.rs, an optimizer whose update is a user kernel too) as on
//! the CPU: the check of user kernels compiled by NVRTC and launched on a real device.
//!
//! The emulator check skips with a printed reason where no C++ compiler runs, unless
//! `TRAINKIT_REQUIRE_EMULATOR` is set; the NVRTC check skips where NVRTC or the CUDA
//! headers are missing, unless `TRAINKIT_REQUIRE_NVRTC=1`; the GPU check skips where no GPU
//! answers.

mod common;
#[path = "../examples/lion/lion.rs"]
#[allow(dead_code)]
mod lion;

use common::{corpus_loader, tiny_config};
use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use trainkit::checkpoint::{Full, NoRecompute, Tags};
use trainkit::device::cuda::kernels::{
    compile, custom_full_source, find_include_dir, nvrtc_version, ptx_entries, CompileOptions,
};
use trainkit::device::cuda::{probe, CudaBackend};
use trainkit::device::CustomKernel;
use trainkit::estimate::{predict, MicroBatch};
use trainkit::model::{exec, Batch, Graph, ParamInit, Pass, PassStats, Section, Value};
use trainkit::ops::{
    BackwardCx, Classifier, ForwardCx, LayerNorm, LearnedEmbedding, Linear, LinearResidual, Op,
    Saves,
};
use trainkit::{
    Backend, CheckpointPolicy, CpuBackend, DType, Fp32, Gpt2, Gpt2Config, MemoryCategory, Model,
    Result, Rng, SamplingOptions, Tensor, Trainer,
};

/// Writes to the real stderr, past the test harness's capture.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "custom_op: {line}");
}

/// `out = relu(x)²`.
#[derive(Debug)]
struct SquaredReluForward;

impl CustomKernel for SquaredReluForward {
    fn name(&self) -> &'static str {
        "squared_relu_forward"
    }
    fn source(&self) -> &'static str {
        r#"
extern "C" __global__ void squared_relu_forward(float* out, const float* x, i64 n) {
    TK_FOR_EACH(i, n) {
        const float r = x[i] > 0.0f ? x[i] : 0.0f;
        out[i] = r * r;
    }
}
"#
    }
    fn cpu(
        &self,
        outputs: &mut [&mut [f32]],
        inputs: &[&[f32]],
        _: &[f32],
        n: usize,
    ) -> Result<()> {
        for i in 0..n {
            let r = inputs[0][i].max(0.0);
            outputs[0][i] = r * r;
        }
        Ok(())
    }
    fn flops_per_element(&self) -> u64 {
        2
    }
}

/// `dx = 2·relu(x)·dout`.
#[derive(Debug)]
struct SquaredReluBackward;

impl CustomKernel for SquaredReluBackward {
    fn name(&self) -> &'static str {
        "squared_relu_backward"
    }
    fn source(&self) -> &'static str {
        r#"
extern "C" __global__ void squared_relu_backward(float* dx, const float* x,
                                                 const float* dout, i64 n) {
    TK_FOR_EACH(i, n) {
        const float r = x[i] > 0.0f ? x[i] : 0.0f;
        dx[i] = 2.0f * r * dout[i];
    }
}
"#
    }
    fn cpu(
        &self,
        outputs: &mut [&mut [f32]],
        inputs: &[&[f32]],
        _: &[f32],
        n: usize,
    ) -> Result<()> {
        for i in 0..n {
            let r = inputs[0][i].max(0.0);
            outputs[0][i] = 2.0 * r * inputs[1][i];
        }
        Ok(())
    }
    fn flops_per_element(&self) -> u64 {
        3
    }
}

/// The op node: input `x`, output `relu(x)²`; backward reads `x`.
#[derive(Debug)]
struct SquaredRelu;

impl Op for SquaredRelu {
    fn name(&self) -> &'static str {
        "squared_relu"
    }
    fn output_shapes(
        &self,
        inputs: &[&Tensor],
        _weights: &[&Tensor],
        dtype: DType,
        _batch: [usize; 2],
    ) -> Result<Vec<(Vec<usize>, DType)>> {
        Ok(vec![(inputs[0].shape().to_vec(), dtype)])
    }
    fn saves(&self) -> Saves {
        Saves {
            inputs: 0b1,
            outputs: 0,
        }
    }
    fn forward(&self, cx: &mut ForwardCx<'_>) -> Result<()> {
        let mut y = cx.alloc(0)?;
        cx.backend
            .custom(&SquaredReluForward, &mut [&mut y], &[cx.input(0)?], &[])?;
        cx.outputs[0] = Some(y);
        Ok(())
    }
    fn backward(&self, cx: &mut BackwardCx<'_>) -> Result<()> {
        let be = cx.backend;
        let dout = cx.take_grad_out(0)?;
        let x = cx.inputs[0].get()?;
        cx.grads_in[0].overwrite(be, |dx| {
            be.custom(&SquaredReluBackward, &mut [dx], &[x, &dout], &[])
        })?;
        cx.inputs[0].release();
        Ok(())
    }
}

/// GPT-2 with a squared-ReLU MLP: GPT-2's parameters (so its initialisation and saving
/// are reused), its graph with the GELU replaced, trainkit's executor.
#[derive(Debug)]
struct ReluSquaredGpt {
    inner: Gpt2,
    graph: Graph,
}

impl ReluSquaredGpt {
    fn new(config: Gpt2Config) -> Self {
        let index: HashMap<String, usize> = config
            .param_shapes()
            .into_iter()
            .enumerate()
            .map(|(i, (name, _))| (name, i))
            .collect();
        let p = |name: &str| index[name];
        let eps = config.layer_norm_epsilon;
        let linear = Linear {
            bias: true,
            transposed: false,
        };
        let residual = LinearResidual {
            bias: true,
            transposed: false,
        };
        let mut embedding = Section::new(Value::new("tokens", "tokens", Tags::NONE));
        let x = embedding.value("input", "h.0.input", Tags::LAYER_INPUT);
        embedding.node(
            LearnedEmbedding,
            &[],
            &[x],
            &[p("transformer.wte.weight"), p("transformer.wpe.weight")],
        );
        embedding.output = x;
        let layers = (0..config.n_layer)
            .map(|l| {
                let h = |s: &str| p(&format!("transformer.h.{l}.{s}"));
                let label = |s: &str| format!("h.{l}.{s}");
                let (attn, mlp) = (Tags::ATTENTION, Tags::MLP);
                let mut s = Section::new(Value::new("input", label("input"), Tags::LAYER_INPUT));
                let ln1 = s.value("ln1_out", label("ln1_out"), attn | Tags::NORM_OUT);
                let ln1_stats = s.value("ln1_stats", label("ln1_stats"), attn | Tags::NORM_STATS);
                let qkv = s.value("qkv", label("qkv"), attn | Tags::PROJECTION);
                let probs = s.value("attn_probs", label("attn_probs"), attn | Tags::QUADRATIC);
                let attn_out = s.value("attn_out", label("attn_out"), attn);
                let res = s.value("residual", label("residual"), Tags::RESIDUAL);
                let ln2 = s.value("ln2_out", label("ln2_out"), mlp | Tags::NORM_OUT);
                let ln2_stats = s.value("ln2_stats", label("ln2_stats"), mlp | Tags::NORM_STATS);
                let fc = s.value(
                    "fc_out",
                    label("fc_out"),
                    mlp | Tags::WIDE | Tags::PROJECTION,
                );
                let act = s.value("act_out", label("act_out"), mlp | Tags::WIDE);
                let next = if l + 1 < config.n_layer {
                    format!("h.{}.input", l + 1)
                } else {
                    "ln_f.input".to_string()
                };
                let out = s.value("output", next, Tags::LAYER_INPUT);
                s.node(
                    LayerNorm { eps },
                    &[0],
                    &[ln1, ln1_stats],
                    &[h("ln_1.weight"), h("ln_1.bias")],
                );
                s.node(
                    linear,
                    &[ln1],
                    &[qkv],
                    &[h("attn.c_attn.weight"), h("attn.c_attn.bias")],
                );
                s.node(
                    trainkit::ops::CausalAttention {
                        heads: trainkit::ops::Heads::mha(config.n_head, config.n_embd),
                    },
                    &[qkv],
                    &[probs, attn_out],
                    &[],
                );
                s.node(
                    residual,
                    &[0, attn_out],
                    &[res],
                    &[h("attn.c_proj.weight"), h("attn.c_proj.bias")],
                );
                s.node(
                    LayerNorm { eps },
                    &[res],
                    &[ln2, ln2_stats],
                    &[h("ln_2.weight"), h("ln_2.bias")],
                );
                s.node(
                    linear,
                    &[ln2],
                    &[fc],
                    &[h("mlp.c_fc.weight"), h("mlp.c_fc.bias")],
                );
                s.node(SquaredRelu, &[fc], &[act], &[]);
                s.node(
                    residual,
                    &[res, act],
                    &[out],
                    &[h("mlp.c_proj.weight"), h("mlp.c_proj.bias")],
                );
                s.output = out;
                s
            })
            .collect();
        let mut head = Section::new(Value::new("input", "ln_f.input", Tags::NONE));
        let out = head.value("out", "ln_f.out", Tags::NORM_OUT);
        let stats = head.value("stats", "ln_f.stats", Tags::NORM_STATS);
        let logits = head.value("logits", "logits", Tags::NONE);
        head.node(
            LayerNorm { eps },
            &[0],
            &[out, stats],
            &[p("transformer.ln_f.weight"), p("transformer.ln_f.bias")],
        );
        head.node(
            Classifier,
            &[out],
            &[logits],
            &[p("transformer.wte.weight")],
        );
        head.output = logits;
        ReluSquaredGpt {
            inner: Gpt2::new(config).unwrap(),
            graph: Graph {
                embedding,
                layers,
                head,
            },
        }
    }
}

impl Model for ReluSquaredGpt {
    fn describe(&self) -> String {
        format!("squared-ReLU {}", self.inner.describe())
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_seq_len(&self) -> usize {
        self.inner.max_seq_len()
    }
    fn init_params(&self) -> Vec<ParamInit> {
        self.inner.init_params()
    }
    fn forward_backward(
        &self,
        pass: &mut Pass<'_>,
        batch: &Batch,
        grad_scale: f32,
        losses: &mut Tensor,
    ) -> Result<PassStats> {
        let vocab = self.vocab_size();
        exec::forward_backward(&self.graph, pass, batch, vocab, grad_scale, losses)
    }
    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<f64> {
        exec::loss(&self.graph, pass, batch, self.vocab_size())
    }
    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> Result<Vec<f32>> {
        exec::logits(&self.graph, pass, batch)
    }
    fn write_config(&self, dir: &std::path::Path) -> Result<()> {
        self.inner.write_config(dir)
    }
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.inner.flops_per_token(seq_len)
    }
}

fn trainer(
    backend: Arc<dyn Backend>,
    policy: Box<dyn CheckpointPolicy>,
) -> Trainer<
    Fp32,
    Box<dyn CheckpointPolicy>,
    trainkit::AdamW,
    trainkit::Constant,
    trainkit::PeakTracker,
> {
    Trainer::builder(
        ReluSquaredGpt::new(tiny_config()),
        backend,
        corpus_loader(20_000, 7, 2, 32),
    )
    .checkpoint(policy)
    .build()
    .unwrap()
}

#[test]
fn the_op_matches_its_composed_reference_and_finite_differences() {
    let be = CpuBackend::new();
    let xs: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.07).collect();
    let douts: Vec<f32> = (0..64).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
    let up = |v: &[f32], label: &str| {
        be.upload(v, &[8, 8], DType::F32, MemoryCategory::Workspace, label)
            .unwrap()
    };
    let (x, dout) = (up(&xs, "x"), up(&douts, "dout"));
    let mut y = up(&[0.0; 64], "y");
    be.custom(&SquaredReluForward, &mut [&mut y], &[&x], &[])
        .unwrap();
    let mut dx = up(&[0.0; 64], "dx");
    be.custom(&SquaredReluBackward, &mut [&mut dx], &[&x, &dout], &[])
        .unwrap();
    let (y, dx) = (be.to_f32(&y).unwrap(), be.to_f32(&dx).unwrap());
    for i in 0..64 {
        // The composed reference: relu, then a square.
        let r = xs[i].max(0.0);
        assert_eq!(y[i], r * r, "forward at {}", xs[i]);
        // Central differences of relu(x)² (away from the kink at 0).
        let f = |v: f64| v.max(0.0).powi(2);
        let h = 1e-3;
        let x = xs[i] as f64;
        let numeric = (f(x + h) - f(x - h)) / (2.0 * h) * douts[i] as f64;
        assert!(
            (dx[i] as f64 - numeric).abs() < 1e-4,
            "backward at {x}: {} vs {numeric}",
            dx[i]
        );
    }
}

#[test]
fn a_model_with_the_users_op_trains_recomputes_exactly_and_is_predicted_exactly() {
    let cpu = || -> Arc<dyn Backend> { Arc::new(CpuBackend::new()) };
    let mut keep = trainer(cpu(), Box::new(NoRecompute));
    let mut full = trainer(cpu(), Box::new(Full));
    let (mut first, mut last) = (0.0, 0.0);
    for step in 0..12 {
        let a = keep.step().unwrap();
        let b = full.step().unwrap();
        assert_eq!(a.loss, b.loss, "recomputation changed the loss");
        assert_eq!(a.grad_norm, b.grad_norm);
        assert!(b.stash.recomputed_bytes > 0);
        if step == 0 {
            first = a.loss;
        }
        last = a.loss;
    }
    assert!(last < first - 0.3, "the loss went from {first} to {last}");

    // The exact prediction runs the same graph on the meta backend.
    for (policy, t) in [
        (
            Box::new(NoRecompute) as Box<dyn CheckpointPolicy>,
            &mut keep,
        ),
        (Box::new(Full), &mut full),
    ] {
        let p = predict(
            Box::new(ReluSquaredGpt::new(tiny_config())),
            MicroBatch {
                batch_size: 2,
                seq_len: 32,
            },
            &Fp32,
            policy.as_ref(),
            &trainkit::AdamW::default(),
        )
        .unwrap();
        let s = t.step().unwrap();
        assert_eq!(s.memory.peak, p.peak, "{policy:?}");
        assert_eq!(s.memory.peak_total, p.peak_total, "{policy:?}");
    }

    // Sampling reads the next token's logits through the trait's default (the last row
    // of every row's logits), and draws with them.
    let tokens: Vec<u32> = (0..9).map(|i| (i * 31 + 2) % 200).collect();
    let all = keep.logits(&tokens).unwrap();
    let last = keep.last_logits(&tokens, None).unwrap();
    assert_eq!(last, all[all.len() - last.len()..]);
    assert_eq!(last.len() * tokens.len(), all.len());
    let mut rng = Rng::new(1);
    let drawn = keep
        .generate(
            &tokens,
            3,
            SamplingOptions {
                temperature: 0.0,
                ..SamplingOptions::default()
            },
            &mut rng,
        )
        .unwrap();
    assert_eq!(drawn.len(), 3);
}

#[test]
fn the_users_op_and_optimizer_run_on_the_cuda_emulator_as_on_the_cpu() {
    let emulated = match CudaBackend::emulated() {
        Ok(b) => b,
        Err(e) => {
            if std::env::var_os("TRAINKIT_REQUIRE_EMULATOR").is_some() {
                panic!("the CUDA emulator is required (TRAINKIT_REQUIRE_EMULATOR) but: {e}");
            }
            say(&format!("CUDA emulator check SKIPPED: {e}"));
            return;
        }
    };
    tracks_the_cpu(Arc::new(emulated), "the emulator", 1e-5);
}

#[test]
fn the_users_kernels_compile_with_nvrtc() {
    let found = nvrtc_version().and_then(|v| Ok((find_include_dir()?, v)));
    let (include, version) = match found {
        Ok(found) => found,
        Err(e) => {
            if std::env::var("TRAINKIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("TRAINKIT_REQUIRE_NVRTC=1, but NVRTC cannot run: {e}");
            }
            say(&format!("NVRTC check skipped: {e}"));
            return;
        }
    };
    let kernels: [&dyn CustomKernel; 2] = [&SquaredReluForward, &SquaredReluBackward];
    for kernel in kernels {
        let source = custom_full_source(kernel);
        for arch in ["sm_90", "sm_80"] {
            let ptx = compile(&source, &CompileOptions::new(arch, &include))
                .unwrap_or_else(|e| panic!("{arch}: {e}"))
                .ptx;
            assert_eq!(ptx_entries(&ptx), vec![kernel.name()], "{arch}");
        }
        say(&format!(
            "NVRTC {}.{} compiled {} for sm_90 and sm_80",
            version.0,
            version.1,
            kernel.name()
        ));
    }
}

#[test]
fn the_users_op_and_optimizer_run_on_a_gpu_as_on_the_cpu() {
    let info = match probe() {
        Ok(info) => info,
        Err(reason) => {
            say(&format!("GPU checks SKIPPED: no usable GPU ({reason})"));
            return;
        }
    };
    let gpu = CudaBackend::new(info.ordinal)
        .unwrap_or_else(|e| panic!("{info} answers but the backend fails: {e}"));
    say(&format!("GPU checks run on {info}"));
    tracks_the_cpu(Arc::new(gpu), "the GPU", 1e-4);
}

/// Three steps of the squared-ReLU GPT-2 with full recomputation and Lion on `backend`
/// give the CPU's losses within `tolerance` (relative).
fn tracks_the_cpu(backend: Arc<dyn Backend>, name: &str, tolerance: f64) {
    let build = |backend: Arc<dyn Backend>| {
        Trainer::builder(
            ReluSquaredGpt::new(tiny_config()),
            backend,
            corpus_loader(20_000, 7, 2, 32),
        )
        .checkpoint(Box::new(Full) as Box<dyn CheckpointPolicy>)
        .optimizer(lion::Lion {
            lr: 3e-4,
            ..Default::default()
        })
        .build()
        .unwrap()
    };
    let (mut there, mut cpu) = (build(backend), build(Arc::new(CpuBackend::new())));
    for step in 1..=3 {
        let (a, b) = (there.step().unwrap().loss, cpu.step().unwrap().loss);
        say(&format!("step {step}: loss {a} on {name}, {b} on the CPU"));
        assert!(
            ((a - b) / b).abs() < tolerance,
            "step {step}: {name} {a}, CPU {b}"
        );
    }
}

/// An op node of a downstream crate reaches its parameters' weights and gradient buffers
/// as trainkit's own nodes do (`BackwardCx::params`, a `ParamGrad` each).
#[test]
fn a_downstream_node_accumulates_parameter_gradients() {
    let be = CpuBackend::new();
    let mut p =
        trainkit::optim::Param::new(&be, "gain", &[4], &[1.0, 2.0, 3.0, 4.0], &Fp32).unwrap();
    let delta = be
        .upload(
            &[0.5; 4],
            &[4],
            DType::F32,
            MemoryCategory::Workspace,
            "delta",
        )
        .unwrap();
    for _ in 0..2 {
        let mut view = p.for_backward();
        assert!(view.wants_grad());
        let (weight, grad) = view.weight_and_grad(&be).unwrap();
        assert_eq!(be.to_f32(weight).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        be.axpy(grad, 1.0, &delta).unwrap();
    }
    be.axpy(p.grad_mut(&be).unwrap(), 2.0, &delta).unwrap();
    assert_eq!(be.to_f32(p.grad().unwrap()).unwrap(), vec![2.0; 4]);
    // A frozen parameter's view wants no gradient; an op that must write one anyway (a
    // norm's gain) gets a buffer that goes with the view, never into the parameter.
    let mut frozen =
        trainkit::optim::Param::frozen(&be, "gain", &[4], &[1.0, 2.0, 3.0, 4.0], &Fp32).unwrap();
    {
        let mut view = frozen.for_backward();
        assert!(!view.wants_grad());
        be.axpy(view.grad_mut(&be).unwrap(), 1.0, &delta).unwrap();
    }
    assert!(frozen.grad().is_none());
}
