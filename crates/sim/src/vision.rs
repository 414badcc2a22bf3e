//! A VLM request end to end: the image encode, the prefill of the image tokens ("image decode" in the paper),
//! the text prompt, and the generated tokens, with the peak VRAM over the whole request.
//!
//! - **Encode.** The encoder's ops ([`pipeshard_core::vision::encoder_ops`]) run one after another, as ggml
//!   runs a CLIP graph: on the GPU (one launch each) unless the plan puts the tower on the CPU. Streamed
//!   weights (VLMOpt's CPU offload) cross PCIe per use before their block runs, without overlap: ggml's
//!   scheduler copies a split's inputs and then computes it; they sit in a plain (pageable) CPU buffer, so
//!   they copy at the pageable rate. Query tiles add their kernel launches.
//! - **Language phases.** The language model's plan (any planner's) is simulated by [`Simulator`]: the image
//!   template's text before the image, the image tokens in `ubatch` chunks and the text after it are prefilled
//!   as mtmd sends them (the image in batches of its own, each text part as one), and the
//!   decode rate is that of the plan's workload (prompt = image + text tokens).
//! - **VRAM.** The encode peaks at its plan's breakdown, the language phases at the larger of their plan's
//!   breakdown (what the runtime reserves when it creates the context) and what the simulated steps used; the
//!   request at their max or sum by the [`Handover`].
//! - **E2EL.** [`VlmMetrics::e2el_paper_ns`] is what the paper's Table 8 script adds up: the encode, the image
//!   decode, llama.cpp's "prompt eval time" and `gen_tokens` / TPS. llama.cpp's prompt-eval timer counts every
//!   batch of more than one token, image embeddings included, so that sum counts the image prefill twice;
//!   [`VlmMetrics::e2el_ns`] is the request's wall time without the double count.

use pipeshard_core::cost::{CostModel, OpContext};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Plan};
use pipeshard_core::vision::{
    Handover, VisionError, VisionPlan, VisionWeights, encoder_ops, extra_attention_launches,
};
use pipeshard_core::workload::Phase;

use crate::{SimError, SimOptions, Simulator};

/// Nanoseconds of one image's encode under `plan`.
pub fn encode_ns(
    spec: &ModelSpec,
    inv: &Inventory,
    plan: &VisionPlan,
    cost: &dyn CostModel,
) -> Result<u64, VisionError> {
    let ops = encoder_ops(spec, inv, &plan.grid, plan.attention)?;
    let ctx = match plan.weights {
        VisionWeights::Cpu => OpContext::cpu(cost.cpu_threads()),
        VisionWeights::Pinned | VisionWeights::Streamed => OpContext::gpu(),
    };
    let launch = if plan.weights == VisionWeights::Cpu { 0 } else { cost.launch_ns() };
    let mut copied: Option<UnitId> = None;
    let mut t = 0u64;
    for op in &ops {
        if plan.weights == VisionWeights::Streamed && copied != Some(op.unit) {
            // clip.cpp allocates the offloaded tower in a plain CPU buffer, which CUDA never pins.
            t += cost.h2d_ns(inv.unit_bytes(op.unit), false);
            copied = Some(op.unit);
        }
        t += cost.op_ns(op, ctx) + launch;
    }
    let blocks = spec.vision.as_ref().map_or(0, |v| u64::from(v.depth));
    Ok(t + blocks * extra_attention_launches(plan.grid.patches(), plan.attention) * launch)
}

/// Times and VRAM of one VLM request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VlmMetrics {
    pub encode_ns: u64,
    /// Prefill of the image tokens ("image decoded" in llama.cpp's log).
    pub image_prefill_ns: u64,
    /// Prefill of the text before and after the image.
    pub text_prefill_ns: u64,
    pub tps: f64,
    pub gen_tokens: u64,
    pub vision_peak_bytes: u64,
    pub language_peak_bytes: u64,
    /// Over the whole request, by the hand-over.
    pub peak_vram_bytes: u64,
}

impl VlmMetrics {
    /// llama.cpp's "prompt eval time": every multi-token batch, the image's included.
    #[must_use]
    pub fn prompt_eval_ns(&self) -> u64 {
        self.image_prefill_ns + self.text_prefill_ns
    }

    /// Generating `gen_tokens` at the decode rate.
    #[must_use]
    pub fn generate_ns(&self) -> u64 {
        (self.gen_tokens as f64 / self.tps * 1e9).round() as u64
    }

    /// E2EL as the paper's Table 8 script sums it (the image prefill counted twice, see the module docs).
    #[must_use]
    pub fn e2el_paper_ns(&self) -> u64 {
        self.encode_ns + self.image_prefill_ns + self.prompt_eval_ns() + self.generate_ns()
    }

    /// The request's wall time: encode, image and text prefill, generation.
    #[must_use]
    pub fn e2el_ns(&self) -> u64 {
        self.encode_ns + self.prompt_eval_ns() + self.generate_ns()
    }
}

