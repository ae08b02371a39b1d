//! The built-in corpus: text from a random word-level Markov chain whose entropy rate is
//! known exactly, so a run can print its loss beside the floor no model can beat.

use crate::rng::Rng;

/// A synthetic language: a fixed vocabulary of words and a first-order Markov chain over
/// them, written as bytes (each word followed by a space; the word `.` ends a line).
///
/// The byte stream is a function of the word sequence and the word sequence can be read
/// back from it, so its entropy rate per byte is the chain's entropy rate per word divided
/// by the mean bytes per word under the stationary distribution:
/// `Σ π(w) H(next | w) / Σ π(w) (len(w) + 1)`.
#[derive(Clone, Debug)]
pub struct SyntheticCorpus {
    words: Vec<String>,
    /// For each word, its successors and their probabilities.
    transitions: Vec<Vec<(usize, f64)>>,
}

const LETTERS: &[u8] = b"etaoinshrdlcumwfgypbvk";

impl SyntheticCorpus {
    /// The corpus of `trainkit train`: 48 words, 4 successors each.
    pub fn builtin() -> Self {
        Self::new(48, 4, 20_241_122)
    }

    /// A random language of `n_words` words, each followed by one of `successors` words,
    /// drawn from `seed`.
    pub fn new(n_words: usize, successors: usize, seed: u64) -> Self {
        let n_words = n_words.max(2);
        let successors = successors.clamp(1, n_words);
        let mut rng = Rng::new(seed);
        let mut words: Vec<String> = vec![".\n".to_string()];
        while words.len() < n_words {
            let len = 2 + rng.below(6);
            let w: String = (0..len)
                .map(|_| LETTERS[rng.below(LETTERS.len())] as char)
                .collect();
            if !words.contains(&w) {
                words.push(w);
            }
        }
        let transitions = (0..n_words)
            .map(|w| {
                // The next word in the list is always a successor: the chain is irreducible.
                let mut next = vec![(w + 1) % n_words];
                while next.len() < successors {
                    let c = rng.below(n_words);
                    if !next.contains(&c) {
                        next.push(c);
                    }
                }
                let weights: Vec<f64> = next.iter().map(|_| 0.05 + rng.uniform().powi(2)).collect();
                let total: f64 = weights.iter().sum();
                next.into_iter()
                    .zip(weights)
                    .map(|(n, w)| (n, w / total))
                    .collect()
            })
            .collect();
        SyntheticCorpus { words, transitions }
    }

    fn word_bytes(&self, w: usize) -> usize {
        let s = &self.words[w];
        if s.ends_with('\n') {
            s.len()
        } else {
            s.len() + 1
        }
    }

    /// The stationary distribution of the word chain (power iteration on the lazy chain,
    /// which has the same fixed point and always converges).
    pub fn stationary(&self) -> Vec<f64> {
        let n = self.words.len();
        let mut pi = vec![1.0 / n as f64; n];
        for _ in 0..10_000 {
            let mut next = vec![0.0; n];
            for (w, succ) in self.transitions.iter().enumerate() {
                next[w] += 0.5 * pi[w];
                for &(s, p) in succ {
                    next[s] += 0.5 * pi[w] * p;
                }
            }
            let delta: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            pi = next;
            if delta < 1e-15 {
                break;
            }
        }
        pi
    }

    /// The entropy rate of the byte stream in nats per byte: the lowest mean loss any
    /// model can reach on it.
    pub fn entropy_per_byte(&self) -> f64 {
        let pi = self.stationary();
        let mut h = 0.0;
        let mut len = 0.0;
        for (w, succ) in self.transitions.iter().enumerate() {
            let hw: f64 = succ.iter().map(|&(_, p)| -p * p.ln()).sum();
            h += pi[w] * hw;
            len += pi[w] * self.word_bytes(w) as f64;
        }
        h / len
    }

    /// `n_bytes` bytes of text drawn from the chain with `seed`.
    pub fn generate(&self, n_bytes: usize, seed: u64) -> String {
        let mut rng = Rng::new(seed);
        let mut w = rng.below(self.words.len());
        let mut out = String::with_capacity(n_bytes + 16);
        while out.len() < n_bytes {
            let r = rng.uniform();
            let succ = &self.transitions[w];
            let mut acc = 0.0;
            let mut next = succ[succ.len() - 1].0;
            for &(s, p) in succ {
                acc += p;
                if r < acc {
                    next = s;
                    break;
                }
            }
            w = next;
            out.push_str(&self.words[w]);
            if !self.words[w].ends_with('\n') {
                out.push(' ');
            }
        }
        out.truncate(n_bytes);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empirical_entropy_matches_the_formula() {
        let c = SyntheticCorpus::builtin();
        let h = c.entropy_per_byte();
        assert!(h > 0.05 && h < 1.0, "entropy {h}");
        // Estimate from a long sample: -log p of each word transition, per byte.
        let text = c.generate(400_000, 7);
        let words: Vec<&str> = text.split([' ', '\n']).filter(|w| !w.is_empty()).collect();
        let index = |s: &str| {
            c.words
                .iter()
                .position(|w| w.trim_end() == s || (s == "." && w == ".\n"))
                .unwrap()
        };
        let mut nll = 0.0;
        let mut n = 0;
        for pair in words.windows(2).take(words.len() - 2) {
            let (a, b) = (index(pair[0]), index(pair[1]));
            let p = c.transitions[a].iter().find(|(s, _)| *s == b).unwrap().1;
            nll -= p.ln();
            n += 1;
        }
        let bytes_per_word = text.len() as f64 / words.len() as f64;
        let est = nll / n as f64 / bytes_per_word;
        assert!((est - h).abs() / h < 0.03, "estimated {est}, formula {h}");
    }

    #[test]
    fn generation_is_deterministic() {
        let c = SyntheticCorpus::builtin();
        assert_eq!(c.generate(1000, 3), c.generate(1000, 3));
        assert_ne!(c.generate(1000, 3), c.generate(1000, 4));
        assert_eq!(c.generate(1000, 3).len(), 1000);
    }
}
