//! Chat templates: the Jinja template a model ships (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`), run by minijinja with the Python
//! compatibility Hugging Face templates need (`.strip()`, `.startswith()`,
//! `raise_exception`, `trim_blocks` and `lstrip_blocks` as transformers sets them); or a
//! built-in one by name for a tokenizer that has none. A conversation renders to text cut
//! into [`Segment`]s, so that a loss mask can say which text is an assistant's.

use super::conversation::Message;
use crate::data::{CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE};
use crate::error::{Error, Result};
use minijinja::{context, Environment};
use serde_json::Value;
use std::path::Path;

/// The built-in templates, by name: ChatML (Qwen's turn markers) and Llama 3's.
pub const BUILTIN_TEMPLATES: [(&str, &str); 2] = [
    (
        "chatml",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
         {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}\
         <|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}\
         {% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n\
         {% endif %}",
    ),
];

/// A template ready to render, with the special tokens it may name.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for messages.
    source: String,
    bos_token: String,
    eos_token: String,
    /// The special-token markers (`<|...|>`) written literally in the template.
    markers: Vec<String>,
    /// Whether the template marks assistant text with `{% generation %}` blocks.
    generation: bool,
}

/// Where a `{% generation %}` block opens in a rendering: a Unicode noncharacter (for a
/// program's own use), which no conversation may hold.
const GENERATION_OPEN: char = '\u{FDD0}';
/// Where a `{% generation %}` block closes in a rendering.
const GENERATION_CLOSE: char = '\u{FDD1}';

/// A piece of a rendered conversation: the text one turn added, and whether it is the
/// turn's own content (for an assistant, what it says and its end-of-turn marker) or the
/// text before it (the assistant header a generation prompt adds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// The turn it belongs to.
    pub turn: usize,
    /// Whether it is what the turn says (not the header before an assistant's turn).
    pub content: bool,
}

/// The `<|...|>` markers in `source`, each once, in order.
fn literal_markers(source: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("<|") {
        let Some(len) = rest[start + 2..].find("|>") else {
            break;
        };
        let marker = &rest[start..start + 2 + len + 2];
        if !marker[2..marker.len() - 2].contains(char::is_whitespace)
            && !found.iter().any(|m| m == marker)
        {
            found.push(marker.to_string());
        }
        rest = &rest[start + 2 + len + 2..];
    }
    found
}

