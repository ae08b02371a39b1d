//! Where a run's tokens come from, and loading them.

use crate::data::{SyntheticCorpus, TokenDataset, Tokenizer, TokenizerKind};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where training data comes from (the `[data]` table, chosen by `source`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "source", deny_unknown_fields)]
pub enum DataConfig {
    /// The built-in synthetic corpus (nothing outside the binary needed), byte tokens.
    Builtin {
        /// Bytes of training text to generate.
        #[serde(default = "default_builtin_bytes")]
        bytes: usize,
    },
    /// A UTF-8 text file, tokenized when the run starts; its last `val_fraction` is held
    /// out for evaluation.
    Text {
        /// Path of the file.
        path: PathBuf,
        /// `gpt2` (BPE, vocabulary 50257), `bytes` (vocabulary 256), or the path of a
        /// Hugging Face `tokenizer.json` or of a model directory that holds one (see
        /// [`TokenizerKind`]).
        #[serde(default = "default_text_tokenizer")]
        tokenizer: TokenizerKind,
        /// Fraction of the tokens held out for evaluation, in (0, 1).
        #[serde(default = "default_val_fraction")]
        val_fraction: f64,
        /// Visit the batches in a seeded random order (the run's seed), new every epoch.
        #[serde(default)]
        shuffle: bool,
        /// Mask documents: each ends at the separator token (`separator_id`, else the
        /// tokenizer's end-of-text token), attention stays within it, positions restart
        /// at 0 after it, and the position holding the separator predicts nothing.
        #[serde(default)]
        document_mask: bool,
        /// The token that ends a document, for `document_mask` (default: the tokenizer's
        /// end-of-text token, e.g. GPT-2's 50256).
        #[serde(default)]
        separator_id: Option<u32>,
    },
    /// llm.c token files (`trainkit prepare` writes them), memory-mapped.
    Tokens {
        /// The training tokens: a token file, a glob of shards
        /// (`data/fineweb_train_*.bin`) or a directory of shards, read in sorted order
        /// (see [`TokenDataset::open`]).
        train: PathBuf,
        /// Held-out tokens (a file, glob or directory); when unset, the validation shards
        /// beside `train` if there are any (see [`TokenDataset::open_val_for`]), else the
        /// last tenth of the last training shard.
        #[serde(default)]
        val: Option<PathBuf>,
        /// The tokenizer that produced the ids, for sampling; the ids themselves are
        /// checked against the model's vocabulary.
        #[serde(default = "default_token_tokenizer")]
        tokenizer: TokenizerKind,
        /// Visit shards and batches in a seeded random order (the run's seed), new every
        /// epoch.
        #[serde(default)]
        shuffle: bool,
        /// Mask documents: each ends at the separator token (`separator_id`, else the
        /// tokenizer's end-of-text token), attention stays within it, positions restart
        /// at 0 after it, and the position holding the separator predicts nothing.
        #[serde(default)]
        document_mask: bool,
        /// The token that ends a document, for `document_mask` (default: the tokenizer's
        /// end-of-text token, e.g. GPT-2's 50256).
        #[serde(default)]
        separator_id: Option<u32>,
    },
}

fn default_builtin_bytes() -> usize {
    1 << 20
}
fn default_text_tokenizer() -> TokenizerKind {
    TokenizerKind::Bytes
}
fn default_token_tokenizer() -> TokenizerKind {
    TokenizerKind::Gpt2
}
fn default_val_fraction() -> f64 {
    0.1
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig::Builtin {
            bytes: default_builtin_bytes(),
        }
    }
}

/// A run's tokens, split into training and held-out streams.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// Training tokens.
    pub train: TokenDataset,
    /// Held-out tokens.
    pub val: TokenDataset,
    /// Whether training batches are shuffled (with the run's seed).
    pub shuffle: bool,
    /// The lowest loss any model can reach, when known (the built-in corpus).
    pub entropy_floor: Option<f64>,
    /// The tokenizer behind the ids.
    pub tokenizer: TokenizerKind,
    /// The token that ends a document, where documents are masked
    /// ([`crate::data::DataLoader::separated_by`]).
    pub separator: Option<u32>,
    /// Where the tokens came from, for messages.
    pub description: String,
}

