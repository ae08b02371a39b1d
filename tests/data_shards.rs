//! Data at scale through the public API: token shards (u16 and u32) named by a file, a
//! glob or a directory; batching across shards and shuffling; exact resume across shard
//! boundaries and epochs; the streaming `prepare` (text, JSON lines, shards); bad input.

use crate::common;

use common::{cpu, per_param, scratch, trainkit};
use std::fs;
use std::path::{Path, PathBuf};
use trainkit::config::DataConfig;
use trainkit::data::{
    is_token_file, prepare_with, read_token_file, write_token_file, write_token_file_as,
    DataLoader, Gpt2Tokenizer, InputKind, PrepareOptions, TokenDataset, TokenFormat, Tokenizer,
    TokenizerKind,
};
use trainkit::{Constant, Gpt2, Trainer, TrainerOptions};

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes shards `NAME_00000i.bin` of the given lengths holding consecutive ids (mod
/// `modulo`) into `dir`; returns their paths.
fn write_shards(dir: &Path, name: &str, lens: &[usize], modulo: u32) -> Vec<PathBuf> {
    let mut next = 0u32;
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = dir.join(format!("{name}_{i:06}.bin"));
            let tokens: Vec<u32> = (0..n)
                .map(|_| {
                    next += 1;
                    (next - 1) % modulo
                })
                .collect();
            write_token_file(&p, &tokens).unwrap();
            p
        })
        .collect()
}

fn assert_contains(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "expected `{part}` in: {msg}");
    }
}

#[test]
fn u32_token_files_round_trip_in_llm_c_s_llama_3_format() {
    let dir = scratch("shards-u32");
    let p = dir.join("llama.bin");
    let tokens = vec![0, 128_000, 128_255, 65_536, 7];
    write_token_file(&p, &tokens).unwrap();
    let bytes = fs::read(&p).unwrap();
    assert_eq!(bytes[0..4], 20240801i32.to_le_bytes());
    assert_eq!(bytes[4..8], 7i32.to_le_bytes());
    assert_eq!(bytes.len(), 1024 + 4 * tokens.len());
    assert!(is_token_file(&p));
    assert_eq!(read_token_file(&p).unwrap(), tokens);
    let data = TokenDataset::open(&p).unwrap();
    assert_eq!(data.format(), Some(TokenFormat::U32));
    let mut got = Vec::new();
    data.shards()[0].read_into(1, 3, &mut got);
    assert_eq!(got, [128_000, 128_255, 65_536]);
    // Small ids still go to the u16 format unless asked.
    write_token_file_as(&p, &[1, 2], TokenFormat::U32).unwrap();
    assert_eq!(
        TokenDataset::open(&p).unwrap().format(),
        Some(TokenFormat::U32)
    );
    write_token_file(&p, &[1, 2]).unwrap();
    assert_eq!(
        TokenDataset::open(&p).unwrap().format(),
        Some(TokenFormat::U16)
    );
}

#[test]
fn data_is_a_file_a_glob_or_a_directory_with_val_shards_beside_it() {
    let dir = scratch("shards-specs");
    let train = write_shards(&dir, "fw_train", &[100, 50, 80], 1000);
    let val = write_shards(&dir, "fw_val", &[30], 1000);
    let glob = dir.join("fw_train_*.bin");
    let data = TokenDataset::open(&glob).unwrap();
    let files: Vec<_> = data.shards().iter().map(|s| s.path().unwrap()).collect();
    assert_eq!(
        files,
        train.iter().map(PathBuf::as_path).collect::<Vec<_>>()
    );
    assert_eq!(data.len_tokens(), 230);
    // `_train` → `_val` for the glob's validation shards.
    let v = TokenDataset::open_val_for(&glob).unwrap().unwrap();
    assert_eq!(v.shards()[0].path().unwrap(), val[0]);

    // A directory, and a glob matching both: `_val` shards are held out.
    for spec in [dir.clone(), dir.join("fw_*.bin")] {
        let d = TokenDataset::open(&spec).unwrap();
        assert_eq!(d.len_tokens(), 230, "{}", spec.display());
        let v = TokenDataset::open_val_for(&spec).unwrap().unwrap();
        assert_eq!(v.len_tokens(), 30);
    }

    // A config from the command line picks token data for a glob or a directory.
    for spec in [&glob, &dir] {
        let cfg = DataConfig::from_path(spec, None);
        assert!(matches!(cfg, DataConfig::Tokens { .. }), "{cfg:?}");
        let corpus = cfg.load(9, 1000).unwrap();
        assert_eq!(corpus.train.len_tokens(), 230);
        assert_eq!(corpus.val.len_tokens(), 30);
    }

    // One file without a val sibling: the last tenth of it is held out.
    let lone = scratch("shards-lone").join("lone.bin");
    write_token_file(&lone, &(0..200).collect::<Vec<u32>>()).unwrap();
    let corpus = DataConfig::from_path(&lone, None).load(5, 300).unwrap();
    assert_eq!(corpus.train.len_tokens(), 180);
    assert_eq!(corpus.val.len_tokens(), 20);
}

