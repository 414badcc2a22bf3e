//! Workloads and the ops they run.
//!
//! A [`Workload`] is what a user asks for: P prompt tokens in ubatch-sized chunks into a context of C tokens,
//! then G decode steps, for R parallel requests. [`Phase`] is one step of it: a prefill chunk of n tokens at
//! position p, or a decode step of b sequences at context c. [`ops`] lists, for a phase, every op in execution
//! order with its shapes, FLOPs and bytes, and the placement unit whose weights (or KV) it reads.
//!
//! Routed experts are one op per layer ([`OpKind::Experts`]) rather than one per expert: under uniform routing
//! the expected number of distinct experts that n tokens touch is E·(1−(1−k/E)^n), so a consumer that knows
//! how many of a layer's experts sit on each device gets the expected work per device without 128 ops.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::inventory::{Inventory, UnitId};
use crate::model::{FfnKind, ModelSpec};

/// What a user runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub prompt_tokens: u64,
    /// Context size the KV cache is allocated for (tokens per sequence).
    pub ctx: u64,
    pub gen_tokens: u64,
    pub ubatch: u64,
    /// Parallel requests (sequences) decoded together.
    pub batch: u64,
    pub kv_dtype: DType,
    /// Flash attention (no materialised score matrix). The paper's baseline runs without it.
    pub flash_attn: bool,
    /// One KV cache shared by all sequences (llama.cpp `-kvu`, which the paper's batched runs use) rather than
    /// one per sequence. Unified cells are contiguous, so a layer's new cells (or its whole cache) move in one
    /// copy instead of one per sequence; but a GPU attention kernel walks every used cell of the cache for
    /// each query, masking the other sequences' cells (see [`OpKind::Attention`]). Irrelevant for one request.
    #[serde(default)]
    pub kv_unified: bool,
    /// Host copies of the weights and of CPU-resident KV are pageable: stock llama.cpp maps the model file and
    /// allocates its CPU cache with malloc, so op offload's per-ubatch copies are staged by the driver at the
    /// pageable rate. Our executor and the paper's runtime page-lock them (the default).
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_pageable: bool,
    /// Whether the parallel requests are distinct token sequences or copies of one ([`Requests`]).
    #[serde(default, skip_serializing_if = "Requests::is_distinct")]
    pub requests: Requests,
}

/// What the parallel requests of a batched workload are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Requests {
    /// Different token sequences: a decode step's tokens route independently.
    #[default]
    Distinct,
    /// One token sequence, repeated: a decode step's tokens route alike and touch only top-k experts per
    /// layer. `llama-batched-bench`, which the paper's batched runs use, feeds token 0 to every sequence at
    /// every position.
    Identical,
}

impl Requests {
    #[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
    fn is_distinct(&self) -> bool {
        *self == Requests::Distinct
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_false(b: &bool) -> bool {
    !*b
}

impl Workload {
    /// One request: `prompt_tokens` of prompt, `gen_tokens` generated, KV for `ctx`, f16 KV, flash attention.
    #[must_use]
    pub fn single(prompt_tokens: u64, ctx: u64, gen_tokens: u64, ubatch: u64) -> Workload {
        Workload {
            prompt_tokens,
            ctx,
            gen_tokens,
            ubatch,
            batch: 1,
            kv_dtype: DType::F16,
            flash_attn: true,
            kv_unified: false,
            host_pageable: false,
            requests: Requests::Distinct,
        }
    }

    /// `batch` parallel requests of the same shape, with unified or per-sequence KV.
    #[must_use]
    pub fn batched(self, batch: u64, kv_unified: bool) -> Workload {
        Workload { batch, kv_unified, ..self }
    }

    /// Separate copies that move one layer's KV cells of a step between host and device: a prefill chunk
    /// belongs to one sequence, and a decode step's cells (or a layer's whole cache) are contiguous when the
    /// cache is unified, one run per sequence otherwise.
    #[must_use]
    pub fn kv_copies(&self, phase: Phase) -> u64 {
        match phase {
            Phase::Decode { batch, .. } if !self.kv_unified => batch,
            _ => 1,
        }
    }

    /// Checks the workload is runnable; errors name the field and the fix.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad =
            |field: &'static str, value: u64, expected: String| Err(WorkloadError { field, value, expected });
        if self.ubatch == 0 {
            return bad("ubatch", 0, "at least 1 token".into());
        }
        if self.batch == 0 {
            return bad("batch", 0, "at least 1 sequence".into());
        }
        if self.prompt_tokens == 0 {
            return bad("prompt_tokens", 0, "at least 1 token".into());
        }
        if self.ctx > MAX_CTX {
            return bad("ctx", self.ctx, format!("at most {MAX_CTX} tokens (no model has a longer context)"));
        }
        if self.batch > MAX_BATCH {
            return bad("batch", self.batch, format!("at most {MAX_BATCH} sequences"));
        }
        match self.prompt_tokens.checked_add(self.gen_tokens) {
            Some(n) if n <= self.ctx => {}
            Some(n) => return bad("ctx", self.ctx, format!("at least prompt + gen = {n} tokens")),
            None => return bad("gen_tokens", self.gen_tokens, "prompt + gen within the context".into()),
        }
        Ok(())
    }

    /// The prefill chunks, in order. With R requests each request's prompt is prefilled in turn.
    #[must_use]
    pub fn prefill_chunks(&self) -> Vec<Phase> {
        let mut v = Vec::new();
        for _ in 0..self.batch {
            let mut pos = 0;
            while pos < self.prompt_tokens {
                let n = self.ubatch.min(self.prompt_tokens - pos);
                v.push(Phase::Prefill { tokens: n, start_pos: pos, last: pos + n == self.prompt_tokens });
                pos += n;
            }
        }
        v
    }

    /// The decode step that produces generated token `i` (0-based): it attends over prompt + i tokens.
    #[must_use]
    pub fn decode_step(&self, i: u64) -> Phase {
        Phase::Decode { batch: self.batch, ctx: self.prompt_tokens + i + 1 }
    }

    /// KV bytes of one layer for the whole allocated context of every sequence.
    #[must_use]
    pub fn kv_bytes_per_layer(&self, spec: &ModelSpec) -> u64 {
        spec.kv_bytes_per_token_layer(self.kv_dtype) * self.ctx * self.batch
    }
}

/// Longest context a workload may ask for (2^32 tokens): bounds every KV size to 64 bits.
pub const MAX_CTX: u64 = 1 << 32;
/// Most sequences decoded together.
pub const MAX_BATCH: u64 = 1 << 16;

/// A workload field out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("workload: `{field}` = {value} is out of range; expected {expected}")]
pub struct WorkloadError {
    pub field: &'static str,
    pub value: u64,
    pub expected: String,
}

/// One step of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// `tokens` prompt tokens at positions `start_pos..start_pos+tokens`; `last` chunks produce logits.
    Prefill { tokens: u64, start_pos: u64, last: bool },
    /// One new token for each of `batch` sequences, each attending over `ctx` tokens (itself included).
    Decode { batch: u64, ctx: u64 },
}

