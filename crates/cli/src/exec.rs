//! `pipeshard exec run`: run plans for real on this machine's GPU (and CPU), print the metrics next to the
//! plan's VRAM breakdown, and append CSV rows with provenance.
//!
//! Budgets and planners take comma lists (`--budget 2G,4G,8G --planner ngl,pshard,ilp`): the weights are
//! generated once and every (planner, budget) cell runs in this process; a cell that cannot be planned or does
//! not fit is reported and the others go on. `--plan plan.json` (repeatable) runs hand-made or saved plans.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use pipeshard_core::checkpoint::Checkpoint;
use pipeshard_core::cost::TableCostModel;
use pipeshard_core::dtype::DType;
use pipeshard_core::gguf;
use pipeshard_core::metrics::Resource;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{Placement, Plan, VramBreakdown};
use pipeshard_core::profile::{Profile, Provenance};
use pipeshard_core::workload::Workload;
use pipeshard_exec::cuda::{Gpu, probe};
use pipeshard_exec::host::Elem;
use pipeshard_exec::quant::QFormat;
use pipeshard_exec::reference::rel_err;
use pipeshard_exec::testing::random_tokens;
use pipeshard_exec::weights::{Dims, ModelWeights};
use pipeshard_exec::{
    ExecError, GroupedExperts, LAZY_LOAD_RESERVE_BYTES, OVERHEAD_SPREAD_BYTES, PreEnqueue, RunOptions,
    RunOutput, UnitSpans, page_table_bytes_per_locked_gib, runtime_overhead_bytes,
};
use pipeshard_planner::PlannerOptions;

use crate::args::{format_bytes, load_profile, parse_bytes, parse_tokens};
use crate::experiment::resolve_model;

/// `pipeshard exec …`
#[derive(Debug, Subcommand)]
pub enum ExecCommand {
    /// Run plans on the GPU and CPU of this machine and measure TTFT, TPS, E2EL and peak VRAM.
    Run(Box<RunArgs>),
    /// Measure the decode GEMV of every weight format (bf16, q8_0, q4_0, q4_k, q6_k) against DRAM / HBM
    /// bandwidth; `--bounds`: whole-model decode against the HBM roofline, pinned H2D and DRAM ÷ CPU bytes.
    Bench(crate::exec_bench::BenchArgs),
    /// Run random feasible plans (random truncated catalog models, budgets, depths, placements) and check that
    /// the measured VRAM peak never exceeds the budget; CSV and summary under results/reliability/.
    Stress(crate::stress::StressArgs),
}

/// Arguments of `exec run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Catalog model, `.gguf` file or HF checkpoint folder (their real weights are loaded) or config.json,
    /// optionally truncated (`nemo-8b`, `nemo-8b@4L`); default: the plan's model.
    #[arg(long, required_unless_present = "plan")]
    model: Option<String>,
    /// Prompt tokens (random ids from --seed).
    #[arg(long, default_value = "1024")]
    prompt_tokens: String,
    /// Decode steps after the prompt.
    #[arg(long = "gen", default_value_t = 64)]
    gen_tokens: u64,
    /// Context the KV cache is allocated for (per request).
    #[arg(long, default_value = "4K")]
    ctx: String,
    /// Parallel requests decoded together, each with its own random prompt.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// One unified KV cache for the parallel requests (llama.cpp `-kvu`; planners that pick a layout ignore it).
    #[arg(long)]
    kv_unified: bool,
    /// VRAM budgets, comma-separated (`2G,4G,8G`).
    #[arg(long, default_value = "8G")]
    budget: String,
    /// Planners, comma-separated (ngl, pshard, greedy, ilp, exhaustive).
    #[arg(long, default_value = "ilp")]
    planner: String,
    /// Run these plans (JSON) instead of planning.
    #[arg(long)]
    plan: Vec<PathBuf>,
    /// Store every matrix in this format (`bf16`, `f16`, `q8_0`, `q4_0`, `q2_k`, `q3_k`, `q4_k`, `q6_k`), overriding the
    /// catalog's.
    #[arg(long)]
    weights: Option<String>,
    /// Load the weights of this HF checkpoint folder (config.json + bf16/f16/f32 safetensors) instead of random
    /// ones; default: the `--model` folder when it is one.
    #[arg(long)]
    weights_from: Option<PathBuf>,
    /// Random weights (from --seed) for a GGUF file or checkpoint folder too, which otherwise load their own.
    #[arg(long)]
    random_weights: bool,
    /// Keep only the first N decoder layers.
    #[arg(long)]
    layers: Option<u32>,
    /// Prefill chunk size.
    #[arg(long, default_value = "1024")]
    ubatch: String,
    /// CPU threads for CPU-placed units (default: the plan's).
    #[arg(long)]
    threads: Option<u32>,
    /// Machine profile the planners cost with: a JSON path, `profiles/NAME.json`, cli1/cli2/cli3, or `auto`:
    /// the newest profile in `profiles/` measured on this machine's GPU, else cli3 (the paper's system).
    #[arg(long, default_value = "auto")]
    profile: String,
    /// Page-lock at most this many bytes of weights (`0`, `8G`), streamed units first; the rest stays pageable
    /// and its copies run at pageable speed. Default: every weight is page-locked.
    #[arg(long)]
    page_lock_limit: Option<String>,
    /// Seed of the random weights and prompt.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the measured Chrome trace (one file per cell: `NAME-PLANNER-BUDGET.json` next to this path).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Append one CSV row per cell (header written when the file is new); the file is replaced whole at the
    /// end, so a run stopped by Ctrl-C leaves it as it was.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// First run the whole model pinned (budget unconstrained) as the reference, then feed every cell the
    /// reference's tokens and compare logits (max rel. err) and sampled tokens with it.
    #[arg(long)]
    check: bool,
    /// Decode with MoE experts on the CPU: queue the GPU work that follows a layer's CPU experts (their sum,
    /// the next layer's attention and router) while they run, behind a flag the host opens (`on`: where the
    /// plan and the device allow it), or launch it after them (`off`).
    #[arg(long, value_enum, default_value = "on")]
    pre_enqueue: Toggle,
    /// A MoE layer's pinned GPU experts: steps of at most 8 tokens run them (any format but q2_k/q3_k) as two
    /// grouped launches (2.51 → 1.05–1.35 ms a qwen3-30b-a3b@4L bf16 decode step on the H200), larger steps
    /// (any format) in tiled groups of three launches (`on`, the default), or every one as five or six
    /// launches of its own (`off`). `--check`'s all-pinned reference always runs them per expert.
    #[arg(long, value_enum, default_value = "on")]
    grouped_experts: Toggle,
    /// One-token steps over bf16/f16 matrices: run their GEMVs as exec's decode GEMV, with a unit's input norm
    /// and FFN activation folded in (`on`, the default), or as cuBLAS GEMMs with the norm and activation as
    /// kernels of their own (`off`). `--check`'s all-pinned reference always runs them on cuBLAS.
    #[arg(long, value_enum, default_value = "on")]
    decode_gemv: Toggle,
    /// Time every unit's kernels on the device (`on`, the default: the trace's GPU compute spans and the GPU
    /// busy time), or not (`off`: each timed unit costs ~3 µs of device time for its two events, ~4 % of an
    /// all-pinned nemo-8b decode step on the H200).
    #[arg(long, value_enum, default_value = "on")]
    unit_spans: Toggle,
}

