//! `pipeshard sim sweep`: plan and simulate a grid of cells in parallel; write `cells.csv`, `provenance.json`
//! and plots under `results/sweeps/<name>/`; print a summary.
//!
//! [`run_cells`] is shared with `pipeshard compare`: each cell runs its planner on the profile's cost model and
//! simulates the plan (sampled steps, see pipeshard-sim). A planner that finds no plan within the budget gives
//! an `infeasible` row with its reason, never a crash.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use pipeshard_core::cost::CostModel;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhasePlan, Placement, Plan, PlanInvalid};
use pipeshard_core::profile::{self, Profile};
use pipeshard_planner::{PlanError, PlannerOptions};
use pipeshard_sim::{Runtime, SimOptions, Simulation, Simulator};
use rayon::prelude::*;
use serde::Serialize;

use crate::args::{format_bytes, format_tokens, load_profile};
use crate::experiment::{Cell, Experiment};
use crate::output::{Format, render};

/// How a cell ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    /// The planner found no plan within the budget.
    Infeasible,
    /// The planner does not handle this case (e.g. the exhaustive planner on a large model).
    Unsupported,
    /// The workload is invalid, or the plan could not be simulated.
    Error,
}

/// A planned and simulated cell.
#[derive(Debug, Clone)]
pub struct CellRun {
    pub plan: Plan,
    pub sim: Simulation,
    /// The same plan on our runtime, when `sim` ran it on the artifact's (a `pshard` plan): our planners' plans
    /// run on ours, so they are compared with this.
    pub sim_on_ours: Option<Simulation>,
    /// Weight bytes pinned / streamed / on the CPU, per phase.
    pub weights_by_placement: [[u64; 3]; 2],
}

/// What became of a cell.
#[derive(Debug, Clone)]
pub struct CellResult {
    pub cell: Cell,
    pub status: Status,
    pub reason: String,
    pub run: Option<Box<CellRun>>,
    /// Wall time the planner took (not written to the CSV, which stays reproducible).
    pub plan_ms: f64,
    /// Wall time the simulation took.
    pub sim_ms: f64,
}

fn weights_by_placement(inv: &Inventory, pp: &PhasePlan) -> [u64; 3] {
    let mut v = [0u64; 3];
    for up in pp.placements.iter().filter(|u| !matches!(u.unit, UnitId::Kv { .. })) {
        let i = match up.placement {
            Placement::Pinned => 0,
            Placement::Streamed => 1,
            Placement::Cpu => 2,
        };
        v[i] += inv.unit_bytes(up.unit);
    }
    v
}

