//! Chat and instruction data for fine-tuning: `prepare --chat` reads conversations
//! (`messages`, Alpaca or ShareGPT JSON lines, [`conversation`]), renders each with the
//! model's chat template ([`template`]), tokenizes it and writes rows of `seq_len` tokens
//! (longer examples truncated, dropped or split), one example per row padded to the end or,
//! with packing, as many whole examples as fit, with a loss mask and the documents'
//! starts beside the tokens ([`crate::data::token_flags`]): by default only what the
//! assistant says is trained, and a packed example attends only to itself.

pub mod conversation;
pub mod template;

use super::token_file::{write_token_file_as, TokenFormat};
use super::token_flags::{flags_path_for, write_flags_file, DOCUMENT_START, TRAINED};
use super::{val_path_for, HfTokenizer, Tokenizer, TokenizerKind};
use crate::error::{Error, Result};
use conversation::Message;
use std::path::PathBuf;
use template::{ChatTemplate, Segment};

/// Which positions of a conversation train.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MaskMode {
    /// What every assistant turn says, with its end-of-turn marker (torchtune's
    /// `train_on_assistant`, the default).
    #[default]
    Assistant,
    /// Every token but the padding.
    All,
    /// The last assistant turn only.
    Last,
}

/// What becomes of an example longer than a row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Overflow {
    /// Keep its first `seq_len` tokens.
    #[default]
    Truncate,
    /// Leave it out.
    Drop,
    /// Continue it in the next rows (each row attends within itself only).
    Split,
}

/// What [`prepare_chat`] reads and writes.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// JSON-lines files or globs, read in order.
    pub inputs: Vec<PathBuf>,
    /// The train token file (its mask beside it); val files as [`val_path_for`] names.
    pub out: PathBuf,
    /// The tokenizer: a Hugging Face `tokenizer.json` (or model directory) brings its
    /// chat template; gpt2 and bytes need `template`.
    pub tokenizer: TokenizerKind,
    /// A built-in template by name, used instead of the tokenizer's.
    pub template: Option<String>,
    /// Tokens per row: the `--seq-len` the data trains with.
    pub seq_len: usize,
    /// Which positions train.
    pub mask: MaskMode,
    /// What becomes of an example longer than a row.
    pub overflow: Overflow,
    /// Fraction of the examples written to the val files, in `[0, 1)`: drawn from every
    /// input, at random with `shuffle_seed`, else spread evenly over the inputs' order.
    /// Must be 0 when `val_inputs` are given.
    pub val_fraction: f64,
    /// JSON-lines files or globs of the val conversations (`prepare --val`); none: the
    /// val part is `val_fraction` of `inputs`.
    pub val_inputs: Vec<PathBuf>,
    /// Skip (and count) rows that are not a conversation instead of failing on the first.
    pub skip_bad_rows: bool,
    /// Pack whole examples greedily into rows (each starting a document) instead of one
    /// per row.
    pub pack: bool,
    /// Shuffle the examples with this seed before the val part is drawn and the train
    /// rows are laid out (`None`: the inputs' order).
    pub shuffle_seed: Option<u64>,
    /// The text that opens each assistant reply (TRL's `response_template`, Unsloth's
    /// `response_part`): replies are located after it in the whole rendering instead of
    /// rendering the turns one at a time.
    pub response_marker: Option<String>,
}

/// What [`prepare_chat`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatReport {
    /// Conversations written.
    pub examples: usize,
    /// Examples longer than a row (then truncated, dropped or split per the overflow).
    pub too_long: usize,
    /// Examples left out as longer than a row (`--overflow drop`).
    pub dropped: usize,
    /// Examples continued over several rows (`--overflow split`).
    pub split: usize,
    /// Rows of the input that were not conversations, skipped.
    pub bad_rows: usize,
    /// Conversations whose replies were located in the whole rendering (after
    /// `response_marker`, or the template's assistant header where the template renders
    /// earlier turns anew), not told apart turn by turn.
    pub located: usize,
    /// Train examples that keep no trained token (their trained part truncated away, or
    /// a mask that trains nothing in them): written, but they teach nothing.
    pub untrained: usize,
    /// Rows of `seq_len` tokens in the train and val files.
    pub train_rows: usize,
    /// Rows in the val files.
    pub val_rows: usize,
    /// Trained positions in the train file.
    pub trained_tokens: usize,
    /// Padding tokens in the train rows (what packing saves).
    pub pad_tokens: usize,
    /// The files written: train tokens, then val tokens (each with its `.mask`).
    pub files: Vec<PathBuf>,
    /// Where the template came from.
    pub template: String,
}

