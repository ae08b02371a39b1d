//! The `trainkit` binary as a user runs it.

use crate::common;

use common::{scratch, trainkit, TINY_TRAIN};
use std::path::Path;
use trainkit::save::{read_safetensors, NamedTensor};

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A tiny, fast run on the built-in corpus; `extra` flags are appended.
/// `trainkit sample` of `model` continuing "the " on the CPU with `extra` flags, which
/// must succeed: its stdout and stderr.
fn sample_ok(model: &Path, extra: &[&str]) -> (String, String) {
    let a = [
        "sample",
        "--model",
        path(model),
        "--prompt",
        "the ",
        "--device",
        "cpu",
    ];
    let (ok, out, err) = trainkit(&[&a[..], extra].concat());
    assert!(ok, "{err}");
    (out, err)
}

fn tiny_run(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = TINY_TRAIN.iter().map(|s| s.to_string()).collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    if !extra.contains(&"--batch-size") {
        args.extend(["--batch-size".to_string(), "4".to_string()]);
    }
    args
}

fn run_ok(args: &[String]) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{args:?}: {err}");
    out
}

fn weights(dir: &Path) -> Vec<NamedTensor> {
    read_safetensors(&dir.join("model.safetensors")).unwrap()
}

#[test]
fn train_runs_and_reports_each_step() {
    let (ok, out, err) = trainkit(&["train", "--steps", "3", "--device", "cpu"]);
    assert!(ok, "{err}");
    assert!(out.contains("entropy floor"), "{out}");
    for step in 1..=3 {
        assert!(out.contains(&format!("step     {step}/3")), "{out}");
    }
    assert!(out.contains("final val loss"), "{out}");
}

#[test]
fn print_config_round_trips() {
    let (ok, out, err) = trainkit(&["train", "--print-config", "--steps", "7"]);
    assert!(ok, "{err}");
    let cfg = trainkit::config::RunConfig::from_toml(&out).unwrap();
    assert_eq!(cfg.training.steps, 7);
}

