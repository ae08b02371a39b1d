//! NF4 as bitsandbytes stores it (`quantize_4bit(quant_type="nf4", blocksize=64,
//! compress_statistics=True)`), on the host: the layout of a packed tensor, quantization
//! and the reference dequantization every kernel is held to.
//!
//! - Elements are quantized in blocks of [`BLOCK`] (64) with one absmax each: an element
//!   becomes the index of the [`CODE`] value nearest to `x · (1/absmax)` (clamped to
//!   `[-1, 1]`; a value on a midpoint goes to the lower code), two indices per byte, the
//!   even element in the high nibble.
//! - The absmaxes are double-quantized: their mean (the `offset`) is subtracted, and the
//!   rest quantized to the nearest value of the signed 8-bit dynamic code
//!   ([`dynamic_code`]) in blocks of [`STATS_BLOCK`] (256) with one f32 scale each.
//! - An element dequantizes to `CODE[c] · (dyn[q] · scale + offset)`, each product and sum
//!   rounded to f32 in that order, as `dequantize_4bit` computes it.
//!
//! trainkit fuses some Hugging Face modules into one weight (`qkv_proj` holds `q_proj`,
//! `k_proj` and `v_proj`; `gate_up_proj` holds `gate_proj` and `up_proj`), which
//! bitsandbytes quantizes one by one. Such a weight is quantized in [`Parts`]: each
//! module's rows on their own (their own offset and scales), packed one after the other.
//!
//! A packed tensor (or part) of `n` elements is one byte buffer: the `⌈n/2⌉` code bytes, the
//! `⌈n/64⌉` absmax codes, padding to 4 bytes, the `⌈n/16384⌉` f32 scales and the f32
//! offset, little-endian: 4.127 bits per element ([`Layout`]).

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

/// Elements per absmax block.
pub const BLOCK: usize = 64;

/// Absmaxes per block of the double quantization.
pub const STATS_BLOCK: usize = 256;

/// The 16 NF4 values: quantiles of a standard normal scaled to `[-1, 1]`, with an exact 0
/// (bitsandbytes' table, as f32).
pub const CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The Hugging Face modules a fused NF4 weight holds, by their element counts: the first
/// one or two (0: none), the last part being the rest. Each part is quantized on its own,
/// as bitsandbytes quantizes each module. [`Parts::WHOLE`] is one part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Parts(pub [u64; 2]);

impl Parts {
    /// One part: the whole tensor.
    pub const WHOLE: Parts = Parts([0, 0]);

    /// The parts of a tensor of `n` elements: `(first element, elements, first byte)` of
    /// each, in order (boundaries beyond `n` are clamped).
    pub fn of(self, n: usize) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::with_capacity(3);
        let (mut start, mut byte) = (0usize, 0usize);
        for len in self.0 {
            let len = usize::try_from(len).unwrap_or(usize::MAX).min(n - start);
            if len > 0 && start + len < n {
                out.push((start, len, byte));
                byte += Layout::of(len).bytes;
                start += len;
            }
        }
        out.push((start, n - start, byte));
        out
    }

    /// Exact bytes of `n` elements quantized in these parts.
    pub fn bytes(self, n: usize) -> usize {
        self.of(n)
            .last()
            .map_or(0, |&(_, len, byte)| byte + Layout::of(len).bytes)
    }
}

/// Where each part of a packed NF4 tensor of `n` elements lies, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Elements.
    pub n: usize,
    /// Absmax blocks (`⌈n/64⌉`).
    pub blocks: usize,
    /// Blocks of the double quantization (`⌈blocks/256⌉`).
    pub stats_blocks: usize,
    /// Start of the absmax codes (after the `⌈n/2⌉` code bytes).
    pub absmax_at: usize,
    /// Start of the f32 scales of the absmax codes.
    pub scales_at: usize,
    /// Start of the f32 offset.
    pub offset_at: usize,
    /// Total bytes.
    pub bytes: usize,
}

