//! `prepare`'s output: token shards written to temporary files as tokens arrive, and at
//! the end split into train and val and renamed into place, so that a shard is complete
//! or absent and a failed run leaves nothing behind.

use crate::data::token_file::{TokenFormat, TOKEN_FILE_HEADER_BYTES};
use crate::error::{Error, Result};
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Tokens copied at a time when moving the val tail out of the train shards.
const COPY_TOKENS: usize = 1 << 20;

/// A finished temporary shard.
struct Part {
    tmp: PathBuf,
    tokens: usize,
}

/// The shard being written.
struct Current {
    tmp: PathBuf,
    file: BufWriter<File>,
    tokens: usize,
}

/// Writes a token stream into temporary shards of at most `shard_tokens` tokens each.
pub(super) struct ShardWriter {
    dir: PathBuf,
    /// Temporary names start with this.
    prefix: String,
    format: TokenFormat,
    shard_tokens: usize,
    parts: Vec<Part>,
    current: Option<Current>,
    buf: Vec<u8>,
    total: u64,
}

impl ShardWriter {
    /// Writes into `dir`, temporary files named after `name`.
    pub fn new(dir: &Path, name: &str, format: TokenFormat, shard_tokens: usize) -> ShardWriter {
        ShardWriter {
            dir: dir.to_path_buf(),
            prefix: format!(".{name}.{}", std::process::id()),
            format,
            shard_tokens: shard_tokens.max(1),
            parts: Vec::new(),
            current: None,
            buf: Vec::new(),
            total: 0,
        }
    }

    /// Tokens written so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Appends `tokens`.
    pub fn push(&mut self, mut tokens: &[u32]) -> Result<()> {
        while !tokens.is_empty() {
            if self.current.is_none() {
                let tmp = self
                    .dir
                    .join(format!("{}.{}.tmp", self.prefix, self.parts.len()));
                let file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&tmp)
                    .map_err(|e| Error::io(&tmp, e))?;
                let mut file = BufWriter::with_capacity(1 << 20, file);
                file.write_all(&self.format.header(0))
                    .map_err(|e| Error::io(&tmp, e))?;
                self.current = Some(Current {
                    tmp,
                    file,
                    tokens: 0,
                });
            }
            let Some(cur) = self.current.as_mut() else {
                break;
            };
            let n = (self.shard_tokens - cur.tokens).min(tokens.len());
            self.buf.clear();
            self.format.encode_into(&tokens[..n], &mut self.buf);
            cur.file
                .write_all(&self.buf)
                .map_err(|e| Error::io(&cur.tmp, e))?;
            cur.tokens += n;
            self.total += n as u64;
            tokens = &tokens[n..];
            if cur.tokens == self.shard_tokens {
                self.close_current()?;
            }
        }
        Ok(())
    }

    /// Finishes the shard being written: its token count goes into its header.
    fn close_current(&mut self) -> Result<()> {
        if let Some(cur) = self.current.take() {
            let mut file = cur
                .file
                .into_inner()
                .map_err(|e| Error::io(&cur.tmp, e.into_error()))?;
            set_count(&mut file, &cur.tmp, cur.tokens)?;
            self.parts.push(Part {
                tmp: cur.tmp,
                tokens: cur.tokens,
            });
        }
        Ok(())
    }

    /// Closes the shards and moves every token from `keep` on into `tail` (the val
    /// writer), shortening or removing the shards that held them. Returns the remaining
    /// temporary shards and their token counts, in order.
    pub fn split_off(mut self, keep: u64, tail: &mut ShardWriter) -> Result<Vec<(PathBuf, usize)>> {
        self.close_current()?;
        let parts = std::mem::take(&mut self.parts);
        let result = self.move_tail(&parts, keep, tail);
        if result.is_err() {
            for part in &parts {
                let _ = fs::remove_file(&part.tmp);
            }
        }
        result
    }

    fn move_tail(
        &self,
        parts: &[Part],
        keep: u64,
        tail: &mut ShardWriter,
    ) -> Result<Vec<(PathBuf, usize)>> {
        let w = self.format.token_bytes();
        let mut start = 0u64;
        let mut kept = Vec::new();
        let mut tokens = Vec::new();
        for part in parts {
            let from = keep.saturating_sub(start).min(part.tokens as u64) as usize;
            start += part.tokens as u64;
            if from == part.tokens {
                kept.push((part.tmp.clone(), part.tokens));
                continue;
            }
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&part.tmp)
                .map_err(|e| Error::io(&part.tmp, e))?;
            file.seek(SeekFrom::Start((TOKEN_FILE_HEADER_BYTES + from * w) as u64))
                .map_err(|e| Error::io(&part.tmp, e))?;
            let mut left = part.tokens - from;
            let mut bytes = vec![0u8; COPY_TOKENS.min(left) * w];
            while left > 0 {
                let n = COPY_TOKENS.min(left);
                file.read_exact(&mut bytes[..n * w])
                    .map_err(|e| Error::io(&part.tmp, e))?;
                tokens.clear();
                self.format.decode_into(&bytes[..n * w], &mut tokens);
                tail.push(&tokens)?;
                left -= n;
            }
            if from == 0 {
                fs::remove_file(&part.tmp).map_err(|e| Error::io(&part.tmp, e))?;
            } else {
                file.set_len((TOKEN_FILE_HEADER_BYTES + from * w) as u64)
                    .map_err(|e| Error::io(&part.tmp, e))?;
                set_count(&mut file, &part.tmp, from)?;
                kept.push((part.tmp.clone(), from));
            }
        }
        Ok(kept)
    }

    /// Closes the shards and returns them with their token counts, in order.
    pub fn finish(mut self) -> Result<Vec<(PathBuf, usize)>> {
        self.close_current()?;
        Ok(std::mem::take(&mut self.parts)
            .into_iter()
            .map(|p| (p.tmp.clone(), p.tokens))
            .collect())
    }
}

impl Drop for ShardWriter {
    /// Removes the temporary files of a writer that did not finish.
    fn drop(&mut self) {
        if let Some(cur) = self.current.take() {
            let _ = fs::remove_file(cur.tmp);
        }
        for part in &self.parts {
            let _ = fs::remove_file(&part.tmp);
        }
    }
}

/// Writes `count` into the header of `file` and flushes it to disk.
fn set_count(file: &mut File, path: &Path, count: usize) -> Result<()> {
    let count = i32::try_from(count).map_err(|_| {
        Error::data(
            format!("token file {}", path.display()),
            format!(
                "{count} tokens is more than the {} one token file's i32 header can count; \
                 write shards (--shard-tokens N)",
                i32::MAX
            ),
        )
    })?;
    let io = |e| Error::io(path, e);
    file.seek(SeekFrom::Start(8)).map_err(io)?;
    file.write_all(&count.to_le_bytes()).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Renames finished temporary shards to their names; a failure removes the temporary
/// files not yet renamed.
pub(super) fn commit(files: Vec<(PathBuf, PathBuf)>) -> Result<()> {
    let mut result = Ok(());
    for (tmp, path) in &files {
        if result.is_ok() {
            result = fs::rename(tmp, path).map_err(|e| Error::io(path, e));
        }
        if result.is_err() {
            let _ = fs::remove_file(tmp);
        }
    }
    if let Some((_, path)) = files.first() {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    result
}

/// Removes temporary shards (after a failure).
pub(super) fn discard(files: &[(PathBuf, usize)]) {
    for (tmp, _) in files {
        let _ = fs::remove_file(tmp);
    }
}
