//! Property: any valid plan, however its units are mixed between pinned, streamed and CPU, lays out in the
//! executor's arena at its own budget (the budget minus the plan's runtime overhead), exact fits included, and
//! what the executor carves never exceeds that arena. This is the CPU half of "the budget holds"; the GPU half
//! (measured peaks) is `pipeshard exec stress`.

use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::plan::{PhaseKind, Placement};
use pipeshard_core::workload::Workload;
use pipeshard_exec::cpu::KvLayout;
use pipeshard_exec::host::Elem;
use pipeshard_exec::layout::{Arena, layout_plan};
use pipeshard_exec::seqs::SeqKv;
use pipeshard_exec::testing::{
    manual_plan, tiny_nemotron_spec, tiny_qwen3_moe_spec, tiny_qwen3_spec, tiny_spec,
};
use pipeshard_exec::weights::ModelWeights;
use proptest::prelude::*;

fn placement(code: u8) -> Placement {
    match code % 3 {
        0 => Placement::Pinned,
        1 => Placement::Streamed,
        _ => Placement::Cpu,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn valid_plans_fit_the_arena_of_their_budget(
        which in 0usize..5,
        codes in proptest::collection::vec(0u8..6, 64),
        depth in 1u32..4,
        (prompt, gen_tokens, ubatch, ctx_extra) in (1u64..40, 1u64..8, 1u64..24, 0u64..3000),
        slack in prop_oneof![Just(0u64), 0u64..100_000],
    ) {
        let spec = match which {
            0 => tiny_spec(),
            1 => tiny_nemotron_spec(),
            2 => tiny_qwen3_spec(),
            3 => tiny_qwen3_moe_spec(),
            _ => tiny_spec().with_uniform_weights(DType::Q4_0),
        };
        let inv = Inventory::new(&spec);
        let w = ModelWeights::zeroed(&spec).unwrap();
        let workload = Workload::single(prompt, prompt + gen_tokens + ctx_extra, gen_tokens, ubatch);
        let index = |u: UnitId| inv.units.iter().position(|x| x.id == u).unwrap();
        // KV goes with its layer's attention (pinned or streamed on the GPU, else the CPU).
        let place = |phase: PhaseKind, u: UnitId| {
            let code = |u: UnitId| codes[(index(u) + if phase == PhaseKind::Decode { 32 } else { 0 }) % 64];
            match u {
                UnitId::Kv { layer } => match placement(code(UnitId::Attn { layer })) {
                    Placement::Cpu => Placement::Cpu,
                    _ if code(u) >= 3 => Placement::Streamed,
                    _ => Placement::Pinned,
                },
                _ => placement(code(u)),
            }
        };
        let overhead = 300 << 20;
        let mut plan = manual_plan(&spec, workload, u64::MAX, overhead, depth, 2, place);
        plan.budget_bytes = plan.peak_vram_bytes() + slack;
        prop_assert!(plan.validate(&inv).is_ok(), "{:?}", plan.validate(&inv));
        let kv = SeqKv::single(KvLayout { ctx: workload.ctx as usize, kv_dim: w.dims.kv_dim, elem: Elem::F16 });
        let arena = Arena {
            bytes: (plan.budget_bytes - overhead) as usize,
            budget_bytes: plan.budget_bytes,
            overhead_bytes: overhead,
        };
        let lay = layout_plan(&w, &plan, kv, ubatch.min(prompt) as usize, arena);
        prop_assert!(lay.is_ok(), "{}", lay.unwrap_err());
        for l in lay.unwrap() {
            let u = l.used;
            let carved = u.pinned_weights_bytes + u.streaming_slots_bytes + u.kv_bytes + u.scratch_bytes;
            prop_assert!(carved as usize <= arena.bytes, "{:?}: carved {carved} > arena {}", l.phase, arena.bytes);
        }
    }
}
