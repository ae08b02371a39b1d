//! Batching with llm.c's semantics, across shards, optionally shuffled.

use super::token_flags::{DOCUMENT_START, TRAINED};
use super::{TokenDataset, Tokenizer};
use crate::error::{Error, Result};
use crate::model::Batch;
use crate::ops::cross_entropy::IGNORE;
use crate::ops::positions;
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Where a [`DataLoader`] stands: the epoch, the shard (its place in the epoch's shard
/// order) and the window (its place in the shard's window order) the next batch reads.
/// With the loader's settings it determines every batch to come, so saving it makes a
/// resume exact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// Passes over the whole dataset completed.
    pub epoch: u64,
    /// Index into this epoch's shard order.
    pub shard: usize,
    /// Index into the current shard's window order: windows already read from it.
    pub window: usize,
}

/// Cuts token shards into micro-batches the way llm.c does.
///
/// A shard of `n` tokens holds `(n - 1) / (B·T)` windows of `B·T + 1` tokens; window `w`
/// starts at token `w·B·T` and gives row `r` of the batch the tokens
/// `w·B·T + r·T ..= w·B·T + r·T + T` (inputs the first `T`, targets the same shifted by
/// one). Batches take the windows of one shard in order and move to the next shard when
/// the next batch would run past the end of this one, starting over from the first shard
/// after the last (a new epoch). A shard too short for one batch is skipped.
///
/// With [`DataLoader::shuffled`], every epoch visits the shards in a new order and each
/// shard's windows in a new order, both drawn from the seed and the epoch (and the shard),
/// so the [`DataCursor`] alone says where a run stands.
///
/// Documents. Where a row holds several documents, attention stays within each and
/// positions restart at 0 at each ([`Batch::positions`]), and no position is trained to
/// predict across a boundary: the target of the position before a document's first token
/// is left out of the loss. Documents start where the token flags say so
/// ([`DOCUMENT_START`]: packed examples) and, with [`DataLoader::separated_by`], after each
/// separator token of a stream: the separator belongs to the document it ends, and the
/// position holding it predicts nothing.
#[derive(Clone, Debug)]
pub struct DataLoader {
    data: TokenDataset,
    batch_size: usize,
    seq_len: usize,
    shuffle: Option<u64>,
    /// Windows in each shard (0 for a shard too short for one batch).
    windows: Vec<usize>,
    cursor: DataCursor,
    /// The shard order of the cursor's epoch.
    order: Vec<usize>,
    /// The window order of the cursor's shard, when shuffling.
    window_order: Option<Vec<u32>>,
    /// The (epoch, shard) that `window_order` belongs to.
    window_order_of: Option<(u64, usize)>,
    /// The token that ends a document in a stream ([`DataLoader::separated_by`]).
    separator: Option<u32>,
}

impl DataLoader {
    /// A loader over `data` (a [`TokenDataset`], or tokens in memory: a `Vec<u32>`) giving
    /// `batch_size` rows of `seq_len` tokens, in order.
    ///
    /// Fails when no shard holds the `batch_size · seq_len + 1` tokens of one batch.
    pub fn new(data: impl Into<TokenDataset>, batch_size: usize, seq_len: usize) -> Result<Self> {
        let data = data.into();
        if batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        if seq_len == 0 {
            return Err(Error::config("seq_len", "must be at least 1"));
        }
        if let Some(shard) = data
            .shards()
            .iter()
            .find(|s| s.row_len().is_some_and(|t| t != seq_len))
        {
            let t = shard.row_len().unwrap_or_default();
            return Err(Error::config(
                "seq_len",
                format!(
                    "{seq_len}, but {} holds one example per row of {t} tokens (prepared with \
                     --seq-len {t}); train with --seq-len {t}, or prepare the data again",
                    shard.name()
                ),
            ));
        }
        let span = batch_size * seq_len;
        let need = span + 1;
        let windows: Vec<usize> = data
            .shards()
            .iter()
            .map(|s| s.len().saturating_sub(1) / span)
            .collect();
        if windows.iter().all(|&w| w == 0) {
            let longest = data.shards().iter().map(|s| s.len()).max().unwrap_or(0);
            let what = if data.shards().len() == 1 {
                format!("{longest} tokens")
            } else {
                format!(
                    "the longest of its {} shards has {longest} tokens",
                    data.shards().len()
                )
            };
            return Err(Error::data(
                data.describe(),
                format!(
                    "{what}, but one batch of {batch_size} × {seq_len} needs {need}; use more \
                     data or a smaller batch size or sequence length"
                ),
            ));
        }
        for (shard, _) in data.shards().iter().zip(&windows).filter(|(_, &w)| w == 0) {
            log::warn!(
                "{} has {} tokens, fewer than the {need} of one batch of {batch_size} × \
                 {seq_len}: it is skipped",
                shard.name(),
                shard.len()
            );
        }
        let order = (0..windows.len()).collect();
        Ok(DataLoader {
            data,
            batch_size,
            seq_len,
            shuffle: None,
            windows,
            cursor: DataCursor::default(),
            order,
            window_order: None,
            window_order_of: None,
            separator: None,
        })
    }

