//! Token and position embeddings and their backward.
//!
//! `embedding_backward_wte_*` accumulates without atomics: one thread per (token, column)
//! adds that token's rows in row order. The token ids are on the host, so the rows are
//! grouped there, once per batch, into [`TokenBuckets`], which the backend uploads.
//!
//! CPU twin: `cpu.rs` beside this file. Kernels: `kernels/embedding.cu`, listed once in [`KERNELS`].

use crate::device::cuda::backend::{ptr, CudaBackend, BLOCK};
use crate::device::cuda::Args;
use crate::device::cuda::KernelFile;
use crate::error::Result;
use crate::tensor::Tensor;

/// The kernels of `kernels/embedding.cu`, named once: the backend launches these names, NVRTC
/// and the emulator build this source.
pub(crate) const KERNELS: KernelFile = KernelFile {
    name: "embedding.cu",
    source: include_str!("../../../kernels/embedding.cu"),
    kernels: &[
        "embedding_f32",
        "embedding_bf16",
        "embedding_backward_wte_f32_f32",
        "embedding_backward_wte_bf16_f32",
        "embedding_backward_wte_f32_bf16",
        "embedding_backward_wte_bf16_bf16",
        "embedding_backward_wpe_f32_f32",
        "embedding_backward_wpe_bf16_f32",
        "embedding_backward_wpe_f32_bf16",
        "embedding_backward_wpe_bf16_bf16",
        "embedding_f16",
        "embedding_backward_wte_f16_f32",
        "embedding_backward_wte_f32_f16",
        "embedding_backward_wte_f16_f16",
        "embedding_backward_wpe_f16_f32",
        "embedding_backward_wpe_f32_f16",
        "embedding_backward_wpe_f16_f16",
    ],
};
inventory::submit!(KERNELS);

pub(crate) fn forward(
    be: &CudaBackend,
    out: &mut Tensor,
    tokens: &[u32],
    wte: &Tensor,
    wpe: Option<&Tensor>,
    positions: Option<&[u32]>,
) -> Result<()> {
    let (b, t, c) = btc(out);
    if b * t * c == 0 {
        return Ok(());
    }
    let dt = out.dtype();
    let wte = be.as_dtype(wte, dt)?;
    // Without position embeddings the kernel is told so and never reads its `wpe`.
    let has_wpe = wpe.is_some();
    let wpe = be.as_dtype(wpe.unwrap_or(&wte), dt)?;
    let toks = be.upload_u32(tokens, "embedding.tokens")?;
    let pos = be.positions(positions)?;
    be.launch(
        &format!("embedding_{dt}"),
        be.grid(b * t * c),
        BLOCK,
        Args::new()
            .ptr(ptr(out)?)
            .ptr(ptr(&toks)?)
            .ptr(ptr(&wte)?)
            .ptr(ptr(&wpe)?)
            .i64(b * t)
            .i64(t)
            .i64(c)
            .i64(has_wpe as usize)
            .ptr(pos.ptr()?),
    )
}

/// `table[index[r]] += dout[r]` for every row `r` of `dout`, in row order per index: the
/// rows grouped on the host ([`TokenBuckets`]) and added by `embedding_backward_wte_*`.
fn add_rows_by_index(
    be: &CudaBackend,
    table: &mut Tensor,
    dout: &Tensor,
    index: &[u32],
    label: &str,
) -> Result<()> {
    let c = btc(dout).2;
    let buckets = TokenBuckets::new(index);
    let bt = be.upload_u32(&buckets.tokens, &format!("{label}.tokens"))?;
    let bo = be.upload_u32(&buckets.offsets, &format!("{label}.offsets"))?;
    let br = be.upload_u32(&buckets.rows, &format!("{label}.rows"))?;
    let suffix = format!("{}_{}", dout.dtype(), table.dtype());
    be.launch(
        &format!("embedding_backward_wte_{suffix}"),
        be.grid(buckets.len() * c),
        BLOCK,
        Args::new()
            .ptr(ptr(table)?)
            .ptr(ptr(dout)?)
            .ptr(ptr(&bt)?)
            .ptr(ptr(&bo)?)
            .ptr(ptr(&br)?)
            .i64(buckets.len())
            .i64(c),
    )
}

