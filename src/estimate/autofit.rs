//! Autofit: the cheapest setup that fits a memory budget, chosen with the exact memory
//! model among micro-batch and accumulation, recomputation (selective, a byte budget,
//! full), 8-bit AdamW state, the optimizer inside backward, activation offloading, the
//! optimizer offloaded to the host and bf16 precision, and, when named, pure bf16, LoRA and
//! QLoRA, in the cost order of [`Technique`].

use super::exact::{predict_rank, MemoryPrediction, MicroBatch, HOST_LINK_BYTES_PER_S};
use super::techniques::{Technique, Techniques};
use crate::adapter::{Adapter, Lora, ALL_LINEAR};
use crate::checkpoint::{Budget, CheckpointPolicy, Full, NoRecompute, Selective};
use crate::error::{Error, Result};
use crate::memory::{format_bytes, MemoryCategory};
use crate::model::Shape;
use crate::ops::update_rounding::UpdateRounding;
use crate::ops::{AttentionPath, LossPath};
use crate::optim::Optimizer;
use crate::placement::WeightPlacement;
use crate::precision::{MixedBf16, Precision, PureBf16};
use crate::trainer::TrainerOptions;
use std::sync::Arc;

/// What autofit is asked to fit.
#[derive(Clone, Copy, Debug)]
pub struct FitRequest<'a> {
    /// The model.
    pub model: Shape,
    /// Tokens per row.
    pub seq_len: usize,
    /// Rows per optimizer step: micro-batch size × accumulation steps.
    pub global_batch: usize,
    /// Device bytes the run may use at its peak.
    pub budget: u64,
    /// The run's precision: kept, unless autofit may use [`Technique::Bf16`] and it is
    /// fp32.
    pub precision: &'a (dyn Precision + 'static),
    /// The run's optimizer: kept, unless autofit may use [`Technique::Adamw8bit`] and it
    /// is AdamW (whose settings the 8-bit one then takes).
    pub optimizer: &'a (dyn Optimizer + 'static),
    /// The run's recompute policy: kept when autofit may use none of
    /// [`Technique::Selective`], [`Technique::Budget`] and [`Technique::Full`]; otherwise
    /// autofit starts from no recomputation and chooses.
    pub recompute: &'a (dyn CheckpointPolicy + 'static),
    /// How the model computes attention (the run's `training.attention`).
    pub attention: AttentionPath,
    /// How the model computes the loss (the run's `training.loss`).
    pub loss: LossPath,
    /// Positions per chunk of the fused loss (the run's `training.loss_chunk`; `None`:
    /// chosen from the vocabulary).
    pub loss_chunk: Option<usize>,
    /// The techniques autofit may use; of these it uses those the rest of the request
    /// allows ([`FitPlan::left_out`] says why it leaves any out).
    pub techniques: Techniques,
    /// The run's global-norm clipping threshold (0 = off). The optimizer inside backward
    /// cannot clip by the global norm, so autofit uses it only when this is 0.
    pub grad_clip: f32,
    /// The run updates inside backward already: kept on (one micro-batch per step).
    pub optimizer_in_backward: bool,
    /// The run offloads its kept activations already: kept on.
    pub offload_activations: bool,
    /// The run keeps its master weights and optimizer state in host memory already
    /// ([`TrainerOptions::optimizer_offload`]): kept on.
    pub optimizer_offload: bool,
    /// The run's placement ([`TrainerOptions::placement`]): one that streams stays on, and
    /// a setup streaming weights uses it; with [`crate::placement::Resident`] such a setup
    /// streams the frozen base ([`crate::placement::StreamFrozen`]), or every weight beside
    /// the optimizer on the host ([`crate::placement::StreamAll`]).
    pub placement: &'a (dyn WeightPlacement + 'static),
    /// Host memory the setup may take: offloaded activations, and an offloaded
    /// optimizer's master weights and state (`None`: not checked).
    pub host_budget: Option<u64>,
    /// The run's adapter (LoRA): which parameters train, the updates it adds (`None`:
    /// every parameter trains).
    pub adapter: Option<&'a (dyn Adapter + 'static)>,
    /// Ranks of the run's data-parallel job (1: one process): the figures are one rank's
    /// (under ZeRO the heaviest, [`crate::trainer::heaviest_rank`]), and the global batch
    /// is one rank's.
    pub world: usize,
    /// The run's ZeRO stage ([`TrainerOptions::zero_stage`]): under 1 and 2 a rank keeps
    /// its share of the optimizer side, under 2 of the gradients too.
    pub zero_stage: u8,
    /// The run accumulates each micro-batch's gradients apart
    /// ([`TrainerOptions::separate_accumulation`]).
    pub separate_accumulation: bool,
    /// The run's gradient buckets ([`TrainerOptions::bucket_bytes`]): 0 (each gradient
    /// summed after backward) rules ZeRO-2 out, whose frees need the buckets.
    pub bucket_bytes: usize,
}

impl<'a> FitRequest<'a> {
    /// A request with the defaults of a run: fused attention and loss, no recomputation,
    /// clipping at [`TrainerOptions::default`]'s threshold, neither the optimizer inside
    /// backward nor any offloading, every technique allowed, host memory unchecked.
    pub fn new(
        model: Shape,
        seq_len: usize,
        global_batch: usize,
        budget: u64,
        precision: &'a (dyn Precision + 'static),
        optimizer: &'a (dyn Optimizer + 'static),
    ) -> Self {
        FitRequest {
            model,
            seq_len,
            global_batch,
            budget,
            precision,
            optimizer,
            recompute: &NoRecompute,
            attention: AttentionPath::Fused,
            loss: LossPath::Fused,
            loss_chunk: None,
            techniques: Techniques::ALL,
            grad_clip: TrainerOptions::default().grad_clip,
            optimizer_in_backward: false,
            offload_activations: false,
            optimizer_offload: false,
            placement: &crate::placement::Resident,
            host_budget: None,
            adapter: None,
            world: 1,
            zero_stage: 0,
            separate_accumulation: false,
            bucket_bytes: TrainerOptions::default().bucket_bytes,
        }
    }
}

