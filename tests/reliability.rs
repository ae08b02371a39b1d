//! Numerical trouble, interrupts and crashes never cost a user their run.

use crate::common;

use common::{corpus_loader, cpu, per_param, scratch, tiny_config, token_file_bytes, TINY_TRAIN};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use trainkit::model::{Batch, ParamInit, Pass, PassStats};
use trainkit::{Error, Gpt2, Model, Rng, Tensor, Trainer, TrainerOptions};

/// GPT-2 that poisons chosen micro-batches: a NaN gradient (through the loss-gradient
/// scale) or a NaN loss.
#[derive(Debug)]
struct Poisoned {
    inner: Gpt2,
    calls: AtomicUsize,
    nan_grad: Vec<usize>,
    nan_loss: Vec<usize>,
}

impl Model for Poisoned {
    fn describe(&self) -> String {
        self.inner.describe()
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
    ) -> trainkit::Result<PassStats> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let scale = if self.nan_grad.contains(&call) {
            f32::NAN
        } else {
            grad_scale
        };
        let s = self.inner.forward_backward(pass, batch, scale, losses)?;
        if self.nan_loss.contains(&call) {
            pass.backend.fill(losses, f32::NAN)?;
        }
        Ok(s)
    }
    fn loss(&self, pass: &mut Pass<'_>, batch: &Batch) -> trainkit::Result<f64> {
        self.inner.loss(pass, batch)
    }
    fn logits(&self, pass: &mut Pass<'_>, batch: &Batch) -> trainkit::Result<Vec<f32>> {
        self.inner.logits(pass, batch)
    }
    fn write_config(&self, dir: &Path) -> trainkit::Result<()> {
        self.inner.write_config(dir)
    }
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.inner.flops_per_token(seq_len)
    }
}

fn poisoned(
    nan_grad: Vec<usize>,
    nan_loss: Vec<usize>,
    max_bad_steps: u64,
) -> Trainer<
    trainkit::Fp32,
    trainkit::NoRecompute,
    trainkit::AdamW,
    trainkit::Constant,
    trainkit::PeakTracker,
> {
    let model = Poisoned {
        inner: Gpt2::new(tiny_config()).unwrap(),
        calls: AtomicUsize::new(0),
        nan_grad,
        nan_loss,
    };
    Trainer::builder(model, cpu(), corpus_loader(4000, 3, 2, 16))
        .options(TrainerOptions {
            max_bad_steps,
            ..TrainerOptions::default()
        })
        .build()
        .unwrap()
}

#[test]
fn non_finite_steps_are_skipped_before_the_optimizer_touches_anything() {
    let mut t = poisoned(vec![2], vec![3], 10);
    t.step().unwrap();
    t.step().unwrap();
    let weights = per_param(&t, |p| p.value());
    let moments: Vec<Vec<Vec<f32>>> = t
        .params()
        .iter()
        .map(|p| {
            p.state()
                .iter()
                .map(|s| t.backend().to_f32(s).unwrap())
                .collect()
        })
        .collect();
    let a = t.step().unwrap();
    let b = t.step().unwrap();
    assert!(
        a.skipped && a.grad_norm.is_nan() && a.loss.is_finite(),
        "{a:?}"
    );
    assert!(b.skipped && b.loss.is_nan(), "{b:?}");
    assert_eq!(t.skipped_steps(), 2);
    assert_eq!(t.bad_streak(), 2);
    assert_eq!(per_param(&t, |p| p.value()), weights, "weights untouched");
    let after: Vec<Vec<Vec<f32>>> = t
        .params()
        .iter()
        .map(|p| {
            p.state()
                .iter()
                .map(|s| t.backend().to_f32(s).unwrap())
                .collect()
        })
        .collect();
    assert_eq!(after, moments, "optimizer state untouched");
    let c = t.step().unwrap();
    assert!(!c.skipped && c.loss.is_finite());
    assert_eq!(t.bad_streak(), 0);
    assert_ne!(per_param(&t, |p| p.value()), weights, "training goes on");
}

