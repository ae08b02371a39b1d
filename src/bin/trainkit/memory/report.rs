//! `trainkit memory`'s output: the table of the figures, or one JSON object.

use super::units::{gb, gib, group, signed_gib};
use super::{subject::Subject, MemoryArgs};
use trainkit::estimate::{ActivationShape, FitCandidate, MemoryPrediction, TechniqueSavings};
use trainkit::memory::{CategoryBytes, MemoryCategory};

/// What `trainkit memory` found, for the table or the JSON object.
pub struct Figures<'a> {
    /// The data-parallel job the figures are one rank of.
    pub ranks: super::Ranks,
    /// What each rank sends per step.
    pub sent: super::Sent,
    /// The flags.
    pub args: &'a MemoryArgs,
    /// The model.
    pub subject: &'a Subject,
    /// Tokens per sequence.
    pub seq_len: u64,
    /// The precision policy.
    pub precision: &'a dyn trainkit::Precision,
    /// Its description.
    pub precision_name: String,
    /// The optimizer.
    pub optimizer: &'a dyn trainkit::Optimizer,
    /// The optimizer's kind.
    pub optimizer_name: &'static str,
    /// The recompute policy's kind.
    pub recompute_name: &'static str,
    /// The playbook's model state by category.
    pub state: CategoryBytes,
    /// Their sum.
    pub state_total: u64,
    /// The activation shape, when the dimensions are known.
    pub shape: Option<ActivationShape>,
    /// The playbook's activations under each recompute policy.
    pub by_policy: Option<Vec<(&'static str, u64)>>,
    /// The playbook's activations under the chosen policy.
    pub activations: Option<u64>,
    /// Model state and activations.
    pub total: Option<u64>,
    /// The playbook's parameter count.
    pub playbook: Option<u64>,
    /// trainkit's exact figures.
    pub exact: Option<MemoryPrediction>,
    /// The exact figures without offloaded activations.
    pub kept: Option<MemoryPrediction>,
    /// The LoRA, its trainable parameters and all parameters.
    pub adapted: Option<(&'a trainkit::Lora, (u64, u64))>,
    /// What each technique saves.
    pub savings: Option<TechniqueSavings>,
    /// The optimizer inside backward.
    pub in_backward: bool,
    /// Activations offloaded.
    pub offload_activations: bool,
    /// The optimizer offloaded.
    pub optimizer_offload: bool,
}

/// The figures as one JSON object on stdout.
pub fn json(f: &Figures) {
    let (args, subject, seq_len, precision) = (f.args, f.subject, f.seq_len, f.precision);
    let (optimizer_name, recompute_name) = (f.optimizer_name, f.recompute_name);
    let (state, state_total) = (&f.state, f.state_total);
    let (by_policy, activations, total, playbook) =
        (&f.by_policy, f.activations, f.total, f.playbook);
    let (exact, kept, adapted, savings) = (&f.exact, &f.kept, f.adapted, &f.savings);
    let (in_backward, offload_activations, optimizer_offload) =
        (f.in_backward, f.offload_activations, f.optimizer_offload);
    let exact_json = exact.as_ref().map(|p| {
        let mut bytes = serde_json::Map::new();
        for c in MemoryCategory::ALL {
            bytes.insert(c.name().into(), p.peak.get(c).into());
        }
        serde_json::json!({
            "bytes": bytes,
            "model_state_bytes": p.model_state_bytes(),
            "activation_bytes": p.peak.get(MemoryCategory::Activations),
            "peak_total_bytes": p.peak_total,
            "optimizer_in_backward": in_backward,
            "offload_activations": offload_activations,
            "optimizer_offload": optimizer_offload,
            "offloaded_bytes": p.peak.get(MemoryCategory::Offloaded),
            "stream_weights": p.peak.get(MemoryCategory::Streamed) > 0,
            "streamed_bytes": p.peak.get(MemoryCategory::Streamed),
            "streamed_bytes_per_step": p.streamed_bytes_per_step,
            "flops_per_step": p.flops_per_step,
            "host_bytes": p.host_bytes(),
            "peak_total_bytes_without_offload": kept.as_ref().map(|k| k.peak_total),
            "activation_peak_phase": p.activations.peak_phase.map(|x| x.to_string()),
        })
    });
    let mut bytes = serde_json::Map::new();
    for c in STATE {
        bytes.insert(c.name().into(), state.get(c).into());
    }
    bytes.insert("activations".into(), activations.into());
    let by_policy = by_policy.as_ref().map(|v| {
        v.iter()
            .map(|(r, b)| (r.to_string(), serde_json::Value::from(*b)))
            .collect::<serde_json::Map<_, _>>()
    });
    let a = subject.shape;
    // The formulas count full training: a LoRA run has its exact figures alone.
    let full = |v: serde_json::Value| {
        if adapted.is_some() {
            serde_json::Value::Null
        } else {
            v
        }
    };
    let adapter_json = adapted.map(|(l, (trained, all))| {
        serde_json::json!({
            "kind": if args.lora.qlora { "qlora" } else { "lora" },
            "rank": l.rank,
            "alpha": l.alpha,
            "targets": l.targets,
            "trainable_params": trained,
            "params": all,
        })
    });
    let data_parallel = serde_json::json!({
        "world": f.ranks.world,
        "zero_stage": f.ranks.zero,
        "rank": f.ranks.shown,
        "bytes_sent_per_step": {
            "gradients": f.sent.gradients,
            "weights": f.sent.weights,
        },
    });
    let out = serde_json::json!({
        "model": subject.name,
        "data_parallel": data_parallel,
        "params": subject.params,
        "params_playbook": playbook,
        "adapter": adapter_json,
        "bytes": full(bytes.into()),
        "model_state_bytes": full(state_total.into()),
        "activation_bytes": full(activations.into()),
        "activation_bytes_by_recompute": full(by_policy.into()),
        "total_bytes": full(total.into()),
        "trainkit_exact": exact_json,
        "techniques": savings.as_ref().map(savings_json),
        "inputs": {
            "model": subject.name,
            "params": args.params,
            "layers": a.map(|a| a.layers),
            "hidden": a.map(|a| a.hidden),
            "heads": a.map(|a| a.heads),
            "kv_heads": a.map(|a| a.kv_heads),
            "ffn": a.map(|a| a.ffn),
            "vocab": a.map(|a| a.vocab),
            "seq_len": a.map(|_| seq_len),
            "batch_size": args.batch_size,
            "precision": args.policy.precision.as_deref().unwrap_or("bf16"),
            "fp32_grads": args.fp32_grads,
            "master_weights": if precision.master_weights() || precision.compute_dtype() == trainkit::DType::F32 { "f32" } else { "none" },
            "update_rounding": precision.update_rounding().map(|r| r.name()),
            "recompute": recompute_name,
            "optimizer": optimizer_name,
        },
    });
    println!("{out}");
}

/// The figures as a table on stdout.
pub fn table(f: &Figures) {
    let (args, subject, seq_len, precision, optimizer) =
        (f.args, f.subject, f.seq_len, f.precision, f.optimizer);
    let (precision_name, optimizer_name, recompute_name) =
        (&f.precision_name, f.optimizer_name, f.recompute_name);
    let (state, state_total, shape) = (&f.state, f.state_total, f.shape);
    let (by_policy, activations, total, playbook) =
        (&f.by_policy, f.activations, f.total, f.playbook);
    let (exact, kept, adapted, savings) = (&f.exact, &f.kept, f.adapted, &f.savings);
    let (in_backward, offload_activations, optimizer_offload) =
        (f.in_backward, f.offload_activations, f.optimizer_offload);

    println!("model      {}", subject.title);
    match playbook {
        Some(p) => println!(
            "params     {} exact; playbook formula h·v + L·(12h² + 13h) + 2h: {}",
            group(subject.params),
            group(p)
        ),
        None => println!("params     {}", group(subject.params)),
    }
    match shape {
        Some(_) => println!(
            "training   {precision_name}, {optimizer_name}, recompute {recompute_name}, micro-batch \
             {} × {seq_len} tokens",
            args.batch_size
        ),
        None => println!("training   {precision_name}, {optimizer_name}"),
    }
    if f.ranks.world > 1 {
        let (n, sent) = (f.ranks.world, f.sent);
        println!(
            "ranks      {n} ({}); the figures are rank {}'s{}; each rank sends {} GiB a step \
             ({} GiB of gradients, all-reduced{})",
            match f.ranks.zero {
                0 => "DDP".to_string(),
                1 => format!(
                    "ZeRO-1: master weights and optimizer state ÷ {n} by the formulas, by \
                     whole parameters in the exact figures"
                ),
                z => format!(
                    "ZeRO-{z}: master weights, optimizer state and gradients ÷ {n} by the \
                     formulas, by whole parameters in the exact figures; the gradients are \
                     summed every micro-batch"
                ),
            },
            f.ranks.shown,
            if f.ranks.zero > 0 {
                " (the largest share)"
            } else {
                ""
            },
            gib(sent.gradients + sent.weights),
            gib(sent.gradients),
            if sent.weights > 0 {
                format!("; {} GiB of updated weights", gib(sent.weights))
            } else {
                String::new()
            }
        );
    }
    if let (Some((l, (trained, all))), Some(p)) = (adapted, &exact) {
        println!(
            "adapter    {} rank {}, α {} on {}{}: {} of {} parameters train ({:.3}%), the base \
             frozen{}",
            if args.lora.qlora { "QLoRA" } else { "LoRA" },
            l.rank,
            l.alpha,
            l.targets.join(", "),
            if l.dropout > 0.0 {
                format!(", dropout {}", l.dropout)
            } else {
                String::new()
            },
            group(trained),
            group(all),
            100.0 * trained as f64 / all.max(1) as f64,
            if args.lora.qlora {
                " (its projections in NF4)"
            } else {
                ""
            }
        );
        println!();
        print_exact_table(p, kept.as_ref(), optimizer_offload);
        if let Some(s) = &savings {
            print_savings(s);
        }
        return;
    }
    println!();
    println!(
        "{:<16} {:>11} {:>12} {:>12}",
        "category", "bytes/param", "GiB", "GB"
    );
    let per_param = trainkit::estimate::bytes_per_param(precision, optimizer);
    let sharded = |c: MemoryCategory| f.ranks.sharded(c);
    for c in STATE {
        let bytes = match (sharded(c), per_param.get(c)) {
            (true, b) if b > 0 => format!("{b}/{}", f.ranks.world),
            (_, b) => b.to_string(),
        };
        println!(
            "{:<16} {:>11} {:>12} {:>12}",
            c.name(),
            bytes,
            gib(state.get(c)),
            gb(state.get(c))
        );
    }
    let per_param_total = STATE
        .iter()
        .map(|&c| {
            per_param.get(c) as f64
                / if sharded(c) {
                    f.ranks.world as f64
                } else {
                    1.0
                }
        })
        .sum::<f64>();
    println!(
        "{:<16} {:>11} {:>12} {:>12}",
        "model state",
        format!("{}", (per_param_total * 100.0).round() / 100.0),
        gib(state_total),
        gb(state_total)
    );
    match (activations, total) {
        (Some(a), Some(t)) => {
            let formula = match recompute_name {
                "none" => "L·s·b·(34h + 5·a·s)",
                "selective" => "L·s·b·34h",
                "budget" => "L·s·b·2h at least (the budget's choice: see the exact figures)",
                _ => "L·s·b·2h",
            };
            let scale = if precision.compute_dtype().size() == 4 {
                ", ×2 for f32"
            } else {
                ""
            };
            println!(
                "{:<16} {:>11} {:>12} {:>12}   {formula}{scale}",
                "activations",
                "",
                gib(a),
                gb(a)
            );
            println!("{:<16} {:>11} {:>12} {:>12}", "total", "", gib(t), gb(t));
        }
        _ => println!(
            "{:<16} {:>11} {:>12} {:>12}   unknown without the dimensions (--model or \
             --layers/--hidden/--heads/--vocab)",
            "activations", "", "-", "-"
        ),
    }
    if let Some(v) = by_policy {
        let parts: Vec<String> = v
            .iter()
            .map(|(r, b)| format!("{r} {} GiB", gib(*b)))
            .collect();
        println!();
        println!("activations by recompute policy: {}", parts.join(", "));
    }
    if let Some(p) = exact {
        println!();
        println!(
            "trainkit's model, exact (what its ledger measures; activations include the \
             fused loss's chunk of logits){}:",
            [
                (in_backward, ", optimizer inside backward"),
                (
                    optimizer_offload,
                    ", optimizer offloaded (master weights and state in host memory)",
                ),
                (offload_activations, ", activations offloaded"),
                (
                    p.peak.get(MemoryCategory::Streamed) > 0,
                    ", weights streamed from host memory",
                ),
            ]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, s)| *s)
            .collect::<String>()
        );
        let parts: Vec<String> = MemoryCategory::ALL
            .iter()
            .filter(|c| p.peak.get(**c) > 0)
            .map(|c| format!("{c} {} GiB", gib(p.peak.get(*c))))
            .collect();
        println!("  {}", parts.join(", "));
        println!(
            "  peak {} GiB on the device, activations peaking in the {} phase",
            gib(p.peak_total),
            p.activations
                .peak_phase
                .map_or("-".to_string(), |x| x.to_string())
        );
        if p.host_bytes() > 0 {
            println!(
                "  host memory {} GiB at its peak (the offloaded and streamed categories)",
                gib(p.host_bytes())
            );
        }
        print_streaming(p, "  ");
        if let Some(k) = kept {
            println!(
                "  offloading saves {} GiB of device memory (peak {} GiB without it, {} GiB \
                 with it; activations {} GiB → {} GiB) and holds {} GiB in host memory",
                gib(k.peak_total.saturating_sub(p.peak_total)),
                gib(k.peak_total),
                gib(p.peak_total),
                gib(k.peak.get(MemoryCategory::Activations)),
                gib(p.peak.get(MemoryCategory::Activations)),
                gib(p.peak.get(MemoryCategory::Offloaded)),
            );
        }
    }
    if let Some(s) = &savings {
        print_savings(s);
    }
    if subject.shape.is_some_and(|a| !a.is_gpt_like()) {
        println!(
            "note: the activation formula is for the playbook's GPT-style layer (multi-head \
             attention, a 4h GELU MLP); for this model it is an approximation"
        );
    }
}

