//! The model `trainkit memory` estimates: a preset, a parameter count or raw dimensions.

use super::units::group;
use super::MemoryArgs;
use crate::as_flag;
use trainkit::estimate::{preset_names, Mlp, Norm, Preset, Shape, PRESETS};
use trainkit::{Error, Result};

/// The sequence length of estimates for a model without a preset: the playbook's usual
/// training length.
const DEFAULT_SEQ_LEN: u64 = 4096;

/// The model the estimate is for.
pub(super) struct Subject {
    /// Preset name, if any.
    pub(super) name: Option<&'static str>,
    /// What to call it in the table.
    pub(super) title: String,
    /// Parameters the model state is computed from.
    pub(super) params: u64,
    /// The dimensions, when known (not with --params).
    pub(super) shape: Option<Shape>,
    /// Sequence length when --seq-len is not given.
    pub(super) default_seq_len: u64,
}

pub(super) fn flag_error(flag: &str, message: impl Into<String>) -> Error {
    Error::config(flag, message)
}

/// A parameter count: digits with an optional fraction and K, M, B or T suffix.
pub(super) fn parse_count(text: &str) -> Result<u64> {
    let bad = || {
        flag_error(
            "--params",
            format!(
                "`{text}` is not a parameter count; use a number with an optional K, M, B or \
                 T suffix, e.g. 7B, 1.5B or 124M"
            ),
        )
    };
    let t = text.trim().replace('_', "");
    let (number, scale) = match t.char_indices().last() {
        Some((at, c)) if c.is_ascii_alphabetic() => {
            let scale: u64 = match c.to_ascii_uppercase() {
                'K' => 1_000,
                'M' => 1_000_000,
                'B' => 1_000_000_000,
                'T' => 1_000_000_000_000,
                _ => return Err(bad()),
            };
            (&t[..at], scale)
        }
        _ => (t.as_str(), 1),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() && frac.is_empty() || !digits(whole) || !digits(frac) {
        return Err(bad());
    }
    let too_big = || flag_error("--params", format!("`{text}` is too large"));
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| too_big())?
    };
    let mut count = whole.checked_mul(scale).ok_or_else(too_big)?;
    if !frac.is_empty() {
        let frac_value: u128 = frac.parse().map_err(|_| too_big())?;
        let denom = 10u128.checked_pow(frac.len() as u32).ok_or_else(too_big)?;
        let scaled = frac_value * scale as u128;
        if scaled % denom != 0 {
            return Err(flag_error(
                "--params",
                format!("`{text}` is not a whole number of parameters; drop some decimals"),
            ));
        }
        let extra = u64::try_from(scaled / denom).map_err(|_| too_big())?;
        count = count.checked_add(extra).ok_or_else(too_big)?;
    }
    if count == 0 {
        return Err(flag_error("--params", "must be at least 1"));
    }
    Ok(count)
}

pub(super) fn positive(flag: &str, value: Option<u64>) -> Result<Option<u64>> {
    match value {
        Some(0) => Err(flag_error(flag, "must be at least 1")),
        v => Ok(v),
    }
}

pub(super) fn describe(arch: &Shape) -> String {
    let mut heads = if arch.kv_heads == arch.heads {
        format!("{} heads", arch.heads)
    } else {
        format!("{} heads ({} kv)", arch.heads, arch.kv_heads)
    };
    if arch.head_dim.saturating_mul(arch.heads) != arch.hidden {
        heads += &format!(" of {}", arch.head_dim);
    }
    if arch.qk_norm {
        heads += ", q/k norm";
    }
    if arch.bias == trainkit::model::Biases::QKV {
        heads += ", q/k/v biases";
    }
    let mlp = match arch.mlp {
        Mlp::Gelu => "GELU MLP",
        Mlp::SwiGlu => "SwiGLU MLP",
        Mlp::GeGlu => "GeGLU MLP",
    };
    let norm = match arch.norm {
        Norm::LayerNorm => "LayerNorm",
        Norm::RmsNorm => "RMSNorm",
    };
    format!(
        "{} layers, hidden {}, {heads}, ffn {}, vocab {}, {mlp}, {norm}{}",
        arch.layers,
        arch.hidden,
        arch.ffn,
        arch.vocab,
        if arch.tied_embeddings {
            ", tied embeddings"
        } else {
            ""
        }
    )
}

