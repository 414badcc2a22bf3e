//! The CPU sections in tiny mode, with the GPU side from a derived profile: what CI can run without a device.

use std::path::Path;

use pipeshard_core::cost::{CostModel, OpContext, TableCostModel};
use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::UnitId;
use pipeshard_core::profile::{Profile, Provenance};
use pipeshard_core::reference;
use pipeshard_core::workload::{Op, OpClass, OpKind};
use pipeshard_profiler::{Config, Mode, Progress, measure};

struct Quiet;

impl Progress for Quiet {
    fn section(&self, _: &str, _: u64) {}
    fn step(&self, _: &str) {}
}

/// The CPU-only tiny grid on 1 and 2 threads, GPU sections from cli3.
fn tiny_config() -> Config {
    Config {
        mode: Mode::Tiny,
        name: "ci".into(),
        threads: vec![1, 2],
        gpu_from: Some(reference::derived("cli3").unwrap()),
        host_only: false,
        gpu_experts: false,
        gpu_decode_attention: false,
        command: "test".into(),
        commit: "test".into(),
        date: "2026-11-30T00:00:00Z".into(),
    }
}

fn tiny_profile() -> Profile {
    measure(&tiny_config(), &Quiet).unwrap()
}

/// Copies of more bytes never take less time, on every committed profile and the tiny one.
fn assert_copies_monotone(name: &str, p: &Profile) {
    let m = TableCostModel::new(p);
    let mut prev = [0u64; 4];
    let mut bytes = 1u64;
    while bytes <= 4 << 30 {
        let t =
            [m.h2d_ns(bytes, true), m.d2h_ns(bytes, true), m.h2d_ns(bytes, false), m.d2h_ns(bytes, false)];
        for i in 0..4 {
            assert!(
                t[i] >= prev[i],
                "{name}: copy {i} of {bytes} bytes takes {} ns < {} ns for fewer",
                t[i],
                prev[i]
            );
        }
        prev = t;
        bytes = bytes * 5 / 4 + 1;
    }
}

#[test]
fn tiny_cpu_profile_loads_interpolates_and_round_trips() {
    let p = tiny_profile();
    // Valid and stable through JSON.
    let back = Profile::from_json("tiny.json", &p.to_json()).unwrap();
    assert_eq!(back, p);
    assert!(matches!(p.provenance, Provenance::Measured { .. }));
    assert!(p.notes.iter().any(|n| n.contains("cli3")), "the base profile is named: {:?}", p.notes);
    // Every thread count measured the DRAM and the matmul grid, with spreads.
    assert_eq!(p.dram.iter().map(|d| d.threads).collect::<Vec<_>>(), vec![1, 2]);
    assert!(p.dram.iter().all(|d| d.gbps > 0.0 && d.spread.is_some()));
    // The disturbance check reads the host with one probe at both ends of the run (like with like).
    for when in ["start", "end"] {
        let probe =
            p.measurements.iter().find(|m| m.name.starts_with(&format!("host DRAM read at the {when}")));
        assert!(probe.is_some_and(|m| m.value > 0.0 && m.unit == "GB/s"), "the {when} probe: {probe:?}");
    }
    for (t, want) in [(1, 4), (2, 6)] {
        for d in [DType::Bf16, DType::Q4_0] {
            let n = p
                .cpu
                .ops
                .iter()
                .filter(|r| r.op == OpClass::MatMul && r.threads == t && r.dtype == d && r.n != 2048)
                .count();
            assert_eq!(
                n, want,
                "2 shapes × 2 token counts at {t} threads in {d}, and a prefill-sized row each at the most"
            );
        }
    }
    // The output head in bf16 on the most threads, at the batched-decode row counts only.
    let head: Vec<_> = p.cpu.ops.iter().filter(|r| r.op == OpClass::MatMul && r.n == 2048).collect();
    assert_eq!(
        head.iter().map(|r| (r.k, r.tokens, r.threads, r.dtype)).collect::<Vec<_>>(),
        vec![(256, 4, 2, DType::Bf16)]
    );
    // Routed experts (exec's expert block) on the most threads, one row per tokens-per-expert count.
    let experts: Vec<_> = p.cpu.ops.iter().filter(|r| r.op == OpClass::Experts).collect();
    assert_eq!(
        experts.iter().map(|r| (r.tokens, r.threads, r.dtype)).collect::<Vec<_>>(),
        vec![(1, 2, DType::Bf16), (4, 2, DType::Bf16), (1, 2, DType::Q4_0), (4, 2, DType::Q4_0)],
        "every format: the block's own work (gather, SwiGLU, scatter, the short down projection) is not in the \
         matmul rows, quantised or not"
    );
    // Decode attention at every thread count; prefill attention (16 queries) on the most threads, over the
    // same average keys as a decode row, so the cost model interpolates between them in tokens.
    let attn: Vec<_> = p.cpu.ops.iter().filter(|r| r.op == OpClass::Attention).collect();
    assert!(attn.iter().any(|r| r.tokens == 1 && r.threads == 1));
    let prefill = attn.iter().find(|r| r.tokens == 16).expect("a prefill attention row");
    assert_eq!(prefill.threads, 2);
    assert!(attn.iter().any(|r| r.tokens == 1 && r.k == prefill.k && r.threads == 2));
    // Batched decode attention (2 sequences, each over the prefill rows' keys) on the most threads; the GPU's
    // rows of it come from the base profile (none in cli3) unless `gpu_decode_attention` measures them.
    let batched: Vec<_> = p.cpu.ops.iter().filter(|r| r.op == OpClass::AttentionDecode).collect();
    assert_eq!(
        batched.iter().map(|r| (r.tokens, r.k, r.threads)).collect::<Vec<_>>(),
        vec![(2, prefill.k, 2)]
    );
    assert!(!p.gpu.ops.iter().any(|r| r.op == OpClass::AttentionDecode));
    assert!(p.cpu.ops.iter().all(|r| r.spread.is_some_and(|s| s >= 0.0)));
    // The host's routing of a 1024-token chunk is timed (tens of ns to a few µs a token on any CPU).
    assert!((10..20_000).contains(&p.host_route_ns_per_token), "{}", p.host_route_ns_per_token);

    // The cost model reproduces every measured matmul row, unless the row beat the measured roofline (small
    // matrices served from cache), where it predicts the roofline.
    let m = TableCostModel::new(&p);
    for r in p.cpu.ops.iter().filter(|r| r.op == OpClass::MatMul) {
        let (mf, n, k) = (r.tokens as f64, r.n as f64, r.k as f64);
        let op = Op {
            kind: OpKind::MatMul { n: r.n, k: r.k },
            unit: UnitId::TokenEmbd,
            tokens: r.tokens,
            dtype: r.dtype,
            flops: 2.0 * mf * n * k,
            weight_bytes: r.dtype.tensor_bytes(r.k, r.n).unwrap() as f64,
            act_bytes: 4.0 * mf * (n + k),
            kv_bytes: 0.0,
        };
        let ctx = OpContext::cpu(r.threads);
        let want = (r.time_ns as f64).max(m.roofline_ns(&op, ctx) as f64);
        let got = m.op_ns(&op, ctx) as f64;
        assert!((got - want).abs() <= 0.01 * want + 1.0, "{r:?}: predicted {got} ns, expected {want} ns");
    }
    // A routed-experts op of one touched expert is costed by the expert rows, not the matmul rows.
    for r in experts {
        let (mf, n, k) = (r.tokens as f64, r.n as f64, r.k as f64);
        let op = Op {
            kind: OpKind::Experts {
                n_experts: 1,
                touched: 1.0,
                tokens_per_touched: mf,
                ffn: r.n,
                hidden: r.k,
            },
            unit: UnitId::TokenEmbd,
            tokens: r.tokens,
            dtype: r.dtype,
            flops: 6.0 * mf * n * k,
            weight_bytes: 3.0 * r.dtype.tensor_bytes(r.k, r.n).unwrap() as f64,
            act_bytes: 4.0 * mf * (2.0 * k + 3.0 * n),
            kv_bytes: 0.0,
        };
        let ctx = OpContext::cpu(r.threads);
        let want = (r.time_ns as f64).max(m.roofline_ns(&op, ctx) as f64);
        let got = m.op_ns(&op, ctx) as f64;
        assert!((got - want).abs() <= 0.02 * want + 1.0, "{r:?}: predicted {got} ns, expected {want} ns");
    }
    assert_copies_monotone("tiny", &p);
}

