//! pipeshard-sim: a deterministic discrete-event simulator that predicts TTFT, TPS, end-to-end latency, peak
//! VRAM and a timeline for a plan on a machine described by a Profile.
//!
//! # Job
//! Given a [`Plan`](pipeshard_core::plan::Plan), the [`ModelSpec`](pipeshard_core::model::ModelSpec) it was
//! made for and a [`CostModel`](pipeshard_core::cost::CostModel) fitted to a machine profile, play out what the
//! executor does — copy by copy, kernel by kernel — and report the same [`Metrics`](pipeshard_core::metrics)
//! and [`Trace`](pipeshard_core::trace) that the executor measures, so every prediction error is one
//! subtraction.
//!
//! # Main types
//! - [`Simulator`]: built once per plan (`Simulator::new` checks the plan against the model, the only step
//!   that can fail); `step` runs one prefill chunk or decode step, `steps` several with the ring running
//!   across them, `run` a whole workload and returns a [`Simulation`].
//! - [`vision`]: a VLM request end to end (image encode, image-token prefill, text prompt, generation, peak
//!   VRAM by hand-over), with the E2EL the paper's Table 8 script computes.
//! - [`StepGraph`] (module [`graph`]): one step as tasks on lanes — GPU compute stream, CPU worker pool, H2D and
//!   D2H copy engines, and latency-only CPU↔GPU hand-offs — with their dependencies and the ring items of
//!   streamed units.
//! - [`StepOutcome`] (module [`engine`]): start and end of every task, ring slot tenancies, busy time per
//!   resource; the engine's events are one enum, [`engine::Event`], handled in one `match`.
//! - [`EventQueue`] (module [`queue`]): the deterministic queue keyed by (time, event rank, insertion order).
//!
//! # Decisions
//! - **Integer nanoseconds, deterministic.** No wall clock, no hash-map iteration, no randomness: the same plan
//!   gives the same bytes of output on every run.
//! - **What runs where.** `Pinned` and `Streamed` units compute on the GPU, `Cpu` units on the CPU pool (one op
//!   at a time on all the plan's threads, as ggml does). A GPU op takes its device time or its kernels' launches,
//!   whichever is longer (the host issues the next launch while the device runs): one kernel an op on our
//!   runtime, llama.cpp's count on the paper's ([`Runtime::launches`]), which replays a CUDA graph, each
//!   kernel at the profile's replay cost, when a one-token step is one GPU split
//!   ([`Runtime::replays_graphs`]). Every change of
//!   device costs a host sync plus the copy of the activations (token ids at the start of a step, sampled
//!   tokens at its end); hand-offs hold no copy engine (ours and the paper's runtime issue them on the compute
//!   stream, beside the prefetch stream).
//! - **Streaming ring.** Streamed units are copied in first-use order into `pipeline_depth` slots of
//!   `slot_bytes`, one slot per group of core's `PhasePlan::stream_groups` (a unit; a layer's streamed
//!   attention with its streamed KV; one expert's worth of a layer's touched streamed experts). A copy starts
//!   when its slot is released by the item `depth` earlier (all its readers done), and an op starts when its
//!   own copy is done. Streamed KV is uploaded before the attention that reads it: the cells the pass reads
//!   on ours and the artifact's runtime, the whole allocated context on stock llama.cpp
//!   ([`Runtime::kv_upload_bytes`]); after a GPU attention whose KV is mirrored on the host (streamed, or
//!   pinned in prefill but not in decode) the new cells go back D2H, and the slot is not reused before they
//!   have.
//!   Decode steps run the ring across step boundaries, as the executor does.
//! - **MoE.** A layer's routed experts are split by how many of them the plan pins, streams or leaves on the
//!   CPU; each side does the expected share (count × touched / E) of the work. Streamed experts are copied
//!   only if touched (expected bytes), once the router has run; under [`Runtime::Artifact`] (the paper's
//!   runtime) all of them. The GPU and CPU shares run concurrently and join before the residual add. On
//!   llama.cpp (stock and the artifact) a GPU experts op of several tokens also waits for the host to sort its
//!   routing before each `mul_mat_id` ([`Runtime::expert_ids_host_ns`]). On ours the host thread enqueues
//!   the streamed parts one after another, each its ring copy issue and span (the profile's
//!   `ring_copy_issue_ns`, where measured) after the previous part's kernels, on a latency-only `Host` lane:
//!   a part's copy waits for the host to have issued it, its kernels for the host to have launched them, so
//!   a host slower than PCIe paces the layer (q4_0 experts on the H200 machine). Each of our ring items'
//!   copies also takes the profile's `ring_copy_gap_ns` (the slot's wait and events on the copy stream).
//! - **Parallel requests.** A decode step of R sequences runs R tokens through every op: weights read once,
//!   R × context of KV, the distinct experts R tokens touch. With per-sequence KV (the workload's
//!   `kv_unified = false`) a layer's new cells and a streamed layer's cache move in one copy per sequence, each
//!   paying the copy latency; with a unified cache in one, but GPU attention then also scores the other
//!   sequences' masked cells (core's `Op::flops_on`). TPS sums the tokens of all requests.
//! - **Shared DRAM.** While an H2D or D2H copy is in flight, CPU and GPU ops run at their cost model's
//!   under-DMA rate; a running op switches rate when the copy starts or ends.
//! - **Op offload** (the `ngl` baseline, in prefill and in decode steps of ≥ 32 parallel requests): ops
//!   reading CPU-resident weights copy them to the GPU and run there, copy then compute, not overlapped.
//! - **Sampling.** A step's time is linear in its position except through pipeline stalls, so `run` simulates
//!   the first, last and a few evenly spaced steps of each phase and interpolates the rest
//!   ([`SimOptions`]); `SimOptions { exact: true, .. }` simulates every one.
//! - **Metrics.** TTFT = the prefill of all R prompts (for one request, the paper's "prompt eval time");
//!   decode time = the plan switch's re-upload plus the G steps; TPS = G·R / decode time; E2EL = TTFT +
//!   decode time; `decode_step_ns` = the mean step, switch excluded. Peak VRAM by category is what the run
//!   used: pinned weights and KV from the placements, ring slots actually held × `slot_bytes`, core's
//!   `scratch_bytes` of the largest step (if anything runs on the GPU) plus op-offload weights, and the runtime
//!   overhead — so a plan whose breakdown under-counts shows up.
//!
//! # Must not depend on
//! It depends on pipeshard-core only; it must never depend on planner, exec, profiler or cudarc (planners may
//! depend on it to score plans).

pub mod engine;
pub mod graph;
pub mod queue;
mod simulator;
pub mod vision;

pub use engine::{SlotUse, StepOutcome};
pub use graph::{Lane, StepGraph};
pub use queue::EventQueue;
pub use simulator::{Runtime, SimError, SimOptions, Simulation, Simulator};
