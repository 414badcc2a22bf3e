//! Tiny model specs for tests (here, in the GPU test binary and in the CLI's checks): small enough for the f64
//! reference, with every feature the kernels branch on; hand-made plans; and the batched-vs-independent-runs check
//! the CPU and GPU tests share.

use pipeshard_core::dtype::DType;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::{ModelSpec, WeightFormat, parse_hf_config};
use pipeshard_core::plan::{
    PLAN_SCHEMA_VERSION, PhaseKind, PhasePlan, Placement, Plan, UnitPlacement, VramBreakdown,
};
use pipeshard_core::workload::{Phase, Workload, scratch_bytes};

use crate::cuda::Gpu;
use crate::weights::ModelWeights;
use crate::{Result, RunOptions, RunOutput, run};

fn spec(name: &str, json: &str) -> ModelSpec {
    parse_hf_config(name, json, name, WeightFormat::uniform(DType::Bf16)).expect("tiny configs parse")
}

/// A llama-style model: 3 layers, hidden 128, 4 query heads of 32 over 2 KV heads, SwiGLU 256, vocab 512.
#[must_use]
pub fn tiny_spec() -> ModelSpec {
    spec(
        "tiny-llama",
        r#"{"model_type":"llama","hidden_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "num_hidden_layers":3,"intermediate_size":256,"vocab_size":512,"rope_theta":10000.0,
            "rms_norm_eps":1e-5,"max_position_embeddings":4096}"#,
    )
}

/// A nemotron-style model: LayerNorm with bias, squared-ReLU FFN, half the head dimensions rotated.
#[must_use]
pub fn tiny_nemotron_spec() -> ModelSpec {
    spec(
        "tiny-nemotron",
        r#"{"model_type":"nemotron","hidden_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "head_dim":32,"num_hidden_layers":2,"intermediate_size":192,"vocab_size":384,
            "partial_rotary_factor":0.5,"rope_theta":10000,"norm_eps":1e-5,"max_position_embeddings":4096}"#,
    )
}

/// A qwen3-style model: per-head q/k RMSNorm, head_dim 64 independent of hidden.
#[must_use]
pub fn tiny_qwen3_spec() -> ModelSpec {
    spec(
        "tiny-qwen3",
        r#"{"model_type":"qwen3","hidden_size":128,"num_attention_heads":4,"num_key_value_heads":1,
            "head_dim":64,"num_hidden_layers":2,"intermediate_size":256,"vocab_size":320,
            "rope_theta":1000000.0,"rms_norm_eps":1e-6,"max_position_embeddings":4096}"#,
    )
}

/// A Qwen3-MoE-style model: 3 layers of 8 routed SwiGLU experts (intermediate 64), top-2 with renormalised
/// routing weights, q/k RMSNorm. Its matrices are f16, not bf16: routing is discrete, and at a near-tie two
/// correct implementations may pick different experts; f16 activations carry 3 more bits than bf16, so against
/// unrounded references (the f64 one, transformers in f32) such flips are 8× rarer.
#[must_use]
pub fn tiny_qwen3_moe_spec() -> ModelSpec {
    spec(
        "tiny-qwen3-moe",
        r#"{"model_type":"qwen3_moe","hidden_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "head_dim":32,"num_hidden_layers":3,"intermediate_size":256,"moe_intermediate_size":64,
            "num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,"decoder_sparse_step":1,
            "mlp_only_layers":[],"vocab_size":320,"rope_theta":1000000.0,"rms_norm_eps":1e-6,
            "max_position_embeddings":4096}"#,
    )
    .with_uniform_weights(DType::F16)
}

/// [`tiny_spec`] widened for the K-quants, whose rows hold whole 256-element super-blocks: 2 layers, hidden 256,
/// 4 query heads of 64 over 2 KV heads, SwiGLU 512.
#[must_use]
pub fn tiny_k_spec() -> ModelSpec {
    spec(
        "tinyk-llama",
        r#"{"model_type":"llama","hidden_size":256,"num_attention_heads":4,"num_key_value_heads":2,
            "num_hidden_layers":2,"intermediate_size":512,"vocab_size":512,"rope_theta":10000.0,
            "rms_norm_eps":1e-5,"max_position_embeddings":4096}"#,
    )
}

/// [`tiny_qwen3_moe_spec`] widened for the K-quants: hidden 256, 2 layers of 8 experts of intermediate 256.
#[must_use]
pub fn tiny_qwen3_moe_k_spec() -> ModelSpec {
    spec(
        "tinyk-qwen3-moe",
        r#"{"model_type":"qwen3_moe","hidden_size":256,"num_attention_heads":4,"num_key_value_heads":2,
            "head_dim":64,"num_hidden_layers":2,"intermediate_size":512,"moe_intermediate_size":256,
            "num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,"decoder_sparse_step":1,
            "mlp_only_layers":[],"vocab_size":320,"rope_theta":1000000.0,"rms_norm_eps":1e-6,
            "max_position_embeddings":4096}"#,
    )
}

