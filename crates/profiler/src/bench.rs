//! The decode GEMV's bandwidth per weight format, measured against what bounds it (`pipeshard exec bench`).
//!
//! A decode step reads every weight once, so a GEMV is as fast as the bytes of its weights stream: on the
//! CPU the bound is the DRAM read bandwidth with the same threads over a buffer of the same size, on the GPU
//! a device-to-device copy (read + write bytes over its time). Each format's matrix is sized to the same byte
//! count, far above the caches, and filled with random values; the first rows of every result are checked
//! against an f64 product with the dequantised weights, so a fast but wrong kernel shows.

use std::time::Instant;

use half::bf16;
use pipeshard_exec::cpu::simd::Isa;
use pipeshard_exec::cpu::{CacheLevel, CpuPool, Prefetch, TASKS_PER_THREAD, matmul, matmul_quant};
use pipeshard_exec::cuda::{Gpu, KernelKey, Stream};
use pipeshard_exec::host::Elem;
use pipeshard_exec::quant::{K_BLOCK_ELEMS, QFormat, round_activations};
use rayon::prelude::*;

use crate::cpu::{fill_random, read_sum};
use crate::stats::{Rule, sample};
use crate::{Progress, Result};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// CPU threads.
    pub threads: usize,
    /// Bytes of each CPU matrix (and of the DRAM read).
    pub cpu_weight_bytes: usize,
    /// Bytes of each GPU matrix (and of the copy).
    pub gpu_weight_bytes: usize,
    /// Row length of the matrices.
    pub cols: usize,
    /// Sampling rule.
    pub rule: Rule,
    /// Quantised formats to measure besides bf16 (`None`: every one). bf16 always runs: the bounds and the
    /// prefill rows take it as their reference.
    pub quant_formats: Option<Vec<QFormat>>,
}

impl BenchConfig {
    /// The formats this bench measures, bf16 first.
    fn formats(&self) -> Vec<Fmt> {
        Fmt::ALL
            .into_iter()
            .filter(|f| match (f, &self.quant_formats) {
                (Fmt::Quant(q), Some(only)) => only.contains(q),
                _ => true,
            })
            .collect()
    }
}

/// One measured GEMV.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// `cpu` or `gpu`.
    pub device: String,
    /// Weight format.
    pub format: String,
    /// The kernel that ran.
    pub kernel: String,
    /// Matrix rows (outputs) and columns (inputs).
    pub rows: usize,
    pub cols: usize,
    /// Bytes of weights one GEMV reads.
    pub weight_bytes: u64,
    /// Median time of one GEMV.
    pub time_ns: f64,
    /// `weight_bytes / time`.
    pub gbps: f64,
    /// What bounds it, and that bound measured.
    pub bound: String,
    pub bound_gbps: f64,
    /// Largest error of the checked rows over the largest reference value.
    pub max_rel_err: f64,
}

/// A weight format of the bench.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fmt {
    Bf16,
    Quant(QFormat),
}

impl Fmt {
    const ALL: [Fmt; 7] = [
        Fmt::Bf16,
        Fmt::Quant(QFormat::Q8_0),
        Fmt::Quant(QFormat::Q4_0),
        Fmt::Quant(QFormat::Q4K),
        Fmt::Quant(QFormat::Q6K),
        Fmt::Quant(QFormat::Q2K),
        Fmt::Quant(QFormat::Q3K),
    ];

    fn name(self) -> &'static str {
        match self {
            Fmt::Bf16 => "bf16",
            Fmt::Quant(q) => q.dtype().name(),
        }
    }

    fn row_bytes(self, k: usize) -> usize {
        match self {
            Fmt::Bf16 => 2 * k,
            Fmt::Quant(q) => q.row_bytes(k),
        }
    }

    /// Row `r` dequantised (widened) to f32.
    fn row(self, w: &[u8], r: usize, k: usize) -> Vec<f32> {
        let rb = self.row_bytes(k);
        let bytes = &w[r * rb..(r + 1) * rb];
        match self {
            Fmt::Bf16 => (0..k).map(|i| Elem::Bf16.read(bytes, i)).collect(),
            Fmt::Quant(q) => {
                let mut out = vec![0f32; k];
                q.dequantize_row(bytes, &mut out);
                out
            }
        }
    }
}

