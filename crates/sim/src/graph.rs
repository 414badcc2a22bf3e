//! Steps of a workload (prefill chunks or decode steps) as a task graph.
//!
//! `build` walks each step's ops (core's [`workload::ops`], in execution order) and emits [`Task`]s, each on
//! one [`Lane`]: a compute on the GPU stream or the CPU pool, a copy on the H2D or D2H engine, a hand-off
//! (activations crossing between host and device, with a host synchronisation) or our host's enqueue of a
//! streamed expert. Lanes other than hand-offs and enqueues run their tasks one at a time in creation order,
//! like a CUDA stream or ggml's CPU backend; a layer's enqueues wait each for the previous.
//!
//! Streaming, slot by slot as core's [`PhasePlan::stream_groups`](pipeshard_core::plan::PhasePlan::stream_groups)
//! defines it: the reads of a `Streamed` unit within one layer share one [`RingItem`], and a layer whose
//! attention and KV are both streamed carries both in one item (two copies into one slot: the q/k/v
//! projections start when the weights are in, the attention when the KV is); a layer's touched streamed
//! experts are `⌈streamed × touched / E⌉` items of at most one expert each, each computed as soon as it
//! arrives (on our runtime, once the host thread has enqueued it: [`Lane::Host`], [`TaskKind::Enqueue`]).
//! Item `i` goes to slot `i mod pipeline_depth`; its first copy starts when item `i − depth` has been
//! released — all its readers done, including the write-back of the new KV cells of a streamed KV — and every
//! op waits for the copy of what it reads. Several steps in one graph continue the ring across the boundary
//! (the executor issues the next decode step's copies as soon as slots free up), and a layer's KV upload
//! waits for its previous write-back.
//!
//! Creation order is a topological order of every wait, slot waits included: an item's readers are all
//! created before the next item's first copy, so a copy never waits for a task created after it.

use pipeshard_core::cost::{CostModel, Device, OpContext};
use pipeshard_core::fxhash::FxHashMap;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::plan::{PhaseKind, Placement, RING_ISSUE_AHEAD};
use pipeshard_core::workload::{self, ACT_BYTES, Op, OpKind, Phase, Workload};

/// Marks "none" in index vectors.
const NONE: u32 = u32::MAX;

/// The resource a task occupies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// The GPU compute stream.
    Gpu,
    /// The CPU worker pool (all of the plan's threads work on one op at a time).
    Cpu,
    /// The host → device copy engine.
    H2d,
    /// The device → host copy engine.
    D2h,
    /// A CPU↔GPU hand-off: latency only, no exclusive resource.
    Handoff,
    /// Our executor's host thread enqueueing streamed experts: latency only, one task after another (each
    /// waits for the previous), so it runs one at a time without an exclusive resource.
    Host,
}

impl Lane {
    /// The exclusive lanes, in the order [`crate::StepOutcome::busy_ns`] reports them.
    pub const EXCLUSIVE: [Lane; 4] = [Lane::Gpu, Lane::H2d, Lane::D2h, Lane::Cpu];

    /// Index into [`Lane::EXCLUSIVE`] (`None` for hand-offs).
    #[must_use]
    pub fn exclusive_index(self) -> Option<usize> {
        match self {
            Lane::Gpu => Some(0),
            Lane::H2d => Some(1),
            Lane::D2h => Some(2),
            Lane::Cpu => Some(3),
            Lane::Handoff | Lane::Host => None,
        }
    }
}

/// Which share of an op a compute task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpShare {
    /// The whole op.
    Whole,
    /// The routed experts of a layer placed `Pinned` or on the `Cpu` (expected work: count / n_experts), or
    /// one streamed ring item's worth of the `Streamed` ones.
    Experts(Placement),
}

/// What a task does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskKind {
    /// Op `op` (index into [`StepGraph::ops`]) computing on the lane's device.
    Compute { op: u32, share: OpShare },
    /// Ring item `item` (index into [`StepGraph::items`]) copied into its slot.
    Stream { item: u32 },
    /// llama.cpp op offload: the CPU-resident weights of op `op` copied to the GPU for one prefill ubatch.
    Offload { op: u32 },
    /// The KV cells written by the GPU attention op `op` copied back to the host mirror.
    KvWriteback { op: u32 },
    /// Activations handed to `to` (host sync plus copy); at a step's start, token ids (no sync), and at its
    /// end, the sampled tokens.
    Handoff { to: Device },
    /// The host enqueueing ring item `item`'s reader: the previous reader's kernels, then the ring's copy
    /// issue and span ([`CostModel::ring_copy_issue_ns`]).
    Enqueue { item: u32 },
}

/// One task.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub kind: TaskKind,
    pub lane: Lane,
    /// Time with no copy in flight (a GPU task takes at least one kernel launch).
    pub duration_ns: u64,
    /// Time while the other side of the shared memory is busy: a compute's while an H2D or D2H copy is in
    /// flight, an H2D copy's while the CPU pool computes (host DRAM and device memory are shared with DMA), a
    /// hand-off's where an H2D copy is in flight as it starts (the device's reads of host memory queue
    /// behind the copy's on the link).
    pub duration_contended_ns: u64,
    /// Bytes moved (copies and hand-offs).
    pub bytes: u64,
    /// The ring item the task fills (stream copies) or reads (computes, KV write-backs).
    pub item: Option<u32>,
    /// Which step of the graph the task belongs to.
    pub step: u32,
    deps_start: u32,
    deps_end: u32,
}

/// What a ring item holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKey {
    /// A streamed unit's weights, or a streamed layer's KV (as [`crate::Runtime::kv_upload_bytes`] sizes it).
    Unit(UnitId),
    /// Part `part` of the expected touched share of a layer's streamed experts (at most one expert's bytes).
    Experts { layer: u32, part: u32 },
}

/// What one ring slot holds between a copy and the release.
#[derive(Debug, Clone, PartialEq)]
pub struct RingItem {
    pub key: StreamKey,
    /// Whether the layer's streamed KV shares the slot of its streamed attention (`key` is the attention).
    pub with_kv: bool,
    /// Bytes copied into the slot (of a KV, the cells the step reads, not the whole cache the slot holds).
    pub bytes: u64,
    pub slot: u32,
    /// The first copy task, which claims the slot (a KV sharing it has a second copy).
    pub copy: u32,
    /// Tasks that read it; the slot is released when the last of them ends.
    pub readers: u32,
    /// The last reader created (tasks are created in execution order).
    pub last_reader: u32,
}

