//! `pipeshard repro`: the paper's Table 4, Figure 2, Table 9 and Figure 7 in the simulator, side by side with
//! the paper, and the calibration of the derived profile they run on.
//!
//! - `repro table4|figure2|table9|figure7` runs `experiments/<table>.toml` (every planner it lists) and writes, under
//!   `results/paper/<table>/`: `cells.csv` — the paper CSV's key columns and, per metric X, `X` (ours),
//!   `X_paper`, `X_err` (relative error) and `calibration` (the cell's model was fitted on); `planners.csv` —
//!   every planner's TTFT / TPS / E2EL, the speed-ups of `greedy` and `ilp` over `pshard` (its plans on our
//!   runtime, as theirs run: the runtimes differ, see pipeshard-sim's `Runtime`) and `ngl`, and the resource
//!   that binds the best plan in decode and in prefill; `summary.md` (hit rates and error statistics,
//!   calibration and held-out cells apart); `runs.csv` (every simulated cell, as `sim sweep` writes it); the
//!   plots; and `provenance.json`.
//! - `repro baseline` runs `experiments/baseline.toml`: the `-ngl` baseline's own measured runs
//!   (`baseline_ngl_5090.csv`: stock llama.cpp's prompt time and decode rate per model × context × budget ×
//!   ubatch, the mean of its successful trials) against our replay of the same `-ngl N` at the same ubatch.
//! - `repro calibrate` fits the few free parameters of a derived profile ([`Efficiencies`]) on the cells of
//!   the `calibration_models` of Table 4 and of the baseline's runs, each table weighing the same, and writes
//!   the profile with the fit in its provenance. Both hold absolute measurements of the machine (running pshard,
//!   and running stock llama.cpp); Figure 2's speed-ups are ratios against our model of llama.cpp, so fitting
//!   the machine to them lets that model's errors bend the machine (a first fit on Table 4 and Figure 2 drove
//!   DRAM under DMA to 8% and PCIe to 30% of its measured figure, and doubled Table 4's TTFT error). Figure 2
//!   is entirely held out. `--tables` adds tables (Table 9's qwen3-30b-a3b rows fit how fast the CPU computes
//!   routed experts shared by several tokens, which no single-request row exercises), `--vary` restricts the
//!   fit to some parameters and `--start` starts it from an earlier fit.
//!
//! How ours is computed, as the paper's scripts do: `pshard`'s plans run on the artifact's runtime and `ngl`'s on
//! stock llama.cpp's (pipeshard-sim's `Runtime`); Table 4 is `pshard`'s TPS and TTFT; Figure 2's speed-ups
//! pair `ngl` and `pshard` at the same ubatch (TTFT and E2EL: ngl / pshard; TPS: pshard / ngl) and keep the
//! best over the ubatches per metric, and E2EL = TTFT + `gen_tokens` / TPS whatever the cell generated (it
//! stops at a full context). Table 9 is `pshard`'s aggregate decode TPS with N parallel requests (the paper's
//! S_TG), Figure 7 its ratio to `ngl`'s at the same N; their rows are keyed by batch rather than context (a
//! paper CSV without a context column takes the experiment's one context). Table 9's rows are calibration
//! where the profile's fit names them (`cpu_expert_gemm`); Figure 7 is held out, though its `pshard` side is
//! Table 9's. Table 4's TTFT is rounded to 100 ms in the paper's CSV, so a value that
//! is a multiple of 100 ms stands for the interval ±50 ms around it, and the error is the distance to that
//! interval.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::PhaseKind;
use pipeshard_core::profile::{Fit, Profile, Provenance as ProfileProvenance};
use pipeshard_core::reference::{self, DEFAULT_EFFICIENCIES, Efficiencies};
use pipeshard_sim::Simulator;
use serde::Serialize;

use crate::args::{format_bytes, format_tokens, load_profile, parse_bytes, parse_tokens};
use crate::experiment::{Cell, Experiment, PaperRef};
use crate::sweep::{CellResult, Status, git_commit, now_utc, run_cells, write_csv, write_provenance};

#[derive(Debug, Subcommand)]
pub enum ReproCommand {
    /// The paper's Table 4 (pshard TPS and TTFT on cli3) in the simulator, against the paper.
    Table4(ReproArgs),
    /// The paper's Figure 2 (speed-ups of pshard over the -ngl baseline on cli3), against the paper.
    Figure2(ReproArgs),
    /// The `-ngl` baseline's own runs (stock llama.cpp's TTFT and TPS per ubatch, baseline_ngl_5090.csv)
    /// against our replay of them.
    Baseline(ReproArgs),
    /// The paper's Table 8 (Cosmos-Reason1-7B E2EL speed-ups of pshard + VLMOpt, OOM map, on cli2) and the
    /// peak VRAM each VLMOpt measure saves.
    Table8(ReproArgs),
    /// The paper's Table 9 (pshard's aggregate decode TPS of qwen3-30b-a3b with 1–64 parallel requests).
    Table9(ReproArgs),
    /// The paper's Figure 7 (batched TPS speed-up of pshard, unified KV, over -ngl, per-sequence KV).
    Figure7(ReproArgs),
    /// Fit a derived profile's free parameters on the calibration models of Table 4 and the baseline's runs.
    Calibrate(CalibrateArgs),
}

#[derive(Debug, Args)]
pub struct ReproArgs {
    /// Machine profile (default: the experiment's, `profiles/cli3.json`).
    #[arg(long)]
    pub profile: Option<String>,
    #[arg(long, default_value = "experiments")]
    pub experiments: PathBuf,
    #[arg(long, default_value = "results/paper")]
    pub out_dir: PathBuf,
    /// Skip the PNG plots.
    #[arg(long)]
    pub no_plots: bool,
}

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// The derived system to fit (cli1, cli2, cli3).
    #[arg(long, default_value = "cli3")]
    system: String,
    #[arg(long, default_value = "experiments")]
    experiments: PathBuf,
    /// Output profile (default: `profiles/SYSTEM.json`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Coordinate-descent rounds at most.
    #[arg(long, default_value_t = 8)]
    rounds: u32,
    /// Tables whose calibration models' rows the fit uses, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = CALIBRATION_TABLES.map(String::from))]
    tables: Vec<String>,
    /// Vary only these parameters (comma-separated names), the others held at `--start`'s values.
    #[arg(long, value_delimiter = ',')]
    vary: Vec<String>,
    /// A calibrated profile whose fitted parameters the fit starts from (default: the default assumptions).
    #[arg(long)]
    start: Option<PathBuf>,
}

/// Points of the log grid a single varied parameter is scanned over before the descent.
const SCAN_POINTS: u32 = 48;

