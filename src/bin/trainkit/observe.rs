//! `trainkit train`'s flags that observe a run: the peak FLOP/s MFU is measured against,
//! the memory timeline and the op profile.

use std::path::{Path, PathBuf};
use trainkit::config::RunConfig;
use trainkit::memory::SharedOpProfile;
use trainkit::{Error, MemoryObserver, Observers, Result, Timeline};

/// `--peak-tflops`, `--timeline`, `--timeline-steps` and `--profile-ops`.
#[derive(clap::Args)]
pub struct ObserveArgs {
    /// The device's peak TFLOP/s in the compute dtype, for MFU and HFU in the log
    /// (e.g. 989 for an H100 SXM in bf16); without it a GPU of trainkit's table uses its
    /// datasheet figure, and elsewhere only achieved FLOP/s are shown.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Record memory and op timings of the first --timeline-steps steps and write
    /// memory.svg, memory_viz.pickle, memory.jsonl and trace.json into this directory.
    #[arg(long, value_name = "DIR")]
    pub timeline: Option<PathBuf>,
    /// Optimizer steps the --timeline records.
    #[arg(long, value_name = "N", default_value_t = Timeline::DEFAULT_STEPS)]
    pub timeline_steps: u64,
    /// At the end, print where the time of the steps after the first went, op by op
    /// (time, share, calls, GFLOP/s). On a GPU every op then waits for the device, so each
    /// op's time is the device's, and steps run slower.
    #[arg(long)]
    pub profile_ops: bool,
}

/// What a run's observer is made of: the observer the trainer gets, the steps the
/// timeline records (`None` without one) and the op profile to read at the end.
pub struct RunObserver {
    /// The observer the trainer gets.
    pub observer: Box<dyn MemoryObserver>,
    /// The steps the timeline records.
    pub timeline_steps: Option<u64>,
    /// The op profile of `--profile-ops`.
    pub profile: Option<SharedOpProfile>,
}

impl ObserveArgs {
    /// `--peak-tflops` in FLOP/s, refused unless positive.
    pub fn peak_flops(&self) -> Result<Option<f64>> {
        match self.peak_tflops {
            Some(p) if !(p.is_finite() && p > 0.0) => Err(Error::config(
                "--peak-tflops",
                format!("{p} is not a positive number of TFLOP/s (e.g. 989 for an H100 SXM)"),
            )),
            p => Ok(p.map(|p| p * 1e12)),
        }
    }

    /// The run's observer: the config's, joined by a timeline writing into `--timeline
    /// DIR` and by the op profile of `--profile-ops`. `resume`: the directory a resumed
    /// run continues.
    pub fn observer(&self, cfg: &RunConfig, resume: Option<&Path>) -> Result<RunObserver> {
        let mut observers = vec![cfg.observer.clone()];
        let mut timeline_steps = None;
        if let Some(dir) = &self.timeline {
            // A run shorter than --timeline-steps still writes its files: record the steps
            // it runs.
            let done = resume.map_or(0, trainkit::save::saved_step);
            let steps = match cfg.training.steps.saturating_sub(done) {
                0 => self.timeline_steps,
                to_go => self.timeline_steps.min(to_go),
            };
            let timeline = Timeline::in_dir(dir, steps).map_err(|e| match e {
                Error::Config { message, .. } => Error::config("--timeline-steps", message),
                other => other,
            })?;
            println!(
                "memory timeline: the first {steps} step(s) go to {} (memory.svg; \
                 memory_viz.pickle opens at https://pytorch.org/memory_viz, trace.json at \
                 https://ui.perfetto.dev)",
                dir.display()
            );
            observers.push(Box::new(timeline));
            timeline_steps = Some(steps);
        }
        let profile = self.profile_ops.then(SharedOpProfile::default);
        if let Some(p) = &profile {
            observers.push(Box::new(p.clone()));
        }
        let observer = match observers.len() {
            1 => observers.remove(0),
            _ => Box::new(Observers { observers }),
        };
        Ok(RunObserver {
            observer,
            timeline_steps,
            profile,
        })
    }
}

/// The peak FLOP/s of the GPU `backend` runs on in the run's compute dtype (bf16 and fp16
/// on tensor cores, f32 on the CUDA cores or with `tf32` on TF32 tensor cores), from trainkit's table of datasheet figures,
/// announced with how to change it; `None` on the CPU or an unknown GPU (then
/// `--peak-tflops` gives MFU).
pub fn device_peak(backend: &dyn trainkit::Backend, cfg: &RunConfig) -> Option<f64> {
    if backend.device() == trainkit::Device::Cpu {
        return None;
    }
    let dtype = trainkit::estimate::MathDtype::of_products(
        cfg.precision.compute_dtype(),
        cfg.training.tf32,
    );
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
