//! The report's plots (SVG, plotters): curves of a quantity against a size or a count, and
//! ratio bars of clan against its same-run baselines. Every plot carries its title, axis
//! labels with units, tick labels in human units (`1.5 Gbit/s`, `64 KiB`, `1.2 µs`) and a
//! footer with the machine and the placement, so that it reads without the text around it.

use std::path::Path;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::Result;

/// What the numbers on an axis are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes (sizes): `64 B`, `4 KiB`, `1 MiB`.
    Bytes,
    /// Bandwidth given in Mbit/s: `500 Mbit/s`, `1.5 Gbit/s`.
    Mbits,
    /// Nanoseconds: `500 ns`, `1.5 µs`, `2 ms`.
    Nanos,
    /// Events per second: `500 k/s`, `1.2 M/s`.
    PerSec,
    /// Plain counts (endpoints, clients): `10`, `1k`, `10k`.
    Count,
}

/// An axis: what it measures (with the unit in words) and how its ticks read.
#[derive(Debug, Clone, Copy)]
pub struct Axis {
    pub label: &'static str,
    pub unit: Unit,
}

/// Curves of one quantity (y) against another (x), both on log scales.
#[derive(Debug)]
pub struct Lines<'a> {
    pub title: &'a str,
    pub footer: &'a str,
    pub x: Axis,
    pub y: Axis,
    pub curves: Vec<(String, Vec<(f64, f64)>)>,
}

/// One bar per measurement: clan's figure divided by its baseline's, same run.
#[derive(Debug)]
pub struct Ratios<'a> {
    pub title: &'a str,
    pub footer: &'a str,
    /// (what was measured, the baseline's name, clan ÷ baseline).
    pub bars: Vec<(String, String, f64)>,
}

/// Three significant digits at most, trailing zeros dropped: 1.5, 500, 12.3.
fn sig(v: f64) -> String {
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s }
}

/// `v` in `unit`, for a tick or a bar's label.
pub fn human(v: f64, unit: Unit) -> String {
    if !v.is_finite() {
        return "—".into();
    }
    let scaled = |v: f64, steps: &[(f64, &str)]| {
        let (div, name) = steps.iter().rev().find(|(d, _)| v.abs() >= *d).copied().unwrap_or(steps[0]);
        format!("{} {name}", sig(v / div))
    };
    match unit {
        Unit::Bytes => {
            scaled(v, &[(1.0, "B"), (1024.0, "KiB"), (1024.0 * 1024.0, "MiB"), (1024.0 * 1024.0 * 1024.0, "GiB")])
        }
        Unit::Mbits => {
            scaled(v * 1e6, &[(1.0, "bit/s"), (1e3, "kbit/s"), (1e6, "Mbit/s"), (1e9, "Gbit/s"), (1e12, "Tbit/s")])
        }
        Unit::Nanos => scaled(v, &[(1.0, "ns"), (1e3, "µs"), (1e6, "ms"), (1e9, "s")]),
        Unit::PerSec => scaled(v, &[(1.0, "/s"), (1e3, "k/s"), (1e6, "M/s"), (1e9, "G/s")]),
        Unit::Count => scaled(v, &[(1.0, ""), (1e3, "k"), (1e6, "M")]).replace(' ', ""),
    }
}

/// Tick positions on a log axis from `lo` to `hi`: powers of two for sizes, 1–2–5 steps
/// otherwise; thinned to at most about ten.
fn ticks(lo: f64, hi: f64, unit: Unit) -> Vec<f64> {
    let mut t = Vec::new();
    if unit == Unit::Bytes {
        let mut v = 2f64.powi(lo.log2().ceil() as i32);
        while v <= hi && t.len() < 64 {
            t.push(v);
            v *= 2.0;
        }
    } else {
        let mut decade = 10f64.powi(lo.log10().floor() as i32);
        while decade <= hi && t.len() < 64 {
            for m in [1.0, 2.0, 5.0] {
                let v = decade * m;
                if v >= lo && v <= hi {
                    t.push(v);
                }
            }
            decade *= 10.0;
        }
    }
    let mut step = 1;
    while t.len().div_ceil(step) > 10 {
        step *= 2;
    }
    t.into_iter().step_by(step).collect()
}

/// Ratio ticks: 1× always, halves and doubles near it, powers of ten further out.
fn ratio_ticks(lo: f64, hi: f64) -> Vec<f64> {
    [0.001, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0, 100.0, 1000.0]
        .into_iter()
        .filter(|t| *t >= lo && *t <= hi)
        .collect()
}

