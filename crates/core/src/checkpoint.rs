//! HF checkpoints: a folder with `config.json` and safetensors weights (`model.safetensors`, or the shards that
//! `model.safetensors.index.json` lists).
//!
//! [`Checkpoint::open`] reads the safetensors headers only — the 8-byte length and the JSON after it, parsed
//! and checked (contiguous offsets, sizes that match shape × dtype) by the `safetensors` crate — so a 60 GB
//! checkpoint costs a few hundred kB of reads. [`Checkpoint::model_spec`] is the architecture of `config.json`
//! with every tensor's dtype and exact bytes ([`ModelSpec::stored`]) under our names, checked against the
//! layout. [`Checkpoint::tensor`] says where a tensor's bytes lie, for loaders that read them.
//!
//! Names: [`hf_name`] and [`our_name`] translate one table between transformers' Llama/Qwen/Nemotron module
//! names and our GGUF-style names; the routed experts of a Qwen3-MoE layer (one tensor per expert in
//! transformers) become our merged `ffn_*_exps` tensors. Vision towers are not mapped.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::dtype::DType;
use crate::inventory::Inventory;
use crate::model::{ConfigError, ModelSpec, StoredTensor, WeightFormat, load_hf_config};

/// Our name and transformers' name of each per-layer tensor (after `blk.N.` and `model.layers.N.`).
const LAYER_NAMES: [(&str, &str); 17] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_norm.bias", "input_layernorm.bias"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_norm.bias", "post_attention_layernorm.bias"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("ffn_gate_inp.weight", "mlp.gate.weight"),
];

/// Our name and transformers' name of the tensors outside the layers.
const GLOBAL_NAMES: [(&str, &str); 4] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output_norm.bias", "model.norm.bias"),
    ("output.weight", "lm_head.weight"),
];

/// Routed-expert projections: transformers' `mlp.experts.E.{proj}` and our merged tensor.
const EXPERT_NAMES: [(&str, &str); 3] = [
    ("gate_proj.weight", "ffn_gate_exps.weight"),
    ("up_proj.weight", "ffn_up_exps.weight"),
    ("down_proj.weight", "ffn_down_exps.weight"),
];

/// The transformers name of one of our tensors (`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`);
/// `expert` names one expert's slice of a merged `*_exps` tensor (`blk.1.ffn_up_exps.weight`, 5 →
/// `model.layers.1.mlp.experts.5.up_proj.weight`).
#[must_use]
pub fn hf_name(name: &str, expert: Option<u32>) -> Option<String> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(ours, _)| *ours == name) {
        return Some((*hf).to_string());
    }
    let (layer, tail) = name.strip_prefix("blk.")?.split_once('.')?;
    if let Some(e) = expert {
        let (proj, _) = EXPERT_NAMES.iter().find(|(_, ours)| *ours == tail)?;
        return Some(format!("model.layers.{layer}.mlp.experts.{e}.{proj}"));
    }
    let (_, hf) = LAYER_NAMES.iter().find(|(ours, _)| *ours == tail)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Our name of a transformers tensor, the reverse of [`hf_name`]; routed experts map to their merged tensor
/// and expert index (`model.layers.2.mlp.experts.7.up_proj.weight` → (`blk.2.ffn_up_exps.weight`, 7)).
#[must_use]
pub fn our_name(hf: &str) -> Option<(String, Option<u32>)> {
    if let Some((ours, _)) = GLOBAL_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(((*ours).to_string(), None));
    }
    let (layer, tail) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    if let Some((expert, proj)) = tail.strip_prefix("mlp.experts.").and_then(|t| t.split_once('.')) {
        let (_, ours) = EXPERT_NAMES.iter().find(|(h, _)| *h == proj)?;
        return Some((format!("blk.{layer}.{ours}"), Some(expert.parse().ok()?)));
    }
    let (ours, _) = LAYER_NAMES.iter().find(|(_, h)| *h == tail)?;
    Some((format!("blk.{layer}.{ours}"), None))
}

