//! Collectives across the ranks of a data-parallel job: the seam through which gradients
//! are summed, the trained positions of a global step counted and the ranks kept in step.
//! trainkit runs them on the engines clusters already use: MPI (the `mpi` feature: ranks
//! started by `mpirun` or `srun`, CPU buffers) and, for one process alone, [`Single`]
//! (world 1, no cost, the default). Sums are sums (never averages): the trainer scales
//! once, locally, by the trained positions of the whole global step.

#[cfg(feature = "mpi")]
mod mpi;
mod rehearsal;
mod tensor;

#[cfg(feature = "mpi")]
pub use self::mpi::Mpi;
pub use rehearsal::Rehearsal;
pub(crate) use tensor::host_of;
pub use tensor::{all_reduce_tensor, broadcast_bytes, broadcast_tensor};

use crate::error::{Error, Result};
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

/// The environment variables a launcher sets that give the number of ranks: MPICH's and
/// Intel MPI's (`PMI_SIZE`), Open MPI's (`OMPI_COMM_WORLD_SIZE`), Slurm's (`SLURM_NTASKS`
/// under `srun`) and torchrun's (`WORLD_SIZE`).
pub const WORLD_VARIABLES: [&str; 4] = [
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_NTASKS",
    "WORLD_SIZE",
];

/// The number of ranks the launcher of this process started, from its environment
/// ([`WORLD_VARIABLES`]), `None` when no launcher started it (or one rank only).
pub fn launched_world() -> Option<(usize, &'static str)> {
    WORLD_VARIABLES.iter().find_map(|name| {
        let n = std::env::var(name).ok()?.trim().parse::<usize>().ok()?;
        (n > 1).then_some((n, *name))
    })
}

/// The collective of this process: MPI's world when a launcher started several ranks
/// (built with the `mpi` feature), [`Single`] otherwise. A job of several ranks in a build
/// without MPI is an error naming the fix, never N independent runs.
pub fn launch() -> Result<Arc<dyn Collective>> {
    match launched_world() {
        None => Ok(Arc::new(Single)),
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
