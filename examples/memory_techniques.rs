//! torchtune's Llama 3.2 3B memory ablation (batch 2, sequence 4096: bf16, then chunked
//! cross-entropy, activation checkpointing, the optimizer in backward, activation
//! offloading and 8-bit AdamW, one after the other) row by row with trainkit's exact
//! figures, in mixed bf16 and in pure bf16 (torchtune's bf16); then the largest model that trains with f32 master weights on one 80 GB GPU
//! and on a 24 GB one at sequence 4096: Llama 3.1 8B's layer stacked as deep as autofit can
//! fit, with AdamW and with 8-bit AdamW, with the optimizer on the device and on the host. Exact figures from the meta backend, as `trainkit memory` and
//! `trainkit train --autofit` print them.
//!
//! `cargo run --release --example memory_techniques`

use trainkit::estimate::{
    autofit, predict_with, preset, FitPlan, FitRequest, MemoryPrediction, MicroBatch, Shape,
    Technique, Techniques,
};
use trainkit::memory::format_bytes;
use trainkit::ops::update_rounding::UpdateRounding;
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::prelude::*;
use trainkit::CheckpointPolicy;

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

/// One row of the ablation: what it adds, and torchtune's figure where the issue quotes
/// one.
struct Row {
    adds: &'static str,
    flags: &'static str,
    torchtune: Option<f64>,
    loss: LossPath,
    recompute: Box<dyn CheckpointPolicy>,
    in_backward: bool,
    offload: bool,
    optimizer: Box<dyn Optimizer>,
}

fn predict_row(arch: &Shape, row: &Row, precision: &dyn Precision) -> Result<MemoryPrediction> {
    let model =
        trainkit::model::build_with(&arch.for_length(4096), AttentionPath::Fused, row.loss, None)?;
    let options = TrainerOptions {
        grad_clip: 0.0,
        optimizer_in_backward: row.in_backward,
        offload_activations: row.offload,
        ..TrainerOptions::default()
    };
    predict_with(
        model,
        MicroBatch {
            batch_size: 2,
            seq_len: 4096,
        },
        precision,
        row.recompute.as_ref(),
        row.optimizer.as_ref(),
        &options,
    )
}

