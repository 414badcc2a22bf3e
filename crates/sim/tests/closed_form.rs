//! Cases with a closed-form answer: all pinned, all on the CPU, all streamed at depth 1 and 2.

mod common;

use common::{FixedCost, PhaseShape, plan, small, uniform};
use pipeshard_core::cost::{CostModel, Device, OpContext};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::workload::{self, Op, Phase, Workload};
use pipeshard_sim::graph::TaskKind;
use pipeshard_sim::{Lane, Runtime, Simulator};

const SHAPE: PhaseShape = PhaseShape { pipeline_depth: 0, op_offload: false, cpu_threads: 8 };

fn ops_of(spec: &pipeshard_core::model::ModelSpec, w: &Workload, phase: Phase) -> Vec<Op> {
    workload::ops(spec, &Inventory::new(spec), w, phase)
}

#[test]
fn all_pinned_is_the_sum_of_op_times_at_least_a_launch_each() {
    for (name, expert_ids_on_device) in
        [("nemo-4b", false), ("qwen3-30b-a3b", false), ("qwen3-30b-a3b", true)]
    {
        let cost = FixedCost {
            launch_ns: 3_000,
            host_sync_ns: 7_000,
            weightless_ns: 500,
            expert_ids_on_device,
            ..FixedCost::plain(0.01, 20.0)
        };
        let spec = small(name, 3);
        let w = Workload::single(700, 1024, 4, 256);
        let p = plan(&spec, &w, SHAPE, &uniform(Placement::Pinned));
        let sim = Simulator::new(&spec, &p, &cost).unwrap();
        for (kind, phase) in [
            (PhaseKind::Decode, w.decode_step(2)),
            (PhaseKind::Prefill, w.prefill_chunks()[0]),
            (PhaseKind::Prefill, w.prefill_chunks()[2]),
        ] {
            let ops = ops_of(&spec, &w, phase);
            let compute: u64 = ops.iter().map(|o| cost.op_ns(o, OpContext::gpu()).max(cost.launch_ns)).sum();
            // Token ids in; sampled tokens (or nothing, for a chunk without logits) out after a host sync; in a
            // MoE layer, the routing: the router's output down to the host and back, a sync each way, unless the
            // expert kernels read it on the device.
            let act = phase.tokens() * spec.text.hidden * 4;
            let host_routed = spec.text.moe.is_some() && !expert_ids_on_device;
            let moe_layers = if host_routed { u64::from(spec.text.n_layers) } else { 0 };
            let routing =
                moe_layers * (2 * cost.host_sync_ns + cost.d2h_ns(act, true) + cost.h2d_ns(act, true));
            let handoffs = cost.h2d_ns(phase.tokens() * 4, true)
                + cost.host_sync_ns
                + cost.d2h_ns(phase.logit_rows() * 4, true)
                + routing;
            let o = sim.step(kind, phase);
            assert_eq!(
                o.makespan_ns,
                compute + handoffs,
                "{name} {phase:?} (ids on device: {expert_ids_on_device})"
            );
            assert_eq!(o.total_busy_ns(), [compute, 0, 0, 0], "{name} {phase:?}: only the GPU works");
        }
    }
}

#[test]
fn all_cpu_is_the_cpu_sum_without_copies() {
    let cost = FixedCost {
        launch_ns: 3_000,
        host_sync_ns: 7_000,
        weightless_ns: 900,
        ..FixedCost::plain(0.01, 20.0)
    };
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(300, 512, 3, 128);
    let p = plan(&spec, &w, SHAPE, &uniform(Placement::Cpu));
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    for (kind, phase) in [(PhaseKind::Decode, w.decode_step(0)), (PhaseKind::Prefill, w.prefill_chunks()[1])]
    {
        let ops = ops_of(&spec, &w, phase);
        let cpu: u64 = ops.iter().map(|o| cost.op_ns(o, OpContext::cpu(8))).sum();
        let o = sim.step(kind, phase);
        assert_eq!(o.makespan_ns, cpu);
        assert_eq!(o.total_busy_ns(), [0, 0, 0, cpu]);
        assert!(o.graph.tasks.iter().all(|t| t.lane == Lane::Cpu), "no copies, no hand-offs");
    }
    let run = sim.run(&pipeshard_sim::SimOptions::default());
    assert_eq!(run.metrics.busy(pipeshard_core::metrics::Resource::H2d), 0);
    for used in run.vram_used {
        // Nothing on the GPU: no weights, no slots, no KV and no scratch there.
        assert_eq!(used.total(), used.runtime_overhead_bytes);
    }
}

