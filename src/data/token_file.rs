//! llm.c's token file format: a header of 256 little-endian `i32`, then the tokens as
//! little-endian `u16` or, for vocabularies above 65536, `u32`.
//!
//! The header holds `header[0]` = the magic number, `header[1]` = the version and
//! `header[2]` = the number of tokens; the other 253 entries are zero. The magic number and
//! version together name the token width ([`TokenFormat`]):
//!
//! | format | magic | version | tokens |
//! | --- | --- | --- | --- |
//! | [`TokenFormat::U16`] | 20240520 | 1 | `u16`: GPT-2's and other vocabularies up to 65536 |
//! | [`TokenFormat::U32`] | 20240801 | 7 | `u32`: Llama 3's 128256 and any larger vocabulary |
//!
//! Both are llm.c's own (`dev/data/data_common.py`, "gpt-2" and "llama-3"), so files written
//! here are read by llm.c and the other way round.

use crate::error::{Error, Result};
use crate::save::write_atomically;
use std::fmt;
use std::fs;
use std::io::Read;
use std::path::Path;

/// The magic number in `header[0]` of an llm.c token file of `u16` tokens.
pub const TOKEN_FILE_MAGIC: i32 = 20240520;

/// The version in `header[1]` of an llm.c token file of `u16` tokens.
pub const TOKEN_FILE_VERSION: i32 = 1;

/// Size of the header in bytes: 256 little-endian `i32`.
pub const TOKEN_FILE_HEADER_BYTES: usize = 256 * 4;

/// The width of the token ids in a token file, named by the header's magic number and
/// version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenFormat {
    /// Little-endian `u16` ids (magic 20240520, version 1): vocabularies up to 65536.
    U16,
    /// Little-endian `u32` ids (magic 20240801, version 7, llm.c's Llama 3 files):
    /// vocabularies above 65536.
    U32,
}

impl TokenFormat {
    /// Both formats, narrowest first.
    pub const ALL: [TokenFormat; 2] = [TokenFormat::U16, TokenFormat::U32];

    /// `header[0]` of a file in this format.
    pub const fn magic(self) -> i32 {
        match self {
            TokenFormat::U16 => TOKEN_FILE_MAGIC,
            TokenFormat::U32 => 20240801,
        }
    }

    /// `header[1]` of a file in this format.
    pub const fn version(self) -> i32 {
        match self {
            TokenFormat::U16 => TOKEN_FILE_VERSION,
            TokenFormat::U32 => 7,
        }
    }

    /// Bytes per token id.
    pub const fn token_bytes(self) -> usize {
        match self {
            TokenFormat::U16 => 2,
            TokenFormat::U32 => 4,
        }
    }

    /// One more than the largest id the format holds.
    pub const fn id_limit(self) -> u64 {
        match self {
            TokenFormat::U16 => 1 << 16,
            TokenFormat::U32 => 1 << 32,
        }
    }

    /// The narrowest format whose ids reach `vocab_size - 1`.
    pub fn for_vocab(vocab_size: usize) -> TokenFormat {
        if vocab_size as u64 <= TokenFormat::U16.id_limit() {
            TokenFormat::U16
        } else {
            TokenFormat::U32
        }
    }

    /// The format whose header starts with `magic`, whatever the version.
    pub fn from_magic(magic: i32) -> Option<TokenFormat> {
        TokenFormat::ALL.into_iter().find(|f| f.magic() == magic)
    }

    /// The header of a file of `count` tokens in this format.
    pub fn header(self, count: i32) -> [u8; TOKEN_FILE_HEADER_BYTES] {
        let mut header = [0u8; TOKEN_FILE_HEADER_BYTES];
        header[0..4].copy_from_slice(&self.magic().to_le_bytes());
        header[4..8].copy_from_slice(&self.version().to_le_bytes());
        header[8..12].copy_from_slice(&count.to_le_bytes());
        header
    }

    /// Appends the little-endian bytes of `tokens` to `out`; every id must fit (checked by
    /// the caller).
    pub(crate) fn encode_into(self, tokens: &[u32], out: &mut Vec<u8>) {
        match self {
            TokenFormat::U16 => {
                for &t in tokens {
                    out.extend_from_slice(&(t as u16).to_le_bytes());
                }
            }
            TokenFormat::U32 => {
                for &t in tokens {
                    out.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
    }

    /// Appends the ids stored in `bytes` (a whole number of tokens) to `out`.
    pub(crate) fn decode_into(self, bytes: &[u8], out: &mut Vec<u32>) {
        match self {
            TokenFormat::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]]))),
            ),
            TokenFormat::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]])),
            ),
        }
    }

    /// The first id in `bytes` (a whole number of tokens) that is `limit` or more, with
    /// its index.
    pub(crate) fn find_id_at_least(self, bytes: &[u8], limit: u64) -> Option<(usize, u64)> {
        match self {
            TokenFormat::U16 => bytes
                .chunks_exact(2)
                .map(|p| u64::from(u16::from_le_bytes([p[0], p[1]])))
                .enumerate()
                .find(|&(_, id)| id >= limit),
            TokenFormat::U32 => bytes
                .chunks_exact(4)
                .map(|p| u64::from(u32::from_le_bytes([p[0], p[1], p[2], p[3]])))
                .enumerate()
                .find(|&(_, id)| id >= limit),
        }
    }
}

