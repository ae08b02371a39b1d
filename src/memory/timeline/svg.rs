//! The SVG plot: live memory stacked by category, a ribbon of the phases above it, and a
//! line at each step end.

use super::{PhaseGroup, TimelineAxis, Walk};
use crate::error::{Error, Result};
use crate::memory::{format_bytes, CategoryBytes, MemoryCategory, MemoryEvent};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Above this many memory changes the plot keeps, per slice of the x axis, the moment
/// of highest total (peaks survive, the file stays small).
const MAX_SAMPLES: usize = 4000;
const WIDTH: u32 = 1280;
const HEIGHT: u32 = 640;
const LEGEND_WIDTH: u32 = 210;

fn category_color(c: MemoryCategory) -> RGBColor {
    match c {
        MemoryCategory::Weights => RGBColor(78, 121, 167),
        MemoryCategory::MasterWeights => RGBColor(118, 183, 178),
        MemoryCategory::Gradients => RGBColor(242, 142, 44),
        MemoryCategory::OptimizerState => RGBColor(225, 87, 89),
        MemoryCategory::Activations => RGBColor(89, 161, 79),
        MemoryCategory::Workspace => RGBColor(237, 201, 73),
        MemoryCategory::Offloaded => RGBColor(186, 176, 172),
        MemoryCategory::Streamed => RGBColor(156, 117, 95),
    }
}

fn phase_color(g: PhaseGroup) -> RGBColor {
    match g {
        PhaseGroup::Forward => RGBColor(107, 174, 214),
        PhaseGroup::Loss => RGBColor(158, 154, 200),
        PhaseGroup::Backward => RGBColor(214, 150, 120),
        PhaseGroup::Optimizer => RGBColor(99, 99, 99),
    }
}

/// Live bytes after a memory change at `x` (the events so far, or milliseconds).
struct Sample {
    x: f64,
    live: CategoryBytes,
}

/// What the plot shows, in x-axis units.
struct Layout {
    samples: Vec<Sample>,
    /// Runs of one phase group: (group, begin, end).
    phases: Vec<(PhaseGroup, f64, f64)>,
    /// Step ends: (step, x).
    steps: Vec<(u64, f64)>,
    x_end: f64,
    /// The device's peak total.
    peak: u64,
    /// The most host memory held for the device at once (offloaded activations).
    host_peak: u64,
}

fn layout(events: &[MemoryEvent], axis: TimelineAxis) -> Layout {
    let t0 = events.first().map(super::time_us).unwrap_or(0);
    // Events so far: allocations, frees and ops.
    let mut changes = 0u64;
    let x_of = |e: &MemoryEvent, changes: u64| match axis {
        TimelineAxis::Events => changes as f64,
        TimelineAxis::Time => super::time_us(e).saturating_sub(t0) as f64 / 1000.0,
    };
    let mut walk = Walk::default();
    let mut samples = vec![Sample {
        x: 0.0,
        live: CategoryBytes::default(),
    }];
    let mut phases: Vec<(PhaseGroup, f64, f64)> = Vec::new();
    let mut open_group: Option<PhaseGroup> = None;
    let mut steps = Vec::new();
    let mut x_end: f64 = 0.0;
    let mut peak = 0;
    let mut host_peak = 0;
    for e in events {
        walk.apply(e);
        match e {
            MemoryEvent::Alloc { .. } | MemoryEvent::Free { .. } => {
                changes += 1;
                let x = x_of(e, changes);
                samples.push(Sample { x, live: walk.live });
                peak = peak.max(walk.live.total());
                host_peak = host_peak.max(walk.live.host());
            }
            MemoryEvent::PhaseBegin { phase, .. } => {
                if let Some(g) = PhaseGroup::of(*phase) {
                    let x = x_of(e, changes);
                    match phases.last_mut() {
                        // The same group again with no other between: one run.
                        Some(run) if run.0 == g && open_group.is_none() => run.2 = x,
                        _ => phases.push((g, x, x)),
                    }
                    open_group = Some(g);
                }
            }
            MemoryEvent::PhaseEnd { phase, .. } => {
                if let (Some(g), Some(run)) = (PhaseGroup::of(*phase), phases.last_mut()) {
                    if run.0 == g {
                        run.2 = x_of(e, changes);
                        open_group = None;
                    }
                }
            }
            MemoryEvent::StepEnd { step, .. } => {
                steps.push((*step, x_of(e, changes)));
                open_group = None;
            }
            MemoryEvent::Op {
                time_us,
                duration_us,
                ..
            } => {
                // Ops take room on the event axis too, so phases without allocations (the
                // optimizer of later steps) stay visible.
                changes += 1;
                if axis == TimelineAxis::Time {
                    let end = (time_us + duration_us).saturating_sub(t0) as f64 / 1000.0;
                    x_end = x_end.max(end);
                    continue;
                }
            }
        }
        x_end = x_end.max(x_of(e, changes));
    }
    Layout {
        samples: thin(samples, x_end),
        phases,
        steps,
        x_end: if x_end > 0.0 { x_end } else { 1.0 },
        peak,
        host_peak,
    }
}

