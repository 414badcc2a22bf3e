//! Golden tests of `pshard` against hand-worked cases of the paper's planner (DIGEST §1.5 and the artifact's
//! `llama-plan-builder.cpp`): the expected strategy and pinned-layer counts are computed here from the VRAM
//! formula, `scratch × 1.5 + pinned + slots × largest streamed split + KV`, with the inventory's bytes.

mod common;

use pipeshard_core::cost::TableCostModel;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhasePlan, Placement, Plan};
use pipeshard_core::profile::Profile;
use pipeshard_core::workload::{Phase, Workload, scratch_parts};
use pipeshard_planner::Planner;
use pipeshard_planner::pshard::{Pshard, Strategy, tier_of, tiers};

use common::{cli3, filled, model};

/// Bytes the paper's formula needs, for one model and workload.
struct Hand {
    n: u64,
    attn: u64,
    ffn: u64,
    kv: u64,
    output: u64,
    overhead: u64,
    spec: ModelSpec,
    w: Workload,
}

impl Hand {
    fn new(spec: ModelSpec, w: Workload) -> Hand {
        let inv = Inventory::new(&spec);
        let l0 = |id| inv.unit_bytes(id);
        let attn = l0(UnitId::Attn { layer: 0 }) + l0(UnitId::Router { layer: 0 });
        let ffn = l0(UnitId::Ffn { layer: 0 })
            + (0..spec.text.moe.as_ref().map_or(0, |m| m.n_experts))
                .map(|e| l0(UnitId::Expert { layer: 0, expert: e }))
                .sum::<u64>();
        Hand {
            n: u64::from(spec.text.n_layers),
            attn,
            ffn,
            kv: w.kv_bytes_per_layer_of(&inv),
            output: l0(UnitId::Output),
            overhead: cli3_overhead(),
            spec,
            w,
        }
    }

    /// 1.5 × the scratch of the GPU splits at 1024 tokens over the full KV, padded to 128 bytes.
    fn scratch(&self, attn_gpu: bool, ffn_gpu: bool, logits: bool) -> u64 {
        let tier = 1024;
        let p = scratch_parts(
            &self.spec,
            &self.w,
            Phase::Prefill { tokens: tier, start_pos: self.w.ctx - tier, last: false },
        );
        let work = (if attn_gpu { p.attention_bytes } else { 0 }).max(if ffn_gpu { p.ffn_bytes } else { 0 });
        let logits = if logits { tier * self.spec.text.vocab * 4 } else { 0 };
        let raw = (p.residual_bytes + work + logits) as f64 * 1.5;
        (raw.ceil() as u64).div_ceil(128) * 128
    }
}

fn cli3_overhead() -> u64 {
    use pipeshard_core::cost::CostModel;
    cli3().runtime_overhead_bytes()
}

fn plan(h: &Hand, budget: u64, forced: Option<Strategy>) -> Plan {
    let p = Pshard { forced_strategy: forced, ..Pshard::default() };
    let plan = p.plan(&h.spec, &h.w, &cli3(), budget).unwrap();
    plan.validate(&Inventory::new(&h.spec)).unwrap();
    plan
}

/// (whole layers pinned, attention blocks pinned, attention blocks streamed, output pinned).
fn shape(p: &PhasePlan, n: u32) -> (u32, u32, u32, bool) {
    let at = |id| p.placement(id).unwrap();
    let mut whole = 0;
    let mut attn_pinned = 0;
    let mut attn_streamed = 0;
    for layer in 0..n {
        let attn = at(UnitId::Attn { layer });
        let ffn =
            p.placement(UnitId::Ffn { layer }).unwrap_or_else(|| at(UnitId::Expert { layer, expert: 0 }));
        whole += u32::from(attn == Placement::Pinned && ffn == Placement::Pinned);
        attn_pinned += u32::from(attn == Placement::Pinned);
        attn_streamed += u32::from(attn == Placement::Streamed);
        assert_eq!(at(UnitId::Kv { layer }), attn, "layer {layer}: the paper's KV follows its attention");
    }
    (whole, attn_pinned, attn_streamed, at(UnitId::Output) == Placement::Pinned)
}

fn nemo8() -> Hand {
    Hand::new(model("nemo-8b").truncated(8).unwrap(), filled(4096, 100, 1024))
}

