//! The timing the GPU microbenchmarks share (`attention_bench`, `kernel_bench`).

use std::time::Instant;
use trainkit::device::cuda::CudaBackend;
use trainkit::Backend;

/// The median of `iters` timings of `f` in milliseconds, each a wait for the GPU, 5 calls,
/// a wait, divided by 5; two untimed rounds first.
pub fn time(
    be: &CudaBackend,
    iters: usize,
    mut f: impl FnMut() -> trainkit::Result<()>,
) -> trainkit::Result<f64> {
    const CALLS: usize = 5;
    for _ in 0..2 {
        f()?;
    }
    let mut ms = Vec::with_capacity(iters);
    for _ in 0..iters {
        be.synchronize()?;
        let start = Instant::now();
        for _ in 0..CALLS {
            f()?;
        }
        be.synchronize()?;
        ms.push(start.elapsed().as_secs_f64() * 1e3 / CALLS as f64);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(ms[ms.len() / 2])
}