/// One setup autofit considered, with its exact memory.
#[derive(Clone, Debug)]
pub struct FitCandidate {
    /// Rows per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// The precision.
    pub precision: Box<dyn Precision>,
    /// The recompute policy.
    pub recompute: Box<dyn CheckpointPolicy>,
    /// The optimizer.
    pub optimizer: Box<dyn Optimizer>,
    /// Whether the optimizer runs inside backward.
    pub optimizer_in_backward: bool,
    /// Whether the kept activations are offloaded to host memory.
    pub offload_activations: bool,
    /// Whether the master weights and optimizer state are in host memory, the update on
    /// the CPU.
    pub optimizer_offload: bool,
    /// Whether the frozen weights are streamed from host memory.
    pub stream_weights: bool,
    /// The ZeRO stage of the data-parallel job ([`TrainerOptions::zero_stage`]): the
    /// request's, or the one autofit chose.
    pub zero_stage: u8,
    /// The adapter: the request's, or the LoRA autofit added (`None`: every parameter
    /// trains).
    pub adapter: Option<Arc<dyn Adapter>>,
    /// The techniques of this setup that the request did not have already.
    pub techniques: Techniques,
    /// Its exact memory.
    pub prediction: MemoryPrediction,
    /// The device peak over any step (the first step included).
    pub peak: u64,
}

impl FitCandidate {
    /// Host memory it takes at its peak: offloaded activations, and an offloaded
    /// optimizer's master weights and state ([`MemoryCategory::Offloaded`]); streamed
    /// weights ([`MemoryCategory::Streamed`]).
    pub fn host_bytes(&self) -> u64 {
        self.prediction.host_bytes()
    }

    /// What its host memory holds: `offloaded activations`, `master weights and optimizer
    /// state`, both, or nothing.
    pub fn host_contents(&self) -> String {
        let mut what = Vec::new();
        if self.offload_activations {
            what.push("offloaded activations");
        }
        if self.optimizer_offload {
            what.push("master weights and optimizer state");
        }
        if self.stream_weights {
            what.push("streamed weights");
        }
        what.join(", ")
    }

    /// `micro-batch 2 × 4 micro-batches, recompute full, adamw8bit, offload`: the shape and
    /// the policy, then the other techniques autofit added.
    pub fn describe(&self) -> String {
        let policy = policy_name(self.recompute.as_ref());
        let mut text = format!(
            "micro-batch {} × {}, recompute {policy}",
            self.micro_batch,
            micro_batches(self.micro_batches),
        );
        if let Some(bytes) = policy.strip_prefix("budget:").and_then(|b| b.parse().ok()) {
            text.push_str(&format!(" ({})", format_bytes(bytes)));
        }
        for t in self
            .techniques
            .iter()
            .filter(|t| !t.is_recompute() && *t != Technique::Accumulation)
        {
            text.push_str(", ");
            text.push_str(t.name());
        }
        text
    }

    /// The `trainkit train` flags of this setup: `--batch-size 2 --grad-accum 4
    /// --recompute full`, then one flag for each other technique autofit added
    /// (`--optimizer adamw8bit`, `--optimizer-in-backward`, `--offload-activations`,
    /// `--optimizer-offload`, `--precision bf16`).
    pub fn flags(&self) -> String {
        let mut flags = format!(
            "--batch-size {} --grad-accum {} --recompute {}",
            self.micro_batch,
            self.micro_batches,
            policy_name(self.recompute.as_ref())
        );
        if self.techniques.contains(Technique::Zero1) || self.techniques.contains(Technique::Zero2)
        {
            flags.push_str(&format!(" --zero {}", self.zero_stage));
        }
        for (t, flag) in [
            (Technique::Adamw8bit, " --optimizer adamw8bit"),
            (Technique::OptimizerInBackward, " --optimizer-in-backward"),
            (Technique::Offload, " --offload-activations"),
            (Technique::OptimizerOffload, " --optimizer-offload"),
            (
                Technique::StreamWeights,
                crate::placement::flag(
                    crate::placement::streaming(self.adapter.is_some()).as_ref(),
                ),
            ),
            (Technique::Bf16, " --precision bf16"),
            (
                Technique::PureBf16,
                " --precision bf16 --master-weights none --update-rounding stochastic",
            ),
            (
                Technique::Lora,
                " --lora-rank 8 --lora-alpha 16 --lora-targets all-linear",
            ),
            (Technique::Qlora, " --qlora"),
        ] {
            if self.techniques.contains(t) {
                flags.push_str(flag);
            }
        }
        flags
    }
}

/// A recompute policy as `--recompute` spells it: `none`, `selective`, `full`,
/// `budget:BYTES`, or a policy's `kind`.
pub fn policy_name(policy: &dyn CheckpointPolicy) -> String {
    let kind = policy.typetag_name();
    if kind == "budget" {
        if let Some(bytes) = serde_json::to_value(policy)
            .ok()
            .and_then(|v| v.get("bytes").and_then(|b| b.as_u64()))
        {
            return format!("budget:{bytes}");
        }
    }
    kind.to_string()
}

/// One combination of techniques autofit tried, in its cost order.
#[derive(Clone, Debug)]
pub struct FitAttempt {
    /// The techniques added to the request's setup.
    pub techniques: Techniques,
    /// The fewest micro-batches with which it fits, if any does.
    pub fit: Option<FitCandidate>,
    /// The setup with the most micro-batches it may take: the least memory it can do.
    pub least: FitCandidate,
}

