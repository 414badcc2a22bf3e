//! `ilp`: the optimum of the estimator's model, as a small mixed-integer linear program (good_lp + HiGHS).
//!
//! # Formulation
//! The estimator's model does not depend on the order of layers, so identical layers (same bytes and costs in
//! both phases: every layer of a model, or two classes for qwen3-235b, whose `use_more_bits` layers store
//! `ffn_down` in more bits) are planned by **count**, which removes the symmetry that makes a per-layer
//! program hopeless (one binary per layer and option stalls HiGHS at a 1–5 % gap for seconds on a 32-layer
//! model). Per phase φ and class c of `n` layers, integers:
//! - `aP + aS + aC = n` layers with their attention group (attention, router, shared experts) pinned, streamed
//!   or on the CPU; `kP + kS = aP + aS` of them with their KV pinned or streamed;
//! - dense: `fP + fS + fC = n` FFNs; MoE: `eP + eS + eC = n·E` routed experts (counts, never 12 032
//!   binaries), with `eP + eS = E·g + r`, `g` full GPU-expert layers and `r ≤ (E−1)·partial` experts in one
//!   mixed layer integral, and the pinned/streamed split continuous (integer counts in the thousands slowed
//!   HiGHS several times): the split is rounded, then the neighbouring whole counts are tried under the
//!   estimator and the best that fits is kept;
//! - hand-offs: a layer whose attention and FFN (or experts) sit on different devices, or whose experts are
//!   split, costs two; with GPU layers arranged first, that is `2·|aG − fG|` (dense) or
//!   `2·(partial + (g − aG)⁺ + (aG − g − partial)⁺)` (MoE), linearised with auxiliaries;
//! - the output head's three binaries; `S ≥ bytes · [any streamed]` per kind; `any_gpu` binary.
//!
//! Constraints: `Σ pinned bytes + kv · Σ kP + slots · S + scratch · any_gpu + runtime ≤ budget`, and the
//! phase time `T_φ` above the compute, copy, occupancy and DRAM sums of [`crate::estimate`]. The ring depth is
//! part of the program (a binary per phase: one slot, or two, which the estimator's model never needs more
//! than; see [`DEPTHS`]), linearised with a big M, rather than enumerated outside it: that makes every plan one
//! solve, and a solve of the joint program takes a few hundred milliseconds on 2 cores where the 12 solves of an
//! outer enumeration took seconds. The phases are joined by the switch,
//! `Σ (pinned_dec − pinned_pre)⁺ · bytes` per kind (and the prompt's KV for each KV that becomes pinned), as
//! one large H2D copy. Objective (`--objective`): `ttft` = `T_pre`, `tps` = `T_dec`, `e2el` =
//! `T_pre + switch + gen · T_dec` (for `ttft` and `tps`, ties are broken by E2EL).
//!
//! # From counts to layers
//! Within a class, layers take placements in one rank order that spreads any first ranks through the class
//! (by the radical inverse of their index): for every kind, the first ranks are pinned, the next streamed, the
//! rest on the CPU, and routed experts fill layers in rank order the same way. So GPU attention and GPU FFN
//! share layers as much as the counts allow (the hand-off count above), a streamed attention and its streamed
//! KV share layers (and a slot), pinned sets of the two phases nest (the switch uploads exactly the
//! difference), and streamed layers are spread through the model. The estimate of the arranged plan equals the
//! program's value, up to that expert rounding.
//!
//! # Solving
//! HiGHS runs with one thread, presolve off, a relative gap of [`MIP_REL_GAP`] and a time limit
//! ([`Ilp::time_limit_s`]). The program's layouts, `greedy`'s and `pshard`'s (the paper's plan for the same cell),
//! with their variants, then go to the simulator, which picks the plan ([`crate::judge`]; the estimator cannot see order and timing). With
//! [`Ilp::simulate`] off, the plan is the program's unless `greedy`'s is better under the estimator (which
//! can only happen when a solve stops at its limit or within its gap); the notes say which. Scratch as in
//! `greedy` (no margin). Inside the program times are in milliseconds and bytes in MiB; the VRAM row keeps a
//! safety margin for the solver's tolerances (16 KiB, raised to 1 and 16 MiB if the rounded solution does not
//! fit), and the plan's breakdown is recomputed in bytes. `ttft` and `tps` take two solves: the phase's time,
//! then E2EL with that phase capped at the time found. A process keeps the answers to its last programs by
//! their exact data (HiGHS is deterministic), so cells that pose the same program (Figure 2's 1K prompts, one
//! chunk at either ubatch) solve it once.
//!
//! # Parallel requests
//! With R > 1 requests the KV layout is a choice too (core's `Workload::kv_unified`: one copy per sequence, or a
//! unified cache whose other sequences' cells a GPU attention scans masked); with [`Ilp::simulate`] on, both
//! layouts are planned and the simulator keeps the better plan (its notes give both times). Plans are for the
//! exact R.

use good_lp::solvers::SolutionStatus;
use good_lp::solvers::highs::highs;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use good_lp::{
    Constraint, Expression, IntoAffineExpression, ProblemVariables, ResolutionError, Solution, SolverModel,
    Variable, variable,
};
use pipeshard_core::MIB;
use pipeshard_core::cost::CostModel;
use pipeshard_core::fxhash::FxHashMap;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Placement, Plan};
use pipeshard_core::workload::Workload;
use pipeshard_sim::Simulator;

use crate::estimate::{Estimator, Layout, UnitCost, objective_ns};
use crate::judge::{Candidate, JUDGE_OPTIONS, Judge, MAX_JUDGED_DEPTH};
use crate::pshard::Pshard;
use crate::space::{DEPTHS, Space};
use crate::{Decision, Objective, PlanError, Planner, assemble, greedy, prepare};

