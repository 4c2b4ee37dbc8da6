//! The safetensors header parser on arbitrary bytes (the whole "file" is the input): it must
//! return Ok or a typed error, never panic, hang or allocate past the input's size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.safetensors");
    if let Ok(h) = colibri::container::safetensors::parse_header(path, data, data.len() as u64) {
        // Every accepted range lies inside the file, in order, without overlap.
        let mut end = h.data_start;
        let mut ranges: Vec<_> = h.tensors.iter().map(|t| (t.start, t.end)).collect();
        ranges.sort_unstable();
        for (s, e) in ranges {
            assert!(s >= end && e >= s && e <= data.len(), "bad range {s}..{e}");
            end = e;
        }
    }
    // A claimed file length larger than the bytes we have must not be trusted either.
    let _ = colibri::container::safetensors::parse_header(path, data, u64::MAX);
});
