//! The shapes to measure, derived from the catalog's specs (never a fixed list): every matrix shape of every
//! catalog model, the routed-expert FFN shapes, the attention head layouts, and the widths of the elementwise
//! ops. A new catalog model adds its shapes to the next profile.

use std::collections::BTreeSet;

use pipeshard_core::catalog;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, Role};
use pipeshard_exec::quant::QFormat;

/// A matrix `n × k` (output features × input features) and the catalog tensors that have it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MatShape {
    pub n: u64,
    pub k: u64,
    /// `model:tensor` of the first tensor seen with this shape.
    pub example: String,
}

/// An attention head layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeadLayout {
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u64,
}

/// Everything the profiler sweeps, from the catalog.
#[derive(Debug, Clone, Default)]
pub struct Shapes {
    /// Dense matrices (attention, dense FFN, shared experts, routers, output heads, vision tower).
    pub matmul: Vec<MatShape>,
    /// One routed expert's gate/up shape `expert_ffn × hidden` (down is its transpose).
    pub experts: Vec<MatShape>,
    pub heads: Vec<HeadLayout>,
    /// Residual widths (norms).
    pub hidden: Vec<u64>,
    /// FFN widths (activations), dense and expert.
    pub ffn: Vec<u64>,
}

/// The shapes of every catalog model. The token embedding is a row lookup, not a matmul, and is left out.
#[must_use]
pub fn from_catalog() -> Shapes {
    let mut mat = BTreeSet::new();
    let mut exp = BTreeSet::new();
    let (mut heads, mut hidden, mut ffn) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let mut seen = BTreeSet::new();
    let mut experts_seen = BTreeSet::new();
    for entry in catalog::entries() {
        let spec = &entry.spec;
        let t = &spec.text;
        heads.insert(HeadLayout { q_heads: t.n_heads, kv_heads: t.n_kv_heads, head_dim: t.head_dim });
        hidden.insert(t.hidden);
        if !spec.layer_is_moe(0) {
            ffn.insert(t.ffn);
        }
        if let Some(moe) = &t.moe {
            ffn.insert(moe.expert_ffn);
        }
        let inv = Inventory::new(spec);
        for tensor in &inv.tensors {
            // Embeddings are lookups; an expert's down is its gate/up transposed.
            let (seen_set, out, n, k) = match (tensor.role, tensor.shape.as_slice()) {
                (Role::TokenEmbd | Role::ExpertDown, _) => continue,
                (Role::ExpertGate | Role::ExpertUp, [_, n, k]) => (&mut experts_seen, &mut exp, *n, *k),
                (_, [n, k]) => (&mut seen, &mut mat, *n, *k),
                _ => continue,
            };
            if seen_set.insert((n, k)) {
                out.insert(MatShape { n, k, example: format!("{}:{}", spec.name, tensor.name) });
            }
        }
    }
    Shapes {
        matmul: mat.into_iter().collect(),
        experts: exp.into_iter().collect(),
        heads: heads.into_iter().collect(),
        hidden: hidden.into_iter().collect(),
        ffn: ffn.into_iter().collect(),
    }
}

/// `plain` formats followed by every block-quantised format the executor runs (the full grids' weight formats).
#[must_use]
pub fn with_quantised(plain: &[DType]) -> Vec<DType> {
    plain.iter().copied().chain(QFormat::ALL.map(QFormat::dtype)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_model_contributes_its_shapes() {
        let s = from_catalog();
        // nemo-8b's FFN up, qwen3-30b-a3b's expert, llama's 8 KV heads of 128, the vocab heads.
        let nemo = catalog::get("nemo-8b").unwrap().text;
        assert!(s.matmul.iter().any(|m| (m.n, m.k) == (nemo.ffn, nemo.hidden)), "{:?}", s.matmul);
        let moe = catalog::get("qwen3-30b-a3b").unwrap().text;
        let e = moe.moe.unwrap();
        assert!(s.experts.iter().any(|m| (m.n, m.k) == (e.expert_ffn, moe.hidden)), "{:?}", s.experts);
        assert!(s.heads.iter().any(|h| h.kv_heads == 4), "the catalog has 4-KV-head layouts: {:?}", s.heads);
        assert!(s.matmul.iter().any(|m| m.n == nemo.vocab), "output heads are matmuls");
        assert!(!s.matmul.iter().any(|m| m.example.contains("token_embd")), "embeddings are lookups");
        eprintln!(
            "{} matmul shapes, {} expert shapes, {} head layouts",
            s.matmul.len(),
            s.experts.len(),
            s.heads.len()
        );
    }
}
