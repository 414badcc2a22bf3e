//! `pipeshard plan`: run one planner on one workload and show the plan: per phase a placement map (one line per
//! layer), the VRAM breakdown against the budget and the predicted times; `--format json` prints the plan itself
//! and `--llama-cpp` the llama.cpp flags that come closest to it.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use clap::Args;
use clap::builder::PossibleValuesParser;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, PhasePlan, Placement, Plan, Prediction, VramBreakdown};
use pipeshard_core::workload::Workload;
use pipeshard_core::{GIB, MIB};
use pipeshard_planner::estimate::Estimator;
use pipeshard_planner::{NAMES, Objective, PlannerOptions, with_options};
use pipeshard_sim::{SimOptions, Simulator};
use serde::Serialize;

use crate::args::{format_bytes, format_tokens, load_profile, parse_bytes, parse_tokens};
use crate::experiment::resolve_model;
use crate::output::{self, Format};

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Catalog model (`nemo-8b`, or truncated: `qwen3-30b-a3b@2L`), a `.gguf` file, an HF checkpoint folder
    /// (config.json + safetensors) or an HF `config.json`.
    #[arg(long)]
    model: String,
    /// Storage format of every matrix (f16, bf16, q8_0, q4_0, q4_k …) of a catalog model (default: the
    /// format the paper ran it in) or a `config.json` (default: bf16); GGUF files and checkpoint folders say
    /// their own.
    #[arg(long)]
    weights: Option<String>,
    /// Keep only the first N decoder layers (what `exhaustive` needs for larger models).
    #[arg(long)]
    layers: Option<u32>,
    /// Context the KV cache is allocated for, in tokens (`16K` = 16384).
    #[arg(long, default_value = "16K")]
    ctx: String,
    /// VRAM budget of the whole process (`8G` = 8 GiB, `512M`, `7.5G`).
    #[arg(long, default_value = "8G")]
    budget: String,
    #[arg(long, default_value = "ilp", value_parser = PossibleValuesParser::new(NAMES))]
    planner: String,
    /// Prefill chunk size (tokens).
    #[arg(long, default_value = "1024")]
    ubatch: String,
    /// Prompt tokens per request (default: ctx − gen, a nearly full context as in the paper).
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 100)]
    r#gen: u64,
    /// Parallel requests decoded together.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// One KV cache for all requests (llama.cpp `-kvu`) for `greedy`/`exhaustive` (`ilp` chooses;
    /// `pshard` always runs unified, `ngl` never).
    #[arg(long)]
    kv_unified: bool,
    /// Machine profile: a JSON path, `profiles/NAME.json`, or a derived system (cli1, cli2, cli3).
    #[arg(long, default_value = "cli3")]
    profile: String,
    /// What `greedy`, `ilp` and `exhaustive` minimise.
    #[arg(long, default_value = "e2el", value_parser = PossibleValuesParser::new(Objective::NAMES))]
    objective: String,
    /// `ngl` only: offload exactly N layers (llama.cpp `-ngl N`) instead of the largest N that fits.
    #[arg(long)]
    ngl: Option<u32>,
    /// `table`: the placement map; `csv`/`md`: a row per phase and unit; `json`: the plan itself (the file
    /// `sim run --plan` and `exec run --plan` read).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Also print the llama.cpp flags closest to the plan (on stderr outside `--format table`).
    #[arg(long)]
    llama_cpp: bool,
    /// Instead of planning, the plan llama.cpp runs with these flags (`"-ngl 20 -ot 'blk\.(1|2)\.ffn_.*=CPU'
    /// -c 16384 -ub 512 -fa on"`; a whole `llama-server …` line works): `-c`, `-ub`, `-np` and `-fa` replace
    /// --ctx, --ubatch, --batch and flash attention (`-ub` defaults to llama.cpp's 512).
    #[arg(long, allow_hyphen_values = true, conflicts_with_all = ["planner", "ngl", "objective"])]
    from_llama_cpp: Option<String>,
}

/// Phase two of argument handling: the rich objects the planner needs.
struct Request {
    spec: ModelSpec,
    workload: Workload,
    budget_bytes: u64,
    options: PlannerOptions,
    profile_name: String,
}