/// Autofit's choice, with what it tried and why.
#[derive(Clone, Debug)]
pub struct FitPlan {
    /// The chosen setup.
    pub choice: FitCandidate,
    /// The budget it fits.
    pub budget: u64,
    /// Every combination tried, cheapest first; the last is the choice's.
    pub tried: Vec<FitAttempt>,
    /// The techniques autofit did not consider, each with the reason.
    pub left_out: Vec<(Technique, String)>,
    /// The whole global batch in one micro-batch with none of the techniques.
    pub unconstrained: FitCandidate,
    /// What each technique saves on its own at the choice's micro-batch size.
    pub savings: TechniqueSavings,
}

/// The cost order as a line: `accumulation < selective < ... < bf16`.
fn cost_order() -> String {
    Technique::ALL
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(" < ")
}

impl FitPlan {
    /// Lines explaining the choice: the setup and its peak, the cost order, what each
    /// technique saves on its own, and what was tried before.
    pub fn explain(&self) -> Vec<String> {
        let c = &self.choice;
        let mut lines = vec![format!(
            "autofit: {}: peak {} of a {} budget",
            c.describe(),
            format_bytes(c.peak),
            format_bytes(self.budget)
        )];
        if c.host_bytes() > 0 {
            lines.push(format!(
                "  host memory: {} ({})",
                format_bytes(c.host_bytes()),
                c.host_contents()
            ));
        }
        if let Some(rate) = c.prediction.hiding_flop_rate(HOST_LINK_BYTES_PER_S) {
            lines.push(format!(
                "  streamed weights: {} copied to the device per step beside {:.1} TFLOP of \
                 compute; at 25 GB/s (PCIe 4.0 x16) the copies hide behind it on a device \
                 below {:.0} TFLOP/s",
                format_bytes(c.prediction.streamed_bytes_per_step),
                c.prediction.flops_per_step as f64 / 1e12,
                rate / 1e12
            ));
        }
        let u = &self.unconstrained;
        if u.peak > self.budget {
            lines.push(format!(
                "  the whole batch of {} at once, without any of the techniques, would need {}",
                rows(u.micro_batch),
                format_bytes(u.peak)
            ));
        }
        lines.push(format!(
            "  cost order, cheapest in time first: {}; a technique is used only when no \
             combination of cheaper ones fits, and within a combination the fewest \
             micro-batches",
            cost_order()
        ));
        let s = &self.savings;
        // Autofit offloads under full recomputation whenever it may choose full.
        let chooses = !self.left_out.iter().any(|(t, _)| *t == Technique::Full);
        lines.push(format!(
            "  each technique alone at micro-batch {} (peak {} without any):",
            s.baseline.micro_batch,
            format_bytes(s.baseline.peak)
        ));
        for row in &s.rows {
            let t = row.technique;
            if t == Technique::Accumulation {
                continue;
            }
            let used = if c.techniques.contains(t) {
                "  (used)"
            } else {
                ""
            };
            let left_out = self.left_out.iter().find(|(l, _)| *l == t);
            lines.push(match (&row.outcome, left_out) {
                (_, Some((_, why))) => format!("    {:<22} not considered: {why}", t.name()),
                (Ok(r), None) => format!(
                    "    {:<22} peak {}, {}{}{}{used}",
                    t.name(),
                    format_bytes(r.peak),
                    saving_text(s.baseline.peak, r.peak),
                    if r.host_bytes() > 0 {
                        format!(", host {}", format_bytes(r.host_bytes()))
                    } else {
                        String::new()
                    },
                    if t == Technique::Offload && chooses {
                        ", offloading what no recomputation keeps (autofit offloads only \
                         what full recomputation keeps)"
                    } else {
                        ""
                    }
                ),
                (Err(why), None) => format!("    {:<22} {why}", t.name()),
            });
        }
        let before = &self.tried[..self.tried.len().saturating_sub(1)];
        if let Some(closest) = before.iter().map(|a| &a.least).min_by_key(|l| l.peak) {
            lines.push(format!(
                "  {} cheaper combination{} did not fit; the closest: {} at {}",
                before.len(),
                if before.len() == 1 { "" } else { "s" },
                closest.describe(),
                format_bytes(closest.peak)
            ));
        }
        lines
    }
}

/// `saves 1.20 GiB` or `costs 3.00 MiB more`.
fn saving_text(baseline: u64, peak: u64) -> String {
    if peak <= baseline {
        format!("saves {}", format_bytes(baseline - peak))
    } else {
        format!("costs {} more", format_bytes(peak - baseline))
    }
}

/// `1 row`, `8 rows`.
fn rows(n: usize) -> String {
    if n == 1 {
        "1 row".to_string()
    } else {
        format!("{n} rows")
    }
}

/// `1 micro-batch`, `4 micro-batches`.
fn micro_batches(n: usize) -> String {
    if n == 1 {
        "1 micro-batch".to_string()
    } else {
        format!("{n} micro-batches")
    }
}

/// One setup to predict: everything but the micro-batch size.
#[derive(Clone, Debug)]
struct Spec {
    techniques: Techniques,
    precision: Box<dyn Precision>,
    recompute: Box<dyn CheckpointPolicy>,
    optimizer: Box<dyn Optimizer>,
    in_backward: bool,
    offload: bool,
    optimizer_offload: bool,
    stream: bool,
    zero_stage: u8,
    adapter: Option<Arc<dyn Adapter>>,
}

