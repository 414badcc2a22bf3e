//! `pipeshard validate`: the simulator's predictions against real executions, cell by cell.
//!
//! For every cell of an experiment (models in the experiment's `weights` format, contexts, budgets, ubatches,
//! planners and forced pipeline depths) it plans with the runtime overhead this machine measures, predicts with
//! the simulator, runs the same plan with the executor, and records both: TTFT, TPS, E2EL, peak VRAM and busy
//! time per resource. It writes, under `<out>/<date>-<gpu>/`:
//! - `cells.csv`: `X_pred` and `X_meas` for X in ttft_ms, tps, e2el_ms, vram_peak_bytes (and busy times);
//!   `calibration` is false on every row because nothing is fitted to these cells;
//! - `summary.md`: median and p90 of |error| per metric, overall, per planner and per model kind;
//! - `scatter.png`: predicted against measured, log axes, the y = x line;
//! - `worst-N.json`: the simulator's and the executor's traces of the worst cells in one Perfetto file
//!   (`traces/cell-N.json` for every cell with `--all-traces`);
//! - `provenance.json`.
//!
//! Around each run a host check reads DRAM with the profile's threads and times a CPU GEMV against the
//! profile's row of that shape; a cell run while the shared host read under 90 % of the profile's DRAM figure,
//! or ran the GEMV under 90 % of its row's pace (each reference lowered to the host's at the start), runs once
//! more (`host_dram_gbps`, `host_gemv_ratio`, `attempts` in `cells.csv`). The host's kernel launches are
//! timed against the profile's launch cost too (`host_launch_ratio`), which the summary reports.
//! An experiment's `runs_per_cell` runs each cell's plan that many times: its measurements are the runs'
//! medians, their spread in `cells.csv` (`runs`, `ttft_spread_meas`, `tps_spread_meas`) and the summary.
//! A cell whose plan and workload an earlier cell already ran (a coordinate its planner ignores, such as
//! `ngl`'s depth) is predicted but not run again: its row's status names the cell that ran it.
//!
//! Measured VRAM is what the executor carved from its arena in the larger phase, plus the runtime overhead it
//! measured, plus what the driver loaded lazily past both during the run (the arena itself is allocated
//! whole, so the process peak is always near the budget; it is kept in its own column and must stay under
//! the budget). The prediction counts the executor's lazy-load reserve in place of that growth.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::metrics::{Metrics, Resource};
use pipeshard_core::plan::{Plan, VramBreakdown};
use pipeshard_core::trace::Trace;
use pipeshard_core::workload::OpClass;
use pipeshard_exec::RunOptions;
use pipeshard_exec::cpu::CpuPool;
use pipeshard_exec::cuda::{Gpu, probe};
use pipeshard_exec::testing::random_tokens;
use pipeshard_exec::weights::ModelWeights;
use pipeshard_profiler::cpu::{DramProbe, GemvProbe};
use pipeshard_profiler::gpu::LaunchProbe;
use pipeshard_sim::{SimOptions, Simulator};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::args::{format_bytes, format_tokens, load_profile};
use crate::exec::{provenance, with_measured_overhead};
use crate::experiment::{Cell, Experiment};
use crate::plots::{COLOURS, register};
use crate::sweep::run_cell;

/// Arguments of `validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The cells: an experiment file (`weights`, `depths` and the usual grid fields).
    #[arg(long, default_value = "experiments/validate-h200.toml")]
    experiment: PathBuf,
    /// Profile the planners and the simulator use instead of the experiment's (a path or `profiles/NAME.json`).
    #[arg(long)]
    profile: Option<String>,
    /// Results go to `OUT/<date>-<gpu>/`.
    #[arg(long, default_value = "results/validation")]
    out: PathBuf,
    /// Seed of the random weights and prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How many of the worst cells get their traces written side by side.
    #[arg(long, default_value_t = 3)]
    worst: usize,
    /// Also write every validated cell's traces side by side, `traces/cell-N.json` for row N of `cells.csv`
    /// (≈ 0.2 MB a cell): what a later look at any cell needs, without another device run.
    #[arg(long)]
    all_traces: bool,
    /// Run nothing: summarise and plot the `cells.csv` files of earlier runs into `--out` (for a grid measured
    /// in several device sessions).
    #[arg(long, num_args = 1..)]
    summarize: Vec<PathBuf>,
    /// Run nothing on a GPU: plan and simulate the experiment's cells again with this build and compare them
    /// with the measurements of an earlier run's `cells.csv` of the same experiment. Cells whose plan differs
    /// from the one that ran (another fingerprint, or where none was recorded other depths or predicted VRAM)
    /// are reported and left out: their measurement belongs to another plan.
    #[arg(long, conflicts_with = "summarize")]
    repredict: Option<PathBuf>,
    /// Run nothing: the measurements of two runs' `cells.csv` against each other, over the cells that ran the
    /// same plan (equal fingerprints) in both — how far the machine itself moves between runs, the floor under
    /// any prediction's error.
    #[arg(long, num_args = 2, value_names = ["A", "B"], conflicts_with_all = ["summarize", "repredict"])]
    reproducibility: Vec<PathBuf>,
}

/// What one side (simulator or executor) says about a cell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub ttft_ms: f64,
    pub tps: f64,
    pub e2el_ms: f64,
    pub vram_peak_bytes: u64,
    /// Busy time per [`Resource::ALL`] entry.
    pub busy_ms: [f64; 4],
}

impl Sample {
    fn new(m: &Metrics, vram_peak_bytes: u64) -> Sample {
        Sample {
            ttft_ms: m.ttft_ms(),
            tps: m.tps,
            e2el_ms: m.e2el_ms(),
            vram_peak_bytes,
            busy_ms: Resource::ALL.map(|r| m.busy(r) as f64 / 1e6),
        }
    }
}

/// The median of each metric over runs of one plan (the middle two's mean for an even count), and the largest
/// VRAM peak; `None` for no run.
fn median_sample(runs: &[Sample]) -> Option<Sample> {
    let median = |f: &dyn Fn(&Sample) -> f64| -> f64 {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 { v[n / 2] } else { f64::midpoint(v[n / 2 - 1], v[n / 2]) }
    };
    runs.first()?;
    Some(Sample {
        ttft_ms: median(&|s| s.ttft_ms),
        tps: median(&|s| s.tps),
        e2el_ms: median(&|s| s.e2el_ms),
        vram_peak_bytes: runs.iter().map(|s| s.vram_peak_bytes).max().unwrap_or(0),
        busy_ms: std::array::from_fn(|i| median(&|s| s.busy_ms[i])),
    })
}

/// (max − min) ÷ median of one metric over runs of one plan; `None` for fewer than two runs.
fn spread(runs: &[Sample], median: f64, f: fn(&Sample) -> f64) -> Option<f64> {
    if runs.len() < 2 || median <= 0.0 {
        return None;
    }
    let (lo, hi) = runs.iter().map(f).fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    Some((hi - lo) / median)
}

/// How many times a cell's plan ran (`runs_per_cell`), and how far its runs' TTFT and TPS lay apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Runs {
    pub count: u32,
    /// [`spread`] of the runs' TTFT and TPS.
    pub ttft_spread: Option<f64>,
    pub tps_spread: Option<f64>,
}

impl Runs {
    const ONE: Runs = Runs { count: 1, ttft_spread: None, tps_spread: None };
}

/// The metrics the goal is stated for: TTFT, TPS, E2EL, peak VRAM (the columns of the summary and the panels
/// of the scatter plot, in this order).
const METRICS: [fn(&Sample) -> f64; 4] =
    [|s| s.ttft_ms, |s| s.tps, |s| s.e2el_ms, |s| s.vram_peak_bytes as f64];

/// One validated cell.
#[derive(Debug)]
pub struct Outcome {
    pub cell: Cell,
    /// `dense` or `moe`.
    pub kind: &'static str,
    pub status: String,
    pub pred: Option<Sample>,
    pub meas: Option<Sample>,
    /// Depths of the plan that ran (prefill, decode).
    pub depths: Option<(u32, u32)>,
    /// Measured process VRAM peak (context and arena included).
    pub process_peak_bytes: Option<u64>,
    pub runtime_overhead_bytes: u64,
    /// [`plan_fingerprint`] of the plan that was predicted (and run).
    pub plan_fingerprint: Option<String>,
    /// The host check's DRAM read around the run that was kept (the lower of before and after), GB/s.
    pub host_dram_gbps: Option<f64>,
    /// The host check's CPU GEMV over the profile's row of that shape around the run that was kept (the
    /// lower of before and after).
    pub host_gemv_ratio: Option<f64>,
    /// The host's launch rate around the run over the profile's (the slower of before and after; below 1: it
    /// launched slower than when profiled).
    pub host_launch_ratio: Option<f64>,
    /// Runs of the cell: more than one when the host check found the host disturbed.
    pub attempts: u32,
    /// Whether the host check still found the host disturbed around the run that was kept (after
    /// `HOST_ATTEMPTS` runs): its measurement is another host's than the profile's.
    pub host_disturbed: bool,
    /// The runs of the attempt that was kept (`runs_per_cell`); `meas` is their median.
    pub runs: Runs,
    /// What is kept to draw the worst cells: the plan and the executor's trace.
    pub run: Option<(Plan, Trace)>,
}

