//! Device sections: the PCIe link, exec's GPU kernels, launch and sync latency, and the interference between
//! copies and compute. Also runs the host sections ([`crate::cpu`]) with pinned H2D copies as the background
//! load, since copies need the device.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use pipeshard_core::catalog;
use pipeshard_core::dtype::DType;
use pipeshard_core::profile::{BwPoint, DeviceProfile, Machine, OpRow, PcieProfile, Profile, Roofline};
use pipeshard_core::workload::{GROUPED_EXPERTS_MAX_TOKENS, OpClass};
use pipeshard_exec::cpu::KvLayout;
use pipeshard_exec::cuda::{
    DevBuf, Event, ExpertIo, Gpu, GroupedIo, HostRegistration, KernelKey, Kernels, RingSlot, Stream, TiledIo,
    grouped_experts_fit, tiled, tiled_experts_fit,
};
use pipeshard_exec::host::{Elem, HostBuf};
use pipeshard_exec::layout::scratch_layout;
use pipeshard_exec::quant::QFormat;
use pipeshard_exec::seqs::{GpuKeys, Pass, SeqKv};
use pipeshard_exec::weights::{Dims, ExpertOffsets, TENSOR_ALIGN_BYTES};

use crate::cpu::{self, Background, dims_for, fill_random};
use crate::shapes::{self, HeadLayout};
use crate::stats::{Rule, Stat, sample};
use crate::{Figures, Mode, ProfilerError, Progress, Result};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// GPU timings aim at this much work per sample, so that launch gaps and event resolution stay small.
const SAMPLE_TARGET_NS: f64 = 50_000.0;
/// A held stream's hold per queued call: several times what a cuBLAS call costs the host (≈ 10–15 µs).
const HOLD_NS_PER_CALL: u64 = 50_000;
/// Calls a sample of a host-paced row at least (routed experts, unheld). One call of ~70 µs, as the 50 µs
/// target gives, timed the host's enqueueing of its launches plus its last kernel's run; the executor
/// enqueues a layer's experts back to back, each at the host's pace alone: run27's q4_0 qwen3-30b-a3b@24L,
/// all pinned, took 49 µs an expert in prefill (~64 tokens) against the row's 71.7 µs, 25.7 in decode against
/// 32.8 (results/validation/2026-12-01-nvidia-h200). Eight is a decode layer's experts.
const HOST_PACED_MIN_REPS: usize = 8;
/// Experts of the grouped rows ([`OpClass::ExpertsGrouped`]): a one-token decode step's 8 of qwen3-30b-a3b
/// and up to an 8-token step's 64.
const GROUP_SIZES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Entries of a tiled row's group ([`OpClass::ExpertsTiled`]): a 1024-token prefill chunk's rows (the
/// validation's and the paper's ubatch), which exec's groups fill; of experts with `m` tokens each, 1024 / m of
/// them, at most [`TILED_GROUP_MAX_EXPERTS`].
const TILED_GROUP_ROWS: usize = 1024;
/// A layer's experts at most (qwen3-30b-a3b's 128).
const TILED_GROUP_MAX_EXPERTS: usize = 128;
/// The longest hold (256 calls).
const HOLD_MAX_NS: u64 = 15_000_000;

struct Grid {
    copy_sizes: Vec<usize>,
    tokens: Vec<usize>,
    dtypes: Vec<DType>,
    attn_ctx: Vec<usize>,
    kv_dtypes: Vec<DType>,
    elementwise_tokens: Vec<usize>,
    prefill_chunk: usize,
    /// Sequences of a batched decode step (the one-sequence step is the plain decode row).
    decode_seqs: Vec<usize>,
}

fn grid(mode: Mode) -> Grid {
    let pow2 =
        |lo: u32, hi: u32, step: usize| (lo..=hi).step_by(step).map(|i| 1usize << i).collect::<Vec<_>>();
    match mode {
        Mode::Full => Grid {
            copy_sizes: pow2(16, 30, 2),
            tokens: pow2(0, 12, 1),
            dtypes: shapes::with_quantised(&[DType::Bf16, DType::F16]),
            // Powers of two and 1.5× between them from 3K: the cost model takes a row's efficiency from the
            // nearest measured key count, and attention slows past the L2 (nemo-8b's 1024-token prefill chunks
            // read their K/V at one rate to ~6K keys and slower above, run22): with only 4K and 8K rows, 5.6K
            // keys were priced at the 8K row's rate, 37 % slow.
            attn_ctx: {
                let mut c = pow2(10, 17, 1);
                c.extend(pow2(10, 15, 1).iter().map(|&k| 3 * k));
                c.sort_unstable();
                c
            },
            // The workloads' KV format; a 128K prefill chunk takes ~1-2 s with exec's kernel, so one format.
            kv_dtypes: vec![DType::F16],
            elementwise_tokens: pow2(0, 12, 2),
            prefill_chunk: 512,
            decode_seqs: vec![4, 16, 64],
        },
        Mode::Fast | Mode::Tiny => Grid {
            copy_sizes: pow2(16, 28, 4),
            tokens: vec![1, 16, 256, 4096],
            dtypes: vec![DType::Bf16, DType::Q4_0],
            attn_ctx: vec![1024, 16384, 131_072],
            kv_dtypes: vec![DType::F16],
            elementwise_tokens: vec![1, 64, 4096],
            prefill_chunk: 512,
            decode_seqs: vec![4, 16],
        },
    }
}

/// Device buffers and events the sections share.
struct Bench<'g> {
    gpu: &'g Gpu,
    rule: Rule,
    ev0: Event,
    ev1: Event,
}

impl Bench<'_> {
    /// Nanoseconds per call of `f`, timed with events on `stream` over enough calls to reach
    /// [`SAMPLE_TARGET_NS`]; sampled per the rule. `f(i)` gets the call's index (for buffer rotation).
    ///
    /// With `hold`, the compute stream is held ([`Gpu::hold_compute`]) while the host enqueues the calls, so
    /// they run back to back at the device's pace, as the executor's decode runs kernels (its host enqueues a
    /// step well ahead). Unheld, a sample of a few short cuBLAS calls also timed the host's enqueueing: the
    /// H200 profile's 4096×4096 GEMV rows read 17–20 µs against 11.6 µs in place (ncu), slower still on a
    /// disturbed host, and all-GPU decode was predicted 5–9 % slow (results/validation/2026-12-01-nvidia-h200).
    /// Routed experts stay unheld: the executor enqueues them right after the routing sync, host-paced.
    fn events(
        &self,
        stream: Stream,
        hold: Option<&Kernels>,
        f: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Stat> {
        self.events_min_reps(stream, hold, 1, f)
    }

    /// [`Self::events`] with at least `min_reps` calls a sample.
    fn events_min_reps(
        &self,
        stream: Stream,
        hold: Option<&Kernels>,
        min_reps: usize,
        f: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Stat> {
        let mut once = |reps: usize, base: usize| -> Result<f64> {
            if let Some(k) = hold {
                self.gpu.hold_compute(k, (HOLD_NS_PER_CALL * (reps as u64 + 1)).min(HOLD_MAX_NS))?;
            }
            self.gpu.record(&self.ev0, stream)?;
            for i in 0..reps {
                f(base + i)?;
            }
            self.gpu.record(&self.ev1, stream)?;
            self.gpu.sync(stream)?;
            Ok(f64::from(self.gpu.elapsed_ms(&self.ev0, &self.ev1)?) * 1e6 / reps as f64)
        };
        let est = once(1, 0)?.max(1.0);
        let reps = ((SAMPLE_TARGET_NS / est).ceil() as usize).clamp(min_reps, 256.max(min_reps));
        let mut base = 1;
        // Ops of over 50 ms (long-context prefill attention) vary little: three samples do.
        let rule = if est > 5e7 { Rule { min_samples: 3, max_samples: 3, ..self.rule } } else { self.rule };
        sample(rule, || {
            base += reps;
            once(reps, base)
        })
    }
}

/// Bytes of a run of back-to-back pageable H2D copies the profile's curve times (at most
/// [`PAGEABLE_RUN_COPIES`] copies): the executor stages a layer's units so.
const PAGEABLE_RUN_BYTES: usize = 256 * MIB;
const PAGEABLE_RUN_COPIES: usize = 64;

/// The host memory of pageable copies, made as the executor makes its weights (a [`HostBuf`]: page-aligned,
/// zeroed by the allocating thread, filled with random values by every thread), since a pageable copy is the
/// host reading it into the driver's staging buffers. The profile's curve used to read a calloc'd `Vec`; the
/// executor's staged `ngl` units copied at ≈ 0.8× it (results/validation/2026-12-01-nvidia-h200, run22, run23).
struct PageableSource {
    buf: HostBuf,
    next_offset: usize,
}

impl PageableSource {
    /// `len_bytes` of random values: at least twice the largest copy, so a copy never reads bytes the
    /// last-level cache still holds from the one before (copying the same 64 MiB again measured 15 GB/s on
    /// the H200 machine).
    fn new(len_bytes: usize) -> PageableSource {
        let mut buf = HostBuf::zeroed(len_bytes);
        buf.as_mut_slice()
            .par_chunks_mut(16 * MIB)
            .enumerate()
            .for_each(|(i, chunk)| fill_random(chunk, Elem::F32, 12 + i as u64));
        PageableSource { buf, next_offset: 0 }
    }

    /// The offset of the next `size` bytes, from the start again when they would pass the end.
    fn advance(&mut self, size: usize) -> usize {
        assert!(size <= self.buf.len_bytes(), "a pageable copy of {size} bytes from a smaller source");
        if self.next_offset + size > self.buf.len_bytes() {
            self.next_offset = 0;
        }
        self.next_offset += size;
        self.next_offset - size
    }

    /// The next `size` bytes to copy from.
    fn next(&mut self, size: usize) -> &[u8] {
        let o = self.advance(size);
        &self.buf.as_slice()[o..o + size]
    }

    /// The next `size` bytes to copy into.
    fn next_mut(&mut self, size: usize) -> &mut [u8] {
        let o = self.advance(size);
        &mut self.buf.as_mut_slice()[o..o + size]
    }
}

/// Pinned H2D copies looping on the H2D stream from a second thread.
struct DmaLoad<'a> {
    gpu: &'a Gpu,
    src: &'a [u8],
    dst: u64,
    /// Expected time of one copy (the thread sleeps most of it instead of spinning in a sync).
    copy_time: Duration,
    copies: AtomicU64,
}

impl Background for DmaLoad<'_> {
    fn during(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let h = s.spawn(|| -> Result<()> {
                self.gpu.bind()?;
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: `dst` spans `src.len()` bytes of a live device buffer and `src` is registered host
                    // memory alive for this scope; the stream is synchronised before the next pair.
                    unsafe {
                        self.gpu.h2d(Stream::H2d, self.dst, self.src)?;
                        self.gpu.h2d(Stream::H2d, self.dst, self.src)?;
                    }
                    std::thread::sleep(self.copy_time.mul_f64(1.8));
                    self.gpu.sync(Stream::H2d)?;
                    self.copies.fetch_add(2, Ordering::Relaxed);
                }
                Ok(())
            });
            std::thread::sleep(Duration::from_millis(3));
            let r = body();
            stop.store(true, Ordering::Relaxed);
            let t = h.join().map_err(|_| ProfilerError::Input("the DMA load thread panicked".into()))?;
            r.and(t)
        })
    }
}

/// The slot of an `n × k` matrix (or its transpose) in `quant`'s format, 256-byte aligned, and an expert's
/// offsets in a unit of three slots: up right after gate (aligned) as in exec's weights, so that the calls
/// take exec's path (one matmul over gate|up).
fn expert_layout(n: usize, k: usize, quant: Option<QFormat>) -> (usize, ExpertOffsets) {
    let row_bytes = |k: usize| quant.map_or(2 * k, |q| q.row_bytes(k));
    let wbytes = (n * row_bytes(k)).max(k * row_bytes(n)).next_multiple_of(256);
    let up = (n * row_bytes(k)).next_multiple_of(TENSOR_ALIGN_BYTES);
    (wbytes, ExpertOffsets { gate: 0, up, down: 2 * wbytes })
}

