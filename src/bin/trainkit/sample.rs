//! `trainkit sample`.

use crate::saved_model::{default_tokenizer, SavedModelArgs};
use trainkit::config::RunConfig;
use trainkit::data::chat::conversation::Message;
use trainkit::data::chat::{chat_prompt, END_OF_TURN};
use trainkit::data::{DataLoader, TokenizerKind};
use trainkit::save::GENERATION_CONFIG_FILE;
use trainkit::save::RUN_CONFIG_FILE;
use trainkit::trainer::GenerationConfig;
use trainkit::{Error, Result, Rng, SamplingOptions};

/// Generate text from a saved model.
#[derive(clap::Args)]
// Negative numbers are values (then refused by their parser with the flag's name), not flags.
#[command(allow_negative_numbers = true)]
pub struct SampleArgs {
    /// The model, its adapter and the device.
    #[command(flatten)]
    saved: SavedModelArgs,
    /// Text to continue.
    #[arg(long, required_unless_present = "chat", conflicts_with = "chat")]
    prompt: Option<String>,
    /// A user message: rendered with the model's chat template (and --system) with the
    /// generation prompt; the reply stops at the template's end of turn.
    #[arg(long)]
    chat: Option<String>,
    /// With --chat: a system message before it.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: a built-in template (chatml or llama3) instead of the tokenizer's.
    #[arg(long, requires = "chat")]
    template: Option<String>,
    /// Tokens to generate (default: the model's generation_config.json's
    /// max_new_tokens, else 100).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Softmax temperature (0 = always the most likely token). The defaults of this and
    /// the settings below are the model directory's generation_config.json, as
    /// transformers' generate takes them (greedy unless it says do_sample; top-k 50 when
    /// sampling), else temperature 1 and no other setting.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only (0 = all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: among the most likely tokens whose probabilities add up to P,
    /// after the temperature and --top-k (1 = all; transformers' top_p).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop the tokens less likely than P times the most likely one, after the
    /// temperature, --top-k and --top-p (0 = none; transformers' min_p).
    #[arg(long)]
    min_p: Option<f32>,
    /// Make the tokens already in the context less likely: a positive logit divided by
    /// it, a negative one multiplied (1 = none; transformers' repetition_penalty, 1.1 to
    /// 1.3 in common use).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// With --prompt: go on past the tokenizer's end-of-text token (GPT-2's
    /// <|endoftext|>, a tokenizer.json's EOS) instead of stopping there, as generate does.
    #[arg(long)]
    ignore_eos: bool,
    /// Rerun the whole context for every new token instead of decoding through a
    /// key/value cache (transformers' use_cache=False): slower, for comparison.
    #[arg(long)]
    no_cache: bool,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// gpt2, bytes, or a Hugging Face tokenizer.json (or a directory that holds one)
    /// (default: the model directory's tokenizer.json if it has one, else what the run
    /// that saved the model used).
    #[arg(long)]
    tokenizer: Option<TokenizerKind>,
}

pub fn run(mut args: SampleArgs) -> Result<()> {
    // The flags' own values are refused before the model loads.
    args.sampling(SamplingOptions::default())
        .check()
        .map_err(crate::as_flag)?;
    let dir = args.saved.open()?;
    let generation = GenerationConfig::read(&args.saved.model)?;
    let (options, max_new_tokens) = args.settings(generation.as_ref())?;
    let saved = args.saved.model.join(RUN_CONFIG_FILE);
    let tokenizer = match (args.tokenizer, args.saved.dir_tokenizer()) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) if saved.is_file() => RunConfig::from_file(&saved)?.data.tokenizer(),
        (None, None) => default_tokenizer(dir.config.vocab_size()),
    };
    let tok = tokenizer.build()?;
    if tok.vocab_size() > dir.config.vocab_size() {
        return Err(Error::config(
            "--tokenizer",
            format!(
                "the {tokenizer} tokenizer has {} ids, more than the model's vocabulary of \
                 {}; sample with the tokenizer the model was trained with (--tokenizer)",
                tok.vocab_size(),
                dir.config.vocab_size()
            ),
        ));
    }
    let (prompt, stop) = match (&args.chat, &args.prompt) {
        (Some(message), _) => {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(Message {
                    role: "system".into(),
                    content: system.clone(),
                });
            }
            messages.push(Message {
                role: "user".into(),
                content: message.clone(),
            });
            chat_prompt(&tokenizer, args.template.as_deref(), &messages)?
        }
        (None, Some(text)) => {
            let stop = match args.ignore_eos {
                true => Vec::new(),
                false => tok.end_of_text().into_iter().collect(),
            };
            (tok.try_encode(text)?, stop)
        }
        (None, None) => return Err(Error::config("--prompt", "give --prompt or --chat")),
    };
    // The model's own end tokens (generation_config.json's eos_token_id) end it too.
    let mut stop = stop;
    if args.chat.is_some() || !args.ignore_eos {
        stop.extend(
            generation
                .iter()
                .flat_map(|g| g.eos_token_id.iter().copied()),
        );
    }
    let placeholder = DataLoader::new(vec![0; 2], 1, 1)?;
    let mut trainer = args.saved.trainer(dir, placeholder)?;
    let mut rng = Rng::new(args.seed);
    // Tokens are printed as they are drawn; text that may still become an end-of-turn
    // marker (with --chat) or a character cut between two tokens is held back until the
    // next token settles it.
    let chat = args.prompt.is_none();
    let mut stream = Stream::default();
    if let Some(prompt) = &args.prompt {
        print_now(prompt)?;
    }
    let started = std::time::Instant::now();
    let new = trainer.generate_streaming(
        &prompt,
        max_new_tokens,
        options,
        &stop,
        &mut rng,
        &mut |token| {
            stream.drawn.push(token);
            let text = tok.decode(&stream.drawn);
            stream.show(&text, reply_end(&text, chat, false))
        },
    )?;
    let seconds = started.elapsed().as_secs_f64();
    let text = tok.decode(&new);
    stream.show(&text, reply_end(&text, chat, true))?;
    print_now("\n")?;
    eprintln!(
        "sampled {} tokens after a prompt of {} in {seconds:.2} s: {:.1} tokens/s{}{}",
        new.len(),
        prompt.len(),
        new.len() as f64 / seconds.max(1e-9),
        if !args.no_cache && trainer.model().decodes_incrementally() {
            " (key/value cache)"
        } else {
            ""
        },
        match (new.len() < max_new_tokens, chat) {
            (true, true) => "; the reply ended its turn",
            (true, false) => "; stopped at the end-of-text token (--ignore-eos goes on)",
            (false, _) => "",
        }
    );
    Ok(())
}