#[test]
fn too_many_bad_steps_in_a_row_stop_the_run() {
    let mut t = poisoned(vec![1, 2, 3, 4, 5], vec![], 3);
    t.step().unwrap();
    let good = per_param(&t, |p| p.value());
    t.step().unwrap();
    t.step().unwrap();
    let err = t.step().unwrap_err();
    assert!(matches!(err, Error::Diverged { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("3 steps in a row") && msg.contains("step 1"),
        "{msg}"
    );
    assert_eq!(per_param(&t, |p| p.value()), good);
}

fn train_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_trainkit"));
    c.args(TINY_TRAIN)
        .args(["--batch-size", "2", "--out"])
        .arg(out)
        .args(extra);
    c
}

fn saved_step(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["step"].as_u64().unwrap()
}

/// Resumes the run saved in `dir` up to `steps`, which it must then have saved.
fn resume_to(dir: &Path, steps: u64) {
    let out = train_cmd(dir, &[])
        .arg("--resume")
        .arg(dir)
        .args(["--steps", &steps.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(saved_step(dir), steps);
}

#[cfg(unix)]
fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

#[cfg(unix)]
#[test]
fn an_interrupt_finishes_the_step_saves_and_exits_cleanly() {
    for sig in ["-INT", "-TERM"] {
        let dir = scratch(&format!("int{sig}")).join("run");
        let mut child = train_cmd(&dir, &["--steps", "100000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Signal once the first step is reported, however long start-up takes on a busy
        // machine.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut stdout = String::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            stdout.push_str(&line);
            stdout.push('\n');
            if line.starts_with("step") {
                break;
            }
        }
        signal(&child, sig);
        for line in lines {
            stdout.push_str(&line.unwrap());
            stdout.push('\n');
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{sig}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("resume with: trainkit train --resume"),
            "{stdout}"
        );
        let step = saved_step(&dir);
        assert!(step >= 1, "{step}");
        resume_to(&dir, step + 1);
    }
}

#[cfg(unix)]
#[test]
fn a_process_killed_while_saving_always_leaves_a_checkpoint_that_resumes() {
    let root = scratch("kill");
    let dir = root.join("run");
    let mut rng = Rng::new(42);
    let mut last = 0;
    let mut mid_save = 0;
    for round in 0..20 {
        // Saves every step: a kill lands inside a save most of the time.
        let mut cmd = train_cmd(&dir, &["--steps", "100000", "--save-every", "1"]);
        if round > 0 {
            cmd.arg("--resume").arg(&dir);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        if round == 0 {
            while !dir.join("trainer_state.json").exists() {
                assert!(start.elapsed() < Duration::from_secs(60), "no first save");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        std::thread::sleep(Duration::from_millis(50 + rng.below(400) as u64));
        signal(&child, "-KILL");
        child.wait().unwrap();
        let debris = std::fs::read_dir(&root).unwrap().count() > 1;
        mid_save += debris as usize;
        let resumed = Command::new(env!("CARGO_BIN_EXE_trainkit"))
            .args(["train", "--device", "cpu", "--resume"])
            .arg(&dir)
            .args(["--steps", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&resumed.stderr);
        assert!(resumed.status.success(), "round {round}: {err}");
        let step = saved_step(&dir);
        assert!(
            step >= last,
            "round {round}: step went back from {last} to {step}"
        );
        last = step;
        // No debris: only the checkpoint itself beside it.
        let names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["run".to_string()], "round {round}");
    }
    // Kills landed inside saves (their staging directories were left behind), and
    // every time the previous checkpoint was whole.
    assert!(mid_save > 0, "no kill landed inside a save");
    eprintln!("{mid_save} of 20 kills landed inside a save");
    // The last checkpoint trains on.
    resume_to(&dir, last + 2);
}

/// Every kind of bad input ends in one line on stderr naming the file or field, a
/// non-zero exit, and no panic.
#[test]
fn bad_input_of_every_kind_is_a_one_line_error() {
    let dir = scratch("badinput");
    let p = |name: &str| dir.join(name);
    let s = |path: &Path| path.to_str().unwrap().to_string();
    // A good model directory to damage.
    let good = p("good");
    let ok = train_cmd(&good, &["--steps", "1"]).output().unwrap();
    assert!(ok.status.success());
    let copy = |name: &str| {
        let d = p(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in [
            "config.json",
            "model.safetensors",
            "trainer_state.json",
            "trainer_state.safetensors",
            "trainkit.toml",
        ] {
            std::fs::copy(good.join(f), d.join(f)).unwrap();
        }
        d
    };
    let truncated = copy("truncated");
    let bytes = std::fs::read(truncated.join("model.safetensors")).unwrap();
    std::fs::write(
        truncated.join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let corrupt = copy("corrupt");
    let mut bytes = std::fs::read(corrupt.join("model.safetensors")).unwrap();
    bytes[8..40].fill(b'#');
    std::fs::write(corrupt.join("model.safetensors"), &bytes).unwrap();
    let disagree = copy("disagree");
    let cfg = std::fs::read_to_string(disagree.join("config.json")).unwrap();
    std::fs::write(
        disagree.join("config.json"),
        cfg.replace("\"n_embd\": 32", "\"n_embd\": 64"),
    )
    .unwrap();
    let state = copy("state");
    std::fs::write(state.join("trainer_state.json"), "{ not json").unwrap();
    // Token files.
    let wrong_magic = p("magic.bin");
    std::fs::write(&wrong_magic, token_file_bytes(1234, 1, 4, &[0; 4])).unwrap();
    let odd = p("odd.bin");
    let mut f = token_file_bytes(20240520, 1, 400, &[]);
    f.extend(vec![1u8; 401]);
    std::fs::write(&odd, &f).unwrap();
    let beyond = p("beyond.bin");
    let ids: Vec<u16> = (0..400).map(|i| i % 300).collect();
    std::fs::write(&beyond, token_file_bytes(20240520, 1, 400, &ids)).unwrap();
    let fine = p("fine.bin");
    let ids: Vec<u16> = (0..400).map(|i| i % 200).collect();
    std::fs::write(&fine, token_file_bytes(20240520, 1, 400, &ids)).unwrap();
    let bad_toml = p("bad.toml");
    std::fs::write(&bad_toml, "[training\nsteps = 3\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "eval".into(),
                "--model".into(),
                s(&truncated),
                "--data".into(),
                s(&beyond),
            ],
            "model.safetensors",
        ),
        (
            vec![
                "eval".into(),
                "--model".into(),
                s(&corrupt),
                "--data".into(),
                s(&beyond),
            ],
            "model.safetensors",
        ),
        (
            vec![
                "eval".into(),
                "--model".into(),
                s(&disagree),
                "--data".into(),
                s(&beyond),
            ],
            "shape",
        ),
        (
            vec!["train".into(), "--resume".into(), s(&state)],
            "trainer_state.json",
        ),
        (
            vec!["train".into(), "--data".into(), s(&wrong_magic)],
            "magic.bin",
        ),
        (
            vec![
                "train".into(),
                "--data".into(),
                s(&odd),
                "--tokenizer".into(),
                "bytes".into(),
            ],
            "odd.bin",
        ),
        (
            vec![
                "train".into(),
                "--data".into(),
                s(&beyond),
                "--tokenizer".into(),
                "bytes".into(),
            ],
            "vocab",
        ),
        (
            vec!["train".into(), "--config".into(), s(&bad_toml)],
            "bad.toml",
        ),
        (
            vec![
                "train".into(),
                "--n-embd".into(),
                "30".into(),
                "--n-head".into(),
                "4".into(),
            ],
            "n_head",
        ),
        (
            vec!["train".into(), "--config".into(), s(&p("missing.toml"))],
            "missing.toml",
        ),
        (
            vec!["train".into(), "--init-from".into(), s(&p("nowhere"))],
            "nowhere",
        ),
        (
            vec![
                "sample".into(),
                "--model".into(),
                s(&good),
                "--prompt".into(),
                "".into(),
            ],
            "prompt",
        ),
        (
            vec![
                "sample".into(),
                "--model".into(),
                s(&good),
                "--prompt".into(),
                "x".into(),
                "--temperature=-1".into(),
            ],
            "temperature",
        ),
    ];
    for (mut args, needle) in cases {
        if args[0] != "train" || !args.contains(&"--device".to_string()) {
            args.extend(["--device".into(), "cpu".into()]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_trainkit"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: one line, got {err}"
        );
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn running_out_of_memory_is_an_error_that_shows_the_ledger() {
    let be = cpu();
    let mut t = Trainer::builder(
        Gpt2::new(tiny_config()).unwrap(),
        be.clone(),
        corpus_loader(4000, 3, 2, 16),
    )
    .build()
    .unwrap();
    t.step().unwrap();
    let weights = per_param(&t, |p| p.value());
    let live = be.ledger().snapshot().live.total();
    // Room for the weights, gradients and moments, not for a step's activations.
    be.ledger().set_limit(Some(live + 4096));
    let err = t.step().unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    let msg = err.to_string();
    for needle in ["would exceed the limit", "live:", "weights", "recompute"] {
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
    assert_eq!(
        per_param(&t, |p| p.value()),
        weights,
        "a failed step changes nothing"
    );
    // With the limit lifted the run goes on.
    be.ledger().set_limit(None);
    assert!(t.step().is_ok());
}