/// The experts of the grouped rows of an `n × k` (ffn × hidden) expert in `quant`'s format (`None`:
/// f16/bf16): the [`GROUP_SIZES`] the grouped kernels take, up to the units `rot_bytes` holds (each sample's
/// experts distinct); none where the format stores no such expert (rows and columns of whole blocks).
fn group_sizes(n: usize, k: usize, quant: Option<QFormat>, rot_bytes: usize) -> Vec<usize> {
    if quant.is_some_and(|q| !k.is_multiple_of(q.block_elems()) || !n.is_multiple_of(q.block_elems())) {
        return Vec::new();
    }
    let units = rot_bytes / (3 * expert_layout(n, k, quant).0);
    let max_tokens = GROUPED_EXPERTS_MAX_TOKENS as usize;
    GROUP_SIZES
        .into_iter()
        .filter(|&e| e <= units && grouped_experts_fit(quant, e.min(max_tokens), k, n))
        .collect()
}

/// Whether exec's tiled expert kernels take an expert shape (`n` = ffn, `k` = hidden).
fn tiled_fit(s: &shapes::MatShape) -> bool {
    tiled_experts_fit(s.k as usize, s.n as usize)
}

/// Whether exec tiles experts of `m` tokens in `dtype`: quantised experts of at most
/// [`GROUPED_EXPERTS_MAX_TOKENS`] (exec's `EXACT_MAX_TOKENS`) tokens keep their exact per-expert GEMVs.
fn tiled_row(dtype: DType, m: usize) -> bool {
    !dtype.is_quantized() || m as u64 > GROUPED_EXPERTS_MAX_TOKENS
}

/// The tiled rows' device buffers ([`time_tiled`]).
struct TiledBufs<'a> {
    idx: &'a DevBuf,
    wts: &'a DevBuf,
    act: &'a DevBuf,
    y: &'a DevBuf,
    index: &'a DevBuf,
}

/// Entries of each of a tiled row's `units` experts of `m` tokens on average: from 16 tokens on, spread as a
/// layer's routing spreads them (qwen3-30b-a3b's 1024-token chunk: 63 ± 8, a binomial's ±√m), cycling
/// through m + √m·{−1.5, −0.5, +0.5, +1.5}, so that the rows see the tiles' 16-entry warps partly filled as a
/// layer does; at most `max_m` (distinct tokens).
fn tiled_counts(m: usize, units: usize, max_m: usize) -> Vec<usize> {
    const SPREAD: [f64; 4] = [-1.5, -0.5, 0.5, 1.5];
    let sd = if m >= 16 { (m as f64).sqrt() } else { 0.0 };
    (0..units).map(|e| ((m as f64 + sd * SPREAD[e % 4]).round() as usize).clamp(1, max_m)).collect()
}

/// One expert's share of exec's tiled kernels over a group of `units` experts of `m` tokens on average
/// ([`tiled_counts`]), in `quant`'s format (`n × k`: ffn × hidden): the group's time ÷ `units`, unheld as exec
/// enqueues it after the routing. As in a layer, the group's entries name distinct token rows (up to
/// `max_m`), so the gathers and the combine cover as many rows as a prefill chunk's. Sample i takes the units
/// of index variant i mod (variants), which together cycle through all `copies` units of `wbuf`
/// (`unit_bytes` apart), so that no weights come from L2.
#[allow(clippy::too_many_arguments)]
fn time_tiled(
    gpu: &Gpu,
    b: &Bench<'_>,
    kn: &Kernels,
    quant: Option<QFormat>,
    (wbuf, unit_bytes, copies): (&DevBuf, usize, usize),
    expert: ExpertOffsets,
    (n, k): (usize, usize),
    (m, max_m): (usize, usize),
    units: usize,
    bufs: &TiledBufs<'_>,
    h: u64,
    xbuf: &DevBuf,
) -> Result<Stat> {
    let counts = tiled_counts(m, units, max_m);
    let entries: usize = counts.iter().sum();
    // Expert e's entries take the next token rows, wrapping at max_m (an expert's stay distinct).
    let rows_m = entries.min(max_m);
    let tokens: Vec<u32> = (0..entries).map(|p| (p % max_m) as u32).collect();
    let idx: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    // Variants 16 bytes apart at least: a tile starts with a u64.
    let index_bytes = tiled::tiled_index_max_bytes(rows_m, entries, units, entries).next_multiple_of(16);
    let variants = copies.div_ceil(units).min(bufs.index.bytes() / index_bytes).max(1);
    let mut host = vec![0u8; variants * index_bytes];
    let mut layout = None;
    for (v, out) in host.chunks_exact_mut(index_bytes).enumerate() {
        let experts: Vec<(u64, usize)> = (0..units)
            .map(|e| (wbuf.ptr() + (((v * units + e) % copies) * unit_bytes) as u64, counts[e]))
            .collect();
        layout = Some(tiled::build_tiled_index(&experts, &tokens, rows_m, entries, out));
    }
    let ix = layout.expect("one variant at least");
    let [group] = ix.groups.as_slice() else { unreachable!("one group holds all the entries") };
    // SAFETY: idx holds t_entries_max ≥ entries u32, index variants × index_bytes; copies finish before the
    // sources drop.
    unsafe {
        gpu.h2d(Stream::H2d, bufs.idx.ptr(), &idx)?;
        gpu.h2d(Stream::H2d, bufs.index.ptr(), &host)?;
    }
    gpu.sync(Stream::H2d)?;
    b.events_min_reps(Stream::Compute, None, HOST_PACED_MIN_REPS, &mut |i| {
        let at = bufs.index.ptr() + ((i % variants) * index_bytes) as u64;
        let io = TiledIo {
            tiles: at,
            idx: bufs.idx.ptr(),
            wts: bufs.wts.ptr(),
            tok_first: at + group.tok_first as u64,
            tok_ent: at + ix.tok_ent as u64,
            xn: xbuf.ptr(),
            act: bufs.act.ptr(),
            y: bufs.y.ptr(),
            h,
        };
        // SAFETY: every variant lays out the same tiles and lists (only the unit addresses differ), over
        // `entries` ≤ t_entries_max entries of idx/wts/act/y; the units lie in wbuf with gate, up and down at
        // `expert` in the format; token rows < rows_m ≤ max_m of xbuf (hidden k) and h (f32, e_hidden ≥ k);
        // `tiled_fit` checked the shape.
        unsafe { gpu.tiled_experts(kn, quant, expert, &io, group.tiles.len(), 0, rows_m, k, n)? };
        Ok(())
    })
    .map(|s| Stat { median: s.median / units as f64, ..s })
}

/// The unit addresses of `copies` samples of `groups` experts, little-endian u64: sample j takes the units
/// `j·groups ..` of the `copies` in the buffer at `base` (`unit_bytes` apart), wrapping, so that sample i's
/// array (i mod copies) continues where sample i − 1's stopped and nothing is read from L2.
fn group_bases(base: u64, unit_bytes: usize, copies: usize, groups: usize) -> Vec<u8> {
    (0..copies * groups).flat_map(|e| (base + ((e % copies) * unit_bytes) as u64).to_le_bytes()).collect()
}

fn elem(d: DType) -> Elem {
    Elem::from_dtype(d).expect("the profiler sweeps f16/bf16 only")
}

/// Uploads random values of `e` into `dev[off..off+bytes]` through the pinned staging buffer.
fn upload_random(gpu: &Gpu, staging: &mut HostBuf, e: Elem, dst: u64, bytes: usize, seed: u64) -> Result<()> {
    let chunk = staging.len_bytes();
    let mut done = 0;
    let mut seed = seed;
    while done < bytes {
        let n = chunk.min(bytes - done);
        fill_random(&mut staging.as_mut_slice()[..n.next_multiple_of(8).min(chunk)], e, seed);
        seed += 1;
        // SAFETY: dst+done..+n lies inside the caller's buffer; the staging buffer is synchronised before reuse.
        unsafe { gpu.h2d(Stream::H2d, dst + done as u64, &staging.as_slice()[..n])? };
        gpu.sync(Stream::H2d)?;
        done += n;
    }
    Ok(())
}

/// The head layouts exec's attention kernel runs: head_dim a multiple of 32, at most 256.
fn kernel_heads(all: &[HeadLayout]) -> Vec<HeadLayout> {
    all.iter().copied().filter(|h| h.head_dim % 32 == 0 && h.head_dim <= 256).collect()
}

/// The K and V of call `i` over a cache of `rows` rows of `kv_dim` elements of `esize` bytes: consecutive calls
/// read different regions of `kvbuf` (K in its first `kv_half` bytes, V in the rest), as the executor's attention
/// reads a layer's cache once a step with every other layer's weights and cache read in between. Calls on one
/// region read it from L2 (50 MB on the H200): nemo-8b@8L's attention units took 9–21 µs more in place than
/// their rows (run27, 1K–8K keys; the 8K cache is 33.5 MB).
fn kv_region(kvbuf: u64, kv_half: usize, rows: usize, kv_dim: usize, esize: usize, i: usize) -> (u64, u64) {
    let region = (rows * kv_dim * esize).next_multiple_of(256);
    let off = ((i % (kv_half / region).max(1)) * region) as u64;
    (kvbuf + off, kvbuf + kv_half as u64 + off)
}

/// Only the GPU's batched decode attention rows (`attention_decode`, `attention_decode_unified`: exec's kernel
/// over R ∈ {4, 16, 64} sequences, 4 and 16 when fast, with the executor's key splits), for a CPU-only profile
/// that keeps another run's GPU section but needs rows that run did not measure.
pub fn measure_decode_attention(mode: Mode, progress: &dyn Progress) -> Result<Vec<OpRow>> {
    pipeshard_exec::cuda::probe().map_err(ProfilerError::NoGpu)?;
    let gpu = Gpu::new()?;
    let b = Bench { gpu: &gpu, rule: mode.rule(), ev0: gpu.event(true)?, ev1: gpu.event(true)? };
    let mut staging = HostBuf::zeroed(64 * MIB);
    // SAFETY: `staging` outlives the registration (dropped at the end of this function, after it).
    let _sreg = unsafe { gpu.register(&staging)? };
    let heads = kernel_heads(&shapes::from_catalog().heads);
    decode_attention_rows(&gpu, &b, &grid(mode), &heads, &mut staging, progress)
}

/// A decode step of R sequences as the executor launches it: one attention kernel for the R queries, each
/// over its own `ctx` keys (`attention_decode`), or scanning all R × ctx cells of a unified cache and masking
/// the others' (`attention_decode_unified`), with the key splits the executor picks for that step
/// (`layout::scratch_layout`). Steps whose cache would exceed the largest context are skipped.
fn decode_attention_rows(
    gpu: &Gpu,
    b: &Bench<'_>,
    g: &Grid,
    heads: &[HeadLayout],
    staging: &mut HostBuf,
    progress: &dyn Progress,
) -> Result<Vec<OpRow>> {
    let ctx_max = *g.attn_ctx.iter().max().expect("contexts");
    let steps: Vec<(usize, usize)> = g
        .decode_seqs
        .iter()
        .flat_map(|&r| g.attn_ctx.iter().filter(move |&&c| r * c <= ctx_max).map(move |&c| (r, c)))
        .collect();
    let n_steps = g.kv_dtypes.len() * heads.len() * steps.len() * 2;
    progress.section(
        "GPU batched decode attention (exec kernel): sequences × context × layout × cache",
        n_steps as u64,
    );
    let dims: Vec<Dims> = heads.iter().map(|&h| dims_for(h, 4096, Elem::Bf16)).collect();
    let max_kv_dim = dims.iter().map(|d| d.kv_dim).max().unwrap_or(1);
    let max_q_dim = dims.iter().map(|d| d.q_dim).max().unwrap_or(1);
    let max_r = steps.iter().map(|s| s.0).max().unwrap_or(1);
    // Partial sums of every (query, head, split) warp.
    let max_warps = dims
        .iter()
        .flat_map(|d| {
            steps.iter().map(move |&(r, c)| r * d.n_heads * scratch_layout(d, r, r, c, 0).attn_splits)
        })
        .max()
        .unwrap_or(1);
    let max_head_dim = dims.iter().map(|d| d.head_dim).max().unwrap_or(1);
    let kv_half = ctx_max * max_kv_dim * 2;
    let kvbuf = gpu.alloc(2 * kv_half)?;
    let qbuf = gpu.alloc(max_r * max_q_dim * 4)?;
    let obuf = gpu.alloc(max_r * max_q_dim * 2)?;
    let part_o = gpu.alloc(max_warps * max_head_dim * 4)?;
    let part_ml = gpu.alloc(max_warps * 2 * 4)?;
    upload_random(gpu, staging, Elem::F32, qbuf.ptr(), max_r * max_q_dim * 4, 32)?;
    let mut rows = Vec::new();
    for &kv_dtype in &g.kv_dtypes {
        let kv_e = elem(kv_dtype);
        upload_random(gpu, staging, kv_e, kvbuf.ptr(), 2 * kv_half, 33)?;
        for (h, d) in heads.iter().zip(&dims) {
            let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: kv_e, head_dim: d.head_dim })?;
            for &(r, ctx) in &steps {
                let splits = scratch_layout(d, r, r, ctx, 0).attn_splits;
                for unified in [false, true] {
                    let seq = KvLayout { ctx, kv_dim: d.kv_dim, elem: kv_e };
                    // Every sequence's prompt fills all but the step's own cell.
                    let cache = SeqKv { seq, seqs: r, unified, prompt: ctx - 1 };
                    let keys = cache.gpu_keys(Pass::Decode { pos: ctx - 1 });
                    let s = b.events(Stream::Compute, Some(&kn), &mut |i| {
                        let (kc, vc) =
                            kv_region(kvbuf.ptr(), kv_half, r * ctx, d.kv_dim, kv_e.size_bytes(), i);
                        // SAFETY: q holds r·q_dim f32, K and V (ctx_max·max_kv_dim each) hold the r·ctx·kv_dim
                        // elements of the cache (r·ctx ≤ ctx_max) from kc and vc, out r·q_dim activations,
                        // part_o/part_ml one partial per (query, head, split) warp (max_warps).
                        unsafe {
                            gpu.attention(
                                &kn,
                                qbuf.ptr(),
                                kc,
                                vc,
                                obuf.ptr(),
                                part_o.ptr(),
                                part_ml.ptr(),
                                r,
                                keys,
                                d.n_heads,
                                d.n_kv_heads,
                                d.attn_scale(),
                                splits,
                            )
                        }
                        .map_err(Into::into)
                    })?;
                    rows.push(OpRow {
                        op: if unified { OpClass::AttentionDecodeUnified } else { OpClass::AttentionDecode },
                        dtype: kv_dtype,
                        n: d.q_dim as u64,
                        k: ctx as u64,
                        tokens: r as u64,
                        threads: 0,
                        time_ns: s.median.ceil() as u64,
                        time_ns_under_dma: None,
                        spread: Some(s.spread),
                        kv_heads: Some(h.kv_heads),
                    });
                    progress.tick(&format!(
                        "{kv_dtype:?} {}q/{}kv×{} {r} seqs × ctx {ctx} {}: {:.1} µs",
                        h.q_heads,
                        h.kv_heads,
                        h.head_dim,
                        if unified { "unified" } else { "per sequence" },
                        s.median / 1e3
                    ))?;
                }
            }
        }
    }
    Ok(rows)
}

