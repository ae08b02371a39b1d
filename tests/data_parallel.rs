//! Data parallelism with real processes: `mpirun -np N trainkit train` against one
//! process accumulating the same micro-batches. N ranks of micro-batch b read the global
//! step's N micro-batches, sum their gradients over MPI and take the step one process
//! accumulating N micro-batches of b takes: the same losses, gradient norms and trained
//! tokens every step, and the same weights to float32 rounding (a rank's gradient is
//! summed whole where one process adds each micro-batch into the running sum inside
//! backward's products, so the additions round in another order); bitwise, for two
//! ranks, against one process that accumulates apart (`--separate-accumulation`). ZeRO-1 (`--zero 1`) against DDP: bitwise the same
//! training and checkpoints, each rank keeping its share of the optimizer side, and each
//! rank's ledger equal to its prediction; ZeRO-2 (`--zero 2`) the same, each rank keeping
//! its share of the gradients too. Ranks that disagree on the model end the whole
//! job with an error naming the rank, never a hang.
//!
//! Needs the `mpi` feature and an MPI's `mpirun` (`apt-get install mpich libmpich-dev
//! libclang-dev`; `cargo test --features mpi --test data_parallel`). Without them the
//! tests say what they skipped, or fail where `TRAINKIT_REQUIRE_MPI=1` asks for them (CI).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Why the tests cannot run here, if they cannot.
fn unavailable() -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some("trainkit was built without the `mpi` feature".into());
    }
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no `mpirun` on the PATH (apt-get install mpich libmpich-dev)".into()),
    }
}

