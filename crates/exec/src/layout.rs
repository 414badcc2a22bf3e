//! How one phase plan becomes addresses: the arena carve-up, the per-step locations of weights and KV, and the
//! streaming ring's item sequence. Pure functions, testable without a GPU.
//!
//! The arena is carved as: KV of VRAM-resident layers from the bottom up (layer order), pinned weights from the
//! top down (inventory order), and in between the streaming slots, the op-offload staging area and the scratch
//! (activations). Units (and KV) pinned in both phases are carved first, in the same order, in both layouts, so
//! they keep their address across the plan switch, which then uploads only what the decode plan newly pins —
//! the switch the planner and simulator cost.
//! Every line is compared with the plan's [`VramBreakdown`]; the total must fit the arena.

use std::collections::{HashMap, HashSet};

use pipeshard_core::inventory::UnitId;
use pipeshard_core::model::FfnKind;
use pipeshard_core::plan::{PhaseKind, PhasePlan, Placement, Plan, VramBreakdown};
use pipeshard_core::workload::attention_key_splits;

use crate::cuda::grouped_experts_fit;
use crate::error::{ExecError, Result};
use crate::seqs::SeqKv;
use crate::weights::{Dims, ModelWeights};

/// Alignment of every region in the arena.
pub const REGION_ALIGN_BYTES: usize = pipeshard_core::workload::EXEC_REGION_ALIGN_BYTES as usize;

fn align(x: usize) -> usize {
    x.next_multiple_of(REGION_ALIGN_BYTES)
}

/// Where a unit's weights are read from in a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLoc {
    /// Resident in VRAM at this arena offset.
    Pinned(usize),
    /// Copied into a ring slot before use.
    Streamed,
    /// Copied into the staging area at this offset before use, on the compute stream (llama.cpp's op offload).
    /// A layer's CPU experts sit side by side there, as ggml stages a merged `*_exps` tensor whole.
    Staged(usize),
    /// Read from host memory by the CPU.
    Cpu,
}

impl WeightLoc {
    /// Whether the unit computes on the GPU.
    #[must_use]
    pub fn on_gpu(self) -> bool {
        !matches!(self, WeightLoc::Cpu)
    }
}

/// Where a layer's KV cache lives in a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLoc {
    /// Resident in VRAM at this arena offset.
    Pinned(usize),
    /// Uploaded into a ring slot before the layer's attention, new rows written back after.
    Streamed,
    /// In host memory, used by CPU attention (also under op offload, whose matmuls run on the GPU).
    Host,
}

/// One compute step of a forward pass: a weight unit and where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The unit (token embedding, attention, FFN or output).
    pub unit: UnitId,
    /// Where its weights are.
    pub weights: WeightLoc,
    /// For attention: where its KV is.
    pub kv: Option<KvLoc>,
}

/// One item of the streaming ring: what one slot receives (`PhasePlan::stream_groups` in the core).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RingItem {
    /// A unit's weights.
    Weights(UnitId),
    /// A layer's attention weights with its KV cache in the same slot (KV at the aligned end of the weights).
    AttnKv(u32),
    /// A layer's KV cache alone (its attention is pinned).
    Kv(u32),
    /// The streamed experts of a layer that its router picks, one slot each in expert order: a placeholder the
    /// engine replaces by `Weights(expert)` items once the routing is known (unpicked experts are not copied).
    Experts(u32),
}

/// Offsets (from the arena base) of the activation buffers of a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScratchLayout {
    /// Most tokens per step.
    pub tokens: usize,
    /// Key splits of decode attention (1 = none).
    pub attn_splits: usize,
    pub ids: usize,
    pub tok: usize,
    pub inv_freq: usize,
    pub h: usize,
    pub xb: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub gate: usize,
    pub up: usize,
    pub act: usize,
    pub logits: usize,
    pub part_o: usize,
    pub part_ml: usize,
    /// MoE: router logits `[m, n_experts]` f32.
    pub moe_logits: usize,
    /// MoE: token permutation, `m × top_k` u32 token ids and f32 routing weights.
    pub moe_idx: usize,
    pub moe_w: usize,
    /// MoE: one expert's gathered inputs `[m, hidden]` (activations), gate and up `[m, 2·expert_ffn]` f32
    /// (one GEMM's output, `cuda::ExpertIo::gate_up`), their SwiGLU `[m, expert_ffn]` (activations) and
    /// output `[m, hidden]` f32 (also where the CPU experts' partial sum lands).
    pub moe_x: usize,
    pub moe_gate_up: usize,
    pub moe_act: usize,
    pub moe_y: usize,
    /// MoE, steps the grouped expert kernels can run (`cuda::grouped_experts_fit`: f16/bf16 and every
    /// quantised format but q2_k/q3_k, at most `EXACT_MAX_TOKENS` tokens): `moe_grouped` says they were
    /// carved. Up to `m × top_k` experts' unit addresses (u64) and entry offsets (`m × top_k + 1` u32), and a
    /// SwiGLU row (activations, `expert_ffn`) per (expert, token) entry — the per-expert path's `moe_act`
    /// holds one expert's rows only.
    pub moe_grouped: bool,
    pub moe_gbase: usize,
    pub moe_gfirst: usize,
    pub moe_gact: usize,
    /// End of the attention temporaries (q, k, v, split partials) in the region they share with the FFN's.
    pub attn_end: usize,
    /// Op offload: a CPU-resident layer's `[K | V]` cache view, copied up for its attention on the GPU (after
    /// the attention temporaries, in the region the FFN's temporaries use later); 0 when no layer needs one.
    pub kv_view: usize,
    /// Bytes of the whole scratch region.
    pub bytes: usize,
}

