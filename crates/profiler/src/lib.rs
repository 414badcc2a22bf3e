//! pipeshard-profiler: measures a Profile (PCIe, DRAM, GPU and CPU op throughput, their interference) on the
//! machine it runs on, using exec's own kernels so that what is profiled is what runs.
//!
//! It depends on pipeshard-core and pipeshard-exec; it must never depend on planner or sim.
