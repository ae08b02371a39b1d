//! Hugging Face `tokenizer.json` files, built by the tests themselves: encoding and
//! decoding through trainkit's tokenizer, `prepare --tokenizer FILE|DIR` on text and JSON
//! lines, the end-of-text rule, the 32-bit token format for large vocabularies, and
//! clear errors for bad files.

use crate::common;

use common::trainkit;
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use trainkit::data::{
    prepare, read_token_file, HfTokenizer, TokenFormat, Tokenizer, TokenizerKind, TOKEN_FILE_MAGIC,
};

/// A fresh, empty directory for one test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "trainkit-hf-tokenizer-{}-{name}",
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

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// GPT-2's map from bytes to the printable characters byte-level BPE vocabularies use.
fn byte_chars() -> Vec<char> {
    let printable: Vec<u32> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .map(u32::from)
        .collect();
    let mut chars = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        chars[b as usize] = char::from_u32(c).unwrap();
    }
    chars
}

const MERGES: [(&str, &str); 6] = [
    ("h", "e"),
    ("l", "l"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("he", "ll"),
];

/// A byte-level BPE `tokenizer.json` (GPT-2's design, in miniature): the 256 byte tokens,
/// the merges of [`MERGES`], then `added` special tokens.
fn byte_level_bpe(added: &[&str]) -> Value {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    for (a, b) in MERGES {
        let id = vocab.len();
        vocab.insert(format!("{a}{b}"), json!(id));
    }
    let merges: Vec<String> = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let added: Vec<Value> = added
        .iter()
        .enumerate()
        .map(|(i, t)| special(vocab.len() + i, t))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    })
}

fn special(id: usize, content: &str) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
           "rstrip": false, "normalized": false, "special": true})
}

/// A word-level `tokenizer.json`: `[UNK]` and the words `w0`, `w1`, ... `w{n-2}`, split at
/// whitespace, no end-of-text token.
fn word_level(n: usize) -> Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for i in 1..n {
        vocab.insert(format!("w{}", i - 1), json!(i));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "[UNK]")],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

fn write_json(path: &Path, value: &Value) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, serde_json::to_vec(value).unwrap()).unwrap();
}

/// The ids the `tokenizers` library itself gives `text`.
fn reference_ids(file: &Path, text: &str) -> Vec<u32> {
    let t = tokenizers::Tokenizer::from_file(file).unwrap();
    t.encode(text, false).unwrap().get_ids().to_vec()
}

const TEXT: &str = "hello world, hello World!\n\tça va? 日本語 — «quotes» and  spaces  ";

#[test]
fn byte_level_bpe_round_trip() {
    let dir = TempDir::new("round-trip");
    let file = dir.path("tokenizer.json");
    write_json(&file, &byte_level_bpe(&["<|endoftext|>"]));
    let kind: TokenizerKind = s(&file).parse().unwrap();
    assert_eq!(kind, TokenizerKind::HuggingFace(file.clone()));
    let tok = kind.build().unwrap();
    assert_eq!(tok.vocab_size(), 256 + MERGES.len() + 1);
    assert_eq!(kind.vocab_size().unwrap(), tok.vocab_size());
    let eot = (256 + MERGES.len()) as u32;
    assert_eq!(tok.end_of_text(), Some(eot));
    assert_eq!(kind.end_of_text().unwrap(), Some(eot));

    // "hello" is `hell` `o`; " world" is ` wor` `l` `d`.
    let hell = 256 + 5;
    let wor = 256 + 4;
    assert_eq!(
        tok.encode("hello world"),
        [hell, u32::from(b'o'), wor, u32::from(b'l'), u32::from(b'd')]
    );
    let ids = tok.encode(TEXT);
    assert_eq!(ids, reference_ids(&file, TEXT));
    assert_eq!(tok.decode(&ids), TEXT);
    // A special token in the text is encoded as text, and decodes back to it.
    let ids = tok.encode("a<|endoftext|>b");
    assert!(!ids.contains(&eot), "{ids:?}");
    assert_eq!(tok.decode(&ids), "a<|endoftext|>b");
    assert_eq!(tok.decode(&[eot]), "<|endoftext|>");
    // Ids outside the vocabulary never fail.
    let _ = tok.decode(&[u32::MAX, 5, 70000]);

    // A directory that holds a tokenizer.json is read the same.
    let from_dir = HfTokenizer::open(&dir.0).unwrap();
    assert_eq!(from_dir.path(), file);
    assert_eq!(from_dir.encode(TEXT), tok.encode(TEXT));
}