impl Layout {
    /// The layout of `n` elements.
    pub fn of(n: usize) -> Layout {
        let blocks = n.div_ceil(BLOCK);
        let stats_blocks = blocks.div_ceil(STATS_BLOCK);
        let absmax_at = n.div_ceil(2);
        let scales_at = (absmax_at + blocks).next_multiple_of(4);
        let offset_at = scales_at + 4 * stats_blocks;
        Layout {
            n,
            blocks,
            stats_blocks,
            absmax_at,
            scales_at,
            offset_at,
            bytes: offset_at + 4,
        }
    }
}

/// The signed 8-bit dynamic code of the absmaxes, sorted ascending: bitsandbytes'
/// `create_dynamic_map(signed=True)` (7 exponent bits; at each power of ten from 10⁻⁶ to
/// 1, the means of evenly spaced fractions between 0.1 and 1, with both signs; then 0 and
/// 1), as the f32 bits bitsandbytes stores with every double-quantized tensor. The table
/// is kept as bits because it inherits f32 `linspace` rounding that no formula here
/// reproduces to the last bit.
pub fn dynamic_code() -> &'static [f32; 256] {
    static CODE: OnceLock<[f32; 256]> = OnceLock::new();
    CODE.get_or_init(|| DYNAMIC_BITS.map(f32::from_bits))
}

#[rustfmt::skip]
const DYNAMIC_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333,
    0xbf68999a, 0xbf650000, 0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a,
    0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333, 0xbf44999a, 0xbf410000,
    0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd,
    0xbf123334, 0xbf0e999a, 0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333,
    0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a, 0xbedc6666, 0xbed53333,
    0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999,
    0xbe6f3333, 0xbe60cccd, 0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333,
    0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334, 0xbdc9eb85, 0xbdc428f7,
    0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b,
    0xbd728f5d, 0xbd670a3d, 0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3,
    0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148, 0xbcfeb852, 0xbce7ae15,
    0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3,
    0xbbcfdf3b, 0xbbbd70a4, 0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a,
    0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d, 0xba7765ff, 0xba59e83e,
    0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94,
    0xb513a3b7, 0x00000000, 0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206,
    0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b, 0x398ce705, 0x39c7e283,
    0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374,
    0x3bab020d, 0x3bbd70a4, 0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581,
    0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148, 0x3c68f5c3, 0x3c8b851f,
    0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000,
    0x3d5b851f, 0x3d670a3d, 0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d,
    0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a, 0x3da75c2a, 0x3dad1eb8,
    0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000,
    0x3e526666, 0x3e60cccd, 0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334,
    0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000, 0x3eb13333, 0x3eb86666,
    0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666,
    0x3f0b0000, 0x3f0e999a, 0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000,
    0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666, 0x3f2f0000, 0x3f32999a,
    0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd,
    0x3f616666, 0x3f650000, 0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666,
    0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The index of the code value nearest to `x` (the lower one on a midpoint) in a sorted
/// `code`: the number of midpoints below `x`, as `torch.bucketize` counts them.
fn nearest(code: &[f32], x: f32) -> u8 {
    let mut i = 0;
    while i + 1 < code.len() && (code[i] + code[i + 1]) / 2.0 < x {
        i += 1;
    }
    i as u8
}

/// Each block's absmax of `values` and the values scaled by its reciprocal, clamped to
/// `[-1, 1]`.
fn block_scaled(values: &[f32], block: usize) -> (Vec<f32>, Vec<f32>) {
    let mut absmax = Vec::with_capacity(values.len().div_ceil(block));
    let mut scaled = Vec::with_capacity(values.len());
    for b in values.chunks(block) {
        let m = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = 1.0 / m.max(1e-38);
        absmax.push(m);
        scaled.extend(b.iter().map(|v| (v * inv).clamp(-1.0, 1.0)));
    }
    (absmax, scaled)
}

