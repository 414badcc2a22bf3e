//! `pipeshard exec bench --bounds`: whole-model decode against the hardware bound that limits it — all-pinned
//! decode against the HBM roofline, streamed decode's H2D against the profiled pinned copy bandwidth, and decode
//! with the experts on the CPU against DRAM read bandwidth ÷ the bytes the CPU reads per token.
//!
//! Every figure is a steady-state decode figure: decode steps 1.. (step 0 follows the prefill → decode switch),
//! read off the measured trace.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::UnitId;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{Placement, Plan};
use pipeshard_core::profile::Profile;
use pipeshard_core::trace::Trace;
use pipeshard_core::workload::Workload;
use pipeshard_exec::cuda::Gpu;
use pipeshard_exec::testing::random_tokens;
use pipeshard_exec::weights::{Dims, ModelWeights};
use pipeshard_exec::{GroupedExperts, PreEnqueue, RunOptions, RunOutput, UnitSpans};
use pipeshard_planner::PlannerOptions;
use pipeshard_profiler::Progress;

use crate::args::{format_bytes, parse_bytes};
use crate::exec::with_measured_overhead;
use crate::experiment::resolve_model;

/// What the decode bounds run.
pub struct BoundsConfig<'a> {
    pub dense_model: &'a str,
    pub moe_model: &'a str,
    pub moe_budget_bytes: u64,
    pub moe_planner: &'a str,
    pub profile: &'a Profile,
    pub profile_name: &'a str,
    pub prompt_tokens: u64,
    pub gen_tokens: u64,
    pub threads: u32,
    /// Device read bandwidth (GB/s): the device-to-device copy of the GEMV bench, read + write bytes.
    pub device_gbps: f64,
    /// DRAM read bandwidth (GB/s) with `threads` threads, from the GEMV bench.
    pub dram_gbps: f64,
    /// Folder the runs' Chrome traces go to (`bounds-NAME.json`).
    pub trace_dir: Option<&'a std::path::Path>,
    /// Whether decode queues the GPU work after CPU experts while they run.
    pub pre_enqueue: PreEnqueue,
    /// Whether decode runs a MoE layer's pinned GPU experts as two grouped launches.
    pub grouped_experts: GroupedExperts,
}

/// Ring slots of the streaming bound's plan: enough to keep the copy engine busy while one FFN computes.
const STREAM_DEPTH: u32 = 3;