/// Key splits of attention over `ctx` keys for steps of `tokens` tokens, `logit_rows` of which produce a
/// token (a decode step when every token does): core's [`attention_key_splits`], which sizes the scratch the
/// planner counts.
#[must_use]
pub fn attn_splits(d: &Dims, tokens: usize, logit_rows: usize, ctx: usize) -> usize {
    attention_key_splits(ctx as u64, tokens as u64, logit_rows == tokens, d.n_heads as u32) as usize
}

/// Bytes of scratch a phase of `tokens` tokens per step, `logit_rows` of which produce a token (1 in prefill,
/// every sequence's in decode), needs over a context of `ctx` keys, with its offsets relative to `base`.
#[must_use]
pub fn scratch_layout(d: &Dims, tokens: usize, logit_rows: usize, ctx: usize, base: usize) -> ScratchLayout {
    carve_scratch(d, tokens, logit_rows, attn_splits(d, tokens, logit_rows, ctx), base)
}

/// [`scratch_layout`] with `attn_splits` key splits.
fn carve_scratch(
    d: &Dims,
    tokens: usize,
    logit_rows: usize,
    attn_splits: usize,
    base: usize,
) -> ScratchLayout {
    let m = tokens;
    let act = d.mat.size_bytes();
    let mut s = ScratchLayout { tokens: m, attn_splits, ..ScratchLayout::default() };
    let mut at = base;
    let mut take = |bytes: usize| {
        let off = at;
        at = align(at + bytes);
        off
    };
    s.ids = take(m * 4);
    s.tok = take(16.max(logit_rows * 4));
    s.inv_freq = take(d.rot_dims / 2 * 4 + 4);
    s.h = take(m * d.hidden * 4);
    s.xb = take(m * d.hidden.max(d.q_dim) * act);
    s.logits = take(logit_rows * d.vocab * 4);
    // Attention temporaries (q, k, v and the split-attention partials) and FFN temporaries are never live at
    // once: they share one region (core's `scratch_parts` counts them the same way).
    let union_base = at;
    let q = union_base;
    let k = align(q + m * d.q_dim * 4);
    let v = align(k + m * d.kv_dim * 4);
    let mut attn_end = align(v + m * d.kv_dim * 4);
    if attn_splits > 1 {
        s.part_o = attn_end;
        attn_end = align(attn_end + m * d.n_heads * attn_splits * d.head_dim * 4);
        s.part_ml = attn_end;
        attn_end = align(attn_end + m * d.n_heads * attn_splits * 2 * 4);
    }
    let up = union_base;
    let gate = align(up + m * d.ffn * 4);
    let act_off = if d.ffn_kind == FfnKind::SwiGlu { align(gate + m * d.ffn * 4) } else { gate };
    // A model whose every layer routes to experts has no dense FFN temporaries.
    let ffn_end = if d.dense_ffn { align(act_off + m * d.ffn * act) } else { union_base };
    let mut moe_end = union_base;
    if let Some(moe) = d.moe {
        let mut take = |bytes: usize| {
            let off = moe_end;
            moe_end = align(moe_end + bytes);
            off
        };
        s.moe_logits = take(m * moe.n_experts * 4);
        s.moe_idx = take(m * moe.top_k * 4);
        s.moe_w = take(m * moe.top_k * 4);
        s.moe_x = take(m * d.hidden * act);
        s.moe_gate_up = take(2 * m * moe.expert_ffn * 4);
        s.moe_act = take(m * moe.expert_ffn * act);
        s.moe_y = take(m * d.hidden * 4);
        if grouped_experts_fit(d.quant, m, d.hidden, moe.expert_ffn) {
            let entries = m * moe.top_k;
            s.moe_grouped = true;
            s.moe_gbase = take(entries * 8);
            s.moe_gfirst = take((entries + 1) * 4);
            s.moe_gact = take(entries * moe.expert_ffn * act);
        }
    }
    s.q = q;
    s.k = k;
    s.v = v;
    s.attn_end = attn_end;
    s.up = up;
    s.gate = gate;
    s.act = act_off;
    s.bytes = attn_end.max(ffn_end).max(moe_end) - base;
    s
}