/// The tables `repro calibrate` fits on: absolute measurements only (see the module docs).
pub const CALIBRATION_TABLES: [&str; 2] = ["table4", "baseline"];

/// A metric of a paper table, by its CSV column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Tps,
    TtftMs,
    TtftSpeedup,
    TpsSpeedup,
    E2elSpeedup,
    /// The `-ngl` baseline's own decode rate (the baseline CSV's `EvalTPS`).
    NglTps,
    /// The `-ngl` baseline's own prompt time (the baseline CSV's `PromptEvalTime_ms`).
    NglTtftMs,
}

impl Metric {
    fn from_column(c: &str) -> Option<Metric> {
        Some(match c {
            "TPS" => Metric::Tps,
            "TTFT(msec)" => Metric::TtftMs,
            "TTFTSpeedup" => Metric::TtftSpeedup,
            "TPSSpeedup" => Metric::TpsSpeedup,
            "E2ELSpeedup" => Metric::E2elSpeedup,
            "EvalTPS" => Metric::NglTps,
            "PromptEvalTime_ms" => Metric::NglTtftMs,
            _ => return None,
        })
    }

    /// The planners whose runs this metric reads.
    fn planners(self) -> &'static [&'static str] {
        match self {
            Metric::Tps | Metric::TtftMs => &["pshard"],
            Metric::NglTps | Metric::NglTtftMs => &["ngl"],
            Metric::TtftSpeedup | Metric::TpsSpeedup | Metric::E2elSpeedup => &["pshard", "ngl"],
        }
    }

    /// The interval the paper's printed value stands for.
    fn paper_interval(self, v: f64) -> (f64, f64) {
        if self == Metric::TtftMs && v >= 100.0 && v % 100.0 == 0.0 { (v - 50.0, v + 50.0) } else { (v, v) }
    }
}

/// One row of a paper table, resolved to our cell.
#[derive(Debug, Clone)]
struct PaperRow {
    /// The key columns as the paper writes them.
    keys: Vec<String>,
    model: String,
    ctx: u64,
    budget_bytes: u64,
    /// Parallel requests (1 where the table has no batch column).
    batch: u64,
    /// The ubatch the row was measured at (the baseline CSV's `Ubatch`); `None`: ours is the best ubatch.
    ubatch: Option<u64>,
    values: Vec<f64>,
}

/// A paper table: key and metric columns, rows.
#[derive(Debug, Clone)]
struct PaperTable {
    key_columns: Vec<String>,
    metrics: Vec<(String, Metric)>,
    rows: Vec<PaperRow>,
    /// The rows are keyed by batch (Table 9, Figure 7).
    batched: bool,
}

const MODEL_COLUMNS: [&str; 1] = ["Model"];
const CTX_COLUMNS: [&str; 3] = ["CtxK", "CtxSize", "Context"];
const BUDGET_COLUMNS: [&str; 3] = ["VramBudget", "Vram", "MVA"];
const BATCH_COLUMNS: [&str; 1] = ["BatchSize"];
/// The baseline CSV's runs: one row per run at one ubatch, with a status (failed runs are skipped).
const UBATCH_COLUMN: &str = "Ubatch";
const STATUS_COLUMN: &str = "Status";

/// A budget cell: `8G` and the like, or the baseline CSV's `-mva` in decimal thousands of MB, which the paper's
/// scripts key budgets by (2G is looked up as 2000).
fn parse_budget(column: &str, v: &str) -> anyhow::Result<u64> {
    if column == "MVA" {
        let mb: u64 = v.parse().with_context(|| format!("MVA = `{v}` is not a whole number of MB"))?;
        if mb == 0 || !mb.is_multiple_of(1000) {
            bail!("MVA = `{v}`: expected a multiple of 1000 (the scripts' label for N GiB is N×1000)");
        }
        Ok(mb / 1000 * pipeshard_core::GIB)
    } else {
        parse_bytes(v)
    }
}

impl PaperTable {
    /// Reads the paper's CSV; a table without a context column gets `default_ctx` (the experiment's only one).
    fn load(p: &PaperRef, default_ctx: Option<u64>) -> anyhow::Result<PaperTable> {
        let file = p.csv.display().to_string();
        let mut r = csv::Reader::from_path(&p.csv).with_context(|| format!("[paper] csv: reading {file}"))?;
        let header: Vec<String> = r.headers()?.iter().map(str::to_string).collect();
        let find = |names: &[&str]| {
            header.iter().position(|h| names.contains(&h.as_str())).with_context(|| {
                format!("{file}: no column {}; the header is {}", names.join(" or "), header.join(","))
            })
        };
        let mi = find(&MODEL_COLUMNS)?;
        let ni = find(&BATCH_COLUMNS).ok();
        let ci = match find(&CTX_COLUMNS) {
            Ok(ci) => Some(ci),
            Err(_) if ni.is_some() && default_ctx.is_some() => None,
            Err(_) if ni.is_some() => bail!(
                "{file}: no CtxK or CtxSize column, and the experiment has more than one ctx; a batched table \
                 without one takes the experiment's only context"
            ),
            Err(e) => return Err(e),
        };
        let bi = find(&BUDGET_COLUMNS)?;
        let ui = header.iter().position(|h| h == UBATCH_COLUMN);
        let si = header.iter().position(|h| h == STATUS_COLUMN);
        let metrics: Vec<(usize, String, Metric)> = header
            .iter()
            .enumerate()
            .filter_map(|(i, h)| Metric::from_column(h).map(|m| (i, h.clone(), m)))
            .collect();
        if metrics.is_empty() {
            bail!("{file}: no metric column (TPS, TTFT(msec), TTFTSpeedup, TPSSpeedup, E2ELSpeedup)");
        }
        let ours: BTreeMap<&str, &str> = p.names.iter().map(|(a, b)| (b.as_str(), a.as_str())).collect();
        let mut rows = Vec::new();
        for (n, rec) in r.records().enumerate() {
            let rec = rec.with_context(|| format!("{file}: row {}", n + 2))?;
            let at = |i: usize| rec.get(i).unwrap_or("");
            if si.is_some_and(|si| at(si) != "SUCCESS") {
                continue;
            }
            let Some(model) = ours.get(at(mi)) else {
                bail!("{file}: row {}: model `{}` has no entry in [paper] names", n + 2, at(mi));
            };
            let values = metrics
                .iter()
                .map(|(i, h, _)| {
                    at(*i).parse::<f64>().ok().filter(|v| *v > 0.0).with_context(|| {
                        format!("{file}: row {}: {h} = `{}` is not a positive number", n + 2, at(*i))
                    })
                })
                .collect::<anyhow::Result<Vec<f64>>>()?;
            let keys: Vec<String> =
                [Some(mi), ci, Some(bi), ni, ui].into_iter().flatten().map(|i| at(i).to_string()).collect();
            let ctx = match ci {
                Some(ci) => parse_tokens(at(ci)).with_context(|| format!("{file}: row {}", n + 2))?,
                None => default_ctx.expect("checked with the columns"),
            };
            let batch = match ni {
                Some(ni) => at(ni).parse::<u64>().ok().filter(|b| *b > 0).with_context(|| {
                    format!("{file}: row {}: {} = `{}` is not a positive count", n + 2, header[ni], at(ni))
                })?,
                None => 1,
            };
            let ubatch = match ui {
                Some(ui) => Some(at(ui).parse::<u64>().ok().filter(|u| *u > 0).with_context(|| {
                    format!("{file}: row {}: {UBATCH_COLUMN} = `{}` is not a positive count", n + 2, at(ui))
                })?),
                None => None,
            };
            let row = PaperRow {
                keys,
                model: (*model).to_string(),
                ctx,
                budget_bytes: parse_budget(&header[bi], at(bi))
                    .with_context(|| format!("{file}: row {}", n + 2))?,
                batch,
                ubatch,
                values,
            };
            // Repeated runs of one key (the baseline's trials) count as their mean.
            match rows.iter_mut().find(|r: &&mut (PaperRow, f64)| r.0.keys == row.keys) {
                Some((r, count)) => {
                    *count += 1.0;
                    for (a, b) in r.values.iter_mut().zip(&row.values) {
                        *a += (b - *a) / *count;
                    }
                }
                None => rows.push((row, 1.0)),
            }
        }
        let rows = rows.into_iter().map(|(r, _)| r).collect();
        Ok(PaperTable {
            key_columns: [Some(mi), ci, Some(bi), ni, ui]
                .into_iter()
                .flatten()
                .map(|i| header[i].clone())
                .collect(),
            metrics: metrics.into_iter().map(|(_, h, m)| (h, m)).collect(),
            rows,
            batched: ni.is_some(),
        })
    }
}

