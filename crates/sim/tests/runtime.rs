//! What the runtime that executes a plan changes: kernels launched per op and CUDA-graph replay.

mod common;

use common::{FixedCost, PhaseShape, plan, small};
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::UnitId;
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::profile::{OpRow, Profile};
use pipeshard_core::workload::{OpClass, Phase, Workload};
use pipeshard_sim::graph::TaskKind;
use pipeshard_sim::{Lane, Runtime, Simulator};

const LAUNCH_NS: u64 = 1_000;
const GRAPH_NS: u64 = 300;
const SHAPE: PhaseShape = PhaseShape { pipeline_depth: 2, op_offload: false, cpu_threads: 8 };

/// Free ops and copies: a GPU op costs its kernels' launches (or replays) alone.
fn cost() -> FixedCost {
    FixedCost { launch_ns: LAUNCH_NS, graph_kernel_ns: GRAPH_NS, ..FixedCost::plain(0.0, 1.0) }
}

/// GPU busy time of one decode step of `batch` sequences of a 2-layer qwen3-30b-a3b placed by `place`.
fn gpu_busy_ns(runtime: Runtime, batch: u64, place: &dyn Fn(UnitId) -> Placement) -> u64 {
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(100, 256, 4, 128).batched(batch, true);
    let p = plan(&spec, &w, SHAPE, place);
    let cost = cost();
    let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
    sim.step(PhaseKind::Decode, w.decode_step(1)).total_busy_ns()[0]
}

/// Host time llama.cpp's three `mul_mat_id` of the 2-layer model spend sorting the routing of `tokens`
/// tokens over its 128 experts (this cost model's host syncs are free).
fn routing_sort_ns(tokens: u64) -> u64 {
    2 * 3 * 128 * tokens * Runtime::EXPERT_PAIR_PS / 1000
}

/// llama.cpp launches a layer's K and V stores apart (+1), the router's softmax, top-k, weight gather and
/// renormalisation beside its matmul (+5), and three `mul_mat_id`, the GLU, the weighting and 7 adds for the
/// experts (+11): 17 kernels a MoE layer more than ours. A step of 4 tokens replays no graph.
#[test]
fn llama_cpp_launches_seventeen_more_kernels_a_moe_layer() {
    let pinned = |_: UnitId| Placement::Pinned;
    let ours = gpu_busy_ns(Runtime::Ours, 4, &pinned);
    for runtime in [Runtime::Stock, Runtime::Artifact] {
        let extra = gpu_busy_ns(runtime, 4, &pinned) - ours;
        assert_eq!(extra, 2 * 17 * LAUNCH_NS + routing_sort_ns(4), "{runtime:?}");
    }
}

/// Several tokens' `mul_mat_id` in llama.cpp sorts the routing on the host first, once per expert and token,
/// with the GPU idle: 16 tokens cost the GPU 12 tokens' worth of sorting more than 4. One token (the vector
/// kernel reads the ids on the device) and our runtime sort nothing.
#[test]
fn llama_cpp_sorts_a_several_token_routing_on_the_host() {
    let pinned = |_: UnitId| Placement::Pinned;
    for runtime in [Runtime::Stock, Runtime::Artifact] {
        let llama = |batch| gpu_busy_ns(runtime, batch, &pinned) - gpu_busy_ns(Runtime::Ours, batch, &pinned);
        assert_eq!(llama(16) - llama(4), routing_sort_ns(12), "{runtime:?}");
    }
    assert_eq!(gpu_busy_ns(Runtime::Ours, 16, &pinned) % LAUNCH_NS, 0, "ours: launches only");
    assert_eq!(gpu_busy_ns(Runtime::Stock, 1, &pinned) % GRAPH_NS, 0, "one token: replayed kernels only");
}

