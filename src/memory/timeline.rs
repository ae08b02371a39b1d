//! `Timeline`: records the event stream of the first steps of training and writes it as an
//! SVG plot, a PyTorch memory-viewer snapshot, JSON lines and a Chrome trace.

mod chrome;
mod memory_viz;
mod pickle;
mod svg;

use super::{CategoryBytes, MemoryCategory, MemoryEvent, MemoryObserver, Phase};
use crate::error::{Error, Result};
use crate::save::write_atomically;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What the x axis of the SVG plot counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimelineAxis {
    /// One unit per event, in order: allocations and frees (as PyTorch's memory viewer
    /// counts them) and ops. Every change of memory gets the same width however quickly it
    /// happened, and phases without allocations (a later step's optimizer) still show.
    #[default]
    Events,
    /// Wall time in milliseconds: long ops take room, brief phases shrink to a line.
    Time,
}

/// The settings of a [`Timeline`], as a config file spells them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct TimelineSettings {
    steps: u64,
    x_axis: TimelineAxis,
    #[serde(skip_serializing_if = "Option::is_none")]
    svg: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_viz: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    json_lines: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chrome_trace: Option<PathBuf>,
}

impl Default for TimelineSettings {
    fn default() -> Self {
        TimelineSettings {
            steps: Timeline::DEFAULT_STEPS,
            x_axis: TimelineAxis::default(),
            svg: None,
            memory_viz: None,
            json_lines: None,
            chrome_trace: None,
        }
    }
}

/// Records every [`MemoryEvent`] of the first `steps` optimizer steps (from the trainer's
/// creation on), then stops recording and writes the files it was given:
///
/// - `svg`: memory over time, stacked by [`MemoryCategory`], with a ribbon of the phases
///   (forward, loss, backward, optimizer) and the step ends marked;
/// - `memory_viz`: a pickled snapshot that PyTorch's memory viewer opens
///   (<https://pytorch.org/memory_viz>), every buffer named by its label and category;
/// - `json_lines`: one JSON object per event;
/// - `chrome_trace`: a Chrome / Perfetto trace of steps, phases and ops (with their flops)
///   and counters of memory per category.
///
/// Configurable as `[observer] kind = "timeline"` with `steps`, `x_axis` (`"events"` or
/// `"time"`) and the four paths, each optional. The `write_*` methods write any format on
/// demand, from what has been recorded so far.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(try_from = "TimelineSettings", into = "TimelineSettings")]
pub struct Timeline {
    settings: TimelineSettings,
    events: Vec<MemoryEvent>,
    steps_seen: u64,
    written: bool,
}

impl TryFrom<TimelineSettings> for Timeline {
    type Error = Error;

    fn try_from(settings: TimelineSettings) -> Result<Self> {
        if settings.steps == 0 {
            return Err(Error::config(
                "observer.steps",
                "a timeline records at least one step; use steps = 1 or more (3 shows step \
                 1, where optimizer state appears, beside steady steps)",
            ));
        }
        Ok(Timeline {
            settings,
            events: Vec::new(),
            steps_seen: 0,
            written: false,
        })
    }
}

impl From<Timeline> for TimelineSettings {
    fn from(t: Timeline) -> Self {
        t.settings
    }
}

/// File names [`Timeline::in_dir`] writes.
pub const TIMELINE_FILES: [&str; 4] = [
    "memory.svg",
    "memory_viz.pickle",
    "memory.jsonl",
    "trace.json",
];

/// The peak of total live bytes within one recorded step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPeak {
    /// The step (1-based; events before the first step count toward it).
    pub step: u64,
    /// The highest total of live bytes during the step.
    pub peak_total: u64,
    /// The breakdown by category at that moment.
    pub at_peak: CategoryBytes,
    /// The innermost phase running at that moment, if any.
    pub phase: Option<Phase>,
}

impl Timeline {
    /// Steps recorded unless told otherwise.
    pub const DEFAULT_STEPS: u64 = 3;

    /// A timeline recording `steps` optimizer steps and writing no files by itself (add
    /// paths with the `with_*` methods, or call the `write_*` methods).
    pub fn new(steps: u64) -> Result<Self> {
        Timeline::try_from(TimelineSettings {
            steps,
            ..TimelineSettings::default()
        })
    }