/// The task graph of one or more consecutive steps of one phase.
#[derive(Debug, Clone)]
pub struct StepGraph {
    pub phase_kind: PhaseKind,
    pub phases: Vec<Phase>,
    /// The ops of every step, concatenated.
    pub ops: Vec<Op>,
    pub tasks: Vec<Task>,
    pub items: Vec<RingItem>,
    /// Per step, the task whose end gives the host the step's result (the sampled tokens, or completion).
    pub step_end: Vec<u32>,
    pub pipeline_depth: u32,
    pub slot_bytes: u64,
    /// Largest weight copied to the GPU by op offload (it lives in scratch while the op runs).
    pub offload_peak_bytes: u64,
    deps: Vec<u32>,
}

impl StepGraph {
    /// The tasks `task` waits for.
    #[must_use]
    pub fn deps(&self, task: u32) -> &[u32] {
        let t = &self.tasks[task as usize];
        &self.deps[t.deps_start as usize..t.deps_end as usize]
    }

    /// The device a task's output lives on (copies: `None`).
    #[must_use]
    pub fn device(&self, task: u32) -> Option<Device> {
        let t = &self.tasks[task as usize];
        match (t.lane, t.kind) {
            (Lane::Gpu, _) => Some(Device::Gpu),
            (Lane::Cpu, _) => Some(Device::Cpu),
            (_, TaskKind::Handoff { to }) => Some(to),
            _ => None,
        }
    }

    /// A short human-readable name of a ring item.
    #[must_use]
    pub fn item_label(&self, item: u32) -> String {
        let it = &self.items[item as usize];
        match it.key {
            StreamKey::Unit(u) if it.with_kv => format!("{u}+kv"),
            StreamKey::Unit(u) => u.to_string(),
            StreamKey::Experts { layer, part } => format!("blk.{layer}.experts[{part}]"),
        }
    }

    /// A short human-readable name of a task (trace labels, errors).
    #[must_use]
    pub fn label(&self, task: u32) -> String {
        let t = &self.tasks[task as usize];
        match t.kind {
            TaskKind::Compute { op, share } => {
                let o = &self.ops[op as usize];
                let what = match o.kind {
                    OpKind::MatMul { n, k } => format!("matmul {n}x{k}"),
                    OpKind::Attention { keys, .. } => format!("attention ({keys} keys)"),
                    OpKind::Experts { .. } => match (share, t.item) {
                        (_, Some(item)) => format!("experts ({})", self.item_label(item)),
                        (OpShare::Experts(p), None) => format!("experts ({})", placement_word(p)),
                        (OpShare::Whole, None) => "experts".to_string(),
                    },
                    OpKind::Router { .. } => "router".to_string(),
                    OpKind::Sample { .. } => "sample".to_string(),
                    OpKind::KvStore => "kv store".to_string(),
                    k => format!("{:?}", k.class()).to_lowercase(),
                };
                format!("{} {what}", o.unit)
            }
            TaskKind::Stream { item } => format!("stream {}", self.item_label(item)),
            TaskKind::Offload { op } => format!("offload {}", self.ops[op as usize].unit),
            TaskKind::KvWriteback { op } => format!("kv cells {}", self.ops[op as usize].unit),
            TaskKind::Handoff { to: Device::Gpu } => "hand-off to gpu".to_string(),
            TaskKind::Handoff { to: Device::Cpu } => "hand-off to cpu".to_string(),
            TaskKind::Enqueue { item } => format!("enqueue {}", self.item_label(item)),
        }
    }
}

fn placement_word(p: Placement) -> &'static str {
    match p {
        Placement::Pinned => "pinned",
        Placement::Streamed => "streamed",
        Placement::Cpu => "cpu",
    }
}

/// Placements of one decoder layer in one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerView {
    pub attn: Placement,
    /// The dense FFN block or, for MoE layers, the router.
    pub ffn: Placement,
    pub shared_experts: Placement,
    pub kv: Placement,
    /// Routed experts placed pinned, streamed, on the CPU.
    pub experts: [u32; 3],
    /// Whether the new KV cells of a GPU attention go back to the host mirror (the KV is streamed in this
    /// phase, or pinned in prefill but not in decode).
    pub kv_mirrored: bool,
}

/// Placements of one phase, indexed for O(1) lookup by unit.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PhaseView {
    pub kind: PhaseKind,
    pub token_embd: Placement,
    pub output: Placement,
    pub layers: Vec<LayerView>,
    pub pipeline_depth: u32,
    pub slot_bytes: u64,
    pub op_offload: bool,
    pub cpu_threads: u32,
    /// Every text unit but the token embedding is pinned.
    pub all_pinned_but_embd: bool,
}

impl PhaseView {
    /// Whether a step is one GPU split after the token embedding: every text unit but the embedding pinned, no
    /// op offload. (Stock llama.cpp and the artifact always gather the embedding on the CPU.)
    pub fn one_gpu_split(&self) -> bool {
        !self.op_offload && self.all_pinned_but_embd
    }

    /// Whether any op of the phase can run on the GPU (else it needs no GPU scratch).
    pub fn uses_gpu(&self) -> bool {
        self.token_embd.on_gpu()
            || self.output.on_gpu()
            || self.op_offload
            || self.layers.iter().any(|l| {
                l.attn.on_gpu()
                    || l.ffn.on_gpu()
                    || l.shared_experts.on_gpu()
                    || l.experts[0] + l.experts[1] > 0
            })
    }

    /// The scratch terms of `parts` that live on the GPU: the residual stream whenever the GPU runs anything,
    /// attention temporaries if some attention runs there, FFN intermediates if some dense FFN, shared or
    /// routed expert runs there (a router alone does not; or op offload stages matmuls there), and the logits
    /// if the output head does.
    pub fn gpu_scratch_bytes(&self, parts: &workload::ScratchParts) -> u64 {
        if !self.uses_gpu() {
            return 0;
        }
        let offload = self.op_offload;
        let attn = self.layers.iter().any(|l| l.attn.on_gpu());
        // A MoE layer's `ffn` is its router, whose output (one score per expert) is no FFN intermediate.
        let ffn = offload
            || self.layers.iter().any(|l| {
                let dense = l.experts == [0; 3];
                (dense && l.ffn.on_gpu()) || l.shared_experts.on_gpu() || l.experts[0] + l.experts[1] > 0
            });
        let work = if attn { parts.attention_bytes } else { 0 }.max(if ffn { parts.ffn_bytes } else { 0 });
        parts.residual_bytes + work + if self.output.on_gpu() { parts.logits_bytes } else { 0 }
    }

