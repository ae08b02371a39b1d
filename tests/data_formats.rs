//! Data formats through the public API: llm.c token files, GPT-2's tokenizer, and
//! `prepare` (text to train/val token files).

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};
use trainkit::data::{
    is_token_file, prepare, read_token_file, val_path_for, write_token_file, write_token_file_as,
    ByteTokenizer, Gpt2Tokenizer, TokenFormat, Tokenizer, TokenizerKind, TOKEN_FILE_HEADER_BYTES,
    TOKEN_FILE_MAGIC,
};

/// A fresh, empty directory for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "trainkit-data-formats-{}-{name}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The error message of reading a file holding `bytes`.
fn read_error(dir: &TempDir, name: &str, bytes: &[u8]) -> String {
    let path = dir.path(name);
    fs::write(&path, bytes).unwrap();
    let err = read_token_file(&path).expect_err("malformed file must be an error");
    let msg = err.to_string();
    assert!(
        msg.contains(name),
        "the message should name the file: {msg}"
    );
    msg
}

fn assert_contains(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "expected `{part}` in: {msg}");
    }
}

const PARAGRAPH: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
    All:\nSpeak, speak.\n\nCafé, naïve, 日本語のテキスト — and numbers 1234 or 3.14!\n\
    \tTabs,   runs of spaces,\r\nWindows lines; 'tis we'll they're.\n\n\n";

#[test]
fn token_file_round_trip() {
    let dir = TempDir::new("round-trip");
    let path = dir.path("tokens.bin");
    let tokens: Vec<u32> = vec![0, 1, 255, 256, 50256, 65535, 7];
    write_token_file(&path, &tokens).unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len() as usize,
        TOKEN_FILE_HEADER_BYTES + 2 * tokens.len()
    );
    let bytes = fs::read(&path).unwrap();
    assert_eq!(bytes[0..4], TOKEN_FILE_MAGIC.to_le_bytes());
    assert_eq!(bytes[4..8], 1i32.to_le_bytes());
    assert_eq!(bytes[8..12], 7i32.to_le_bytes());
    assert!(bytes[12..TOKEN_FILE_HEADER_BYTES].iter().all(|&b| b == 0));
    assert_eq!(
        bytes[TOKEN_FILE_HEADER_BYTES + 6..][..2],
        256u16.to_le_bytes()
    );
    assert_eq!(read_token_file(&path).unwrap(), tokens);

    // Overwriting replaces the file whole and leaves no temporary file behind.
    write_token_file(&path, &[9, 8]).unwrap();
    assert_eq!(read_token_file(&path).unwrap(), [9, 8]);
    let names: Vec<_> = fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["tokens.bin"]);
}

#[test]
fn a_file_written_by_llm_c_is_read() {
    // What llm.c's `write_datafile` produces for [50256, 5962, 22307].
    let dir = TempDir::new("llmc");
    let path = dir.path("tiny.bin");
    fs::write(
        &path,
        common::token_file_bytes(20240520, 1, 3, &[50256, 5962, 22307]),
    )
    .unwrap();
    assert!(is_token_file(&path));
    assert_eq!(read_token_file(&path).unwrap(), [50256, 5962, 22307]);
}

