//! The timeline observer and what feeds it: per-label bytes, op spans with their flops,
//! and the four outputs (SVG, PyTorch memory-viewer pickle, JSON lines, Chrome trace).

use crate::common;

use common::{corpus_loader, cpu, scratch, tiny_config, trainkit, TINY_TRAIN};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use trainkit::memory::{LedgerSnapshot, StepPeak, TimelineAxis, TIMELINE_FILES};
use trainkit::{
    AdamW, Backend, CpuBackend, DType, Gpt2, MemoryCategory, MemoryEvent, MemoryObserver, Phase,
    Timeline, Trainer,
};

/// Trains the tiny model for `steps` steps with `observer`; returns the trainer.
fn train<M: MemoryObserver>(
    observer: M,
    steps: u64,
) -> Trainer<trainkit::Fp32, trainkit::NoRecompute, AdamW, trainkit::Constant, M> {
    let model = Gpt2::new(tiny_config()).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(20_000, 1, 4, 32))
        .observer(observer)
        .build()
        .unwrap();
    for _ in 0..steps {
        t.step().unwrap();
    }
    t
}

#[test]
fn matmul_flops_are_two_per_multiply_add() {
    let be = CpuBackend::new();
    let ledger = be.ledger().clone();
    let f32s = |n: usize| vec![0.5f32; n];
    let a = be
        .upload(
            &f32s(4 * 8),
            &[4, 8],
            DType::F32,
            MemoryCategory::Activations,
            "a",
        )
        .unwrap();
    let b = be
        .upload(
            &f32s(8 * 5),
            &[8, 5],
            DType::F32,
            MemoryCategory::Weights,
            "b",
        )
        .unwrap();
    let bias = be
        .upload(&f32s(5), &[5], DType::F32, MemoryCategory::Weights, "bias")
        .unwrap();
    let mut out = be
        .zeros(&[4, 5], DType::F32, MemoryCategory::Activations, "out")
        .unwrap();
    assert_eq!(
        ledger.flops(),
        0,
        "uploads and allocations execute no flops"
    );
    ledger.set_recording(true);
    be.matmul(&mut out, &a, &b, None, false, false, false)
        .unwrap();
    assert_eq!(ledger.flops(), 2 * 4 * 5 * 8);
    // A bias adds one per output element; the transposed form counts the same.
    let bt = be
        .upload(
            &f32s(5 * 8),
            &[5, 8],
            DType::F32,
            MemoryCategory::Weights,
            "bt",
        )
        .unwrap();
    be.matmul(&mut out, &a, &bt, Some(&bias), false, true, true)
        .unwrap();
    assert_eq!(ledger.flops(), 2 * (2 * 4 * 5 * 8) + 4 * 5);
    // A refused op executed nothing and records nothing.
    assert!(be
        .matmul(&mut out, &a, &a, None, false, false, false)
        .is_err());
    assert_eq!(ledger.flops(), 2 * (2 * 4 * 5 * 8) + 4 * 5);
    let ops: Vec<(String, String, u64)> = ledger
        .drain_events()
        .into_iter()
        .filter_map(|e| match e {
            MemoryEvent::Op {
                name, label, flops, ..
            } => Some((name.into_owned(), label, flops)),
            _ => None,
        })
        .collect();
    assert_eq!(
        ops,
        [
            ("matmul".to_string(), "out".to_string(), 320),
            ("upload".to_string(), "bt".to_string(), 0),
            ("matmul".to_string(), "out".to_string(), 340),
        ]
    );
    assert_eq!(ledger.snapshot().flops, 660);
    ledger.reset_peaks();
    assert_eq!(ledger.flops(), 0);
}

