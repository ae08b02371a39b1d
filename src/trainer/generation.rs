//! transformers' `generation_config.json`: the sampling settings a model ships with, which
//! `generate()` takes as its defaults (an instruct model's temperature, top-p and
//! repetition penalty; its end-of-turn tokens).

use super::SamplingOptions;
use crate::error::{Error, Result};
use crate::save::GENERATION_CONFIG_FILE;
use serde::Deserialize;
use std::path::Path;

/// The settings of a `generation_config.json` that sampling uses; `None` where the file
/// leaves one out (or writes `null`), the rest of the file ignored.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    /// Whether to sample at all (transformers' default: no, the most likely token).
    #[serde(default)]
    pub do_sample: Option<bool>,
    /// Softmax temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Tokens to sample among (transformers' default 50).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// Nucleus sampling's probability.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// min-p sampling's ratio.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// The repetition penalty.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Tokens to generate.
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
    /// The tokens that end generation: one id or a list.
    #[serde(default, deserialize_with = "token_ids")]
    pub eos_token_id: Vec<u32>,
}

/// One token id, a list of them, or `null`.
fn token_ids<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Ids {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<Ids>::deserialize(d)? {
        None => Vec::new(),
        Some(Ids::One(id)) => vec![id],
        Some(Ids::Many(ids)) => ids,
    })
}

impl GenerationConfig {
    /// The `generation_config.json` of model directory `dir`, `None` where it has none.
    pub fn read(dir: &Path) -> Result<Option<GenerationConfig>> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::data(path.display().to_string(), e.to_string()))
    }

    /// The sampling these settings make, with transformers' defaults for what they leave
    /// out: the most likely token (temperature 0) unless `do_sample`, and when sampling a
    /// temperature of 1, the 50 most likely tokens, top-p 1, no min-p, no repetition
    /// penalty.
    pub fn sampling(&self) -> SamplingOptions {
        let sample = self.do_sample.unwrap_or(false);
        SamplingOptions {
            temperature: match sample {
                true => self.temperature.unwrap_or(1.0),
                false => 0.0,
            },
            top_k: self.top_k.unwrap_or(50),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            ..SamplingOptions::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-Instruct's file, and one that does not sample.
    #[test]
    fn a_models_settings_become_its_sampling() {
        let qwen: GenerationConfig = serde_json::from_str(
            r#"{"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true,
                "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
                "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                "transformers_version": "4.37.0"}"#,
        )
        .unwrap();
        assert_eq!(qwen.eos_token_id, [151645, 151643]);
        let s = qwen.sampling();
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.repetition_penalty),
            (0.7, 20, 0.8, 1.05)
        );
        let greedy: GenerationConfig =
            serde_json::from_str(r#"{"eos_token_id": 50256, "temperature": null}"#).unwrap();
        assert_eq!(greedy.eos_token_id, [50256]);
        assert_eq!(greedy.sampling().temperature, 0.0);
        let sampled: GenerationConfig = serde_json::from_str(r#"{"do_sample": true}"#).unwrap();
        let s = sampled.sampling();
        assert_eq!((s.temperature, s.top_k), (1.0, 50));
        assert!(serde_json::from_str::<GenerationConfig>(r#"{"top_k": "many"}"#).is_err());
    }
}