/// The streamed layer units of a decode step in ring order, with copy time c and compute time p.
fn stages(
    spec: &pipeshard_core::model::ModelSpec,
    w: &Workload,
    cost: &FixedCost,
    phase: Phase,
) -> Vec<(u64, u64)> {
    let inv = Inventory::new(spec);
    let ops = ops_of(spec, w, phase);
    let mut out: Vec<(UnitId, u64, u64)> = Vec::new();
    for o in &ops {
        if matches!(o.unit, UnitId::Attn { .. } | UnitId::Ffn { .. }) && o.weight_bytes > 0.0 {
            let t = cost.op_ns(o, OpContext::gpu());
            match out.last_mut() {
                Some(last) if last.0 == o.unit => last.2 += t,
                _ => out.push((o.unit, cost.h2d_ns(inv.unit_bytes(o.unit), true), t)),
            }
        }
    }
    out.into_iter().map(|(_, c, p)| (c, p)).collect()
}

/// Dense model, layer weights streamed, embedding / head / KV pinned, no launch or sync cost: the textbook
/// two-stage pipeline (copy, compute) with a buffer of `depth` slots.
fn streamed_case(gpu_ns_per_byte: f64, depth: u32) -> (u64, Vec<(u64, u64)>, u64, u64) {
    let cost = FixedCost::plain(gpu_ns_per_byte, 25.0);
    let spec = small("nemo-8b", 4);
    let w = Workload::single(1000, 2048, 2, 512);
    let place = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Ffn { .. } => Placement::Streamed,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: depth, ..SHAPE }, &place);
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let phase = w.decode_step(0);
    let o = sim.step(PhaseKind::Decode, phase);
    let ops = ops_of(&spec, &w, phase);
    let embd = cost.h2d_ns(4, true) + cost.op_ns(&ops[0], OpContext::gpu());
    let tail: u64 =
        ops.iter().filter(|o| o.unit == UnitId::Output).map(|o| cost.op_ns(o, OpContext::gpu())).sum::<u64>()
            + cost.d2h_ns(4, true);
    (o.makespan_ns, stages(&spec, &w, &cost, phase), embd, tail)
}

#[test]
fn streamed_depth_one_serialises_copy_and_compute() {
    let (t, st, embd, tail) = streamed_case(0.05, 1);
    // Copy 0 overlaps the embedding; every later copy waits for the previous unit's compute.
    let (c0, p0) = st[0];
    let rest: u64 = st[1..].iter().map(|(c, p)| c + p).sum();
    assert_eq!(t, embd.max(c0) + p0 + rest + tail);
}

#[test]
fn streamed_depth_two_copy_bound_is_the_sum_of_copies() {
    // Compute ≪ copy: copies run back to back; only the last unit's compute sticks out.
    let (t, st, _, tail) = streamed_case(0.0005, 2);
    assert!(st.windows(2).all(|w| w[0].1 <= w[1].0), "the regime assumed by the formula");
    let copies: u64 = st.iter().map(|s| s.0).sum();
    assert_eq!(t, copies + st.last().unwrap().1 + tail);
}

