//! pipeshard-planner: decides, for a model, a workload and a VRAM budget, where every placement unit lives in
//! each phase (prefill, decode) and how deep the copy pipeline runs.
//!
//! # Planners
//! All implement [`Planner`]; the binary picks one by name with [`by_name`] or [`with_options`].
//! - [`ngl`]: llama.cpp's `-ngl N` layer offload as the paper's baseline ran it (the last N layers on the GPU,
//!   op offload in prefill, no flash attention, no streaming), with N automatic or fixed.
//! - [`pshard`]: the paper's planner, faithfully: five execution strategies, pinned-prefix binary searches, its
//!   VRAM formula (1.5× scratch margin, full-context KV) and its own throughput predictor to pick a strategy
//!   per token tier.
//! - [`greedy`]: benefit per VRAM byte, per phase and pipeline depth.
//! - [`ilp`]: a mixed-integer program (good_lp + HiGHS) over the same model the estimator evaluates, solved
//!   to a 0.1 % gap: one solve per plan, identical layers planned by count; then the simulator chooses among
//!   variants of its and greedy's layouts ([`judge`]).
//! - [`exhaustive`]: enumerates every placement and depth of small (truncated) models; an oracle for tests.
//! - [`vision`]: the encode phase of a VLM request (tower weights pinned / streamed / on the CPU, materialised,
//!   flash or query-tiled attention), with the VLMOpt measures one by one; its language phases use the above.
//!
//! # Shared pieces
//! [`estimate`] holds the analytic estimator: per-unit GPU, CPU and copy times of each phase and a pipeline
//! estimate of a placement (TTFT over all prefill chunks, one decode step). `greedy`, `ilp` and `exhaustive`
//! optimise it, so `ilp` is never worse than `greedy` under it; `pshard` predicts with the paper's formula.
//! [`space`] is the decision space those three share (attention + router + KV, FFN, counts of routed experts
//! per layer, output head).
//!
//! # Decisions
//! - The VRAM budget is what the process may use: every plan's breakdown includes the runtime overhead, and
//!   `vram.total() <= budget` in both phases. (The paper's `-mva` excludes the CUDA context; to reproduce a
//!   paper cell, pass its budget plus the profile's runtime overhead.)
//! - Scratch margins differ by planner and are documented on each: `greedy`/`ilp`/`exhaustive` charge
//!   [`pipeshard_core::workload::scratch_bytes`] as is, `pshard` the paper's 1.5×, `ngl` llama.cpp's compute
//!   buffer without flash attention.
//! - Infeasible budgets give [`PlanError::Infeasible`] with the budget of the smallest plan that works.
//!
//! It depends on pipeshard-core, pipeshard-sim ([`judge`]: `ilp` lets the simulator choose among its candidate
//! plans) and good_lp for the ILP; it must never depend on exec, profiler or cudarc.

pub mod estimate;
pub mod exhaustive;
pub mod greedy;
pub mod ilp;
pub mod judge;
pub mod ngl;
pub mod pshard;
pub mod space;
pub mod vision;

use std::sync::Arc;

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PLAN_SCHEMA_VERSION, PhaseKind, Plan, Prediction, VramBreakdown};
use pipeshard_core::workload::{Workload, WorkloadError};

use crate::estimate::{Estimator, Layout};

/// Why no plan came out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No plan of this planner fits; `min_budget_bytes` is what its smallest working plan needs.
    #[error(
        "a VRAM budget of {budget_bytes} bytes is too small: the smallest plan needs {min_budget_bytes} bytes \
         (scratch {} + one streaming slot {} + KV {} + runtime overhead {} + pinned {}); raise the budget to at least {min_budget_bytes}",
        min.scratch_bytes, min.streaming_slots_bytes, min.kv_bytes, min.runtime_overhead_bytes, min.pinned_weights_bytes
    )]
    Infeasible { budget_bytes: u64, min_budget_bytes: u64, min: VramBreakdown },
    /// The workload itself is invalid.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The planner cannot handle this model or workload; `reason` says why and what to do instead.
    #[error("planner `{planner}`: {reason}")]
    Unsupported { planner: String, reason: String },
    /// The MILP solver failed (not an infeasible budget: every budget that fits the runtime has a plan).
    #[error("planner `{planner}`: the solver failed: {reason}")]
    Solver { planner: String, reason: String },
}

/// A placement planner.
pub trait Planner: Send + Sync {
    /// Short name used on the command line (`ngl`, `pshard`, `greedy`, `ilp`, `exhaustive`).
    fn name(&self) -> &str;
    /// A plan for `spec` running `workload` within `budget_bytes` of VRAM, costed with `cost`.
    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError>;
}

/// What a searching planner (`greedy`, `ilp`, `exhaustive`) minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Time to first token (all prefill chunks).
    Ttft,
    /// Decode throughput (minimises the decode step time).
    Tps,
    /// End-to-end latency: TTFT + gen_tokens × decode step time.
    #[default]
    E2el,
}

/// Settings a caller may pass to [`with_options`]; the defaults are what [`by_name`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlannerOptions {
    /// Objective of `greedy`, `ilp` and `exhaustive`.
    pub objective: Objective,
    /// `ngl` only: offload exactly this many layers (llama.cpp `-ngl N`) instead of the largest N that fits.
    pub ngl_layers: Option<u32>,
    /// `ngl` only: run the baseline with flash attention (`-fa`, as the paper's batched runs do and the executor
    /// needs).
    pub ngl_flash_attn: bool,
    /// `ngl` only: count the CPU output head llama.cpp's reserve graph stages on the GPU (see [`ngl::Ngl`]).
    pub ngl_reserve_cpu_head: bool,
}

