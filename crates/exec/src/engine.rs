//! Running a plan: prefill in ubatch chunks, a switch to the decode plan, greedy decode steps; metrics and a
//! Chrome trace from CUDA events and host timers.
//!
//! The GPU side enqueues everything asynchronously and orders its three streams with events only:
//! - the streaming ring: item `i` of the ring sequence goes to slot `i mod depth`; its copy (H2D stream) waits
//!   for the event that released item `i − depth`, and its consumer (compute stream) waits for the copy. The
//!   host issues copies as soon as the slot's release has been recorded, also into the next decode step, so
//!   the copy of unit `i + depth` runs while unit `i` computes;
//! - a streamed KV cache comes in with the rows already filled and goes back (D2H stream) with the new rows;
//!   its slot is released on the D2H stream after the write-back, and the next upload of that layer waits for
//!   it;
//! - the host waits only where data crosses: before a CPU unit that needs GPU output (residual stream D2H),
//!   for the sampled token, and at the end of a prefill chunk (the host reuses its staging buffers).
//!
//! VRAM: after the context, cuBLAS (with its workspace) and the kernels are up and the GEMM shapes are warmed,
//! the process's VRAM is measured (device total − free) as the runtime overhead; one arena of
//! `budget − overhead − LAZY_LOAD_RESERVE_BYTES` is allocated and carved per phase (see `layout`); device free
//! memory is sampled after every pass, and a measured peak above the budget is an error.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipeshard_core::inventory::UnitId;
use pipeshard_core::metrics::{Metrics, Resource};
use pipeshard_core::model::FfnKind;
use pipeshard_core::plan::{PhaseKind, PhasePlan, Placement, Plan, RING_ISSUE_AHEAD, VramBreakdown};
use pipeshard_core::trace::Trace;
use pipeshard_core::workload::GROUPED_EXPERTS_MAX_TOKENS;
use serde::{Deserialize, Serialize};

use crate::cpu::{self, CpuPool, KvLayout, Routing};
use crate::cuda::{
    DevBuf, EarlyStart, Event, ExpertIo, GemvInput, GemvOutput, Gpu, GroupedIo, HostFlag, HostRegistration,
    InlineParts, KernelKey, Kernels, MappedParts, RingSlot, Stream, TiledIo, decode_gemv_fits,
    grouped_experts_fit, tiled, tiled_experts_fit,
};
use crate::error::{ExecError, Result};
use crate::host::{Elem, HostBuf};
use crate::layout::{Arena, KvLoc, PhaseLayout, RingItem, ScratchLayout, Step, WeightLoc, layout_plan};
use crate::quant::EXACT_MAX_TOKENS;
use crate::seqs::{GpuKeys, Pass, SeqKv};
use crate::weights::{Dims, ExpertOffsets, ModelWeights, MoeDims, UnitKind};

/// VRAM kept out of the arena for what the driver and cuBLAS load lazily during the run (kernel code the
/// warm-up did not reach). Measured on the H200 (validation run12, 92 cells, dense and MoE, bf16 and q4_0, with
/// expert GEMMs padded to warmed token counts): the process grew 8.8–16.8 MiB past its arena and measured
/// overhead. The reserve is twice the largest growth seen; a run whose measured peak passes the budget still
/// fails loudly. (Before the expert GEMM padding, a MoE run needed 64 + 128 MiB.)
pub const LAZY_LOAD_RESERVE_BYTES: u64 = 32 << 20;

/// How much more runtime overhead the executor may find than was measured for planning in the same process:
/// validation run35 refused a plan that left 139 KB of its 4 GiB budget free, the executor's measurement having
/// come out 416 KB above the planning one. [`runtime_overhead_bytes`] adds one 2 MiB device page of it, so a
/// plan keeps that much apart; the executor's own check is unchanged.
pub const OVERHEAD_SPREAD_BYTES: u64 = 2 << 20;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Prompt token ids (of the first sequence).
    pub prompt: Vec<u32>,
    /// With a workload of R > 1 parallel requests, the prompts of sequences 2..R, each as long as `prompt`;
    /// empty: every sequence gets `prompt`.
    pub other_prompts: Vec<Vec<u32>>,
    /// Decode steps after the prompt (each produces one more token).
    pub gen_tokens: usize,
    /// Tokens to feed to the decode steps instead of the sampled ones (teacher forcing, for comparisons), the
    /// same for every sequence.
    pub force_tokens: Option<Vec<u32>>,
    /// Keep the logits of every produced token.
    pub keep_logits: bool,
    /// Host bytes of weights the run may page-lock (`None`: all of them). Units past the limit, and any whose
    /// page-locking the driver refuses, stay pageable: they still run, with slower copies, and
    /// [`RunOutput::warnings`] says how many bytes were left pageable and why.
    pub pinned_limit_bytes: Option<u64>,
    /// Checked before every forward pass: once set (by a Ctrl-C handler), the run stops with
    /// [`ExecError::Interrupted`] and releases its device and page-locked memory on the way out.
    pub interrupt: Option<&'static AtomicBool>,
    /// Whether decode steps queue the GPU work after a MoE layer's CPU experts while those run ([`PreEnqueue`]).
    pub pre_enqueue: PreEnqueue,
    /// Whether a MoE layer's pinned GPU experts run grouped (steps of at most `EXACT_MAX_TOKENS` tokens) or
    /// tiled (larger steps), or each on its own ([`GroupedExperts`]).
    pub grouped_experts: GroupedExperts,
    /// Whether every unit's kernels are timed on the device ([`UnitSpans`]).
    pub unit_spans: UnitSpans,
}

/// Timed spans around each unit's kernels on the compute stream: the measured trace's GPU compute track and
/// [`RunOutput`]'s GPU busy time. Each span records two timing events, and each event makes the stream drain
/// before the next kernel starts: on the H200 a pair cost ~3.2 µs of device time around a decode GEMV
/// (results/exec/bounds/run10, decode-kernels.md), ~4 % of an all-pinned nemo-8b decode step. Copies keep their
/// spans either way (they run on the copy streams).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UnitSpans {
    /// Timed: the trace shows every unit.
    #[default]
    On,
    /// Not recorded: the trace's compute track and GPU busy time are empty; decode runs at full speed.
    Off,
}

/// Grouped routed experts (decode): a MoE layer's pinned picked GPU experts run as two launches
/// (`Gpu::grouped_experts`: gate|up with SwiGLU for every expert, then down with the weighted sum into the
/// residual) instead of five launches an expert (`Gpu::expert_ffn`). In a one-token qwen3-30b-a3b step the
/// 8 pinned experts of a layer took ~380 µs on the H200, paced by the host's 40 launches, for ~20 µs of
/// weight reads.
///
/// It applies to steps of at most `EXACT_MAX_TOKENS` token rows with f16/bf16, q8_0, q4_0, q4_k or q6_k
/// matrices (`cuda::grouped_experts_fit`; the quantised ones dequantised exactly in f32, as the per-expert
/// GEMVs do; q2_k/q3_k round the activations first, so they stay per expert). Larger steps (prefill chunks,
/// batched decode of more than 8 sequences) run the pinned experts, in any format, through the tiled kernels
/// (`Gpu::tiled_experts`, `cuda::tiled`): three launches a group of experts whose entries fit the per-expert
/// path's rows, where a q4_0 qwen3-30b-a3b prefill chunk spent ≈ 42 µs of host time an expert on the H200's
/// host. Streamed experts keep the per-expert path (each waits for its own ring slot), after the pinned
/// ones; a q2_k/q3_k decode step keeps it entirely.
///
/// On by default: measured on the H200 (qwen3-30b-a3b@4L bf16, all experts pinned, 16 decode steps) a decode
/// step took 1.05–1.35 ms grouped against 2.51–2.55 ms per expert, 17/17 tokens equal to the per-expert
/// reference and logits within 1.75e-3 (relative) of it. The profiler times it (`experts_grouped` rows) and
/// the simulator prices our pinned experts with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GroupedExperts {
    /// Where it applies.
    #[default]
    On,
    /// Never: every GPU expert runs `Gpu::expert_ffn` (the per-expert reference).
    Off,
}

/// Pre-enqueue (decode, experts on the CPU): while layer L's CPU experts run, the host queues what follows
/// them on the compute stream — their sum's upload and add, layer L+1's attention and router up to the copy
/// of its logits to the host — behind a wait on a host flag, and opens it once it has written the sum. The
/// host's launches of the attention (≈ 70 µs a layer of qwen3-30b-a3b, which the GPU ran at the host's pace)
/// leave the serial path from the CPU experts to the next routing.
///
/// It applies where that is simple: decode passes whose residual stream is on the GPU, with layer L+1's
/// attention on the GPU right after layer L's experts, its weights and KV pinned or streamed (the ring item
/// already in flight, so that taking it only queues a device-side wait), and its router pinned or streamed (its
/// ring item next after the attention's) (`pre_enqueue_steps`); the host syncs on nothing before it opens the
/// gate. Elsewhere, and on devices without stream memory operations ([`RunOutput::warnings`] says so), the host
/// enqueues as it does with `Off`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PreEnqueue {
    /// Where the plan and the device allow it. The default: on the H200 machine, qwen3-30b-a3b@4L bf16 at 2 GB
    /// (pshard, every expert on the CPU) decoded 4.92–5.27 ms a step against 5.28–5.74 ms with `Off`
    /// (interleaved runs, one lease, session 13), with the same tokens and logits as the all-pinned reference.
    #[default]
    On,
    /// Never: every launch after the CPU experts' end.
    Off,
}

/// VRAM as planned, as carved, and as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VramReport {
    /// The plan's budget.
    pub budget_bytes: u64,
    /// Measured process VRAM before the arena (context, cuBLAS handle and workspace, kernels).
    pub overhead_bytes: u64,
    /// The arena.
    pub arena_bytes: u64,
    /// Measured process VRAM peak (device total − lowest free).
    pub peak_process_bytes: u64,
    /// The plan's breakdown, prefill then decode.
    pub planned: [VramBreakdown; 2],
    /// What the executor carved, prefill then decode.
    pub used: [VramBreakdown; 2],
    /// Bytes uploaded when switching from the prefill to the decode layout.
    pub switch_uploaded_bytes: u64,
    /// Weight bytes left pageable (see [`RunOptions::pinned_limit_bytes`]; all of them for a plan whose workload
    /// says `host_pageable`).
    #[serde(default)]
    pub pageable_weight_bytes: u64,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    /// Produced tokens: the first from prefill, then one per decode step; with R sequences step by step, the
    /// R sequences' tokens of a step side by side (token `i` of sequence `s` at `i·R + s`).
    pub tokens: Vec<u32>,
    /// Logits behind each produced token (if asked for), in the order of `tokens`.
    pub logits: Vec<Vec<f32>>,
    /// Measured metrics (same type as the simulator's).
    pub metrics: Metrics,
    /// Measured timeline.
    pub trace: Trace,
    /// VRAM accounting (None for CPU-only runs).
    pub vram: Option<VramReport>,
    /// With `keep_logits`, the experts every MoE layer picked: pass by pass, layer by layer, `[tokens, top_k]`
    /// each (empty for dense models). Two runs of the same inputs route alike unless a near-tie flipped.
    pub routes: Vec<u32>,
    /// What the run did differently from what was asked, and why (weights left pageable).
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Track {
    Compute,
    H2d,
    D2h,
    Cpu,
    Host,
}

impl Track {
    fn ids(self) -> (u32, u32) {
        match self {
            Track::Compute => (0, 0),
            Track::H2d => (0, 1),
            Track::D2h => (0, 2),
            Track::Cpu => (1, 0),
            Track::Host => (2, 0),
        }
    }

    fn resource(self) -> Option<Resource> {
        match self {
            Track::Compute => Some(Resource::GpuCompute),
            Track::H2d => Some(Resource::H2d),
            Track::D2h => Some(Resource::D2h),
            Track::Cpu => Some(Resource::Cpu),
            Track::Host => None,
        }
    }
}

struct GpuSpan {
    name: String,
    track: Track,
    start: Event,
    end: Event,
    /// Bytes a copy span moved (0 for kernels): the trace carries them so achieved copy bandwidth can be read
    /// off it (`exec bench --bounds`).
    bytes: u64,
}

struct Timeline {
    start: Instant,
    spans: Vec<(String, Track, u64, u64)>,
    gpu: Vec<GpuSpan>,
}

impl Timeline {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn host(&mut self, name: String, track: Track, start_ns: u64) {
        let end = self.now_ns();
        self.spans.push((name, track, start_ns, end.saturating_sub(start_ns)));
    }
}

/// The streaming ring of one phase.
struct Ring {
    slots: Vec<u64>,
    /// Each slot's events ([`RingSlot`]).
    events: Vec<RingSlot>,
    issued: usize,
    released: usize,
    /// Items queued for copying: (item, pass index, the pass's tokens, whose KV cells they upload).
    pending: VecDeque<(RingItem, usize, Pass)>,
    /// Copied items not yet consumed: (item, slot).
    in_flight: VecDeque<(RingItem, usize)>,
    queued_through: Option<usize>,
    first_pass: usize,
}

struct GpuSide<'a> {
    gpu: &'a Gpu,
    k: Arc<Kernels>,
    arena: DevBuf,
    overhead_bytes: u64,
    total_bytes: u64,
    min_free_bytes: u64,
    ring: Option<Ring>,
    kv_wb: Vec<Event>,
    kv_wb_pass: Vec<Option<usize>>,
    /// Recorded after the last upload from [`MoeIo`]; the host waits for it before rewriting that buffer.
    moe_uploaded: Event,
    /// The device address of the mapped `h_host` ([`Gpu::register_mapped`]).
    h_host_dev: u64,
    /// The device address of the mapped [`MoeIo`] buffer: CPU experts' sums are added from it by a kernel.
    moe_io_dev: u64,
    /// Recorded after a MoE layer's expert inputs went up on the H2D stream (`expert_inputs_stream`); the
    /// compute stream waits for it.
    expert_inputs: Event,
    mark: Event,
    t0: Event,
    t0_ns: u64,
    /// Weight bytes left pageable, and the warning that says why when the plan did not ask for it.
    pageable: (u64, Option<String>),
    /// The flag that gates pre-enqueued work ([`PreEnqueue`]), if on and the device can wait on it.
    gate: Option<Rc<HostFlag>>,
    /// The value the last gate waited for: each gate waits for the next one (cyclically).
    gate_seq: u32,
    /// Why pre-enqueue is off although asked for.
    gate_warning: Option<String>,
    /// Whether units' kernels are timed ([`UnitSpans`]).
    unit_spans: UnitSpans,
    _regs: Vec<HostRegistration>,
}

/// Opens a pre-enqueue's gate when dropped: after the host wrote what the gated work reads, or on an error or
/// a panic in between, so that the compute stream (and the sync of `GpuSide`'s drop) never waits forever.
struct Gate {
    flag: Rc<HostFlag>,
    seq: u32,
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.flag.release(self.seq);
    }
}

/// Layer `L + 1`'s attention and router, which can be pre-enqueued after layer L's CPU experts ([`PreEnqueue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NextLayer {
    attn: Step,
    router: Step,
    /// The ring item the attention takes first (its weights, its KV, or both in one slot), if it streams: it
    /// must be in flight already, so that taking it only queues a device-side wait (`Exec::ring_leads_with`).
    ring: Option<RingItem>,
    /// The router's ring item, if it streams: next after the attention's, in flight or issued once the
    /// attention's slot is released — a device-side wait either way.
    router_ring: Option<RingItem>,
}

/// Why the GPU work after a decode layer's CPU experts was not pre-enqueued ([`PreEnqueue`]); a run counts
/// them and says so in [`RunOutput::warnings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum NotPreEnqueued {
    /// A prefill pass, the last layer (the output head follows) or a dense layer next.
    NoNextMoeLayer,
    /// The next layer's router is on the CPU.
    RouterOnCpu,
    /// The next layer's attention or its KV is on the host (on the CPU, or staged).
    AttentionOnHost,
    /// The next attention or router streams, and their ring items were not the next in line.
    RingItemsNotNext,
    /// The residual stream was on the host while the experts ran.
    ResidualOnHost,
}

impl NotPreEnqueued {
    fn why(self) -> &'static str {
        match self {
            NotPreEnqueued::NoNextMoeLayer => "no MoE layer next",
            NotPreEnqueued::RouterOnCpu => "the next router on the CPU",
            NotPreEnqueued::AttentionOnHost => "the next attention or its KV on the host",
            NotPreEnqueued::RingItemsNotNext => {
                "the next attention's or router's ring items not next in line"
            }
            NotPreEnqueued::ResidualOnHost => "the residual stream on the host",
        }
    }
}

