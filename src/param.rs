//! `Param`: one named parameter with its compute weights, master copy, gradient and
//! optimizer state; `ParamInit`, how a model declares one.

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::ops::update_rounding::{self, UpdateRounding};
use crate::ops::ParamGrad;
use crate::optim::{ParamUpdate, StateSlot};
use crate::precision::Precision;
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};
use std::borrow::Cow;
use std::sync::Arc;

/// How a parameter's initial values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    /// Independent normal values with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Every element this value (1 for norm gains, 0 for biases).
    Constant(f32),
    /// These values, row-major.
    Values(Vec<f32>),
    /// Independent uniform values in `[-bound, bound)`: `nn.Linear`'s Kaiming-uniform
    /// initialisation (`a = √5`) has `bound = 1/√in_features`.
    Uniform {
        /// The half-width of the interval.
        bound: f64,
    },
    /// The first `rows` rows (of the parameter's first dimension) drawn as `init`, the
    /// rest zero: a vocabulary padded to an aligned width ([`crate::model::Shape`]'s
    /// `padded_vocab`), drawing from the stream exactly as the unpadded parameter would.
    Rows {
        /// Rows drawn as `init`.
        rows: usize,
        /// How they are drawn.
        init: Box<Init>,
    },
}

/// A parameter's name, shape and initialisation, as a model declares it. Values are drawn
/// only when a backend stores them ([`ParamInit::values`]), so a model predicted on the
/// meta backend never materialises its weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamInit {
    /// Hugging Face name of the parameter.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// How the initial values are drawn.
    pub init: Init,
    /// Whether the parameter trains: a frozen one has no gradient, no optimizer state and
    /// no f32 master copy ([`crate::adapter::Adapter`] decides).
    pub trains: bool,
    /// The dtype its weights are stored in instead of the precision's compute dtype:
    /// [`DType::Nf4`] for a QLoRA base projection (frozen parameters only).
    pub dtype: Option<DType>,
}

impl ParamInit {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The initial values, row-major f32, drawing from `rng` for random initialisations
    /// (parameters are drawn in model order from one stream).
    pub fn values(&self, rng: &mut Rng) -> Vec<f32> {
        draw(&self.init, &self.shape, rng)
    }

    /// The numbers of the stream [`ParamInit::values`] takes from it: a parameter whose
    /// values come from elsewhere (a model directory) moves the stream on by as many
    /// ([`Rng::skip`]), so that the parameters drawn after it draw as they would have.
    pub fn draws(&self) -> u64 {
        draws(&self.init, &self.shape)
    }
}

/// Elements of a random initialisation drawn together on one core.
const DRAW_PIECE: usize = 1 << 16;

/// `n` values of `shape` drawn as `init` says.
fn draw(init: &Init, shape: &[usize], rng: &mut Rng) -> Vec<f32> {
    let n = shape.iter().product();
    match init {
        Init::Normal { std } => random(n, 2, rng, |r| (r.normal() * std) as f32),
        Init::Constant(v) => vec![*v; n],
        Init::Values(v) => v.clone(),
        Init::Uniform { bound } => {
            random(n, 1, rng, |r| ((r.uniform() * 2.0 - 1.0) * bound) as f32)
        }
        Init::Rows { rows, init } => {
            let mut values = draw(init, &drawn_rows(shape, *rows), rng);
            values.resize(n, 0.0);
            values
        }
    }
}

/// The shape of the rows of `shape` that [`Init::Rows`] draws: its first `rows`.
fn drawn_rows(shape: &[usize], rows: usize) -> Vec<usize> {
    let mut part = shape.to_vec();
    if let Some(first) = part.first_mut() {
        *first = rows.min(*first);
    }
    part
}

/// `n` values of `one`, each taking `per` numbers of `rng`'s stream, drawn in pieces of
/// [`DRAW_PIECE`] on every core: a piece starts where the stream stands after the pieces
/// before it ([`Rng::skip`]), so the values are those of drawing them one after another,
/// on any number of threads, and `rng` ends past them all.
fn random(n: usize, per: u64, rng: &mut Rng, one: impl Fn(&mut Rng) -> f32 + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    let mut values = vec![0.0f32; n];
    let start = rng.clone();
    values
        .par_chunks_mut(DRAW_PIECE)
        .enumerate()
        .for_each(|(i, piece)| {
            let mut r = start.clone();
            r.skip((i * DRAW_PIECE) as u64 * per);
            piece.iter_mut().for_each(|v| *v = one(&mut r));
        });
    rng.skip(n as u64 * per);
    values
}

