//! safetensors files: any bytes decode to tensors or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(tensors) = trainkit::save::parse_safetensors(Path::new("fuzz.safetensors"), data) {
        for t in tensors {
            assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
        }
    }
});
