//! Op and copy times from a [`Profile`]: the [`CostModel`] trait and its table implementation.
//!
//! [`TableCostModel`] is fitted once from a profile and answers in O(rows of one op family) without
//! allocation. For an op it computes the roofline time on the device (FLOPs at peak vs bytes at memory
//! bandwidth; CPU rates at the thread count asked for) and divides by an *efficiency* — the fraction of the
//! roofline the measured rows achieved — interpolated log-linearly in tokens between rows of the same op family
//! and format, then log-linearly in shape (n·k) between the measured shapes either side. Efficiencies are
//! capped at 1, so a prediction is never faster than the roofline bound; with no matching rows the roofline
//! itself is used (efficiency 1), except that a block-quantised format a measured profile has no rows of
//! borrows the bf16 rows' efficiency ([`TableCostModel::borrows_bf16`]).
//! A decode step of several sequences runs their queries side by side in one kernel, which a prefill chunk's
//! rows do not time: it takes the `attention_decode` rows (or `attention_decode_unified` for a unified cache's
//! masked scan), with the one-token attention rows as their one-sequence end, where the profile has them.
//! Routed experts run as `touched` separate expert GEMMs, each at one expert's efficiency at its tokens (the
//! `experts` rows); where our executor groups a MoE layer's pinned GPU experts of a step of at most
//! [`GROUPED_EXPERTS_MAX_TOKENS`] tokens into one launch pair ([`OpContext::grouped_experts`]), the
//! `experts_grouped` rows time that group, interpolated in the number of experts instead; a larger step's
//! pinned experts run in tiled groups of three launches, whose `experts_tiled` rows give an expert's share at its
//! tokens (interpolated as the per-expert rows).
//! Concurrent DMA: rows' `time_ns_under_dma` give their own efficiency; otherwise memory-bound time is
//! stretched by the device's `dma_slowdown` and CPU bandwidth comes from the DRAM-under-DMA curve.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::inventory::Inventory;
use crate::profile::{OpRow, Profile, Provenance};
use crate::workload::{GROUPED_EXPERTS_MAX_TOKENS, Op, OpClass, OpKind, Workload};

/// Experts of the router whose routing [`Profile::host_route_ns_per_token`] times (qwen3-30b-a3b's).
pub const ROUTE_PROFILE_EXPERTS: u64 = 128;
/// Experts each token picks in that measurement.
pub const ROUTE_PROFILE_TOP_K: usize = 8;
/// Tokens of that measurement: a prefill chunk.
pub const ROUTE_PROFILE_TOKENS: usize = 1024;

/// Where an op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    Gpu,
    Cpu,
}

/// Conditions an op runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpContext {
    pub device: Device,
    /// CPU threads (ignored on the GPU).
    pub threads: u32,
    /// Whether a PCIe copy runs at the same time (it takes DRAM bandwidth on the host).
    pub under_dma: bool,
    /// Whether a routed-experts op on the GPU runs as our executor's pinned experts do: one group
    /// ([`OpClass::ExpertsGrouped`]) where its step is small enough, tiled groups ([`OpClass::ExpertsTiled`])
    /// above, where the profile has such rows.
    pub grouped_experts: bool,
}

impl OpContext {
    #[must_use]
    pub fn gpu() -> OpContext {
        OpContext { device: Device::Gpu, threads: 0, under_dma: false, grouped_experts: false }
    }

    #[must_use]
    pub fn cpu(threads: u32) -> OpContext {
        OpContext { device: Device::Cpu, threads, under_dma: false, grouped_experts: false }
    }

    #[must_use]
    pub fn with_dma(self, under_dma: bool) -> OpContext {
        OpContext { under_dma, ..self }
    }

    #[must_use]
    pub fn with_grouped_experts(self, grouped_experts: bool) -> OpContext {
        OpContext { grouped_experts, ..self }
    }
}

/// Time of ops and copies on one machine.
pub trait CostModel: Send + Sync {
    /// Nanoseconds for `op` (without kernel launch overhead).
    fn op_ns(&self, op: &Op, ctx: OpContext) -> u64;
    /// The roofline lower bound for `op`: no prediction is below it.
    fn roofline_ns(&self, op: &Op, ctx: OpContext) -> u64;
    /// Host → device copy of `bytes`.
    fn h2d_ns(&self, bytes: u64, pinned: bool) -> u64;
    /// Host → device copy of `bytes` while the CPU pool computes beside it, its DMA reading the host DRAM the
    /// pool streams from (see [`crate::profile::PcieProfile::h2d_pinned_cpu_slowdown`]); [`Self::h2d_ns`]
    /// where not measured.
    fn h2d_beside_cpu_ns(&self, bytes: u64, pinned: bool) -> u64 {
        self.h2d_ns(bytes, pinned)
    }
    /// Device → host copy of `bytes`.
    fn d2h_ns(&self, bytes: u64, pinned: bool) -> u64;
    /// One kernel launch.
    fn launch_ns(&self) -> u64;
    /// One kernel replayed from a CUDA graph.
    fn graph_kernel_ns(&self) -> u64 {
        self.launch_ns()
    }
    /// One host↔device synchronisation.
    fn host_sync_ns(&self) -> u64;
    /// Our executor's host work routing `tokens` tokens over `n_experts` experts (see
    /// [`crate::profile::Profile::host_route_ns_per_token`]).
    fn host_route_ns(&self, _n_experts: u32, _tokens: u64) -> u64 {
        0
    }
    /// Our executor's measured routing round trip in a one-token decode step, from a GPU router's kernels' end
    /// to the first expert's start on `to` (see [`crate::profile::Profile::decode_routing_to_cpu_ns`]), with
    /// an H2D copy streaming (`beside_h2d`) or not; 0 where not measured.
    fn decode_routing_ns(&self, _to: Device, _beside_h2d: bool) -> u64 {
        0
    }
    /// Our executor's measured return from a one-token decode step's CPU experts to the GPU, from their end to
    /// the device starting their sum (see [`crate::profile::Profile::decode_experts_return_ns`]), with an H2D
    /// copy streaming (`beside_h2d`) or not; 0 where not measured.
    fn decode_experts_return_ns(&self, _beside_h2d: bool) -> u64 {
        0
    }
    /// Our executor's host time per streamed unit beyond its kernels' launches (see
    /// [`crate::profile::Profile::ring_copy_issue_ns`]); 0 where not measured.
    fn ring_copy_issue_ns(&self) -> u64 {
        0
    }
    /// Copy-engine time each of our executor's ring copies takes beyond its PCIe copy (see
    /// [`crate::profile::Profile::ring_copy_gap_ns`]); 0 where not measured.
    fn ring_copy_gap_ns(&self) -> u64 {
        0
    }
    /// Whether GPU experts read the routing on the device (no host round trip after a GPU router).
    fn expert_ids_on_device(&self) -> bool {
        false
    }
    /// Whether GPU units run a one-token step's q|k|v and gate|up as one GEMM each
    /// ([`crate::workload::fuse_one_token_projections`]).
    fn one_token_projections_fused(&self) -> bool {
        false
    }
    /// Whether GPU units of a one-token step fold their input norm and FFN activation into their projections
    /// ([`crate::profile::Profile::one_token_norm_act_fused`]).
    fn one_token_norm_act_fused(&self) -> bool {
        false
    }
    /// VRAM held by the runtime before any weight.
    fn runtime_overhead_bytes(&self) -> u64;
    /// VRAM the driver takes to map `locked_bytes` of page-locked host memory for the GPU.
    fn locked_host_vram_bytes(&self, _locked_bytes: u64) -> u64 {
        0
    }
    /// Default CPU threads of the machine.
    fn cpu_threads(&self) -> u32;
    /// Host DRAM bandwidth (GB/s) at `threads`, alone or while DMA runs.
    fn dram_gbps(&self, threads: u32, under_dma: bool) -> f64;
}

