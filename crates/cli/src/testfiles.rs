//! Model files written by tests: a small llama-architecture GGUF (whole or split in two) with a quantisation
//! mix, and its layout.

use std::path::{Path, PathBuf};

use pipeshard_core::dtype::DType;
use pipeshard_core::gguf::{GgufValue, dtype_of_ggml, write_header};
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::{WeightFormat, parse_hf_config};

/// The architecture of the test GGUF, as a transformers config.
pub const CONFIG: &str = r#"{"model_type":"llama","hidden_size":256,"num_attention_heads":4,"num_key_value_heads":2,
    "intermediate_size":512,"num_hidden_layers":2,"vocab_size":256,"tie_word_embeddings":false,
    "rope_theta":500000.0,"rms_norm_eps":1e-5,"max_position_embeddings":8192}"#;

/// ggml type ids: f32, q8_0, q4_K, q6_K.
const F32: u32 = 0;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;

/// A fresh folder under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pipeshard-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The test model's tensors as (name, dims innermost first, ggml type, bytes): q4_K matrices, q8_0 `attn_v`,
/// q6_K `ffn_down` and output head, f32 norms — a mix no single format describes.
pub fn tensors() -> Vec<(String, Vec<u64>, u32, u64)> {
    let spec = parse_hf_config("config.json", CONFIG, "t", WeightFormat::uniform(DType::F16)).unwrap();
    Inventory::new(&spec)
        .tensors
        .iter()
        .map(|t| {
            let ty = if t.shape.len() == 1 {
                F32
            } else if t.name.ends_with("attn_v.weight") {
                Q8_0
            } else if t.name.ends_with("ffn_down.weight") || t.name == "output.weight" {
                Q6_K
            } else {
                Q4_K
            };
            let dims: Vec<u64> = t.shape.iter().rev().copied().collect();
            let rows = dims[1..].iter().product();
            let bytes = dtype_of_ggml(ty).unwrap().tensor_bytes(dims[0], rows).unwrap();
            (t.name.clone(), dims, ty, bytes)
        })
        .collect()
}

fn metadata() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("llama.block_count", GgufValue::U32(2)),
        ("llama.embedding_length", GgufValue::U32(256)),
        ("llama.feed_forward_length", GgufValue::U32(512)),
        ("llama.attention.head_count", GgufValue::U32(4)),
        ("llama.attention.head_count_kv", GgufValue::U32(2)),
        ("llama.rope.freq_base", GgufValue::F32(500_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", GgufValue::F32(1e-5)),
        ("llama.context_length", GgufValue::U32(8192)),
        ("llama.vocab_size", GgufValue::U32(256)),
        ("general.alignment", GgufValue::U32(32)),
    ]
}

/// One GGUF file holding `tensors` (zeroed data at aligned offsets) with `meta`.
fn write_file(path: &Path, meta: &[(&str, GgufValue)], tensors: &[(String, Vec<u64>, u32, u64)]) {
    let mut offset = 0u64;
    let infos: Vec<(&str, &[u64], u32, u64)> = tensors
        .iter()
        .map(|(name, dims, ty, bytes)| {
            let at = offset;
            offset = (offset + bytes).next_multiple_of(32);
            (name.as_str(), dims.as_slice(), *ty, at)
        })
        .collect();
    let mut out = write_header(meta, &infos);
    out.resize(out.len().next_multiple_of(32) + offset as usize, 0);
    std::fs::write(path, out).unwrap();
}

/// Writes `dir/tiny.gguf` and returns its path.
pub fn write_gguf(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    write_file(&path, &metadata(), &tensors());
    path
}

/// Writes the same model split in two (`tiny-00001-of-00002.gguf`, `tiny-00002-of-00002.gguf`), the first
/// part holding the metadata and the first half of the tensors, as llama.cpp's `gguf-split` does; returns the
/// second part's path.
pub fn write_split_gguf(dir: &Path) -> PathBuf {
    let all = tensors();
    let (a, b) = all.split_at(all.len() / 2);
    let split = |no: u16, n: usize| {
        vec![
            ("split.no", GgufValue::U16(no)),
            ("split.count", GgufValue::U16(2)),
            ("split.tensors.count", GgufValue::I32(n as i32)),
        ]
    };
    let mut first = metadata();
    first.extend(split(0, all.len()));
    write_file(&dir.join("tiny-00001-of-00002.gguf"), &first, a);
    let second = dir.join("tiny-00002-of-00002.gguf");
    write_file(&second, &split(1, all.len()), b);
    second
}
