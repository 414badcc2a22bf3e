//! The `Profile`: what a machine can do, measured by `pipeshard profile` or derived from published figures.
//!
//! A profile holds the PCIe link (H2D and D2H by transfer size, pinned and pageable, and both directions at
//! once), host DRAM bandwidth by thread count (alone and while DMA runs), per-op throughput tables for the GPU
//! and the CPU (alone and under concurrent DMA), launch and host-sync latencies, and the VRAM the runtime takes
//! before any weight (CUDA context, cuBLAS workspace). The schema is versioned: readers reject other versions
//! with a message naming the file, the version found and the one expected.
//!
//! Version 2 (this build) adds what a measured profile records beyond version 1: the spread of every measured
//! point (`spread`: interquartile range over the median), the H2D bandwidth while the GPU computes, a list of
//! scalar `measurements` (each with its spread and sample count) and free-text `notes`. Every addition is
//! optional, so version-1 files load unchanged (read as version 2 with the additions absent).

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::workload::OpClass;

/// The schema version this build reads and writes.
pub const PROFILE_SCHEMA_VERSION: u32 = 2;

/// Older schema versions this build still reads (their files lack only optional fields).
pub const PROFILE_SCHEMA_READABLE: [u32; 2] = [1, 2];

/// Where a profile's numbers come from.
// A profile is loaded once per command: the fit's fifteen parameters inline cost nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum Provenance {
    /// Measured by `pipeshard profile` on the machine itself.
    Measured { command: String, commit: String, date: String },
    /// Derived from published figures and datasheets; `calibration` says how, `fit` (if calibrated) how the
    /// free parameters were fitted.
    Derived {
        sources: Vec<String>,
        calibration: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fit: Option<Fit>,
    },
}

/// How a derived profile's free parameters were fitted to published results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub parameters: crate::reference::Efficiencies,
    /// The cells fitted on (never the held-out ones).
    pub calibration_set: String,
    /// The objective and its value before and after.
    pub objective: String,
    pub command: String,
    pub commit: String,
    pub date_utc: String,
}

/// What the machine is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub name: String,
    pub gpu: String,
    pub gpu_vram_bytes: u64,
    pub cpu: String,
    /// CPU threads the profile's CPU rows assume unless a row says otherwise.
    pub cpu_threads: u32,
    pub host_ram_bytes: u64,
    pub pcie: String,
}

/// Bandwidth at one transfer size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BwPoint {
    pub bytes: u64,
    pub gbps: f64,
    /// Relative spread of the measurement (interquartile range / median); `None` for derived points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<f64>,
}

/// The host↔device link. Curves are sorted by `bytes`; between points bandwidth is interpolated in log size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PcieProfile {
    pub h2d_pinned: Vec<BwPoint>,
    pub d2h_pinned: Vec<BwPoint>,
    /// From pageable host memory: measured profiles time runs of back-to-back copies of each size, as the
    /// executor stages units (`ngl`), the host's copy into the driver's buffers overlapping the previous DMA.
    pub h2d_pageable: Vec<BwPoint>,
    pub d2h_pageable: Vec<BwPoint>,
    /// Aggregate GB/s with H2D and D2H running at once.
    pub bidirectional_gbps: f64,
    /// Fixed cost of issuing one copy (driver call + DMA setup).
    pub copy_latency_ns: u64,
    /// Pinned H2D GB/s (large copies) while the GPU computes on another stream (`None`: not measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub h2d_under_compute_gbps: Option<f64>,
    /// Large H2D copies' time while every CPU thread reads host DRAM, over their time alone (≥ 1; `None`: not
    /// measured), from pinned and from pageable memory: the DMA reads the DRAM the CPU pool streams weights
    /// from (validation, session 21: the executor's streamed copies ran at 0.91–0.94 of the pinned curve
    /// beside its CPU experts, 0.97–0.98 without).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub h2d_pinned_cpu_slowdown: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub h2d_pageable_cpu_slowdown: Option<f64>,
}