/// The LoRA autofit adds to a run that trains every weight: rank 8, α 16, on every
/// projection (torchtune's and QLoRA's choice of targets).
fn autofit_lora() -> Lora {
    Lora {
        rank: 8,
        alpha: 16.0,
        targets: vec![ALL_LINEAR.to_string()],
        rslora: false,
        base: crate::adapter::BaseWeights::Compute,
        dropout: 0.0,
        dora: false,
        modules_to_save: Vec::new(),
    }
}

impl Spec {
    /// The request's own setup; its recompute policy too when `keep_recompute`, else none.
    fn base(req: &FitRequest<'_>, keep_recompute: bool) -> Spec {
        Spec {
            techniques: Techniques::NONE,
            precision: dyn_clone::clone_box(req.precision),
            recompute: if keep_recompute {
                dyn_clone::clone_box(req.recompute)
            } else {
                Box::new(NoRecompute)
            },
            optimizer: dyn_clone::clone_box(req.optimizer),
            in_backward: req.optimizer_in_backward,
            offload: req.offload_activations,
            optimizer_offload: req.optimizer_offload,
            stream: !crate::placement::is_resident(req.placement),
            zero_stage: req.zero_stage,
            adapter: req.adapter.map(|a| Arc::from(dyn_clone::clone_box(a))),
        }
    }

    /// The setup of `c`.
    fn of(c: &FitCandidate) -> Spec {
        Spec {
            techniques: c.techniques,
            precision: c.precision.clone(),
            recompute: c.recompute.clone(),
            optimizer: c.optimizer.clone(),
            in_backward: c.optimizer_in_backward,
            offload: c.offload_activations,
            optimizer_offload: c.optimizer_offload,
            stream: c.stream_weights,
            zero_stage: c.zero_stage,
            adapter: c.adapter.clone(),
        }
    }

    /// This setup with `t` added (a budget of 0 bytes until [`at`] sizes it).
    fn with(&self, t: Technique) -> Result<Spec> {
        let mut s = self.clone();
        s.techniques = s.techniques.with(t);
        match t {
            Technique::Accumulation => {}
            Technique::Zero1 => s.zero_stage = s.zero_stage.max(1),
            Technique::Zero2 => s.zero_stage = 2,
            Technique::Selective => s.recompute = Box::new(Selective),
            Technique::Budget => s.recompute = Box::new(Budget::new(0)),
            Technique::Full => s.recompute = Box::new(Full),
            Technique::Adamw8bit => {
                s.optimizer = crate::optim::switch_to("adamw8bit", self.optimizer.as_ref())?
            }
            Technique::OptimizerInBackward => s.in_backward = true,
            Technique::Offload => s.offload = true,
            Technique::OptimizerOffload => s.optimizer_offload = true,
            Technique::StreamWeights => s.stream = true,
            Technique::Bf16 => s.precision = Box::new(MixedBf16 { fp32_grads: false }),
            Technique::PureBf16 => {
                // Pure bf16 computes in bf16 already: it replaces mixed bf16.
                s.techniques = s.techniques.without(Technique::Bf16);
                s.precision = Box::new(PureBf16 {
                    rounding: UpdateRounding::Stochastic,
                })
            }
            Technique::Lora => s.adapter = Some(Arc::new(autofit_lora())),
            Technique::Qlora => {
                let lora = match s.adapter.as_ref().and_then(|a| a.as_lora()) {
                    Some(l) => l.clone(),
                    None => {
                        // QLoRA on a run that trains every weight brings its LoRA.
                        s.techniques = s.techniques.with(Technique::Lora);
                        autofit_lora()
                    }
                };
                s.adapter = Some(Arc::new(lora.with_nf4_base()));
            }
        }
        Ok(s)
    }
}

/// Whether autofit chooses the recompute policy (rather than keeping the request's).
fn chooses_recompute(req: &FitRequest<'_>) -> bool {
    req.techniques.iter().any(Technique::is_recompute)
}

/// Why autofit may not add `t` to `req`'s setup, or `None` when it may.
fn why_not(req: &FitRequest<'_>, t: Technique) -> Option<String> {
    let why = incompatible(req, t);
    if why.is_none() && !req.techniques.contains(t) {
        return Some(
            "not among the techniques autofit may use (--autofit-techniques, less those a \
             flag on the command line fixes)"
                .into(),
        );
    }
    why
}

