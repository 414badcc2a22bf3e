//! pipeshard-profiler: measures a [`Profile`] (PCIe, DRAM, GPU and CPU op throughput, and how they slow each
//! other) on the machine it runs on, using exec's own kernels so that what is profiled is what runs.
//!
//! It depends on pipeshard-core and pipeshard-exec; it must never depend on planner or sim.
//!
//! # Job
//! [`measure`] runs every section below and returns a schema-2 [`Profile`] that
//! [`pipeshard_core::cost::TableCostModel`] consumes:
//! - **PCIe** ([`gpu`]): pinned and pageable H2D and D2H over transfer sizes 64 KiB … 1 GiB, the fixed copy
//!   latency, both directions at once, H2D while the GPU computes (a GEMV queue and a GEMM queue), and the
//!   slowdown of a GEMV and a GEMM while a copy streams.
//! - **DRAM** ([`cpu`]): read bandwidth by thread count, alone and while pinned H2D copies stream.
//! - **GPU ops**: exec's matmul (cuBLAS GEMM; for the quantised formats its dequantising GEMV or dequantise +
//!   cuBLAS)
//!   over log-spaced token counts for every matrix shape of every catalog model ([`shapes`]) and every
//!   executor format (f16, bf16, q8_0, q4_0, q4_k, q6_k, q2_k, q3_k; the fast mode bf16 and q4_0); routed experts as exec's
//!   whole per-expert sequence (gather, one gate|up matmul, SwiGLU, down matmul, weighted scatter-add: five
//!   launches, six where the quantised expert is dequantised before cuBLAS), and (every format but q2_k and
//!   q3_k) as exec's two grouped launches over 1–64 experts of one token each (a layer's pinned experts in a
//!   step of ≤ 8 tokens);
//!   exec's attention kernel for prefill and decode over contexts 1K … 128K and every catalog head layout;
//!   exec's norm, RoPE and SwiGLU kernels; launch overhead ([`gpu::LaunchProbe`], which `validate` also runs
//!   around each cell); host-sync latency; the runtime's VRAM.
//! - **Executor sequences**: the decode routing round trip of a MoE layer after a GPU router, as exec runs it
//!   (copies down, the sync with the pool polling, the routing, the first CPU or GPU expert's start).
//! - **CPU ops**: exec's CPU matmul (bf16 and the quantised formats) and attention by thread count, alone and under DMA, and its elementwise
//!   kernels; the host's routing of a prefill chunk.
//!
//! Every figure is sampled until its spread (interquartile range / median) is small or its time budget is
//! spent ([`stats`]); the median is kept and the spread recorded beside it.
//!
//! # Decisions
//! - **Effective copy bandwidth.** A curve point's `gbps` is `bytes / (time − copy_latency)`, so that the cost
//!   model's `latency + bytes / gbps` reproduces the measured time at every size.
//! - **Rooflines are the best measured**, not datasheet figures: the GPU's FLOP/s per format is its fastest
//!   GEMM row, its memory bandwidth the larger of a device-to-device copy and its fastest GEMV; the CPU's are its
//!   fastest matmul row and the DRAM read bandwidth at all threads.
//! - **Caches are defeated**: weights rotate among copies totalling several times the last-level cache, and
//!   every buffer holds random values, never zeros.
//! - **No GPU** ([`Mode::Tiny`] in tests, or `--cpu-only` on a development machine): the CPU sections are
//!   measured and the GPU and PCIe sections are taken from a base profile, which the profile's notes name;
//!   `gpu_decode_attention` adds the GPU's batched decode attention rows measured in the same run.
//!
//! [`bench`](mod@bench) (`pipeshard exec bench`) measures the decode GEMV per weight format (bf16, q8_0, q4_0, q4_k, q6_k, q2_k, q3_k) on CPU and
//! GPU against DRAM and device-copy bandwidth; it is a table, not part of the profile.
//!
//! # Not measured (notes say so)
//! Grouped experts in q2_k/q3_k (exec keeps them per expert: their GEMVs round the activations to 8 bits);
//! quantised formats other than q8_0, q4_0, q2_k, q3_k, q4_k and q6_k (exec does not run them).

pub mod bench;
pub mod cpu;
pub mod gpu;
pub mod machine;
pub mod shapes;
pub mod stats;

use std::time::{Duration, Instant};

use pipeshard_core::profile::{Machine, Measurement, PROFILE_SCHEMA_VERSION, Profile, Provenance};
use pipeshard_core::workload::OpClass;
use pipeshard_exec::ExecError;

use stats::{Rule, Stat};

/// How much to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Seconds, small buffers: for tests (CPU sections only make sense here).
    Tiny,
    /// A few minutes: coarse grids, bf16 and q4_0 matmuls.
    Fast,
    /// The full grids of the issue: every token count 1 … 4096, every executor format, every context and layout.
    Full,
}

