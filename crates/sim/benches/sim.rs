//! Criterion benches of the simulator's hot paths on the largest catalog model, qwen3-235b-a22b (94 layers,
//! 128 experts per layer), with a plan that uses every mechanism: pinned and streamed attention with streamed
//! KV, and each layer's experts split 16 pinned / 48 streamed / 64 on the CPU.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;

use common::{PhaseShape, plan};
use criterion::{Criterion, criterion_group, criterion_main};
use pipeshard_core::catalog;
use pipeshard_core::inventory::UnitId;
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::workload::{Phase, Workload};
use pipeshard_sim::{SimOptions, Simulator};

fn place(u: UnitId) -> Placement {
    match u {
        UnitId::Attn { layer } | UnitId::Kv { layer } if layer < 40 => Placement::Pinned,
        UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
        UnitId::Expert { expert, .. } if expert < 16 => Placement::Pinned,
        UnitId::Expert { expert, .. } if expert < 64 => Placement::Streamed,
        UnitId::Expert { .. } | UnitId::TokenEmbd => Placement::Cpu,
        _ => Placement::Pinned,
    }
}

fn benches(c: &mut Criterion) {
    let spec = catalog::get("qwen3-235b-a22b").unwrap();
    let w = Workload::single(16_000, 16_384, 100, 1024);
    let p = plan(&spec, &w, PhaseShape { pipeline_depth: 2, op_offload: false, cpu_threads: 16 }, &place);
    let cost = common::cli3();
    let sim = Simulator::new(&spec, &p, &cost).unwrap();
    c.bench_function("sim_decode_step", |b| {
        b.iter(|| sim.step(PhaseKind::Decode, black_box(w.decode_step(50))).makespan_ns);
    });
    let chunk = Phase::Prefill { tokens: 1024, start_pos: 8192, last: false };
    c.bench_function("sim_prefill_chunk", |b| {
        b.iter(|| sim.step(PhaseKind::Prefill, black_box(chunk)).makespan_ns);
    });
    c.bench_function("sim_run_sampled", |b| {
        b.iter(|| sim.run(black_box(&SimOptions::default())).metrics.ttft_ns);
    });
}

criterion_group!(sim, benches);
criterion_main!(sim);
