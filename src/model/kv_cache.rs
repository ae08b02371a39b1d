//! The key/value cache of incremental decoding: what each attention node of a model has
//! seen, so the next token runs the model on its own row instead of the whole context.

use crate::device::Backend;

use crate::error::{Error, Result};
use crate::memory::MemoryCategory;
use crate::ops::attention::decode;
use crate::ops::Heads;
use crate::tensor::Tensor;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

/// The keys and values every attention node of a model computed for the positions run
/// so far ([`crate::Model::logits_cached`]), up to a capacity fixed when it is made.
/// Each node's are one tensor of `[capacity, 2·KV·D]` (the keys of every key/value head,
/// then their values) in the compute dtype, allocated on the first call (on the device,
/// counted as activations).
#[derive(Debug)]
pub struct KvCache {
    capacity: usize,
    len: usize,
    nodes: HashMap<String, Tensor>,
}

impl KvCache {
    /// An empty cache for at most `capacity` positions.
    pub fn new(capacity: usize) -> KvCache {
        KvCache {
            capacity,
            len: 0,
            nodes: HashMap::new(),
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the buffers stay, for the next sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Fails unless `n` more positions fit.
    pub(crate) fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(Error::config(
                "kv cache",
                format!(
                    "holds {} of {} positions, too few for {n} more; make it larger (at most \
                     the model's context) or start a new sequence",
                    self.len, self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// The new rows' keys and values of attention node `node` (its output's name)
    /// appended to its cache, and `out` its attention over every position so far.
    pub(crate) fn attend(
        &mut self,
        be: &dyn Backend,
        node: &str,
        out: &mut Tensor,
        qkv: &Tensor,
        heads: Heads,
    ) -> Result<()> {
        let width = 2 * heads.kv_width();
        let n = qkv.numel() / heads.qkv_width().max(1);
        let cache = match self.nodes.entry(node.to_string()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(be.zeros(
                &[self.capacity, width],
                qkv.dtype(),
                MemoryCategory::Activations,
                &format!("{node}.kv_cache"),
            )?),
        };
        let mut scratch = be.empty(
            &[n, width],
            qkv.dtype(),
            MemoryCategory::Workspace,
            &format!("{node}.kv_new"),
        )?;
        decode::append(be, cache, &mut scratch, qkv, heads, self.len)?;
        drop(scratch);
        decode::decode(be, out, qkv, cache, heads, self.len)
    }

    /// Counts `n` positions as held, once every node has appended them.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