/// The numbers of the stream that drawing `init` over `shape` takes.
fn draws(init: &Init, shape: &[usize]) -> u64 {
    let n = shape.iter().product::<usize>() as u64;
    match init {
        Init::Normal { .. } => 2 * n,
        Init::Uniform { .. } => n,
        Init::Constant(_) | Init::Values(_) => 0,
        Init::Rows { rows, init } => draws(init, &drawn_rows(shape, *rows)),
    }
}

/// A named parameter tensor and everything training keeps for it.
///
/// `value` is the f32 copy the optimizer updates: the master weights when the precision
/// keeps them apart, otherwise the compute weights themselves. Gradients are allocated on
/// the first backward; optimizer state slots are created by the optimizer on its first
/// step. A frozen parameter ([`Param::trains`] false) is its compute weights alone: no
/// master copy, no optimizer state, and a gradient only inside the backward of an op
/// that cannot skip it (a norm's gain, freed when the op is done).
#[derive(Debug)]
pub struct Param {
    name: String,
    weight: Tensor,
    master: Option<Tensor>,
    grad: Option<Tensor>,
    grad_dtype: DType,
    state: Vec<Tensor>,
    /// The optimizer already wrote the compute weights from this step's update.
    weight_fresh: bool,
    /// Whether the parameter trains (a frozen one keeps no master copy and no state).
    trains: bool,
    /// How updates are written back into weights without a master copy (pure bf16).
    rounding: Option<UpdateRounding>,
    /// The Kahan compensation of pure bf16 weights (bf16, the weights' rounding error).
    compensation: Option<Tensor>,
    /// With the optimizer offloaded, the host memory its side of the parameter lives in
    /// (master weights, compensation, optimizer state): [`Backend::host`].
    host: Option<Arc<dyn Backend>>,
    /// The host copy an offloaded update runs on ([`HostUpdate`]): the optimizer leaves
    /// the compute weights to the refresh after its step, so that a skipped step leaves
    /// them as they were.
    refresh_deferred: bool,
    /// Another rank updates this parameter (ZeRO-1: [`Param::hand_over`]): this one keeps
    /// its compute weights and gradient, and receives the updated weights.
    elsewhere: bool,
    /// The weights live in host memory ([`crate::placement::Placement::Streamed`]):
    /// `weight` is that copy, and `staged` the device's while a section reads them.
    streamed: bool,
    /// A streamed parameter's weights on the device ([`Param::stage`]).
    staged: Option<Tensor>,
}

/// An offloaded parameter's update, taken out of its [`Param`] to run on a host thread
/// while the device goes on: the parameter's optimizer side (master weights, optimizer
/// state, compensation) with host copies of its gradient and compute weights, and the
/// guard's record. Every buffer is allocated and freed by the thread that starts and
/// finishes it ([`Param::start_host_update`], [`Param::finish_host_update`]); the host
/// thread only runs the optimizer's step on it.
pub(crate) struct HostUpdate {
    /// The host-only parameter the optimizer updates.
    pub(crate) param: Param,
    /// The guard's record ([`crate::optim::StepRecord`]), in host memory.
    pub(crate) record: Tensor,
}

impl HostUpdate {
    /// Waits until the copies into the update's host tensors have run (the gradient's
    /// copy is queued where the host memory is page-locked), before the step reads them.
    pub(crate) fn settle(&self, device: &dyn Backend) -> Result<()> {
        if let Some(g) = &self.param.grad {
            device.settle(g)?;
        }
        device.settle(&self.param.weight)?;
        device.settle(&self.record)
    }
}

impl Param {
    /// A parameter initialised from `init` (f32, row-major), laid out as `precision` says.
    pub fn new(
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        init: &[f32],
        precision: &dyn Precision,
    ) -> Result<Param> {
        Self::build(
            backend,
            None,
            name,
            shape,
            Some(init),
            precision,
            true,
            None,
            None,
        )
    }

    /// A frozen parameter ([`Param::trains`] false) initialised from `init`: compute
    /// weights only.
    pub fn frozen(
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        init: &[f32],
        precision: &dyn Precision,
    ) -> Result<Param> {
        Self::build(
            backend,
            None,
            name,
            shape,
            Some(init),
            precision,
            false,
            None,
            None,
        )
    }

    /// The parameter `spec` declares, its values drawn from `rng` in model order; on a
    /// backend that holds no data ([`Backend::holds_data`]) nothing is drawn and no value
    /// is materialised.
    pub fn init(
        backend: &dyn Backend,
        spec: &ParamInit,
        rng: &mut Rng,
        precision: &dyn Precision,
    ) -> Result<Param> {
        Self::init_with_host(backend, None, spec, rng, precision)
    }

