//! Experiment definitions (`experiments/NAME.toml`) and the grid of cells they expand to.
//!
//! An experiment is a cartesian product: models × contexts × budgets × batches × ubatches × planners, on one
//! profile, with one generation length — or the union of several such grids (`[[grid]]` sections, each with
//! its own models, contexts, budgets and ubatches, and optionally a subset of the planners; missing fields fall
//! back to the top level), so that one
//! file can hold truncated models at budgets of MiB and full models at budgets of GiB. A model is a catalog name
//! or a model file ([`resolve_model`]), optionally truncated to its first N layers with `@NL`
//! (`qwen3-30b-a3b@2L`), which is how CI-sized grids stay small enough for the exhaustive planner. Prompt length, per grid: `prompt_tokens` as one number, or as a table by context
//! (`{ "1K" = 908, "4K" = 4035 }`: the paper's prompt files, DIGEST §5.3, differ by tokenizer), else the
//! context minus the generated tokens — the paper's prompts nearly fill the context, so TPS is measured at
//! almost full KV. A cell generates `gen_tokens`, or fewer where the prompt leaves less room: llama.cpp stops
//! at a full context (the paper's 4K Minitron runs generate 60 tokens). `batch` (a number or a list) is the
//! parallel requests, each with its own prompt and `ctx` tokens of KV; `kv_unified` gives the planners that do
//! not pick it themselves (`greedy`, `exhaustive`) one unified cache instead of one per sequence
//! (`pshard` always runs unified, `ngl` never, as in the paper's batched runs). `weights` stores every matrix in
//! one format (the executor's: `bf16`, `f16`, `q8_0`, `q4_0`, `q2_k`, `q3_k`, `q4_k`, `q6_k`); a `[[grid]]` may name its own, and its models are
//! then labelled `model:format` in cells and results, so one experiment can run a model in two formats.
//!
//! Paper reproductions and executor runs add:
//! - `budget_excludes_runtime = true`: budgets are the paper's `-mva`, which does not count the CUDA context,
//!   so planners get the budget plus the profile's runtime overhead.
//! - `[ngl]`: the `ngl` cells replay the baseline's measured `-ngl N` from a CSV of the paper's runs
//!   (`Model, Context, MVA, NGL, Ubatch`; MVA in decimal thousands, so 2G is looked up as 2000, as the
//!   paper's scripts do), with a per-model fallback where the CSV has no run. A replayed N ran on the whole
//!   card, so its plan gets the machine's VRAM as budget; the cell's budget only chose N. With
//!   `ctx_is_total = true` the lookup context is the cell's context times its batch (the `-c N×1024` of the
//!   paper's batched runs).
//! - `ngl_flash_attn = true`: `ngl` plans llama.cpp's `-fa on` (the paper's batched runs did; the executor
//!   implements flash attention only), instead of Table 4 / Figure 2's `-fa off`.
//! - `identical_requests = true`: every request is the same token sequence, as `llama-batched-bench` (the
//!   paper's batched runs) feeds token 0 to every sequence, so a decode step's tokens route alike and touch
//!   top-k experts per layer whatever the batch.
//! - `[paper]`: the paper's CSV that `pipeshard repro` compares against, its model names, and the models
//!   whose cells calibrate the profile.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use pipeshard_core::catalog;
use pipeshard_core::checkpoint::Checkpoint;
use pipeshard_core::dtype::DType;
use pipeshard_core::gguf;
use pipeshard_core::model::{ModelSpec, WeightFormat, load_hf_config};
use pipeshard_core::workload::{MAX_BATCH, Requests, Workload};
use serde::Deserialize;

use crate::args::{format_bytes, format_tokens, parse_bytes, parse_tokens};

/// A count written as a number or with a binary suffix (`16K`, `8G`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    Number(u64),
    Text(String),
}

/// One `[[grid]]` section as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GridFile {
    pub models: Option<Vec<String>>,
    /// At the top level, the experiment's planners (default: every planner); in a `[[grid]]`, the planners
    /// that grid runs (default: the experiment's).
    pub planners: Option<Vec<String>>,
    pub ctx: Option<Vec<Quantity>>,
    pub budgets: Option<Vec<Quantity>>,
    pub ubatch: Option<Vec<Quantity>>,
    /// Ring depths to force on every plan (each planner otherwise picks its own).
    pub depths: Option<Vec<u32>>,
    /// One prompt length, or one per context (`{ "1K" = 908 }`); default: ctx − gen_tokens.
    pub prompt_tokens: Option<PromptTokensFile>,
    /// Parallel requests: one number or a list (default 1).
    pub batch: Option<Counts>,
    /// Store every matrix in this format (`bf16`, `f16`, `q8_0`, `q4_0`, `q2_k`, `q3_k`, `q4_k`, `q6_k`) instead of the catalog's — the
    /// executor runs these. At the top level: every grid's default; in a `[[grid]]`: that grid's models.
    pub weights: Option<String>,
}

/// One count or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Counts {
    One(u64),
    Many(Vec<u64>),
}

impl Counts {
    fn to_vec(&self) -> Vec<u64> {
        match self {
            Counts::One(n) => vec![*n],
            Counts::Many(v) => v.clone(),
        }
    }
}

/// `prompt_tokens` as written: a number or a table by context.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptTokensFile {
    Fixed(u64),
    ByCtx(BTreeMap<String, u64>),
}

/// The `[ngl]` section: replay the paper's measured `-ngl N`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NglFile {
    /// CSV of the baseline's runs (relative to the experiment file).
    pub csv: PathBuf,
    /// Our model name → the CSV's.
    pub names: BTreeMap<String, String>,
    /// N where the CSV has no run for a (model, ctx, budget, ubatch), per model (the paper's scripts' maxima).
    pub fallback: BTreeMap<String, u32>,
    /// Look N up at the cell's context × batch (the batched runs' `-c`), not its context per sequence.
    pub ctx_is_total: Option<bool>,
}