/// Simulated TTFT (ms), TPS and E2EL (ms) of one planner on one cell at one ubatch.
#[derive(Debug, Clone, Copy)]
struct Point {
    ttft_ms: f64,
    tps: f64,
    e2el_ms: f64,
}

/// (model, ctx, budget, batch, planner) → ubatch → point, for the cells that found a plan.
type Points = BTreeMap<(String, u64, u64, u64, String), BTreeMap<u64, Point>>;

/// The key of `pshard`'s plans simulated on our runtime in [`Points`] (what our planners are compared with).
const PSHARD_ON_OURS: &str = "pshard on our runtime";

/// The points of `results`, E2EL as the paper's script computes it: TTFT + `gen_tokens` / TPS.
fn points(results: &[CellResult], gen_tokens: u64) -> Points {
    let mut m = Points::new();
    for r in results {
        let Some(run) = r.run.as_deref() else { continue };
        let c = &r.cell;
        let on_ours = run.sim_on_ours.as_ref().map(|s| (PSHARD_ON_OURS.to_string(), s));
        for (planner, sim) in std::iter::once((c.planner.clone(), &run.sim)).chain(on_ours) {
            let x = &sim.metrics;
            m.entry((c.model.clone(), c.ctx, c.budget_bytes, c.batch, planner)).or_default().insert(
                c.ubatch,
                Point {
                    ttft_ms: x.ttft_ms(),
                    tps: x.tps,
                    e2el_ms: x.ttft_ms() + gen_tokens as f64 / x.tps * 1e3,
                },
            );
        }
    }
    m
}

/// Best over ubatches of `f` (higher is better).
fn best(p: Option<&BTreeMap<u64, Point>>, f: impl Fn(&Point) -> f64) -> Option<f64> {
    p?.values().map(f).filter(|v| v.is_finite() && *v > 0.0).reduce(f64::max)
}

/// Best over ubatches of a speed-up of `a` over `b`, paired at the same ubatch.
fn best_paired(
    a: Option<&BTreeMap<u64, Point>>,
    b: Option<&BTreeMap<u64, Point>>,
    f: impl Fn(&Point, &Point) -> f64,
) -> Option<f64> {
    let (a, b) = (a?, b?);
    a.iter()
        .filter_map(|(u, pa)| b.get(u).map(|pb| f(pa, pb)))
        .filter(|v| v.is_finite() && *v > 0.0)
        .reduce(f64::max)
}

/// One planner's points on the cell of a paper row.
fn at<'m>(pts: &'m Points, row: &PaperRow, planner: &str) -> Option<&'m BTreeMap<u64, Point>> {
    pts.get(&(row.model.clone(), row.ctx, row.budget_bytes, row.batch, planner.to_string()))
}

/// Ours for one paper metric on one cell.
fn ours(pts: &Points, row: &PaperRow, m: Metric) -> Option<f64> {
    let (ps, ngl) = (at(pts, row, "pshard"), at(pts, row, "ngl"));
    let ngl_at = |f: fn(&Point) -> f64| ngl?.get(&row.ubatch?).map(f);
    match m {
        Metric::NglTps => ngl_at(|p| p.tps),
        Metric::NglTtftMs => ngl_at(|p| p.ttft_ms),
        Metric::Tps => best(ps, |p| p.tps),
        Metric::TtftMs => best(ps, |p| 1.0 / p.ttft_ms).map(|x| 1.0 / x),
        Metric::TtftSpeedup => best_paired(ps, ngl, |p, b| b.ttft_ms / p.ttft_ms),
        Metric::TpsSpeedup => best_paired(ps, ngl, |p, b| p.tps / b.tps),
        Metric::E2elSpeedup => best_paired(ps, ngl, |p, b| b.e2el_ms / p.e2el_ms),
    }
}

/// Ours against the paper on one metric of one cell.
#[derive(Debug, Clone, Copy)]
struct Comparison {
    row: usize,
    metric: usize,
    ours: Option<f64>,
    paper: f64,
    /// ours / (nearest value the paper's figure stands for) − 1; `None` where we found no plan.
    err: Option<f64>,
    calibration: bool,
}

fn compare(t: &PaperTable, p: &PaperRef, pts: &Points) -> Vec<Comparison> {
    let mut v = Vec::new();
    for (ri, row) in t.rows.iter().enumerate() {
        for (mi, (_, m)) in t.metrics.iter().enumerate() {
            let paper = row.values[mi];
            let o = ours(pts, row, *m);
            let (lo, hi) = m.paper_interval(paper);
            v.push(Comparison {
                row: ri,
                metric: mi,
                ours: o,
                paper,
                err: o.map(|o| o / o.clamp(lo, hi) - 1.0),
                calibration: p.calibration_models.contains(&row.model),
            });
        }
    }
    v
}

