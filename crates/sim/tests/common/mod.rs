//! Hand-built plans and a fixed cost model for the simulator's tests.
#![allow(dead_code)] // each test binary uses part of this module

use pipeshard_core::catalog;
use pipeshard_core::cost::{CostModel, Device, OpContext};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{
    PLAN_SCHEMA_VERSION, PhaseKind, PhasePlan, Placement, Plan, UnitPlacement, VramBreakdown,
};
use pipeshard_core::workload::{self, Op, OpKind, Workload};

/// A cost model with round numbers: GPU ops take `gpu_ns_per_byte` per weight byte (KV ignored), CPU ops
/// `cpu_ns_per_byte`, weightless ops `weightless_ns`; copies move `pcie_bytes_per_ns` after `copy_latency_ns`
/// each; optional launch (and graph replay), sync, DMA slowdown and H2D slowdown beside CPU work.
#[derive(Debug, Clone)]
pub struct FixedCost {
    pub gpu_ns_per_byte: f64,
    pub cpu_ns_per_byte: f64,
    pub weightless_ns: u64,
    pub pcie_bytes_per_ns: f64,
    pub copy_latency_ns: u64,
    pub launch_ns: u64,
    /// One kernel replayed from a CUDA graph; 0: a launch.
    pub graph_kernel_ns: u64,
    pub host_sync_ns: u64,
    pub dma_slowdown: f64,
    /// An H2D copy's time while the CPU pool computes, over its time alone.
    pub h2d_cpu_slowdown: f64,
    /// GPU experts read the routing on the device (llama.cpp) rather than after a host round trip.
    pub expert_ids_on_device: bool,
    /// Our executor's host routing, per token of a 128-expert router.
    pub host_route_ns_per_token: u64,
    /// Our executor's decode routing round trip to the CPU and to the GPU experts (0: not measured).
    pub decode_routing_ns: (u64, u64),
    /// Our executor's host time per streamed unit beyond its kernels (0: not measured).
    pub ring_copy_issue_ns: u64,
    /// Our executor's copy-engine time per ring item beyond its copies (0: not measured).
    pub ring_copy_gap_ns: u64,
    /// Our executor's return from a decode step's CPU experts to the GPU (0: not measured).
    pub decode_experts_return_ns: u64,
    /// The routing round trips beside an H2D copy (to the CPU, to the GPU; 0: the idle figure).
    pub decode_routing_beside_h2d_ns: (u64, u64),
    /// The return beside an H2D copy (0: the idle figure).
    pub decode_experts_return_beside_h2d_ns: u64,
}

impl FixedCost {
    /// Zero launch, sync and slowdown: times are exactly the formulas.
    pub fn plain(gpu_ns_per_byte: f64, pcie_bytes_per_ns: f64) -> FixedCost {
        FixedCost {
            gpu_ns_per_byte,
            cpu_ns_per_byte: 10.0 * gpu_ns_per_byte,
            weightless_ns: 0,
            pcie_bytes_per_ns,
            copy_latency_ns: 0,
            launch_ns: 0,
            graph_kernel_ns: 0,
            host_sync_ns: 0,
            dma_slowdown: 1.0,
            h2d_cpu_slowdown: 1.0,
            expert_ids_on_device: false,
            host_route_ns_per_token: 0,
            decode_routing_ns: (0, 0),
            ring_copy_issue_ns: 0,
            ring_copy_gap_ns: 0,
            decode_experts_return_ns: 0,
            decode_routing_beside_h2d_ns: (0, 0),
            decode_experts_return_beside_h2d_ns: 0,
        }
    }
}