/// Why the rest of `req` rules out adding `t`, or `None`.
fn incompatible(req: &FitRequest<'_>, t: Technique) -> Option<String> {
    match t {
        Technique::Accumulation if req.optimizer_in_backward => {
            Some("the run updates inside backward, which needs one micro-batch per step".into())
        }
        Technique::Zero1 | Technique::Zero2 if req.world <= 1 => Some(
            "one process: there are no ranks to share the optimizer side and gradients \
             with (mpirun -np N)"
                .into(),
        ),
        Technique::Zero1 if req.zero_stage >= 1 => Some("on already (the run's own --zero)".into()),
        Technique::Zero2 if req.zero_stage >= 2 => Some("on already (the run's own --zero)".into()),
        Technique::Zero2 if req.separate_accumulation => Some(
            "the run accumulates apart (--separate-accumulation), which ZeRO-2's sums every \
             micro-batch cannot"
                .into(),
        ),
        Technique::Zero2 if req.bucket_bytes == 0 => Some(
            "the run sums each gradient after backward (--bucket-size 0), and ZeRO-2 frees \
             each as soon as it is in a bucket"
                .into(),
        ),
        Technique::Accumulation if req.global_batch == 1 => {
            Some("a global batch of one row cannot be split".into())
        }
        Technique::Selective if req.attention == AttentionPath::Fused => Some(
            "the fused attention keeps no T² tensor to drop, so selective keeps what no \
             recomputation keeps"
                .into(),
        ),
        Technique::Adamw8bit => match req.optimizer.typetag_name() {
            "adamw" => None,
            "adamw8bit" => Some("the run's optimizer has 8-bit state already".into()),
            other => Some(format!(
                "8-bit state is AdamW's, and the run's optimizer is {other}"
            )),
        },
        Technique::OptimizerInBackward if req.optimizer_in_backward => {
            Some("on already (the run's own setting)".into())
        }
        Technique::OptimizerInBackward if req.grad_clip != 0.0 => Some(format!(
            "the run clips gradients by their global norm (grad_clip {}), which needs every \
             gradient at once; --grad-clip 0 lets autofit use it",
            req.grad_clip
        )),
        Technique::Offload if req.offload_activations => {
            Some("on already (the run's own setting)".into())
        }
        Technique::OptimizerOffload if req.optimizer_offload => {
            Some("on already (the run's own setting)".into())
        }
        Technique::StreamWeights if !crate::placement::is_resident(req.placement) => {
            Some("on already (the run's own setting)".into())
        }
        Technique::StreamWeights if req.world > 1 && req.adapter.is_none() => Some(format!(
            "the {} ranks of a data-parallel job stream only a frozen base, and the run \
             trains every weight",
            req.world
        )),
        Technique::StreamWeights
            if req.adapter.is_none()
                && !req.techniques.contains(Technique::Lora)
                && !req.techniques.contains(Technique::Qlora)
                && !req.optimizer_offload
                && !req.techniques.contains(Technique::OptimizerOffload) =>
        {
            Some(
                "every weight trains and the optimizer stays on the device: streaming moves a \
                 frozen base (LoRA's, QLoRA's), or every weight with the optimizer on the host \
                 (optimizer-offload)"
                    .into(),
            )
        }
        Technique::Bf16 if req.precision.typetag_name() != "fp32" => Some(format!(
            "the run's precision is {} already",
            crate::precision::describe(req.precision)
        )),
        Technique::PureBf16 if req.precision.update_rounding().is_some() => Some(format!(
            "the run's precision is {} already",
            crate::precision::describe(req.precision)
        )),
        Technique::PureBf16 if req.precision.compute_dtype() == crate::tensor::DType::F16 => {
            Some("the run is fp16, whose loss scale needs f32 master weights".into())
        }
        Technique::Lora if req.adapter.is_some() => {
            Some("the run trains an adapter already".into())
        }
        Technique::Qlora => match req.adapter {
            Some(a) if a.base_dtype().is_some() => {
                Some("the run's base is quantized already".into())
            }
            Some(a) if a.as_lora().is_none() => Some(format!(
                "QLoRA is LoRA over an NF4 base, and the run's adapter is {}",
                a.typetag_name()
            )),
            _ => None,
        },
        _ => None,
    }
}

/// The techniques autofit may add to `req`, and why it leaves out the others.
fn usable(req: &FitRequest<'_>) -> (Techniques, Vec<(Technique, String)>) {
    let mut usable = Techniques::NONE;
    let mut left_out = Vec::new();
    for t in Technique::ALL {
        match why_not(req, t) {
            None => usable = usable.with(t),
            Some(why) => left_out.push((t, why)),
        }
    }
    (usable, left_out)
}

/// Every combination of the usable techniques, cheapest first. A combination holds one
/// recompute policy at most; offloading joins only the policy that keeps the least of
/// those autofit may choose (full recomputation's layer inputs), or the request's own.
fn combinations(req: &FitRequest<'_>, usable: Techniques) -> Result<Vec<Spec>> {
    let base = Spec::base(req, !chooses_recompute(req));
    let mut policies: Vec<Option<Technique>> = vec![None];
    policies.extend(
        [Technique::Selective, Technique::Budget, Technique::Full]
            .into_iter()
            .filter(|t| usable.contains(*t))
            .map(Some),
    );
    let keeps_least = *policies.last().unwrap_or(&None);
    let toggles: Vec<Technique> = [
        Technique::Zero1,
        Technique::Zero2,
        Technique::Adamw8bit,
        Technique::OptimizerInBackward,
        Technique::Offload,
        Technique::OptimizerOffload,
        Technique::StreamWeights,
        Technique::Bf16,
        Technique::PureBf16,
        Technique::Lora,
        Technique::Qlora,
    ]
    .into_iter()
    .filter(|t| usable.contains(*t))
    .collect();
    let mut specs = Vec::new();
    for policy in &policies {
        for mask in 0..1u32 << toggles.len() {
            let on: Vec<Technique> = toggles
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, t)| *t)
                .collect();
            if on.contains(&Technique::Offload) && *policy != keeps_least {
                continue;
            }
            // QLoRA brings its LoRA: the two together are QLoRA alone; pure bf16 is bf16
            // compute already; ZeRO-2 shards what ZeRO-1 does.
            if on.contains(&Technique::Lora) && on.contains(&Technique::Qlora)
                || on.contains(&Technique::Bf16) && on.contains(&Technique::PureBf16)
                || on.contains(&Technique::Zero1) && on.contains(&Technique::Zero2)
            {
                continue;
            }
            let mut spec = base.clone();
            for t in policy.iter().chain(on.iter()) {
                spec = spec.with(*t)?;
            }
            // Streaming moves a frozen base, or every weight with the optimizer on the host.
            if on.contains(&Technique::StreamWeights)
                && spec.adapter.is_none()
                && !spec.optimizer_offload
            {
                continue;
            }
            specs.push(spec);
        }
    }
    specs.sort_by_key(|s| s.techniques.cost());
    Ok(specs)
}

