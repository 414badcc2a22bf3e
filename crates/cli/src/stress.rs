//! `pipeshard exec stress`: the VRAM budget must hold for every feasible plan, not only the planners' favourite
//! ones. Random cases — a catalog model the executor runs, truncated to a few layers, in a random weight format;
//! a small random workload; a plan that is either a random per-unit mix of pinned / streamed / CPU (a random
//! ring depth, thread count and budget slack over its exact need) or a planner's plan at a random budget (and
//! sometimes a forced ring depth); sometimes a page-lock limit that leaves weights pageable — each run for real.
//!
//! Per run the budget is checked three ways: the executor's own accounting (measured overhead + arena ≤
//! budget, what it carved ≤ arena), its measured process peak (device total − lowest free memory, sampled after
//! every pass), and the driver's view from outside the run: a thread samples `cuMemGetInfo` every
//! [`SAMPLE_EVERY`] while the run goes. A run whose layout the executor refuses before running (`OverBudget`)
//! or whose budget no planner can meet is counted, not run; any other error is reported as one.
//! `results/reliability/<date>-<gpu>/`: `runs.csv` (one row per run), `summary.md`, `provenance.json`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pipeshard_core::catalog;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Placement, Plan};
use pipeshard_core::profile::Profile;
use pipeshard_core::workload::Workload;
use pipeshard_exec::cuda::{Gpu, probe};
use pipeshard_exec::testing::{manual_plan, random_tokens};
use pipeshard_exec::weights::{Dims, ModelWeights};
use pipeshard_exec::{ExecError, RunOptions, VramReport};
use pipeshard_planner::PlannerOptions;
use serde::Serialize;

use crate::args::{format_bytes, load_profile, parse_bytes};
use crate::exec::{WarnOnce, provenance, with_measured_overhead};
use crate::interrupt::write_atomic;

/// How often the outside sampler reads the device's free memory during a run.
const SAMPLE_EVERY: Duration = Duration::from_micros(200);

/// Planners whose plans the stress run draws (exhaustive is too slow for a random case).
const PLANNERS: [&str; 4] = ["ngl", "pshard", "greedy", "ilp"];

/// Weight formats drawn.
const FORMATS: [DType; 3] = [DType::Bf16, DType::Q8_0, DType::Q4_0];

/// Arguments of `exec stress`.
#[derive(Debug, Args)]
pub struct StressArgs {
    /// Runs to draw (fewer if `--max-seconds` ends it first).
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// Seed of every draw (models, workloads, plans, budgets, weights, prompts).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Truncate drawn models to 1..=N decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// Catalog models to draw from, comma-separated (default: every one the executor runs).
    #[arg(long)]
    models: Option<String>,
    /// Skip drawn (model, layers, format) whose weights exceed this size (generating them takes ~1 s per GB).
    #[arg(long, default_value = "3G")]
    max_model_bytes: String,
    /// Runs per drawn model (its weights are generated once for them).
    #[arg(long, default_value_t = 8)]
    runs_per_model: usize,
    /// Stop drawing after this many seconds and report the runs done.
    #[arg(long)]
    max_seconds: Option<f64>,
    /// Machine profile the planners cost with (its runtime overhead is replaced by the measured one).
    #[arg(long, default_value = "h200")]
    profile: String,
    /// Results go to `OUT/<date>-<gpu>/`.
    #[arg(long, default_value = "results/reliability")]
    out: PathBuf,
}

/// A small deterministic generator (splitmix64): the draws of a seed are the same on every machine.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.range(0, xs.len() as u64 - 1) as usize]
    }
}

/// The catalog models the executor runs (vision models and unsupported architectures are left out).
fn runnable_models(only: Option<&str>) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> = match only {
        Some(list) => list.split(',').map(|s| s.trim().to_string()).collect(),
        None => catalog::names().into_iter().map(String::from).collect(),
    };
    let mut ok = Vec::new();
    for name in names {
        let spec = catalog::get(&name).with_context(|| format!("--models: `{name}`"))?;
        let one_layer = spec.truncated(1)?.with_uniform_weights(DType::Bf16);
        match Dims::new(&one_layer) {
            Ok(_) => ok.push(name),
            Err(e) if only.is_some() => bail!("--models: the executor cannot run {name}: {e}"),
            Err(_) => {}
        }
    }
    if ok.is_empty() {
        bail!("no model to draw from");
    }
    Ok(ok)
}

