//! The executor's error type. Every variant carries what a user needs to fix the problem; cudarc's errors are
//! turned into [`ExecError::Cuda`] at the call site (in `exec::cuda`), so no cudarc type leaks out of the crate.

use pipeshard_core::inventory::UnitId;
use pipeshard_core::plan::PhaseKind;

/// Why a run could not start or did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// No usable CUDA device (libraries missing, no device, context creation failed).
    #[error("no CUDA device: {reason}")]
    NoCuda { reason: String },
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA call `{call}` failed: {reason}")]
    Cuda { call: &'static str, reason: String },
    /// The model uses something this executor does not run.
    #[error("model {model}: {what} is not supported by the executor ({hint})")]
    UnsupportedModel { model: String, what: String, hint: String },
    /// The plan asks for something this executor cannot do.
    #[error("{phase:?} plan: {reason}")]
    UnsupportedPlan { phase: PhaseKind, reason: String },
    /// The plan does not fit the VRAM budget once the runtime overhead is measured.
    #[error(
        "{phase:?} plan does not fit the VRAM budget of {budget_bytes} bytes: {line} needs {needed_bytes} bytes, \
         {over_bytes} bytes more than the {available_bytes} bytes left for it \
         (measured runtime overhead {overhead_bytes} bytes); {detail}"
    )]
    OverBudget {
        phase: PhaseKind,
        line: String,
        needed_bytes: u64,
        available_bytes: u64,
        over_bytes: u64,
        budget_bytes: u64,
        overhead_bytes: u64,
        detail: String,
    },
    /// The process used more VRAM than the budget while running (measured with device free-memory deltas).
    #[error("measured process VRAM peak {peak_bytes} bytes exceeds the budget of {budget_bytes} bytes")]
    BudgetExceeded { peak_bytes: u64, budget_bytes: u64 },
    /// The plan breaks one of the core invariants (see `Plan::validate`).
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A plan references a unit the executor's model does not have, or misses one.
    #[error("{phase:?} plan has no placement for unit {unit}")]
    MissingPlacement { phase: PhaseKind, unit: UnitId },
    /// Bad input (tokens out of range, empty prompt, context overflow).
    #[error("invalid input: {0}")]
    Input(String),
    /// Weights could not be loaded from a checkpoint.
    #[error("cannot load weights from {file}: tensor `{tensor}` {problem}")]
    Checkpoint { file: String, tensor: String, problem: String },
    /// The host could not allocate a buffer (weights, KV mirror): out of memory, or an absurd size.
    #[error(
        "cannot allocate {bytes} bytes of host memory for {what}: free host memory, or run fewer layers \
         (`--layers`), a smaller context (`--ctx`) or smaller weights (`--weights q4_0`)"
    )]
    HostMemory { what: String, bytes: u64 },
    /// The run was stopped from outside (Ctrl-C); device memory and page-locked host memory are released.
    #[error("interrupted after {passes} forward passes; device memory released")]
    Interrupted { passes: usize },
    /// Writing an export (safetensors, config) failed.
    #[error("cannot write {path}: {reason}")]
    Io { path: String, reason: String },
}

/// Shorthand for results of this crate.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;