/// The document-masking flags of `trainkit train` and `trainkit eval`.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct DocumentFlags {
    /// Mask documents in the stream: each ends at the tokenizer's end-of-text token (or
    /// --separator-id), attends only within itself, restarts its positions at 0, and the
    /// position holding the separator predicts nothing (is left out of the loss). Packed
    /// data (prepare --chat --pack) is masked by its own boundaries without this flag.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub document_mask: Option<bool>,
    /// The token that ends a document, for --document-mask on a bare token file (implies
    /// --document-mask).
    #[arg(long, value_name = "ID")]
    pub separator_id: Option<u32>,
}

impl DocumentFlags {
    /// Lays the flags over `data` ([`DataConfig::set_document_mask`]); none given leaves
    /// it as it is.
    pub fn apply(&self, data: &mut DataConfig) -> Result<()> {
        if self.document_mask.is_some() || self.separator_id.is_some() {
            data.set_document_mask(self.document_mask.unwrap_or(true), self.separator_id)?;
        }
        Ok(())
    }
}

impl DataConfig {
    /// The data from a path on the command line: an llm.c token file (recognised by its
    /// magic number), a glob of shards or a directory of them, or else a text file
    /// tokenized with `tokenizer`.
    pub fn from_path(path: &Path, tokenizer: Option<TokenizerKind>) -> DataConfig {
        if crate::data::is_token_file(path) || crate::data::is_shard_spec(path) {
            DataConfig::Tokens {
                train: path.to_path_buf(),
                val: None,
                tokenizer: tokenizer.unwrap_or(TokenizerKind::Gpt2),
                shuffle: false,
                document_mask: false,
                separator_id: None,
            }
        } else {
            DataConfig::Text {
                path: path.to_path_buf(),
                tokenizer: tokenizer.unwrap_or(TokenizerKind::Bytes),
                val_fraction: default_val_fraction(),
                shuffle: false,
                document_mask: false,
                separator_id: None,
            }
        }
    }

    /// Turns document masking on (`on`) or off, with `separator_id` as the token that ends
    /// a document when given (else the one already set, or the tokenizer's end-of-text
    /// token). Fails for the built-in corpus, which is one document.
    pub fn set_document_mask(&mut self, on: bool, separator: Option<u32>) -> Result<()> {
        match self {
            DataConfig::Tokens {
                document_mask,
                separator_id,
                ..
            }
            | DataConfig::Text {
                document_mask,
                separator_id,
                ..
            } => {
                *document_mask = on;
                if separator.is_some() {
                    *separator_id = separator;
                }
                Ok(())
            }
            DataConfig::Builtin { .. } => Err(Error::config(
                "--document-mask",
                "applies to --data files; the built-in corpus is one document",
            )),
        }
    }

    /// The token that ends a document where documents are masked (`document_mask`):
    /// `separator_id`, else the tokenizer's end-of-text token; `None` without masking.
    /// Fails when masking is asked for with neither.
    pub fn separator(&self) -> Result<Option<u32>> {
        match self {
            DataConfig::Builtin { .. } => Ok(None),
            DataConfig::Text {
                document_mask,
                separator_id,
                tokenizer,
                ..
            }
            | DataConfig::Tokens {
                document_mask,
                separator_id,
                tokenizer,
                ..
            } => {
                if !document_mask {
                    return Ok(None);
                }
                if let Some(id) = separator_id {
                    return Ok(Some(*id));
                }
                match tokenizer.build()?.end_of_text() {
                    Some(id) => Ok(Some(id)),
                    None => Err(Error::config(
                        "data.separator_id",
                        format!(
                            "document masking needs the token that ends a document, and the \
                             {tokenizer} tokenizer has no end-of-text token; give it with \
                             --separator-id N"
                        ),
                    )),
                }
            }
        }
    }

