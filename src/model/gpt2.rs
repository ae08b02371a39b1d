//! GPT-2 with Hugging Face semantics: pre-norm blocks, learned positions, GELU (tanh),
//! LayerNorm eps 1e-5, tied input and output embeddings, no dropout.

use super::shape_flags::set;
use super::{
    Biases, Decoder, Family, FamilyConfig, LayerSlot, Mlp, Norm, Positions, Shape, ShapeFlags, Slot,
};
use crate::error::{Error, Result};
use crate::save::StoredTensor;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// GPT-2's `<|endoftext|>` id.
const EOT: u32 = 50256;

/// GPT-2's shape, with the field names of Hugging Face's `GPT2Config`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpt2Config {
    /// Transformer layers.
    pub n_layer: usize,
    /// Attention heads per layer.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Longest sequence (rows of the position embedding).
    pub n_positions: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
}

fn default_eps() -> f32 {
    1e-5
}

impl Gpt2Config {
    /// Every parameter's Hugging Face name and shape, in model order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        super::decoder::param_shapes(self)
    }

    /// GPT-2 small (124M): 12 layers, 12 heads, 768 wide, 1024 positions, vocab 50257.
    pub fn gpt2_124m() -> Self {
        Gpt2Config {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            n_positions: 1024,
            vocab_size: 50257,
            layer_norm_epsilon: 1e-5,
        }
    }

    /// The default model of `trainkit train`: a byte-level model that learns the built-in
    /// corpus in a couple of minutes on two CPU cores.
    pub fn small_bytes() -> Self {
        Gpt2Config {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            n_positions: 128,
            vocab_size: 256,
            layer_norm_epsilon: 1e-5,
        }
    }

    /// Checks that the shape is buildable; errors name the field and what would be valid.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("model.n_layer", self.n_layer),
            ("model.n_head", self.n_head),
            ("model.n_embd", self.n_embd),
            ("model.n_positions", self.n_positions),
            ("model.vocab_size", self.vocab_size),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(Error::config(field, "must be at least 1"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(Error::config(
                "model.n_embd",
                format!(
                    "{} is not divisible by n_head = {}; use a multiple of {}",
                    self.n_embd, self.n_head, self.n_head
                ),
            ));
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            return Err(Error::config(
                "model.layer_norm_epsilon",
                "must be a finite value > 0",
            ));
        }
        Ok(())
    }

    /// Number of parameters (embeddings tied, so counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        self.vocab_size * c + self.n_positions * c + l * (12 * c * c + 13 * c) + 2 * c
    }
}

impl FamilyConfig for Gpt2Config {
    const MODELS: &'static str = "GPT-2";

    fn read_config(path: &Path, text: &str) -> Result<Self> {
        parse_config(path, text)
    }

    /// The GPT-2 config of `shape`, if it is GPT-2 shaped: multi-head attention, a GELU
    /// MLP of width 4h, LayerNorms, biases, tied embeddings, learned positions and GPT-2's
    /// initialisation. Otherwise an error naming what differs.
    fn from_shape(shape: &Shape) -> Result<Self> {
        shape.validate()?;
        let mut differs = Vec::new();
        if shape.kv_heads != shape.heads {
            differs.push("grouped-query attention");
        }
        if shape.mlp != Mlp::Gelu || shape.ffn != shape.hidden.saturating_mul(4) {
            differs.push("an MLP other than GELU of width 4 × hidden");
        }
        if shape.norm != Norm::LayerNorm || shape.norm_offset {
            differs.push("a norm other than LayerNorm");
        }
        if shape.bias != Biases::ALL {
            differs.push("no biases");
        }
        if shape.qk_norm {
            differs.push("a per-head q/k norm");
        }
        if shape.head_dim.saturating_mul(shape.heads) != shape.hidden {
            differs.push("heads other than hidden / heads wide");
        }
        if !shape.tied_embeddings {
            differs.push("an untied output head");
        }
        if shape.positions != Positions::Learned {
            differs.push("no learned position embedding");
        }
        if shape.embedding_scale.is_some() {
            differs.push("a scaled token embedding");
        }
        if shape.init_std != 0.02 || !shape.scaled_residual_init {
            differs.push("an initialisation other than GPT-2's");
        }
        if !differs.is_empty() {
            return Err(Error::config(
                "model",
                format!(
                    "a GPT-2 model has none of: {} (a Llama-shaped model takes RMSNorm, a \
                     SwiGLU MLP and no biases)",
                    differs.join(", ")
                ),
            ));
        }
        let config = Gpt2Config {
            n_layer: shape.layers,
            n_head: shape.heads,
            n_embd: shape.hidden,
            n_positions: shape.context,
            vocab_size: shape.vocab,
            layer_norm_epsilon: shape.norm_eps as f32,
        };
        config.validate()?;
        Ok(config)
    }