/// The ILP planner (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ilp {
    pub objective: Objective,
    /// Wall-clock limit of one HiGHS solve, in seconds.
    pub time_limit_s: f64,
    /// Largest ring depth it may use: the program uses one or two slots (see [`DEPTHS`]) within it, the
    /// simulator's candidates ([`crate::judge`]) deeper rings up to it.
    pub max_depth: u32,
    /// Let the simulator choose among variants of the program's and greedy's plans ([`crate::judge`]); off,
    /// the plan is the program's (or greedy's, if better under the estimator).
    pub simulate: bool,
}

impl Default for Ilp {
    fn default() -> Self {
        Ilp { objective: Objective::E2el, time_limit_s: 5.0, max_depth: MAX_JUDGED_DEPTH, simulate: true }
    }
}

/// VRAM kept free for the solver's tolerances (MiB), tried in turn until the rounded solution fits.
const SAFETY_MIB: [f64; 3] = [1.0 / 64.0, 1.0, 16.0];
/// Relative optimality gap at which HiGHS stops.
pub const MIP_REL_GAP: f32 = 1e-3;
const NS_PER_MS: f64 = 1e6;
const PHASES: [PhaseKind; 2] = [PhaseKind::Prefill, PhaseKind::Decode];

impl Planner for Ilp {
    fn name(&self) -> &'static str {
        "ilp"
    }

    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        if workload.batch == 1 || !self.simulate {
            return self.plan_kv(spec, workload, cost, budget_bytes);
        }
        // Parallel requests: the KV layout is ours to choose too (one copy per sequence, or a unified cache
        // whose masked cells the GPU scans); the simulator judges the two plans.
        let mut best: Option<(f64, Plan)> = None;
        let mut times = Vec::new();
        for unified in [false, true] {
            let Ok(plan) = self.plan_kv(spec, &workload.batched(workload.batch, unified), cost, budget_bytes)
            else {
                continue;
            };
            let Ok(sim) = Simulator::new(spec, &plan, cost).map(|s| s.run(&JUDGE_OPTIONS)) else { continue };
            let m = &sim.metrics;
            let value = match self.objective {
                Objective::E2el => m.e2el_ns as f64,
                Objective::Ttft => m.ttft_ns as f64 + 1e-6 * m.e2el_ns as f64,
                Objective::Tps => m.decode_step_ns as f64 + 1e-6 * m.e2el_ns as f64,
            };
            times.push(format!("{}: {:.1} ms E2EL", kv_name(unified), m.e2el_ns as f64 / 1e6));
            if best.as_ref().is_none_or(|(v, _)| value < *v) {
                best = Some((value, plan));
            }
        }
        let Some((_, mut plan)) = best else {
            return self.plan_kv(spec, workload, cost, budget_bytes);
        };
        plan.notes.push(format!(
            "KV layout {} chosen by the simulator ({})",
            kv_name(plan.workload.kv_unified),
            times.join(", ")
        ));
        Ok(plan)
    }
}

fn kv_name(unified: bool) -> &'static str {
    if unified { "unified" } else { "per-sequence" }
}

impl Ilp {
    /// The plan for the workload's own KV layout.
    fn plan_kv(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        let (inv, est) = prepare(spec, workload, cost, budget_bytes)?;
        let space = Space::new(&est.structure);
        let classes = classes(&est);
        let solved = self.search(&est, &classes, budget_bytes)?;
        let mut notes = vec![format!(
            "objective {}; {} classes of identical layers",
            self.objective.name(),
            classes.len()
        )];
        let greedy = greedy::search(&est, &space, budget_bytes, self.objective, self.max_depth);
        let milp = if let Some(s) = solved {
            let status = if s.proven { "optimal within 0.1%" } else { "stopped at its time limit" };
            notes
                .push(format!("MILP {status}; depths prefill {} decode {}", s.prefill.depth, s.decode.depth));
            Some((s.prefill, s.decode))
        } else {
            notes.push("the MILP found no solution within its time limit".into());
            None
        };
        let (prefill, decode) = if self.simulate {
            let judge = Judge {
                spec,
                inv: &inv,
                est: &est,
                workload,
                cost,
                budget_bytes,
                objective: self.objective,
                max_depth: self.max_depth,
            };
            // The paper's plan for the same cell joins the candidates, so the simulator never picks worse.
            let paper = Pshard::default().plan(spec, workload, cost, budget_bytes).ok().map(|p| {
                let layout = |pp| {
                    let mut l = Layout::of_phase(&est.structure, &inv, pp);
                    l.depth = l.depth.min(self.max_depth);
                    l
                };
                (layout(&p.prefill), layout(&p.decode))
            });
            self.judged(&judge, milp, greedy, paper, &mut notes)
        } else {
            let score = |(a, b): &(Layout, Layout)| objective_ns(self.objective, &est.predict(a, b, false));
            let (p, d) = match milp {
                Some(m) if score(&m) <= score(&greedy) => m,
                _ => {
                    notes.push("greedy's plan is better under the estimator and kept".into());
                    greedy
                }
            };
            (Candidate { layout: p, op_offload: false }, Candidate { layout: d, op_offload: false })
        };
        let decision = Decision::searched(&est, prefill.layout, decode.layout, notes)
            .with_op_offload(&est, prefill.op_offload);
        Ok(assemble(self.name(), spec, &inv, &est, workload, budget_bytes, decision))
    }