/// One CPU measurement: a format and a kernel variant (the pool's ISA, prefetch, tasks and rows a block).
struct CpuCase {
    fmt: Fmt,
    pool: CpuPool,
}

/// Every format with this machine's kernels first; then q8_0 and q4_0 with 4 rows a register block and
/// without software prefetch, q4_0 prefetching further into L2, q4_k and q6_k without prefetch, every quantised
/// format with 4 tasks per thread instead of 16; where the bf16 kernels run, q4_0 with
/// the f32 AVX-512 kernel and the K-quants with the f32 AVX2 ones.
fn cpu_cases(cfg: &BenchConfig, pool: &CpuPool) -> Result<Vec<CpuCase>> {
    let (q8, q4) = (Fmt::Quant(QFormat::Q8_0), Fmt::Quant(QFormat::Q4_0));
    let formats = cfg.formats();
    let mut v: Vec<(Fmt, Variant)> = formats.iter().map(|&f| (f, Variant::default())).collect();
    for f in [q8, q4] {
        v.push((f, Variant { gemv_rows: Some(4), ..Variant::default() }));
        v.push((
            f,
            Variant { prefetch: Some(Prefetch { bytes: 0, level: CacheLevel::L1 }), ..Variant::default() },
        ));
    }
    v.push((
        q4,
        Variant { prefetch: Some(Prefetch { bytes: 4096, level: CacheLevel::L2 }), ..Variant::default() },
    ));
    for f in [Fmt::Quant(QFormat::Q4K), Fmt::Quant(QFormat::Q6K)] {
        v.push((
            f,
            Variant { prefetch: Some(Prefetch { bytes: 0, level: CacheLevel::L1 }), ..Variant::default() },
        ));
    }
    // Every quantised format with the 4 tasks per thread of the other matmuls (see `QUANT_TASKS_PER_THREAD`).
    for q in QFormat::ALL {
        v.push((Fmt::Quant(q), Variant { tasks_per_thread: Some(TASKS_PER_THREAD), ..Variant::default() }));
    }
    if pool.isa() == Isa::Avx512Bf16 {
        for f in [
            q4,
            Fmt::Quant(QFormat::Q4K),
            Fmt::Quant(QFormat::Q6K),
            Fmt::Quant(QFormat::Q2K),
            Fmt::Quant(QFormat::Q3K),
        ] {
            v.push((f, Variant { isa: Some(Isa::Avx512), ..Variant::default() }));
        }
    }
    v.retain(|(f, _)| formats.contains(f));
    v.into_iter()
        .map(|(fmt, var)| {
            let mut pool = match var.isa {
                Some(isa) => CpuPool::with_isa(cfg.threads, isa)?,
                None => CpuPool::new(cfg.threads)?,
            };
            if let Some(p) = var.prefetch {
                pool = pool.with_prefetch(p);
            }
            if let Some(t) = var.tasks_per_thread {
                pool = pool.with_tasks_per_thread(t);
            }
            if let Some(r) = var.gemv_rows {
                pool = pool.with_gemv_rows(r)?;
            }
            Ok(CpuCase { fmt, pool })
        })
        .collect()
}

/// A kernel variant: what differs from the pool's defaults.
#[derive(Default)]
struct Variant {
    prefetch: Option<Prefetch>,
    isa: Option<Isa>,
    tasks_per_thread: Option<usize>,
    gemv_rows: Option<usize>,
}

/// Rows checked against the f64 reference.
const CHECKED_ROWS: usize = 64;

/// A random `[rows, k]` matrix in `fmt` (quantised formats quantise random f32 rows), filled in parallel.
fn random_matrix(fmt: Fmt, rows: usize, k: usize) -> Vec<u8> {
    const CHUNK_ROWS: usize = 256;
    let rb = fmt.row_bytes(k);
    let mut w = vec![0u8; rows * rb];
    w.par_chunks_mut(CHUNK_ROWS * rb).enumerate().for_each(|(c, chunk)| match fmt {
        Fmt::Bf16 => fill_random(chunk, Elem::Bf16, c as u64),
        Fmt::Quant(q) => {
            let mut f = vec![0u8; chunk.len() / rb * k * 4];
            fill_random(&mut f, Elem::F32, c as u64);
            let vals: Vec<f32> =
                f.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4"))).collect();
            chunk.copy_from_slice(&q.quantize(&vals, k));
        }
    });
    w
}

