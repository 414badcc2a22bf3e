//! `pipeshard exec bench`: the decode GEMV of every weight format against the bandwidth that bounds it
//! (DRAM on the CPU, a device copy on the GPU), as a table on stdout and, with `--out DIR`, `gemv.csv` and
//! `gemv.md` carrying their provenance.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pipeshard_exec::cuda::{Gpu, probe};
use pipeshard_profiler::bench::{BenchConfig, BenchRow, gemv_bandwidth};
use pipeshard_profiler::machine::cpu_model;
use pipeshard_profiler::stats::Rule;

use crate::args::parse_bytes;
use crate::exec::provenance;
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
    /// Write `gemv.csv` and `gemv.md` into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
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
            Ok(_) => Some(Gpu::new().context("opening the CUDA device")?),
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
    };
    let rows = gemv_bandwidth(&cfg, gpu.as_ref(), &Bars::new())?;
    let machine =
        format!("{} + {} ({threads} threads)", gpu.as_ref().map_or("no GPU", |g| g.name()), cpu_model());
    let t = table(&rows);
    println!("{t}");
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
        eprintln!("wrote {}/gemv.md and gemv.csv", dir.display());
    }
    Ok(())
}