/// The `[paper]` section: what `pipeshard repro` compares against.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaperRef {
    /// The paper's CSV (relative to the experiment file).
    pub csv: PathBuf,
    /// Our model name → the CSV's.
    pub names: BTreeMap<String, String>,
    /// Models whose cells fit the profile's free parameters (`pipeshard repro calibrate`); the rest are held out.
    pub calibration_models: Vec<String>,
    /// Largest |relative error| that counts as reproducing a cell (the reproduction issue's goal).
    pub tolerance: f64,
}

/// An experiment file as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentFile {
    /// Defaults to the file's stem.
    pub name: Option<String>,
    #[serde(default)]
    pub description: String,
    pub profile: Option<String>,
    /// The top-level grid (and the defaults of `[[grid]]` sections).
    #[serde(flatten)]
    pub top: GridFile,
    #[serde(default)]
    pub grid: Vec<GridFile>,
    pub gen_tokens: Option<u64>,
    /// One KV cache for all sequences (llama.cpp `-kvu`) for the planners that take the workload's choice.
    pub kv_unified: Option<bool>,
    /// Budgets are the paper's `-mva`: the runtime's VRAM comes on top.
    pub budget_excludes_runtime: Option<bool>,
    /// Plan `ngl` with flash attention on (llama.cpp `-fa on`) instead of the paper's `-fa off`: the executor
    /// implements flash attention only, so experiments it runs (`validate`) need this.
    pub ngl_flash_attn: Option<bool>,
    /// Every request is the same token sequence (`llama-batched-bench`'s), so a decode step's tokens touch one
    /// token's experts; else they route independently.
    pub identical_requests: Option<bool>,
    /// `validate`: how many times each cell's plan runs (default 1); its measurements are the runs' medians.
    pub runs_per_cell: Option<u32>,
    pub ngl: Option<NglFile>,
    pub paper: Option<PaperRef>,
}

/// One validated grid: models × contexts × budgets × ubatches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    pub models: Vec<String>,
    /// `None`: the experiment's planners.
    pub planners: Option<Vec<String>>,
    pub ctx: Vec<u64>,
    pub budgets: Vec<u64>,
    pub ubatch: Vec<u64>,
    /// `[None]`: each planner's own depth.
    pub depths: Vec<Option<u32>>,
    pub prompt_tokens: PromptTokens,
    /// Parallel requests.
    pub batch: Vec<u64>,
    /// The matrices' format (`None`: each model's own).
    pub weights: Option<DType>,
    /// The name of each of `models` in cells and results: the model, with `:FORMAT` where the grid's
    /// `weights` differ from the experiment's (so one model may run in two formats).
    pub labels: Vec<String>,
}

/// How long the prompts of a grid are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    /// The context minus the generated tokens.
    FillContext,
    Fixed(u64),
    /// Context → prompt tokens (every context of the grid has one).
    ByCtx(BTreeMap<u64, u64>),
}

/// Key of a replayed `-ngl N`: model, context, budget, ubatch, batch.
pub type NglKey = (String, u64, u64, u64, u64);

/// A validated experiment.
#[derive(Debug, Clone, PartialEq)]
pub struct Experiment {
    pub name: String,
    pub description: String,
    pub profile: String,
    pub grids: Vec<Grid>,
    pub planners: Vec<String>,
    pub gen_tokens: u64,
    pub kv_unified: bool,
    pub weights: Option<DType>,
    pub budget_excludes_runtime: bool,
    /// `ngl` plans with flash attention on.
    pub ngl_flash_attn: bool,
    /// Distinct requests, or copies of one token sequence.
    pub requests: Requests,
    /// Replayed `-ngl N` of every `ngl` cell (empty: `ngl` picks N itself).
    pub ngl_layers: BTreeMap<NglKey, u32>,
    /// Runs of each cell's plan under `validate` (≥ 1): a machine whose runs of one plan differ by up to ~10 %
    /// (validation run39 against run40: TTFT p90 12 %) is measured by their median.
    pub runs_per_cell: u32,
    pub paper: Option<PaperRef>,
}

/// The generation length of the paper's Figure 2 (E2EL = TTFT + 100 / TPS).
pub const DEFAULT_GEN_TOKENS: u64 = 100;
/// The ubatch of the paper's Table 4 and of the sweep's default grid.
pub const DEFAULT_UBATCH: u64 = 1024;
/// The profile of the paper's Figure 2 and Table 4 machine (RTX 5090).
pub const DEFAULT_PROFILE: &str = "cli3";

fn quantities(
    v: &[Quantity],
    parse: fn(&str) -> anyhow::Result<u64>,
    field: &str,
) -> anyhow::Result<Vec<u64>> {
    v.iter()
        .map(|q| match q {
            Quantity::Number(n) => Ok(*n),
            Quantity::Text(s) => parse(s).with_context(|| format!("`{field}`")),
        })
        .collect()
}

