//! Per-kernel device time: while timing is on ([`CudaBackend::time_kernels`]), every kernel
//! launch and every cuBLASLt product on the compute stream is bracketed by a pair of CUDA
//! events (on the emulator, by the host's clock, as it runs each launch to its end), and
//! [`CudaBackend::kernel_times`] reads them back, summed per kernel.
//!
//! Unlike the op spans of [`crate::memory::OpProfile`] under `CudaOptions::sync_ops`, the
//! launches stay queued back to back: the times are the kernels' own, in a step that runs
//! at its normal speed, less the events' small cost.
//!
//! [`CudaBackend::time_kernels`]: super::CudaBackend::time_kernels
//! [`CudaBackend::kernel_times`]: super::CudaBackend::kernel_times

use crate::error::{Error, Result};
use cudarc::driver::{result as drv, sys as drv_sys};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The device time of one kernel, or of the products of one shape, over the launches
/// timed.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel's name (`layernorm_backward_dx_bf16`), or for a cuBLASLt product
    /// `cublasLt m×n×k` with its epilogue.
    pub name: String,
    /// Launches timed.
    pub calls: u64,
    /// Their device time, summed, in milliseconds.
    pub millis: f64,
}

/// `samples` summed per name, the longest total first (ties by name).
pub(crate) fn summarize(samples: impl IntoIterator<Item = (String, f64)>) -> Vec<KernelTime> {
    let mut by_name: HashMap<String, (u64, f64)> = HashMap::new();
    for (name, ms) in samples {
        let e = by_name.entry(name).or_default();
        e.0 += 1;
        e.1 += ms;
    }
    let mut v: Vec<KernelTime> = by_name
        .into_iter()
        .map(|(name, (calls, millis))| KernelTime {
            name,
            calls,
            millis,
        })
        .collect();
    v.sort_by(|a, b| b.millis.total_cmp(&a.millis).then(a.name.cmp(&b.name)));
    v
}

/// Times on a real device: CUDA events recorded on the stream around each launch.
pub(crate) struct EventTimer {
    on: AtomicBool,
    state: Mutex<Events>,
}

/// The events of the launches not read yet, and the events free for reuse.
#[derive(Default)]
struct Events {
    pending: Vec<(String, drv_sys::CUevent, drv_sys::CUevent)>,
    free: Vec<drv_sys::CUevent>,
}

impl Events {
    fn take_event(&mut self) -> Result<drv_sys::CUevent> {
        match self.free.pop() {
            Some(e) => Ok(e),
            None => drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| timing_error("creating an event", e)),
        }
    }
}

fn timing_error(what: &str, e: drv::DriverError) -> Error {
    Error::Backend {
        backend: "cuda",
        message: format!("timing kernels: {what}: {e:?}"),
    }
}

impl EventTimer {
    /// Off.
    pub(crate) fn new() -> EventTimer {
        EventTimer {
            on: AtomicBool::new(false),
            state: Mutex::new(Events::default()),
        }
    }

    /// Turns timing on or off.
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// When timing is on, records a start event on `stream` (the caller's context bound).
    pub(crate) fn start(&self, stream: drv_sys::CUstream) -> Result<Option<drv_sys::CUevent>> {
        if !self.on.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let e = s.take_event()?;
        // SAFETY: a live event of this context, recorded on this context's stream.
        unsafe { drv::event::record(e, stream) }.map_err(|e| timing_error("recording", e))?;
        Ok(Some(e))
    }

    /// Records the end event of a launch begun with [`EventTimer::start`] (nothing when
    /// that recorded none).
    pub(crate) fn stop(
        &self,
        start: Option<drv_sys::CUevent>,
        name: impl FnOnce() -> String,
        stream: drv_sys::CUstream,
    ) -> Result<()> {
        let Some(start) = start else {
            return Ok(());
        };
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let end = s.take_event()?;
        // SAFETY: as in `start`.
        unsafe { drv::event::record(end, stream) }.map_err(|e| timing_error("recording", e))?;
        s.pending.push((name(), start, end));
        Ok(())
    }

    /// The launches recorded since the last call, summed per kernel: waits for each
    /// launch's end event, then keeps the events for reuse.
    pub(crate) fn take(&self) -> Result<Vec<KernelTime>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pending = std::mem::take(&mut s.pending);
        let mut samples = Vec::with_capacity(pending.len());
        let mut failure = None;
        for (name, start, end) in pending {
            if failure.is_none() {
                // SAFETY: both events were created by this timer and recorded on one
                // stream; neither is destroyed before `drop`.
                let ms = unsafe {
                    drv::event::synchronize(end).and_then(|_| drv::event::elapsed(start, end))
                };
                match ms {
                    Ok(ms) => samples.push((name, ms as f64)),
                    Err(e) => failure = Some(timing_error("reading an event", e)),
                }
            }
            s.free.push(start);
            s.free.push(end);
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(summarize(samples)),
        }
    }

    /// Destroys every event (the owner's context still bound and alive).
    pub(crate) fn destroy(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pending = std::mem::take(&mut s.pending);
        let mut all = std::mem::take(&mut s.free);
        all.extend(pending.into_iter().flat_map(|(_, a, b)| [a, b]));
        for e in all {
            // SAFETY: created by this timer and no longer used.
            let _ = unsafe { drv::event::destroy(e) };
        }
    }
}

/// Times on the emulator: the host's clock around each launch, which runs to its end
/// before the launch returns.
pub(crate) struct HostTimer {
    on: AtomicBool,
    samples: Mutex<Vec<(String, f64)>>,
}

impl HostTimer {
    /// Off.
    pub(crate) fn new() -> HostTimer {
        HostTimer {
            on: AtomicBool::new(false),
            samples: Mutex::new(Vec::new()),
        }
    }

    /// Turns timing on or off.
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Runs `f`, and when timing is on records its time under `name()`.
    pub(crate) fn time<T>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        if !self.on.load(Ordering::Relaxed) {
            return f();
        }
        let start = Instant::now();
        let out = f();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        s.push((name(), ms));
        out
    }

    /// The launches recorded since the last call, summed per kernel.
    pub(crate) fn take(&self) -> Vec<KernelTime> {
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        summarize(std::mem::take(&mut *s))
    }
}

/// The name a timed product goes by: `cublasLt m×n×k`, with its epilogue, then `+C`
/// where it adds a C of its own (a residual) or `+=` where it adds to what D holds.
pub(crate) fn gemm_name(g: &super::gpu::Gemm) -> String {
    let mut name = format!("cublasLt {}x{}x{}", g.m, g.n, g.k);
    if g.dgelu_aux != 0 {
        name.push_str(" +dgelu");
    } else if g.gelu_aux != 0 {
        name.push_str(" +gelu");
    } else if g.bias != 0 {
        name.push_str(" +bias");
    }
    if g.bias_grad != 0 {
        name.push_str(" +bias_grad");
    }
    if g.beta != 0.0 && g.c != 0 {
        name.push_str(" +C");
    } else if g.beta != 0.0 {
        name.push_str(" +=");
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_per_name_longest_first() {
        let v = summarize([
            ("a".to_string(), 1.0),
            ("b".to_string(), 5.0),
            ("a".to_string(), 2.5),
            ("c".to_string(), 3.5),
        ]);
        let got: Vec<(&str, u64, f64)> = v
            .iter()
            .map(|k| (k.name.as_str(), k.calls, k.millis))
            .collect();
        assert_eq!(got, [("b", 1, 5.0), ("a", 2, 3.5), ("c", 1, 3.5)]);
    }
}