/// VRAM the runtime holds when running `inv` under `workload`: its own overhead plus the GPU's mapping of the
/// weights' page-locked host copies (none when the workload copies from pageable memory, as llama.cpp does
/// from its mmap of the model file).
#[must_use]
pub fn workload_overhead_bytes(cost: &dyn CostModel, inv: &Inventory, workload: &Workload) -> u64 {
    let locked_bytes = if workload.host_pageable { 0 } else { inv.total_bytes() };
    cost.runtime_overhead_bytes() + cost.locked_host_vram_bytes(locked_bytes)
}

/// One measured row as an efficiency sample: (log n·k, log tokens, efficiency alone, efficiency under DMA).
type Point = (f64, f64, f64, Option<f64>);

/// Efficiency samples of one op family on one device, sorted by (shape, tokens).
#[derive(Debug, Clone)]
struct Family {
    device: Device,
    class: OpClass,
    dtype: DType,
    threads: u32,
    /// Attention: query heads per KV head (a kernel's efficiency depends on how many query heads share a KV
    /// row); 0 for other ops.
    group: u32,
    points: Vec<Point>,
}

/// An attention op's (or row's) query heads per KV head; 0 for other ops.
fn head_group(kind: &OpKind) -> u32 {
    match *kind {
        OpKind::Attention { q_heads, kv_heads, .. } => q_heads / kv_heads.max(1),
        _ => 0,
    }
}

/// The table cost model (see the module docs).
#[derive(Debug, Clone)]
pub struct TableCostModel {
    profile: Profile,
    families: Vec<Family>,
}

impl TableCostModel {
    /// A host → device copy of `bytes` on the profile's curve, its transfer `slowdown` times longer.
    fn h2d_slowed_ns(&self, bytes: u64, pinned: bool, slowdown: f64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        self.profile.pcie.copy_latency_ns
            + (bytes as f64 * slowdown / self.profile.h2d_gbps(bytes, pinned)).ceil() as u64
    }

    /// Fits efficiencies from the profile's op rows.
    #[must_use]
    pub fn new(profile: &Profile) -> TableCostModel {
        let mut m = TableCostModel { profile: profile.clone(), families: Vec::new() };
        let mut families: Vec<Family> = Vec::new();
        for (device, rows) in [(Device::Gpu, &profile.gpu.ops), (Device::Cpu, &profile.cpu.ops)] {
            for row in rows {
                let Some(op) = op_of_row(row) else { continue };
                let ctx = OpContext {
                    device,
                    threads: row.threads.max(1),
                    under_dma: false,
                    grouped_experts: false,
                };
                let roof = m.roofline_f(&op, ctx);
                let eff = (roof / row.time_ns as f64).min(1.0);
                let eff_dma = row
                    .time_ns_under_dma
                    .map(|t| (m.roofline_f(&op, ctx.with_dma(true)) / t as f64).min(1.0));
                let key_threads = if device == Device::Gpu { 0 } else { row.threads };
                let group = head_group(&op.kind);
                let point = (((row.n * row.k).max(1) as f64).ln(), (row.tokens as f64).ln(), eff, eff_dma);
                match families.iter_mut().find(|f| {
                    f.device == device
                        && f.class == row.op
                        && f.dtype == row.dtype
                        && f.threads == key_threads
                        && f.group == group
                }) {
                    Some(f) => f.points.push(point),
                    None => families.push(Family {
                        device,
                        class: row.op,
                        dtype: row.dtype,
                        threads: key_threads,
                        group,
                        points: vec![point],
                    }),
                }
            }
        }
        // A one-token attention row is the decode of one sequence, whatever the cache: the R = 1 end of the
        // batched decode rows, where a profile has them.
        let one_seq: Vec<(Device, DType, u32, u32, Point)> = families
            .iter()
            .filter(|f| f.class == OpClass::Attention)
            .flat_map(|f| {
                f.points.iter().filter(|p| p.1 == 0.0).map(|p| (f.device, f.dtype, f.threads, f.group, *p))
            })
            .collect();
        for f in families
            .iter_mut()
            .filter(|f| matches!(f.class, OpClass::AttentionDecode | OpClass::AttentionDecodeUnified))
        {
            f.points.extend(
                one_seq
                    .iter()
                    .filter(|o| (o.0, o.1, o.2, o.3) == (f.device, f.dtype, f.threads, f.group))
                    .map(|o| o.4),
            );
        }
        for f in &mut families {
            f.points.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        }
        m.families = families;
        m
    }

    /// The profile the model was fitted on.
    #[must_use]
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    fn roofline_f(&self, op: &Op, ctx: OpContext) -> f64 {
        let (flops, gbps) = match ctx.device {
            Device::Gpu => {
                let r = &self.profile.gpu.roofline;
                let slow = if ctx.under_dma { self.profile.gpu.dma_slowdown } else { 1.0 };
                (r.flops(op.dtype), r.mem_gbps / slow)
            }
            Device::Cpu => {
                let r = &self.profile.cpu.roofline;
                let base = f64::from(self.profile.machine.cpu_threads);
                let threads = f64::from(ctx.threads.max(1));
                (
                    r.flops(op.dtype) * (threads / base).min(1.0),
                    self.profile.dram_gbps(ctx.threads.max(1), ctx.under_dma),
                )
            }
        };
        // Attention reads KV in f16 and computes in f16/f32; matmuls use the weight format's peak.
        (op.flops_on(ctx.device) / flops * 1e9).max(op.bytes_on(ctx.device) / gbps)
    }

