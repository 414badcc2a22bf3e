//! Batched decode: R sequences decoding one token each per step, with unified or per-sequence KV.

mod common;

use common::{FixedCost, PhaseShape, cli3, plan, small};
use pipeshard_core::cost::Device;
use pipeshard_core::inventory::UnitId;
use pipeshard_core::metrics::Resource;
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::workload::Workload;
use pipeshard_sim::graph::TaskKind;
use pipeshard_sim::{SimOptions, Simulator};

const SHAPE: PhaseShape = PhaseShape { pipeline_depth: 2, op_offload: false, cpu_threads: 8 };

/// Streamed attention with its KV (uploaded whole, new cells written back), everything else pinned.
fn streamed_attention(u: UnitId) -> Placement {
    match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        _ => Placement::Pinned,
    }
}

/// Per-sequence KV moves a layer's cache and its new cells in one copy per sequence; unified KV in one. With
/// one byte per ns and no other cost, the copy engines' busy time differs by exactly (R − 1) latencies per
/// layer and direction; with one sequence the two are the same.
#[test]
fn per_sequence_kv_pays_one_copy_latency_per_sequence() {
    let latency = 5_000;
    let cost = FixedCost { copy_latency_ns: latency, ..FixedCost::plain(0.001, 1.0) };
    let spec = small("qwen3-30b-a3b", 3);
    for r in [1u64, 4, 16] {
        let per_seq = Workload::single(300, 512, 8, 256).batched(r, false);
        let mut p = plan(&spec, &per_seq, SHAPE, &streamed_attention);
        let busy = |p: &pipeshard_core::plan::Plan| {
            let sim = Simulator::new(&spec, p, &cost).unwrap();
            sim.step(PhaseKind::Decode, per_seq.decode_step(3)).total_busy_ns()
        };
        let split = busy(&p);
        p.workload.kv_unified = true;
        let unified = busy(&p);
        let extra = (r - 1) * latency * 3;
        assert_eq!(split[1] - unified[1], extra, "R = {r}: H2D (KV uploads)");
        assert_eq!(split[2] - unified[2], extra, "R = {r}: D2H (new cells)");
        assert_eq!(split[0], unified[0], "R = {r}: the fixed cost model ignores the masked scan");
    }
}

/// Aggregate TPS sums over requests, and batching shares the weights: on cli3 with everything pinned, 16
/// requests decode more tokens per second than one, while each request's step takes longer. A unified cache
/// costs the GPU its masked scan, so per-sequence KV decodes faster there.
#[test]
fn batching_shares_weights_and_a_unified_cache_costs_the_gpu_its_scan() {
    let cost = cli3();
    let spec = small("qwen3-30b-a3b", 4);
    let run = |w: Workload| {
        let p = plan(&spec, &w, SHAPE, &|_| Placement::Pinned);
        let sim = Simulator::new(&spec, &p, &cost).unwrap().run(&SimOptions::default());
        // Everything pinned: the GPU bounds every step, busy most of it (hand-offs are the rest).
        let (bound, busy) = sim.decode_bound();
        assert_eq!(bound, Resource::GpuCompute);
        assert!(busy > 0.5 && busy <= 1.0, "{busy}");
        sim.metrics
    };
    let base = Workload::single(889, 1024, 16, 1024);
    let one = run(base);
    let split = run(base.batched(16, false));
    let unified = run(base.batched(16, true));
    assert!(split.tps > 4.0 * one.tps, "{} vs {}", split.tps, one.tps);
    assert!(split.decode_step_ns > one.decode_step_ns);
    assert!(unified.tps < split.tps, "{} vs {}", unified.tps, split.tps);
    // TPS counts every request's tokens: G × R over the decode time.
    let decode_s = (split.e2el_ns - split.ttft_ns) as f64 / 1e9;
    assert!((split.tps - 16.0 * 16.0 / decode_s).abs() / split.tps < 1e-9);
    assert!(split.busy(Resource::GpuCompute) > one.busy(Resource::GpuCompute));
}

