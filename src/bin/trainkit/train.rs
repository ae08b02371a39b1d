//! `trainkit train`.

use crate::fit;
use crate::progress::Progress;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use trainkit::config::{Resolved, RunConfig, RunFlags};
use trainkit::data::{
    DataLoader, HfTokenizer, TokenizerKind, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
};
use trainkit::memory::CategoryBytes;
use trainkit::model::read_model_dir;
use trainkit::{
    Error, MemoryObserver, Model, Observers, Result, Timeline, Trainer, TrainerOptions,
};

/// Train a model. Flags override the config file (or, with --resume, the config saved
/// in the checkpoint).
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct TrainArgs {
    /// The config, and the flags laid over it.
    #[command(flatten)]
    run: RunFlags,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Choose the cheapest setup that fits the memory budget (--memory-budget, else the
    /// device's free memory) for the global batch: --batch-size and --grad-accum, then in
    /// cost order --recompute, 8-bit AdamW state, the optimizer inside backward,
    /// --offload-activations, the optimizer on the host (--optimizer-offload) and bf16; a
    /// flag given on the command line stays as given.
    #[arg(long)]
    autofit: bool,
    /// The techniques --autofit may use: all (the default), or a comma-separated list of
    /// accumulation, selective, adamw8bit, optimizer-in-backward, budget, full, offload,
    /// optimizer-offload, bf16; pure-bf16, lora or qlora, which change how updates land
    /// or what is trained, are used only when named (all,qlora).
    #[arg(long, value_name = "LIST")]
    autofit_techniques: Option<String>,
    /// Memory the run may use, e.g. 24GiB or 512MB: autofit's budget; on the CPU also a
    /// hard cap (an allocation beyond it fails and says what would fit).
    #[arg(long)]
    memory_budget: Option<String>,
    /// Rows per optimizer step that --autofit keeps (default: --batch-size × --grad-accum).
    #[arg(long)]
    global_batch: Option<usize>,
    /// Write the measured peak bytes per memory category next to the exact prediction to
    /// this JSON file at the end.
    #[arg(long)]
    memory_report: Option<PathBuf>,
    /// The device's peak TFLOP/s in the compute dtype, for MFU and HFU in the log
    /// (e.g. 989 for an H100 SXM in bf16); without it a GPU of trainkit's table uses its
    /// datasheet figure, and elsewhere only achieved FLOP/s are shown.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Record memory and op timings of the first --timeline-steps steps and write
    /// memory.svg, memory_viz.pickle, memory.jsonl and trace.json into this directory.
    #[arg(long, value_name = "DIR")]
    timeline: Option<PathBuf>,
    /// Optimizer steps the --timeline records.
    #[arg(long, value_name = "N", default_value_t = Timeline::DEFAULT_STEPS)]
    timeline_steps: u64,
    /// At the end, print where the time of the steps after the first went, op by op
    /// (time, share, calls, GFLOP/s). On a GPU every op then waits for the device, so each
    /// op's time is the device's, and steps run slower.
    #[arg(long)]
    profile_ops: bool,
}

impl TrainArgs {
    /// The `--device` flag.
    pub fn device(&self) -> &str {
        &self.device
    }
}

/// The learning rate's course and the optimizer's settings, in one line:
/// `learning rate 0.0002, warmup 3 steps, cosine to 0 at step 100; beta1 0.9, ...`.
fn schedule_line(cfg: &RunConfig) -> Result<String> {
    let t = &cfg.training;
    let base = cfg.optimizer.learning_rate();
    let course = match t.lr_schedule {
        trainkit::optim::LrSchedule::Constant { .. } => "then constant".to_string(),
        trainkit::optim::LrSchedule::Cosine {
            decay_steps,
            min_lr_ratio,
            ..
        } => format!(
            "cosine to {min_lr_ratio}× at step {}",
            if decay_steps == 0 {
                t.steps
            } else {
                decay_steps
            }
        ),
    };
    let settings = serde_json::to_value(&cfg.optimizer).map_err(|e| Error::Serde(e.to_string()))?;
    let named: Vec<String> = ["beta1", "beta2", "eps", "weight_decay", "momentum"]
        .iter()
        .filter_map(|k| {
            Some(format!(
                "{k} {}",
                number(settings.get(*k)?.as_f64()? as f32)
            ))
        })
        .collect();
    Ok(format!(
        "learning rate {}, warmup {} steps, {course}; {} {}",
        number(base),
        t.lr_schedule.warmup_steps(),
        kind(&cfg.optimizer)?,
        named.join(", ")
    ))
}

/// The peak FLOP/s of the GPU `backend` runs on in the run's compute dtype (bf16 and fp16
/// on tensor cores, f32 on the CUDA cores), from trainkit's table of datasheet figures,
/// announced with how to change it; `None` on the CPU or an unknown GPU (then
/// `--peak-tflops` gives MFU).
fn device_peak(backend: &dyn trainkit::Backend, cfg: &RunConfig) -> Option<f64> {
    if backend.device() == trainkit::Device::Cpu {
        return None;
    }
    let dtype = trainkit::estimate::MathDtype::of_compute(cfg.precision.compute_dtype());
    let name = backend.describe();
    let gpu = trainkit::estimate::gpu_peak(&name)?;
    let peak = gpu.get(dtype)?;
    println!(
        "MFU against the {} peak of {:.1} TFLOP/s ({dtype:?}, dense; --peak-tflops sets another)",
        gpu.name,
        peak / 1e12
    );
    Some(peak)
}

/// `x` as a person writes it: `2e-5`, `0.999`, `0`.
fn number(x: f32) -> String {
    if x != 0.0 && x.abs() < 1e-3 {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// A training run, resolved: its config (autofit applied), device and limits.
struct Plan {
    cfg: RunConfig,
    memory_budget: Option<u64>,
    device: trainkit::Device,
    scope: fit::FitScope,
    peak_flops: Option<f64>,
    /// What the fine-tuning defaults set, when they applied.
    defaults: Option<String>,
}

/// A trainer of a run config's boxed policies.
type RunTrainer = Trainer<
    Box<dyn trainkit::Precision>,
    Box<dyn trainkit::CheckpointPolicy>,
    Box<dyn trainkit::Optimizer>,
    Box<dyn trainkit::AccumulationSchedule>,
    Box<dyn MemoryObserver>,
>;

/// A run, built: the trainer on its backend, the validation data, what the data says
/// about itself, and the optional op profile and timeline.
struct Job {
    plan: Plan,
    backend: Arc<dyn trainkit::Backend>,
    trainer: RunTrainer,
    val: DataLoader,
    entropy_floor: Option<f64>,
    /// Whether the data is rows with a loss mask (`prepare --chat`).
    chat_data: bool,
    data_tokenizer: TokenizerKind,
    profile: Option<SharedOpProfile>,
    timeline_steps: Option<u64>,
    run_config: String,
}

/// How the loop ended.
enum Ended {
    /// Every step ran: the first and last training losses and the step peaks.
    Done {
        first_loss: Option<f64>,
        last_loss: f64,
        peaks: CategoryBytes,
        peak_total: u64,
        profiled: Option<(trainkit::memory::OpProfile, std::time::Instant)>,
    },
    /// Interrupted and saved.
    Interrupted,
}

pub fn run(args: Box<TrainArgs>) -> Result<()> {
    // First of all: an interrupt while the model and data are still being built must
    // not kill the process without a word; the loop sees it and saves after one step.
    let interrupted = interrupt_flag();
    let plan = plan(&args)?;
    if args.print_config {
        print!("{}", plan.cfg.to_toml()?);
        return Ok(());
    }
    let mut job = build(&args, plan)?;
    if nothing_to_train(&args, &job)? {
        return Ok(());
    }
    match train_loop(&mut job, &interrupted)? {
        Ended::Interrupted => Ok(()),
        done => finish(&args, &mut job, done),
    }
}

/// The run config with the flags laid over it, autofit applied, and the device, budget,
/// autofit scope and peak FLOP/s the flags give.
fn plan(args: &TrainArgs) -> Result<Plan> {
    let Resolved {
        config: mut cfg,
        defaults,
    } = args.run.resolve()?;
    let memory_budget = match &args.memory_budget {
        Some(text) => Some(trainkit::estimate::parse_bytes(text).map_err(|e| match e {
            Error::Config { message, .. } => Error::config("--memory-budget", message),
            other => other,
        })?),
        None => None,
    };
    let device = crate::device(args.device())?;
    let scope = fit_scope(args)?;
    if args.autofit {
        let global = match args.global_batch {
            Some(0) => return Err(Error::config("--global-batch", "must be at least 1 row")),
            Some(g) => g,
            None => cfg.global_batch()?,
        };
        let budget = fit::budget(memory_budget, device)?;
        fit::apply_autofit(&mut cfg, global, budget, scope)?;
    } else {
        for (flag, given) in [
            ("--global-batch", args.global_batch.is_some()),
            ("--autofit-techniques", args.autofit_techniques.is_some()),
        ] {
            if given {
                return Err(Error::config(
                    flag,
                    "applies to --autofit; without --autofit set --batch-size, --grad-accum \
                     and the memory flags yourself",
                ));
            }
        }
    }
    let peak_flops = match args.peak_tflops {
        Some(p) if !(p.is_finite() && p > 0.0) => {
            return Err(Error::config(
                "--peak-tflops",
                format!("{p} is not a positive number of TFLOP/s (e.g. 989 for an H100 SXM)"),
            ))
        }
        p => p.map(|p| p * 1e12),
    };
    Ok(Plan {
        cfg,
        memory_budget,
        device,
        scope,
        peak_flops,
        defaults,
    })
}

/// The backend, the data, the model and the trainer of `plan` (resumed or started from
/// a model directory when asked), announced on stdout.
fn build(args: &TrainArgs, plan: Plan) -> Result<Job> {
    let (cfg, device) = (&plan.cfg, plan.device);
    let backend = device.backend()?;
    if device == trainkit::Device::Cpu {
        if let Some(path) = trainkit::Blas::path_from_env() {
            println!(
                "CPU matrix products: the CBLAS library {} (${})",
                path.display(),
                trainkit::device::BLAS_ENV
            );
        }
    }
    if let Some(budget) = plan.memory_budget {
        backend.ledger().set_limit(Some(budget));
    }
    let t = cfg.training.clone();
    let corpus = cfg.data.load(t.seq_len + 1, cfg.model.vocab_size())?;
    let chat_data = corpus.train.shards().iter().any(|s| s.row_len().is_some());
    let data = DataLoader::new(corpus.train, t.batch_size, t.seq_len)?
        .shuffled(corpus.shuffle.then_some(t.seed))
        .separated_by(corpus.separator);
    let val = DataLoader::new(corpus.val, t.batch_size, t.seq_len)?.separated_by(corpus.separator);
    let model = cfg.build_model()?;
    println!("model: {}", model.describe());
    println!("data: {}", corpus.description);
    let device = match device {
        trainkit::Device::Cpu => device.to_string(),
        _ => format!("{device} ({})", backend.describe()),
    };
    println!(
        "device: {device}; precision {}{}; recompute {}{}; optimizer {}{}; {} micro-batch rows × \
         {} tokens",
        kind(&cfg.precision)?,
        match cfg.precision.update_rounding() {
            Some(r) => format!(" (no master copy, {r} update rounding)"),
            None => String::new(),
        },
        trainkit::estimate::policy_name(cfg.checkpoint.as_ref()),
        if t.offload_activations {
            ", kept activations offloaded to host memory"
        } else {
            ""
        },
        kind(&cfg.optimizer)?,
        match (t.optimizer_in_backward, cfg.optimizer_offload) {
            (true, true) =>
                " inside backward, on the host (master weights and state in host memory)",
            (true, false) => " inside backward",
            (false, true) => " on the host (master weights and state in host memory)",
            (false, false) => "",
        },
        t.batch_size,
        t.seq_len
    );
    if let Some(floor) = corpus.entropy_floor {
        println!(
            "data: built-in corpus, entropy floor {floor:.4} nats/byte (no model can beat it); \
             uniform guessing is {:.4}",
            (cfg.model.vocab_size() as f64).ln()
        );
    }
    let peak_flops = plan
        .peak_flops
        .or_else(|| device_peak(backend.as_ref(), cfg));
    let (observer, timeline_steps) = observer(cfg, args)?;
    let profile = args.profile_ops.then(SharedOpProfile::default);
    let observer: Box<dyn MemoryObserver> = match &profile {
        Some(p) => Box::new(Observers {
            observers: vec![observer, Box::new(p.clone())],
        }),
        None => observer,
    };
    let mut trainer = Trainer::new(
        model,
        Arc::clone(&backend),
        data,
        cfg.precision.clone(),
        cfg.checkpoint.clone(),
        cfg.optimizer.clone(),
        cfg.accumulation.clone(),
        observer,
        TrainerOptions {
            peak_flops,
            ..TrainerOptions::from(cfg)
        },
    )?;
    let adapted = cfg.adapter.is_some();
    trainer.set_adapter_base(t.init_from.as_ref().map(|d| d.display().to_string()));
    if let Some(dir) = &args.run.resume {
        // A LoRA checkpoint holds the adapter alone: the base comes from where it came.
        if let (true, Some(base)) = (adapted, &t.init_from) {
            trainer.load_weights(&read_model_dir(base)?)?;
        }
        trainer.resume_from(dir)?;
        println!("resumed {} at step {}", dir.display(), trainer.steps_done());
    } else if let Some(dir) = &t.init_from {
        trainer.load_weights(&read_model_dir(dir)?)?;
        println!("weights from {}", dir.display());
        if let Some(adapter) = &args.run.adapter {
            trainer.load_adapter(adapter)?;
            println!("adapter from {}", adapter.display());
        }
    }
    if let Some(lora) = cfg.adapter.as_ref().and_then(|a| a.as_lora()) {
        let trained: usize = trainer
            .params()
            .iter()
            .filter(|p| p.trains())
            .map(|p| p.numel())
            .sum();
        let all: usize = trainer.params().iter().map(|p| p.numel()).sum();
        let kind = match lora.base {
            trainkit::adapter::BaseWeights::Nf4 => "QLoRA (NF4 base)",
            trainkit::adapter::BaseWeights::Compute => "LoRA",
        };
        let dropout = if lora.dropout > 0.0 {
            format!(", dropout {}", lora.dropout)
        } else {
            String::new()
        };
        println!(
            "adapter: {kind} rank {}, α {} on {}{dropout}: {trained} of {all} parameters train \
             ({:.2}%)",
            lora.rank,
            lora.alpha,
            lora.targets.join(", "),
            100.0 * trained as f64 / all as f64
        );
    }
    if let Some(line) = &plan.defaults {
        println!("{line}");
    }
    println!("{}", schedule_line(cfg)?);
    // Among the run's first lines (stdout): stderr stays the one line of an error.
    if let Some(w) = cfg.warmup_warning() {
        println!("warning: {w}");
    }
    let run_config = cfg.to_toml()?;
    Ok(Job {
        backend,
        trainer,
        val,
        entropy_floor: corpus.entropy_floor,
        chat_data,
        data_tokenizer: corpus.tokenizer,
        profile,
        timeline_steps,
        run_config,
        plan,
    })
}

impl Job {
    /// Whether a save writes a LoRA adapter (PEFT's files) rather than the model.
    fn saves_adapter(&self) -> bool {
        let cfg = &self.plan.cfg;
        cfg.adapter.as_ref().and_then(|a| a.as_lora()).is_some()
    }

    /// What a save writes beside the trainer state.
    fn saves(&self) -> &'static str {
        if self.saves_adapter() {
            "the LoRA adapter (PEFT's files)"
        } else {
            "model"
        }
    }

    /// Saves the model, the trainer state, the run config and the tokenizer to `dir`.
    fn save(&self, dir: &Path) -> Result<()> {
        self.trainer.save(dir, Some(&self.run_config))?;
        copy_tokenizer(&self.plan.cfg.data.tokenizer(), dir);
        // A full model keeps its base's generation settings (`generate()` reads them), as
        // `merge` keeps them; an adapter's directory holds the adapter alone.
        if let (Some(base), false) = (&self.plan.cfg.training.init_from, self.saves_adapter()) {
            let name = trainkit::save::GENERATION_CONFIG_FILE;
            copy_files(dir, [(base.join(name), name)]);
        }
        Ok(())
    }
}

/// When the run already reached its last step: says so (writing the initialised model
/// for `--steps 0 --out DIR`) and returns true.
fn nothing_to_train(args: &TrainArgs, job: &Job) -> Result<bool> {
    let steps = job.plan.cfg.training.steps;
    if job.trainer.steps_done() < steps {
        return Ok(false);
    }
    println!(
        "at step {} of {steps}: nothing to train (raise --steps to go on)",
        job.trainer.steps_done(),
    );
    if let (Some(dir), None) = (&job.plan.cfg.output.out, &args.run.resume) {
        job.save(dir)?;
        println!(
            "saved {} and trainer state to {}",
            job.saves(),
            dir.display()
        );
    }
    Ok(true)
}

/// The steps: progress, periodic evaluation and saves; an interrupt saves and stops, an
/// out-of-memory error is explained, a divergence saves the last good state.
fn train_loop(job: &mut Job, interrupted: &AtomicUsize) -> Result<Ended> {
    let (device, t) = (job.plan.device, job.plan.cfg.training.clone());
    let out = job.plan.cfg.output.out.clone();
    // A GPU queues work without waiting, so its op spans would time the launches: while
    // the timeline records, every op waits for the device at both ends, and trace.json
    // shows each op's device time. The steps after it run unsynchronized.
    let mut fenced_until = None;
    let backend = Arc::clone(&job.backend);
    if job.profile.is_some() && device != trainkit::Device::Cpu {
        backend
            .ledger()
            .set_op_fence(Some(trainkit::device::op_fence(&backend)));
        println!("--profile-ops: every op waits for the device (slower steps)");
    } else if let (Some(n), true) = (job.timeline_steps, device != trainkit::Device::Cpu) {
        backend
            .ledger()
            .set_op_fence(Some(trainkit::device::op_fence(&backend)));
        fenced_until = Some(job.trainer.steps_done() + n);
        println!("timeline: each op of the recorded steps waits for the device (slower steps)");
    }
    let mut progress = Progress::new(
        job.trainer.steps_done(),
        t.steps,
        job.plan.cfg.output.log_json.as_deref(),
    )?;
    let mut first_loss = None;
    let mut last_loss = f64::NAN;
    let mut peaks = CategoryBytes::default();
    let mut peak_total = 0;
    // The op profile leaves the first step out (kernel compilation, first allocations).
    let mut profiled: Option<(trainkit::memory::OpProfile, std::time::Instant)> = None;
    while job.trainer.steps_done() < t.steps {
        let s = match job.trainer.step() {
            Ok(s) => s,
            Err(e @ Error::OutOfMemory { .. }) => {
                progress.finish();
                let budget = job
                    .plan
                    .memory_budget
                    .or_else(|| fit::device_budget(device));
                return Err(fit::explain_oom(e, &job.plan.cfg, budget, job.plan.scope));
            }
            Err(e @ Error::Diverged { .. }) => {
                progress.finish();
                // Skipped steps leave the weights untouched: this is the last good state.
                let dir = out.clone().unwrap_or_else(|| fallback_dir("diverged"));
                job.save(&dir)?;
                eprintln!(
                    "saved the last good state (step {}) to {}",
                    job.trainer.steps_done() - job.trainer.bad_streak(),
                    dir.display()
                );
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        if fenced_until.is_some_and(|until| job.trainer.steps_done() >= until) {
            backend.ledger().set_op_fence(None);
            fenced_until = None;
        }
        if let (Some(p), None) = (&job.profile, &profiled) {
            profiled = Some((p.snapshot(), std::time::Instant::now()));
        }
        first_loss.get_or_insert(s.loss);
        last_loss = s.loss;
        peaks.max_with(&s.memory.peak);
        peak_total = peak_total.max(s.memory.peak_total);
        progress.step(&s)?;
        if interrupted.load(Ordering::SeqCst) > 0 {
            progress.finish();
            let dir = out.clone().unwrap_or_else(|| fallback_dir("interrupted"));
            job.save(&dir)?;
            println!(
                "interrupted after step {}; saved to {}\nresume with: trainkit train --resume {} \
                 --steps {}",
                s.step,
                dir.display(),
                dir.display(),
                t.steps
            );
            return Ok(Ended::Interrupted);
        }
        if t.eval_every > 0 && s.step % t.eval_every == 0 && s.step < t.steps {
            // The same first batches of the validation data each time.
            let v = job.trainer.evaluate_once(&job.val, Some(t.eval_batches))?;
            progress.println(&format!("step {:>5} | val loss {:.4}", s.step, v.loss));
        }
        if let Some(dir) = &out {
            let every = job.plan.cfg.output.save_every;
            if every > 0 && s.step % every == 0 && s.step < t.steps {
                job.save(dir)?;
                progress.println(&format!("step {:>5} | saved {}", s.step, dir.display()));
            }
        }
    }
    progress.finish();
    Ok(Ended::Done {
        first_loss,
        last_loss,
        peaks,
        peak_total,
        profiled,
    })
}

/// After the last step: the op profile, the memory report, the final losses, the save
/// and what to run next.
fn finish(args: &TrainArgs, job: &mut Job, ended: Ended) -> Result<()> {
    let Ended::Done {
        first_loss,
        last_loss,
        peaks,
        peak_total,
        profiled,
    } = ended
    else {
        return Ok(());
    };
    let t = job.plan.cfg.training.clone();
    if let Some(p) = &job.profile {
        match &profiled {
            Some((first, since)) if job.trainer.steps_done() > 0 => {
                let ops = p.snapshot().since(first);
                if ops.total_micros() == 0 {
                    println!("op profile: one step only (the first is left out); run more steps");
                } else {
                    println!("op profile of the steps after the first:");
                    print!("{}", ops.table(since.elapsed().as_secs_f64()));
                }
            }
            _ => println!("op profile: no step ran"),
        }
    }
    if let Some(path) = &args.memory_report {
        fit::write_report(path, &job.plan.cfg, &peaks, peak_total)?;
        println!("memory report: {}", path.display());
    }
    // The whole validation data once: the figure `trainkit eval` gives on it by default.
    let v = job.trainer.evaluate_once(&job.val, None)?;
    println!(
        "final train loss {last_loss:.4}; final val loss {:.4} (all {} positions of the \
         validation data, once)",
        v.loss, v.counted
    );
    if let (Some(first), Some(floor)) = (first_loss, job.entropy_floor) {
        println!(
            "train loss {first:.4} -> {last_loss:.4}; the floor is {floor:.4} ({:.1}% of the gap closed)",
            100.0 * (first - last_loss) / (first - floor)
        );
    }
    match &job.plan.cfg.output.out {
        Some(dir) => {
            job.save(dir)?;
            println!(
                "saved {} and trainer state to {}",
                job.saves(),
                dir.display()
            );
            // A LoRA run's directory holds the adapter: sampling reads it over its base
            // (one drawn from the seed is nowhere to read).
            let model = match (&job.plan.cfg.training.init_from, job.saves_adapter()) {
                (Some(base), true) => {
                    Some(format!("{} --adapter {}", base.display(), dir.display()))
                }
                (None, true) => None,
                (_, false) => Some(dir.display().to_string()),
            };
            if let Some(model) = model {
                // Chat data (rows with a loss mask) samples a reply to a message, rendered
                // with the tokenizer's template; an NF4 base is quantized as it trained.
                let prompt = match (job.chat_data, &job.data_tokenizer) {
                    (true, _) => "--chat \"Hello!\"",
                    (false, TokenizerKind::Bytes) => "--prompt \"the \"",
                    (false, _) => "--prompt \"Once upon a time\"",
                };
                let nf4 = job
                    .plan
                    .cfg
                    .adapter
                    .as_ref()
                    .is_some_and(|a| a.base_dtype().is_some());
                println!(
                    "sample from it: trainkit sample --model {model}{} {prompt} \
                     --max-new-tokens 200",
                    if nf4 { " --qlora" } else { "" }
                );
            }
            println!(
                "continue it:    trainkit train --resume {} --steps {}",
                dir.display(),
                t.steps * 2
            );
        }
        None => println!("not saved (pass --out DIR to keep the model)"),
    }
    Ok(())
}

/// What autofit may change: `--autofit-techniques` (all by default), less what a flag on
/// the command line fixes (`--precision`: bf16; `--optimizer`: 8-bit state;
/// `--recompute`: every recompute policy); offloaded activations within the host's
/// available memory.
fn fit_scope(args: &TrainArgs) -> Result<fit::FitScope> {
    use trainkit::estimate::{Technique, Techniques};
    let mut techniques = match &args.autofit_techniques {
        Some(list) => Techniques::parse(list).map_err(|e| e.for_field("--autofit-techniques"))?,
        None => Techniques::ALL,
    };
    let policy = &args.run.overrides.policy;
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
    Ok(fit::FitScope {
        techniques,
        host_budget: trainkit::estimate::host_available_memory(),
    })
}

/// Copies a Hugging Face tokenizer (its `tokenizer.json`, and the `tokenizer_config.json`
/// and `chat_template.jinja` beside it if there are) into the model directory `dir`,
/// where `sample` and `eval` look for it. A failure is a warning: the model itself is
/// saved.
fn copy_tokenizer(kind: &TokenizerKind, dir: &Path) {
    let Some(path) = kind.hf_path() else {
        return;
    };
    let file = match HfTokenizer::resolve(path) {
        Ok(file) => file,
        Err(e) => {
            eprintln!(
                "warning: the tokenizer was not copied into {}: {e}",
                dir.display()
            );
            return;
        }
    };
    copy_files(
        dir,
        [
            (file.clone(), TOKENIZER_FILE),
            (
                file.with_file_name(TOKENIZER_CONFIG_FILE),
                TOKENIZER_CONFIG_FILE,
            ),
            (file.with_file_name(CHAT_TEMPLATE_FILE), CHAT_TEMPLATE_FILE),
        ],
    );
}

/// Copies each file `from` that exists into `dir` as `name`; a failure is a warning, as
/// the model itself is saved.
fn copy_files<const N: usize>(dir: &Path, files: [(PathBuf, &str); N]) {
    for (from, name) in files {
        let to = dir.join(name);
        let same = matches!(
            (std::fs::canonicalize(&from), std::fs::canonicalize(&to)),
            (Ok(a), Ok(b)) if a == b
        );
        if from.is_file() && !same {
            if let Err(e) = std::fs::copy(&from, &to) {
                eprintln!(
                    "warning: {} was not copied to {}: {e}",
                    from.display(),
                    to.display()
                );
            }
        }
    }
}

/// An op profile the trainer's observer feeds and the command reads at the end.
#[derive(Clone, Debug, Default, serde::Serialize)]
struct SharedOpProfile {
    #[serde(skip)]
    profile: Arc<std::sync::Mutex<trainkit::memory::OpProfile>>,
}

impl SharedOpProfile {
    /// The profile so far.
    fn snapshot(&self) -> trainkit::memory::OpProfile {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[typetag::serialize(name = "shared_op_profile")]
impl MemoryObserver for SharedOpProfile {
    fn on_event(&mut self, event: &trainkit::memory::MemoryEvent) {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_event(event);
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// The config's observer, joined by a timeline writing into `--timeline DIR`, and the
/// number of steps the timeline records (`None` without one).
fn observer(cfg: &RunConfig, args: &TrainArgs) -> Result<(Box<dyn MemoryObserver>, Option<u64>)> {
    let Some(dir) = &args.timeline else {
        return Ok((cfg.observer.clone(), None));
    };
    // A run shorter than --timeline-steps still writes its files: record the steps it runs.
    let done = args.run.resume.as_deref().map_or(0, resumed_step);
    let steps = match cfg.training.steps.saturating_sub(done) {
        0 => args.timeline_steps,
        to_go => args.timeline_steps.min(to_go),
    };
    let timeline = Timeline::in_dir(dir, steps).map_err(|e| match e {
        Error::Config { message, .. } => Error::config("--timeline-steps", message),
        other => other,
    })?;
    println!(
        "memory timeline: the first {steps} step(s) go to {} (memory.svg; memory_viz.pickle \
         opens at https://pytorch.org/memory_viz, trace.json at https://ui.perfetto.dev)",
        dir.display()
    );
    let observer = Box::new(Observers {
        observers: vec![cfg.observer.clone(), Box::new(timeline)],
    });
    Ok((observer, Some(steps)))
}

/// The step a checkpoint directory was saved at (0 when it cannot tell; resuming then
/// reports what is wrong with the directory).
fn resumed_step(dir: &Path) -> u64 {
    std::fs::read_to_string(dir.join(trainkit::save::STATE_FILE))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
        .unwrap_or(0)
}

/// The `kind` a policy is saved under.
fn kind<T: serde::Serialize + ?Sized>(policy: &T) -> Result<String> {
    let v = serde_json::to_value(policy).map_err(|e| Error::Serde(e.to_string()))?;
    Ok(v.get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("custom")
        .to_string())
}

/// Counts SIGINT / SIGTERM: the first asks the loop to finish its step, save and exit; a
/// second exits at once.
fn interrupt_flag() -> Arc<AtomicUsize> {
    let flag = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&flag);
    let installed = ctrlc::set_handler(move || {
        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
            eprintln!(
                "\ninterrupt: finishing this step, then saving (interrupt again to quit at once, \
                 without saving)"
            );
        } else {
            eprintln!("second interrupt: exiting without saving");
            std::process::exit(130);
        }
    });
    if let Err(e) = installed {
        log::warn!("cannot catch interrupts ({e}); Ctrl-C will stop the run without saving");
    }
    flag
}

/// Where a run without `--out` saves when it has to stop early.
fn fallback_dir(why: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(format!("{why}-{secs}"))
}