/// `(B, T, C)` of a checked `[B, T, C]` tensor.
fn btc(x: &Tensor) -> (usize, usize, usize) {
    match *x.shape() {
        [b, t, c] => (b, t, c),
        _ => (0, 0, 0),
    }
}

pub(crate) fn backward(
    be: &CudaBackend,
    dwte: &mut Tensor,
    dwpe: Option<&mut Tensor>,
    dout: &Tensor,
    tokens: &[u32],
    positions: Option<&[u32]>,
) -> Result<()> {
    let (b, t, c) = btc(dout);
    if b * t == 0 || c == 0 {
        return Ok(());
    }
    add_rows_by_index(be, dwte, dout, tokens, "embedding_backward")?;
    let Some(dwpe) = dwpe else { return Ok(()) };
    if let Some(positions) = positions {
        // Rows grouped by their position in their document, as tokens are grouped.
        return add_rows_by_index(be, dwpe, dout, positions, "embedding_backward.positions");
    }
    let dwpe_kernel = format!("embedding_backward_wpe_{}_{}", dout.dtype(), dwpe.dtype());
    let dwpe_ptr = ptr(dwpe)?;
    be.launch(
        &dwpe_kernel,
        be.grid(t * c),
        BLOCK,
        Args::new()
            .ptr(dwpe_ptr)
            .ptr(ptr(dout)?)
            .i64(b)
            .i64(t)
            .i64(c),
    )
}

/// The rows of a batch grouped by token, in the layout the kernel reads: bucket `b` is
/// token `tokens[b]` and its rows are `rows[offsets[b] .. offsets[b + 1]]`, ascending.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenBuckets {
    /// The distinct token ids, ascending.
    pub tokens: Vec<u32>,
    /// `tokens.len() + 1` offsets into `rows`.
    pub offsets: Vec<u32>,
    /// Row indices (positions in the batch's `tokens`), grouped by token, each group in
    /// row order.
    pub rows: Vec<u32>,
}

impl TokenBuckets {
    /// Groups the rows of `tokens` (one token per row of `[B·T, C]`) by token id.
    ///
    /// Panics if there are 2³² rows or more (a batch of that size does not fit a GPU).
    pub fn new(tokens: &[u32]) -> Self {
        let n = u32::try_from(tokens.len()).expect("fewer than 2^32 rows in a batch");
        let mut order: Vec<u32> = (0..n).collect();
        // Stable: rows of one token stay in row order.
        order.sort_by_key(|&r| tokens[r as usize]);
        let mut buckets = TokenBuckets {
            tokens: Vec::new(),
            offsets: Vec::new(),
            rows: order,
        };
        for (i, &r) in buckets.rows.iter().enumerate() {
            let tok = tokens[r as usize];
            if buckets.tokens.last() != Some(&tok) {
                buckets.tokens.push(tok);
                buckets.offsets.push(i as u32);
            }
        }
        buckets.offsets.push(n);
        buckets
    }

    /// Number of distinct tokens (the kernel's `n_buckets`).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the batch was empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_grouped_by_token_in_row_order() {
        let b = TokenBuckets::new(&[5, 2, 5, 7, 2, 5]);
        assert_eq!(b.tokens, vec![2, 5, 7]);
        assert_eq!(b.offsets, vec![0, 2, 5, 6]);
        assert_eq!(b.rows, vec![1, 4, 0, 2, 5, 3]);
        assert_eq!(b.len(), 3);
        let empty = TokenBuckets::new(&[]);
        assert!(empty.is_empty());
        assert_eq!(empty.offsets, vec![0]);
    }

    /// Accumulating bucket by bucket, as the kernel does, gives the CPU's sums (same
    /// order per token, so the same f32 results).
    #[test]
    fn bucketed_accumulation_matches_row_order() {
        let tokens: Vec<u32> = (0..200u32).map(|i| (i * 7 + i / 3) % 13).collect();
        let grad: Vec<f32> = (0..200)
            .map(|i| ((i * 37) % 101) as f32 * 0.013 - 0.6)
            .collect();
        let mut by_rows = vec![0.25f32; 13];
        for (r, &t) in tokens.iter().enumerate() {
            by_rows[t as usize] += grad[r];
        }
        let b = TokenBuckets::new(&tokens);
        let mut by_buckets = vec![0.25f32; 13];
        for (k, &t) in b.tokens.iter().enumerate() {
            let mut acc = by_buckets[t as usize];
            for &r in &b.rows[b.offsets[k] as usize..b.offsets[k + 1] as usize] {
                acc += grad[r as usize];
            }
            by_buckets[t as usize] = acc;
        }
        assert_eq!(by_rows, by_buckets);
    }
}