#[test]
fn ledger_counts_bytes_per_label() {
    let be = CpuBackend::new();
    let ledger = be.ledger();
    let act = |label: &str, n: usize| {
        be.zeros(&[n], DType::F32, MemoryCategory::Activations, label)
            .unwrap()
    };
    let w = be
        .zeros(&[10], DType::F32, MemoryCategory::Weights, "wte")
        .unwrap();
    let q1 = act("h.0.qkv", 6);
    let q2 = act("h.0.qkv", 4);
    let big = act("h.0.attn_probs", 100);
    drop(q1);
    drop(big);
    let labels = ledger.labels();
    let row = |l: &str| labels.iter().find(|b| b.label == l).unwrap().clone();
    assert_eq!((row("h.0.qkv").live, row("h.0.qkv").peak), (16, 40));
    assert_eq!(row("h.0.attn_probs").live, 0);
    assert_eq!(row("h.0.attn_probs").peak, 400);
    assert_eq!(row("wte").category, MemoryCategory::Weights);
    // Weights first, then activations by peak.
    let order: Vec<&str> = labels.iter().map(|b| b.label.as_str()).collect();
    assert_eq!(order, ["wte", "h.0.attn_probs", "h.0.qkv"]);
    // A new window: peaks become what is live, labels with nothing live are forgotten.
    ledger.reset_peaks();
    let labels = ledger.labels();
    let order: Vec<(&str, u64, u64)> = labels
        .iter()
        .map(|b| (b.label.as_str(), b.live, b.peak))
        .collect();
    assert_eq!(order, [("wte", 40, 40), ("h.0.qkv", 16, 16)]);
    drop((w, q2));
}

#[test]
fn a_training_run_is_recorded_and_written_in_four_formats() {
    let dir = scratch("timeline");
    let t = train(Timeline::in_dir(&dir, 3).unwrap(), 3);
    let timeline = t.observer();
    assert!(timeline.is_complete());
    assert_eq!(timeline.steps_recorded(), 3);
    let snap = t.backend().ledger().snapshot();
    for f in TIMELINE_FILES {
        assert!(dir.join(f).is_file(), "{f} was not written");
    }
    let events = timeline.events();

    // Per-label bytes agree with the category totals.
    let labels = t.backend().ledger().labels();
    for c in MemoryCategory::ALL {
        let live: u64 = labels
            .iter()
            .filter(|b| b.category == c)
            .map(|b| b.live)
            .sum();
        assert_eq!(live, snap.live.get(c), "{c}");
    }
    assert!(labels.iter().any(|b| b.label == "h.0.qkv" && b.peak > 0));

    check_lazy_optimizer_state(timeline);
    check_svg(&std::fs::read_to_string(dir.join("memory.svg")).unwrap());
    check_json_lines(&dir.join("memory.jsonl"), events, &snap);
    check_memory_viz(
        &std::fs::read(dir.join("memory_viz.pickle")).unwrap(),
        &snap,
    );
    check_chrome_trace(&dir.join("trace.json"), events, &snap);

    // The time axis renders too.
    let svg = timeline
        .clone()
        .with_x_axis(TimelineAxis::Time)
        .render_svg()
        .unwrap();
    assert!(svg.contains("time (ms)"));
}

/// Step 1 allocates the Adam moments in its optimizer phase; from step 2 on they are live
/// throughout, so step 2 peaks higher.
fn check_lazy_optimizer_state(timeline: &Timeline) {
    let mut live = [0u64; 6];
    let mut step = 1;
    let mut phase = None;
    let mut state_allocs = HashMap::new();
    for e in timeline.events() {
        match e {
            MemoryEvent::Alloc {
                category, bytes, ..
            } => {
                live[category.index()] += bytes;
                if *category == MemoryCategory::OptimizerState {
                    *state_allocs.entry((step, phase)).or_insert(0) += bytes;
                }
            }
            MemoryEvent::Free {
                category, bytes, ..
            } => live[category.index()] -= bytes,
            MemoryEvent::PhaseBegin { phase: p, .. } => phase = Some(*p),
            MemoryEvent::StepEnd { .. } => step += 1,
            _ => {}
        }
    }
    let state = live[MemoryCategory::OptimizerState.index()];
    assert!(state > 0);
    assert_eq!(
        state_allocs,
        HashMap::from([((1, Some(Phase::Optimizer)), state)]),
        "optimizer state is allocated once, in step 1's optimizer phase"
    );

    let peaks = timeline.step_peaks();
    assert_eq!(peaks.len(), 3);
    let (p1, p2, p3) = (peaks[0], peaks[1], peaks[2]);
    assert_eq!((p1.step, p2.step, p3.step), (1, 2, 3));
    // Both peak in the loss phase, where the logits join the stashed activations; step 2
    // also holds the moments (and every gradient, which step 1 creates as its first
    // backward reaches each parameter).
    assert_eq!((p1.phase, p2.phase), (Some(Phase::Loss), Some(Phase::Loss)));
    assert_eq!(p1.at_peak.get(MemoryCategory::OptimizerState), 0);
    assert_eq!(p2.at_peak.get(MemoryCategory::OptimizerState), state);
    for c in [MemoryCategory::Weights, MemoryCategory::Activations] {
        assert_eq!(p1.at_peak.get(c), p2.at_peak.get(c), "{c}");
    }
    let grads = |p: &StepPeak| p.at_peak.get(MemoryCategory::Gradients);
    assert_eq!(
        p2.peak_total,
        p1.peak_total + state + grads(&p2) - grads(&p1)
    );
    assert_eq!(
        p3,
        StepPeak { step: 3, ..p2 },
        "steps after the first are alike"
    );
}

