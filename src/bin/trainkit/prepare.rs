//! `trainkit prepare`: text or JSON lines to llm.c token files.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use trainkit::data::chat::{prepare_chat, ChatOptions, MaskMode, Overflow};
use trainkit::data::{prepare_with, InputKind, PrepareOptions, TokenizerKind};
use trainkit::Result;

/// Tokenize text files or JSON lines into llm.c token files: the train file (or shards)
/// at --out and, with a nonzero --val-fraction, `_val` files beside it.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct PrepareArgs {
    /// UTF-8 text files, each one document; several, or a quoted glob ('books/*.txt').
    #[arg(long, num_args = 1.., value_name = "FILE")]
    text: Vec<PathBuf>,
    /// JSON-lines files, one document per line in its `text` field (FineWeb's form);
    /// several, or a quoted glob. Read after the --text files.
    #[arg(long, num_args = 1.., value_name = "FILE")]
    jsonl: Vec<PathBuf>,
    /// Chat or instruction JSON-lines files (`messages`, Alpaca or ShareGPT rows); several,
    /// or a quoted glob. Each conversation is rendered with the tokenizer's chat template
    /// (or --template) and written as rows of --seq-len tokens with a loss mask beside them
    /// (NAME.mask).
    #[arg(long, num_args = 1.., value_name = "FILE", conflicts_with_all = ["text", "jsonl"])]
    chat: Vec<PathBuf>,
    /// With --chat: tokens per row, the --seq-len the data trains with.
    #[arg(long, requires = "chat")]
    seq_len: Option<usize>,
    /// With --chat: which positions train: assistant (what the assistant says, with its
    /// end-of-turn marker), all, or last (the last assistant turn).
    #[arg(long, value_enum, default_value = "assistant", requires = "chat")]
    mask: MaskMode,
    /// With --chat: an example longer than --seq-len is truncated, dropped, or split over
    /// several rows.
    #[arg(long, value_enum, default_value = "truncate", requires = "chat")]
    overflow: Overflow,
    /// With --chat: a built-in chat template (chatml or llama3) instead of the
    /// tokenizer's; needed for a tokenizer that ships none (gpt2, bytes).
    #[arg(long, requires = "chat")]
    template: Option<String>,
    /// With --chat: skip rows that are not a conversation, or that the template cannot
    /// render or mask (reported with file and line), instead of stopping at the first.
    #[arg(long, requires = "chat")]
    skip_bad_rows: bool,
    /// With --chat: the text that opens each assistant reply (TRL's response_template,
    /// Unsloth's response_part), e.g. '<|im_start|>assistant\n' (`\n` and `\t` are read as
    /// a newline and a tab): each reply is located after it in the whole rendered
    /// conversation and trained up to its end-of-turn marker. Without it, turns are told
    /// apart by rendering them one at a time, or located after the template's assistant
    /// header where the template renders earlier turns anew (Qwen3).
    #[arg(long, value_name = "TEXT", requires = "chat")]
    response_marker: Option<String>,
    /// With --chat: pack whole conversations greedily into each row while the next fits
    /// (torchtune's packed=True); each attends only to itself and its positions start at
    /// 0, so it trains as it would alone, with far less padding.
    #[arg(long, requires = "chat")]
    pack: bool,
    /// With --chat: shuffle the conversations with this seed before the val part is drawn
    /// (at random, from every input) and the rows are laid out (default: the files' order,
    /// the val conversations spread evenly over it).
    #[arg(long, value_name = "SEED", requires = "chat")]
    shuffle_seed: Option<u64>,
    /// The train token file to write (e.g. data/shakespeare.bin; the val file becomes
    /// data/shakespeare_val.bin); with --shard-tokens, the name shards are numbered from.
    #[arg(long)]
    out: PathBuf,
    /// gpt2 (BPE, vocabulary 50257), bytes (vocabulary 256), or a Hugging Face
    /// tokenizer.json (or a model directory that holds one); its end-of-text token goes
    /// before every document.
    #[arg(long, default_value = "gpt2")]
    tokenizer: TokenizerKind,
    /// Fraction written to the val file(s): of the tokens, from the end, for --text and
    /// --jsonl; of the conversations, drawn from every input, for --chat.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// With --chat: JSON-lines files (or a quoted glob) of the val conversations, written
    /// to the val file instead of a --val-fraction of the --chat ones.
    #[arg(long, num_args = 1.., value_name = "FILE", requires = "chat", conflicts_with = "val_fraction")]
    val: Vec<PathBuf>,
    /// Write shards of this many tokens: NAME_000000.bin, NAME_000001.bin, ... and
    /// NAME_val_000000.bin, ... (llm.c's FineWeb shards hold 100000000).
    #[arg(long, value_name = "N")]
    shard_tokens: Option<usize>,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    if !args.chat.is_empty() {
        return run_chat(args);
    }
    let mut inputs: Vec<(PathBuf, InputKind)> = args
        .text
        .iter()
        .map(|p| (p.clone(), InputKind::Text))
        .collect();
    inputs.extend(args.jsonl.iter().map(|p| (p.clone(), InputKind::JsonLines)));
    let options = PrepareOptions {
        inputs,
        out: args.out.clone(),
        tokenizer: args.tokenizer.clone(),
        val_fraction: args.val_fraction,
        shard_tokens: args.shard_tokens,
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} {bytes}/{total_bytes} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar
    });
    let mut last = None;
    let r = prepare_with(&options, &mut |p| {
        let mb_s = p.bytes as f64 / 1e6 / p.elapsed.as_secs_f64().max(1e-9);
        if let Some(bar) = &bar {
            bar.set_length(p.total_bytes);
            bar.set_position(p.bytes);
            bar.set_message(format!(
                "{mb_s:.1} MB/s | {} tokens | {} documents",
                p.tokens, p.documents
            ));
        }
        last = Some(*p);
    });
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let r = r?;
    if let Some(p) = last {
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        println!(
            "read {:.1} MB ({} documents) in {secs:.1} s: {:.1} MB/s, {:.0} tokens/s",
            p.bytes as f64 / 1e6,
            p.documents,
            p.bytes as f64 / 1e6 / secs,
            p.tokens as f64 / secs
        );
    }
    let list = |files: &[PathBuf]| match files {
        [one] => one.display().to_string(),
        [first, .., last] => format!(
            "{} shards, {} .. {}",
            files.len(),
            first.display(),
            last.display()
        ),
        [] => String::new(),
    };
    println!(
        "wrote {} train tokens to {}",
        r.train_tokens,
        list(&r.train_files)
    );
    if !r.val_files.is_empty() {
        println!(
            "wrote {} val tokens to {}",
            r.val_tokens,
            list(&r.val_files)
        );
    }
    let data = match (args.shard_tokens, r.train_files.first()) {
        (Some(_), Some(first)) => {
            let dir = first
                .parent()
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            let stem = args.out.file_stem().unwrap_or_default().to_string_lossy();
            let ext = args
                .out
                .extension()
                .map(|e| format!(".{}", e.to_string_lossy()))
                .unwrap_or_default();
            let dir = if dir.is_empty() {
                String::new()
            } else {
                format!("{dir}/")
            };
            format!("'{dir}{stem}_*{ext}'")
        }
        (_, Some(first)) => first.display().to_string(),
        _ => String::new(),
    };
    for hint in train_hints(&args.tokenizer, &data, "")? {
        println!("{hint}");
    }
    Ok(())
}

