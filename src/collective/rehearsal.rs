//! One rank of a world that is not there: what a prediction runs to see a data-parallel
//! job from one rank's side (its share of the optimizer state under ZeRO-1, of the
//! gradients under ZeRO-2, its buffers), on the meta backend.

use super::{check_blocks, check_root, Collective};
use crate::error::{Error, Result};

/// Rank `rank` of a world of `world` ranks, every one of which is taken to hold what this
/// one does: a sum is this rank's values times the world, a gather repeats them, a
/// broadcast leaves them. For predictions ([`crate::estimate::predict_rank`]), whose
/// tensors hold no values; training with it would train on this rank's data alone.
#[derive(Clone, Copy, Debug)]
pub struct Rehearsal {
    rank: usize,
    world: usize,
}

impl Rehearsal {
    /// Rank `rank` of `world`; fails unless `rank < world`.
    pub fn new(rank: usize, world: usize) -> Result<Rehearsal> {
        if rank >= world {
            return Err(Error::config(
                "rank",
                format!("rank {rank} is not one of a world of {world} (0 to {world} - 1)"),
            ));
        }
        Ok(Rehearsal { rank, world })
    }
}

impl Collective for Rehearsal {
    fn describe(&self) -> String {
        format!("rehearsal of rank {} of {}", self.rank, self.world)
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn local_rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_sum(&self, values: &mut [f32]) -> Result<()> {
        values.iter_mut().for_each(|v| *v *= self.world as f32);
        Ok(())
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<()> {
        values.iter_mut().for_each(|v| *v *= self.world as f64);
        Ok(())
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter_sum", input.len(), output.len(), self.world)?;
        let block = &input[self.rank * output.len()..(self.rank + 1) * output.len()];
        for (o, i) in output.iter_mut().zip(block) {
            *o = i * self.world as f32;
        }
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", output.len(), input.len(), self.world)?;
        for chunk in output.chunks_exact_mut(input.len().max(1)) {
            chunk.copy_from_slice(input);
        }
        Ok(())
    }

    fn broadcast(&self, _: &mut [u8], root: usize) -> Result<()> {
        check_root(root, self.world)
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_holds_what_this_one_does() {
        let c = Rehearsal::new(1, 4).unwrap();
        let mut v = [1.0f32, 2.5];
        c.all_reduce_sum(&mut v).unwrap();
        assert_eq!(v, [4.0, 10.0]);
        let mut n = [3.0f64];
        c.all_reduce_sum_f64(&mut n).unwrap();
        assert_eq!(n, [12.0]);
        let mut block = [0.0f32; 2];
        c.reduce_scatter_sum(&[0., 0., 1., 2., 0., 0., 0., 0.], &mut block)
            .unwrap();
        assert_eq!(block, [4.0, 8.0]);
        let mut all = [0.0f32; 4];
        c.all_gather(&[7.0], &mut all).unwrap();
        assert_eq!(all, [7.0; 4]);
        assert!(c.broadcast(&mut [0u8], 4).is_err());
        assert!(Rehearsal::new(4, 4).is_err());
    }
}
