//! Named models with their published architectures: the GPT-2 family, SmolLM2, Llama 3,
//! Qwen2.5 and Qwen3.

use crate::error::{Error, Result};
use crate::model::{Biases, Mlp, Norm, Positions, Rope, RopeScaling, Shape};

/// A named model: its shape (with its published context, rotary embedding, norm epsilon
/// and initialisation) and the sequence length estimates use by default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    /// The name `trainkit memory --model` takes (`gpt2`, `llama-8b`, ...).
    pub name: &'static str,
    /// The model it describes.
    pub description: &'static str,
    /// Layers, widths, heads, vocabulary, the form of each block and the longest sequence
    /// the model was trained for ([`Shape::context`]).
    pub shape: Shape,
    /// The sequence length estimates assume unless told otherwise: the context for
    /// GPT-2, 4096 for Llama (the playbook's usual training length).
    pub default_seq_len: u64,
}

const fn gpt2(
    name: &'static str,
    description: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
) -> Preset {
    Preset {
        name,
        description,
        shape: Shape::gpt(layers, hidden, heads, 50257, 1024),
        default_seq_len: 1024,
    }
}

/// Llama 3's rotary embedding: θ = 500 000 with the `llama3` scaling by `factor`.
const fn llama3_rope(factor: f64) -> Rope {
    Rope {
        theta: 500_000.0,
        scaling: RopeScaling::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        },
    }
}

/// A rotary embedding of base `theta` without scaling.
const fn plain_rope(theta: f64) -> Rope {
    Rope {
        theta,
        scaling: RopeScaling::Default,
    }
}

#[allow(clippy::too_many_arguments)]
const fn llama(
    name: &'static str,
    description: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    tied_embeddings: bool,
    rope_factor: f64,
) -> Preset {
    llama_family(
        name,
        description,
        [layers, hidden, heads, kv_heads, ffn],
        128_256,
        tied_embeddings,
        131_072,
        (llama3_rope(rope_factor), 0.02),
    )
}

/// A Llama-shaped model (RMSNorm with eps 1e-5, SwiGLU, grouped-query attention, rotary
/// positions, no biases): `[layers, hidden, heads, kv_heads, ffn]`, its vocabulary, tying,
/// context, rotary embedding and initialisation.
const fn llama_family(
    name: &'static str,
    description: &'static str,
    [layers, hidden, heads, kv_heads, ffn]: [usize; 5],
    vocab: usize,
    tied_embeddings: bool,
    context: usize,
    (rope, init_std): (Rope, f64),
) -> Preset {
    Preset {
        name,
        description,
        shape: Shape {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            ffn,
            vocab,
            context,
            norm: Norm::RmsNorm,
            norm_eps: 1e-5,
            norm_offset: false,
            positions: Positions::Rotary(rope),
            mlp: Mlp::SwiGlu,
            bias: Biases::NONE,
            qk_norm: false,
            tied_embeddings,
            embedding_scale: None,
            init_std,
            scaled_residual_init: false,
        },
        default_seq_len: 4096,
    }
}

/// A Qwen-shaped model (RMSNorm with eps 1e-6, SwiGLU, grouped-query attention, rotary
/// positions of θ = 1 000 000, the vocabulary of 151 936): `[layers, hidden, heads,
/// kv_heads, ffn]`, heads `head_dim` wide, Qwen2's q/k/v biases or Qwen3's per-head q/k
/// norm, its tying and context.
const fn qwen(
    name: &'static str,
    description: &'static str,
    [layers, hidden, heads, kv_heads, ffn]: [usize; 5],
    head_dim: usize,
    qwen3: bool,
    tied_embeddings: bool,
    context: usize,
) -> Preset {
    let base = llama_family(
        name,
        description,
        [layers, hidden, heads, kv_heads, ffn],
        151_936,
        tied_embeddings,
        context,
        (plain_rope(1_000_000.0), 0.02),
    );
    Preset {
        shape: Shape {
            head_dim,
            norm_eps: 1e-6,
            bias: if qwen3 { Biases::NONE } else { Biases::QKV },
            qk_norm: qwen3,
            ..base.shape
        },
        ..base
    }
}

