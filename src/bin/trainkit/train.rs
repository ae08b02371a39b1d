//! `trainkit train`.

use crate::progress::Progress;
use crate::{fit, observe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use trainkit::config::{Resolved, RunConfig, RunFlags};
use trainkit::data::{DataLoader, TokenizerKind};
use trainkit::memory::CategoryBytes;
use trainkit::model::read_model_dir;
use trainkit::{Error, Model, Result};

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
    /// What carries a data-parallel job's sums between ranks: auto (NCCL for ranks on
    /// GPUs, MPI for ranks on CPUs), nccl (also for one process, to check that it works)
    /// or mpi.
    #[arg(long, value_enum, default_value = "auto")]
    collective: trainkit::collective::Engine,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// The memory flags: autofit, the budget, the report.
    #[command(flatten)]
    fit: fit::FitArgs,
    /// The flags that observe the run: MFU's peak, the timeline, the op profile.
    #[command(flatten)]
    observe: observe::ObserveArgs,
}

impl TrainArgs {
    /// The `--device` flag.
    pub fn device(&self) -> &str {
        &self.device
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

/// A run, built: the trainer on its backend, the validation data, what the data says
/// about itself, and the optional op profile and timeline.
struct Job {
    plan: Plan,
    backend: Arc<dyn trainkit::Backend>,
    trainer: trainkit::config::ConfigTrainer,
    val: DataLoader,
    entropy_floor: Option<f64>,
    /// Whether the data is rows with a loss mask (`prepare --chat`).
    chat_data: bool,
    data_tokenizer: TokenizerKind,
    profile: Option<trainkit::memory::SharedOpProfile>,
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
    // One of several ranks (`mpirun -np N trainkit train ...`): rank 0 alone prints,
    // logs and saves; a rank that fails ends them all (the others would wait for it).
    let collective = trainkit::collective::launch()?;
    if collective.world() == 1 {
        return run_rank(args, collective, &interrupted);
    }
    if collective.rank() != 0 {
        quiet_stdout();
    }
    let rank = collective.rank();
    match run_rank(args, Arc::clone(&collective), &interrupted) {
        Ok(()) => Ok(()),
        Err(e) => {
            // One write, so that the lines of ranks failing together do not interleave.
            let line = format!("error on rank {rank} of {}: {e}\n", collective.world());
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            collective.abort(1)
        }
    }
}

/// [`run`] as one rank of `collective`.
fn run_rank(
    args: Box<TrainArgs>,
    collective: Arc<dyn trainkit::collective::Collective>,
    interrupted: &AtomicUsize,
) -> Result<()> {
    let plan = plan(&args)?;
    if args.print_config {
        if let Some(epochs) = args.run.overrides.epochs {
            // The steps of the passes are counted once the data is read, at the start.
            println!("# --epochs {epochs}: the run sets training.steps from its data");
        }
        print!("{}", plan.cfg.to_toml()?);
        return Ok(());
    }
    let mut job = build(&args, plan, collective)?;
    if nothing_to_train(&args, &job)? {
        return Ok(());
    }
    match train_loop(&mut job, interrupted)? {
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
    let memory_budget = args.fit.memory_budget()?;
    let device = crate::device(args.device())?;
    let scope = args.fit.scope(&args.run.overrides)?;
    args.fit.apply(&mut cfg, memory_budget, device, scope)?;
    let peak_flops = args.observe.peak_flops()?;
    Ok(Plan {
        cfg,
        memory_budget,
        device,
        scope,
        peak_flops,
        defaults,
    })
}

/// The steps of `epochs` passes over `train` (`--epochs`): each step reads the
/// micro-batches of its accumulation on each of `world` ranks; announced on stdout.
/// Refused for a number that is not positive, and for an accumulation schedule whose
/// micro-batches change from step to step.
fn steps_for_epochs(cfg: &RunConfig, epochs: f64, train: &DataLoader, world: usize) -> Result<u64> {
    if !(epochs > 0.0 && epochs.is_finite()) {
        return Err(trainkit::Error::config(
            "--epochs",
            format!("{epochs} must be a number of passes over the data above 0"),
        ));
    }
    let kind = trainkit::config::policy_kind(&cfg.accumulation)?;
    if kind != "constant" {
        return Err(trainkit::Error::config(
            "--epochs",
            format!(
                "the `{kind}` accumulation schedule changes the micro-batches of a step, so \
                 passes over the data do not make a number of steps; give --steps"
            ),
        ));
    }
    let per_step = cfg.global_batch()? / cfg.training.batch_size.max(1) * world.max(1);
    let per_epoch = train.batches_per_epoch();
    let steps = ((epochs * per_epoch as f64) / per_step as f64)
        .ceil()
        .max(1.0) as u64;
    println!(
        "epochs: {epochs} over {per_epoch} micro-batches of {} × {} tokens, {per_step} a step: \
         {steps} steps",
        train.batch_size(),
        train.seq_len()
    );
    Ok(steps)
}

/// Whether the run's f32 products take TF32 tensor cores (`--tf32`, `training.tf32`): on
/// a GPU as asked; refused on the CPU named by `--device cpu`, which has no TF32; noted
/// and ignored where `--device auto` found no GPU, so that one config serves both.
fn tf32_on(args: &TrainArgs, cfg: &RunConfig, device: trainkit::Device) -> Result<bool> {
    match (cfg.training.tf32, device, args.device()) {
        (false, ..) => Ok(false),
        (true, trainkit::Device::Cuda(_), _) => Ok(true),
        (true, trainkit::Device::Cpu, "cpu") => Err(trainkit::Error::config(
            "--tf32",
            "TF32 is a GPU's tensor-core format, and --device cpu computes f32 products in \
             f32: drop --tf32 (training.tf32 = false) or train on a GPU (--device cuda)",
        )),
        (true, trainkit::Device::Cpu, _) => {
            println!("tf32: no GPU, so the f32 products run in f32 on the CPU");
            Ok(false)
        }
    }
}

/// The backend, the data, the model and the trainer of `plan` (resumed or started from
/// a model directory when asked), announced on stdout.
fn build(
    args: &TrainArgs,
    mut plan: Plan,
    collective: Arc<dyn trainkit::collective::Collective>,
) -> Result<Job> {
    let cfg = &plan.cfg;
    // Rank 0 saves: a place it cannot write is refused before anything is built, not at
    // the first save.
    if let (Some(dir), 0) = (&cfg.output.out, collective.rank()) {
        trainkit::save::check_writable_dir(dir).map_err(|e| {
            trainkit::Error::config(
                "--out",
                format!(
                    "the run could not save there ({e}); give --out a directory in a place \
                     this user can write"
                ),
            )
        })?;
    }
    // Each rank of a data-parallel job takes the GPU of its local rank.
    let device = match plan.device {
        trainkit::Device::Cuda(0) if collective.world() > 1 => {
            trainkit::Device::Cuda(collective.local_rank())
        }
        d => d,
    };
    let options = trainkit::device::cuda::CudaOptions {
        allow_tf32: tf32_on(args, cfg, device)?,
        ..Default::default()
    };
    let backend = device.backend_with(options).map_err(|e| match device {
        trainkit::Device::Cuda(i) if i > 0 => trainkit::Error::config(
            "--device",
            format!(
                "rank {} of {} is local rank {i} on its machine, so it takes GPU {i}: {e} \
                 (start as many ranks per machine as it has GPUs)",
                collective.rank(),
                collective.world()
            ),
        ),
        _ => e,
    })?;
    let collective = trainkit::collective::on_device(collective, &backend, args.collective)?;
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
    let data = cfg.loaders()?;
    if let Some(epochs) = args.run.overrides.epochs {
        plan.cfg.training.steps =
            steps_for_epochs(&plan.cfg, epochs, &data.train, collective.world())?;
    }
    let cfg = &plan.cfg;
    let t = cfg.training.clone();
    let model = cfg.build_model()?;
    println!("model: {}", model.describe());
    println!("data: {}", data.description);
    let device = match device {
        trainkit::Device::Cpu => device.to_string(),
        _ => format!("{device} ({})", backend.describe()),
    };
    println!("device: {device}; {}", cfg.setup_line()?);
    if let Some(floor) = data.entropy_floor {
        println!(
            "data: built-in corpus, entropy floor {floor:.4} nats/byte (no model can beat it); \
             uniform guessing is {:.4}",
            (cfg.model.vocab_size() as f64).ln()
        );
    }
    let peak_flops = plan
        .peak_flops
        .or_else(|| observe::device_peak(backend.as_ref(), cfg));
    let observe::RunObserver {
        observer,
        timeline_steps,
        profile,
    } = args.observe.observer(cfg, args.run.resume.as_deref())?;
    // The parameters start from --init-from's weights (a resumed LoRA run's base too);
    // a resumed full run starts from the checkpoint's own (nothing drawn, and
    // `resume_from` then does not read them again).
    let adapted = cfg.adapter.is_some();
    let weights = match (&t.init_from, &args.run.resume) {
        (Some(base), Some(_)) if adapted => Some(read_model_dir(base)?),
        (_, Some(dir)) if !adapted => Some(read_model_dir(dir)?),
        (Some(dir), None) => Some(read_model_dir(dir)?),
        _ => None,
    };
    let mut trainer = cfg.trainer_from(
        model,
        Arc::clone(&backend),
        data.train,
        observer,
        peak_flops,
        weights,
    )?;
    if collective.world() > 1 {
        let per_rank = cfg.global_batch()?;
        let zero = match t.zero_stage {
            0 => String::new(),
            1 => {
                "; ZeRO-1: each rank keeps and updates its share of the optimizer state".to_string()
            }
            2 => "; ZeRO-2: each rank keeps and updates its share of the optimizer state \
                  and keeps its share of the gradients"
                .to_string(),
            n => format!("; ZeRO stage {n}"),
        };
        println!(
            "data parallel: {} ranks ({}); each rank {per_rank} sequences a step, {} in \
             all{zero}",
            collective.world(),
            collective.describe(),
            per_rank * collective.world()
        );
    }
    if collective.world() == 1 && args.collective == trainkit::collective::Engine::Nccl {
        println!("collective: {}", collective.describe());
    }
    trainer.join(collective)?;
    trainer.set_adapter_base(t.init_from.as_ref().map(|d| d.display().to_string()));
    if let Some(dir) = &args.run.resume {
        // A LoRA checkpoint holds the adapter alone: the base came from where it came
        // (read above).
        trainer.resume_from(dir)?;
        println!("resumed {} at step {}", dir.display(), trainer.steps_done());
        let (saved, world) = (
            trainkit::trainer::checkpoint_ranks(dir)?,
            trainer.collective().world(),
        );
        if saved != world {
            let job = |n: usize| match n {
                1 => "one process".to_string(),
                n => format!("{n} ranks"),
            };
            println!(
                "resharded: saved by {}, resumed by {}; each rank took the optimizer state of \
                 what it updates, and the data goes on from the saved position (the run goes \
                 on as saved when ranks × --grad-accum stays what it was)",
                job(saved),
                job(world)
            );
        }
    } else if let Some(dir) = &t.init_from {
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
    println!("{}", cfg.schedule_line()?);
    // Among the run's first lines (stdout): stderr stays the one line of an error.
    if let Some(w) = cfg.warmup_warning() {
        println!("warning: {w}");
    }
    if !trainkit::placement::is_resident(cfg.placement.as_ref())
        && !trainer.params().iter().any(trainkit::Param::streamed)
    {
        println!(
            "warning: the placement streams no weight of this model: `{}` leaves every \
             weight on the device (frozen ones alone stream with `frozen`, and only weights of \
             at least its min_bytes; every weight streams with `--stream-weights all \
             --optimizer-offload`)",
            cfg.placement.typetag_name()
        );
    }
    let run_config = cfg.to_toml()?;
    Ok(Job {
        backend,
        trainer,
        val: data.val,
        entropy_floor: data.entropy_floor,
        chat_data: data.chat,
        data_tokenizer: data.tokenizer,
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
    /// Every rank calls it at the same step: rank 0 writes, receiving under ZeRO-1 what
    /// the others keep.
    fn save(&self, dir: &Path) -> Result<()> {
        self.trainer.save(dir, Some(&self.run_config))?;
        if self.trainer.collective().rank() != 0 {
            return Ok(());
        }
        let tokenizer = self.plan.cfg.data.tokenizer();
        warn(tokenizer.copy_into(dir));
        // A full model keeps its base's generation settings (`generate()` reads them), as
        // `merge` keeps them; an adapter's directory holds the adapter alone.
        if let (Some(base), false) = (&self.plan.cfg.training.init_from, self.saves_adapter()) {
            let name = trainkit::save::GENERATION_CONFIG_FILE;
            warn(trainkit::save::copy_files(dir, &[(base.join(name), name)]));
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
    let lead = job.trainer.collective().rank() == 0;
    let mut progress = Progress::new(
        job.trainer.steps_done(),
        t.steps,
        job.plan.cfg.output.log_json.as_deref().filter(|_| lead),
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
        let (rank_peaks, stop) = settle_step(
            job.trainer.collective().as_ref(),
            s.memory.peak_total,
            interrupted.load(Ordering::SeqCst) > 0,
        )?;
        progress.step(&s, rank_peaks.as_deref())?;
        if stop {
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
    if let Some(path) = &args.fit.memory_report {
        let c = job.trainer.collective();
        let path = fit::rank_report_path(path, c.rank());
        let ranks = (c.rank(), c.world());
        fit::write_report(&path, &job.plan.cfg, ranks, &peaks, peak_total)?;
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

/// Prints each warning on stderr.
fn warn(warnings: Vec<String>) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
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

/// What the ranks settle together after each step, in one collective: every rank's peak
/// memory, in rank order (`None` alone), and whether any rank was interrupted (they stop
/// after the same step, so none leaves the others waiting in the next one).
fn settle_step(
    c: &dyn trainkit::collective::Collective,
    peak: u64,
    interrupted: bool,
) -> Result<(Option<Vec<u64>>, bool)> {
    if c.world() == 1 {
        return Ok((None, interrupted));
    }
    // One slot per rank for its peak, and a last one counting the interrupted ranks.
    let mut v = vec![0f64; c.world() + 1];
    v[c.rank()] = peak as f64;
    v[c.world()] = f64::from(u8::from(interrupted));
    c.all_reduce_sum_f64(&mut v)?;
    let stop = v.pop().is_some_and(|n| n > 0.0);
    Ok((Some(v.into_iter().map(|p| p as u64).collect()), stop))
}

/// Sends this process's standard output to nowhere (a rank other than 0 of a
/// data-parallel job: its lines would repeat rank 0's); errors still reach stderr.
fn quiet_stdout() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let _ = std::io::stdout().flush();
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: both descriptors are open; dup2 replaces descriptor 1 atomically.
        unsafe {
            libc::dup2(null.as_raw_fd(), 1);
        }
    }
}

/// Where a run without `--out` saves when it has to stop early.
fn fallback_dir(why: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(format!("{why}-{secs}"))
}
