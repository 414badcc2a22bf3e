//! Model specifications: dense decoders, MoE decoders and vision-language models, read from HF `config.json`.
//!
//! A [`ModelSpec`] holds the architecture ([`TextConfig`], optional [`VisionConfig`]) and the storage format of
//! each tensor class ([`WeightFormat`]). Everything downstream (inventory, workload ops, plans) derives from it.
//! Parsing is strict: an unknown `model_type` or a missing or ill-typed field names the file, the field and the
//! value, because a silently defaulted head count gives plausible but wrong VRAM numbers.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dtype::DType;

/// The feed-forward flavour of a dense block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    /// gate, up, down with SiLU(gate) ⊙ up (llama, qwen, mistral).
    SwiGlu,
    /// up, down with ReLU(x)² (nemotron), no gate.
    ReluSquared,
}

/// Normalisation flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    RmsNorm,
    /// LayerNorm with weight and bias (nemotron's `layernorm1p` stores weight − 1; same bytes).
    LayerNorm,
}

/// Mixture-of-experts part of a decoder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub n_experts: u32,
    pub top_k: u32,
    /// Intermediate size of one routed expert.
    pub expert_ffn: u64,
    /// Shared experts applied to every token (0 for Qwen3-MoE).
    pub n_shared_experts: u32,
    /// Intermediate size of the shared-expert block (all shared experts together).
    pub shared_ffn: u64,
    /// The first `leading_dense_layers` layers use a dense FFN of `TextConfig::ffn` instead of experts.
    pub leading_dense_layers: u32,
    /// Whether top-k probabilities are renormalised to sum to one (Qwen3-MoE `norm_topk_prob`).
    pub norm_topk_prob: bool,
}

/// The language decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    pub n_layers: u32,
    pub hidden: u64,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u64,
    /// Dense FFN intermediate size (also of the leading dense layers of an MoE model).
    pub ffn: u64,
    pub ffn_kind: FfnKind,
    pub norm: NormKind,
    pub vocab: u64,
    pub tied_embeddings: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    /// Bias on the q, k, v projections (Qwen2).
    pub qkv_bias: bool,
    pub rope_theta: f64,
    /// Fraction of each head's dimensions that RoPE rotates (nemotron: 0.5).
    pub partial_rotary: f64,
    pub norm_eps: f64,
    pub max_position: u64,
    pub moe: Option<MoeConfig>,
}

/// Most decoder layers a spec may have. Real models stay far below (qwen3-235b: 94), and every layer becomes
/// inventory entries, so a file claiming millions is an error rather than an out-of-memory.
pub const MAX_LAYERS: u32 = 512;
/// Most routed experts per layer (the largest public MoE models have 384).
pub const MAX_EXPERTS: u32 = 512;
/// Most routed experts over all layers (layers × experts; Kimi K2 has 61 × 384 = 23 424): each is an
/// inventory unit.
pub const MAX_EXPERT_UNITS: u64 = 1 << 16;
/// Largest width, head count or vocabulary (2^20; real models stay below 2^18). With these limits every
/// tensor's and the whole model's bytes fit in 64 bits.
pub const MAX_WIDTH: u64 = 1 << 20;

impl TextConfig {
    /// The first field (our name, its value, its limit) over [`MAX_LAYERS`], [`MAX_EXPERTS`],
    /// [`MAX_EXPERT_UNITS`] or [`MAX_WIDTH`]; readers turn it into an error naming the field as their file spells it.
    #[must_use]
    pub fn over_limit(&self) -> Option<(&'static str, u64, u64)> {
        let mut fields = vec![
            ("n_layers", u64::from(self.n_layers), u64::from(MAX_LAYERS)),
            ("hidden", self.hidden, MAX_WIDTH),
            ("n_heads", u64::from(self.n_heads), MAX_WIDTH),
            ("n_kv_heads", u64::from(self.n_kv_heads), MAX_WIDTH),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("ffn", self.ffn, MAX_WIDTH),
            ("vocab", self.vocab, MAX_WIDTH),
        ];
        if let Some(m) = &self.moe {
            fields.extend([
                ("n_experts", u64::from(m.n_experts), u64::from(MAX_EXPERTS)),
                ("n_layers × n_experts", u64::from(self.n_layers) * u64::from(m.n_experts), MAX_EXPERT_UNITS),
                ("expert_ffn", m.expert_ffn, MAX_WIDTH),
                ("shared_ffn", m.shared_ffn, MAX_WIDTH),
            ]);
        }
        fields.into_iter().find(|&(_, v, max)| v > max)
    }
}

