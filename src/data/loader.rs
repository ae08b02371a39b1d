//! Batching with llm.c's semantics.

use super::Tokenizer;
use crate::error::{Error, Result};
use crate::model::Batch;
use std::path::Path;
use std::sync::Arc;

/// Cuts a token stream into micro-batches the way llm.c does: micro-batch `j`, row `r` is
/// the window `tokens[(j·B + r)·T ..= (j·B + r)·T + T]` (inputs the first `T`, targets the
/// same shifted by one), moving through the stream in order and starting over from the
/// beginning when the next batch would run past the end.
#[derive(Clone, Debug)]
pub struct DataLoader {
    tokens: Arc<[u32]>,
    batch_size: usize,
    seq_len: usize,
    position: usize,
}

impl DataLoader {
    /// A loader over `tokens` giving `batch_size` rows of `seq_len` tokens.
    pub fn new(tokens: impl Into<Arc<[u32]>>, batch_size: usize, seq_len: usize) -> Result<Self> {
        let tokens = tokens.into();
        if batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        if seq_len == 0 {
            return Err(Error::config("seq_len", "must be at least 1"));
        }
        let need = batch_size * seq_len + 1;
        if tokens.len() < need {
            return Err(Error::data(
                "token stream",
                format!(
                    "{} tokens, but one batch of {batch_size} × {seq_len} needs {need}; use more \
                     data or a smaller batch size or sequence length",
                    tokens.len()
                ),
            ));
        }
        Ok(DataLoader {
            tokens,
            batch_size,
            seq_len,
            position: 0,
        })
    }

    /// A loader over a text file, tokenized with `tokenizer`.
    pub fn from_text_file(
        path: impl AsRef<Path>,
        tokenizer: &dyn Tokenizer,
        batch_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::new(tokenizer.encode(&text), batch_size, seq_len)
    }

    /// Rows per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens in the stream.
    pub fn len_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Where the next batch starts (in tokens): save it to resume exactly.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Continues from a saved [`DataLoader::position`].
    pub fn set_position(&mut self, position: usize) -> Result<()> {
        if position > self.tokens.len() {
            return Err(Error::data(
                "data position",
                format!(
                    "position {position} is past the end of a stream of {} tokens; was the \
                     run resumed on different data?",
                    self.tokens.len()
                ),
            ));
        }
        self.position = position;
        Ok(())
    }

    /// The next micro-batch.
    pub fn next_batch(&mut self) -> Batch {
        let (b, t) = (self.batch_size, self.seq_len);
        if self.position + b * t + 1 > self.tokens.len() {
            self.position = 0;
        }
        let window = &self.tokens[self.position..self.position + b * t + 1];
        self.position += b * t;
        Batch {
            batch_size: b,
            seq_len: t,
            inputs: window[..b * t].to_vec(),
            targets: window[1..].to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_llm_c() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut big = DataLoader::new(tokens.clone(), 4, 5).unwrap();
        let mut small = DataLoader::new(tokens, 2, 5).unwrap();
        let b = big.next_batch();
        let s1 = small.next_batch();
        let s2 = small.next_batch();
        assert_eq!(b.inputs[..10], s1.inputs[..]);
        assert_eq!(b.inputs[10..], s2.inputs[..]);
        assert_eq!(b.targets[..10], s1.targets[..]);
        assert_eq!(b.inputs[0..5], [0, 1, 2, 3, 4]);
        assert_eq!(b.targets[0..5], [1, 2, 3, 4, 5]);
        assert_eq!(b.inputs[15..20], [15, 16, 17, 18, 19]);
    }

    #[test]
    fn wraps_at_the_end() {
        let tokens: Vec<u32> = (0..25).collect();
        let mut l = DataLoader::new(tokens, 2, 5).unwrap();
        assert_eq!(l.next_batch().inputs[0], 0);
        assert_eq!(l.next_batch().inputs[0], 10);
        // 20 + 10 + 1 > 25: starts over.
        assert_eq!(l.next_batch().inputs[0], 0);
    }

    #[test]
    fn too_little_data_is_an_error() {
        let err = DataLoader::new(vec![1u32; 10], 2, 5).unwrap_err();
        assert!(err.to_string().contains("needs 11"), "{err}");
    }
}
