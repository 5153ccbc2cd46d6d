//! The speed-up chart (SVG, via plotters; SVG text needs no font files): one panel per group
//! and workload tag, speed-up against each configuration's baseline on the y axis, `k` on the
//! x axis, one line per drafter family (engine, drafter, placement).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::results::{GroupResults, RunResults};
use crate::stats::ALL;

/// One line of a panel: `(k, speed-up)` points, sorted by `k`.
pub type Series = BTreeMap<String, Vec<(f64, f64)>>;

/// The series of one group on one tag: every configuration with a `k` and a speed-up.
pub fn series(g: &GroupResults, tag: &str) -> Series {
    let mut out = Series::new();
    for c in &g.configs {
        let (Some(k), Some(up)) = (c.config.k, c.summary.get(tag).and_then(|s| s.speedup)) else {
            continue;
        };
        out.entry(c.config.family())
            .or_default()
            .push((k as f64, up.median));
    }
    for points in out.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Draws the chart into `path`; `false` when no configuration speculates (nothing to draw).
///
/// # Errors
/// The file cannot be written.
pub fn draw(run: &RunResults, path: &Path) -> Result<bool> {
    let mut panels = Vec::new();
    for g in &run.groups {
        let mut tags: Vec<&str> = g.tags();
        if tags.len() > 1 {
            tags.push(ALL);
        }
        let row: Vec<(String, Series)> = tags
            .iter()
            .map(|t| (format!("{} — {t}", g.group.name), series(g, t)))
            .collect();
        if row.iter().any(|(_, s)| !s.is_empty()) {
            panels.push(row);
        }
    }
    if panels.is_empty() {
        return Ok(false);
    }
    let families: Vec<String> = {
        let mut f: Vec<String> = panels
            .iter()
            .flatten()
            .flat_map(|(_, s)| s.keys().cloned())
            .collect();
        f.sort();
        f.dedup();
        f
    };
    let cols = panels.iter().map(Vec::len).max().unwrap_or(1);
    let (w, h) = (330u32, 260u32);
    let root =
        SVGBackend::new(path, (w * cols as u32, h * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let areas = root.split_evenly((panels.len(), cols));
    for (r, row) in panels.iter().enumerate() {
        for (c, (title, series)) in row.iter().enumerate() {
            panel(&areas[r * cols + c], title, series, &families)?;
        }
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(true)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    series: &Series,
    families: &[String],
) -> Result<()> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e:?}");
    let points = series.values().flatten();
    let k_max = points.clone().map(|p| p.0).fold(1.0, f64::max) + 1.0;
    let y_max = points.map(|p| p.1).fold(1.2, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(36)
        .build_cartesian_2d(0.0..k_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("k (drafts per round)")
        .y_desc("speed-up")
        .light_line_style(WHITE)
        .draw()
        .map_err(err)?;
    // Break-even: above this line speculation pays.
    chart
        .draw_series(LineSeries::new([(0.0, 1.0), (k_max, 1.0)], BLACK.mix(0.4)))
        .map_err(err)?;
    for (name, pts) in series {
        let i = families.iter().position(|f| f == name).unwrap_or(0);
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 10))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
    }
    Ok(())
}