/// A ViT vision tower with a patch-merging projector (Qwen2.5-VL).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VisionConfig {
    pub depth: u32,
    pub width: u64,
    pub n_heads: u32,
    pub mlp: u64,
    pub patch: u64,
    pub temporal_patch: u64,
    pub in_channels: u64,
    /// Side of the square of patches merged into one LLM token.
    pub spatial_merge: u64,
    /// Blocks that attend over the whole image; the others attend within windows.
    pub full_attn_blocks: Vec<u32>,
    /// Window side in pixels for windowed blocks.
    pub window_px: u64,
    /// Hidden size of the language model the projector feeds.
    pub out_hidden: u64,
}

/// Storage format per tensor class, as a GGUF file of this model holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFormat {
    pub token_embd: DType,
    pub output: DType,
    pub attn_q: DType,
    pub attn_k: DType,
    pub attn_v: DType,
    pub attn_output: DType,
    pub ffn_gate: DType,
    pub ffn_up: DType,
    pub ffn_down: DType,
    /// `ffn_down` (dense and expert) in llama.cpp's `use_more_bits` layers, where a quantisation mix gives them
    /// more bits; `None` keeps `ffn_down` / `expert_down` everywhere.
    #[serde(default)]
    pub ffn_down_more_bits: Option<DType>,
    /// Routed experts' gate/up; `ffn_gate`/`ffn_up` apply to dense and shared blocks.
    pub expert_gate_up: DType,
    pub expert_down: DType,
    pub router: DType,
    pub vision: DType,
    /// Norm weights and biases.
    pub norms: DType,
}

impl WeightFormat {
    /// One format for every matrix, f32 norms (the usual f16/bf16 export).
    #[must_use]
    pub fn uniform(matrices: DType) -> Self {
        WeightFormat {
            token_embd: matrices,
            output: matrices,
            attn_q: matrices,
            attn_k: matrices,
            attn_v: matrices,
            attn_output: matrices,
            ffn_gate: matrices,
            ffn_up: matrices,
            ffn_down: matrices,
            ffn_down_more_bits: None,
            expert_gate_up: matrices,
            expert_down: matrices,
            router: matrices,
            vision: matrices,
            norms: DType::F32,
        }
    }
}

/// One tensor as a model file stores it: its GGUF-style name, shape (rows first), format and exact bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub bytes: u64,
}

impl WeightFormat {
    /// The format most stored tensors of each class use (a quantisation mix varies some layers; the
    /// inventory takes the exact format of each tensor from [`ModelSpec::stored`]). Classes without tensors
    /// take the format of `attn_q` (f16 if there is none).
    #[must_use]
    pub fn from_stored(stored: &[StoredTensor]) -> WeightFormat {
        let most = |suffix: &str| {
            let mut counts: Vec<(DType, usize)> = Vec::new();
            for t in stored.iter().filter(|t| t.name.ends_with(suffix)) {
                match counts.iter_mut().find(|(d, _)| *d == t.dtype) {
                    Some(c) => c.1 += 1,
                    None => counts.push((t.dtype, 1)),
                }
            }
            counts.into_iter().max_by_key(|c| c.1).map(|c| c.0)
        };
        let matrices = most("attn_q.weight").unwrap_or(DType::F16);
        let fmt = |suffix: &str| most(suffix).unwrap_or(matrices);
        WeightFormat {
            token_embd: fmt("token_embd.weight"),
            output: fmt("output.weight"),
            attn_q: matrices,
            attn_k: fmt("attn_k.weight"),
            attn_v: fmt("attn_v.weight"),
            attn_output: fmt("attn_output.weight"),
            ffn_gate: fmt("ffn_gate.weight"),
            ffn_up: fmt("ffn_up.weight"),
            ffn_down: fmt("ffn_down.weight"),
            ffn_down_more_bits: None,
            expert_gate_up: fmt("ffn_gate_exps.weight"),
            expert_down: fmt("ffn_down_exps.weight"),
            router: fmt("ffn_gate_inp.weight"),
            vision: matrices,
            norms: fmt("attn_norm.weight"),
        }
    }
}

