//! `trainkit prepare`: text files or JSON lines, streamed through a tokenizer into llm.c
//! token files (train and val, whole or in shards), with bounded memory whatever the size
//! of the input.

mod input;
mod writer;

pub use input::InputKind;

use super::token_file::TokenFormat;
use super::TokenizerKind;
use crate::error::{Error, Result};
use input::{Input, Piece, Reader};
use rayon::prelude::*;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use writer::ShardWriter;

/// Text in one piece handed to the tokenizer (the pieces of a batch are tokenized in
/// parallel).
const PIECE_BYTES: usize = 256 << 10;

/// Text read before the batch is tokenized and written: with the tokens, what `prepare`
/// holds in memory.
const BATCH_BYTES: usize = 32 << 20;

/// What [`prepare_with`] reads and writes.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareOptions {
    /// Inputs in order, each a file or a glob (matches in sorted order), and how it holds
    /// its documents.
    pub inputs: Vec<(PathBuf, InputKind)>,
    /// The train token file; with `shard_tokens`, the name the shards are numbered from
    /// (`data/NAME.bin` → `data/NAME_000000.bin`, ...).
    pub out: PathBuf,
    /// The tokenizer.
    pub tokenizer: TokenizerKind,
    /// Fraction of the tokens, from the end, written to the val file(s), in `[0, 1)`.
    pub val_fraction: f64,
    /// Tokens per shard; `None` writes one train file (and one val file).
    pub shard_tokens: Option<usize>,
}

/// How far [`prepare_with`] has got.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrepareProgress {
    /// Input bytes read and tokenized.
    pub bytes: u64,
    /// Input bytes in all.
    pub total_bytes: u64,
    /// Tokens written.
    pub tokens: u64,
    /// Documents read.
    pub documents: u64,
    /// Time since the start.
    pub elapsed: Duration,
}

/// What [`prepare`] and [`prepare_with`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareReport {
    /// Tokens in the training files.
    pub train_tokens: usize,
    /// Tokens in the validation files (0 when none was written).
    pub val_tokens: usize,
    /// The training files: the `out` argument, or its shards in order.
    pub train_files: Vec<PathBuf>,
    /// The validation files ([`val_path_for`] of the training file, or its shards); empty
    /// when the validation fraction was 0.
    pub val_files: Vec<PathBuf>,
    /// Documents read (a text file is one, a JSON line is one).
    pub documents: u64,
    /// Input bytes read.
    pub bytes: u64,
}

impl fmt::Display for PrepareReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let files = |files: &[PathBuf]| match files {
            [one] => one.display().to_string(),
            [first, .., last] => format!(
                "{} shards {} .. {}",
                files.len(),
                first.display(),
                last.display()
            ),
            [] => "nothing".to_string(),
        };
        write!(
            f,
            "{} train tokens -> {}",
            self.train_tokens,
            files(&self.train_files)
        )?;
        if !self.val_files.is_empty() {
            write!(
                f,
                ", {} val tokens -> {}",
                self.val_tokens,
                files(&self.val_files)
            )?;
        }
        Ok(())
    }
}

/// Tokenizes the UTF-8 text file `text_path` with `tokenizer` and writes llm.c token
/// files: the first `1 - val_fraction` of the tokens to `out`, the last `val_fraction` to
/// [`val_path_for`]`(out)` (e.g. `data/shakespeare.bin` and `data/shakespeare_val.bin`,
/// `data/x_train.bin` and `data/x_val.bin`). [`prepare_with`] with one text input and no
/// shards; see there.
pub fn prepare(
    text_path: &Path,
    out: &Path,
    tokenizer: TokenizerKind,
    val_fraction: f64,
) -> Result<PrepareReport> {
    prepare_with(
        &PrepareOptions {
            inputs: vec![(text_path.to_path_buf(), InputKind::Text)],
            out: out.to_path_buf(),
            tokenizer,
            val_fraction,
            shard_tokens: None,
        },
        &mut |_| {},
    )
}