#[test]
fn streamed_depth_two_compute_bound_is_the_sum_of_computes() {
    // Copy ≪ compute: after the first copy the GPU never waits.
    let (t, st, embd, tail) = streamed_case(2.0, 2);
    assert!(st.windows(2).all(|w| w[1].0 <= w[0].1), "the regime assumed by the formula");
    let computes: u64 = st.iter().map(|s| s.1).sum();
    assert_eq!(t, embd.max(st[0].0) + computes + tail);
}

#[test]
fn streamed_depth_two_follows_the_buffered_flow_shop_recurrence() {
    for gpu_ns_per_byte in [0.01, 0.04, 0.1] {
        for depth in [1u32, 2, 3] {
            let (t, st, embd, tail) = streamed_case(gpu_ns_per_byte, depth);
            // copy k starts when copy k-1 is done and unit k-depth has released its slot.
            let d = depth as usize;
            let (mut copy_end, mut comp_end) = (0u64, embd);
            let mut release: Vec<u64> = Vec::new();
            for (k, &(c, p)) in st.iter().enumerate() {
                let free = if k >= d { release[k - d] } else { 0 };
                copy_end = copy_end.max(free) + c;
                comp_end = comp_end.max(copy_end) + p;
                release.push(comp_end);
            }
            assert_eq!(t, comp_end + tail, "β {gpu_ns_per_byte} depth {depth}");
        }
    }
    let (t1, ..) = streamed_case(0.04, 1);
    let (t2, st, ..) = streamed_case(0.04, 2);
    let (c, p): (u64, u64) = st.iter().fold((0, 0), |a, s| (a.0 + s.0, a.1 + s.1));
    assert!(t2 < t1 && t2 >= c.max(p), "depth 2 overlaps: {t2} < {t1}, ≥ max(Σc {c}, Σp {p})");
}

#[test]
fn moe_experts_split_runs_gpu_and_cpu_shares_concurrently() {
    let cost = FixedCost { launch_ns: 1_000, host_sync_ns: 5_000, ..FixedCost::plain(0.01, 25.0) };
    let spec = small("qwen3-30b-a3b", 1);
    let w = Workload::single(100, 512, 2, 64);
    // Half the experts pinned, a quarter streamed, a quarter on the CPU.
    let place = |u: UnitId| match u {
        UnitId::Expert { expert, .. } if expert < 64 => Placement::Pinned,
        UnitId::Expert { expert, .. } if expert < 96 => Placement::Streamed,
        UnitId::Expert { .. } => Placement::Cpu,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 1, ..SHAPE }, &place);
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let o = sim.step(PhaseKind::Decode, w.decode_step(0));
    let g = &o.graph;
    let share = |pl: Placement| {
        (0..g.tasks.len() as u32)
            .find(|&t| {
                matches!(g.tasks[t as usize].kind, TaskKind::Compute { share: pipeshard_sim::graph::OpShare::Experts(x), .. } if x == pl)
            })
            .unwrap()
    };
    let (gpu, streamed, cpu) = (share(Placement::Pinned), share(Placement::Streamed), share(Placement::Cpu));
    let span = |t: u32| (o.start_ns[t as usize], o.end_ns[t as usize]);
    assert!(span(cpu).0 < span(gpu).1 && span(gpu).0 < span(cpu).1, "GPU and CPU shares overlap in time");
    // Expected work: 8 touched of 128, so the CPU share is 32/128 of the op.
    let experts = ops_of(&spec, &w, w.decode_step(0))
        .into_iter()
        .find(|o| o.kind.class() == pipeshard_core::workload::OpClass::Experts)
        .unwrap();
    let want = cost.op_ns(&Op { weight_bytes: experts.weight_bytes / 4.0, ..experts }, OpContext::cpu(8));
    assert_eq!(g.tasks[cpu as usize].duration_ns, want);
    // The streamed share: 32 experts × 8/128 touched = 2 experts, two ring items of one expert each, each
    // copied once the router has run and computed as it arrives.
    let expert_bytes = Inventory::new(&spec).unit_bytes(UnitId::Expert { layer: 0, expert: 0 });
    assert_eq!(g.items.len(), 2);
    assert!(g.items.iter().all(|i| i.bytes == expert_bytes));
    let shares: Vec<u32> = g.items.iter().map(|i| i.last_reader).collect();
    assert_eq!(shares[0], streamed);
    let router = (0..g.tasks.len() as u32).find(|&t| g.label(t).ends_with("router")).unwrap();
    for (item, &t) in g.items.iter().zip(&shares) {
        // The copy waits for the routing: the router's output at the host and the expert ids back up.
        let routed = g.deps(item.copy)[0];
        assert!(matches!(g.tasks[routed as usize].kind, TaskKind::Handoff { to: Device::Gpu }));
        assert!(o.start_ns[item.copy as usize] >= o.end_ns[routed as usize]);
        assert!(o.start_ns[routed as usize] >= o.end_ns[router as usize] + cost.host_sync_ns);
        assert!(o.start_ns[t as usize] >= o.end_ns[item.copy as usize]);
    }
    // The residual add joins every share, after handing the CPU share back to the GPU.
    let add = (0..g.tasks.len() as u32).find(|&t| g.label(t) == "blk.0.router add").unwrap();
    for t in [gpu, shares[0], shares[1], cpu] {
        assert!(o.start_ns[add as usize] >= o.end_ns[t as usize]);
    }
    assert_eq!(g.device(add), Some(Device::Gpu));
}