/// A checkpoint that cannot describe a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("{file}: cannot read: {reason}")]
    Io { file: String, reason: String },
    #[error("{file}: not a safetensors file: {reason}")]
    Header { file: String, reason: String },
    #[error("{dir}: no `model.safetensors` or `model.safetensors.index.json`; {fix}")]
    NoWeights { dir: String, fix: String },
    #[error("{file}: tensor `{tensor}` {value}: {problem}")]
    Tensor { file: String, tensor: String, value: String, problem: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// One tensor of a checkpoint and where its bytes lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointTensor {
    /// transformers name.
    pub hf_name: String,
    /// The shard that holds it.
    pub file: PathBuf,
    pub dtype: Dtype,
    /// Rows first, as safetensors stores it.
    pub shape: Vec<u64>,
    /// Offset of the first byte from the start of the file.
    pub file_offset: u64,
    pub bytes: u64,
}

/// An HF checkpoint folder: its `config.json` and every tensor of its safetensors files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub config: PathBuf,
    /// By transformers name.
    pub tensors: BTreeMap<String, CheckpointTensor>,
}

/// Largest header the safetensors crate accepts.
const MAX_HEADER_BYTES: u64 = 100_000_000;

fn io_err(path: &Path, e: &std::io::Error) -> CheckpointError {
    CheckpointError::Io { file: path.display().to_string(), reason: e.to_string() }
}

/// Reads the header of one safetensors file.
fn read_header(path: &Path) -> Result<Vec<CheckpointTensor>, CheckpointError> {
    let header = |reason: String| CheckpointError::Header { file: path.display().to_string(), reason };
    let mut f = File::open(path).map_err(|e| io_err(path, &e))?;
    let len = f.metadata().map_err(|e| io_err(path, &e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| header(format!("{len} bytes, shorter than the 8-byte header length")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || 8 + n > len {
        return Err(header(format!("header length {n} does not fit the file of {len} bytes")));
    }
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json).map_err(|e| io_err(path, &e))?;
    let meta: Metadata = serde_json::from_slice(&json).map_err(|e| header(e.to_string()))?;
    let data_start = 8 + n;
    if data_start + meta.data_len() as u64 > len {
        return Err(header(format!(
            "its tensors need {} bytes after the header but the file has {} (truncated: re-download it)",
            meta.data_len(),
            len - data_start
        )));
    }
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| CheckpointTensor {
            hf_name: name,
            file: path.to_path_buf(),
            dtype: info.dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            file_offset: data_start + info.data_offsets.0 as u64,
            bytes: (info.data_offsets.1 - info.data_offsets.0) as u64,
        })
        .collect())
}

/// Our format for a safetensors dtype.
fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::BF16 => Some(DType::Bf16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F32 => Some(DType::F32),
        _ => None,
    }
}