/// Streams the inputs through the tokenizer into llm.c token files, calling `progress`
/// after every batch.
///
/// Each text file is one document and each JSON line one document (its `text` field);
/// like llm.c's data scripts, the tokenizer's end-of-text token (GPT-2's `<|endoftext|>`,
/// 50256; for a Hugging Face `tokenizer.json`, the one [`HfTokenizer`](super::HfTokenizer)
/// finds) goes before every document; the byte tokenizer has none (nor may a
/// `tokenizer.json`), so documents simply follow each other. Text is read a block at a
/// time, cut only where GPT-2's pre-tokenizer always splits (so the ids equal those of
/// tokenizing each document whole, with the exception documented on
/// [`Gpt2Tokenizer`](super::Gpt2Tokenizer); preferably at a single space between words,
/// so the same holds for a `tokenizer.json` whose pre-tokenizer splits there, as the
/// byte-level BPE of GPT-2, Llama 3 and Qwen and whitespace pre-tokenizers do, while one
/// that puts a `▁` before the start of its text, as Llama 2's and Mistral's do, gets one
/// more `▁` at each cut, one in about 256 KiB of a text file), tokenized in parallel and
/// written in order; memory stays bounded whatever the input size.
///
/// The last `round(tokens × val_fraction)` tokens go to the val file(s). Without
/// `shard_tokens` the train tokens go to `out` and the val tokens to [`val_path_for`]`(out)`;
/// with it, both are cut into shards of `shard_tokens` tokens (the last one shorter):
/// `NAME_000000.bin`, `NAME_000001.bin`, ... and `NAME_val_000000.bin`, ... (for `out` =
/// `NAME.bin`; `x_train.bin` gives `x_train_000000.bin` and `x_val_000000.bin`). The token
/// format is u16, or u32 for a vocabulary above 65536.
///
/// Nothing appears before the whole input has been read: tokens go to temporary files,
/// renamed into place at the end, each complete; a failure removes them. Fails if the
/// tokenizer cannot be read (a `tokenizer.json` missing or not one) or cannot encode the
/// text, if
/// `val_fraction` is not in `[0, 1)` (0 writes no val file), if an input is missing, not
/// UTF-8, a token file, or (JSON lines) a line that is not an object with a `text` string
/// (the error names the file and line), if a glob matches nothing, if `out` is a directory
/// or would overwrite an input, or if the train part (or the val part, when there is one)
/// would hold fewer than 2 tokens, the least a training window needs.
pub fn prepare_with(
    options: &PrepareOptions,
    progress: &mut dyn FnMut(&PrepareProgress),
) -> Result<PrepareReport> {
    let PrepareOptions {
        out,
        tokenizer,
        val_fraction,
        shard_tokens,
        ..
    } = options;
    let (val_fraction, shard_tokens) = (*val_fraction, *shard_tokens);
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(Error::config(
            "--val-fraction",
            format!(
                "{val_fraction} is not in [0, 1): use e.g. 0.1 to keep the last 10% of the \
                 tokens for validation, or 0 to write no validation file"
            ),
        ));
    }
    if let Some(n) = shard_tokens {
        if !(2..=i32::MAX as usize).contains(&n) {
            return Err(Error::config(
                "--shard-tokens",
                format!(
                    "{n} is not between 2 and {} (what a token file can count); llm.c's \
                     FineWeb shards hold 100000000",
                    i32::MAX
                ),
            ));
        }
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
    let inputs = resolve_inputs(&options.inputs)?;
    let tok = tokenizer.build()?;
    let eot = tok.end_of_text();
    if eot.is_none() && tokenizer.hf_path().is_some() {
        log::warn!(
            "the tokenizer {tokenizer} has no end-of-text token (no eos_token in a \
             tokenizer_config.json beside it, none of {} among its special tokens): the \
             documents are written with nothing between them",
            super::END_OF_TEXT_TOKENS.join(" ")
        );
    }
    let train_name = |i: usize| match shard_tokens {
        Some(_) => numbered(out, i),
        None => out.clone(),
    };
    let val_out = val_path_for(out);
    let val_name = |i: usize| match shard_tokens {
        Some(_) => numbered(&val_out, i),
        None => val_out.clone(),
    };
    for input in &inputs {
        for target in [train_name(0), val_name(0)] {
            if same_file(&input.path, &target) {
                return Err(Error::config(
                    "out",
                    format!(
                        "`{}` is an input being prepared and would be overwritten; write \
                         the tokens to another path, e.g. one ending in .bin",
                        target.display()
                    ),
                ));
            }
        }
    }

    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let stem = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let format = TokenFormat::for_vocab(tok.vocab_size());
    let per_file = shard_tokens.unwrap_or(usize::MAX);
    let mut train = ShardWriter::new(&dir, &stem, format, per_file);
    let total_bytes = inputs.iter().map(|i| i.len).sum();
    let mut reader = Reader::new(inputs);
    let start = Instant::now();
    loop {
        let mut batch: Vec<Vec<Piece>> = Vec::new();
        let mut bytes = 0;
        while bytes < BATCH_BYTES {
            let Some(unit) = reader.next_unit(PIECE_BYTES)? else {
                break;
            };
            bytes += unit.iter().map(|p| p.text.len()).sum::<usize>().max(1);
            batch.push(unit);
        }
        if batch.is_empty() {
            break;
        }
        let encoded: Vec<Vec<u32>> = batch
            .par_iter()
            .map(|unit| {
                let mut ids = Vec::with_capacity(unit.iter().map(|p| p.text.len() / 3).sum());
                for piece in unit {
                    if let (true, Some(eot)) = (piece.starts_document, eot) {
                        ids.push(eot);
                    }
                    ids.extend(tok.try_encode(&piece.text)?);
                }
                Ok(ids)
            })
            .collect::<Result<_>>()?;
        drop(batch);
        for ids in &encoded {
            train.push(ids)?;
        }
        progress(&PrepareProgress {
            bytes: reader.bytes_read,
            total_bytes,
            tokens: train.total(),
            documents: reader.documents,
            elapsed: start.elapsed(),
        });
    }

    let n = train.total() as usize;
    let n_val = if val_fraction > 0.0 {
        ((n as f64) * val_fraction).round() as usize
    } else {
        0
    };
    let n_train = n - n_val.min(n);
    let with_val = val_fraction > 0.0;
    if n_train < 2 || (with_val && n_val < 2) {
        let split = if with_val {
            format!(
                ", split into {n_train} train and {n_val} val tokens by --val-fraction \
                 {val_fraction}"
            )
        } else {
            String::new()
        };
        let what = match options.inputs.as_slice() {
            [(path, InputKind::Text)] => format!("text file {}", path.display()),
            _ => "the inputs".to_string(),
        };
        return Err(Error::data(
            what,
            format!(
                "the text is {n} {tokenizer} tokens{split}; each part needs at least 2 \
                 (an input and its target): use a longer text{}",
                if with_val {
                    " or another --val-fraction (0 writes no val file)"
                } else {
                    ""
                }
            ),
        ));
    }
    if shard_tokens.is_none() && n_train.max(n_val) > i32::MAX as usize {
        return Err(Error::data(
            format!("token file {}", out.display()),
            format!(
                "{} tokens do not fit in one token file (at most {}); write shards with \
                 --shard-tokens, e.g. 100000000",
                n_train.max(n_val),
                i32::MAX
            ),
        ));
    }
    let val_stem = val_out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut val = ShardWriter::new(&dir, &val_stem, format, per_file);
    let train_parts = train.split_off(n_train as u64, &mut val)?;
    let val_parts = match val.finish() {
        Ok(parts) => parts,
        Err(e) => {
            writer::discard(&train_parts);
            return Err(e);
        }
    };
    let mut renames = Vec::new();
    let mut train_files = Vec::new();
    for (i, (tmp, _)) in train_parts.into_iter().enumerate() {
        train_files.push(train_name(i));
        renames.push((tmp, train_name(i)));
    }
    let mut val_files = Vec::new();
    for (i, (tmp, _)) in val_parts.into_iter().enumerate() {
        val_files.push(val_name(i));
        renames.push((tmp, val_name(i)));
    }
    writer::commit(renames)?;
    if !with_val && val_name(0).exists() {
        log::warn!(
            "{} exists from an earlier run and was left as it is (no val file was written)",
            val_name(0).display()
        );
    }
    if shard_tokens.is_some() {
        for stale in [
            train_name(train_files.len()),
            val_name(val_files.len().max(1)),
        ] {
            if stale.exists() {
                log::warn!(
                    "{} exists from an earlier run with more shards; a glob over the shards \
                     would read it too: remove it",
                    stale.display()
                );
            }
        }
    }
    let report = PrepareReport {
        train_tokens: n_train,
        val_tokens: n - n_train,
        train_files,
        val_files,
        documents: reader.documents,
        bytes: reader.bytes_read,
    };
    log::info!("prepared: {report}");
    Ok(report)
}