    fn small() -> Self {
        Gpt2Config::small_bytes()
    }

    fn set_context(&mut self, context: usize) {
        self.n_positions = context;
    }
}

/// GPT-2, trainable on any backend with any checkpoint policy and precision.
pub type Gpt2 = Decoder<Gpt2Config>;

impl Family for Gpt2Config {
    const MODEL_TYPE: &'static str = "gpt2";
    const CONTEXT_FIELD: &'static str = "n_positions";

    fn shape(&self) -> Shape {
        Shape {
            layers: self.n_layer,
            hidden: self.n_embd,
            heads: self.n_head,
            kv_heads: self.n_head,
            head_dim: self.n_embd / self.n_head.max(1),
            ffn: 4 * self.n_embd,
            vocab: self.vocab_size,
            context: self.n_positions,
            norm: Norm::LayerNorm,
            norm_eps: f64::from(self.layer_norm_epsilon),
            norm_offset: false,
            positions: Positions::Learned,
            mlp: Mlp::Gelu,
            bias: Biases::ALL,
            qk_norm: false,
            tied_embeddings: true,
            embedding_scale: None,
            init_std: 0.02,
            scaled_residual_init: true,
        }
    }

    fn reshape(&mut self, flags: &ShapeFlags) -> Result<()> {
        for (flag, given) in [
            ("--n-kv-head", flags.n_kv_head.is_some()),
            ("--ffn", flags.ffn.is_some()),
            ("--rope-theta", flags.rope_theta.is_some()),
        ] {
            if given {
                return Err(Error::config(
                    flag,
                    "shapes a Llama model; add --arch llama (GPT-2 has multi-head attention, \
                     an MLP of 4 × n_embd and learned positions)",
                ));
            }
        }
        set(&mut self.n_layer, flags.n_layer);
        set(&mut self.n_head, flags.n_head);
        set(&mut self.n_embd, flags.n_embd);
        set(&mut self.vocab_size, flags.vocab_size);
        set(&mut self.n_positions, flags.n_positions);
        Ok(())
    }

    fn validate(&self) -> Result<()> {
        Gpt2Config::validate(self)
    }

