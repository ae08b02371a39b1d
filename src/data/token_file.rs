//! llm.c's token file format: a header of 256 little-endian `i32`, then the tokens as
//! little-endian `u16`.
//!
//! The header holds `header[0] = 20240520` (the magic number), `header[1] = 1` (the
//! version: `u16` tokens) and `header[2]` = the number of tokens; the other 253 entries are
//! zero. Files written here are read by llm.c's data loader and the other way round.

use crate::error::{Error, Result};
use crate::save::write_atomically;
use std::fs;
use std::io::Read;
use std::path::Path;

/// The magic number in `header[0]` of an llm.c token file.
pub const TOKEN_FILE_MAGIC: i32 = 20240520;

/// The token file version this crate reads and writes (`header[1]`): tokens stored as
/// little-endian `u16`.
pub const TOKEN_FILE_VERSION: i32 = 1;

/// Size of the header in bytes: 256 little-endian `i32`.
pub const TOKEN_FILE_HEADER_BYTES: usize = 256 * 4;

/// Reads an llm.c token file into token ids.
///
/// The format: a header of 256 little-endian `i32` holding the magic number
/// [`TOKEN_FILE_MAGIC`] (20240520), the version [`TOKEN_FILE_VERSION`] (1) and the number of
/// tokens, the rest zero; then the tokens as little-endian `u16`.
///
/// Fails with a data error naming the problem when the file is shorter than the header,
/// has the wrong magic number or an unsupported version, holds no tokens, or has a length
/// that disagrees with the token count in its header (truncated, or trailing bytes).
pub fn read_token_file(path: &Path) -> Result<Vec<u32>> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_token_file(path, &bytes)
}

/// Decodes the bytes of a token file (what [`read_token_file`] does after reading it);
/// `path` only names the file in errors.
pub fn parse_token_file(path: &Path, bytes: &[u8]) -> Result<Vec<u32>> {
    let what = || format!("token file {}", path.display());
    if bytes.len() < TOKEN_FILE_HEADER_BYTES {
        return Err(Error::data(
            what(),
            format!(
                "the file is {} bytes, shorter than the {TOKEN_FILE_HEADER_BYTES}-byte header \
                 of an llm.c token file; it is truncated or not a token file (produce one \
                 with `trainkit prepare`)",
                bytes.len()
            ),
        ));
    }
    let header_int = |i: usize| {
        let mut word = [0u8; 4];
        word.copy_from_slice(&bytes[4 * i..4 * i + 4]);
        i32::from_le_bytes(word)
    };
    let magic = header_int(0);
    if magic != TOKEN_FILE_MAGIC {
        return Err(Error::data(
            what(),
            format!(
                "wrong magic number {magic} (expected {TOKEN_FILE_MAGIC}): this is not an \
                 llm.c token file; produce one from text with `trainkit prepare`, or pass the \
                 text file itself"
            ),
        ));
    }
    let version = header_int(1);
    if version != TOKEN_FILE_VERSION {
        let hint = if version == 2 {
            " (version 2 stores u32 tokens, llm.c's Llama 3 format)"
        } else {
            ""
        };
        return Err(Error::data(
            what(),
            format!(
                "unsupported version {version}{hint}; only version {TOKEN_FILE_VERSION} \
                 (u16 tokens, GPT-2 vocabularies) is supported: re-create the file with \
                 `trainkit prepare`"
            ),
        ));
    }
    let count = header_int(2);
    let body = bytes.len() - TOKEN_FILE_HEADER_BYTES;
    if count < 0 {
        return Err(Error::data(
            what(),
            format!(
                "the header claims a negative token count ({count}); the header is corrupt: \
                 re-create the file with `trainkit prepare`"
            ),
        ));
    }
    let count = count as usize;
    if count.checked_mul(2) != Some(body) {
        let expected = TOKEN_FILE_HEADER_BYTES as u64 + 2 * count as u64;
        let problem = if (body as u64) < 2 * count as u64 {
            "the file is truncated"
        } else {
            "the file has trailing bytes"
        };
        return Err(Error::data(
            what(),
            format!(
                "the header says {count} tokens, so the file should be {expected} bytes, but \
                 it is {} bytes ({} tokens' worth{}): {problem}; re-create it with \
                 `trainkit prepare`",
                bytes.len(),
                body / 2,
                if body % 2 == 1 { " plus one byte" } else { "" }
            ),
        ));
    }
    if count == 0 {
        return Err(Error::data(
            what(),
            "the file holds zero tokens; prepare it from a non-empty text with `trainkit \
             prepare`",
        ));
    }
    Ok(bytes[TOKEN_FILE_HEADER_BYTES..]
        .chunks_exact(2)
        .map(|pair| u32::from(u16::from_le_bytes([pair[0], pair[1]])))
        .collect())
}