/// A decode step of nemo-4b@3L with its attention streamed on the GPU and its FFN on the CPU, where each CPU
/// FFN overlaps the next attention's copy, priced by `cost`.
fn streamed_attention_cpu_ffn_step(cost: &FixedCost) -> pipeshard_sim::StepOutcome {
    let spec = small("nemo-4b", 3);
    let w = Workload::single(100, 512, 2, 64);
    let place = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        UnitId::Ffn { .. } => Placement::Cpu,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, ..SHAPE }, &place);
    Simulator::new(&spec, &p, cost).unwrap().step(PhaseKind::Decode, w.decode_step(0))
}

#[test]
fn cpu_ops_slow_down_while_a_copy_is_in_flight() {
    let run = |slow: f64| {
        streamed_attention_cpu_ffn_step(&FixedCost { dma_slowdown: slow, ..FixedCost::plain(0.01, 2.0) })
    };
    let (fast, slow) = (run(1.0), run(1.5));
    assert!(slow.makespan_ns > fast.makespan_ns);
    // A CPU op entirely inside one copy runs at the under-DMA rate.
    let g = &slow.graph;
    let copies: Vec<usize> = (0..g.tasks.len()).filter(|&t| g.tasks[t].lane == Lane::H2d).collect();
    let mut checked = 0;
    for t in (0..g.tasks.len()).filter(|&t| g.tasks[t].lane == Lane::Cpu && g.tasks[t].duration_ns > 0) {
        let (s, e) = (slow.start_ns[t], slow.end_ns[t]);
        if copies.iter().any(|&c| slow.start_ns[c] <= s && e <= slow.end_ns[c]) {
            assert_eq!(e - s, g.tasks[t].duration_contended_ns, "{}", g.label(t as u32));
            checked += 1;
        }
    }
    assert!(checked > 0, "the plan must put a CPU op under a copy");
}