impl ChatTemplate {
    /// The built-in template `name` (see [`BUILTIN_TEMPLATES`]), with `bos` and `eos` as
    /// its special tokens' text.
    pub fn builtin(name: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let source = BUILTIN_TEMPLATES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| *s)
            .ok_or_else(|| {
                Error::config(
                    "--template",
                    format!(
                        "`{name}` is not a built-in template; use one of {}, or a tokenizer \
                         that ships its own",
                        names()
                    ),
                )
            })?;
        ChatTemplate::new(
            source.to_string(),
            format!("built-in template {name}"),
            bos,
            eos,
        )
    }

    /// The template a tokenizer ships beside `tokenizer_json` (a model directory's
    /// `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, its
    /// `default` entry when it lists several), with that config's `bos_token` and
    /// `eos_token`; `None` when there is none.
    pub fn of_tokenizer(tokenizer_json: &Path) -> Result<Option<ChatTemplate>> {
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                Error::data(
                    config_path.display().to_string(),
                    format!("is not JSON ({e})"),
                )
            })?,
            Err(_) => Value::Null,
        };
        let token = |key: &str| -> String {
            match config.get(key) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            }
        };
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            let source = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
            let name = file.display().to_string();
            return ChatTemplate::new(source, name, &bos, &eos).map(Some);
        }
        let source = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(list)) => {
                let named = |n: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name").and_then(Value::as_str) == Some(n))
                            .then(|| t.get("template").and_then(Value::as_str))
                            .flatten()
                    })
                };
                match named("default") {
                    Some(s) => s.to_string(),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let name = format!("the chat_template of {}", config_path.display());
        ChatTemplate::new(source, name, &bos, &eos).map(Some)
    }

    /// The template whose Jinja text is `source` (as a `chat_template.jinja` holds it),
    /// named `name` in messages, with `bos` and `eos` as its special tokens' text; an
    /// error naming `name` when it is not a template minijinja can read.
    pub fn from_source(source: &str, name: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        Self::new(source.to_string(), name.to_string(), bos, eos)
    }

    fn new(source: String, name: String, bos: &str, eos: &str) -> Result<ChatTemplate> {
        // transformers' `{% generation %}` blocks mark the text its assistant masks
        // train; they render what they hold between two marks that
        // [`ChatTemplate::generation_segments`] cuts at.
        let (source, generation) = generation_blocks(&source);
        let markers = literal_markers(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        // transformers' `strftime_now(format)` (Llama 3.2's "Today Date"), in UTC.
        env.add_function(
            "strftime_now",
            |format: String| -> std::result::Result<String, minijinja::Error> {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as i64);
                strftime(&format, now)
                    .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e))
            },
        );
        env.add_template_owned("chat", source).map_err(|e| {
            Error::data(
                &name,
                format!("is not a Jinja template minijinja can read ({e})"),
            )
        })?;
        Ok(ChatTemplate {
            env,
            source: name,
            bos_token: bos.to_string(),
            eos_token: eos.to_string(),
            markers,
            generation,
        })
    }

    /// The special-token markers (`<|im_start|>`, `<|eot_id|>`, ...) the template writes
    /// literally, each once, in order of first appearance.
    pub fn markers(&self) -> Vec<String> {
        self.markers.clone()
    }

    /// Where the template came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text of `messages`, with the assistant header after them when
    /// `add_generation_prompt` (what `sample --chat` continues).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let mut text = self.render_marked(messages, add_generation_prompt)?;
        if self.generation {
            text.retain(|c| c != GENERATION_OPEN && c != GENERATION_CLOSE);
        }
        Ok(text)
    }

    /// [`ChatTemplate::render`] with [`GENERATION_OPEN`] and [`GENERATION_CLOSE`] where
    /// the template's generation blocks open and close; fails on a conversation that
    /// holds either.
    fn render_marked(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let reserved = |t: &str| t.contains([GENERATION_OPEN, GENERATION_CLOSE]);
        if let Some(i) = messages
            .iter()
            .position(|m| reserved(&m.content) || reserved(&m.role))
        {
            return Err(format!(
                "turn {i} holds U+FDD0 or U+FDD1, Unicode noncharacters that no text should \
                 hold (trainkit marks generation blocks with them); remove them"
            ));
        }
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| format!("the template {} failed: {e}", self.source))
    }

    /// The whole conversation rendered once, cut at the template's `{% generation %}`
    /// blocks, as transformers' `return_assistant_tokens_mask` reads them: each block's
    /// text is a content segment, the text between blocks is not. The k-th block belongs
    /// to the k-th assistant turn (blocks past the last assistant turn to that turn).
    /// `None` when the template has no generation block.
    pub fn generation_segments(
        &self,
        messages: &[Message],
    ) -> std::result::Result<Option<Vec<Segment>>, String> {
        if !self.generation {
            return Ok(None);
        }
        let text = self.render_marked(messages, false)?;
        let assistants: Vec<usize> = messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.role == "assistant")
            .map(|(i, _)| i)
            .collect();
        let turn_of = |k: usize| {
            assistants
                .get(k)
                .or(assistants.last())
                .copied()
                .unwrap_or(messages.len().saturating_sub(1))
        };
        let mut out: Vec<Segment> = Vec::new();
        let (mut piece, mut open, mut blocks) = (String::new(), false, 0);
        for c in text.chars() {
            // A mark that opens a closed block or closes an open one ends the piece; a
            // nested or stray mark is dropped.
            if c == if open {
                GENERATION_CLOSE
            } else {
                GENERATION_OPEN
            } {
                out.push(Segment {
                    text: std::mem::take(&mut piece),
                    turn: turn_of(blocks),
                    content: open,
                });
                blocks += usize::from(open);
                open = !open;
            } else if c != GENERATION_OPEN && c != GENERATION_CLOSE {
                piece.push(c);
            }
        }
        out.push(Segment {
            text: piece,
            turn: turn_of(blocks),
            content: open,
        });
        out.retain(|s| !s.text.is_empty());
        Ok(Some(out))
    }

    /// The conversation's text cut at each turn: rendering the turns one more at a time,
    /// each adds a segment (an assistant turn two: the header a generation prompt adds,
    /// then its content). Fails when a rendering is not the start of the next (a template
    /// that rewrites earlier turns once later ones come, as some do with reasoning text):
    /// turns cannot be told apart then.
    pub fn segments(&self, messages: &[Message]) -> std::result::Result<Vec<Segment>, String> {
        let mut done = String::new();
        let mut out = Vec::new();
        let mut add = |text: String, turn: usize, content: bool, out: &mut Vec<Segment>| match text
            .strip_prefix(done.as_str())
        {
            Some(new) => {
                out.push(Segment {
                    text: new.to_string(),
                    turn,
                    content,
                });
                done = text;
                Ok(())
            }
            None => Err(format!(
                "the template {} renders the turns before turn {turn} differently once it \
                     is added, so its turns cannot be told apart one by one",
                self.source,
            )),
        };
        for (i, m) in messages.iter().enumerate() {
            if m.role == "assistant" {
                add(self.render(&messages[..i], true)?, i, false, &mut out)?;
            }
            add(self.render(&messages[..=i], false)?, i, true, &mut out)?;
        }
        Ok(out)
    }

    /// The text an assistant turn opens with: what a generation prompt adds after the
    /// turns before the first assistant turn (`<|im_start|>assistant\n` for ChatML).
    pub fn assistant_header(&self, messages: &[Message]) -> std::result::Result<String, String> {
        let first = messages
            .iter()
            .position(|m| m.role == "assistant")
            .ok_or("has no assistant turn")?;
        let (plain, prompted) = (
            self.render(&messages[..first], false)?,
            self.render(&messages[..first], true)?,
        );
        match prompted.strip_prefix(plain.as_str()) {
            Some(header) if !header.is_empty() => Ok(header.to_string()),
            _ => Err(format!(
                "the template {} adds no assistant header of its own with a generation \
                 prompt, so its replies cannot be located; name the text that opens a reply \
                 with --response-marker, or use --mask all",
                self.source
            )),
        }
    }

    /// The whole conversation rendered once, cut around each assistant reply located in
    /// it: the reply starts after the k-th `marker` (the assistant header, for the k-th
    /// assistant turn) and ends after the first end-of-turn marker ([`super::END_OF_TURN`] or the
    /// template's end-of-sequence token) that follows, with the whitespace right after it,
    /// as [`ChatTemplate::segments`] cuts a turn (else at the next `marker`, or the end).
    /// The reply's segment belongs to its turn (`content`); the text before it to that
    /// turn too, not as content. For templates that render earlier turns anew once later
    /// ones come (Qwen3 drops earlier turns' reasoning), where `segments` cannot tell the
    /// turns apart. Fails when a marker is missing or a located reply does not hold what
    /// the turn says (its answer after any `</think>`).
    pub fn located_segments(
        &self,
        messages: &[Message],
        marker: &str,
    ) -> std::result::Result<Vec<Segment>, String> {
        if marker.is_empty() {
            return Err("the response marker is empty".into());
        }
        let text = self.render(messages, false)?;
        let mut ends: Vec<&str> = crate::data::chat::END_OF_TURN.to_vec();
        if !self.eos_token.is_empty() {
            ends.push(&self.eos_token);
        }
        let mut out = Vec::new();
        let mut cursor = 0;
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let Some(found) = text[cursor..].find(marker) else {
                return Err(format!(
                    "the rendered conversation has no `{}` before assistant turn {i}, so the \
                     reply cannot be located; use --mask all, or --response-marker with the \
                     text that opens each reply",
                    marker.escape_debug()
                ));
            };
            let start = cursor + found + marker.len();
            let next = text[start..]
                .find(marker)
                .map_or(text.len(), |at| start + at);
            let end = ends
                .iter()
                .filter_map(|e| text[start..next].find(e).map(|at| start + at + e.len()))
                .min()
                .map_or(next, |end| {
                    let ws = text[end..next].len() - text[end..next].trim_start().len();
                    end + ws
                });
            let answer = m
                .content
                .rsplit("</think>")
                .next()
                .unwrap_or_default()
                .trim_start_matches('\n')
                .trim_end();
            if !text[start..end].contains(answer) {
                return Err(format!(
                    "the reply located after `{}` for assistant turn {i} does not hold what \
                     the turn says; use --mask all",
                    marker.escape_debug()
                ));
            }
            out.push(Segment {
                text: text[cursor..start].to_string(),
                turn: i,
                content: false,
            });
            out.push(Segment {
                text: text[start..end].to_string(),
                turn: i,
                content: true,
            });
            cursor = end;
        }
        out.push(Segment {
            text: text[cursor..].to_string(),
            turn: messages.len().saturating_sub(1),
            content: false,
        });
        out.retain(|s| !s.text.is_empty());
        Ok(out)
    }
}

