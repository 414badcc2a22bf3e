//! Reference profiles of the paper's client systems (cli1–cli3, DIGEST §5.1), derived from published figures.
//!
//! No one can measure these machines from here, so their profiles are built from the poster's system table
//! (GPU, VRAM, cores, DRAM theoretical bandwidth, measured PCIe) and vendor datasheets (GPU memory bandwidth
//! and dense tensor FLOP/s). Achieved fractions of those peaks — the op rows — are *assumptions* stated in
//! [`Efficiencies`] and in each profile's `calibration` string, to be replaced by fitting to the paper's tables
//! (the paper-reproduction issue) or by measurement. `pipeshard profile derive --system NAME` writes them to
//! `profiles/NAME.json`; a test keeps the committed files equal to this code.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::profile::{
    BwPoint, DeviceProfile, DramPoint, Machine, OpRow, PROFILE_SCHEMA_VERSION, PcieProfile, Profile,
    Provenance, Roofline,
};
use crate::workload::OpClass;
use crate::{GIB, MIB};

/// Published figures of one system.
struct System {
    name: &'static str,
    gpu: &'static str,
    vram_gib: u64,
    gpu_mem_gbps: f64,
    /// Dense f16/bf16 tensor FLOP/s with f32 accumulation.
    gpu_f16_flops: f64,
    cpu: &'static str,
    cores: u32,
    ram_gib: u64,
    dram_theoretical_gbps: f64,
    pcie: &'static str,
    pcie_measured_gbps: f64,
    sources: &'static [&'static str],
}

const POSTER: &str = "MLSys'26 poster, 'Client systems' table (via shared/paper/DIGEST.md §5.1)";

const SYSTEMS: [System; 3] = [
    System {
        name: "cli1",
        gpu: "NVIDIA RTX 3500 Ada Generation Laptop GPU",
        vram_gib: 12,
        gpu_mem_gbps: 432.0,
        gpu_f16_flops: 60.0e12,
        cpu: "Intel Core Ultra 7 (16 cores)",
        cores: 16,
        ram_gib: 64,
        dram_theoretical_gbps: 119.5,
        pcie: "PCIe Gen4 x8 (13 GB/s measured, 16 peak)",
        pcie_measured_gbps: 13.0,
        sources: &[
            POSTER,
            "NVIDIA RTX 3500 Ada laptop datasheet: 432 GB/s GDDR6, ~60 TFLOP/s dense FP16 tensor (f32 accumulate)",
        ],
    },
    System {
        name: "cli2",
        gpu: "NVIDIA GeForce RTX 5070 Ti",
        vram_gib: 16,
        gpu_mem_gbps: 896.0,
        gpu_f16_flops: 87.9e12,
        cpu: "AMD Ryzen 7 (8 cores)",
        cores: 8,
        ram_gib: 128,
        dram_theoretical_gbps: 57.6,
        pcie: "PCIe Gen5 x16 (50 GB/s measured, 64 peak)",
        pcie_measured_gbps: 50.0,
        sources: &[
            POSTER,
            "NVIDIA RTX 5070 Ti datasheet: 896 GB/s GDDR7, 87.9 TFLOP/s dense FP16 tensor (f32 accumulate)",
        ],
    },
    System {
        name: "cli3",
        gpu: "NVIDIA GeForce RTX 5090",
        vram_gib: 32,
        gpu_mem_gbps: 1792.0,
        gpu_f16_flops: 209.5e12,
        cpu: "AMD EPYC (16 cores)",
        cores: 16,
        ram_gib: 256,
        dram_theoretical_gbps: 153.6,
        pcie: "PCIe Gen5 x16 (50 GB/s measured, 64 peak)",
        pcie_measured_gbps: 50.0,
        sources: &[
            POSTER,
            "NVIDIA RTX 5090 datasheet: 1792 GB/s GDDR7, 209.5 TFLOP/s dense FP16 tensor (f32 accumulate)",
        ],
    },
];