    /// Masks documents at `separator` (`None`: only where the token flags mark them): each
    /// document ends with a separator token, which belongs to it; the next starts after it.
    pub fn separated_by(mut self, separator: Option<u32>) -> Self {
        self.separator = separator;
        self
    }

    /// The token that ends a document, with [`DataLoader::separated_by`].
    pub fn separator(&self) -> Option<u32> {
        self.separator
    }

    /// Shuffles with `seed` (or stops shuffling, with `None`): every epoch, the shard
    /// order and each shard's window order are permuted. Starts from the beginning.
    pub fn shuffled(mut self, seed: Option<u64>) -> Self {
        self.shuffle = seed;
        self.cursor = DataCursor::default();
        self.order = self.shard_order(0);
        self.window_order = None;
        self.window_order_of = None;
        self
    }

    /// A loader over a text file, tokenized with `tokenizer`.
    pub fn from_text_file(
        path: impl AsRef<Path>,
        tokenizer: &dyn Tokenizer,
        batch_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::new(tokenizer.encode(&text), batch_size, seq_len)
    }

    /// Rows per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The micro-batches of one pass over the data (an epoch): every shard's whole
    /// windows of `batch_size` rows (training never reads the tokens past a shard's last
    /// whole window).
    pub fn batches_per_epoch(&self) -> usize {
        self.windows.iter().sum()
    }

    /// Tokens in all shards.
    pub fn len_tokens(&self) -> usize {
        self.data.len_tokens()
    }

    /// The data.
    pub fn dataset(&self) -> &TokenDataset {
        &self.data
    }

    /// The shuffling seed, if the loader shuffles.
    pub fn shuffle_seed(&self) -> Option<u64> {
        self.shuffle
    }

    /// Where the next batch starts in its shard's order of windows, in tokens
    /// (`window · B·T`; for one shard read in order, the token it starts at).
    pub fn position(&self) -> usize {
        self.cursor.window * self.batch_size * self.seq_len
    }

    /// Continues from a saved [`DataLoader::position`] in the first shard of the first
    /// epoch (what a trainer state without a [`DataCursor`] records).
    pub fn set_position(&mut self, position: usize) -> Result<()> {
        let span = self.batch_size * self.seq_len;
        if position > self.len_tokens() || position % span != 0 {
            return Err(Error::data(
                "data position",
                format!(
                    "position {position} is not the start of a batch of {span} tokens within \
                     a stream of {} tokens; was the run resumed on different data or with \
                     another batch size?",
                    self.len_tokens()
                ),
            ));
        }
        self.set_cursor(DataCursor {
            epoch: 0,
            shard: 0,
            window: position / span,
        })
    }

    /// Where the loader stands: save it to resume exactly.
    pub fn cursor(&self) -> DataCursor {
        self.cursor
    }

    /// Continues from a saved [`DataLoader::cursor`].
    pub fn set_cursor(&mut self, cursor: DataCursor) -> Result<()> {
        let shards = self.windows.len();
        if cursor.shard >= shards {
            return Err(Error::data(
                "data position",
                format!(
                    "shard {} of a dataset of {shards} shards; was the run resumed on \
                     different data?",
                    cursor.shard
                ),
            ));
        }
        let order = self.shard_order(cursor.epoch);
        if cursor.window > self.windows[order[cursor.shard]] {
            return Err(Error::data(
                "data position",
                format!(
                    "window {} of a shard of {} windows; was the run resumed on different \
                     data or with another batch size?",
                    cursor.window, self.windows[order[cursor.shard]]
                ),
            ));
        }
        self.cursor = cursor;
        self.order = order;
        self.window_order = None;
        self.window_order_of = None;
        Ok(())
    }