/// A phase plan turned into addresses.
#[derive(Debug, Clone)]
pub struct PhaseLayout {
    /// Which phase.
    pub phase: PhaseKind,
    /// Compute steps in order.
    pub steps: Vec<Step>,
    /// Streamed items of one forward pass, in the order they are used.
    pub ring_items: Vec<RingItem>,
    /// Ring slots (arena offsets).
    pub slots: Vec<usize>,
    /// Bytes of one slot.
    pub slot_bytes: usize,
    /// Staging area for op offload (arena offset) and its bytes.
    pub staging: Option<(usize, usize)>,
    /// Activation buffers.
    pub scratch: ScratchLayout,
    /// Where each expert of each MoE layer is, by layer, in expert order.
    pub experts: HashMap<u32, Vec<WeightLoc>>,
    /// What this layout takes, line by line (runtime overhead left 0: it is measured, not carved).
    pub used: VramBreakdown,
    /// Bytes the arena must have.
    pub arena_needed_bytes: usize,
}

impl PhaseLayout {
    /// Offsets of the pinned units, by unit: one map for a plan switch's thousands of lookups (a search of
    /// `steps` for each took 5 ms at 24 MoE layers of 128 experts).
    #[must_use]
    pub fn pinned_offsets(&self) -> HashMap<UnitId, usize> {
        self.steps
            .iter()
            .filter_map(|s| match s.weights {
                WeightLoc::Pinned(o) => Some((s.unit, o)),
                _ => None,
            })
            .collect()
    }

    /// Offset of a layer's VRAM-resident KV, if resident.
    #[must_use]
    pub fn kv_offset(&self, layer: u32) -> Option<usize> {
        self.steps.iter().find(|s| s.unit == UnitId::Attn { layer }).and_then(|s| match s.kv {
            Some(KvLoc::Pinned(o)) => Some(o),
            _ => None,
        })
    }
}

/// The device memory a plan is laid out in.
#[derive(Debug, Clone, Copy)]
pub struct Arena {
    /// Bytes of the arena (the budget less the runtime overhead and reserves).
    pub bytes: usize,
    /// The plan's VRAM budget, for error messages.
    pub budget_bytes: u64,
    /// Measured runtime overhead, for error messages.
    pub overhead_bytes: u64,
}

/// Units pinned in both phases of `plan` (weights and KV): they stay put across the plan switch.
#[must_use]
pub fn pinned_in_both(plan: &Plan) -> HashSet<UnitId> {
    let pinned = |p: &PhasePlan| -> HashSet<UnitId> {
        p.placements.iter().filter(|u| u.placement == Placement::Pinned).map(|u| u.unit).collect()
    };
    pinned(&plan.prefill).intersection(&pinned(&plan.decode)).copied().collect()
}

/// Lays out both phases of `plan` (prefill for steps of up to `prefill_tokens` tokens, decode for one token of
/// each of `kv`'s sequences), with what both phases pin at the same addresses.
pub fn layout_plan(
    w: &ModelWeights,
    plan: &Plan,
    kv: SeqKv,
    prefill_tokens: usize,
    arena: Arena,
) -> Result<[PhaseLayout; 2]> {
    let kept = pinned_in_both(plan);
    Ok([
        layout_phase(w, &plan.prefill, &kept, kv, prefill_tokens, arena)?,
        layout_phase(w, &plan.decode, &kept, kv, kv.seqs, arena)?,
    ])
}