    /// As [`Param::init`], with the optimizer's side of a parameter that trains (its f32
    /// master weights, a Kahan compensation, the optimizer state the optimizer creates) in
    /// `host` memory, [`Backend::host`], when given: the device keeps the compute weights
    /// and the gradient, and the update runs on the host.
    pub fn init_with_host(
        backend: &dyn Backend,
        host: Option<&Arc<dyn Backend>>,
        spec: &ParamInit,
        rng: &mut Rng,
        precision: &dyn Precision,
    ) -> Result<Param> {
        Self::init_placed(backend, host, None, spec, rng, precision)
    }

    /// As [`Param::init_with_host`], with the weights in `stream`, the device's host memory
    /// ([`Backend::host`]), when given: they are streamed
    /// ([`crate::placement::Placement::Streamed`]), counted under
    /// [`MemoryCategory::Streamed`] and copied to the device by [`Param::stage`] while a
    /// section reads them. A parameter that trains streams only with its optimizer side in
    /// `host` too (its update runs there and writes the streamed weights in place); without
    /// it, an error.
    pub fn init_placed(
        backend: &dyn Backend,
        host: Option<&Arc<dyn Backend>>,
        stream: Option<&Arc<dyn Backend>>,
        spec: &ParamInit,
        rng: &mut Rng,
        precision: &dyn Precision,
    ) -> Result<Param> {
        Self::init_loaded(backend, host, stream, spec, None, rng, precision)
    }

