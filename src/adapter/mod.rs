//! Which parameters train: the [`Adapter`] policy, and LoRA, its shipped low-rank form.
//!
//! Fine-tuning rarely trains every weight. An [`Adapter`] decides, per parameter of the
//! base model, whether it trains, and may add a low-rank update to any linear projection,
//! chosen by its Hugging Face module name (`model.layers.3.self_attn.q_proj`,
//! `transformer.h.3.attn.c_attn`). A frozen parameter gets no gradient buffer, no
//! optimizer state and no f32 master copy: it stays in the compute dtype, and the
//! products that would only serve its gradient are not run.
//!
//! [`FullFineTune`] trains everything (the default); [`Lora`] freezes the base and adds
//! `(α/r) · B·A` beside the projections it targets, as PEFT's LoRA does. Adapters are
//! policies like the other five: serializable by their `kind` tag, writable in a crate of
//! your own.

pub mod merge;
pub mod peft;

use crate::error::{Error, Result};
use crate::tensor::DType;
use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// A low-rank update `ΔW = scale · B·A` of one linear projection: `A` is `[rank, in]`,
/// `B` is `[out, rank]`, and the projection's output gains `scale · (x Aᵀ) Bᵀ`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LowRank {
    /// The rank `r`.
    pub rank: usize,
    /// The scale applied to `B·A` (LoRA's `α/r`, rsLoRA's `α/√r`).
    pub scale: f32,
    /// The probability that an element of the update's input is zeroed in training
    /// (PEFT's `lora_dropout`; the kept ones scaled by `1/(1 − p)`); 0 for none.
    pub dropout: f32,
    /// DoRA (PEFT's `use_dora`): the adapted weight's rows rescaled to a trained
    /// magnitude ([`crate::ops::lora::dora`]).
    pub dora: bool,
}

/// Which parameters of a model train, and which projections get a low-rank update.
///
/// The model asks [`Adapter::trains`] for every base parameter by its name in trainkit
/// (Hugging Face's, with trainkit's fused `qkv_proj` and `gate_up_proj`), and
/// [`Adapter::low_rank`] for every linear projection by its Hugging Face module name, with
/// its input and output widths. The low-rank parameters it adds always train.
#[typetag::serde(tag = "kind")]
pub trait Adapter: DynClone + Debug + Send + Sync {
    /// Whether the base parameter `name` trains.
    fn trains(&self, name: &str) -> bool;

    /// The low-rank update of the projection `module` (`in_features` → `out_features`),
    /// or `None` for none.
    fn low_rank(&self, module: &str, in_features: usize, out_features: usize) -> Option<LowRank>;

    /// Checks the policy against the model's projection modules (their Hugging Face
    /// names): an error names what matches nothing. The default accepts everything.
    fn check(&self, modules: &[String]) -> Result<()> {
        let _ = modules;
        Ok(())
    }

    /// Checks the policy against the names of the base parameters outside the
    /// projections (`model.norm.weight`, `lm_head.weight`, ...): an error names what
    /// matches nothing. The default accepts everything.
    fn check_params(&self, names: &[String]) -> Result<()> {
        let _ = names;
        Ok(())
    }

    /// The dtype the frozen base projections' weights are stored in instead of the
    /// compute dtype: [`DType::Nf4`] for QLoRA. Embeddings, norms, biases and the output
    /// head are never quantized. The default stores them as the precision says.
    fn base_dtype(&self) -> Option<DType> {
        None
    }

    /// The LoRA settings, when this is [`Lora`]: what the PEFT files record.
    fn as_lora(&self) -> Option<&Lora> {
        None
    }
}

dyn_clone::clone_trait_object!(Adapter);

/// Where the low-rank update of `module` lives in trainkit's parameter list (and, under
/// PEFT's prefix, in its files): its `lora_A` and `lora_B` names.
pub fn param_names(module: &str) -> [String; 2] {
    [
        format!("{module}.lora_A.weight"),
        format!("{module}.lora_B.weight"),
    ]
}

/// The Hugging Face name of every family's output head (GPT-2's, Llama's, Qwen's): where
/// PEFT writes again an embedding the head is tied to (`ensure_weight_tying`).
pub const HEAD_WEIGHT: &str = "lm_head.weight";

/// Where a DoRA update of `module` keeps its magnitude (PEFT's name in its files):
/// `{module}.lora_magnitude_vector`.
pub fn magnitude_name(module: &str) -> String {
    format!("{module}.lora_magnitude_vector")
}

/// The module a parameter belongs to: `name` without its last part (`.weight`, `.bias`).
fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(m, _)| m)
}

/// Whether `name` is the parameter of a low-rank update (`….lora_A.weight`,
/// `….lora_B.weight`) rather than of the base model.
pub fn is_update_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight")
        || name.ends_with(".lora_B.weight")
        || name.ends_with(".lora_magnitude_vector")
}

