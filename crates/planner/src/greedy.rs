//! `greedy`: benefit per VRAM byte.
//!
//! For each phase and each candidate slot size (0, or the size of one kind of unit: attention, attention with
//! its KV, FFN, expert, output; sizes within 10 % merged) at the deepest ring of [`DEPTHS`], then at one slot
//! for the best size, starting from everything on the CPU:
//! 1. reserve the runtime, the phase's scratch and `depth × slot` for the ring;
//! 2. **pin** groups (attention with its KV, FFN, output) and chunks of 1/16 of a layer's routed experts in
//!    decreasing order of predicted time saved (CPU time − GPU time) per VRAM byte, while they fit;
//! 3. **stream** the remaining groups and expert chunks that fit the slot, in decreasing order of time saved
//!    per copy nanosecond, keeping the prefix of that order the estimator likes best (17 samples over a
//!    window that narrows 16-fold around the best sample until it is one move wide).
//!
//! The best layout per phase under the estimator wins; then the pair of phase layouts (or one of them used for
//! both phases, which saves the switch) that minimises the objective. Scratch is charged as
//! [`pipeshard_core::workload::scratch_bytes`] of the phase's worst step, with no margin.

use pipeshard_core::cost::CostModel;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Placement, Plan};
use pipeshard_core::workload::Workload;

use crate::estimate::{Estimator, Layout, objective_ns};
use crate::space::{Choice, DEPTHS, Space};
use crate::{Decision, Objective, PlanError, Planner, assemble, prepare};

/// The greedy planner (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greedy {
    /// What the final choice between phase layouts minimises.
    pub objective: Objective,
    /// Largest ring depth it may use (1 or 2; see [`DEPTHS`]).
    pub max_depth: u32,
}

impl Default for Greedy {
    fn default() -> Self {
        Greedy { objective: Objective::E2el, max_depth: DEPTHS[DEPTHS.len() - 1] }
    }
}

impl Planner for Greedy {
    fn name(&self) -> &'static str {
        "greedy"
    }

    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        let (inv, est) = prepare(spec, workload, cost, budget_bytes)?;
        let space = Space::new(&est.structure);
        let (prefill, decode) = search(&est, &space, budget_bytes, self.objective, self.max_depth);
        let notes = vec![
            format!("objective {}", self.objective.name()),
            describe("prefill", &est, &prefill),
            describe("decode", &est, &decode),
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

fn describe(phase: &str, est: &Estimator, l: &Layout) -> String {
    let slot = est.slot_bytes(l);
    if slot == 0 {
        format!("{phase}: nothing streams")
    } else {
        format!("{phase}: depth {} × slot {slot} bytes", l.depth)
    }
}

/// The greedy pair of layouts (prefill, decode) for a budget the runtime fits in, with rings of at most
/// `max_depth` slots.
#[must_use]
pub fn search(
    est: &Estimator,
    space: &Space,
    budget_bytes: u64,
    objective: Objective,
    max_depth: u32,
) -> (Layout, Layout) {
    let pre = best_phase(est, space, PhaseKind::Prefill, budget_bytes, max_depth);
    let dec = best_phase(est, space, PhaseKind::Decode, budget_bytes, max_depth);
    let fits = |phase, l: &Layout| est.vram(phase, l).total() <= budget_bytes;
    let mut pairs = vec![(pre.clone(), dec.clone())];
    if fits(PhaseKind::Decode, &pre) {
        pairs.push((pre.clone(), pre.clone()));
    }
    if fits(PhaseKind::Prefill, &dec) {
        pairs.push((dec.clone(), dec));
    }
    pairs
        .into_iter()
        .map(|(a, b)| (objective_ns(objective, &est.predict(&a, &b, false)), a, b))
        .min_by(|x, y| x.0.total_cmp(&y.0))
        .map(|(_, a, b)| (a, b))
        .expect("at least one pair")
}

/// A move of the greedy: a group to a placement, or a number of a layer's experts off the CPU.
#[derive(Debug, Clone, Copy)]
enum Move {
    Group(usize, Choice),
    Experts { layer: usize, count: u32, placement: Placement },
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    mv: Move,
    /// VRAM (pins) or copy time (streams): the denominator of the benefit.
    price: f64,
    saving_ns: f64,
    bytes: u64,
}

fn apply(space: &Space, layout: &mut Layout, mv: Move) {
    match mv {
        Move::Group(g, choice) => space.apply(layout, g, choice),
        Move::Experts { layer, count, placement } => {
            let c = &mut layout.experts[layer];
            c[2] -= count;
            match placement {
                Placement::Pinned => c[0] += count,
                Placement::Streamed => c[1] += count,
                Placement::Cpu => c[2] += count,
            }
        }
    }
}

/// Slot sizes worth trying: the largest unit of each kind a slot might hold.
fn slot_candidates(est: &Estimator, space: &Space) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::new();
    for g in &space.groups {
        let mut m = g.units.iter().map(|&u| est.unit_bytes[u]).max().unwrap_or(0);
        v.push(m);
        if g.kv.is_some() {
            m = m.max(est.unit_bytes[g.units[0]] + est.kv_layer_bytes);
            v.push(m);
        }
    }
    for &l in &space.expert_layers {
        v.push(est.structure.layers[l].expert_bytes);
    }
    v.retain(|&b| b > 0);
    v.sort_unstable();
    // Sizes within 10 % of the next larger one add little (qwen3-235b's two expert sizes): keep the larger.
    let mut kept: Vec<u64> = Vec::new();
    for &b in v.iter().rev() {
        if kept.last().is_none_or(|&k| b * 11 < k * 10) {
            kept.push(b);
        }
    }
    kept.reverse();
    kept
}

