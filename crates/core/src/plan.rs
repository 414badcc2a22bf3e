//! Plans: where every placement unit lives in each phase, how deep the copy pipeline runs, and the VRAM
//! breakdown that must fit the budget.
//!
//! The pipeline depth is a property of a phase, not of a unit: all streamed units of a phase share one ring of
//! `pipeline_depth` slots of `slot_bytes` each (the largest streamed unit), so storing a depth per unit would
//! only allow inconsistent plans. KV units use the same [`Placement`]: `Pinned` = resident in VRAM, `Streamed`
//! = kept on the host and uploaded into a slot before each use (the paper's streamed-attention layers), `Cpu` =
//! kept on the host and read by CPU attention.

use serde::{Deserialize, Serialize};

use crate::inventory::{Inventory, UnitId};
use crate::model::WeightFormat;
use crate::workload::Workload;

/// The plan schema version this build reads and writes.
pub const PLAN_SCHEMA_VERSION: u32 = 1;

/// Copies our executor's ring issues ahead of the units that consume them (ring depth permitting); the
/// simulator's host enqueue of streamed units follows it. A layer's 128 streamed experts issued at once (a
/// depth-128 ring) ran every copy before the first expert's compute: q4_0 qwen3-30b-a3b@24L, pshard at 4 GB,
/// a layer's experts took 13.8 ms where 2 or 8 ahead took 10.9-11.6 ms (TTFT 360 -> 313-317 ms;
/// results/validation/2026-12-01-nvidia-h200/s12-exec-experiments). The compute had waited for the layer's
/// token lists, which went up only after the H2D stream's queue of copies (exec's `expert_inputs_stream`): 8
/// ahead shortened that queue where the host paced it. Not re-measured since the lists go up on the H2D
/// stream, ahead of the copies.
pub const RING_ISSUE_AHEAD: usize = 8;

/// Where a unit lives and runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Resident in VRAM for the whole phase; computes on the GPU.
    Pinned,
    /// Copied from pinned host memory into a ring slot just before use; computes on the GPU.
    Streamed,
    /// Stays in host memory; computes on the CPU.
    Cpu,
}

impl Placement {
    /// Whether the unit computes on the GPU.
    #[must_use]
    pub fn on_gpu(self) -> bool {
        !matches!(self, Placement::Cpu)
    }

    /// One-letter code for compact maps: P, S, C.
    #[must_use]
    pub fn code(self) -> char {
        match self {
            Placement::Pinned => 'P',
            Placement::Streamed => 'S',
            Placement::Cpu => 'C',
        }
    }
}

/// Which phase a phase plan serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    Prefill,
    Decode,
}

/// VRAM by category. Every byte the executor takes from its arena is in exactly one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct VramBreakdown {
    pub pinned_weights_bytes: u64,
    /// `pipeline_depth × slot_bytes`.
    pub streaming_slots_bytes: u64,
    pub kv_bytes: u64,
    pub scratch_bytes: u64,
    /// CUDA context, cuBLAS handle and workspace (measured by the profiler).
    pub runtime_overhead_bytes: u64,
}

impl VramBreakdown {
    /// The sum; it saturates at `u64::MAX` (over any budget), so a plan read from a file with absurd
    /// numbers fails its budget check instead of overflowing.
    #[must_use]
    pub fn total(&self) -> u64 {
        [self.streaming_slots_bytes, self.kv_bytes, self.scratch_bytes, self.runtime_overhead_bytes]
            .into_iter()
            .fold(self.pinned_weights_bytes, u64::saturating_add)
    }

    /// Category-wise maximum (peak by category over phases).
    #[must_use]
    pub fn max(&self, o: &VramBreakdown) -> VramBreakdown {
        VramBreakdown {
            pinned_weights_bytes: self.pinned_weights_bytes.max(o.pinned_weights_bytes),
            streaming_slots_bytes: self.streaming_slots_bytes.max(o.streaming_slots_bytes),
            kv_bytes: self.kv_bytes.max(o.kv_bytes),
            scratch_bytes: self.scratch_bytes.max(o.scratch_bytes),
            runtime_overhead_bytes: self.runtime_overhead_bytes.max(o.runtime_overhead_bytes),
        }
    }
}

