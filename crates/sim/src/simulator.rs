//! [`Simulator`]: a plan, a model and a cost model in; one step or a whole workload out.
//!
//! A workload is prefill (P prompt tokens in ubatch chunks, for each of R requests in turn, with the prefill
//! plan), a plan switch (the re-upload of `switch_bytes`), then G decode steps of R sequences (decode plan).
//! A prefill chunk starts with empty copy engines and an empty ring and ends when its last task ends (the
//! host waits at the end of each chunk). Decode steps are measured in steady state, as the executor runs them:
//! the ring keeps copying into the next step while the current one finishes, so a decode step is simulated
//! after a warm-up step of the same shape, and its time runs from the warm-up step's sampled token reaching
//! the host to its own.
//!
//! Sampling: a step's time depends on its position only through attention (keys attended, KV read), which is
//! linear in the position, so [`Simulator::run`] simulates a few representative steps and interpolates
//! linearly between them: for decode the first, the last and `decode_samples − 2` evenly between; for prefill
//! the same over the full chunks of one request, plus the last chunk (which computes logits, and may be
//! shorter) on its own. All R requests' prefills are the same. [`SimOptions::exact`] simulates every step.

use std::ops::Deref;
use std::sync::Arc;

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::metrics::{Metrics, Resource};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, PhasePlan, Placement, Plan, PlanInvalid, VramBreakdown};
use pipeshard_core::trace::Trace;
use pipeshard_core::workload::{self, Op, OpKind, Phase, Workload, WorkloadError};

use crate::engine::{self, StepOutcome};
use crate::graph::{self, BuildCtx, Lane, LayerView, PhaseView, StepGraph, TaskKind};

/// Why a plan cannot be simulated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("the plan is for model `{plan}` but the spec given is `{spec}`")]
    ModelMismatch { plan: String, spec: String },
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("invalid plan: {0}")]
    InvalidPlan(#[from] PlanInvalid),
    #[error(transparent)]
    Vision(#[from] pipeshard_core::vision::VisionError),
}

/// How much of a workload to simulate, and what to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimOptions {
    /// Full prefill chunks of one request simulated (first, last, evenly between); the rest interpolated.
    pub prefill_samples: u32,
    /// Decode steps simulated (first, last, evenly between); the rest interpolated.
    pub decode_samples: u32,
    /// Simulate every step.
    pub exact: bool,
    /// Build a Chrome trace of the simulated steps.
    pub trace: bool,
}

impl Default for SimOptions {
    /// 5 prefill samples, 3 decode samples, no trace.
    fn default() -> SimOptions {
        SimOptions { prefill_samples: 5, decode_samples: 3, exact: false, trace: false }
    }
}

/// One step of the integrated timeline.
#[derive(Debug, Clone)]
struct StepTime {
    phase: Phase,
    duration_ns: u64,
    busy_ns: [u64; 4],
    /// Kept for simulated steps when tracing, with the measured step's index in it and where its window
    /// starts.
    outcome: Option<(StepOutcome, u32, u64)>,
    simulated: bool,
}

/// What the steps simulated for one phase reuse from one step to the next (see [`graph::Reuse`] and
/// [`engine::Workspace`]).
#[derive(Debug, Default)]
struct PhaseScratch {
    graph: graph::Reuse,
    engine: engine::Workspace,
}

thread_local! {
    /// The buffers of the last phase simulated on this thread: a planner judging candidates simulates many
    /// short phases, and fresh buffers for each cost page faults.
    static SCRATCH: std::cell::RefCell<PhaseScratch> = std::cell::RefCell::default();
}

impl PhaseScratch {
    /// This thread's buffers, without the memos of the phase that used them last.
    fn take() -> PhaseScratch {
        let mut s = SCRATCH.take();
        s.graph.forget_times();
        s
    }

    /// Keeps the buffers for the next phase simulated on this thread.
    fn give_back(self) {
        SCRATCH.set(self);
    }
}

/// The result of simulating a whole workload.
#[derive(Debug, Clone)]
pub struct Simulation {
    pub metrics: Metrics,
    /// Prefill of all requests (= TTFT).
    pub prefill_ns: u64,
    /// Re-upload of the plan switch before the first decode step.
    pub switch_ns: u64,
    /// Switch plus all decode steps.
    pub decode_ns: u64,
    /// VRAM the simulated run used, per phase (pinned and KV from the placements, slots actually held,
    /// scratch of the largest step if anything runs on the GPU, plus op-offload weights, runtime overhead from
    /// the cost model).
    pub vram_used: [VramBreakdown; 2],
    /// Busy time of each resource over the decode steps (switch excluded), in [`Resource::ALL`] order.
    pub decode_busy_ns: [u64; 4],
    pub steps_simulated: u64,
    pub steps_total: u64,
    pub trace: Option<Trace>,
}