    /// The family measured for this op: same device, class ([`OpKind::row_class`]) and format, nearest
    /// query heads per KV head (attention), then nearest thread count. Routers and expert FFNs are matmuls, so they borrow the matmul rows when they have none of their
    /// own; a decode step's attention of several sequences borrows the attention rows when the profile did not
    /// time batched decode (on the GPU interpolated in tokens towards the prefill chunks', on the CPU at the
    /// one-query rows' efficiency: see [`TableCostModel::efficiency`]); a block-quantised format
    /// without rows borrows bf16's where [`TableCostModel::borrows_bf16`] says so. A GPU routed-experts op
    /// of a step of at most [`GROUPED_EXPERTS_MAX_TOKENS`] tokens asked for as a group
    /// ([`OpContext::grouped_experts`]) takes the `experts_grouped` rows of its format where the profile has
    /// them (f16/bf16, q8_0, q4_0, q4_k, q6_k: the formats of the grouped kernels), a larger step's the
    /// `experts_tiled` rows (any format), else the per-expert rows as any other.
    fn family(&self, op: &Op, ctx: OpContext) -> Option<&Family> {
        let threads = if ctx.device == Device::Gpu { 0 } else { ctx.threads };
        let group = head_group(&op.kind);
        let find = |class: OpClass, dtype: DType| {
            self.families
                .iter()
                .filter(|f| f.device == ctx.device && f.class == class && f.dtype == dtype)
                .min_by_key(|f| (f.group.abs_diff(group), f.threads.abs_diff(threads)))
        };
        if ctx.grouped_experts
            && ctx.device == Device::Gpu
            && let OpKind::Experts { tokens_per_touched, .. } = op.kind
        {
            // Our executor keeps quantised experts of few tokens on their exact per-expert GEMVs.
            let exact = op.dtype.is_quantized() && tokens_per_touched <= GROUPED_EXPERTS_MAX_TOKENS as f64;
            let class = match op.tokens <= GROUPED_EXPERTS_MAX_TOKENS {
                true => Some(OpClass::ExpertsGrouped),
                false if !exact => Some(OpClass::ExpertsTiled),
                false => None,
            };
            if let Some(f) = class.and_then(|c| find(c, op.dtype)) {
                return Some(f);
            }
        }
        // The CPU kernel reads a sequence's own cells of a unified cache, as of its own cache.
        let class = match (op.kind.row_class(op.tokens), ctx.device) {
            (OpClass::AttentionDecodeUnified, Device::Cpu) => OpClass::AttentionDecode,
            (c, _) => c,
        };
        // Without flash attention, a CPU decode step runs one sequence's `mul_mat` pair per sequence: the one-query
        // materialised rows where the profile has them, whatever the number of sequences.
        let materialized_cpu = ctx.device == Device::Cpu
            && matches!(op.kind, OpKind::Attention { decode: true, materialized: true, .. });
        let find_matmul = |dtype: DType| {
            let own = if materialized_cpu { find(OpClass::AttentionMaterialized, dtype) } else { None };
            own.or_else(|| find(class, dtype)).or_else(|| match class {
                OpClass::Router | OpClass::Experts => find(OpClass::MatMul, dtype),
                OpClass::AttentionDecode
                | OpClass::AttentionDecodeUnified
                | OpClass::AttentionMaterialized => find(OpClass::Attention, dtype),
                _ => None,
            })
        };
        find_matmul(op.dtype)
            .or_else(|| if self.borrows_bf16(ctx.device, op.dtype) { find_matmul(DType::Bf16) } else { None })
    }

    /// Whether matmuls in `dtype` on `device` are priced with the efficiency of the bf16 rows (at the roofline
    /// of their own bytes, i.e. the bf16 measurement scaled by bytes): a block-quantised format that a
    /// *measured* profile has no rows of there — the executor's quantised kernels were not profiled, and its
    /// bf16 kernels are the nearest measurement. Callers should warn (the quantised GEMV may run well below
    /// bf16's share of the bandwidth). A derived profile keeps the roofline for formats its published figures
    /// do not cover, as it was calibrated that way.
    #[must_use]
    pub fn borrows_bf16(&self, device: Device, dtype: DType) -> bool {
        dtype.is_quantized()
            && matches!(self.profile.provenance, Provenance::Measured { .. })
            && !self.families.iter().any(|f| f.device == device && f.dtype == dtype)
    }

    /// Efficiency for `op`: the rows of the measured shapes on either side of its own (in log n·k), each
    /// interpolated in log tokens, then interpolated between the two in log n·k; the nearest shape's alone
    /// outside the measured range. Points are sorted by (shape, tokens), so each shape's rows are one
    /// contiguous run. Taking the nearest shape alone had priced nemo-8b's prefill attention at 5.6K keys at
    /// the 7.9K-key row's rate, past the L2, 37 % slow (results/validation/2026-12-01-nvidia-h200, run22).
    fn efficiency(&self, op: &Op, ctx: OpContext) -> f64 {
        let Some(fam) = self.family(op, ctx) else { return 1.0 };
        // A routed-experts op is `touched` separate expert GEMMs of `tokens_per_touched` tokens each, so it runs at
        // one expert's efficiency at that token count (latency-bound for small counts), not at the phase's;
        // grouped, its `touched` experts are one launch pair, whose rows are timed by experts in the group.
        // A CPU decode step's queries belong to separate sequences: ggml's CPU attention (flash or not) gives each
        // query row and head to one thread, which computes over that sequence's own cells only (a unified cache's
        // others are masked and skipped), so nothing is shared between sequences, and one sequence's 32+ rows
        // already occupy every thread: R sequences cost R times one. When it
        // borrows the one-query rows, it keeps their efficiency instead of moving towards a prefill chunk's, whose
        // queries share their keys (16 sequences had cost 8.3 one's on cli3). Measured in ggml b6097's CPU kernel
        // (`scripts/ggml-cpu-attention.c`): the same time a cell and head at 1, 4 and 16 sequences.
        let tokens = match op.kind {
            OpKind::Experts { touched, .. } if fam.class == OpClass::ExpertsGrouped => touched.max(1.0),
            OpKind::Experts { tokens_per_touched, .. } => tokens_per_touched.max(1.0),
            OpKind::Attention { decode: true, .. }
                if ctx.device == Device::Cpu
                    && matches!(fam.class, OpClass::Attention | OpClass::AttentionMaterialized) =>
            {
                1.0
            }
            _ => op.tokens.max(1) as f64,
        };
        let x = tokens.ln();
        let shape = shape_log(op);
        // Each shape's run with how far its token range is from `x`: attention rows time one-token decode and
        // prefill chunks at different key counts, and a chunk's efficiency must not come from a decode row whose
        // key count happens to be closer, so only the runs nearest in tokens take part.
        let mut runs: Vec<(f64, &[Point])> = Vec::new();
        let mut rest = fam.points.as_slice();
        while let Some(first) = rest.first() {
            let len = rest.partition_point(|p| p.0 <= first.0);
            let (run, tail) = rest.split_at(len);
            runs.push(((run[0].1 - x).max(x - run[len - 1].1).max(0.0), run));
            rest = tail;
        }
        let gap = runs.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
        let near: Vec<&[Point]> = runs.iter().filter(|r| r.0 <= gap).map(|r| r.1).collect();
        let pick = |p: &Point| if ctx.under_dma { p.3.unwrap_or(p.2) } else { p.2 };
        let at_tokens = |run: &[Point]| match run.iter().position(|p| p.1 >= x) {
            Some(0) => pick(&run[0]),
            Some(i) => {
                let (a, b) = (&run[i - 1], &run[i]);
                let f = if (b.1 - a.1).abs() < 1e-12 { 0.0 } else { (x - a.1) / (b.1 - a.1) };
                pick(a) + f * (pick(b) - pick(a))
            }
            None => pick(&run[run.len() - 1]),
        };
        // `near` is sorted by shape: the last run at or below `shape` and the first above it.
        let above = near.partition_point(|r| r[0].0 <= shape);
        let eff = match (above.checked_sub(1).map(|i| near[i]), near.get(above).copied()) {
            (Some(lo), Some(hi)) => {
                let f = (shape - lo[0].0) / (hi[0].0 - lo[0].0);
                at_tokens(lo) + f * (at_tokens(hi) - at_tokens(lo))
            }
            (Some(only), None) | (None, Some(only)) => at_tokens(only),
            (None, None) => unreachable!("families have at least one point"),
        };
        eff.clamp(1e-6, 1.0)
    }
}