/// The text around the image in the prompt, in tokens: the chat template's head before the image (with the
/// vision-start marker) and the rest after it. llama.cpp's mtmd evaluates them as separate batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptText {
    pub before_image: u64,
    pub after_image: u64,
}

/// Simulates one request: `vision` encodes the image, `language` is the language model's plan, whose workload
/// holds the text before the image, the image tokens, then the text after it (`prompt_tokens` = their sum).
pub fn simulate_request(
    spec: &ModelSpec,
    inv: &Inventory,
    vision: &VisionPlan,
    language: &Plan,
    text: PromptText,
    handover: Handover,
    cost: &dyn CostModel,
) -> Result<VlmMetrics, SimError> {
    let w = language.workload;
    let image_tokens = vision.grid.tokens();
    let prompt = text.before_image + image_tokens + text.after_image;
    if w.prompt_tokens != prompt || text.after_image == 0 {
        return Err(SimError::Workload(pipeshard_core::workload::WorkloadError {
            field: "prompt_tokens",
            value: w.prompt_tokens,
            expected: format!(
                "text before the image ({}) + image tokens ({image_tokens}) + text after it ({}, at least 1)",
                text.before_image, text.after_image
            ),
        }));
    }
    let encode = encode_ns(spec, inv, vision, cost)?;
    let sim = Simulator::with_inventory(spec, inv, language, cost)?;
    let chunk = |tokens, start_pos, last| {
        sim.step(PhaseKind::Prefill, Phase::Prefill { tokens, start_pos, last }).makespan_ns
    };
    let mut text_prefill = if text.before_image > 0 { chunk(text.before_image, 0, false) } else { 0 };
    let mut image_prefill = 0;
    let mut pos = text.before_image;
    while pos < text.before_image + image_tokens {
        let n = w.ubatch.min(text.before_image + image_tokens - pos);
        image_prefill += chunk(n, pos, false);
        pos += n;
    }
    text_prefill += chunk(text.after_image, pos, true);
    let run = sim.run(&SimOptions::default());
    let vision_peak = vision.vram.total();
    // The runtime takes the plan's VRAM when the context is created (llama.cpp reserves its compute buffer
    // for a worst-case ubatch), whatever part of it the run's steps touch.
    let reserved = language.prefill.vram.total().max(language.decode.vram.total());
    let language_peak = run.metrics.vram_peak_bytes.max(reserved);
    Ok(VlmMetrics {
        encode_ns: encode,
        image_prefill_ns: image_prefill,
        text_prefill_ns: text_prefill,
        tps: run.metrics.tps,
        gen_tokens: w.gen_tokens,
        vision_peak_bytes: vision_peak,
        language_peak_bytes: language_peak,
        peak_vram_bytes: handover.peak_bytes(vision_peak, language_peak, cost.runtime_overhead_bytes()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::catalog;
    use pipeshard_core::cost::TableCostModel;
    use pipeshard_core::plan::VramBreakdown;
    use pipeshard_core::profile::Profile;
    use pipeshard_core::vision::{ImageGrid, SourceImage, VisionAttention};

    #[test]
    fn encode_time_follows_placement_and_kernel() {
        let spec = catalog::get("cosmos-reason1-7b").unwrap();
        let inv = Inventory::new(&spec);
        let profile = Profile::from_json("cli2.json", include_str!("../../../profiles/cli2.json")).unwrap();
        let cost = TableCostModel::new(&profile);
        let image = SourceImage { width_px: 3840, height_px: 2160, max_side_px: 1280 };
        let grid = ImageGrid::fit(spec.vision.as_ref().unwrap(), image, false).unwrap();
        let t = |weights, attention| {
            let plan = VisionPlan { grid, weights, attention, vram: VramBreakdown::default() };
            encode_ns(&spec, &inv, &plan, &cost).unwrap()
        };
        let pinned = t(VisionWeights::Pinned, VisionAttention::Flash);
        let streamed = t(VisionWeights::Streamed, VisionAttention::Flash);
        // Streaming adds exactly one copy of every vision unit.
        let copies: u64 =
            inv.units.iter().filter(|u| u.id.is_vision()).map(|u| cost.h2d_ns(u.weight_bytes, false)).sum();
        assert_eq!(streamed, pinned + copies);
        assert!(t(VisionWeights::Cpu, VisionAttention::Flash) > 5 * pinned);
        // Materialised scores move 16 × N² × 16 B per block more than flash attention.
        assert!(t(VisionWeights::Pinned, VisionAttention::Materialised) > pinned);
        let tiled = t(VisionWeights::Pinned, VisionAttention::TiledQ { q_tile: 512 });
        let materialised = t(VisionWeights::Pinned, VisionAttention::Materialised);
        let tiles = grid.patches().div_ceil(512) - 1;
        assert_eq!(tiled - materialised, 32 * 6 * tiles * cost.launch_ns());
    }
}
