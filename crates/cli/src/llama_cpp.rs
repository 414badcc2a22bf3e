//! The llama.cpp bridge: the flags that come closest to a plan (`plan --llama-cpp`), and the plan that a set of
//! llama.cpp flags makes (`plan --from-llama-cpp "<flags>"`), so the configuration someone runs today can be
//! simulated and compared with ours.
//!
//! llama.cpp's placement rules, as modelled here (llama.cpp b6000-era `common/arg.cpp` and `llama-model.cpp`):
//! - `-ngl N` puts the **last** N decoder layers on the GPU (weights and KV); `N > n_layers` also puts the output
//!   head there; the token embedding always stays on the CPU.
//! - `-ot REGEX=BUFFER` (repeatable, comma lists allowed) moves every tensor whose name the regex matches
//!   anywhere to that buffer (`CPU`, or a GPU buffer such as `CUDA0`); the first matching pattern wins, in
//!   command-line order. `--n-cpu-moe N` adds `blk\.i\.ffn_(up|down|gate)_exps=CPU` for the first N layers,
//!   `--cpu-moe` for all.
//! - The KV cache of a layer stays with the layer `-ngl` gives it, whatever `-ot` does (`-nkvo`: all in host
//!   memory), and attention runs where the KV is.
//! - In prefill, ubatches of at least 32 tokens run the matmuls of CPU-resident weights on the GPU after copying
//!   them (op offload), unless `--no-op-offload`.
//!
//! What the flags cannot express, and the converters say so in notes: streaming (llama.cpp has no ring; a
//! streamed unit stays in host memory), a placement per phase (flags follow the decode plan), part of a layer's
//! experts on the GPU (llama.cpp stores them as one tensor), a pinned token embedding, and attention on one side
//! with its KV on the other.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use pipeshard_core::cost::CostModel;
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::ModelSpec;
use pipeshard_core::plan::{PLAN_SCHEMA_VERSION, PhaseKind, Placement, Plan};
use pipeshard_core::workload::Workload;
use pipeshard_planner::estimate::{Estimator, Layout};
use regex::Regex;

/// llama.cpp's default `-ub`.
const DEFAULT_UBATCH: u64 = 512;
/// The buffer `-ot` names for the GPU.
const GPU_BUFFER: &str = "CUDA0";

/// One tensor override, in command-line order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Override {
    /// `-ot PATTERN=BUFFER`; `gpu`: the buffer is a GPU's.
    Tensors { pattern: String, gpu: bool },
    /// `--n-cpu-moe N`: the experts of the first N layers on the CPU.
    NCpuMoe(u32),
    /// `--cpu-moe`: every expert on the CPU.
    CpuMoe,
}

impl Override {
    /// The (pattern, on GPU) pairs llama.cpp adds for it.
    fn patterns(&self) -> Vec<(String, bool)> {
        match self {
            Override::Tensors { pattern, gpu } => vec![(pattern.clone(), *gpu)],
            Override::NCpuMoe(n) => {
                (0..*n).map(|i| (format!("blk\\.{i}\\.ffn_(up|down|gate)_exps"), false)).collect()
            }
            Override::CpuMoe => vec![("\\.ffn_(up|down|gate)_exps".into(), false)],
        }
    }
}

/// The placement flags of one llama.cpp run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Flags {
    /// `-ngl`.
    pub ngl: u32,
    /// `-ot`, `--n-cpu-moe`, `--cpu-moe`, in order.
    pub overrides: Vec<Override>,
    /// `-c`: the context of all sequences together.
    pub ctx: Option<u64>,
    pub ubatch: Option<u64>,
    /// `-np`.
    pub parallel: Option<u64>,
    pub threads: Option<u32>,
    /// `-fa on|off`; `None` is llama.cpp's `auto` (on where supported, as on CUDA).
    pub flash_attn: Option<bool>,
    /// `-nkvo`.
    pub no_kv_offload: bool,
    /// `-kvu`: one KV cache for all sequences.
    pub kv_unified: bool,
    /// `--no-op-offload`.
    pub no_op_offload: bool,
    /// Flags that do not affect placement, as written (they are ignored).
    pub ignored: Vec<String>,
}

