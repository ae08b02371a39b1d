//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod adapters;
pub mod mirrored;

use std::sync::Arc;
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::{Backend, CpuBackend, DType, MemoryCategory, Rng, Tensor};

/// Runs the `trainkit` binary with `args`: whether it succeeded, its stdout and stderr.
pub fn trainkit(args: &[&str]) -> (bool, String, String) {
    trainkit_with_env(args, &[], &[])
}

/// [`trainkit`] with the environment variables `set` set and `unset` removed.
pub fn trainkit_with_env(
    args: &[&str],
    set: &[(&str, &std::ffi::OsStr)],
    unset: &[&str],
) -> (bool, String, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_trainkit"));
    command.args(args).envs(set.iter().copied());
    for name in unset {
        command.env_remove(name);
    }
    let out = command.output().expect("run trainkit");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the `trainkit` binary with `args`, which must succeed: its stdout.
pub fn trainkit_ok(args: &[&str]) -> String {
    let (ok, out, err) = trainkit(args);
    assert!(ok, "{args:?}: {out}\n{err}");
    out
}

/// The flags of a small run on the CPU: batch 2 × 32, no evaluation.
pub const SMALL_RUN: [&str; 8] = [
    "--device",
    "cpu",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
];

/// A short English text (1800 bytes) as `dir/text.txt`, for small runs on bytes.
pub fn small_text(dir: &std::path::Path) -> std::path::PathBuf {
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    text
}

/// `trainkit eval --json`'s loss of the model in `model` on the text file `text`, as
/// bytes (two batches of 32), with the flags `extra` (`--adapter DIR`, `--qlora`).
pub fn eval_loss(model: &std::path::Path, text: &std::path::Path, extra: &[&str]) -> f64 {
    let (m, t) = (model.display().to_string(), text.display().to_string());
    let base = [
        "eval",
        "--model",
        &m,
        "--data",
        &t,
        "--tokenizer",
        "bytes",
        "--seq-len",
        "32",
        "--batches",
        "2",
        "--json",
        "--device",
        "cpu",
    ];
    let out = trainkit_ok(&[&base[..], extra].concat());
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["loss"]
        .as_f64()
        .unwrap()
}

/// [`eval_loss`] of the model in `dir/model` on `text`, with the adapter in
/// `dir/adapter` (`--adapter`) when given.
pub fn eval_in(
    dir: &std::path::Path,
    text: &std::path::Path,
    model: &str,
    adapter: Option<&str>,
) -> f64 {
    let adapter = adapter.map(|a| dir.join(a).display().to_string());
    let extra: Vec<&str> = adapter.iter().flat_map(|a| ["--adapter", a]).collect();
    eval_loss(&dir.join(model), text, &extra)
}

/// A fresh CPU backend: its products run on the CBLAS library `$TRAINKIT_BLAS` names,
/// if set, so the suite can be run against one.
pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::from_env().expect("$TRAINKIT_BLAS names a usable CBLAS library"))
}

/// `n` standard-normal values times `scale`.
pub fn randn(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

/// An f32 activation tensor.
pub fn tensor(be: &dyn Backend, data: &[f32], shape: &[usize]) -> Tensor {
    be.upload(data, shape, DType::F32, MemoryCategory::Activations, "test")
        .unwrap()
}

/// A loader over the built-in corpus.
pub fn corpus_loader(bytes: usize, seed: u64, batch: usize, seq: usize) -> DataLoader {
    let text = SyntheticCorpus::builtin().generate(bytes, seed);
    DataLoader::new(ByteTokenizer.encode(&text), batch, seq).unwrap()
}

/// A small GPT-2 for tests: 3 layers, 2 heads, 32 wide, bytes.
pub fn tiny_config() -> trainkit::Gpt2Config {
    trainkit::Gpt2Config {
        n_layer: 3,
        n_head: 2,
        n_embd: 32,
        n_positions: 32,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    }
}

/// One f32 vector per parameter, in model order, of the tensor `pick` chooses.
pub fn per_param<P, C, O, A, M>(
    t: &trainkit::Trainer<P, C, O, A, M>,
    pick: impl Fn(&trainkit::Param) -> &Tensor,
) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    t.params()
        .iter()
        .map(|p| t.backend().to_f32(pick(p)).unwrap())
        .collect()
}

