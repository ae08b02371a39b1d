//! Per-token flags beside a token file: which tokens are trained targets (the loss mask
//! of chat and instruction data) and where documents start. A token file `x.bin` keeps
//! llm.c's format unchanged; its flags, when it has any, are the sibling `x.mask`
//! ([`flags_path_for`]), found by whatever opens `x.bin`. A token file without one trains
//! every target, as before.
//!
//! The file: a header of 256 little-endian i32 (1024 bytes, as a token file's) holding
//! [`FLAGS_FILE_MAGIC`], [`FLAGS_FILE_VERSION`], the number of tokens and the row length
//! (0 for a stream; `prepare --chat` writes rows of `--seq-len` tokens, one example each,
//! which train only with that sequence length), then one byte per token: bit 0 ([`TRAINED`]) set when the position that predicts this token is in the
//! loss, bit 1 ([`DOCUMENT_START`]) set on a document's first token.

use super::token_file::TOKEN_FILE_HEADER_BYTES;
use crate::error::{Error, Result};
use crate::save::write_atomically;
use std::path::{Path, PathBuf};

/// `header[0]` of a flags file.
pub const FLAGS_FILE_MAGIC: i32 = 20261126;

/// `header[1]` of a flags file.
pub const FLAGS_FILE_VERSION: i32 = 1;

/// The flag of a token that is a trained target: the position before it predicts it in
/// the loss.
pub const TRAINED: u8 = 1;

/// The flag of a document's first token.
pub const DOCUMENT_START: u8 = 2;

/// The flags file of the token file `tokens`: the same name with the extension `mask`.
pub fn flags_path_for(tokens: &Path) -> PathBuf {
    tokens.with_extension("mask")
}

/// Writes `flags`, one byte per token, as a flags file at `path` (atomically), for tokens
/// laid out in rows of `row_len` (`None`: a stream).
pub fn write_flags_file(path: &Path, flags: &[u8], row_len: Option<usize>) -> Result<()> {
    let count = i32::try_from(flags.len()).map_err(|_| {
        Error::data(
            format!("token flags for {}", path.display()),
            format!(
                "{} tokens is more than a flags file's i32 header counts; split the data into \
                 shards (`trainkit prepare --shard-tokens N`)",
                flags.len()
            ),
        )
    })?;
    let row_len = i32::try_from(row_len.unwrap_or(0))
        .map_err(|_| Error::config("--seq-len", "does not fit a flags file's i32 header"))?;
    let mut bytes = vec![0u8; TOKEN_FILE_HEADER_BYTES];
    for (i, v) in [FLAGS_FILE_MAGIC, FLAGS_FILE_VERSION, count, row_len]
        .into_iter()
        .enumerate()
    {
        bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    bytes.extend_from_slice(flags);
    write_atomically(path, &bytes)
}

/// Checks the header of the flags file `path` (`bytes` the whole file) against its token
/// file's `tokens` tokens and returns its row length (`None` for a stream); errors name
/// the file and the fix.
pub(crate) fn check_flags_file(path: &Path, bytes: &[u8], tokens: usize) -> Result<Option<usize>> {
    let what = || format!("token flags {}", path.display());
    if bytes.len() < TOKEN_FILE_HEADER_BYTES {
        return Err(Error::data(
            what(),
            format!(
                "the file is {} bytes, shorter than its {TOKEN_FILE_HEADER_BYTES}-byte header; \
                 it is truncated: re-create the data with `trainkit prepare`, or delete it to \
                 train every token",
                bytes.len()
            ),
        ));
    }
    let int = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap_or([0; 4]));
    if int(0) != FLAGS_FILE_MAGIC || int(1) != FLAGS_FILE_VERSION {
        return Err(Error::data(
            what(),
            format!(
                "has magic {} version {}, not a flags file's {FLAGS_FILE_MAGIC} version \
                 {FLAGS_FILE_VERSION}; a `.mask` file beside a token file must be the mask \
                 `trainkit prepare` writes (rename the file if it is something else)",
                int(0),
                int(1)
            ),
        ));
    }
    let count = int(2);
    let body = bytes.len() - TOKEN_FILE_HEADER_BYTES;
    if count < 0 || count as usize != body || body != tokens {
        return Err(Error::data(
            what(),
            format!(
                "holds flags for {body} tokens (its header says {count}), but its token file \
                 holds {tokens}; the two were not written together: re-create them with \
                 `trainkit prepare`"
            ),
        ));
    }
    match int(3) {
        0 => Ok(None),
        n if n > 0 => Ok(Some(n as usize)),
        n => Err(Error::data(
            what(),
            format!("has a negative row length ({n}); re-create it with `trainkit prepare`"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flags_file_round_trips_and_a_wrong_one_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("trainkit-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = flags_path_for(&dir.join("x.bin"));
        assert_eq!(path.file_name().unwrap(), "x.mask");
        let flags = [DOCUMENT_START, TRAINED, TRAINED | DOCUMENT_START, 0];
        write_flags_file(&path, &flags, None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(check_flags_file(&path, &bytes, 4).unwrap(), None);
        write_flags_file(&path, &flags, Some(2)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(check_flags_file(&path, &bytes, 4).unwrap(), Some(2));
        assert_eq!(&bytes[TOKEN_FILE_HEADER_BYTES..], &flags);
        let e = check_flags_file(&path, &bytes, 5).unwrap_err().to_string();
        assert!(e.contains("x.mask") && e.contains("holds 5"), "{e}");
        let e = check_flags_file(&path, &bytes[..100], 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        let mut other = bytes.clone();
        other[0] = 0;
        let e = check_flags_file(&path, &other, 4).unwrap_err().to_string();
        assert!(e.contains("not a flags file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
