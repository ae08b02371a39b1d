//! The head layout of attention: how many query heads, how many key/value heads they share
//! (grouped-query attention), and how wide each is.

use crate::error::{Error, Result};

/// The heads of an attention op. Its fused projection `qkv` is `[B, T, (H + 2·KV)·D]`:
/// columns `[0, H·D)` hold the queries, `[H·D, (H+KV)·D)` the keys and the rest the
/// values, head after head, each `D = head_dim` wide. Query head `h` attends with key and
/// value head `h / (H / KV)`: GPT-2's multi-head attention is `KV = H`, multi-query
/// attention `KV = 1`. The output is `[B, T, H·D]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads (`H`).
    pub n_head: usize,
    /// Key and value heads (`KV`), dividing `H`.
    pub n_kv_head: usize,
    /// Width of each head (`D`).
    pub head_dim: usize,
}

impl Heads {
    /// Multi-head attention over `width` columns: `n_head` query, key and value heads of
    /// `width / n_head` (GPT-2's layout; a `width` that `n_head` does not divide is
    /// refused by every op).
    pub fn mha(n_head: usize, width: usize) -> Heads {
        Heads {
            n_head,
            n_kv_head: n_head,
            head_dim: match width.checked_rem(n_head) {
                Some(0) => width / n_head,
                _ => 0,
            },
        }
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.n_head.checked_div(self.n_kv_head).unwrap_or(0)
    }

    /// Columns of the queries and of the output: `H·D`.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Columns of the keys (and of the values): `KV·D`.
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Columns of the fused projection: `(H + 2·KV)·D`.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// First column of query head `h`.
    pub fn q_col(&self, h: usize) -> usize {
        h * self.head_dim
    }

    /// First column of the key head query head `h` reads.
    pub fn k_col(&self, h: usize) -> usize {
        self.q_width() + (h / self.group().max(1)) * self.head_dim
    }

    /// First column of the value head query head `h` reads.
    pub fn v_col(&self, h: usize) -> usize {
        self.q_width() + self.kv_width() + (h / self.group().max(1)) * self.head_dim
    }

    /// Fails, naming `op`, unless every count is positive and `KV` divides `H`.
    pub fn check(&self, op: &'static str) -> Result<()> {
        if self.n_head == 0 || self.n_kv_head == 0 || self.head_dim == 0 {
            return Err(Error::shape(
                op,
                format!(
                    "heads must be positive: {} query heads, {} key/value heads of {} \
                     (is the width divisible by the number of heads?)",
                    self.n_head, self.n_kv_head, self.head_dim
                ),
            ));
        }
        if self.n_head % self.n_kv_head != 0 {
            return Err(Error::shape(
                op,
                format!(
                    "{} query heads cannot share {} key/value heads evenly; the key/value \
                     heads must divide the query heads",
                    self.n_head, self.n_kv_head
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_of_grouped_heads() {
        let h = Heads {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 3,
        };
        assert_eq!(h.group(), 2);
        assert_eq!((h.q_width(), h.kv_width(), h.qkv_width()), (12, 6, 24));
        assert_eq!((h.q_col(3), h.k_col(3), h.v_col(3)), (9, 15, 21));
        assert_eq!((h.k_col(0), h.k_col(1), h.v_col(0)), (12, 12, 18));
        assert!(h.check("t").is_ok());
        let mha = Heads::mha(4, 32);
        assert_eq!((mha.n_kv_head, mha.head_dim, mha.qkv_width()), (4, 8, 96));
        assert!(Heads::mha(3, 32).check("t").is_err());
        let bad = Heads {
            n_head: 4,
            n_kv_head: 3,
            head_dim: 2,
        };
        assert!(bad.check("t").unwrap_err().to_string().contains("divide"));
    }
}