/// Plans and simulates one cell; `inv` is the inventory of `spec`.
pub fn run_cell(cell: &Cell, spec: &ModelSpec, inv: &Inventory, cost: &TableCostModel) -> CellResult {
    let t0 = Instant::now();
    let elapsed = || t0.elapsed().as_secs_f64() * 1e3;
    let failed = |status: Status, reason: String, plan_ms: f64| CellResult {
        cell: cell.clone(),
        status,
        reason,
        run: None,
        plan_ms,
        sim_ms: 0.0,
    };
    let w = cell.workload();
    if let Err(e) = w.validate() {
        return failed(Status::Error, e.to_string(), 0.0);
    }
    let options = PlannerOptions {
        ngl_layers: cell.ngl_layers,
        ngl_flash_attn: cell.ngl_flash_attn,
        ..PlannerOptions::default()
    };
    let Some(planner) = pipeshard_planner::with_options(&cell.planner, &options) else {
        return failed(Status::Error, format!("unknown planner `{}`", cell.planner), 0.0);
    };
    let budget =
        cell.planner_budget_bytes(cost.profile().machine.gpu_vram_bytes, cost.runtime_overhead_bytes());
    let planned = planner.plan(spec, &w, cost, budget);
    let plan_ms = elapsed();
    let plan = match planned {
        Ok(p) => p,
        Err(PlanError::Infeasible { min_budget_bytes, .. }) => {
            return failed(
                Status::Infeasible,
                format!("needs at least {:.2} GiB", gib(min_budget_bytes)),
                plan_ms,
            );
        }
        Err(e @ PlanError::Unsupported { .. }) => return failed(Status::Unsupported, e.to_string(), plan_ms),
        Err(e) => return failed(Status::Error, e.to_string(), plan_ms),
    };
    let plan = match cell.depth {
        None => plan,
        Some(d) => match plan.with_pipeline_depth(d, inv) {
            Ok(deeper) => deeper,
            Err(e @ PlanInvalid::OverBudget { .. }) => {
                return failed(Status::Infeasible, format!("depth {d}: {e}"), plan_ms);
            }
            Err(e) => return failed(Status::Error, format!("depth {d}: {e}"), plan_ms),
        },
    };
    let t1 = Instant::now();
    // On the paper's machines (derived profiles) `pshard` stands for the paper's system, its plans running on the
    // artifact's runtime, and `ngl` on stock llama.cpp; on a measured machine every plan runs on our executor.
    let paper_machine = matches!(cost.profile().provenance, profile::Provenance::Derived { .. });
    let runtime = match cell.planner.as_str() {
        "pshard" if paper_machine => Runtime::Artifact,
        "ngl" if paper_machine => Runtime::Stock,
        _ => Runtime::Ours,
    };
    let simulator = match Simulator::with_inventory(spec, inv, &plan, cost) {
        Ok(s) => s,
        Err(e) => {
            return failed(Status::Error, format!("simulating the {} plan: {e}", cell.planner), plan_ms);
        }
    };
    let sim_on_ours = (runtime == Runtime::Artifact).then(|| simulator.run(&SimOptions::default()));
    let sim = simulator.with_runtime(runtime).run(&SimOptions::default());
    let weights = [weights_by_placement(inv, &plan.prefill), weights_by_placement(inv, &plan.decode)];
    CellResult {
        cell: cell.clone(),
        status: Status::Ok,
        reason: String::new(),
        run: Some(Box::new(CellRun { plan, sim, sim_on_ours, weights_by_placement: weights })),
        plan_ms,
        sim_ms: t1.elapsed().as_secs_f64() * 1e3,
    }
}

/// Time per planner, `ngl 0.1 s (max 3 ms), ilp …` in the experiment's planner order, then the simulator's.
#[must_use]
pub fn planning_times(planners: &[String], results: &[CellResult]) -> String {
    let parts: Vec<String> = planners
        .iter()
        .map(|p| {
            let t: Vec<f64> = results.iter().filter(|r| &r.cell.planner == p).map(|r| r.plan_ms).collect();
            let max = t.iter().copied().fold(0.0, f64::max);
            format!("{p} {:.1} s (max {max:.0} ms)", t.iter().sum::<f64>() / 1e3)
        })
        .collect();
    let sim: Vec<f64> = results.iter().map(|r| r.sim_ms).collect();
    format!(
        "time summed over cells: planning {}; simulation {:.1} s (max {:.0} ms)",
        parts.join(", "),
        sim.iter().sum::<f64>() / 1e3,
        sim.iter().copied().fold(0.0, f64::max)
    )
}