impl Outcome {
    /// Relative error pred / meas − 1 of metric `i` of [`METRICS`].
    fn error(&self, i: usize) -> Option<f64> {
        let (p, m) = (self.pred?, self.meas?);
        let (p, m) = (METRICS[i](&p), METRICS[i](&m));
        (m > 0.0 && p.is_finite()).then(|| p / m - 1.0)
    }

    /// The larger of the TTFT and TPS errors: how the worst cells are ranked.
    fn worst_error(&self) -> f64 {
        [0, 1].iter().filter_map(|&i| self.error(i)).map(f64::abs).fold(0.0, f64::max)
    }
}

/// Median and p90 (nearest rank) of |x|, or `None` for no values.
#[must_use]
pub fn median_p90(values: &[f64]) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().map(|x| x.abs()).filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    let median =
        if v.len() % 2 == 1 { v[v.len() / 2] } else { f64::midpoint(v[v.len() / 2 - 1], v[v.len() / 2]) };
    Some((median, rank(0.9)))
}

/// The summary table (Markdown): one row per group, median / p90 of |error| per metric.
#[must_use]
pub fn summary(outcomes: &[Outcome]) -> String {
    summary_of(outcomes, "|predicted ÷ measured − 1|")
}

/// [`summary`] of `pred ÷ meas − 1` read as `what`.
fn summary_of(outcomes: &[Outcome], what: &str) -> String {
    let mut groups: Vec<(String, Vec<&Outcome>)> = vec![("all".into(), outcomes.iter().collect())];
    // Where the host check still read a disturbed host around some cells, the rest apart: their
    // measurements are the profile's host's.
    if outcomes.iter().any(|o| o.host_disturbed) {
        groups.push(("host check held".into(), outcomes.iter().filter(|o| !o.host_disturbed).collect()));
    }
    let mut by: BTreeMap<String, Vec<&Outcome>> = BTreeMap::new();
    for o in outcomes {
        by.entry(format!("planner {}", o.cell.planner)).or_default().push(o);
        by.entry(format!("{} models", o.kind)).or_default().push(o);
    }
    groups.extend(by);
    let mut s = String::from(
        "| cells | validated | TTFT (prefill) | TPS (decode) | E2EL | peak VRAM |\n|---|---|---|---|---|---|\n",
    );
    for (name, members) in groups {
        let ok = members.iter().filter(|o| o.pred.is_some() && o.meas.is_some()).count();
        let _ = write!(s, "| {name} ({}) | {ok} |", members.len());
        for i in 0..METRICS.len() {
            let errors: Vec<f64> = members.iter().filter_map(|o| o.error(i)).collect();
            match median_p90(&errors) {
                Some((m, p)) => {
                    let _ = write!(s, " {:.1}% / {:.1}% |", 100.0 * m, 100.0 * p);
                }
                None => s.push_str(" – |"),
            }
        }
        s.push('\n');
    }
    let _ = writeln!(s, "\nEach entry: median / p90 of {what} over the validated cells of the group.");
    s
}

fn one() -> u64 {
    1
}

fn one_run() -> u32 {
    1
}

/// One row of `cells.csv`.
#[derive(Debug, Serialize, Deserialize)]
struct Row {
    model: String,
    kind: String,
    ctx: u64,
    prompt_tokens: u64,
    gen_tokens: u64,
    ubatch: u64,
    /// Parallel requests (absent in runs before batched cells: 1).
    #[serde(default = "one")]
    batch: u64,
    /// Whether the plan that ran has one unified KV cache (the planner's choice where it picks).
    #[serde(default)]
    kv_unified: bool,
    vram_budget_bytes: u64,
    planner: String,
    depth: Option<u32>,
    prefill_pipeline_depth: Option<u32>,
    decode_pipeline_depth: Option<u32>,
    status: String,
    ttft_ms_pred: Option<f64>,
    ttft_ms_meas: Option<f64>,
    tps_pred: Option<f64>,
    tps_meas: Option<f64>,
    e2el_ms_pred: Option<f64>,
    e2el_ms_meas: Option<f64>,
    vram_peak_bytes_pred: Option<u64>,
    vram_peak_bytes_meas: Option<u64>,
    busy_gpu_ms_pred: Option<f64>,
    busy_gpu_ms_meas: Option<f64>,
    busy_h2d_ms_pred: Option<f64>,
    busy_h2d_ms_meas: Option<f64>,
    busy_d2h_ms_pred: Option<f64>,
    busy_d2h_ms_meas: Option<f64>,
    busy_cpu_ms_pred: Option<f64>,
    busy_cpu_ms_meas: Option<f64>,
    process_vram_peak_bytes: Option<u64>,
    runtime_overhead_bytes: u64,
    /// Absent from runs before the host check (as are `attempts`).
    #[serde(default)]
    host_dram_gbps: Option<f64>,
    /// Absent from runs before session 12.
    #[serde(default)]
    host_gemv_ratio: Option<f64>,
    /// Absent from runs before session 13.
    #[serde(default)]
    host_launch_ratio: Option<f64>,
    #[serde(default = "one_run")]
    attempts: u32,
    /// Absent from runs before session 20 (read as not disturbed).
    #[serde(default)]
    host_disturbed: bool,
    /// Absent from runs before `runs_per_cell` (one run a cell).
    #[serde(default = "one_run")]
    runs: u32,
    #[serde(default)]
    ttft_spread_meas: Option<f64>,
    #[serde(default)]
    tps_spread_meas: Option<f64>,
    calibration: bool,
    /// Absent from runs before the column existed.
    #[serde(default)]
    plan_fingerprint: Option<String>,
}

fn write_csv(outcomes: &[Outcome], path: &Path) -> anyhow::Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("writing {}", path.display()))?;
    for o in outcomes {
        let (p, m) = (o.pred.as_ref(), o.meas.as_ref());
        let busy = |s: Option<&Sample>, i: usize| s.map(|s| s.busy_ms[i]);
        w.serialize(Row {
            model: o.cell.model.clone(),
            kind: o.kind.to_string(),
            ctx: o.cell.ctx,
            prompt_tokens: o.cell.prompt_tokens,
            gen_tokens: o.cell.gen_tokens,
            ubatch: o.cell.ubatch,
            batch: o.cell.batch,
            kv_unified: o.run.as_ref().map_or(o.cell.kv_unified, |(plan, _)| plan.workload.kv_unified),
            vram_budget_bytes: o.cell.budget_bytes,
            planner: o.cell.planner.clone(),
            depth: o.cell.depth,
            prefill_pipeline_depth: o.depths.map(|d| d.0),
            decode_pipeline_depth: o.depths.map(|d| d.1),
            status: o.status.clone(),
            ttft_ms_pred: p.map(|s| s.ttft_ms),
            ttft_ms_meas: m.map(|s| s.ttft_ms),
            tps_pred: p.map(|s| s.tps),
            tps_meas: m.map(|s| s.tps),
            e2el_ms_pred: p.map(|s| s.e2el_ms),
            e2el_ms_meas: m.map(|s| s.e2el_ms),
            vram_peak_bytes_pred: p.map(|s| s.vram_peak_bytes),
            vram_peak_bytes_meas: m.map(|s| s.vram_peak_bytes),
            busy_gpu_ms_pred: busy(p, 0),
            busy_gpu_ms_meas: busy(m, 0),
            busy_h2d_ms_pred: busy(p, 1),
            busy_h2d_ms_meas: busy(m, 1),
            busy_d2h_ms_pred: busy(p, 2),
            busy_d2h_ms_meas: busy(m, 2),
            busy_cpu_ms_pred: busy(p, 3),
            busy_cpu_ms_meas: busy(m, 3),
            process_vram_peak_bytes: o.process_peak_bytes,
            runtime_overhead_bytes: o.runtime_overhead_bytes,
            host_dram_gbps: o.host_dram_gbps,
            host_gemv_ratio: o.host_gemv_ratio,
            host_launch_ratio: o.host_launch_ratio,
            attempts: o.attempts,
            host_disturbed: o.host_disturbed,
            runs: o.runs.count,
            ttft_spread_meas: o.runs.ttft_spread,
            tps_spread_meas: o.runs.tps_spread,
            calibration: false,
            plan_fingerprint: o.plan_fingerprint.clone(),
        })?;
    }
    w.flush()?;
    Ok(())
}

