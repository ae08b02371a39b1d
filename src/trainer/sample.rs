//! Text generation from a trainer's model: temperature, top-k, top-p (nucleus), min-p and
//! a repetition penalty, as transformers' `generate` applies them, with a
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
    /// Sample among the most likely tokens whose probabilities (after the temperature and
    /// top-k) add up to `top_p`: nucleus sampling (1 = all). The most likely token always
    /// stays.
    pub top_p: f32,
    /// Drop the tokens less likely than `min_p` times the most likely one (after the
    /// temperature, top-k and top-p; 0 = none).
    pub min_p: f32,
    /// Make the tokens already in the context less likely (CTRL's penalty, transformers'
    /// `repetition_penalty`): a positive logit divided by it, a negative one multiplied,
    /// before the temperature (1 = none).
    pub repetition_penalty: f32,
    /// Decode through a key/value cache where the model can (transformers' `use_cache`);
    /// `false` reruns the whole context for every token.
    pub use_cache: bool,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            use_cache: true,
        }
    }
}

impl SamplingOptions {
    /// Refuses settings no sampler can follow, naming the setting.
    pub fn check(&self) -> Result<()> {
        let refuse = |name: &str, value: f32, want: &str| {
            Err(Error::config(name, format!("{value} must be {want}")))
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return refuse("temperature", self.temperature, "a number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return refuse("top_p", self.top_p, "in (0, 1] (1 keeps every token)");
        }
        if !(0.0..1.0).contains(&self.min_p) {
            return refuse("min_p", self.min_p, "in [0, 1) (0 keeps every token)");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return refuse(
                "repetition_penalty",
                self.repetition_penalty,
                "a number > 0 (1 is no penalty)",
            );
        }
        Ok(())
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
        options.check()?;
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
            let next = pick(&logits, options, &tokens, rng) as u32;
            if stop.contains(&next) {
                break;
            }
            tokens.push(next);
            on_token(next)?;
        }
        Ok(tokens[prompt.len()..].to_vec())
    }
}