/// Per layer, whether the plan wants a tensor family on the GPU (`None`: the layer has none).
type WantGpu<'a> = dyn Fn(u32) -> Option<bool> + 'a;

/// `(0|1|2)` of layer numbers.
fn alternation(layers: &[u32]) -> String {
    format!("({})", layers.iter().map(u32::to_string).collect::<Vec<_>>().join("|"))
}

impl Flags {
    /// The flags closest to `plan`'s decode placement, and what they cannot express.
    #[must_use]
    pub fn from_plan(plan: &Plan, inv: &Inventory) -> (Flags, Vec<String>) {
        let p = &plan.decode;
        let gpu = |id: UnitId| p.placement(id) == Some(Placement::Pinned);
        let n = inv.units.iter().filter_map(|u| u.id.layer()).max().map_or(0, |l| l + 1);
        // -ngl: the longest suffix of layers whose attention runs on the GPU (their KV goes with them).
        let suffix = (0..n).rev().take_while(|&l| gpu(UnitId::Attn { layer: l })).count() as u32;
        let ngl = if suffix == n && gpu(UnitId::Output) { n + 1 } else { suffix };
        let by_ngl = |l: u32| l >= n - suffix;
        let unit = |id: UnitId| inv.position(id).is_some().then(|| gpu(id));
        // A layer's experts go where most of them are.
        let experts = |l: u32| -> Option<bool> {
            let (mut on, mut all) = (0, 0);
            for u in inv.units.iter().filter(|u| matches!(u.id, UnitId::Expert { layer, .. } if layer == l)) {
                all += 1;
                on += u32::from(gpu(u.id));
            }
            (all > 0).then_some(2 * on > all)
        };
        let families: [(&str, &WantGpu); 5] = [
            ("attn_.*", &|l| unit(UnitId::Attn { layer: l })),
            ("ffn_gate_inp\\.weight", &|l| unit(UnitId::Router { layer: l })),
            ("ffn_(gate|up|down)\\.weight", &|l| unit(UnitId::Ffn { layer: l })),
            ("ffn_(gate|up|down)_shexp\\.weight", &|l| unit(UnitId::SharedExperts { layer: l })),
            ("ffn_(gate|up|down)_exps\\.weight", &experts),
        ];
        let mut overrides = Vec::new();
        let mut notes = Vec::new();
        for (tensors, want) in families {
            let to_gpu: Vec<u32> = (0..n).filter(|&l| want(l) == Some(true) && !by_ngl(l)).collect();
            let to_cpu: Vec<u32> = (0..n).filter(|&l| want(l) == Some(false) && by_ngl(l)).collect();
            let prefix = to_cpu.iter().enumerate().all(|(i, &l)| l == i as u32);
            if tensors.ends_with("_exps\\.weight") && !to_cpu.is_empty() && prefix {
                overrides.push(Override::NCpuMoe(to_cpu.len() as u32));
            } else if !to_cpu.is_empty() {
                overrides.push(Override::Tensors {
                    pattern: format!("blk\\.{}\\.{tensors}", alternation(&to_cpu)),
                    gpu: false,
                });
            }
            if !to_gpu.is_empty() {
                overrides.push(Override::Tensors {
                    pattern: format!("blk\\.{}\\.{tensors}", alternation(&to_gpu)),
                    gpu: true,
                });
                if tensors == "attn_.*" {
                    notes.push(format!(
                        "llama.cpp keeps a layer's KV where -ngl puts it: layers {} have their attention on the GPU in \
                         the plan but their KV, and so their attention, on the CPU with these flags",
                        alternation(&to_gpu)
                    ));
                }
            }
        }
        if gpu(UnitId::Output) != (ngl > n) {
            overrides
                .push(Override::Tensors { pattern: "^output\\.weight".into(), gpu: gpu(UnitId::Output) });
        }
        let split: Vec<u32> = (0..n)
            .filter(|&l| {
                let mut sides = p
                    .placements
                    .iter()
                    .filter(|u| matches!(u.unit, UnitId::Expert { layer, .. } if layer == l));
                let first = sides.next().map(|u| u.placement == Placement::Pinned);
                sides.any(|u| Some(u.placement == Placement::Pinned) != first)
            })
            .collect();
        if !split.is_empty() {
            notes.push(format!(
                "llama.cpp stores a layer's experts as one tensor: layers {} split theirs in the plan and go where \
                 most of them are",
                alternation(&split)
            ));
        }
        if p.placements.iter().any(|u| u.placement == Placement::Streamed) {
            notes.push(
                "llama.cpp cannot stream: streamed units stay in host memory and run on the CPU".into(),
            );
        }
        if gpu(UnitId::TokenEmbd) {
            notes.push("llama.cpp keeps the token embedding on the CPU".into());
        }
        if plan.prefill.placements != plan.decode.placements {
            notes.push(
                "llama.cpp uses one placement for both phases: these flags follow the decode plan".into(),
            );
        }
        let w = &plan.workload;
        let flags = Flags {
            ngl,
            overrides,
            ctx: Some(w.ctx * w.batch),
            ubatch: Some(w.ubatch),
            parallel: (w.batch > 1).then_some(w.batch),
            threads: Some(p.cpu_threads),
            flash_attn: Some(w.flash_attn),
            no_kv_offload: false,
            kv_unified: w.kv_unified,
            no_op_offload: !plan.prefill.op_offload,
            ignored: Vec::new(),
        };
        (flags, notes)
    }