fn check_svg(svg: &str) {
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    // The texts of the plot.
    let texts: Vec<&str> = svg
        .split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
        .collect();
    for c in MemoryCategory::ALL {
        assert!(texts.contains(&c.name()), "no {c} in the legend: {texts:?}");
    }
    for mark in [
        "forward",
        "loss",
        "backward",
        "optimizer",
        "step 1",
        "step 3",
    ] {
        assert!(texts.contains(&mark), "no `{mark}` in the SVG: {texts:?}");
    }
    assert!(svg.contains("<polygon"), "no stacked areas");
}

fn check_json_lines(path: &Path, events: &[MemoryEvent], snap: &LedgerSnapshot) {
    let text = std::fs::read_to_string(path).unwrap();
    let parsed: Vec<MemoryEvent> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed, events);
    let mut live = [0i64; MemoryCategory::ALL.len()];
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        let sign = match v["event"].as_str().unwrap() {
            "alloc" => 1,
            "free" => -1,
            _ => continue,
        };
        let c: MemoryCategory = serde_json::from_value(v["category"].clone()).unwrap();
        live[c.index()] += sign * v["bytes"].as_i64().unwrap();
    }
    for c in MemoryCategory::ALL {
        assert_eq!(live[c.index()] as u64, snap.live.get(c), "{c}");
    }
}

fn check_memory_viz(bytes: &[u8], snap: &LedgerSnapshot) {
    let v = unpickle(bytes);
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["device_traces", "segments"]);
    let traces = v["device_traces"].as_array().unwrap();
    assert_eq!(traces.len(), 1, "one device");
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut requested: HashMap<u64, u64> = HashMap::new();
    let mut allocs = 0;
    for e in traces[0].as_array().unwrap() {
        for k in ["action", "addr", "size", "stream", "time_us", "frames"] {
            assert!(e.get(k).is_some(), "trace entry without {k}: {e}");
        }
        let (addr, size) = (e["addr"].as_u64().unwrap(), e["size"].as_u64().unwrap());
        match e["action"].as_str().unwrap() {
            "alloc" => {
                allocs += 1;
                let name = e["frames"][0]["name"].as_str().unwrap();
                assert!(name.ends_with(')'), "frame name {name}");
                assert!(
                    live.insert(addr, size).is_none(),
                    "address {addr:#x} given twice"
                );
            }
            "free_requested" => {
                assert_eq!(live.get(&addr), Some(&size), "free of unknown {addr:#x}");
                requested.insert(addr, size);
            }
            "free_completed" => {
                assert_eq!(requested.remove(&addr), Some(size));
                assert_eq!(live.remove(&addr), Some(size));
            }
            other => panic!("unexpected action {other}"),
        }
        // Live buffers never overlap (addresses are 512-aligned and sizes exact).
        assert_eq!(addr % 512, 0);
    }
    assert!(allocs > 100);
    assert!(requested.is_empty());
    assert_eq!(live.values().sum::<u64>(), snap.live.total());
    assert!(traces[0]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["frames"][0]["name"] == "h.0.qkv (activations)"));

    let segments = v["segments"].as_array().unwrap();
    assert_eq!(segments.len(), 1);
    let seg = &segments[0];
    let mut at = seg["address"].as_u64().unwrap();
    let mut active = 0;
    for b in seg["blocks"].as_array().unwrap() {
        assert_eq!(
            b["address"].as_u64().unwrap(),
            at,
            "blocks tile the segment"
        );
        let size = b["size"].as_u64().unwrap();
        if b["state"] == "active_allocated" {
            assert_eq!(live.get(&at), Some(&size), "block {at:#x} is not live");
            active += size;
        } else {
            assert_eq!(b["state"], "inactive");
        }
        at += size;
    }
    assert_eq!(
        at - seg["address"].as_u64().unwrap(),
        seg["total_size"].as_u64().unwrap()
    );
    assert_eq!(active, snap.live.total());
    assert_eq!(seg["allocated_size"].as_u64().unwrap(), active);
    assert_eq!(seg["segment_pool_id"], serde_json::json!([0, 0]));
    assert_eq!(seg["is_expandable"], false);
}

