//! CPU kernels and the CPU side of a forward pass. They double as the reference the GPU path is checked
//! against: every rounding the GPU path does (activations to the matrix format before each matmul, and to 8
//! bits in q2_k/q3_k GEMVs; K/V to the cache format) happens here at the same point, so the two differ only in
//! the order of f32 additions.
//!
//! Layouts: activations are row-major `[tokens, features]` f32; a matrix is `[rows, row_elems]` (output
//! features × input features) in f16 or bf16; a layer's KV cache is `[K | V]`, each `[ctx, kv_heads, head_dim]`.
//! RoPE rotates the first and second halves of the rotated dimensions (transformers' `rotate_half`).

pub mod kdot;
pub mod qdot;
pub mod simd;

use pipeshard_core::model::{FfnKind, NormKind};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{ExecError, Result};
use crate::host::Elem;
use crate::quant::{EXACT_MAX_TOKENS, QFormat};
use crate::seqs::{KeyRows, Pass, SeqKv};
use crate::weights::{AttnOffsets, Dims, ExpertOffsets, FfnOffsets, OutputOffsets, RouterOffsets};
pub use qdot::{CacheLevel, Prefetch};
use simd::Isa;

/// A worker pool of `threads` threads and the instruction set its kernels use.
#[derive(Debug)]
pub struct CpuPool {
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    prefetch: Prefetch,
    /// Tasks per thread a matmul's rows are cut into; `None`: [`TASKS_PER_THREAD`], or for quantised rows
    /// [`QUANT_TASKS_PER_THREAD`].
    tasks_per_thread: Option<usize>,
    gemv_rows: usize,
}

impl CpuPool {
    /// A pool of `threads` workers (at least one).
    pub fn new(threads: usize) -> Result<CpuPool> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pipeshard-cpu-{i}"))
            .build()
            .map_err(|e| ExecError::Input(format!("cannot start {threads} CPU worker threads: {e}")))?;
        Ok(CpuPool {
            pool,
            threads,
            isa: simd::detect(),
            prefetch: QUANT_PREFETCH,
            tasks_per_thread: None,
            gemv_rows: QUANT_GEMV_ROWS,
        })
    }

    /// A pool whose kernels use `isa`, which must be this machine's or a weaker one (to compare kernels).
    pub fn with_isa(threads: usize, isa: Isa) -> Result<CpuPool> {
        let best = simd::detect();
        if isa > best {
            return Err(ExecError::Input(format!(
                "CPU instruction set {isa:?} requested; this CPU has {best:?}"
            )));
        }
        Ok(CpuPool { isa, ..CpuPool::new(threads)? })
    }

    /// The same pool with the quantised kernels prefetching as `prefetch` says, to compare.
    #[must_use]
    pub fn with_prefetch(self, prefetch: Prefetch) -> CpuPool {
        CpuPool { prefetch, ..self }
    }

    /// How the quantised kernels prefetch.
    #[must_use]
    pub fn prefetch(&self) -> Prefetch {
        self.prefetch
    }

    /// The same pool with a matmul's rows cut into `tasks` tasks per thread (at least 1), to compare.
    #[must_use]
    pub fn with_tasks_per_thread(self, tasks: usize) -> CpuPool {
        CpuPool { tasks_per_thread: Some(tasks.max(1)), ..self }
    }

    /// Tasks per thread a quantised matmul's rows are cut into.
    #[must_use]
    pub fn quant_tasks_per_thread(&self) -> usize {
        self.tasks_per_thread.unwrap_or(QUANT_TASKS_PER_THREAD)
    }

    /// The same pool with a quantised GEMV (up to 3 tokens) taking `rows` rows (4 or 8) per register block, to
    /// compare.
    ///
    /// # Errors
    /// For another count.
    pub fn with_gemv_rows(self, rows: usize) -> Result<CpuPool> {
        if !matches!(rows, 4 | 8) {
            return Err(ExecError::Input(format!("{rows} rows per quantised GEMV block; give 4 or 8")));
        }
        Ok(CpuPool { gemv_rows: rows, ..self })
    }

    /// Rows per register block of a quantised GEMV.
    #[must_use]
    pub fn gemv_rows(&self) -> usize {
        self.gemv_rows
    }

    /// Worker threads.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The instruction set in use.
    #[must_use]
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Runs `f` inside the pool, so its parallel iterators use the pool's threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Wakes every worker and keeps it polling until the returned guard is dropped (or [`WARM_MAX`] has
    /// passed), so that CPU work the host hands over after a GPU wait starts at once. Idle rayon workers sleep
    /// within tens of µs, and waking them one by one as parallel work fans out costs what the profiler's
    /// back-to-back samples never pay (llama.cpp's worker threads poll between graph nodes for the same
    /// reason).
    #[must_use = "the workers stop polling when the guard is dropped"]
    pub fn keep_warm(&self) -> WarmGuard {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        self.pool.spawn_broadcast(move |_| {
            let t0 = Instant::now();
            while !flag.load(Ordering::Acquire) && t0.elapsed() < WARM_MAX {
                // Yield so that the host thread (one more thread than cores) still gets a core.
                std::thread::yield_now();
            }
        });
        WarmGuard { stop }
    }

    /// Runs `work` on the pool while the calling thread runs `host` (which may block, e.g. on a GPU ring
    /// slot), and returns both results once both are done.
    ///
    /// The calling thread then polls for `work`'s end instead of sleeping on rayon's latch: waking it took
    /// 30–57 µs on the H200 machine's host (MoE decode, from the last CPU expert to the sum's upload
    /// enqueued), polling 8.5 µs; qwen3-30b-a3b@4L bf16 at 2 GB (pshard, CPU experts) decoded 249 against
    /// 209–216 tok/s, its q4_0@24L at 2 GB (ilp) 109 against 96–99 (one lease, interleaved runs).
    pub fn alongside<W: Send, H>(&self, work: impl FnOnce() -> W + Send, host: impl FnOnce() -> H) -> (W, H) {
        let mut done = None;
        let finished = AtomicBool::new(false);
        let h = self.pool.in_place_scope(|s| {
            s.spawn(|_| {
                done = Some(work());
                finished.store(true, Ordering::Release);
            });
            let h = host();
            while !finished.load(Ordering::Acquire) {
                // Yield: the workers hold every core, and the last of them still has to finish.
                std::thread::yield_now();
            }
            h
        });
        (done.expect("the scope waits for its spawned work"), h)
    }
}

/// How long [`CpuPool::keep_warm`]'s workers poll at most.
pub const WARM_MAX: Duration = Duration::from_millis(2);

/// Stops the polling [`CpuPool::keep_warm`] started, when dropped.
#[derive(Debug)]
pub struct WarmGuard {
    stop: Arc<AtomicBool>,
}

impl Drop for WarmGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// How the quantised kernels prefetch along each row. Measured on the H200 machine's Xeon (16
/// threads, `pipeshard exec bench`): q4_0 77 GB/s with it against 70 without, q8_0 118 against 102.
pub const QUANT_PREFETCH: Prefetch = Prefetch { bytes: 1024, level: CacheLevel::L1 };

/// Tasks per thread a matmul's rows are cut into: few, long tasks cost the least scheduling in a streaming
/// GEMV; more of them even out the threads' finishing times.
pub const TASKS_PER_THREAD: usize = 4;

/// Tasks per thread a quantised matmul's rows are cut into. Its kernels are near a core's compute limit, so
/// the threads finish a GEMV at different times, and more, shorter tasks even that out. Measured on the H200
/// machine's Xeon (16 threads, `exec bench`, 512 MB matrices; GB/s with 16 against 4 tasks): run-q2 q8_0
/// 131.8 / 103.3, q4_0 88.9 / 75.5, q4_k 81.8 / 67.3, q6_k 83.6 / 69.0, q2_k 50.4 / 43.9, q3_k 55.9 / 46.7;
/// run-q1 q4_0 91.6 / 73.7–83.3, q4_k 87.4 / 69.8–75.0, q6_k 84.2 / 87.4 (the one loss, within the ±15 % the
/// same case varies between runs) (results/exec/bounds).
pub const QUANT_TASKS_PER_THREAD: usize = 16;

