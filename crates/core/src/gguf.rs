//! GGUF header reader: metadata and tensor infos, never the weights.
//!
//! Our own reader rather than a crate: it must treat every count and length in the file as untrusted (a
//! fuzzed or truncated file must give an error naming the file, the byte offset and the field, never a panic
//! or a multi-gigabyte allocation), it reads only the header (a 77 GiB model costs a few MB of reads), and it
//! merges split files (`-00001-of-00002.gguf`). The format is GGUF v2/v3 (v1, with 32-bit counts, predates
//! every file people hold today and is rejected with a message saying so): magic `GGUF`, version, tensor
//! count, metadata count, metadata key/values, tensor infos (name, dims innermost first, ggml type, offset),
//! then tensor data aligned to `general.alignment` (default 32).

use std::fmt;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::inventory::Inventory;
use crate::model::{FfnKind, ModelSpec, MoeConfig, NormKind, StoredTensor, TextConfig, WeightFormat};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    #[must_use]
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(u64::from(v)),
            GgufValue::U16(v) => Some(u64::from(v)),
            GgufValue::U32(v) => Some(u64::from(v)),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    #[must_use]
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(f64::from(v)),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Array(a) => write!(f, "[{} values]", a.len()),
            GgufValue::Bool(b) => write!(f, "{b}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_u64().map_or_else(|| format!("{other:?}"), |v| v.to_string())),
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions innermost first, as ggml stores them (`[row_elems, rows, …]`).
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub ggml_type: u32,
    /// Our format for it, if we model that type.
    pub dtype: Option<DType>,
    /// Exact bytes of the tensor data.
    pub bytes: u64,
    /// Offset of the data from the start of the file's data section.
    pub offset: u64,
    /// Which split file holds it (0 for a single file).
    pub split: u32,
}

/// A parsed header (all splits merged).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// The files read, first split first.
    pub files: Vec<PathBuf>,
    /// Where each file's tensor data begins (byte offset; a tensor's `offset` counts from there), in `files`
    /// order.
    pub data_starts: Vec<u64>,
}

impl GgufHeader {
    /// A metadata value by key.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Total tensor data bytes.
    #[must_use]
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }
}

/// A file that is not a readable GGUF header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: cannot read: {reason}")]
    Io { file: String, reason: String },
    #[error("{file}: not a GGUF file (magic {found:?} at offset 0, expected \"GGUF\")")]
    Magic { file: String, found: [u8; 4] },
    #[error(
        "{file}: GGUF version {found} is not supported (this reader takes versions 2 and 3; convert v1 files with llama.cpp's gguf tools)"
    )]
    Version { file: String, found: u32 },
    #[error(
        "{file}: a big-endian GGUF file; this reader takes little-endian files (convert it with llama.cpp's gguf tools)"
    )]
    BigEndian { file: String },
    #[error("{file}: truncated at byte {offset} while reading {field} (file ends early; re-download it)")]
    Truncated { file: String, offset: u64, field: String },
    #[error("{file}: byte {offset}: {field} is {value}, {problem}")]
    Invalid { file: String, offset: u64, field: String, value: String, problem: String },
    #[error("{file}: split {found} of {count} missing: expected {expected}")]
    MissingSplit { file: String, found: u32, count: u32, expected: String },
}

/// Longest string accepted in a header (names and metadata strings; tokenizer merges are short).
const MAX_STRING_BYTES: u64 = 1 << 20;
/// Most tensor dimensions ggml supports.
const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted.
const MAX_ARRAY_DEPTH: u32 = 4;

struct Reader<R: Read> {
    inner: R,
    offset: u64,
    file: String,
    /// Bytes of file left after `offset`: no count may promise more items than could fit in them.
    remaining: u64,
}

impl<R: Read> Reader<R> {
    fn truncated(&self, field: &str) -> GgufError {
        GgufError::Truncated { file: self.file.clone(), offset: self.offset, field: field.into() }
    }

    fn invalid(&self, field: &str, value: impl fmt::Display, problem: &str) -> GgufError {
        GgufError::Invalid {
            file: self.file.clone(),
            offset: self.offset,
            field: field.into(),
            value: value.to_string(),
            problem: problem.into(),
        }
    }