/// DRAM read bandwidth at a thread count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DramPoint {
    pub threads: u32,
    pub gbps: f64,
    /// The same while a pinned H2D copy streams from host memory.
    pub gbps_under_dma: f64,
    /// Relative spread of `gbps` (interquartile range / median); `None` for derived points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<f64>,
}

/// One measured op timing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRow {
    pub op: OpClass,
    pub dtype: DType,
    /// Output features (matmul rows; attention: query heads × head_dim).
    pub n: u64,
    /// Input features (matmul; attention: keys attended).
    pub k: u64,
    pub tokens: u64,
    /// CPU threads (0 on the GPU).
    pub threads: u32,
    /// Time with no concurrent DMA.
    pub time_ns: u64,
    /// Time while a copy runs on the link (`None`: not measured).
    pub time_ns_under_dma: Option<u64>,
    /// Relative spread of `time_ns` (interquartile range / median); `None` for derived rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<f64>,
    /// Attention rows: the KV heads the `n / 128` query heads share (grouped-query attention sets how many
    /// KV bytes a query head reads). `None` (older profiles, derived rows): 4 query heads per KV head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u32>,
}

impl OpRow {
    /// A GPU row of `time_ns` for `tokens` through an `n × k` shape, without a DMA figure, spread or KV heads.
    #[must_use]
    pub fn gpu(op: OpClass, dtype: DType, (n, k): (u64, u64), tokens: u64, time_ns: u64) -> OpRow {
        OpRow {
            op,
            dtype,
            n,
            k,
            tokens,
            threads: 0,
            time_ns,
            time_ns_under_dma: None,
            spread: None,
            kv_heads: None,
        }
    }
}

/// One scalar measurement a profile keeps beside its tables (slowdowns, latencies, section timings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    pub name: String,
    pub value: f64,
    pub unit: String,
    /// Relative spread (interquartile range / median) over `samples` samples.
    pub spread: f64,
    pub samples: u32,
}

/// Peak rates of one device: the roofline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    /// Peak dense matmul FLOP/s by weight format (formats not listed use `default_flops`).
    pub matmul_flops: Vec<(DType, f64)>,
    pub default_flops: f64,
    /// Memory bandwidth in GB/s (GPU: device memory; CPU: DRAM at `Machine::cpu_threads`).
    pub mem_gbps: f64,
}

impl Roofline {
    /// Peak FLOP/s for a weight format.
    #[must_use]
    pub fn flops(&self, dtype: DType) -> f64 {
        self.matmul_flops.iter().find(|(d, _)| *d == dtype).map_or(self.default_flops, |(_, f)| *f)
    }
}

/// A device's rates and measured op table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    pub roofline: Roofline,
    pub ops: Vec<OpRow>,
    /// Slowdown factor (≥ 1) of memory-bound ops while DMA runs, where rows have no `time_ns_under_dma`.
    pub dma_slowdown: f64,
}

