//! The tensor inventory of a model and its placement units.
//!
//! [`Inventory::new`] lists every weight tensor of a [`ModelSpec`] under its GGUF name (`blk.3.attn_q.weight`,
//! `blk.7.ffn_gate_exps.weight`, `v.blk.0.attn_qkv.weight` …) with shape, format and exact bytes, and groups them
//! into [`Unit`]s, the granularity at which a plan places weights:
//! - per decoder layer: the attention block (norm, q/k/v/o, q/k norms, biases), then either the dense FFN
//!   block (norm, gate/up/down) or, for MoE layers, the router (norm + gate_inp), each routed expert (its slice
//!   of the merged `*_exps` tensors) and the shared experts; and the layer's KV cache (no weights; its bytes
//!   depend on the context and are computed by the workload);
//! - the token embedding; the output norm with the output head;
//! - for VLMs, the patch embedding, each vision block and the projector (merger).
//!
//! Merged expert tensors are the one case where a tensor spans units: each expert unit owns an equal slice.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::model::{FfnKind, ModelSpec, NormKind};

/// What a tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TokenEmbd,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQNorm,
    AttnKNorm,
    AttnBias,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    Router,
    ExpertGate,
    ExpertUp,
    ExpertDown,
    SharedGate,
    SharedUp,
    SharedDown,
    OutputNorm,
    Output,
    VisionPatchEmbd,
    VisionNorm,
    VisionAttnQkv,
    VisionAttnOut,
    VisionMlpGate,
    VisionMlpUp,
    VisionMlpDown,
    VisionMergerNorm,
    VisionMerger,
}

/// One weight tensor. `shape` is `[rows, row_elems]` for matrices (row-major, `row_elems` = input features)
/// and `[n_experts, rows, row_elems]` for merged expert tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tensor {
    pub name: String,
    pub layer: Option<u32>,
    pub role: Role,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub bytes: u64,
}

impl Tensor {
    /// Number of elements.
    #[must_use]
    pub fn elems(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A placement unit: the granularity at which a plan decides pinned / streamed / CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum UnitId {
    TokenEmbd,
    Attn { layer: u32 },
    Ffn { layer: u32 },
    Router { layer: u32 },
    Expert { layer: u32, expert: u32 },
    SharedExperts { layer: u32 },
    Kv { layer: u32 },
    Output,
    VisionPatchEmbd,
    VisionBlock { block: u32 },
    VisionMerger,
}

impl UnitId {
    /// The decoder layer a unit belongs to, if any.
    #[must_use]
    pub fn layer(self) -> Option<u32> {
        match self {
            UnitId::Attn { layer }
            | UnitId::Ffn { layer }
            | UnitId::Router { layer }
            | UnitId::Expert { layer, .. }
            | UnitId::SharedExperts { layer }
            | UnitId::Kv { layer } => Some(layer),
            _ => None,
        }
    }

    /// Whether the unit belongs to the vision tower.
    #[must_use]
    pub fn is_vision(self) -> bool {
        matches!(self, UnitId::VisionPatchEmbd | UnitId::VisionBlock { .. } | UnitId::VisionMerger)
    }
}

impl fmt::Display for UnitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnitId::TokenEmbd => write!(f, "token_embd"),
            UnitId::Attn { layer } => write!(f, "blk.{layer}.attn"),
            UnitId::Ffn { layer } => write!(f, "blk.{layer}.ffn"),
            UnitId::Router { layer } => write!(f, "blk.{layer}.router"),
            UnitId::Expert { layer, expert } => write!(f, "blk.{layer}.expert.{expert}"),
            UnitId::SharedExperts { layer } => write!(f, "blk.{layer}.shexp"),
            UnitId::Kv { layer } => write!(f, "blk.{layer}.kv"),
            UnitId::Output => write!(f, "output"),
            UnitId::VisionPatchEmbd => write!(f, "v.patch_embd"),
            UnitId::VisionBlock { block } => write!(f, "v.blk.{block}"),
            UnitId::VisionMerger => write!(f, "v.merger"),
        }
    }
}