/// The next layer's steps when the GPU work after layer L's CPU experts can be pre-enqueued ([`PreEnqueue`]):
/// `router` is the index of layer L's router step in `steps`, `decode` whether the pass is a decode step. The
/// attention must follow L's expert steps, on the GPU with its KV (pinned or streamed, not on the host), and
/// the router must follow it, pinned or streamed: then the enqueue needs no host sync, only device-side waits
/// for at most two ring items (the attention's, then the router's).
fn pre_enqueue_steps(steps: &[Step], router: usize, decode: bool) -> Result<NextLayer, NotPreEnqueued> {
    let none = NotPreEnqueued::NoNextMoeLayer;
    let Some(UnitId::Router { layer }) = steps.get(router).map(|s| s.unit) else { return Err(none) };
    let mut rest = steps[router + 1..]
        .iter()
        .skip_while(|s| matches!(s.unit, UnitId::Expert { layer: l, .. } if l == layer));
    let (Some(&attn), Some(&next_router)) = (rest.next(), rest.next()) else { return Err(none) };
    let next = layer + 1;
    if !decode
        || attn.unit != (UnitId::Attn { layer: next })
        || next_router.unit != (UnitId::Router { layer: next })
    {
        return Err(none);
    }
    let router_ring = match next_router.weights {
        WeightLoc::Pinned(_) => None,
        WeightLoc::Streamed => Some(RingItem::Weights(next_router.unit)),
        WeightLoc::Cpu | WeightLoc::Staged(_) => return Err(NotPreEnqueued::RouterOnCpu),
    };
    let ring = match (attn.weights, attn.kv.ok_or(none)?) {
        (WeightLoc::Pinned(_), KvLoc::Pinned(_)) => None,
        (WeightLoc::Streamed, KvLoc::Streamed) => Some(RingItem::AttnKv(next)),
        (WeightLoc::Streamed, KvLoc::Pinned(_)) => Some(RingItem::Weights(attn.unit)),
        (WeightLoc::Pinned(_), KvLoc::Streamed) => Some(RingItem::Kv(next)),
        // On the CPU, or staged with the KV on the host (op offload, prefill only).
        _ => return Err(NotPreEnqueued::AttentionOnHost),
    };
    Ok(NextLayer { attn, router: next_router, ring, router_ring })
}

/// The stream that takes a MoE layer's expert inputs up (token lists and weights; the normed input and the
/// residual where they are on the host), given every expert's location and the picked GPU experts: the H2D
/// stream, ahead of the streamed experts' copies, where any is picked; else the compute stream.
///
/// On the compute stream, a prefill chunk's inputs (32 KB lists and more) were copied only once the H2D
/// stream's queue of expert copies, though queued after them, drained or stalled on a ring slot's release,
/// and every expert waited behind them: in run31's cell 69 (q4_0, 55 slots) each layer's first expert ran
/// 1.8–2.9 ms after its copy, once 35–55 copies had landed, and the layer's last expert ended 1.0–2.3 ms
/// after its last copy (44.8 of 268.6 ms TTFT over 23 layers); bf16 layers with 8 or 128 slots waited for the
/// 8th or the 128th copy. A decode step's few hundred bytes did not wait for the queue (cell 96), but copies
/// on the compute stream wait for a copy engine that a streamed unit's copy in flight holds (session 21: 48 µs
/// from the router to the GPU experts, 24 without), so a small step's inputs on the compute stream are read
/// from the mapped staging buffer by a kernel instead ([`Gpu::copy_mapped_parts`]); on the H2D stream they
/// would queue behind copies of later units where the layer streams nothing.
fn expert_inputs_stream(locs: &[WeightLoc], gpu_experts: &[u32]) -> Stream {
    if gpu_experts.iter().any(|&e| locs[e as usize] == WeightLoc::Streamed) {
        Stream::H2d
    } else {
        Stream::Compute
    }
}

impl Drop for GpuSide<'_> {
    fn drop(&mut self) {
        let _ = self.gpu.sync_all();
    }
}

impl GpuSide<'_> {
    fn base(&self) -> u64 {
        self.arena.ptr()
    }

    fn sample_vram(&mut self) -> Result<()> {
        let (free, _) = self.gpu.mem_info()?;
        self.min_free_bytes = self.min_free_bytes.min(free);
        Ok(())
    }

    /// A timing event recorded on `on` (a staged copy runs on the compute stream but is an H2D span).
    /// A timing event recorded on `on`, unless the compute stream's spans are off ([`UnitSpans`]).
    fn span_start(&self, on: Stream) -> Result<Option<Event>> {
        if on == Stream::Compute && self.unit_spans == UnitSpans::Off {
            return Ok(None);
        }
        self.gpu.mark(on).map(Some)
    }

    fn span_end(
        &self,
        tl: &mut Timeline,
        name: String,
        track: Track,
        on: Stream,
        start: Option<Event>,
    ) -> Result<()> {
        if let Some(start) = start {
            let end = self.gpu.mark(on)?;
            tl.gpu.push(GpuSpan { name, track, start, end, bytes: 0 });
        }
        Ok(())
    }
}

/// Host-side staging for the GPU: token ids, the sampled token, RoPE frequencies, logits.
struct Io {
    buf: HostBuf,
    ids: usize,
    tok: usize,
    inv_freq: usize,
    logits: usize,
}

impl Io {
    /// For passes of up to `tokens` tokens, of which up to `logit_rows` produce a token.
    fn new(d: &Dims, tokens: usize, logit_rows: usize) -> Io {
        let ids = 0;
        let tok = (tokens * 4).next_multiple_of(64);
        let inv_freq = tok + (logit_rows * 4).next_multiple_of(64);
        let logits = (inv_freq + d.rot_dims * 2 + 4).next_multiple_of(64);
        Io { buf: HostBuf::zeroed(logits + logit_rows * d.vocab * 4), ids, tok, inv_freq, logits }
    }
}

/// Host-side staging of MoE layers (page-locked): router logits and normed input coming from the GPU, the
/// token permutation and the CPU experts' partial sum going to it. Empty for dense models.
struct MoeIo {
    buf: HostBuf,
    logits: usize,
    xn: usize,
    idx: usize,
    w: usize,
    part: usize,
    /// The grouped experts' unit addresses (u64) and entry offsets (u32), `tokens × top_k` (+ 1).
    gbase: usize,
    gfirst: usize,
    /// The tiled experts' index ([`tiled`]), `tiled_bytes` at most.
    tiled: usize,
    tiled_bytes: usize,
}

impl MoeIo {
    fn new(d: &Dims, tokens: usize) -> MoeIo {
        let Some(moe) = d.moe else {
            return MoeIo {
                buf: HostBuf::zeroed(0),
                logits: 0,
                xn: 0,
                idx: 0,
                w: 0,
                part: 0,
                gbase: 0,
                gfirst: 0,
                tiled: 0,
                tiled_bytes: 0,
            };
        };
        let mut at = 0;
        let mut take = |bytes: usize| {
            let off = at;
            at = (at + bytes).next_multiple_of(64);
            off
        };
        let logits = take(tokens * moe.n_experts * 4);
        let xn = take(tokens * d.hidden * 2);
        let idx = take(tokens * moe.top_k * 4);
        let w = take(tokens * moe.top_k * 4);
        let part = take(tokens * d.hidden * 4);
        let gbase = take(tokens * moe.top_k * 8);
        let gfirst = take((tokens * moe.top_k + 1) * 4);
        let tiled_bytes = tiled::tiled_index_max_bytes(tokens, tokens * moe.top_k, moe.n_experts, tokens);
        let tiled = take(tiled_bytes);
        MoeIo { buf: HostBuf::zeroed(at), logits, xn, idx, w, part, gbase, gfirst, tiled, tiled_bytes }
    }
}

struct Exec<'a> {
    w: &'a ModelWeights,
    d: &'a Dims,
    opts: &'a RunOptions,
    /// The KV cache of every sequence, per layer.
    kv: SeqKv,
    gpu: Option<GpuSide<'a>>,
    host_kv: Vec<HostBuf>,
    h_host: HostBuf,
    io: Io,
    moe_io: MoeIo,
    /// Op offload (prefill): q, k, v coming from the GPU and the attention output going back (page-locked).
    attn_io: HostBuf,
    routes: Vec<u32>,
    tl: Timeline,
    h_on_dev: bool,
    /// The layer whose attention and router were pre-enqueued ([`PreEnqueue`]): the step loop skips them.
    pre_enqueued: Option<u32>,
    /// Decode layers with CPU experts, pre-enqueued or not (and why), with the gate in use.
    pre_enqueue_count: (usize, BTreeMap<NotPreEnqueued, usize>),
}

/// Runs every GEMM shape a run will launch once, so that cuBLAS's first call of a shape (its heuristics, and
/// loading the kernel it picks: 3–4 ms each on the H200 for the output head and the accumulating projections)
/// falls before the timed run, as a warm-up run of llama.cpp's would; the simulator prices steady-state kernels.
/// `output_rows`: the token counts of passes that produce logits on the GPU (none when the head is on the CPU).
/// Returns the device's free bytes while the warm-up buffers are allocated.
fn warm_up(
    gpu: &Gpu,
    kn: &Kernels,
    d: &Dims,
    m_prefill: usize,
    m_decode: usize,
    output_rows: &[usize],
) -> Result<u64> {
    // (n, k, accumulate): the output and down projections add into the residual stream.
    let mut shapes = vec![
        (d.q_dim, d.hidden, false),
        (d.kv_dim, d.hidden, false),
        (d.hidden, d.q_dim, true),
        (d.ffn, d.hidden, false),
        (d.hidden, d.ffn, true),
    ];
    if let Some(moe) = d.moe {
        // An expert's gate and up run as one matmul where they lie back to back (`Gpu::expert_ffn`).
        let gate_up = if d.expert_gate_up_adjacent() { 2 * moe.expert_ffn } else { moe.expert_ffn };
        shapes.extend([
            (moe.n_experts, d.hidden, false),
            (gate_up, d.hidden, false),
            (d.hidden, moe.expert_ffn, false),
        ]);
    }
    // Experts see every token count up to the chunk: warm every power of two too.
    let mut counts = vec![m_prefill, 1, m_decode];
    if d.moe.is_some() {
        counts.extend((1..).map(|p| 1usize << p).take_while(|&m| m < m_prefill));
    }
    // (m, n, k, accumulate)
    let mut calls: Vec<_> =
        counts.iter().flat_map(|&m| shapes.iter().map(move |&(n, k, acc)| (m, n, k, acc))).collect();
    // One-token steps run q|k|v and gate|up as one GEMM each (`one_gemm_rows`); their first calls had cost
    // step 0 of nemo-8b 8.4 ms (results/exec/bounds/README.md).
    calls.push((1, d.q_dim + 2 * d.kv_dim, d.hidden, false));
    if d.ffn_kind == FfnKind::SwiGlu {
        calls.push((1, 2 * d.ffn, d.hidden, false));
    }
    calls.extend(output_rows.iter().map(|&m| (m, d.vocab, d.hidden, false)));
    let max_of = |f: fn(&(usize, usize, usize, bool)) -> usize| calls.iter().map(f).max().unwrap_or(0);
    let wb = gpu.alloc(max_of(|c| c.1 * c.2) * 2)?;
    let xb = gpu.alloc(max_of(|c| c.0 * c.2) * 2)?;
    let yb = gpu.alloc(max_of(|c| c.0 * c.1) * 4)?;
    for &(m, n, kd, acc) in &calls {
        // SAFETY: wb holds n·k, xb m·k and yb m·n elements (sized by the maxima above); contents do not matter.
        unsafe { gpu.matmul(kn, d.quant, wb.ptr(), xb.ptr(), yb.ptr(), m, n, kd, acc)? };
    }
    gpu.sync(Stream::Compute)?;
    Ok(gpu.mem_info()?.0)
}

/// The VRAM a run of `w` will find taken before its arena (CUDA context, cuBLAS and its workspace, the compiled
/// kernels, warmed GEMMs), plus [`LAZY_LOAD_RESERVE_BYTES`] and [`OVERHEAD_SPREAD_BYTES`]: what a planner should assume as runtime overhead
/// on this machine, for prefill chunks of `prefill_tokens` and decode steps of `decode_tokens` (the parallel
/// requests). Measured as device total − free, so other processes on the device count too.
pub fn runtime_overhead_bytes(
    gpu: &Gpu,
    w: &Dims,
    kv: Elem,
    prefill_tokens: usize,
    decode_tokens: usize,
) -> Result<u64> {
    let k = gpu.kernels(KernelKey { act: w.mat, kv, head_dim: w.head_dim })?;
    warm_up(gpu, &k, w, prefill_tokens, decode_tokens, &[1, decode_tokens])?;
    let (free, total) = gpu.mem_info()?;
    Ok(total - free + LAZY_LOAD_RESERVE_BYTES + OVERHEAD_SPREAD_BYTES)
}

/// VRAM the driver takes per GiB of page-locked host memory (its mapping for the GPU), measured once per
/// process by locking a 2 GiB probe buffer; a model's weights are locked whole, so this is part of its runtime
/// overhead ([`pipeshard_core::profile::Profile::page_table_bytes_per_locked_gib`]).
pub fn page_table_bytes_per_locked_gib(gpu: &Gpu) -> Result<u64> {
    const PROBE_BYTES: u64 = 2 << 30;
    static MEASURED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    if let Some(&v) = MEASURED.get() {
        return Ok(v);
    }
    let probe = HostBuf::try_zeroed(PROBE_BYTES as usize, "the page-lock probe")?;
    gpu.sync_all()?;
    let (before, _) = gpu.mem_info()?;
    // SAFETY: `probe` outlives the guard, which is dropped first; it is registered once.
    let reg = unsafe { gpu.register(&probe)? };
    let (after, _) = gpu.mem_info()?;
    drop(reg);
    Ok(*MEASURED.get_or_init(|| before.saturating_sub(after) * (1 << 30) / PROBE_BYTES))
}

/// Which weight buffers to page-lock, given each one's (bytes, streamed in some phase) and the limit: streamed
/// units first (they cross PCIe every pass), then the rest, each in order while it fits under the limit.
fn page_lock_choice(units: &[(u64, bool)], limit_bytes: Option<u64>) -> Vec<bool> {
    let Some(limit) = limit_bytes else { return vec![true; units.len()] };
    let mut lock = vec![false; units.len()];
    let mut used = 0u64;
    for streamed_pass in [true, false] {
        for (i, &(bytes, streamed)) in units.iter().enumerate() {
            if streamed == streamed_pass && used + bytes <= limit {
                used += bytes;
                lock[i] = true;
            }
        }
    }
    lock
}

fn uses_gpu(plan: &PhasePlan, tokens: usize) -> bool {
    plan.placements.iter().any(|p| p.placement.on_gpu())
        || (plan.op_offload
            && plan.phase == PhaseKind::Prefill
            && tokens >= 32
            && plan.placements.iter().any(|p| {
                matches!(
                    p.unit,
                    UnitId::Attn { .. } | UnitId::Ffn { .. } | UnitId::Router { .. } | UnitId::Expert { .. }
                )
            }))
}

/// Bytes of [`offloaded_attention`]'s staging for `m` tokens: the chunk's new k and v rows (f32).
fn offloaded_attention_io_bytes(d: &Dims, m: usize) -> usize {
    2 * m * d.kv_dim * 4
}

/// Op offload's attention of a CPU-resident layer, where llama.cpp's scheduler runs it: on the GPU. The
/// chunk's new K/V rows (roped, in scratch) go down into the host cache, where decode reads them; then the
/// sequence's rows up to the chunk's last come up into scratch `kv_view` and the GPU kernel attends over them,
/// writing scratch `xb`. Returns the start of the timeline span of the GPU work after the host sync.
fn offloaded_attention(
    g: &GpuSide,
    d: &Dims,
    io: &mut HostBuf,
    kv_cache: &mut [u8],
    cache: SeqKv,
    tl: &mut Timeline,
    sc: &ScratchLayout,
    pass: Pass,
) -> Result<Option<Event>> {
    let Pass::Prefill { seq, pos0, tokens: m } = pass else {
        unreachable!("op offload runs prefill chunks only")
    };
    let nkv = m * d.kv_dim;
    let at = |o: usize| g.base() + o as u64;
    let t = tl.now_ns();
    {
        let (k, rest) = io.as_mut_slice().split_at_mut(nkv * 4);
        // SAFETY: scratch k, v hold m·kv_dim f32 (scratch_layout); io is registered, sized by
        // offloaded_attention_io_bytes for ≥ m tokens, and read only after the sync below.
        unsafe {
            g.gpu.d2h(Stream::Compute, k, at(sc.k))?;
            g.gpu.d2h(Stream::Compute, &mut rest[..nkv * 4], at(sc.v))?;
        }
    }
    g.gpu.sync(Stream::Compute)?;
    tl.host("sync: k, v to host".into(), Track::Host, t);
    let whole = cache.whole();
    {
        let (k, v) = io.f32s_mut().split_at_mut(nkv);
        cpu::store_kv_rows(kv_cache, whole, k, &v[..nkv], m, cache.store_rows(pass));
    }
    let (first, len) = (whole.row_offset(cache.row(seq, 0)), whole.row_offset(pos0 + m));
    let (kc, vc) = (at(sc.kv_view), at(sc.kv_view) + len as u64);
    let start = g.span_start(Stream::Compute)?;
    // SAFETY: kv_view holds one sequence's [K | V] (layout_phase) and pos0 + m ≤ its ctx rows; the host cache
    // is registered and this layer's rows are next written after a later sync of this stream; q and xb hold
    // m·q_dim, the split partials the scratch's splits.
    unsafe {
        g.gpu.h2d(Stream::Compute, kc, &kv_cache[first..first + len])?;
        g.gpu.h2d(
            Stream::Compute,
            vc,
            &kv_cache[whole.half_bytes() + first..whole.half_bytes() + first + len],
        )?;
        g.gpu.attention(
            &g.k,
            at(sc.q),
            kc,
            vc,
            at(sc.xb),
            at(sc.part_o),
            at(sc.part_ml),
            m,
            GpuKeys::causal(pos0),
            d.n_heads,
            d.n_kv_heads,
            d.attn_scale(),
            sc.attn_splits,
        )?;
    }
    Ok(start)
}

