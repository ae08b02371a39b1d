//! Data: tokenizers, the built-in synthetic corpus, and llm.c-style batching.

mod corpus;
mod gpt2_tokenizer;
mod loader;
mod prepare;
mod token_file;
mod tokenizer;

pub use crate::model::Batch;
pub use corpus::SyntheticCorpus;
pub use gpt2_tokenizer::{Gpt2Tokenizer, TokenizerKind};
pub use loader::DataLoader;
pub use prepare::{prepare, val_path_for, PrepareReport};
pub use token_file::{
    is_token_file, parse_token_file, read_token_file, write_token_file, TOKEN_FILE_HEADER_BYTES,
    TOKEN_FILE_MAGIC, TOKEN_FILE_VERSION,
};
pub use tokenizer::{ByteTokenizer, Tokenizer};
