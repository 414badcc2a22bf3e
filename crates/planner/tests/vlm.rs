//! A VLM request planned and simulated end to end: the vision plan of `vision`, the language plan of `pshard`,
//! and pipeshard-sim's request simulation, with each VLMOpt measure checked for what it is meant to change.

mod common;

use pipeshard_core::GIB;
use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::vision::{Handover, SourceImage, VisionAttention, VisionWeights};
use pipeshard_core::workload::Workload;
use pipeshard_planner::Planner;
use pipeshard_planner::pshard::Pshard;
use pipeshard_planner::vision::{AttentionChoice, VlmOptions, plan_vision};
use pipeshard_sim::vision::{PromptText, simulate_request};

use common::{cli3, model};

const TEXT: PromptText = PromptText { before_image: 15, after_image: 14 };

#[test]
fn the_hand_over_decides_max_or_sum_and_the_papers_e2el_counts_the_image_twice() {
    let cost = cli3();
    let spec = model("cosmos-reason1-7b");
    let inv = Inventory::new(&spec);
    let image = SourceImage { width_px: 3840, height_px: 2160, max_side_px: 1280 };
    let vision = plan_vision(&spec, &inv, image, &VlmOptions::paper(), &cost, 8 * GIB).unwrap();
    assert_eq!(vision.attention, VisionAttention::Flash);
    assert_eq!(vision.weights, VisionWeights::Streamed);
    // 1280×720 aligned to 224 px under flash attention: 1344×896, 96×64 patches, 1536 tokens.
    assert_eq!(vision.grid.tokens(), 1536);
    let prompt = TEXT.before_image + vision.grid.tokens() + TEXT.after_image;
    let w = Workload::single(prompt, 4096, 100, 512);
    let lm = Pshard::default().plan(&spec, &w, &cost, 4 * GIB).unwrap();
    let run = |h| simulate_request(&spec, &inv, &vision, &lm, TEXT, h, &cost).unwrap();
    let (serial, overlap) = (run(Handover::Serialised), run(Handover::Overlapping));
    let (v, l) = (serial.vision_peak_bytes, serial.language_peak_bytes);
    assert!(v > 0 && l > 0);
    assert_eq!(serial.peak_vram_bytes, v.max(l));
    assert_eq!(overlap.peak_vram_bytes, v + l - cost.runtime_overhead_bytes());
    assert!(serial.peak_vram_bytes < overlap.peak_vram_bytes);
    // Three 512-token chunks of image, two text batches; the paper's sum has the image prefill twice.
    assert!(serial.image_prefill_ns > serial.text_prefill_ns);
    assert_eq!(serial.e2el_paper_ns(), serial.e2el_ns() + serial.image_prefill_ns);
    assert_eq!(serial.e2el_ns(), serial.encode_ns + serial.prompt_eval_ns() + serial.generate_ns());
    // A workload that does not hold the image's tokens is an error naming the field.
    let short = Workload::single(prompt - 1, 4096, 100, 512);
    let lm_short = Pshard::default().plan(&spec, &short, &cost, 4 * GIB).unwrap();
    let e = simulate_request(&spec, &inv, &vision, &lm_short, TEXT, Handover::Serialised, &cost).unwrap_err();
    assert!(e.to_string().contains("prompt_tokens") && e.to_string().contains("1536"), "{e}");
}

#[test]
fn tiles_follow_the_budget_and_bound_the_encode_peak() {
    let cost = cli3();
    let spec = model("cosmos-reason1-7b");
    let inv = Inventory::new(&spec);
    let image = SourceImage { width_px: 3840, height_px: 2160, max_side_px: 2560 };
    let tiled = |tile_budget_bytes| VlmOptions {
        attention: AttentionChoice::TiledQ { tile_budget_bytes },
        ..VlmOptions::paper()
    };
    let plan = |tile| plan_vision(&spec, &inv, image, &tiled(tile), &cost, 64 * GIB).unwrap();
    let (small, large) = (plan(GIB / 2), plan(4 * GIB));
    let q = |p: &pipeshard_core::vision::VisionPlan| match p.attention {
        VisionAttention::TiledQ { q_tile } => q_tile,
        a => panic!("{a:?}"),
    };
    // Eight times the tile budget, about eight times the tile (rounding to 64 rows aside).
    let ratio = q(&large) as f64 / q(&small) as f64;
    assert!((7.0..=9.0).contains(&ratio), "{ratio}");
    // The tile's scores are the only part of the encode peak that the tile budget moves.
    let d = large.vram.scratch_bytes - small.vram.scratch_bytes;
    let expect = 4 * 16 * (q(&large) - q(&small)) * small.grid.patches();
    assert_eq!(d, expect);
}

