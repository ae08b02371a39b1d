//! `trainkit memory`: the Ultra-Scale Playbook's memory explorer.

use std::path::PathBuf;
use trainkit::config::{LoraFlags, PolicyFlags, RunConfig};
use trainkit::estimate::{
    model_state_bytes, preset_names, technique_savings, ActivationSweep, Architecture,
    FitCandidate, FitRequest, MemoryPrediction, MicroBatch, Mlp, Norm, Preset, TechniqueSavings,
    PRESETS,
};
use trainkit::memory::MemoryCategory;
use trainkit::{Error, Result};

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
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also draw activation memory against sequence length for each recompute policy,
    /// with the model state for scale, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// The model the estimate is for.
struct Subject {
    /// Preset name, if any.
    name: Option<&'static str>,
    /// What to call it in the table.
    title: String,
    /// Parameters the model state is computed from.
    params: u64,
    /// The dimensions, when known (not with --params).
    arch: Option<Architecture>,
    /// Sequence length when --seq-len is not given.
    default_seq_len: u64,
}

fn flag_error(flag: &str, message: impl Into<String>) -> Error {
    Error::config(flag, message)
}

/// Library errors name fields (`kv_heads`); on the command line they are flags.
fn as_flag(e: Error) -> Error {
    match e {
        Error::Config { field, message } => Error::Config {
            field: format!("--{}", field.replace('_', "-")),
            message,
        },
        e => e,
    }
}

/// A parameter count: digits with an optional fraction and K, M, B or T suffix.
fn parse_count(text: &str) -> Result<u64> {
    let bad = || {
        flag_error(
            "--params",
            format!(
                "`{text}` is not a parameter count; use a number with an optional K, M, B or \
                 T suffix, e.g. 7B, 1.5B or 124M"
            ),
        )
    };
    let t = text.trim().replace('_', "");
    let (number, scale) = match t.char_indices().last() {
        Some((at, c)) if c.is_ascii_alphabetic() => {
            let scale: u64 = match c.to_ascii_uppercase() {
                'K' => 1_000,
                'M' => 1_000_000,
                'B' => 1_000_000_000,
                'T' => 1_000_000_000_000,
                _ => return Err(bad()),
            };
            (&t[..at], scale)
        }
        _ => (t.as_str(), 1),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() && frac.is_empty() || !digits(whole) || !digits(frac) {
        return Err(bad());
    }
    let too_big = || flag_error("--params", format!("`{text}` is too large"));
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| too_big())?
    };
    let mut count = whole.checked_mul(scale).ok_or_else(too_big)?;
    if !frac.is_empty() {
        let frac_value: u128 = frac.parse().map_err(|_| too_big())?;
        let denom = 10u128.checked_pow(frac.len() as u32).ok_or_else(too_big)?;
        let scaled = frac_value * scale as u128;
        if scaled % denom != 0 {
            return Err(flag_error(
                "--params",
                format!("`{text}` is not a whole number of parameters; drop some decimals"),
            ));
        }
        let extra = u64::try_from(scaled / denom).map_err(|_| too_big())?;
        count = count.checked_add(extra).ok_or_else(too_big)?;
    }
    if count == 0 {
        return Err(flag_error("--params", "must be at least 1"));
    }
    Ok(count)
}

fn positive(flag: &str, value: Option<u64>) -> Result<Option<u64>> {
    match value {
        Some(0) => Err(flag_error(flag, "must be at least 1")),
        v => Ok(v),
    }
}

fn describe(arch: &Architecture) -> String {
    let mut heads = if arch.kv_heads == arch.heads {
        format!("{} heads", arch.heads)
    } else {
        format!("{} heads ({} kv)", arch.heads, arch.kv_heads)
    };
    if arch.head_dim.saturating_mul(arch.heads) != arch.hidden {
        heads += &format!(" of {}", arch.head_dim);
    }
    if arch.qk_norm {
        heads += ", q/k norm";
    }
    if arch.bias == trainkit::model::Biases::QKV {
        heads += ", q/k/v biases";
    }
    let mlp = match arch.mlp {
        Mlp::Gelu => "GELU MLP",
        Mlp::SwiGlu => "SwiGLU MLP",
        Mlp::GeGlu => "GeGLU MLP",
    };
    let norm = match arch.norm {
        Norm::LayerNorm => "LayerNorm",
        Norm::RmsNorm => "RMSNorm",
    };
    format!(
        "{} layers, hidden {}, {heads}, ffn {}, vocab {}, {mlp}, {norm}{}",
        arch.layers,
        arch.hidden,
        arch.ffn,
        arch.vocab,
        if arch.tied_embeddings {
            ", tied embeddings"
        } else {
            ""
        }
    )
}

