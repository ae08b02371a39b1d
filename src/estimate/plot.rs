//! The playbook's "activation explosion" figure: activation memory against sequence
//! length for each recompute policy, beside the model state, as an SVG file: trainkit's
//! exact figures (meta runs of the model it builds) where it has them, with the playbook's
//! formula drawn dashed beside them for reference.

use super::formulas::ActivationShape;
use crate::checkpoint::by_cost;
use crate::error::{Error, Result};
use crate::precision::Precision;
use crate::save::write_atomically;
use plotters::prelude::*;
use std::path::Path;

/// Points per doubling of the sequence length.
const STEPS_PER_OCTAVE: u32 = 4;

/// Activation bytes of each recompute policy over a range of sequence lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationSweep {
    /// Sequence lengths, increasing (powers of two and points between them).
    pub seq_lens: Vec<u64>,
    /// Activation bytes per sequence length, for each shipped recompute policy (by its
    /// `kind`, in the order of [`crate::checkpoint::by_cost`]): the formula's from
    /// [`ActivationSweep::new`], trainkit's exact ones after [`ActivationSweep::with_exact`].
    pub curves: Vec<(String, Vec<u64>)>,
    /// The formula's curves, drawn dashed, when `curves` are trainkit's exact figures.
    pub reference: Vec<(String, Vec<u64>)>,
    /// Model-state bytes (weights, gradients, master weights, optimizer state): the
    /// horizontal line activations are compared with.
    pub model_state: u64,
}

impl ActivationSweep {
    /// The sequence lengths a sweep around `seq_len` covers: from a quarter of it to 8 times
    /// it, rounded up to powers of two (1k to 32k around 4096).
    pub fn default_range(seq_len: u64) -> (u64, u64) {
        let top = seq_len
            .max(1)
            .checked_next_power_of_two()
            .unwrap_or(1 << 63)
            .min(1 << 40);
        (top.div_ceil(4).max(1), top.saturating_mul(8))
    }

    /// Activation bytes of every policy for `shape` (its `seq_len` replaced) at sequence
    /// lengths from `min_seq` to `max_seq`, four points per doubling.
    pub fn new(
        shape: ActivationShape,
        precision: &dyn Precision,
        model_state: u64,
        min_seq: u64,
        max_seq: u64,
    ) -> Result<Self> {
        if min_seq == 0 || max_seq < min_seq {
            return Err(Error::config(
                "seq_len",
                format!("the range {min_seq}..{max_seq} is empty; use 1 <= min <= max"),
            ));
        }
        let octaves = (max_seq as f64 / min_seq as f64).log2();
        let points = (octaves * STEPS_PER_OCTAVE as f64).round() as u32;
        let mut seq_lens: Vec<u64> = (0..=points)
            .map(|i| {
                let s = min_seq as f64 * 2f64.powf(i as f64 / STEPS_PER_OCTAVE as f64);
                (s.round() as u64).clamp(min_seq, max_seq)
            })
            .collect();
        seq_lens.dedup();
        let mut curves = Vec::new();
        for policy in by_cost() {
            let bytes = seq_lens
                .iter()
                .map(|&seq_len| {
                    ActivationShape { seq_len, ..shape }.bytes(policy.as_ref(), precision)
                })
                .collect::<Result<Vec<u64>>>()?;
            curves.push((policy.typetag_name().to_string(), bytes));
        }
        Ok(ActivationSweep {
            seq_lens,
            curves,
            reference: Vec::new(),
            model_state,
        })
    }

    /// The sweep with `exact(policy, seq_len)`'s bytes as its curves (trainkit's exact
    /// figures) and the formula's kept as the dashed reference; unchanged (the formula
    /// alone) when `exact` has no figure for some point (`Ok(None)`).
    pub fn with_exact(
        mut self,
        mut exact: impl FnMut(&dyn crate::checkpoint::CheckpointPolicy, u64) -> Result<Option<u64>>,
    ) -> Result<Self> {
        let mut curves = Vec::new();
        for policy in by_cost() {
            let mut ys = Vec::with_capacity(self.seq_lens.len());
            for &s in &self.seq_lens {
                match exact(policy.as_ref(), s)? {
                    Some(b) => ys.push(b),
                    None => return Ok(self),
                }
            }
            curves.push((policy.typetag_name().to_string(), ys));
        }
        self.reference = std::mem::replace(&mut self.curves, curves);
        Ok(self)
    }

    /// Whether the curves are trainkit's exact figures ([`ActivationSweep::with_exact`]).
    pub fn is_exact(&self) -> bool {
        !self.reference.is_empty()
    }

    /// Draws the sweep as an SVG line chart (GiB against sequence length on a log2 axis)
    /// titled `title`, and writes it to `path` (atomically).
    pub fn write_svg(&self, path: &Path, title: &str) -> Result<()> {
        write_atomically(path, self.to_svg(title)?.as_bytes())
    }

