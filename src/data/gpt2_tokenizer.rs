//! GPT-2's byte-level BPE tokenizer (the `r50k_base` ranks, shipped inside tiktoken-rs, no
//! download).

use super::Tokenizer;
use rayon::prelude::*;
use tiktoken_rs::CoreBPE;

/// GPT-2's tokenizer: byte-level BPE with 50,257 ids, the last being `<|endoftext|>`
/// ([`Gpt2Tokenizer::EOT`]).
///
/// [`encode`](Tokenizer::encode) treats all text as ordinary text: a literal
/// `<|endoftext|>` in the input is encoded as its characters, never as the special token
/// (insert [`Gpt2Tokenizer::EOT`] yourself between documents).
/// [`decode`](Tokenizer::decode) never fails: ids whose bytes do not form valid UTF-8 on
/// their own (a multi-byte character cut between slices) decode to U+FFFD, and so do ids
/// outside the vocabulary.
///
/// Long texts are cut at word boundaries and the pieces encoded in parallel, with exactly
/// the ids of encoding the text whole, except inside a stretch of over 16 KiB with no
/// whitespace to cut at, which is cut every 16 KiB (details on `encode` below).
///
/// The ranks are parsed once per process, on first use (a fraction of a second).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gpt2Tokenizer;

/// Target size of one piece of text handed to the BPE at a time; the pieces of a long text
/// are encoded in parallel.
const CHUNK_BYTES: usize = 256 << 10;

/// The longest stretch of text without a place to cut it exactly (see
/// [`split_for_encoding`]) that is encoded in one go; a longer one is cut, inexactly.
const MAX_STRETCH_BYTES: usize = 16 << 10;

impl Gpt2Tokenizer {
    /// The id of `<|endoftext|>`, which separates documents in GPT-2's training data.
    pub const EOT: u32 = 50256;

    /// Number of ids: 50,256 BPE tokens and `<|endoftext|>`.
    pub const VOCAB_SIZE: usize = 50257;

    /// The tokenizer (the same as `Gpt2Tokenizer` or `Gpt2Tokenizer::default()`).
    pub fn new() -> Self {
        Gpt2Tokenizer
    }

    fn bpe() -> &'static CoreBPE {
        // Parses ranks compiled into tiktoken-rs; it cannot fail on any input of ours.
        tiktoken_rs::r50k_base_singleton()
    }
}

impl Tokenizer for Gpt2Tokenizer {
    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    /// GPT-2 token ids of `text` (no special tokens).
    ///
    /// The text is cut into pieces of about 256 KiB, encoded in parallel. A cut is made
    /// only before the last character of a run of whitespace that is followed by a
    /// non-whitespace character, where GPT-2's pre-tokenizer always ends one piece and
    /// starts the next whatever comes before or after; so the ids are exactly those of
    /// encoding the whole text at once, with one exception: a stretch of over 16 KiB
    /// with no such place (one enormous "word", or a long run of whitespace) is cut
    /// every 16 KiB, where GPT-2 would take it whole. tiktoken's pre-tokenizer fails on
    /// such runs (a regex stack overflow) and its BPE takes quadratic time in them, so the
    /// cut keeps encoding fast and safe; it changes the ids only next to the cut.
    fn encode(&self, text: &str) -> Vec<u32> {
        let bpe = Self::bpe();
        let chunks = split_for_encoding(text, CHUNK_BYTES, MAX_STRETCH_BYTES);
        if chunks.len() <= 1 {
            return bpe.encode_ordinary(text);
        }
        let pieces: Vec<Vec<u32>> = chunks
            .par_iter()
            .map(|chunk| bpe.encode_ordinary(chunk))
            .collect();
        let mut ids = Vec::with_capacity(pieces.iter().map(Vec::len).sum());
        for piece in pieces {
            ids.extend_from_slice(&piece);
        }
        ids
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bpe = Self::bpe();
        let bytes = match bpe.decode_bytes(ids) {
            Ok(bytes) => bytes,
            // Some id is outside the vocabulary: decode id by id, replacing the bad ones.
            Err(_) => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for id in ids {
                    match bpe.decode_bytes(std::slice::from_ref(id)) {
                        Ok(b) => bytes.extend_from_slice(&b),
                        Err(_) => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
                    }
                }
                bytes
            }
        };
        match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    fn end_of_text(&self) -> Option<u32> {
        Some(Self::EOT)
    }
}