impl CostModel for FixedCost {
    fn op_ns(&self, op: &Op, ctx: OpContext) -> u64 {
        if op.weight_bytes == 0.0 {
            return self.weightless_ns;
        }
        let per = match ctx.device {
            Device::Gpu => self.gpu_ns_per_byte,
            Device::Cpu => self.cpu_ns_per_byte,
        };
        let slow = if ctx.under_dma { self.dma_slowdown } else { 1.0 };
        (op.weight_bytes * per * slow).round() as u64
    }
    fn roofline_ns(&self, op: &Op, ctx: OpContext) -> u64 {
        self.op_ns(op, ctx)
    }
    fn h2d_ns(&self, bytes: u64, _pinned: bool) -> u64 {
        if bytes == 0 {
            0
        } else {
            self.copy_latency_ns + (bytes as f64 / self.pcie_bytes_per_ns).round() as u64
        }
    }
    fn h2d_beside_cpu_ns(&self, bytes: u64, _pinned: bool) -> u64 {
        if bytes == 0 {
            0
        } else {
            self.copy_latency_ns
                + (bytes as f64 * self.h2d_cpu_slowdown / self.pcie_bytes_per_ns).round() as u64
        }
    }
    fn d2h_ns(&self, bytes: u64, pinned: bool) -> u64 {
        self.h2d_ns(bytes, pinned)
    }
    fn launch_ns(&self) -> u64 {
        self.launch_ns
    }
    fn graph_kernel_ns(&self) -> u64 {
        if self.graph_kernel_ns == 0 { self.launch_ns } else { self.graph_kernel_ns }
    }
    fn host_sync_ns(&self) -> u64 {
        self.host_sync_ns
    }
    fn host_route_ns(&self, n_experts: u32, tokens: u64) -> u64 {
        self.host_route_ns_per_token * tokens * u64::from(n_experts) / 128
    }
    fn decode_routing_ns(&self, to: Device, beside_h2d: bool) -> u64 {
        let pick = |(cpu, gpu): (u64, u64)| if to == Device::Cpu { cpu } else { gpu };
        let beside = pick(self.decode_routing_beside_h2d_ns);
        if beside_h2d && beside > 0 { beside } else { pick(self.decode_routing_ns) }
    }
    fn ring_copy_issue_ns(&self) -> u64 {
        self.ring_copy_issue_ns
    }
    fn ring_copy_gap_ns(&self) -> u64 {
        self.ring_copy_gap_ns
    }
    fn decode_experts_return_ns(&self, beside_h2d: bool) -> u64 {
        let beside = self.decode_experts_return_beside_h2d_ns;
        if beside_h2d && beside > 0 { beside } else { self.decode_experts_return_ns }
    }
    fn expert_ids_on_device(&self) -> bool {
        self.expert_ids_on_device
    }
    fn runtime_overhead_bytes(&self) -> u64 {
        0
    }
    fn cpu_threads(&self) -> u32 {
        8
    }
    fn dram_gbps(&self, _threads: u32, _under_dma: bool) -> f64 {
        100.0
    }
}

/// The derived profile of the paper's cli3 (RTX 5090) as a table cost model.
pub fn cli3() -> pipeshard_core::cost::TableCostModel {
    pipeshard_core::cost::TableCostModel::new(&pipeshard_core::reference::derived("cli3").unwrap())
}

/// A catalog model truncated to `layers` layers.
pub fn small(name: &str, layers: u32) -> ModelSpec {
    catalog::get(name).unwrap().truncated(layers).unwrap()
}

/// What a hand-built phase looks like.
#[derive(Debug, Clone, Copy)]
pub struct PhaseShape {
    pub pipeline_depth: u32,
    pub op_offload: bool,
    pub cpu_threads: u32,
}