/// The free parameters of a derived profile: assumed fractions of the published peaks, and the runtime's
/// fixed costs. Each is a single number so that calibration (`pipeshard repro calibrate`) can replace it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Efficiencies {
    /// GPU decode GEMV: fraction of memory bandwidth.
    pub gpu_gemv_bw: f64,
    /// GPU large GEMM: fraction of tensor peak.
    pub gpu_gemm_flops: f64,
    /// CPU GEMV: fraction of the achievable DRAM bandwidth.
    pub cpu_gemv_bw: f64,
    /// CPU GEMM: fraction of the SIMD FMA peak.
    pub cpu_gemm_flops: f64,
    /// Achievable fraction of theoretical DRAM bandwidth with all cores.
    pub dram_achievable: f64,
    /// DRAM bandwidth left to the CPU while a pinned H2D copy streams.
    pub dram_under_dma: f64,
    /// Fraction of the measured PCIe figure the runtime's weight copies achieve.
    pub pcie_achieved: f64,
    /// One CPU↔GPU hand-off (event wait + wake-up), microseconds.
    pub host_sync_us: f64,
    /// GPU flash attention in decode: fraction of its roofline (KV bytes at memory bandwidth). Older fits, which
    /// priced attention at the roofline, read as 1.
    #[serde(default = "one")]
    pub gpu_attn: f64,
    /// GPU flash attention over a prefill chunk: fraction of its roofline (FLOPs at tensor peak). Older fits
    /// read as 1.
    #[serde(default = "one")]
    pub gpu_attn_prefill: f64,
    /// CPU flash attention in decode: fraction of its roofline (KV bytes at achievable DRAM); a prefill chunk's
    /// CPU attention stays at its roofline. Older fits read as 1.
    #[serde(default = "one")]
    pub cpu_attn: f64,
    /// One GPU kernel launch (the runtime's per-op cost on the host, which short kernels cannot hide),
    /// microseconds. Older fits read as the 4 µs they assumed.
    #[serde(default = "four")]
    pub launch_us: f64,
    /// CPU attention without flash attention in decode (stock llama.cpp's `mul_mat` pair, KV re-read for each
    /// query head): fraction of the roofline of those reads at achievable DRAM. Older fits read as 1.
    #[serde(default = "one")]
    pub cpu_attn_materialized: f64,
    /// Fixed CPU cost of one touched routed expert beyond its bytes (ggml's `mul_mat_id` runs each as its own
    /// small product), microseconds. Older fits read as 0.
    #[serde(default)]
    pub cpu_expert_us: f64,
    /// Fraction of the measured PCIe figure that copies from pageable memory achieve (the driver stages them
    /// through a pinned buffer); stock llama.cpp's op offload copies from its mapped model file. Older fits read
    /// as the 30% they assumed.
    #[serde(default = "pageable_default")]
    pub pcie_pageable: f64,
    /// CPU routed experts: fraction of the CPU GEMM rate (`cpu_gemm_flops`) that ggml's `mul_mat_id` reaches
    /// when several tokens share an expert (it runs one quantised dot product per weight row and token, where a
    /// dense `mul_mat` takes the tiled GEMM). Older fits read as 1 (the dense rate).
    #[serde(default = "one")]
    pub cpu_expert_gemm: f64,
    /// One kernel of a decode step replayed from a CUDA graph (llama.cpp, when the whole step is one GPU
    /// split), microseconds: the device's per-kernel floor. Older fits read as the 3 µs assumed.
    #[serde(default = "three")]
    pub graph_kernel_us: f64,
}

fn one() -> f64 {
    1.0
}

fn four() -> f64 {
    4.0
}

fn three() -> f64 {
    3.0
}

fn pageable_default() -> f64 {
    0.3
}

