//! From the command line to a run config: where the config comes from (a file, a resumed
//! checkpoint, a model directory, or the defaults), the flags laid over it, and the
//! fine-tuning defaults of a run that starts from a trained model.

use super::{Overrides, RunConfig, ShapeFlags};
use crate::data::{TokenizerKind, TOKENIZER_FILE};
use crate::error::{Error, Result};
use crate::save::RUN_CONFIG_FILE;
use std::path::{Path, PathBuf};

/// Where a run's config comes from, and the flags over it: the settings of `trainkit
/// train` that decide its [`RunConfig`].
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct RunFlags {
    /// A TOML run config (see examples/configs/); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run saved in this directory, exactly where it stopped (keeps saving
    /// there unless --out says otherwise).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from (or continue) a PEFT LoRA adapter saved in this directory, on the base
    /// model of --init-from; its rank, α and targets are the run's.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// The settings laid over the config.
    #[command(flatten)]
    pub overrides: Overrides,
}

/// A resolved run config, and the line saying which fine-tuning defaults it got (a new run
/// from a model directory without a config file).
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The run's config, validated.
    pub config: RunConfig,
    /// What [`RunConfig::apply_fine_tuning_defaults`] set, when it applied.
    pub defaults: Option<String>,
}

impl RunFlags {
    /// The run config: the file, or the resumed checkpoint's, with the flags laid over
    /// it; a model directory (`--init-from`, a Hugging Face model id resolved in the local
    /// cache) gives the model's family and shape, which shape flags may only repeat; a new
    /// run from a model without `--config` gets the fine-tuning defaults. Every error
    /// names the flag.
    pub fn resolve(&self) -> Result<Resolved> {
        let mut cfg = match (&self.resume, &self.config) {
            (Some(_), Some(_)) => {
                return Err(Error::config(
                    "--config",
                    "a resumed run uses the config saved in its directory; drop --config and \
                     pass only the flags that change (e.g. --steps)",
                ))
            }
            (Some(dir), None) => {
                crate::save::recover_directory(dir)?;
                let path = dir.join(RUN_CONFIG_FILE);
                if !path.is_file() {
                    return Err(Error::data(
                        dir.display().to_string(),
                        format!(
                            "has no {RUN_CONFIG_FILE}: --resume takes a directory written by \
                             `trainkit train --out DIR`; to start from weights alone use \
                             --init-from"
                        ),
                    ));
                }
                RunConfig::from_file(path)?
            }
            (None, Some(path)) => RunConfig::from_file(path)?,
            (None, None) => RunConfig::default(),
        };
        let mut overrides = self.overrides.clone();
        // A Hugging Face model id (`org/name`) names its snapshot in the local cache
        // (downloaded into it first when missing and the network allows).
        if let Some(spec) = &overrides.init_from {
            overrides.init_from = Some(crate::save::hub::resolve_model(spec)?);
        }
        if let Some(dir) = &self.resume {
            resumed_base_and_adapter(&cfg, dir, &overrides)?;
        }
        if self.adapter.is_some() {
            // With --adapter the LoRA comes from its directory, QLoRA and the dropout
            // with it (`adapter_settings`).
            let lora = &mut overrides.lora;
            lora.dropout = None;
            lora.modules_to_save = None;
            lora.qlora = false;
            lora.use_dora = false;
        }
        let init_dir = overrides
            .init_from
            .clone()
            .or_else(|| cfg.training.init_from.clone());
        if let (Some(dir), None) = (&init_dir, &self.resume) {
            // The model's family and shape come from the directory; shape flags may only
            // repeat them.
            let model = crate::model::read_model_config(dir)?;
            let mut wanted = model.clone();
            wanted.reshape(&overrides.shape)?;
            if wanted != model {
                return Err(Error::config(
                    "--init-from",
                    format!(
                        "the {} model in {} is {}, which the shape flags contradict; drop them",
                        model.arch(),
                        dir.display(),
                        model.build()?.describe()
                    ),
                ));
            }
            cfg.model = model;
        }
        if self.resume.is_some() && overrides.out.is_none() && cfg.output.out.is_none() {
            overrides.out = self.resume.clone();
        }
        if init_dir.is_some() {
            overrides.shape = ShapeFlags::default();
        }
        // Data given with --init-from was tokenized by the model's own tokenizer: without
        // --tokenizer, the directory's tokenizer.json is the data's (and goes with the
        // model into --out).
        if let (Some(dir), None, Some(_)) = (&init_dir, &self.overrides.tokenizer, &overrides.data)
        {
            if dir.join(TOKENIZER_FILE).is_file() {
                overrides.tokenizer = Some(TokenizerKind::HuggingFace(dir.join(TOKENIZER_FILE)));
            }
        }
        // A model from scratch gets the context its sequences need.
        if let (None, None, None, Some(t)) = (
            &init_dir,
            &self.resume,
            self.overrides.shape.n_positions,
            overrides.seq_len,
        ) {
            if t > cfg.model.context() {
                overrides.shape.n_positions = Some(t);
            }
        }
        overrides.apply(&mut cfg)?;
        if let Some(dir) = &self.adapter {
            adapter_settings(&mut cfg, dir, self)?;
        }
        let defaults = match (&init_dir, &self.resume, &self.config) {
            (Some(_), None, None) => Some(cfg.apply_fine_tuning_defaults(&overrides)?),
            _ => None,
        };
        Ok(Resolved {
            config: cfg,
            defaults,
        })
    }
}

