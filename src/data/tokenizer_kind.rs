//! [`TokenizerKind`]: the choice of tokenizer in configs and on the command line.

use super::{
    ByteTokenizer, Gpt2Tokenizer, HfTokenizer, Tokenizer, CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Which tokenizer turns text into ids: `gpt2`, `bytes`, or the path of a Hugging Face
/// `tokenizer.json` (or of a model directory that holds one), in a config and on the
/// command line alike.
///
/// A string is read as: `gpt2` or `bytes` (ignoring case and surrounding spaces); else a
/// path, if it holds a `/` (or `\`), ends in `.json`, or names an existing file or
/// directory; anything else is an error listing the valid values (so `GPT-2` or `bpe` is a
/// mistake, not a missing file). The file is read when the tokenizer is built, so a
/// config parses wherever it is read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TokenizerKind {
    /// GPT-2's BPE ([`Gpt2Tokenizer`]), vocabulary 50,257.
    Gpt2,
    /// One token per UTF-8 byte ([`ByteTokenizer`]), vocabulary 256.
    Bytes,
    /// A Hugging Face `tokenizer.json`, or a directory that holds one ([`HfTokenizer`]).
    HuggingFace(PathBuf),
}

impl TokenizerKind {
    /// The built-in kinds, in the order they are listed in messages.
    pub const ALL: [TokenizerKind; 2] = [TokenizerKind::Gpt2, TokenizerKind::Bytes];

    /// The tokenizer file (or directory) of a Hugging Face kind.
    pub fn hf_path(&self) -> Option<&Path> {
        match self {
            TokenizerKind::HuggingFace(path) => Some(path),
            _ => None,
        }
    }

    /// Copies a Hugging Face tokenizer (its `tokenizer.json`, and the
    /// `tokenizer_config.json` and `chat_template.jinja` beside it if there are) into the
    /// model directory `dir`, where `sample` and `eval` look for it; other kinds need no
    /// file. Returns what could not be copied, as warnings: the model itself is saved.
    pub fn copy_into(&self, dir: &Path) -> Vec<String> {
        let Some(path) = self.hf_path() else {
            return Vec::new();
        };
        let file = match HfTokenizer::resolve(path) {
            Ok(file) => file,
            Err(e) => {
                return vec![format!(
                    "the tokenizer was not copied into {}: {e}",
                    dir.display()
                )]
            }
        };
        crate::save::copy_files(
            dir,
            &[
                (file.clone(), TOKENIZER_FILE),
                (
                    file.with_file_name(TOKENIZER_CONFIG_FILE),
                    TOKENIZER_CONFIG_FILE,
                ),
                (file.with_file_name(CHAT_TEMPLATE_FILE), CHAT_TEMPLATE_FILE),
            ],
        )
    }

    /// The vocabulary size of this kind's tokenizer (a Hugging Face file is read for it;
    /// fails as [`HfTokenizer::open`] does).
    pub fn vocab_size(&self) -> Result<usize> {
        Ok(match self {
            TokenizerKind::Gpt2 => Gpt2Tokenizer::VOCAB_SIZE,
            TokenizerKind::Bytes => 256,
            TokenizerKind::HuggingFace(path) => HfTokenizer::open(path)?.vocab_size(),
        })
    }

    /// The id that separates documents, if the vocabulary has one (GPT-2's
    /// `<|endoftext|>`, 50256; the byte tokenizer has none; for a Hugging Face file, see
    /// [`HfTokenizer`]).
    pub fn end_of_text(&self) -> Result<Option<u32>> {
        Ok(match self {
            TokenizerKind::Gpt2 => Some(Gpt2Tokenizer::EOT),
            TokenizerKind::Bytes => None,
            TokenizerKind::HuggingFace(path) => HfTokenizer::open(path)?.end_of_text(),
        })
    }

    /// The tokenizer of this kind; reading a Hugging Face file can fail (see
    /// [`HfTokenizer::open`]), the built-in kinds cannot.
    pub fn build(&self) -> Result<Box<dyn Tokenizer>> {
        Ok(match self {
            TokenizerKind::Gpt2 => Box::new(Gpt2Tokenizer),
            TokenizerKind::Bytes => Box::new(ByteTokenizer),
            TokenizerKind::HuggingFace(path) => Box::new(HfTokenizer::open(path)?),
        })
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerKind::Gpt2 => f.write_str("gpt2"),
            TokenizerKind::Bytes => f.write_str("bytes"),
            TokenizerKind::HuggingFace(path) => write!(f, "{}", path.display()),
        }
    }
}

impl FromStr for TokenizerKind {
    type Err = Error;

    /// Parses `gpt2`, `bytes` or a path (see [`TokenizerKind`]).
    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim();
        if wanted.eq_ignore_ascii_case("gpt2") {
            return Ok(TokenizerKind::Gpt2);
        }
        if wanted.eq_ignore_ascii_case("bytes") {
            return Ok(TokenizerKind::Bytes);
        }
        let path_like = wanted.contains(['/', '\\'])
            || wanted.to_ascii_lowercase().ends_with(".json")
            || (!wanted.is_empty() && Path::new(wanted).exists());
        if path_like {
            return Ok(TokenizerKind::HuggingFace(PathBuf::from(wanted)));
        }
        Err(Error::config(
            "tokenizer",
            format!(
                "unknown tokenizer `{s}`; valid values are `gpt2`, `bytes`, or the path of a \
                 Hugging Face tokenizer.json (or of a model directory that holds one)"
            ),
        ))
    }
}

impl Serialize for TokenizerKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TokenizerKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(|e: Error| {
            // The message without the "invalid config `tokenizer`" prefix the field adds.
            let text = match &e {
                Error::Config { message, .. } => message.clone(),
                other => other.to_string(),
            };
            serde::de::Error::custom(text)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        for kind in TokenizerKind::ALL {
            assert_eq!(kind.to_string().parse::<TokenizerKind>().unwrap(), kind);
            assert_eq!(
                kind.build().unwrap().vocab_size(),
                kind.vocab_size().unwrap()
            );
        }
        assert_eq!(
            " GPT2 ".parse::<TokenizerKind>().unwrap(),
            TokenizerKind::Gpt2
        );
        let e = "bpe".parse::<TokenizerKind>().unwrap_err().to_string();
        assert!(e.contains("`gpt2`") && e.contains("`bytes`"), "{e}");
        let hf = "models/llama/tokenizer.json"
            .parse::<TokenizerKind>()
            .unwrap();
        assert_eq!(hf.hf_path(), Some(Path::new("models/llama/tokenizer.json")));
        assert_eq!(hf.to_string(), "models/llama/tokenizer.json");
        assert_eq!(
            "tok.json".parse::<TokenizerKind>().unwrap(),
            TokenizerKind::HuggingFace("tok.json".into())
        );
        let json = serde_json::to_string(&hf).unwrap();
        assert_eq!(json, "\"models/llama/tokenizer.json\"");
        assert_eq!(serde_json::from_str::<TokenizerKind>(&json).unwrap(), hf);
        let err = hf.build().unwrap_err().to_string();
        assert!(
            err.contains("models/llama/tokenizer.json") && err.contains("no such file"),
            "{err}"
        );
    }
}