/// A drawn model: a catalog model truncated to 1..=`max_layers` layers in a random format, redrawn while its
/// weights would exceed `max_bytes`.
pub(crate) fn draw_model(
    rng: &mut Rng,
    models: &[String],
    max_layers: u32,
    max_bytes: u64,
) -> anyhow::Result<ModelSpec> {
    for _ in 0..1000 {
        let base = catalog::get(&models[rng.range(0, models.len() as u64 - 1) as usize])?;
        let layers = rng.range(1, u64::from(max_layers.min(base.text.n_layers))) as u32;
        let spec = base.truncated(layers)?.with_uniform_weights(rng.pick(&FORMATS));
        if Inventory::new(&spec).total_bytes() <= max_bytes {
            return Ok(spec);
        }
    }
    bail!("no drawn model fits --max-model-bytes {max_bytes}: raise it or draw fewer --layers")
}

/// A small workload: 1–96 prompt tokens in ubatches of 16–128, 1–6 generated tokens, a context of up to 8K.
pub(crate) fn draw_workload(rng: &mut Rng) -> Workload {
    let prompt = rng.range(1, 96);
    let gen_tokens = rng.range(1, 6);
    let ctx = rng.range(prompt + gen_tokens, 8192).next_multiple_of(256);
    Workload::single(prompt, ctx, gen_tokens, rng.pick(&[16, 32, 64, 128]))
}

/// Where a drawn plan came from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Source {
    /// A random per-unit mix with this budget slack over the plan's exact need.
    Mix { slack_bytes: u64 },
    /// A planner's plan at a random budget; `forced_depth` when its ring depth was redrawn.
    Planner { name: &'static str, forced_depth: Option<u32> },
}

impl Source {
    fn label(&self) -> String {
        match self {
            Source::Mix { .. } => "mix".into(),
            Source::Planner { name, forced_depth: None } => (*name).into(),
            Source::Planner { name, forced_depth: Some(d) } => format!("{name}+depth{d}"),
        }
    }
}

/// A random pinned / streamed / CPU mix for both phases (the decode phase redrawn half the time, so plan
/// switches are exercised too). A layer's KV goes with its attention: on the GPU (pinned or streamed) when the
/// attention is, else on the CPU.
fn draw_mix(
    rng: &mut Rng,
    spec: &ModelSpec,
    workload: Workload,
    overhead_bytes: u64,
    threads: &[u32],
) -> (Plan, Source) {
    let inv = Inventory::new(spec);
    let mut place: HashMap<(PhaseKind, UnitId), Placement> = HashMap::new();
    let same = rng.chance(0.5);
    for phase in [PhaseKind::Prefill, PhaseKind::Decode] {
        let (p_pin, p_stream) = (rng.unit(), rng.unit());
        for u in inv.units.iter().filter(|u| !matches!(u.id, UnitId::Kv { .. })) {
            let p = if phase == PhaseKind::Decode && same {
                place[&(PhaseKind::Prefill, u.id)]
            } else if rng.chance(p_pin) {
                Placement::Pinned
            } else if rng.chance(p_stream) {
                Placement::Streamed
            } else {
                Placement::Cpu
            };
            place.insert((phase, u.id), p);
        }
        for layer in 0..spec.text.n_layers {
            let kv = match place[&(phase, UnitId::Attn { layer })] {
                Placement::Cpu => Placement::Cpu,
                _ if rng.chance(0.3) => Placement::Streamed,
                _ => Placement::Pinned,
            };
            place.insert((phase, UnitId::Kv { layer }), kv);
        }
    }
    let depth = rng.range(1, 3) as u32;
    let mut plan =
        manual_plan(spec, workload, u64::MAX, overhead_bytes, depth, rng.pick(threads), |ph, u| {
            place[&(ph, u)]
        });
    // From the exact need (slack 0) to 64 MiB over it.
    let slack_bytes = if rng.chance(0.3) { 0 } else { rng.range(0, 64 << 20) };
    plan.budget_bytes = plan.peak_vram_bytes() + slack_bytes;
    plan.planner = "mix".into();
    (plan, Source::Mix { slack_bytes })
}