/// The frame every plot shares: a title above, the machine and placement below. Returns the
/// area left for the chart.
fn frame<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    footer: &str,
) -> Result<DrawingArea<DB, plotters::coord::Shift>> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (w, h) = root.dim_in_pixel();
    let (head, rest) = root.split_vertically(44);
    let (body, foot) = rest.split_vertically(h - 44 - 44);
    head.draw(&Text::new(
        title.to_owned(),
        (w as i32 / 2, 24),
        TextStyle::from(("sans-serif", 20).into_font().style(FontStyle::Bold))
            .pos(Pos::new(HPos::Center, VPos::Center)),
    ))
    .map_err(|e| e.to_string())?;
    // The footer on at most two lines.
    let max = (w as usize / 7).max(40);
    let mut lines = vec![String::new()];
    for word in footer.split(' ') {
        let last = lines.last_mut().expect("one line");
        if !last.is_empty() && last.chars().count() + 1 + word.chars().count() > max {
            if lines.len() == 2 {
                lines[1].push_str(" …");
                break;
            }
            lines.push(String::new());
        }
        let last = lines.last_mut().expect("one line");
        if !last.is_empty() {
            last.push(' ');
        }
        last.push_str(word);
    }
    for (i, l) in lines.iter().enumerate() {
        foot.draw(&Text::new(
            l.clone(),
            (12, 12 + 16 * i as i32),
            ("sans-serif", 12).into_font().color(&BLACK.mix(0.7)),
        ))
        .map_err(|e| e.to_string())?;
    }
    Ok(body)
}

