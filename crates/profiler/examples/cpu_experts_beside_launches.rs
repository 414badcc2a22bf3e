//! Does a decode layer's CPU expert block run slower while the host thread launches GPU work, as in the
//! executor's decode (it enqueues the layer's GPU experts, then the next layer's attention and router, 80–90 µs
//! of launches, before it polls for the block's end), than while the host thread only polls, as the profiler's
//! CPU `experts` rows time it? (Session 23: the executor's decode CPU experts ran 2–12 % slower than the row on
//! four leases; results/validation/2026-12-02-nvidia-h200, "Session 23".) Needs a CUDA GPU (loaded at run time).
//!
//!   cargo build --release -p pipeshard-profiler --example cpu_experts_beside_launches
//!   target/release/examples/cpu_experts_beside_launches [threads] [launches, default 20]   (≈ 10 s)
//!
//! The block: 8 q4_0 experts of qwen3-30b-a3b (768 × 2048), one token each, as the profiler's rows sample it
//! (`CpuPool::alongside`, each sample's experts the next of a 1 GiB wall, so that none is read from cache).
//! Samples alternate between the host closure doing nothing and launching `launches` tiny kernels; each way's
//! median block time and their ratio are printed.

use std::time::Instant;

use pipeshard_exec::cpu::{CpuPool, ExpertWork, experts_block};
use pipeshard_exec::cuda::{Gpu, KernelKey, Stream};
use pipeshard_exec::host::Elem;
use pipeshard_exec::quant::QFormat;
use pipeshard_exec::weights::ExpertOffsets;
use pipeshard_profiler::cpu::{dims_for, random_blocks};
use pipeshard_profiler::shapes::HeadLayout;

const SAMPLES: usize = 200;
const EXPERTS: usize = 8;
const WALL_BYTES: usize = 1 << 30;
const FFN: usize = 768;
const HIDDEN: usize = 2048;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let threads = match args.next() {
        Some(t) => t.parse()?,
        None => std::thread::available_parallelism()?.get(),
    };
    let launches: usize = args.next().map_or(Ok(20), |a| a.parse())?;
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?;
    let tiny = gpu.alloc(8)?;
    let pool = CpuPool::new(threads)?;
    let q = QFormat::Q4_0;
    let mat_bytes = FFN * q.row_bytes(HIDDEN);
    let off = ExpertOffsets { gate: 0, up: mat_bytes, down: 2 * mat_bytes };
    let wall = random_blocks(q, WALL_BYTES, 10);
    let copies = wall.len() / (3 * mat_bytes);
    let head = HeadLayout { q_heads: 32, kv_heads: 4, head_dim: 128 };
    let d = pipeshard_exec::weights::Dims { quant: Some(q), ..dims_for(head, HIDDEN, Elem::Bf16) };
    let xn: Vec<f32> =
        (0..HIDDEN).map(|i| Elem::Bf16.round(((i * 7919 % 211) as f32 / 105.0) - 1.0)).collect();
    let tokens = [(0u32, 0.125f32)];
    let mut out = vec![0f32; HIDDEN];
    let mut next = 0;
    let mut times: [Vec<f64>; 2] = Default::default();
    for i in 0..2 * SAMPLES {
        let launching = i % 2 == 1;
        let work: Vec<ExpertWork<'_>> = (0..EXPERTS)
            .map(|j| {
                let e = (next + j) % copies;
                (&wall[3 * mat_bytes * e..3 * mat_bytes * (e + 1)], off, &tokens[..])
            })
            .collect();
        next = (next + EXPERTS) % copies;
        let t0 = Instant::now();
        let ((), launched) = pool.alongside(
            || experts_block(&pool, &d, FFN, &xn, &work, &mut out),
            || -> Result<(), pipeshard_exec::ExecError> {
                for _ in 0..if launching { launches } else { 0 } {
                    // SAFETY: one f32 element of x and of b (the buffer's two).
                    unsafe { gpu.add_bias(&kn, tiny.ptr(), tiny.ptr() + 4, 1, 1)? };
                }
                Ok(())
            },
        );
        times[usize::from(launching)].push(t0.elapsed().as_nanos() as f64);
        launched?;
        gpu.sync(Stream::Compute)?;
    }
    let [idle, busy] = times.map(median);
    println!(
        "{threads} threads, {EXPERTS} q4_0 experts {FFN}×{HIDDEN} of one token, {SAMPLES} samples each way (median)"
    );
    println!("host thread polling only:               {:>8.1} µs a block", idle / 1e3);
    println!("host thread launching {launches:>3} kernels first: {:>8.1} µs a block", busy / 1e3);
    println!("ratio {:.3}", busy / idle);
    Ok(())
}
