//! Data: token files and shards (memory-mapped), tokenizers (GPT-2, bytes, Hugging Face
//! `tokenizer.json`), the built-in synthetic corpus,
//! llm.c-style batching, and `prepare`, which streams text into token shards.

pub mod chat;
mod corpus;
mod dataset;
mod gpt2_tokenizer;
mod hf_tokenizer;
mod loader;
mod prepare;
mod shard;
mod token_file;
pub mod token_flags;
mod tokenizer;
mod tokenizer_kind;

pub use crate::model::Batch;
pub use corpus::SyntheticCorpus;
pub use dataset::{is_shard_spec, is_val_shard, TokenDataset};
pub use gpt2_tokenizer::Gpt2Tokenizer;
pub use hf_tokenizer::{
    HfTokenizer, CHAT_TEMPLATE_FILE, END_OF_TEXT_TOKENS, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
pub use loader::{DataCursor, DataLoader};
pub use prepare::{
    prepare, prepare_with, val_path_for, InputKind, PrepareOptions, PrepareProgress, PrepareReport,
};
pub use shard::Shard;
pub use token_file::{
    is_token_file, parse_token_file, read_token_file, write_token_file, write_token_file_as,
    TokenFormat, TOKEN_FILE_HEADER_BYTES, TOKEN_FILE_MAGIC, TOKEN_FILE_VERSION,
};
pub use tokenizer::{ByteTokenizer, Tokenizer};
pub use tokenizer_kind::TokenizerKind;
