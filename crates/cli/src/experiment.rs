//! Experiment definitions (`experiments/NAME.toml`) and the grid of cells they expand to.
//!
//! An experiment is a cartesian product: models × contexts × budgets × ubatches × planners, on one profile,
//! with one generation length and batch — or the union of several such grids (`[[grid]]` sections, each with
//! its own models, contexts, budgets and ubatches; missing fields fall back to the top level), so that one
//! file can hold truncated models at budgets of MiB and full models at budgets of GiB. A model is a catalog name
//! or a model file ([`resolve_model`]), optionally truncated to its first N layers with `@NL`
//! (`qwen3-30b-a3b@2L`), which is how CI-sized grids stay small enough for the exhaustive planner. Prompt
//! length: `prompt_tokens` if given, else the context minus the generated tokens — the paper's prompts nearly
//! fill the context (DIGEST §5.3: 908 of 1024 … 64530 of 65536), so TPS is measured at almost
//! full KV.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use pipeshard_core::catalog;
use pipeshard_core::checkpoint::Checkpoint;
use pipeshard_core::dtype::DType;
use pipeshard_core::gguf;
use pipeshard_core::model::{ModelSpec, WeightFormat, load_hf_config};
use pipeshard_core::workload::Workload;
use serde::Deserialize;

use crate::args::{parse_bytes, parse_tokens};

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
    pub ctx: Option<Vec<Quantity>>,
    pub budgets: Option<Vec<Quantity>>,
    pub ubatch: Option<Vec<Quantity>>,
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
    /// Defaults to every planner.
    pub planners: Option<Vec<String>>,
    pub gen_tokens: Option<u64>,
    pub batch: Option<u64>,
    /// Fixed prompt length; defaults to `ctx − gen_tokens`.
    pub prompt_tokens: Option<u64>,
}

/// One validated grid: models × contexts × budgets × ubatches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    pub models: Vec<String>,
    pub ctx: Vec<u64>,
    pub budgets: Vec<u64>,
    pub ubatch: Vec<u64>,
}

/// A validated experiment.
#[derive(Debug, Clone, PartialEq)]
pub struct Experiment {
    pub name: String,
    pub description: String,
    pub profile: String,
    pub grids: Vec<Grid>,
    pub planners: Vec<String>,
    pub gen_tokens: u64,
    pub batch: u64,
    pub prompt_tokens: Option<u64>,
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
        let file: ExperimentFile =
            toml::from_str(&text).with_context(|| format!("{}: not a valid experiment", path.display()))?;
        let stem = path.file_stem().map_or_else(|| "experiment".into(), |s| s.to_string_lossy().into_owned());
        Experiment::from_file(file, &stem).with_context(|| format!("{}", path.display()))
    }

    /// Checks a parsed file; `stem` names it when it has no `name`.
    pub fn from_file(f: ExperimentFile, stem: &str) -> anyhow::Result<Experiment> {
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
            grids.push(Grid {
                models,
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
            });
        }
        let e = Experiment {
            name: f.name.unwrap_or_else(|| stem.to_string()),
            description: f.description,
            profile: f.profile.unwrap_or_else(|| DEFAULT_PROFILE.into()),
            grids,
            planners: f
                .planners
                .unwrap_or_else(|| pipeshard_planner::NAMES.iter().map(|s| (*s).into()).collect()),
            gen_tokens: f.gen_tokens.unwrap_or(DEFAULT_GEN_TOKENS),
            batch: f.batch.unwrap_or(1),
            prompt_tokens: f.prompt_tokens,
        };
        e.check()?;
        Ok(e)
    }

    fn check(&self) -> anyhow::Result<()> {
        if self.planners.is_empty() {
            bail!("`planners` is empty; list at least one");
        }
        if self.grids.iter().any(|g| g.ubatch.is_empty()) {
            bail!("`ubatch` is empty; list at least one");
        }
        if let Some(p) = self.planners.iter().find(|p| !pipeshard_planner::NAMES.contains(&p.as_str())) {
            bail!("unknown planner `{p}`; known: {}", pipeshard_planner::NAMES.join(", "));
        }
        for m in self.models() {
            resolve_model(m)?;
        }
        if self.batch == 0 {
            bail!("`batch` is 0; it must be at least 1");
        }
        Ok(())
    }

    /// Every model of every grid, first appearance first.
    #[must_use]
    pub fn models(&self) -> Vec<&String> {
        let mut v: Vec<&String> = Vec::new();
        for m in self.grids.iter().flat_map(|g| &g.models) {
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
            for m in &g.models {
                for &ctx in &g.ctx {
                    for &budget_bytes in &g.budgets {
                        for &ubatch in &g.ubatch {
                            for p in &self.planners {
                                v.push(Cell {
                                    model: m.clone(),
                                    ctx,
                                    prompt_tokens: self
                                        .prompt_tokens
                                        .unwrap_or(ctx.saturating_sub(self.gen_tokens)),
                                    gen_tokens: self.gen_tokens,
                                    ubatch,
                                    batch: self.batch,
                                    budget_bytes,
                                    planner: p.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
        v
    }

    /// The specs of every model, by the name the experiment uses.
    pub fn specs(&self) -> anyhow::Result<BTreeMap<String, ModelSpec>> {
        self.models().into_iter().map(|m| Ok((m.clone(), resolve_model(m)?))).collect()
    }
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

/// One point of a grid: a workload, a budget and a planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    pub model: String,
    pub ctx: u64,
    pub prompt_tokens: u64,
    pub gen_tokens: u64,
    pub ubatch: u64,
    pub batch: u64,
    pub budget_bytes: u64,
    pub planner: String,
}

impl Cell {
    /// The workload of the cell (f16 KV, flash attention).
    #[must_use]
    pub fn workload(&self) -> Workload {
        Workload {
            batch: self.batch,
            ..Workload::single(self.prompt_tokens, self.ctx, self.gen_tokens, self.ubatch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn committed_experiments_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Experiment::load(&path).unwrap();
                n += 1;
            }
        }
        assert!(n >= 2, "experiments/ holds at least ci-planners and figure2");
    }
}