    pub fn placement(&self, unit: UnitId) -> Placement {
        match unit {
            UnitId::TokenEmbd => self.token_embd,
            UnitId::Output => self.output,
            UnitId::Attn { layer } => self.layers[layer as usize].attn,
            UnitId::Ffn { layer } | UnitId::Router { layer } => self.layers[layer as usize].ffn,
            UnitId::SharedExperts { layer } => self.layers[layer as usize].shared_experts,
            UnitId::Kv { layer } => self.layers[layer as usize].kv,
            // Experts are split by counts; the vision tower runs no text op.
            UnitId::Expert { .. }
            | UnitId::VisionPatchEmbd
            | UnitId::VisionBlock { .. }
            | UnitId::VisionMerger => Placement::Pinned,
        }
    }
}

/// What a step build needs besides the phase view.
pub(crate) struct BuildCtx<'a> {
    pub inv: &'a Inventory,
    pub spec: &'a pipeshard_core::model::ModelSpec,
    pub workload: &'a Workload,
    pub cost: &'a dyn CostModel,
    /// KV bytes of one layer for the full allocated context of every sequence.
    pub kv_layer_bytes: u64,
    /// KV bytes one token adds to one layer.
    pub kv_token_bytes: u64,
    /// Bytes of one routed expert, per layer (0 for dense layers).
    pub expert_bytes: &'a [u64],
    pub runtime: crate::Runtime,
}

/// The identity of an op's cost: everything a cost model may read, except the unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CostKey {
    kind: [u64; 6],
    tokens: u64,
    dtype: pipeshard_core::dtype::DType,
    device: Device,
    /// Priced as one group of experts ([`OpContext::grouped_experts`]).
    grouped: bool,
    amounts: [u64; 4],
}

impl std::hash::Hash for CostKey {
    /// The words that tell ops apart (shape, tokens, FLOPs and weight bytes, the device and grouping), one
    /// `write_u64` each: the memo is asked once per op of every simulated step, and hashing the whole key
    /// word by word through slices was a tenth of a sweep. Equal keys still compare whole.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let device = u64::from(self.device == Device::Gpu) | u64::from(self.grouped) << 1;
        for w in
            [self.kind[0], self.kind[1], self.kind[2], self.kind[3], self.tokens, self.amounts[0], device]
        {
            state.write_u64(w);
        }
    }
}

impl CostKey {
    fn new(op: &Op, ctx: OpContext) -> CostKey {
        let kind = match op.kind {
            OpKind::MatMul { n, k } => [1, n, k, 0, 0, 0],
            OpKind::Attention { q_heads, kv_heads, head_dim, keys, scanned_keys, decode, materialized } => {
                // Heads fit in 32 bits each: one word holds both; the kind word says decode or prefill, and
                // materialised or fused.
                let heads = u64::from(q_heads) << 32 | u64::from(kv_heads);
                let kind = if decode { 100 } else { 2 } + if materialized { 1000 } else { 0 };
                [kind, heads, head_dim, keys, scanned_keys, 0]
            }
            OpKind::Router { n_experts, top_k } => [3, u64::from(n_experts), u64::from(top_k), 0, 0, 0],
            OpKind::Experts { n_experts, touched, tokens_per_touched, ffn, hidden } => {
                [4, u64::from(n_experts), touched.to_bits(), tokens_per_touched.to_bits(), ffn, hidden]
            }
            OpKind::Sample { vocab } => [5, vocab, 0, 0, 0, 0],
            k => [6 + k.class() as u64, 0, 0, 0, 0, 0],
        };
        CostKey {
            kind,
            tokens: op.tokens,
            dtype: op.dtype,
            device: ctx.device,
            grouped: ctx.grouped_experts,
            amounts: [
                op.flops.to_bits(),
                op.weight_bytes.to_bits(),
                op.act_bytes.to_bits(),
                op.kv_bytes.to_bits(),
            ],
        }
    }
}

type CostMemo = FxHashMap<CostKey, (u64, u64)>;

/// Which part of a step an op belongs to: a unit's reads within one part share one ring item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment {
    Prologue,
    Layer(u32),
    Epilogue,
}

struct Builder<'a> {
    ctx: &'a BuildCtx<'a>,
    /// Op times (alone, under DMA) already asked of the cost model: layers repeat the same shapes.
    memo: CostMemo,
    /// Copy times already asked of the cost model, by (host → device, bytes): every layer copies the same
    /// activations and expert shares.
    copy_memo: FxHashMap<(bool, u64), (u64, u64)>,
    view: &'a PhaseView,
    phase: Phase,
    step: u32,
    tasks: Vec<Task>,
    deps: Vec<u32>,
    /// Hand-off task leaving each task for the other device.
    handoff_after: Vec<u32>,
    items: Vec<RingItem>,
    /// The last write-back of each layer's new KV cells (the next upload of that KV waits for it).
    last_writeback: Vec<u32>,
    offload_peak_bytes: u64,
    /// The unit whose weights op offload staged last in this step, and their copy.
    staged: Option<(UnitId, u32)>,
    /// The current step's kernels replay from a CUDA graph (no host launch each).
    graphed: bool,
}