/// A planner's plan at a budget drawn log-uniformly between the runtime overhead and what pins everything,
/// with its ring depth redrawn (1–4) half the time when the plan streams and the new depth fits.
fn draw_planned(
    rng: &mut Rng,
    spec: &ModelSpec,
    workload: Workload,
    profile: &Profile,
) -> Result<(Plan, Source), String> {
    let inv = Inventory::new(spec);
    let name = rng.pick(&PLANNERS);
    let all = inv.total_bytes()
        + workload.kv_bytes_per_layer(spec) * u64::from(spec.text.n_layers)
        + profile.runtime_overhead_bytes
        + (256 << 20);
    let lo = (profile.runtime_overhead_bytes + (64 << 20)) as f64;
    let budget = (lo * (all as f64 / lo).powf(rng.unit())) as u64;
    let options = PlannerOptions { ngl_flash_attn: true, ..PlannerOptions::default() };
    let planner = pipeshard_planner::with_options(name, &options).expect("a known planner");
    let plan = planner
        .plan(spec, &workload, &TableCostModel::new(profile), budget)
        .map_err(|e| format!("{name} @ {}: {e}", format_bytes(budget)))?;
    let streams = plan.prefill.pipeline_depth > 0 || plan.decode.pipeline_depth > 0;
    if streams && rng.chance(0.5) {
        let depth = rng.range(1, 4) as u32;
        if let Ok(p) = plan.with_pipeline_depth(depth, &inv) {
            return Ok((p, Source::Planner { name, forced_depth: Some(depth) }));
        }
    }
    Ok((plan, Source::Planner { name, forced_depth: None }))
}

/// One drawn plan: a random mix 40% of the time, else a planner's (`Err`: the planner found no plan at the
/// drawn budget). `profile` carries the measured runtime overhead.
pub(crate) fn draw_plan(
    rng: &mut Rng,
    spec: &ModelSpec,
    workload: Workload,
    profile: &Profile,
    threads: &[u32],
) -> Result<(Plan, Source), String> {
    if rng.chance(0.4) {
        Ok(draw_mix(rng, spec, workload, profile.runtime_overhead_bytes, threads))
    } else {
        draw_planned(rng, spec, workload, profile)
    }
}

/// What one run measured, against its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::struct_field_names)] // every field is a size, and says so
pub(crate) struct Observed {
    pub budget_bytes: u64,
    /// The executor's measured runtime overhead and its arena.
    pub overhead_bytes: u64,
    pub arena_bytes: u64,
    /// The most the executor carved out of its arena in either phase.
    pub carved_bytes: u64,
    /// The executor's measured process peak.
    pub exec_peak_bytes: u64,
    /// The outside sampler's peak (device total − lowest free seen).
    pub driver_peak_bytes: u64,
}

impl Observed {
    fn from_report(v: &VramReport, driver_peak_bytes: u64) -> Observed {
        let carved = v
            .used
            .iter()
            .map(|b| b.pinned_weights_bytes + b.streaming_slots_bytes + b.kv_bytes + b.scratch_bytes)
            .max()
            .unwrap_or(0);
        Observed {
            budget_bytes: v.budget_bytes,
            overhead_bytes: v.overhead_bytes,
            arena_bytes: v.arena_bytes,
            carved_bytes: carved,
            exec_peak_bytes: v.peak_process_bytes,
            driver_peak_bytes,
        }
    }

