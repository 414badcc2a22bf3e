//! The CPU routed-expert block (`cpu::experts_block`) at qwen3-30b-a3b's shape: 8 experts (gate and up 768 ×
//! 2048, down 2048 × 768) of one token each (decode) and of 64 (prefill), in bf16 and q4_0, on every hardware
//! thread, the decode block also as the executor runs it (`CpuPool::alongside`, the host thread polling for
//! its end). The experts rotate through a wall of copies far larger than the last-level cache, so every call
//! reads its weights from DRAM; criterion's throughput is those weight bytes per second, to set against a
//! DRAM read with the same threads (`pipeshard exec bench --cpu-only --formats none --cpu-bytes 256M
//! --threads N`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipeshard_core::catalog;
use pipeshard_core::dtype::DType;
use pipeshard_exec::cpu::{CpuPool, ExpertWork, experts_block};
use pipeshard_exec::host::Elem;
use pipeshard_exec::quant::QFormat;
use pipeshard_exec::weights::{Dims, ExpertOffsets};

/// Bytes of expert copies the calls rotate through.
const WALL_BYTES: usize = 1 << 30;

fn benches(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let pool = CpuPool::new(threads).unwrap();
    let mut group = c.benchmark_group(format!("experts_t{threads}"));
    group.sample_size(20);
    for dtype in [DType::Bf16, DType::Q4_0] {
        let spec = catalog::get("qwen3-30b-a3b").unwrap().with_uniform_weights(dtype);
        let d = Dims::new(&spec).unwrap();
        let moe = d.moe.unwrap();
        let (hd, fe, top_k) = (d.hidden, moe.expert_ffn, moe.top_k);
        // One expert's gate, up and down from small values, then copied along the wall.
        let mat = d.mat_bytes(fe, hd);
        let off = ExpertOffsets { gate: 0, up: mat, down: 2 * mat };
        let values: Vec<f32> = (0..fe * hd).map(|i| ((i * 53 % 97) as f32 - 48.0) / 400.0).collect();
        // Rows of `k`: the same values as gate and up (k = hidden) and as down (k = expert FFN).
        let rows_of = |k: usize| -> Vec<u8> {
            QFormat::from_dtype(dtype).map_or_else(
                || {
                    let mut m = vec![0u8; mat];
                    values.iter().enumerate().for_each(|(i, &v)| Elem::Bf16.write(&mut m, i, v));
                    m
                },
                |q| q.quantize(&values, k),
            )
        };
        let one = [rows_of(hd), rows_of(hd), rows_of(fe)].concat();
        let wall = one.repeat(WALL_BYTES / one.len());
        let copies = wall.len() / one.len();
        // One token (decode), and 64 tokens an expert (prefill, which takes the nested path).
        for tokens in [1, 64] {
            let xn: Vec<f32> =
                (0..tokens * hd).map(|i| d.mat.round(((i * 37 % 101) as f32 - 50.0) / 25.0)).collect();
            let routed: Vec<(u32, f32)> = (0..tokens as u32).map(|t| (t, 1.0 / top_k as f32)).collect();
            let mut out = vec![0f32; tokens * hd];
            let mut at = 0;
            group.throughput(Throughput::Bytes((top_k * one.len()) as u64));
            // As the profiler times the block (called from the host thread), and, in decode, as the
            // executor runs it: on the pool while the host thread polls for its end (`CpuPool::alongside`).
            let ways: &[bool] = if tokens == 1 { &[false, true] } else { &[false] };
            for &polled in ways {
                let how = if polled { ", host polling" } else { "" };
                group.bench_function(format!("{dtype:?}/{tokens} tokens{how}"), |b| {
                    b.iter(|| {
                        let work: Vec<ExpertWork<'_>> = (0..top_k)
                            .map(|j| {
                                let e = (at + j) % copies;
                                (&wall[e * one.len()..(e + 1) * one.len()], off, routed.as_slice())
                            })
                            .collect();
                        at = (at + top_k) % copies;
                        let (pool, d, xn, work, out) = (&pool, &d, &xn, &work, &mut out);
                        let mut run = move || experts_block(pool, d, fe, black_box(xn), work, out);
                        if polled { pool.alongside(run, || ()).0 } else { run() }
                    });
                });
            }
        }
    }
    group.finish();
}

criterion_group!(experts, benches);
criterion_main!(experts);