    /// As [`Param::init_placed`], with `loaded` the initial values where they come from
    /// elsewhere (a model directory's, row-major, `spec`'s shape) instead of `spec`'s
    /// initialisation: nothing is drawn for them, and `rng` moves on as the drawing would
    /// have moved it ([`ParamInit::draws`]), so that the parameters after this one draw
    /// the values they draw without it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn init_loaded(
        backend: &dyn Backend,
        host: Option<&Arc<dyn Backend>>,
        stream: Option<&Arc<dyn Backend>>,
        spec: &ParamInit,
        loaded: Option<&[f32]>,
        rng: &mut Rng,
        precision: &dyn Precision,
    ) -> Result<Param> {
        let host = host.filter(|_| spec.trains);
        if stream.is_some() && spec.trains && host.is_none() {
            return Err(Error::config(
                "placement",
                format!(
                    "`{}` trains, and a streamed weight that trains is updated on the host: \
                     keep the optimizer there too (--optimizer-offload, `[optimizer] offload \
                     = true`), or place the weights that train as resident (--stream-weights \
                     frozen)",
                    spec.name
                ),
            ));
        }
        // Values are read, drawn or skipped only where the backend keeps them.
        let values = match (backend.holds_data(), loaded) {
            (false, _) => None,
            (true, Some(values)) => {
                rng.skip(spec.draws());
                Some(Cow::Borrowed(values))
            }
            (true, None) => Some(Cow::Owned(spec.values(rng))),
        };
        let mut param = Self::build(
            backend,
            host,
            &spec.name,
            &spec.shape,
            values.as_deref(),
            precision,
            spec.trains,
            spec.dtype,
            stream,
        )?;
        param.streamed = stream.is_some();
        Ok(param)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        backend: &dyn Backend,
        host: Option<&Arc<dyn Backend>>,
        name: &str,
        shape: &[usize],
        init: Option<&[f32]>,
        precision: &dyn Precision,
        trains: bool,
        stored: Option<DType>,
        stream: Option<&Arc<dyn Backend>>,
    ) -> Result<Param> {
        if let Some(d) = stored.filter(|d| !d.is_float()) {
            if trains {
                return Err(Error::config(
                    "adapter",
                    format!(
                        "`{name}` is stored as {d}, which cannot train: only a frozen base \
                         weight is quantized"
                    ),
                ));
            }
        }
        let side: &dyn Backend = host.map_or(backend, |h| h.as_ref());
        let place = |be: &dyn Backend, dtype: DType, category: MemoryCategory| match init {
            Some(values) => be.upload(values, shape, dtype, category, name),
            None => be.zeros(shape, dtype, category, name),
        };
        let compute = precision.compute_dtype();
        let rounding = precision.update_rounding().filter(|_| trains);
        // Offloaded, the f32 values are kept on the host even where the precision keeps
        // none apart (fp32): the device's weights are their copy.
        let master =
            if (precision.master_weights() || host.is_some() && rounding.is_none()) && trains {
                Some(place(side, DType::F32, MemoryCategory::MasterWeights)?)
            } else {
                if compute != DType::F32 && trains && rounding.is_none() {
                    return Err(Error::config(
                        "precision",
                        format!(
                            "a precision without master weights must compute in f32, not \
                         {compute}, or say how updates are rounded (`update_rounding`)"
                        ),
                    ));
                }
                None
            };
        if rounding.is_some() && compute != DType::Bf16 {
            return Err(Error::config(
                "precision",
                format!("update rounding writes bf16 weights, not {compute}"),
            ));
        }
        let weight = match stream {
            Some(home) => place(
                home.as_ref(),
                stored.unwrap_or(compute),
                MemoryCategory::Streamed,
            )?,
            None => place(backend, stored.unwrap_or(compute), MemoryCategory::Weights)?,
        };
        // The compensation starts at zero: the weights are the initial values rounded.
        let compensation = match rounding {
            Some(r) if r.compensated() => Some(side.zeros(
                shape,
                DType::Bf16,
                MemoryCategory::MasterWeights,
                &compensation_label(name),
            )?),
            _ => None,
        };
        Ok(Param {
            name: name.to_string(),
            weight,
            master,
            grad: None,
            grad_dtype: precision.grad_dtype(),
            state: Vec::new(),
            weight_fresh: false,
            trains,
            rounding,
            compensation,
            host: host.cloned(),
            refresh_deferred: false,
            elsewhere: false,
            streamed: false,
            staged: None,
        })
    }

    /// The parameter's name (Hugging Face's, e.g. `transformer.h.0.attn.c_attn.weight`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.weight.shape()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.weight.numel()
    }

    /// Whether the parameter trains. A frozen one has no gradient after backward, no
    /// optimizer state and no master copy: optimizers skip it.
    pub fn trains(&self) -> bool {
        self.trains
    }

    /// Whether this process updates the parameter: it trains, and no other rank owns its
    /// update (ZeRO-1, [`crate::TrainerOptions::zero_stage`]).
    pub fn updated_here(&self) -> bool {
        self.trains && !self.elsewhere
    }

    /// Hands this parameter's update to another rank (ZeRO-1): its optimizer side (f32
    /// master weights, optimizer state, Kahan compensation) is freed here, where the
    /// parameter keeps its compute weights and gradient and takes the owner's updated
    /// weights after each step. A frozen parameter is left as it is.
    pub(crate) fn hand_over(&mut self) {
        if !self.trains {
            return;
        }
        self.elsewhere = true;
        if self.rounding.is_none() {
            self.master = None;
        }
        self.state.clear();
        self.compensation = None;
    }

    /// The compute weights, to be overwritten whole (the owner's update received).
    pub(crate) fn weight_mut(&mut self) -> &mut Tensor {
        &mut self.weight
    }

    /// Whether weight decay applies: matrices and embeddings (rank >= 2), not biases or
    /// norm gains.
    pub fn decays(&self) -> bool {
        self.weight.rank() >= 2
    }

    /// The weights forward and backward read (compute dtype): a streamed parameter's copy
    /// on the device while it is staged ([`Param::stage`]), else its weights in host
    /// memory.
    pub fn weight(&self) -> &Tensor {
        self.staged.as_ref().unwrap_or(&self.weight)
    }

    /// Whether the weights live in host memory and are copied to the device while a
    /// section reads them ([`crate::placement::Placement::Streamed`]).
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// Whether a streamed parameter's weights are on the device now ([`Param::stage`]).
    pub fn staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Starts copying a streamed parameter's weights to the device (on the backend's copy
    /// stream, where it has one: compute waits for the copy where the weights are first
    /// read), unless they are there already; returns the bytes copied. A no-op for a
    /// resident parameter.
    pub fn stage(&mut self, backend: &dyn Backend) -> Result<u64> {
        if !self.streamed || self.staged.is_some() {
            return Ok(0);
        }
        let mut staged = backend.empty(
            self.weight.shape(),
            self.weight.dtype(),
            MemoryCategory::Weights,
            &self.name,
        )?;
        backend.transfer_queued(&mut staged, &self.weight)?;
        self.staged = Some(staged);
        Ok(self.weight.bytes())
    }

    /// Frees a streamed parameter's copy on the device, once no section about to run
    /// reads it.
    pub fn unstage(&mut self) {
        self.staged = None;
    }

    /// The f32 values the optimizer updates (master copy, or the weights in f32 training;
    /// a frozen parameter's compute weights).
    pub fn value(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(&self.weight)
    }

    /// The accumulated gradient, once backward has run.
    pub fn grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }

    /// The parameter as an optimizer updates it ([`ParamUpdate`]), its state slots
    /// allocated on `backend` as `slots` declares when it has none yet; with `fused`, the
    /// compute weights (when kept apart from the values) for the optimizer to write in
    /// the same pass, as the fused AdamW kernel does: the trainer then skips its own copy
    /// of the master weights into them. Fails if no backward has produced a gradient yet.
    pub(crate) fn for_update(
        &mut self,
        backend: &dyn Backend,
        slots: &[StateSlot],
        fused: bool,
    ) -> Result<ParamUpdate<'_>> {
        grad_for_update(&self.name, self.trains, &self.grad)?;
        if self.state.is_empty() {
            for slot in slots {
                let label = format!("{}.{}", self.name, slot.name);
                let t = backend.zeros(
                    &slot.shape,
                    slot.dtype,
                    MemoryCategory::OptimizerState,
                    &label,
                )?;
                self.state.push(t);
            }
        }
        let decays = self.decays();
        let grad = self.grad.as_ref().expect("checked above");
        let (values, compute) = match self.master.as_mut() {
            // Pure bf16: the update is rounded as the precision says, after the step; an
            // offloaded update rounds its compute weights from the master copy after the
            // step too.
            Some(master) if !fused || self.rounding.is_some() || self.refresh_deferred => {
                (master, None)
            }
            Some(master) => {
                self.weight_fresh = true;
                (master, Some(&mut self.weight))
            }
            None => (&mut self.weight, None),
        };
        Ok(ParamUpdate {
            name: &self.name,
            values,
            compute,
            grad,
            state: &mut self.state,
            decays,
        })
    }

    /// The dtype this parameter's values are kept in between steps: its f32 master copy's
    /// when it keeps one, else its weights' (bf16 under pure bf16, whose update runs in an
    /// f32 copy made for it alone). Optimizers whose state follows the weights (AdamW's
    /// moments by default) key on it.
    pub fn kept_dtype(&self) -> DType {
        match &self.master {
            Some(master) if self.rounding.is_none() => master.dtype(),
            _ => self.weight.dtype(),
        }
    }

    /// How updates are written back into the weights when they have no f32 master copy
    /// ([`crate::precision::PureBf16`]); `None` otherwise.
    pub fn update_rounding(&self) -> Option<UpdateRounding> {
        self.rounding
    }

    /// The Kahan compensation of pure bf16 weights (`{name}.kahan`), when kept.
    pub fn compensation(&self) -> Option<&Tensor> {
        self.compensation.as_ref()
    }

    /// Replaces the Kahan compensation (a resumed checkpoint's); an error when the
    /// parameter keeps none or the shape differs.
    pub(crate) fn set_compensation(&mut self, backend: &dyn Backend, data: &[f32]) -> Result<()> {
        let label = compensation_label(&self.name);
        if self.compensation.is_none() || data.len() != self.numel() {
            return Err(Error::data(
                &label,
                format!(
                    "has {} values for a parameter of {} that {}",
                    data.len(),
                    self.numel(),
                    if self.compensation.is_some() {
                        "keeps one per element"
                    } else {
                        "keeps no compensation (the run's update rounding is not kahan)"
                    }
                ),
            ));
        }
        let shape = self.shape().to_vec();
        let side = self.host.as_deref().unwrap_or(backend);
        self.compensation = Some(side.upload(
            data,
            &shape,
            DType::Bf16,
            MemoryCategory::MasterWeights,
            &label,
        )?);
        Ok(())
    }

    /// Before an optimizer updates a parameter without master weights whose values are
    /// bf16 (pure bf16): widens the weights (plus their compensation) into a transient f32
    /// buffer, which the update then reads as the values to update, until
    /// `Param::refresh_after_step` rounds them back and frees it. A no-op otherwise.
    pub fn begin_update(&mut self, backend: &dyn Backend) -> Result<()> {
        if self.rounding.is_none() || self.master.is_some() {
            return Ok(());
        }
        // `expand` writes every element.
        let mut values = backend.empty(
            self.weight.shape(),
            DType::F32,
            MemoryCategory::MasterWeights,
            &format!("{}.update", self.name),
        )?;
        update_rounding::expand(
            backend,
            &mut values,
            &self.weight,
            self.compensation.as_ref(),
        )?;
        self.master = Some(values);
        Ok(())
    }

    /// Optimizer state slots (empty until the optimizer's first step).
    pub fn state(&self) -> &[Tensor] {
        &self.state
    }

    /// The gradient, to change in place, when there is one.
    pub(crate) fn grad_if_any_mut(&mut self) -> Option<&mut Tensor> {
        self.grad.as_mut()
    }

    /// The gradient buffer, allocated (zeroed) on first use, for setting a gradient by
    /// hand (tests, a custom loop); ops accumulate through [`Param::for_backward`], which
    /// gives a frozen parameter none.
    pub fn grad_mut(&mut self, backend: &dyn Backend) -> Result<&mut Tensor> {
        if self.grad.is_none() {
            let g = backend.zeros(
                self.weight.shape(),
                self.grad_dtype,
                MemoryCategory::Gradients,
                &self.name,
            )?;
            self.grad = Some(g);
        }
        Ok(self.grad.as_mut().expect("allocated above"))
    }

    /// The parameter as an op's backward sees it ([`ParamGrad`]): its weights, and its
    /// gradient when it trains.
    pub fn for_backward(&mut self) -> ParamGrad<'_> {
        let grad = self.trains.then_some(&mut self.grad);
        let weight = self.staged.as_ref().unwrap_or(&self.weight);
        ParamGrad::new(&self.name, weight, grad, self.grad_dtype)
    }

    /// Frees the gradient (after the optimizer used it inside backward); the next
    /// backward allocates it again.
    pub(crate) fn drop_grad(&mut self) {
        self.grad = None;
    }

    /// Takes the gradient out (the running sum of a step's earlier micro-batches), so
    /// that backward computes the next micro-batch's apart.
    pub(crate) fn take_grad(&mut self) -> Option<Tensor> {
        self.grad.take()
    }

    /// Adds the gradient backward computed apart to `sum` (what [`Param::take_grad`]
    /// took out), rounded once to its dtype, and keeps the result as the gradient.
    pub(crate) fn fold_grad(&mut self, backend: &dyn Backend, mut sum: Tensor) -> Result<()> {
        if let Some(fresh) = self.grad.take() {
            backend.axpy(&mut sum, 1.0, &fresh)?;
        }
        self.grad = Some(sum);
        Ok(())
    }

    /// Zeroes the gradient (kept allocated, as PyTorch's `zero_grad(set_to_none=False)`).
    pub(crate) fn zero_grad(&mut self, backend: &dyn Backend) -> Result<()> {
        if let Some(g) = self.grad.as_mut() {
            backend.fill(g, 0.0)?;
        }
        Ok(())
    }

    /// Replaces the parameter's value (master weights where kept, else the weights) with
    /// `data` (row-major, as many values as the shape holds), then refreshes the compute
    /// weights.
    pub fn set_value(&mut self, backend: &dyn Backend, data: &[f32]) -> Result<()> {
        if data.len() != self.numel() {
            return Err(Error::data(
                &self.name,
                format!(
                    "has {} values, the model needs {} for shape {:?}",
                    data.len(),
                    self.numel(),
                    self.shape()
                ),
            ));
        }
        let shape = self.shape().to_vec();
        let side = self.host.as_deref().unwrap_or(backend);
        match &mut self.master {
            Some(master) => {
                *master = side.upload(
                    data,
                    &shape,
                    DType::F32,
                    MemoryCategory::MasterWeights,
                    &self.name,
                )?
            }
            None if self.streamed => {
                self.staged = None;
                let home = backend
                    .host()
                    .ok_or_else(|| no_host_to_stream(backend, &self.name))?;
                self.weight = home.upload(
                    data,
                    &shape,
                    self.weight.dtype(),
                    MemoryCategory::Streamed,
                    &self.name,
                )?
            }
            None => {
                self.weight = backend.upload(
                    data,
                    &shape,
                    self.weight.dtype(),
                    MemoryCategory::Weights,
                    &self.name,
                )?
            }
        }
        self.refresh_weight(backend)
    }

    /// Replaces the optimizer's per-parameter state (what [`Param::state`] returns).
    pub(crate) fn set_state(&mut self, state: Vec<Tensor>) {
        self.state = state;
    }

    /// Copies the master weights into the compute weights after an optimizer step,
    /// unless the optimizer already wrote them ([`Param::update_parts_fused`]); for pure
    /// bf16, rounds the updated values back into the weights (stochastic rounding draws
    /// from stream `key`, [`update_rounding::stream_key`]) and frees them.
    pub(crate) fn refresh_after_step(&mut self, backend: &dyn Backend, key: u64) -> Result<()> {
        if let Some(mode) = self.rounding {
            let Some(values) = self.master.take() else {
                return Ok(());
            };
            return update_rounding::round(
                backend,
                &mut self.weight,
                self.compensation.as_mut(),
                &values,
                mode,
                key,
            );
        }
        if std::mem::take(&mut self.weight_fresh) {
            return Ok(());
        }
        self.refresh_weight(backend)
    }

    /// The key of this parameter's stochastic-rounding stream at `step` of a run seeded
    /// with `seed`: a hash of its name, so that it does not depend on the model's order.
    pub(crate) fn rounding_key(&self, seed: u64, step: u64) -> u64 {
        update_rounding::stream_key(seed, step, crate::rng::name_hash(&self.name))
    }

    pub(crate) fn refresh_weight(&mut self, backend: &dyn Backend) -> Result<()> {
        self.weight_fresh = false;
        let Some(master) = &self.master else {
            return Ok(());
        };
        match self.host.as_deref() {
            // Streamed weights live beside the master copy: rounded in place, once the
            // copies reading them have run.
            Some(host) if self.streamed => host.cast(
                streamed_home(&mut self.staged, &mut self.weight, backend)?,
                master,
            ),
            // The master copy is in host memory and the weights on the device: rounded on
            // the host, then copied over.
            Some(host) if !is_same(host, backend) => {
                let mut rounded = host.empty(
                    self.weight.shape(),
                    self.weight.dtype(),
                    MemoryCategory::Weights,
                    &self.name,
                )?;
                host.cast(&mut rounded, master)?;
                backend.transfer_queued(&mut self.weight, &rounded)
            }
            _ => backend.cast(&mut self.weight, master),
        }
    }

    /// Whether the optimizer's side of this parameter is in host memory
    /// ([`Param::init_with_host`]).
    pub fn offloaded(&self) -> bool {
        self.host.is_some()
    }

    /// The backend the optimizer's side of this parameter lives on (its master weights,
    /// compensation and state): its host memory when the optimizer is offloaded, else
    /// `backend`.
    pub fn state_backend<'a>(&'a self, backend: &'a dyn Backend) -> &'a dyn Backend {
        self.host.as_deref().unwrap_or(backend)
    }

    /// Takes this offloaded parameter's update out for a host thread
    /// ([`Param::offloaded`]): its gradient and `record` (the guard's) are copied to host
    /// memory, pure bf16's weights too (the update reads them), and its optimizer side
    /// moves into the returned [`HostUpdate`], made ready for the optimizer
    /// ([`Param::begin_update`]). The device keeps the compute weights and the gradient
    /// until [`Param::finish_host_update`] puts the update back.
    pub(crate) fn start_host_update(
        &mut self,
        backend: &dyn Backend,
        record: &Tensor,
    ) -> Result<HostUpdate> {
        let Some(host) = self.host.clone() else {
            return Err(Error::Backend {
                backend: "optimizer",
                message: format!("`{}` keeps its optimizer state on the device", self.name),
            });
        };
        let device_grad = grad_for_update(&self.name, self.trains, &self.grad)?;
        let shape = self.weight.shape().to_vec();
        let mut grad = host.empty(
            &shape,
            device_grad.dtype(),
            MemoryCategory::Gradients,
            &self.name,
        )?;
        // Queued where the host memory is page-locked: the host thread settles it before
        // the step reads it, and the trainer goes on meanwhile.
        backend.transfer_queued(&mut grad, device_grad)?;
        let mut weight = host.empty(
            &shape,
            self.weight.dtype(),
            MemoryCategory::Weights,
            &self.name,
        )?;
        if self.rounding.is_some() {
            if self.streamed {
                host.transfer(&mut weight, &self.weight)?;
            } else {
                backend.transfer(&mut weight, &self.weight)?;
            }
        }
        let mut host_record = host.empty(
            record.shape(),
            record.dtype(),
            MemoryCategory::Workspace,
            record.label(),
        )?;
        backend.transfer(&mut host_record, record)?;
        let mut param = Param {
            name: self.name.clone(),
            weight,
            master: self.master.take(),
            grad: Some(grad),
            grad_dtype: self.grad_dtype,
            state: std::mem::take(&mut self.state),
            weight_fresh: false,
            trains: self.trains,
            rounding: self.rounding,
            compensation: self.compensation.take(),
            host: None,
            refresh_deferred: true,
            elsewhere: false,
            streamed: false,
            staged: None,
        };
        param.begin_update(host.as_ref())?;
        Ok(HostUpdate {
            param,
            record: host_record,
        })
    }

    /// Puts back an update [`Param::start_host_update`] took out, once the optimizer has
    /// stepped it: the compute weights are refreshed on the host (rounded from the master
    /// copy, or pure bf16's rounding keyed by `key`), copied to the device, and the
    /// optimizer side returns to this parameter; the host copies are freed.
    pub(crate) fn finish_host_update(
        &mut self,
        backend: &dyn Backend,
        mut done: HostUpdate,
        key: u64,
    ) -> Result<()> {
        let host = self.host.clone();
        let refreshed = match host.as_deref() {
            Some(host) => done.param.refresh_after_step(host, key),
            None => Ok(()),
        };
        // Queued where the host memory is page-locked; its buffer is reused only once the
        // copy has run. Streamed weights are written in host memory, in place, once the
        // copies reading them have run.
        let copied = refreshed.and_then(|()| match host.as_deref() {
            Some(host) if self.streamed => host.transfer(
                streamed_home(&mut self.staged, &mut self.weight, backend)?,
                &done.param.weight,
            ),
            _ => backend.transfer_queued(&mut self.weight, &done.param.weight),
        });
        // The optimizer side comes back whatever happened, so the parameter stays whole.
        if done.param.rounding.is_none() {
            self.master = done.param.master.take();
        }
        self.state = std::mem::take(&mut done.param.state);
        self.compensation = done.param.compensation.take();
        copied
    }
}

