//! Host sections: DRAM read bandwidth by thread count and exec's CPU kernels by thread count, each alone and,
//! when a device is present, while pinned H2D copies stream ([`Background`]).

use std::time::{Duration, Instant};

use pipeshard_core::cost::{ROUTE_PROFILE_EXPERTS, ROUTE_PROFILE_TOKENS, ROUTE_PROFILE_TOP_K};
use pipeshard_core::dtype::DType;
use pipeshard_core::model::{FfnKind, NormKind};
use pipeshard_core::profile::{DeviceProfile, DramPoint, OpRow, Roofline};
use pipeshard_core::workload::OpClass;
use pipeshard_exec::cpu::{self as kernels, CpuPool, ExpertWork, KvLayout};
use pipeshard_exec::cuda::tiled;
use pipeshard_exec::host::Elem;
use pipeshard_exec::quant::QFormat;
use pipeshard_exec::seqs::{Pass, SeqKv};
use pipeshard_exec::weights::{Dims, ExpertOffsets};
use rayon::prelude::*;

use crate::shapes::{self, HeadLayout};
use crate::stats::{Stat, sample};
use crate::{Figures, Mode, Progress, Result};

/// Load that runs beside a measurement (pinned H2D copies on the GPU side).
pub trait Background {
    /// Runs `body` while the load runs.
    fn during(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<()>;
}

/// What the host sections produce.
#[derive(Debug)]
pub struct HostProfile {
    pub dram: Vec<DramPoint>,
    pub device: DeviceProfile,
    /// See [`pipeshard_core::profile::Profile::host_route_ns_per_token`].
    pub route_ns_per_token: u64,
}

/// Fills `bytes` with random non-zero values of `elem` (magnitudes 1/8 … 1, random signs).
pub fn fill_random(bytes: &mut [u8], elem: Elem, seed: u64) {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    match elem {
        Elem::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                let r = next();
                let x = (r >> 40) as f32 / (1u64 << 24) as f32 * 0.875 + 0.125;
                let x = if r & 1 == 0 { x } else { -x };
                c.copy_from_slice(&x.to_le_bytes());
            }
        }
        Elem::Bf16 | Elem::F16 => {
            for c in bytes.chunks_exact_mut(8) {
                let r = next();
                for (i, h) in c.chunks_exact_mut(2).enumerate() {
                    let b = (r >> (16 * i)) as u16;
                    let sign = b & 0x8000;
                    let bits = if elem == Elem::Bf16 {
                        sign | ((0x7C + (b >> 7) % 3) << 7) | (b & 0x7F)
                    } else {
                        sign | ((12 + (b >> 10) % 3) << 10) | (b & 0x3FF)
                    };
                    h.copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
    }
}

/// `len_bytes` (rounded down to whole blocks) of random `fmt` blocks: random quants (and K-quant sub-block
/// scales), and f16 scales that are normal values (2^-7 … 2^-6), so that no kernel meets a NaN or a subnormal.
#[must_use]
pub fn random_blocks(fmt: QFormat, len_bytes: usize, seed: u64) -> Vec<u8> {
    let bb = fmt.block_bytes();
    // Where each block keeps its f16 scales (q4_k: d and dmin; q6_k, q3_k: d at the end; q2_k: d, dmin there).
    let f16_at: &[usize] = match fmt {
        QFormat::Q8_0 | QFormat::Q4_0 => &[0],
        QFormat::Q4K => &[0, 2],
        QFormat::Q6K => &[208],
        QFormat::Q2K => &[80, 82],
        QFormat::Q3K => &[108],
    };
    let mut v = random_vec(len_bytes / bb * bb, Elem::F32, seed);
    for (i, b) in v.chunks_exact_mut(bb).enumerate() {
        for &at in f16_at {
            b[at..at + 2].copy_from_slice(&(0x2000u16 | (i as u16 & 0x3ff)).to_le_bytes());
        }
    }
    v
}

/// A random buffer of `len_bytes`.
fn random_vec(len_bytes: usize, elem: Elem, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len_bytes.next_multiple_of(8)];
    fill_random(&mut v, elem, seed);
    v.truncate(len_bytes);
    v
}

/// Copies of an operand laid end to end, handed out in turn, so that every timed call reads its operand from
/// DRAM as a decode step does (the rest of the model passes through the caches in between), not from the
/// last-level cache the previous sample left it in. A 64 MB batched-decode KV cache timed in place ran 1.7×
/// faster per byte than a 256 MB one (profiles/h200.json at f1e6ea0: 16 sequences × 1K vs 4K keys), and the
/// executor's CPU attention ran ~1.5× its row.
struct Rotation {
    wall: Vec<u8>,
    next: usize,
}

impl Rotation {
    /// Random bytes of `elem` over `max(rotation_bytes, largest operand)`.
    fn new(rotation_bytes: usize, largest_bytes: usize, elem: Elem, seed: u64) -> Rotation {
        Rotation { wall: random_vec(rotation_bytes.max(largest_bytes), elem, seed), next: 0 }
    }

    /// The wall as laid out by the caller (quantised blocks).
    fn of(wall: Vec<u8>) -> Rotation {
        Rotation { wall, next: 0 }
    }