/// The largest error of `y`'s first rows against the f64 product, over the largest reference value. q2_k and
/// q3_k GEMVs compute on their activations rounded to 8 bits (`quant::round_activations`), so the product does.
fn check(fmt: Fmt, w: &[u8], x: &[f32], y: &[f32], k: usize) -> f64 {
    let x: Vec<f64> = match fmt {
        Fmt::Quant(q) if q.rounds_activations() => {
            let mut q8 = [0i8; K_BLOCK_ELEMS];
            x[..k]
                .chunks_exact(K_BLOCK_ELEMS)
                .flat_map(|xb| {
                    let dx = round_activations(xb, &mut q8);
                    q8.map(|v| f64::from(v) * f64::from(dx))
                })
                .collect()
        }
        _ => x[..k].iter().map(|&v| f64::from(v)).collect(),
    };
    let (mut err, mut top) = (0f64, 0f64);
    for (r, &got) in y.iter().enumerate().take(CHECKED_ROWS) {
        let want: f64 = fmt.row(w, r, k).iter().zip(&x).map(|(&a, &b)| f64::from(a) * b).sum();
        err = err.max((f64::from(got) - want).abs());
        top = top.max(want.abs());
    }
    err / top.max(f64::MIN_POSITIVE)
}

fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64().max(1e-9)
}

/// Measures the CPU GEMV of every format, and the GPU's when `gpu` is given.
pub fn gemv_bandwidth(
    cfg: &BenchConfig,
    gpu: Option<&Gpu>,
    progress: &dyn Progress,
) -> Result<Vec<BenchRow>> {
    let k = cfg.cols;
    let x: Vec<f32> =
        (0..k).map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 50.0).to_f32()).collect();
    let pool = CpuPool::new(cfg.threads)?;
    let cases = cpu_cases(cfg, &pool)?;
    let mut rows = Vec::new();

    progress.section("CPU: DRAM read, then GEMV per format and kernel variant", 1 + cases.len() as u64);
    let words = vec![1u64; cfg.cpu_weight_bytes / 8];
    let chunk = words.len().div_ceil(pool.threads());
    let dram = sample(cfg.rule, || -> Result<f64> {
        let t = Instant::now();
        let s = pool.install(|| words.par_chunks(chunk).map(read_sum).reduce(|| 0, u64::wrapping_add));
        std::hint::black_box(s);
        Ok(secs(t))
    })?;
    drop(words);
    let dram_gbps = cfg.cpu_weight_bytes as f64 / dram.median / 1e9;
    progress.tick(&format!("DRAM read, {} threads: {dram_gbps:.1} GB/s", pool.threads()))?;
    // One random matrix per format, shared by the variants that read it (and by the GPU), all made before the
    // first is timed: a format's first GEMV right after its matrix was made measured ~10 % slow.
    let mut matrices: Vec<(Fmt, Vec<u8>)> = Vec::new();
    for case in &cases {
        if !matrices.iter().any(|(f, _)| *f == case.fmt) {
            matrices
                .push((case.fmt, random_matrix(case.fmt, cfg.cpu_weight_bytes / case.fmt.row_bytes(k), k)));
        }
    }
    for case in &cases {
        let (fmt, pool) = (case.fmt, &case.pool);
        let n = cfg.cpu_weight_bytes / fmt.row_bytes(k);
        let w = &matrices.iter().find(|(f, _)| *f == fmt).expect("generated above").1;
        let mut y = vec![0f32; n];
        let t = sample(cfg.rule, || -> Result<f64> {
            let t = Instant::now();
            match fmt {
                Fmt::Bf16 => matmul(pool, &x, 1, k, w, Elem::Bf16, n, &mut y, false),
                Fmt::Quant(q) => matmul_quant(pool, &x, 1, k, w, q, n, &mut y, false),
            }
            Ok(secs(t))
        })?;
        let gbps = w.len() as f64 / t.median / 1e9;
        let kernel = match fmt {
            Fmt::Bf16 => format!("exec cpu matmul ({:?}, {} threads)", pool.isa(), pool.threads()),
            Fmt::Quant(_) => {
                format!(
                    "exec cpu matmul ({:?}, {} threads × {} tasks, {} rows a block, {})",
                    pool.isa(),
                    pool.threads(),
                    pool.quant_tasks_per_thread(),
                    pool.gemv_rows(),
                    pool.prefetch()
                )
            }
        };
        rows.push(BenchRow {
            device: "cpu".into(),
            format: fmt.name().into(),
            kernel: kernel.clone(),
            rows: n,
            cols: k,
            weight_bytes: w.len() as u64,
            time_ns: t.median * 1e9,
            gbps,
            bound: format!("DRAM read, {} threads", pool.threads()),
            bound_gbps: dram_gbps,
            max_rel_err: check(fmt, w, &x, &y, k),
        });
        progress.tick(&format!("{} ({kernel}): {gbps:.1} GB/s", fmt.name()))?;
    }
    if let Some(gpu) = gpu {
        rows.extend(gpu_rows(cfg, gpu, &x, &matrices, progress)?);
    }
    Ok(rows)
}