/// A one-token step that is one GPU split replays llama.cpp's CUDA graph: every kernel at the replay cost
/// instead of a launch. A CPU unit (a second split) or a second token launches again; ours always launches.
#[test]
fn one_gpu_split_of_one_token_replays_a_cuda_graph() {
    let pinned = |_: UnitId| Placement::Pinned;
    let launched = gpu_busy_ns(Runtime::Stock, 4, &pinned) - routing_sort_ns(4);
    let kernels = launched / LAUNCH_NS;
    assert_eq!(launched % LAUNCH_NS, 0);
    assert_eq!(gpu_busy_ns(Runtime::Stock, 1, &pinned), kernels * GRAPH_NS);
    assert_eq!(gpu_busy_ns(Runtime::Artifact, 1, &pinned), kernels * GRAPH_NS);
    assert_eq!(gpu_busy_ns(Runtime::Ours, 1, &pinned) % LAUNCH_NS, 0, "ours launches");
    // The token embedding on the CPU keeps the rest one split; the output head there does not.
    let embd_cpu = |u: UnitId| if u == UnitId::TokenEmbd { Placement::Cpu } else { Placement::Pinned };
    assert_eq!(gpu_busy_ns(Runtime::Stock, 1, &embd_cpu), (kernels - 1) * GRAPH_NS);
    let head_cpu = |u: UnitId| if u == UnitId::Output { Placement::Cpu } else { Placement::Pinned };
    assert_eq!(gpu_busy_ns(Runtime::Stock, 1, &head_cpu) % LAUNCH_NS, 0, "two splits launch");
}

/// H2D busy time of one prefill chunk of 256 tokens at `start_pos` of a 4096-token context, a 2-layer nemo-8b
/// whose attention and KV stream (copies at 1 byte/ns, everything else free).
fn streamed_kv_upload_ns(runtime: Runtime, start_pos: u64) -> u64 {
    let spec = small("nemo-8b", 2);
    let w = Workload::single(4088, 4096, 8, 256);
    let streamed = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, SHAPE, &streamed);
    let cost = FixedCost::plain(0.0, 1.0);
    let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
    let phase = Phase::Prefill { tokens: 256, start_pos, last: false };
    sim.step(PhaseKind::Prefill, phase).total_busy_ns()[1]
}

/// The artifact uploads a streamed layer's cells in use (the chunk's own included), so a prompt's first chunk
/// copies 256 cells a layer and its last all 4096; ours uploads the cells before the chunk (none for the
/// first: validation run23's batch-16 prefill copied each layer's attention with 0 KV rows); stock llama.cpp
/// the whole allocated cache every chunk.
#[test]
fn the_kv_upload_covers_the_cells_each_runtime_reads() {
    // nemo-8b: 8 KV heads × 128 × (K + V) × 2 bytes = 4 KiB a cell.
    let cell = 4096;
    let first = streamed_kv_upload_ns(Runtime::Artifact, 0);
    let last = streamed_kv_upload_ns(Runtime::Artifact, 4096 - 256);
    assert_eq!(last - first, 2 * (4096 - 256) * cell, "two layers, 3840 more cells each");
    let ours_first = streamed_kv_upload_ns(Runtime::Ours, 0);
    assert_eq!(first - ours_first, 2 * 256 * cell, "ours leaves out the chunk's own 256 cells");
    assert_eq!(streamed_kv_upload_ns(Runtime::Ours, 4096 - 256), ours_first + 2 * (4096 - 256) * cell);
    assert_eq!(streamed_kv_upload_ns(Runtime::Stock, 0), last, "stock: the whole cache from the start");
    assert_eq!(streamed_kv_upload_ns(Runtime::Stock, 4096 - 256), last);
}

/// TTFT of a 256-token prefill chunk of a 2-layer qwen3-30b-a3b, experts placed at `experts` and everything
/// else pinned, free ops and copies, with our executor's host routing at `route_ns_per_token` a token.
fn moe_prefill_ttft_ns(runtime: Runtime, experts: Placement, route_ns_per_token: u64) -> u64 {
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(256, 1024, 1, 256);
    let p = plan(&spec, &w, SHAPE, &|u| {
        if matches!(u, UnitId::Expert { .. }) { experts } else { Placement::Pinned }
    });
    let cost = FixedCost { host_route_ns_per_token: route_ns_per_token, ..FixedCost::plain(0.0, 1.0) };
    let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
    sim.run(&pipeshard_sim::SimOptions::default()).metrics.ttft_ns
}

