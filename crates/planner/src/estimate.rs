//! The analytic plan estimator: per-unit GPU, CPU and copy times of each phase, and a pipeline estimate of a
//! phase's time (prefill: TTFT over all chunks; decode: one step) for any placement.
//!
//! `greedy`, `ilp` and `exhaustive` optimise exactly this model, `ngl` reports it as its prediction, and the
//! CLI scores any plan with it; `pshard` chooses its strategy with the paper's own predictor instead (see
//! [`crate::pshard`]). The simulator, not this module, is the judge of how good a plan really is.
//!
//! # Costs
//! [`PhaseCosts`] holds, per unit and summed over the steps of a phase (every prefill chunk, or the middle
//! decode step), the time of its ops on the GPU (`op_ns` plus one kernel launch per op) and on the CPU, the
//! time of one H2D copy of its bytes, and the DRAM bytes a CPU execution moves. Ops come from
//! [`pipeshard_core::workload::ops`]; the routed-experts op of a layer is split evenly over the layer's expert
//! units (uniform routing), and attention is charged to the layer's KV unit. Prefill chunks differ only in how
//! many keys attention reads, so the other ops are costed once per chunk shape and attention once per chunk.
//!
//! # Pipeline model
//! A phase takes the largest of four bounds, each a sum over units, so it does not depend on the order of
//! layers (which lets [`crate::ilp`] optimise it exactly over counts of identical layers):
//! - **compute**: the serial GPU and CPU work, plus one hand-off (host sync and hidden-state copy) per
//!   CPU↔GPU transition inside each layer's chain, counted cyclically (a layer whose attention and FFN sit on
//!   different devices costs two, one on a single device none);
//! - **copy**: the H2D copies of streamed units;
//! - **occupancy**: a streamed unit holds its slot from the start of its copy to the end of its compute, and
//!   the ring has `depth` slots, so the phase lasts at least Σ(copy + compute of streamed units) / depth;
//! - **DRAM**: CPU-resident bytes plus streamed bytes over the host DRAM bandwidth.
//!
//! The model assumes streamed units are spread through the layers, as the planners that use it arrange them;
//! it is optimistic for plans that bunch them behind a pinned prefix (pshard), which the simulator judges.
//! Routed experts of a layer are placed by count: pinned and streamed experts run first on the GPU, then the
//! CPU ones. Pinned experts are priced as one group where the cost model groups them
//! ([`OpContext::grouped_experts`]: steps of few tokens, profiles with grouped rows), streamed ones apart.
//!
//! # VRAM
//! [`Estimator::vram`] charges pinned weights, `depth × slot` for the ring (the slot holds the largest
//! streamed unit, a streamed KV unit being the layer's full-context KV, or a streamed attention together with
//! its streamed KV, as [`PhasePlan::stream_groups`] groups them), the full-context KV of every pinned KV unit,
//! the phase's worst-step [`scratch_bytes`] (no margin; none at all when nothing runs on the GPU) and the
//! runtime overhead. `pshard` and `ngl` replace the scratch line with their own models.

use pipeshard_core::fxhash::FxHashMap;

use pipeshard_core::GIB;
use pipeshard_core::cost::{CostModel, OpContext};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, PhasePlan, Placement, Plan, Prediction, UnitPlacement, VramBreakdown};
use pipeshard_core::workload::{
    ACT_BYTES, Op, OpClass, OpKind, Phase, Workload, fuse_one_token_projections, ops, scratch_bytes,
};

/// llama.cpp's CUDA backend offloads a CPU-resident matmul to the GPU only for batches of at least this many
/// tokens (`ggml_backend_cuda_offload_op`).
pub const OP_OFFLOAD_MIN_TOKENS: u64 = 32;

/// Time and traffic of one unit over a whole phase.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct UnitCost {
    /// Its ops on the GPU, kernel launches included, summed over the steps.
    pub gpu_ns: f64,
    /// What of `gpu_ns` a pinned unit saves: a routed expert's share of the layer's pinned experts run as one
    /// group in steps of few tokens (our executor's grouped experts, where the profile has grouped rows).
    pub pinned_saving_ns: f64,
    /// Its ops on the CPU at the machine's thread count, summed over the steps.
    pub cpu_ns: f64,
    /// CPU-resident under llama.cpp's op offload: matmuls run on the GPU after a serial copy of the weights in
    /// every step of at least [`OP_OFFLOAD_MIN_TOKENS`] tokens, other ops on the CPU.
    pub offload_ns: f64,
    /// One H2D copy of the unit (its weights, or for a KV unit the layer's full-context KV).
    pub copy_ns: f64,
    /// DRAM bytes its ops move when they run on the CPU, summed over the steps.
    pub cpu_dram_bytes: f64,
}

impl UnitCost {
    /// Its ops on the GPU when pinned.
    #[must_use]
    pub fn pinned_gpu_ns(&self) -> f64 {
        self.gpu_ns - self.pinned_saving_ns
    }
}

/// Per-unit costs of one phase.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseCosts {
    pub phase: PhaseKind,
    /// Steps the phase runs (prefill chunks; 1 for decode, whose costs are those of the middle step).
    pub steps: u64,
    /// Largest token count of a step.
    pub tier_tokens: u64,
    /// Indexed by inventory position.
    pub units: Vec<UnitCost>,
    /// One CPU↔GPU hand-off in every step (host sync plus the copy of the hidden state), summed over steps.
    pub handoff_ns: f64,
    /// [`scratch_bytes`] of the phase's worst step.
    pub scratch_bytes: u64,
}

/// Inventory positions of one decoder layer's units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerUnits {
    pub attn: usize,
    pub kv: usize,
    pub router: Option<usize>,
    pub ffn: Option<usize>,
    pub shared_experts: Option<usize>,
    /// Positions of the routed experts, in expert order (empty for dense layers).
    pub experts: Vec<usize>,
    /// Bytes of one routed expert (0 for dense layers).
    pub expert_bytes: u64,
}

/// A link of a layer's hand-off chain: one unit, or the routed experts of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item {
    Unit(usize),
    Experts(usize),
}