fn check_chrome_trace(path: &Path, events: &[MemoryEvent], snap: &LedgerSnapshot) {
    let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let trace = v["traceEvents"].as_array().unwrap();
    let of = |ph: &str, cat: &str| -> Vec<&Value> {
        trace
            .iter()
            .filter(|e| e["ph"] == ph && (cat.is_empty() || e["cat"] == cat))
            .collect()
    };
    let phases = of("X", "phase");
    let begins = events
        .iter()
        .filter(|e| matches!(e, MemoryEvent::PhaseBegin { .. }))
        .count();
    assert_eq!(phases.len(), begins);
    assert!(phases.iter().any(|e| e["name"] == "forward 2"));
    assert!(phases.iter().any(|e| e["name"] == "optimizer"));
    let ops = of("X", "op");
    assert!(ops.len() > 100);
    for e in phases.iter().chain(&ops) {
        assert!(e["dur"].is_u64() && e["ts"].is_u64(), "{e}");
    }
    let steps = of("X", "step");
    assert_eq!(steps.len(), 3);
    assert_eq!(of("i", "step").len(), 3);
    // The ledger counts the flops of the last step; its ops sum to them.
    let step_flops = |n: u64| -> u64 {
        ops.iter()
            .filter(|e| e["args"]["step"] == n)
            .map(|e| e["args"]["flops"].as_u64().unwrap())
            .sum()
    };
    assert!(snap.flops > 0);
    assert_eq!(step_flops(3), snap.flops);
    assert_eq!(
        step_flops(2),
        snap.flops,
        "steps of one shape execute the same flops"
    );
    assert!(ops
        .iter()
        .any(|e| e["name"] == "matmul" && e["args"]["label"] == "h.0.qkv"));
    // Memory counters end at what is live.
    let counters = of("C", "");
    let last = counters.last().unwrap();
    for c in MemoryCategory::ALL {
        assert_eq!(last["args"][c.name()].as_u64().unwrap(), snap.live.get(c));
    }
}

#[test]
fn a_config_file_sets_up_a_timeline() {
    let dir = scratch("timeline-config");
    let svg = dir.join("m.svg");
    let jsonl = dir.join("sub").join("events.jsonl");
    let text = format!(
        "[observer]\nkind = \"timeline\"\nsteps = 2\nx_axis = \"time\"\nsvg = {:?}\njson_lines = {:?}\n",
        svg.to_str().unwrap(),
        jsonl.to_str().unwrap()
    );
    let cfg = trainkit::config::RunConfig::from_toml(&text).unwrap();
    let again = trainkit::config::RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert_eq!(again.to_toml().unwrap(), cfg.to_toml().unwrap());
    assert!(cfg.to_toml().unwrap().contains("kind = \"timeline\""));

    let t = train(cfg.observer.clone(), 1);
    assert!(!svg.exists(), "written before its steps were complete");
    drop(t);
    let _t = train(cfg.observer, 2);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("time (ms)"));
    assert!(std::fs::read_to_string(&jsonl).unwrap().lines().count() > 100);
    assert!(!dir.join("memory_viz.pickle").exists());

    for (bad, needle) in [
        ("steps = 0", "at least one step"),
        ("stepz = 2", "stepz"),
        ("x_axis = \"seconds\"", "seconds"),
    ] {
        let text = format!("[observer]\nkind = \"timeline\"\n{bad}\n");
        let err = trainkit::config::RunConfig::from_toml(&text)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{bad}: {err}");
    }
    assert!(Timeline::new(0).is_err());
}