    /// Every way this run broke its budget (empty: it held).
    pub(crate) fn violations(&self) -> Vec<String> {
        let b = self.budget_bytes;
        let mut v = Vec::new();
        if self.overhead_bytes + self.arena_bytes > b {
            v.push(format!("overhead {} + arena {} > budget {b}", self.overhead_bytes, self.arena_bytes));
        }
        if self.carved_bytes > self.arena_bytes {
            v.push(format!("carved {} > arena {}", self.carved_bytes, self.arena_bytes));
        }
        if self.exec_peak_bytes > b {
            v.push(format!("executor peak {} > budget {b}", self.exec_peak_bytes));
        }
        if self.driver_peak_bytes > b {
            v.push(format!("driver peak {} > budget {b}", self.driver_peak_bytes));
        }
        v
    }

    /// The larger measured peak over the budget.
    pub(crate) fn margin(&self) -> f64 {
        self.exec_peak_bytes.max(self.driver_peak_bytes) as f64 / self.budget_bytes as f64
    }
}

/// One row of `runs.csv`.
#[derive(Debug, Serialize)]
struct Row {
    run: usize,
    model: String,
    weights: String,
    prompt_tokens: u64,
    gen_tokens: u64,
    ctx: u64,
    ubatch: u64,
    source: String,
    placement: String,
    depth_prefill: u32,
    depth_decode: u32,
    cpu_threads: u32,
    pinned_limit_bytes: Option<u64>,
    pageable_weight_bytes: Option<u64>,
    budget_bytes: u64,
    overhead_bytes: Option<u64>,
    arena_bytes: Option<u64>,
    carved_bytes: Option<u64>,
    exec_peak_bytes: Option<u64>,
    driver_peak_bytes: Option<u64>,
    margin: Option<f64>,
    leaked_bytes: Option<i64>,
    status: String,
    detail: String,
    wall_ms: u64,
}

/// How a drawn plan places its units: pinned / streamed / CPU counts per phase.
fn placement_counts(plan: &Plan) -> String {
    plan.phases()
        .iter()
        .map(|p| {
            let n = |x: Placement| p.placements.iter().filter(|u| u.placement == x).count();
            format!("{}P/{}S/{}C", n(Placement::Pinned), n(Placement::Streamed), n(Placement::Cpu))
        })
        .collect::<Vec<_>>()
        .join(" → ")
}

/// Runs `f` while a thread samples the device's free memory; returns `f`'s result and the lowest free seen.
fn with_sampler<T>(gpu: &Gpu, f: impl FnOnce() -> T) -> (T, u64) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut min_free = u64::MAX;
            while !done.load(Ordering::Relaxed) {
                if let Ok((free, _)) = gpu.mem_info() {
                    min_free = min_free.min(free);
                }
                std::thread::sleep(SAMPLE_EVERY);
            }
            min_free
        });
        let out = f();
        done.store(true, Ordering::Relaxed);
        (out, sampler.join().expect("the sampler does not panic"))
    })
}

