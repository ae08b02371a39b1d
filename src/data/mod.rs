//! Data: tokenizers, the built-in synthetic corpus, and llm.c-style batching.

mod corpus;
mod loader;
mod tokenizer;

pub use crate::model::Batch;
pub use corpus::SyntheticCorpus;
pub use loader::DataLoader;
pub use tokenizer::{ByteTokenizer, Tokenizer};
