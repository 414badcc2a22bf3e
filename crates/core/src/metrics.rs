//! Metrics: what the simulator predicts and the executor measures, in the same type so that every error is
//! one subtraction.

use serde::{Deserialize, Serialize};

use crate::plan::VramBreakdown;

/// A resource that can be busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    GpuCompute,
    H2d,
    D2h,
    Cpu,
}

impl Resource {
    pub const ALL: [Resource; 4] = [Resource::GpuCompute, Resource::H2d, Resource::D2h, Resource::Cpu];

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Resource::GpuCompute => "gpu",
            Resource::H2d => "h2d",
            Resource::D2h => "d2h",
            Resource::Cpu => "cpu",
        }
    }
}

/// Time-to-first-token, decode throughput, end-to-end latency, peak VRAM and resource busy times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// Start of prefill to the first token on the host (the paper's "prompt eval time").
    pub ttft_ns: u64,
    /// Tokens per second over the decode steps, summed over parallel requests.
    pub tps: f64,
    /// TTFT plus the decode steps (TTFT + G / TPS for one request).
    pub e2el_ns: u64,
    pub gen_tokens: u64,
    /// Mean decode step time.
    pub decode_step_ns: u64,
    /// Peak VRAM by category.
    pub vram_peak: VramBreakdown,
    pub vram_peak_bytes: u64,
    /// Busy nanoseconds per resource over the whole run.
    pub busy_ns: Vec<(Resource, u64)>,
}

impl Metrics {
    /// TTFT in milliseconds.
    #[must_use]
    pub fn ttft_ms(&self) -> f64 {
        self.ttft_ns as f64 / 1e6
    }

    /// E2EL in milliseconds.
    #[must_use]
    pub fn e2el_ms(&self) -> f64 {
        self.e2el_ns as f64 / 1e6
    }

    /// Busy time of one resource.
    #[must_use]
    pub fn busy(&self, r: Resource) -> u64 {
        self.busy_ns.iter().find(|(x, _)| *x == r).map_or(0, |(_, t)| *t)
    }
}