impl Simulation {
    /// The resource that bounds a decode step (the busiest over the decode steps) and the share of decode time
    /// it is busy: near 1, the step sits on that resource's bound.
    #[must_use]
    pub fn decode_bound(&self) -> (Resource, f64) {
        let steps_ns = self.decode_ns - self.switch_ns;
        let (i, b) = self.decode_busy_ns.iter().enumerate().max_by_key(|(_, b)| **b).expect("four resources");
        (Resource::ALL[i], *b as f64 / steps_ns.max(1) as f64)
    }
}

/// The model's inventory: the caller's, or the one shared in the process ([`Inventory::shared`]).
enum Inv<'a> {
    Borrowed(&'a Inventory),
    Shared(Arc<Inventory>),
}

impl Deref for Inv<'_> {
    type Target = Inventory;

    fn deref(&self) -> &Inventory {
        match self {
            Inv::Borrowed(inv) => inv,
            Inv::Shared(inv) => inv,
        }
    }
}

/// Simulates one plan (see the module docs).
pub struct Simulator<'a> {
    spec: &'a ModelSpec,
    plan: &'a Plan,
    cost: &'a dyn CostModel,
    inv: Inv<'a>,
    views: [PhaseView; 2],
    expert_bytes: Vec<u64>,
    kv_layer_bytes: u64,
    kv_token_bytes: u64,
    runtime: Runtime,
    audit: bool,
}

/// Whose runtime executes the plan: ours (the executor in pipeshard-exec) or the paper's artifact (its llama.cpp
/// fork), which differs where a plan streams routed experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Runtime {
    /// Ours: a layer's streamed experts are copied once routed, only those its tokens touch.
    #[default]
    Ours,
    /// Stock llama.cpp (the paper's `-ngl` baseline): its GPU kernels as [`Runtime::launches`] counts them.
    Stock,
    /// The artifact's: a streamed split's weights are prefetched as whole tensors, so a layer's streamed
    /// `*_exps` tensors cross PCIe with all their experts, touched or not (DIGEST §3.2, §3.4). Before a streamed
    /// layer's KV upload from a unified cache, the host collects the cells of each sequence by walking the
    /// cache's set of used cells once per sequence (`get_cells_for_seq`, then a sort): R × used cells visits
    /// at [`Runtime::CELL_VISIT_PS`] each, which grows with R² and bites at 64 requests. It uploads only the
    /// used cells ([`Runtime::kv_upload_bytes`]).
    Artifact,
}

impl Runtime {
    /// Host time per visited cell of the artifact's per-sequence cell walk, picoseconds: a replica of its
    /// bookkeeping (`scripts/artifact-kv-walk.cpp`) took 5.6, 3.7 and 3.4 ns per visit at 4, 16 and 64
    /// sequences of 953 cells on the development machine (13 ms per layer upload at 64).
    pub const CELL_VISIT_PS: u64 = 3_400;

    /// Host time per (expert, token) pair of llama.cpp's routing sort before a several-token CUDA `mul_mat_id`,
    /// picoseconds: a replica of its loop (`scripts/artifact-mmid-sort.cpp`) took 2.6–2.8 ns a pair at 4–1024
    /// tokens and 128 experts on the development machine (0.36 ms a call at 1024 tokens).
    pub const EXPERT_PAIR_PS: u64 = 2_750;

    /// `mul_mat_id` calls of a routed-experts op: gate, up and down (`build_moe_ffn`).
    const EXPERT_MATMULS: u64 = 3;

    /// Kernels the runtime launches for `op` on the GPU. Ours: one per op. llama.cpp (stock and the artifact):
    /// a K and a V store, and for a MoE layer the router's softmax, top-k, weight gather and renormalisation
    /// beside its matmul, and the experts' three `mul_mat_id`, the GLU, the weighting and one add per further
    /// expert used to sum them (`build_moe_ffn`).
    #[must_use]
    pub fn launches(self, op: &Op) -> u32 {
        if self == Runtime::Ours {
            return 1;
        }
        match op.kind {
            OpKind::KvStore => 2,
            OpKind::Router { .. } => 6,
            OpKind::Experts { touched, tokens_per_touched, .. } => {
                let top_k = (touched * tokens_per_touched / op.tokens.max(1) as f64).round() as u32;
                4 + top_k.max(1)
            }
            _ => 1,
        }
    }

    /// Whether the runtime replays a step's kernels from a CUDA graph when the step allows it (one token, one
    /// GPU split: every text unit but the token embedding pinned): llama.cpp's CUDA backend does (stock, and the
    /// artifact's single-plan mode); a step of several tokens disables it (its batched adds and `mul_mat_id`),
    /// and so do several GPU splits a step (each split's graph replaces the last until the backend gives up).
    /// Stock llama.cpp with layers on the CPU decodes as if it launched every kernel too: the baseline's runs
    /// take 23.9 ms a token at `-ngl 44` against 6.2 ms at `-ngl 49` (qwen3-30b-a3b, 1K), far more than its
    /// four CPU layers and CPU output head cost.
    #[must_use]
    pub fn replays_graphs(self) -> bool {
        self != Runtime::Ours
    }

