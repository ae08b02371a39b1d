//! Hugging Face tokenizers: any `tokenizer.json` (the file a Hugging Face model directory
//! holds: Llama, Mistral, Qwen, GPT-2, ...), read offline with the `tokenizers` crate.

use super::Tokenizer;
use crate::error::{Error, Result};
use std::fmt;
use std::path::{Path, PathBuf};

/// The name of the tokenizer file in a Hugging Face model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The file beside `tokenizer.json` that names the end-of-sequence token (`eos_token`).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The file beside `tokenizer.json` that holds the model's chat template (Jinja), where
/// transformers writes it apart from `tokenizer_config.json`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// End-of-text tokens looked for, in this order, among a file's special tokens when no
/// `tokenizer_config.json` names one: GPT-2's and Qwen's, Llama 3's, Llama 2's and
/// Mistral's, Gemma's, ChatML's.
pub const END_OF_TEXT_TOKENS: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|im_end|>",
];

/// A Hugging Face tokenizer read from a `tokenizer.json`.
///
/// Its vocabulary is the model's plus the file's added tokens: every id is below
/// [`vocab_size`](Tokenizer::vocab_size). Text is encoded as text: special tokens written
/// in it (`</s>`, `<|endoftext|>`) are encoded as their characters, never as the special
/// ids, and no beginning-of-sequence token is added (insert
/// [`end_of_text`](Tokenizer::end_of_text) yourself between documents, as `prepare` does).
///
/// The end-of-text token is, in this order: the `eos_token` of a `tokenizer_config.json`
/// beside the file, when it is a token of the vocabulary; else the first of
/// [`END_OF_TEXT_TOKENS`] that the file declares as a special token; else none.
pub struct HfTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    end_of_text: Option<(String, u32)>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("end_of_text", &self.end_of_text)
            .finish()
    }
}

impl HfTokenizer {
    /// The tokenizer file `path` names: `path` itself, or `path/tokenizer.json` when `path`
    /// is a directory (a Hugging Face model directory). Fails, naming the path and what to
    /// pass instead, when there is no such file.
    pub fn resolve(path: &Path) -> Result<PathBuf> {
        if path.is_dir() {
            let file = path.join(TOKENIZER_FILE);
            if file.is_file() {
                return Ok(file);
            }
            return Err(Error::data(
                format!("directory {}", path.display()),
                format!(
                    "holds no {TOKENIZER_FILE}; pass the tokenizer.json itself, a model \
                     directory that holds one, or gpt2 or bytes"
                ),
            ));
        }
        if !path.exists() {
            return Err(Error::data(
                format!("tokenizer {}", path.display()),
                "no such file or directory; pass gpt2, bytes, a Hugging Face tokenizer.json, \
                 or a model directory that holds one",
            ));
        }
        Ok(path.to_path_buf())
    }

    /// Reads the tokenizer in `path`: a `tokenizer.json`, or a directory that holds one.
    ///
    /// Fails, naming the file, if it is missing, unreadable, or not a Hugging Face
    /// tokenizer file.
    pub fn open(path: &Path) -> Result<HfTokenizer> {
        let file = Self::resolve(path)?;
        let bytes = std::fs::read(&file).map_err(|e| Error::io(&file, e))?;
        Self::from_bytes(&file, &bytes)
    }

    /// The tokenizer in `bytes`, the contents of the file `path` (named in errors; a
    /// `tokenizer_config.json` beside it is read for the end-of-text token).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<HfTokenizer> {
        let what = || format!("tokenizer file {}", path.display());
        if serde_json::from_slice::<serde_json::Value>(bytes).is_err() {
            return Err(Error::data(
                what(),
                "is not JSON; pass a Hugging Face tokenizer.json (the file beside a model's \
                 config.json), or gpt2 or bytes",
            ));
        }
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
            Error::data(
                what(),
                format!(
                    "is not a Hugging Face tokenizer.json ({e}); pass the tokenizer.json a \
                     `tokenizers` library saved (with a `model` of type BPE, WordLevel, \
                     WordPiece or Unigram)"
                ),
            )
        })?;
        // Text is text: a special token written in it is not turned into its id.
        inner.set_encode_special_tokens(true);
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        if vocab_size == 0 {
            return Err(Error::data(
                what(),
                "has an empty vocabulary; pass a trained tokenizer",
            ));
        }
        let end_of_text = declared_eos(path, &inner).or_else(|| {
            let specials = inner.get_added_tokens_decoder();
            END_OF_TEXT_TOKENS.iter().find_map(|name| {
                specials
                    .iter()
                    .find(|(_, t)| t.special && t.content == *name)
                    .map(|(&id, t)| (t.content.clone(), id))
            })
        });
        Ok(HfTokenizer {
            path: path.to_path_buf(),
            inner,
            vocab_size,
            end_of_text,
        })
    }

    /// The file the tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The end-of-text token's text, when the tokenizer has one (see [`HfTokenizer`]).
    pub fn end_of_text_token(&self) -> Option<&str> {
        self.end_of_text.as_ref().map(|(t, _)| t.as_str())
    }
}

