//! pipeshard-planner: decides, for a model, a workload and a VRAM budget, where every placement unit lives in
//! each phase and how deep the copy pipeline runs.
//!
//! Planners: `ngl` (llama.cpp's layer offload baseline), `pshard` (the paper's five strategies), `greedy`
//! (benefit per VRAM byte), `ilp` (exact, good_lp) and `exhaustive` (an oracle for small spaces).
//! It depends on pipeshard-core and pipeshard-sim only; it must never depend on exec, profiler or cudarc.
