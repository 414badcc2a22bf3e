//! `pipeshard compare`: every planner on every cell of an experiment, scored in the simulator.
//!
//! The score is the simulated end-to-end latency (TTFT + the decode steps, plan switch included), the
//! objective `ilp` minimises by default. A planner's **regret** on a cell is its E2EL over the reference's,
//! minus one: the reference is the exhaustive search where it found a plan (small truncated models), else the
//! best planner on that cell. The command fails (exit status 1) if, on any cell, `ilp` is more than
//! [`MAX_ILP_GAP`] worse than another non-oracle planner, more than [`MAX_ILP_REGRET`] worse than the
//! exhaustive search, or finds no plan where another planner does. CI runs it on
//! `experiments/ci-planners.toml` as the test `ilp_passes_the_ci_planner_comparison` (`cargo test`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use pipeshard_core::cost::TableCostModel;
use serde::Serialize;

use crate::args::{format_bytes, format_tokens, load_profile};
use crate::experiment::{Cell, Experiment};
use crate::output::{Format, render};
use crate::sweep::{CellResult, Status, run_cells};

/// Largest allowed E2EL gap of `ilp` behind any other non-oracle planner on one cell.
pub const MAX_ILP_GAP: f64 = 0.01;
/// Largest allowed E2EL regret of `ilp` against the exhaustive search on one cell.
pub const MAX_ILP_REGRET: f64 = 0.02;
/// The planner under test and the oracle.
const ILP: &str = "ilp";
const ORACLE: &str = "exhaustive";

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The cells to compare planners on.
    #[arg(long, default_value = "experiments/ci-planners.toml")]
    experiment: PathBuf,
    /// Also write one row per cell and planner (E2EL, regret) to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// `table`: the comparison table and the verdict; other formats print one row per cell and planner on
    /// stdout and the rest on stderr.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

/// The planners' results on one cell (a cell without its planner).
#[derive(Debug)]
struct Group<'a> {
    cell: &'a Cell,
    /// planner → its result.
    by_planner: BTreeMap<&'a str, &'a CellResult>,
}

impl Group<'_> {
    fn e2el(&self, planner: &str) -> Option<u64> {
        self.by_planner.get(planner)?.run.as_deref().map(|r| r.sim.metrics.e2el_ns)
    }

    /// The reference E2EL and who set it: the oracle if it found a plan, else the best planner.
    fn reference(&self) -> Option<(u64, &str)> {
        if let Some(e) = self.e2el(ORACLE) {
            return Some((e, ORACLE));
        }
        self.by_planner.keys().filter_map(|p| self.e2el(p).map(|e| (e, *p))).min()
    }
}

/// One row per cell and planner.
#[derive(Debug, Serialize)]
struct Row<'a> {
    model: &'a str,
    ctx: u64,
    ubatch: u64,
    vram_budget_bytes: u64,
    planner: &'a str,
    status: Status,
    e2el_ms: Option<f64>,
    reference: &'a str,
    regret: Option<f64>,
}

