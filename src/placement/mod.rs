//! `WeightPlacement`: where each weight lives between the ops that read it, and the
//! shipped policies.
//!
//! A weight is [`Placement::Resident`] (on the device for the whole run, as every tool
//! keeps it) or [`Placement::Streamed`]: kept in page-locked host memory (the ledger's
//! [`crate::MemoryCategory::Streamed`]) and copied to the device on the copy stream a few
//! sections ahead of the section that reads it ([`WeightPlacement::ahead`]: the
//! embedding, each layer and the head are sections), then freed once that section is
//! done, in forward, in recomputation and in backward alike. The device then holds the
//! streamed weights of `ahead + 1` sections at a time instead of the whole model's, and
//! every step moves them over the host link once forward and once backward
//! ([`crate::model::PassStats::streamed_bytes`]). NF4 weights stay packed in transit.
//!
//! Training is bitwise the same either way: the copies carry the weights' bytes as they
//! are, and each op waits for its weights' copy before it reads them.
//!
//! [`StreamFrozen`] streams the frozen weights (the base of LoRA, QLoRA and DoRA);
//! [`StreamAll`] every weight, those that train updated on the host in place (with the
//! optimizer offloaded; without it [`crate::Trainer::new`] refuses them by name). Both keep
//! weights under `min_bytes` ([`DEFAULT_MIN_STREAMED_BYTES`], 1 MiB) on the device, as
//! DeepSpeed's `stage3_param_persistence_threshold` does: norm gains and biases cost little
//! there (about 2.6 MB for a 70B model), and a copy that small would cost more in its
//! launch and synchronisation than it saves.

use crate::param::ParamInit;
use crate::tensor::DType;
use dyn_clone::DynClone;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// Where one weight lives between its readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// On the device for the whole run.
    Resident,
    /// In page-locked host memory, copied to the device ahead of the section that reads
    /// it and freed after.
    Streamed,
}

/// What a [`WeightPlacement`] decides on: one parameter of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightSite<'a> {
    /// The parameter's name (Hugging Face's, e.g. `model.layers.3.mlp.up_proj.weight`).
    pub name: &'a str,
    /// Its shape.
    pub shape: &'a [usize],
    /// Bytes of its weights as stored (NF4 packed, bf16, f32).
    pub bytes: u64,
    /// Whether it trains (a frozen base weight of LoRA or QLoRA does not).
    pub trains: bool,
}

/// Decides where every weight lives: on the device, or streamed from host memory.
///
/// Serializable by its `kind` tag like the other policies (`[placement] kind =
/// "stream_frozen"` in a config file); a policy written in another crate deserializes
/// once it is linked in.
#[typetag::serde(tag = "kind")]
pub trait WeightPlacement: DynClone + Debug + Send + Sync {
    /// Where the weight at `site` lives.
    fn place(&self, site: &WeightSite<'_>) -> Placement;

    /// How many sections ahead of the one running the streamed weights are copied (1: the
    /// next layer's weights travel while this one computes). The device holds the
    /// streamed weights of `ahead + 1` sections at a time.
    fn ahead(&self) -> usize {
        1
    }
}

dyn_clone::clone_trait_object!(WeightPlacement);

impl<'a> WeightPlacement for Box<dyn WeightPlacement + 'a> {
    fn place(&self, site: &WeightSite<'_>) -> Placement {
        (**self).place(site)
    }
    fn ahead(&self) -> usize {
        (**self).ahead()
    }
    #[doc(hidden)]
    fn typetag_name(&self) -> &'static str {
        (**self).typetag_name()
    }
    #[doc(hidden)]
    fn typetag_deserialize(&self) {}
}

/// Every weight on the device for the whole run (the default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resident;

#[typetag::serde(name = "resident")]
impl WeightPlacement for Resident {
    fn place(&self, _site: &WeightSite<'_>) -> Placement {
        Placement::Resident
    }
}

