//! `prepare`'s inputs, read a piece at a time: text files (each one document) and JSON
//! lines (each line a document, its `text` field).

use crate::data::TokenFormat;
use crate::error::{Error, Result};
use serde::Deserialize;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// How an input file holds its documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// UTF-8 text: the whole file is one document.
    Text,
    /// JSON lines: one JSON object per line, the document in its `text` field (the form of
    /// FineWeb and most corpora on the Hugging Face Hub); blank lines are skipped.
    JsonLines,
}

/// One input file.
#[derive(Clone, Debug)]
pub(super) struct Input {
    pub path: PathBuf,
    pub kind: InputKind,
    pub len: u64,
}

/// Text to tokenize: the start of a document (an end-of-text token goes before it) or the
/// continuation of the one before.
pub(super) struct Piece {
    pub starts_document: bool,
    pub text: String,
}

/// The UTF-8 byte-order mark some editors write at the start of a file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Text past which a stretch with no exact cut is cut anyway.
const FORCED_CUT_BYTES: usize = 64 << 10;

/// Text past which a cut exact for GPT-2 only is taken when there is no single space
/// between words to cut at (see [`exact_cut`]).
const FALLBACK_CUT_BYTES: usize = 16 << 10;

/// Reads the inputs in order as pieces of text cut where tokenizing the pieces one by one
/// gives the ids of tokenizing the whole (see [`exact_cut`]).
pub(super) struct Reader {
    inputs: std::vec::IntoIter<Input>,
    current: Option<Open>,
    /// Bytes of input consumed so far.
    pub bytes_read: u64,
    /// Documents started so far.
    pub documents: u64,
}

enum Open {
    Text(TextStream),
    Json(JsonStream),
}

impl Reader {
    pub fn new(inputs: Vec<Input>) -> Reader {
        Reader {
            inputs: inputs.into_iter(),
            current: None,
            bytes_read: 0,
            documents: 0,
        }
    }

    /// The next pieces, about `target` bytes of text in all (documents in order); `None`
    /// when every input has been read.
    pub fn next_unit(&mut self, target: usize) -> Result<Option<Vec<Piece>>> {
        let mut unit = Vec::new();
        let mut bytes = 0;
        while bytes < target {
            if self.current.is_none() {
                let Some(input) = self.inputs.next() else {
                    break;
                };
                self.current = Some(match input.kind {
                    InputKind::Text => Open::Text(TextStream::open(&input.path)?),
                    InputKind::JsonLines => Open::Json(JsonStream::open(&input.path)?),
                });
            }
            let piece = match self.current.as_mut() {
                Some(Open::Text(t)) => t.next_piece(target - bytes)?,
                Some(Open::Json(j)) => j.next_document()?,
                None => None,
            };
            match piece {
                Some((piece, consumed)) => {
                    self.bytes_read += consumed;
                    self.documents += u64::from(piece.starts_document);
                    bytes += piece.text.len();
                    unit.push(piece);
                }
                None => self.current = None,
            }
        }
        Ok((!unit.is_empty()).then_some(unit))
    }
}

/// A text file read a block at a time.
struct TextStream {
    path: PathBuf,
    file: File,
    /// Bytes read but not yet handed out (an incomplete character or the text after the
    /// last cut).
    carry: Vec<u8>,
    /// Offset in the file of `carry[0]`.
    offset: u64,
    started: bool,
    eof: bool,
}

impl TextStream {
    fn open(path: &Path) -> Result<TextStream> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(TextStream {
            path: path.to_path_buf(),
            file,
            carry: Vec::new(),
            offset: 0,
            started: false,
            eof: false,
        })
    }

    fn what(&self) -> String {
        format!("text file {}", self.path.display())
    }

    /// About `want` bytes of text (at least one character), and the bytes of the file it
    /// consumed; `None` at the end of the file.
    fn next_piece(&mut self, want: usize) -> Result<Option<(Piece, u64)>> {
        let mut want = want.max(4);
        loop {
            self.fill(want + 4)?;
            if !self.started {
                let magic = self
                    .carry
                    .get(..4)
                    .map(|m| i32::from_le_bytes([m[0], m[1], m[2], m[3]]));
                if magic.and_then(TokenFormat::from_magic).is_some() {
                    return Err(Error::data(
                        self.what(),
                        "this is already an llm.c token file, not text; train on it \
                         directly instead of preparing it",
                    ));
                }
                // A UTF-8 byte-order mark is not text of the document.
                if self.offset == 0 && self.carry.starts_with(BOM) {
                    self.carry.drain(..BOM.len());
                    self.offset = BOM.len() as u64;
                }
            }
            if self.carry.is_empty() {
                if self.started {
                    return Ok(None);
                }
                // An empty file is an empty document.
                self.started = true;
                let piece = Piece {
                    starts_document: true,
                    text: String::new(),
                };
                return Ok(Some((piece, 0)));
            }
            let valid = match std::str::from_utf8(&self.carry) {
                Ok(s) => s.len(),
                Err(e) if e.error_len().is_none() && !self.eof => e.valid_up_to(),
                Err(e) => {
                    return Err(Error::data(
                        self.what(),
                        format!(
                            "the file is not valid UTF-8 (first bad byte at offset {}); \
                             convert it to UTF-8 first (e.g. `iconv -t UTF-8`)",
                            self.offset + e.valid_up_to() as u64
                        ),
                    ))
                }
            };
            // Checked just above: the first `valid` bytes are UTF-8.
            let text = std::str::from_utf8(&self.carry[..valid]).unwrap_or_default();
            let cut = if self.eof && valid == self.carry.len() {
                Some(valid)
            } else {
                match exact_cut(text, FALLBACK_CUT_BYTES) {
                    Some(cut) => Some(cut),
                    // No exact cut in a long stretch: cut anyway, as the GPT-2 tokenizer
                    // itself does past 16 KiB.
                    None if valid >= FORCED_CUT_BYTES => Some(valid),
                    None => None,
                }
            };
            let Some(cut) = cut else {
                // Too little text to find a cut in: read more.
                want = 2 * self.carry.len();
                continue;
            };
            let text = text[..cut].to_string();
            self.carry.drain(..cut);
            self.offset += cut as u64;
            let starts_document = !self.started;
            self.started = true;
            let piece = Piece {
                starts_document,
                text,
            };
            // The first piece counts the mark it passed over.
            let consumed = if starts_document {
                self.offset
            } else {
                cut as u64
            };
            return Ok(Some((piece, consumed)));
        }
    }

    /// Reads until `carry` holds at least `bytes` bytes or the file ends.
    fn fill(&mut self, bytes: usize) -> Result<()> {
        while !self.eof && self.carry.len() < bytes {
            let old = self.carry.len();
            let want = (bytes - old).max(64 << 10);
            self.carry.resize(old + want, 0);
            let n = self
                .file
                .read(&mut self.carry[old..])
                .map_err(|e| Error::io(&self.path, e))?;
            self.carry.truncate(old + n);
            self.eof = n == 0;
        }
        Ok(())
    }
}