/// The `eos_token` that a `tokenizer_config.json` beside `path` names, with its id, if
/// there is such a file and the token is in the vocabulary.
fn declared_eos(path: &Path, inner: &tokenizers::Tokenizer) -> Option<(String, u32)> {
    let config = path.with_file_name(TOKENIZER_CONFIG_FILE);
    let text = std::fs::read(&config).ok()?;
    let value: serde_json::Value = match serde_json::from_slice(&text) {
        Ok(v) => v,
        Err(e) => {
            log::warn!(
                "{} is not JSON ({e}); its eos_token is ignored",
                config.display()
            );
            return None;
        }
    };
    let eos = value.get("eos_token")?;
    let name = match eos {
        serde_json::Value::String(s) => s.as_str(),
        other => other.get("content")?.as_str()?,
    };
    match inner.token_to_id(name) {
        Some(id) => Some((name.to_string(), id)),
        None => {
            log::warn!(
                "{} names eos_token `{name}`, which is not in {}; it is ignored",
                config.display(),
                path.display()
            );
            None
        }
    }
}

impl Tokenizer for HfTokenizer {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`; text the tokenizer cannot encode (a word-level vocabulary with
    /// no unknown token) is logged and left out: [`try_encode`](Tokenizer::try_encode)
    /// reports it instead.
    fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).unwrap_or_else(|e| {
            log::error!("{e}");
            Vec::new()
        })
    }

    fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        match self.inner.encode_fast(text, false) {
            Ok(encoding) => Ok(encoding.get_ids().to_vec()),
            Err(e) => Err(Error::data(
                format!("tokenizer file {}", self.path.display()),
                format!(
                    "cannot encode the text ({e}); a word-level tokenizer needs an \
                     `unk_token` for words outside its vocabulary"
                ),
            )),
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        // Ids outside the vocabulary are skipped by the library; a decoder error (which
        // the stock decoders do not raise) falls back to the tokens' text.
        self.inner.decode(ids, false).unwrap_or_else(|_| {
            ids.iter()
                .map(|&id| {
                    self.inner
                        .id_to_token(id)
                        .unwrap_or_else(|| "\u{FFFD}".into())
                })
                .collect()
        })
    }

    fn end_of_text(&self) -> Option<u32> {
        self.end_of_text.as_ref().map(|&(_, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word_level(added: &str) -> String {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{added}],
            "normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,
            "decoder":null,"model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"a":1,"b":2}},
            "unk_token":"[UNK]"}}}}"#
        )
    }

    #[test]
    fn word_level_with_eos() {
        let added = r#"{"id":3,"content":"</s>","single_word":false,"lstrip":false,
            "rstrip":false,"normalized":false,"special":true}"#;
        let t = HfTokenizer::from_bytes(Path::new("t.json"), word_level(added).as_bytes()).unwrap();
        assert_eq!(t.vocab_size(), 4);
        assert_eq!(t.end_of_text(), Some(3));
        assert_eq!(t.end_of_text_token(), Some("</s>"));
        assert_eq!(t.encode("a b c"), [1, 2, 0]);
        // A special token in the text is text.
        assert_eq!(t.encode("a </s>"), [1, 0, 0, 0]);
        assert_eq!(t.decode(&[1, 2, 3, 99]), "a b </s>");
    }

    #[test]
    fn no_eos_and_bad_files() {
        let t = HfTokenizer::from_bytes(Path::new("t.json"), word_level("").as_bytes()).unwrap();
        assert_eq!(t.end_of_text(), None);
        let err = HfTokenizer::from_bytes(Path::new("x.json"), b"{\"a\": 1}")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x.json") && err.contains("not a Hugging Face"),
            "{err}"
        );
        let err = HfTokenizer::from_bytes(Path::new("x.json"), b"\x00\x01")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not JSON"), "{err}");
    }
}