/// Runs every cell in parallel (rayon), with a progress bar on a terminal. Results keep the cells' order.
pub fn run_cells(
    cells: &[Cell],
    specs: &BTreeMap<String, ModelSpec>,
    cost: &TableCostModel,
    progress: bool,
) -> Vec<CellResult> {
    let bar = if progress { ProgressBar::new(cells.len() as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{elapsed:>4} [{bar:40}] {pos}/{len} cells ({per_sec}) {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let inventories: BTreeMap<&String, Arc<Inventory>> =
        specs.iter().map(|(m, s)| (m, Inventory::shared(s))).collect();
    // Longest first, handed out one at a time: on two cores, a long `ilp` cell of a large model that came up
    // last would run alone at the end. Cells are independent, so the order changes no result.
    let mut order: Vec<usize> = (0..cells.len()).collect();
    // Among equally long cells, one ubatch's come before the next's: where a prompt fits one chunk of either
    // (Figure 2 at 1K), the two cells pose `ilp` the same program, which it solves once if the first solve has
    // finished when the second cell starts rather than running beside it.
    order.sort_by_key(|&i| {
        let c = &cells[i];
        let searches = matches!(c.planner.as_str(), "ilp" | "exhaustive");
        (Reverse((searches, inventories[&c.model].total_bytes(), c.prompt_tokens * c.batch)), c.ubatch)
    });
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, CellResult)> = (0..rayon::current_num_threads())
        .into_par_iter()
        .flat_map_iter(|_| {
            std::iter::from_fn(|| {
                let &i = order.get(next.fetch_add(1, Ordering::Relaxed))?;
                let c = &cells[i];
                let r = run_cell(c, &specs[&c.model], &inventories[&c.model], cost);
                bar.inc(1);
                Some((i, r))
            })
        })
        .collect();
    bar.finish_and_clear();
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Bytes in GiB.
#[must_use]
pub fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Rounds to `d` decimals, so the CSV shows readable numbers.
fn round(x: f64, d: i32) -> f64 {
    let s = 10f64.powi(d);
    (x * s).round() / s
}

/// One CSV row: inputs, status, metrics, VRAM (simulated peak by category, and the plan's total) and a plan
/// summary.
#[derive(Debug, Serialize)]
struct Row<'a> {
    model: &'a str,
    ctx: u64,
    prompt_tokens: u64,
    gen_tokens: u64,
    ubatch: u64,
    batch: u64,
    vram_budget_bytes: u64,
    planner: &'a str,
    status: Status,
    reason: &'a str,
    ttft_ms: Option<f64>,
    /// Decode tokens per second summed over the parallel requests.
    tps: Option<f64>,
    /// … and of one request (`tps / batch`).
    request_tps: Option<f64>,
    /// One request's latency: all prompts' prefill, then the decode steps.
    e2el_ms: Option<f64>,
    decode_step_ms: Option<f64>,
    /// The resource that bounds a decode step (gpu, h2d, d2h, cpu) and the share of decode time it is busy.
    decode_bound: Option<&'static str>,
    decode_bound_busy: Option<f64>,
    switch_ms: Option<f64>,
    vram_peak_bytes: Option<u64>,
    plan_vram_bytes: Option<u64>,
    pinned_weights_bytes: Option<u64>,
    streaming_slots_bytes: Option<u64>,
    kv_bytes: Option<u64>,
    scratch_bytes: Option<u64>,
    prefill_pipeline_depth: Option<u32>,
    decode_pipeline_depth: Option<u32>,
    prefill_pinned_bytes: Option<u64>,
    prefill_streamed_bytes: Option<u64>,
    prefill_cpu_bytes: Option<u64>,
    decode_pinned_bytes: Option<u64>,
    decode_streamed_bytes: Option<u64>,
    decode_cpu_bytes: Option<u64>,
    planner_e2el_ms: Option<f64>,
    notes: String,
}

fn row(r: &CellResult) -> Row<'_> {
    let c = &r.cell;
    let run = r.run.as_deref();
    let m = run.map(|x| &x.sim.metrics);
    let ms = |ns: u64| round(ns as f64 / 1e6, 3);
    Row {
        model: &c.model,
        ctx: c.ctx,
        prompt_tokens: c.prompt_tokens,
        gen_tokens: c.gen_tokens,
        ubatch: c.ubatch,
        batch: c.batch,
        vram_budget_bytes: c.budget_bytes,
        planner: &c.planner,
        status: r.status,
        reason: &r.reason,
        ttft_ms: m.map(|m| ms(m.ttft_ns)),
        tps: m.map(|m| round(m.tps, 3)),
        request_tps: m.map(|m| round(m.tps / c.batch.max(1) as f64, 3)),
        e2el_ms: m.map(|m| ms(m.e2el_ns)),
        decode_step_ms: m.map(|m| ms(m.decode_step_ns)),
        decode_bound: run.map(|x| x.sim.decode_bound().0.name()),
        decode_bound_busy: run.map(|x| round(x.sim.decode_bound().1, 3)),
        switch_ms: run.map(|x| ms(x.sim.switch_ns)),
        vram_peak_bytes: m.map(|m| m.vram_peak_bytes),
        plan_vram_bytes: run.map(|x| x.plan.peak_vram_bytes()),
        pinned_weights_bytes: m.map(|m| m.vram_peak.pinned_weights_bytes),
        streaming_slots_bytes: m.map(|m| m.vram_peak.streaming_slots_bytes),
        kv_bytes: m.map(|m| m.vram_peak.kv_bytes),
        scratch_bytes: m.map(|m| m.vram_peak.scratch_bytes),
        prefill_pipeline_depth: run.map(|x| x.plan.prefill.pipeline_depth),
        decode_pipeline_depth: run.map(|x| x.plan.decode.pipeline_depth),
        prefill_pinned_bytes: run.map(|x| x.weights_by_placement[0][0]),
        prefill_streamed_bytes: run.map(|x| x.weights_by_placement[0][1]),
        prefill_cpu_bytes: run.map(|x| x.weights_by_placement[0][2]),
        decode_pinned_bytes: run.map(|x| x.weights_by_placement[1][0]),
        decode_streamed_bytes: run.map(|x| x.weights_by_placement[1][1]),
        decode_cpu_bytes: run.map(|x| x.weights_by_placement[1][2]),
        planner_e2el_ms: run.and_then(|x| x.plan.prediction).map(|p| ms(p.e2el_ns)),
        notes: run.map(|x| x.plan.notes.join("; ")).unwrap_or_default(),
    }
}

/// Writes `cells.csv`.
pub fn write_csv(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("writing {}", path.display()))?;
    for r in results {
        w.serialize(row(r))?;
    }
    w.flush()?;
    Ok(())
}