#[test]
fn end_of_text_rule() {
    let dir = TempDir::new("eos");
    let file = dir.path("m/tokenizer.json");
    // Both `</s>` and `<|endoftext|>`: the list's order picks `<|endoftext|>`...
    write_json(&file, &byte_level_bpe(&["</s>", "<|endoftext|>"]));
    let base = (256 + MERGES.len()) as u32;
    let t = HfTokenizer::open(&file).unwrap();
    assert_eq!(t.end_of_text(), Some(base + 1));
    assert_eq!(t.end_of_text_token(), Some("<|endoftext|>"));
    // ... unless a tokenizer_config.json beside it names the eos token.
    write_json(
        &dir.path("m/tokenizer_config.json"),
        &json!({"eos_token": {"content": "</s>", "special": true}}),
    );
    let t = HfTokenizer::open(&file).unwrap();
    assert_eq!(t.end_of_text(), Some(base));
    write_json(
        &dir.path("m/tokenizer_config.json"),
        &json!({"eos_token": "<|endoftext|>"}),
    );
    assert_eq!(
        HfTokenizer::open(&file).unwrap().end_of_text(),
        Some(base + 1)
    );
    // A named token the vocabulary lacks is ignored.
    write_json(
        &dir.path("m/tokenizer_config.json"),
        &json!({"eos_token": "<eos>"}),
    );
    assert_eq!(
        HfTokenizer::open(&file).unwrap().end_of_text(),
        Some(base + 1)
    );
    // None at all.
    let plain = dir.path("plain.json");
    write_json(&plain, &byte_level_bpe(&["<pad>"]));
    assert_eq!(HfTokenizer::open(&plain).unwrap().end_of_text(), None);
}

#[test]
fn prepare_text_and_json_lines() {
    let dir = TempDir::new("prepare");
    let model = dir.path("model");
    let file = model.join("tokenizer.json");
    write_json(&file, &byte_level_bpe(&["<|endoftext|>"]));
    let eot = (256 + MERGES.len()) as u32;
    let text = dir.path("a.txt");
    fs::write(&text, TEXT).unwrap();
    let docs = ["hello world", "Hello, World!\nsecond line", ""];
    let jsonl = dir.path("b.jsonl");
    let lines: Vec<String> = docs
        .iter()
        .map(|d| json!({"text": d, "id": 1}).to_string())
        .collect();
    fs::write(&jsonl, lines.join("\n") + "\n").unwrap();

    let mut expected = vec![eot];
    expected.extend(reference_ids(&file, TEXT));
    for d in docs {
        expected.push(eot);
        expected.extend(reference_ids(&file, d));
    }
    // The file, and the model directory that holds it.
    for (i, tokenizer) in [&file, &model].into_iter().enumerate() {
        let out = dir.path(&format!("out{i}/tokens.bin"));
        let (ok, stdout, stderr) = trainkit(&[
            "prepare",
            "--text",
            s(&text),
            "--jsonl",
            s(&jsonl),
            "--out",
            s(&out),
            "--tokenizer",
            s(tokenizer),
            "--val-fraction",
            "0",
        ]);
        assert!(ok, "{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("--vocab-size {}", eot + 1)),
            "{stdout}"
        );
        let bytes = fs::read(&out).unwrap();
        assert_eq!(
            i32::from_le_bytes(bytes[..4].try_into().unwrap()),
            TOKEN_FILE_MAGIC
        );
        assert_eq!(read_token_file(&out).unwrap(), expected);
    }
}