/// The kernels of `kernels/embedding.cu` on the emulator, held to their CPU twins.
#[cfg(test)]
mod emulated {
    use crate::device::cuda::parity::*;
    use crate::device::{Backend, CpuBackend};
    use crate::ops::embedding;
    use crate::Rng;

    #[test]
    fn embedding_kernels_match_the_cpu_bit_for_bit() {
        let Some(emu) = emulator() else { return };
        let be = CpuBackend::new();
        let (b, t, c, v, p) = (3usize, 11usize, 24usize, 17usize, 16usize);
        let mut rng = Rng::new(30);
        let mut tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
        let buckets = crate::ops::embedding::TokenBuckets::new(&tokens);
        let (wtes, wpes) = (random(v * c, 1.0, 31), random(p * c, 1.0, 32));
        let douts = random(b * t * c, 1.0, 33);
        for tt in DTYPES {
            let wte = upload(&be, &wtes, &[v, c], tt);
            let wpe = upload(&be, &wpes, &[p, c], tt);
            // With position embeddings (GPT-2) and without (Llama).
            for with_wpe in [true, false] {
                let mut out_cpu = zeros(&be, &[b, t, c], tt);
                embedding::forward(&be, &mut out_cpu, &tokens, &wte, with_wpe.then_some(&wpe))
                    .unwrap();
                let mut out = Buf::new(&vec![0.0; b * t * c], tt);
                let (mut we, mut pe) = (Buf::new(&wtes, tt), Buf::new(&wpes, tt));
                let a = Args::new()
                    .buf(&mut out)
                    .ptr(&mut tokens)
                    .buf(&mut we)
                    .buf(&mut pe)
                    .arg((b * t) as i64)
                    .arg(t as i64)
                    .arg(c as i64)
                    .arg(with_wpe as i64)
                    .arg(std::ptr::null_mut::<u32>());
                launch(emu, &format!("embedding_{}", suffix(tt)), 2, 128, 0, a).unwrap();
                assert_bitwise("embedding", &out.values(), &be.to_f32(&out_cpu).unwrap());
            }
            for g in DTYPES {
                if !instantiated(&[tt, g]) {
                    continue;
                }
                let dout = upload(&be, &douts, &[b, t, c], tt);
                let mut dwte_cpu = upload(&be, &wtes, &[v, c], g);
                let mut dwpe_cpu = upload(&be, &wpes, &[p, c], g);
                embedding::backward(&be, &mut dwte_cpu, Some(&mut dwpe_cpu), &dout, &tokens)
                    .unwrap();
                let mut dout_buf = Buf::new(&douts, tt);
                let (mut dwte, mut dwpe) = (Buf::new(&wtes, g), Buf::new(&wpes, g));
                let (mut bt, mut bo, mut br) = (
                    buckets.tokens.clone(),
                    buckets.offsets.clone(),
                    buckets.rows.clone(),
                );
                let a = Args::new()
                    .buf(&mut dwte)
                    .buf(&mut dout_buf)
                    .ptr(&mut bt)
                    .ptr(&mut bo)
                    .ptr(&mut br)
                    .arg(buckets.len() as i64)
                    .arg(c as i64);
                let names = format!("{}_{}", suffix(tt), suffix(g));
                launch(emu, &format!("embedding_backward_wte_{names}"), 2, 64, 0, a).unwrap();
                let a = Args::new()
                    .buf(&mut dwpe)
                    .buf(&mut dout_buf)
                    .arg(b as i64)
                    .arg(t as i64)
                    .arg(c as i64);
                launch(emu, &format!("embedding_backward_wpe_{names}"), 2, 64, 0, a).unwrap();
                assert_bitwise("dwte", &dwte.values(), &be.to_f32(&dwte_cpu).unwrap());
                assert_bitwise("dwpe", &dwpe.values(), &be.to_f32(&dwpe_cpu).unwrap());
            }
        }
    }
}
