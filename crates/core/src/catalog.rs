//! The built-in model catalog: HF-style `config.json` files plus the storage format of each tensor class,
//! embedded in the binary (`crates/core/catalog/`).

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

use crate::dtype::DType;
use crate::model::{ConfigError, ModelSpec, WeightFormat, parse_hf_config};

/// A catalog entry: the spec and what the paper says of its file.
#[derive(Debug, Clone)]
pub struct CatalogEntry {
    pub spec: ModelSpec,
    /// The file the sizes refer to.
    pub file: String,
    /// Published size in GiB.
    pub published_gib: f64,
    /// Assumptions made to get the tensor formats.
    pub note: Option<String>,
}

const MANIFEST: &str = include_str!("../catalog/catalog.json");

fn config_json(name: &str) -> Option<&'static str> {
    Some(match name {
        "nemo-4b" => include_str!("../catalog/nemo-4b.config.json"),
        "nemo-8b" => include_str!("../catalog/nemo-8b.config.json"),
        "qwen3-30b-a3b" => include_str!("../catalog/qwen3-30b-a3b.config.json"),
        "qwen3-235b-a22b" => include_str!("../catalog/qwen3-235b-a22b.config.json"),
        "cosmos-reason1-7b" => include_str!("../catalog/cosmos-reason1-7b.config.json"),
        "llama-3.1-8b" => include_str!("../catalog/llama-3.1-8b.config.json"),
        "qwen3-8b" => include_str!("../catalog/qwen3-8b.config.json"),
        _ => return None,
    })
}

#[derive(Deserialize)]
struct Manifest {
    models: Vec<ManifestEntry>,
}

#[derive(Deserialize)]
struct ManifestEntry {
    name: String,
    file: String,
    published_gib: f64,
    note: Option<String>,
    weights: serde_json::Map<String, Value>,
}

/// Builds a [`WeightFormat`] from `{"default": fmt, "<class>": fmt, …}`; `file` names the source in errors.
pub fn weight_format_from_json(
    file: &str,
    obj: &serde_json::Map<String, Value>,
) -> Result<WeightFormat, ConfigError> {
    let dtype = |field: &str, v: &Value| -> Result<DType, ConfigError> {
        let invalid = || ConfigError::Invalid {
            file: file.into(),
            field: format!("weights.{field}"),
            value: v.to_string(),
            expected: "a weight format such as f16, bf16, q4_0, q6_k".into(),
        };
        v.as_str().ok_or_else(invalid)?.parse().map_err(|_| invalid())
    };
    let default = obj.get("default").ok_or_else(|| ConfigError::Missing {
        file: file.into(),
        field: "weights.default".into(),
        expected: "a weight format".into(),
    })?;
    let mut w = WeightFormat::uniform(dtype("default", default)?);
    for (k, v) in obj {
        let slot = match k.as_str() {
            "default" => continue,
            "ffn_down_more_bits" => {
                w.ffn_down_more_bits = Some(dtype(k, v)?);
                continue;
            }
            "token_embd" => &mut w.token_embd,
            "output" => &mut w.output,
            "attn_q" => &mut w.attn_q,
            "attn_k" => &mut w.attn_k,
            "attn_v" => &mut w.attn_v,
            "attn_output" => &mut w.attn_output,
            "ffn_gate" => &mut w.ffn_gate,
            "ffn_up" => &mut w.ffn_up,
            "ffn_down" => &mut w.ffn_down,
            "expert_gate_up" => &mut w.expert_gate_up,
            "expert_down" => &mut w.expert_down,
            "router" => &mut w.router,
            "vision" => &mut w.vision,
            "norms" => &mut w.norms,
            _ => {
                return Err(ConfigError::Invalid {
                    file: file.into(),
                    field: format!("weights.{k}"),
                    value: v.to_string(),
                    expected: "a tensor class: default token_embd output attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down ffn_down_more_bits expert_gate_up expert_down router vision norms".into(),
                });
            }
        };
        *slot = dtype(k, v)?;
    }
    Ok(w)
}

/// Every catalog entry, parsed once. The embedded files are part of the binary, so a parse failure is a bug
/// caught by the tests.
#[must_use]
pub fn entries() -> &'static [CatalogEntry] {
    static ENTRIES: OnceLock<Vec<CatalogEntry>> = OnceLock::new();
    ENTRIES.get_or_init(|| {
        let manifest: Manifest = serde_json::from_str(MANIFEST).expect("embedded catalog.json is valid");
        manifest
            .models
            .into_iter()
            .map(|e| {
                let file = format!("catalog/{}.config.json", e.name);
                let json =
                    config_json(&e.name).unwrap_or_else(|| panic!("no embedded config for {}", e.name));
                let weights =
                    weight_format_from_json("catalog/catalog.json", &e.weights).expect("catalog weights");
                let spec = parse_hf_config(&file, json, &e.name, weights).expect("embedded config parses");
                CatalogEntry { spec, file: e.file, published_gib: e.published_gib, note: e.note }
            })
            .collect()
    })
}

/// Names of the catalog models, in catalog order.
#[must_use]
pub fn names() -> Vec<&'static str> {
    entries().iter().map(|e| e.spec.name.as_str()).collect()
}

/// The catalog model `name`, or an error listing the known names.
pub fn get(name: &str) -> Result<ModelSpec, CatalogError> {
    entries()
        .iter()
        .find(|e| e.spec.name == name)
        .map(|e| e.spec.clone())
        .ok_or_else(|| CatalogError::Unknown { name: name.into(), known: names().join(", ") })
}

/// A model name the catalog does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogError {
    #[error(
        "unknown model `{name}`; built-in models: {known} (or pass the path of a .gguf file, an HF checkpoint folder or a config.json)"
    )]
    Unknown { name: String, known: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Inventory;

    const GIB: f64 = (1u64 << 30) as f64;

    #[test]
    fn every_model_is_within_two_percent_of_its_published_size() {
        for e in entries() {
            let gib = Inventory::new(&e.spec).total_bytes() as f64 / GIB;
            let err = (gib - e.published_gib) / e.published_gib;
            assert!(
                err.abs() < 0.02,
                "{}: {gib:.2} GiB vs published {:.2} ({:+.1}%)",
                e.spec.name,
                e.published_gib,
                err * 100.0
            );
        }
    }

    #[test]
    fn unknown_names_list_the_catalog() {
        let e = get("gpt-5").unwrap_err().to_string();
        assert!(e.contains("qwen3-30b-a3b") && e.contains("gpt-5"), "{e}");
    }

    #[test]
    fn bad_weight_classes_are_named() {
        let obj: serde_json::Map<String, Value> =
            serde_json::from_str(r#"{"default":"f16","atn_q":"q4_0"}"#).unwrap();
        let e = weight_format_from_json("w.json", &obj).unwrap_err().to_string();
        assert!(e.contains("weights.atn_q") && e.contains("w.json"), "{e}");
        let obj: serde_json::Map<String, Value> = serde_json::from_str(r#"{"default":"q9"}"#).unwrap();
        assert!(weight_format_from_json("w.json", &obj).unwrap_err().to_string().contains("q9"));
    }
}