/// A host round-trip figure beside an H2D copy where the profile measured it (non-zero), else the idle one.
fn beside_or_idle(beside_h2d: bool, idle_ns: u64, beside_ns: u64) -> u64 {
    if beside_h2d && beside_ns > 0 { beside_ns } else { idle_ns }
}

fn shape_log(op: &Op) -> f64 {
    let nk = match op.kind {
        OpKind::MatMul { n, k } => n * k,
        OpKind::Attention { q_heads, head_dim, keys, .. } => u64::from(q_heads) * head_dim * keys,
        OpKind::Experts { ffn, hidden, .. } => ffn * hidden,
        _ => (op.act_bytes / 8.0).max(1.0) as u64,
    };
    (nk.max(1) as f64).ln()
}

/// A synthetic op with a row's shape, to compute the roofline of a measured row.
fn op_of_row(row: &OpRow) -> Option<Op> {
    use crate::inventory::UnitId;
    let m = row.tokens as f64;
    let (n, k) = (row.n as f64, row.k as f64);
    let wb = row.dtype.tensor_bytes(row.k, row.n).ok()? as f64;
    let (kind, flops, weight_bytes, act_bytes, kv_bytes) = match row.op {
        OpClass::MatMul | OpClass::Router => {
            (OpKind::MatMul { n: row.n, k: row.k }, 2.0 * m * n * k, wb, 4.0 * m * (n + k), 0.0)
        }
        OpClass::Attention
        | OpClass::AttentionDecode
        | OpClass::AttentionDecodeUnified
        | OpClass::AttentionMaterialized => {
            // n = q_heads × head_dim (head_dim 128), k = keys; K and V (f16) of `keys` tokens of the row's KV
            // heads (4 query heads per KV head where the row does not say), for one sequence, or (decode rows)
            // for each of the `tokens` sequences.
            let head_dim = 128;
            let q_heads = (row.n / head_dim).max(1) as u32;
            let kv_heads = row.kv_heads.unwrap_or(q_heads / 4).clamp(1, q_heads);
            let decode = row.op != OpClass::Attention;
            let seqs = if decode { m } else { 1.0 };
            let kv = seqs * 2.0 * k * f64::from(kv_heads) * head_dim as f64 * 2.0;
            let scanned = if row.op == OpClass::AttentionDecodeUnified { row.k * row.tokens } else { row.k };
            (
                OpKind::Attention {
                    q_heads,
                    kv_heads,
                    head_dim,
                    keys: row.k,
                    scanned_keys: scanned,
                    decode,
                    materialized: row.op == OpClass::AttentionMaterialized,
                },
                4.0 * m * k * n,
                0.0,
                4.0 * 2.0 * m * n,
                kv,
            )
        }
        OpClass::Experts | OpClass::ExpertsTiled => (
            OpKind::Experts { n_experts: 1, touched: 1.0, tokens_per_touched: m, ffn: row.n, hidden: row.k },
            6.0 * m * n * k,
            3.0 * wb,
            4.0 * m * (2.0 * k + 3.0 * n),
            0.0,
        ),
        // `tokens` experts of one token each: the work of a layer's pinned share whose `touched` is m.
        OpClass::ExpertsGrouped => (
            OpKind::Experts {
                n_experts: u32::try_from(row.tokens).ok()?,
                touched: m,
                tokens_per_touched: 1.0,
                ffn: row.n,
                hidden: row.k,
            },
            6.0 * m * n * k,
            3.0 * wb * m,
            4.0 * m * (2.0 * k + 3.0 * n),
            0.0,
        ),
        OpClass::Norm
        | OpClass::Rope
        | OpClass::Activation
        | OpClass::Add
        | OpClass::Embed
        | OpClass::Sample => {
            let elems = m * n;
            let kind = match row.op {
                OpClass::Norm => OpKind::Norm,
                OpClass::Rope => OpKind::Rope,
                OpClass::Activation => OpKind::Activation,
                OpClass::Add => OpKind::Add,
                OpClass::Embed => OpKind::Embed,
                _ => OpKind::Sample { vocab: row.n },
            };
            (kind, 3.0 * elems, 0.0, 8.0 * elems, 0.0)
        }
    };
    // A grouped row's step has at most GROUPED_EXPERTS_MAX_TOKENS tokens, whatever its experts.
    let tokens = if row.op == OpClass::ExpertsGrouped {
        row.tokens.min(GROUPED_EXPERTS_MAX_TOKENS)
    } else {
        row.tokens
    };
    Some(Op {
        kind,
        unit: UnitId::TokenEmbd,
        tokens,
        dtype: row.dtype,
        flops,
        weight_bytes,
        act_bytes,
        kv_bytes,
    })
}

impl CostModel for TableCostModel {
    fn op_ns(&self, op: &Op, ctx: OpContext) -> u64 {
        let fixed = match op.kind {
            OpKind::Experts { touched, .. } if ctx.device == Device::Cpu => {
                touched * self.profile.cpu_expert_ns as f64
            }
            _ => 0.0,
        };
        (self.roofline_f(op, ctx) / self.efficiency(op, ctx) + fixed).ceil() as u64
    }

    fn roofline_ns(&self, op: &Op, ctx: OpContext) -> u64 {
        self.roofline_f(op, ctx).floor() as u64
    }

    fn h2d_ns(&self, bytes: u64, pinned: bool) -> u64 {
        self.h2d_slowed_ns(bytes, pinned, 1.0)
    }

    fn h2d_beside_cpu_ns(&self, bytes: u64, pinned: bool) -> u64 {
        let pcie = &self.profile.pcie;
        let slowdown =
            if pinned { pcie.h2d_pinned_cpu_slowdown } else { pcie.h2d_pageable_cpu_slowdown }.unwrap_or(1.0);
        self.h2d_slowed_ns(bytes, pinned, slowdown)
    }

    fn d2h_ns(&self, bytes: u64, pinned: bool) -> u64 {
        if bytes == 0 {
            return 0;
        }
        self.profile.pcie.copy_latency_ns
            + (bytes as f64 / self.profile.d2h_gbps(bytes, pinned)).ceil() as u64
    }

    fn launch_ns(&self) -> u64 {
        self.profile.launch_ns
    }

    fn graph_kernel_ns(&self) -> u64 {
        if self.profile.graph_kernel_ns == 0 { self.profile.launch_ns } else { self.profile.graph_kernel_ns }
    }

    fn host_sync_ns(&self) -> u64 {
        self.profile.host_sync_ns
    }

    fn host_route_ns(&self, n_experts: u32, tokens: u64) -> u64 {
        self.profile.host_route_ns_per_token * tokens * u64::from(n_experts) / ROUTE_PROFILE_EXPERTS
    }

    fn decode_routing_ns(&self, to: Device, beside_h2d: bool) -> u64 {
        let p = &self.profile;
        let (idle, beside) = match to {
            Device::Cpu => (p.decode_routing_to_cpu_ns, p.decode_routing_to_cpu_beside_h2d_ns),
            Device::Gpu => (p.decode_routing_to_gpu_ns, p.decode_routing_to_gpu_beside_h2d_ns),
        };
        beside_or_idle(beside_h2d, idle, beside)
    }