    /// The simulator's choice among the variants of the program's and greedy's layouts ([`crate::judge`]).
    fn judged(
        &self,
        judge: &Judge<'_>,
        milp: Option<(Layout, Layout)>,
        greedy: (Layout, Layout),
        paper: Option<(Layout, Layout)>,
        notes: &mut Vec<String>,
    ) -> (Candidate, Candidate) {
        let sources: Vec<(&str, Layout, Layout)> = milp
            .map(|(p, d)| ("MILP", p, d))
            .into_iter()
            .chain([("greedy", greedy.0, greedy.1)])
            .chain(paper.map(|(p, d)| ("pshard", p, d)))
            .collect();
        let (p, d, note) = judge.choose(self.name(), &sources);
        notes.push(note);
        (p, d)
    }
}

/// Costs and bytes of one layer's units as the program sees them, per phase.
#[derive(Debug, Clone, PartialEq)]
struct LayerCosts {
    /// Attention group (attention, router, shared experts): summed costs per phase.
    attn: [UnitCost; 2],
    attn_bytes: u64,
    /// Largest unit of the attention group (what a slot must hold when it streams).
    attn_max_unit: u64,
    /// The attention unit alone (it shares a slot with its KV when both stream).
    attn_unit: u64,
    kv: [UnitCost; 2],
    ffn: Option<([UnitCost; 2], u64)>,
    /// Per routed expert, and the number of experts.
    expert: Option<([UnitCost; 2], u64, u32)>,
}

/// Layers with identical costs.
#[derive(Debug, Clone, PartialEq)]
struct Class {
    layers: Vec<usize>,
    costs: LayerCosts,
}

fn sum_costs(costs: &[UnitCost], units: &[usize]) -> UnitCost {
    units.iter().fold(UnitCost::default(), |a, &u| {
        let c = &costs[u];
        UnitCost {
            gpu_ns: a.gpu_ns + c.gpu_ns,
            pinned_saving_ns: a.pinned_saving_ns + c.pinned_saving_ns,
            cpu_ns: a.cpu_ns + c.cpu_ns,
            offload_ns: a.offload_ns + c.offload_ns,
            copy_ns: a.copy_ns + c.copy_ns,
            cpu_dram_bytes: a.cpu_dram_bytes + c.cpu_dram_bytes,
        }
    })
}

/// Groups the layers of a model into classes of identical layers.
fn classes(est: &Estimator) -> Vec<Class> {
    let st = &est.structure;
    let mut out: Vec<Class> = Vec::new();
    for (l, lu) in st.layers.iter().enumerate() {
        let per_phase = |units: &[usize]| PHASES.map(|p| sum_costs(&est.costs(p).units, units));
        let mut attn_units = vec![lu.attn];
        attn_units.extend(lu.router);
        attn_units.extend(lu.shared_experts);
        let costs = LayerCosts {
            attn: per_phase(&attn_units),
            attn_bytes: attn_units.iter().map(|&u| est.unit_bytes[u]).sum(),
            attn_max_unit: attn_units.iter().map(|&u| est.unit_bytes[u]).max().unwrap_or(0),
            attn_unit: est.unit_bytes[lu.attn],
            kv: per_phase(&[lu.kv]),
            ffn: lu.ffn.map(|f| (per_phase(&[f]), est.unit_bytes[f])),
            expert: lu.experts.first().map(|&e| (per_phase(&[e]), lu.expert_bytes, lu.experts.len() as u32)),
        };
        match out.iter_mut().find(|c| c.costs == costs) {
            Some(c) => c.layers.push(l),
            None => out.push(Class { layers: vec![l], costs }),
        }
    }
    out
}

/// The solution of the program.
struct Solved {
    prefill: Layout,
    decode: Layout,
    /// Every solve finished within its gap rather than at its time limit.
    proven: bool,
}

/// What one solve minimises.
#[derive(Debug, Clone, Copy)]
enum Goal {
    /// E2EL.
    E2el,
    /// One phase's time (TTFT or the decode step).
    Phase(PhaseKind),
    /// E2EL with one phase's time capped (the second, tie-breaking solve of `ttft` and `tps`).
    E2elCapped(PhaseKind, f64),
}

/// One solve's outcome.
struct Outcome {
    prefill: Layout,
    decode: Layout,
    /// The objective's phase time (ms) in the solution.
    phase_ms: [f64; 2],
    proven: bool,
}

impl Ilp {
    /// Solves the program (twice for `ttft` and `tps`: the phase first, then E2EL at that phase time), with a
    /// VRAM safety margin that grows when the rounded solution does not fit.
    fn search(&self, est: &Estimator, classes: &[Class], budget: u64) -> Result<Option<Solved>, PlanError> {
        for margin_mib in SAFETY_MIB {
            let first = match self.objective {
                Objective::E2el => Goal::E2el,
                Objective::Ttft => Goal::Phase(PhaseKind::Prefill),
                Objective::Tps => Goal::Phase(PhaseKind::Decode),
            };
            let Some(mut o) = self.solve(est, classes, budget, margin_mib, first)? else { return Ok(None) };
            if let Goal::Phase(phase) = first {
                let cap = o.phase_ms[usize::from(phase == PhaseKind::Decode)];
                let proven = o.proven;
                if let Some(second) =
                    self.solve(est, classes, budget, margin_mib, Goal::E2elCapped(phase, cap))?
                {
                    o = Outcome { proven: proven && second.proven, ..second };
                }
            }
            let fits = |phase, l: &Layout| est.vram(phase, l).total() <= budget;
            if fits(PhaseKind::Prefill, &o.prefill) && fits(PhaseKind::Decode, &o.decode) {
                return Ok(Some(Solved { prefill: o.prefill, decode: o.decode, proven: o.proven }));
            }
        }
        Ok(None)
    }

