//! `pipeshard sim`: `run` plans one cell (or reads a plan) and simulates it; `sweep` does a whole grid;
//! `batch-study` the batched-decode study (module `study`).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::metrics::Resource;
use pipeshard_core::plan::{Placement, Plan, VramBreakdown};
use pipeshard_sim::{SimOptions, Simulation, Simulator};

use crate::args::{format_bytes, format_tokens, load_profile, parse_bytes, parse_tokens};
use crate::experiment::{self, Cell, Experiment, resolve_model};
use crate::output::{self, Format};
use crate::sweep::gib;

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// Plan one workload with a planner (or read a plan) and simulate it: metrics, VRAM breakdown, busy time.
    Run(RunArgs),
    /// Plan and simulate a grid (models × contexts × budgets × ubatches × planners): CSV, plots, summary.
    Sweep(SweepArgs),
    /// Throughput against parallel requests and budget for every planner of a MoE model, and the batch from
    /// which streaming experts to the GPU beats computing them on the CPU.
    BatchStudy(crate::study::BatchStudyArgs),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Catalog model, `.gguf` file, HF checkpoint folder or config.json, optionally truncated: `nemo-8b`,
    /// `qwen3-30b-a3b@2L`, `models/q4.gguf@4L` (default: the plan's model).
    #[arg(long, required_unless_present = "plan")]
    model: Option<String>,
    /// Store every matrix in this format (`bf16`, `q4_0`, `q4_k`, …), as `exec run --weights` and the
    /// experiments' `weights` do.
    #[arg(long)]
    weights: Option<String>,
    /// Context the KV cache is allocated for (tokens; `16K` = 16384).
    #[arg(long, default_value = "16K")]
    ctx: String,
    /// VRAM budget (`8G` = 8 GiB).
    #[arg(long, default_value = "8G")]
    budget: String,
    #[arg(long, default_value = "ilp", value_parser = clap::builder::PossibleValuesParser::new(pipeshard_planner::NAMES))]
    planner: String,
    /// Simulate this plan (JSON, as `pipeshard plan` writes it) instead of running a planner.
    #[arg(long, conflicts_with_all = ["model", "weights", "ctx", "budget", "planner", "ubatch", "gen_tokens", "batch", "prompt"])]
    plan: Option<PathBuf>,
    #[arg(long, default_value = "1024")]
    ubatch: String,
    /// Tokens generated per request.
    #[arg(long = "gen", default_value_t = experiment::DEFAULT_GEN_TOKENS)]
    gen_tokens: u64,
    /// Parallel requests.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// One KV cache for all requests (llama.cpp `-kvu`) for `greedy`/`exhaustive` (`ilp` chooses;
    /// `pshard` always runs unified, `ngl` never).
    #[arg(long)]
    kv_unified: bool,
    /// Prompt tokens per request (default: ctx − gen, a nearly full context as in the paper).
    #[arg(long)]
    prompt: Option<String>,
    /// Machine profile: a JSON path, `profiles/NAME.json`, or a derived system (cli1, cli2, cli3).
    #[arg(long, default_value = experiment::DEFAULT_PROFILE)]
    profile: String,
    /// Write a Chrome trace (opens in Perfetto) of the simulated steps.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Simulate every step instead of sampling and interpolating.
    #[arg(long)]
    exact: bool,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// An experiment file; list flags below are ignored when given.
    #[arg(long)]
    experiment: Option<PathBuf>,
    /// Models: catalog names, `.gguf` files or HF checkpoint folders (comma-separated or repeated; default:
    /// the paper's four LLMs).
    #[arg(long, value_delimiter = ',', default_values_t = ["nemo-4b", "nemo-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"].map(String::from))]
    model: Vec<String>,
    #[arg(long, value_delimiter = ',', default_values_t = ["1K", "4K", "16K", "64K"].map(String::from))]
    ctx: Vec<String>,
    #[arg(long, value_delimiter = ',', default_values_t = ["2G", "4G", "6G", "8G", "12G", "16G", "24G", "32G"].map(String::from))]
    budget: Vec<String>,
    #[arg(long, value_delimiter = ',', default_values_t = ["1024".to_string()])]
    ubatch: Vec<String>,
    /// Planners (default: all).
    #[arg(long, value_delimiter = ',', default_values_t = pipeshard_planner::NAMES.map(String::from))]
    planner: Vec<String>,
    #[arg(long, default_value = experiment::DEFAULT_PROFILE)]
    profile: String,
    /// Tokens generated per request.
    #[arg(long = "gen", default_value_t = experiment::DEFAULT_GEN_TOKENS)]
    gen_tokens: u64,
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// One KV cache for all requests (see `sim run --kv-unified`).
    #[arg(long)]
    kv_unified: bool,
    /// Name of the results folder (default: the experiment's name, or `default`).
    #[arg(long)]
    name: Option<String>,
    #[arg(long, default_value = "results/sweeps")]
    out_dir: PathBuf,
    /// Skip the PNG plots.
    #[arg(long)]
    no_plots: bool,
    /// Format of the printed summary (the files written are the same).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// The command line as typed, for provenance.
fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

pub fn run(cmd: SimCommand) -> anyhow::Result<()> {
    match cmd {
        SimCommand::Run(a) => run_one(&a),
        SimCommand::BatchStudy(a) => crate::study::run(&a, &command_line()),
        SimCommand::Sweep(a) => {
            let mut e = match &a.experiment {
                Some(path) => Experiment::load(path)?,
                None => Experiment::from_file(
                    experiment::ExperimentFile {
                        name: Some("default".into()),
                        description: "the paper's four LLMs, Figure 2 grid at ubatch 1024".into(),
                        profile: Some(a.profile.clone()),
                        top: experiment::GridFile {
                            models: Some(a.model.clone()),
                            ctx: Some(a.ctx.iter().cloned().map(experiment::Quantity::Text).collect()),
                            budgets: Some(a.budget.iter().cloned().map(experiment::Quantity::Text).collect()),
                            ubatch: Some(a.ubatch.iter().cloned().map(experiment::Quantity::Text).collect()),
                            planners: Some(a.planner.clone()),
                            depths: None,
                            prompt_tokens: None,
                            batch: Some(experiment::Counts::One(a.batch)),
                            weights: None,
                        },
                        grid: Vec::new(),
                        gen_tokens: Some(a.gen_tokens),
                        kv_unified: Some(a.kv_unified),
                        budget_excludes_runtime: None,
                        ngl_flash_attn: None,
                        identical_requests: None,
                        runs_per_cell: None,
                        ngl: None,
                        paper: None,
                    },
                    "default",
                )?,
            };
            if let Some(n) = &a.name {
                e.name.clone_from(n);
            }
            crate::sweep::sweep(&e, &a.out_dir, &command_line(), !a.no_plots, a.format)
        }
    }
}

/// `model` resolved, with every matrix in the `weights` format if given.
fn model_with_weights(
    model: &str,
    weights: Option<&str>,
) -> anyhow::Result<pipeshard_core::model::ModelSpec> {
    let spec = resolve_model(model)?;
    Ok(match weights {
        Some(w) => {
            spec.with_uniform_weights(w.parse::<DType>().map_err(|e| anyhow::anyhow!("--weights {w}: {e}"))?)
        }
        None => spec,
    })
}