/// `values` quantized to NF4 with double-quantized absmaxes, packed as [`Layout`] says.
pub fn quantize(values: &[f32]) -> Vec<u8> {
    let layout = Layout::of(values.len());
    let mut out = vec![0u8; layout.bytes];
    // Quantized in parallel, 256 blocks (8 KiB of codes) per task.
    const TASK: usize = BLOCK * 256;
    let absmax: Vec<f32> = out[..layout.absmax_at]
        .par_chunks_mut(TASK / 2)
        .zip(values.par_chunks(TASK))
        .flat_map_iter(|(bytes, values)| {
            let (absmax, scaled) = block_scaled(values, BLOCK);
            for (byte, pair) in bytes.iter_mut().zip(scaled.chunks(2)) {
                let hi = nearest(&CODE, pair[0]);
                let lo = pair
                    .get(1)
                    .map_or(nearest(&CODE, 0.0), |x| nearest(&CODE, *x));
                *byte = (hi << 4) | lo;
            }
            absmax
        })
        .collect();
    let offset = if absmax.is_empty() {
        0.0
    } else {
        (absmax.iter().map(|&a| f64::from(a)).sum::<f64>() / absmax.len() as f64) as f32
    };
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let (scales, scaled) = block_scaled(&centred, STATS_BLOCK);
    let code = dynamic_code();
    let absmax_codes: Vec<u8> = scaled.iter().map(|x| nearest(code, *x)).collect();
    write_statistics(&mut out, &layout, &absmax_codes, &scales, offset);
    out
}

/// Writes the absmax codes, their scales and the offset into a packed buffer.
fn write_statistics(out: &mut [u8], layout: &Layout, absmax: &[u8], scales: &[f32], offset: f32) {
    out[layout.absmax_at..layout.absmax_at + absmax.len()].copy_from_slice(absmax);
    for (i, s) in scales.iter().enumerate() {
        let at = layout.scales_at + 4 * i;
        out[at..at + 4].copy_from_slice(&s.to_le_bytes());
    }
    out[layout.offset_at..].copy_from_slice(&offset.to_le_bytes());
}

/// `values` quantized in `parts`, each part packed on its own, one after the other.
pub fn quantize_parts(values: &[f32], parts: Parts) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.bytes(values.len()));
    for (start, len, _) in parts.of(values.len()) {
        out.extend(quantize(&values[start..start + len]));
    }
    out
}

/// A tensor of `n` elements packed in `parts`, dequantized to f32.
pub fn dequantize_parts(packed: &[u8], n: usize, parts: Parts) -> Vec<f32> {
    let mut out = vec![0f32; n];
    dequantize_range(packed, n, parts, 0, &mut out);
    out
}

/// Elements `start..start + out.len()` of a tensor of `n` elements packed in `parts`,
/// dequantized to f32 (each part's blocks in parallel): the reference every kernel is
/// held to, and the CPU's kernel itself.
pub fn dequantize_range(packed: &[u8], n: usize, parts: Parts, start: usize, out: &mut [f32]) {
    let end = start + out.len();
    for (part_start, part_len, byte) in parts.of(n) {
        let (from, to) = (start.max(part_start), end.min(part_start + part_len));
        if from < to {
            let layout = Layout::of(part_len);
            let part = &packed[byte..byte + layout.bytes];
            dequantize_part(
                part,
                &layout,
                from - part_start,
                &mut out[from - start..to - start],
            );
        }
    }
}

/// Elements `start..start + out.len()` of one part (`packed`, laid out as `layout`).
fn dequantize_part(packed: &[u8], layout: &Layout, start: usize, out: &mut [f32]) {
    let first = start / BLOCK;
    let last = (start + out.len()).div_ceil(BLOCK).min(layout.blocks);
    let absmax = absmaxes_of(packed, layout, first..last);
    // The head up to a block boundary, then chunks of whole blocks in parallel.
    let head = (BLOCK - start % BLOCK) % BLOCK;
    let (head_part, rest) = out.split_at_mut(head.min(out.len()));
    dequantize_into(packed, &absmax, first * BLOCK, start, head_part);
    let base = start + head_part.len();
    rest.par_chunks_mut(BLOCK * 64)
        .enumerate()
        .for_each(|(i, chunk)| {
            dequantize_into(packed, &absmax, first * BLOCK, base + i * BLOCK * 64, chunk)
        });
}