impl Row {
    /// The outcome a row records (without the plan and trace, which the CSV does not hold).
    fn outcome(self) -> Outcome {
        let sample = |ttft: Option<f64>,
                      tps: Option<f64>,
                      e2el: Option<f64>,
                      vram: Option<u64>,
                      busy: [Option<f64>; 4]| {
            Some(Sample {
                ttft_ms: ttft?,
                tps: tps?,
                e2el_ms: e2el?,
                vram_peak_bytes: vram?,
                busy_ms: busy.map(|b| b.unwrap_or(0.0)),
            })
        };
        Outcome {
            kind: if self.kind == "moe" { "moe" } else { "dense" },
            pred: sample(
                self.ttft_ms_pred,
                self.tps_pred,
                self.e2el_ms_pred,
                self.vram_peak_bytes_pred,
                [self.busy_gpu_ms_pred, self.busy_h2d_ms_pred, self.busy_d2h_ms_pred, self.busy_cpu_ms_pred],
            ),
            meas: sample(
                self.ttft_ms_meas,
                self.tps_meas,
                self.e2el_ms_meas,
                self.vram_peak_bytes_meas,
                [self.busy_gpu_ms_meas, self.busy_h2d_ms_meas, self.busy_d2h_ms_meas, self.busy_cpu_ms_meas],
            ),
            depths: self.prefill_pipeline_depth.zip(self.decode_pipeline_depth),
            process_peak_bytes: self.process_vram_peak_bytes,
            runtime_overhead_bytes: self.runtime_overhead_bytes,
            plan_fingerprint: self.plan_fingerprint,
            host_dram_gbps: self.host_dram_gbps,
            host_gemv_ratio: self.host_gemv_ratio,
            host_launch_ratio: self.host_launch_ratio,
            attempts: self.attempts,
            host_disturbed: self.host_disturbed,
            runs: Runs {
                count: self.runs,
                ttft_spread: self.ttft_spread_meas,
                tps_spread: self.tps_spread_meas,
            },
            run: None,
            status: self.status,
            cell: Cell {
                model: self.model,
                ctx: self.ctx,
                prompt_tokens: self.prompt_tokens,
                gen_tokens: self.gen_tokens,
                ubatch: self.ubatch,
                batch: self.batch,
                kv_unified: self.kv_unified,
                budget_bytes: self.vram_budget_bytes,
                planner: self.planner,
                depth: self.depth,
                ngl_layers: None,
                budget_excludes_runtime: false,
                ngl_flash_attn: false,
                requests: pipeshard_core::workload::Requests::Distinct,
            },
        }
    }
}

/// Reads the outcomes back from `cells.csv` files (several runs of one grid may be summarised together).
fn read_csvs(paths: &[PathBuf]) -> anyhow::Result<Vec<Outcome>> {
    let mut v = Vec::new();
    for path in paths {
        let mut r = csv::Reader::from_path(path).with_context(|| format!("reading {}", path.display()))?;
        for (i, row) in r.deserialize::<Row>().enumerate() {
            let row =
                row.with_context(|| format!("{}: row {} is not a validation row", path.display(), i + 1))?;
            v.push(row.outcome());
        }
    }
    Ok(v)
}

/// The simulator's and the executor's traces in one file: the prediction's tracks first, the measurement's
/// below them (process ids shifted), each process name saying which side it is.
#[must_use]
pub fn side_by_side(pred: &Trace, meas: &Trace) -> Trace {
    let offset = pred.events.iter().map(|e| e.pid).max().map_or(0, |p| p + 1);
    let mut out = Trace::new();
    for (side, trace, shift) in [("predicted", pred, 0), ("measured", meas, offset)] {
        for e in &trace.events {
            let mut e = e.clone();
            e.pid += shift;
            if e.name == "process_name"
                && let Some(name) = e.args.get_mut("name")
            {
                *name = format!("{side} · {}", name.as_str().unwrap_or_default()).into();
            }
            out.events.push(e);
        }
    }
    out
}

