//! `trainkit train`'s memory flags: the budget, autofit, the out-of-memory advice and
//! the memory report.

use std::path::{Path, PathBuf};
use trainkit::config::Overrides;
use trainkit::config::RunConfig;
use trainkit::estimate::{
    autofit, host_available_memory, FitRequest, MicroBatch, Technique, Techniques,
};
use trainkit::memory::{format_bytes, CategoryBytes, MemoryCategory};
use trainkit::{Constant, Device, Error, Result};

/// `--autofit`, `--autofit-techniques`, `--memory-budget`, `--global-batch` and
/// `--memory-report`.
#[derive(clap::Args)]
pub struct FitArgs {
    /// Choose the cheapest setup that fits the memory budget (--memory-budget, else the
    /// device's free memory) for the global batch: --batch-size and --grad-accum, then in
    /// cost order --recompute, 8-bit AdamW state, the optimizer inside backward,
    /// --offload-activations, the optimizer on the host (--optimizer-offload) and bf16; a
    /// flag given on the command line stays as given.
    #[arg(long)]
    pub autofit: bool,
    /// The techniques --autofit may use: all (the default), or a comma-separated list of
    /// accumulation, selective, adamw8bit, optimizer-in-backward, budget, full, offload,
    /// optimizer-offload, bf16; pure-bf16, lora or qlora, which change how updates land
    /// or what is trained, are used only when named (all,qlora).
    #[arg(long, value_name = "LIST")]
    pub autofit_techniques: Option<String>,
    /// Memory the run may use, e.g. 24GiB or 512MB: autofit's budget; on the CPU also a
    /// hard cap (an allocation beyond it fails and says what would fit).
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// Rows per optimizer step that --autofit keeps (default: --batch-size × --grad-accum).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Write the measured peak bytes per memory category next to the exact prediction to
    /// this JSON file at the end (under mpirun, rank r > 0 writes FILE.rankR.json: each
    /// rank's own, its ZeRO-1 share included).
    #[arg(long)]
    pub memory_report: Option<PathBuf>,
}

impl FitArgs {
    /// `--memory-budget` in bytes.
    pub fn memory_budget(&self) -> Result<Option<u64>> {
        let Some(text) = &self.memory_budget else {
            return Ok(None);
        };
        trainkit::estimate::parse_bytes(text)
            .map(Some)
            .map_err(|e| match e {
                Error::Config { message, .. } => Error::config("--memory-budget", message),
                other => other,
            })
    }

    /// What autofit may change: `--autofit-techniques` (all by default), less what a
    /// flag on the command line fixes (`--precision`: bf16; `--optimizer`: 8-bit state;
    /// `--recompute`: every recompute policy; `--zero`: the ZeRO stages); offloaded
    /// activations within the host's available memory.
    pub fn scope(&self, flags: &Overrides) -> Result<FitScope> {
        let policy = &flags.policy;
        let mut techniques = match &self.autofit_techniques {
            Some(list) => {
                Techniques::parse(list).map_err(|e| e.for_field("--autofit-techniques"))?
            }
            None => Techniques::ALL,
        };
        if policy.sets_precision() {
            techniques = techniques
                .without(Technique::Bf16)
                .without(Technique::PureBf16);
        }
        if policy.optimizer.is_some() {
            techniques = techniques.without(Technique::Adamw8bit);
        }
        if policy.recompute.is_some() {
            for t in [Technique::Selective, Technique::Budget, Technique::Full] {
                techniques = techniques.without(t);
            }
        }
        if flags.zero.is_some() {
            techniques = techniques
                .without(Technique::Zero1)
                .without(Technique::Zero2);
        }
        Ok(FitScope {
            techniques,
            host_budget: host_available_memory(),
        })
    }

    /// With `--autofit`, the cheapest setup of `cfg` that fits (`--memory-budget`, else
    /// what `device` has free) in `scope`, written into `cfg`; without it, the flags that
    /// only autofit reads are refused.
    pub fn apply(
        &self,
        cfg: &mut RunConfig,
        memory_budget: Option<u64>,
        device: Device,
        scope: FitScope,
    ) -> Result<()> {
        if self.autofit {
            let global = match self.global_batch {
                Some(0) => return Err(Error::config("--global-batch", "must be at least 1 row")),
                Some(g) => g,
                None => cfg.global_batch()?,
            };
            return apply_autofit(cfg, global, budget(memory_budget, device)?, scope);
        }
        for (flag, given) in [
            ("--global-batch", self.global_batch.is_some()),
            ("--autofit-techniques", self.autofit_techniques.is_some()),
        ] {
            if given {
                return Err(Error::config(
                    flag,
                    "applies to --autofit; without --autofit set --batch-size, --grad-accum \
                     and the memory flags yourself",
                ));
            }
        }
        Ok(())
    }
}

/// The budget autofit works to: the flag, else the memory the device has free.
pub fn budget(flag: Option<u64>, device: Device) -> Result<u64> {
    if let Some(b) = flag {
        return Ok(b);
    }
    match device {
        Device::Cpu => host_available_memory().ok_or_else(|| {
            Error::config(
                "--memory-budget",
                "the host does not say how much memory is free; give a budget, e.g. \
                 --memory-budget 8GiB",
            )
        }),
        Device::Cuda(i) => match trainkit::device::cuda::probe::probe_device(i) {
            // The context, cuBLASLt's workspace and the pool's rounding take some of the
            // free memory: keep 5% (at least 512 MiB) aside.
            Ok(info) => Ok(info
                .free_memory
                .saturating_sub((info.free_memory / 20).max(512 << 20))),
            Err(reason) => Err(Error::config(
                "--memory-budget",
                format!(
                    "the GPU's free memory could not be read ({reason}); give a budget, e.g. \
                     --memory-budget 70GiB"
                ),
            )),
        },
    }
}

