//! Fixtures shared by the planner tests.

// Each test binary uses a different subset of the fixtures.
#![allow(dead_code)]

use pipeshard_core::catalog;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::reference;
use pipeshard_core::workload::Workload;

/// The paper's RTX 5090 system (cli3).
pub fn cli3() -> TableCostModel {
    TableCostModel::new(&reference::derived("cli3").expect("cli3 is a derived system"))
}

/// A catalog model.
pub fn model(name: &str) -> ModelSpec {
    catalog::get(name).expect("catalog model")
}

/// A small MoE: qwen3-30b-a3b's first `layers` layers with `experts` routed experts, top-2.
pub fn small_moe(layers: u32, experts: u32) -> ModelSpec {
    let mut spec = model("qwen3-30b-a3b").truncated(layers).expect("layers within the model");
    let moe = spec.text.moe.as_mut().expect("qwen3-30b-a3b is MoE");
    moe.n_experts = experts;
    moe.top_k = 2;
    spec.name = format!("qwen3-30b-a3b@{layers}L×{experts}E");
    spec
}

/// A prompt that nearly fills `ctx`, as the paper's prompts do, with `gen` tokens generated.
pub fn filled(ctx: u64, gen_tokens: u64, ubatch: u64) -> Workload {
    Workload::single(ctx - gen_tokens, ctx, gen_tokens, ubatch)
}
