//! The simulator as the judge of a searching planner's candidates.
//!
//! The estimator sums work over units and so cannot see what depends on order and timing: a streamed MoE
//! layer's expert copies wait for its router, a chunk starts with an empty ring, compute slows down while DMA
//! shares host DRAM, CPU and GPU expert shares of a layer overlap. `ilp` therefore turns its solution into a
//! few candidate layouts per phase — the program's, `greedy`'s, each with its ring deepened to what the budget
//! allows (the estimator never needs more than two slots; the simulator's router barrier and per-chunk fill
//! do), with its streaming dropped (streamed units back on the CPU), and in prefill with llama.cpp's op
//! offload for the CPU-resident units — and lets [`pipeshard_sim`] pick.
//!
//! Each candidate's phase is simulated once, alone, with few samples ([`JUDGE_OPTIONS`]); the phases are then
//! combined freely: prefill candidate `i` with decode candidate `j` scores `prefill_i + switch(i, j) +
//! decode_j`, with the switch timed as the simulator times it (one H2D copy of the re-uploaded bytes). A
//! prefill candidate is simulated to the end only if its lower bound
//! ([`Simulator::prefill_lower_bound_ns`]: its task graphs with no ring slot to wait for) could still beat the
//! best pair of a candidate before it, which the choice keeps whatever follows; the choice is the same as with
//! every candidate simulated. The graphs built for the bound are the ones simulated
//! ([`Simulator::prefill_ns_unless`]).

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::workload::Workload;
use pipeshard_sim::{SimOptions, Simulator};
use rayon::prelude::*;

use crate::estimate::{Estimator, Layout};
use crate::space::{Choice, Space};
use crate::{Decision, Objective, assemble};

/// Few samples: candidates differ by far more than the interpolation error.
pub const JUDGE_OPTIONS: SimOptions =
    SimOptions { prefill_samples: 2, decode_samples: 2, exact: false, trace: false };

/// Largest ring a deepened candidate gets by default (pshard's rings of small experts reach 128 slots).
pub const MAX_JUDGED_DEPTH: u32 = 128;

/// Prefill candidates the estimator finds more than this many times slower than the fastest are not simulated.
pub const PRUNE_FACTOR: f64 = 2.0;

/// Pairs within this fraction of the best judged pair have their decode judged again with the sampling the
/// tables use ([`SimOptions::default`]): two decode samples cannot tell pairs 0.1% apart, which the tables
/// can. (Prefill keeps its judged time: re-simulating it cost the qwen3-235b-a22b bench ≈ 10%.)
pub const NEAR_TIE: f64 = 0.005;

/// At most this many near-tied pairs are judged again (the best first).
pub const MAX_REJUDGED: usize = 4;

/// A candidate layout of one phase; prefill ones may run llama.cpp's op offload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub layout: Layout,
    pub op_offload: bool,
}

/// A candidate with its simulated phase time and where it came from.
#[derive(Debug, Clone)]
struct Timed {
    candidate: Candidate,
    /// Prefill: TTFT; decode: the steps without the switch.
    ns: f64,
    source: usize,
}

/// What judging one candidate's phase found.
enum Judged {
    /// Its simulated time.
    Simulated(f64),
    /// A lower bound of its time already loses to a candidate simulated before.
    Beaten,
}

/// The model, workload and machine a judgement runs on.
pub struct Judge<'a> {
    pub spec: &'a ModelSpec,
    pub inv: &'a Inventory,
    pub est: &'a Estimator,
    pub workload: &'a Workload,
    pub cost: &'a dyn CostModel,
    pub budget_bytes: u64,
    pub objective: Objective,
    /// Largest ring a candidate may have.
    pub max_depth: u32,
}

impl std::fmt::Debug for Judge<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Judge")
            .field("model", &self.spec.name)
            .field("budget_bytes", &self.budget_bytes)
            .finish()
    }
}