/// A unit and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitPlacement {
    pub unit: UnitId,
    pub placement: Placement,
}

/// The plan of one phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhasePlan {
    pub phase: PhaseKind,
    /// Largest token count per step this plan is sized for (ubatch for prefill, batch for decode).
    pub tier_tokens: u64,
    /// Streaming ring slots (0 when nothing streams).
    pub pipeline_depth: u32,
    /// Bytes of one ring slot (the largest streamed unit, KV included).
    pub slot_bytes: u64,
    /// Every unit of the inventory, in inventory order.
    pub placements: Vec<UnitPlacement>,
    /// llama.cpp op offload: in prefill, CPU-resident matmul weights are copied to the GPU per ubatch and the
    /// matmul runs there (not overlapped). Only the `ngl` baseline sets it.
    pub op_offload: bool,
    pub cpu_threads: u32,
    pub vram: VramBreakdown,
}

/// What one ring slot carries: a streamed unit, or a streamed attention together with its streamed KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamGroup {
    /// One unit, or `[Attn { l }, Kv { l }]`.
    pub units: Vec<UnitId>,
    /// Bytes copied into the slot.
    pub bytes: u64,
}

impl PhasePlan {
    /// The streamed units in execution order, grouped by the slot they occupy. A layer whose attention and KV
    /// are both streamed uploads them into ONE slot (as the paper's streamed-attention split carries its KV),
    /// so its slot must hold both; every other streamed unit (KV of a KV-streamed layer whose attention is
    /// pinned, an expert, an FFN …) has a slot of its own. `kv_layer_bytes` is the KV of one layer for the
    /// allocated context ([`Workload::kv_bytes_per_layer_of`]). Planner, simulator and executor all use this.
    #[must_use]
    pub fn stream_groups(&self, inv: &Inventory, kv_layer_bytes: u64) -> Vec<StreamGroup> {
        let mut groups: Vec<StreamGroup> = Vec::new();
        for up in self.placements.iter().filter(|u| u.placement == Placement::Streamed) {
            let bytes =
                if matches!(up.unit, UnitId::Kv { .. }) { kv_layer_bytes } else { inv.unit_bytes(up.unit) };
            // The layer's KV comes after its FFN in inventory order; it joins the attention's slot.
            if let UnitId::Kv { layer } = up.unit
                && let Some(attn) = groups.iter_mut().rev().find(|g| g.units == [UnitId::Attn { layer }])
            {
                attn.units.push(up.unit);
                attn.bytes += bytes;
                continue;
            }
            groups.push(StreamGroup { units: vec![up.unit], bytes });
        }
        groups
    }

    /// Whether every group of [`PhasePlan::stream_groups`] fits a slot, without building them (each unit placed
    /// once): a streamed unit alone, or a streamed attention with its layer's streamed KV.
    #[must_use]
    pub fn stream_groups_fit(&self, inv: &Inventory, kv_layer_bytes: u64) -> bool {
        let in_order = self.placements.len() == inv.units.len();
        // Bytes of each layer's streamed attention seen so far (its KV comes after it and joins its slot).
        let mut attn_bytes: Vec<Option<u64>> = Vec::new();
        for (i, up) in self.placements.iter().enumerate().filter(|(_, u)| u.placement == Placement::Streamed)
        {
            let bytes = match up.unit {
                UnitId::Kv { layer } => {
                    attn_bytes.get(layer as usize).copied().flatten().unwrap_or(0) + kv_layer_bytes
                }
                u if in_order && inv.units[i].id == u => inv.units[i].weight_bytes,
                u => inv.unit_bytes(u),
            };
            if bytes > self.slot_bytes {
                return false;
            }
            if let UnitId::Attn { layer } = up.unit {
                let l = layer as usize;
                if attn_bytes.len() <= l {
                    attn_bytes.resize(l + 1, None);
                }
                attn_bytes[l] = Some(bytes);
            }
        }
        true
    }