/// Runs `exec stress`.
pub fn run(a: &StressArgs) -> anyhow::Result<()> {
    let (commit, date, command) = provenance();
    let gpu = match probe() {
        Ok(_) => Gpu::new().context("opening the CUDA device")?,
        Err(reason) => {
            bail!("exec stress runs plans on a CUDA GPU and none is usable here ({reason}); nothing was run")
        }
    };
    let models = runnable_models(a.models.as_deref())?;
    let max_bytes = parse_bytes(&a.max_model_bytes)?;
    let base_profile = load_profile(&a.profile)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let threads: Vec<u32> = [1, 2, 4, 8, 16].into_iter().filter(|&t| t <= cores).collect();
    let machine = format!("{} + {cores} CPU threads", gpu.name());
    let t0 = Instant::now();
    let mut rng = Rng::new(a.seed);
    let mut warned = WarnOnce::default();
    let bar = ProgressBar::new(a.runs as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {elapsed} {msg}").expect("a valid template"),
    );
    let mut rows: Vec<Row> = Vec::new();
    let out_of_time = || a.max_seconds.is_some_and(|s| t0.elapsed().as_secs_f64() > s);
    'models: while rows.len() < a.runs && !out_of_time() {
        let spec = draw_model(&mut rng, &models, a.layers, max_bytes)?;
        bar.set_message(format!("generating {} weights ({})", spec.name, spec.weights.attn_q));
        let weights = ModelWeights::random(&spec, rng.next_u64())
            .with_context(|| format!("{}: generating weights", spec.name))?;
        for _ in 0..a.runs_per_model {
            if rows.len() >= a.runs || out_of_time() {
                break 'models;
            }
            if crate::interrupt::raised() {
                return Err(crate::interrupt::stopped("no result was written"));
            }
            let row = stress_one(
                &mut rng,
                &gpu,
                &spec,
                &weights,
                &base_profile,
                &threads,
                rows.len(),
                &mut warned,
            )?;
            let line = format!(
                "run {} {} {} {}: {}{}",
                row.run,
                spec.name,
                row.source,
                format_bytes(row.budget_bytes),
                row.status,
                row.margin.map_or(String::new(), |m| format!(" (peak {:.1}% of budget)", 100.0 * m))
            );
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.set_message(line);
            }
            rows.push(row);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let dir = a.out.join(format!("{}-{}", &date[..date.len().min(10)], crate::validate::slug(gpu.name())));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in &rows {
        w.serialize(r)?;
    }
    write_atomic(&dir.join("runs.csv"), &w.into_inner()?)?;
    let md = summary(&rows, &machine, &command, &commit, &date, a);
    write_atomic(&dir.join("summary.md"), md.as_bytes())?;
    let prov = serde_json::json!({
        "command": command,
        "commit": commit,
        "date_utc": date,
        "machine": machine,
        "profile": a.profile,
        "seed": a.seed,
        "runs": rows.len(),
        "violations": rows.iter().filter(|r| r.status == "violation").count(),
        "wall_time_s": t0.elapsed().as_secs_f64(),
    });
    write_atomic(&dir.join("provenance.json"), (serde_json::to_string_pretty(&prov)? + "\n").as_bytes())?;
    print!("{md}");
    println!("\nwrote {}", dir.display());
    if rows.iter().any(|r| r.status == "violation") {
        bail!("the budget was exceeded: see {}", dir.join("runs.csv").display());
    }
    Ok(())
}