fn best_phase(est: &Estimator, space: &Space, phase: PhaseKind, budget: u64, max_depth: u32) -> Layout {
    let cands = Candidates::new(est, space, phase);
    let fill = |depth, slot| fill(est, space, &cands, phase, budget, depth, slot);
    let base = Layout::all_cpu(&est.structure, est.unit_bytes.len());
    let mut best = (est.phase(phase, &base, false).time_ns, base);
    let mut consider = |l: Layout| {
        let t = est.phase(phase, &l, false).time_ns;
        if t < best.0 && est.vram(phase, &l).total() <= budget {
            best = (t, l);
        }
    };
    if let Some(l) = fill(0, 0) {
        consider(l);
    }
    // Every slot size at the deepest ring, then the shallower ring at the best size found (and wherever the
    // deeper ring does not fit).
    let deepest = DEPTHS.into_iter().filter(|&d| d <= max_depth).max().unwrap_or(DEPTHS[0]);
    let mut best_slot = None;
    for slot in slot_candidates(est, space) {
        match fill(deepest, slot) {
            Some(l) => {
                let t = est.phase(phase, &l, false).time_ns;
                consider(l);
                if best_slot.is_none_or(|(bt, _)| t < bt) {
                    best_slot = Some((t, slot));
                }
            }
            None if deepest > DEPTHS[0] => {
                if let Some(l) = fill(DEPTHS[0], slot) {
                    consider(l);
                }
            }
            None => {}
        }
    }
    if let Some((_, slot)) = best_slot.filter(|_| deepest > DEPTHS[0])
        && let Some(l) = fill(DEPTHS[0], slot)
    {
        consider(l);
    }
    best.1
}

/// What a phase's greedy passes share: the pin candidates in order, and the stream candidates in order
/// (expert layers stand for their chunks, which all have the same benefit).
struct Candidates {
    pins: Vec<Candidate>,
    streams: Vec<StreamCandidate>,
    chunk: u32,
}

#[derive(Debug, Clone, Copy)]
enum StreamCandidate {
    /// A group, with the slot it needs.
    Group { g: usize, slot: u64, saving_ns: f64, copy_ns: f64 },
    /// The CPU experts of a layer, in chunks.
    Experts { layer: usize, slot: u64, saving_ns: f64, copy_ns: f64 },
}