impl Builder<'_> {
    fn push(&mut self, kind: TaskKind, lane: Lane, durations: (u64, u64), bytes: u64, deps: &[u32]) -> u32 {
        let deps_start = self.deps.len() as u32;
        self.deps.extend_from_slice(deps);
        self.tasks.push(Task {
            kind,
            lane,
            duration_ns: durations.0,
            duration_contended_ns: durations.1,
            bytes,
            item: None,
            step: self.step,
            deps_start,
            deps_end: self.deps.len() as u32,
        });
        self.handoff_after.push(NONE);
        (self.tasks.len() - 1) as u32
    }

    fn device(&self, task: u32) -> Device {
        match (self.tasks[task as usize].lane, self.tasks[task as usize].kind) {
            (Lane::Gpu, _) => Device::Gpu,
            (_, TaskKind::Handoff { to }) => to,
            _ => Device::Cpu,
        }
    }

    fn activation_bytes(&self) -> u64 {
        (self.phase.tokens() as f64 * self.ctx.spec.text.hidden as f64 * ACT_BYTES) as u64
    }

    /// The dependency a task on `dev` takes on `from`: `from` itself on the same device, else the hand-off
    /// leaving it (created once).
    fn on(&mut self, from: Option<u32>, dev: Device) -> Option<u32> {
        let f = from?;
        if self.device(f) == dev {
            return Some(f);
        }
        if self.handoff_after[f as usize] == NONE {
            let bytes = self.activation_bytes();
            let d = self.ctx.cost.host_sync_ns() + self.copy_ns(dev == Device::Gpu, bytes);
            self.handoff_taking(f, dev, (d, d));
        }
        Some(self.handoff_after[f as usize])
    }

    /// The hand-off of the activations leaving `f` to `dev`, taking `d` (alone, beside an H2D copy).
    fn handoff_taking(&mut self, f: u32, dev: Device, d: (u64, u64)) -> u32 {
        let bytes = self.activation_bytes();
        let h = self.push(TaskKind::Handoff { to: dev }, Lane::Handoff, d, bytes, &[f]);
        self.handoff_after[f as usize] = h;
        h
    }

    /// What the residual add on `dev` waits for from the experts share `t`: [`Self::on`], except that our
    /// executor returns a one-token decode step's CPU experts to the GPU by writing their sum where the device
    /// reads it and opening the gate its pre-enqueued add waits at, which the profile times
    /// ([`CostModel::decode_experts_return_ns`]; run41 measured ≈ 24 µs from the experts' end to their sum's
    /// end where a sync, a copy and the add priced ≈ 14), instead of a sync and a copy; beside an H2D copy,
    /// the profile's figure for that (session 22: 35–41 µs to the add's start, the add 20–30 µs).
    fn join_experts(&mut self, t: u32, dev: Device) -> Option<u32> {
        let cost = self.ctx.cost;
        let (ns, beside_ns) = (cost.decode_experts_return_ns(false), cost.decode_experts_return_ns(true));
        let task = &self.tasks[t as usize];
        let cpu_experts = task.lane == Lane::Cpu
            && matches!(task.kind, TaskKind::Compute { share: OpShare::Experts(Placement::Cpu), .. });
        let returns = ns > 0
            && cpu_experts
            && dev == Device::Gpu
            && self.ctx.runtime == crate::Runtime::Ours
            && matches!(self.phase, Phase::Decode { .. })
            && self.phase.tokens() == 1
            && self.handoff_after[t as usize] == NONE;
        if !returns {
            return self.on(Some(t), dev);
        }
        Some(self.handoff_taking(t, dev, (ns, beside_ns)))
    }

    /// A pinned host ↔ device copy of `bytes` (memoised): its time alone and while the CPU pool computes
    /// (an H2D copy's DMA reads the DRAM the pool streams from; a D2H copy's is not measured).
    fn copy_durations(&mut self, to_device: bool, bytes: u64) -> (u64, u64) {
        let cost = self.ctx.cost;
        *self.copy_memo.entry((to_device, bytes)).or_insert_with(|| {
            if to_device {
                (cost.h2d_ns(bytes, true), cost.h2d_beside_cpu_ns(bytes, true))
            } else {
                let d = cost.d2h_ns(bytes, true);
                (d, d)
            }
        })
    }

    /// [`Self::copy_durations`] alone.
    fn copy_ns(&mut self, to_device: bool, bytes: u64) -> u64 {
        self.copy_durations(to_device, bytes).0
    }

    fn compute(&mut self, op_index: usize, share: OpShare, op: &Op, dev: Device, deps: &[u32]) -> u32 {
        self.compute_launching(op_index, share, op, dev, deps, self.ctx.runtime.launches(op), false)
    }

    /// [`Self::compute`] issuing `launches` kernels on the GPU, routed experts there priced as one group
    /// where `grouped_experts` ([`OpContext::grouped_experts`]).
    fn compute_launching(
        &mut self,
        op_index: usize,
        share: OpShare,
        op: &Op,
        dev: Device,
        deps: &[u32],
        launches: u32,
        grouped_experts: bool,
    ) -> u32 {
        let cost = self.ctx.cost;
        let per_kernel_ns = if self.graphed { cost.graph_kernel_ns() } else { cost.launch_ns() };
        let (lane, ctx, launch) = match dev {
            Device::Gpu => (
                Lane::Gpu,
                OpContext::gpu().with_grouped_experts(grouped_experts),
                per_kernel_ns * u64::from(launches),
            ),
            Device::Cpu => (Lane::Cpu, OpContext::cpu(self.view.cpu_threads), 0),
        };
        let key = CostKey::new(op, ctx);
        let (alone, dma) = if let Some(&times) = self.memo.get(&key) {
            times
        } else {
            let times = (cost.op_ns(op, ctx), cost.op_ns(op, ctx.with_dma(true)));
            self.memo.insert(key, times);
            times
        };
        // Launches are asynchronous: the host issues the next kernel while the device runs this one, so a GPU op
        // takes its device time, or the launch rate's when it is shorter (the profile's back-to-back launch
        // cost). The validation's all-GPU dense decode was 7-13% slow when launches were added on top.
        self.push(
            TaskKind::Compute { op: op_index as u32, share },
            lane,
            (alone.max(launch), dma.max(launch)),
            0,
            deps,
        )
    }

    /// Lengthens the last of `chain` (tasks that run one after another) so that the chain takes at least `ns`,
    /// and at least `beside_ns` at the rates its tasks take beside an H2D copy.
    fn top_up(&mut self, chain: &[u32], (ns, beside_ns): (u64, u64)) {
        let have = |f: fn(&Task) -> u64| chain.iter().map(|&t| f(&self.tasks[t as usize])).sum::<u64>();
        let (have_ns, have_beside_ns) = (have(|t| t.duration_ns), have(|t| t.duration_contended_ns));
        if let Some(&last) = chain.last() {
            let t = &mut self.tasks[last as usize];
            t.duration_ns += ns.saturating_sub(have_ns);
            t.duration_contended_ns += beside_ns.saturating_sub(have_beside_ns);
        }
    }

    /// Lengthens task `task` (a GPU one, or a hand-off to the GPU) by `ns` of host work the device waits for.
    fn hold(&mut self, task: u32, ns: u64) {
        let t = &mut self.tasks[task as usize];
        t.duration_ns += ns;
        t.duration_contended_ns += ns;
    }

    /// A new ring item and its copy, which also waits for `after` (a layer's router, for its experts; the
    /// previous write-back, for a KV).
    fn item(&mut self, key: StreamKey, bytes: u64, after: Option<u32>) -> u32 {
        let d = self.copy_durations(true, bytes);
        self.item_taking(key, bytes, d, after)
    }

    /// [`Self::item`] with the copy's durations given (alone, beside the CPU pool: a per-sequence KV cache
    /// moves in one copy per sequence).
    fn item_taking(&mut self, key: StreamKey, bytes: u64, d: (u64, u64), after: Option<u32>) -> u32 {
        let item = self.items.len() as u32;
        // Our executor issues an item's copies into its slot behind the slot's release, between events: the
        // copy engine's time beyond the copies (llama.cpp's runtimes copy otherwise).
        let gap = if self.ctx.runtime == crate::Runtime::Ours { self.ctx.cost.ring_copy_gap_ns() } else { 0 };
        let d = (d.0 + gap, d.1 + gap);
        let copy = self.push(TaskKind::Stream { item }, Lane::H2d, d, bytes, after.as_slice());
        self.tasks[copy as usize].item = Some(item);
        let slot = item % self.view.pipeline_depth.max(1);
        self.items.push(RingItem { key, with_kv: false, bytes, slot, copy, readers: 0, last_reader: NONE });
        item
    }

    /// A layer's streamed KV joining the slot of its streamed attention: a second copy into `item`.
    fn join_kv(&mut self, item: u32, bytes: u64, d: (u64, u64), after: Option<u32>) -> u32 {
        let copy = self.push(TaskKind::Stream { item }, Lane::H2d, d, bytes, after.as_slice());
        self.tasks[copy as usize].item = Some(item);
        let it = &mut self.items[item as usize];
        it.with_kv = true;
        it.bytes += bytes;
        copy
    }

    /// Marks `task` as a reader of `item`.
    fn read(&mut self, task: u32, item: u32) {
        self.tasks[task as usize].item = Some(item);
        let it = &mut self.items[item as usize];
        it.readers += 1;
        it.last_reader = task;
    }

    /// llama.cpp op offload: the CPU-resident weights of `unit` (`bytes`) staged by one serialised copy after
    /// `prev`, or the copy that staged them already in this step. The executor copies a unit whole before its
    /// first op, once per pass, and it stays in VRAM until the next unit's copy; llama.cpp copies the same
    /// bytes a tensor at a time, each split's back to back before the split runs (one copy's fixed cost more
    /// per tensor, and the rate of smaller copies: ±1 % of a bf16 unit's copy on the H200).
    fn stage(&mut self, op_index: usize, unit: UnitId, bytes: u64, prev: Option<u32>) -> u32 {
        if let Some((u, copy)) = self.staged
            && u == unit
        {
            return copy;
        }
        let copy = self.offload_copy(op_index, bytes, prev);
        self.staged = Some((unit, copy));
        copy
    }

    /// A serialised op-offload copy of `bytes` after `prev`. Stock llama.cpp copies from pageable memory (its
    /// mapped model file and malloc'd CPU cache).
    fn offload_copy(&mut self, op_index: usize, bytes: u64, prev: Option<u32>) -> u32 {
        self.offload_peak_bytes = self.offload_peak_bytes.max(bytes);
        let d = if self.ctx.workload.host_pageable {
            (self.ctx.cost.h2d_ns(bytes, false), self.ctx.cost.h2d_beside_cpu_ns(bytes, false))
        } else {
            self.copy_durations(true, bytes)
        };
        self.push(TaskKind::Offload { op: op_index as u32 }, Lane::H2d, d, bytes, prev.as_slice())
    }

    fn offload_phase(&self, op: &Op) -> bool {
        self.view.op_offload && op.tokens >= OP_OFFLOAD_MIN_TOKENS
    }

    /// Under op offload, an op reading CPU-resident weights runs on the GPU (ggml offloads every op whose
    /// weights sit in a host buffer, except row gathers).
    fn offloads(&self, op: &Op) -> bool {
        self.offload_phase(op) && op.weight_bytes > 0.0 && !matches!(op.kind, OpKind::Embed)
    }

    /// Under op offload, a CPU-resident layer's attention runs on the GPU too, after copying the cache view it
    /// reads: ggml's scheduler leaves the attention ops (which read no weights) unassigned and expands the GPU
    /// assignment of the offloaded output projection up to them (`ggml_backend_sched_split_graph`, pass 2), so
    /// the K and V views of the host cache become inputs of a GPU split, copied every ubatch and layer.
    fn offloads_attention(&self, op: &Op) -> bool {
        self.offload_phase(op) && matches!(op.kind, OpKind::Attention { .. })
    }

    /// Under op offload, an op with neither weights nor KV runs where its input is (ggml's scheduler expands
    /// assignments to such ops from their neighbours).
    fn follows_input(&self, op: &Op) -> bool {
        self.offload_phase(op) && op.weight_bytes == 0.0 && op.kv_bytes == 0.0
    }

    /// Where an op (not an experts op) runs, given the task before it.
    fn device_of(&self, op: &Op, prev: Option<u32>) -> Device {
        match self.view.placement(op.unit) {
            Placement::Pinned | Placement::Streamed => Device::Gpu,
            Placement::Cpu if self.offloads(op) || self.offloads_attention(op) => Device::Gpu,
            Placement::Cpu if self.follows_input(op) => prev.map_or(Device::Cpu, |p| self.device(p)),
            Placement::Cpu => Device::Cpu,
        }
    }

    /// The task after which the host knows a layer's routing: a GPU router's logits come down with a sync (the
    /// hand-off to the host), a CPU router's are there. Our executor then routes on the host (the top-k and
    /// the per-expert token lists) before any expert starts, on either side: `route_ns` of host work, held on
    /// that task once per layer (a CPU router's own task, the host thread's work after it).
    fn routed_on_host(&mut self, router: Option<u32>, route_ns: u64) -> Option<u32> {
        let r = router?;
        let host = if self.device(r) == Device::Gpu { self.on(router, Device::Cpu) } else { router };
        if let Some(h) = host {
            self.hold(h, route_ns);
        }
        host
    }

    /// What GPU expert work waits for: the routing, known on the host ([`Self::routed_on_host`]), then sent
    /// up. Expert ids are read on the host (our executor routes there); streamed experts always need it: the
    /// host picks what to copy.
    fn routing(&mut self, host: Option<u32>) -> Option<u32> {
        self.on(host, Device::Gpu)
    }

    /// The tasks of a layer's routed experts op after the router task `router`; returns what the residual add
    /// joins: the last GPU share (the stream runs them in order) and the CPU share.
    fn experts(&mut self, i: usize, op: &Op, router: Option<u32>) -> Vec<u32> {
        let OpKind::Experts { n_experts, touched, .. } = op.kind else { unreachable!("an experts op") };
        let layer = op.unit.layer().expect("experts belong to a layer");
        let counts = self.view.layers[layer as usize].experts;
        let expert_bytes = self.ctx.expert_bytes[layer as usize];
        let share = |count: u32| f64::from(count) / f64::from(n_experts);
        // A share's kernels are the whole op's (a share scales `touched`, not the experts each token uses).
        let launches = self.ctx.runtime.launches(op);
        let mut last_gpu = None;
        // A runtime whose kernels take the expert ids on the device (llama.cpp's CUDA `mul_mat_id`) runs pinned
        // experts right after a GPU router.
        let on_device =
            router.filter(|&r| self.ctx.cost.expert_ids_on_device() && self.device(r) == Device::Gpu);
        let host_routed =
            counts[1] > 0 || (counts[2] > 0 && self.offloads(op)) || (counts[0] > 0 && on_device.is_none());
        // Our executor routes on the host for every expert, CPU ones too; llama.cpp's CPU backend routes inside
        // its expert kernels, and its CUDA backend on the device or in its own host sort (below).
        let ours = self.ctx.runtime == crate::Runtime::Ours;
        let route_ns = if ours { self.ctx.cost.host_route_ns(n_experts, op.tokens) } else { 0 };
        let on_host =
            if host_routed || (ours && counts[2] > 0) { self.routed_on_host(router, route_ns) } else { None };
        let routed = if host_routed { self.routing(on_host) } else { None };
        // A decode step's round trip after a GPU router, where the profile measured our executor's: the copies
        // down, the sync (with the pool's workers polling), the routing and the start of either side cost more
        // than a sync and a small copy price.
        if ours
            && matches!(self.phase, Phase::Decode { .. })
            && router.is_some_and(|r| self.device(r) == Device::Gpu)
        {
            let cost = self.ctx.cost;
            let routing = |to: Device| (cost.decode_routing_ns(to, false), cost.decode_routing_ns(to, true));
            if let (Some(h), true) = (on_host, counts[2] > 0 && !self.offloads(op)) {
                self.top_up(&[h], routing(Device::Cpu));
            }
            if let (Some(h), Some(up)) = (on_host, routed) {
                self.top_up(&[h, up], routing(Device::Gpu));
            }
        }
        // The runtime's host-side routing sort, shared out over the GPU shares like the work.
        let sort_ns = self.ctx.runtime.expert_ids_host_ns(op, self.ctx.cost.host_sync_ns()) as f64;
        let held = |f: f64| (sort_ns * f).round() as u64;
        if counts[0] > 0 {
            let deps = Deps::from(on_device.or(routed));
            let sop = scaled(op, share(counts[0]));
            // Our executor runs a small step's pinned experts as one group and a larger step's in tiled groups
            // (exec's `GroupedExperts`, on by default); the cost model says which rows apply (step size,
            // format, the profile's rows).
            last_gpu = Some(self.compute_launching(
                i,
                OpShare::Experts(Placement::Pinned),
                &sop,
                Device::Gpu,
                deps.as_slice(),
                launches,
                ours,
            ));
            self.hold(last_gpu.expect("just built"), held(share(counts[0])));
        }
        if counts[1] > 0 {
            // Touched streamed experts (expected), one ring item per expert's worth, each computed on arrival.
            // The artifact's runtime copies every streamed expert, touched or not; the copies keep the same
            // order after the routing, which prefill (where every expert is touched) is calibrated with.
            let whole = self.ctx.runtime == crate::Runtime::Artifact;
            let copied = if whole { 1.0 } else { touched / f64::from(n_experts) };
            let expected = f64::from(counts[1]) * copied;
            let parts = (expected.ceil() as u32).clamp(1, counts[1]);
            let bytes = (expected * expert_bytes as f64 / f64::from(parts)).ceil() as u64;
            let sop = scaled(op, share(counts[1]) / f64::from(parts));
            // Our executor's host thread enqueues the parts one after another (exec's `enqueue_experts`), each
            // after the previous part's kernels — whose time the expert rows give at the host's pace, as the
            // profiler times them unheld — then the ring's copy issue and span (`ring_copy_issue_ns`). A part's
            // copy was issued while the host enqueued the part `ahead` before it (the ring's depth permitting),
            // the first `ahead` right after the routing; its kernels run once enqueued. Where the host's part
            // takes longer than a copy (q4_0 experts on the H200 machine), the host paces the layer. Not priced
            // where not measured (0), nor on llama.cpp's runtimes.
            let issue_ns = if ours { self.ctx.cost.ring_copy_issue_ns() } else { 0 };
            let ahead = RING_ISSUE_AHEAD.min(self.view.pipeline_depth.max(1) as usize - 1);
            let mut enqueues: Vec<u32> = Vec::new();
            // What the host did last before the first part: the routing, then the pinned experts' launches.
            let mut host = Deps::from(routed);
            host.push_some(last_gpu);
            let mut launching_ns = 0;
            for part in 0..parts {
                let next_item = self.items.len() as u32;
                let enqueue = (issue_ns > 0).then(|| {
                    let d = launching_ns + issue_ns;
                    self.push(TaskKind::Enqueue { item: next_item }, Lane::Host, (d, d), 0, host.as_slice())
                });
                enqueues.extend(enqueue);
                let issued = match (part as usize).checked_sub(ahead) {
                    Some(p) if issue_ns > 0 => Some(enqueues[p]),
                    _ => routed,
                };
                let item = self.item(StreamKey::Experts { layer, part }, bytes, issued);
                debug_assert_eq!(item, next_item, "the enqueue names its part's item");
                let mut deps = Deps::from(routed);
                deps.push(self.items[item as usize].copy);
                deps.push_some(enqueue);
                let t = self.compute_launching(
                    i,
                    OpShare::Experts(Placement::Streamed),
                    &sop,
                    Device::Gpu,
                    deps.as_slice(),
                    launches.div_ceil(parts),
                    false,
                );
                self.hold(t, held(share(counts[1]) / f64::from(parts)));
                self.read(t, item);
                last_gpu = Some(t);
                host = Deps::from(enqueue);
                launching_ns = self.tasks[t as usize].duration_ns;
            }
        }
        let mut joins: Vec<u32> = last_gpu.into_iter().collect();
        if counts[2] > 0 {
            let sop = scaled(op, share(counts[2]));
            let t = if self.offloads(op) {
                // The layer's CPU experts are staged as one, apart from the router's weights (the op's unit).
                let experts_key = UnitId::Expert { layer, expert: 0 };
                let copy = self.stage(i, experts_key, u64::from(counts[2]) * expert_bytes, router);
                let mut deps = Deps::from(routed);
                deps.push(copy);
                let t = self.compute_launching(
                    i,
                    OpShare::Experts(Placement::Cpu),
                    &sop,
                    Device::Gpu,
                    deps.as_slice(),
                    launches,
                    false,
                );
                self.hold(t, held(share(counts[2])));
                t
            } else {
                let deps = Deps::from(if ours { on_host } else { self.on(router, Device::Cpu) });
                self.compute(i, OpShare::Experts(Placement::Cpu), &sop, Device::Cpu, deps.as_slice())
            };
            joins.push(t);
        }
        joins
    }
}

