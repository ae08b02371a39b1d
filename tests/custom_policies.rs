//! A policy of each of the five traits, written outside the crate as a user would: it
//! trains, and round-trips through TOML and JSON as a `Box<dyn _>`.

use crate::common;

use common::{corpus_loader, cpu, tiny_config};
use serde::{Deserialize, Serialize};
use trainkit::accumulate::AccumulationContext;
use trainkit::checkpoint::{ActivationSite, Retention, Tags};
use trainkit::config::RunConfig;
use trainkit::optim::{GradScale, ParamUpdate, StateSlot};
use trainkit::{
    AccumulationSchedule, Backend, CheckpointPolicy, DType, Gpt2, MemoryEvent, MemoryObserver,
    Optimizer, Precision, Trainer,
};

/// f32 training with a static loss scale: exercises the loss-scale hooks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct ScaledFp32 {
    scale: f32,
    #[serde(skip)]
    bad_steps: u32,
}

#[typetag::serde(name = "scaled_fp32")]
impl Precision for ScaledFp32 {
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    fn master_weights(&self) -> bool {
        false
    }
    fn grad_dtype(&self) -> DType {
        DType::F32
    }
    fn loss_scale(&self) -> f32 {
        self.scale
    }
    fn update_loss_scale(&mut self, finite: bool) {
        if !finite {
            self.bad_steps += 1;
        }
    }
}

/// Keeps layer inputs and the MLP; recomputes the attention block.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct RecomputeAttention {
    from_layer: usize,
}

#[typetag::serde(name = "recompute_attention")]
impl CheckpointPolicy for RecomputeAttention {
    fn retain(&self, site: &ActivationSite) -> Retention {
        if site.is(Tags::ATTENTION) && site.layer >= self.from_layer {
            Retention::Recompute
        } else {
            Retention::Keep
        }
    }
}

/// Sign descent with a momentum buffer, written with the public backend ops.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Momentum {
    lr: f32,
    beta: f32,
}

#[typetag::serde(name = "momentum")]
impl Optimizer for Momentum {
    fn learning_rate(&self) -> f32 {
        self.lr
    }
    fn state_slots(&self, shape: &[usize], _kept: DType) -> Vec<StateSlot> {
        vec![StateSlot::new("buf", shape, DType::F32)]
    }
    fn update(
        &mut self,
        backend: &dyn Backend,
        params: &mut [ParamUpdate<'_>],
        lr: f32,
        grad_scale: GradScale<'_>,
        _step: u64,
    ) -> trainkit::Result<()> {
        // Host-valued ops: read the multiplier; a non-finite step is skipped.
        let Some(grad_scale) = grad_scale.read(backend)? else {
            return Ok(());
        };
        for p in params.iter_mut() {
            let buf = &mut p.state[0];
            backend.scale(buf, self.beta)?;
            backend.axpy(buf, grad_scale, p.grad)?;
            backend.axpy(p.values, -lr, buf)?;
        }
        Ok(())
    }
    fn state_bytes_per_param(&self) -> usize {
        4
    }
}

/// One micro-batch more every `every` steps, up to `max`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Staircase {
    every: u64,
    max: usize,
}

#[typetag::serde(name = "staircase")]
impl AccumulationSchedule for Staircase {
    fn micro_batches(&self, ctx: &AccumulationContext) -> trainkit::Result<usize> {
        Ok((1 + (ctx.step / self.every) as usize).min(self.max))
    }
}

/// Counts allocations of activations.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
struct CountActivations {
    #[serde(skip)]
    allocs: usize,
    #[serde(skip)]
    steps: u64,
}

#[typetag::serde(name = "count_activations")]
impl MemoryObserver for CountActivations {
    fn on_event(&mut self, event: &MemoryEvent) {
        match event {
            MemoryEvent::Alloc {
                category: trainkit::MemoryCategory::Activations,
                ..
            } => self.allocs += 1,
            MemoryEvent::StepEnd { .. } => self.steps += 1,
            _ => {}
        }
    }
}

#[test]
fn user_policies_train() {
    let model = Gpt2::new(tiny_config()).unwrap();
    let mut t = Trainer::builder(model, cpu(), corpus_loader(50_000, 2, 4, 16))
        .precision(ScaledFp32 {
            scale: 1024.0,
            bad_steps: 0,
        })
        .checkpoint(RecomputeAttention { from_layer: 1 })
        .optimizer(Momentum { lr: 0.5, beta: 0.9 })
        .accumulation(Staircase { every: 3, max: 2 })
        .observer(CountActivations::default())
        .build()
        .unwrap();
    let stats: Vec<_> = (0..12).map(|_| t.step().unwrap()).collect();
    assert_eq!(stats[0].micro_batches, 1);
    assert_eq!(stats[11].micro_batches, 2);
    assert!(stats.iter().all(|s| !s.skipped));
    let first: f64 = stats[..2].iter().map(|s| s.loss).sum::<f64>() / 2.0;
    let last: f64 = stats[10..].iter().map(|s| s.loss).sum::<f64>() / 2.0;
    assert!(last < first - 0.5, "loss falls: {first} -> {last}");
    assert!(
        stats[0].stash.recomputed_bytes > 0,
        "the policy recomputed attention"
    );
    assert_eq!(t.observer().steps, 12);
    assert!(t.observer().allocs > 100);
    // The loss scale is removed before clipping and the update: the norm is the true one.
    assert!(
        stats[0].grad_norm < 100.0,
        "unscaled gradient norm {}",
        stats[0].grad_norm
    );
    assert_eq!(t.precision().bad_steps, 0);
}

