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
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::fxhash::FxHashMap;
use crate::model::{FfnKind, ModelSpec, NormKind, StoredTensor};

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
    /// Unit → position; Fx-hashed, as planners and the simulator look units up per placement.
    index: FxHashMap<UnitId, usize>,
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

/// RoPE frequency factors some GGUF files carry once for all layers.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// A stored tensor that does not fit a model's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutMismatch {
    pub tensor: String,
    pub value: String,
    pub problem: String,
}

impl Builder<'_> {
    /// Takes each tensor's format and bytes from the model file (`spec.stored`). A stored tensor the layout
    /// lacks is `rope_freqs.weight` (it goes with the token embedding) or belongs to a layer that truncation
    /// cut off: [`Inventory::check_stored`] refused anything else when the file was read.
    fn apply_stored(&mut self) {
        let by_name: BTreeMap<&str, &StoredTensor> =
            self.spec.stored.iter().map(|t| (t.name.as_str(), t)).collect();
        for t in &mut self.tensors {
            if let Some(s) = by_name.get(t.name.as_str()) {
                t.dtype = s.dtype;
                t.bytes = s.bytes;
            }
        }
        if let Some(rope) = by_name.get(ROPE_FREQS) {
            self.tensors.push(Tensor {
                name: rope.name.clone(),
                layer: None,
                role: Role::TokenEmbd,
                shape: rope.shape.clone(),
                dtype: rope.dtype,
                bytes: rope.bytes,
            });
            let idx = self.tensors.len() - 1;
            let embd = self.units.iter_mut().find(|u| u.id == UnitId::TokenEmbd).expect("built above");
            embd.parts.push(TensorPart { tensor: idx, expert: None, bytes: 0 });
        }
        let n_experts = self.spec.text.moe.as_ref().map_or(1, |m| u64::from(m.n_experts));
        for u in &mut self.units {
            for p in &mut u.parts {
                let bytes = self.tensors[p.tensor].bytes;
                p.bytes = if p.expert.is_some() { bytes / n_experts } else { bytes };
            }
            u.weight_bytes = u.parts.iter().map(|p| p.bytes).sum();
        }
    }
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers and every third one between.
#[must_use]
pub fn uses_more_bits(layer: u32, n_layers: u32) -> bool {
    let (i, n) = (i64::from(layer), i64::from(n_layers));
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// Models whose inventories [`Inventory::shared`] keeps, most recently used last.
const SHARED_MODELS: usize = 8;

/// The inventories [`Inventory::shared`] hands out, with the spec each was built from.
static SHARED: Mutex<Vec<(ModelSpec, Arc<Inventory>)>> = Mutex::new(Vec::new());

impl Inventory {
    /// `Inventory::new(spec)`, built once per process for the last few models asked for: every plan starts
    /// from the model's inventory, and qwen3-235b-a22b's 12 000 expert units took half of an `ngl` plan to
    /// build and free.
    #[must_use]
    pub fn shared(spec: &ModelSpec) -> Arc<Inventory> {
        let mut cache = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = cache.iter().position(|(s, _)| s == spec) {
            let hit = cache.remove(i);
            let inv = Arc::clone(&hit.1);
            cache.push(hit);
            return inv;
        }
        let inv = Arc::new(Inventory::new(spec));
        if cache.len() == SHARED_MODELS {
            cache.remove(0);
        }
        cache.push((spec.clone(), Arc::clone(&inv)));
        inv
    }

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
        if !spec.stored.is_empty() {
            b.apply_stored();
        }
        let index = b.units.iter().enumerate().map(|(i, u)| (u.id, i)).collect();
        Inventory { tensors: b.tensors, units: b.units, index }
    }

    /// Checks a spec's [`ModelSpec::stored`] tensors against its layout: every tensor the layout expects is
    /// stored with the same shape, and every stored tensor has a place (`rope_freqs.weight`, shared by all
    /// layers, goes with the token embedding). Model-file readers call it once; [`Inventory::new`] then trusts
    /// the stored formats.
    pub fn check_stored(spec: &ModelSpec) -> Result<(), LayoutMismatch> {
        let layout = Inventory::new(&ModelSpec { stored: Vec::new(), ..spec.clone() });
        let by_name: BTreeMap<&str, &StoredTensor> =
            spec.stored.iter().map(|t| (t.name.as_str(), t)).collect();
        for t in &layout.tensors {
            let Some(s) = by_name.get(t.name.as_str()) else {
                return Err(LayoutMismatch {
                    tensor: t.name.clone(),
                    value: "missing".into(),
                    problem: format!("the {} layout needs it (shape {:?})", spec.name, t.shape),
                });
            };
            if s.shape != t.shape {
                return Err(LayoutMismatch {
                    tensor: t.name.clone(),
                    value: format!("shape {:?}", s.shape),
                    problem: format!("the {} layout expects {:?} (rows first)", spec.name, t.shape),
                });
            }
        }
        for s in &spec.stored {
            if s.name != ROPE_FREQS && !layout.tensors.iter().any(|t| t.name == s.name) {
                return Err(LayoutMismatch {
                    tensor: s.name.clone(),
                    value: format!("shape {:?}", s.shape),
                    problem: format!("has no place in the {} layout", spec.name),
                });
            }
        }
        Ok(())
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
    fn shared_inventory_is_built_once_per_spec() {
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let short = spec.truncated(2).unwrap();
        let a = Inventory::shared(&spec);
        assert_eq!(*a, Inventory::new(&spec));
        assert!(Arc::ptr_eq(&a, &Inventory::shared(&spec.clone())), "an equal spec gets the same inventory");
        let b = Inventory::shared(&short);
        assert_eq!(*b, Inventory::new(&short));
        assert!(!Arc::ptr_eq(&a, &b));
        // Past the cache's capacity the least recently used spec is built anew, and still equal.
        for layers in 1..=SHARED_MODELS as u32 {
            let _ = Inventory::shared(&spec.truncated(layers + 2).unwrap());
        }
        let again = Inventory::shared(&spec);
        assert!(!Arc::ptr_eq(&a, &again));
        assert_eq!(*again, *a);
    }

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

    /// A GGUF header written from a catalog model's inventory reads back as the same architecture and bytes,
    /// and a tensor stored in another format changes exactly that tensor's bytes.
    #[test]
    fn gguf_headers_round_trip_to_spec_and_inventory() {
        use crate::gguf::{GgufValue, parse, write_header};
        for name in ["llama-3.1-8b", "qwen3-30b-a3b", "nemo-4b"] {
            let spec = catalog::get(name).unwrap().truncated(2).unwrap();
            let inv = Inventory::new(&spec);
            let t = &spec.text;
            let arch = match name {
                "qwen3-30b-a3b" => "qwen3moe",
                "nemo-4b" => "nemotron",
                _ => "llama",
            };
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
                (
                    k(if arch == "nemotron" {
                        "attention.layer_norm_epsilon"
                    } else {
                        "attention.layer_norm_rms_epsilon"
                    }),
                    GgufValue::F64(t.norm_eps),
                ),
            ];
            if let Some(m) = &t.moe {
                meta.push((k("expert_count"), GgufValue::U32(m.n_experts)));
                meta.push((k("expert_used_count"), GgufValue::U32(m.top_k)));
                meta.push((k("expert_feed_forward_length"), GgufValue::U32(m.expert_ffn as u32)));
            }
            let ggml = |d: DType| match d {
                DType::F32 => 0,
                DType::F16 => 1,
                DType::Q4_0 => 2,
                DType::Q8_0 => 8,
                DType::Q6K => 14,
                DType::Bf16 => 30,
                other => panic!("{other}"),
            };
            let dims: Vec<Vec<u64>> =
                inv.tensors.iter().map(|t| t.shape.iter().rev().copied().collect()).collect();
            let mut tensors: Vec<(&str, &[u64], u32, u64)> = inv
                .tensors
                .iter()
                .zip(&dims)
                .map(|(t, d)| (t.name.as_str(), d.as_slice(), ggml(t.dtype), 0))
                .collect();
            // Store the first attn_v in q8_0 instead.
            let v = tensors.iter().position(|t| t.0 == "blk.0.attn_v.weight").unwrap();
            tensors[v].2 = 8;
            let meta_ref: Vec<(&str, GgufValue)> =
                meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let bytes = write_header(&meta_ref, &tensors);
            let header = parse("m.gguf", &bytes[..], 1 << 40, 0).unwrap();
            let read = header.model_spec(&spec.name).unwrap();
            assert_eq!(read.text, spec.text, "{name}");
            let from_file = Inventory::new(&read);
            let vt = &inv.tensors[v];
            // Every other tensor is the catalog's, exactly: name, layer, role, shape, format and bytes.
            assert_eq!(from_file.tensors.len(), inv.tensors.len());
            for (a, b) in from_file.tensors.iter().zip(&inv.tensors).filter(|(a, _)| a.name != vt.name) {
                assert_eq!(a, b, "{name}");
            }
            let expect =
                inv.total_bytes() - vt.bytes + DType::Q8_0.tensor_bytes(vt.shape[1], vt.shape[0]).unwrap();
            assert_eq!(from_file.total_bytes(), expect, "{name}");
            assert_eq!(
                from_file.unit_bytes(UnitId::Attn { layer: 0 }),
                inv.unit_bytes(UnitId::Attn { layer: 0 }) - vt.bytes
                    + DType::Q8_0.tensor_bytes(vt.shape[1], vt.shape[0]).unwrap()
            );
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