/// Where a result came from: enough to regenerate it.
#[derive(Debug, Serialize)]
pub struct Provenance {
    pub command: String,
    pub commit: String,
    pub date_utc: String,
    pub pipeshard_version: &'static str,
    pub experiment: String,
    pub profile: String,
    pub machine: String,
    /// Where the profile's numbers come from (measured, or derived from published figures).
    pub profile_source: serde_json::Value,
    pub cells: usize,
    pub ok_cells: usize,
    pub wall_time_s: f64,
    pub simulator: String,
}

/// Writes `dir/provenance.json` for a simulated run of `e` on `profile`; returns its path.
pub fn write_provenance(
    dir: &Path,
    e: &Experiment,
    profile: &Profile,
    command: &str,
    commit: String,
    results: &[CellResult],
    wall_s: f64,
) -> anyhow::Result<PathBuf> {
    let prov = Provenance {
        command: command.to_string(),
        commit,
        date_utc: now_utc(),
        pipeshard_version: env!("CARGO_PKG_VERSION"),
        experiment: e.name.clone(),
        profile: e.profile.clone(),
        machine: format!("{} ({}, {})", profile.machine.name, profile.machine.gpu, profile.machine.cpu),
        profile_source: serde_json::to_value(&profile.provenance)?,
        cells: results.len(),
        ok_cells: results.iter().filter(|r| r.status == Status::Ok).count(),
        wall_time_s: round(wall_s, 3),
        simulator: format!("pipeshard-sim, {:?}", SimOptions::default()),
    };
    let path = dir.join("provenance.json");
    std::fs::write(&path, serde_json::to_string_pretty(&prov)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The commit of this run: `PIPESHARD_COMMIT` when set (machines that run a copied binary, whose checkout may
/// be another commit's), else the checkout's (`-dirty` with uncommitted changes outside `results/` and
/// `profiles/`), or `unknown` outside one.
#[must_use]
pub fn git_commit() -> String {
    if let Ok(c) = std::env::var("PIPESHARD_COMMIT") {
        return c;
    }
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        // Outputs of earlier commands (results/, profiles/) do not make the code that produced them dirty.
        Some(c)
            if run(&["status", "--porcelain", "--", ".", ":!results", ":!profiles"])
                .is_some_and(|s| !s.is_empty()) =>
        {
            format!("{c}-dirty")
        }
        Some(c) => c,
        None => "unknown".into(),
    }
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (civil-from-days, no time-zone database needed).
#[must_use]
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Cells whose simulated peak VRAM exceeds their plan's own breakdown, per planner (a planner under-counting).
#[must_use]
pub fn vram_check(results: &[CellResult]) -> String {
    let mut over: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for r in results {
        let Some(run) = r.run.as_deref() else { continue };
        let (used, planned) = (run.sim.metrics.vram_peak_bytes, run.plan.peak_vram_bytes());
        if used > planned {
            let e = over.entry(r.cell.planner.as_str()).or_default();
            e.0 += 1;
            e.1 = e.1.max(used - planned);
        }
    }
    if over.is_empty() {
        return "simulated peak VRAM within every plan's breakdown".into();
    }
    let parts: Vec<String> = over
        .iter()
        .map(|(p, (n, worst))| {
            format!("{p} {n} cells (worst by {:.1} MiB)", *worst as f64 / f64::from(1u32 << 20))
        })
        .collect();
    format!("simulated peak VRAM above the plan's breakdown: {}", parts.join(", "))
}

/// Geometric mean.
fn geomean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
}

/// One line of the summary: a planner's speed-ups over the baseline on one model × context.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SummaryRow {
    pub model: String,
    pub ctx: u64,
    pub planner: String,
    pub baseline: String,
    /// Cells of this model × context (every planner, budget and ubatch) that found a plan, and all of them.
    pub cells_planned: usize,
    pub cells: usize,
    /// Geometric means over the budgets where both found a plan (best ubatch per budget); none if no budget.
    pub tps_speedup: Option<f64>,
    pub ttft_speedup: Option<f64>,
}

/// The summary rows: per model × context, each planner's TPS and TTFT speed-up over the baseline (`ngl` if
/// swept, else the first planner), geometric mean over the budgets (best ubatch per budget) where both found a
/// plan.
#[must_use]
pub fn summary_rows(e: &Experiment, results: &[CellResult]) -> Vec<SummaryRow> {
    let baseline = if e.planners.iter().any(|p| p == "ngl") { "ngl" } else { e.planners[0].as_str() };
    // (model, ctx, planner, budget) → best (tps, ttft_ns) over ubatches.
    let mut best: BTreeMap<(&str, u64, &str, u64), (f64, u64)> = BTreeMap::new();
    for r in results {
        let Some(run) = r.run.as_deref() else { continue };
        let c = &r.cell;
        let m = &run.sim.metrics;
        let e = best
            .entry((c.model.as_str(), c.ctx, c.planner.as_str(), c.budget_bytes))
            .or_insert((0.0, u64::MAX));
        e.0 = e.0.max(m.tps);
        e.1 = e.1.min(m.ttft_ns);
    }
    let budgets = e.budgets();
    let mut rows = Vec::new();
    for m in e.models() {
        for ctx in e.contexts() {
            let group = || results.iter().filter(|r| r.cell.model == *m && r.cell.ctx == ctx);
            let cells = group().count();
            if cells == 0 {
                continue;
            }
            for p in e.planners.iter().filter(|p| *p != baseline) {
                let (mut tps, mut ttft) = (Vec::new(), Vec::new());
                for &b in &budgets {
                    let (Some(x), Some(base)) = (
                        best.get(&(m.as_str(), ctx, p.as_str(), b)),
                        best.get(&(m.as_str(), ctx, baseline, b)),
                    ) else {
                        continue;
                    };
                    if base.0 > 0.0 && x.0 > 0.0 {
                        tps.push(x.0 / base.0);
                    }
                    if x.1 > 0 {
                        ttft.push(base.1 as f64 / x.1 as f64);
                    }
                }
                rows.push(SummaryRow {
                    model: m.clone(),
                    ctx,
                    planner: p.clone(),
                    baseline: baseline.into(),
                    cells_planned: group().filter(|r| r.run.is_some()).count(),
                    cells,
                    tps_speedup: geomean(&tps),
                    ttft_speedup: geomean(&ttft),
                });
            }
        }
    }
    rows
}

/// The summary table: a line per model × context, a column per planner with its `TPS× / TTFT×`.
#[must_use]
pub fn summary(e: &Experiment, rows: &[SummaryRow]) -> String {
    let baseline = if e.planners.iter().any(|p| p == "ngl") { "ngl" } else { e.planners[0].as_str() };
    let others: Vec<&String> = e.planners.iter().filter(|p| *p != baseline).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "speed-up over {baseline}: TPS× / TTFT×, geometric mean over budgets where both found a plan (best ubatch)"
    );
    let _ = write!(s, "{:<20} {:>5} {:>7}", "model", "ctx", "plans");
    for p in &others {
        let _ = write!(s, " {p:>15}");
    }
    s.push('\n');
    let mut groups: Vec<(&str, u64)> = rows.iter().map(|r| (r.model.as_str(), r.ctx)).collect();
    groups.dedup();
    for (m, ctx) in groups {
        let line: Vec<&SummaryRow> = rows.iter().filter(|r| r.model == m && r.ctx == ctx).collect();
        let plans = format!("{}/{}", line[0].cells_planned, line[0].cells);
        let _ = write!(s, "{m:<20} {:>5} {plans:>7}", format_tokens(ctx));
        for r in line {
            let cell = match (r.tps_speedup, r.ttft_speedup) {
                (Some(a), Some(b)) => format!("{a:.2}/{b:.2}"),
                _ => "—".into(),
            };
            let _ = write!(s, " {cell:>15}");
        }
        s.push('\n');
    }
    s
}