    /// Whether training batches are shuffled.
    pub fn shuffle(&self) -> bool {
        match self {
            DataConfig::Builtin { .. } => false,
            DataConfig::Text { shuffle, .. } | DataConfig::Tokens { shuffle, .. } => *shuffle,
        }
    }

    /// The tokenizer behind the ids.
    pub fn tokenizer(&self) -> TokenizerKind {
        match self {
            DataConfig::Builtin { .. } => TokenizerKind::Bytes,
            DataConfig::Text { tokenizer, .. } | DataConfig::Tokens { tokenizer, .. } => {
                tokenizer.clone()
            }
        }
    }

    /// Checks settings against the model before anything is read.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if let DataConfig::Text { val_fraction, .. } = self {
            if !(*val_fraction > 0.0 && *val_fraction < 1.0) {
                return Err(Error::config(
                    "data.val_fraction",
                    format!("{val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1"),
                ));
            }
        }
        // Token files hold ids, checked against the model's vocabulary when they are read
        // (`load`); their tokenizer matters only for sampling.
        // A tokenizer file is read (and its vocabulary checked) when the data is loaded,
        // so that a config parses wherever it is read.
        let tok = self.tokenizer();
        if matches!(self, DataConfig::Tokens { .. }) || tok.hf_path().is_some() {
            return Ok(());
        }
        check_vocab(&tok, tok.vocab_size()?, vocab_size)
    }

    /// The primary source, unsplit: the training shards, memory-mapped; or the text file
    /// tokenized, or the generated training text of the built-in corpus, in memory.
    pub fn train_dataset(&self) -> Result<TokenDataset> {
        match self {
            DataConfig::Tokens { train, .. } => TokenDataset::open(train),
            _ => self.read_tokens().map(TokenDataset::from),
        }
    }

    /// Every token of the primary source, unsplit, in memory: the text file tokenized, the
    /// training token files, or the generated training text of the built-in corpus (prefer
    /// [`DataConfig::train_dataset`], which maps token files instead).
    pub fn read_tokens(&self) -> Result<Vec<u32>> {
        match self {
            DataConfig::Builtin { bytes } => {
                Ok(crate::data::ByteTokenizer
                    .encode(&SyntheticCorpus::builtin().generate(*bytes, 1)))
            }
            DataConfig::Text {
                path, tokenizer, ..
            } => read_text(path, tokenizer.build()?.as_ref()),
            DataConfig::Tokens { train, .. } => {
                let data = TokenDataset::open(train)?;
                let mut tokens = Vec::with_capacity(data.len_tokens());
                for shard in data.shards() {
                    shard.read_into(0, shard.len(), &mut tokens);
                }
                Ok(tokens)
            }
        }
    }

    /// Reads (and tokenizes) the data; token files are mapped, not read. `window` is the
    /// tokens one batch row needs (`seq_len + 1`); each stream must hold at least one in
    /// one shard; every id must be below `vocab_size`.
    pub fn load(&self, window: usize, vocab_size: usize) -> Result<Corpus> {
        let corpus = match self {
            DataConfig::Builtin { bytes } => {
                let c = SyntheticCorpus::builtin();
                Corpus {
                    train: self.read_tokens()?.into(),
                    val: crate::data::ByteTokenizer
                        .encode(&c.generate((*bytes / 10).max(4 * window), 2))
                        .into(),
                    shuffle: false,
                    entropy_floor: Some(c.entropy_per_byte()),
                    tokenizer: TokenizerKind::Bytes,
                    separator: None,
                    description: "the built-in corpus".into(),
                }
            }
            DataConfig::Text {
                path,
                tokenizer,
                val_fraction,
                shuffle,
                ..
            } => {
                let tok = tokenizer.build()?;
                check_vocab(tokenizer, tok.vocab_size(), vocab_size)?;
                let tokens = read_text(path, tok.as_ref())?;
                let split = tokens.len() - (tokens.len() as f64 * val_fraction) as usize;
                Corpus {
                    val: tokens[split..].to_vec().into(),
                    train: {
                        let mut t = tokens;
                        t.truncate(split);
                        t.into()
                    },
                    shuffle: *shuffle,
                    entropy_floor: None,
                    tokenizer: tokenizer.clone(),
                    separator: self.separator()?,
                    description: format!("{} ({tokenizer} tokens)", path.display()),
                }
            }
            DataConfig::Tokens {
                train,
                val,
                tokenizer,
                shuffle,
                ..
            } => {
                let train_data = TokenDataset::open(train)?;
                let val_data = match val {
                    Some(v) => Some(TokenDataset::open_all(v)?),
                    None => TokenDataset::open_val_for(train)?,
                };
                let (train_data, val_data, held_out) = match val_data {
                    Some(v) => (train_data, v, None),
                    None => {
                        let last = train_data.shards().last().map_or(0, |s| s.len());
                        let (t, v) = train_data.split_tail(last / 10);
                        (t, v, Some(()))
                    }
                };
                let description = format!(
                    "{}{}; val {}",
                    train_data.describe(),
                    match train_data.format() {
                        Some(f) =>
                            format!(", {} tokens in the {f} format", train_data.len_tokens()),
                        None => String::new(),
                    },
                    if held_out.is_some() {
                        "the last tenth of the last shard".to_string()
                    } else {
                        val_data.describe()
                    }
                );
                Corpus {
                    train: train_data,
                    val: val_data,
                    shuffle: *shuffle,
                    entropy_floor: None,
                    tokenizer: tokenizer.clone(),
                    separator: self.separator()?,
                    description,
                }
            }
        };
        for (name, stream) in [("training", &corpus.train), ("held-out", &corpus.val)] {
            let longest = stream.shards().iter().map(|s| s.len()).max().unwrap_or(0);
            if longest < window {
                return Err(Error::data(
                    &corpus.description,
                    format!(
                        "the {name} stream has {} tokens{}, one batch row needs {window} \
                         (seq_len + 1); use more data or a shorter --seq-len",
                        stream.len_tokens(),
                        if stream.shards().len() > 1 {
                            format!(" (at most {longest} in one shard)")
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
            stream.check_ids(vocab_size)?;
        }
        if !corpus.train.trains_any() {
            return Err(Error::data(
                &corpus.description,
                "its loss mask (the .mask beside each token file) trains no position: every \
                 target is masked out, so the loss has nothing to average; prepare the data \
                 again (`prepare --chat` counts the conversations that keep no trained \
                 token), or delete the .mask files to train on every token",
            ));
        }
        Ok(corpus)
    }
}

/// The text file `path`, tokenized with `tok`.
fn read_text(path: &Path, tok: &dyn Tokenizer) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::data(
            path.display().to_string(),
            format!(
                "is not UTF-8 text (invalid byte at offset {}); pass a text file, or an \
                 llm.c token file written by `trainkit prepare`",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    // A UTF-8 byte-order mark is not text of the document.
    tok.try_encode(text.strip_prefix('\u{feff}').unwrap_or(&text))
}

/// Fails, naming the tokenizer and the fix, when its `vocab` ids do not fit in the
/// model's `model_vocab`.
fn check_vocab(tokenizer: &TokenizerKind, vocab: usize, model_vocab: usize) -> Result<()> {
    if model_vocab < vocab {
        return Err(Error::config(
            "model.vocab_size",
            format!(
                "{model_vocab} is smaller than the {tokenizer} tokenizer's {vocab}; set \
                 model.vocab_size (--vocab-size) to at least {vocab}, or use a tokenizer \
                 with fewer ids"
            ),
        ));
    }
    Ok(())
}