/// A task's dependencies while it is built (at most an input per expert share, the shared experts, a copy).
#[derive(Debug, Default, Clone, Copy)]
struct Deps {
    ids: [u32; 6],
    len: usize,
}

impl Deps {
    fn push(&mut self, d: u32) {
        self.ids[self.len] = d;
        self.len += 1;
    }

    fn push_some(&mut self, d: Option<u32>) {
        if let Some(d) = d {
            self.push(d);
        }
    }

    fn as_slice(&self) -> &[u32] {
        &self.ids[..self.len]
    }
}

impl From<Option<u32>> for Deps {
    fn from(d: Option<u32>) -> Deps {
        let mut deps = Deps::default();
        deps.push_some(d);
        deps
    }
}

/// llama.cpp offloads an op of CPU-resident weights to the GPU from this many tokens on.
pub const OP_OFFLOAD_MIN_TOKENS: u64 = 32;

fn scaled(op: &Op, f: f64) -> Op {
    let mut o = *op;
    if let OpKind::Experts { touched, .. } = &mut o.kind {
        *touched *= f;
    }
    o.flops *= f;
    o.weight_bytes *= f;
    o.act_bytes *= f;
    o
}

/// What building the step graphs of one phase view keeps from one graph to the next: the op and copy times
/// asked of the cost model (valid for that view and cost model only) and the vectors of graphs that are no
/// longer needed, cleared and refilled rather than reallocated.
#[derive(Debug, Default)]
pub(crate) struct Reuse {
    memo: CostMemo,
    copy_memo: FxHashMap<(bool, u64), (u64, u64)>,
    handoff_after: Vec<u32>,
    /// Vectors of recycled graphs, one set per graph: a prefill bound holds every sampled chunk's graph at once,
    /// and each later build takes a set grown to a graph's size rather than growing fresh vectors (their
    /// reallocations were ≈ 6 % of a qwen3-235b-a22b sweep's instructions).
    spare: Vec<GraphVecs>,
}