    /// Solves the joint program of both phases for `goal`.
    fn solve(
        &self,
        est: &Estimator,
        classes: &[Class],
        budget: u64,
        margin_mib: f64,
        goal: Goal,
    ) -> Result<Option<Outcome>, PlanError> {
        let mut vars = ProblemVariables::new();
        let mut rows: Vec<Constraint> = Vec::new();
        let pre =
            PhaseVars::build(&mut vars, &mut rows, est, classes, PhaseKind::Prefill, budget, margin_mib);
        let dec = PhaseVars::build(&mut vars, &mut rows, est, classes, PhaseKind::Decode, budget, margin_mib);
        if self.max_depth < DEPTHS[1] {
            rows.push(Expression::from(pre.double).eq(0.0));
            rows.push(Expression::from(dec.double).eq(0.0));
        }

        let switch = switch_ms(&mut vars, &mut rows, est, classes, &pre, &dec);
        let e2el = pre.t + est.gen_tokens as f64 * dec.t + switch;
        let t_of = |phase| if phase == PhaseKind::Prefill { pre.t } else { dec.t };
        let objective = match goal {
            Goal::E2el => e2el,
            Goal::Phase(phase) => Expression::from(t_of(phase)),
            Goal::E2elCapped(phase, cap) => {
                rows.push(Expression::from(t_of(phase)).leq(cap));
                e2el
            }
        };
        let key =
            program_key(&vars, &objective, &rows, [self.time_limit_s.to_bits(), goal.word(), cap_bits(goal)]);
        let answer = if let Some(answer) = memoised(&key) {
            answer
        } else {
            let answer = self.run_highs(vars, objective, rows)?;
            remember(key, answer.clone());
            answer
        };
        let Answer::Solved(solution) = answer else { return Ok(None) };
        Ok(Some(Outcome {
            prefill: pre.read(&*solution, est, classes, budget),
            decode: dec.read(&*solution, est, classes, budget),
            phase_ms: [solution.value(pre.t), solution.value(dec.t)],
            // HiGHS stops within its relative gap: that counts as optimal.
            proven: matches!(solution.status(), SolutionStatus::Optimal | SolutionStatus::GapLimit),
        }))
    }

    /// One HiGHS solve.
    fn run_highs(
        &self,
        vars: ProblemVariables,
        objective: Expression,
        rows: Vec<Constraint>,
    ) -> Result<Answer, PlanError> {
        let all: Vec<Variable> = vars.iter_variables_with_def().map(|(v, _)| v).collect();
        let mut model = vars
            .minimise(objective)
            .using(highs)
            .set_time_limit(self.time_limit_s)
            .set_threads(1)
            .set_mip_rel_gap(MIP_REL_GAP)
            .expect("a valid gap")
            // Presolve costs more than it saves on programs this small (measured: 0.8 s → 0.4 s on 2 cores).
            .set_option("presolve", "off");
        for r in rows {
            model.add_constraint(r);
        }
        match model.solve() {
            Ok(s) => Ok(Answer::Solved(Arc::new(Stored {
                status: s.status(),
                index: all.iter().enumerate().map(|(i, &v)| (v, i)).collect(),
                values: all.iter().map(|&v| s.value(v)).collect(),
            }))),
            Err(ResolutionError::Infeasible) => Ok(Answer::Infeasible),
            Err(e) => Err(PlanError::Solver { planner: "ilp".into(), reason: e.to_string() }),
        }
    }
}

impl Goal {
    /// The goal's kind as one word of a program's key.
    fn word(self) -> u64 {
        match self {
            Goal::E2el => 0,
            Goal::Phase(PhaseKind::Prefill) => 1,
            Goal::Phase(PhaseKind::Decode) => 2,
            Goal::E2elCapped(PhaseKind::Prefill, _) => 3,
            Goal::E2elCapped(PhaseKind::Decode, _) => 4,
        }
    }
}

fn cap_bits(goal: Goal) -> u64 {
    if let Goal::E2elCapped(_, cap) = goal { cap.to_bits() } else { 0 }
}

/// What HiGHS made of a program.
#[derive(Clone)]
enum Answer {
    Infeasible,
    Solved(Arc<Stored>),
}

/// A solution, kept for a later solve of the same program.
struct Stored {
    status: SolutionStatus,
    index: FxHashMap<Variable, usize>,
    values: Vec<f64>,
}

impl Solution for Stored {
    fn status(&self) -> SolutionStatus {
        self.status
    }

    fn value(&self, variable: Variable) -> f64 {
        self.values[self.index[&variable]]
    }
}

/// Programs [`memoised`] keeps, oldest first.
const MEMO_PROGRAMS: usize = 64;

/// The last programs solved in this process, by their [`program_key`].
type Memo = VecDeque<(Vec<u64>, Answer)>;

static SOLVED: Mutex<Memo> = Mutex::new(VecDeque::new());

/// The outcome of an earlier solve of the program with this key. HiGHS is deterministic (one thread, fixed
/// seed), so it is what solving it again would give; cells that differ only where the program does not look
/// (Figure 2's 1K prompts fit one chunk of either ubatch) solve once.
fn memoised(key: &[u64]) -> Option<Answer> {
    let memo = SOLVED.lock().unwrap_or_else(PoisonError::into_inner);
    memo.iter().find(|(k, _)| k.as_slice() == key).map(|(_, s)| s.clone())
}

/// Forgets every program solved so far: a benchmark timing `ilp` on one cell over and over calls it so that
/// each run solves its program, as the first plan of a cell does.
pub fn forget_solves() {
    SOLVED.lock().unwrap_or_else(PoisonError::into_inner).clear();
}