#[test]
fn h2d_copies_slow_down_while_the_cpu_pool_computes() {
    // Each copy's DMA reads the host DRAM the CPU FFN beside it reads.
    let run = |slow: f64| {
        streamed_attention_cpu_ffn_step(&FixedCost { h2d_cpu_slowdown: slow, ..FixedCost::plain(0.01, 2.0) })
    };
    let (fast, slow) = (run(1.0), run(1.5));
    assert!(slow.makespan_ns > fast.makespan_ns);
    // Every copy's time splits into a part with the pool idle, at its own rate, and a part beside the pool's
    // work, at the contended one: together one whole copy.
    let g = &slow.graph;
    let cpu: Vec<(u64, u64)> = (0..g.tasks.len())
        .filter(|&t| g.tasks[t].lane == Lane::Cpu)
        .map(|t| (slow.start_ns[t], slow.end_ns[t]))
        .collect();
    let (mut beside, mut alone) = (0, 0);
    for c in (0..g.tasks.len()).filter(|&t| g.tasks[t].lane == Lane::H2d && g.tasks[t].duration_ns > 0) {
        let (s, e) = (slow.start_ns[c], slow.end_ns[c]);
        let busy: u64 = cpu.iter().map(|&(a, b)| b.min(e).saturating_sub(a.max(s))).sum();
        let task = &g.tasks[c];
        assert!(task.duration_contended_ns > task.duration_ns, "{}", g.label(c as u32));
        let work =
            (e - s - busy) as f64 / task.duration_ns as f64 + busy as f64 / task.duration_contended_ns as f64;
        assert!((work - 1.0).abs() < 1e-3, "{}: {work} of a copy", g.label(c as u32));
        if busy > 0 { beside += 1 } else { alone += 1 }
    }
    assert!(beside > 0 && alone > 0, "the plan must run copies both beside the pool and without it");
    // The copy lane's busy time is the copies' real time, the slower rate included.
    let h2d = |o: &pipeshard_sim::StepOutcome| o.total_busy_ns()[1];
    assert!(h2d(&slow) > h2d(&fast));
}

#[test]
fn op_offload_copies_cpu_weights_then_computes_serially() {
    let cost = FixedCost { launch_ns: 2_000, host_sync_ns: 4_000, ..FixedCost::plain(0.01, 25.0) };
    let spec = small("nemo-4b", 2);
    let w = Workload::single(200, 512, 2, 128);
    let place = |u: UnitId| match u {
        UnitId::Attn { layer: 1 } | UnitId::Ffn { layer: 1 } | UnitId::Kv { layer: 1 } | UnitId::Output => {
            Placement::Pinned
        }
        _ => Placement::Cpu,
    };
    let p = plan(&spec, &w, PhaseShape { op_offload: true, ..SHAPE }, &place);
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let o = sim.step(PhaseKind::Prefill, w.prefill_chunks()[0]);
    let g = &o.graph;
    let inv = Inventory::new(&spec);
    let (attn, ffn, kv) = (UnitId::Attn { layer: 0 }, UnitId::Ffn { layer: 0 }, UnitId::Kv { layer: 0 });
    let mut copied = Vec::new();
    for t in 0..g.tasks.len() as u32 {
        let TaskKind::Offload { op } = g.tasks[t as usize].kind else { continue };
        let op = &g.ops[op as usize];
        assert_eq!(op.unit.layer(), Some(0), "only layer 0 is CPU-resident");
        // A unit's weights in one copy, as the executor stages them, at its first op; the attention copies
        // the cache view it reads (ggml's scheduler runs it on the GPU between the offloaded projections).
        let want = if op.unit == kv { op.kv_bytes as u64 } else { inv.unit_bytes(op.unit) };
        assert_eq!(g.tasks[t as usize].bytes, want, "{}", op.unit);
        copied.push((op.unit, want));
        // The copy starts after the previous op ended, and every op of its unit runs on the GPU after it.
        let users: Vec<u32> = (0..g.tasks.len() as u32).filter(|&u| g.deps(u).contains(&t)).collect();
        assert!(!users.is_empty());
        for &user in &users {
            assert_eq!(g.device(user), Some(Device::Gpu));
            assert!(o.start_ns[user as usize] >= o.end_ns[t as usize]);
        }
        for &d in g.deps(t) {
            assert!(o.start_ns[t as usize] >= o.end_ns[d as usize]);
        }
    }
    let units: Vec<UnitId> = copied.iter().map(|c| c.0).collect();
    assert_eq!(units, [attn, kv, ffn], "each unit once per pass, the attention's o after the cache view");
    // q, k, v, o, gate/up, down and both norms wait for their unit's copy.
    let waiting = |u: UnitId| {
        let copy = (0..g.tasks.len() as u32)
            .find(|&t| matches!(g.tasks[t as usize].kind, TaskKind::Offload { op } if g.ops[op as usize].unit == u))
            .unwrap();
        (0..g.tasks.len() as u32).filter(|&t| g.deps(t).contains(&copy)).count()
    };
    assert_eq!(waiting(attn), 5, "norm, q, k, v, o");
    assert_eq!(waiting(ffn), 3, "norm, up, down (a squared-ReLU FFN: no gate)");
    // The largest staged unit sits in scratch.
    assert_eq!(g.offload_peak_bytes, copied.iter().map(|c| c.1).max().unwrap());
    // Decode does not offload: layer 0 computes on the CPU.
    let d = sim.step(PhaseKind::Decode, w.decode_step(0));
    assert!(d.graph.tasks.iter().all(|t| !matches!(t.kind, TaskKind::Offload { .. })));
    assert!(d.total_busy_ns()[3] > 0);
}