fn subject(args: &MemoryArgs) -> Result<Subject> {
    let dims = [
        ("--layers", args.layers),
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--vocab", args.vocab),
        ("--kv-heads", args.kv_heads),
        ("--ffn", args.ffn),
    ];
    let given: Vec<&str> = dims
        .iter()
        .filter(|(_, v)| v.is_some())
        .map(|(f, _)| *f)
        .collect();
    match (&args.model, &args.params) {
        (Some(_), Some(_)) => Err(flag_error(
            "--model",
            "--model and --params both name the model; give one of them",
        )),
        (Some(_), None) | (None, Some(_)) if !given.is_empty() => Err(flag_error(
            given[0],
            format!(
                "{} fixes the model; drop {} or the {} flag",
                if args.model.is_some() {
                    "--model"
                } else {
                    "--params"
                },
                given.join(", "),
                if args.model.is_some() {
                    "--model"
                } else {
                    "--params"
                }
            ),
        )),
        (Some(name), None) => {
            let preset: &'static Preset = PRESETS
                .iter()
                .find(|p| p.name.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    flag_error(
                        "--model",
                        format!(
                            "`{name}` is not a known model; use one of {}",
                            preset_names()
                        ),
                    )
                })?;
            Ok(Subject {
                name: Some(preset.name),
                title: format!(
                    "{}, {}: {}",
                    preset.name,
                    preset.description,
                    describe(&preset.architecture)
                ),
                params: preset.architecture.exact_params().map_err(as_flag)?,
                arch: Some(preset.architecture),
                default_seq_len: preset.default_seq_len,
            })
        }
        (None, Some(text)) => {
            let params = parse_count(text)?;
            Ok(Subject {
                name: None,
                title: format!("a model of {} parameters (--params {text})", group(params)),
                params,
                arch: None,
                default_seq_len: 4096,
            })
        }
        (None, None) => {
            for (flag, v) in dims {
                positive(flag, v)?;
            }
            let (Some(layers), Some(hidden), Some(heads), Some(vocab)) =
                (args.layers, args.hidden, args.heads, args.vocab)
            else {
                if given.is_empty() {
                    return Err(flag_error(
                        "--model",
                        format!(
                            "no model given; use --model NAME ({}), --params N (e.g. 7B) or \
                             --layers, --hidden, --heads and --vocab",
                            preset_names()
                        ),
                    ));
                }
                let missing: Vec<&str> = dims[..4]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(f, _)| *f)
                    .collect();
                return Err(flag_error(
                    missing[0],
                    format!(
                        "raw dimensions need --layers, --hidden, --heads and --vocab; add {}",
                        missing.join(", ")
                    ),
                ));
            };
            let mut arch = Architecture::gpt(layers, hidden, heads, vocab);
            arch.kv_heads = args.kv_heads.unwrap_or(heads);
            arch.ffn = args.ffn.unwrap_or(arch.ffn);
            let params = arch.exact_params().map_err(as_flag)?;
            Ok(Subject {
                name: None,
                title: describe(&arch),
                params,
                arch: Some(arch),
                default_seq_len: 4096,
            })
        }
    }
}