/// The `ngl` baseline's op offload runs in decode too once a step decodes ≥ 32 sequences (ggml offloads an op
/// of CPU-resident weights from 32 rows on): a step of 64 copies the CPU layer's weights and runs it on the GPU,
/// a step of 16 computes it on the CPU.
#[test]
fn op_offload_in_decode_from_32_sequences() {
    let cost = FixedCost::plain(0.01, 25.0);
    let spec = small("qwen3-30b-a3b", 2);
    let place = |u: UnitId| if u.layer() == Some(0) { Placement::Cpu } else { Placement::Pinned };
    for (r, offloads) in [(16u64, false), (64, true)] {
        let w = Workload::single(300, 512, 4, 256).batched(r, false);
        let mut p = plan(&spec, &w, SHAPE, &place);
        p.decode.op_offload = true;
        let sim = Simulator::new(&spec, &p, &cost).unwrap();
        let o = sim.step(PhaseKind::Decode, w.decode_step(1));
        let g = &o.graph;
        let copied: Vec<_> = (0..g.tasks.len())
            .filter_map(|t| match g.tasks[t].kind {
                TaskKind::Offload { op } => Some(g.ops[op as usize].unit),
                _ => None,
            })
            .collect();
        assert_eq!(!copied.is_empty(), offloads, "R = {r}");
        assert!(copied.iter().all(|u| u.layer() == Some(0)), "R = {r}: only layer 0 is CPU-resident");
        let computes_on_cpu = (0..g.tasks.len() as u32).any(|t| {
            matches!(g.tasks[t as usize].kind, TaskKind::Compute { .. }) && g.device(t) == Some(Device::Cpu)
        });
        assert_eq!(computes_on_cpu, !offloads, "R = {r}: offloaded ops leave the CPU no compute");
    }
}

/// Streamed experts under each runtime: ours copies the experts a step's tokens touch, the artifact's copies
/// every streamed expert whatever the routing. With identical requests a decode step of 64 touches one
/// token's top-8, so ours moves 8 experts per layer and the artifact all 128 (attention and KV pinned).
#[test]
fn the_artifacts_runtime_streams_every_expert_ours_the_touched() {
    use pipeshard_core::workload::Requests;
    use pipeshard_sim::Runtime;
    let cost = FixedCost::plain(0.001, 1.0);
    let spec = small("qwen3-30b-a3b", 2);
    let w =
        Workload { requests: Requests::Identical, ..Workload::single(300, 512, 4, 256).batched(64, true) };
    let streamed_experts = |u: UnitId| match u {
        UnitId::Expert { .. } => Placement::Streamed,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, SHAPE, &streamed_experts);
    let inv = pipeshard_core::inventory::Inventory::new(&spec);
    let expert_bytes = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 });
    let h2d_bytes = |runtime: Runtime| {
        let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
        let g = sim.step(PhaseKind::Decode, w.decode_step(1)).graph;
        g.tasks.iter().filter(|t| matches!(t.kind, TaskKind::Stream { .. })).map(|t| t.bytes).sum::<u64>()
    };
    assert_eq!(h2d_bytes(Runtime::Ours), 2 * 8 * expert_bytes);
    assert_eq!(h2d_bytes(Runtime::Artifact), 2 * 128 * expert_bytes);
}

/// The artifact's runtime gathers the cells of a streamed layer's unified KV on the host, one walk over the
/// used cells per sequence, before the upload: R² × context visits per layer, nothing with per-sequence KV or
/// on our runtime. Every streamed layer's upload is longer by exactly that, and by the step's new cells (it
/// copies 304 of each sequence's 512 cells, ours the 303 before the new token).
#[test]
fn the_artifacts_unified_kv_upload_walks_the_cells_once_per_sequence() {
    use pipeshard_sim::Runtime;
    let cost = FixedCost::plain(0.001, 1.0);
    let spec = small("qwen3-30b-a3b", 3);
    for unified in [false, true] {
        let w = Workload::single(300, 512, 8, 256).batched(16, unified);
        let phase = w.decode_step(3);
        let gather_ns = Runtime::Artifact.kv_gather_ns(&w, phase);
        let p = plan(&spec, &w, SHAPE, &streamed_attention);
        let h2d = |runtime: Runtime| {
            let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
            sim.step(PhaseKind::Decode, phase).total_busy_ns()[1]
        };
        assert_eq!(Runtime::Ours.kv_gather_ns(&w, phase), 0);
        // qwen3-30b-a3b: 4 KV heads × 128 × (K + V) × 2 bytes = 2 KiB a cell, copied at 1 byte/ns.
        let new_cells_ns = 16 * 2048;
        let extra_ns = i64::try_from(gather_ns).unwrap() + new_cells_ns;
        let diff_ns =
            i64::try_from(h2d(Runtime::Artifact)).unwrap() - i64::try_from(h2d(Runtime::Ours)).unwrap();
        assert_eq!(diff_ns, 3 * extra_ns, "unified {unified}");
        // 16 walks over 16 × 304 cells at 3.4 ns.
        assert_eq!(gather_ns, if unified { 16 * 16 * 304 * 34 / 10 } else { 0 }, "unified {unified}");
    }
}