    /// The SVG text of [`ActivationSweep::write_svg`].
    pub fn to_svg(&self, title: &str) -> Result<String> {
        let fail = |e: &dyn std::fmt::Display| Error::Backend {
            backend: "svg",
            message: format!("drawing the plot failed: {e}"),
        };
        let (first, last) = match (self.seq_lens.first(), self.seq_lens.last()) {
            (Some(&a), Some(&b)) => (a as f64, b as f64),
            _ => return Err(fail(&"no sequence lengths to plot")),
        };
        let (x0, x1) = (first.log2(), last.log2().max(first.log2() + 1.0));
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let top = self
            .curves
            .iter()
            .flat_map(|(_, ys)| ys.iter().copied())
            .chain([self.model_state])
            .map(gib)
            .fold(0.0, f64::max);
        let y1 = if top > 0.0 { top * 1.08 } else { 1.0 };

        let mut svg = String::new();
        let root = SVGBackend::with_string(&mut svg, (1100, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 15))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, 0f64..y1)
            .map_err(|e| fail(&e))?;
        let octaves = (x1 - x0).round() as usize;
        let label = |x: &f64| {
            if (x - x.round()).abs() > 1e-6 {
                return String::new();
            }
            let s = 2f64.powf(x.round()) as u64;
            if s >= 1024 && s % 1024 == 0 {
                format!("{}k", s / 1024)
            } else {
                s.to_string()
            }
        };
        let y_label = |y: &f64| {
            if y1 >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.2}")
            }
        };
        chart
            .configure_mesh()
            .x_labels(octaves + 1)
            .x_label_formatter(&label)
            .y_label_formatter(&y_label)
            .x_desc("sequence length (tokens, log2 scale)")
            .y_desc("activation memory (GiB)")
            .draw()
            .map_err(|e| fail(&e))?;
        let colors = [RED, BLUE, RGBColor(0, 150, 0)];
        let exact = if self.is_exact() {
            ", exact"
        } else {
            ", formula"
        };
        for ((policy, ys), color) in self.curves.iter().zip(colors) {
            let points = self
                .seq_lens
                .iter()
                .zip(ys)
                .map(|(&s, &b)| ((s as f64).log2(), gib(b)));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(format!("recompute {policy}{exact}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        // The formula's curves run to the top of the chart, which the exact figures set
        // (the formula's materialized attention reaches far above them).
        for ((policy, ys), color) in self.reference.iter().zip(colors) {
            let points = clip_to(
                self.seq_lens
                    .iter()
                    .zip(ys)
                    .map(|(&s, &b)| ((s as f64).log2(), gib(b))),
                y1,
            );
            chart
                .draw_series(DashedLineSeries::new(points, 6, 4, color.stroke_width(1)))
                .map_err(|e| fail(&e))?
                .label(format!("recompute {policy}, playbook formula"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], color.stroke_width(1))
                });
        }
        let state = gib(self.model_state);
        chart
            .draw_series(LineSeries::new(
                [(x0, state), (x1, state)],
                BLACK.stroke_width(1),
            ))
            .map_err(|e| fail(&e))?
            .label(format!("model state ({state:.1} GiB)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
        drop(chart);
        drop(root);
        Ok(svg)
    }
}

/// The points of a line up to where it leaves the top `y1` of the chart, with the point
/// where it crosses it.
fn clip_to(points: impl Iterator<Item = (f64, f64)>, y1: f64) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (x, y) in points {
        if y <= y1 {
            out.push((x, y));
            continue;
        }
        if let Some(&(x0, y0)) = out.last() {
            out.push((x0 + (x - x0) * (y1 - y0) / (y - y0), y1));
        }
        break;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_around_the_sequence_length() {
        assert_eq!(ActivationSweep::default_range(4096), (1024, 32768));
        assert_eq!(ActivationSweep::default_range(1024), (256, 8192));
        assert_eq!(ActivationSweep::default_range(1000), (256, 8192));
        assert_eq!(ActivationSweep::default_range(1), (1, 8));
        let (lo, hi) = ActivationSweep::default_range(u64::MAX);
        assert!(lo <= hi);
    }

    #[test]
    fn sweeps_cover_every_policy_and_grow() {
        let shape = ActivationShape {
            layers: 2,
            hidden: 64,
            heads: 4,
            seq_len: 0,
            micro_batch: 1,
        };
        let bf16 = crate::precision::MixedBf16 { fp32_grads: false };
        let sweep = ActivationSweep::new(shape, &bf16, 1 << 20, 256, 8192).unwrap();
        assert_eq!(sweep.seq_lens.first(), Some(&256));
        assert_eq!(sweep.seq_lens.last(), Some(&8192));
        assert_eq!(sweep.seq_lens.len(), 21);
        assert_eq!(sweep.curves.len(), 3);
        for (_, ys) in &sweep.curves {
            assert!(ys.windows(2).all(|w| w[0] < w[1]));
        }
        let svg = sweep.to_svg("tiny").unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("recompute selective, formula"));
        assert!(!sweep.is_exact());
        // Exact figures take the curves' place; the formula stays, dashed.
        let exact = sweep.clone().with_exact(|_, s| Ok(Some(s * 1000))).unwrap();
        assert!(exact.is_exact());
        assert_eq!(exact.reference, sweep.curves);
        assert_eq!(exact.curves[2].1[0], 256_000);
        let svg = exact.to_svg("tiny").unwrap();
        assert!(svg.contains("recompute full, exact") && svg.contains("playbook formula"));
        assert_eq!(
            clip_to([(0.0, 1.0), (1.0, 3.0), (2.0, 9.0)].into_iter(), 2.0),
            [(0.0, 1.0), (0.5, 2.0)]
        );
        // A missing exact figure leaves the formula alone.
        let partial = sweep
            .clone()
            .with_exact(|_, s| Ok((s < 4096).then_some(s)))
            .unwrap();
        assert_eq!(partial, sweep);
        assert!(ActivationSweep::new(shape, &bf16, 0, 0, 8).is_err());
        assert!(ActivationSweep::new(shape, &bf16, 0, 16, 8).is_err());
    }
}