/// A machine profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub schema_version: u32,
    pub machine: Machine,
    pub provenance: Provenance,
    pub pcie: PcieProfile,
    pub dram: Vec<DramPoint>,
    pub gpu: DeviceProfile,
    pub cpu: DeviceProfile,
    /// Cost of one kernel launch on the GPU stream.
    pub launch_ns: u64,
    /// Cost of one kernel replayed from a CUDA graph (llama.cpp's runtimes replay a decode step's kernels when
    /// the whole step is one GPU split of one token): the device's per-kernel floor, with no host launch.
    /// 0 (measured profiles: our executor launches eagerly) reads as [`Profile::launch_ns`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub graph_kernel_ns: u64,
    /// Cost of a host↔device synchronisation (event wait + wake-up) at a CPU↔GPU hand-off.
    pub host_sync_ns: u64,
    /// Whether the runtime's GPU expert kernels read the routing (expert ids) on the device, as llama.cpp's CUDA
    /// `mul_mat_id` kernels do, so GPU experts start right after a GPU router with no host round trip. Our
    /// executor routes on the host (false, the default); the derived profiles of the paper's systems say true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expert_ids_on_device: bool,
    /// Whether the runtime computes a one-token step's q|k|v, and gate|up, as one GEMM each over the
    /// matrices' back-to-back rows (our executor, measured profiles: true), rather than one GEMM a matrix
    /// (llama.cpp, the derived profiles: false, the default). See [`crate::workload::fuse_one_token_projections`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub one_token_projections_fused: bool,
    /// Whether the runtime folds a one-token GPU attention or FFN unit's input norm into its (merged) first
    /// projection, and the FFN's activation into gate|up, for matrices in the activation type (our executor's
    /// decode GEMV, measured profiles: true; false, the default, prices them as kernels of their own). See
    /// [`crate::workload::fuse_one_token_projections`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub one_token_norm_act_fused: bool,
    /// Fixed CPU cost of one touched routed expert, beyond its bytes: ggml's `mul_mat_id` runs each touched
    /// expert as a small product of its own (rows split over the threads, a barrier after), which the matmul
    /// rows of large shapes do not show. Derived profiles fit it; measured ones time whole expert blocks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_expert_ns: u64,
    /// Host time our executor spends routing one token of a prefill chunk (1024 tokens, 128 experts, top 8:
    /// `Routing::from_logits` on the profile's most threads, then the per-expert token lists), between the
    /// routing sync and the first expert; scaled by the router's expert count. 0: not measured (older
    /// profiles, derived ones), and no routing work is priced.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_route_ns_per_token: u64,
    /// Our executor's routing round trip in a one-token decode step of a MoE layer whose router runs on the GPU,
    /// from the router's kernels' end to the first CPU expert's start: the logits and the normed input copied
    /// down on the compute stream, the host's sync with the pool's workers polling, the routing and the pool's
    /// start (qwen3-30b-a3b's router, 16 threads on the H200 machine). 0: not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_routing_to_cpu_ns: u64,
    /// The same round trip to the first GPU expert's start: the logits copied down, the sync, the routing, the
    /// token lists copied up. 0: not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_routing_to_gpu_ns: u64,
    /// Our executor's return from a one-token decode step's CPU experts to the GPU, from the pool's last
    /// expert's end to the device starting the experts' sum: the host thread's wake from its polling, the sum
    /// written into mapped page-locked memory, the gate (a host flag the compute stream waits at) opened and
    /// seen by the device, as `Exec::moe_layer` returns where it pre-enqueued the next layer (qwen3-30b-a3b's
    /// hidden size). 0: not measured, and the hand-off is priced as a sync and a copy.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_experts_return_ns: u64,
    /// [`Self::decode_routing_to_cpu_ns`] while pinned H2D copies stream: the device's reads of host memory
    /// (the gate, mapped inputs) and its launches' fetches queue behind the copy's on the link (validation,
    /// session 22: decode layers beside a streamed unit's copy). 0: not measured, and the idle figure holds.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_routing_to_cpu_beside_h2d_ns: u64,
    /// [`Self::decode_routing_to_gpu_ns`] while pinned H2D copies stream. 0: not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_routing_to_gpu_beside_h2d_ns: u64,
    /// [`Self::decode_experts_return_ns`] while pinned H2D copies stream, plus what the sum's add, which
    /// reads the sum from mapped memory, takes beyond its idle device time then (the simulator prices the
    /// add at its idle row). 0: not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_experts_return_beside_h2d_ns: u64,
    /// Host time our executor spends on each streamed unit beyond its kernels' launches: the ring's copy
    /// issue (the H2D stream's wait for the slot's release, the copy between two timing events, its
    /// completion event), the compute stream's wait for it, the unit's own timing span and the slot's
    /// release (exec's `RingSlot`, timed by the profiler's `RingIssueProbe` behind a held compute stream).
    /// The host thread does this unit after unit, so where it exceeds the copy (q4_0 experts on the H200
    /// machine) the host, not PCIe, paces a layer's streamed experts. 0: not measured, and not priced.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ring_copy_issue_ns: u64,
    /// Copy-engine time each ring copy of our executor takes beyond the PCIe curve's copy: the H2D stream's
    /// wait for the slot's release and the events around the copy (exec's `RingSlot`), measured as a run of
    /// ring-issued 4 MiB copies against the same copies back to back (the profiler's `RingIssueProbe`). On the
    /// H200 machine ≈ 3 µs a copy at 2.65, 4 and 12.7 MB alike (crates/exec/examples/h2d_sources.rs, session
    /// 23), 6 % of a streamed q4_0 expert's copy. 0: not measured, and not priced.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ring_copy_gap_ns: u64,
    /// VRAM the runtime holds before any weight: CUDA context, cuBLAS handle and workspace.
    pub runtime_overhead_bytes: u64,
    /// VRAM the driver takes to map page-locked host memory into the GPU's address space, per GiB locked:
    /// the executor page-locks every weight buffer, so a model's host copy costs VRAM too (2 MiB per GiB,
    /// 8 bytes per 4 KiB page, on the H200: 120 MB for qwen3-30b-a3b in bf16). 0 where not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub page_table_bytes_per_locked_gib: u64,
    /// Scalar measurements beside the tables (schema 2; empty for derived profiles).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measurements: Vec<Measurement>,
    /// What a reader should know about how the numbers were taken (schema 2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// A profile that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    #[error("{file}: cannot read: {reason}")]
    Io { file: String, reason: String },
    #[error("{file}: not a valid profile: {reason}")]
    Json { file: String, reason: String },
    #[error(
        "{file}: schema_version {found}, this build reads 1 to {expected}: re-run `pipeshard profile measure` or convert the file"
    )]
    Version { file: String, found: u32, expected: u32 },
    #[error("{file}: `{field}` {problem}")]
    Invalid { file: String, field: String, problem: String },
}