    /// Every position of the data once, in order (shard after shard, each from its start,
    /// whatever the loader's shuffling and cursor): the shard's whole batches, then its
    /// remaining positions in one batch whose other positions are padding, left out of the
    /// loss. What evaluation reads: each target counts exactly once, none twice.
    pub fn each_once(&self) -> impl Iterator<Item = Batch> + '_ {
        let span = self.batch_size * self.seq_len;
        (0..self.windows.len()).flat_map(move |shard| {
            let whole = self.windows[shard];
            let rest = self.data.shards()[shard].len().saturating_sub(1) - whole * span;
            (0..whole)
                .map(move |w| self.batch_at(shard, w * span, span))
                .chain((rest > 0).then(|| self.batch_at(shard, whole * span, rest)))
        })
    }

    /// The positions of data (padding not counted) in the first `batches` batches of
    /// [`DataLoader::each_once`] (all of them with `None`).
    pub fn positions_once(&self, batches: Option<usize>) -> usize {
        let span = self.batch_size * self.seq_len;
        let mut left = batches.unwrap_or(usize::MAX);
        let mut positions = 0;
        for s in self.data.shards() {
            let n = s.len().saturating_sub(1);
            let take = n.div_ceil(span).min(left);
            positions += (take * span).min(n);
            left -= take;
        }
        positions
    }

    /// The batches of [`DataLoader::each_once`].
    pub fn batches_once(&self) -> usize {
        let span = self.batch_size * self.seq_len;
        self.data
            .shards()
            .iter()
            .map(|s| s.len().saturating_sub(1).div_ceil(span))
            .sum()
    }

    /// Passes over the next micro-batch without reading it: what [`DataLoader::next_batch`]
    /// would have returned is left out, and the loader stands where it would then stand
    /// (how a rank of a data-parallel job passes over the other ranks' share).
    pub fn skip_batch(&mut self) {
        self.settle_cursor();
        self.cursor.window += 1;
    }

    /// Moves the cursor past shards with no window left (into the next epoch at the end).
    fn settle_cursor(&mut self) {
        while self.cursor.window >= self.windows[self.order[self.cursor.shard]] {
            self.cursor.window = 0;
            self.cursor.shard += 1;
            if self.cursor.shard == self.order.len() {
                self.cursor.shard = 0;
                self.cursor.epoch += 1;
                self.order = self.shard_order(self.cursor.epoch);
            }
        }
    }

    /// The next micro-batch.
    pub fn next_batch(&mut self) -> Batch {
        let span = self.batch_size * self.seq_len;
        self.settle_cursor();
        let shard = self.order[self.cursor.shard];
        let window = match self.shuffle {
            None => self.cursor.window,
            Some(seed) => {
                let key = (self.cursor.epoch, shard);
                if self.window_order_of != Some(key) {
                    self.window_order = Some(permutation(
                        self.windows[shard],
                        mix(seed, self.cursor.epoch, shard as u64 + 1),
                    ));
                    self.window_order_of = Some(key);
                }
                self.window_order
                    .as_ref()
                    .map_or(0, |p| p[self.cursor.window] as usize)
            }
        };
        let batch = self.batch_at(shard, window * span, span);
        self.cursor.window += 1;
        batch
    }

    /// The batch of `B·T` positions from token `start` of shard `shard`, of which the first
    /// `real` have their targets in the shard; the others, past its end, are padding
    /// (token 0 in, left out of the loss), which the causal model never lets a real
    /// position see.
    fn batch_at(&self, shard: usize, start: usize, real: usize) -> Batch {
        let span = self.batch_size * self.seq_len;
        let mut tokens = Vec::with_capacity(span + 1);
        let source = &self.data.shards()[shard];
        source.read_into(start, real + 1, &mut tokens);
        tokens.resize(span + 1, 0);
        let mut targets = tokens[1..].to_vec();
        for t in &mut targets[real..] {
            *t = IGNORE;
        }
        let mut flags = Vec::new();
        let has_flags = source.read_flags_into(start, real + 1, &mut flags);
        flags.resize(span + 1, 0);
        if has_flags {
            // A target whose token is not trained leaves its position out of the loss.
            for (t, f) in targets.iter_mut().zip(&flags[1..]) {
                if f & TRAINED == 0 {
                    *t = IGNORE;
                }
            }
        }
        // Token k starts a document (per its flags, or after a separator).
        let starts = |k: usize| {
            (has_flags && flags[k] & DOCUMENT_START != 0)
                || (k > 0 && Some(tokens[k - 1]) == self.separator)
        };
        // No position predicts the first token of the next document.
        for (k, t) in targets.iter_mut().enumerate() {
            if starts(k + 1) {
                *t = IGNORE;
            }
        }
        let positions = positions::from_document_starts(self.batch_size, self.seq_len, starts);
        let positions = positions::has_documents(&positions, self.seq_len).then_some(positions);
        Batch {
            batch_size: self.batch_size,
            seq_len: self.seq_len,
            inputs: tokens[..span].to_vec(),
            targets,
            positions,
        }
    }

    /// The order of the shards in `epoch`.
    fn shard_order(&self, epoch: u64) -> Vec<usize> {
        let n = self.windows.len();
        match self.shuffle {
            None => (0..n).collect(),
            Some(seed) => permutation(n, mix(seed, epoch, 0))
                .into_iter()
                .map(|i| i as usize)
                .collect(),
        }
    }
}

