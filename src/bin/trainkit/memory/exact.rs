//! trainkit's exact figures for `trainkit memory`: the model it builds for the subject, and
//! the meta run that measures it.

use super::subject::{flag_error, Subject};
use super::{MemoryArgs, Paths};
use crate::as_flag;
use trainkit::estimate::{MemoryPrediction, MicroBatch};
use trainkit::model::{Positions, Shape};
use trainkit::Result;

/// The parameters of the model `subject` builds with `adapter` that train, and all of
/// them.
pub(super) fn trainable_params(
    subject: &Subject,
    seq_len: u64,
    paths: Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
) -> Result<(u64, u64)> {
    let model = exact_model(subject, seq_len, paths, adapter)?
        .ok_or_else(|| flag_error("--seq-len", "exceeds the model's context"))?;
    let params = model.init_params();
    let count = |trains: bool| {
        params
            .iter()
            .filter(|p| trains || !p.trains)
            .map(|p| p.numel() as u64)
            .sum::<u64>()
    };
    let all = count(true);
    Ok((all - count(false), all))
}

/// The model trainkit's exact figures run for `subject` at `seq_len`, with `adapter`:
/// `None` for shapes trainkit does not build (the formulas alone describe them).
pub(super) fn exact_model(
    subject: &Subject,
    seq_len: u64,
    (attention, loss, loss_chunk): Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
) -> Result<Option<Box<dyn trainkit::Model>>> {
    let Some(shape) = exact_shape(subject, seq_len) else {
        return Ok(None);
    };
    let Ok(model) = trainkit::model::build_with(&shape, attention, loss, loss_chunk) else {
        return Ok(None);
    };
    match adapter {
        Some(a) => model
            .with_adapter(std::sync::Arc::from(dyn_clone::clone_box(a)))
            .map(Some)
            .map_err(|e| {
                let flag = trainkit::config::lora_flag(&e);
                e.for_field(flag)
            }),
        None => Ok(Some(model)),
    }
}

/// The shape trainkit's exact figures build for `subject` at `seq_len`: raw GPT-style
/// dimensions get a position table of `seq_len` rows, rotary models a context of
/// `seq_len`; `None` without dimensions or when the sequence exceeds a GPT-2 preset's
/// context.
pub(super) fn exact_shape(subject: &Subject, seq_len: u64) -> Option<Shape> {
    let shape = subject.shape?;
    let len = usize::try_from(seq_len).ok()?;
    match shape.positions {
        Positions::None => Some(Shape {
            positions: Positions::Learned,
            context: len,
            ..shape
        }),
        Positions::Learned if len > shape.context => None,
        Positions::Learned | Positions::Rotary(_) => Some(shape.for_length(len)),
    }
}

/// The LoRA the `--lora-*` flags describe, if any: α defaults to twice the rank, the
/// targets to PEFT's for the model trainkit builds for `subject` at `seq_len`.
pub(super) fn lora(
    args: &MemoryArgs,
    subject: &Subject,
    seq_len: u64,
) -> Result<Option<trainkit::Lora>> {
    let modules = exact_shape(subject, seq_len)
        .and_then(|s| trainkit::model::families::from_shape(&s).ok())
        .map(|m| m.family().projection_modules())
        .unwrap_or_default();
    args.lora.lora(None, &modules)
}

/// The rank of `ranks`' job whose figures are shown: under ZeRO the one whose share of the
/// model state weighs most ([`trainkit::trainer::heaviest_rank`]), else rank 0 (every rank
/// the same).
pub(super) fn heaviest(model: &dyn trainkit::Model, ranks: super::Ranks) -> usize {
    let world = usize::try_from(ranks.world).unwrap_or(usize::MAX);
    if ranks.zero == 0 || world <= 1 {
        return 0;
    }
    trainkit::trainer::heaviest_rank(&model.init_params(), world)
}

/// trainkit's exact memory for the models it builds (GPT-2 shaped presets, or GPT-style raw
/// dimensions), `None` for others or when the sequence exceeds a preset's context; in a
/// data-parallel job, the heaviest rank's ([`heaviest`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn trainkit_exact(
    subject: &Subject,
    seq_len: u64,
    batch_size: u64,
    precision: &dyn trainkit::Precision,
    recompute: &dyn trainkit::CheckpointPolicy,
    optimizer: &dyn trainkit::Optimizer,
    optimizer_in_backward: bool,
    offload_activations: bool,
    optimizer_offload: bool,
    (attention, loss, loss_chunk): Paths,
    adapter: Option<&(dyn trainkit::Adapter + 'static)>,
    ranks: super::Ranks,
    placement: &(dyn trainkit::WeightPlacement + 'static),
) -> Result<Option<MemoryPrediction>> {
    let Some(model) = exact_model(subject, seq_len, (attention, loss, loss_chunk), adapter)? else {
        return Ok(None);
    };
    let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let mut options = if optimizer_in_backward {
        trainkit::TrainerOptions {
            grad_clip: 0.0,
            optimizer_in_backward: true,
            ..trainkit::TrainerOptions::default()
        }
    } else {
        trainkit::TrainerOptions::default()
    };
    options.offload_activations = offload_activations;
    options.optimizer_offload = optimizer_offload;
    options.zero_stage = ranks.zero;
    options.placement = dyn_clone::clone_box(placement);
    // The rank whose share weighs most (ownership is by whole parameters).
    let rank = trainkit::collective::Rehearsal::new(
        heaviest(model.as_ref(), ranks),
        usize_of(ranks.world),
    )?;
    trainkit::estimate::predict_rank(
        model,
        MicroBatch {
            batch_size: usize_of(batch_size),
            seq_len: usize_of(seq_len),
        },
        precision,
        recompute,
        optimizer,
        &options,
        rank,
    )
    .map(Some)
    .map_err(as_flag)
}