#[test]
fn tiers_follow_batch_tier_config() {
    assert_eq!(tiers(1024, 1), vec![1, 512, 1024]);
    assert_eq!(tiers(2048, 1), vec![1, 512, 1024, 2048]);
    assert_eq!(tiers(256, 1), vec![1, 256]);
    assert_eq!(tiers(1024, 4), vec![1, 4, 16, 64, 512, 1024]);
    let t = tiers(2048, 1);
    assert_eq!(
        (tier_of(&t, 889), tier_of(&t, 1), tier_of(&t, 513), tier_of(&t, 9999)),
        (1024, 1, 1024, 2048)
    );
}

#[test]
fn full_gpu_when_everything_fits_is_one_plan_for_every_tier() {
    let h = nemo8();
    let need = h.scratch(true, true, true) + h.n * (h.attn + h.ffn) + h.output + h.n * h.kv;
    let p = plan(&h, h.overhead + need, None);
    for phase in p.phases() {
        assert_eq!(shape(phase, 8), (8, 8, 0, true));
    }
    assert!(p.notes.iter().all(|n| n.contains("FULL_GPU at tier 1024")), "{:?}", p.notes);
    // One byte less and the output head no longer fits.
    let p = plan(&h, h.overhead + need - 1, None);
    assert!(p.notes[0].contains("FULL_GPU_NO_OUTPUT"), "{:?}", p.notes);
    assert_eq!(shape(&p.prefill, 8), (8, 8, 0, false));
}

#[test]
fn static_pins_the_largest_attention_prefix_that_fits() {
    let h = nemo8();
    let per = h.attn + h.kv;
    // Phase 1 (base ALL_CPU, pin ATTN_GPU_PINNED, no slots): scratch + n·attn + n·kv ≤ arena.
    let arena = h.scratch(true, false, false) + 5 * per + per / 2;
    let p = plan(&h, h.overhead + arena, Some(Strategy::StaticAttnPrio));
    assert_eq!(shape(&p.prefill, 8), (0, 5, 0, false));
    assert!(p.prefill.placements.iter().all(|u| u.placement != Placement::Streamed));
    // Case B: all attention fits, then whole layers by a second binary search (FFN splits now on the GPU).
    let arena = h.scratch(true, true, false) + 8 * per + 3 * h.ffn + h.ffn / 2;
    let p = plan(&h, h.overhead + arena, Some(Strategy::StaticAttnPrio));
    assert_eq!(shape(&p.prefill, 8), (3, 8, 0, false));
}

#[test]
fn shard_attn_prio_streams_the_attention_that_does_not_fit_with_its_kv() {
    let h = nemo8();
    let per = h.attn + h.kv;
    let scratch = h.scratch(true, false, false);
    // Phase 1 pins 5 (its KV counts one slot too); case A then budgets one streamed attention split and one
    // KV slot: arena − attn − kv ≥ scratch + k·(attn + kv) gives k = 4.
    let arena = scratch + 5 * per + per / 2;
    let p = plan(&h, h.overhead + arena, Some(Strategy::ShardAttnPrio));
    assert_eq!(shape(&p.prefill, 8), (0, 4, 4, false));
    let ffn_on_cpu = (0..8).all(|layer| p.prefill.placement(UnitId::Ffn { layer }) == Some(Placement::Cpu));
    assert!(ffn_on_cpu);
    // The streamed attention carries its KV in one slot: the paper's ring (attn + kv) holds one.
    assert_eq!((p.prefill.pipeline_depth, p.prefill.slot_bytes), (1, h.attn + h.kv));
}

#[test]
fn full_shard_pins_whole_layers_and_streams_the_rest_through_two_slots() {
    let h = nemo8();
    let layer = h.attn + h.ffn;
    let scratch = h.scratch(true, true, false);
    // scratch + n·layer + 2·layer + (n + 2)·kv ≤ arena, with n = 3.
    let arena = scratch + 3 * layer + 2 * layer + 5 * h.kv + layer / 2;
    let p = plan(&h, h.overhead + arena, Some(Strategy::FullShard));
    assert_eq!(shape(&p.prefill, 8), (3, 3, 5, false));
    // Our ring: slots of the largest streamed unit (the FFN), as many as the paper's two layer slots and two
    // KV slots hold.
    let paper_ring = 2 * layer + 2 * h.kv;
    assert_eq!(p.prefill.slot_bytes, h.ffn);
    assert_eq!(u64::from(p.prefill.pipeline_depth), paper_ring / h.ffn);
    assert!(p.prefill.vram.total() <= h.overhead + arena);
}