/// Every preset, smallest first within each family. The SmolLM2 and Llama 3 shapes are
/// those of each model's published `config.json`; `llama-1b` and `llama-8b` are the
/// shorter names of `llama-3.2-1b` and `llama-3.1-8b`.
pub const PRESETS: [Preset; 19] = [
    gpt2("gpt2", "GPT-2 small (124M)", 12, 768, 12),
    gpt2("gpt2-medium", "GPT-2 medium (355M)", 24, 1024, 16),
    gpt2("gpt2-large", "GPT-2 large (774M)", 36, 1280, 20),
    gpt2("gpt2-xl", "GPT-2 XL (1.5B)", 48, 1600, 25),
    llama_family(
        "smollm2-135m",
        "SmolLM2 135M",
        [30, 576, 9, 3, 1536],
        49_152,
        true,
        8192,
        (plain_rope(100_000.0), 0.041_666_666_666_666_664),
    ),
    llama_family(
        "smollm2-360m",
        "SmolLM2 360M",
        [32, 960, 15, 5, 2560],
        49_152,
        true,
        8192,
        (plain_rope(100_000.0), 0.02),
    ),
    llama_family(
        "smollm2-1.7b",
        "SmolLM2 1.7B",
        [24, 2048, 32, 32, 8192],
        49_152,
        true,
        8192,
        (plain_rope(130_000.0), 0.02),
    ),
    llama(
        "llama-3.2-1b",
        "Llama 3.2 1B",
        16,
        2048,
        32,
        8,
        8192,
        true,
        32.0,
    ),
    llama(
        "llama-3.2-3b",
        "Llama 3.2 3B",
        28,
        3072,
        24,
        8,
        8192,
        true,
        32.0,
    ),
    llama(
        "llama-3.1-8b",
        "Llama 3.1 8B",
        32,
        4096,
        32,
        8,
        14_336,
        false,
        8.0,
    ),
    llama(
        "llama-1b",
        "Llama 3.2 1B",
        16,
        2048,
        32,
        8,
        8192,
        true,
        32.0,
    ),
    llama(
        "llama-8b",
        "Llama 3.1 8B",
        32,
        4096,
        32,
        8,
        14_336,
        false,
        8.0,
    ),
    llama(
        "llama-70b",
        "Llama 3.1 70B",
        80,
        8192,
        64,
        8,
        28_672,
        false,
        8.0,
    ),
    llama(
        "llama-405b",
        "Llama 3.1 405B",
        126,
        16_384,
        128,
        8,
        53_248,
        false,
        8.0,
    ),
    qwen(
        "qwen2.5-0.5b",
        "Qwen2.5 0.5B",
        [24, 896, 14, 2, 4864],
        64,
        false,
        true,
        32_768,
    ),
    qwen(
        "qwen3-0.6b",
        "Qwen3 0.6B",
        [28, 1024, 16, 8, 3072],
        128,
        true,
        true,
        40_960,
    ),
    qwen(
        "qwen3-1.7b",
        "Qwen3 1.7B",
        [28, 2048, 16, 8, 6144],
        128,
        true,
        true,
        40_960,
    ),
    qwen(
        "qwen3-4b",
        "Qwen3 4B",
        [36, 2560, 32, 8, 9728],
        128,
        true,
        true,
        40_960,
    ),
    qwen(
        "qwen3-8b",
        "Qwen3 8B",
        [36, 4096, 32, 8, 12_288],
        128,
        true,
        false,
        40_960,
    ),
];

/// The preset called `name` (ignoring case), or `None`.
pub fn find_preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// The names of every preset, comma-separated, for messages.
pub fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The preset called `name`; the error lists the known names.
pub fn preset(name: &str) -> Result<&'static Preset> {
    find_preset(name).ok_or_else(|| {
        Error::config(
            "model",
            format!(
                "`{name}` is not a known model; use one of {}",
                preset_names()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_parameter_counts() {
        for (name, exact) in [
            ("gpt2", 124_439_808),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
            ("smollm2-135m", 134_515_008),
            ("smollm2-360m", 361_821_120),
            ("smollm2-1.7b", 1_711_376_384),
            ("llama-3.2-1b", 1_235_814_400),
            ("llama-3.2-3b", 3_212_749_824),
            ("llama-3.1-8b", 8_030_261_248),
            ("llama-1b", 1_235_814_400),
            ("llama-8b", 8_030_261_248),
            ("llama-70b", 70_553_706_496),
            ("llama-405b", 405_853_388_800),
        ] {
            let p = preset(name).unwrap();
            assert_eq!(p.shape.exact_params().unwrap(), exact, "{name}");
        }
    }

    /// The counts of the published Qwen configs (a tied head counted once): the
    /// shape's count, and the parameters the built model declares.
    #[test]
    fn qwen_parameter_counts() {
        for (name, exact, family) in [
            ("qwen2.5-0.5b", 494_032_768, "qwen2"),
            ("qwen3-0.6b", 596_049_920, "qwen3"),
            ("qwen3-1.7b", 1_720_574_976, "qwen3"),
            ("qwen3-4b", 4_022_468_096, "qwen3"),
            ("qwen3-8b", 8_190_735_360, "qwen3"),
        ] {
            let p = preset(name).unwrap();
            assert_eq!(p.shape.exact_params().unwrap(), exact, "{name}");
            let config = crate::model::ModelConfig::preset(name).unwrap();
            assert_eq!(config.arch(), family, "{name}");
            let declared: usize = config
                .build()
                .unwrap()
                .init_params()
                .iter()
                .map(|p| p.numel())
                .sum();
            assert_eq!(declared as u64, exact, "{name}");
        }
    }

    #[test]
    fn the_playbook_formula_beside_the_exact_count() {
        // GPT-2: the formula is exact but for the position embedding.
        let gpt2 = preset("gpt2").unwrap().shape;
        assert_eq!(
            gpt2.exact_params().unwrap() - gpt2.playbook_params().unwrap(),
            1024 * 768
        );
        // Llama: grouped-query attention and a SwiGLU MLP make the formula an
        // approximation (within 15% here).
        for name in ["llama-8b", "llama-70b", "llama-405b"] {
            let a = preset(name).unwrap().shape;
            assert!(!a.is_gpt_like());
            let (exact, formula) = (
                a.exact_params().unwrap() as f64,
                a.playbook_params().unwrap() as f64,
            );
            assert!(
                (formula / exact - 1.0).abs() < 0.15,
                "{name}: {formula} vs {exact}"
            );
        }
    }

    #[test]
    fn gpt2_matches_trainkits_config() {
        let p = preset("GPT2").unwrap();
        let c = crate::model::Gpt2Config::gpt2_124m();
        assert_eq!(p.shape, crate::model::Family::shape(&c));
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = preset("llama-7b").unwrap_err().to_string();
        assert!(
            e.contains("llama-7b") && e.contains("gpt2-xl") && e.contains("llama-405b"),
            "{e}"
        );
    }
}