impl Efficiencies {
    /// Names and values, in a fixed order (what calibration varies).
    #[must_use]
    pub fn values(&self) -> [(&'static str, f64); 17] {
        [
            ("gpu_gemv_bw", self.gpu_gemv_bw),
            ("gpu_gemm_flops", self.gpu_gemm_flops),
            ("cpu_gemv_bw", self.cpu_gemv_bw),
            ("cpu_gemm_flops", self.cpu_gemm_flops),
            ("dram_achievable", self.dram_achievable),
            ("dram_under_dma", self.dram_under_dma),
            ("pcie_achieved", self.pcie_achieved),
            ("host_sync_us", self.host_sync_us),
            ("gpu_attn", self.gpu_attn),
            ("gpu_attn_prefill", self.gpu_attn_prefill),
            ("cpu_attn", self.cpu_attn),
            ("launch_us", self.launch_us),
            ("cpu_attn_materialized", self.cpu_attn_materialized),
            ("cpu_expert_us", self.cpu_expert_us),
            ("pcie_pageable", self.pcie_pageable),
            ("cpu_expert_gemm", self.cpu_expert_gemm),
            ("graph_kernel_us", self.graph_kernel_us),
        ]
    }

    /// The same with the `i`-th of [`Efficiencies::values`] set to `v`.
    #[must_use]
    pub fn with(mut self, i: usize, v: f64) -> Efficiencies {
        let field = match i {
            0 => &mut self.gpu_gemv_bw,
            1 => &mut self.gpu_gemm_flops,
            2 => &mut self.cpu_gemv_bw,
            3 => &mut self.cpu_gemm_flops,
            4 => &mut self.dram_achievable,
            5 => &mut self.dram_under_dma,
            6 => &mut self.pcie_achieved,
            7 => &mut self.host_sync_us,
            8 => &mut self.gpu_attn,
            9 => &mut self.gpu_attn_prefill,
            10 => &mut self.cpu_attn,
            11 => &mut self.launch_us,
            12 => &mut self.cpu_attn_materialized,
            13 => &mut self.cpu_expert_us,
            14 => &mut self.pcie_pageable,
            15 => &mut self.cpu_expert_gemm,
            _ => &mut self.graph_kernel_us,
        };
        *field = v;
        self
    }

    /// Allowed range of the `i`-th parameter: fractions in (0, 1], the hand-off in 1–500 µs, a launch in 1–50 µs,
    /// a CPU expert's fixed cost in 0.5–500 µs, a replayed kernel in 0.5–50 µs.
    #[must_use]
    pub fn range(i: usize) -> (f64, f64) {
        match i {
            7 => (1.0, 500.0),
            11 => (1.0, 50.0),
            13 => (0.5, 500.0),
            16 => (0.5, 50.0),
            _ => (0.05, 1.0),
        }
    }
}

/// The assumptions behind every derived profile.
pub const DEFAULT_EFFICIENCIES: Efficiencies = Efficiencies {
    gpu_gemv_bw: 0.80,
    gpu_gemm_flops: 0.60,
    cpu_gemv_bw: 0.70,
    cpu_gemm_flops: 0.35,
    dram_achievable: 0.70,
    dram_under_dma: 0.85,
    pcie_achieved: 1.0,
    host_sync_us: 15.0,
    // The roofline, as profiles before the attention rows priced it.
    gpu_attn: 1.0,
    gpu_attn_prefill: 1.0,
    cpu_attn: 1.0,
    launch_us: 4.0,
    cpu_attn_materialized: 1.0,
    cpu_expert_us: 1.0,
    pcie_pageable: 0.3,
    cpu_expert_gemm: 1.0,
    graph_kernel_us: 3.0,
};

/// Names of the derived systems.
#[must_use]
pub fn systems() -> Vec<&'static str> {
    SYSTEMS.iter().map(|s| s.name).collect()
}

/// A derived op row: `t_ns` rounded up as the profiler rounds its medians, alone and (when given) under DMA.
fn derived_row(
    op: OpClass,
    dtype: DType,
    (n, k): (u64, u64),
    tokens: u64,
    threads: u32,
    t_ns: f64,
    t_ns_under_dma: Option<f64>,
) -> OpRow {
    OpRow {
        op,
        dtype,
        n,
        k,
        tokens,
        threads,
        time_ns: t_ns.ceil() as u64,
        time_ns_under_dma: t_ns_under_dma.map(|t| t.ceil() as u64),
        spread: None,
        kv_heads: None,
    }
}

/// The derived profile of `name` (cli1, cli2, cli3) under the default assumptions.
#[must_use]
pub fn derived(name: &str) -> Option<Profile> {
    derived_with(name, &DEFAULT_EFFICIENCIES)
}