    /// The flags as a command line (without the program and `-m`).
    #[must_use]
    pub fn to_args(&self) -> String {
        let mut v = vec![format!("-ngl {}", self.ngl)];
        for o in &self.overrides {
            v.push(match o {
                Override::Tensors { pattern, gpu } => {
                    format!("-ot \"{pattern}={}\"", if *gpu { GPU_BUFFER } else { "CPU" })
                }
                Override::NCpuMoe(n) => format!("--n-cpu-moe {n}"),
                Override::CpuMoe => "--cpu-moe".into(),
            });
        }
        let mut opt = |flag: &str, v_: Option<String>| {
            if let Some(x) = v_ {
                v.push(format!("{flag} {x}"));
            }
        };
        opt("-c", self.ctx.map(|x| x.to_string()));
        opt("-ub", self.ubatch.map(|x| x.to_string()));
        opt("-np", self.parallel.map(|x| x.to_string()));
        opt("-t", self.threads.map(|x| x.to_string()));
        opt("-fa", self.flash_attn.map(|fa| if fa { "on" } else { "off" }.to_string()));
        if self.no_kv_offload {
            v.push("-nkvo".into());
        }
        if self.kv_unified {
            v.push("-kvu".into());
        }
        if self.no_op_offload {
            v.push("--no-op-offload".into());
        }
        v.join(" ")
    }