impl Phase {
    /// Tokens processed by the step.
    #[must_use]
    pub fn tokens(self) -> u64 {
        match self {
            Phase::Prefill { tokens, .. } => tokens,
            Phase::Decode { batch, .. } => batch,
        }
    }

    /// Rows for which logits are computed.
    #[must_use]
    pub fn logit_rows(self) -> u64 {
        match self {
            Phase::Prefill { last, .. } => u64::from(last),
            Phase::Decode { batch, .. } => batch,
        }
    }
}

/// The family of an op, which selects its row in a cost table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    Embed,
    Norm,
    MatMul,
    Rope,
    Attention,
    Activation,
    Add,
    Router,
    Experts,
    Sample,
    /// A decode step's attention for one query of each of `tokens` sequences, each over its own `k` keys in
    /// its own cache: one kernel launch whose queries run side by side, so it is timed apart from a prefill
    /// chunk's `tokens` causal queries (profile rows only; ops stay [`OpKind::Attention`]).
    AttentionDecode,
    /// [`OpClass::AttentionDecode`] over one unified cache: each query scans all `tokens × k` cells, masked.
    AttentionDecodeUnified,
    /// One decode query's attention without flash attention (scores materialised, ggml's `mul_mat` pair with
    /// each KV head broadcast over its query heads). Only derived CPU rows time it; elsewhere it borrows the
    /// [`OpClass::Attention`] rows.
    AttentionMaterialized,
    /// A MoE layer's pinned routed experts of a step of at most [`GROUPED_EXPERTS_MAX_TOKENS`] tokens, run as
    /// one group (our executor's grouped decode kernels: f16/bf16, q8_0, q4_0, q4_k and q6_k, the quantised
    /// weights dequantised exactly as the per-expert GEMVs do; q2_k/q3_k experts stay per expert). Profile
    /// rows only, GPU; ops stay [`OpKind::Experts`]. A row's `tokens` is the number of experts in the group,
    /// each with one token.
    ExpertsGrouped,
    /// A MoE layer's pinned routed experts of a step of more than [`GROUPED_EXPERTS_MAX_TOKENS`] tokens, run in
    /// groups of three launches (our executor's tiled kernels, any format). Profile rows only, GPU; ops stay
    /// [`OpKind::Experts`]. A row's `tokens` is each expert's tokens, as for [`OpClass::Experts`], and its time
    /// one expert's share of a group of such experts as large as a prefill chunk's rows hold. Quantised experts
    /// of at most [`GROUPED_EXPERTS_MAX_TOKENS`] tokens keep their exact per-expert GEMVs (no rows there).
    ExpertsTiled,
}

/// What an op is, with the shape facts a cost model needs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    Embed,
    Norm,
    /// `tokens × k` activations times a `n × k` weight.
    MatMul {
        n: u64,
        k: u64,
    },
    Rope,
    /// `tokens` queries over on average `keys` keys (causal masking counted), per sequence. A GPU kernel walks
    /// `scanned_keys` cells per query, masked ones included: every used cell of a unified cache shared by
    /// several sequences (llama.cpp's CUDA kernels mask, the CPU kernel skips masked cells), else `keys`.
    Attention {
        q_heads: u32,
        kv_heads: u32,
        head_dim: u64,
        keys: u64,
        #[serde(default)]
        scanned_keys: u64,
        /// A decode step: `tokens` queries, one of each sequence (else one sequence's causal chunk).
        #[serde(default)]
        decode: bool,
        /// Without flash attention: the scores are materialised by two matmuls, which broadcast each KV head
        /// over its query heads.
        #[serde(default, skip_serializing_if = "is_false")]
        materialized: bool,
    },
    Activation,
    Add,
    /// Router logits, softmax and top-k.
    Router {
        n_experts: u32,
        top_k: u32,
    },
    /// All routed experts of a layer: each touched expert runs `tokens_per_touched` tokens through its
    /// gate/up/down (`flops_per_touched`, `bytes_per_expert` of weights).
    Experts {
        n_experts: u32,
        touched: f64,
        tokens_per_touched: f64,
        ffn: u64,
        hidden: u64,
    },
    Sample {
        vocab: u64,
    },
    /// A chunk's new K and V rows written into the layer's cache (one kernel on the GPU); priced as an
    /// elementwise op of its bytes.
    KvStore,
}

impl OpKind {
    #[must_use]
    pub fn class(&self) -> OpClass {
        match self {
            OpKind::Embed => OpClass::Embed,
            OpKind::Norm => OpClass::Norm,
            OpKind::MatMul { .. } => OpClass::MatMul,
            OpKind::Rope => OpClass::Rope,
            OpKind::Attention { .. } => OpClass::Attention,
            OpKind::Activation => OpClass::Activation,
            // A KV store is an elementwise copy: priced by the add rows.
            OpKind::Add | OpKind::KvStore => OpClass::Add,
            OpKind::Router { .. } => OpClass::Router,
            OpKind::Experts { .. } => OpClass::Experts,
            OpKind::Sample { .. } => OpClass::Sample,
        }
    }

    /// The profile rows that time this op best: a decode step's attention of several sequences has rows of its
    /// own ([`OpClass::AttentionDecode`], or [`OpClass::AttentionDecodeUnified`] when a query scans more cells
    /// than its own keys); every other op its [`OpKind::class`].
    #[must_use]
    pub fn row_class(&self, tokens: u64) -> OpClass {
        match *self {
            OpKind::Attention { decode: true, keys, scanned_keys, .. } if tokens > 1 => {
                if scanned_keys > keys { OpClass::AttentionDecodeUnified } else { OpClass::AttentionDecode }
            }
            OpKind::Attention { decode: true, materialized: true, .. } => OpClass::AttentionMaterialized,
            k => k.class(),
        }
    }
}

/// One op of a phase. Byte counts are the minimum traffic: each operand read once, each result written once.
/// For [`OpKind::Experts`], `flops` and `weight_bytes` are expectations over routing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub kind: OpKind,
    /// The unit whose weights the op reads; for [`OpKind::Experts`] the layer's router unit stands for all
    /// its expert units, and for attention the layer's KV unit.
    pub unit: UnitId,
    pub tokens: u64,
    /// Format of the weights read (activation format for weightless ops).
    pub dtype: DType,
    pub flops: f64,
    pub weight_bytes: f64,
    /// Activations read plus written.
    pub act_bytes: f64,
    /// KV cache read plus written.
    pub kv_bytes: f64,
}

impl Op {
    /// FLOPs the op costs on `device`: a GPU attention over a unified cache also scores the masked cells of the
    /// other sequences ([`OpKind::Attention`]'s `scanned_keys`).
    #[must_use]
    pub fn flops_on(&self, device: crate::cost::Device) -> f64 {
        match self.kind {
            OpKind::Attention { keys, scanned_keys, .. }
                if device == crate::cost::Device::Gpu && scanned_keys > keys && keys > 0 =>
            {
                self.flops * scanned_keys as f64 / keys as f64
            }
            _ => self.flops,
        }
    }