/// The default `min_bytes` of [`StreamFrozen`] and [`StreamAll`]: weights under 1 MiB
/// stay on the device.
pub const DEFAULT_MIN_STREAMED_BYTES: u64 = 1 << 20;

/// Every frozen weight of at least `min_bytes` streamed from page-locked host memory,
/// `ahead` sections ahead of its readers (the base of LoRA, QLoRA and DoRA: a 70B model's
/// NF4 base is ~35 GiB of host memory and two layers', ~0.9 GiB, on the device); weights
/// that train, and smaller ones, stay on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamFrozen {
    /// Sections copied ahead of the one running (at least 1 to overlap the copies with
    /// compute; 0 copies each section's weights when it starts).
    pub ahead: usize,
    /// Weights of fewer bytes (as stored) stay on the device
    /// ([`DEFAULT_MIN_STREAMED_BYTES`]; 0 streams every one).
    pub min_bytes: u64,
}

impl Default for StreamFrozen {
    fn default() -> Self {
        StreamFrozen {
            ahead: 1,
            min_bytes: DEFAULT_MIN_STREAMED_BYTES,
        }
    }
}

#[typetag::serde(name = "stream_frozen")]
impl WeightPlacement for StreamFrozen {
    fn place(&self, site: &WeightSite<'_>) -> Placement {
        if site.trains || site.bytes < self.min_bytes {
            Placement::Resident
        } else {
            Placement::Streamed
        }
    }

    fn ahead(&self) -> usize {
        self.ahead
    }
}

/// Every weight of at least `min_bytes` streamed from page-locked host memory, `ahead`
/// sections ahead of its readers, those that train included: their update runs on the host and writes the
/// streamed weights in place, so it needs the optimizer there
/// ([`crate::TrainerOptions::optimizer_offload`]); with the update inside backward
/// ([`crate::TrainerOptions::optimizer_in_backward`]) the device holds two sections'
/// weights and about one layer's gradients, whatever the model's size (ZeRO-Infinity's
/// parameter offload, for one GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamAll {
    /// Sections copied ahead of the one running.
    pub ahead: usize,
    /// Weights of fewer bytes (as stored) stay on the device
    /// ([`DEFAULT_MIN_STREAMED_BYTES`]; 0 streams every one).
    pub min_bytes: u64,
}

impl Default for StreamAll {
    fn default() -> Self {
        StreamAll {
            ahead: 1,
            min_bytes: DEFAULT_MIN_STREAMED_BYTES,
        }
    }
}

#[typetag::serde(name = "stream_all")]
impl WeightPlacement for StreamAll {
    fn place(&self, site: &WeightSite<'_>) -> Placement {
        if site.bytes < self.min_bytes {
            Placement::Resident
        } else {
            Placement::Streamed
        }
    }

    fn ahead(&self) -> usize {
        self.ahead
    }
}

/// The shipped placement `name` names, as `--stream-weights` spells it: `frozen`
/// ([`StreamFrozen`]), `all` ([`StreamAll`]) or `none` ([`Resident`]).
pub fn named(name: &str) -> crate::error::Result<Box<dyn WeightPlacement>> {
    match name {
        "frozen" => Ok(Box::new(StreamFrozen::default())),
        "all" => Ok(Box::new(StreamAll::default())),
        "none" => Ok(resident()),
        other => Err(crate::error::Error::config(
            "--stream-weights",
            format!(
                "`{other}` is not a placement; use frozen (the frozen base of LoRA or QLoRA), \
                 all (every weight, with --optimizer-offload) or none"
            ),
        )),
    }
}

/// The streaming a run picks when asked to stream without naming how (autofit's
/// technique): the frozen base where there is one ([`StreamFrozen`]), else every weight
/// ([`StreamAll`], whose update needs the optimizer on the host).
pub fn streaming(frozen_base: bool) -> Box<dyn WeightPlacement> {
    if frozen_base {
        Box::new(StreamFrozen::default())
    } else {
        Box::new(StreamAll::default())
    }
}

