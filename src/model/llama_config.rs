//! The configuration of a Llama-family model as Hugging Face writes it (`config.json` of
//! `LlamaForCausalLM`), in both the transformers 5 form (`rope_parameters`) and the 4.x
//! form (`rope_theta`, `rope_scaling`, `torch_dtype`), and its rotary position frequencies.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// How rotary position frequencies are scaled for contexts longer than trained on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "rope_type")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3's scaling: low frequencies divided by `factor`, high ones kept, a smooth
    /// blend between (transformers' `llama3` rope type).
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are
        /// scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are
        /// kept.
        high_freq_factor: f64,
        /// The context the model was first trained with.
        original_max_position_embeddings: f64,
    },
}

/// Rotary position embedding parameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// The base `θ` of the frequencies `θ^(−2i/d)`.
    pub theta: f64,
    /// The scaling applied to them.
    pub scaling: RopeScaling,
}

impl Rope {
    /// The inverse frequencies of a head of `head_dim` (even) dimensions, one per pair, as
    /// transformers computes them (in f32, then scaled).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let base: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0 / (self.theta as f32).powf(exponent)
            })
            .collect();
        match self.scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f as f64;
                        if wavelen > low_wavelen {
                            (f as f64 / factor) as f32
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            ((1.0 - smooth) * f as f64 / factor + smooth * f as f64) as f32
                        }
                    })
                    .collect()
            }
        }
    }
}

/// A Llama-family model's configuration, with Hugging Face's field names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Inner width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether the output head shares the token embedding.
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation.
    pub initializer_range: f64,
    /// Rotary position embedding.
    pub rope: Rope,
}

pub(crate) fn field<'a>(map: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    map.get(name).filter(|v| !v.is_null())
}

pub(crate) fn number(map: &Map<String, Value>, name: &str, at: &str) -> Result<Option<f64>> {
    match field(map, name) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::config(format!("{at}{name}"), format!("{v} is not a number"))),
    }
}

pub(crate) fn count(map: &Map<String, Value>, name: &str) -> Result<Option<usize>> {
    match field(map, name) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .map(Some)
            .ok_or_else(|| Error::config(name, format!("{v} is not a positive whole number"))),
    }
}

fn required(map: &Map<String, Value>, name: &str) -> Result<usize> {
    count(map, name)?.ok_or_else(|| {
        Error::config(
            name,
            "is missing; a Llama-like config.json names it (see LlamaConfig)",
        )
    })
}

