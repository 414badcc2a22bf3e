//! `ngl` against the paper's measured baseline: for each (model, context, budget, ubatch) cell of the
//! paper's RTX 5090 runs, the N our llama.cpp model picks next to the N the authors tuned. Exact agreement is
//! not expected (they tuned on a real machine and did not say how they measured VRAM); the test pins the
//! agreement where our model and theirs should agree (short contexts) and the shape everywhere. Run with
//! `--nocapture` for the table.

mod common;

use std::collections::BTreeMap;

use pipeshard_core::GIB;
use pipeshard_core::workload::Workload;
use pipeshard_planner::Planner;
use pipeshard_planner::ngl::Ngl;

use common::{cli3, model};

struct Cell {
    model: &'static str,
    ctx: u64,
    mva_mb: u64,
    ubatch: u64,
    paper: u32,
    prompt_tokens: u64,
}

fn cells() -> Vec<Cell> {
    include_str!("data/ngl_5090.csv")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let num = |i: usize| f[i].parse::<u64>().unwrap();
            Cell {
                model: match f[0] {
                    "minitron-4b" => "nemo-4b",
                    "minitron-8b" => "nemo-8b",
                    "qwen3-30b" => "qwen3-30b-a3b",
                    "qwen3-235b" => "qwen3-235b-a22b",
                    other => panic!("unknown model {other}"),
                },
                ctx: num(1),
                mva_mb: num(2),
                ubatch: num(3),
                paper: num(4) as u32,
                prompt_tokens: num(5),
            }
        })
        .collect()
}

fn workload(c: &Cell) -> Workload {
    // The sweep generated up to 128 tokens; VRAM does not depend on it.
    Workload::single(c.prompt_tokens, c.ctx, (c.ctx - c.prompt_tokens).min(128), c.ubatch)
}

/// N of an `ngl` plan (its decode placement: offloaded layers are pinned, plus the head past n_layers).
fn n_of(plan: &pipeshard_core::plan::Plan) -> u32 {
    use pipeshard_core::inventory::UnitId;
    use pipeshard_core::plan::Placement;
    let pinned = |id| plan.decode.placement(id) == Some(Placement::Pinned);
    let layers =
        plan.decode.placements.iter().filter(|u| matches!(u.unit, UnitId::Attn { .. })).count() as u32;
    (0..layers).filter(|&l| pinned(UnitId::Attn { layer: l })).count() as u32
        + u32::from(pinned(UnitId::Output))
}

#[test]
fn ngl_replays_the_papers_baseline() {
    let cost = cli3();
    let cells = cells();
    assert_eq!(cells.len(), 286);
    let mut ours: BTreeMap<(&str, u64, u64, u64), u32> = BTreeMap::new();
    let mut by_ctx: BTreeMap<u64, (u32, u32, u32, i64)> = BTreeMap::new();
    println!("{:16} {:>6} {:>6} {:>6} {:>5} {:>5}", "model", "ctx", "MB", "ubatch", "paper", "ours");
    for c in &cells {
        let spec = model(c.model);
        let plan = Ngl::default()
            .plan(&spec, &workload(c), &cost, c.mva_mb * 1_000_000)
            .expect("N = 0 fits every cell");
        let n = n_of(&plan);
        println!("{:16} {:>6} {:>6} {:>6} {:>5} {:>5}", c.model, c.ctx, c.mva_mb, c.ubatch, c.paper, n);
        ours.insert((c.model, c.ctx, c.mva_mb, c.ubatch), n);
        let d = i64::from(n) - i64::from(c.paper);
        let e = by_ctx.entry(c.ctx).or_default();
        *e = (e.0 + 1, e.1 + u32::from(d == 0), e.2 + u32::from(d.abs() <= 2), e.3 + d);
    }
    for (ctx, (n, exact, near, sum)) in &by_ctx {
        println!(
            "ctx {ctx:>6}: {n} cells, {exact} exact, {near} within ±2, mean ours − paper {:+.1}",
            *sum as f64 / f64::from(*n)
        );
    }
    // Short contexts, where the score matrix llama.cpp needs without flash attention is small: mostly within ±2.
    let (n, near) = by_ctx.range(..=4096).fold((0, 0), |a, (_, v)| (a.0 + v.0, a.1 + v.2));
    assert!(f64::from(near) >= 0.75 * f64::from(n), "{near} of {n} short-context cells within ±2");
    // Long contexts: without flash attention llama.cpp sizes the score matrix over every key (6 GiB at 64K for
    // nemo-4b), which the paper's N evidently did not count, so ours is never above theirs there.
    for c in cells.iter().filter(|c| c.ctx >= 16_384) {
        assert!(
            ours[&(c.model, c.ctx, c.mva_mb, c.ubatch)] <= c.paper + 1,
            "{} {} {}",
            c.model,
            c.ctx,
            c.mva_mb
        );
    }
    // Shape: more budget never offloads fewer layers, a longer context never more.
    for (&(m, ctx, mb, ub), &n) in &ours {
        for (&(m2, ctx2, mb2, ub2), &n2) in &ours {
            let broken = (ctx == ctx2 && mb2 > mb && n2 < n) || (mb == mb2 && ctx2 > ctx && n2 > n);
            assert!(
                !(m == m2 && ub == ub2 && broken),
                "{m} ub {ub}: {ctx}/{mb} → {n} but {ctx2}/{mb2} → {n2}"
            );
        }
    }
}

#[test]
fn the_papers_n_replays_as_a_fixed_n() {
    let cost = cli3();
    for c in cells().iter().filter(|c| c.ubatch == 1024) {
        let spec = model(c.model);
        // A budget no cell needs: the replay is about the placement; at 64K some of the paper's N would need
        // more than the 5090's 32 GiB once llama.cpp's score matrix is counted.
        let plan = Ngl { fixed_layers: Some(c.paper), ..Ngl::default() }.plan(
            &spec,
            &workload(c),
            &cost,
            1024 * GIB,
        );
        let plan = plan.unwrap_or_else(|e| panic!("{} {} -ngl {}: {e}", c.model, c.ctx, c.paper));
        // Values above n_layers + 1 mean "everything", as in llama.cpp.
        assert_eq!(n_of(&plan), c.paper.min(spec.text.n_layers + 1));
        assert!(!plan.workload.flash_attn && plan.prefill.op_offload);
    }
}
