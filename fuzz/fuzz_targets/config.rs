//! Run configs: any text parses to a config or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(cfg) = trainkit::config::RunConfig::from_toml(text) {
            // What parses must print and parse back.
            let again = cfg.to_toml().expect("a parsed config prints");
            trainkit::config::RunConfig::from_toml(&again).expect("a printed config parses");
        }
    }
});
