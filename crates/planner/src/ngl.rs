//! `ngl`: llama.cpp's layer offload (`-ngl N`), the paper's baseline as it ran it (llama.cpp b6097).
//!
//! - The **last** N decoder layers go to the GPU whole (attention, router, FFN or every expert, and their KV
//!   at full context); the others stay on the CPU with their KV. The output head goes to the GPU only when
//!   `N > n_layers` (llama.cpp counts it as layer `n_layers`); the token embedding always stays on the CPU.
//! - No streaming and no pipelining. Steps of at least [`OP_OFFLOAD_MIN_TOKENS`] tokens (prefill ubatches,
//!   and decode steps of that many parallel requests) run the matmuls of CPU-resident
//!   layers on the GPU after copying their weights, every step, without overlap (llama.cpp's op offload),
//!   and their attention too, after copying the cache view it reads (ggml's scheduler expands the offloaded
//!   projections' GPU assignment to the weightless attention ops between them).
//! - **Pageable host memory** (`host_pageable`): llama.cpp maps the model file (`--mmap`, the default, under
//!   which it does not use its pinned host buffer) and mallocs the CPU layers' cache, so those copies go at
//!   the pageable rate.
//! - **Flash attention off**, as in the paper's single-request baseline: the plan's workload has
//!   `flash_attn = false`, so the score matrix counts in scratch and attention time. [`Ngl::flash_attn`] turns
//!   it on (the batched runs of Table 9 / Figure 7 pass `-fa` to both sides; the executor implements flash
//!   attention only).
//! - **Per-sequence KV** (`kv_unified = false`), as llama.cpp runs without `-kvu`: with parallel requests each
//!   sequence's attention reads its own cache only.
//! - VRAM: runtime overhead + offloaded weights + their KV + llama.cpp's CUDA compute buffer, which it sizes
//!   once, for a worst-case ubatch of `min(ctx, ubatch)` tokens over the full KV with every row producing
//!   logits: the residual stream, plus the attention temporaries (with the scores over all keys) when some
//!   attention runs on the GPU, or the FFN intermediates, whichever is larger, plus the logits when the head
//!   is on the GPU, plus (op offload) the most weights it stages at once for a CPU-resident layer — one
//!   unit's offloaded ops, or all of a layer's routed experts, as ggml's scheduler copies a split's weight inputs together and
//!   as the simulator and executor stage them ([`Estimator::offload_staged_bytes`]). The reserve graph asks
//!   logits of every row (llama.cpp `graph_reserve(n_tokens, n_seqs, n_tokens)`), so with the head on the CPU
//!   op offload stages the head's weights whole beside those logits: that split peaks at residual + head +
//!   logits, after the layers' buffers are freed (the larger of the two counts; only with
//!   [`Ngl::reserve_cpu_head`]). Both phases use the same allocation.
//! - `fixed_layers: None` picks the largest N that fits (what "manually tuned" means in the paper);
//!   `Some(n)` replays a given N (values above `n_layers + 1` mean "everything", as in llama.cpp).

use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::Inventory;
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PhaseKind, Placement, Plan, VramBreakdown};
use pipeshard_core::workload::{ACT_BYTES, Phase, Workload, scratch_parts};

use crate::estimate::{Estimator, Layout, OP_OFFLOAD_MIN_TOKENS};
use crate::{Decision, PlanError, Planner, assemble};

/// The llama.cpp baseline (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ngl {
    /// `Some(n)`: offload exactly `n` layers (`-ngl n`); `None`: the largest `n` that fits.
    pub fixed_layers: Option<u32>,
    /// Run with flash attention (`-fa`); off by default, as the paper's Table 4 / Figure 2 baseline.
    pub flash_attn: bool,
    /// Count the reserve graph's CPU output head (see the module docs): what the process really allocates,
    /// which Table 8's OOM cells measure. Off by default: the `-ngl N` the paper tuned for its LLM runs fit
    /// our model only without it (`tests/ngl_replay.rs`: 77% of short-context cells within ±2 without it, 63% with it).
    pub reserve_cpu_head: bool,
}

