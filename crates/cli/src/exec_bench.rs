//! `pipeshard exec bench`: the decode GEMV of every weight format against the bandwidth that bounds it
//! (DRAM on the CPU, a device copy on the GPU), as a table on stdout and, with `--out DIR`, `gemv.csv` and
//! `gemv.md` carrying their provenance; with `--bounds`, whole-model decode against its bounds too
//! ([`crate::exec_bounds`]: `bounds.csv`, `bounds.md`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pipeshard_core::dtype::DType;
use pipeshard_core::model::FfnKind;
use pipeshard_exec::cuda::{Gpu, probe};
use pipeshard_exec::quant::QFormat;
use pipeshard_profiler::bench::{
    BenchConfig, BenchRow, LayerKernelRow, LayerShapes, decode_layer_kernels, gemv_bandwidth,
};
use pipeshard_profiler::machine::cpu_model;
use pipeshard_profiler::stats::Rule;

use crate::args::{load_profile, parse_bytes};
use crate::exec::provenance;
use crate::exec_bounds::{BoundRow, BoundsConfig, budget, decode_bounds, table as bounds_table};
use crate::profile::Bars;

/// Arguments of `exec bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// CPU threads (default: every hardware thread).
    #[arg(long)]
    threads: Option<usize>,
    /// Bytes of each CPU matrix and of the DRAM read (well above the last-level cache).
    #[arg(long, default_value = "1G")]
    cpu_bytes: String,
    /// Bytes of each GPU matrix and of the device copy.
    #[arg(long, default_value = "1G")]
    gpu_bytes: String,
    /// Row length (input features) of the matrices; a multiple of 32.
    #[arg(long, default_value_t = 4096)]
    cols: usize,
    /// Measure the CPU only, even where a GPU is present.
    #[arg(long)]
    cpu_only: bool,
    /// Quantised formats to measure besides bf16, comma-separated (`q4_0,q4_k`; `none` for bf16 alone, as
    /// `--bounds` needs); default: every one.
    #[arg(long)]
    formats: Option<String>,
    /// Write `gemv.csv` and `gemv.md` (and with `--bounds`, `bounds.csv` and `bounds.md`) into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also run whole-model decode against its bounds (needs a GPU): all-pinned decode of `--dense-model`
    /// against the HBM roofline, its decode with every FFN streamed against the profiled pinned H2D, and
    /// `--moe-model` with its experts on the CPU against DRAM read ÷ CPU bytes per token.
    #[arg(long)]
    bounds: bool,
    /// Dense model of the roofline and streaming bounds (bf16 random weights; `NAME@NL` truncates).
    #[arg(long, default_value = "nemo-8b")]
    dense_model: String,
    /// MoE model of the CPU-experts bound (bf16 random weights; `NAME@NL` keeps the first N layers, each
    /// with the full model's per-layer sizes).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    moe_model: String,
    /// VRAM budget of the MoE model's plan.
    #[arg(long, default_value = "2G")]
    moe_budget: String,
    /// Planner of the MoE model's plan.
    #[arg(long, default_value = "ilp")]
    moe_planner: String,
    /// Machine profile the planners cost with and whose pinned H2D curve bounds streaming.
    #[arg(long, default_value = "profiles/h200.json")]
    profile: String,
    /// Prompt tokens before the measured decode steps (one prefill pass).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: u64,
    /// Decode steps (step 0 is left out of every figure).
    #[arg(long = "gen", default_value_t = 16)]
    gen_tokens: u64,
    /// Decode of the MoE bound: queue the GPU work after a layer's CPU experts while they run (`on`, where the
    /// plan and the device allow it) or launch it after them (`off`); see `exec run --pre-enqueue`.
    #[arg(long, value_enum, default_value = "on")]
    pre_enqueue: crate::exec::Toggle,
    /// The bounds' decode runs: a MoE layer's pinned GPU experts as two grouped launches (`on`, the default)
    /// or five an expert (`off`); see `exec run --grouped-experts`.
    #[arg(long, value_enum, default_value = "on")]
    grouped_experts: crate::exec::Toggle,
    /// One-token bf16 GEMVs of every part: exec's decode GEMV with the norm and activation folded in (`on`,
    /// the default) or cuBLAS (`off`); see `exec run --decode-gemv`.
    #[arg(long, value_enum, default_value = "on")]
    decode_gemv: crate::exec::Toggle,
    /// With --bounds and --out, also write the runs' Chrome traces (`bounds-pinned.json`, `bounds-streamed.json`,
    /// `bounds-moe-cpu-experts.json`).
    #[arg(long)]
    trace: bool,
}