/// Where each unit sits in the model: layers and their hand-off chains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Structure {
    pub token_embd: usize,
    pub output: usize,
    pub layers: Vec<LayerUnits>,
    /// Vision units (the text phases run none of their ops; planners keep them on the CPU).
    pub vision: Vec<usize>,
    /// Per decoder layer, the chain of items whose devices decide its hand-offs (KV units follow their
    /// attention).
    pub chains: Vec<Vec<Item>>,
    /// The output head reads the token embedding (tied embeddings).
    pub tied_embeddings: bool,
    /// Kind of every unit.
    pub kind: Vec<UnitKind>,
    /// Positions of every unit that is not a routed expert.
    pub plain: Vec<usize>,
}

/// What a unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnitKind {
    TokenEmbd,
    Attn,
    Router,
    Kv,
    Ffn,
    Expert,
    SharedExperts,
    Output,
    Vision,
}

impl UnitKind {
    /// The kind of a unit id.
    #[must_use]
    pub fn of(id: UnitId) -> UnitKind {
        match id {
            UnitId::TokenEmbd => UnitKind::TokenEmbd,
            UnitId::Attn { .. } => UnitKind::Attn,
            UnitId::Ffn { .. } => UnitKind::Ffn,
            UnitId::Router { .. } => UnitKind::Router,
            UnitId::Expert { .. } => UnitKind::Expert,
            UnitId::SharedExperts { .. } => UnitKind::SharedExperts,
            UnitId::Kv { .. } => UnitKind::Kv,
            UnitId::Output => UnitKind::Output,
            UnitId::VisionPatchEmbd | UnitId::VisionBlock { .. } | UnitId::VisionMerger => UnitKind::Vision,
        }
    }
}

impl Structure {
    /// Reads the layer structure of an inventory.
    #[must_use]
    pub fn new(spec: &ModelSpec, inv: &Inventory) -> Structure {
        let n_layers = spec.text.n_layers as usize;
        let mut layers: Vec<LayerUnits> = (0..n_layers)
            .map(|_| LayerUnits {
                attn: usize::MAX,
                kv: usize::MAX,
                router: None,
                ffn: None,
                shared_experts: None,
                experts: Vec::new(),
                expert_bytes: 0,
            })
            .collect();
        let mut token_embd = usize::MAX;
        let mut output = usize::MAX;
        let mut vision = Vec::new();
        for (pos, u) in inv.units.iter().enumerate() {
            match u.id {
                UnitId::TokenEmbd => token_embd = pos,
                UnitId::Output => output = pos,
                UnitId::Attn { layer } => layers[layer as usize].attn = pos,
                UnitId::Kv { layer } => layers[layer as usize].kv = pos,
                UnitId::Router { layer } => layers[layer as usize].router = Some(pos),
                UnitId::Ffn { layer } => layers[layer as usize].ffn = Some(pos),
                UnitId::SharedExperts { layer } => layers[layer as usize].shared_experts = Some(pos),
                UnitId::Expert { layer, .. } => {
                    let l = &mut layers[layer as usize];
                    l.expert_bytes = u.weight_bytes;
                    l.experts.push(pos);
                }
                UnitId::VisionPatchEmbd | UnitId::VisionBlock { .. } | UnitId::VisionMerger => {
                    vision.push(pos);
                }
            }
        }
        let chains = layers
            .iter()
            .enumerate()
            .map(|(l, lu)| {
                let mut chain = vec![Item::Unit(lu.attn)];
                chain.extend(lu.router.map(Item::Unit));
                if !lu.experts.is_empty() {
                    chain.push(Item::Experts(l));
                }
                chain.extend(lu.shared_experts.map(Item::Unit));
                chain.extend(lu.ffn.map(Item::Unit));
                chain
            })
            .collect();
        let kind: Vec<UnitKind> = inv.units.iter().map(|u| UnitKind::of(u.id)).collect();
        let plain = (0..inv.units.len()).filter(|&p| kind[p] != UnitKind::Expert).collect();
        Structure {
            token_embd,
            output,
            layers,
            vision,
            chains,
            tied_embeddings: spec.text.tied_embeddings,
            kind,
            plain,
        }
    }

    /// Routed experts per MoE layer (0 for dense models).
    #[must_use]
    pub fn n_experts(&self) -> u32 {
        self.layers.iter().map(|l| l.experts.len() as u32).max().unwrap_or(0)
    }
}

/// A phase's placement in the form the estimator reads: every unit by inventory position, except routed
/// experts, which are counted per layer (the first `pinned` experts of a layer are pinned, the next `streamed`
/// streamed, the rest on the CPU; under uniform routing experts are interchangeable).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    /// By inventory position; entries of routed-expert units are ignored (see `experts`).
    pub placements: Vec<Placement>,
    /// Per decoder layer: routed experts `[pinned, streamed, cpu]` (all zero for dense layers).
    pub experts: Vec<[u32; 3]>,
    /// Streaming ring slots.
    pub depth: u32,
}

impl Layout {
    /// Everything on the CPU.
    #[must_use]
    pub fn all_cpu(st: &Structure, n_units: usize) -> Layout {
        Layout {
            placements: vec![Placement::Cpu; n_units],
            experts: st.layers.iter().map(|l| [0, 0, l.experts.len() as u32]).collect(),
            depth: 0,
        }
    }

    /// The layout of a phase plan (expert counts read from its expert units).
    #[must_use]
    pub fn of_phase(st: &Structure, inv: &Inventory, p: &PhasePlan) -> Layout {
        let mut placements = vec![Placement::Cpu; inv.units.len()];
        for up in &p.placements {
            if let Some(pos) = inv.position(up.unit) {
                placements[pos] = up.placement;
            }
        }
        let experts = st
            .layers
            .iter()
            .map(|l| {
                let mut c = [0u32; 3];
                for &pos in &l.experts {
                    c[placement_index(placements[pos])] += 1;
                }
                c
            })
            .collect();
        Layout { placements, experts, depth: p.pipeline_depth }
    }

    /// Placement of every unit, in inventory order (routed experts expanded from their counts).
    #[must_use]
    pub fn unit_placements(&self, st: &Structure, inv: &Inventory) -> Vec<UnitPlacement> {
        let mut placements = self.placements.clone();
        for (l, lu) in st.layers.iter().enumerate() {
            let [p, s, _] = self.experts[l];
            for (e, &pos) in lu.experts.iter().enumerate() {
                let e = e as u32;
                placements[pos] = if e < p {
                    Placement::Pinned
                } else if e < p + s {
                    Placement::Streamed
                } else {
                    Placement::Cpu
                };
            }
        }
        inv.units
            .iter()
            .zip(placements)
            .map(|(u, placement)| UnitPlacement { unit: u.id, placement })
            .collect()
    }

