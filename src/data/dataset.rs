//! A dataset of token shards: what `--data` names (a token file, a glob of shards or a
//! directory), and where its validation shards are.

use super::shard::Shard;
use super::token_file::TokenFormat;
use super::val_path_for;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Token shards read in order, each memory-mapped ([`Shard`]); or tokens in memory, as one
/// shard. All the files of a dataset share one [`TokenFormat`].
#[derive(Clone, Debug)]
pub struct TokenDataset {
    shards: Vec<Shard>,
}

impl TokenDataset {
    /// The training shards `spec` names:
    ///
    /// - a token file: that file;
    /// - a glob (`data/fineweb_train_*.bin`): the files it matches, in sorted order;
    /// - a directory: its `.bin` files, in sorted order.
    ///
    /// From a glob or a directory, files whose name has a `val` part between underscores
    /// (`x_val.bin`, `fineweb_val_000000.bin`) are validation shards and left out (see
    /// [`TokenDataset::open_val_for`]). Every file is checked (header, length, one token
    /// format for all); ids are checked by [`TokenDataset::check_ids`].
    pub fn open(spec: &Path) -> Result<TokenDataset> {
        let listing = Listing::of(spec)?;
        if listing.train.is_empty() {
            return Err(Error::data(
                spec.display().to_string(),
                format!(
                    "holds only validation shards ({}); name the training shards, e.g. \
                     data/NAME_*.bin or data/NAME_train_*.bin",
                    listing.val.len()
                ),
            ));
        }
        TokenDataset::from_files(&listing.train)
    }

    /// The validation shards that go with the training data `spec`, if there are any:
    ///
    /// - beside a token file `x.bin` (or `x_train.bin`), `x_val.bin` (`x_val.bin`): llm.c's
    ///   naming, see [`val_path_for`];
    /// - from a glob or a directory, its files with a `val` part in their name; when it
    ///   has none, a glob's `_train` replaced by `_val` (`fineweb_train_*.bin` →
    ///   `fineweb_val_*.bin`).
    pub fn open_val_for(spec: &Path) -> Result<Option<TokenDataset>> {
        let listing = Listing::of(spec)?;
        if !listing.val.is_empty() {
            return TokenDataset::from_files(&listing.val).map(Some);
        }
        match listing.kind {
            SpecKind::File => {
                let val = val_path_for(spec);
                if val != spec && val.is_file() {
                    return TokenDataset::from_files(&[val]).map(Some);
                }
            }
            SpecKind::Glob => {
                let text = spec.to_string_lossy();
                if let Some(i) = text.rfind("_train") {
                    let pattern = format!("{}_val{}", &text[..i], &text[i + "_train".len()..]);
                    let files = glob_files(&pattern)?;
                    if !files.is_empty() {
                        return TokenDataset::from_files(&files).map(Some);
                    }
                }
            }
            SpecKind::Directory => {}
        }
        Ok(None)
    }

    /// Every shard `spec` names, validation shards included (what `--val-data` names).
    pub fn open_all(spec: &Path) -> Result<TokenDataset> {
        let listing = Listing::of(spec)?;
        let mut files = listing.train;
        files.extend(listing.val);
        files.sort();
        TokenDataset::from_files(&files)
    }

    /// Opens `files` as one dataset, in the order given.
    ///
    /// Fails, naming the file, on a file that is missing or not a valid token file, and
    /// when the files mix the u16 and u32 formats.
    pub fn from_files(files: &[PathBuf]) -> Result<TokenDataset> {
        let mut shards: Vec<Shard> = Vec::with_capacity(files.len());
        for path in files {
            let shard = Shard::open(path)?;
            if let (Some(first), Some(format)) = (shards.first(), shard.format()) {
                let want = first.format().unwrap_or(format);
                if format != want {
                    return Err(Error::data(
                        format!("token file {}", path.display()),
                        format!(
                            "is in the {format} format but {} is {want}; the shards of one \
                             dataset must share a format: re-create them with `trainkit \
                             prepare`",
                            first.path().unwrap_or(Path::new("?")).display()
                        ),
                    ));
                }
            }
            shards.push(shard);
        }
        if shards.is_empty() {
            return Err(Error::data("token files", "none given"));
        }
        Ok(TokenDataset { shards })
    }

    /// A dataset of the given shards, in order.
    pub fn from_shards(shards: Vec<Shard>) -> TokenDataset {
        TokenDataset { shards }
    }

    /// The shards, in order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Tokens in all shards.
    pub fn len_tokens(&self) -> usize {
        self.shards.iter().map(Shard::len).sum()
    }

    /// The token format of the files (`None` for tokens in memory).
    pub fn format(&self) -> Option<TokenFormat> {
        self.shards.first().and_then(Shard::format)
    }

    /// Whether any position trains: a shard without flags trains every target; with flags,
    /// one [`super::token_flags::TRAINED`] bit is enough (read a megabyte at a time, up to
    /// the first).
    pub fn trains_any(&self) -> bool {
        const CHUNK: usize = 1 << 20;
        let mut flags = Vec::with_capacity(CHUNK);
        self.shards.iter().any(|s| {
            (0..s.len()).step_by(CHUNK).any(|start| {
                flags.clear();
                let n = CHUNK.min(s.len() - start);
                !s.read_flags_into(start, n, &mut flags)
                    || flags.iter().any(|f| f & super::token_flags::TRAINED != 0)
            })
        })
    }

    /// Checks every id of every shard against `vocab_size` (see [`Shard::check_ids`]).
    pub fn check_ids(&self, vocab_size: usize) -> Result<()> {
        self.shards.iter().try_for_each(|s| s.check_ids(vocab_size))
    }