/// Predicted against measured, one panel per metric, log axes, the y = x line, a colour per planner.
fn scatter(outcomes: &[Outcome], planners: &[String], path: &Path) -> anyhow::Result<()> {
    register();
    let root = BitMapBackend::new(path, (1200, 1060)).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(60);
    header.draw(&Text::new(
        "simulator vs executor: predicted (y) against measured (x)",
        (16, 8),
        ("sans-serif", 22).into_font(),
    ))?;
    let mut x = 16;
    for (i, p) in planners.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        header.draw(&Circle::new((x + 6, 44), 5, colour.filled()))?;
        header.draw(&Text::new(p.clone(), (x + 16, 36), ("sans-serif", 16).into_font()))?;
        x += 40 + 9 * p.len() as i32;
    }
    let units = ["TTFT (ms)", "TPS (tokens/s)", "E2EL (ms)", "peak VRAM (GiB)"];
    for (i, area) in body.split_evenly((2, 2)).iter().enumerate() {
        let scale = if i == 3 { 1.0 / f64::from(1u32 << 30) } else { 1.0 };
        let points: Vec<(f64, f64, usize)> = outcomes
            .iter()
            .filter_map(|o| {
                let (p, m) = (o.pred?, o.meas?);
                let planner = planners.iter().position(|x| *x == o.cell.planner).unwrap_or(0);
                Some((METRICS[i](&m) * scale, METRICS[i](&p) * scale, planner))
            })
            .filter(|(m, p, _)| *m > 0.0 && *p > 0.0)
            .collect();
        let (lo, hi) = points
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), (m, p, _)| (lo.min(m.min(*p)), hi.max(m.max(*p))));
        let (lo, hi) = if points.is_empty() { (0.1, 10.0) } else { (lo / 1.3, hi * 1.3) };
        let mut chart = ChartBuilder::on(area)
            .caption(units[i], ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())
            .context("building a scatter panel")?;
        chart
            .configure_mesh()
            .x_desc("measured")
            .y_desc("predicted")
            .x_labels(6)
            .y_labels(6)
            .x_label_formatter(&|v| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .y_label_formatter(&|v| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .light_line_style(WHITE)
            .label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(LineSeries::new([(lo, lo), (hi, hi)], BLACK.stroke_width(1)))?;
        chart.draw_series(
            points.iter().map(|&(m, p, c)| Circle::new((m, p), 4, COLOURS[c % COLOURS.len()].filled())),
        )?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A file-name-safe slug of the GPU's name (`NVIDIA H200` → `nvidia-h200`).
pub(crate) fn slug(name: &str) -> String {
    let s: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    s.split('-').filter(|p| !p.is_empty()).collect::<Vec<_>>().join("-")
}

/// Where a validation came from.
#[derive(Debug, Serialize)]
struct Provenance {
    command: String,
    commit: String,
    date_utc: String,
    experiment: String,
    profile: String,
    profile_source: serde_json::Value,
    machine: String,
    cells: usize,
    validated_cells: usize,
    wall_time_s: f64,
    fitted: &'static str,
}

/// What identifies the plan a cell ran: a CRC-32 of both phase plans (placements, depths, slots, offload,
/// threads, VRAM lines), not of the planner's notes or estimate.
#[must_use]
pub fn plan_fingerprint(plan: &Plan) -> String {
    let phases = serde_json::to_vec(&(&plan.prefill, &plan.decode)).expect("plans serialise");
    format!("{:08x}", crc32fast::hash(&phases))
}

/// The 1-based row of the earlier outcome that ran `o`'s plan (equal fingerprints) on `o`'s workload.
fn same_run(earlier: &[Outcome], o: &Outcome) -> Option<usize> {
    let w = o.cell.workload();
    earlier
        .iter()
        .position(|e| e.meas.is_some() && e.plan_fingerprint == o.plan_fingerprint && e.cell.workload() == w)
        .map(|i| i + 1)
}

/// The grid coordinates a `cells.csv` row records (the batch too: a grid has cells that differ only by it).
/// Not the KV layout: a row records the one the planner chose.
fn same_cell(a: &Cell, b: &Cell) -> bool {
    let coords = |c: &Cell| {
        let size = (c.ctx, c.prompt_tokens, c.gen_tokens, c.ubatch, c.batch, c.budget_bytes);
        (c.model.clone(), size, c.planner.clone(), c.depth)
    };
    coords(a) == coords(b)
}

/// `--repredict`: this build's predictions of an earlier run's measured cells (see [`ValidateArgs`]).
fn repredict(a: &ValidateArgs, csv: &Path) -> anyhow::Result<()> {
    let e = Experiment::load(&a.experiment)?;
    let profile_name = a.profile.clone().unwrap_or_else(|| e.profile.clone());
    let profile = load_profile(&profile_name)?;
    let specs = e.specs()?;
    let measured = read_csvs(&[csv.to_path_buf()])?;
    let (mut outcomes, mut changed) = (Vec::new(), Vec::new());
    for cell in e.cells() {
        let Some(old) = measured.iter().find(|o| same_cell(&o.cell, &cell)) else { continue };
        let Some(meas) = old.meas else { continue };
        let spec = &specs[&cell.model];
        let mut prof = profile.clone();
        prof.runtime_overhead_bytes = old.runtime_overhead_bytes;
        let cost = TableCostModel::new(&prof);
        let planned = run_cell(&cell, spec, &Inventory::new(spec), &cost);
        let label = format!(
            "{} {} ctx {} budget {}",
            cell.planner,
            cell.model,
            format_tokens(cell.ctx),
            format_bytes(cell.budget_bytes)
        );
        let Some(run) = planned.run else {
            changed.push(format!("{label}: no plan now ({})", planned.reason));
            continue;
        };
        let pred = Sample::new(&run.sim.metrics, run.sim.metrics.vram_peak_bytes);
        let depths = (run.plan.prefill.pipeline_depth, run.plan.decode.pipeline_depth);
        let fingerprint = plan_fingerprint(&run.plan);
        let same = match &old.plan_fingerprint {
            Some(f) => *f == fingerprint,
            None => {
                old.depths == Some(depths)
                    && old.pred.is_some_and(|p| p.vram_peak_bytes == pred.vram_peak_bytes)
            }
        };
        if !same {
            changed.push(format!("{label}: the plan differs from the one that ran"));
            continue;
        }
        outcomes.push(Outcome {
            kind: old.kind,
            status: "ok".into(),
            pred: Some(pred),
            meas: Some(meas),
            depths: Some(depths),
            process_peak_bytes: old.process_peak_bytes,
            runtime_overhead_bytes: old.runtime_overhead_bytes,
            plan_fingerprint: Some(fingerprint),
            host_dram_gbps: old.host_dram_gbps,
            host_gemv_ratio: old.host_gemv_ratio,
            host_launch_ratio: old.host_launch_ratio,
            attempts: old.attempts,
            host_disturbed: old.host_disturbed,
            runs: old.runs,
            run: None,
            cell,
        });
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    write_csv(&outcomes, &a.out.join("cells.csv"))?;
    scatter(&outcomes, &e.planners, &a.out.join("scatter.png"))?;
    let mut md = format!(
        "# Re-prediction of `{}` with this build (commit {}, profile `{profile_name}`)\n\n{} cells re-predicted \
         against their measurements; {} left out because their plan changed; nothing fitted.\n\n{}",
        csv.display(),
        provenance().0,
        outcomes.len(),
        changed.len(),
        summary(&outcomes)
    );
    if !changed.is_empty() {
        md.push_str("\n## Left out\n\n");
        for c in &changed {
            let _ = writeln!(md, "- {c}");
        }
    }
    std::fs::write(a.out.join("summary.md"), &md)
        .with_context(|| format!("writing {}/summary.md", a.out.display()))?;
    print!("{md}");
    Ok(())
}

/// The cells of `second` that ran the plan they ran in `first` (equal fingerprints), each with `first`'s
/// measurement in place of the prediction, so [`summary_of`] gives |first ÷ second − 1|.
fn paired_measurements(first: &[Outcome], second: Vec<Outcome>) -> Vec<Outcome> {
    second
        .into_iter()
        .filter_map(|o| {
            let twin = first.iter().find(|f| {
                same_cell(&f.cell, &o.cell)
                    && f.plan_fingerprint.is_some()
                    && f.plan_fingerprint == o.plan_fingerprint
            })?;
            Some(Outcome { pred: twin.meas, ..o })
        })
        .filter(|o| o.pred.is_some() && o.meas.is_some())
        .collect()
}

/// `--reproducibility A B`: writes `reproducibility.md` into `a.out`.
fn reproducibility(a: &ValidateArgs, first: &Path, second: &Path) -> anyhow::Result<()> {
    let pairs = paired_measurements(&read_csvs(&[first.to_path_buf()])?, read_csvs(&[second.to_path_buf()])?);
    let (commit, date, command) = provenance();
    let md = format!(
        "# Reproducibility: `{}` against `{}`\n\nCommand `{command}` (commit {commit}, {date}). {} cells ran the \
         same plan (equal fingerprints) in both runs; nothing predicted.\n\n{}",
        first.display(),
        second.display(),
        pairs.len(),
        summary_of(&pairs, "|first run's measurement ÷ second run's − 1|")
    );
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let path = a.out.join("reproducibility.md");
    std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
    print!("{md}");
    Ok(())
}

/// Writes `summary.md` and `scatter.png` of earlier runs' `cells.csv` files into `a.out`.
fn summarize(a: &ValidateArgs) -> anyhow::Result<()> {
    let outcomes = read_csvs(&a.summarize)?;
    let mut planners: Vec<String> = Vec::new();
    for o in &outcomes {
        if !planners.contains(&o.cell.planner) {
            planners.push(o.cell.planner.clone());
        }
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    scatter(&outcomes, &planners, &a.out.join("scatter.png"))?;
    let sources: Vec<String> = a.summarize.iter().map(|p| format!("`{}`", p.display())).collect();
    let validated = outcomes.iter().filter(|o| o.pred.is_some() && o.meas.is_some()).count();
    let md = format!(
        "# Validation summary of {}\n\n{validated} of {} cells validated; nothing fitted (no calibration \
         cells).\n\n{}",
        sources.join(", "),
        outcomes.len(),
        summary(&outcomes)
    );
    let path = a.out.join("summary.md");
    std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
    print!("{md}");
    Ok(())
}

/// Runs `validate`.
pub fn run(a: &ValidateArgs) -> anyhow::Result<()> {
    if !a.summarize.is_empty() {
        return summarize(a);
    }
    if let Some(csv) = &a.repredict {
        return repredict(a, csv);
    }
    if let [first, second] = a.reproducibility.as_slice() {
        return reproducibility(a, first, second);
    }
    let (commit, date, command) = provenance();
    let t0 = Instant::now();
    let e = Experiment::load(&a.experiment)?;
    let profile_name = a.profile.clone().unwrap_or_else(|| e.profile.clone());
    let profile = load_profile(&profile_name)?;
    let gpu = match probe() {
        Ok(_) => Gpu::new().context("opening the CUDA device")?,
        Err(reason) => bail!(
            "validate runs every cell on a CUDA GPU and none is usable here ({reason}); \
             `pipeshard sim sweep --experiment {}` gives the predictions alone",
            a.experiment.display()
        ),
    };
    let machine = format!(
        "{} + {} CPU threads (profile: {} threads)",
        gpu.name(),
        num_cpus(),
        profile.machine.cpu_threads
    );
    // Predictions from another machine's profile are still made, but never silently.
    let mut warned = crate::exec::WarnOnce::default();
    for w in profile.mismatch_warnings(Some(gpu.name()), profile.machine.cpu_threads) {
        warned.warn(&format!("profile {profile_name}: {w}"));
    }
    let dir = a.out.join(format!("{}-{}", &date[..date.len().min(10)], slug(gpu.name())));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    let specs = e.specs()?;
    let borrowed = crate::args::borrowed_rows(&TableCostModel::new(&profile), &profile_name, specs.values());
    for w in &borrowed {
        eprintln!("{w}");
    }
    let cells = e.cells();
    let bar = ProgressBar::new(cells.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} cells {elapsed} {msg}").expect("a valid template"),
    );
    // The simulator's trace of a cell's plan (with the overhead measured for it) beside the executor's.
    let write_traces = |o: &Outcome, file: &Path| -> anyhow::Result<()> {
        let (plan, measured) = o.run.as_ref().expect("a cell that ran");
        let mut prof = profile.clone();
        prof.runtime_overhead_bytes = o.runtime_overhead_bytes;
        let cost = TableCostModel::new(&prof);
        let predicted = Simulator::new(&specs[&o.cell.model], plan, &cost)?
            .run(&SimOptions { trace: true, ..SimOptions::default() })
            .trace
            .unwrap_or_default();
        std::fs::write(file, side_by_side(&predicted, measured).to_json())
            .with_context(|| format!("writing {}", file.display()))
    };
    // Every cell's traces as soon as it ran (`--all-traces`): a grid stopped part-way keeps them.
    let traces = dir.join("traces");
    if a.all_traces {
        std::fs::create_dir_all(&traces).with_context(|| format!("creating {}", traces.display()))?;
    }
    let host = HostCheck::new(&profile, &gpu)?;
    let mut outcomes = Vec::with_capacity(cells.len());
    // Cells come model by model: the weights of one model at a time.
    let mut model: Option<(String, Inventory, ModelWeights)> = None;
    for cell in cells {
        let spec = &specs[&cell.model];
        if model.as_ref().is_none_or(|(name, _, _)| *name != cell.model) {
            drop(model.take()); // the previous model's weights go before the next one's are made
            bar.set_message(format!("generating {} weights", cell.model));
            let weights = ModelWeights::random(spec, a.seed)
                .with_context(|| format!("{}: the executor cannot hold this model", cell.model))?;
            model = Some((cell.model.clone(), Inventory::new(spec), weights));
        }
        let (_, inv, weights) = model.as_ref().expect("set above");
        bar.set_message(format!(
            "{} ctx {} {} {}",
            cell.model,
            format_tokens(cell.ctx),
            format_bytes(cell.budget_bytes),
            cell.planner
        ));
        let mut attempts = 0;
        let outcome = loop {
            attempts += 1;
            let (before_gbps, before_gemv, before_launch) =
                (host.gbps(), host.gemv_ratio(), host.launch_ratio(&gpu));
            let mut o = validate_cell(
                cell.clone(),
                spec,
                inv,
                weights,
                &gpu,
                &profile,
                a.seed,
                e.runs_per_cell,
                &outcomes,
            )?;
            let host_gbps = before_gbps.min(host.gbps());
            o.host_gemv_ratio = before_gemv.zip(host.gemv_ratio()).map(|(b, a)| b.min(a));
            o.host_launch_ratio = before_launch.zip(host.launch_ratio(&gpu)).map(|(b, a)| b.min(a));
            (o.host_dram_gbps, o.attempts) = (Some(host_gbps), attempts);
            o.host_disturbed = o.meas.is_some() && host.disturbed(host_gbps, o.host_gemv_ratio);
            if !o.host_disturbed || attempts == HOST_ATTEMPTS {
                break o;
            }
            bar.println(format!(
                "{} {} {}: the host read DRAM at {host_gbps:.1} GB/s (reference {:.1}) and ran the CPU GEMV at \
                 {:.2} of the profile's row (reference {:.2}) around the run, one under {:.0} % of its \
                 reference: running the cell again",
                cell.model,
                format_bytes(cell.budget_bytes),
                cell.planner,
                host.expected_gbps,
                o.host_gemv_ratio.unwrap_or(f64::NAN),
                host.gemv_reference,
                100.0 * HOST_OK_SHARE,
            ));
        };
        if a.all_traces && outcome.run.is_some() && outcome.pred.is_some() {
            write_traces(&outcome, &traces.join(format!("cell-{}.json", outcomes.len() + 1)))?;
        }
        outcomes.push(outcome);
        // Rewritten after every cell: a run stopped part-way still leaves the cells it measured.
        write_csv(&outcomes, &dir.join("cells.csv"))?;
        bar.inc(1);
    }
    bar.finish_and_clear();

    let table = summary(&outcomes);
    let validated = outcomes.iter().filter(|o| o.pred.is_some() && o.meas.is_some()).count();
    let mut md = format!(
        "# Validation: {} on {machine}\n\nProfile `{profile_name}`; {validated} of {} cells validated; nothing \
         fitted (no calibration cells).\n\n{table}",
        e.name,
        outcomes.len()
    );
    let rerun = outcomes.iter().filter(|o| o.attempts > 1).count();
    let still = outcomes.iter().filter(|o| o.host_disturbed);
    let _ = writeln!(
        md,
        "\nHost check (DRAM read and CPU GEMV with {} threads before and after each run; the references, the lower \
         of the profile's and the host's at the start: {:.1} GB/s and {:.2} of the profile's GEMV row): {rerun} \
         cells ran again after a reading under {:.0} % of either; {} kept such a reading after {HOST_ATTEMPTS} \
         runs (columns `host_dram_gbps`, `host_gemv_ratio`, `host_disturbed`; the table's `host check held` row \
         leaves them out).",
        profile.machine.cpu_threads,
        host.expected_gbps,
        host.gemv_reference,
        100.0 * HOST_OK_SHARE,
        still.count()
    );
    if let Some(line) = gemv_check_line(&outcomes, host.expected_gemv_gbps) {
        let _ = writeln!(md, "\n{line}");
    }
    if let Some(line) = launch_check_line(&outcomes, profile.launch_ns) {
        let _ = writeln!(md, "\n{line}");
    }
    if let Some(line) = runs_line(&outcomes) {
        let _ = writeln!(md, "\n{line}");
    }
    for w in &borrowed {
        md.push('\n');
        md.push_str(w);
        md.push('\n');
    }
    scatter(&outcomes, &e.planners, &dir.join("scatter.png"))?;

    let mut ranked: Vec<&Outcome> = outcomes.iter().filter(|o| o.run.is_some() && o.pred.is_some()).collect();
    ranked.sort_by(|x, y| y.worst_error().total_cmp(&x.worst_error()));
    md.push_str("\n## Worst cells (largest TTFT or TPS error)\n\n");
    for (k, o) in ranked.iter().take(a.worst).enumerate() {
        let plan = &o.run.as_ref().expect("filtered").0;
        let file = dir.join(format!("worst-{}.json", k + 1));
        write_traces(o, &file)?;
        let (p, m) = (o.pred.expect("filtered"), o.meas.expect("filtered"));
        let _ = writeln!(
            md,
            "{}. {} {} ctx {} budget {}, ring depths {}/{}: TTFT {:.1} ms predicted vs {:.1} measured \
             ({:+.1}%), TPS {:.2} vs {:.2} ({:+.1}%); traces in `{}`",
            k + 1,
            o.cell.planner,
            o.cell.model,
            format_tokens(o.cell.ctx),
            format_bytes(o.cell.budget_bytes),
            plan.prefill.pipeline_depth,
            plan.decode.pipeline_depth,
            p.ttft_ms,
            m.ttft_ms,
            100.0 * o.error(0).unwrap_or(f64::NAN),
            p.tps,
            m.tps,
            100.0 * o.error(1).unwrap_or(f64::NAN),
            file.file_name().map(|f| f.to_string_lossy()).unwrap_or_default(),
        );
    }
    std::fs::write(dir.join("summary.md"), &md)
        .with_context(|| format!("writing {}/summary.md", dir.display()))?;
    let prov = Provenance {
        command,
        commit,
        date_utc: date,
        experiment: a.experiment.display().to_string(),
        profile: profile_name,
        profile_source: serde_json::to_value(&profile.provenance)?,
        machine,
        cells: outcomes.len(),
        validated_cells: validated,
        wall_time_s: t0.elapsed().as_secs_f64(),
        fitted: "nothing: every prediction comes from the profile as measured",
    };
    std::fs::write(dir.join("provenance.json"), serde_json::to_string_pretty(&prov)? + "\n")
        .with_context(|| format!("writing {}/provenance.json", dir.display()))?;
    print!("{md}");
    println!("\nwrote {}", dir.display());
    Ok(())
}

/// The share of the host check's reference DRAM read below which it counts the host as disturbed.
const HOST_OK_SHARE: f64 = 0.9;
/// Runs of a cell at most while the host check finds the host disturbed.
const HOST_ATTEMPTS: u32 = 2;

/// The host's DRAM read with the profile's threads, right before and right after each cell's run. The GPU
/// machine's host is shared: in run21 (results/validation/2026-12-01-nvidia-h200) the CPU-bound cells of a
/// ~100 s stretch decoded up to 2× slower than in run20 and than the same cells re-run minutes later on a
/// fresh lease, a disturbance no prediction can know of. Such a cell runs again, and cells.csv keeps what the
/// host read.
///
/// It also times a CPU GEMV against the profile's row of the same shape (`host_gemv_ratio`): the DRAM read can
/// hold while the GEMV does not, and a ratio far from 1 in every cell says the profile's CPU rows were taken in
/// another host state than the cells ran in (run27: its host section's GEMV rows 26 % slow).
struct HostCheck {
    pool: CpuPool,
    probe: DramProbe,
    expected_gbps: f64,
    gemv: GemvProbe,
    /// The profile's GB/s at the probe's shape, one token, the profile's threads (None: no such row).
    expected_gemv_gbps: Option<f64>,
    /// The GEMV ratio a cell is held to: the lower of 1 (the profile's row) and the host's at the start, as
    /// `expected_gbps` is for the DRAM read.
    gemv_reference: f64,
    launch: LaunchProbe,
    /// The profile's nanoseconds a launch (0: none).
    expected_launch_ns: u64,
}

impl HostCheck {
    fn new(profile: &pipeshard_core::profile::Profile, gpu: &Gpu) -> anyhow::Result<HostCheck> {
        let threads = profile.machine.cpu_threads;
        let (n, k) = GemvProbe::SHAPE;
        let expected_gemv_gbps = profile
            .cpu
            .ops
            .iter()
            .find(|r| {
                r.op == OpClass::MatMul
                    && r.dtype == DType::Bf16
                    && (r.n, r.k, r.tokens, r.threads) == (n, k, 1, threads)
            })
            .map(|r| (2 * n * k) as f64 / r.time_ns as f64);
        let (pool, probe) = (CpuPool::new(threads as usize)?, DramProbe::default());
        // The lower of the profile's read and the host's now: a profile taken in a faster host state (run30's
        // read 118 GB/s at its start and 94 at its end; the cells ~100) had 59 of 96 cells run twice, and the
        // grid overran its command.
        let expected_gbps = profile.dram_gbps(threads, false).min(probe.gbps(&pool));
        let gemv = GemvProbe::default();
        let gemv_reference = expected_gemv_gbps.map_or(1.0, |e| (gemv.gbps(&pool) / e).min(1.0));
        Ok(HostCheck {
            pool,
            probe,
            expected_gbps,
            gemv,
            expected_gemv_gbps,
            gemv_reference,
            launch: LaunchProbe::new(gpu)?,
            expected_launch_ns: profile.launch_ns,
        })
    }

    /// The profile's launch cost over the probe's (a rate ratio, as `gemv_ratio`), if both are known.
    fn launch_ratio(&self, gpu: &Gpu) -> Option<f64> {
        let ns = self.launch.ns_per_launch(gpu).ok()?;
        (self.expected_launch_ns > 0 && ns > 0.0).then(|| self.expected_launch_ns as f64 / ns)
    }

    fn gbps(&self) -> f64 {
        self.probe.gbps(&self.pool)
    }

    /// The GEMV probe's GB/s over the profile's, if it has the row.
    fn gemv_ratio(&self) -> Option<f64> {
        self.expected_gemv_gbps.map(|e| self.gemv.gbps(&self.pool) / e)
    }

    /// Whether a cell's readings (DRAM GB/s, GEMV ratio) say it ran on a host in another state than the
    /// profile's: either under [`HOST_OK_SHARE`] of its reference. The DRAM read can hold while the GEMV does
    /// not (validation run35: cells with GEMV ratios 0.74 and 0.88 and the usual DRAM read were among the
    /// worst, CPU prefill 29 % and CPU decode 14 % slower than predicted).
    fn disturbed(&self, gbps: f64, gemv_ratio: Option<f64>) -> bool {
        host_disturbed((gbps, self.expected_gbps), gemv_ratio.map(|r| (r, self.gemv_reference)))
    }
}

/// Whether a reading falls under [`HOST_OK_SHARE`] of its reference: the DRAM read `(GB/s, reference)`, or
/// the GEMV's `(ratio to the profile's row, reference ratio)` where the profile has the row.
fn host_disturbed(dram: (f64, f64), gemv: Option<(f64, f64)>) -> bool {
    let under = |(reading, reference): (f64, f64)| reading < HOST_OK_SHARE * reference;
    under(dram) || gemv.is_some_and(under)
}

/// Median, smallest and largest of a probe's ratio over the measured cells (None: no reading).
fn ratio_spread(outcomes: &[Outcome], ratio: fn(&Outcome) -> Option<f64>) -> Option<(f64, f64, f64, usize)> {
    let mut r: Vec<f64> = outcomes.iter().filter(|o| o.meas.is_some()).filter_map(ratio).collect();
    r.sort_by(f64::total_cmp);
    Some((*r.get(r.len() / 2)?, r[0], r[r.len() - 1], r.len()))
}

/// The summary's line on the GEMV probe: the spread of `host_gemv_ratio` over the measured cells.
fn gemv_check_line(outcomes: &[Outcome], expected_gbps: Option<f64>) -> Option<String> {
    let expected = expected_gbps?;
    let (median, lo, hi, n) = ratio_spread(outcomes, |o| o.host_gemv_ratio)?;
    let (rows, k) = GemvProbe::SHAPE;
    Some(format!(
        "CPU GEMV check ({rows}×{k} bf16, one token, before and after each run; the profile's row: {expected:.1} \
         GB/s): measured ÷ profile {median:.2} (median), {lo:.2}–{hi:.2} over {n} cells (column `host_gemv_ratio`; far \
         from 1 in every cell: the profile's CPU rows and the cells saw different hosts)."
    ))
}

/// The summary's line on the launch probe: the spread of `host_launch_ratio` over the measured cells.
fn launch_check_line(outcomes: &[Outcome], expected_ns: u64) -> Option<String> {
    let (median, lo, hi, n) = ratio_spread(outcomes, |o| o.host_launch_ratio)?;
    Some(format!(
        "Launch check (1000 tiny kernels back to back before and after each run; the profile's: {:.2} µs a \
         launch): profile ÷ measured {median:.2} (median), {lo:.2}–{hi:.2} over {n} cells (column \
         `host_launch_ratio`; below 1 the host launched slower than when profiled, and host-paced work — a \
         prefill chunk's GPU experts, launches after CPU work — with it).",
        expected_ns as f64 / 1e3
    ))
}

/// The summary's line on cells run more than once (`runs_per_cell`): how far a cell's runs lay apart.
fn runs_line(outcomes: &[Outcome]) -> Option<String> {
    let runs = outcomes.iter().filter(|o| o.meas.is_some()).map(|o| o.runs.count).max().filter(|&n| n > 1)?;
    let part = |what: &str, f: fn(&Outcome) -> Option<f64>| {
        ratio_spread(outcomes, f).map_or_else(String::new, |(median, _, hi, n)| {
            format!("; {what} {:.1} % (median), {:.1} % (largest) over {n} cells", 100.0 * median, 100.0 * hi)
        })
    };
    Some(format!(
        "Runs: each cell's plan ran {runs} times and its measurements are the runs' medians (columns `runs`, \
         `ttft_spread_meas`, `tps_spread_meas`). Spread of a cell's runs, (largest − smallest) ÷ median{}{}.",
        part("TTFT", |o| o.runs.ttft_spread),
        part("TPS", |o| o.runs.tps_spread),
    ))
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
}

/// Plans, predicts and runs one cell. Errors of the cell (no plan, a run that fails) are its status; only a
/// broken machine (the overhead cannot be measured) stops the whole validation.
fn validate_cell(
    cell: Cell,
    spec: &pipeshard_core::model::ModelSpec,
    inv: &Inventory,
    weights: &ModelWeights,
    gpu: &Gpu,
    profile: &pipeshard_core::profile::Profile,
    seed: u64,
    runs: u32,
    earlier: &[Outcome],
) -> anyhow::Result<Outcome> {
    let workload = cell.workload();
    let prof = with_measured_overhead(gpu, spec, &workload, profile)?;
    let cost = TableCostModel::new(&prof);
    let mut outcome = Outcome {
        kind: if spec.is_moe() { "moe" } else { "dense" },
        status: String::new(),
        pred: None,
        meas: None,
        depths: None,
        process_peak_bytes: None,
        runtime_overhead_bytes: prof.runtime_overhead_bytes,
        plan_fingerprint: None,
        host_dram_gbps: None,
        host_gemv_ratio: None,
        host_launch_ratio: None,
        attempts: 1,
        host_disturbed: false,
        runs: Runs::ONE,
        run: None,
        cell,
    };
    let planned = run_cell(&outcome.cell, spec, inv, &cost);
    let Some(run) = planned.run else {
        let status = serde_json::to_value(planned.status)?;
        outcome.status = format!("{}: {}", status.as_str().unwrap_or_default(), planned.reason);
        return Ok(outcome);
    };
    let (plan, sim) = (run.plan, run.sim);
    outcome.pred = Some(Sample::new(&sim.metrics, sim.metrics.vram_peak_bytes));
    outcome.depths = Some((plan.prefill.pipeline_depth, plan.decode.pipeline_depth));
    outcome.plan_fingerprint = Some(plan_fingerprint(&plan));
    if let Some(n) = same_run(earlier, &outcome) {
        // A grid coordinate the planner ignores (`ngl`'s depth) gives the same run again: one measurement of it
        // is one cell, and the device time goes to the others.
        outcome.status = format!("the same plan and workload as cell {n}: not run again");
        return Ok(outcome);
    }
    // Every parallel request gets a prompt of its own.
    let prompt = |s: u64| random_tokens(workload.prompt_tokens as usize, weights.dims.vocab, seed + s);
    let opts = RunOptions {
        prompt: prompt(0),
        other_prompts: (1..workload.batch).map(prompt).collect(),
        gen_tokens: workload.gen_tokens as usize,
        force_tokens: None,
        keep_logits: false,
        ..RunOptions::default()
    };
    // `runs` runs of the plan; the measurement is their median, the trace and the process peak those of the run
    // whose TTFT is the median (the upper middle one for an even count).
    let mut done: Vec<(Sample, Option<u64>, Trace)> = Vec::new();
    for _ in 0..runs {
        match pipeshard_exec::run(weights, &plan, Some(gpu), &opts) {
            Ok(out) => {
                let v = out.vram.as_ref();
                // What the process needs: the larger phase's carved lines, the overhead measured before the
                // arena, and what was loaded lazily past them (the arena is allocated whole, so the process
                // total alone would only echo the budget). The plan counts the lazy-load reserve instead, in
                // its overhead.
                let held = v.map_or(0, |v| {
                    let lazy = v.peak_process_bytes.saturating_sub(v.overhead_bytes + v.arena_bytes);
                    v.used.iter().map(VramBreakdown::total).max().unwrap_or(0) + v.overhead_bytes + lazy
                });
                done.push((Sample::new(&out.metrics, held), v.map(|v| v.peak_process_bytes), out.trace));
            }
            Err(e) => {
                outcome.status = format!("exec error: {e}");
                return Ok(outcome);
            }
        }
    }
    let samples: Vec<Sample> = done.iter().map(|d| d.0).collect();
    let meas = median_sample(&samples).expect("runs_per_cell ≥ 1 (Experiment::check)");
    done.sort_by(|a, b| a.0.ttft_ms.total_cmp(&b.0.ttft_ms));
    let (_, peak, trace) = done.swap_remove(done.len() / 2);
    outcome.runs = Runs {
        count: runs,
        ttft_spread: spread(&samples, meas.ttft_ms, |s| s.ttft_ms),
        tps_spread: spread(&samples, meas.tps, |s| s.tps),
    };
    outcome.meas = Some(meas);
    outcome.process_peak_bytes = peak;
    outcome.status = "ok".into();
    outcome.run = Some((plan, trace));
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two runs' measurements pair up only where the same plan ran; the first run's stands in for the
    /// prediction, so the summary reads |first ÷ second − 1|.
    #[test]
    fn reproducibility_pairs_the_same_plans_measurements() {
        let first = vec![outcome("ilp", "dense", 0.0, 10.0), outcome("pshard", "dense", 0.0, 20.0)];
        let mut other_plan = outcome("pshard", "dense", 0.0, 30.0);
        other_plan.plan_fingerprint = Some("ffff0000".into());
        let second =
            vec![outcome("ilp", "dense", 0.0, 11.0), other_plan, outcome("greedy", "dense", 0.0, 5.0)];
        let pairs = paired_measurements(&first, second);
        assert_eq!(pairs.len(), 1, "only ilp ran the same plan in both");
        assert!((pairs[0].error(0).unwrap() - (10.0 / 11.0 - 1.0)).abs() < 1e-12);
        let md = summary_of(&pairs, "|first ÷ second − 1|");
        assert!(md.contains("| all (1) | 1 | 9.1% / 9.1% |"), "{md}");
    }

    /// The summary states the GEMV probe's ratio to the profile's row over the measured cells, and nothing
    /// without the profile's row or a reading.
    #[test]
    fn the_gemv_check_line_gives_the_ratios_spread() {
        let mut cells = vec![outcome("ilp", "dense", 1.0, 1.0), outcome("ngl", "dense", 1.0, 1.0)];
        cells[1].host_gemv_ratio = Some(1.41);
        cells.push(Outcome { meas: None, host_gemv_ratio: Some(0.2), ..outcome("pshard", "moe", 1.0, 1.0) });
        let line = gemv_check_line(&cells, Some(99.8)).expect("a line");
        assert!(
            line.contains("99.8 GB/s") && line.contains("1.41 (median), 1.25–1.41 over 2 cells"),
            "{line}"
        );
        assert!(gemv_check_line(&cells, None).is_none());
        for o in &mut cells {
            o.host_gemv_ratio = None;
        }
        assert!(gemv_check_line(&cells, Some(99.8)).is_none());
    }

    /// A cell whose plan and workload an earlier cell ran is found (its 1-based row), whatever grid
    /// coordinate the planner ignored; another fingerprint, another workload or an earlier cell without a
    /// measurement is not a match.
    #[test]
    fn a_cell_that_repeats_an_earlier_run_names_it() {
        let mut ngl_depth_3 = outcome("ngl", "dense", 1.0, 1.0);
        ngl_depth_3.cell.depth = Some(3);
        let mut other_plan = outcome("ngl", "dense", 1.0, 1.0);
        other_plan.plan_fingerprint = Some("ffff0000".into());
        let mut unmeasured = outcome("ngl", "dense", 1.0, 1.0);
        (unmeasured.plan_fingerprint, unmeasured.meas) = (other_plan.plan_fingerprint.clone(), None);
        let mut longer = outcome("ngl", "dense", 1.0, 1.0);
        longer.cell.gen_tokens = 32;
        let earlier = vec![unmeasured, longer, outcome("ngl", "dense", 1.0, 1.0)];
        assert_eq!(same_run(&earlier, &ngl_depth_3), Some(3));
        assert_eq!(same_run(&earlier, &other_plan), None);
        assert_eq!(same_run(&earlier[..2], &ngl_depth_3), None);
    }

    /// The summary states the launch probe's rate against the profile's over the measured cells, and nothing
    /// without a reading.
    #[test]
    fn a_slow_dram_read_or_a_slow_cpu_gemv_counts_as_a_disturbed_host() {
        assert!(!host_disturbed((95.0, 100.0), Some((0.95, 1.0))));
        assert!(host_disturbed((85.0, 100.0), Some((1.0, 1.0))));
        // Run35's worst cells: the DRAM read as usual, the GEMV at 0.74 and 0.88 of the profile's row.
        assert!(host_disturbed((96.0, 98.0), Some((0.74, 1.0))));
        assert!(host_disturbed((96.0, 98.0), Some((0.88, 1.0))));
        // A host already slower at the start lowers the reference, as for the DRAM read.
        assert!(!host_disturbed((96.0, 98.0), Some((0.80, 0.85))));
        // No GEMV row in the profile: the DRAM read alone decides.
        assert!(!host_disturbed((96.0, 98.0), None));
    }

    #[test]
    fn the_launch_check_line_gives_the_ratios_spread() {
        let mut cells = vec![outcome("ilp", "dense", 1.0, 1.0), outcome("ngl", "dense", 1.0, 1.0)];
        cells[0].host_launch_ratio = Some(0.7);
        cells.push(Outcome {
            meas: None,
            host_launch_ratio: Some(0.1),
            ..outcome("pshard", "moe", 1.0, 1.0)
        });
        let line = launch_check_line(&cells, 3_018).expect("a line");
        assert!(
            line.contains("3.02 µs a launch") && line.contains("0.90 (median), 0.70–0.90 over 2 cells"),
            "{line}"
        );
        for o in &mut cells {
            o.host_launch_ratio = None;
        }
        assert!(launch_check_line(&cells, 3_018).is_none());
    }

    fn outcome(planner: &str, kind: &'static str, pred: f64, meas: f64) -> Outcome {
        let s = |x: f64| Sample {
            ttft_ms: x,
            tps: 100.0 / x,
            e2el_ms: 2.0 * x,
            vram_peak_bytes: 1 << 30,
            busy_ms: [x, 0.0, 0.0, 0.0],
        };
        Outcome {
            cell: Cell {
                model: "nemo-8b@4L".into(),
                ctx: 4096,
                prompt_tokens: 4000,
                gen_tokens: 16,
                ubatch: 1024,
                batch: 1,
                kv_unified: false,
                budget_bytes: 2 << 30,
                planner: planner.into(),
                depth: None,
                ngl_layers: None,
                budget_excludes_runtime: false,
                ngl_flash_attn: false,
                requests: pipeshard_core::workload::Requests::Distinct,
            },
            kind,
            status: "ok".into(),
            pred: Some(s(pred)),
            meas: Some(s(meas)),
            depths: Some((2, 2)),
            process_peak_bytes: Some(2 << 30),
            runtime_overhead_bytes: 500 << 20,
            plan_fingerprint: Some("0123abcd".into()),
            host_dram_gbps: Some(91.5),
            host_gemv_ratio: Some(1.25),
            host_launch_ratio: Some(0.9),
            attempts: 2,
            host_disturbed: false,
            runs: Runs { count: 3, ttft_spread: Some(0.1), tps_spread: Some(0.05) },
            run: None,
        }
    }

    /// Several runs of a plan measure as each metric's median (the middle two's mean for an even count) and
    /// the largest VRAM peak; their spread is (largest − smallest) ÷ median, none for one run. The summary
    /// says so only where a cell ran more than once.
    #[test]
    fn several_runs_of_a_cell_measure_as_their_median() {
        let run = |ttft: f64, tps: f64, vram: u64| Sample {
            ttft_ms: ttft,
            tps,
            e2el_ms: ttft + 1000.0 / tps,
            vram_peak_bytes: vram,
            busy_ms: [ttft, 1.0, 0.0, tps],
        };
        let runs = [run(110.0, 90.0, 5), run(100.0, 100.0, 7), run(130.0, 95.0, 6)];
        let m = median_sample(&runs).unwrap();
        assert_eq!((m.ttft_ms, m.tps, m.vram_peak_bytes), (110.0, 95.0, 7));
        let [gpu, h2d, d2h, cpu] = m.busy_ms;
        assert_eq!((gpu, h2d, d2h, cpu), (110.0, 1.0, 0.0, 95.0));
        // Each metric its own median: E2EL's is the first run's, not the median TTFT's and TPS's combination.
        assert_eq!(m.e2el_ms.to_bits(), runs[0].e2el_ms.to_bits());
        assert!((median_sample(&runs[..2]).unwrap().ttft_ms - 105.0).abs() < 1e-12, "the middle two's mean");
        assert_eq!(median_sample(&[]), None);
        assert_eq!(spread(&runs, m.ttft_ms, |s| s.ttft_ms), Some(30.0 / 110.0));
        assert_eq!(spread(&runs[..1], 110.0, |s| s.ttft_ms), None);
        let mut cells = vec![outcome("ilp", "dense", 1.0, 1.0), outcome("ngl", "dense", 1.0, 1.0)];
        cells[1].runs.ttft_spread = Some(0.3);
        let line = runs_line(&cells).unwrap();
        assert!(
            line.contains("ran 3 times") && line.contains("TTFT 30.0 % (median), 30.0 % (largest)"),
            "{line}"
        );
        assert!(line.contains("TPS 5.0 % (median), 5.0 % (largest) over 2 cells"), "{line}");
        for c in &mut cells {
            c.runs = Runs::ONE;
        }
        assert_eq!(runs_line(&cells), None);
    }

    #[test]
    fn median_and_p90_of_absolute_errors() {
        assert_eq!(median_p90(&[]), None);
        assert_eq!(median_p90(&[-0.5]), Some((0.5, 0.5)));
        let v: Vec<f64> = (1..=10).map(|i| f64::from(i) * if i % 2 == 0 { -0.01 } else { 0.01 }).collect();
        let (m, p) = median_p90(&v).unwrap();
        assert!((m - 0.055).abs() < 1e-12, "{m}");
        assert!((p - 0.09).abs() < 1e-12, "{p}");
    }

    #[test]
    fn errors_and_summary_groups() {
        let outcomes = vec![
            outcome("ilp", "dense", 110.0, 100.0),
            outcome("ngl", "dense", 95.0, 100.0),
            outcome("ilp", "moe", 100.0, 100.0),
        ];
        let e = outcomes[0].error(0).unwrap();
        assert!((e - 0.1).abs() < 1e-12);
        // TPS is 100/x on both sides: the error is the inverse ratio.
        assert!((outcomes[0].error(1).unwrap() - (100.0 / 110.0 - 1.0)).abs() < 1e-12);
        assert!((outcomes[0].worst_error() - 0.1).abs() < 1e-12);
        let t = summary(&outcomes);
        assert!(t.contains("| all (3) | 3 | 5.0% / 10.0% |"), "{t}");
        assert!(t.contains("| planner ilp (2) | 2 | 5.0% / 10.0% |"), "{t}");
        assert!(t.contains("| moe models (1) | 1 | 0.0% / 0.0% |"), "{t}");
        assert!(t.contains("| dense models (2) | 2 | 7.5% / 10.0% |"), "{t}");
        assert!(!t.contains("host check held"), "every host check held: no such group\n{t}");
        // A cell whose host stayed disturbed: the others apart, right after all.
        let mut outcomes = outcomes;
        outcomes[0].host_disturbed = true;
        let t = summary(&outcomes);
        let rows: Vec<&str> = t.lines().skip(2).take(2).collect();
        assert!(rows[0].starts_with("| all (3) | 3 | 5.0% / 10.0% |"), "{t}");
        assert!(rows[1].starts_with("| host check held (2) | 2 | 2.5% / 5.0% |"), "{t}");
    }

    #[test]
    fn csv_has_predicted_and_measured_columns_and_a_scatter_plot_is_drawn() {
        let dir = std::env::temp_dir().join(format!("pipeshard-validate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut failed = outcome("ilp", "dense", 1.0, 1.0);
        (failed.pred, failed.meas, failed.status) = (None, None, "infeasible: needs at least 3 GiB".into());
        let mut outcomes = vec![outcome("ilp", "dense", 110.0, 100.0), failed];
        outcomes[0].host_disturbed = true;
        write_csv(&outcomes, &dir.join("cells.csv")).unwrap();
        let text = std::fs::read_to_string(dir.join("cells.csv")).unwrap();
        let header = text.lines().next().unwrap();
        for x in ["ttft_ms", "tps", "e2el_ms", "vram_peak_bytes"] {
            assert!(header.contains(&format!("{x}_pred,{x}_meas")), "{header}");
        }
        assert!(header.ends_with(",calibration,plan_fingerprint"));
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains("infeasible: needs at least 3 GiB"));
        let back = read_csvs(&[dir.join("cells.csv")]).unwrap();
        assert_eq!((back[0].pred, back[0].meas), (outcomes[0].pred, outcomes[0].meas));
        assert_eq!(back[0].plan_fingerprint.as_deref(), Some("0123abcd"));
        assert_eq!((back[0].host_dram_gbps, back[0].attempts), (Some(91.5), 2));
        assert_eq!(back[0].host_gemv_ratio, Some(1.25));
        assert_eq!(back[0].host_launch_ratio, Some(0.9));
        assert!(back[0].host_disturbed && !back[1].host_disturbed);
        assert_eq!(back[0].runs, outcomes[0].runs);
        // Runs from before the fingerprint column still read.
        let old: String = text.lines().map(|l| l.rsplit_once(',').unwrap().0.to_string() + "\n").collect();
        std::fs::write(dir.join("old.csv"), old).unwrap();
        let back_old = read_csvs(&[dir.join("old.csv")]).unwrap();
        assert_eq!((back_old[0].pred, back_old[0].plan_fingerprint.as_deref()), (outcomes[0].pred, None));
        assert_eq!((back[1].pred, back[1].status.as_str()), (None, "infeasible: needs at least 3 GiB"));
        assert_eq!(summary(&back), summary(&outcomes));
        scatter(&outcomes, &["ngl".into(), "ilp".into()], &dir.join("scatter.png")).unwrap();
        assert!(std::fs::metadata(dir.join("scatter.png")).unwrap().len() > 10_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_batched_cell_is_not_its_single_request_twin() {
        let one = outcome("pshard", "dense", 1.0, 1.0).cell;
        let sixteen = Cell { batch: 16, ..one.clone() };
        assert!(same_cell(&one, &Cell { kv_unified: true, ..one.clone() }), "the row's layout is the plan's");
        assert!(!same_cell(&one, &sixteen), "repredict matched a batch-16 cell to the batch-1 row");
    }

    #[test]
    fn plan_fingerprints_follow_placements_not_notes() {
        use pipeshard_core::inventory::UnitId;
        use pipeshard_core::plan::Placement;
        use pipeshard_exec::testing::{manual_plan, tiny_spec};
        let (spec, wl) = (tiny_spec(), pipeshard_core::workload::Workload::single(16, 64, 4, 8));
        let a = manual_plan(&spec, wl, 1 << 30, 0, 0, 2, |_, _| Placement::Pinned);
        let mut b = a.clone();
        b.notes.push("another estimate".into());
        assert_eq!(plan_fingerprint(&a), plan_fingerprint(&b));
        let c = manual_plan(&spec, wl, 1 << 30, 0, 0, 2, |_, u| {
            if u == UnitId::Output { Placement::Cpu } else { Placement::Pinned }
        });
        assert_ne!(plan_fingerprint(&a), plan_fingerprint(&c));
    }

    #[test]
    fn traces_side_by_side_keep_both_sides_apart() {
        let mut pred = Trace::new();
        pred.name_track(0, "GPU", 0, "compute");
        pred.span(0, 0, "attn", "gpu", 0, 1000);
        pred.name_track(1, "PCIe", 0, "h2d");
        let mut meas = Trace::new();
        meas.name_track(0, "GPU", 0, "compute");
        meas.span(0, 0, "attn", "gpu", 0, 1200);
        let both = side_by_side(&pred, &meas);
        assert_eq!(both.events.len(), pred.events.len() + meas.events.len());
        let names: Vec<(u32, &str)> = both
            .events
            .iter()
            .filter(|e| e.name == "process_name")
            .map(|e| (e.pid, e.args["name"].as_str().unwrap()))
            .collect();
        assert_eq!(names, vec![(0, "predicted · GPU"), (1, "predicted · PCIe"), (2, "measured · GPU")]);
        assert_eq!(both.events.iter().filter(|e| e.ph == "X" && e.pid == 2).count(), 1);
    }

    #[test]
    fn gpu_names_become_folder_names() {
        assert_eq!(slug("NVIDIA H200"), "nvidia-h200");
        assert_eq!(slug(" GeForce RTX 5090 (32 GB) "), "geforce-rtx-5090-32-gb");
    }
}