    /// A timeline recording `steps` steps that then writes the four outputs into `dir`
    /// (created if needed) under the names of [`TIMELINE_FILES`].
    pub fn in_dir(dir: impl AsRef<Path>, steps: u64) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let [svg, viz, jsonl, trace] = TIMELINE_FILES;
        Ok(Timeline::new(steps)?
            .with_svg(dir.join(svg))
            .with_memory_viz(dir.join(viz))
            .with_json_lines(dir.join(jsonl))
            .with_chrome_trace(dir.join(trace)))
    }

    /// Writes the SVG plot to `path` once the steps are recorded.
    pub fn with_svg(mut self, path: impl Into<PathBuf>) -> Self {
        self.settings.svg = Some(path.into());
        self
    }

    /// Writes the memory-viewer pickle to `path` once the steps are recorded.
    pub fn with_memory_viz(mut self, path: impl Into<PathBuf>) -> Self {
        self.settings.memory_viz = Some(path.into());
        self
    }

    /// Writes the JSON lines to `path` once the steps are recorded.
    pub fn with_json_lines(mut self, path: impl Into<PathBuf>) -> Self {
        self.settings.json_lines = Some(path.into());
        self
    }

    /// Writes the Chrome trace to `path` once the steps are recorded.
    pub fn with_chrome_trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.settings.chrome_trace = Some(path.into());
        self
    }

    /// Sets what the SVG's x axis counts.
    pub fn with_x_axis(mut self, axis: TimelineAxis) -> Self {
        self.settings.x_axis = axis;
        self
    }

    /// Optimizer steps this timeline records.
    pub fn steps(&self) -> u64 {
        self.settings.steps
    }

    /// Step ends seen so far (at most [`Timeline::steps`]).
    pub fn steps_recorded(&self) -> u64 {
        self.steps_seen
    }

    /// Whether all the steps are recorded (later events are ignored).
    pub fn is_complete(&self) -> bool {
        self.steps_seen >= self.settings.steps
    }

    /// The recorded events, in order.
    pub fn events(&self) -> &[MemoryEvent] {
        &self.events
    }

    /// The peak of total live bytes in each recorded step (a step still running when
    /// recording stopped is included).
    pub fn step_peaks(&self) -> Vec<StepPeak> {
        let mut out = Vec::new();
        let mut walk = Walk::default();
        let mut current = StepPeak {
            step: 1,
            peak_total: 0,
            at_peak: CategoryBytes::default(),
            phase: None,
        };
        let mut any = false;
        for e in &self.events {
            walk.apply(e);
            any = true;
            if walk.live.total() > current.peak_total {
                current.peak_total = walk.live.total();
                current.at_peak = walk.live;
                current.phase = walk.phases.last().copied();
            }
            if let MemoryEvent::StepEnd { step, .. } = e {
                current.step = *step;
                out.push(current);
                any = false;
                current = StepPeak {
                    step: step + 1,
                    peak_total: walk.live.total(),
                    at_peak: walk.live,
                    phase: None,
                };
            }
        }
        if any {
            out.push(current);
        }
        out
    }

    /// The SVG plot of memory over time, as a string.
    pub fn render_svg(&self) -> Result<String> {
        svg::render(&self.events, self.settings.x_axis)
    }

    /// The pickled snapshot for PyTorch's memory viewer.
    pub fn render_memory_viz(&self) -> Vec<u8> {
        memory_viz::render(&self.events)
    }

    /// One JSON object per event, each on its own line.
    pub fn render_json_lines(&self) -> Result<String> {
        let mut out = String::new();
        for e in &self.events {
            out.push_str(&serde_json::to_string(e).map_err(|e| Error::Serde(e.to_string()))?);
            out.push('\n');
        }
        Ok(out)
    }

    /// The Chrome trace (`{"traceEvents": [...]}`) as a JSON value.
    pub fn render_chrome_trace(&self) -> serde_json::Value {
        chrome::render(&self.events)
    }

    /// Writes the SVG plot to `path` (atomically; parent directories are created).
    pub fn write_svg(&self, path: impl AsRef<Path>) -> Result<()> {
        write_file(path.as_ref(), self.render_svg()?.as_bytes())
    }

    /// Writes the memory-viewer pickle to `path`; open it by dropping it on
    /// <https://pytorch.org/memory_viz>.
    pub fn write_memory_viz(&self, path: impl AsRef<Path>) -> Result<()> {
        write_file(path.as_ref(), &self.render_memory_viz())
    }

    /// Writes the events as JSON lines to `path`.
    pub fn write_json_lines(&self, path: impl AsRef<Path>) -> Result<()> {
        write_file(path.as_ref(), self.render_json_lines()?.as_bytes())
    }

    /// Writes the Chrome trace to `path`; open it in <https://ui.perfetto.dev> or
    /// `chrome://tracing`.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> Result<()> {
        let json = serde_json::to_vec(&self.render_chrome_trace())
            .map_err(|e| Error::Serde(e.to_string()))?;
        write_file(path.as_ref(), &json)
    }

    /// Writes every configured output now, from what has been recorded, and returns the
    /// paths written.
    pub fn write_outputs(&self) -> Result<Vec<PathBuf>> {
        let s = &self.settings;
        let mut written = Vec::new();
        if let Some(p) = &s.svg {
            self.write_svg(p)?;
            written.push(p.clone());
        }
        if let Some(p) = &s.memory_viz {
            self.write_memory_viz(p)?;
            written.push(p.clone());
        }
        if let Some(p) = &s.json_lines {
            self.write_json_lines(p)?;
            written.push(p.clone());
        }
        if let Some(p) = &s.chrome_trace {
            self.write_chrome_trace(p)?;
            written.push(p.clone());
        }
        Ok(written)
    }
}