/// Measures everything with the device: returns the whole profile (machine facts filled by the caller). With
/// `gpu_ops_from`, the GPU op rows are those instead of measured ones.
pub fn measure_all(
    mode: Mode,
    threads: &[u32],
    gpu_ops_from: Option<&[OpRow]>,
    experts_again: bool,
    figures: &mut Figures,
    notes: &mut Vec<String>,
    progress: &dyn Progress,
) -> Result<Profile> {
    let name = pipeshard_exec::cuda::probe().map_err(ProfilerError::NoGpu)?;
    let gpu = Gpu::new()?;
    let g = grid(mode);
    let rule = mode.rule();

    // Runtime VRAM first, before the profiler allocates anything: exec's own measurement for nemo-8b in bf16.
    let nemo = catalog::get("nemo-8b").expect("catalog model").with_uniform_weights(DType::Bf16);
    let runtime_overhead_bytes =
        pipeshard_exec::runtime_overhead_bytes(&gpu, &Dims::new(&nemo)?, Elem::F16, g.prefill_chunk, 1)?;
    let page_table_bytes_per_locked_gib = pipeshard_exec::page_table_bytes_per_locked_gib(&gpu)?;
    let (_, vram_total) = gpu.mem_info()?;
    let b = Bench { gpu: &gpu, rule, ev0: gpu.event(true)?, ev1: gpu.event(true)? };

    // ---- PCIe ----
    let max_copy = *g.copy_sizes.iter().max().expect("sizes");
    let host_bytes = max_copy.max(512 * MIB);
    progress.section(
        "PCIe: pinned/pageable H2D and D2H by size, both ways, latency",
        (g.copy_sizes.len() * 4 + 3) as u64,
    );
    let mut pinned = HostBuf::zeroed(host_bytes);
    fill_random(pinned.as_mut_slice(), Elem::F32, 11);
    // SAFETY: `pinned` outlives `_reg` (dropped first: declared after it).
    let _reg = unsafe { gpu.register(&pinned)? };
    let mut pageable = PageableSource::new(2 * max_copy.max(512 * MIB));
    let dev = gpu.alloc(host_bytes)?;

    let tiny_h2d = b.events(Stream::H2d, None, &mut |_| {
        // SAFETY: 4 bytes inside both buffers.
        unsafe { gpu.h2d(Stream::H2d, dev.ptr(), &pinned.as_slice()[..4]) }.map_err(Into::into)
    })?;
    let tiny_d2h = b.events(Stream::D2h, None, &mut |_| {
        // SAFETY: 4 bytes inside both buffers; the host bytes are not read meanwhile.
        let dst = unsafe { std::slice::from_raw_parts_mut(pinned.as_ptr(), 4) };
        unsafe { gpu.d2h(Stream::D2h, dst, dev.ptr()) }.map_err(Into::into)
    })?;
    figures.add("copy latency (4-byte pinned H2D)", "ns", tiny_h2d);
    figures.add("copy latency (4-byte pinned D2H)", "ns", tiny_d2h);
    progress.tick(&format!("copy latency {:.1} / {:.1} µs", tiny_h2d.median / 1e3, tiny_d2h.median / 1e3))?;
    // The fixed cost both directions pay: the smaller of the two.
    let latency_ns = tiny_h2d.median.min(tiny_d2h.median);
    let mut raw: [Vec<(usize, Stat)>; 4] = Default::default();
    for &size in &g.copy_sizes {
        let s = b.events(Stream::H2d, None, &mut |_| {
            // SAFETY: `size` ≤ both buffers' lengths; events order the reuse.
            unsafe { gpu.h2d(Stream::H2d, dev.ptr(), &pinned.as_slice()[..size]) }.map_err(Into::into)
        })?;
        raw[0].push((size, s));
        progress.tick(&format!("pinned H2D {} KiB: {:.1} GB/s", size / KIB, size as f64 / s.median))?;
        let s = b.events(Stream::D2h, None, &mut |_| {
            // SAFETY: as above; the host buffer is not read meanwhile.
            let dst = unsafe { std::slice::from_raw_parts_mut(pinned.as_ptr(), size) };
            unsafe { gpu.d2h(Stream::D2h, dst, dev.ptr()) }.map_err(Into::into)
        })?;
        raw[1].push((size, s));
        progress.tick(&format!("pinned D2H {} KiB: {:.1} GB/s", size / KIB, size as f64 / s.median))?;
        // Pageable copies stage through the driver's buffers and hold the host thread: time them on the host,
        // a run of them back to back as the executor stages `ngl`'s units (the host's copy of one into the
        // driver's buffers overlaps the DMA of the one before): one copy then a sync at a time read 5.6–6.0
        // GB/s where the executor's staged experts (9.4 MB each) ran at 7.7 (validation run38).
        let copies = (PAGEABLE_RUN_BYTES / size).clamp(1, PAGEABLE_RUN_COPIES);
        let s = sample(rule, || -> Result<f64> {
            let t0 = Instant::now();
            for _ in 0..copies {
                let src = pageable.next(size);
                // SAFETY: as above; the stream orders the copies into `dev`.
                unsafe { gpu.h2d(Stream::H2d, dev.ptr(), src)? };
            }
            gpu.sync(Stream::H2d)?;
            Ok(t0.elapsed().as_nanos() as f64 / copies as f64)
        })?;
        raw[2].push((size, s));
        progress.tick(&format!("pageable H2D {} KiB: {:.1} GB/s", size / KIB, size as f64 / s.median))?;
        let s = sample(rule, || -> Result<f64> {
            let dst = pageable.next_mut(size);
            let t0 = Instant::now();
            // SAFETY: as above.
            unsafe { gpu.d2h(Stream::D2h, dst, dev.ptr())? };
            gpu.sync(Stream::D2h)?;
            Ok(t0.elapsed().as_nanos() as f64)
        })?;
        raw[3].push((size, s));
        progress.tick(&format!("pageable D2H {} KiB: {:.1} GB/s", size / KIB, size as f64 / s.median))?;
    }
    // Effective rate after the fixed latency, never above the curve's best raw rate (no copy streams faster
    // than the link; a copy that beats latency + bytes at that rate is predicted slightly slow).
    let [h2d_pinned, d2h_pinned, h2d_pageable, d2h_pageable] = raw.map(|curve| {
        let peak = curve.iter().map(|(b, s)| *b as f64 / s.median).fold(0.0, f64::max);
        curve
            .iter()
            .map(|&(bytes, s)| BwPoint {
                bytes: bytes as u64,
                gbps: (bytes as f64 / (s.median - latency_ns).max(1.0)).min(peak),
                spread: Some(s.spread),
            })
            .collect::<Vec<_>>()
    });
    let mut pcie_notes = Vec::new();
    let [mut h2d_pinned, mut d2h_pinned, mut h2d_pageable, mut d2h_pageable] =
        [h2d_pinned, d2h_pinned, h2d_pageable, d2h_pageable];
    for (name, curve) in [
        ("pinned H2D", &mut h2d_pinned),
        ("pinned D2H", &mut d2h_pinned),
        ("pageable H2D", &mut h2d_pageable),
        ("pageable D2H", &mut d2h_pageable),
    ] {
        pcie_notes.extend(monotone_copy_curve(name, curve));
    }
    notes.extend(pcie_notes);
    let big = (256 * MIB).min(host_bytes / 2);
    let bidir = sample(rule, || -> Result<f64> {
        let t0 = Instant::now();
        // SAFETY: H2D reads the first half of `pinned`, D2H writes the second; device halves are disjoint.
        unsafe {
            let (lo, hi) = (pinned.as_ptr(), pinned.as_ptr().add(big));
            gpu.h2d(Stream::H2d, dev.ptr(), std::slice::from_raw_parts(lo, big))?;
            gpu.d2h(Stream::D2h, std::slice::from_raw_parts_mut(hi, big), dev.ptr() + big as u64)?;
        }
        gpu.sync(Stream::H2d)?;
        gpu.sync(Stream::D2h)?;
        Ok(2.0 * big as f64 / t0.elapsed().as_nanos() as f64)
    })?;
    figures.add("H2D + D2H at once, aggregate (256 MiB each)", "GB/s", bidir);
    progress.tick(&format!("both directions: {:.1} GB/s", bidir.median))?;

    // Device memory bandwidth: a device-to-device copy, bytes read + written.
    let half = host_bytes / 2;
    let d2d = b.events(Stream::Compute, None, &mut |_| {
        // SAFETY: two disjoint halves of `dev`.
        unsafe { gpu.d2d(Stream::Compute, dev.ptr() + half as u64, dev.ptr(), half) }.map_err(Into::into)
    })?;
    let d2d_gbps = 2.0 * half as f64 / d2d.median;
    figures.add("device memory: D2D copy, read + written", "GB/s", Stat { median: d2d_gbps, ..d2d });
    progress.tick(&format!("device D2D copy: {d2d_gbps:.0} GB/s"))?;
    progress.tick("PCIe done")?;

    let h2d_big = h2d_pinned.last().expect("sizes").gbps;
    let dma_chunk = (256 * MIB).min(host_bytes / 2);
    let dma = DmaLoad {
        gpu: &gpu,
        src: &pinned.as_slice()[..dma_chunk],
        dst: dev.ptr(),
        copy_time: Duration::from_nanos((dma_chunk as f64 / h2d_big) as u64),
        copies: AtomicU64::new(0),
    };

    // ---- GPU ops ----
    let cat = shapes::from_catalog();
    let max_m = *g.tokens.iter().max().expect("tokens");
    let max_w = cat.matmul.iter().chain(&cat.experts).map(|s| s.n * s.k * 2).max().unwrap_or(0) as usize;
    let max_k = cat.matmul.iter().chain(&cat.experts).map(|s| s.k.max(s.n)).max().unwrap_or(1) as usize;
    let max_n = cat.matmul.iter().chain(&cat.experts).map(|s| s.n.max(s.k)).max().unwrap_or(1) as usize;
    let rot_bytes = (512 * MIB).max(max_w);
    let wbuf = gpu.alloc(rot_bytes)?;
    let xbuf = gpu.alloc(max_m * max_k * 2)?;
    let ybuf = gpu.alloc(max_m * max_n * 4)?;
    let mut staging = HostBuf::zeroed(64 * MIB);
    // SAFETY: `staging` outlives the registration (dropped at the end of this function, after it).
    let _sreg = unsafe { gpu.register(&staging)? };
    // The H200 itself does not change between leases, its shared host does: a host-only run keeps another
    // run's op rows and re-measures only what the host shapes (PCIe, launches, interference, DRAM, CPU).
    // Its routed-expert rows are host-paced too, and an executor change moves them: `experts_again` measures them
    // here in place of the base's.
    let mut measure_ops = |only_experts: bool| {
        measure_gpu_ops(
            &gpu,
            &b,
            &g,
            &cat,
            &mut staging,
            (&wbuf, &xbuf, &ybuf),
            (rot_bytes, max_m),
            only_experts,
            notes,
            progress,
        )
    };
    let gpu_rows = match gpu_ops_from {
        Some(rows) if experts_again => {
            let mut kept: Vec<OpRow> = rows.iter().filter(|r| !is_gpu_experts_row(r.op)).cloned().collect();
            kept.extend(measure_ops(true)?);
            kept
        }
        Some(rows) => rows.to_vec(),
        None => measure_ops(false)?,
    };
    // Two f32 elements for the sync measurement.
    let tiny = gpu.alloc(8)?;
    let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?;

    // ---- Latencies and interference ----
    progress.section("launch, ring copy issue and gap, host sync, copies vs compute", 11);
    let launch_probe = LaunchProbe::new(&gpu)?;
    let launch = sample(rule, || launch_probe.ns_per_launch(&gpu))?;
    figures.add("kernel launch (back-to-back tiny kernels, per launch)", "ns", launch);
    progress.tick(&format!("launch {:.2} µs", launch.median / 1e3))?;
    let issue_probe = RingIssueProbe::new(&gpu)?;
    let issue = sample(rule, || issue_probe.ns_per_unit(&gpu))?;
    figures.add(
        "ring copy issue per streamed unit (exec's ring protocol and span, host time, stream held)",
        "ns",
        issue,
    );
    progress.tick(&format!("ring copy issue {:.2} µs a unit", issue.median / 1e3))?;
    let ring_gap = sample(rule, || issue_probe.gap_ns_per_copy(&gpu))?;
    figures.add(
        "ring copy gap per copy (exec's ring protocol against plain copies, 4 MiB, copy engine)",
        "ns",
        ring_gap,
    );
    progress.tick(&format!("ring copy gap {:.2} µs a copy", ring_gap.median / 1e3))?;
    drop(issue_probe);
    let sync = sample(rule, || -> Result<f64> {
        let t0 = Instant::now();
        // SAFETY: as above.
        unsafe { gpu.add_bias(&kn, tiny.ptr(), tiny.ptr() + 4, 1, 1)? };
        gpu.sync(Stream::Compute)?;
        Ok(t0.elapsed().as_nanos() as f64)
    })?;
    figures.add("host sync (launch a tiny kernel, wait for it on the host)", "ns", sync);
    progress.tick(&format!("host sync {:.1} µs", sync.median / 1e3))?;
    let max_threads = *threads.iter().max().unwrap_or(&1) as usize;
    let (to_cpu, to_gpu) = routing_round_trip(&gpu, &kn, &mut staging, rule, max_threads, tiny.ptr())?;
    let back = experts_return(&gpu, &kn, rule, max_threads, None)?;
    // The same beside pinned H2D copies: the device's reads of host memory (the gate, the sum) and its
    // launches' fetches queue behind the copy's on the link (validation, session 22: a decode layer's return
    // took 35–41 µs to its add's start and the add 20–30 µs beside a streamed unit's copy, 7 and 3 idle).
    let mut beside = None;
    dma.during(&mut || {
        let (to_cpu, to_gpu) = routing_round_trip(&gpu, &kn, &mut staging, rule, max_threads, tiny.ptr())?;
        let add_ns = back.map(|(_, add_ns)| add_ns);
        let back =
            add_ns.map(|a| experts_return(&gpu, &kn, rule, max_threads, Some(a))).transpose()?.flatten();
        beside = Some((to_cpu, to_gpu, back));
        Ok(())
    })?;
    let (to_cpu_beside, to_gpu_beside, back_beside) = beside.expect("measured beside H2D copies");
    let back = back.map(|(st, _)| st);
    let back_beside = back_beside.map(|(st, _)| st);
    for (to, st, under) in [("CPU", to_cpu, to_cpu_beside), ("GPU", to_gpu, to_gpu_beside)] {
        let what = format!(
            "decode routing round trip, router kernels' end to the first {to} expert (exec, one token)"
        );
        figures.add(&what, "ns", st);
        figures.add(&format!("{what}, beside H2D copies"), "ns", under);
        progress.tick(&format!(
            "routing round trip to the {to}: {:.1} µs, {:.1} beside H2D copies",
            st.median / 1e3,
            under.median / 1e3
        ))?;
    }
    let what = "decode return from CPU experts, their end to the device starting their sum (exec, gated)";
    if let (Some(back), Some(under)) = (back, back_beside) {
        figures.add(what, "ns", back);
        figures.add(
            &format!("{what}, beside H2D copies, with the add's time past its idle one"),
            "ns",
            under,
        );
    }
    progress.tick(&match back.zip(back_beside) {
        Some((b, u)) => {
            format!(
                "return from CPU experts {:.1} µs, {:.1} beside H2D copies",
                b.median / 1e3,
                u.median / 1e3
            )
        }
        None => "return from CPU experts: no host flags on this device (the executor runs ungated)".into(),
    })?;

    // A memory-bound GEMV and a compute-bound GEMM from nemo-8b's FFN, alone and while H2D copies stream.
    let (fn_, fk) = (nemo.text.ffn as usize, nemo.text.hidden as usize);
    let wbytes = (fn_ * fk * 2).next_multiple_of(256);
    let copies = (rot_bytes / wbytes).max(1);
    let e = Elem::Bf16;
    upload_random(&gpu, &mut staging, e, wbuf.ptr(), rot_bytes, 50)?;
    let mut op_stats = Vec::new();
    for m in [1usize, 4096.min(max_m)] {
        let mut run = |i: usize| -> Result<()> {
            let w = wbuf.ptr() + ((i % copies) * wbytes) as u64;
            // SAFETY: as in the GEMM sweep.
            unsafe { gpu.gemm(e, w, xbuf.ptr(), ybuf.ptr(), m, fn_, fk, false) }.map_err(Into::into)
        };
        let alone = b.events(Stream::Compute, None, &mut run)?;
        let mut under = None;
        dma.during(&mut || {
            under = Some(b.events(Stream::Compute, None, &mut run)?);
            Ok(())
        })?;
        let under = under.expect("measured under DMA");
        let ratio = under.median / alone.median;
        let label = if m == 1 { "GEMV" } else { "GEMM" };
        figures.add(
            &format!("GPU {label} {fn_}×{fk} m={m} slowdown under H2D copies"),
            "x",
            Stat { median: ratio, spread: alone.spread.max(under.spread), samples: under.samples },
        );
        progress.tick(&format!("{label} under H2D: ×{ratio:.3}"))?;
        op_stats.push((m, alone, ratio));
    }
    let gemv_slowdown = op_stats[0].2.max(1.0);
    // H2D while the compute stream runs a queue of GEMVs (then GEMMs) three times as long as the copy.
    let copy_bytes = dma_chunk;
    let mut h2d_under = Vec::new();
    for (m, alone, _) in &op_stats {
        let queue = ((3.0 * copy_bytes as f64 / h2d_big / alone.median).ceil() as usize).max(1);
        let s = sample(rule, || -> Result<f64> {
            for i in 0..queue {
                let w = wbuf.ptr() + ((i % copies) * wbytes) as u64;
                // SAFETY: as in the GEMM sweep.
                unsafe { gpu.gemm(e, w, xbuf.ptr(), ybuf.ptr(), *m, fn_, fk, false)? };
            }
            gpu.record(&b.ev0, Stream::H2d)?;
            // SAFETY: copy_bytes of the pinned buffer into `dev`.
            unsafe { gpu.h2d(Stream::H2d, dev.ptr(), &pinned.as_slice()[..copy_bytes])? };
            gpu.record(&b.ev1, Stream::H2d)?;
            gpu.sync(Stream::H2d)?;
            let ms = gpu.elapsed_ms(&b.ev0, &b.ev1)?;
            gpu.sync(Stream::Compute)?;
            Ok(copy_bytes as f64 / (f64::from(ms) * 1e6))
        })?;
        let label = if *m == 1 { "GEMV" } else { "GEMM" };
        figures.add(&format!("pinned H2D (256 MiB) while GPU runs {label}s"), "GB/s", s);
        progress.tick(&format!("H2D during {label}s: {:.1} GB/s", s.median))?;
        h2d_under.push(s.median);
    }
    // Copies beside the CPU pool: pinned and pageable, with the host idle and with every CPU thread reading
    // DRAM, as the executor's streamed copies run beside its CPU experts and `ngl`'s prefill copies beside its
    // CPU layers (a pageable copy is also the host copying into the driver's staging buffers).
    let mut pinned_h2d = || -> Result<f64> {
        gpu.record(&b.ev0, Stream::H2d)?;
        // SAFETY: copy_bytes of the pinned buffer into `dev`.
        unsafe { gpu.h2d(Stream::H2d, dev.ptr(), &pinned.as_slice()[..copy_bytes])? };
        gpu.record(&b.ev1, Stream::H2d)?;
        gpu.sync(Stream::H2d)?;
        Ok(copy_bytes as f64 / (f64::from(gpu.elapsed_ms(&b.ev0, &b.ev1)?) * 1e6))
    };
    let mut pageable_h2d = || -> Result<f64> {
        let src = pageable.next(copy_bytes);
        let t0 = Instant::now();
        // SAFETY: copy_bytes of a live host buffer into `dev`, synchronised before the buffer is touched again.
        unsafe { gpu.h2d(Stream::H2d, dev.ptr(), src)? };
        gpu.sync(Stream::H2d)?;
        Ok(copy_bytes as f64 / t0.elapsed().as_nanos() as f64)
    };
    let mut both_copies =
        || -> Result<[Stat; 2]> { Ok([sample(rule, &mut pinned_h2d)?, sample(rule, &mut pageable_h2d)?]) };
    let idle = both_copies()?;
    let readers = pipeshard_exec::cpu::CpuPool::new(*threads.iter().max().unwrap_or(&1) as usize)?;
    let probe = cpu::DramProbe::default();
    let stop = AtomicBool::new(false);
    let busy = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(probe.read_gbps(&readers));
            }
        });
        std::thread::sleep(Duration::from_millis(3));
        let r = both_copies();
        stop.store(true, Ordering::Relaxed);
        r
    })?;
    let mut cpu_slowdown = [1.0; 2];
    for (i, from) in ["pinned", "pageable"].into_iter().enumerate() {
        for (what, st) in [("host idle", idle[i]), ("every CPU thread reading DRAM", busy[i])] {
            figures.add(&format!("{from} H2D (256 MiB), {what}"), "GB/s", st);
            progress.tick(&format!("{from} H2D, {what}: {:.1} GB/s", st.median))?;
        }
        // A slowdown: a faster reading beside the readers is noise.
        cpu_slowdown[i] = (idle[i].median / busy[i].median).max(1.0);
    }
    drop((pageable, probe));
    drop((wbuf, xbuf, ybuf, tiny));

    // ---- Host sections, with H2D copies as the background load ----
    let host = cpu::measure(mode, threads, Some(&dma), figures, progress)?;
    let copies_done = dma.copies.load(Ordering::Relaxed);
    notes.push(format!(
        "under DMA = while 256 MiB pinned H2D copies loop on the copy stream ({copies_done} copies ran in all)"
    ));

    // Rooflines: best measured.
    let mut matmul_flops = Vec::new();
    for &dtype in &g.dtypes {
        let best = gpu_rows
            .iter()
            .filter(|r| r.op == OpClass::MatMul && r.dtype == dtype)
            .map(|r| 2.0 * (r.tokens * r.n * r.k) as f64 / r.time_ns as f64 * 1e9)
            .fold(0.0, f64::max);
        matmul_flops.push((dtype, best));
    }
    let default_flops = matmul_flops.iter().map(|x| x.1).fold(0.0, f64::max);
    let gemv_gbps = gpu_rows
        .iter()
        .filter(|r| r.op == OpClass::MatMul && r.tokens == 1)
        .map(|r| {
            let weight_bytes = r.dtype.tensor_bytes(r.k, r.n).unwrap_or(2 * r.n * r.k);
            (weight_bytes + 4 * (r.n + r.k)) as f64 / r.time_ns as f64
        })
        .fold(0.0, f64::max);
    figures.add("best GPU GEMV weight stream", "GB/s", Stat { median: gemv_gbps, spread: 0.0, samples: 1 });
    let driver = crate::machine::nvidia_driver().map_or_else(String::new, |d| format!(", driver {d}"));
    let link = crate::machine::nvidia_pcie_link().unwrap_or_else(|| "link speed not readable".into());
    Ok(Profile {
        schema_version: pipeshard_core::profile::PROFILE_SCHEMA_VERSION,
        machine: Machine {
            name: String::new(),
            gpu: format!("{name}{driver}"),
            gpu_vram_bytes: vram_total,
            cpu: String::new(),
            cpu_threads: 1,
            host_ram_bytes: 0,
            pcie: format!("{link}; measured pinned H2D {h2d_big:.1} GB/s at {} MiB", max_copy / MIB),
        },
        provenance: pipeshard_core::profile::Provenance::Derived {
            sources: vec![],
            calibration: String::new(),
            fit: None,
        },
        pcie: PcieProfile {
            h2d_pinned,
            d2h_pinned,
            h2d_pageable,
            d2h_pageable,
            bidirectional_gbps: bidir.median,
            copy_latency_ns: latency_ns.round() as u64,
            h2d_under_compute_gbps: h2d_under.iter().copied().reduce(f64::min),
            h2d_pinned_cpu_slowdown: Some(cpu_slowdown[0]),
            h2d_pageable_cpu_slowdown: Some(cpu_slowdown[1]),
        },
        dram: host.dram,
        gpu: DeviceProfile {
            roofline: Roofline { matmul_flops, default_flops, mem_gbps: d2d_gbps.max(gemv_gbps) },
            ops: gpu_rows,
            dma_slowdown: gemv_slowdown,
        },
        cpu: host.device,
        launch_ns: launch.median.round() as u64,
        // The executor launches every kernel; it replays no CUDA graph.
        graph_kernel_ns: 0,
        host_sync_ns: sync.median.round() as u64,
        // The executor reads the routing on the host before any GPU expert runs.
        expert_ids_on_device: false,
        // exec's one-token steps run q|k|v and gate|up as one GEMM each.
        one_token_projections_fused: true,
        // …and fold the unit's input norm and FFN activation into them (the decode GEMV, which the one-token
        // matmul rows above measured).
        one_token_norm_act_fused: gpu.decode_gemv_on(),
        cpu_expert_ns: 0,
        host_route_ns_per_token: host.route_ns_per_token,
        decode_routing_to_cpu_ns: to_cpu.median.round() as u64,
        decode_routing_to_gpu_ns: to_gpu.median.round() as u64,
        decode_experts_return_ns: back.map_or(0, |b| b.median.round() as u64),
        decode_routing_to_cpu_beside_h2d_ns: to_cpu_beside.median.round() as u64,
        decode_routing_to_gpu_beside_h2d_ns: to_gpu_beside.median.round() as u64,
        decode_experts_return_beside_h2d_ns: back_beside.map_or(0, |b| b.median.round() as u64),
        ring_copy_issue_ns: issue.median.round() as u64,
        ring_copy_gap_ns: ring_gap.median.max(0.0).round() as u64,
        runtime_overhead_bytes,
        page_table_bytes_per_locked_gib,
        measurements: Vec::new(),
        notes: Vec::new(),
    })
}

