//! SVG plots of `holdfast bench` results (`--plot FILE`), drawn with plotters' SVG backend.
//!
//! Two charts, the ones a user compares systems by: latency percentiles against throughput across a
//! sweep of client counts (`acquire-release --clients 1,16,64,256`), and keepalive latency over time in
//! a hold. Text is written as SVG `<text>` in the viewer's sans-serif font, so no font file is needed.

use plotters::prelude::*;
use std::path::Path;

/// One client count of an `acquire-release` sweep.
pub struct SweepPoint {
    pub clients: usize,
    pub pairs_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
}

/// One second of a hold: when, and its keepalive latency percentiles.
pub struct HoldSecond {
    pub at_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

const SIZE: (u32, u32) = (900, 560);
/// The three lines' colours: blue, red, green.
const COLORS: [RGBColor; 3] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
];

/// What one chart shows: three named lines of (x, y) points, y in ms on a log scale.
struct Chart<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    /// The right end of the x axis.
    x_max: f64,
    lines: [(&'a str, Vec<(f64, f64)>); 3],
    /// Mark every point with a dot.
    marks: bool,
    /// Text placed at a point.
    labels: Vec<(String, (f64, f64))>,
}

/// Latency (ms, log scale) against throughput (pairs/s), one point per client count, labelled.
pub fn latency_vs_throughput(
    path: &Path,
    title: &str,
    points: &[SweepPoint],
) -> anyhow::Result<()> {
    let line = |f: fn(&SweepPoint) -> f64| points.iter().map(|p| (p.pairs_per_sec, f(p))).collect();
    draw(
        path,
        Chart {
            title,
            x_desc: "throughput (acquire+release pairs/s)",
            y_desc: "pair latency (ms, log scale)",
            x_max: points.iter().map(|p| p.pairs_per_sec).fold(1.0, f64::max) * 1.15,
            lines: [
                ("p50", line(|p| p.p50_ms)),
                ("p99", line(|p| p.p99_ms)),
                ("p99.9", line(|p| p.p999_ms)),
            ],
            marks: true,
            // Each point's client count, above its p99.9.
            labels: points
                .iter()
                .map(|p| {
                    (
                        format!("{} clients", p.clients),
                        (p.pairs_per_sec, p.p999_ms * 1.15),
                    )
                })
                .collect(),
        },
    )
}

/// Keepalive latency (ms, log scale) per second of a hold.
pub fn keepalive_over_time(path: &Path, title: &str, seconds: &[HoldSecond]) -> anyhow::Result<()> {
    let line = |f: fn(&HoldSecond) -> f64| seconds.iter().map(|s| (s.at_s, f(s))).collect();
    draw(
        path,
        Chart {
            title,
            x_desc: "time into the hold (s)",
            y_desc: "keepalive latency (ms, log scale)",
            x_max: seconds.iter().map(|s| s.at_s).fold(1.0, f64::max),
            lines: [
                ("p50", line(|s| s.p50_ms)),
                ("p99", line(|s| s.p99_ms)),
                ("max", line(|s| s.max_ms)),
            ],
            marks: false,
            labels: Vec::new(),
        },
    )
}

fn draw(path: &Path, c: Chart<'_>) -> anyhow::Result<()> {
    let (y_min, y_max) = bounds(c.lines.iter().flat_map(|(_, xy)| xy.iter().map(|p| p.1)));
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(c.title, ("sans-serif", 22))
        .margin(16)
        .margin_right(32)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..c.x_max, (y_min..y_max).log_scale())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc(c.x_desc)
        .y_desc(c.y_desc)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(plot_error)?;
    for ((name, xy), color) in c.lines.iter().zip(COLORS) {
        chart
            .draw_series(LineSeries::new(xy.iter().copied(), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if c.marks {
            chart
                .draw_series(xy.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(plot_error)?;
        }
    }
    chart
        .draw_series(
            c.labels
                .iter()
                .map(|(text, at)| Text::new(text.clone(), *at, ("sans-serif", 13))),
        )
        .map_err(plot_error)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

/// A log-scale range that holds every value (a decade at least; latencies under 10 µs count as 10 µs).
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let lo = if lo.is_finite() && lo > 0.01 {
        lo
    } else {
        0.01
    };
    let hi = hi.max(lo * 10.0);
    (lo / 1.5, hi * 1.5)
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(e: E) -> anyhow::Error {
    anyhow::anyhow!("cannot draw the plot: {e}")
}