/// One example (or one row) as tokens and their flags.
#[derive(Clone, Debug, Default)]
struct Example {
    tokens: Vec<u32>,
    flags: Vec<u8>,
}

/// A byte range of a rendered conversation: `(start, end)`.
type Span = (usize, usize);

/// Tokens of a rendered conversation, each with the byte range of the text it stands
/// for.
enum Encoder {
    /// A Hugging Face tokenizer, with the special tokens the template writes parsed as
    /// theirs (as `apply_chat_template` tokenizes): the whole text at once, each token's
    /// range its offsets.
    Hf(Box<tokenizers::Tokenizer>),
    /// GPT-2's or the byte tokenizer: each segment on its own.
    Plain(Box<dyn Tokenizer>),
}

impl Encoder {
    /// Those of `markers` that this encoder does not read as one token.
    fn split_markers(&self, markers: Vec<String>) -> Vec<String> {
        markers
            .into_iter()
            .filter(|m| match self {
                Encoder::Hf(t) => t.token_to_id(m).is_none(),
                Encoder::Plain(t) => t.encode(m).len() != 1,
            })
            .collect()
    }

    /// The tokens of the segments' text and each token's byte range in it (for the
    /// plain tokenizers, which encode each segment on its own, the segment's range).
    fn encode(&self, segments: &[Segment]) -> std::result::Result<(Vec<u32>, Vec<Span>), String> {
        match self {
            Encoder::Hf(t) => {
                let text: String = segments.iter().map(|s| s.text.as_str()).collect();
                let encoding = t.encode(text.as_str(), false).map_err(|e| e.to_string())?;
                Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
            }
            Encoder::Plain(t) => {
                let mut ids = Vec::new();
                let mut ranges = Vec::new();
                let mut at = 0;
                for s in segments {
                    let part = t.try_encode(&s.text).map_err(|e| e.to_string())?;
                    ranges.extend(std::iter::repeat_n((at, at + s.text.len()), part.len()));
                    ids.extend(part);
                    at += s.text.len();
                }
                Ok((ids, ranges))
            }
        }
    }
}

/// Renders, tokenizes and masks every conversation of the inputs and writes them as rows
/// of `seq_len` tokens: `out` and its `.mask`, and the val part (the conversations of
/// `val_inputs`, or `val_fraction` of the examples drawn from every input)
/// to [`val_path_for`]`(out)` and its `.mask`.
///
/// Each example fills one row (a longer one is cut per `overflow`), padded with the
/// tokenizer's end-of-text token (untrained); with `pack`, whole examples follow each other
/// in a row while the next fits, each flagged as a document start (attention stays within
/// it; positions restart), and the rest of the row is padding (a document of its own). A
/// row's last position predicts the next row's first token, which trains only when `split`
/// continues the same example there. The mask files record the row length, and `train`
/// refuses another `--seq-len`.
///
/// Fails, naming the file and line, on a row that is not a conversation (unless
/// `skip_bad_rows`), when no template is found, when a template fails on a conversation,
/// when no example or too few for the val fraction remain, or when no train example keeps
/// a trained token.
pub fn prepare_chat(options: &ChatOptions) -> Result<ChatReport> {
    let t = options.seq_len;
    if t == 0 {
        return Err(Error::config("--seq-len", "must be at least 1"));
    }
    if !(0.0..1.0).contains(&options.val_fraction) {
        return Err(Error::config(
            "--val-fraction",
            format!("{} is not in [0, 1)", options.val_fraction),
        ));
    }
    let pad = options.tokenizer.build()?.end_of_text().unwrap_or(0);
    let (template, encoder) =
        template_and_encoder(&options.tokenizer, options.template.as_deref())?;
    let mut report = ChatReport {
        template: template.source().to_string(),
        ..ChatReport::default()
    };
    let read = |inputs: &[PathBuf], report: &mut ChatReport| {
        read_examples(inputs, &template, &encoder, options, report)
    };
    let mut examples = read(&options.inputs, &mut report)?;
    let mut val_part = read(&options.val_inputs, &mut report)?;
    report.examples = examples.len() + val_part.len();
    if examples.is_empty() {
        return Err(Error::data(
            "--chat",
            "no conversation was written: every row was bad or, with --overflow drop, \
             longer than --seq-len",
        ));
    }
    if let Some(seed) = options.shuffle_seed {
        crate::rng::Rng::new(seed).shuffle(&mut examples);
    }
    if !options.val_inputs.is_empty() {
        if options.val_fraction > 0.0 {
            return Err(Error::config(
                "--val-fraction",
                "the val conversations are given (--val): drop --val-fraction",
            ));
        }
        if val_part.is_empty() {
            return Err(Error::data("--val", "holds no conversation"));
        }
    } else {
        val_part = draw_val(&mut examples, options.val_fraction, options.shuffle_seed)?;
    }
    report.untrained = examples
        .iter()
        .filter(|pieces| {
            pieces
                .iter()
                .all(|p| p.flags.iter().all(|&f| f & TRAINED == 0))
        })
        .count();
    if report.untrained == examples.len() {
        return Err(Error::data(
            "--chat",
            format!(
                "none of the {} train conversations keeps a trained token: the mask ({}) \
                 selects nothing in them, or --seq-len {t} truncates every reply away; use a \
                 longer --seq-len, --overflow split, or another --mask",
                examples.len(),
                format!("{:?}", options.mask).to_lowercase()
            ),
        ));
    }
    let (rows, pad_tokens) = lay_out(examples, t, pad, options.pack);
    let (val, _) = lay_out(val_part, t, pad, options.pack);
    report.train_rows = rows.len();
    report.val_rows = val.len();
    report.trained_tokens = rows
        .iter()
        .flat_map(|r| &r.flags)
        .filter(|&&f| f & TRAINED != 0)
        .count();
    report.pad_tokens = pad_tokens;
    let format = TokenFormat::for_vocab(options.tokenizer.vocab_size()?);
    let mut outputs = vec![(options.out.clone(), rows)];
    if !val.is_empty() {
        outputs.push((val_path_for(&options.out), val));
    }
    for (path, rows) in outputs {
        let mut tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let mut flags: Vec<u8> = rows.iter().flat_map(|r| r.flags.iter().copied()).collect();
        // One more token: the last row's last position needs a target.
        tokens.push(pad);
        flags.push(DOCUMENT_START);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        write_token_file_as(&path, &tokens, format)?;
        write_flags_file(&flags_path_for(&path), &flags, Some(t))?;
        report.files.push(path);
    }
    Ok(report)
}