/// The host's pace launching kernels: 1000 tiny kernels back to back on the compute stream, timed between
/// two events (the device runs each in less than a launch takes, so the span is the host's). The profile's
/// `launch_ns`, and the validation's check of it around each cell: host-paced work (a prefill chunk's GPU
/// experts, launches after CPU work) slows with it.
pub struct LaunchProbe {
    kn: std::sync::Arc<Kernels>,
    tiny: DevBuf,
    ev: (Event, Event),
}

impl std::fmt::Debug for LaunchProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchProbe").field("launches", &Self::LAUNCHES).finish_non_exhaustive()
    }
}

impl LaunchProbe {
    const LAUNCHES: u32 = 1000;

    /// # Errors
    /// Device errors (allocation, kernel compilation, events).
    pub fn new(gpu: &Gpu) -> Result<LaunchProbe> {
        Ok(LaunchProbe {
            kn: gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?,
            tiny: gpu.alloc(8)?,
            ev: (gpu.event(true)?, gpu.event(true)?),
        })
    }

    /// Nanoseconds a launch, one sample.
    ///
    /// # Errors
    /// Device errors.
    pub fn ns_per_launch(&self, gpu: &Gpu) -> Result<f64> {
        gpu.record(&self.ev.0, Stream::Compute)?;
        for _ in 0..Self::LAUNCHES {
            // SAFETY: one f32 element of x and b (the buffer's two).
            unsafe { gpu.add_bias(&self.kn, self.tiny.ptr(), self.tiny.ptr() + 4, 1, 1)? };
        }
        gpu.record(&self.ev.1, Stream::Compute)?;
        gpu.sync(Stream::Compute)?;
        Ok(f64::from(gpu.elapsed_ms(&self.ev.0, &self.ev.1)?) * 1e6 / f64::from(Self::LAUNCHES))
    }
}