#[test]
fn batches_cross_shards_as_llm_c_and_shuffle_per_epoch() {
    let dir = scratch("shards-batches");
    // Shards of 25, 5 (too short: skipped) and 17 tokens; batches of 2 × 3.
    write_shards(&dir, "b", &[25, 5, 17], 1 << 16);
    let data = TokenDataset::open(&dir.join("b_*.bin")).unwrap();
    let mut l = DataLoader::new(data.clone(), 2, 3).unwrap();
    let batches: Vec<_> = (0..7).map(|_| l.next_batch()).collect();
    let starts: Vec<u32> = batches.iter().map(|b| b.inputs[0]).collect();
    // 4 windows of 6 (+1) in the first shard, 2 in the third (it starts at token 30).
    assert_eq!(starts, [0, 6, 12, 18, 30, 36, 0]);
    assert_eq!(batches[3].targets.last(), Some(&24));
    assert_eq!(l.cursor().epoch, 1);

    let mut s = DataLoader::new(data.clone(), 2, 3)
        .unwrap()
        .shuffled(Some(3));
    let epoch: Vec<u32> = (0..6).map(|_| s.next_batch().inputs[0]).collect();
    let mut sorted = epoch.clone();
    sorted.sort();
    assert_eq!(sorted, [0, 6, 12, 18, 30, 36]);
    let again: Vec<u32> = {
        let mut s2 = DataLoader::new(data, 2, 3).unwrap().shuffled(Some(3));
        (0..6).map(|_| s2.next_batch().inputs[0]).collect()
    };
    assert_eq!(epoch, again, "the same seed gives the same order");
}

/// A trainer on the shards in `dir`, batches of 2 × 8, shuffled with seed 11.
fn shard_trainer(
    dir: &Path,
) -> Trainer<trainkit::Fp32, trainkit::NoRecompute, trainkit::AdamW, Constant, trainkit::PeakTracker>
{
    let data = TokenDataset::open(&dir.join("r_*.bin")).unwrap();
    let loader = DataLoader::new(data, 2, 8).unwrap().shuffled(Some(11));
    Trainer::builder(Gpt2::new(common::tiny_config()).unwrap(), cpu(), loader)
        .options(TrainerOptions {
            total_steps: 12,
            ..TrainerOptions::default()
        })
        .build()
        .unwrap()
}

#[test]
fn resume_is_exact_across_shard_boundaries_and_epochs() {
    let dir = scratch("shards-resume");
    // 3 shards of 2, 1 and 2 windows: 5 batches an epoch, so 12 steps cross epochs twice.
    write_shards(&dir, "r", &[40, 20, 35], 256);
    let mut straight = shard_trainer(&dir);
    let losses: Vec<f64> = (0..12).map(|_| straight.step().unwrap().loss).collect();
    for stop in [3, 7] {
        let ckpt = dir.join(format!("ckpt{stop}"));
        let mut first = shard_trainer(&dir);
        for _ in 0..stop {
            first.step().unwrap();
        }
        first.save(&ckpt, None).unwrap();
        let mut resumed = shard_trainer(&dir);
        resumed.resume_from(&ckpt).unwrap();
        let rest: Vec<f64> = (stop..12).map(|_| resumed.step().unwrap().loss).collect();
        for (a, b) in losses[stop..].iter().zip(&rest) {
            assert_eq!(a.to_bits(), b.to_bits(), "resumed at {stop}");
        }
        assert_eq!(
            per_param(&straight, |p| p.value()),
            per_param(&resumed, |p| p.value())
        );
    }
    // Resuming in order a run saved shuffled is refused.
    let data = TokenDataset::open(&dir.join("r_*.bin")).unwrap();
    let mut plain = Trainer::builder(
        Gpt2::new(common::tiny_config()).unwrap(),
        cpu(),
        DataLoader::new(data, 2, 8).unwrap(),
    )
    .build()
    .unwrap();
    let e = plain
        .resume_from(&dir.join("ckpt3"))
        .unwrap_err()
        .to_string();
    assert_contains(&e, &["shuffled with seed 11", "in order", "--shuffle"]);
}