/// Our executor routes each layer's tokens on the host between the routing sync and the first expert, GPU or
/// CPU, the expert side waiting: 2 layers × 256 tokens at 500 ns a token. llama.cpp reads the ids on the
/// device, and its CPU backend routes inside its expert kernels.
#[test]
fn our_host_routing_delays_each_layers_experts() {
    for experts in [Placement::Pinned, Placement::Cpu] {
        let extra =
            moe_prefill_ttft_ns(Runtime::Ours, experts, 500) - moe_prefill_ttft_ns(Runtime::Ours, experts, 0);
        assert_eq!(extra, 2 * 256 * 500, "{experts:?}");
        for runtime in [Runtime::Stock, Runtime::Artifact] {
            assert_eq!(
                moe_prefill_ttft_ns(runtime, experts, 500),
                moe_prefill_ttft_ns(runtime, experts, 0),
                "{runtime:?} {experts:?}"
            );
        }
    }
}

/// Decode step time of a 2-layer qwen3-30b-a3b with its experts at `experts` and everything else pinned, free
/// ops and copies, 1 µs host syncs, with our executor's measured decode routing round trip `round_trip` (to the
/// CPU, to the GPU experts) and return from CPU experts `back`, over `seqs` sequences.
fn moe_decode_steps_ns(
    runtime: Runtime,
    experts: Placement,
    round_trip: (u64, u64),
    back: u64,
    seqs: u64,
) -> u64 {
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(256, 1024, 2, 256).batched(seqs, false);
    let p = plan(&spec, &w, SHAPE, &|u| {
        if matches!(u, UnitId::Expert { .. }) { experts } else { Placement::Pinned }
    });
    let cost = FixedCost {
        host_sync_ns: 1_000,
        decode_routing_ns: round_trip,
        decode_experts_return_ns: back,
        ..FixedCost::plain(0.0, 1e9)
    };
    let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
    sim.run(&pipeshard_sim::SimOptions::default()).metrics.decode_step_ns
}

fn moe_decode_step_ns(runtime: Runtime, experts: Placement, round_trip: (u64, u64)) -> u64 {
    moe_decode_steps_ns(runtime, experts, round_trip, 0, 1)
}

/// Where the profile measured our executor's decode routing round trip (router kernels' end to the first
/// expert's start), each MoE layer's routing takes at least that long, to whichever side runs the experts;
/// where it did not (0), the sync and copy model stands; llama.cpp's runtimes never use it.
#[test]
fn a_measured_decode_routing_round_trip_sets_each_layers_hand_off() {
    for (experts, round_trip, per_layer) in
        [(Placement::Cpu, (50_000, 0), 50_000), (Placement::Pinned, (0, 30_000), 30_000)]
    {
        let base = moe_decode_step_ns(Runtime::Ours, experts, (0, 0));
        let with = moe_decode_step_ns(Runtime::Ours, experts, round_trip);
        // Without it a layer's hand-offs are the syncs: one to the CPU, one more back up for GPU experts.
        let syncs = if experts == Placement::Cpu { 1_000 } else { 2_000 };
        assert_eq!(with - base, 2 * (per_layer - syncs), "{experts:?}");
        for runtime in [Runtime::Stock, Runtime::Artifact] {
            assert_eq!(
                moe_decode_step_ns(runtime, experts, round_trip),
                moe_decode_step_ns(runtime, experts, (0, 0)),
                "{runtime:?} {experts:?}"
            );
        }
    }
}

/// Where the profile measured our executor's return from a one-token decode step's CPU experts to the GPU
/// (their end to the device starting their sum), each MoE layer's hand-off back takes that instead of a sync
/// and a copy; GPU experts, batched decode steps, llama.cpp's runtimes and unmeasured profiles (0) keep the
/// sync and copy.
#[test]
fn a_measured_return_from_cpu_experts_sets_each_layers_hand_off_back() {
    let step = |runtime, experts, back, seqs| moe_decode_steps_ns(runtime, experts, (0, 0), back, seqs);
    let base = step(Runtime::Ours, Placement::Cpu, 0, 1);
    // Two layers, each hand-off back a 1 µs sync (copies are free) before, 25 µs after.
    assert_eq!(step(Runtime::Ours, Placement::Cpu, 25_000, 1) - base, 2 * (25_000 - 1_000));
    for (runtime, experts, seqs) in [
        (Runtime::Ours, Placement::Pinned, 1),
        (Runtime::Ours, Placement::Cpu, 4),
        (Runtime::Stock, Placement::Cpu, 1),
        (Runtime::Artifact, Placement::Cpu, 1),
    ] {
        assert_eq!(
            step(runtime, experts, 25_000, seqs),
            step(runtime, experts, 0, seqs),
            "{runtime:?} {experts:?} {seqs} sequences"
        );
    }
}