#[test]
fn bad_input_is_a_one_line_error() {
    let dir = scratch("bad");
    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "[training]\nstepz = 3\n").unwrap();
    let heads = dir.join("heads.toml");
    std::fs::write(
        &heads,
        "[model]\nn_layer = 2\nn_head = 3\nn_embd = 32\nn_positions = 64\nvocab_size = 256\n",
    )
    .unwrap();
    let kind = dir.join("kind.toml");
    std::fs::write(&kind, "[checkpoint]\nkind = \"sometimes\"\n").unwrap();
    let xbin = dir.join("x.bin");
    let binary = dir.join("binary.txt");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x41]).unwrap();
    // An adapter's directory where a model's is asked for.
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::write(adapter.join("adapter_config.json"), "{}").unwrap();
    // Places no run can write: a file, and a path through a file.
    let under_a_file = binary.join("run");
    let log_under_a_file = binary.join("log.jsonl");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["train", "--out", path(&binary)],
            "exists and is not a directory",
        ),
        (vec!["train", "--out", path(&under_a_file)], "--out"),
        (
            vec!["sample", "--model", path(&adapter), "--prompt", "x"],
            "holds a LoRA adapter",
        ),
        (
            vec!["train", "--log-json", path(&log_under_a_file)],
            "--log-json",
        ),
        (vec!["train", "--device", "tpu"], "auto, cpu or cuda"),
        (
            vec!["train", "--update-rounding", "kahan", "--precision", "fp32"],
            "--update-rounding",
        ),
        (
            vec!["train", "--master-weights", "none", "--precision", "fp16"],
            "--master-weights",
        ),
        (
            vec!["train", "--data", "/nonexistent/file.txt"],
            "/nonexistent/file.txt",
        ),
        (
            vec!["train", "--config", "/nonexistent/run.toml"],
            "/nonexistent/run.toml",
        ),
        (vec!["train", "--config", path(&unknown)], "stepz"),
        (vec!["train", "--config", path(&heads)], "n_head"),
        (vec!["train", "--config", path(&kind)], "sometimes"),
        (vec!["train", "--precision", "fp8"], "fp32, bf16 or fp16"),
        (
            vec!["train", "--recompute", "some"],
            "none, full, selective or budget:SIZE",
        ),
        (
            vec!["train", "--optimizer", "adam8"],
            "adamw, adamw8bit, sgd",
        ),
        (
            vec!["train", "--lr-schedule", "linear"],
            "constant or cosine",
        ),
        (vec!["train", "--grad-accum", "0"], "--grad-accum"),
        (vec!["train", "--zero", "3"], "--zero"),
        (vec!["train", "--collective", "gloo"], "auto, nccl, mpi"),
        (
            vec!["train", "--device", "cpu", "--collective", "nccl"],
            "NCCL carries GPU memory",
        ),
        (vec!["train", "--bucket-size", "5X"], "--bucket-size"),
        (vec!["train", "--device", "cpu", "--tf32"], "--tf32"),
        (
            vec!["train", "--epochs", "1", "--steps", "3"],
            "cannot be used with",
        ),
        (vec!["train", "--epochs", "0"], "--epochs"),
        (vec!["train", "--batch-size", "0"], "batch_size"),
        (
            vec!["train", "--seq-len", "4096", "--n-positions", "1024"],
            "n_positions",
        ),
        (vec!["train", "--lr=-1"], "--lr"),
        // A negative number is the flag's value (refused by name), not a flag of its own.
        (vec!["train", "--lr", "-1"], "--lr"),
        (vec!["train", "--lora-rank", "-1"], "--lora-rank"),
        (vec!["eval", "--batches", "-2"], "--batches"),
        (vec!["train", "--tokenizer", "wordpiece"], "gpt2"),
        (vec!["train", "--data", path(&binary)], "not UTF-8"),
        (vec!["train", "--resume", path(&dir)], "--init-from"),
        (vec!["train", "--init-from", path(&dir)], "config.json"),
        (
            vec!["train", "--data", path(&unknown), "--tokenizer", "gpt2"],
            "--vocab-size",
        ),
        (
            vec!["eval", "--model", path(&dir), "--data", path(&unknown)],
            "config.json",
        ),
        (
            vec![
                "sample",
                "--model",
                "/nonexistent",
                "--prompt",
                "x",
                "--top-p",
                "2",
            ],
            "--top-p",
        ),
        (
            vec!["sample", "--model", "/nonexistent", "--prompt", "x"],
            "not a directory",
        ),
        (
            vec![
                "prepare",
                "--text",
                "/nonexistent.txt",
                "--out",
                path(&xbin),
            ],
            "/nonexistent.txt",
        ),
        (
            vec![
                "prepare",
                "--text",
                path(&unknown),
                "--out",
                path(&xbin),
                "--val-fraction",
                "1.5",
            ],
            "--val-fraction",
        ),
    ];
    for (args, needle) in cases {
        let (ok, _, err) = trainkit(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Ranks started by torchrun-style variables sum over NCCL, so on GPUs: on the CPU they
/// are refused by name, as is a rank missing its `RANK`.
#[test]
fn torchrun_style_ranks_need_gpus() {
    let world = std::ffi::OsStr::new("2");
    let rank = std::ffi::OsStr::new("0");
    let (ok, _, err) = common::trainkit_with_env(
        &["train", "--device", "cpu", "--steps", "1"],
        &[("WORLD_SIZE", world), ("RANK", rank)],
        &[],
    );
    assert!(!ok);
    assert!(err.contains("error on rank 0 of 2"), "{err}");
    assert!(
        err.contains("sum over NCCL") && err.contains("mpirun"),
        "{err}"
    );
    let (ok, _, err) = common::trainkit_with_env(
        &["train", "--device", "cpu", "--steps", "1"],
        &[("WORLD_SIZE", world)],
        &["RANK"],
    );
    assert!(!ok);
    assert!(err.contains("RANK is not set"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `--tf32` is saved in the config, and where `--device auto` finds no GPU the run goes on
/// in f32 on the CPU, saying so (on a GPU it runs with TF32 products).
#[test]
fn tf32_is_saved_and_noted_without_a_gpu() {
    let (ok, out, err) = trainkit(&["train", "--tf32", "--print-config"]);
    assert!(ok, "{err}");
    assert!(out.contains("tf32 = true"), "{out}");
    let (ok, out, err) = trainkit(&["train", "--tf32", "--steps", "1", "--batch-size", "2"]);
    assert!(ok, "{err}");
    if err.contains("using the CPU") {
        assert!(out.contains("tf32: no GPU"), "{out}");
    }
}

/// `--epochs E` trains E passes over the data: the built-in corpus holds 2,047
/// micro-batches of 4 × 128 tokens, so 0.004 passes are 9 steps, and 5 with two
/// micro-batches a step.
#[test]
fn epochs_make_the_steps_of_passes_over_the_data() {
    for (accum, steps) in [("1", 9), ("2", 5)] {
        let (ok, out, err) = trainkit(&[
            "train",
            "--device",
            "cpu",
            "--epochs",
            "0.004",
            "--batch-size",
            "4",
            "--grad-accum",
            accum,
            "--n-layer",
            "1",
        ]);
        assert!(ok, "{err}");
        assert!(
            out.contains(&format!(
                "over 2047 micro-batches of 4 × 128 tokens, {accum} a step: {steps} steps"
            )),
            "{out}"
        );
        assert!(out.contains(&format!("step {steps:>5}/{steps}")), "{out}");
    }
}

/// `sample` takes the model directory's generation_config.json as transformers' generate
/// does: `do_sample: false` draws the most likely token whatever the seed, its
/// max_new_tokens is the default, flags override it, and a setting out of range is named.
/// `--precision bf16` samples and evaluates the model in bf16.
#[test]
fn sample_takes_the_models_generation_config() {
    let dir = scratch("generation-config");
    let model = dir.join("model");
    let args = tiny_run(&["--steps", "1", "--out", path(&model)]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _, err) = trainkit(&args);
    assert!(ok, "{err}");
    let config = model.join("generation_config.json");
    std::fs::write(
        &config,
        r#"{"do_sample": false, "max_new_tokens": 6, "eos_token_id": null}"#,
    )
    .unwrap();
    let sample = |extra: &[&str]| sample_ok(&model, extra);
    // A model's directory given as the adapter is named as a model.
    let (ok, _, err) = trainkit(&[
        "sample",
        "--model",
        path(&model),
        "--adapter",
        path(&model),
        "--prompt",
        "x",
    ]);
    assert!(!ok && err.contains("not a LoRA adapter"), "{err}");
    let (one, err) = sample(&["--seed", "1"]);
    assert!(err.contains("sampling: the most likely token"), "{err}");
    assert!(err.contains("sampled 6 tokens"), "{err}");
    assert_eq!(sample(&["--seed", "2"]).0, one, "greedy whatever the seed");
    let (_, err) = sample(&["--top-p", "0.9", "--max-new-tokens", "3"]);
    assert!(err.contains("temperature 1, top-k 50, top-p 0.9"), "{err}");
    assert!(err.contains("sampled 3 tokens"), "{err}");
    // In bf16 the same model samples, and evaluates to its f32 loss within bf16's rounding.
    let (bf16, _) = sample(&["--precision", "bf16"]);
    assert!(bf16.starts_with("the "), "{bf16}");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let loss = |precision: &str| {
        let a = [
            "eval",
            "--model",
            path(&model),
            "--data",
            path(&text),
            "--batches",
            "2",
        ];
        let (ok, out, err) = trainkit(
            &[
                &a[..],
                &["--json", "--device", "cpu", "--precision", precision],
            ]
            .concat(),
        );
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (f32_loss, bf16_loss) = (loss("fp32"), loss("bf16"));
    assert!(
        (f32_loss - bf16_loss).abs() < 0.02 * f32_loss,
        "{f32_loss} {bf16_loss}"
    );
    std::fs::write(&config, r#"{"do_sample": true, "top_p": 1.5}"#).unwrap();
    let (ok, _, err) = trainkit(&[
        "sample",
        "--model",
        path(&model),
        "--prompt",
        "x",
        "--device",
        "cpu",
    ]);
    assert!(
        !ok && err.contains("generation_config.json: top_p") && err.contains("--top-p"),
        "{err}"
    );
}

#[test]
fn every_subcommand_documents_its_flags() {
    for (sub, flags) in [
        (
            "train",
            &[
                "--data",
                "--tokenizer",
                "--init-from",
                "--out",
                "--resume",
                "--steps",
                "--batch-size",
                "--seq-len",
                "--grad-accum",
                "--lr",
                "--lr-schedule",
                "--warmup-steps",
                "--weight-decay",
                "--optimizer",
                "--grad-clip",
                "--precision",
                "--tf32",
                "--recompute",
                "--device",
                "--seed",
                "--n-layer",
                "--n-head",
                "--n-embd",
                "--vocab-size",
                "--eval-every",
                "--save-every",
                "--log-json",
                "--print-config",
            ][..],
        ),
        (
            "eval",
            &[
                "--model",
                "--data",
                "--batch-size",
                "--seq-len",
                "--batches",
                "--json",
            ][..],
        ),
        (
            "sample",
            &[
                "--model",
                "--prompt",
                "--max-new-tokens",
                "--temperature",
                "--top-k",
                "--top-p",
                "--min-p",
                "--repetition-penalty",
                "--ignore-eos",
                "--seed",
            ][..],
        ),
        (
            "prepare",
            &["--text", "--out", "--tokenizer", "--val-fraction"][..],
        ),
    ] {
        let (ok, out, err) = trainkit(&[sub, "--help"]);
        assert!(ok, "{sub}: {err}");
        for f in flags {
            assert!(out.contains(f), "`trainkit {sub} --help` lacks {f}:\n{out}");
        }
    }
}

#[test]
fn resume_through_the_cli_is_bitwise_exact() {
    resume_through_the_cli(&[], "resume");
}

/// The same with `--optimizer adamw8bit`: the checkpoint holds u8 codes, the resumed run
/// takes the optimizer from the saved config.
#[test]
fn resume_through_the_cli_is_bitwise_exact_with_adamw8bit() {
    let dir = resume_through_the_cli(&["--optimizer", "adamw8bit"], "resume8");
    let state = std::fs::read_to_string(dir.join("b/trainkit.toml")).unwrap();
    assert!(state.contains("kind = \"adamw8bit\""), "{state}");
    let bytes = std::fs::read(dir.join("b/trainer_state.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&bytes[..bytes.len().min(20_000)]).to_string();
    assert!(
        header.contains("exp_avg.codes") && header.contains("\"U8\""),
        "{header}"
    );
}

/// Pure bf16 with Kahan-compensated updates: the flags reach the run (its line says so),
/// the compensation is saved, and the resumed run continues bit for bit.
#[test]
fn resume_through_the_cli_is_bitwise_exact_in_pure_bf16() {
    let flags = [
        "--precision",
        "bf16",
        "--master-weights",
        "none",
        "--update-rounding",
        "kahan",
    ];
    let dir = resume_through_the_cli(&flags, "resume-pure");
    let state = std::fs::read_to_string(dir.join("b/trainkit.toml")).unwrap();
    assert!(
        state.contains("pure_bf16") && state.contains("kahan"),
        "{state}"
    );
    let bytes = std::fs::read(dir.join("b/trainer_state.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&bytes[..bytes.len().min(20_000)]).to_string();
    assert!(header.contains(".kahan"), "{header}");
    let (ok, out, err) =
        trainkit(&[&["train", "--steps", "1", "--device", "cpu"][..], &flags].concat());
    assert!(ok, "{err}");
    assert!(
        out.contains("precision pure_bf16 (no master copy, kahan update rounding)"),
        "{out}"
    );
}

fn resume_through_the_cli(extra: &[&str], name: &str) -> std::path::PathBuf {
    let dir = scratch(name);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let mut constant = vec!["--lr-schedule", "constant", "--lr", "1e-3"];
    constant.extend_from_slice(extra);
    let mut straight = tiny_run(&["--steps", "4", "--out", path(&a)]);
    straight.extend(constant.iter().map(|s| s.to_string()));
    run_ok(&straight);
    let mut first = tiny_run(&["--steps", "2", "--out", path(&b)]);
    first.extend(constant.iter().map(|s| s.to_string()));
    run_ok(&first);
    let out = run_ok(&[
        "train".into(),
        "--resume".into(),
        path(&b).into(),
        "--steps".into(),
        "4".into(),
        "--device".into(),
        "cpu".into(),
    ]);
    assert!(out.contains("at step 2"), "{out}");
    assert!(
        out.contains("step     3/4") && !out.contains("step     2/4"),
        "{out}"
    );
    assert_eq!(weights(&a), weights(&b));
    let state = |d: &Path| std::fs::read_to_string(d.join("trainer_state.json")).unwrap();
    assert_eq!(state(&a), state(&b));
    let tensors = |d: &Path| std::fs::read(d.join("trainer_state.safetensors")).unwrap();
    assert_eq!(tensors(&a), tensors(&b));
    dir
}

#[test]
fn grad_accum_sees_the_same_windows_as_a_bigger_batch() {
    let dir = scratch("accum");
    let (one, two) = (dir.join("one"), dir.join("two"));
    let big = tiny_run(&["--steps", "1", "--out", path(&one), "--batch-size", "4"]);
    run_ok(&big);
    let acc = tiny_run(&[
        "--steps",
        "1",
        "--out",
        path(&two),
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
    ]);
    run_ok(&acc);
    let (w1, w2) = (weights(&one), weights(&two));
    let before = {
        let d = dir.join("zero");
        let mut zero = tiny_run(&["--steps", "1", "--out", path(&d), "--lr", "1e-30"]);
        zero.extend(["--weight-decay", "0"].iter().map(|s| s.to_string()));
        run_ok(&zero);
        weights(&d)
    };
    let mut moved = 0usize;
    for ((a, b), w0) in w1.iter().zip(&w2).zip(&before) {
        assert_eq!(a.name, b.name);
        for ((x, y), x0) in a.data.iter().zip(&b.data).zip(&w0.data) {
            assert!(
                (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
                "{}: {x} vs {y}",
                a.name
            );
            moved += (x != x0) as usize;
        }
    }
    assert!(moved > 1000, "the step must change the weights ({moved})");
}

#[test]
fn saved_models_evaluate_and_sample() {
    let dir = scratch("eval");
    let model = dir.join("model");
    run_ok(&tiny_run(&["--steps", "3", "--out", path(&model)]));
    let text = dir.join("text.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(40)).unwrap();
    let (ok, out, err) = trainkit(&[
        "eval",
        "--model",
        path(&model),
        "--data",
        path(&text),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--batches",
        "3",
        "--json",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["tokens"], 2 * 16 * 3);
    let loss = v["loss"].as_f64().unwrap();
    assert!(loss > 0.5 && loss < 6.0, "{loss}");
    // By default every position of the data once (960 bytes: 959 positions, 30 batches of
    // 2 × 16, the last one partly padding); more batches than the data holds never wrap.
    let whole = |batches: Option<&str>| {
        let mut a = vec![
            "eval",
            "--model",
            path(&model),
            "--data",
            path(&text),
            "--tokenizer",
            "bytes",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--json",
            "--device",
            "cpu",
        ];
        if let Some(b) = batches {
            a.extend(["--batches", b]);
        }
        let (ok, out, err) = trainkit(&a);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()
    };
    let all = whole(None);
    assert_eq!(all["tokens"], 959);
    assert_eq!(all["trained_tokens"], 959);
    assert_eq!(all["batches"], 30);
    assert_eq!(all["whole_data"], true);
    assert_eq!(whole(Some("100")), all);

    let sample = |extra: &[&str]| {
        let a = ["--max-new-tokens", "20", "--seed", "3", "--top-k", "8"];
        sample_ok(&model, &[&a[..], extra].concat()).0
    };
    let (s1, s2) = (sample(&[]), sample(&[]));
    assert_eq!(s1, s2, "a seed fixes the sample");
    assert!(s1.starts_with("the ") && s1.trim_end().len() > 4, "{s1}");
    // Nucleus, min-p and the repetition penalty: as reproducible.
    let more = [
        "--top-p",
        "0.9",
        "--min-p",
        "0.05",
        "--repetition-penalty",
        "1.3",
    ];
    let (s3, s4) = (sample(&more), sample(&more));
    assert_eq!(s3, s4);
    assert!(s3.starts_with("the ") && s3.trim_end().len() > 4, "{s3}");
}

#[test]
fn prepared_token_files_train_and_log_json() {
    let dir = scratch("prepare");
    let text = dir.join("corpus.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(60),
    )
    .unwrap();
    let bin = dir.join("corpus.bin");
    let (ok, out, err) = trainkit(&[
        "prepare",
        "--text",
        path(&text),
        "--out",
        path(&bin),
        "--tokenizer",
        "bytes",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("corpus_val.bin"), "{out}");
    let log = dir.join("log.jsonl");
    let out = run_ok(&tiny_run(&[
        "--steps",
        "3",
        "--data",
        path(&bin),
        "--tokenizer",
        "bytes",
        "--log-json",
        path(&log),
    ]));
    assert!(out.contains("corpus_val.bin"), "{out}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        for key in [
            "loss",
            "lr",
            "grad_norm",
            "tokens",
            "seconds",
            "tokens_per_s",
        ] {
            assert!(l[key].is_number(), "{key} in {l}");
        }
        assert!(l["memory_peak"]["activations"].as_u64().unwrap() > 0, "{l}");
        assert!(l["memory_peak"]["optimizer_state"].is_u64(), "{l}");
    }
}

#[test]
fn constant_schedule_without_warmup_is_exactly_the_flag() {
    let dir = scratch("lr");
    let log = dir.join("log.jsonl");
    run_ok(&tiny_run(&[
        "--steps",
        "3",
        "--lr",
        "0.00123",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
        "--log-json",
        path(&log),
    ]));
    for l in std::fs::read_to_string(&log).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["lr"].as_f64().unwrap() as f32, 0.00123f32, "{l}");
    }
}

#[test]
fn init_from_takes_shape_and_weights_and_save_every_saves() {
    let dir = scratch("init");
    let (base, next) = (dir.join("base"), dir.join("next"));
    let out = run_ok(&tiny_run(&[
        "--steps",
        "3",
        "--out",
        path(&base),
        "--save-every",
        "2",
    ]));
    assert!(out.contains("step     2 | saved"), "{out}");
    // No shape flags: the 2-layer, 32-wide shape comes from the directory.
    let out = run_ok(
        &[
            "train",
            "--init-from",
            path(&base),
            "--steps",
            "0",
            "--out",
            path(&next),
            "--device",
            "cpu",
            "--seq-len",
            "32",
        ]
        .map(String::from),
    );
    assert!(out.contains("2 layers"), "{out}");
    assert_eq!(weights(&base), weights(&next));
    let (ok, _, err) = trainkit(&["train", "--init-from", path(&base), "--n-layer", "3"]);
    assert!(!ok && err.contains("contradict"), "{err}");
}

#[test]
fn a_model_from_scratch_gets_the_context_its_sequences_need() {
    // The default model's context is 128: --seq-len 256 raises it, --n-positions sets it.
    let (ok, out, err) = trainkit(&["train", "--print-config", "--seq-len", "256"]);
    assert!(ok, "{err}");
    let cfg = trainkit::config::RunConfig::from_toml(&out).unwrap();
    assert_eq!((cfg.training.seq_len, cfg.model.context()), (256, 256));
    let (ok, out, err) = trainkit(&["train", "--print-config", "--n-positions", "512"]);
    assert!(ok, "{err}");
    let cfg = trainkit::config::RunConfig::from_toml(&out).unwrap();
    assert_eq!(cfg.model.context(), 512);
    // An explicit context shorter than the sequences is refused, naming the fix.
    let (ok, _, err) = trainkit(&[
        "train",
        "--print-config",
        "--seq-len",
        "256",
        "--n-positions",
        "64",
    ]);
    assert!(!ok);
    assert!(err.contains("--n-positions"), "{err}");
}

#[test]
fn llama_trains_resumes_bitwise_evaluates_and_samples() {
    let dir = scratch("llama");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let llama = [
        "--arch",
        "llama",
        "--n-kv-head",
        "1",
        "--ffn",
        "48",
        "--rope-theta",
        "500",
        "--precision",
        "bf16",
        "--recompute",
        "selective",
        "--lr-schedule",
        "constant",
    ];
    let run = |steps: &str, out: &Path| {
        let mut args = tiny_run(&["--steps", steps, "--out", path(out)]);
        args.extend(llama.iter().map(|s| s.to_string()));
        run_ok(&args)
    };
    let out = run("4", &a);
    assert!(
        out.contains("llama: 2 layers, 2 heads (1 key/value)"),
        "{out}"
    );
    run("2", &b);
    let resumed = run_ok(&[
        "train".into(),
        "--resume".into(),
        path(&b).into(),
        "--steps".into(),
        "4".into(),
    ]);
    assert!(resumed.contains("at step 2"), "{resumed}");
    assert_eq!(weights(&a), weights(&b));
    let names: Vec<String> = weights(&a).into_iter().map(|t| t.name).collect();
    assert!(
        names.contains(&"model.layers.1.self_attn.k_proj.weight".to_string()),
        "{names:?}"
    );
    let config = std::fs::read_to_string(a.join("config.json")).unwrap();
    assert!(config.contains("\"model_type\": \"llama\""), "{config}");

    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let (ok, out, err) = trainkit(&[
        "eval",
        "--model",
        path(&a),
        "--data",
        path(&text),
        "--device",
        "cpu",
    ]);
    assert!(ok && out.contains("nats/token"), "{out}{err}");
    let (ok, out, err) = trainkit(&[
        "sample",
        "--model",
        path(&a),
        "--prompt",
        "the ",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
    ]);
    assert!(ok && !out.is_empty(), "{err}");
    // A fine-tune from it takes its shape; a contradicting flag is refused.
    let (ok, _, err) = trainkit(&[
        "train",
        "--init-from",
        path(&a),
        "--n-kv-head",
        "2",
        "--steps",
        "1",
    ]);
    assert!(!ok && err.contains("contradict"), "{err}");
    for (args, needle) in [
        (vec!["train", "--arch", "mamba"], "gpt2 or llama"),
        (vec!["train", "--n-kv-head", "2"], "--arch llama"),
        (
            vec!["train", "--arch", "llama", "--n-kv-head", "3"],
            "num_key_value_heads",
        ),
        (vec!["train", "--model", "gpt5"], "smollm2-135m"),
        (
            vec!["train", "--model", "gpt2", "--arch", "llama"],
            "contradicts",
        ),
    ] {
        let (ok, _, err) = trainkit(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--precision fp16` trains with a dynamic loss scale that `--log-json` reports per step;
/// fp32 logs a scale of 1.
#[test]
fn fp16_runs_log_their_loss_scale() {
    let dir = scratch("fp16-log");
    for (precision, scale) in [("fp16", 65536.0), ("fp32", 1.0)] {
        let log = dir.join(format!("{precision}.jsonl"));
        let out = run_ok(&tiny_run(&[
            "--steps",
            "2",
            "--precision",
            precision,
            "--log-json",
            path(&log),
        ]));
        if precision == "fp16" {
            assert!(out.contains("precision mixed_fp16"), "{out}");
        }
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        for l in &lines {
            assert_eq!(l["loss_scale"].as_f64(), Some(scale), "{l}");
            assert_eq!(l["skipped"], false, "{l}");
        }
    }
    let (ok, _, err) = trainkit(&["train", "--precision", "f16", "--steps", "1"]);
    assert!(!ok && err.contains("fp32, bf16 or fp16"), "{err}");
}

/// `--profile-ops` prints where the time of the steps after the first went, op by op, with
/// the product among them; a run of one step says there is nothing to show.
#[test]
fn profile_ops_prints_the_time_per_op() {
    let out = run_ok(&tiny_run(&["--steps", "3", "--profile-ops"]));
    let table = out
        .split("op profile of the steps after the first:")
        .nth(1)
        .unwrap_or_else(|| panic!("no op profile in: {out}"));
    assert!(
        table.contains("of the wall time inside op spans"),
        "{table}"
    );
    let matmul = table
        .lines()
        .find(|l| l.trim_start().starts_with("matmul "))
        .unwrap_or_else(|| panic!("no matmul row: {table}"));
    assert!(
        matmul.contains("GFLOP/s") && matmul.contains("calls"),
        "{matmul}"
    );
    let out = run_ok(&tiny_run(&["--steps", "1", "--profile-ops"]));
    assert!(out.contains("one step only"), "{out}");
}

/// The optimizer's and the schedule's settings of `trainkit train ARGS --print-config`.
fn printed_settings(args: &[&str]) -> (f32, f32, f32, toml::Value) {
    let mut all = args.to_vec();
    all.push("--print-config");
    let (ok, out, err) = trainkit(&all);
    assert!(ok, "{all:?}: {err}");
    let v = toml::Value::Table(out.parse::<toml::Table>().unwrap());
    let f = |k: &str| v["optimizer"][k].as_float().unwrap() as f32;
    (
        f("lr"),
        f("beta2"),
        f("weight_decay"),
        v["training"]["lr_schedule"].clone(),
    )
}

#[test]
fn runs_from_a_model_get_fine_tuning_defaults_that_flags_and_configs_override() {
    let dir = scratch("finetune-defaults");
    let base = dir.join("base");
    run_ok(&tiny_run(&["--steps", "0", "--out", path(&base)]));
    let from = ["train", "--init-from", path(&base), "--steps", "100"];
    let (lr, beta2, wd, schedule) = printed_settings(&from);
    assert_eq!((lr, beta2, wd), (2e-5, 0.999, 0.0));
    assert_eq!(schedule["kind"].as_str(), Some("cosine"));
    assert_eq!(schedule["warmup_steps"].as_integer(), Some(3));
    assert_eq!(schedule["min_lr_ratio"].as_float(), Some(0.0));
    // LoRA and QLoRA: 2e-4.
    for adapter in [&["--lora-rank", "4"][..], &["--lora-rank", "4", "--qlora"]] {
        let (lr, ..) = printed_settings(&[&from[..], adapter].concat());
        assert_eq!(lr, 2e-4, "{adapter:?}");
    }
    // Flags win, each alone.
    let flags = [
        "--lr",
        "0.001",
        "--weight-decay",
        "0.05",
        "--warmup-steps",
        "7",
        "--lr-schedule",
        "constant",
    ];
    let (lr, beta2, wd, schedule) = printed_settings(&[&from[..], &flags].concat());
    assert_eq!((lr, beta2, wd), (1e-3, 0.999, 0.05));
    assert_eq!(schedule["kind"].as_str(), Some("constant"));
    assert_eq!(schedule["warmup_steps"].as_integer(), Some(7));
    // A config file's settings stand as written.
    let config = dir.join("run.toml");
    std::fs::write(&config, "[optimizer]\nkind = \"adamw\"\nlr = 0.0007\n").unwrap();
    let (lr, beta2, ..) = printed_settings(&[&from[..], &["--config", path(&config)]].concat());
    assert_eq!((lr, beta2), (7e-4, 0.95));
    // The run says what it set, and the first step trains at the full rate after one
    // warmup step.
    let log = dir.join("log.jsonl");
    // The base's generation settings go with a full fine-tune (not with an adapter).
    let generation = r#"{"do_sample": true, "temperature": 0.6}"#;
    std::fs::write(base.join("generation_config.json"), generation).unwrap();
    let tuned = dir.join("tuned");
    let out = run_ok(
        &[
            "train",
            "--init-from",
            path(&base),
            "--out",
            path(&tuned),
            "--steps",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--log-json",
            path(&log),
        ]
        .map(String::from),
    );
    assert!(
        out.contains("fine-tuning defaults (a full fine-tune)"),
        "{out}"
    );
    assert!(out.contains("learning rate 2e-5, warmup 1 steps"), "{out}");
    let first = std::fs::read_to_string(&log).unwrap();
    let first: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert_eq!(first["lr"].as_f64().unwrap() as f32, 2e-5);
    let copied = std::fs::read_to_string(tuned.join("generation_config.json")).unwrap();
    assert_eq!(copied, generation);
}

#[test]
fn a_warmup_longer_than_the_run_is_warned_of() {
    let run = |warmup: &str| {
        let args = tiny_run(&["--steps", "2", "--warmup-steps", warmup]);
        let (ok, out, err) = trainkit(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(ok, "{err}");
        out
    };
    let out = run("4");
    assert!(
        out.contains("warning: the warmup (4 steps) is longer than the run (2 steps)")
            && out.contains("peaks at 1.000e-3"),
        "{out}"
    );
    assert!(!run("2").contains("warmup ("));
}

/// `--init-from org/name` (and `eval --model org/name`) read the model's snapshot from the
/// Hugging Face cache as huggingface_hub lays it out; a revision names another snapshot;
/// an id missing from the cache, with no way to download it, is an error naming the id,
/// the cache and how to fetch it.
#[test]
fn model_ids_resolve_from_the_hugging_face_cache() {
    let dir = scratch("hub");
    let base = dir.join("base");
    run_ok(&tiny_run(&["--steps", "0", "--out", path(&base)]));
    let hub = dir.join("hf/hub/models--acme--tiny");
    let snapshot = hub.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(hub.join("refs")).unwrap();
    std::fs::write(hub.join("refs/main"), "0123abcd").unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(base.join(f), snapshot.join(f)).unwrap();
    }
    let hf_home = dir.join("hf");
    let run = |args: &[&str]| {
        common::trainkit_with_env(
            args,
            &[
                ("HF_HOME", hf_home.as_os_str()),
                // Nothing listens here: a download fails at once.
                ("HF_ENDPOINT", "http://127.0.0.1:9".as_ref()),
            ],
            &["HF_HUB_CACHE"],
        )
    };
    let next = dir.join("next");
    let (ok, out, err) = run(&[
        "train",
        "--init-from",
        "acme/tiny",
        "--steps",
        "0",
        "--out",
        path(&next),
        "--device",
        "cpu",
        "--seq-len",
        "32",
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains(&format!("weights from {}", snapshot.display())),
        "{out}"
    );
    assert_eq!(weights(&base), weights(&next));
    let (ok, _, err) = run(&[
        "sample",
        "--model",
        "acme/tiny@0123abcd",
        "--tokenizer",
        "bytes",
        "--prompt",
        "the ",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["train", "--init-from", "acme/missing", "--steps", "1"]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("acme/missing@main")
            && err.contains("is not in the Hugging Face cache")
            && err.contains(&dir.join("hf/hub").display().to_string())
            && err.contains("hf download acme/missing"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