impl Judge<'_> {
    /// The variants of a phase layout worth simulating (the layout itself first; only those that fit).
    #[must_use]
    pub fn variants(&self, phase: PhaseKind, layout: &Layout) -> Vec<Candidate> {
        let est = self.est;
        let plain = Candidate { layout: layout.clone(), op_offload: false };
        let mut out = vec![plain];
        if layout.streams(&est.structure) {
            let mut deep = layout.clone();
            deep.depth = self.deepest(phase, layout);
            if deep.depth > layout.depth {
                out.push(Candidate { layout: deep, op_offload: false });
            }
            out.push(Candidate { layout: unstreamed(est, layout), op_offload: false });
        }
        // CPU work streamed instead: what fits the current slot, and everything.
        let slot = est.slot_bytes(layout);
        for cap in [slot, u64::MAX].into_iter().filter(|&c| c > 0) {
            let mut l = self.streamed_instead_of_cpu(layout, cap);
            if l != *layout && l.streams(&est.structure) {
                l.depth = 1;
                l.depth = self.deepest(phase, &l);
                out.push(Candidate { layout: l, op_offload: false });
            }
        }
        if phase == PhaseKind::Prefill && est.prefill.tier_tokens >= crate::estimate::OP_OFFLOAD_MIN_TOKENS {
            // Op offload serves CPU-resident units: the layout as solved, and without its streaming. Staging the
            // weights takes VRAM: unpin the largest groups until it fits.
            let bases: Vec<Layout> = [layout.clone(), unstreamed(est, layout)].into_iter().collect();
            for base in bases {
                if let Some(l) = self.unpinned_to_fit_offload(base) {
                    out.push(Candidate { layout: l, op_offload: true });
                }
            }
        }
        out.retain(|c| self.fits(phase, &c.layout, c.op_offload));
        let mut distinct: Vec<Candidate> = Vec::with_capacity(out.len());
        for c in out {
            if !distinct.contains(&c) {
                distinct.push(c);
            }
        }
        out = distinct;
        if phase == PhaseKind::Prefill {
            // Prefill simulations dominate the cost of judging (a chunk of a streamed MoE is thousands of
            // copies): skip what even the estimator, however blind to timing, finds more than twice as slow.
            let time = |c: &Candidate| est.phase(phase, &c.layout, c.op_offload).time_ns;
            let best = out.iter().map(time).fold(f64::INFINITY, f64::min);
            out.retain(|c| time(c) <= PRUNE_FACTOR * best);
        }
        out
    }

    /// `layout` with every CPU group and routed expert whose slot would be at most `cap` bytes streamed.
    fn streamed_instead_of_cpu(&self, layout: &Layout, cap: u64) -> Layout {
        let est = self.est;
        let space = Space::new(&est.structure);
        let mut l = layout.clone();
        let stream = Choice { weights: Placement::Streamed, kv: Placement::Streamed };
        for (g, group) in space.groups.iter().enumerate() {
            let largest = group.units.iter().map(|&u| est.unit_bytes[u]).max().unwrap_or(0);
            // A streamed attention carries its streamed KV in its slot.
            let need = group
                .kv
                .map_or(largest, |_| largest.max(est.unit_bytes[group.units[0]] + est.kv_layer_bytes));
            if space.choice_of(&l, g).weights == Placement::Cpu && need <= cap {
                space.apply(&mut l, g, stream);
            }
        }
        for (c, lu) in l.experts.iter_mut().zip(&est.structure.layers) {
            if lu.expert_bytes <= cap {
                *c = [c[0], c[1] + c[2], 0];
            }
        }
        l
    }

    /// `layout` with its largest pinned groups (or a layer's pinned experts) moved to the CPU until it fits
    /// with op offload in prefill; `None` if even nothing pinned does not fit.
    fn unpinned_to_fit_offload(&self, mut layout: Layout) -> Option<Layout> {
        /// A pinned group, or the pinned routed experts of a layer.
        enum Pinned {
            Group(usize),
            Experts(usize),
        }
        let est = self.est;
        let space = Space::new(&est.structure);
        let cpu = Choice { weights: Placement::Cpu, kv: Placement::Cpu };
        while !self.fits(PhaseKind::Prefill, &layout, true) {
            let groups = (0..space.groups.len())
                .filter(|&g| space.choice_of(&layout, g).weights == Placement::Pinned)
                .map(|g| (space.weight_bytes(est, g), Pinned::Group(g)));
            let experts =
                est.structure.layers.iter().zip(&layout.experts).enumerate().filter(|(_, (_, c))| c[0] > 0);
            let experts = experts.map(|(l, (lu, c))| (u64::from(c[0]) * lu.expert_bytes, Pinned::Experts(l)));
            let (_, largest) = groups.chain(experts).max_by_key(|(bytes, _)| *bytes)?;
            match largest {
                Pinned::Group(g) => space.apply(&mut layout, g, cpu),
                Pinned::Experts(l) => {
                    let c = &mut layout.experts[l];
                    *c = [0, c[1], c[0] + c[2]];
                }
            }
            if !layout.streams(&est.structure) {
                layout.depth = 0;
            }
        }
        Some(layout)
    }

    /// `layout` unchanged as a candidate of `phase`, if it fits that phase's budget.
    #[must_use]
    pub fn as_is(&self, phase: PhaseKind, layout: &Layout) -> Option<Candidate> {
        self.fits(phase, layout, false).then(|| Candidate { layout: layout.clone(), op_offload: false })
    }

    /// The deepest ring (up to [`MAX_JUDGED_DEPTH`]) the budget leaves room for.
    fn deepest(&self, phase: PhaseKind, layout: &Layout) -> u32 {
        let slot = self.est.slot_bytes(layout);
        let mut l = layout.clone();
        l.depth = 0;
        let fixed = self.est.vram(phase, &l).total();
        let room = self.budget_bytes.saturating_sub(fixed) / slot.max(1);
        u32::try_from(room).unwrap_or(u32::MAX).min(self.max_depth).max(layout.depth)
    }

    fn fits(&self, phase: PhaseKind, layout: &Layout, op_offload: bool) -> bool {
        self.est.vram_offload(phase, layout, op_offload).total() <= self.budget_bytes
    }

    /// The best pair of candidates in the simulator among the variants of each source's `(prefill, decode)`
    /// layouts (each phase's layout also tried in the other phase, which saves the switch), and a note
    /// naming the sources the pair came from.
    #[must_use]
    pub fn choose(
        &self,
        planner: &str,
        sources: &[(&str, Layout, Layout)],
    ) -> (Candidate, Candidate, String) {
        // Every distinct candidate of each phase with the partner it is judged beside, in source order; they
        // are simulated in parallel (independent and pure), and kept in that order, so the choice is the same.
        let mut jobs: [Vec<(Candidate, Candidate, usize)>; 2] = [Vec::new(), Vec::new()];
        for (k, (_, p, d)) in sources.iter().enumerate() {
            for (i, phase, own, other) in [(0, PhaseKind::Prefill, p, d), (1, PhaseKind::Decode, d, p)] {
                let mut cands = self.variants(phase, own);
                cands.extend(self.as_is(phase, other));
                // The other phase as its source has it (prefill's KV write-backs depend on the decode plan).
                let partner = Candidate { layout: other.clone(), op_offload: false };
                for c in cands {
                    if !jobs[i].iter().any(|(j, ..)| *j == c) {
                        jobs[i].push((c, partner.clone(), k));
                    }
                }
            }
        }
        let dec: Vec<Timed> = jobs[1]
            .par_iter()
            .filter_map(|(c, partner, k)| {
                match self.simulate(planner, PhaseKind::Decode, partner, c, &JUDGE_OPTIONS, None)? {
                    Judged::Simulated(ns) => Some(Timed { candidate: c.clone(), ns, source: *k }),
                    Judged::Beaten => None,
                }
            })
            .collect();
        // The best pair is at most the value of any pair seen before, and only pairs within NEAR_TIE of the best
        // are judged again: so a prefill candidate whose time provably gives no pair within NEAR_TIE of the best
        // pair of an earlier candidate is not simulated to the end, only counted. Candidates go in waves of one
        // per thread, each wave bounded by the candidates before it.
        let pair_value = |a: &Layout, a_ns: f64| {
            dec.iter()
                .map(|b| self.value(a_ns, self.switch_ns(a, &b.candidate.layout), b.ns))
                .fold(f64::INFINITY, f64::min)
        };
        let mut pre: Vec<Timed> = Vec::new();
        let (mut cutoff, mut skipped) = (f64::INFINITY, 0);
        for wave in jobs[0].chunks(rayon::current_num_threads().max(1)) {
            let judged: Vec<(Judged, &Candidate, usize)> = wave
                .par_iter()
                .filter_map(|(c, partner, k)| {
                    let beaten = |bound_ns: f64| pair_value(&c.layout, bound_ns) >= cutoff * (1.0 + NEAR_TIE);
                    let judged = self.simulate(
                        planner,
                        PhaseKind::Prefill,
                        c,
                        partner,
                        &JUDGE_OPTIONS,
                        Some(&beaten),
                    )?;
                    Some((judged, c, *k))
                })
                .collect();
            for (judged, c, source) in judged {
                match judged {
                    Judged::Simulated(ns) => {
                        cutoff = cutoff.min(pair_value(&c.layout, ns));
                        pre.push(Timed { candidate: c.clone(), ns, source });
                    }
                    Judged::Beaten => skipped += 1,
                }
            }
        }
        let mut values = Vec::with_capacity(pre.len() * dec.len());
        for (i, a) in pre.iter().enumerate() {
            for (j, b) in dec.iter().enumerate() {
                let switch = self.switch_ns(&a.candidate.layout, &b.candidate.layout);
                values.push((self.value(a.ns, switch, b.ns), i, j));
            }
        }
        let mut best = first_clear_best(&values);
        if let Some((v, ..)) = best {
            // Near ties, best first, their decode judged again over more steps; the pair order (source order)
            // still breaks ties, so the choice stays deterministic.
            let mut near: Vec<(f64, usize, usize)> =
                values.iter().copied().filter(|(x, ..)| *x <= v * (1.0 + NEAR_TIE)).collect();
            if near.len() > 1 {
                near.sort_by(|a, b| a.0.total_cmp(&b.0));
                near.truncate(MAX_REJUDGED);
                near.sort_by_key(|&(_, i, j)| (i, j));
                let full = SimOptions::default();
                let rejudged: Vec<(f64, usize, usize)> = near
                    .par_iter()
                    .filter_map(|&(_, i, j)| {
                        let (a, b) = (&pre[i].candidate, &dec[j].candidate);
                        let Judged::Simulated(d) =
                            self.simulate(planner, PhaseKind::Decode, a, b, &full, None)?
                        else {
                            return None;
                        };
                        Some((self.value(pre[i].ns, self.switch_ns(&a.layout, &b.layout), d), i, j))
                    })
                    .collect();
                best = first_clear_best(&rejudged).or(best);
            }
        }
        let Some((_, i, j)) = best else {
            // Nothing could be simulated: the first source as it is.
            let (_, p, d) = &sources[0];
            let plain = |l: &Layout| Candidate { layout: l.clone(), op_offload: false };
            return (plain(p), plain(d), "the simulator could not judge; the first plan kept".into());
        };
        let (a, b) = (&pre[i], &dec[j]);
        let note = format!(
            "simulator's choice among {} prefill and {} decode candidates: prefill from {} (depth {}{}), decode \
             from {} (depth {})",
            pre.len() + skipped,
            dec.len(),
            sources[a.source].0,
            a.candidate.layout.depth,
            if a.candidate.op_offload { ", op offload" } else { "" },
            sources[b.source].0,
            b.candidate.layout.depth
        );
        (a.candidate.clone(), b.candidate.clone(), note)
    }

    /// The objective's value of a pair: prefill time, switch and decode time (ties on the objective's phase
    /// broken by E2EL).
    fn value(&self, prefill_ns: f64, switch_ns: f64, decode_ns: f64) -> f64 {
        let e2el = prefill_ns + switch_ns + decode_ns;
        match self.objective {
            Objective::E2el => e2el,
            Objective::Ttft => prefill_ns + 1e-6 * e2el,
            Objective::Tps => decode_ns / (self.workload.gen_tokens as f64).max(1.0) + 1e-6 * e2el,
        }
    }

    fn switch_ns(&self, prefill: &Layout, decode: &Layout) -> f64 {
        let bytes = self.est.switch_bytes(prefill, decode);
        if bytes == 0 { 0.0 } else { self.cost.h2d_ns(bytes, true) as f64 }
    }

    /// The simulated time of `phase` in the plan of `prefill` and `decode` under `opts` (`None` if the plan
    /// cannot be simulated); in prefill, not simulated when `beaten` holds for a lower bound of it.
    fn simulate(
        &self,
        planner: &str,
        phase: PhaseKind,
        prefill: &Candidate,
        decode: &Candidate,
        opts: &SimOptions,
        beaten: Option<&dyn Fn(f64) -> bool>,
    ) -> Option<Judged> {
        let d = Decision::searched(self.est, prefill.layout.clone(), decode.layout.clone(), Vec::new())
            .with_op_offload(self.est, prefill.op_offload);
        let plan = assemble(planner, self.spec, self.inv, self.est, self.workload, self.budget_bytes, d);
        let sim = Simulator::with_inventory(self.spec, self.inv, &plan, self.cost).ok()?;
        if let (PhaseKind::Prefill, Some(beaten)) = (phase, beaten) {
            let ns = sim.prefill_ns_unless(opts, &|bound_ns| beaten(bound_ns as f64));
            return Some(ns.map_or(Judged::Beaten, |ns| Judged::Simulated(ns as f64)));
        }
        Some(Judged::Simulated(sim.phase_ns(phase, opts) as f64))
    }
}