/// Writes `tokens` as an llm.c token file, the format [`read_token_file`] reads.
///
/// The write is atomic: the bytes go to a temporary file in the same directory, which is
/// flushed to disk and then renamed over `path`, so `path` holds either its old contents or
/// the whole new file, never a part. The parent directory must exist.
///
/// Fails (without touching `path`) if `tokens` is empty, if a token is 65536 or more (the
/// format stores `u16`), or if there are more than `i32::MAX` tokens.
pub fn write_token_file(path: &Path, tokens: &[u32]) -> Result<()> {
    let what = || format!("tokens for {}", path.display());
    if tokens.is_empty() {
        return Err(Error::data(
            what(),
            "there are no tokens to write, and a token file must hold at least one; \
             tokenize a non-empty text",
        ));
    }
    let count = i32::try_from(tokens.len()).map_err(|_| {
        Error::data(
            what(),
            format!(
                "{} tokens is more than the {} a token file's i32 header can count; split \
                 the data into several files",
                tokens.len(),
                i32::MAX
            ),
        )
    })?;
    if let Some((index, &token)) = tokens.iter().enumerate().find(|(_, &t)| t > 0xFFFF) {
        return Err(Error::data(
            what(),
            format!(
                "token {token} at index {index} does not fit in the u16 the format stores \
                 (ids must be below 65536); use a tokenizer with a vocabulary of at most \
                 65536"
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES + 2 * tokens.len());
    let mut header = [0i32; TOKEN_FILE_HEADER_BYTES / 4];
    header[0] = TOKEN_FILE_MAGIC;
    header[1] = TOKEN_FILE_VERSION;
    header[2] = count;
    for word in header {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    for &token in tokens {
        // Checked above: every token fits in u16.
        bytes.extend_from_slice(&(token as u16).to_le_bytes());
    }
    write_atomically(path, &bytes)
}

/// Whether `path` starts with the magic number of an llm.c token file.
///
/// Only sniffs the first four bytes: it tells a token file from a text file (UTF-8 text
/// cannot start with them: the first, `0x88`, is a continuation byte), it does not
/// validate the file; use
/// [`read_token_file`] for that. Any error reading the file gives `false`.
pub fn is_token_file(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    match fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)) {
        Ok(()) => i32::from_le_bytes(magic) == TOKEN_FILE_MAGIC,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(magic: i32, version: i32, count: i32, tokens: &[u16]) -> Vec<u8> {
        let mut bytes = vec![0u8; TOKEN_FILE_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&magic.to_le_bytes());
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        bytes[8..12].copy_from_slice(&count.to_le_bytes());
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes
    }

    fn err(bytes: &[u8]) -> String {
        parse_token_file(Path::new("x.bin"), bytes)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_a_valid_file() {
        let bytes = file(TOKEN_FILE_MAGIC, 1, 3, &[0, 50256, 65535]);
        let tokens = parse_token_file(Path::new("x.bin"), &bytes).unwrap();
        assert_eq!(tokens, [0, 50256, 65535]);
    }

    #[test]
    fn rejects_malformed_headers() {
        assert!(err(&[0u8; 10]).contains("shorter than the 1024-byte header"));
        let e = err(&file(7, 1, 1, &[1]));
        assert!(
            e.contains("magic number 7") && e.contains("20240520"),
            "{e}"
        );
        assert!(err(&file(TOKEN_FILE_MAGIC, 2, 1, &[1])).contains("unsupported version 2"));
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, -1, &[])).contains("negative"));
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, 0, &[])).contains("zero tokens"));
        let e = err(&file(TOKEN_FILE_MAGIC, 1, 3, &[1, 2]));
        assert!(e.contains("truncated") && e.contains("3 tokens"), "{e}");
        let mut odd = file(TOKEN_FILE_MAGIC, 1, 2, &[1, 2]);
        odd.push(0);
        assert!(err(&odd).contains("trailing bytes"));
        // i32::MAX tokens: the length check must not overflow.
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, i32::MAX, &[1])).contains("truncated"));
    }
}