/// The vectors of one [`StepGraph`].
#[derive(Debug, Default)]
struct GraphVecs {
    tasks: Vec<Task>,
    deps: Vec<u32>,
    items: Vec<RingItem>,
    ops: Vec<Op>,
}

/// Recycled sets [`Reuse`] keeps: as many graphs as a prefill bound holds at once (the sampled full chunks and
/// the last), with room to spare.
const SPARE_GRAPHS: usize = 8;

impl Reuse {
    /// Forgets the op and copy times (keeping their tables' memory), for another view or cost model.
    pub(crate) fn forget_times(&mut self) {
        self.memo.clear();
        self.copy_memo.clear();
    }

    /// Takes back the vectors of a graph built with this `Reuse`.
    pub(crate) fn recycle(&mut self, g: StepGraph) {
        if self.spare.len() < SPARE_GRAPHS {
            self.spare.push(GraphVecs { tasks: g.tasks, deps: g.deps, items: g.items, ops: g.ops });
        }
    }
}

/// Builds the task graph of consecutive `phases` under `view` (one graph, the ring running across steps).
pub(crate) fn build(ctx: &BuildCtx<'_>, view: &PhaseView, phases: &[Phase]) -> StepGraph {
    build_with(ctx, view, phases, &mut Reuse::default())
}