/// Whether one GEMM can compute a one-token step's matrices `(unit offset, rows)` together: they lie back to
/// back in the unit, so their rows form one matrix, and one token's outputs come out back to back. Small
/// decode GEMMs sit on cuBLAS's latency floor (a 1024×4096 bf16 GEMV took as long as a 4096×4096 one,
/// results/exec/bounds/run2/gemv.md), so one GEMM over q|k|v or gate|up takes less than their sum. Steps of
/// more tokens keep one GEMM each: their output rows would interleave the matrices.
fn one_gemm_rows(d: &Dims, m: usize, mats: &[(usize, usize)]) -> bool {
    let row_bytes = d.quant.map_or(d.hidden * d.mat.size_bytes(), |f| f.row_bytes(d.hidden));
    m == 1 && mats.windows(2).all(|p| p[0].0 + p[0].1 * row_bytes == p[1].0)
}

/// Runs `plan` for `w` with `opts`: on `gpu` where the plan places units on the GPU (an error if it does and
/// `gpu` is `None`), on the CPU elsewhere.
pub fn run(w: &ModelWeights, plan: &Plan, gpu: Option<&Gpu>, opts: &RunOptions) -> Result<RunOutput> {
    let d = &w.dims;
    plan.validate(&w.inventory).map_err(|e| ExecError::InvalidPlan(e.to_string()))?;
    let wl = &plan.workload;
    if plan.decode.op_offload {
        return Err(ExecError::UnsupportedPlan {
            phase: PhaseKind::Decode,
            reason:
                "op offload in decode steps (llama.cpp's, for steps of ≥ 32 sequences) is not implemented by \
                     the executor; run `ngl` with fewer than 32 parallel requests"
                    .into(),
        });
    }
    if !wl.flash_attn {
        return Err(ExecError::UnsupportedPlan {
            phase: PhaseKind::Prefill,
            reason: "flash attention off (the executor implements flash attention only); plan with flash \
                     attention on (`ngl`: PlannerOptions::ngl_flash_attn, experiment `ngl_flash_attn = true`)"
                .into(),
        });
    }
    let kv_elem = Elem::from_dtype(wl.kv_dtype).ok_or_else(|| ExecError::UnsupportedPlan {
        phase: PhaseKind::Prefill,
        reason: format!("KV cache format {} (use f16, bf16 or f32)", wl.kv_dtype),
    })?;
    let ctx = wl.ctx as usize;
    if opts.prompt.is_empty() {
        return Err(ExecError::Input("empty prompt".into()));
    }
    let seqs = wl.batch as usize;
    if !opts.other_prompts.is_empty() && opts.other_prompts.len() + 1 != seqs {
        return Err(ExecError::Input(format!(
            "{} other prompts for a workload of {seqs} parallel requests (give {} or none)",
            opts.other_prompts.len(),
            seqs - 1
        )));
    }
    if let Some(p) = opts.other_prompts.iter().find(|p| p.len() != opts.prompt.len()) {
        return Err(ExecError::Input(format!(
            "a prompt of {} tokens beside one of {}: every parallel request needs the same prompt length",
            p.len(),
            opts.prompt.len()
        )));
    }
    if let Some(&t) =
        opts.prompt.iter().chain(opts.other_prompts.iter().flatten()).find(|&&t| t as usize >= d.vocab)
    {
        return Err(ExecError::Input(format!("token {t} is outside the vocabulary of {}", d.vocab)));
    }
    if opts.prompt.len() + opts.gen_tokens > ctx {
        return Err(ExecError::Input(format!(
            "prompt {} + gen {} tokens exceed the context of {ctx}",
            opts.prompt.len(),
            opts.gen_tokens
        )));
    }
    if let Some(f) = &opts.force_tokens
        && (f.len() < opts.gen_tokens || f.iter().any(|&t| t as usize >= d.vocab))
    {
        return Err(ExecError::Input(format!(
            "force_tokens must hold {} in-vocabulary tokens",
            opts.gen_tokens
        )));
    }
    let ubatch = (wl.ubatch as usize).max(1);
    let chunks: Vec<(usize, usize)> =
        (0..opts.prompt.len()).step_by(ubatch).map(|p| (p, ubatch.min(opts.prompt.len() - p))).collect();
    let m_prefill = chunks.iter().map(|c| c.1).max().unwrap_or(1);
    let m_max = m_prefill.max(seqs);
    let kv = SeqKv {
        seq: KvLayout { ctx, kv_dim: d.kv_dim, elem: kv_elem },
        seqs,
        unified: wl.kv_unified,
        prompt: opts.prompt.len(),
    };
    let needs_gpu = uses_gpu(&plan.prefill, m_prefill) || uses_gpu(&plan.decode, seqs);
    let mut ex = Exec {
        w,
        d,
        opts,
        kv,
        gpu: None,
        host_kv: (0..d.n_layers)
            .map(|l| {
                HostBuf::try_zeroed(
                    kv.whole().bytes(),
                    &format!("the host KV cache of layer {l} (ctx {ctx})"),
                )
            })
            .collect::<Result<_>>()?,
        h_host: HostBuf::zeroed(m_max * d.hidden * 4),
        io: Io::new(d, m_max, seqs),
        moe_io: MoeIo::new(d, m_max),
        attn_io: HostBuf::zeroed(if plan.prefill.op_offload {
            offloaded_attention_io_bytes(d, m_prefill)
        } else {
            0
        }),
        routes: Vec::new(),
        tl: Timeline { start: Instant::now(), spans: Vec::new(), gpu: Vec::new() },
        h_on_dev: false,
        pre_enqueued: None,
        pre_enqueue_count: (0, BTreeMap::new()),
    };
    if needs_gpu {
        let gpu = gpu.ok_or_else(|| ExecError::NoCuda {
            reason: "the plan places units on the GPU but no CUDA device was opened".into(),
        })?;
        ex.gpu = Some(ex.open_gpu(gpu, plan, m_prefill)?);
    }
    ex.run(plan, &chunks, m_prefill)
}

