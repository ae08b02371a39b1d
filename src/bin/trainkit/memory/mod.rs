//! `trainkit memory`: the Ultra-Scale Playbook's memory explorer.

mod exact;
mod report;
mod subject;
mod units;

use crate::as_flag;
use exact::{exact_shape, lora, trainable_params, trainkit_exact};
use report::{Figures, STATE};
use std::path::PathBuf;
use subject::{flag_error, positive, subject};
use trainkit::config::{LoraFlags, PolicyFlags, RunConfig};
use trainkit::estimate::{model_state_bytes, technique_savings, ActivationSweep, FitRequest};
use trainkit::memory::MemoryCategory;
use trainkit::Result;

/// How much memory training a model takes on one GPU (with AdamW unless --optimizer says
/// otherwise), by the Ultra-Scale Playbook's formulas: weights, gradients, master weights
/// and optimizer state per parameter, and activations per token for each recompute
/// policy.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct MemoryArgs {
    /// A named model: gpt2, gpt2-medium, gpt2-large, gpt2-xl, smollm2-135m, smollm2-360m,
    /// smollm2-1.7b, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, llama-1b, llama-8b, llama-70b
    /// or llama-405b.
    #[arg(long)]
    model: Option<String>,
    /// A parameter count instead of a model, e.g. 7B, 1.5B, 124M or 350000000 (K, M, B, T
    /// suffixes): model state only, as activations need the dimensions.
    #[arg(long)]
    params: Option<String>,
    /// Layers (raw dimensions, with --hidden, --heads and --vocab).
    #[arg(long)]
    layers: Option<u64>,
    /// Width of the residual stream.
    #[arg(long)]
    hidden: Option<u64>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<u64>,
    /// Vocabulary size.
    #[arg(long)]
    vocab: Option<u64>,
    /// Key and value heads, for grouped-query attention (default: --heads).
    #[arg(long)]
    kv_heads: Option<u64>,
    /// Inner width of the MLP (default: 4 × --hidden).
    #[arg(long)]
    ffn: Option<u64>,
    /// Tokens per sequence (default: the context of a GPT-2, 4096 for Llama presets and
    /// raw dimensions).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    batch_size: u64,
    /// With bf16: also accumulate gradients in f32 (4 more bytes per parameter).
    #[arg(long)]
    fp32_grads: bool,
    /// Also show what each memory technique saves on its own for this model, batch and
    /// sequence (trainkit's exact figures): the setup the other flags describe with
    /// accumulation, selective, adamw8bit, optimizer-in-backward, budget, full, offload,
    /// optimizer-offload, bf16, LoRA (rank 8 on every projection) or QLoRA added, and with
    /// all that combine (those that train every weight).
    #[arg(long)]
    techniques: bool,
    /// The policies (`--precision`, bf16 by default; `--recompute`, `--optimizer`, the
    /// offloads, the loss and attention paths), as `trainkit train` takes them: the
    /// offloads and the paths change trainkit's exact figures.
    #[command(flatten)]
    policy: PolicyFlags,
    /// The LoRA flags: trainkit's exact figures for an adapter on the frozen model (a
    /// bf16 base without master weights or gradients; the formulas count full training).
    #[command(flatten)]
    lora: LoraFlags,
    /// Ranks of a data-parallel job (`mpirun -np N trainkit train`): the figures are one
    /// rank's (under ZeRO the heaviest's), with the bytes each rank sends per step.
    #[arg(long, default_value_t = 1)]
    world: u64,
    /// ZeRO stage across the --world ranks: 0 (DDP: every rank keeps the whole optimizer
    /// state), 1 (each rank keeps the master weights and optimizer state of its share of
    /// the parameters) or 2 (and their gradients alone).
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also draw activation memory against sequence length for each recompute policy,
    /// with the model state for scale, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// The attention path, the loss path and the fused loss's chunk of trainkit's exact
/// figures.
pub(super) type Paths = (
    trainkit::ops::AttentionPath,
    trainkit::ops::LossPath,
    Option<usize>,
);

