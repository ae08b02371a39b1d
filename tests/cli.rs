//! The `trainkit` binary as a user runs it.

use std::process::Command;

fn trainkit(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trainkit"))
        .args(args)
        .output()
        .expect("run trainkit");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
    for (args, needle) in [
        (vec!["train", "--device", "tpu"], "auto, cpu or cuda"),
        (
            vec!["train", "--data", "/nonexistent/file.txt"],
            "/nonexistent/file.txt",
        ),
        (
            vec!["train", "--config", "/nonexistent/run.toml"],
            "/nonexistent/run.toml",
        ),
    ] {
        let (ok, _, err) = trainkit(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