/// Every conversation of `inputs` as the pieces of at most `seq_len` tokens its overflow
/// leaves (none for a dropped one), counted in `report`; a row that is not a conversation
/// fails, naming the file and line, unless skipped. A UTF-8 byte-order mark opening a file
/// is not part of its first row.
fn read_examples(
    inputs: &[PathBuf],
    template: &ChatTemplate,
    encoder: &Encoder,
    options: &ChatOptions,
    report: &mut ChatReport,
) -> Result<Vec<Vec<Example>>> {
    let mut examples = Vec::new();
    for path in input_files(inputs)? {
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{} line {}", path.display(), n + 1);
            let marker = options.response_marker.as_deref();
            let row = conversation::parse(line)
                .and_then(|m| encode(template, encoder, &m, options.mask, marker));
            let (example, located) = match row {
                Ok(e) => e,
                Err(e) if options.skip_bad_rows => {
                    log::warn!("{}: {e}; skipped", at());
                    report.bad_rows += 1;
                    continue;
                }
                Err(e) => {
                    return Err(Error::data(
                        at(),
                        format!("{e} (--skip-bad-rows skips such rows)"),
                    ))
                }
            };
            report.located += usize::from(located);
            if let Some(pieces) = cut(example, options.seq_len, options.overflow, report) {
                examples.push(pieces);
            }
        }
    }
    Ok(examples)
}

/// Takes `fraction` of `examples` out as the val part: the last ones (after the seed's
/// shuffle, so drawn at random from every input) with `seed`, else spread evenly over the
/// inputs' order (the i-th of n is val when ⌊(i+1)·v/n⌋ > ⌊i·v/n⌋), so every input gives
/// its share. Fails when the split would leave either part empty.
fn draw_val(
    examples: &mut Vec<Vec<Example>>,
    fraction: f64,
    seed: Option<u64>,
) -> Result<Vec<Vec<Example>>> {
    let n = examples.len();
    let v = (n as f64 * fraction).round() as usize;
    if fraction > 0.0 && (v == 0 || v == n) {
        return Err(Error::data(
            "--chat",
            format!(
                "{n} examples cannot be split by --val-fraction {fraction} into non-empty \
                 train and val parts; use more data, --val FILE or --val-fraction 0"
            ),
        ));
    }
    if seed.is_some() {
        return Ok(examples.split_off(n - v));
    }
    let (mut train, mut val) = (Vec::with_capacity(n - v), Vec::with_capacity(v));
    for (i, e) in std::mem::take(examples).into_iter().enumerate() {
        if (i + 1) * v / n > i * v / n {
            val.push(e);
        } else {
            train.push(e);
        }
    }
    *examples = train;
    Ok(val)
}

