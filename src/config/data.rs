//! Where a run's tokens come from, and loading them.

use crate::data::{read_token_file, val_path_for, SyntheticCorpus, Tokenizer, TokenizerKind};
use crate::error::{Error, Result};
use crate::model::Gpt2Config;
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
        /// `gpt2` (BPE, vocabulary 50257) or `bytes` (vocabulary 256).
        #[serde(default = "default_text_tokenizer")]
        tokenizer: TokenizerKind,
        /// Fraction of the tokens held out for evaluation, in (0, 1).
        #[serde(default = "default_val_fraction")]
        val_fraction: f64,
    },
    /// llm.c token files (`trainkit prepare` writes them).
    Tokens {
        /// The training tokens.
        train: PathBuf,
        /// Held-out tokens; when unset, the `_val` sibling of `train` if it exists, else
        /// the last tenth of `train`.
        #[serde(default)]
        val: Option<PathBuf>,
        /// The tokenizer that produced the ids (for sampling and for checking the
        /// vocabulary).
        #[serde(default = "default_token_tokenizer")]
        tokenizer: TokenizerKind,
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
    pub train: Vec<u32>,
    /// Held-out tokens.
    pub val: Vec<u32>,
    /// The lowest loss any model can reach, when known (the built-in corpus).
    pub entropy_floor: Option<f64>,
    /// The tokenizer behind the ids.
    pub tokenizer: TokenizerKind,
    /// Where the tokens came from, for messages.
    pub description: String,
}

impl DataConfig {
    /// The data from a path on the command line: an llm.c token file (recognised by its
    /// magic number) or a text file tokenized with `tokenizer`.
    pub fn from_path(path: &Path, tokenizer: Option<TokenizerKind>) -> DataConfig {
        if crate::data::is_token_file(path) {
            DataConfig::Tokens {
                train: path.to_path_buf(),
                val: None,
                tokenizer: tokenizer.unwrap_or(TokenizerKind::Gpt2),
            }
        } else {
            DataConfig::Text {
                path: path.to_path_buf(),
                tokenizer: tokenizer.unwrap_or(TokenizerKind::Bytes),
                val_fraction: default_val_fraction(),
            }
        }
    }

    /// The tokenizer behind the ids.
    pub fn tokenizer(&self) -> TokenizerKind {
        match self {
            DataConfig::Builtin { .. } => TokenizerKind::Bytes,
            DataConfig::Text { tokenizer, .. } | DataConfig::Tokens { tokenizer, .. } => *tokenizer,
        }
    }

    /// Checks settings against the model before anything is read.
    pub fn validate(&self, model: &Gpt2Config) -> Result<()> {
        if let DataConfig::Text { val_fraction, .. } = self {
            if !(*val_fraction > 0.0 && *val_fraction < 1.0) {
                return Err(Error::config(
                    "data.val_fraction",
                    format!("{val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1"),
                ));
            }
        }
        let tok = self.tokenizer();
        if model.vocab_size < tok.vocab_size() {
            return Err(Error::config(
                "model.vocab_size",
                format!(
                    "{} is smaller than the {tok} tokenizer's {}; set model.vocab_size \
                     (--vocab-size) to at least {}",
                    model.vocab_size,
                    tok.vocab_size(),
                    tok.vocab_size()
                ),
            ));
        }
        Ok(())
    }

    /// Every token of the primary source, unsplit: the text file tokenized, the training
    /// token file, or the generated training text of the built-in corpus.
    pub fn read_tokens(&self) -> Result<Vec<u32>> {
        match self {
            DataConfig::Builtin { bytes } => {
                Ok(crate::data::ByteTokenizer
                    .encode(&SyntheticCorpus::builtin().generate(*bytes, 1)))
            }
            DataConfig::Text {
                path, tokenizer, ..
            } => {
                let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    Error::data(
                        path.display().to_string(),
                        format!(
                            "is not UTF-8 text (invalid byte at offset {}); pass a text file, \
                             or an llm.c token file written by `trainkit prepare`",
                            e.utf8_error().valid_up_to()
                        ),
                    )
                })?;
                Ok(tokenizer.build().encode(&text))
            }
            DataConfig::Tokens { train, .. } => read_token_file(train),
        }
    }

    /// Reads (and tokenizes) the data. `window` is the tokens one batch row needs
    /// (`seq_len + 1`); each stream must hold at least one; every id must be below
    /// `vocab_size`.
    pub fn load(&self, window: usize, vocab_size: usize) -> Result<Corpus> {
        let corpus = match self {
            DataConfig::Builtin { bytes } => {
                let c = SyntheticCorpus::builtin();
                Corpus {
                    train: self.read_tokens()?,
                    val: crate::data::ByteTokenizer
                        .encode(&c.generate((*bytes / 10).max(4 * window), 2)),
                    entropy_floor: Some(c.entropy_per_byte()),
                    tokenizer: TokenizerKind::Bytes,
                    description: "the built-in corpus".into(),
                }
            }
            DataConfig::Text {
                path,
                tokenizer,
                val_fraction,
            } => {
                let tokens = self.read_tokens()?;
                let split = tokens.len() - (tokens.len() as f64 * val_fraction) as usize;
                Corpus {
                    val: tokens[split..].to_vec(),
                    train: {
                        let mut t = tokens;
                        t.truncate(split);
                        t
                    },
                    entropy_floor: None,
                    tokenizer: *tokenizer,
                    description: format!("{} ({tokenizer} tokens)", path.display()),
                }
            }
            DataConfig::Tokens {
                train,
                val,
                tokenizer,
            } => {
                let train_tokens = self.read_tokens()?;
                let val_file = val.clone().or_else(|| {
                    let v = val_path_for(train);
                    v.exists().then_some(v)
                });
                let (train_tokens, val_tokens) = match &val_file {
                    Some(v) => (train_tokens, read_token_file(v)?),
                    None => {
                        let split = train_tokens.len() - train_tokens.len() / 10;
                        let val = train_tokens[split..].to_vec();
                        let mut t = train_tokens;
                        t.truncate(split);
                        (t, val)
                    }
                };
                Corpus {
                    train: train_tokens,
                    val: val_tokens,
                    entropy_floor: None,
                    tokenizer: *tokenizer,
                    description: match &val_file {
                        Some(v) => format!("{} (val {})", train.display(), v.display()),
                        None => format!("{} (last tenth held out)", train.display()),
                    },
                }
            }
        };
        for (name, stream) in [("training", &corpus.train), ("held-out", &corpus.val)] {
            if stream.len() < window {
                return Err(Error::data(
                    &corpus.description,
                    format!(
                        "the {name} stream has {} tokens, one batch row needs {window} \
                         (seq_len + 1); use more data or a shorter --seq-len",
                        stream.len()
                    ),
                ));
            }
            if let Some((i, &id)) = stream
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= vocab_size)
            {
                return Err(Error::data(
                    &corpus.description,
                    format!(
                        "{name} token {i} is id {id}, beyond the model's vocabulary of \
                         {vocab_size}; raise model.vocab_size (--vocab-size) or use data made \
                         with the model's tokenizer"
                    ),
                ));
            }
        }
        Ok(corpus)
    }
}
