//! `pshard`: the paper's planner, reproduced from its artifact (`src/llama-plan-builder.cpp`,
//! `src/llama-pipeline-executor.cpp`, `src/llama-pipeline.h` of deepshnv/pipeshard-mlsys26-ae; DIGEST §1).
//!
//! # What it reproduces
//! - The five execution strategies ([`Strategy`]) and their per-layer templates ([`LayerStrategy`]): which of
//!   a layer's attention side (attention, norms, router, KV) and FFN side (FFN or all experts) is pinned in
//!   VRAM, streamed through shard slots, or on the CPU; token embedding always on the CPU; output head on the
//!   GPU only for FULL_GPU or, for MoE models, when case B below fits it.
//! - `plan_find_max_pinnable`: a binary search for the largest pinned *prefix* of layers, assuming the VRAM
//!   need grows with it; FULL_GPU and FULL_GPU_NO_OUTPUT are all or nothing.
//! - `plan_apply_phase2_progressive`: SHARD_ATTN_PRIO when not all attention fits (case A: the rest of the
//!   attention streams through one slot with its KV, every FFN on the CPU); when it all fits (case B) MoE models
//!   try the output head on the GPU, then a binary search pins whole layers, the rest keeping attention pinned
//!   with the FFN on the CPU (STATIC) or streamed (SHARD). As in the artifact, those searches accept `n = 0`
//!   without testing it.
//! - The VRAM requirement: `scratch + pinned splits + slots × largest streamed split + KV`, KV sized at the
//!   full context for pinned layers plus one per slot (capped at the whole cache), scratch measured over the
//!   GPU splits at the tier's token count with full KV and multiplied by [`Pshard::scratch_margin`] (1.5).
//! - Token tiers ([`tiers`]: {1, 512, 1024, …, ubatch}, or {1, 4, 16, 64, …} with parallel requests), the plan
//!   registry rules (single-plan mode when FULL_GPU fits the largest tier; NO_OUTPUT shortcuts; lower tiers
//!   stop at the first viable full-GPU strategy) and the ceiling tier lookup: the prefill plan is the plan of
//!   the tier of the largest chunk, the decode plan that of the tier of the batch.
//! - The strategy choice per tier by its own throughput predictor (`PipelineExecutor::predict_tps`): for the
//!   split sequence `T_i = max(C_i, P_{i+1}/B) + D_i`, with `C_i` the split's ops on its device (CPU ops at
//!   the concurrent rate while the next split prefetches), `P_{i+1}` the next streamed split's weights plus its
//!   full-context KV, `B` the peak PCIe rate (for a CPU split, × 0.9 × the CPU's concurrent/standalone rate),
//!   and `D_i` the download of a GPU split's new KV cells. Op times come from our [`CostModel`] rather than
//!   the paper's nearest-neighbour profile lookup, except the attention its lookup cannot find
//!   ([`Pshard::attention_by_exact_row`]).
//! - Flash attention on (`-pipe-shard` forces it): the plan's workload has `flash_attn = true`; and unified
//!   KV (`-kvu`, as the paper's batched runs): `kv_unified = true`.
//!
//! # Quirks behind flags
//! - [`Pshard::all_logits_at_planning`] (default on, as the artifact): plans are measured with every token of
//!   the tier producing logits, which inflates the output head's scratch and predicted time at prefill tiers.
//! - [`Pshard::scratch_margin`] (default 1.5).
//! - [`Pshard::attention_by_exact_row`] (default on, as the artifact): the predictor times flash attention
//!   from a profile row only on an exact key (full context, KV heads, tier) among the `--fast` profile's
//!   rows; any other attention (every Qwen3 layer, every 64K context, every tier above 512) is priced at its
//!   bytes over the memory bandwidth, far below what it costs on the CPU.
//! - [`Pshard::forced_strategy`]: the artifact's `-fes`.
//!
//! # How it maps onto a [`Plan`]
//! The paper's slots hold whole splits (a layer, or an attention split with its KV); a plan's ring holds one
//! unit per slot. A pshard phase plan keeps the paper's VRAM: its ring has `depth = ⌊paper slot bytes / slot⌋`
//! slots of the largest streamed unit (at least the paper's slot count), so it uses no more than the paper's
//! slots and lets as much stream ahead. Its scratch line is the paper's margined scratch. The budget is the
//! process's: the runtime overhead is taken off before the paper's arena (`-mva`) is planned, so to reproduce
//! a paper cell at `-mva B`, pass `B` plus the profile's runtime overhead.
//! Not reproduced: the remainder prefill chunk running a smaller tier's plan (one prefill plan per [`Plan`]),
//! 128-byte padding of each tensor, and the per-split scratch of the artifact's graph allocator (we use
//! [`scratch_parts`] of the kinds of GPU splits present).

use pipeshard_core::fxhash::FxHashMap;
use std::cell::RefCell;

use pipeshard_core::cost::{CostModel, OpContext};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{Placement, Plan, Prediction, VramBreakdown};
use pipeshard_core::workload::{ACT_BYTES, Op, OpKind, Phase, Workload, ops, scratch_parts};