fn run_one(a: &RunArgs) -> anyhow::Result<()> {
    let profile = load_profile(&a.profile)?;
    let cost = TableCostModel::new(&profile);
    let (spec, plan) = if let Some(path) = &a.plan {
        let json = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let plan = Plan::from_json(&path.display().to_string(), &json).map_err(anyhow::Error::msg)?;
        if plan.weights.is_none() {
            eprintln!(
                "note: {} records no weight formats (saved before they were recorded); simulating {} in its own",
                path.display(),
                plan.model
            );
        }
        (crate::experiment::plan_model(&plan)?, plan)
    } else {
        let model = a.model.as_deref().expect("clap requires --model without --plan");
        let spec = model_with_weights(model, a.weights.as_deref())?;
        let ctx = parse_tokens(&a.ctx)?;
        let prompt = match &a.prompt {
            Some(p) => parse_tokens(p)?,
            None => ctx.checked_sub(a.gen_tokens).filter(|p| *p > 0).with_context(|| {
                format!(
                    "--ctx {} leaves no prompt after --gen {}; raise --ctx or lower --gen",
                    a.ctx, a.gen_tokens
                )
            })?,
        };
        let cell = Cell {
            model: model.to_string(),
            ctx,
            prompt_tokens: prompt,
            gen_tokens: a.gen_tokens,
            ubatch: parse_tokens(&a.ubatch)?,
            batch: a.batch,
            kv_unified: a.kv_unified,
            budget_bytes: parse_bytes(&a.budget)?,
            planner: a.planner.clone(),
            depth: None,
            ngl_layers: None,
            budget_excludes_runtime: false,
            ngl_flash_attn: false,
            requests: pipeshard_core::workload::Requests::Distinct,
        };
        let planner = pipeshard_planner::by_name(&a.planner).expect("clap checks the planner name");
        let plan = planner
            .plan(&spec, &cell.workload(), &cost, cell.budget_bytes)
            .with_context(|| format!("no plan for {model} at ctx {}, budget {}", a.ctx, a.budget))?;
        (spec, plan)
    };
    for w in crate::args::borrowed_rows(&cost, &a.profile, [&spec]) {
        eprintln!("{w}");
    }
    let opts = SimOptions { exact: a.exact, trace: a.trace.is_some(), ..SimOptions::default() };
    let sim = Simulator::new(&spec, &plan, &cost)?.run(&opts);
    if let (Some(path), Some(trace)) = (&a.trace, &sim.trace) {
        std::fs::write(path, trace.to_json()).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} (open it in https://ui.perfetto.dev)", path.display());
    }
    let out = match a.format {
        Format::Json => {
            output::json(
                "sim_run",
                serde_json::json!({
                    "model": plan.model,
                    "planner": plan.planner,
                    "profile": a.profile,
                    "workload": plan.workload,
                    "vram_budget_bytes": plan.budget_bytes,
                    "metrics": sim.metrics,
                    "switch_ns": sim.switch_ns,
                    "plan_vram": [plan.prefill.vram, plan.decode.vram],
                    "sim_vram": sim.vram_used,
                    "steps_simulated": sim.steps_simulated,
                    "steps_total": sim.steps_total,
                }),
            )? + "\n"
        }
        f => output::render(f, "sim_run", &[SimRow::new(&plan, &a.profile, &sim)], || {
            render(&plan, &a.profile, &sim)
        })?,
    };
    print!("{out}");
    Ok(())
}

/// `sim run` as one CSV/Markdown row: the cell and its headline metrics.
#[derive(Debug, serde::Serialize)]
struct SimRow<'a> {
    model: &'a str,
    planner: &'a str,
    profile: &'a str,
    ctx: u64,
    prompt_tokens: u64,
    gen_tokens: u64,
    ubatch: u64,
    batch: u64,
    vram_budget_bytes: u64,
    ttft_ms: f64,
    tps: f64,
    e2el_ms: f64,
    decode_step_ms: f64,
    sim_vram_peak_bytes: u64,
    plan_prefill_vram_bytes: u64,
    plan_decode_vram_bytes: u64,
    steps_simulated: u64,
    steps_total: u64,
}

impl<'a> SimRow<'a> {
    fn new(plan: &'a Plan, profile: &'a str, sim: &Simulation) -> SimRow<'a> {
        let (w, m) = (&plan.workload, &sim.metrics);
        SimRow {
            model: &plan.model,
            planner: &plan.planner,
            profile,
            ctx: w.ctx,
            prompt_tokens: w.prompt_tokens,
            gen_tokens: w.gen_tokens,
            ubatch: w.ubatch,
            batch: w.batch,
            vram_budget_bytes: plan.budget_bytes,
            ttft_ms: m.ttft_ms(),
            tps: m.tps,
            e2el_ms: m.e2el_ms(),
            decode_step_ms: m.decode_step_ns as f64 / 1e6,
            sim_vram_peak_bytes: m.vram_peak_bytes,
            plan_prefill_vram_bytes: plan.prefill.vram.total(),
            plan_decode_vram_bytes: plan.decode.vram.total(),
            steps_simulated: sim.steps_simulated,
            steps_total: sim.steps_total,
        }
    }
}