/// Our executor's host time per streamed unit beyond its kernels' launches, the profile's
/// `ring_copy_issue_ns`: `UNITS` (64) units back to back through a ring of `DEPTH` (8) slots, each as
/// the executor enqueues a streamed unit — its copy issued into its slot by exec's [`RingSlot`] (behind the
/// slot's previous release, between two timing events, then its completion), the compute stream's wait for
/// it, the unit's timing span (two timing events on the compute stream, where its kernels would run) and the
/// slot's release — timed on the host with the compute stream held ([`Gpu::hold_compute`]), so that the
/// compute stream runs none of it meanwhile and the time is the host's alone. A copy moves `COPY_BYTES` (4 MiB) of
/// page-locked memory, about a q4_0 expert of qwen3-30b-a3b (2.7 MB). On the H200 machine the executor took
/// 57–61 µs to enqueue a q4_0 prefill expert, of which its kernels (the expert row, timed unheld) ≈ 45
/// (results/validation/2026-12-01-nvidia-h200, "host paces"). It also times the copy engine's share of the
/// protocol, the profile's `ring_copy_gap_ns` ([`Self::gap_ns_per_copy`]).
pub struct RingIssueProbe {
    kn: std::sync::Arc<Kernels>,
    slots: Vec<RingSlot>,
    /// Timing events around a run of copies ([`Self::gap_ns_per_copy`]).
    ev: (Event, Event),
    dev: DevBuf,
    // Declared before `src`: unregistered before its memory is freed.
    _reg: HostRegistration,
    src: HostBuf,
}

impl std::fmt::Debug for RingIssueProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingIssueProbe").field("units", &Self::UNITS).finish_non_exhaustive()
    }
}

impl RingIssueProbe {
    const UNITS: usize = 64;
    /// Fewer slots than units: most copies wait for a release, as in the executor's steady state.
    const DEPTH: usize = 8;
    const COPY_BYTES: usize = 4 * MIB;

    /// # Errors
    /// Device errors (allocation, registration, kernel compilation, events).
    pub fn new(gpu: &Gpu) -> Result<RingIssueProbe> {
        let mut src = HostBuf::zeroed(Self::COPY_BYTES);
        fill_random(src.as_mut_slice(), Elem::F32, 70);
        // SAFETY: `src` moves into the probe, which drops the registration first; registered once.
        let reg = unsafe { gpu.register(&src)? };
        Ok(RingIssueProbe {
            kn: gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?,
            slots: (0..Self::DEPTH).map(|_| RingSlot::new(gpu)).collect::<std::result::Result<_, _>>()?,
            ev: (gpu.event(true)?, gpu.event(true)?),
            dev: gpu.alloc(Self::DEPTH * Self::COPY_BYTES)?,
            _reg: reg,
            src,
        })
    }

    /// Copy-engine nanoseconds a ring copy takes beyond a plain one, one sample: `UNITS` copies issued as the
    /// ring issues them (each behind its slot's release, between timing events, the compute stream acquiring
    /// and releasing the slot at once, as in the executor's steady state where slots are free) against
    /// `UNITS` plain copies back to back, each run timed by events on the H2D stream.
    ///
    /// # Errors
    /// Device errors.
    pub fn gap_ns_per_copy(&self, gpu: &Gpu) -> Result<f64> {
        let per_copy = |ring: bool| -> Result<f64> {
            let mut spans = Vec::with_capacity(if ring { Self::UNITS } else { 0 });
            gpu.record(&self.ev.0, Stream::H2d)?;
            for i in 0..Self::UNITS {
                let slot = &self.slots[i % Self::DEPTH];
                let dst = self.dev.ptr() + ((i % Self::DEPTH) * Self::COPY_BYTES) as u64;
                // SAFETY: as in `ns_per_unit`.
                let copy = || unsafe { gpu.h2d(Stream::H2d, dst, self.src.as_slice()) };
                if ring {
                    spans.push(slot.issue(gpu, i >= Self::DEPTH, copy)?);
                    slot.acquire(gpu, Stream::Compute)?;
                    slot.release(gpu, Stream::Compute)?;
                } else {
                    copy()?;
                }
            }
            gpu.record(&self.ev.1, Stream::H2d)?;
            gpu.sync_all()?;
            Ok(f64::from(gpu.elapsed_ms(&self.ev.0, &self.ev.1)?) * 1e6 / Self::UNITS as f64)
        };
        Ok(per_copy(true)? - per_copy(false)?)
    }

    /// Host nanoseconds a unit, one sample.
    ///
    /// # Errors
    /// Device errors.
    pub fn ns_per_unit(&self, gpu: &Gpu) -> Result<f64> {
        gpu.hold_compute(&self.kn, HOLD_NS_PER_CALL * (Self::UNITS as u64 + 1))?;
        // The timing events live until the sample's end, as the executor's live until its run's.
        let mut spans = Vec::with_capacity(4 * Self::UNITS);
        let t0 = Instant::now();
        for i in 0..Self::UNITS {
            let slot = &self.slots[i % Self::DEPTH];
            let dst = self.dev.ptr() + ((i % Self::DEPTH) * Self::COPY_BYTES) as u64;
            // SAFETY: the slot's COPY_BYTES lie in `dev`, free once the copy runs (it waits for the slot's
            // release); `src` is page-locked and outlives the sync below.
            let (start, end, ()) = slot
                .issue(gpu, i >= Self::DEPTH, || unsafe { gpu.h2d(Stream::H2d, dst, self.src.as_slice()) })?;
            slot.acquire(gpu, Stream::Compute)?;
            let span = (gpu.mark(Stream::Compute)?, gpu.mark(Stream::Compute)?);
            slot.release(gpu, Stream::Compute)?;
            spans.push((start, end, span));
        }
        let ns = t0.elapsed().as_nanos() as f64 / Self::UNITS as f64;
        gpu.sync_all()?;
        drop(spans);
        Ok(ns)
    }
}

