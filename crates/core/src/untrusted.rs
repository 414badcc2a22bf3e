//! Entry points that run untrusted bytes through a reader and everything a command does right after it.
//!
//! Each function takes the raw bytes of one file and returns `Ok` when the reader accepted them or the
//! reader's error message. None may panic, whatever the bytes: the fuzz targets in `fuzz/` call exactly these
//! functions, and `tests/fuzz_corpus.rs` replays every committed corpus file through them on the stable
//! toolchain, so CI checks in seconds that no known input panics. What "everything after it" covers:
//! - [`gguf`]: the header, then the spec it describes and the inventory the file stores;
//! - [`hf_config`]: a `config.json`, then its inventory and KV size;
//! - [`profile`]: a Profile, then the cost model built from it and a few of its lookups;
//! - [`plan`]: a Plan, then its check against the inventory of the catalog model it names.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use crate::cost::{CostModel, TableCostModel};
use crate::dtype::DType;
use crate::inventory::Inventory;
use crate::model::{WeightFormat, parse_hf_config};
use crate::plan::Plan;
use crate::profile::Profile;

fn text(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))
}

/// A GGUF file: header, model spec, inventory.
pub fn gguf(bytes: &[u8]) -> Result<(), String> {
    let header = crate::gguf::parse("fuzz.gguf", bytes, bytes.len() as u64, 0).map_err(|e| e.to_string())?;
    let _ = header.tensor_bytes();
    let spec = header.model_spec("fuzz").map_err(|e| e.to_string())?;
    // The spec carries every stored tensor, so the inventory is the file's exact one.
    let _ = Inventory::new(&spec).total_bytes();
    Ok(())
}

/// An HF `config.json`: spec, inventory, KV bytes per token.
pub fn hf_config(bytes: &[u8]) -> Result<(), String> {
    let spec = parse_hf_config("config.json", text(bytes)?, "fuzz", WeightFormat::uniform(DType::Bf16))
        .map_err(|e| e.to_string())?;
    let inv = Inventory::new(&spec);
    let _ = (inv.total_bytes(), inv.params(), spec.kv_bytes_per_token(DType::F16));
    Ok(())
}

/// A Profile: the cost model and its copy and DRAM lookups.
pub fn profile(bytes: &[u8]) -> Result<(), String> {
    let p = Profile::from_json("profile.json", text(bytes)?).map_err(|e| e.to_string())?;
    let _ = p.to_json();
    let cost = TableCostModel::new(&p);
    for b in [1u64, 1 << 20, 1 << 30] {
        let _ = (cost.h2d_ns(b, true), cost.d2h_ns(b, false));
    }
    let _ = (cost.dram_gbps(1, false), cost.dram_gbps(cost.cpu_threads(), true));
    Ok(())
}

/// Inventories of catalog models (optionally truncated, `NAME@NL`), built once (the largest takes milliseconds).
fn catalog_inventory(name: &str) -> Option<std::sync::Arc<Inventory>> {
    static CACHE: OnceLock<Mutex<BTreeMap<String, std::sync::Arc<Inventory>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(BTreeMap::new()));
    let spec = match name.split_once('@') {
        // `qwen3-30b-a3b@2L`: the CLI's truncated catalog models.
        Some((base, l)) => {
            crate::catalog::get(base).ok()?.truncated(l.strip_suffix('L')?.parse().ok()?).ok()?
        }
        None => crate::catalog::get(name).ok()?,
    };
    let mut map = cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    Some(map.entry(name.to_string()).or_insert_with(|| std::sync::Arc::new(Inventory::new(&spec))).clone())
}

/// A Plan: read, then checked against the catalog model it names (as `sim run` and `exec run` do).
pub fn plan(bytes: &[u8]) -> Result<(), String> {
    let plan = Plan::from_json("plan.json", text(bytes)?)?;
    let _ = (plan.peak_vram_bytes(), plan.to_json());
    let inv = catalog_inventory(&plan.model).ok_or_else(|| format!("unknown model `{}`", plan.model))?;
    plan.validate(&inv).map_err(|e| e.to_string())?;
    Ok(())
}