/// The GPU rows; `cpu_matrices` are reused where the GPU matrices have the CPU's bytes.
fn gpu_rows(
    cfg: &BenchConfig,
    gpu: &Gpu,
    x: &[f32],
    cpu_matrices: &[(Fmt, Vec<u8>)],
    progress: &dyn Progress,
) -> Result<Vec<BenchRow>> {
    const REPS: usize = 20;
    let k = cfg.cols;
    let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::Bf16, head_dim: 128 })?;
    let formats = cfg.formats();
    progress.section("GPU: device copy, then GEMV per format", 1 + formats.len() as u64);
    let (start, end) = (gpu.event(true)?, gpu.event(true)?);
    // Times `REPS` launches of `f` on the compute stream; seconds per launch.
    let timed = |f: &dyn Fn() -> pipeshard_exec::Result<()>| -> Result<f64> {
        gpu.record(&start, Stream::Compute)?;
        for _ in 0..REPS {
            f()?;
        }
        gpu.record(&end, Stream::Compute)?;
        gpu.sync_event(&end)?;
        Ok(f64::from(gpu.elapsed_ms(&start, &end)?) / 1e3 / REPS as f64)
    };
    let bytes = cfg.gpu_weight_bytes;
    let (a, b) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    // SAFETY: both buffers hold `bytes`, do not overlap, and outlive the synchronised measurement.
    let copy = sample(cfg.rule, || timed(&|| unsafe { gpu.d2d(Stream::Compute, b.ptr(), a.ptr(), bytes) }))?;
    let hbm_gbps = 2.0 * bytes as f64 / copy.median / 1e9;
    progress.tick(&format!("device copy: {hbm_gbps:.0} GB/s (read + write)"))?;
    drop(b);
    let mut xb = vec![0u8; 2 * k];
    for (i, &v) in x.iter().enumerate() {
        Elem::Bf16.write(&mut xb, i, v);
    }
    let xd = gpu.alloc(xb.len())?;
    let mut rows = Vec::new();
    for &fmt in &formats {
        let n = bytes / fmt.row_bytes(k);
        let generated;
        let w = if let Some((_, w)) =
            cpu_matrices.iter().find(|(f, w)| *f == fmt && w.len() == n * fmt.row_bytes(k))
        {
            w
        } else {
            generated = random_matrix(fmt, n, k);
            &generated
        };
        let yd = gpu.alloc(4 * n)?;
        let quant = match fmt {
            Fmt::Bf16 => None,
            Fmt::Quant(q) => Some(q),
        };
        // SAFETY: `a` holds `bytes` ≥ w.len(), xd k activations, yd n f32; all synchronised before reading.
        let t = unsafe {
            gpu.h2d(Stream::Compute, a.ptr(), w)?;
            gpu.h2d(Stream::Compute, xd.ptr(), &xb)?;
            sample(cfg.rule, || {
                timed(&|| gpu.matmul(&kn, quant, a.ptr(), xd.ptr(), yd.ptr(), 1, n, k, false))
            })?
        };
        let mut yb = vec![0u8; 4 * CHECKED_ROWS];
        // SAFETY: yd holds n ≥ CHECKED_ROWS f32; the stream is synchronised below before yb is read.
        unsafe { gpu.d2h(Stream::Compute, &mut yb, yd.ptr())? };
        gpu.sync(Stream::Compute)?;
        let y: Vec<f32> = yb.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();
        let gbps = w.len() as f64 / t.median / 1e9;
        rows.push(BenchRow {
            device: "gpu".into(),
            format: fmt.name().into(),
            kernel: match quant {
                Some(QFormat::Q4K) => "exec gemv_q (NVRTC, tensor cores)".into(),
                Some(_) => "exec gemv_q (NVRTC)".into(),
                None if gpu.decode_gemv_on() => "exec decode_gemv (NVRTC)".into(),
                None => "cuBLAS GemmEx".into(),
            },
            rows: n,
            cols: k,
            weight_bytes: w.len() as u64,
            time_ns: t.median * 1e9,
            gbps,
            bound: "device-to-device copy".into(),
            bound_gbps: hbm_gbps,
            max_rel_err: check(fmt, w, x, &y, k),
        });
        progress.tick(&format!("{}: {gbps:.0} GB/s", fmt.name()))?;
    }
    drop(a);
    rows.extend(gpu_prefill_rows(gpu, &kn, k, cfg, &timed, progress)?);
    Ok(rows)
}