/// A complete model description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub name: String,
    pub text: TextConfig,
    pub vision: Option<VisionConfig>,
    pub weights: WeightFormat,
    /// Every tensor as the model file holds it (GGUF, safetensors), checked against the layout when the file
    /// was read; the inventory takes each tensor's format and bytes from here. Empty for catalog and
    /// `config.json` models, whose formats come from `weights`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stored: Vec<StoredTensor>,
}

impl ModelSpec {
    #[must_use]
    pub fn is_moe(&self) -> bool {
        self.text.moe.is_some()
    }

    /// Whether layer `layer` routes to experts (false for the leading dense layers of an MoE model).
    #[must_use]
    pub fn layer_is_moe(&self, layer: u32) -> bool {
        self.text.moe.as_ref().is_some_and(|m| layer >= m.leading_dense_layers)
    }

    /// K plus V bytes one token adds to one layer's cache in `kv_dtype`.
    #[must_use]
    pub fn kv_bytes_per_token_layer(&self, kv_dtype: DType) -> u64 {
        let elems = 2 * u64::from(self.text.n_kv_heads) * self.text.head_dim;
        kv_dtype.tensor_bytes(elems, 1).unwrap_or(elems * 2)
    }

    /// K plus V bytes one token adds across all layers.
    #[must_use]
    pub fn kv_bytes_per_token(&self, kv_dtype: DType) -> u64 {
        self.kv_bytes_per_token_layer(kv_dtype) * u64::from(self.text.n_layers)
    }

    /// The same model with only its first `n_layers` decoder layers (for quick runs and exhaustive search).
    pub fn truncated(&self, n_layers: u32) -> Result<ModelSpec, ConfigError> {
        if n_layers == 0 || n_layers > self.text.n_layers {
            return Err(ConfigError::Invalid {
                file: self.name.clone(),
                field: "layers".into(),
                value: n_layers.to_string(),
                expected: format!("1..={}", self.text.n_layers),
            });
        }
        let mut spec = self.clone();
        spec.text.n_layers = n_layers;
        spec.name = format!("{}@{}L", self.name, n_layers);
        if let Some(moe) = &mut spec.text.moe {
            moe.leading_dense_layers = moe.leading_dense_layers.min(n_layers);
        }
        Ok(spec)
    }

    /// The same architecture with every matrix stored as `dtype` (norms f32), forgetting the file's formats.
    #[must_use]
    pub fn with_uniform_weights(&self, dtype: DType) -> ModelSpec {
        self.with_weights(WeightFormat::uniform(dtype))
    }

    /// The same model stored in `weights` (what a file's tensors say of their formats no longer applies).
    #[must_use]
    pub fn with_weights(&self, weights: WeightFormat) -> ModelSpec {
        ModelSpec { weights, stored: Vec::new(), ..self.clone() }
    }
}

/// A config file that cannot describe a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {reason}")]
    Io { file: String, reason: String },
    #[error("{file}: not valid JSON: {reason}")]
    Json { file: String, reason: String },
    #[error("{file}: field `{field}` is missing (expected {expected})")]
    Missing { file: String, field: String, expected: String },
    #[error("{file}: field `{field}` has value {value}, expected {expected}")]
    Invalid { file: String, field: String, value: String, expected: String },
    #[error(
        "{file}: model_type `{value}` is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_5_vl, nemotron"
    )]
    UnknownModelType { file: String, value: String },
}

/// Field access on a JSON object that reports errors against a file name and a dotted path.
struct Fields<'a> {
    file: &'a str,
    prefix: &'a str,
    obj: &'a Value,
}

impl<'a> Fields<'a> {
    fn path(&self, field: &str) -> String {
        if self.prefix.is_empty() { field.to_string() } else { format!("{}.{field}", self.prefix) }
    }

    fn missing(&self, field: &str, expected: &str) -> ConfigError {
        ConfigError::Missing { file: self.file.into(), field: self.path(field), expected: expected.into() }
    }

    fn invalid(&self, field: &str, value: &Value, expected: &str) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.into(),
            field: self.path(field),
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    /// A positive integer.
    fn pos(&self, field: &str) -> Result<u64, ConfigError> {
        let v = self.get(field).ok_or_else(|| self.missing(field, "a positive integer"))?;
        match v.as_u64() {
            Some(n) if n > 0 => Ok(n),
            _ => Err(self.invalid(field, v, "a positive integer")),
        }
    }

    fn pos_or(&self, field: &str, default: u64) -> Result<u64, ConfigError> {
        if self.get(field).is_some() { self.pos(field) } else { Ok(default) }
    }