    fn decode_experts_return_ns(&self, beside_h2d: bool) -> u64 {
        let p = &self.profile;
        beside_or_idle(beside_h2d, p.decode_experts_return_ns, p.decode_experts_return_beside_h2d_ns)
    }

    fn ring_copy_issue_ns(&self) -> u64 {
        self.profile.ring_copy_issue_ns
    }

    fn ring_copy_gap_ns(&self) -> u64 {
        self.profile.ring_copy_gap_ns
    }

    fn expert_ids_on_device(&self) -> bool {
        self.profile.expert_ids_on_device
    }

    fn one_token_projections_fused(&self) -> bool {
        self.profile.one_token_projections_fused
    }

    fn one_token_norm_act_fused(&self) -> bool {
        self.profile.one_token_norm_act_fused
    }

    fn runtime_overhead_bytes(&self) -> u64 {
        self.profile.runtime_overhead_bytes
    }

    fn locked_host_vram_bytes(&self, locked_bytes: u64) -> u64 {
        (u128::from(locked_bytes) * u128::from(self.profile.page_table_bytes_per_locked_gib))
            .div_ceil(1 << 30) as u64
    }

    fn cpu_threads(&self) -> u32 {
        self.profile.machine.cpu_threads
    }

    fn dram_gbps(&self, threads: u32, under_dma: bool) -> f64 {
        self.profile.dram_gbps(threads, under_dma)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::dtype::DType;
    use crate::inventory::Inventory;
    use crate::reference;
    use crate::workload::{Phase, Workload, ops};
    use proptest::prelude::*;

    fn model() -> TableCostModel {
        TableCostModel::new(&reference::derived("cli3").unwrap())
    }

    #[test]
    fn measured_rows_are_reproduced() {
        let m = model();
        for (device, rows) in [(Device::Gpu, &m.profile.gpu.ops), (Device::Cpu, &m.profile.cpu.ops)] {
            for row in rows {
                let op = op_of_row(row).unwrap();
                let ctx =
                    OpContext { device, threads: row.threads, under_dma: false, grouped_experts: false };
                let t = m.op_ns(&op, ctx) as f64;
                assert!(
                    (t - row.time_ns as f64).abs() / (row.time_ns as f64) < 0.01,
                    "{row:?}: predicted {t}"
                );
                if let Some(dma) = row.time_ns_under_dma {
                    let t = m.op_ns(&op, ctx.with_dma(true)) as f64;
                    assert!((t - dma as f64).abs() / (dma as f64) < 0.01, "{row:?} under DMA: predicted {t}");
                }
            }
        }
    }

    #[test]
    fn locked_weights_add_their_page_tables_to_the_overhead_unless_copies_are_pageable() {
        let mut profile = reference::derived("cli3").unwrap();
        profile.page_table_bytes_per_locked_gib = 2 << 20;
        let m = TableCostModel::new(&profile);
        let spec = catalog::get("qwen3-30b-a3b").unwrap().with_uniform_weights(DType::Bf16);
        let inv = Inventory::new(&spec);
        let mut w = Workload::single(1000, 4096, 32, 1024);
        let base = profile.runtime_overhead_bytes;
        // 61 GB of bf16 weights locked: 1/512 of them, as the H200 measured (119.3 MB).
        let tables = workload_overhead_bytes(&m, &inv, &w) - base;
        assert_eq!(tables, inv.total_bytes().div_ceil(512));
        assert!((119_000_000..120_000_000).contains(&tables), "{tables}");
        w.host_pageable = true;
        assert_eq!(workload_overhead_bytes(&m, &inv, &w), base);
        assert_eq!(workload_overhead_bytes(&model(), &inv, &Workload::single(1000, 4096, 32, 1024)), base);
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound_on_the_gpu() {
        let m = model();
        let spec = catalog::get("nemo-8b").unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(1024, 4096, 10, 1024);
        let decode = ops(&spec, &inv, &w, w.decode_step(0));
        let ffn_up = decode.iter().find(|o| matches!(o.kind, OpKind::MatMul { n: 11520, .. })).unwrap();
        let t = m.op_ns(ffn_up, OpContext::gpu()) as f64;
        // 94 MB of f16 weights at 80% of 1792 GB/s.
        let expect = ffn_up.bytes() / (1792.0 * 0.8);
        assert!((t - expect).abs() / expect < 0.05, "{t} vs {expect}");
        let prefill = ops(&spec, &inv, &w, Phase::Prefill { tokens: 1024, start_pos: 0, last: false });
        let up = prefill.iter().find(|o| matches!(o.kind, OpKind::MatMul { n: 11520, .. })).unwrap();
        let t = m.op_ns(up, OpContext::gpu()) as f64;
        let expect = up.flops / (209.5e12 * 0.6) * 1e9;
        assert!((t - expect).abs() / expect < 0.05, "{t} vs {expect}");
        // The CPU is far slower than the GPU on the same op, slower under DMA, slower with fewer threads.
        let cpu = m.op_ns(ffn_up, OpContext::cpu(16));
        assert!(cpu > 5 * m.op_ns(ffn_up, OpContext::gpu()));
        assert!(m.op_ns(ffn_up, OpContext::cpu(16).with_dma(true)) > cpu);
        assert!(m.op_ns(ffn_up, OpContext::cpu(4)) > cpu);
    }

    #[test]
    fn routed_experts_cost_one_expert_row_per_touched_expert() {
        // The H200 profile measures one qwen3-30b-a3b expert (768 × 2048, bf16) at 1–4096 tokens: a latency floor
        // of ≈ 35 µs up to ~1K tokens. A 1024-token prefill chunk routes ≈ 64 tokens to each of ≈ 128 experts.
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        let m = TableCostModel::new(&Profile::load(&path).unwrap());
        let row_ns = |tokens: u64| {
            let r = m.profile.gpu.ops.iter().find(|r| {
                r.op == OpClass::Experts
                    && r.dtype == DType::Bf16
                    && (r.n, r.k, r.tokens) == (768, 2048, tokens)
            });
            r.unwrap().time_ns as f64
        };
        let spec =
            catalog::get("qwen3-30b-a3b").unwrap().truncated(1).unwrap().with_uniform_weights(DType::Bf16);
        let inv = Inventory::new(&spec);
        let w = Workload::single(1024, 4096, 10, 1024);
        for (phase, tokens) in
            [(Phase::Prefill { tokens: 1024, start_pos: 0, last: false }, 64), (w.decode_step(0), 1)]
        {
            let all = ops(&spec, &inv, &w, phase);
            let op = all.iter().find(|o| o.kind.class() == OpClass::Experts).unwrap();
            let OpKind::Experts { touched, tokens_per_touched, .. } = op.kind else { unreachable!() };
            assert!(
                (tokens_per_touched - tokens as f64).abs() / (tokens as f64) < 0.05,
                "{tokens_per_touched}"
            );
            let t = m.op_ns(op, OpContext::gpu()) as f64;
            let expect = touched * row_ns(tokens);
            assert!((t - expect).abs() / expect < 0.05, "{phase:?}: {t} vs {expect}");
        }
    }

    /// A GPU routed-experts row of qwen3-30b-a3b's expert shape (768 × 2048, bf16).
    fn expert_row(op: OpClass, tokens: u64, time_ns: u64) -> OpRow {
        OpRow::gpu(op, DType::Bf16, (768, 2048), tokens, time_ns)
    }

    /// The measured H200 profile with its routed-experts rows replaced: 40 µs an expert at 1 and 64 tokens,
    /// and (`grouped`) groups of 1, 2, 4 and 8 one-token experts at 8, 10, 14 and 20 µs.
    fn expert_profile(grouped: bool) -> Profile {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        let mut p = Profile::load(&path).unwrap();
        p.gpu
            .ops
            .retain(|r| !matches!(r.op, OpClass::Experts | OpClass::ExpertsGrouped | OpClass::ExpertsTiled));
        p.gpu.ops.extend([1, 64].map(|t| expert_row(OpClass::Experts, t, 40_000)));
        if grouped {
            p.gpu.ops.extend(
                [(1, 8_000), (2, 10_000), (4, 14_000), (8, 20_000)]
                    .map(|(e, t)| expert_row(OpClass::ExpertsGrouped, e, t)),
            );
        }
        p
    }

    /// The routed-experts op of one qwen3-30b-a3b bf16 layer in `phase` of `w`.
    fn experts_op(w: &Workload, phase: Phase) -> Op {
        let spec =
            catalog::get("qwen3-30b-a3b").unwrap().truncated(1).unwrap().with_uniform_weights(DType::Bf16);
        let all = ops(&spec, &Inventory::new(&spec), w, phase);
        *all.iter().find(|o| o.kind.class() == OpClass::Experts).unwrap()
    }

    /// A one-token step's 8 experts cost the grouped row of 8 experts when asked for as a group, 8 per-expert
    /// rows otherwise; a share of them (a layer's pinned experts, `touched` scaled) costs the grouped row of
    /// that many experts, as the row's own op does.
    #[test]
    fn grouped_decode_experts_take_the_grouped_rows() {
        let m = TableCostModel::new(&expert_profile(true));
        let w = Workload::single(1024, 4096, 10, 1024);
        let op = experts_op(&w, w.decode_step(0));
        let OpKind::Experts { touched, .. } = op.kind else { unreachable!() };
        assert!((touched - 8.0).abs() < 1e-9, "{touched}");
        let (grouped, apart) = (OpContext::gpu().with_grouped_experts(true), OpContext::gpu());
        let near = |got: u64, want: f64| (got as f64 / want - 1.0).abs() < 0.02;
        assert!(near(m.op_ns(&op, grouped), 20e3), "{}", m.op_ns(&op, grouped));
        assert!(near(m.op_ns(&op, apart), 8.0 * 40e3), "{}", m.op_ns(&op, apart));
        // The CPU has no grouped kernel.
        let cpu = OpContext::cpu(16);
        assert_eq!(m.op_ns(&op, cpu.with_grouped_experts(true)), m.op_ns(&op, cpu));
        // A quarter of the layer's experts pinned: 2 expected experts, the 2-expert row.
        let mut share = op;
        if let OpKind::Experts { touched, .. } = &mut share.kind {
            *touched *= 0.25;
        }
        share.flops *= 0.25;
        share.weight_bytes *= 0.25;
        share.act_bytes *= 0.25;
        assert!(near(m.op_ns(&share, grouped), 10e3), "{}", m.op_ns(&share, grouped));
        // Every grouped row comes back from its own op, at its roofline's efficiency.
        for row in m.profile.gpu.ops.iter().filter(|r| r.op == OpClass::ExpertsGrouped) {
            let row_op = op_of_row(row).unwrap();
            assert!(near(m.op_ns(&row_op, grouped), row.time_ns as f64), "{row:?}");
            assert!(m.roofline_ns(&row_op, grouped) <= row.time_ns);
        }
    }

    /// A prefill chunk (over GROUPED_EXPERTS_MAX_TOKENS tokens) never takes the grouped rows: asked for as a
    /// group it takes the tiled rows (an expert's share of a tiled group, at its tokens) where the profile has
    /// them, else the per-expert rows, as it does when not asked for as a group.
    #[test]
    fn prefill_experts_take_the_tiled_rows_never_the_grouped_ones() {
        let mut p = expert_profile(true);
        let w = Workload::single(1024, 4096, 10, 1024);
        let grouped = OpContext::gpu().with_grouped_experts(true);
        let prefill = |tokens| experts_op(&w, Phase::Prefill { tokens, start_pos: 0, last: false });
        let m = TableCostModel::new(&p);
        for tokens in [GROUPED_EXPERTS_MAX_TOKENS + 1, 1024] {
            let op = prefill(tokens);
            assert_eq!(m.op_ns(&op, grouped), m.op_ns(&op, OpContext::gpu()), "{tokens} tokens");
        }
        p.gpu.ops.extend([1, 64].map(|t| expert_row(OpClass::ExpertsTiled, t, 10_000)));
        let m = TableCostModel::new(&p);
        let near = |got: u64, want: f64| (got as f64 / want - 1.0).abs() < 0.02;
        for tokens in [GROUPED_EXPERTS_MAX_TOKENS + 1, 1024] {
            let op = prefill(tokens);
            let OpKind::Experts { touched, .. } = op.kind else { unreachable!() };
            let (tiled, apart) = (m.op_ns(&op, grouped), m.op_ns(&op, OpContext::gpu()));
            assert!(near(tiled, touched * 10e3), "{tokens} tokens: {tiled} for {touched} experts");
            assert!(near(apart, touched * 40e3), "{tokens} tokens: {apart} for {touched} experts");
        }
    }

    /// Without grouped rows, grouped experts are priced per expert.
    #[test]
    fn grouped_experts_without_grouped_rows_cost_the_per_expert_rows() {
        let m = TableCostModel::new(&expert_profile(false));
        let w = Workload::single(1024, 4096, 10, 1024);
        let op = experts_op(&w, w.decode_step(0));
        let grouped = m.op_ns(&op, OpContext::gpu().with_grouped_experts(true));
        assert_eq!(grouped, m.op_ns(&op, OpContext::gpu()));
        assert!((grouped as f64 / (8.0 * 40e3) - 1.0).abs() < 0.02, "{grouped}");
    }

    #[test]
    fn quantised_ops_use_their_rows_else_a_measured_profiles_bf16_rows() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        // The committed profile without its q4_0 rows (it has measured them since 4af863c).
        let mut measured = Profile::load(&path).unwrap();
        for ops in [&mut measured.gpu.ops, &mut measured.cpu.ops] {
            ops.retain(|r| r.dtype != DType::Q4_0);
        }
        let spec = catalog::get("nemo-8b").unwrap().truncated(1).unwrap();
        let w = Workload::single(1024, 4096, 10, 1024);
        let up = |d: DType| {
            let s = spec.with_uniform_weights(d);
            let all = ops(&s, &Inventory::new(&s), &w, w.decode_step(0));
            all.into_iter().find(|o| matches!(o.kind, OpKind::MatMul { n: 11520, .. })).unwrap()
        };
        let (bf16, q4) = (up(DType::Bf16), up(DType::Q4_0));
        // No q4_0 rows: q4_0 borrows bf16's efficiency at its own (3.6× fewer) bytes.
        let m = TableCostModel::new(&measured);
        assert!(m.borrows_bf16(Device::Gpu, DType::Q4_0) && !m.borrows_bf16(Device::Gpu, DType::Bf16));
        for ctx in [OpContext::gpu(), OpContext::cpu(16)] {
            let eff = |op: &Op| m.roofline_f(op, ctx) / m.op_ns(op, ctx) as f64;
            assert!((eff(&q4) - eff(&bf16)).abs() < 0.01, "{ctx:?}: {} vs {}", eff(&q4), eff(&bf16));
            // On the GPU bf16's decode GEMV runs at 70% of the roofline, so borrowing it is not the roofline.
            assert!(ctx.device == Device::Cpu || eff(&bf16) < 0.9, "{}", eff(&bf16));
        }
        // With a q4_0 row of that shape, its own time comes back.
        let mut with_q4 = measured.clone();
        let row = OpRow {
            op: OpClass::MatMul,
            dtype: DType::Q4_0,
            n: 11520,
            k: 4096,
            tokens: 1,
            threads: 0,
            time_ns: 50_000,
            time_ns_under_dma: None,
            spread: None,
            kv_heads: None,
        };
        with_q4.gpu.ops.push(row);
        let m = TableCostModel::new(&with_q4);
        assert!(!m.borrows_bf16(Device::Gpu, DType::Q4_0) && m.borrows_bf16(Device::Cpu, DType::Q4_0));
        let t = m.op_ns(&q4, OpContext::gpu());
        assert!(t.abs_diff(50_000) < 500, "{t}");
        // A derived profile keeps the roofline for a format it has no rows of (q6_k on cli3).
        let derived = model();
        let q6 = up(DType::Q6K);
        assert!(!derived.borrows_bf16(Device::Gpu, DType::Q6K));
        assert_eq!(
            derived.op_ns(&q6, OpContext::gpu()),
            derived.roofline_f(&q6, OpContext::gpu()).ceil() as u64
        );
    }

    #[test]
    fn batched_decode_attention_takes_its_own_rows() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        let mut base = Profile::load(&path).unwrap();
        // The measured profile's own batched rows out: the test adds its own.
        let single = |r: &OpRow| !matches!(r.op, OpClass::AttentionDecode | OpClass::AttentionDecodeUnified);
        base.gpu.ops.retain(single);
        base.cpu.ops.retain(single);
        let spec = catalog::get("nemo-8b").unwrap().truncated(1).unwrap();
        let inv = Inventory::new(&spec);
        // The first decode step attends over 1024 keys per sequence.
        let w = Workload::single(1023, 1040, 8, 1024);
        let attn = |r: u64, unified: bool| {
            let wb = w.batched(r, unified);
            let all = ops(&spec, &inv, &wb, wb.decode_step(0));
            *all.iter().find(|o| matches!(o.kind, OpKind::Attention { .. })).unwrap()
        };
        let row = |op: OpClass, threads: u32, time_ns: u64| OpRow {
            op,
            dtype: DType::F16,
            n: 4096,
            k: 1024,
            tokens: 16,
            threads,
            time_ns,
            time_ns_under_dma: None,
            spread: None,
            kv_heads: None,
        };
        let t = |m: &TableCostModel, op: &Op, ctx: OpContext| m.op_ns(op, ctx) as f64;
        let old = TableCostModel::new(&base);
        let (per_seq, unified) = (attn(16, false), attn(16, true));
        // Without batched rows, the one-query attention rows; the rows added here are a quarter of that, so the
        // model must read them, not fall back.
        let fallback_ns = t(&old, &per_seq, OpContext::gpu());
        let per_seq_ns = (fallback_ns / 4.0).round();
        let mut p = base.clone();
        p.gpu.ops.push(row(OpClass::AttentionDecode, 0, per_seq_ns as u64));
        p.gpu.ops.push(row(OpClass::AttentionDecodeUnified, 0, 2_000_000));
        p.cpu.ops.push(row(OpClass::AttentionDecode, 16, 3_000_000));
        let m = TableCostModel::new(&p);
        let near = |got: f64, want: f64| (got / want - 1.0).abs() < 0.01;
        // The measured steps come back: 16 queries side by side, or a 16-fold masked scan.
        assert!(near(t(&m, &per_seq, OpContext::gpu()), per_seq_ns), "{}", t(&m, &per_seq, OpContext::gpu()));
        assert!(near(t(&m, &unified, OpContext::gpu()), 2e6), "{}", t(&m, &unified, OpContext::gpu()));
        // The CPU reads a unified cache's own cells only: per-sequence rows for both.
        for op in [per_seq, unified] {
            assert!(near(t(&m, &op, OpContext::cpu(16)), 3e6), "{}", t(&m, &op, OpContext::cpu(16)));
        }
        // One sequence keeps its one-token decode row; so does a prefill chunk its rows.
        let one = attn(1, false);
        assert_eq!(m.op_ns(&one, OpContext::gpu()), old.op_ns(&one, OpContext::gpu()));
        let prefill = *ops(&spec, &inv, &w, w.prefill_chunks()[0])
            .iter()
            .find(|o| matches!(o.kind, OpKind::Attention { .. }))
            .unwrap();
        assert_eq!(m.op_ns(&prefill, OpContext::gpu()), old.op_ns(&prefill, OpContext::gpu()));
    }