#[test]
fn malformed_token_files_are_errors_that_name_the_problem() {
    let dir = TempDir::new("malformed");
    let short = read_error(&dir, "short.bin", &[0x88, 0xd8, 0x34, 0x01, 1, 0]);
    assert_contains(&short, &["6 bytes", "1024-byte header"]);

    let magic = read_error(
        &dir,
        "magic.bin",
        &common::token_file_bytes(12345, 1, 1, &[1]),
    );
    assert_contains(
        &magic,
        &[
            "magic number 12345",
            "20240520",
            "not an llm.c token file",
            "prepare",
        ],
    );

    let text = read_error(&dir, "text.bin", &[b'a'; 2000]);
    assert_contains(&text, &["magic number", "not an llm.c token file"]);

    let version = read_error(
        &dir,
        "version.bin",
        &common::token_file_bytes(TOKEN_FILE_MAGIC, 3, 1, &[1]),
    );
    assert_contains(&version, &["unsupported version 3", "version 1"]);

    let truncated = read_error(
        &dir,
        "truncated.bin",
        &common::token_file_bytes(TOKEN_FILE_MAGIC, 1, 10, &[1, 2, 3]),
    );
    assert_contains(
        &truncated,
        &["10 tokens", "1044 bytes", "1030 bytes", "truncated"],
    );

    let trailing = read_error(
        &dir,
        "trailing.bin",
        &common::token_file_bytes(TOKEN_FILE_MAGIC, 1, 2, &[1, 2, 3]),
    );
    assert_contains(
        &trailing,
        &["2 tokens", "1028 bytes", "1030 bytes", "trailing"],
    );

    let empty = read_error(
        &dir,
        "empty.bin",
        &common::token_file_bytes(TOKEN_FILE_MAGIC, 1, 0, &[]),
    );
    assert_contains(&empty, &["zero tokens"]);

    let negative = read_error(
        &dir,
        "negative.bin",
        &common::token_file_bytes(TOKEN_FILE_MAGIC, 1, -5, &[]),
    );
    assert_contains(&negative, &["negative"]);

    let missing = dir.path("missing.bin");
    let err = read_token_file(&missing).unwrap_err().to_string();
    assert_contains(&err, &["missing.bin"]);
}

#[test]
fn is_token_file_sniffs_the_magic() {
    let dir = TempDir::new("sniff");
    let tokens = dir.path("t.bin");
    write_token_file(&tokens, &[1, 2, 3]).unwrap();
    assert!(is_token_file(&tokens));
    let text = dir.path("t.txt");
    fs::write(&text, "hello world, this is text").unwrap();
    assert!(!is_token_file(&text));
    let tiny = dir.path("tiny");
    fs::write(&tiny, [0x88, 0xd8]).unwrap();
    assert!(!is_token_file(&tiny));
    assert!(!is_token_file(&dir.path("does-not-exist")));
    assert!(!is_token_file(&dir.0));
}

#[test]
fn write_refuses_what_the_format_cannot_hold() {
    let dir = TempDir::new("refuse");
    let path = dir.path("big.bin");
    let err = write_token_file_as(&path, &[1, 2, 65535, 65536, 3], TokenFormat::U16)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["65536", "index 3", "u16"]);
    let err = write_token_file_as(&path, &[u32::MAX], TokenFormat::U16)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["4294967295", "index 0"]);
    let err = write_token_file(&path, &[]).unwrap_err().to_string();
    assert_contains(&err, &["no tokens"]);
    assert!(!path.exists(), "a refused write must not create the file");
    assert_eq!(fs::read_dir(&dir.0).unwrap().count(), 0);

    // A missing directory is an I/O error naming the target.
    let nowhere = dir.path("no/such/dir/x.bin");
    let err = write_token_file(&nowhere, &[1]).unwrap_err().to_string();
    assert_contains(&err, &["x.bin"]);
}

#[test]
fn gpt2_known_ids() {
    let t = Gpt2Tokenizer;
    assert_eq!(t.vocab_size(), 50257);
    assert_eq!(Gpt2Tokenizer::EOT, 50256);
    assert_eq!(t.encode("Hello world"), [15496, 995]);
    assert_eq!(t.encode(" the"), [262]);
    assert_eq!(t.encode(""), Vec::<u32>::new());
    assert_eq!(t.decode(&[Gpt2Tokenizer::EOT]), "<|endoftext|>");
    // Special tokens are never parsed from text.
    assert!(!t.encode("a<|endoftext|>b").contains(&Gpt2Tokenizer::EOT));
}