/// Beside an H2D copy the device's reads of host memory queue behind the copy's (validation, session 22):
/// where the profile measured the routing round trip and the return from CPU experts beside one, a decode
/// step's hand-off takes that figure if a copy is in flight as it starts, and its idle figure otherwise.
#[test]
fn decode_hand_offs_take_their_figures_beside_a_copy_where_one_streams() {
    let spec = small("qwen3-30b-a3b", 3);
    let w = Workload::single(256, 1024, 2, 256);
    let p = plan(&spec, &w, SHAPE, &|u| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        UnitId::Expert { .. } => Placement::Cpu,
        _ => Placement::Pinned,
    });
    let cost = FixedCost {
        host_sync_ns: 1_000,
        decode_routing_ns: (10_000, 0),
        decode_routing_beside_h2d_ns: (40_000, 0),
        decode_experts_return_ns: 7_000,
        decode_experts_return_beside_h2d_ns: 35_000,
        ..FixedCost::plain(0.01, 2.0)
    };
    let o = Simulator::new(&spec, &p, &cost)
        .unwrap()
        .with_runtime(Runtime::Ours)
        .step(PhaseKind::Decode, w.decode_step(0));
    let g = &o.graph;
    let copies: Vec<(u64, u64)> = (0..g.tasks.len())
        .filter(|&t| g.tasks[t].lane == Lane::H2d)
        .map(|t| (o.start_ns[t], o.end_ns[t]))
        .collect();
    let mut seen = Vec::new();
    for t in (0..g.tasks.len()).filter(|&t| g.tasks[t].lane == Lane::Handoff) {
        let (task, s) = (&g.tasks[t], o.start_ns[t]);
        let beside = copies.iter().any(|&(a, b)| a <= s && s < b);
        let want = if beside { task.duration_contended_ns } else { task.duration_ns };
        assert_eq!(o.end_ns[t] - s, want, "{} (beside a copy: {beside})", g.label(t as u32));
        if task.duration_contended_ns != task.duration_ns {
            seen.push(((task.duration_ns, task.duration_contended_ns), beside));
        }
    }
    // Each layer's routing to its CPU experts and their return, both ways in the step.
    for figures in [(10_000, 40_000), (7_000, 35_000)] {
        for beside in [true, false] {
            assert!(seen.contains(&(figures, beside)), "{figures:?} beside a copy: {beside} in {seen:?}");
        }
    }
}

/// A GPU routed-experts row of qwen3-30b-a3b's expert shape (768 × 2048, bf16).
fn expert_row(op: OpClass, tokens: u64, time_ns: u64) -> OpRow {
    OpRow::gpu(op, DType::Bf16, (768, 2048), tokens, time_ns)
}

/// Decode step time of a 2-layer bf16 qwen3-30b-a3b with its experts at `experts` and everything else pinned,
/// priced by the H200 profile whose routed-experts rows are 40 µs an expert and, with `grouped`, 8 µs for a
/// group of one expert and 20 µs for 8.
fn priced_moe_decode_step_ns(runtime: Runtime, experts: Placement, grouped: bool) -> u64 {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
    let mut profile = Profile::load(&path).unwrap();
    profile.gpu.ops.retain(|r| !matches!(r.op, OpClass::Experts | OpClass::ExpertsGrouped));
    profile.gpu.ops.extend([1, 64].map(|t| expert_row(OpClass::Experts, t, 40_000)));
    if grouped {
        profile
            .gpu
            .ops
            .extend([(1, 8_000), (8, 20_000)].map(|(e, t)| expert_row(OpClass::ExpertsGrouped, e, t)));
    }
    let cost = TableCostModel::new(&profile);
    let spec = small("qwen3-30b-a3b", 2).with_uniform_weights(DType::Bf16);
    let w = Workload::single(256, 1024, 2, 256);
    let p = plan(&spec, &w, SHAPE, &|u| {
        if matches!(u, UnitId::Expert { .. }) { experts } else { Placement::Pinned }
    });
    let sim = Simulator::new(&spec, &p, &cost).unwrap().with_runtime(runtime);
    sim.run(&pipeshard_sim::SimOptions::default()).metrics.decode_step_ns
}