#[test]
fn train_timeline_flag_writes_the_files() {
    let dir = scratch("timeline-cli");
    let out = dir.join("timeline");
    let mut args: Vec<&str> = TINY_TRAIN.to_vec();
    let out_str = out.to_str().unwrap();
    // Fewer steps than --timeline-steps: the timeline records the steps that run.
    args.extend([
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--timeline",
        out_str,
        "--timeline-steps",
        "5",
    ]);
    let (ok, stdout, stderr) = trainkit(&args);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("memory timeline"), "{stdout}");
    for f in TIMELINE_FILES {
        let len = std::fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 0, "{f} missing or empty");
    }
    let (_, help, _) = trainkit(&["train", "--help"]);
    assert!(help.contains("--timeline") && help.contains("--timeline-steps"));

    let mut bad = TINY_TRAIN.to_vec();
    bad.extend([
        "--steps",
        "1",
        "--timeline",
        out_str,
        "--timeline-steps",
        "0",
    ]);
    let (ok, _, err) = trainkit(&bad);
    assert!(!ok);
    assert!(
        err.contains("--timeline-steps") && !err.contains("panicked"),
        "{err}"
    );
}

/// Reads the pickle opcodes a memory snapshot uses into JSON (tuples become arrays).
fn unpickle(bytes: &[u8]) -> Value {
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    let mut i = 0;
    let take = |i: &mut usize, n: usize| -> &[u8] {
        let s = &bytes[*i..*i + n];
        *i += n;
        s
    };
    let u32_at = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
    loop {
        let op = take(&mut i, 1)[0];
        match op {
            0x80 => assert_eq!(take(&mut i, 1)[0], 2, "protocol 2"),
            b'.' => return stack.pop().unwrap(),
            b'N' => stack.push(Value::Null),
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'K' => stack.push(take(&mut i, 1)[0].into()),
            b'M' => stack.push(u16::from_le_bytes(take(&mut i, 2).try_into().unwrap()).into()),
            b'J' => stack.push(i32::from_le_bytes(take(&mut i, 4).try_into().unwrap()).into()),
            0x8a => {
                let n = take(&mut i, 1)[0] as usize;
                let b = take(&mut i, n);
                let mut full = [if b.last().is_some_and(|x| x & 0x80 != 0) {
                    0xff
                } else {
                    0
                }; 8];
                full[..n].copy_from_slice(b);
                stack.push(i64::from_le_bytes(full).into());
            }
            b'X' => {
                let n = u32_at(take(&mut i, 4)) as usize;
                stack.push(String::from_utf8(take(&mut i, n).to_vec()).unwrap().into());
            }
            b']' => stack.push(Value::Array(vec![])),
            b'}' => stack.push(Value::Object(Default::default())),
            b')' => stack.push(Value::Array(vec![])),
            b'(' => marks.push(stack.len()),
            b'e' => {
                let items = stack.split_off(marks.pop().unwrap());
                stack
                    .last_mut()
                    .unwrap()
                    .as_array_mut()
                    .unwrap()
                    .extend(items);
            }
            b'u' => {
                let items = stack.split_off(marks.pop().unwrap());
                let dict = stack.last_mut().unwrap().as_object_mut().unwrap();
                for kv in items.chunks(2) {
                    dict.insert(kv[0].as_str().unwrap().to_string(), kv[1].clone());
                }
            }
            b't' => {
                let items = stack.split_off(marks.pop().unwrap());
                stack.push(Value::Array(items));
            }
            b'q' => {
                let k = take(&mut i, 1)[0] as u32;
                memo.insert(k, stack.last().unwrap().clone());
            }
            b'r' => {
                let k = u32_at(take(&mut i, 4));
                memo.insert(k, stack.last().unwrap().clone());
            }
            b'h' => {
                let k = take(&mut i, 1)[0] as u32;
                stack.push(memo[&k].clone());
            }
            b'j' => {
                let k = u32_at(take(&mut i, 4));
                stack.push(memo[&k].clone());
            }
            other => panic!("unexpected pickle opcode {other:#x} at {}", i - 1),
        }
    }
}