/// A plan built by rule instead of by a planner: `place(phase, unit)` gives every unit's placement (KV units
/// included), `depth` the ring depth where anything streams. The VRAM breakdown is computed the way the plan
/// schema defines it (scratch from `pipeshard_core::workload::scratch_bytes`), with `overhead_bytes` as the
/// planned runtime overhead, so the plan validates against `budget_bytes` when it fits.
#[must_use]
pub fn manual_plan(
    spec: &ModelSpec,
    workload: Workload,
    budget_bytes: u64,
    overhead_bytes: u64,
    depth: u32,
    threads: u32,
    place: impl Fn(PhaseKind, UnitId) -> Placement,
) -> Plan {
    let inv = Inventory::new(spec);
    let kv_layer = workload.kv_bytes_per_layer(spec);
    let phase_plan = |phase: PhaseKind| {
        let placements: Vec<UnitPlacement> =
            inv.units.iter().map(|u| UnitPlacement { unit: u.id, placement: place(phase, u.id) }).collect();
        let bytes = |u: UnitId| if matches!(u, UnitId::Kv { .. }) { kv_layer } else { inv.unit_bytes(u) };
        let probe = PhasePlan {
            phase,
            tier_tokens: 0,
            pipeline_depth: 0,
            slot_bytes: 0,
            placements: placements.clone(),
            op_offload: false,
            cpu_threads: threads,
            vram: VramBreakdown::default(),
        };
        let groups = probe.stream_groups(&inv, kv_layer);
        // The executor aligns the KV inside a shared slot to 256 bytes; leave room for it.
        let slot_bytes = groups.iter().map(|g| g.bytes + 256).max().unwrap_or(0);
        let pipeline_depth = if groups.is_empty() { 0 } else { depth };
        let pinned = |kv: bool| {
            placements
                .iter()
                .filter(|p| p.placement == Placement::Pinned && matches!(p.unit, UnitId::Kv { .. }) == kv)
                .map(|p| bytes(p.unit))
                .sum::<u64>()
        };
        let (tier_tokens, ph) = match phase {
            PhaseKind::Prefill => {
                let n = workload.ubatch.min(workload.prompt_tokens);
                (n, Phase::Prefill { tokens: n, start_pos: workload.prompt_tokens - n, last: true })
            }
            PhaseKind::Decode => {
                (workload.batch, workload.decode_step(workload.gen_tokens.saturating_sub(1)))
            }
        };
        let vram = VramBreakdown {
            pinned_weights_bytes: pinned(false),
            streaming_slots_bytes: u64::from(pipeline_depth) * slot_bytes,
            kv_bytes: pinned(true),
            scratch_bytes: scratch_bytes(spec, &workload, ph),
            runtime_overhead_bytes: overhead_bytes,
        };
        PhasePlan {
            phase,
            tier_tokens,
            pipeline_depth,
            slot_bytes,
            placements,
            op_offload: false,
            cpu_threads: threads,
            vram,
        }
    };
    Plan {
        schema_version: PLAN_SCHEMA_VERSION,
        planner: "manual".into(),
        model: spec.name.clone(),
        weights: Some(spec.weights.clone()),
        budget_bytes,
        workload,
        prefill: phase_plan(PhaseKind::Prefill),
        decode: phase_plan(PhaseKind::Decode),
        switch_bytes: 0,
        prediction: None,
        notes: vec!["hand-made plan (pipeshard_exec::testing::manual_plan)".into()],
    }
}