/// Curves on log–log axes.
pub fn lines(path: &Path, p: &Lines<'_>) -> Result<()> {
    let mut curves: Vec<(String, Vec<(f64, f64)>)> = p
        .curves
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite() && *x > 0.0 && *y > 0.0).collect(),
            )
        })
        .collect();
    curves.retain(|(_, v): &(String, Vec<(f64, f64)>)| !v.is_empty());
    if curves.is_empty() {
        return Err(format!("{}: no point to plot", p.title).into());
    }
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    let body = frame(&root, p.title, p.footer)?;
    let xs = curves.iter().flat_map(|c| c.1.iter().map(|q| q.0));
    let ys = curves.iter().flat_map(|c| c.1.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let (y0, y1) = ys.fold((f64::MAX, 0.0f64), |(a, b), y| (a.min(y), b.max(y)));
    let (xu, yu) = (p.x.unit, p.y.unit);
    // Headroom above the curves for the legend (about 20 px a line of the ~390 px plot).
    let legend = (20.0 * curves.len() as f64 + 24.0) / 390.0;
    let decades = (y1 * 1.4 / (y0 * 0.7)).log10().max(0.3);
    let (xr, yr) = ((x0 * 0.8, x1 * 1.25), (y0 * 0.7, y1 * 1.4 * 10f64.powf(decades * legend / (1.0 - legend))));
    let (xt, yt) = (ticks(xr.0, xr.1, xu), ticks(yr.0, yr.1, yu));
    let mut chart = ChartBuilder::on(&body)
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(85)
        .build_cartesian_2d((xr.0..xr.1).log_scale().with_key_points(xt), (yr.0..yr.1).log_scale().with_key_points(yt))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(p.x.label)
        .y_desc(p.y.label)
        .x_label_formatter(&|v| human(*v, xu))
        .y_label_formatter(&|v| human(*v, yu))
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, pts)) in curves.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|q| Circle::new(*q, 3, c.filled()))).map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// Horizontal bars of clan ÷ baseline, each labelled with what was measured and against
/// what, its value written at its end, and a line at 1 (equal).
pub fn ratios(path: &Path, p: &Ratios<'_>) -> Result<()> {
    let bars: Vec<&(String, String, f64)> = p.bars.iter().filter(|b| b.2.is_finite() && b.2 > 0.0).collect();
    if bars.is_empty() {
        return Err(format!("{}: no ratio to plot", p.title).into());
    }
    let n = bars.len();
    let height = (44 + 44 + 110 + 34 * n as u32).max(280);
    let root = SVGBackend::new(path, (1100, height)).into_drawing_area();
    let body = frame(&root, p.title, p.footer)?;
    // A log scale centred on 1×: each bar goes from 1× to its ratio, so 0.5× and 2× are
    // bars of the same length on either side.
    let lo = bars.iter().map(|b| b.2).fold(0.5, f64::min) / 1.6;
    let hi = bars.iter().map(|b| b.2).fold(2.0, f64::max) * 1.6;
    let span = (1.0 / lo).max(hi);
    let (lo, hi) = (1.0 / span, span);
    // Bars from the top down in the rows' order; y = n - i - 1 .. n - i.
    let labels: Vec<String> = bars
        .iter()
        .map(|(what, base, _)| {
            let l = format!("{what} — clan ÷ {base}");
            if l.chars().count() > 78 { format!("{}…", l.chars().take(77).collect::<String>()) } else { l }
        })
        .collect();
    // One segment per bar (an integer range includes its end: 0..n-1 is n segments).
    let top = n as i32 - 1;
    let mut chart = ChartBuilder::on(&body)
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(520)
        .build_cartesian_2d((lo..hi).log_scale().with_key_points(ratio_ticks(lo, hi)), (0..top).into_segmented())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(s) => labels.get((top - s) as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc("clan ÷ baseline, same run (log scale). Orange: times, left of 1× is faster. Blue: rates, right of 1× is more.")
        .x_label_formatter(&|v| format!("{}×", sig(*v)))
        .draw()
        .map_err(|e| e.to_string())?;
    // Times (lower is better) and rates (higher is better) in two colours.
    let is_time = |what: &str| {
        let w = what.to_lowercase();
        [
            "rtt",
            "latency",
            "round trip",
            "one-way",
            "overhead",
            "time",
            "set-up",
            "setup",
            "connect",
            "µs",
            "p50",
            "p99",
        ]
        .iter()
        .any(|k| w.contains(k))
            && !["/s", "bandwidth", "rate", "per s"].iter().any(|k| w.contains(k))
    };
    let time_colour = RGBColor(230, 120, 30);
    let rate_colour = RGBColor(40, 90, 200);
    let seg = |i: usize| top - i as i32;
    for (want_time, colour) in [(true, time_colour), (false, rate_colour)] {
        let mine: Vec<(usize, f64)> =
            bars.iter().enumerate().filter(|(_, b)| is_time(&b.0) == want_time).map(|(i, b)| (i, b.2)).collect();
        if mine.is_empty() {
            continue;
        }
        chart
            .draw_series(mine.iter().map(|&(i, v)| {
                let mut r = Rectangle::new(
                    [(1.0, SegmentValue::Exact(seg(i))), (v, SegmentValue::Exact(seg(i) + 1))],
                    colour.mix(0.75).filled(),
                );
                r.set_margin(6, 6, 0, 0);
                r
            }))
            .map_err(|e| e.to_string())?;
    }
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            Text::new(
                format!(" {}×", sig(b.2)),
                (b.2.max(1.0), SegmentValue::CenterOf(seg(i))),
                ("sans-serif", 13).into_font(),
            )
        }))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(1.0, SegmentValue::Exact(0)), (1.0, SegmentValue::Exact(top + 1))],
            BLACK.mix(0.7).stroke_width(1),
        )))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Unit, human};

    #[test]
    fn ticks_read_in_human_units() {
        assert_eq!(human(500_000.0, Unit::Mbits), "500 Gbit/s");
        assert_eq!(human(1500.0, Unit::Mbits), "1.5 Gbit/s");
        assert_eq!(human(500.0, Unit::Mbits), "500 Mbit/s");
        assert_eq!(human(0.25, Unit::Mbits), "250 kbit/s");
        assert_eq!(human(64.0, Unit::Bytes), "64 B");
        assert_eq!(human(65536.0, Unit::Bytes), "64 KiB");
        assert_eq!(human(1536.0, Unit::Bytes), "1.5 KiB");
        assert_eq!(human(1048576.0, Unit::Bytes), "1 MiB");
        assert_eq!(human(450.0, Unit::Nanos), "450 ns");
        assert_eq!(human(1500.0, Unit::Nanos), "1.5 µs");
        assert_eq!(human(12_300.0, Unit::Nanos), "12.3 µs");
        assert_eq!(human(1_200_000.0, Unit::PerSec), "1.2 M/s");
        assert_eq!(human(10_000.0, Unit::Count), "10k");
        assert_eq!(human(7.0, Unit::Count), "7");
        assert_eq!(human(f64::NAN, Unit::Nanos), "—");
    }
}