use crate::estimate::{Estimator, Layout, OpKey, op_key};
use crate::{Decision, PlanError, Planner, assemble, check_runtime_fits};

/// The paper's execution strategies (`exec_strategy`), in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Strategy {
    /// Everything pinned, output head included.
    FullGpu,
    /// Everything pinned but the output head.
    FullGpuNoOutput,
    /// Attention first (pinned prefix), FFN on the CPU; "Static" on the poster.
    StaticAttnPrio,
    /// Attention first, then streamed attention or streamed FFN through one slot; "Dynamic".
    ShardAttnPrio,
    /// Pinned prefix of whole layers, the rest streamed whole through two slots; "GPU-only".
    FullShard,
}

impl Strategy {
    /// All strategies in the paper's order.
    pub const ALL: [Strategy; 5] = [
        Strategy::FullGpu,
        Strategy::FullGpuNoOutput,
        Strategy::StaticAttnPrio,
        Strategy::ShardAttnPrio,
        Strategy::FullShard,
    ];

    /// The artifact's name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Strategy::FullGpu => "FULL_GPU",
            Strategy::FullGpuNoOutput => "FULL_GPU_NO_OUTPUT",
            Strategy::StaticAttnPrio => "STATIC_ATTN_PRIO",
            Strategy::ShardAttnPrio => "SHARD_ATTN_PRIO",
            Strategy::FullShard => "FULL_SHARD",
        }
    }

    /// The strategy called `name` (the artifact's name, case-insensitive) or numbered `name` (`-fes`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Strategy> {
        Strategy::ALL
            .into_iter()
            .enumerate()
            .find_map(|(i, s)| (s.name().eq_ignore_ascii_case(name) || name == i.to_string()).then_some(s))
    }

    /// `STRATEGY_CONFIGS`: (base, pin, shard slots, output on the GPU).
    fn config(self) -> (LayerStrategy, LayerStrategy, u64, bool) {
        use LayerStrategy as L;
        match self {
            Strategy::FullGpu => (L::AllGpuPinned, L::AllGpuPinned, 0, true),
            Strategy::FullGpuNoOutput => (L::AllGpuPinned, L::AllGpuPinned, 0, false),
            Strategy::StaticAttnPrio => (L::AllCpu, L::AttnGpuPinned, 0, false),
            Strategy::ShardAttnPrio => (L::AllCpu, L::AttnGpuPinned, 1, false),
            Strategy::FullShard => (L::AllGpuSharded, L::AllGpuPinned, 2, false),
        }
    }
}

/// The paper's per-layer templates (`layer_strategy`). FFN_GPU_PINNED (3) and FFN_GPU_SHARDED (7) exist in the
/// artifact but no strategy produces them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerStrategy {
    /// 1: attention and FFN streamed as one split through the layer's own backend.
    AllGpuSharded,
    /// 2: attention pinned, FFN on the CPU.
    AttnGpuPinned,
    /// 4: everything on the CPU.
    AllCpu,
    /// 5: everything pinned.
    AllGpuPinned,
    /// 6: attention streamed (backend 1), FFN on the CPU.
    AttnGpuSharded,
    /// 8: attention pinned, FFN streamed.
    AttnPinnedFfnSharded,
}

/// Where a split runs: the pinned GPU backend, a streamed ("sharded") backend by id, or the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Pinned,
    Sharded(u32),
    Cpu,
}

impl LayerStrategy {
    /// (attention side, FFN side) backends of layer `l`.
    fn backends(self, l: u32) -> (Backend, Backend) {
        use Backend::{Cpu, Pinned, Sharded};
        match self {
            LayerStrategy::AllGpuSharded => (Sharded(l + 1), Sharded(l + 1)),
            LayerStrategy::AttnGpuPinned => (Pinned, Cpu),
            LayerStrategy::AllCpu => (Cpu, Cpu),
            LayerStrategy::AllGpuPinned => (Pinned, Pinned),
            LayerStrategy::AttnGpuSharded => (Sharded(1), Cpu),
            LayerStrategy::AttnPinnedFfnSharded => (Pinned, Sharded(l + 1)),
        }
    }

    /// Whether the artifact counts the layer's KV as pinned (`n_pinned_layers`).
    fn kv_pinned(self) -> bool {
        matches!(
            self,
            LayerStrategy::AllGpuPinned | LayerStrategy::AttnGpuPinned | LayerStrategy::AttnPinnedFfnSharded
        )
    }
}

