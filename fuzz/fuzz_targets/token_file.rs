//! llm.c token files: any bytes decode to tokens or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(tokens) = trainkit::data::parse_token_file(Path::new("fuzz.bin"), data) {
        assert!(!tokens.is_empty());
        assert!(tokens.iter().all(|&t| t < 65536));
    }
});
