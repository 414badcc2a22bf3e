//! `exhaustive`: every placement of every group, every split of every layer's routed experts and every depth in
//! [`DEPTHS`], for small (truncated) models; the oracle the tests hold `ilp` to.
//!
//! Each phase's layouts are enumerated and scored with the estimator (layouts that stream nothing are scored
//! once, without a depth); the pair of phase layouts is then found by branch and bound over the two sorted
//! lists, exactly (the switch cost only ever adds). The space is the one `greedy` and `ilp` search
//! ([`crate::space`]), so on any cell `exhaustive` and `ilp` agree up to the solver's tolerances. Scratch as
//! in `greedy` (no margin).
//!
//! A space larger than [`Exhaustive::max_layouts`] per phase is refused with [`PlanError::Unsupported`],
//! naming its size: truncate the model (`ModelSpec::truncated`, `pipeshard plan --layers N`) or use `ilp`.

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Plan, Prediction};
use pipeshard_core::workload::Workload;

use crate::estimate::{Estimator, Layout, objective_ns};
use crate::space::{DEPTHS, Space};
use crate::{Decision, Objective, PlanError, Planner, assemble, check_runtime_fits};

/// The exhaustive planner (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhaustive {
    pub objective: Objective,
    /// Largest number of layouts per phase (placements × expert splits × depths) it accepts.
    pub max_layouts: u64,
    /// Largest ring depth it may use (1 or 2; see [`DEPTHS`]).
    pub max_depth: u32,
}

impl Default for Exhaustive {
    fn default() -> Self {
        Exhaustive { objective: Objective::E2el, max_layouts: 200_000, max_depth: DEPTHS[DEPTHS.len() - 1] }
    }
}

/// Layouts per phase of a space: the product of every group's choices and every expert layer's splits, times
/// the depths (a float: large models have more than 2^64).
#[must_use]
pub fn space_size(est: &Estimator, space: &Space) -> f64 {
    let mut n = DEPTHS.len() as f64;
    for g in 0..space.groups.len() {
        n *= space.choices(g).len() as f64;
    }
    for &l in &space.expert_layers {
        let e = est.structure.layers[l].experts.len() as f64;
        n *= (e + 1.0) * (e + 2.0) / 2.0;
    }
    n
}

impl Planner for Exhaustive {
    fn name(&self) -> &'static str {
        "exhaustive"
    }

    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        workload.validate()?;
        let inv = Inventory::shared(spec);
        let est = Estimator::new(spec, &inv, workload, cost);
        let space = Space::new(&est.structure);
        let size = space_size(&est, &space);
        if size > self.max_layouts as f64 {
            return Err(PlanError::Unsupported {
                planner: self.name().into(),
                reason: format!(
                    "{} has {size:.2e} layouts per phase ({} groups, {} layers of routed experts, {} depths), over \
                     the limit of {}; truncate the model to a few layers (`--layers 2`) or use the `ilp` planner",
                    spec.name,
                    space.groups.len(),
                    space.expert_layers.len(),
                    DEPTHS.len(),
                    self.max_layouts
                ),
            });
        }
        check_runtime_fits(budget_bytes, est.runtime_overhead_bytes)?;
        let pre = enumerate(&est, &space, PhaseKind::Prefill, budget_bytes, self.max_depth);
        let dec = enumerate(&est, &space, PhaseKind::Decode, budget_bytes, self.max_depth);
        let (prefill, decode) = best_pair(&est, self.objective, &pre, &dec);
        let notes = vec![
            format!("objective {}", self.objective.name()),
            format!("{} prefill and {} decode layouts fit the budget", pre.len(), dec.len()),
        ];
        Ok(assemble(
            self.name(),
            spec,
            &inv,
            &est,
            workload,
            budget_bytes,
            Decision::searched(&est, prefill, decode, notes),
        ))
    }
}

/// Every layout of a phase that fits the budget, with its time, sorted by time.
fn enumerate(
    est: &Estimator,
    space: &Space,
    phase: PhaseKind,
    budget: u64,
    max_depth: u32,
) -> Vec<(f64, Layout)> {
    let st = &est.structure;
    let n_groups = space.groups.len();
    // Mixed-radix digits: one per group, then one per expert layer (index into its (pinned, streamed) pairs).
    let mut radix: Vec<usize> = (0..n_groups).map(|g| space.choices(g).len()).collect();
    let splits: Vec<Vec<[u32; 3]>> = space
        .expert_layers
        .iter()
        .map(|&l| {
            let e = st.layers[l].experts.len() as u32;
            (0..=e).flat_map(|p| (0..=e - p).map(move |s| [p, s, e - p - s])).collect()
        })
        .collect();
    radix.extend(splits.iter().map(Vec::len));
    let mut digits = vec![0usize; radix.len()];
    let mut out = Vec::new();
    loop {
        let mut layout = Layout::all_cpu(st, est.unit_bytes.len());
        for (g, &d) in digits.iter().enumerate().take(n_groups) {
            space.apply(&mut layout, g, space.choices(g)[d]);
        }
        for (i, &l) in space.expert_layers.iter().enumerate() {
            layout.experts[l] = splits[i][digits[n_groups + i]];
        }
        let depths: Vec<u32> = if layout.streams(st) {
            DEPTHS.into_iter().filter(|&d| d <= max_depth).collect()
        } else {
            vec![0]
        };
        for depth in depths {
            layout.depth = depth;
            if est.vram(phase, &layout).total() <= budget {
                out.push((est.phase(phase, &layout, false).time_ns, layout.clone()));
            }
        }
        // Next combination.
        let mut i = 0;
        loop {
            if i == digits.len() {
                out.sort_by(|a, b| a.0.total_cmp(&b.0));
                return out;
            }
            digits[i] += 1;
            if digits[i] < radix[i] {
                break;
            }
            digits[i] = 0;
            i += 1;
        }
    }
}

/// The pair minimising the objective: both lists are sorted by time, and the switch only adds to a pair's
/// value, so each list is scanned only while its bound can still win.
fn best_pair(
    est: &Estimator,
    objective: Objective,
    pre: &[(f64, Layout)],
    dec: &[(f64, Layout)],
) -> (Layout, Layout) {
    let gen_tokens = est.gen_tokens as f64;
    let value = |tp: f64, td: f64, switch: f64| {
        objective_ns(
            objective,
            &Prediction {
                ttft_ns: tp.round() as u64,
                decode_step_ns: td.round() as u64,
                e2el_ns: (tp + switch + gen_tokens * td).round() as u64,
            },
        )
    };
    let mut best: Option<(f64, usize, usize)> = None;
    for (j, (td, dl)) in dec.iter().enumerate() {
        if best.is_some_and(|b| value(pre[0].0, *td, 0.0) >= b.0) {
            break;
        }
        for (i, (tp, pl)) in pre.iter().enumerate() {
            if best.is_some_and(|b| value(*tp, *td, 0.0) >= b.0) {
                break;
            }
            let v = value(*tp, *td, est.switch_ns(est.switch_bytes(pl, dl)));
            if best.is_none_or(|b| v < b.0) {
                best = Some((v, i, j));
            }
        }
    }
    let (_, i, j) = best.expect("the all-CPU layout always fits a budget the runtime fits");
    (pre[i].1.clone(), dec[j].1.clone())
}