    /// Whether any unit (or expert) streams.
    #[must_use]
    pub fn streams(&self, st: &Structure) -> bool {
        self.experts.iter().any(|c| c[1] > 0)
            || st.plain.iter().any(|&p| self.placements[p] == Placement::Streamed)
    }
}

/// 0 pinned, 1 streamed, 2 CPU.
#[must_use]
pub fn placement_index(p: Placement) -> usize {
    match p {
        Placement::Pinned => 0,
        Placement::Streamed => 1,
        Placement::Cpu => 2,
    }
}

/// What the estimator predicts for one phase.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PhaseEstimate {
    /// The phase's time: the largest of the three bounds.
    pub time_ns: f64,
    /// Serial compute, hand-offs included.
    pub compute_ns: f64,
    /// H2D copies of streamed units.
    pub copy_ns: f64,
    /// Slot occupancy of streamed units over the ring's depth.
    pub occupancy_ns: f64,
    /// Host DRAM traffic over its bandwidth.
    pub dram_ns: f64,
    /// CPU↔GPU transitions per step.
    pub handoffs: u32,
    /// The largest streamed unit (0 when nothing streams).
    pub slot_bytes: u64,
}

/// The estimator for one model, workload and machine.
#[derive(Debug, Clone)]
pub struct Estimator {
    pub structure: Structure,
    pub prefill: PhaseCosts,
    pub decode: PhaseCosts,
    /// Full-context KV bytes of one layer (all sequences).
    pub kv_layer_bytes: u64,
    /// KV bytes the prompt leaves in one layer (what a switch uploads for a layer whose KV becomes pinned).
    pub kv_prompt_bytes: u64,
    /// Nanoseconds per byte of a large pinned H2D copy (the switch between phases).
    pub h2d_ns_per_byte: f64,
    /// Host DRAM bandwidth at the machine's threads, bytes per nanosecond.
    pub dram_bytes_per_ns: f64,
    pub runtime_overhead_bytes: u64,
    pub cpu_threads: u32,
    pub gen_tokens: u64,
    /// Weight bytes by inventory position.
    pub unit_bytes: Vec<u64>,
    /// Per unit, the bytes op offload stages in VRAM at once when the unit is CPU-resident: the weights of all
    /// its offloaded prefill ops (a layer's CPU routed experts are staged together: their count × one expert),
    /// for a KV unit the cache view its attention reads in the last chunk.
    pub offload_stage_bytes: Vec<u64>,
}

/// What identifies an op's cost: class, tokens, format, FLOPs and bytes, and its shape.
pub(crate) type OpKey = (OpClass, u64, u8, [u64; 6]);

pub(crate) fn op_key(op: &Op) -> OpKey {
    let shape = match op.kind {
        OpKind::MatMul { n, k } => [n, k, 0],
        OpKind::Attention { keys, head_dim, q_heads, .. } => [keys, head_dim, u64::from(q_heads)],
        OpKind::Experts { touched, ffn, hidden, .. } => [touched.to_bits(), ffn, hidden],
        OpKind::Router { n_experts, top_k } => [u64::from(n_experts), u64::from(top_k), 0],
        OpKind::Sample { vocab } => [vocab, 0, 0],
        _ => [0, 0, 0],
    };
    (
        op.kind.class(),
        op.tokens,
        op.dtype as u8,
        [op.flops.to_bits(), op.weight_bytes.to_bits(), op.act_bytes.to_bits(), shape[0], shape[1], shape[2]],
    )
}

/// Op times on both devices, memoised: most ops repeat in every layer.
struct OpTimes<'a> {
    cost: &'a dyn CostModel,
    threads: u32,
    launch_ns: f64,
    memo: FxHashMap<OpKey, OpTime>,
}

/// An op's GPU time with its launch, and as one group of experts (the same for other ops), and its CPU time.
#[derive(Debug, Clone, Copy)]
struct OpTime {
    gpu: f64,
    grouped_gpu: f64,
    cpu: f64,
}

impl OpTimes<'_> {
    fn of(&mut self, op: &Op) -> OpTime {
        let key = op_key(op);
        if let Some(&t) = self.memo.get(&key) {
            return t;
        }
        let gpu = self.cost.op_ns(op, OpContext::gpu()) as f64 + self.launch_ns;
        let grouped_gpu = match op.kind {
            OpKind::Experts { .. } => {
                self.cost.op_ns(op, OpContext::gpu().with_grouped_experts(true)) as f64 + self.launch_ns
            }
            _ => gpu,
        };
        let t = OpTime { gpu, grouped_gpu, cpu: self.cost.op_ns(op, OpContext::cpu(self.threads)) as f64 };
        self.memo.insert(key, t);
        t
    }
}

/// Which side's time an op is charged to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Both,
    Gpu,
    Cpu,
}

fn is_matmul(op: &Op) -> bool {
    matches!(op.kind.class(), OpClass::MatMul | OpClass::Router | OpClass::Experts)
}

impl Estimator {
    /// Costs every unit of both phases of `w` on the machine `cost` describes.
    #[must_use]
    pub fn new(spec: &ModelSpec, inv: &Inventory, w: &Workload, cost: &dyn CostModel) -> Estimator {
        let structure = Structure::new(spec, inv);
        let threads = cost.cpu_threads();
        let mut times =
            OpTimes { cost, threads, launch_ns: cost.launch_ns() as f64, memo: FxHashMap::default() };
        let unit_bytes: Vec<u64> = inv.units.iter().map(|u| u.weight_bytes).collect();
        let kv_layer_bytes = w.kv_bytes_per_layer_of(inv);
        let kv_tok = spec.kv_bytes_per_token_layer(w.kv_dtype);
        // Thousands of experts in a row share one size: remember the last size's copy time.
        let mut last: Option<(u64, f64)> = None;
        let copy_ns = (0..inv.units.len())
            .map(|pos| {
                let bytes =
                    if structure.kind[pos] == UnitKind::Kv { kv_layer_bytes } else { unit_bytes[pos] };
                match last {
                    Some((b, ns)) if b == bytes => ns,
                    _ => {
                        let ns = cost.h2d_ns(bytes, true) as f64;
                        last = Some((bytes, ns));
                        ns
                    }
                }
            })
            .collect();
        let ctx = Ctx { spec, inv, w, cost, st: &structure, copy_ns };
        let (prefill, offload_stage_bytes) = ctx.prefill_costs(&mut times);
        let decode = ctx.decode_costs(&mut times);
        Estimator {
            prefill,
            decode,
            kv_layer_bytes,
            kv_prompt_bytes: kv_tok * w.prompt_tokens * w.batch,
            h2d_ns_per_byte: cost.h2d_ns(GIB, true) as f64 / GIB as f64,
            dram_bytes_per_ns: cost.dram_gbps(threads, false),
            runtime_overhead_bytes: pipeshard_core::cost::workload_overhead_bytes(cost, inv, w),
            cpu_threads: threads,
            gen_tokens: w.gen_tokens,
            unit_bytes,
            offload_stage_bytes,
            structure,
        }
    }

