//! PNG plots of a sweep (plotters, bitmap backend): TPS and TTFT against the VRAM budget, one panel per
//! model × context, one line per planner. Where a sweep has several ubatches, each point is the best over them
//! (as the paper's Figure 2 does). Log scales on both axes: budgets double, and metrics span decades.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (`assets/DejaVuSans.ttf`, its licence beside it) via
//! plotters' `ab_glyph` feature, so the binary needs no fontconfig or freetype on the machine that runs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::args::format_tokens;
use crate::experiment::Experiment;
use crate::sweep::{CellResult, gib};

static FONT: Once = Once::new();

pub(crate) fn register() {
    FONT.call_once(|| {
        register_font("sans-serif", FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"))
            .unwrap_or_else(|_| panic!("the embedded DejaVu Sans is a valid font"));
    });
}

/// Line colours, one per planner in the experiment's order.
pub(crate) const COLOURS: [RGBColor; 6] = [
    RGBColor(120, 120, 120),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
];

/// A metric to plot.
#[derive(Debug, Clone, Copy)]
struct Metric {
    file: &'static str,
    title: &'static str,
    unit: &'static str,
    /// Value of a cell; higher-is-better metrics keep the maximum over ubatches.
    value: fn(&CellResult) -> Option<f64>,
    higher_is_better: bool,
}

const METRICS: [Metric; 2] = [
    Metric {
        file: "tps.png",
        title: "decode throughput (TPS) vs VRAM budget",
        unit: "tokens/s",
        value: |r| r.run.as_deref().map(|x| x.sim.metrics.tps),
        higher_is_better: true,
    },
    Metric {
        file: "ttft.png",
        title: "time to first token (TTFT) vs VRAM budget",
        unit: "TTFT (s)",
        value: |r| r.run.as_deref().map(|x| x.sim.metrics.ttft_ns as f64 / 1e9),
        higher_is_better: false,
    },
];

/// Writes `tps.png` and `ttft.png` into `dir`; returns their paths.
pub fn sweep_plots(e: &Experiment, results: &[CellResult], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    register();
    METRICS.iter().map(|m| plot(e, results, dir, *m)).collect()
}

fn plot(e: &Experiment, results: &[CellResult], dir: &Path, metric: Metric) -> anyhow::Result<PathBuf> {
    // (model, ctx, planner) → budget GiB → best value over ubatches.
    let mut series: BTreeMap<(&str, u64, &str), BTreeMap<u64, f64>> = BTreeMap::new();
    for r in results {
        let Some(v) = (metric.value)(r).filter(|v| *v > 0.0 && v.is_finite()) else { continue };
        let c = &r.cell;
        let slot =
            series.entry((&c.model, c.ctx, &c.planner)).or_default().entry(c.budget_bytes).or_insert(v);
        *slot = if metric.higher_is_better { slot.max(v) } else { slot.min(v) };
    }
    let values: Vec<f64> = series.values().flat_map(|s| s.values().copied()).collect();
    let (lo, hi) = values.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    let (lo, hi) = if values.is_empty() { (0.1, 10.0) } else { (lo / 1.5, hi * 1.5) };
    let budgets: Vec<f64> = e.budgets().iter().map(|&b| gib(b)).collect();
    let (bx0, bx1) = budgets.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    let (bx0, bx1) = (bx0 / 1.25, bx1 * 1.25);

    let path = dir.join(metric.file);
    draw(e, &series, (lo, hi), (bx0, bx1), metric, &path)?;
    Ok(path)
}

/// Draws the panels into `path`.
fn draw(
    e: &Experiment,
    series: &BTreeMap<(&str, u64, &str), BTreeMap<u64, f64>>,
    (lo, hi): (f64, f64),
    (bx0, bx1): (f64, f64),
    metric: Metric,
    path: &Path,
) -> anyhow::Result<()> {
    let (models, contexts) = (e.models(), e.contexts());
    let (rows, cols) = (models.len(), contexts.len());
    let size = ((cols as u32 * 360).max(480), rows as u32 * 280 + 90);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!("{} — {} on {}", metric.title, e.name, e.profile);
    let (header, body) = root.split_vertically(60);
    header.draw(&Text::new(title, (16, 10), ("sans-serif", 22).into_font()))?;
    let mut x = 16;
    for (i, p) in e.planners.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        header.draw(&PathElement::new(vec![(x, 45), (x + 24, 45)], colour.stroke_width(3)))?;
        header.draw(&Text::new(p.clone(), (x + 30, 37), ("sans-serif", 16).into_font()))?;
        x += 40 + 9 * p.len() as i32;
    }
    let panels = body.split_evenly((rows, cols));
    for (i, area) in panels.iter().enumerate() {
        let (model, ctx) = (models[i / cols], contexts[i % cols]);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{model} · ctx {}", format_tokens(ctx)), ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(34)
            .y_label_area_size(56)
            .build_cartesian_2d((bx0..bx1).log_scale().base(2.0), (lo..hi).log_scale())
            .context("building a panel")?;
        chart
            .configure_mesh()
            .x_desc("VRAM budget (GiB)")
            .light_line_style(WHITE)
            .y_desc(metric.unit)
            .x_label_formatter(&|v| if *v >= 1.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .y_label_formatter(&|v| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .label_style(("sans-serif", 12))
            .draw()?;
        for (pi, p) in e.planners.iter().enumerate() {
            let Some(s) = series.get(&(model.as_str(), ctx, p.as_str())) else { continue };
            let colour = COLOURS[pi % COLOURS.len()];
            let points: Vec<(f64, f64)> = s.iter().map(|(&b, &v)| (gib(b), v)).collect();
            chart.draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?;
            chart.draw_series(points.into_iter().map(|pt| Circle::new(pt, 3, colour.filled())))?;
        }
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