/// Lays out `plan` for `w` in `arena`, for steps of at most `tokens` tokens and the KV cache of `kv`'s
/// sequences, carving the pinned units in `kept` first; fails before anything runs if the plan cannot be
/// executed or does not fit, naming the lines.
fn layout_phase(
    w: &ModelWeights,
    plan: &PhasePlan,
    kept: &HashSet<UnitId>,
    kv: SeqKv,
    tokens: usize,
    arena: Arena,
) -> Result<PhaseLayout> {
    let Arena { bytes: arena_bytes, budget_bytes, overhead_bytes } = arena;
    let d = &w.dims;
    let phase = plan.phase;
    let placement: HashMap<UnitId, Placement> =
        plan.placements.iter().map(|p| (p.unit, p.placement)).collect();
    let get = |unit: UnitId| placement.get(&unit).copied().ok_or(ExecError::MissingPlacement { phase, unit });
    let offload = plan.op_offload && phase == PhaseKind::Prefill && tokens >= 32;
    let kv_bytes = kv.whole().bytes();

    // KV of VRAM-resident layers, bottom up, and pinned weights, top down, in order: what both phases pin
    // first.
    let mut bottom = 0usize;
    let mut kv_pinned: HashMap<u32, usize> = HashMap::new();
    let mut top = arena_bytes - arena_bytes % REGION_ALIGN_BYTES;
    let mut pinned_at: HashMap<UnitId, usize> = HashMap::new();
    let mut pinned_used = 0usize;
    for both in [true, false] {
        for l in 0..d.n_layers as u32 {
            let id = UnitId::Kv { layer: l };
            if get(id)? == Placement::Pinned && kept.contains(&id) == both {
                kv_pinned.insert(l, bottom);
                bottom = align(bottom + kv_bytes);
            }
        }
        for unit in w.units() {
            if get(unit.id)? == Placement::Pinned && kept.contains(&unit.id) == both {
                let b = align(unit.bytes);
                top = top.saturating_sub(b);
                pinned_used += b;
                pinned_at.insert(unit.id, top);
            }
        }
    }
    let kv_used = bottom;
    let mut steps = Vec::new();
    let mut ring_items = Vec::new();
    let mut staging_bytes = 0usize;
    let mut staged_experts: HashMap<u32, usize> = HashMap::new();
    let mut max_item = 0usize;
    for unit in w.units() {
        let id = unit.id;
        let p = get(id)?;
        let weights = match p {
            Placement::Pinned => WeightLoc::Pinned(pinned_at[&id]),
            Placement::Streamed if matches!(id, UnitId::Expert { .. }) => {
                let UnitId::Expert { layer, .. } = id else { unreachable!("matched above") };
                if ring_items.last() != Some(&RingItem::Experts(layer)) {
                    ring_items.push(RingItem::Experts(layer));
                }
                max_item = max_item.max(unit.bytes);
                WeightLoc::Streamed
            }
            Placement::Streamed => {
                let with_kv =
                    matches!(id, UnitId::Attn { layer } if get(UnitId::Kv { layer })? == Placement::Streamed);
                if let (true, UnitId::Attn { layer }) = (with_kv, id) {
                    ring_items.push(RingItem::AttnKv(layer));
                    max_item = max_item.max(align(unit.bytes) + kv_bytes);
                } else {
                    ring_items.push(RingItem::Weights(id));
                    max_item = max_item.max(unit.bytes);
                }
                WeightLoc::Streamed
            }
            Placement::Cpu if offload && matches!(id, UnitId::Expert { .. }) => {
                let UnitId::Expert { layer, .. } = id else { unreachable!("matched above") };
                let at = staged_experts.entry(layer).or_insert(0);
                let o = *at;
                *at += align(unit.bytes);
                staging_bytes = staging_bytes.max(*at);
                WeightLoc::Staged(o)
            }
            Placement::Cpu
                if offload
                    && matches!(id, UnitId::Attn { .. } | UnitId::Ffn { .. } | UnitId::Router { .. }) =>
            {
                staging_bytes = staging_bytes.max(align(unit.bytes));
                WeightLoc::Staged(0)
            }
            Placement::Cpu => WeightLoc::Cpu,
        };
        let kv_loc = if let UnitId::Attn { layer } = id {
            let kp = get(UnitId::Kv { layer })?;
            let loc = match (weights, kp) {
                // Op offload keeps the cache on the host: a chunk's attention copies its rows up (kv_view).
                (WeightLoc::Cpu | WeightLoc::Staged(_), Placement::Cpu) => KvLoc::Host,
                (WeightLoc::Pinned(_) | WeightLoc::Streamed, Placement::Pinned) => {
                    KvLoc::Pinned(kv_pinned[&layer])
                }
                (WeightLoc::Streamed, Placement::Streamed) => KvLoc::Streamed,
                (WeightLoc::Pinned(_), Placement::Streamed) => {
                    ring_items.push(RingItem::Kv(layer));
                    max_item = max_item.max(kv_bytes);
                    KvLoc::Streamed
                }
                (wl, kp) => {
                    return Err(ExecError::UnsupportedPlan {
                        phase,
                        reason: format!(
                            "layer {layer}: attention weights {wl:?} with KV {kp:?}; KV must be on the side that runs attention"
                        ),
                    });
                }
            };
            Some(loc)
        } else {
            None
        };
        steps.push(Step { unit: id, weights, kv: kv_loc });
    }
    let depth = plan.pipeline_depth as usize;
    if !ring_items.is_empty() && depth == 0 {
        return Err(ExecError::UnsupportedPlan {
            phase,
            reason: "units are streamed but pipeline_depth is 0".into(),
        });
    }
    let mut experts: HashMap<u32, Vec<WeightLoc>> = HashMap::new();
    for st in &steps {
        if let UnitId::Expert { layer, .. } = st.unit {
            experts.entry(layer).or_default().push(st.weights);
        }
    }
    let slot_bytes = if ring_items.is_empty() { 0 } else { align(max_item.max(plan.slot_bytes as usize)) };
    let depth = if ring_items.is_empty() { 0 } else { depth };
    let mut at = bottom;
    let slots: Vec<usize> = (0..depth)
        .map(|_| {
            let o = at;
            at += slot_bytes;
            o
        })
        .collect();
    let staging = (staging_bytes > 0).then(|| {
        let o = at;
        at += staging_bytes;
        (o, staging_bytes)
    });
    let logit_rows = if phase == PhaseKind::Decode { tokens } else { 1 };
    // Key splits follow one sequence's context: a unified cache's masked scan is longer, but its VRAM must
    // not depend on the layout.
    let mut scratch = scratch_layout(d, tokens, logit_rows, kv.seq.ctx, at);
    // Core's scratch line counts the split attention's partial sums without the 256-byte alignment of each
    // buffer here (and a plan whose output head runs on the CPU without the logits rows this scratch always
    // holds): in an arena that tight, split the keys fewer ways (a slower decode attention, the same function
    // up to f32 rounding) rather than refuse the plan. Only the arena decides: comparing with the plan's
    // scratch line had left pshard's 16-sequence decode at 2 GiB with one split, 6.1 ms of attention a layer
    // where 8 splits take 1.6 (results/validation/2026-12-01-nvidia-h200, run23 cell 89).
    let room = arena_bytes - arena_bytes % REGION_ALIGN_BYTES;
    while scratch.attn_splits > 1 && at + scratch.bytes + pinned_used > room {
        scratch = carve_scratch(d, tokens, logit_rows, scratch.attn_splits / 2, at);
    }
    // Op offload runs a CPU-resident layer's attention on the GPU over a copy of its sequence's cache rows, as
    // llama.cpp's scheduler does (the simulator's `offloads_attention`).
    if steps.iter().any(|s| matches!((s.weights, s.kv), (WeightLoc::Staged(_), Some(KvLoc::Host)))) {
        scratch.kv_view = scratch.attn_end;
        scratch.bytes = scratch.bytes.max(align(scratch.attn_end + kv.seq.bytes()) - at);
    }
    at += scratch.bytes;
    let used = VramBreakdown {
        pinned_weights_bytes: pinned_used as u64,
        streaming_slots_bytes: (depth * slot_bytes) as u64,
        kv_bytes: kv_used as u64,
        scratch_bytes: (scratch.bytes + staging_bytes) as u64,
        runtime_overhead_bytes: 0,
    };
    let needed = at + pinned_used;
    if needed > arena_bytes - arena_bytes % REGION_ALIGN_BYTES {
        let lines = [
            ("pinned weights", used.pinned_weights_bytes, plan.vram.pinned_weights_bytes),
            ("streaming slots", used.streaming_slots_bytes, plan.vram.streaming_slots_bytes),
            ("KV", used.kv_bytes, plan.vram.kv_bytes),
            ("scratch (activations + op-offload staging)", used.scratch_bytes, plan.vram.scratch_bytes),
            ("runtime overhead (measured vs planned)", overhead_bytes, plan.vram.runtime_overhead_bytes),
        ];
        let detail = lines
            .iter()
            .map(|(n, u, p)| {
                format!("{n} {u} (plan {p}{})", if u > p { format!(", +{}", u - p) } else { String::new() })
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(ExecError::OverBudget {
            phase,
            line: "pinned weights + streaming slots + KV + scratch".into(),
            needed_bytes: needed as u64,
            available_bytes: arena_bytes as u64,
            over_bytes: (needed - arena_bytes) as u64,
            budget_bytes,
            overhead_bytes,
            detail,
        });
    }
    Ok(PhaseLayout {
        phase,
        steps,
        ring_items,
        slots,
        slot_bytes,
        staging,
        scratch,
        experts,
        used,
        arena_needed_bytes: needed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::KvLayout;
    use crate::host::Elem;
    use crate::testing::tiny_spec;
    use pipeshard_core::plan::UnitPlacement;

    fn phase_plan(w: &ModelWeights, f: impl Fn(UnitId) -> Placement, depth: u32) -> PhasePlan {
        PhasePlan {
            phase: PhaseKind::Decode,
            tier_tokens: 1,
            pipeline_depth: depth,
            slot_bytes: 0,
            placements: w
                .inventory
                .units
                .iter()
                .map(|u| UnitPlacement { unit: u.id, placement: f(u.id) })
                .collect(),
            op_offload: false,
            cpu_threads: 2,
            vram: VramBreakdown::default(),
        }
    }

    /// `p` laid out on its own (no unit kept from another phase) in an arena of `bytes`, with no budget to report.
    fn alone(w: &ModelWeights, p: &PhasePlan, kv: SeqKv, tokens: usize, bytes: usize) -> Result<PhaseLayout> {
        layout_phase(w, p, &HashSet::new(), kv, tokens, Arena { bytes, budget_bytes: 0, overhead_bytes: 0 })
    }

    #[test]
    fn regions_are_disjoint_and_inside_the_arena() {
        let w = ModelWeights::random(&tiny_spec(), 1).unwrap();
        let kv = SeqKv::single(KvLayout { ctx: 64, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        let p = phase_plan(
            &w,
            |u| match u {
                UnitId::Attn { layer: 0 } | UnitId::Kv { layer: 0 } | UnitId::Output => Placement::Pinned,
                UnitId::Ffn { .. } | UnitId::Attn { .. } | UnitId::Kv { .. } => Placement::Streamed,
                _ => Placement::Cpu,
            },
            2,
        );
        let arena = 16 << 20;
        let l = alone(&w, &p, kv, 1, arena).unwrap();
        let mut regions: Vec<(usize, usize)> = l.slots.iter().map(|&s| (s, l.slot_bytes)).collect();
        regions.push((l.scratch.h, 1));
        for s in &l.steps {
            if let WeightLoc::Pinned(o) = s.weights {
                regions.push((o, w.unit(s.unit).unwrap().bytes));
            }
            if let Some(KvLoc::Pinned(o)) = s.kv {
                regions.push((o, kv.whole().bytes()));
            }
        }
        regions.sort_unstable();
        for pair in regions.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{regions:?}");
        }
        assert!(regions.last().unwrap().0 + regions.last().unwrap().1 <= arena);
        assert_eq!(l.ring_items[0], RingItem::Weights(UnitId::Ffn { layer: 0 }));
        assert_eq!(l.ring_items[1], RingItem::AttnKv(1));
        assert_eq!(l.ring_items[2], RingItem::Weights(UnitId::Ffn { layer: 1 }));
        let attn = align(w.unit(UnitId::Attn { layer: 1 }).unwrap().bytes);
        assert!(l.slot_bytes >= attn + kv.whole().bytes(), "a streamed attention carries its KV in its slot");
    }

    #[test]
    fn streamed_experts_share_one_ring_placeholder_per_layer() {
        let w = ModelWeights::random(&crate::testing::tiny_qwen3_moe_spec(), 1).unwrap();
        let kv = SeqKv::single(KvLayout { ctx: 64, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        let p = phase_plan(
            &w,
            |u| match u {
                UnitId::Expert { expert, .. } if expert % 2 == 1 => Placement::Streamed,
                UnitId::Expert { layer: 2, .. } => Placement::Cpu,
                UnitId::Router { layer: 1 } => Placement::Streamed,
                _ => Placement::Pinned,
            },
            2,
        );
        let l = alone(&w, &p, kv, 4, 16 << 20).unwrap();
        assert_eq!(
            l.ring_items,
            vec![
                RingItem::Experts(0),
                RingItem::Weights(UnitId::Router { layer: 1 }),
                RingItem::Experts(1),
                RingItem::Experts(2)
            ]
        );
        let expert = w.unit(UnitId::Expert { layer: 0, expert: 0 }).unwrap().bytes;
        assert!(l.slot_bytes >= expert);
        assert_eq!(l.experts.len(), 3);
        assert!(matches!(l.experts[&0][0], WeightLoc::Pinned(_)));
        assert_eq!(l.experts[&0][1], WeightLoc::Streamed);
        assert_eq!(l.experts[&2][0], WeightLoc::Cpu);
        let sc = l.scratch;
        let moe = w.dims.moe.unwrap();
        assert!(sc.moe_y + 4 * w.dims.hidden * 4 <= sc.ids + sc.bytes, "MoE temporaries inside the scratch");
        assert!(
            sc.moe_logits >= sc.xb + 4 * w.dims.hidden * 2,
            "MoE temporaries leave the normed input alone"
        );
        assert!(sc.moe_act >= sc.moe_gate_up + 4 * 2 * moe.expert_ffn * 4);
        // 4 tokens of f16 experts: the grouped path's arrays and SwiGLU rows follow, inside the scratch.
        let entries = 4 * moe.top_k;
        assert!(sc.moe_grouped);
        assert!(sc.moe_gbase >= sc.moe_y + 4 * w.dims.hidden * 4);
        assert!(sc.moe_gfirst >= sc.moe_gbase + 8 * entries);
        assert!(sc.moe_gact >= sc.moe_gfirst + 4 * (entries + 1));
        assert!(sc.moe_gact + entries * moe.expert_ffn * 2 <= sc.ids + sc.bytes);
        assert!(sc.moe_gbase.is_multiple_of(16) && sc.moe_gact.is_multiple_of(16), "16-byte aligned rows");
        let prefill = scratch_layout(&w.dims, 16, 1, 64, 0);
        assert!(!prefill.moe_grouped, "more than EXACT_MAX_TOKENS tokens: per-expert only");
        let dense = scratch_layout(&crate::weights::Dims { dense_ffn: true, ..w.dims.clone() }, 4, 4, 64, 0);
        assert!(sc.bytes < dense.bytes, "no dense FFN temporaries when every layer is MoE");
    }

    /// A decode step of many sequences splits its keys as far as the arena holds the partial sums, whatever the
    /// plan's scratch line says (a plan whose head runs on the CPU does not count the logits rows this scratch
    /// holds); one sequence's decode splits by its context.
    #[test]
    fn many_sequences_split_keys_as_far_as_the_arena_holds() {
        let w = ModelWeights::random(&tiny_spec(), 1).unwrap();
        let seq = KvLayout { ctx: 4096, kv_dim: w.dims.kv_dim, elem: Elem::F16 };
        let kv = SeqKv { seq, seqs: 16, unified: true, prompt: 8 };
        let mut p = phase_plan(&w, |_| Placement::Pinned, 0);
        p.vram.scratch_bytes = 0;
        let roomy = alone(&w, &p, kv, 16, 64 << 20).unwrap();
        assert_eq!(
            roomy.scratch.attn_splits, 64,
            "4096 keys in 64-key splits (16 sequences × 4 heads × 64 = 4096 warps)"
        );
        // The smallest arena that takes the plan (to 4 KiB) has no room for 64 splits' partial sums.
        let (mut lo, mut hi) = (0usize, 64usize << 20);
        while hi - lo > 4096 {
            let mid = lo.midpoint(hi);
            if alone(&w, &p, kv, 16, mid).is_ok() { hi = mid } else { lo = mid }
        }
        let tight = alone(&w, &p, kv, 16, hi).unwrap();
        assert!(tight.scratch.attn_splits < 64, "{}", tight.scratch.attn_splits);
        assert!(roomy.scratch.bytes > tight.scratch.bytes, "the partial sums take room");
        let one = layout_phase(
            &w,
            &p,
            &HashSet::new(),
            SeqKv::single(seq),
            1,
            Arena { bytes: 64 << 20, budget_bytes: 0, overhead_bytes: 0 },
        )
        .unwrap();
        assert_eq!(one.scratch.attn_splits, 64, "4096 keys in 64-key splits");
    }

    #[test]
    fn too_small_arenas_fail_naming_the_lines() {
        let w = ModelWeights::random(&tiny_spec(), 1).unwrap();
        let kv = SeqKv::single(KvLayout { ctx: 64, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        let p = phase_plan(&w, |_| Placement::Pinned, 0);
        let e = layout_phase(
            &w,
            &p,
            &HashSet::new(),
            kv,
            1,
            Arena { bytes: 100_000, budget_bytes: 200_000, overhead_bytes: 100_000 },
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.contains("pinned weights") && s.contains("over") || s.contains("more than"), "{s}");
        assert!(matches!(e, ExecError::OverBudget { over_bytes, .. } if over_bytes > 0));
    }

    #[test]
    fn kv_streams_alone_only_under_pinned_attention() {
        let w = ModelWeights::random(&tiny_spec(), 1).unwrap();
        let kv = SeqKv::single(KvLayout { ctx: 64, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        let p = phase_plan(
            &w,
            |u| match u {
                UnitId::Attn { .. } => Placement::Pinned,
                UnitId::Kv { .. } => Placement::Streamed,
                _ => Placement::Cpu,
            },
            1,
        );
        let l = alone(&w, &p, kv, 1, 64 << 20).unwrap();
        assert_eq!(l.ring_items, vec![RingItem::Kv(0), RingItem::Kv(1), RingItem::Kv(2)]);
        assert_eq!(l.slot_bytes, align(kv.whole().bytes()));
        let bad = phase_plan(
            &w,
            |u| if matches!(u, UnitId::Kv { .. }) { Placement::Pinned } else { Placement::Cpu },
            0,
        );
        let e = alone(&w, &bad, kv, 1, 64 << 20).unwrap_err();
        assert!(e.to_string().contains("KV must be on the side that runs attention"), "{e}");
    }
    #[test]
    fn units_pinned_in_both_phases_keep_their_address() {
        let spec = crate::testing::tiny_qwen3_moe_spec();
        let w = ModelWeights::random(&spec, 1).unwrap();
        let kv = SeqKv::single(KvLayout { ctx: 64, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        // Prefill pins the odd experts and layer 1's attention and KV; decode also pins layer 0's even experts
        // and every layer's attention and KV, units that come before shared ones in inventory order.
        let plan = crate::testing::manual_plan(
            &spec,
            pipeshard_core::workload::Workload::single(16, 64, 4, 8),
            1 << 30,
            0,
            0,
            2,
            |phase, u| match (phase, u) {
                (_, UnitId::Expert { expert, .. }) if expert % 2 == 1 => Placement::Pinned,
                (PhaseKind::Decode, UnitId::Expert { layer: 0, .. }) => Placement::Pinned,
                (_, UnitId::Expert { .. }) => Placement::Cpu,
                (PhaseKind::Prefill, UnitId::Kv { layer } | UnitId::Attn { layer }) if layer != 1 => {
                    Placement::Cpu
                }
                _ => Placement::Pinned,
            },
        );
        let kept = pinned_in_both(&plan);
        assert!(kept.contains(&UnitId::Expert { layer: 0, expert: 1 }));
        assert!(!kept.contains(&UnitId::Expert { layer: 0, expert: 0 }));
        let [p, d] =
            layout_plan(&w, &plan, kv, 4, Arena { bytes: 64 << 20, budget_bytes: 0, overhead_bytes: 0 })
                .unwrap();
        let (p_pinned, d_pinned) = (p.pinned_offsets(), d.pinned_offsets());
        for &u in &kept {
            match u {
                UnitId::Kv { layer } => assert_eq!(p.kv_offset(layer), d.kv_offset(layer), "{u}"),
                _ => assert_eq!(p_pinned.get(&u), d_pinned.get(&u), "{u}"),
            }
        }
        assert!(d_pinned.contains_key(&UnitId::Expert { layer: 0, expert: 0 }));
        assert_ne!(p.kv_offset(0), d.kv_offset(0), "only layer 1's KV is shared");
    }
    /// Core's `exec_scratch_bytes`, with which the simulator predicts our runtime's VRAM, is this carve's size.
    #[test]
    fn core_predicts_the_carved_scratch() {
        use pipeshard_core::dtype::DType;
        // The formats whose MoE decode steps carve the grouped experts' entries: all but q2_k/q3_k.
        let dtypes = [DType::Bf16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4K, DType::Q6K];
        for name in ["nemo-8b", "qwen3-30b-a3b", "nemo-4b", "llama-3.1-8b", "qwen3-235b-a22b"] {
            for dtype in dtypes.into_iter().chain([DType::Q2K, DType::Q3K]) {
                let spec = pipeshard_core::catalog::get(name).unwrap().with_uniform_weights(dtype);
                let d = crate::weights::Dims::new(&spec).unwrap();
                let grouped = d.moe.is_some() && dtypes.contains(&dtype);
                assert_eq!(scratch_layout(&d, 8, 8, 1024, 0).moe_grouped, grouped, "{name} {dtype}");
                // Prefill chunks (one logits row) and decode steps of 1 to 64 sequences.
                let shapes = [(1024, 1), (512, 1), (37, 1), (1, 1), (4, 4), (8, 8), (16, 16), (64, 64)];
                for ((m, rows), ctx) in shapes.into_iter().flat_map(|s| [1024, 8192, 32768].map(|c| (s, c))) {
                    let carved = scratch_layout(&d, m, rows, ctx, 0).bytes as u64;
                    let core = pipeshard_core::workload::exec_scratch_bytes(
                        &spec,
                        m as u64,
                        rows as u64,
                        ctx as u64,
                    );
                    assert_eq!(core, carved, "{name} {dtype}: {m} tokens, {rows} logits rows, ctx {ctx}");
                }
            }
        }
    }

    /// The planner's scratch line (core's `scratch_bytes`) covers the executor's scratch in decode, where the
    /// split-attention partials grow with the context (a nemo-8b 8K decode plan was refused for them).
    #[test]
    fn core_scratch_covers_exec_scratch_in_decode() {
        for name in ["nemo-8b", "qwen3-30b-a3b", "nemo-4b"] {
            let spec = pipeshard_core::catalog::get(name)
                .unwrap()
                .with_uniform_weights(pipeshard_core::dtype::DType::Bf16);
            let d = crate::weights::Dims::new(&spec).unwrap();
            // One request, and 4 parallel ones (a token and its logits row each).
            for (ctx, r) in [1024u64, 8192, 32768].into_iter().flat_map(|c| [(c, 1usize), (c, 4)]) {
                let wl = pipeshard_core::workload::Workload::single(ctx - 16, ctx, 16, 1024)
                    .batched(r as u64, false);
                let planned = pipeshard_core::workload::scratch_bytes(&spec, &wl, wl.decode_step(15));
                let exec = scratch_layout(&d, r, r, ctx as usize, 0);
                assert!(exec.attn_splits > 1, "{name} {ctx}: decode splits the keys");
                assert!(
                    exec.bytes as u64 <= planned,
                    "{name} ctx {ctx} batch {r}: exec {} > planned {planned}",
                    exec.bytes
                );
            }
        }
    }
}