/// PEFT's default targets for a model whose projections are `modules` (Hugging Face
/// module names, as [`crate::model::AnyFamily::projection_modules`] lists them): the
/// queries and values (`q_proj`, `v_proj`), GPT-2's fused `c_attn`, or every linear
/// projection for a model with neither.
pub fn default_targets(modules: &[String]) -> Vec<String> {
    let has = |t: &str| modules.iter().any(|m| m.rsplit('.').next() == Some(t));
    if has("q_proj") && has("v_proj") {
        vec!["q_proj".into(), "v_proj".into()]
    } else if has("c_attn") {
        vec!["c_attn".into()]
    } else {
        vec![ALL_LINEAR.into()]
    }
}

/// Every parameter trains and nothing is added: full fine-tuning (and pretraining).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FullFineTune;

#[typetag::serde(name = "full")]
impl Adapter for FullFineTune {
    fn trains(&self, _name: &str) -> bool {
        true
    }

    fn low_rank(&self, _module: &str, _in: usize, _out: usize) -> Option<LowRank> {
        None
    }
}

/// Nothing trains and nothing is added: a frozen model to evaluate or sample from, its
/// projections stored as `base` says (`trainkit eval --qlora` measures what NF4 alone
/// costs a model).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Frozen {
    /// How the projections are stored.
    #[serde(default)]
    pub base: BaseWeights,
}

#[typetag::serde(name = "frozen")]
impl Adapter for Frozen {
    fn trains(&self, _name: &str) -> bool {
        false
    }

    fn low_rank(&self, _module: &str, _in: usize, _out: usize) -> Option<LowRank> {
        None
    }

    fn base_dtype(&self) -> Option<DType> {
        self.base.dtype()
    }
}

/// LoRA (Hu et al., 2021), as PEFT builds it: the base model frozen, and on each
/// projection whose module name ends in one of `targets` a low-rank update
/// `(α/r) · B·A`, `A` Kaiming-uniform (as `nn.Linear`'s initialisation) and `B` zero, so
/// training starts from the base model exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lora {
    /// The rank `r` (at least 1).
    pub rank: usize,
    /// `α`: the update is scaled by `α/r` (or `α/√r` with `rslora`).
    pub alpha: f64,
    /// The projections adapted, by the last part of their Hugging Face module names:
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, or
    /// GPT-2's `c_attn`, `c_proj`, `c_fc`; `all-linear` adapts every projection.
    pub targets: Vec<String>,
    /// rsLoRA's scaling `α/√r` (Kalajdzievski, 2023) instead of `α/r`.
    #[serde(default)]
    pub rslora: bool,
    /// How the frozen base projections are stored: as the precision says, or in NF4
    /// (QLoRA, Dettmers et al., 2023).
    #[serde(default, skip_serializing_if = "BaseWeights::is_compute")]
    pub base: BaseWeights,
    /// PEFT's `lora_dropout`: in training, each element of an update's input is zeroed
    /// with this probability (the rest scaled by `1/(1 − p)`), drawn anew for every
    /// micro-batch and every adapted projection; evaluation, sampling and merging use no
    /// dropout. In `[0, 1)`; 0 (the default) for none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropout: f64,
    /// DoRA (Liu et al., 2024; PEFT's `use_dora`): each adapted projection's output
    /// features are rescaled by a trained magnitude `m` over the norm of their row of
    /// `W + (α/r)·B·A` (detached, as PEFT does), `m` starting at the base rows' norms so
    /// that training starts from the base model exactly. The base must be frozen. With
    /// `dropout`, the base also runs on the dropped input, as PEFT's DoRA does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dora: bool,
    /// PEFT's `modules_to_save`: base modules (not projections) trained whole beside the
    /// adapter and saved with it, each matching every module whose name ends with it, as
    /// PEFT matches them (`lm_head`, `embed_tokens`, `norm`). A token embedding its head
    /// shares trains once for both, as PEFT's `ensure_weight_tying` keeps them tied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules_to_save: Vec<String>,
}

fn is_zero(p: &f64) -> bool {
    *p == 0.0
}

/// How [`Lora`] stores the frozen weights of the base model's projections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseWeights {
    /// In the precision's compute dtype (LoRA).
    #[default]
    Compute,
    /// In NF4 with double-quantized absmaxes, 4.127 bits per weight, quantized once when
    /// the weights are loaded and dequantized a block at a time in each product (QLoRA).
    Nf4,
}

impl BaseWeights {
    fn is_compute(&self) -> bool {
        *self == BaseWeights::Compute
    }

    /// The dtype the frozen projections are stored in, when not the compute dtype
    /// ([`Adapter::base_dtype`]).
    pub fn dtype(self) -> Option<DType> {
        (self == BaseWeights::Nf4).then_some(DType::NF4)
    }
}

/// The projection names LoRA knows, Llama's layout then GPT-2's.
pub const PROJECTIONS: [&str; 10] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
    "c_fc",
];