impl Mode {
    /// The sampling rule of this mode.
    #[must_use]
    pub fn rule(self) -> Rule {
        match self {
            Mode::Tiny => {
                Rule { min_samples: 3, max_samples: 5, target_spread: 0.1, budget: Duration::from_millis(50) }
            }
            Mode::Fast => Rule {
                min_samples: 5,
                max_samples: 12,
                target_spread: 0.03,
                budget: Duration::from_millis(150),
            },
            Mode::Full => Rule {
                min_samples: 7,
                max_samples: 25,
                target_spread: 0.02,
                budget: Duration::from_millis(250),
            },
        }
    }
}

/// What to measure and how to label it.
#[derive(Debug, Clone)]
pub struct Config {
    pub mode: Mode,
    /// The machine's name in the profile (e.g. `h200`).
    pub name: String,
    /// CPU thread counts to sweep; empty: powers of two up to the machine's threads, and the machine's threads.
    pub threads: Vec<u32>,
    /// `None`: measure the GPU (an error without one). `Some(p)`: CPU only; GPU and PCIe sections from `p`
    /// (with `host_only`, only `p`'s GPU op rows).
    pub gpu_from: Option<Profile>,
    /// With `gpu_from`: measure on this machine's GPU everything its host shapes (PCIe, launch and sync,
    /// copies against compute, DRAM, CPU rows) and keep `gpu_from`'s GPU op rows (GEMM, attention,
    /// elementwise), which a GPU of the same model reproduces while the shared host's figures drift
    /// (results/validation/2026-12-01-nvidia-h200, run22–run24).
    pub host_only: bool,
    /// With `host_only`: measure the GPU's routed-expert rows (per expert, grouped, tiled) here too and put them
    /// in place of the base profile's: they are paced by the host's launches, and an executor change moves them.
    pub gpu_experts: bool,
    /// With `gpu_from`: measure the GPU's batched decode attention here too and put its rows in place of the
    /// base profile's (a base measured before those rows existed, or on another machine).
    pub gpu_decode_attention: bool,
    /// Provenance: the command line, commit and date that produced the profile.
    pub command: String,
    pub commit: String,
    pub date: String,
}

/// Receives progress: one section at a time, a known number of steps each.
pub trait Progress {
    /// A new section with `steps` steps begins.
    fn section(&self, name: &str, steps: u64);
    /// One step of the current section is done.
    fn step(&self, detail: &str);
    /// Whether the user asked to stop (Ctrl-C): checked after every step.
    fn interrupted(&self) -> bool {
        false
    }
    /// [`Progress::step`], then [`ProfilerError::Interrupted`] if [`Progress::interrupted`]: the measurement
    /// unwinds, releasing its device and page-locked buffers, and no profile is produced.
    fn tick(&self, detail: &str) -> Result<()> {
        self.step(detail);
        if self.interrupted() { Err(ProfilerError::Interrupted) } else { Ok(()) }
    }
}

/// A profiling failure.
#[derive(Debug, thiserror::Error)]
pub enum ProfilerError {
    #[error(
        "no usable GPU ({0}); run `pipeshard profile measure` on the GPU machine, or pass `--cpu-only --gpu-from \
         PROFILE` to measure only this machine's CPU"
    )]
    NoGpu(String),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("{0}")]
    Input(String),
    #[error("interrupted (Ctrl-C): no profile was written")]
    Interrupted,
}

/// A result of this crate.
pub type Result<T> = std::result::Result<T, ProfilerError>;

/// Thread counts to sweep on a machine with `max` threads.
#[must_use]
pub fn default_threads(max: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (0..31).map(|i| 1u32 << i).take_while(|&x| x < max).collect();
    t.push(max.max(1));
    t
}

/// The scalar measurements a run collects for the profile's `measurements`.
#[derive(Debug, Default)]
pub struct Figures(pub Vec<Measurement>);

impl Figures {
    /// Records `s` under `name`.
    pub fn add(&mut self, name: &str, unit: &str, s: Stat) {
        self.0.push(Measurement {
            name: name.into(),
            value: s.median,
            unit: unit.into(),
            spread: s.spread,
            samples: s.samples,
        });
    }
}

/// Where a base profile's figures came from, for the notes of a run that keeps some of them.
fn provenance_line(p: &Provenance) -> String {
    match p {
        Provenance::Measured { command, commit, date } => {
            format!("measured {date}, commit {commit}: `{command}`")
        }
        Provenance::Derived { .. } => "derived from published figures".into(),
    }
}