    /// The next copy of an operand of `bytes` (at most the largest operand given to `new`).
    fn take(&mut self, bytes: usize) -> &[u8] {
        let copies = (self.wall.len() / bytes.max(1)).max(1);
        self.next = (self.next + 1) % copies;
        &self.wall[self.next * bytes..(self.next + 1) * bytes]
    }
}

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    random_vec(n * 4, Elem::F32, seed)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A dense-decoder `Dims` with a catalog head layout, for the attention kernels.
#[must_use]
pub fn dims_for(h: HeadLayout, hidden: usize, mat: Elem) -> Dims {
    let head_dim = h.head_dim as usize;
    Dims {
        model: format!("profile {}q/{}kv×{}", h.q_heads, h.kv_heads, h.head_dim),
        n_layers: 1,
        hidden,
        n_heads: h.q_heads as usize,
        n_kv_heads: h.kv_heads as usize,
        head_dim,
        q_dim: h.q_heads as usize * head_dim,
        kv_dim: h.kv_heads as usize * head_dim,
        ffn: hidden,
        vocab: 1,
        rot_dims: head_dim,
        rope_theta: 1.0e6,
        norm_eps: 1e-5,
        norm: NormKind::RmsNorm,
        ffn_kind: FfnKind::SwiGlu,
        qk_norm: false,
        qkv_bias: false,
        mat,
        quant: None,
        moe: None,
        dense_ffn: true,
    }
}

/// GB/s of one read of `words` (well above the last-level cache) by `pool`'s threads, one contiguous chunk
/// each: the host DRAM read bandwidth of a profile, and [`DramProbe`]'s reads.
#[must_use]
fn dram_read_gbps(pool: &CpuPool, words: &[u64]) -> f64 {
    let chunk = words.len().div_ceil(pool.threads());
    let t0 = Instant::now();
    let s = pool.install(|| words.par_chunks(chunk).map(read_sum).reduce(|| 0, u64::wrapping_add));
    std::hint::black_box(s);
    (words.len() * 8) as f64 / secs_ns(t0)
}

/// A quick check of the host's DRAM read: 256 MiB (well above any last-level cache; written, so every page is
/// backed), read by a pool's threads. The GPU machine's host is shared, so the profiler and the validation
/// check it around their measurements.
#[derive(Debug)]
pub struct DramProbe {
    words: Vec<u64>,
}

impl Default for DramProbe {
    fn default() -> DramProbe {
        DramProbe { words: vec![1; 32 << 20] }
    }
}

impl DramProbe {
    /// One read's GB/s.
    #[must_use]
    pub fn read_gbps(&self, pool: &CpuPool) -> f64 {
        dram_read_gbps(pool, &self.words)
    }

    /// The best of three reads: a short dip is noise, a disturbed host reads slowly every time.
    #[must_use]
    pub fn gbps(&self, pool: &CpuPool) -> f64 {
        (0..3).map(|_| self.read_gbps(pool)).fold(0.0, f64::max)
    }
}

/// A quick check of the host's CPU GEMV: exec's bf16 matmul of one token over nemo-8b's FFN down-projection
/// shape (11520 × 4096, a row every profile has), two copies read in turn so that neither is served from the
/// last-level cache. The DRAM read can hold while the GEMV does not: in validation run27 a profile's GEMV rows
/// read 26 % slow with its DRAM read at the usual figure, and the cells minutes later ran at full speed.
#[derive(Debug)]
pub struct GemvProbe {
    copies: [Vec<u8>; 2],
    x: Vec<f32>,
}

impl Default for GemvProbe {
    fn default() -> GemvProbe {
        let (n, k) = (Self::SHAPE.0 as usize, Self::SHAPE.1 as usize);
        GemvProbe {
            copies: [random_vec(n * k * 2, Elem::Bf16, 60), random_vec(n * k * 2, Elem::Bf16, 61)],
            x: random_f32(k, 62).iter().map(|&v| Elem::Bf16.round(v)).collect(),
        }
    }
}

impl GemvProbe {
    /// The matrix rows and row length the probe multiplies (a profile row's `n` and `k`).
    pub const SHAPE: (u64, u64) = (11520, 4096);

    /// Weight GB/s of the best of three GEMVs by `pool`'s threads (as [`DramProbe::gbps`]).
    #[must_use]
    pub fn gbps(&self, pool: &CpuPool) -> f64 {
        let (n, k) = (Self::SHAPE.0 as usize, Self::SHAPE.1 as usize);
        let mut y = vec![0f32; n];
        (0..3)
            .map(|i| {
                let t0 = Instant::now();
                kernels::matmul(pool, &self.x, 1, k, &self.copies[i % 2], Elem::Bf16, n, &mut y, false);
                (n * k * 2) as f64 / secs_ns(t0)
            })
            .fold(0.0, f64::max)
    }
}

/// The sum of a slice read as u64 words (the DRAM read kernel): 64-byte AVX-512 loads where available, as
/// exec's matmul uses, so that DRAM bandwidth is the CPU kernels' real ceiling; eight plain lanes otherwise.
pub(crate) fn read_sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was just detected.
            return unsafe { read_sum_avx512(words) };
        }
    }
    read_sum_portable(words)
}

