//! pipeshard-exec: the real executor. It runs a Plan on a CUDA GPU (cudarc, loaded at run time) plus CPU worker
//! threads within the VRAM budget, and measures the same Metrics and Trace as the simulator.
//!
//! Only `exec::cuda` will touch cudarc. It depends on pipeshard-core; it must never depend on planner or sim.
//!
//! # Job
//! Make every prediction checkable: run the same [`pipeshard_core::plan::Plan`] the simulator consumes, for real,
//! honestly — the budget is enforced by one VRAM arena, streamed units really cross PCIe from page-locked host
//! memory, CPU-placed units really compute on the CPU — and report [`pipeshard_core::metrics::Metrics`] and a
//! Chrome [`pipeshard_core::trace::Trace`] in the simulator's vocabulary.
//!
//! # Main types and modules
//! - [`weights::ModelWeights`]: every tensor of a dense or Qwen3-MoE decoder, random from a seed or read from an
//!   HF checkpoint or a GGUF file ([`weights::ModelWeights::from_gguf`]), one page-aligned host buffer per
//!   placement unit ([`host::HostBuf`]; one per routed expert); [`weights::Dims`] checks what the executor
//!   supports.
//! - [`cpu`]: SIMD kernels (AVX-512 / AVX2+FMA+F16C, f32 accumulation; bf16/f16 rows and q8_0/q4_0 blocks)
//!   and the CPU half of a forward pass; they double as the reference for the GPU path.
//!   [`reference`](mod@reference) is an independent f64 forward pass for tests.
//! - [`quant`]: the GGUF q8_0/q4_0 blocks and q2_k/q3_k/q4_k/q6_k super-blocks, quantised and dequantised
//!   bit-exact with ggml's reference.
//! - [`cuda`] (`exec::cuda`): the device seam — [`cuda::probe`], [`cuda::Gpu`] (context, compute/H2D/D2H
//!   streams, cuBLAS GemmEx, NVRTC kernels for norms, RoPE, KV store, tiled causal attention, SwiGLU/ReLU²,
//!   embedding and greedy sampling, GEMV and dequantisation of every [`quant`] format), raw allocations and events.
//! - [`layout`]: a phase plan turned into arena offsets, per-step weight/KV locations and the streaming ring's
//!   item sequence; fails before running, naming the line that overflows.
//! - [`engine`]: [`run`] — prefill chunks, the switch to the decode plan, decode steps, the ring, metrics.
//! - [`seqs`]: parallel requests — where R sequences' KV cells live (per sequence or unified) and which tokens
//!   a pass runs.
//! - [`hf`]: export to a transformers checkpoint for the independent comparison (`scripts/hf_compare.py`).
//! - [`testing`]: tiny specs and hand-made plans ([`testing::manual_plan`]) for tests and checks.
//!
//! # Decisions
//! - Quantised matrices (q8_0, q4_0; `--weights q4_0`): every matrix, the embedding included, stays in its
//!   blocks in host memory, in VRAM and over PCIe; activations are bf16. The CPU and the GPU decode GEMV
//!   (≤ 8 tokens) dequantise as they read, exactly in f32; larger GPU matmuls (prefill) dequantise chunks of
//!   rows to bf16 in a scratch buffer taken at warm-up (so it is part of the measured runtime overhead) and
//!   run cuBLAS on them.
//! - Numerics: activations stay f32; they are rounded to the matrix format (bf16/f16) right before every matmul
//!   on both sides, and K/V to the cache format, so CPU and GPU compute the same function up to the order of f32
//!   additions (measured: ≤ 1e-2 relative logits error between any two placements, ≤ 6.2e-3 against
//!   transformers in float32).
//! - One arena: after the context, cuBLAS (our own workspace) and the kernels are up and GEMM shapes are warmed,
//!   the process VRAM is measured (device total − free) and `budget − overhead − LAZY_LOAD_RESERVE_BYTES` is
//!   allocated once with `cuMemAlloc`; the stream-ordered pool is never used. KV from the bottom, pinned weights
//!   from the top, slots/staging/scratch between: a unit keeps its address across phases when both pin it.
//! - The ring follows the core's `PhasePlan::stream_groups`: a streamed attention carries its streamed KV in
//!   the same slot; slots are reused round-robin and released in issue order; only events order the streams.
//! - Activations never queue behind weight copies: on the H200 a copy on the compute stream ran only once the
//!   H2D stream's queue of copies drained or stalled, so the residual stream goes up by a kernel reading its
//!   mapped host copy ([`cuda::Gpu::copy_mapped`]) and a MoE layer's expert inputs ahead of its expert copies
//!   on the H2D stream.
//! - `op_offload` (llama.cpp's baseline): the weights of CPU-placed attention/FFN of a prefill ubatch ≥ 32
//!   tokens are staged whole into a staging area on the compute stream and their matmuls run on the GPU — not
//!   overlapped, as in llama.cpp; attention itself stays with the host KV cache on the CPU (q, k, v come down,
//!   the output goes back up), as llama.cpp's scheduler keeps it.
//! - MoE layers (docs/DESIGN-NOTES.md, "exec: MoE layers"): the router runs where it is placed, its logits
//!   come to the host, which routes and permutes the tokens; only picked experts run — GPU experts as
//!   per-expert cuBLAS calls (streamed ones copied only when picked, through a ring placeholder expanded once
//!   the routing is known, behind their token lists on the same H2D stream), CPU experts meanwhile on the
//!   host. In decode steps the host queues the GPU work
//!   that follows a layer's CPU experts (their sum, the next layer's attention and router) while they run,
//!   behind a wait on a host flag it opens once the sum is written ([`PreEnqueue`]). By default
//!   ([`GroupedExperts`]; 2.51 → 1.05–1.35 ms a qwen3-30b-a3b@4L bf16 decode step on the H200), steps of at
//!   most 8 tokens run a layer's pinned experts (any format but q2_k/q3_k) in two grouped launches instead of
//!   five an expert.
//! - Failing loudly, never silently (docs/DESIGN-NOTES.md, "reliability"): weights the driver will not
//!   page-lock, or past [`RunOptions::pinned_limit_bytes`], stay pageable and [`RunOutput::warnings`] says so;
//!   a host allocation that fails is [`ExecError::HostMemory`], not an abort; [`RunOptions::interrupt`]
//!   (Ctrl-C) stops a run before its next forward pass with [`ExecError::Interrupted`], freeing what it holds.
//!   A plan that fits its budget exactly but not the split decode attention's aligned partial buffers runs
//!   with fewer splits rather than being refused.
//! - Parallel requests (the workload's `batch` R): as the simulator models them, every request's prompt is
//!   prefilled in turn, then each decode step runs R tokens (one per sequence) through the same plan — GEMMs of
//!   R rows, attention per sequence over its own cells, MoE experts once over the tokens that picked them. A
//!   layer's cache holds R × ctx rows, per sequence or unified in write order (`seqs`): the unified one moves a
//!   step's cells in one copy, and its GPU attention scans every used cell, masking other sequences' (as
//!   llama.cpp's CUDA kernels and the simulator's cost); per-sequence caches move one run per sequence.
//! - Host sync only where data crosses: residual to the host before a CPU unit, the sampled token, and the end
//!   of each pass (the host reuses its staging buffers).
//!
//! # Not supported (errors say so)
//! Vision towers (issue 11), shared experts, tied embeddings, mixed matrix formats (a GGUF file's tensors in
//! other formats are converted to the one format of `--weights` as they load; q4_1, q5_0, q5_1 and q5_k cannot
//! be read yet), parallel requests with prompts of different lengths.

pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod hf;
pub mod host;
pub mod layout;
pub mod quant;
pub mod reference;
pub mod seqs;
pub mod testing;
pub mod weights;

pub use engine::{
    GroupedExperts, LAZY_LOAD_RESERVE_BYTES, OVERHEAD_SPREAD_BYTES, PreEnqueue, RunOptions, RunOutput,
    UnitSpans, VramReport, page_table_bytes_per_locked_gib, run, runtime_overhead_bytes,
};
pub use error::{ExecError, Result};
