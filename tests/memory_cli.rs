//! `trainkit memory` as a user runs it.

use crate::common;

use common::scratch;
use serde_json::Value;

/// `trainkit memory` with `args`.
fn trainkit(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["memory"];
    all.extend_from_slice(args);
    common::trainkit(&all)
}

fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let (ok, out, err) = trainkit(&all);
    assert!(ok, "{args:?}: {err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_preset_prints_the_breakdown() {
    let (ok, out, err) = trainkit(&["--model", "gpt2"]);
    assert!(ok, "{err}");
    for needle in [
        "124,439,808",
        "123,653,376",
        "weights",
        "master_weights",
        "gradients",
        "optimizer_state",
        "model state",
        "activations",
        "total",
        "1 × 1024 tokens",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
    let v = json(&["--model", "llama-8b", "--recompute", "selective"]);
    assert_eq!(v["params"], 8_030_261_248u64);
    assert_eq!(v["inputs"]["seq_len"], 4096);
    assert_eq!(v["inputs"]["kv_heads"], 8);
    assert_eq!(v["model_state_bytes"], 16 * 8_030_261_248u64);
    // Selective: L·s·b·34h in bf16.
    assert_eq!(v["activation_bytes"], 32u64 * 4096 * 34 * 4096);
    assert_eq!(
        v["activation_bytes_by_recompute"]["full"],
        32u64 * 4096 * 2 * 4096
    );
}

#[test]
fn a_parameter_count_gives_model_state_only() {
    let v = json(&["--params", "7B"]);
    assert_eq!(v["params"], 7_000_000_000u64);
    assert_eq!(v["model_state_bytes"], 112_000_000_000u64);
    assert_eq!(v["bytes"]["weights"], 14_000_000_000u64);
    assert_eq!(v["bytes"]["master_weights"], 28_000_000_000u64);
    assert!(v["activation_bytes"].is_null());
    assert!(v["bytes"]["activations"].is_null());
    assert!(v["total_bytes"].is_null());
    let v = json(&["--params", "7B", "--fp32-grads"]);
    assert_eq!(v["model_state_bytes"], 140_000_000_000u64);
    assert_eq!(v["bytes"]["gradients"], 42_000_000_000u64);
    let v = json(&["--params", "7B", "--precision", "fp32"]);
    assert_eq!(v["model_state_bytes"], 112_000_000_000u64);
    assert_eq!(v["bytes"]["master_weights"], 0);
    let (ok, out, err) = trainkit(&["--params", "405B"]);
    assert!(ok, "{err}");
    assert!(out.contains("6480.00"), "{out}");
}

#[test]
fn raw_dimensions() {
    let v = json(&[
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "256",
        "--seq-len",
        "128",
        "--batch-size",
        "3",
        "--precision",
        "fp32",
    ]);
    let n = 64 * 256 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64;
    assert_eq!(v["params"], n);
    assert_eq!(v["params_playbook"], n);
    assert_eq!(v["model_state_bytes"], 16 * n);
    // f32 activations: twice L·s·b·(34h + 5·a·s).
    let acts = 2 * 2 * 128 * 3 * (34 * 64 + 5 * 4 * 128);
    assert_eq!(v["activation_bytes"], acts);
    assert_eq!(v["total_bytes"], 16 * n + acts);
    assert_eq!(v["inputs"]["recompute"], "none");
    let gqa = json(&[
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "256",
    ]);
    assert!(gqa["params"].as_u64().unwrap() < n);
    assert_eq!(gqa["inputs"]["seq_len"], 4096);
}

#[test]
fn plot_draws_every_policy() {
    let dir = scratch("memory-plot");
    let path = dir.join("acts.svg");
    let (ok, out, err) = trainkit(&["--model", "gpt2", "--plot", path.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("acts.svg"), "{out}");
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    for name in ["none", "selective", "full", "model state", "8k"] {
        assert!(svg.contains(name), "{name} missing from the plot");
    }
    // GPT-2's context ends at 1024: beyond it trainkit builds no model, so the plot is the
    // formula's, and says so.
    assert!(
        svg.contains("recompute full, formula"),
        "the legend names the source"
    );
    assert!(
        out.contains("the playbook's formula (trainkit builds no exact"),
        "{out}"
    );

    // A rotary model of any length: trainkit's exact figures, the formula dashed.
    let (ok, out, err) = trainkit(&["--model", "smollm2-135m", "--plot", path.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("trainkit's exact figures"), "{out}");
    let svg = std::fs::read_to_string(&path).unwrap();
    for name in [
        "trainkit exact (fused attention, fused loss)",
        "recompute none, exact",
        "recompute full, playbook formula",
    ] {
        assert!(svg.contains(name), "{name} missing from the plot");
    }
}

#[test]
fn bad_input_is_a_one_line_error() {
    let dir = scratch("memory-bad");
    let unwritable = dir.join("no/such/dir/plot.svg");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![], "--model NAME"),
        (vec!["--model", "llama-7b"], "llama-405b"),
        (vec!["--model", "gpt2", "--params", "7B"], "one of them"),
        (vec!["--model", "gpt2", "--layers", "2"], "--layers"),
        (vec!["--params", "7X"], "K, M, B or T"),
        (vec!["--model", "gpt2", "--zero", "1"], "--world"),
        (vec!["--model", "gpt2", "--world", "0"], "--world"),
        (
            vec!["--model", "gpt2", "--world", "2", "--zero", "3"],
            "--zero",
        ),
        (vec!["--params", "0"], "at least 1"),
        (vec!["--params", "1.5"], "whole number"),
        (vec!["--params", "7B", "--plot", "x.svg"], "--params"),
        (vec!["--layers", "2", "--hidden", "64"], "--heads, --vocab"),
        (
            vec![
                "--layers", "0", "--hidden", "64", "--heads", "4", "--vocab", "9",
            ],
            "--layers",
        ),
        (
            vec![
                "--layers", "2", "--hidden", "66", "--heads", "4", "--vocab", "9",
            ],
            "--hidden",
        ),
        (
            vec![
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--kv-heads",
                "3",
                "--vocab",
                "9",
            ],
            "--kv-heads",
        ),
        (vec!["--model", "gpt2", "--seq-len", "0"], "--seq-len"),
        (vec!["--model", "gpt2", "--batch-size", "0"], "--batch-size"),
        (
            vec!["--model", "gpt2", "--precision", "fp8"],
            "fp32, bf16 or fp16",
        ),
        (
            vec!["--model", "gpt2", "--recompute", "some"],
            "none, full, selective or budget:SIZE",
        ),
        (
            vec!["--model", "gpt2", "--optimizer", "adam8"],
            "adamw, adamw8bit, sgd",
        ),
        (
            vec!["--model", "llama-405b", "--seq-len", "18446744073709551615"],
            "64 bits",
        ),
        (
            vec!["--model", "gpt2", "--plot", unwritable.to_str().unwrap()],
            "plot.svg",
        ),
    ];
    for (args, needle) in cases {
        let (ok, out, err) = trainkit(&args);
        assert!(!ok, "{args:?} should fail: {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn help_documents_every_flag() {
    let (ok, out, err) = trainkit(&["--help"]);
    assert!(ok, "{err}");
    for flag in [
        "--model",
        "--params",
        "--layers",
        "--hidden",
        "--heads",
        "--vocab",
        "--kv-heads",
        "--ffn",
        "--seq-len",
        "--batch-size",
        "--precision",
        "--fp32-grads",
        "--recompute",
        "--optimizer",
        "--attention",
        "--loss",
        "--json",
        "--plot",
        "--techniques",
        "--stream-weights",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
}

#[test]
fn gpt2_models_also_get_trainkits_exact_prediction() {
    use trainkit::estimate::{predict_gpt2, MicroBatch};
    let v = json(&[
        "--model",
        "gpt2-medium",
        "--batch-size",
        "2",
        "--seq-len",
        "512",
        "--recompute",
        "full",
    ]);
    let config = trainkit::Gpt2Config {
        n_layer: 24,
        n_head: 16,
        n_embd: 1024,
        n_positions: 1024,
        vocab_size: 50257,
        layer_norm_epsilon: 1e-5,
    };
    let p = predict_gpt2(
        &config,
        MicroBatch {
            batch_size: 2,
            seq_len: 512,
        },
        &trainkit::MixedBf16 { fp32_grads: false },
        &trainkit::Full,
        &trainkit::AdamW::default(),
    )
    .unwrap();
    let exact = &v["trainkit_exact"];
    assert_eq!(
        exact["peak_total_bytes"].as_u64(),
        Some(p.peak_total),
        "{v}"
    );
    assert_eq!(
        exact["bytes"]["activations"].as_u64(),
        Some(p.activations.peak),
        "{v}"
    );
    // The playbook's model state is trainkit's too, for bf16 gradients, but for the 47
    // rows that pad the vocabulary to 50304 (16 bytes per parameter).
    assert_eq!(
        exact["model_state_bytes"].as_u64().unwrap(),
        v["model_state_bytes"].as_u64().unwrap() + 16 * 47 * 1024
    );
    // Llama presets are trainkit's models too; a bare parameter count is not a model.
    let llama = json(&["--model", "llama-3.2-1b", "--seq-len", "1024"]);
    assert!(
        llama["trainkit_exact"]["peak_total_bytes"].as_u64() > Some(0),
        "{llama}"
    );
    assert!(json(&["--params", "7B"])["trainkit_exact"].is_null());
}

/// `--attention` and `--loss` choose the paths of trainkit's exact figures: GPT-2 124M,
/// bf16, full recompute, T = 1024 peaks at 126.6 MB of activations with both materialized
/// and under 64 MB with both fused (the default), more or less with a larger or smaller
/// `--loss-chunk`; a path that does not exist is refused.
#[test]
fn attention_and_loss_paths_change_the_exact_activations() {
    let activations = |extra: &[&str]| {
        let mut args = vec![
            "--model",
            "gpt2",
            "--recompute",
            "full",
            "--seq-len",
            "1024",
        ];
        args.extend_from_slice(extra);
        json(&args)["trainkit_exact"]["bytes"]["activations"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(
        activations(&["--attention", "materialized", "--loss", "materialized"]),
        126_623_744
    );
    let fused = activations(&[]);
    assert!(fused < 64_000_000, "{fused}");
    assert_eq!(
        activations(&["--attention", "fused", "--loss", "fused"]),
        fused
    );
    let between = activations(&["--attention", "materialized"]);
    assert!(fused < between && between < 126_623_744, "{between}");
    // The fused loss's chunk, as `train --loss-chunk` sets it: one chunk of all 1024
    // positions holds every position's logits, as the materialized loss does.
    let small = activations(&["--loss-chunk", "128"]);
    let whole = activations(&["--loss-chunk", "1024"]);
    assert!(small <= fused && fused < whole, "{small} {fused} {whole}");
    let (ok, _, err) = trainkit(&["--model", "gpt2", "--loss-chunk", "0"]);
    assert!(!ok && err.contains("--loss-chunk"), "{err}");
    let (ok, _, err) = trainkit(&["--model", "gpt2", "--attention", "sparse"]);
    assert!(!ok);
    assert!(
        err.contains("--attention") && err.contains("`fused` or `materialized`"),
        "{err}"
    );
}

/// `--optimizer adamw8bit`: 2 bytes of state per parameter by the formula, and in the
/// exact figures the codes, one f32 maximum per block of 256 per moment and the f32
/// moments of tensors under 4096 elements, about 2.03 bytes per parameter for GPT-2.
#[test]
fn adamw8bit_state_is_shown() {
    let params = 124_439_808u64;
    let v = json(&["--model", "gpt2", "--optimizer", "adamw8bit"]);
    assert_eq!(v["inputs"]["optimizer"], "adamw8bit");
    assert_eq!(v["bytes"]["optimizer_state"], 2 * params);
    let exact = v["trainkit_exact"]["bytes"]["optimizer_state"]
        .as_u64()
        .unwrap();
    let per_param = exact as f64 / params as f64;
    assert!(
        (2.03..2.06).contains(&per_param),
        "{per_param} bytes per parameter"
    );
    let config = trainkit::Gpt2Config {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        n_positions: 1024,
        vocab_size: 50257,
        layer_norm_epsilon: 1e-5,
    };
    let opt = trainkit::AdamW8bit::default();
    let want: u64 = config
        .param_shapes()
        .iter()
        .map(|(_, s)| opt.state_bytes(s.iter().product()))
        .sum();
    assert_eq!(exact, want);
    let adamw = json(&["--model", "gpt2"]);
    assert_eq!(adamw["bytes"]["optimizer_state"], 8 * params);
    let (ok, out, err) = trainkit(&["--model", "gpt2", "--optimizer", "adamw8bit"]);
    assert!(ok, "{err}");
    assert!(out.contains("adamw8bit"), "{out}");
}

/// `--techniques` adds one technique at a time to the setup the other flags describe:
/// each row is that setup's exact peak, the same as the flag that turns the technique on.
#[test]
fn techniques_shows_what_each_saves_as_its_own_flags_would() {
    let base = ["--model", "gpt2", "--batch-size", "2", "--seq-len", "512"];
    let with = |extra: &[&str]| -> u64 {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        json(&args)["trainkit_exact"]["peak_total_bytes"]
            .as_u64()
            .unwrap()
    };
    let mut args = base.to_vec();
    args.push("--techniques");
    let v = json(&args);
    let t = &v["techniques"];
    let baseline = t["baseline"]["peak_total_bytes"].as_u64().unwrap();
    assert_eq!(baseline, with(&[]));
    let row = |name: &str| {
        t["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["technique"] == name)
            .unwrap_or_else(|| panic!("no {name} row: {t}"))
            .clone()
    };
    for (name, flags) in [
        ("adamw8bit", &["--optimizer", "adamw8bit"][..]),
        ("optimizer-in-backward", &["--optimizer-in-backward"][..]),
        ("full", &["--recompute", "full"][..]),
        ("offload", &["--offload-activations"][..]),
        ("optimizer-offload", &["--optimizer-offload"][..]),
        (
            "pure-bf16",
            &[
                "--master-weights",
                "none",
                "--update-rounding",
                "stochastic",
            ][..],
        ),
        ("accumulation", &["--batch-size", "1"][..]),
    ] {
        let r = row(name);
        let peak = r["peak_total_bytes"].as_u64().unwrap();
        if name != "accumulation" {
            assert_eq!(peak, with(flags), "{name}");
        }
        assert_eq!(
            r["saving_bytes"].as_i64().unwrap(),
            baseline as i64 - peak as i64
        );
        assert!(peak < baseline, "{name}: {peak} of {baseline}");
    }
    assert!(row("offload")["offloaded_bytes"].as_u64().unwrap() > 0);
    // The optimizer on the host: its host bytes are the flag's.
    let mut offloaded = base.to_vec();
    offloaded.push("--optimizer-offload");
    let host = json(&offloaded)["trainkit_exact"]["host_bytes"]
        .as_u64()
        .unwrap();
    assert!(host > 0);
    assert_eq!(row("optimizer-offload")["offloaded_bytes"], host);
    assert!(row("optimizer-offload")["flags"]
        .as_str()
        .unwrap()
        .ends_with(" --optimizer-offload"));
    // A setup with it already says so.
    offloaded.push("--techniques");
    let already = json(&offloaded)["techniques"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["technique"] == "optimizer-offload")
        .unwrap()["not_applicable"]
        .clone();
    assert_eq!(already, "on already (the run's own setting)");
    assert!(row("budget")["flags"]
        .as_str()
        .unwrap()
        .contains("--recompute budget:"));
    // Already bf16, and no T² tensor under the fused attention: said, not computed.
    assert!(row("bf16")["not_applicable"]
        .as_str()
        .unwrap()
        .contains("bf16"));
    assert!(row("selective")["not_applicable"].is_string());
    let all = t["all"]["peak_total_bytes"].as_u64().unwrap();
    assert!(all < row("full")["peak_total_bytes"].as_u64().unwrap());

    let (ok, out, err) = trainkit(&["--model", "gpt2", "--precision", "fp32", "--techniques"]);
    assert!(ok, "{err}");
    for name in [
        "baseline",
        "accumulation",
        "selective",
        "adamw8bit",
        "optimizer-in-backward",
        "budget",
        "full",
        "offload",
        "optimizer-offload",
        "bf16",
        "all that combine",
    ] {
        assert!(
            out.lines().any(|l| l.trim_start().starts_with(name)),
            "{name}: {out}"
        );
    }
    let (ok, _, err) = trainkit(&["--params", "7B", "--techniques"]);
    assert!(!ok);
    assert!(err.contains("--techniques"), "{err}");
}

/// A LoRA or QLoRA run prints one table, trainkit's exact figures for that run (the
/// playbook's formulas count full training and are left out), with the parameters that
/// train; a subject without dimensions cannot have those figures and is refused.
#[test]
fn a_lora_run_prints_its_own_exact_table() {
    let args = [
        "--model",
        "gpt2",
        "--lora-rank",
        "8",
        "--qlora",
        "--seq-len",
        "256",
    ];
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{err}");
    // GPT-2's c_attn in 12 layers: rank 8 × (768 in + 2304 out).
    assert!(
        out.contains("QLoRA rank 8, α 16 on c_attn: 294,912 of"),
        "{out}"
    );
    assert!(
        !out.contains("bytes/param") && !out.contains("model state"),
        "{out}"
    );
    let v = json(&args);
    assert_eq!(v["adapter"]["trainable_params"], 294_912);
    assert_eq!(v["adapter"]["kind"], "qlora");
    assert!(v["model_state_bytes"].is_null() && v["total_bytes"].is_null());
    let peak = v["trainkit_exact"]["peak_total_bytes"].as_u64().unwrap();
    let row = format!("{:.2}", peak as f64 / (1u64 << 30) as f64);
    let line = out.lines().find(|l| l.starts_with("peak ")).unwrap();
    assert!(
        line.split_whitespace().nth(1) == Some(row.as_str()),
        "{line} vs {row}"
    );
    // A full fine-tune keeps the formulas.
    let full = json(&["--model", "gpt2", "--seq-len", "256"]);
    assert!(full["adapter"].is_null() && full["total_bytes"].as_u64().is_some());
    let (ok, _, err) = trainkit(&["--params", "8B", "--lora-rank", "8"]);
    assert!(
        !ok && err.contains("--lora-rank") && err.contains("--params has none"),
        "{err}"
    );
    // Dropout and the modules trained whole beside the adapter: GPT-2's final norm adds
    // its gain and bias (2 × 768) to what trains, in the line and the JSON.
    let saving = [
        &args[..],
        &["--lora-dropout", "0.05", "--modules-to-save", "ln_f"],
    ]
    .concat();
    let (ok, out, err) = trainkit(&saving);
    assert!(ok, "{err}");
    assert!(out.contains("on c_attn, dropout 0.05: 296,448 of"), "{out}");
    assert_eq!(
        json(&saving)["adapter"]["trainable_params"],
        294_912 + 2 * 768
    );
    // Llama 3.2 1B's tied embedding trained whole (PEFT's ensure_weight_tying): the
    // 128256 × 2048 embedding, once, beside the adapter.
    let lora = [
        "--model",
        "llama-3.2-1b",
        "--lora-rank",
        "8",
        "--seq-len",
        "256",
    ];
    let plain = json(&lora);
    let saving = json(&[&lora[..], &["--modules-to-save", "embed_tokens"]].concat());
    assert_eq!(
        saving["adapter"]["trainable_params"].as_u64().unwrap(),
        plain["adapter"]["trainable_params"].as_u64().unwrap() + 128_256 * 2048
    );
}

/// Under ZeRO the figures are the heaviest rank's: GPT-2's is rank 0 (the tied embedding,
/// the largest parameter, given first); Llama 3.1 8B's parameters, given largest first,
/// leave every rank within 1% of an even share at 2, 4 and 8 ranks, and at 3 ranks rank 2
/// the heaviest.
#[test]
fn zero_figures_are_the_heaviest_ranks() {
    let rank = |v: &Value| v["data_parallel"]["rank"].as_u64().unwrap();
    let gpt2 = json(&[
        "--model",
        "gpt2",
        "--seq-len",
        "256",
        "--world",
        "4",
        "--zero",
        "1",
    ]);
    assert_eq!(rank(&gpt2), 0);
    let llama = |world: &str| {
        json(&[
            "--model",
            "llama-8b",
            "--seq-len",
            "256",
            "--world",
            world,
            "--zero",
            "1",
        ])
    };
    let exact = |v: &Value| {
        v["trainkit_exact"]["bytes"]["master_weights"]
            .as_u64()
            .unwrap()
    };
    let whole = exact(&json(&["--model", "llama-8b", "--seq-len", "256"]));
    for world in ["2", "4", "8"] {
        let v = llama(world);
        let n: u64 = world.parse().unwrap();
        assert!(
            exact(&v) * n >= whole && exact(&v) * n * 100 <= whole * 101,
            "{world} ranks: rank {} holds {} of {whole}",
            rank(&v),
            exact(&v)
        );
    }
    assert_eq!(rank(&llama("3")), 2);
    let (ok, out, err) = trainkit(&[
        "--model",
        "llama-8b",
        "--seq-len",
        "256",
        "--world",
        "3",
        "--zero",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("the figures are rank 2's (the largest share)"),
        "{out}"
    );
}

/// `--world N` gives one rank's figures: the same as one process's under DDP, and under
/// ZeRO-1 the formulas' master weights and optimizer state divided by the ranks and the
/// exact figures rank 0's share (whole parameters: GPT-2's embedding alone is 31% of it);
/// each rank sends the ring's share of the gradients, and under ZeRO-1 of the weights.
#[test]
fn a_data_parallel_job_is_one_ranks_figures() {
    let base = ["--model", "gpt2", "--seq-len", "256"];
    let with = |extra: &[&str]| json(&[&base[..], extra].concat());
    let (one, ddp, zero) = (
        with(&[]),
        with(&["--world", "4"]),
        with(&["--world", "4", "--zero", "1"]),
    );
    let exact = |v: &Value, c: &str| v["trainkit_exact"]["bytes"][c].as_u64().unwrap();
    let formula = |v: &Value, c: &str| v["bytes"][c].as_u64().unwrap();
    assert_eq!(
        one["trainkit_exact"], ddp["trainkit_exact"],
        "DDP keeps it all"
    );
    for c in ["master_weights", "optimizer_state"] {
        assert_eq!(formula(&zero, c), formula(&one, c).div_ceil(4), "{c}");
        let (whole, share) = (exact(&one, c), exact(&zero, c));
        assert!(
            share * 4 >= whole && share * 2 < whole,
            "{c}: {share} of {whole}"
        );
    }
    // AdamW's two f32 moments beside each f32 master element rank 0 owns.
    assert_eq!(
        exact(&zero, "optimizer_state"),
        2 * exact(&zero, "master_weights")
    );
    for c in ["weights", "gradients", "activations"] {
        assert_eq!(exact(&zero, c), exact(&one, c), "{c}");
    }
    let params = one["params"].as_u64().unwrap() as f64;
    let sent = |v: &Value, what: &str| v["data_parallel"]["bytes_sent_per_step"][what].as_u64();
    // Gradients summed in f32 (4 bytes, bf16 or not), bf16 weights (2 bytes); the ring
    // sends 2·3/4 and 3/4 of them.
    assert_eq!(
        sent(&ddp, "gradients"),
        Some((2.0 * 0.75 * 4.0 * params).round() as u64)
    );
    assert_eq!(sent(&ddp, "weights"), Some(0));
    assert_eq!(
        sent(&zero, "weights"),
        Some((0.75 * 2.0 * params).round() as u64)
    );
    assert_eq!(sent(&one, "gradients"), Some(0));
    let (ok, out, err) = trainkit(&[&base[..], &["--world", "4", "--zero", "1"]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("ranks      4 (ZeRO-1"), "{out}");
    assert!(out.contains("optimizer_state          8/4"), "{out}");
    // ZeRO-2: rank 0 keeps the gradients of what it owns (and, while backward runs, the
    // one it has not yet summed: GPT-2's tied embedding, the largest, is a third of them).
    let zero2 = with(&["--world", "4", "--zero", "2"]);
    assert_eq!(
        formula(&zero2, "gradients"),
        formula(&one, "gradients").div_ceil(4)
    );
    let (whole, share) = (exact(&one, "gradients"), exact(&zero2, "gradients"));
    assert!(share * 4 >= whole && share < whole, "{share} of {whole}");
    for c in ["master_weights", "optimizer_state"] {
        assert_eq!(exact(&zero2, c), exact(&zero, c), "{c}");
    }
    assert_eq!(sent(&zero2, "weights"), sent(&zero, "weights"));
    let (ok, out, err) = trainkit(&[&base[..], &["--world", "4", "--zero", "2"]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("ranks      4 (ZeRO-2"), "{out}");
    assert!(out.contains("gradients                2/4"), "{out}");
}

/// `--stream-weights`: the frozen base in host memory (the streamed category), the device
/// holding two sections of it, and the bytes a step copies; the adapters' own figures
/// unchanged.
#[test]
fn streamed_weights_move_the_base_to_host_memory() {
    let args = [
        "--model",
        "llama-3.2-1b",
        "--lora-rank",
        "8",
        "--qlora",
        "--recompute",
        "full",
        "--seq-len",
        "256",
    ];
    let resident = json(&args);
    let streamed_args = [&args[..], &["--stream-weights"]].concat();
    let streamed = json(&streamed_args);
    let (r, s) = (&resident["trainkit_exact"], &streamed["trainkit_exact"]);
    let bytes = |v: &Value, c: &str| v["bytes"][c].as_u64().unwrap();
    assert_eq!(r["stream_weights"], false);
    assert_eq!(s["stream_weights"], true);
    assert_eq!(bytes(r, "streamed"), 0);
    assert_eq!(r["streamed_bytes_per_step"], 0);
    let host = bytes(s, "streamed");
    // The frozen base: more than the device keeps of it with streaming, which is at most
    // two sections (the tied 128256 × 2048 bf16 embedding is the largest).
    assert!(host > 0 && bytes(s, "weights") < bytes(r, "weights"), "{s}");
    assert!(
        bytes(s, "weights") <= bytes(r, "weights") - host + 2 * 128_256 * 2048 * 2,
        "{s}"
    );
    assert_eq!(s["host_bytes"].as_u64().unwrap(), host);
    // Forward and backward each copy the base (the head once); the tied embedding table
    // is read by the embedding twice and by the head.
    let per_step = s["streamed_bytes_per_step"].as_u64().unwrap();
    let table = 128_256 * 2048 * 2;
    assert!(
        per_step > host && per_step <= 2 * host + table,
        "{per_step} vs {host}"
    );
    for c in ["gradients", "optimizer_state", "activations"] {
        assert_eq!(bytes(s, c), bytes(r, c), "{c}");
    }
    assert!(s["peak_total_bytes"].as_u64() < r["peak_total_bytes"].as_u64());
    let (ok, out, err) = trainkit(&streamed_args);
    assert!(ok, "{err}");
    assert!(
        out.contains("streamed weights:") && out.contains("copied to the device per step"),
        "{out}"
    );
}