    /// Splits off the last `n` tokens of the last shard: `(the rest, those n)`; the held-out
    /// part of a dataset that has no validation shards. A shard of rows (one example each,
    /// [`Shard::row_len`]) is split between rows, holding out at least `n` tokens.
    pub fn split_tail(&self, n: usize) -> (TokenDataset, TokenDataset) {
        let mut head = self.shards.clone();
        let last = head.pop().unwrap_or_else(|| Shard::from_tokens(Vec::new()));
        let n = n.min(last.len());
        // Rows of examples are split between rows; the head keeps the next row's first
        // token (untrained) as its last row's final target.
        let (split, head_end) = match last.row_len() {
            Some(t) => {
                let split = (last.len() - n) / t * t;
                (split, (split + 1).min(last.len()))
            }
            None => (last.len() - n, last.len() - n),
        };
        head.push(last.slice(0..head_end));
        (
            TokenDataset { shards: head },
            TokenDataset {
                shards: vec![last.slice(split..last.len())],
            },
        )
    }

    /// A short description for messages: the file, or the first and last of the shards.
    pub fn describe(&self) -> String {
        match self.shards.as_slice() {
            [] => "no tokens".to_string(),
            [one] => one.name(),
            [first, .., last] => format!(
                "{} shards, {} .. {}",
                self.shards.len(),
                first.path().unwrap_or(Path::new("?")).display(),
                last.path().unwrap_or(Path::new("?")).display()
            ),
        }
    }
}

impl From<Vec<u32>> for TokenDataset {
    fn from(tokens: Vec<u32>) -> Self {
        TokenDataset::from_shards(vec![Shard::from_tokens(tokens)])
    }
}

impl From<Arc<[u32]>> for TokenDataset {
    fn from(tokens: Arc<[u32]>) -> Self {
        TokenDataset::from_shards(vec![Shard::from_tokens(tokens)])
    }
}

impl From<&[u32]> for TokenDataset {
    fn from(tokens: &[u32]) -> Self {
        TokenDataset::from(tokens.to_vec())
    }
}

/// Whether `spec` names more than one file: a glob pattern (with `*`, `?` or `[`) or a
/// directory.
pub fn is_shard_spec(spec: &Path) -> bool {
    spec.is_dir() || (!spec.exists() && has_glob_chars(spec))
}

fn has_glob_chars(spec: &Path) -> bool {
    spec.to_string_lossy().contains(['*', '?', '['])
}

/// Whether a shard's file name marks it as validation data: a `val` part between
/// underscores in its stem (`x_val`, `fineweb_val_000000`, `val_3`).
pub fn is_val_shard(path: &Path) -> bool {
    path.file_stem()
        .and_then(|s| s.to_str())
        .is_some_and(|s| s.split('_').any(|part| part == "val"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SpecKind {
    File,
    Glob,
    Directory,
}

/// The files a data spec names, split into training and validation shards.
struct Listing {
    kind: SpecKind,
    train: Vec<PathBuf>,
    val: Vec<PathBuf>,
}

impl Listing {
    fn of(spec: &Path) -> Result<Listing> {
        if spec.is_dir() {
            let entries = std::fs::read_dir(spec).map_err(|e| Error::io(spec, e))?;
            let mut files = Vec::new();
            for entry in entries {
                let path = entry.map_err(|e| Error::io(spec, e))?.path();
                if path.is_file() && path.extension().is_some_and(|x| x == "bin") {
                    files.push(path);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(Error::data(
                    format!("directory {}", spec.display()),
                    "holds no .bin token files; write shards into it with `trainkit prepare \
                     --shard-tokens N --out DIR/NAME.bin`",
                ));
            }
            return Ok(Listing::split(SpecKind::Directory, files));
        }
        if !spec.exists() && has_glob_chars(spec) {
            let files = glob_files(&spec.to_string_lossy())?;
            if files.is_empty() {
                return Err(Error::data(
                    format!("pattern {}", spec.display()),
                    "matches no file; check the directory and the pattern (e.g. \
                     data/fineweb_train_*.bin)",
                ));
            }
            return Ok(Listing::split(SpecKind::Glob, files));
        }
        Ok(Listing {
            kind: SpecKind::File,
            train: vec![spec.to_path_buf()],
            val: Vec::new(),
        })
    }

    fn split(kind: SpecKind, files: Vec<PathBuf>) -> Listing {
        let (val, train) = files.into_iter().partition(|p| is_val_shard(p));
        Listing { kind, train, val }
    }
}

/// The files `pattern` matches, sorted.
fn glob_files(pattern: &str) -> Result<Vec<PathBuf>> {
    let paths = glob::glob(pattern).map_err(|e| {
        Error::data(
            format!("pattern {pattern}"),
            format!("is not a valid glob pattern: {e}"),
        )
    })?;
    let mut files = Vec::new();
    for entry in paths {
        let path = entry.map_err(|e| {
            let path = e.path().to_path_buf();
            Error::io(path, e.into())
        })?;
        if path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn val_shard_names() {
        for val in [
            "x_val.bin",
            "fineweb_val_000000.bin",
            "val_3.bin",
            "a/b_val",
        ] {
            assert!(is_val_shard(Path::new(val)), "{val}");
        }
        for train in [
            "x.bin",
            "interval_1.bin",
            "fineweb_train_000001.bin",
            "valid.bin",
        ] {
            assert!(!is_val_shard(Path::new(train)), "{train}");
        }
    }
}
