//! Snapshot of a small trace: a one-layer model, one prefill chunk and two decode steps, attention and KV
//! streamed through two slots, the FFN on the CPU, with a round-number cost model. One event per line.

mod common;

use common::{FixedCost, PhaseShape, plan, small};
use pipeshard_core::inventory::UnitId;
use pipeshard_core::plan::Placement;
use pipeshard_core::workload::Workload;
use pipeshard_sim::{SimOptions, Simulator};

#[test]
fn small_trace() {
    let spec = small("nemo-4b", 1);
    let w = Workload::single(60, 256, 2, 64);
    let place = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        UnitId::Ffn { .. } | UnitId::TokenEmbd => Placement::Cpu,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, op_offload: false, cpu_threads: 8 }, &place);
    let cost = FixedCost {
        launch_ns: 5_000,
        host_sync_ns: 10_000,
        weightless_ns: 2_000,
        dma_slowdown: 1.25,
        ..FixedCost::plain(0.001, 25.0)
    };
    let run =
        Simulator::new(&spec, &p, &cost).unwrap().run(&SimOptions { trace: true, ..SimOptions::default() });
    let trace = run.trace.unwrap();
    let lines: Vec<String> = trace.events.iter().map(|e| serde_json::to_string(e).unwrap()).collect();
    insta::assert_snapshot!(lines.join("\n"));
    // The whole document is what Perfetto opens.
    let doc: serde_json::Value = serde_json::from_str(&trace.to_json()).unwrap();
    assert_eq!(doc["traceEvents"].as_array().unwrap().len(), trace.events.len());
}
