//! Saving a trainer to a directory and restoring it: the model as Hugging Face reads it,
//! plus everything an exact resume needs.

use super::gather::{RowCache, Saved};
use super::Trainer;
use crate::accumulate::AccumulationSchedule;
use crate::adapter::{is_update_param, peft, Lora};
use crate::checkpoint::CheckpointPolicy;
use crate::data::DataCursor;
use crate::error::{Error, Result};
use crate::memory::{MemoryCategory, MemoryObserver};
use crate::model::{read_model_dir, ModelDir, Param};
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::rng::Rng;
use crate::save::{
    read_typed, write_stored, DirectoryWriter, NamedTensor, StoredTensor, RUN_CONFIG_FILE,
    STATE_FILE, STATE_TENSORS_FILE, WEIGHTS_FILE,
};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Identifies a trainer state file.
const STATE_FORMAT: &str = "trainkit-trainer-state";
/// The state file's layout version.
const STATE_VERSION: u32 = 1;

/// `trainer_state.json`: the counters and settings that, with the tensors, make a resume
/// exact.
#[derive(Debug, Serialize, Deserialize)]
struct TrainerState {
    format: String,
    version: u32,
    step: u64,
    tokens_seen: u64,
    skipped_steps: u64,
    #[serde(default)]
    bad_streak: u64,
    /// The next batch's start in its shard's window order, in tokens (all a state without
    /// `data_cursor` has: one shard read in order).
    data_position: usize,
    data_tokens: usize,
    /// Where the data loader stands: epoch, shard and window.
    #[serde(default)]
    data_cursor: Option<DataCursor>,
    /// The data loader's shuffling seed, if it shuffles.
    #[serde(default)]
    data_shuffle: Option<u64>,
    rng: Rng,
    /// The ranks of the data-parallel job that saved it (1 alone): a resume with another
    /// number reshards ([`checkpoint_ranks`]).
    #[serde(default = "one_rank")]
    ranks: usize,
    /// Per parameter, the names of its optimizer-state tensors in
    /// `trainer_state.safetensors`, in slot order.
    optimizer_state: BTreeMap<String, Vec<String>>,
    /// The Kahan compensations of pure bf16 weights in `trainer_state.safetensors`
    /// (`{name}.kahan`), when the run keeps them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    compensation: Vec<String>,
    precision: serde_json::Value,
    /// The precision's running state (a dynamic loss scale and its counters), if any.
    #[serde(default)]
    precision_state: Option<serde_json::Value>,
    checkpoint: serde_json::Value,
    optimizer: serde_json::Value,
    accumulation: serde_json::Value,
}

/// The number of ranks of the data-parallel job that saved the resumable checkpoint `dir`
/// (1 for one process). A job of another number of ranks resumes it too
/// ([`crate::Trainer::resume_from`]): each rank takes the optimizer state of the
/// parameters it updates, and the data goes on from the saved position, so the run goes
/// on unchanged in meaning when ranks × micro-batches per step stays the same (as
/// `--separate-accumulation` makes one process accumulating two micro-batches take
/// bitwise the steps of two ranks).
pub fn checkpoint_ranks(dir: &Path) -> Result<usize> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        Error::data(
            path.display().to_string(),
            format!("is not a trainer state: {e}"),
        )
    })?;
    Ok(state.ranks)
}

fn one_rank() -> usize {
    1
}