/// The `--stream-weights` flag that sets `placement`, if it is a shipped one: `""` for
/// [`Resident`], ` --stream-weights` for [`StreamFrozen`], ` --stream-weights all` for
/// [`StreamAll`] (each with a leading space, as a flag appended to others).
pub fn flag(placement: &dyn WeightPlacement) -> &'static str {
    match placement.typetag_name() {
        "stream_frozen" => " --stream-weights",
        "stream_all" => " --stream-weights all",
        _ => "",
    }
}

/// Whether `placement` keeps every weight on the device ([`Resident`], by its `kind`).
pub fn is_resident(placement: &dyn WeightPlacement) -> bool {
    placement.typetag_name() == "resident"
}

/// The default placement: [`Resident`].
pub fn resident() -> Box<dyn WeightPlacement> {
    Box::new(Resident)
}

/// Which of the parameters `specs` declares `placement` streams, in their order; `compute`
/// is the dtype weights are kept in where a parameter declares none of its own.
pub fn streamed(placement: &dyn WeightPlacement, specs: &[ParamInit], compute: DType) -> Vec<bool> {
    specs
        .iter()
        .map(|spec| {
            let dtype = spec.dtype.unwrap_or(compute);
            let site = WeightSite {
                name: &spec.name,
                shape: &spec.shape,
                bytes: dtype.bytes(spec.numel()) as u64,
                trains: spec.trains,
            };
            placement.place(&site) == Placement::Streamed
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(trains: bool, bytes: u64) -> WeightSite<'static> {
        WeightSite {
            name: "model.layers.0.mlp.up_proj.weight",
            shape: &[8, 4],
            bytes,
            trains,
        }
    }

    #[test]
    fn stream_frozen_streams_what_does_not_train() {
        let p = StreamFrozen::default();
        let big = DEFAULT_MIN_STREAMED_BYTES;
        assert_eq!(p.place(&site(false, big)), Placement::Streamed);
        assert_eq!(p.place(&site(true, big)), Placement::Resident);
        assert_eq!(p.ahead(), 1);
        assert_eq!(Resident.place(&site(false, big)), Placement::Resident);
    }

    #[test]
    fn weights_under_min_bytes_stay_on_the_device() {
        let small = DEFAULT_MIN_STREAMED_BYTES - 1;
        assert_eq!(
            StreamFrozen::default().place(&site(false, small)),
            Placement::Resident
        );
        assert_eq!(
            StreamAll::default().place(&site(true, small)),
            Placement::Resident
        );
        let every = StreamAll {
            ahead: 1,
            min_bytes: 0,
        };
        assert_eq!(every.place(&site(true, 4)), Placement::Streamed);
        assert_eq!(flag(&every), " --stream-weights all");
        assert_eq!(flag(streaming(true).as_ref()), " --stream-weights");
        assert_eq!(flag(&Resident), "");
    }

    #[test]
    fn policies_round_trip_through_their_kind() {
        let p: Box<dyn WeightPlacement> = Box::new(StreamFrozen {
            ahead: 2,
            ..StreamFrozen::default()
        });
        let text = toml::to_string(&p).unwrap();
        assert!(text.contains("kind = \"stream_frozen\""), "{text}");
        let back: Box<dyn WeightPlacement> = toml::from_str(&text).unwrap();
        assert_eq!(back.ahead(), 2);
        let every: Box<dyn WeightPlacement> =
            toml::from_str("kind = \"stream_frozen\"\nmin_bytes = 0").unwrap();
        assert_eq!(every.place(&site(false, 4)), Placement::Streamed);
        assert_eq!(back.typetag_name(), "stream_frozen");
        let err = toml::from_str::<Box<dyn WeightPlacement>>("kind = \"stream_frozen\"\nahed = 2")
            .unwrap_err();
        assert!(err.to_string().contains("ahed"), "{err}");
    }
}