/// Times launches of a closure on the compute stream: seconds per launch.
type Timed<'a> = dyn Fn(&dyn Fn() -> pipeshard_exec::Result<()>) -> Result<f64> + 'a;

/// Tokens of the prefill GEMM rows (a ubatch), and that GEMM's weight rows (a large FFN projection).
const PREFILL_TOKENS: usize = 512;
const PREFILL_ROWS: usize = 14336;

/// One prefill GEMM per format over the same `[PREFILL_ROWS, k]` shape: cuBLAS on bf16 weights, and for the
/// quantised formats exec's path above 8 tokens (dequantise chunks of rows to bf16, then cuBLAS), so the rows
/// show what dequantising costs against bf16 weights already in place. Rates are GFLOP/s; the bound is bf16's.
fn gpu_prefill_rows(
    gpu: &Gpu,
    kn: &pipeshard_exec::cuda::Kernels,
    k: usize,
    cfg: &BenchConfig,
    timed: &Timed<'_>,
    progress: &dyn Progress,
) -> Result<Vec<BenchRow>> {
    let (m, n) = (PREFILL_TOKENS, PREFILL_ROWS);
    let formats = cfg.formats();
    progress.section("GPU: prefill GEMM per format", formats.len() as u64);
    // bf16 is the largest format.
    let (wd, xd, yd) = (gpu.alloc(n * k * 2)?, gpu.alloc(m * k * 2)?, gpu.alloc(m * n * 4)?);
    let xb: Vec<u8> = (0..m * k)
        .flat_map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 50.0).to_bits().to_le_bytes())
        .collect();
    let flops = 2.0 * (m * n * k) as f64;
    let mut rows: Vec<BenchRow> = Vec::new();
    for fmt in formats {
        let w = random_matrix(fmt, n, k);
        let quant = match fmt {
            Fmt::Bf16 => None,
            Fmt::Quant(q) => Some(q),
        };
        // SAFETY: wd holds n·k bf16 ≥ w's bytes, xd m·k activations, yd m·n f32; `timed` synchronises before
        // the next upload overwrites them.
        let t = unsafe {
            gpu.h2d(Stream::Compute, wd.ptr(), &w)?;
            gpu.h2d(Stream::Compute, xd.ptr(), &xb)?;
            sample(cfg.rule, || {
                timed(&|| gpu.matmul(kn, quant, wd.ptr(), xd.ptr(), yd.ptr(), m, n, k, false))
            })?
        };
        let gflops = flops / t.median / 1e9;
        let bound_gflops = rows.first().map_or(gflops, |r| r.gbps);
        rows.push(BenchRow {
            device: "gpu".into(),
            format: fmt.name().into(),
            kernel: match quant {
                None => format!("prefill GEMM, {m} tokens: cuBLAS GemmEx (GFLOP/s)"),
                Some(_) => format!("prefill GEMM, {m} tokens: dequantise to bf16 + cuBLAS GemmEx (GFLOP/s)"),
            },
            rows: n,
            cols: k,
            weight_bytes: w.len() as u64,
            time_ns: t.median * 1e9,
            gbps: gflops,
            bound: "bf16 cuBLAS GemmEx, same shape (GFLOP/s)".into(),
            bound_gbps: bound_gflops,
            max_rel_err: 0.0,
        });
        progress.tick(&format!("{}: {gflops:.0} GFLOP/s", fmt.name()))?;
    }
    Ok(rows)
}

