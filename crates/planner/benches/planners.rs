//! Planning time per (model, context, budget) cell for every planner, on the paper's RTX 5090 profile.
//! Targets (2 cores): `ilp` < 200 ms per cell for qwen3-235b-a22b, every other planner < 5 ms.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::workload::Workload;
use pipeshard_core::{GIB, MIB, catalog, reference};
use pipeshard_planner::by_name;

/// (model, context, budget) cells: the paper's four LLMs at a tight and a roomy budget.
fn cells() -> Vec<(ModelSpec, u64, u64)> {
    [
        ("nemo-8b", 16_384, 8 * GIB),
        ("qwen3-30b-a3b", 4096, 4 * GIB),
        ("qwen3-235b-a22b", 16_384, 16 * GIB),
        ("qwen3-235b-a22b", 65_536, 4 * GIB),
        ("qwen3-235b-a22b", 1024, 32 * GIB),
    ]
    .into_iter()
    .map(|(m, ctx, budget)| (catalog::get(m).expect("catalog model"), ctx, budget))
    .collect()
}

fn planners(c: &mut Criterion) {
    let cost = TableCostModel::new(&reference::derived("cli3").expect("cli3"));
    let mut group = c.benchmark_group("plan");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    for name in ["ngl", "pshard", "greedy", "ilp"] {
        let planner = by_name(name).expect("planner");
        for (spec, ctx, budget) in cells() {
            let w = Workload::single(ctx - 100, ctx, 100, 1024);
            let id = format!("{name}/{}/{}K/{}G", spec.name, ctx / 1024, budget / GIB);
            group.bench_function(id, |b| b.iter(|| planner.plan(&spec, &w, &cost, budget).expect("a plan")));
        }
    }
    // Exhaustive enumerates truncated models only.
    let exhaustive = by_name("exhaustive").expect("planner");
    for (name, layers, budget) in [("nemo-4b", 2, 900 * MIB), ("llama-3.1-8b", 2, 1200 * MIB)] {
        let spec = catalog::get(name).expect("catalog model").truncated(layers).expect("layers");
        let w = Workload::single(4000, 4096, 96, 1024);
        group.bench_function(format!("exhaustive/{}/4K/{}M", spec.name, budget / MIB), |b| {
            b.iter(|| exhaustive.plan(&spec, &w, &cost, budget).expect("a plan"));
        });
    }
    group.finish();
}

criterion_group!(benches, planners);
criterion_main!(benches);