    fn u32_pos(&self, field: &str) -> Result<u32, ConfigError> {
        let n = self.pos(field)?;
        u32::try_from(n).map_err(|_| self.invalid(field, &Value::from(n), "an integer below 2^32"))
    }

    fn uint_or(&self, field: &str, default: u64) -> Result<u64, ConfigError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v.as_u64().ok_or_else(|| self.invalid(field, v, "a non-negative integer")),
        }
    }

    fn float_or(&self, field: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.invalid(field, v, "a positive number")),
            },
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.invalid(field, v, "true or false")),
        }
    }

    fn str(&self, field: &str) -> Result<&'a str, ConfigError> {
        let v = self.get(field).ok_or_else(|| self.missing(field, "a string"))?;
        v.as_str().ok_or_else(|| self.invalid(field, v, "a string"))
    }

    fn object(&self, field: &str) -> Result<&'a Value, ConfigError> {
        let v = self.get(field).ok_or_else(|| self.missing(field, "an object"))?;
        if v.is_object() { Ok(v) } else { Err(self.invalid(field, v, "an object")) }
    }
}

const SUPPORTED: [&str; 7] = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "nemotron"];

/// Parses the architecture of an HF `config.json`. `file` names the source in errors; `weights` gives the
/// storage format (a `config.json` does not say how a GGUF of the model is quantised).
pub fn parse_hf_config(
    file: &str,
    json: &str,
    name: &str,
    weights: WeightFormat,
) -> Result<ModelSpec, ConfigError> {
    let root: Value = serde_json::from_str(json)
        .map_err(|e| ConfigError::Json { file: file.into(), reason: e.to_string() })?;
    if !root.is_object() {
        return Err(ConfigError::Invalid {
            file: file.into(),
            field: "(root)".into(),
            value: root.to_string().chars().take(40).collect(),
            expected: "a JSON object".into(),
        });
    }
    let top = Fields { file, prefix: "", obj: &root };
    let model_type = top.str("model_type")?;
    if !SUPPORTED.contains(&model_type) {
        return Err(ConfigError::UnknownModelType { file: file.into(), value: model_type.into() });
    }
    // Newer transformers nest the Qwen2.5-VL decoder under `text_config`; older files keep it flat.
    let nested = model_type == "qwen2_5_vl" && top.get("text_config").is_some();
    let t = if nested {
        Fields { file, prefix: "text_config", obj: top.object("text_config")? }
    } else {
        Fields { file, prefix: "", obj: &root }
    };
    let hidden = t.pos("hidden_size")?;
    let n_heads = t.u32_pos("num_attention_heads")?;
    let n_kv_heads =
        if t.get("num_key_value_heads").is_some() { t.u32_pos("num_key_value_heads")? } else { n_heads };
    if n_heads % n_kv_heads != 0 {
        return Err(t.invalid(
            "num_key_value_heads",
            &Value::from(n_kv_heads),
            &format!("a divisor of num_attention_heads ({n_heads})"),
        ));
    }
    let default_head_dim = hidden / u64::from(n_heads);
    let head_dim = t.pos_or("head_dim", default_head_dim)?;
    let nemotron = model_type == "nemotron";
    let moe = if model_type == "qwen3_moe" {
        let n_experts = t.u32_pos("num_experts")?;
        let top_k = t.u32_pos("num_experts_per_tok")?;
        if top_k > n_experts {
            return Err(t.invalid(
                "num_experts_per_tok",
                &Value::from(top_k),
                &format!("at most num_experts ({n_experts})"),
            ));
        }
        let step = t.uint_or("decoder_sparse_step", 1)?;
        if step != 1 {
            return Err(t.invalid("decoder_sparse_step", &Value::from(step), "1 (every layer sparse)"));
        }
        let mlp_only = t.get("mlp_only_layers").and_then(Value::as_array).map_or(0, Vec::len);
        if mlp_only != 0 {
            return Err(t.invalid(
                "mlp_only_layers",
                t.get("mlp_only_layers").unwrap_or(&Value::Null),
                "an empty list",
            ));
        }
        Some(MoeConfig {
            n_experts,
            top_k,
            expert_ffn: t.pos("moe_intermediate_size")?,
            n_shared_experts: 0,
            shared_ffn: 0,
            leading_dense_layers: 0,
            norm_topk_prob: t.bool_or("norm_topk_prob", true)?,
        })
    } else {
        None
    };
    let text = TextConfig {
        n_layers: t.u32_pos("num_hidden_layers")?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn: t.pos("intermediate_size")?,
        ffn_kind: if nemotron { FfnKind::ReluSquared } else { FfnKind::SwiGlu },
        norm: if nemotron { NormKind::LayerNorm } else { NormKind::RmsNorm },
        vocab: t.pos("vocab_size")?,
        tied_embeddings: top.bool_or("tie_word_embeddings", false)?,
        qk_norm: matches!(model_type, "qwen3" | "qwen3_moe"),
        qkv_bias: matches!(model_type, "qwen2" | "qwen2_5_vl") || t.bool_or("attention_bias", false)?,
        rope_theta: t.float_or("rope_theta", 10_000.0)?,
        partial_rotary: t.float_or("partial_rotary_factor", 1.0)?,
        norm_eps: if nemotron { t.float_or("norm_eps", 1e-5)? } else { t.float_or("rms_norm_eps", 1e-6)? },
        max_position: t.pos_or("max_position_embeddings", 4096)?,
        moe,
    };
    if let Some((field, value, max)) = text.over_limit() {
        let hf = match field {
            "n_layers" => "num_hidden_layers",
            "hidden" => "hidden_size",
            "n_heads" => "num_attention_heads",
            "n_kv_heads" => "num_key_value_heads",
            "ffn" => "intermediate_size",
            "vocab" => "vocab_size",
            "n_experts" | "n_layers × n_experts" => "num_experts",
            "expert_ffn" => "moe_intermediate_size",
            "shared_ffn" => "shared_expert_intermediate_size",
            other => other,
        };
        return Err(t.invalid(
            hf,
            &Value::from(value),
            &format!("{field} at most {max} (no real model is larger)"),
        ));
    }
    let vision = if model_type == "qwen2_5_vl" { Some(parse_vision(&top, text.hidden)?) } else { None };
    Ok(ModelSpec { name: name.into(), text, vision, weights, stored: Vec::new() })
}

