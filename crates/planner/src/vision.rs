//! The vision phase of a VLM request: where the tower's weights live, which attention kernel runs, and the
//! VRAM that follows; the language phases are planned by the other planners of this crate.
//!
//! [`VlmOptions`] names the three VLMOpt measures of the paper (DIGEST §3.5) one by one, so each can be
//! switched off to see what it buys: weights kept on the CPU and copied per use; attention without the whole
//! `N × N` scores (flash attention over the whole sequence, as the Table 8 runs set `MTMD_CLIP_FLASH_ATTN=1`,
//! or query tiles sized from a budget); and the serialised hand-over (the encoder's VRAM freed before the
//! language model's is taken). [`VlmOptions::stock`] is llama.cpp without them.

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::VramBreakdown;
use pipeshard_core::vision::{
    Handover, ImageGrid, SourceImage, VisionAttention, VisionPlan, VisionWeights, encoder_scratch_bytes,
    q_tile_for_budget,
};

use crate::PlanError;

/// How the attention of the encoder avoids the whole score matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionChoice {
    /// Scores materialised whole.
    Materialised,
    /// Flash attention over the whole sequence.
    Flash,
    /// Query tiles sized so one tile's scores fit `tile_budget_bytes` (the paper's `-clip-tiled-mb`).
    TiledQ { tile_budget_bytes: u64 },
}

/// The VLMOpt measures, each on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VlmOptions {
    pub weights: VisionWeights,
    pub attention: AttentionChoice,
    pub handover: Handover,
}

impl VlmOptions {
    /// llama.cpp b6097 without VLMOpt: tower resident, scores materialised, LLM context held during the encode.
    #[must_use]
    pub fn stock() -> VlmOptions {
        VlmOptions {
            weights: VisionWeights::Pinned,
            attention: AttentionChoice::Materialised,
            handover: Handover::Overlapping,
        }
    }

    /// The paper's Table 8 runs: weights on the CPU, full flash attention, serialised hand-over.
    #[must_use]
    pub fn paper() -> VlmOptions {
        VlmOptions {
            weights: VisionWeights::Streamed,
            attention: AttentionChoice::Flash,
            handover: Handover::Serialised,
        }
    }
}

/// The encode plan for `image` under `options` (flash attention changes the grid, see
/// [`ImageGrid::fit`]), or why it does not fit `budget_bytes` (which includes the runtime overhead the cost
/// model states).
pub fn plan_vision(
    spec: &ModelSpec,
    inv: &Inventory,
    image: SourceImage,
    options: &VlmOptions,
    cost: &dyn CostModel,
    budget_bytes: u64,
) -> Result<VisionPlan, PlanError> {
    let unsupported = |reason: String| PlanError::Unsupported { planner: "vision".into(), reason };
    let Some(v) = spec.vision.as_ref() else {
        return Err(unsupported(format!(
            "model `{}` has no vision encoder; pick a VLM such as cosmos-reason1-7b",
            spec.name
        )));
    };
    let grid = ImageGrid::fit(v, image, options.attention == AttentionChoice::Flash)
        .map_err(|e| unsupported(e.to_string()))?;
    let n = grid.patches();
    let attention = match options.attention {
        AttentionChoice::Materialised => VisionAttention::Materialised,
        AttentionChoice::Flash => VisionAttention::Flash,
        AttentionChoice::TiledQ { tile_budget_bytes } => match q_tile_for_budget(v, n, tile_budget_bytes) {
            q if q >= n => VisionAttention::Materialised,
            q_tile => VisionAttention::TiledQ { q_tile },
        },
    };
    let vision_units = || inv.units.iter().filter(|u| u.id.is_vision()).map(|u| u.weight_bytes);
    let (pinned, staged) = match options.weights {
        VisionWeights::Pinned => (vision_units().sum(), 0),
        VisionWeights::Streamed => (0, vision_units().max().unwrap_or(0)),
        VisionWeights::Cpu => (0, 0),
    };
    let scratch =
        if options.weights == VisionWeights::Cpu { 0 } else { encoder_scratch_bytes(v, n, attention) };
    let vram = VramBreakdown {
        pinned_weights_bytes: pinned,
        streaming_slots_bytes: staged,
        scratch_bytes: scratch,
        runtime_overhead_bytes: cost.runtime_overhead_bytes(),
        ..VramBreakdown::default()
    };
    if vram.total() > budget_bytes {
        return Err(PlanError::Infeasible { budget_bytes, min_budget_bytes: vram.total(), min: vram });
    }
    Ok(VisionPlan { grid, weights: options.weights, attention, vram })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::catalog;
    use pipeshard_core::cost::TableCostModel;
    use pipeshard_core::profile::Profile;

    fn setup() -> (ModelSpec, Inventory, TableCostModel) {
        let spec = catalog::get("cosmos-reason1-7b").unwrap();
        let inv = Inventory::new(&spec);
        let profile = Profile::from_json("cli2.json", include_str!("../../../profiles/cli2.json")).unwrap();
        (spec, inv, TableCostModel::new(&profile))
    }

    #[test]
    fn each_measure_lowers_the_encode_peak_and_oom_names_the_need() {
        let (spec, inv, cost) = setup();
        let grid = SourceImage { width_px: 3840, height_px: 2160, max_side_px: 1920 };
        let big = 64u64 << 30;
        let peak = |o: VlmOptions| plan_vision(&spec, &inv, grid, &o, &cost, big).unwrap().vram.total();
        let stock = VlmOptions::stock();
        let offload = VlmOptions { weights: VisionWeights::Streamed, ..stock };
        let tiled =
            VlmOptions { attention: AttentionChoice::TiledQ { tile_budget_bytes: 1 << 30 }, ..offload };
        let flash = VlmOptions { attention: AttentionChoice::Flash, ..offload };
        assert!(peak(offload) < peak(stock));
        assert!(peak(tiled) < peak(offload) / 2, "{} vs {}", peak(tiled), peak(offload));
        assert!(peak(flash) < peak(offload) / 2);
        // Stock at 1080p needs more than 8 GiB (7.4 GB of scores): a clear infeasible error.
        let e = plan_vision(&spec, &inv, grid, &stock, &cost, 8 << 30).unwrap_err();
        let PlanError::Infeasible { min_budget_bytes, .. } = e else { panic!("{e}") };
        assert!(min_budget_bytes > 8 << 30);
        assert!(e.to_string().contains("raise the budget"), "{e}");
        // A tile budget large enough for every score means no tiling.
        let untiled =
            VlmOptions { attention: AttentionChoice::TiledQ { tile_budget_bytes: 60 << 30 }, ..offload };
        let p = plan_vision(&spec, &inv, grid, &untiled, &cost, big).unwrap();
        assert_eq!(p.attention, VisionAttention::Materialised);
    }

    #[test]
    fn a_text_model_is_refused() {
        let (_, _, cost) = setup();
        let spec = catalog::get("qwen3-8b").unwrap();
        let inv = Inventory::new(&spec);
        let grid = SourceImage { width_px: 640, height_px: 360, max_side_px: 640 };
        let e = plan_vision(&spec, &inv, grid, &VlmOptions::paper(), &cost, 8 << 30).unwrap_err();
        assert!(e.to_string().contains("qwen3-8b"), "{e}");
    }
}