    /// All bytes moved.
    #[must_use]
    pub fn bytes(&self) -> f64 {
        self.weight_bytes + self.act_bytes + self.kv_bytes
    }

    /// Bytes `device` moves: [`Op::bytes`], except that the CPU's materialised decode attention reads each KV
    /// head once per query head of its group (ggml's CPU `mul_mat` broadcasts `K` and `V` over the query heads
    /// and streams them again for each; the paper's baseline TPS at 16K–64K falls with the query heads, not
    /// the KV bytes: ≈ 10 GB/s of KV for nemo-8b's 4 query heads per KV head, ≈ 5.5 for qwen3-30b-a3b's 8,
    /// ≈ 2.8 for qwen3-235b-a22b's 16).
    #[must_use]
    pub fn bytes_on(&self, device: crate::cost::Device) -> f64 {
        match self.kind {
            OpKind::Attention { q_heads, kv_heads, decode: true, materialized: true, .. }
                if device == crate::cost::Device::Cpu && kv_heads > 0 =>
            {
                self.bytes() + self.kv_bytes * (f64::from(q_heads / kv_heads) - 1.0).max(0.0)
            }
            _ => self.bytes(),
        }
    }

    /// FLOPs per byte moved.
    #[must_use]
    pub fn arithmetic_intensity(&self) -> f64 {
        self.flops / self.bytes().max(1.0)
    }
}

/// Bytes of an activation element (ggml keeps hidden states in f32).
pub const ACT_BYTES: f64 = 4.0;

/// Expected distinct experts that `tokens` tokens touch with top-`k` of `e` under uniform routing.
#[must_use]
pub fn expected_touched_experts(e: u32, k: u32, tokens: u64) -> f64 {
    let e = f64::from(e);
    let p_miss = 1.0 - f64::from(k) / e;
    e * (1.0 - p_miss.powf(tokens as f64))
}

/// Average keys a query attends over: prefill chunks are causal within the chunk.
fn attention_keys(phase: Phase) -> u64 {
    match phase {
        Phase::Prefill { tokens, start_pos, .. } => start_pos + tokens.div_ceil(2),
        Phase::Decode { ctx, .. } => ctx,
    }
}