    /// On a profile without batched decode rows (cli3's), a CPU decode attention of R sequences costs R times one
    /// sequence's, flash or not, per-sequence or unified cache (each query row computes over its own sequence's
    /// cells); a prefill chunk keeps its rows.
    #[test]
    fn cpu_decode_attention_of_several_sequences_costs_each_sequence_in_full() {
        let m = model();
        let spec = catalog::get("qwen3-30b-a3b").unwrap().truncated(1).unwrap();
        let inv = Inventory::new(&spec);
        // llama-batched-bench's first decode step: 889 prompt tokens, 953 keys in the middle of its 128 steps.
        let w = Workload::single(952, 1024, 128, 1024);
        let attn = |r: u64, unified: bool, flash: bool| {
            let wb = Workload { flash_attn: flash, ..w.batched(r, unified) };
            let all = ops(&spec, &inv, &wb, wb.decode_step(0));
            *all.iter().find(|o| matches!(o.kind, OpKind::Attention { .. })).unwrap()
        };
        let cpu = OpContext::cpu(16);
        for flash in [true, false] {
            let one_ns = m.op_ns(&attn(1, false, flash), cpu);
            for r in [4u64, 16, 64] {
                for unified in [false, true] {
                    let ns = m.op_ns(&attn(r, unified, flash), cpu);
                    // One rounding per op: within R ns of R times one sequence.
                    assert!(
                        ns.abs_diff(r * one_ns) <= r,
                        "flash {flash}, {r} unified {unified}: {ns} vs {one_ns}"
                    );
                }
            }
        }
        let prefill = *ops(&spec, &inv, &w, w.prefill_chunks()[0])
            .iter()
            .find(|o| matches!(o.kind, OpKind::Attention { .. }))
            .unwrap();
        assert!(m.op_ns(&prefill, cpu) <= m.roofline_ns(&prefill, cpu) + 1, "prefill at its roofline");
    }

