//! PNG plots of a sweep (plotters, bitmap backend): TPS and TTFT against the VRAM budget, one panel per
//! model × context, one line per planner. Where a sweep has several ubatches, each point is the best over them
//! (as the paper's Figure 2 does). Log scales on both axes: budgets double, and metrics span decades.
//! `pipeshard repro` draws ours beside the paper's: Table 4 as the same panels, Figure 2 as grouped bars, Table 9
//! and Figure 7 as lines against the number of parallel requests, a panel per budget ([`batch_panels`], which
//! the batch study draws too).
//!
//! Text is drawn with DejaVu Sans embedded in the binary (`assets/DejaVuSans.ttf`, its licence beside it) via
//! plotters' `ab_glyph` feature, so the binary needs no fontconfig or freetype on the machine that runs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::args::{format_bytes, format_tokens};
use crate::experiment::Experiment;
use crate::repro::{BatchSeries, TableSeries};
use crate::sweep::{CellResult, gib};

static FONT: Once = Once::new();

pub(crate) fn register() {
    FONT.call_once(|| {
        register_font("sans-serif", FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"))
            .unwrap_or_else(|_| panic!("the embedded DejaVu Sans is a valid font"));
    });
}

/// Line colours, one per planner in the experiment's order (the first two also mark the paper's and ours).
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
    // (model, ctx, planner) → budget → best value over ubatches.
    let mut series: Series = BTreeMap::new();
    for r in results {
        let Some(v) = (metric.value)(r).filter(|v| *v > 0.0 && v.is_finite()) else { continue };
        let c = &r.cell;
        let slot = series
            .entry((c.model.clone(), c.ctx, c.planner.clone()))
            .or_default()
            .entry(c.budget_bytes)
            .or_insert(v);
        *slot = if metric.higher_is_better { slot.max(v) } else { slot.min(v) };
    }
    let path = dir.join(metric.file);
    let panels = Panels {
        title: format!("{} — {} on {}", metric.title, e.name, e.profile),
        models: e.models().into_iter().cloned().collect(),
        contexts: e.contexts(),
        budgets: e.budgets(),
        lines: e.planners.clone(),
        unit: metric.unit,
    };
    draw(&panels, &series, &path)?;
    Ok(path)
}

/// (model, ctx, line) → budget → value.
type Series = BTreeMap<(String, u64, String), BTreeMap<u64, f64>>;

/// A grid of panels (model rows × context columns), lines against the VRAM budget.
struct Panels {
    title: String,
    models: Vec<String>,
    contexts: Vec<u64>,
    budgets: Vec<u64>,
    /// Line names, in legend and colour order.
    lines: Vec<String>,
    unit: &'static str,
}