/// Median and 90th percentile (nearest rank) of `v`.
fn median_p90(v: &mut [f64]) -> Option<(f64, f64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some((rank(0.5), rank(0.9)))
}

/// Hit rates and |error| statistics per metric, calibration and held-out cells apart (markdown).
fn error_table(t: &PaperTable, comps: &[Comparison], tolerance: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| metric | cells | n | within ±{:.0}% | median abs err | p90 abs err | median signed err | no plan |",
        tolerance * 100.0
    );
    s.push_str("|---|---|---|---|---|---|---|---|\n");
    for (mi, (name, _)) in t.metrics.iter().enumerate() {
        for cal in [true, false] {
            let sel: Vec<&Comparison> =
                comps.iter().filter(|c| c.metric == mi && c.calibration == cal).collect();
            let errs: Vec<f64> = sel.iter().filter_map(|c| c.err).collect();
            let hits = errs.iter().filter(|e| e.abs() <= tolerance).count();
            let mut abs: Vec<f64> = errs.iter().map(|e| e.abs()).collect();
            let mut signed = errs.clone();
            let (Some((med, p90)), Some((sm, _))) = (median_p90(&mut abs), median_p90(&mut signed)) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {name} | {} | {} | {hits} ({:.0}%) | {:.1}% | {:.1}% | {:+.1}% | {} |",
                if cal { "calibration" } else { "held-out" },
                sel.len(),
                100.0 * hits as f64 / sel.len() as f64,
                med * 100.0,
                p90 * 100.0,
                sm * 100.0,
                sel.len() - errs.len(),
            );
        }
    }
    s
}

/// Mean squared log error of the comparisons (a cell without a plan counts as a factor e off).
fn objective(comps: &[Comparison]) -> f64 {
    let sq: f64 = comps.iter().map(|c| c.err.map_or(1.0, |e| (1.0 + e).ln().powi(2))).sum();
    sq / comps.len().max(1) as f64
}

/// An experiment with its paper table.
struct PaperRun {
    experiment: Experiment,
    paper: PaperRef,
    table: PaperTable,
}

fn load_table(dir: &Path, name: &str) -> anyhow::Result<PaperRun> {
    let experiment = Experiment::load(&dir.join(format!("{name}.toml")))?;
    let paper = experiment.paper.clone().with_context(|| {
        format!("{}/{name}.toml has no [paper] section to compare against", dir.display())
    })?;
    let contexts = experiment.contexts();
    let mut table = PaperTable::load(&paper, (contexts.len() == 1).then(|| contexts[0]))?;
    // The baseline CSV also holds budgets the figures do not use (1, 3 and 5 GB): only the experiment's grid.
    let cells: std::collections::BTreeSet<(String, u64, u64)> =
        experiment.cells().into_iter().map(|c| (c.model, c.ctx, c.budget_bytes)).collect();
    table.rows.retain(|r| r.ubatch.is_none() || cells.contains(&(r.model.clone(), r.ctx, r.budget_bytes)));
    Ok(PaperRun { experiment, paper, table })
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let b = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    b.set_style(
        ProgressStyle::with_template(&format!("{{elapsed:>4}} [{{bar:40}}] {{pos}}/{{len}} {what} {{msg}}"))
            .expect("a valid template")
            .progress_chars("=> "),
    );
    b
}

pub fn run(cmd: ReproCommand, command: &str) -> anyhow::Result<()> {
    match cmd {
        ReproCommand::Table4(a) => repro("table4", &a, command),
        ReproCommand::Figure2(a) => repro("figure2", &a, command),
        ReproCommand::Baseline(a) => repro("baseline", &a, command),
        ReproCommand::Table8(a) => crate::table8::run(&a, command),
        ReproCommand::Table9(a) => repro("table9", &a, command),
        ReproCommand::Figure7(a) => repro("figure7", &a, command),
        ReproCommand::Calibrate(a) => calibrate(&a, command),
    }
}

