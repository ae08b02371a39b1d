//! The fuzz targets' seeds (fuzz/seeds/), and any input a fuzzer once found, replayed
//! through the same loaders on stable Rust: each parses or fails cleanly, never panics.

use std::path::{Path, PathBuf};
use trainkit::config::RunConfig;
use trainkit::data::chat::conversation::Message;
use trainkit::data::chat::template::ChatTemplate;
use trainkit::data::parse_token_file;
use trainkit::model::parse_hf_config;
use trainkit::save::parse_safetensors;

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds in {}", dir.display());
    files
}

#[test]
fn config_seeds() {
    for f in inputs("config") {
        let text = std::fs::read_to_string(&f).unwrap();
        let cfg = RunConfig::from_toml(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    }
}

#[test]
fn token_file_seeds() {
    for f in inputs("token_file") {
        let bytes = std::fs::read(&f).unwrap();
        let _ = parse_token_file(&f, &bytes);
    }
}

#[test]
fn safetensors_seeds() {
    for f in inputs("safetensors") {
        let bytes = std::fs::read(&f).unwrap();
        let _ = parse_safetensors(&f, &bytes);
    }
}

#[test]
fn hf_config_seeds() {
    for f in inputs("hf_config") {
        let text = std::fs::read_to_string(&f).unwrap();
        let _ = parse_hf_config(&f, &text);
    }
}

#[test]
fn chat_template_seeds() {
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
    let mut rendered = 0;
    for f in inputs("chat_template") {
        let text = std::fs::read_to_string(&f).unwrap();
        match ChatTemplate::from_source(&text, "chat_template.jinja", "<s>", "</s>") {
            Ok(t) => {
                rendered += t.render(&conversation, true).is_ok() as usize;
                let _ = t.segments(&conversation);
            }
            Err(e) => assert!(e.to_string().contains("chat_template.jinja"), "{e}"),
        }
    }
    assert!(rendered >= 3, "the well-formed seeds render");
}
