//! Text generation from a trainer's model: temperature and top-k sampling, with a
//! key/value cache where the model decodes incrementally ([`crate::Model::logits_cached`]):
//! the prompt runs once, then each new token runs the model on its own row.

use super::Trainer;
use crate::accumulate::AccumulationSchedule;
use crate::checkpoint::CheckpointPolicy;
use crate::error::{Error, Result};
use crate::memory::MemoryObserver;
use crate::model::{Batch, KvCache};
use crate::optim::Optimizer;
use crate::precision::Precision;
use crate::rng::Rng;

/// How [`Trainer::generate`] picks each next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingOptions {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Sample among the `top_k` most likely tokens only (0 = all).
    pub top_k: usize,
    /// Decode through a key/value cache where the model can (transformers' `use_cache`);
    /// `false` reruns the whole context for every token.
    pub use_cache: bool,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            temperature: 1.0,
            top_k: 0,
            use_cache: true,
        }
    }
}

impl<P, C, O, A, M> Trainer<P, C, O, A, M>
where
    P: Precision,
    C: CheckpointPolicy,
    O: Optimizer,
    A: AccumulationSchedule,
    M: MemoryObserver,
{
    /// Logits `[seq_len, vocab]` of the model for one row of `tokens` (forward only).
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (model, mut pass) = self.forward_pass(None);
        let out = model.logits(&mut pass, &Batch::row(tokens));
        self.flush_events();
        out
    }

    /// Logits `[tokens.len(), vocab]` of `tokens` continuing the sequence `cache` holds
    /// (forward only, incremental decoding; see [`crate::Model::logits_cached`]).
    pub fn logits_cached(&mut self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let (model, mut pass) = self.forward_pass(None);
        let out = model.logits_cached(&mut pass, tokens, cache);
        self.flush_events();
        out
    }

    /// The logits `[vocab]` of the position after `tokens` (forward only; the head on
    /// the last position alone): the whole context, or with `cache` the tokens that
    /// continue the sequence it holds (see [`crate::Model::last_logits`]).
    pub fn last_logits(&mut self, tokens: &[u32], cache: Option<&mut KvCache>) -> Result<Vec<f32>> {
        let (model, mut pass) = self.forward_pass(None);
        let out = model.last_logits(&mut pass, tokens, cache);
        self.flush_events();
        out
    }

    /// Continues `prompt` by `max_new_tokens` tokens, each drawn from the model's next-token
    /// distribution (the context is cut to the model's last `max_seq_len` tokens).
    /// Returns the new tokens only.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        options: SamplingOptions,
        rng: &mut Rng,
    ) -> Result<Vec<u32>> {
        self.generate_until(prompt, max_new_tokens, options, &[], rng)
    }

    /// [`Trainer::generate`] that ends early at the first token of `stop` it draws (a
    /// chat template's end of turn), which is not returned.
    pub fn generate_until(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        options: SamplingOptions,
        stop: &[u32],
        rng: &mut Rng,
    ) -> Result<Vec<u32>> {
        self.generate_streaming(prompt, max_new_tokens, options, stop, rng, &mut |_| Ok(()))
    }

    /// [`Trainer::generate_until`] that hands each new token to `on_token` as it is drawn
    /// (to print it as it comes). Where the model decodes incrementally, the prompt runs
    /// once into a key/value cache and each token after it on its own row, until the
    /// context is full; past it (a prompt and reply longer than the model's context)
    /// every token reruns the last `max_seq_len` tokens, as without a cache. The tokens
    /// drawn are the same either way, up to the rounding of the attention's sums.
    pub fn generate_streaming(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        options: SamplingOptions,
        stop: &[u32],
        rng: &mut Rng,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::config(
                "prompt",
                "is empty; give at least one token of context",
            ));
        }
        if !(options.temperature >= 0.0 && options.temperature.is_finite()) {
            return Err(Error::config(
                "temperature",
                format!("{} must be a number >= 0", options.temperature),
            ));
        }
        let vocab = self.model.vocab_size();
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::data(
                "prompt",
                format!("token {bad} is beyond the model's vocabulary of {vocab}"),
            ));
        }
        let ctx_len = self.model.max_seq_len();
        let mut tokens = prompt.to_vec();
        // The cache holds what fits the context: the prompt, then each token drawn.
        let mut cache =
            (options.use_cache && self.model.decodes_incrementally() && prompt.len() <= ctx_len)
                .then(|| KvCache::new((prompt.len() + max_new_tokens).min(ctx_len)));
        for _ in 0..max_new_tokens {
            // The head runs on the last position alone (the next token's logits).
            let logits = match cache.as_mut() {
                Some(c) if c.len() < c.capacity() => {
                    let fresh = c.len();
                    self.last_logits(&tokens[fresh..], Some(c))?
                }
                _ => {
                    let ctx = tokens.len().saturating_sub(ctx_len);
                    self.last_logits(&tokens[ctx..], None)?
                }
            };
            let next = pick(&logits, options, rng) as u32;
            if stop.contains(&next) {
                break;
            }
            tokens.push(next);
            on_token(next)?;
        }
        Ok(tokens[prompt.len()..].to_vec())
    }
}

/// Draws a token id from `logits` under `options`.
fn pick(logits: &[f32], options: SamplingOptions, rng: &mut Rng) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if options.temperature == 0.0 {
        return order[0];
    }
    if options.top_k > 0 {
        order.truncate(options.top_k);
    }
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / options.temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform() * total;
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i;
        }
        u -= w;
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_top_k_pick_what_they_should() {
        let logits = [0.0, 3.0, 1.0, 2.5];
        let mut rng = Rng::new(1);
        let greedy = SamplingOptions {
            temperature: 0.0,
            top_k: 0,
            use_cache: true,
        };
        assert_eq!(pick(&logits, greedy, &mut rng), 1);
        let top2 = SamplingOptions {
            temperature: 1.0,
            top_k: 2,
            use_cache: true,
        };
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[pick(&logits, top2, &mut rng)] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0, "{counts:?}");
        // p(1) / p(3) = e^0.5 ≈ 1.65.
        let ratio = counts[1] as f64 / counts[3] as f64;
        assert!((ratio - 0.5f64.exp()).abs() < 0.15, "{ratio}");
    }

    /// Generation ends before the first stop token it draws: greedy decoding that would
    /// draw `t` at step 3 returns the two tokens before it.
    #[test]
    fn generation_stops_at_a_stop_token() {
        use crate::data::DataLoader;
        use crate::{CpuBackend, Gpt2, Gpt2Config, Trainer};
        let config = Gpt2Config {
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            n_positions: 16,
            vocab_size: 64,
            layer_norm_epsilon: 1e-5,
        };
        let data = DataLoader::new(vec![0; 4], 1, 2).unwrap();
        let mut t = Trainer::builder(
            Gpt2::new(config).unwrap(),
            std::sync::Arc::new(CpuBackend::new()),
            data,
        )
        .build()
        .unwrap();
        let greedy = SamplingOptions {
            temperature: 0.0,
            top_k: 0,
            use_cache: true,
        };
        let mut rng = Rng::new(1);
        let all = t.generate(&[1, 2], 6, greedy, &mut rng).unwrap();
        assert_eq!(all.len(), 6);
        let at = all.iter().position(|&x| x == all[2]).unwrap();
        let cut = t
            .generate_until(&[1, 2], 6, greedy, &[all[2]], &mut rng)
            .unwrap();
        assert_eq!(cut, all[..at]);
    }
}