#[test]
fn large_vocabulary_writes_u32_tokens() {
    let dir = TempDir::new("u32");
    let file = dir.path("big.json");
    write_json(&file, &word_level(70_000));
    let kind = TokenizerKind::HuggingFace(file.clone());
    assert_eq!(kind.vocab_size().unwrap(), 70_000);
    assert_eq!(kind.end_of_text().unwrap(), None);
    let text = dir.path("t.txt");
    fs::write(&text, "w69998 w0 w65535 nope w12345 w69998").unwrap();
    let out = dir.path("t.bin");
    let report = prepare(&text, &out, kind.clone(), 0.0).unwrap();
    assert_eq!(report.train_tokens, 6);
    let bytes = fs::read(&out).unwrap();
    let magic = i32::from_le_bytes(bytes[..4].try_into().unwrap());
    assert_eq!(TokenFormat::from_magic(magic), Some(TokenFormat::U32));
    assert_eq!(
        read_token_file(&out).unwrap(),
        [69_999, 1, 65_536, 0, 12_346, 69_999]
    );
    let tok = kind.build().unwrap();
    assert_eq!(tok.decode(&[69_999, 1]), "w69998 w0");

    // Training text with it needs a model with at least its vocabulary.
    let (ok, stdout, stderr) = trainkit(&[
        "train",
        "--data",
        s(&text),
        "--tokenizer",
        s(&file),
        "--vocab-size",
        "256",
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "8",
        "--n-positions",
        "4",
        "--seq-len",
        "2",
        "--batch-size",
        "1",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("big.json") && stderr.contains("70000") && stderr.contains("--vocab-size"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_tokenizer_files() {
    let dir = TempDir::new("bad");
    let text = dir.path("t.txt");
    fs::write(&text, "hello world").unwrap();
    let not_json = dir.path("notes.json");
    fs::write(&not_json, "just some text").unwrap();
    let other_json = dir.path("config.json");
    write_json(&other_json, &json!({"n_layer": 2, "vocab_size": 100}));
    let empty_dir = dir.path("empty");
    fs::create_dir_all(&empty_dir).unwrap();
    let no_unk = dir.path("no_unk.json");
    let mut v = word_level(3);
    v["model"]["unk_token"] = json!("[MISSING]");
    write_json(&no_unk, &v);
    let missing = dir.path("missing/tokenizer.json");
    let cases: [(&Path, &[&str]); 5] = [
        (
            &missing,
            &["missing/tokenizer.json", "no such file", "gpt2"],
        ),
        (&not_json, &["notes.json", "not JSON"]),
        (
            &other_json,
            &["config.json", "not a Hugging Face tokenizer.json"],
        ),
        (&empty_dir, &["empty", "holds no tokenizer.json"]),
        (&no_unk, &["no_unk.json", "cannot encode"]),
    ];
    for (tokenizer, wanted) in cases {
        let out = dir.path("out.bin");
        let (ok, stdout, stderr) = trainkit(&[
            "prepare",
            "--text",
            s(&text),
            "--out",
            s(&out),
            "--tokenizer",
            s(tokenizer),
        ]);
        assert!(!ok, "{}: {stdout}", tokenizer.display());
        for w in wanted {
            assert!(
                stderr.contains(w),
                "{}: wanted {w:?} in {stderr}",
                tokenizer.display()
            );
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!out.exists());
    }
    // A bare unknown name is a mistake, not a missing file.
    let err = "wordpiece"
        .parse::<TokenizerKind>()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gpt2") && err.contains("tokenizer.json"),
        "{err}"
    );
}

#[test]
fn train_saves_the_tokenizer_and_sample_uses_it() {
    let dir = TempDir::new("sample");
    let file = dir.path("src/tokenizer.json");
    write_json(&file, &byte_level_bpe(&["<|endoftext|>"]));
    let text = dir.path("t.txt");
    fs::write(&text, TEXT.repeat(20)).unwrap();
    let out = dir.path("model");
    let (ok, stdout, stderr) = trainkit(&[
        "train",
        "--data",
        s(&text),
        "--tokenizer",
        s(&file),
        "--vocab-size",
        "264",
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "8",
        "--n-positions",
        "8",
        "--seq-len",
        "8",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--out",
        s(&out),
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert_eq!(
        fs::read(out.join("tokenizer.json")).unwrap(),
        fs::read(&file).unwrap()
    );
    // The saved tokenizer is found even when the original is gone.
    fs::remove_file(&file).unwrap();
    let (ok, stdout, stderr) = trainkit(&[
        "sample",
        "--model",
        s(&out),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
        "--temperature",
        "0",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.starts_with("hello world"), "{stdout}");
}

/// A new user's path: `prepare --tokenizer M`, `train --init-from M` (no --tokenizer),
/// `sample`. The model directory's tokenizer files (tokenizer.json, tokenizer_config.json,
/// chat_template.jinja) go with the model into --out, and sample decodes with them.
#[test]
fn init_from_carries_the_model_directory_tokenizer_into_out() {
    let dir = TempDir::new("init-from");
    let file = dir.path("src/tokenizer.json");
    write_json(&file, &byte_level_bpe(&["<|endoftext|>"]));
    fs::write(
        dir.path("src/tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>"}"#,
    )
    .unwrap();
    let template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}";
    fs::write(dir.path("src/chat_template.jinja"), template).unwrap();
    let text = dir.path("t.txt");
    fs::write(&text, TEXT.repeat(20)).unwrap();
    let shape = [
        "--vocab-size",
        "264",
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "8",
        "--n-positions",
        "8",
    ];
    let run = |args: &[&str]| {
        let (ok, stdout, stderr) = trainkit(args);
        assert!(ok, "{args:?}\n{stdout}\n{stderr}");
        stdout
    };
    let common = ["--seq-len", "8", "--batch-size", "2", "--device", "cpu"];
    // The "downloaded" model: a directory with weights, config and tokenizer files.
    let base = dir.path("base");
    let mut args = vec!["train", "--data", s(&text), "--tokenizer", s(&file)];
    args.extend(shape);
    args.extend(common);
    args.extend(["--steps", "1", "--out", s(&base)]);
    run(&args);
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        assert!(base.join(name).is_file(), "{name} not in the base model");
    }
    // prepare with the model directory, train from it with no --tokenizer.
    let tokens = dir.path("data/tokens.bin");
    run(&[
        "prepare",
        "--text",
        s(&text),
        "--tokenizer",
        s(&base),
        "--out",
        s(&tokens),
    ]);
    let out = dir.path("tuned");
    let mut args = vec!["train", "--data", s(&tokens), "--init-from", s(&base)];
    args.extend(common);
    args.extend(["--steps", "2", "--out", s(&out)]);
    run(&args);
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        assert_eq!(
            fs::read(out.join(name)).unwrap(),
            fs::read(base.join(name)).unwrap(),
            "{name}"
        );
    }
    let cfg = fs::read_to_string(out.join("trainkit.toml")).unwrap();
    assert!(cfg.contains("tokenizer.json"), "{cfg}");
    let stdout = run(&[
        "sample",
        "--model",
        s(&out),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
        "--temperature",
        "0",
    ]);
    assert!(stdout.starts_with("hello world"), "{stdout}");
}

#[test]
fn configs_take_a_tokenizer_path() {
    use trainkit::config::{DataConfig, RunConfig};
    // Read when the data is loaded, not when the config is parsed: the file need not exist.
    let text = "[data]\nsource = \"text\"\npath = \"x.txt\"\ntokenizer = \"models/llama/\"\n";
    let cfg = RunConfig::from_toml(text).unwrap();
    let kind = TokenizerKind::HuggingFace("models/llama/".into());
    assert_eq!(cfg.data.tokenizer(), kind);
    let again = RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert_eq!(again.data, cfg.data);
    // The built-in names parse as before.
    let old = "[data]\nsource = \"tokens\"\ntrain = \"x.bin\"\ntokenizer = \"gpt2\"\n";
    assert_eq!(
        RunConfig::from_toml(old).unwrap().data.tokenizer(),
        TokenizerKind::Gpt2
    );
    let err = RunConfig::from_toml(&text.replace("models/llama/", "wordpiece"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown tokenizer `wordpiece`"), "{err}");
    // Loading reads it, and names it when it is missing.
    let data = DataConfig::Text {
        path: "x.txt".into(),
        tokenizer: kind,
        val_fraction: 0.1,
        shuffle: false,
        document_mask: false,
        separator_id: None,
    };
    let err = data.load(8, 1 << 20).unwrap_err().to_string();
    assert!(
        err.contains("models/llama/") && err.contains("no such file"),
        "{err}"
    );
}

/// [`byte_level_bpe`] with Llama 3's pre-tokenizer (which keeps a run of newlines whole)
/// and a merge of two newlines.
fn llama3_style() -> Value {
    let mut v = byte_level_bpe(&["<|end_of_text|>"]);
    let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]});
    let eot = v["added_tokens"][0]["id"].as_u64().unwrap();
    v["model"]["vocab"]["ĊĊ"] = json!(eot);
    v["added_tokens"][0]["id"] = json!(eot + 1);
    v["model"]["merges"]
        .as_array_mut()
        .unwrap()
        .push(json!("Ċ Ċ"));
    v
}

#[test]
fn long_text_files_encode_as_a_whole() {
    let dir = TempDir::new("long");
    let file = dir.path("tokenizer.json");
    write_json(&file, &llama3_style());
    let tok = HfTokenizer::open(&file).unwrap();
    let eot = tok.end_of_text().unwrap();
    assert_eq!(tok.encode("\n\n"), [eot - 1]);
    // Long enough to be cut into pieces, with runs of newlines everywhere.
    let text = "hello world, it's 12345 wor\n\nld!\n\n\nhe  said\n \n".repeat(20_000);
    let path = dir.path("long.txt");
    fs::write(&path, &text).unwrap();
    let out = dir.path("long.bin");
    prepare(&path, &out, TokenizerKind::HuggingFace(file.clone()), 0.0).unwrap();
    let mut expected = vec![eot];
    expected.extend(reference_ids(&file, &text));
    let got = read_token_file(&out).unwrap();
    let first = got.iter().zip(&expected).position(|(a, b)| a != b);
    if let Some(i) =
        first.or((got.len() != expected.len()).then_some(got.len().min(expected.len())))
    {
        let lo = i.saturating_sub(8);
        panic!(
            "ids differ at {i} of {} / {}: {:?} vs {:?}",
            got.len(),
            expected.len(),
            &got[lo..(i + 8).min(got.len())],
            &expected[lo..(i + 8).min(expected.len())]
        );
    }
}

/// A model directory's tokenizer in `dir`: a byte-level BPE with ChatML's markers and
/// `<|endoftext|>`, and `template` as its chat template (`<|im_end|>` its end of
/// sequence).
fn write_chat_tokenizer(dir: &Path, template: &str) {
    write_json(
        &dir.join("tokenizer.json"),
        &byte_level_bpe(&["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    );
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"eos_token": "<|im_end|>", "chat_template": template}),
    );
}

/// The runs of consecutive trained tokens (flags with TRAINED) of `tokens`, decoded.
fn trained_runs(tok: &HfTokenizer, tokens: &[u32], flags: &[u8]) -> Vec<String> {
    let trained = trainkit::data::token_flags::TRAINED;
    let mut runs = Vec::new();
    let mut run = Vec::new();
    for (&t, &f) in tokens.iter().zip(flags) {
        if f & trained != 0 {
            run.push(t);
        } else if !run.is_empty() {
            runs.push(tok.decode(&std::mem::take(&mut run)));
        }
    }
    if !run.is_empty() {
        runs.push(tok.decode(&run));
    }
    runs
}

/// `prepare --chat` with a model directory's tokenizer and its chat template (in
/// tokenizer_config.json): the three row forms, a bad row reported by file and line (or
/// skipped), one example per row of --seq-len tokens equal to the `tokenizers` library's
/// ids of the rendered text, trained exactly where the assistant speaks; `train` takes the
/// data with its --seq-len and refuses another.
#[test]
fn prepare_chat_masks_what_the_assistant_says() {
    use trainkit::data::token_flags::{flags_path_for, DOCUMENT_START, TRAINED};
    let dir = TempDir::new("chat");
    let model = dir.path("model");
    let template = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + \
                    message['content'].strip() + '<|im_end|>' + '\n' }}{% endfor %}\
                    {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    write_chat_tokenizer(&model, template);
    let rows = [
        r#"{"messages":[{"role":"system","content":"Be kind."},{"role":"user","content":"hello"},{"role":"assistant","content":"hello world"}]}"#,
        r#"{"instruction":"Say","input":"hi","output":"world"}"#,
        r#"{"conversations":[{"from":"human","value":"a"},{"from":"gpt","value":"b"},{"from":"human","value":"c"},{"from":"gpt","value":"d"}]}"#,
        r#"{"messages":[]}"#,
    ];
    let chat = dir.path("chat.jsonl");
    fs::write(&chat, rows.join("\n")).unwrap();
    let out = dir.path("data/chat.bin");
    let prepare = |seq: &str, extra: &[&str]| {
        let mut args = vec![
            "prepare",
            "--chat",
            s(&chat),
            "--tokenizer",
            s(&model),
            "--out",
            s(&out),
            "--seq-len",
            seq,
            "--val-fraction",
            "0",
        ];
        args.extend_from_slice(extra);
        trainkit(&args)
    };
    let (ok, _, err) = prepare("64", &[]);
    assert!(!ok);
    assert!(
        err.contains("chat.jsonl line 4") && err.contains("empty conversation"),
        "{err}"
    );
    let (ok, stdout, err) = prepare("64", &["--skip-bad-rows"]);
    assert!(ok, "{stdout}\n{err}");
    assert!(
        stdout.contains("3 conversations") && stdout.contains("1 rows"),
        "{stdout}"
    );

    let tokens = read_token_file(&out).unwrap();
    let flags = fs::read(flags_path_for(&out)).unwrap()[1024..].to_vec();
    assert_eq!((tokens.len(), flags.len()), (3 * 64 + 1, 3 * 64 + 1));
    let tok = HfTokenizer::open(&model).unwrap();
    let rendered = [
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n\
         <|im_start|>assistant\nhello world<|im_end|>\n",
        "<|im_start|>user\nSay\n\nhi<|im_end|>\n<|im_start|>assistant\nworld<|im_end|>\n",
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\n\
         c<|im_end|>\n<|im_start|>assistant\nd<|im_end|>\n",
    ];
    let trained = [
        vec!["hello world<|im_end|>\n"],
        vec!["world<|im_end|>\n"],
        vec!["b<|im_end|>\n", "d<|im_end|>\n"],
    ];
    let eot = tok.end_of_text().unwrap();
    for (r, (text, want)) in rendered.iter().zip(&trained).enumerate() {
        let row = &tokens[r * 64..(r + 1) * 64];
        let f = &flags[r * 64..(r + 1) * 64];
        let ids = reference_ids(&model.join("tokenizer.json"), text);
        assert_eq!(row[..ids.len()], ids[..], "row {r}");
        assert!(
            row[ids.len()..].iter().all(|&t| t == eot),
            "row {r} padding"
        );
        assert_eq!(f[0], DOCUMENT_START);
        assert!(f[ids.len()..].iter().all(|&x| x == 0));
        // The trained runs, decoded, are what the assistant says with its end of turn.
        let runs = trained_runs(&tok, row, f);
        assert_eq!(runs, *want, "row {r}");
    }

    let train = |seq: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            s(&out),
            "--tokenizer",
            s(&model),
            "--vocab-size",
            "265",
            "--n-layer",
            "1",
            "--n-head",
            "1",
            "--n-embd",
            "8",
            "--n-positions",
            seq,
            "--seq-len",
            seq,
            "--batch-size",
            "1",
            "--steps",
            "2",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        trainkit(&args)
    };
    let (ok, stdout, err) = train("64", &[]);
    assert!(ok, "{stdout}\n{err}");
    assert!(stdout.contains("trained)"), "{stdout}");
    // The tokenizer's files go with the model; sample --chat renders its template.
    let saved = dir.path("tuned");
    let (ok, stdout, err) = train("64", &["--out", s(&saved)]);
    assert!(ok, "{stdout}\n{err}");
    assert!(saved.join("tokenizer_config.json").is_file());
    let (ok, stdout, err) = trainkit(&[
        "sample",
        "--model",
        s(&saved),
        "--chat",
        "hello",
        "--system",
        "Be kind.",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{stdout}\n{err}");
    assert!(!stdout.contains("<|im_end|>"), "{stdout}");
    let (ok, _, err) = trainkit(&["sample", "--model", s(&saved), "--device", "cpu"]);
    assert!(!ok && err.contains("--prompt"), "{err}");
    let (ok, _, err) = train("32", &[]);
    assert!(!ok);
    assert!(err.contains("--seq-len 64"), "{err}");

    // Packed: the three conversations whole in one row of 256, each a document of its own
    // (its first token flagged), then padding that is a document too.
    let (ok, stdout, err) = prepare("256", &["--skip-bad-rows", "--pack"]);
    assert!(ok, "{stdout}\n{err}");
    assert!(stdout.contains("packed into 1 train"), "{stdout}");
    let tokens = read_token_file(&out).unwrap();
    let flags = fs::read(flags_path_for(&out)).unwrap()[1024..].to_vec();
    assert_eq!(tokens.len(), 257);
    let mut at = 0;
    for text in rendered {
        let ids = reference_ids(&model.join("tokenizer.json"), text);
        assert_eq!(tokens[at..at + ids.len()], ids[..]);
        assert_eq!(flags[at], DOCUMENT_START);
        assert!(flags[at + 1..at + ids.len()]
            .iter()
            .all(|&f| f & DOCUMENT_START == 0));
        at += ids.len();
    }
    assert_eq!(flags[at], DOCUMENT_START, "the padding starts a document");
    assert!(tokens[at..256].iter().all(|&t| t == eot));
    let packed = dir.path("packed");
    let (ok, stdout, err) = train("256", &["--out", s(&packed), "--val-data", s(&out)]);
    assert!(ok, "{stdout}\n{err}");
    let (ok, stdout, err) = trainkit(&[
        "eval",
        "--model",
        s(&packed),
        "--data",
        s(&out),
        "--seq-len",
        "256",
        "--batch-size",
        "1",
        "--batches",
        "1",
        "--json",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{stdout}\n{err}");
    let trained = flags[1..].iter().filter(|&&f| f & TRAINED != 0).count();
    assert!(
        stdout.contains(&format!("\"trained_tokens\":{trained}")),
        "{stdout}"
    );
}

/// The words of the `trainkit ...` command in the line of `out` that starts with `lead`,
/// split as a shell splits them (quotes removed).
fn printed_command(out: &str, lead: &str) -> Vec<String> {
    let line = out
        .lines()
        .find(|l| l.starts_with(lead))
        .unwrap_or_else(|| panic!("no line starting {lead:?} in:\n{out}"));
    let command = &line[line.find("trainkit ").unwrap() + "trainkit ".len()..];
    let (mut words, mut word, mut quote) = (Vec::new(), String::new(), None);
    for c in command.chars() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, ' ') if !word.is_empty() => words.push(std::mem::take(&mut word)),
            (None, ' ') => {}
            (_, c) => word.push(c),
        }
    }
    words.extend((!word.is_empty()).then_some(word));
    words
}

/// Runs a printed command with `extra` flags appended (a short run's).
fn run_printed(words: &[String], extra: &[&str]) -> String {
    let mut args: Vec<&str> = words.iter().map(String::as_str).collect();
    args.extend_from_slice(extra);
    let (ok, out, err) = trainkit(&args);
    assert!(ok, "{args:?}:\n{out}\n{err}");
    out
}

/// `prepare --chat`'s hint trains as printed: from scratch with a bare tokenizer, as a
/// fine-tune of the model when the tokenizer is a model directory's; the fine-tune's
/// sample hint replies to a chat message and keeps `--qlora`.
#[test]
fn prepare_and_train_hints_run_as_printed() {
    let dir = TempDir::new("hints");
    let tokenizer = dir.path("tokenizer");
    let template = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + \
                    message['content'] + '<|im_end|>\n' }}{% endfor %}\
                    {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    write_chat_tokenizer(&tokenizer, template);
    let chat = dir.path("chat.jsonl");
    let row = r#"{"messages":[{"role":"user","content":"hello"},{"role":"assistant","content":"hi there"}]}"#;
    fs::write(&chat, [row; 8].join("\n")).unwrap();
    let prepare = |tok: &Path, name: &str| {
        let out = dir.path(name);
        let (ok, stdout, err) = trainkit(&[
            "prepare",
            "--chat",
            s(&chat),
            "--tokenizer",
            s(tok),
            "--out",
            s(&out),
            "--seq-len",
            "32",
        ]);
        assert!(ok, "{stdout}\n{err}");
        stdout
    };
    let small = [
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--device",
        "cpu",
        "--n-layer",
        "1",
        "--n-head",
        "1",
        "--n-embd",
        "8",
    ];
    // A built-in template whose markers the tokenizer lacks is warned of, by name.
    for (template, warned) in [("llama3", true), ("chatml", false)] {
        let (ok, _, err) = trainkit(&[
            "prepare",
            "--chat",
            s(&chat),
            "--tokenizer",
            s(&tokenizer),
            "--out",
            s(&dir.path("t.bin")),
            "--seq-len",
            "256",
            "--template",
            template,
        ]);
        assert!(ok, "{err}");
        let says = err.contains("does not have as single tokens")
            && err.contains("<|start_header_id|>, <|end_header_id|>, <|eot_id|>");
        assert_eq!(says, warned, "{template}: {err}");
    }
    // A tokenizer without a model: a model from scratch, with its vocabulary.
    let stdout = prepare(&tokenizer, "data/chat.bin");
    assert!(!stdout.contains("--init-from"), "{stdout}");
    let scratch = dir.path("scratch");
    let command = printed_command(&stdout, "train a model from scratch");
    run_printed(&command, &[&small[..], &["--out", s(&scratch)]].concat());
    // The saved model's directory as the tokenizer: a fine-tune of it.
    let stdout = prepare(&scratch, "data/again.bin");
    let command = printed_command(&stdout, "fine-tune the model");
    assert!(
        command.contains(&"--init-from".to_string()) && command.contains(&s(&scratch).to_string()),
        "{command:?}"
    );
    assert!(stdout.contains("--lora-rank 16"), "{stdout}");
    let out = run_printed(
        &command,
        &[
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--device",
            "cpu",
            "--lora-rank",
            "2",
            "--qlora",
        ],
    );
    assert!(
        dir.path("data/again-tuned/adapter_config.json").is_file(),
        "{out}"
    );
    let mut sample = printed_command(&out, "sample from it");
    assert!(
        sample.contains(&"--chat".to_string()) && sample.contains(&"--qlora".to_string()),
        "{sample:?}"
    );
    let n = sample.iter().position(|w| w == "--max-new-tokens").unwrap();
    sample[n + 1] = "2".to_string();
    run_printed(&sample, &["--device", "cpu"]);
}