    fn bytes<const N: usize>(&mut self, field: &str) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|_| self.truncated(field))?;
        self.offset += N as u64;
        self.remaining = self.remaining.saturating_sub(N as u64);
        Ok(buf)
    }

    fn u32(&mut self, field: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(field)?))
    }

    /// A count of items of at least `min_item_bytes` each, checked against what is left of the file.
    fn count(&mut self, field: &str, min_item_bytes: u64) -> Result<u64, GgufError> {
        let n = self.u64(field)?;
        if n.saturating_mul(min_item_bytes) > self.remaining {
            return Err(self.invalid(
                field,
                n,
                &format!("more than the {} bytes left in the file can hold", self.remaining),
            ));
        }
        Ok(n)
    }

    fn string(&mut self, field: &str) -> Result<String, GgufError> {
        let len = self.u64(field)?;
        if len > MAX_STRING_BYTES || len > self.remaining {
            return Err(self.invalid(field, len, "is not a plausible string length"));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner.read_exact(&mut buf).map_err(|_| self.truncated(field))?;
        self.offset += len;
        self.remaining -= len;
        String::from_utf8(buf).map_err(|_| self.invalid(field, format!("{len} bytes"), "is not valid UTF-8"))
    }

    fn value(&mut self, ty: u32, field: &str, depth: u32) -> Result<GgufValue, GgufError> {
        Ok(match ty {
            0 => GgufValue::U8(self.bytes::<1>(field)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.bytes(field)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes(field)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes(field)?)),
            4 => GgufValue::U32(self.u32(field)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes(field)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes(field)?)),
            7 => match self.bytes::<1>(field)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.invalid(field, b, "is not a bool (0 or 1)")),
            },
            8 => GgufValue::String(self.string(field)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.invalid(field, depth, "nests arrays too deeply"));
                }
                let elem = self.u32(field)?;
                let n = self.count(field, elem_min_bytes(elem))?;
                // Capacity from the checked count, capped: a lying count cannot reserve more than the file.
                let mut items = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    items.push(self.value(elem, field, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(field)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes(field)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes(field)?)),
            other => return Err(self.invalid(field, other, "is not a GGUF value type (0..=12)")),
        })
    }
}