/// Every op of `phase` in execution order.
#[must_use]
pub fn ops(spec: &ModelSpec, inv: &Inventory, w: &Workload, phase: Phase) -> Vec<Op> {
    let t = &spec.text;
    let m = phase.tokens();
    let mf = m as f64;
    let h = t.hidden as f64;
    let mut out = Vec::with_capacity(t.n_layers as usize * 14 + 6);
    let act = |elems: f64| elems * ACT_BYTES;
    let tensor_of = |unit: UnitId, name_suffix: &str| {
        inv.unit(unit).and_then(|u| {
            u.parts.iter().map(|p| &inv.tensors[p.tensor]).find(|tt| tt.name.ends_with(name_suffix))
        })
    };
    let matmul = |unit: UnitId, suffix: &str, tokens: u64| -> Option<Op> {
        let tt = tensor_of(unit, suffix)?;
        let (n, k) = (tt.shape[0], tt.shape[1]);
        Some(Op {
            kind: OpKind::MatMul { n, k },
            unit,
            tokens,
            dtype: tt.dtype,
            flops: 2.0 * tokens as f64 * n as f64 * k as f64,
            weight_bytes: tt.bytes as f64,
            act_bytes: act(tokens as f64 * (n + k) as f64),
            kv_bytes: 0.0,
        })
    };
    let simple = |kind: OpKind, unit: UnitId, elems: f64, flops_per: f64, weight_bytes: f64| Op {
        kind,
        unit,
        tokens: m,
        dtype: DType::F32,
        flops: elems * flops_per,
        weight_bytes,
        act_bytes: act(2.0 * elems),
        kv_bytes: 0.0,
    };

    let embd = UnitId::TokenEmbd;
    let row_bytes = inv.unit_bytes(embd) as f64 / t.vocab as f64;
    out.push(Op {
        kind: OpKind::Embed,
        unit: embd,
        tokens: m,
        dtype: spec.weights.token_embd,
        flops: mf * h,
        weight_bytes: mf * row_bytes,
        act_bytes: act(mf * h),
        kv_bytes: 0.0,
    });

    let kv_tok = spec.kv_bytes_per_token_layer(w.kv_dtype) as f64;
    let q_dim = f64::from(t.n_heads) * t.head_dim as f64;
    let kv_dim = f64::from(t.n_kv_heads) * t.head_dim as f64;
    let keys = attention_keys(phase);
    let seqs = match phase {
        Phase::Prefill { .. } => 1.0,
        Phase::Decode { batch, .. } => batch as f64,
    };
    // A unified cache holds every sequence's cells; a decode query walks all of them, masked or not.
    let scanned_keys = match phase {
        Phase::Decode { batch, ctx } if w.kv_unified => batch * ctx,
        _ => keys,
    };
    for il in 0..t.n_layers {
        let attn = UnitId::Attn { layer: il };
        let norm_bytes = tensor_of(attn, "attn_norm.weight").map_or(0.0, |tt| tt.bytes as f64);
        out.push(simple(OpKind::Norm, attn, mf * h, 3.0, norm_bytes));
        out.extend(
            ["attn_q.weight", "attn_k.weight", "attn_v.weight"].iter().filter_map(|s| matmul(attn, s, m)),
        );
        // Every kernel the executor (and llama.cpp) launches between the projections and the attention: the
        // biases, the per-head q/k norms, RoPE of q and of k, and the store of the new K and V rows. Decode runs
        // them at the launch rate, so their count matters more than their bytes.
        for (bias, dim) in [("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)] {
            if let Some(tt) = tensor_of(attn, bias) {
                out.push(simple(OpKind::Add, attn, mf * dim, 1.0, tt.bytes as f64));
            }
        }
        if t.qk_norm {
            for (norm, dim) in [("attn_q_norm.weight", q_dim), ("attn_k_norm.weight", kv_dim)] {
                let nb = tensor_of(attn, norm).map_or(0.0, |tt| tt.bytes as f64);
                out.push(simple(OpKind::Norm, attn, mf * dim, 3.0, nb));
            }
        }
        for dim in [q_dim, kv_dim] {
            out.push(simple(OpKind::Rope, attn, mf * dim * t.partial_rotary, 6.0, 0.0));
        }
        out.push(Op {
            kind: OpKind::KvStore,
            unit: UnitId::Kv { layer: il },
            tokens: m,
            dtype: w.kv_dtype,
            flops: 0.0,
            weight_bytes: 0.0,
            act_bytes: act(2.0 * mf * kv_dim) + mf * kv_tok,
            kv_bytes: 0.0,
        });
        // Per query: q·K over `keys` keys and P·V, 2 FLOPs each per head dimension.
        let score_elems = mf * keys as f64 * f64::from(t.n_heads);
        let kv_read = match phase {
            Phase::Prefill { tokens, start_pos, .. } => (start_pos + tokens) as f64 * kv_tok,
            Phase::Decode { ctx, .. } => seqs * ctx as f64 * kv_tok,
        };
        out.push(Op {
            kind: OpKind::Attention {
                q_heads: t.n_heads,
                kv_heads: t.n_kv_heads,
                head_dim: t.head_dim,
                keys,
                scanned_keys,
                decode: matches!(phase, Phase::Decode { .. }),
                materialized: !w.flash_attn,
            },
            unit: UnitId::Kv { layer: il },
            tokens: m,
            dtype: w.kv_dtype,
            flops: 4.0 * score_elems * t.head_dim as f64,
            weight_bytes: 0.0,
            // q in, output out, and without flash attention the score matrix written and read back.
            act_bytes: act(2.0 * mf * q_dim) + if w.flash_attn { 0.0 } else { 2.0 * act(score_elems) },
            kv_bytes: kv_read + mf * kv_tok,
        });
        out.extend(matmul(attn, "attn_output.weight", m));
        out.push(simple(OpKind::Add, attn, mf * h, 1.0, 0.0));

        if spec.layer_is_moe(il) {
            let moe = t.moe.as_ref().expect("layer_is_moe implies moe config");
            let router = UnitId::Router { layer: il };
            let rb = tensor_of(router, "ffn_norm.weight").map_or(0.0, |tt| tt.bytes as f64);
            out.push(simple(OpKind::Norm, router, mf * h, 3.0, rb));
            let mut r = matmul(router, "ffn_gate_inp.weight", m).expect("router tensor");
            r.kind = OpKind::Router { n_experts: moe.n_experts, top_k: moe.top_k };
            out.push(r);
            // Identical requests route a decode step's tokens alike: one token's experts.
            let routing_tokens = match phase {
                Phase::Decode { .. } if w.requests == Requests::Identical => 1,
                _ => m,
            };
            let touched = expected_touched_experts(moe.n_experts, moe.top_k, routing_tokens);
            let routed = mf * f64::from(moe.top_k);
            let expert_bytes = inv.unit_bytes(UnitId::Expert { layer: il, expert: 0 }) as f64;
            let ffn = moe.expert_ffn as f64;
            out.push(Op {
                kind: OpKind::Experts {
                    n_experts: moe.n_experts,
                    touched,
                    tokens_per_touched: routed / touched,
                    ffn: moe.expert_ffn,
                    hidden: t.hidden,
                },
                unit: router,
                tokens: m,
                dtype: spec.weights.expert_gate_up,
                flops: 2.0 * 3.0 * routed * ffn * h,
                weight_bytes: touched * expert_bytes,
                act_bytes: act(routed * (2.0 * h + 3.0 * ffn)),
                kv_bytes: 0.0,
            });
            if moe.n_shared_experts > 0 {
                let sh = UnitId::SharedExperts { layer: il };
                out.extend(
                    ["ffn_gate_shexp.weight", "ffn_up_shexp.weight"].iter().filter_map(|s| matmul(sh, s, m)),
                );
                out.push(simple(OpKind::Activation, sh, mf * moe.shared_ffn as f64, 2.0, 0.0));
                out.extend(matmul(sh, "ffn_down_shexp.weight", m));
            }
            out.push(simple(OpKind::Add, router, mf * h, 1.0, 0.0));
        } else {
            let ffn = UnitId::Ffn { layer: il };
            let nb = tensor_of(ffn, "ffn_norm.weight").map_or(0.0, |tt| tt.bytes as f64);
            out.push(simple(OpKind::Norm, ffn, mf * h, 3.0, nb));
            if t.ffn_kind == FfnKind::SwiGlu {
                out.extend(matmul(ffn, "ffn_gate.weight", m));
            }
            out.extend(matmul(ffn, "ffn_up.weight", m));
            out.push(simple(OpKind::Activation, ffn, mf * t.ffn as f64, 2.0, 0.0));
            out.extend(matmul(ffn, "ffn_down.weight", m));
            out.push(simple(OpKind::Add, ffn, mf * h, 1.0, 0.0));
        }
    }

    let rows = phase.logit_rows();
    if rows > 0 {
        let output = UnitId::Output;
        let nb = tensor_of(output, "output_norm.weight").map_or(0.0, |tt| tt.bytes as f64);
        let mut norm = simple(OpKind::Norm, output, rows as f64 * h, 3.0, nb);
        norm.tokens = rows;
        out.push(norm);
        let head = if t.tied_embeddings {
            matmul(embd, "token_embd.weight", rows)
        } else {
            matmul(output, "output.weight", rows)
        };
        out.extend(head);
        let mut sample =
            simple(OpKind::Sample { vocab: t.vocab }, output, rows as f64 * t.vocab as f64, 1.0, 0.0);
        sample.tokens = rows;
        out.push(sample);
    }
    out
}

/// Merges the matmuls that a runtime with [`crate::profile::Profile::one_token_projections_fused`] runs as one
/// GEMM: in a one-token step, adjacent matmuls of one attention or FFN unit with the same inner size and
/// format (q|k|v, gate|up, stored back to back) for which `fused(unit)` holds (the executor fuses on the GPU
/// only). The merged op reads the input once. The RoPE of q and of k, back to back in the merged output, merge
/// into one launch too. With `fold_norm_act` ([`crate::profile::Profile::one_token_norm_act_fused`]) the
/// unit's input norm goes into its merged first matmul, and the FFN's activation into gate|up (or up), where
/// the matrices are in the activation type: the executor's decode GEMV computes both in the same launch; such
/// an attention stores its K/V rows in its RoPE launch.
pub fn fuse_one_token_projections(ops: &mut Vec<Op>, fused: impl Fn(UnitId) -> bool, fold_norm_act: bool) {
    let fusable = |o: &Op| o.tokens == 1 && matches!(o.unit, UnitId::Attn { .. } | UnitId::Ffn { .. });
    ops.dedup_by(|next, prev| {
        let (kind, shared_input_bytes) = match (prev.kind, next.kind) {
            (OpKind::MatMul { n, k }, OpKind::MatMul { n: n2, k: k2 }) if k == k2 => {
                (OpKind::MatMul { n: n + n2, k }, ACT_BYTES * k as f64)
            }
            (OpKind::Rope, OpKind::Rope) => (OpKind::Rope, 0.0),
            _ => return false,
        };
        let merge = prev.unit == next.unit
            && prev.dtype == next.dtype
            && fusable(prev)
            && fusable(next)
            && fused(prev.unit);
        if merge {
            prev.kind = kind;
            prev.flops += next.flops;
            prev.weight_bytes += next.weight_bytes;
            prev.act_bytes += next.act_bytes - shared_input_bytes;
        }
        merge
    });
    if !fold_norm_act {
        return;
    }
    // A matmul of `unit` that the decode GEMV runs.
    let gemv = |o: Option<&Op>, unit: UnitId| {
        o.is_some_and(|o| {
            o.unit == unit
                && matches!(o.kind, OpKind::MatMul { .. })
                && matches!(o.dtype, DType::F16 | DType::Bf16)
                && fusable(o)
                && fused(unit)
        })
    };
    let is_matmul_of = |o: Option<&Op>, unit: UnitId| {
        o.is_some_and(|o| o.unit == unit && matches!(o.kind, OpKind::MatMul { .. }))
    };
    let mut folded = vec![false; ops.len()];
    for i in 0..ops.len() {
        let (op, at) = (&ops[i], |j: Option<usize>| j.and_then(|j| ops.get(j)));
        folded[i] = match op.kind {
            // The input norm before the first matmul, if q|k|v (or gate|up) merged into it: the op after it is
            // no matmul of the unit.
            OpKind::Norm => gemv(at(Some(i + 1)), op.unit) && !is_matmul_of(at(Some(i + 2)), op.unit),
            // The FFN's activation after one (merged) matmul.
            OpKind::Activation => {
                matches!(op.unit, UnitId::Ffn { .. })
                    && gemv(at(i.checked_sub(1)), op.unit)
                    && !is_matmul_of(at(i.checked_sub(2)), op.unit)
            }
            // The K/V store goes with the RoPE launch of an attention whose norm folded.
            OpKind::KvStore => {
                let UnitId::Kv { layer } = op.unit else { continue };
                let attn = UnitId::Attn { layer };
                i > 0
                    && ops[i - 1].kind == OpKind::Rope
                    && ops[i - 1].unit == attn
                    && (0..i).rev().take_while(|&j| ops[j].unit == attn).any(|j| folded[j])
            }
            _ => false,
        };
    }
    let mut i = 0;
    ops.retain(|_| {
        i += 1;
        !folded[i - 1]
    });
}

/// Peak bytes of activations and temporaries a phase needs on the device that runs it (ggml keeps f32
/// hidden states; the largest live set is the residual stream, the normed input, the FFN intermediates, the
/// attention temporaries and the logits). Equals [`scratch_parts`]`(…).total()`.
#[must_use]
pub fn scratch_bytes(spec: &ModelSpec, w: &Workload, phase: Phase) -> u64 {
    scratch_parts(spec, w, phase).total()
}

/// The terms of [`scratch_bytes`], for a device that runs only part of a phase (a planner whose GPU runs the
/// attention but not the FFN needs the residual and attention terms only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScratchParts {
    /// Residual stream, normed input and one more hidden-sized buffer: 3 × tokens × hidden.
    pub residual_bytes: u64,
    /// Attention temporaries: q, k, v, and without flash attention the score matrix over all keys.
    pub attention_bytes: u64,
    /// FFN intermediates: 3 × tokens × (dense FFN or top-k expert FFN, whichever is wider).
    pub ffn_bytes: u64,
    /// Logits of the rows that produce them.
    pub logits_bytes: u64,
}