    /// Costs of one phase.
    #[must_use]
    pub fn costs(&self, phase: PhaseKind) -> &PhaseCosts {
        match phase {
            PhaseKind::Prefill => &self.prefill,
            PhaseKind::Decode => &self.decode,
        }
    }

    /// Bytes a streamed or pinned unit occupies (a KV unit: the layer's full-context KV).
    #[must_use]
    pub fn resident_bytes(&self, pos: usize) -> u64 {
        if self.is_kv(pos) { self.kv_layer_bytes } else { self.unit_bytes[pos] }
    }

    fn is_kv(&self, pos: usize) -> bool {
        self.structure.kind[pos] == UnitKind::Kv
    }

    /// The slot a layout needs: the largest streamed unit, or streamed attention with its streamed KV, which
    /// share a slot ([`PhasePlan::stream_groups`]); 0 when nothing streams.
    #[must_use]
    pub fn slot_bytes(&self, layout: &Layout) -> u64 {
        let st = &self.structure;
        let streamed = |pos: usize| layout.placements[pos] == Placement::Streamed;
        let mut slot = 0;
        for &pos in &st.plain {
            if streamed(pos) {
                slot = slot.max(self.resident_bytes(pos));
            }
        }
        for (l, lu) in st.layers.iter().enumerate() {
            // A streamed attention carries its streamed KV in one slot (`PhasePlan::stream_groups`).
            if streamed(lu.attn) && streamed(lu.kv) {
                slot = slot.max(self.unit_bytes[lu.attn] + self.kv_layer_bytes);
            }
            if layout.experts[l][1] > 0 {
                slot = slot.max(lu.expert_bytes);
            }
        }
        slot
    }

    /// Whether any unit of the layout computes on the GPU.
    #[must_use]
    pub fn uses_gpu(&self, layout: &Layout) -> bool {
        let st = &self.structure;
        layout.experts.iter().any(|c| c[0] + c[1] > 0)
            || st.plain.iter().any(|&p| layout.placements[p].on_gpu())
    }

    /// The VRAM breakdown of a layout with the estimator's scratch policy (the phase's worst-step scratch, none
    /// when nothing runs on the GPU). The ring is `depth × slot` (nothing when nothing streams).
    #[must_use]
    pub fn vram(&self, phase: PhaseKind, layout: &Layout) -> VramBreakdown {
        let scratch = if self.uses_gpu(layout) { self.costs(phase).scratch_bytes } else { 0 };
        self.vram_with_scratch(layout, scratch)
    }

    /// The VRAM breakdown of a layout run with llama.cpp's op offload in prefill (if `op_offload`): the scratch
    /// also holds the largest batch of weights staged at once, as the simulator and the executor stage them.
    #[must_use]
    pub fn vram_offload(&self, phase: PhaseKind, layout: &Layout, op_offload: bool) -> VramBreakdown {
        if !op_offload || phase != PhaseKind::Prefill {
            return self.vram(phase, layout);
        }
        self.vram_with_scratch(layout, self.prefill.scratch_bytes + self.offload_staged_bytes(layout))
    }

    /// The most weight bytes op offload stages in VRAM at once for `layout`: the offloaded ops of one
    /// CPU-resident unit, or all of a layer's CPU routed experts (one op), as the simulator and executor copy
    /// them.
    #[must_use]
    pub fn offload_staged_bytes(&self, layout: &Layout) -> u64 {
        let st = &self.structure;
        let plain = st.plain.iter().filter(|&&p| layout.placements[p] == Placement::Cpu);
        let experts = st.layers.iter().zip(&layout.experts).map(|(lu, c)| u64::from(c[2]) * lu.expert_bytes);
        plain.map(|&p| self.offload_stage_bytes[p]).chain(experts).max().unwrap_or(0)
    }

    /// The VRAM breakdown of a layout with a given scratch line.
    #[must_use]
    pub fn vram_with_scratch(&self, layout: &Layout, scratch_bytes: u64) -> VramBreakdown {
        let st = &self.structure;
        let mut pinned = 0;
        let mut kv = 0;
        for &pos in &st.plain {
            if layout.placements[pos] == Placement::Pinned {
                if self.is_kv(pos) {
                    kv += self.kv_layer_bytes;
                } else {
                    pinned += self.unit_bytes[pos];
                }
            }
        }
        for (l, lu) in st.layers.iter().enumerate() {
            pinned += u64::from(layout.experts[l][0]) * lu.expert_bytes;
        }
        let slot = self.slot_bytes(layout);
        let depth = if slot > 0 { u64::from(layout.depth) } else { 0 };
        VramBreakdown {
            pinned_weights_bytes: pinned,
            streaming_slots_bytes: depth * slot,
            kv_bytes: kv,
            scratch_bytes,
            runtime_overhead_bytes: self.runtime_overhead_bytes,
        }
    }

    /// CPU↔GPU transitions of one layer's chain, counted cyclically (see the module docs).
    #[must_use]
    pub fn layer_handoffs(&self, layout: &Layout, layer: usize) -> u32 {
        // (entry on CPU, exit on CPU, transitions inside the item)
        let ends = |item: Item| -> (bool, bool, u32) {
            match item {
                Item::Unit(pos) => {
                    let cpu = !layout.placements[pos].on_gpu();
                    (cpu, cpu, 0)
                }
                Item::Experts(l) => {
                    let [p, s, c] = layout.experts[l];
                    let gpu = p + s > 0;
                    (!gpu, c > 0, u32::from(gpu && c > 0))
                }
            }
        };
        let chain = &self.structure.chains[layer];
        let mut n = 0;
        let mut prev_exit = ends(chain[chain.len() - 1]).1;
        for &item in chain {
            let (entry, exit, inner) = ends(item);
            n += u32::from(prev_exit != entry) + inner;
            prev_exit = exit;
        }
        n
    }