    /// Parses a llama.cpp command line (`llama-server -m x.gguf -ngl 20 -ot "…=CPU" …`, the program and model
    /// optional). Flags that do not place tensors or size the context are kept in `ignored`.
    pub fn parse(text: &str) -> anyhow::Result<Flags> {
        let words = shlex::split(text)
            .with_context(|| format!("cannot split `{text}` into words (unbalanced quotes?)"))?;
        let mut f = Flags::default();
        let mut it = words.into_iter().peekable();
        if it.peek().is_some_and(|w| !w.starts_with('-')) {
            it.next(); // the program
        }
        let number = |flag: &str, v: Option<String>| -> anyhow::Result<u64> {
            let v = v.with_context(|| format!("llama.cpp flag {flag} needs a value"))?;
            v.parse().with_context(|| format!("llama.cpp flag {flag} {v}: expected a whole number"))
        };
        while let Some(flag) = it.next() {
            match flag.as_str() {
                "-ngl" | "--n-gpu-layers" | "--gpu-layers" => {
                    let v = it.next();
                    f.ngl = if v.as_deref() == Some("all") {
                        u32::MAX
                    } else {
                        u32::try_from(number(&flag, v)?).unwrap_or(u32::MAX)
                    };
                }
                "-ot" | "--override-tensor" => {
                    let v = it.next().with_context(|| format!("llama.cpp flag {flag} needs REGEX=BUFFER"))?;
                    for item in v.split(',') {
                        let (pattern, buffer) = item.rsplit_once('=').with_context(|| {
                            format!("-ot `{item}`: write REGEX=BUFFER, e.g. `blk\\.1[0-9]\\.ffn_.*=CPU`")
                        })?;
                        Regex::new(pattern).with_context(|| format!("-ot `{item}`: not a regex"))?;
                        let gpu = match buffer {
                            "CPU" => false,
                            b if ["CUDA", "ROCm", "Vulkan", "Metal", "SYCL"]
                                .iter()
                                .any(|g| b.starts_with(g)) =>
                            {
                                true
                            }
                            b => bail!(
                                "-ot `{item}`: unknown buffer type `{b}`; use CPU or a GPU buffer like CUDA0"
                            ),
                        };
                        f.overrides.push(Override::Tensors { pattern: pattern.to_string(), gpu });
                    }
                }
                "--n-cpu-moe" | "-ncmoe" => {
                    let n = u32::try_from(number(&flag, it.next())?).context("--n-cpu-moe: too large")?;
                    f.overrides.push(Override::NCpuMoe(n));
                }
                "--cpu-moe" | "-cmoe" => f.overrides.push(Override::CpuMoe),
                "-c" | "--ctx-size" => f.ctx = Some(number(&flag, it.next())?),
                "-ub" | "--ubatch-size" => f.ubatch = Some(number(&flag, it.next())?),
                "-np" | "--parallel" => f.parallel = Some(number(&flag, it.next())?),
                "-t" | "--threads" => {
                    f.threads = Some(u32::try_from(number(&flag, it.next())?).context("-t: too large")?);
                }
                "-fa" | "--flash-attn" => {
                    // Older builds take a bare -fa (on); newer ones on|off|auto.
                    let value = match it.peek().map(String::as_str) {
                        Some("on" | "1" | "true") => Some(Some(true)),
                        Some("off" | "0" | "false") => Some(Some(false)),
                        Some("auto") => Some(None),
                        _ => None,
                    };
                    f.flash_attn = match value {
                        Some(v) => {
                            it.next();
                            v
                        }
                        None => Some(true),
                    };
                }
                "-nkvo" | "--no-kv-offload" => f.no_kv_offload = true,
                "-kvu" | "--kv-unified" => f.kv_unified = true,
                "--no-op-offload" => f.no_op_offload = true,
                "-m" | "--model" => {
                    it.next();
                }
                other if other.starts_with('-') => {
                    let mut s = other.to_string();
                    if it.peek().is_some_and(|v| !v.starts_with('-')) {
                        let _ = write!(s, " {}", it.next().expect("peeked"));
                    }
                    f.ignored.push(s);
                }
                other => {
                    bail!("llama.cpp flags: `{other}` is not a flag (quote -ot values that hold spaces)")
                }
            }
        }
        Ok(f)
    }

    /// Whether llama.cpp puts tensor `name` (of decoder layer `layer`) on the GPU.
    fn tensor_on_gpu(
        &self,
        patterns: &[(Regex, bool)],
        name: &str,
        layer: Option<u32>,
        n_layers: u32,
    ) -> bool {
        if let Some((_, gpu)) = patterns.iter().find(|(re, _)| re.is_match(name)) {
            return *gpu;
        }
        match layer {
            Some(l) => l + self.ngl.min(n_layers) >= n_layers,
            None => name != "token_embd.weight" && self.ngl > n_layers,
        }
    }

