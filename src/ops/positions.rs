//! Positions within documents. A batch row may hold several documents (packed examples,
//! or a pretraining stream cut at its separators); each token then carries its position in
//! its own document, restarting at 0 where a document starts. The ops that read positions
//! take them as `[B·T]` values, row-major like the batch's tokens, or `None` for the
//! plain layout (`0..T` in every row, one document per row):
//!
//! - attention (fused and materialized): query `i` attends keys `i − position[i] ..= i`,
//!   the tokens of its own document up to itself, so no token sees another document;
//! - rotary embeddings turn each query and key by its own position's angles;
//! - learned position embeddings add (and backward accumulates into) each token's own
//!   position's row.
//!
//! The invariant every backend relies on ([`check`]): each row starts at 0 and each next
//! position is 0 (a document starts) or one more than the last. So the first key a query
//! attends never decreases along a row, which lets the fused attention skip whole tiles.
//! The ops that read a token's own position alone (rotary and learned position
//! embeddings) also take a row that continues a document from any position
//! ([`check_continued`]): incremental decoding runs the new tokens of a sequence whose
//! earlier positions a key/value cache holds.

use crate::error::{Error, Result};

/// Fails unless `positions` holds `b · t` valid positions: each row's first 0, each next
/// either 0 or one more than the one before it (`None`, the plain layout, always passes).
/// `op` names the call in the error.
pub fn check(op: &'static str, positions: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
    check_rows(op, positions, b, t, false)
}

/// [`check`], except that a row may start at any position (it continues a document whose
/// earlier tokens ran before): for the ops that read each token's own position alone.
pub fn check_continued(
    op: &'static str,
    positions: Option<&[u32]>,
    b: usize,
    t: usize,
) -> Result<()> {
    check_rows(op, positions, b, t, true)
}

fn check_rows(
    op: &'static str,
    positions: Option<&[u32]>,
    b: usize,
    t: usize,
    continued: bool,
) -> Result<()> {
    let Some(positions) = positions else {
        return Ok(());
    };
    if positions.len() != b * t {
        return Err(Error::shape(
            op,
            format!(
                "{} positions for a batch of {b} rows of {t} tokens (one per token)",
                positions.len()
            ),
        ));
    }
    for (r, row) in positions.chunks_exact(t.max(1)).enumerate() {
        let mut last: Option<u32> = None;
        for (i, &p) in row.iter().enumerate() {
            let ok = p == 0 || last.map_or(continued, |l| p == l + 1);
            if !ok {
                return Err(Error::shape(
                    op,
                    format!(
                        "position {p} at row {r}, token {i}: a document's positions start at 0 \
                         and count up by one (each row starts a document)"
                    ),
                ));
            }
            last = Some(p);
        }
    }
    Ok(())
}

/// The first key query `i` of batch row `row` attends: `i − position`, the start of its
/// document (0 without positions).
#[inline]
pub(crate) fn first_key(positions: Option<&[u32]>, t: usize, row: usize, i: usize) -> usize {
    positions.map_or(0, |p| i - p[row * t + i] as usize)
}

/// Positions of `b` rows of `t` tokens from where documents start: `starts(k)` says
/// whether token `k` (of the `b · t`, row-major) begins a document. Every row begins one.
pub fn from_document_starts(b: usize, t: usize, starts: impl Fn(usize) -> bool) -> Vec<u32> {
    let mut positions = Vec::with_capacity(b * t);
    for k in 0..b * t {
        let p = if k % t == 0 || starts(k) {
            0
        } else {
            positions[k - 1] + 1
        };
        positions.push(p);
    }
    positions
}

/// Whether `positions` (valid, per [`check`]) restart anywhere but at each row's start:
/// `false` means the plain layout, which every op computes without them.
pub fn has_documents(positions: &[u32], t: usize) -> bool {
    positions
        .iter()
        .enumerate()
        .any(|(k, &p)| p as usize != k % t.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_at_each_document_and_row() {
        let p = from_document_starts(2, 5, |k| k == 3 || k == 8);
        assert_eq!(p, [0, 1, 2, 0, 1, 0, 1, 2, 0, 1]);
        check("t", Some(&p), 2, 5).unwrap();
        check("t", None, 2, 5).unwrap();
        assert!(has_documents(&p, 5));
        assert!(!has_documents(&from_document_starts(2, 5, |_| false), 5));
        assert_eq!(first_key(Some(&p), 5, 0, 4), 3);
        assert_eq!(first_key(Some(&p), 5, 1, 2), 0);
        assert_eq!(first_key(None, 5, 1, 2), 0);
    }

    #[test]
    fn bad_positions_are_named() {
        let e = check("rope", Some(&[0, 1, 3]), 1, 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("position 3 at row 0, token 2"), "{e}");
        let e = check("rope", Some(&[1, 2]), 1, 2).unwrap_err().to_string();
        assert!(e.contains("each row starts"), "{e}");
        let e = check("rope", Some(&[0, 1]), 2, 2).unwrap_err().to_string();
        assert!(e.contains("2 positions for a batch of 2 rows"), "{e}");
        // A continued row may start anywhere, then counts on as any row.
        check_continued("rope", Some(&[7, 8, 0, 1]), 1, 4).unwrap();
        assert!(check_continued("rope", Some(&[7, 9]), 1, 2).is_err());
    }
}