    /// The measured H200 profile without its attention rows, for tests that add their own.
    fn h200_without_attention() -> Profile {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        let mut p = Profile::load(&path).unwrap();
        p.gpu.ops.retain(|r| r.op != OpClass::Attention);
        p
    }

    /// A GPU attention row of 32 query heads (n = 32 × 128) over `k` keys.
    fn attention_row(k: u64, tokens: u64, time_ns: u64, kv_heads: Option<u32>) -> OpRow {
        OpRow {
            op: OpClass::Attention,
            dtype: DType::F16,
            n: 4096,
            k,
            tokens,
            threads: 0,
            time_ns,
            time_ns_under_dma: None,
            spread: None,
            kv_heads,
        }
    }

    /// The attention op of one layer of `name` in `phase` of `w`.
    fn attention_op(name: &str, w: &Workload, phase: crate::workload::Phase) -> Op {
        let spec = catalog::get(name).unwrap().truncated(1).unwrap();
        let inv = Inventory::new(&spec);
        *ops(&spec, &inv, w, phase).iter().find(|o| matches!(o.kind, OpKind::Attention { .. })).unwrap()
    }

    /// A KV head shared by 8 query heads (qwen3) is priced from rows of that grouping, not from rows where 4
    /// share one (llama): the kernel's time follows its KV bytes and how its warps share them.
    #[test]
    fn attention_takes_the_rows_of_its_head_grouping() {
        let mut p = h200_without_attention();
        p.gpu.ops.push(attention_row(4096, 1, 200_000, Some(8)));
        p.gpu.ops.push(attention_row(4096, 1, 60_000, Some(4)));
        let m = TableCostModel::new(&p);
        let w = Workload::single(4095, 4200, 8, 1024);
        let decode_attention = |name: &str| attention_op(name, &w, w.decode_step(0));
        let (llama_op, qwen3_op) = (decode_attention("llama-3.1-8b"), decode_attention("qwen3-30b-a3b"));
        let (llama, qwen3) =
            (m.op_ns(&llama_op, OpContext::gpu()) as f64, m.op_ns(&qwen3_op, OpContext::gpu()) as f64);
        assert!((llama / 200e3 - 1.0).abs() < 0.02, "32 query heads on 8 KV heads: {llama} ns");
        assert!((qwen3 / 60e3 - 1.0).abs() < 0.02, "32 query heads on 4 KV heads: {qwen3} ns");
        // Rows that do not say are taken as 4 query heads per KV head, as profiles before the field were.
        let mut unsaid = h200_without_attention();
        unsaid.gpu.ops.push(attention_row(4096, 1, 200_000, None));
        let unsaid = TableCostModel::new(&unsaid);
        assert_eq!(unsaid.op_ns(&llama_op, OpContext::gpu()), m.op_ns(&llama_op, OpContext::gpu()));
    }