/// A line of the VRAM table: its label and the category it reads.
type VramLine = (&'static str, fn(&VramBreakdown) -> u64);

/// The `sim run` table: workload, plan summary, metrics, VRAM (plan vs simulated, per phase), busy time.
#[must_use]
pub fn render(plan: &Plan, profile: &str, sim: &Simulation) -> String {
    let w = &plan.workload;
    let m = &sim.metrics;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} · ctx {} (prompt {}, gen {}) · ubatch {} · batch {} · budget {} · profile {} · planner {}",
        plan.model,
        format_tokens(w.ctx),
        w.prompt_tokens,
        w.gen_tokens,
        w.ubatch,
        w.batch,
        format_bytes(plan.budget_bytes),
        profile,
        plan.planner
    );
    let _ = writeln!(s, "\nplan              {:>14} {:>14}", "prefill", "decode");
    let count = |pp: &pipeshard_core::plan::PhasePlan, p: Placement, kv: bool| {
        pp.placements
            .iter()
            .filter(|u| {
                u.placement == p && matches!(u.unit, pipeshard_core::inventory::UnitId::Kv { .. }) == kv
            })
            .count()
    };
    for (label, p) in
        [("pinned", Placement::Pinned), ("streamed", Placement::Streamed), ("cpu", Placement::Cpu)]
    {
        let _ = writeln!(
            s,
            "{:<17} {:>14} {:>14}",
            format!("{label} units/kv"),
            format!("{}/{}", count(&plan.prefill, p, false), count(&plan.prefill, p, true)),
            format!("{}/{}", count(&plan.decode, p, false), count(&plan.decode, p, true)),
        );
    }
    let _ = writeln!(
        s,
        "{:<17} {:>14} {:>14}",
        "pipeline depth", plan.prefill.pipeline_depth, plan.decode.pipeline_depth
    );
    let _ =
        writeln!(s, "{:<17} {:>14} {:>14}", "op offload", plan.prefill.op_offload, plan.decode.op_offload);
    let _ =
        writeln!(s, "{:<17} {:>14} {:>14}", "cpu threads", plan.prefill.cpu_threads, plan.decode.cpu_threads);

    let _ = writeln!(s, "\nmetric            {:>14}", "simulated");
    let _ = writeln!(s, "{:<17} {:>11.1} ms", "TTFT", m.ttft_ms());
    let _ = writeln!(s, "{:<17} {:>14.2}", "TPS", m.tps);
    let _ = writeln!(s, "{:<17} {:>11.1} ms", "E2EL", m.e2el_ms());
    let _ = writeln!(s, "{:<17} {:>11.2} ms", "decode step", m.decode_step_ns as f64 / 1e6);
    let _ = writeln!(s, "{:<17} {:>11.2} ms", "plan switch", sim.switch_ns as f64 / 1e6);
    if let Some(p) = plan.prediction {
        let _ = writeln!(
            s,
            "{:<17} {:>11.1} ms (the planner's own estimate)",
            "planner E2EL",
            p.e2el_ns as f64 / 1e6
        );
    }

    let _ = writeln!(
        s,
        "\nVRAM (GiB)        {:>9} {:>9} {:>9} {:>9}",
        "plan pre", "sim pre", "plan dec", "sim dec"
    );
    let lines: [VramLine; 6] = [
        ("pinned weights", |v| v.pinned_weights_bytes),
        ("streaming slots", |v| v.streaming_slots_bytes),
        ("kv", |v| v.kv_bytes),
        ("scratch", |v| v.scratch_bytes),
        ("runtime overhead", |v| v.runtime_overhead_bytes),
        ("total", VramBreakdown::total),
    ];
    for (label, f) in lines {
        let _ = writeln!(
            s,
            "{label:<17} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            gib(f(&plan.prefill.vram)),
            gib(f(&sim.vram_used[0])),
            gib(f(&plan.decode.vram)),
            gib(f(&sim.vram_used[1])),
        );
    }
    let _ = writeln!(s, "{:<17} {:>9.2}", "budget", gib(plan.budget_bytes));

    let e2el = m.e2el_ns.max(1) as f64;
    let _ = write!(s, "\nbusy (ms, % of E2EL)");
    for r in Resource::ALL {
        let b = m.busy(r);
        let _ = write!(s, "  {} {:.1} ({:.0}%)", r.name(), b as f64 / 1e6, 100.0 * b as f64 / e2el);
    }
    let _ = writeln!(
        s,
        "\nsteps simulated: {} of {} (the rest interpolated linearly in position)",
        sim.steps_simulated, sim.steps_total
    );
    if !plan.notes.is_empty() {
        let _ = writeln!(s, "notes: {}", plan.notes.join("; "));
    }
    s
}