    /// The estimate of one phase of a layout (see the module docs). `op_offload` costs CPU-resident units as
    /// llama.cpp's op offload runs them.
    #[must_use]
    pub fn phase(&self, phase: PhaseKind, layout: &Layout, op_offload: bool) -> PhaseEstimate {
        let st = &self.structure;
        let costs = self.costs(phase);
        let steps = costs.steps as f64;
        let mut acc = Accumulator::default();
        let mut run = |c: &UnitCost, p: Placement, count: f64, bytes: f64| match p {
            Placement::Pinned => acc.compute += count * c.pinned_gpu_ns(),
            Placement::Streamed => {
                acc.compute += count * c.gpu_ns;
                acc.copy += count * steps * c.copy_ns;
                acc.streamed_gpu += count * c.gpu_ns;
                acc.streamed_bytes += count * bytes;
            }
            Placement::Cpu if op_offload => acc.compute += count * c.offload_ns,
            Placement::Cpu => {
                acc.compute += count * c.cpu_ns;
                acc.dram_bytes += count * c.cpu_dram_bytes;
            }
        };
        for &pos in &st.plain {
            run(&costs.units[pos], layout.placements[pos], 1.0, self.resident_bytes(pos) as f64);
        }
        for (l, lu) in st.layers.iter().enumerate() {
            if let Some(&first) = lu.experts.first() {
                let c = &costs.units[first];
                let [p, s, cpu] = layout.experts[l].map(f64::from);
                let bytes = lu.expert_bytes as f64;
                run(c, Placement::Pinned, p, bytes);
                run(c, Placement::Streamed, s, bytes);
                run(c, Placement::Cpu, cpu, bytes);
            }
        }
        let handoffs: u32 = (0..st.layers.len()).map(|l| self.layer_handoffs(layout, l)).sum();
        let compute = acc.compute + f64::from(handoffs) * costs.handoff_ns;
        let occupancy =
            if acc.copy > 0.0 { (acc.copy + acc.streamed_gpu) / f64::from(layout.depth.max(1)) } else { 0.0 };
        let dram = (acc.dram_bytes + steps * acc.streamed_bytes) / self.dram_bytes_per_ns;
        PhaseEstimate {
            time_ns: compute.max(acc.copy).max(occupancy).max(dram),
            compute_ns: compute,
            copy_ns: acc.copy,
            occupancy_ns: occupancy,
            dram_ns: dram,
            handoffs,
            slot_bytes: self.slot_bytes(layout),
        }
    }

    /// Bytes re-uploaded when switching from the prefill layout to the decode layout: weights pinned in decode
    /// but not in prefill, and the prompt's KV of layers whose KV becomes pinned.
    #[must_use]
    pub fn switch_bytes(&self, prefill: &Layout, decode: &Layout) -> u64 {
        let st = &self.structure;
        let mut bytes = 0;
        for &pos in &st.plain {
            let (a, b) = (prefill.placements[pos], decode.placements[pos]);
            if b == Placement::Pinned && a != Placement::Pinned {
                bytes += if self.is_kv(pos) { self.kv_prompt_bytes } else { self.unit_bytes[pos] };
            }
        }
        for (l, lu) in st.layers.iter().enumerate() {
            bytes += u64::from(decode.experts[l][0].saturating_sub(prefill.experts[l][0])) * lu.expert_bytes;
        }
        bytes
    }

    /// Time of a switch of `bytes` (one large pinned copy, the model the ILP uses).
    #[must_use]
    pub fn switch_ns(&self, bytes: u64) -> f64 {
        bytes as f64 * self.h2d_ns_per_byte
    }

    /// TTFT, decode step and end-to-end latency of a pair of layouts.
    #[must_use]
    pub fn predict(&self, prefill: &Layout, decode: &Layout, prefill_offload: bool) -> Prediction {
        let ttft = self.phase(PhaseKind::Prefill, prefill, prefill_offload).time_ns;
        let step = self.phase(PhaseKind::Decode, decode, false).time_ns;
        let switch = self.switch_ns(self.switch_bytes(prefill, decode));
        Prediction {
            ttft_ns: ttft.round() as u64,
            decode_step_ns: step.round() as u64,
            e2el_ns: (ttft + switch + self.gen_tokens as f64 * step).round() as u64,
        }
    }

    /// The estimator's prediction for any plan of this model (its workload must be the one the estimator was
    /// built for).
    #[must_use]
    pub fn predict_plan(&self, inv: &Inventory, plan: &Plan) -> Prediction {
        let pre = Layout::of_phase(&self.structure, inv, &plan.prefill);
        let dec = Layout::of_phase(&self.structure, inv, &plan.decode);
        self.predict(&pre, &dec, plan.prefill.op_offload)
    }

    /// A phase plan of a layout with the given VRAM breakdown.
    #[must_use]
    pub fn phase_plan(
        &self,
        inv: &Inventory,
        phase: PhaseKind,
        layout: &Layout,
        vram: VramBreakdown,
        op_offload: bool,
    ) -> PhasePlan {
        let slot = self.slot_bytes(layout);
        let depth = if slot > 0 { layout.depth } else { 0 };
        PhasePlan {
            phase,
            tier_tokens: self.costs(phase).tier_tokens,
            pipeline_depth: depth,
            slot_bytes: if depth > 0 { slot } else { 0 },
            placements: layout.unit_placements(&self.structure, inv),
            op_offload,
            cpu_threads: self.cpu_threads,
            vram,
        }
    }
}

/// An objective value of a prediction.
#[must_use]
pub fn objective_ns(objective: crate::Objective, p: &Prediction) -> f64 {
    // The secondary term only breaks ties between plans equal on the primary one.
    let tie = 1e-6 * p.e2el_ns as f64;
    match objective {
        crate::Objective::Ttft => p.ttft_ns as f64 + tie,
        crate::Objective::Tps => p.decode_step_ns as f64 + tie,
        crate::Objective::E2el => p.e2el_ns as f64,
    }
}

/// Sums over the units of a layout.
#[derive(Default)]
struct Accumulator {
    compute: f64,
    copy: f64,
    streamed_gpu: f64,
    streamed_bytes: f64,
    dram_bytes: f64,
}