/// A resumed run keeps the base model and the adapter it was saved with: flags that would
/// change them (`--init-from`, `--qlora`, the LoRA flags) may only repeat them, else the
/// error names the flag and what the run in `dir` is.
fn resumed_base_and_adapter(cfg: &RunConfig, dir: &Path, flags: &Overrides) -> Result<()> {
    let lora = cfg.adapter.as_ref().and_then(|a| a.as_lora());
    let nf4 = cfg
        .adapter
        .as_ref()
        .is_some_and(|a| a.base_dtype().is_some());
    let what = match lora {
        Some(l) => format!(
            "{} rank {}, α {}, targets {}",
            if nf4 { "QLoRA (NF4 base)" } else { "LoRA" },
            l.rank,
            l.alpha,
            l.targets.join(",")
        ),
        None => "a full model (no adapter)".to_string(),
    };
    let refuse = |flag: &str| {
        Err(Error::config(
            flag,
            format!(
                "the run in {} trains {what}, and a resumed run keeps its base model and \
                 adapter: drop {flag} (or start a new run with --init-from)",
                dir.display()
            ),
        ))
    };
    let f = &flags.lora;
    if f.qlora && !nf4 {
        return refuse("--qlora");
    }
    if f.rank.is_some_and(|r| lora.is_none_or(|l| l.rank != r)) {
        return refuse("--lora-rank");
    }
    if f.alpha.is_some_and(|a| lora.is_none_or(|l| l.alpha != a)) {
        return refuse("--lora-alpha");
    }
    if f.targets
        .as_ref()
        .is_some_and(|t| lora.is_none_or(|l| l.targets != *t))
    {
        return refuse("--lora-targets");
    }
    if f.dropout
        .is_some_and(|p| lora.is_none_or(|l| l.dropout != p))
    {
        return refuse("--lora-dropout");
    }
    if f.modules_to_save
        .as_ref()
        .is_some_and(|m| lora.is_none_or(|l| l.modules_to_save != *m))
    {
        return refuse("--modules-to-save");
    }
    if f.use_dora && lora.is_none_or(|l| !l.dora) {
        return refuse("--use-dora");
    }
    if flags
        .init_from
        .as_ref()
        .is_some_and(|d| cfg.training.init_from.as_ref() != Some(d))
    {
        return refuse("--init-from");
    }
    Ok(())
}

/// `--adapter DIR`: the run trains the PEFT adapter in `dir` on the base model of
/// --init-from, with the adapter's rank, α and targets (LoRA flags may only repeat them).
fn adapter_settings(cfg: &mut RunConfig, dir: &Path, flags: &RunFlags) -> Result<()> {
    if flags.resume.is_some() {
        return Err(Error::config(
            "--adapter",
            "a resumed run continues the adapter saved in its directory; drop --adapter",
        ));
    }
    if cfg.training.init_from.is_none() {
        return Err(Error::config(
            "--adapter",
            "an adapter trains on its base model: add --init-from BASE_DIR (the model the \
             adapter was made for)",
        ));
    }
    let f = &flags.overrides.lora;
    let (mut lora, _) = crate::adapter::peft::read(dir)?;
    // The adapter goes on with its dropout unless --lora-dropout says otherwise.
    if let Some(p) = f.dropout {
        lora.dropout = p;
        lora.validate().map_err(|e| e.for_field("--lora-dropout"))?;
    }
    if f.rank.is_some_and(|r| r != lora.rank)
        || f.alpha.is_some_and(|a| a != lora.alpha)
        || (f.use_dora && !lora.dora)
        || f.modules_to_save
            .as_ref()
            .is_some_and(|m| *m != lora.modules_to_save)
        || f.targets.as_ref().is_some_and(|t| *t != lora.targets)
    {
        return Err(Error::config(
            "--adapter",
            format!(
                "the adapter in {} is rank {}, α {}, targets {}; the LoRA flags say \
                 otherwise (drop them)",
                dir.display(),
                lora.rank,
                lora.alpha,
                lora.targets.join(",")
            ),
        ));
    }
    let lora = if f.qlora
        || cfg
            .adapter
            .as_ref()
            .is_some_and(|a| a.base_dtype().is_some())
    {
        lora.with_nf4_base()
    } else {
        lora
    };
    cfg.adapter = Some(Box::new(lora));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, FromArgMatches};

    fn parse(args: &[&str]) -> RunFlags {
        let cmd = RunFlags::augment_args(clap::Command::new("train"));
        let matches = cmd
            .try_get_matches_from(std::iter::once("train").chain(args.iter().copied()))
            .unwrap();
        RunFlags::from_arg_matches(&matches).unwrap()
    }

    #[test]
    fn a_command_line_resolves_into_its_run_config() {
        let r = parse(&[
            "--arch",
            "llama",
            "--n-layer",
            "2",
            "--steps",
            "7",
            "--precision",
            "bf16",
            "--lora-rank",
            "4",
        ])
        .resolve()
        .unwrap();
        let cfg = r.config;
        assert_eq!(r.defaults, None);
        assert_eq!(cfg.model.arch(), "llama");
        assert_eq!(cfg.model.shape().layers, 2);
        assert_eq!(cfg.training.steps, 7);
        assert_eq!(cfg.precision.compute_dtype(), crate::DType::Bf16);
        let lora = cfg.adapter.as_ref().and_then(|a| a.as_lora()).unwrap();
        assert_eq!((lora.rank, lora.alpha), (4, 8.0));
        assert_eq!(lora.targets, ["q_proj", "v_proj"]);
        // Where the config comes from is decided once: a resumed run keeps its own.
        let err = parse(&["--resume", "run", "--config", "run.toml"])
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--config"), "{err}");
    }
}
