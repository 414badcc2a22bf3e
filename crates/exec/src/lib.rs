//! pipeshard-exec: the real executor. It runs a Plan on a CUDA GPU (cudarc, loaded at run time) plus CPU worker
//! threads within the VRAM budget, and measures the same Metrics and Trace as the simulator.
//!
//! Only `exec::cuda` will touch cudarc. It depends on pipeshard-core; it must never depend on planner or sim.
