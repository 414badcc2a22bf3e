//! pipeshard-sim: a deterministic discrete-event simulator that predicts TTFT, TPS, end-to-end latency, peak
//! VRAM and a timeline for a plan on a machine described by a Profile.
//!
//! Resources: GPU compute stream, H2D and D2H copy engines, CPU worker pool, host DRAM shared by CPU ops and
//! DMA. Time is integer nanoseconds. It depends on pipeshard-core only; it must never depend on planner, exec,
//! profiler or cudarc.