/// The rope parameters of either form: transformers 5's `rope_parameters`, or 4.x's
/// `rope_theta` with `rope_scaling`.
pub(crate) fn rope(map: &Map<String, Value>) -> Result<Rope> {
    let (params, at, theta) = match field(map, "rope_parameters") {
        Some(Value::Object(p)) => (
            Some(p),
            "rope_parameters.",
            number(p, "rope_theta", "rope_parameters.")?,
        ),
        Some(other) => {
            return Err(Error::config(
                "rope_parameters",
                format!("{other} is not a table of rope parameters"),
            ))
        }
        None => match field(map, "rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling.", number(map, "rope_theta", "")?),
            Some(other) => {
                return Err(Error::config(
                    "rope_scaling",
                    format!("{other} is not a table of rope scaling parameters"),
                ))
            }
            None => (None, "", number(map, "rope_theta", "")?),
        },
    };
    let theta = theta.unwrap_or(10_000.0);
    if !(theta > 1.0 && theta.is_finite()) {
        return Err(Error::config(
            "rope_theta",
            format!("{theta} must be a finite value > 1"),
        ));
    }
    let Some(p) = params else {
        return Ok(Rope {
            theta,
            scaling: RopeScaling::Default,
        });
    };
    let kind = field(p, "rope_type")
        .or_else(|| field(p, "type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let get = |name: &str| -> Result<f64> {
        let v = number(p, name, at)?.ok_or_else(|| {
            Error::config(
                format!("{at}{name}"),
                format!("is missing for rope type `{kind}`"),
            )
        })?;
        if v > 0.0 && v.is_finite() {
            Ok(v)
        } else {
            Err(Error::config(
                format!("{at}{name}"),
                format!("{v} must be a finite value > 0"),
            ))
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: get("factor")?,
        },
        "llama3" => {
            let (low, high) = (get("low_freq_factor")?, get("high_freq_factor")?);
            if high <= low {
                return Err(Error::config(
                    format!("{at}high_freq_factor"),
                    format!("{high} must exceed low_freq_factor = {low}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: get("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: get("original_max_position_embeddings")?,
            }
        }
        other => {
            return Err(Error::config(
                format!("{at}rope_type"),
                format!("`{other}` is not supported; use default, linear or llama3"),
            ))
        }
    };
    Ok(Rope { theta, scaling })
}

impl LlamaConfig {
    /// A Llama of the default run's size: 4 layers, 128 wide, 4 query heads sharing 2
    /// key/value heads, a SwiGLU MLP of 352, bytes, a context of 128, tied embeddings.
    pub fn small() -> LlamaConfig {
        LlamaConfig {
            hidden_size: 128,
            intermediate_size: 352,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            vocab_size: 256,
            max_position_embeddings: 128,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            rope: Rope {
                theta: 10_000.0,
                scaling: RopeScaling::Default,
            },
        }
    }

    /// Parses a `config.json` of `LlamaForCausalLM` (transformers 5 or 4.x); unknown fields
    /// are ignored. A `model_type` other than `llama`, biases, an activation other than
    /// SiLU or an unknown rope type are errors naming the field.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::Serde(format!("config.json: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::config("config.json", "must hold a JSON object"));
        };
        match field(&map, "model_type").and_then(Value::as_str) {
            Some("llama") => {}
            other => {
                return Err(Error::config(
                    "model_type",
                    format!(
                        "{} is not a Llama config; trainkit reads the model types {}",
                        other.map_or("a missing model_type".to_string(), |t| format!("`{t}`")),
                        super::families::list()
                    ),
                ))
            }
        }
        for bias in ["attention_bias", "mlp_bias"] {
            if field(&map, bias).and_then(Value::as_bool) == Some(true) {
                return Err(Error::config(
                    bias,
                    "trainkit's Llama has no biases (as Llama, SmolLM2 and TinyLlama); this \
                     model needs them",
                ));
            }
        }
        if let Some(act) = field(&map, "hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(Error::config(
                    "hidden_act",
                    format!("`{act}` is not supported; Llama's MLP uses silu"),
                ));
            }
        }
        Self::from_map(&map)
    }

    /// The fields every Llama-like family shares (Qwen's too), from a parsed
    /// `config.json`, without checking its `model_type`.
    pub(crate) fn from_map(map: &Map<String, Value>) -> Result<Self> {
        let hidden_size = required(map, "hidden_size")?;
        let num_attention_heads = required(map, "num_attention_heads")?;
        let config = LlamaConfig {
            hidden_size,
            intermediate_size: required(map, "intermediate_size")?,
            num_hidden_layers: required(map, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: count(map, "num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim: count(map, "head_dim")?.unwrap_or(hidden_size / num_attention_heads),
            vocab_size: required(map, "vocab_size")?,
            max_position_embeddings: count(map, "max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: number(map, "rms_norm_eps", "")?.unwrap_or(1e-6),
            tie_word_embeddings: field(map, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            initializer_range: number(map, "initializer_range", "")?.unwrap_or(0.02),
            rope: rope(map)?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that the shape is buildable; errors name the field and what would be valid.
    pub fn validate(&self) -> Result<()> {
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(Error::config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(Error::config(
                "head_dim",
                format!("{} must be even for rotary embeddings", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(Error::config("rms_norm_eps", "must be a finite value > 0"));
        }
        Ok(())
    }
}

/// Writes `rope` into a `config.json` value in both transformers 5's `rope_parameters`
/// and 4.x's `rope_theta` and `rope_scaling`, so either version loads it.
pub(crate) fn write_rope(v: &mut Value, rope: &Rope) {
    let mut params = match rope.scaling {
        RopeScaling::Default => json!({"rope_type": "default"}),
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings as u64,
        }),
    };
    let scaling = (rope.scaling != RopeScaling::Default).then(|| params.clone());
    params["rope_theta"] = json!(rope.theta);
    v["rope_parameters"] = params;
    v["rope_theta"] = json!(rope.theta);
    v["rope_scaling"] = json!(scaling);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What transformers 5.17 writes for a small `LlamaConfig` (its `to_dict`).
    const V5: &str = r#"{"architectures": null, "attention_bias": false, "attention_dropout": 0.0,
        "bos_token_id": 1, "dtype": null, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 256, "mlp_bias": false, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64},
        "tie_word_embeddings": true, "transformers_version": "5.17.0", "use_cache": true,
        "vocab_size": 300}"#;

    /// Llama 3.2 1B's published config.json (transformers 4.45 form).
    const LLAMA_3_2_1B: &str = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256}"#;

    #[test]
    fn both_forms_parse() {
        let c = LlamaConfig::from_json(V5).unwrap();
        assert_eq!(
            (c.hidden_size, c.num_key_value_heads, c.head_dim),
            (64, 2, 16)
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.theta, 500_000.0);
        assert!(matches!(c.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        let c = LlamaConfig::from_json(LLAMA_3_2_1B).unwrap();
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(
            crate::model::Family::shape(&c),
            crate::estimate::preset("llama-3.2-1b").unwrap().shape
        );
        assert_eq!(
            crate::model::Family::shape(&c).exact_params().unwrap(),
            1_235_814_400
        );
        // The oldest form: no rope table at all, no kv heads (multi-head attention).
        let old = r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 50,
            "rope_scaling": null, "some_new_field": [1, 2]}"#;
        let c = LlamaConfig::from_json(old).unwrap();
        assert_eq!(
            (c.num_key_value_heads, c.head_dim, c.rope.theta),
            (4, 8, 10_000.0)
        );
        assert_eq!(c.rope.scaling, RopeScaling::Default);
        let linear = r#"{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 50,
            "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}"#;
        let c = LlamaConfig::from_json(linear).unwrap();
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn what_trainkit_cannot_build_is_refused_by_name() {
        let with = |key: &str, value: &str| {
            V5.replacen(
                "\"vocab_size\": 300",
                &format!("\"vocab_size\": 300, \"{key}\": {value}"),
                1,
            )
        };
        for (text, needle) in [
            (
                V5.replace("\"attention_bias\": false", "\"attention_bias\": true"),
                "attention_bias",
            ),
            (
                V5.replace("\"mlp_bias\": false", "\"mlp_bias\": true"),
                "mlp_bias",
            ),
            (V5.replace("\"silu\"", "\"gelu\""), "hidden_act"),
            (
                V5.replace("\"model_type\": \"llama\"", "\"model_type\": \"mistral\""),
                "`gpt2` (GPT-2)",
            ),
            (V5.replace("\"llama3\"", "\"yarn\""), "rope_type"),
            (
                V5.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
                "num_key_value_heads",
            ),
            (V5.replace("\"hidden_size\": 64,", ""), "hidden_size"),
            (
                V5.replace("\"low_freq_factor\": 1.0,", ""),
                "low_freq_factor",
            ),
            (with("rms_norm_eps", "-1"), "rms_norm_eps"),
            ("[1, 2]".to_string(), "JSON object"),
        ] {
            let e = LlamaConfig::from_json(&text).unwrap_err().to_string();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }

    /// transformers 5.17's `ROPE_INIT_FUNCTIONS` on the same parameters.
    #[test]
    fn frequencies_match_transformers() {
        let llama3 = LlamaConfig::from_json(V5).unwrap().rope.inv_freq(16);
        let want = [
            1.0,
            0.067_133_04,
            0.001_175_188_5,
            0.000_227_895_78,
            4.419_417e-5,
            8.570_256e-6,
            1.661_967_4e-6,
            3.222_933e-7,
        ];
        let linear = Rope {
            theta: 10_000.0,
            scaling: RopeScaling::Linear { factor: 4.0 },
        }
        .inv_freq(16);
        let want_linear = [
            0.25,
            0.079_056_94,
            0.025,
            0.007_905_695,
            0.002_5,
            0.000_790_569_47,
            0.000_25,
            7.905_695e-5,
        ];
        for (got, want) in [(llama3, want), (linear, want_linear)] {
            for (g, w) in got.iter().zip(want) {
                assert!(((g - w) / w).abs() < 1e-6, "{g} vs {w}");
            }
        }
    }
}