impl Profile {
    /// Parses and checks a profile; `file` names the source in errors.
    pub fn from_json(file: &str, json: &str) -> Result<Profile, ProfileError> {
        #[derive(Deserialize)]
        struct Version {
            schema_version: u32,
        }
        let v: Version = serde_json::from_str(json)
            .map_err(|e| ProfileError::Json { file: file.into(), reason: e.to_string() })?;
        if !PROFILE_SCHEMA_READABLE.contains(&v.schema_version) {
            return Err(ProfileError::Version {
                file: file.into(),
                found: v.schema_version,
                expected: PROFILE_SCHEMA_VERSION,
            });
        }
        let mut p: Profile = serde_json::from_str(json)
            .map_err(|e| ProfileError::Json { file: file.into(), reason: e.to_string() })?;
        // Older versions differ only by absent optional fields: read them as the current version.
        p.schema_version = PROFILE_SCHEMA_VERSION;
        p.validate(file)?;
        Ok(p)
    }

    /// Reads a profile from disk.
    pub fn load(path: &std::path::Path) -> Result<Profile, ProfileError> {
        let file = path.display().to_string();
        let json = std::fs::read_to_string(path)
            .map_err(|e| ProfileError::Io { file: file.clone(), reason: e.to_string() })?;
        Profile::from_json(&file, &json)
    }