/// The bits of every parameter's weights, value (its master copy where it keeps one) and
/// optimizer state, in model order, wherever they live (host memory too): what an update
/// run two ways must leave bitwise equal.
pub fn update_bits<P, C, O, A, M>(t: &trainkit::Trainer<P, C, O, A, M>) -> Vec<Vec<u32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    let be = t.backend();
    t.params()
        .iter()
        .flat_map(|p| {
            let mut ts = vec![p.weight(), p.value()];
            ts.extend(p.state());
            ts.into_iter()
                .map(|x| be.to_f32(x).unwrap().iter().map(|v| v.to_bits()).collect())
                .collect::<Vec<Vec<u32>>>()
        })
        .collect()
}

/// Every parameter's gradient (f32), in model order.
pub fn grads<P, C, O, A, M>(t: &trainkit::Trainer<P, C, O, A, M>) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    per_param(t, |p| p.grad().expect("gradient"))
}

/// Every parameter's f32 values, in model order.
pub fn values<P, C, O, A, M>(t: &trainkit::Trainer<P, C, O, A, M>) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    per_param(t, |p| p.value())
}

/// A trainer on `corpus_loader(4_000, 7, b, t)` whose steps compute gradients and change
/// no weight (AdamW at learning rate 0, no clipping): for gradient checks.
pub fn gradient_probe(
    model: impl trainkit::Model + 'static,
    b: usize,
    t: usize,
) -> trainkit::Trainer<
    trainkit::Fp32,
    trainkit::NoRecompute,
    trainkit::AdamW,
    trainkit::Constant,
    trainkit::PeakTracker,
> {
    trainkit::Trainer::builder(model, cpu(), corpus_loader(4_000, 7, b, t))
        .optimizer(trainkit::AdamW {
            lr: 0.0,
            ..trainkit::AdamW::default()
        })
        .options(trainkit::TrainerOptions {
            grad_clip: 0.0,
            ..trainkit::TrainerOptions::default()
        })
        .build()
        .unwrap()
}

/// Holds `analytic`, the gradient of element `at` of parameter `i`, to the central
/// difference of the mean loss on `batch` (step 1e-2): relative error under 2 %, with a
/// floor of 1e-3. The parameter is restored after.
pub fn check_central_difference<P, C, O, A, M>(
    what: &str,
    trainer: &mut trainkit::Trainer<P, C, O, A, M>,
    batch: &trainkit::data::Batch,
    (i, at): (usize, usize),
    analytic: f64,
) where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    check_difference(what, trainer, batch, (i, at), analytic, None)
}

/// [`check_central_difference`] of the loss training computes for `batch` as the first
/// micro-batch of step `step`: with that micro-batch's random draws (LoRA dropout).
pub fn check_central_difference_in_step<P, C, O, A, M>(
    what: &str,
    trainer: &mut trainkit::Trainer<P, C, O, A, M>,
    batch: &trainkit::data::Batch,
    (i, at): (usize, usize),
    analytic: f64,
    step: u64,
) where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    check_difference(what, trainer, batch, (i, at), analytic, Some(step))
}

fn check_difference<P, C, O, A, M>(
    what: &str,
    trainer: &mut trainkit::Trainer<P, C, O, A, M>,
    batch: &trainkit::data::Batch,
    (i, at): (usize, usize),
    analytic: f64,
    step: Option<u64>,
) where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    let original = values(trainer)[i].clone();
    let tokens = batch.tokens() as f64;
    let h = 1e-2f32;
    let mut loss_at = |delta: f32| {
        let mut v = original.clone();
        v[at] += delta;
        let be = trainer.backend().clone();
        trainer.params_mut()[i].set_value(be.as_ref(), &v).unwrap();
        match step {
            Some(step) => trainer.training_loss_on(batch, step, 0).unwrap() / tokens,
            None => trainer.loss_on(batch).unwrap() / tokens,
        }
    };
    let numeric = (loss_at(h) - loss_at(-h)) / (2.0 * h as f64);
    loss_at(0.0);
    let err = (numeric - analytic).abs() / (1e-3 + numeric.abs().max(analytic.abs()));
    assert!(
        err < 2e-2,
        "{what}: {}[{at}]: numeric {numeric:.6}, analytic {analytic:.6}",
        trainer.params()[i].name()
    );
}