/// `source` with transformers' `{% generation %}` and `{% endgeneration %}` tags (a block
/// transformers' Jinja extension adds to mark assistant text) written as blocks that
/// render what they enclose between [`GENERATION_OPEN`] and [`GENERATION_CLOSE`]:
/// `{% if true %}{{ OPEN }}{% if true %}` and `{% endif %}{{ CLOSE }}{% endif %}`, the
/// tag's whitespace control (`-`, `+`) kept on the outer side of each, so `trim_blocks`
/// and `lstrip_blocks` treat the text around them as transformers does (a newline right
/// after `{% endgeneration %}` is dropped). Other text, however malformed, is left as it
/// is for the parser to judge. Also says whether there was a generation tag.
fn generation_blocks(source: &str) -> (String, bool) {
    let mut found = false;
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        // The tag's end, searched past its opening (`{%}` is not a tag).
        let Some(len) = rest[start + 2..].find("%}") else {
            break;
        };
        let inner = &rest[start + 2..start + 2 + len];
        let after = start + 2 + len + 2;
        let left = inner.strip_prefix(['-', '+']).map(|_| &inner[..1]);
        let body = left.map_or(inner, |_| &inner[1..]);
        let right = body
            .strip_suffix(['-', '+'])
            .map(|_| &body[body.len() - 1..]);
        let body = right.map_or(body, |_| &body[..body.len() - 1]);
        let (word, mark) = match body.trim() {
            "generation" => ("if true", GENERATION_OPEN),
            "endgeneration" => ("endif", GENERATION_CLOSE),
            _ => ("", ' '),
        };
        out.push_str(&rest[..start]);
        if word.is_empty() {
            out.push_str(&rest[start..after]);
        } else {
            found = true;
            let (left, right) = (left.unwrap_or(""), right.unwrap_or(""));
            out.push_str(&format!(
                "{{%{left} {word} %}}{{{{ \"{mark}\" }}}}{{% {word} {right}%}}"
            ));
        }
        rest = &rest[after..];
    }
    out.push_str(rest);
    (out, found)
}