/// Draws one workload and plan for `weights`, runs it and checks the budget.
#[allow(clippy::too_many_arguments)]
fn stress_one(
    rng: &mut Rng,
    gpu: &Gpu,
    spec: &ModelSpec,
    weights: &ModelWeights,
    base_profile: &Profile,
    threads: &[u32],
    run: usize,
    warned: &mut WarnOnce,
) -> anyhow::Result<Row> {
    let workload = draw_workload(rng);
    let profile = with_measured_overhead(gpu, spec, &workload, base_profile)?;
    let drawn = draw_plan(rng, spec, workload, &profile, threads);
    // A fifth of the runs may page-lock only part of their weights.
    let pinned_limit_bytes = rng.chance(0.2).then(|| (weights.total_bytes() as f64 * rng.unit()) as u64);
    let prompt = random_tokens(workload.prompt_tokens as usize, weights.dims.vocab, rng.next_u64());
    let mut row = Row {
        run,
        model: spec.name.clone(),
        weights: spec.weights.attn_q.to_string(),
        prompt_tokens: workload.prompt_tokens,
        gen_tokens: workload.gen_tokens,
        ctx: workload.ctx,
        ubatch: workload.ubatch,
        source: String::new(),
        placement: String::new(),
        depth_prefill: 0,
        depth_decode: 0,
        cpu_threads: 0,
        pinned_limit_bytes,
        pageable_weight_bytes: None,
        budget_bytes: 0,
        overhead_bytes: None,
        arena_bytes: None,
        carved_bytes: None,
        exec_peak_bytes: None,
        driver_peak_bytes: None,
        margin: None,
        leaked_bytes: None,
        status: String::new(),
        detail: String::new(),
        wall_ms: 0,
    };
    let (plan, source) = match drawn {
        Ok(d) => d,
        Err(e) => {
            row.status = "no-plan".into();
            row.detail = e;
            return Ok(row);
        }
    };
    row.source = source.label();
    row.placement = placement_counts(&plan);
    row.depth_prefill = plan.prefill.pipeline_depth;
    row.depth_decode = plan.decode.pipeline_depth;
    row.cpu_threads = plan.prefill.cpu_threads;
    row.budget_bytes = plan.budget_bytes;
    for w in profile.mismatch_warnings(Some(gpu.name()), plan.prefill.cpu_threads) {
        warned.warn(&w);
    }
    let opts = RunOptions {
        prompt,
        gen_tokens: workload.gen_tokens as usize,
        pinned_limit_bytes,
        interrupt: Some(&crate::interrupt::FLAG),
        ..RunOptions::default()
    };
    let (free_before, total) = gpu.mem_info()?;
    let t = Instant::now();
    let (result, min_free) = with_sampler(gpu, || pipeshard_exec::run(weights, &plan, Some(gpu), &opts));
    row.wall_ms = t.elapsed().as_millis() as u64;
    let (free_after, _) = gpu.mem_info()?;
    row.leaked_bytes = Some(free_before as i64 - free_after as i64);
    let driver_peak = total - min_free.min(free_before);
    match result {
        // A plan that puts nothing on the GPU (all on the CPU) never opens the device: nothing to hold to the
        // budget but the harness's own context.
        Ok(out) if out.vram.is_none() => {
            row.driver_peak_bytes = Some(driver_peak);
            row.status = "ok".into();
            row.detail = "the plan puts nothing on the GPU: the executor did not open it".into();
        }
        Ok(out) => {
            let v = out.vram.as_ref().context("a GPU run reports its VRAM")?;
            let o = Observed::from_report(v, driver_peak);
            row.pageable_weight_bytes = Some(v.pageable_weight_bytes);
            row.overhead_bytes = Some(o.overhead_bytes);
            row.arena_bytes = Some(o.arena_bytes);
            row.carved_bytes = Some(o.carved_bytes);
            row.exec_peak_bytes = Some(o.exec_peak_bytes);
            row.driver_peak_bytes = Some(o.driver_peak_bytes);
            row.margin = Some(o.margin());
            let broken = o.violations();
            row.status = if broken.is_empty() { "ok" } else { "violation" }.into();
            row.detail = broken.join("; ");
            for w in &out.warnings {
                row.detail = if row.detail.is_empty() { w.clone() } else { format!("{}; {w}", row.detail) };
            }
        }
        Err(ExecError::BudgetExceeded { peak_bytes, budget_bytes }) => {
            row.exec_peak_bytes = Some(peak_bytes);
            row.driver_peak_bytes = Some(driver_peak);
            row.margin = Some(peak_bytes.max(driver_peak) as f64 / budget_bytes as f64);
            row.status = "violation".into();
            row.detail = format!("executor: peak {peak_bytes} > budget {budget_bytes}");
        }
        Err(e @ ExecError::OverBudget { .. }) => {
            row.driver_peak_bytes = Some(driver_peak);
            row.status = "refused".into();
            row.detail = e.to_string();
        }
        Err(ExecError::Interrupted { .. }) => {
            return Err(crate::interrupt::stopped("no result was written"));
        }
        Err(e) => {
            row.driver_peak_bytes = Some(driver_peak);
            row.status = "error".into();
            row.detail = e.to_string();
        }
    }
    // A refused or failed run must not break the budget either.
    if row.status != "ok" && row.status != "violation" && driver_peak > plan.budget_bytes {
        row.status = "violation".into();
        row.detail = format!("driver peak {driver_peak} > budget {} ({})", plan.budget_bytes, row.detail);
    }
    Ok(row)
}