    /// A prefill chunk is priced from the prefill rows even where a one-token decode row's key count is nearer.
    #[test]
    fn prefill_attention_takes_prefill_rows_over_nearer_decode_rows() {
        let mut p = h200_without_attention();
        p.gpu.ops.extend([
            attention_row(2048, 1, 35_000, Some(8)),
            attention_row(1792, 512, 2_700_000, Some(8)),
            attention_row(3840, 512, 5_800_000, Some(8)),
        ]);
        let m = TableCostModel::new(&p);
        // The third 1024-token chunk of a 4096-token prompt: 2560 keys on average, nearer 2048 than 1792.
        let w = Workload::single(4096, 4200, 8, 1024);
        let op = attention_op("llama-3.1-8b", &w, w.prefill_chunks()[2]);
        let OpKind::Attention { keys, .. } = op.kind else { unreachable!() };
        // Compute-bound: the 1792-key chunk row's time scaled by query-key pairs.
        let want = 2.7e6 * (op.tokens * keys) as f64 / (512.0 * 1792.0);
        let got = m.op_ns(&op, OpContext::gpu()) as f64;
        assert!((got / want - 1.0).abs() < 0.02, "{keys} keys × {} tokens: {got} ns, want {want}", op.tokens);
    }

    /// Between two measured key counts an op's efficiency is interpolated in log n·k, not taken from the
    /// nearer row: past the L2 the 7936-key row runs at half the rate per query-key pair.
    #[test]
    fn attention_between_measured_key_counts_interpolates_their_efficiency() {
        let mut p = h200_without_attention();
        p.gpu.ops.extend([
            attention_row(3840, 512, 4_400_000, Some(8)),
            attention_row(7936, 512, 2 * 4_400_000 * 7936 / 3840, Some(8)),
        ]);
        let m = TableCostModel::new(&p);
        // The sixth 1024-token chunk of an 8176-token prompt: 5632 keys on average, nearer 7936 in log n·k.
        let w = Workload::single(8176, 8192, 8, 1024);
        let op = attention_op("llama-3.1-8b", &w, w.prefill_chunks()[5]);
        let OpKind::Attention { keys, .. } = op.kind else { unreachable!() };
        let per_pair_ns = m.op_ns(&op, OpContext::gpu()) as f64 / (op.tokens * keys) as f64;
        let (fast, slow) = (4.4e6 / (512.0 * 3840.0), 2.0 * 4.4e6 / (512.0 * 3840.0));
        // Efficiency (∝ 1 / time per pair) moves linearly in log keys from one row's to the other's.
        let f = (keys as f64 / 3840.0).ln() / (7936.0_f64 / 3840.0).ln();
        let want = 1.0 / (1.0 / fast + f * (1.0 / slow - 1.0 / fast));
        assert!((per_pair_ns / want - 1.0).abs() < 0.02, "{keys} keys: {per_pair_ns} ns a pair, want {want}");
        assert!(per_pair_ns < 0.8 * slow, "not the nearer row's rate: {per_pair_ns} against {slow}");
    }

    #[test]
    fn copies_follow_the_link() {
        let m = model();
        let t = m.h2d_ns(1 << 30, true);
        let expect = (1u64 << 30) as f64 / 50.0 + 8_000.0;
        assert!((t as f64 - expect).abs() < 1.0, "{t}");
        assert!(m.h2d_ns(1 << 30, false) > 3 * t);
        assert_eq!(m.h2d_ns(0, true), 0);
    }

    proptest! {
        /// No prediction is ever below the roofline, whatever the op, device, threads or DMA.
        #[test]
        fn never_faster_than_the_roofline(
            name in proptest::sample::select(catalog::names()),
            tokens in 1u64..4096,
            start in 0u64..60_000,
            decode in any::<bool>(),
            gpu in any::<bool>(),
            threads in 1u32..32,
            dma in any::<bool>(),
            pick in 0usize..10_000,
        ) {
            let m = model();
            let spec = catalog::get(name).unwrap().truncated(1).unwrap();
            let inv = Inventory::new(&spec);
            let w = Workload::single(start + tokens, start + tokens + 8, 8, 4096);
            let phase = if decode {
                Phase::Decode { batch: tokens.min(64), ctx: start + 1 }
            } else {
                Phase::Prefill { tokens, start_pos: start, last: true }
            };
            let all = ops(&spec, &inv, &w, phase);
            let op = &all[pick % all.len()];
            let ctx = if gpu { OpContext::gpu() } else { OpContext::cpu(threads) }.with_dma(dma);
            prop_assert!(m.op_ns(op, ctx) >= m.roofline_ns(op, ctx));
        }
    }
}