/// Our executor's routing round trip in a one-token decode step of qwen3-30b-a3b's MoE layer, router on the GPU,
/// as `Exec::moe_layer` runs it: the router's norm and GEMV, the logits (and, for CPU experts, the normed
/// input) copied down on the compute stream, the host's sync (the pool's workers polling, for CPU experts),
/// the routing and per-expert token lists, then either a pool job's start or the token lists copied up and
/// the first expert kernel. Returns the time from the router's kernels' end to the expert's start, to the CPU
/// and to the GPU: the validation's MoE decode layers spent 40–60 µs there against the 10–12 µs a host sync
/// and a small copy price (run29, qwen3-30b-a3b@4L bf16 with CPU experts). To the CPU it is the host's time
/// from the enqueue to the job's start less the router kernels' device time, so it also holds the first
/// kernel's launch latency (a few µs), which a decode step, whose router queues behind its attention, does
/// not pay.
fn routing_round_trip(
    gpu: &Gpu,
    kn: &Kernels,
    staging: &mut HostBuf,
    rule: Rule,
    threads: usize,
    expert_target: u64,
) -> Result<(Stat, Stat)> {
    use pipeshard_core::cost::{ROUTE_PROFILE_EXPERTS, ROUTE_PROFILE_TOP_K};
    use pipeshard_exec::cpu::{CpuPool, Routing};
    let spec = catalog::get("qwen3-30b-a3b").expect("catalog model");
    let hidden = spec.text.hidden as usize;
    let n_experts = ROUTE_PROFILE_EXPERTS as usize;
    let pool = CpuPool::new(threads)?;
    let (h, norm_w, router_w) =
        (gpu.alloc(hidden * 4)?, gpu.alloc(hidden * 4)?, gpu.alloc(n_experts * hidden * 2)?);
    let (xb, logits, lists) = (gpu.alloc(hidden * 2)?, gpu.alloc(n_experts * 4)?, gpu.alloc(4 * KIB)?);
    upload_random(gpu, staging, Elem::F32, h.ptr(), hidden * 4, 60)?;
    upload_random(gpu, staging, Elem::F32, norm_w.ptr(), hidden * 4, 61)?;
    upload_random(gpu, staging, Elem::Bf16, router_w.ptr(), n_experts * hidden * 2, 62)?;
    // Host side, registered as the executor's `moe_io`: logits and the normed input.
    let (lo, xo) = (0, 4 * KIB);
    let mut host = HostBuf::zeroed(16 * KIB);
    // SAFETY: `host` outlives the registration (dropped after it, at the end of this function).
    let _hreg = unsafe { gpu.register(&host)? };
    let (ev_a, ev_b, ev_c) = (gpu.event(true)?, gpu.event(true)?, gpu.event(true)?);
    let mut round_trip = |to_cpu: bool| -> Result<f64> {
        let t0 = Instant::now();
        gpu.record(&ev_a, Stream::Compute)?;
        // SAFETY: h and norm_w hold `hidden` f32, xb `hidden` activations, router_w `n_experts × hidden` bf16,
        // logits `n_experts` f32; the host buffer is registered and read only after the sync below.
        unsafe {
            gpu.norm_act(kn, h.ptr(), norm_w.ptr(), 0, xb.ptr(), 1, hidden, 1e-6, false)?;
            gpu.matmul(kn, None, router_w.ptr(), xb.ptr(), logits.ptr(), 1, n_experts, hidden, false)?;
            gpu.record(&ev_b, Stream::Compute)?;
            let buf = host.as_mut_slice();
            gpu.d2h(Stream::Compute, &mut buf[lo..lo + n_experts * 4], logits.ptr())?;
            if to_cpu {
                gpu.d2h(Stream::Compute, &mut buf[xo..xo + hidden * 2], xb.ptr())?;
            }
        }
        let warm = to_cpu.then(|| pool.keep_warm());
        gpu.sync(Stream::Compute)?;
        let routing =
            Routing::from_logits(&pool, &host.f32s()[..n_experts], n_experts, ROUTE_PROFILE_TOP_K, true);
        let per_expert = routing.per_expert(n_experts);
        drop(warm);
        let router_ns = f64::from(gpu.elapsed_ms(&ev_a, &ev_b)?) * 1e6;
        if to_cpu {
            let (started, ()) =
                pool.alongside(|| (Instant::now(), std::hint::black_box(&per_expert)).0, || ());
            return Ok((started - t0).as_nanos() as f64 - router_ns);
        }
        // The token ids and the routing weights, in one launch's parameters as the executor takes a small
        // step's inputs up (`Gpu::copy_inline_parts`).
        let entries: Vec<_> = per_expert.iter().flatten().collect();
        let ids: Vec<u8> = entries.iter().flat_map(|(t, _)| t.to_le_bytes()).collect();
        let weights: Vec<u8> = entries.iter().flat_map(|(_, w)| w.to_le_bytes()).collect();
        let n = ids.len() as u64;
        let parts =
            pipeshard_exec::cuda::InlineParts::new(&[(lists.ptr(), &ids), (lists.ptr() + n, &weights)])
                .expect("top-k ids and weights fit one launch");
        // SAFETY: `lists` holds 4 KiB ≥ both arrays (top-k entries each); `expert_target` one f32 pair (the
        // launch measurements' `tiny`).
        unsafe {
            gpu.copy_inline_parts(kn, &parts)?;
            gpu.record(&ev_c, Stream::Compute)?;
            gpu.add_bias(kn, expert_target, expert_target + 4, 1, 1)?;
        }
        gpu.sync(Stream::Compute)?;
        Ok(f64::from(gpu.elapsed_ms(&ev_b, &ev_c)?) * 1e6)
    };
    let to_cpu = sample(rule, || round_trip(true))?;
    let to_gpu = sample(rule, || round_trip(false))?;
    Ok((to_cpu, to_gpu))
}

/// What the pool's job in [`experts_return`] takes: CPU experts the host waits for (while polling).
const RETURN_CPU_WORK: Duration = Duration::from_micros(50);

/// Our executor's return from a one-token decode step's CPU experts to the GPU, as `Exec::moe_layer` runs it
/// where it pre-enqueued the next layer: the compute stream waits at the gate (a [`HostFlag`]) before adding
/// the experts' sum into the residual (`add_mapped`, which reads it over PCIe from mapped page-locked memory);
/// the pool runs the experts while the host thread polls (`CpuPool::alongside`), then the host writes the sum
/// and opens the gate. Returns the time from the pool job's end (where the executor reads its `cpu_end_ns`)
/// to the device starting the add: the host's time until it saw the add end, less the add's device time (so
/// it holds the host's detection of that end, about a µs of polling). Validation run41's decode layers took
/// ≈ 24 µs from their CPU experts' end to their sum's end, where a sync, a copy and the add priced ≈ 14.
/// None where the device or driver has no host flags (`Gpu::host_flag`), as the executor then runs ungated.
/// Also returns the add's median device time. With `idle_add_ns` (the add's device time measured idle), a
/// sample subtracts that instead of its own add's, so that what the add takes past it counts too (beside
/// H2D copies, where its reads of the mapped sum queue behind the copy's).
fn experts_return(
    gpu: &Gpu,
    kn: &Kernels,
    rule: Rule,
    threads: usize,
    idle_add_ns: Option<f64>,
) -> Result<Option<(Stat, f64)>> {
    use pipeshard_exec::cpu::CpuPool;
    use pipeshard_exec::cuda::HostFlag;
    /// Opens the gate when dropped, so that an error between the wait's enqueue and the release leaves no
    /// stream waiting.
    struct Open<'a>(&'a HostFlag, u32);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.release(self.1);
        }
    }
    let hidden = catalog::get("qwen3-30b-a3b").expect("catalog model").text.hidden as usize;
    let pool = CpuPool::new(threads)?;
    let h = gpu.alloc(hidden * 4)?;
    let part: Vec<f32> = (0..hidden).map(|i| (i % 7) as f32 * 1e-3).collect();
    let mut sum = HostBuf::zeroed(hidden * 4);
    // SAFETY: `sum` outlives the registration (declared after it, so dropped first), registered once.
    let (_reg, sum_dev) = unsafe { gpu.register_mapped(&sum)? };
    let Ok(flag) = gpu.host_flag() else { return Ok(None) };
    let (opened, added) = (gpu.event(true)?, gpu.event(true)?);
    let (mut seq, mut adds_ns) = (0u32, Vec::new());
    let back = sample(rule, || -> Result<f64> {
        seq = seq.wrapping_add(1);
        let gate = Open(&flag, seq);
        // SAFETY: the flag outlives the wait, and `gate` opens it on every path; `h` holds `hidden` f32 and
        // `sum_dev` maps `hidden` f32, which the host writes only before opening the gate and after the sync
        // below.
        unsafe {
            gpu.wait_flag(Stream::Compute, &flag, seq)?;
            gpu.record(&opened, Stream::Compute)?;
            gpu.add_mapped(kn, h.ptr(), sum_dev, hidden)?;
        }
        gpu.record(&added, Stream::Compute)?;
        let (cpu_end, ()) = pool.alongside(
            || {
                let t0 = Instant::now();
                while t0.elapsed() < RETURN_CPU_WORK {
                    std::hint::spin_loop();
                }
                Instant::now()
            },
            || (),
        );
        Elem::F32.write_row(&part, sum.as_mut_slice());
        drop(gate);
        gpu.sync_event(&added)?;
        let host_ns = cpu_end.elapsed().as_nanos() as f64;
        let add_ns = f64::from(gpu.elapsed_ms(&opened, &added)?) * 1e6;
        adds_ns.push(add_ns);
        Ok(host_ns - idle_add_ns.unwrap_or(add_ns))
    })?;
    adds_ns.sort_by(f64::total_cmp);
    Ok(Some((back, adds_ns[adds_ns.len() / 2])))
}

/// The GPU routed-expert row families (per expert, grouped, tiled).
fn is_gpu_experts_row(op: OpClass) -> bool {
    matches!(op, OpClass::Experts | OpClass::ExpertsGrouped | OpClass::ExpertsTiled)
}