/// A profile of one machine from two of its measurements, without running anything: `host`'s DRAM and CPU
/// rows (and the host's routing cost) in `device`'s profile, whose GPU, PCIe, launch and sync figures stay.
/// For a run whose host was disturbed while its CPU section ran (the GPU machine's host is shared): the CPU
/// figures of a steadier run of the same machine, as a `--cpu-only` run measures them, recorded in the notes.
///
/// # Errors
/// The two profiles describe different CPUs or thread counts.
pub fn combine(
    device: &Profile,
    host: &Profile,
    command: String,
    commit: String,
    date: String,
) -> Result<Profile> {
    if device.machine.cpu != host.machine.cpu || device.machine.cpu_threads != host.machine.cpu_threads {
        return Err(ProfilerError::Input(format!(
            "the host profile `{}` was measured on {} ({} threads), the device profile `{}` on {} ({} threads): \
             combine two profiles of the same machine",
            host.machine.name,
            host.machine.cpu,
            host.machine.cpu_threads,
            device.machine.name,
            device.machine.cpu,
            device.machine.cpu_threads
        )));
    }
    let mut p = device.clone();
    p.dram.clone_from(&host.dram);
    p.cpu.clone_from(&host.cpu);
    p.host_route_ns_per_token = host.host_route_ns_per_token;
    p.notes.push(format!(
        "combined: DRAM and CPU rows and the host's routing cost from `{}` ({}); everything else from `{}` ({})",
        host.machine.name,
        provenance_line(&host.provenance),
        device.machine.name,
        provenance_line(&device.provenance)
    ));
    p.provenance = Provenance::Measured { command, commit, date };
    Ok(p)
}