/// Cuts `text` into pieces of at least `target` bytes (the last may be shorter) whose
/// GPT-2 encodings, concatenated, equal the encoding of `text`, as long as `text` has no
/// stretch of over `max_stretch` bytes without an exact cut.
///
/// An exact cut goes at byte `p` when `text[p]` is whitespace and the next character is
/// not. GPT-2's pre-tokenizer pattern (in tiktoken: `'(?:[sdmt]|ll|ve|re)| ?\p{L}++|
/// ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s`) always starts a piece there: a
/// whitespace run `w1 .. wk` followed by a non-space `c` is matched as `w1 .. w(k-1)` (by
/// `\s+(?!\S)`) and then either `wk` alone (by `\s`) or, if `wk` is a space, `wk` with
/// the word, number or symbols starting at `c`. In the left piece the same run `w1 ..
/// w(k-1)` ends the text and is matched whole by `\s++$`; the piece before it ends at a
/// non-space, which no match runs past; the pattern has no look-behind, so matching from
/// `p` on in the right piece is the same as in the whole text.
///
/// A stretch of over `max_stretch` bytes with no exact cut is cut anyway at a character
/// boundary at most `max_stretch` bytes past the previous cut: the only inexact cuts.
fn split_for_encoding(text: &str, target: usize, max_stretch: usize) -> Vec<&str> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut last_cut = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let exact = c.is_whitespace()
            && i > start
            && matches!(chars.peek(), Some((_, next)) if !next.is_whitespace());
        if exact {
            last_cut = i;
            if i - start >= target {
                chunks.push(&text[start..i]);
                start = i;
            }
        } else if i + c.len_utf8() - last_cut > max_stretch && i > start {
            // Taking `c` would make a stretch of over max_stretch bytes: cut before it.
            chunks.push(&text[start..i]);
            start = i;
            last_cut = i;
        }
    }
    if start < text.len() || chunks.is_empty() {
        chunks.push(&text[start..]);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ids() {
        let t = Gpt2Tokenizer;
        assert_eq!(t.encode("Hello world"), [15496, 995]);
        assert_eq!(t.encode(" the"), [262]);
        // Special tokens are not parsed from text.
        let literal = t.encode("<|endoftext|>");
        assert_eq!(literal, [27, 91, 437, 1659, 5239, 91, 29]);
        assert_eq!(t.decode(&literal), "<|endoftext|>");
        assert_eq!(t.decode(&[Gpt2Tokenizer::EOT]), "<|endoftext|>");
    }

    #[test]
    fn decode_is_lossy_not_fallible() {
        let t = Gpt2Tokenizer;
        let ids = t.encode("日本");
        assert!(ids.len() >= 2, "{ids:?}");
        // A cut through a multi-byte character and an id beyond the vocabulary.
        let s = t.decode(&ids[..1]);
        assert!(s.contains('\u{FFFD}'), "{s:?}");
        assert_eq!(t.decode(&[15496, 1_000_000, 995]), "Hello\u{FFFD} world");
    }

    /// Encodes `chunks` one by one with tiktoken.
    fn encode_chunks(chunks: &[&str]) -> Vec<u32> {
        let bpe = Gpt2Tokenizer::bpe();
        chunks.iter().flat_map(|c| bpe.encode_ordinary(c)).collect()
    }

    #[test]
    fn cut_encoding_matches_whole_encoding() {
        let paragraphs = [
            "First Citizen:\nBefore we proceed any further, hear me speak.",
            "  indented, café 日本語 123 ½ ⅷ",
            "'tis a contraction, isn't it? 'S 'LL we'll\r\n\r\nWindows lines.",
            "\n\n\n\n\"quoted\" \u{a0}nbsp\u{2003}em\u{3000}ideographic",
            "trailing spaces   \n   \n\tTab \t mixed\x0bvt\x0cff",
            "(punct) -- and numbers 42 3.14 ' ' '  x \u{301}\u{301} e\u{301}",
        ];
        let mut text = String::new();
        for i in 0..4000 {
            text.push_str(paragraphs[i % paragraphs.len()]);
            text.push_str(
                [
                    "\n\n", "\n \n", " ", "\n\n\n", " \n\n", "\r\n\r\n", "\t", "",
                ][i % 8],
            );
        }
        let whole = Gpt2Tokenizer::bpe().encode_ordinary(&text);
        for target in [1, 7, 100, 1000] {
            let chunks = split_for_encoding(&text, target, usize::MAX);
            assert!(
                chunks.len() > text.len() / (target + 200),
                "{}",
                chunks.len()
            );
            assert!(chunks.iter().all(|c| !c.is_empty()));
            assert_eq!(chunks.concat(), text);
            assert!(encode_chunks(&chunks) == whole, "target {target}");
        }
    }

    #[test]
    fn random_texts_cut_exactly() {
        let alphabet: Vec<char> = " \n\t\r\u{a0}\u{3000}aZé日'sdltm-.,1٣½\u{301}\u{180e}"
            .chars()
            .collect();
        let mut rng = crate::Rng::new(7);
        for _ in 0..300 {
            let len = 1 + rng.below(200);
            let text: String = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            let whole = Gpt2Tokenizer::bpe().encode_ordinary(&text);
            let chunks = split_for_encoding(&text, 1, usize::MAX);
            assert_eq!(chunks.concat(), text);
            assert!(encode_chunks(&chunks) == whole, "{text:?}: {chunks:?}");
        }
    }

    #[test]
    fn long_stretches_are_cut() {
        let text = "x".repeat(100) + &" ".repeat(100) + "\n";
        let chunks = split_for_encoding(&text, 1, 30);
        assert_eq!(chunks.concat(), text);
        assert!(chunks.iter().all(|c| c.len() <= 30), "{chunks:?}");
        let text = "日".repeat(100);
        let chunks = split_for_encoding(&text, 1000, 32);
        assert_eq!(chunks.concat(), text);
        assert!(chunks.iter().all(|c| c.len() <= 32), "{chunks:?}");
        assert_eq!(split_for_encoding("", 10, 10), [""]);
    }
}