impl ScratchParts {
    /// Residual + the larger of attention and FFN (they are not live together) + logits.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.residual_bytes + self.attention_bytes.max(self.ffn_bytes) + self.logits_bytes
    }
}

/// The most key splits a GPU attention runs (the executor's split combine holds this many).
pub const MAX_KEY_SPLITS: u64 = 256;

/// The most tokens a step may have for our executor to run a MoE layer's pinned GPU experts as one group
/// ([`OpClass::ExpertsGrouped`]): its grouped kernels keep a register accumulator per token of an expert.
pub const GROUPED_EXPERTS_MAX_TOKENS: u64 = 8;

/// Key splits of a GPU attention over a cache of `ctx` keys (flash decoding), as scratch is sized for it:
/// steps of up to 8 query tokens split the keys into chunks of at least 64, at most 64 chunks or, where that
/// leaves fewer than 8192 warps, as many as reach them (to [`MAX_KEY_SPLITS`]): a decode step runs enough
/// warps (one per query, head and split) to hide the latency of its key loads, and each warp walks at most
/// a few tiles (at 64 splits a one-query 16K-key step read its KV at 490 GB/s on the H200, each warp's 8 tiles
/// one after another). A decode step of more sequences splits until about 4096 warps run; a prefill chunk of
/// more tokens has warps enough and does not split. The executor launches at most one split per 32 keys the
/// step reads, so a short prompt in a long context runs no empty splits.
#[must_use]
pub fn attention_key_splits(ctx: u64, tokens: u64, decode: bool, q_heads: u32) -> u64 {
    let by_keys = ctx.div_ceil(64).clamp(1, MAX_KEY_SPLITS);
    let warps_per_split = tokens * u64::from(q_heads);
    if tokens <= 8 {
        by_keys.min(8192u64.div_ceil(warps_per_split.max(1)).max(64))
    } else if decode {
        by_keys.min(4096u64.div_ceil(warps_per_split))
    } else {
        1
    }
}

/// Alignment of the executor's scratch regions (`pipeshard-exec`'s `REGION_ALIGN_BYTES`).
pub const EXEC_REGION_ALIGN_BYTES: u64 = 256;

/// The scratch our executor carves for a phase of `tokens` tokens a step, `logit_rows` of which produce a token
/// (1 in prefill, every sequence's in decode), over a context of `ctx` keys, region by region as
/// `pipeshard-exec`'s `layout::carve_scratch` lays it out (a test there holds the two equal): the residual
/// stream in f32, the normed input in the activation type (bf16 or f16; quantised models compute in bf16),
/// the logits rows, then the largest of the attention temporaries (q, k, v in f32 and the split partials), a
/// dense FFN's (up and gate in f32, the activation in the activation type) and a MoE layer's. The simulator
/// predicts our runtime's VRAM with it; planners keep [`scratch_parts`], which covers it.
#[must_use]
pub fn exec_scratch_bytes(spec: &ModelSpec, tokens: u64, logit_rows: u64, ctx: u64) -> u64 {
    let t = &spec.text;
    let (m, act) = (tokens, 2);
    let (q_dim, kv_dim) = (u64::from(t.n_heads) * t.head_dim, u64::from(t.n_kv_heads) * t.head_dim);
    let splits = attention_key_splits(ctx, m, logit_rows == m, t.n_heads);
    let align = |x: u64| x.next_multiple_of(EXEC_REGION_ALIGN_BYTES);
    let rot_dims = {
        let r = (t.head_dim as f64 * t.partial_rotary).round() as u64;
        r - r % 2
    };
    let fixed = [
        m * 4,
        (logit_rows * 4).max(16),
        rot_dims / 2 * 4 + 4,
        m * t.hidden * 4,
        m * t.hidden.max(q_dim) * act,
        logit_rows * t.vocab * 4,
    ]
    .into_iter()
    .map(align)
    .sum::<u64>();
    let mut attn = align(m * q_dim * 4) + 2 * align(m * kv_dim * 4);
    if splits > 1 {
        let heads = m * u64::from(t.n_heads) * splits;
        attn += align(heads * t.head_dim * 4) + align(heads * 2 * 4);
    }
    let dense_ffn = (0..t.n_layers).any(|l| !spec.layer_is_moe(l));
    let ffn = if dense_ffn {
        let gate = if t.ffn_kind == FfnKind::SwiGlu { align(m * t.ffn * 4) } else { 0 };
        align(m * t.ffn * 4) + gate + align(m * t.ffn * act)
    } else {
        0
    };
    let moe = t.moe.as_ref().map_or(0, |e| {
        let fe = e.expert_ffn;
        let k = u64::from(e.top_k);
        let mut b = [
            m * u64::from(e.n_experts) * 4,
            m * k * 4,
            m * k * 4,
            m * t.hidden * act,
            2 * m * fe * 4,
            m * fe * act,
            m * t.hidden * 4,
        ]
        .into_iter()
        .map(align)
        .sum::<u64>();
        // The grouped decode experts' entries (`grouped_experts_fit` in the executor: every format but q2_k
        // and q3_k, whose GEMVs round the activations to 8 bits first).
        let grouped = !matches!(spec.weights.expert_gate_up, DType::Q2K | DType::Q3K)
            && m <= GROUPED_EXPERTS_MAX_TOKENS
            && t.hidden.is_multiple_of(8)
            && fe.is_multiple_of(8);
        if grouped {
            let entries = m * k;
            b += align(entries * 8) + align((entries + 1) * 4) + align(entries * fe * act);
        }
        b
    });
    fixed + attn.max(ffn).max(moe)
}

