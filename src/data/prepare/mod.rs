//! `trainkit prepare`: tokenize a text file once into llm.c token files (train and val).

use super::token_file::{write_token_file, TOKEN_FILE_MAGIC};
use super::TokenizerKind;
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

/// What [`prepare`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareReport {
    /// Tokens in the training file.
    pub train_tokens: usize,
    /// Tokens in the validation file (0 when none was written).
    pub val_tokens: usize,
    /// The training file (the `out` argument of [`prepare`]).
    pub train_path: PathBuf,
    /// The validation file ([`val_path_for`] of the training file), or `None` when the
    /// validation fraction was 0.
    pub val_path: Option<PathBuf>,
}

impl fmt::Display for PrepareReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} train tokens -> {}",
            self.train_tokens,
            self.train_path.display()
        )?;
        if let Some(val) = &self.val_path {
            write!(f, ", {} val tokens -> {}", self.val_tokens, val.display())?;
        }
        Ok(())
    }
}

/// Tokenizes the UTF-8 text file `text_path` with `tokenizer` and writes llm.c token
/// files: the first `1 - val_fraction` of the tokens to `out`, the last `val_fraction` to
/// [`val_path_for`]`(out)` (e.g. `data/shakespeare.bin` and `data/shakespeare_val.bin`,
/// `data/x_train.bin` and `data/x_val.bin`). The parent directory of `out` is created if
/// needed; each file is written atomically.
///
/// The whole text is encoded as one document, with no `<|endoftext|>` added (for GPT-2,
/// in parallel pieces cut at whitespace, with the ids of a single encode: see
/// [`Gpt2Tokenizer`](super::Gpt2Tokenizer)), so reading the train file and then the val
/// file gives back `tokenizer.build().encode(text)`. The val part gets
/// `round(tokens × val_fraction)` tokens. (llm.c's `tinyshakespeare.py` differs: it puts
/// `<|endoftext|>` before each blank-line-separated section and takes the *first* 32,768
/// tokens as val.)
///
/// Fails if `val_fraction` is not in `[0, 1)` (0 writes no val file), if the text cannot
/// be read or is not UTF-8, if `out` is a directory or would overwrite the text, or if
/// the train part (or the val part, when there is one) would hold fewer than 2 tokens,
/// the least a training window (one input and its target) needs.
pub fn prepare(
    text_path: &Path,
    out: &Path,
    tokenizer: TokenizerKind,
    val_fraction: f64,
) -> Result<PrepareReport> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(Error::config(
            "--val-fraction",
            format!(
                "{val_fraction} is not in [0, 1): use e.g. 0.1 to keep the last 10% of the \
                 tokens for validation, or 0 to write no validation file"
            ),
        ));
    }
    if out.file_name().is_none() || out.is_dir() {
        return Err(Error::config(
            "out",
            format!(
                "`{}` {}; give the token file to write, e.g. data/shakespeare.bin",
                out.display(),
                if out.is_dir() {
                    "is a directory"
                } else {
                    "does not name a file"
                }
            ),
        ));
    }
    let val_path = (val_fraction > 0.0).then(|| val_path_for(out));
    for target in std::iter::once(out).chain(val_path.as_deref()) {
        if same_file(text_path, target) {
            return Err(Error::config(
                "out",
                format!(
                    "`{}` is the text file being prepared and would be overwritten; write \
                     the tokens to another path, e.g. one ending in .bin",
                    target.display()
                ),
            ));
        }
    }

    let text = read_text(text_path)?;
    let tokens = tokenizer.build().encode(&text);
    drop(text);
    let n = tokens.len();
    let n_val = if val_fraction > 0.0 {
        ((n as f64) * val_fraction).round() as usize
    } else {
        0
    };
    let n_train = n - n_val.min(n);
    if n_train < 2 || (val_path.is_some() && n_val < 2) {
        let split = if val_path.is_some() {
            format!(
                ", split into {n_train} train and {n_val} val tokens by --val-fraction \
                 {val_fraction}"
            )
        } else {
            String::new()
        };
        return Err(Error::data(
            format!("text file {}", text_path.display()),
            format!(
                "the text is {n} {tokenizer} tokens{split}; each part needs at least 2 \
                 (an input and its target): use a longer text{}",
                if val_path.is_some() {
                    " or another --val-fraction (0 writes no val file)"
                } else {
                    ""
                }
            ),
        ));
    }

    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    write_token_file(out, &tokens[..n_train])?;
    if let Some(val) = &val_path {
        write_token_file(val, &tokens[n_train..])?;
    } else if val_path_for(out).exists() {
        log::warn!(
            "{} exists from an earlier run and was left as it is (no val file was written)",
            val_path_for(out).display()
        );
    }
    let report = PrepareReport {
        train_tokens: n_train,
        val_tokens: n_val,
        train_path: out.to_path_buf(),
        val_path,
    };
    log::info!("prepared {}: {report}", text_path.display());
    Ok(report)
}

/// The validation file that goes with the training file `train`: the last `_train` in its
/// stem replaced by `_val` if there is one, else `_val` appended to the stem, the
/// extension kept.
///
/// `data/shakespeare.bin` → `data/shakespeare_val.bin`; `data/x_train.bin` →
/// `data/x_val.bin`; `fineweb_train_000001.bin` → `fineweb_val_000001.bin`; `data/x` →
/// `data/x_val`.
pub fn val_path_for(train: &Path) -> PathBuf {
    let stem = train.file_stem().unwrap_or_default();
    let new_stem: OsString = match stem.to_str() {
        Some(s) if s.contains("_train") => {
            let i = s.rfind("_train").unwrap_or_default();
            format!("{}_val{}", &s[..i], &s[i + "_train".len()..]).into()
        }
        _ => {
            let mut s = stem.to_os_string();
            s.push("_val");
            s
        }
    };
    let mut name = new_stem;
    if let Some(ext) = train.extension() {
        name.push(".");
        name.push(ext);
    }
    train.with_file_name(name)
}

/// Reads `path` as UTF-8 text, with errors that say what the file is instead.
fn read_text(path: &Path) -> Result<String> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    if bytes.len() >= 4 && bytes[..4] == TOKEN_FILE_MAGIC.to_le_bytes() {
        return Err(Error::data(
            format!("text file {}", path.display()),
            "this is already an llm.c token file, not text; train on it directly instead \
             of preparing it",
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::data(
            format!("text file {}", path.display()),
            format!(
                "the file is not valid UTF-8 (first bad byte at offset {}); convert it to \
                 UTF-8 first (e.g. `iconv -t UTF-8`)",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// Whether `a` and `b` are the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn val_paths() {
        let cases = [
            ("data/shakespeare.bin", "data/shakespeare_val.bin"),
            ("data/x_train.bin", "data/x_val.bin"),
            ("fineweb_train_000001.bin", "fineweb_val_000001.bin"),
            ("a_train/b_train_c.bin", "a_train/b_val_c.bin"),
            ("data/x", "data/x_val"),
            ("x.tar.bin", "x.tar_val.bin"),
        ];
        for (train, val) in cases {
            assert_eq!(val_path_for(Path::new(train)), Path::new(val), "{train}");
        }
    }
}