/// A phase plan placing each unit by `place`, with a slot as large as the largest stream group, and the VRAM
/// breakdown accounted statically (what the simulator must never exceed).
pub fn phase_plan(
    spec: &ModelSpec,
    w: &Workload,
    kind: PhaseKind,
    shape: PhaseShape,
    place: &dyn Fn(UnitId) -> Placement,
) -> PhasePlan {
    let inv = Inventory::new(spec);
    let placements: Vec<UnitPlacement> =
        inv.units.iter().map(|u| UnitPlacement { unit: u.id, placement: place(u.id) }).collect();
    let streamed = |u: &UnitPlacement| u.placement == Placement::Streamed;
    let any_streamed = placements.iter().any(streamed);
    let pipeline_depth = if any_streamed { shape.pipeline_depth.max(1) } else { 0 };
    let mut p = PhasePlan {
        phase: kind,
        tier_tokens: match kind {
            PhaseKind::Prefill => w.ubatch,
            PhaseKind::Decode => w.batch,
        },
        pipeline_depth,
        slot_bytes: 0,
        placements,
        op_offload: shape.op_offload,
        cpu_threads: shape.cpu_threads,
        vram: VramBreakdown::default(),
    };
    // A slot holds the largest stream group (a unit, or a streamed attention with its streamed KV).
    let slot_bytes =
        p.stream_groups(&inv, w.kv_bytes_per_layer_of(&inv)).iter().map(|g| g.bytes).max().unwrap_or(0);
    let placements = std::mem::take(&mut p.placements);
    let mut vram = VramBreakdown {
        streaming_slots_bytes: u64::from(pipeline_depth) * slot_bytes,
        ..VramBreakdown::default()
    };
    for u in placements.iter().filter(|u| u.placement == Placement::Pinned) {
        match u.unit {
            UnitId::Kv { .. } => vram.kv_bytes += w.kv_bytes_per_layer(spec),
            id => vram.pinned_weights_bytes += inv.unit_bytes(id),
        }
    }
    let phases = match kind {
        PhaseKind::Prefill => w.prefill_chunks(),
        PhaseKind::Decode => (0..w.gen_tokens).map(|i| w.decode_step(i)).collect(),
    };
    let scratch = phases.iter().map(|&p| workload::scratch_bytes(spec, w, p)).max().unwrap_or(0);
    // Op offload keeps one CPU unit's weights (or a layer's CPU experts) in scratch while it runs.
    let offload = if shape.op_offload && kind == PhaseKind::Prefill {
        let unit_max = placements
            .iter()
            .filter(|u| u.placement == Placement::Cpu)
            .map(|u| inv.unit_bytes(u.unit))
            .max()
            .unwrap_or(0);
        let mut experts: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
        for u in placements.iter().filter(|u| u.placement == Placement::Cpu) {
            if let UnitId::Expert { layer, .. } = u.unit {
                *experts.entry(layer).or_default() += inv.unit_bytes(u.unit);
            }
        }
        unit_max.max(experts.values().copied().max().unwrap_or(0))
    } else {
        0
    };
    vram.scratch_bytes = scratch + offload;
    PhasePlan { slot_bytes, placements, vram, ..p }
}

/// A plan using the same placement in both phases, budget exactly its breakdown.
pub fn plan(spec: &ModelSpec, w: &Workload, shape: PhaseShape, place: &dyn Fn(UnitId) -> Placement) -> Plan {
    let prefill = phase_plan(spec, w, PhaseKind::Prefill, shape, place);
    let decode = phase_plan(spec, w, PhaseKind::Decode, PhaseShape { op_offload: false, ..shape }, place);
    let budget_bytes = prefill.vram.total().max(decode.vram.total());
    Plan {
        schema_version: PLAN_SCHEMA_VERSION,
        planner: "hand".into(),
        model: spec.name.clone(),
        weights: Some(spec.weights.clone()),
        budget_bytes,
        workload: *w,
        prefill,
        decode,
        switch_bytes: 0,
        prediction: None,
        notes: Vec::new(),
    }
}

/// Every unit the same, KV following attention (KV `Streamed` only where attention is on the GPU).
pub fn uniform(p: Placement) -> impl Fn(UnitId) -> Placement {
    move |_| p
}

/// Whether an op reads weights (the fixed cost model charges only those).
pub fn reads_weights(op: &Op) -> bool {
    op.weight_bytes > 0.0 && !matches!(op.kind, OpKind::Attention { .. })
}