#[test]
fn gpt2_round_trips_text() {
    let t = Gpt2Tokenizer;
    let ids = t.encode(PARAGRAPH);
    assert!(ids.iter().all(|&id| id < 50257));
    assert!(ids.len() < PARAGRAPH.len());
    assert_eq!(t.decode(&ids), PARAGRAPH);
    // Decoding never fails: a cut through a character and unknown ids become U+FFFD.
    let cut = t.decode(&t.encode("日")[..1]);
    assert!(cut.contains('\u{FFFD}'), "{cut:?}");
    assert_eq!(t.decode(&[15496, 99_999, 995]), "Hello\u{FFFD} world");
}

#[test]
fn gpt2_long_texts_encode_exactly_as_one_piece() {
    // Several 256 KiB pieces, cut at whitespace and encoded in parallel, which must give
    // exactly the ids of encoding the whole text at once.
    let mut text = String::new();
    let mut i = 0u32;
    while text.len() < 800_000 {
        text.push_str(PARAGRAPH);
        text.push_str(&format!("Paragraph {i}, with a number.\n"));
        text.push_str(["\n", " \n\n", "\r\n\r\n", "\n\n\n"][i as usize % 4]);
        i += 1;
    }
    let ids = Gpt2Tokenizer.encode(&text);
    let whole = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
    assert_eq!(ids.len(), whole.len());
    assert!(
        ids == whole,
        "parallel encoding differs from encoding the whole text"
    );
    assert_eq!(Gpt2Tokenizer.decode(&ids), text);
}

#[test]
fn gpt2_odd_texts_do_not_panic() {
    let t = Gpt2Tokenizer;
    for text in [
        // tiktoken alone panics on this one (regex stack overflow).
        " ".repeat(1_000_000) + "a",
        "\n".repeat(100_000) + "a",
        "x".repeat(20_000),
        "\u{FFFD}\0\u{7f}\u{200b}\u{180e}\u{1F600}".repeat(1000),
    ] {
        let ids = t.encode(&text);
        assert_eq!(t.decode(&ids), text);
    }
}

#[test]
fn tokenizer_kinds() {
    assert_eq!(
        "gpt2".parse::<TokenizerKind>().unwrap(),
        TokenizerKind::Gpt2
    );
    assert_eq!(
        "bytes".parse::<TokenizerKind>().unwrap(),
        TokenizerKind::Bytes
    );
    assert_eq!(TokenizerKind::Gpt2.to_string(), "gpt2");
    assert_eq!(TokenizerKind::Bytes.to_string(), "bytes");
    let err = "tiktoken".parse::<TokenizerKind>().unwrap_err().to_string();
    assert_contains(&err, &["tiktoken", "gpt2", "bytes"]);
    assert_eq!(
        serde_json::to_string(&TokenizerKind::Gpt2).unwrap(),
        "\"gpt2\""
    );
    let kind: TokenizerKind = serde_json::from_str("\"bytes\"").unwrap();
    assert_eq!(kind, TokenizerKind::Bytes);
    assert!(serde_json::from_str::<TokenizerKind>("\"GPT-2\"").is_err());
    assert_eq!(TokenizerKind::Gpt2.build().unwrap().vocab_size(), 50257);
    assert_eq!(TokenizerKind::Bytes.build().unwrap().vocab_size(), 256);
    assert_eq!(
        TokenizerKind::Bytes.build().unwrap().encode("hé"),
        ByteTokenizer.encode("hé")
    );
}