/// A template in Qwen3's style, which drops earlier assistant turns' reasoning once later
/// turns come: `prepare --chat` locates each reply in the whole rendering (after the
/// template's assistant header, or after --response-marker) and trains what it says.
#[test]
fn replies_of_a_template_that_rewrites_turns_are_trained() {
    use trainkit::data::token_flags::flags_path_for;
    let dir = TempDir::new("rewrites");
    let model = dir.path("model");
    let template = r#"{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set content = m.content.split('</think>')[-1].lstrip('\n') %}{%- if loop.last and '</think>' in m.content %}{{- '<|im_start|>assistant\n<think>\n' + m.content.split('</think>')[0].split('<think>')[-1].strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;
    write_chat_tokenizer(&model, template);
    let row = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nBye."},
    ]});
    let chat = dir.path("chat.jsonl");
    fs::write(&chat, row.to_string()).unwrap();
    let out = dir.path("chat.bin");
    let tok = HfTokenizer::open(&model).unwrap();
    for extra in [&[][..], &["--response-marker", "<|im_start|>assistant\\n"]] {
        let mut args = vec![
            "prepare",
            "--chat",
            s(&chat),
            "--tokenizer",
            s(&model),
            "--out",
            s(&out),
            "--seq-len",
            "128",
            "--val-fraction",
            "0",
        ];
        args.extend_from_slice(extra);
        let (ok, stdout, err) = trainkit(&args);
        assert!(ok, "{extra:?}: {stdout}\n{err}");
        assert!(
            stdout.contains("1 conversations had their replies located"),
            "{stdout}"
        );
        let tokens = read_token_file(&out).unwrap();
        let flags = fs::read(flags_path_for(&out)).unwrap()[1024..].to_vec();
        let runs = trained_runs(&tok, &tokens, &flags);
        assert_eq!(
            runs,
            [
                "Hello!<|im_end|>\n",
                "<think>\nok\n</think>\n\nBye.<|im_end|>\n"
            ],
            "{extra:?}"
        );
    }
}