/// The resource that binds a plan in one phase: its label and its busy share of the step.
fn binding(busy: [u64; 4], step_ns: u64, labels: [&'static str; 4]) -> (&'static str, f64) {
    let (i, b) = busy.iter().enumerate().max_by_key(|(_, b)| **b).expect("four lanes");
    (labels[i], *b as f64 / step_ns.max(1) as f64)
}

/// The binding resources of a planned cell: a decode step at the end of generation (two steps, the ring
/// running across them, the second measured) and the first prefill chunk.
fn bounds(
    r: &CellResult,
    spec: &ModelSpec,
    inv: &Inventory,
    cost: &TableCostModel,
) -> Option<[(&'static str, f64); 2]> {
    let run = r.run.as_deref()?;
    let sim = Simulator::with_inventory(spec, inv, &run.plan, cost).ok()?;
    let w = &run.plan.workload;
    let d = w.decode_step(w.gen_tokens - 1);
    let o = sim.steps(PhaseKind::Decode, &[d, d]);
    let decode =
        binding(o.busy_ns[1], o.step_end_ns[1] - o.step_end_ns[0], ["GPU", "PCIe", "PCIe D2H", "DRAM"]);
    let chunk = *w.prefill_chunks().first()?;
    let o = sim.step(PhaseKind::Prefill, chunk);
    let prefill = binding(o.busy_ns[0], o.makespan_ns, ["compute", "copy", "copy D2H", "CPU"]);
    Some([decode, prefill])
}

/// Rounded to 4 decimals, so the CSV shows readable numbers.
fn r4(x: Option<f64>) -> Option<f64> {
    x.map(|v| (v * 1e4).round() / 1e4)
}

fn fmt(x: Option<f64>, d: usize) -> String {
    x.map_or_else(String::new, |v| format!("{v:.d$}"))
}

/// The planners that are not the paper's (`greedy`, `ilp`, …), whose speed-ups `planners.csv` reports.
fn ours_planners(e: &Experiment) -> Vec<&str> {
    e.planners.iter().map(String::as_str).filter(|p| !["ngl", "pshard"].contains(p)).collect()
}

fn repro(name: &str, a: &ReproArgs, command: &str) -> anyhow::Result<()> {
    let commit = git_commit();
    let t0 = Instant::now();
    let PaperRun { mut experiment, paper, table } = load_table(&a.experiments, name)?;
    if let Some(p) = &a.profile {
        experiment.profile.clone_from(p);
    }
    let e = &experiment;
    let profile = load_profile(&e.profile)?;
    let cost = TableCostModel::new(&profile);
    let specs = e.specs()?;
    let cells = e.cells();
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let results = run_cells(&cells, &specs, &cost, progress);
    let pts = points(&results, e.gen_tokens);
    let comps = compare(&table, &paper, &pts);

    let dir = a.out_dir.join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = vec![dir.join("cells.csv"), dir.join("planners.csv"), dir.join("runs.csv")];
    write_cells(&table, &comps, &written[0])?;
    let beat = write_planners(e, &table, &results, &pts, &specs, &cost, &written[1])?;
    write_csv(&results, &written[2])?;
    if !a.no_plots {
        written.extend(if table.batched {
            crate::plots::batch_paper_plots(name, e, &batch_series(&table, &comps), &dir)?
        } else {
            crate::plots::paper_plots(name, e, &table_series(&table, &comps), &dir)?
        });
    }
    let summary = format!(
        "# {name}: ours (simulated, profile {}) vs the paper\n\n{}\n\nHit: |error| within ±{:.0}% (the issue's goal); \
         error = ours / paper − 1 (Table 4's TTFT: against the ±50 ms its rounding to 100 ms stands for).\n\n{}\n\n\
         {beat}",
        e.profile,
        e.description,
        paper.tolerance * 100.0,
        error_table(&table, &comps, paper.tolerance)
    );
    let summary_path = dir.join("summary.md");
    std::fs::write(&summary_path, &summary).with_context(|| format!("writing {}", summary_path.display()))?;
    written.push(summary_path);
    let prov_path =
        write_provenance(&dir, e, &profile, command, commit, &results, t0.elapsed().as_secs_f64())?;
    written.push(prov_path);
    let ok = results.iter().filter(|r| r.status == Status::Ok).count();
    print!("{summary}");
    println!(
        "{} cells ({ok} planned) in {:.1} s; wrote {}",
        results.len(),
        t0.elapsed().as_secs_f64(),
        written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

/// `cells.csv`: key columns, per metric `X`, `X_paper`, `X_err`, then `calibration`.
fn write_cells(t: &PaperTable, comps: &[Comparison], path: &Path) -> anyhow::Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("writing {}", path.display()))?;
    let mut header = t.key_columns.clone();
    for (m, _) in &t.metrics {
        header.extend([m.clone(), format!("{m}_paper"), format!("{m}_err")]);
    }
    header.push("calibration".into());
    w.write_record(&header)?;
    for (ri, row) in t.rows.iter().enumerate() {
        let mut rec = row.keys.clone();
        let mut cal = false;
        for c in comps.iter().filter(|c| c.row == ri) {
            rec.extend([fmt(c.ours, 3), format!("{}", c.paper), fmt(c.err, 4)]);
            cal = c.calibration;
        }
        rec.push(cal.to_string());
        w.write_record(&rec)?;
    }
    w.flush()?;
    Ok(())
}

/// (metric column, model, ctx) → (budget, ours, paper) for the plots.
pub type TableSeries = BTreeMap<(String, String, u64), Vec<(u64, Option<f64>, f64)>>;

fn table_series(t: &PaperTable, comps: &[Comparison]) -> TableSeries {
    let mut s: TableSeries = BTreeMap::new();
    for c in comps {
        let row = &t.rows[c.row];
        s.entry((t.metrics[c.metric].0.clone(), row.model.clone(), row.ctx)).or_default().push((
            row.budget_bytes,
            c.ours,
            c.paper,
        ));
    }
    for v in s.values_mut() {
        v.sort_by_key(|x| x.0);
    }
    s
}

/// (metric column, budget) → (batch, ours, paper) for the plots of a batched table.
pub type BatchSeries = BTreeMap<(String, u64), Vec<(u64, Option<f64>, f64)>>;

fn batch_series(t: &PaperTable, comps: &[Comparison]) -> BatchSeries {
    let mut s: BatchSeries = BTreeMap::new();
    for c in comps {
        let row = &t.rows[c.row];
        s.entry((t.metrics[c.metric].0.clone(), row.budget_bytes))
            .or_default()
            .push((row.batch, c.ours, c.paper));
    }
    for v in s.values_mut() {
        v.sort_by_key(|x| x.0);
    }
    s
}

/// One row of `planners.csv`.
#[derive(Debug, Serialize)]
struct PlannerRow {
    model: String,
    ctx: u64,
    vram_budget_bytes: u64,
    batch: u64,
    planner: String,
    ttft_ms: Option<f64>,
    tps: Option<f64>,
    e2el_ms: Option<f64>,
    e2el_speedup_vs_pshard: Option<f64>,
    e2el_speedup_vs_ngl: Option<f64>,
    ttft_speedup_vs_pshard: Option<f64>,
    tps_speedup_vs_pshard: Option<f64>,
    /// Binding resource of this planner's best-E2EL plan in decode (GPU, PCIe, DRAM) and its busy share.
    decode_bound: String,
    decode_bound_busy: Option<f64>,
    /// … and in prefill (compute, copy, CPU).
    prefill_bound: String,
    prefill_bound_busy: Option<f64>,
}

/// Writes `planners.csv` (one row per paper cell and planner; best ubatch per metric) and returns the
/// markdown summary of our planners against `pshard`.
fn write_planners(
    e: &Experiment,
    t: &PaperTable,
    results: &[CellResult],
    pts: &Points,
    specs: &BTreeMap<String, ModelSpec>,
    cost: &TableCostModel,
    path: &Path,
) -> anyhow::Result<String> {
    let inventories: BTreeMap<&String, Arc<Inventory>> =
        specs.iter().map(|(m, s)| (m, Inventory::shared(s))).collect();
    // (model, ctx, budget, batch, planner) → the result with the best E2EL over ubatches.
    let mut best_run: BTreeMap<(&str, u64, u64, u64, &str), &CellResult> = BTreeMap::new();
    for r in results.iter().filter(|r| r.run.is_some()) {
        let c = &r.cell;
        let e2el = |r: &CellResult| r.run.as_deref().map_or(u64::MAX, |x| x.sim.metrics.e2el_ns);
        let slot = best_run
            .entry((c.model.as_str(), c.ctx, c.budget_bytes, c.batch, c.planner.as_str()))
            .or_insert(r);
        if e2el(r) < e2el(slot) {
            *slot = r;
        }
    }
    let rows: Vec<PlannerRow> = {
        let keys: Vec<(&PaperRow, &String)> =
            t.rows.iter().flat_map(|row| e.planners.iter().map(move |p| (row, p))).collect();
        let progress = bar(keys.len() as u64, "bounds");
        let rows = keys
            .iter()
            .map(|(row, p)| {
                let me = at(pts, row, p);
                let vs = |q: &str| best_paired(me, at(pts, row, q), |a, b| b.e2el_ms / a.e2el_ms);
                // Our planners against pshard's plans on the same (our) runtime; pshard against itself.
                let ps = at(pts, row, if p.as_str() == "pshard" { "pshard" } else { PSHARD_ON_OURS });
                let b = best_run
                    .get(&(row.model.as_str(), row.ctx, row.budget_bytes, row.batch, p.as_str()))
                    .and_then(|r| bounds(r, &specs[&row.model], &inventories[&row.model], cost));
                progress.inc(1);
                PlannerRow {
                    model: row.model.clone(),
                    ctx: row.ctx,
                    vram_budget_bytes: row.budget_bytes,
                    batch: row.batch,
                    planner: (*p).clone(),
                    ttft_ms: r4(best(me, |x| 1.0 / x.ttft_ms).map(|x| 1.0 / x)),
                    tps: r4(best(me, |x| x.tps)),
                    e2el_ms: r4(best(me, |x| 1.0 / x.e2el_ms).map(|x| 1.0 / x)),
                    e2el_speedup_vs_pshard: r4(best_paired(me, ps, |a, b| b.e2el_ms / a.e2el_ms)),
                    e2el_speedup_vs_ngl: r4(vs("ngl")),
                    ttft_speedup_vs_pshard: r4(best_paired(me, ps, |a, b| b.ttft_ms / a.ttft_ms)),
                    tps_speedup_vs_pshard: r4(best_paired(me, ps, |a, b| a.tps / b.tps)),
                    decode_bound: b.map_or_else(String::new, |b| b[0].0.to_string()),
                    decode_bound_busy: r4(b.map(|b| b[0].1)),
                    prefill_bound: b.map_or_else(String::new, |b| b[1].0.to_string()),
                    prefill_bound_busy: r4(b.map(|b| b[1].1)),
                }
            })
            .collect();
        progress.finish_and_clear();
        rows
    };
    let mut w = csv::Writer::from_path(path).with_context(|| format!("writing {}", path.display()))?;
    for r in &rows {
        w.serialize(r)?;
    }
    w.flush()?;
    Ok(beat_summary(e, &rows))
}

/// Our planners against `pshard` and `ngl`: geometric-mean and worst E2EL speed-up, cells where each is at
/// least as fast as `pshard`, and the binding resources of `ilp`'s plans.
fn beat_summary(e: &Experiment, rows: &[PlannerRow]) -> String {
    if !e.planners.iter().any(|p| p == "pshard") {
        return String::new();
    }
    let mut s = String::from(
        "## Our planners on the same cells (E2EL speed-up, best ubatch, over `pshard`'s plans on our runtime; \
         planners.csv has every cell)\n\n\
         | planner | cells | ≥ pshard | geomean × pshard | worst × pshard (cell) | geomean × ngl | no plan |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for p in ours_planners(e).into_iter().chain(["pshard"]) {
        let sel: Vec<&PlannerRow> = rows.iter().filter(|r| r.planner == p).collect();
        let vs_ps: Vec<(f64, &PlannerRow)> =
            sel.iter().filter_map(|r| r.e2el_speedup_vs_pshard.map(|x| (x, *r))).collect();
        let vs_ngl: Vec<f64> = sel.iter().filter_map(|r| r.e2el_speedup_vs_ngl).collect();
        let geo = |v: &[f64]| (v.iter().map(|x| x.ln()).sum::<f64>() / v.len().max(1) as f64).exp();
        let worst = vs_ps.iter().min_by(|a, b| a.0.total_cmp(&b.0));
        // A 0.1% tolerance: the simulator samples steps, and ties are ties.
        let at_least = vs_ps.iter().filter(|(x, _)| *x >= 0.999).count();
        let _ = writeln!(
            s,
            "| {p} | {} | {at_least}/{} | {:.2} | {} | {:.2} | {} |",
            sel.len(),
            vs_ps.len(),
            geo(&vs_ps.iter().map(|x| x.0).collect::<Vec<_>>()),
            worst.map_or_else(String::new, |(x, r)| format!(
                "{x:.3} ({} {} {}{})",
                r.model,
                format_tokens(r.ctx),
                format_bytes(r.vram_budget_bytes),
                if r.batch > 1 { format!(" × {} requests", r.batch) } else { String::new() }
            )),
            geo(&vs_ngl),
            sel.iter().filter(|r| r.e2el_ms.is_none()).count(),
        );
    }
    let mut bounds: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.planner == "ilp" && !r.decode_bound.is_empty()) {
        *bounds.entry((r.decode_bound.clone(), r.prefill_bound.clone())).or_default() += 1;
    }
    s.push_str("\nBinding resource of `ilp`'s plans (decode / prefill): ");
    s.push_str(&bounds.iter().map(|((d, p), n)| format!("{d} / {p}: {n}")).collect::<Vec<_>>().join(", "));
    s.push('\n');
    s
}

/// Fits the free parameters of a derived profile on the calibration models' cells of [`CALIBRATION_TABLES`].
fn calibrate(a: &CalibrateArgs, command: &str) -> anyhow::Result<()> {
    let commit = git_commit();
    let t0 = Instant::now();
    let mut tables = Vec::new();
    let mut set = Vec::new();
    for name in &a.tables {
        let t = load_table(&a.experiments, name)?;
        let cal = &t.paper.calibration_models;
        let planners: Vec<&str> = t.table.metrics.iter().flat_map(|(_, m)| m.planners()).copied().collect();
        let cells: Vec<Cell> = t
            .experiment
            .cells()
            .into_iter()
            .filter(|c| cal.contains(&c.model) && planners.contains(&c.planner.as_str()))
            .collect();
        set.push(format!(
            "{name}: {} ({} paper rows)",
            cal.join(", "),
            t.table.rows.iter().filter(|r| cal.contains(&r.model)).count()
        ));
        let mut table = t.table.clone();
        table.rows.retain(|r| cal.contains(&r.model));
        tables.push((cells, t.experiment.specs()?, table, t.paper, t.experiment.gen_tokens));
    }
    if reference::derived(&a.system).is_none() {
        bail!("no derived system `{}`; known: {}", a.system, reference::systems().join(", "));
    }
    let eval = |e: &Efficiencies| -> f64 {
        let profile = reference::derived_with(&a.system, e).expect("checked above");
        let cost = TableCostModel::new(&profile);
        // Each table weighs the same, whatever its number of rows.
        let per_table: Vec<f64> = tables
            .iter()
            .map(|(cells, specs, table, paper, gen_tokens)| {
                let results = run_cells(cells, specs, &cost, false);
                objective(&compare(table, paper, &points(&results, *gen_tokens)))
            })
            .collect();
        per_table.iter().sum::<f64>() / per_table.len() as f64
    };
    let names = DEFAULT_EFFICIENCIES.values().map(|(name, _)| name);
    if let Some(bad) = a.vary.iter().find(|v| !names.contains(&v.as_str())) {
        bail!("--vary: no parameter `{bad}`; known: {}", names.join(", "));
    }
    let varied: Vec<usize> =
        (0..names.len()).filter(|&i| a.vary.is_empty() || a.vary.iter().any(|v| v == names[i])).collect();
    let (mut x, start_from) = match &a.start {
        None => (DEFAULT_EFFICIENCIES, "the default assumptions".to_string()),
        Some(p) => {
            let source = Profile::load(p).with_context(|| format!("--start {}", p.display()))?;
            let ProfileProvenance::Derived { fit: Some(fit), .. } = source.provenance else {
                bail!(
                    "--start {}: the profile carries no fit; give one written by `repro calibrate`",
                    p.display()
                );
            };
            (fit.parameters, format!("the fit of {} ({})", p.display(), fit.calibration_set))
        }
    };
    // One parameter alone is scanned over its range first (a log grid), so that the descent starts in the
    // global minimum's basin: plan choices make the objective jump (a cheaper CPU expert flips a plan).
    let scan = if varied.len() == 1 { SCAN_POINTS } else { 0 };
    let progress = bar(u64::from(a.rounds) * 2 * varied.len() as u64 + 1 + u64::from(scan), "evaluations");
    let start = eval(&x);
    let mut fx = start;
    progress.inc(1);
    if let [i] = varied[..] {
        let (lo, hi) = Efficiencies::range(i);
        for j in 0..scan {
            let cand = x.with(i, lo * (hi / lo).powf(f64::from(j) / f64::from(scan - 1)));
            let f = eval(&cand);
            progress.inc(1);
            if f < fx {
                (x, fx) = (cand, f);
            }
        }
    }
    // Coordinate descent in log space: each parameter up and down by a factor, halving it when a round
    // gains nothing.
    let mut step = 0.4f64;
    for _ in 0..a.rounds {
        let mut improved = false;
        for &i in &varied {
            for dir in [1.0, -1.0] {
                let (lo, hi) = Efficiencies::range(i);
                let v = (x.values()[i].1 * (dir * step).exp()).clamp(lo, hi);
                // Already at the bound in this direction.
                if (v - x.values()[i].1).abs() <= 1e-12 {
                    progress.inc(1);
                    continue;
                }
                let cand = x.with(i, v);
                let f = eval(&cand);
                progress.inc(1);
                if f < fx {
                    (x, fx, improved) = (cand, f, true);
                    break;
                }
            }
        }
        progress.set_message(format!("objective {fx:.4}, step ×{:.2}", step.exp()));
        if !improved {
            step /= 2.0;
            if step < 0.03 {
                break;
            }
        }
    }
    progress.finish_and_clear();
    let mut profile: Profile = reference::derived_with(&a.system, &x).expect("checked above");
    if let ProfileProvenance::Derived { fit, .. } = &mut profile.provenance {
        *fit = Some(Fit {
            parameters: x,
            calibration_set: format!(
                "{} (Table 4 and Table 9: pshard's TPS and TTFT; baseline: the replayed `-ngl` runs' TTFT and TPS \
                 per ubatch; every other cell, and all of Figure 2, is held out); varied: {}, from {start_from}",
                set.join("; "),
                if a.vary.is_empty() { "every parameter".to_string() } else { a.vary.join(", ") },
            ),
            objective: format!(
                "mean squared log error of ours vs the paper over every metric of those rows, averaged over the \
                 tables: {start:.4} at the start, {fx:.4} fitted"
            ),
            command: command.to_string(),
            commit,
            date_utc: now_utc(),
        });
    }
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from(format!("profiles/{}.json", a.system)));
    std::fs::write(&out, profile.to_json() + "\n").with_context(|| format!("writing {}", out.display()))?;
    println!("fitted {} in {:.0} s: objective {start:.4} → {fx:.4}", a.system, t0.elapsed().as_secs_f64());
    for ((name, v), (_, d)) in x.values().iter().zip(DEFAULT_EFFICIENCIES.values()) {
        println!("  {name:<16} {v:>8.3}  (default {d})");
    }
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounded_ttft_stands_for_an_interval() {
        assert_eq!(Metric::TtftMs.paper_interval(200.0), (150.0, 250.0));
        assert_eq!(Metric::TtftMs.paper_interval(520.0), (520.0, 520.0));
        assert_eq!(Metric::Tps.paper_interval(200.0), (200.0, 200.0));
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(median_p90(&mut v), Some((5.0, 9.0)));
        assert_eq!(median_p90(&mut []), None);
    }

    #[test]
    fn speedups_pair_ubatches_and_keep_the_best() {
        let p = |ttft_ms, tps| Point { ttft_ms, tps, e2el_ms: ttft_ms + 100.0 / tps * 1e3 };
        let ps: BTreeMap<u64, Point> = [(1024, p(100.0, 10.0)), (2048, p(80.0, 9.0))].into();
        let ngl: BTreeMap<u64, Point> = [(1024, p(300.0, 5.0)), (2048, p(160.0, 6.0))].into();
        // TTFT: 3.0 at 1024 beats 2.0 at 2048; TPS: 2.0 at 1024 beats 1.5.
        assert_eq!(best_paired(Some(&ps), Some(&ngl), |a, b| b.ttft_ms / a.ttft_ms), Some(3.0));
        assert_eq!(best_paired(Some(&ps), Some(&ngl), |a, b| a.tps / b.tps), Some(2.0));
        assert_eq!(best_paired(Some(&ps), None, |a, b| a.tps / b.tps), None);
    }

    #[test]
    fn committed_tables_load_and_cover_the_paper() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        for (name, rows, ubatches) in [("table4", 112, 1), ("figure2", 128, 2)] {
            let t = load_table(&dir, name).unwrap();
            assert_eq!(t.table.rows.len(), rows, "{name}");
            let cells = t.experiment.cells();
            // Every paper row has a pshard cell per ubatch, and every ngl cell replays a measured N.
            for row in &t.table.rows {
                let n = cells
                    .iter()
                    .filter(|c| {
                        c.model == row.model && c.ctx == row.ctx && c.budget_bytes == row.budget_bytes
                    })
                    .filter(|c| c.planner == "pshard")
                    .count();
                assert_eq!(n, ubatches, "{name} {:?}", row.keys);
            }
            assert!(cells.iter().filter(|c| c.planner == "ngl").all(|c| c.ngl_layers.is_some()));
            let q = cells.iter().find(|c| c.model == "qwen3-30b-a3b" && c.ctx == 4096).unwrap();
            assert_eq!(q.prompt_tokens, 3935);
            // Generation stops at the full context: 4096 − 4035 tokens of room for Minitron at 4K.
            let m = cells.iter().find(|c| c.model == "nemo-4b" && c.ctx == 4096).unwrap();
            assert_eq!((m.prompt_tokens, m.gen_tokens), (4035, 61));
        }
        // The baseline at 2G replays the run measured at MVA 2000: -ngl 3 for minitron-4b at 1K.
        let t = load_table(&dir, "figure2").unwrap();
        let c = t
            .experiment
            .cells()
            .into_iter()
            .find(|c| {
                c.model == "nemo-4b" && c.ctx == 1024 && c.budget_bytes == 2 << 30 && c.planner == "ngl"
            })
            .unwrap();
        assert_eq!(c.ngl_layers, Some(3));
    }

    /// Table 9 and Figure 7 are keyed by batch: every row has one `pshard` cell at its batch, and the baseline
    /// replays the `-ngl N` measured at the whole `-c N×1024` (DIGEST §4: 3/20/44 at 1K … 2/15/32 at 64K).
    #[test]
    fn batched_tables_key_rows_by_batch_and_replay_the_total_context() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        for name in ["table9", "figure7"] {
            let t = load_table(&dir, name).unwrap();
            assert!(t.table.batched);
            assert_eq!(t.table.rows.len(), 12, "{name}");
            assert_eq!(t.table.key_columns, ["Model", "VramBudget", "BatchSize"]);
            let cells = t.experiment.cells();
            assert_eq!(cells.len(), 12 * 4);
            for row in &t.table.rows {
                let at = |planner: &str| {
                    cells
                        .iter()
                        .filter(|c| {
                            c.planner == planner && c.batch == row.batch && c.budget_bytes == row.budget_bytes
                        })
                        .collect::<Vec<_>>()
                };
                let ps = at("pshard");
                assert_eq!(ps.len(), 1, "{name} {:?}", row.keys);
                assert_eq!((ps[0].ctx, ps[0].prompt_tokens, ps[0].gen_tokens), (1024, 889, 128));
                let ngl = at("ngl");
                assert!(ngl[0].ngl_flash_attn && ps[0].kv_unified);
                let expect = match (row.budget_bytes >> 30, row.batch) {
                    (2, 64) => 2,
                    (2, _) => 3,
                    (8, 16) => 19,
                    (8, 64) => 15,
                    (8, _) => 20,
                    (16, 1) => 44,
                    (16, 4) => 43,
                    (16, 16) => 40,
                    _ => 32,
                };
                assert_eq!(ngl[0].ngl_layers, Some(expect), "{name} {:?}", row.keys);
            }
        }
    }

    #[test]
    #[allow(clippy::float_cmp)] // means of exactly representable values
    fn bad_paper_csv_names_file_row_and_field() {
        let dir = std::env::temp_dir().join(format!("pipeshard-repro-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let csv = dir.join("t.csv");
        std::fs::write(&csv, "Model,CtxK,VramBudget,TPSSpeedup\nm,1K,2G,fast\n").unwrap();
        let p = PaperRef {
            csv: csv.clone(),
            names: [("ours".to_string(), "m".to_string())].into(),
            calibration_models: vec![],
            tolerance: 0.2,
        };
        let e = PaperTable::load(&p, None).unwrap_err().to_string();
        assert!(
            e.contains("t.csv") && e.contains("row 2") && e.contains("TPSSpeedup") && e.contains("fast"),
            "{e}"
        );
        std::fs::write(&csv, "Model,Budget,TPS\nm,2G,1\n").unwrap();
        let e = PaperTable::load(&p, None).unwrap_err().to_string();
        assert!(e.contains("CtxK or CtxSize"), "{e}");
        // The baseline's runs: failed runs skipped, trials of one key averaged, MVA in decimal thousands.
        let runs = "Model,Context,MVA,Ubatch,Trial,Status,PromptEvalTime_ms,EvalTPS\n\
                    m,1024,2000,1024,0,SUCCESS,600,10\nm,1024,2000,1024,1,SUCCESS,700,12\n\
                    m,1024,2000,1024,2,FAILED,1,1\nm,1024,2000,2048,0,SUCCESS,500,11\n";
        std::fs::write(&csv, runs).unwrap();
        let t = PaperTable::load(&p, None).unwrap();
        assert_eq!(t.rows.len(), 2);
        let r = &t.rows[0];
        assert_eq!((r.ctx, r.budget_bytes, r.ubatch), (1024, 2 * pipeshard_core::GIB, Some(1024)));
        let col = |m: Metric| t.metrics.iter().position(|(_, x)| *x == m).unwrap();
        assert_eq!((r.values[col(Metric::NglTtftMs)], r.values[col(Metric::NglTps)]), (650.0, 11.0));
        assert_eq!(t.rows[1].ubatch, Some(2048));
        std::fs::write(&csv, runs.replace(",2000,1024,0", ",2500,1024,0")).unwrap();
        let e = format!("{:#}", PaperTable::load(&p, None).unwrap_err());
        assert!(e.contains("row 2") && e.contains("MVA") && e.contains("2500"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn baseline_rows_outside_the_grid_are_dropped_and_ours_is_ngl_at_their_ubatch() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        let t = load_table(&dir, "baseline").unwrap();
        let budgets = t.experiment.budgets();
        assert!(t.table.rows.iter().all(|r| budgets.contains(&r.budget_bytes)), "no 1, 3 or 5 GB rows");
        // minitron-4b 1K at 2G (MVA 2000), ubatch 1024: trials of 660.23 and 678.85 ms.
        let row = t
            .table
            .rows
            .iter()
            .find(|r| {
                r.model == "nemo-4b"
                    && r.ctx == 1024
                    && r.ubatch == Some(1024)
                    && r.budget_bytes == budgets[0]
            })
            .unwrap();
        let ttft = t.table.metrics.iter().position(|(_, m)| *m == Metric::NglTtftMs).unwrap();
        assert!((row.values[ttft] - f64::midpoint(660.23, 678.85)).abs() < 1e-9);
        let point = |ttft_ms: f64| Point { ttft_ms, tps: 1.0, e2el_ms: 1.0 };
        let mut pts = Points::new();
        pts.insert(
            (row.model.clone(), row.ctx, row.budget_bytes, 1, "ngl".into()),
            [(1024, point(700.0)), (2048, point(300.0))].into(),
        );
        assert_eq!(ours(&pts, row, Metric::NglTtftMs), Some(700.0), "the row's ubatch, not the best");
    }
}