/// Rows per register block of a quantised GEMV (up to 3 tokens): each is its own stream through memory, and
/// they share each activation load and conversion. Measured on the H200 machine's Xeon (16 threads, `exec
/// bench`, results/exec/quant run 6): 8 rows against 4, q8_0 112.4 against 104.5 GB/s, q4_0 71.8 against 69.6.
pub const QUANT_GEMV_ROWS: usize = 8;

/// A raw pointer that tasks share, each writing disjoint elements if any.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements, and the owner outlives the parallel region.
unsafe impl Send for SharedPtr {}
// SAFETY: as above.
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    /// The pointer (a method, so closures capture the whole Send + Sync wrapper, not its raw field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Activation rows as a kernel reads them and their stride in f32s, where that is not the rows themselves.
type PackedX = Option<(Vec<f32>, usize)>;

/// A matrix row format and its `R` rows × `T` tokens inner kernel, so one tiling loop serves every format.
trait RowFormat: Copy + Send + Sync {
    /// Whether a register block's rows are taken far apart (see `tiled`); the kernels then take any row stride.
    const SPREAD_ROWS: bool;
    /// Bytes of one row of `k` elements.
    fn row_bytes(self, k: usize) -> usize;
    /// Tasks per thread a matmul's rows are cut into, unless the pool says otherwise.
    fn tasks_per_thread(self) -> usize;
    /// The `m` activation rows (of `k`) as `dot` reads them on `isa`, and their stride, where that is not
    /// the rows themselves (see [`qdot::pack_x`]).
    fn pack_x(self, isa: Isa, x: &[f32], m: usize, k: usize) -> PackedX;
    /// `out[r][t] = Σ_i x[t][i] · w[r][i]` over `R` rows starting at `w`, `w_stride` bytes apart (adjacent
    /// rows unless `SPREAD_ROWS`); quantised kernels prefetch ahead of every block they read as `pf` says.
    ///
    /// # Safety
    /// `w` holds `R` rows, `x` holds `T` rows of stride `ldx` with at least `k` f32s each, or of what `pack_x`
    /// made; `isa` was detected.
    unsafe fn dot<const R: usize, const T: usize>(
        self,
        isa: Isa,
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        w_stride: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    );
}

impl RowFormat for Elem {
    const SPREAD_ROWS: bool = false;
    fn row_bytes(self, k: usize) -> usize {
        k * self.size_bytes()
    }
    fn tasks_per_thread(self) -> usize {
        TASKS_PER_THREAD
    }
    fn pack_x(self, _isa: Isa, _x: &[f32], _m: usize, _k: usize) -> PackedX {
        None
    }
    unsafe fn dot<const R: usize, const T: usize>(
        self,
        isa: Isa,
        _pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        _w_stride: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // The kernels load with unaligned (`loadu`) instructions, so a byte pointer cast to u16 is fine.
        #[allow(clippy::cast_ptr_alignment)]
        // SAFETY: forwarded from the caller.
        unsafe {
            simd::dot_block::<R, T>(isa, self, x, ldx, w.cast::<u16>(), k, out);
        }
    }
}

impl RowFormat for QFormat {
    const SPREAD_ROWS: bool = true;
    fn row_bytes(self, k: usize) -> usize {
        QFormat::row_bytes(self, k)
    }
    fn tasks_per_thread(self) -> usize {
        QUANT_TASKS_PER_THREAD
    }
    fn pack_x(self, isa: Isa, x: &[f32], m: usize, k: usize) -> PackedX {
        qdot::pack_x(isa, self, x, m, k)
    }
    unsafe fn dot<const R: usize, const T: usize>(
        self,
        isa: Isa,
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        w_stride: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: forwarded from the caller (k is whole blocks: `matmul_quant` checks it).
        unsafe { qdot::dot_block::<R, T>(isa, self, pf, x, ldx, w, w_stride, k, out) };
    }
}

/// `y[t][j] (+)= Σ_i x[t][i] · w[j][i]`: `x` is `[m, k]` f32, `w` is `[n, k]` in `elem`, `y` is `[m, n]`.
pub fn matmul(
    pool: &CpuPool,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    elem: Elem,
    n: usize,
    y: &mut [f32],
    accumulate: bool,
) {
    assert!(matches!(elem, Elem::F16 | Elem::Bf16), "matrices are f16 or bf16");
    tiled(pool, x, m, k, w, elem, n, y, n, accumulate);
}

/// [`matmul`] with `w` `[n, k]` in a block-quantised format (`k` a multiple of its block). Up to
/// [`EXACT_MAX_TOKENS`] tokens it equals dequantising `w` to f32 first, up to the order of f32 additions (q2_k
/// and q3_k: on the activations rounded by [`crate::quant::round_activations`], as the GPU rounds them); with
/// more, `w` is dequantised to bf16 in chunks of rows and multiplied by the bf16 kernel, as the GPU does.
pub fn matmul_quant(
    pool: &CpuPool,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    fmt: QFormat,
    n: usize,
    y: &mut [f32],
    accumulate: bool,
) {
    matmul_quant_in_chunks(pool, x, m, k, w, fmt, n, y, accumulate, 8 << 20);
}

/// [`matmul_quant`] with at most `chunk_bytes` of dequantised bf16 rows at a time.
fn matmul_quant_in_chunks(
    pool: &CpuPool,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    fmt: QFormat,
    n: usize,
    y: &mut [f32],
    accumulate: bool,
    chunk_bytes: usize,
) {
    assert!(k.is_multiple_of(fmt.block_elems()), "{fmt:?} rows of {k} elements are not whole blocks");
    if m <= EXACT_MAX_TOKENS {
        tiled(pool, x, m, k, w, fmt, n, y, n, accumulate);
        return;
    }
    let (rb, chunk_rows) = (fmt.row_bytes(k), (chunk_bytes / (2 * k)).clamp(1, n));
    let mut wb = vec![0u8; chunk_rows * k * 2];
    let mut r0 = 0;
    while r0 < n {
        let rows = chunk_rows.min(n - r0);
        pool.install(|| {
            wb[..rows * k * 2].par_chunks_mut(k * 2).zip(w[r0 * rb..].par_chunks(rb)).for_each(
                |(out, blocks)| {
                    let mut row = vec![0f32; k];
                    fmt.dequantize_row(blocks, &mut row);
                    for (i, &v) in row.iter().enumerate() {
                        Elem::Bf16.write(out, i, v);
                    }
                },
            );
        });
        tiled(pool, x, m, k, &wb[..rows * k * 2], Elem::Bf16, rows, &mut y[r0..], n, accumulate);
        r0 += rows;
    }
}

/// One matmul's operands as tasks over its rows read and write them: `y[t][j] (+)= Σ_i x[t][i] · w[j][i]`
/// with `x` the activations as the format's kernel reads them (`ldx` apart; see [`RowFormat::pack_x`]), `w`
/// rows of `k` elements and `y[t][j]` at `t × ldy + j`.
#[derive(Clone, Copy)]
struct RowsJob {
    x: *const f32,
    ldx: usize,
    m: usize,
    k: usize,
    w: *const u8,
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
}
// SAFETY: tasks over one job read `x` and `w` and write disjoint rows of `y`, whose owners outlive them.
unsafe impl Send for RowsJob {}
// SAFETY: as above.
unsafe impl Sync for RowsJob {}