/// Measures this machine.
pub fn measure(cfg: &Config, progress: &dyn Progress) -> Result<Profile> {
    let started = Instant::now();
    let max_threads = machine::cpu_threads();
    let threads = if cfg.threads.is_empty() { default_threads(max_threads) } else { cfg.threads.clone() };
    if let Some(&t) = threads.iter().find(|&&t| t == 0) {
        return Err(ProfilerError::Input(format!("thread count {t}: every thread count must be ≥ 1")));
    }
    let mut figures = Figures::default();
    let mut notes = vec![
        "quantised matmuls (q8_0/q4_0/q2_k/q3_k/q4_k/q6_k rows) are exec's own kernels: a dequantising GEMV up to 8 tokens, \
         dequantise-to-bf16 + cuBLAS (GPU) or the bf16 kernel (CPU) above; formats without rows borrow the bf16 \
         rows' efficiency in the cost model"
            .into(),
        "routed experts: a GPU `experts` row is exec's whole sequence for one expert (gather, gate|up, \
         SwiGLU, down, scatter-add: five launches, six quantised above 8 tokens), a CPU row exec's expert \
         block (on a machine with a GPU as the executor runs it there: on the pool while the host thread polls \
         for its end); a GPU `experts_grouped` row (any format but q2_k/q3_k) is exec's two grouped launches over \
         `tokens` experts of one token each (a layer's pinned experts in a step of at most 8 tokens), each \
         expert's weights another unit of the rotating buffer; a GPU `experts_tiled` row is one expert's share \
         of exec's tiled launches over a group of 1024 / m experts of m tokens on average (a larger step's \
         pinned experts)"
            .into(),
        "CPU norm, RoPE and activation kernels run on the calling thread: their rows carry threads = 1".into(),
    ];
    let cpu_threads = *threads.iter().max().expect("at least one thread count");
    // The GPU machine's host is shared; a disturbed stretch slowed CPU rows by up to 1.7× in one run
    // (results/validation/2026-12-01-nvidia-h200, run21). The same quick probe at the start and at the end
    // shows whether the host held still: the profile's DRAM rows (medians of 1 GiB reads) against the probe's
    // best of three read 10–20 % apart on a lease whose cells then held (session 21).
    let dram_probe_gbps = || -> Result<f64> {
        let pool = pipeshard_exec::cpu::CpuPool::new(cpu_threads as usize)?;
        Ok(cpu::DramProbe::default().gbps(&pool))
    };
    let start_gbps = dram_probe_gbps()?;
    let mut profile = match &cfg.gpu_from {
        Some(base) if cfg.host_only => {
            let p = gpu::measure_all(
                cfg.mode,
                &threads,
                Some(&base.gpu.ops),
                cfg.gpu_experts,
                &mut figures,
                &mut notes,
                progress,
            )?;
            if !base.machine.gpu.starts_with(p.machine.gpu.split(',').next().unwrap_or_default()) {
                return Err(ProfilerError::Input(format!(
                    "--gpu-from profile `{}` was measured on {}, this GPU is {}: its op rows would not hold here; \
                     measure the whole profile instead",
                    base.machine.name, base.machine.gpu, p.machine.gpu
                )));
            }
            notes.push(format!(
                "host-only run: GPU op rows (GEMM, attention, elementwise{}) are those of the base profile `{}` \
                 ({}); PCIe, launch, sync, interference, DRAM and CPU{} measured by this run",
                if cfg.gpu_experts { "" } else { ", routed experts" },
                base.machine.name,
                provenance_line(&base.provenance),
                if cfg.gpu_experts { ", the GPU's routed-expert rows" } else { "" }
            ));
            p
        }
        Some(base) => {
            notes.push(format!(
                "CPU-only run: GPU, PCIe, launch and host-sync figures are those of the base profile `{}` ({}); DRAM \
                 and CPU rows under DMA were not measured (no device) and equal the rows alone",
                base.machine.name,
                provenance_line(&base.provenance)
            ));
            let cpu = cpu::measure(cfg.mode, &threads, None, &mut figures, progress)?;
            let mut p = base.clone();
            if cfg.gpu_decode_attention {
                let rows = gpu::measure_decode_attention(cfg.mode, progress)?;
                p.gpu
                    .ops
                    .retain(|r| !matches!(r.op, OpClass::AttentionDecode | OpClass::AttentionDecodeUnified));
                p.gpu.ops.extend(rows);
                notes.push("GPU batched decode attention rows measured by this run, on this machine".into());
            }
            p.dram = cpu.dram;
            p.cpu = cpu.device;
            p.host_route_ns_per_token = cpu.route_ns_per_token;
            // The expert rows time whole expert blocks: a derived base's fitted per-expert cost would count
            // it twice.
            p.cpu_expert_ns = 0;
            p.machine.gpu = format!("{} (from profile {})", base.machine.gpu, base.machine.name);
            p
        }
        None => gpu::measure_all(cfg.mode, &threads, None, false, &mut figures, &mut notes, progress)?,
    };
    profile.schema_version = PROFILE_SCHEMA_VERSION;
    profile.machine = Machine {
        name: cfg.name.clone(),
        gpu: profile.machine.gpu.clone(),
        gpu_vram_bytes: profile.machine.gpu_vram_bytes,
        cpu: machine::cpu_model(),
        cpu_threads,
        host_ram_bytes: machine::host_ram_bytes(),
        pcie: profile.machine.pcie.clone(),
    };
    profile.provenance = Provenance::Measured {
        command: cfg.command.clone(),
        commit: cfg.commit.clone(),
        date: cfg.date.clone(),
    };
    let end_gbps = dram_probe_gbps()?;
    for (when, gbps) in [("start", start_gbps), ("end", end_gbps)] {
        figures.add(
            &format!("host DRAM read at the {when} of the run ({cpu_threads} threads, 256 MiB, best of 3)"),
            "GB/s",
            Stat { median: gbps, spread: 0.0, samples: 3 },
        );
    }
    if (end_gbps / start_gbps - 1.0).abs() > 0.1 {
        notes.push(format!(
            "the host read DRAM at {start_gbps:.1} GB/s at the start and {end_gbps:.1} at the end: it was \
             disturbed during the run, so CPU rows may be off; measure again"
        ));
    }
    figures.add(
        "profiler wall time",
        "s",
        Stat { median: started.elapsed().as_secs_f64(), spread: 0.0, samples: 1 },
    );
    profile.measurements = figures.0;
    profile.notes = notes;
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_takes_the_host_rows_of_one_profile_and_the_rest_of_the_other() {
        let device = pipeshard_core::reference::derived("cli3").unwrap();
        let mut host = device.clone();
        host.dram.iter_mut().for_each(|d| d.gbps *= 1.5);
        host.cpu.ops.iter_mut().for_each(|r| r.time_ns /= 2);
        host.host_route_ns_per_token += 7;
        host.launch_ns += 1000;
        let p = combine(&device, &host, "cmd".into(), "abc".into(), "2026-12-02".into()).unwrap();
        assert_eq!((p.dram.clone(), p.cpu.clone()), (host.dram.clone(), host.cpu.clone()));
        assert_eq!(p.host_route_ns_per_token, host.host_route_ns_per_token);
        // The device side stays: GPU rows, PCIe, launches.
        assert_eq!(
            (p.gpu.clone(), p.pcie.clone(), p.launch_ns),
            (device.gpu.clone(), device.pcie.clone(), device.launch_ns)
        );
        assert!(matches!(p.provenance, Provenance::Measured { ref command, .. } if command == "cmd"));
        assert!(p.notes.last().unwrap().starts_with("combined: DRAM and CPU rows"));
        // Another CPU's rows are refused.
        host.machine.cpu = "another CPU".into();
        let err = combine(&device, &host, String::new(), String::new(), String::new()).unwrap_err();
        assert!(err.to_string().contains("combine two profiles of the same machine"), "{err}");
    }
}
