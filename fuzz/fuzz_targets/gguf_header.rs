//! Arbitrary bytes through `pipeshard_core::untrusted::gguf`: errors are fine, a panic is a bug.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = pipeshard_core::untrusted::gguf(data);
});