/// Smallest encoding of one value of type `ty` (unknown types count 1 so the type error surfaces later).
fn elem_min_bytes(ty: u32) -> u64 {
    match ty {
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

/// Our format for a ggml type id, with its block geometry from [`DType`].
#[must_use]
pub fn dtype_of_ggml(ty: u32) -> Option<DType> {
    Some(match ty {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::Bf16,
        _ => return None,
    })
}

/// Reads one file's header.
fn read_one(path: &Path, split: u32) -> Result<GgufHeader, GgufError> {
    let file = path.display().to_string();
    let io = |e: std::io::Error| GgufError::Io { file: file.clone(), reason: e.to_string() };
    let f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    parse(&file, BufReader::new(f), len, split)
}

/// Parses a header from `source` of `len` bytes; `file` names it in errors.
pub fn parse<R: Read>(file: &str, source: R, len: u64, split: u32) -> Result<GgufHeader, GgufError> {
    let mut r = Reader { inner: source, offset: 0, file: file.into(), remaining: len };
    let magic: [u8; 4] = r.bytes("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::Magic { file: file.into(), found: magic });
    }
    let version = r.u32("version")?;
    if (2..=3).contains(&version.swap_bytes()) {
        return Err(GgufError::BigEndian { file: file.into() });
    }
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version { file: file.into(), found: version });
    }
    // A tensor info is at least name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    let n_tensors = r.count("tensor_count", 32)?;
    // A key/value is at least key length (8) + type (4) + one byte.
    let n_kv = r.count("metadata_kv_count", 13)?;
    let mut metadata = Vec::with_capacity(n_kv.min(4096) as usize);
    for i in 0..n_kv {
        let key = r.string(&format!("metadata[{i}].key"))?;
        let ty = r.u32(&format!("metadata `{key}` type"))?;
        let value = r.value(ty, &format!("metadata `{key}`"), 0)?;
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => 32,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return Err(r.invalid("general.alignment", v, "must be a power of two")),
        },
    };
    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor[{i}].name"))?;
        let n_dims = r.u32(&format!("tensor `{name}` n_dims"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.invalid(&format!("tensor `{name}` n_dims"), n_dims, "must be 1..=4"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let v = r.u64(&format!("tensor `{name}` dim {d}"))?;
            if v == 0 {
                return Err(r.invalid(&format!("tensor `{name}` dim {d}"), v, "must be positive"));
            }
            dims.push(v);
        }
        let ggml_type = r.u32(&format!("tensor `{name}` type"))?;
        let offset = r.u64(&format!("tensor `{name}` offset"))?;
        if offset % alignment != 0 {
            return Err(r.invalid(
                &format!("tensor `{name}` offset"),
                offset,
                &format!("is not a multiple of the alignment {alignment}"),
            ));
        }
        let dtype = dtype_of_ggml(ggml_type);
        let elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let bytes = match (dtype, elems) {
            (Some(dt), Some(elems)) => {
                let row = dims[0];
                dt.tensor_bytes(row, elems / row).map_err(|e| {
                    r.invalid(&format!("tensor `{name}` dims"), format!("{dims:?}"), &e.to_string())
                })?
            }
            (None, _) => {
                return Err(r.invalid(
                    &format!("tensor `{name}` type"),
                    ggml_type,
                    "is a ggml type this tool does not model (supported: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_K..q6_K)",
                ));
            }
            (_, None) => {
                return Err(r.invalid(
                    &format!("tensor `{name}` dims"),
                    format!("{dims:?}"),
                    "overflow 64 bits",
                ));
            }
        };
        tensors.push(GgufTensorInfo { name, dims, ggml_type, dtype, bytes, offset, split });
    }
    // Tensor data starts at the next multiple of the alignment after the header; a file that ends before its
    // last tensor's data is an interrupted download.
    let data_start = r.offset.next_multiple_of(alignment);
    for t in &tensors {
        let end = data_start.saturating_add(t.offset).saturating_add(t.bytes);
        if end > len {
            return Err(GgufError::Invalid {
                file: file.into(),
                offset: data_start + t.offset,
                field: format!("tensor `{}` data", t.name),
                value: format!("{} bytes ending at byte {end}", t.bytes),
                problem: format!("past the end of the file ({len} bytes): it is truncated; re-download it"),
            });
        }
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        files: vec![PathBuf::from(file)],
        data_starts: vec![data_start],
    })
}

/// `(stem, index, count)` of a split file name `stem-0000i-of-0000n.gguf`.
fn split_parts(path: &Path) -> Option<(String, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let base = name.strip_suffix(".gguf")?;
    let (rest, count) = base.rsplit_once("-of-")?;
    let (stem, index) = rest.rsplit_once('-')?;
    if index.len() != 5 || count.len() != 5 {
        return None;
    }
    Some((stem.to_string(), index.parse().ok()?, count.parse().ok()?))
}

/// Reads a GGUF header; for a split file (`…-00001-of-00003.gguf`, any of the parts) reads every part and
/// merges their tensors.
pub fn read_header(path: &Path) -> Result<GgufHeader, GgufError> {
    let Some((stem, _, count)) = split_parts(path) else { return read_one(path, 0) };
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut merged: Option<GgufHeader> = None;
    for i in 1..=count {
        let part = dir.join(format!("{stem}-{i:05}-of-{count:05}.gguf"));
        if !part.exists() {
            return Err(GgufError::MissingSplit {
                file: path.display().to_string(),
                found: i,
                count,
                expected: part.display().to_string(),
            });
        }
        let h = read_one(&part, i - 1)?;
        match &mut merged {
            None => merged = Some(h),
            Some(m) => {
                m.tensors.extend(h.tensors);
                m.files.extend(h.files);
                m.data_starts.extend(h.data_starts);
            }
        }
    }
    Ok(merged.expect("count ≥ 1 parts were read"))
}