/// A seed for one (epoch, shard) permutation: distinct inputs give unrelated streams.
fn mix(seed: u64, epoch: u64, shard: u64) -> u64 {
    let mut rng = Rng::new(seed ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let a = rng.next_u64();
    Rng::new(a ^ shard.wrapping_mul(0xA076_1D64_78BD_642F)).next_u64()
}

/// A uniformly random permutation of `0..n` (Fisher–Yates) drawn from `seed`.
fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    Rng::new(seed).shuffle(&mut p);
    p
}

#[cfg(test)]
mod tests {

    /// Every target of the data counts once in `each_once`, however the data divides into
    /// batches, the last batch padded with positions left out of the loss.
    #[test]
    fn each_once_counts_every_target_exactly_once() {
        for n in [9usize, 17, 24, 25, 40] {
            let tokens: Vec<u32> = (0..n as u32).collect();
            let loader = DataLoader::new(tokens, 2, 4).unwrap();
            let mut seen = Vec::new();
            for b in loader.each_once() {
                for (i, t) in b.inputs.iter().zip(&b.targets) {
                    if *t != IGNORE {
                        seen.push((*i, *t));
                    }
                }
            }
            let want: Vec<(u32, u32)> = (0..n as u32 - 1).map(|i| (i, i + 1)).collect();
            assert_eq!(seen, want, "{n} tokens");
            assert_eq!(loader.batches_once(), loader.each_once().count());
            assert_eq!(loader.positions_once(None), n - 1);
            assert_eq!(loader.positions_once(Some(1)), 8.min(n - 1));
        }
    }

    use super::*;
    use crate::data::Shard;