    /// A transformers `GPT2Config` (`GPT2LMHeadModel`, tied head, tanh GELU, no
    /// dropout).
    fn hf_config(&self) -> Value {
        let mut v = json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "vocab_size": self.vocab_size,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
        });
        // GPT-2's <|endoftext|> when the vocabulary has it; otherwise none (transformers
        // would default to 50256).
        let eot = (self.vocab_size > EOT as usize).then_some(EOT);
        v["bos_token_id"] = json!(eot);
        v["eos_token_id"] = json!(eot);
        v
    }

    fn param_name(&self, slot: Slot) -> String {
        use LayerSlot as L;
        let name = match slot {
            Slot::Embed => "wte.weight".to_string(),
            Slot::Positions => "wpe.weight".to_string(),
            Slot::FinalNorm => "ln_f.weight".to_string(),
            Slot::FinalNormBias => "ln_f.bias".to_string(),
            Slot::Head => "lm_head.weight".to_string(),
            Slot::Layer(l, s) => {
                let part = match s {
                    L::Norm1 => "ln_1.weight",
                    L::Norm1Bias => "ln_1.bias",
                    L::Qkv => "attn.c_attn.weight",
                    L::QkvBias => "attn.c_attn.bias",
                    L::QNorm => "attn.q_norm.weight",
                    L::KNorm => "attn.k_norm.weight",
                    L::O => "attn.c_proj.weight",
                    L::OBias => "attn.c_proj.bias",
                    L::Norm2 => "ln_2.weight",
                    L::Norm2Bias => "ln_2.bias",
                    L::Up => "mlp.c_fc.weight",
                    L::UpBias => "mlp.c_fc.bias",
                    L::Down => "mlp.c_proj.weight",
                    L::DownBias => "mlp.c_proj.bias",
                };
                format!("h.{l}.{part}")
            }
        };
        format!("transformer.{name}")
    }

    fn out_in(&self) -> bool {
        false
    }

    fn final_norm_label(&self) -> &'static str {
        "ln_f"
    }

    fn export_tensors<'t>(&self, tensors: Vec<StoredTensor<'t>>) -> Result<Vec<StoredTensor<'t>>> {
        Ok(tensors)
    }

    fn import_tensors(
        &self,
        tensors: BTreeMap<String, StoredTensor<'static>>,
    ) -> Result<BTreeMap<String, StoredTensor<'static>>> {
        Ok(tensors)
    }

    /// Names under `transformer.` (what `save_pretrained` writes with or without the
    /// prefix), without the tied `lm_head.weight` and the attention mask buffers.
    fn file_tensors(
        &self,
        tensors: Vec<StoredTensor<'static>>,
    ) -> BTreeMap<String, StoredTensor<'static>> {
        let mut out = BTreeMap::new();
        for t in tensors {
            let name = if t.name.starts_with("transformer.") {
                t.name.clone()
            } else {
                format!("transformer.{}", t.name)
            };
            let ignored = name == "transformer.lm_head.weight"
                || name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias");
            if !ignored {
                out.insert(name.clone(), t.renamed(name));
            }
        }
        out
    }
}

/// Parses the text of a GPT-2 `config.json` whose `model_type` is `gpt2` or absent (the
/// registry's [`super::families::parse_hf_config`] checks it first); `path` only names the
/// file in errors.
pub(crate) fn parse_config(path: &Path, text: &str) -> Result<Gpt2Config> {
    let what = path.display().to_string();
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::data(&what, format!("is not valid JSON: {e}")))?;
    let field = |name: &str| -> Result<usize> {
        v.get(name)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| {
                Error::data(
                    &what,
                    format!("needs `{name}` as a positive integer (a GPT2Config field)"),
                )
            })
    };
    if let Some(t) = v.get("model_type").and_then(Value::as_str) {
        if t != "gpt2" {
            return Err(Error::data(
                &what,
                format!("`model_type` is `{t}`, not GPT-2 (`gpt2`)"),
            ));
        }
    }
    if let Some(act) = v.get("activation_function").and_then(Value::as_str) {
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(Error::data(
                &what,
                format!(
                    "`activation_function` is `{act}`; trainkit's GPT-2 uses the tanh GELU \
                     (`gelu_new`)"
                ),
            ));
        }
    }
    if v.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
        return Err(Error::data(
            &what,
            "`tie_word_embeddings` is false; trainkit's GPT-2 ties the head to `wte`",
        ));
    }
    let n_positions = match field("n_positions") {
        Ok(n) => n,
        Err(e) => field("n_ctx").map_err(|_| e)?,
    };
    let config = Gpt2Config {
        n_layer: field("n_layer")?,
        n_head: field("n_head")?,
        n_embd: field("n_embd")?,
        n_positions,
        vocab_size: field("vocab_size")?,
        layer_norm_epsilon: v
            .get("layer_norm_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5) as f32,
    };
    config
        .validate()
        .map_err(|e| Error::data(&what, format!("describes an impossible model: {e}")))?;
    Ok(config)
}