fn ablation() -> Result<()> {
    let arch = preset("llama-3.2-3b")?.shape;
    let n = arch.exact_params()?;
    println!(
        "Llama 3.2 3B ({n} parameters), batch 2 × 4096 tokens, bf16 compute, bf16 gradients, \
         f32 master weights, fused attention"
    );
    let adamw = || Box::new(AdamW::default()) as Box<dyn Optimizer>;
    let rows = [
        Row {
            adds: "bf16 (the baseline)",
            flags: "--loss materialized",
            torchtune: Some(25.5),
            loss: LossPath::Materialized,
            recompute: Box::new(NoRecompute),
            in_backward: false,
            offload: false,
            optimizer: adamw(),
        },
        Row {
            adds: "+ chunked cross-entropy",
            flags: "--loss fused",
            torchtune: None,
            loss: LossPath::Fused,
            recompute: Box::new(NoRecompute),
            in_backward: false,
            offload: false,
            optimizer: adamw(),
        },
        Row {
            adds: "+ activation checkpointing",
            flags: "--recompute full",
            torchtune: None,
            loss: LossPath::Fused,
            recompute: Box::new(Full),
            in_backward: false,
            offload: false,
            optimizer: adamw(),
        },
        Row {
            adds: "+ optimizer in backward",
            flags: "--recompute full --optimizer-in-backward",
            torchtune: None,
            loss: LossPath::Fused,
            recompute: Box::new(Full),
            in_backward: true,
            offload: false,
            optimizer: adamw(),
        },
        Row {
            adds: "+ activation offloading",
            flags: "--recompute full --optimizer-in-backward --offload-activations",
            torchtune: None,
            loss: LossPath::Fused,
            recompute: Box::new(Full),
            in_backward: true,
            offload: true,
            optimizer: adamw(),
        },
        Row {
            adds: "+ 8-bit AdamW",
            flags: "--recompute full --optimizer-in-backward --offload-activations \
                    --optimizer adamw8bit",
            torchtune: Some(17.6),
            loss: LossPath::Fused,
            recompute: Box::new(Full),
            in_backward: true,
            offload: true,
            optimizer: Box::new(AdamW8bit::default()),
        },
    ];
    println!(
        "| setup | torchtune (GiB) | trainkit peak (GiB) | weights | master weights | gradients \
         | optimizer state | activations | host (offloaded) | trainkit in pure bf16 (GiB) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mixed = MixedBf16 { fp32_grads: false };
    // torchtune's bf16: no master copy, updates rounded to nearest, AdamW's moments bf16.
    let pure = PureBf16 {
        rounding: UpdateRounding::Nearest,
    };
    for row in &rows {
        let p = predict_row(&arch, row, &mixed)?;
        let c = |cat| gib(p.peak.get(cat));
        let like_torchtune = predict_row(&arch, row, &pure)?.peak_total;
        println!(
            "| {} (`{}`) | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.adds,
            row.flags,
            row.torchtune.map_or("-".to_string(), |t| format!("{t:.1}")),
            gib(p.peak_total),
            c(MemoryCategory::Weights),
            c(MemoryCategory::MasterWeights),
            c(MemoryCategory::Gradients),
            c(MemoryCategory::OptimizerState),
            c(MemoryCategory::Activations),
            c(MemoryCategory::Offloaded),
            gib(like_torchtune)
        );
    }
    Ok(())
}

/// Autofit's plan for `arch` at batch 1 × 4096 in `budget` bytes with `optimizer` (8-bit
/// state only when `optimizer` is 8-bit), bf16 compute and f32 master weights, no clipping;
/// the optimizer on the host only when `offload` allows it (host memory unchecked).
fn plan(
    arch: Shape,
    budget: u64,
    optimizer: &(dyn Optimizer + 'static),
    offload: bool,
) -> Option<FitPlan> {
    let bf16 = MixedBf16 { fp32_grads: false };
    let mut techniques = Techniques::ALL.without(Technique::Adamw8bit);
    if !offload {
        techniques = techniques.without(Technique::OptimizerOffload);
    }
    let req = FitRequest {
        grad_clip: 0.0,
        techniques,
        ..FitRequest::new(arch, 4096, 1, budget, &bf16, optimizer)
    };
    autofit(&req).ok()
}

fn largest() -> Result<()> {
    let base = preset("llama-3.1-8b")?.shape;
    println!();
    println!(
        "The largest Llama 3.1 8B-shaped model (its layer, stacked deeper) that trains with f32 \
         master weights at batch 1 × 4096:"
    );
    // The budgets `--autofit` takes on an idle card: 80 GB less 5%, and 24 GiB as asked.
    let budgets = [
        ("75 GiB", 75u64 << 30, "75GiB", false),
        ("80 GB", 80_000_000_000, "80GB", false),
        ("75 GiB, optimizer on the host", 75u64 << 30, "75GiB", true),
        ("24 GiB", 24u64 << 30, "24GiB", false),
        ("24 GiB, optimizer on the host", 24u64 << 30, "24GiB", true),
    ];
    for (name, optimizer) in [
        ("adamw", Box::new(AdamW::default()) as Box<dyn Optimizer>),
        ("adamw8bit", Box::new(AdamW8bit::default())),
    ] {
        for (budget_name, budget, flag, offload) in budgets {
            // The most layers that fit, by bisection: `lo` fits, `hi` does not.
            let with = |layers| Shape { layers, ..base };
            let (mut lo, mut hi) = (1usize, 1024usize);
            if plan(with(lo), budget, optimizer.as_ref(), offload).is_none() {
                println!("{name}, {budget_name}: not even one layer fits");
                continue;
            }
            while lo + 1 < hi {
                let mid = (lo + hi) / 2;
                if plan(with(mid), budget, optimizer.as_ref(), offload).is_some() {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            let p = plan(with(lo), budget, optimizer.as_ref(), offload).expect("it fits");
            let params = with(lo).exact_params()?;
            println!(
                "{name}, {budget_name}: {lo} layers, {params} parameters ({:.2}B): {} — peak {} \
                 ({} bytes), host {}",
                params as f64 / 1e9,
                p.choice.describe(),
                format_bytes(p.choice.peak),
                p.choice.peak,
                format_bytes(p.choice.host_bytes()),
            );
            let next = plan(with(lo + 1), budget, optimizer.as_ref(), offload);
            assert!(next.is_none());
            println!(
                "  trainkit train --model llama-3.1-8b --n-layer {lo} --seq-len 4096 \
                 --batch-size 1 --precision bf16 --optimizer {name} --grad-clip 0 --autofit \
                 --memory-budget {flag}{} --print-config",
                if offload {
                    String::new()
                } else {
                    let names: Vec<&str> = Techniques::ALL
                        .without(Technique::OptimizerOffload)
                        .iter()
                        .map(Technique::name)
                        .collect();
                    format!(" --autofit-techniques {}", names.join(","))
                }
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    ablation()?;
    largest()
}