/// The derived profile of `name` under the assumptions `e`; the provenance carries no fit (the caller that
/// fitted `e` records it).
#[must_use]
pub fn derived_with(name: &str, e: &Efficiencies) -> Option<Profile> {
    let s = SYSTEMS.iter().find(|s| s.name == name)?;
    let e = *e;
    let dram_gbps = s.dram_theoretical_gbps * e.dram_achievable;
    // Zen 4 / Lion Cove class cores: two 256-bit FMA pipes = 32 f32 FLOP/cycle at ~3.5 GHz sustained.
    let cpu_flops = f64::from(s.cores) * 32.0 * 3.5e9;
    let pcie = s.pcie_measured_gbps * e.pcie_achieved;
    // Small copies pay a fixed setup cost; the measured figure is reached from ~16 MiB on.
    let curve = |peak: f64| {
        vec![
            BwPoint { bytes: 64 << 10, gbps: peak * 0.35, spread: None },
            BwPoint { bytes: MIB, gbps: peak * 0.88, spread: None },
            BwPoint { bytes: 16 * MIB, gbps: peak, spread: None },
            BwPoint { bytes: GIB, gbps: peak, spread: None },
        ]
    };
    let pageable = curve(s.pcie_measured_gbps * e.pcie_pageable);
    let threads = s.cores;
    let dram = [1, threads / 4, threads / 2, threads]
        .into_iter()
        .filter(|&t| t >= 1)
        .map(|t| {
            // One core streams ~15 GB/s; bandwidth saturates at the achievable figure.
            let g = (15.0 * f64::from(t)).min(dram_gbps);
            DramPoint {
                threads: t,
                gbps: g,
                gbps_under_dma: g.min(dram_gbps * e.dram_under_dma),
                spread: None,
            }
        })
        .collect::<Vec<_>>();
    let mut dram = dram;
    dram.dedup_by_key(|d| d.threads);

    let mut gpu_ops = Vec::new();
    let mut cpu_ops = Vec::new();
    for dtype in [DType::F16, DType::Bf16, DType::Q4_0, DType::Q2K, DType::Q8_0] {
        let (n, k) = (4096u64, 4096u64);
        let wbytes = dtype.tensor_bytes(k, n).expect("4096 is block aligned") as f64;
        // Every power of two up to 64 tokens, where decode batches and a layer's tokens per expert fall: the cost
        // model interpolates efficiency in log tokens, and between a bandwidth-bound row and a compute-bound one
        // that would bend the roofline's corner into a slope.
        for tokens in [1u64, 2, 4, 8, 16, 32, 64, 512, 2048] {
            let flops = 2.0 * tokens as f64 * (n * k) as f64;
            let act = 4.0 * tokens as f64 * (n + k) as f64;
            let peak_gpu = s.gpu_f16_flops;
            let gpu_t = ((wbytes + act) / (s.gpu_mem_gbps * e.gpu_gemv_bw))
                .max(flops / (peak_gpu * e.gpu_gemm_flops) * 1e9);
            let cpu_t = ((wbytes + act) / (dram_gbps * e.cpu_gemv_bw))
                .max(flops / (cpu_flops * e.cpu_gemm_flops) * 1e9);
            gpu_ops.push(derived_row(OpClass::MatMul, dtype, (n, k), tokens, 0, gpu_t, None));
            let under_dma = Some(cpu_t / e.dram_under_dma);
            cpu_ops.push(derived_row(OpClass::MatMul, dtype, (n, k), tokens, threads, cpu_t, under_dma));
        }
    }
    // Routed experts on the CPU (one expert's gate, up and down, 1536 × 4096): ggml's `mul_mat_id` at
    // `cpu_expert_gemm` of the dense GEMM rate. Only q4_0's: the rate was fitted on its runs (Table 9), and
    // other formats' dot products differ in cost (a q2_K expert would turn compute-bound at one token, which
    // the paper's qwen3-235b-a22b decode does not show); they keep borrowing the dense matmul rows.
    {
        let dtype = DType::Q4_0;
        let (n, k) = (1536u64, 4096u64);
        let wbytes = 3.0 * dtype.tensor_bytes(k, n).expect("4096 is block aligned") as f64;
        for tokens in [1u64, 2, 4, 8, 16, 32, 64, 512, 2048] {
            let flops = 6.0 * tokens as f64 * (n * k) as f64;
            let act = 4.0 * tokens as f64 * (2 * k + 3 * n) as f64;
            let t = ((wbytes + act) / (dram_gbps * e.cpu_gemv_bw))
                .max(flops / (cpu_flops * e.cpu_gemm_flops * e.cpu_expert_gemm) * 1e9);
            let under_dma = Some(t / e.dram_under_dma);
            cpu_ops.push(derived_row(OpClass::Experts, dtype, (n, k), tokens, threads, t, under_dma));
        }
    }
    // Flash attention, in the row format the cost model reads (n = 32 query heads × 128, k = keys, 4 query heads
    // per KV head, f16 KV): its roofline divided by the kernel's efficiency, the same at every shape; one decode
    // query (memory-bound) and a prefill chunk (compute-bound) have their own.
    for tokens in [1u64, 1024] {
        let (n, keys) = (4096u64, 16384u64);
        let flops = 4.0 * tokens as f64 * (keys * n) as f64;
        let bytes = 8.0 * tokens as f64 * n as f64 + (keys * n) as f64;
        let gpu_eff = if tokens == 1 { e.gpu_attn } else { e.gpu_attn_prefill };
        let gpu_t = (bytes / s.gpu_mem_gbps).max(flops / s.gpu_f16_flops * 1e9) / gpu_eff;
        // A prefill chunk's CPU attention keeps its roofline: the paper's baseline runs it for its CPU layers, and
        // its TTFT (qwen3-30b-a3b 4K at 2G: 6.5 s for ≈ 5.7 TFLOP of attention) leaves no room for less.
        let cpu_eff = if tokens == 1 { e.cpu_attn } else { 1.0 };
        let cpu_t = (bytes / dram_gbps).max(flops / cpu_flops * 1e9) / cpu_eff;
        let row = |threads: u32, t: f64, t_dma: Option<f64>| {
            derived_row(OpClass::Attention, DType::F16, (n, keys), tokens, threads, t, t_dma)
        };
        gpu_ops.push(row(0, gpu_t, None));
        cpu_ops.push(row(threads, cpu_t, Some(cpu_t / e.dram_under_dma)));
    }
    // Decode attention without flash attention on the CPU: each query head streams its KV head again (4 query
    // heads per KV head in the row), at `cpu_attn_materialized` of that roofline.
    {
        let (n, keys) = (4096u64, 16384u64);
        let bytes = 8.0 * n as f64 + (keys * n) as f64 * 4.0;
        let t = bytes / dram_gbps / e.cpu_attn_materialized;
        let under_dma = Some(t / e.dram_under_dma);
        cpu_ops.push(derived_row(
            OpClass::AttentionMaterialized,
            DType::F16,
            (n, keys),
            1,
            threads,
            t,
            under_dma,
        ));
    }
    Some(Profile {
        schema_version: PROFILE_SCHEMA_VERSION,
        machine: Machine {
            name: s.name.into(),
            gpu: s.gpu.into(),
            gpu_vram_bytes: s.vram_gib * GIB,
            cpu: s.cpu.into(),
            cpu_threads: threads,
            host_ram_bytes: s.ram_gib * GIB,
            pcie: s.pcie.into(),
        },
        provenance: Provenance::Derived {
            sources: s.sources.iter().map(|x| (*x).to_string()).collect(),
            calibration: format!(
                "{}: op rows assume GPU GEMV at {:.0}% of memory bandwidth and GEMM at {:.0}% of tensor peak; \
                 CPU GEMV at {:.0}% of achievable DRAM ({:.0}% of theoretical) and GEMM at {:.0}% of {} cores × 32 FLOP/cycle × 3.5 GHz; \
                 DRAM keeps {:.0}% under DMA; pinned copies at {:.0}% of the measured PCIe figure, pageable at {:.0}%; \
                 a CPU↔GPU hand-off costs {:.1} µs, a kernel launch {:.1} µs and a kernel replayed from a CUDA graph \
                 {:.1} µs; flash attention at {:.0}% of its \
                 roofline on the GPU in decode, {:.0}% in prefill, {:.0}% on the CPU in decode (at the roofline in \
                 prefill), {:.0}% on the CPU without flash attention in decode (KV re-read per query head); a CPU \
                 routed expert costs {:.1} µs beyond its bytes and computes at {:.0}% of the CPU GEMM rate; GPU \
                 experts read the routing on the device (llama.cpp)",
                if e == DEFAULT_EFFICIENCIES { "uncalibrated" } else { "calibrated (see `fit`)" },
                e.gpu_gemv_bw * 100.0,
                e.gpu_gemm_flops * 100.0,
                e.cpu_gemv_bw * 100.0,
                e.dram_achievable * 100.0,
                e.cpu_gemm_flops * 100.0,
                s.cores,
                e.dram_under_dma * 100.0,
                e.pcie_achieved * 100.0,
                e.pcie_pageable * 100.0,
                e.host_sync_us,
                e.launch_us,
                e.graph_kernel_us,
                e.gpu_attn * 100.0,
                e.gpu_attn_prefill * 100.0,
                e.cpu_attn * 100.0,
                e.cpu_attn_materialized * 100.0,
                e.cpu_expert_us,
                e.cpu_expert_gemm * 100.0,
            ),
            fit: None,
        },
        pcie: PcieProfile {
            h2d_pinned: curve(pcie),
            d2h_pinned: curve(pcie),
            h2d_pageable: pageable.clone(),
            d2h_pageable: pageable,
            bidirectional_gbps: pcie * 1.8,
            copy_latency_ns: 8_000,
            h2d_under_compute_gbps: None,
            h2d_pinned_cpu_slowdown: None,
            h2d_pageable_cpu_slowdown: None,
        },
        dram,
        gpu: DeviceProfile {
            roofline: Roofline {
                matmul_flops: vec![],
                default_flops: s.gpu_f16_flops,
                mem_gbps: s.gpu_mem_gbps,
            },
            ops: gpu_ops,
            dma_slowdown: 1.07,
        },
        cpu: DeviceProfile {
            roofline: Roofline { matmul_flops: vec![], default_flops: cpu_flops, mem_gbps: dram_gbps },
            ops: cpu_ops,
            dma_slowdown: 1.0 / e.dram_under_dma,
        },
        launch_ns: (e.launch_us * 1e3).round() as u64,
        graph_kernel_ns: (e.graph_kernel_us * 1e3).round() as u64,
        host_sync_ns: (e.host_sync_us * 1e3).round() as u64,
        // The paper's runtime is llama.cpp, whose CUDA expert kernels take the expert ids on the device.
        expert_ids_on_device: true,
        // llama.cpp runs one GEMM a matrix.
        one_token_projections_fused: false,
        one_token_norm_act_fused: false,
        cpu_expert_ns: (e.cpu_expert_us * 1e3).round() as u64,
        host_route_ns_per_token: 0,
        decode_routing_to_cpu_ns: 0,
        decode_routing_to_gpu_ns: 0,
        decode_experts_return_ns: 0,
        decode_routing_to_cpu_beside_h2d_ns: 0,
        decode_routing_to_gpu_beside_h2d_ns: 0,
        decode_experts_return_beside_h2d_ns: 0,
        // Ours only: llama.cpp's runtimes are not priced by it.
        ring_copy_issue_ns: 0,
        ring_copy_gap_ns: 0,
        runtime_overhead_bytes: 500 * MIB,
        // Not in the published figures (llama.cpp copies from its pageable mmap of the model file).
        page_table_bytes_per_locked_gib: 0,
        measurements: Vec::new(),
        notes: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_profiles_match_the_derivation() {
        for name in systems() {
            let path = format!("{}/../../profiles/{name}.json", env!("CARGO_MANIFEST_DIR"));
            let committed = Profile::load(std::path::Path::new(&path)).unwrap();
            // A calibrated profile is the derivation under its fitted parameters, plus the record of the fit.
            let Provenance::Derived { fit, .. } = &committed.provenance else {
                panic!("{path} is not derived")
            };
            let mut expected =
                derived_with(name, &fit.as_ref().map_or(DEFAULT_EFFICIENCIES, |f| f.parameters)).unwrap();
            if let Provenance::Derived { fit: f, .. } = &mut expected.provenance {
                f.clone_from(fit);
            }
            assert_eq!(
                committed, expected,
                "{path} is stale: run `pipeshard profile derive --system {name}` (or `pipeshard repro calibrate`)"
            );
        }
    }

    #[test]
    fn attention_and_launch_follow_their_parameters() {
        use crate::cost::{CostModel, OpContext, TableCostModel};
        use crate::inventory::UnitId;
        use crate::workload::{Op, OpKind};
        let e = Efficiencies {
            gpu_attn: 0.5,
            gpu_attn_prefill: 0.8,
            cpu_attn: 0.25,
            launch_us: 9.0,
            ..DEFAULT_EFFICIENCIES
        };
        let p = derived_with("cli3", &e).unwrap();
        assert_eq!(p.launch_ns, 9_000);
        assert!(p.expert_ids_on_device, "the paper's llama.cpp reads expert ids on the device");
        let cost = TableCostModel::new(&p);
        // A GQA-8 attention of a shape no row has: one decode query and a prefill chunk over 40 000 keys.
        let attention = |tokens: u64| {
            let (q_heads, kv_heads, head_dim, keys) = (32u32, 4u32, 128u64, 40_000u64);
            let q_dim = f64::from(q_heads) * head_dim as f64;
            Op {
                kind: OpKind::Attention {
                    q_heads,
                    kv_heads,
                    head_dim,
                    keys,
                    scanned_keys: keys,
                    decode: tokens == 1,
                    materialized: false,
                },
                unit: UnitId::Kv { layer: 0 },
                tokens,
                dtype: DType::F16,
                flops: 4.0 * tokens as f64 * keys as f64 * q_dim,
                weight_bytes: 0.0,
                act_bytes: 8.0 * tokens as f64 * q_dim,
                kv_bytes: (keys * u64::from(kv_heads) * head_dim * 4) as f64,
            }
        };
        for (op, ctx, want) in [
            (attention(1), OpContext::gpu(), 0.5),
            (attention(1024), OpContext::gpu(), 0.8),
            (attention(1), OpContext::cpu(16), 0.25),
            (attention(1024), OpContext::cpu(16), 1.0),
        ] {
            let got = cost.roofline_ns(&op, ctx) as f64 / cost.op_ns(&op, ctx) as f64;
            assert!(
                (got - want).abs() < 0.01,
                "{:?} at {} tokens: {got} of the roofline, want {want}",
                ctx.device,
                op.tokens
            );
        }
    }

    #[test]
    fn a_cpu_routed_expert_pays_its_fixed_cost_on_the_cpu_only() {
        use crate::cost::{CostModel, OpContext, TableCostModel};
        use crate::workload::{OpKind, ops};
        let spec = crate::catalog::get("qwen3-30b-a3b").unwrap();
        let inv = crate::inventory::Inventory::new(&spec);
        let w = crate::workload::Workload::single(1000, 4096, 8, 1024);
        let all = ops(&spec, &inv, &w, w.decode_step(0));
        let experts = all.iter().find(|o| matches!(o.kind, OpKind::Experts { .. })).unwrap();
        let OpKind::Experts { touched, .. } = experts.kind else { unreachable!() };
        let cost = |us: f64| {
            TableCostModel::new(
                &derived_with("cli3", &Efficiencies { cpu_expert_us: us, ..DEFAULT_EFFICIENCIES }).unwrap(),
            )
        };
        let (a, b) = (cost(1.0), cost(51.0));
        let cpu = OpContext::cpu(16);
        let extra = b.op_ns(experts, cpu) as f64 - a.op_ns(experts, cpu) as f64;
        assert!((extra - touched * 50_000.0).abs() < 2.0, "{extra} for {touched} experts");
        assert_eq!(a.op_ns(experts, OpContext::gpu()), b.op_ns(experts, OpContext::gpu()));
    }

    #[test]
    fn profiles_round_trip_through_json() {
        let p = derived("cli3").unwrap();
        let back = Profile::from_json("cli3.json", &p.to_json()).unwrap();
        assert_eq!(back, p);
        let bumped = p.to_json().replacen("\"schema_version\": 2", "\"schema_version\": 9", 1);
        let e = Profile::from_json("x.json", &bumped).unwrap_err().to_string();
        assert!(e.contains("x.json") && e.contains('9'), "{e}");
        assert!(derived("cli9").is_none());
    }

    #[test]
    fn version_1_files_load_as_version_2() {
        let p = derived("cli2").unwrap();
        let v1 = p.to_json().replacen("\"schema_version\": 2", "\"schema_version\": 1", 1);
        let back = Profile::from_json("cli2-v1.json", &v1).unwrap();
        assert_eq!(back, p, "a version-1 file reads as the same profile, upgraded");
    }
}