/// The model directory a Hugging Face tokenizer came from: the directory given as
/// `--tokenizer`, or the one holding the `tokenizer.json` given, when it holds the model's
/// `config.json` too.
fn model_dir_of(tokenizer: &TokenizerKind) -> Option<PathBuf> {
    let TokenizerKind::HuggingFace(path) = tokenizer else {
        return None;
    };
    let dir = if path.is_dir() {
        path.clone()
    } else {
        path.parent()?.to_path_buf()
    };
    dir.join("config.json").is_file().then_some(dir)
}

/// Commands that train on the data just written, as they run when pasted: fine-tune the
/// model the tokenizer came from (its directory's tokenizer is then the data's), and a
/// model from scratch with the tokenizer's vocabulary. `extra` holds flags both need
/// (`--seq-len N`).
fn train_hints(tokenizer: &TokenizerKind, data: &str, extra: &str) -> Result<Vec<String>> {
    let mut hints = Vec::new();
    if let Some(dir) = model_dir_of(tokenizer) {
        // The run's directory beside the data: `data/chat.bin` -> `data/chat-tuned`.
        let data_path = Path::new(data.trim_matches('\''));
        let stem = data_path.file_stem().map_or("data".into(), |s| {
            s.to_string_lossy().replace(['*', '?'], "")
        });
        let out = data_path
            .with_file_name(format!("{}-tuned", stem.trim_end_matches('_')))
            .display()
            .to_string();
        hints.push(format!(
            "fine-tune the model on them: trainkit train --init-from {} --data {data}{extra} \
             --out {out}",
            dir.display(),
        ));
        hints.push("  (add --lora-rank 16 for LoRA, and --qlora with it for QLoRA)".to_string());
    }
    let vocab = match tokenizer {
        TokenizerKind::Bytes => String::new(),
        kind => format!(" --vocab-size {}", kind.vocab_size()?),
    };
    hints.push(format!(
        "train a model from scratch on them: trainkit train --data {data}{extra} --tokenizer \
         {tokenizer}{vocab}"
    ));
    Ok(hints)
}

