//! The plan tester: every planner × ring depth × model kind × budget, checking the invariants every consumer
//! of a plan relies on; and, over random budgets, that an infeasible budget names a minimum that works.

mod common;

use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhasePlan, Placement, Plan};
use pipeshard_core::workload::Workload;
use pipeshard_core::{GIB, MIB};
use pipeshard_planner::exhaustive::Exhaustive;
use pipeshard_planner::greedy::Greedy;
use pipeshard_planner::ilp::Ilp;
use pipeshard_planner::ngl::Ngl;
use pipeshard_planner::pshard::Pshard;
use pipeshard_planner::{NAMES, PlanError, Planner, by_name};
use proptest::prelude::*;

use common::{cli3, filled, model, small_moe};

/// Every planner, with the ring depths the searching ones may use.
fn planners() -> Vec<(Box<dyn Planner>, u32)> {
    let mut v: Vec<(Box<dyn Planner>, u32)> =
        vec![(Box::new(Ngl::default()), 0), (Box::new(Pshard::default()), 0)];
    for max_depth in [1, 2] {
        v.push((Box::new(Greedy { max_depth, ..Greedy::default() }), max_depth));
        v.push((Box::new(Ilp { max_depth, ..Ilp::default() }), max_depth));
        v.push((Box::new(Exhaustive { max_depth, ..Exhaustive::default() }), max_depth));
    }
    v
}

/// Models of every kind: dense with and without a gate, MoE, vision-language; `exhaustive` gets truncated
/// ones it can enumerate.
fn models(planner: &str) -> Vec<ModelSpec> {
    if planner == "exhaustive" {
        vec![
            model("nemo-4b").truncated(2).unwrap(),
            model("llama-3.1-8b").truncated(1).unwrap(),
            small_moe(1, 4),
            model("cosmos-reason1-7b").truncated(1).unwrap(),
        ]
    } else {
        vec![
            model("nemo-4b"),
            model("llama-3.1-8b").truncated(8).unwrap(),
            model("qwen3-30b-a3b"),
            model("qwen3-235b-a22b"),
            model("cosmos-reason1-7b").truncated(6).unwrap(),
        ]
    }
}

/// Checks a phase plan beyond `Plan::validate`: the breakdown's lines match the placements.
fn check_phase(plan: &Plan, p: &PhasePlan, inv: &Inventory, max_depth: u32) -> Result<(), String> {
    let kv_layer = plan.workload.kv_bytes_per_layer_of(inv);
    let mut pinned = 0;
    let mut kv = 0;
    let mut streams = false;
    let mut gpu = false;
    for up in &p.placements {
        let kind_is_kv = matches!(up.unit, UnitId::Kv { .. });
        match up.placement {
            Placement::Pinned if kind_is_kv => kv += kv_layer,
            Placement::Pinned => pinned += inv.unit_bytes(up.unit),
            Placement::Streamed => streams = true,
            Placement::Cpu => {}
        }
        gpu |= up.placement.on_gpu();
        if up.unit.is_vision() && up.placement != Placement::Cpu {
            return Err(format!("vision unit {} is {:?}", up.unit, up.placement));
        }
    }
    if p.vram.pinned_weights_bytes != pinned {
        return Err(format!("pinned line {} ≠ pinned units {pinned}", p.vram.pinned_weights_bytes));
    }
    if p.vram.kv_bytes != kv {
        return Err(format!("KV line {} ≠ pinned KV {kv}", p.vram.kv_bytes));
    }
    if streams != (p.pipeline_depth > 0) {
        return Err(format!("depth {} but streams = {streams}", p.pipeline_depth));
    }
    if max_depth > 0 && p.pipeline_depth > max_depth {
        return Err(format!("depth {} over the limit {max_depth}", p.pipeline_depth));
    }
    // Op offload stages weights in scratch even when nothing is placed on the GPU.
    if plan.planner != "ngl" && !p.op_offload && gpu != (p.vram.scratch_bytes > 0) {
        return Err(format!("scratch {} with GPU work = {gpu}", p.vram.scratch_bytes));
    }
    Ok(())
}

fn check(plan: &Plan, spec: &ModelSpec, budget: u64, max_depth: u32) -> Result<(), String> {
    let inv = Inventory::new(spec);
    plan.validate(&inv).map_err(|e| e.to_string())?;
    if plan.budget_bytes != budget || plan.model != spec.name {
        return Err("the plan names another budget or model".into());
    }
    for p in plan.phases() {
        check_phase(plan, p, &inv, max_depth)?;
    }
    let pred = plan.prediction.ok_or("no prediction")?;
    // Each figure is rounded to a nanosecond on its own.
    let gen_tokens = plan.workload.gen_tokens;
    if pred.e2el_ns + gen_tokens + 1 < pred.ttft_ns + gen_tokens * pred.decode_step_ns {
        return Err(format!("E2EL {pred:?} below TTFT + gen × step"));
    }
    let flash = match plan.planner.as_str() {
        "ngl" => Some(false),
        "pshard" => Some(true),
        _ => None,
    };
    if flash.is_some_and(|f| f != plan.workload.flash_attn) {
        return Err(format!("{} plans with flash attention {}", plan.planner, plan.workload.flash_attn));
    }
    if Plan::from_json("round trip", &plan.to_json())? != *plan {
        return Err("the plan does not survive its JSON".into());
    }
    Ok(())
}