/// What `trainkit train` lets autofit change: the techniques of `--autofit-techniques`
/// (all by default), less those a flag on the command line fixes.
#[derive(Clone, Copy, Debug)]
pub struct FitScope {
    /// The techniques autofit may use.
    pub techniques: Techniques,
    /// Host memory the setup may take: offloaded activations, and an offloaded optimizer's
    /// master weights and state.
    pub host_budget: Option<u64>,
}

impl FitScope {
    /// The autofit request of the run `cfg` within this scope: `global` rows per step in
    /// `budget` bytes.
    fn request<'a>(&self, cfg: &'a RunConfig, global: usize, budget: u64) -> FitRequest<'a> {
        FitRequest {
            host_budget: self.host_budget,
            ..FitRequest::for_run(cfg, global, budget, self.techniques)
        }
    }
}

/// Chooses the cheapest setup that fits `budget` (micro-batch, accumulation, recompute,
/// 8-bit state, the optimizer inside backward, offloading activations or the optimizer,
/// precision: those `scope` allows), prints the explanation and writes the choice into
/// `cfg`.
pub fn apply_autofit(
    cfg: &mut RunConfig,
    global: usize,
    budget: u64,
    scope: FitScope,
) -> Result<()> {
    let plan = autofit(&scope.request(cfg, global, budget))?;
    for line in plan.explain() {
        println!("{line}");
    }
    let c = plan.choice;
    cfg.training.batch_size = c.micro_batch;
    cfg.accumulation = Box::new(Constant::new(c.micro_batches));
    cfg.checkpoint = c.recompute;
    cfg.precision = c.precision;
    cfg.optimizer = c.optimizer;
    cfg.training.optimizer_in_backward = c.optimizer_in_backward;
    cfg.training.offload_activations = c.offload_activations;
    cfg.optimizer_offload = c.optimizer_offload;
    cfg.training.zero_stage = c.zero_stage;
    if c.stream_weights && trainkit::placement::is_resident(cfg.placement.as_ref()) {
        cfg.placement = trainkit::placement::streaming(c.adapter.is_some());
    }
    if let Some(a) = c.adapter {
        cfg.adapter = Some(dyn_clone::clone_box(&*a));
    }
    cfg.validate()
}

/// The budget a GPU run's out-of-memory advice aims at when no `--memory-budget` was
/// given: the device's total memory less the 5% (at least 512 MiB) the context, cuBLASLt
/// and the pool take. `None` on the CPU or when the GPU cannot be read.
pub fn device_budget(device: Device) -> Option<u64> {
    match device {
        Device::Cpu => None,
        Device::Cuda(i) => trainkit::device::cuda::probe::probe_device(i)
            .ok()
            .map(|info| {
                info.total_memory
                    .saturating_sub((info.total_memory / 20).max(512 << 20))
            }),
    }
}

/// An out-of-memory error with what would fit the budget appended.
pub fn explain_oom(err: Error, cfg: &RunConfig, budget: Option<u64>, scope: FitScope) -> Error {
    let (Error::OutOfMemory { message }, Some(budget)) = (&err, budget) else {
        return err;
    };
    let advice = match cfg
        .global_batch()
        .and_then(|g| autofit(&scope.request(cfg, g, budget)))
    {
        Ok(plan) => {
            let c = plan.choice;
            format!(
                "what would fit: {} (peak {}), or pass --autofit",
                c.flags(),
                format_bytes(c.peak)
            )
        }
        Err(Error::OutOfMemory { message }) => message,
        Err(_) => return err,
    };
    Error::OutOfMemory {
        message: format!("{message}; {advice}"),
    }
}

fn by_category(bytes: &CategoryBytes) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = MemoryCategory::ALL
        .iter()
        .map(|c| (c.name().to_string(), bytes.get(*c).into()))
        .collect();
    serde_json::Value::Object(map)
}

/// Where rank `rank` writes its memory report: `path` for rank 0, else `path` with
/// `.rank{rank}` before its extension (`report.json` → `report.rank1.json`).
pub fn rank_report_path(path: &Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// Writes `{"measured": {...}, "predicted": {...}}`: per-category peaks of the run next
/// to the exact model's, plus the total peaks; in a data-parallel job, those of rank
/// `rank` of `world` (its share of the optimizer state under ZeRO-1).
pub fn write_report(
    path: &Path,
    cfg: &RunConfig,
    (rank, world): (usize, usize),
    measured: &CategoryBytes,
    measured_total: u64,
) -> Result<()> {
    let t = &cfg.training;
    let options = trainkit::TrainerOptions::from(cfg);
    let prediction = trainkit::estimate::predict_rank(
        cfg.build_model()?,
        MicroBatch {
            batch_size: t.batch_size,
            seq_len: t.seq_len,
        },
        cfg.precision.as_ref(),
        cfg.checkpoint.as_ref(),
        cfg.optimizer.as_ref(),
        &options,
        trainkit::collective::Rehearsal::new(rank, world)?,
    )?;
    let k = cfg.global_batch()? / t.batch_size;
    let report = serde_json::json!({
        "measured": by_category(measured),
        "predicted": by_category(&prediction.peak),
        "peak_total": {
            "measured": measured_total,
            "predicted": prediction.peak_total.max(prediction.first_step_peak_total(k)),
        },
        "activation_peak_phase": prediction.activations.peak_phase.map(|p| p.to_string()),
        "rank": rank,
        "world": world,
    });
    let text = serde_json::to_string_pretty(&report).map_err(|e| Error::Serde(e.to_string()))?;
    trainkit::save::write_atomically(path, text.as_bytes())?;
    Ok(())
}