pub(super) const STATE: [MemoryCategory; 4] = [
    MemoryCategory::Weights,
    MemoryCategory::MasterWeights,
    MemoryCategory::Gradients,
    MemoryCategory::OptimizerState,
];

/// trainkit's exact figures as the table of a run (a LoRA's): each category's peak, the
/// peak total on the device, and what offloading moves to the host.
pub(super) fn print_exact_table(
    p: &MemoryPrediction,
    kept: Option<&MemoryPrediction>,
    optimizer_offload: bool,
) {
    println!(
        "trainkit's exact figures (what its ledger measures; activations include the fused \
         loss's chunk of logits):"
    );
    println!("{:<16} {:>12} {:>12}", "category", "GiB", "GB");
    for c in MemoryCategory::ALL {
        let b = p.peak.get(c);
        if b > 0 && c.on_device() {
            println!("{:<16} {:>12} {:>12}", c.name(), gib(b), gb(b));
        }
    }
    println!(
        "{:<16} {:>12} {:>12}   on the device, activations peaking in the {} phase",
        "peak",
        gib(p.peak_total),
        gb(p.peak_total),
        p.activations
            .peak_phase
            .map_or("-".to_string(), |x| x.to_string())
    );
    if p.host_bytes() > 0 {
        println!(
            "{:<16} {:>12} {:>12}   in host memory at its peak{}",
            "host",
            gib(p.host_bytes()),
            gb(p.host_bytes()),
            match (
                optimizer_offload,
                p.peak.get(MemoryCategory::Offloaded) > 0,
                p.peak.get(MemoryCategory::Streamed) > 0,
            ) {
                (true, _, false) => " (the optimizer's side)",
                (true, _, true) => " (the optimizer's side and the streamed weights)",
                (false, true, true) => " (offloaded activations and the streamed weights)",
                (false, false, true) => " (the streamed weights)",
                (false, _, false) => " (offloaded activations)",
            }
        );
    }
    print_streaming(p, "");
    if let Some(k) = kept {
        println!(
            "offloading the activations saves {} GiB of device memory (peak {} GiB without it)",
            gib(k.peak_total.saturating_sub(p.peak_total)),
            gib(k.peak_total),
        );
    }
}

