//! `pipeshard models`: the built-in catalog.

use pipeshard_core::catalog;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, Tensor, UnitId};
use serde::Serialize;

use crate::output::{Format, render};

/// One catalog row.
#[derive(Debug, Serialize)]
pub struct ModelRow {
    pub name: String,
    pub kind: &'static str,
    pub layers: u32,
    pub params: u64,
    pub active_params: u64,
    pub bytes: u64,
    pub published_gib: f64,
    pub kv_bytes_per_token: u64,
    pub file: String,
}

/// Parameters one token touches: everything but the embedding table (one row is read) and the experts the
/// router does not pick.
fn active_params(inv: &Inventory, spec: &pipeshard_core::model::ModelSpec) -> u64 {
    let expert_params: u64 = inv
        .units
        .iter()
        .filter(|u| matches!(u.id, UnitId::Expert { .. }))
        .flat_map(|u| u.parts.iter())
        .map(|p| inv.tensors[p.tensor].elems() / u64::from(spec.text.moe.as_ref().map_or(1, |m| m.n_experts)))
        .sum();
    let active_experts =
        spec.text.moe.as_ref().map_or(0, |m| expert_params * u64::from(m.top_k) / u64::from(m.n_experts));
    let vision: u64 = inv
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("v.") || t.name.starts_with("mm."))
        .map(Tensor::elems)
        .sum();
    let embd = inv.tensors.iter().find(|t| t.name == "token_embd.weight").map_or(0, Tensor::elems);
    inv.params() - expert_params - vision - embd + active_experts + spec.text.hidden
}

#[must_use]
pub fn rows() -> Vec<ModelRow> {
    catalog::entries()
        .iter()
        .map(|e| {
            let inv = Inventory::new(&e.spec);
            ModelRow {
                name: e.spec.name.clone(),
                kind: if e.spec.vision.is_some() {
                    "vlm"
                } else if e.spec.is_moe() {
                    "moe"
                } else {
                    "dense"
                },
                layers: e.spec.text.n_layers,
                params: inv.params(),
                active_params: active_params(&inv, &e.spec),
                bytes: inv.total_bytes(),
                published_gib: e.published_gib,
                kv_bytes_per_token: e.spec.kv_bytes_per_token(DType::F16),
                file: e.file.clone(),
            }
        })
        .collect()
}

#[must_use]
pub fn table(rows: &[ModelRow]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<18} {:<5} {:>6} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10}",
        "model", "kind", "layers", "params", "active", "GiB", "published", "Δ", "KV/token"
    );
    for r in rows {
        let gib = r.bytes as f64 / (1u64 << 30) as f64;
        let _ = writeln!(
            s,
            "{:<18} {:<5} {:>6} {:>8.2}B {:>8.2}B {:>9.2} {:>10.2} {:>+6.1}% {:>8} KiB",
            r.name,
            r.kind,
            r.layers,
            r.params as f64 / 1e9,
            r.active_params as f64 / 1e9,
            gib,
            r.published_gib,
            (gib / r.published_gib - 1.0) * 100.0,
            r.kv_bytes_per_token / 1024,
        );
    }
    s.push_str("KV/token: K+V over all layers in f16. Sizes in GiB; published = the paper's file sizes.\n");
    s
}

pub fn run(format: Format) -> anyhow::Result<()> {
    let rows = rows();
    print!("{}", render(format, "models", &rows, || table(&rows))?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_table_snapshot() {
        insta::assert_snapshot!(table(&rows()));
    }

    #[test]
    fn json_has_name_and_bytes() {
        let v: serde_json::Value = serde_json::to_value(rows()).unwrap();
        for m in v.as_array().unwrap() {
            assert!(m["name"].is_string() && m["bytes"].as_u64().unwrap() > 0);
        }
    }

    #[test]
    fn active_params_of_moe_are_a_fraction() {
        let r = rows();
        let q = r.iter().find(|r| r.name == "qwen3-30b-a3b").unwrap();
        // Qwen3-30B-A3B: about 3.3 B active of 30.5 B.
        assert!((3.0e9..3.6e9).contains(&(q.active_params as f64)), "{}", q.active_params);
        let l = r.iter().find(|r| r.name == "llama-3.1-8b").unwrap();
        assert!((7.4e9..7.6e9).contains(&(l.active_params as f64)), "{}", l.active_params);
    }
}