/// The paper's planner (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pshard {
    /// Build only this strategy for every tier (the artifact's `-fes`); `None` chooses by predicted TPS.
    pub forced_strategy: Option<Strategy>,
    /// Factor on measured scratch (`SCRATCH_MARGIN`).
    pub scratch_margin: f64,
    /// Plan every token of a tier as producing logits (the artifact sets `n_outputs = n_tokens` when planning).
    pub all_logits_at_planning: bool,
    /// Price flash attention as the artifact's predictor does (`BenchmarkPredictor::predict`,
    /// `src/llama-benchmark.cpp`): its only lookup is the exact key `FLASH_ATTN|ctx|kv_heads|tier`, the
    /// nearest-row search never matches an attention row (it compares the literal `FLASH_ATTN` with rows
    /// named `FLASH_ATTN_<arch>`), and a miss falls back to bytes over the memory bandwidth (the GPU's, or
    /// the host DRAM's, under DMA while the next split prefetches). `ctx` is the attention's key count in the
    /// planning graph (`init_full`): the whole cache, every sequence's cells of the unified cache pshard
    /// plans for. The `--fast` profiles the artifact's scripts measure ([`FAST_ATTENTION_CTX`],
    /// [`FAST_ATTENTION_KV_HEADS`], [`FAST_ATTENTION_TOKENS`]) leave a 64K context, a Qwen3 layer's 4 KV
    /// heads and the 1024/2048 prefill tiers to the fallback. A hit is priced by our cost model, standing in
    /// for the measured row.
    pub attention_by_exact_row: bool,
}

/// Contexts of the `--fast` profile's flash-attention rows (`examples/microbench/concurrent_profiler.cpp`).
pub const FAST_ATTENTION_CTX: [u64; 3] = [1024, 4096, 16384];
/// KV heads of the `--fast` profile's flash-attention rows (MHA, GQA-8 and MQA of 32 query heads).
pub const FAST_ATTENTION_KV_HEADS: [u32; 3] = [32, 8, 1];
/// Token counts (the profilers' batch sizes) of every profile row.
pub const FAST_ATTENTION_TOKENS: [u64; 3] = [1, 64, 512];

impl Default for Pshard {
    fn default() -> Self {
        Pshard {
            forced_strategy: None,
            scratch_margin: 1.5,
            all_logits_at_planning: true,
            attention_by_exact_row: true,
        }
    }
}

/// The token tiers of `batch_tier_config::init` for `n_ubatch` and `n_parallel` sequences.
#[must_use]
pub fn tiers(n_ubatch: u64, n_parallel: u64) -> Vec<u64> {
    let mut v = Vec::new();
    if n_parallel <= 1 {
        v.push(1);
    } else {
        let mut t = 1;
        while t <= 64 {
            v.push(t);
            t *= 4;
        }
    }
    let mut t = 512;
    while t < n_ubatch {
        if v.last().is_none_or(|&last| last < t) {
            v.push(t);
        }
        t *= 2;
    }
    if v.last() != Some(&n_ubatch) {
        v.push(n_ubatch);
    }
    v
}

/// The ceiling tier of `n_tokens` (the last tier when none is large enough).
#[must_use]
pub fn tier_of(tiers: &[u64], n_tokens: u64) -> u64 {
    tiers.iter().copied().find(|&t| n_tokens <= t).unwrap_or(*tiers.last().expect("tiers are never empty"))
}

/// One built plan of a (tier, strategy).
#[derive(Debug, Clone)]
struct Built {
    strategy: Strategy,
    tier: u64,
    layers: Vec<LayerStrategy>,
    output_gpu: bool,
    /// The artifact's `total_vram_req`.
    total_bytes: u64,
    /// Margined scratch.
    scratch_bytes: u64,
    /// Bytes of the paper's shard slots, weights and KV (`sharded_weights_vram_req` + KV slots).
    ring_bytes: u64,
    viable: bool,
    /// Predicted time of one tier-sized step.
    step_ns: f64,
}

/// The pieces the paper's accounting needs, per model, workload and machine.
struct Paper<'a> {
    cfg: Pshard,
    spec: &'a ModelSpec,
    inv: &'a Inventory,
    w: Workload,
    cost: &'a dyn CostModel,
    est: &'a Estimator,
    arena: u64,
    n_layers: u32,
    attn_bytes: Vec<u64>,
    ffn_bytes: Vec<u64>,
    output_bytes: u64,
    kv_layer: u64,
    total_kv: u64,
    ops_memo: RefCell<FxHashMap<u64, Vec<Op>>>,
    times_memo: RefCell<FxHashMap<OpKey, (f64, f64, f64)>>,
}

/// The split of an op: token embedding, a layer's attention or FFN side, or the output head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Embed,
    Attn(u32),
    Ffn(u32),
    Output,
}

fn side_of(op: &Op) -> Side {
    match op.unit {
        UnitId::TokenEmbd if matches!(op.kind, OpKind::Embed) => Side::Embed,
        UnitId::Router { layer } if matches!(op.kind, OpKind::Experts { .. } | OpKind::Add) => {
            Side::Ffn(layer)
        }
        UnitId::Attn { layer } | UnitId::Kv { layer } | UnitId::Router { layer } => Side::Attn(layer),
        UnitId::Ffn { layer } | UnitId::Expert { layer, .. } | UnitId::SharedExperts { layer } => {
            Side::Ffn(layer)
        }
        _ => Side::Output,
    }
}

