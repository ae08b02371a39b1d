//! What a run shows while it trains: a progress bar on a terminal, plain lines otherwise,
//! and the optional JSON-lines log.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::Path;
use trainkit::memory::{format_bytes, MemoryCategory};
use trainkit::{Error, Result, StepStats};

/// Reports steps as they finish.
pub struct Progress {
    bar: Option<ProgressBar>,
    total: u64,
    log: Option<(std::fs::File, std::path::PathBuf)>,
}

impl Progress {
    /// Starts at step `done` of `total`; appends JSON lines to `log_json` when given.
    pub fn new(done: u64, total: u64, log_json: Option<&Path>) -> Result<Self> {
        let bar = std::io::stdout().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar.set_position(done);
            bar
        });
        let log = match log_json {
            Some(path) => {
                let refused = |e: std::io::Error| {
                    Error::config(
                        "--log-json",
                        format!(
                            "cannot append to {}: {e}; give it a file in a place this user \
                             can write",
                            path.display()
                        ),
                    )
                };
                if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(refused)?;
                }
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(refused)?;
                Some((f, path.to_path_buf()))
            }
            None => None,
        };
        Ok(Progress { bar, total, log })
    }

    /// Reports one finished step; `rank_peaks` is every rank's peak memory of a
    /// data-parallel step (logged as `memory_peak_ranks`).
    pub fn step(&mut self, s: &StepStats, rank_peaks: Option<&[u64]>) -> Result<()> {
        let mut peak = format_bytes(s.memory.peak_total);
        if let Some(d) = &s.memory.device {
            peak = format!(
                "{peak} (GPU pool {} reserved, peak {}; {} free of {})",
                format_bytes(d.pool_reserved),
                format_bytes(d.pool_reserved_peak),
                format_bytes(d.free),
                format_bytes(d.total)
            );
        }
        let seconds = s.seconds.max(1e-12);
        let speed = match (s.mfu, s.hfu) {
            (Some(m), Some(h)) => format!("MFU {:.1}% | HFU {:.1}%", 100.0 * m, 100.0 * h),
            _ => format!("{:.1} GFLOP/s", s.model_flops / seconds / 1e9),
        };
        // With a loss mask, the trained positions' rate beside every position's.
        let rate = if s.trained_tokens < s.tokens {
            format!(
                "{:.0} tok/s ({:.0} trained)",
                s.tokens_per_s, s.trained_tokens_per_s
            )
        } else {
            format!("{:.0} tok/s", s.tokens_per_s)
        };
        // Streamed weights: what the step copied over the host link, at what rate.
        let peak = if s.streamed_bytes > 0 {
            format!(
                "{peak} | streamed {} ({:.1} GB/s)",
                format_bytes(s.streamed_bytes),
                s.streamed_bytes as f64 / seconds / 1e9
            )
        } else {
            peak
        };
        match &self.bar {
            Some(bar) => {
                bar.set_position(s.step);
                bar.set_message(format!(
                    "loss {:.4} | {rate} | {speed} | peak {peak}",
                    s.loss
                ));
            }
            None => println!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {rate} | {:.0} ms | \
                 {speed} | peak {peak}{}",
                s.step,
                self.total,
                s.loss,
                s.lr,
                s.grad_norm,
                s.seconds * 1e3,
                match (s.skipped, s.loss_scale != 1.0) {
                    (true, true) => format!(
                        " | update skipped (not finite at loss scale {})",
                        s.loss_scale
                    ),
                    (true, false) => " | update skipped (not finite)".to_string(),
                    (false, _) => String::new(),
                }
            ),
        }
        if let Some((file, path)) = &mut self.log {
            let peak: serde_json::Map<String, serde_json::Value> = MemoryCategory::ALL
                .iter()
                .map(|c| (c.name().to_string(), s.memory.peak.get(*c).into()))
                .collect();
            let mut line = serde_json::json!({
                "step": s.step,
                "loss": s.loss,
                "lr": s.lr,
                "grad_norm": s.grad_norm,
                "tokens": s.tokens,
                "micro_batches": s.micro_batches,
                "seconds": s.seconds,
                "tokens_per_s": s.tokens_per_s,
                "trained_tokens": s.trained_tokens,
                "trained_tokens_per_s": s.trained_tokens_per_s,
                "skipped": s.skipped,
                "loss_scale": s.loss_scale,
                "model_flops": s.model_flops,
                "hardware_flops": s.hardware_flops,
                "model_flops_per_s": s.model_flops / seconds,
                "hardware_flops_per_s": s.hardware_flops as f64 / seconds,
                "mfu": s.mfu,
                "hfu": s.hfu,
                "memory_peak": peak,
                "memory_peak_total": s.memory.peak_total,
                "streamed_bytes": s.streamed_bytes,
                "device_memory": s.memory.device,
            });
            if let Some(peaks) = rank_peaks {
                line["memory_peak_ranks"] = peaks.into();
            }
            writeln!(file, "{line}").map_err(|e| Error::io(path.as_path(), e))?;
        }
        Ok(())
    }

    /// Prints a line without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