impl fmt::Display for TokenFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenFormat::U16 => "u16 (magic 20240520, version 1)",
            TokenFormat::U32 => "u32 (magic 20240801, version 7)",
        })
    }
}

/// Checks the header of a token file of `file_len` bytes; `header` is its first
/// [`TOKEN_FILE_HEADER_BYTES`] bytes (or all of them, for a shorter file). Returns the
/// format and the number of tokens. `path` names the file in errors.
pub(crate) fn parse_header(
    path: &Path,
    header: &[u8],
    file_len: u64,
) -> Result<(TokenFormat, usize)> {
    let what = || format!("token file {}", path.display());
    if header.len() < TOKEN_FILE_HEADER_BYTES || file_len < TOKEN_FILE_HEADER_BYTES as u64 {
        return Err(Error::data(
            what(),
            format!(
                "the file is {file_len} bytes, shorter than the {TOKEN_FILE_HEADER_BYTES}-byte \
                 header of an llm.c token file; it is truncated or not a token file (produce \
                 one with `trainkit prepare`)"
            ),
        ));
    }
    let header_int = |i: usize| {
        let mut word = [0u8; 4];
        word.copy_from_slice(&header[4 * i..4 * i + 4]);
        i32::from_le_bytes(word)
    };
    let magic = header_int(0);
    let Some(format) = TokenFormat::from_magic(magic) else {
        return Err(Error::data(
            what(),
            format!(
                "wrong magic number {magic} (expected {} for u16 tokens or {} for u32): this \
                 is not an llm.c token file; produce one from text with `trainkit prepare`, \
                 or pass the text file itself",
                TokenFormat::U16.magic(),
                TokenFormat::U32.magic()
            ),
        ));
    };
    let version = header_int(1);
    if version != format.version() {
        let other = TokenFormat::ALL
            .into_iter()
            .find(|f| f.version() == version)
            .map(|f| format!(" (version {version} goes with magic {}, {f})", f.magic()))
            .unwrap_or_default();
        return Err(Error::data(
            what(),
            format!(
                "unsupported version {version} for magic {magic}{other}; a file with magic \
                 {magic} must have version {} ({format}): the header mixes two token formats \
                 or is corrupt; re-create the file with `trainkit prepare`",
                format.version()
            ),
        ));
    }
    let count = header_int(2);
    if count < 0 {
        return Err(Error::data(
            what(),
            format!(
                "the header claims a negative token count ({count}); the header is corrupt: \
                 re-create the file with `trainkit prepare`"
            ),
        ));
    }
    let count = count as u64;
    let width = format.token_bytes() as u64;
    let body = file_len - TOKEN_FILE_HEADER_BYTES as u64;
    if count * width != body {
        let expected = TOKEN_FILE_HEADER_BYTES as u64 + width * count;
        let problem = if body < width * count {
            "the file is truncated"
        } else {
            "the file has trailing bytes"
        };
        let odd = body % width;
        return Err(Error::data(
            what(),
            format!(
                "the header says {count} tokens of {width} bytes, so the file should be \
                 {expected} bytes, but it is {file_len} bytes ({} tokens' worth{}): \
                 {problem}; re-create it with `trainkit prepare`",
                body / width,
                match odd {
                    0 => String::new(),
                    1 => " plus one byte".to_string(),
                    n => format!(" plus {n} bytes"),
                }
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
    Ok((format, count as usize))
}

/// Reads an llm.c token file whole into token ids (either format).
///
/// This holds the whole file in memory twice over; training reads token files through
/// [`TokenDataset`](super::TokenDataset) instead, which maps them.
///
/// Fails with a data error naming the file and the problem when the file is shorter than
/// the header, has an unknown magic number or a version that does not go with it, holds
/// no tokens, or has a length that disagrees with the token count in its header
/// (truncated, or trailing bytes).
pub fn read_token_file(path: &Path) -> Result<Vec<u32>> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_token_file(path, &bytes)
}

/// Decodes the bytes of a token file (what [`read_token_file`] does after reading it);
/// `path` only names the file in errors.
pub fn parse_token_file(path: &Path, bytes: &[u8]) -> Result<Vec<u32>> {
    let (format, count) = parse_header(path, bytes, bytes.len() as u64)?;
    let mut tokens = Vec::with_capacity(count);
    format.decode_into(&bytes[TOKEN_FILE_HEADER_BYTES..], &mut tokens);
    Ok(tokens)
}

/// Writes `tokens` as an llm.c token file in the narrowest format that holds them: `u16`
/// when every id is below 65536, else `u32` (see [`write_token_file_as`]).
pub fn write_token_file(path: &Path, tokens: &[u32]) -> Result<()> {
    let max = tokens.iter().copied().max().unwrap_or(0);
    write_token_file_as(path, tokens, TokenFormat::for_vocab(max as usize + 1))
}

/// Writes `tokens` as an llm.c token file in `format`, the format [`read_token_file`]
/// reads.
///
/// The write is atomic: the bytes go to a temporary file in the same directory, which is
/// flushed to disk and then renamed over `path`, so `path` holds either its old contents or
/// the whole new file, never a part. The parent directory must exist.
///
/// Fails (without touching `path`) if `tokens` is empty, if a token does not fit the
/// format, or if there are more than `i32::MAX` tokens.
pub fn write_token_file_as(path: &Path, tokens: &[u32], format: TokenFormat) -> Result<()> {
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
                 the data into shards (`trainkit prepare --shard-tokens N`)",
                tokens.len(),
                i32::MAX
            ),
        )
    })?;
    if let Some((index, &token)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| u64::from(t) >= format.id_limit())
    {
        return Err(Error::data(
            what(),
            format!(
                "token {token} at index {index} does not fit in the u16 ids of the {format} \
                 format (ids must be below 65536); write the u32 format instead"
            ),
        ));
    }
    let mut bytes =
        Vec::with_capacity(TOKEN_FILE_HEADER_BYTES + format.token_bytes() * tokens.len());
    bytes.extend_from_slice(&format.header(count));
    format.encode_into(tokens, &mut bytes);
    write_atomically(path, &bytes)
}