/// The target that adapts every linear projection (PEFT's `all-linear`, the output head
/// excepted).
pub const ALL_LINEAR: &str = "all-linear";

impl Lora {
    /// LoRA of rank `rank` and scale `alpha / rank` on `targets`; errors name what is
    /// wrong (a rank of 0, an α that is not a positive number, an empty or unknown target).
    pub fn new(rank: usize, alpha: f64, targets: &[&str]) -> Result<Lora> {
        let lora = Lora {
            rank,
            alpha,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            rslora: false,
            base: BaseWeights::Compute,
            dropout: 0.0,
            dora: false,
            modules_to_save: Vec::new(),
        };
        lora.validate()?;
        Ok(lora)
    }

    /// Fails unless the settings make a LoRA: errors name the field and what would fix it.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::config(
                "adapter.rank",
                "a LoRA rank must be at least 1 (8, 16 and 32 are common)",
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::config(
                "adapter.alpha",
                format!(
                    "{} is not a positive number (α = 2·r is common)",
                    self.alpha
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::config(
                "adapter.dropout",
                format!(
                    "{} is not a dropout probability in [0, 1) (PEFT's recipes use 0.05; 0 \
                     for none)",
                    self.dropout
                ),
            ));
        }
        if self.targets.is_empty() {
            return Err(Error::config(
                "adapter.targets",
                format!(
                    "name at least one projection: {} (or {ALL_LINEAR})",
                    PROJECTIONS.join(", ")
                ),
            ));
        }
        for t in &self.targets {
            if t != ALL_LINEAR && !PROJECTIONS.contains(&t.as_str()) {
                return Err(Error::config(
                    "adapter.targets",
                    format!(
                        "`{t}` is not a projection trainkit adapts; use {} (or {ALL_LINEAR})",
                        PROJECTIONS.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The scale of `B·A`: `α/r`, or `α/√r` with rsLoRA.
    pub fn scale(&self) -> f32 {
        let r = self.rank as f64;
        (if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }) as f32
    }

    /// The same LoRA over a base stored in NF4 (QLoRA).
    pub fn with_nf4_base(mut self) -> Lora {
        self.base = BaseWeights::Nf4;
        self
    }

    /// Whether the base parameter `name` (`{module}.weight` or `.bias`) belongs to a
    /// module of [`Lora::modules_to_save`].
    pub fn saves(&self, name: &str) -> bool {
        let module = module_of(name);
        self.modules_to_save
            .iter()
            .any(|m| module.ends_with(m.as_str()))
    }

    /// Whether the projection `module` is one of the targets.
    pub fn targets_module(&self, module: &str) -> bool {
        let last = module.rsplit('.').next().unwrap_or(module);
        self.targets.iter().any(|t| t == ALL_LINEAR || t == last)
    }
}

#[typetag::serde(name = "lora")]
impl Adapter for Lora {
    fn trains(&self, name: &str) -> bool {
        self.saves(name)
    }

    fn low_rank(&self, module: &str, _in: usize, _out: usize) -> Option<LowRank> {
        self.targets_module(module).then(|| LowRank {
            rank: self.rank,
            scale: self.scale(),
            dropout: self.dropout as f32,
            dora: self.dora,
        })
    }

    fn check(&self, modules: &[String]) -> Result<()> {
        self.validate()?;
        for m in &self.modules_to_save {
            if let Some(p) = modules.iter().find(|p| p.ends_with(m.as_str())) {
                return Err(Error::config(
                    "adapter.modules_to_save",
                    format!(
                        "`{m}` names a projection (`{p}`): LoRA adapts projections \
                         (adapter.targets), modules_to_save trains other modules whole"
                    ),
                ));
            }
        }
        for t in &self.targets {
            if t == ALL_LINEAR {
                continue;
            }
            if !modules
                .iter()
                .any(|m| m.rsplit('.').next() == Some(t.as_str()))
            {
                let mut names: Vec<&str> = modules
                    .iter()
                    .filter_map(|m| m.rsplit('.').next())
                    .collect();
                names.sort_unstable();
                names.dedup();
                return Err(Error::config(
                    "adapter.targets",
                    format!(
                        "this model has no `{t}` projection; its projections are {}",
                        names.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_params(&self, names: &[String]) -> Result<()> {
        for m in &self.modules_to_save {
            if !names.iter().any(|n| module_of(n).ends_with(m.as_str())) {
                let mut modules: Vec<&str> = names
                    .iter()
                    .map(|n| module_of(n).rsplit('.').next().unwrap_or_default())
                    .collect();
                modules.sort_unstable();
                modules.dedup();
                return Err(Error::config(
                    "adapter.modules_to_save",
                    format!(
                        "`{m}` matches no module of this model; its modules besides the \
                         projections are {}",
                        modules.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    fn base_dtype(&self) -> Option<DType> {
        self.base.dtype()
    }

    fn as_lora(&self) -> Option<&Lora> {
        Some(self)
    }
}