/// `prepare --chat`: conversations to rows of tokens with a loss mask.
fn run_chat(args: PrepareArgs) -> Result<()> {
    if args.shard_tokens.is_some() {
        return Err(trainkit::Error::config(
            "--shard-tokens",
            "is for --text and --jsonl; --chat writes one train and one val file",
        ));
    }
    let seq_len = args.seq_len.ok_or_else(|| {
        trainkit::Error::config(
            "--seq-len",
            "--chat writes rows of --seq-len tokens; give the sequence length \
             you will train with, e.g. --seq-len 1024",
        )
    })?;
    let r = prepare_chat(&ChatOptions {
        inputs: args.chat.clone(),
        out: args.out.clone(),
        tokenizer: args.tokenizer.clone(),
        template: args.template.clone(),
        seq_len,
        mask: args.mask,
        overflow: args.overflow,
        val_fraction: if args.val.is_empty() {
            args.val_fraction
        } else {
            0.0
        },
        val_inputs: args.val.clone(),
        skip_bad_rows: args.skip_bad_rows,
        pack: args.pack,
        shuffle_seed: args.shuffle_seed,
        response_marker: args
            .response_marker
            .as_ref()
            .map(|m| m.replace("\\n", "\n").replace("\\t", "\t")),
    })?;
    println!("template: {}", r.template);
    println!(
        "{} conversations {} {} train and {} val rows of {seq_len} tokens; {} trained \
         positions in the train rows, {} padding tokens ({:.1}%)",
        r.examples,
        if args.pack { "packed into" } else { "in" },
        r.train_rows,
        r.val_rows,
        r.trained_tokens,
        r.pad_tokens,
        100.0 * r.pad_tokens as f64 / (r.train_rows * seq_len).max(1) as f64
    );
    if r.too_long > 0 {
        let what = match args.overflow {
            Overflow::Truncate => "truncated",
            Overflow::Drop => "dropped",
            Overflow::Split => "split over several rows",
        };
        println!(
            "{} conversations longer than {seq_len} tokens: {what}",
            r.too_long
        );
    }
    if r.bad_rows > 0 {
        println!(
            "{} rows that are not conversations, or that the template or the marker could \
             not render or mask: skipped (the warnings above say why)",
            r.bad_rows
        );
    }
    if r.located > 0 {
        println!(
            "{} conversations had their replies located in the whole rendering ({}): {}",
            r.located,
            match &args.response_marker {
                Some(m) => format!("after --response-marker `{m}`"),
                None => "after the template's assistant header".to_string(),
            },
            if args.response_marker.is_some() {
                "each trained up to its end-of-turn marker"
            } else {
                "the template renders earlier turns anew once later ones come, so they \
                 cannot be told apart one at a time"
            }
        );
    }
    if r.untrained > 0 {
        println!(
            "{} train conversations keep no trained token (their {} part is past --seq-len \
             {seq_len}, or the mask selects nothing in them): they teach nothing; a longer \
             --seq-len or --overflow split keeps them",
            r.untrained,
            match args.mask {
                MaskMode::All => "trained",
                MaskMode::Assistant | MaskMode::Last => "assistant",
            }
        );
    }
    for f in &r.files {
        println!("wrote {} and its .mask", f.display());
    }
    let data = args.out.display().to_string();
    let hints = train_hints(&args.tokenizer, &data, &format!(" --seq-len {seq_len}"))?;
    // Chat data fine-tunes a model; training one from scratch on it is the odd case, so
    // it is offered alone only when the tokenizer names no model.
    let fine_tune = model_dir_of(&args.tokenizer).is_some();
    for hint in &hints[..if fine_tune { 2 } else { hints.len() }] {
        println!("{hint}");
    }
    Ok(())
}