/// The policies the flags describe, laid over the defaults as `trainkit train` lays them,
/// but bf16 (with f32 gradients under --fp32-grads) unless --precision says otherwise.
fn policies(args: &MemoryArgs) -> Result<RunConfig> {
    let mut cfg = RunConfig::default();
    let precision = args.policy.precision.as_deref().unwrap_or("bf16");
    cfg.precision = trainkit::precision::named(precision, args.fp32_grads)
        .map_err(|e| e.for_field("--precision"))?;
    let rest = PolicyFlags {
        precision: None,
        ..args.policy.clone()
    };
    rest.apply(&mut cfg)?;
    Ok(cfg)
}

/// The data-parallel job the figures are one rank of (`--world`, `--zero`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ranks {
    /// Ranks of the job (1: one process).
    pub world: u64,
    /// ZeRO stage: 0, 1 or 2.
    pub zero: u8,
    /// The rank whose exact figures are shown: under ZeRO the heaviest
    /// ([`exact::heaviest`]), else 0.
    pub shown: usize,
}

impl Ranks {
    /// The categories of model state one rank keeps a share of: under ZeRO-1 the master
    /// weights and optimizer state, under ZeRO-2 the gradients too.
    pub(super) fn sharded(&self, c: MemoryCategory) -> bool {
        match c {
            MemoryCategory::MasterWeights | MemoryCategory::OptimizerState => self.zero >= 1,
            MemoryCategory::Gradients => self.zero >= 2,
            _ => false,
        }
    }

    /// The playbook's model state of one rank: each [`Ranks::sharded`] category divided
    /// by the ranks (rounded up).
    fn share(&self, mut state: trainkit::memory::CategoryBytes) -> trainkit::memory::CategoryBytes {
        for c in [
            MemoryCategory::MasterWeights,
            MemoryCategory::OptimizerState,
            MemoryCategory::Gradients,
        ] {
            if self.sharded(c) {
                let share = state.get(c).div_ceil(self.world);
                *state.get_mut(c) = share;
            }
        }
        state
    }

    /// Bytes each rank sends per optimizer step of one micro-batch over MPI's host path,
    /// by a ring's count: the gradients of the `trained` parameters all-reduced (2(N−1)/N
    /// of them, in f32: trainkit sums a bf16 gradient across ranks in f32 and rounds once;
    /// under ZeRO-2 every micro-batch's, so k times that when accumulating k), and under
    /// ZeRO-1 and 2 the updated compute weights their owners send ((N−1)/N of them, an
    /// all-gather's share). NCCL sends less: each gradient in its own dtype, and under
    /// ZeRO-2 reduced to its owner ((N−1)/N).
    pub(super) fn bytes_sent(&self, trained: u64, precision: &dyn trainkit::Precision) -> Sent {
        let n = self.world as f64;
        let ring = (n - 1.0) / n;
        let grads = trained as f64 * 4.0;
        let weights = trained as f64 * precision.compute_dtype().size() as f64;
        Sent {
            gradients: (2.0 * ring * grads).round() as u64,
            weights: if self.zero >= 1 {
                (ring * weights).round() as u64
            } else {
                0
            },
        }
    }
}

/// Bytes one rank sends per optimizer step ([`Ranks::bytes_sent`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sent {
    /// Gradients, all-reduced.
    pub gradients: u64,
    /// Updated weights (ZeRO-1).
    pub weights: u64,
}

/// `--world` and `--zero`, checked.
fn ranks(args: &MemoryArgs) -> Result<Ranks> {
    positive("--world", Some(args.world))?;
    if !trainkit::trainer::ZERO_STAGES.contains(&args.zero) {
        return Err(flag_error(
            "--zero",
            format!(
                "stage {} is not built; use 0 (DDP), 1 (the optimizer state and master \
                 weights sharded across the ranks) or 2 (the gradients too)",
                args.zero
            ),
        ));
    }
    if args.zero > 0 && args.world == 1 {
        return Err(flag_error(
            "--zero",
            "shards across the ranks of a data-parallel job; add --world N (N > 1)",
        ));
    }
    Ok(Ranks {
        world: args.world,
        zero: args.zero,
        shown: 0,
    })
}

