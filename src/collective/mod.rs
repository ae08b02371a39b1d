//! Collectives across the ranks of a data-parallel job: the seam through which gradients
//! are summed, the trained positions of a global step counted and the ranks kept in step.
//! trainkit runs them on the engines clusters already use: MPI (the `mpi` feature: ranks
//! started by `mpirun` or `srun`, CPU buffers) and, for one process alone, [`Single`]
//! (world 1, no cost, the default). Sums are sums (never averages): the trainer scales
//! once, locally, by the trained positions of the whole global step.

mod launcher;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod rehearsal;
mod tensor;

#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
pub use launcher::Launched;
#[cfg(feature = "nccl")]
pub use nccl::Nccl;
pub use rehearsal::Rehearsal;
pub(crate) use tensor::host_of;
pub use tensor::{all_reduce_tensor, broadcast_bytes, broadcast_tensor};

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::fmt::Debug;
use std::sync::Arc;

/// The collectives of a data-parallel job, as every engine has them: each call is made by
/// every rank, in the same order, with buffers of the same length.
pub trait Collective: Debug + Send + Sync {
    /// The engine's name (`single`, `mpi`) and what it runs on, for logs.
    fn describe(&self) -> String;

    /// This process's rank, `0..world()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// This process's rank among those on its machine (which local device it takes).
    fn local_rank(&self) -> usize;

    /// Every rank's `values` summed, in place on every rank.
    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()>;

    /// Every rank's `values` summed into rank `root`'s `values` (the others' are left
    /// unspecified: a ZeRO-2 rank uses only the sums of what it updates). By default an
    /// all-reduce, which gives the root the same sums.
    fn reduce_sum(&self, values: &mut [f32], root: usize) -> Result<()> {
        let _ = root;
        self.all_reduce_sum(values)
    }

    /// Every rank's `values` summed, in place on every rank (counts: exact up to 2⁵³).
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()>;

    /// The sum over ranks of `input` (`world()` equal blocks), rank `r` keeping block `r`
    /// in `output` (`input.len() / world()` values).
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()>;

    /// Every rank's `input`, in rank order, into `output` (`world() × input.len()`
    /// values) on every rank.
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()>;

    /// Rank `root`'s `bytes` on every rank.
    fn broadcast(&self, bytes: &mut [u8], root: usize) -> Result<()>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Whether this engine carries bytes between ranks (false for ranks known only from a
    /// launcher's variables, which meet through NCCL's own bootstrap).
    fn carries_bytes(&self) -> bool {
        true
    }

    /// Whether this engine sums device memory where it lies ([`Collective::all_reduce_device`]);
    /// its collectives are then queued from one thread, in the same order on every rank.
    fn sums_on_device(&self) -> bool {
        false
    }

    /// Sums device tensor `t` over every rank in place, queued on its device after the
    /// work that wrote it and beside the work queued later ([`Collective::settle_device`]
    /// before that reads, writes or frees `t`), when this engine reads device memory
    /// (NCCL): `Ok(false)` when it does not, and the caller goes through host memory.
    /// Every rank calls it with a tensor of the same shape and dtype.
    fn all_reduce_device(&self, t: &mut Tensor) -> Result<bool> {
        let _ = t;
        Ok(false)
    }

    /// Sums device tensor `t` over every rank into rank `root`'s `t` alone (the others'
    /// are left as they are: a ZeRO-2 rank frees what it does not update), queued as
    /// [`Collective::all_reduce_device`] is, when this engine reads device memory:
    /// `Ok(false)` when it does not.
    fn reduce_device(&self, t: &mut Tensor, root: usize) -> Result<bool> {
        let _ = (t, root);
        Ok(false)
    }

    /// Rank `root`'s device tensor `t` on every rank, in place on the device, when this
    /// engine reads device memory: `Ok(false)` when it does not.
    fn broadcast_device(&self, t: &mut Tensor, root: usize) -> Result<bool> {
        let _ = (t, root);
        Ok(false)
    }

    /// Runs `queue`, whose device collectives the engine may launch together (NCCL's
    /// group: one launch for a bucket of gradients); as it is for the others.
    fn group(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        queue()
    }

    /// Makes the device's work queued from now on wait for the collectives queued so far
    /// by [`Collective::all_reduce_device`] and [`Collective::broadcast_device`] (which
    /// run beside compute): before their tensors are read, written or freed. A wait on the
    /// device, not on the host; nothing for an engine of host memory.
    fn settle_device(&self) -> Result<()> {
        Ok(())
    }

    /// Ends every rank of the job with `code` (a rank that failed: the others would wait
    /// for it in their next collective). One process alone just exits.
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// One process alone: world 1, every collective a copy or nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Collective for Single {
    fn describe(&self) -> String {
        "single process".to_string()
    }

    fn rank(&self) -> usize {
        0
    }

    fn world(&self) -> usize {
        1
    }

    fn local_rank(&self) -> usize {
        0
    }

    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter_sum", input.len(), output.len(), 1)?;
        output.copy_from_slice(input);
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", output.len(), input.len(), 1)?;
        output.copy_from_slice(input);
        Ok(())
    }