impl SampleArgs {
    /// The sampling and the tokens to draw: the flags given, over the model's
    /// `generation` settings where it has them (announced on stderr; a value out of range
    /// there is refused naming the file, the setting and the flag), else the defaults.
    fn settings(&self, generation: Option<&GenerationConfig>) -> Result<(SamplingOptions, usize)> {
        let Some(g) = generation else {
            return Ok((
                self.sampling(SamplingOptions::default()),
                self.max_new_tokens.unwrap_or(100),
            ));
        };
        let options = self.sampling(g.sampling());
        options.check().map_err(|e| match e {
            Error::Config { field, message } => Error::config(
                format!("{GENERATION_CONFIG_FILE}: {field}"),
                format!("{message}; {} overrides it", crate::flag_of(&field)),
            ),
            e => e,
        })?;
        eprintln!(
            "sampling: {} ({GENERATION_CONFIG_FILE}; flags override it)",
            describe(&options)
        );
        let max_new_tokens = self.max_new_tokens.or(g.max_new_tokens).unwrap_or(100);
        Ok((options, max_new_tokens))
    }

    /// The sampling of the flags given, over `defaults` for those not given; a flag that
    /// shapes the draw (--top-k, --top-p, --min-p) over greedy defaults samples at
    /// temperature 1.
    fn sampling(&self, defaults: SamplingOptions) -> SamplingOptions {
        let shaped = self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some();
        let temperature = match (self.temperature, defaults.temperature) {
            (Some(t), _) => t,
            (None, t) if t == 0.0 && shaped => 1.0,
            (None, t) => t,
        };
        SamplingOptions {
            temperature,
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            use_cache: !self.no_cache,
        }
    }
}

/// The sampling in a line: `temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05`
/// (greedy: `the most likely token`), settings that change nothing left out.
fn describe(o: &SamplingOptions) -> String {
    if o.temperature == 0.0 {
        let penalty = match o.repetition_penalty {
            1.0 => String::new(),
            p => format!(", repetition penalty {p}"),
        };
        return format!("the most likely token{penalty}");
    }
    let mut parts = vec![format!("temperature {}", o.temperature)];
    if o.top_k > 0 {
        parts.push(format!("top-k {}", o.top_k));
    }
    if o.top_p < 1.0 {
        parts.push(format!("top-p {}", o.top_p));
    }
    if o.min_p > 0.0 {
        parts.push(format!("min-p {}", o.min_p));
    }
    if o.repetition_penalty != 1.0 {
        parts.push(format!("repetition penalty {}", o.repetition_penalty));
    }
    parts.join(", ")
}

/// What of the reply is printed so far.
#[derive(Default)]
struct Stream {
    drawn: Vec<u32>,
    shown: String,
}

impl Stream {
    /// Prints `text[..end]` past what is shown, where it continues what is shown.
    fn show(&mut self, text: &str, end: usize) -> Result<()> {
        let settled = &text[..end];
        if settled.len() > self.shown.len() && settled.starts_with(self.shown.as_str()) {
            let more = &settled[self.shown.len()..];
            print_now(more)?;
            self.shown.push_str(more);
        }
        Ok(())
    }
}

/// Writes `text` to stdout at once (flushed).
fn print_now(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(|e| Error::io("stdout", e))
}

/// Where the printable part of `text` ends: with `chat`, at the first end-of-turn marker
/// (a tokenizer without them as single tokens writes them as text). Before the end
/// (`last` false) it also holds back a tail that may still grow into a marker and a
/// character cut between tokens (U+FFFD).
fn reply_end(text: &str, chat: bool, last: bool) -> usize {
    if chat {
        if let Some(at) = END_OF_TURN.iter().filter_map(|m| text.find(m)).min() {
            return at;
        }
    }
    if last {
        return text.len();
    }
    let mut end = text.len();
    if chat {
        let held = END_OF_TURN
            .iter()
            .flat_map(|m| {
                (1..m.len())
                    .filter(move |&k| m.is_char_boundary(k))
                    .map(move |k| &m[..k])
            })
            .filter(|prefix| text.ends_with(prefix))
            .map(|prefix| prefix.len())
            .max()
            .unwrap_or(0);
        end -= held;
    }
    let cut = '\u{FFFD}';
    while text[..end].ends_with(cut) {
        end -= cut.len_utf8();
    }
    end
}