/// The terms of the scratch a phase needs (see [`scratch_bytes`]).
#[must_use]
pub fn scratch_parts(spec: &ModelSpec, w: &Workload, phase: Phase) -> ScratchParts {
    let t = &spec.text;
    let m = phase.tokens() as f64;
    let h = t.hidden as f64;
    let ffn = match &t.moe {
        Some(moe) => (t.ffn as f64).max(moe.expert_ffn as f64 * f64::from(moe.top_k)),
        None => t.ffn as f64,
    };
    let q_dim = f64::from(t.n_heads) * t.head_dim as f64;
    let kv_dim = f64::from(t.n_kv_heads) * t.head_dim as f64;
    let keys = match phase {
        Phase::Prefill { tokens, start_pos, .. } => (start_pos + tokens) as f64,
        Phase::Decode { ctx, .. } => ctx as f64,
    };
    let attn_tmp = if w.flash_attn {
        // Flash decoding: partial outputs and (max, sum) pairs of every key split, combined after.
        let decode = matches!(phase, Phase::Decode { .. });
        let splits = attention_key_splits(w.ctx, phase.tokens(), decode, t.n_heads) as f64;
        let partials =
            if splits > 1.0 { m * f64::from(t.n_heads) * splits * (t.head_dim as f64 + 2.0) } else { 0.0 };
        m * (q_dim + 2.0 * kv_dim) + partials
    } else {
        m * (q_dim + 2.0 * kv_dim) + m * keys * f64::from(t.n_heads)
    };
    let bytes = |elems: f64| (elems * ACT_BYTES) as u64;
    ScratchParts {
        residual_bytes: bytes(3.0 * m * h),
        attention_bytes: bytes(attn_tmp),
        ffn_bytes: bytes(m * 3.0 * ffn),
        logits_bytes: bytes(phase.logit_rows() as f64 * t.vocab as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::model::WeightFormat;

    #[test]
    fn attention_splits_keep_enough_warps_and_bounded_scratch() {
        // One query: 64-key splits, up to 8192 warps (256 splits of 32 heads, 128 of 64).
        assert_eq!(attention_key_splits(1, 1, true, 32), 1);
        assert_eq!(attention_key_splits(1000, 1, true, 32), 16);
        assert_eq!(attention_key_splits(4096, 1, true, 32), 64);
        assert_eq!(attention_key_splits(16_384, 1, true, 32), 256);
        assert_eq!(attention_key_splits(131_072, 1, true, 32), MAX_KEY_SPLITS);
        assert_eq!(attention_key_splits(131_072, 1, true, 64), 128);
        // Up to 8 queries never below 64 splits (of 64 keys or more).
        assert_eq!(attention_key_splits(131_072, 8, true, 32), 64);
        assert_eq!(attention_key_splits(131_072, 2, true, 32), 128);
        // 16 sequences of 32 heads: 4096 warps at 8 splits; a prefill chunk does not split.
        assert_eq!(attention_key_splits(4096, 16, true, 32), 8);
        assert_eq!(attention_key_splits(4096, 512, false, 32), 1);
    }

    #[test]
    #[allow(clippy::float_cmp)] // the same sums, computed the same way
    fn materialised_cpu_decode_attention_reads_kv_once_per_query_head() {
        use crate::cost::{CostModel, Device, OpContext, TableCostModel};
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let fused = Workload::single(16_000, 16_384, 8, 1024);
        let materialized = Workload { flash_attn: false, ..fused };
        let attention = |w: &Workload, phase: Phase| {
            *ops(&spec, &inv, w, phase).iter().find(|o| matches!(o.kind, OpKind::Attention { .. })).unwrap()
        };
        let (f, m) =
            (attention(&fused, fused.decode_step(0)), attention(&materialized, fused.decode_step(0)));
        let group = f64::from(spec.text.n_heads / spec.text.n_kv_heads);
        assert_eq!(group, 8.0);
        assert!(matches!(m.kind, OpKind::Attention { materialized: true, .. }));
        assert_eq!(m.kind.row_class(1), OpClass::AttentionMaterialized);
        // The CPU streams each KV head once per query head; the GPU and flash attention read it once.
        assert!((m.bytes_on(Device::Cpu) - m.bytes() - (group - 1.0) * m.kv_bytes).abs() < 1.0);
        assert_eq!(m.bytes_on(Device::Gpu), m.bytes());
        assert_eq!(f.bytes_on(Device::Cpu), f.bytes());
        // A prefill chunk is not a decode query: no materialised-decode row for it.
        let chunk = attention(&materialized, materialized.prefill_chunks()[0]);
        assert_eq!(chunk.bytes_on(Device::Cpu), chunk.bytes());
        // Priced by the derived rows: materialised decode on the CPU costs more than the fused kernel.
        let cost = TableCostModel::new(&crate::reference::derived("cli3").unwrap());
        assert!(cost.op_ns(&m, OpContext::cpu(16)) > cost.op_ns(&f, OpContext::cpu(16)));
    }

    #[test]
    fn expected_experts_limits() {
        assert!((expected_touched_experts(128, 8, 1) - 8.0).abs() < 1e-9);
        assert!(expected_touched_experts(128, 8, 1024) > 127.99);
        let e16 = expected_touched_experts(128, 8, 16);
        assert!(e16 > 8.0 && e16 < 128.0);
    }

    #[test]
    fn decode_matmul_flops_match_parameters() {
        let spec = catalog::get("llama-3.1-8b").unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(1000, 2048, 16, 512);
        let ops = ops(&spec, &inv, &w, w.decode_step(0));
        let mm_flops: f64 =
            ops.iter().filter(|o| matches!(o.kind, OpKind::MatMul { .. })).map(|o| o.flops).sum();
        // One token: 2 FLOPs per matrix parameter, embedding excluded.
        let params: u64 = inv
            .tensors
            .iter()
            .filter(|t| t.shape.len() == 2 && t.name != "token_embd.weight")
            .map(crate::inventory::Tensor::elems)
            .sum();
        assert!((mm_flops - 2.0 * params as f64).abs() < 1.0, "{mm_flops} vs {}", 2 * params);
        let weights: f64 = ops.iter().map(|o| o.weight_bytes).sum();
        let embd_row = inv.unit_bytes(UnitId::TokenEmbd) as f64 / 128_256.0;
        let expect = (inv.total_bytes() - inv.unit_bytes(UnitId::TokenEmbd)) as f64 + embd_row;
        assert!((weights - expect).abs() / expect < 1e-9);
    }

    #[test]
    fn one_token_projections_fuse_into_qkv_and_gate_up() {
        let spec = catalog::get("nemo-8b").unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(128, 1024, 16, 128);
        let matmuls = |ops: &[Op], unit: UnitId| -> Vec<u64> {
            ops.iter()
                .filter(|o| o.unit == unit)
                .filter_map(|o| match o.kind {
                    OpKind::MatMul { n, .. } => Some(n),
                    _ => None,
                })
                .collect()
        };
        let decode = ops(&spec, &inv, &w, w.decode_step(0));
        let mut fused = decode.clone();
        fuse_one_token_projections(&mut fused, |u| u != UnitId::Attn { layer: 1 }, false);
        let (attn, ffn) = (UnitId::Attn { layer: 0 }, UnitId::Ffn { layer: 0 });
        assert_eq!(matmuls(&decode, attn), [4096, 1024, 1024, 4096]);
        assert_eq!(matmuls(&fused, attn), [6144, 4096]);
        assert_eq!(matmuls(&fused, ffn), [2 * 11520, 4096]);
        // Units the runtime does not fuse keep their matmuls.
        assert_eq!(matmuls(&fused, UnitId::Attn { layer: 1 }), [4096, 1024, 1024, 4096]);
        // q|k|v and one RoPE launch per fused attention, gate|up per FFN.
        let ropes = |ops: &[Op], unit: UnitId| {
            ops.iter().filter(|o| o.unit == unit && o.kind == OpKind::Rope).count()
        };
        assert_eq!(
            (ropes(&decode, attn), ropes(&fused, attn), ropes(&fused, UnitId::Attn { layer: 1 })),
            (2, 1, 2)
        );
        assert_eq!(decode.len() - fused.len(), 3 * 39 + 40);
        let sum = |ops: &[Op], f: fn(&Op) -> f64| ops.iter().map(f).sum::<f64>();
        assert!((sum(&decode, |o| o.flops) - sum(&fused, |o| o.flops)).abs() < 1.0);
        assert!((sum(&decode, |o| o.weight_bytes) - sum(&fused, |o| o.weight_bytes)).abs() < 1.0);
        // The input is read once: 2 fewer 4096-wide rows per fused attention, 1 fewer per FFN.
        let saved = sum(&decode, |o| o.act_bytes) - sum(&fused, |o| o.act_bytes);
        assert!((saved - (2.0 * 39.0 + 40.0) * 4096.0 * ACT_BYTES).abs() < 1.0, "{saved}");
        // Steps of more tokens keep one GEMM a matrix.
        let prefill = ops(&spec, &inv, &w, w.prefill_chunks()[0]);
        let mut unfused = prefill.clone();
        fuse_one_token_projections(&mut unfused, |_| true, true);
        assert_eq!(unfused.len(), prefill.len());
    }

    #[test]
    fn the_decode_gemv_folds_a_units_input_norm_and_ffn_activation() {
        let w = Workload::single(128, 1024, 16, 128);
        let kinds = |ops: &[Op], unit: UnitId| -> Vec<OpKind> {
            ops.iter().filter(|o| o.unit == unit).map(|o| o.kind).collect()
        };
        let norms_acts =
            |ops: &[Op]| ops.iter().filter(|o| matches!(o.kind, OpKind::Norm | OpKind::Activation)).count();
        let stores = |ops: &[Op]| ops.iter().filter(|o| o.kind == OpKind::KvStore).count();
        let (attn, ffn) = (UnitId::Attn { layer: 0 }, UnitId::Ffn { layer: 0 });
        let mm = |n, k| OpKind::MatMul { n, k };
        for (dtype, folds) in [(DType::Bf16, true), (DType::F16, true), (DType::Q4_0, false)] {
            let spec = catalog::get("nemo-8b").unwrap().with_weights(WeightFormat::uniform(dtype));
            let inv = Inventory::new(&spec);
            let decode = ops(&spec, &inv, &w, w.decode_step(0));
            let mut fused = decode.clone();
            fuse_one_token_projections(&mut fused, |u| u != UnitId::Ffn { layer: 1 }, true);
            if folds {
                // gate|up with the SwiGLU, then down; q|k|v with the norm, RoPE, …, o.
                assert_eq!(
                    kinds(&fused, ffn),
                    [mm(2 * 11520, 4096), mm(4096, 11520), OpKind::Add],
                    "{dtype}"
                );
                assert_eq!(kinds(&fused, attn)[0], mm(6144, 4096), "{dtype}");
                // 40 attention norms, 39 FFN norms and activations (layer 1's FFN is not fused), the output norm.
                assert_eq!(norms_acts(&decode) - norms_acts(&fused), 40 + 2 * 39, "{dtype}");
                assert_eq!(kinds(&fused, UnitId::Ffn { layer: 1 })[0], OpKind::Norm);
                // Every attention stores its K/V rows in its RoPE launch.
                assert_eq!((stores(&decode), stores(&fused)), (40, 0), "{dtype}");
            } else {
                assert_eq!(norms_acts(&decode), norms_acts(&fused), "{dtype}");
                assert_eq!(stores(&fused), 40, "{dtype}");
            }
        }
        // Without the flag, or with the matrices not merged, the norm stays.
        let spec = catalog::get("nemo-8b").unwrap().with_weights(WeightFormat::uniform(DType::Bf16));
        let inv = Inventory::new(&spec);
        let decode = ops(&spec, &inv, &w, w.decode_step(0));
        let mut merged_only = decode.clone();
        fuse_one_token_projections(&mut merged_only, |_| true, false);
        assert_eq!(norms_acts(&decode), norms_acts(&merged_only));
        assert_eq!(stores(&merged_only), 40);
        let mut unmerged = decode.clone();
        fuse_one_token_projections(&mut unmerged, |_| false, true);
        assert_eq!(unmerged.len(), decode.len());
    }

    #[test]
    fn moe_decode_reads_top_k_experts() {
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let w = Workload::single(100, 1024, 8, 512);
        let ops = ops(&spec, &inv, &w, w.decode_step(0));
        let e = ops.iter().find(|o| matches!(o.kind, OpKind::Experts { .. })).unwrap();
        let per_expert = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 }) as f64;
        assert!((e.weight_bytes - 8.0 * per_expert).abs() < 1e-6);
    }

    #[test]
    fn moe_decode_of_r_tokens_reads_the_distinct_experts_they_touch() {
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let per_expert = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 }) as f64;
        for r in [1u64, 4, 16, 64] {
            let w = Workload::single(889, 1024, 128, 1024).batched(r, true);
            let ops = ops(&spec, &inv, &w, w.decode_step(5));
            let e = ops.iter().find(|o| matches!(o.kind, OpKind::Experts { .. })).unwrap();
            let OpKind::Experts { touched, tokens_per_touched, .. } = e.kind else { unreachable!() };
            let expect = expected_touched_experts(128, 8, r);
            assert!((touched - expect).abs() < 1e-9, "R = {r}");
            assert!((e.weight_bytes - expect * per_expert).abs() < 1e-3, "R = {r}: not R × k experts");
            assert!((tokens_per_touched * touched - 8.0 * r as f64).abs() < 1e-9, "R = {r}");
        }
        // 64 tokens touch almost every expert (128 · (1 − (120/128)^64) ≈ 125.9), far fewer than 64 × 8.
        assert!((125.8..126.0).contains(&expected_touched_experts(128, 8, 64)));
    }

    /// Identical requests (`llama-batched-bench`) route a decode step's R tokens to one token's top-k experts,
    /// each running all R tokens; their prefill chunks still route by token.
    #[test]
    fn identical_requests_decode_through_one_tokens_experts() {
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let per_expert = inv.unit_bytes(UnitId::Expert { layer: 0, expert: 0 }) as f64;
        let experts = |w: &Workload, phase: Phase| {
            let ops = ops(&spec, &inv, w, phase);
            let e = *ops.iter().find(|o| matches!(o.kind, OpKind::Experts { .. })).unwrap();
            let OpKind::Experts { touched, tokens_per_touched, .. } = e.kind else { unreachable!() };
            (touched, tokens_per_touched, e.weight_bytes, e.flops)
        };
        for r in [4u64, 16, 64] {
            let distinct = Workload::single(889, 1024, 128, 1024).batched(r, true);
            let same = Workload { requests: Requests::Identical, ..distinct };
            let (touched, per_touched, bytes, flops) = experts(&same, same.decode_step(5));
            assert!((touched - 8.0).abs() < 1e-9 && (per_touched - r as f64).abs() < 1e-9, "R = {r}");
            assert!((bytes - 8.0 * per_expert).abs() < 1e-3, "R = {r}");
            let (d_touched, _, d_bytes, d_flops) = experts(&distinct, distinct.decode_step(5));
            assert!(d_touched > 8.0 * 1.5 && d_bytes > bytes, "R = {r}: distinct requests touch more");
            assert!((flops - d_flops).abs() < 1e-3 * flops, "R = {r}: the same R × k expert FLOPs");
            let chunk = same.prefill_chunks()[0];
            assert_eq!(experts(&same, chunk), experts(&distinct, chunk), "R = {r}: prefill");
        }
    }

    #[test]
    fn unified_kv_is_one_copy_and_a_masked_scan_on_the_gpu() {
        use crate::cost::{CostModel, Device, OpContext, TableCostModel};
        let spec = catalog::get("qwen3-30b-a3b").unwrap();
        let inv = Inventory::new(&spec);
        let per_seq = Workload::single(889, 1024, 128, 1024).batched(16, false);
        let unified = per_seq.batched(16, true);
        let step = per_seq.decode_step(10);
        assert_eq!((per_seq.kv_copies(step), unified.kv_copies(step)), (16, 1));
        // A prefill chunk belongs to one sequence whatever the cache.
        assert_eq!(per_seq.kv_copies(per_seq.prefill_chunks()[0]), 1);
        let attn = |w: &Workload| {
            *ops(&spec, &inv, w, step).iter().find(|o| matches!(o.kind, OpKind::Attention { .. })).unwrap()
        };
        let (a, b) = (attn(&per_seq), attn(&unified));
        // The same useful work and KV traffic; the unified kernel on the GPU also scores the 15 other
        // sequences' cells of the cache, the CPU kernel skips them.
        assert_eq!((a.flops, a.kv_bytes), (b.flops, b.kv_bytes));
        let OpKind::Attention { keys, scanned_keys, .. } = b.kind else { unreachable!() };
        assert_eq!((keys, scanned_keys), (900, 16 * 900));
        let ratio = |x: f64, y: f64| x / y;
        assert!((ratio(a.flops_on(Device::Gpu), a.flops) - 1.0).abs() < 1e-12);
        assert!((ratio(b.flops_on(Device::Gpu), b.flops) - 16.0).abs() < 1e-12);
        assert!((ratio(b.flops_on(Device::Cpu), b.flops) - 1.0).abs() < 1e-12);
        let cost = TableCostModel::new(&crate::reference::derived("cli3").unwrap());
        assert!(cost.op_ns(&b, OpContext::gpu()) > cost.op_ns(&a, OpContext::gpu()));
        assert_eq!(cost.op_ns(&b, OpContext::cpu(16)), cost.op_ns(&a, OpContext::cpu(16)));
        // Plan files written before the field existed read as per-sequence KV.
        let json = serde_json::to_string(&per_seq).unwrap().replace(",\"kv_unified\":false", "");
        assert!(!json.contains("kv_unified"));
        assert_eq!(serde_json::from_str::<Workload>(&json).unwrap(), per_seq);
    }

    #[test]
    fn chunks_cover_the_prompt() {
        let w = Workload::single(2500, 4096, 10, 1024);
        let c = w.prefill_chunks();
        assert_eq!(c.len(), 3);
        assert_eq!(c.iter().map(|p| p.tokens()).sum::<u64>(), 2500);
        assert_eq!(c[2], Phase::Prefill { tokens: 452, start_pos: 2048, last: true });
        assert!(w.validate().is_ok());
        assert!(Workload::single(4000, 4096, 200, 1024).validate().unwrap_err().to_string().contains("ctx"));
    }

    #[test]
    fn attention_without_flash_needs_score_memory() {
        let spec = catalog::get("nemo-8b").unwrap();
        let mut w = Workload::single(4096, 8192, 1, 1024);
        let p = Phase::Prefill { tokens: 1024, start_pos: 3072, last: false };
        let flash = scratch_bytes(&spec, &w, p);
        w.flash_attn = false;
        let scores = 1024 * 4096 * 32 * 4;
        assert!(flash < scores);
        assert!(scratch_bytes(&spec, &w, p) >= scores);
    }
}