impl GgufHeader {
    fn meta_err(&self, key: &str, value: Option<&GgufValue>, problem: &str) -> GgufError {
        GgufError::Invalid {
            file: self.files.first().map_or_else(String::new, |f| f.display().to_string()),
            offset: 0,
            field: format!("metadata `{key}`"),
            value: value.map_or_else(|| "missing".into(), ToString::to_string),
            problem: problem.into(),
        }
    }

    fn meta_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key);
        v.and_then(GgufValue::as_u64)
            .filter(|&n| n > 0)
            .ok_or_else(|| self.meta_err(key, v, "must be a positive integer"))
    }

    fn meta_u32(&self, key: &str) -> Result<u32, GgufError> {
        let n = self.meta_u64(key)?;
        u32::try_from(n).map_err(|_| self.meta_err(key, self.get(key), "must fit 32 bits"))
    }

    fn meta_f64_or(&self, key: &str, default: f64) -> Result<f64, GgufError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| self.meta_err(key, Some(v), "must be a positive number")),
        }
    }

    /// The model the header describes, as a [`ModelSpec`] named `name` that carries every tensor's format and
    /// exact bytes ([`ModelSpec::stored`]), checked against the layout of its architecture: every tensor the
    /// layout expects is in the file with that shape, and every tensor of the file has a place.
    pub fn model_spec(&self, name: &str) -> Result<ModelSpec, GgufError> {
        let arch_v = self.get("general.architecture");
        let arch = arch_v
            .and_then(GgufValue::as_str)
            .ok_or_else(|| self.meta_err("general.architecture", arch_v, "must be a string"))?;
        let (ffn_kind, norm) = match arch {
            "llama" | "qwen2" | "qwen3" | "qwen3moe" | "qwen2vl" => (FfnKind::SwiGlu, NormKind::RmsNorm),
            "nemotron" => (FfnKind::ReluSquared, NormKind::LayerNorm),
            _ => {
                return Err(self.meta_err(
                    "general.architecture",
                    arch_v,
                    "is not supported (supported: llama, qwen2, qwen2vl, qwen3, qwen3moe, nemotron)",
                ));
            }
        };
        let k = |key: &str| format!("{arch}.{key}");
        let hidden = self.meta_u64(&k("embedding_length"))?;
        let n_heads = self.meta_u32(&k("attention.head_count"))?;
        let n_kv_heads = if self.get(&k("attention.head_count_kv")).is_some() {
            self.meta_u32(&k("attention.head_count_kv"))?
        } else {
            n_heads
        };
        if n_heads % n_kv_heads != 0 {
            return Err(self.meta_err(
                &k("attention.head_count_kv"),
                self.get(&k("attention.head_count_kv")),
                "must divide attention.head_count",
            ));
        }
        let head_dim = if self.get(&k("attention.key_length")).is_some() {
            self.meta_u64(&k("attention.key_length"))?
        } else {
            hidden / u64::from(n_heads)
        };
        let rope_dims = if self.get(&k("rope.dimension_count")).is_some() {
            self.meta_u64(&k("rope.dimension_count"))?
        } else {
            head_dim
        };
        let vocab = match self.get(&k("vocab_size")) {
            Some(_) => self.meta_u64(&k("vocab_size"))?,
            None => match self.get("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(a)) if !a.is_empty() => a.len() as u64,
                other => {
                    return Err(self.meta_err(
                        "tokenizer.ggml.tokens",
                        other,
                        "must list the vocabulary (or set {arch}.vocab_size)",
                    ));
                }
            },
        };
        let moe = if arch == "qwen3moe" {
            let n_experts = self.meta_u32(&k("expert_count"))?;
            let top_k = self.meta_u32(&k("expert_used_count"))?;
            if top_k > n_experts {
                return Err(self.meta_err(
                    &k("expert_used_count"),
                    self.get(&k("expert_used_count")),
                    "must be at most expert_count",
                ));
            }
            Some(MoeConfig {
                n_experts,
                top_k,
                expert_ffn: self.meta_u64(&k("expert_feed_forward_length"))?,
                n_shared_experts: 0,
                shared_ffn: 0,
                leading_dense_layers: 0,
                norm_topk_prob: true,
            })
        } else {
            None
        };
        let ffn = if moe.is_some() && self.get(&k("feed_forward_length")).is_none() {
            hidden
        } else {
            self.meta_u64(&k("feed_forward_length"))?
        };
        let eps_key = if norm == NormKind::LayerNorm {
            "attention.layer_norm_epsilon"
        } else {
            "attention.layer_norm_rms_epsilon"
        };
        let text = TextConfig {
            n_layers: self.meta_u32(&k("block_count"))?,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            ffn_kind,
            norm,
            vocab,
            tied_embeddings: !self.tensors.iter().any(|t| t.name == "output.weight"),
            qk_norm: self.tensors.iter().any(|t| t.name.ends_with("attn_q_norm.weight")),
            qkv_bias: self.tensors.iter().any(|t| t.name.ends_with("attn_q.bias")),
            rope_theta: self.meta_f64_or(&k("rope.freq_base"), 10_000.0)?,
            partial_rotary: rope_dims as f64 / head_dim as f64,
            norm_eps: self.meta_f64_or(&k(eps_key), 1e-6)?,
            max_position: self.meta_u64(&k("context_length")).unwrap_or(4096),
            moe,
        };
        if let Some((field, value, max)) = text.over_limit() {
            let key = match field {
                "n_layers" => "block_count",
                "hidden" => "embedding_length",
                "n_heads" => "attention.head_count",
                "n_kv_heads" => "attention.head_count_kv",
                "head_dim" => "attention.key_length",
                "ffn" => "feed_forward_length",
                "vocab" => "vocab_size",
                "n_experts" | "n_layers × n_experts" => "expert_count",
                "expert_ffn" => "expert_feed_forward_length",
                other => other,
            };
            return Err(self.meta_err(
                &k(key),
                Some(&GgufValue::U64(value)),
                &format!("{field} must be at most {max} (no real model is larger)"),
            ));
        }
        let stored: Vec<StoredTensor> = self
            .tensors
            .iter()
            .map(|t| StoredTensor {
                name: t.name.clone(),
                shape: t.dims.iter().rev().copied().collect(),
                dtype: t.dtype.expect("the reader rejects types it does not model"),
                bytes: t.bytes,
            })
            .collect();
        let spec = ModelSpec {
            name: name.into(),
            text,
            vision: None,
            weights: WeightFormat::from_stored(&stored),
            stored,
        };
        Inventory::check_stored(&spec).map_err(|m| GgufError::Invalid {
            file: self.files.first().map_or_else(String::new, |f| f.display().to_string()),
            offset: 0,
            field: format!("tensor `{}`", m.tensor),
            value: m.value,
            problem: m.problem,
        })?;
        Ok(spec)
    }
}