/// `format` with Python's `strftime` fields for `secs` seconds after the Unix epoch (UTC):
/// `%d %m %Y %y %b %B %a %A %H %I %M %S %p %j %%`; another field is an error naming it.
fn strftime(format: &str, secs: i64) -> std::result::Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The civil date of a day count (H. Hinnant's days_from_civil, inverted).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + i64::from(leap && month > 2);
    let (hour, minute, second) = (rem / 3_600, rem % 3_600 / 60, rem % 60);
    let (month_name, day_name) = (
        MONTHS[month as usize - 1],
        DAYS[days.rem_euclid(7) as usize],
    );
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let field = chars
            .next()
            .ok_or("strftime_now's format ends in a lone %")?;
        match field {
            'd' => out.push_str(&format!("{day:02}")),
            'm' => out.push_str(&format!("{month:02}")),
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year % 100)),
            'b' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'a' => out.push_str(&day_name[..3]),
            'A' => out.push_str(day_name),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'j' => out.push_str(&format!("{yday:03}")),
            '%' => out.push('%'),
            other => {
                return Err(format!(
                    "strftime_now does not know %{other}; it writes %d %m %Y %y %b %B %a %A \
                     %H %I %M %S %p %j and %%"
                ))
            }
        }
    }
    Ok(out)
}