/// The template to render with (`template` by name, else the tokenizer's own) and the
/// encoder of its text. A built-in template whose markers (`<|im_start|>`, ...) the
/// tokenizer does not hold as single tokens is warned of: each marker would be split into
/// ordinary tokens, which the model has to learn as text.
fn template_and_encoder(
    kind: &TokenizerKind,
    template: Option<&str>,
) -> Result<(ChatTemplate, Encoder)> {
    let (chat, encoder) = template_and_encoder_unchecked(kind, template)?;
    if let Some(name) = template {
        let split = encoder.split_markers(chat.markers());
        if !split.is_empty() {
            log::warn!(
                "the built-in template {name} writes {}, which the tokenizer {kind} does not \
                 have as single tokens: each is split into ordinary tokens that the model \
                 must learn as text; use the model's own template (drop --template) or a \
                 tokenizer that has them",
                split.join(", ")
            );
        }
    }
    Ok((chat, encoder))
}

fn template_and_encoder_unchecked(
    kind: &TokenizerKind,
    template: Option<&str>,
) -> Result<(ChatTemplate, Encoder)> {
    let Some(path) = kind.hf_path() else {
        let tokenizer = kind.build()?;
        let name = template.ok_or_else(|| no_template(kind))?;
        let eos = match tokenizer.end_of_text() {
            Some(id) => tokenizer.decode(&[id]),
            None => String::new(),
        };
        return Ok((
            ChatTemplate::builtin(name, "", &eos)?,
            Encoder::Plain(tokenizer),
        ));
    };
    let file = HfTokenizer::resolve(path)?;
    let own = match template {
        Some(_) => None,
        None => ChatTemplate::of_tokenizer(&file)?,
    };
    let eos = HfTokenizer::open(&file)?
        .end_of_text_token()
        .unwrap_or_default()
        .to_string();
    let template = match (own, template) {
        (Some(own), _) => own,
        (None, Some(name)) => ChatTemplate::builtin(name, "", &eos)?,
        (None, None) => return Err(no_template(kind)),
    };
    let raw = tokenizers::Tokenizer::from_file(&file)
        .map_err(|e| Error::data(file.display().to_string(), format!("cannot be read ({e})")))?;
    Ok((template, Encoder::Hf(Box::new(raw))))
}

/// End-of-turn markers of the common templates: generation stops at whichever of them is
/// one token of the vocabulary, and a reply is cut at the first of them in its text.
pub const END_OF_TURN: [&str; 6] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
];

/// A prompt for the model to continue as the assistant: `messages` rendered with the
/// generation prompt (`template` by name, else the tokenizer's own), as token ids, and the
/// ids generation stops at (the tokenizer's end of text and the [`END_OF_TURN`] markers it
/// has as single tokens).
pub fn chat_prompt(
    kind: &TokenizerKind,
    template: Option<&str>,
    messages: &[Message],
) -> Result<(Vec<u32>, Vec<u32>)> {
    let (template, encoder) = template_and_encoder(kind, template)?;
    let text = template
        .render(messages, true)
        .map_err(|e| Error::data("--chat", e))?;
    let segment = Segment {
        text,
        turn: 0,
        content: true,
    };
    let (ids, _) = encoder
        .encode(std::slice::from_ref(&segment))
        .map_err(|e| Error::data("--chat", e))?;
    let mut stop: Vec<u32> = kind.build()?.end_of_text().into_iter().collect();
    if let Encoder::Hf(t) = &encoder {
        stop.extend(END_OF_TURN.iter().filter_map(|m| t.token_to_id(m)));
    }
    Ok((ids, stop))
}

/// The error for a tokenizer without a template and no `--template`.
fn no_template(tokenizer: &TokenizerKind) -> Error {
    Error::config(
        "--template",
        format!(
            "the tokenizer {tokenizer} ships no chat template (no chat_template.jinja, no \
             chat_template in tokenizer_config.json); name a built-in one: --template {}",
            template::BUILTIN_TEMPLATES
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(" or ")
        ),
    )
}