#[test]
fn bad_shards_are_errors_that_name_the_file() {
    let dir = scratch("shards-bad");
    write_shards(&dir, "ok", &[50, 50], 100);
    let load = |spec: &Path| {
        DataConfig::from_path(spec, None)
            .load(5, 100)
            .unwrap_err()
            .to_string()
    };

    // An empty glob.
    let e = load(&dir.join("nothing_*.bin"));
    assert_contains(&e, &["nothing_*.bin", "matches no file"]);

    // A bad header and an odd length among good shards.
    let bad = dir.join("ok_000002.bin");
    fs::write(&bad, common::token_file_bytes(12345, 1, 1, &[1])).unwrap();
    let e = load(&dir.join("ok_*.bin"));
    assert_contains(&e, &["ok_000002.bin", "magic number 12345"]);
    let mut odd = common::token_file_bytes(20240520, 1, 2, &[1, 2]);
    odd.push(0);
    fs::write(&bad, odd).unwrap();
    let e = load(&dir.join("ok_*.bin"));
    assert_contains(&e, &["ok_000002.bin", "plus one byte", "trailing"]);

    // Mixed token formats.
    write_token_file_as(&bad, &[1, 2, 3], TokenFormat::U32).unwrap();
    let e = load(&dir.join("ok_*.bin"));
    assert_contains(&e, &["ok_000002.bin", "u32", "u16", "share a format"]);

    // An id beyond the vocabulary: the file and the token's index.
    write_token_file(&bad, &[1, 2, 3, 99, 100, 5, 6]).unwrap();
    let e = load(&dir.join("ok_*.bin"));
    assert_contains(
        &e,
        &["ok_000002.bin", "token 4 is id 100", "vocabulary of 100"],
    );
}

#[test]
fn prepare_streams_json_lines_and_text_into_shards() {
    let dir = scratch("prepare-shards");
    let docs = [
        "First document.",
        "Second one,\nwith two lines.",
        "",
        "Fourth: é 日本",
    ];
    let mut jsonl = String::new();
    for (i, d) in docs.iter().enumerate() {
        jsonl.push_str(&serde_json::json!({"id": i, "text": d, "meta": {"x": [1, 2]}}).to_string());
        jsonl.push('\n');
        if i == 1 {
            jsonl.push('\n'); // blank lines are skipped
        }
    }
    // A UTF-8 byte-order mark opening a file (as some editors write) is not text.
    let jl = dir.join("a.jsonl");
    fs::write(&jl, format!("\u{feff}{jsonl}")).unwrap();
    let texts = ["A text file of its own.\n", "And another, the last.\n"];
    for (i, t) in texts.iter().enumerate() {
        let mark = if i == 0 { "\u{feff}" } else { "" };
        fs::write(dir.join(format!("t{i}.txt")), format!("{mark}{t}")).unwrap();
    }
    let out = dir.join("out/corpus.bin");
    let report = prepare_with(
        &PrepareOptions {
            inputs: vec![
                (dir.join("t*.txt"), InputKind::Text),
                (jl.clone(), InputKind::JsonLines),
            ],
            out: out.clone(),
            tokenizer: TokenizerKind::Gpt2,
            val_fraction: 0.25,
            shard_tokens: Some(8),
        },
        &mut |_| {},
    )
    .unwrap();
    // Each document after an end-of-text token, in order: text files, then JSON lines.
    let mut expected = Vec::new();
    for d in texts.iter().chain(&docs) {
        expected.push(Gpt2Tokenizer::EOT);
        expected.extend(Gpt2Tokenizer.encode(d));
    }
    assert_eq!(report.documents, 6);
    let n = expected.len();
    let n_val = (n as f64 * 0.25).round() as usize;
    assert_eq!((report.train_tokens, report.val_tokens), (n - n_val, n_val));
    let names: Vec<String> = report
        .train_files
        .iter()
        .chain(&report.val_files)
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names[0], "corpus_000000.bin");
    assert_eq!(report.val_files[0], dir.join("out/corpus_val_000000.bin"));
    let mut got = Vec::new();
    for f in report.train_files.iter().chain(&report.val_files) {
        let t = read_token_file(f).unwrap();
        assert!(t.len() <= 8, "{}: {}", f.display(), t.len());
        got.extend(t);
    }
    assert_eq!(got, expected);
    assert_eq!(report.train_files.len(), (n - n_val).div_ceil(8));
    assert_eq!(report.val_files.len(), n_val.div_ceil(8));
    // No temporary file is left, and training reads the shards with their val shards.
    let left: Vec<_> = fs::read_dir(dir.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let corpus = DataConfig::from_path(&dir.join("out/corpus_*.bin"), None)
        .load(2, 50257)
        .unwrap();
    assert_eq!(corpus.train.len_tokens(), n - n_val);
    assert_eq!(corpus.val.len_tokens(), n_val);
    // Text given to `train` directly drops the mark too.
    let long = texts[0].repeat(20);
    fs::write(dir.join("long.txt"), format!("\u{feff}{long}")).unwrap();
    let corpus = DataConfig::from_path(&dir.join("long.txt"), Some(TokenizerKind::Gpt2))
        .load(2, 50257)
        .unwrap();
    assert_eq!(
        corpus.train.len_tokens() + corpus.val.len_tokens(),
        Gpt2Tokenizer.encode(&long).len()
    );
}

