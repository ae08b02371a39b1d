//! Starting a trainer from a model directory (`TrainerBuilder::init_from`, what `train
//! --init-from`, `sample` and `eval` do): bit for bit the trainer that draws its weights
//! and then loads them (`Trainer::load_weights`), in every precision, with LoRA, DoRA and
//! QLoRA (whose updates are drawn from the same place of the seed's stream), streamed
//! weights and the optimizer on the host; a directory that lacks a weight is refused by
//! name.

use crate::common;

use common::{corpus_loader, cpu, per_param, scratch, tiny_config};
use std::path::Path;
use std::sync::Arc;
use trainkit::model::{read_model_dir, ModelDir};
use trainkit::save::NamedTensor;
use trainkit::{
    Adapter, Fp32, Gpt2, Llama, Lora, MixedBf16, Model, Precision, PureBf16, StreamFrozen, Trainer,
    TrainerOptions, WeightPlacement,
};

type Built = Trainer<
    Box<dyn Precision>,
    trainkit::NoRecompute,
    trainkit::AdamW,
    trainkit::Constant,
    trainkit::PeakTracker,
>;

fn base(what: &str) -> Box<dyn Model> {
    match what {
        "llama" => Box::new(Llama::new(common::tiny_llama_config()).unwrap()),
        _ => Box::new(Gpt2::new(tiny_config()).unwrap()),
    }
}

/// A trained base model of `what`, saved as a model directory under `dir`.
fn saved_base(what: &str, dir: &Path) -> ModelDir {
    let mut t = Trainer::builder(base(what), cpu(), corpus_loader(3000, 5, 2, 16))
        .options(TrainerOptions {
            seed: 99,
            ..TrainerOptions::default()
        })
        .build()
        .unwrap();
    t.step().unwrap();
    t.save(dir, None).unwrap();
    read_model_dir(dir).unwrap()
}

/// One way of training `what` from a saved base: its adapter, precision, placement and
/// whether the optimizer lives on the host.
struct Setup {
    what: &'static str,
    adapter: Option<Lora>,
    precision: fn() -> Box<dyn Precision>,
    stream: bool,
    offload: bool,
}

impl Setup {
    fn builder(
        &self,
    ) -> trainkit::trainer::TrainerBuilder<
        Box<dyn Precision>,
        trainkit::NoRecompute,
        trainkit::AdamW,
        trainkit::Constant,
        trainkit::PeakTracker,
    > {
        let mut model = base(self.what);
        if let Some(lora) = &self.adapter {
            model = model
                .with_adapter(Arc::new(lora.clone()) as Arc<dyn Adapter>)
                .unwrap();
        }
        let placement: Box<dyn WeightPlacement> = match self.stream {
            true => Box::new(StreamFrozen {
                ahead: 1,
                min_bytes: 0,
            }),
            false => Box::new(trainkit::placement::Resident),
        };
        Trainer::builder(model, cpu(), corpus_loader(3000, 8, 2, 16))
            .precision((self.precision)())
            .options(TrainerOptions {
                optimizer_offload: self.offload,
                placement,
                ..TrainerOptions::default()
            })
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Every parameter's f32 values and compute weights.
fn state(t: &Built) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    (
        bits(&per_param(t, |p| p.value())),
        bits(&per_param(t, |p| p.weight())),
    )
}

#[test]
fn a_trainer_started_from_a_directory_is_the_one_that_loads_it_after() {
    let lora = |targets: &[&str]| Lora::new(4, 8.0, targets).unwrap();
    let setups = [
        Setup {
            what: "gpt2",
            adapter: None,
            precision: || Box::new(Fp32),
            stream: false,
            offload: false,
        },
        Setup {
            what: "llama",
            adapter: None,
            precision: || Box::new(PureBf16::default()),
            stream: false,
            offload: false,
        },
        Setup {
            what: "llama",
            adapter: Some(lora(&["q_proj", "v_proj", "down_proj"])),
            precision: || Box::new(MixedBf16::default()),
            stream: false,
            offload: false,
        },
        Setup {
            what: "gpt2",
            adapter: Some(Lora {
                dora: true,
                ..lora(&["c_attn", "c_proj"])
            }),
            precision: || Box::new(Fp32),
            stream: false,
            offload: false,
        },
        Setup {
            what: "llama",
            adapter: Some(lora(&["q_proj", "v_proj", "gate_proj"]).with_nf4_base()),
            precision: || Box::new(MixedBf16::default()),
            stream: true,
            offload: false,
        },
        Setup {
            what: "gpt2",
            adapter: None,
            precision: || Box::new(MixedBf16::default()),
            stream: false,
            offload: true,
        },
    ];
    for (i, setup) in setups.iter().enumerate() {
        let label = format!(
            "{} ({i}), adapter {}, stream {}, offload {}",
            setup.what,
            setup.adapter.as_ref().map_or("none", |l| match l.dora {
                true => "DoRA",
                false => "LoRA",
            }),
            setup.stream,
            setup.offload
        );
        let dir = saved_base(setup.what, &scratch(&format!("init-from-{i}")).join("base"));
        let mut loaded = setup.builder().build().unwrap();
        loaded.load_weights(&dir).unwrap();
        let mut started = setup.builder().init_from(dir).build().unwrap();
        assert!(state(&started) == state(&loaded), "{label}: the weights");
        for step in 0..2 {
            let (a, b) = (started.step().unwrap(), loaded.step().unwrap());
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{label}: step {step}");
        }
        assert!(
            state(&started) == state(&loaded),
            "{label}: after two steps"
        );
    }
}

#[test]
fn a_directory_without_a_weight_of_the_model_is_refused_by_name() {
    let dir = scratch("init-from-missing").join("base");
    let mut model = saved_base("gpt2", &dir);
    model.tensors.remove("transformer.h.1.mlp.c_fc.bias");
    let e = Trainer::builder(base("gpt2"), cpu(), corpus_loader(3000, 8, 2, 16))
        .init_from(model)
        .build()
        .err()
        .expect("a missing weight is refused")
        .to_string();
    assert!(
        e.contains("transformer.h.1.mlp.c_fc.bias") && e.contains("missing"),
        "{e}"
    );
    let mut model = read_model_dir(&dir).unwrap();
    let name = "transformer.wpe.weight";
    let misshapen = NamedTensor {
        name: name.into(),
        shape: vec![16, 64],
        data: vec![0.0; 16 * 64],
    };
    model.tensors.insert(name.into(), misshapen.into());
    let e = Trainer::builder(base("gpt2"), cpu(), corpus_loader(3000, 8, 2, 16))
        .init_from(model)
        .build()
        .err()
        .expect("a misshapen weight is refused")
        .to_string();
    assert!(
        e.contains("transformer.wpe.weight") && e.contains("[16, 64]"),
        "{e}"
    );
}