    fn broadcast(&self, _: &mut [u8], root: usize) -> Result<()> {
        check_root(root, 1)
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// Fails unless `whole` holds `world` blocks of `block` values.
fn check_blocks(what: &str, whole: usize, block: usize, world: usize) -> Result<()> {
    if block.checked_mul(world) != Some(whole) {
        return Err(Error::config(
            what,
            format!("{whole} values are not {world} blocks of {block}"),
        ));
    }
    Ok(())
}

/// Fails unless `root` is a rank of a world of `world`.
fn check_root(root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(Error::config(
            "broadcast",
            format!("root {root} is not a rank of a world of {world}"),
        ));
    }
    Ok(())
}

/// The environment variables a launcher sets that give the number of ranks, in the order
/// they are read: torchrun's (`WORLD_SIZE`, first: a torchrun inside a Slurm allocation
/// also sees Slurm's), MPICH's and Intel MPI's (`PMI_SIZE`), Open MPI's
/// (`OMPI_COMM_WORLD_SIZE`) and Slurm's (`SLURM_NTASKS` under `srun`).
pub const WORLD_VARIABLES: [&str; 4] = [
    "WORLD_SIZE",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_NTASKS",
];

/// The number of ranks the launcher of this process started, from its environment
/// ([`WORLD_VARIABLES`]), `None` when no launcher started it (or one rank only).
pub fn launched_world() -> Option<(usize, &'static str)> {
    WORLD_VARIABLES.iter().find_map(|name| {
        let n = std::env::var(name).ok()?.trim().parse::<usize>().ok()?;
        (n > 1).then_some((n, *name))
    })
}

/// The collective of this process: MPI's world when an MPI launcher started several ranks
/// (built with the `mpi` feature); the ranks of a torchrun-style launcher's variables
/// ([`Launched`], whose data crosses over NCCL once each rank has its GPU:
/// [`on_device`]); [`Single`] otherwise. A job of several ranks in a build without the
/// engine it needs is an error naming the fix, never N independent runs.
pub fn launch() -> Result<Arc<dyn Collective>> {
    match launched_world() {
        None => Ok(Arc::new(Single)),
        Some((_, "WORLD_SIZE")) => Ok(Arc::new(Launched::from_env()?)),
        #[cfg(feature = "mpi")]
        Some(_) => Ok(Arc::new(Mpi::init()?)),
        #[cfg(not(feature = "mpi"))]
        Some((n, variable)) => Err(Error::config(
            "launch",
            format!(
                "this process is one of {n} ranks ({variable} = {n}), but trainkit was built \
                 without the `mpi` feature, so the ranks would train {n} separate models; \
                 rebuild with `cargo build --release --features mpi` (needs an MPI such as \
                 MPICH), or run one process"
            ),
        )),
    }
}

/// Which engine carries a job's data between ranks (`--collective`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// NCCL for ranks on GPUs (when built with it), the launcher's engine otherwise.
    #[default]
    Auto,
    /// NCCL, also for one process alone (a check that it works on this machine).
    Nccl,
    /// The launcher's engine: MPI, or nothing for one process.
    Mpi,
}

/// The collective ranks on `backend` run on: `bootstrap` (what [`launch`] returned) as
/// it is on the CPU, or an NCCL communicator of its ranks on their GPUs when `engine`
/// asks for it or leaves it to trainkit ([`Engine::Auto`]: NCCL for several ranks on
/// GPUs). Ranks a torchrun-style launcher started need NCCL, so GPUs.
pub fn on_device(
    bootstrap: Arc<dyn Collective>,
    backend: &Arc<dyn crate::device::Backend>,
    engine: Engine,
) -> Result<Arc<dyn Collective>> {
    let on_gpu = backend.device() != crate::Device::Cpu;
    let nccl = match engine {
        Engine::Nccl => true,
        Engine::Mpi => false,
        Engine::Auto => on_gpu && bootstrap.world() > 1 && cfg!(feature = "nccl"),
    };
    if !nccl {
        if !bootstrap.carries_bytes() {
            return Err(Error::config(
                "--collective",
                format!(
                    "{} carries no data itself: its ranks sum over NCCL, on GPUs \
                     (start CPU ranks with mpirun, built with the `mpi` feature)",
                    bootstrap.describe()
                ),
            ));
        }
        return Ok(bootstrap);
    }
    if !on_gpu {
        return Err(Error::config(
            "--collective",
            "NCCL carries GPU memory: it needs `--device cuda` (CPU ranks run over MPI)",
        ));
    }
    nccl_on(bootstrap, backend)
}

#[cfg(feature = "nccl")]
fn nccl_on(
    bootstrap: Arc<dyn Collective>,
    backend: &Arc<dyn crate::device::Backend>,
) -> Result<Arc<dyn Collective>> {
    let cuda = backend.as_cuda().ok_or_else(|| {
        Error::config("--collective", "NCCL runs on trainkit's CUDA backend only")
    })?;
    Ok(Arc::new(Nccl::join(cuda, bootstrap)?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_on(
    _: Arc<dyn Collective>,
    _: &Arc<dyn crate::device::Backend>,
) -> Result<Arc<dyn Collective>> {
    Err(Error::config(
        "--collective",
        "trainkit was built without the `nccl` feature: rebuild with it (a default \
         feature) to sum GPU ranks over NCCL",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_is_a_world_of_one() {
        let s = Single;
        assert_eq!((s.rank(), s.world(), s.local_rank()), (0, 1, 0));
        let mut v = [1.0, 2.0];
        s.all_reduce_sum(&mut v).unwrap();
        assert_eq!(v, [1.0, 2.0]);
        let mut out = [0.0; 2];
        s.reduce_scatter_sum(&v, &mut out).unwrap();
        assert_eq!(out, v);
        s.all_gather(&v, &mut out).unwrap();
        assert_eq!(out, v);
        assert!(s.all_gather(&v, &mut [0.0; 3]).is_err());
        assert!(s.broadcast(&mut [1], 1).is_err());
    }
}
