//! The ready configs in examples/configs/ parse, validate and mean what they say.

use trainkit::config::{DataConfig, RunConfig};

fn load(name: &str) -> RunConfig {
    let path = format!("{}/examples/configs/{name}", env!("CARGO_MANIFEST_DIR"));
    RunConfig::from_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_default_config_is_the_default_run() {
    let file = load("default.toml");
    let builtin = RunConfig::default();
    assert_eq!(file.to_toml().unwrap(), builtin.to_toml().unwrap());
}

#[test]
fn the_gpt2_config_is_gpt2_small() {
    let c = load("gpt2-124m.toml");
    assert_eq!(
        c.model,
        trainkit::ModelConfig::new(trainkit::Gpt2Config::gpt2_124m())
    );
    assert!(matches!(c.data, DataConfig::Tokens { .. }));
    let json = serde_json::to_value(&c.precision).unwrap();
    assert_eq!(json["kind"], "mixed_bf16");
}

#[test]
fn the_memory_lean_config_recomputes_and_accumulates() {
    let c = load("memory-lean.toml");
    assert_eq!(serde_json::to_value(&c.checkpoint).unwrap()["kind"], "full");
    assert_eq!(
        serde_json::to_value(&c.accumulation).unwrap()["micro_batches"],
        8
    );
}

/// The budget-and-offload config says what its comment says, and trains.
#[test]
fn the_budget_offload_config_keeps_a_budget_offloaded() {
    let c = load("budget-offload.toml");
    let policy = serde_json::to_value(&c.checkpoint).unwrap();
    assert_eq!(policy["kind"], "budget");
    assert_eq!(policy["bytes"], 16 << 20);
    assert!(c.training.offload_activations);
}

/// The fp16 config carries Megatron-LM's loss-scale settings and round-trips.
#[test]
fn the_fp16_config_scales_the_loss_as_megatron_does() {
    let c = load("fp16-megatron.toml");
    let json = serde_json::to_value(&c.precision).unwrap();
    assert_eq!(json["kind"], "mixed_fp16");
    assert_eq!(json["hysteresis"], 2);
    assert_eq!(json["min_scale"], 1.0);
    assert_eq!(json["growth_interval"], 1000);
    assert_eq!(c.precision.compute_dtype(), trainkit::DType::F16);
    assert_eq!(c.precision.loss_scale(), 65536.0);
    c.precision.validate().unwrap();
    let back = RunConfig::from_toml(&c.to_toml().unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&back.precision).unwrap(), json);
}

/// `[optimizer] kind = "adamw8bit"` reads with its settings, writes back the same, and
/// `--optimizer` switches kinds keeping the settings they share.
#[test]
fn adamw8bit_config_round_trips_and_the_flag_switches_optimizers() {
    use trainkit::config::{Overrides, PolicyFlags};
    use trainkit::{AdamW8bit, Optimizer};
    let text =
        "[optimizer]\nkind = \"adamw8bit\"\nlr = 0.001\nbeta2 = 0.99\nmin_8bit_size = 1024\n";
    let c = RunConfig::from_toml(text).unwrap();
    let json = serde_json::to_value(&c.optimizer).unwrap();
    assert_eq!(json["kind"], "adamw8bit");
    assert_eq!(json["min_8bit_size"], 1024);
    let back = RunConfig::from_toml(&c.to_toml().unwrap()).unwrap();
    assert_eq!(serde_json::to_value(&back.optimizer).unwrap(), json);
    assert_eq!(c.optimizer.state_bytes_per_param(), 2);

    // From the default AdamW (lr 2e-3): the settings carry over.
    let mut c = RunConfig::default();
    let o = Overrides {
        policy: PolicyFlags {
            optimizer: Some("adamw8bit".into()),
            ..PolicyFlags::default()
        },
        ..Overrides::default()
    };
    o.apply(&mut c).unwrap();
    let json = serde_json::to_value(&c.optimizer).unwrap();
    assert_eq!(json["kind"], "adamw8bit");
    let want = AdamW8bit {
        lr: 2e-3,
        ..AdamW8bit::default()
    };
    assert_eq!(json, serde_json::to_value(&want as &dyn Optimizer).unwrap());
    // --lr applies after the switch; sgd keeps lr and weight decay.
    let o = Overrides {
        policy: PolicyFlags {
            optimizer: Some("sgd".into()),
            ..PolicyFlags::default()
        },
        lr: Some(0.5),
        ..Overrides::default()
    };
    o.apply(&mut c).unwrap();
    let json = serde_json::to_value(&c.optimizer).unwrap();
    assert_eq!(
        (json["kind"].as_str(), json["lr"].as_f64()),
        (Some("sgd"), Some(0.5))
    );
    let err = Overrides {
        policy: PolicyFlags {
            optimizer: Some("adam8".into()),
            ..PolicyFlags::default()
        },
        ..Overrides::default()
    }
    .apply(&mut c)
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--optimizer") && err.contains("adamw, adamw8bit, sgd"),
        "{err}"
    );
}

#[test]
fn config_errors_name_the_field_and_the_fix() {
    let bad = |text: &str| RunConfig::from_toml(text).unwrap_err().to_string();
    assert!(bad("[training]\nsteps = \"ten\"\n").contains("steps"));
    assert!(bad(
        "[model]\nn_layer = 2\nn_head = 3\nn_embd = 32\nn_positions = 8\nvocab_size = 256\n"
    )
    .contains("n_head"));
    assert!(bad("[training]\nbatch_size = 0\n").contains("batch_size"));
    assert!(bad("[training]\nseq_len = 999\n").contains("n_positions"));
    // A kind no crate of the test binary registers (tests/lion.rs registers `lion`).
    let unknown = bad("[optimizer]\nkind = \"adafactor\"\n");
    assert!(
        unknown.contains("adafactor") && unknown.contains("adamw8bit"),
        "{unknown}"
    );
    let eight = bad("[optimizer]\nkind = \"adamw8bit\"\nmin_8bit = 10\n");
    assert!(eight.contains("min_8bit"), "{eight}");
    assert!(bad("[data]\nsource = \"s3\"\n").contains("s3"));
    let vocab = bad("[data]\nsource = \"text\"\npath = \"x.txt\"\ntokenizer = \"gpt2\"\n");
    assert!(
        vocab.contains("vocab_size") && vocab.contains("50257"),
        "{vocab}"
    );
    let frac = bad("[data]\nsource = \"text\"\npath = \"x.txt\"\nval_fraction = 1.0\n");
    assert!(frac.contains("val_fraction"), "{frac}");
}

#[test]
fn the_smollm2_config_is_the_preset() {
    let c = load("smollm2-135m.toml");
    assert_eq!(
        c.model,
        trainkit::ModelConfig::preset("smollm2-135m").unwrap()
    );
    assert_eq!(
        serde_json::to_value(&c.checkpoint).unwrap()["kind"],
        "selective"
    );
}