impl Experiment {
    /// Reads and checks `experiments/NAME.toml`.
    pub fn load(path: &Path) -> anyhow::Result<Experiment> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut file: ExperimentFile =
            toml::from_str(&text).with_context(|| format!("{}: not a valid experiment", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        if let Some(n) = &mut file.ngl {
            n.csv = dir.join(&n.csv);
        }
        if let Some(p) = &mut file.paper {
            p.csv = dir.join(&p.csv);
        }
        let stem = path.file_stem().map_or_else(|| "experiment".into(), |s| s.to_string_lossy().into_owned());
        Experiment::from_file(file, &stem).with_context(|| format!("{}", path.display()))
    }

    /// What [`Experiment::load`] does after reading the file, for untrusted bytes (the `experiment_toml` fuzz
    /// target and the corpus replay test call this). `[ngl] csv` is replaced by `ngl_csv`, so that no input
    /// can make it read an arbitrary file (`/dev/zero` would never end).
    #[cfg_attr(not(test), allow(dead_code, reason = "called by the fuzz target in fuzz/ and by the tests"))]
    pub fn from_untrusted(bytes: &[u8], ngl_csv: &Path) -> anyhow::Result<Experiment> {
        let text = std::str::from_utf8(bytes).context("experiment file is not UTF-8")?;
        let mut file: ExperimentFile = toml::from_str(text).context("not a valid experiment")?;
        if let Some(n) = &mut file.ngl {
            n.csv = ngl_csv.to_path_buf();
        }
        Experiment::from_file(file, "fuzz")
    }

    /// Checks a parsed file; `stem` names it when it has no `name`.
    pub fn from_file(f: ExperimentFile, stem: &str) -> anyhow::Result<Experiment> {
        let top_weights = f.top.weights.as_deref().map(parse_weights).transpose().context("`weights`")?;
        let sections = if f.grid.is_empty() { vec![GridFile::default()] } else { f.grid.clone() };
        let mut grids = Vec::with_capacity(sections.len());
        for (i, g) in sections.into_iter().enumerate() {
            let what = if f.grid.is_empty() { String::new() } else { format!("[[grid]] {}: ", i + 1) };
            let pick = |own: Option<Vec<Quantity>>, top: &Option<Vec<Quantity>>| own.or_else(|| top.clone());
            let need = |v: Option<Vec<Quantity>>, field: &str| {
                v.filter(|v| !v.is_empty()).with_context(|| format!("{what}`{field}` is missing or empty"))
            };
            let models = g
                .models
                .or_else(|| f.top.models.clone())
                .filter(|v| !v.is_empty())
                .with_context(|| format!("{what}`models` is missing or empty"))?;
            let weights = match &g.weights {
                Some(w) => Some(parse_weights(w).with_context(|| format!("{what}`weights`"))?),
                None => top_weights,
            };
            let suffix = match weights {
                Some(d) if weights != top_weights => format!(":{}", d.name()),
                _ => String::new(),
            };
            grids.push(Grid {
                planners: g.planners,
                ctx: quantities(&need(pick(g.ctx, &f.top.ctx), "ctx")?, parse_tokens, "ctx")?,
                budgets: quantities(
                    &need(pick(g.budgets, &f.top.budgets), "budgets")?,
                    parse_bytes,
                    "budgets",
                )?,
                ubatch: match pick(g.ubatch, &f.top.ubatch) {
                    Some(u) => quantities(&u, parse_tokens, "ubatch")?,
                    None => vec![DEFAULT_UBATCH],
                },
                depths: match g.depths.or_else(|| f.top.depths.clone()) {
                    Some(d) if d.contains(&0) => bail!("{what}`depths` holds 0; a ring has at least 1 slot"),
                    Some(d) if !d.is_empty() => d.into_iter().map(Some).collect(),
                    _ => vec![None],
                },
                prompt_tokens: prompt_tokens(g.prompt_tokens.or_else(|| f.top.prompt_tokens.clone()))
                    .with_context(|| format!("{what}`prompt_tokens`"))?,
                batch: g.batch.or_else(|| f.top.batch.clone()).map_or_else(|| vec![1], |b| b.to_vec()),
                labels: models.iter().map(|m| format!("{m}{suffix}")).collect(),
                weights,
                models,
            });
        }
        let planners: Vec<String> =
            f.top.planners.unwrap_or_else(|| pipeshard_planner::NAMES.iter().map(|s| (*s).into()).collect());
        let ngl_layers = match &f.ngl {
            Some(n) if planners.iter().any(|p| p == "ngl") => replay_ngl(n, &grids)?,
            _ => BTreeMap::new(),
        };
        let e = Experiment {
            name: f.name.unwrap_or_else(|| stem.to_string()),
            description: f.description,
            profile: f.profile.unwrap_or_else(|| DEFAULT_PROFILE.into()),
            grids,
            planners,
            gen_tokens: f.gen_tokens.unwrap_or(DEFAULT_GEN_TOKENS),
            kv_unified: f.kv_unified.unwrap_or(false),
            weights: top_weights,
            budget_excludes_runtime: f.budget_excludes_runtime.unwrap_or(false),
            ngl_flash_attn: f.ngl_flash_attn.unwrap_or(false),
            requests: if f.identical_requests == Some(true) {
                Requests::Identical
            } else {
                Requests::Distinct
            },
            ngl_layers,
            runs_per_cell: f.runs_per_cell.unwrap_or(1),
            paper: f.paper,
        };
        e.check()?;
        Ok(e)
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.runs_per_cell == 0 {
            bail!("`runs_per_cell` is 0; each cell runs at least once");
        }
        if self.planners.is_empty() {
            bail!("`planners` is empty; list at least one");
        }
        if self.grids.iter().any(|g| g.ubatch.is_empty()) {
            bail!("`ubatch` is empty; list at least one");
        }
        if let Some(p) = self.planners.iter().find(|p| !pipeshard_planner::NAMES.contains(&p.as_str())) {
            bail!("unknown planner `{p}`; known: {}", pipeshard_planner::NAMES.join(", "));
        }
        for (i, g) in self.grids.iter().enumerate() {
            match &g.planners {
                Some(ps) if ps.is_empty() => {
                    bail!("[[grid]] {}: `planners` is empty; list at least one", i + 1)
                }
                Some(ps) => {
                    if let Some(p) = ps.iter().find(|p| !self.planners.contains(p)) {
                        bail!(
                            "[[grid]] {}: planner `{p}` is not among the experiment's `planners` ({})",
                            i + 1,
                            self.planners.join(", ")
                        );
                    }
                }
                None => {}
            }
        }
        for m in self.grids.iter().flat_map(|g| &g.models) {
            resolve_model(m)?;
        }
        if let Some(b) = self.grids.iter().flat_map(|g| &g.batch).find(|&&b| b == 0 || b > MAX_BATCH) {
            bail!("`batch` holds {b}; give 1 to {MAX_BATCH} parallel requests");
        }
        if self.grids.iter().any(|g| g.batch.is_empty()) {
            bail!("`batch` is empty; list at least one");
        }
        for g in &self.grids {
            for &ctx in &g.ctx {
                match g.prompt_tokens.tokens(ctx, self.gen_tokens) {
                    Some(p) if p > 0 && p < ctx && self.gen_tokens > 0 => {}
                    Some(p) => bail!(
                        "ctx {ctx}: prompt {p} with gen_tokens {}: a cell needs at least one prompt token, one \
                         generated token, and a prompt shorter than the context",
                        self.gen_tokens
                    ),
                    None => bail!(
                        "`prompt_tokens` has no entry for ctx {}; add `\"{}\" = N`",
                        ctx,
                        format_tokens(ctx)
                    ),
                }
            }
        }
        if let Some(p) = &self.paper {
            if !(p.tolerance > 0.0 && p.tolerance < 1.0) {
                bail!("[paper] tolerance = {}: give a fraction, e.g. 0.2 for ±20%", p.tolerance);
            }
            for m in p.calibration_models.iter().chain(p.names.keys()) {
                if !self.models().contains(&m) {
                    bail!("[paper]: model `{m}` is not in the experiment's models");
                }
            }
        }
        Ok(())
    }

    /// Every model of every grid by its label (see [`Grid::labels`]), first appearance first.
    #[must_use]
    pub fn models(&self) -> Vec<&String> {
        let mut v: Vec<&String> = Vec::new();
        for m in self.grids.iter().flat_map(|g| &g.labels) {
            if !v.contains(&m) {
                v.push(m);
            }
        }
        v
    }

    /// Every context of every grid, ascending.
    #[must_use]
    pub fn contexts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.grids.iter().flat_map(|g| g.ctx.iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Every budget of every grid, ascending.
    #[must_use]
    pub fn budgets(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.grids.iter().flat_map(|g| g.budgets.iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Every cell, grid by grid, in a stable order: model, ctx, budget, ubatch, planner.
    #[must_use]
    pub fn cells(&self) -> Vec<Cell> {
        let mut v = Vec::new();
        for g in &self.grids {
            for (m, label) in g.models.iter().zip(&g.labels) {
                for &ctx in &g.ctx {
                    for &budget_bytes in &g.budgets {
                        for (&batch, &ubatch) in
                            g.batch.iter().flat_map(|b| g.ubatch.iter().map(move |u| (b, u)))
                        {
                            let planners = g.planners.as_ref().unwrap_or(&self.planners);
                            for (p, &depth) in
                                planners.iter().flat_map(|p| g.depths.iter().map(move |d| (p, d)))
                            {
                                let ngl_layers = (p == "ngl")
                                    .then(|| {
                                        self.ngl_layers.get(&(m.clone(), ctx, budget_bytes, ubatch, batch))
                                    })
                                    .flatten()
                                    .copied();
                                let prompt_tokens = g.prompt_tokens.tokens(ctx, self.gen_tokens).unwrap_or(0);
                                v.push(Cell {
                                    model: label.clone(),
                                    ctx,
                                    prompt_tokens,
                                    gen_tokens: self.gen_tokens.min(ctx.saturating_sub(prompt_tokens)),
                                    ubatch,
                                    batch,
                                    kv_unified: self.kv_unified,
                                    budget_bytes,
                                    planner: p.clone(),
                                    depth,
                                    ngl_layers,
                                    budget_excludes_runtime: self.budget_excludes_runtime,
                                    ngl_flash_attn: self.ngl_flash_attn,
                                    requests: self.requests,
                                });
                            }
                        }
                    }
                }
            }
        }
        v
    }

    /// The specs of every model (in its grid's `weights` format, if it names one), by the label cells use.
    pub fn specs(&self) -> anyhow::Result<BTreeMap<String, ModelSpec>> {
        let mut specs = BTreeMap::new();
        for g in &self.grids {
            for (m, label) in g.models.iter().zip(&g.labels) {
                if !specs.contains_key(label) {
                    let spec = resolve_model(m)?;
                    let spec = match g.weights {
                        Some(d) => spec.with_uniform_weights(d),
                        None => spec,
                    };
                    specs.insert(label.clone(), spec);
                }
            }
        }
        Ok(specs)
    }
}

/// A `weights` value: a format name.
fn parse_weights(w: &str) -> anyhow::Result<DType> {
    w.parse::<DType>().map_err(|e| anyhow::anyhow!("{e}"))
}

impl PromptTokens {
    /// Prompt tokens at context `ctx` (`None`: a table without that context).
    #[must_use]
    pub fn tokens(&self, ctx: u64, gen_tokens: u64) -> Option<u64> {
        match self {
            PromptTokens::FillContext => Some(ctx.saturating_sub(gen_tokens)),
            PromptTokens::Fixed(n) => Some(*n),
            PromptTokens::ByCtx(m) => m.get(&ctx).copied(),
        }
    }
}

fn prompt_tokens(f: Option<PromptTokensFile>) -> anyhow::Result<PromptTokens> {
    Ok(match f {
        None => PromptTokens::FillContext,
        Some(PromptTokensFile::Fixed(n)) => PromptTokens::Fixed(n),
        Some(PromptTokensFile::ByCtx(m)) => PromptTokens::ByCtx(
            m.into_iter().map(|(ctx, n)| Ok((parse_tokens(&ctx)?, n))).collect::<anyhow::Result<_>>()?,
        ),
    })
}

/// One run of the baseline CSV (only the columns the replay needs).
#[derive(Debug, Deserialize)]
struct BaselineRun {
    #[serde(rename = "Model")]
    model: String,
    #[serde(rename = "Context")]
    ctx: u64,
    #[serde(rename = "MVA")]
    mva: u64,
    #[serde(rename = "NGL")]
    ngl: u32,
    #[serde(rename = "Ubatch")]
    ubatch: u64,
}

/// The replayed `-ngl N` of every (model, ctx, budget, ubatch) of the grids (see the module docs).
fn replay_ngl(n: &NglFile, grids: &[Grid]) -> anyhow::Result<BTreeMap<NglKey, u32>> {
    let file = n.csv.display();
    let mut reader = csv::Reader::from_path(&n.csv).with_context(|| format!("[ngl] csv: reading {file}"))?;
    let mut runs: BTreeMap<(String, u64, u64, u64), u32> = BTreeMap::new();
    for (i, row) in reader.deserialize::<BaselineRun>().enumerate() {
        let r = row.with_context(|| format!("{file}: row {}", i + 2))?;
        runs.entry((r.model, r.ctx, r.mva, r.ubatch)).or_insert(r.ngl);
    }
    let mut out = BTreeMap::new();
    for g in grids {
        for m in &g.models {
            let name = n.names.get(m).with_context(|| format!("[ngl] names: no entry for model `{m}`"))?;
            let fallback =
                *n.fallback.get(m).with_context(|| format!("[ngl] fallback: no entry for model `{m}`"))?;
            for &ctx in &g.ctx {
                for &budget in &g.budgets {
                    if !budget.is_multiple_of(pipeshard_core::GIB) {
                        bail!(
                            "[ngl]: budget {} is not whole GiB; the paper's runs are keyed by GB",
                            format_bytes(budget)
                        );
                    }
                    let mva = budget / pipeshard_core::GIB * 1000;
                    for (&ub, &batch) in g.ubatch.iter().flat_map(|u| g.batch.iter().map(move |b| (u, b))) {
                        let lookup_ctx = if n.ctx_is_total == Some(true) { ctx * batch } else { ctx };
                        let layers =
                            runs.get(&(name.clone(), lookup_ctx, mva, ub)).copied().unwrap_or(fallback);
                        out.insert((m.clone(), ctx, budget, ub, batch), layers);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// A model, optionally truncated to its first N layers with `@NL`: a catalog name (`nemo-8b`,
/// `qwen3-30b-a3b@2L`), a GGUF file (`models/q.gguf`, any part of a split file; every tensor's quant type and
/// bytes as stored), an HF checkpoint folder (config.json + safetensors: every tensor's dtype and bytes), or a
/// `config.json` (bf16 matrices). Models from files are named by the path as given, so a saved plan's `model`
/// resolves again.
pub fn resolve_model(name: &str) -> anyhow::Result<ModelSpec> {
    let (base, layers) = match name.rsplit_once('@') {
        Some((base, l)) => {
            let n: u32 = l
                .strip_suffix(['L', 'l'])
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("model `{name}`: write a truncation as `@NL`, e.g. `{base}@2L`"))?;
            (base, Some(n))
        }
        None => (name, None),
    };
    let path = Path::new(base);
    let spec = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        gguf::read_header(path)?.model_spec(base)?
    } else if path.is_dir() {
        Checkpoint::open(path)?.model_spec(base)?
    } else if path.extension().is_some_and(|e| e == "json") {
        load_hf_config(path, base, WeightFormat::uniform(DType::Bf16))?
    } else {
        catalog::get(base).with_context(|| format!("model `{base}`"))?
    };
    match layers {
        Some(n) => spec.truncated(n).with_context(|| format!("model `{name}`")),
        None => Ok(spec),
    }
}

/// The model a saved plan was made for: its `model` resolved and stored in the formats the plan records (a
/// plan's unit bytes follow from them: a plan made with `--weights bf16` for a catalog model whose paper
/// formats are q4_0 had been simulated again in q4_0).
pub fn plan_model(plan: &pipeshard_core::plan::Plan) -> anyhow::Result<ModelSpec> {
    let spec = resolve_model(&plan.model)?;
    Ok(match &plan.weights {
        Some(recorded) if *recorded != spec.weights => spec.with_weights(recorded.clone()),
        _ => spec,
    })
}

/// One point of a grid: a workload, a budget and a planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    pub model: String,
    pub ctx: u64,
    pub prompt_tokens: u64,
    pub gen_tokens: u64,
    pub ubatch: u64,
    pub batch: u64,
    /// One KV cache for all sequences (for the planners that take the workload's choice).
    pub kv_unified: bool,
    /// The budget as the experiment states it (see `budget_excludes_runtime`).
    pub budget_bytes: u64,
    pub planner: String,
    /// Ring depth forced on the plan (`None`: the planner's own).
    pub depth: Option<u32>,
    /// `ngl` only: replay this `-ngl N`.
    pub ngl_layers: Option<u32>,
    /// `budget_bytes` leaves out the runtime overhead (the paper's `-mva`).
    pub budget_excludes_runtime: bool,
    /// `ngl` only: plan with flash attention on.
    pub ngl_flash_attn: bool,
    /// Distinct requests, or copies of one token sequence.
    pub requests: Requests,
}

impl Cell {
    /// The budget the planner gets: a replayed `-ngl N` ran on the whole card (`gpu_vram_bytes`); a paper
    /// `-mva` budget gets the runtime overhead on top.
    #[must_use]
    pub fn planner_budget_bytes(&self, gpu_vram_bytes: u64, runtime_overhead_bytes: u64) -> u64 {
        if self.ngl_layers.is_some() {
            gpu_vram_bytes
        } else if self.budget_excludes_runtime {
            self.budget_bytes + runtime_overhead_bytes
        } else {
            self.budget_bytes
        }
    }

    /// The workload of the cell (f16 KV, flash attention).
    #[must_use]
    pub fn workload(&self) -> Workload {
        Workload {
            requests: self.requests,
            ..Workload::single(self.prompt_tokens, self.ctx, self.gen_tokens, self.ubatch)
                .batched(self.batch, self.kv_unified)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::inventory::Inventory;

    /// A saved plan is simulated in the formats it was made for, not in the catalog's (qwen3-30b-a3b's are
    /// the paper's Q4_0 mix): a bf16 plan read back resolves to bf16 units of the plan's bytes; one saved before the formats
    /// were recorded resolves to the model's own.
    #[test]
    fn a_saved_plan_resolves_to_the_formats_it_was_made_for() {
        use pipeshard_core::cost::TableCostModel;
        let spec = resolve_model("qwen3-30b-a3b@2L").unwrap().with_uniform_weights(DType::Bf16);
        let cost = TableCostModel::new(&crate::args::load_profile("cli3").unwrap());
        let plan = pipeshard_planner::by_name("pshard")
            .unwrap()
            .plan(&spec, &Workload::single(1000, 2048, 16, 1024), &cost, 8 << 30)
            .unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        let read = pipeshard_core::plan::Plan::from_json("plan.json", &json).unwrap();
        let resolved = plan_model(&read).unwrap();
        assert_eq!(resolved.weights, spec.weights);
        assert_eq!(Inventory::new(&resolved).total_bytes(), Inventory::new(&spec).total_bytes());
        let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
        old.as_object_mut().unwrap().remove("weights");
        let old = pipeshard_core::plan::Plan::from_json("old.json", &old.to_string()).unwrap();
        let own = resolve_model("qwen3-30b-a3b@2L").unwrap().weights;
        assert_ne!(own, spec.weights);
        assert_eq!(plan_model(&old).unwrap().weights, own);
    }

    #[test]
    fn experiment_files_parse_and_expand() {
        let f: ExperimentFile = toml::from_str(
            r#"
            models = ["nemo-4b", "qwen3-30b-a3b@2L"]
            ctx = ["1K", 4096]
            budgets = ["2G", "1536M"]
            planners = ["ngl", "ilp"]
            "#,
        )
        .unwrap();
        let e = Experiment::from_file(f, "demo").unwrap();
        assert_eq!(e.name, "demo");
        assert_eq!(e.grids[0].ctx, vec![1024, 4096]);
        assert_eq!(e.grids[0].budgets, vec![2 << 30, 1536 << 20]);
        assert_eq!(e.budgets(), vec![1536 << 20, 2 << 30]);
        let cells = e.cells();
        assert_eq!(cells.len(), 2 * 2 * 2 * 2);
        assert_eq!(cells[0].prompt_tokens, 1024 - DEFAULT_GEN_TOKENS);
        assert_eq!((cells[1].planner.as_str(), cells[2].budget_bytes), ("ilp", 1536 << 20));
        assert_eq!(resolve_model("qwen3-30b-a3b@2L").unwrap().text.n_layers, 2);
        assert!(resolve_model("qwen3-30b-a3b@2").unwrap_err().to_string().contains("@NL"));
        let bad: ExperimentFile = toml::from_str(
            "models = [\"nemo-4b\"]\nctx = [1024]\nbudgets = [\"2G\"]\nplanners = [\"magic\"]",
        )
        .unwrap();
        assert!(Experiment::from_file(bad, "x").unwrap_err().to_string().contains("magic"));
    }

    /// `runs_per_cell` defaults to one run and refuses none.
    #[test]
    fn runs_per_cell_is_at_least_one() {
        let file = |extra: &str| -> ExperimentFile {
            toml::from_str(&format!("models = [\"nemo-4b\"]\nctx = [1024]\nbudgets = [\"2G\"]\n{extra}"))
                .unwrap()
        };
        assert_eq!(Experiment::from_file(file(""), "x").unwrap().runs_per_cell, 1);
        assert_eq!(Experiment::from_file(file("runs_per_cell = 3"), "x").unwrap().runs_per_cell, 3);
        let zero = Experiment::from_file(file("runs_per_cell = 0"), "x").unwrap_err().to_string();
        assert!(zero.contains("`runs_per_cell` is 0"), "{zero}");
    }

    #[test]
    fn batches_are_a_number_or_a_list_per_grid() {
        let f: ExperimentFile = toml::from_str(
            r#"
            models = ["nemo-4b@2L"]
            ctx = ["1K"]
            budgets = ["1G"]
            planners = ["ilp"]
            batch = 4
            kv_unified = true
            [[grid]]
            [[grid]]
            batch = [1, 16]
            "#,
        )
        .unwrap();
        let e = Experiment::from_file(f, "b").unwrap();
        let cells = e.cells();
        assert_eq!(cells.iter().map(|c| c.batch).collect::<Vec<_>>(), [4, 1, 16]);
        assert!(cells.iter().all(|c| c.kv_unified && c.workload().kv_unified));
        assert_eq!(cells[2].workload().batch, 16);
        for bad in ["batch = 0", "batch = [2, 100000]", "batch = []"] {
            let f: ExperimentFile =
                toml::from_str(&format!("models = [\"nemo-4b\"]\nctx = [1024]\nbudgets = [\"2G\"]\n{bad}"))
                    .unwrap();
            let err = Experiment::from_file(f, "x").unwrap_err().to_string();
            assert!(err.contains("`batch`"), "{bad}: {err}");
        }
    }

    #[test]
    fn grids_fall_back_to_the_top_level() {
        let f: ExperimentFile = toml::from_str(
            r#"
            ctx = ["1K"]
            planners = ["ilp"]
            [[grid]]
            models = ["nemo-4b@2L"]
            budgets = ["512M"]
            [[grid]]
            models = ["nemo-8b"]
            ctx = ["4K", "16K"]
            budgets = ["8G"]
            ubatch = [512]
            "#,
        )
        .unwrap();
        let e = Experiment::from_file(f, "two").unwrap();
        let cells = e.cells();
        assert_eq!(cells.len(), 1 + 2);
        assert_eq!((cells[0].ctx, cells[0].budget_bytes, cells[0].ubatch), (1024, 512 << 20, DEFAULT_UBATCH));
        assert_eq!((cells[2].model.as_str(), cells[2].ctx, cells[2].ubatch), ("nemo-8b", 16_384, 512));
        assert_eq!(e.contexts(), vec![1024, 4096, 16_384]);
        assert_eq!(e.models().len(), 2);
        let f: ExperimentFile = toml::from_str(
            r#"
            ctx = ["1K"]
            budgets = ["2G"]
            planners = ["ngl", "ilp"]
            [[grid]]
            models = ["nemo-4b@2L"]
            [[grid]]
            models = ["nemo-8b@2L"]
            planners = ["ilp"]
            "#,
        )
        .unwrap();
        let planners: Vec<String> =
            Experiment::from_file(f, "x").unwrap().cells().into_iter().map(|c| c.planner).collect();
        assert_eq!(planners, ["ngl", "ilp", "ilp"], "a grid's own planners replace the experiment's");
        let outside: ExperimentFile = toml::from_str(
            "ctx = [1024]\nbudgets = [\"2G\"]\nplanners = [\"ilp\"]\n[[grid]]\nmodels = [\"nemo-4b\"]\nplanners = [\"ngl\"]",
        )
        .unwrap();
        let e = Experiment::from_file(outside, "x").unwrap_err().to_string();
        assert!(e.contains("[[grid]] 1: planner `ngl`"), "{e}");
        let missing: ExperimentFile =
            toml::from_str("ctx = [1024]\n[[grid]]\nmodels = [\"nemo-4b\"]").unwrap();
        assert!(
            Experiment::from_file(missing, "x").unwrap_err().to_string().contains("[[grid]] 1: `budgets`")
        );
    }

    /// A GGUF file (whole or split) is a model wherever a catalog name is: its inventory has each tensor's
    /// quant type and exact bytes, and an experiment's plans and simulations count those bytes.
    #[test]
    fn gguf_files_are_models_with_their_exact_bytes() {
        use pipeshard_core::cost::TableCostModel;
        use pipeshard_core::inventory::Inventory;

        use crate::testfiles::{temp_dir, tensors, write_gguf, write_split_gguf};

        let dir = temp_dir("gguf");
        let path = write_gguf(&dir);
        let name = path.display().to_string();
        let spec = resolve_model(&name).unwrap();
        let inv = Inventory::new(&spec);
        let file_bytes: u64 = tensors().iter().map(|t| t.3).sum();
        assert_eq!(inv.total_bytes(), file_bytes);
        let down = inv.tensors.iter().find(|t| t.name == "blk.1.ffn_down.weight").unwrap();
        assert_eq!((down.dtype, down.bytes), (DType::Q6K, 512 / 256 * 210 * 256));
        // The quantisation mix is not any single format: the per-class formats alone would miss it.
        let by_class = Inventory::new(&ModelSpec { stored: Vec::new(), ..spec.clone() }).total_bytes();
        assert_ne!(by_class, file_bytes);

        let split = resolve_model(&write_split_gguf(&dir).display().to_string()).unwrap();
        assert_eq!(Inventory::new(&split).tensors, inv.tensors, "split parts merge to the same model");

        let one = resolve_model(&format!("{name}@1L")).unwrap();
        let layer1: u64 = inv.units.iter().filter(|u| u.id.layer() == Some(1)).map(|u| u.weight_bytes).sum();
        assert_eq!(Inventory::new(&one).total_bytes(), file_bytes - layer1);

        let toml =
            format!("models = [{name:?}]\nctx = [\"4K\"]\nbudgets = [\"2G\", \"64M\"]\nplanners = [\"ngl\"]");
        let e = Experiment::from_file(toml::from_str(&toml).unwrap(), "gguf").unwrap();
        let cost = TableCostModel::new(&crate::args::load_profile("cli3").unwrap());
        let results = crate::sweep::run_cells(&e.cells(), &e.specs().unwrap(), &cost, false);
        let run = results[0].run.as_ref().expect("2 GiB holds the whole model");
        // The planner's VRAM line and the simulator's peak count the file's bytes of the pinned units.
        let [prefill, decode] = run.weights_by_placement;
        assert_eq!(decode.iter().sum::<u64>(), file_bytes);
        assert_eq!(run.plan.decode.vram.pinned_weights_bytes, decode[0]);
        assert_eq!(run.plan.prefill.vram.pinned_weights_bytes, prefill[0]);
        assert_eq!(run.sim.metrics.vram_peak.pinned_weights_bytes, prefill[0].max(decode[0]));
        assert!(decode[0] > file_bytes / 2, "ngl offloads every layer at 2 GiB: {decode:?}");
        // Below the runtime overhead nothing fits, and the error names the smallest budget.
        assert!(results[1].run.is_none() && results[1].reason.contains("GiB"), "{}", results[1].reason);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn broken_model_files_say_what_to_fix() {
        use crate::testfiles::{temp_dir, write_gguf, write_split_gguf};

        let dir = temp_dir("bad-gguf");
        let path = write_gguf(&dir);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let e = format!("{:#}", resolve_model(&path.display().to_string()).unwrap_err());
        assert!(e.contains("tiny.gguf") && e.contains("re-download"), "{e}");
        let second = write_split_gguf(&dir);
        std::fs::remove_file(dir.join("tiny-00001-of-00002.gguf")).unwrap();
        let e = format!("{:#}", resolve_model(&second.display().to_string()).unwrap_err());
        assert!(e.contains("tiny-00001-of-00002.gguf"), "{e}");
        let e = format!("{:#}", resolve_model(&dir.display().to_string()).unwrap_err());
        assert!(e.contains("config.json"), "a folder without a checkpoint: {e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn weights_and_forced_depths_expand_into_cells() {
        let f: ExperimentFile = toml::from_str(
            r#"
            models = ["nemo-8b@2L"]
            ctx = ["4K"]
            budgets = ["2G"]
            planners = ["pshard", "ilp"]
            weights = "bf16"
            [[grid]]
            depths = [1, 3]
            [[grid]]
            ctx = ["1K"]
            "#,
        )
        .unwrap();
        let e = Experiment::from_file(f, "v").unwrap();
        let cells = e.cells();
        let depths: Vec<(&str, Option<u32>)> = cells.iter().map(|c| (c.planner.as_str(), c.depth)).collect();
        assert_eq!(
            depths,
            vec![
                ("pshard", Some(1)),
                ("pshard", Some(3)),
                ("ilp", Some(1)),
                ("ilp", Some(3)),
                ("pshard", None),
                ("ilp", None)
            ]
        );
        let spec = &e.specs().unwrap()["nemo-8b@2L"];
        assert_eq!(spec.text.n_layers, 2);
        assert!(Inventory::new(spec).tensors.iter().all(|t| t.dtype == DType::Bf16 || t.shape.len() == 1));
        let parse = |extra: &str| {
            let f: ExperimentFile =
                toml::from_str(&format!("models = [\"nemo-4b\"]\nctx = [1024]\nbudgets = [\"2G\"]\n{extra}"))
                    .unwrap();
            Experiment::from_file(f, "x").map(|_| ()).unwrap_err().to_string()
        };
        assert!(parse("depths = [0, 2]").contains("`depths` holds 0"));
        assert!(parse("weights = \"bf17\"").contains("`weights`"));
    }

    #[test]
    fn a_grid_may_store_its_models_in_another_format() {
        let f: ExperimentFile = toml::from_str(
            r#"
            models = ["qwen3-30b-a3b@2L"]
            ctx = ["1K"]
            budgets = ["2G"]
            planners = ["pshard"]
            weights = "bf16"
            [[grid]]
            [[grid]]
            weights = "q4_0"
            budgets = ["2G", "4G"]
            [[grid]]
            weights = "bf16"
            "#,
        )
        .unwrap();
        let e = Experiment::from_file(f, "q").unwrap();
        let cells = e.cells();
        let labels: Vec<&str> = cells.iter().map(|c| c.model.as_str()).collect();
        assert_eq!(
            labels,
            ["qwen3-30b-a3b@2L", "qwen3-30b-a3b@2L:q4_0", "qwen3-30b-a3b@2L:q4_0", "qwen3-30b-a3b@2L"]
        );
        assert_eq!(e.models(), ["qwen3-30b-a3b@2L", "qwen3-30b-a3b@2L:q4_0"]);
        let specs = e.specs().unwrap();
        let bytes = |label: &str, dtype: DType| {
            let inv = Inventory::new(&specs[label]);
            let matrices: Vec<_> = inv.tensors.iter().filter(|t| t.shape.len() > 1).collect();
            assert!(matrices.iter().all(|t| t.dtype == dtype), "{label}: every matrix in {dtype:?}");
            matrices.iter().map(|t| t.bytes).sum::<u64>() as f64
        };
        // q4_0 stores 4.5 bits a weight against bf16's 16.
        let ratio = bytes("qwen3-30b-a3b@2L", DType::Bf16) / bytes("qwen3-30b-a3b@2L:q4_0", DType::Q4_0);
        assert!((ratio - 16.0 / 4.5).abs() < 0.01, "{ratio}");
        let f: ExperimentFile = toml::from_str(
            "models = [\"nemo-4b\"]\nctx = [1024]\nbudgets = [\"2G\"]\n[[grid]]\nweights = \"q4\"",
        )
        .unwrap();
        let err = format!("{:#}", Experiment::from_file(f, "x").unwrap_err());
        assert!(err.contains("[[grid]] 1: `weights`") && err.contains("q4_0"), "{err}");
    }

    #[test]
    fn committed_experiments_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                // table8.toml has the schema of `repro table8` (crates/cli/src/table8.rs).
                if path.file_stem().is_some_and(|s| s == "table8") {
                    crate::table8::Table8File::load(&path).unwrap();
                } else {
                    Experiment::load(&path).unwrap();
                }
                n += 1;
            }
        }
        assert!(n >= 2, "experiments/ holds at least ci-planners and figure2");
    }

    /// Replays the `experiment_toml` fuzz corpus and crash regressions (`fuzz/`) through the function the fuzz
    /// target calls: no committed input may panic.
    #[test]
    fn fuzz_corpus_never_panics() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let csv = root.join("experiments/paper/baseline_ngl_5090.csv");
        let (mut files, mut accepted) = (0, 0);
        for dir in ["fuzz/corpus/experiment_toml", "fuzz/regressions/experiment_toml"] {
            let Ok(rd) = std::fs::read_dir(root.join(dir)) else { continue };
            for entry in rd {
                let path = entry.unwrap().path();
                let bytes = std::fs::read(&path).unwrap();
                let r = std::panic::catch_unwind(|| Experiment::from_untrusted(&bytes, &csv).is_ok());
                assert!(r.is_ok(), "{}: the experiment reader panicked", path.display());
                files += 1;
                accepted += usize::from(r.unwrap());
            }
        }
        assert!(files >= 4, "the experiment_toml corpus has {files} files");
        assert!(accepted >= 1, "no experiment_toml corpus file is a valid experiment");
    }
}