    /// The plan llama.cpp runs with these flags for `spec`: one placement for both phases, no streaming, op
    /// offload in prefill unless `--no-op-offload`, VRAM and predicted times from the estimator. `-c`, `-ub`,
    /// `-np` and `-fa` set the workload (`-c` is shared by the `-np` sequences; unset, `ctx` and llama.cpp's
    /// `-ub` 512 apply); `prompt_tokens` and `gen_tokens` come from the caller.
    pub fn plan(
        &self,
        spec: &ModelSpec,
        ctx: u64,
        prompt_tokens: Option<u64>,
        gen_tokens: u64,
        cost: &dyn CostModel,
        budget_bytes: u64,
    ) -> anyhow::Result<Plan> {
        let batch = self.parallel.unwrap_or(1).max(1);
        let ctx = self.ctx.map_or(ctx, |c| c / batch);
        let prompt = match prompt_tokens {
            Some(p) => p,
            None => ctx.checked_sub(gen_tokens).filter(|&p| p > 0).with_context(|| {
                format!("a context of {ctx} tokens per sequence leaves no prompt before {gen_tokens} generated tokens")
            })?,
        };
        let workload = Workload {
            batch,
            flash_attn: self.flash_attn.unwrap_or(true),
            kv_unified: self.kv_unified,
            // llama.cpp maps the model file (and then keeps CPU weights out of its pinned buffer).
            host_pageable: true,
            ..Workload::single(prompt, ctx, gen_tokens, self.ubatch.unwrap_or(DEFAULT_UBATCH))
        };
        workload.validate()?;
        let inv = Inventory::new(spec);
        let est = Estimator::new(spec, &inv, &workload, cost);
        let patterns: Vec<(Regex, bool)> = self
            .overrides
            .iter()
            .flat_map(Override::patterns)
            .map(|(p, g)| Ok((Regex::new(&p).with_context(|| format!("-ot `{p}`: not a regex"))?, g)))
            .collect::<anyhow::Result<_>>()?;
        let n = spec.text.n_layers;
        let kv_on_gpu = |l: u32| !self.no_kv_offload && l + self.ngl.min(n) >= n;
        let mut layout = Layout::all_cpu(&est.structure, inv.units.len());
        let mut moved = (Vec::new(), Vec::new());
        for (pos, u) in inv.units.iter().enumerate() {
            let gpu = if let UnitId::Kv { layer } = u.id {
                kv_on_gpu(layer)
            } else {
                let (mut on, mut all) = (0u64, 0u64);
                for part in &u.parts {
                    let t = &inv.tensors[part.tensor];
                    all += part.bytes;
                    if self.tensor_on_gpu(&patterns, &t.name, t.layer, n) {
                        on += part.bytes;
                    }
                }
                all > 0 && 2 * on > all
            };
            // Attention runs where the KV is.
            let gpu = match u.id {
                UnitId::Attn { layer } if gpu != kv_on_gpu(layer) => {
                    (if gpu { &mut moved.0 } else { &mut moved.1 }).push(layer);
                    kv_on_gpu(layer)
                }
                _ => gpu,
            };
            layout.placements[pos] = if gpu { Placement::Pinned } else { Placement::Cpu };
            if let UnitId::Expert { layer, .. } = u.id {
                let c = &mut layout.experts[layer as usize];
                if gpu {
                    c[0] += 1;
                    c[2] -= 1;
                }
            }
        }
        let mut notes = vec![format!("from llama.cpp flags: {}", self.to_args())];
        if !moved.0.is_empty() {
            notes.push(format!(
                "layers {}: q/k/v/o weights on the GPU but KV in host memory: attention counted on the CPU",
                alternation(&moved.0)
            ));
        }
        if !moved.1.is_empty() {
            notes.push(format!(
                "layers {}: q/k/v/o weights in host memory but KV in VRAM: attention and KV counted on the CPU",
                alternation(&moved.1)
            ));
        }
        if !self.ignored.is_empty() {
            notes.push(format!("ignored: {}", self.ignored.join(" ")));
        }
        let op_offload = !self.no_op_offload;
        let vram = est.vram(PhaseKind::Prefill, &layout).max(&est.vram(PhaseKind::Decode, &layout));
        if vram.total() > budget_bytes {
            bail!(
                "these flags need {} bytes of VRAM (weights {}, KV {}, scratch {}, runtime {}), more than the budget \
                 of {budget_bytes}; raise --budget to compare",
                vram.total(),
                vram.pinned_weights_bytes,
                vram.kv_bytes,
                vram.scratch_bytes,
                vram.runtime_overhead_bytes
            );
        }
        let phase = |kind| {
            let mut pp = est.phase_plan(&inv, kind, &layout, vram, kind == PhaseKind::Prefill && op_offload);
            if let Some(t) = self.threads {
                pp.cpu_threads = t;
            }
            pp
        };
        let plan = Plan {
            schema_version: PLAN_SCHEMA_VERSION,
            planner: "llama.cpp".into(),
            model: spec.name.clone(),
            weights: Some(spec.weights.clone()),
            budget_bytes,
            workload,
            prefill: phase(PhaseKind::Prefill),
            decode: phase(PhaseKind::Decode),
            switch_bytes: 0,
            prediction: Some(est.predict(&layout, &layout, op_offload)),
            notes,
        };
        plan.validate(&inv).context("the plan of these llama.cpp flags is invalid (a bug)")?;
        Ok(plan)
    }
}

