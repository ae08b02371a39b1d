//! Measures the memory anatomy of a training step with the ledger and prints the tables
//! of docs/memory.md: step 1 against step 2, activations against sequence length and
//! batch size for each recompute policy, and how mixed precision redistributes bytes,
//! with the materialized attention and logits (the fused paths are measured by the
//! `loss_floor` example).
//! Each measurement sits next to the exact model's prediction. Plots go to the directory
//! given as the first argument (default `docs/img`).
//!
//! `cargo run --release --example memory_anatomy [-- OUT_DIR]`

use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::estimate::{predict, MicroBatch};
use trainkit::memory::{format_bytes, CategoryBytes, MemoryCategory};
use trainkit::ops::update_rounding::UpdateRounding;
use trainkit::ops::{AttentionPath, LossPath};
use trainkit::prelude::*;
use trainkit::{CpuBackend, Timeline};

/// A GPT-2 with the real vocabulary and context, six layers of 384: small enough to
/// train a step in seconds on a CPU, with GPT-2's proportions of classifier to layers.
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

/// [`model`] with the materialized attention probabilities and logits.
fn build() -> Result<Gpt2> {
    Gpt2::new(model())?
        .with_attention(AttentionPath::Materialized)
        .with_loss(LossPath::Materialized, None)
}

struct Setup {
    batch: usize,
    seq: usize,
    precision: Box<dyn Precision>,
    policy: Box<dyn CheckpointPolicy>,
}

/// Per-step peaks (each category's own and the total) of `steps` steps.
fn measure(setup: &Setup, tokens: &[u32], steps: usize) -> Result<Vec<(CategoryBytes, u64)>> {
    let data = DataLoader::new(tokens.to_vec(), setup.batch, setup.seq)?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut t = Trainer::builder(build()?, backend, data)
        .precision(setup.precision.clone())
        .checkpoint(setup.policy.clone())
        .optimizer(AdamW::default())
        .build()?;
    (0..steps)
        .map(|_| t.step().map(|s| (s.memory.peak, s.memory.peak_total)))
        .collect()
}

/// Records three steps of `setup` with a [`Timeline`] and draws them.
fn profile(setup: &Setup, tokens: &[u32], svg: &Path) -> Result<()> {
    let data = DataLoader::new(tokens.to_vec(), setup.batch, setup.seq)?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut t = Trainer::builder(build()?, backend, data)
        .precision(setup.precision.clone())
        .checkpoint(setup.policy.clone())
        .optimizer(AdamW::default())
        .observer(Timeline::new(3)?.with_svg(svg))
        .build()?;
    for _ in 0..3 {
        t.step()?;
    }
    for p in t.observer().step_peaks() {
        eprintln!(
            "step {}: peak {} in {}",
            p.step,
            format_bytes(p.peak_total),
            p.phase.map_or("-".to_string(), |x| x.to_string())
        );
    }
    Ok(())
}

fn predicted(setup: &Setup) -> Result<trainkit::estimate::MemoryPrediction> {
    predict(
        Box::new(build()?),
        MicroBatch {
            batch_size: setup.batch,
            seq_len: setup.seq,
        },
        setup.precision.as_ref(),
        setup.policy.as_ref(),
        &AdamW::default(),
    )
}