fn summary(rows: &[Row], machine: &str, command: &str, commit: &str, date: &str, a: &StressArgs) -> String {
    let count = |s: &str| rows.iter().filter(|r| r.status == s).count();
    let ran: Vec<&Row> = rows.iter().filter(|r| r.margin.is_some()).collect();
    let worst = ran.iter().max_by(|x, y| x.margin.unwrap_or(0.0).total_cmp(&y.margin.unwrap_or(0.0)));
    let mut md = format!(
        "# VRAM budget stress run on {machine}\n\n\
         {} runs drawn (seed {}, models truncated to 1–{} layers, at most {} of weights): **{} ran, {} \
         violations**; {} refused by the executor before running (layout over budget), {} without a plan at \
         the drawn budget, {} other errors.\n\n",
        rows.len(),
        a.seed,
        a.layers,
        a.max_model_bytes,
        ran.len(),
        count("violation"),
        count("refused"),
        count("no-plan"),
        count("error"),
    );
    if let Some(w) = worst {
        let _ = writeln!(
            md,
            "Largest margin used: **{:.2}%** of the budget (run {}: {} {} at {}, {}; executor peak {} bytes, \
             driver peak {} bytes, budget {} bytes).\n",
            100.0 * w.margin.unwrap_or(0.0),
            w.run,
            w.model,
            w.source,
            format_bytes(w.budget_bytes),
            w.placement,
            w.exec_peak_bytes.unwrap_or(0),
            w.driver_peak_bytes.unwrap_or(0),
            w.budget_bytes
        );
    }
    md.push_str(
        "| plan source | ran | violations | largest margin | pageable-weight runs |\n|---|---|---|---|---|\n",
    );
    let mut sources: Vec<String> =
        ran.iter().map(|r| r.source.split('+').next().unwrap_or("").to_string()).collect();
    sources.sort();
    sources.dedup();
    for s in &sources {
        let of: Vec<&&Row> = ran.iter().filter(|r| r.source.split('+').next() == Some(s.as_str())).collect();
        let _ = writeln!(
            md,
            "| {s} | {} | {} | {:.2}% | {} |",
            of.len(),
            of.iter().filter(|r| r.status == "violation").count(),
            100.0 * of.iter().filter_map(|r| r.margin).fold(0.0, f64::max),
            of.iter().filter(|r| r.pageable_weight_bytes.unwrap_or(0) > 0).count()
        );
    }
    let errors: Vec<&Row> = rows.iter().filter(|r| r.status == "error").collect();
    if !errors.is_empty() {
        md.push_str("\n## Errors\n\n");
        for r in errors {
            let _ = writeln!(md, "- run {} ({} {}): {}", r.run, r.model, r.source, r.detail);
        }
    }
    let _ = write!(
        md,
        "\nChecks per run: measured overhead + arena ≤ budget and carved ≤ arena (the executor's accounting), \
         the executor's process peak (device total − lowest free, sampled after every pass) ≤ budget, and the \
         driver's view from a thread sampling cuMemGetInfo every {} µs during the run ≤ budget.\n\n\
         Command: `{command}`; commit {commit}; {date}.\n",
        SAMPLE_EVERY.as_micros()
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_exec::cpu::KvLayout;
    use pipeshard_exec::host::Elem;
    use pipeshard_exec::layout::{Arena, layout_plan};

    /// Every drawn plan validates against its model, fits its budget, and lays out in the executor's arena at
    /// that budget (what the GPU run relies on before it measures anything), exact-fit mixes included; the
    /// draws cover mixes, the planners and both slack kinds.
    #[test]
    fn drawn_plans_are_feasible_and_varied() {
        let models = runnable_models(None).unwrap();
        assert!(
            models.iter().any(|m| m.starts_with("qwen3-30b"))
                && !models.iter().any(|m| m.starts_with("cosmos")),
            "{models:?}"
        );
        let mut profile =
            load_profile(concat!(env!("CARGO_MANIFEST_DIR"), "/../../profiles/h200.json")).unwrap();
        profile.runtime_overhead_bytes = 700 << 20;
        let mut rng = Rng::new(7);
        let (mut mixes, mut exact, mut planners, mut forced, mut no_plan) = (0, 0, Vec::new(), 0, 0);
        for _ in 0..6 {
            let spec = draw_model(&mut rng, &models, 2, 3 << 30).unwrap();
            assert!(Inventory::new(&spec).total_bytes() <= 3 << 30);
            let weights = ModelWeights::zeroed(&spec).unwrap();
            let inv = Inventory::new(&spec);
            for _ in 0..5 {
                let workload = draw_workload(&mut rng);
                workload.validate().unwrap();
                let Ok((plan, source)) = draw_plan(&mut rng, &spec, workload, &profile, &[1, 2, 4]) else {
                    no_plan += 1;
                    continue;
                };
                plan.validate(&inv).unwrap_or_else(|e| panic!("{} {source:?}: {e}", spec.name));
                match source {
                    Source::Mix { slack_bytes } => {
                        mixes += 1;
                        exact += usize::from(slack_bytes == 0);
                        assert_eq!(plan.budget_bytes, plan.peak_vram_bytes() + slack_bytes);
                    }
                    Source::Planner { name, forced_depth } => {
                        planners.push(name);
                        forced += usize::from(forced_depth.is_some());
                    }
                }
                let kv = pipeshard_exec::seqs::SeqKv::single(KvLayout {
                    ctx: workload.ctx as usize,
                    kv_dim: weights.dims.kv_dim,
                    elem: Elem::F16,
                });
                let m = workload.ubatch.min(workload.prompt_tokens) as usize;
                let overhead = plan.prefill.vram.runtime_overhead_bytes;
                let arena = Arena {
                    bytes: (plan.budget_bytes - overhead) as usize,
                    budget_bytes: plan.budget_bytes,
                    overhead_bytes: overhead,
                };
                if let Err(e) = layout_plan(&weights, &plan, kv, m, arena) {
                    panic!("{} {source:?}: {e}", spec.name);
                }
            }
        }
        planners.sort_unstable();
        planners.dedup();
        eprintln!(
            "{mixes} mixes ({exact} at slack 0), planners {planners:?}, {forced} forced depths, {no_plan} without a plan"
        );
        assert!(mixes >= 5 && exact >= 1 && planners.len() >= 3, "draws too narrow");
    }

    /// A run breaks its budget if any of the four checks fails, and its margin is the larger measured peak.
    #[test]
    fn budget_checks_catch_each_kind_of_overrun() {
        let fine = Observed {
            budget_bytes: 1000,
            overhead_bytes: 300,
            arena_bytes: 700,
            carved_bytes: 650,
            exec_peak_bytes: 990,
            driver_peak_bytes: 1000,
        };
        assert!(fine.violations().is_empty());
        assert!((fine.margin() - 1.0).abs() < 1e-12);
        for (broken, what) in [
            (Observed { arena_bytes: 701, carved_bytes: 600, ..fine }, "arena"),
            (Observed { carved_bytes: 701, ..fine }, "carved"),
            (Observed { exec_peak_bytes: 1001, ..fine }, "executor peak"),
            (Observed { driver_peak_bytes: 1001, ..fine }, "driver peak"),
        ] {
            let v = broken.violations();
            assert_eq!(v.len(), 1, "{what}: {v:?}");
            assert!(v[0].contains(what), "{v:?}");
        }
    }

    /// The generator is deterministic and its ranges are inclusive.
    #[test]
    fn draws_repeat_from_a_seed() {
        let a: Vec<u64> = (0..50).scan(Rng::new(3), |r, _| Some(r.range(1, 3))).collect();
        let b: Vec<u64> = (0..50).scan(Rng::new(3), |r, _| Some(r.range(1, 3))).collect();
        assert_eq!(a, b);
        assert!((1..=3).all(|x| a.contains(&x)) && a.iter().all(|x| (1..=3).contains(x)));
    }

    /// Without a device the command says it needs one and writes nothing.
    #[test]
    fn without_a_gpu_stress_says_it_needs_one() {
        if probe().is_ok() {
            eprintln!("a GPU is present: the no-GPU message is not tested here");
            return;
        }
        let dir = crate::testfiles::temp_dir("stress-no-gpu");
        let a = StressArgs {
            runs: 3,
            seed: 1,
            layers: 1,
            models: None,
            max_model_bytes: "3G".into(),
            runs_per_model: 1,
            max_seconds: None,
            profile: "cli3".into(),
            out: dir.clone(),
        };
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains("CUDA GPU") && e.contains("nothing was run"), "{e}");
        assert_eq!(std::fs::read_dir(&dir).map_or(0, Iterator::count), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
