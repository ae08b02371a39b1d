//! The check that activation offloading has something to offload, before the first step.

use crate::checkpoint::CheckpointPolicy;
use crate::data::DataLoader;
use crate::device::{Backend, MetaBackend};
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::model::{Batch, Model, Param, Pass};
use crate::precision::Precision;
use crate::rng::Rng;
use crate::tensor::DType;

/// Fails unless `checkpoint` keeps some activation of `model` for backward: offloading
/// moves what the policy keeps, so a policy that recomputes everything leaves it nothing.
/// Runs one forward and backward of a micro-batch of `data`'s shape on the meta backend
/// (shapes only, no data), so the answer is the executor's own.
pub(super) fn check(
    model: &dyn Model,
    data: &DataLoader,
    precision: &dyn Precision,
    checkpoint: &dyn CheckpointPolicy,
) -> Result<()> {
    let meta = MetaBackend::new();
    let mut rng = Rng::new(0);
    let mut params = model
        .init_params()
        .iter()
        .map(|p| Param::init(&meta, p, &mut rng, precision))
        .collect::<Result<Vec<_>>>()?;
    let (b, t) = (data.batch_size(), data.seq_len());
    let batch = Batch {
        batch_size: b,
        seq_len: t,
        inputs: vec![0; b * t],
        targets: vec![0; b * t],
        positions: None,
    };
    let mut losses = meta.zeros(
        &[b * t],
        DType::F32,
        MemoryCategory::Workspace,
        "offload.losses",
    )?;
    let mut pass = Pass {
        backend: &meta,
        params: &mut params,
        checkpoint,
        dtype: precision.compute_dtype(),
        offload: true,
        grad_ready: None,
        // A training pass: dropout draws (its transient buffers counted), any key will do.
        rng_key: Some(0),
        // The probe's parameters are all resident.
        stream_ahead: 1,
    };
    let stats = model.forward_backward(&mut pass, &batch, 1.0, &mut losses)?;
    if stats.stash.offloaded_bytes > 0 {
        return Ok(());
    }
    Err(Error::config(
        "offload_activations",
        format!(
            "--offload-activations (training.offload_activations = true) offloads the \
             activations the recompute policy keeps, but `{}` keeps none of {}'s; choose a \
             policy that keeps some (--recompute full keeps each layer's input, none keeps \
             every activation) or drop --offload-activations",
            checkpoint.typetag_name(),
            model.describe()
        ),
    ))
}
