//! Do pinned host→device copies run slower when each reads another part of a large registered buffer, as the
//! executor's ring reads a model's units, than when they read one source again, as the profiler's PCIe curve
//! does? (validation run51: a streamed q4_0 expert of 2.65 MB took 56.8 µs a copy, 2.5 µs apart, against
//! 53.7 predicted from the curve.) Needs a CUDA GPU (loaded at run time).
//!
//!   cargo build --release -p pipeshard-exec --example h2d_sources
//!   target/release/examples/h2d_sources [GiB of sources, default 8]   (≈ 20 s on the H200 machine)
//!
//! For each copy size, `COPIES` copies back to back on the copy stream, timed with events around the batch:
//! from one source (`same`), from sources `stride` apart across the buffer (`spread`), and spread with each
//! copy issued as the executor's ring issues it (`ring`: events before and after each copy, the copy stream
//! waiting on an event first). `ROUNDS` rounds, the variants' order rotating; medians printed.

use pipeshard_exec::cuda::{Gpu, Stream};
use pipeshard_exec::host::HostBuf;

const COPIES: usize = 200;
const ROUNDS: usize = 5;
/// A q4_0 expert of qwen3-30b-a3b, a layer's attention and KV of it (1K context), and the profiler's 4 MiB.
const SIZES: [usize; 3] = [2_654_208, 12_713_984, 4 << 20];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gib: usize = std::env::args().nth(1).map_or(Ok(8), |a| a.parse())?;
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    let mut src = HostBuf::zeroed(gib << 30);
    // Touch every page with data, as weights are written before they are registered.
    src.as_mut_slice().chunks_mut(4096).enumerate().for_each(|(i, p)| p[0] = i as u8);
    // SAFETY: `src` outlives the registration (declared after it, so dropped first).
    let _reg = unsafe { gpu.register(&src)? };
    let max = *SIZES.iter().max().expect("sizes");
    let dev = gpu.alloc(max)?;
    let (ev0, ev1) = (gpu.event(true)?, gpu.event(true)?);
    let ring_events = [gpu.event(false)?, gpu.event(true)?, gpu.event(true)?];
    println!("{gib} GiB of registered sources, {COPIES} copies a batch, medians of {ROUNDS} rounds");
    for size in SIZES {
        let stride = ((src.len_bytes() - size) / COPIES) & !4095;
        let mut times: [Vec<f64>; 3] = Default::default();
        for round in 0..ROUNDS {
            for k in 0..3 {
                let variant = (k + round) % 3;
                gpu.record(&ev0, Stream::H2d)?;
                for i in 0..COPIES {
                    let at = if variant == 0 { 0 } else { i * stride };
                    let part = &src.as_slice()[at..at + size];
                    if variant == 2 {
                        // The ring's issue: the slot's release waited for, an event before and after.
                        gpu.record(&ring_events[0], Stream::Compute)?;
                        gpu.wait(Stream::H2d, &ring_events[0])?;
                        gpu.record(&ring_events[1], Stream::H2d)?;
                    }
                    // SAFETY: `size` bytes fit `dev`; `src` is registered and outlives the syncs below.
                    unsafe { gpu.h2d(Stream::H2d, dev.ptr(), part)? };
                    if variant == 2 {
                        gpu.record(&ring_events[2], Stream::H2d)?;
                    }
                }
                gpu.record(&ev1, Stream::H2d)?;
                gpu.sync(Stream::H2d)?;
                times[variant].push(f64::from(gpu.elapsed_ms(&ev0, &ev1)?) * 1e3 / COPIES as f64);
            }
        }
        for (name, t) in ["same", "spread", "ring"].iter().zip(times) {
            let us = median(t);
            println!("{size:>10} B {name:<7} {us:>8.2} µs a copy  {:>6.2} GB/s", size as f64 / us / 1e3);
        }
    }
    Ok(())
}