/// exec's GPU op rows: GEMM/GEMV and routed experts over the catalog shapes × tokens, attention (prefill chunks,
/// decode, batched decode) over contexts and layouts, and the elementwise kernels; `only_experts`: the routed
/// experts' rows alone. `wbuf` (`rot_bytes`), `xbuf` and `ybuf` are sized for the largest shape and token count
/// (`max_m`).
#[allow(clippy::too_many_arguments)]
fn measure_gpu_ops(
    gpu: &Gpu,
    b: &Bench<'_>,
    g: &Grid,
    cat: &shapes::Shapes,
    staging: &mut HostBuf,
    (wbuf, xbuf, ybuf): (&DevBuf, &DevBuf, &DevBuf),
    (rot_bytes, max_m): (usize, usize),
    only_experts: bool,
    notes: &mut Vec<String>,
    progress: &dyn Progress,
) -> Result<Vec<OpRow>> {
    // The MoE scratch of one expert over up to max_m tokens; its token ids are 0..max_m, each picked once.
    let (e_ffn, e_hidden) = cat.experts.iter().fold((1, 1), |(f, h), s| (f.max(s.n), h.max(s.k)));
    let (e_ffn, e_hidden) = (e_ffn as usize, e_hidden as usize);
    let e_bufs = [4 * max_m, 4 * max_m, 2 * max_m * e_hidden, 4 * max_m * 2 * e_ffn]
        .into_iter()
        .chain([2 * max_m * e_ffn, 4 * max_m * e_hidden, 4 * max_m * e_hidden])
        .map(|bytes| gpu.alloc(bytes))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let ids: Vec<u8> = (0..max_m as u32).flat_map(u32::to_le_bytes).collect();
    let weights: Vec<u8> = (0..max_m).flat_map(|_| 0.125f32.to_le_bytes()).collect();
    // SAFETY: both buffers hold max_m 4-byte entries; the copies finish before the sources drop.
    unsafe {
        gpu.h2d(Stream::H2d, e_bufs[0].ptr(), &ids)?;
        gpu.h2d(Stream::H2d, e_bufs[1].ptr(), &weights)?;
    }
    gpu.sync(Stream::H2d)?;
    let expert_io = ExpertIo {
        xn: xbuf.ptr(),
        idx: e_bufs[0].ptr(),
        wts: e_bufs[1].ptr(),
        x: e_bufs[2].ptr(),
        gate_up: e_bufs[3].ptr(),
        act: e_bufs[4].ptr(),
        y: e_bufs[5].ptr(),
        h: e_bufs[6].ptr(),
    };
    // The grouped experts' entries as exec lays them out: expert g's one entry at g (`first`), its token
    // g mod m of the step's m = min(experts, 8) (the same as g mod 8), weight 0.125; a SwiGLU row an entry.
    let max_group = GROUP_SIZES[GROUP_SIZES.len() - 1];
    let max_tokens = GROUPED_EXPERTS_MAX_TOKENS as u32;
    let (g_first, g_idx, g_wts) =
        (gpu.alloc(4 * (max_group + 1))?, gpu.alloc(4 * max_group)?, gpu.alloc(4 * max_group)?);
    let g_act = gpu.alloc(2 * max_group * e_ffn)?;
    let first: Vec<u8> = (0..=max_group as u32).flat_map(u32::to_le_bytes).collect();
    let tokens: Vec<u8> = (0..max_group as u32).flat_map(|g| (g % max_tokens).to_le_bytes()).collect();
    let g_weights: Vec<u8> = (0..max_group).flat_map(|_| 0.125f32.to_le_bytes()).collect();
    // SAFETY: the buffers hold max_group + 1, max_group and max_group 4-byte entries; the copies finish
    // before the sources drop.
    unsafe {
        gpu.h2d(Stream::H2d, g_first.ptr(), &first)?;
        gpu.h2d(Stream::H2d, g_idx.ptr(), &tokens)?;
        gpu.h2d(Stream::H2d, g_wts.ptr(), &g_weights)?;
    }
    gpu.sync(Stream::H2d)?;
    let mut gpu_rows: Vec<OpRow> = Vec::new();
    // Quantised formats store whole 32-element blocks: shapes whose rows (or, for an expert's down, columns)
    // are not whole blocks have no quantised rows.
    let fits = |dtype: DType, n: u64, k: u64, experts: bool| {
        let block = dtype.block_elems();
        !dtype.is_quantized() || (k.is_multiple_of(block) && (!experts || n.is_multiple_of(block)))
    };
    let matmuls = cat.matmul.iter().filter(|_| !only_experts);
    let shapes: Vec<(&shapes::MatShape, bool)> =
        matmuls.map(|s| (s, false)).chain(cat.experts.iter().map(|s| (s, true))).collect();
    let grouped_rows = |quant: Option<QFormat>| -> usize {
        cat.experts.iter().map(|s| group_sizes(s.n as usize, s.k as usize, quant, rot_bytes).len()).sum()
    };
    let steps = g
        .dtypes
        .iter()
        .map(|&d| {
            let grouped = grouped_rows(QFormat::from_dtype(d));
            let tiled = cat.experts.iter().filter(|s| fits(d, s.n, s.k, true) && tiled_fit(s)).count();
            let tiled_tokens = g.tokens.iter().filter(|&&m| tiled_row(d, m)).count();
            shapes.iter().filter(|(s, e)| fits(d, s.n, s.k, *e)).count() * g.tokens.len()
                + tiled * tiled_tokens
                + grouped
        })
        .sum::<usize>();
    // The tiled rows' buffers: a group's token rows (each expert's tokens 0..m) and its index, at most.
    let tiled_units = |m: usize| (TILED_GROUP_ROWS / m).clamp(1, TILED_GROUP_MAX_EXPERTS);
    let tiled_entries = |m: usize| tiled_counts(m, tiled_units(m), max_m).iter().sum::<usize>();
    let tiled_index_bytes = |m: usize| {
        let (e, rows) = (tiled_entries(m), tiled_entries(m).min(max_m));
        tiled::tiled_index_max_bytes(rows, e, tiled_units(m), e).next_multiple_of(16)
    };
    let t_entries_max = g.tokens.iter().map(|&m| tiled_entries(m)).max().unwrap_or(1);
    let t_index_max = g.tokens.iter().map(|&m| tiled_index_bytes(m)).max().unwrap_or(1);
    let t_idx = gpu.alloc(4 * t_entries_max)?;
    let t_wts = gpu.alloc(4 * t_entries_max)?;
    let t_act = gpu.alloc(2 * t_entries_max * e_ffn)?;
    let t_y = gpu.alloc(4 * t_entries_max * e_hidden)?;
    // Index variants: one a set of distinct units, as many as it takes to cycle through every copy.
    let t_index = gpu.alloc(t_index_max * TILED_GROUP_MAX_EXPERTS.max(1))?;
    let t_weights: Vec<u8> = (0..t_entries_max).flat_map(|_| 0.125f32.to_le_bytes()).collect();
    // SAFETY: the buffer holds t_entries_max 4-byte entries; the copy finishes before the source drops.
    unsafe { gpu.h2d(Stream::H2d, t_wts.ptr(), &t_weights)? };
    gpu.sync(Stream::H2d)?;
    progress.section(
        "GPU GEMM/GEMV and routed experts (exec cuBLAS, quantised and grouped kernels) over catalog shapes × \
         tokens",
        steps as u64,
    );
    for &dtype in &g.dtypes {
        let quant = QFormat::from_dtype(dtype);
        // Quantised matmuls take bf16 activations, as a quantised model's are.
        let e = if quant.is_some() { Elem::Bf16 } else { elem(dtype) };
        let kn = gpu.kernels(KernelKey { act: e, kv: Elem::F16, head_dim: 128 })?;
        match quant {
            // Random quants and f16 scales whose bit patterns are random too: a NaN scale costs a GPU no time.
            Some(_) => upload_random(gpu, staging, Elem::F32, wbuf.ptr(), rot_bytes, 20)?,
            None => upload_random(gpu, staging, e, wbuf.ptr(), rot_bytes, 20)?,
        }
        upload_random(gpu, staging, e, xbuf.ptr(), xbuf.bytes(), 21)?;
        for &(shape, experts) in shapes.iter().filter(|(s, x)| fits(dtype, s.n, s.k, *x)) {
            let (n, k) = (shape.n as usize, shape.k as usize);
            // An expert's gate, up and down lie together ([`expert_layout`]); each sample's matrices come
            // from another slot so that none is read from L2.
            let (wbytes, expert) = expert_layout(n, k, quant);
            let unit_bytes = if experts { 3 * wbytes } else { wbytes };
            let copies = (rot_bytes / unit_bytes).max(1);
            for &m in &g.tokens {
                let (hold, min_reps) = if experts { (None, HOST_PACED_MIN_REPS) } else { (Some(&*kn), 1) };
                let s = b.events_min_reps(Stream::Compute, hold, min_reps, &mut |i| {
                    let w = wbuf.ptr() + ((i % copies) * unit_bytes) as u64;
                    // SAFETY: each slot holds n rows of k elements (an expert: two such and k rows of n) in the
                    // format, x m·k and y m·n elements; the expert buffers hold m ≤ max_m rows of every width and
                    // m distinct row ids.
                    unsafe {
                        if experts {
                            // exec's whole per-expert sequence (5 launches, 6 quantised above 8 tokens) over
                            // m tokens that all picked it.
                            gpu.expert_ffn(&kn, quant, w, expert, &expert_io, m, m, k, n)?;
                        } else {
                            gpu.matmul(&kn, quant, w, xbuf.ptr(), ybuf.ptr(), m, n, k, false)?;
                        }
                    }
                    Ok(())
                })?;
                // A row of this shape and token count from its measurement.
                let row = |op, s: &Stat| OpRow {
                    spread: Some(s.spread),
                    ..OpRow::gpu(op, dtype, (n as u64, k as u64), m as u64, s.median.ceil() as u64)
                };
                gpu_rows.push(row(if experts { OpClass::Experts } else { OpClass::MatMul }, &s));
                let flops = if experts { 6.0 } else { 2.0 } * (m * n * k) as f64;
                progress.tick(&format!("{dtype:?} {n}×{k} m={m}: {:.1} TFLOP/s", flops / s.median / 1e3))?;
                if experts && tiled_fit(shape) && tiled_row(dtype, m) {
                    let units = tiled_units(m).min(copies);
                    let tiled_io =
                        TiledBufs { idx: &t_idx, wts: &t_wts, act: &t_act, y: &t_y, index: &t_index };
                    let s = time_tiled(
                        gpu,
                        b,
                        &kn,
                        quant,
                        (wbuf, unit_bytes, copies),
                        expert,
                        (n, k),
                        (m, max_m),
                        units,
                        &tiled_io,
                        expert_io.h,
                        xbuf,
                    )?;
                    gpu_rows.push(row(OpClass::ExpertsTiled, &s));
                    progress.tick(&format!(
                        "{dtype:?} {n}×{k} m={m} tiled, {units} experts: {:.1} µs an expert",
                        s.median / 1e3
                    ))?;
                }
            }
        }
        // A layer's pinned experts of a step of ≤ 8 tokens as exec's two grouped launches, one token an
        // expert (f16/bf16 and the quantised formats but q2_k/q3_k: `group_sizes` is empty for those). Unheld
        // like the per-expert rows: the executor launches them right after the routing sync (whose round trip
        // is measured apart).
        for shape in &cat.experts {
            let (n, k) = (shape.n as usize, shape.k as usize);
            let sizes = group_sizes(n, k, quant, rot_bytes);
            let Some(&largest) = sizes.last() else { continue };
            let (wbytes, expert) = expert_layout(n, k, quant);
            let unit_bytes = 3 * wbytes;
            let copies = rot_bytes / unit_bytes;
            let g_base = gpu.alloc(copies * largest * 8)?;
            for groups in sizes {
                let bases = group_bases(wbuf.ptr(), unit_bytes, copies, groups);
                // SAFETY: g_base holds copies × largest ≥ bases.len() / 8 addresses; the copy finishes before
                // `bases` drops.
                unsafe { gpu.h2d(Stream::H2d, g_base.ptr(), &bases)? };
                gpu.sync(Stream::H2d)?;
                let m = groups.min(GROUPED_EXPERTS_MAX_TOKENS as usize);
                let s = b.events_min_reps(Stream::Compute, None, HOST_PACED_MIN_REPS, &mut |i| {
                    let io = GroupedIo {
                        base: g_base.ptr() + ((i % copies) * groups * 8) as u64,
                        first: g_first.ptr(),
                        idx: g_idx.ptr(),
                        wts: g_wts.ptr(),
                        xn: xbuf.ptr(),
                        act: g_act.ptr(),
                        h: expert_io.h,
                    };
                    // SAFETY: each of the sample's `groups` addresses is a distinct unit of wbuf (3 slots
                    // of `wbytes`, 256-byte aligned) with gate, up and down at `expert`'s offsets in
                    // `quant`'s format (the activation type where `None`); `first` runs 0..=groups, one entry
                    // an expert, its token < m ≤ 8 rows of xbuf (hidden k) and of h (f32, max_m ≥ 8 rows of
                    // e_hidden ≥ k); act holds max_group ≥ groups rows of e_ffn ≥ n; group_sizes checked the
                    // kernels' shapes and formats.
                    unsafe { gpu.grouped_experts(&kn, quant, expert, &io, groups, m, k, n)? };
                    Ok(())
                })?;
                gpu_rows.push(OpRow {
                    op: OpClass::ExpertsGrouped,
                    dtype,
                    n: n as u64,
                    k: k as u64,
                    tokens: groups as u64,
                    threads: 0,
                    time_ns: s.median.ceil() as u64,
                    time_ns_under_dma: None,
                    spread: Some(s.spread),
                    kv_heads: None,
                });
                progress.tick(&format!(
                    "{dtype:?} {n}×{k} grouped, {groups} experts: {:.1} µs",
                    s.median / 1e3
                ))?;
            }
        }
    }
    if only_experts {
        return Ok(gpu_rows);
    }

    // Attention: exec's kernel, prefill chunks and decode, over contexts and head layouts.
    let heads = kernel_heads(&cat.heads);
    let skipped: Vec<String> =
        cat.heads.iter().filter(|h| !heads.contains(h)).map(|h| format!("{h:?}")).collect();
    if !skipped.is_empty() {
        notes.push(format!(
            "attention layouts exec's kernel cannot run (head_dim not a multiple of 32 ≤ 256): {}",
            skipped.join(", ")
        ));
    }
    let ctx_max = *g.attn_ctx.iter().max().expect("contexts");
    let steps = g.kv_dtypes.len() * heads.len() * g.attn_ctx.len() * 2;
    progress
        .section("GPU attention (exec kernel): prefill chunk and decode × context × layout", steps as u64);
    let max_kv_dim = heads.iter().map(|h| h.kv_heads as usize * h.head_dim as usize).max().unwrap_or(1);
    let max_q_dim = heads.iter().map(|h| h.q_heads as usize * h.head_dim as usize).max().unwrap_or(1);
    let kv_half = ctx_max * max_kv_dim * 2;
    let kvbuf = gpu.alloc(2 * kv_half)?;
    let chunk = g.prefill_chunk;
    let qbuf = gpu.alloc(chunk * max_q_dim * 4)?;
    let obuf = gpu.alloc(chunk * max_q_dim * 2)?;
    let splits = pipeshard_core::workload::MAX_KEY_SPLITS as usize;
    let part_o = gpu.alloc(splits * max_q_dim * 4)?;
    let part_ml = gpu.alloc(splits * max_q_dim / 32 * 2 * 4 + 4096)?;
    upload_random(gpu, staging, Elem::F32, qbuf.ptr(), chunk * max_q_dim * 4, 30)?;
    for &kv_dtype in &g.kv_dtypes {
        let kv_e = elem(kv_dtype);
        upload_random(gpu, staging, kv_e, kvbuf.ptr(), 2 * kv_half, 31)?;
        for &h in &heads {
            let d = dims_for(h, 4096, Elem::Bf16);
            let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: kv_e, head_dim: d.head_dim })?;
            for &ctx in &g.attn_ctx {
                for decode in [true, false] {
                    let m = if decode { 1 } else { chunk.min(ctx) };
                    let pos0 = ctx - m;
                    let splits = scratch_layout(&d, m, 1, ctx, 0).attn_splits;
                    let s = b.events(Stream::Compute, Some(&kn), &mut |i| {
                        let (kc, vc) = kv_region(kvbuf.ptr(), kv_half, ctx, d.kv_dim, kv_e.size_bytes(), i);
                        // SAFETY: q holds m·q_dim f32, K and V (ctx_max·max_kv_dim each) hold ≥ ctx·kv_dim
                        // elements from kc and vc, out m·q_dim activations, part_o/part_ml 64 splits of one
                        // query's heads.
                        unsafe {
                            gpu.attention(
                                &kn,
                                qbuf.ptr(),
                                kc,
                                vc,
                                obuf.ptr(),
                                part_o.ptr(),
                                part_ml.ptr(),
                                m,
                                GpuKeys::causal(pos0),
                                d.n_heads,
                                d.n_kv_heads,
                                d.attn_scale(),
                                splits,
                            )
                        }
                        .map_err(Into::into)
                    })?;
                    let keys = if decode { ctx } else { pos0 + m.div_ceil(2) };
                    gpu_rows.push(OpRow {
                        op: OpClass::Attention,
                        dtype: kv_dtype,
                        n: d.q_dim as u64,
                        k: keys as u64,
                        tokens: m as u64,
                        threads: 0,
                        time_ns: s.median.ceil() as u64,
                        time_ns_under_dma: None,
                        spread: Some(s.spread),
                        kv_heads: Some(h.kv_heads),
                    });
                    progress.tick(&format!(
                        "{kv_dtype:?} {}q/{}kv×{} ctx {ctx} {}: {:.1} µs",
                        h.q_heads,
                        h.kv_heads,
                        h.head_dim,
                        if decode { "decode" } else { "prefill" },
                        s.median / 1e3
                    ))?;
                }
            }
        }
    }
    drop((kvbuf, part_o, part_ml));
    gpu_rows.extend(decode_attention_rows(gpu, b, g, &heads, staging, progress)?);

    // Elementwise kernels.
    let max_ffn = cat.ffn.iter().copied().max().unwrap_or(1) as usize;
    let max_hidden = cat.hidden.iter().copied().max().unwrap_or(1) as usize;
    let em = *g.elementwise_tokens.iter().max().expect("tokens");
    let steps = g.elementwise_tokens.len() * (cat.hidden.len() * 2 + cat.ffn.len());
    progress.section("GPU norm / RoPE / SwiGLU (exec kernels)", steps as u64);
    let ew = gpu.alloc(em * max_ffn.max(max_hidden) * 4 * 3)?;
    upload_random(gpu, staging, Elem::F32, ew.ptr(), em * max_ffn.max(max_hidden) * 4 * 3, 40)?;
    let stride = (em * max_ffn.max(max_hidden) * 4) as u64;
    let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::F16, head_dim: 128 })?;
    for &m in &g.elementwise_tokens {
        for &hid in &cat.hidden {
            let hid = hid as usize;
            let s = b.events(Stream::Compute, Some(&kn), &mut |_| {
                // SAFETY: x holds m·hid f32 (region 0), w hid f32 (region 1), out m·hid activations (region 2).
                unsafe {
                    gpu.norm_act(
                        &kn,
                        ew.ptr(),
                        ew.ptr() + stride,
                        0,
                        ew.ptr() + 2 * stride,
                        m,
                        hid,
                        1e-5,
                        false,
                    )
                }
                .map_err(Into::into)
            })?;
            gpu_rows.push(gpu_elementwise(OpClass::Norm, hid as u64, m, s));
            progress.tick(&format!("norm {hid} m={m}"))?;
            let heads = (hid / 128).max(1);
            let s = b.events(Stream::Compute, Some(&kn), &mut |_| {
                // SAFETY: x holds m·heads·128 f32 (region 0), inv_freq 64 f32 (region 1).
                unsafe { gpu.rope(&kn, ew.ptr(), ew.ptr() + stride, m, heads, 128, 64, (1000, 1)) }
                    .map_err(Into::into)
            })?;
            gpu_rows.push(gpu_elementwise(OpClass::Rope, (heads * 128) as u64, m, s));
            progress.tick(&format!("rope {hid} m={m}"))?;
        }
        for &f in &cat.ffn {
            let f = f as usize;
            let s = b.events(Stream::Compute, Some(&kn), &mut |_| {
                // SAFETY: g, u hold m·f f32 (regions 0, 1), out m·f activations (region 2).
                unsafe { gpu.ffn_act(&kn, Some(ew.ptr()), ew.ptr() + stride, ew.ptr() + 2 * stride, m, f, f) }
                    .map_err(Into::into)
            })?;
            gpu_rows.push(gpu_elementwise(OpClass::Activation, f as u64, m, s));
            progress.tick(&format!("swiglu {f} m={m}"))?;
        }
    }
    Ok(gpu_rows)
}