#[test]
fn prepare_refuses_bad_json_lines_and_writes_nothing() {
    let dir = scratch("prepare-bad-json");
    let out = dir.join("out/x.bin");
    let run = |content: &str| {
        let jl = dir.join("in.jsonl");
        fs::write(&jl, content).unwrap();
        prepare_with(
            &PrepareOptions {
                inputs: vec![(jl, InputKind::JsonLines)],
                out: out.clone(),
                tokenizer: TokenizerKind::Gpt2,
                val_fraction: 0.1,
                shard_tokens: Some(4),
            },
            &mut |_| {},
        )
        .unwrap_err()
        .to_string()
    };
    let good = "{\"text\": \"a long enough document to make several shards of tokens\"}\n";
    let e = run(&format!("{good}{good}{{\"body\": \"no text here\"}}\n"));
    assert_contains(&e, &["in.jsonl line 3", "no `text` field"]);
    let e = run(&format!("{good}\n{{\"text\": 5}}\n"));
    assert_contains(&e, &["in.jsonl line 3", "`text` string"]);
    let e = run(&format!("{good}not json\n"));
    assert_contains(&e, &["in.jsonl line 2", "JSON object"]);
    let left: Vec<_> = fs::read_dir(dir.join("out")).unwrap().collect();
    assert!(left.is_empty(), "a failed prepare leaves nothing: {left:?}");

    let e = prepare_with(
        &PrepareOptions {
            inputs: vec![(dir.join("none_*.txt"), InputKind::Text)],
            out: out.clone(),
            tokenizer: TokenizerKind::Gpt2,
            val_fraction: 0.1,
            shard_tokens: None,
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert_contains(&e, &["none_*.txt", "matches no file"]);
}

#[test]
fn init_from_a_small_vocabulary_trains_on_token_files() {
    // A model of vocabulary 300 (below GPT-2's 50257) and an llm.c token file of ids
    // below 300: the ids are checked against the model, not against a tokenizer.
    let dir = scratch("init-small-vocab");
    let model = dir.join("model");
    let shape = [
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--vocab-size",
        "300",
    ];
    let (ok, _, err) = trainkit(
        &[
            &["train", "--steps", "0", "--out", path(&model)][..],
            &shape[..],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let data = dir.join("ids.bin");
    write_token_file(&data, &(0..3000).map(|i| i % 300).collect::<Vec<u32>>()).unwrap();
    let base = [
        "train",
        "--init-from",
        path(&model),
        "--data",
        path(&data),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--device",
        "cpu",
    ];
    let (ok, out, err) = trainkit(&base);
    assert!(ok, "{out}\n{err}");
    // An id beyond the model's vocabulary is still refused, naming the file.
    write_token_file(&data, &(0..3000).map(|i| i % 301).collect::<Vec<u32>>()).unwrap();
    let (ok, _, err) = trainkit(&base);
    assert!(!ok);
    assert_contains(&err, &["ids.bin", "is id 300", "vocabulary of 300"]);
}

/// A token file whose loss mask trains no position is refused when the data loads (the
/// loss would average nothing), naming the fix; one trained position is enough.
#[test]
fn a_mask_that_trains_nothing_is_refused() {
    use trainkit::data::token_flags::{flags_path_for, write_flags_file, TRAINED};
    let dir = scratch("all-masked");
    let path = dir.join("chat.bin");
    let tokens: Vec<u32> = (0..3000).map(|i| i % 200).collect();
    write_token_file(&path, &tokens).unwrap();
    let mut flags = vec![0u8; tokens.len()];
    write_flags_file(&flags_path_for(&path), &flags, None).unwrap();
    let load = || DataConfig::from_path(&path, None).load(33, 50257);
    let Err(e) = load() else {
        panic!("an all-masked file is refused")
    };
    let e = e.to_string();
    assert!(
        e.contains("trains no position") && e.contains(".mask"),
        "{e}"
    );
    flags[2000] = TRAINED;
    write_flags_file(&flags_path_for(&path), &flags, None).unwrap();
    load().unwrap();
}