#[test]
fn streamed_kv_shares_its_attention_slot_and_is_written_back_before_reuse() {
    let cost = FixedCost::plain(0.01, 25.0);
    let spec = small("nemo-4b", 3);
    let w = Workload::single(900, 1024, 2, 512);
    let place = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        _ => Placement::Cpu,
    };
    // One slot carries a layer's streamed attention and its streamed KV (core's stream groups), so a depth-1
    // ring serialises layer by layer.
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 1, ..SHAPE }, &place);
    let kv = w.kv_bytes_per_layer(&spec);
    assert_eq!(p.decode.slot_bytes, Inventory::new(&spec).unit_bytes(UnitId::Attn { layer: 0 }) + kv);
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let o = sim.step(PhaseKind::Decode, w.decode_step(0));
    let g = &o.graph;
    let kv_tok = spec.kv_bytes_per_token_layer(w.kv_dtype);
    let writebacks: Vec<usize> =
        (0..g.tasks.len()).filter(|&t| matches!(g.tasks[t].kind, TaskKind::KvWriteback { .. })).collect();
    assert_eq!(writebacks.len(), 3);
    for &t in &writebacks {
        assert_eq!(g.tasks[t].bytes, kv_tok);
        let item = g.tasks[t].item.unwrap();
        let release = o.slot_uses.iter().find(|s| s.item == item).unwrap().released_ns;
        assert!(release >= o.end_ns[t], "the slot is not reused before the write-back");
    }
    let kv_uploads: Vec<u64> = g
        .tasks
        .iter()
        .filter(|t| matches!(t.kind, TaskKind::Stream { .. }))
        .map(|t| t.bytes)
        .filter(|&b| b == 900 * kv_tok)
        .collect();
    assert_eq!(kv_uploads.len(), 3, "the prompt's 900 cells before the step's token, every layer");
    assert_eq!(g.items.len(), 3, "attention weights and KV share one item");
    for (item, it) in g.items.iter().enumerate() {
        let attn = Inventory::new(&spec).unit_bytes(UnitId::Attn { layer: 0 });
        assert!(it.with_kv && it.bytes == attn + 900 * kv_tok && it.bytes <= p.decode.slot_bytes);
        // The projections wait for the weights only; the attention waits for the KV copy.
        let readers: Vec<u32> = (0..g.tasks.len() as u32)
            .filter(|&t| g.tasks[t as usize].item == Some(item as u32) && g.device(t).is_some())
            .collect();
        let kv_copy = (0..g.tasks.len() as u32)
            .find(|&t| {
                matches!(g.tasks[t as usize].kind, TaskKind::Stream { .. })
                    && g.tasks[t as usize].item == Some(item as u32)
                    && t != it.copy
            })
            .unwrap();
        for t in readers {
            let waits_kv = g.deps(t).contains(&kv_copy);
            assert_eq!(waits_kv, g.label(t).contains("attention"), "{}", g.label(t));
            assert!(waits_kv || g.deps(t).contains(&it.copy), "{}", g.label(t));
        }
    }
}