#[test]
fn user_policies_round_trip_through_toml_and_json() {
    let precision: Box<dyn Precision> = Box::new(ScaledFp32 {
        scale: 8.0,
        bad_steps: 0,
    });
    let checkpoint: Box<dyn CheckpointPolicy> = Box::new(RecomputeAttention { from_layer: 2 });
    let optimizer: Box<dyn Optimizer> = Box::new(Momentum { lr: 0.1, beta: 0.8 });
    let accumulation: Box<dyn AccumulationSchedule> = Box::new(Staircase { every: 5, max: 4 });
    let observer: Box<dyn MemoryObserver> = Box::new(CountActivations::default());
    // JSON: each boxed policy serializes with its kind and deserializes to an equal value.
    macro_rules! json_round_trip {
        ($value:expr, $trait:ty) => {{
            let json = serde_json::to_string(&$value).unwrap();
            let back: Box<$trait> = serde_json::from_str(&json).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), json);
            json
        }};
    }
    let j = json_round_trip!(precision, dyn Precision);
    assert_eq!(j, r#"{"kind":"scaled_fp32","scale":8.0}"#);
    json_round_trip!(checkpoint, dyn CheckpointPolicy);
    json_round_trip!(optimizer, dyn Optimizer);
    json_round_trip!(accumulation, dyn AccumulationSchedule);
    json_round_trip!(observer, dyn MemoryObserver);

    // TOML: a whole run config naming every user policy by kind.
    let toml_text = r#"
[model]
n_layer = 2
n_head = 2
n_embd = 32
n_positions = 32
vocab_size = 256

[training]
steps = 3
batch_size = 2
seq_len = 16

[precision]
kind = "scaled_fp32"
scale = 8.0

[checkpoint]
kind = "recompute_attention"
from_layer = 2

[optimizer]
kind = "momentum"
lr = 0.1
beta = 0.8

[accumulation]
kind = "staircase"
every = 5
max = 4

[observer]
kind = "count_activations"
"#;
    let cfg = RunConfig::from_toml(toml_text).unwrap();
    assert_eq!(
        serde_json::to_string(&cfg.precision).unwrap(),
        serde_json::to_string(&precision).unwrap()
    );
    assert_eq!(
        serde_json::to_string(&cfg.checkpoint).unwrap(),
        serde_json::to_string(&checkpoint).unwrap()
    );
    assert_eq!(
        serde_json::to_string(&cfg.optimizer).unwrap(),
        serde_json::to_string(&optimizer).unwrap()
    );
    assert_eq!(
        serde_json::to_string(&cfg.accumulation).unwrap(),
        serde_json::to_string(&accumulation).unwrap()
    );
    assert_eq!(
        serde_json::to_string(&cfg.observer).unwrap(),
        serde_json::to_string(&observer).unwrap()
    );
    // And back to TOML and in again, unchanged.
    let again = RunConfig::from_toml(&cfg.to_toml().unwrap()).unwrap();
    assert_eq!(again.to_toml().unwrap(), cfg.to_toml().unwrap());
    // Each policy alone through TOML.
    let t = toml::to_string(&checkpoint).unwrap();
    let back: Box<dyn CheckpointPolicy> = toml::from_str(&t).unwrap();
    assert_eq!(toml::to_string(&back).unwrap(), t);
}

#[test]
fn shipped_policies_round_trip_and_unknown_kinds_are_clear_errors() {
    let cfg = RunConfig::default();
    let text = cfg.to_toml().unwrap();
    let back = RunConfig::from_toml(&text).unwrap();
    assert_eq!(back.to_toml().unwrap(), text);
    for kind in ["none", "full", "selective"] {
        let c: Box<dyn CheckpointPolicy> = toml::from_str(&format!("kind = \"{kind}\"")).unwrap();
        assert!(toml::to_string(&c).unwrap().contains(kind));
    }
    let p: Box<dyn Precision> =
        toml::from_str("kind = \"mixed_bf16\"\nfp32_grads = false").unwrap();
    assert_eq!(p.grad_dtype(), DType::Bf16);

    let err = RunConfig::from_toml("[checkpoint]\nkind = \"bogus\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bogus") && err.contains("selective") && err.contains("full"),
        "{err}"
    );
    let err = RunConfig::from_toml("[optimizer]\nkind = \"adamw\"\nlearning_rate = 1.0\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("learning_rate"), "{err}");
    let err = RunConfig::from_toml(
        "[model]\nn_layer = 2\nn_head = 3\nn_embd = 32\nn_positions = 32\nvocab_size = 256\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("model.n_embd") && err.contains("divisible"),
        "{err}"
    );
}