pub fn run(args: MemoryArgs) -> Result<()> {
    let cfg = policies(&args)?;
    let precision = cfg.precision.as_ref();
    let recompute = cfg.checkpoint.as_ref();
    let recompute_name = recompute.typetag_name();
    let precision_name = trainkit::precision::describe(precision);
    let optimizer = cfg.optimizer.as_ref();
    let optimizer_name = optimizer.typetag_name();
    let t = &cfg.training;
    let (in_backward, offload_activations, optimizer_offload) = (
        t.optimizer_in_backward,
        t.offload_activations,
        cfg.optimizer_offload,
    );
    positive("--batch-size", Some(args.batch_size))?;
    positive("--seq-len", args.seq_len)?;
    let ranks = ranks(&args)?;
    let subject = subject(&args)?;
    if args.plot.is_some() && subject.shape.is_none() {
        return Err(flag_error(
            "--plot",
            "activations need the model's dimensions; use --model NAME or --layers, --hidden, \
             --heads and --vocab instead of --params",
        ));
    }
    let seq_len = args.seq_len.unwrap_or(subject.default_seq_len);
    let state = model_state_bytes(subject.params, precision, optimizer).map_err(as_flag)?;
    let state = ranks.share(state);
    let state_total: u64 = STATE.iter().map(|&c| state.get(c)).sum();
    let shape = subject
        .shape
        .map(|a| a.activation_shape(seq_len, args.batch_size));
    let by_policy: Option<Vec<(&'static str, u64)>> = shape
        .map(|s| {
            trainkit::checkpoint::by_cost()
                .into_iter()
                .map(|r| {
                    let bytes = s.bytes(r.as_ref(), precision).map_err(as_flag)?;
                    Ok((r.typetag_name(), bytes))
                })
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    let activations = by_policy.as_ref().and_then(|v| {
        v.iter()
            .find(|(r, _)| *r == recompute_name)
            .map(|(_, b)| *b)
    });
    let total = activations
        .map(|a| {
            a.checked_add(state_total)
                .ok_or_else(|| flag_error("--seq-len", "the total does not fit in 64 bits"))
        })
        .transpose()?;
    let playbook = subject
        .shape
        .map(|a| a.playbook_params().map_err(as_flag))
        .transpose()?;

    let paths = (t.attention, t.loss, t.loss_chunk);
    let lora = lora(&args, &subject, seq_len)?;
    let adapter = lora
        .as_ref()
        .map(|l| l as &(dyn trainkit::Adapter + 'static));
    let ranks = Ranks {
        shown: exact::exact_model(&subject, seq_len, paths, adapter)?
            .map_or(0, |m| exact::heaviest(m.as_ref(), ranks)),
        ..ranks
    };
    let exact_with = |offload: bool| {
        trainkit_exact(
            &subject,
            seq_len,
            args.batch_size,
            precision,
            recompute,
            optimizer,
            in_backward,
            offload,
            optimizer_offload,
            paths,
            adapter,
            ranks,
            cfg.placement.as_ref(),
        )
    };
    let exact = exact_with(offload_activations)?;
    // A LoRA run's figures are trainkit's exact ones (the playbook's formulas count full
    // training): without them the flags cannot be honoured.
    let adapted = match (&lora, &exact) {
        (Some(l), Some(_)) => Some((l, trainable_params(&subject, seq_len, paths, adapter)?)),
        (Some(_), None) => {
            return Err(flag_error(
                "--lora-rank",
                "a LoRA's memory is trainkit's exact figure, which needs the model's \
                 dimensions (--model NAME, or --layers, --hidden, --heads and --vocab; \
                 --params has none) and a --seq-len within its context",
            ))
        }
        (None, _) => None,
    };
    if let (Some(path), Some(shape)) = (&args.plot, shape) {
        let (lo, hi) = ActivationSweep::default_range(seq_len);
        // trainkit's exact activations (meta runs of the model it builds, every policy at
        // every length), with the playbook's formula beside them, dashed.
        let sweep = ActivationSweep::new(shape, precision, state_total, lo, hi)
            .map_err(as_flag)?
            .with_exact(|policy, s| {
                let p = trainkit_exact(
                    &subject,
                    s,
                    args.batch_size,
                    precision,
                    policy,
                    optimizer,
                    in_backward,
                    false,
                    optimizer_offload,
                    paths,
                    adapter,
                    ranks,
                    cfg.placement.as_ref(),
                )?;
                Ok(p.map(|p| p.peak.get(MemoryCategory::Activations)))
            })?;
        let source = if sweep.is_exact() {
            format!(
                "trainkit exact ({} attention, {} loss); dashed: the playbook's formula",
                paths.0, paths.1
            )
        } else {
            "the playbook's formula".to_string()
        };
        let title = format!(
            "{}: activation memory vs sequence length, {source} (materialized attention); {}, \
             micro-batch {}",
            subject.name.unwrap_or("model"),
            precision_name,
            args.batch_size
        );
        sweep.write_svg(path, &title)?;
        let note = format!(
            "plot: {} (activation memory, {lo} to {hi} tokens, per recompute policy: {})",
            path.display(),
            if sweep.is_exact() {
                "trainkit's exact figures, the playbook's formula dashed"
            } else {
                "the playbook's formula (trainkit builds no exact model for this subject)"
            }
        );
        if args.json {
            eprintln!("{note}");
        } else {
            println!("{note}");
        }
    }
    let savings = if args.techniques {
        let shape = exact_shape(&subject, seq_len).ok_or_else(|| {
            flag_error(
                "--techniques",
                "needs the exact figures: a model with dimensions (--model NAME, or --layers, \
                 --hidden, --heads and --vocab) and a --seq-len within a GPT-2's context",
            )
        })?;
        let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let req = FitRequest {
            recompute,
            attention: paths.0,
            loss: paths.1,
            loss_chunk: paths.2,
            grad_clip: 0.0,
            optimizer_in_backward: in_backward,
            offload_activations,
            optimizer_offload,
            placement: cfg.placement.as_ref(),
            adapter,
            world: usize_of(ranks.world),
            zero_stage: ranks.zero,
            // The table shows LoRA, QLoRA and pure bf16 too (autofit uses them only when
            // named).
            techniques: trainkit::estimate::Techniques::ALL
                .with(trainkit::estimate::Technique::Lora)
                .with(trainkit::estimate::Technique::Qlora)
                .with(trainkit::estimate::Technique::PureBf16),
            ..FitRequest::new(
                shape,
                usize_of(seq_len),
                usize_of(args.batch_size),
                u64::MAX,
                precision,
                optimizer,
            )
        };
        Some(technique_savings(&req).map_err(as_flag)?)
    } else {
        None
    };
    // With offloading, the same run without it: what offloading saves.
    let kept = if offload_activations {
        exact_with(false)?
    } else {
        None
    };

    // What each rank sends: the trained parameters' gradients, and under ZeRO-1 their
    // updated weights.
    let trained = adapted.map_or(subject.params, |(_, (trained, _))| trained);
    let sent = ranks.bytes_sent(trained, precision);
    let figures = Figures {
        ranks,
        sent,
        args: &args,
        subject: &subject,
        seq_len,
        precision,
        precision_name,
        optimizer,
        optimizer_name,
        recompute_name,
        state,
        state_total,
        shape,
        by_policy,
        activations,
        total,
        playbook,
        exact,
        kept,
        adapted,
        savings,
        in_backward,
        offload_activations,
        optimizer_offload,
    };
    if args.json {
        report::json(&figures);
    } else {
        report::table(&figures);
    }
    Ok(())
}
