//! Ranks a torchrun-style launcher started (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`, as torchrun, Slurm scripts and Kubernetes operators set
//! them): their rank and world, and no data of their own. Their data crosses over NCCL,
//! whose bootstrap finds rank 0 at `MASTER_ADDR` ([`super::on_device`]).

use super::Collective;
use crate::error::{Error, Result};

/// A rank of a job started by torchrun-style variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launched {
    rank: usize,
    world: usize,
    local_rank: usize,
}

impl Launched {
    /// The rank the environment describes: `RANK` of `WORLD_SIZE`, `LOCAL_RANK` on its
    /// machine (`RANK` when unset). Fails naming a missing or contradicting variable.
    pub fn from_env() -> Result<Launched> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Launched::from_env`] over the variables `var` gives.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Launched> {
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| Error::config(name, format!("`{v}` is not a whole number")))
                })
                .transpose()
        };
        let world = number("WORLD_SIZE")?.unwrap_or(1);
        let rank = number("RANK")?.ok_or_else(|| {
            Error::config(
                "RANK",
                format!(
                    "WORLD_SIZE is {world} but RANK is not set: a torchrun-style launcher \
                     sets both (and LOCAL_RANK) for every rank"
                ),
            )
        })?;
        if rank >= world {
            return Err(Error::config(
                "RANK",
                format!("{rank} is not a rank of a world of {world} (WORLD_SIZE)"),
            ));
        }
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
        Ok(Launched {
            rank,
            world,
            local_rank,
        })
    }

    fn no_data(&self, what: &str) -> Error {
        Error::config(
            what,
            format!(
                "{} carries no data: its ranks sum over NCCL on their GPUs",
                self.describe()
            ),
        )
    }
}

impl Collective for Launched {
    fn describe(&self) -> String {
        format!(
            "rank {} of {} started by torchrun-style variables (RANK, WORLD_SIZE)",
            self.rank, self.world
        )
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<()> {
        Err(self.no_data("all_reduce_sum"))
    }

    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Err(self.no_data("all_reduce_sum_f64"))
    }

    fn reduce_scatter_sum(&self, _: &[f32], _: &mut [f32]) -> Result<()> {
        Err(self.no_data("reduce_scatter_sum"))
    }

    fn all_gather(&self, _: &[f32], _: &mut [f32]) -> Result<()> {
        Err(self.no_data("all_gather"))
    }

    fn broadcast(&self, _: &mut [u8], _: usize) -> Result<()> {
        Err(self.no_data("broadcast"))
    }

    fn barrier(&self) -> Result<()> {
        Err(self.no_data("barrier"))
    }

    fn carries_bytes(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn torchrun_variables_give_the_rank() {
        let l = Launched::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
        ]))
        .unwrap();
        assert_eq!((l.rank(), l.world(), l.local_rank()), (3, 4, 1));
        assert!(!l.carries_bytes());
        let e = l.all_reduce_sum(&mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("NCCL"), "{e}");
        let l = Launched::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!(l.local_rank(), 1);
    }

    #[test]
    fn a_missing_or_wrong_rank_is_named() {
        let e = Launched::from_vars(vars(&[("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK is not set"), "{e}");
        let e = Launched::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a rank of a world of 2"), "{e}");
        let e = Launched::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`x` is not a whole number"), "{e}");
    }
}
