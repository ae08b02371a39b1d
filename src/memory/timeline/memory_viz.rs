//! The snapshot PyTorch's memory viewer reads (`torch.cuda.memory._snapshot()`'s format):
//! a pickled dict of `segments` (the blocks live at the end) and `device_traces` (every
//! allocation and free, in order).
//!
//! trainkit's buffers have no device addresses of their own, so each gets one from a
//! first-fit allocator over a virtual address space (512-byte aligned, like CUDA's caching
//! allocator): an address is unique while its buffer lives and is reused after it is
//! freed. One segment spans the whole space used.

use super::pickle::{dumps, Value};
use super::{buffer_name, time_us, Walk};
use crate::memory::MemoryEvent;
use std::collections::{BTreeMap, HashMap};

/// Where the virtual address space begins (a typical CUDA device address).
const BASE: u64 = 0x7f00_0000_0000;
/// Alignment (and smallest footprint) of a buffer.
const ALIGN: u64 = 512;

/// First-fit allocation of addresses, coalescing free ranges.
#[derive(Debug, Default)]
struct AddressSpace {
    /// Free ranges below `top`: offset -> length.
    free: BTreeMap<u64, u64>,
    /// The high-water mark: everything at or above it is free.
    top: u64,
}

fn footprint(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ALIGN).saturating_mul(ALIGN)
}

impl AddressSpace {
    /// The offset of a new buffer of `bytes`.
    fn alloc(&mut self, bytes: u64) -> u64 {
        let size = footprint(bytes);
        let fit = self
            .free
            .iter()
            .find(|(_, len)| **len >= size)
            .map(|(o, l)| (*o, *l));
        match fit {
            Some((offset, len)) => {
                self.free.remove(&offset);
                if len > size {
                    self.free.insert(offset + size, len - size);
                }
                offset
            }
            None => {
                // Grow from the last free range if it ends at the top.
                let offset = match self.free.iter().next_back().map(|(o, l)| (*o, *l)) {
                    Some((o, l)) if o + l == self.top => {
                        self.free.remove(&o);
                        o
                    }
                    _ => self.top,
                };
                self.top = offset + size;
                offset
            }
        }
    }

    /// Returns the range of a buffer of `bytes` at `offset`.
    fn free(&mut self, offset: u64, bytes: u64) {
        let mut start = offset;
        let mut len = footprint(bytes);
        if let Some((&o, &l)) = self.free.range(..offset).next_back() {
            if o + l == start {
                self.free.remove(&o);
                start = o;
                len += l;
            }
        }
        if let Some(&l) = self.free.get(&(offset + footprint(bytes))) {
            self.free.remove(&(offset + footprint(bytes)));
            len += l;
        }
        self.free.insert(start, len);
    }
}

/// A buffer live in the address space.
struct Live {
    offset: u64,
    bytes: u64,
    frames: Value,
}

fn frames(name: String, context: String) -> Value {
    let frame = |name: String| {
        Value::Dict(vec![
            ("filename", "trainkit".into()),
            ("line", Value::Int(0)),
            ("name", name.into()),
        ])
    };
    Value::List(vec![frame(name), frame(context)])
}

fn trace_entry(action: &str, offset: u64, bytes: u64, time: u64, frames: &Value) -> Value {
    Value::Dict(vec![
        ("action", action.into()),
        ("addr", (BASE + offset).into()),
        ("size", bytes.into()),
        ("stream", Value::Int(0)),
        ("time_us", time.into()),
        ("frames", frames.clone()),
    ])
}

/// The pickled snapshot of `events`.
pub(super) fn render(events: &[MemoryEvent]) -> Vec<u8> {
    dumps(&snapshot(events))
}

/// The snapshot of `events` as a Python value.
fn snapshot(events: &[MemoryEvent]) -> Value {
    let mut space = AddressSpace::default();
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut trace = Vec::new();
    let mut walk = Walk::default();
    for e in events {
        match e {
            MemoryEvent::Alloc {
                id,
                category,
                bytes,
                label,
                ..
            } if category.on_device() => {
                // Host memory held for the device (offloaded activations) has no device
                // address: the snapshot is the device's.
                let offset = space.alloc(*bytes);
                let f = frames(buffer_name(label, *category), walk.context());
                trace.push(trace_entry("alloc", offset, *bytes, time_us(e), &f));
                live.insert(
                    *id,
                    Live {
                        offset,
                        bytes: *bytes,
                        frames: f,
                    },
                );
            }
            MemoryEvent::Free { id, .. } => {
                // A buffer allocated before recording began has no address: skipped.
                if let Some(b) = live.remove(id) {
                    for action in ["free_requested", "free_completed"] {
                        trace.push(trace_entry(
                            action,
                            b.offset,
                            b.bytes,
                            time_us(e),
                            &b.frames,
                        ));
                    }
                    space.free(b.offset, b.bytes);
                }
            }
            _ => {}
        }
        walk.apply(e);
    }

    let mut segments = Vec::new();
    if space.top > 0 {
        let mut at_end: Vec<&Live> = live.values().collect();
        at_end.sort_by_key(|b| b.offset);
        let mut blocks = Vec::new();
        let mut cursor = 0;
        let mut allocated = 0;
        let inactive = |offset: u64, size: u64| {
            Value::Dict(vec![
                ("address", (BASE + offset).into()),
                ("size", size.into()),
                ("requested_size", size.into()),
                ("state", "inactive".into()),
                ("frames", Value::List(Vec::new())),
            ])
        };
        for b in at_end {
            if b.offset > cursor {
                blocks.push(inactive(cursor, b.offset - cursor));
            }
            blocks.push(Value::Dict(vec![
                ("address", (BASE + b.offset).into()),
                ("size", b.bytes.into()),
                ("requested_size", b.bytes.into()),
                ("state", "active_allocated".into()),
                ("frames", b.frames.clone()),
            ]));
            allocated += b.bytes;
            cursor = b.offset + b.bytes;
        }
        if space.top > cursor {
            blocks.push(inactive(cursor, space.top - cursor));
        }
        segments.push(Value::Dict(vec![
            ("device", Value::Int(0)),
            ("address", BASE.into()),
            ("total_size", space.top.into()),
            ("allocated_size", allocated.into()),
            ("active_size", allocated.into()),
            ("requested_size", allocated.into()),
            ("stream", Value::Int(0)),
            ("segment_type", "large".into()),
            (
                "segment_pool_id",
                Value::Tuple(vec![Value::Int(0), Value::Int(0)]),
            ),
            ("is_expandable", false.into()),
            ("frames", Value::List(Vec::new())),
            ("blocks", Value::List(blocks)),
        ]));
    }
    Value::Dict(vec![
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(vec![Value::List(trace)])),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_first_fit_and_coalesce() {
        let mut s = AddressSpace::default();
        let a = s.alloc(1000); // 1024
        let b = s.alloc(10); // 512
        let c = s.alloc(2048);
        assert_eq!((a, b, c), (0, 1024, 1536));
        s.free(a, 1000);
        // Fits in the hole a left.
        assert_eq!(s.alloc(512), 0);
        s.free(0, 512);
        s.free(b, 10);
        // a's and b's ranges merged: 1536 bytes at 0.
        assert_eq!(s.free.get(&0), Some(&1536));
        assert_eq!(s.alloc(1536), 0);
        s.free(c, 2048);
        // Too big for anything free below the top: the last range grows past the top.
        assert_eq!(s.alloc(4096), 1536);
        assert_eq!(s.top, 1536 + 4096);
        // Zero bytes still take a unique address.
        let z = s.alloc(0);
        assert_eq!(z, s.top - ALIGN);
    }
}