/// `--pre-enqueue`, `--grouped-experts`, `--decode-gemv`, `--unit-spans`: on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Toggle {
    On,
    Off,
}

impl From<Toggle> for GroupedExperts {
    fn from(t: Toggle) -> GroupedExperts {
        match t {
            Toggle::On => GroupedExperts::On,
            Toggle::Off => GroupedExperts::Off,
        }
    }
}

impl From<Toggle> for PreEnqueue {
    fn from(t: Toggle) -> PreEnqueue {
        match t {
            Toggle::On => PreEnqueue::On,
            Toggle::Off => PreEnqueue::Off,
        }
    }
}

/// Commit (`PIPESHARD_COMMIT` on machines without the git checkout), date and command line of this run.
pub(crate) fn provenance() -> (String, String, String) {
    let cmd = std::env::args().collect::<Vec<_>>().join(" ");
    (crate::sweep::git_commit(), crate::sweep::now_utc(), cmd)
}

/// `profile` with the runtime overhead this machine measures for `spec` and `workload`, so that planner,
/// simulator and executor agree on every line of the VRAM breakdown.
pub(crate) fn with_measured_overhead(
    gpu: &Gpu,
    spec: &ModelSpec,
    workload: &Workload,
    profile: &Profile,
) -> anyhow::Result<Profile> {
    let dims = Dims::new(spec)?;
    let kv = Elem::from_dtype(workload.kv_dtype).unwrap_or(Elem::F16);
    let prefill_tokens = workload.ubatch.min(workload.prompt_tokens) as usize;
    let overhead = runtime_overhead_bytes(gpu, &dims, kv, prefill_tokens, workload.batch as usize)?;
    Ok(Profile {
        runtime_overhead_bytes: overhead,
        page_table_bytes_per_locked_gib: page_table_bytes_per_locked_gib(gpu)?,
        ..profile.clone()
    })
}

fn spec_for(args: &RunArgs, model: &str) -> anyhow::Result<ModelSpec> {
    let mut spec = resolve_model(model)?;
    if let Some(w) = &args.weights {
        let d: DType = w.parse().map_err(|e| anyhow::anyhow!("--weights: {e}"))?;
        spec = spec.with_uniform_weights(d);
    } else if !spec.stored.is_empty() {
        // The executor holds every matrix in one format and norms in f32, whatever the file stores.
        let m = spec.weights.attn_q;
        if !matches!(m, DType::Bf16 | DType::F16) && QFormat::from_dtype(m).is_none() {
            bail!(
                "{model} stores its matrices as {m}; the executor runs bf16, f16, q8_0, q4_0, q2_k, q3_k, q4_k \
                 or q6_k matrices: pass --weights q4_k (or q4_0, bf16); the file's tensors are converted as they \
                 load"
            );
        }
        spec = spec.with_uniform_weights(m);
    }
    if let Some(n) = args.layers {
        spec = spec.truncated(n).with_context(|| format!("--layers {n}"))?;
    }
    Ok(spec)
}

