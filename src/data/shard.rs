//! One shard of token data: an llm.c token file mapped into memory (never read whole), or
//! tokens already in memory; either viewed whole or as a range, with the tokens' flags
//! (loss mask, document starts: [`super::token_flags`]) when the data has them.

use super::token_file::{parse_header, TokenFormat, TOKEN_FILE_HEADER_BYTES};
use super::token_flags::{check_flags_file, flags_path_for};
use crate::error::{Error, Result};
use crate::mapped::release;
use memmap2::Mmap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tokens scanned at a time when checking ids, so a check never holds more than this much
/// of a mapped file in memory.
const SCAN_TOKENS: usize = 1 << 21;

/// A run of tokens: a memory-mapped token file (ids stay in the file's 16- or 32-bit form;
/// the pages a read touches are handed back to the kernel right after), or ids in memory.
/// Cloning is cheap: clones share the mapping.
#[derive(Clone)]
pub struct Shard {
    source: Arc<Source>,
    /// First token of this view within the source.
    start: usize,
    /// Tokens in this view.
    len: usize,
}

enum Source {
    Mapped {
        path: PathBuf,
        map: Mmap,
        format: TokenFormat,
        /// The sibling flags file, mapped (header included).
        flags: Option<Mmap>,
        /// The rows the flags file says the tokens are laid out in.
        row_len: Option<usize>,
    },
    Memory {
        tokens: Arc<[u32]>,
        flags: Option<Arc<[u8]>>,
    },
}