impl<'a> Exec<'a> {
    fn open_gpu(&self, gpu: &'a Gpu, plan: &Plan, m_prefill: usize) -> Result<GpuSide<'a>> {
        let d = self.d;
        let k = gpu.kernels(KernelKey { act: d.mat, kv: self.kv.seq.elem, head_dim: d.head_dim })?;
        // Page-lock before the VRAM is read for the arena: the driver's mapping of locked host memory takes
        // VRAM (1/512 of the locked bytes on the H200), which then counts in the runtime overhead.
        let mut regs = Vec::new();
        // Staging buffers first: small, and the host reads them right after asynchronous copies.
        for b in self.host_kv.iter().chain([&self.io.buf, &self.attn_io]) {
            // SAFETY: these buffers are fields of Exec declared after `gpu`, so they drop after the guards.
            regs.push(unsafe { gpu.register(b)? });
        }
        // The residual stream's host copy is mapped too: `ensure_dev` reads it by a kernel (`Gpu::copy_mapped`).
        // SAFETY: as above.
        let (reg, h_host_dev) = unsafe { gpu.register_mapped(&self.h_host)? };
        regs.push(reg);
        // So is MoE's staging buffer: `Gpu::add_mapped` adds CPU experts' sums from it.
        // SAFETY: as above.
        let (reg, moe_io_dev) = unsafe { gpu.register_mapped(&self.moe_io.buf)? };
        regs.push(reg);
        // Pre-enqueue gates the work after CPU experts, which only MoE decode plans with CPU experts have.
        let cpu_experts = plan
            .decode
            .placements
            .iter()
            .any(|p| matches!(p.unit, UnitId::Expert { .. }) && p.placement == Placement::Cpu);
        let (gate, gate_warning) = if self.opts.pre_enqueue == PreEnqueue::On && cpu_experts {
            match gpu.host_flag() {
                Ok(f) => (Some(Rc::new(f)), None),
                Err(e) => {
                    (None, Some(format!("pre-enqueue is off: the device cannot wait on a host flag ({e})")))
                }
            }
        } else {
            (None, None)
        };
        let units = self.w.units();
        let streamed: HashSet<UnitId> = plan
            .phases()
            .iter()
            .flat_map(|p| p.placements.iter().filter(|u| u.placement == Placement::Streamed).map(|u| u.unit))
            .collect();
        let wanted: Vec<(u64, bool)> =
            units.iter().map(|u| (u.buf.capacity_bytes() as u64, streamed.contains(&u.id))).collect();
        let (mut pageable_bytes, mut refused) = (0u64, None);
        // A plan costed for pageable host memory (`ngl`: llama.cpp copies from its mmap of the model file) runs
        // from pageable memory, as it was costed.
        let limit = if plan.workload.host_pageable { Some(0) } else { self.opts.pinned_limit_bytes };
        for (u, lock) in units.iter().zip(page_lock_choice(&wanted, limit)) {
            if lock && refused.is_none() {
                // SAFETY: the weights outlive this run (borrowed for 'a) and each buffer is registered once.
                match unsafe { gpu.register(&u.buf) } {
                    Ok(r) => {
                        regs.push(r);
                        continue;
                    }
                    // Copies from pageable memory are correct, only slower: run on and say so.
                    Err(e) => refused = Some(e.to_string()),
                }
            }
            pageable_bytes += u.buf.capacity_bytes() as u64;
        }
        let warning = (pageable_bytes > 0 && !plan.workload.host_pageable).then(|| {
            let why = match (&refused, limit) {
                (Some(e), _) => format!("the driver refused to page-lock more ({e})"),
                (None, Some(limit)) => format!("the page-lock limit is {limit} bytes"),
                (None, None) => unreachable!("nothing is left pageable without a limit or a refusal"),
            };
            let total: u64 = wanted.iter().map(|w| w.0).sum();
            format!(
                "{pageable_bytes} of {total} bytes of weights stay pageable because {why}: their copies run at \
                 pageable speed (several times slower than page-locked); free host memory or raise the \
                 locked-memory limit (`ulimit -l`) to page-lock them"
            )
        });
        let pageable = (pageable_bytes, warning);
        let (free0, total) = gpu.mem_info()?;
        let seqs = self.kv.seqs;
        // Logits come from one row of a prefill chunk and from every sequence of a decode step.
        let head_on_gpu = |p: &PhasePlan| p.placement(UnitId::Output).is_some_and(|pl| pl != Placement::Cpu);
        let output_rows: Vec<usize> = [(head_on_gpu(&plan.prefill), 1), (head_on_gpu(&plan.decode), seqs)]
            .iter()
            .filter_map(|&(on, rows)| on.then_some(rows))
            .collect();
        let min_free = free0.min(warm_up(gpu, &k, d, m_prefill, seqs, &output_rows)?);
        let (free, _) = gpu.mem_info()?;
        let min_free = min_free.min(free);
        let overhead = total - free;
        let budget = plan.budget_bytes;
        let reserve = LAZY_LOAD_RESERVE_BYTES;
        if overhead + reserve >= budget {
            return Err(ExecError::OverBudget {
                phase: PhaseKind::Prefill,
                line: "runtime overhead + lazy-load reserve".into(),
                needed_bytes: overhead + reserve,
                available_bytes: budget,
                over_bytes: overhead + reserve - budget,
                budget_bytes: budget,
                overhead_bytes: overhead,
                detail: "the CUDA context, cuBLAS and kernels alone exceed the budget".into(),
            });
        }
        let arena_bytes = budget - overhead - reserve;
        // Check both layouts before taking the arena.
        layout_plan(
            self.w,
            plan,
            self.kv,
            m_prefill,
            Arena { bytes: arena_bytes as usize, budget_bytes: budget, overhead_bytes: overhead },
        )?;
        let arena = gpu.alloc(arena_bytes as usize)?;
        let kv_wb = (0..d.n_layers).map(|_| gpu.event(false)).collect::<Result<Vec<_>>>()?;
        let t0 = gpu.event(true)?;
        let mark = gpu.event(false)?;
        let moe_uploaded = gpu.event(false)?;
        let expert_inputs = gpu.event(false)?;
        let mut side = GpuSide {
            gpu,
            k,
            arena,
            overhead_bytes: overhead,
            total_bytes: total,
            min_free_bytes: min_free,
            ring: None,
            kv_wb,
            kv_wb_pass: vec![None; d.n_layers],
            moe_uploaded,
            h_host_dev,
            moe_io_dev,
            expert_inputs,
            mark,
            t0,
            t0_ns: 0,
            pageable,
            gate,
            gate_seq: 0,
            gate_warning,
            unit_spans: self.opts.unit_spans,
            _regs: regs,
        };
        side.sample_vram()?;
        Ok(side)
    }

    fn run(mut self, plan: &Plan, chunks: &[(usize, usize)], m_prefill: usize) -> Result<RunOutput> {
        let arena_bytes = self.gpu.as_ref().map_or(usize::MAX / 4, |g| g.arena.bytes());
        let (budget, overhead) = (plan.budget_bytes, self.gpu.as_ref().map_or(0, |g| g.overhead_bytes));
        let arena = Arena { bytes: arena_bytes, budget_bytes: budget, overhead_bytes: overhead };
        let [lay_p, lay_d] = layout_plan(self.w, plan, self.kv, m_prefill, arena)?;
        let seqs = self.kv.seqs;
        let pool_p = CpuPool::new(plan.prefill.cpu_threads as usize)?;
        let pool_d = if plan.decode.cpu_threads == plan.prefill.cpu_threads {
            None
        } else {
            Some(CpuPool::new(plan.decode.cpu_threads as usize)?)
        };
        self.enter_phase(&lay_p, None, None, 0)?;
        if let Some(g) = &mut self.gpu {
            g.gpu.sync_all()?;
            g.gpu.record(&g.t0, Stream::Compute)?;
            g.gpu.sync(Stream::Compute)?;
        }
        self.tl.start = Instant::now();
        if let Some(g) = &mut self.gpu {
            g.t0_ns = 0;
        }
        let mut tokens = Vec::new();
        let mut logits = Vec::new();
        let mut pass = 0usize;
        let run_opts = self.opts;
        let prompt = |s: usize| match s {
            0 => &run_opts.prompt,
            _ => run_opts.other_prompts.get(s - 1).unwrap_or(&run_opts.prompt),
        };
        let prompt_len = self.opts.prompt.len();
        // Every request's prompt in turn, as the simulator models it; the ring runs across their chunks.
        let passes: Vec<Pass> = (0..seqs)
            .flat_map(|seq| chunks.iter().map(move |&(pos0, m)| Pass::Prefill { seq, pos0, tokens: m }))
            .collect();
        let output =
            |p: &Pass| matches!(*p, Pass::Prefill { pos0, tokens, .. } if pos0 + tokens == prompt_len);
        let t_prefill = self.tl.now_ns();
        for (i, at) in passes.iter().enumerate() {
            self.check_interrupt(pass)?;
            let Pass::Prefill { seq, pos0, tokens: m } = *at else { unreachable!("prefill passes") };
            let next = passes.get(i + 1).map(|p| (*p, output(p)));
            let ids = prompt(seq);
            let t = self.tl.now_ns();
            let out = self.forward(&lay_p, &pool_p, &ids[pos0..pos0 + m], *at, output(at), pass, next)?;
            let name = if seqs > 1 {
                format!("prefill seq {seq} chunk ({m} tokens at {pos0})")
            } else {
                format!("prefill chunk {i} ({m} tokens)")
            };
            self.tl.host(name, Track::Host, t);
            pass += 1;
            if let Some((tok, lg)) = out {
                tokens.extend(tok);
                logits.extend(lg);
            }
        }
        let ttft_ns = self.tl.now_ns() - t_prefill;
        let t_switch = self.tl.now_ns();
        let switch_uploaded_bytes =
            self.enter_phase(&lay_d, Some(&lay_p), Some(Pass::Decode { pos: prompt_len }), pass)?;
        self.tl.host("switch prefill → decode plan".into(), Track::Host, t_switch);
        let pool = pool_d.as_ref().unwrap_or(&pool_p);
        let mut decode_ns = self.tl.now_ns() - t_switch;
        for step in 0..self.opts.gen_tokens {
            self.check_interrupt(pass)?;
            let input: Vec<u32> = match &self.opts.force_tokens {
                Some(f) => vec![f[step]; seqs],
                None => tokens[tokens.len() - seqs..].to_vec(),
            };
            let at = Pass::Decode { pos: prompt_len + step };
            let next = (step + 1 < self.opts.gen_tokens)
                .then_some((Pass::Decode { pos: prompt_len + step + 1 }, true));
            let t = self.tl.now_ns();
            let (tok, lg) = self
                .forward(&lay_d, pool, &input, at, true, pass, next)?
                .expect("decode steps produce tokens");
            self.tl.host(format!("decode step {step}"), Track::Host, t);
            decode_ns += self.tl.now_ns() - t;
            pass += 1;
            tokens.extend(tok);
            logits.extend(lg);
        }
        self.finish(plan, &lay_p, &lay_d, tokens, logits, ttft_ns, decode_ns, switch_uploaded_bytes)
    }

    fn check_interrupt(&self, passes: usize) -> Result<()> {
        match self.opts.interrupt {
            Some(flag) if flag.load(Ordering::Relaxed) => Err(ExecError::Interrupted { passes }),
            _ => Ok(()),
        }
    }

    fn finish(
        mut self,
        plan: &Plan,
        lay_p: &PhaseLayout,
        lay_d: &PhaseLayout,
        tokens: Vec<u32>,
        logits: Vec<Vec<f32>>,
        ttft_ns: u64,
        decode_ns: u64,
        switch_uploaded_bytes: u64,
    ) -> Result<RunOutput> {
        let mut trace = Trace::new();
        for (track, p, t) in [
            (Track::Compute, "gpu", "compute"),
            (Track::H2d, "gpu", "h2d"),
            (Track::D2h, "gpu", "d2h"),
            (Track::Cpu, "cpu", "pool"),
            (Track::Host, "host", "phases"),
        ] {
            let (pid, tid) = track.ids();
            trace.name_track(pid, p, tid, t);
        }
        let mut busy = [0u64; 4];
        let mut add = |trace: &mut Trace, name: &str, track: Track, start: u64, dur: u64| {
            let (pid, tid) = track.ids();
            trace.span(pid, tid, name, "exec", start, dur);
            if let Some(r) = track.resource() {
                busy[Resource::ALL.iter().position(|x| *x == r).expect("resource")] += dur;
            }
        };
        let mut vram = None;
        if let Some(g) = &mut self.gpu {
            g.gpu.sync_all()?;
            g.sample_vram()?;
            for s in &self.tl.gpu {
                let start_ms = g.gpu.elapsed_ms(&g.t0, &s.start)?;
                let dur_ms = g.gpu.elapsed_ms(&s.start, &s.end)?;
                let start = g.t0_ns + (f64::from(start_ms.max(0.0)) * 1e6) as u64;
                add(&mut trace, &s.name, s.track, start, (f64::from(dur_ms.max(0.0)) * 1e6) as u64);
                if s.bytes > 0 {
                    trace.events.last_mut().expect("just added").args.insert("bytes".into(), s.bytes.into());
                }
            }
            let peak = g.total_bytes - g.min_free_bytes;
            let report = VramReport {
                budget_bytes: plan.budget_bytes,
                overhead_bytes: g.overhead_bytes,
                arena_bytes: g.arena.bytes() as u64,
                peak_process_bytes: peak,
                planned: [plan.prefill.vram, plan.decode.vram],
                used: [lay_p.used, lay_d.used],
                switch_uploaded_bytes,
                pageable_weight_bytes: g.pageable.0,
            };
            if peak > plan.budget_bytes {
                return Err(ExecError::BudgetExceeded { peak_bytes: peak, budget_bytes: plan.budget_bytes });
            }
            vram = Some(report);
        }
        for (name, track, start, dur) in &self.tl.spans {
            add(&mut trace, name, *track, *start, *dur);
        }
        let n_gen = self.opts.gen_tokens as u64;
        let generated = n_gen * self.kv.seqs as u64;
        let mut peak_lines = lay_p.used.max(&lay_d.used);
        peak_lines.runtime_overhead_bytes = vram.as_ref().map_or(0, |v| v.overhead_bytes);
        let metrics = Metrics {
            ttft_ns,
            tps: if n_gen > 0 && decode_ns > 0 { generated as f64 / (decode_ns as f64 / 1e9) } else { 0.0 },
            e2el_ns: ttft_ns + decode_ns,
            gen_tokens: n_gen,
            decode_step_ns: decode_ns.checked_div(n_gen).unwrap_or(0),
            vram_peak: peak_lines,
            vram_peak_bytes: vram.as_ref().map_or(0, |v| v.peak_process_bytes),
            busy_ns: Resource::ALL.iter().copied().zip(busy).collect(),
        };
        let mut warnings: Vec<String> = self
            .gpu
            .as_ref()
            .map(|g| g.pageable.1.iter().chain(&g.gate_warning).cloned().collect())
            .unwrap_or_default();
        let (layers, skipped) = &self.pre_enqueue_count;
        if !skipped.is_empty() {
            let why: Vec<String> = skipped.iter().map(|(k, n)| format!("{n} with {}", k.why())).collect();
            warnings.push(format!(
                "pre-enqueue: {} of {layers} decode layer steps with CPU experts queued ahead; not {}",
                layers - skipped.values().sum::<usize>(),
                why.join(", ")
            ));
        }
        Ok(RunOutput { tokens, logits, metrics, trace, vram, routes: self.routes, warnings })
    }

    /// Makes `lay` current: moves KV and pinned weights that change place (the KV cells `at` finds filled),
    /// uploads RoPE frequencies, resets the ring. Returns the bytes uploaded.
    fn enter_phase(
        &mut self,
        lay: &PhaseLayout,
        prev: Option<&PhaseLayout>,
        at: Option<Pass>,
        pass: usize,
    ) -> Result<u64> {
        let Some(g) = &mut self.gpu else { return Ok(0) };
        let gpu = g.gpu;
        gpu.sync_all()?;
        let base = g.base();
        let whole = self.kv.whole();
        let half = whole.half_bytes();
        // Byte ranges of the filled cells in K (add `half` for V).
        let ranges: Vec<(usize, usize)> = at.map_or_else(Vec::new, |at| {
            self.kv.filled(at).iter().map(|&(r, n)| (whole.row_offset(r), whole.row_offset(n))).collect()
        });
        let mut uploaded = 0u64;
        // KV that leaves its place goes back to the host mirror first.
        if let Some(prev) = prev {
            for l in 0..self.d.n_layers as u32 {
                if let Some(p) = prev.kv_offset(l)
                    && lay.kv_offset(l) != Some(p)
                {
                    let hb = self.host_kv[l as usize].as_mut_slice();
                    let (k, v) = hb.split_at_mut(half);
                    for &(o, n) in &ranges {
                        // SAFETY: the arena holds the layer's [K|V] at p (prev layout) and the ranges lie in it; the
                        // host buffer is alive and registered; the D2H stream is synchronised below before anything
                        // reads it.
                        unsafe {
                            gpu.d2h(Stream::D2h, &mut k[o..o + n], base + (p + o) as u64)?;
                            gpu.d2h(Stream::D2h, &mut v[o..o + n], base + (p + half + o) as u64)?;
                        }
                    }
                }
            }
            gpu.sync(Stream::D2h)?;
        }
        for l in 0..self.d.n_layers as u32 {
            if let Some(p) = lay.kv_offset(l)
                && prev.and_then(|pr| pr.kv_offset(l)) != Some(p)
            {
                let hb = self.host_kv[l as usize].as_slice();
                for &(o, n) in &ranges {
                    // SAFETY: the arena holds [K|V] of whole.bytes() at p in this layout; host rows exist; synced
                    // below.
                    unsafe {
                        gpu.h2d(Stream::H2d, base + (p + o) as u64, &hb[o..o + n])?;
                        gpu.h2d(Stream::H2d, base + (p + half + o) as u64, &hb[half + o..half + o + n])?;
                    }
                    uploaded += 2 * n as u64;
                }
            }
        }
        let prev_pinned = prev.map(PhaseLayout::pinned_offsets).unwrap_or_default();
        for s in &lay.steps {
            if let WeightLoc::Pinned(o) = s.weights
                && prev_pinned.get(&s.unit) != Some(&o)
            {
                let u = self.w.unit(s.unit).expect("weight unit");
                // SAFETY: the region at o holds align(u.bytes) bytes in this layout; weights are registered and
                // outlive the run; synced below.
                unsafe { gpu.h2d(Stream::H2d, base + o as u64, &u.buf.as_slice()[..u.bytes])? };
                uploaded += u.bytes as u64;
            }
        }
        let inv = self.d.rope_inv_freq();
        let io = self.io.buf.as_mut_slice();
        for (i, f) in inv.iter().enumerate() {
            io[self.io.inv_freq + 4 * i..self.io.inv_freq + 4 * i + 4].copy_from_slice(&f.to_le_bytes());
        }
        if !inv.is_empty() {
            // SAFETY: the scratch region has room for rot_dims/2 f32 at inv_freq; io is registered; synced below.
            unsafe {
                gpu.h2d(
                    Stream::H2d,
                    base + lay.scratch.inv_freq as u64,
                    &self.io.buf.as_slice()[self.io.inv_freq..self.io.inv_freq + inv.len() * 4],
                )?;
            }
        }
        gpu.sync(Stream::H2d)?;
        g.ring = if lay.slots.is_empty() {
            None
        } else {
            Some(Ring {
                slots: lay.slots.iter().map(|&o| base + o as u64).collect(),
                events: (0..lay.slots.len()).map(|_| RingSlot::new(gpu)).collect::<Result<_>>()?,
                issued: 0,
                released: 0,
                pending: VecDeque::new(),
                in_flight: VecDeque::new(),
                queued_through: None,
                first_pass: pass,
            })
        };
        g.sample_vram()?;
        Ok(uploaded)
    }

    /// Issues ring copies while slots are free and their inputs are ready.
    fn pump(&mut self) -> Result<()> {
        let Some(g) = &mut self.gpu else { return Ok(()) };
        let Some(ring) = &mut g.ring else { return Ok(()) };
        let depth = ring.slots.len();
        while let Some(&(item, pass, at)) = ring.pending.front() {
            // A layer's streamed experts are known only once its router has run (`expand_experts`).
            if ring.issued >= ring.released + depth
                || ring.in_flight.len() >= RING_ISSUE_AHEAD
                || matches!(item, RingItem::Experts(_))
            {
                break;
            }
            if let RingItem::Kv(l) | RingItem::AttnKv(l) = item
                && pass != ring.first_pass
                && g.kv_wb_pass[l as usize] != Some(pass - 1)
            {
                break;
            }
            let slot = ring.issued % depth;
            let dst = ring.slots[slot];
            let (gpu, kv_wb) = (g.gpu, &g.kv_wb);
            // The slot is free once the copies run: they wait for its previous tenant's release.
            let (start, end, (name, bytes)) = ring.events[slot].issue(gpu, ring.issued >= depth, || {
                Ok(match item {
                    RingItem::Weights(u) => {
                        let uw = self.w.unit(u).expect("weight unit");
                        // SAFETY: a slot holds slot_bytes ≥ every streamed unit; the weights are registered and
                        // outlive the run; the slot is free (see above).
                        unsafe { gpu.h2d(Stream::H2d, dst, &uw.buf.as_slice()[..uw.bytes])? };
                        (format!("copy {u}"), uw.bytes as u64)
                    }
                    RingItem::Kv(l) | RingItem::AttnKv(l) => {
                        let mut bytes = 0;
                        let dst = if let RingItem::AttnKv(_) = item {
                            let uw = self.w.unit(UnitId::Attn { layer: l }).expect("attention unit");
                            // SAFETY: the slot holds align(attention bytes) + kv.bytes() (layout_phase sized it).
                            unsafe { gpu.h2d(Stream::H2d, dst, &uw.buf.as_slice()[..uw.bytes])? };
                            bytes = uw.bytes as u64;
                            dst + uw.bytes.next_multiple_of(crate::layout::REGION_ALIGN_BYTES) as u64
                        } else {
                            dst
                        };
                        gpu.wait(Stream::H2d, &kv_wb[l as usize])?;
                        let hb = self.host_kv[l as usize].as_slice();
                        let whole = self.kv.whole();
                        let half = whole.half_bytes();
                        // One copy per run of filled cells: one per sequence unless the cache is unified.
                        let runs = self.kv.filled(at);
                        for &(r, n) in &runs {
                            let (o, n) = (whole.row_offset(r), whole.row_offset(n));
                            // SAFETY: a slot holds ≥ whole.bytes() and the runs lie in it; the host rows were
                            // written back (waited above) and stay unmodified until the slot's release (no CPU
                            // unit uses a streamed layer's KV in this phase).
                            unsafe {
                                gpu.h2d(Stream::H2d, dst + o as u64, &hb[o..o + n])?;
                                gpu.h2d(Stream::H2d, dst + (half + o) as u64, &hb[half + o..half + o + n])?;
                            }
                            bytes += 2 * n as u64;
                        }
                        let rows: usize = runs.iter().map(|r| r.1).sum();
                        let what = if let RingItem::AttnKv(_) = item { "attn + kv" } else { "kv" };
                        let name = match runs.len() {
                            0 | 1 => format!("copy blk.{l}.{what} ({rows} rows)"),
                            n => format!("copy blk.{l}.{what} ({rows} rows, {n} copies)"),
                        };
                        (name, bytes)
                    }
                    RingItem::Experts(_) => unreachable!("placeholders are expanded before they are issued"),
                })
            })?;
            self.tl.gpu.push(GpuSpan { name, track: Track::H2d, start, end, bytes });
            ring.in_flight.push_back((item, slot));
            ring.pending.pop_front();
            ring.issued += 1;
        }
        Ok(())
    }

    /// Queues the ring items of pass `pass` (the output head only if the pass produces a token).
    fn queue_pass(&mut self, lay: &PhaseLayout, pass: usize, at: Pass, output: bool) {
        let Some(ring) = self.gpu.as_mut().and_then(|g| g.ring.as_mut()) else { return };
        if ring.queued_through.is_some_and(|q| q >= pass) {
            return;
        }
        for &item in &lay.ring_items {
            if output || item != RingItem::Weights(UnitId::Output) {
                ring.pending.push_back((item, pass, at));
            }
        }
        ring.queued_through = Some(pass);
    }

    /// Whether the next layer's ring items come next, so that taking them queues only device-side waits: the
    /// attention's (if it streams) in flight already, then the router's (if it streams) in flight, or first in
    /// line with a slot that the attention's release frees (or already free).
    fn ring_leads_with(&self, n: &NextLayer) -> bool {
        let items: Vec<RingItem> = n.ring.into_iter().chain(n.router_ring).collect();
        if items.is_empty() {
            return true;
        }
        let Some(ring) = self.gpu.as_ref().and_then(|g| g.ring.as_ref()) else { return false };
        let mut line =
            ring.in_flight.iter().map(|&(item, _)| item).chain(ring.pending.iter().map(|&(i, ..)| i));
        if !items.iter().all(|&item| line.next() == Some(item)) {
            return false;
        }
        let in_flight = ring.in_flight.iter().filter(|(item, _)| items.contains(item)).count();
        let attn_in_flight = n.ring.is_some_and(|a| ring.in_flight.front().map(|f| f.0) == Some(a));
        // A pending router item is issued by `pump` once a slot is free: the attention's release frees one.
        n.ring.is_none_or(|_| attn_in_flight)
            && (in_flight == items.len()
                || ring.issued - ring.released - usize::from(attn_in_flight) < ring.slots.len())
    }

    /// Waits (on the compute stream) for the next ring item, which must be `item`; returns its slot.
    fn acquire(&mut self, item: RingItem) -> Result<(usize, u64)> {
        self.pump()?;
        let g = self.gpu.as_mut().expect("streamed units run on the GPU");
        let ring = g.ring.as_mut().expect("a ring exists when units stream");
        let (it, slot) = ring
            .in_flight
            .pop_front()
            .ok_or_else(|| ExecError::Input(format!("ring stalled before {item:?}")))?;
        assert_eq!(it, item, "ring items are consumed in order");
        ring.events[slot].acquire(g.gpu, Stream::Compute)?;
        let addr = ring.slots[slot];
        self.pump()?;
        Ok((slot, addr))
    }

    fn release(&mut self, slot: usize, on: Stream) -> Result<()> {
        {
            let g = self.gpu.as_mut().expect("gpu");
            let ring = g.ring.as_mut().expect("ring");
            assert_eq!(slot, ring.released % ring.slots.len(), "ring slots are released in issue order");
            ring.events[slot].release(g.gpu, on)?;
            ring.released += 1;
        }
        self.pump()
    }

    /// Brings the residual stream to the host for CPU work on `pool`, whose workers poll meanwhile.
    fn ensure_host(&mut self, lay: &PhaseLayout, m: usize, pool: &CpuPool) -> Result<()> {
        if !self.h_on_dev {
            return Ok(());
        }
        let _warm = pool.keep_warm();
        let g = self.gpu.as_ref().expect("h is on the GPU only with a GPU");
        let n = m * self.d.hidden * 4;
        let t = self.tl.now_ns();
        // SAFETY: scratch.h holds ≥ m·hidden f32; h_host is registered and not read before the sync below.
        unsafe {
            g.gpu.d2h(
                Stream::Compute,
                &mut self.h_host.as_mut_slice()[..n],
                g.base() + lay.scratch.h as u64,
            )?;
        }
        g.gpu.sync(Stream::Compute)?;
        self.tl.host("sync: residual to host".into(), Track::Host, t);
        self.h_on_dev = false;
        Ok(())
    }

    /// Brings the residual stream to the GPU on `on`: on the compute stream by a kernel reading the mapped
    /// host copy, or as a copy on the H2D stream ahead of work that the compute stream orders after it by an
    /// event. A copy on the compute stream waited for the H2D stream's queue of weight copies to drain: in
    /// run31 a prefill chunk's embedding reached the GPU 5-10 ms late behind streamed FFNs (nemo-8b@8L at 3 GB:
    /// TTFT 9-15 % over the prediction).
    fn ensure_dev(&mut self, lay: &PhaseLayout, m: usize, on: Stream) -> Result<()> {
        if self.h_on_dev {
            return Ok(());
        }
        let g = self.gpu.as_ref().expect("gpu");
        let n = m * self.d.hidden * 4;
        let dst = g.base() + lay.scratch.h as u64;
        // SAFETY: scratch.h holds ≥ m·hidden f32; h_host is registered (and mapped at h_host_dev) and not
        // written until the next host sync of the compute stream, which the copy precedes.
        unsafe {
            match on {
                Stream::Compute => g.gpu.copy_mapped(&g.k, dst, g.h_host_dev, n)?,
                _ => g.gpu.h2d(on, dst, &self.h_host.as_slice()[..n])?,
            }
        }
        self.h_on_dev = true;
        Ok(())
    }

    /// One forward pass of `tokens` (those of `at`); with `output`, the sampled tokens of its output rows (the
    /// last token of a prefill chunk, every token of a decode step) and, if kept, their logits.
    #[allow(clippy::type_complexity)]
    fn forward(
        &mut self,
        lay: &PhaseLayout,
        pool: &CpuPool,
        tokens: &[u32],
        at: Pass,
        output: bool,
        pass: usize,
        next: Option<(Pass, bool)>,
    ) -> Result<Option<(Vec<u32>, Vec<Vec<f32>>)>> {
        let m = tokens.len();
        let logit_rows = match at {
            Pass::Prefill { .. } => 1,
            Pass::Decode { .. } => m,
        };
        self.queue_pass(lay, pass, at, output);
        if let Some((np, next_output)) = next {
            self.queue_pass(lay, pass + 1, np, next_output);
        }
        self.pump()?;
        self.h_on_dev = false;
        let mut result = None;
        for (i, step) in lay.steps.iter().enumerate() {
            let uw = self.w.unit(step.unit).expect("weight unit");
            match (uw.kind, step.weights.on_gpu()) {
                (UnitKind::Embd, false) => {
                    let t = self.tl.now_ns();
                    cpu::embed(pool, self.d, uw.buf.as_slice(), tokens, self.h_host.f32s_mut());
                    self.tl.host("cpu token_embd".into(), Track::Cpu, t);
                    self.h_on_dev = false;
                }
                (UnitKind::Embd, true) => self.gpu_embed(lay, step, tokens)?,
                (UnitKind::Attn(off), false) => {
                    self.ensure_host(lay, m, pool)?;
                    let UnitId::Attn { layer } = step.unit else { unreachable!("attention unit") };
                    let t = self.tl.now_ns();
                    cpu::attn_block(
                        pool,
                        self.d,
                        uw.buf.as_slice(),
                        &off,
                        self.host_kv[layer as usize].as_mut_slice(),
                        self.kv,
                        at,
                        self.h_host.f32s_mut(),
                    );
                    self.tl.host(format!("cpu {}", step.unit), Track::Cpu, t);
                }
                (UnitKind::Ffn(off), false) => {
                    self.ensure_host(lay, m, pool)?;
                    let t = self.tl.now_ns();
                    cpu::ffn_block(pool, self.d, uw.buf.as_slice(), &off, self.h_host.f32s_mut(), m);
                    self.tl.host(format!("cpu {}", step.unit), Track::Cpu, t);
                }
                (UnitKind::Attn(_), true) if self.pre_enqueued == step.unit.layer() => {}
                (UnitKind::Attn(_) | UnitKind::Ffn(_), true) => {
                    // The host's enqueue time: decode kernels are small, so a GPU span as long as this one
                    // is bound by the host's launches, not by the GPU.
                    let t = self.tl.now_ns();
                    self.gpu_block(lay, step, at, pass)?;
                    self.tl.host(format!("enqueue {}", step.unit), Track::Host, t);
                }
                (UnitKind::Router(_), _) => self.moe_layer(lay, pool, i, at, pass)?,
                // Experts run inside their layer's MoE block (at the router step), only where picked.
                (UnitKind::Expert(_), _) => {}
                (UnitKind::Output(off), on_gpu) => {
                    if !output {
                        continue;
                    }
                    result = Some(if on_gpu {
                        self.gpu_output(lay, step, m, logit_rows)?
                    } else {
                        self.ensure_host(lay, m, pool)?;
                        let t = self.tl.now_ns();
                        let h = &self.h_host.f32s()[(m - logit_rows) * self.d.hidden..m * self.d.hidden];
                        let lg = cpu::output_block(pool, self.d, uw.buf.as_slice(), &off, h);
                        self.tl.host("cpu output".into(), Track::Cpu, t);
                        let rows = lg.chunks_exact(self.d.vocab);
                        let toks = rows.clone().map(cpu::argmax).collect();
                        (
                            toks,
                            if self.opts.keep_logits {
                                rows.map(<[f32]>::to_vec).collect()
                            } else {
                                Vec::new()
                            },
                        )
                    });
                }
            }
        }
        debug_assert_eq!(self.pre_enqueued, None, "a pre-enqueued router runs in the same pass");
        if let Some(g) = &mut self.gpu {
            // The host reuses its staging buffers next pass: wait for this pass's compute work.
            g.gpu.sync(Stream::Compute)?;
            g.sample_vram()?;
        }
        Ok(result)
    }

    /// Replaces the front ring placeholder of `layer`'s streamed experts by the experts the router picked (in
    /// expert order) and issues their copies as slots free up.
    fn expand_experts(&mut self, layer: u32, picked: &[u32]) -> Result<()> {
        let ring = self.gpu.as_mut().and_then(|g| g.ring.as_mut()).expect("streamed experts imply a ring");
        let Some(&(RingItem::Experts(l), pass, at)) = ring.pending.front() else {
            return Err(ExecError::Input(format!(
                "ring out of order: layer {layer}'s experts are not next (front {:?})",
                ring.pending.front()
            )));
        };
        debug_assert_eq!(l, layer, "the front placeholder is this layer's");
        ring.pending.pop_front();
        for &expert in picked.iter().rev() {
            ring.pending.push_front((RingItem::Weights(UnitId::Expert { layer, expert }), pass, at));
        }
        self.pump()
    }

    /// One MoE layer, at its router step: the router where the router unit is placed, the routing on the host,
    /// then the picked experts only — GPU experts (pinned, or streamed and copied now) as per-expert cuBLAS
    /// calls over their gathered token rows, enqueued first, and CPU experts computed meanwhile on the host;
    /// the CPU partial sum is added on the side that holds the residual stream. `router` is the router's index
    /// in the layout's steps, of pass `pass` (`pass_at`).
    fn moe_layer(
        &mut self,
        lay: &PhaseLayout,
        pool: &CpuPool,
        router: usize,
        pass_at: Pass,
        pass: usize,
    ) -> Result<()> {
        let step = &lay.steps[router];
        let m = pass_at.tokens(self.kv.seqs);
        let d = self.d;
        let moe: MoeDims = d.moe.expect("router units exist only in MoE models");
        let UnitId::Router { layer } = step.unit else { unreachable!("router step") };
        let UnitKind::Router(roff) = self.w.unit(step.unit).expect("router unit").kind else {
            unreachable!("router unit kind")
        };
        let locs = &lay.experts[&layer];
        let (hd, e_n, fe) = (d.hidden, moe.n_experts, moe.expert_ffn);
        let has_cpu_experts = locs.iter().any(|l| !l.on_gpu());
        // A pre-enqueued router is already queued behind the previous layer's experts' sum: the host waits for
        // it from here on, with the CPU experts' workers polling.
        let pre_enqueued = self.pre_enqueued.take() == Some(layer);
        let mut warm = (pre_enqueued && has_cpu_experts).then(|| pool.keep_warm());
        if let Some(g) = &self.gpu {
            // The host rewrites the MoE staging buffer below: the previous layer's uploads must be done.
            g.gpu.sync_event(&g.moe_uploaded)?;
        }
        // 1. Router: normed input and logits, on the router's side; the logits come to the host. The CPU
        // experts' workers poll from the routing sync until their work starts.
        let xn: Vec<f32>;
        let logits: Vec<f32>;
        let xn_on_dev;
        if step.weights.on_gpu() {
            if !pre_enqueued {
                self.enqueue_router(lay, step, m, has_cpu_experts)?;
            }
            let (lo, xo) = (self.moe_io.logits, self.moe_io.xn);
            let g = self.gpu.as_ref().expect("gpu");
            let t = self.tl.now_ns();
            warm = warm.or_else(|| has_cpu_experts.then(|| pool.keep_warm()));
            g.gpu.sync(Stream::Compute)?;
            self.tl.host(format!("sync: blk.{layer} routing to host"), Track::Host, t);
            let buf = self.moe_io.buf.as_slice();
            logits = buf[lo..lo + m * e_n * 4]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            xn = if has_cpu_experts {
                let mut v = vec![0f32; m * hd];
                d.mat.read_row(&buf[xo..xo + m * hd * d.mat.size_bytes()], &mut v);
                v
            } else {
                Vec::new()
            };
            xn_on_dev = true;
        } else {
            self.ensure_host(lay, m, pool)?;
            let t = self.tl.now_ns();
            let ru = self.w.unit(step.unit).expect("router unit");
            (xn, logits) = cpu::router_block(pool, d, e_n, ru.buf.as_slice(), &roff, self.h_host.f32s(), m);
            self.tl.host(format!("cpu {}", step.unit), Track::Cpu, t);
            xn_on_dev = false;
        }
        // 2. Routing and the token permutation (tokens ascending within each expert, experts ascending), under
        // a host span of its own: a 1008-token prefill spent 2–3 ms a layer between the routing sync and the
        // first expert on the H200's host, which the simulator does not price yet (run25-quick).
        let t_route = self.tl.now_ns();
        let routing = Routing::from_logits(pool, &logits, e_n, moe.top_k, moe.norm_topk_prob);
        if self.opts.keep_logits {
            self.routes.extend(&routing.experts);
        }
        let lists = routing.per_expert(e_n);
        let picked = |on_gpu: bool| -> Vec<u32> {
            (0..e_n as u32)
                .filter(|&e| !lists[e as usize].is_empty() && locs[e as usize].on_gpu() == on_gpu)
                .collect()
        };
        let (mut gpu_experts, cpu_experts) = (picked(true), picked(false));
        // Pinned experts first (a stable sort: ascending within each kind), so that they run under one timeline
        // span: a span costs two event creations and records of host time, and decode experts are host-bound
        // (on the H200 a qwen3-30b-a3b expert took 53 µs under its own span against 40 µs for its six
        // launches, when gate and up were two matmuls).
        gpu_experts.sort_by_key(|&e| !matches!(locs[e as usize], WeightLoc::Pinned(_)));
        let pinned =
            gpu_experts.iter().take_while(|&&e| matches!(locs[e as usize], WeightLoc::Pinned(_))).count();
        // The pinned experts as two grouped launches ([`GroupedExperts`]) where the step is small enough and the
        // scratch holds the grouped rows; they share one set of offsets in their units.
        let offsets = |e: u32| match self.w.unit(UnitId::Expert { layer, expert: e }).map(|u| u.kind) {
            Some(UnitKind::Expert(o)) => Some(o),
            _ => None,
        };
        // The offsets every pinned expert's unit shares, where `ok`: the grouped and tiled kernels take one set.
        let shared_offsets = |ok: bool| {
            ok.then(|| offsets(gpu_experts[0]))
                .flatten()
                .filter(|&o| gpu_experts[..pinned].iter().all(|&e| offsets(e) == Some(o)))
        };
        let grouped_offsets = shared_offsets(
            pinned > 0
                && self.opts.grouped_experts == GroupedExperts::On
                && lay.scratch.moe_grouped
                && grouped_experts_fit(d.quant, m, hd, fe),
        );
        // Steps of more tokens take the tiled kernels ([`tiled`]) for the pinned experts, three launches a group
        // whose entries fit the per-expert path's `moe_act`/`moe_y` rows, with their index in its `moe_gate_up`
        // (which the tiled kernels leave unused). They round quantised weights to the activation type, as the
        // per-expert path does above EXACT_MAX_TOKENS rows only: a quantised expert of fewer tokens keeps its
        // exact GEMVs (CPU and GPU compute the same function at every count; `quant::EXACT_MAX_TOKENS`), after
        // the tiled ones. In a 1024-token chunk of qwen3-30b-a3b (≈ 63 tokens an expert) there are none.
        let exact = |e: u32| d.quant.is_some() && lists[e as usize].len() <= EXACT_MAX_TOKENS;
        let tiled_n = gpu_experts[..pinned].iter().filter(|&&e| !exact(e)).count();
        let tiled_entries: usize =
            gpu_experts[..pinned].iter().filter(|&&e| !exact(e)).map(|&e| lists[e as usize].len()).sum();
        let rows = lay.scratch.tokens;
        let index_max = tiled::tiled_index_max_bytes(m, tiled_entries, tiled_n, rows);
        let tiled_offsets = shared_offsets(
            tiled_n > 0
                && m > EXACT_MAX_TOKENS
                && self.opts.grouped_experts == GroupedExperts::On
                && tiled_experts_fit(hd, fe)
                && index_max <= self.moe_io.tiled_bytes
                && index_max <= 2 * rows * fe * 4,
        );
        if tiled_offsets.is_some() {
            // The tiled experts first, then the exact ones, each kind ascending (a stable sort).
            gpu_experts[..pinned].sort_by_key(|&e| exact(e));
        }
        // 3. GPU experts' token lists (and the normed input, if the router ran on the CPU) go up, before the
        // streamed experts' copies are queued, on the stream `expert_inputs_stream` says; on the H2D stream,
        // the compute stream waits for them by an event.
        let up = expert_inputs_stream(locs, &gpu_experts);
        let mut tiled_index = None;
        if !gpu_experts.is_empty() {
            if up == Stream::H2d {
                // The uploads overwrite what the compute stream read last: ordered by an event, though that
                // stream is idle since the routing.
                let g = self.gpu.as_ref().expect("gpu");
                g.gpu.record(&g.mark, Stream::Compute)?;
                g.gpu.wait(Stream::H2d, &g.mark)?;
            }
            self.ensure_dev(lay, m, up)?;
            let mio = &mut self.moe_io;
            let (io_idx, io_w, io_xn) = (mio.idx, mio.w, mio.xn);
            let io_tiled = mio.tiled..mio.tiled + mio.tiled_bytes;
            let buf = mio.buf.as_mut_slice();
            let (io_gbase, io_gfirst) = (mio.gbase, mio.gfirst);
            let arena = self.gpu.as_ref().expect("gpu").base();
            let mut n = 0;
            for (i, &e) in gpu_experts.iter().enumerate() {
                if grouped_offsets.is_some() && i < pinned {
                    // Expert i of the group: its unit's address and its first entry.
                    let WeightLoc::Pinned(o) = locs[e as usize] else { unreachable!("pinned experts first") };
                    let addr = arena + o as u64;
                    buf[io_gbase + 8 * i..io_gbase + 8 * i + 8].copy_from_slice(&addr.to_le_bytes());
                    buf[io_gfirst + 4 * i..io_gfirst + 4 * i + 4].copy_from_slice(&(n as u32).to_le_bytes());
                }
                for &(t, w) in &lists[e as usize] {
                    buf[io_idx + 4 * n..io_idx + 4 * n + 4].copy_from_slice(&t.to_le_bytes());
                    buf[io_w + 4 * n..io_w + 4 * n + 4].copy_from_slice(&w.to_le_bytes());
                    n += 1;
                }
                if grouped_offsets.is_some() && i + 1 == pinned {
                    let end = 4 * pinned;
                    buf[io_gfirst + end..io_gfirst + end + 4].copy_from_slice(&(n as u32).to_le_bytes());
                }
            }
            if !xn_on_dev {
                d.mat.write_row(&xn, &mut buf[io_xn..io_xn + m * hd * d.mat.size_bytes()]);
            }
            if tiled_offsets.is_some() {
                let units: Vec<(u64, usize)> = gpu_experts[..tiled_n]
                    .iter()
                    .map(|&e| {
                        let WeightLoc::Pinned(o) = locs[e as usize] else {
                            unreachable!("pinned experts first")
                        };
                        (arena + o as u64, lists[e as usize].len())
                    })
                    .collect();
                let tokens: Vec<u32> = gpu_experts[..tiled_n]
                    .iter()
                    .flat_map(|&e| lists[e as usize].iter().map(|l| l.0))
                    .collect();
                tiled_index =
                    Some(tiled::build_tiled_index(&units, &tokens, m, rows, &mut buf[io_tiled.clone()]));
            }
            let g = self.gpu.as_ref().expect("gpu");
            let (base, sc) = (g.base(), lay.scratch);
            let at = |o: usize| base + o as u64;
            let buf = self.moe_io.buf.as_slice();
            // A small step's inputs on the compute stream go up with one launch: copies there waited for a copy
            // engine that a streamed unit's copy held (validation, session 21: a decode layer's GPU experts
            // started 48 µs after their router with a copy in flight, 24 without). Their bytes ride in the
            // launch's parameters where they fit (a decode step's routing, ~170 bytes); else the kernel reads
            // the mapped staging buffer, whose loads queue behind that copy's on the link (36 µs).
            let mapped =
                up == Stream::Compute && m as u64 <= GROUPED_EXPERTS_MAX_TOKENS && tiled_index.is_none();
            if mapped {
                let mut list = vec![(at(sc.moe_idx), io_idx, 4 * n), (at(sc.moe_w), io_w, 4 * n)];
                if !xn_on_dev {
                    list.push((at(sc.xb), io_xn, m * hd * 2));
                }
                if grouped_offsets.is_some() {
                    let (gb, gf) = (self.moe_io.gbase, self.moe_io.gfirst);
                    list.extend([
                        (at(sc.moe_gbase), gb, 8 * pinned),
                        (at(sc.moe_gfirst), gf, 4 * (pinned + 1)),
                    ]);
                }
                let bytes: Vec<(u64, &[u8])> = list.iter().map(|&(d, o, b)| (d, &buf[o..o + b])).collect();
                if let Some(parts) = InlineParts::new(&bytes) {
                    // SAFETY: every destination is a carved scratch area holding its part (as below).
                    unsafe { g.gpu.copy_inline_parts(&g.k, &parts)? };
                } else {
                    let mut parts = MappedParts::default();
                    for &(d, o, b) in &list {
                        parts.push(d, g.moe_io_dev + o as u64, b);
                    }
                    // SAFETY: as the copies' below; moe_io is mapped at `moe_io_dev`.
                    unsafe { g.gpu.copy_mapped_parts(&g.k, &parts)? };
                }
            } else {
                // SAFETY: moe_idx/moe_w hold m·top_k ≥ n entries and xb m·hidden activations; moe_io is
                // registered and rewritten only after `moe_uploaded` (recorded below on the compute stream,
                // which waits for these uploads) has completed.
                unsafe {
                    g.gpu.h2d(up, at(sc.moe_idx), &buf[io_idx..io_idx + 4 * n])?;
                    g.gpu.h2d(up, at(sc.moe_w), &buf[io_w..io_w + 4 * n])?;
                    if !xn_on_dev {
                        g.gpu.h2d(up, at(sc.xb), &buf[io_xn..io_xn + m * hd * 2])?;
                    }
                    // moe_gbase/moe_gfirst hold m·top_k ≥ pinned (+ 1) entries (carved with `moe_grouped`).
                    if grouped_offsets.is_some() {
                        let (gb, gf) = (self.moe_io.gbase, self.moe_io.gfirst);
                        g.gpu.h2d(up, at(sc.moe_gbase), &buf[gb..gb + 8 * pinned])?;
                        g.gpu.h2d(up, at(sc.moe_gfirst), &buf[gf..gf + 4 * (pinned + 1)])?;
                    }
                    // The tiled experts' index, into `moe_gate_up` (it fits: `tiled_offsets`).
                    if let Some(ix) = &tiled_index {
                        let at_host = io_tiled.start;
                        g.gpu.h2d(up, at(sc.moe_gate_up), &buf[at_host..at_host + ix.bytes])?;
                    }
                }
            }
            if up == Stream::H2d {
                g.gpu.record(&g.expert_inputs, Stream::H2d)?;
                g.gpu.wait(Stream::Compute, &g.expert_inputs)?;
            }
        }
        self.tl.host(format!("route blk.{layer} ({m} tokens)"), Track::Host, t_route);
        if locs.contains(&WeightLoc::Streamed) {
            let streamed: Vec<u32> =
                gpu_experts.iter().copied().filter(|&e| locs[e as usize] == WeightLoc::Streamed).collect();
            self.expand_experts(layer, &streamed)?;
        }
        // Pinned experts, then streamed ones as their ring slots free up, under a host span: the host's pace
        // apart from the device's (run31's trace could not tell them apart; see `expert_inputs_stream`).
        let enqueue_gpu_experts = |ex: &mut Self| -> Result<()> {
            let t = ex.tl.now_ns();
            let first = match (grouped_offsets, tiled_offsets.zip(tiled_index.as_ref())) {
                (Some(o), _) => {
                    ex.enqueue_grouped_experts(lay, layer, &lists, &gpu_experts[..pinned], o, m)?
                }
                (None, Some((o, ix))) => {
                    let first = ex.enqueue_tiled_experts(lay, layer, ix, tiled_n, o, m)?;
                    ex.enqueue_experts(lay, layer, &lists, &gpu_experts[tiled_n..pinned], true, first)?
                }
                (None, None) => ex.enqueue_experts(lay, layer, &lists, &gpu_experts[..pinned], true, 0)?,
            };
            ex.enqueue_experts(lay, layer, &lists, &gpu_experts[pinned..], false, first)?;
            if !gpu_experts.is_empty() {
                let n = gpu_experts.len();
                ex.tl.host(
                    format!("enqueue blk.{layer} experts ({pinned} pinned, {} streamed)", n - pinned),
                    Track::Host,
                    t,
                );
            }
            Ok(())
        };
        // 4. CPU experts start first (they are the longer side) on the pool, while this thread enqueues the GPU
        // experts (and, where it can, pre-enqueues what follows the CPU experts); the CPU experts' sum joins the
        // residual stream where it is.
        // The workers stop polling here whether or not CPU experts were picked.
        drop(warm);
        // Whether `moe_uploaded` was recorded after this layer's last upload from the staging buffer already.
        let mut uploads_recorded = false;
        if cpu_experts.is_empty() {
            enqueue_gpu_experts(self)?;
        } else {
            let w = self.w;
            let units: Vec<_> = cpu_experts
                .iter()
                .map(|&e| {
                    let u = w.unit(UnitId::Expert { layer, expert: e }).expect("expert unit");
                    let UnitKind::Expert(o) = u.kind else { unreachable!("expert unit kind") };
                    (u.buf.as_slice(), o, lists[e as usize].as_slice())
                })
                .collect();
            let name = format!("cpu blk.{layer} experts ({})", cpu_experts.len());
            let (clock, t) = (self.tl.start, self.tl.now_ns());
            if self.h_on_dev {
                let decode = matches!(pass_at, Pass::Decode { .. });
                let next = self
                    .gpu
                    .as_ref()
                    .is_some_and(|g| g.gate.is_some())
                    .then(|| pre_enqueue_steps(&lay.steps, router, decode));
                let mut part = vec![0f32; m * hd];
                let (cpu_end_ns, enqueued) = pool.alongside(
                    || {
                        cpu::experts_block(pool, d, fe, &xn, &units, &mut part);
                        clock.elapsed().as_nanos() as u64
                    },
                    || -> Result<Option<Gate>> {
                        enqueue_gpu_experts(self)?;
                        // After this layer's streamed experts took their slots, the next layer's ring items must
                        // come next.
                        let next = next.map(|n| {
                            n.and_then(|n| {
                                if self.ring_leads_with(&n) {
                                    Ok(n)
                                } else {
                                    Err(NotPreEnqueued::RingItemsNotNext)
                                }
                            })
                        });
                        // Layers with no MoE layer next (the last one) could never be: they are not counted.
                        if decode
                            && let Some(r) = &next
                            && r.as_ref().err() != Some(&NotPreEnqueued::NoNextMoeLayer)
                        {
                            self.count_pre_enqueue(r.as_ref().err().copied());
                        }
                        next.and_then(Result::ok)
                            .map(|n| self.pre_enqueue(lay, layer, &n, pass_at, pass, m))
                            .transpose()
                    },
                );
                // An error after a gate's wait was queued dropped the gate, which opened it: the queued work runs
                // on stale inputs, and the run fails.
                let gate = enqueued?;
                self.tl.spans.push((name, Track::Cpu, t, cpu_end_ns.saturating_sub(t)));
                let po = self.moe_io.part;
                let buf = self.moe_io.buf.as_mut_slice();
                Elem::F32.write_row(&part, &mut buf[po..po + 4 * m * hd]);
                if gate.is_some() {
                    // The upload and the add wait behind the gate, which opens here.
                    drop(gate);
                    uploads_recorded = true;
                } else {
                    let g = self.gpu.as_ref().expect("gpu");
                    let at = |o: usize| g.base() + o as u64;
                    let sc = lay.scratch;
                    // SAFETY: h holds m·hidden f32; moe_io is mapped at moe_io_dev and holds the sum at `po`,
                    // which the host rewrites only after `moe_uploaded`, recorded after this kernel.
                    unsafe { g.gpu.add_mapped(&g.k, at(sc.h), g.moe_io_dev + po as u64, m * hd)? };
                }
                // From the pool's last expert to the sum's upload enqueued or its gate opened: the host
                // thread's wake-up included.
                self.tl.host(format!("cpu → gpu: blk.{layer} experts' sum"), Track::Host, cpu_end_ns);
            } else {
                if matches!(pass_at, Pass::Decode { .. })
                    && self.gpu.as_ref().is_some_and(|g| g.gate.is_some())
                {
                    self.count_pre_enqueue(Some(NotPreEnqueued::ResidualOnHost));
                }
                // No GPU expert ran (it would have moved the residual stream to the device).
                cpu::experts_block(pool, d, fe, &xn, &units, self.h_host.f32s_mut());
                self.tl.host(name, Track::Cpu, t);
            }
        }
        if let (Some(g), false) = (&self.gpu, uploads_recorded) {
            g.gpu.record(&g.moe_uploaded, Stream::Compute)?;
        }
        Ok(())
    }

    /// Counts a decode layer with CPU experts: pre-enqueued (`None`) or not, and why.
    fn count_pre_enqueue(&mut self, skipped: Option<NotPreEnqueued>) {
        self.pre_enqueue_count.0 += 1;
        if let Some(why) = skipped {
            *self.pre_enqueue_count.1.entry(why).or_default() += 1;
        }
    }

    /// Enqueues the GPU router of `step` over the pass's `m` rows: the normed input and the logits, and their
    /// copies to the host (the normed input only for CPU experts, `to_cpu`), which reads them after a sync.
    fn enqueue_router(&mut self, lay: &PhaseLayout, step: &Step, m: usize, to_cpu: bool) -> Result<()> {
        let d = self.d;
        let (hd, e_n) = (d.hidden, d.moe.expect("router units exist only in MoE models").n_experts);
        let UnitKind::Router(roff) = self.w.unit(step.unit).expect("router unit").kind else {
            unreachable!("router unit kind")
        };
        self.ensure_dev(lay, m, Stream::Compute)?;
        let (wb, slot) = self.weights_base(lay, step)?;
        let g = self.gpu.as_ref().expect("gpu");
        let (base, sc) = (g.base(), lay.scratch);
        let at = |o: usize| base + o as u64;
        let start = g.span_start(Stream::Compute)?;
        let mio = &mut self.moe_io;
        let buf = mio.buf.as_mut_slice();
        let (lo, xo) = (mio.logits, mio.xn);
        // SAFETY: h holds m rows, xb m·hidden activations, moe_logits m·n_experts f32 (scratch_layout); the
        // router unit holds its norm and [n_experts, hidden] matrix at these offsets; moe_io is registered and
        // read only after a sync of the compute stream.
        unsafe {
            g.gpu.norm_act(
                &g.k,
                at(sc.h),
                wb + roff.norm_w as u64,
                roff.norm_b.map_or(0, |b| wb + b as u64),
                at(sc.xb),
                m,
                hd,
                d.norm_eps,
                d.norm == pipeshard_core::model::NormKind::LayerNorm,
            )?;
            g.gpu.matmul(
                &g.k,
                d.quant,
                wb + roff.gate_inp as u64,
                at(sc.xb),
                at(sc.moe_logits),
                m,
                e_n,
                hd,
                false,
            )?;
            g.gpu.d2h(Stream::Compute, &mut buf[lo..lo + m * e_n * 4], at(sc.moe_logits))?;
            if to_cpu {
                g.gpu.d2h(Stream::Compute, &mut buf[xo..xo + m * hd * 2], at(sc.xb))?;
            }
        }
        g.span_end(&mut self.tl, format!("gpu {}", step.unit), Track::Compute, Stream::Compute, start)?;
        if let Some(s) = slot {
            self.release(s, Stream::Compute)?;
        }
        Ok(())
    }

    /// Queues, behind a new gate on the compute stream, the GPU work that follows `layer`'s CPU experts
    /// ([`PreEnqueue`]): the upload of their sum (from `moe_io.part`, where the host writes it before it opens
    /// the gate) and its add into the residual stream, then the next layer's `attn` and `router` steps up to the
    /// copy of the router's results to the host. Returns the gate, which opens when dropped. A streamed attention
    /// takes its ring slot, already copied, behind the gate, and releases it (its KV's write-back too) there.
    fn pre_enqueue(
        &mut self,
        lay: &PhaseLayout,
        layer: u32,
        next: &NextLayer,
        pass_at: Pass,
        pass: usize,
        m: usize,
    ) -> Result<Gate> {
        let t = self.tl.now_ns();
        let g = self.gpu.as_mut().expect("gpu");
        let flag = g.gate.clone().expect("pre-enqueue needs the gate");
        let seq = g.gate_seq.wrapping_add(1);
        // SAFETY: the flag lives in GpuSide, whose drop syncs the streams before its fields drop; the gate made
        // next releases it to `seq` on every path out of here and out of the caller.
        unsafe { g.gpu.wait_flag(Stream::Compute, &flag, seq)? };
        g.gate_seq = seq;
        let gate = Gate { flag, seq };
        let g = self.gpu.as_ref().expect("gpu");
        let (base, sc) = (g.base(), lay.scratch);
        let (n, po) = (m * self.d.hidden, self.moe_io.part);
        // Starts when the device has seen the gate open.
        let start = g.span_start(Stream::Compute)?;
        // SAFETY: h holds m·hidden f32; moe_io is mapped at moe_io_dev, and the kernel reads its `part` only
        // after the gate opens, which the host does after writing the sum there (HostFlag::release orders the
        // two); the host next rewrites it after `moe_uploaded`, recorded after this kernel.
        unsafe { g.gpu.add_mapped(&g.k, base + sc.h as u64, g.moe_io_dev + po as u64, n)? };
        let name = format!("gpu blk.{layer} experts' sum (gated)");
        g.span_end(&mut self.tl, name, Track::Compute, Stream::Compute, start)?;
        // The layer's last upload from the staging buffer (its GPU experts' token lists precede it).
        g.gpu.record(&g.moe_uploaded, Stream::Compute)?;
        self.gpu_block(lay, &next.attn, pass_at, pass)?;
        let to_cpu = lay.experts[&(layer + 1)].iter().any(|l| !l.on_gpu());
        self.enqueue_router(lay, &next.router, m, to_cpu)?;
        self.pre_enqueued = Some(layer + 1);
        self.tl.host(format!("pre-enqueue blk.{} attn + router", layer + 1), Track::Host, t);
        Ok(gate)
    }

    /// Enqueues `experts` of `layer` on the GPU, their tokens at `first` onwards of the uploaded token lists
    /// (pinned experts under one timeline span, each streamed one under its own, waiting for its ring slot);
    /// returns the next token list position.
    fn enqueue_experts(
        &mut self,
        lay: &PhaseLayout,
        layer: u32,
        lists: &[Vec<(u32, f32)>],
        experts: &[u32],
        pinned: bool,
        mut first: usize,
    ) -> Result<usize> {
        let Some(&last) = experts.last() else { return Ok(first) };
        let d = self.d;
        let (hd, fe) = (d.hidden, d.moe.expect("MoE layer").expert_ffn);
        let locs = &lay.experts[&layer];
        let mut group =
            if pinned { Some(self.gpu.as_ref().expect("gpu").span_start(Stream::Compute)?) } else { None };
        for &e in experts {
            let c = lists[e as usize].len();
            // cuBLAS pays ≈ 0.4 ms of host time the first time it sees a GEMM shape (measured on the H200: an
            // expert's 35-token GEMMs took 393 µs, the same shape again 40 µs), and a prefill chunk gives every
            // expert another token count. The GEMMs run over the count rounded up to a power of two (warm_up
            // warms those); rows past `c` hold stale activations and their results are not scattered.
            let rows = c.next_power_of_two().min(lay.scratch.tokens).max(c);
            let unit = UnitId::Expert { layer, expert: e };
            let (wb, slot) = self.weights_base(lay, &Step { unit, weights: locs[e as usize], kv: None })?;
            let UnitKind::Expert(o) = self.w.unit(unit).expect("expert unit").kind else {
                unreachable!("expert unit kind")
            };
            let g = self.gpu.as_ref().expect("gpu");
            let (base, sc) = (g.base(), lay.scratch);
            let at = |o: usize| base + o as u64;
            let start = if pinned { None } else { Some(g.span_start(Stream::Compute)?) };
            let io = ExpertIo {
                xn: at(sc.xb),
                idx: at(sc.moe_idx) + 4 * first as u64,
                wts: at(sc.moe_w) + 4 * first as u64,
                x: at(sc.moe_x),
                gate_up: at(sc.moe_gate_up),
                act: at(sc.moe_act),
                y: at(sc.moe_y),
                h: at(sc.h),
            };
            // SAFETY: c ≤ rows ≤ m rows fit moe_x/moe_gate_up/moe_act/moe_y (sized for m); idx/wts hold c
            // entries at `first`; the expert's slices are at wb with these offsets; token ids are < m rows of xb
            // and h.
            unsafe { g.gpu.expert_ffn(&g.k, d.quant, wb, o, &io, c, rows, hd, fe)? };
            first += c;
            if let Some(start) = start {
                g.span_end(
                    &mut self.tl,
                    format!("gpu {unit} ({c} tokens)"),
                    Track::Compute,
                    Stream::Compute,
                    start,
                )?;
            } else if e == last {
                let start = group.take().expect("pinned experts open a group span");
                let name = format!("gpu blk.{layer} experts ({} pinned, {first} tokens)", experts.len());
                g.span_end(&mut self.tl, name, Track::Compute, Stream::Compute, start)?;
            }
            if let Some(s) = slot {
                self.release(s, Stream::Compute)?;
            }
        }
        Ok(first)
    }

    /// Enqueues a layer's pinned picked experts as two grouped launches over the step's `m` tokens
    /// (`Gpu::grouped_experts`, [`GroupedExperts`]): 2 launches instead of 5 an expert. Their entries are the
    /// first of `moe_idx`/`moe_w`, and their unit addresses and entry offsets are in `moe_gbase`/`moe_gfirst`
    /// (uploaded by `moe_layer`). Returns the number of entries, where the streamed experts' start.
    fn enqueue_grouped_experts(
        &mut self,
        lay: &PhaseLayout,
        layer: u32,
        lists: &[Vec<(u32, f32)>],
        experts: &[u32],
        o: ExpertOffsets,
        m: usize,
    ) -> Result<usize> {
        let d = self.d;
        let (hd, fe) = (d.hidden, d.moe.expect("MoE layer").expert_ffn);
        let entries: usize = experts.iter().map(|&e| lists[e as usize].len()).sum();
        let g = self.gpu.as_ref().expect("gpu");
        let (base, sc) = (g.base(), lay.scratch);
        let at = |o: usize| base + o as u64;
        let start = g.span_start(Stream::Compute)?;
        let io = GroupedIo {
            base: at(sc.moe_gbase),
            first: at(sc.moe_gfirst),
            idx: at(sc.moe_idx),
            wts: at(sc.moe_w),
            xn: at(sc.xb),
            act: at(sc.moe_gact),
            h: at(sc.h),
        };
        // SAFETY: `moe_grouped` carved moe_gbase/moe_gfirst for m·top_k ≥ experts.len() (+ 1) entries, uploaded
        // before on the compute stream, and moe_gact for m·top_k ≥ `entries` rows of ffn; each pinned expert's
        // list holds ≤ m ≤ EXACT_MAX_TOKENS distinct token rows (< m) of xb and h; the units are pinned in the
        // arena at 256-byte aligned offsets, their tensors in `d.quant`'s format and 16-byte aligned at `o`
        // (every expert's, checked by the caller); rows are 16-byte aligned as `grouped_experts_fit` checked
        // hidden and ffn.
        unsafe { g.gpu.grouped_experts(&g.k, d.quant, o, &io, experts.len(), m, hd, fe)? };
        let name = format!("gpu blk.{layer} experts ({} pinned, grouped, {entries} tokens)", experts.len());
        g.span_end(&mut self.tl, name, Track::Compute, Stream::Compute, start)?;
        Ok(entries)
    }

    /// Enqueues a layer's `pinned` pinned picked experts as the tiled kernels' groups (`Gpu::tiled_experts`,
    /// [`tiled`]), three launches a group, under one timeline span: their entries are the first of
    /// `moe_idx`/`moe_w` and their index is in `moe_gate_up` (uploaded by `moe_layer`). Returns the number of
    /// entries, where the streamed experts' start.
    fn enqueue_tiled_experts(
        &mut self,
        lay: &PhaseLayout,
        layer: u32,
        ix: &tiled::TiledIndex,
        pinned: usize,
        o: ExpertOffsets,
        m: usize,
    ) -> Result<usize> {
        let d = self.d;
        let (hd, fe) = (d.hidden, d.moe.expect("MoE layer").expert_ffn);
        let entries = ix.groups.last().map_or(0, |g| g.entries.end);
        let g = self.gpu.as_ref().expect("gpu");
        let (base, sc) = (g.base(), lay.scratch);
        let at = |o: usize| base + o as u64;
        let start = g.span_start(Stream::Compute)?;
        for group in &ix.groups {
            let io = TiledIo {
                tiles: at(sc.moe_gate_up) + (16 * group.tiles.start) as u64,
                idx: at(sc.moe_idx),
                wts: at(sc.moe_w),
                tok_first: at(sc.moe_gate_up) + group.tok_first as u64,
                tok_ent: at(sc.moe_gate_up) + ix.tok_ent as u64,
                xn: at(sc.xb),
                act: at(sc.moe_act),
                y: at(sc.moe_y),
                h: at(sc.h),
            };
            // SAFETY: the index (uploaded before on the compute stream, or waited for) lays out this group's
            // tiles and token lists over entries of `moe_idx`/`moe_w`, token rows < m of xb and h; a group holds
            // at most `lay.scratch.tokens` entries, the rows of moe_act and moe_y; the units are pinned in the
            // arena, every pinned expert's tensors at `o` (checked by the caller), rows 16-byte aligned as
            // `tiled_experts_fit` checked hidden and ffn; moe_gate_up holds the index (`tiled_offsets`).
            unsafe {
                g.gpu.tiled_experts(
                    &g.k,
                    d.quant,
                    o,
                    &io,
                    group.tiles.len(),
                    group.entries.start,
                    m,
                    hd,
                    fe,
                )?;
            }
        }
        let name = format!(
            "gpu blk.{layer} experts ({pinned} pinned, tiled in {} groups, {entries} tokens)",
            ix.groups.len()
        );
        g.span_end(&mut self.tl, name, Track::Compute, Stream::Compute, start)?;
        Ok(entries)
    }

    /// Device address of a GPU step's weights, acquiring a ring slot or staging the unit as its location says.
    fn weights_base(&mut self, lay: &PhaseLayout, step: &Step) -> Result<(u64, Option<usize>)> {
        let base = self.gpu.as_ref().expect("gpu").base();
        Ok(match step.weights {
            WeightLoc::Pinned(o) => (base + o as u64, None),
            WeightLoc::Streamed => {
                let (slot, addr) = self.acquire(RingItem::Weights(step.unit))?;
                (addr, Some(slot))
            }
            WeightLoc::Staged(o) => {
                let off = lay.staging.expect("staged units have a staging area").0 + o;
                let g = self.gpu.as_ref().expect("gpu");
                let uw = self.w.unit(step.unit).expect("weight unit");
                let start = g.span_start(Stream::Compute)?;
                // SAFETY: the staging area holds ≥ o + align(u.bytes); the compute stream orders this copy after
                // the previous staged unit's compute; weights are registered and outlive the run.
                unsafe { g.gpu.h2d(Stream::Compute, base + off as u64, &uw.buf.as_slice()[..uw.bytes])? };
                g.span_end(&mut self.tl, format!("stage {}", step.unit), Track::H2d, Stream::Compute, start)?;
                if let Some(s) = self.tl.gpu.last_mut() {
                    s.bytes = uw.bytes as u64;
                }
                (base + off as u64, None)
            }
            WeightLoc::Cpu => unreachable!("CPU units have no device weights"),
        })
    }

    fn gpu_embed(&mut self, lay: &PhaseLayout, step: &Step, tokens: &[u32]) -> Result<()> {
        let m = tokens.len();
        for (i, t) in tokens.iter().enumerate() {
            self.io.buf.as_mut_slice()[self.io.ids + 4 * i..self.io.ids + 4 * i + 4]
                .copy_from_slice(&t.to_le_bytes());
        }
        let (wb, slot) = self.weights_base(lay, step)?;
        let g = self.gpu.as_ref().expect("gpu");
        let base = g.base();
        let start = g.span_start(Stream::Compute)?;
        // SAFETY: scratch ids hold m u32, h holds m·hidden f32; the table holds vocab·hidden in-range rows (token ids
        // were checked against the vocabulary); io is registered and rewritten only after the end-of-pass sync.
        unsafe {
            g.gpu.h2d(
                Stream::Compute,
                base + lay.scratch.ids as u64,
                &self.io.buf.as_slice()[self.io.ids..self.io.ids + 4 * m],
            )?;
            g.gpu.embed(
                &g.k,
                self.d.quant,
                wb,
                base + lay.scratch.ids as u64,
                base + lay.scratch.h as u64,
                m,
                self.d.hidden,
            )?;
        }
        g.span_end(&mut self.tl, "gpu token_embd".into(), Track::Compute, Stream::Compute, start)?;
        self.h_on_dev = true;
        if let Some(s) = slot {
            self.release(s, Stream::Compute)?;
        }
        Ok(())
    }

    fn gpu_block(&mut self, lay: &PhaseLayout, step: &Step, pass_at: Pass, pass: usize) -> Result<()> {
        let m = pass_at.tokens(self.kv.seqs);
        self.ensure_dev(lay, m, Stream::Compute)?;
        let d = self.d;
        let joint = matches!(
            (step.unit, step.weights, step.kv),
            (UnitId::Attn { .. }, WeightLoc::Streamed, Some(KvLoc::Streamed))
        );
        let uw = self.w.unit(step.unit).expect("weight unit");
        let (wb, wslot) = if let (true, UnitId::Attn { layer }) = (joint, step.unit) {
            let (slot, addr) = self.acquire(RingItem::AttnKv(layer))?;
            (addr, Some(slot))
        } else {
            self.weights_base(lay, step)?
        };
        let base = self.gpu.as_ref().expect("gpu").base();
        let sc = lay.scratch;
        let at = |o: usize| base + o as u64;
        let whole = self.kv.whole();
        let half = whole.half_bytes() as u64;
        let mut kslot = None;
        let kv_base = match step.kv {
            // No KV, or op offload's attention over the host KV, whose rows come up per chunk (below).
            None | Some(KvLoc::Host) => 0,
            Some(KvLoc::Pinned(o)) => at(o),
            Some(KvLoc::Streamed) if joint => {
                wb + uw.bytes.next_multiple_of(crate::layout::REGION_ALIGN_BYTES) as u64
            }
            Some(KvLoc::Streamed) => {
                let UnitId::Attn { layer } = step.unit else { unreachable!("KV belongs to attention") };
                let (slot, addr) = self.acquire(RingItem::Kv(layer))?;
                kslot = Some(slot);
                addr
            }
        };
        let g = self.gpu.as_ref().expect("gpu");
        let gpu = g.gpu;
        let k = &g.k;
        let ln = d.norm == pipeshard_core::model::NormKind::LayerNorm;
        let opt = |o: Option<usize>| o.map_or(0, |o| wb + o as u64);
        // A one-token step folds the unit's input norm into its first GEMV (and the FFN's activation into
        // gate|up's), where the decode GEMV runs this step's matrices.
        let decode_gemv = m == 1 && d.quant.is_none() && gpu.decode_gemv_on();
        let normed = |norm_w: usize, norm_b: Option<usize>, w: u64| {
            (decode_gemv && decode_gemv_fits(d.hidden, &[w])).then_some(GemvInput::Norm {
                h: at(sc.h),
                w: wb + norm_w as u64,
                b: opt(norm_b),
                eps: d.norm_eps,
                layer_norm: ln,
            })
        };
        // A unit's first decode GEMV may start under the kernel before it where nothing it waits for is in
        // flight (weights and KV resident); the unit's later ones follow its own kernels, after any such wait.
        let first_start = if matches!(step.weights, WeightLoc::Pinned(_)) && step.kv != Some(KvLoc::Streamed)
        {
            EarlyStart::UnderPrevious
        } else {
            EarlyStart::AfterPrevious
        };
        // The unit's input norm into xb, where no decode GEMV folds it in.
        let norm_into_xb = |norm_w: usize, norm_b: Option<usize>| {
            // SAFETY: h and xb hold m·hidden elements (scratch_layout); the unit's norm weights lie at wb.
            unsafe {
                gpu.norm_act(
                    k,
                    at(sc.h),
                    wb + norm_w as u64,
                    opt(norm_b),
                    at(sc.xb),
                    m,
                    d.hidden,
                    d.norm_eps,
                    ln,
                )
            }
        };
        let mut start = g.span_start(Stream::Compute)?;
        match uw.kind {
            UnitKind::Attn(o) => {
                // Op offload's attention reads k and v from their own scratch regions.
                let qkv = step.kv != Some(KvLoc::Host)
                    && one_gemm_rows(d, m, &[(o.q, d.q_dim), (o.k, d.kv_dim), (o.v, d.kv_dim)]);
                // One GEMM writes q|k|v back to back from q's scratch; q, k and v each fit in their own region,
                // so the three together fit from q's start (scratch_layout).
                let qa = at(sc.q);
                let (ka, va) = if qkv {
                    (qa + (d.q_dim * 4) as u64, qa + ((d.q_dim + d.kv_dim) * 4) as u64)
                } else {
                    (at(sc.k), at(sc.v))
                };
                // SAFETY: every pointer is inside the arena: weights at wb with the unit's layout (offsets from the
                // inventory shapes), scratch buffers sized by scratch_layout for ≤ scratch.tokens ≥ m tokens, and the
                // layer's [K|V] of whole.bytes() at kv_base holding every row of every sequence (seqs::SeqKv).
                let qkv_normed = if qkv { normed(o.norm_w, o.norm_b, wb + o.q as u64) } else { None };
                unsafe {
                    if let Some(input) = qkv_normed {
                        let n = d.q_dim + 2 * d.kv_dim;
                        let y = GemvOutput::Y { y: qa, accumulate: false };
                        gpu.decode_gemv(k, wb + o.q as u64, n, d.hidden, input, y, first_start)?;
                    } else {
                        norm_into_xb(o.norm_w, o.norm_b)?;
                        if qkv {
                            let n = d.q_dim + 2 * d.kv_dim;
                            gpu.matmul(k, d.quant, wb + o.q as u64, at(sc.xb), qa, m, n, d.hidden, false)?;
                        } else {
                            for (w_off, y, n) in
                                [(o.q, qa, d.q_dim), (o.k, ka, d.kv_dim), (o.v, va, d.kv_dim)]
                            {
                                gpu.matmul(
                                    k,
                                    d.quant,
                                    wb + w_off as u64,
                                    at(sc.xb),
                                    y,
                                    m,
                                    n,
                                    d.hidden,
                                    false,
                                )?;
                            }
                        }
                    }
                    for (b, x, dim) in
                        [(o.q_bias, qa, d.q_dim), (o.k_bias, ka, d.kv_dim), (o.v_bias, va, d.kv_dim)]
                    {
                        if let Some(b) = b {
                            gpu.add_bias(k, x, wb + b as u64, dim, m * dim)?;
                        }
                    }
                    if let Some(qn) = o.q_norm {
                        gpu.rmsnorm_rows(k, qa, wb + qn as u64, m * d.n_heads, d.head_dim, d.norm_eps)?;
                    }
                    if let Some(kn) = o.k_norm {
                        gpu.rmsnorm_rows(k, ka, wb + kn as u64, m * d.n_kv_heads, d.head_dim, d.norm_eps)?;
                    }
                    let pos = pass_at.positions();
                    // After the decode GEMV, RoPE runs with the K/V store below.
                    match (qkv_normed, qkv) {
                        (Some(_), _) => {}
                        (None, true) => {
                            // One token's q and k heads lie back to back: one launch rotates both.
                            let heads = d.n_heads + d.n_kv_heads;
                            gpu.rope(k, qa, at(sc.inv_freq), m, heads, d.head_dim, d.rot_dims / 2, pos)?;
                        }
                        (None, false) => {
                            gpu.rope(k, qa, at(sc.inv_freq), m, d.n_heads, d.head_dim, d.rot_dims / 2, pos)?;
                            gpu.rope(
                                k,
                                ka,
                                at(sc.inv_freq),
                                m,
                                d.n_kv_heads,
                                d.head_dim,
                                d.rot_dims / 2,
                                pos,
                            )?;
                        }
                    }
                }
                if step.kv == Some(KvLoc::Host) {
                    let UnitId::Attn { layer } = step.unit else { unreachable!("KV belongs to attention") };
                    g.span_end(
                        &mut self.tl,
                        format!("gpu {} qkv", step.unit),
                        Track::Compute,
                        Stream::Compute,
                        start,
                    )?;
                    start = offloaded_attention(
                        g,
                        d,
                        &mut self.attn_io,
                        self.host_kv[layer as usize].as_mut_slice(),
                        self.kv,
                        &mut self.tl,
                        &sc,
                        pass_at,
                    )?;
                } else {
                    let rows = self.kv.store_rows(pass_at);
                    let keys = self.kv.gpu_keys(pass_at);
                    let kb = kv_base + whole.row_offset(keys.base_row) as u64;
                    // SAFETY: as above; every row the store and the attention touch is one of the cache's
                    // seqs × ctx rows (seqs::SeqKv).
                    unsafe {
                        if qkv_normed.is_some() {
                            gpu.rope_store_kv(
                                k,
                                (qa, ka, va),
                                at(sc.inv_freq),
                                (kv_base, kv_base + half),
                                m,
                                (d.n_heads, d.n_kv_heads, d.head_dim, d.rot_dims / 2),
                                pass_at.positions(),
                                rows,
                            )?;
                        } else {
                            gpu.store_kv(k, ka, va, kv_base, kv_base + half, d.kv_dim, rows, m)?;
                        }
                        gpu.attention(
                            k,
                            qa,
                            kb,
                            kb + half,
                            at(sc.xb),
                            at(sc.part_o),
                            at(sc.part_ml),
                            m,
                            keys,
                            d.n_heads,
                            d.n_kv_heads,
                            d.attn_scale(),
                            sc.attn_splits,
                        )?;
                    }
                }
                // SAFETY: as above; xb holds the m·q_dim attention output.
                // SAFETY: as above; the output projection follows the attention's kernels in the unit.
                unsafe {
                    let (w, x, y) = (wb + o.o as u64, at(sc.xb), at(sc.h));
                    gpu.matmul_early(
                        k,
                        d.quant,
                        w,
                        x,
                        y,
                        m,
                        d.hidden,
                        d.q_dim,
                        true,
                        EarlyStart::UnderPrevious,
                    )?;
                }
            }
            UnitKind::Ffn(o) => {
                // One GEMM writes gate|up back to back from up's scratch, which has room for both (the gate's
                // region follows it).
                let gate_up = o.gate.filter(|&gw| one_gemm_rows(d, m, &[(gw, d.ffn), (o.up, d.ffn)]));
                // One decode GEMV runs the norm, gate|up (or up alone) and the activation.
                let folded = match (o.gate, gate_up) {
                    (Some(_), None) => None,
                    (_, first) => normed(o.norm_w, o.norm_b, wb + first.unwrap_or(o.up) as u64)
                        .map(|input| (input, first.unwrap_or(o.up))),
                };
                // SAFETY: as above; up/gate/act hold m·ffn elements.
                unsafe {
                    if let Some((input, w_off)) = folded {
                        let out = if gate_up.is_some() {
                            GemvOutput::SwiGlu { act: at(sc.act) }
                        } else {
                            GemvOutput::Relu2 { act: at(sc.act) }
                        };
                        gpu.decode_gemv(k, wb + w_off as u64, d.ffn, d.hidden, input, out, first_start)?;
                    } else {
                        norm_into_xb(o.norm_w, o.norm_b)?;
                        let (gate, up, ld) = if let Some(gw) = gate_up {
                            let ga = at(sc.up);
                            gpu.matmul(
                                k,
                                d.quant,
                                wb + gw as u64,
                                at(sc.xb),
                                ga,
                                m,
                                2 * d.ffn,
                                d.hidden,
                                false,
                            )?;
                            (Some(ga), ga + (d.ffn * 4) as u64, 2 * d.ffn)
                        } else {
                            let mm = |w_off: usize, y: usize| {
                                gpu.matmul(
                                    k,
                                    d.quant,
                                    wb + w_off as u64,
                                    at(sc.xb),
                                    at(y),
                                    m,
                                    d.ffn,
                                    d.hidden,
                                    false,
                                )
                            };
                            mm(o.up, sc.up)?;
                            if let Some(gw) = o.gate {
                                mm(gw, sc.gate)?;
                            }
                            (o.gate.map(|_| at(sc.gate)), at(sc.up), d.ffn)
                        };
                        gpu.ffn_act(k, gate, up, at(sc.act), m, d.ffn, ld)?;
                    }
                    // The down projection follows the unit's first kernels.
                    let (w, x, y) = (wb + o.down as u64, at(sc.act), at(sc.h));
                    gpu.matmul_early(
                        k,
                        d.quant,
                        w,
                        x,
                        y,
                        m,
                        d.hidden,
                        d.ffn,
                        true,
                        EarlyStart::UnderPrevious,
                    )?;
                }
            }
            _ => unreachable!("gpu_block runs attention and FFN units"),
        }
        g.span_end(&mut self.tl, format!("gpu {}", step.unit), Track::Compute, Stream::Compute, start)?;
        if let (UnitId::Attn { layer }, Some(KvLoc::Streamed)) = (step.unit, step.kv) {
            let li = layer as usize;
            let g = self.gpu.as_mut().expect("gpu");
            g.gpu.record(&g.mark, Stream::Compute)?;
            g.gpu.wait(Stream::D2h, &g.mark)?;
            let hb = self.host_kv[li].as_mut_slice();
            let (hk, hv) = hb.split_at_mut(half as usize);
            let start = g.span_start(Stream::D2h)?;
            // The new cells: one copy per sequence unless the cache is unified.
            for (r, n) in self.kv.new_cells(pass_at) {
                let (p, n) = (whole.row_offset(r), whole.row_offset(n));
                // SAFETY: the new rows exist in the slot and in the host mirror; the host does not read the
                // mirror of a streamed layer before the next upload, which waits for kv_wb.
                unsafe {
                    g.gpu.d2h(Stream::D2h, &mut hk[p..p + n], kv_base + p as u64)?;
                    g.gpu.d2h(Stream::D2h, &mut hv[p..p + n], kv_base + half + p as u64)?;
                }
            }
            g.span_end(&mut self.tl, format!("write back blk.{layer}.kv"), Track::D2h, Stream::D2h, start)?;
            g.gpu.record(&g.kv_wb[li], Stream::D2h)?;
            g.kv_wb_pass[li] = Some(pass);
        }
        // Slots are handed out round-robin, so they must come back in the order they were issued: the weights
        // (issued first) before the KV.
        if let Some(s) = wslot {
            // A slot that also held the KV comes free only after the write-back (D2H stream).
            self.release(s, if joint { Stream::D2h } else { Stream::Compute })?;
        }
        if let Some(s) = kslot {
            self.release(s, Stream::D2h)?;
        }
        Ok(())
    }

    /// The output head over the last `rows` of the pass's `m` rows: their sampled tokens and, if kept, logits.
    #[allow(clippy::type_complexity)]
    fn gpu_output(
        &mut self,
        lay: &PhaseLayout,
        step: &Step,
        m: usize,
        rows: usize,
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        self.ensure_dev(lay, m, Stream::Compute)?;
        let d = self.d;
        let (wb, slot) = self.weights_base(lay, step)?;
        let uw = self.w.unit(step.unit).expect("weight unit");
        let UnitKind::Output(o) = uw.kind else { unreachable!("output unit") };
        let g = self.gpu.as_ref().expect("gpu");
        let base = g.base();
        let sc = lay.scratch;
        let at = |x: usize| base + x as u64;
        let ln = d.norm == pipeshard_core::model::NormKind::LayerNorm;
        let start = g.span_start(Stream::Compute)?;
        let keep = self.opts.keep_logits;
        // SAFETY: h holds m rows (the last `rows` are normalised), xb ≥ rows·hidden activations, logits
        // rows·vocab f32, tok rows·4 bytes (scratch_layout); io is sized for them (Io::new), registered and read
        // only after the sync below.
        unsafe {
            g.gpu.norm_act(
                &g.k,
                at(sc.h) + ((m - rows) * d.hidden * 4) as u64,
                wb + o.norm_w as u64,
                o.norm_b.map_or(0, |b| wb + b as u64),
                at(sc.xb),
                rows,
                d.hidden,
                d.norm_eps,
                ln,
            )?;
            g.gpu.matmul(
                &g.k,
                d.quant,
                wb + o.head as u64,
                at(sc.xb),
                at(sc.logits),
                rows,
                d.vocab,
                d.hidden,
                false,
            )?;
            g.gpu.argmax(&g.k, at(sc.logits), d.vocab, at(sc.tok), rows)?;
            let io = self.io.buf.as_mut_slice();
            let (head, tail) = io.split_at_mut(self.io.logits);
            g.gpu.d2h(Stream::Compute, &mut head[self.io.tok..self.io.tok + 4 * rows], at(sc.tok))?;
            if keep {
                g.gpu.d2h(Stream::Compute, &mut tail[..rows * d.vocab * 4], at(sc.logits))?;
            }
        }
        g.span_end(&mut self.tl, "gpu output".into(), Track::Compute, Stream::Compute, start)?;
        if let Some(s) = slot {
            self.release(s, Stream::Compute)?;
        }
        let g = self.gpu.as_ref().expect("gpu");
        let t = self.tl.now_ns();
        g.gpu.sync(Stream::Compute)?;
        self.tl.host("sync: token to host".into(), Track::Host, t);
        let io = self.io.buf.as_slice();
        let f32_at = |c: &[u8]| f32::from_le_bytes(c.try_into().expect("4 bytes"));
        let tokens = io[self.io.tok..self.io.tok + 4 * rows]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let logits = if keep {
            io[self.io.logits..self.io.logits + rows * d.vocab * 4]
                .chunks_exact(d.vocab * 4)
                .map(|row| row.chunks_exact(4).map(f32_at).collect())
                .collect()
        } else {
            Vec::new()
        };
        Ok((tokens, logits))
    }
}

#[cfg(test)]
mod tests {
    use super::{
        KvLoc, NextLayer, NotPreEnqueued, RingItem, Step, Stream, UnitId, WeightLoc, expert_inputs_stream,
        page_lock_choice, pre_enqueue_steps,
    };

