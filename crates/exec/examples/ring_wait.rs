//! When does a compute-stream wait on one copy's event end, behind a deep queue of copies? (issue #8: in the
//! H200 validation, a depth-128 expert ring ran a layer's first expert 2 µs after the layer's *last* copy,
//! every layer; results/validation/2026-12-01-nvidia-h200/s12-exec-experiments). Needs a CUDA GPU (loaded at
//! run time).
//!
//!   cargo build --release -p pipeshard-exec --example ring_wait
//!   target/release/examples/ring_wait            (a few seconds on the H200 machine)
//!
//! Each variant queues `copies` host→device copies of `bytes` each from page-locked memory on the H2D stream,
//! records a (timing-free) event after each, as the executor's ring does, and on the compute stream waits for
//! each event in turn, recording a timing event (and, with `kernel`, launching a tiny kernel) after each wait.
//! Printed per variant: when copy 0 and the last copy ended and when the compute stream passed its first and
//! last wait (ms from the first copy's start), and the median over i of (compute i passed − copy i ended):
//! about 0 if each wait ends with its own copy, about the whole queue if it ends with the last.

use pipeshard_exec::cuda::{Event, Gpu, KernelKey, Stream};
use pipeshard_exec::host::{Elem, HostBuf};

/// One variant: how many copies of how many bytes, and how the host queues them.
struct Variant {
    name: &'static str,
    copies: usize,
    bytes: usize,
    /// Timing events around every copy on the H2D stream, as the executor's trace records them.
    traced: bool,
    /// Queue every copy first, then every wait (a deep ring); otherwise copy i, then wait i.
    copies_first: bool,
    /// A tiny kernel after every wait, as an expert's compute.
    kernel: bool,
}

const Q4_EXPERT_BYTES: usize = 2_654_208;
const BF16_EXPERT_BYTES: usize = 9_437_184;

const VARIANTS: [Variant; 8] = [
    Variant {
        name: "q4_0 experts, ring of 128",
        copies: 128,
        bytes: Q4_EXPERT_BYTES,
        traced: true,
        copies_first: true,
        kernel: true,
    },
    Variant {
        name: "bf16 experts, ring of 128",
        copies: 128,
        bytes: BF16_EXPERT_BYTES,
        traced: true,
        copies_first: true,
        kernel: true,
    },
    Variant {
        name: "bf16, untraced copies",
        copies: 128,
        bytes: BF16_EXPERT_BYTES,
        traced: false,
        copies_first: true,
        kernel: true,
    },
    Variant {
        name: "bf16, waits only",
        copies: 128,
        bytes: BF16_EXPERT_BYTES,
        traced: true,
        copies_first: true,
        kernel: false,
    },
    Variant {
        name: "bf16, interleaved",
        copies: 128,
        bytes: BF16_EXPERT_BYTES,
        traced: true,
        copies_first: false,
        kernel: true,
    },
    Variant {
        name: "bf16, ring of 8",
        copies: 8,
        bytes: BF16_EXPERT_BYTES,
        traced: true,
        copies_first: true,
        kernel: true,
    },
    Variant {
        name: "bf16, ring of 32",
        copies: 32,
        bytes: BF16_EXPERT_BYTES,
        traced: true,
        copies_first: true,
        kernel: true,
    },
    Variant {
        name: "64 KiB, ring of 128",
        copies: 128,
        bytes: 64 << 10,
        traced: true,
        copies_first: true,
        kernel: true,
    },
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(why) = pipeshard_exec::cuda::probe() {
        println!("skipped: no usable CUDA GPU ({why})");
        return Ok(());
    }
    let gpu = Gpu::new()?;
    let k = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?;
    let max_bytes = VARIANTS.iter().map(|v| v.copies * v.bytes).max().unwrap_or(0);
    let mut src = HostBuf::zeroed(max_bytes);
    src.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    // SAFETY: `src` outlives the registration, dropped at the end of main before it.
    let _reg = unsafe { gpu.register(&src)? };
    let dst = gpu.alloc(max_bytes)?;
    let tiny = gpu.alloc(256)?;
    println!("{}", gpu.name());
    println!(
        "{:<28} {:>9} {:>9} {:>11} {:>11} {:>14}",
        "variant", "copy 0", "copy last", "compute 0", "compute last", "median lag ms"
    );
    for v in &VARIANTS {
        for round in 0..2 {
            let base = gpu.event(true)?;
            let copy_done: Vec<Event> = (0..v.copies).map(|_| gpu.event(false)).collect::<Result<_, _>>()?;
            let copy_end: Vec<Event> = (0..v.copies).map(|_| gpu.event(true)).collect::<Result<_, _>>()?;
            let passed: Vec<Event> = (0..v.copies).map(|_| gpu.event(true)).collect::<Result<_, _>>()?;
            gpu.record(&base, Stream::H2d)?;
            let copy = |i: usize| -> Result<(), Box<dyn std::error::Error>> {
                let o = i * v.bytes;
                if v.traced {
                    gpu.record(&gpu.event(true)?, Stream::H2d)?;
                }
                // SAFETY: dst holds max_bytes ≥ copies·bytes; src is registered and outlives the sync below.
                unsafe { gpu.h2d(Stream::H2d, dst.ptr() + o as u64, &src.as_slice()[o..o + v.bytes])? };
                gpu.record(&copy_end[i], Stream::H2d)?;
                gpu.record(&copy_done[i], Stream::H2d)?;
                Ok(())
            };
            let consume = |i: usize| -> Result<(), Box<dyn std::error::Error>> {
                gpu.wait(Stream::Compute, &copy_done[i])?;
                gpu.record(&passed[i], Stream::Compute)?;
                if v.kernel {
                    // SAFETY: tiny holds 64 f32: x in its first 32, b in the rest.
                    unsafe { gpu.add_bias(&k, tiny.ptr(), tiny.ptr() + 128, 32, 32)? };
                }
                Ok(())
            };
            if v.copies_first {
                (0..v.copies).try_for_each(copy)?;
                (0..v.copies).try_for_each(consume)?;
            } else {
                (0..v.copies).try_for_each(|i| copy(i).and_then(|()| consume(i)))?;
            }
            gpu.sync_all()?;
            let at = |e: &Event| gpu.elapsed_ms(&base, e).map(f64::from);
            let ends: Vec<f64> = copy_end.iter().map(at).collect::<Result<_, _>>()?;
            let pass: Vec<f64> = passed.iter().map(at).collect::<Result<_, _>>()?;
            let mut lag: Vec<f64> = pass.iter().zip(&ends).map(|(p, e)| p - e).collect();
            lag.sort_by(f64::total_cmp);
            if round == 1 {
                let last = v.copies - 1;
                println!(
                    "{:<28} {:>9.3} {:>9.3} {:>11.3} {:>11.3} {:>14.3}",
                    v.name,
                    ends[0],
                    ends[last],
                    pass[0],
                    pass[last],
                    lag[lag.len() / 2]
                );
            }
        }
    }
    Ok(())
}
