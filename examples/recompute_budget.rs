//! Measures what a recompute budget and activation offloading trade, with the ledger: for
//! each policy (with and without offloading), the activation bytes kept on the device and
//! held in host memory, the activation and device peaks, the bytes recomputed, the FLOPs a
//! step executes and its time, on the CPU. Prints the table of docs/memory.md's "A byte
//! budget, and offloading".
//!
//! `cargo run --example recompute_budget`

use std::sync::Arc;
use std::time::Instant;
use trainkit::memory::format_bytes;
use trainkit::prelude::*;
use trainkit::CpuBackend;

/// docs/memory.md's model: GPT-2's vocabulary and context, six layers of 384, run with
/// the materialized attention (whose probabilities are what selective recomputation and
/// a budget choose to drop) and the fused loss.
fn model() -> Gpt2Config {
    Gpt2Config {
        n_layer: 6,
        n_head: 6,
        n_embd: 384,
        n_positions: 1024,
        vocab_size: 50257,
        layer_norm_epsilon: 1e-5,
    }
}

/// What one setup measured in its third step.
struct Row {
    name: String,
    offload: bool,
    stats: StepStats,
    seconds: f64,
}

fn measure(
    tokens: &[u32],
    name: String,
    policy: Box<dyn CheckpointPolicy>,
    offload: bool,
) -> Result<Row> {
    let data = DataLoader::new(tokens.to_vec(), 4, 256)?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut t = Trainer::builder(
        Gpt2::new(model())?.with_attention(trainkit::ops::AttentionPath::Materialized),
        backend,
        data,
    )
    .checkpoint(policy)
    .optimizer(AdamW::default())
    .options(TrainerOptions {
        offload_activations: offload,
        ..TrainerOptions::default()
    })
    .build()?;
    t.step()?;
    t.step()?;
    let start = Instant::now();
    let stats = t.step()?;
    Ok(Row {
        name,
        offload,
        stats,
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn main() -> Result<()> {
    let text = SyntheticCorpus::builtin().generate(200_000, 7);
    let tokens = ByteTokenizer.encode(&text);
    let mut rows = vec![
        measure(&tokens, "none".into(), Box::new(NoRecompute), false)?,
        measure(&tokens, "full".into(), Box::new(Full), false)?,
        measure(&tokens, "selective".into(), Box::new(Selective), false)?,
    ];
    let (lo, hi) = (
        rows[1].stats.stash.kept_bytes,
        rows[0].stats.stash.kept_bytes,
    );
    for quarter in [1, 2, 3] {
        let bytes = lo + (hi - lo) * quarter / 4;
        let name = format!("budget {}", format_bytes(bytes));
        rows.push(measure(&tokens, name, Box::new(Budget::new(bytes)), false)?);
    }
    rows.push(measure(
        &tokens,
        "none".into(),
        Box::new(NoRecompute),
        true,
    )?);
    rows.push(measure(&tokens, "full".into(), Box::new(Full), true)?);
    let base_flops = rows[0].stats.hardware_flops as f64;
    println!(
        "| policy | offload | kept on device | offloaded (host) | activation peak | device peak \
         | recomputed | FLOPs vs none | s/step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let s = &r.stats;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.2} |",
            r.name,
            if r.offload { "yes" } else { "no" },
            format_bytes(s.stash.kept_bytes),
            format_bytes(s.memory.peak.get(MemoryCategory::Offloaded)),
            format_bytes(s.memory.peak.get(MemoryCategory::Activations)),
            format_bytes(s.memory.peak_total),
            format_bytes(s.stash.recomputed_bytes),
            s.hardware_flops as f64 / base_flops,
            r.seconds
        );
    }
    Ok(())
}
