//! `pipeshard profile`: machine profiles — measure this machine, derive the paper's reference systems, show one.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use pipeshard_core::dtype::DType;
use pipeshard_core::profile::{Fit, Profile, Provenance};
use pipeshard_core::reference;
use pipeshard_core::workload::OpClass;
use pipeshard_profiler::{Config, Mode, Progress};

#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Write the derived reference profile of one of the paper's client systems (cli1, cli2, cli3).
    Derive {
        #[arg(long)]
        system: String,
        /// Output file (default: `profiles/SYSTEM.json`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// A calibrated derived profile (written by `repro calibrate`) whose fitted efficiencies this system
        /// takes over: for a system the paper publishes no absolute measurements of (cli2), the efficiencies of
        /// the same software on a sibling machine, recorded as such in the provenance.
        #[arg(long)]
        efficiencies_from: Option<PathBuf>,
    },
    /// Measure this machine with the executor's kernels and write its profile.
    Measure {
        /// Coarse grids and bf16 only: a few minutes instead of the full sweep.
        #[arg(long)]
        fast: bool,
        /// Output file (default: `profiles/NAME.json`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// The machine's name in the profile (default: the output file's stem, else `local`).
        #[arg(long)]
        name: Option<String>,
        /// CPU thread counts to sweep, comma-separated (default: powers of two up to all threads, and all).
        #[arg(long, value_delimiter = ',')]
        threads: Vec<u32>,
        /// Measure the CPU only (no GPU needed); the GPU and PCIe sections come from `--gpu-from`.
        #[arg(long, requires = "gpu_from")]
        cpu_only: bool,
        /// Measure with the GPU everything the host shapes (PCIe, launch and sync, copies against compute, DRAM,
        /// CPU rows) and keep the GPU op rows of `--gpu-from` (same GPU model): ~2 minutes instead of ~5, so
        /// a validation can run right after it, before a shared host's figures drift.
        #[arg(long, requires = "gpu_from", conflicts_with = "cpu_only")]
        host_only: bool,
        /// The profile whose GPU and PCIe sections a `--cpu-only` run keeps (`--host-only`: its GPU op rows).
        #[arg(long)]
        gpu_from: Option<PathBuf>,
        /// With `--host-only`: also measure the GPU's routed-expert rows (per expert, grouped, tiled) and put
        /// them in place of the `--gpu-from` profile's (host-paced rows, which an executor change moves).
        #[arg(long, requires = "host_only")]
        gpu_experts: bool,
        /// With `--cpu-only`: also measure the GPU's batched decode attention (R sequences in one step) and
        /// replace the `--gpu-from` profile's rows of it.
        #[arg(long, requires = "cpu_only")]
        gpu_decode_attention: bool,
        /// Also write the summary plot (default: beside the output, `.png`).
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Write a profile of this machine from two of its measured profiles, running nothing: the DRAM and CPU
    /// rows of `--host-from` in `--device-from` (for a profile whose host was disturbed while its CPU section
    /// ran; both profiles' provenance goes into the notes).
    Combine {
        /// The profile whose GPU, PCIe, launch and sync figures are kept.
        #[arg(long)]
        device_from: PathBuf,
        /// The profile whose DRAM and CPU rows replace the other's.
        #[arg(long)]
        host_from: PathBuf,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print a profile's summary and plot its curves as PNG.
    Show {
        /// The profile (JSON).
        profile: PathBuf,
        /// PNG to write (default: beside the profile, `.png`).
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

/// The fit of the calibrated profile at `from`, restated as taken over by another system (command, commit and
/// date of this transfer; what it was fitted on and how well, from the source).
fn transferred_fit(from: &Path) -> anyhow::Result<Fit> {
    let source = Profile::load(from).with_context(|| format!("--efficiencies-from {}", from.display()))?;
    let Provenance::Derived { fit: Some(fit), .. } = source.provenance else {
        anyhow::bail!(
            "--efficiencies-from {}: the profile carries no fit; give a profile written by `pipeshard repro \
             calibrate` (e.g. profiles/cli3.json)",
            from.display()
        );
    };
    let name = &source.machine.name;
    Ok(Fit {
        parameters: fit.parameters,
        calibration_set: format!(
            "not fitted on this system: the efficiencies of {name}'s fit ({}), taken over as the same software's \
             on a sibling machine; this system's own figures (bandwidths, peaks, cores) are its own",
            fit.calibration_set
        ),
        objective: format!("{name}'s: {}", fit.objective),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        commit: crate::sweep::git_commit(),
        date_utc: crate::sweep::now_utc(),
    })
}

/// indicatif bars, one per section.
pub(crate) struct Bars {
    bar: std::cell::RefCell<Option<ProgressBar>>,
}

impl Bars {
    pub(crate) fn new() -> Bars {
        Bars { bar: std::cell::RefCell::new(None) }
    }
}

impl Progress for Bars {
    fn section(&self, name: &str, steps: u64) {
        if let Some(b) = self.bar.borrow_mut().take() {
            b.finish();
        }
        eprintln!("== {name}");
        let b = ProgressBar::new(steps);
        b.set_style(
            ProgressStyle::with_template("{elapsed:>4} [{bar:40}] {pos}/{len} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        *self.bar.borrow_mut() = Some(b);
    }

    fn step(&self, detail: &str) {
        if let Some(b) = self.bar.borrow().as_ref() {
            b.set_message(detail.to_string());
            b.inc(1);
            if b.is_hidden() {
                eprintln!("  {detail}");
            }
        }
    }

    fn interrupted(&self) -> bool {
        crate::interrupt::raised()
    }
}

pub fn run(cmd: ProfileCommand) -> anyhow::Result<()> {
    match cmd {
        ProfileCommand::Derive { system, out, efficiencies_from } => {
            let unknown = || {
                format!(
                    "no derived profile for `{system}`; known systems: {}",
                    reference::systems().join(", ")
                )
            };
            let profile = match efficiencies_from {
                None => reference::derived(&system).with_context(unknown)?,
                Some(from) => {
                    let fit = transferred_fit(&from)?;
                    let mut p = reference::derived_with(&system, &fit.parameters).with_context(unknown)?;
                    if let Provenance::Derived { fit: f, .. } = &mut p.provenance {
                        *f = Some(fit);
                    }
                    p
                }
            };
            let out = out.unwrap_or_else(|| PathBuf::from(format!("profiles/{system}.json")));
            std::fs::write(&out, profile.to_json() + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {}", out.display());
            Ok(())
        }
        ProfileCommand::Measure {
            fast,
            out,
            name,
            threads,
            cpu_only,
            host_only,
            gpu_from,
            gpu_experts,
            gpu_decode_attention,
            plot,
        } => {
            let name = name
                .or_else(|| {
                    out.as_ref().and_then(|o| o.file_stem()).map(|s| s.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "local".into());
            let out = out.unwrap_or_else(|| PathBuf::from(format!("profiles/{name}.json")));
            let gpu_from = match (cpu_only || host_only, gpu_from) {
                (true, Some(p)) => Some(Profile::load(&p)?),
                (false, Some(_)) => anyhow::bail!("--gpu-from only goes with --cpu-only or --host-only"),
                _ => None,
            };
            let (commit, date, command) = crate::exec::provenance();
            let cfg = Config {
                mode: if fast { Mode::Fast } else { Mode::Full },
                name,
                threads,
                gpu_from,
                host_only,
                gpu_experts,
                gpu_decode_attention,
                command,
                commit,
                date,
            };
            let bars = Bars::new();
            crate::interrupt::install();
            let profile = pipeshard_profiler::measure(&cfg, &bars)?;
            if let Some(b) = bars.bar.borrow_mut().take() {
                b.finish();
            }
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            crate::interrupt::write_atomic(&out, (profile.to_json() + "\n").as_bytes())?;
            // Read it back: what was written is a valid profile.
            let profile = Profile::load(&out)?;
            println!("wrote {}", out.display());
            show(&profile, &plot.unwrap_or_else(|| out.with_extension("png")))
        }
        ProfileCommand::Combine { device_from, host_from, out } => {
            let load =
                |p: &Path, flag: &str| Profile::load(p).with_context(|| format!("{flag} {}", p.display()));
            let (device, host) = (load(&device_from, "--device-from")?, load(&host_from, "--host-from")?);
            let (commit, date, command) = crate::exec::provenance();
            let profile = pipeshard_profiler::combine(&device, &host, command, commit, date)?;
            crate::interrupt::write_atomic(&out, (profile.to_json() + "\n").as_bytes())?;
            println!("wrote {}", out.display());
            show(&Profile::load(&out)?, &out.with_extension("png"))
        }
        ProfileCommand::Show { profile, plot } => {
            let p = Profile::load(&profile)?;
            show(&p, &plot.unwrap_or_else(|| profile.with_extension("png")))
        }
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 30)
}

fn size_label(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{}G", b >> 30)
    } else if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}K", b >> 10)
    }
}

/// Prints the summary and writes the plot.
fn show(p: &Profile, plot: &Path) -> anyhow::Result<()> {
    let m = &p.machine;
    println!("profile `{}` (schema {})", m.name, p.schema_version);
    match &p.provenance {
        Provenance::Measured { command, commit, date } => {
            println!("measured {date}, commit {commit}: {command}");
        }
        Provenance::Derived { calibration, .. } => println!("derived: {calibration}"),
    }
    println!("GPU  {} · {:.1} GiB", m.gpu, gib(m.gpu_vram_bytes));
    println!("CPU  {} · {} threads · {:.1} GiB RAM", m.cpu, m.cpu_threads, gib(m.host_ram_bytes));
    println!("PCIe {}", m.pcie);
    println!();
    let sizes: Vec<u64> = p.pcie.h2d_pinned.iter().map(|x| x.bytes).collect();
    let model = pipeshard_core::cost::TableCostModel::new(p);
    print!("{:<14}", "copies GB/s");
    for s in &sizes {
        print!("{:>8}", size_label(*s));
    }
    println!();
    for (label, pinned, h2d) in [
        ("H2D pinned", true, true),
        ("D2H pinned", true, false),
        ("H2D pageable", false, true),
        ("D2H pageable", false, false),
    ] {
        print!("{label:<14}");
        for &s in &sizes {
            use pipeshard_core::cost::CostModel;
            let ns = if h2d { model.h2d_ns(s, pinned) } else { model.d2h_ns(s, pinned) };
            let g = s as f64 / ns as f64;
            print!("{g:>8.1}");
        }
        println!();
    }
    println!("(achieved: bytes / (latency + bytes / curve rate), as the cost model predicts)");
    println!(
        "both directions {:.1} GB/s · copy latency {:.1} µs{}",
        p.pcie.bidirectional_gbps,
        p.pcie.copy_latency_ns as f64 / 1e3,
        p.pcie
            .h2d_under_compute_gbps
            .map_or(String::new(), |g| format!(" · H2D while the GPU computes {g:.1} GB/s"))
    );
    println!();
    println!(
        "{:<8}{:>12}{:>14}{:>16}{:>18}",
        "threads", "DRAM GB/s", "under DMA", "CPU GEMV GB/s", "GEMV under DMA"
    );
    for d in &p.dram {
        let gemv = best_cpu_gemv(p, d.threads);
        println!(
            "{:<8}{:>12.1}{:>14.1}{:>16}{:>18}",
            d.threads,
            d.gbps,
            d.gbps_under_dma,
            gemv.map_or("-".into(), |g| format!("{:.1}", g.0)),
            gemv.and_then(|g| g.1).map_or("-".into(), |g| format!("{g:.1}")),
        );
    }
    println!();
    for (d, f) in &p.gpu.roofline.matmul_flops {
        println!("GPU {d:?} GEMM peak (best row) {:.0} TFLOP/s", f / 1e12);
    }
    let gemv = p
        .gpu
        .ops
        .iter()
        .filter(|r| r.op == OpClass::MatMul && r.tokens == 1)
        .filter_map(|r| Some((r.dtype.tensor_bytes(r.k, r.n).ok()? as f64 / r.time_ns as f64, r)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((g, r)) = gemv {
        println!("GPU GEMV best {:.2} TB/s of weights ({:?} {}×{})", g / 1e3, r.dtype, r.n, r.k);
    }
    println!(
        "GPU memory roofline {:.0} GB/s · launch {:.1} µs · host sync {:.1} µs · memory-bound ops ×{:.3} under DMA · \
         runtime VRAM {:.2} GiB",
        p.gpu.roofline.mem_gbps,
        p.launch_ns as f64 / 1e3,
        p.host_sync_ns as f64 / 1e3,
        p.gpu.dma_slowdown,
        gib(p.runtime_overhead_bytes)
    );
    println!(
        "CPU ops ×{:.3} under DMA (median) · {} GPU rows, {} CPU rows",
        p.cpu.dma_slowdown,
        p.gpu.ops.len(),
        p.cpu.ops.len()
    );
    if !p.measurements.is_empty() {
        println!();
        for x in &p.measurements {
            println!(
                "  {:<64} {:>10.3} {:<5} ±{:.1}% ({} samples)",
                x.name,
                x.value,
                x.unit,
                x.spread * 100.0,
                x.samples
            );
        }
    }
    for n in &p.notes {
        println!("note: {n}");
    }
    crate::plots::profile_plot(p, plot)?;
    println!("wrote {}", plot.display());
    Ok(())
}

/// Best CPU GEMV (1 token, bf16) weight GB/s at `threads`, alone and under DMA.
pub fn best_cpu_gemv(p: &Profile, threads: u32) -> Option<(f64, Option<f64>)> {
    p.cpu
        .ops
        .iter()
        .filter(|r| {
            r.op == OpClass::MatMul && r.tokens == 1 && r.threads == threads && r.dtype == DType::Bf16
        })
        .map(|r| {
            let bytes = (2 * r.n * r.k) as f64;
            (bytes / r.time_ns as f64, r.time_ns_under_dma.map(|t| bytes / t as f64))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transferred_fit_keeps_the_sources_parameters_and_says_where_they_come_from() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles");
        let cli3 = Profile::load(&root.join("cli3.json")).unwrap();
        let Provenance::Derived { fit: Some(source), .. } = &cli3.provenance else {
            panic!("cli3 is fitted")
        };
        let fit = transferred_fit(&root.join("cli3.json")).unwrap();
        assert_eq!(fit.parameters, source.parameters);
        assert!(
            fit.calibration_set.starts_with("not fitted on this system")
                && fit.calibration_set.contains("cli3")
        );
        assert!(fit.objective.contains(&source.objective));
        // The committed cli2 is the derivation of cli2 under cli3's parameters.
        let cli2 = Profile::load(&root.join("cli2.json")).unwrap();
        let Provenance::Derived { fit: Some(f2), .. } = &cli2.provenance else {
            panic!("cli2 carries its transfer")
        };
        assert_eq!(f2.parameters, source.parameters);
        assert_eq!(cli2.machine, reference::derived("cli2").unwrap().machine);
        // A profile without a fit is refused, naming the flag and what to give instead.
        let e = format!("{:#}", transferred_fit(&root.join("h200.json")).unwrap_err());
        assert!(e.contains("--efficiencies-from") && e.contains("no fit") && e.contains("cli3.json"), "{e}");
    }
}