/// Verdicts on `ilp`: a line per cell and check it fails.
fn violations(groups: &[Group<'_>]) -> Vec<String> {
    let mut v = Vec::new();
    for g in groups {
        let name = cell_name(g.cell);
        let Some(ilp) = g.by_planner.get(ILP) else { continue };
        // The best other non-oracle planner that found a plan.
        let best = g
            .by_planner
            .keys()
            .filter(|p| **p != ILP && **p != ORACLE)
            .filter_map(|p| g.e2el(p).map(|e| (e, *p)))
            .min();
        match (g.e2el(ILP), best) {
            (None, Some(_)) => {
                let others: Vec<&str> =
                    g.by_planner.keys().filter(|q| **q != ILP && g.e2el(q).is_some()).copied().collect();
                v.push(format!("{name}: ilp found no plan ({}) but {} did", ilp.reason, others.join(", ")));
            }
            (Some(e), Some((other, p))) if e as f64 > other as f64 * (1.0 + MAX_ILP_GAP) => v.push(format!(
                "{name}: ilp E2EL {:.1} ms is {:+.2}% behind {p} ({:.1} ms)",
                e as f64 / 1e6,
                (e as f64 / other as f64 - 1.0) * 100.0,
                other as f64 / 1e6
            )),
            _ => {}
        }
        if let (Some(e), Some(o)) = (g.e2el(ILP), g.e2el(ORACLE))
            && e as f64 > o as f64 * (1.0 + MAX_ILP_REGRET)
        {
            v.push(format!(
                "{name}: ilp regret against the exhaustive search is {:+.2}% (limit {:.0}%)",
                (e as f64 / o as f64 - 1.0) * 100.0,
                MAX_ILP_REGRET * 100.0
            ));
        }
    }
    v
}

fn cell_name(c: &Cell) -> String {
    format!(
        "{} ctx {} ub {} budget {}",
        c.model,
        format_tokens(c.ctx),
        c.ubatch,
        format_bytes(c.budget_bytes)
    )
}

fn group(results: &[CellResult]) -> Vec<Group<'_>> {
    let mut groups: Vec<Group<'_>> = Vec::new();
    for r in results {
        let c = &r.cell;
        let same = |g: &Group<'_>| {
            let k = g.cell;
            (&k.model, k.ctx, k.ubatch, k.budget_bytes, k.batch, k.prompt_tokens, k.gen_tokens)
                == (&c.model, c.ctx, c.ubatch, c.budget_bytes, c.batch, c.prompt_tokens, c.gen_tokens)
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => {
                g.by_planner.insert(&c.planner, r);
            }
            None => groups.push(Group { cell: c, by_planner: BTreeMap::from([(c.planner.as_str(), r)]) }),
        }
    }
    groups
}

