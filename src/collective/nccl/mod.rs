//! NCCL's world (the `nccl` feature): the ranks of a GPU job summing device memory over
//! NVLink, PCIe or the network, as every GPU trainer does.
//!
//! NCCL only carries data; the ranks are started and found by something else, the
//! *bootstrap*: MPI (`mpirun`, `srun`: rank 0 makes the communicator's id and MPI
//! broadcasts it), a launcher's variables alone (torchrun-style `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`: every rank reads the id from
//! `NCCL_COMM_ID`, NCCL's own bootstrap), or one process.
//!
//! Device tensors are summed in place on the device ([`Collective::all_reduce_device`]),
//! queued on the backend's communication stream after the compute work that wrote them,
//! so that the compute queued later runs beside the sum; [`Collective::settle_device`]
//! orders compute after the sums where it reads or frees what they write. Every NCCL
//! call of a rank goes to that one stream, in the rank's order. A host buffer (a count,
//! the ranks' squared norms) crosses through a device buffer, and its wait watches
//! NCCL's errors and a timeout rather than blocking. A watchdog thread polls the
//! communicator's asynchronous error while the job runs: a failed peer or network ends
//! every rank with the error named, instead of a hang.

mod library;

pub use library::{
    version_text, Comm, DataType, NcclError, NcclLibrary, UniqueId, MIN_VERSION, NCCL_ENV,
};

use super::{check_blocks, check_root, Collective};
use crate::device::cuda::{device_ptr, AllocError, CudaBackend, Gpu};
use crate::device::Backend;
use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The environment variable holding how many seconds a collective may take before the
/// job is ended (default [`DEFAULT_TIMEOUT`], as PyTorch's process groups).
pub const TIMEOUT_ENV: &str = "TRAINKIT_NCCL_TIMEOUT";

/// How long a collective may wait for the other ranks by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How often the watchdog asks NCCL for an asynchronous error.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// A communicator handle that may cross threads (NCCL allows the error query from any
/// thread; every other call is made under [`Nccl`]'s lock).
#[derive(Clone, Copy)]
struct Handle(Comm);

// SAFETY: see the type's comment.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

/// An NCCL communicator over every rank of the job, on one GPU per rank.
pub struct Nccl {
    lib: &'static NcclLibrary,
    /// The communicator; collectives are queued one at a time.
    comm: Mutex<Handle>,
    gpu: Arc<dyn Gpu>,
    /// What started the ranks: gives rank and world, and ends the job on [`Collective::abort`].
    bootstrap: Arc<dyn Collective>,
    /// How the ranks found each other, for [`Collective::describe`].
    how: &'static str,
    device: String,
    timeout: Duration,
    /// Set when the communicator was aborted (it is then neither used nor destroyed).
    aborted: Arc<AtomicBool>,
    stop_watch: Arc<AtomicBool>,
    watchdog: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank())
            .field("world", &self.world())
            .field("version", &version_text(self.lib.version()))
            .field("device", &self.device)
            .finish()
    }
}

impl Nccl {
    /// Forms the communicator of the ranks `bootstrap` started, each on the GPU of its
    /// `backend` (the process's NCCL, [`NcclLibrary::get`]). Returns when every rank has
    /// joined.
    pub fn join(backend: &CudaBackend, bootstrap: Arc<dyn Collective>) -> Result<Nccl> {
        let lib = NcclLibrary::get().map_err(nccl_error)?;
        Self::join_with(lib, backend, bootstrap)
    }