fn remember(key: Vec<u64>, answer: Answer) {
    let mut memo = SOLVED.lock().unwrap_or_else(PoisonError::into_inner);
    if memo.len() == MEMO_PROGRAMS {
        memo.pop_front();
    }
    memo.push_back((key, answer));
}

/// Everything HiGHS is given, as words: `extra` (the time limit and the goal), each variable's bounds and
/// integrality, the objective and the rows, coefficients in variable order (f64 bits, so only identical
/// programs share a key). good_lp does not expose whether an inequality was written `≥` or `≤` (HiGHS gets
/// the row negated or not); that follows from the code that built the row, which the goal and the variables
/// (the classes' kinds) identify.
fn program_key(
    vars: &ProblemVariables,
    objective: &Expression,
    rows: &[Constraint],
    extra: [u64; 3],
) -> Vec<u64> {
    let index: FxHashMap<Variable, u64> =
        vars.iter_variables_with_def().enumerate().map(|(i, (v, _))| (v, i as u64)).collect();
    let mut key = extra.to_vec();
    for (_, def) in vars.iter_variables_with_def() {
        key.extend([def.get_min().to_bits(), def.get_max().to_bits(), u64::from(def.is_integer())]);
    }
    let expression = |key: &mut Vec<u64>, e: &Expression, tag: u64| {
        let mut coefficients: Vec<(u64, u64)> =
            e.linear_coefficients().map(|(v, c)| (index[&v], c.to_bits())).collect();
        coefficients.sort_unstable();
        key.extend([tag, e.constant().to_bits(), coefficients.len() as u64]);
        key.extend(coefficients.into_iter().flat_map(|(v, c)| [v, c]));
    };
    expression(&mut key, objective, 2);
    for r in rows {
        expression(&mut key, r.expression(), u64::from(r.is_equality()));
    }
    key
}

/// Counts of one class in one phase.
struct ClassVars {
    /// Attention groups pinned, streamed, CPU.
    attn: [Variable; 3],
    /// KV pinned, streamed.
    kv: [Variable; 2],
    ffn: Option<[Variable; 3]>,
    experts: Option<[Variable; 3]>,
}

/// The variables of one phase.
struct PhaseVars {
    phase: PhaseKind,
    /// Two ring slots rather than one.
    double: Variable,
    t: Variable,
    classes: Vec<ClassVars>,
    /// Output head pinned, streamed, CPU.
    output: [Variable; 3],
}

/// Milliseconds of `ns`.
fn ms(ns: f64) -> f64 {
    ns / NS_PER_MS
}

/// MiB of `bytes`.
fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// Sums a phase's terms over its units.
#[derive(Default)]
struct Terms {
    compute: Expression,
    copy: Expression,
    streamed_gpu: Expression,
    dram_bytes: Expression,
    vram_mib: Expression,
}

impl Terms {
    /// Adds `[pinned, streamed, cpu]` counts of a unit with cost `c` and `bytes` (VRAM when pinned, copied
    /// when streamed).
    fn add(&mut self, c: &UnitCost, counts: [Expression; 3], bytes: u64, steps: f64) {
        let [p, s, cpu] = counts;
        self.compute +=
            ms(c.pinned_gpu_ns()) * p.clone() + ms(c.gpu_ns) * s.clone() + ms(c.cpu_ns) * cpu.clone();
        self.copy += ms(steps * c.copy_ns) * s.clone();
        self.streamed_gpu += ms(c.gpu_ns) * s.clone();
        self.dram_bytes += c.cpu_dram_bytes * cpu + steps * bytes as f64 * s;
        self.vram_mib += mib(bytes) * p;
    }
}