/// A streamed parameter's weights in host memory, ready to be written in place: its
/// staged device copy dropped and every copy still reading the host weights run first.
fn streamed_home<'a>(
    staged: &mut Option<Tensor>,
    weight: &'a mut Tensor,
    backend: &dyn Backend,
) -> Result<&'a mut Tensor> {
    *staged = None;
    backend.settle(weight)?;
    Ok(weight)
}

/// The error of streaming `name`'s weights on a backend without host memory.
pub(crate) fn no_host_to_stream(backend: &dyn Backend, name: &str) -> Error {
    Error::config(
        "placement",
        format!(
            "the {} backend has no host memory to stream `{name}` from (Backend::host); place \
             the weights as resident (drop --stream-weights)",
            backend.name()
        ),
    )
}

/// Whether `a` and `b` are the same backend.
fn is_same(a: &dyn Backend, b: &dyn Backend) -> bool {
    std::ptr::addr_eq(a as *const dyn Backend, b as *const dyn Backend)
}

/// The label of parameter `name`'s Kahan compensation.
fn compensation_label(name: &str) -> String {
    format!("{name}.kahan")
}

/// The gradient an optimizer updates parameter `name` with, or the error of a parameter
/// without one.
fn grad_for_update<'a>(name: &str, trains: bool, grad: &'a Option<Tensor>) -> Result<&'a Tensor> {
    if !trains {
        return Err(Error::Backend {
            backend: "optimizer",
            message: format!(
                "`{name}` is frozen: an optimizer skips parameters whose `trains()` is false"
            ),
        });
    }
    grad.as_ref().ok_or_else(|| Error::Backend {
        backend: "optimizer",
        message: format!("`{name}` has no gradient: run backward first"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each element drawn one after another from one stream: the values [`draw`] gives
    /// in pieces on every core must equal these bit for bit.
    fn one_by_one(init: &Init, n: usize, rng: &mut Rng) -> Vec<f32> {
        match init {
            Init::Normal { std } => (0..n).map(|_| (rng.normal() * std) as f32).collect(),
            Init::Uniform { bound } => (0..n)
                .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                .collect(),
            _ => unreachable!("random initialisations only"),
        }
    }

    /// Drawn in pieces, a random initialisation is the one drawn element by element (on
    /// either side of a piece's end), the stream ends where drawing them one by one leaves
    /// it, and `draws` counts what it took; a padded vocabulary draws its rows alone.
    #[test]
    fn random_values_drawn_in_pieces_are_those_drawn_one_by_one() {
        let inits = [Init::Normal { std: 0.02 }, Init::Uniform { bound: 0.5 }];
        for init in &inits {
            for n in [0, 1, 3, DRAW_PIECE - 1, DRAW_PIECE, 2 * DRAW_PIECE + 5] {
                let spec = ParamInit {
                    name: "w".into(),
                    shape: vec![n],
                    init: init.clone(),
                    trains: true,
                    dtype: None,
                };
                let (mut pieces, mut single) = (Rng::new(7), Rng::new(7));
                let drawn = spec.values(&mut pieces);
                let expected = one_by_one(init, n, &mut single);
                assert!(
                    drawn
                        .iter()
                        .map(|v| v.to_bits())
                        .eq(expected.iter().map(|v| v.to_bits())),
                    "{init:?}, {n} values"
                );
                assert_eq!(pieces, single, "{init:?}, {n}: the stream after them");
                let mut skipped = Rng::new(7);
                skipped.skip(spec.draws());
                assert_eq!(skipped, single, "{init:?}, {n}: draws()");
            }
        }
        let padded = ParamInit {
            name: "wte".into(),
            shape: vec![5, DRAW_PIECE / 2],
            init: Init::Rows {
                rows: 3,
                init: Box::new(Init::Normal { std: 1.0 }),
            },
            trains: true,
            dtype: None,
        };
        let (mut rng, mut single) = (Rng::new(3), Rng::new(3));
        let values = padded.values(&mut rng);
        let rows = one_by_one(&Init::Normal { std: 1.0 }, 3 * DRAW_PIECE / 2, &mut single);
        assert_eq!(values[..rows.len()], rows[..]);
        assert!(values[rows.len()..].iter().all(|&v| v == 0.0));
        assert_eq!(rng, single);
        assert_eq!(padded.draws(), 3 * DRAW_PIECE as u64);
        let constant = ParamInit {
            init: Init::Constant(1.0),
            ..padded
        };
        assert_eq!(constant.draws(), 0);
    }
}