impl Shard {
    /// Maps the token file at `path` after checking its header and length (see
    /// [`read_token_file`](super::read_token_file) for the errors); ids are checked
    /// separately, by [`Shard::check_ids`].
    pub fn open(path: &Path) -> Result<Shard> {
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut header = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES);
        (&mut file)
            .take(TOKEN_FILE_HEADER_BYTES as u64)
            .read_to_end(&mut header)
            .map_err(|e| Error::io(path, e))?;
        let (format, len) = parse_header(path, &header, file_len)?;
        // SAFETY: the mapping is read-only and shared; the file is not written by this
        // process while mapped. Another process truncating it would fault, as with every
        // memory-mapped reader (llm.c's readers share the same assumption); token files are
        // written once, atomically, by renaming a complete file into place.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if (map.len() as u64) != file_len {
            return Err(Error::data(
                format!("token file {}", path.display()),
                "changed size while it was being opened; is it still being written?",
            ));
        }
        let (flags, row_len) = match open_flags(&flags_path_for(path), len)? {
            Some((map, row_len)) => (Some(map), row_len),
            None => (None, None),
        };
        Ok(Shard {
            source: Arc::new(Source::Mapped {
                path: path.to_path_buf(),
                map,
                format,
                flags,
                row_len,
            }),
            start: 0,
            len,
        })
    }

    /// A shard of ids held in memory.
    pub fn from_tokens(tokens: impl Into<Arc<[u32]>>) -> Shard {
        let tokens = tokens.into();
        Shard {
            start: 0,
            len: tokens.len(),
            source: Arc::new(Source::Memory {
                tokens,
                flags: None,
            }),
        }
    }

    /// A shard of ids held in memory with their flags (one byte per token, see
    /// [`super::token_flags`]); fails unless there is one flag per token.
    pub fn from_tokens_and_flags(
        tokens: impl Into<Arc<[u32]>>,
        flags: impl Into<Arc<[u8]>>,
    ) -> Result<Shard> {
        let (tokens, flags) = (tokens.into(), flags.into());
        if tokens.len() != flags.len() {
            return Err(Error::data(
                "token flags",
                format!(
                    "{} flags for {} tokens; give one flag byte per token",
                    flags.len(),
                    tokens.len()
                ),
            ));
        }
        Ok(Shard {
            start: 0,
            len: tokens.len(),
            source: Arc::new(Source::Memory {
                tokens,
                flags: Some(flags),
            }),
        })
    }

    /// The length of the rows the tokens are laid out in (one example each, as `prepare
    /// --chat` writes them): a loader must read rows of exactly this length. `None` for a
    /// stream.
    pub fn row_len(&self) -> Option<usize> {
        match &*self.source {
            Source::Mapped { row_len, .. } => *row_len,
            Source::Memory { .. } => None,
        }
    }

    /// Whether the shard's tokens carry flags (a loss mask, document starts).
    pub fn has_flags(&self) -> bool {
        match &*self.source {
            Source::Mapped { flags, .. } => flags.is_some(),
            Source::Memory { flags, .. } => flags.is_some(),
        }
    }

    /// Appends the flags of tokens `start .. start + n` to `out` and returns true, or
    /// returns false when the shard has none (every target trains).
    ///
    /// # Panics
    /// If the range is not within the shard.
    pub fn read_flags_into(&self, start: usize, n: usize, out: &mut Vec<u8>) -> bool {
        let first = self.source_index(start, n);
        match &*self.source {
            Source::Memory {
                flags: Some(flags), ..
            } => out.extend_from_slice(&flags[first..first + n]),
            Source::Mapped {
                flags: Some(map), ..
            } => {
                let begin = TOKEN_FILE_HEADER_BYTES + first;
                out.extend_from_slice(&map[begin..begin + n]);
                release(map, begin, n);
            }
            _ => return false,
        }
        true
    }

    /// Tokens in the shard.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file behind the shard, if it is one.
    pub fn path(&self) -> Option<&Path> {
        match &*self.source {
            Source::Mapped { path, .. } => Some(path),
            Source::Memory { .. } => None,
        }
    }

    /// The token format of the file behind the shard, if it is one.
    pub fn format(&self) -> Option<TokenFormat> {
        match &*self.source {
            Source::Mapped { format, .. } => Some(*format),
            Source::Memory { .. } => None,
        }
    }

    /// The shard's name in messages: its file, or "tokens in memory", with the range when
    /// it is a part.
    pub fn name(&self) -> String {
        let whole = match &*self.source {
            Source::Mapped { path, .. } => format!("token file {}", path.display()),
            Source::Memory { .. } => "tokens in memory".to_string(),
        };
        if self.start == 0 && self.len == self.source_len() {
            whole
        } else {
            format!("{whole} (tokens {}..{})", self.start, self.start + self.len)
        }
    }

    /// The index in the source of this view's token `start`, for a read of `n` tokens.
    ///
    /// # Panics
    /// If the range is not within the shard.
    fn source_index(&self, start: usize, n: usize) -> usize {
        assert!(
            start + n <= self.len,
            "read past the end of {}",
            self.name()
        );
        self.start + start
    }

    fn source_len(&self) -> usize {
        match &*self.source {
            Source::Mapped { map, format, .. } => {
                (map.len() - TOKEN_FILE_HEADER_BYTES) / format.token_bytes()
            }
            Source::Memory { tokens, .. } => tokens.len(),
        }
    }

    /// The tokens `range` of this shard as a shard of its own (sharing the mapping).
    ///
    /// # Panics
    /// If `range` is not within `0..len()`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Shard {
        assert!(range.start <= range.end && range.end <= self.len);
        Shard {
            source: Arc::clone(&self.source),
            start: self.start + range.start,
            len: range.end - range.start,
        }
    }

    /// Appends tokens `start .. start + n` of the shard to `out`.
    ///
    /// # Panics
    /// If the range is not within the shard.
    pub fn read_into(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        let first = self.source_index(start, n);
        match &*self.source {
            Source::Memory { tokens, .. } => out.extend_from_slice(&tokens[first..first + n]),
            Source::Mapped { map, format, .. } => {
                let w = format.token_bytes();
                let begin = TOKEN_FILE_HEADER_BYTES + first * w;
                format.decode_into(&map[begin..begin + n * w], out);
                release(map, begin, n * w);
            }
        }
    }

    /// Checks that every id is below `vocab_size`; the error names the shard, the token's
    /// index in its file and the id. Scans a mapped file a piece at a time, handing each
    /// piece back to the kernel, so memory does not grow with the file.
    pub fn check_ids(&self, vocab_size: usize) -> Result<()> {
        let limit = vocab_size as u64;
        let bad = |index: usize, id: u64| {
            Error::data(
                self.name(),
                format!(
                    "token {index} is id {id}, beyond the model's vocabulary of {vocab_size}; \
                     raise model.vocab_size (--vocab-size) or use data made with the model's \
                     tokenizer"
                ),
            )
        };
        match &*self.source {
            Source::Memory { tokens, .. } => {
                let view = &tokens[self.start..self.start + self.len];
                match view.iter().position(|&id| u64::from(id) >= limit) {
                    Some(i) => Err(bad(self.start + i, u64::from(view[i]))),
                    None => Ok(()),
                }
            }
            Source::Mapped { map, format, .. } => {
                if limit >= format.id_limit() {
                    return Ok(());
                }
                let w = format.token_bytes();
                let mut at = self.start;
                let end = self.start + self.len;
                while at < end {
                    let n = SCAN_TOKENS.min(end - at);
                    let begin = TOKEN_FILE_HEADER_BYTES + at * w;
                    let found = format.find_id_at_least(&map[begin..begin + n * w], limit);
                    release(map, begin, n * w);
                    if let Some((i, id)) = found {
                        return Err(bad(at + i, id));
                    }
                    at += n;
                }
                Ok(())
            }
        }
    }
}

/// Maps the flags file at `path` when there is one, checked against its token file's
/// `tokens` tokens, with its row length.
fn open_flags(path: &Path, tokens: usize) -> Result<Option<(Mmap, Option<usize>)>> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    // SAFETY: as for the token file in `Shard::open`: a read-only shared mapping of a file
    // written once, atomically.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let row_len = check_flags_file(path, &map, tokens)?;
    Ok(Some((map, row_len)))
}

impl fmt::Debug for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shard")
            .field("name", &self.name())
            .field("len", &self.len)
            .finish()
    }
}