#[test]
fn committed_profiles_never_copy_more_bytes_faster() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") {
            let p = Profile::load(&path).unwrap();
            assert_copies_monotone(&path.display().to_string(), &p);
            n += 1;
        }
    }
    assert!(n >= 3, "found only {n} profiles in {}", dir.display());
}

#[test]
fn copy_curves_are_capped_where_interpolation_would_make_more_bytes_faster() {
    use pipeshard_core::profile::BwPoint;
    let pt = |kib: u64, gbps: f64| BwPoint { bytes: kib << 10, gbps, spread: None };
    // 2.9 → 9.3 GB/s from 64 to 256 KiB: more than 1 + ln 4 times, so 256 KiB is lowered; the rest stands.
    let mut curve = vec![pt(64, 2.9), pt(256, 9.3), pt(1024, 11.0), pt(4096, 12.0)];
    let notes = pipeshard_profiler::gpu::monotone_copy_curve("pageable H2D", &mut curve);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("256 KiB"), "{}", notes[0]);
    assert!((curve[1].gbps - 2.9 * (1.0 + 4f64.ln())).abs() < 1e-12);
    assert_eq!((curve[2].gbps, curve[3].gbps), (11.0, 12.0));
    let mut p = reference::derived("cli3").unwrap();
    p.pcie.h2d_pageable = curve;
    assert_copies_monotone("capped", &p);
}

/// Ctrl-C during a measurement (here: raised after the third step) stops it at the next step with
/// `Interrupted`, producing no profile.
#[test]
fn an_interrupt_stops_the_measurement() {
    use std::cell::Cell;
    struct StopAfter(Cell<u32>);
    impl Progress for StopAfter {
        fn section(&self, _: &str, _: u64) {}
        fn step(&self, _: &str) {
            self.0.set(self.0.get() + 1);
        }
        fn interrupted(&self) -> bool {
            self.0.get() >= 3
        }
    }
    let cfg = tiny_config();
    let progress = StopAfter(Cell::new(0));
    let e = measure(&cfg, &progress).unwrap_err();
    assert!(matches!(e, pipeshard_profiler::ProfilerError::Interrupted), "{e}");
    assert_eq!(progress.0.get(), 3, "no step after the interrupt");
}

/// A host-only run measures PCIe and launches with the GPU: without one it says so and how to measure the CPU
/// alone, rather than keeping the base profile's host figures. (On a machine with a GPU it would measure for
/// minutes: skipped there.)
#[test]
fn a_host_only_run_needs_a_gpu() {
    if pipeshard_exec::cuda::probe().is_ok() {
        eprintln!("skipped: a GPU is present");
        return;
    }
    let cfg = Config { host_only: true, ..tiny_config() };
    let e = measure(&cfg, &Quiet).unwrap_err();
    assert!(matches!(e, pipeshard_profiler::ProfilerError::NoGpu(_)), "{e}");
    assert!(e.to_string().contains("--cpu-only --gpu-from"), "{e}");
}