/// Caps points so that the cost model's copy time, `latency + bytes / gbps(bytes)` with `gbps` linear in
/// log(bytes) between points, never falls as bytes grow: between points `a < b` that holds iff
/// `gbps_b ≤ gbps_a · (1 + ln(b / a))`. A point above that is lowered to it (its copies are then predicted a
/// little slower than measured, never faster); each lowered point is returned as a note.
pub fn monotone_copy_curve(name: &str, curve: &mut [BwPoint]) -> Vec<String> {
    let mut notes = Vec::new();
    for i in 1..curve.len() {
        let (a, b) = (curve[i - 1], curve[i]);
        let cap = a.gbps * (1.0 + (b.bytes as f64 / a.bytes as f64).ln());
        if b.gbps > cap {
            notes.push(format!(
                "{name} {} KiB: effective rate {:.2} GB/s lowered to {cap:.2} GB/s so that interpolation never \
                 predicts a larger copy faster than a smaller one",
                b.bytes >> 10,
                b.gbps
            ));
            curve[i].gbps = cap;
        }
    }
    notes
}

fn gpu_elementwise(op: OpClass, n: u64, m: usize, s: Stat) -> OpRow {
    OpRow {
        op,
        dtype: DType::F32,
        n,
        k: 1,
        tokens: m as u64,
        threads: 0,
        time_ns: s.median.ceil().max(1.0) as u64,
        time_ns_under_dma: None,
        spread: Some(s.spread),
        kv_heads: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiled row's experts average its token count (units a multiple of 4), spread by ±√m from 16 tokens on
    /// (63 ± 8 at 64), exact below, and never more than the token rows there are.
    #[test]
    fn tiled_rows_spread_their_experts_counts_around_the_rows_tokens() {
        for m in [1usize, 8, 16, 64, 256, 1024] {
            let c = tiled_counts(m, 16, 4096);
            assert_eq!(c.iter().sum::<usize>(), 16 * m, "{m}: {c:?}");
            assert_eq!(c.iter().all(|&x| x == m), m < 16, "{m}: {c:?}");
        }
        assert_eq!(&tiled_counts(64, 4, 4096), &[52, 60, 68, 76]);
        assert!(tiled_counts(4096, 4, 4096).iter().all(|&x| (1..=4096).contains(&x)));
    }

    /// On a device, the ring issue probe times the host's enqueueing, not the copies it enqueues (64 × 4 MiB
    /// take ≈ 76 µs a unit at PCIe gen5's 55 GB/s). Skips without one.
    #[test]
    fn the_ring_issue_probe_times_the_host_not_the_copies() {
        if let Err(reason) = pipeshard_exec::cuda::probe() {
            eprintln!("skipped: no CUDA device: {reason}");
            return;
        }
        let gpu = Gpu::new().unwrap();
        let probe = RingIssueProbe::new(&gpu).unwrap();
        let ns = probe.ns_per_unit(&gpu).unwrap();
        assert!((100.0..60_000.0).contains(&ns), "{ns} ns a unit");
        // The gap is the events' and the wait's share of the copy engine: microseconds, not a copy (≈ 76 µs).
        let gap = probe.gap_ns_per_copy(&gpu).unwrap();
        assert!((-5_000.0..30_000.0).contains(&gap), "{gap} ns a copy");
    }

    /// Copies read the executor's kind of buffer (page-aligned, random), each the next region, wrapping
    /// before the end.
    #[test]
    fn pageable_copies_take_the_next_region_of_page_aligned_random_bytes() {
        let mut src = PageableSource::new(64 * MIB);
        let base = src.buf.as_ptr() as usize;
        assert_eq!(base % pipeshard_exec::host::HOST_ALIGN_BYTES, 0);
        let starts: Vec<usize> = (0..5).map(|_| src.next(24 * MIB).as_ptr() as usize - base).collect();
        assert_eq!(starts, [0, 24 * MIB, 0, 24 * MIB, 0]);
        assert_eq!(src.next_mut(16 * MIB).as_ptr() as usize - base, 24 * MIB);
        assert_eq!(src.next(64 * MIB).len(), 64 * MIB);
        // Random values in every 16 MiB chunk, not the allocation's zeros (each chunk has its own seed).
        for chunk in src.buf.as_slice().chunks(16 * MIB) {
            assert!(chunk[..4096].iter().map(|&b| u32::from(b == 0)).sum::<u32>() < 64);
        }
        let chunks: Vec<&[u8]> = src.buf.as_slice().chunks(16 * MIB).map(|c| &c[..64]).collect();
        assert!(chunks.windows(2).all(|w| w[0] != w[1]));
    }

    /// Grouped rows take up to as many experts as the rotating buffer holds units: qwen3-30b-a3b's 9 MiB
    /// bf16 expert 56 of 512 MiB, qwen3-235b-a22b's 36 MiB 14; each sample's experts are distinct units and
    /// the next sample's continue the rotation.
    #[test]
    fn grouped_samples_take_distinct_units_in_rotation() {
        assert_eq!(group_sizes(768, 2048, None, 512 * MIB), [1, 2, 4, 8, 16, 32]);
        assert_eq!(group_sizes(1536, 4096, None, 512 * MIB), [1, 2, 4, 8]);
        assert!(group_sizes(768, 2044, None, 512 * MIB).is_empty(), "rows of whole 16-byte vectors only");
        // Quantised experts are smaller (q4_0's 2.6 MiB: 202 units) and take the grouped rows too, but for
        // q2_k/q3_k's and shapes the format cannot store.
        assert_eq!(group_sizes(768, 2048, Some(QFormat::Q4_0), 512 * MIB), GROUP_SIZES);
        assert_eq!(group_sizes(768, 2048, Some(QFormat::Q6K), 512 * MIB), GROUP_SIZES);
        assert!(group_sizes(768, 2048, Some(QFormat::Q2K), 512 * MIB).is_empty());
        assert!(group_sizes(768, 2080, Some(QFormat::Q4K), 512 * MIB).is_empty(), "whole super-blocks");
        let (base, unit) = (1u64 << 40, 9 * MIB);
        let bases = group_bases(base, unit, 5, 2);
        let units: Vec<u64> = bases
            .chunks(8)
            .map(|b| (u64::from_le_bytes(b.try_into().unwrap()) - base) / unit as u64)
            .collect();
        assert_eq!(units, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]);
        let (wbytes, o) = expert_layout(768, 2048, None);
        assert_eq!((wbytes, o.up, o.down), (3 * MIB, 3 * MIB, 6 * MIB), "gate|up one matrix");
    }

    /// Attention calls rotate over 256-byte-aligned regions of the K and V halves that together exceed the L2,
    /// wrapping before the half's end; a cache as large as the half has one region.
    #[test]
    fn attention_calls_read_the_next_kv_region() {
        let (base, half) = (1u64 << 40, 64 * MIB);
        // 1K keys of 8 heads × 128 in f16: 2 MiB a region, 32 of them.
        let regions: Vec<(u64, u64)> = (0..34).map(|i| kv_region(base, half, 1024, 1024, 2, i)).collect();
        assert_eq!(regions[1].0 - regions[0].0, 2 * MIB as u64);
        assert_eq!(regions[32], regions[0]);
        assert!(regions.iter().all(|&(k, v)| v - k == half as u64 && (k - base) % 256 == 0));
        assert!(regions.iter().all(|&(k, _)| k - base + 2 * MIB as u64 <= half as u64));
        assert_eq!(kv_region(base, half, 32 * 1024, 1024, 2, 5), (base, base + half as u64));
    }
}