    /// Serialises with stable formatting.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("profiles serialise")
    }

    fn validate(&self, file: &str) -> Result<(), ProfileError> {
        let bad = |field: &str, problem: String| {
            Err(ProfileError::Invalid { file: file.into(), field: field.into(), problem })
        };
        for (name, curve) in [
            ("pcie.h2d_pinned", &self.pcie.h2d_pinned),
            ("pcie.d2h_pinned", &self.pcie.d2h_pinned),
            ("pcie.h2d_pageable", &self.pcie.h2d_pageable),
            ("pcie.d2h_pageable", &self.pcie.d2h_pageable),
        ] {
            if curve.is_empty() {
                return bad(name, "is empty; it needs at least one {bytes, gbps} point".into());
            }
            if let Some(p) = curve.iter().find(|p| !(p.gbps.is_finite() && p.gbps > 0.0) || p.bytes == 0) {
                return bad(
                    name,
                    format!(
                        "has a point {} bytes at {} GB/s; sizes and rates must be positive",
                        p.bytes, p.gbps
                    ),
                );
            }
            if curve.windows(2).any(|w| w[0].bytes >= w[1].bytes) {
                return bad(name, "must be sorted by increasing bytes".into());
            }
        }
        for (name, slowdown) in [
            ("pcie.h2d_pinned_cpu_slowdown", self.pcie.h2d_pinned_cpu_slowdown),
            ("pcie.h2d_pageable_cpu_slowdown", self.pcie.h2d_pageable_cpu_slowdown),
        ] {
            if let Some(x) = slowdown.filter(|x| !(x.is_finite() && *x >= 1.0)) {
                return bad(name, format!("is {x}; it must be ≥ 1 (or left out where not measured)"));
            }
        }
        if self.dram.is_empty()
            || self.dram.iter().any(|d| d.threads == 0 || !(d.gbps > 0.0 && d.gbps_under_dma > 0.0))
        {
            return bad("dram", "needs points with threads ≥ 1 and positive gbps / gbps_under_dma".into());
        }
        for (name, dev) in [("gpu", &self.gpu), ("cpu", &self.cpu)] {
            let r = &dev.roofline;
            let positive = |x: f64| x.is_finite() && x > 0.0;
            if !positive(r.default_flops)
                || !positive(r.mem_gbps)
                || r.matmul_flops.iter().any(|(_, f)| !positive(*f))
            {
                return bad(&format!("{name}.roofline"), "needs positive FLOP/s and mem_gbps".into());
            }
            if dev.dma_slowdown.is_nan() || dev.dma_slowdown < 1.0 {
                return bad(
                    &format!("{name}.dma_slowdown"),
                    format!("is {}; it must be ≥ 1", dev.dma_slowdown),
                );
            }
            if let Some(row) = dev.ops.iter().find(|o| o.time_ns == 0 || o.tokens == 0) {
                return bad(&format!("{name}.ops"), format!("has a row with zero time or tokens: {row:?}"));
            }
        }
        if let Some(m) = self.measurements.iter().find(|m| !m.value.is_finite() || !m.spread.is_finite()) {
            return bad(
                "measurements",
                format!("`{}` is not a finite number ({} ± {})", m.name, m.value, m.spread),
            );
        }
        if self.machine.cpu_threads == 0 {
            return bad("machine.cpu_threads", "is 0; it must be ≥ 1".into());
        }
        Ok(())
    }

    /// Pinned H2D bandwidth for a transfer of `bytes`, in bytes per nanosecond (= GB/s).
    #[must_use]
    pub fn h2d_gbps(&self, bytes: u64, pinned: bool) -> f64 {
        interp_bw(if pinned { &self.pcie.h2d_pinned } else { &self.pcie.h2d_pageable }, bytes)
    }

    /// D2H bandwidth for a transfer of `bytes`.
    #[must_use]
    pub fn d2h_gbps(&self, bytes: u64, pinned: bool) -> f64 {
        interp_bw(if pinned { &self.pcie.d2h_pinned } else { &self.pcie.d2h_pageable }, bytes)
    }

    /// DRAM read bandwidth with `threads` threads (linear between measured counts, clamped at the ends).
    #[must_use]
    pub fn dram_gbps(&self, threads: u32, under_dma: bool) -> f64 {
        let pick = |d: &DramPoint| if under_dma { d.gbps_under_dma } else { d.gbps };
        let mut pts: Vec<&DramPoint> = self.dram.iter().collect();
        pts.sort_by_key(|d| d.threads);
        let t = f64::from(threads);
        match pts.iter().position(|d| d.threads >= threads) {
            Some(0) => pick(pts[0]) * (t / f64::from(pts[0].threads)).min(1.0),
            Some(i) => {
                let (a, b) = (pts[i - 1], pts[i]);
                let f = (t - f64::from(a.threads)) / f64::from(b.threads - a.threads);
                pick(a) + f * (pick(b) - pick(a))
            }
            None => pick(pts[pts.len() - 1]),
        }
    }
}

