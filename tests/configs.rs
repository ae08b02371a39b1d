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
        trainkit::ModelConfig::Gpt2(trainkit::Gpt2Config::gpt2_124m())
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
    assert!(bad("[optimizer]\nkind = \"lion\"\n").contains("lion"));
    assert!(bad("[data]\nsource = \"s3\"\n").contains("s3"));
    let vocab = bad("[data]\nsource = \"text\"\npath = \"x.txt\"\ntokenizer = \"gpt2\"\n");
    assert!(
        vocab.contains("vocab_size") && vocab.contains("50257"),
        "{vocab}"
    );
    let frac = bad("[data]\nsource = \"text\"\npath = \"x.txt\"\nval_fraction = 1.0\n");
    assert!(frac.contains("val_fraction"), "{frac}");
}