    /// Layer 0 and 1 of a MoE model, both with attention and router pinned (KV pinned) and two CPU experts, then
    /// the output head.
    fn moe_steps() -> Vec<Step> {
        let mut steps = Vec::new();
        for layer in 0..2 {
            steps.push(Step {
                unit: UnitId::Attn { layer },
                weights: WeightLoc::Pinned(0),
                kv: Some(KvLoc::Pinned(0)),
            });
            steps.push(Step { unit: UnitId::Router { layer }, weights: WeightLoc::Pinned(0), kv: None });
            for expert in 0..2 {
                steps.push(Step {
                    unit: UnitId::Expert { layer, expert },
                    weights: WeightLoc::Cpu,
                    kv: None,
                });
            }
        }
        steps.push(Step { unit: UnitId::Output, weights: WeightLoc::Pinned(0), kv: None });
        steps
    }

    /// Pre-enqueue takes the next layer's attention and router in a decode step when both run on the GPU (the
    /// attention with its KV), naming the ring items streamed ones take; nothing else: not in prefill, not
    /// after the last layer, not from a step that is not a router, not where the attention or the router is on
    /// the CPU.
    #[test]
    fn pre_enqueue_takes_the_next_gpu_attention_and_router_of_decode() {
        use NotPreEnqueued::{AttentionOnHost, NoNextMoeLayer, RouterOnCpu};
        let steps = moe_steps();
        let next = |s: &[Step]| Ok(NextLayer { attn: s[4], router: s[5], ring: None, router_ring: None });
        assert_eq!(pre_enqueue_steps(&steps, 1, true), next(&steps));
        assert_eq!(pre_enqueue_steps(&steps, 1, false), Err(NoNextMoeLayer), "prefill");
        assert_eq!(
            pre_enqueue_steps(&steps, 5, true),
            Err(NoNextMoeLayer),
            "the last layer's router: the output head follows"
        );
        assert_eq!(pre_enqueue_steps(&steps, 0, true), Err(NoNextMoeLayer), "an attention step");
        assert_eq!(pre_enqueue_steps(&steps, 99, true), Err(NoNextMoeLayer), "past the steps");
        let with = |i: usize, weights: WeightLoc, kv: Option<KvLoc>| {
            let mut s = steps.clone();
            s[i] = Step { weights, kv, ..s[i] };
            (pre_enqueue_steps(&s, 1, true), s)
        };
        let attn1 = UnitId::Attn { layer: 1 };
        for (weights, kv, ring) in [
            (WeightLoc::Streamed, KvLoc::Pinned(0), RingItem::Weights(attn1)),
            (WeightLoc::Pinned(0), KvLoc::Streamed, RingItem::Kv(1)),
            (WeightLoc::Streamed, KvLoc::Streamed, RingItem::AttnKv(1)),
        ] {
            let (got, s) = with(4, weights, Some(kv));
            assert_eq!(
                got,
                Ok(NextLayer { attn: s[4], router: s[5], ring: Some(ring), router_ring: None }),
                "{weights:?}, {kv:?}"
            );
        }
        assert_eq!(
            with(4, WeightLoc::Cpu, Some(KvLoc::Host)).0,
            Err(AttentionOnHost),
            "attention on the CPU"
        );
        assert_eq!(
            with(4, WeightLoc::Staged(0), Some(KvLoc::Host)).0,
            Err(AttentionOnHost),
            "attention staged"
        );
        let (got, s) = with(5, WeightLoc::Streamed, None);
        let router_ring = Some(RingItem::Weights(UnitId::Router { layer: 1 }));
        assert_eq!(
            got,
            Ok(NextLayer { attn: s[4], router: s[5], ring: None, router_ring }),
            "router streamed"
        );
        assert_eq!(with(5, WeightLoc::Cpu, None).0, Err(RouterOnCpu), "router on the CPU");
        // Experts of this layer on the GPU are skipped like CPU ones.
        let (got, s) = with(2, WeightLoc::Pinned(0), None);
        assert_eq!(got, next(&s));
        // A dense layer next (an FFN instead of a router).
        let mut dense = steps.clone();
        dense[5] = Step { unit: UnitId::Ffn { layer: 1 }, weights: WeightLoc::Pinned(0), kv: None };
        assert_eq!(pre_enqueue_steps(&dense, 1, true), Err(NoNextMoeLayer), "the next layer is dense");
    }