/// Whether `path` starts with the magic number of an llm.c token file (either format).
///
/// Only sniffs the first four bytes: it tells a token file from a text file (UTF-8 text
/// cannot start with them: the first byte of either magic number, `0x88` or `0xc1`, never
/// starts a UTF-8 character), it does not validate the file; use [`read_token_file`] for
/// that. Any error reading the file gives `false`.
pub fn is_token_file(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    match fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)) {
        Ok(()) => TokenFormat::from_magic(i32::from_le_bytes(magic)).is_some(),
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
        // u32: two u16 words per token, low word first.
        let bytes = file(20240801, 7, 2, &[0x5678, 0x1, 7, 0]);
        let tokens = parse_token_file(Path::new("x.bin"), &bytes).unwrap();
        assert_eq!(tokens, [0x1_5678, 7]);
    }

    #[test]
    fn rejects_malformed_headers() {
        assert!(err(&[0u8; 10]).contains("shorter than the 1024-byte header"));
        let e = err(&file(7, 1, 1, &[1]));
        assert!(
            e.contains("magic number 7") && e.contains("20240520") && e.contains("20240801"),
            "{e}"
        );
        let e = err(&file(TOKEN_FILE_MAGIC, 2, 1, &[1]));
        assert!(e.contains("unsupported version 2"), "{e}");
        let e = err(&file(TOKEN_FILE_MAGIC, 7, 1, &[1, 0]));
        assert!(
            e.contains("mixes two token formats") && e.contains("20240801"),
            "{e}"
        );
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, -1, &[])).contains("negative"));
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, 0, &[])).contains("zero tokens"));
        let e = err(&file(TOKEN_FILE_MAGIC, 1, 3, &[1, 2]));
        assert!(
            e.contains("truncated") && e.contains("3 tokens of 2 bytes"),
            "{e}"
        );
        let mut odd = file(TOKEN_FILE_MAGIC, 1, 2, &[1, 2]);
        odd.push(0);
        assert!(err(&odd).contains("trailing bytes"));
        // An odd number of u16 words in a u32 file.
        let e = err(&file(20240801, 7, 2, &[1, 0, 2]));
        assert!(e.contains("truncated") && e.contains("plus 2 bytes"), "{e}");
        // i32::MAX tokens: the length check must not overflow.
        assert!(err(&file(TOKEN_FILE_MAGIC, 1, i32::MAX, &[1])).contains("truncated"));
    }

    #[test]
    fn formats() {
        assert_eq!(TokenFormat::for_vocab(50257), TokenFormat::U16);
        assert_eq!(TokenFormat::for_vocab(65536), TokenFormat::U16);
        assert_eq!(TokenFormat::for_vocab(65537), TokenFormat::U32);
        assert_eq!(TokenFormat::for_vocab(128256), TokenFormat::U32);
        for f in TokenFormat::ALL {
            assert_eq!(TokenFormat::from_magic(f.magic()), Some(f));
            let mut bytes = Vec::new();
            f.encode_into(&[1, 65535], &mut bytes);
            let mut back = Vec::new();
            f.decode_into(&bytes, &mut back);
            assert_eq!(back, [1, 65535]);
            assert_eq!(f.find_id_at_least(&bytes, 65535), Some((1, 65535)));
        }
    }
}