/// Whether to run; panics where MPI is required but missing.
fn ready(test: &str) -> bool {
    match unavailable() {
        None => true,
        Some(why) if std::env::var("TRAINKIT_REQUIRE_MPI").is_ok_and(|v| v == "1") => {
            panic!("{test}: TRAINKIT_REQUIRE_MPI=1 but {why}")
        }
        Some(why) => {
            eprintln!("skipped {test}: {why}");
            false
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainkit-ddp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `trainkit train` on the built-in corpus for 3 steps with `extra` flags, saving to
/// `dir`, logging JSON lines there; under `mpirun -np ranks` when `ranks` is given.
fn train(ranks: Option<usize>, dir: &Path, extra: &[&str]) -> Output {
    train_steps(ranks, dir, 3, extra)
}

/// [`train`] for `steps` steps.
fn train_steps(ranks: Option<usize>, dir: &Path, steps: u64, extra: &[&str]) -> Output {
    run_bounded(
        train_command(ranks, dir, steps, extra),
        Duration::from_secs(300),
    )
}

/// The command [`train_steps`] runs.
fn train_command(ranks: Option<usize>, dir: &Path, steps: u64, extra: &[&str]) -> Command {
    let bin = env!("CARGO_BIN_EXE_trainkit");
    let out = dir.join("model");
    let log = dir.join("log.jsonl");
    let steps = steps.to_string();
    let mut args: Vec<String> = [
        "train",
        "--steps",
        &steps,
        "--seq-len",
        "64",
        "--eval-every",
        "0",
        "--warmup-steps",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--out".into(), out.display().to_string()]);
    args.extend(["--log-json".into(), log.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut c = match ranks {
        Some(n) => {
            let mut c = Command::new("mpirun");
            c.args(["-np", &n.to_string(), bin]);
            c
        }
        None => Command::new(bin),
    };
    c.args(&args).env_remove("RUST_BACKTRACE");
    c
}

/// Runs `c`, killing it after `limit` (a hang fails the test instead of stalling CI).
fn run_bounded(mut c: Command, limit: Duration) -> Output {
    let child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_bounded(child, limit)
}

/// Waits for `child`, killing it after `limit`.
fn wait_bounded(child: std::process::Child, limit: Duration) -> Output {
    let id = child.id();
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("the job hung: killed after {:?}", start.elapsed())
        }
    }
}

/// The JSON lines of a run's log: (loss, grad norm, tokens, trained tokens) per step.
fn steps(dir: &Path) -> Vec<(f64, f64, u64, u64)> {
    let text = std::fs::read_to_string(dir.join("log.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
                v["tokens"].as_u64().unwrap(),
                v["trained_tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Every f32 tensor of a saved model (or of a LoRA run's adapter), by name.
fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let model = dir.join("model");
    let file = ["model.safetensors", "adapter_model.safetensors"]
        .iter()
        .map(|f| model.join(f))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{} holds no weights", model.display()));
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let v = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn check(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How far two runs of the same step in another order of additions may drift: the
/// relative difference of losses and of gradient norms, the largest absolute difference
/// of any weight after the steps (AdamW's division by `√v` turns rounding in a small
/// gradient into a step of up to the learning rate's order; a gradient not summed across
/// ranks at all moves the losses by 1e-4 and the weights by 1e-3).
struct Tolerance {
    loss: f64,
    grad_norm: f64,
    weight: f64,
}

/// Gradients in f32.
const F32: Tolerance = Tolerance {
    loss: 1e-6,
    grad_norm: 1e-5,
    weight: 1e-5,
};

/// `ranks` ranks of micro-batch `b` against one process of micro-batch `b` accumulating
/// `ranks` micro-batches, with `extra` flags on both. Two ranks sum their gradients as one
/// process accumulating them apart (`--separate-accumulation`) adds them: bitwise the
/// same training; the one process accumulating in place, or more ranks (MPI adds them in
/// its own order), agree within `tol`.
fn ranks_equal_one_accumulating(
    name: &str,
    ranks: usize,
    b: usize,
    extra: &[&str],
    tol: &Tolerance,
) {
    let (one, many) = (
        scratch(&format!("{name}-one")),
        scratch(&format!("{name}-many")),
    );
    let (bs, accum) = (b.to_string(), ranks.to_string());
    let mut single: Vec<&str> = vec!["--batch-size", &bs, "--grad-accum", &accum];
    single.extend(extra);
    check(&train(None, &one, &single), "one process");
    let bitwise = ranks == 2;
    let apart = scratch(&format!("{name}-apart"));
    if bitwise {
        single.push("--separate-accumulation");
        check(
            &train(None, &apart, &single),
            "one process, separate accumulation",
        );
    }
    let mut parallel: Vec<&str> = vec!["--batch-size", &bs];
    parallel.extend(extra);
    let out = train(Some(ranks), &many, &parallel);
    check(&out, "mpirun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Rank 0 alone speaks: one line per step.
    assert_eq!(stdout.matches("step     1/3").count(), 1, "{stdout}");
    assert!(
        stdout.contains(&format!("data parallel: {ranks} ranks (MPI")),
        "{stdout}"
    );

    // Rank 0's log holds every rank's peak.
    let log = std::fs::read_to_string(many.join("log.jsonl")).unwrap();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let peaks = v["memory_peak_ranks"]
            .as_array()
            .expect("memory_peak_ranks");
        assert_eq!(peaks.len(), ranks, "{line}");
        assert!(peaks.iter().all(|p| p.as_u64().unwrap() > 0), "{line}");
        assert_eq!(peaks[0].as_u64(), v["memory_peak_total"].as_u64(), "{line}");
    }
    let (a, p) = (steps(&one), steps(&many));
    assert_eq!(a.len(), 3);
    assert_eq!(p.len(), 3, "rank 0 alone logs");
    // The first step's loss is every micro-batch's from the same weights: bitwise.
    assert_eq!(a[0].0, p[0].0, "step 1 loss");
    for (s, (x, y)) in a.iter().zip(&p).enumerate() {
        assert_eq!(
            (x.2, x.3),
            (y.2, y.3),
            "step {}: tokens, trained tokens",
            s + 1
        );
        let step = s + 1;
        assert!(
            (x.0 - y.0).abs() <= tol.loss * x.0.abs(),
            "step {step}: {x:?} {y:?}"
        );
        assert!(
            (x.1 - y.1).abs() <= tol.grad_norm * x.1.abs(),
            "step {step}: {x:?} {y:?}"
        );
    }
    let (wa, wp) = (weights(&one), weights(&many));
    assert_eq!(wa.len(), wp.len());
    let mut worst = 0f64;
    for ((na, va), (np, vp)) in wa.iter().zip(&wp) {
        assert_eq!(na, np);
        for (x, y) in va.iter().zip(vp) {
            worst = worst.max((x - y).abs() as f64);
        }
    }
    assert!(worst <= tol.weight, "weights differ by up to {worst:e}");
    eprintln!("{name}: {ranks} ranks against one process accumulating {ranks}: weights within {worst:.1e}");
    if bitwise {
        assert_eq!(steps(&apart), p, "losses, gradient norms, tokens per step");
        weights_bitwise(&apart, &many);
        eprintln!("{name}: 2 ranks bitwise one process accumulating 2 apart");
    }
    for d in [one, many, apart] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn two_ranks_take_the_step_of_one_process_accumulating_two() {
    if ready("two_ranks_take_the_step_of_one_process_accumulating_two") {
        ranks_equal_one_accumulating("f32", 2, 2, &[], &F32);
    }
}

#[test]
fn two_ranks_in_bf16_with_lora() {
    if ready("two_ranks_in_bf16_with_lora") {
        // bf16 gradients: each rank's sum is rounded to bf16 before the ranks add up.
        // SGD, whose step is proportional to the gradient: AdamW's first steps are ±lr
        // wherever a gradient is near zero, whatever its rounding.
        let bf16 = Tolerance {
            loss: 1e-4,
            grad_norm: 1e-3,
            weight: 1e-5,
        };
        ranks_equal_one_accumulating(
            "bf16-lora",
            2,
            2,
            &[
                "--precision",
                "bf16",
                "--lora-rank",
                "4",
                "--optimizer",
                "sgd",
                // Each micro-batch's dropout mask is keyed by its place in the global
                // step, on whichever rank it runs.
                "--lora-dropout",
                "0.1",
            ],
            &bf16,
        );
    }
}

/// Documents masked apart (token-weighted: each micro-batch trains another number of
/// positions, and the step divides by those of every rank), with the optimizer on the
/// host thread.
#[test]
fn two_ranks_with_document_masks_and_the_optimizer_offloaded() {
    if !ready("two_ranks_with_document_masks_and_the_optimizer_offloaded") {
        return;
    }
    let dir = scratch("documents");
    let text = dir.join("docs.txt");
    // Lines of 2 to 30 words: documents of many lengths, ended by newlines.
    let words = [
        "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as",
    ];
    let mut lines = Vec::new();
    let mut x = 7u64;
    for _ in 0..3000 {
        let mut line = Vec::new();
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        for w in 0..2 + (x >> 33) % 29 {
            line.push(words[((x >> 20) as usize + w as usize * 7) % words.len()]);
        }
        lines.push(line.join(" "));
    }
    std::fs::write(&text, lines.join("\n")).unwrap();
    let data = text.display().to_string();
    ranks_equal_one_accumulating(
        "documents",
        2,
        2,
        &[
            "--data",
            &data,
            "--separator-id",
            "10",
            "--optimizer-offload",
        ],
        &F32,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn four_ranks_oversubscribed_take_the_step_of_one_process_accumulating_four() {
    if ready("four_ranks_oversubscribed") {
        ranks_equal_one_accumulating("four", 4, 1, &[], &F32);
    }
}

/// The saved weights of the runs in `a` and `b` are the same, bit for bit.
fn weights_bitwise(a: &Path, b: &Path) {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let differ = va
            .iter()
            .zip(vb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{na}: {differ} of {} values differ", va.len());
    }
}

/// The bytes of a saved run's file `name` (in its model directory).
fn saved_file(dir: &Path, name: &str) -> Vec<u8> {
    let path = dir.join("model").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The peak bytes of memory category `category` on rank 0, over a run's steps.
fn peak_of(dir: &Path, category: &str) -> u64 {
    let log = std::fs::read_to_string(dir.join("log.jsonl")).unwrap();
    log.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["memory_peak"][category].as_u64().unwrap()
        })
        .max()
        .unwrap()
}

/// `ranks` ranks with ZeRO-1 against the same ranks without (DDP), with `extra` flags:
/// the same training bitwise (losses, gradient norms, the saved model and optimizer
/// state byte for byte: rank 0 gathers what the others keep), with rank 0 holding a
/// share of the optimizer state and master weights.
fn zero_1_is_ddp_sharded(name: &str, ranks: usize, extra: &[&str], weights_file: &str) {
    zero_is_ddp_sharded(name, ranks, 1, extra, weights_file)
}

/// [`zero_1_is_ddp_sharded`] at ZeRO stage `stage`: at stage 2 rank 0 also holds a share
/// of the gradients (one micro-batch a step: the buckets sum what DDP's sum, and the
/// global norm adds the ranks' squares in model order, so bitwise DDP still).
fn zero_is_ddp_sharded(name: &str, ranks: usize, stage: u8, extra: &[&str], weights_file: &str) {
    let (ddp, zero) = (
        scratch(&format!("{name}-ddp")),
        scratch(&format!("{name}-zero{stage}")),
    );
    let (ddp_report, zero_report) = (
        ddp.join("report.json").display().to_string(),
        zero.join("report.json").display().to_string(),
    );
    let run = |dir: &Path, zero: &str, report: &str| {
        let mut flags: Vec<&str> = vec!["--batch-size", "2", "--zero", zero];
        flags.extend(["--memory-report", report]);
        flags.extend(extra);
        train(Some(ranks), dir, &flags)
    };
    check(&run(&ddp, "0", &ddp_report), "DDP");
    let out = run(&zero, &stage.to_string(), &zero_report);
    check(&out, &format!("ZeRO-{stage}"));
    // Every rank's ledger is its prediction (the meta backend run as that rank).
    for dir in [&ddp, &zero] {
        ledgers_equal_predictions(dir, ranks);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("ZeRO-{stage}: each rank keeps")),
        "{stdout}"
    );
    let (a, b) = (steps(&ddp), steps(&zero));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "losses, gradient norms, tokens per step");
    for file in [
        weights_file,
        "trainer_state.safetensors",
        "trainer_state.json",
    ] {
        assert!(
            saved_file(&ddp, file) == saved_file(&zero, file),
            "{name}: {file} differs between DDP and ZeRO-{stage}"
        );
    }
    let sharded: &[&str] = match stage {
        1 => &["optimizer_state", "master_weights", "offloaded"],
        _ => &[
            "optimizer_state",
            "master_weights",
            "offloaded",
            "gradients",
        ],
    };
    for &category in sharded {
        let (whole, share) = (peak_of(&ddp, category), peak_of(&zero, category));
        // Ownership is by whole parameters: a share of the state near 1/ranks. Pure
        // bf16's master category is mostly the f32 copy one update makes at a time,
        // which no sharding shrinks: less, but not by the ranks.
        let near_share = category == "master_weights" || share * ranks as u64 <= whole * 3 / 2;
        assert!(
            whole == 0 && share == 0 || near_share && share < whole,
            "{name}: rank 0 keeps {share} bytes of {category} under ZeRO-{stage}, {whole} under DDP"
        );
        eprintln!(
            "{name}: rank 0's {category}: {whole} bytes under DDP, {share} under ZeRO-{stage}"
        );
    }
    let _ = std::fs::remove_dir_all(&ddp);
    let _ = std::fs::remove_dir_all(&zero);
}

#[test]
fn zero_1_is_bitwise_ddp_in_bf16() {
    if ready("zero_1_is_bitwise_ddp_in_bf16") {
        zero_1_is_ddp_sharded(
            "zero-bf16",
            2,
            &["--precision", "bf16"],
            "model.safetensors",
        );
    }
}

/// 8-bit AdamW's codes and scales, kept in host memory by the offloaded optimizer.
#[test]
fn zero_1_is_bitwise_ddp_with_8bit_adamw_offloaded() {
    if ready("zero_1_is_bitwise_ddp_with_8bit_adamw_offloaded") {
        zero_1_is_ddp_sharded(
            "zero-8bit",
            2,
            &["--optimizer", "adamw8bit", "--optimizer-offload"],
            "model.safetensors",
        );
    }
}

/// Pure bf16 with Kahan-compensated updates through a LoRA adapter, on three ranks
/// (oversubscribed): the compensations are sharded with the state.
#[test]
fn zero_1_is_bitwise_ddp_in_pure_bf16_with_lora_on_three_ranks() {
    if ready("zero_1_is_bitwise_ddp_in_pure_bf16_with_lora_on_three_ranks") {
        zero_1_is_ddp_sharded(
            "zero-pure-lora",
            3,
            &[
                "--precision",
                "bf16",
                "--master-weights",
                "none",
                "--update-rounding",
                "kahan",
                "--lora-rank",
                "4",
            ],
            "adapter_model.safetensors",
        );
    }
}

/// ZeRO-2 in bf16: each rank keeps its share of the gradients too, freed as backward
/// buckets them; bitwise DDP, each rank's ledger its prediction.
#[test]
fn zero_2_is_bitwise_ddp_in_bf16() {
    if ready("zero_2_is_bitwise_ddp_in_bf16") {
        zero_is_ddp_sharded(
            "zero2-bf16",
            2,
            2,
            &["--precision", "bf16"],
            "model.safetensors",
        );
    }
}

/// ZeRO-2 with 8-bit AdamW on the host thread, through a LoRA adapter.
#[test]
fn zero_2_is_bitwise_ddp_with_lora_8bit_adamw_offloaded() {
    if ready("zero_2_is_bitwise_ddp_with_lora_8bit_adamw_offloaded") {
        zero_is_ddp_sharded(
            "zero2-lora-8bit",
            2,
            2,
            &[
                "--optimizer",
                "adamw8bit",
                "--optimizer-offload",
                "--lora-rank",
                "4",
            ],
            "adapter_model.safetensors",
        );
    }
}

/// ZeRO-2 accumulating micro-batches: each micro-batch's gradients are summed across the
/// ranks as backward completes them (the owner adds each sum into its running one), so
/// 2 ranks accumulating 2 take the step of one process accumulating 4 to float32
/// rounding; each rank's ledger is its prediction, resumed runs are bitwise.
#[test]
fn zero_2_accumulates_summing_every_micro_batch_and_resumes_bitwise() {
    if !ready("zero_2_accumulates_summing_every_micro_batch_and_resumes_bitwise") {
        return;
    }
    let (one, many) = (scratch("zero2-accum-one"), scratch("zero2-accum-many"));
    check(
        &train(None, &one, &["--batch-size", "2", "--grad-accum", "4"]),
        "one process",
    );
    let report = many.join("report.json").display().to_string();
    let flags = [
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
        "--zero",
        "2",
        "--memory-report",
        &report,
    ];
    check(&train(Some(2), &many, &flags), "ZeRO-2");
    ledgers_equal_predictions(&many, 2);
    let (a, p) = (steps(&one), steps(&many));
    assert_eq!((a.len(), p.len()), (3, 3));
    assert_eq!(a[0].0, p[0].0, "step 1 loss");
    for (x, y) in a.iter().zip(&p) {
        assert_eq!((x.2, x.3), (y.2, y.3), "tokens");
        assert!((x.0 - y.0).abs() <= F32.loss * x.0.abs(), "{x:?} {y:?}");
        assert!(
            (x.1 - y.1).abs() <= F32.grad_norm * x.1.abs(),
            "{x:?} {y:?}"
        );
    }
    let mut worst = 0f64;
    for ((na, va), (np, vp)) in weights(&one).iter().zip(&weights(&many)) {
        assert_eq!(na, np);
        for (x, y) in va.iter().zip(vp) {
            worst = worst.max((x - y).abs() as f64);
        }
    }
    assert!(worst <= F32.weight, "weights differ by up to {worst:e}");
    for d in [one, many] {
        let _ = std::fs::remove_dir_all(d);
    }
    let first = resume_bitwise("zero2", &["--zero", "2", "--grad-accum", "2"]);
    let _ = std::fs::remove_dir_all(first);
    // Without buckets no gradient could be freed as backward completes it: refused.
    let unbucketed = scratch("zero2-unbucketed");
    let out = train(Some(2), &unbucketed, &["--zero", "2", "--bucket-size", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--bucket-size"),
        "{stderr}"
    );
    // Nor are ZeRO-2's micro-batch sums computed apart.
    let out = train(
        Some(2),
        &unbucketed,
        &["--zero", "2", "--separate-accumulation"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--separate-accumulation"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(unbucketed);
}

/// Gradients summed in buckets while backward runs (4 KiB buckets: dozens of them,
/// summed on the communication thread as backward completes their gradients) against one
/// sum per gradient after backward: the same sums, so bitwise the same training.
#[test]
fn buckets_during_backward_sum_what_one_all_reduce_per_gradient_sums() {
    if !ready("buckets_during_backward_sum_what_one_all_reduce_per_gradient_sums") {
        return;
    }
    let (after, during) = (scratch("buckets-after"), scratch("buckets-during"));
    let flags = |size: &'static str| {
        [
            "--batch-size",
            "2",
            "--precision",
            "bf16",
            "--bucket-size",
            size,
        ]
    };
    check(&train(Some(2), &after, &flags("0")), "after backward");
    check(&train(Some(2), &during, &flags("4KiB")), "in buckets");
    assert_eq!(steps(&after), steps(&during));
    for file in ["model.safetensors", "trainer_state.safetensors"] {
        assert!(
            saved_file(&after, file) == saved_file(&during, file),
            "{file} differs"
        );
    }
    for d in [after, during] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Each rank's ledger in `dir` (its `--memory-report` files) equals its prediction.
fn ledgers_equal_predictions(dir: &Path, ranks: usize) {
    for rank in 0..ranks {
        let name = match rank {
            0 => "report.json".to_string(),
            r => format!("report.rank{r}.json"),
        };
        let text = std::fs::read_to_string(dir.join(&name)).unwrap();
        let r: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(r["rank"].as_u64(), Some(rank as u64), "{name}");
        assert_eq!(r["measured"], r["predicted"], "{name}: {text}");
        assert_eq!(
            r["peak_total"]["measured"], r["peak_total"]["predicted"],
            "{name}: {text}"
        );
    }
}

/// The 3 steps of the runs in `a` and `b` have the same losses and tokens, bit for bit,
/// and gradient norms within 1e-5 relative (the update inside backward adds the
/// per-parameter squares in another order).
fn same_steps_norms_to_rounding(a: &Path, b: &Path, what: &str) {
    let (a, b) = (steps(a), steps(b));
    assert_eq!((a.len(), b.len()), (3, 3), "{what}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.0, x.2, x.3), (y.0, y.2, y.3), "{what}: loss, tokens");
        assert!((x.1 - y.1).abs() <= 1e-5 * x.1, "{what}: norm {x:?} {y:?}");
    }
}

/// The update inside backward on 2 ranks (each gradient summed in its bucket as backward
/// goes on, then updated by its owner and freed) against the same ranks updating after
/// backward, without clipping: the same losses and tokens, the saved model and optimizer
/// state byte for byte, the global norm to rounding (added per parameter), under DDP,
/// ZeRO-1 and ZeRO-2, and with the optimizer on the host; each rank's ledger is its
/// prediction, and the gradients held are a fraction of DDP's.
#[test]
fn the_update_inside_backward_on_ranks_is_the_update_after_it() {
    if !ready("the_update_inside_backward_on_ranks_is_the_update_after_it") {
        return;
    }
    let run = |name: &str, extra: &[&str]| {
        let dir = scratch(name);
        let report = dir.join("report.json").display().to_string();
        let mut flags = vec![
            "--batch-size",
            "2",
            "--precision",
            "bf16",
            "--grad-clip",
            "0",
        ];
        flags.extend(["--bucket-size", "4KiB", "--memory-report", &report]);
        flags.extend(extra);
        check(&train(Some(2), &dir, &flags), name);
        ledgers_equal_predictions(&dir, 2);
        dir
    };
    for offload in [false, true] {
        let host: &[&str] = if offload {
            &["--optimizer-offload"]
        } else {
            &[]
        };
        let after = run(&format!("after-{offload}"), host);
        let stages: &[&str] = if offload { &["2"] } else { &["0", "1", "2"] };
        for &zero in stages {
            let what = format!("ZeRO-{zero}, offloaded {offload}");
            let mut flags = vec!["--optimizer-in-backward", "--zero", zero];
            flags.extend(host);
            let inside = run(&format!("inside-{zero}-{offload}"), &flags);
            same_steps_norms_to_rounding(&after, &inside, &what);
            for file in ["model.safetensors", "trainer_state.safetensors"] {
                assert!(
                    saved_file(&after, file) == saved_file(&inside, file),
                    "{what}: {file} differs"
                );
            }
            let (whole, held) = (peak_of(&after, "gradients"), peak_of(&inside, "gradients"));
            assert!(
                held * 2 < whole,
                "{what}: {held} bytes of gradients, {whole} after"
            );
            eprintln!(
                "{what}: inside backward bitwise after it; gradients {held} of {whole} bytes"
            );
            let _ = std::fs::remove_dir_all(inside);
        }
        let _ = std::fs::remove_dir_all(after);
    }
}

/// QLoRA (an NF4 base, a bf16 adapter) on 2 ranks under ZeRO-2, updating inside
/// backward: bitwise one process accumulating the two micro-batches apart (the adapter
/// and every step's loss and tokens; the norm to rounding), each rank's ledger its
/// prediction.
#[test]
fn two_ranks_of_qlora_under_zero_2_updating_inside_backward() {
    if !ready("two_ranks_of_qlora_under_zero_2_updating_inside_backward") {
        return;
    }
    let (one, many) = (scratch("qlora-one"), scratch("qlora-many"));
    let common = [
        "--lora-rank",
        "4",
        "--qlora",
        "--precision",
        "bf16",
        "--grad-clip",
        "0",
        "--batch-size",
        "2",
    ];
    let mut single = common.to_vec();
    single.extend(["--grad-accum", "2", "--separate-accumulation"]);
    check(&train(None, &one, &single), "one process");
    let report = many.join("report.json").display().to_string();
    let mut ranks = common.to_vec();
    ranks.extend(["--zero", "2", "--optimizer-in-backward"]);
    ranks.extend(["--memory-report", &report]);
    check(&train(Some(2), &many, &ranks), "2 ranks");
    ledgers_equal_predictions(&many, 2);
    same_steps_norms_to_rounding(&one, &many, "QLoRA");
    weights_bitwise(&one, &many);
    for d in [one, many] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A ZeRO-1 run saved after 3 steps and resumed by the same ranks to 5 takes the steps
/// of the run that went to 5 at once, bitwise: each rank loads the state it owns.
#[test]
fn zero_1_resumes_bitwise() {
    if ready("zero_1_resumes_bitwise") {
        let first = resume_bitwise("zero1", &["--zero", "1", "--precision", "bf16"]);
        let _ = std::fs::remove_dir_all(first);
    }
}

/// Runs of 2 ranks with `extra` flags: one of 5 steps, one of 3 resumed to 5; returns
/// the directory of the resumed run's first part. Both must agree bitwise.
fn resume_bitwise(name: &str, extra: &[&str]) -> PathBuf {
    let (first, straight) = resume_bitwise_keeping(name, extra);
    let _ = std::fs::remove_dir_all(straight);
    first
}

/// [`resume_bitwise`], returning the directories of the resumed run's first part and of
/// the run of 5 steps at once.
fn resume_bitwise_keeping(name: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    let (straight, first, resumed) = (
        scratch(&format!("{name}-straight")),
        scratch(&format!("{name}-first")),
        scratch(&format!("{name}-resumed")),
    );
    let mut constant = vec!["--lr-schedule", "constant"];
    constant.extend(extra);
    check(&train_steps(Some(2), &straight, 5, &constant), "5 steps");
    check(&train_steps(Some(2), &first, 3, &constant), "3 steps");
    let saved = first.join("model").display().to_string();
    let mut resume = constant.clone();
    resume.extend(["--resume", &saved]);
    check(&train_steps(Some(2), &resumed, 5, &resume), "resumed to 5");
    weights_bitwise(&straight, &resumed);
    let (a, b) = (steps(&straight), steps(&resumed));
    assert_eq!(a[3..], b[..], "steps 4 and 5");
    let _ = std::fs::remove_dir_all(resumed);
    (first, straight)
}

/// A data-parallel run saved after 3 steps and resumed by the same ranks to 5 takes the
/// steps of the run that went to 5 at once, bitwise (a constant learning rate, so that
/// the schedule does not depend on the run's length). Another number of ranks reshards:
/// a ZeRO-1 checkpoint of 2 ranks resumed by one process accumulating their 2
/// micro-batches apart goes on bitwise as the 2 ranks did, and 3 ranks take it too, each
/// loading the state of what it updates now.
#[test]
fn ranks_resume_bitwise_and_reshard() {
    if !ready("ranks_resume_bitwise_and_reshard") {
        return;
    }
    let first = resume_bitwise("ddp", &[]);
    let _ = std::fs::remove_dir_all(first);
    let (first, straight) = resume_bitwise_keeping("reshard", &["--zero", "1"]);
    let saved = first.join("model").display().to_string();
    let one = scratch("reshard-one");
    let resume = [
        "--lr-schedule",
        "constant",
        "--resume",
        &saved,
        "--grad-accum",
        "2",
        "--separate-accumulation",
    ];
    let out = train_steps(None, &one, 5, &resume);
    check(&out, "one process resuming 2 ranks' checkpoint");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("resharded: saved by 2 ranks, resumed by one process"),
        "{stdout}"
    );
    assert_eq!(steps(&straight)[3..], steps(&one)[..], "steps 4 and 5");
    weights_bitwise(&straight, &one);
    let three = scratch("reshard-three");
    let resume = [
        "--lr-schedule",
        "constant",
        "--resume",
        &saved,
        "--zero",
        "1",
    ];
    let out = train_steps(Some(3), &three, 5, &resume);
    check(&out, "3 ranks resuming 2 ranks' checkpoint");
    assert_eq!(steps(&three).len(), 2, "steps 4 and 5");
    assert!(first.join("model").join("model.safetensors").exists());
    for d in [first, straight, one, three] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Ranks given different models are refused on every rank, and the job ends with an
/// error naming the rank instead of hanging in a collective.
#[test]
fn ranks_that_disagree_end_the_job_with_an_error() {
    if !ready("ranks_that_disagree_end_the_job_with_an_error") {
        return;
    }
    let dir = scratch("disagree");
    let bin = env!("CARGO_BIN_EXE_trainkit");
    let mut c = Command::new("mpirun");
    c.args(["-np", "1", bin, "train", "--steps", "2", "--n-layer", "2"])
        .args([
            ":",
            "-np",
            "1",
            bin,
            "train",
            "--steps",
            "2",
            "--n-layer",
            "3",
        ])
        .current_dir(&dir);
    let out = run_bounded(c, Duration::from_secs(120));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("error on rank") && stderr.contains("same model"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts 2 ranks training for many steps in `dir` with `extra` flags, and returns the
/// launcher once rank 0 has logged a step.
fn start_long_run(dir: &Path, extra: &[&str]) -> std::process::Child {
    let mut c = train_command(Some(2), dir, 100_000, extra);
    let child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = dir.join("log.jsonl");
    let start = Instant::now();
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() >= 2) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no step logged in {:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    child
}

/// Ctrl-C under mpirun (the launcher passes it to every rank) stops the ranks after the
/// same step; rank 0 saves, gathering the ZeRO-1 shards, and the checkpoint resumes.
#[test]
fn an_interrupt_under_mpirun_saves_a_checkpoint_that_resumes() {
    if !ready("an_interrupt_under_mpirun_saves_a_checkpoint_that_resumes") {
        return;
    }
    let (dir, again) = (scratch("interrupt"), scratch("interrupt-resumed"));
    let flags = ["--zero", "1", "--precision", "bf16"];
    let child = start_long_run(&dir, &flags);
    let launcher = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &launcher])
        .status()
        .unwrap()
        .success());
    let out = wait_bounded(child, Duration::from_secs(120));
    check(&out, "interrupted");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let step: u64 = stdout
        .split("interrupted after step ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no interrupt line:\n{stdout}"));
    let state = String::from_utf8(saved_file(&dir, "trainer_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["step"].as_u64(), Some(step), "the saved step");
    assert_eq!(state["ranks"].as_u64(), Some(2));
    let saved = dir.join("model").display().to_string();
    let mut resume = flags.to_vec();
    resume.extend(["--resume", &saved]);
    check(
        &train_steps(Some(2), &again, step + 1, &resume),
        "resumed for one step",
    );
    assert_eq!(steps(&again).len(), 1, "one step after the checkpoint's");
    for d in [dir, again] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A rank killed outright (no error, no abort of its own) ends the whole job within a
/// bounded time: the launcher ends the others instead of leaving them in a collective.
#[test]
fn a_killed_rank_ends_the_job() {
    if !ready("a_killed_rank_ends_the_job") {
        return;
    }
    let dir = scratch("killed");
    let child = start_long_run(&dir, &[]);
    // The ranks: trainkit processes whose arguments name this run's directory.
    let bin = env!("CARGO_BIN_EXE_trainkit");
    let here = dir.display().to_string();
    let ranks: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let pid = e.ok()?.file_name().into_string().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (args.first().is_some_and(|a| a == bin) && args.iter().any(|a| a.contains(&here)))
                .then_some(pid)
        })
        .collect();
    assert_eq!(ranks.len(), 2, "the two ranks: {ranks:?}");
    assert!(Command::new("kill")
        .args(["-KILL", &ranks[1]])
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let out = wait_bounded(child, Duration::from_secs(60));
    assert!(!out.status.success(), "the job went on without a rank");
    eprintln!(
        "a killed rank ended the job in {:?}: {}",
        start.elapsed(),
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    let _ = std::fs::remove_dir_all(dir);
}
