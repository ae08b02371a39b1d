//! `trainkit train`'s memory flags as a user runs them: the report, the budget, autofit.
//! Autofit's choice is the run's: every technique it takes is applied, and the run's
//! memory report then agrees with the exact prediction.

use crate::common;

use common::{scratch, TINY_TRAIN};

/// A tiny training run with `extra` flags.
fn trainkit(extra: &[&str]) -> (bool, String, String) {
    let mut args = TINY_TRAIN.to_vec();
    args.extend_from_slice(extra);
    common::trainkit(&args)
}

#[test]
fn the_memory_report_puts_measured_peaks_next_to_the_exact_prediction() {
    let dir = scratch("memory-report");
    let report = dir.join("memory.json");
    for precision in ["fp32", "bf16"] {
        for recompute in ["none", "selective", "full"] {
            let (ok, _, err) = trainkit(&[
                "--steps",
                "2",
                "--batch-size",
                "3",
                "--grad-accum",
                "2",
                "--precision",
                precision,
                "--recompute",
                recompute,
                "--memory-report",
                report.to_str().unwrap(),
            ]);
            assert!(ok, "{err}");
            let r: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
            for key in [
                "weights",
                "master_weights",
                "gradients",
                "optimizer_state",
                "activations",
                "workspace",
            ] {
                let m = r["measured"][key].as_u64().unwrap();
                assert_eq!(m, r["predicted"][key].as_u64().unwrap(), "{key}: {r}");
            }
            assert!(r["measured"]["activations"].as_u64().unwrap() > 0);
            assert_eq!(r["peak_total"]["measured"], r["peak_total"]["predicted"]);
            assert_eq!(
                r["measured"]["master_weights"].as_u64().unwrap() > 0,
                precision == "bf16"
            );
        }
    }
}