/// `plan --llama-cpp`: the command line and its notes.
#[must_use]
pub fn describe(plan: &Plan, inv: &Inventory) -> String {
    let (flags, notes) = Flags::from_plan(plan, inv);
    let mut out = format!("\nllama.cpp: llama-server -m MODEL.gguf {}\n", flags.to_args());
    for n in notes {
        let _ = writeln!(out, "  # {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::cost::TableCostModel;
    use pipeshard_core::plan::UnitPlacement;

    use crate::args::load_profile;
    use crate::experiment::resolve_model;

    fn cost() -> TableCostModel {
        TableCostModel::new(&load_profile("cli3").unwrap())
    }

    /// plan → flags → text → flags → plan.
    fn round_trip(plan: &Plan, spec: &ModelSpec) -> (String, Plan) {
        let inv = Inventory::new(spec);
        let (flags, _) = Flags::from_plan(plan, &inv);
        let text = format!("./llama-server -m model.gguf {} --temp 0.7", flags.to_args());
        let parsed = Flags::parse(&text).unwrap();
        assert_eq!(parsed.ignored, vec!["--temp 0.7".to_string()]);
        let w = &plan.workload;
        let back = parsed.plan(spec, w.ctx, Some(w.prompt_tokens), w.gen_tokens, &cost(), 1 << 40).unwrap();
        (text, back)
    }

    fn placements(p: &[UnitPlacement]) -> Vec<(String, Placement)> {
        p.iter().map(|u| (u.unit.to_string(), u.placement)).collect()
    }

    /// Every `-ngl N` plan comes back with the same placement, the same workload and llama.cpp's op offload.
    #[test]
    fn ngl_plans_round_trip() {
        let spec = resolve_model("nemo-4b@6L").unwrap();
        let w = Workload::single(900, 1024, 100, 256);
        for n in 0..=7 {
            let ngl = pipeshard_planner::ngl::Ngl { fixed_layers: Some(n), ..Default::default() };
            let plan = pipeshard_planner::Planner::plan(&ngl, &spec, &w, &cost(), 1 << 40).unwrap();
            let (text, back) = round_trip(&plan, &spec);
            assert!(text.contains(&format!("-ngl {n} ")) && !text.contains("-ot"), "{text}");
            assert_eq!(placements(&back.decode.placements), placements(&plan.decode.placements), "{text}");
            assert_eq!(back.workload, plan.workload, "{text}");
            assert_eq!(back.prefill.op_offload, plan.prefill.op_offload, "{text}");
        }
    }

    /// A plan that llama.cpp can express — an attention suffix, FFNs and experts on either side of it, the
    /// head pinned without the last layer's count — comes back unit for unit, through `-ot` and `--n-cpu-moe`.
    #[test]
    fn mixed_plans_round_trip_through_overrides() {
        for model in ["qwen3-30b-a3b@4L", "nemo-4b@4L"] {
            let spec = resolve_model(model).unwrap();
            let moe = spec.is_moe();
            let w = Workload::single(900, 1024, 100, 256);
            let place = |_: PhaseKind, u: UnitId| match u {
                UnitId::Attn { layer } | UnitId::Kv { layer } | UnitId::Router { layer } if layer >= 2 => {
                    Placement::Pinned
                }
                // Against -ngl 2: layer 1's FFN and experts on the GPU, layer 3's FFN and layer 2's experts on
                // the CPU, the head on the GPU.
                UnitId::Ffn { layer: 1 | 2 } | UnitId::Expert { layer: 1 | 3, .. } | UnitId::Output => {
                    Placement::Pinned
                }
                _ => Placement::Cpu,
            };
            let plan = pipeshard_exec::testing::manual_plan(&spec, w, 1 << 40, 0, 0, 8, place);
            plan.validate(&Inventory::new(&spec)).unwrap();
            let (text, back) = round_trip(&plan, &spec);
            assert!(text.contains("-ngl 2 ") && text.contains("^output\\.weight=CUDA0"), "{text}");
            if moe {
                assert!(text.contains("blk\\.(1)\\.ffn_(gate|up|down)_exps\\.weight=CUDA0"), "{text}");
                assert!(text.contains("blk\\.(2)\\.ffn_(gate|up|down)_exps\\.weight=CPU"), "{text}");
            } else {
                assert!(text.contains("blk\\.(3)\\.ffn_(gate|up|down)\\.weight=CPU"), "{text}");
            }
            assert_eq!(placements(&back.decode.placements), placements(&plan.decode.placements), "{text}");
        }
    }

    /// What cannot be expressed is said, and a second round trip changes nothing more.
    #[test]
    fn searched_plans_settle_after_one_round_trip() {
        let spec = resolve_model("qwen3-30b-a3b@4L").unwrap();
        let w = Workload::single(3996, 4096, 100, 1024);
        let plan = pipeshard_planner::by_name("ilp").unwrap().plan(&spec, &w, &cost(), 3 << 30).unwrap();
        let inv = Inventory::new(&spec);
        let (_, back) = round_trip(&plan, &spec);
        let (_, again) = round_trip(&back, &spec);
        assert_eq!(placements(&again.decode.placements), placements(&back.decode.placements));
        let (flags, notes) = Flags::from_plan(&plan, &inv);
        let streams = plan.decode.placements.iter().any(|u| u.placement == Placement::Streamed);
        assert_eq!(notes.iter().any(|n| n.contains("cannot stream")), streams, "{notes:?}");
        assert!(flags.no_op_offload);
    }

    #[test]
    fn flags_parse_like_llama_cpp() {
        let f = Flags::parse(
            "llama-cli -m x.gguf -ngl 99 -ot 'blk\\.1[0-9]\\.ffn_.*_exps=CPU,token_embd=CUDA0' --n-cpu-moe 2 \
             -c 8192 -np 2 -ub 256 -fa -t 12 -nkvo -kvu",
        )
        .unwrap();
        assert!(f.kv_unified && f.to_args().contains("-kvu"));
        assert_eq!(f.ngl, 99);
        assert_eq!(f.overrides.len(), 3);
        assert_eq!(f.overrides[2], Override::NCpuMoe(2));
        assert_eq!((f.ctx, f.parallel, f.ubatch, f.threads), (Some(8192), Some(2), Some(256), Some(12)));
        assert_eq!((f.flash_attn, f.no_kv_offload), (Some(true), true));
        // -nkvo keeps every KV, and so every attention, on the CPU.
        let spec = resolve_model("qwen3-30b-a3b@4L").unwrap();
        let plan = f.plan(&spec, 4096, None, 100, &cost(), 1 << 40).unwrap();
        assert_eq!(plan.workload.ctx, 4096);
        assert!(
            plan.decode.placements.iter().all(|u| !matches!(u.unit, UnitId::Attn { .. } | UnitId::Kv { .. })
                || u.placement == Placement::Cpu)
        );
        assert!(plan.notes.iter().any(|n| n.contains("attention counted on the CPU")), "{:?}", plan.notes);
        // Experts of layers 0, 1 on the CPU (--n-cpu-moe 2), 2, 3 on the GPU.
        let e = |l| plan.decode.placement(UnitId::Expert { layer: l, expert: 0 }).unwrap();
        assert_eq!(
            [e(0), e(1), e(2), e(3)],
            [Placement::Cpu, Placement::Cpu, Placement::Pinned, Placement::Pinned]
        );
        for (bad, says) in [
            ("-ngl x", "whole number"),
            ("-ot 'blk.(=CPU'", "not a regex"),
            ("-ot 'ffn=NPU0'", "unknown buffer"),
            ("-ot ffn", "REGEX=BUFFER"),
            ("-ngl 1 -ot 'a=CPU", "quotes"),
        ] {
            let e = format!("{:#}", Flags::parse(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = format!(
            "{:#}",
            Flags::parse("-ngl 99").unwrap().plan(&spec, 4096, None, 100, &cost(), 1 << 20).unwrap_err()
        );
        assert!(e.contains("raise --budget"), "{e}");
    }
}