/// Prepares `text` and checks the files against `kind`'s encoding of it.
fn check_prepare(dir: &TempDir, text: &str, kind: TokenizerKind, val_fraction: f64) {
    let text_path = dir.path("input.txt");
    fs::write(&text_path, text).unwrap();
    let out = dir.path("out/corpus.bin");
    let report = prepare(&text_path, &out, kind.clone(), val_fraction).unwrap();
    let expected = kind.build().unwrap().encode(text);

    // The document starts with the end-of-text token, as in llm.c's files.
    let expected = match kind.end_of_text().unwrap() {
        Some(eot) => [vec![eot], expected].concat(),
        None => expected,
    };
    assert_eq!(report.train_files, std::slice::from_ref(&out));
    assert_eq!(report.val_files, [dir.path("out/corpus_val.bin")]);
    assert_eq!(report.train_tokens + report.val_tokens, expected.len());
    let want_val = (expected.len() as f64 * val_fraction).round() as usize;
    assert_eq!(report.val_tokens, want_val);

    let train = read_token_file(&out).unwrap();
    let val = read_token_file(&report.val_files[0]).unwrap();
    assert_eq!(train.len(), report.train_tokens);
    assert_eq!(val.len(), report.val_tokens);
    assert_eq!([train, val].concat(), expected);
}

#[test]
fn prepare_splits_train_and_val() {
    let dir = TempDir::new("prepare");
    let text = PARAGRAPH.repeat(20);
    check_prepare(&dir, &text, TokenizerKind::Gpt2, 0.1);
    check_prepare(&dir, &text, TokenizerKind::Bytes, 0.25);
}

#[test]
fn prepare_without_val_and_train_names() {
    let dir = TempDir::new("prepare-names");
    let text_path = dir.path("in.txt");
    fs::write(&text_path, PARAGRAPH).unwrap();

    let out = dir.path("all.bin");
    let report = prepare(&text_path, &out, TokenizerKind::Gpt2, 0.0).unwrap();
    assert!(report.val_files.is_empty());
    assert_eq!(report.val_tokens, 0);
    assert!(!dir.path("all_val.bin").exists());
    assert_eq!(
        read_token_file(&out).unwrap(),
        [vec![Gpt2Tokenizer::EOT], Gpt2Tokenizer.encode(PARAGRAPH)].concat()
    );

    let out = dir.path("x_train.bin");
    let report = prepare(&text_path, &out, TokenizerKind::Gpt2, 0.5).unwrap();
    assert_eq!(report.val_files, [dir.path("x_val.bin")]);
    assert!(dir.path("x_val.bin").exists());

    assert_eq!(
        val_path_for(Path::new("data/shakespeare.bin")),
        Path::new("data/shakespeare_val.bin")
    );
    assert_eq!(
        val_path_for(Path::new("data/x_train.bin")),
        Path::new("data/x_val.bin")
    );
}

#[test]
fn prepare_validates_its_inputs() {
    let dir = TempDir::new("prepare-errors");
    let text_path = dir.path("in.txt");
    fs::write(&text_path, PARAGRAPH).unwrap();
    let out = dir.path("out.bin");

    for bad in [-0.1, 1.0, 1.5, f64::NAN, f64::INFINITY] {
        let err = prepare(&text_path, &out, TokenizerKind::Gpt2, bad)
            .unwrap_err()
            .to_string();
        assert_contains(&err, &["--val-fraction", "[0, 1)"]);
    }

    let tiny = dir.path("tiny.txt");
    fs::write(&tiny, "H").unwrap();
    let err = prepare(&tiny, &out, TokenizerKind::Bytes, 0.0)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["is 1 bytes tokens", "at least 2"]);
    // Enough tokens in all, but too few for the val part.
    let err = prepare(&text_path, &out, TokenizerKind::Gpt2, 0.001)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["0 val tokens", "at least 2", "--val-fraction"]);

    let err = prepare(&dir.path("nope.txt"), &out, TokenizerKind::Gpt2, 0.1)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["nope.txt", "No such file"]);

    let latin1 = dir.path("latin1.txt");
    fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let err = prepare(&latin1, &out, TokenizerKind::Gpt2, 0.1)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["latin1.txt", "not valid UTF-8", "offset 3"]);

    let tokens = dir.path("tokens.bin");
    write_token_file(&tokens, &[1, 2, 3]).unwrap();
    let err = prepare(&tokens, &out, TokenizerKind::Gpt2, 0.1)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["already an llm.c token file"]);

    let err = prepare(&text_path, &text_path, TokenizerKind::Gpt2, 0.1)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["would be overwritten"]);
    let err = prepare(&text_path, &dir.0, TokenizerKind::Gpt2, 0.1)
        .unwrap_err()
        .to_string();
    assert_contains(&err, &["is a directory"]);
    assert_eq!(fs::read_to_string(&text_path).unwrap(), PARAGRAPH);

    assert!(!out.exists(), "failed prepares must not write");
}