/// The peak total the report measured for a setup.
fn measured_peak(extra: &[&str]) -> u64 {
    let dir = scratch("memory-peak");
    let report = dir.join("m.json");
    let mut args = vec!["--steps", "2", "--memory-report", report.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (ok, _, err) = trainkit(&args);
    assert!(ok, "{err}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    r["peak_total"]["measured"].as_u64().unwrap()
}

#[test]
fn autofit_fits_the_budget_and_an_oversized_run_says_what_would_fit() {
    let whole = measured_peak(&["--batch-size", "8"]);
    let budget = (whole * 3 / 4).to_string();
    // Without autofit the batch of 8 exceeds the budget: the error names a setup that fits.
    let (ok, _, err) = trainkit(&[
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--memory-budget",
        &budget,
    ]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("out of memory") && err.contains("what would fit: --batch-size"),
        "{err}"
    );
    // Autofit keeps the global batch of 8 and fits.
    let (ok, out, err) = trainkit(&[
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--autofit",
        "--memory-budget",
        &budget,
    ]);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with("autofit:")).unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let micro: usize = words[2].parse().unwrap();
    let k: usize = words[4].parse().unwrap();
    assert_eq!(micro * k, 8, "{line}");
    let recompute = words[7].trim_end_matches([':', ',']);
    let peak = measured_peak(&[
        "--batch-size",
        &micro.to_string(),
        "--grad-accum",
        &k.to_string(),
        "--recompute",
        recompute,
    ]);
    assert!(peak <= whole * 3 / 4, "{line}: {peak}");
}

#[test]
fn memory_flags_refuse_bad_values_in_one_line() {
    for (args, needle) in [
        (&["--memory-budget", "lots"][..], "24GiB"),
        (&["--memory-budget", "0"][..], "24GiB"),
        (&["--global-batch", "8"][..], "--autofit"),
        (
            &[
                "--autofit",
                "--global-batch",
                "0",
                "--memory-budget",
                "1GiB",
            ][..],
            "at least 1",
        ),
        (
            &["--autofit", "--memory-budget", "1KiB"][..],
            "what would fit",
        ),
        (
            &[
                "--autofit",
                "--memory-budget",
                "1GiB",
                "--autofit-techniques",
                "full,fast",
            ][..],
            "--autofit-techniques",
        ),
        (&["--autofit-techniques", "all"][..], "--autofit"),
    ] {
        let (ok, _, err) = trainkit(args);
        assert!(!ok, "{args:?}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// The tightest budget autofit can fit with `extra`, from its out-of-memory message
/// ("a budget of at least 8.79 MiB"), rounded up to the next 0.01 MiB.
fn tightest_budget(extra: &[&str]) -> String {
    let mut args = extra.to_vec();
    args.extend_from_slice(&["--autofit", "--memory-budget", "1KiB"]);
    let (ok, _, err) = trainkit(&args);
    assert!(!ok);
    let at_least = err
        .split("a budget of at least ")
        .nth(1)
        .unwrap_or_else(|| panic!("{err}"));
    let mut words = at_least.split_whitespace();
    let value: f64 = words.next().unwrap().parse().unwrap();
    let unit = words.next().unwrap().trim_end_matches([',', ';']);
    format!("{:.2}{unit}", value + 0.01)
}

#[test]
fn autofit_applies_every_technique_it_chooses_and_the_report_agrees() {
    let dir = scratch("autofit-all");
    let report = dir.join("memory.json");
    let run = ["--steps", "2", "--batch-size", "4", "--grad-clip", "0"];
    let budget = tightest_budget(&run);
    let mut args = run.to_vec();
    args.extend_from_slice(&[
        "--autofit",
        "--memory-budget",
        &budget,
        "--memory-report",
        report.to_str().unwrap(),
    ]);
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with("autofit:")).unwrap();
    let device = out.lines().find(|l| l.starts_with("device:")).unwrap();
    // At the tightest budget autofit needs more than batch and recompute; each technique
    // it names is the run's.
    let setup: Vec<&str> = line.split(": peak").next().unwrap().split(", ").collect();
    let mut applied = 0;
    for (technique, shown) in [
        ("adamw8bit", "optimizer adamw8bit"),
        ("optimizer-in-backward", "inside backward"),
        ("offload", "offloaded to host memory"),
        (
            "optimizer-offload",
            "on the host (master weights and state in host memory)",
        ),
        ("bf16", "precision mixed_bf16"),
        ("recompute budget:", "recompute budget:"),
    ] {
        if setup.iter().any(|s| s.starts_with(technique)) {
            assert!(device.contains(shown), "{line}\n{device}");
            applied += 1;
        }
    }
    assert!(applied >= 2, "{line}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["measured"], r["predicted"], "{r}");
    assert_eq!(r["peak_total"]["measured"], r["peak_total"]["predicted"]);
    let measured = r["peak_total"]["measured"].as_u64().unwrap();
    assert!(measured <= trainkit::estimate::parse_bytes(&budget).unwrap());
}

/// A flag given on the command line stays as given; the explanation says so.
#[test]
fn autofit_keeps_the_flags_given() {
    let run = [
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--grad-clip",
        "0",
        "--precision",
        "fp32",
        "--optimizer",
        "adamw",
        "--recompute",
        "none",
    ];
    let budget = tightest_budget(&run);
    let mut args = run.to_vec();
    args.extend_from_slice(&["--autofit", "--memory-budget", &budget, "--print-config"]);
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with("autofit:")).unwrap();
    let setup = line.split(": peak").next().unwrap();
    assert!(setup.contains("recompute none"), "{line}");
    for absent in ["adamw8bit", "bf16", "full", "budget"] {
        assert!(!setup.contains(absent), "{line}");
    }
    assert!(
        out.contains("bf16                   not considered"),
        "{out}"
    );
}

/// `--optimizer-offload` stays on under autofit: the plan does not add it, says why, and
/// the config it prints keeps the optimizer on the host.
#[test]
fn autofit_keeps_the_optimizer_on_the_host_when_asked() {
    let run = [
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--grad-clip",
        "0",
        "--optimizer-offload",
    ];
    let budget = tightest_budget(&run);
    let mut args = run.to_vec();
    args.extend_from_slice(&["--autofit", "--memory-budget", &budget, "--print-config"]);
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with("autofit:")).unwrap();
    assert!(!line.contains("optimizer-offload"), "{line}");
    assert!(
        out.contains("optimizer-offload      not considered: on already"),
        "{out}"
    );
    // The host holds the optimizer's side (and, where autofit streams the weights beside
    // it, those too).
    assert!(out.contains("(master weights and optimizer state"), "{out}");
    let toml = &out[out.find("[accumulation]").unwrap_or(0)..];
    let cfg: toml::Value = toml::from_str(toml).unwrap();
    assert_eq!(cfg["optimizer"]["offload"].as_bool(), Some(true), "{toml}");
}
