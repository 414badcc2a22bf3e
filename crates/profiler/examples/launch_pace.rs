//! How fast does the host launch kernels in the states the executor and the validation put it in? (validation
//! run35: the profile's launch probe read 3.46 µs a launch, the same probe around every cell 4.0–4.2 µs in two
//! leases; results/validation/2026-12-02-nvidia-h200). Needs a CUDA GPU (loaded at run time).
//!
//!   cargo build --release -p pipeshard-profiler --example launch_pace
//!   target/release/examples/launch_pace [threads]       (≈ 20 s on the H200 machine)
//!
//! Each state is sampled `SAMPLES` times, the probe being the profiler's own ([`LaunchProbe`], 1000 tiny
//! launches between two events): after the host idled 200 ms (the profiler's state: its launch probe follows
//! the GPU op rows, the CPU idle); right after the validation's host check (DRAM read and CPU GEMV on every
//! thread, then the probe); while the pool's workers poll (`CpuPool::keep_warm`, re-armed every millisecond: a
//! MoE layer with CPU experts enqueues its GPU experts so, one more thread than cores); and while every thread
//! but the launching one runs the CPU GEMV (a cell whose CPU experts or layers run while the host launches GPU
//! work).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pipeshard_exec::cpu::CpuPool;
use pipeshard_exec::cuda::Gpu;
use pipeshard_profiler::cpu::{DramProbe, GemvProbe};
use pipeshard_profiler::gpu::LaunchProbe;

const SAMPLES: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let threads = match std::env::args().nth(1) {
        Some(t) => t.parse()?,
        None => std::thread::available_parallelism()?.get(),
    };
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    let probe = LaunchProbe::new(&gpu)?;
    let (pool, dram, gemv) = (CpuPool::new(threads)?, DramProbe::default(), GemvProbe::default());
    // The first launches compile and load; leave them out.
    probe.ns_per_launch(&gpu)?;
    let print = |state: &str, ns: Vec<f64>| {
        let lo = ns.iter().copied().fold(f64::MAX, f64::min) / 1e3;
        let hi = ns.iter().copied().fold(0.0, f64::max) / 1e3;
        println!(
            "{state:<58} {:>6.2} µs a launch (median; {lo:.2}–{hi:.2} over {SAMPLES})",
            median(ns) / 1e3
        );
    };

    let mut idle = Vec::new();
    for _ in 0..SAMPLES {
        std::thread::sleep(Duration::from_millis(200));
        idle.push(probe.ns_per_launch(&gpu)?);
    }
    print("after 200 ms idle (the profiler's state)", idle);

    let mut after_check = Vec::new();
    for _ in 0..SAMPLES {
        std::thread::sleep(Duration::from_millis(200));
        let _ = (dram.gbps(&pool), gemv.gbps(&pool));
        after_check.push(probe.ns_per_launch(&gpu)?);
    }
    print(
        &format!("right after DRAM read + CPU GEMV on {threads} threads (validation's check)"),
        after_check,
    );

    // `SAMPLES` probes while another thread repeats `load` (after `settle` for it to start).
    let beside =
        |settle: Duration, load: &(dyn Fn() + Sync)| -> Result<Vec<f64>, Box<dyn std::error::Error>> {
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        load();
                    }
                });
                std::thread::sleep(settle);
                let ns = (0..SAMPLES).map(|_| probe.ns_per_launch(&gpu)).collect::<Result<Vec<f64>, _>>();
                stop.store(true, Ordering::Relaxed);
                Ok(ns?)
            })
        };
    let polling = beside(Duration::from_millis(10), &|| {
        let _warm = pool.keep_warm();
        std::thread::sleep(Duration::from_millis(1));
    })?;
    print(&format!("while the pool's {threads} workers poll (keep_warm)"), polling);

    let busy_pool = CpuPool::new(threads.saturating_sub(1).max(1))?;
    let under_load = beside(Duration::from_millis(100), &|| {
        let _ = gemv.gbps(&busy_pool);
    })?;
    print(
        &format!("while {} threads run the CPU GEMV (a cell's CPU work)", threads.saturating_sub(1).max(1)),
        under_load,
    );
    Ok(())
}