impl Profile {
    /// What a run on the GPU named `gpu` with `threads` CPU threads should be told before it is costed with
    /// this profile: a GPU other than the one measured (its costs are then that GPU's), or a thread count the
    /// CPU rows were not measured at (DRAM bandwidth is then interpolated linearly between the measured counts
    /// or held beyond them, and op efficiencies come from the nearest measured count). Empty when they match.
    #[must_use]
    pub fn mismatch_warnings(&self, gpu: Option<&str>, threads: u32) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(g) = gpu.filter(|g| !self.machine.gpu.contains(g)) {
            out.push(format!(
                "measured on {} ({}) but the run uses {g}: GPU and PCIe costs are that machine's; measure this \
                 one with `pipeshard profile measure`",
                self.machine.gpu, self.machine.name
            ));
        }
        let mut counts: Vec<u32> = self.cpu.ops.iter().map(|r| r.threads).collect();
        if counts.is_empty() {
            counts = self.dram.iter().map(|d| d.threads).collect();
        }
        counts.sort_unstable();
        counts.dedup();
        let (Some(&lo), Some(&hi)) = (counts.first(), counts.last()) else { return out };
        if counts.contains(&threads) {
            return out;
        }
        let listed = counts.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        let how = if threads > hi {
            format!("extrapolated from {hi} threads (DRAM bandwidth held at {hi} threads')")
        } else if threads < lo {
            format!("scaled down from {lo} threads")
        } else {
            let below = counts.iter().rev().find(|&&c| c < threads).copied().unwrap_or(lo);
            let above = counts.iter().find(|&&c| c > threads).copied().unwrap_or(hi);
            format!("interpolated between {below} and {above} threads")
        };
        out.push(format!(
            "CPU rows measured at {listed} threads, the run uses {threads}: CPU costs are {how}; for exact \
             costs measure with `pipeshard profile measure --threads {threads}` or run with a measured count"
        ));
        out
    }
}

/// Bandwidth at `bytes`, linear in log(size) between points and clamped at the ends.
fn interp_bw(curve: &[BwPoint], bytes: u64) -> f64 {
    let x = (bytes.max(1) as f64).ln();
    match curve.iter().position(|p| p.bytes >= bytes) {
        Some(0) => curve[0].gbps,
        Some(i) => {
            let (a, b) = (curve[i - 1], curve[i]);
            let (xa, xb) = ((a.bytes as f64).ln(), (b.bytes as f64).ln());
            a.gbps + (x - xa) / (xb - xa) * (b.gbps - a.gbps)
        }
        None => curve[curve.len() - 1].gbps,
    }
}

#[cfg(test)]
mod tests {
    use crate::reference::derived;

    /// A profile used on another GPU or at a thread count it was not measured at says so, and says how the
    /// costs are obtained; a matching one says nothing.
    #[test]
    fn mismatched_machines_and_thread_counts_are_reported() {
        let mut p = derived("cli3").unwrap();
        p.machine.gpu = "NVIDIA H200, driver 580".into();
        for (i, t) in [1u32, 2, 4, 8, 16].into_iter().enumerate() {
            let n = p.cpu.ops.len();
            p.cpu.ops[i % n].threads = t;
        }
        assert!(p.mismatch_warnings(Some("NVIDIA H200"), 8).is_empty());
        let w = p.mismatch_warnings(Some("NVIDIA GeForce RTX 4090"), 16);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("NVIDIA H200, driver 580") && w[0].contains("RTX 4090"), "{}", w[0]);
        let w = p.mismatch_warnings(None, 6);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("interpolated between 4 and 8") && w[0].contains("uses 6"), "{}", w[0]);
        assert!(p.mismatch_warnings(None, 32)[0].contains("extrapolated from 16"));
        assert_eq!(p.mismatch_warnings(Some("NVIDIA H200"), 0).len(), 1);
    }
}