/// The decode-layer kernel rows as a markdown table.
fn layer_table(model: &str, rows: &[LayerKernelRow]) -> String {
    let mut t = format!(
        "{model}: a decode layer's GEMVs\n\n| part | rows × cols | variant | µs | GB/s | max rel err |\n|---|---|---|---:|---:|---:|\n"
    );
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} × {} | {} | {:.1} | {:.0} | {:.1e} |",
            r.part,
            r.rows,
            r.cols,
            r.variant,
            r.time_ns / 1e3,
            r.gbps,
            r.max_rel_err
        );
    }
    t
}

fn table(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| device | format | kernel | matrix | weights MB | µs | GB/s | bound | bound GB/s | % of bound | max rel err |\n\
         |---|---|---|---|---:|---:|---:|---|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {}×{} | {:.0} | {:.0} | {:.1} | {} | {:.1} | {:.0}% | {:.1e} |",
            r.device,
            r.format,
            r.kernel,
            r.rows,
            r.cols,
            r.weight_bytes as f64 / 1e6,
            r.time_ns / 1e3,
            r.gbps,
            r.bound,
            r.bound_gbps,
            100.0 * r.gbps / r.bound_gbps,
            r.max_rel_err
        );
    }
    s
}

/// `--formats`: quantised formats by name, or `none`.
fn quant_formats(list: &str) -> anyhow::Result<Vec<QFormat>> {
    if list == "none" {
        return Ok(Vec::new());
    }
    list.split(',')
        .filter(|f| *f != "bf16")
        .map(|f| {
            let d: DType = f.parse().map_err(|e| anyhow::anyhow!("--formats {f}: {e}"))?;
            QFormat::from_dtype(d).with_context(|| {
                format!("--formats {f}: not a quantised format the bench measures (q8_0, q4_0, q4_k, q6_k, q2_k, q3_k)")
            })
        })
        .collect()
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.cols == 0 || !args.cols.is_multiple_of(256) {
        anyhow::bail!("--cols {}: must be a positive multiple of 256 (the q4_k/q6_k super-block)", args.cols);
    }
    let (commit, date, command) = provenance();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    let gpu = if args.cpu_only {
        None
    } else {
        match probe() {
            Ok(_) => {
                let g = Gpu::new().context("opening the CUDA device")?;
                g.set_decode_gemv(args.decode_gemv == crate::exec::Toggle::On);
                Some(g)
            }
            Err(reason) => {
                eprintln!("no CUDA device ({reason}): CPU only");
                None
            }
        }
    };
    let cfg = BenchConfig {
        threads,
        cpu_weight_bytes: usize::try_from(parse_bytes(&args.cpu_bytes)?).context("--cpu-bytes")?,
        gpu_weight_bytes: usize::try_from(parse_bytes(&args.gpu_bytes)?).context("--gpu-bytes")?,
        cols: args.cols,
        rule: Rule { min_samples: 5, max_samples: 15, target_spread: 0.03, budget: Duration::from_secs(2) },
        quant_formats: args.formats.as_deref().map(quant_formats).transpose()?,
    };
    if args.bounds && gpu.is_none() {
        anyhow::bail!(
            "--bounds runs whole models on the GPU: this machine has none (or --cpu-only was given)"
        );
    }
    if args.bounds && args.gen_tokens < 2 {
        anyhow::bail!("--gen {}: --bounds leaves decode step 0 out, so it needs 2 or more", args.gen_tokens);
    }
    let bars = Bars::new();
    let rows = gemv_bandwidth(&cfg, gpu.as_ref(), &bars)?;
    let layer = match &gpu {
        Some(g) => {
            let t = &crate::experiment::resolve_model(&args.dense_model)
                .with_context(|| format!("--dense-model {}", args.dense_model))?
                .text;
            let shapes = LayerShapes {
                hidden: t.hidden as usize,
                qkv: (u64::from(t.n_heads + 2 * t.n_kv_heads) * t.head_dim) as usize,
                q_dim: (u64::from(t.n_heads) * t.head_dim) as usize,
                ffn: t.ffn as usize,
                gated: t.ffn_kind == FfnKind::SwiGlu,
            };
            let lt = layer_table(&args.dense_model, &decode_layer_kernels(g, shapes, cfg.rule, &bars)?);
            println!("{lt}");
            Some(lt)
        }
        None => None,
    };
    let machine =
        format!("{} + {} ({threads} threads)", gpu.as_ref().map_or("no GPU", |g| g.name()), cpu_model());
    let t = table(&rows);
    println!("{t}");
    if let (true, Some(g)) = (args.bounds, &gpu) {
        let bf16 = |device: &str| {
            rows.iter().find(|r| r.device == device && r.format == "bf16").with_context(|| {
                format!("the GEMV bench measured no bf16 {device} row, which the bounds need")
            })
        };
        let (cpu_row, gpu_row) = (bf16("cpu")?, bf16("gpu")?);
        let profile = load_profile(&args.profile)?;
        let bcfg = BoundsConfig {
            dense_model: &args.dense_model,
            moe_model: &args.moe_model,
            moe_budget_bytes: budget("--moe-budget", &args.moe_budget)?,
            moe_planner: &args.moe_planner,
            profile: &profile,
            profile_name: &args.profile,
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            threads: u32::try_from(threads).context("--threads")?,
            device_gbps: gpu_row.bound_gbps,
            dram_gbps: cpu_row.bound_gbps,
            trace_dir: args.out.as_deref().filter(|_| args.trace),
            pre_enqueue: args.pre_enqueue.into(),
            grouped_experts: args.grouped_experts.into(),
        };
        let mut bounds = vec![BoundRow {
            bound: "DRAM read".into(),
            workload: format!("CPU GEMV bf16 {}×{} ({})", cpu_row.rows, cpu_row.cols, cpu_row.kernel),
            measured: cpu_row.gbps,
            bound_value: cpu_row.bound_gbps,
            unit: "GB/s",
            goal_pct: 80.0,
            how: format!("DRAM read of {} with the same {threads} threads", args.cpu_bytes),
        }];
        bounds.extend(decode_bounds(g, &bcfg, &bars)?);
        let bt = bounds_table(&bounds);
        println!("{bt}");
        if let Some(dir) = &args.out {
            write_bounds(dir, &bounds, &bt, &machine, &args.profile)?;
        }
    }
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let md = format!(
            "# Decode GEMV bandwidth per weight format\n\nmachine: {machine}  \ncommit: {commit}  \ndate: {date}  \n\
             command: `{command}`\n\nOne GEMV (1 token) over a matrix of the given bytes; GB/s counts weight bytes. \
             The CPU bound is a DRAM read of the same size with the same threads; the GPU bound is a \
             device-to-device copy (read + write bytes). Max rel err: the first 64 outputs against an f64 product \
             with the dequantised weights. The GPU prefill GEMM rows (512 tokens, 14336 rows) give GFLOP/s in the \
             GB/s column, against bf16 cuBLAS on the same shape, and are not checked (max rel err 0).\n\n{t}"
        );
        std::fs::write(dir.join("gemv.md"), md).with_context(|| format!("writing {}", dir.display()))?;
        let mut csv = String::from(
            "device,format,kernel,rows,cols,weight_bytes,time_ns,gbps,bound,bound_gbps,max_rel_err,machine,commit,date\n",
        );
        for r in &rows {
            let _ = writeln!(
                csv,
                "{},{},\"{}\",{},{},{},{:.0},{:.2},\"{}\",{:.2},{:.3e},\"{machine}\",{commit},{date}",
                r.device,
                r.format,
                r.kernel,
                r.rows,
                r.cols,
                r.weight_bytes,
                r.time_ns,
                r.gbps,
                r.bound,
                r.bound_gbps,
                r.max_rel_err
            );
        }
        std::fs::write(dir.join("gemv.csv"), csv).with_context(|| format!("writing {}", dir.display()))?;
        if let Some(lt) = &layer {
            let md = format!(
                "# A decode layer's GEMVs: cuBLAS against the decode GEMV\n\nmachine: {machine}  \ncommit: \
                 {commit}  \ndate: {date}  \ncommand: `{command}`\n\nEach part as the executor runs it with \
                 `--decode-gemv off` (cuBLAS, the norm and activation kernels of their own) and `on` at each rows \
                 a warp the kernel has; device time of back-to-back sequences over copies of the matrix that L2 \
                 cannot hold. GB/s counts weight bytes; max rel err is against the cuBLAS variant's output.\n\n{lt}"
            );
            std::fs::write(dir.join("decode-kernels.md"), md)
                .with_context(|| format!("writing {}", dir.display()))?;
        }
        eprintln!("wrote {}/gemv.md and gemv.csv", dir.display());
    }
    Ok(())
}