#[test]
fn the_stock_baseline_reserves_its_cpu_head_and_copies_pageable_weights() {
    use pipeshard_core::inventory::UnitId;
    use pipeshard_planner::ngl::Ngl;
    let cost = cli3();
    let spec = model("cosmos-reason1-7b");
    let inv = Inventory::new(&spec);
    let image = SourceImage { width_px: 3840, height_px: 2160, max_side_px: 1280 };
    let vision = plan_vision(&spec, &inv, image, &VlmOptions::stock(), &cost, 64 * GIB).unwrap();
    let prompt = TEXT.before_image + vision.grid.tokens() + TEXT.after_image;
    let pinned = Workload::single(prompt, 4096, 100, 512);
    let pageable = Workload { host_pageable: true, ..pinned };
    let ngl = |n, reserve_cpu_head, w: &Workload| {
        Ngl { fixed_layers: Some(n), reserve_cpu_head, ..Ngl::default() }
            .plan(&spec, w, &cost, 64 * GIB)
            .unwrap()
    };
    // -ngl 0: the reserve graph's head (152064 × 3584 f16) is staged beside the logits of all 512 rows, after
    // the layers' buffers are freed, so the compute buffer is the residual stream + head + logits.
    let head = inv.unit_bytes(UnitId::Output);
    assert_eq!(head, 152_064 * 3584 * 2 + 3584 * 4, "head and output norm");
    let (residual, logits) = (3 * 512 * 3584 * 4, 512 * 152_064 * 4);
    let with = ngl(0, true, &pinned);
    assert_eq!(with.prefill.vram.scratch_bytes, residual + head + logits);
    assert!(ngl(0, false, &pinned).prefill.vram.scratch_bytes < residual + head);
    // With the head on the GPU nothing is staged for it: the option changes nothing.
    let all = spec.text.n_layers + 1;
    assert_eq!(ngl(all, true, &pinned).prefill.vram, ngl(all, false, &pinned).prefill.vram);
    // The request peaks at what the context reserved, though no real step stages the head (one logit row).
    let run =
        |plan| simulate_request(&spec, &inv, &vision, &plan, TEXT, Handover::Overlapping, &cost).unwrap();
    let m = run(with.clone());
    assert_eq!(m.language_peak_bytes, with.prefill.vram.total());
    // Pageable weights (`ngl` plans stock llama.cpp's mapped, unpinned weights): every image chunk copies each
    // layer's FFN at the pageable rate instead of the pinned one of the same plan with its host memory pinned.
    let slow = run(ngl(0, true, &pageable));
    assert!(with.workload.host_pageable, "ngl plans pageable host memory whatever the workload says");
    let mut pinned_plan = with.clone();
    pinned_plan.workload.host_pageable = false;
    let m = run(pinned_plan);
    let ffn = inv.unit_bytes(UnitId::Ffn { layer: 0 });
    let chunks = vision.grid.tokens().div_ceil(512);
    let floor = chunks * u64::from(spec.text.n_layers) * (cost.h2d_ns(ffn, false) - cost.h2d_ns(ffn, true));
    assert!(
        slow.image_prefill_ns >= m.image_prefill_ns + floor,
        "{} vs {}",
        slow.image_prefill_ns,
        m.image_prefill_ns
    );
    // Decode copies nothing: the same rate.
    assert!((slow.tps - m.tps).abs() < 1e-9 * m.tps);
}
