//! A small, seedable, serializable random number generator (SplitMix64).

use serde::{Deserialize, Serialize};

/// SplitMix64's increment: the `n`-th number of the stream seeded with `s` is
/// `mix64(s + n · GAMMA)`.
pub(crate) const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The FNV-1a hash of `name`: a stable number for a parameter's or a node's name, to key
/// its own random stream.
pub(crate) fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A key of its own for every `(seed, step, index)`: nested SplitMix64 finalizers, so
/// neighbouring triples give unrelated keys (the key of a stream of [`counter_bits`]).
pub(crate) fn stream_key(seed: u64, step: u64, index: u64) -> u64 {
    mix64(mix64(mix64(seed) ^ step) ^ index)
}

/// The random bits of element `i` of the stream seeded with `key`: the `(i + 1)`-th number
/// of that SplitMix64 stream, drawn without state (kernels/common.cuh's
/// `tk_counter_bits`), so every device, thread count, recomputation and resumed run draws
/// the same.
pub(crate) fn counter_bits(key: u64, i: u64) -> u64 {
    mix64(key.wrapping_add((i + 1).wrapping_mul(GAMMA)))
}

/// Deterministic pseudo-random numbers; the whole state is one `u64`, so a run's RNG can be
/// saved and restored exactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Moves the stream on as `draws` calls of [`Rng::next_u64`] would, without making
    /// them (SplitMix64's state only counts: this costs one multiplication).
    pub fn skip(&mut self, draws: u64) {
        self.state = self.state.wrapping_add(draws.wrapping_mul(GAMMA));
    }

    /// Shuffles `items` in place (Fisher–Yates, one draw per element from the last).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.uniform() * n as f64) as usize).min(n.saturating_sub(1))
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeded shuffle is a permutation, the same for the same seed.
    #[test]
    fn shuffles_reproducibly() {
        let mut a: Vec<u32> = (0..20).collect();
        let mut b = a.clone();
        Rng::new(4).shuffle(&mut a);
        Rng::new(4).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..20).collect::<Vec<_>>());
        a.sort();
        assert_eq!(a, (0..20).collect::<Vec<_>>());
    }

    /// Skipping `n` draws leaves the stream where drawing them would.
    #[test]
    fn skipping_draws_lands_where_drawing_them_does() {
        for n in [0u64, 1, 2, 7, 1000] {
            let mut drawn = Rng::new(11);
            (0..n).for_each(|_| {
                drawn.next_u64();
            });
            let mut skipped = Rng::new(11);
            skipped.skip(n);
            assert_eq!(skipped, drawn, "{n}");
            assert_eq!(skipped.next_u64(), drawn.next_u64());
        }
    }
}