#[test]
fn every_planner_depth_model_and_budget_keeps_the_invariants() {
    let cost = cli3();
    let w = filled(4096, 64, 1024);
    let mut checked = std::collections::BTreeMap::<String, (usize, usize)>::new();
    for (planner, max_depth) in planners() {
        for spec in models(planner.name()) {
            let total = Inventory::new(&spec).total_bytes();
            // Below the runtime, tight, a quarter, most, and more than everything.
            for budget in [100 * MIB, 640 * MIB, total / 4 + GIB, total * 3 / 4 + GIB, 2 * total + 4 * GIB] {
                let entry = checked.entry(format!("{}@{max_depth}", planner.name())).or_default();
                match planner.plan(&spec, &w, &cost, budget) {
                    Ok(plan) => {
                        if let Err(e) = check(&plan, &spec, budget, max_depth) {
                            panic!(
                                "{} (depth ≤ {max_depth}) on {} at {budget} bytes: {e}",
                                planner.name(),
                                spec.name
                            );
                        }
                        entry.0 += 1;
                    }
                    Err(PlanError::Infeasible { min_budget_bytes, min, .. }) => {
                        assert!(
                            min_budget_bytes > budget && min.total() <= min_budget_bytes,
                            "{}",
                            planner.name()
                        );
                        entry.1 += 1;
                    }
                    Err(e) => panic!("{} on {} at {budget} bytes: {e}", planner.name(), spec.name),
                }
            }
        }
    }
    // The tester must have exercised every planner and depth, with plans and with infeasible budgets.
    assert_eq!(checked.len(), 2 + 3 * 2, "{checked:?}");
    for (name, (plans, infeasible)) in &checked {
        assert!(*plans >= 8 && *infeasible >= 1, "{name}: {plans} plans, {infeasible} infeasible");
    }
}

#[test]
fn everything_fits_on_a_large_budget() {
    let cost = cli3();
    let spec = model("nemo-4b");
    let w = filled(4096, 64, 1024);
    for name in NAMES.into_iter().filter(|n| *n != "exhaustive") {
        let plan = by_name(name).unwrap().plan(&spec, &w, &cost, 64 * GIB).unwrap();
        let layers_on_cpu = plan
            .decode
            .placements
            .iter()
            .filter(|u| u.unit.layer().is_some() && u.placement == Placement::Cpu)
            .count();
        assert_eq!(layers_on_cpu, 0, "{name} leaves decoder units on the CPU with 64 GiB");
    }
}

#[test]
fn unknown_names_are_refused() {
    assert!(by_name("magic").is_none());
    assert_eq!(
        NAMES.iter().filter_map(|n| by_name(n)).map(|p| p.name().to_string()).collect::<Vec<_>>(),
        NAMES
    );
}

#[test]
fn invalid_workloads_are_errors() {
    let cost = cli3();
    let bad = Workload { ubatch: 0, ..filled(1024, 10, 512) };
    for name in NAMES {
        let e = by_name(name).unwrap().plan(&model("nemo-4b").truncated(1).unwrap(), &bad, &cost, 4 * GIB);
        assert!(matches!(e, Err(PlanError::Workload(_))), "{name}: {e:?}");
    }
}

#[test]
fn exhaustive_refuses_large_spaces_and_says_what_to_do() {
    let e = Exhaustive::default().plan(&model("qwen3-30b-a3b"), &filled(1024, 10, 512), &cli3(), 8 * GIB);
    let Err(PlanError::Unsupported { reason, .. }) = e else { panic!("{e:?}") };
    assert!(reason.contains("truncate") && reason.contains("ilp") && reason.contains("layouts"), "{reason}");
}

/// Models for the budget property: small enough to plan fast in a debug build.
fn property_models() -> Vec<ModelSpec> {
    vec![
        model("nemo-4b").truncated(4).unwrap(),
        small_moe(3, 8),
        model("qwen3-30b-a3b").truncated(6).unwrap(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any budget either plans within itself or is infeasible with a minimum that plans when retried.
    #[test]
    fn infeasible_budgets_name_a_minimum_that_works(
        budget_mib in 1u64..3000,
        which in 0usize..3,
        planner in proptest::sample::select(vec!["ngl", "pshard", "greedy", "ilp"]),
        fixed_ngl in proptest::option::of(0u32..8),
    ) {
        let cost = cli3();
        let spec = &property_models()[which];
        let w = filled(2048, 32, 512);
        let p: Box<dyn Planner> = match (planner, fixed_ngl) {
            ("ngl", Some(n)) => Box::new(Ngl { fixed_layers: Some(n), ..Ngl::default() }),
            _ => by_name(planner).unwrap(),
        };
        let budget = budget_mib * MIB;
        match p.plan(spec, &w, &cost, budget) {
            Ok(plan) => prop_assert!(check(&plan, spec, budget, 0).is_ok(), "{:?}", check(&plan, spec, budget, 0)),
            Err(PlanError::Infeasible { min_budget_bytes, .. }) => {
                prop_assert!(min_budget_bytes > budget);
                let retried = p.plan(spec, &w, &cost, min_budget_bytes);
                prop_assert!(retried.is_ok(), "{planner} at its own minimum {min_budget_bytes}: {retried:?}");
                let plan = retried.unwrap();
                prop_assert!(check(&plan, spec, min_budget_bytes, 0).is_ok());
            }
            Err(e) => prop_assert!(false, "{planner}: {e}"),
        }
    }
}