impl RowsJob {
    /// Rows `r0..r1` of the product, on the calling thread: groups of 4 rows (4×4 rows × tokens register
    /// blocks), or for a quantised GEMV the pool's `gemv_rows`, then single rows.
    ///
    /// # Safety
    /// `x` holds the job's `m` activation rows, `w` at least `r1` rows, `y` the elements the job names for
    /// these rows, and no other thread touches those elements meanwhile.
    unsafe fn rows<F: RowFormat>(self, pool: &CpuPool, fmt: F, r0: usize, r1: usize) {
        let RowsJob { x: xp, ldx, m, k, w: wp, y, ldy, accumulate } = self;
        let (isa, pf, rb) = (pool.isa, pool.prefetch, fmt.row_bytes(k));
        let store = |t: usize, r: usize, v: f32| {
            // SAFETY: t < m and r < r1, so the index is inside y (the caller's promise); these rows are this
            // call's alone.
            unsafe {
                let p = y.add(t * ldy + r);
                *p = if accumulate { *p + v } else { v };
            }
        };
        // Groups of `g` rows (4; a GEMV of short rows takes the pool's `gemv_rows`), then single rows. A
        // group is adjacent rows, or, for formats whose rows are short (`SPREAD_ROWS`), rows a g-th of the
        // task apart, so that each of the g streams has its own pages, which the hardware prefetchers follow
        // (two streams in one page defeat them).
        let g = if F::SPREAD_ROWS && m < 4 { pool.gemv_rows } else { 4 };
        let full = (r1 - r0) / g;
        let (lane, next) = if F::SPREAD_ROWS { (full, 1) } else { (1, g) };
        let groups = (0..full).map(|i| (r0 + i * next, g)).chain((r0 + g * full..r1).map(|r| (r, 1)));
        let mut t = 0;
        while t < m {
            let tb = if m - t >= 4 { 4 } else { 1 };
            for (r, rows) in groups.clone() {
                // SAFETY: rows r, r + lane, … (`rows` of them, all < r1) of w and tokens t..t+tb of x exist
                // (the caller's promise).
                unsafe {
                    let xr = xp.add(t * ldx);
                    let wr = wp.add(r * rb);
                    let ws = lane * rb;
                    match (rows, tb) {
                        (4, 4) => {
                            let mut o = [[0f32; 4]; 4];
                            fmt.dot::<4, 4>(isa, pf, xr, ldx, wr, ws, k, &mut o);
                            for (ri, row) in o.iter().enumerate() {
                                for (ti, &v) in row.iter().enumerate() {
                                    store(t + ti, r + ri * lane, v);
                                }
                            }
                        }
                        (8, _) => {
                            let mut o = [[0f32; 1]; 8];
                            fmt.dot::<8, 1>(isa, pf, xr, ldx, wr, ws, k, &mut o);
                            for (ri, row) in o.iter().enumerate() {
                                store(t, r + ri * lane, row[0]);
                            }
                        }
                        (4, _) => {
                            let mut o = [[0f32; 1]; 4];
                            fmt.dot::<4, 1>(isa, pf, xr, ldx, wr, ws, k, &mut o);
                            for (ri, row) in o.iter().enumerate() {
                                store(t, r + ri * lane, row[0]);
                            }
                        }
                        (_, 4) => {
                            let mut o = [[0f32; 4]; 1];
                            fmt.dot::<1, 4>(isa, pf, xr, ldx, wr, rb, k, &mut o);
                            for (ti, &v) in o[0].iter().enumerate() {
                                store(t + ti, r, v);
                            }
                        }
                        _ => {
                            let mut o = [[0f32; 1]; 1];
                            fmt.dot::<1, 1>(isa, pf, xr, ldx, wr, rb, k, &mut o);
                            store(t, r, o[0][0]);
                        }
                    }
                }
            }
            t += tb;
        }
    }
}

/// The tiling loop: tasks of whole 4-row groups over the pool, each a [`RowsJob::rows`].
/// `y[t][j]` is at `t × ldy + j` (`ldy` > `n` when the rows are a chunk of a larger matrix).
fn tiled<F: RowFormat>(
    pool: &CpuPool,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    fmt: F,
    n: usize,
    y: &mut [f32],
    ldy: usize,
    accumulate: bool,
) {
    assert!(
        x.len() >= m * k
            && w.len() >= n * fmt.row_bytes(k)
            && ldy >= n
            && (m == 0 || y.len() >= (m - 1) * ldy + n),
        "matmul operand sizes"
    );
    // `tasks_per_thread` tasks per thread at most, 32 rows at least.
    let tasks_per_thread = pool.tasks_per_thread.unwrap_or_else(|| fmt.tasks_per_thread());
    let rows_per_task = n.div_ceil(tasks_per_thread * pool.threads).next_multiple_of(4).max(32);
    let packed = fmt.pack_x(pool.isa, x, m, k);
    let (xp, ldx) = packed.as_ref().map_or((x.as_ptr(), k), |(p, ld)| (p.as_ptr(), *ld));
    let job = RowsJob { x: xp, ldx, m, k, w: w.as_ptr(), y: y.as_mut_ptr(), ldy, accumulate };
    let tasks = n.div_ceil(rows_per_task);
    pool.install(|| {
        (0..tasks).into_par_iter().for_each(|task| {
            let r0 = task * rows_per_task;
            // SAFETY: sizes checked above; each task writes its own rows.
            unsafe { job.rows(pool, fmt, r0, (r0 + rows_per_task).min(n)) };
        });
    });
}

fn f32s(bytes: &[u8], n: usize) -> Vec<f32> {
    (0..n).map(|i| Elem::F32.read(bytes, i)).collect()
}

/// Normalises each `dim`-row of `x` (RMSNorm, or LayerNorm with `b`), scales by `w` and rounds to `round`.
pub fn norm_rows(
    kind: NormKind,
    x: &[f32],
    dim: usize,
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
    round: Elem,
    out: &mut [f32],
) {
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        match kind {
            NormKind::RmsNorm => {
                let ss: f32 = row.iter().map(|v| v * v).sum();
                let inv = 1.0 / (ss / dim as f32 + eps).sqrt();
                for i in 0..dim {
                    o[i] = round.round(row[i] * inv * w[i]);
                }
            }
            NormKind::LayerNorm => {
                let mean = row.iter().sum::<f32>() / dim as f32;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for i in 0..dim {
                    let bias = b.map_or(0.0, |b| b[i]);
                    o[i] = round.round((row[i] - mean) * inv * w[i] + bias);
                }
            }
        }
    }
}

/// Rotates `x` (`[m, heads, head_dim]`) in place, token `t` at position `pos.0 + t·pos.1`.
pub fn rope(x: &mut [f32], m: usize, heads: usize, head_dim: usize, inv_freq: &[f32], pos: (usize, usize)) {
    let half = inv_freq.len();
    for t in 0..m {
        let pos = (pos.0 + t * pos.1) as f32;
        for (i, &f) in inv_freq.iter().enumerate() {
            let (s, c) = (pos * f).sin_cos();
            for h in 0..heads {
                let base = (t * heads + h) * head_dim;
                let a = x[base + i];
                let b = x[base + i + half];
                x[base + i] = a * c - b * s;
                x[base + i + half] = b * c + a * s;
            }
        }
    }
}

/// `silu(g) · u`, rounded to `round`, into `g`.
pub fn swiglu(g: &mut [f32], u: &[f32], round: Elem) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = round.round(*a / (1.0 + (-*a).exp()) * b);
    }
}

/// `max(u, 0)²`, rounded to `round`, in place.
pub fn relu2(u: &mut [f32], round: Elem) {
    for a in u.iter_mut() {
        let r = a.max(0.0);
        *a = round.round(r * r);
    }
}

/// Index of the largest value (the first one on ties).
#[must_use]
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Where a layer's K and V rows live inside its `[K | V]` cache bytes.
#[derive(Debug, Clone, Copy)]
pub struct KvLayout {
    /// Tokens the cache holds.
    pub ctx: usize,
    /// `kv_heads × head_dim`.
    pub kv_dim: usize,
    /// Element type.
    pub elem: Elem,
}

impl KvLayout {
    /// Bytes of K (or of V).
    #[must_use]
    pub fn half_bytes(&self) -> usize {
        self.ctx * self.kv_dim * self.elem.size_bytes()
    }

    /// Bytes of the whole `[K | V]` cache.
    #[must_use]
    pub fn bytes(&self) -> usize {
        2 * self.half_bytes()
    }

    /// Byte offset of position `pos`'s row in K (add `half_bytes` for V).
    #[must_use]
    pub fn row_offset(&self, pos: usize) -> usize {
        pos * self.kv_dim * self.elem.size_bytes()
    }
}