/// `1234567` as `1,234,567`.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// The attention path, the loss path and the fused loss's chunk of trainkit's exact
/// figures.
type Paths = (
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

const STATE: [MemoryCategory; 4] = [
    MemoryCategory::Weights,
    MemoryCategory::MasterWeights,
    MemoryCategory::Gradients,
    MemoryCategory::OptimizerState,
];

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
    let subject = subject(&args)?;
    if args.plot.is_some() && subject.arch.is_none() {
        return Err(flag_error(
            "--plot",
            "activations need the model's dimensions; use --model NAME or --layers, --hidden, \
             --heads and --vocab instead of --params",
        ));
    }
    let seq_len = args.seq_len.unwrap_or(subject.default_seq_len);
    let state = model_state_bytes(subject.params, precision, optimizer).map_err(as_flag)?;
    let state_total: u64 = STATE.iter().map(|&c| state.get(c)).sum();
    let shape = subject
        .arch
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
        .arch
        .map(|a| a.playbook_params().map_err(as_flag))
        .transpose()?;

    let paths = (t.attention, t.loss, t.loss_chunk);
    let lora = lora(&args, &subject, seq_len)?;
    let adapter = lora
        .as_ref()
        .map(|l| l as &(dyn trainkit::Adapter + 'static));
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
        let arch = exact_arch(&subject, seq_len).ok_or_else(|| {
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
            adapter,
            // The table shows LoRA, QLoRA and pure bf16 too (autofit uses them only when
            // named).
            techniques: trainkit::estimate::Techniques::ALL
                .with(trainkit::estimate::Technique::Lora)
                .with(trainkit::estimate::Technique::Qlora)
                .with(trainkit::estimate::Technique::PureBf16),
            ..FitRequest::new(
                arch,
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

    if args.json {
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
        let a = subject.arch;
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
        let out = serde_json::json!({
            "model": subject.name,
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
        return Ok(());
    }

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
        return Ok(());
    }
    println!();
    println!(
        "{:<16} {:>11} {:>12} {:>12}",
        "category", "bytes/param", "GiB", "GB"
    );
    let per_param = trainkit::estimate::bytes_per_param(precision, optimizer);
    for c in STATE {
        println!(
            "{:<16} {:>11} {:>12} {:>12}",
            c.name(),
            per_param.get(c),
            gib(state.get(c)),
            gb(state.get(c))
        );
    }
    let per_param_total: u64 = STATE.iter().map(|&c| per_param.get(c)).sum();
    println!(
        "{:<16} {:>11} {:>12} {:>12}",
        "model state",
        per_param_total,
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
                "  host memory {} GiB at its peak (the offloaded category)",
                gib(p.host_bytes())
            );
        }
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
    if subject.arch.is_some_and(|a| !a.is_gpt_like()) {
        println!(
            "note: the activation formula is for the playbook's GPT-style layer (multi-head \
             attention, a 4h GELU MLP); for this model it is an approximation"
        );
    }
    Ok(())
}

/// The parameters of the model `subject` builds with `adapter` that train, and all of
/// them.
fn trainable_params(
    subject: &Subject,
    seq_len: u64,
    paths: Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
) -> Result<(u64, u64)> {
    let model = exact_model(subject, seq_len, paths, adapter)?
        .ok_or_else(|| flag_error("--seq-len", "exceeds the model's context"))?;
    let params = model.init_params();
    let count = |trains: bool| {
        params
            .iter()
            .filter(|p| trains || !p.trains)
            .map(|p| p.numel() as u64)
            .sum::<u64>()
    };
    let all = count(true);
    Ok((all - count(false), all))
}

/// The model trainkit's exact figures run for `subject` at `seq_len`, with `adapter`:
/// `None` for architectures trainkit does not build (the formulas alone describe them).
fn exact_model(
    subject: &Subject,
    seq_len: u64,
    (attention, loss, loss_chunk): Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
) -> Result<Option<Box<dyn trainkit::Model>>> {
    let Some(arch) = exact_arch(subject, seq_len) else {
        return Ok(None);
    };
    let context = usize::try_from(seq_len).unwrap_or(usize::MAX);
    let Ok(model) = trainkit::model::build_with(&arch, context, attention, loss, loss_chunk) else {
        return Ok(None);
    };
    match adapter {
        Some(a) => model
            .with_adapter(std::sync::Arc::from(dyn_clone::clone_box(a)))
            .map(Some)
            .map_err(|e| {
                let flag = trainkit::config::lora_flag(&e);
                e.for_field(flag)
            }),
        None => Ok(Some(model)),
    }
}

/// trainkit's exact figures as the table of a run (a LoRA's): each category's peak, the
/// peak total on the device, and what offloading moves to the host.
fn print_exact_table(
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
        if b > 0 && c != MemoryCategory::Offloaded {
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
            if optimizer_offload {
                " (the optimizer's side)"
            } else {
                " (offloaded activations)"
            }
        );
    }
    if let Some(k) = kept {
        println!(
            "offloading the activations saves {} GiB of device memory (peak {} GiB without it)",
            gib(k.peak_total.saturating_sub(p.peak_total)),
            gib(k.peak_total),
        );
    }
}

/// `1.25` GiB, `-0.50` when it costs memory.
fn signed_gib(baseline: u64, peak: u64) -> String {
    format!(
        "{:.2}",
        (baseline as f64 - peak as f64) / (1u64 << 30) as f64
    )
}

/// The table of what each technique saves.
fn print_savings(s: &TechniqueSavings) {
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
fn candidate_json(baseline: u64, c: &FitCandidate) -> serde_json::Value {
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
fn savings_json(s: &TechniqueSavings) -> serde_json::Value {
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

/// The architecture trainkit's exact figures build for `subject` at `seq_len` (raw GPT-style
/// dimensions get a position table of `seq_len` rows), `None` without dimensions or when
/// the sequence exceeds a GPT-2 preset's context.
fn exact_arch(subject: &Subject, seq_len: u64) -> Option<Architecture> {
    let a = subject.arch?;
    // Rotary models (Llama) have no position table: any length up to the context.
    let rotary = a.positions == 0 && a.norm == trainkit::model::Norm::RmsNorm;
    let positions = if subject.name.is_some() || rotary {
        a.positions
    } else {
        seq_len
    };
    if seq_len > positions && !rotary {
        return None;
    }
    Some(Architecture { positions, ..a })
}

/// The LoRA the `--lora-*` flags describe, if any: α defaults to twice the rank, the
/// targets to PEFT's for the model trainkit builds for `subject` at `seq_len`.
fn lora(args: &MemoryArgs, subject: &Subject, seq_len: u64) -> Result<Option<trainkit::Lora>> {
    let context = usize::try_from(seq_len).unwrap_or(usize::MAX);
    let modules = exact_arch(subject, seq_len)
        .and_then(|a| trainkit::model::families::from_architecture(&a, context).ok())
        .map(|m| m.family().projection_modules())
        .unwrap_or_default();
    args.lora.lora(None, &modules)
}

/// trainkit's exact memory for the models it builds (GPT-2 shaped presets, or GPT-style raw
/// dimensions), `None` for others or when the sequence exceeds a preset's context.
#[allow(clippy::too_many_arguments)]
fn trainkit_exact(
    subject: &Subject,
    seq_len: u64,
    batch_size: u64,
    precision: &dyn trainkit::Precision,
    recompute: &dyn trainkit::CheckpointPolicy,
    optimizer: &dyn trainkit::Optimizer,
    optimizer_in_backward: bool,
    offload_activations: bool,
    optimizer_offload: bool,
    (attention, loss, loss_chunk): Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
) -> Result<Option<MemoryPrediction>> {
    let Some(model) = exact_model(subject, seq_len, (attention, loss, loss_chunk), adapter)? else {
        return Ok(None);
    };
    let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let mut options = if optimizer_in_backward {
        trainkit::TrainerOptions {
            grad_clip: 0.0,
            optimizer_in_backward: true,
            ..trainkit::TrainerOptions::default()
        }
    } else {
        trainkit::TrainerOptions::default()
    };
    options.offload_activations = offload_activations;
    options.optimizer_offload = optimizer_offload;
    trainkit::estimate::predict_with(
        model,
        MicroBatch {
            batch_size: usize_of(batch_size),
            seq_len: usize_of(seq_len),
        },
        precision,
        recompute,
        optimizer,
        &options,
    )
    .map(Some)
    .map_err(as_flag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts() {
        for (text, want) in [
            ("7B", 7_000_000_000),
            ("7b", 7_000_000_000),
            ("1.5B", 1_500_000_000),
            ("124M", 124_000_000),
            ("350K", 350_000),
            ("2T", 2_000_000_000_000),
            ("0.5T", 500_000_000_000),
            ("124439808", 124_439_808),
            ("124_439_808", 124_439_808),
            (" 70B ", 70_000_000_000),
        ] {
            assert_eq!(parse_count(text).unwrap(), want, "{text}");
        }
        for text in [
            "",
            "B",
            "7X",
            "7.B.",
            "-1B",
            "1e9",
            "0",
            "0B",
            "1.0000000001K",
        ] {
            assert!(parse_count(text).is_err(), "{text}");
        }
        assert!(parse_count("99999999999T").is_err());
        assert!(parse_count("18446744073709551616").is_err());
    }

    #[test]
    fn grouping() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(124_439_808), "124,439,808");
    }
}