/// The exact memory of `spec` with micro-batches of `micro_batch` rows.
fn evaluate(req: &FitRequest<'_>, spec: &Spec, micro_batch: usize) -> Result<FitCandidate> {
    let mut model = crate::model::build_with(
        &req.model.for_length(req.seq_len),
        req.attention,
        req.loss,
        req.loss_chunk,
    )?;
    if let Some(a) = &spec.adapter {
        model = model.with_adapter(a.clone())?;
    }
    let options = TrainerOptions {
        grad_clip: req.grad_clip,
        optimizer_in_backward: spec.in_backward,
        offload_activations: spec.offload,
        optimizer_offload: spec.optimizer_offload,
        placement: match (spec.stream, crate::placement::is_resident(req.placement)) {
            (false, _) => crate::placement::resident(),
            (true, true) => crate::placement::streaming(spec.adapter.is_some()),
            (true, false) => dyn_clone::clone_box(req.placement),
        },
        zero_stage: spec.zero_stage,
        separate_accumulation: req.separate_accumulation,
        bucket_bytes: req.bucket_bytes,
        ..TrainerOptions::default()
    };
    // Under ZeRO the ranks differ (ownership is by whole parameters): the budget must fit
    // the heaviest.
    let world = req.world.max(1);
    let rank = if spec.zero_stage > 0 && world > 1 {
        crate::trainer::heaviest_rank(&model.init_params(), world)
    } else {
        0
    };
    let prediction = predict_rank(
        model,
        MicroBatch {
            batch_size: micro_batch,
            seq_len: req.seq_len,
        },
        spec.precision.as_ref(),
        spec.recompute.as_ref(),
        spec.optimizer.as_ref(),
        &options,
        crate::collective::Rehearsal::new(rank, world)?,
    )?;
    let micro_batches = req.global_batch / micro_batch.max(1);
    let mut techniques = spec.techniques;
    if micro_batches > 1 {
        techniques = techniques.with(Technique::Accumulation);
    }
    Ok(FitCandidate {
        micro_batch,
        micro_batches,
        precision: spec.precision.clone(),
        recompute: spec.recompute.clone(),
        optimizer: spec.optimizer.clone(),
        optimizer_in_backward: spec.in_backward,
        offload_activations: spec.offload,
        optimizer_offload: spec.optimizer_offload,
        stream_weights: spec.stream,
        zero_stage: spec.zero_stage,
        adapter: spec.adapter.clone(),
        techniques,
        peak: prediction
            .peak_total
            .max(prediction.first_step_peak_total(micro_batches)),
        prediction,
    })
}

/// Whether `c` fits the request's device budget and, with anything offloaded, its host
/// budget.
fn fits(req: &FitRequest<'_>, c: &FitCandidate) -> bool {
    c.peak <= req.budget && req.host_budget.is_none_or(|h| c.host_bytes() <= h)
}

/// Steps of a byte budget between keeping nothing but layer inputs and keeping everything.
const BUDGET_STEPS: u64 = 256;

/// `spec` at `micro_batch`; for a byte budget, the largest budget (in 256ths of what no
/// recomputation keeps, at least one) that fits, or one 256th when none does.
fn at(req: &FitRequest<'_>, spec: &Spec, micro_batch: usize) -> Result<FitCandidate> {
    if !spec.techniques.contains(Technique::Budget) {
        return evaluate(req, spec, micro_batch);
    }
    let mut none = spec.clone();
    none.recompute = Box::new(NoRecompute);
    let a = evaluate(req, &none, micro_batch)?.prediction.activations;
    let all = a.kept_bytes + a.offloaded_bytes;
    let with = |steps: u64| {
        let mut s = spec.clone();
        let bytes = (all as u128 * steps as u128 / BUDGET_STEPS as u128) as u64;
        s.recompute = Box::new(Budget::new(bytes));
        evaluate(req, &s, micro_batch)
    };
    let mut best = with(1)?;
    if !fits(req, &best) {
        return Ok(best);
    }
    // `lo` fits; `hi` (every byte: no recomputation) is not a budget's to choose.
    let (mut lo, mut hi) = (1, BUDGET_STEPS);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        let c = with(mid)?;
        if fits(req, &c) {
            lo = mid;
            best = c;
        } else {
            hi = mid;
        }
    }
    Ok(best)
}

/// The largest of `sizes` (largest first) at which `spec` fits, and `spec` at the
/// smallest of them.
fn search(
    req: &FitRequest<'_>,
    spec: &Spec,
    sizes: &[usize],
) -> Result<(Option<FitCandidate>, FitCandidate)> {
    let sizes = if spec.in_backward { &sizes[..1] } else { sizes };
    let last = sizes.len() - 1;
    let least = at(req, spec, sizes[last])?;
    if !fits(req, &least) {
        return Ok((None, least));
    }
    // Memory grows with the micro-batch: the first size that fits, by bisection.
    let (mut lo, mut hi, mut best) = (0, last, least.clone());
    while lo < hi {
        let mid = (lo + hi) / 2;
        let c = at(req, spec, sizes[mid])?;
        if fits(req, &c) {
            hi = mid;
            best = c;
        } else {
            lo = mid + 1;
        }
    }
    Ok((Some(best), least))
}