fn load_model(a: &PlanArgs) -> anyhow::Result<ModelSpec> {
    let mut spec = resolve_model(&a.model)?;
    let path = Path::new(&a.model);
    let config_json = path.extension().is_some_and(|e| e == "json");
    let weights = match &a.weights {
        Some(_) if path.is_dir() || path.extension().is_some_and(|e| e == "gguf") => {
            bail!("--weights: {} stores its own formats; drop --weights", a.model)
        }
        Some(w) => Some(w.as_str()),
        None => config_json.then_some("bf16"),
    };
    if let Some(w) = weights {
        let dtype: DType = w.parse().with_context(|| format!("--weights `{w}`"))?;
        spec = spec.with_uniform_weights(dtype);
    }
    match a.layers {
        Some(n) => spec.truncated(n).with_context(|| format!("--layers {n}")),
        None => Ok(spec),
    }
}

fn request(a: &PlanArgs) -> anyhow::Result<Request> {
    let spec = load_model(a)?;
    let ctx = parse_tokens(&a.ctx).context("--ctx")?;
    let ubatch = parse_tokens(&a.ubatch).context("--ubatch")?;
    let budget_bytes = parse_bytes(&a.budget).context("--budget")?;
    let prompt_tokens = match &a.prompt_tokens {
        Some(p) => parse_tokens(p).context("--prompt-tokens")?,
        None => ctx.checked_sub(a.r#gen).filter(|&p| p > 0).with_context(|| {
            format!("--ctx {} leaves no room for a prompt before --gen {} tokens", a.ctx, a.r#gen)
        })?,
    };
    let workload = Workload::single(prompt_tokens, ctx, a.r#gen, ubatch).batched(a.batch, a.kv_unified);
    workload.validate()?;
    if a.ngl.is_some() && a.planner != "ngl" {
        bail!("--ngl applies to the `ngl` planner only (got --planner {})", a.planner);
    }
    let objective = Objective::from_name(&a.objective).expect("clap checks the objective");
    Ok(Request {
        spec,
        workload,
        budget_bytes,
        options: PlannerOptions { objective, ngl_layers: a.ngl, ..PlannerOptions::default() },
        profile_name: a.profile.clone(),
    })
}

pub fn run(a: &PlanArgs) -> anyhow::Result<()> {
    let r = request(a)?;
    let profile = load_profile(&r.profile_name)?;
    let cost = TableCostModel::new(&profile);
    let plan = match &a.from_llama_cpp {
        Some(text) => {
            let flags = crate::llama_cpp::Flags::parse(text)?;
            let prompt =
                a.prompt_tokens.as_deref().map(parse_tokens).transpose().context("--prompt-tokens")?;
            flags.plan(&r.spec, r.workload.ctx, prompt, r.workload.gen_tokens, &cost, r.budget_bytes)?
        }
        None => with_options(&a.planner, &r.options)
            .expect("clap checks the planner name")
            .plan(&r.spec, &r.workload, &cost, r.budget_bytes)
            .with_context(|| format!("planning {} within {}", r.spec.name, a.budget))?,
    };
    let inv = Inventory::new(&r.spec);
    plan.validate(&inv).context("the planner produced an invalid plan (a bug)")?;
    match a.format {
        Format::Json => println!("{}", plan.to_json()),
        f => {
            let est = Estimator::new(&r.spec, &inv, &plan.workload, &cost);
            let simulated = simulate(&r.spec, &plan, &cost)?;
            let rows = placement_rows(&plan, &r.spec, &inv);
            print!(
                "{}",
                output::render(f, "plan", &rows, || render(
                    &plan,
                    &inv,
                    &est,
                    &profile.machine.name,
                    &simulated
                ))?
            );
        }
    }
    if a.llama_cpp {
        let flags = crate::llama_cpp::describe(&plan, &inv);
        if a.format == Format::Table { print!("{flags}") } else { eprint!("{flags}") }
    }
    Ok(())
}

/// One unit's placement in one phase.
#[derive(Debug, Serialize)]
struct PlacementRow {
    phase: PhaseKind,
    unit: String,
    layer: Option<u32>,
    placement: Placement,
    /// Weight bytes (KV units: the phase's KV bytes of the layer).
    bytes: u64,
}

/// Every unit of both phases, in execution order.
fn placement_rows(plan: &Plan, spec: &ModelSpec, inv: &Inventory) -> Vec<PlacementRow> {
    let kv_layer = plan.workload.kv_bytes_per_layer(spec);
    plan.phases()
        .iter()
        .flat_map(|p| {
            p.placements.iter().map(|u| PlacementRow {
                phase: p.phase,
                unit: u.unit.to_string(),
                layer: u.unit.layer(),
                placement: u.placement,
                bytes: if matches!(u.unit, UnitId::Kv { .. }) { kv_layer } else { inv.unit_bytes(u.unit) },
            })
        })
        .collect()
}

/// Bytes for people: `7.93 GiB`, `210.4 MiB`, `12 KiB`.
fn human(b: u64) -> String {
    if b >= GIB {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    } else if b >= MIB {
        format!("{:.1} MiB", b as f64 / MIB as f64)
    } else {
        format!("{} KiB", b.div_ceil(1024))
    }
}

/// Nanoseconds for people.
fn duration(ns: u64) -> String {
    let s = ns as f64 / 1e9;
    if s >= 1.0 { format!("{s:.2} s") } else { format!("{:.1} ms", s * 1e3) }
}

fn vram_line(v: &VramBreakdown, budget: u64) -> String {
    format!(
        "VRAM  pinned {} + ring {} + KV {} + scratch {} + runtime {} = {} of {} ({:.0}%)",
        human(v.pinned_weights_bytes),
        human(v.streaming_slots_bytes),
        human(v.kv_bytes),
        human(v.scratch_bytes),
        human(v.runtime_overhead_bytes),
        human(v.total()),
        human(budget),
        100.0 * v.total() as f64 / budget.max(1) as f64
    )
}

/// One line per decoder layer, plus the token embedding, the vision tower and the output head.
fn placement_map(p: &PhasePlan, inv: &Inventory) -> String {
    let mut by_pos = vec![Placement::Cpu; inv.units.len()];
    for up in &p.placements {
        if let Some(pos) = inv.position(up.unit) {
            by_pos[pos] = up.placement;
        }
    }
    let code = |id: UnitId| inv.position(id).map_or('-', |pos| by_pos[pos].code());
    let mut out = String::new();
    let vision: Vec<char> = inv
        .units
        .iter()
        .enumerate()
        .filter(|(_, u)| u.id.is_vision())
        .map(|(pos, _)| by_pos[pos].code())
        .collect();
    if !vision.is_empty() {
        let all_cpu = vision.iter().all(|&c| c == 'C');
        let _ = writeln!(
            out,
            "  vision  {}",
            if all_cpu { "C (every block)".to_string() } else { vision.iter().collect::<String>() }
        );
    }
    let _ = writeln!(out, "  token_embd  {}", code(UnitId::TokenEmbd));
    let n_layers = inv.units.iter().filter_map(|u| u.id.layer()).max().map_or(0, |l| l + 1);
    for layer in 0..n_layers {
        let mut line = format!(
            "  blk.{layer:<3} attn {}  kv {}",
            code(UnitId::Attn { layer }),
            code(UnitId::Kv { layer })
        );
        if inv.position(UnitId::Router { layer }).is_some()
            && code(UnitId::Router { layer }) != code(UnitId::Attn { layer })
        {
            let _ = write!(line, "  router {}", code(UnitId::Router { layer }));
        }
        if inv.position(UnitId::Ffn { layer }).is_some() {
            let _ = write!(line, "  ffn {}", code(UnitId::Ffn { layer }));
        }
        let mut counts = [0u32; 3];
        for (pos, u) in inv.units.iter().enumerate() {
            if matches!(u.id, UnitId::Expert { layer: l, .. } if l == layer) {
                counts[match by_pos[pos] {
                    Placement::Pinned => 0,
                    Placement::Streamed => 1,
                    Placement::Cpu => 2,
                }] += 1;
            }
        }
        if counts.iter().sum::<u32>() > 0 {
            let _ = write!(line, "  experts {}P/{}S/{}C", counts[0], counts[1], counts[2]);
        }
        if inv.position(UnitId::SharedExperts { layer }).is_some() {
            let _ = write!(line, "  shexp {}", code(UnitId::SharedExperts { layer }));
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out, "  output  {}", code(UnitId::Output));
    out
}

/// The simulator's prediction of `plan` (what `sim run` reports), beside which the planner's own estimate is
/// shown: planners rank with their estimators, which can be far off (streamed experts, for one).
fn simulate(spec: &ModelSpec, plan: &Plan, cost: &TableCostModel) -> anyhow::Result<Prediction> {
    let run = Simulator::new(spec, plan, cost)?.run(&SimOptions::default());
    let gen_tokens = plan.workload.gen_tokens.max(1);
    Ok(Prediction {
        ttft_ns: run.metrics.ttft_ns,
        decode_step_ns: (run.decode_ns - run.switch_ns) / gen_tokens,
        e2el_ns: run.metrics.e2el_ns,
    })
}

fn prediction_line(label: &str, p: &Prediction, batch: u64) -> String {
    let tps = if p.decode_step_ns > 0 { batch as f64 * 1e9 / p.decode_step_ns as f64 } else { 0.0 };
    format!(
        "{label}: TTFT {} · decode step {} ({tps:.1} tokens/s) · E2EL {}",
        duration(p.ttft_ns),
        duration(p.decode_step_ns),
        duration(p.e2el_ns)
    )
}

fn render(plan: &Plan, inv: &Inventory, est: &Estimator, machine: &str, simulated: &Prediction) -> String {
    let w = &plan.workload;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} plan for {} on {machine}: ctx {} (prompt {}, gen {}, ubatch {}, batch {}), budget {}, flash attention {}",
        plan.planner,
        plan.model,
        format_tokens(w.ctx),
        w.prompt_tokens,
        w.gen_tokens,
        w.ubatch,
        w.batch,
        format_bytes(plan.budget_bytes),
        if w.flash_attn { "on" } else { "off" }
    );
    for n in &plan.notes {
        let _ = writeln!(out, "  {n}");
    }
    for p in plan.phases() {
        let ring = if p.pipeline_depth > 0 {
            format!("ring {} × {}", p.pipeline_depth, human(p.slot_bytes))
        } else {
            "nothing streams".into()
        };
        let _ = writeln!(
            out,
            "\n{:?} (tier {} tokens; {ring}{}; {} CPU threads)",
            p.phase,
            p.tier_tokens,
            if p.op_offload { "; op offload" } else { "" },
            p.cpu_threads
        );
        out.push_str(&placement_map(p, inv));
        let _ = writeln!(out, "  {}", vram_line(&p.vram, plan.budget_bytes));
    }
    let _ = writeln!(out, "\nswitch prefill → decode: {} re-uploaded", human(plan.switch_bytes));
    let _ = writeln!(out, "{}", prediction_line("simulated", simulated, w.batch));
    if let Some(p) = &plan.prediction {
        let label = format!("{}'s own estimate", plan.planner);
        let _ = writeln!(out, "{}", prediction_line(&label, p, w.batch));
    }
    if plan.planner == "pshard" {
        let _ = writeln!(out, "{}", prediction_line("the estimator", &est.predict_plan(inv, plan), w.batch));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        a: PlanArgs,
    }

    fn args(line: &str) -> PlanArgs {
        Wrap::try_parse_from(std::iter::once("plan").chain(line.split_whitespace())).unwrap().a
    }

    #[test]
    fn defaults_follow_the_paper() {
        let r = request(&args("--model nemo-8b --ctx 16K --budget 8G")).unwrap();
        assert_eq!(r.workload.ctx, 16_384);
        assert_eq!(r.workload.prompt_tokens, 16_384 - 100);
        assert_eq!(r.workload.ubatch, 1024);
        assert_eq!(r.budget_bytes, 8 << 30);
        assert_eq!(r.options.objective, Objective::E2el);
    }

    #[test]
    fn weights_retype_catalog_models() {
        let q4 = request(&args("--model qwen3-30b-a3b@2L")).unwrap().spec;
        let bf16 = request(&args("--model qwen3-30b-a3b@2L --weights bf16")).unwrap().spec;
        let bytes = |s: &ModelSpec| Inventory::new(s).total_bytes();
        // bf16 is 16 bits a weight, Q4_0 4.5: the experts dominate, so the model grows ≈ 3.5×.
        let ratio = bytes(&bf16) as f64 / bytes(&q4) as f64;
        assert!((3.0..3.6).contains(&ratio), "{ratio}");
        let e = format!("{:#}", request(&args("--model nemo-8b --weights q9")).err().unwrap());
        assert!(e.contains("--weights `q9`"), "{e}");
    }

    #[test]
    fn bad_arguments_say_what_to_fix() {
        let e = request(&args("--model nemo-8b --ctx 64 --gen 100")).err().unwrap().to_string();
        assert!(e.contains("--ctx"), "{e}");
        let e = request(&args("--model nemo-8b --ngl 3 --planner ilp")).err().unwrap().to_string();
        assert!(e.contains("--ngl"), "{e}");
        let e = format!("{:#}", request(&args("--model nemo-9b")).err().unwrap());
        assert!(e.contains("nemo-8b"), "{e}");
        let e = format!("{:#}", request(&args("--model nemo-8b --budget 8X")).err().unwrap());
        assert!(e.contains("--budget") && e.contains("suffix"), "{e}");
    }

    #[test]
    fn table_shows_every_layer_and_the_budget() {
        let r = request(&args("--model qwen3-30b-a3b@3L --ctx 4K --budget 2G --planner ilp")).unwrap();
        let cost = TableCostModel::new(&load_profile("cli3").unwrap());
        let plan = with_options("ilp", &r.options)
            .unwrap()
            .plan(&r.spec, &r.workload, &cost, r.budget_bytes)
            .unwrap();
        let inv = Inventory::new(&r.spec);
        let est = Estimator::new(&r.spec, &inv, &plan.workload, &cost);
        let simulated = simulate(&r.spec, &plan, &cost).unwrap();
        let text = render(&plan, &inv, &est, "cli3", &simulated);
        for needle in [
            "blk.0",
            "blk.2",
            "experts",
            "of 2.00 GiB",
            "simulated: TTFT",
            "own estimate",
            "Prefill",
            "Decode",
        ] {
            assert!(text.contains(needle), "missing {needle}:\n{text}");
        }
        assert!(!text.contains("blk.3 "), "{text}");
        let flags = crate::llama_cpp::describe(&plan, &inv);
        assert!(flags.contains("-ngl") && flags.contains("-ub 1024"), "{flags}");
        // The rows list every unit once per phase, weights and KV at their sizes.
        let rows = placement_rows(&plan, &r.spec, &inv);
        assert_eq!(rows.len(), 2 * inv.units.len());
        let decode_bytes: u64 = rows.iter().filter(|x| x.phase == PhaseKind::Decode).map(|x| x.bytes).sum();
        assert_eq!(decode_bytes, inv.total_bytes() + 3 * r.workload.kv_bytes_per_layer(&r.spec));
        let csv = output::csv(&rows).unwrap();
        assert!(csv.starts_with("phase,unit,layer,placement,bytes\nprefill,token_embd,,"), "{csv}");
    }

    #[test]
    fn llama_cpp_flags_are_one_argument() {
        let line =
            ["plan", "--model", "nemo-4b@2L", "--budget", "2G", "--from-llama-cpp", "-ngl 1 -c 4096 -fa off"];
        let a = Wrap::try_parse_from(line).unwrap().a;
        assert_eq!(a.from_llama_cpp.as_deref(), Some("-ngl 1 -c 4096 -fa off"));
        let e = Wrap::try_parse_from(line.into_iter().chain(["--planner", "ilp"])).unwrap_err().to_string();
        assert!(e.contains("cannot be used with"), "{e}");
    }

    #[test]
    fn ngl_plans_print_their_layer_count() {
        let r = request(&args("--model nemo-4b --ctx 4K --budget 4G --planner ngl --ngl 5")).unwrap();
        let cost = TableCostModel::new(&load_profile("cli3").unwrap());
        let plan = with_options("ngl", &r.options)
            .unwrap()
            .plan(&r.spec, &r.workload, &cost, r.budget_bytes)
            .unwrap();
        let flags = crate::llama_cpp::describe(&plan, &Inventory::new(&r.spec));
        assert!(flags.contains("-ngl 5 ") || flags.ends_with("-ngl 5\n"), "{flags}");
        assert!(flags.contains("-fa off"), "{flags}");
    }
}
