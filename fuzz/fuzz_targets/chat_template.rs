//! A chat template's text (as `chat_template.jinja` holds it): any text is a template that
//! renders a conversation (or fails to, with an error) or an error naming the file; the
//! turn cutting of `prepare --chat` likewise. Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use trainkit::data::chat::conversation::Message;
use trainkit::data::chat::template::ChatTemplate;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(template) = ChatTemplate::from_source(text, "chat_template.jinja", "<s>", "</s>")
    else {
        return;
    };
    let conversation: Vec<Message> = [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Bye"),
        ("assistant", "Bye."),
    ]
    .iter()
    .map(|(role, content)| Message {
        role: role.to_string(),
        content: content.to_string(),
    })
    .collect();
    let _ = template.render(&conversation, true);
    let _ = template.segments(&conversation);
});