impl<P, C, O, A, M> Trainer<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// The model's parameters as f32 tensors with their Hugging Face names: the master
    /// weights where the precision keeps them, else the weights.
    ///
    /// Under ZeRO-1 a parameter another rank updates gives its compute weights here (its
    /// master weights live on that rank); [`Trainer::save`] gathers them.
    pub fn model_tensors(&self) -> Result<Vec<NamedTensor>> {
        let here: Vec<Saved<'_>> = self.params.iter().map(Saved::Here).collect();
        let cache = RowCache::default();
        let tensors = self.model_tensors_of(&here, &cache)?;
        tensors.iter().map(StoredTensor::read).collect()
    }

    /// Each parameter's values here as f32, for those `wanted` says (empty for the rest).
    fn values_here(&self, wanted: fn(&Param) -> bool) -> Result<Vec<Vec<f32>>> {
        self.params
            .iter()
            .map(|p| match wanted(p) {
                true => self.backend.to_f32(p.value()),
                false => Ok(Vec::new()),
            })
            .collect()
    }

    /// The model's tensors as its files hold them, each read from `saved` (one per
    /// parameter, in model order) when asked; `cache` learns the rows the files ask of
    /// each parameter ([`RowCache::plan`]).
    fn model_tensors_of<'a>(
        &'a self,
        saved: &'a [Saved<'a>],
        cache: &'a RowCache,
    ) -> Result<Vec<StoredTensor<'a>>> {
        let be = self.backend.as_ref();
        let tensors: Vec<_> = self
            .params
            .iter()
            .zip(saved)
            .enumerate()
            .map(|(i, (p, s))| s.value(p, i, be, cache))
            .collect::<Result<_>>()?;
        let written = self.model.export_tensors(tensors.clone())?;
        cache.plan(&tensors, &written);
        Ok(written)
    }

    /// Saves the model (`config.json`, `model.safetensors`: what transformers'
    /// `from_pretrained` loads) and the trainer state (optimizer moments, step, data
    /// position, RNG, policies, and `run_config` as `trainkit.toml` when given) into
    /// `dir`, replacing it in one rename once everything is written.
    ///
    /// A run through LoRA saves the adapter instead of the model, as PEFT does
    /// (`adapter_config.json`, `adapter_model.safetensors`): the base stays where it was
    /// read from (`--init-from`), or is drawn again from the seed.
    ///
    /// In a data-parallel job rank 0 writes the directory; under ZeRO-1 every rank must
    /// call it (at the same step), sending rank 0 the parameters whose update it owns:
    /// the files are those an unsharded run writes.
    pub fn save(&self, dir: &Path, run_config: Option<&str>) -> Result<()> {
        // An adapter's checkpoint reads no value of the frozen base.
        let wanted = match self.lora() {
            Some(_) => in_adapter,
            None => |_: &Param| true,
        };
        let Some(saved) = self.saved_params(wanted)? else {
            return Ok(());
        };
        let be = self.backend.as_ref();
        let mut w = DirectoryWriter::new(dir)?;
        match self.lora() {
            Some(lora) => {
                let saved_whole =
                    |name: &String| self.params.iter().any(|p| p.name() == name && p.trains());
                let base = peft::BaseInfo {
                    name_or_path: self.adapter_base.clone(),
                    fan_in_fan_out: self.model.weights_in_out(),
                    tied_head: self.model.tied_head().filter(|(_, e)| saved_whole(e)),
                };
                let cache = RowCache::default();
                let adapter = self
                    .params
                    .iter()
                    .zip(&saved)
                    .enumerate()
                    .filter(|(_, (p, _))| in_adapter(p))
                    .map(|(i, (p, s))| s.value(p, i, be, &cache)?.read())
                    .collect::<Result<Vec<_>>>()?;
                peft::write(&w.path(""), lora, &base, &adapter)?;
            }
            None => {
                // A full model replaces an adapter saved there before: transformers would
                // apply the stale adapter on top of the model.
                w.supersede(&[peft::ADAPTER_CONFIG, peft::ADAPTER_WEIGHTS]);
                self.model.write_config(&w.path(""))?;
                let mut meta = HashMap::new();
                meta.insert("format".to_string(), "pt".to_string());
                let cache = RowCache::default();
                let tensors: Vec<_> = self
                    .model_tensors_of(&saved, &cache)?
                    .into_iter()
                    .map(|t| (t, DType::F32))
                    .collect();
                write_stored(&w.path(WEIGHTS_FILE), &tensors, Some(meta))?;
            }
        }

        let mut state_tensors = Vec::new();
        let mut optimizer_state = BTreeMap::new();
        let mut compensations = Vec::new();
        for (p, s) in self.params.iter().zip(&saved) {
            let (state, compensation) = s.state(be)?;
            let names = state.iter().map(|(t, _)| t.name.clone()).collect();
            optimizer_state.insert(p.name().to_string(), names);
            state_tensors.extend(state);
            compensations.extend(compensation);
        }
        let compensation = compensations.iter().map(|(t, _)| t.name.clone()).collect();
        state_tensors.extend(compensations);
        write_stored(&w.path(STATE_TENSORS_FILE), &state_tensors, None)?;
        let json = |v: Result<serde_json::Value, serde_json::Error>| {
            v.map_err(|e| Error::Serde(format!("saving the trainer state: {e}")))
        };
        let state = TrainerState {
            format: STATE_FORMAT.into(),
            version: STATE_VERSION,
            step: self.step,
            tokens_seen: self.tokens_seen,
            skipped_steps: self.skipped_steps,
            bad_streak: self.bad_streak,
            data_position: self.data.position(),
            data_tokens: self.data.len_tokens(),
            data_cursor: Some(self.data.cursor()),
            data_shuffle: self.data.shuffle_seed(),
            rng: self.rng.clone(),
            ranks: self.collective.world(),
            optimizer_state,
            compensation,
            precision: json(serde_json::to_value(&self.precision as &dyn Precision))?,
            precision_state: self.precision.state(),
            checkpoint: json(serde_json::to_value(
                &self.checkpoint as &dyn CheckpointPolicy,
            ))?,
            optimizer: json(serde_json::to_value(&self.optimizer as &dyn Optimizer))?,
            accumulation: json(serde_json::to_value(
                &self.accumulation as &dyn AccumulationSchedule,
            ))?,
        };
        let text = serde_json::to_string_pretty(&state)
            .map_err(|e| Error::Serde(format!("saving the trainer state: {e}")))?;
        w.write(STATE_FILE, text.as_bytes())?;
        if let Some(cfg) = run_config {
            w.write(RUN_CONFIG_FILE, cfg.as_bytes())?;
        }
        w.commit()
    }

    /// The LoRA settings of a run that trains a LoRA adapter alone (a frozen base).
    fn lora(&self) -> Option<&Lora> {
        let lora = self.model.adapter()?.as_lora()?;
        self.params.iter().any(|p| !p.trains()).then_some(lora)
    }

    /// The adapter's tensors, in model order: the low-rank updates'
    /// (`{module}.lora_A.weight`, ...) and, in a run that trains a LoRA, the base modules
    /// it trains whole (`modules_to_save`, by their own names).
    pub fn adapter_tensors(&self) -> Result<Vec<NamedTensor>> {
        Ok(self.adapter_tensors_of(self.values_here(in_adapter)?))
    }

    /// The adapter's tensors with `values` (one per parameter, in model order; those of
    /// parameters outside the adapter are not read).
    fn adapter_tensors_of(&self, values: Vec<Vec<f32>>) -> Vec<NamedTensor> {
        self.params
            .iter()
            .zip(values)
            .filter(|(p, _)| in_adapter(p))
            .map(|(p, data)| NamedTensor {
                name: p.name().to_string(),
                shape: p.shape().to_vec(),
                data,
            })
            .collect()
    }

    /// Records the base model a saved adapter names (`base_model_name_or_path`).
    pub fn set_adapter_base(&mut self, name_or_path: Option<String>) {
        self.adapter_base = name_or_path;
    }

    /// Loads a PEFT LoRA adapter (`--adapter DIR`, or a LoRA run's checkpoint) into the
    /// low-rank updates: its settings must be the model's (rank, α, targets) and every
    /// update must be there with its shape; a tensor for a module the model does not
    /// adapt is an error naming it.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        self.weights_from = None;
        let (lora, tensors) = peft::read(dir)?;
        let what = dir.join(peft::ADAPTER_CONFIG).display().to_string();
        let Some(ours) = self.model.adapter().and_then(|a| a.as_lora()) else {
            return Err(Error::data(
                &what,
                "holds a LoRA adapter, but this run trains no LoRA (add --lora-rank, or \
                 --adapter to start from it)",
            ));
        };
        if lora.rank != ours.rank || lora.alpha != ours.alpha || lora.rslora != ours.rslora {
            return Err(Error::data(
                &what,
                format!(
                    "is a LoRA of rank {} and α {}, this run's is rank {} and α {}; use the \
                     adapter's (drop --lora-rank and --lora-alpha)",
                    lora.rank, lora.alpha, ours.rank, ours.alpha
                ),
            ));
        }
        if lora.modules_to_save != ours.modules_to_save {
            return Err(Error::data(
                &what,
                format!(
                    "saves the modules {:?} beside its updates, this run's LoRA {:?}",
                    lora.modules_to_save, ours.modules_to_save
                ),
            ));
        }
        let mut by_name: HashMap<String, NamedTensor> =
            tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
        // A head tied to a trained embedding: PEFT (ensure_weight_tying) writes the
        // embedding again under the head's name; without it, PEFT trained an untied copy
        // of the embedding, which this model cannot be.
        if let Some((head, embedding)) = self.model.tied_head() {
            let trained = self
                .params
                .iter()
                .any(|p| p.name() == embedding && p.trains());
            if trained && by_name.remove(&head).is_none() {
                return Err(Error::data(
                    &what,
                    format!(
                        "trains `{embedding}` whole but holds no `{head}`: PEFT trained an \
                         untied copy of the embedding the head shares (ensure_weight_tying \
                         false), which trainkit does not build; save the adapter with \
                         ensure_weight_tying, or save other modules"
                    ),
                ));
            }
        }
        let be = self.backend.as_ref();
        for p in self.params.iter_mut().filter(|p| in_adapter(p)) {
            let t = by_name.remove(p.name()).ok_or_else(|| {
                Error::data(
                    &what,
                    format!(
                        "has no `{}`: the adapter targets {:?}, this run adapts {:?}",
                        p.name(),
                        lora.targets,
                        ours.targets
                    ),
                )
            })?;
            if t.shape != p.shape() {
                return Err(Error::data(
                    dir.join(peft::ADAPTER_WEIGHTS).display().to_string(),
                    format!(
                        "`{}` has shape {:?}, the model needs {:?} (is the adapter for this \
                         base model?)",
                        p.name(),
                        t.shape,
                        p.shape()
                    ),
                ));
            }
            p.set_value(be, &t.data)?;
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(Error::data(
                dir.join(peft::ADAPTER_WEIGHTS).display().to_string(),
                format!(
                    "holds `{extra}`, which this model has no module for (is the adapter \
                     for this base model?)"
                ),
            ));
        }
        Ok(())
    }

    /// Replaces the parameters' values with a model directory's (`--init-from`): every
    /// parameter of the model must be there with its shape (the low-rank updates of an
    /// adapter keep their values when the directory, a base model, lacks them);
    /// optimizer state and counters are untouched.
    pub fn load_weights(&mut self, model: &ModelDir) -> Result<()> {
        self.weights_from = None;
        let mut tensors = self.model.import_tensors(model.tensors.clone())?;
        let held = tensors.len();
        let be = self.backend.as_ref();
        let mut fresh = Vec::new();
        for p in &mut self.params {
            if let Some(values) = file_values(&mut tensors, held, p.name(), p.shape(), &mut fresh)?
            {
                p.set_value(be, &values)?;
            }
        }
        // DoRA's magnitudes start from the base weights just read.
        self.init_magnitudes(Some(&fresh))
    }

    /// Whether the parameters hold `dir`'s weights as read: the trainer was built from
    /// them ([`super::TrainerBuilder::init_from`]) and no step, load or `params_mut` has
    /// touched a parameter since.
    fn holds_weights_of(&self, dir: &Path) -> bool {
        let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        self.weights_from
            .as_deref()
            .is_some_and(|from| same(from, dir))
    }

    /// Restores a directory written by [`Trainer::save`]: weights, optimizer state, step,
    /// tokens seen, data position and RNG, so that training on continues exactly as if it
    /// had not stopped. The trainer must have been built with the same model shape,
    /// policies and data. A trainer built from the directory's own weights
    /// (`init_from(read_model_dir(dir)?)`, what `trainkit train --resume` does for a full
    /// run, so that nothing is drawn first) does not read them a second time.
    pub fn resume_from(&mut self, dir: &Path) -> Result<()> {
        crate::save::recover_directory(dir)?;
        let state_path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&state_path).map_err(|e| {
            Error::io(
                &state_path,
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "{e}; a resumable checkpoint is written by `trainkit train --out DIR` \
                         (use --init-from to start from weights alone)"
                    ),
                ),
            )
        })?;
        let what = state_path.display().to_string();
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| Error::data(&what, format!("is not a trainer state: {e}")))?;
        if state.format != STATE_FORMAT || state.version != STATE_VERSION {
            return Err(Error::data(
                &what,
                format!(
                    "has format `{}` version {}; this trainkit reads `{STATE_FORMAT}` version \
                     {STATE_VERSION}",
                    state.format, state.version
                ),
            ));
        }
        // Another number of ranks reshards: the checkpoint holds every parameter's whole
        // optimizer state (rank 0 gathered what the owners kept), each rank loads what it
        // updates now, and the data goes on from the saved global position (every rank of
        // the saved job stood there).
        if state.data_tokens != self.data.len_tokens() {
            return Err(Error::data(
                &what,
                format!(
                    "was saved training on {} tokens, this run has {}; resume on the same data",
                    state.data_tokens,
                    self.data.len_tokens()
                ),
            ));
        }
        if state.data_cursor.is_some() && state.data_shuffle != self.data.shuffle_seed() {
            let says = |s: Option<u64>| match s {
                Some(seed) => format!("shuffled with seed {seed}"),
                None => "in order".to_string(),
            };
            return Err(Error::data(
                &what,
                format!(
                    "was saved reading the data {}, this run reads it {}; resume with the \
                     same --shuffle and --seed",
                    says(state.data_shuffle),
                    says(self.data.shuffle_seed())
                ),
            ));
        }
        if peft::is_adapter_dir(dir) {
            self.load_adapter(dir)?;
        } else if !self.holds_weights_of(dir) {
            let model = read_model_dir(dir)?;
            self.load_weights(&model)?;
        }
        let tensors: HashMap<String, (NamedTensor, DType)> =
            read_typed(&dir.join(STATE_TENSORS_FILE))?
                .into_iter()
                .map(|t| (t.0.name.clone(), t))
                .collect();
        let be = self.backend.as_ref();
        let vocab = self.model.vocab_size();
        for p in &mut self.params {
            if p.trains() && !p.updated_here() {
                // Another rank updates it (ZeRO-1) and loads its state.
                continue;
            }
            let names = state.optimizer_state.get(p.name()).ok_or_else(|| {
                Error::data(&what, format!("has no optimizer state for `{}`", p.name()))
            })?;
            let slots = names
                .iter()
                .map(|n| {
                    let (t, dtype) = tensors.get(n).ok_or_else(|| {
                        Error::data(
                            STATE_TENSORS_FILE,
                            format!("is missing `{n}`; the checkpoint is incomplete"),
                        )
                    })?;
                    let (data, shape) = padded_state(t, *dtype, p.shape(), vocab);
                    p.state_backend(be).upload(
                        &data,
                        &shape,
                        *dtype,
                        MemoryCategory::OptimizerState,
                        n,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            p.set_state(slots);
        }
        self.restore_compensation(&state.compensation, &tensors)?;
        match state.data_cursor {
            Some(cursor) => self.data.set_cursor(cursor)?,
            None => self.data.set_position(state.data_position)?,
        }
        if let Some(s) = &state.precision_state {
            self.precision.load_state(s)?;
        }
        self.step = state.step;
        self.tokens_seen = state.tokens_seen;
        self.skipped_steps = state.skipped_steps;
        self.bad_streak = state.bad_streak;
        self.rng = state.rng;
        self.flush_events();
        Ok(())
    }

    /// Loads the Kahan compensations a checkpoint saved (`saved`, their names) into the
    /// parameters that keep one: both sides must agree on which do, or the resume would
    /// not continue the run.
    fn restore_compensation(
        &mut self,
        saved: &[String],
        tensors: &HashMap<String, (NamedTensor, DType)>,
    ) -> Result<()> {
        let be = self.backend.as_ref();
        let keeps = self
            .params
            .iter()
            .any(|p| p.update_rounding().is_some_and(|r| r.compensated()));
        if !saved.is_empty() && !keeps {
            return Err(Error::data(
                STATE_FILE,
                "was saved by a pure-bf16 run with Kahan-compensated updates; resume with \
                 --master-weights none --update-rounding kahan",
            ));
        }
        for p in self.params.iter_mut() {
            let Some(label) = p.compensation().map(|t| t.label().to_string()) else {
                continue;
            };
            let (t, _) = tensors.get(&label).ok_or_else(|| {
                Error::data(
                    STATE_TENSORS_FILE,
                    format!(
                        "has no `{label}`: the checkpoint was not saved with Kahan-compensated \
                         updates (resume with the update rounding it was saved with)"
                    ),
                )
            })?;
            p.set_compensation(be, &t.data)?;
        }
        Ok(())
    }
}

/// An optimizer state tensor as saved, or, when it is an f32 state of the embedding or
/// head saved with the tokenizer's `vocab` rows (by a trainkit that did not pad the
/// vocabulary), the same with zero rows up to the parameter's padded rows: exactly the
/// state those rows have, as no gradient reaches them.
fn padded_state<'t>(
    t: &'t NamedTensor,
    dtype: DType,
    param: &[usize],
    vocab: usize,
) -> (Cow<'t, [f32]>, Vec<usize>) {
    let rows_short = dtype == DType::F32
        && t.shape.len() == param.len()
        && t.shape.first() == Some(&vocab)
        && param.first().is_some_and(|&r| r > vocab)
        && t.shape[1..] == param[1..];
    if !rows_short {
        return (Cow::Borrowed(&t.data), t.shape.clone());
    }
    let mut data = t.data.clone();
    data.resize(param.iter().product(), 0.0);
    (Cow::Owned(data), param.to_vec())
}