/// Writes `bounds.md` and `bounds.csv` with their provenance.
fn write_bounds(
    dir: &std::path::Path,
    rows: &[BoundRow],
    table: &str,
    machine: &str,
    profile: &str,
) -> anyhow::Result<()> {
    let (commit, date, command) = provenance();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let md = format!(
        "# Decode against its hardware bounds\n\nmachine: {machine}  \ncommit: {commit}  \ndate: {date}  \n\
         profile: {profile}  \ncommand: `{command}`\n\nRandom bf16 weights. Decode figures are the mean of decode \
         steps 1.. (step 0 follows the prefill → decode switch), from the run's measured trace; the H2D rows \
         count the bytes of every ring copy that starts within those steps.\n\n{table}"
    );
    std::fs::write(dir.join("bounds.md"), md)
        .with_context(|| format!("writing {}/bounds.md", dir.display()))?;
    let mut csv = String::from(
        "bound,workload,measured,bound_value,unit,pct_of_bound,goal_pct,how,machine,commit,date\n",
    );
    for r in rows {
        let _ = writeln!(
            csv,
            "\"{}\",\"{}\",{:.3},{:.3},{},{:.1},{:.0},\"{}\",\"{machine}\",{commit},{date}",
            r.bound,
            r.workload,
            r.measured,
            r.bound_value,
            r.unit,
            r.pct(),
            r.goal_pct,
            r.how
        );
    }
    std::fs::write(dir.join("bounds.csv"), csv)
        .with_context(|| format!("writing {}/bounds.csv", dir.display()))?;
    eprintln!("wrote {}/bounds.md and bounds.csv", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_lists_name_quantised_formats_and_refuse_others() {
        assert_eq!(quant_formats("q4_0,q4_k").unwrap(), [QFormat::Q4_0, QFormat::Q4K]);
        assert!(quant_formats("none").unwrap().is_empty());
        assert!(quant_formats("bf16").unwrap().is_empty());
        let e = quant_formats("q4_0,f16").unwrap_err().to_string();
        assert!(e.contains("--formats f16") && e.contains("not a quantised format"), "{e}");
        let e = quant_formats("q5_z").unwrap_err().to_string();
        assert!(e.contains("--formats q5_z"), "{e}");
    }
}