#[typetag::serde(name = "timeline")]
impl MemoryObserver for Timeline {
    fn on_event(&mut self, event: &MemoryEvent) {
        if self.is_complete() {
            return;
        }
        self.events.push(event.clone());
        if let MemoryEvent::StepEnd { .. } = event {
            self.steps_seen += 1;
        }
        if self.is_complete() && !self.written {
            self.written = true;
            match self.write_outputs() {
                Ok(paths) if paths.is_empty() => {}
                Ok(paths) => {
                    let names: Vec<String> =
                        paths.iter().map(|p| p.display().to_string()).collect();
                    log::info!(
                        "memory timeline of {} steps written to {}",
                        self.steps_seen,
                        names.join(", ")
                    );
                }
                Err(e) => log::error!("memory timeline not written: {e}"),
            }
        }
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    write_atomically(path, bytes)
}

/// The four groups of phases the plots shade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PhaseGroup {
    Forward,
    Loss,
    Backward,
    Optimizer,
}

impl PhaseGroup {
    const ALL: [PhaseGroup; 4] = [
        PhaseGroup::Forward,
        PhaseGroup::Loss,
        PhaseGroup::Backward,
        PhaseGroup::Optimizer,
    ];

    fn of(phase: Phase) -> Option<PhaseGroup> {
        match phase {
            Phase::MicroBatch(_) => None,
            Phase::Embedding | Phase::Forward(_) => Some(PhaseGroup::Forward),
            Phase::Loss => Some(PhaseGroup::Loss),
            Phase::Backward(_) | Phase::EmbeddingBackward => Some(PhaseGroup::Backward),
            Phase::Optimizer => Some(PhaseGroup::Optimizer),
        }
    }

    fn name(self) -> &'static str {
        match self {
            PhaseGroup::Forward => "forward",
            PhaseGroup::Loss => "loss",
            PhaseGroup::Backward => "backward",
            PhaseGroup::Optimizer => "optimizer",
        }
    }
}

/// Live bytes, open phases and the step, followed event by event.
#[derive(Clone, Debug, Default)]
struct Walk {
    live: CategoryBytes,
    phases: Vec<Phase>,
    steps_done: u64,
    /// Whether any phase has begun yet (events before are the setup).
    started: bool,
}

impl Walk {
    fn apply(&mut self, e: &MemoryEvent) {
        match e {
            MemoryEvent::Alloc {
                category, bytes, ..
            } => *self.live.get_mut(*category) += bytes,
            MemoryEvent::Free {
                category, bytes, ..
            } => {
                let live = self.live.get_mut(*category);
                *live = live.saturating_sub(*bytes);
            }
            MemoryEvent::PhaseBegin { phase, .. } => {
                self.started = true;
                self.phases.push(*phase);
            }
            MemoryEvent::PhaseEnd { phase, .. } => {
                if let Some(i) = self.phases.iter().rposition(|p| p == phase) {
                    self.phases.truncate(i);
                }
            }
            MemoryEvent::StepEnd { .. } => {
                self.steps_done += 1;
                self.phases.clear();
            }
            MemoryEvent::Op { .. } => {}
        }
    }

    /// Where the stream is: `setup`, `step 2`, or `step 2, micro-batch 0, forward 1`.
    fn context(&self) -> String {
        if !self.started && self.steps_done == 0 {
            return "setup".to_string();
        }
        let mut s = format!("step {}", self.steps_done + 1);
        for p in &self.phases {
            s.push_str(&format!(", {p}"));
        }
        s
    }
}

/// The time of an event, in microseconds since the ledger was created.
fn time_us(e: &MemoryEvent) -> u64 {
    match e {
        MemoryEvent::Alloc { time_us, .. }
        | MemoryEvent::Free { time_us, .. }
        | MemoryEvent::PhaseBegin { time_us, .. }
        | MemoryEvent::PhaseEnd { time_us, .. }
        | MemoryEvent::Op { time_us, .. }
        | MemoryEvent::StepEnd { time_us, .. } => *time_us,
    }
}

/// A category's name and label as the outputs show a buffer: `h.3.qkv (activations)`.
fn buffer_name(label: &str, category: MemoryCategory) -> String {
    format!("{label} ({category})")
}