/// What the cost builders share.
struct Ctx<'a> {
    spec: &'a ModelSpec,
    inv: &'a Inventory,
    w: &'a Workload,
    cost: &'a dyn CostModel,
    st: &'a Structure,
    /// One H2D copy of each unit (a KV unit: the layer's full-context KV), shared by both phases.
    copy_ns: Vec<f64>,
}

impl Ctx<'_> {
    fn empty(&self) -> Vec<UnitCost> {
        self.copy_ns.iter().map(|&copy_ns| UnitCost { copy_ns, ..UnitCost::default() }).collect()
    }

    /// Adds `count` runs of `op` to the units it belongs to (an experts op is shared by the layer's experts).
    fn charge(
        &self,
        units: &mut [UnitCost],
        times: &mut OpTimes<'_>,
        op: &Op,
        count: f64,
        offload: bool,
        side: Side,
    ) {
        let OpTime { gpu, grouped_gpu, cpu } = times.of(op);
        let offloaded = if offload && is_matmul(op) { gpu } else { cpu };
        let (on_gpu, on_cpu) = (side != Side::Cpu, side != Side::Gpu);
        let add = |u: &mut UnitCost, share: f64| {
            if on_gpu {
                u.gpu_ns += count * gpu * share;
                u.pinned_saving_ns += count * (gpu - grouped_gpu) * share;
            }
            if on_cpu {
                u.cpu_ns += count * cpu * share;
                u.offload_ns += count * offloaded * share;
                u.cpu_dram_bytes += count * op.bytes() * share;
            }
        };
        if let OpKind::Experts { .. } = op.kind {
            let layer = op.unit.layer().expect("experts ops belong to a layer") as usize;
            let experts = &self.st.layers[layer].experts;
            let share = 1.0 / experts.len() as f64;
            for &pos in experts {
                add(&mut units[pos], share);
            }
        } else if let Some(pos) = self.inv.position(op.unit) {
            add(&mut units[pos], 1.0);
        }
    }

    /// Adds the serial weight copies of op offload: every unit with a matmul, once per step of `count` steps.
    fn charge_offload_copies(&self, units: &mut [UnitCost], step_ops: &[Op], count: f64) {
        let mut seen = vec![false; units.len()];
        let mut charge = |pos: usize, units: &mut [UnitCost]| {
            if !seen[pos] {
                seen[pos] = true;
                // One copy of the unit's weights (`copy_ns` is its pinned H2D copy).
                let copy = if self.w.host_pageable {
                    self.cost.h2d_ns(self.inv.units[pos].weight_bytes, false) as f64
                } else {
                    units[pos].copy_ns
                };
                units[pos].offload_ns += count * copy;
            }
        };
        for op in step_ops.iter().filter(|o| is_matmul(o)) {
            if let OpKind::Experts { .. } = op.kind {
                let layer = op.unit.layer().expect("experts ops belong to a layer") as usize;
                for &pos in &self.st.layers[layer].experts {
                    charge(pos, units);
                }
            } else if let Some(pos) = self.inv.position(op.unit) {
                charge(pos, units);
            }
        }
    }

    fn handoff_ns(&self, tokens: u64) -> f64 {
        let hidden_bytes = (tokens as f64 * self.spec.text.hidden as f64 * ACT_BYTES) as u64;
        (self.cost.host_sync_ns() + self.cost.h2d_ns(hidden_bytes, true)) as f64
    }

    fn prefill_costs(&self, times: &mut OpTimes<'_>) -> (PhaseCosts, Vec<u64>) {
        let chunks = self.w.prefill_chunks();
        let mut units = self.empty();
        let mut stage = vec![0u64; units.len()];
        let mut handoff_ns = 0.0;
        let mut scratch: u64 = 0;
        // Chunks of one shape run the same ops but attention; count them per (tokens, last).
        let mut shapes: Vec<(u64, bool, Phase, u64)> = Vec::new();
        for &c in &chunks {
            let Phase::Prefill { tokens, last, .. } = c else { unreachable!("prefill chunks") };
            handoff_ns += self.handoff_ns(tokens);
            scratch = scratch.max(scratch_bytes(self.spec, self.w, c));
            match shapes.iter_mut().find(|s| s.0 == tokens && s.1 == last) {
                Some(s) => s.3 += 1,
                None => shapes.push((tokens, last, c, 1)),
            }
        }
        for &(tokens, _, phase, count) in &shapes {
            let step_ops = ops(self.spec, self.inv, self.w, phase);
            let offload = tokens >= OP_OFFLOAD_MIN_TOKENS;
            // What op offload would stage: ops of enough tokens with weights (not row gathers); experts below.
            let staged = |o: &&Op| {
                o.tokens >= OP_OFFLOAD_MIN_TOKENS && !matches!(o.kind, OpKind::Experts { .. } | OpKind::Embed)
            };
            // A unit's staged weights stay together until its last op has run (as the simulator stages them).
            let mut shape_stage = vec![0u64; units.len()];
            for op in step_ops.iter().filter(staged) {
                if let Some(pos) = self.inv.position(op.unit) {
                    shape_stage[pos] += op.weight_bytes as u64;
                }
            }
            stage.iter_mut().zip(shape_stage).for_each(|(s, b)| *s = (*s).max(b));
            for op in step_ops.iter().filter(|o| o.kind.class() != OpClass::Attention) {
                self.charge(&mut units, times, op, count as f64, offload, Side::Both);
            }
            if offload {
                self.charge_offload_copies(&mut units, &step_ops, count as f64);
            }
        }
        // Attention per chunk, from a one-layer model (every layer's attention has the same shape).
        let one_layer = self.spec.truncated(1).expect("models have at least one layer");
        let mut attn_memo: FxHashMap<(u64, u64), Op> = FxHashMap::default();
        for &c in &chunks {
            let Phase::Prefill { tokens, start_pos, .. } = c else { unreachable!("prefill chunks") };
            let op = *attn_memo.entry((tokens, start_pos)).or_insert_with(|| {
                ops(&one_layer, self.inv, self.w, c)
                    .into_iter()
                    .find(|o| o.kind.class() == OpClass::Attention)
                    .expect("every layer has attention")
            });
            let OpTime { gpu, cpu, .. } = times.of(&op);
            // Under op offload a CPU layer's attention runs on the GPU after a copy of the cache view it reads
            // (as the simulator models ggml's scheduler).
            let offloaded = (tokens >= OP_OFFLOAD_MIN_TOKENS).then(|| {
                let bytes = op.kv_bytes as u64;
                (gpu + self.cost.h2d_ns(bytes, !self.w.host_pageable) as f64, bytes)
            });
            for l in &self.st.layers {
                let u = &mut units[l.kv];
                u.gpu_ns += gpu;
                u.cpu_ns += cpu;
                u.offload_ns += offloaded.map_or(cpu, |o| o.0);
                u.cpu_dram_bytes += op.bytes();
                stage[l.kv] = stage[l.kv].max(offloaded.map_or(0, |o| o.1));
            }
        }
        let costs = PhaseCosts {
            phase: PhaseKind::Prefill,
            steps: chunks.len() as u64,
            tier_tokens: chunks.iter().map(|c| c.tokens()).max().unwrap_or(0),
            units,
            handoff_ns,
            scratch_bytes: scratch,
        };
        (costs, stage)
    }

    fn decode_costs(&self, times: &mut OpTimes<'_>) -> PhaseCosts {
        let mut units = self.empty();
        let step = self.w.decode_step(self.w.gen_tokens / 2);
        let plain = ops(self.spec, self.inv, self.w, step);
        if self.cost.one_token_projections_fused() {
            // The runtime fuses one-token q|k|v and gate|up on the GPU only, as the simulator prices it: a
            // unit's GPU time comes from the fused ops, its CPU time from the plain ones.
            let mut fused = plain.clone();
            fuse_one_token_projections(&mut fused, |_| true, self.cost.one_token_norm_act_fused());
            for op in &plain {
                self.charge(&mut units, times, op, 1.0, false, Side::Cpu);
            }
            for op in &fused {
                self.charge(&mut units, times, op, 1.0, false, Side::Gpu);
            }
        } else {
            for op in &plain {
                self.charge(&mut units, times, op, 1.0, false, Side::Both);
            }
        }
        let last = self.w.decode_step(self.w.gen_tokens.saturating_sub(1));
        PhaseCosts {
            phase: PhaseKind::Decode,
            steps: 1,
            tier_tokens: self.w.batch,
            units,
            handoff_ns: self.handoff_ns(self.w.batch),
            scratch_bytes: scratch_bytes(self.spec, self.w, last),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::catalog;
    use pipeshard_core::cost::TableCostModel;
    use pipeshard_core::dtype::DType;
    use pipeshard_core::reference;

    fn setup(name: &str, layers: u32) -> (ModelSpec, Inventory, Workload, Estimator) {
        let spec = catalog::get(name).unwrap().truncated(layers).unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(3000, 4096, 96, 1024);
        let cost = TableCostModel::new(&reference::derived("cli3").unwrap());
        let est = Estimator::new(&spec, &inv, &w, &cost);
        (spec, inv, w, est)
    }

    #[test]
    fn fused_one_token_projections_cut_gpu_time_only() {
        let spec = catalog::get("nemo-8b").unwrap().truncated(2).unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(128, 1024, 16, 128);
        let mut profile = reference::derived("cli3").unwrap();
        let plain = Estimator::new(&spec, &inv, &w, &TableCostModel::new(&profile));
        profile.one_token_projections_fused = true;
        let fused = Estimator::new(&spec, &inv, &w, &TableCostModel::new(&profile));
        for unit in [UnitId::Attn { layer: 0 }, UnitId::Ffn { layer: 1 }] {
            let pos = inv.position(unit).unwrap();
            let (p, f) =
                (&plain.costs(PhaseKind::Decode).units[pos], &fused.costs(PhaseKind::Decode).units[pos]);
            // One launch and one read of the input fewer per merged GEMM; the CPU keeps one GEMM a matrix.
            assert!(f.gpu_ns < p.gpu_ns, "{unit}: {} vs {}", f.gpu_ns, p.gpu_ns);
            assert_eq!(
                [f.cpu_ns.to_bits(), f.cpu_dram_bytes.to_bits()],
                [p.cpu_ns.to_bits(), p.cpu_dram_bytes.to_bits()],
                "{unit}"
            );
            // Prefill chunks are never fused.
            let (pp, fp) =
                (&plain.costs(PhaseKind::Prefill).units[pos], &fused.costs(PhaseKind::Prefill).units[pos]);
            assert_eq!(pp.gpu_ns.to_bits(), fp.gpu_ns.to_bits(), "{unit}");
        }
    }

    #[test]
    fn slot_is_the_largest_stream_group_of_core() {
        let (_, inv, w, est) = setup("qwen3-30b-a3b", 3);
        let st = &est.structure;
        let mut layout = Layout::all_cpu(st, inv.units.len());
        let cases: [(&[usize], Placement, Placement, [u32; 3]); 4] = [
            (&[0], Placement::Streamed, Placement::Streamed, [0, 5, 123]),
            (&[1], Placement::Streamed, Placement::Pinned, [10, 0, 118]),
            (&[0, 2], Placement::Pinned, Placement::Streamed, [0, 0, 128]),
            (&[2], Placement::Cpu, Placement::Cpu, [0, 1, 127]),
        ];
        for (layers, attn, kv, experts) in cases {
            for &l in layers {
                let lu = &st.layers[l];
                layout.placements[lu.attn] = attn;
                layout.placements[lu.kv] = kv;
                layout.experts[l] = experts;
            }
            layout.depth = 1;
            let plan =
                est.phase_plan(&inv, PhaseKind::Decode, &layout, est.vram(PhaseKind::Decode, &layout), false);
            let groups = plan.stream_groups(&inv, w.kv_bytes_per_layer_of(&inv));
            assert_eq!(est.slot_bytes(&layout), groups.iter().map(|g| g.bytes).max().unwrap_or(0));
        }
    }

    /// Pinned routed experts of a decode step cost the grouped rows where the profile has them (as the
    /// simulator prices our executor's), those of a prefill chunk the tiled rows where it has them, streamed
    /// ones the per-expert rows.
    #[test]
    fn pinned_decode_experts_cost_the_grouped_rows() {
        let spec =
            catalog::get("qwen3-30b-a3b").unwrap().truncated(2).unwrap().with_uniform_weights(DType::Bf16);
        let inv = Inventory::new(&spec);
        let w = Workload::single(256, 1024, 16, 256);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/h200.json");
        let mut profile = pipeshard_core::profile::Profile::load(&path).unwrap();
        profile
            .gpu
            .ops
            .retain(|r| !matches!(r.op, OpClass::Experts | OpClass::ExpertsGrouped | OpClass::ExpertsTiled));
        let row = |op, tokens, time_ns| {
            pipeshard_core::profile::OpRow::gpu(op, DType::Bf16, (768, 2048), tokens, time_ns)
        };
        profile.gpu.ops.extend([1, 64].map(|t| row(OpClass::Experts, t, 40_000)));
        let apart = Estimator::new(&spec, &inv, &w, &TableCostModel::new(&profile));
        profile.gpu.ops.push(row(OpClass::ExpertsGrouped, 8, 20_000));
        let grouped = Estimator::new(&spec, &inv, &w, &TableCostModel::new(&profile));
        let st = &grouped.structure;
        let mut layout = Layout::all_cpu(st, inv.units.len());
        layout.placements.fill(Placement::Pinned);
        let mut time = |est: &Estimator, experts: [u32; 3]| {
            layout.experts.fill(experts);
            layout.depth = u32::from(experts[1] > 0);
            est.phase(PhaseKind::Decode, &layout, false).compute_ns
        };
        // Each layer's 8 experts a token: 8 × 40 µs apart, one 20 µs group pinned.
        let saved = time(&apart, [128, 0, 0]) - time(&grouped, [128, 0, 0]);
        let want = 2.0 * (8.0 * 40e3 - 20e3);
        assert!((saved / want - 1.0).abs() < 0.02, "saved {saved} ns, want {want}");
        assert_eq!(time(&apart, [0, 128, 0]).to_bits(), time(&grouped, [0, 128, 0]).to_bits());
        let expert = st.layers[0].experts[0];
        let saving = |est: &Estimator, phase| est.costs(phase).units[expert].pinned_saving_ns;
        assert!(saving(&grouped, PhaseKind::Decode) > 0.0);
        assert!(saving(&grouped, PhaseKind::Prefill).abs() < 1e-9, "prefill chunks are not grouped");
        assert!(saving(&apart, PhaseKind::Decode).abs() < 1e-9, "no grouped rows");
        profile.gpu.ops.extend([1, 64].map(|t| row(OpClass::ExpertsTiled, t, 10_000)));
        let tiled = Estimator::new(&spec, &inv, &w, &TableCostModel::new(&profile));
        assert!(saving(&tiled, PhaseKind::Prefill) > 0.0, "a prefill chunk's pinned experts are tiled");
        assert_eq!(
            saving(&tiled, PhaseKind::Decode).to_bits(),
            saving(&grouped, PhaseKind::Decode).to_bits()
        );
    }

    #[test]
    fn handoffs_count_device_changes_around_each_layer() {
        let (_, inv, _, est) = setup("nemo-8b", 2);
        let st = &est.structure;
        let mut l = Layout::all_cpu(st, inv.units.len());
        assert_eq!(est.layer_handoffs(&l, 0), 0);
        l.placements[st.layers[0].attn] = Placement::Pinned;
        l.placements[st.layers[0].kv] = Placement::Pinned;
        assert_eq!(est.layer_handoffs(&l, 0), 2, "GPU attention, CPU FFN");
        l.placements[st.layers[0].ffn.unwrap()] = Placement::Streamed;
        assert_eq!(est.layer_handoffs(&l, 0), 0, "pinned and streamed are both on the GPU");

        let (_, inv, _, est) = setup("qwen3-30b-a3b", 1);
        let st = &est.structure;
        let mut l = Layout::all_cpu(st, inv.units.len());
        l.experts[0] = [3, 0, 125];
        assert_eq!(est.layer_handoffs(&l, 0), 2, "CPU attention, experts split");
        for u in [st.layers[0].attn, st.layers[0].kv, st.layers[0].router.unwrap()] {
            l.placements[u] = Placement::Pinned;
        }
        assert_eq!(est.layer_handoffs(&l, 0), 2, "GPU attention, experts split");
        l.experts[0] = [128, 0, 0];
        assert_eq!(est.layer_handoffs(&l, 0), 0);
    }

    #[test]
    fn costs_cover_every_chunk_and_the_gpu_is_faster_for_prefill() {
        let (spec, inv, w, est) = setup("nemo-8b", 2);
        assert_eq!(est.prefill.steps, 3);
        assert_eq!(est.prefill.tier_tokens, 1024);
        let ffn = est.structure.layers[1].ffn.unwrap();
        let u = est.prefill.units[ffn];
        assert!(u.gpu_ns * 10.0 < u.cpu_ns, "{u:?}");
        // Op offload copies the weights once per chunk, unoverlapped, and runs the matmuls on the GPU.
        assert!(u.offload_ns > 3.0 * u.copy_ns && u.offload_ns < u.cpu_ns / 10.0, "{u:?}");
        // Later chunks attend over more keys.
        let kv = est.structure.layers[0].kv;
        assert!(est.prefill.units[kv].gpu_ns > 3.0 * est.decode.units[kv].gpu_ns);
        assert_eq!(est.kv_layer_bytes, spec.kv_bytes_per_token_layer(w.kv_dtype) * 4096);
        assert_eq!(est.unit_bytes.len(), inv.units.len());
    }

    #[test]
    fn streaming_needs_a_second_slot_to_overlap() {
        let (_, inv, _, est) = setup("nemo-8b", 4);
        let st = &est.structure;
        let mut l = Layout::all_cpu(st, inv.units.len());
        for lu in &st.layers {
            for u in [lu.attn, lu.kv, lu.ffn.unwrap()] {
                l.placements[u] = Placement::Streamed;
            }
        }
        l.depth = 1;
        let one = est.phase(PhaseKind::Prefill, &l, false);
        l.depth = 2;
        let two = est.phase(PhaseKind::Prefill, &l, false);
        // One slot serialises each unit's copy and compute; two halve the occupancy, which then never binds.
        assert!(one.occupancy_ns > one.copy_ns.max(one.compute_ns));
        assert!((one.time_ns - one.occupancy_ns).abs() < 1.0);
        assert!((one.occupancy_ns - 2.0 * two.occupancy_ns).abs() < 1.0);
        assert!(two.time_ns < one.time_ns);
        assert!((two.time_ns - two.copy_ns.max(two.compute_ns).max(two.dram_ns)).abs() < 1.0);
        assert_eq!(est.vram(PhaseKind::Prefill, &l).streaming_slots_bytes, 2 * one.slot_bytes);
    }
}