    #[test]
    fn windows_follow_llm_c() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut big = DataLoader::new(tokens.clone(), 4, 5).unwrap();
        let mut small = DataLoader::new(tokens, 2, 5).unwrap();
        let b = big.next_batch();
        let s1 = small.next_batch();
        let s2 = small.next_batch();
        assert_eq!(b.inputs[..10], s1.inputs[..]);
        assert_eq!(b.inputs[10..], s2.inputs[..]);
        assert_eq!(b.targets[..10], s1.targets[..]);
        assert_eq!(b.inputs[0..5], [0, 1, 2, 3, 4]);
        assert_eq!(b.targets[0..5], [1, 2, 3, 4, 5]);
        assert_eq!(b.inputs[15..20], [15, 16, 17, 18, 19]);
    }

    #[test]
    fn wraps_at_the_end() {
        let tokens: Vec<u32> = (0..25).collect();
        let mut l = DataLoader::new(tokens, 2, 5).unwrap();
        assert_eq!(l.next_batch().inputs[0], 0);
        assert_eq!(l.next_batch().inputs[0], 10);
        // 20 + 10 + 1 > 25: starts over.
        assert_eq!(l.next_batch().inputs[0], 0);
        assert_eq!(l.cursor().epoch, 1);
    }

    /// A stream cut at a separator: the separator ends its document, the position holding
    /// it predicts nothing, positions restart after it (and at every row).
    #[test]
    fn separators_end_documents() {
        const S: u32 = 9;
        let tokens = vec![1, 2, S, 3, 4, 5, S, 6, 7, S, 8];
        let mut l = DataLoader::new(tokens, 2, 5).unwrap().separated_by(Some(S));
        let b = l.next_batch();
        assert_eq!(b.inputs, [1, 2, S, 3, 4, 5, S, 6, 7, S]);
        assert_eq!(b.targets, [2, S, IGNORE, 4, 5, S, IGNORE, 7, S, IGNORE]);
        assert_eq!(b.positions.unwrap(), [0, 1, 2, 0, 1, 0, 1, 0, 1, 2]);
        // Without the separator: one document per row, every target trained.
        let mut l = DataLoader::new(vec![1, 2, S, 3, 4, 5], 1, 5).unwrap();
        let b = l.next_batch();
        assert_eq!((b.positions.is_none(), b.counted()), (true, 5));
    }

    /// Packed rows: documents start where the flags say, and no position predicts the
    /// next document's first token, whatever its trained flag.
    #[test]
    fn flagged_documents_restart_positions() {
        use crate::data::token_flags::DOCUMENT_START as D;
        const T: u8 = TRAINED;
        let shard = Shard::from_tokens_and_flags(
            vec![1u32, 2, 3, 4, 5, 6, 7],
            vec![D, T, T, D | T, T, D, D],
        )
        .unwrap();
        let mut l = DataLoader::new(TokenDataset::from_shards(vec![shard]), 1, 6).unwrap();
        let b = l.next_batch();
        assert_eq!(b.targets, [2, 3, IGNORE, 5, IGNORE, IGNORE]);
        assert_eq!(b.positions.unwrap(), [0, 1, 2, 0, 1, 0]);
    }

    #[test]
    fn too_little_data_is_an_error() {
        let err = DataLoader::new(vec![1u32; 10], 2, 5).unwrap_err();
        assert!(err.to_string().contains("needs 11"), "{err}");
    }

    fn shards(lens: &[u32]) -> TokenDataset {
        let mut next = 0;
        TokenDataset::from_shards(
            lens.iter()
                .map(|&n| {
                    let s = Shard::from_tokens((next..next + n).collect::<Vec<u32>>());
                    next += n;
                    s
                })
                .collect(),
        )
    }

    #[test]
    fn moves_across_shards_and_skips_short_ones() {
        // Windows of 2 × 3 + 1 tokens: 2 in the first shard, none in the second, 1 in the
        // third.
        let mut l = DataLoader::new(shards(&[13, 5, 7]), 2, 3).unwrap();
        let starts: Vec<u32> = (0..5).map(|_| l.next_batch().inputs[0]).collect();
        assert_eq!(starts, [0, 6, 18, 0, 6]);
    }

    #[test]
    fn skipping_a_batch_is_reading_it_and_leaving_it() {
        // Across shards, a short shard and epochs, shuffled (each epoch its own order).
        let data = shards(&[41, 5, 41, 29]);
        let mut read = DataLoader::new(data.clone(), 2, 4)
            .unwrap()
            .shuffled(Some(3));
        let mut skip = DataLoader::new(data, 2, 4).unwrap().shuffled(Some(3));
        for i in 0..40 {
            let b = read.next_batch();
            if i % 3 == 1 {
                assert_eq!(skip.next_batch().inputs, b.inputs, "batch {i}");
            } else {
                skip.skip_batch();
            }
            assert_eq!(skip.cursor(), read.cursor(), "after batch {i}");
        }
    }

    #[test]
    fn shuffling_permutes_and_resumes() {
        let data = shards(&[41, 41, 41]);
        let mut l = DataLoader::new(data.clone(), 2, 4)
            .unwrap()
            .shuffled(Some(5));
        let epoch: Vec<u32> = (0..15).map(|_| l.next_batch().inputs[0]).collect();
        let mut sorted = epoch.clone();
        sorted.sort();
        let plain: Vec<u32> = {
            let mut p = DataLoader::new(data.clone(), 2, 4).unwrap();
            (0..15).map(|_| p.next_batch().inputs[0]).collect()
        };
        assert_eq!(sorted, plain, "one epoch visits every window once");
        assert_ne!(epoch, plain);
        let next: Vec<u32> = (0..15).map(|_| l.next_batch().inputs[0]).collect();
        assert_ne!(next, epoch, "each epoch has its own order");

        // Stopping anywhere and resuming from the cursor gives the same batches.
        let mut a = DataLoader::new(data.clone(), 2, 4)
            .unwrap()
            .shuffled(Some(5));
        for _ in 0..7 {
            a.next_batch();
        }
        let mut b = DataLoader::new(data, 2, 4).unwrap().shuffled(Some(5));
        b.set_cursor(a.cursor()).unwrap();
        for _ in 0..20 {
            assert_eq!(a.next_batch().inputs, b.next_batch().inputs);
        }
    }
}
