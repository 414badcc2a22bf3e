//! Export of the executor's weights as a transformers checkpoint (`config.json` + `model.safetensors`), so an
//! independent implementation (PyTorch/transformers on the GPU machine, `scripts/hf_compare.py`) can compute
//! logits from exactly the same numbers.
//!
//! Names follow transformers' Llama/Qwen3/Qwen3-MoE/Nemotron modules (experts one module each, the classic
//! checkpoint layout; `scripts/hf_compare.py` fuses them where transformers keeps them as 3-D tensors). Mistral-style models (nemo-8b) are exported as
//! `llama` with an explicit `head_dim`: without a sliding window the two compute the same function. Nemotron's
//! `layernorm1p` stores `weight − 1` (exact in f32 for weights in [0.5, 2]).

use std::collections::HashMap;
use std::path::Path;

use pipeshard_core::model::{FfnKind, NormKind};
use safetensors::tensor::{Dtype, TensorView};

use crate::error::{ExecError, Result};
use crate::host::Elem;
use crate::weights::ModelWeights;

/// transformers' `model_type` for the executor's model.
#[must_use]
pub fn model_type(w: &ModelWeights) -> &'static str {
    let d = &w.dims;
    if d.moe.is_some() {
        "qwen3_moe"
    } else if d.norm == NormKind::LayerNorm && d.ffn_kind == FfnKind::ReluSquared {
        "nemotron"
    } else if d.qk_norm {
        "qwen3"
    } else if d.qkv_bias {
        "qwen2"
    } else {
        "llama"
    }
}

/// The transformers name of one of our tensors (`expert`: which expert's slice of a merged `*_exps` tensor).
#[must_use]
pub fn hf_name(name: &str, expert: Option<usize>) -> Option<String> {
    let map = |s: &str| -> Option<&'static str> {
        Some(match s {
            "attn_norm.weight" => "input_layernorm.weight",
            "attn_norm.bias" => "input_layernorm.bias",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_q.bias" => "self_attn.q_proj.bias",
            "attn_k.bias" => "self_attn.k_proj.bias",
            "attn_v.bias" => "self_attn.v_proj.bias",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "attn_q_norm.weight" => "self_attn.q_norm.weight",
            "attn_k_norm.weight" => "self_attn.k_norm.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "ffn_norm.bias" => "post_attention_layernorm.bias",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            "ffn_gate_inp.weight" => "mlp.gate.weight",
            _ => return None,
        })
    };
    let expert_proj = |s: &str| -> Option<&'static str> {
        Some(match s {
            "ffn_gate_exps.weight" => "gate_proj",
            "ffn_up_exps.weight" => "up_proj",
            "ffn_down_exps.weight" => "down_proj",
            _ => return None,
        })
    };
    match name {
        "token_embd.weight" => Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => Some("model.norm.weight".into()),
        "output_norm.bias" => Some("model.norm.bias".into()),
        "output.weight" => Some("lm_head.weight".into()),
        _ => {
            let rest = name.strip_prefix("blk.")?;
            let (layer, tail) = rest.split_once('.')?;
            match expert {
                Some(e) => {
                    Some(format!("model.layers.{layer}.mlp.experts.{e}.{}.weight", expert_proj(tail)?))
                }
                None => Some(format!("model.layers.{layer}.{}", map(tail)?)),
            }
        }
    }
}

/// transformers `config.json` for the executor's model.
#[must_use]
pub fn config_json(w: &ModelWeights, max_position: usize) -> serde_json::Value {
    let d = &w.dims;
    let mt = model_type(w);
    let mut c = serde_json::json!({
        "model_type": mt,
        "architectures": [match mt { "nemotron" => "NemotronForCausalLM", "qwen3" => "Qwen3ForCausalLM", "qwen3_moe" => "Qwen3MoeForCausalLM", "qwen2" => "Qwen2ForCausalLM", _ => "LlamaForCausalLM" }],
        "hidden_size": d.hidden,
        "intermediate_size": d.ffn,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_heads,
        "num_key_value_heads": d.n_kv_heads,
        "head_dim": d.head_dim,
        "vocab_size": d.vocab,
        "max_position_embeddings": max_position,
        "rope_theta": d.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "tie_word_embeddings": false,
        "attention_bias": d.qkv_bias,
        "mlp_bias": false,
        "torch_dtype": "float32",
    });
    let obj = c.as_object_mut().expect("object");
    if let Some(moe) = d.moe {
        obj.insert("num_experts".into(), moe.n_experts.into());
        obj.insert("num_experts_per_tok".into(), moe.top_k.into());
        obj.insert("moe_intermediate_size".into(), moe.expert_ffn.into());
        obj.insert("norm_topk_prob".into(), moe.norm_topk_prob.into());
        obj.insert("decoder_sparse_step".into(), 1.into());
        obj.insert("mlp_only_layers".into(), serde_json::json!([]));
        obj.insert("output_router_logits".into(), false.into());
    }
    if mt == "nemotron" {
        obj.insert("norm_eps".into(), d.norm_eps.into());
        obj.insert("partial_rotary_factor".into(), (d.rot_dims as f64 / d.head_dim as f64).into());
        obj.insert("hidden_act".into(), "relu2".into());
    } else {
        obj.insert("rms_norm_eps".into(), d.norm_eps.into());
        obj.insert("hidden_act".into(), "silu".into());
    }
    c
}

struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Writes `config.json` and `model.safetensors` for `w` into `dir`.
pub fn export(w: &ModelWeights, dir: &Path, max_position: usize) -> Result<()> {
    let io = |path: &Path, e: &dyn std::fmt::Display| ExecError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, &e))?;
    let nemotron = model_type(w) == "nemotron";
    let mut owned: Vec<(String, Owned)> = Vec::new();
    for u in w.units() {
        for t in &u.tensors {
            let Some(name) = hf_name(&t.name, t.expert) else {
                return Err(ExecError::UnsupportedModel {
                    model: w.spec.name.clone(),
                    what: format!("tensor {} in a transformers export", t.name),
                    hint: "llama/qwen/qwen3-moe/nemotron only".into(),
                });
            };
            let mut data = u.bytes_at(t.offset, t.bytes).to_vec();
            if nemotron && t.name.contains("norm.weight") {
                for i in 0..t.bytes / 4 {
                    let v = Elem::F32.read(&data, i) - 1.0;
                    Elem::F32.write(&mut data, i, v);
                }
            }
            let dtype = match t.elem {
                Elem::F32 => Dtype::F32,
                Elem::F16 => Dtype::F16,
                Elem::Bf16 => Dtype::BF16,
            };
            owned.push((name, Owned { dtype, shape: t.shape.clone(), data }));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, o)| {
            Ok((n.clone(), TensorView::new(o.dtype, o.shape.clone(), &o.data).map_err(|e| io(dir, &e))?))
        })
        .collect::<Result<_>>()?;
    let st = dir.join("model.safetensors");
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(meta), &st).map_err(|e| io(&st, &e))?;
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, serde_json::to_string_pretty(&config_json(w, max_position)).expect("json"))
        .map_err(|e| io(&cfg, &e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{tiny_nemotron_spec, tiny_qwen3_moe_spec, tiny_qwen3_spec, tiny_spec};

    #[test]
    fn every_tensor_has_a_transformers_name() {
        for spec in [tiny_spec(), tiny_nemotron_spec(), tiny_qwen3_spec(), tiny_qwen3_moe_spec()] {
            let w = ModelWeights::random(&spec, 1).unwrap();
            let mut names = std::collections::HashSet::new();
            for u in w.units() {
                for t in &u.tensors {
                    let n = hf_name(&t.name, t.expert);
                    assert!(n.as_ref().is_some_and(|n| names.insert(n.clone())), "{} {:?}", t.name, n);
                }
            }
        }
        assert_eq!(hf_name("blk.12.ffn_down.weight", None).unwrap(), "model.layers.12.mlp.down_proj.weight");
        assert_eq!(
            hf_name("blk.1.ffn_up_exps.weight", Some(5)).unwrap(),
            "model.layers.1.mlp.experts.5.up_proj.weight"
        );
        assert_eq!(hf_name("blk.1.ffn_gate_inp.weight", None).unwrap(), "model.layers.1.mlp.gate.weight");
    }

    #[test]
    fn export_writes_a_readable_checkpoint() {
        let w = ModelWeights::random(&tiny_nemotron_spec(), 5).unwrap();
        let dir = std::env::temp_dir().join(format!("pipeshard-hf-{}", std::process::id()));
        export(&w, &dir, 64).unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let norm = st.tensor("model.layers.0.input_layernorm.weight").unwrap();
        let orig = w.unit(pipeshard_core::inventory::UnitId::Attn { layer: 0 }).unwrap();
        let t = orig.tensor("attn_norm.weight").unwrap();
        let want = Elem::F32.read(orig.bytes_at(t.offset, t.bytes), 0) - 1.0;
        assert!((Elem::F32.read(norm.data(), 0) - want).abs() < 1e-7, "layernorm1p stores weight − 1");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["model_type"], "nemotron");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