impl Candidates {
    fn new(est: &Estimator, space: &Space, phase: PhaseKind) -> Candidates {
        let costs = est.costs(phase);
        let st = &est.structure;
        let steps = costs.steps as f64;
        let saving = |units: &[usize]| -> f64 {
            units.iter().map(|&u| costs.units[u].cpu_ns - costs.units[u].gpu_ns).sum()
        };
        let chunk = st.n_experts().div_ceil(16).max(1);
        let by_ratio = |a: f64, pa: f64, b: f64, pb: f64| (b / pb.max(1.0)).total_cmp(&(a / pa.max(1.0)));

        let mut pins: Vec<Candidate> = Vec::new();
        let mut streams: Vec<StreamCandidate> = Vec::new();
        for (g, group) in space.groups.iter().enumerate() {
            let mut units = group.units.clone();
            units.extend(group.kv);
            let bytes = space.weight_bytes(est, g) + group.kv.map_or(0, |_| est.kv_layer_bytes);
            let choice = Choice { weights: Placement::Pinned, kv: Placement::Pinned };
            let saving_ns = saving(&units);
            pins.push(Candidate { mv: Move::Group(g, choice), price: bytes as f64, saving_ns, bytes });
            // A streamed attention shares its slot with its streamed KV.
            let largest = group.units.iter().map(|&u| est.unit_bytes[u]).max().unwrap_or(0);
            let slot = group
                .kv
                .map_or(largest, |_| largest.max(est.unit_bytes[group.units[0]] + est.kv_layer_bytes));
            let copy_ns = units.iter().map(|&u| costs.units[u].copy_ns).sum::<f64>() * steps;
            streams.push(StreamCandidate::Group { g, slot, saving_ns, copy_ns });
        }
        for &l in &space.expert_layers {
            let lu = &st.layers[l];
            let per = &costs.units[lu.experts[0]];
            let mut left = lu.experts.len() as u32;
            while left > 0 {
                let count = chunk.min(left);
                left -= count;
                let bytes = u64::from(count) * lu.expert_bytes;
                pins.push(Candidate {
                    mv: Move::Experts { layer: l, count, placement: Placement::Pinned },
                    price: bytes as f64,
                    saving_ns: f64::from(count) * (per.cpu_ns - per.pinned_gpu_ns()),
                    bytes,
                });
            }
            streams.push(StreamCandidate::Experts {
                layer: l,
                slot: lu.expert_bytes,
                saving_ns: per.cpu_ns - per.gpu_ns,
                copy_ns: per.copy_ns * steps,
            });
        }
        pins.retain(|c| c.saving_ns > 0.0);
        pins.sort_by(|a, b| by_ratio(a.saving_ns, a.price, b.saving_ns, b.price));
        let key = |c: &StreamCandidate| match *c {
            StreamCandidate::Group { saving_ns, copy_ns, .. }
            | StreamCandidate::Experts { saving_ns, copy_ns, .. } => (saving_ns, copy_ns),
        };
        streams.retain(|c| key(c).0 > 0.0);
        streams.sort_by(|a, b| {
            let ((sa, pa), (sb, pb)) = (key(a), key(b));
            by_ratio(sa, pa, sb, pb)
        });
        Candidates { pins, streams, chunk }
    }
}

/// One greedy pass at a given ring (depth × slot); `None` when the ring and scratch alone do not fit.
fn fill(
    est: &Estimator,
    space: &Space,
    cands: &Candidates,
    phase: PhaseKind,
    budget: u64,
    depth: u32,
    slot: u64,
) -> Option<Layout> {
    let costs = est.costs(phase);
    let fixed = est.runtime_overhead_bytes + costs.scratch_bytes + u64::from(depth) * slot;
    let mut avail = budget.checked_sub(fixed)?;
    let st = &est.structure;
    let mut layout = Layout::all_cpu(st, est.unit_bytes.len());
    layout.depth = depth;

    // Pins.
    for c in &cands.pins {
        if c.bytes <= avail {
            avail -= c.bytes;
            apply(space, &mut layout, c.mv);
        }
    }
    if slot == 0 {
        return Some(layout);
    }

    // Streams, among what stayed on the CPU and fits the slot.
    let mut streams: Vec<Move> = Vec::new();
    for c in &cands.streams {
        match *c {
            StreamCandidate::Group { g, slot: need, .. } => {
                if need <= slot && space.choice_of(&layout, g).weights == Placement::Cpu {
                    let choice = Choice { weights: Placement::Streamed, kv: Placement::Streamed };
                    streams.push(Move::Group(g, choice));
                }
            }
            StreamCandidate::Experts { layer, slot: need, .. } => {
                let mut left = if need <= slot { layout.experts[layer][2] } else { 0 };
                while left > 0 {
                    let count = cands.chunk.min(left);
                    left -= count;
                    streams.push(Move::Experts { layer, count, placement: Placement::Streamed });
                }
            }
        }
    }
    if streams.is_empty() {
        return Some(layout);
    }
    let with_prefix = |k: usize| {
        let mut l = layout.clone();
        for &mv in &streams[..k] {
            apply(space, &mut l, mv);
        }
        l
    };
    // The best prefix: sample 17 evenly spaced prefixes of the window, then narrow the window around the
    // best sample, until it is one move wide. Moves are applied incrementally between samples.
    let (mut lo, mut hi) = (0, streams.len());
    let mut best = (est.phase(phase, &layout, false).time_ns, 0);
    loop {
        let step = ((hi - lo) / 16).max(1);
        let mut l = with_prefix(lo);
        let mut applied = lo;
        let mut k = lo;
        while k <= hi {
            while applied < k {
                apply(space, &mut l, streams[applied]);
                applied += 1;
            }
            let t = est.phase(phase, &l, false).time_ns;
            if t < best.0 {
                best = (t, k);
            }
            k += step;
        }
        if step == 1 {
            break;
        }
        (lo, hi) = (best.1.saturating_sub(step), (best.1 + step).min(streams.len()));
    }
    Some(with_prefix(best.1))
}
