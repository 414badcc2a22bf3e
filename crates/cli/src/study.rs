//! `pipeshard sim batch-study`: decode throughput against the number of parallel requests and the VRAM budget,
//! for every planner of an experiment (`experiments/batch-study.toml`), and where streaming a MoE model's
//! experts to the GPU starts to beat computing them on the CPU.
//!
//! The crossover is measured with the paper's own two templates, built by `pshard` with a forced strategy so
//! that nothing else changes between them: STATIC_ATTN_PRIO (attention pinned, the experts of the layers that
//! are not pinned whole computed on the CPU) and SHARD_ATTN_PRIO (the same experts streamed through a slot),
//! plus FULL_SHARD (whole layers streamed). Both sides of the comparison scale with the distinct experts R
//! tokens touch, E·(1−(1−k/E)^R); what moves the crossover is the tokens each touched expert runs, ≈ R·k/E
//! once all are touched: a CPU expert's time grows with them (it turns compute-bound), a streamed one's copy
//! does not. The crossover of a budget is the smallest batch from which streaming is at least as fast at every
//! larger batch of the grid.
//!
//! Writes `cells.csv` (every planner's cell, as `sim sweep` writes it), `crossover.csv` (per budget and batch:
//! tokens per expert, distinct experts touched, the three templates' TPS, the share of the non-pinned expert
//! bytes `ilp` streams), `throughput.png`, `crossover.png`, `summary.md` and `provenance.json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::Placement;
use pipeshard_core::workload::expected_touched_experts;
use pipeshard_planner::Planner;
use pipeshard_planner::pshard::{Pshard, Strategy};
use pipeshard_sim::{SimOptions, Simulation, Simulator};
use rayon::prelude::*;
use serde::Serialize;

use crate::args::{format_bytes, load_profile};
use crate::experiment::{Cell, Experiment};
use crate::plots::{BatchPanel, batch_panels};
use crate::sweep::{CellResult, git_commit, run_cells, write_csv, write_provenance};

#[derive(Debug, Args)]
pub struct BatchStudyArgs {
    /// The study's grid: one MoE model, budgets, batches, planners.
    #[arg(long, default_value = "experiments/batch-study.toml")]
    experiment: PathBuf,
    /// Machine profile (default: the experiment's); the results folder gets its name as a suffix.
    #[arg(long)]
    profile: Option<String>,
    #[arg(long, default_value = "results/studies")]
    out_dir: PathBuf,
}

/// The templates the crossover compares, CPU experts first.
const TEMPLATES: [Strategy; 3] = [Strategy::StaticAttnPrio, Strategy::ShardAttnPrio, Strategy::FullShard];

/// One row of `crossover.csv`.
#[derive(Debug, Clone, Serialize)]
struct CrossoverRow {
    vram_budget_bytes: u64,
    batch: u64,
    /// R·k/E: routed tokens per expert.
    tokens_per_expert: f64,
    /// Distinct experts R tokens touch per layer.
    touched_experts: f64,
    /// Aggregate decode TPS with the non-pinned experts on the CPU (STATIC_ATTN_PRIO).
    cpu_experts_tps: Option<f64>,
    /// … streamed to the GPU (SHARD_ATTN_PRIO).
    streamed_experts_tps: Option<f64>,
    /// … whole layers streamed (FULL_SHARD).
    full_shard_tps: Option<f64>,
    /// Best streamed template over CPU experts (empty where all experts fit on the GPU).
    streaming_speedup: Option<f64>,
    /// Share of the expert bytes `ilp`'s decode plan leaves off the GPU that it streams (the rest on the CPU).
    ilp_streamed_share: Option<f64>,
    /// Aggregate decode TPS of `ilp` and `pshard` (free choice; pshard's plan on our runtime, as ilp's runs).
    ilp_tps: Option<f64>,
    pshard_tps: Option<f64>,
    /// End-to-end latency of a request (prefill of all requests, then the decode steps) of `ilp` and `pshard`:
    /// what `ilp` minimises.
    ilp_e2el_ms: Option<f64>,
    pshard_e2el_ms: Option<f64>,
}

fn cell_of<'r>(results: &'r [CellResult], budget: u64, batch: u64, planner: &str) -> Option<&'r CellResult> {
    results.iter().find(|r| {
        r.cell.budget_bytes == budget && r.cell.batch == batch && r.cell.planner == planner && r.run.is_some()
    })
}

/// A cell's simulation on our runtime (a `pshard` plan also ran there): where the planners are compared.
fn sim_on_ours(r: Option<&CellResult>) -> Option<&Simulation> {
    r.and_then(|r| r.run.as_deref()).map(|x| x.sim_on_ours.as_ref().unwrap_or(&x.sim))
}