/// The files of `inputs`, each a file or a glob (its matches in sorted order).
fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        let text = input.to_string_lossy();
        if text.contains(['*', '?', '[']) {
            let mut found: Vec<PathBuf> = glob::glob(&text)
                .map_err(|e| Error::config("--chat", format!("`{text}` is not a glob ({e})")))?
                .filter_map(|p| p.ok())
                .collect();
            if found.is_empty() {
                return Err(Error::data(text.to_string(), "matches no file"));
            }
            found.sort();
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    Ok(files)
}

/// One conversation's tokens and flags: trained where `mask` says, the first token a
/// document start and never trained; and whether its replies were located in the whole
/// rendering ([`ChatTemplate::located_segments`]: after `marker` when given, else after
/// the template's assistant header where rendering turn by turn cannot tell the turns
/// apart). A template with `{% generation %}` blocks trains what they enclose
/// ([`ChatTemplate::generation_segments`]), each token that overlaps a block as
/// transformers' `return_assistant_tokens_mask` marks it (a response `marker` goes first).
fn encode(
    template: &ChatTemplate,
    encoder: &Encoder,
    messages: &[Message],
    mask: MaskMode,
    marker: Option<&str>,
) -> std::result::Result<(Example, bool), String> {
    let generation = match (mask, marker) {
        (MaskMode::All, _) | (_, Some(_)) => None,
        _ => template.generation_segments(messages)?,
    };
    let by_overlap = generation.is_some();
    let (segments, located) = match (mask, marker, generation) {
        (MaskMode::All, _, _) => (
            vec![Segment {
                text: template.render(messages, false)?,
                turn: 0,
                content: true,
            }],
            false,
        ),
        (_, Some(marker), _) => (template.located_segments(messages, marker)?, true),
        (_, None, Some(segments)) => (segments, false),
        (_, None, None) => match template.segments(messages) {
            Ok(segments) => (segments, false),
            Err(turn_by_turn) => {
                let header = template
                    .assistant_header(messages)
                    .map_err(|e| format!("{turn_by_turn}; {e}"))?;
                let segments = template
                    .located_segments(messages, &header)
                    .map_err(|e| format!("{turn_by_turn}; {e}"))?;
                (segments, true)
            }
        },
    };
    let last = messages.iter().rposition(|m| m.role == "assistant");
    let trains = |s: &Segment| match mask {
        MaskMode::All => true,
        MaskMode::Assistant => s.content && messages[s.turn].role == "assistant",
        MaskMode::Last => s.content && Some(s.turn) == last,
    };
    let (tokens, ranges) = encoder.encode(&segments)?;
    if tokens.is_empty() {
        return Err("renders to no token".into());
    }
    // Each segment's byte range in the whole text.
    let mut bounds = Vec::with_capacity(segments.len());
    let mut at = 0;
    for s in &segments {
        bounds.push((at, at + s.text.len()));
        at += s.text.len();
    }
    let starts_in = |start: usize| {
        bounds
            .partition_point(|&(_, end)| end <= start)
            .min(segments.len().saturating_sub(1))
    };
    let mut flags: Vec<u8> = ranges
        .iter()
        .map(|&(start, end)| {
            let trained = if by_overlap && end > start {
                segments
                    .iter()
                    .zip(&bounds)
                    .any(|(s, &(a, b))| trains(s) && a < end && b > start)
            } else {
                trains(&segments[starts_in(start)])
            };
            if trained {
                TRAINED
            } else {
                0
            }
        })
        .collect();
    flags[0] = DOCUMENT_START;
    Ok((Example { tokens, flags }, located))
}

/// `example` as pieces of at most `t` tokens per `overflow` (one piece unless split), or
/// `None` when dropped; counted in `report`.
fn cut(
    mut example: Example,
    t: usize,
    overflow: Overflow,
    report: &mut ChatReport,
) -> Option<Vec<Example>> {
    if example.tokens.len() > t {
        report.too_long += 1;
        match overflow {
            Overflow::Truncate => {
                example.tokens.truncate(t);
                example.flags.truncate(t);
            }
            Overflow::Drop => {
                report.dropped += 1;
                return None;
            }
            Overflow::Split => report.split += 1,
        }
    }
    let n = example.tokens.len();
    Some(
        (0..n)
            .step_by(t)
            .map(|start| {
                let end = (start + t).min(n);
                Example {
                    tokens: example.tokens[start..end].to_vec(),
                    flags: example.flags[start..end].to_vec(),
                }
            })
            .collect(),
    )
}

