//! Two mirrored ranks: a collective for tests of one process standing for rank 0 of two
//! that hold the same values.

use trainkit::collective::Collective;

/// Two ranks holding the same values, as a host engine sees them: every sum doubles, and
/// what rank 1 broadcasts is zeros (as the stand-in NCCL has it).
#[derive(Debug)]
pub struct Mirrored;

impl Collective for Mirrored {
    fn describe(&self) -> String {
        "two mirrored ranks".into()
    }
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        2
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn all_reduce_sum(&self, values: &mut [f32]) -> trainkit::Result<()> {
        values.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> trainkit::Result<()> {
        values.iter_mut().for_each(|v| *v *= 2.0);
        Ok(())
    }
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> trainkit::Result<()> {
        let n = output.len();
        output
            .iter_mut()
            .zip(&input[..n])
            .for_each(|(o, v)| *o = 2.0 * v);
        Ok(())
    }
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> trainkit::Result<()> {
        output
            .chunks_mut(input.len())
            .for_each(|c| c.copy_from_slice(input));
        Ok(())
    }
    /// Rank 1, the other, sends zeros (what it sends cannot be its copy of rank 0's
    /// values: a ZeRO rank broadcasts what it alone updated).
    fn broadcast(&self, bytes: &mut [u8], root: usize) -> trainkit::Result<()> {
        if root != 0 {
            bytes.fill(0);
        }
        Ok(())
    }
    fn barrier(&self) -> trainkit::Result<()> {
        Ok(())
    }
}