impl Planner for Ngl {
    fn name(&self) -> &'static str {
        "ngl"
    }

    fn plan(
        &self,
        spec: &ModelSpec,
        workload: &Workload,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> Result<Plan, PlanError> {
        workload.validate()?;
        let w = Workload { flash_attn: self.flash_attn, kv_unified: false, host_pageable: true, ..*workload };
        let inv = Inventory::shared(spec);
        let est = Estimator::new(spec, &inv, &w, cost);
        let model = Offload::new(spec, &w, &est, self.reserve_cpu_head);
        let max_n = spec.text.n_layers + 1;
        // Fixed: exactly that N (above n_layers + 1 means everything); automatic: the largest N that fits.
        let candidates: Vec<u32> = match self.fixed_layers {
            Some(n) => vec![n.min(max_n)],
            None => (0..=max_n).rev().collect(),
        };
        let Some(n) = candidates.iter().copied().find(|&n| model.vram(n).total() <= budget_bytes) else {
            let min =
                candidates.iter().map(|&n| model.vram(n)).min_by_key(VramBreakdown::total).expect("n ≥ 0");
            return Err(PlanError::Infeasible { budget_bytes, min_budget_bytes: min.total(), min });
        };
        let layout = model.layout(n);
        let vram = model.vram(n);
        let op_offload = model.op_offload(PhaseKind::Prefill);
        let notes = vec![
            format!(
                "-ngl {n}{}",
                if self.fixed_layers.is_some() { " (fixed)" } else { " (largest that fits)" }
            ),
            if self.flash_attn {
                "flash attention on (-fa)".into()
            } else {
                "flash attention off (the paper's baseline)".into()
            },
        ];
        Ok(assemble(
            self.name(),
            spec,
            &inv,
            &est,
            &w,
            budget_bytes,
            Decision {
                prediction: est.predict(&layout, &layout, op_offload),
                prefill: layout.clone(),
                decode: layout,
                prefill_vram: vram,
                decode_vram: vram,
                prefill_op_offload: op_offload,
                decode_op_offload: model.op_offload(PhaseKind::Decode),
                notes,
            },
        ))
    }
}

/// VRAM of `-ngl n` for one model and workload.
struct Offload<'a> {
    est: &'a Estimator,
    n_layers: u32,
    /// Reserve-time scratch terms (ubatch of `min(ctx, ubatch)` tokens over the full KV).
    residual: u64,
    attention: u64,
    ffn: u64,
    logits: u64,
    /// Weights of the output head (the token embedding when tied) the reserve graph stages, when counted.
    head_bytes: Option<u64>,
    reserve_tokens: u64,
}

impl<'a> Offload<'a> {
    fn new(spec: &ModelSpec, w: &Workload, est: &'a Estimator, reserve_cpu_head: bool) -> Offload<'a> {
        let tokens = w.ctx.min(w.ubatch);
        let reserve = Phase::Prefill { tokens, start_pos: w.ctx - tokens, last: false };
        let parts = scratch_parts(spec, w, reserve);
        Offload {
            est,
            n_layers: spec.text.n_layers,
            residual: parts.residual_bytes,
            attention: parts.attention_bytes,
            ffn: parts.ffn_bytes,
            logits: (tokens as f64 * spec.text.vocab as f64 * ACT_BYTES) as u64,
            head_bytes: reserve_cpu_head.then(|| {
                est.unit_bytes[est.structure.output]
                    + if spec.text.tied_embeddings { est.unit_bytes[est.structure.token_embd] } else { 0 }
            }),
            reserve_tokens: tokens,
        }
    }

    /// Whether llama.cpp's op offload runs in `phase`: its steps (a prefill ubatch, or one token of each of the
    /// batch's sequences) reach [`OP_OFFLOAD_MIN_TOKENS`].
    fn op_offload(&self, phase: PhaseKind) -> bool {
        self.est.costs(phase).tier_tokens >= OP_OFFLOAD_MIN_TOKENS
    }

    /// First GPU layer of `-ngl n`.
    fn first_gpu_layer(&self, n: u32) -> u32 {
        self.n_layers - n.min(self.n_layers)
    }

    fn layout(&self, n: u32) -> Layout {
        let st = &self.est.structure;
        let mut layout = Layout::all_cpu(st, self.est.unit_bytes.len());
        for (l, lu) in st.layers.iter().enumerate().skip(self.first_gpu_layer(n) as usize) {
            for pos in
                [Some(lu.attn), Some(lu.kv), lu.router, lu.ffn, lu.shared_experts].into_iter().flatten()
            {
                layout.placements[pos] = Placement::Pinned;
            }
            layout.experts[l] = [lu.experts.len() as u32, 0, 0];
        }
        if n > self.n_layers {
            layout.placements[st.output] = Placement::Pinned;
            if st.tied_embeddings {
                layout.placements[st.token_embd] = Placement::Pinned;
            }
        }
        layout
    }

    fn vram(&self, n: u32) -> VramBreakdown {
        let first = self.first_gpu_layer(n);
        let any_layer = first < self.n_layers;
        let head = n > self.n_layers;
        // Op offload needs the compute buffer even with no layer on the GPU.
        let offloading = self.reserve_tokens >= OP_OFFLOAD_MIN_TOKENS;
        let scratch = if any_layer || head || offloading {
            let work = self.ffn.max(if any_layer { self.attention } else { 0 });
            let staging = if offloading { self.est.offload_staged_bytes(&self.layout(n)) } else { 0 };
            let layers = work + if head { self.logits } else { 0 } + staging;
            // The reserve graph asks logits of every row, so a CPU head meets op offload there: its weights
            // are staged whole beside the logits, after the layers' buffers are freed.
            let cpu_head = match self.head_bytes {
                Some(b) if offloading && !head => b + self.logits,
                _ => 0,
            };
            self.residual + layers.max(cpu_head)
        } else {
            0
        };
        self.est.vram_with_scratch(&self.layout(n), scratch)
    }
}