/// The meta backend's prediction of `model()` equals the ledger, category by category and in
/// total, over two steps under each of `policies` (bf16, batch 2 × 16).
pub fn prediction_equals_ledger(
    what: &str,
    model: &dyn Fn() -> Box<dyn trainkit::Model>,
    policies: &[Box<dyn trainkit::CheckpointPolicy>],
) {
    for policy in policies {
        let precision = trainkit::MixedBf16 { fp32_grads: false };
        let predicted = trainkit::estimate::predict(
            model(),
            trainkit::estimate::MicroBatch {
                batch_size: 2,
                seq_len: 16,
            },
            &precision,
            policy.as_ref(),
            &trainkit::AdamW::default(),
        )
        .unwrap();
        let mut t = trainkit::Trainer::builder(model(), cpu(), corpus_loader(8_000, 3, 2, 16))
            .precision(precision)
            .checkpoint(policy.clone())
            .build()
            .unwrap();
        for step in 1..=2 {
            let s = t.step().unwrap();
            step_matches_prediction(&s, &predicted, step, 1, &format!("{what} {policy:?}"));
        }
    }
}

/// Every category's peak in the ledger of step `step` (1-based) equals `predicted`'s.
pub fn categories_match_prediction(
    s: &trainkit::StepStats,
    predicted: &trainkit::estimate::MemoryPrediction,
    step: u64,
    what: &str,
) {
    for c in MemoryCategory::ALL {
        assert_eq!(
            s.memory.peak.get(c),
            predicted.peak.get(c),
            "step {step} {c} of {what}"
        );
    }
}

/// The ledger of step `step` (1-based) of `micro_batches` micro-batches equals
/// `predicted`: every category's peak, and the total (the first step's without optimizer
/// state until the update).
pub fn step_matches_prediction(
    s: &trainkit::StepStats,
    predicted: &trainkit::estimate::MemoryPrediction,
    step: u64,
    micro_batches: usize,
    what: &str,
) {
    categories_match_prediction(s, predicted, step, what);
    let total = if step == 1 {
        predicted.first_step_peak_total(micro_batches)
    } else {
        predicted.peak_total
    };
    assert_eq!(s.memory.peak_total, total, "step {step} total of {what}");
}

/// A fresh, empty directory for one test (unique to this test binary's process).
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("trainkit-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The bytes of an llm.c token file with the given header fields and tokens (any of
/// them may be wrong on purpose).
pub fn token_file_bytes(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut bytes = vec![0u8; trainkit::data::TOKEN_FILE_HEADER_BYTES];
    bytes[0..4].copy_from_slice(&magic.to_le_bytes());
    bytes[4..8].copy_from_slice(&version.to_le_bytes());
    bytes[8..12].copy_from_slice(&count.to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    bytes
}

/// `trainkit train` flags of a tiny, fast run on the built-in corpus (batch size, steps
/// and output left to the caller).
pub const TINY_TRAIN: [&str; 13] = [
    "train",
    "--device",
    "cpu",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
];

/// A checkpoint policy written outside the crate: keeps only the input of every other
/// layer, so backward restores the others by rerunning the layer before them.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct EveryOtherInput;

#[typetag::serde(name = "every_other_input")]
impl trainkit::CheckpointPolicy for EveryOtherInput {
    fn retain(&self, site: &trainkit::ActivationSite) -> trainkit::Retention {
        if site.is(trainkit::Tags::LAYER_INPUT) && site.layer % 2 == 0 {
            trainkit::Retention::Keep
        } else {
            trainkit::Retention::Recompute
        }
    }
}

/// The tensor names in a safetensors file.
pub fn safetensors_names(path: &std::path::Path) -> Vec<String> {
    trainkit::save::read_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect()
}

/// A small Llama config: 2 layers, 32 wide, 4 query heads of 8 sharing 2 key/value heads,
/// an MLP of 48, bytes, a context of 32, an untied head.
pub fn tiny_llama_config() -> trainkit::LlamaConfig {
    trainkit::LlamaConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        vocab_size: 256,
        max_position_embeddings: 32,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        initializer_range: 0.1,
        rope: trainkit::model::Rope {
            theta: 10_000.0,
            scaling: trainkit::model::RopeScaling::Default,
        },
    }
}