impl BoundsConfig<'_> {
    fn save_trace(&self, name: &str, out: &RunOutput) -> anyhow::Result<()> {
        if let Some(dir) = self.trace_dir {
            let path = dir.join(format!("bounds-{name}.json"));
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(&path, out.trace.to_json())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// One measured figure beside its bound.
pub struct BoundRow {
    pub bound: String,
    pub workload: String,
    pub measured: f64,
    pub bound_value: f64,
    pub unit: &'static str,
    pub goal_pct: f64,
    pub how: String,
}

impl BoundRow {
    pub fn pct(&self) -> f64 {
        100.0 * self.measured / self.bound_value
    }
}

/// Host spans `decode step i` (i ≥ 1) of a run: (start ns, end ns) each.
fn steady_steps(trace: &Trace) -> Vec<(u64, u64)> {
    trace
        .events
        .iter()
        .filter(|e| e.name.strip_prefix("decode step ").is_some_and(|i| i != "0"))
        .map(|e| ((e.ts * 1e3) as u64, ((e.ts + e.dur.unwrap_or(0.0)) * 1e3) as u64))
        .collect()
}

/// The host-to-device copies of a run's steady decode steps (the trace's spans with a byte count).
struct Steady {
    bytes: u64,
    busy_ns: f64,
    copies: u64,
}

fn h2d_in_steps(trace: &Trace) -> Steady {
    let steps = steady_steps(trace);
    let (first, last) = (steps.first().map_or(0, |s| s.0), steps.last().map_or(0, |s| s.1));
    let mut sum = Steady { bytes: 0, busy_ns: 0.0, copies: 0 };
    for e in trace.events.iter().filter(|e| e.ts * 1e3 >= first as f64 && e.ts * 1e3 < last as f64) {
        if let Some(b) = e.args.get("bytes").and_then(serde_json::Value::as_u64) {
            sum.bytes += b;
            sum.busy_ns += e.dur.unwrap_or(0.0) * 1e3;
            sum.copies += 1;
        }
    }
    sum
}

/// Mean steady-state decode step (ns) of a run; fails when it has fewer than two decode steps.
fn step_ns(out: &RunOutput, what: &str) -> anyhow::Result<f64> {
    let steps = steady_steps(&out.trace);
    if steps.is_empty() {
        bail!("{what}: no decode step after the first; pass --gen 2 or more");
    }
    Ok(steps.iter().map(|(a, b)| (b - a) as f64).sum::<f64>() / steps.len() as f64)
}

fn spec(name: &str, flag: &str) -> anyhow::Result<ModelSpec> {
    Ok(resolve_model(name).with_context(|| format!("{flag} {name}"))?.with_uniform_weights(DType::Bf16))
}

/// Random bf16 weights of `spec` (`what`, for the error), with how long they took on the progress line.
fn random_weights(spec: &ModelSpec, what: &str, progress: &dyn Progress) -> anyhow::Result<ModelWeights> {
    let t = std::time::Instant::now();
    let w = ModelWeights::random(spec, 1).with_context(|| format!("generating the {what}'s weights"))?;
    progress.tick(&format!(
        "{}: {} bytes of bf16 weights in {:.0} s",
        spec.name,
        w.total_bytes(),
        t.elapsed().as_secs_f64()
    ))?;
    Ok(w)
}

/// KV bytes the attention of one layer reads per cell.
fn kv_cell_bytes(spec: &ModelSpec, w: &Workload) -> f64 {
    w.kv_bytes_per_layer(spec) as f64 / w.ctx as f64
}

/// Cells filled when decode step `i` runs (the prompt, the steps before and its own token).
fn filled(w: &Workload, i: u64) -> f64 {
    (w.prompt_tokens + i + 1) as f64
}

fn plan_with(
    gpu: &Gpu,
    cfg: &BoundsConfig,
    spec: &ModelSpec,
    w: &Workload,
    planner: &str,
    budget: u64,
) -> anyhow::Result<Plan> {
    let profile = with_measured_overhead(gpu, spec, w, cfg.profile)?;
    let cost = pipeshard_core::cost::TableCostModel::new(&profile);
    let options = PlannerOptions { ngl_flash_attn: true, ..PlannerOptions::default() };
    let p = pipeshard_planner::with_options(planner, &options).with_context(|| {
        format!("unknown planner `{planner}`; known: {}", pipeshard_planner::NAMES.join(", "))
    })?;
    let mut plan = p
        .plan(spec, w, &cost, budget)
        .map_err(|e| anyhow::anyhow!("{planner} @ {}: {e}", format_bytes(budget)))?;
    plan.prefill.cpu_threads = cfg.threads;
    plan.decode.cpu_threads = cfg.threads;
    Ok(plan)
}

fn run_plan(
    w: &ModelWeights,
    plan: &Plan,
    gpu: &Gpu,
    wl: &Workload,
    routes: bool,
    pre_enqueue: PreEnqueue,
    grouped_experts: GroupedExperts,
    unit_spans: UnitSpans,
) -> anyhow::Result<RunOutput> {
    let opts = RunOptions {
        prompt: random_tokens(wl.prompt_tokens as usize, w.dims.vocab, 1),
        gen_tokens: wl.gen_tokens as usize,
        keep_logits: routes,
        pre_enqueue,
        grouped_experts,
        unit_spans,
        ..RunOptions::default()
    };
    let what = format!("{} / {} / {}", w.dims.model, plan.planner, format_bytes(plan.budget_bytes));
    let out = pipeshard_exec::run(w, plan, Some(gpu), &opts).with_context(|| what.clone())?;
    // What the run did not do as asked (pre-enqueue's skipped layers, weights left pageable), in the log.
    for warning in &out.warnings {
        eprintln!("{what}: {warning}");
    }
    Ok(out)
}

/// Runs the three decode bounds (the CPU GEMV bound is the GEMV bench's bf16 CPU row).
pub fn decode_bounds(
    gpu: &Gpu,
    cfg: &BoundsConfig,
    progress: &dyn Progress,
) -> anyhow::Result<Vec<BoundRow>> {
    let ctx = (cfg.prompt_tokens + cfg.gen_tokens).next_multiple_of(256);
    let wl = Workload::single(cfg.prompt_tokens, ctx, cfg.gen_tokens, cfg.prompt_tokens);
    wl.validate()?;
    let mut rows = Vec::new();
    progress
        .section("decode bounds: weights, all pinned (untimed, timed), streamed, MoE experts on the CPU", 6);

    let dense = spec(cfg.dense_model, "--dense-model")?;
    // Both models are checked before the first one's weights are generated.
    let moe = spec(cfg.moe_model, "--moe-model")?;
    if Dims::new(&moe)?.moe.is_none() {
        bail!("--moe-model {}: not a MoE model; pass one with routed experts (qwen3-30b-a3b)", cfg.moe_model);
    }
    let w = random_weights(&dense, "dense model", progress)?;
    let weight_bytes: u64 =
        w.units().iter().filter(|u| u.id != UnitId::TokenEmbd).map(|u| u.bytes as u64).sum::<u64>()
            + (w.dims.hidden * 2) as u64;
    let big = w.total_bytes() + wl.kv_bytes_per_layer(&dense) * u64::from(dense.text.n_layers) + (8 << 30);
    let pinned =
        pipeshard_exec::testing::manual_plan(&dense, wl, big, 0, 0, cfg.threads, |_, _| Placement::Pinned);
    // Steady steps 1..G: the weights once each, and the cells filled at that step.
    let kv = kv_cell_bytes(&dense, &wl) * f64::from(dense.text.n_layers);
    let mean_bytes = weight_bytes as f64
        + (1..cfg.gen_tokens).map(|i| kv * filled(&wl, i)).sum::<f64>() / (cfg.gen_tokens - 1) as f64;
    let bound_tps = cfg.device_gbps * 1e9 / mean_bytes;
    // As a user runs it (no per-unit timing), then with every unit timed for the trace (UnitSpans).
    for (spans, timed) in [(UnitSpans::Off, ""), (UnitSpans::On, ", every unit timed (the trace's spans)")] {
        let out = run_plan(&w, &pinned, gpu, &wl, false, cfg.pre_enqueue, cfg.grouped_experts, spans)?;
        if spans == UnitSpans::On {
            cfg.save_trace("pinned", &out)?;
        }
        let step = step_ns(&out, "all pinned")?;
        progress.tick(&format!("all pinned{timed}: {:.1} tok/s, roofline {bound_tps:.1}", 1e9 / step))?;
        rows.push(BoundRow {
            bound: "HBM roofline".into(),
            workload: format!(
                "{} bf16, all pinned, decode after {} prompt tokens{timed}",
                dense.name, cfg.prompt_tokens
            ),
            measured: 1e9 / step,
            bound_value: bound_tps,
            unit: "tok/s",
            goal_pct: 75.0,
            how: format!(
                "{:.2} GB read per token (every matrix but the embedding, plus the KV cells) ÷ {:.0} GB/s \
                 device copy (read + write bytes of a device-to-device copy)",
                mean_bytes / 1e9,
                cfg.device_gbps
            ),
        });
    }

    // Planners rarely stream in decode (the CPU is faster than PCIe for a unit read once per token), so the
    // streaming bound runs a plan by rule: every layer's FFN streamed through the ring, the rest pinned.
    let plan = pipeshard_exec::testing::manual_plan(&dense, wl, big, 0, STREAM_DEPTH, cfg.threads, |_, u| {
        if matches!(u, UnitId::Ffn { .. }) { Placement::Streamed } else { Placement::Pinned }
    });
    let out = run_plan(&w, &plan, gpu, &wl, false, cfg.pre_enqueue, cfg.grouped_experts, UnitSpans::On)?;
    cfg.save_trace("streamed", &out)?;
    drop(w);
    let steps = steady_steps(&out.trace);
    let (first, last) = (steps.first().map_or(0, |s| s.0), steps.last().map_or(0, |s| s.1));
    let Steady { bytes, busy_ns, copies } = h2d_in_steps(&out.trace);
    let mean_copy = bytes / copies.max(1);
    let h2d_bound = cfg.profile.h2d_gbps(mean_copy, true);
    let (busy_gbps, wall_gbps) = (bytes as f64 / busy_ns, bytes as f64 / (last - first) as f64);
    progress.tick(&format!("streamed: H2D {busy_gbps:.1} GB/s busy, {wall_gbps:.1} GB/s wall"))?;
    let what = format!(
        "{} bf16, every FFN streamed (ring depth {STREAM_DEPTH}), the rest pinned: {:.2} GB streamed per decode \
         step",
        dense.name,
        bytes as f64 / steps.len() as f64 / 1e9
    );
    let bound = format!("pinned H2D, profile {} at {} MB", cfg.profile_name, mean_copy / 1_000_000);
    for (measured, per) in
        [(busy_gbps, "copy-engine busy time"), (wall_gbps, "wall time of the decode steps")]
    {
        rows.push(BoundRow {
            bound: bound.clone(),
            workload: what.clone(),
            measured,
            bound_value: h2d_bound,
            unit: "GB/s",
            goal_pct: 90.0,
            how: format!("bytes copied ÷ {per} (decode steps 1..)"),
        });
    }

    let w = random_weights(&moe, "MoE model", progress)?;
    let Some(m) = w.dims.moe.as_ref() else { unreachable!("checked above") };
    let (top_k, n_experts) = (m.top_k, m.n_experts);
    let plan = plan_with(gpu, cfg, &moe, &wl, cfg.moe_planner, cfg.moe_budget_bytes)?;
    let out = run_plan(&w, &plan, gpu, &wl, true, cfg.pre_enqueue, cfg.grouped_experts, UnitSpans::On)?;
    cfg.save_trace("moe-cpu-experts", &out)?;
    let step = step_ns(&out, "experts on the CPU")?;
    let moe_layers: Vec<u32> = w
        .units()
        .iter()
        .filter_map(|u| if let UnitId::Router { layer } = u.id { Some(layer) } else { None })
        .collect();
    let per_pass = moe_layers.len() * top_k;
    let decode_routes = per_pass * cfg.gen_tokens as usize;
    if out.routes.len() < decode_routes {
        bail!(
            "{}: {} routing choices recorded, fewer than the decode's {decode_routes}",
            moe.name,
            out.routes.len()
        );
    }
    let routes = &out.routes[out.routes.len() - decode_routes..];
    let decode = &plan.decode;
    let on_cpu = |u: UnitId| decode.placement(u) == Some(Placement::Cpu);
    // Bytes the CPU reads in every decode step whatever the routing: its dense units and its layers' KV.
    let fixed = w
        .units()
        .iter()
        .filter(|u| !matches!(u.id, UnitId::Expert { .. } | UnitId::TokenEmbd) && on_cpu(u.id))
        .map(|u| u.bytes as f64)
        .fold(0.0, |a, b| a + b);
    let kv_layers = (0..moe.text.n_layers).filter(|&l| on_cpu(UnitId::Kv { layer: l })).count() as u32;
    let kv = kv_cell_bytes(&moe, &wl) * f64::from(kv_layers);
    let mut per_step = Vec::new();
    for (i, pass) in routes.chunks(per_pass).enumerate().skip(1) {
        let mut b = fixed + kv * filled(&wl, i as u64);
        for (li, picks) in pass.chunks(top_k).enumerate() {
            let layer = moe_layers[li];
            for &e in picks {
                if (e as usize) < n_experts && on_cpu(UnitId::Expert { layer, expert: e }) {
                    b += w.unit(UnitId::Expert { layer, expert: e }).map_or(0, |u| u.bytes) as f64;
                }
            }
        }
        per_step.push(b);
    }
    let mean_bytes = per_step.iter().sum::<f64>() / per_step.len().max(1) as f64;
    let bound_tps = cfg.dram_gbps * 1e9 / mean_bytes;
    progress.tick(&format!("experts on the CPU: {:.1} tok/s, bound {bound_tps:.1}", 1e9 / step))?;
    let cpu_experts = decode
        .placements
        .iter()
        .filter(|p| matches!(p.unit, UnitId::Expert { .. }) && p.placement == Placement::Cpu)
        .count();
    // Layers whose successor's GPU work was queued while their CPU experts ran (the engine's host spans).
    let pre_enqueued = out.trace.events.iter().filter(|e| e.name.starts_with("pre-enqueue ")).count();
    let pre_enqueue = match cfg.pre_enqueue {
        PreEnqueue::On => format!(
            "pre-enqueue on ({:.1} of {} layers a step)",
            pre_enqueued as f64 / cfg.gen_tokens.max(1) as f64,
            moe_layers.len().saturating_sub(1)
        ),
        PreEnqueue::Off => "pre-enqueue off".into(),
    };
    let pre_enqueue = match cfg.grouped_experts {
        GroupedExperts::On => format!("{pre_enqueue}, grouped experts"),
        GroupedExperts::Off => pre_enqueue,
    };
    let workload = format!(
        "{} bf16, {} plan at {}: {cpu_experts} of {} experts on the CPU in decode, {pre_enqueue}",
        moe.name,
        plan.planner,
        format_bytes(cfg.moe_budget_bytes),
        moe_layers.len() * n_experts
    );
    rows.push(BoundRow {
        bound: "DRAM read ÷ CPU bytes per token".into(),
        workload: workload.clone(),
        measured: 1e9 / step,
        bound_value: bound_tps,
        unit: "tok/s",
        goal_pct: 70.0,
        how: format!(
            "{:.2} GB read on the CPU per token (picked CPU experts from the run's routing + {:.2} GB of other \
             CPU units + KV of {kv_layers} CPU layers) ÷ {:.1} GB/s DRAM read ({} threads)",
            mean_bytes / 1e9,
            fixed / 1e9,
            cfg.dram_gbps,
            cfg.threads
        ),
    });
    // The plan's streamed units are read from the same DRAM by the copy engine while the CPU reads its
    // experts, so the host's whole read per token bounds the step too.
    let streamed_bytes = h2d_in_steps(&out.trace).bytes as f64 / steady_steps(&out.trace).len().max(1) as f64;
    rows.push(BoundRow {
        bound: "DRAM read ÷ host bytes per token (CPU reads + H2D copies)".into(),
        workload,
        measured: 1e9 / step,
        bound_value: cfg.dram_gbps * 1e9 / (mean_bytes + streamed_bytes),
        unit: "tok/s",
        goal_pct: 70.0,
        how: format!(
            "{:.2} GB read on the CPU + {:.2} GB copied to the GPU per token ÷ {:.1} GB/s DRAM read",
            mean_bytes / 1e9,
            streamed_bytes / 1e9,
            cfg.dram_gbps
        ),
    });
    Ok(rows)
}

/// The bounds as a markdown table.
pub fn table(rows: &[BoundRow]) -> String {
    let mut s = String::from(
        "| bound | workload | measured | bound | % of bound | goal | how the bound is counted |\n\
         |---|---|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} {u} | {:.1} {u} | {:.0}% | ≥ {:.0}% | {} |",
            r.bound,
            r.workload,
            r.measured,
            r.bound_value,
            r.pct(),
            r.goal_pct,
            r.how,
            u = r.unit
        );
    }
    s
}

/// Parses a byte budget flag.
pub fn budget(flag: &str, s: &str) -> anyhow::Result<u64> {
    parse_bytes(s).with_context(|| format!("{flag} {s}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steady-state steps are the host's `decode step i` spans for i ≥ 1, whatever else the trace holds.
    #[test]
    fn steady_steps_leave_out_step_0_and_other_spans() {
        let mut t = Trace::new();
        t.span(2, 0, "prefill chunk 0 (128 tokens)", "exec", 0, 5_000);
        t.span(2, 0, "decode step 0", "exec", 6_000, 3_000);
        t.span(0, 1, "copy blk.0.ffn", "exec", 9_500, 1_000);
        t.span(2, 0, "decode step 1", "exec", 9_000, 2_000);
        t.span(2, 0, "decode step 10", "exec", 11_000, 4_000);
        assert_eq!(steady_steps(&t), vec![(9_000, 11_000), (11_000, 15_000)]);
    }

    #[test]
    fn bounds_need_a_gpu() {
        #[derive(Debug, clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            a: crate::exec_bench::BenchArgs,
        }
        let args = <Wrap as clap::Parser>::try_parse_from(["bench", "--bounds", "--cpu-only"]).unwrap().a;
        let err = crate::exec_bench::run(&args).unwrap_err().to_string();
        assert!(err.contains("--bounds runs whole models on the GPU"), "{err}");
    }
}
