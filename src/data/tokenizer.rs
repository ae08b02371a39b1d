//! Tokenizers: text to token ids and back.

use crate::error::Result;
use std::fmt::Debug;

/// Turns text into token ids and back.
pub trait Tokenizer: Debug + Send + Sync {
    /// Number of distinct ids (every id is below it).
    fn vocab_size(&self) -> usize;
    /// Token ids of `text`.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text of `ids` (invalid sequences replaced, never an error).
    fn decode(&self, ids: &[u32]) -> String;
    /// Token ids of `text`, or an error naming what cannot be encoded (only a tokenizer
    /// read from a file can fail: a word-level vocabulary without an unknown token).
    fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode(text))
    }
    /// The id that separates documents, if the vocabulary has one (GPT-2's
    /// `<|endoftext|>`; see [`HfTokenizer`](super::HfTokenizer) for a `tokenizer.json`).
    fn end_of_text(&self) -> Option<u32> {
        None
    }
}

/// One token per byte of UTF-8: vocabulary 256, works on any text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn vocab_size(&self) -> usize {
        256
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip() {
        let t = ByteTokenizer;
        let text = "To be, or not to be — ça va?";
        let ids = t.encode(text);
        assert_eq!(ids.len(), text.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(t.decode(&ids), text);
    }
}