/// Causal attention of `m` queries at positions `pos0..pos0+m` over the cache, output rounded to `round`.
pub fn attention(
    pool: &CpuPool,
    d: &Dims,
    q: &[f32],
    kv: &[u8],
    lay: KvLayout,
    m: usize,
    pos0: usize,
    round: Elem,
    out: &mut [f32],
) {
    let keys = |t: usize| KeyRows { a_start: 0, a_len: pos0 + t + 1, b_start: 0, b_stride: 1, b_len: 0 };
    attention_rows(pool, d, q, kv, lay, m, &keys, round, out);
}

/// Attention of `m` queries, query `t` over the cache rows `keys(t)` (its own cells, in position order),
/// output rounded to `round`.
pub fn attention_rows(
    pool: &CpuPool,
    d: &Dims,
    q: &[f32],
    kv: &[u8],
    lay: KvLayout,
    m: usize,
    keys: &(dyn Fn(usize) -> KeyRows + Sync),
    round: Elem,
    out: &mut [f32],
) {
    let hd = d.head_dim;
    let group = d.n_heads / d.n_kv_heads;
    let scale = d.attn_scale();
    let es = lay.elem.size_bytes();
    let isa = pool.isa;
    let (kc, vc) = kv.split_at(lay.half_bytes());
    pool.install(|| {
        out[..m * d.q_dim].par_chunks_mut(hd).enumerate().for_each(|(th, o)| {
            let (t, h) = (th / d.n_heads, th % d.n_heads);
            let g = h / group;
            let qv = &q[th * hd..(th + 1) * hd];
            let rows = keys(t);
            let mut scores: Vec<f32> = (0..rows.len())
                .map(|j| {
                    let off = lay.row_offset(rows.row(j)) + g * hd * es;
                    simd::dot_kv(isa, qv, &kc[off..off + hd * es], lay.elem) * scale
                })
                .collect();
            let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in &mut scores {
                *s = (*s - mx).exp();
                sum += *s;
            }
            let mut acc = vec![0f32; hd];
            for (j, &p) in scores.iter().enumerate() {
                let off = lay.row_offset(rows.row(j)) + g * hd * es;
                simd::axpy_kv(isa, &mut acc, p, &vc[off..off + hd * es], lay.elem);
            }
            for (a, b) in o.iter_mut().zip(&acc) {
                *a = round.round(b / sum);
            }
        });
    });
}

/// Writes the K and V rows of `m` tokens at positions `pos0..` into the cache, rounded to its element type.
pub fn store_kv(kv: &mut [u8], lay: KvLayout, k: &[f32], v: &[f32], m: usize, pos0: usize) {
    store_kv_rows(kv, lay, k, v, m, (pos0, 1));
}

/// Writes the K and V rows of `m` tokens into the cache, token `t` at row `first + t·step` (`rows`).
pub fn store_kv_rows(kv: &mut [u8], lay: KvLayout, k: &[f32], v: &[f32], m: usize, rows: (usize, usize)) {
    let (kh, vh) = kv.split_at_mut(lay.half_bytes());
    let (dim, row_bytes) = (lay.kv_dim, lay.row_offset(1));
    for t in 0..m {
        // Row-wise conversion: a 1008-token prefill chunk's rows one element at a time took ~7 ms a layer.
        let at = lay.row_offset(rows.0 + t * rows.1);
        lay.elem.write_row(&k[t * dim..(t + 1) * dim], &mut kh[at..at + row_bytes]);
        lay.elem.write_row(&v[t * dim..(t + 1) * dim], &mut vh[at..at + row_bytes]);
    }
}

fn norm_params(unit: &[u8], d: &Dims, w_off: usize, b_off: Option<usize>) -> (Vec<f32>, Option<Vec<f32>>) {
    let w = f32s(&unit[w_off..], d.hidden);
    let b = b_off.map(|o| f32s(&unit[o..], d.hidden));
    (w, b)
}

/// `y (+)= x · wᵀ` for the model matrix `w` `[n, k]` at `off` in `unit`, in the model's matrix format.
fn mat_mul(
    pool: &CpuPool,
    d: &Dims,
    x: &[f32],
    m: usize,
    k: usize,
    unit: &[u8],
    off: usize,
    n: usize,
    y: &mut [f32],
    accumulate: bool,
) {
    let w = &unit[off..off + d.mat_bytes(n, k)];
    match d.quant {
        Some(q) => matmul_quant(pool, x, m, k, w, q, n, y, accumulate),
        None => matmul(pool, x, m, k, w, d.mat, n, y, accumulate),
    }
}

/// The embedding rows of `tokens` as f32 `[m, hidden]`.
pub fn embed(pool: &CpuPool, d: &Dims, table: &[u8], tokens: &[u32], h: &mut [f32]) {
    if tokens.len() <= EMBED_THREAD_ROWS {
        for (row, &tok) in h[..tokens.len() * d.hidden].chunks_mut(d.hidden).zip(tokens) {
            d.mat_row_into(table, tok as usize, row);
        }
        return;
    }
    pool.install(|| {
        h[..tokens.len() * d.hidden]
            .par_chunks_mut(d.hidden)
            .zip(tokens)
            .for_each(|(row, &tok)| d.mat_row_into(table, tok as usize, row));
    });
}

/// Token rows [`embed`] converts on the calling thread: a decode step's row takes about a microsecond, the
/// hand-over to the pool and back 30–40 µs on the H200 machine's host (`cpu token_embd` in run27's traces, on
/// every decode step's critical path).
const EMBED_THREAD_ROWS: usize = 8;

/// One attention block on the CPU: `h += o_proj(attention(rope(q, k), v))` for the tokens of `pass`, writing
/// their K/V into the cache of `cache`'s sequences (`kv` holds its whole `[K | V]`).
pub fn attn_block(
    pool: &CpuPool,
    d: &Dims,
    unit: &[u8],
    off: &AttnOffsets,
    kv: &mut [u8],
    cache: SeqKv,
    pass: Pass,
    h: &mut [f32],
) {
    let m = pass.tokens(cache.seqs);
    let (w, b) = norm_params(unit, d, off.norm_w, off.norm_b);
    let mut xn = vec![0f32; m * d.hidden];
    norm_rows(d.norm, &h[..m * d.hidden], d.hidden, &w, b.as_deref(), d.norm_eps, d.mat, &mut xn);
    let mut q = vec![0f32; m * d.q_dim];
    let mut k = vec![0f32; m * d.kv_dim];
    let mut v = vec![0f32; m * d.kv_dim];
    mat_mul(pool, d, &xn, m, d.hidden, unit, off.q, d.q_dim, &mut q, false);
    mat_mul(pool, d, &xn, m, d.hidden, unit, off.k, d.kv_dim, &mut k, false);
    mat_mul(pool, d, &xn, m, d.hidden, unit, off.v, d.kv_dim, &mut v, false);
    for (bias, x, dim) in
        [(off.q_bias, &mut q, d.q_dim), (off.k_bias, &mut k, d.kv_dim), (off.v_bias, &mut v, d.kv_dim)]
    {
        if let Some(o) = bias {
            let b = f32s(&unit[o..], dim);
            for row in x.chunks_exact_mut(dim) {
                row.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
            }
        }
    }
    for (nw, x) in [(off.q_norm, &mut q), (off.k_norm, &mut k)] {
        if let Some(o) = nw {
            let w = f32s(&unit[o..], d.head_dim);
            let src = x.clone();
            norm_rows(NormKind::RmsNorm, &src, d.head_dim, &w, None, d.norm_eps, Elem::F32, x);
        }
    }
    let inv_freq = d.rope_inv_freq();
    rope(&mut q, m, d.n_heads, d.head_dim, &inv_freq, pass.positions());
    rope(&mut k, m, d.n_kv_heads, d.head_dim, &inv_freq, pass.positions());
    let lay = cache.whole();
    store_kv_rows(kv, lay, &k, &v, m, cache.store_rows(pass));
    let mut att = vec![0f32; m * d.q_dim];
    attention_rows(pool, d, &q, kv, lay, m, &|t| cache.keys(pass, t), d.mat, &mut att);
    mat_mul(pool, d, &att, m, d.q_dim, unit, off.o, d.hidden, h, true);
}