fn policies() -> [(&'static str, Box<dyn CheckpointPolicy>); 3] {
    [
        ("none", Box::new(NoRecompute)),
        ("selective", Box::new(Selective)),
        ("full", Box::new(Full)),
    ]
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The playbook's activation formula for this model, with 4-byte activations in f32.
fn playbook_activations(batch: usize, seq: usize, policy: &str, bytes_per_value: u64) -> u64 {
    let c = model();
    let (l, h, a) = (c.n_layer as u64, c.n_embd as u64, c.n_head as u64);
    let (s, b) = (seq as u64, batch as u64);
    let per_token = match policy {
        "none" => 34 * h + 5 * a * s,
        "selective" => 34 * h,
        _ => 2 * h,
    };
    l * s * b * per_token * bytes_per_value / 2
}

fn main() -> Result<()> {
    let out_dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("docs/img"));
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::io(&out_dir, e))?;
    let text = SyntheticCorpus::builtin().generate(200_000, 1);
    let tokens = ByteTokenizer.encode(&text);

    // 1. Step 1 against step 2.
    println!("## Step 1 and step 2 (B=4, T=256, fp32, no recompute)\n");
    let base = Setup {
        batch: 4,
        seq: 256,
        precision: Box::new(Fp32),
        policy: Box::new(NoRecompute),
    };
    let steps = measure(&base, &tokens, 2)?;
    println!("| category | step 1 peak | step 2 peak |\n|---|---|---|");
    for c in MemoryCategory::ALL {
        println!(
            "| {c} | {} | {} |",
            format_bytes(steps[0].0.get(c)),
            format_bytes(steps[1].0.get(c))
        );
    }
    let p = predicted(&base)?;
    profile(&base, &tokens, &out_dir.join("step_profile.svg"))?;
    println!(
        "| **total peak** | **{}** (predicted {}) | **{}** (predicted {}) |\n",
        format_bytes(steps[0].1),
        format_bytes(p.first_step_peak_total(1)),
        format_bytes(steps[1].1),
        format_bytes(p.peak_total)
    );

    // 2. Activations against sequence length.
    println!("## Activation peak against sequence length (B=1, fp32)\n");
    println!(
        "| T | policy | measured | predicted | playbook formula (f32) |\n|---|---|---|---|---|"
    );
    let seqs = [128usize, 256, 512, 1024];
    let mut by_seq: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
    for (name, policy) in policies() {
        let mut points = Vec::new();
        for &seq in &seqs {
            let s = Setup {
                batch: 1,
                seq,
                precision: Box::new(Fp32),
                policy: policy.clone(),
            };
            let m = measure(&s, &tokens, 1)?[0]
                .0
                .get(MemoryCategory::Activations);
            let p = predicted(&s)?.activations.peak;
            println!(
                "| {seq} | {name} | {} | {} | {} |",
                format_bytes(m),
                format_bytes(p),
                format_bytes(playbook_activations(1, seq, name, 4))
            );
            points.push((seq as f64, mib(m)));
        }
        by_seq.push((name, points));
    }
    println!();
    plot(
        &out_dir.join("activations_vs_seq_len.svg"),
        "Activation peak against sequence length (B=1, fp32)",
        "sequence length",
        &by_seq,
    )?;

    // 3. Activations against batch size.
    println!("## Activation peak against batch size (T=256, fp32)\n");
    println!("| B | none | selective | full |\n|---|---|---|---|");
    let batches = [1usize, 2, 4, 8];
    let mut by_batch: Vec<(&str, Vec<(f64, f64)>)> =
        policies().iter().map(|(n, _)| (*n, Vec::new())).collect();
    for &batch in &batches {
        let mut row = format!("| {batch} |");
        for (i, (_, policy)) in policies().into_iter().enumerate() {
            let s = Setup {
                batch,
                seq: 256,
                precision: Box::new(Fp32),
                policy,
            };
            let m = measure(&s, &tokens, 1)?[0]
                .0
                .get(MemoryCategory::Activations);
            assert_eq!(m, predicted(&s)?.activations.peak, "the model is exact");
            row.push_str(&format!(" {} |", format_bytes(m)));
            by_batch[i].1.push((batch as f64, mib(m)));
        }
        println!("{row}");
    }
    println!();
    plot(
        &out_dir.join("activations_vs_batch.svg"),
        "Activation peak against batch size (T=256, fp32)",
        "micro-batch rows",
        &by_batch,
    )?;

    // 4. Mixed precision.
    println!("## Where mixed precision moves the bytes (B=4, T=256, no recompute, step 2)\n");
    let precisions: [(&str, Box<dyn Precision>); 5] = [
        ("fp32", Box::new(Fp32)),
        (
            "bf16, f32 gradients",
            Box::new(MixedBf16 { fp32_grads: true }),
        ),
        (
            "bf16, bf16 gradients",
            Box::new(MixedBf16 { fp32_grads: false }),
        ),
        ("pure bf16, nearest", Box::new(PureBf16::default())),
        (
            "pure bf16, Kahan",
            Box::new(PureBf16 {
                rounding: UpdateRounding::Kahan,
            }),
        ),
    ];
    let names: Vec<&str> = precisions.iter().map(|p| p.0).collect();
    println!(
        "| category | {} |\n|---|{}",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    let mut columns = Vec::new();
    for (_, precision) in precisions {
        let s = Setup {
            batch: 4,
            seq: 256,
            precision,
            policy: Box::new(NoRecompute),
        };
        columns.push(measure(&s, &tokens, 2)?[1]);
    }
    for c in MemoryCategory::ALL {
        let cells: Vec<String> = columns
            .iter()
            .map(|col| format_bytes(col.0.get(c)))
            .collect();
        println!("| {c} | {} |", cells.join(" | "));
    }
    let totals: Vec<String> = columns
        .iter()
        .map(|col| format!("**{}**", format_bytes(col.1)))
        .collect();
    println!("| **total peak** | {} |", totals.join(" | "));
    Ok(())
}

fn plot(path: &Path, title: &str, x_desc: &str, series: &[(&str, Vec<(f64, f64)>)]) -> Result<()> {
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
        root.fill(&WHITE)?;
        let x_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.0))
            .fold(1.0, f64::max);
        let y_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max * 1.05, 0.0..y_max * 1.1)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc("activation peak (MiB)")
            .draw()?;
        let colours = [
            RGBColor(214, 39, 40),
            RGBColor(255, 127, 14),
            RGBColor(31, 119, 180),
        ];
        for ((name, points), colour) in series.iter().zip(colours) {
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, colour.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| Error::Backend {
        backend: "plot",
        message: format!("cannot draw {}: {e}", path.display()),
    })
}