/// A decode layer's matrices, by the shapes of its one-token GEMVs.
#[derive(Debug, Clone, Copy)]
pub struct LayerShapes {
    pub hidden: usize,
    /// q|k|v rows (q_dim + 2·kv_dim), read as one matrix.
    pub qkv: usize,
    pub q_dim: usize,
    pub ffn: usize,
    /// SwiGLU over gate|up (else squared ReLU over up).
    pub gated: bool,
}

/// One timed variant of one of a decode layer's GEMVs (`exec bench`'s decode-kernel table).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerKernelRow {
    /// `norm + q|k|v`, `o (+= h)`, `norm + gate|up + SwiGLU`, `down (+= h)`.
    pub part: String,
    /// Weight rows × row length.
    pub rows: usize,
    pub cols: usize,
    /// `cuBLAS` (with the norm and activation kernels of their own where the part has them) or
    /// `decode_gemv Rr` (the rows a warp streams).
    pub variant: String,
    /// Device time a launch sequence takes, back to back.
    pub time_ns: f64,
    /// Weight bytes over that time.
    pub gbps: f64,
    /// Largest difference from the cuBLAS variant's output over that output's largest value.
    pub max_rel_err: f64,
}

/// Times a decode layer's four one-token GEMVs as the executor runs them with the decode GEMV off (cuBLAS,
/// the norm and the activation as kernels of their own) and on, at each rows-a-warp the kernel has, back to back
/// on the compute stream over enough copies of each matrix that L2 holds none of them (HBM-bound, as in decode).
///
/// # Errors
/// Device errors.
pub fn decode_layer_kernels(
    gpu: &Gpu,
    shapes: LayerShapes,
    rule: Rule,
    progress: &dyn Progress,
) -> Result<Vec<LayerKernelRow>> {
    use pipeshard_exec::cuda::{EarlyStart, GemvInput, GemvOutput, GemvShape};
    const REPS: usize = 40;
    const ROTATE_BYTES: usize = 512 << 20;
    let kn = gpu.kernels(KernelKey { act: Elem::Bf16, kv: Elem::Bf16, head_dim: 128 })?;
    let LayerShapes { hidden, qkv, q_dim, ffn, gated } = shapes;
    let up_rows = if gated { 2 * ffn } else { ffn };
    // (part, weight rows, row length, norm input, activation output, accumulate)
    let parts = [
        ("norm + q|k|v", qkv, hidden, true, false, false),
        ("o (+= h)", hidden, q_dim, false, false, true),
        (
            if gated { "norm + gate|up + SwiGLU" } else { "norm + up + squared ReLU" },
            up_rows,
            hidden,
            true,
            true,
            false,
        ),
        ("down (+= h)", hidden, ffn, false, false, true),
    ];
    progress.section("GPU: a decode layer's GEMVs, cuBLAS against the decode GEMV", parts.len() as u64);
    let widest = hidden.max(q_dim).max(ffn);
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let ramp = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 37 + seed * 11) % 101) as f32 - 50.0) / 50.0).collect()
    };
    let (h, nw) = (ramp(widest, 1), ramp(widest, 2).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<_>>());
    let hd = gpu.alloc(4 * widest)?;
    let nwd = gpu.alloc(4 * widest)?;
    let xd = gpu.alloc(2 * widest)?;
    let yd = gpu.alloc(4 * up_rows)?;
    let actd = gpu.alloc(2 * up_rows)?;
    let mut xb = vec![0u8; 2 * widest];
    for (i, &v) in ramp(widest, 3).iter().enumerate() {
        Elem::Bf16.write(&mut xb, i, v);
    }
    // SAFETY: the buffers hold what is written; synchronised below before use.
    unsafe {
        gpu.h2d(Stream::Compute, hd.ptr(), &f32s(&h))?;
        gpu.h2d(Stream::Compute, nwd.ptr(), &f32s(&nw))?;
        gpu.h2d(Stream::Compute, xd.ptr(), &xb)?;
    }
    let (start, end) = (gpu.event(true)?, gpu.event(true)?);
    let mut rows = Vec::new();
    for (part, n, k, norm, act_out, acc) in parts {
        let bytes = n * k * 2;
        let copies = ROTATE_BYTES.div_ceil(bytes).max(2);
        let w = gpu.alloc(bytes * copies)?;
        let one = random_matrix(Fmt::Bf16, n, k);
        for c in 0..copies {
            // SAFETY: copy c lies inside w.
            unsafe { gpu.h2d(Stream::Compute, w.ptr() + (c * bytes) as u64, &one)? };
        }
        gpu.sync(Stream::Compute)?;
        let out_n = if act_out && gated { n / 2 } else { n };
        // One launch sequence over copy c: `None` cuBLAS with the norm and activation kernels, else the decode
        // GEMV at that shape, launched as the executor launches it (under the kernel before: the weights are
        // resident).
        let run = |c: usize, r: Option<GemvShape>| -> pipeshard_exec::Result<()> {
            let wc = w.ptr() + (c * bytes) as u64;
            // SAFETY: every buffer holds the shapes above (widest ≥ k, up_rows ≥ n).
            unsafe {
                if let Some(shape) = r {
                    let input = if norm {
                        GemvInput::Norm { h: hd.ptr(), w: nwd.ptr(), b: 0, eps: 1e-5, layer_norm: false }
                    } else {
                        GemvInput::Act(xd.ptr())
                    };
                    let output = match (act_out, gated) {
                        (true, true) => GemvOutput::SwiGlu { act: actd.ptr() },
                        (true, false) => GemvOutput::Relu2 { act: actd.ptr() },
                        (false, _) => GemvOutput::Y { y: yd.ptr(), accumulate: acc },
                    };
                    return gpu.decode_gemv_with(
                        &kn,
                        wc,
                        out_n,
                        k,
                        input,
                        output,
                        shape,
                        EarlyStart::UnderPrevious,
                    );
                }
                if norm {
                    gpu.norm_act(&kn, hd.ptr(), nwd.ptr(), 0, xd.ptr(), 1, k, 1e-5, false)?;
                }
                gpu.gemm(Elem::Bf16, wc, xd.ptr(), yd.ptr(), 1, n, k, acc)?;
                if act_out {
                    let (g, u) = if gated {
                        (Some(yd.ptr()), yd.ptr() + (4 * out_n) as u64)
                    } else {
                        (None, yd.ptr())
                    };
                    gpu.ffn_act(&kn, g, u, actd.ptr(), 1, out_n, n)?;
                }
                Ok(())
            }
        };
        // The part's output after one sequence from a zeroed y (accumulating parts add into it).
        let output = |r: Option<GemvShape>| -> Result<Vec<f32>> {
            let zeros = vec![0u8; 4 * n];
            let mut got = vec![0u8; if act_out { 2 * out_n } else { 4 * out_n }];
            // SAFETY: yd holds n f32, actd out_n activations; synchronised before reading.
            unsafe {
                gpu.h2d(Stream::Compute, yd.ptr(), &zeros)?;
                run(0, r)?;
                gpu.d2h(Stream::Compute, &mut got, if act_out { actd.ptr() } else { yd.ptr() })?;
            }
            gpu.sync(Stream::Compute)?;
            Ok(if act_out {
                (0..out_n).map(|i| Elem::Bf16.read(&got, i)).collect()
            } else {
                got.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4"))).collect()
            })
        };
        let reference = output(None)?;
        let top = reference.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        let shapes: &[GemvShape] = match (act_out, gated) {
            (true, true) => &GemvShape::PAIRS,
            (true, false) => &GemvShape::ONE_OUTPUT_A_ROW,
            (false, _) => &GemvShape::ALL,
        };
        // cuBLAS, each shape, then the default shape again with two timing events recorded around every launch
        // sequence (the executor's unit spans), which shows what they cost.
        let mut timed_variants: Vec<(Option<GemvShape>, bool)> =
            std::iter::once(None).chain(shapes.iter().copied().map(Some)).map(|r| (r, false)).collect();
        timed_variants.push((Some(GemvShape::DEFAULT), true));
        let marks = (gpu.event(true)?, gpu.event(true)?);
        for (r, spans) in timed_variants {
            let got = output(r)?;
            let err = got.iter().zip(&reference).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / top;
            let t = sample(rule, || -> Result<f64> {
                gpu.record(&start, Stream::Compute)?;
                for i in 0..REPS {
                    if spans {
                        gpu.record(&marks.0, Stream::Compute)?;
                    }
                    run(i % copies, r)?;
                    if spans {
                        gpu.record(&marks.1, Stream::Compute)?;
                    }
                }
                gpu.record(&end, Stream::Compute)?;
                gpu.sync_event(&end)?;
                Ok(f64::from(gpu.elapsed_ms(&start, &end)?) / 1e3 / REPS as f64)
            })?;
            rows.push(LayerKernelRow {
                part: part.into(),
                rows: n,
                cols: k,
                variant: match (r, spans) {
                    (None, _) => "cuBLAS".into(),
                    (Some(s), false) => format!("decode_gemv {} rows × {} loads", s.rows, s.loads),
                    (Some(s), true) => {
                        format!("decode_gemv {} rows × {} loads, 2 timing events around it", s.rows, s.loads)
                    }
                },
                time_ns: t.median * 1e9,
                gbps: bytes as f64 / t.median / 1e9,
                max_rel_err: f64::from(err),
            });
        }
        progress.tick(part)?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct Quiet;
    impl Progress for Quiet {
        fn section(&self, _: &str, _: u64) {}
        fn step(&self, _: &str) {}
    }

    #[test]
    fn every_format_is_measured_and_correct_on_the_cpu() {
        let cfg = BenchConfig {
            threads: 2,
            cpu_weight_bytes: 4 << 20,
            gpu_weight_bytes: 0,
            cols: 1024,
            rule: Rule {
                min_samples: 2,
                max_samples: 3,
                target_spread: 1.0,
                budget: Duration::from_millis(50),
            },
            quant_formats: None,
        };
        let rows = gemv_bandwidth(&cfg, None, &Quiet).unwrap();
        // Every format with the default kernels, then the quantised variants.
        let formats: Vec<&str> = rows.iter().map(|r| r.format.as_str()).collect();
        assert_eq!(formats[..9], ["bf16", "q8_0", "q4_0", "q4_k", "q6_k", "q2_k", "q3_k", "q8_0", "q8_0"]);
        assert!(rows[1].kernel.contains("8 rows a block, prefetch 1024 B to L1"), "{}", rows[1].kernel);
        assert!(rows[7].kernel.contains("4 rows a block") && rows[8].kernel.contains("no prefetch"));
        for q in QFormat::ALL {
            for tasks in ["× 4 tasks", "× 16 tasks"] {
                let name = Fmt::Quant(q).name();
                assert!(rows.iter().any(|r| r.format == name && r.kernel.contains(tasks)), "{name} {tasks}");
            }
        }
        for r in &rows {
            assert!(r.gbps > 0.0 && r.bound_gbps > 0.0, "{r:?}");
            assert!(r.max_rel_err < 1e-4, "{r:?}");
            assert!(r.weight_bytes <= 4 << 20 && r.weight_bytes > 4 << 19, "{r:?}");
        }
        // q2_k (2.625 bits a weight) packs the most rows into the same bytes, then q3_k (3.4375), q4_0 and q4_k
        // (4.5), q6_k, q8_0, bf16.
        let n: Vec<usize> = rows[..7].iter().map(|r| r.rows).collect();
        assert!(n[5] > n[6] && n[6] > n[2], "{n:?}");
        assert!(n[2] == n[3] && n[3] > n[4] && n[4] > n[1] && n[1] > n[0], "{n:?}");
    }

    #[test]
    fn a_format_list_keeps_bf16_and_the_listed_formats_variants() {
        let cfg = BenchConfig {
            threads: 2,
            cpu_weight_bytes: 1 << 20,
            gpu_weight_bytes: 0,
            cols: 1024,
            rule: Rule {
                min_samples: 1,
                max_samples: 1,
                target_spread: 1.0,
                budget: Duration::from_millis(10),
            },
            quant_formats: Some(vec![QFormat::Q4K]),
        };
        let rows = gemv_bandwidth(&cfg, None, &Quiet).unwrap();
        let mut formats: Vec<&str> = rows.iter().map(|r| r.format.as_str()).collect();
        formats.dedup();
        assert_eq!(formats, ["bf16", "q4_k"]);
        assert!(rows.iter().filter(|r| r.format == "q4_k").count() >= 3, "default, no prefetch, 4 tasks");
    }
}