/// One FFN block on the CPU: `h += down(act(x))`.
pub fn ffn_block(pool: &CpuPool, d: &Dims, unit: &[u8], off: &FfnOffsets, h: &mut [f32], m: usize) {
    let (w, b) = norm_params(unit, d, off.norm_w, off.norm_b);
    let mut xn = vec![0f32; m * d.hidden];
    norm_rows(d.norm, &h[..m * d.hidden], d.hidden, &w, b.as_deref(), d.norm_eps, d.mat, &mut xn);
    let mut up = vec![0f32; m * d.ffn];
    mat_mul(pool, d, &xn, m, d.hidden, unit, off.up, d.ffn, &mut up, false);
    let act = if let (FfnKind::SwiGlu, Some(g_off)) = (d.ffn_kind, off.gate) {
        let mut g = vec![0f32; m * d.ffn];
        mat_mul(pool, d, &xn, m, d.hidden, unit, g_off, d.ffn, &mut g, false);
        swiglu(&mut g, &up, d.mat);
        g
    } else {
        relu2(&mut up, d.mat);
        up
    };
    mat_mul(pool, d, &act, m, d.ffn, unit, off.down, d.hidden, h, true);
}

/// Where the tokens of an MoE layer go: each token's `top_k` experts (most probable first) and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// `[m, top_k]` expert ids.
    pub experts: Vec<u32>,
    /// `[m, top_k]` routing weights.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Qwen3-MoE routing of the `[m, n_experts]` router logits: softmax in f32, the `top_k` largest
    /// probabilities (the lower expert id on ties), divided by their sum when `norm_topk_prob`.
    #[must_use]
    pub fn from_logits(
        pool: &CpuPool,
        logits: &[f32],
        n_experts: usize,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Routing {
        let m = logits.len() / n_experts;
        let (mut experts, mut weights) = (vec![0u32; m * top_k], vec![0f32; m * top_k]);
        let rows =
            logits.chunks_exact(n_experts).zip(experts.chunks_mut(top_k)).zip(weights.chunks_mut(top_k));
        if m < PARALLEL_ROUTING_ROWS {
            let mut best = Vec::with_capacity(top_k + 1);
            for ((row, e), w) in rows {
                route_row(row, norm_topk_prob, &mut best, e, w);
            }
        } else {
            // A row takes ~0.85 µs on one core (the insertions), a 1008-token prefill chunk 1.7-1.9 ms on the
            // H200's host between the routing sync and the first expert (run27), where the GPU waits.
            let rows = logits
                .par_chunks_exact(n_experts)
                .zip(experts.par_chunks_mut(top_k))
                .zip(weights.par_chunks_mut(top_k))
                .with_min_len(PARALLEL_ROUTING_ROWS / 4);
            pool.alongside(
                || {
                    rows.for_each_init(
                        || Vec::with_capacity(top_k + 1),
                        |best, ((row, e), w)| route_row(row, norm_topk_prob, best, e, w),
                    );
                },
                || (),
            );
        }
        Routing { top_k, experts, weights }
    }

    /// Tokens routed to each of `n_experts` experts, in token order, with their weights: the token
    /// permutation both sides compute from.
    #[must_use]
    pub fn per_expert(&self, n_experts: usize) -> Vec<Vec<(u32, f32)>> {
        let mut lists = vec![Vec::new(); n_experts];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            lists[e as usize].push(((i / self.top_k) as u32, w));
        }
        lists
    }
}

/// Rows from which [`Routing::from_logits`] routes on the pool: fewer cost less than a hand-over to it.
const PARALLEL_ROUTING_ROWS: usize = 64;

/// One token's routing: the indices of the `e.len()` largest of `row` (most probable first, the lower id on
/// ties) into `e` and their probabilities into `w`. The best logits so far are kept by insertion rather than a
/// sort of the row (a full sort took 7 ms a 1008-token chunk on the H200's host). The softmax is monotone, so
/// its top k are the logits' top k; with `norm_topk_prob` its sum cancels and only the k picked exponentials
/// are needed.
fn route_row(row: &[f32], norm_topk_prob: bool, best: &mut Vec<(f32, usize)>, e: &mut [u32], w: &mut [f32]) {
    let top_k = e.len();
    best.clear();
    for (i, &l) in row.iter().enumerate() {
        // Experts come in id order, so one that only ties the worst kept never displaces it.
        if best.len() == top_k && best[top_k - 1].0.total_cmp(&l).is_ge() {
            continue;
        }
        let at = best.partition_point(|&(q, _)| q.total_cmp(&l).is_ge());
        best.insert(at, (l, i));
        best.truncate(top_k);
    }
    let mx = best[0].0;
    let sum: f32 = if norm_topk_prob {
        best.iter().map(|&(l, _)| (l - mx).exp()).sum()
    } else {
        row.iter().map(|&l| (l - mx).exp()).sum()
    };
    for ((&(l, i), e), w) in best.iter().zip(e).zip(w) {
        *e = i as u32;
        *w = (l - mx).exp() / sum;
    }
}

/// An MoE layer's router on the CPU: the normed input `[m, hidden]` (rounded to the matrix format) and the
/// router logits `[m, n_experts]`.
#[must_use]
pub fn router_block(
    pool: &CpuPool,
    d: &Dims,
    n_experts: usize,
    unit: &[u8],
    off: &RouterOffsets,
    h: &[f32],
    m: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (w, b) = norm_params(unit, d, off.norm_w, off.norm_b);
    let mut xn = vec![0f32; m * d.hidden];
    norm_rows(d.norm, &h[..m * d.hidden], d.hidden, &w, b.as_deref(), d.norm_eps, d.mat, &mut xn);
    let mut logits = vec![0f32; m * n_experts];
    mat_mul(pool, d, &xn, m, d.hidden, unit, off.gate_inp, n_experts, &mut logits, false);
    (xn, logits)
}

/// One expert's work on the CPU: its unit's bytes, its slices' offsets, and its `(token, weight)` pairs.
pub type ExpertWork<'a> = (&'a [u8], ExpertOffsets, &'a [(u32, f32)]);

/// Bytes of weight rows in one task of [`experts_block`]'s few-token path: enough that starting a task (an
/// atomic counter, the hardware prefetchers ramping up on new pages) costs little against reading it, few
/// enough that a layer's tasks (~300 for qwen3-30b-a3b's 8 bf16 experts) even out the threads' finishing
/// times.
const EXPERT_STRIPE_BYTES: usize = 256 << 10;