impl PhaseVars {
    fn build(
        vars: &mut ProblemVariables,
        rows: &mut Vec<Constraint>,
        est: &Estimator,
        classes: &[Class],
        phase: PhaseKind,
        budget: u64,
        margin_mib: f64,
    ) -> PhaseVars {
        let st = &est.structure;
        let costs = est.costs(phase);
        let i = usize::from(phase == PhaseKind::Decode);
        let steps = costs.steps as f64;
        let handoff = ms(costs.handoff_ns);
        let int = |vars: &mut ProblemVariables, max: f64| vars.add(variable().integer().min(0.0).max(max));
        let bin = |vars: &mut ProblemVariables| vars.add(variable().binary());
        let cont = |vars: &mut ProblemVariables| vars.add(variable().min(0.0));
        let e = |v: Variable| Expression::from(v);

        let mut terms = Terms::default();
        let slot = cont(vars);
        let any_gpu = bin(vars);
        let mut class_vars = Vec::with_capacity(classes.len());
        for class in classes {
            let n = class.layers.len() as f64;
            let c = &class.costs;
            let attn = [int(vars, n), int(vars, n), int(vars, n)];
            rows.push((attn[0] + attn[1] + attn[2]).eq(n));
            let kv = [int(vars, n), int(vars, n)];
            rows.push((kv[0] + kv[1]).eq(attn[0] + attn[1]));
            terms.add(&c.attn[i], attn.map(e), c.attn_bytes, steps);
            terms.add(&c.kv[i], [e(kv[0]), e(kv[1]), e(attn[2])], est.kv_layer_bytes, steps);
            rows.push((n * any_gpu).geq(attn[0] + attn[1]));
            // Slots hold the largest streamed unit of each kind that streams.
            let streams = |vars: &mut ProblemVariables,
                           rows: &mut Vec<Constraint>,
                           count: Variable,
                           of: f64,
                           bytes: u64| {
                let z = bin(vars);
                rows.push((of * z).geq(e(count)));
                rows.push(e(slot).geq(mib(bytes) * z));
                z
            };
            let za = streams(vars, rows, attn[1], n, c.attn_max_unit);
            let zk = streams(vars, rows, kv[1], n, est.kv_layer_bytes);
            // Streamed KV goes first to layers whose attention streams, and then they share one slot.
            rows.push(e(slot).geq(mib(c.attn_unit + est.kv_layer_bytes) * (za + zk - 1.0)));
            let attn_gpu = attn[0] + attn[1];
            let mut ffn = None;
            let mut experts = None;
            if let Some((fc, fbytes)) = &c.ffn {
                let f = [int(vars, n), int(vars, n), int(vars, n)];
                rows.push((f[0] + f[1] + f[2]).eq(n));
                terms.add(&fc[i], f.map(e), *fbytes, steps);
                rows.push((n * any_gpu).geq(f[0] + f[1]));
                streams(vars, rows, f[1], n, *fbytes);
                // Layers whose attention and FFN sit on different devices: |aG − fG|, two hand-offs each.
                let h = cont(vars);
                rows.push(e(h).geq(attn_gpu.clone() - (f[0] + f[1])));
                rows.push(e(h).geq((f[0] + f[1]) - attn_gpu.clone()));
                terms.compute += 2.0 * handoff * h;
                ffn = Some(f);
            }
            if let Some((ec, ebytes, n_experts)) = &c.expert {
                let big_e = f64::from(*n_experts);
                // Continuous counts: their GPU total is integral through `full` and `rem` below, and only the
                // pinned/streamed split is rounded (pinned down), which keeps VRAM and costs at most one
                // expert's copy. Integer counts up to n·E slow HiGHS down several times.
                let real = |vars: &mut ProblemVariables| vars.add(variable().min(0.0).max(n * big_e));
                let x = [real(vars), real(vars), real(vars)];
                rows.push((x[0] + x[1] + x[2]).eq(n * big_e));
                terms.add(&ec[i], x.map(e), *ebytes, steps);
                rows.push((n * big_e * any_gpu).geq(x[0] + x[1]));
                streams(vars, rows, x[1], n * big_e, *ebytes);
                // GPU experts fill `full` layers, then `rem` of one mixed layer.
                let full = int(vars, n);
                let partial = bin(vars);
                let rem = int(vars, big_e - 1.0);
                rows.push((x[0] + x[1]).eq(big_e * full + rem));
                rows.push(e(rem).leq((big_e - 1.0) * partial));
                rows.push(e(rem).geq(e(partial)));
                rows.push((full + partial).leq(n));
                let (m1, m2) = (cont(vars), cont(vars));
                rows.push(e(m1).geq(full - attn_gpu.clone()));
                rows.push(e(m2).geq(attn_gpu.clone() - full - partial));
                terms.compute += 2.0 * handoff * (partial + m1 + m2);
                experts = Some(x);
            }
            class_vars.push(ClassVars { attn, kv, ffn, experts });
        }
        // The output head (with the token embedding when tied); other units stay on the CPU.
        let mut out_units = vec![st.output];
        if st.tied_embeddings {
            out_units.push(st.token_embd);
        }
        let output = [bin(vars), bin(vars), bin(vars)];
        rows.push((output[0] + output[1] + output[2]).eq(1.0));
        let out_cost = sum_costs(&costs.units, &out_units);
        let out_bytes: u64 = out_units.iter().map(|&u| est.unit_bytes[u]).sum();
        terms.add(&out_cost, output.map(e), out_bytes, steps);
        rows.push(e(any_gpu).geq(output[0] + output[1]));
        for &u in &out_units {
            rows.push(e(slot).geq(mib(est.unit_bytes[u]) * output[1]));
        }
        for &u in &st.plain {
            let grouped = out_units.contains(&u)
                || st.layers.iter().any(|l| {
                    l.attn == u
                        || l.kv == u
                        || l.router == Some(u)
                        || l.ffn == Some(u)
                        || l.shared_experts == Some(u)
                });
            if !grouped {
                terms.compute += ms(costs.units[u].cpu_ns);
                terms.dram_bytes += costs.units[u].cpu_dram_bytes;
            }
        }

        // The depth (1 or 2): `double` = 1 for two slots. The second slot costs `S` more (big-M); one slot
        // makes a streamed unit's copy and compute serial (occupancy); with two the occupancy bound is implied.
        let room = mib(budget) - mib(est.runtime_overhead_bytes) - margin_mib;
        let double = bin(vars);
        let second_slot = cont(vars);
        rows.push(e(second_slot).geq(slot - room.max(0.0) * (1.0 - e(double))));
        let mut vram = terms.vram_mib + slot + second_slot;
        vram += mib(costs.scratch_bytes) * any_gpu;
        rows.push(vram.leq(room));
        let t = cont(vars);
        let occupancy = terms.copy.clone() + terms.streamed_gpu;
        rows.push(e(t).geq(occupancy - occupancy_bound_ms(est, phase) * e(double)));

        // Time.
        rows.push(e(t).geq(terms.compute));
        rows.push(e(t).geq(terms.copy));
        rows.push(e(t).geq(terms.dram_bytes * ms(1.0 / est.dram_bytes_per_ns)));
        PhaseVars { phase, double, t, classes: class_vars, output }
    }