#[test]
fn decode_steps_overlap_the_next_steps_copies() {
    let cost = FixedCost { launch_ns: 2_000, host_sync_ns: 6_000, ..FixedCost::plain(0.02, 25.0) };
    let spec = small("nemo-8b", 4);
    let w = Workload::single(1000, 2048, 4, 512);
    let place = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Ffn { .. } => Placement::Streamed,
        UnitId::TokenEmbd => Placement::Cpu,
        _ => Placement::Pinned,
    };
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, ..SHAPE }, &place);
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let phase = w.decode_step(1);
    let cold = sim.step(PhaseKind::Decode, phase);
    let two = sim.steps(PhaseKind::Decode, &[phase, phase]);
    let g = &two.graph;
    let steady = two.step_end_ns[1] - two.step_end_ns[0];
    assert_eq!(two.step_end_ns[0], cold.step_end_ns[0], "the first step is the cold one");
    // The second step's first copies ran during the first step's tail.
    let first_copy = g.items.iter().map(|i| i.copy).find(|&c| g.tasks[c as usize].step == 1).unwrap();
    assert!(two.start_ns[first_copy as usize] < two.step_end_ns[0]);
    assert!(steady < cold.makespan_ns, "steady {steady} < cold {}", cold.makespan_ns);
    let [gpu, h2d, ..] = two.busy_ns[1];
    assert!(steady >= gpu.max(h2d) && h2d == two.busy_ns[0][1]);
}

/// Without flash attention the score matrix is the largest temporary at long context; it is GPU scratch only
/// when some attention runs on the GPU (llama.cpp keeps KQ of CPU layers on the host): llama.cpp's runtimes.
#[test]
fn attention_scratch_counts_only_where_attention_runs() {
    let cost = FixedCost::plain(0.01, 20.0);
    let spec = small("nemo-4b", 2);
    let mut w = Workload::single(8000, 8192, 4, 1024);
    w.flash_attn = false;
    let chunk = w.prefill_chunks()[7];
    let parts = workload::scratch_parts(&spec, &w, chunk);
    assert!(parts.attention_bytes > 4 * parts.ffn_bytes, "the score matrix dominates: {parts:?}");
    let ffn_on_gpu = |u: UnitId| match u {
        UnitId::Ffn { .. } => Placement::Pinned,
        _ => Placement::Cpu,
    };
    let attn_on_gpu = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Pinned,
        _ => Placement::Cpu,
    };
    let prefill_scratch = |place: &dyn Fn(UnitId) -> Placement| {
        let p = plan(&spec, &w, SHAPE, place);
        Simulator::new(&spec, &p, &cost)
            .unwrap()
            .with_runtime(Runtime::Stock)
            .run(&pipeshard_sim::SimOptions::default())
            .metrics
            .vram_peak
            .scratch_bytes
    };
    // The peak is over every chunk: FFN temporaries peak at a full chunk, scores at the longest context.
    let peak = |term: &dyn Fn(&workload::ScratchParts) -> u64| {
        w.prefill_chunks().into_iter().map(|c| term(&workload::scratch_parts(&spec, &w, c))).max().unwrap()
    };
    assert_eq!(prefill_scratch(&ffn_on_gpu), peak(&|p| p.residual_bytes + p.ffn_bytes));
    assert_eq!(prefill_scratch(&attn_on_gpu), peak(&|p| p.residual_bytes + p.attention_bytes));
    assert!(prefill_scratch(&ffn_on_gpu) < parts.attention_bytes);
}