    /// A MoE layer's expert inputs go up on the H2D stream, ahead of the copies, where a streamed expert is
    /// picked for the GPU: on the compute stream, the H200 copied them only after the layer's queue of expert
    /// copies. Where none is, they stay on the compute stream, clear of other units' copies.
    #[test]
    fn expert_inputs_go_up_ahead_of_the_streamed_experts_copies() {
        let locs = [WeightLoc::Pinned(0), WeightLoc::Streamed, WeightLoc::Cpu, WeightLoc::Streamed];
        assert_eq!(expert_inputs_stream(&locs, &[0, 1, 3]), Stream::H2d);
        assert_eq!(expert_inputs_stream(&locs, &[3]), Stream::H2d, "streamed only");
        assert_eq!(expert_inputs_stream(&locs, &[0]), Stream::Compute, "pinned only");
        assert_eq!(expert_inputs_stream(&locs, &[]), Stream::Compute, "no GPU expert picked");
    }

    /// Under a page-lock limit, streamed units are locked first, then the others in order while they fit;
    /// without a limit everything is.
    #[test]
    fn page_locking_prefers_streamed_units_under_a_limit() {
        let units = [(100, false), (300, true), (50, false), (200, true)];
        assert_eq!(page_lock_choice(&units, None), [true; 4]);
        assert_eq!(page_lock_choice(&units, Some(0)), [false; 4]);
        // 300 + 200 streamed first, then 100 does not fit, 50 does.
        assert_eq!(page_lock_choice(&units, Some(560)), [false, true, true, true]);
        assert_eq!(page_lock_choice(&units, Some(350)), [false, true, true, false]);
        assert_eq!(page_lock_choice(&units, Some(650)), [true, true, true, true]);
    }
}