/// Draws `series` as `panels` into `path`.
fn draw(p: &Panels, series: &Series, path: &Path) -> anyhow::Result<()> {
    let values: Vec<f64> = series.values().flat_map(|s| s.values().copied()).collect();
    let (lo, hi) = values.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    let (lo, hi) = if values.is_empty() { (0.1, 10.0) } else { (lo / 1.5, hi * 1.5) };
    let budgets: Vec<f64> = p.budgets.iter().map(|&b| gib(b)).collect();
    let (bx0, bx1) = budgets.iter().fold((f64::INFINITY, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
    let (bx0, bx1) = (bx0 / 1.25, bx1 * 1.25);
    let (rows, cols) = (p.models.len(), p.contexts.len());
    let size = ((cols as u32 * 360).max(480), rows as u32 * 280 + 90);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(60);
    header.draw(&Text::new(p.title.clone(), (16, 10), ("sans-serif", 22).into_font()))?;
    legend(&header, &p.lines)?;
    let areas = body.split_evenly((rows, cols));
    for (i, area) in areas.iter().enumerate() {
        let (model, ctx) = (&p.models[i / cols], p.contexts[i % cols]);
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
            .y_desc(p.unit)
            .x_label_formatter(&|v| if *v >= 1.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .y_label_formatter(&|v| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .label_style(("sans-serif", 12))
            .draw()?;
        for (li, line) in p.lines.iter().enumerate() {
            let Some(s) = series.get(&(model.clone(), ctx, line.clone())) else { continue };
            let colour = COLOURS[li % COLOURS.len()];
            let points: Vec<(f64, f64)> = s.iter().map(|(&b, &v)| (gib(b), v)).collect();
            chart.draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?;
            chart.draw_series(points.into_iter().map(|pt| Circle::new(pt, 3, colour.filled())))?;
        }
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One line of a profile panel.
type Line = (String, Vec<(f64, f64)>);

/// Draws one log-log (or log-x) panel of a profile.
fn profile_panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    lines: &[Line],
    log_y: bool,
) -> anyhow::Result<()> {
    let pts: Vec<(f64, f64)> = lines.iter().flat_map(|l| l.1.iter().copied()).filter(|p| p.1 > 0.0).collect();
    if pts.is_empty() {
        area.draw(&Text::new(format!("{title}: no data"), (20, 20), ("sans-serif", 16).into_font()))?;
        return Ok(());
    }
    let (x0, x1) = pts.iter().fold((f64::INFINITY, 0.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts.iter().fold((f64::INFINITY, 0.0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (x0, x1) = (x0 / 1.3, x1 * 1.3);
    let mut chart = ChartBuilder::on(area);
    chart.caption(title, ("sans-serif", 18)).margin(10).x_label_area_size(38).y_label_area_size(60);
    let fmt = |v: &f64| {
        if *v >= 1e9 {
            format!("{:.0}G", v / 1e9)
        } else if *v >= 1e6 {
            format!("{:.0}M", v / 1e6)
        } else if *v >= 1e3 {
            format!("{:.0}K", v / 1e3)
        } else if *v >= 10.0 || (*v >= 1.0 && v.fract().abs() < 1e-9) {
            format!("{v:.0}")
        } else {
            format!("{v:.2}")
        }
    };
    macro_rules! body {
        ($c:expr) => {{
            let mut c = $c;
            c.configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .light_line_style(WHITE.mix(0.0))
                .x_label_formatter(&fmt)
                .y_label_formatter(&fmt)
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, (name, l)) in lines.iter().enumerate() {
                let colour = COLOURS[i % COLOURS.len()];
                let style = if i >= COLOURS.len() { colour.stroke_width(1) } else { colour.stroke_width(2) };
                c.draw_series(LineSeries::new(l.iter().copied(), style))?.label(name.clone()).legend(
                    move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2)),
                );
                c.draw_series(l.iter().map(|&p| Circle::new(p, 2, colour.filled())))?;
            }
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 11))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }};
    }
    if log_y {
        body!(
            chart.build_cartesian_2d((x0..x1).log_scale().base(2.0), ((y0 / 1.5)..(y1 * 1.5)).log_scale())?
        );
    } else {
        body!(chart.build_cartesian_2d((x0..x1).log_scale().base(2.0), 0.0..(y1 * 1.15))?);
    }
    Ok(())
}

/// A legend line per name, left to right, in `COLOURS` order.
fn legend(
    header: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    names: &[String],
) -> anyhow::Result<()> {
    let mut x = 16;
    for (i, name) in names.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        header.draw(&PathElement::new(vec![(x, 45), (x + 24, 45)], colour.stroke_width(3)))?;
        header.draw(&Text::new(name.clone(), (x + 30, 37), ("sans-serif", 16).into_font()))?;
        x += 40 + 9 * name.chars().count() as i32;
    }
    Ok(())
}

/// The summary plot of a profile: PCIe by size, host bandwidth by threads, GPU GEMM rate by tokens, GPU
/// attention time by context.
pub fn profile_plot(p: &pipeshard_core::profile::Profile, path: &Path) -> anyhow::Result<()> {
    use pipeshard_core::cost::{CostModel, TableCostModel};
    use pipeshard_core::dtype::DType;
    use pipeshard_core::workload::OpClass;
    register();
    let m = TableCostModel::new(p);
    let root = BitMapBackend::new(path, (1500, 1060)).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(44);
    let title = format!("profile `{}` — {} · {}", p.machine.name, p.machine.gpu, p.machine.cpu);
    header.draw(&Text::new(title, (16, 12), ("sans-serif", 20).into_font()))?;
    let panels = body.split_evenly((2, 2));

    let sizes: Vec<u64> = p.pcie.h2d_pinned.iter().map(|x| x.bytes).collect();
    let copy = |f: &dyn Fn(u64) -> u64| {
        sizes.iter().map(|&b| (b as f64, b as f64 / f(b) as f64)).collect::<Vec<_>>()
    };
    let pcie = vec![
        ("H2D pinned".to_string(), copy(&|b| m.h2d_ns(b, true))),
        ("D2H pinned".to_string(), copy(&|b| m.d2h_ns(b, true))),
        ("H2D pageable".to_string(), copy(&|b| m.h2d_ns(b, false))),
        ("D2H pageable".to_string(), copy(&|b| m.d2h_ns(b, false))),
    ];
    profile_panel(
        &panels[0],
        "PCIe copies (achieved, latency included)",
        ("bytes per copy", "GB/s"),
        &pcie,
        true,
    )?;

    let gemv = |under: bool| {
        p.dram
            .iter()
            .filter_map(|d| {
                let g = crate::profile::best_cpu_gemv(p, d.threads)?;
                Some((f64::from(d.threads), if under { g.1? } else { g.0 }))
            })
            .collect::<Vec<_>>()
    };
    let host = vec![
        ("DRAM read".to_string(), p.dram.iter().map(|d| (f64::from(d.threads), d.gbps)).collect()),
        (
            "DRAM read under H2D".to_string(),
            p.dram.iter().map(|d| (f64::from(d.threads), d.gbps_under_dma)).collect(),
        ),
        ("CPU GEMV bf16 (weights)".to_string(), gemv(false)),
        ("CPU GEMV under H2D".to_string(), gemv(true)),
    ];
    profile_panel(&panels[1], "host: DRAM and CPU GEMV by threads", ("threads", "GB/s"), &host, false)?;

    // GEMM rate by tokens for up to six bf16 shapes spread over the sizes measured.
    let mut shapes: Vec<(u64, u64)> = p
        .gpu
        .ops
        .iter()
        .filter(|r| r.op == OpClass::MatMul && r.dtype == DType::Bf16)
        .map(|r| (r.n, r.k))
        .collect();
    shapes.sort_by_key(|s| (s.0 * s.1, s.0));
    shapes.dedup();
    let pick: Vec<(u64, u64)> = if shapes.len() <= 6 {
        shapes.clone()
    } else {
        (0..6).map(|i| shapes[i * (shapes.len() - 1) / 5]).collect()
    };
    let gemm: Vec<Line> = pick
        .iter()
        .map(|&(n, k)| {
            let mut pts: Vec<(f64, f64)> = p
                .gpu
                .ops
                .iter()
                .filter(|r| r.op == OpClass::MatMul && r.dtype == DType::Bf16 && (r.n, r.k) == (n, k))
                .map(|r| (r.tokens as f64, 2.0 * (r.tokens * n * k) as f64 / r.time_ns as f64 / 1e3))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (format!("{n}×{k}"), pts)
        })
        .collect();
    profile_panel(&panels[2], "GPU bf16 GEMM (exec cuBLAS)", ("tokens", "TFLOP/s"), &gemm, true)?;

    let mut layouts: Vec<u64> =
        p.gpu.ops.iter().filter(|r| r.op == OpClass::Attention).map(|r| r.n).collect();
    layouts.sort_unstable();
    layouts.dedup();
    let mut attn: Vec<Line> = Vec::new();
    for decode in [true, false] {
        for &n in &layouts {
            let mut pts: Vec<(f64, f64)> = p
                .gpu
                .ops
                .iter()
                .filter(|r| {
                    r.op == OpClass::Attention
                        && r.n == n
                        && r.dtype == DType::F16
                        && (r.tokens == 1) == decode
                })
                .map(|r| (r.k as f64, r.time_ns as f64 / 1e3))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            if !pts.is_empty() {
                attn.push((format!("{} q-dim {n}", if decode { "decode" } else { "prefill 512" }), pts));
            }
        }
    }
    profile_panel(&panels[3], "GPU attention (exec kernel, f16 KV)", ("keys attended", "µs"), &attn, true)?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Ours against the paper: Table 4 as lines against the budget (one PNG per metric), Figure 2 as grouped bars
/// (one PNG, a row per model and a column per metric). Returns the paths written.
pub fn paper_plots(table: &str, e: &Experiment, s: &TableSeries, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    register();
    let metrics: Vec<String> = {
        let mut v: Vec<String> = s.keys().map(|k| k.0.clone()).collect();
        v.dedup();
        v
    };
    let lines = ["paper".to_string(), "ours (pshard, simulated)".to_string()];
    if table == "figure2" {
        let path = dir.join("figure2.png");
        speedup_bars(e, s, &metrics, &lines, &path)?;
        return Ok(vec![path]);
    }
    let mut out = Vec::new();
    for m in &metrics {
        let mut series: Series = BTreeMap::new();
        for ((_, model, ctx), pts) in s.iter().filter(|(k, _)| &k.0 == m) {
            for &(b, ours, paper) in pts {
                series.entry((model.clone(), *ctx, lines[0].clone())).or_default().insert(b, paper);
                if let Some(o) = ours {
                    series.entry((model.clone(), *ctx, lines[1].clone())).or_default().insert(b, o);
                }
            }
        }
        let file: String = m.chars().filter(char::is_ascii_alphanumeric).collect::<String>().to_lowercase();
        let path = dir.join(format!("{file}.png"));
        let panels = Panels {
            title: format!("{table}: {m}, ours vs the paper ({})", e.profile),
            models: e.models().into_iter().cloned().collect(),
            contexts: e.contexts(),
            budgets: e.budgets(),
            lines: lines.to_vec(),
            unit: if m.starts_with("TTFT") { "TTFT (ms)" } else { "tokens/s" },
        };
        draw(&panels, &series, &path)?;
        out.push(path);
    }
    Ok(out)
}

/// Grouped bars: per model (row) and metric (column), one group per (ctx, budget), ours beside the paper's.
fn speedup_bars(
    e: &Experiment,
    s: &TableSeries,
    metrics: &[String],
    lines: &[String; 2],
    path: &Path,
) -> anyhow::Result<()> {
    let models: Vec<String> = e.models().into_iter().cloned().collect();
    let (contexts, budgets) = (e.contexts(), e.budgets());
    let groups = contexts.len() * budgets.len();
    let values: Vec<f64> =
        s.values().flat_map(|v| v.iter().flat_map(|(_, o, p)| o.iter().copied().chain([*p]))).collect();
    let hi = values.iter().copied().fold(1.0f64, f64::max) * 1.3;
    let lo = values.iter().copied().fold(1.0f64, f64::min).min(0.5) / 1.2;
    let size = (metrics.len() as u32 * 620, models.len() as u32 * 300 + 90);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(60);
    header.draw(&Text::new(
        format!(
            "Figure 2: speed-up of pshard over -ngl, ours ({}) vs the paper; groups: ctx, bars by budget",
            e.profile
        ),
        (16, 10),
        ("sans-serif", 22).into_font(),
    ))?;
    legend(&header, lines)?;
    let areas = body.split_evenly((models.len(), metrics.len()));
    for (i, area) in areas.iter().enumerate() {
        let (model, metric) = (&models[i / metrics.len()], &metrics[i % metrics.len()]);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{model} · {metric}"), ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..groups as f64, (lo..hi).log_scale())
            .context("building a panel")?;
        let per = budgets.len();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .y_desc("speed-up (×)")
            .x_labels(0)
            .y_label_formatter(&|v| format!("{v:.1}"))
            .label_style(("sans-serif", 12))
            .draw()?;
        for (ci, ctx) in contexts.iter().enumerate() {
            let Some(pts) = s.get(&(metric.clone(), model.clone(), *ctx)) else { continue };
            for &(b, ours, paper) in pts {
                let Some(bi) = budgets.iter().position(|x| *x == b) else { continue };
                let x0 = (ci * per + bi) as f64;
                for (k, v) in [(0usize, Some(paper)), (1, ours)] {
                    let Some(v) = v else { continue };
                    let colour = COLOURS[k];
                    let (a, z) = (x0 + 0.1 + 0.4 * k as f64, x0 + 0.5 + 0.4 * k as f64);
                    chart.draw_series([Rectangle::new([(a, lo), (z, v)], colour.filled())])?;
                }
            }
            let centre = ((ci * per) as f64 + per as f64 / 2.0 - 0.8, hi / 1.2);
            chart.draw_series([Text::new(
                format!("ctx {}", format_tokens(*ctx)),
                centre,
                ("sans-serif", 13),
            )])?;
            if ci > 0 {
                let x = (ci * per) as f64;
                chart.draw_series(LineSeries::new([(x, lo), (x, hi)], BLACK.stroke_width(1)))?;
            }
        }
        chart.draw_series(LineSeries::new(
            [(0.0, 1.0), (groups as f64, 1.0)],
            BLACK.mix(0.4).stroke_width(1),
        ))?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One panel of a batch plot: its caption and, per line, (batch, value) points.
pub struct BatchPanel {
    pub caption: String,
    pub lines: BTreeMap<String, Vec<(u64, f64)>>,
}

/// Panels side by side (one per VRAM budget, say), each with lines against the number of parallel requests
/// (log₂ x axis); `lines` gives the legend and colour order.
pub fn batch_panels(
    title: &str,
    unit: &str,
    lines: &[String],
    panels: &[BatchPanel],
    path: &Path,
) -> anyhow::Result<()> {
    register();
    let points = || panels.iter().flat_map(|p| p.lines.values().flatten());
    let (lo, hi) = points().fold((f64::INFINITY, 0.0f64), |(a, b), &(_, v)| (a.min(v), b.max(v)));
    let (lo, hi) = if hi > 0.0 { (lo / 1.5, hi * 1.5) } else { (0.1, 10.0) };
    let x_hi = points().map(|&(b, _)| b).max().unwrap_or(64) as f64 * 1.5;
    let size = ((panels.len() as u32 * 420).max(480), 400);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(60);
    header.draw(&Text::new(title.to_string(), (16, 10), ("sans-serif", 20).into_font()))?;
    legend(&header, lines)?;
    let areas = body.split_evenly((1, panels.len().max(1)));
    for (area, panel) in areas.iter().zip(panels) {
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.caption, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(34)
            .y_label_area_size(56)
            .build_cartesian_2d((0.7..x_hi).log_scale().base(2.0), (lo..hi).log_scale())
            .context("building a panel")?;
        chart
            .configure_mesh()
            .x_desc("parallel requests")
            .light_line_style(WHITE)
            .y_desc(unit)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| if *v >= 10.0 { format!("{v:.0}") } else { format!("{v:.2}") })
            .label_style(("sans-serif", 12))
            .draw()?;
        for (li, line) in lines.iter().enumerate() {
            let Some(pts) = panel.lines.get(line) else { continue };
            let colour = COLOURS[li % COLOURS.len()];
            let pts: Vec<(f64, f64)> = pts.iter().map(|&(b, v)| (b as f64, v)).collect();
            chart.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?;
            chart.draw_series(pts.into_iter().map(|pt| Circle::new(pt, 3, colour.filled())))?;
        }
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A batched paper table (Table 9, Figure 7): per metric one PNG, a panel per budget, ours beside the paper's
/// against the number of requests.
pub fn batch_paper_plots(
    table: &str,
    e: &Experiment,
    s: &BatchSeries,
    dir: &Path,
) -> anyhow::Result<Vec<PathBuf>> {
    let lines = ["paper".to_string(), "ours (pshard, simulated)".to_string()];
    let mut metrics: Vec<&String> = s.keys().map(|k| &k.0).collect();
    metrics.dedup();
    let mut out = Vec::new();
    for m in metrics {
        let panels: Vec<BatchPanel> = s
            .iter()
            .filter(|(k, _)| &k.0 == m)
            .map(|((_, budget), pts)| BatchPanel {
                caption: format!("budget {}", format_bytes(*budget)),
                lines: [
                    (lines[0].clone(), pts.iter().map(|&(b, _, p)| (b, p)).collect()),
                    (lines[1].clone(), pts.iter().filter_map(|&(b, o, _)| o.map(|o| (b, o))).collect()),
                ]
                .into(),
            })
            .collect();
        let file: String = m.chars().filter(char::is_ascii_alphanumeric).collect::<String>().to_lowercase();
        let path = dir.join(format!("{file}.png"));
        let title = format!(
            "{table}: {m} of {}, ours vs the paper ({})",
            e.models().into_iter().cloned().collect::<Vec<_>>().join(", "),
            e.profile
        );
        batch_panels(
            &title,
            if m.contains("Speedup") { "speed-up (×)" } else { "tokens/s (all requests)" },
            &lines,
            &panels,
            &path,
        )?;
        out.push(path);
    }
    Ok(out)
}