/// The first of `(value, …)` that no later one beats clearly: the first candidates are the searches' own, and
/// equal times would otherwise pick a deeper ring for nothing, so a later one must win by 0.01%.
fn first_clear_best(values: &[(f64, usize, usize)]) -> Option<(f64, usize, usize)> {
    let mut best: Option<(f64, usize, usize)> = None;
    for &x in values {
        if best.is_none_or(|(v, ..)| x.0 < v * (1.0 - 1e-4)) {
            best = Some(x);
        }
    }
    best
}

/// `layout` with every streamed unit and expert on the CPU instead (no ring).
fn unstreamed(est: &Estimator, layout: &Layout) -> Layout {
    let mut l = layout.clone();
    for p in &mut l.placements {
        if *p == Placement::Streamed {
            *p = Placement::Cpu;
        }
    }
    // A KV follows its attention: to the CPU with it, or still streamed beside a pinned attention.
    for lu in &est.structure.layers {
        l.placements[lu.kv] =
            if l.placements[lu.attn] == Placement::Cpu { Placement::Cpu } else { layout.placements[lu.kv] };
    }
    for c in &mut l.experts {
        *c = [c[0], 0, c[1] + c[2]];
    }
    l.depth = if l.streams(&est.structure) { layout.depth } else { 0 };
    l
}