impl Paper<'_> {
    /// Segments in execution order: embedding, (attention, FFN) per layer, output.
    fn backends(layers: &[LayerStrategy], output_gpu: bool) -> Vec<Backend> {
        let mut v = vec![Backend::Cpu];
        for (l, s) in layers.iter().enumerate() {
            let (a, f) = s.backends(l as u32);
            v.push(a);
            v.push(f);
        }
        v.push(if output_gpu { Backend::Pinned } else { Backend::Cpu });
        v
    }

    fn segment_bytes(&self, seg: usize) -> u64 {
        if seg == 0 {
            0
        } else if seg == 2 * self.n_layers as usize + 1 {
            self.output_bytes
        } else if seg % 2 == 1 {
            self.attn_bytes[(seg - 1) / 2]
        } else {
            self.ffn_bytes[(seg - 1) / 2]
        }
    }

    /// Splits: merged runs of equal backends, as (backend, weight bytes, KV layers, first segment, end segment).
    fn splits(&self, layers: &[LayerStrategy], output_gpu: bool) -> Vec<(Backend, u64, u64, usize, usize)> {
        let b = Self::backends(layers, output_gpu);
        let mut out: Vec<(Backend, u64, u64, usize, usize)> = Vec::new();
        for (seg, &backend) in b.iter().enumerate() {
            let kv = u64::from(seg % 2 == 1 && seg < b.len() - 1);
            match out.last_mut() {
                Some(last) if last.0 == backend => {
                    last.1 += self.segment_bytes(seg);
                    last.2 += kv;
                    last.4 = seg + 1;
                }
                _ => out.push((backend, self.segment_bytes(seg), kv, seg, seg + 1)),
            }
        }
        out
    }

    /// Margined scratch of the GPU splits at `tier` tokens over the full KV.
    fn scratch(&self, tier: u64, layers: &[LayerStrategy], output_gpu: bool) -> u64 {
        let b = Self::backends(layers, output_gpu);
        let on_gpu = |x: &Backend| *x != Backend::Cpu;
        let attn_gpu = b.iter().skip(1).step_by(2).take(layers.len()).any(on_gpu);
        let ffn_gpu = b.iter().skip(2).step_by(2).take(layers.len()).any(on_gpu);
        if !(attn_gpu || ffn_gpu || output_gpu) {
            return 0;
        }
        let tokens = tier.min(self.w.ctx);
        let p = scratch_parts(
            self.spec,
            &self.w,
            Phase::Prefill { tokens, start_pos: self.w.ctx - tokens, last: false },
        );
        let rows = if self.cfg.all_logits_at_planning { tokens } else { 1 };
        let logits =
            if output_gpu { (rows as f64 * self.spec.text.vocab as f64 * ACT_BYTES) as u64 } else { 0 };
        let work = (if attn_gpu { p.attention_bytes } else { 0 }).max(if ffn_gpu { p.ffn_bytes } else { 0 });
        let raw = (p.residual_bytes + work + logits) as f64 * self.cfg.scratch_margin;
        (raw.ceil() as u64).div_ceil(128) * 128
    }

    /// (scratch, pinned bytes, largest streamed split) of a configuration.
    fn measure(&self, tier: u64, layers: &[LayerStrategy], output_gpu: bool) -> (u64, u64, u64) {
        let mut pinned = 0;
        let mut sharded = 0;
        for (backend, bytes, ..) in self.splits(layers, output_gpu) {
            match backend {
                Backend::Pinned => pinned += bytes,
                Backend::Sharded(_) => sharded = sharded.max(bytes),
                Backend::Cpu => {}
            }
        }
        (self.scratch(tier, layers, output_gpu), pinned, sharded)
    }

    /// `plan_measure_total`.
    fn measure_total(&self, tier: u64, layers: &[LayerStrategy], output_gpu: bool, slots: u64) -> u64 {
        let (scratch, pinned, sharded) = self.measure(tier, layers, output_gpu);
        let n_pinned = layers.iter().filter(|s| s.kv_pinned()).count() as u64;
        scratch + pinned + slots * sharded + ((n_pinned + slots) * self.kv_layer).min(self.total_kv)
    }

    fn prefix(&self, n: u32, pin: LayerStrategy, rest: LayerStrategy) -> Vec<LayerStrategy> {
        (0..self.n_layers).map(|l| if l < n { pin } else { rest }).collect()
    }

    /// `plan_find_max_pinnable`: (layers, n pinned).
    fn find_max_pinnable(
        &self,
        tier: u64,
        base: LayerStrategy,
        pin: LayerStrategy,
        slots: u64,
        output_gpu: bool,
    ) -> (Vec<LayerStrategy>, u32) {
        let l = self.n_layers;
        if base == pin {
            let layers = vec![pin; l as usize];
            let (scratch, pinned, _) = self.measure(tier, &layers, output_gpu);
            let kv = (u64::from(l) * self.kv_layer).min(self.total_kv);
            let n = if scratch + pinned + kv <= self.arena { l } else { 0 };
            return (layers, n);
        }
        let (mut lo, mut hi, mut result) = (0i64, i64::from(l), 0u32);
        while lo <= hi {
            let mid = i64::midpoint(lo, hi) as u32;
            let layers = self.prefix(mid, pin, base);
            let (scratch, pinned, sharded) = self.measure(tier, &layers, output_gpu);
            let kv = ((u64::from(mid) + slots) * self.kv_layer).min(self.total_kv);
            if scratch + pinned + slots * sharded + kv <= self.arena {
                result = mid;
                lo = i64::from(mid) + 1;
            } else {
                hi = i64::from(mid) - 1;
            }
        }
        (self.prefix(result, pin, base), result)
    }

    /// A binary search over `n` that, like the artifact, accepts `n = 0` untested.
    fn search_prefix(&self, fits: impl Fn(u32) -> bool) -> u32 {
        let (mut lo, mut hi, mut best) = (0i64, i64::from(self.n_layers), 0u32);
        while lo <= hi {
            let mid = lo + (hi - lo) / 2;
            if mid == 0 || fits(mid as u32) {
                best = mid as u32;
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        best
    }

    /// `plan_build_for_batch` for one tier and strategy.
    fn build(&self, tier: u64, strategy: Strategy) -> Built {
        use LayerStrategy as L;
        let (base, pin, slots, mut output_gpu) = strategy.config();
        let (mut layers, n_pinned) = self.find_max_pinnable(tier, base, pin, slots, output_gpu);
        let n = self.n_layers;
        match strategy {
            Strategy::ShardAttnPrio if n_pinned < n => {
                // Case A: `plan_shard_remaining_with_recalc`.
                let all_sharded = vec![L::AttnGpuSharded; n as usize];
                let (_, _, max_shard) = self.measure(tier, &all_sharded, output_gpu);
                let adjusted = self.arena.saturating_sub(max_shard + self.kv_layer);
                let k = self.search_prefix(|k| {
                    let layers = self.prefix(k, L::AttnGpuPinned, L::AttnGpuSharded);
                    let (scratch, pinned, _) = self.measure(tier, &layers, output_gpu);
                    scratch + pinned + u64::from(k) * self.kv_layer <= adjusted
                });
                layers = self.prefix(k, L::AttnGpuPinned, L::AttnGpuSharded);
            }
            Strategy::StaticAttnPrio | Strategy::ShardAttnPrio if n_pinned == n => {
                // Case B.
                if self.spec.is_moe() && self.measure_total(tier, &layers, true, slots) <= self.arena {
                    output_gpu = true;
                }
                let rest = if strategy == Strategy::ShardAttnPrio {
                    L::AttnPinnedFfnSharded
                } else {
                    L::AttnGpuPinned
                };
                let all_rest = vec![rest; n as usize];
                if strategy == Strategy::ShardAttnPrio
                    && self.measure_total(tier, &all_rest, output_gpu, slots) > self.arena
                {
                    layers = all_rest;
                } else {
                    let k = self.search_prefix(|k| {
                        self.measure_total(tier, &self.prefix(k, L::AllGpuPinned, rest), output_gpu, slots)
                            <= self.arena
                    });
                    layers = self.prefix(k, L::AllGpuPinned, rest);
                }
            }
            Strategy::FullShard if n_pinned < n => {
                layers = self.prefix(n_pinned, L::AllGpuPinned, L::AllGpuSharded);
            }
            _ => {}
        }
        self.finalize(tier, strategy, layers, output_gpu, slots)
    }

    /// `plan_finalize`: the requirement, viability and predicted step time.
    fn finalize(
        &self,
        tier: u64,
        strategy: Strategy,
        layers: Vec<LayerStrategy>,
        output_gpu: bool,
        slots: u64,
    ) -> Built {
        let (scratch, pinned, sharded) = self.measure(tier, &layers, output_gpu);
        let ring_weights = slots * sharded;
        let n_pinned = layers.iter().filter(|s| s.kv_pinned()).count() as u64;
        let kv_layers = n_pinned + if ring_weights > 0 { slots } else { 0 };
        let kv = (kv_layers * self.kv_layer).min(self.total_kv);
        let total = pinned + ring_weights + scratch + kv;
        let viable = total <= self.arena;
        let step_ns = self.predict_ns(&self.tier_ops(tier), tier, &layers, output_gpu);
        Built {
            strategy,
            tier,
            ring_bytes: ring_weights + kv.saturating_sub(n_pinned * self.kv_layer),
            layers,
            output_gpu,
            total_bytes: total,
            scratch_bytes: scratch,
            viable,
            step_ns,
        }
    }

    /// The ops of a tier-sized step as the artifact plans it (full KV; all rows producing logits if the quirk
    /// is on).
    fn tier_ops(&self, tier: u64) -> Vec<Op> {
        if let Some(v) = self.ops_memo.borrow().get(&tier) {
            return v.clone();
        }
        let tokens = tier.min(self.w.ctx);
        let phase = Phase::Prefill { tokens, start_pos: self.w.ctx - tokens, last: true };
        let mut v = ops(self.spec, self.inv, &self.w, phase);
        if self.cfg.all_logits_at_planning {
            let rows = tokens as f64;
            for op in v.iter_mut().filter(|o| side_of(o) == Side::Output) {
                op.tokens = tokens;
                op.flops *= rows;
                op.act_bytes *= rows;
            }
        }
        self.ops_memo.borrow_mut().insert(tier, v.clone());
        v
    }

    /// (GPU, CPU alone, CPU under DMA) time of an op, memoised: most ops repeat in every layer and plan.
    fn op_times(&self, op: &Op) -> (f64, f64, f64) {
        let key = op_key(op);
        if let Some(&t) = self.times_memo.borrow().get(&key) {
            return t;
        }
        let threads = self.est.cpu_threads;
        let (gpu, cpu, cpu_dma) =
            (OpContext::gpu(), OpContext::cpu(threads), OpContext::cpu(threads).with_dma(true));
        let t = if self.attention_by_bandwidth(op) {
            // The roofline of its bytes alone: bytes over the memory bandwidth.
            let bytes_only = Op { flops: 0.0, ..*op };
            let at = |ctx| self.cost.roofline_ns(&bytes_only, ctx) as f64;
            (at(gpu), at(cpu), at(cpu_dma))
        } else {
            let at = |ctx| self.cost.op_ns(op, ctx) as f64;
            (at(gpu), at(cpu), at(cpu_dma))
        };
        self.times_memo.borrow_mut().insert(key, t);
        t
    }

    /// Whether the artifact's predictor prices attention `op` by bandwidth: the quirk
    /// ([`Pshard::attention_by_exact_row`]) is on and the profile has no row of its exact key.
    fn attention_by_bandwidth(&self, op: &Op) -> bool {
        let OpKind::Attention { kv_heads, .. } = op.kind else { return false };
        // The planning graph's attention reads the whole unified cache: every sequence's cells.
        let cache_cells = self.w.ctx * self.w.batch;
        self.cfg.attention_by_exact_row
            && !(FAST_ATTENTION_CTX.contains(&cache_cells)
                && FAST_ATTENTION_KV_HEADS.contains(&kv_heads)
                && FAST_ATTENTION_TOKENS.contains(&op.tokens))
    }

    /// `PipelineExecutor::predict_tps` as a step time: Σ_i max(C_i, P_{i+1}/B) + D_i, for a step of `tokens`
    /// tokens running `step_ops`.
    fn predict_ns(&self, step_ops: &[Op], tokens: u64, layers: &[LayerStrategy], output_gpu: bool) -> f64 {
        let splits = self.splits(layers, output_gpu);
        let mut split_of_segment = vec![0usize; 2 * layers.len() + 2];
        for (i, s) in splits.iter().enumerate() {
            split_of_segment[s.3..s.4].fill(i);
        }
        let seg = |side: Side| match side {
            Side::Embed => 0,
            Side::Attn(l) => 2 * l as usize + 1,
            Side::Ffn(l) => 2 * l as usize + 2,
            Side::Output => 2 * layers.len() + 1,
        };
        // Per split: GPU time, CPU time alone, CPU time under DMA.
        let mut times = vec![(0.0, 0.0, 0.0); splits.len()];
        for op in step_ops {
            let i = split_of_segment[seg(side_of(op))];
            let (gpu, alone, dma) = self.op_times(op);
            let t = &mut times[i];
            if splits[i].0 == Backend::Cpu {
                t.1 += alone;
                t.2 += dma;
            } else {
                t.0 += gpu;
            }
        }
        let peak = (1.0 / self.est.h2d_ns_per_byte).min(self.est.dram_bytes_per_ns);
        let kv_cell = self.kv_layer as f64 / self.w.ctx as f64;
        let mut total = 0.0;
        for (i, s) in splits.iter().enumerate() {
            let prefetch = match splits.get(i + 1) {
                Some((Backend::Sharded(_), bytes, kv, ..)) => {
                    *bytes as f64 + *kv as f64 * self.kv_layer as f64
                }
                _ => 0.0,
            };
            let (gpu, alone, dma) = times[i];
            let (compute, bw) = if s.0 == Backend::Cpu {
                let c = if prefetch > 0.0 { dma } else { alone };
                let eff = if dma > 0.0 { alone / dma } else { 1.0 };
                (c, peak * 0.9 * eff)
            } else {
                (gpu, peak)
            };
            let download = if s.0 == Backend::Cpu { 0.0 } else { s.2 as f64 * kv_cell * tokens as f64 / bw };
            total += compute.max(prefetch / bw) + download;
        }
        total
    }

    /// `populate_plan_registry` + `select_best_strategy` for the tiers a workload needs.
    fn choose(&self, tiers: &[u64], wanted: &[u64]) -> Result<Vec<Built>, Strategy> {
        let max_tier = *tiers.last().expect("tiers are never empty");
        let best = |built: Vec<Built>| -> Option<Built> {
            // Highest predicted TPS (all plans of a tier run the same tokens); the first wins ties.
            built.into_iter().filter(|b| b.viable).min_by(|a, b| a.step_ns.total_cmp(&b.step_ns))
        };
        let full = self.build(max_tier, Strategy::FullGpu);
        if full.viable {
            return Ok(wanted.iter().map(|_| full.clone()).collect());
        }
        if let Some(forced) = self.cfg.forced_strategy {
            return wanted
                .iter()
                .map(|&t| Some(self.build(t, forced)).filter(|b| b.viable).ok_or(forced))
                .collect();
        }
        let no_output = self.build(max_tier, Strategy::FullGpuNoOutput);
        let mut out = Vec::new();
        for &t in wanted {
            let chosen = if no_output.viable {
                let full_t = self.build(t, Strategy::FullGpu);
                if t != max_tier && full_t.viable { full_t } else { no_output.clone() }
            } else if t == max_tier {
                let built = [Strategy::StaticAttnPrio, Strategy::ShardAttnPrio, Strategy::FullShard]
                    .into_iter()
                    .map(|s| self.build(t, s))
                    .collect();
                best(built).ok_or(Strategy::StaticAttnPrio)?
            } else {
                let mut built = Vec::new();
                for s in Strategy::ALL {
                    let b = self.build(t, s);
                    let stop = b.viable && matches!(s, Strategy::FullGpu | Strategy::FullGpuNoOutput);
                    built.push(b);
                    if stop {
                        break;
                    }
                }
                best(built).ok_or(Strategy::StaticAttnPrio)?
            };
            out.push(chosen);
        }
        Ok(out)
    }

    /// Our layout of a built plan (ring depth mapped as the module docs say).
    fn layout(&self, b: &Built) -> Layout {
        let st = &self.est.structure;
        let mut layout = Layout::all_cpu(st, self.est.unit_bytes.len());
        for (l, (lu, s)) in st.layers.iter().zip(&b.layers).enumerate() {
            let place = |backend: Backend| match backend {
                Backend::Pinned => Placement::Pinned,
                Backend::Sharded(_) => Placement::Streamed,
                Backend::Cpu => Placement::Cpu,
            };
            let (a, f) = s.backends(l as u32);
            let (a, f) = (place(a), place(f));
            for pos in [Some(lu.attn), Some(lu.kv), lu.router].into_iter().flatten() {
                layout.placements[pos] = a;
            }
            for pos in [lu.ffn, lu.shared_experts].into_iter().flatten() {
                layout.placements[pos] = f;
            }
            let e = lu.experts.len() as u32;
            layout.experts[l] = match f {
                Placement::Pinned => [e, 0, 0],
                Placement::Streamed => [0, e, 0],
                Placement::Cpu => [0, 0, e],
            };
        }
        if b.output_gpu {
            layout.placements[st.output] = Placement::Pinned;
            if st.tied_embeddings {
                layout.placements[st.token_embd] = Placement::Pinned;
            }
        }
        let slot = self.est.slot_bytes(&layout);
        layout.depth = b.ring_bytes.checked_div(slot).map_or(0, |d| (d as u32).max(1));
        layout
    }
}

impl Pshard {
    fn paper<'a>(
        &self,
        spec: &'a ModelSpec,
        inv: &'a Inventory,
        w: Workload,
        cost: &'a dyn CostModel,
        est: &'a Estimator,
        budget: u64,
    ) -> Paper<'a> {
        let st = &est.structure;
        let side = |units: &[Option<usize>], experts: &[usize]| -> u64 {
            units.iter().flatten().map(|&u| est.unit_bytes[u]).sum::<u64>()
                + experts.iter().map(|&u| est.unit_bytes[u]).sum::<u64>()
        };
        let attn_bytes = st.layers.iter().map(|l| side(&[Some(l.attn), l.router], &[])).collect();
        let ffn_bytes = st.layers.iter().map(|l| side(&[l.ffn, l.shared_experts], &l.experts)).collect();
        let mut output_bytes = est.unit_bytes[st.output];
        if st.tied_embeddings {
            output_bytes += est.unit_bytes[st.token_embd];
        }
        Paper {
            cfg: *self,
            spec,
            inv,
            w,
            cost,
            est,
            arena: budget - est.runtime_overhead_bytes,
            n_layers: spec.text.n_layers,
            attn_bytes,
            ffn_bytes,
            output_bytes,
            kv_layer: est.kv_layer_bytes,
            total_kv: est.kv_layer_bytes * u64::from(spec.text.n_layers),
            ops_memo: RefCell::new(FxHashMap::default()),
            times_memo: RefCell::new(FxHashMap::default()),
        }
    }
}