    /// Placement of `unit` (linear scan; consumers on a hot path index by inventory position instead).
    #[must_use]
    pub fn placement(&self, unit: UnitId) -> Option<Placement> {
        self.placements.iter().find(|p| p.unit == unit).map(|p| p.placement)
    }
}

/// What a planner predicted for its plan under its own cost model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub ttft_ns: u64,
    pub decode_step_ns: u64,
    pub e2el_ns: u64,
}

/// A complete plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub schema_version: u32,
    pub planner: String,
    pub model: String,
    /// The storage formats the plan was made for: `model` resolves to its own formats (a catalog model's are
    /// the paper's), which `--weights` may have replaced, and every unit's bytes follow from them. `None` in
    /// plans saved before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightFormat>,
    pub budget_bytes: u64,
    pub workload: Workload,
    pub prefill: PhasePlan,
    pub decode: PhasePlan,
    /// Bytes re-uploaded when switching from the prefill plan to the decode plan (weights pinned in decode
    /// but not in prefill, plus KV of layers that become GPU-resident).
    pub switch_bytes: u64,
    pub prediction: Option<Prediction>,
    /// Planner-specific facts worth showing (strategy chosen, pinned-prefix length …).
    pub notes: Vec<String>,
}

/// A plan that breaks an invariant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanInvalid {
    #[error("{phase:?} plan: unit {unit} is placed {count} times (expected exactly once)")]
    Placement { phase: PhaseKind, unit: String, count: usize },
    #[error("{phase:?} plan names unit {unit}, which the model does not have")]
    UnknownUnit { phase: PhaseKind, unit: String },
    #[error("{phase:?} plan needs {needed} bytes of VRAM, over the budget of {budget} by {over}")]
    OverBudget { phase: PhaseKind, needed: u64, budget: u64, over: u64 },
    #[error("{phase:?} plan: {reason}")]
    Inconsistent { phase: PhaseKind, reason: String },
    #[error("plan schema_version {found}, this build reads {expected}")]
    Version { found: u32, expected: u32 },
}

impl Plan {
    /// Both phase plans.
    #[must_use]
    pub fn phases(&self) -> [&PhasePlan; 2] {
        [&self.prefill, &self.decode]
    }

    /// Peak VRAM over phases (the larger total).
    #[must_use]
    pub fn peak_vram_bytes(&self) -> u64 {
        self.prefill.vram.total().max(self.decode.vram.total())
    }

    /// The same plan with `depth` ring slots in every phase that streams (phases that stream nothing keep no
    /// ring). The slots grow or shrink with it, the prediction is dropped (it was for the planner's depth) and
    /// the result is checked, so a depth that does not fit the budget is an `OverBudget` error.
    pub fn with_pipeline_depth(&self, depth: u32, inv: &Inventory) -> Result<Plan, PlanInvalid> {
        let mut plan = self.clone();
        for p in [&mut plan.prefill, &mut plan.decode] {
            if p.pipeline_depth > 0 {
                p.pipeline_depth = depth;
                p.vram.streaming_slots_bytes = u64::from(p.pipeline_depth).saturating_mul(p.slot_bytes);
            }
        }
        if plan != *self {
            plan.prediction = None;
            plan.notes.push(format!(
                "pipeline depth set to {depth} (planner chose {}/{})",
                self.prefill.pipeline_depth, self.decode.pipeline_depth
            ));
        }
        plan.validate(inv)?;
        Ok(plan)
    }