/// `count` pseudo-random token ids below `vocab`, from `seed`.
#[must_use]
pub fn random_tokens(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed ^ 0x5851_F42D_4C95_7F2D;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// A batched run against independent ones: `plan` (a workload of R = `prompts.len()` parallel requests) run
/// on `gpu` (or the CPU) with every sequence's decode fed `force`, and each prompt run alone, all on the CPU
/// (`threads`), with the same inputs. Returns the batched run and the largest relative logits error of any
/// sequence's token against its own run (`reference::rel_err`).
pub fn batched_vs_single(
    w: &ModelWeights,
    plan: &Plan,
    gpu: Option<&Gpu>,
    prompts: &[Vec<u32>],
    force: &[u32],
    threads: u32,
) -> Result<(RunOutput, f64)> {
    let (r, n_gen) = (prompts.len(), force.len());
    assert_eq!(plan.workload.batch as usize, r, "one prompt per parallel request");
    let opts = |prompt: &[u32], others: &[Vec<u32>]| RunOptions {
        prompt: prompt.to_vec(),
        other_prompts: others.to_vec(),
        gen_tokens: n_gen,
        force_tokens: Some(force.to_vec()),
        keep_logits: true,
        ..RunOptions::default()
    };
    let batched = run(w, plan, gpu, &opts(&prompts[0], &prompts[1..]))?;
    let single = Workload { batch: 1, kv_unified: false, ..plan.workload };
    let cpu = manual_plan(&w.spec, single, plan.budget_bytes, 0, 0, threads, |_, _| Placement::Cpu);
    let mut max_err = 0f64;
    for (s, prompt) in prompts.iter().enumerate() {
        let alone = run(w, &cpu, None, &opts(prompt, &[]))?;
        assert_eq!(batched.logits.len(), (n_gen + 1) * r, "a token of every sequence per step");
        for (i, lg) in alone.logits.iter().enumerate() {
            let b64: Vec<f64> = lg.iter().map(|&x| f64::from(x)).collect();
            max_err = max_err.max(crate::reference::rel_err(&batched.logits[i * r + s], &b64));
        }
    }
    Ok((batched, max_err))
}

/// Writes `w`'s tensors as a GGUF file at `path`: `general.architecture` = `arch` (a `llama` file stores its
/// `attn_q`/`attn_k` rows interleaved for ggml's RoPE, as llama.cpp's converter does) and every expert slice
/// merged back into its `*_exps` tensor. The header comes from [`pipeshard_core::gguf::write_header`].
///
/// # Errors
/// If the file cannot be written.
pub fn write_gguf(
    w: &crate::weights::ModelWeights,
    arch: &str,
    path: &std::path::Path,
) -> std::io::Result<()> {
    use pipeshard_core::gguf::{GgufValue, dtype_of_ggml, write_header};
    const ALIGN: u64 = 32;
    // (name, dims outer first, format, bytes), experts appended in inventory order.
    let mut tensors: Vec<(String, Vec<u64>, DType, Vec<u8>)> = Vec::new();
    for u in w.units() {
        for t in &u.tensors {
            let bytes = &u.buf.as_slice()[t.offset..t.offset + t.bytes];
            let dtype = t.quant.map_or_else(|| t.elem.dtype(), crate::quant::QFormat::dtype);
            if let Some(x) = tensors.iter_mut().find(|x| x.0 == t.name) {
                // The next expert of a merged tensor.
                x.1[0] += 1;
                x.3.extend_from_slice(bytes);
            } else {
                let mut dims: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
                if t.expert.is_some() {
                    dims.insert(0, 1);
                }
                tensors.push((t.name.clone(), dims, dtype, bytes.to_vec()));
            }
        }
    }
    if arch == "llama" {
        for (name, dims, _, bytes) in &mut tensors {
            let heads = if name.ends_with("attn_q.weight") {
                w.dims.n_heads
            } else if name.ends_with("attn_k.weight") {
                w.dims.n_kv_heads
            } else {
                continue;
            };
            // What llama.cpp's converter does (the loader undoes it): half-row j·d/2 + i goes to row 2i + j.
            let rows = dims[0] as usize;
            let (row_bytes, d) = (bytes.len() / rows, rows / heads);
            let mut out = vec![0u8; bytes.len()];
            for h in 0..heads {
                for i in 0..d / 2 {
                    for j in 0..2 {
                        let (src, dst) =
                            ((h * d + j * d / 2 + i) * row_bytes, (h * d + 2 * i + j) * row_bytes);
                        out[dst..dst + row_bytes].copy_from_slice(&bytes[src..src + row_bytes]);
                    }
                }
            }
            *bytes = out;
        }
    }
    let ggml = |d: DType| {
        (0..64).find(|&id| dtype_of_ggml(id) == Some(d)).expect("every executor format has a ggml id")
    };
    let mut offset = 0u64;
    let dims_inner_first: Vec<Vec<u64>> =
        tensors.iter().map(|t| t.1.iter().rev().copied().collect()).collect();
    let infos: Vec<(&str, &[u64], u32, u64)> = tensors
        .iter()
        .zip(&dims_inner_first)
        .map(|((name, _, dtype, bytes), dims)| {
            let at = offset;
            offset = (offset + bytes.len() as u64).next_multiple_of(ALIGN);
            (name.as_str(), dims.as_slice(), ggml(*dtype), at)
        })
        .collect();
    let meta = [
        ("general.architecture", GgufValue::String(arch.into())),
        ("general.alignment", GgufValue::U32(ALIGN as u32)),
    ];
    let mut out = write_header(&meta, &infos);
    // Data starts at the header's end rounded up to the alignment, and every tensor at its aligned offset.
    for (_, _, _, bytes) in &tensors {
        out.resize((out.len() as u64).next_multiple_of(ALIGN) as usize, 0);
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out)
}
