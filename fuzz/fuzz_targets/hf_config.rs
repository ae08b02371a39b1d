//! transformers' config.json: any text parses to a valid shape of one of trainkit's model
//! families (read by its `model_type` through the registry) or an error; GPT-2's own
//! reader likewise.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(cfg) = trainkit::model::parse_hf_config(Path::new("config.json"), text) {
            cfg.validate().expect("a parsed config is valid");
        }
        if let Ok(cfg) = trainkit::model::families::read_config(Path::new("config.json"), text) {
            cfg.validate().expect("a parsed config is valid");
        }
    }
});