#[test]
fn prepare_tinyshakespeare_head() {
    let source = Path::new("/work/shared/data/tinyshakespeare.txt");
    let Ok(bytes) = fs::read(source) else {
        return; // Not on this machine: nothing to check.
    };
    let head = &bytes[..bytes.len().min(20_000)];
    let head = match std::str::from_utf8(head) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&head[..e.valid_up_to()]).unwrap(),
    };
    assert!(head.starts_with("First Citizen:"), "{:?}", &head[..40]);
    let dir = TempDir::new("shakespeare");
    check_prepare(&dir, head, TokenizerKind::Gpt2, 0.1);
    let ids = Gpt2Tokenizer.encode(head);
    // "First Citizen:" in GPT-2 ids, as in llm.c's tinyshakespeare files.
    assert_eq!(ids[..4], [5962, 22307, 25, 198]);
    // GPT-2 packs English text at roughly 3-5 bytes per token.
    let bytes_per_token = head.len() as f64 / ids.len() as f64;
    assert!((2.5..6.0).contains(&bytes_per_token), "{bytes_per_token}");
}

/// A token file's sibling `.mask` (prepare's flags) is found by whatever opens the token
/// file, across shards: a target whose token is not flagged trained becomes
/// `cross_entropy::IGNORE`; a token file without one trains everything; a flags file that
/// does not belong to its tokens is refused by name.
#[test]
fn flags_beside_a_token_file_mask_the_targets() {
    use trainkit::data::token_flags::{flags_path_for, write_flags_file, TRAINED};
    use trainkit::data::{DataLoader, TokenDataset};
    use trainkit::ops::cross_entropy::IGNORE;
    let dir = TempDir::new("flags");
    let tokens: Vec<u32> = (0..40).collect();
    // Shard a: tokens 10..20 and 30..40 trained; shard b has no flags.
    let flags: Vec<u8> = (0..40u32)
        .map(|i| {
            if (10..20).contains(&i) || i >= 30 {
                TRAINED
            } else {
                0
            }
        })
        .collect();
    let (a, b) = (dir.path("d_000.bin"), dir.path("d_001.bin"));
    write_token_file(&a, &tokens).unwrap();
    write_token_file(&b, &tokens).unwrap();
    write_flags_file(&flags_path_for(&a), &flags, None).unwrap();
    let data = TokenDataset::open(&dir.path("d_*.bin")).unwrap();
    assert!(data.shards()[0].has_flags() && !data.shards()[1].has_flags());
    let mut loader = DataLoader::new(data, 1, 39).unwrap();
    let masked = loader.next_batch();
    for (i, &t) in masked.targets.iter().enumerate() {
        let want = if flags[i + 1] == TRAINED {
            i as u32 + 1
        } else {
            IGNORE
        };
        assert_eq!(t, want, "position {i}");
    }
    assert_eq!(masked.counted(), 20);
    assert_eq!(masked.inputs, tokens[..39]);
    let plain = loader.next_batch();
    assert_eq!(plain.targets, tokens[1..]);
    assert_eq!(plain.counted(), 39);

    write_flags_file(&flags_path_for(&b), &flags[..30], None).unwrap();
    let e = TokenDataset::open(&dir.path("d_*.bin"))
        .unwrap_err()
        .to_string();
    assert_contains(&e, &["d_001.mask", "30 tokens", "holds 40"]);
}
