//! MPI's world (the `mpi` feature): the ranks `mpirun`, `mpiexec` or `srun` started, on
//! CPU buffers.

use super::{check_blocks, check_root, launched_world, Collective};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use std::sync::Mutex;

/// The world of an MPI job. MPI is initialised once per process ([`Mpi::init`]) and
/// finalised when this value is dropped (which waits for the other ranks to finish too);
/// a panic on any rank aborts the whole job (a rank that unwound would leave the others
/// waiting in a collective), and so should an error ([`Collective::abort`]).
pub struct Mpi {
    /// The world communicator; collectives are made one at a time.
    world: Mutex<SimpleCommunicator>,
    /// MPI itself: dropping it finalises MPI (declared after `world`, dropped after it).
    _universe: mpi::environment::Universe,
    rank: usize,
    size: usize,
    local_rank: usize,
    library: String,
}

// MPI is initialised with `MPI_THREAD_MULTIPLE` (or the job is refused), and every call
// goes through the mutex, so the communicator may be used from any thread.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

/// Set once MPI was initialised in this process (it cannot be initialised twice).
static INITIALISED: std::sync::OnceLock<()> = std::sync::OnceLock::new();

impl Mpi {
    /// Initialises MPI (once per process) and takes its world. Fails when MPI was
    /// initialised already, when the library cannot give calls from any thread, or when the
    /// launcher's world size (`PMI_SIZE`, `OMPI_COMM_WORLD_SIZE`, ...) is not MPI's (a job
    /// started by a launcher MPI does not know, such as torchrun).
    pub fn init() -> Result<Mpi> {
        if INITIALISED.get().is_some() {
            return Err(mpi_error("MPI is initialised already in this process"));
        }
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| mpi_error("MPI was initialised already by another library"))?;
        let world = universe.world();
        let _ = INITIALISED.set(());
        if threading != mpi::Threading::Multiple {
            return Err(mpi_error(format!(
                "the MPI library gives {threading:?} threading; trainkit calls it from the \
                 update thread too and needs Multiple (MPI_THREAD_MULTIPLE)"
            )));
        }
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if let Some((n, variable)) = launched_world().filter(|(n, _)| *n != size) {
            return Err(mpi_error(format!(
                "the launcher started {n} ranks ({variable} = {n}) but MPI's world holds \
                 {size}: start the job with this MPI's mpirun (or srun built against it)"
            )));
        }
        abort_on_panic();
        let local_rank = [
            "MPI_LOCALRANKID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "SLURM_LOCALID",
        ]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(rank);
        let library = mpi::environment::library_version()
            .unwrap_or_default()
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        Ok(Mpi {
            world: Mutex::new(world),
            _universe: universe,
            rank,
            size,
            local_rank,
            library,
        })
    }

    fn world(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A panic on any thread of any rank ends the whole job at once (`MPI_Abort`), after the
/// panic's message is printed.
fn abort_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        let_launcher_forward_output();
        // SAFETY: MPI is initialised before this hook is set; a panic after finalising
        // would abort a finalised MPI, which ends the process all the same.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
        }
    }));
}

/// How long a failing rank waits before `MPI_Abort`. The launcher forwards each rank's
/// output through its own proxies, and an abort that reaches it first ends the job with
/// the rank's last lines (the error saying what went wrong) still unforwarded.
const FORWARD_GRACE: std::time::Duration = std::time::Duration::from_millis(1000);

/// Flushes this rank's output and gives the launcher [`FORWARD_GRACE`] to pass it on.
fn let_launcher_forward_output() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::thread::sleep(FORWARD_GRACE);
}

fn mpi_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "mpi",
        message: message.into(),
    }
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("library", &self.library)
            .finish()
    }
}

impl Collective for Mpi {
    fn describe(&self) -> String {
        format!(
            "MPI, rank {} of {} ({})",
            self.rank, self.size, self.library
        )
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.size
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
        let send = values.to_vec();
        self.world()
            .all_reduce_into(&send[..], values, SystemOperation::sum());
        Ok(())
    }

    fn reduce_sum(&self, values: &mut [f32], root: usize) -> Result<()> {
        check_root(root, self.size)?;
        let world = self.world();
        let at = world.process_at_rank(root as i32);
        let send = values.to_vec();
        if root == self.rank {
            at.reduce_into_root(&send[..], values, SystemOperation::sum());
        } else {
            at.reduce_into(&send[..], SystemOperation::sum());
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        let send = values.to_vec();
        self.world()
            .all_reduce_into(&send[..], values, SystemOperation::sum());
        Ok(())
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter_sum", input.len(), output.len(), self.size)?;
        self.world()
            .reduce_scatter_block_into(input, output, SystemOperation::sum());
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", output.len(), input.len(), self.size)?;
        self.world().all_gather_into(input, output);
        Ok(())
    }

    fn broadcast(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        check_root(root, self.size)?;
        let world = self.world();
        world.process_at_rank(root as i32).broadcast_into(bytes);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.world().barrier();
        Ok(())
    }

    fn abort(&self, code: i32) -> ! {
        let_launcher_forward_output();
        self.world().abort(code)
    }
}