/// [`build`] with the memos and buffers of `reuse` (built for the same view and cost model).
pub(crate) fn build_with(
    ctx: &BuildCtx<'_>,
    view: &PhaseView,
    phases: &[Phase],
    reuse: &mut Reuse,
) -> StepGraph {
    fn cleared<T>(mut v: Vec<T>) -> Vec<T> {
        v.clear();
        v
    }
    let vecs = reuse.spare.pop().unwrap_or_default();
    let mut b = Builder {
        ctx,
        memo: std::mem::take(&mut reuse.memo),
        copy_memo: std::mem::take(&mut reuse.copy_memo),
        view,
        phase: phases[0],
        step: 0,
        tasks: cleared(vecs.tasks),
        deps: cleared(vecs.deps),
        handoff_after: cleared(std::mem::take(&mut reuse.handoff_after)),
        items: cleared(vecs.items),
        last_writeback: vec![NONE; ctx.spec.text.n_layers as usize],
        offload_peak_bytes: 0,
        staged: None,
        graphed: false,
    };
    let mut all_ops: Vec<Op> = cleared(vecs.ops);
    let mut op_counts: Vec<usize> = Vec::with_capacity(phases.len());
    let mut step_end = Vec::with_capacity(phases.len());
    // The previous step's result, on the host.
    let mut prev: Option<u32> = None;
    for (step, &phase) in phases.iter().enumerate() {
        // A repeated phase (the decode warm-up pair) reuses the previous step's op list.
        let ops = match step.checked_sub(1) {
            Some(k) if phases[k] == phase => all_ops[all_ops.len() - op_counts[k]..].to_vec(),
            _ => {
                let mut ops = workload::ops(ctx.spec, ctx.inv, ctx.workload, phase);
                if ctx.cost.one_token_projections_fused() {
                    // The executor fuses on the GPU only (pinned or streamed units).
                    workload::fuse_one_token_projections(
                        &mut ops,
                        |u| view.placement(u) != Placement::Cpu,
                        ctx.cost.one_token_norm_act_fused(),
                    );
                }
                ops
            }
        };
        op_counts.push(ops.len());
        let base = all_ops.len();
        b.step = step as u32;
        b.phase = phase;
        // Every pass stages its units again (the staging area is reused unit after unit).
        b.staged = None;
        b.graphed = ctx.runtime.replays_graphs() && phase.tokens() == 1 && view.one_gpu_split();
        b.tasks.reserve(ops.len() * 3 / 2);
        b.deps.reserve(ops.len() * 2);
        b.handoff_after.reserve(ops.len() * 3 / 2);
        let mut segment = Segment::Prologue;
        // Items of the current segment: a unit read again within it reuses its item.
        let mut segment_items: Vec<(UnitId, u32, u32)> = Vec::new();
        // Within a MoE layer after its experts op: the router task and the expert shares to join.
        let mut moe: Option<(Option<u32>, Vec<u32>)> = None;
        for (j, op) in ops.iter().enumerate() {
            let i = base + j;
            let s = match op.unit.layer() {
                Some(l) => Segment::Layer(l),
                None if segment == Segment::Prologue => Segment::Prologue,
                None => Segment::Epilogue,
            };
            if s != segment {
                segment = s;
                segment_items.clear();
            }
            if let OpKind::Experts { .. } = op.kind {
                let joins = b.experts(i, op, prev);
                // Shared experts (if any) read the same input as the routed ones and run beside them.
                moe = Some((prev, joins));
                continue;
            }
            let dev = b.device_of(op, prev);
            if j == 0 && dev == Device::Gpu {
                // Token ids go to the device; the host is not waiting on the device yet.
                let bytes = phase.tokens() * 4;
                let d = b.copy_ns(true, bytes);
                prev = Some(b.push(
                    TaskKind::Handoff { to: Device::Gpu },
                    Lane::Handoff,
                    (d, d),
                    bytes,
                    prev.as_slice(),
                ));
            }
            let mut deps = Deps::default();
            match moe.take() {
                Some((router, joins))
                    if matches!(op.kind, OpKind::Add) && matches!(op.unit, UnitId::Router { .. }) =>
                {
                    for t in joins {
                        deps.push_some(b.join_experts(t, dev));
                    }
                    if prev != router {
                        deps.push_some(b.on(prev, dev));
                    }
                }
                other => {
                    moe = other;
                    deps.push_some(b.on(prev, dev));
                }
            }
            let placement = view.placement(op.unit);
            let mut item = None;
            if placement == Placement::Streamed && (op.weight_bytes > 0.0 || op.kv_bytes > 0.0) {
                // (item, the copy this op waits for) of the unit in this segment.
                let found = segment_items.iter().find(|(u, ..)| *u == op.unit).map(|x| (x.1, x.2));
                let (it, copy) = found.unwrap_or_else(|| {
                    let (it, copy) = match op.unit {
                        UnitId::Kv { layer } => {
                            let w = b.last_writeback[layer as usize];
                            let after = (w != NONE).then_some(w);
                            let attn = segment_items.iter().find(|(u, ..)| *u == UnitId::Attn { layer });
                            let copies = ctx.workload.kv_copies(phase);
                            let bytes =
                                ctx.runtime.kv_upload_bytes(ctx.kv_layer_bytes, ctx.kv_token_bytes, phase);
                            // The host's gathering of the cells, then the copies, all ahead of the attention.
                            let gather = ctx.runtime.kv_gather_ns(ctx.workload, phase);
                            let (alone, beside_cpu) = b.copy_durations(true, bytes / copies);
                            let d = (gather + copies * alone, gather + copies * beside_cpu);
                            // The attention's slot carries the KV too.
                            if let Some(&(_, it, _)) = attn {
                                (it, b.join_kv(it, bytes, d, after))
                            } else {
                                let it = b.item_taking(StreamKey::Unit(op.unit), bytes, d, after);
                                (it, b.items[it as usize].copy)
                            }
                        }
                        u => {
                            let it = b.item(StreamKey::Unit(u), ctx.inv.unit_bytes(u), None);
                            (it, b.items[it as usize].copy)
                        }
                    };
                    segment_items.push((op.unit, it, copy));
                    (it, copy)
                });
                deps.push(copy);
                item = Some(it);
            }
            if placement == Placement::Cpu && b.offloads(op) {
                deps.push(b.stage(i, op.unit, ctx.inv.unit_bytes(op.unit), prev));
            } else if placement == Placement::Cpu && b.offloads_attention(op) {
                // The cells the chunk reads, its own new ones included (written to the host cache first).
                deps.push(b.offload_copy(i, op.kv_bytes as u64, prev));
            }
            let t = b.compute(i, OpShare::Whole, op, dev, deps.as_slice());
            if let Some(it) = item {
                b.read(t, it);
            }
            if let (OpKind::Attention { .. }, UnitId::Kv { layer }, Device::Gpu) = (op.kind, op.unit, dev)
                && view.layers[layer as usize].kv_mirrored
            {
                // One copy of the new cells per sequence unless the cache is unified.
                let copies = ctx.workload.kv_copies(phase);
                let bytes = op.tokens * ctx.kv_token_bytes;
                let d = copies * b.copy_ns(false, bytes / copies);
                let w = b.push(TaskKind::KvWriteback { op: i as u32 }, Lane::D2h, (d, d), bytes, &[t]);
                b.last_writeback[layer as usize] = w;
                if let Some(it) = item {
                    b.read(w, it);
                }
            }
            prev = Some(t);
        }
        all_ops.extend(ops);
        let last = prev.expect("a step has ops");
        let end = if b.device(last) == Device::Gpu {
            // The sampled tokens (or, for a chunk without logits, just completion) go back to the host.
            let bytes = phase.logit_rows() * 4;
            let d = ctx.cost.host_sync_ns() + b.copy_ns(false, bytes);
            b.push(TaskKind::Handoff { to: Device::Cpu }, Lane::Handoff, (d, d), bytes, &[last])
        } else {
            last
        };
        step_end.push(end);
        prev = Some(end);
    }

    // The topological argument above: item i reuses the slot of item i − depth, whose readers all come first.
    let depth = view.pipeline_depth.max(1) as usize;
    debug_assert!(
        (depth..b.items.len()).all(|i| b.items[i - depth].last_reader < b.items[i].copy),
        "a ring item is read after the next tenant of its slot was created"
    );

    reuse.memo = b.memo;
    reuse.copy_memo = b.copy_memo;
    reuse.handoff_after = b.handoff_after;
    StepGraph {
        phase_kind: view.kind,
        phases: phases.to_vec(),
        ops: all_ops,
        tasks: b.tasks,
        items: b.items,
        step_end,
        pipeline_depth: view.pipeline_depth,
        slot_bytes: view.slot_bytes,
        offload_peak_bytes: b.offload_peak_bytes,
        deps: b.deps,
    }
}