/// Our executor runs a one-token step's pinned experts as one group: with grouped rows in the profile, each
/// layer's 8 experts cost the 8-expert group's 20 µs instead of 8 × 40 µs. Streamed and CPU experts, and
/// llama.cpp's runtimes, keep the per-expert rows.
#[test]
fn our_pinned_decode_experts_cost_the_grouped_rows() {
    let step = |runtime, experts, grouped| priced_moe_decode_step_ns(runtime, experts, grouped);
    let saved = step(Runtime::Ours, Placement::Pinned, false) - step(Runtime::Ours, Placement::Pinned, true);
    let want = 2.0 * (8.0 * 40e3 - 20e3);
    assert!((saved as f64 / want - 1.0).abs() < 0.02, "saved {saved} ns a step, want {want}");
    for experts in [Placement::Streamed, Placement::Cpu] {
        assert_eq!(step(Runtime::Ours, experts, true), step(Runtime::Ours, experts, false), "{experts:?}");
    }
    for runtime in [Runtime::Stock, Runtime::Artifact] {
        assert_eq!(
            step(runtime, Placement::Pinned, true),
            step(runtime, Placement::Pinned, false),
            "{runtime:?}"
        );
    }
}

/// One 1024-token prefill chunk (every expert touched) and one decode step of a 1-layer qwen3-30b-a3b whose
/// routed experts all stream through a 4-slot ring, everything else pinned; a GPU op at 1 ps a weight byte
/// (an expert ≈ 9.4 µs), copies at 100 bytes a ns (an expert ≈ 94 µs), our executor's host at `issue_ns` a
/// streamed part beyond its kernels.
fn streamed_experts(runtime: Runtime, issue_ns: u64) -> [pipeshard_sim::StepOutcome; 2] {
    streamed_experts_costing(
        runtime,
        &FixedCost { ring_copy_issue_ns: issue_ns, ..FixedCost::plain(0.001, 100.0) },
    )
}

/// [`streamed_experts`] priced by `cost`.
fn streamed_experts_costing(runtime: Runtime, cost: &FixedCost) -> [pipeshard_sim::StepOutcome; 2] {
    let spec = small("qwen3-30b-a3b", 1);
    let w = Workload::single(1024, 2048, 1, 1024);
    let shape = PhaseShape { pipeline_depth: 4, ..SHAPE };
    let p = plan(&spec, &w, shape, &|u| {
        if matches!(u, UnitId::Expert { .. }) { Placement::Streamed } else { Placement::Pinned }
    });
    let sim = Simulator::new(&spec, &p, cost).unwrap().with_runtime(runtime);
    [sim.step(PhaseKind::Prefill, w.prefill_chunks()[0]), sim.step(PhaseKind::Decode, w.decode_step(0))]
}

/// The streamed experts' tasks of a step: the hand-off that brought the routing up, and each part's compute.
fn streamed_parts(o: &pipeshard_sim::StepOutcome) -> (u32, Vec<u32>) {
    let g = &o.graph;
    let routed = g.deps(g.items[0].copy)[0];
    assert!(matches!(g.tasks[routed as usize].kind, TaskKind::Handoff { .. }));
    (routed, g.items.iter().map(|i| i.last_reader).collect())
}