fn parse_vision(top: &Fields<'_>, text_hidden: u64) -> Result<VisionConfig, ConfigError> {
    let obj = top.object("vision_config")?;
    let v = Fields { file: top.file, prefix: "vision_config", obj };
    let depth = v.u32_pos("depth")?;
    let full: Vec<u32> = match v.get("fullatt_block_indexes") {
        None => (0..depth).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| {
                i.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n < depth).ok_or_else(|| {
                    v.invalid("fullatt_block_indexes", i, &format!("block indices below depth ({depth})"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(v.invalid("fullatt_block_indexes", other, "a list of block indices")),
    };
    let width = v.pos("hidden_size")?;
    let n_heads = v.u32_pos("num_heads")?;
    if width % u64::from(n_heads) != 0 {
        return Err(v.invalid(
            "num_heads",
            &Value::from(n_heads),
            &format!("a divisor of hidden_size ({width})"),
        ));
    }
    Ok(VisionConfig {
        depth,
        width,
        n_heads,
        mlp: v.pos("intermediate_size")?,
        patch: v.pos("patch_size")?,
        temporal_patch: v.pos_or("temporal_patch_size", 2)?,
        in_channels: v.pos_or("in_chans", 3)?,
        spatial_merge: v.pos_or("spatial_merge_size", 2)?,
        full_attn_blocks: full,
        window_px: v.pos_or("window_size", 112)?,
        out_hidden: v.pos_or("out_hidden_size", text_hidden)?,
    })
}

/// Reads and parses a `config.json` from disk.
pub fn load_hf_config(path: &Path, name: &str, weights: WeightFormat) -> Result<ModelSpec, ConfigError> {
    let file = path.display().to_string();
    let json = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::Io { file: file.clone(), reason: e.to_string() })?;
    parse_hf_config(&file, &json, name, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
        "num_hidden_layers":2,"intermediate_size":128,"vocab_size":100}"#;

    fn parse(json: &str) -> Result<ModelSpec, ConfigError> {
        parse_hf_config("cfg.json", json, "t", WeightFormat::uniform(DType::Bf16))
    }

    /// Fuzzing found it: `num_hidden_layers` = 888888880 (and any absurd width) made the inventory run out of
    /// memory; the reader now names the field and the limit.
    #[test]
    fn sizes_beyond_any_real_model_are_errors() {
        let e = parse(&LLAMA.replace(r#""num_hidden_layers":2"#, r#""num_hidden_layers":888888880"#))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_hidden_layers") && e.contains("888888880") && e.contains("at most 512"),
            "{e}"
        );
        let e = parse(&LLAMA.replace(r#""vocab_size":100"#, r#""vocab_size":4000000000000"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("vocab_size") && e.contains(&MAX_WIDTH.to_string()), "{e}");
        // 512 layers of 500 experts: each is within its own limit, together 256 000 inventory units.
        let moe = include_str!("../catalog/qwen3-30b-a3b.config.json")
            .replace(r#""num_hidden_layers": 48"#, r#""num_hidden_layers": 512"#)
            .replace(r#""num_experts": 128"#, r#""num_experts": 500"#);
        let e = parse(&moe).unwrap_err().to_string();
        assert!(e.contains("num_experts") && e.contains("n_layers × n_experts at most 65536"), "{e}");
    }

    #[test]
    fn parses_minimal_llama() {
        let m = parse(LLAMA).unwrap();
        assert_eq!(m.text.head_dim, 16);
        assert_eq!(m.text.n_kv_heads, 2);
        assert!(!m.is_moe());
        assert_eq!(m.kv_bytes_per_token_layer(DType::F16), 2 * 2 * 16 * 2);
    }

    #[test]
    fn errors_name_file_field_and_value() {
        let e = parse(&LLAMA.replace("\"num_attention_heads\":4", "\"num_attention_heads\":-3")).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("cfg.json") && s.contains("num_attention_heads") && s.contains("-3"), "{s}");
        let e = parse(&LLAMA.replace("\"vocab_size\":100", "\"x\":1")).unwrap_err();
        assert!(matches!(e, ConfigError::Missing { ref field, .. } if field == "vocab_size"), "{e}");
        let e = parse(&LLAMA.replace("llama", "gpt2")).unwrap_err();
        assert!(e.to_string().contains("gpt2"), "{e}");
        let e = parse(&LLAMA.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3")).unwrap_err();
        assert!(e.to_string().contains("divisor"), "{e}");
        assert!(matches!(parse("[1,2]"), Err(ConfigError::Invalid { .. })));
        assert!(matches!(parse("{"), Err(ConfigError::Json { .. })));
    }

    #[test]
    fn qwen2_has_qkv_bias_and_nested_vl_text_config_is_read() {
        let q2 = LLAMA.replace("llama", "qwen2");
        let m = parse(&q2).unwrap();
        assert!(m.text.qkv_bias && !m.text.qk_norm);
        let vl = r#"{"model_type":"qwen2_5_vl","text_config":{"hidden_size":64,"num_attention_heads":4,
            "num_key_value_heads":2,"num_hidden_layers":2,"intermediate_size":128,"vocab_size":100},
            "vision_config":{"depth":4,"hidden_size":32,"num_heads":4,"intermediate_size":64,"patch_size":14,
            "fullatt_block_indexes":[1,3]}}"#;
        let m = parse(vl).unwrap();
        assert_eq!(m.vision.as_ref().unwrap().full_attn_blocks, vec![1, 3]);
        let e = parse(&vl.replace("[1,3]", "[1,9]")).unwrap_err().to_string();
        assert!(e.contains("vision_config.fullatt_block_indexes") && e.contains('9'), "{e}");
        let e =
            parse(&vl.replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":0")).unwrap_err().to_string();
        assert!(e.contains("text_config.num_hidden_layers"), "{e}");
    }

    #[test]
    fn truncation_keeps_architecture() {
        let m = parse(LLAMA).unwrap();
        assert_eq!(m.truncated(1).unwrap().text.n_layers, 1);
        assert!(m.truncated(3).is_err());
        assert!(m.truncated(0).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_json_never_panics(s in "\\PC{0,200}") {
            let _ = parse(&s);
        }

        #[test]
        fn mutated_fields_never_panic(field in proptest::sample::select(vec!["hidden_size","num_attention_heads","num_hidden_layers","intermediate_size","vocab_size","head_dim","rope_theta","tie_word_embeddings"]),
                                      value in proptest::sample::select(vec!["0","-1","1.5","\"x\"","null","[]","{}","true","18446744073709551615"])) {
            let mut v: Value = serde_json::from_str(LLAMA).unwrap();
            v[field] = serde_json::from_str(value).unwrap();
            let _ = parse(&v.to_string());
        }
    }
}