/// Names [`by_name`] accepts, in the order the CLI lists them.
pub const NAMES: [&str; 5] = ["ngl", "pshard", "greedy", "ilp", "exhaustive"];

/// The planner called `name` with its default settings (`ngl` picks N automatically; `ilp` minimises E2EL),
/// or `None` for an unknown name (see [`NAMES`]).
#[must_use]
pub fn by_name(name: &str) -> Option<Box<dyn Planner>> {
    with_options(name, &PlannerOptions::default())
}

/// The planner called `name` configured by `options` (fields that do not apply to it are ignored), or `None`
/// for an unknown name.
#[must_use]
pub fn with_options(name: &str, options: &PlannerOptions) -> Option<Box<dyn Planner>> {
    Some(match name {
        "ngl" => Box::new(ngl::Ngl {
            fixed_layers: options.ngl_layers,
            flash_attn: options.ngl_flash_attn,
            reserve_cpu_head: options.ngl_reserve_cpu_head,
        }),
        "pshard" => Box::new(pshard::Pshard::default()),
        "greedy" => Box::new(greedy::Greedy { objective: options.objective, ..greedy::Greedy::default() }),
        "ilp" => Box::new(ilp::Ilp { objective: options.objective, ..ilp::Ilp::default() }),
        "exhaustive" => Box::new(exhaustive::Exhaustive {
            objective: options.objective,
            ..exhaustive::Exhaustive::default()
        }),
        _ => return None,
    })
}

impl Objective {
    /// Command-line names, in order.
    pub const NAMES: [&str; 3] = ["ttft", "tps", "e2el"];

    /// The objective called `name` (`ttft`, `tps`, `e2el`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Objective> {
        match name {
            "ttft" => Some(Objective::Ttft),
            "tps" => Some(Objective::Tps),
            "e2el" => Some(Objective::E2el),
            _ => None,
        }
    }

    /// The command-line name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Objective::Ttft => "ttft",
            Objective::Tps => "tps",
            Objective::E2el => "e2el",
        }
    }
}

/// The smallest plan any placement planner can make: everything on the CPU, only the runtime on the GPU.
pub(crate) fn check_runtime_fits(budget_bytes: u64, runtime_overhead_bytes: u64) -> Result<(), PlanError> {
    if budget_bytes < runtime_overhead_bytes {
        let min = VramBreakdown { runtime_overhead_bytes, ..VramBreakdown::default() };
        return Err(PlanError::Infeasible { budget_bytes, min_budget_bytes: min.total(), min });
    }
    Ok(())
}

/// The common start of a searching planner: a valid workload, the inventory, the estimator, and a budget that
/// holds at least the runtime.
pub(crate) fn prepare(
    spec: &ModelSpec,
    workload: &Workload,
    cost: &dyn CostModel,
    budget_bytes: u64,
) -> Result<(Arc<Inventory>, Estimator), PlanError> {
    workload.validate()?;
    let inv = Inventory::shared(spec);
    let est = Estimator::new(spec, &inv, workload, cost);
    check_runtime_fits(budget_bytes, est.runtime_overhead_bytes)?;
    Ok((inv, est))
}

/// What a planner decided, ready to become a [`Plan`].
pub(crate) struct Decision {
    pub prefill: Layout,
    pub decode: Layout,
    pub prefill_vram: VramBreakdown,
    pub decode_vram: VramBreakdown,
    pub prefill_op_offload: bool,
    /// llama.cpp's op offload in decode: only the `ngl` baseline, when a step decodes enough sequences.
    pub decode_op_offload: bool,
    pub prediction: Prediction,
    pub notes: Vec<String>,
}

impl Decision {
    /// The decision of a searching planner (greedy, ilp, exhaustive): both layouts on the GPU-side formats
    /// with the estimator's VRAM and prediction, no op offload.
    pub(crate) fn searched(est: &Estimator, prefill: Layout, decode: Layout, notes: Vec<String>) -> Decision {
        Decision {
            prefill_vram: est.vram(PhaseKind::Prefill, &prefill),
            decode_vram: est.vram(PhaseKind::Decode, &decode),
            prediction: est.predict(&prefill, &decode, false),
            prefill,
            decode,
            prefill_op_offload: false,
            decode_op_offload: false,
            notes,
        }
    }

    /// The same decision with llama.cpp's op offload in prefill (if `op_offload`): its VRAM and prediction.
    pub(crate) fn with_op_offload(mut self, est: &Estimator, op_offload: bool) -> Decision {
        if op_offload {
            self.prefill_op_offload = true;
            self.prefill_vram = est.vram_offload(PhaseKind::Prefill, &self.prefill, true);
            self.prediction = est.predict(&self.prefill, &self.decode, true);
        }
        self
    }
}

/// Assembles a plan from two layouts (switch bytes from the estimator).
pub(crate) fn assemble(
    planner: &str,
    spec: &ModelSpec,
    inv: &Inventory,
    est: &Estimator,
    workload: &Workload,
    budget_bytes: u64,
    d: Decision,
) -> Plan {
    Plan {
        schema_version: PLAN_SCHEMA_VERSION,
        planner: planner.into(),
        model: spec.name.clone(),
        weights: Some(spec.weights.clone()),
        budget_bytes,
        workload: *workload,
        prefill: est.phase_plan(inv, PhaseKind::Prefill, &d.prefill, d.prefill_vram, d.prefill_op_offload),
        decode: est.phase_plan(inv, PhaseKind::Decode, &d.decode, d.decode_vram, d.decode_op_offload),
        switch_bytes: est.switch_bytes(&d.prefill, &d.decode),
        prediction: Some(d.prediction),
        notes: d.notes,
    }
}