#[test]
fn moe_case_b_moves_the_output_head_to_the_gpu_when_it_fits() {
    let h = Hand::new(model("qwen3-30b-a3b").truncated(4).unwrap(), filled(4096, 100, 1024));
    let attn_only = h.scratch(true, false, false) + h.n * (h.attn + h.kv);
    let with_head = h.scratch(true, false, true) + h.n * (h.attn + h.kv) + h.output;
    assert!(with_head > attn_only);
    let p = plan(&h, h.overhead + with_head, Some(Strategy::StaticAttnPrio));
    assert_eq!(shape(&p.prefill, 4), (0, 4, 0, true));
    // A byte less: the head stays on the CPU, and the whole-layer search uses the room instead.
    let arena = with_head - 1;
    let whole = (arena - h.scratch(true, true, false) - h.n * (h.attn + h.kv)) / h.ffn;
    let p = plan(&h, h.overhead + arena, Some(Strategy::StaticAttnPrio));
    assert_eq!(shape(&p.prefill, 4), (whole as u32, 4, 0, false));
    assert!(whole >= 1);
    // Without the all-logits quirk the head's scratch is one row, and it fits with less.
    let quirkless = Pshard {
        forced_strategy: Some(Strategy::StaticAttnPrio),
        all_logits_at_planning: false,
        ..Pshard::default()
    };
    let p = quirkless.plan(&h.spec, &h.w, &cli3(), h.overhead + with_head - 1).unwrap();
    let (whole, attn, _, head) = shape(&p.prefill, 4);
    assert!(head && attn == 4 && whole >= 1, "{:?}", shape(&p.prefill, 4));
}

#[test]
fn a_forced_strategy_that_never_fits_is_infeasible_with_a_working_minimum() {
    let h = nemo8();
    let p = Pshard { forced_strategy: Some(Strategy::FullGpuNoOutput), ..Pshard::default() };
    let e = p.plan(&h.spec, &h.w, &cli3(), 2 << 30).unwrap_err();
    let pipeshard_planner::PlanError::Infeasible { min_budget_bytes, .. } = e else { panic!("{e}") };
    let ok = p.plan(&h.spec, &h.w, &cli3(), min_budget_bytes).unwrap();
    assert!(ok.notes[0].contains("FULL_GPU"), "{:?}", ok.notes);
    assert_eq!(Strategy::from_name("full_shard"), Some(Strategy::FullShard));
    assert_eq!(Strategy::from_name("3"), Some(Strategy::ShardAttnPrio));
}

/// The decode strategy of `p`'s plan of nemo-8b at `ctx` with a 2 GiB arena, on the calibrated cli3 profile
/// (`profiles/cli3.json`, which prices CPU flash attention in decode at 30 % of its roofline).
fn nemo8_decode_note(p: Pshard, ctx: u64) -> String {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/cli3.json");
    let cost = TableCostModel::new(&Profile::load(&file).unwrap());
    let spec = model("nemo-8b");
    let plan = p.plan(&spec, &filled(ctx, 100, 1024), &cost, cli3_overhead() + (2 << 30)).unwrap();
    plan.notes.iter().find(|n| n.starts_with("decode:")).unwrap().split(" (").next().unwrap().to_string()
}

#[test]
fn attention_without_an_exact_profile_row_is_priced_at_bandwidth_and_steers_the_choice() {
    let artifact = Pshard::default();
    let measured = Pshard { attention_by_exact_row: false, ..Pshard::default() };
    // At 64K no `--fast` row matches: the predictor prices the CPU attention of STATIC's unpinned layers at
    // DRAM bandwidth and takes STATIC, where priced at its cost it streams every layer with its KV
    // (FULL_SHARD).
    assert_eq!(nemo8_decode_note(artifact, 65536), "decode: STATIC_ATTN_PRIO at tier 1");
    assert_eq!(nemo8_decode_note(measured, 65536), "decode: FULL_SHARD at tier 1");
    // At 16K the GQA-8 row of tier 1 matches exactly: both price attention alike.
    assert_eq!(nemo8_decode_note(artifact, 16384), nemo8_decode_note(measured, 16384));
}