    /// The layout of a solution, arranged as the module docs say.
    fn read(&self, sol: &impl Solution, est: &Estimator, classes: &[Class], budget: u64) -> Layout {
        let st = &est.structure;
        let count = |v: Variable| sol.value(v).round().max(0.0) as usize;
        let mut layout = Layout::all_cpu(st, est.unit_bytes.len());
        for (class, cv) in classes.iter().zip(&self.classes) {
            let by_rank: Vec<usize> =
                rank_order(class.layers.len()).into_iter().map(|j| class.layers[j]).collect();
            let n = by_rank.len();
            let attn = placements_by_rank(count(cv.attn[0]), count(cv.attn[1]), n);
            let kv = placements_by_rank(count(cv.kv[0]), count(cv.kv[1]), n);
            for (r, &l) in by_rank.iter().enumerate() {
                let lu = &st.layers[l];
                for u in [Some(lu.attn), lu.router, lu.shared_experts].into_iter().flatten() {
                    layout.placements[u] = attn[r];
                }
                layout.placements[lu.kv] = if attn[r] == Placement::Cpu { Placement::Cpu } else { kv[r] };
            }
            if let Some(f) = cv.ffn {
                let ffn = placements_by_rank(count(f[0]), count(f[1]), n);
                for (r, &l) in by_rank.iter().enumerate() {
                    layout.placements[st.layers[l].ffn.expect("dense classes have an FFN")] = ffn[r];
                }
            }
            if let Some(x) = cv.experts {
                let per_layer = st.layers[by_rank[0]].experts.len();
                let pinned = (sol.value(x[0]) + 1e-6).floor().max(0.0) as usize;
                let streamed = (sol.value(x[1]) - 1e-6).ceil().max(0.0) as usize;
                for (&l, split) in by_rank.iter().zip(expert_splits(pinned, streamed, per_layer, n)) {
                    layout.experts[l] = split;
                }
            }
        }
        let weights = if sol.value(self.output[0]) > 0.5 {
            Placement::Pinned
        } else if sol.value(self.output[1]) > 0.5 {
            Placement::Streamed
        } else {
            Placement::Cpu
        };
        layout.placements[st.output] = weights;
        if st.tied_embeddings {
            layout.placements[st.token_embd] = weights;
        }
        let depth = if sol.value(self.double) > 0.5 { DEPTHS[1] } else { DEPTHS[0] };
        layout.depth = if layout.streams(st) { depth } else { 0 };
        self.repair_expert_rounding(&mut layout, est, classes, budget);
        layout
    }

    /// The program's pinned/streamed split of experts is fractional and rounded: try the neighbouring whole
    /// counts (one more or less of each, per class) and keep the fastest that fits.
    fn repair_expert_rounding(&self, layout: &mut Layout, est: &Estimator, classes: &[Class], budget: u64) {
        for class in classes.iter().filter(|c| c.costs.expert.is_some()) {
            let by_rank: Vec<usize> =
                rank_order(class.layers.len()).into_iter().map(|j| class.layers[j]).collect();
            let per_layer = st_experts(est, by_rank[0]);
            let all = per_layer * by_rank.len();
            let total =
                |l: &Layout, k: usize| by_rank.iter().map(|&x| l.experts[x][k] as usize).sum::<usize>();
            let (p, s) = (total(layout, 0), total(layout, 1));
            let mut best = (est.phase(self.phase, layout, false).time_ns, layout.clone());
            for (dp, ds) in [(1, -1), (1, 0), (0, 1), (0, -1), (1, -2), (-1, 1)] {
                let (Some(p2), Some(s2)) = (p.checked_add_signed(dp), s.checked_add_signed(ds)) else {
                    continue;
                };
                if p2 + s2 > all {
                    continue;
                }
                let mut candidate = layout.clone();
                for (&l, split) in by_rank.iter().zip(expert_splits(p2, s2, per_layer, by_rank.len())) {
                    candidate.experts[l] = split;
                }
                candidate.depth = if candidate.streams(&est.structure) { layout.depth.max(1) } else { 0 };
                let t = est.phase(self.phase, &candidate, false).time_ns;
                if t < best.0 && est.vram(self.phase, &candidate).total() <= budget {
                    best = (t, candidate);
                }
            }
            *layout = best.1;
        }
    }
}

/// Routed experts per layer of layer `l`.
fn st_experts(est: &Estimator, l: usize) -> usize {
    est.structure.layers[l].experts.len()
}

/// The order in which a class's layers take placements: by the radical inverse (base 2) of their index
/// stretched onto the next power of two, so that any first `k` ranks are spread through the class (0, n/2,
/// n/4, 3n/4 …).
fn rank_order(n: usize) -> Vec<usize> {
    let m = n.next_power_of_two();
    let mut v: Vec<usize> = (0..n).collect();
    v.sort_by_key(|&j| ((j * m / n) as u64).reverse_bits());
    v
}

/// Placements by rank: the first `pinned` ranks pinned, the next `streamed` streamed, the rest on the CPU.
fn placements_by_rank(pinned: usize, streamed: usize, n: usize) -> Vec<Placement> {
    (0..n)
        .map(|r| {
            if r < pinned {
                Placement::Pinned
            } else if r < pinned + streamed {
                Placement::Streamed
            } else {
                Placement::Cpu
            }
        })
        .collect()
}

/// Per-rank `[pinned, streamed, cpu]` experts of a class of `n` layers of `per_layer` experts: pinned experts
/// fill layers in rank order, the streamed ones continue where they stop, the rest stay on the CPU.
fn expert_splits(pinned: usize, streamed: usize, per_layer: usize, n: usize) -> Vec<[u32; 3]> {
    let fill = |total: usize, r: usize| total.saturating_sub(r * per_layer).min(per_layer);
    (0..n)
        .map(|r| {
            let p = fill(pinned, r);
            let gpu = fill(pinned + streamed, r);
            [p as u32, (gpu - p) as u32, (per_layer - gpu) as u32]
        })
        .collect()
}