/// Aggregate decode TPS of one forced `pshard` template on a cell, and whether its decode plan leaves any
/// expert off the GPU (`None`: the template does not fit).
fn template_tps(
    cell: &Cell,
    spec: &ModelSpec,
    inv: &Inventory,
    cost: &TableCostModel,
    s: Strategy,
) -> Option<(f64, bool)> {
    let planner = Pshard { forced_strategy: Some(s), ..Pshard::default() };
    let budget = cell
        .planner_budget_bytes(cost.profile().machine.gpu_vram_bytes, cost.profile().runtime_overhead_bytes);
    let plan = planner.plan(spec, &cell.workload(), cost, budget).ok()?;
    let sim = Simulator::with_inventory(spec, inv, &plan, cost).ok()?.run(&SimOptions::default());
    let off_gpu = plan
        .decode
        .placements
        .iter()
        .any(|u| matches!(u.unit, UnitId::Expert { .. }) && u.placement != Placement::Pinned);
    Some((sim.metrics.tps, off_gpu))
}

pub fn run(a: &BatchStudyArgs, command: &str) -> anyhow::Result<()> {
    let commit = git_commit();
    let t0 = Instant::now();
    let mut e = Experiment::load(&a.experiment)?;
    if let Some(p) = &a.profile {
        e.name = format!(
            "{}-{}",
            e.name,
            Path::new(p).file_stem().map_or(p.clone(), |s| s.to_string_lossy().into())
        );
        e.profile.clone_from(p);
    }
    let specs = e.specs()?;
    let [model] = e.models()[..] else {
        bail!("{}: a batch study takes one model; it lists {}", a.experiment.display(), e.models().len());
    };
    let spec = &specs[model];
    let moe = spec.text.moe.as_ref().with_context(|| {
        format!(
            "{}: model `{model}` has no routed experts; the crossover needs a MoE model",
            a.experiment.display()
        )
    })?;
    let profile = load_profile(&e.profile)?;
    let cost = TableCostModel::new(&profile);
    let cells = e.cells();
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let results = run_cells(&cells, &specs, &cost, progress);

    let inv = Inventory::new(spec);
    // One cell per (budget, batch) for the templates: the first planner's.
    let keys: Vec<&Cell> = cells.iter().filter(|c| c.planner == e.planners[0]).collect();
    let rows: Vec<CrossoverRow> = keys
        .par_iter()
        .map(|c| {
            let [cpu_t, streamed_t, full_t] = TEMPLATES.map(|s| template_tps(c, spec, &inv, &cost, s));
            let [cpu, streamed, full] = [cpu_t, streamed_t, full_t].map(|t| t.map(|t| t.0));
            // Where every expert fits next to the CPU template's attention there is nothing to compare.
            let compared = cpu_t.is_some_and(|t| t.1);
            let best_streamed = streamed.into_iter().chain(full).reduce(f64::max).filter(|_| compared);
            let ilp = cell_of(&results, c.budget_bytes, c.batch, "ilp");
            let ilp_share = ilp.and_then(|r| {
                let w = r.run.as_deref()?.weights_by_placement[1];
                (w[1] + w[2] > 0).then(|| w[1] as f64 / (w[1] + w[2]) as f64)
            });
            let ps = cell_of(&results, c.budget_bytes, c.batch, "pshard");
            let tps = |r: Option<&CellResult>| sim_on_ours(r).map(|s| s.metrics.tps);
            let e2el = |r: Option<&CellResult>| sim_on_ours(r).map(|s| s.metrics.e2el_ms());
            CrossoverRow {
                vram_budget_bytes: c.budget_bytes,
                batch: c.batch,
                tokens_per_expert: c.batch as f64 * f64::from(moe.top_k) / f64::from(moe.n_experts),
                touched_experts: expected_touched_experts(moe.n_experts, moe.top_k, c.batch),
                cpu_experts_tps: cpu,
                streamed_experts_tps: streamed,
                full_shard_tps: full,
                streaming_speedup: best_streamed.zip(cpu).map(|(s, c)| s / c),
                ilp_streamed_share: ilp_share,
                ilp_tps: tps(ilp),
                pshard_tps: tps(ps),
                ilp_e2el_ms: e2el(ilp),
                pshard_e2el_ms: e2el(ps),
            }
        })
        .collect();

    let dir = a.out_dir.join(&e.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = vec![dir.join("cells.csv"), dir.join("crossover.csv")];
    write_csv(&results, &written[0])?;
    let mut w =
        csv::Writer::from_path(&written[1]).with_context(|| format!("writing {}", written[1].display()))?;
    for r in &rows {
        w.serialize(r)?;
    }
    w.flush()?;
    written.extend(plots(&e, &results, &rows, &dir)?);
    let summary = summary(&e, model, &results, &rows);
    let path = dir.join("summary.md");
    std::fs::write(&path, &summary).with_context(|| format!("writing {}", path.display()))?;
    written.push(path);
    written.push(write_provenance(
        &dir,
        &e,
        &profile,
        command,
        commit,
        &results,
        t0.elapsed().as_secs_f64(),
    )?);
    print!("{summary}");
    println!("wrote {}", written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "));
    Ok(())
}

/// The crossover of each budget: the smallest batch from which the best streamed template is at least as
/// fast as CPU experts at every larger batch (`None`: CPU experts win at the largest batch).
fn crossovers(rows: &[CrossoverRow]) -> BTreeMap<u64, Option<&CrossoverRow>> {
    let mut by_budget: BTreeMap<u64, Vec<&CrossoverRow>> = BTreeMap::new();
    for r in rows {
        by_budget.entry(r.vram_budget_bytes).or_default().push(r);
    }
    by_budget
        .into_iter()
        .map(|(b, mut v)| {
            v.sort_by_key(|r| r.batch);
            let wins = |r: &&CrossoverRow| r.streaming_speedup.is_some_and(|s| s >= 1.0);
            let from = v.iter().rposition(|r| !wins(r)).map_or(0, |i| i + 1);
            (b, v.get(from).copied())
        })
        .collect()
}

fn fmt(x: Option<f64>, d: usize) -> String {
    x.map_or_else(|| "—".into(), |v| format!("{v:.d$}"))
}

fn summary(e: &Experiment, model: &str, results: &[CellResult], rows: &[CrossoverRow]) -> String {
    let mut s = format!(
        "# Batch study: {model} on {}\n\n{}\n\nAggregate decode throughput (tokens/s summed over requests) of every planner, and \
         where streaming experts beats CPU experts (pshard's STATIC_ATTN_PRIO vs SHARD_ATTN_PRIO / FULL_SHARD, \
         `crossover.csv`).\n\n## Crossover\n\n| budget | streaming first wins at batch | wins from batch on | tokens per \
         expert there (R·k/E) | distinct experts touched | speed-up of streaming there | at the largest batch | `ilp` \
         streams most off-GPU expert bytes from batch |\n|---|---|---|---|---|---|---|---|\n",
        e.profile, e.description
    );
    for (b, r) in crossovers(rows) {
        let mine = || rows.iter().filter(move |x| x.vram_budget_bytes == b);
        let last = mine().max_by_key(|x| x.batch);
        let first_at = |f: &dyn Fn(&CrossoverRow) -> bool| {
            mine()
                .filter(|x| f(x))
                .map(|x| x.batch)
                .min()
                .map_or_else(|| "never in the grid".into(), |n| n.to_string())
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            format_bytes(b),
            first_at(&|x| x.streaming_speedup.is_some_and(|v| v >= 1.0)),
            r.map_or_else(|| "never in the grid".into(), |r| r.batch.to_string()),
            fmt(r.map(|r| r.tokens_per_expert), 2),
            fmt(r.map(|r| r.touched_experts), 1),
            fmt(r.and_then(|r| r.streaming_speedup), 2),
            fmt(last.and_then(|r| r.streaming_speedup), 2),
            first_at(&|x| x.ilp_streamed_share.is_some_and(|v| v > 0.5)),
        );
    }
    s.push_str("\n## Throughput by planner (tokens/s; budget rows, batch columns)\n\n");
    let mut batches: Vec<u64> = rows.iter().map(|r| r.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    for p in &e.planners {
        let _ = writeln!(
            s,
            "**{p}**\n\n| budget | {} |",
            batches.iter().map(u64::to_string).collect::<Vec<_>>().join(" | ")
        );
        let _ = writeln!(s, "|---|{}", "---|".repeat(batches.len()));
        for &b in &e.budgets() {
            let cells: Vec<String> = batches
                .iter()
                .map(|&n| {
                    fmt(
                        cell_of(results, b, n, p).and_then(|r| r.run.as_deref()).map(|x| x.sim.metrics.tps),
                        1,
                    )
                })
                .collect();
            let _ = writeln!(s, "| {} | {} |", format_bytes(b), cells.join(" | "));
        }
        s.push('\n');
    }
    for (what, ratio) in [
        (
            "aggregate TPS",
            rows.iter().filter_map(|r| r.ilp_tps.zip(r.pshard_tps).map(|(i, p)| i / p)).collect::<Vec<_>>(),
        ),
        (
            "E2EL speed-up, its objective",
            rows.iter().filter_map(|r| r.ilp_e2el_ms.zip(r.pshard_e2el_ms).map(|(i, p)| p / i)).collect(),
        ),
    ] {
        let below = ratio.iter().filter(|x| **x < 0.999).count();
        let geo = (ratio.iter().map(|x| x.ln()).sum::<f64>() / ratio.len().max(1) as f64).exp();
        let _ = writeln!(
            s,
            "`ilp` over `pshard`, {what}: geomean ×{geo:.2} over {} cells, {below} below ×0.999.\n",
            ratio.len()
        );
    }
    s
}

fn plots(
    e: &Experiment,
    results: &[CellResult],
    rows: &[CrossoverRow],
    dir: &Path,
) -> anyhow::Result<Vec<PathBuf>> {
    let panel = |b: u64, lines: BTreeMap<String, Vec<(u64, f64)>>| BatchPanel {
        caption: format!("budget {}", format_bytes(b)),
        lines,
    };
    let throughput: Vec<BatchPanel> = e
        .budgets()
        .into_iter()
        .map(|b| {
            let mut lines: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
            for r in results.iter().filter(|r| r.cell.budget_bytes == b) {
                if let Some(x) = r.run.as_deref() {
                    lines.entry(r.cell.planner.clone()).or_default().push((r.cell.batch, x.sim.metrics.tps));
                }
            }
            panel(b, lines)
        })
        .collect();
    let p1 = dir.join("throughput.png");
    batch_panels(
        &format!("{}: aggregate decode TPS vs parallel requests, per budget ({})", e.name, e.profile),
        "tokens/s (all requests)",
        &e.planners,
        &throughput,
        &p1,
    )?;
    let names = ["CPU experts (STATIC)", "streamed experts (SHARD)", "whole layers streamed (FULL_SHARD)"];
    let crossover: Vec<BatchPanel> = e
        .budgets()
        .into_iter()
        .map(|b| {
            let mut lines: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
            for r in rows.iter().filter(|r| r.vram_budget_bytes == b) {
                for (name, v) in
                    names.iter().zip([r.cpu_experts_tps, r.streamed_experts_tps, r.full_shard_tps])
                {
                    if let Some(v) = v {
                        lines.entry((*name).to_string()).or_default().push((r.batch, v));
                    }
                }
            }
            for v in lines.values_mut() {
                v.sort_by_key(|x| x.0);
            }
            panel(b, lines)
        })
        .collect();
    let p2 = dir.join("crossover.png");
    batch_panels(
        &format!("{}: experts on the CPU vs streamed to the GPU (pshard templates, {})", e.name, e.profile),
        "tokens/s (all requests)",
        &names.map(String::from),
        &crossover,
        &p2,
    )?;
    Ok(vec![p1, p2])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(budget: u64, batch: u64, speedup: Option<f64>) -> CrossoverRow {
        CrossoverRow {
            vram_budget_bytes: budget,
            batch,
            tokens_per_expert: batch as f64 / 16.0,
            touched_experts: 0.0,
            cpu_experts_tps: None,
            streamed_experts_tps: None,
            full_shard_tps: None,
            streaming_speedup: speedup,
            ilp_streamed_share: None,
            ilp_tps: None,
            pshard_tps: None,
            ilp_e2el_ms: None,
            pshard_e2el_ms: None,
        }
    }

    #[test]
    fn crossover_is_where_streaming_keeps_winning() {
        let rows = vec![
            // Budget 1: wins at 4, loses at 16, wins from 64 on: the crossover is 64.
            row(1, 1, Some(0.5)),
            row(1, 4, Some(1.2)),
            row(1, 16, Some(0.9)),
            row(1, 64, Some(1.5)),
            row(1, 128, Some(2.0)),
            // Budget 2: never wins; budget 3: wins everywhere; budget 4: no streamed plan at the top.
            row(2, 1, Some(0.5)),
            row(2, 64, Some(0.8)),
            row(3, 1, Some(1.0)),
            row(3, 64, Some(3.0)),
            row(4, 1, Some(2.0)),
            row(4, 64, None),
        ];
        let c = crossovers(&rows);
        assert_eq!(c[&1].map(|r| r.batch), Some(64));
        assert_eq!(c[&2].map(|r| r.batch), None);
        assert_eq!(c[&3].map(|r| r.batch), Some(1));
        assert_eq!(c[&4].map(|r| r.batch), None);
    }
}