pub(super) fn subject(args: &MemoryArgs) -> Result<Subject> {
    let dims = [
        ("--layers", args.layers),
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--vocab", args.vocab),
        ("--kv-heads", args.kv_heads),
        ("--ffn", args.ffn),
    ];
    let given: Vec<&str> = dims
        .iter()
        .filter(|(_, v)| v.is_some())
        .map(|(f, _)| *f)
        .collect();
    match (&args.model, &args.params) {
        (Some(_), Some(_)) => Err(flag_error(
            "--model",
            "--model and --params both name the model; give one of them",
        )),
        (Some(_), None) | (None, Some(_)) if !given.is_empty() => Err(flag_error(
            given[0],
            format!(
                "{} fixes the model; drop {} or the {} flag",
                if args.model.is_some() {
                    "--model"
                } else {
                    "--params"
                },
                given.join(", "),
                if args.model.is_some() {
                    "--model"
                } else {
                    "--params"
                }
            ),
        )),
        (Some(name), None) => {
            let preset: &'static Preset = PRESETS
                .iter()
                .find(|p| p.name.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    flag_error(
                        "--model",
                        format!(
                            "`{name}` is not a known model; use one of {}",
                            preset_names()
                        ),
                    )
                })?;
            Ok(Subject {
                name: Some(preset.name),
                title: format!(
                    "{}, {}: {}",
                    preset.name,
                    preset.description,
                    describe(&preset.shape)
                ),
                params: preset.shape.exact_params().map_err(as_flag)?,
                shape: Some(preset.shape),
                default_seq_len: preset.default_seq_len,
            })
        }
        (None, Some(text)) => {
            let params = parse_count(text)?;
            Ok(Subject {
                name: None,
                title: format!("a model of {} parameters (--params {text})", group(params)),
                params,
                shape: None,
                default_seq_len: DEFAULT_SEQ_LEN,
            })
        }
        (None, None) => {
            for (flag, v) in dims {
                positive(flag, v)?;
            }
            let (Some(layers), Some(hidden), Some(heads), Some(vocab)) =
                (args.layers, args.hidden, args.heads, args.vocab)
            else {
                if given.is_empty() {
                    return Err(flag_error(
                        "--model",
                        format!(
                            "no model given; use --model NAME ({}), --params N (e.g. 7B) or \
                             --layers, --hidden, --heads and --vocab",
                            preset_names()
                        ),
                    ));
                }
                let missing: Vec<&str> = dims[..4]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(f, _)| *f)
                    .collect();
                return Err(flag_error(
                    missing[0],
                    format!(
                        "raw dimensions need --layers, --hidden, --heads and --vocab; add {}",
                        missing.join(", ")
                    ),
                ));
            };
            let dim = |flag: &str, v: u64| {
                usize::try_from(v).map_err(|_| flag_error(flag, format!("{v} is too large")))
            };
            let gpt = Shape::gpt(
                dim("--layers", layers)?,
                dim("--hidden", hidden)?,
                dim("--heads", heads)?,
                dim("--vocab", vocab)?,
                DEFAULT_SEQ_LEN as usize,
            );
            // The playbook's GPT: no position parameters in the count.
            let shape = Shape {
                positions: trainkit::model::Positions::None,
                kv_heads: dim("--kv-heads", args.kv_heads.unwrap_or(heads))?,
                ffn: match args.ffn {
                    Some(ffn) => dim("--ffn", ffn)?,
                    None => gpt.ffn,
                },
                ..gpt
            };
            let params = shape.exact_params().map_err(as_flag)?;
            Ok(Subject {
                name: None,
                title: describe(&shape),
                params,
                shape: Some(shape),
                default_seq_len: DEFAULT_SEQ_LEN,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts() {
        for (text, want) in [
            ("7B", 7_000_000_000),
            ("7b", 7_000_000_000),
            ("1.5B", 1_500_000_000),
            ("124M", 124_000_000),
            ("350K", 350_000),
            ("2T", 2_000_000_000_000),
            ("0.5T", 500_000_000_000),
            ("124439808", 124_439_808),
            ("124_439_808", 124_439_808),
            (" 70B ", 70_000_000_000),
        ] {
            assert_eq!(parse_count(text).unwrap(), want, "{text}");
        }
        for text in [
            "",
            "B",
            "7X",
            "7.B.",
            "-1B",
            "1e9",
            "0",
            "0B",
            "1.0000000001K",
        ] {
            assert!(parse_count(text).is_err(), "{text}");
        }
        assert!(parse_count("99999999999T").is_err());
        assert!(parse_count("18446744073709551616").is_err());
    }
}