/// Runs an experiment and writes its results under `out_dir/<name>/`.
pub fn sweep(
    e: &Experiment,
    out_dir: &Path,
    command: &str,
    plots: bool,
    format: Format,
) -> anyhow::Result<()> {
    // Read before the run: the results it writes are themselves uncommitted changes.
    let commit = git_commit();
    let t0 = Instant::now();
    let profile = load_profile(&e.profile)?;
    let cost = TableCostModel::new(&profile);
    let specs = e.specs()?;
    for w in crate::args::borrowed_rows(&cost, &e.profile, specs.values()) {
        eprintln!("{w}");
    }
    let cells = e.cells();
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let results = run_cells(&cells, &specs, &cost, progress);
    let wall = t0.elapsed().as_secs_f64();

    let dir = out_dir.join(&e.name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written: Vec<PathBuf> = vec![dir.join("cells.csv")];
    write_csv(&results, &written[0])?;
    if plots {
        written.extend(crate::plots::sweep_plots(e, &results, &dir)?);
    }
    let prov_path = write_provenance(&dir, e, &profile, command, commit, &results, wall)?;
    let ok = results.iter().filter(|r| r.status == Status::Ok).count();
    written.push(prov_path);

    let count = |s: Status| results.iter().filter(|r| r.status == s).count();
    // Outside `table`, stdout holds only the summary rows.
    let report = |line: String| {
        if format == Format::Table {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    };
    report(format!(
        "sweep {}: {} models × {} contexts × {} budgets × {} planners = {} cells on {} in {:.1} s \
         ({ok} planned, {} infeasible, {} unsupported, {} errors)",
        e.name,
        e.models().len(),
        e.contexts().len(),
        e.budgets().len(),
        e.planners.len(),
        results.len(),
        e.profile,
        wall,
        count(Status::Infeasible),
        count(Status::Unsupported),
        count(Status::Error),
    ));
    let rows = summary_rows(e, &results);
    print!("{}", render(format, "sweep_summary", &rows, || summary(e, &rows))?);
    report(planning_times(&e.planners, &results));
    report(vram_check(&results));
    if let Some(r) = results.iter().find(|r| r.status == Status::Error) {
        report(format!(
            "first error: {} ctx {} budget {} {}: {}",
            r.cell.model,
            format_tokens(r.cell.ctx),
            format_bytes(r.cell.budget_bytes),
            r.cell.planner,
            r.reason
        ));
    }
    report(format!(
        "wrote {}",
        written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An experiment named `s` from a TOML file's text.
    fn experiment(toml_text: &str) -> Experiment {
        Experiment::from_file(toml::from_str(toml_text).unwrap(), "s").unwrap()
    }

    /// The summary's rows and its table say the same: one row per model × context × non-baseline planner.
    #[test]
    fn summary_rows_and_table_agree() {
        let e = experiment(
            "models = [\"nemo-4b@2L\"]\nctx = [\"1K\", \"4K\"]\nbudgets = [\"1G\", \"2G\"]\nplanners = [\"ngl\", \"greedy\", \"ilp\"]",
        );
        let cost = TableCostModel::new(&load_profile("cli3").unwrap());
        let results = run_cells(&e.cells(), &e.specs().unwrap(), &cost, false);
        let rows = summary_rows(&e, &results);
        assert_eq!(rows.len(), 2 * 2, "2 contexts × (greedy, ilp)");
        assert!(rows.iter().all(|r| r.baseline == "ngl" && r.cells == 6), "{rows:?}");
        let r = &rows[1];
        assert_eq!((r.ctx, r.planner.as_str()), (1024, "ilp"));
        let speedup = r.tps_speedup.expect("both plan at 2G");
        let text = summary(&e, &rows);
        let line = text.lines().find(|l| l.starts_with("nemo-4b@2L") && l.contains(" 1K ")).unwrap();
        assert!(line.contains(&format!("{speedup:.2}/")), "{line}");
        let md = render(Format::Md, "sweep_summary", &rows, String::new).unwrap();
        assert_eq!(md.lines().count(), 2 + rows.len());
    }

    /// On a paper machine (a derived profile) `pshard`'s plan runs on the artifact's runtime and, for the
    /// planner comparisons, on ours; `ngl`'s on stock llama.cpp's. On a measured machine every plan runs on ours.
    #[test]
    fn each_planner_runs_on_its_machines_runtime() {
        let e = experiment(
            "models = [\"qwen3-30b-a3b@2L\"]\nctx = [\"1K\"]\nbudgets = [\"8G\"]\nplanners = [\"pshard\", \"ngl\"]",
        );
        let specs = e.specs().unwrap();
        let h200 = concat!(env!("CARGO_MANIFEST_DIR"), "/../../profiles/h200.json");
        for (profile, paper) in [("cli3", true), (h200, false)] {
            let cost = TableCostModel::new(&load_profile(profile).unwrap());
            for r in run_cells(&e.cells(), &specs, &cost, false) {
                let run = r.run.as_deref().expect("planned");
                let step_ns = |runtime: Runtime| {
                    let sim = Simulator::new(&specs[&r.cell.model], &run.plan, &cost).unwrap();
                    sim.with_runtime(runtime).run(&SimOptions::default()).metrics.decode_step_ns
                };
                let expected = match r.cell.planner.as_str() {
                    "pshard" if paper => Runtime::Artifact,
                    "ngl" if paper => Runtime::Stock,
                    _ => Runtime::Ours,
                };
                assert_eq!(run.sim.metrics.decode_step_ns, step_ns(expected), "{profile} {}", r.cell.planner);
                if expected != Runtime::Ours {
                    assert_ne!(step_ns(expected), step_ns(Runtime::Ours), "{}", r.cell.planner);
                }
                let on_ours = run.sim_on_ours.as_ref().map(|s| s.metrics.decode_step_ns);
                assert_eq!(on_ours, (expected == Runtime::Artifact).then(|| step_ns(Runtime::Ours)));
            }
        }
    }

    #[test]
    fn dates_are_civil() {
        let d = now_utc();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.starts_with("20") && d.ends_with('Z'));
    }

    #[test]
    fn geomean_of_ratios() {
        assert!((geomean(&[2.0, 8.0]).unwrap() - 4.0).abs() < 1e-12);
        assert!(geomean(&[]).is_none());
    }
}