impl Checkpoint {
    /// Reads `dir/config.json` and the headers of its safetensors files.
    pub fn open(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(CheckpointError::Io {
                file: config.display().to_string(),
                reason: "missing: an HF checkpoint folder holds config.json next to its safetensors".into(),
            });
        }
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut tensors = BTreeMap::new();
        if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, &e))?;
            let bad = |reason: String| CheckpointError::Header { file: index.display().to_string(), reason };
            let root: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map = root
                .get("weight_map")
                .and_then(serde_json::Value::as_object)
                .ok_or_else(|| bad("field `weight_map` is missing or not an object of name → file".into()))?;
            let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (name, file) in map {
                let file = file
                    .as_str()
                    .filter(|f| !f.contains('/') && !f.contains('\\'))
                    .ok_or_else(|| bad(format!("weight_map `{name}` is {file}, expected a file name")))?;
                shards.entry(file).or_default().push(name);
            }
            for (file, names) in shards {
                let path = dir.join(file);
                let found: BTreeMap<String, CheckpointTensor> =
                    read_header(&path)?.into_iter().map(|t| (t.hf_name.clone(), t)).collect();
                if let Some(missing) = names.iter().find(|n| !found.contains_key(**n)) {
                    return Err(bad(format!("weight_map puts `{missing}` in {file}, whose header lacks it")));
                }
                tensors.extend(found);
            }
        } else if single.is_file() {
            tensors.extend(read_header(&single)?.into_iter().map(|t| (t.hf_name.clone(), t)));
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.display().to_string(),
                fix: format!(
                    "to plan from the architecture alone, pass {} (matrices then take --weights)",
                    config.display()
                ),
            });
        }
        Ok(Checkpoint { config, tensors })
    }

    /// The model named `name`: `config.json`'s architecture, every tensor's format and bytes from the
    /// safetensors headers, checked against the layout.
    pub fn model_spec(&self, name: &str) -> Result<ModelSpec, CheckpointError> {
        let mut stored: BTreeMap<String, StoredTensor> = BTreeMap::new();
        // Merged expert tensors: experts seen, and the shape and format every expert must share.
        let mut experts: BTreeMap<String, (u32, Vec<u64>, DType)> = BTreeMap::new();
        for t in self.tensors.values() {
            let err = |value: String, problem: &str| CheckpointError::Tensor {
                file: t.file.display().to_string(),
                tensor: t.hf_name.clone(),
                value,
                problem: problem.into(),
            };
            if t.hf_name.ends_with("rotary_emb.inv_freq") {
                continue; // Older exports save RoPE frequencies that are computed from config.json.
            }
            let Some((ours, expert)) = our_name(&t.hf_name) else {
                return Err(err(
                    String::new(),
                    "has no counterpart in our layout (llama, mistral, qwen2, qwen3, qwen3_moe and nemotron text decoders are mapped)",
                ));
            };
            let dtype = dtype_of(t.dtype).ok_or_else(|| {
                err(
                    format!("{:?}", t.dtype),
                    "is not bf16, f16 or f32; convert the checkpoint to one of those",
                )
            })?;
            if expert.is_none() {
                stored.insert(
                    ours.clone(),
                    StoredTensor { name: ours, shape: t.shape.clone(), dtype, bytes: t.bytes },
                );
                continue;
            }
            let e = experts.entry(ours.clone()).or_insert((0, t.shape.clone(), dtype));
            if (e.1.as_slice(), e.2) != (t.shape.as_slice(), dtype) {
                return Err(err(
                    format!("{:?} {dtype}", t.shape),
                    &format!("differs from the other experts of {ours} ({:?} {})", e.1, e.2),
                ));
            }
            e.0 += 1;
            let s = stored.entry(ours.clone()).or_insert(StoredTensor {
                name: ours,
                shape: Vec::new(),
                dtype,
                bytes: 0,
            });
            s.bytes += t.bytes;
        }
        for (name, (count, shape, _)) in experts {
            let s = stored.get_mut(&name).expect("inserted with the experts");
            s.shape = std::iter::once(u64::from(count)).chain(shape).collect();
        }
        let stored: Vec<StoredTensor> = stored.into_values().collect();
        let weights = WeightFormat::from_stored(&stored);
        let spec = ModelSpec { stored, ..load_hf_config(&self.config, name, weights)? };
        Inventory::check_stored(&spec).map_err(|m| CheckpointError::Tensor {
            file: self.config.display().to_string(),
            tensor: hf_name(&m.tensor, None).unwrap_or(m.tensor),
            value: m.value,
            problem: m.problem,
        })?;
        Ok(spec)
    }

    /// The checkpoint tensor holding our tensor `name` (dense tensors only: experts are one tensor each).
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&CheckpointTensor> {
        self.tensors.get(&hf_name(name, None)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_translate_both_ways() {
        assert_eq!(hf_name("blk.12.ffn_down.weight", None).unwrap(), "model.layers.12.mlp.down_proj.weight");
        assert_eq!(hf_name("output.weight", None).unwrap(), "lm_head.weight");
        for (ours, _) in LAYER_NAMES {
            let name = format!("blk.3.{ours}");
            assert_eq!(our_name(&hf_name(&name, None).unwrap()), Some((name, None)));
        }
        assert_eq!(
            our_name("model.layers.2.mlp.experts.7.up_proj.weight"),
            Some(("blk.2.ffn_up_exps.weight".into(), Some(7)))
        );
        assert_eq!(our_name("model.visual.blocks.0.attn.qkv.weight"), None);
    }

    const CONFIG: &str = r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
        "intermediate_size":128,"num_hidden_layers":2,"vocab_size":96,"tie_word_embeddings":false}"#;

    /// Writes a checkpoint of `CONFIG` whose matrices are bf16 and norms f32 (zeros), in `shards` files;
    /// `edit` may change the (name, dtype, shape) list first.
    fn write(dir: &Path, shards: usize, edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>)>)) {
        use safetensors::tensor::TensorView;
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), CONFIG).unwrap();
        let spec =
            crate::model::parse_hf_config("c", CONFIG, "x", WeightFormat::uniform(DType::Bf16)).unwrap();
        let mut list: Vec<(String, Dtype, Vec<usize>)> = Inventory::new(&spec)
            .tensors
            .iter()
            .map(|t| {
                let dt = if t.dtype == DType::F32 { Dtype::F32 } else { Dtype::BF16 };
                (hf_name(&t.name, None).unwrap(), dt, t.shape.iter().map(|&d| d as usize).collect())
            })
            .collect();
        edit(&mut list);
        let data: Vec<Vec<u8>> =
            list.iter().map(|(_, dt, s)| vec![0u8; s.iter().product::<usize>() * dt.bitsize() / 8]).collect();
        let mut weight_map = serde_json::Map::new();
        let per = list.len().div_ceil(shards);
        for (i, chunk) in list.chunks(per).enumerate() {
            let file = if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
            };
            let views: Vec<(String, TensorView<'_>)> = chunk
                .iter()
                .enumerate()
                .map(|(j, (n, dt, s))| {
                    weight_map.insert(n.clone(), file.clone().into());
                    (n.clone(), TensorView::new(*dt, s.clone(), &data[i * per + j]).unwrap())
                })
                .collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        }
        if shards > 1 {
            let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        }
    }

    fn temp(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("pipeshard-ckpt-{tag}-{}", std::process::id()))
    }

    #[test]
    fn checkpoints_give_exact_dtypes_and_bytes_single_or_sharded() {
        for shards in [1, 3] {
            let dir = temp(&format!("ok{shards}"));
            write(&dir, shards, |_| {});
            let ck = Checkpoint::open(&dir).unwrap();
            let spec = ck.model_spec("tiny").unwrap();
            let file_bytes: u64 = ck.tensors.values().map(|t| t.bytes).sum();
            let inv = Inventory::new(&spec);
            assert_eq!(inv.total_bytes(), file_bytes, "{shards} shards");
            assert_eq!(inv.tensors.len(), ck.tensors.len());
            assert_eq!(spec.weights.attn_q, DType::Bf16);
            assert_eq!(spec.weights.norms, DType::F32);
            let q = ck.tensor("blk.1.attn_q.weight").unwrap();
            assert_eq!((q.shape.as_slice(), q.bytes), (&[64u64, 64][..], 64 * 64 * 2));
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn bad_checkpoints_name_the_tensor_and_the_fix() {
        let dir = temp("missing");
        write(&dir, 1, |l| l.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight"));
        let e = Checkpoint::open(&dir).unwrap().model_spec("x").unwrap_err().to_string();
        assert!(e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("missing"), "{e}");
        write(&dir, 1, |l| l[0].1 = Dtype::I8);
        let e = Checkpoint::open(&dir).unwrap().model_spec("x").unwrap_err().to_string();
        assert!(e.contains("I8") && e.contains("convert"), "{e}");
        write(&dir, 1, |l| l.push(("model.vision.proj.weight".into(), Dtype::F32, vec![4])));
        let e = Checkpoint::open(&dir).unwrap().model_spec("x").unwrap_err().to_string();
        assert!(e.contains("model.vision.proj.weight") && e.contains("no counterpart"), "{e}");
        write(&dir, 1, |_| {});
        let st = dir.join("model.safetensors");
        let bytes = std::fs::read(&st).unwrap();
        std::fs::write(&st, &bytes[..bytes.len() - 10]).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        std::fs::write(&st, &bytes[..5]).unwrap();
        assert!(Checkpoint::open(&dir).unwrap_err().to_string().contains("8-byte"));
        std::fs::remove_file(&st).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("--weights"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