/// `dir/STEM_00000i.EXT` for `dir/STEM.EXT`.
fn numbered(path: &Path, i: usize) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}_{i:06}.{}", ext.to_string_lossy()),
        None => format!("{stem}_{i:06}"),
    };
    path.with_file_name(name)
}

/// The input files: each spec a file, or a glob whose matches are taken in sorted order.
fn resolve_inputs(specs: &[(PathBuf, InputKind)]) -> Result<Vec<Input>> {
    if specs.is_empty() {
        return Err(Error::config(
            "--text/--jsonl",
            "no input given; name text files with --text or JSON lines with --jsonl",
        ));
    }
    let mut inputs = Vec::new();
    for (spec, kind) in specs {
        let text = spec.to_string_lossy();
        let paths = if !spec.exists() && text.contains(['*', '?', '[']) {
            let matches = glob::glob(&text).map_err(|e| {
                Error::data(
                    format!("pattern {text}"),
                    format!("is not a valid glob pattern: {e}"),
                )
            })?;
            let mut paths: Vec<PathBuf> = matches
                .filter_map(|m| m.ok())
                .filter(|p| p.is_file())
                .collect();
            paths.sort();
            if paths.is_empty() {
                return Err(Error::data(
                    format!("pattern {text}"),
                    "matches no file; check the directory and the pattern (quote it so the \
                     shell does not expand it)",
                ));
            }
            paths
        } else {
            vec![spec.clone()]
        };
        for path in paths {
            let meta = fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
            if meta.is_dir() {
                return Err(Error::data(
                    path.display().to_string(),
                    "is a directory; name its files, e.g. DIR/*.txt or DIR/*.jsonl",
                ));
            }
            inputs.push(Input {
                path,
                kind: *kind,
                len: meta.len(),
            });
        }
    }
    Ok(inputs)
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