/// The ids a draw from `scores` chooses among, the most likely first (ties by id): the
/// most likely alone when greedy, the top-k with top-k, else every id. Only these are
/// ordered (a vocabulary's sort per token is milliseconds).
fn candidates(scores: &[f64], options: SamplingOptions) -> Vec<usize> {
    let before = |&a: &usize, &b: &usize| scores[b].total_cmp(&scores[a]).then(a.cmp(&b));
    if options.temperature == 0.0 {
        return vec![(0..scores.len()).min_by(before).unwrap_or(0)];
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    if options.top_k > 0 && options.top_k < order.len() {
        order.select_nth_unstable_by(options.top_k - 1, before);
        order.truncate(options.top_k);
    }
    order.sort_unstable_by(before);
    order
}

/// Draws a token id from `logits` under `options`, `context` the tokens before it (for the
/// repetition penalty): the penalty, then the temperature, top-k, top-p and min-p, in
/// transformers' order.
fn pick(logits: &[f32], options: SamplingOptions, context: &[u32], rng: &mut Rng) -> usize {
    let mut scores: Vec<f64> = logits.iter().map(|&l| l as f64).collect();
    let penalty = options.repetition_penalty as f64;
    if penalty != 1.0 {
        let mut seen = vec![false; scores.len()];
        for &t in context {
            if let Some(s) = scores.get_mut(t as usize).filter(|_| !seen[t as usize]) {
                seen[t as usize] = true;
                *s = if *s < 0.0 { *s * penalty } else { *s / penalty };
            }
        }
    }
    let mut order = candidates(&scores, options);
    if options.temperature == 0.0 {
        return order[0];
    }
    let max = scores[order[0]];
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((scores[i] - max) / options.temperature as f64).exp())
        .collect();
    if options.top_p < 1.0 {
        // The most likely tokens until the ones before reach top_p of the probability.
        let (total, top_p) = (weights.iter().sum::<f64>(), options.top_p as f64);
        let mut before = 0.0;
        let keep = weights
            .iter()
            .take_while(|&&w| {
                let kept = before < top_p * total;
                before += w;
                kept
            })
            .count();
        order.truncate(keep.max(1));
        weights.truncate(keep.max(1));
    }
    if options.min_p > 0.0 {
        // The first weight is the most likely token's: exp(0) = 1.
        let keep = weights
            .iter()
            .take_while(|&&w| w >= options.min_p as f64)
            .count();
        order.truncate(keep.max(1));
        weights.truncate(keep.max(1));
    }
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
            ..SamplingOptions::default()
        };
        assert_eq!(pick(&logits, greedy, &[], &mut rng), 1);
        let top2 = SamplingOptions {
            temperature: 1.0,
            top_k: 2,
            ..SamplingOptions::default()
        };
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[pick(&logits, top2, &[], &mut rng)] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0, "{counts:?}");
        // p(1) / p(3) = e^0.5 ≈ 1.65.
        let ratio = counts[1] as f64 / counts[3] as f64;
        assert!((ratio - 0.5f64.exp()).abs() < 0.15, "{ratio}");
    }

    /// Every id sorted, most likely first, ties by id, then cut to the one (greedy) or
    /// the top-k: the reference the partial ordering must equal.
    fn sorted_candidates(scores: &[f64], options: SamplingOptions) -> Vec<usize> {
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        match (options.temperature, options.top_k) {
            (0.0, _) => order.truncate(1),
            (_, 0) => {}
            (_, k) => order.truncate(k),
        }
        order
    }

    /// Greedy decoding takes the most likely id without ordering the vocabulary, and
    /// top-k orders its k alone: the candidates are the full sort's, in its order, over
    /// scores with ties (rounded to a few values) and without, for every setting.
    #[test]
    fn the_partial_ordering_is_the_full_sorts() {
        let mut gen = Rng::new(3);
        for (vocab, levels) in [(1, 0.0), (7, 0.0), (500, 0.0), (500, 4.0), (2000, 1.0)] {
            let scores: Vec<f64> = (0..vocab)
                .map(|_| {
                    let l = gen.normal() * 3.0;
                    if levels > 0.0 {
                        (l * levels).round() / levels
                    } else {
                        l
                    }
                })
                .collect();
            for temperature in [0.0, 0.7] {
                for top_k in [0, 1, 5, 50, vocab, vocab + 3] {
                    let options = SamplingOptions {
                        temperature,
                        top_k,
                        ..SamplingOptions::default()
                    };
                    assert_eq!(
                        candidates(&scores, options),
                        sorted_candidates(&scores, options),
                        "vocab {vocab}, levels {levels}, {options:?}"
                    );
                }
            }
        }
    }

    /// Draws of `options` from `logits` after `context`: how often each token came.
    fn draws(logits: &[f32], options: SamplingOptions, context: &[u32]) -> Vec<usize> {
        let mut rng = Rng::new(7);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..4000 {
            counts[pick(logits, options, context, &mut rng)] += 1;
        }
        counts
    }

    /// Nucleus sampling keeps the most likely tokens until those before reach top_p:
    /// probabilities 0.5, 0.3, 0.15, 0.05 with top_p 0.75 keep the first two (0.5 < 0.75,
    /// 0.8 is not), with 0.8 the first three, and the most likely always.
    #[test]
    fn top_p_keeps_the_nucleus() {
        let probs: [f64; 4] = [0.15, 0.5, 0.05, 0.3];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let with = |top_p| SamplingOptions {
            top_p,
            ..SamplingOptions::default()
        };
        let c = draws(&logits, with(0.75), &[]);
        assert_eq!(c[0] + c[2], 0, "{c:?}");
        // Renormalised over the two: 0.5 / 0.3.
        let ratio = c[1] as f64 / c[3] as f64;
        assert!((ratio - 5.0 / 3.0).abs() < 0.2, "{ratio}");
        let c = draws(&logits, with(0.8001), &[]);
        assert!(c[0] > 0 && c[2] == 0, "{c:?}");
        let c = draws(&logits, with(0.01), &[]);
        assert_eq!(c[1], 4000, "{c:?}");
        assert!(draws(&logits, with(1.0), &[]).iter().all(|&n| n > 0));
    }

    /// min-p drops what is less likely than min_p times the most likely token, after the
    /// temperature: at temperature 1, 0.15 / 0.5 = 0.3 stays at min_p 0.3 and 0.05 goes.
    #[test]
    fn min_p_drops_the_unlikely() {
        let logits: Vec<f32> = [0.15f64, 0.5, 0.05, 0.3]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let c = draws(
            &logits,
            SamplingOptions {
                min_p: 0.29,
                ..SamplingOptions::default()
            },
            &[],
        );
        assert!(c[0] > 0 && c[2] == 0, "{c:?}");
    }

    /// The repetition penalty divides a positive logit of a token in the context and
    /// multiplies a negative one, each token once however often it came.
    #[test]
    fn the_repetition_penalty_turns_greedy_away_from_the_context() {
        let greedy = SamplingOptions {
            temperature: 0.0,
            repetition_penalty: 1.25,
            ..SamplingOptions::default()
        };
        let mut rng = Rng::new(1);
        // 3.0 / 1.25 = 2.4 < 2.9: token 1 instead of 0.
        assert_eq!(pick(&[3.0, 2.9], greedy, &[0, 0, 0], &mut rng), 1);
        assert_eq!(pick(&[3.0, 2.9], greedy, &[], &mut rng), 0);
        // −1.0 · 1.25 = −1.25 < −1.2: token 1.
        assert_eq!(pick(&[-1.0, -1.2], greedy, &[0], &mut rng), 1);
        // Out-of-range context ids are ignored rather than indexed.
        assert_eq!(pick(&[3.0, 2.9], greedy, &[9], &mut rng), 0);
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let d = SamplingOptions::default();
        assert!(d.check().is_ok());
        for (bad, name) in [
            (SamplingOptions { top_p: 0.0, ..d }, "top_p"),
            (SamplingOptions { top_p: 1.5, ..d }, "top_p"),
            (SamplingOptions { min_p: 1.0, ..d }, "min_p"),
            (SamplingOptions { min_p: -0.1, ..d }, "min_p"),
            (
                SamplingOptions {
                    repetition_penalty: 0.0,
                    ..d
                },
                "repetition_penalty",
            ),
            (
                SamplingOptions {
                    temperature: f32::NAN,
                    ..d
                },
                "temperature",
            ),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
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
            ..SamplingOptions::default()
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