    /// [`Nccl::join`] through the NCCL library `lib`.
    pub fn join_with(
        lib: &'static NcclLibrary,
        backend: &CudaBackend,
        bootstrap: Arc<dyn Collective>,
    ) -> Result<Nccl> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world());
        let (id, how) = if world == 1 {
            (lib.unique_id().map_err(error)?, "one process")
        } else if bootstrap.carries_bytes() {
            let mut id = if rank == 0 {
                lib.unique_id().map_err(error)?
            } else {
                UniqueId { bytes: [0; 128] }
            };
            bootstrap.broadcast(&mut id.bytes, 0)?;
            (id, "its id broadcast over MPI")
        } else {
            comm_id_from_launcher()?;
            (lib.unique_id().map_err(error)?, "NCCL_COMM_ID")
        };
        let gpu = Arc::clone(backend.gpu());
        gpu.comm_stream()?;
        let comm = lib.init_rank(world, id, rank).map_err(|e| {
            nccl_error(format!(
                "rank {rank} of {world} could not join the communicator ({how}): {e}"
            ))
        })?;
        let aborted = Arc::new(AtomicBool::new(false));
        let stop_watch = Arc::new(AtomicBool::new(false));
        let watchdog = watch(lib, Handle(comm), rank, &aborted, &stop_watch);
        Ok(Nccl {
            lib,
            comm: Mutex::new(Handle(comm)),
            gpu,
            bootstrap,
            how,
            device: format!("{} ({})", backend.device(), backend.describe()),
            timeout: timeout_from_env()?,
            aborted,
            stop_watch,
            watchdog: Some(watchdog),
        })
    }

    /// The NCCL library this communicator runs on.
    pub fn library(&self) -> &'static NcclLibrary {
        self.lib
    }

    fn comm(&self) -> Result<std::sync::MutexGuard<'_, Handle>> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(nccl_error("the communicator was aborted after an error"));
        }
        Ok(self.comm.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Queues `op` (given the communicator and the communication stream, which waits for
    /// the compute work queued so far) on the device.
    fn queue(&self, op: impl FnOnce(Comm, *mut std::ffi::c_void) -> NcclResult) -> Result<()> {
        let comm = self.comm()?;
        let stream = self.gpu.comm_stream()? as *mut std::ffi::c_void;
        op(comm.0, stream).map_err(error)
    }

    /// Waits for the work queued on the device, watching NCCL's error and the timeout
    /// meanwhile: `what` names the collective in the error.
    fn wait(&self, what: &str) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(10);
        while !self.gpu.comm_idle()? {
            if let Err(e) = self.check_async() {
                return Err(nccl_error(format!("{what}: {e}")));
            }
            if start.elapsed() > self.timeout {
                return Err(nccl_error(format!(
                    "{what} did not end within {} s: another rank stopped taking part \
                     (set ${TIMEOUT_ENV} to wait longer)",
                    self.timeout.as_secs()
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        self.check_async()
    }

    fn check_async(&self) -> Result<()> {
        let comm = self.comm()?;
        // SAFETY: the communicator is live (not aborted, not destroyed before `self`).
        unsafe { self.lib.async_error(comm.0) }.map_err(error)
    }

    /// Runs `op` (given the send and receive buffers) on a device copy of `input` and a
    /// device buffer for `out` (the send buffer itself when `in_place`, `input` and `out`
    /// then of one length), waits for it, and reads the result into `out`.
    fn through_device(
        &self,
        what: &str,
        input: &[u8],
        out: &mut [u8],
        in_place: bool,
        op: impl FnOnce(u64, u64, Comm, *mut std::ffi::c_void) -> NcclResult,
    ) -> Result<()> {
        let send = self.alloc(input.len(), what)?;
        let recv = (!in_place)
            .then(|| self.alloc(out.len(), what))
            .transpose()?;
        let recv_ptr = recv.as_ref().map_or(send.ptr, |r| r.ptr);
        self.gpu.upload(send.ptr, input)?;
        self.queue(|comm, stream| op(send.ptr, recv_ptr, comm, stream))?;
        self.wait(what)?;
        self.gpu.download(out, recv_ptr)
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<Scratch> {
        match self.gpu.alloc(bytes.max(1)) {
            Ok(ptr) => Ok(Scratch {
                gpu: Arc::clone(&self.gpu),
                ptr,
            }),
            Err(AllocError::OutOfMemory) => Err(Error::OutOfMemory {
                message: format!("{what}: no room on the device for a buffer of {bytes} bytes"),
            }),
            Err(AllocError::Other(m)) => Err(nccl_error(format!("{what}: {m}"))),
        }
    }

    /// Queues `op` on device tensor `t` in place — its address, values and NCCL type —
    /// after the compute work that wrote it: `Ok(false)` (nothing queued) for a host
    /// tensor or one NCCL does not sum. `t` lies on the backend's device, which is this
    /// communicator's, and the caller settles before anything touches it again.
    fn in_place(
        &self,
        t: &Tensor,
        op: impl FnOnce(u64, usize, DataType, Comm, *mut std::ffi::c_void) -> NcclResult,
    ) -> Result<bool> {
        let (Storage::Device(_), Some(ty)) = (t.storage(), data_type(t)) else {
            return Ok(false);
        };
        let (ptr, n) = (device_ptr(t)?, t.numel());
        self.queue(|comm, stream| op(ptr, n, ty, comm, stream))?;
        Ok(true)
    }
}

/// What an NCCL call returns.
type NcclResult = std::result::Result<(), NcclError>;

/// A device buffer a host collective crosses through, freed when dropped.
struct Scratch {
    gpu: Arc<dyn Gpu>,
    ptr: u64,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.gpu.free(self.ptr);
    }
}

/// The watchdog: polls `comm`'s asynchronous error every [`WATCH_EVERY`] until stopped;
/// on an error, marks the communicator aborted, aborts it (releasing whatever waits on
/// it) and ends the process with the error named.
fn watch(
    lib: &'static NcclLibrary,
    comm: Handle,
    rank: usize,
    aborted: &Arc<AtomicBool>,
    stop: &Arc<AtomicBool>,
) -> JoinHandle<()> {
    let (aborted, stop) = (Arc::clone(aborted), Arc::clone(stop));
    std::thread::spawn(move || {
        let comm = comm;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(WATCH_EVERY);
            if stop.load(Ordering::SeqCst) || aborted.load(Ordering::SeqCst) {
                return;
            }
            // SAFETY: the communicator lives until `stop` is set and this thread joined.
            if let Err(e) = unsafe { lib.async_error(comm.0) } {
                aborted.store(true, Ordering::SeqCst);
                eprintln!("error on rank {rank}: NCCL: {e}; ending the job");
                // SAFETY: marked aborted above: no other call uses it from now on.
                let _ = unsafe { lib.abort(comm.0) };
                std::process::exit(1);
            }
        }
    })
}

impl Drop for Nccl {
    fn drop(&mut self) {
        self.stop_watch.store(true, Ordering::SeqCst);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if !self.aborted.load(Ordering::SeqCst) {
            let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            let _ = self.gpu.synchronize();
            // SAFETY: the watchdog has stopped; nothing uses the communicator afterwards.
            let _ = unsafe { self.lib.destroy(comm.0) };
        }
    }
}

/// The NCCL type of a tensor's elements, where NCCL sums them.
fn data_type(t: &Tensor) -> Option<DataType> {
    match t.dtype() {
        DType::F32 => Some(DataType::F32),
        DType::Bf16 => Some(DataType::Bf16),
        DType::F16 => Some(DataType::F16),
        DType::U8 | DType::Nf4(_) => None,
    }
}

fn bytes_of<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers (f32, f64, u8): every byte is initialised, any length fits.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; every bit pattern is a valid f32, f64 or u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

impl Collective for Nccl {
    fn describe(&self) -> String {
        format!(
            "NCCL {} ({}), rank {} of {} on {}, ranks found by {}",
            version_text(self.lib.version()),
            self.lib.path().display(),
            self.rank(),
            self.world(),
            self.device,
            self.how
        )
    }

    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    fn world(&self) -> usize {
        self.bootstrap.world()
    }

    fn local_rank(&self) -> usize {
        self.bootstrap.local_rank()
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
        let input = bytes_of(values).to_vec();
        let n = values.len();
        self.through_device(
            "all-reduce",
            &input,
            bytes_of_mut(values),
            true,
            |s, r, c, st| {
                // SAFETY: both buffers hold `n` f32 on this communicator's device.
                unsafe { self.lib.all_reduce(s, r, n, DataType::F32, c, st) }
            },
        )
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        let input = bytes_of(values).to_vec();
        let n = values.len();
        self.through_device(
            "all-reduce",
            &input,
            bytes_of_mut(values),
            true,
            |s, r, c, st| {
                // SAFETY: both buffers hold `n` f64 on this communicator's device.
                unsafe { self.lib.all_reduce(s, r, n, DataType::F64, c, st) }
            },
        )
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks(
            "reduce_scatter_sum",
            input.len(),
            output.len(),
            self.world(),
        )?;
        let n = output.len();
        self.through_device(
            "reduce-scatter",
            bytes_of(input),
            bytes_of_mut(output),
            false,
            |s, r, c, st| {
                // SAFETY: `s` holds world × n f32, `r` n, on this communicator's device.
                unsafe { self.lib.reduce_scatter(s, r, n, DataType::F32, c, st) }
            },
        )
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", output.len(), input.len(), self.world())?;
        let n = input.len();
        self.through_device(
            "all-gather",
            bytes_of(input),
            bytes_of_mut(output),
            false,
            |s, r, c, st| {
                // SAFETY: `s` holds n f32, `r` world × n, on this communicator's device.
                unsafe { self.lib.all_gather(s, r, n, DataType::F32, c, st) }
            },
        )
    }

    fn broadcast(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        check_root(root, self.world())?;
        let input = bytes.to_vec();
        let n = bytes.len();
        self.through_device("broadcast", &input, bytes, true, |s, r, c, st| {
            // SAFETY: both buffers hold `n` bytes on this communicator's device.
            unsafe { self.lib.broadcast(s, r, n, DataType::U8, root, c, st) }
        })
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_sum(&mut [0.0])
    }

    fn carries_bytes(&self) -> bool {
        true
    }

    fn sums_on_device(&self) -> bool {
        true
    }

    fn all_reduce_device(&self, t: &mut Tensor) -> Result<bool> {
        self.in_place(t, |ptr, n, ty, comm, stream| {
            // SAFETY: see `in_place`.
            unsafe { self.lib.all_reduce(ptr, ptr, n, ty, comm, stream) }
        })
    }

    fn reduce_device(&self, t: &mut Tensor, root: usize) -> Result<bool> {
        check_root(root, self.world())?;
        self.in_place(t, |ptr, n, ty, comm, stream| {
            // SAFETY: see `in_place`.
            unsafe { self.lib.reduce(ptr, ptr, n, ty, root, comm, stream) }
        })
    }

    fn broadcast_device(&self, t: &mut Tensor, root: usize) -> Result<bool> {
        check_root(root, self.world())?;
        self.in_place(t, |ptr, n, ty, comm, stream| {
            // SAFETY: see `in_place`.
            unsafe { self.lib.broadcast(ptr, ptr, n, ty, root, comm, stream) }
        })
    }

    fn group(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.lib.group_start().map_err(error)?;
        let queued = queue();
        let ended = self.lib.group_end().map_err(error);
        queued.and(ended)
    }

    fn settle_device(&self) -> Result<()> {
        self.gpu.compute_waits_for_comm()
    }

    fn abort(&self, code: i32) -> ! {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: marked aborted: nothing uses the communicator afterwards.
            let _ = unsafe { self.lib.abort(comm.0) };
        }
        self.bootstrap.abort(code)
    }
}

/// Sets `NCCL_COMM_ID` from a torchrun-style launcher's variables ([`comm_id`]) unless it
/// is set already. Every rank then makes the same communicator id, and rank 0 serves
/// NCCL's bootstrap there.
fn comm_id_from_launcher() -> Result<()> {
    if std::env::var_os("NCCL_COMM_ID").is_some() {
        return Ok(());
    }
    let id = comm_id(|name| std::env::var(name).ok())?;
    std::env::set_var("NCCL_COMM_ID", id);
    Ok(())
}

/// The `NCCL_COMM_ID` of ranks a torchrun-style launcher started: `MASTER_ADDR` and
/// `MASTER_PORT` + 1 (the launcher's own store listens on the port itself), from the
/// variables `var` gives. Fails naming what is missing or wrong and the fixes.
pub fn comm_id(var: impl Fn(&str) -> Option<String>) -> Result<String> {
    let get = |name: &str| {
        var(name).ok_or_else(|| {
            Error::config(
                name,
                format!(
                    "the ranks were started without MPI (torchrun-style variables), so NCCL \
                     finds them through rank 0's address: set MASTER_ADDR and MASTER_PORT \
                     (torchrun does), or NCCL_COMM_ID=host:port, or start the job with \
                     mpirun; {name} is not set"
                ),
            )
        })
    };
    let addr = get("MASTER_ADDR")?;
    let port = get("MASTER_PORT")?;
    let port: u16 = port
        .trim()
        .parse()
        .map_err(|_| Error::config("MASTER_PORT", format!("`{port}` is not a port number")))?;
    let port = port.checked_add(1).ok_or_else(|| {
        Error::config("MASTER_PORT", "NCCL listens on MASTER_PORT + 1, past 65535")
    })?;
    Ok(format!("{}:{port}", addr.trim()))
}

/// [`TIMEOUT_ENV`], or [`DEFAULT_TIMEOUT`].
fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_ENV) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(secs) if secs > 0.0 && secs.is_finite() => Ok(Duration::from_secs_f64(secs)),
            _ => Err(Error::config(
                TIMEOUT_ENV,
                format!("`{s}` is not a number of seconds above 0"),
            )),
        },
    }
}

fn error(e: NcclError) -> Error {
    nccl_error(e.to_string())
}

fn nccl_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "nccl",
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_variables_give_nccls_address() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let id = comm_id(vars(&[("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")]));
        assert_eq!(id.unwrap(), "node0:29501");
        let e = comm_id(vars(&[("MASTER_PORT", "29500")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR is not set"), "{e}");
        let e = comm_id(vars(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "x")])).unwrap_err();
        assert!(e.to_string().contains("`x` is not a port number"), "{e}");
        let e = comm_id(vars(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "65535")])).unwrap_err();
        assert!(e.to_string().contains("past 65535"), "{e}");
    }
}