impl Planner for Pshard {
    fn name(&self) -> &'static str {
        "pshard"
    }

    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        match self.plan_or_unfit(spec, workload, cost, budget_bytes)? {
            Ok(plan) => Ok(plan),
            Err(strategy) => Err(self.min_budget_error(spec, workload, cost, budget_bytes, strategy)),
        }
    }
}

impl Pshard {
    /// The plan, or the forced strategy that is not viable at this budget.
    fn plan_or_unfit(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Result<Plan, Strategy>, PlanError> {
        workload.validate()?;
        let w = Workload { flash_attn: true, kv_unified: true, ..*workload };
        let inv = Inventory::shared(spec);
        let est = Estimator::new(spec, &inv, &w, cost);
        check_runtime_fits(budget_bytes, est.runtime_overhead_bytes)?;
        let tiers = tiers(w.ubatch, w.batch);
        let chunks = w.prefill_chunks();
        let prefill_tier = tier_of(&tiers, chunks.iter().map(|c| c.tokens()).max().unwrap_or(1));
        let decode_tier = tier_of(&tiers, w.batch);
        let paper = self.paper(spec, &inv, w, cost, &est, budget_bytes);
        let chosen = match paper.choose(&tiers, &[prefill_tier, decode_tier]) {
            Ok(c) => c,
            Err(strategy) => return Ok(Err(strategy)),
        };
        let (pre, dec) = (&chosen[0], &chosen[1]);
        let pre_layout = paper.layout(pre);
        let dec_layout = paper.layout(dec);
        let vram = |b: &Built, l: &Layout| VramBreakdown {
            scratch_bytes: b.scratch_bytes,
            ..est.vram_with_scratch(l, 0)
        };
        // The paper's formula applied to the steps that run (planning used tier-sized steps with every row
        // producing logits): full chunks at the middle of the prompt, the last chunk, a mid-generation step.
        let step = |phase: Phase, b: &Built| {
            paper.predict_ns(&ops(spec, &inv, &w, phase), phase.tokens(), &b.layers, b.output_gpu)
        };
        let lasts = chunks.iter().filter(|c| matches!(c, Phase::Prefill { last: true, .. })).count() as u64;
        let full = chunks.len() as u64 - lasts;
        let mut ttft = lasts as f64 * step(*chunks.last().expect("a prompt has a chunk"), pre);
        if full > 0 {
            let ubatch = w.ubatch.min(w.prompt_tokens);
            let middle = Phase::Prefill { tokens: ubatch, start_pos: (full / 2) * ubatch, last: false };
            ttft += full as f64 * step(middle, pre);
        }
        let decode_step = step(w.decode_step(w.gen_tokens / 2), dec);
        let prediction = Prediction {
            ttft_ns: ttft.round() as u64,
            decode_step_ns: decode_step.round() as u64,
            e2el_ns: (ttft + w.gen_tokens as f64 * decode_step).round() as u64,
        };
        let describe = |phase: &str, b: &Built| {
            let pinned = b.layers.iter().filter(|s| **s == LayerStrategy::AllGpuPinned).count();
            let attn = b.layers.iter().filter(|s| s.kv_pinned()).count();
            format!(
                "{phase}: {} at tier {} ({} whole layers and {} attention blocks pinned{}; paper requirement {} of {} bytes; predicted {:.1} tokens/s at the tier)",
                b.strategy.name(),
                b.tier,
                pinned,
                attn,
                if b.output_gpu { ", output head pinned" } else { "" },
                b.total_bytes,
                paper.arena,
                b.tier as f64 * 1e9 / b.step_ns.max(1.0),
            )
        };
        let notes = vec![describe("prefill", pre), describe("decode", dec)];
        Ok(Ok(assemble(
            self.name(),
            spec,
            &inv,
            &est,
            &w,
            budget_bytes,
            Decision {
                prefill_vram: vram(pre, &pre_layout),
                decode_vram: vram(dec, &dec_layout),
                prefill: pre_layout,
                decode: dec_layout,
                prefill_op_offload: false,
                decode_op_offload: false,
                prediction,
                notes,
            },
        )))
    }

    /// The error for a forced strategy that does not fit: bisects the budget for the smallest one where it is
    /// viable at every tier the workload needs.
    fn min_budget_error(
        &self,
        spec: &ModelSpec,
        w: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
        strategy: Strategy,
    ) -> PlanError {
        let fits = |b: u64| self.plan_or_unfit(spec, w, cost, b).ok().and_then(Result::ok);
        let mut lo = budget_bytes;
        let mut hi = budget_bytes.max(1 << 30);
        let mut found = None;
        while found.is_none() {
            match fits(hi) {
                Some(p) => found = Some((hi, p)),
                None if hi > u64::MAX / 4 => {
                    return PlanError::Unsupported {
                        planner: self.name().into(),
                        reason: format!(
                            "strategy {} is not viable for {} at any budget",
                            strategy.name(),
                            spec.name
                        ),
                    };
                }
                None => {
                    lo = hi;
                    hi *= 2;
                }
            }
        }
        let (mut hi, mut plan) = found.expect("found above");
        while hi - lo > 1 << 20 {
            let mid = lo + (hi - lo) / 2;
            match fits(mid) {
                Some(p) => {
                    hi = mid;
                    plan = p;
                }
                None => lo = mid,
            }
        }
        let min = if plan.prefill.vram.total() >= plan.decode.vram.total() {
            plan.prefill.vram
        } else {
            plan.decode.vram
        };
        PlanError::Infeasible { budget_bytes, min_budget_bytes: hi, min }
    }
}