#[cfg(test)]
mod tests {
    use pipeshard_core::inventory::{Inventory, UnitId};
    use pipeshard_core::plan::{PLAN_SCHEMA_VERSION, PhaseKind, PhasePlan, UnitPlacement};
    use pipeshard_core::workload::{self, Workload};

    use super::*;

    /// Two layers of nemo-4b: layer 0 pinned; layer 1's attention streamed (its KV pinned) and its FFN on
    /// the CPU; embedding on the CPU, head pinned; a two-slot ring.
    fn hand_plan() -> (pipeshard_core::model::ModelSpec, Plan) {
        let spec = resolve_model("nemo-4b@2L").unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(900, 1024, 100, 512);
        let place = |u: UnitId| match u {
            UnitId::Attn { layer: 1 } => Placement::Streamed,
            UnitId::Ffn { layer: 1 } | UnitId::TokenEmbd => Placement::Cpu,
            _ => Placement::Pinned,
        };
        let phase = |kind: PhaseKind, tier_tokens: u64, scratch_bytes: u64| {
            let placements: Vec<UnitPlacement> =
                inv.units.iter().map(|u| UnitPlacement { unit: u.id, placement: place(u.id) }).collect();
            let slot_bytes = inv.unit_bytes(UnitId::Attn { layer: 1 });
            let pinned: u64 = placements
                .iter()
                .filter(|u| u.placement == Placement::Pinned && !matches!(u.unit, UnitId::Kv { .. }))
                .map(|u| inv.unit_bytes(u.unit))
                .sum();
            PhasePlan {
                phase: kind,
                tier_tokens,
                pipeline_depth: 2,
                slot_bytes,
                placements,
                op_offload: false,
                cpu_threads: 16,
                vram: VramBreakdown {
                    pinned_weights_bytes: pinned,
                    streaming_slots_bytes: 2 * slot_bytes,
                    kv_bytes: 2 * w.kv_bytes_per_layer(&spec),
                    scratch_bytes,
                    runtime_overhead_bytes: 500 << 20,
                },
            }
        };
        let prefill_scratch = workload::scratch_bytes(&spec, &w, w.prefill_chunks()[0]);
        let decode_scratch = workload::scratch_bytes(&spec, &w, w.decode_step(99));
        let plan = Plan {
            schema_version: PLAN_SCHEMA_VERSION,
            planner: "hand".into(),
            model: spec.name.clone(),
            weights: Some(spec.weights.clone()),
            budget_bytes: 4 << 30,
            workload: w,
            prefill: phase(PhaseKind::Prefill, 512, prefill_scratch),
            decode: phase(PhaseKind::Decode, 1, decode_scratch),
            switch_bytes: 0,
            prediction: None,
            notes: vec!["built by hand for the snapshot".into()],
        };
        (spec, plan)
    }

    #[test]
    fn weights_set_every_matrix_format() {
        let q4 = model_with_weights("qwen3-30b-a3b@2L", Some("q4_0")).unwrap();
        let bf16 = model_with_weights("qwen3-30b-a3b@2L", Some("bf16")).unwrap();
        assert_eq!((q4.weights.attn_q, q4.weights.ffn_down), (DType::Q4_0, DType::Q4_0));
        // 4.5 bits a weight against 16.
        let bytes = |s| Inventory::new(s).units.iter().map(|u| u.weight_bytes).sum::<u64>() as f64;
        assert!((bytes(&q4) / bytes(&bf16) - 4.5 / 16.0).abs() < 0.02);
        let err = model_with_weights("nemo-4b", Some("q9")).unwrap_err().to_string();
        assert!(err.contains("--weights q9"), "{err}");
    }

    #[test]
    fn sim_run_table_snapshot() {
        let (spec, plan) = hand_plan();
        let cost = TableCostModel::new(&load_profile("cli3").unwrap());
        let sim = Simulator::new(&spec, &plan, &cost).unwrap().run(&SimOptions::default());
        insta::assert_snapshot!(render(&plan, "cli3", &sim));
    }
}