/// Chooses the cheapest setup that fits `req.budget`: the first combination of techniques
/// in cost order ([`Technique`]; a technique is used only when no combination of the
/// cheaper ones fits) with which some micro-batch size (a divisor of the global batch)
/// fits, and with it the fewest micro-batches. A byte budget takes the most bytes that
/// fit.
///
/// When nothing fits, the error says what would: the budget needed, and where it helps,
/// techniques autofit was not allowed, mixed precision or the longest sequence that fits.
pub fn autofit(req: &FitRequest<'_>) -> Result<FitPlan> {
    if req.global_batch == 0 {
        return Err(Error::config("global_batch", "must be at least 1 row"));
    }
    let (usable, left_out) = usable(req);
    let sizes: Vec<usize> = if usable.contains(Technique::Accumulation) {
        (1..=req.global_batch)
            .rev()
            .filter(|d| req.global_batch % d == 0)
            .collect()
    } else {
        vec![req.global_batch]
    };
    let mut tried = Vec::new();
    for spec in combinations(req, usable)? {
        let (fit, least) = search(req, &spec, &sizes)?;
        tried.push(FitAttempt {
            techniques: spec.techniques,
            fit: fit.clone(),
            least,
        });
        let Some(choice) = fit else {
            continue;
        };
        let keep = !chooses_recompute(req);
        let base = Spec::base(req, keep);
        let unconstrained = evaluate(req, &base, req.global_batch)?;
        let at_choice = FitRequest {
            global_batch: choice.micro_batch,
            recompute: base.recompute.as_ref(),
            ..*req
        };
        let savings = technique_savings(&at_choice)?;
        return Ok(FitPlan {
            choice,
            budget: req.budget,
            tried,
            left_out,
            unconstrained,
            savings,
        });
    }
    Err(Error::OutOfMemory {
        message: what_would_fit(req, &tried)?,
    })
}

/// The message of a run that cannot fit: what it needs and what would fit.
fn what_would_fit(req: &FitRequest<'_>, tried: &[FitAttempt]) -> Result<String> {
    // Of the setups that fit the device (but not the host), the one that needs the least
    // host memory; else the least device peak.
    let on_device = tried
        .iter()
        .map(|a| &a.least)
        .filter(|c| c.peak <= req.budget)
        .min_by_key(|c| (c.host_bytes(), c.peak));
    let least = on_device
        .or_else(|| tried.iter().map(|a| &a.least).min_by_key(|c| c.peak))
        .ok_or_else(|| Error::config("autofit", "no setup to try"))?;
    let state = least.prediction.model_state_bytes();
    let mut msg = format!(
        "nothing fits {}: of the setups autofit may choose, {} needs the least, {} (model \
         state {}, activations {})",
        format_bytes(req.budget),
        least.describe(),
        format_bytes(least.peak),
        format_bytes(state),
        format_bytes(least.prediction.peak.get(MemoryCategory::Activations))
    );
    let mut fixes = Vec::new();
    if least.peak <= req.budget {
        // It fits the device but not the host.
        msg.push_str(&format!(
            ", and {} of host memory ({}), more than the host's {} available",
            format_bytes(least.host_bytes()),
            least.host_contents(),
            format_bytes(req.host_budget.unwrap_or(0))
        ));
        fixes.push(format!(
            "a host with at least {} of memory available",
            format_bytes(least.host_bytes())
        ));
    } else {
        fixes.push(format!("a budget of at least {}", format_bytes(least.peak)));
    }
    // Techniques the request did not allow, all at once where they combine.
    let all = FitRequest {
        techniques: Techniques::ALL,
        ..*req
    };
    let (more, _) = usable(&all);
    let (allowed, _) = usable(req);
    let extra: Techniques = more.iter().filter(|t| !allowed.contains(*t)).collect();
    if !extra.is_empty() {
        let mut spec = Spec::base(&all, false);
        for t in [
            Technique::Full,
            Technique::Adamw8bit,
            Technique::Offload,
            Technique::OptimizerOffload,
            Technique::Bf16,
        ] {
            if more.contains(t) {
                spec = spec.with(t)?;
            }
        }
        let micro = if more.contains(Technique::Accumulation) {
            1
        } else {
            req.global_batch
        };
        let c = evaluate(&all, &spec, micro)?;
        if fits(req, &c) {
            fixes.push(format!(
                "letting autofit use {extra} (--autofit-techniques all; {}: peak {})",
                c.describe(),
                format_bytes(c.peak)
            ));
        }
    }
    // Pure bf16, when the request did not name it.
    let named = FitRequest {
        techniques: req.techniques.with(Technique::PureBf16),
        ..*req
    };
    if !allowed.contains(Technique::PureBf16) && why_not(&named, Technique::PureBf16).is_none() {
        let spec = Spec::of(least).with(Technique::PureBf16)?;
        let c = evaluate(&named, &spec, least.micro_batch)?;
        if fits(req, &c) {
            fixes.push(format!(
                "bf16 weights without an f32 master copy, updates rounded stochastically \
                 (--autofit-techniques all,pure-bf16: {}: peak {})",
                c.describe(),
                format_bytes(c.peak)
            ));
        }
    }
    // Training an adapter instead of every weight, when the request did not name it.
    for t in [Technique::Lora, Technique::Qlora] {
        let named = FitRequest {
            techniques: req.techniques.with(t),
            ..*req
        };
        if allowed.contains(t) || why_not(&named, t).is_some() {
            continue;
        }
        let spec = Spec::of(least).with(t)?;
        let c = evaluate(&named, &spec, least.micro_batch)?;
        if fits(req, &c) {
            fixes.push(format!(
                "training {} adapter instead of every weight (--autofit-techniques all,{}: {}: \
                 peak {})",
                if t == Technique::Lora {
                    "a LoRA"
                } else {
                    "a QLoRA"
                },
                t.name(),
                c.describe(),
                format_bytes(c.peak)
            ));
            break;
        }
    }
    if req.precision.compute_dtype() != crate::tensor::DType::Bf16
        && !allowed.contains(Technique::Bf16)
    {
        let mut spec = Spec::of(least);
        spec.precision = Box::new(MixedBf16 { fp32_grads: false });
        let c = evaluate(req, &spec, least.micro_batch)?;
        if fits(req, &c) {
            fixes.push(format!(
                "--precision bf16 (bf16 gradients: peak {})",
                format_bytes(c.peak)
            ));
        }
    }
    if state < req.budget {
        // The longest sequence that fits with the least setup.
        let spec = Spec::of(least);
        let (mut lo, mut hi) = (0usize, req.seq_len);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            let shorter = FitRequest {
                seq_len: mid,
                ..*req
            };
            if fits(req, &at(&shorter, &spec, least.micro_batch)?) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if lo > 0 {
            fixes.push(format!("--seq-len {lo} or shorter"));
        }
    } else {
        msg.push_str("; the model state alone exceeds the budget, whatever the batch");
        fixes.push("a smaller model".to_string());
    }
    msg.push_str(&format!("; what would fit: {}", fixes.join(", or ")));
    Ok(msg)
}