/// The part of a tensor a unit owns: the whole tensor, or one expert's slice of a merged expert tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPart {
    /// Index into [`Inventory::tensors`].
    pub tensor: usize,
    /// `Some(e)`: expert `e`'s slice (1/n_experts of the tensor).
    pub expert: Option<u32>,
    pub bytes: u64,
}

/// A placement unit with the tensor parts it owns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unit {
    pub id: UnitId,
    pub parts: Vec<TensorPart>,
    /// Weight bytes (0 for KV units, whose size depends on the context).
    pub weight_bytes: u64,
}

/// Every tensor of a model and its placement units, in execution order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    pub tensors: Vec<Tensor>,
    pub units: Vec<Unit>,
    #[serde(skip)]
    index: BTreeMap<UnitId, usize>,
}

struct Builder<'a> {
    spec: &'a ModelSpec,
    tensors: Vec<Tensor>,
    units: Vec<Unit>,
}

impl Builder<'_> {
    /// Adds a tensor stored as `dtype` (falling back to f16 if its rows do not fit the block size, as llama.cpp's
    /// quantizer does) and returns its index.
    fn tensor(
        &mut self,
        name: String,
        layer: Option<u32>,
        role: Role,
        shape: Vec<u64>,
        dtype: DType,
    ) -> usize {
        let row = *shape.last().expect("tensors have at least one dimension");
        let rows: u64 = shape[..shape.len() - 1].iter().product();
        let (dtype, bytes) = match dtype.tensor_bytes(row, rows) {
            Ok(b) => (dtype, b),
            Err(_) => (DType::F16, row * rows * 2),
        };
        self.tensors.push(Tensor { name, layer, role, shape, dtype, bytes });
        self.tensors.len() - 1
    }

    fn unit(&mut self, id: UnitId, tensors: &[usize]) {
        let parts: Vec<TensorPart> = tensors
            .iter()
            .map(|&t| TensorPart { tensor: t, expert: None, bytes: self.tensors[t].bytes })
            .collect();
        let weight_bytes = parts.iter().map(|p| p.bytes).sum();
        self.units.push(Unit { id, parts, weight_bytes });
    }

    fn norm(&mut self, prefix: &str, layer: Option<u32>, role: Role, dim: u64, kind: NormKind) -> Vec<usize> {
        let dt = self.spec.weights.norms;
        let mut v = vec![self.tensor(format!("{prefix}.weight"), layer, role, vec![dim], dt)];
        if kind == NormKind::LayerNorm {
            v.push(self.tensor(format!("{prefix}.bias"), layer, role, vec![dim], dt));
        }
        v
    }

    fn decoder_layer(&mut self, il: u32) {
        let t = &self.spec.text;
        let w = self.spec.weights.clone();
        let l = Some(il);
        let q_dim = u64::from(t.n_heads) * t.head_dim;
        let kv_dim = u64::from(t.n_kv_heads) * t.head_dim;
        let p = format!("blk.{il}");
        let mut attn = self.norm(&format!("{p}.attn_norm"), l, Role::AttnNorm, t.hidden, t.norm);
        attn.push(self.tensor(format!("{p}.attn_q.weight"), l, Role::AttnQ, vec![q_dim, t.hidden], w.attn_q));
        attn.push(self.tensor(
            format!("{p}.attn_k.weight"),
            l,
            Role::AttnK,
            vec![kv_dim, t.hidden],
            w.attn_k,
        ));
        attn.push(self.tensor(
            format!("{p}.attn_v.weight"),
            l,
            Role::AttnV,
            vec![kv_dim, t.hidden],
            w.attn_v,
        ));
        attn.push(self.tensor(
            format!("{p}.attn_output.weight"),
            l,
            Role::AttnOutput,
            vec![t.hidden, q_dim],
            w.attn_output,
        ));
        if t.qk_norm {
            attn.push(self.tensor(
                format!("{p}.attn_q_norm.weight"),
                l,
                Role::AttnQNorm,
                vec![t.head_dim],
                w.norms,
            ));
            attn.push(self.tensor(
                format!("{p}.attn_k_norm.weight"),
                l,
                Role::AttnKNorm,
                vec![t.head_dim],
                w.norms,
            ));
        }
        if t.qkv_bias {
            for (n, d) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                attn.push(self.tensor(format!("{p}.{n}.bias"), l, Role::AttnBias, vec![d], DType::F32));
            }
        }
        self.unit(UnitId::Attn { layer: il }, &attn);

        let down_dtype = if uses_more_bits(il, t.n_layers) {
            w.ffn_down_more_bits.unwrap_or(w.ffn_down)
        } else {
            w.ffn_down
        };
        let ffn_norm = self.norm(&format!("{p}.ffn_norm"), l, Role::FfnNorm, t.hidden, t.norm);
        if let Some(moe) = t.moe.clone().filter(|_| self.spec.layer_is_moe(il)) {
            let mut router = ffn_norm;
            let e = u64::from(moe.n_experts);
            router.push(self.tensor(
                format!("{p}.ffn_gate_inp.weight"),
                l,
                Role::Router,
                vec![e, t.hidden],
                w.router,
            ));
            self.unit(UnitId::Router { layer: il }, &router);
            let down_dtype = if uses_more_bits(il, t.n_layers) {
                w.ffn_down_more_bits.unwrap_or(w.expert_down)
            } else {
                w.expert_down
            };
            let gate = self.tensor(
                format!("{p}.ffn_gate_exps.weight"),
                l,
                Role::ExpertGate,
                vec![e, moe.expert_ffn, t.hidden],
                w.expert_gate_up,
            );
            let up = self.tensor(
                format!("{p}.ffn_up_exps.weight"),
                l,
                Role::ExpertUp,
                vec![e, moe.expert_ffn, t.hidden],
                w.expert_gate_up,
            );
            let down = self.tensor(
                format!("{p}.ffn_down_exps.weight"),
                l,
                Role::ExpertDown,
                vec![e, t.hidden, moe.expert_ffn],
                down_dtype,
            );
            for expert in 0..moe.n_experts {
                let parts: Vec<TensorPart> = [gate, up, down]
                    .into_iter()
                    .map(|ti| TensorPart {
                        tensor: ti,
                        expert: Some(expert),
                        bytes: self.tensors[ti].bytes / e,
                    })
                    .collect();
                let weight_bytes = parts.iter().map(|p| p.bytes).sum();
                self.units.push(Unit { id: UnitId::Expert { layer: il, expert }, parts, weight_bytes });
            }
            if moe.n_shared_experts > 0 {
                let s = moe.shared_ffn;
                let sh = vec![
                    self.tensor(
                        format!("{p}.ffn_gate_shexp.weight"),
                        l,
                        Role::SharedGate,
                        vec![s, t.hidden],
                        w.ffn_gate,
                    ),
                    self.tensor(
                        format!("{p}.ffn_up_shexp.weight"),
                        l,
                        Role::SharedUp,
                        vec![s, t.hidden],
                        w.ffn_up,
                    ),
                    self.tensor(
                        format!("{p}.ffn_down_shexp.weight"),
                        l,
                        Role::SharedDown,
                        vec![t.hidden, s],
                        down_dtype,
                    ),
                ];
                self.unit(UnitId::SharedExperts { layer: il }, &sh);
            }
        } else {
            let mut ffn = ffn_norm;
            if t.ffn_kind == FfnKind::SwiGlu {
                ffn.push(self.tensor(
                    format!("{p}.ffn_gate.weight"),
                    l,
                    Role::FfnGate,
                    vec![t.ffn, t.hidden],
                    w.ffn_gate,
                ));
            }
            ffn.push(self.tensor(
                format!("{p}.ffn_up.weight"),
                l,
                Role::FfnUp,
                vec![t.ffn, t.hidden],
                w.ffn_up,
            ));
            ffn.push(self.tensor(
                format!("{p}.ffn_down.weight"),
                l,
                Role::FfnDown,
                vec![t.hidden, t.ffn],
                down_dtype,
            ));
            self.unit(UnitId::Ffn { layer: il }, &ffn);
        }
        self.units.push(Unit { id: UnitId::Kv { layer: il }, parts: Vec::new(), weight_bytes: 0 });
    }

    fn vision(&mut self) {
        let Some(v) = self.spec.vision.clone() else { return };
        let dt = self.spec.weights.vision;
        let patch_in = v.in_channels * v.temporal_patch * v.patch * v.patch;
        let pe = self.tensor(
            "v.patch_embd.weight".into(),
            None,
            Role::VisionPatchEmbd,
            vec![v.width, patch_in],
            dt,
        );
        self.unit(UnitId::VisionPatchEmbd, &[pe]);
        for b in 0..v.depth {
            let p = format!("v.blk.{b}");
            let mut ts = self.norm(&format!("{p}.ln1"), None, Role::VisionNorm, v.width, NormKind::RmsNorm);
            ts.push(self.tensor(
                format!("{p}.attn_qkv.weight"),
                None,
                Role::VisionAttnQkv,
                vec![3 * v.width, v.width],
                dt,
            ));
            ts.push(self.tensor(
                format!("{p}.attn_qkv.bias"),
                None,
                Role::VisionAttnQkv,
                vec![3 * v.width],
                DType::F32,
            ));
            ts.push(self.tensor(
                format!("{p}.attn_out.weight"),
                None,
                Role::VisionAttnOut,
                vec![v.width, v.width],
                dt,
            ));
            ts.push(self.tensor(
                format!("{p}.attn_out.bias"),
                None,
                Role::VisionAttnOut,
                vec![v.width],
                DType::F32,
            ));
            ts.extend(self.norm(&format!("{p}.ln2"), None, Role::VisionNorm, v.width, NormKind::RmsNorm));
            for (n, role, shape) in [
                ("ffn_gate", Role::VisionMlpGate, vec![v.mlp, v.width]),
                ("ffn_up", Role::VisionMlpUp, vec![v.mlp, v.width]),
                ("ffn_down", Role::VisionMlpDown, vec![v.width, v.mlp]),
            ] {
                let rows = shape[0];
                ts.push(self.tensor(format!("{p}.{n}.weight"), None, role, shape, dt));
                ts.push(self.tensor(format!("{p}.{n}.bias"), None, role, vec![rows], DType::F32));
            }
            self.unit(UnitId::VisionBlock { block: b }, &ts);
        }
        let merged = v.width * v.spatial_merge * v.spatial_merge;
        let mut m = self.norm("v.post_ln", None, Role::VisionMergerNorm, v.width, NormKind::RmsNorm);
        m.push(self.tensor("mm.0.weight".into(), None, Role::VisionMerger, vec![merged, merged], dt));
        m.push(self.tensor("mm.0.bias".into(), None, Role::VisionMerger, vec![merged], DType::F32));
        m.push(self.tensor("mm.2.weight".into(), None, Role::VisionMerger, vec![v.out_hidden, merged], dt));
        m.push(self.tensor("mm.2.bias".into(), None, Role::VisionMerger, vec![v.out_hidden], DType::F32));
        self.unit(UnitId::VisionMerger, &m);
    }
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers and every third one between.
#[must_use]
pub fn uses_more_bits(layer: u32, n_layers: u32) -> bool {
    let (i, n) = (i64::from(layer), i64::from(n_layers));
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl Inventory {
    /// Lists every tensor of `spec` and groups them into units, in execution order (vision first, then the
    /// token embedding, the decoder layers, and the output head).
    #[must_use]
    pub fn new(spec: &ModelSpec) -> Inventory {
        let mut b = Builder { spec, tensors: Vec::new(), units: Vec::new() };
        b.vision();
        let t = &spec.text;
        let embd = b.tensor(
            "token_embd.weight".into(),
            None,
            Role::TokenEmbd,
            vec![t.vocab, t.hidden],
            spec.weights.token_embd,
        );
        b.unit(UnitId::TokenEmbd, &[embd]);
        for il in 0..t.n_layers {
            b.decoder_layer(il);
        }
        let mut out = b.norm("output_norm", None, Role::OutputNorm, t.hidden, t.norm);
        if !t.tied_embeddings {
            out.push(b.tensor(
                "output.weight".into(),
                None,
                Role::Output,
                vec![t.vocab, t.hidden],
                spec.weights.output,
            ));
        }
        b.unit(UnitId::Output, &out);
        let index = b.units.iter().enumerate().map(|(i, u)| (u.id, i)).collect();
        Inventory { tensors: b.tensors, units: b.units, index }
    }

    /// Total weight bytes of the model.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// Total parameter count.
    #[must_use]
    pub fn params(&self) -> u64 {
        self.tensors.iter().map(Tensor::elems).sum()
    }

    /// The unit with this id.
    #[must_use]
    pub fn unit(&self, id: UnitId) -> Option<&Unit> {
        self.index.get(&id).map(|&i| &self.units[i])
    }

    /// Weight bytes of a unit (0 for KV units and unknown ids).
    #[must_use]
    pub fn unit_bytes(&self, id: UnitId) -> u64 {
        self.unit(id).map_or(0, |u| u.weight_bytes)
    }

    /// Position of a unit in execution order.
    #[must_use]
    pub fn position(&self, id: UnitId) -> Option<usize> {
        self.index.get(&id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use proptest::prelude::*;

    #[test]
    fn llama_names_and_shapes() {
        let spec = catalog::get("llama-3.1-8b").unwrap();
        let inv = Inventory::new(&spec);
        let q = inv.tensors.iter().find(|t| t.name == "blk.0.attn_q.weight").unwrap();
        assert_eq!(q.shape, vec![4096, 4096]);
        let k = inv.tensors.iter().find(|t| t.name == "blk.31.attn_k.weight").unwrap();
        assert_eq!(k.shape, vec![1024, 4096]);
        assert_eq!(inv.unit_bytes(UnitId::Ffn { layer: 3 }), 3 * 4096 * 14336 * 2 + 4096 * 4);
        assert!(inv.unit(UnitId::Kv { layer: 31 }).is_some());
        assert!(inv.unit(UnitId::Kv { layer: 32 }).is_none());
    }

    #[test]
    fn moe_experts_are_units() {
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let e = inv.unit(UnitId::Expert { layer: 5, expert: 77 }).unwrap();
        assert_eq!(e.parts.len(), 3);
        // 3 × 768 × 2048 weights in q4_0 (4.5 bits).
        assert_eq!(e.weight_bytes, 3 * 768 * 2048 * 9 / 16);
        assert!(inv.unit(UnitId::Ffn { layer: 5 }).is_none());
    }

    /// Every byte of every tensor belongs to exactly one unit.
    fn check_partition(spec: &ModelSpec) -> Result<(), TestCaseError> {
        let inv = Inventory::new(spec);
        let mut covered = vec![0u64; inv.tensors.len()];
        for u in &inv.units {
            for p in &u.parts {
                covered[p.tensor] += p.bytes;
            }
            prop_assert_eq!(u.weight_bytes, u.parts.iter().map(|p| p.bytes).sum::<u64>());
        }
        for (t, c) in inv.tensors.iter().zip(&covered) {
            prop_assert_eq!(t.bytes, *c, "tensor {} covered {} of {} bytes", t.name, c, t.bytes);
        }
        prop_assert_eq!(inv.units.iter().map(|u| u.weight_bytes).sum::<u64>(), inv.total_bytes());
        let mut ids: Vec<_> = inv.units.iter().map(|u| u.id).collect();
        ids.sort();
        ids.dedup();
        prop_assert_eq!(ids.len(), inv.units.len());
        Ok(())
    }

    proptest! {
        #[test]
        fn units_partition_the_tensors(name in proptest::sample::select(catalog::names()), layers in 1u32..4) {
            let spec = catalog::get(name).unwrap();
            let spec = spec.truncated(layers.min(spec.text.n_layers)).unwrap();
            check_partition(&spec)?;
        }
    }

    #[test]
    fn full_models_partition() {
        for name in catalog::names() {
            check_partition(&catalog::get(name).unwrap()).unwrap();
        }
    }

    #[test]
    fn more_bits_pattern_matches_llama_cpp() {
        let n = 32;
        let more: Vec<u32> = (0..n).filter(|&i| uses_more_bits(i, n)).collect();
        assert_eq!(&more[..6], &[0, 1, 2, 3, 6, 9]);
        assert!(more.contains(&28) && more.contains(&31));
    }
}