/// Rows of `t` tokens from the examples' pieces, in order: one piece per row or, with
/// `pack`, each piece appended to the current row while it fits (greedily, in order) and a
/// new row started when it does not. The rest of a row is `pad` (untrained; with `pack`
/// its first token starts a document, so no example attends to the padding and the padding
/// to no example). Returns the rows and the number of padding tokens in them.
fn lay_out(examples: Vec<Vec<Example>>, t: usize, pad: u32, pack: bool) -> (Vec<Example>, usize) {
    let mut rows: Vec<Example> = Vec::new();
    let mut padding = 0;
    let mut row = Example::default();
    let mut finish = |mut row: Example, rows: &mut Vec<Example>| {
        if row.tokens.is_empty() {
            return;
        }
        let used = row.tokens.len();
        row.tokens.resize(t, pad);
        row.flags.resize(t, 0);
        if pack && used < t {
            row.flags[used] = DOCUMENT_START;
        }
        padding += t - used;
        rows.push(row);
    };
    for piece in examples.into_iter().flatten() {
        if !pack || row.tokens.len() + piece.tokens.len() > t {
            finish(std::mem::take(&mut row), &mut rows);
        }
        row.tokens.extend(piece.tokens);
        row.flags.extend(piece.flags);
    }
    finish(row, &mut rows);
    (rows, padding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::read_token_file;

    /// Runs `prepare_chat` over `rows` with the byte tokenizer and ChatML, returning the
    /// report, the tokens and the flags written.
    fn run(
        name: &str,
        rows: &[&str],
        seq_len: usize,
        mask: MaskMode,
        overflow: Overflow,
    ) -> Result<(ChatReport, Vec<u32>, Vec<u8>)> {
        let dir = std::env::temp_dir().join(format!("trainkit-chat-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("c.jsonl");
        std::fs::write(&input, rows.join("\n")).unwrap();
        let out = dir.join("c.bin");
        let report = prepare_chat(&ChatOptions {
            inputs: vec![input],
            out: out.clone(),
            tokenizer: TokenizerKind::Bytes,
            template: Some("chatml".into()),
            seq_len,
            mask,
            overflow,
            val_fraction: 0.0,
            val_inputs: Vec::new(),
            skip_bad_rows: false,
            pack: false,
            shuffle_seed: None,
            response_marker: None,
        });
        let result = report.map(|r| {
            let tokens = read_token_file(&out).unwrap();
            let flags = std::fs::read(flags_path_for(&out)).unwrap()[1024..].to_vec();
            (r, tokens, flags)
        });
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    const ROW: &str = r#"{"messages":[{"role":"user","content":"ab"},{"role":"assistant","content":"cd"},{"role":"user","content":"ef"},{"role":"assistant","content":"gh"}]}"#;

    /// The trained bytes of each row, as text.
    fn trained(tokens: &[u32], flags: &[u8], t: usize) -> Vec<String> {
        (0..tokens.len() / t)
            .map(|r| {
                let bytes: Vec<u8> = (r * t..(r + 1) * t)
                    .filter(|&i| flags[i] & TRAINED != 0)
                    .map(|i| tokens[i] as u8)
                    .collect();
                String::from_utf8(bytes).unwrap()
            })
            .collect()
    }

    #[test]
    fn packing_fills_rows_with_whole_examples_in_order() {
        let piece = |n: usize| {
            vec![Example {
                tokens: vec![n as u32; n],
                flags: std::iter::once(DOCUMENT_START)
                    .chain(std::iter::repeat_n(TRAINED, n - 1))
                    .collect(),
            }]
        };
        let (rows, padding) = lay_out(vec![piece(3), piece(4), piece(2), piece(5)], 8, 0, true);
        let tokens: Vec<Vec<u32>> = rows.iter().map(|r| r.tokens.clone()).collect();
        assert_eq!(
            tokens,
            [vec![3, 3, 3, 4, 4, 4, 4, 0], vec![2, 2, 5, 5, 5, 5, 5, 0]]
        );
        let d = DOCUMENT_START;
        assert_eq!(rows[0].flags, [d, 1, 1, d, 1, 1, 1, d]);
        assert_eq!(
            padding, 2,
            "one padding token in each row of 7 example tokens"
        );
        // Unpacked: one example per row, the padding in the example's document.
        let (rows, padding) = lay_out(vec![piece(3), piece(4)], 8, 0, false);
        assert_eq!((rows.len(), padding), (2, 5 + 4));
        assert_eq!(rows[0].flags, [d, 1, 1, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn masks_choose_the_trained_turns() {
        let end = "<|im_end|>\n";
        let (_, tokens, flags) = run(
            "assistant",
            &[ROW],
            200,
            MaskMode::Assistant,
            Overflow::Truncate,
        )
        .unwrap();
        assert_eq!(trained(&tokens, &flags, 200), [format!("cd{end}gh{end}")]);
        let (_, tokens, flags) =
            run("last", &[ROW], 200, MaskMode::Last, Overflow::Truncate).unwrap();
        assert_eq!(trained(&tokens, &flags, 200), [format!("gh{end}")]);
        let (r, tokens, flags) =
            run("all", &[ROW], 200, MaskMode::All, Overflow::Truncate).unwrap();
        let all = trained(&tokens, &flags, 200).remove(0);
        // Every token but the first (a document's first token is never a target) and the
        // padding.
        assert_eq!(all.len(), r.trained_tokens);
        assert!(all.starts_with("|im_start|>user\nab") && all.ends_with(&format!("gh{end}")));
        assert_eq!(tokens.len(), 201);
        assert_eq!(flags[0], DOCUMENT_START);
    }

    #[test]
    fn long_examples_are_truncated_dropped_or_split() {
        let short = r#"{"instruction":"x","output":"y"}"#;
        let (r, tokens, _) = run(
            "truncate",
            &[ROW, short],
            64,
            MaskMode::Assistant,
            Overflow::Truncate,
        )
        .unwrap();
        assert_eq!(
            (r.examples, r.too_long, r.train_rows, tokens.len()),
            (2, 1, 2, 129)
        );
        let (r, _, _) = run(
            "drop",
            &[ROW, short],
            64,
            MaskMode::Assistant,
            Overflow::Drop,
        )
        .unwrap();
        assert_eq!((r.examples, r.dropped, r.train_rows), (1, 1, 1));
        let (r, tokens, flags) = run(
            "split",
            &[ROW, short],
            64,
            MaskMode::Assistant,
            Overflow::Split,
        )
        .unwrap();
        assert_eq!((r.examples, r.split), (2, 1));
        // The split example's trained text runs on across its rows.
        let rows = trained(&tokens, &flags, 64);
        assert_eq!(rows.len(), r.train_rows);
        assert!(r.train_rows >= 3, "{}", r.train_rows);
        let split: String = rows[..r.train_rows - 1].concat();
        assert_eq!(split, "cd<|im_end|>\ngh<|im_end|>\n");
        let e = run("none", &[ROW], 10, MaskMode::Assistant, Overflow::Drop).unwrap_err();
        assert!(e.to_string().contains("no conversation"), "{e}");
        let e = run("bad", &[ROW, "{"], 64, MaskMode::Assistant, Overflow::Drop).unwrap_err();
        assert!(
            e.to_string().contains("line 2") && e.to_string().contains("not JSON"),
            "{e}"
        );
    }

    /// A conversation whose reply is `reply`, after a user turn of `question`.
    fn chat_row(question: &str, reply: &str) -> String {
        format!(
            r#"{{"messages":[{{"role":"user","content":"{question}"}},{{"role":"assistant","content":"{reply}"}}]}}"#
        )
    }

    /// The replies trained in each row of the token file `path` (rows of `t` bytes).
    fn replies(path: &std::path::Path, t: usize) -> Vec<String> {
        let tokens = read_token_file(path).unwrap();
        let flags = std::fs::read(flags_path_for(path)).unwrap()[1024..].to_vec();
        trained(&tokens, &flags, t)
            .into_iter()
            .map(|r| r.trim_end_matches("<|im_end|>\n").to_string())
            .collect()
    }

    #[test]
    fn val_is_drawn_from_every_input_or_read_from_its_own_files() {
        let dir = std::env::temp_dir().join(format!("trainkit-chat-val-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, bom: bool, replies: &[String]| {
            let rows: Vec<String> = replies.iter().map(|r| chat_row("q", r)).collect();
            let path = dir.join(name);
            let mark = if bom { "\u{feff}" } else { "" };
            std::fs::write(&path, format!("{mark}{}", rows.join("\n"))).unwrap();
            path
        };
        let names = |p: &str| (0..10).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
        // The first file opens with a byte-order mark, which is no part of its first row.
        let a = file("a.jsonl", true, &names("a"));
        let b = file("b.jsonl", false, &names("b"));
        let out = dir.join("c.bin");
        let prepare = |val_fraction: f64, seed: Option<u64>, val_inputs: Vec<PathBuf>| {
            prepare_chat(&ChatOptions {
                inputs: vec![a.clone(), b.clone()],
                out: out.clone(),
                tokenizer: TokenizerKind::Bytes,
                template: Some("chatml".into()),
                seq_len: 64,
                mask: MaskMode::Assistant,
                overflow: Overflow::Truncate,
                val_fraction,
                val_inputs,
                skip_bad_rows: false,
                pack: false,
                shuffle_seed: seed,
                response_marker: None,
            })
        };
        let all: Vec<String> = [names("a"), names("b")].concat();
        // No seed: spread evenly over the inputs' order, so each file gives its share.
        let r = prepare(0.1, None, Vec::new()).unwrap();
        assert_eq!((r.examples, r.train_rows, r.val_rows), (20, 18, 2));
        let val = replies(&val_path_for(&out), 64);
        assert_eq!(val, ["a9", "b9"]);
        let train = replies(&out, 64);
        let rest: Vec<String> = all.iter().filter(|r| !val.contains(r)).cloned().collect();
        assert_eq!(train, rest, "the train rows keep the inputs' order");
        // A seed: shuffled, then the val part drawn; together they are every example.
        prepare(0.2, Some(7), Vec::new()).unwrap();
        let (train, val) = (replies(&out, 64), replies(&val_path_for(&out), 64));
        assert_eq!(val.len(), 4);
        assert_ne!(train, all[..16], "shuffled");
        let mut both = [train, val].concat();
        both.sort();
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(both, sorted);
        // Val files of their own: every input trains.
        let c = file("c.jsonl", false, &["c0".to_string()]);
        let r = prepare(0.0, None, vec![c.clone()]).unwrap();
        assert_eq!((r.train_rows, r.val_rows), (20, 1));
        assert_eq!(replies(&out, 64), all);
        assert_eq!(replies(&val_path_for(&out), 64), ["c0"]);
        let e = prepare(0.1, None, vec![c]).unwrap_err().to_string();
        assert!(e.contains("--val-fraction"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn examples_left_without_a_trained_token_are_counted_and_all_of_them_refused() {
        let long = chat_row(&"x".repeat(80), "y");
        let short = chat_row("q", "z");
        let (r, ..) = run(
            "untrained",
            &[&long, &short],
            64,
            MaskMode::Assistant,
            Overflow::Truncate,
        )
        .unwrap();
        assert_eq!((r.examples, r.untrained), (2, 1));
        let e = run(
            "untrained-all",
            &[&long],
            64,
            MaskMode::Assistant,
            Overflow::Truncate,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("keeps a trained token") && e.contains("--seq-len 64"),
            "{e}"
        );
        // Split, the long reply trains in the next row.
        let (r, ..) = run(
            "untrained-split",
            &[&long],
            64,
            MaskMode::Assistant,
            Overflow::Split,
        )
        .unwrap();
        assert_eq!(r.untrained, 0);
    }

    #[test]
    fn rows_the_marker_cannot_mask_are_refused_or_skipped() {
        let dir = std::env::temp_dir().join(format!("trainkit-chat-marker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("c.jsonl");
        // The second row's user turn holds the marker, so its reply cannot be located.
        let rows = [
            chat_row("q", "fine"),
            chat_row("<|im_start|>assistant", "lost"),
        ];
        std::fs::write(&input, rows.join("\n")).unwrap();
        let options = |skip: bool| ChatOptions {
            inputs: vec![input.clone()],
            out: dir.join("c.bin"),
            tokenizer: TokenizerKind::Bytes,
            template: Some("chatml".into()),
            seq_len: 128,
            mask: MaskMode::Assistant,
            overflow: Overflow::Truncate,
            val_fraction: 0.0,
            val_inputs: Vec::new(),
            skip_bad_rows: skip,
            pack: false,
            shuffle_seed: None,
            response_marker: Some("<|im_start|>assistant".into()),
        };
        let e = prepare_chat(&options(false)).unwrap_err().to_string();
        assert!(
            e.contains("c.jsonl line 2") && e.contains("--skip-bad-rows"),
            "{e}"
        );
        let r = prepare_chat(&options(true)).unwrap();
        assert_eq!((r.examples, r.bad_rows, r.located), (1, 1, 1));
        assert_eq!(replies(&dir.join("c.bin"), 128), ["\nfine"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