/// Whether parameter `p` is saved in (and loaded from) the adapter: a low-rank update's
/// tensor, or a base module the adapter trains whole (`modules_to_save`).
fn in_adapter(p: &Param) -> bool {
    is_update_param(p.name()) || p.trains()
}

/// Parameter `name`'s values (shape `shape`) taken out of a model directory's `tensors`
/// (as the model imports them; `held` of them at first): `None`, with the name pushed to
/// `fresh`, for the low-rank update of an adapter the directory (a base model) lacks,
/// which keeps its own initialisation; an error naming the parameter when it is missing
/// otherwise or misshapen.
pub(super) fn file_values(
    tensors: &mut BTreeMap<String, StoredTensor<'static>>,
    held: usize,
    name: &str,
    shape: &[usize],
    fresh: &mut Vec<String>,
) -> Result<Option<Vec<f32>>> {
    let Some(t) = tensors.remove(name) else {
        if is_update_param(name) {
            fresh.push(name.to_string());
            return Ok(None);
        }
        return Err(Error::data(
            "model weights",
            format!(
                "`{name}` is missing; the directory holds {held} tensors but not this one \
                 (is it a checkpoint of the same model and depth?)"
            ),
        ));
    };
    if t.shape() != shape {
        return Err(Error::data(
            "model weights",
            format!(
                "`{name}` has shape {:?}, the model needs {shape:?}",
                t.shape()
            ),
        ));
    }
    Ok(Some(t.values()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 state saved with the tokenizer's rows gains zero rows up to the padded
    /// parameter's; any other state is uploaded as saved.
    #[test]
    fn state_saved_unpadded_is_padded_with_zero_rows() {
        let t = NamedTensor {
            name: "m".into(),
            shape: vec![3, 2],
            data: vec![1.0; 6],
        };
        let (data, shape) = padded_state(&t, DType::F32, &[64, 2], 3);
        assert_eq!(shape, vec![64, 2]);
        assert_eq!(data[..6], [1.0; 6]);
        assert!(data[6..].iter().all(|&x| x == 0.0) && data.len() == 128);
        for (dtype, param, vocab) in [
            (DType::U8, [64, 2], 3),
            (DType::F32, [64, 3], 3),
            (DType::F32, [64, 2], 5),
            (DType::F32, [3, 2], 3),
        ] {
            let (data, shape) = padded_state(&t, dtype, &param, vocab);
            assert_eq!((&*data, shape), (&t.data[..], t.shape.clone()));
        }
    }
}