/// The last place in `text` (not at its start) where GPT-2's pre-tokenizer always starts a
/// new piece whatever follows: before the last whitespace character of a run that a
/// non-whitespace character follows (the argument is on the GPT-2 tokenizer's
/// `split_for_encoding`). Tokenizing the text before and after such a cut separately gives
/// the ids of tokenizing it whole.
///
/// A single space between two non-whitespace characters is preferred: it is also exact
/// for the pre-tokenizers of Llama 3 and Qwen, which keep a run of newlines whole; another
/// cut is taken only when there is none and `text` holds at least `fallback_from` bytes.
pub(super) fn exact_cut(text: &str, fallback_from: usize) -> Option<usize> {
    let mut next_is_space = None;
    let mut fallback = None;
    let mut chars = text.char_indices().rev().peekable();
    while let Some((i, c)) = chars.next() {
        let space = c.is_whitespace();
        if space && next_is_space == Some(false) && i > 0 {
            let single = c == ' ' && matches!(chars.peek(), Some((_, p)) if !p.is_whitespace());
            if single {
                return Some(i);
            }
            fallback = fallback.or(Some(i));
        }
        next_is_space = Some(space);
    }
    fallback.filter(|_| text.len() >= fallback_from)
}

/// The part of a JSON line that `prepare` reads; every other field is skipped.
#[derive(Deserialize)]
struct Document {
    text: Option<String>,
}

/// A JSON-lines file read a line at a time.
struct JsonStream {
    path: PathBuf,
    reader: BufReader<File>,
    line: Vec<u8>,
    line_number: u64,
}

impl JsonStream {
    fn open(path: &Path) -> Result<JsonStream> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonStream {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1 << 20, file),
            line: Vec::new(),
            line_number: 0,
        })
    }

    /// The next document and the bytes it took; `None` at the end of the file.
    fn next_document(&mut self) -> Result<Option<(Piece, u64)>> {
        loop {
            self.line.clear();
            let n = self
                .reader
                .read_until(b'\n', &mut self.line)
                .map_err(|e| Error::io(&self.path, e))?;
            if n == 0 {
                return Ok(None);
            }
            self.line_number += 1;
            if self.line_number == 1 && self.line.starts_with(BOM) {
                self.line.drain(..BOM.len());
            }
            if self.line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let what = || format!("{} line {}", self.path.display(), self.line_number);
            let doc: Document = serde_json::from_slice(&self.line).map_err(|e| {
                Error::data(
                    what(),
                    format!(
                        "is not a JSON object with a `text` string: {e}; each line must be \
                         one object like {{\"text\": \"...\"}}"
                    ),
                )
            })?;
            let Some(text) = doc.text else {
                return Err(Error::data(
                    what(),
                    "has no `text` field (or it is null); each line must be one object with \
                     the document in `text`, as in FineWeb",
                ));
            };
            return Ok(Some((
                Piece {
                    starts_document: true,
                    text,
                },
                n as u64,
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_cuts() {
        assert_eq!(exact_cut("hello world", 0), Some(5));
        assert_eq!(exact_cut("a  b c  ", 0), Some(4));
        assert_eq!(exact_cut("  x", 0), Some(1));
        assert_eq!(exact_cut(" x", 0), None);
        assert_eq!(exact_cut("abc", 0), None);
        assert_eq!(exact_cut("日本 語", 0), Some(6));
        // A single space between words is preferred to a cut in a run of whitespace.
        assert_eq!(exact_cut("a b\n\nc", 0), Some(1));
        assert_eq!(exact_cut("a\n\nc", 0), Some(2));
        assert_eq!(exact_cut("\n b", 0), Some(1));
        assert_eq!(exact_cut("a\n\nc", 5), None);
        assert_eq!(exact_cut("a b\n\nc", 5), Some(1));
    }
}