/// A packed tensor of `n` elements from bitsandbytes' parts: the packed codes, the
/// absmax codes, their f32 scales and the offset.
pub fn pack(n: usize, codes: &[u8], absmax: &[u8], scales: &[f32], offset: f32) -> Option<Vec<u8>> {
    let layout = Layout::of(n);
    if codes.len() != layout.absmax_at
        || absmax.len() != layout.blocks
        || scales.len() != layout.stats_blocks
    {
        return None;
    }
    let mut out = vec![0u8; layout.bytes];
    out[..codes.len()].copy_from_slice(codes);
    write_statistics(&mut out, &layout, absmax, scales, offset);
    Some(out)
}

fn f32_at(packed: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([packed[at], packed[at + 1], packed[at + 2], packed[at + 3]])
}

/// The absmaxes of blocks `blocks` of a packed tensor: `dyn[q] · scale + offset`.
fn absmaxes_of(packed: &[u8], layout: &Layout, blocks: std::ops::Range<usize>) -> Vec<f32> {
    let code = dynamic_code();
    let offset = f32_at(packed, layout.offset_at);
    blocks
        .map(|b| {
            let scale = f32_at(packed, layout.scales_at + 4 * (b / STATS_BLOCK));
            code[usize::from(packed[layout.absmax_at + b])] * scale + offset
        })
        .collect()
}

/// Elements `start..start + out.len()` of a packed tensor, dequantized to f32; `absmax`
/// holds the absmaxes of the blocks from element `absmax_from` (a block boundary) on.
fn dequantize_into(
    packed: &[u8],
    absmax: &[f32],
    absmax_from: usize,
    start: usize,
    out: &mut [f32],
) {
    for (i, o) in (start..).zip(out.iter_mut()) {
        let byte = packed[i / 2];
        let c = if i % 2 == 0 { byte >> 4 } else { byte & 0xf };
        *o = CODE[usize::from(c)] * absmax[(i - absmax_from) / BLOCK];
    }
}

/// A packed tensor of `n` elements (one part) dequantized to f32.
pub fn dequantize(packed: &[u8], n: usize) -> Vec<f32> {
    dequantize_parts(packed, n, Parts::WHOLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_costs_4_127_bits_per_element() {
        let l = Layout::of(4096 * 4096);
        assert_eq!(l.blocks, 262_144);
        assert_eq!(l.stats_blocks, 1024);
        assert_eq!(l.bytes, 4096 * 4096 / 2 + 262_144 + 4 * 1024 + 4);
        let bits = 8.0 * l.bytes as f64 / (4096.0 * 4096.0);
        assert!((bits - 4.127).abs() < 1e-3, "{bits}");
    }

    #[test]
    fn parts_are_quantized_one_by_one() {
        let v: Vec<f32> = (0..3 * 640)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        let parts = Parts([640 * 2, 320]);
        let spans = parts.of(v.len());
        assert_eq!(spans.len(), 3);
        let packed = quantize_parts(&v, parts);
        assert_eq!(packed.len(), parts.bytes(v.len()));
        let mut want = Vec::new();
        for (start, len, byte) in &spans {
            let one = quantize(&v[*start..start + len]);
            assert_eq!(&packed[*byte..byte + one.len()], &one[..]);
            want.extend(dequantize(&one, *len));
        }
        assert_eq!(dequantize_parts(&packed, v.len(), parts), want);
        assert_eq!(Parts::WHOLE.of(10), vec![(0, 10, 0)]);
        assert_eq!(Parts::WHOLE.bytes(4096), Layout::of(4096).bytes);
    }

    #[test]
    fn code_values_quantize_to_themselves() {
        let mut v: Vec<f32> = CODE.iter().map(|c| c * 0.5).collect();
        v.resize(64, 0.0);
        v[63] = 0.5; // absmax 0.5 in every case
        let q = quantize(&v);
        let d = dequantize(&q, v.len());
        for (i, (a, b)) in v.iter().zip(&d).enumerate() {
            assert!((a - b).abs() <= 0.5 * 0.01, "{i}: {a} vs {b}");
        }
    }

    #[test]
    fn dynamic_code_is_sorted_and_signed() {
        let c = dynamic_code();
        assert!(c.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(c[255], 1.0);
        assert!(c.contains(&0.0));
        assert!((c[0] + 0.99297).abs() < 1e-4, "{}", c[0]);
    }
}
