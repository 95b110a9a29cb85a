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

/// One plotted line: its legend name and how it reads a point's value.
type Line<T> = (&'static str, fn(&T) -> f64);

const SIZE: (u32, u32) = (900, 560);
/// The three lines' colours: blue, red, green.
const COLORS: [RGBColor; 3] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
];

/// Latency (ms, log scale) against throughput (pairs/s), one point per client count, labelled.
pub fn latency_vs_throughput(
    path: &Path,
    title: &str,
    points: &[SweepPoint],
) -> anyhow::Result<()> {
    let x_max = points.iter().map(|p| p.pairs_per_sec).fold(1.0, f64::max) * 1.15;
    let lines: [Line<SweepPoint>; 3] = [
        ("p50", |p| p.p50_ms),
        ("p99", |p| p.p99_ms),
        ("p99.9", |p| p.p999_ms),
    ];
    let (y_min, y_max) = bounds(
        points
            .iter()
            .flat_map(|p| lines.iter().map(move |l| (l.1)(p))),
    );
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .margin_right(32)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("throughput (acquire+release pairs/s)")
        .y_desc("pair latency (ms, log scale)")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(plot_error)?;
    for (i, (name, value)) in lines.iter().enumerate() {
        let color = COLORS[i];
        let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.pairs_per_sec, value(p))).collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                xy.iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
            )
            .map_err(plot_error)?;
    }
    // Each point's client count, above its p99.9.
    chart
        .draw_series(points.iter().map(|p| {
            Text::new(
                format!("{} clients", p.clients),
                (p.pairs_per_sec, p.p999_ms * 1.15),
                ("sans-serif", 13),
            )
        }))
        .map_err(plot_error)?;
    legend(&mut chart)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

/// Keepalive latency (ms, log scale) per second of a hold.
pub fn keepalive_over_time(path: &Path, title: &str, seconds: &[HoldSecond]) -> anyhow::Result<()> {
    let x_max = seconds.iter().map(|s| s.at_s).fold(1.0, f64::max);
    let lines: [Line<HoldSecond>; 3] = [
        ("p50", |s| s.p50_ms),
        ("p99", |s| s.p99_ms),
        ("max", |s| s.max_ms),
    ];
    let (y_min, y_max) = bounds(
        seconds
            .iter()
            .flat_map(|s| lines.iter().map(move |l| (l.1)(s))),
    );
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .margin_right(32)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("time into the hold (s)")
        .y_desc("keepalive latency (ms, log scale)")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(plot_error)?;
    for (i, (name, value)) in lines.iter().enumerate() {
        let color = COLORS[i];
        chart
            .draw_series(LineSeries::new(
                seconds.iter().map(|s| (s.at_s, value(s))),
                color.stroke_width(2),
            ))
            .map_err(plot_error)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    legend(&mut chart)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
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