/// The streamed weights' line: what host memory holds of them and what a step copies
/// to the device (the transfer the link must carry while the step computes).
fn print_streaming(p: &MemoryPrediction, indent: &str) {
    let streamed = p.peak.get(MemoryCategory::Streamed);
    if streamed == 0 {
        return;
    }
    let link = trainkit::estimate::HOST_LINK_BYTES_PER_S;
    println!(
        "{indent}streamed weights: {} GiB in page-locked host memory; {} GB copied to the \
         device per step beside {:.1} TFLOP of compute: at 25 GB/s (PCIe 4.0 x16) {:.2} s of \
         copies, which hide behind the compute on a device running below {:.0} TFLOP/s",
        gib(streamed),
        gb(p.streamed_bytes_per_step),
        p.flops_per_step as f64 / 1e12,
        p.streamed_bytes_per_step as f64 / link,
        p.hiding_flop_rate(link).unwrap_or(0.0) / 1e12
    );
}

/// The table of what each technique saves.
pub(super) fn print_savings(s: &TechniqueSavings) {
    let b = &s.baseline;
    println!();
    println!(
        "what each technique saves on its own (trainkit's exact figures, the setup above \
         with one technique added; saves = baseline peak - peak):"
    );
    println!(
        "  {:<22} {:>9} {:>9} {:>9}  setup",
        "technique", "peak GiB", "saves GiB", "host GiB"
    );
    let row = |name: &str, c: &FitCandidate| {
        println!(
            "  {:<22} {:>9} {:>9} {:>9}  {}",
            name,
            gib(c.peak),
            signed_gib(b.peak, c.peak),
            gib(c.host_bytes()),
            c.describe()
        )
    };
    row("baseline", b);
    for r in &s.rows {
        match &r.outcome {
            Ok(c) => row(r.technique.name(), c),
            Err(why) => println!(
                "  {:<22} {:>9} {:>9} {:>9}  {why}",
                r.technique.name(),
                "-",
                "-",
                "-"
            ),
        }
    }
    row("all that combine", &s.all);
}

/// One setup of the techniques table as JSON.
pub(super) fn candidate_json(baseline: u64, c: &FitCandidate) -> serde_json::Value {
    serde_json::json!({
        "peak_total_bytes": c.peak,
        "saving_bytes": baseline as i128 - c.peak as i128,
        "offloaded_bytes": c.host_bytes(),
        "setup": c.describe(),
        "flags": c.flags(),
    })
}

/// The techniques table as JSON: `baseline`, one row per technique (`not_applicable` with
/// the reason where it cannot be added), and `all`.
pub(super) fn savings_json(s: &TechniqueSavings) -> serde_json::Value {
    let base = s.baseline.peak;
    let rows: Vec<serde_json::Value> = s
        .rows
        .iter()
        .map(|r| {
            let mut v = match &r.outcome {
                Ok(c) => candidate_json(base, c),
                Err(why) => serde_json::json!({ "not_applicable": why }),
            };
            v["technique"] = r.technique.name().into();
            v
        })
        .collect();
    serde_json::json!({
        "baseline": candidate_json(base, &s.baseline),
        "rows": rows,
        "all": candidate_json(base, &s.all),
    })
}