/// A MoE layer's router on the GPU beside its attention (pshard's ATTN_PRIO strategies) makes no FFN
/// intermediates there while its experts run on the CPU: the artifact's runtime.
#[test]
fn a_router_alone_on_the_gpu_needs_no_ffn_scratch() {
    let cost = FixedCost::plain(0.01, 20.0);
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(2000, 2048, 4, 1024);
    let attn_and_router = |u: UnitId| match u {
        UnitId::Attn { .. } | UnitId::Kv { .. } | UnitId::Router { .. } => Placement::Pinned,
        _ => Placement::Cpu,
    };
    let p = plan(&spec, &w, SHAPE, &attn_and_router);
    let scratch = Simulator::new(&spec, &p, &cost)
        .unwrap()
        .with_runtime(Runtime::Artifact)
        .run(&pipeshard_sim::SimOptions::default())
        .metrics
        .vram_peak
        .scratch_bytes;
    let peak = w
        .prefill_chunks()
        .into_iter()
        .map(|c| {
            let parts = workload::scratch_parts(&spec, &w, c);
            parts.residual_bytes + parts.attention_bytes
        })
        .max()
        .unwrap();
    let ffn = workload::scratch_parts(&spec, &w, w.prefill_chunks()[0]).ffn_bytes;
    assert!(
        ffn > workload::scratch_parts(&spec, &w, w.prefill_chunks()[0]).attention_bytes,
        "the test needs FFN to dominate"
    );
    assert_eq!(scratch, peak);
}

/// Our runtime's scratch is what our executor carves for the largest step (core's `exec_scratch_bytes`): a
/// prefill chunk of 1024 tokens with one logits row, whatever runs where, and the same in every phase that uses
/// the GPU; a phase all on the CPU takes none.
#[test]
fn our_scratch_is_the_executors_carve_of_the_largest_step() {
    let cost = FixedCost::plain(0.01, 20.0);
    for name in ["nemo-4b", "qwen3-30b-a3b"] {
        let spec = small(name, 2);
        let w = Workload::single(3000, 4096, 4, 1024);
        let chunk = workload::exec_scratch_bytes(&spec, 1024, 1, w.ctx);
        let decode = workload::exec_scratch_bytes(&spec, 1, 1, w.ctx);
        for (what, place) in
            [("all pinned", uniform(Placement::Pinned)), ("all streamed", uniform(Placement::Streamed))]
        {
            let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, ..SHAPE }, &place);
            let sim = Simulator::new(&spec, &p, &cost).unwrap().run(&pipeshard_sim::SimOptions::default());
            assert_eq!(sim.vram_used[0].scratch_bytes, chunk, "{name} {what}: prefill");
            assert_eq!(sim.vram_used[1].scratch_bytes, decode, "{name} {what}: decode");
        }
        let p = plan(&spec, &w, SHAPE, &uniform(Placement::Cpu));
        let sim = Simulator::new(&spec, &p, &cost).unwrap().run(&pipeshard_sim::SimOptions::default());
        assert_eq!(sim.vram_used[0].scratch_bytes, 0, "{name}: all on the CPU");
        assert!(
            chunk < workload::scratch_bytes(&spec, &w, w.prefill_chunks()[0]),
            "{name}: planners cover it"
        );
    }
}

/// One phase simulated alone takes what the whole run reports for it.
#[test]
fn a_phase_alone_times_as_in_the_whole_run() {
    let cost = FixedCost::plain(0.01, 20.0);
    let spec = small("qwen3-30b-a3b", 2);
    let w = Workload::single(3000, 4096, 8, 1024);
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, ..SHAPE }, &uniform(Placement::Streamed));
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    let opts = pipeshard_sim::SimOptions::default();
    let run = sim.run(&opts);
    assert!(run.switch_ns > 0 || run.decode_ns > 0);
    assert_eq!(sim.phase_ns(PhaseKind::Prefill, &opts), run.prefill_ns);
    assert_eq!(sim.phase_ns(PhaseKind::Decode, &opts), run.decode_ns - run.switch_ns);
}