/// The comparison table: per cell, each planner's E2EL and regret, and the reference.
fn table(planners: &[String], groups: &[Group<'_>]) -> String {
    let mut s = String::new();
    let _ = write!(s, "{:<44}", "cell (E2EL ms, regret vs ref)");
    for p in planners {
        let _ = write!(s, " {p:>18}");
    }
    let _ = writeln!(s, "  ref");
    let mut worst: BTreeMap<&str, f64> = BTreeMap::new();
    for g in groups {
        let _ = write!(s, "{:<44}", cell_name(g.cell));
        let reference = g.reference();
        for p in planners {
            let text = match (g.by_planner.get(p.as_str()), reference) {
                (Some(r), Some((best, _))) if r.run.is_some() => {
                    let e = g.e2el(p).expect("a run has an E2EL");
                    let regret = e as f64 / best as f64 - 1.0;
                    let w = worst.entry(p.as_str()).or_insert(0.0);
                    *w = w.max(regret);
                    format!("{:.1} ({:+.1}%)", e as f64 / 1e6, regret * 100.0)
                }
                (Some(r), _) => match r.status {
                    Status::Infeasible => "infeasible".into(),
                    Status::Unsupported => "n/a".into(),
                    _ => "error".into(),
                },
                (None, _) => "-".into(),
            };
            let _ = write!(s, " {text:>18}");
        }
        let _ = writeln!(s, "  {}", reference.map_or("-", |r| r.1));
    }
    let _ = write!(s, "{:<44}", "worst regret");
    for p in planners {
        let text = worst.get(p.as_str()).map_or_else(|| "-".into(), |w| format!("{:+.1}%", w * 100.0));
        let _ = write!(s, " {text:>18}");
    }
    s.push('\n');
    s
}

/// Every cell's planners as rows, in the table's order.
fn rows<'a>(groups: &'a [Group<'a>]) -> Vec<Row<'a>> {
    let mut rows = Vec::new();
    for g in groups {
        let reference = g.reference();
        for (p, r) in &g.by_planner {
            let e2el = g.e2el(p);
            rows.push(Row {
                model: &g.cell.model,
                ctx: g.cell.ctx,
                ubatch: g.cell.ubatch,
                vram_budget_bytes: g.cell.budget_bytes,
                planner: p,
                status: r.status,
                e2el_ms: e2el.map(|x| x as f64 / 1e6),
                reference: reference.map_or("", |x| x.1),
                regret: e2el.zip(reference).map(|(x, (b, _))| x as f64 / b as f64 - 1.0),
            });
        }
    }
    rows
}

pub fn run(a: &CompareArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let e = Experiment::load(&a.experiment)?;
    if !e.planners.iter().any(|p| p == ILP) {
        bail!("{}: compare checks `ilp`; add it to `planners`", a.experiment.display());
    }
    let profile = load_profile(&e.profile)?;
    let cost = TableCostModel::new(&profile);
    let specs = e.specs()?;
    let cells = e.cells();
    let results = run_cells(&cells, &specs, &cost, std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let groups = group(&results);
    let report = |line: String| {
        if a.format == Format::Table {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    };
    report(format!(
        "compare {}: {} cells × {} planners on {} in {:.1} s; score: simulated E2EL (TTFT + {} decode steps)",
        e.name,
        groups.len(),
        e.planners.len(),
        e.profile,
        t0.elapsed().as_secs_f64(),
        e.gen_tokens
    ));
    let rows = rows(&groups);
    print!("{}", render(a.format, "compare", &rows, || table(&e.planners, &groups))?);
    report(crate::sweep::planning_times(&e.planners, &results));
    if let Some(path) = &a.csv {
        std::fs::write(path, crate::output::csv(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
        report(format!("wrote {}", path.display()));
    }
    let v = violations(&groups);
    if v.is_empty() {
        report(format!(
            "ilp: within {:.0}% of every other planner and {:.0}% of the exhaustive search on every cell",
            MAX_ILP_GAP * 100.0,
            MAX_ILP_REGRET * 100.0
        ));
        Ok(())
    } else {
        for line in &v {
            report(format!("FAIL {line}"));
        }
        bail!("ilp failed {} check(s) of {}", v.len(), a.experiment.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::CellResult;

    fn result(planner: &str, status: Status) -> CellResult {
        CellResult {
            cell: Cell {
                model: "nemo-4b@1L".into(),
                ctx: 1024,
                prompt_tokens: 924,
                gen_tokens: 100,
                ubatch: 512,
                batch: 1,
                kv_unified: false,
                budget_bytes: 1 << 30,
                planner: planner.into(),
                depth: None,
                ngl_layers: None,
                budget_excludes_runtime: false,
                ngl_flash_attn: false,
                requests: pipeshard_core::workload::Requests::Distinct,
            },
            status,
            reason: "needs at least 2 GiB".into(),
            run: None,
            plan_ms: 1.0,
            sim_ms: 0.0,
        }
    }

    /// The planner comparison CI runs (issue #4): `ilp` passes every check on `experiments/ci-planners.toml`.
    #[test]
    fn ilp_passes_the_ci_planner_comparison() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments/ci-planners.toml");
        let e = Experiment::load(&path).unwrap();
        let cost = TableCostModel::new(&load_profile(&e.profile).unwrap());
        let results = run_cells(&e.cells(), &e.specs().unwrap(), &cost, false);
        let groups = group(&results);
        let judged = groups.iter().filter(|g| g.e2el(ILP).is_some() && g.e2el(ORACLE).is_some()).count();
        assert!(
            judged >= 8,
            "only {judged} cells have both an ilp and an exhaustive plan: the check tests little"
        );
        let v = violations(&groups);
        assert!(v.is_empty(), "{}\n{}", v.join("\n"), table(&e.planners, &groups));
    }

    #[test]
    fn no_plan_anywhere_is_no_violation() {
        let rs = vec![result("ngl", Status::Infeasible), result("ilp", Status::Infeasible)];
        let groups = group(&rs);
        assert_eq!(groups.len(), 1);
        assert!(violations(&groups).is_empty());
        let t = table(&["ngl".into(), "ilp".into()], &groups);
        assert!(t.contains("infeasible") && t.contains("nemo-4b@1L ctx 1K ub 512 budget 1G"), "{t}");
    }
}