    /// Host time llama.cpp (stock and the artifact) spends routing a GPU routed-experts op of several tokens:
    /// for each of its `mul_mat_id` calls, the CUDA backend (b6097, `ggml_cuda_mul_mat_q` with ids, and its
    /// fallback alike) copies the expert ids to the host and syncs, scans every token's used experts once per
    /// expert to build the gather lists and expert bounds, copies them back and syncs again. The GPU idles
    /// meanwhile (the host issues nothing), so it lengthens the op. One-token steps take the vector kernel,
    /// which reads the ids on the device. Ours routes once per layer on the host (the hand-offs).
    #[must_use]
    pub fn expert_ids_host_ns(self, op: &Op, host_sync_ns: u64) -> u64 {
        match op.kind {
            OpKind::Experts { n_experts, .. } if self != Runtime::Ours && op.tokens > 1 => {
                let sort_ns = u64::from(n_experts) * op.tokens * Runtime::EXPERT_PAIR_PS / 1000;
                Runtime::EXPERT_MATMULS * (2 * host_sync_ns + sort_ns)
            }
            _ => 0,
        }
    }

    /// Bytes of a streamed layer's KV uploaded before its attention in `phase`, of `full_bytes` allocated
    /// (every sequence's whole context) at `token_bytes` a cell. The artifact uploads the cells its sequences
    /// use (`pipeline_upload_kv_cells_for_seqs`: `get_cells_for_seq`, the chunk's own new cells included), so a
    /// long prompt's early chunks copy little. Ours uploads the cells already in the cache that the pass reads
    /// (exec's `SeqKv::filled`): a prefill chunk its own sequence's earlier cells, a decode step every
    /// sequence's cells before its new token; the new cells are computed on the GPU. Stock llama.cpp uploads the
    /// whole allocated cache.
    #[must_use]
    pub fn kv_upload_bytes(self, full_bytes: u64, token_bytes: u64, phase: Phase) -> u64 {
        let cells = match (self, phase) {
            (Runtime::Stock, _) => return full_bytes,
            (Runtime::Artifact, Phase::Prefill { tokens, start_pos, .. }) => start_pos + tokens,
            (Runtime::Artifact, Phase::Decode { batch, ctx }) => batch * ctx,
            (Runtime::Ours, Phase::Prefill { start_pos, .. }) => start_pos,
            (Runtime::Ours, Phase::Decode { batch, ctx }) => batch * ctx.saturating_sub(1),
        };
        full_bytes.min(cells * token_bytes)
    }

    /// Host time this runtime spends gathering the cells of a streamed layer's KV upload in `phase`.
    #[must_use]
    pub fn kv_gather_ns(self, w: &Workload, phase: Phase) -> u64 {
        match phase {
            Phase::Decode { batch, ctx } if self == Runtime::Artifact && w.kv_unified => {
                batch * batch * ctx * Runtime::CELL_VISIT_PS / 1000
            }
            _ => 0,
        }
    }
}

impl std::fmt::Debug for Simulator<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulator")
            .field("model", &self.spec.name)
            .field("planner", &self.plan.planner)
            .finish()
    }
}

fn phase_index(kind: PhaseKind) -> usize {
    match kind {
        PhaseKind::Prefill => 0,
        PhaseKind::Decode => 1,
    }
}

fn view_of(spec: &ModelSpec, pp: &PhasePlan, default_threads: u32) -> PhaseView {
    let cpu = LayerView {
        attn: Placement::Cpu,
        ffn: Placement::Cpu,
        shared_experts: Placement::Cpu,
        kv: Placement::Cpu,
        experts: [0; 3],
        kv_mirrored: false,
    };
    let mut v = PhaseView {
        kind: pp.phase,
        token_embd: Placement::Cpu,
        output: Placement::Cpu,
        layers: vec![cpu; spec.text.n_layers as usize],
        pipeline_depth: pp.pipeline_depth,
        slot_bytes: pp.slot_bytes,
        op_offload: pp.op_offload,
        cpu_threads: if pp.cpu_threads == 0 { default_threads } else { pp.cpu_threads },
        all_pinned_but_embd: pp.placements.iter().all(|up| {
            up.placement == Placement::Pinned
                || matches!(
                    up.unit,
                    UnitId::TokenEmbd
                        | UnitId::VisionPatchEmbd
                        | UnitId::VisionBlock { .. }
                        | UnitId::VisionMerger
                )
        }),
    };
    for up in &pp.placements {
        let p = up.placement;
        match up.unit {
            UnitId::TokenEmbd => v.token_embd = p,
            UnitId::Output => v.output = p,
            UnitId::Attn { layer } => v.layers[layer as usize].attn = p,
            UnitId::Ffn { layer } | UnitId::Router { layer } => v.layers[layer as usize].ffn = p,
            UnitId::SharedExperts { layer } => v.layers[layer as usize].shared_experts = p,
            UnitId::Kv { layer } => v.layers[layer as usize].kv = p,
            UnitId::Expert { layer, .. } => {
                let i = match p {
                    Placement::Pinned => 0,
                    Placement::Streamed => 1,
                    Placement::Cpu => 2,
                };
                v.layers[layer as usize].experts[i] += 1;
            }
            UnitId::VisionPatchEmbd | UnitId::VisionBlock { .. } | UnitId::VisionMerger => {}
        }
    }
    v
}