fn placement_summary(plan: &Plan) -> String {
    plan.phases()
        .iter()
        .map(|p| {
            let count = |x: Placement| p.placements.iter().filter(|u| u.placement == x).count();
            format!(
                "{:?}: {} pinned / {} streamed / {} CPU, depth {}{}",
                p.phase,
                count(Placement::Pinned),
                count(Placement::Streamed),
                count(Placement::Cpu),
                p.pipeline_depth,
                if p.op_offload { ", op offload" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn render(plan: &Plan, out: &RunOutput) -> String {
    let m = &out.metrics;
    let mut s = String::new();
    let _ = writeln!(s, "  plan: {}", placement_summary(plan));
    let _ = writeln!(
        s,
        "  TTFT {:.1} ms   TPS {:.2}   E2EL {:.1} ms   decode step {:.2} ms   ({} decode steps)",
        m.ttft_ms(),
        m.tps,
        m.e2el_ms(),
        m.decode_step_ns as f64 / 1e6,
        m.gen_tokens
    );
    let busy = Resource::ALL
        .iter()
        .map(|r| format!("{} {:.1} ms", r.name(), m.busy(*r) as f64 / 1e6))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(s, "  busy: {busy}");
    if let Some(v) = &out.vram {
        let _ = writeln!(
            s,
            "  VRAM (bytes)            plan prefill    used prefill     plan decode     used decode"
        );
        let line = |name: &str, f: fn(&VramBreakdown) -> u64| {
            format!(
                "  {name:<22} {:>13} {:>15} {:>15} {:>15}\n",
                f(&v.planned[0]),
                f(&v.used[0]),
                f(&v.planned[1]),
                f(&v.used[1])
            )
        };
        s += &line("pinned weights", |b| b.pinned_weights_bytes);
        s += &line("streaming slots", |b| b.streaming_slots_bytes);
        s += &line("KV", |b| b.kv_bytes);
        s += &line("scratch", |b| b.scratch_bytes);
        let _ = writeln!(
            s,
            "  runtime overhead: planned {} / measured {}; arena {}; switch re-upload {} bytes",
            plan.prefill.vram.runtime_overhead_bytes,
            v.overhead_bytes,
            v.arena_bytes,
            v.switch_uploaded_bytes
        );
        let _ = writeln!(
            s,
            "  measured process VRAM peak {} bytes of the {} budget ({:.1}%)",
            v.peak_process_bytes,
            v.budget_bytes,
            100.0 * v.peak_process_bytes as f64 / v.budget_bytes as f64
        );
    }
    s
}

const CSV_HEADER: &str = "model,planner,budget_bytes,prompt_tokens,gen_tokens,ctx,ubatch,status,ttft_ms,tps,e2el_ms,vram_peak_bytes,overhead_bytes,arena_bytes,plan_peak_bytes,busy_gpu_ms,busy_h2d_ms,busy_d2h_ms,busy_cpu_ms,tokens_agree,max_rel_err,machine,commit,date,command";

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

/// Prints each warning the first time it comes (a profile that does not match the machine, weights left
/// pageable): loud once, not once per cell.
#[derive(Debug, Default)]
pub(crate) struct WarnOnce(std::collections::HashSet<String>);

impl WarnOnce {
    /// Prints `msg` to stderr unless it was printed before; returns whether it printed.
    pub(crate) fn warn(&mut self, msg: &str) -> bool {
        let new = self.0.insert(msg.to_string());
        if new {
            eprintln!("warning: {msg}");
        }
        new
    }
}

/// Runs `exec …`.
pub fn run(cmd: ExecCommand) -> anyhow::Result<()> {
    crate::interrupt::install();
    match cmd {
        ExecCommand::Run(args) => run_cells(&args, &crate::interrupt::FLAG),
        ExecCommand::Bench(args) => crate::exec_bench::run(&args),
        ExecCommand::Stress(args) => crate::stress::run(&args),
    }
}

/// The newest profile in `dir` measured on `gpu` (its `machine.gpu` names the device; newest by the measurement's
/// date), for `--profile auto`: on the H200 machine, profiles/h200.json. Files that are not profiles are passed
/// over.
fn measured_profile_of(dir: &Path, gpu: Option<&str>) -> Option<PathBuf> {
    let gpu = gpu?;
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter_map(|p| {
            let profile = Profile::load(&p).ok()?;
            let Provenance::Measured { date, .. } = profile.provenance else { return None };
            profile.machine.gpu.contains(gpu).then_some((date, p))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p)
}

/// Runs `exec run`; `interrupt` (Ctrl-C) stops it before the next forward pass, writing nothing.
fn run_cells(args: &RunArgs, interrupt: &'static AtomicBool) -> anyhow::Result<()> {
    let (commit, date, command) = provenance();
    let mut warned = WarnOnce::default();
    let gpu = match probe() {
        Ok(_) => Some(Gpu::new().context("opening the CUDA device")?),
        Err(reason) => {
            if args.check {
                bail!(
                    "--check runs the whole model pinned in VRAM as its reference, which needs a CUDA device \
                     ({reason}); run without --check"
                );
            }
            eprintln!("no CUDA device ({reason}): only all-CPU plans can run");
            None
        }
    };
    let machine = format!(
        "{} + {} CPU threads",
        gpu.as_ref().map_or("no GPU", |g| g.name()),
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get)
    );
    // Cells: (plan source, budget).
    let mut plans: Vec<Result<Plan, String>> = Vec::new();
    let model_name = match (&args.model, args.plan.first()) {
        (Some(m), _) => m.clone(),
        (None, Some(p)) => {
            let json = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Plan::from_json(&p.display().to_string(), &json).map_err(anyhow::Error::msg)?.model
        }
        (None, None) => bail!("--model or --plan is required"),
    };
    let mut spec = spec_for(args, &model_name)?;
    let prompt_tokens = parse_tokens(&args.prompt_tokens)?;
    let pinned_limit_bytes = args
        .page_lock_limit
        .as_deref()
        .map(|s| parse_bytes(s).with_context(|| format!("--page-lock-limit {s}")))
        .transpose()?;
    let workload = Workload::single(
        prompt_tokens,
        parse_tokens(&args.ctx)?,
        args.gen_tokens,
        parse_tokens(&args.ubatch)?,
    )
    .batched(args.batch, args.kv_unified);
    workload.validate()?;
    // The profile the planners cost with (plan files bring their own decisions).
    let profile_name = match args.profile.as_str() {
        "auto" => measured_profile_of(Path::new("profiles"), gpu.as_ref().map(Gpu::name))
            .map_or_else(|| "cli3".to_string(), |p| p.display().to_string()),
        name => name.to_string(),
    };
    let mut profile_used = None;
    if args.plan.is_empty() {
        let mut profile = load_profile(&profile_name)?;
        if let Some(g) = &gpu {
            let measured = with_measured_overhead(g, &spec, &workload, &profile)?;
            eprintln!(
                "measured runtime overhead {} bytes (incl. a {}-byte lazy-load reserve and {} bytes for its \
                 spread) + {} bytes per GiB of page-locked weights; profile {} assumed {} + {}",
                measured.runtime_overhead_bytes,
                LAZY_LOAD_RESERVE_BYTES,
                OVERHEAD_SPREAD_BYTES,
                measured.page_table_bytes_per_locked_gib,
                profile_name,
                profile.runtime_overhead_bytes,
                profile.page_table_bytes_per_locked_gib
            );
            profile = measured;
        }
        let cost = TableCostModel::new(&profile);
        for w in crate::args::borrowed_rows(&cost, &profile_name, [&spec]) {
            eprintln!("{w}");
        }
        profile_used = Some(profile.clone());
        for planner in args.planner.split(',') {
            // The executor runs flash attention only: `ngl` plans llama.cpp's `-fa on`.
            let options = PlannerOptions { ngl_flash_attn: true, ..PlannerOptions::default() };
            let p = pipeshard_planner::with_options(planner.trim(), &options).with_context(|| {
                format!("unknown planner `{planner}`; known: {}", pipeshard_planner::NAMES.join(", "))
            })?;
            for b in args.budget.split(',') {
                let budget = parse_bytes(b)?;
                plans.push(
                    p.plan(&spec, &workload, &cost, budget).map_err(|e| format!("{planner} @ {b}: {e}")),
                );
            }
        }
    } else {
        for path in &args.plan {
            let json =
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            plans.push(Ok(Plan::from_json(&path.display().to_string(), &json).map_err(anyhow::Error::msg)?));
        }
        // A saved plan's unit bytes follow from the formats it was made for (`Plan::weights`): run those, not
        // the catalog's (a file's own formats are converted as `spec_for` says).
        let mut adopted: Option<&Plan> = None;
        for plan in plans.iter().flatten() {
            let Some(recorded) =
                plan.weights.as_ref().filter(|w| **w != spec.weights && spec.stored.is_empty())
            else {
                continue;
            };
            if let Some(w) = &args.weights {
                bail!(
                    "--weights {w}: {} was planned with {} matrices; drop --weights, or plan again with it",
                    plan.model,
                    recorded.attn_q
                );
            }
            if let Some(first) = adopted {
                bail!("the plans were made for different formats ({} and {})", first.model, plan.model);
            }
            spec = spec.with_weights(recorded.clone());
            adopted = Some(plan);
        }
    }
    let t = Instant::now();
    let base = model_name.rsplit_once('@').map_or(model_name.as_str(), |(b, _)| b);
    let checkpoint = args.weights_from.as_deref().or(Path::new(base).is_dir().then_some(Path::new(base)));
    let (weights, source) = if let Some(dir) = checkpoint.filter(|_| !args.random_weights) {
        let w = ModelWeights::from_checkpoint(&spec, &Checkpoint::open(dir)?).context("loading weights")?;
        (w, format!("from {}", dir.display()))
    } else if Path::new(base).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        && !args.random_weights
    {
        let header = gguf::read_header(Path::new(base))?;
        let (w, converted) = ModelWeights::from_gguf(&spec, &header).context("loading weights")?;
        if !converted.is_empty() {
            eprintln!(
                "{} of {base}'s tensors converted to the executor's formats (e.g. {}); pass --weights to pick \
                 the format",
                converted.len(),
                converted[0]
            );
        }
        (w, format!("from {base}"))
    } else {
        let w = ModelWeights::random(&spec, args.seed).context("generating weights")?;
        (w, format!("random, seed {}", args.seed))
    };
    eprintln!(
        "{}: {} bytes of {} weights ({source}) in {:.1} s",
        spec.name,
        weights.total_bytes(),
        weights.dims.quant.map_or(weights.dims.mat.name(), |q| q.dtype().name()),
        t.elapsed().as_secs_f64()
    );
    let prompt = random_tokens(prompt_tokens as usize, weights.dims.vocab, args.seed);
    // A plan file's workload says how many requests run; each gets a prompt of its own.
    let requests = plans.iter().flatten().map(|p| p.workload.batch).max().unwrap_or(1);
    if args.check && requests > 1 {
        bail!("--check compares one request with its reference; run it with --batch 1 (plans of {requests})");
    }
    let other_prompts: Vec<Vec<u32>> = (1..requests)
        .map(|s| random_tokens(prompt_tokens as usize, weights.dims.vocab, args.seed + s))
        .collect();
    // The CSV's old rows and this run's, written whole at the end.
    let mut csv = match &args.csv {
        Some(path) if path.exists() => {
            Some(std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)
        }
        Some(_) => Some(format!("{CSV_HEADER}\n")),
        None => None,
    };
    // `--check` without a GPU stopped at the probe above.
    let reference = if let (true, Some(g)) = (args.check, &gpu) {
        let threads = args.threads.unwrap_or(8);
        // Unconstrained means the whole device (a fixed headroom over weights + KV left the page tables of
        // qwen3-30b-a3b's 61 GB of locked bf16 weights out: 87 MB over).
        let big = g.mem_info()?.1;
        let plan = pipeshard_exec::testing::manual_plan(&spec, workload, big, 0, 0, threads, |_, _| {
            Placement::Pinned
        });
        // The cuBLAS path is the reference the decode GEMV is checked against.
        g.set_decode_gemv(false);
        let opts = RunOptions {
            prompt: prompt.clone(),
            other_prompts: Vec::new(),
            gen_tokens: args.gen_tokens as usize,
            keep_logits: true,
            interrupt: Some(interrupt),
            // The per-expert path is the reference the grouped one is checked against.
            grouped_experts: GroupedExperts::Off,
            ..RunOptions::default()
        };
        let r = match pipeshard_exec::run(&weights, &plan, gpu.as_ref(), &opts) {
            Err(ExecError::Interrupted { .. }) => {
                return Err(crate::interrupt::stopped("nothing was written"));
            }
            r => r.context("reference run (everything pinned)")?,
        };
        println!(
            "reference (all pinned, unconstrained budget): TTFT {:.1} ms, TPS {:.2}, tokens {:?}…",
            r.metrics.ttft_ms(),
            r.metrics.tps,
            &r.tokens[..r.tokens.len().min(8)]
        );
        Some(r)
    } else {
        None
    };
    if let Some(g) = &gpu {
        g.set_decode_gemv(args.decode_gemv == Toggle::On);
    }
    let mut first_tokens: Option<Vec<u32>> = reference.as_ref().map(|r| r.tokens.clone());
    let mut failures = 0;
    for plan in plans {
        let mut plan = match plan {
            Ok(p) => p,
            Err(e) => {
                eprintln!("cannot plan: {e}");
                failures += 1;
                continue;
            }
        };
        if let Some(t) = args.threads {
            plan.prefill.cpu_threads = t;
            plan.decode.cpu_threads = t;
        }
        let mut label =
            format!("{} / {} / budget {}", spec.name, plan.planner, format_bytes(plan.budget_bytes));
        if args.pre_enqueue == Toggle::Off {
            label.push_str(" / pre-enqueue off");
        }
        if args.grouped_experts == Toggle::Off {
            label.push_str(" / grouped experts off");
        }
        if args.decode_gemv == Toggle::Off {
            label.push_str(" / decode GEMV off");
        }
        if args.unit_spans == Toggle::Off {
            label.push_str(" / unit spans off");
        }
        println!("{label}");
        if let Some(p) = &profile_used {
            let threads = plan.prefill.cpu_threads.max(plan.decode.cpu_threads);
            for w in p.mismatch_warnings(gpu.as_ref().map(Gpu::name), threads) {
                warned.warn(&format!("profile {profile_name}: {w}"));
            }
        }
        let opts = RunOptions {
            prompt: prompt.clone(),
            other_prompts: other_prompts[..plan.workload.batch as usize - 1].to_vec(),
            gen_tokens: args.gen_tokens as usize,
            force_tokens: reference.as_ref().map(|r| r.tokens[..args.gen_tokens as usize].to_vec()),
            keep_logits: reference.is_some(),
            pinned_limit_bytes,
            interrupt: Some(interrupt),
            pre_enqueue: args.pre_enqueue.into(),
            grouped_experts: args.grouped_experts.into(),
            unit_spans: match args.unit_spans {
                Toggle::On => UnitSpans::On,
                Toggle::Off => UnitSpans::Off,
            },
        };
        let result = pipeshard_exec::run(&weights, &plan, gpu.as_ref(), &opts);
        let (status, out) = match result {
            Err(ExecError::Interrupted { .. }) => {
                return Err(crate::interrupt::stopped(&match &args.csv {
                    Some(p) => format!("{} was left as it was", p.display()),
                    None => "nothing was written".into(),
                }));
            }
            Ok(out) => {
                for w in &out.warnings {
                    warned.warn(w);
                }
                ("ok".to_string(), Some(out))
            }
            Err(e) => {
                println!("  failed: {e}");
                failures += 1;
                (format!("error: {e}"), None)
            }
        };
        let mut agree = String::new();
        let mut max_err = String::new();
        if let Some(out) = &out {
            print!("{}", render(&plan, out));
            let first = first_tokens.get_or_insert_with(|| out.tokens.clone());
            if let Some(r) = &reference {
                let same = out.tokens.iter().zip(&r.tokens).filter(|(a, b)| a == b).count();
                let e = out
                    .logits
                    .iter()
                    .zip(&r.logits)
                    .map(|(a, b)| rel_err(a, &b.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()))
                    .fold(0.0, f64::max);
                agree = format!("{same}/{}", out.tokens.len());
                max_err = format!("{e:.3e}");
                println!(
                    "  check: sampled tokens {agree} equal to the reference's with its inputs; logits max rel err {max_err}"
                );
                if !r.routes.is_empty() {
                    let flips = out.routes.iter().zip(&r.routes).filter(|(a, b)| a != b).count();
                    println!(
                        "  check: routing: {flips} of {} expert choices differ from the reference's (near-ties)",
                        r.routes.len()
                    );
                }
            } else {
                let same = out.tokens.iter().zip(first.iter()).take_while(|(a, b)| a == b).count();
                agree = format!("{same}/{}", out.tokens.len());
                println!(
                    "  tokens: {agree} identical to the first run's ({:?}…)",
                    &out.tokens[..out.tokens.len().min(8)]
                );
            }
            if let Some(path) = &args.trace {
                let file = trace_path(path, &spec.name, &plan);
                crate::interrupt::write_atomic(&file, out.trace.to_json().as_bytes())?;
                println!("  trace: {}", file.display());
            }
        }
        if let Some(text) = &mut csv {
            let m = out.as_ref().map(|o| &o.metrics);
            let v = out.as_ref().and_then(|o| o.vram.as_ref());
            let ms = |r: Resource| m.map_or(String::new(), |m| format!("{:.3}", m.busy(r) as f64 / 1e6));
            let row = [
                spec.name.clone(),
                plan.planner.clone(),
                plan.budget_bytes.to_string(),
                workload.prompt_tokens.to_string(),
                workload.gen_tokens.to_string(),
                workload.ctx.to_string(),
                workload.ubatch.to_string(),
                status,
                m.map_or(String::new(), |m| format!("{:.3}", m.ttft_ms())),
                m.map_or(String::new(), |m| format!("{:.3}", m.tps)),
                m.map_or(String::new(), |m| format!("{:.3}", m.e2el_ms())),
                v.map_or(String::new(), |v| v.peak_process_bytes.to_string()),
                v.map_or(String::new(), |v| v.overhead_bytes.to_string()),
                v.map_or(String::new(), |v| v.arena_bytes.to_string()),
                plan.peak_vram_bytes().to_string(),
                ms(Resource::GpuCompute),
                ms(Resource::H2d),
                ms(Resource::D2h),
                ms(Resource::Cpu),
                agree,
                max_err.clone(),
                machine.clone(),
                commit.clone(),
                date.clone(),
                command.clone(),
            ];
            let _ = writeln!(text, "{}", row.iter().map(|s| csv_field(s)).collect::<Vec<_>>().join(","));
        }
    }
    if let (Some(path), Some(text)) = (&args.csv, &csv) {
        crate::interrupt::write_atomic(path, text.as_bytes())?;
    }
    if failures > 0 {
        eprintln!("{failures} cell(s) failed");
    }
    Ok(())
}

fn trace_path(base: &Path, model: &str, plan: &Plan) -> PathBuf {
    let stem = base.file_stem().map_or("trace".into(), |s| s.to_string_lossy().to_string());
    let dir = base.parent().unwrap_or(Path::new("."));
    dir.join(format!(
        "{stem}-{}-{}-{}.json",
        // A model file's name without its folders (`models/q.gguf@4L` → `q.gguf_4L`).
        Path::new(model).file_name().map_or(model.into(), |f| f.to_string_lossy()).replace('@', "_"),
        plan.planner,
        format_bytes(plan.budget_bytes)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::inventory::Inventory;
    use pipeshard_exec::cpu::KvLayout;
    use pipeshard_exec::layout::{Arena, layout_plan};
    use pipeshard_exec::seqs::SeqKv;

    fn run_args(line: &str) -> RunArgs {
        #[derive(Debug, clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            a: RunArgs,
        }
        <Wrap as clap::Parser>::try_parse_from(std::iter::once("run").chain(line.split_whitespace()))
            .unwrap()
            .a
    }

    /// A checkpoint folder runs in its own bf16 format; a GGUF of K-quants runs only with `--weights`, its
    /// tensors converted as they load.
    #[test]
    fn model_files_get_the_executor_formats() {
        use pipeshard_core::checkpoint::Checkpoint;
        use pipeshard_exec::testing::tiny_spec;

        let dir = crate::testfiles::temp_dir("exec-ckpt");
        let w = ModelWeights::random(&tiny_spec(), 3).unwrap();
        pipeshard_exec::hf::export(&w, &dir, 4096).unwrap();
        let name = dir.display().to_string();
        let spec = spec_for(&run_args(&format!("--model {name}")), &name).unwrap();
        assert!(spec.stored.is_empty() && spec.weights.attn_q == DType::Bf16);
        let loaded = ModelWeights::from_checkpoint(&spec, &Checkpoint::open(&dir).unwrap()).unwrap();
        assert_eq!(loaded.total_bytes(), w.total_bytes());
        let gguf = crate::testfiles::write_gguf(&dir).display().to_string();
        // A q4_K_M-style file runs in its matrices' format (q4_k), its q8_0 and q6_k tensors converted.
        let spec = spec_for(&run_args(&format!("--model {gguf}")), &gguf).unwrap();
        assert_eq!(spec.weights.ffn_down, DType::Q4K);
        let header = gguf::read_header(Path::new(&gguf)).unwrap();
        let (_, converted) = ModelWeights::from_gguf(&spec, &header).unwrap();
        assert!(
            converted.iter().all(|c| c.ends_with("q8_0 → q4_k") || c.ends_with("q6_k → q4_k")),
            "{converted:?}"
        );
        assert_eq!(
            converted.len(),
            2 * 2 + 1,
            "attn_v and ffn_down of 2 layers, and the head: {converted:?}"
        );
        let spec = spec_for(&run_args(&format!("--model {gguf} --weights f16")), &gguf).unwrap();
        assert_eq!(Dims::new(&spec).unwrap().mat, Elem::F16);
        // Its tensors load (the file's data is zero): every matrix converted from q4_k, q8_0 or q6_k to q4_0,
        // the f32 norms read as they are.
        let spec = spec_for(&run_args(&format!("--model {gguf} --weights q4_0")), &gguf).unwrap();
        let (w, converted) = ModelWeights::from_gguf(&spec, &header).unwrap();
        let matrices = w.units().iter().flat_map(|u| &u.tensors).filter(|t| t.shape.len() > 1).count();
        assert_eq!(converted.len(), matrices, "{converted:?}");
        for from in ["q4_k → q4_0", "q8_0 → q4_0", "q6_k → q4_0"] {
            assert!(converted.iter().any(|c| c.ends_with(from)), "{from}: {converted:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `exec run --csv` writes its file whole at the end: a run stopped by Ctrl-C leaves an existing CSV as
    /// it was and no temporary file beside it; a run that finishes appends its rows.
    #[test]
    fn an_interrupted_run_leaves_no_partial_results() {
        use pipeshard_exec::testing::{manual_plan, tiny_spec};
        static RAISED: AtomicBool = AtomicBool::new(true);
        static CALM: AtomicBool = AtomicBool::new(false);

        let dir = crate::testfiles::temp_dir("exec-interrupt");
        let model = dir.join("model");
        pipeshard_exec::hf::export(&ModelWeights::random(&tiny_spec(), 3).unwrap(), &model, 4096).unwrap();
        let spec = spec_for(&run_args(&format!("--model {}", model.display())), &model.display().to_string())
            .unwrap();
        let plan = manual_plan(&spec, Workload::single(4, 16, 2, 4), 1 << 30, 0, 0, 1, |_, _| Placement::Cpu);
        let plan_file = dir.join("plan.json");
        std::fs::write(&plan_file, plan.to_json()).unwrap();
        let csv = dir.join("cells.csv");
        std::fs::write(&csv, "earlier rows\n").unwrap();
        let line = format!(
            "--model {} --plan {} --prompt-tokens 4 --gen 2 --ctx 16 --ubatch 4 --csv {}",
            model.display(),
            plan_file.display(),
            csv.display()
        );
        let e = run_cells(&run_args(&line), &RAISED).unwrap_err().to_string();
        assert!(e.contains("interrupted") && e.contains("left as it was"), "{e}");
        assert_eq!(std::fs::read_to_string(&csv).unwrap(), "earlier rows\n");
        let files = || {
            let mut v: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into())
                .collect();
            v.sort();
            v
        };
        assert_eq!(files(), ["cells.csv", "model", "plan.json"]);
        run_cells(&run_args(&line), &CALM).unwrap();
        let text = std::fs::read_to_string(&csv).unwrap();
        assert!(text.starts_with("earlier rows\n") && text.lines().count() == 2, "{text}");
        assert!(text.lines().nth(1).unwrap().contains(",ok,"), "{text}");
        assert_eq!(files(), ["cells.csv", "model", "plan.json"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `--check`'s all-pinned reference needs a GPU: without one it stops before any weight is made.
    #[test]
    fn check_without_a_gpu_says_it_needs_one() {
        static CALM: AtomicBool = AtomicBool::new(false);
        if pipeshard_exec::cuda::probe().is_ok() {
            eprintln!("skipped: a CUDA device is present");
            return;
        }
        let line = "--model nemo-8b --check --prompt-tokens 4 --gen 2 --ctx 16 --ubatch 4 --budget 1G";
        let e = run_cells(&run_args(line), &CALM).unwrap_err().to_string();
        assert!(e.contains("--check") && e.contains("needs a CUDA device"), "{e}");
    }

    /// Each warning is printed once however many cells raise it.
    #[test]
    fn warnings_print_once() {
        let mut w = WarnOnce::default();
        assert!(w.warn("profile cli3: measured on another GPU"));
        assert!(!w.warn("profile cli3: measured on another GPU"));
        assert!(w.warn("weights left pageable"));
    }

    /// Every planner's plans for the done-when models lay out in the executor's arena, given the runtime
    /// overhead the plan itself assumed: planner and executor agree on every line of the breakdown — for one
    /// request and for 4 and 16 parallel ones (issue 10's validation cells; the planner picks the KV layout).
    #[test]
    fn planner_plans_fit_the_executor_arena() {
        let profile = load_profile("cli3").unwrap();
        let cost = TableCostModel::new(&profile);
        let mut checked = 0;
        let workloads = [
            Workload::single(1024, 4096, 16, 1024),
            Workload::single(1008, 1024, 16, 1024).batched(4, false),
            Workload::single(1008, 1024, 16, 1024).batched(16, false),
        ];
        for model in ["nemo-8b@4L", "llama-3.1-8b@4L", "qwen3-30b-a3b@4L"] {
            let spec = resolve_model(model).unwrap().with_uniform_weights(DType::Bf16);
            let inv = Inventory::new(&spec);
            let kv_dim =
                inv.tensors.iter().find(|t| t.name == "blk.0.attn_k.weight").unwrap().shape[0] as usize;
            let weights = ModelWeights::zeroed(&spec).unwrap();
            for (planner, workload) in
                ["ngl", "pshard", "ilp"].iter().flat_map(|p| workloads.map(|w| (*p, w)))
            {
                let options = PlannerOptions { ngl_flash_attn: true, ..PlannerOptions::default() };
                let p = pipeshard_planner::with_options(planner, &options).unwrap();
                for gib in [2u64, 4, 8] {
                    let budget = gib << 30;
                    let Ok(plan) = p.plan(&spec, &workload, &cost, budget) else { continue };
                    let wl = plan.workload;
                    let kv = SeqKv {
                        seq: KvLayout { ctx: wl.ctx as usize, kv_dim, elem: Elem::F16 },
                        seqs: wl.batch as usize,
                        unified: wl.kv_unified,
                        prompt: wl.prompt_tokens as usize,
                    };
                    let overhead = plan.prefill.vram.runtime_overhead_bytes;
                    let arena = Arena {
                        bytes: (budget - overhead) as usize,
                        budget_bytes: budget,
                        overhead_bytes: overhead,
                    };
                    if let Err(e) = layout_plan(&weights, &plan, kv, 1024, arena) {
                        panic!("{model} {planner} {gib}G batch {}: {e}", wl.batch);
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 0, "no planner produced a plan");
        eprintln!("{checked} plans laid out (both phases)");
    }

    /// `--profile auto` takes the newest measured profile of this GPU from the folder and passes over derived
    /// profiles, other GPUs' and files that are not profiles; with none (or no GPU) the caller falls back to
    /// cli3.
    #[test]
    fn auto_profile_is_the_newest_measured_on_this_gpu() {
        let dir = std::env::temp_dir().join(format!("pipeshard-auto-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let profiles = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles");
        let h200 = load_profile(profiles.join("h200.json").to_str().unwrap()).unwrap();
        let write = |name: &str, gpu: &str, date: &str| {
            let mut p = h200.clone();
            p.machine.gpu = gpu.into();
            p.provenance =
                Provenance::Measured { command: "test".into(), commit: "test".into(), date: date.into() };
            std::fs::write(dir.join(name), serde_json::to_string(&p).unwrap()).unwrap();
        };
        write("old.json", "NVIDIA H200 (143771 MiB)", "2026-11-01T00:00:00Z");
        write("new.json", "NVIDIA H200 (143771 MiB)", "2026-12-01T00:00:00Z");
        write("other.json", "NVIDIA GeForce RTX 5090", "2026-12-02T00:00:00Z");
        std::fs::copy(profiles.join("cli3.json"), dir.join("cli3.json")).unwrap();
        std::fs::write(dir.join("notes.json"), "{}").unwrap();
        assert_eq!(measured_profile_of(&dir, Some("NVIDIA H200")), Some(dir.join("new.json")));
        assert_eq!(measured_profile_of(&dir, Some("NVIDIA GeForce RTX 5090")), Some(dir.join("other.json")));
        assert_eq!(measured_profile_of(&dir, Some("NVIDIA GeForce RTX 4090")), None);
        assert_eq!(measured_profile_of(&dir, None), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