/// Routed experts on the CPU: for each `(expert unit bytes, offsets, tokens)` in order,
/// `out[t] += w · down(silu(gate(xn[t])) · up(xn[t]))` over the expert's `(t, w)` tokens.
///
/// A decode token's expert matrices are a few MB each, too small for one parallel GEMV at a time to keep
/// every thread reading DRAM (measured: 41 GB/s of 111 one after the other), so the experts run at once: with
/// up to [`EXACT_MAX_TOKENS`] tokens an expert as one list of row stripes (`experts_gemv`), with more each
/// expert's matmuls in parallel and the experts beside each other (`experts_gemm`). Outputs are added in the
/// experts' order, so the sums do not depend on scheduling.
pub fn experts_block(
    pool: &CpuPool,
    d: &Dims,
    expert_ffn: usize,
    xn: &[f32],
    experts: &[ExpertWork<'_>],
    out: &mut [f32],
) {
    let hd = d.hidden;
    let busy: Vec<&ExpertWork<'_>> = experts.iter().filter(|e| !e.2.is_empty()).collect();
    if busy.is_empty() {
        return;
    }
    // The busy experts' output rows, in their tokens' order, in one or more blocks.
    let ys: Vec<Vec<f32>> = if busy.iter().all(|e| e.2.len() <= EXACT_MAX_TOKENS) {
        vec![match d.quant {
            Some(q) => experts_gemv(pool, q, d, expert_ffn, xn, &busy),
            None => experts_gemv(pool, d.mat, d, expert_ffn, xn, &busy),
        }]
    } else {
        experts_gemm(pool, d, expert_ffn, xn, &busy)
    };
    let rows = ys.iter().flat_map(|y| y.chunks_exact(hd));
    for (y, &(t, w)) in rows.zip(busy.iter().flat_map(|e| e.2)) {
        let o = &mut out[t as usize * hd..(t as usize + 1) * hd];
        o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
    }
}

/// The rows of `xn` (of `hd`) that `tokens` name, in order, into `out`.
fn gather_rows(xn: &[f32], hd: usize, tokens: &[(u32, f32)], out: &mut [f32]) {
    for (row, &(t, _)) in out.chunks_exact_mut(hd).zip(tokens) {
        row.copy_from_slice(&xn[t as usize * hd..(t as usize + 1) * hd]);
    }
}

/// [`experts_block`] with more tokens an expert (prefill): each expert's gate and up, then its down, as
/// parallel matmuls, every expert at once; each expert's output rows.
fn experts_gemm(pool: &CpuPool, d: &Dims, fe: usize, xn: &[f32], busy: &[&ExpertWork<'_>]) -> Vec<Vec<f32>> {
    let hd = d.hidden;
    let expert = |&&(unit, off, tokens): &&ExpertWork<'_>| {
        let c = tokens.len();
        let mut xe = vec![0f32; c * hd];
        gather_rows(xn, hd, tokens, &mut xe);
        let mut g = vec![0f32; c * fe];
        let mut u = vec![0f32; c * fe];
        rayon::join(
            || mat_mul(pool, d, &xe, c, hd, unit, off.gate, fe, &mut g, false),
            || mat_mul(pool, d, &xe, c, hd, unit, off.up, fe, &mut u, false),
        );
        swiglu(&mut g, &u, d.mat);
        let mut y = vec![0f32; c * hd];
        mat_mul(pool, d, &g, c, fe, unit, off.down, hd, &mut y, false);
        y
    };
    pool.install(|| busy.par_iter().map(expert).collect())
}

/// Which matrix of an expert a task of `experts_gemv` reads.
#[derive(Clone, Copy)]
enum ExpertMat {
    Gate,
    Up,
    Down,
}

/// `n` rows of `row_bytes` cut into stripes of about [`EXPERT_STRIPE_BYTES`], whole 4-row groups but the
/// last.
fn stripes(n: usize, row_bytes: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = (n * row_bytes).div_ceil(EXPERT_STRIPE_BYTES).clamp(1, n.div_ceil(4));
    let rows = n.div_ceil(count).next_multiple_of(4);
    (0..n).step_by(rows).map(move |r0| (r0, (r0 + rows).min(n)))
}

/// [`experts_block`] with up to [`EXACT_MAX_TOKENS`] tokens an expert (decode), on matrices of `fmt`: every
/// busy expert's gate and up rows, then every expert's down rows, cut into stripes in one list that the
/// pool's threads take tasks from in order, so that every thread streams weights until the list ends. A down
/// stripe waits only for its own expert's gate and up (the stripe that completes them applies SwiGLU), which
/// were all taken before it, so no thread idles at a barrier between the two. Returns the output rows, one
/// expert after another.
fn experts_gemv<F: RowFormat>(
    pool: &CpuPool,
    fmt: F,
    d: &Dims,
    fe: usize,
    xn: &[f32],
    busy: &[&ExpertWork<'_>],
) -> Vec<f32> {
    let hd = d.hidden;
    // Each expert's first row in the gathered inputs `xs` and the outputs `ys`, which hold the experts' token
    // rows one expert after another.
    let first: Vec<usize> = busy
        .iter()
        .scan(0, |at, e| {
            *at += e.2.len();
            Some(*at - e.2.len())
        })
        .collect();
    let tokens: usize = busy.iter().map(|e| e.2.len()).sum();
    let mut xs = vec![0f32; tokens * hd];
    for (e, &f) in busy.iter().zip(&first) {
        gather_rows(xn, hd, e.2, &mut xs[f * hd..]);
    }
    let mut ys = vec![0f32; tokens * hd];
    let (gate_up_bytes, down_bytes) = (d.mat_bytes(fe, hd), d.mat_bytes(hd, fe));
    let mut tasks = Vec::new();
    for e in 0..busy.len() {
        for mat in [ExpertMat::Gate, ExpertMat::Up] {
            tasks.extend(stripes(fe, fmt.row_bytes(hd)).map(|(r0, r1)| (e, mat, r0, r1)));
        }
    }
    let gate_up_tasks = tasks.len() / busy.len();
    for e in 0..busy.len() {
        tasks.extend(stripes(hd, fmt.row_bytes(fe)).map(|(r0, r1)| (e, ExpertMat::Down, r0, r1)));
    }
    // Per expert: gate and up stripes still running, and once none is, the SwiGLU rows as the down kernel
    // reads them (packed where `pack_x` packs).
    let pending: Vec<AtomicUsize> = busy.iter().map(|_| AtomicUsize::new(gate_up_tasks)).collect();
    let ready: Vec<OnceLock<PackedX>> = busy.iter().map(|_| OnceLock::new()).collect();
    let xs_packed = fmt.pack_x(pool.isa, &xs, tokens, hd);
    let (xp, ldx) = xs_packed.as_ref().map_or((xs.as_ptr(), hd), |(p, ld)| (p.as_ptr(), *ld));
    let mut g = vec![0f32; tokens * fe];
    let mut u = vec![0f32; tokens * fe];
    let (gp, up, yp) = (SharedPtr(g.as_mut_ptr()), SharedPtr(u.as_mut_ptr()), SharedPtr(ys.as_mut_ptr()));
    let xp = SharedPtr(xp.cast_mut());
    let next = AtomicUsize::new(0);
    pool.install(|| {
        (0..pool.threads).into_par_iter().for_each(|_| {
            while let Some(&(e, mat, r0, r1)) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) {
                let &(unit, off, toks) = busy[e];
                let (c, row0) = (toks.len(), first[e]);
                let job = match mat {
                    ExpertMat::Gate | ExpertMat::Up => {
                        let (at, y) =
                            if matches!(mat, ExpertMat::Gate) { (off.gate, gp) } else { (off.up, up) };
                        RowsJob {
                            // SAFETY: the expert's rows start at row0 < tokens of xs (packed or not).
                            x: unsafe { xp.ptr().add(row0 * ldx) },
                            ldx,
                            m: c,
                            k: hd,
                            w: unit[at..at + gate_up_bytes].as_ptr(),
                            // SAFETY: as above, of g and u.
                            y: unsafe { y.ptr().add(row0 * fe) },
                            ldy: fe,
                            accumulate: false,
                        }
                    }
                    ExpertMat::Down => {
                        let packed = loop {
                            match ready[e].get() {
                                Some(p) => break p,
                                None => std::thread::yield_now(),
                            }
                        };
                        // SAFETY: as above, of g.
                        let (x, ldx) =
                            packed.as_ref().map_or((unsafe { gp.ptr().add(row0 * fe) }, fe), |(p, ld)| {
                                (p.as_ptr().cast_mut(), *ld)
                            });
                        RowsJob {
                            x,
                            ldx,
                            m: c,
                            k: fe,
                            w: unit[off.down..off.down + down_bytes].as_ptr(),
                            // SAFETY: as above, of ys.
                            y: unsafe { yp.ptr().add(row0 * hd) },
                            ldy: hd,
                            accumulate: false,
                        }
                    }
                };
                // SAFETY: the job's operands hold its rows (bounds-checked weight slices, the expert's token
                // rows of buffers sized for every token); stripes of one matrix write disjoint rows, and a
                // down stripe reads the SwiGLU rows only once `ready` is set, after every write to them.
                unsafe { job.rows(pool, fmt, r0, r1) };
                if !matches!(mat, ExpertMat::Down) && pending[e].fetch_sub(1, Ordering::AcqRel) == 1 {
                    // SAFETY: the expert's every gate and up stripe has finished (their writes made visible
                    // by the AcqRel count) and no down stripe reads its rows before `ready` is set: they are
                    // ours.
                    let (ge, ue) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(gp.ptr().add(row0 * fe), c * fe),
                            std::slice::from_raw_parts(up.ptr().add(row0 * fe), c * fe),
                        )
                    };
                    swiglu(ge, ue, d.mat);
                    let set = ready[e].set(fmt.pack_x(pool.isa, ge, c, fe));
                    assert!(set.is_ok(), "one stripe completes an expert's gate and up");
                }
            }
        });
    });
    ys
}