/// Indices of `samples` steps out of `m`: first, last and evenly between (all when `exact`).
/// The value a fraction `f` of the way from `x` to `y`, rounded to the nanosecond.
fn lerp(x: u64, y: u64, f: f64) -> u64 {
    (x as f64 + f * (y as f64 - x as f64)).round() as u64
}

/// When a graph's last task could end at the earliest: each task starts once its inputs have ended and the
/// task before it on its exclusive resource has (the engine's order), and takes its faster rate less 1 ns for
/// the rounding of a rate change. The engine adds waits for ring slots and slower rates, never less.
fn earliest_end_ns(g: &StepGraph) -> u64 {
    let mut end_ns = vec![0u64; g.tasks.len()];
    let mut lane_end_ns = [0u64; 4];
    let mut last_ns = 0;
    for (t, task) in g.tasks.iter().enumerate() {
        // An input created later (none is) would count as ended at 0: the bound only gets weaker.
        let mut start_ns = g.deps(t as u32).iter().map(|&d| end_ns[d as usize]).max().unwrap_or(0);
        let lane = task.lane.exclusive_index();
        if let Some(l) = lane {
            start_ns = start_ns.max(lane_end_ns[l]);
        }
        let end = start_ns + task.duration_ns.min(task.duration_contended_ns).saturating_sub(1);
        end_ns[t] = end;
        if let Some(l) = lane {
            lane_end_ns[l] = end;
        }
        last_ns = last_ns.max(end);
    }
    last_ns
}

fn sample_indices(m: usize, samples: u32, exact: bool) -> Vec<usize> {
    let k = samples.max(2) as usize;
    if exact || m <= k {
        return (0..m).collect();
    }
    let mut v: Vec<usize> =
        (0..k).map(|j| ((j * (m - 1)) as f64 / (k - 1) as f64).round() as usize).collect();
    v.dedup();
    v
}