/// Where our executor's host takes longer to enqueue a streamed expert (its ring copy issue and span, then its
/// kernels) than PCIe takes to copy one, the host paces the layer: from the routing's arrival to the last
/// streamed expert's end, each part costs the issue plus its kernels, whatever the copies.
#[test]
fn a_host_slower_than_the_copies_paces_a_layers_streamed_experts() {
    let issue_ns = 200_000;
    let [prefill, decode] = streamed_experts(Runtime::Ours, issue_ns);
    let (routed, parts) = streamed_parts(&prefill);
    assert_eq!(parts.len(), 128, "every expert touched, one part each");
    let g = &prefill.graph;
    let kernels_ns = g.tasks[parts[0] as usize].duration_ns;
    let copy_ns = g.tasks[g.items[0].copy as usize].duration_ns;
    assert!(issue_ns + kernels_ns > copy_ns, "the regime assumed: {kernels_ns} + {issue_ns} vs {copy_ns}");
    let span = prefill.end_ns[*parts.last().unwrap() as usize] - prefill.end_ns[routed as usize];
    assert_eq!(span, 128 * (issue_ns + kernels_ns));
    let free = streamed_experts(Runtime::Ours, 0)[0].makespan_ns;
    assert!(prefill.makespan_ns > free + 128 * issue_ns / 2, "{} vs {free}", prefill.makespan_ns);
    // The host enqueues every part, one at a time, and no copy starts before the host issued it.
    for o in [&prefill, &decode] {
        let g = &o.graph;
        let host: Vec<usize> = (0..g.tasks.len()).filter(|&t| g.tasks[t].lane == Lane::Host).collect();
        assert_eq!(host.len(), g.items.len());
        assert!(host.windows(2).all(|w| o.end_ns[w[0]] <= o.start_ns[w[1]]), "one enqueue at a time");
        for (item, &e) in g.items.iter().zip(&host).skip(3) {
            assert!(matches!(g.tasks[e].kind, TaskKind::Enqueue { .. }));
            assert!(g.deps(item.copy).iter().any(|&d| g.tasks[d as usize].lane == Lane::Host));
        }
    }
}

/// Where the host enqueues faster than PCIe copies, the copies pace the layer, as without the issue priced;
/// unmeasured (0), it is not priced at all, and llama.cpp's runtimes never pay it.
#[test]
fn a_host_faster_than_the_copies_leaves_the_layer_copy_paced() {
    let makespans = |runtime: Runtime, issue_ns: u64| {
        streamed_experts(runtime, issue_ns).map(|o| (o.makespan_ns, o.graph.tasks.len()))
    };
    let [(free, free_tasks), (free_decode, _)] = makespans(Runtime::Ours, 0);
    let [(fast, fast_tasks), (fast_decode, _)] = makespans(Runtime::Ours, 20_000);
    assert_eq!((fast, fast_decode), (free, free_decode));
    assert_eq!(fast_tasks, free_tasks + 128, "one enqueue a part");
    let [prefill, _] = streamed_experts(Runtime::Ours, 0);
    assert!(prefill.graph.tasks.iter().all(|t| t.lane != Lane::Host), "not priced at 0");
    for runtime in [Runtime::Stock, Runtime::Artifact] {
        assert_eq!(makespans(runtime, 200_000), makespans(runtime, 0), "{runtime:?}");
    }
}

/// Our executor's ring copies each take the copy engine's gap beyond the copy (the slot's wait and events):
/// every ring item's copy grows by it, so a copy-paced layer of 128 streamed experts by 128 gaps; llama.cpp's
/// runtimes never pay it.
#[test]
fn our_ring_copies_take_the_copy_engines_gap() {
    let gap_ns = 10_000;
    for runtime in [Runtime::Ours, Runtime::Stock, Runtime::Artifact] {
        let prefill = |ring_copy_gap_ns| {
            let cost = FixedCost { ring_copy_gap_ns, ..FixedCost::plain(0.001, 100.0) };
            let [p, _] = streamed_experts_costing(runtime, &cost);
            p
        };
        let (plain, gapped) = (prefill(0), prefill(gap_ns));
        let copies = |o: &pipeshard_sim::StepOutcome| -> Vec<u64> {
            o.graph.items.iter().map(|i| o.graph.tasks[i.copy as usize].duration_ns).collect()
        };
        let paid = if runtime == Runtime::Ours { gap_ns } else { 0 };
        assert!(!plain.graph.items.is_empty(), "{runtime:?}: experts stream");
        assert_eq!(
            copies(&gapped),
            copies(&plain).iter().map(|c| c + paid).collect::<Vec<_>>(),
            "{runtime:?}"
        );
        if runtime == Runtime::Ours {
            let grown = gapped.makespan_ns - plain.makespan_ns;
            assert!(grown >= 127 * gap_ns, "a copy-paced layer grows by a gap a copy: {grown} ns");
        }
    }
}
