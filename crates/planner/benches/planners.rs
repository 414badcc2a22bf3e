//! Planning time per (model, context, budget) cell for every planner, on the paper's RTX 5090 profile.
//! Targets (2 cores): `ilp` < 200 ms per cell for qwen3-235b-a22b, every other planner < 5 ms.
//!
//! `PIPESHARD_BENCH_CPU_TIME=1` measures the process's CPU time instead of wall time: on a machine shared
//! with other work, wall time grows with the load and CPU time hardly does. `ilp` judges its candidates on
//! several threads, so its CPU time is their sum.

use std::time::Duration;

use criterion::Criterion;
use criterion::measurement::{Measurement, ValueFormatter, WallTime};
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

/// CPU time of the whole process, in nanoseconds (formatted as durations, like wall time).
struct ProcessCpuTime(WallTime);

fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec that outlives the call; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &raw mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    u64::try_from(ts.tv_sec).expect("non-negative") * 1_000_000_000
        + u64::try_from(ts.tv_nsec).expect("non-negative")
}

impl Measurement for ProcessCpuTime {
    type Intermediate = u64;
    type Value = u64;

    fn start(&self) -> u64 {
        process_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        process_cpu_ns() - start
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, ns: &u64) -> f64 {
        *ns as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        self.0.formatter()
    }
}

fn planners<M: Measurement>(c: &mut Criterion<M>) {
    let cost = TableCostModel::new(&reference::derived("cli3").expect("cli3"));
    let mut group = c.benchmark_group("plan");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    for name in ["ngl", "pshard", "greedy", "ilp"] {
        let planner = by_name(name).expect("planner");
        for (spec, ctx, budget) in cells() {
            let w = Workload::single(ctx - 100, ctx, 100, 1024);
            let id = format!("{name}/{}/{}K/{}G", spec.name, ctx / 1024, budget / GIB);
            // Every run solves its program: `ilp` would otherwise answer a repeated cell from its memo.
            group.bench_function(id, |b| {
                b.iter(|| {
                    pipeshard_planner::ilp::forget_solves();
                    planner.plan(&spec, &w, &cost, budget).expect("a plan")
                });
            });
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

fn main() {
    if std::env::var_os("PIPESHARD_BENCH_CPU_TIME").is_some() {
        planners(&mut Criterion::default().with_measurement(ProcessCpuTime(WallTime)).configure_from_args());
    } else {
        planners(&mut Criterion::default().configure_from_args());
    }
    Criterion::default().configure_from_args().final_summary();
}