impl<'a> Simulator<'a> {
    /// Checks the plan against the model and prepares per-phase lookups.
    pub fn new(
        spec: &'a ModelSpec,
        plan: &'a Plan,
        cost: &'a dyn CostModel,
    ) -> Result<Simulator<'a>, SimError> {
        Simulator::build(spec, Inv::Shared(Inventory::shared(spec)), plan, cost)
    }

    /// The same with the model's inventory already built (`Inventory::new(spec)`, or the exact inventory of a
    /// GGUF file): a sweep builds it once per model rather than once per plan.
    pub fn with_inventory(
        spec: &'a ModelSpec,
        inv: &'a Inventory,
        plan: &'a Plan,
        cost: &'a dyn CostModel,
    ) -> Result<Simulator<'a>, SimError> {
        Simulator::build(spec, Inv::Borrowed(inv), plan, cost)
    }

    fn build(
        spec: &'a ModelSpec,
        inv: Inv<'a>,
        plan: &'a Plan,
        cost: &'a dyn CostModel,
    ) -> Result<Simulator<'a>, SimError> {
        if plan.model != spec.name {
            return Err(SimError::ModelMismatch { plan: plan.model.clone(), spec: spec.name.clone() });
        }
        plan.workload.validate()?;
        plan.validate(&inv)?;
        let threads = cost.cpu_threads();
        let mut views = [view_of(spec, &plan.prefill, threads), view_of(spec, &plan.decode, threads)];
        let decode_kv: Vec<Placement> = views[1].layers.iter().map(|l| l.kv).collect();
        for (i, l) in views[0].layers.iter_mut().enumerate() {
            l.kv_mirrored = l.kv == Placement::Streamed
                || (l.kv == Placement::Pinned && decode_kv[i] != Placement::Pinned);
        }
        for l in &mut views[1].layers {
            l.kv_mirrored = l.kv == Placement::Streamed;
        }
        let expert_bytes = (0..spec.text.n_layers)
            .map(|layer| inv.unit_bytes(UnitId::Expert { layer, expert: 0 }))
            .collect();
        Ok(Simulator {
            spec,
            plan,
            cost,
            kv_layer_bytes: plan.workload.kv_bytes_per_layer(spec),
            kv_token_bytes: spec.kv_bytes_per_token_layer(plan.workload.kv_dtype),
            inv,
            views,
            expert_bytes,
            runtime: Runtime::Ours,
            audit: false,
        })
    }

    /// Simulates the plan as `runtime` executes it.
    #[must_use]
    pub fn with_runtime(mut self, runtime: Runtime) -> Simulator<'a> {
        self.runtime = runtime;
        self
    }

    /// Records the time of every event in each [`StepOutcome`] (for tests of the engine).
    #[must_use]
    pub fn with_audit(mut self, audit: bool) -> Simulator<'a> {
        self.audit = audit;
        self
    }

    /// The model's inventory.
    #[must_use]
    pub fn inventory(&self) -> &Inventory {
        &self.inv
    }

    /// The task graph of consecutive steps (the ring runs across them).
    #[must_use]
    pub fn graph(&self, kind: PhaseKind, phases: &[Phase]) -> StepGraph {
        graph::build(&self.build_ctx(), &self.views[phase_index(kind)], phases)
    }

    fn build_ctx(&self) -> BuildCtx<'_> {
        BuildCtx {
            inv: &self.inv,
            spec: self.spec,
            workload: &self.plan.workload,
            cost: self.cost,
            kv_layer_bytes: self.kv_layer_bytes,
            kv_token_bytes: self.kv_token_bytes,
            expert_bytes: &self.expert_bytes,
            runtime: self.runtime,
        }
    }

    /// Simulates one step from a cold start: a prefill chunk with the prefill plan, or a decode step with the
    /// decode plan.
    #[must_use]
    pub fn step(&self, kind: PhaseKind, phase: Phase) -> StepOutcome {
        self.steps(kind, &[phase])
    }

    /// Simulates consecutive steps of one phase, the ring running across them.
    #[must_use]
    pub fn steps(&self, kind: PhaseKind, phases: &[Phase]) -> StepOutcome {
        engine::execute(self.graph(kind, phases), self.audit)
    }

    /// The steps of one request's prefill (sampled and interpolated as `opts` says).
    fn prefill_steps(
        &self,
        opts: &SimOptions,
        max_slots: &mut u32,
        offload_bytes: &mut u64,
    ) -> Vec<StepTime> {
        let mut scratch = PhaseScratch::take();
        let steps =
            self.prefill_steps_with(opts, &mut scratch, [Vec::new(), Vec::new()], max_slots, offload_bytes);
        scratch.give_back();
        steps
    }

    /// One request's prefill chunks: all but the last, and the last.
    fn one_request_chunks(&self) -> [Vec<Phase>; 2] {
        let w = &self.plan.workload;
        let mut one = w.prefill_chunks();
        one.truncate(one.len() / w.batch as usize);
        let last = one.split_off(one.len() - 1);
        [one, last]
    }

    /// [`Self::prefill_steps`] with the sampled chunks' graphs of each family already built, if `built` holds
    /// them (in sample order).
    fn prefill_steps_with(
        &self,
        opts: &SimOptions,
        scratch: &mut PhaseScratch,
        built: [Vec<StepGraph>; 2],
        max_slots: &mut u32,
        offload_bytes: &mut u64,
    ) -> Vec<StepTime> {
        let [full, last] = self.one_request_chunks();
        let [built_full, built_last] = built;
        let mut steps = self.family(
            PhaseKind::Prefill,
            &full,
            opts.prefill_samples,
            opts,
            scratch,
            built_full,
            max_slots,
            offload_bytes,
        );
        steps.extend(self.family(
            PhaseKind::Prefill,
            &last,
            1,
            opts,
            scratch,
            built_last,
            max_slots,
            offload_bytes,
        ));
        steps
    }

    /// The decode steps (sampled and interpolated as `opts` says).
    fn decode_steps(&self, opts: &SimOptions, max_slots: &mut u32, offload_bytes: &mut u64) -> Vec<StepTime> {
        let w = &self.plan.workload;
        let phases: Vec<Phase> = (0..w.gen_tokens).map(|i| w.decode_step(i)).collect();
        let mut scratch = PhaseScratch::take();
        let steps = self.family(
            PhaseKind::Decode,
            &phases,
            opts.decode_samples,
            opts,
            &mut scratch,
            Vec::new(),
            max_slots,
            offload_bytes,
        );
        scratch.give_back();
        steps
    }

    /// The time of one phase alone, as [`Simulator::run`] reports it: the prefill of all requests (= TTFT), or
    /// the decode steps without the plan switch. A planner comparing candidate layouts of one phase need not
    /// simulate the other.
    #[must_use]
    pub fn phase_ns(&self, kind: PhaseKind, opts: &SimOptions) -> u64 {
        let (mut slots, mut offload) = (0, 0);
        match kind {
            PhaseKind::Prefill => {
                let one: u64 =
                    self.prefill_steps(opts, &mut slots, &mut offload).iter().map(|s| s.duration_ns).sum();
                one * self.plan.workload.batch
            }
            PhaseKind::Decode => {
                self.decode_steps(opts, &mut slots, &mut offload).iter().map(|s| s.duration_ns).sum()
            }
        }
    }

    /// Simulates `sampled` steps of `phases` and interpolates the rest (see the module docs); `built` holds the
    /// graphs of the first sampled steps if they were built already (prefill, for a bound).
    #[allow(clippy::too_many_arguments)] // the two accumulators run through both phases' families
    fn family(
        &self,
        kind: PhaseKind,
        phases: &[Phase],
        samples: u32,
        opts: &SimOptions,
        scratch: &mut PhaseScratch,
        built: Vec<StepGraph>,
        max_slots: &mut u32,
        offload_bytes: &mut u64,
    ) -> Vec<StepTime> {
        let mut built = built.into_iter();
        let idx = sample_indices(phases.len(), samples, opts.exact);
        let mut known: Vec<(usize, u64, [u64; 4])> = Vec::with_capacity(idx.len());
        let mut steps: Vec<StepTime> = phases
            .iter()
            .map(|&phase| StepTime {
                phase,
                duration_ns: 0,
                busy_ns: [0; 4],
                outcome: None,
                simulated: false,
            })
            .collect();
        let view = &self.views[phase_index(kind)];
        let ctx = self.build_ctx();
        for &i in &idx {
            // A decode step is measured after a warm-up step of the same shape (see the module docs).
            let pair = [phases[i], phases[i]];
            let (run, measured) = match kind {
                PhaseKind::Prefill => (&pair[..1], 0),
                PhaseKind::Decode => (&pair[..], 1),
            };
            let g = built.next().unwrap_or_else(|| graph::build_with(&ctx, view, run, &mut scratch.graph));
            let summary = engine::run(&g, self.audit, &mut scratch.engine);
            let ws = &scratch.engine;
            let (window_start, duration) = match kind {
                PhaseKind::Prefill => (0, summary.makespan_ns),
                PhaseKind::Decode => {
                    let (a, b) = (ws.step_end_ns(&g, 0), ws.step_end_ns(&g, 1));
                    (a, b - a)
                }
            };
            *max_slots = (*max_slots).max(summary.max_slots_in_use);
            *offload_bytes = (*offload_bytes).max(g.offload_peak_bytes);
            let busy = ws.busy_ns(measured);
            known.push((i, duration, busy));
            let s = &mut steps[i];
            s.duration_ns = duration;
            s.busy_ns = busy;
            s.simulated = true;
            if opts.trace {
                s.outcome = Some((scratch.engine.outcome(g, summary), measured as u32, window_start));
            } else {
                scratch.graph.recycle(g);
            }
        }
        for w in known.windows(2) {
            let ((a, da, ba), (b, db, bb)) = (w[0], w[1]);
            for (j, s) in steps.iter_mut().enumerate().take(b).skip(a + 1) {
                let f = (j - a) as f64 / (b - a) as f64;
                s.duration_ns = lerp(da, db, f);
                for (r, b) in s.busy_ns.iter_mut().enumerate() {
                    *b = lerp(ba[r], bb[r], f);
                }
            }
        }
        steps
    }

    /// A lower bound of [`Simulator::phase_ns`] for the prefill, from the sampled chunks' task graphs without
    /// running them: a chunk lasts at least until its last task could end with no ring slot to wait for and
    /// every compute at the faster of its two rates, interpolated as the simulation interpolates (non-negative
    /// weights, so the bound holds for every step). A planner skips candidates this proves worse than one it
    /// has simulated.
    #[must_use]
    pub fn prefill_lower_bound_ns(&self, opts: &SimOptions) -> u64 {
        let bound_ns = std::cell::Cell::new(0);
        let beaten = |b| {
            bound_ns.set(b);
            true
        };
        let _ = self.prefill_ns_unless(opts, &beaten);
        bound_ns.get()
    }

    /// [`Simulator::phase_ns`] of the prefill, or `None` if `beaten` holds for
    /// [`Simulator::prefill_lower_bound_ns`]: the sampled chunks' graphs serve both.
    #[must_use]
    pub fn prefill_ns_unless(&self, opts: &SimOptions, beaten: &dyn Fn(u64) -> bool) -> Option<u64> {
        let mut scratch = PhaseScratch::take();
        let (bound_ns, built) = self.prefill_bound(opts, &mut scratch);
        let ns = if beaten(bound_ns) {
            for g in built.into_iter().flatten() {
                scratch.graph.recycle(g);
            }
            None
        } else {
            let steps = self.prefill_steps_with(opts, &mut scratch, built, &mut 0, &mut 0);
            Some(steps.iter().map(|s| s.duration_ns).sum::<u64>() * self.plan.workload.batch)
        };
        scratch.give_back();
        ns
    }

    /// The prefill's lower bound (see [`Simulator::prefill_lower_bound_ns`]) and the sampled chunks' graphs of
    /// each family, in sample order.
    fn prefill_bound(&self, opts: &SimOptions, scratch: &mut PhaseScratch) -> (u64, [Vec<StepGraph>; 2]) {
        let (view, ctx) = (&self.views[phase_index(PhaseKind::Prefill)], self.build_ctx());
        let mut one_ns = 0;
        let mut built: [Vec<StepGraph>; 2] = [Vec::new(), Vec::new()];
        for ((phases, samples), graphs) in
            self.one_request_chunks().iter().zip([opts.prefill_samples, 1]).zip(&mut built)
        {
            let mut known: Vec<(usize, u64)> = Vec::new();
            for i in sample_indices(phases.len(), samples, opts.exact) {
                let g = graph::build_with(&ctx, view, &phases[i..=i], &mut scratch.graph);
                known.push((i, earliest_end_ns(&g)));
                graphs.push(g);
            }
            one_ns += known.iter().map(|k| k.1).sum::<u64>();
            for w in known.windows(2) {
                let ((a, da), (b, db)) = (w[0], w[1]);
                one_ns += (a + 1..b).map(|j| lerp(da, db, (j - a) as f64 / (b - a) as f64)).sum::<u64>();
            }
        }
        (one_ns * self.plan.workload.batch, built)
    }

    /// VRAM the run used in one phase.
    fn vram_used(&self, kind: PhaseKind, max_slots: u32, scratch: u64) -> VramBreakdown {
        let pp = match kind {
            PhaseKind::Prefill => &self.plan.prefill,
            PhaseKind::Decode => &self.plan.decode,
        };
        let mut v = VramBreakdown {
            streaming_slots_bytes: u64::from(max_slots) * pp.slot_bytes,
            scratch_bytes: scratch,
            runtime_overhead_bytes: pipeshard_core::cost::workload_overhead_bytes(
                self.cost,
                &self.inv,
                &self.plan.workload,
            ),
            ..VramBreakdown::default()
        };
        for up in pp.placements.iter().filter(|u| u.placement == Placement::Pinned) {
            match up.unit {
                UnitId::Kv { .. } => v.kv_bytes += self.kv_layer_bytes,
                u => v.pinned_weights_bytes += self.inv.unit_bytes(u),
            }
        }
        v
    }

    /// Simulates the whole workload: TTFT, TPS, E2EL, peak VRAM, busy time, and optionally a trace.
    #[must_use]
    pub fn run(&self, opts: &SimOptions) -> Simulation {
        let w = &self.plan.workload;
        let (mut slots, mut offload) = ([0u32; 2], [0u64; 2]);
        let prefill = self.prefill_steps(opts, &mut slots[0], &mut offload[0]);
        let decode = self.decode_steps(opts, &mut slots[1], &mut offload[1]);
        let prefill_phases: Vec<Phase> = prefill.iter().map(|s| s.phase).collect();
        let decode_phases: Vec<Phase> = decode.iter().map(|s| s.phase).collect();

        let prefill_one: u64 = prefill.iter().map(|s| s.duration_ns).sum();
        let prefill_ns = prefill_one * w.batch;
        let switch_ns = self.cost.h2d_ns(self.plan.switch_bytes, true);
        let decode_steps_ns: u64 = decode.iter().map(|s| s.duration_ns).sum();
        let decode_ns = switch_ns + decode_steps_ns;
        let mut busy = [0u64; 4];
        for s in &prefill {
            for (b, x) in busy.iter_mut().zip(s.busy_ns) {
                *b += x * w.batch;
            }
        }
        let mut decode_busy_ns = [0u64; 4];
        for s in &decode {
            for (b, x) in decode_busy_ns.iter_mut().zip(s.busy_ns) {
                *b += x;
            }
        }
        for (b, x) in busy.iter_mut().zip(decode_busy_ns) {
            *b += x;
        }
        busy[1] += switch_ns;

        // GPU scratch: the largest step's activations. Our executor's as it carves them (core's
        // `exec_scratch_bytes`: 46 MiB less than `scratch_parts` for nemo-8b's 1024-token chunk, which had put
        // 15 of validation run32's cells 4-6 % over their measured peak); llama.cpp's from `scratch_parts`,
        // counting only the terms of the work that runs on the GPU: attention temporaries (the score matrix
        // without flash attention) stay on the host when every attention runs on the CPU, as llama.cpp keeps KQ
        // of CPU layers there.
        let scratch = |view: &PhaseView, phases: &[Phase]| {
            phases
                .iter()
                .map(|&p| match self.runtime {
                    Runtime::Ours if view.uses_gpu() => {
                        let rows = if matches!(p, Phase::Prefill { .. }) { 1 } else { p.tokens() };
                        workload::exec_scratch_bytes(self.spec, p.tokens(), rows, w.ctx)
                    }
                    Runtime::Ours => 0,
                    Runtime::Stock | Runtime::Artifact => {
                        view.gpu_scratch_bytes(&workload::scratch_parts(self.spec, w, p))
                    }
                })
                .max()
                .unwrap_or(0)
        };
        let scratch_prefill = scratch(&self.views[0], &prefill_phases);
        let scratch_decode = scratch(&self.views[1], &decode_phases);
        let vram_used = [
            self.vram_used(PhaseKind::Prefill, slots[0], scratch_prefill + offload[0]),
            self.vram_used(PhaseKind::Decode, slots[1], scratch_decode + offload[1]),
        ];
        let generated = w.gen_tokens * w.batch;
        let metrics = Metrics {
            ttft_ns: prefill_ns,
            tps: if decode_ns == 0 { 0.0 } else { generated as f64 / (decode_ns as f64 / 1e9) },
            e2el_ns: prefill_ns + decode_ns,
            gen_tokens: w.gen_tokens,
            decode_step_ns: decode_steps_ns.checked_div(w.gen_tokens).unwrap_or(0),
            vram_peak: vram_used[0].max(&vram_used[1]),
            vram_peak_bytes: vram_used[0].total().max(vram_used[1].total()),
            busy_ns: Resource::ALL.iter().zip(busy).map(|(r, b)| (*r, b)).collect(),
        };
        let steps_simulated = prefill.iter().chain(&decode).filter(|s| s.simulated).count() as u64;
        let steps_total = (prefill.len() as u64) * w.batch + decode.len() as u64;
        let trace = opts.trace.then(|| self.trace(&prefill, switch_ns, &decode));
        Simulation {
            metrics,
            prefill_ns,
            switch_ns,
            decode_ns,
            vram_used,
            decode_busy_ns,
            steps_simulated,
            steps_total,
            trace,
        }
    }

    /// The Chrome trace of a run: every simulated step in full at its place on the timeline, interpolated
    /// stretches as one span on the `steps` track.
    fn trace(&self, prefill: &[StepTime], switch_ns: u64, decode: &[StepTime]) -> Trace {
        const RUN: u32 = 0;
        const GPU: u32 = 1;
        const PCIE: u32 = 2;
        const CPU: u32 = 3;
        let mut tr = Trace::new();
        let threads = self.views[0].cpu_threads.max(self.views[1].cpu_threads);
        tr.name_track(RUN, "run", 1, "steps");
        tr.name_track(GPU, "GPU", 1, "compute stream");
        tr.name_track(PCIE, "PCIe", 1, "H2D copy engine");
        tr.name_track(PCIE, "PCIe", 2, "D2H copy engine");
        tr.name_track(PCIE, "PCIe", 3, "hand-offs (host sync + activations)");
        tr.name_track(CPU, "CPU", 1, &format!("worker pool ({threads} threads)"));
        let enqueues = prefill
            .iter()
            .chain(decode)
            .filter_map(|s| s.outcome.as_ref())
            .any(|(o, ..)| o.graph.tasks.iter().any(|t| t.lane == Lane::Host));
        if enqueues {
            tr.name_track(CPU, "CPU", 2, "host thread (streamed experts' enqueue)");
        }
        let track = |lane: Lane| match lane {
            Lane::Gpu => (GPU, 1),
            Lane::H2d => (PCIE, 1),
            Lane::D2h => (PCIE, 2),
            Lane::Handoff => (PCIE, 3),
            Lane::Cpu => (CPU, 1),
            Lane::Host => (CPU, 2),
        };
        let mut t0 = 0u64;
        let emit = |tr: &mut Trace, steps: &[StepTime], what: &str, t0: &mut u64| {
            let mut i = 0;
            while i < steps.len() {
                let s = &steps[i];
                if let Some((o, measured, window_start)) = &s.outcome {
                    let name = match s.phase {
                        Phase::Prefill { tokens, start_pos, .. } => {
                            format!("{what} {i}: {tokens} tokens at {start_pos}")
                        }
                        Phase::Decode { batch, ctx } => format!("{what} {i}: {batch} × ctx {ctx}"),
                    };
                    tr.span(RUN, 1, &name, "step", *t0, s.duration_ns);
                    for (t, task) in o.graph.tasks.iter().enumerate().filter(|(_, t)| t.step == *measured) {
                        let (pid, tid) = track(task.lane);
                        let cat = match task.kind {
                            TaskKind::Compute { .. } => "compute",
                            TaskKind::Handoff { .. } => "sync",
                            TaskKind::Enqueue { .. } => "host",
                            _ => "copy",
                        };
                        let label = o.graph.label(t as u32);
                        // A copy prefetched during the warm-up step starts before the window.
                        let start = (*t0 + o.start_ns[t]).saturating_sub(*window_start);
                        tr.span(pid, tid, &label, cat, start, o.end_ns[t] - o.start_ns[t]);
                    }
                    *t0 += s.duration_ns;
                    i += 1;
                } else {
                    let j = (i..steps.len()).find(|&j| steps[j].outcome.is_some()).unwrap_or(steps.len());
                    let d: u64 = steps[i..j].iter().map(|s| s.duration_ns).sum();
                    tr.span(RUN, 1, &format!("{what} {i}–{} (interpolated)", j - 1), "step", *t0, d);
                    *t0 += d;
                    i = j;
                }
            }
        };
        emit(&mut tr, prefill, "prefill chunk", &mut t0);
        let batch = self.plan.workload.batch;
        if batch > 1 {
            let d = prefill.iter().map(|s| s.duration_ns).sum::<u64>() * (batch - 1);
            tr.span(RUN, 1, &format!("prefill of requests 2–{batch} (as request 1)"), "step", t0, d);
            t0 += d;
        }
        if switch_ns > 0 {
            tr.span(RUN, 1, "plan switch", "step", t0, switch_ns);
            tr.span(
                PCIE,
                1,
                &format!("plan switch ({} bytes)", self.plan.switch_bytes),
                "copy",
                t0,
                switch_ns,
            );
            t0 += switch_ns;
        }
        emit(&mut tr, decode, "decode step", &mut t0);
        tr
    }
}
