//! One conversation of a chat or instruction dataset, read from a JSON line in any of the
//! common forms: `messages` (`[{"role", "content"}]`, the form chat templates take),
//! Alpaca (`instruction`, optional `input`, `output`) and ShareGPT (`conversations` of
//! `{"from", "value"}`).

use serde::Serialize;
use serde_json::Value;

/// One turn: who speaks and what they say.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// The roles a conversation may hold.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// The conversation a JSON line holds, or what is wrong with it (the caller names the file
/// and line).
pub fn parse(line: &str) -> Result<Vec<Message>, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("is not JSON ({e})"))?;
    let object = value
        .as_object()
        .ok_or("is not a JSON object; each line is one conversation")?;
    let messages = if let Some(list) = object.get("messages") {
        messages(list, "messages", "role", "content", &|r| {
            Some(r.to_string())
        })?
    } else if let Some(list) = object.get("conversations") {
        messages(list, "conversations", "from", "value", &sharegpt_role)?
    } else if object.contains_key("instruction") {
        alpaca(object)?
    } else {
        return Err(
            "has none of `messages`, `conversations` (ShareGPT) or `instruction` \
                    (Alpaca); one of them holds the conversation"
                .into(),
        );
    };
    check(&messages)?;
    Ok(messages)
}

/// ShareGPT's speaker names as roles.
fn sharegpt_role(from: &str) -> Option<String> {
    Some(
        match from {
            "system" => "system",
            "human" | "user" => "user",
            "gpt" | "assistant" | "chatgpt" | "bard" => "assistant",
            "tool" | "function" | "observation" => "tool",
            _ => return None,
        }
        .to_string(),
    )
}

/// The turns of `list` (the field `field`), each an object with `role_key` and
/// `content_key` strings, its role mapped by `role`.
fn messages(
    list: &Value,
    field: &str,
    role_key: &str,
    content_key: &str,
    role: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<Message>, String> {
    let list = list
        .as_array()
        .ok_or_else(|| format!("has `{field}` that is not a list of turns"))?;
    list.iter()
        .enumerate()
        .map(|(i, turn)| {
            let who = turn
                .get(role_key)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("turn {i} of `{field}` has no `{role_key}` string"))?;
            let content = content(turn.get(content_key), content_key)
                .map_err(|e| format!("turn {i} of `{field}` {e}"))?;
            let role = role(who)
                .ok_or_else(|| format!("turn {i} of `{field}` is from unknown speaker `{who}`"))?;
            Ok(Message { role, content })
        })
        .collect()
}

/// A turn's text: a string, or OpenAI's list of content parts (`[{"type": "text", "text":
/// "..."}]`), whose texts are joined as OpenAI joins them (with nothing between). Parts
/// of other types (images, audio) are refused: a text model cannot train on them.
fn content(value: Option<&Value>, key: &str) -> Result<String, String> {
    match value {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, part)| {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text") | None, Some(text)) => Ok(text),
                    (Some(other), _) if other != "text" => Err(format!(
                        "has a content part of type `{other}` (part {j}); only text parts \
                         can be trained on"
                    )),
                    _ => Err(format!("has content part {j} without a `text` string")),
                }
            })
            .collect(),
        _ => Err(format!("has no `{key}` string (or list of text parts)")),
    }
}

/// An Alpaca record as a user turn (the instruction, then the input after a blank line)
/// and an assistant turn (the output).
fn alpaca(object: &serde_json::Map<String, Value>) -> Result<Vec<Message>, String> {
    let text = |key: &str| -> Result<Option<&str>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(format!("has `{key}` that is not a string")),
        }
    };
    let instruction = text("instruction")?.unwrap_or_default();
    let output = text("output")?.ok_or("is an Alpaca record without an `output` string")?;
    let user = match text("input")? {
        Some(input) if !input.is_empty() => format!("{instruction}\n\n{input}"),
        _ => instruction.to_string(),
    };
    Ok(vec![
        Message {
            role: "user".into(),
            content: user,
        },
        Message {
            role: "assistant".into(),
            content: output.to_string(),
        },
    ])
}

/// Fails on an empty conversation, an unknown role, or one without an assistant turn
/// (nothing to train on).
fn check(messages: &[Message]) -> Result<(), String> {
    if messages.is_empty() {
        return Err("is an empty conversation".into());
    }
    if let Some(m) = messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
        return Err(format!(
            "has a turn of role `{}`; roles are {}",
            m.role,
            ROLES.join(", ")
        ));
    }
    if !messages.iter().any(|m| m.role == "assistant") {
        return Err("has no assistant turn, so nothing to train on".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(m: &[Message]) -> Vec<&str> {
        m.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn the_three_forms_are_read() {
        let m = parse(
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"},
            {"role":"assistant","content":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(roles(&m), ["system", "user", "assistant"]);
        let m = parse(r#"{"instruction":"do","input":"this","output":"done"}"#).unwrap();
        assert_eq!(m[0].content, "do\n\nthis");
        assert_eq!(m[1].content, "done");
        let m = parse(r#"{"instruction":"do","input":"","output":"done"}"#).unwrap();
        assert_eq!(m[0].content, "do");
        let m = parse(
            r#"{"conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"yo"}]}"#,
        )
        .unwrap();
        assert_eq!(roles(&m), ["user", "assistant"]);
        // OpenAI's list of content parts: the texts joined.
        let m = parse(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},
            {"type":"text","text":"b"}]},{"role":"assistant","content":[{"type":"text","text":"c"}]}]}"#,
        )
        .unwrap();
        assert_eq!((m[0].content.as_str(), m[1].content.as_str()), ("ab", "c"));
    }

    #[test]
    fn bad_rows_say_what_is_wrong() {
        for (line, says) in [
            ("{", "not JSON"),
            ("[1]", "not a JSON object"),
            (r#"{"text":"x"}"#, "has none of"),
            (r#"{"messages":[]}"#, "empty conversation"),
            (r#"{"messages":[{"role":"user"}]}"#, "no `content` string"),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
                "of type `image_url` (part 0)",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
                "part 0 without a `text` string",
            ),
            (
                r#"{"messages":[{"role":"robot","content":"x"}]}"#,
                "role `robot`",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
                "no assistant turn",
            ),
            (
                r#"{"conversations":[{"from":"cat","value":"x"}]}"#,
                "unknown speaker `cat`",
            ),
            (r#"{"instruction":"x"}"#, "without an `output`"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(e.contains(says), "{line}: {e}");
        }
    }
}