/// Writes a GGUF v3 header (no tensor data) for tests and fixtures.
#[must_use]
pub fn write_header(metadata: &[(&str, GgufValue)], tensors: &[(&str, &[u64], u32, u64)]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend(x.to_le_bytes()),
            GgufValue::U16(x) => out.extend(x.to_le_bytes()),
            GgufValue::I16(x) => out.extend(x.to_le_bytes()),
            GgufValue::U32(x) => out.extend(x.to_le_bytes()),
            GgufValue::I32(x) => out.extend(x.to_le_bytes()),
            GgufValue::F32(x) => out.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => string(out, s),
            GgufValue::Array(items) => {
                out.extend(items.first().map_or(4, type_id).to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    value(out, i);
                }
            }
            GgufValue::U64(x) => out.extend(x.to_le_bytes()),
            GgufValue::I64(x) => out.extend(x.to_le_bytes()),
            GgufValue::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        string(&mut out, k);
        out.extend(type_id(v).to_le_bytes());
        value(&mut out, v);
    }
    for (name, dims, ty, offset) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        write_header(
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.block_count", GgufValue::U32(2)),
                ("llama.rope.freq_base", GgufValue::F32(500_000.0)),
                (
                    "tokenizer.ggml.tokens",
                    GgufValue::Array(vec![GgufValue::String("a".into()), GgufValue::String("b".into())]),
                ),
                ("general.alignment", GgufValue::U32(32)),
            ],
            &[
                ("token_embd.weight", &[4096, 128_256], 14, 0),
                ("blk.0.attn_q.weight", &[4096, 4096], 2, 430_964_736),
            ],
        )
    }

    fn parse_bytes(b: &[u8]) -> Result<GgufHeader, GgufError> {
        // Pretend the file is as large as a real model, so tensor sizes pass the size check.
        parse("m.gguf", b, b.len() as u64 + (1 << 34), 0)
    }

    /// Fuzzing found it: a tensor whose element count fits in 64 bits but whose bytes do not (2^62 f32
    /// elements) overflowed in `DType::tensor_bytes`.
    #[test]
    fn tensor_bytes_over_64_bits_is_an_error() {
        let b = write_header(&[], &[("big.weight", &[1 << 32, 1 << 30], 0, 0)]);
        let e = parse_bytes(&b).unwrap_err().to_string();
        assert!(e.contains("tensor `big.weight` dims") && e.contains("do not fit in 2^64 bytes"), "{e}");
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let h = parse_bytes(&sample()).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("llama.block_count").and_then(GgufValue::as_u64), Some(2));
        assert_eq!(h.get("llama.rope.freq_base").and_then(GgufValue::as_f64), Some(500_000.0));
        let t = &h.tensors[0];
        assert_eq!((t.dtype, t.bytes), (Some(DType::Q6K), 4096 / 256 * 210 * 128_256));
        assert_eq!(h.tensors[1].bytes, 4096 * 4096 / 32 * 18);
    }

    #[test]
    fn errors_name_file_offset_and_field() {
        let b = sample();
        let e = parse_bytes(&b[..b.len() - 3]).unwrap_err().to_string();
        assert!(e.contains("m.gguf") && e.contains("truncated") && e.contains("blk.0.attn_q.weight"), "{e}");
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(matches!(parse_bytes(&bad), Err(GgufError::Magic { .. })));
        let mut big = b.clone();
        big[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(matches!(parse_bytes(&big), Err(GgufError::BigEndian { .. })));
        // The header is whole but the data of the last tensor is cut off.
        let e = parse("m.gguf", &b[..], b.len() as u64 + 1000, 0).unwrap_err().to_string();
        assert!(e.contains("token_embd.weight` data") && e.contains("re-download"), "{e}");
        let mut v1 = b.clone();
        v1[4] = 1;
        assert!(parse_bytes(&v1).unwrap_err().to_string().contains("version 1"));
        // A tensor count that the file cannot hold is refused before any allocation.
        let mut huge = b.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse("m.gguf", &huge[..], huge.len() as u64, 0).unwrap_err().to_string();
        assert!(e.contains("tensor_count") && e.contains("bytes left"), "{e}");
        let unaligned = write_header(&[], &[("x", &[32], 0, 7)]);
        assert!(parse_bytes(&unaligned).unwrap_err().to_string().contains("alignment 32"));
        let odd_row = write_header(&[], &[("x", &[100, 2], 12, 0)]);
        assert!(parse_bytes(&odd_row).unwrap_err().to_string().contains("multiple of 256"));
        let unknown = write_header(&[], &[("x", &[32], 20, 0)]);
        assert!(parse_bytes(&unknown).unwrap_err().to_string().contains("does not model"));
    }

    /// Every value type of the GGUF v3 spec (0..=12), nested arrays included, reads back as written, and
    /// `general.alignment` moves where tensor data may start.
    #[test]
    fn every_metadata_type_round_trips() {
        let all = vec![
            ("t.u8", GgufValue::U8(200)),
            ("t.i8", GgufValue::I8(-100)),
            ("t.u16", GgufValue::U16(60_000)),
            ("t.i16", GgufValue::I16(-30_000)),
            ("t.u32", GgufValue::U32(4_000_000_000)),
            ("t.i32", GgufValue::I32(-2_000_000_000)),
            ("t.f32", GgufValue::F32(1.5e-5)),
            ("t.bool", GgufValue::Bool(true)),
            ("t.string", GgufValue::String("héllo".into())),
            (
                "t.array",
                GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::I16(-1), GgufValue::I16(2)])]),
            ),
            ("t.u64", GgufValue::U64(u64::MAX)),
            ("t.i64", GgufValue::I64(i64::MIN)),
            ("t.f64", GgufValue::F64(-2.5e300)),
            ("general.alignment", GgufValue::U32(64)),
        ];
        let bytes = write_header(&all, &[("x", &[32], 0, 64)]);
        let h = parse_bytes(&bytes).unwrap();
        assert_eq!(h.metadata, all.iter().map(|(k, v)| ((*k).to_string(), v.clone())).collect::<Vec<_>>());
        assert_eq!((h.alignment, h.tensors[0].offset), (64, 64));
        let e = parse_bytes(&write_header(&all, &[("x", &[32], 0, 32)])).unwrap_err().to_string();
        assert!(e.contains("alignment 64"), "{e}");
        let odd = write_header(&[("general.alignment", GgufValue::U32(48))], &[]);
        assert!(parse_bytes(&odd).unwrap_err().to_string().contains("power of two"));
    }

    /// Fuzzing found it: a `block_count` of hundreds of millions made the inventory run out of memory.
    #[test]
    fn model_spec_rejects_more_layers_than_any_model() {
        let meta = |layers: u32| {
            write_header(
                &[
                    ("general.architecture", GgufValue::String("llama".into())),
                    ("llama.block_count", GgufValue::U32(layers)),
                    ("llama.embedding_length", GgufValue::U32(64)),
                    ("llama.feed_forward_length", GgufValue::U32(128)),
                    ("llama.attention.head_count", GgufValue::U32(4)),
                    ("llama.vocab_size", GgufValue::U32(100)),
                ],
                &[],
            )
        };
        // Two layers pass the limit; what stops this header then is that it holds no tensors.
        let small = parse_bytes(&meta(2)).unwrap().model_spec("m").unwrap_err().to_string();
        assert!(small.contains("token_embd.weight") && small.contains("missing"), "{small}");
        let e = parse_bytes(&meta(888_888_880)).unwrap().model_spec("m").unwrap_err().to_string();
        assert!(
            e.contains("llama.block_count") && e.contains("888888880") && e.contains("at most 512"),
            "{e}"
        );
    }

    #[test]
    fn split_names_are_recognised() {
        assert_eq!(split_parts(Path::new("/m/Q2_K-00002-of-00003.gguf")), Some(("Q2_K".into(), 2, 3)));
        assert_eq!(split_parts(Path::new("model.gguf")), None);
    }

    #[test]
    fn split_files_merge() {
        let dir = std::env::temp_dir().join(format!("gguf-split-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Each part carries (zeroed) data for its tensors, so their sizes fit the file.
        let with_data = |mut h: Vec<u8>| {
            h.resize(h.len() + 512, 0);
            h
        };
        let a = with_data(write_header(&[("split.count", GgufValue::U16(2))], &[("a", &[32], 0, 0)]));
        let b = with_data(write_header(&[("split.count", GgufValue::U16(2))], &[("b", &[64], 0, 0)]));
        std::fs::write(dir.join("m-00001-of-00002.gguf"), a).unwrap();
        let e = read_header(&dir.join("m-00001-of-00002.gguf")).unwrap_err();
        assert!(matches!(e, GgufError::MissingSplit { found: 2, .. }), "{e}");
        std::fs::write(dir.join("m-00002-of-00002.gguf"), b).unwrap();
        let h = read_header(&dir.join("m-00002-of-00002.gguf")).unwrap();
        assert_eq!(
            h.tensors.iter().map(|t| (t.name.as_str(), t.split)).collect::<Vec<_>>(),
            vec![("a", 0), ("b", 1)]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        /// Arbitrary bytes, and every truncation or single-byte corruption of a valid header, give an error or
        /// a header — never a panic.
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), cut in 0usize..400, at in 0usize..400, byte in any::<u8>()) {
            let _ = parse_bytes(&bytes);
            let mut s = sample();
            s.truncate(cut.min(s.len()));
            let _ = parse_bytes(&s);
            let mut s = sample();
            let i = at % s.len();
            s[i] = byte;
            let _ = parse_bytes(&s);
        }
    }
}
