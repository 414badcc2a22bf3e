//! Replays every committed fuzz input (`fuzz/corpus/TARGET/*` and the crash regressions in
//! `fuzz/regressions/TARGET/*`) through the functions the fuzz targets call, on the stable toolchain: a panic
//! fails the test. The experiment target is replayed by the CLI's own tests.

use std::path::{Path, PathBuf};

use pipeshard_core::catalog;
use pipeshard_core::dtype::DType;
use pipeshard_core::gguf::{GgufValue, write_header};
use pipeshard_core::inventory::Inventory;
use pipeshard_core::untrusted;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Runs every file of the target's corpus and regressions through `entry`; returns (files, accepted).
fn replay(target: &str, entry: fn(&[u8]) -> Result<(), String>) -> (usize, usize) {
    let (mut files, mut accepted) = (0, 0);
    for dir in ["corpus", "regressions"] {
        let Ok(rd) = std::fs::read_dir(fuzz_dir().join(dir).join(target)) else { continue };
        for e in rd {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let r = std::panic::catch_unwind(|| entry(&bytes));
            assert!(r.is_ok(), "{}: the reader panicked", path.display());
            files += 1;
            accepted += usize::from(r.unwrap().is_ok());
        }
    }
    (files, accepted)
}

#[test]
fn gguf_corpus_never_panics() {
    let (files, accepted) = replay("gguf_header", untrusted::gguf);
    assert!(files >= 2, "gguf_header corpus has {files} files");
    assert!(accepted >= 1, "no gguf_header corpus file is a readable GGUF");
}

#[test]
fn hf_config_corpus_never_panics() {
    let (files, accepted) = replay("hf_config", untrusted::hf_config);
    assert!(files >= 7, "hf_config corpus has {files} files");
    assert!(accepted >= 1, "no hf_config corpus file is a readable config.json");
}

#[test]
fn profile_corpus_never_panics() {
    let (files, accepted) = replay("profile_json", untrusted::profile);
    assert!(files >= 3, "profile_json corpus has {files} files");
    assert!(accepted >= 1, "no profile_json corpus file is a readable Profile");
}

#[test]
fn plan_corpus_never_panics() {
    let (files, accepted) = replay("plan_json", untrusted::plan);
    assert!(files >= 2, "plan_json corpus has {files} files");
    assert!(accepted >= 1, "no plan_json corpus file is a valid Plan");
}

/// A header-only GGUF of a catalog model cut to one layer with tiny widths (so every tensor fits in the
/// header's own length, as the reader requires of a real file).
fn tiny_gguf(model: &str, arch: &str) -> Vec<u8> {
    let mut spec = catalog::get(model).unwrap().truncated(1).unwrap();
    let t = &mut spec.text;
    (t.hidden, t.ffn, t.vocab, t.n_heads, t.n_kv_heads, t.head_dim) = (8, 8, 8, 2, 1, 4);
    if let Some(m) = &mut t.moe {
        (m.n_experts, m.top_k, m.expert_ffn) = (4, 2, 4);
    }
    let spec = spec.with_uniform_weights(DType::F16);
    let inv = Inventory::new(&spec);
    let t = &spec.text;
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::String(arch.into())),
        (k("block_count"), GgufValue::U32(t.n_layers)),
        (k("embedding_length"), GgufValue::U32(t.hidden as u32)),
        (k("feed_forward_length"), GgufValue::U32(t.ffn as u32)),
        (k("attention.head_count"), GgufValue::U32(t.n_heads)),
        (k("attention.head_count_kv"), GgufValue::U32(t.n_kv_heads)),
        (k("attention.key_length"), GgufValue::U32(t.head_dim as u32)),
        (k("rope.dimension_count"), GgufValue::U32((t.head_dim as f64 * t.partial_rotary) as u32)),
        (k("rope.freq_base"), GgufValue::F32(t.rope_theta as f32)),
        (k("vocab_size"), GgufValue::U32(t.vocab as u32)),
        (k("context_length"), GgufValue::U64(t.max_position)),
        (k("attention.layer_norm_rms_epsilon"), GgufValue::F64(t.norm_eps)),
    ];
    if let Some(m) = &t.moe {
        meta.push((k("expert_count"), GgufValue::U32(m.n_experts)));
        meta.push((k("expert_used_count"), GgufValue::U32(m.top_k)));
        meta.push((k("expert_feed_forward_length"), GgufValue::U32(m.expert_ffn as u32)));
    }
    // ggml types: 0 = f32, 1 = f16.
    let ggml = |d: DType| u32::from(d != DType::F32);
    let dims: Vec<Vec<u64>> = inv.tensors.iter().map(|t| t.shape.iter().rev().copied().collect()).collect();
    let mut offset = 0;
    let tensors: Vec<(&str, &[u64], u32, u64)> = inv
        .tensors
        .iter()
        .zip(&dims)
        .map(|(t, d)| {
            let o = offset;
            offset += t.bytes.div_ceil(32) * 32;
            (t.name.as_str(), d.as_slice(), ggml(t.dtype), o)
        })
        .collect();
    let meta: Vec<(&str, GgufValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    // Tensor data (zeros) after the header, padded to the default alignment: the reader checks it is there.
    let mut bytes = write_header(&meta, &tensors);
    bytes.resize(bytes.len().div_ceil(32) * 32 + offset as usize, 0);
    bytes
}

#[test]
fn tiny_gguf_seeds_are_read() {
    for (model, arch) in [("llama-3.1-8b", "llama"), ("qwen3-30b-a3b", "qwen3moe")] {
        let bytes = tiny_gguf(model, arch);
        untrusted::gguf(&bytes).unwrap_or_else(|e| panic!("{model}: {e}"));
    }
}

/// Writes the GGUF seeds into `fuzz/corpus/gguf_header/` (run with `--ignored` after changing them).
#[test]
#[ignore = "writes the fuzz seeds"]
fn write_gguf_seeds() {
    let dir = fuzz_dir().join("corpus/gguf_header");
    std::fs::create_dir_all(&dir).unwrap();
    for (model, arch) in [("llama-3.1-8b", "llama"), ("qwen3-30b-a3b", "qwen3moe")] {
        std::fs::write(dir.join(format!("{model}-1L.gguf")), tiny_gguf(model, arch)).unwrap();
    }
}
