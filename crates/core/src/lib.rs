//! pipeshard-core: the shared vocabulary of pipeshard.
//!
//! Its job is to define, once, the types every other crate speaks, and the pure functions that derive them:
//! - [`model`]: [`model::ModelSpec`] for dense, MoE and vision-language decoders, read from HF `config.json`;
//! - [`catalog`]: the built-in models (the paper's four LLMs, its VLM, and two common 8B models);
//! - [`dtype`]: weight formats with GGUF block sizes; a tensor's exact bytes;
//! - [`gguf`]: a GGUF header reader (metadata, tensor infos, split files) and the spec it describes;
//! - [`checkpoint`]: HF checkpoint folders (config.json + safetensors headers) and the spec they describe;
//! - [`inventory`]: every tensor of a spec and the placement [`inventory::Unit`]s they group into;
//! - [`workload`]: prefill chunks and decode steps, and the [`workload::Op`]s each runs (FLOPs, bytes, unit);
//! - [`vision`]: a VLM's image → patch grid → tokens, its encoder's ops, and the VRAM of its attention
//!   (materialised, flash, query-tiled);
//! - [`profile`]: the versioned machine [`profile::Profile`];
//! - [`cost`]: the [`cost::CostModel`] trait and its table implementation;
//! - [`plan`], [`metrics`], [`trace`]: what planners emit and what the simulator and executor report.
//! - [`fxhash`]: the fast unkeyed hash of lookup tables keyed by unit ids and op shapes;
//! - [`untrusted`]: every reader of untrusted files behind one entry point each (fuzz targets, corpus replay).
//!
//! Decisions: time is integer nanoseconds and sizes are `u64` bytes wherever they are state; FLOPs and bytes of
//! ops are `f64` because MoE ops carry expectations over routing. Errors are typed and name the file, field and
//! value at fault.
//!
//! This crate holds data types and pure functions only. It must not depend on any other pipeshard crate, on
//! cudarc, or do I/O beyond reading a file a caller names.

pub mod catalog;
pub mod checkpoint;
pub mod cost;
pub mod dtype;
pub mod fxhash;
pub mod gguf;
pub mod inventory;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod profile;
pub mod reference;
pub mod trace;
pub mod untrusted;
pub mod vision;
pub mod workload;

/// Bytes in a GiB, the unit of budgets ("8G" = 8 GiB, as the paper's `-mva` MiB values).
pub const GIB: u64 = 1 << 30;
/// Bytes in a MiB.
pub const MIB: u64 = 1 << 20;