    /// Checks the invariants every consumer relies on: each unit exactly once per phase, KV consistent with
    /// attention, slots large enough, and the breakdown within budget.
    pub fn validate(&self, inv: &Inventory) -> Result<(), PlanInvalid> {
        if self.schema_version != PLAN_SCHEMA_VERSION {
            return Err(PlanInvalid::Version { found: self.schema_version, expected: PLAN_SCHEMA_VERSION });
        }
        for p in self.phases() {
            // Plans list every unit in inventory order (as planners write them): then each is placed exactly
            // once, and nothing needs looking up.
            let in_order = p.placements.len() == inv.units.len()
                && p.placements.iter().zip(&inv.units).all(|(up, u)| up.unit == u.id);
            if !in_order {
                let mut counts = vec![0usize; inv.units.len()];
                for up in &p.placements {
                    let i = inv.position(up.unit).ok_or_else(|| PlanInvalid::UnknownUnit {
                        phase: p.phase,
                        unit: up.unit.to_string(),
                    })?;
                    counts[i] += 1;
                }
                if let Some((i, &c)) = counts.iter().enumerate().find(|(_, c)| **c != 1) {
                    return Err(PlanInvalid::Placement {
                        phase: p.phase,
                        unit: inv.units[i].id.to_string(),
                        count: c,
                    });
                }
            }
            let inconsistent = |reason: String| Err(PlanInvalid::Inconsistent { phase: p.phase, reason });
            let streamed: Vec<&UnitPlacement> =
                p.placements.iter().filter(|u| u.placement == Placement::Streamed).collect();
            if !streamed.is_empty() && p.pipeline_depth == 0 {
                return inconsistent("units are streamed but pipeline_depth is 0".into());
            }
            if Some(p.vram.streaming_slots_bytes) != u64::from(p.pipeline_depth).checked_mul(p.slot_bytes) {
                return inconsistent(format!(
                    "streaming_slots_bytes {} ≠ pipeline_depth {} × slot_bytes {}",
                    p.vram.streaming_slots_bytes, p.pipeline_depth, p.slot_bytes
                ));
            }
            let kv_layer_bytes = self.workload.kv_bytes_per_layer_of(inv);
            // The groups are built (one allocation each) only to name the one that does not fit.
            let groups = if p.stream_groups_fit(inv, kv_layer_bytes) {
                Vec::new()
            } else {
                p.stream_groups(inv, kv_layer_bytes)
            };
            for g in groups {
                if g.bytes > p.slot_bytes {
                    let names: Vec<String> = g.units.iter().map(ToString::to_string).collect();
                    return inconsistent(format!(
                        "{} ({} bytes) does not fit a {}-byte slot",
                        names.join(" + "),
                        g.bytes,
                        p.slot_bytes
                    ));
                }
            }
            // Each unit is placed once (checked above), so one pass finds every layer's attention.
            let mut attn_of_layer: Vec<Placement> = Vec::new();
            for up in &p.placements {
                if let UnitId::Attn { layer } = up.unit {
                    let l = layer as usize;
                    if attn_of_layer.len() <= l {
                        attn_of_layer.resize(l + 1, Placement::Cpu);
                    }
                    attn_of_layer[l] = up.placement;
                }
            }
            for up in &p.placements {
                if let UnitId::Kv { layer } = up.unit {
                    let attn = attn_of_layer.get(layer as usize).copied().unwrap_or(Placement::Cpu);
                    if attn.on_gpu() != up.placement.on_gpu() {
                        return inconsistent(format!(
                            "layer {layer}: attention is {attn:?} but its KV is {:?}; KV must be on the side that runs attention",
                            up.placement
                        ));
                    }
                }
            }
            let needed = p.vram.total();
            if needed > self.budget_bytes {
                return Err(PlanInvalid::OverBudget {
                    phase: p.phase,
                    needed,
                    budget: self.budget_bytes,
                    over: needed - self.budget_bytes,
                });
            }
        }
        Ok(())
    }