/// What one technique does on its own.
#[derive(Clone, Debug)]
pub struct TechniqueSaving {
    /// The technique.
    pub technique: Technique,
    /// The baseline with the technique added, or why it cannot be added.
    pub outcome: std::result::Result<FitCandidate, String>,
}

/// What each technique saves on its own for one setup ([`technique_savings`]).
#[derive(Clone, Debug)]
pub struct TechniqueSavings {
    /// The setup as the request gives it, in one micro-batch of the global batch.
    pub baseline: FitCandidate,
    /// One row per technique, in cost order.
    pub rows: Vec<TechniqueSaving>,
    /// Every technique that combines at once: full recomputation, 8-bit state, the
    /// optimizer inside backward, activation offloading and the optimizer offloaded to the
    /// host where each applies, and bf16 where it applies and lowers the peak (one
    /// micro-batch).
    pub all: FitCandidate,
}

/// What each technique saves on its own for `req`'s setup as given (its precision,
/// optimizer, recompute policy, settings, and the global batch in one micro-batch):
/// one row per technique of [`Technique::ALL`] with that technique added — accumulation
/// as micro-batches of one row, a byte budget of half what no recomputation keeps,
/// offloading under the setup's own policy — or why it cannot be, and a row with all of
/// them that combine (bf16 only where it lowers that row's peak). Unlike autofit, it shows the optimizer inside backward whatever
/// `req.grad_clip` (that row runs without clipping), and ignores `req.budget`.
pub fn technique_savings(req: &FitRequest<'_>) -> Result<TechniqueSavings> {
    let no_clip = FitRequest {
        grad_clip: 0.0,
        ..*req
    };
    let req = &no_clip;
    let base = Spec::base(req, true);
    let baseline = evaluate(req, &base, req.global_batch)?;
    let base_kind = req.recompute.typetag_name();
    let mut rows = Vec::new();
    for t in Technique::ALL {
        let policy_kind = match t {
            Technique::Selective => Some("selective"),
            Technique::Budget => Some("budget"),
            Technique::Full => Some("full"),
            _ => None,
        };
        let outcome = if policy_kind == Some(base_kind) {
            Err(format!("the setup's policy already ({base_kind})"))
        } else if let Some(why) = why_not(req, t) {
            Err(why)
        } else {
            match t {
                Technique::Accumulation => evaluate(req, &base, 1).map(Ok)?,
                Technique::Budget => {
                    let a = baseline.prediction.activations;
                    let mut none = base.clone();
                    none.recompute = Box::new(NoRecompute);
                    let kept = if base_kind == "none" {
                        a.kept_bytes + a.offloaded_bytes
                    } else {
                        let n = evaluate(req, &none, req.global_batch)?
                            .prediction
                            .activations;
                        n.kept_bytes + n.offloaded_bytes
                    };
                    let mut spec = base.with(t)?;
                    spec.recompute = Box::new(Budget::new(kept / 2));
                    evaluate(req, &spec, req.global_batch).map(Ok)?
                }
                Technique::StreamWeights if base.adapter.is_none() && !base.optimizer_offload => {
                    Err(
                        "every weight trains: streaming them needs the optimizer on the host \
                         too (optimizer-offload; the row of all that combine has both)"
                            .to_string(),
                    )
                }
                _ => match evaluate(req, &base.with(t)?, req.global_batch) {
                    Ok(c) => Ok(c),
                    // Offloading under a policy that keeps nothing.
                    Err(Error::Config { message, .. }) if t == Technique::Offload => Err(message),
                    Err(e) => return Err(e),
                },
            }
        };
        rows.push(TechniqueSaving {
            technique: t,
            outcome,
        });
    }
    let mut all = base.clone();
    let applies = |t: Technique| rows.iter().any(|r| r.technique == t && r.outcome.is_ok());
    for t in [
        Technique::Full,
        Technique::Adamw8bit,
        Technique::OptimizerInBackward,
        Technique::Offload,
        Technique::OptimizerOffload,
        Technique::StreamWeights,
    ] {
        // Offloading joins full recomputation even where the setup's own policy would
        // keep nothing to offload; every weight streams beside the optimizer on the host.
        let offloads_full =
            t == Technique::Offload && applies(Technique::Full) && why_not(req, t).is_none();
        let streams_all =
            t == Technique::StreamWeights && all.optimizer_offload && why_not(req, t).is_none();
        if applies(t) || offloads_full || streams_all {
            all = all.with(t)?;
        }
    }
    let mut all = evaluate(req, &all, req.global_batch)?;
    if applies(Technique::Bf16) {
        // bf16 adds 2 bytes per parameter of weights beside the master copy: with little
        // else left it can cost more than it saves.
        let bf16 = evaluate(
            req,
            &Spec::of(&all).with(Technique::Bf16)?,
            req.global_batch,
        )?;
        if bf16.peak < all.peak {
            all = bf16;
        }
    }
    Ok(TechniqueSavings {
        baseline,
        rows,
        all,
    })
}