/// An upper bound of a phase's occupancy (everything streamed), in ms: the big M of the depth choice.
fn occupancy_bound_ms(est: &Estimator, phase: PhaseKind) -> f64 {
    let costs = est.costs(phase);
    let steps = costs.steps as f64;
    let st = &est.structure;
    let plain: f64 = st.plain.iter().map(|&u| steps * costs.units[u].copy_ns + costs.units[u].gpu_ns).sum();
    let experts: f64 = st
        .layers
        .iter()
        .filter_map(|l| {
            l.experts
                .first()
                .map(|&u| l.experts.len() as f64 * (steps * costs.units[u].copy_ns + costs.units[u].gpu_ns))
        })
        .sum();
    ms(plain + experts) + 1.0
}

/// The switch time (ms): newly pinned bytes per kind and class, as one large H2D copy.
fn switch_ms(
    vars: &mut ProblemVariables,
    rows: &mut Vec<Constraint>,
    est: &Estimator,
    classes: &[Class],
    pre: &PhaseVars,
    dec: &PhaseVars,
) -> Expression {
    let mut bytes_mib = Expression::from(0.0);
    let mut up = |vars: &mut ProblemVariables, a: Variable, b: Variable, size: u64| {
        let sw = vars.add(variable().min(0.0));
        rows.push(Expression::from(sw).geq(b - a));
        bytes_mib += mib(size) * sw;
    };
    for ((class, a), b) in classes.iter().zip(&pre.classes).zip(&dec.classes) {
        let c = &class.costs;
        up(vars, a.attn[0], b.attn[0], c.attn_bytes);
        up(vars, a.kv[0], b.kv[0], est.kv_prompt_bytes);
        if let (Some(fa), Some(fb), Some((_, bytes))) = (a.ffn, b.ffn, &c.ffn) {
            up(vars, fa[0], fb[0], *bytes);
        }
        if let (Some(xa), Some(xb), Some((_, bytes, _))) = (a.experts, b.experts, &c.expert) {
            up(vars, xa[0], xb[0], *bytes);
        }
    }
    let st = &est.structure;
    let mut out_bytes = est.unit_bytes[st.output];
    if st.tied_embeddings {
        out_bytes += est.unit_bytes[st.token_embd];
    }
    up(vars, pre.output[0], dec.output[0], out_bytes);
    bytes_mib * (MIB as f64 * est.h2d_ns_per_byte / NS_PER_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 12-item knapsack with room for `room`, as the program to solve, and its item variables.
    fn knapsack(room: f64) -> (ProblemVariables, Expression, Vec<Constraint>, Vec<Variable>) {
        let mut vars = ProblemVariables::new();
        let items: Vec<Variable> = (0..12).map(|_| vars.add(variable().binary())).collect();
        let value: Expression = items.iter().enumerate().map(|(i, &x)| -((i * 7 % 11 + 1) as f64) * x).sum();
        let weight: Expression = items.iter().enumerate().map(|(i, &x)| ((i * 5 % 7 + 1) as f64) * x).sum();
        (vars, value, vec![weight.leq(room)], items)
    }

    #[test]
    fn the_solve_memo_answers_only_the_same_program_and_as_highs_would() {
        let key = |(v, o, r, _): &(ProblemVariables, Expression, Vec<Constraint>, Vec<Variable>)| {
            program_key(v, o, r, [0, 0, 0])
        };
        let (a, b, other) = (knapsack(10.0), knapsack(10.0), knapsack(10.5));
        let (key_a, key_other) = (key(&a), key(&other));
        assert_eq!(key_a, key(&b), "the same program, built twice, has one key");
        assert_ne!(key_a, key_other, "one bound apart");
        assert_ne!(key_a, program_key(&a.0, &a.1, &a.2, [0, 1, 0]), "another goal");
        let items = a.3.clone();
        let ilp = Ilp::default();
        let solve = |(v, o, r, _)| match ilp.run_highs(v, o, r) {
            Ok(Answer::Solved(s)) => s,
            _ => panic!("a knapsack has a solution"),
        };
        let (first, second) = (solve(a), solve(b));
        // What the memo hands out is what solving again gives, value for value.
        assert!(items.iter().all(|&x| first.value(x).to_bits() == second.value(x).to_bits()));
        assert!(items.iter().any(|&x| first.value(x) > 0.5) && items.iter().any(|&x| first.value(x) < 0.5));
        remember(key_a.clone(), Answer::Solved(first));
        let Some(Answer::Solved(kept)) = memoised(&key_a) else { panic!("the program just solved is kept") };
        assert!(items.iter().all(|&x| kept.value(x).to_bits() == second.value(x).to_bits()));
        assert!(memoised(&key_other).is_none());
    }

    #[test]
    fn ranks_spread_through_the_class() {
        assert_eq!(rank_order(8), vec![0, 4, 2, 6, 1, 5, 3, 7]);
        let r = rank_order(94);
        let mut sorted = r.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..94).collect::<Vec<_>>());
        // The first 4 ranks fall in 4 different quarters.
        let mut quarters: Vec<usize> = r[..4].iter().map(|&j| j * 4 / 94).collect();
        quarters.sort_unstable();
        assert_eq!(quarters, vec![0, 1, 2, 3]);
    }

    #[test]
    fn expert_splits_keep_totals_and_nest_pinned_experts() {
        let s = expert_splits(130, 70, 128, 3);
        assert_eq!(s, vec![[128, 0, 0], [2, 70, 56], [0, 0, 128]]);
        // More pinned experts never pin fewer in any layer (a switch uploads only the difference).
        let t = expert_splits(200, 0, 128, 3);
        assert!(s.iter().zip(&t).all(|(a, b)| b[0] >= a[0]));
    }
}