/// The output norm and head on the CPU for the rows `h` holds: logits `[rows, vocab]`.
#[must_use]
pub fn output_block(pool: &CpuPool, d: &Dims, unit: &[u8], off: &OutputOffsets, h: &[f32]) -> Vec<f32> {
    let rows = h.len() / d.hidden;
    let (w, b) = norm_params(unit, d, off.norm_w, off.norm_b);
    let mut xn = vec![0f32; rows * d.hidden];
    norm_rows(d.norm, h, d.hidden, &w, b.as_deref(), d.norm_eps, d.mat, &mut xn);
    let mut logits = vec![0f32; rows * d.vocab];
    mat_mul(pool, d, &xn, rows, d.hidden, unit, off.head, d.vocab, &mut logits, false);
    logits
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn naive(x: &[f32], m: usize, k: usize, w: &[u8], elem: Elem, n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for t in 0..m {
            for j in 0..n {
                y[t * n + j] =
                    (0..k).map(|i| f64::from(x[t * k + i]) * f64::from(elem.read(w, j * k + i))).sum();
            }
        }
        y
    }

    /// Work handed over once a warm guard is dropped runs on the pool's threads, alongside the host thread's,
    /// and both results come back.
    #[test]
    fn warm_workers_take_the_work_handed_over() {
        let pool = CpuPool::new(4).unwrap();
        let xs: Vec<u64> = (0..100_000).collect();
        for _ in 0..3 {
            let warm = pool.keep_warm();
            drop(warm);
            let ids = std::sync::Mutex::new(std::collections::HashSet::new());
            let (sum, host) = pool.alongside(
                || {
                    pool.install(|| {
                        xs.par_chunks(1000)
                            .map(|c| {
                                ids.lock().unwrap().insert(rayon::current_thread_index());
                                c.iter().sum::<u64>()
                            })
                            .sum::<u64>()
                    })
                },
                || 7,
            );
            assert_eq!((sum, host), (xs.iter().sum(), 7));
            assert!(ids.lock().unwrap().iter().all(Option::is_some), "pool threads ran the work");
        }
    }

    #[test]
    fn matmul_matches_naive_for_every_isa_shape_and_format() {
        let pool = CpuPool::new(2).unwrap();
        for elem in [Elem::Bf16, Elem::F16] {
            for (m, k, n) in [(1, 64, 9), (5, 40, 13), (7, 136, 33), (4, 16, 4)] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 25.0).to_f32())
                    .collect();
                let mut w = vec![0u8; n * k * 2];
                for i in 0..n * k {
                    elem.write(&mut w, i, ((i * 53 % 97) as f32 - 48.0) / 40.0);
                }
                let want = naive(&x, m, k, &w, elem, n);
                let mut y = vec![1f32; m * n];
                matmul(&pool, &x, m, k, &w, elem, n, &mut y, true);
                for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(a) - (b + 1.0)).abs() < 1e-3 * (1.0 + b.abs()),
                        "{elem:?} {m}x{k}x{n} [{i}] {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantised_matmul_equals_dequantise_then_f32_for_every_isa_path() {
        // Every shape hits the 4×4, 4×1, 1×4 and 1×1 register blocks (and 8×1 with 8 GEMV rows); every ISA up
        // to the detected one runs (a pool's ISA overridden downwards), so AVX-512, AVX2 and plain Rust are each
        // checked where present, each also with 8 GEMV rows, more tasks and prefetches to L2.
        let pools: Vec<CpuPool> = simd::detect()
            .and_weaker()
            .into_iter()
            .flat_map(|isa| {
                let pool = || CpuPool::with_isa(3, isa).unwrap();
                [
                    pool(),
                    pool().with_gemv_rows(8).unwrap(),
                    pool()
                        .with_tasks_per_thread(16)
                        .with_prefetch(Prefetch { bytes: 2048, level: CacheLevel::L2 }),
                ]
            })
            .collect();
        assert!(pools.len() >= 6, "the portable path and the detected one");
        assert!(CpuPool::new(1).unwrap().with_gemv_rows(6).is_err());
        for pool in &pools {
            for fmt in QFormat::ALL {
                // 12 and 9 tokens take the dequantise-to-bf16 path, in chunks of 5 rows.
                for (m, k32, n) in
                    [(1, 64, 9), (5, 96, 13), (4, 256, 70), (3, 64, 70), (2, 32, 4), (12, 64, 13), (9, 32, 6)]
                {
                    // The same number of blocks for every format (K-quant blocks are 8 times longer).
                    let k = k32 / 32 * fmt.block_elems();
                    let x: Vec<f32> = (0..m * k)
                        .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 25.0).to_f32())
                        .collect();
                    let wf: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0).collect();
                    let w = fmt.quantize(&wf, k);
                    let exact = m <= EXACT_MAX_TOKENS;
                    let deq: Vec<f32> = fmt
                        .dequantize(&w)
                        .into_iter()
                        .map(|v| if exact { v } else { bf16::from_f32(v).to_f32() })
                        .collect();
                    // Up to EXACT_MAX_TOKENS, q2_k's and q3_k's GEMVs compute on rounded activations.
                    let mut q = [0i8; 256];
                    let xr: Vec<f32> = if exact && fmt.rounds_activations() {
                        x.chunks_exact(256)
                            .flat_map(|xb| {
                                let dx = crate::quant::round_activations(xb, &mut q);
                                q.map(|v| f32::from(v) * dx)
                            })
                            .collect()
                    } else {
                        x.clone()
                    };
                    let want: Vec<f64> = (0..m * n)
                        .map(|i| {
                            let (t, j) = (i / n, i % n);
                            (0..k).map(|c| f64::from(xr[t * k + c]) * f64::from(deq[j * k + c])).sum()
                        })
                        .collect();
                    let mut y = vec![1f32; m * n];
                    matmul_quant_in_chunks(pool, &x, m, k, &w, fmt, n, &mut y, true, 5 * 2 * k);
                    for (i, (&a, &b)) in y.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(a) - (b + 1.0)).abs() < 1e-4 * (1.0 + b.abs()),
                            "{:?} ({} GEMV rows) {fmt:?} {m}x{k}x{n} [{i}] {a} vs {}",
                            pool.isa,
                            pool.gemv_rows,
                            b + 1.0
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn attention_is_causal_and_normalised() {
        let d = Dims::new(&crate::testing::tiny_spec()).unwrap();
        let pool = CpuPool::new(2).unwrap();
        let lay = KvLayout { ctx: 8, kv_dim: d.kv_dim, elem: Elem::F32 };
        let mut kv = vec![0u8; lay.bytes()];
        let m = 3;
        let k: Vec<f32> = (0..m * d.kv_dim).map(|i| ((i % 7) as f32 - 3.0) / 3.0).collect();
        // V rows: all ones for position 0, twos for 1, threes for 2.
        let v: Vec<f32> = (0..m * d.kv_dim).map(|i| (i / d.kv_dim + 1) as f32).collect();
        store_kv(&mut kv, lay, &k, &v, m, 0);
        let q = vec![0.5f32; m * d.q_dim];
        let mut out = vec![0f32; m * d.q_dim];
        attention(&pool, &d, &q, &kv, lay, m, 0, Elem::F32, &mut out);
        // Token 0 sees only position 0: exactly V row 0.
        assert!(out[..d.q_dim].iter().all(|&x| (x - 1.0).abs() < 1e-6));
        // Token 2 averages rows 1..3 with positive weights: strictly between 1 and 3.
        assert!(out[2 * d.q_dim..].iter().all(|&x| x > 1.0 && x < 3.0));
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let inv = vec![1.0, 0.1];
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0];
        let orig = x.clone();
        rope(&mut x, 1, 1, 5, &inv, (0, 1));
        assert_eq!(x, orig);
        rope(&mut x, 1, 1, 5, &inv, (3, 1));
        let n0: f32 = orig[..4].iter().map(|v| v * v).sum();
        let n1: f32 = x[..4].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert!((x[4] - 5.0).abs() < f32::EPSILON, "dims past the rotated ones are untouched");
        assert!((x[0] - orig[0]).abs() > 0.1);
    }

    #[test]
    fn routing_picks_the_top_k_and_renormalises() {
        // Token 0 prefers experts 2 then 0; token 1 has a tie between 1 and 3 (the lower id wins).
        let logits = [1.0, -1.0, 2.0, 0.0, 0.5, 3.0, 0.0, 3.0];
        let pool = CpuPool::new(2).unwrap();
        let r = Routing::from_logits(&pool, &logits, 4, 2, true);
        assert_eq!(r.experts, vec![2, 0, 1, 3]);
        assert!((r.weights[0] + r.weights[1] - 1.0).abs() < 1e-6);
        assert!((r.weights[0] / r.weights[1] - 1f32.exp()).abs() < 1e-5, "ratio of probabilities kept");
        let raw = Routing::from_logits(&pool, &logits, 4, 2, false);
        let z: f32 = logits[..4].iter().map(|l| l.exp()).sum();
        assert!((raw.weights[0] - 2f32.exp() / z).abs() < 1e-6, "softmax probability without renormalising");
        let lists = r.per_expert(4);
        assert_eq!(lists[0], vec![(0, r.weights[1])]);
        assert_eq!(lists[3], vec![(1, r.weights[3])]);
        assert!(lists[2].len() == 1 && lists[1].len() == 1);
    }

    proptest::proptest! {
        /// The insertion top-k picks what a stable sort of the row by probability (then id) picks, ties and
        /// all, on the calling thread and on the pool: the logits are drawn from a few values so that rows are
        /// full of ties.
        #[test]
        fn routing_picks_what_a_full_sort_picks(
            levels in proptest::collection::vec(0u8..5, 128 * 3..128 * 80),
            top_k in 1usize..=8,
        ) {
            // Up to 79 rows: from 64 on, the rows are routed on the pool.
            let rows = levels.len() / 128;
            let logits: Vec<f32> = levels[..rows * 128].iter().map(|&l| f32::from(l) * 0.75).collect();
            let r = Routing::from_logits(&CpuPool::new(3).unwrap(), &logits, 128, top_k, true);
            proptest::prop_assert_eq!(r.experts.len(), rows * top_k);
            for (row, picked) in logits.chunks_exact(128).zip(r.experts.chunks_exact(top_k)) {
                let mut order: Vec<u32> = (0..128).collect();
                order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
                proptest::prop_assert_eq!(picked, &order[..top_k]);
            }
        }
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    /// A few tokens are embedded on the calling thread, more on the pool: the same rows either way.
    #[test]
    fn embed_gives_the_same_rows_on_the_thread_and_the_pool() {
        use crate::testing::tiny_qwen3_spec;
        use crate::weights::ModelWeights;
        use pipeshard_core::inventory::UnitId;
        let w = ModelWeights::random(&tiny_qwen3_spec(), 3).unwrap();
        let (d, table) = (&w.dims, w.unit(UnitId::TokenEmbd).unwrap().buf.as_slice());
        let pool = CpuPool::new(3).unwrap();
        let many: Vec<u32> = (0..3 * EMBED_THREAD_ROWS as u32).map(|i| i * 7 % d.vocab as u32).collect();
        let few = &many[..EMBED_THREAD_ROWS];
        let (mut h_many, mut h_few) = (vec![0f32; many.len() * d.hidden], vec![0f32; few.len() * d.hidden]);
        embed(&pool, d, table, &many, &mut h_many);
        embed(&pool, d, table, few, &mut h_few);
        assert_eq!(h_few[..], h_many[..few.len() * d.hidden]);
        let mut row = vec![0f32; d.hidden];
        d.mat_row_into(table, many[1] as usize, &mut row);
        assert_eq!(h_few[d.hidden..2 * d.hidden], row[..]);
        assert!(row.iter().any(|&v| v != 0.0));
    }

    /// The expert block, through both its paths (up to `EXACT_MAX_TOKENS` tokens an expert, and more), equals
    /// each expert's matmuls one after another added in expert order: experts of different token counts and
    /// one with none, on pools of 1 and 3 threads and the portable kernels, in f16, bf16 and quantised
    /// formats (the q2_k kernel reads packed activations).
    #[test]
    fn experts_block_equals_the_experts_one_after_another() {
        use crate::testing::tiny_qwen3_moe_k_spec;
        use crate::weights::{ModelWeights, UnitKind};
        use pipeshard_core::dtype::DType;
        use pipeshard_core::inventory::UnitId;
        let m = 12;
        for dtype in [DType::F16, DType::Bf16, DType::Q4_0, DType::Q4K, DType::Q2K] {
            let w = ModelWeights::random(&tiny_qwen3_moe_k_spec().with_uniform_weights(dtype), 7).unwrap();
            let d = &w.dims;
            let (hd, fe) = (d.hidden, d.moe.unwrap().expert_ffn);
            let xn: Vec<f32> =
                (0..m * hd).map(|i| d.mat.round(((i * 37 % 101) as f32 - 50.0) / 25.0)).collect();
            // The second list gives two experts more than EXACT_MAX_TOKENS tokens.
            for counts in [[1, 3, 0, 8, 2, 0, 5, 1], [1, 9, 0, 12, 2, 0, 0, 1]] {
                let lists: Vec<Vec<(u32, f32)>> = counts
                    .iter()
                    .enumerate()
                    .map(|(e, &c)| {
                        (0..c).map(|i| (((e * 5 + i * 7) % m) as u32, 0.1 + 0.05 * i as f32)).collect()
                    })
                    .collect();
                let work: Vec<ExpertWork<'_>> = lists
                    .iter()
                    .enumerate()
                    .map(|(e, tokens)| {
                        let u = w.unit(UnitId::Expert { layer: 0, expert: e as u32 }).unwrap();
                        let UnitKind::Expert(off) = u.kind else { unreachable!("expert unit kind") };
                        (u.buf.as_slice(), off, tokens.as_slice())
                    })
                    .collect();
                let pools = [
                    CpuPool::new(1).unwrap(),
                    CpuPool::new(3).unwrap(),
                    CpuPool::with_isa(3, Isa::Portable).unwrap(),
                ];
                for pool in &pools {
                    let one = CpuPool::with_isa(1, pool.isa).unwrap();
                    let mut want = vec![0.5f32; m * hd];
                    for &(unit, off, tokens) in work.iter().filter(|e| !e.2.is_empty()) {
                        let c = tokens.len();
                        let xe: Vec<f32> = tokens
                            .iter()
                            .flat_map(|&(t, _)| &xn[t as usize * hd..(t as usize + 1) * hd])
                            .copied()
                            .collect();
                        let (mut g, mut u, mut y) =
                            (vec![0f32; c * fe], vec![0f32; c * fe], vec![0f32; c * hd]);
                        mat_mul(&one, d, &xe, c, hd, unit, off.gate, fe, &mut g, false);
                        mat_mul(&one, d, &xe, c, hd, unit, off.up, fe, &mut u, false);
                        swiglu(&mut g, &u, d.mat);
                        mat_mul(&one, d, &g, c, fe, unit, off.down, hd, &mut y, false);
                        for (row, &(t, wt)) in y.chunks_exact(hd).zip(tokens) {
                            let o = &mut want[t as usize * hd..(t as usize + 1) * hd];
                            o.iter_mut().zip(row).for_each(|(o, y)| *o += wt * y);
                        }
                    }
                    let mut out = vec![0.5f32; m * hd];
                    experts_block(pool, d, fe, &xn, &work, &mut out);
                    for (i, (&a, &b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "{dtype:?} {counts:?} {:?} t={} [{i}] {a} vs {b}",
                            pool.isa,
                            pool.threads
                        );
                    }
                }
            }
        }
    }
}
