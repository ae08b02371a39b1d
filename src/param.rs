//! `Param`: one named parameter with its compute weights, master copy, gradient and
//! optimizer state; `ParamInit`, how a model declares one.

use crate::device::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::precision::Precision;
use crate::rng::Rng;
use crate::tensor::{DType, Tensor};

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
}

/// `n` values of `shape` drawn as `init` says.
fn draw(init: &Init, shape: &[usize], rng: &mut Rng) -> Vec<f32> {
    let n = shape.iter().product();
    match init {
        Init::Normal { std } => (0..n).map(|_| (rng.normal() * std) as f32).collect(),
        Init::Constant(v) => vec![*v; n],
        Init::Values(v) => v.clone(),
        Init::Uniform { bound } => (0..n)
            .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
            .collect(),
        Init::Rows { rows, init } => {
            let mut part = shape.to_vec();
            if let Some(first) = part.first_mut() {
                *first = (*rows).min(*first);
            }
            let mut values = draw(init, &part, rng);
            values.resize(n, 0.0);
            values
        }
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
}

/// What an optimizer needs to update one parameter, with the compute weights it may
/// write in the same pass ([`Param::update_parts_fused`]).
pub struct UpdateParts<'a> {
    /// The f32 values to update.
    pub value: &'a mut Tensor,
    /// The compute weights to overwrite with the updated values (rounded to their
    /// dtype), when they are kept apart from `value`.
    pub compute: Option<&'a mut Tensor>,
    /// The accumulated gradient.
    pub grad: &'a Tensor,
    /// The optimizer's state slots.
    pub state: &'a mut Vec<Tensor>,
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
        Self::build(backend, name, shape, Some(init), precision, true, None)
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
        Self::build(backend, name, shape, Some(init), precision, false, None)
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
        if backend.holds_data() {
            let values = spec.values(rng);
            Self::build(
                backend,
                &spec.name,
                &spec.shape,
                Some(&values),
                precision,
                spec.trains,
                spec.dtype,
            )
        } else {
            Self::build(
                backend,
                &spec.name,
                &spec.shape,
                None,
                precision,
                spec.trains,
                spec.dtype,
            )
        }
    }

    fn build(
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        init: Option<&[f32]>,
        precision: &dyn Precision,
        trains: bool,
        stored: Option<DType>,
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
        let place = |dtype: DType, category: MemoryCategory| match init {
            Some(values) => backend.upload(values, shape, dtype, category, name),
            None => backend.zeros(shape, dtype, category, name),
        };
        let compute = precision.compute_dtype();
        let master = if precision.master_weights() && trains {
            Some(place(DType::F32, MemoryCategory::MasterWeights)?)
        } else {
            if compute != DType::F32 && trains {
                return Err(Error::config(
                    "precision",
                    format!(
                        "a precision without master weights must compute in f32, not {compute}"
                    ),
                ));
            }
            None
        };
        let weight = place(stored.unwrap_or(compute), MemoryCategory::Weights)?;
        Ok(Param {
            name: name.to_string(),
            weight,
            master,
            grad: None,
            grad_dtype: precision.grad_dtype(),
            state: Vec::new(),
            weight_fresh: false,
            trains,
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

    /// Whether weight decay applies: matrices and embeddings (rank >= 2), not biases or
    /// norm gains.
    pub fn decays(&self) -> bool {
        self.weight.rank() >= 2
    }

    /// The weights forward and backward read (compute dtype).
    pub fn weight(&self) -> &Tensor {
        &self.weight
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

    /// The values to update, the gradient and the optimizer state slots, together.
    /// Fails if no backward has produced a gradient yet.
    pub fn update_parts(&mut self) -> Result<(&mut Tensor, &Tensor, &mut Vec<Tensor>)> {
        let grad = grad_for_update(&self.name, self.trains, &self.grad)?;
        let value = self.master.as_mut().unwrap_or(&mut self.weight);
        Ok((value, grad, &mut self.state))
    }

    /// As [`Param::update_parts`], with the compute weights (when kept apart from the
    /// values) for the optimizer to write in the same pass as its update, as the fused
    /// AdamW kernel does. The optimizer must write them when it gets them: the trainer
    /// then skips its own copy of the master weights into the compute weights.
    pub fn update_parts_fused(&mut self) -> Result<UpdateParts<'_>> {
        let grad = grad_for_update(&self.name, self.trains, &self.grad)?;
        let (value, compute) = match self.master.as_mut() {
            Some(master) => {
                self.weight_fresh = true;
                (master, Some(&mut self.weight))
            }
            None => (&mut self.weight, None),
        };
        Ok(UpdateParts {
            value,
            compute,
            grad,
            state: &mut self.state,
        })
    }

    /// Optimizer state slots (empty until the optimizer's first step).
    pub fn state(&self) -> &[Tensor] {
        &self.state
    }

    /// The gradient buffer, allocated (zeroed) on first use: what an op node's backward
    /// accumulates its parameter's gradient into (add to it, never overwrite: several
    /// nodes and micro-batches add up in it). Ops skip the gradients of frozen parameters
    /// where they can; one that cannot (a norm's gain, computed with its input's gradient)
    /// gets a buffer that the executor frees once the op's backward is done.
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

    /// The compute weights and the gradient buffer, for an op that reads one and
    /// accumulates into the other.
    pub fn weight_and_grad(&mut self, backend: &dyn Backend) -> Result<(&Tensor, &mut Tensor)> {
        self.grad_mut(backend)?;
        Ok((&self.weight, self.grad.as_mut().expect("allocated above")))
    }

    /// Frees the gradient (after the optimizer used it inside backward); the next
    /// backward allocates it again.
    pub(crate) fn drop_grad(&mut self) {
        self.grad = None;
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
        match &mut self.master {
            Some(master) => {
                *master = backend.upload(
                    data,
                    &shape,
                    DType::F32,
                    MemoryCategory::MasterWeights,
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
    /// unless the optimizer already wrote them ([`Param::update_parts_fused`]).
    pub(crate) fn refresh_after_step(&mut self, backend: &dyn Backend) -> Result<()> {
        if std::mem::take(&mut self.weight_fresh) {
            return Ok(());
        }
        self.refresh_weight(backend)
    }

    pub(crate) fn refresh_weight(&mut self, backend: &dyn Backend) -> Result<()> {
        self.weight_fresh = false;
        if let Some(master) = &self.master {
            backend.cast(&mut self.weight, master)?;
        }
        Ok(())
    }
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