    /// Reads a plan from JSON; `file` names the source in errors.
    pub fn from_json(file: &str, json: &str) -> Result<Plan, String> {
        let plan: Plan = serde_json::from_str(json).map_err(|e| format!("{file}: not a valid plan: {e}"))?;
        if plan.schema_version != PLAN_SCHEMA_VERSION {
            return Err(format!(
                "{file}: plan schema_version {}, this build reads {PLAN_SCHEMA_VERSION}",
                plan.schema_version
            ));
        }
        plan.workload.validate().map_err(|e| format!("{file}: {e}"))?;
        Ok(plan)
    }

    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans serialise")
    }
}

impl Workload {
    /// KV bytes of one layer, for a plan checked without its spec: derived from the inventory's attention
    /// shapes (k and v projections' output rows).
    #[must_use]
    pub fn kv_bytes_per_layer_of(&self, inv: &Inventory) -> u64 {
        let kv_dim = inv.tensors.iter().find(|t| t.name == "blk.0.attn_k.weight").map_or(0, |t| t.shape[0]);
        // Saturating: a plan file's workload may be absurd; a saturated size fails every slot and budget check.
        self.kv_dtype
            .tensor_bytes(kv_dim.saturating_mul(2), 1)
            .unwrap_or(kv_dim.saturating_mul(4))
            .saturating_mul(self.ctx)
            .saturating_mul(self.batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::inventory::Inventory;
    use crate::{GIB, MIB};

    fn phase(inv: &Inventory, phase: PhaseKind, place: impl Fn(UnitId) -> Placement) -> PhasePlan {
        PhasePlan {
            phase,
            tier_tokens: 512,
            pipeline_depth: 0,
            slot_bytes: 0,
            placements: inv
                .units
                .iter()
                .map(|u| UnitPlacement { unit: u.id, placement: place(u.id) })
                .collect(),
            op_offload: false,
            cpu_threads: 16,
            vram: VramBreakdown {
                scratch_bytes: 100 * MIB,
                runtime_overhead_bytes: 500 * MIB,
                ..VramBreakdown::default()
            },
        }
    }

    fn plan() -> (Plan, Inventory) {
        let spec = catalog::get("qwen3-30b-a3b").unwrap().truncated(2).unwrap();
        let inv = Inventory::new(&spec);
        let p = Plan {
            schema_version: PLAN_SCHEMA_VERSION,
            planner: "test".into(),
            model: spec.name.clone(),
            weights: Some(spec.weights.clone()),
            budget_bytes: GIB,
            workload: Workload::single(1000, 2048, 100, 512),
            prefill: phase(&inv, PhaseKind::Prefill, |_| Placement::Cpu),
            decode: phase(&inv, PhaseKind::Decode, |_| Placement::Cpu),
            switch_bytes: 0,
            prediction: None,
            notes: vec![],
        };
        (p, inv)
    }

    #[test]
    fn an_all_cpu_plan_is_valid_and_round_trips() {
        let (p, inv) = plan();
        p.validate(&inv).unwrap();
        let back = Plan::from_json("p.json", &p.to_json()).unwrap();
        assert_eq!(back, p);
        assert!(Plan::from_json("p.json", "{}").unwrap_err().contains("p.json"));
    }

    /// Fuzzing found them: a plan file's numbers overflowed `ctx × batch × KV`, `depth × slot_bytes` and the
    /// VRAM sum. Each is now an error naming the field.
    #[test]
    fn absurd_numbers_in_a_plan_file_are_errors() {
        let (p, inv) = plan();
        let json = p.to_json();
        let e = Plan::from_json("p.json", &json.replace(r#""ctx": 2048"#, r#""ctx": 18446744073709551615"#))
            .unwrap_err();
        assert!(e.contains("p.json") && e.contains("`ctx` = 18446744073709551615"), "{e}");
        let e = Plan::from_json(
            "p.json",
            &json.replace(r#""gen_tokens": 100"#, r#""gen_tokens": 18446744073709551615"#),
        )
        .unwrap_err();
        assert!(e.contains("`gen_tokens`"), "{e}");

        let (mut p, inv2) = plan();
        p.decode.pipeline_depth = u32::MAX;
        p.decode.slot_bytes = u64::MAX / 2;
        assert!(p.validate(&inv2).unwrap_err().to_string().contains("streaming_slots_bytes"));

        let mut p = Plan::from_json("p.json", &json).unwrap();
        p.decode.vram.kv_bytes = u64::MAX;
        p.decode.vram.pinned_weights_bytes = u64::MAX;
        assert_eq!(p.peak_vram_bytes(), u64::MAX);
        assert!(matches!(p.validate(&inv), Err(PlanInvalid::OverBudget { .. })));
    }

    #[test]
    fn broken_plans_are_rejected_with_the_reason() {
        let (mut p, inv) = plan();
        p.budget_bytes = 500 * MIB;
        assert!(matches!(p.validate(&inv), Err(PlanInvalid::OverBudget { over, .. }) if over == 100 * MIB));

        let (mut p, inv) = plan();
        p.decode.placements.pop();
        assert!(p.validate(&inv).unwrap_err().to_string().contains("placed 0 times"));

        let (mut p, inv) = plan();
        let dup = p.prefill.placements[3];
        p.prefill.placements.push(dup);
        assert!(p.validate(&inv).unwrap_err().to_string().contains("placed 2 times"));

        let (mut p, inv) = plan();
        p.decode = phase(&inv, PhaseKind::Decode, |u| {
            if matches!(u, UnitId::Attn { .. }) { Placement::Pinned } else { Placement::Cpu }
        });
        assert!(p.validate(&inv).unwrap_err().to_string().contains("KV must be on the side"));

        let (mut p, inv) = plan();
        p.decode = phase(&inv, PhaseKind::Decode, |u| {
            if matches!(u, UnitId::Expert { .. }) { Placement::Streamed } else { Placement::Cpu }
        });
        assert!(p.validate(&inv).unwrap_err().to_string().contains("pipeline_depth is 0"));
        let expert = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 });
        p.decode.pipeline_depth = 2;
        p.decode.slot_bytes = expert - 1;
        p.decode.vram.streaming_slots_bytes = 2 * (expert - 1);
        assert!(p.validate(&inv).unwrap_err().to_string().contains("does not fit"));
        p.decode.slot_bytes = expert;
        p.decode.vram.streaming_slots_bytes = 2 * expert;
        p.validate(&inv).unwrap();
    }

    #[test]
    fn pipeline_depth_can_be_set_within_the_budget() {
        let (mut p, inv) = plan();
        p.decode = phase(&inv, PhaseKind::Decode, |u| {
            if matches!(u, UnitId::Expert { .. }) { Placement::Streamed } else { Placement::Cpu }
        });
        let expert = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 });
        (p.decode.pipeline_depth, p.decode.slot_bytes) = (2, expert);
        p.decode.vram.streaming_slots_bytes = 2 * expert;
        let deeper = p.with_pipeline_depth(3, &inv).unwrap();
        assert_eq!((deeper.decode.pipeline_depth, deeper.decode.vram.streaming_slots_bytes), (3, 3 * expert));
        // The prefill phase streams nothing, so it keeps no ring.
        assert_eq!((deeper.prefill.pipeline_depth, deeper.prefill.vram.streaming_slots_bytes), (0, 0));
        assert!(deeper.notes.iter().any(|n| n.contains("set to 3")));
        assert_eq!(p.with_pipeline_depth(2, &inv).unwrap(), p, "the planner's own depth changes nothing");
        let spare = p.budget_bytes - p.decode.vram.total();
        let too_deep = 2 + u32::try_from(spare / expert).unwrap() + 1;
        assert!(matches!(p.with_pipeline_depth(too_deep, &inv), Err(PlanInvalid::OverBudget { .. })));
        assert!(p.with_pipeline_depth(0, &inv).unwrap_err().to_string().contains("pipeline_depth is 0"));
    }

    #[test]
    fn streamed_attention_carries_its_streamed_kv_in_one_slot() {
        let (mut p, inv) = plan();
        let kv = p.workload.kv_bytes_per_layer_of(&inv);
        p.decode = phase(&inv, PhaseKind::Decode, |u| match u {
            UnitId::Attn { .. } | UnitId::Kv { .. } | UnitId::Expert { expert: 0, .. } => Placement::Streamed,
            _ => Placement::Cpu,
        });
        let groups = p.decode.stream_groups(&inv, kv);
        let attn0 = inv.unit_bytes(UnitId::Attn { layer: 0 });
        assert_eq!(groups[0].units, vec![UnitId::Attn { layer: 0 }, UnitId::Kv { layer: 0 }]);
        assert_eq!(groups[0].bytes, attn0 + kv);
        assert_eq!(groups[1].units, vec![UnitId::Expert { layer: 0, expert: 0 }]);
        assert_eq!(groups.len(), 4);
        p.decode.pipeline_depth = 1;
        p.decode.slot_bytes = attn0 + kv - 1;
        p.decode.vram.streaming_slots_bytes = p.decode.slot_bytes;
        assert!(p.validate(&inv).unwrap_err().to_string().contains("blk.0.attn + blk.0.kv"));
    }

    /// `validate` skips lookups for plans in inventory order and builds no stream groups when all fit: its
    /// verdict must be the one the full checks give, in and out of order, at every slot size around the
    /// groups' sizes.
    #[test]
    fn the_checks_of_ordered_plans_agree_with_the_full_checks() {
        let (mut p, inv) = plan();
        let kv = p.workload.kv_bytes_per_layer_of(&inv);
        p.decode = phase(&inv, PhaseKind::Decode, |u| match u {
            UnitId::Attn { layer: 0 } | UnitId::Kv { .. } | UnitId::Expert { expert: 0..3, .. } => {
                Placement::Streamed
            }
            UnitId::Attn { .. } => Placement::Pinned,
            _ => Placement::Cpu,
        });
        let groups = p.decode.stream_groups(&inv, kv);
        let mut sizes: Vec<u64> = groups.iter().flat_map(|g| [g.bytes - 1, g.bytes, g.bytes + 1]).collect();
        sizes.sort_unstable();
        let mut fits_seen = [false; 2];
        for slot in sizes {
            (p.decode.pipeline_depth, p.decode.slot_bytes) = (1, slot);
            p.decode.vram.streaming_slots_bytes = slot;
            let all_fit = groups.iter().all(|g| g.bytes <= slot);
            fits_seen[usize::from(all_fit)] = true;
            assert_eq!(p.decode.stream_groups_fit(&inv, kv), all_fit, "slot {slot}");
            let ordered = p.validate(&inv).map_err(|e| e.to_string());
            let mut reversed = p.clone();
            reversed.decode.placements.reverse();
            // Reversed, a KV precedes its attention and so gets a slot of its own: compare the verdict only
            // where the groups are the same, i.e. with the attention pinned.
            let plain = reversed.decode.stream_groups(&inv, kv).iter().all(|g| g.bytes <= slot);
            assert_eq!(reversed.decode.stream_groups_fit(&inv, kv), plain, "slot {slot}, reversed");
            assert_eq!(ordered.is_ok(), all_fit, "slot {slot}: {ordered:?}");
        }
        assert_eq!(fits_seen, [true, true], "both verdicts were tested");

        // Out of order, the unit checks still name what is wrong.
        let (mut p, inv) = plan();
        p.prefill.placements.swap(0, 1);
        p.validate(&inv).unwrap();
        let moved = p.prefill.placements.remove(2);
        p.prefill.placements.insert(0, UnitPlacement { unit: UnitId::Attn { layer: 7 }, ..moved });
        assert!(p.validate(&inv).unwrap_err().to_string().contains("blk.7.attn"));
    }
}