fn read_sum_portable(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_sum_avx512(words: &[u64]) -> u64 {
    use std::arch::x86_64::{
        __m512i, _mm512_add_epi64, _mm512_loadu_si512, _mm512_reduce_add_epi64, _mm512_setzero_si512,
    };
    let blocks = words.len() / 32;
    let p = words.as_ptr();
    let mut acc = [_mm512_setzero_si512(); 4];
    for i in 0..blocks {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: block i covers words[32i .. 32i + 32], inside the slice; `loadu` takes any alignment.
            #[allow(clippy::cast_ptr_alignment)]
            let v = unsafe { _mm512_loadu_si512(p.add(32 * i + 8 * j).cast::<__m512i>()) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let s = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    (_mm512_reduce_add_epi64(s) as u64).wrapping_add(read_sum_portable(&words[blocks * 32..]))
}

struct Grid {
    dram_bytes: usize,
    rotation_bytes: usize,
    matmul: Vec<(u64, u64)>,
    dtypes: Vec<DType>,
    tokens: Vec<usize>,
    /// Prefill-sized matmuls, on the most threads only (a 256-token matmul on one thread takes seconds).
    prefill_tokens: Vec<usize>,
    /// Output heads `(vocab, hidden)` in bf16 at `output_head_tokens` rows (batched decode), on the most
    /// threads.
    output_heads: Vec<(u64, u64)>,
    output_head_tokens: Vec<usize>,
    /// Routed-expert shapes `(expert_ffn, hidden)` and the tokens one expert gets, on the most threads.
    experts: Vec<(u64, u64)>,
    expert_tokens: Vec<usize>,
    attn_ctx: Vec<usize>,
    /// Prefill attention: a chunk of this many queries seeing on average each of `attn_prefill_ctx` keys (the
    /// decode rows' contexts, so the cost model interpolates between the two in tokens), on the most threads:
    /// it is compute-bound, so decode's efficiency does not carry over.
    attn_prefill_queries: usize,
    attn_prefill_ctx: Vec<usize>,
    /// Batched decode attention: steps of this many sequences over each of `attn_prefill_ctx` keys, on the
    /// most threads.
    decode_seqs: Vec<usize>,
    heads: Vec<HeadLayout>,
    elementwise_tokens: Vec<usize>,
    hidden: Vec<u64>,
    ffn: Vec<u64>,
}

fn grid(mode: Mode) -> Grid {
    let cat = shapes::from_catalog();
    let nemo = pipeshard_core::catalog::get("nemo-8b").expect("nemo-8b is in the catalog");
    let t = &nemo.text;
    let q_dim = u64::from(t.n_heads) * t.head_dim;
    match mode {
        Mode::Tiny => Grid {
            dram_bytes: 16 << 20,
            rotation_bytes: 4 << 20,
            matmul: vec![(256, 128), (1024, 256)],
            dtypes: vec![DType::Bf16, DType::Q4_0],
            tokens: vec![1, 4],
            prefill_tokens: vec![16],
            output_heads: vec![(2048, 256)],
            output_head_tokens: vec![4],
            experts: vec![(128, 64)],
            expert_tokens: vec![1, 4],
            attn_ctx: vec![64, 256],
            attn_prefill_queries: 16,
            attn_prefill_ctx: vec![64],
            decode_seqs: vec![2],
            heads: vec![HeadLayout { q_heads: 4, kv_heads: 2, head_dim: 64 }],
            elementwise_tokens: vec![1, 16],
            hidden: vec![256],
            ffn: vec![512],
        },
        Mode::Fast => Grid {
            dram_bytes: 1 << 30,
            rotation_bytes: 512 << 20,
            matmul: vec![(t.ffn, t.hidden), (q_dim, t.hidden)],
            dtypes: vec![DType::Bf16, DType::Q4_0],
            tokens: vec![1, 16],
            prefill_tokens: vec![],
            output_heads: vec![],
            output_head_tokens: vec![],
            experts: cat.experts.iter().take(1).map(|s| (s.n, s.k)).collect(),
            expert_tokens: vec![1, 64],
            attn_ctx: vec![1024, 16384],
            attn_prefill_queries: 256,
            attn_prefill_ctx: vec![4096],
            decode_seqs: vec![16],
            heads: vec![HeadLayout { q_heads: t.n_heads, kv_heads: t.n_kv_heads, head_dim: t.head_dim }],
            elementwise_tokens: vec![1, 64],
            hidden: vec![t.hidden],
            ffn: vec![t.ffn],
        },
        Mode::Full => Grid {
            dram_bytes: 1 << 30,
            rotation_bytes: 512 << 20,
            // nemo-8b's four dense projections and every routed expert shape: the CPU grid is coarser than
            // the GPU's (a 64-token matmul on one thread takes a fifth of a second).
            matmul: [
                (t.ffn, t.hidden),
                (t.hidden, t.ffn),
                (q_dim, t.hidden),
                (u64::from(t.n_kv_heads) * t.head_dim, t.hidden),
            ]
            .into_iter()
            .chain(cat.experts.iter().map(|s| (s.n, s.k)))
            .collect(),
            dtypes: shapes::with_quantised(&[DType::Bf16]),
            tokens: vec![1, 4, 16, 64],
            // 1024 for the default ubatch: validation run12's CPU FFN prefill of 1008-token chunks took 33% more
            // CPU time than the 256-token rows predicted.
            prefill_tokens: vec![256, 1024],
            // nemo-8b's head (1 GiB): past the projections' n·k, its 16-row matmul ran at 0.65× their
            // efficiency (validation run18–run23, batch 16: 39.5–42.3 ms against 27.1 ms predicted); its
            // 1- and 4-row products stream at the projections' rate (run13–run23: within −15 … +12 %).
            output_heads: vec![(t.vocab, t.hidden)],
            output_head_tokens: vec![16, 64],
            experts: cat.experts.iter().map(|s| (s.n, s.k)).collect(),
            // A 1024-token ubatch gives each of 128 experts ≈ 64 tokens (top-8); 256 covers larger ubatches.
            expert_tokens: vec![1, 4, 16, 64, 256],
            attn_ctx: vec![1024, 4096, 16384, 65536],
            // 256 queries at 16K keys take seconds a sample on 16 threads: the cost model carries 4K's efficiency
            // (compute-bound, so it barely moves with the keys) to longer contexts.
            attn_prefill_queries: 256,
            attn_prefill_ctx: vec![1024, 4096],
            decode_seqs: vec![4, 16],
            heads: cat.heads.iter().copied().filter(|h| h.head_dim % 32 == 0).collect(),
            elementwise_tokens: vec![1, 4, 16, 64, 256],
            hidden: cat.hidden.clone(),
            ffn: cat.ffn.clone(),
        },
    }
}

fn secs_ns(t: Instant) -> f64 {
    t.elapsed().as_nanos() as f64
}

/// Alone and (with a background load) under it.
fn both(
    rule: crate::stats::Rule,
    dma: Option<&dyn Background>,
    f: &mut dyn FnMut() -> Result<f64>,
) -> Result<(Stat, Option<Stat>)> {
    // Calls of over 50 ms (one-thread matmuls and long-context attention) vary little: three samples do.
    let t0 = Instant::now();
    f()?;
    let rule = if t0.elapsed().as_millis() > 50 {
        crate::stats::Rule { min_samples: 3, max_samples: 3, ..rule }
    } else {
        rule
    };
    let alone = sample(rule, &mut *f)?;
    let under = match dma {
        Some(bg) => {
            let mut s = None;
            bg.during(&mut || {
                s = Some(sample(rule, &mut *f)?);
                Ok(())
            })?;
            s
        }
        None => None,
    };
    Ok((alone, under))
}

/// The row of a measurement alone and (where taken) under DMA: `op` on `dtype`, an `n`×`k` shape, `tokens`
/// rows, `threads` threads.
fn timed_row(
    op: OpClass,
    dtype: DType,
    (n, k): (u64, u64),
    tokens: usize,
    threads: usize,
    (alone, under): (Stat, Option<Stat>),
) -> OpRow {
    OpRow {
        op,
        dtype,
        n,
        k,
        tokens: tokens as u64,
        threads: threads as u32,
        time_ns: alone.median.ceil() as u64,
        time_ns_under_dma: under.map(|u| u.median.ceil() as u64),
        spread: Some(alone.spread),
        kv_heads: None,
    }
}

/// The row of an f16-KV attention measurement: `tokens` queries over on average `keys` keys (`op`
/// [`OpClass::AttentionDecode`]: one query of each of `tokens` sequences over its own `keys` keys).
fn attention_row(
    op: OpClass,
    timed: (Stat, Option<Stat>),
    d: &Dims,
    keys: usize,
    tokens: usize,
    threads: usize,
) -> OpRow {
    OpRow {
        kv_heads: Some(d.n_kv_heads as u32),
        ..timed_row(op, DType::F16, (d.q_dim as u64, keys as u64), tokens, threads, timed)
    }
}

/// Routed experts timed together per CPU sample (a decode step's top-8).
const EXPERTS_PER_SAMPLE: usize = 8;
/// Samples of a routed-experts row at most (the rule's time budget still bounds them).
const EXPERT_MAX_SAMPLES: u32 = 100;
/// The pool's idle time before each host-routing sample: a layer's attention on the GPU, during which the
/// executor's host waits in the routing sync and the pool's workers park.
const ROUTE_IDLE_BEFORE: Duration = Duration::from_millis(2);

/// Measures DRAM and the CPU kernels with every thread count in `threads`.
pub fn measure(
    mode: Mode,
    threads: &[u32],
    dma: Option<&dyn Background>,
    figures: &mut Figures,
    progress: &dyn Progress,
) -> Result<HostProfile> {
    let g = grid(mode);
    let rule = mode.rule();
    // Only a machine with a GPU (whose section lends the DMA load) runs CPU experts beside one.
    let beside_gpu = dma.is_some();
    // A decode block's samples (~0.3 ms) spread widely (interquartile range 27 % of the median in 25 samples,
    // run41's profile): more of them, within the rule's time budget.
    let expert_rule = crate::stats::Rule { max_samples: rule.max_samples.max(EXPERT_MAX_SAMPLES), ..rule };
    let pools: Vec<CpuPool> =
        threads.iter().map(|&t| CpuPool::new(t as usize)).collect::<std::result::Result<_, _>>()?;

    // DRAM read bandwidth.
    progress.section("host DRAM read bandwidth", pools.len() as u64);
    let words: Vec<u64> = random_vec(g.dram_bytes, Elem::F32, 1)
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let mut dram = Vec::new();
    for pool in &pools {
        let mut read = || -> Result<f64> { Ok(dram_read_gbps(pool, &words)) };
        let (alone, under) = both(rule, dma, &mut read)?;
        dram.push(DramPoint {
            threads: pool.threads() as u32,
            gbps: alone.median,
            gbps_under_dma: under.map_or(alone.median, |u| u.median),
            spread: Some(alone.spread),
        });
        progress.tick(&format!("{} threads: {:.1} GB/s", pool.threads(), alone.median))?;
    }
    drop(words);

    // Matmuls.
    let mut rows = Vec::new();
    let most = pools.iter().max_by_key(|p| p.threads()).expect("at least one thread count");
    // Shapes whose rows are whole blocks of the format.
    let fits = |dtype: DType, k: u64| k.is_multiple_of(dtype.block_elems());
    let steps = g.dtypes.iter().map(|&d| g.matmul.iter().filter(|s| fits(d, s.1)).count()).sum::<usize>()
        * (g.tokens.len() * pools.len() + g.prefill_tokens.len());
    progress.section("CPU matmul (exec kernels) by threads, alone and under DMA", steps as u64);
    for &dtype in &g.dtypes {
        let quant = QFormat::from_dtype(dtype);
        // Quantised matmuls take activations rounded to bf16, as a quantised model's are.
        let elem = if quant.is_some() { Elem::Bf16 } else { Elem::from_dtype(dtype).expect("f16/bf16") };
        let row_bytes = |k: u64| quant.map_or(2 * k as usize, |q| q.row_bytes(k as usize));
        let max_w = g.matmul.iter().map(|&(n, k)| n as usize * row_bytes(k)).max().unwrap_or(0);
        let mut wall = match quant {
            Some(q) => Rotation::of(random_blocks(q, g.rotation_bytes.max(max_w), 2)),
            None => Rotation::new(g.rotation_bytes, max_w, elem, 2),
        };
        let max_k = g.matmul.iter().map(|s| s.1).max().unwrap_or(1) as usize;
        let max_n = g.matmul.iter().map(|s| s.0).max().unwrap_or(1) as usize;
        let max_m = g.tokens.iter().chain(&g.prefill_tokens).copied().max().unwrap_or(1);
        let x: Vec<f32> = random_f32(max_m * max_k, 3).iter().map(|&v| elem.round(v)).collect();
        let mut y = vec![0f32; max_m * max_n];
        let runs = g
            .tokens
            .iter()
            .map(|&m| (m, &pools[..]))
            .chain(g.prefill_tokens.iter().map(|&m| (m, std::slice::from_ref(most))));
        for &(n, k) in g.matmul.iter().filter(|s| fits(dtype, s.1)) {
            let wbytes = n as usize * row_bytes(k);
            for (m, pools) in runs.clone() {
                for pool in pools {
                    let mut run = || -> Result<f64> {
                        let w = wall.take(wbytes);
                        let (k, n) = (k as usize, n as usize);
                        let t0 = Instant::now();
                        match quant {
                            Some(q) => kernels::matmul_quant(pool, &x, m, k, w, q, n, &mut y, false),
                            None => kernels::matmul(pool, &x, m, k, w, elem, n, &mut y, false),
                        }
                        Ok(secs_ns(t0))
                    };
                    let timed = both(rule, dma, &mut run)?;
                    rows.push(timed_row(OpClass::MatMul, dtype, (n, k), m, pool.threads(), timed));
                    progress.tick(&format!("{dtype:?} {n}×{k} m={m} t={}", pool.threads()))?;
                }
            }
        }
    }

    // Output heads at batched-decode row counts: the cost model interpolates them in n·k between these and
    // the projections instead of carrying the largest projection's efficiency to a matrix 11× its size.
    progress.section(
        "CPU output head matmul (exec kernel), most threads",
        (g.output_heads.len() * g.output_head_tokens.len()) as u64,
    );
    for &(n, k) in &g.output_heads {
        let (nu, ku) = (n as usize, k as usize);
        let w = random_vec(nu * ku * 2, Elem::Bf16, 4);
        let m_max = g.output_head_tokens.iter().copied().max().unwrap_or(1);
        let x: Vec<f32> = random_f32(m_max * ku, 5).iter().map(|&v| Elem::Bf16.round(v)).collect();
        let mut y = vec![0f32; m_max * nu];
        for &m in &g.output_head_tokens {
            let mut run = || -> Result<f64> {
                let t0 = Instant::now();
                kernels::matmul(most, &x, m, ku, &w, Elem::Bf16, nu, &mut y, false);
                Ok(secs_ns(t0))
            };
            let timed = both(rule, dma, &mut run)?;
            rows.push(timed_row(OpClass::MatMul, DType::Bf16, (n, k), m, most.threads(), timed));
            progress.tick(&format!("bf16 head {n}×{k} m={m} t={}", most.threads()))?;
        }
    }

    // Decode attention over the KV cache.
    let steps = g.heads.len() * g.attn_ctx.len() * pools.len();
    progress.section("CPU decode attention (exec kernel) by threads", steps as u64);
    let kv_elem = Elem::F16;
    let m = g.attn_prefill_queries;
    // One wall of random KV serves every attention row below: its values do not matter, only that each sample
    // reads its cache cold. It holds the largest cache of the three kinds.
    let kv_largest = g
        .heads
        .iter()
        .map(|&h| {
            let kv_dim = dims_for(h, 1024, Elem::Bf16).kv_dim;
            let lay = |ctx| KvLayout { ctx, kv_dim, elem: kv_elem };
            let decode = g.attn_ctx.iter().map(|&c| lay(c).bytes());
            let prefill = g.attn_prefill_ctx.iter().map(|&c| lay(c - m / 2 + m).bytes());
            let batched = g.attn_prefill_ctx.iter().flat_map(|&c| {
                g.decode_seqs.iter().map(move |&r| {
                    SeqKv { seq: lay(c), seqs: r, unified: false, prompt: c - 1 }.whole().bytes()
                })
            });
            decode.chain(prefill).chain(batched).max().unwrap_or(0)
        })
        .max()
        .unwrap_or(0);
    let mut kv = Rotation::new(g.rotation_bytes, kv_largest, kv_elem, 4);
    for &h in &g.heads {
        let d = dims_for(h, 1024, Elem::Bf16);
        let q = random_f32(d.q_dim, 5);
        let mut out = vec![0f32; d.q_dim];
        for &ctx in &g.attn_ctx {
            // The cache of `ctx` tokens: K then V, each `ctx × kv_dim`.
            let lay = KvLayout { ctx, kv_dim: d.kv_dim, elem: kv_elem };
            for pool in &pools {
                let mut run = || -> Result<f64> {
                    let cache = kv.take(lay.bytes());
                    let t0 = Instant::now();
                    kernels::attention(pool, &d, &q, cache, lay, 1, ctx - 1, Elem::Bf16, &mut out);
                    Ok(secs_ns(t0))
                };
                rows.push(attention_row(
                    OpClass::Attention,
                    both(rule, dma, &mut run)?,
                    &d,
                    ctx,
                    1,
                    pool.threads(),
                ));
                progress.tick(&format!("{}q/{}kv ctx {ctx} t={}", h.q_heads, h.kv_heads, pool.threads()))?;
            }
        }
    }

    // Routed experts: exec's expert block (gather, gate and up, SwiGLU, down, weighted scatter-add) over
    // EXPERTS_PER_SAMPLE experts that each get `c` tokens, on the most threads; a row is one expert's share.
    // Beside a GPU the executor runs the block on the pool while its host thread enqueues GPU work and then
    // polls for the block's end (`CpuPool::alongside`): one thread more than the cores, which slowed the
    // decode block 10-16 % in 3 of 4 readings on the H200 machine (crates/exec/benches/experts.rs,
    // results/exec/quant "Session 20"); rows timed from a waiting host thread missed it.
    // Matmul rows alone miss the block's own work and its short down projection (k = expert FFN). Quantised
    // experts (whose gate, up and down rows are whole blocks) take bf16 activations.
    let fits = |dtype: DType, n: u64, k: u64| {
        n.is_multiple_of(dtype.block_elems()) && k.is_multiple_of(dtype.block_elems())
    };
    let steps =
        g.dtypes.iter().map(|&d| g.experts.iter().filter(|s| fits(d, s.0, s.1)).count()).sum::<usize>()
            * g.expert_tokens.len();
    progress.section("CPU routed experts (exec kernel), most threads", steps as u64);
    for &dtype in &g.dtypes {
        let quant = QFormat::from_dtype(dtype);
        let elem = if quant.is_some() { Elem::Bf16 } else { Elem::from_dtype(dtype).expect("f16/bf16") };
        for &(n, k) in g.experts.iter().filter(|s| fits(dtype, s.0, s.1)) {
            let (nu, ku) = (n as usize, k as usize);
            // Gate and up are n rows of k, down k rows of n: the same bytes in every format.
            let mat_bytes = quant.map_or(nu * ku * 2, |q| nu * q.row_bytes(ku));
            let off = ExpertOffsets { gate: 0, up: mat_bytes, down: 2 * mat_bytes };
            let wall_bytes = g.rotation_bytes.max(3 * mat_bytes * EXPERTS_PER_SAMPLE);
            let wall = match quant {
                Some(q) => random_blocks(q, wall_bytes, 10),
                None => random_vec(wall_bytes, elem, 10),
            };
            let copies = wall.len() / (3 * mat_bytes);
            let d = Dims { mat: elem, quant, ..dims_for(g.heads[0], ku, elem) };
            for &c in &g.expert_tokens {
                let xn: Vec<f32> = random_f32(c * ku, 11).iter().map(|&v| elem.round(v)).collect();
                let tokens: Vec<(u32, f32)> = (0..c as u32).map(|t| (t, 0.125)).collect();
                let mut out = vec![0f32; c * ku];
                let mut i = 0;
                let mut run = || -> Result<f64> {
                    let work: Vec<ExpertWork<'_>> = (0..EXPERTS_PER_SAMPLE)
                        .map(|j| {
                            let e = (i + j) % copies;
                            (&wall[3 * mat_bytes * e..3 * mat_bytes * (e + 1)], off, tokens.as_slice())
                        })
                        .collect();
                    i = (i + EXPERTS_PER_SAMPLE) % copies;
                    let t0 = Instant::now();
                    let mut block = || kernels::experts_block(most, &d, nu, &xn, &work, &mut out);
                    if beside_gpu {
                        most.alongside(block, || ());
                    } else {
                        block();
                    }
                    Ok(secs_ns(t0) / EXPERTS_PER_SAMPLE as f64)
                };
                let timed = both(expert_rule, dma, &mut run)?;
                rows.push(timed_row(OpClass::Experts, dtype, (n, k), c, most.threads(), timed));
                progress.step(&format!("{dtype:?} expert {n}×{k}, {c} tokens t={}", most.threads()));
            }
        }
    }

    // The executor's host routing of a prefill chunk: the top-k of every token's logits on the pool, the
    // per-expert token lists and the tiled experts' index over them, between the routing sync and the first
    // expert (the GPU waits meanwhile). Each sample starts, as in a layer, after the pool's workers idled
    // through the GPU's attention (2 ms): their wake-up is part of the span (run37's cells spent 0.63–0.71 ms
    // routing 1008 tokens where back-to-back samples had measured 0.29).
    progress.section("host routing of a prefill chunk (exec), most threads", 1);
    let (route_m, route_e) = (ROUTE_PROFILE_TOKENS, ROUTE_PROFILE_EXPERTS as usize);
    let logits = random_f32(route_m * route_e, 12);
    let entries = route_m * ROUTE_PROFILE_TOP_K;
    let mut index = vec![0u8; tiled::tiled_index_max_bytes(route_m, entries, route_e, route_m)];
    let route = sample(rule, || -> Result<f64> {
        std::thread::sleep(ROUTE_IDLE_BEFORE);
        let t0 = Instant::now();
        let routing = kernels::Routing::from_logits(most, &logits, route_e, ROUTE_PROFILE_TOP_K, true);
        let lists = routing.per_expert(route_e);
        let experts: Vec<(u64, usize)> = lists.iter().map(|l| (0, l.len())).filter(|e| e.1 > 0).collect();
        let tokens: Vec<u32> = lists.iter().flat_map(|l| l.iter().map(|p| p.0)).collect();
        std::hint::black_box(tiled::build_tiled_index(&experts, &tokens, route_m, route_m, &mut index));
        Ok(secs_ns(t0))
    })?;
    let route_per_token = Stat { median: route.median / route_m as f64, ..route };
    figures.add(
        &format!("host routing, {route_m} tokens × {route_e} experts, top {ROUTE_PROFILE_TOP_K}, per token"),
        "ns",
        route_per_token,
    );
    progress.tick(&format!("routing {:.2} ms a chunk", route.median / 1e6))?;

    // Prefill attention: a chunk of queries over the cache before them and each other (causal).
    let steps = g.heads.len() * g.attn_prefill_ctx.len();
    progress.section("CPU prefill attention (exec kernel), most threads", steps as u64);
    for &h in &g.heads {
        let d = dims_for(h, 1024, Elem::Bf16);
        let q = random_f32(m * d.q_dim, 8);
        let mut out = vec![0f32; m * d.q_dim];
        for &ctx in &g.attn_prefill_ctx {
            // Query i at position ctx − m/2 + i sees that many keys plus one: on average `ctx`, as the workload
            // counts a chunk's keys.
            let pos0 = ctx - m / 2;
            let lay = KvLayout { ctx: pos0 + m, kv_dim: d.kv_dim, elem: kv_elem };
            let mut run = || -> Result<f64> {
                let cache = kv.take(lay.bytes());
                let t0 = Instant::now();
                kernels::attention(most, &d, &q, cache, lay, m, pos0, Elem::Bf16, &mut out);
                Ok(secs_ns(t0))
            };
            rows.push(attention_row(
                OpClass::Attention,
                both(rule, dma, &mut run)?,
                &d,
                ctx,
                m,
                most.threads(),
            ));
            progress.tick(&format!(
                "{}q/{}kv {m} queries, ~{ctx} keys t={}",
                h.q_heads,
                h.kv_heads,
                most.threads()
            ))?;
        }
    }

    // Batched decode attention: one query of each of r sequences over its own cache, read through the
    // executor's per-query key rows (per-sequence caches; the CPU reads a unified cache's own cells alike).
    let steps = g.heads.len() * g.decode_seqs.len() * g.attn_prefill_ctx.len();
    progress.section("CPU batched decode attention (exec kernel), most threads", steps as u64);
    for &h in &g.heads {
        let d = dims_for(h, 1024, Elem::Bf16);
        for &r in &g.decode_seqs {
            let q = random_f32(r * d.q_dim, 12);
            let mut out = vec![0f32; r * d.q_dim];
            for &ctx in &g.attn_prefill_ctx {
                let seq = KvLayout { ctx, kv_dim: d.kv_dim, elem: kv_elem };
                let cache = SeqKv { seq, seqs: r, unified: false, prompt: ctx - 1 };
                let pass = Pass::Decode { pos: ctx - 1 };
                let keys = |t: usize| cache.keys(pass, t);
                let mut run = || -> Result<f64> {
                    let kv = kv.take(cache.whole().bytes());
                    let t0 = Instant::now();
                    kernels::attention_rows(most, &d, &q, kv, cache.whole(), r, &keys, Elem::Bf16, &mut out);
                    Ok(secs_ns(t0))
                };
                let stats = both(rule, dma, &mut run)?;
                rows.push(attention_row(OpClass::AttentionDecode, stats, &d, ctx, r, most.threads()));
                progress.tick(&format!(
                    "{}q/{}kv {r} seqs × {ctx} keys t={}",
                    h.q_heads,
                    h.kv_heads,
                    most.threads()
                ))?;
            }
        }
    }

    // Elementwise kernels (single-threaded in exec).
    let steps = g.elementwise_tokens.len() * (g.hidden.len() * 2 + g.ffn.len());
    progress.section("CPU norm / RoPE / activation (exec kernels)", steps as u64);
    for &m in &g.elementwise_tokens {
        for &hid in &g.hidden {
            let hid = hid as usize;
            let x = random_f32(m * hid, 6);
            let w = random_f32(hid, 7);
            let mut out = vec![0f32; m * hid];
            let s = sample(rule, || -> Result<f64> {
                let t0 = Instant::now();
                kernels::norm_rows(NormKind::RmsNorm, &x, hid, &w, None, 1e-5, Elem::Bf16, &mut out);
                Ok(secs_ns(t0))
            })?;
            rows.push(elementwise_row(OpClass::Norm, hid as u64, m, s));
            progress.tick(&format!("norm {hid} m={m}"))?;
            // RoPE over `hidden` worth of q (128-dim heads): the shape the layer rotates.
            let head_dim = 128usize;
            let heads = (hid / head_dim).max(1);
            let inv: Vec<f32> =
                (0..head_dim / 2).map(|i| 1.0 / 1.0e6f32.powf(2.0 * i as f32 / head_dim as f32)).collect();
            let mut q = random_f32(m * heads * head_dim, 8);
            let s = sample(rule, || -> Result<f64> {
                let t0 = Instant::now();
                kernels::rope(&mut q, m, heads, head_dim, &inv, (1000, 1));
                Ok(secs_ns(t0))
            })?;
            rows.push(elementwise_row(OpClass::Rope, (heads * head_dim) as u64, m, s));
            progress.tick(&format!("rope {hid} m={m}"))?;
        }
        for &f in &g.ffn {
            let f = f as usize;
            let mut gate = random_f32(m * f, 9);
            let up = random_f32(m * f, 10);
            let s = sample(rule, || -> Result<f64> {
                let t0 = Instant::now();
                kernels::swiglu(&mut gate, &up, Elem::Bf16);
                Ok(secs_ns(t0))
            })?;
            rows.push(elementwise_row(OpClass::Activation, f as u64, m, s));
            progress.tick(&format!("swiglu {f} m={m}"))?;
        }
    }

    // Rooflines: the best measured rates.
    let max_t = threads.iter().copied().max().unwrap_or(1);
    let mut matmul_flops = Vec::new();
    for &dtype in &g.dtypes {
        let best = rows
            .iter()
            .filter(|r| r.op == OpClass::MatMul && r.dtype == dtype && r.threads == max_t)
            .map(|r| 2.0 * (r.tokens * r.n * r.k) as f64 / r.time_ns as f64 * 1e9)
            .fold(0.0, f64::max);
        matmul_flops.push((dtype, best));
    }
    let default_flops = matmul_flops.iter().map(|x| x.1).fold(0.0, f64::max);
    let mem_gbps = dram.iter().map(|d| d.gbps).fold(0.0, f64::max);
    let ratios: Vec<f64> =
        rows.iter().filter_map(|r| r.time_ns_under_dma.map(|u| u as f64 / r.time_ns as f64)).collect();
    let dma_slowdown = if ratios.is_empty() { 1.0 } else { Stat::of(&ratios).median.max(1.0) };
    if !ratios.is_empty() {
        figures.add("CPU op slowdown under H2D DMA (median over rows)", "x", Stat::of(&ratios));
    }
    Ok(HostProfile {
        dram,
        device: DeviceProfile {
            roofline: Roofline { matmul_flops, default_flops, mem_gbps },
            ops: rows,
            dma_slowdown,
        },
        route_ns_per_token: route_per_token.median.round() as u64,
    })
}

fn elementwise_row(op: OpClass, n: u64, m: usize, s: Stat) -> OpRow {
    OpRow {
        op,
        dtype: DType::F32,
        n,
        k: 1,
        tokens: m as u64,
        threads: 1,
        time_ns: s.median.ceil().max(1.0) as u64,
        time_ns_under_dma: None,
        spread: Some(s.spread),
        kv_heads: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GEMV probe multiplies its two copies in turn and gives a positive, finite rate (unoptimised test
    /// builds run it at under 1 GB/s).
    #[test]
    fn the_gemv_probe_reads_its_matrix_at_a_real_rate() {
        let pool = CpuPool::new(2).unwrap();
        let gbps = GemvProbe::default().gbps(&pool);
        assert!(gbps.is_finite() && gbps > 0.01, "{gbps}");
    }

    #[test]
    fn the_dram_reader_sums_every_word() {
        let v: Vec<u64> = (0..1003u64).map(|i| i * 0x9E37_79B9 + 7).collect();
        let want = v.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        assert_eq!(read_sum(&v), want);
        assert_eq!(read_sum_portable(&v), want);
    }

    #[test]
    fn random_fill_is_never_zero_and_stays_in_range() {
        for e in [Elem::Bf16, Elem::F16, Elem::F32] {
            let v = random_vec(4096, e, 3);
            for i in 0..4096 / e.size_bytes() {
                let x = e.read(&v, i).abs();
                assert!((0.124..=1.0).contains(&x), "{e:?}[{i}] = {x}");
            }
        }
    }
}