/// At most about [`MAX_SAMPLES`] samples: per slice of the axis, the one of highest total.
fn thin(samples: Vec<Sample>, x_end: f64) -> Vec<Sample> {
    if samples.len() <= MAX_SAMPLES || x_end <= 0.0 {
        return samples;
    }
    let width = x_end / MAX_SAMPLES as f64;
    let mut out: Vec<Sample> = Vec::with_capacity(MAX_SAMPLES + 1);
    let mut slice = None;
    for s in samples {
        let k = (s.x / width) as u64;
        match out.last_mut() {
            Some(last) if slice == Some(k) => {
                if s.live.total() > last.live.total() {
                    *last = s;
                }
            }
            _ => {
                slice = Some(k);
                out.push(s);
            }
        }
    }
    out
}

/// The unit that shows `bytes` as a number of at least 1: (name, bytes per unit).
fn unit(bytes: u64) -> (&'static str, f64) {
    const K: f64 = 1024.0;
    match bytes as f64 {
        b if b >= K * K * K => ("GiB", K * K * K),
        b if b >= K * K => ("MiB", K * K),
        b if b >= K => ("KiB", K),
        _ => ("bytes", 1.0),
    }
}

/// A tick label: no trailing `.0`, at most three decimals.
fn number(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn draw_error<E: std::error::Error>(e: E) -> Error {
    Error::Serde(format!("drawing the memory plot: {e}"))
}

/// The plot of `events`.
pub(super) fn render(events: &[MemoryEvent], axis: TimelineAxis) -> Result<String> {
    let l = layout(events, axis);
    let (unit_name, per_unit) = unit(l.peak.max(l.host_peak));
    let top = (l.peak.max(l.host_peak) as f64 / per_unit).max(1e-9) * 1.2;
    let ribbon = (top * 0.935, top * 0.985);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let (plot_area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
        let steps = l.steps.len();
        let caption = format!(
            "trainkit memory: {} step{}, peak {}",
            steps,
            if steps == 1 { "" } else { "s" },
            format_bytes(l.peak)
        );
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(caption, ("sans-serif", 24))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..l.x_end, 0.0..top)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc(match axis {
                TimelineAxis::Events => "events in order (allocations, frees and ops)",
                TimelineAxis::Time => "time (ms)",
            })
            .y_desc(format!("live memory ({unit_name})"))
            .x_label_formatter(&|x| number(*x))
            .y_label_formatter(&|y| number(*y))
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 14))
            .light_line_style(WHITE)
            .bold_line_style(RGBColor(225, 225, 225))
            .draw()
            .map_err(draw_error)?;

        // The stacked areas, each a polygon between two cumulative step functions: the
        // device's categories (host memory held for it is not device memory).
        let device: Vec<MemoryCategory> = MemoryCategory::ALL
            .into_iter()
            .filter(|c| c.on_device())
            .collect();
        let cumulative: Vec<Vec<f64>> = l
            .samples
            .iter()
            .map(|s| {
                let mut c = vec![0.0; device.len() + 1];
                for (i, cat) in device.iter().enumerate() {
                    c[i + 1] = c[i] + s.live.get(*cat) as f64 / per_unit;
                }
                c
            })
            .collect();
        let edge = |b: usize| -> Vec<(f64, f64)> {
            let mut pts = Vec::with_capacity(2 * l.samples.len() + 1);
            for (j, s) in l.samples.iter().enumerate() {
                if j > 0 {
                    pts.push((s.x, cumulative[j - 1][b]));
                }
                pts.push((s.x, cumulative[j][b]));
            }
            if let Some(last) = cumulative.last() {
                pts.push((l.x_end, last[b]));
            }
            pts
        };
        for (i, cat) in device.iter().enumerate() {
            let mut pts = edge(i + 1);
            pts.extend(edge(i).into_iter().rev());
            chart
                .draw_series(std::iter::once(Polygon::new(
                    pts,
                    category_color(*cat).filled(),
                )))
                .map_err(draw_error)?;
        }

        // Host memory held for the device: a line over the stacked areas for each of its
        // categories (offloaded, streamed).
        if l.host_peak > 0 {
            for cat in MemoryCategory::ALL.into_iter().filter(|c| !c.on_device()) {
                if l.samples.iter().all(|s| s.live.get(cat) == 0) {
                    continue;
                }
                let mut pts = Vec::with_capacity(2 * l.samples.len() + 1);
                for (j, s) in l.samples.iter().enumerate() {
                    let y = |k: usize| l.samples[k].live.get(cat) as f64 / per_unit;
                    if j > 0 {
                        pts.push((s.x, y(j - 1)));
                    }
                    pts.push((s.x, y(j)));
                }
                if let Some(last) = l.samples.last() {
                    pts.push((l.x_end, last.live.get(cat) as f64 / per_unit));
                }
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        pts,
                        category_color(cat).stroke_width(3),
                    )))
                    .map_err(draw_error)?;
            }
        }

        // The phase ribbon.
        chart
            .draw_series(l.phases.iter().map(|(g, a, b)| {
                Rectangle::new([(*a, ribbon.0), (*b, ribbon.1)], phase_color(*g).filled())
            }))
            .map_err(draw_error)?;

        // Step ends.
        let label_style = TextStyle::from(("sans-serif", 15))
            .color(&BLACK)
            .pos(Pos::new(HPos::Right, VPos::Top));
        for (step, x) in &l.steps {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(*x, 0.0), (*x, top)],
                    BLACK.stroke_width(1),
                )))
                .map_err(draw_error)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("step {step} "),
                    (*x, ribbon.0 * 0.99),
                    label_style.clone(),
                )))
                .map_err(draw_error)?;
        }

        // The legend, beside the plot.
        let text = TextStyle::from(("sans-serif", 17)).color(&BLACK);
        let mut y = 60;
        let item = |color: RGBColor, name: &str, y: i32| -> Result<()> {
            legend_area
                .draw(&Rectangle::new([(10, y), (28, y + 14)], color.filled()))
                .map_err(draw_error)?;
            legend_area
                .draw_text(name, &text, (36, y))
                .map_err(draw_error)?;
            Ok(())
        };
        legend_area
            .draw_text("memory", &text, (10, y - 24))
            .map_err(draw_error)?;
        // Host memory first (drawn as lines), then the device's stack, top down.
        for cat in MemoryCategory::ALL.into_iter().filter(|c| !c.on_device()) {
            item(category_color(cat), cat.name(), y)?;
            y += 22;
        }
        for cat in device.iter().rev() {
            item(category_color(*cat), cat.name(), y)?;
            y += 22;
        }
        y += 30;
        legend_area
            .draw_text("phases (top ribbon)", &text, (10, y - 24))
            .map_err(draw_error)?;
        for g in PhaseGroup::ALL {
            item(phase_color(g), g.name(), y)?;
            y += 22;
        }
        y += 8;
        legend_area
            .draw(&PathElement::new(
                vec![(19, y - 2), (19, y + 16)],
                BLACK.stroke_width(1),
            ))
            .map_err(draw_error)?;
        legend_area
            .draw_text("step end", &text, (36, y))
            .map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    Ok(svg)
}