/// The built-in templates' names, for messages.
fn names() -> String {
    BUILTIN_TEMPLATES
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<Message> {
        [
            ("system", "Be brief."),
            ("user", "Hi"),
            ("assistant", "Hello!"),
            ("user", "Bye"),
            ("assistant", "Bye."),
        ]
        .iter()
        .map(|(r, c)| Message {
            role: r.to_string(),
            content: c.to_string(),
        })
        .collect()
    }

    #[test]
    fn chatml_renders_and_cuts_at_turns() {
        let t = ChatTemplate::builtin("chatml", "", "<|im_end|>").unwrap();
        let m = conversation();
        let text = t.render(&m[..2], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let segments = t.segments(&m).unwrap();
        let joined: String = segments.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(joined, t.render(&m, false).unwrap());
        let assistant: Vec<&str> = segments
            .iter()
            .filter(|s| s.content && m[s.turn].role == "assistant")
            .map(|s| s.text.as_str())
            .collect();
        assert_eq!(assistant, ["Hello!<|im_end|>\n", "Bye.<|im_end|>\n"]);
        let headers: Vec<&str> = segments
            .iter()
            .filter(|s| !s.content)
            .map(|s| s.text.as_str())
            .collect();
        assert_eq!(headers, ["<|im_start|>assistant\n"; 2]);
    }

    #[test]
    fn hugging_face_templates_run_with_python_methods_and_exceptions() {
        // Python string methods and raise_exception, as Hugging Face templates use them.
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be \
                      user') }}{% endif %}{% for m in messages %}{{ m.role.upper() }}: \
                      {{ m.content.strip() }}\n{% endfor %}";
        let t = ChatTemplate::new(source.into(), "test".into(), "", "").unwrap();
        let m = conversation();
        assert_eq!(
            t.render(&m[1..3], false).unwrap(),
            "USER: Hi\nASSISTANT: Hello!\n"
        );
        let e = t.render(&m, false).unwrap_err();
        assert!(e.contains("first must be user"), "{e}");
        // A template that rewrites earlier turns cannot be cut.
        let source = "{% for m in messages %}{{ m.content }}{% if loop.last %}.{% endif %}\
                      {% endfor %}";
        let t = ChatTemplate::new(source.into(), "rewriting".into(), "", "").unwrap();
        let e = t.segments(&m).unwrap_err();
        assert!(
            e.contains("rewriting") && e.contains("cannot be told apart"),
            "{e}"
        );
        assert!(ChatTemplate::builtin("nope", "", "").is_err());
        // transformers' generation blocks render as what they enclose.
        let source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}\
                      {{ m.content }}{%- endgeneration -%}{% else %}{{ m.content }}{% endif %}\
                      {% endfor %}";
        let t = ChatTemplate::new(source.into(), "generation".into(), "", "").unwrap();
        assert_eq!(t.render(&m[1..3], false).unwrap(), "HiHello!");
        assert!(ChatTemplate::new("{% for %}".into(), "bad".into(), "", "").is_err());
    }

    /// A template in Qwen3's style: an assistant turn's reasoning (`<think>...</think>`)
    /// is rendered for the last turn only, so earlier turns render anew once later come.
    pub(crate) const THINKING: &str = "{%- for m in messages %}\
        {%- if m.role == 'assistant' %}\
        {%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}\
        {%- if loop.last and '</think>' in m.content %}\
        {%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}\
        {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}\
        {%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}\
        {%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}\
        {%- endfor %}\
        {%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    fn thinking_conversation() -> Vec<Message> {
        [
            ("user", "Hi"),
            ("assistant", "<think>\nhmm\n</think>\n\nHello!"),
            ("user", "Bye"),
            ("assistant", "<think>\nok\n</think>\n\nBye."),
        ]
        .iter()
        .map(|(r, c)| Message {
            role: r.to_string(),
            content: c.to_string(),
        })
        .collect()
    }

    fn trained(segments: &[Segment]) -> Vec<(usize, &str)> {
        segments
            .iter()
            .filter(|s| s.content)
            .map(|s| (s.turn, s.text.as_str()))
            .collect()
    }

    #[test]
    fn replies_of_a_template_that_rewrites_turns_are_located_in_one_rendering() {
        let t = ChatTemplate::from_source(THINKING, "thinking", "", "<|im_end|>").unwrap();
        let m = thinking_conversation();
        let e = t.segments(&m).unwrap_err();
        assert!(e.contains("cannot be told apart"), "{e}");
        let header = t.assistant_header(&m).unwrap();
        assert_eq!(header, "<|im_start|>assistant\n");
        let located = t.located_segments(&m, &header).unwrap();
        // Earlier turns' reasoning is gone from the text; the last keeps it, trained.
        assert_eq!(
            trained(&located),
            [
                (1, "Hello!<|im_end|>\n"),
                (3, "<think>\nok\n</think>\n\nBye.<|im_end|>\n")
            ]
        );
        let whole: String = located.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(whole, t.render(&m, false).unwrap());
        // Where the turn-by-turn cut works, locating after the header agrees with it.
        let chatml = ChatTemplate::builtin("chatml", "", "").unwrap();
        let m = conversation();
        let by_turn = chatml.segments(&m).unwrap();
        let located = chatml
            .located_segments(&m, &chatml.assistant_header(&m).unwrap())
            .unwrap();
        let replies = |s: &[Segment]| -> Vec<(usize, String)> {
            trained(s)
                .into_iter()
                .filter(|(turn, _)| m[*turn].role == "assistant")
                .map(|(turn, text)| (turn, text.to_string()))
                .collect()
        };
        assert_eq!(replies(&located), replies(&by_turn));
        // A marker the rendering does not hold, or one that finds the wrong text.
        let e = chatml.located_segments(&m, "<|assistant|>").unwrap_err();
        assert!(
            e.contains("no `<|assistant|>` before assistant turn 2"),
            "{e}"
        );
        let e = chatml.located_segments(&m, "user\n").unwrap_err();
        assert!(e.contains("does not hold what the turn says"), "{e}");
    }

    /// Generation blocks cut one rendering: each block's text is content of the k-th
    /// assistant turn, the rest is not, and the marks never reach the text.
    #[test]
    fn generation_blocks_cut_the_rendering_at_their_edges() {
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
                      {% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>\
                      {% endgeneration %}\n{% else %}{{ m.content }}<|im_end|>\n{% endif %}\
                      {% endfor %}";
        let t = ChatTemplate::from_source(source, "generation", "", "").unwrap();
        let m = conversation();
        let segments = t.generation_segments(&m).unwrap().unwrap();
        let whole: String = segments.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(whole, t.render(&m, false).unwrap());
        assert!(!whole.contains([GENERATION_OPEN, GENERATION_CLOSE]));
        // The newline after `{% endgeneration %}` is the template's, outside the block.
        assert_eq!(
            trained(&segments),
            [(2, "Hello!<|im_end|>"), (4, "Bye.<|im_end|>")]
        );
        // Reasoning rewritten by later turns needs no turn-by-turn cut.
        let thinking = THINKING
            .replace(
                "{{- '<|im_start|>assistant\\n<think>\\n'",
                "{{- '<|im_start|>assistant\\n' }}{% generation %}{{ '<think>\\n'",
            )
            .replace(
                "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}",
                "{% endgeneration %}{%- else %}{{- '<|im_start|>assistant\\n' }}\
                 {% generation %}{{ content + '<|im_end|>\\n' }}{% endgeneration %}",
            );
        assert!(thinking.matches("generation %}").count() == 4, "{thinking}");
        let t = ChatTemplate::from_source(&thinking, "thinking", "", "").unwrap();
        let m = thinking_conversation();
        assert_eq!(
            trained(&t.generation_segments(&m).unwrap().unwrap()),
            [
                (1, "Hello!<|im_end|>\n"),
                (3, "<think>\nok\n</think>\n\nBye.<|im_end|>\n")
            ]
        );
        // No blocks, no cut; a conversation holding a mark is refused.
        let chatml = ChatTemplate::builtin("chatml", "", "").unwrap();
        assert_eq!(chatml.generation_segments(&m).unwrap(), None);
        let mut marked = conversation();
        marked[2].content.push(GENERATION_OPEN);
        let e = t.render(&marked, false).unwrap_err();
        assert!(e.contains("turn 2 holds U+FDD0"), "{e}");
    }

    /// transformers' `strftime_now` as Llama 3.2's template calls it, in UTC.
    #[test]
    fn strftime_now_writes_pythons_fields() {
        // 2024-07-26 13:05:09 UTC, a Friday; 2000-02-29 (leap day), 1969-12-31 (before
        // the epoch).
        assert_eq!(strftime("%d %b %Y", 1_721_999_109).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %d %y, %H:%M:%S %I%p day %j %%", 1_721_999_109).unwrap(),
            "Friday July 26 24, 13:05:09 01PM day 208 %"
        );
        assert_eq!(
            strftime("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
        assert_eq!(strftime("%Y-%m-%d %j", -86_400).unwrap(), "1969-12-31 365");
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
        assert!(strftime("50%", 0).is_err());
        let t = ChatTemplate::from_source(
            "{{ bos_token }}Today Date: {{ strftime_now('%d %b %Y') }}",
            "llama3.2",
            "<|begin_of_text|>",
            "",
        )
        .unwrap();
        let text = t.render(&conversation(), false).unwrap();
        let date = text.strip_prefix("<|begin_of_text|>Today Date: ").unwrap();
        let parts: Vec<&str> = date.split(' ').collect();
        assert!(
            parts.len() == 3 && parts[0].len() == 2 && parts[2].len() == 4,
            "{text}"
        );
    }

    #[test]
    fn the_markers_a_template_writes_are_listed_once() {
        let markers = |name: &str| ChatTemplate::builtin(name, "", "").unwrap().markers();
        assert_eq!(markers("chatml"), ["<|im_start|>", "<|im_end|>"]);
        assert_eq!(
            markers("llama3"),
            ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        );
        assert_eq!(literal_markers("a <| x |> <|b|> <|b|> <|"), ["<|b|>"]);
    }

    /// A generation block is a block: `trim_blocks` drops the newline after
    /// `{% endgeneration %}` as after any block tag (transformers renders so), whitespace
    /// control on the tags works, and text that only looks like a tag is left to the
    /// parser: an error or a rendering, never a panic.
    #[test]
    fn generation_blocks_keep_jinja_whitespace_rules() {
        let m = conversation();
        let source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}\n\
                      {{ m.content }}{% endgeneration %}\n{% else %}{{ m.content }}\n\
                      {% endif %}{% endfor %}";
        let t = ChatTemplate::new(source.into(), "generation".into(), "", "").unwrap();
        assert_eq!(t.render(&m[1..4], false).unwrap(), "Hi\nHello!Bye\n");
        let source = "{% for m in messages %}{{ m.content }}  {%- generation +%}  [{{ m.role }}]\
                      {%+ endgeneration -%}  |{% endfor %}";
        let t = ChatTemplate::new(source.into(), "control".into(), "", "").unwrap();
        assert_eq!(
            t.render(&m[1..3], false).unwrap(),
            "Hi  [user]|Hello!  [assistant]|"
        );
        assert_eq!(
            generation_blocks("{%- generation -%}x{%+endgeneration%}"),
            (
                "{%- if true %}{{ \"\u{FDD0}\" }}{% if true -%}x\
                 {%+ endif %}{{ \"\u{FDD1}\" }}{% endif %}"
                    .to_string(),
                true
            )
        );
        assert_eq!(
            generation_blocks("{% if x %}"),
            ("{% if x %}".into(), false)
        );
        for text in [
            "{%}",
            "{{%}",
            "{%-%}",
            "{%+}",
            "{% generation",
            "%}{%",
            "{%%}",
        ] {
            if let Ok(t) = ChatTemplate::new(text.into(), "odd".into(), "", "") {
                let _ = t.render(&m, true);
                let _ = t.segments(&m);
            }
        }
    }
}
