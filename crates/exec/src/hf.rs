//! Export of the executor's weights as a transformers checkpoint (`config.json` + `model.safetensors`), so an
//! independent implementation (PyTorch/transformers on the GPU machine, `scripts/hf_compare.py`) can compute
//! logits from exactly the same numbers.
//!
//! Names follow transformers' Llama/Qwen3/Qwen3-MoE/Nemotron modules ([`pipeshard_core::checkpoint::hf_name`],
//! the table the checkpoint reader uses in reverse; experts one module each, the classic checkpoint layout, which
//! `scripts/hf_compare.py` fuses where transformers keeps them as 3-D tensors). Mistral-style models (nemo-8b)
//! are exported as
//! `llama` with an explicit `head_dim`: without a sliding window the two compute the same function. Nemotron's
//! `layernorm1p` stores `weight − 1` (exact in f32 for weights in [0.5, 2]).

use std::collections::HashMap;
use std::path::Path;

use pipeshard_core::checkpoint::hf_name;
use pipeshard_core::model::{FfnKind, NormKind};
use safetensors::tensor::{Dtype, TensorView};

use crate::error::{ExecError, Result};
use crate::host::Elem;
use crate::weights::{Dims, ModelWeights};

/// transformers' `model_type` for the executor's model.
#[must_use]
pub fn model_type(d: &Dims) -> &'static str {
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

/// What transformers stores less than our value of tensor `name`: 1 for nemotron's norm weights
/// (`layernorm1p` stores weight − 1), else 0. Export subtracts it, loading adds it back.
#[must_use]
pub fn norm_offset(d: &Dims, name: &str) -> f32 {
    if model_type(d) == "nemotron" && name.contains("norm.weight") { 1.0 } else { 0.0 }
}

/// transformers `config.json` for the executor's model.
#[must_use]
pub fn config_json(w: &ModelWeights, max_position: usize) -> serde_json::Value {
    let d = &w.dims;
    let mt = model_type(d);
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
    let mut owned: Vec<(String, Owned)> = Vec::new();
    for u in w.units() {
        for t in &u.tensors {
            let Some(name) = hf_name(&t.name, t.expert.map(|e| e as u32)) else {
                return Err(ExecError::UnsupportedModel {
                    model: w.spec.name.clone(),
                    what: format!("tensor {} in a transformers export", t.name),
                    hint: "llama/qwen/qwen3-moe/nemotron only".into(),
                });
            };
            // Quantised matrices go out dequantised (exactly) in f32.
            let (elem, mut data) = match t.quant {
                Some(q) => (
                    Elem::F32,
                    q.dequantize(u.bytes_at(t.offset, t.bytes))
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                ),
                None => (t.elem, u.bytes_at(t.offset, t.bytes).to_vec()),
            };
            let offset = norm_offset(&w.dims, &t.name);
            if offset != 0.0 {
                for i in 0..data.len() / elem.size_bytes() {
                    let v = elem.read(&data, i) - offset;
                    elem.write(&mut data, i, v);
                }
            }
            let dtype = match elem {
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
                    let n = hf_name(&t.name, t.expert.map(|e| e as u32));
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

    /// Exported weights read back through the checkpoint path are the same bytes, the checkpoint's spec has
    /// the same sizes, and the CPU path computes bit-identical logits from them.
    #[test]
    fn exported_checkpoints_load_back_to_identical_logits() {
        use pipeshard_core::checkpoint::Checkpoint;
        use pipeshard_core::inventory::Inventory;
        use pipeshard_core::model::TextConfig;
        use pipeshard_core::plan::Placement;
        use pipeshard_core::workload::Workload;

        use crate::testing::{manual_plan, random_tokens};
        use crate::{RunOptions, run};

        for spec in [tiny_spec(), tiny_nemotron_spec(), tiny_qwen3_spec()] {
            let w = ModelWeights::random(&spec, 9).unwrap();
            let dir =
                std::env::temp_dir().join(format!("pipeshard-load-{}-{}", spec.name, std::process::id()));
            export(&w, &dir, 4096).unwrap();
            let ck = Checkpoint::open(&dir).unwrap();
            let exact = ck.model_spec(&spec.name).unwrap();
            assert_eq!(Inventory::new(&exact).total_bytes(), w.inventory.total_bytes(), "{}", spec.name);
            // config.json carries the f32 epsilon the kernels use.
            assert_eq!((exact.text.norm_eps as f32).to_bits(), (spec.text.norm_eps as f32).to_bits());
            let text = TextConfig { norm_eps: spec.text.norm_eps, ..exact.text.clone() };
            assert_eq!(text, spec.text, "{}: config.json round trip", spec.name);
            let loaded = ModelWeights::from_checkpoint(&spec, &ck).unwrap();
            for (a, b) in w.units().iter().zip(loaded.units()) {
                assert!(a.buf.as_slice() == b.buf.as_slice(), "{}: unit {} differs", spec.name, a.id);
            }
            let wl = Workload::single(12, 64, 3, 8);
            let plan = manual_plan(&spec, wl, 1 << 30, 0, 0, 2, |_, _| Placement::Cpu);
            let prompt = random_tokens(12, w.dims.vocab, 4);
            let opts = RunOptions {
                prompt,
                other_prompts: Vec::new(),
                gen_tokens: 3,
                force_tokens: None,
                keep_logits: true,
                ..RunOptions::default()
            };
            let (a, b) = (run(&w, &plan, None, &opts).unwrap(), run(&loaded, &plan, None, &opts).unwrap());
            assert!(!a.logits.is_empty());
            assert_eq!((a.tokens, a.logits), (b.tokens, b.logits), "{}", spec.name);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Another format converts (f16 checkpoint into bf16 buffers, rounded); a checkpoint of another shape is
    /// refused naming the tensor.
    #[test]
    fn checkpoints_convert_formats_and_refuse_other_shapes() {
        use pipeshard_core::checkpoint::Checkpoint;
        use pipeshard_core::dtype::DType;
        use pipeshard_core::inventory::UnitId;

        let f16_spec = tiny_spec().with_uniform_weights(DType::F16);
        let w = ModelWeights::random(&f16_spec, 2).unwrap();
        let dir = std::env::temp_dir().join(format!("pipeshard-conv-{}", std::process::id()));
        export(&w, &dir, 4096).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let bf = ModelWeights::from_checkpoint(&tiny_spec(), &ck).unwrap();
        let (u16, ubf) =
            (w.unit(UnitId::Ffn { layer: 1 }).unwrap(), bf.unit(UnitId::Ffn { layer: 1 }).unwrap());
        let (t16, tbf) = (u16.tensor("ffn_up.weight").unwrap(), ubf.tensor("ffn_up.weight").unwrap());
        assert_eq!((t16.elem, tbf.elem), (Elem::F16, Elem::Bf16));
        for i in 0..t16.bytes / 2 {
            let x = Elem::F16.read(u16.bytes_at(t16.offset, t16.bytes), i);
            assert_eq!(
                Elem::Bf16.read(ubf.bytes_at(tbf.offset, tbf.bytes), i).to_bits(),
                Elem::Bf16.round(x).to_bits()
            );
        }
        let mut wider = tiny_spec();
        wider.text.ffn = 512;
        let e = ModelWeights::from_checkpoint(&wider, &ck).unwrap_err().to_string();
        assert!(e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[512, 128]"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
