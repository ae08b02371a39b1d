//! Attention for incremental decoding: new query rows against a key/value cache.
//!
//! A decoder that has run positions `0..start` keeps each layer's keys and values in a
//! cache (`[capacity, 2·KV·D]`: the keys of every key/value head, then their values); the
//! next `n` tokens run every other op on their own rows, append their keys and values to
//! the cache ([`append`]) and attend with [`decode`]: query row `i` (position `start + i`)
//! over the cached keys `0..=start + i`. The result is causal attention's for those rows,
//! without recomputing the earlier positions. CPU twin (`cpu.rs`) and CUDA launches
//! (`cuda.rs`, over `kernels/attention.cu`) agree bit for bit: every sum is a plain loop in
//! one order.

use super::{cpu, cuda};
use crate::device::cpu::{ensure, ensure_float};
use crate::device::{Backend, CpuBackend, CudaBackend, OpKernel};
use crate::error::Result;
use crate::ops::lora::take_cols;
use crate::ops::Heads;
use crate::tensor::Tensor;

/// Appends the keys and values of `qkv` (`n` rows of `(H + 2·KV)·D`, laid out as
/// [`Heads`] says) to `cache` at rows `start..start + n`, through `scratch` (`[n, 2·KV·D]`).
pub fn append(
    be: &(impl Backend + ?Sized),
    cache: &mut Tensor,
    scratch: &mut Tensor,
    qkv: &Tensor,
    heads: Heads,
    start: usize,
) -> Result<()> {
    let n = qkv.numel() / heads.qkv_width().max(1);
    take_cols(be, scratch, qkv, heads.q_width())?;
    be.copy_rows(cache, start, scratch, 0, n, false)
}

/// `out` (`n` rows of `H·D`) = causal attention of the `n` query rows of `qkv` (positions
/// `start..start + n`) over the keys and values of `kv` rows `0..=start + i` (see the
/// module documentation), which must already hold the new rows' own.
pub fn decode(
    be: &(impl Backend + ?Sized),
    out: &mut Tensor,
    qkv: &Tensor,
    kv: &Tensor,
    heads: Heads,
    start: usize,
) -> Result<()> {
    be.run(&mut Decode {
        out,
        qkv,
        kv,
        heads,
        start,
    })
}

struct Decode<'a> {
    out: &'a mut Tensor,
    qkv: &'a Tensor,
    kv: &'a Tensor,
    heads: Heads,
    start: usize,
}

impl Decode<'_> {
    fn rows(&self) -> usize {
        self.qkv.numel() / self.heads.qkv_width().max(1)
    }
}

impl OpKernel for Decode<'_> {
    fn name(&self) -> &'static str {
        "attention_decode"
    }
    fn label(&self) -> &str {
        self.out.label()
    }
    fn check(&self) -> Result<()> {
        ensure_float("attention_decode", &[self.out, self.qkv, self.kv])?;
        self.heads.check("attention_decode")?;
        let h = self.heads;
        let n = self.rows();
        let (cap, kv_w) = self.kv.rows_cols();
        ensure(
            self.qkv.numel() == n * h.qkv_width()
                && self.out.numel() == n * h.q_width()
                && kv_w == 2 * h.kv_width()
                && self.start + n <= cap
                && self.out.dtype() == self.qkv.dtype()
                && self.kv.dtype() == self.qkv.dtype(),
            "attention_decode",
            || {
                format!(
                    "`{}` {:?} must be rows of {} query, key and value columns, `{}` {:?} \
                     those rows of {} output columns, and `{}` {:?} a cache of {} columns \
                     holding positions 0..{}, all in one dtype",
                    self.qkv.label(),
                    self.qkv.shape(),
                    h.qkv_width(),
                    self.out.label(),
                    self.out.shape(),
                    h.q_width(),
                    self.kv.label(),
                    self.kv.shape(),
                    2 * h.kv_width(),
                    self.start + n
                )
            },
        )
    }
    fn flops(&self) -> u64 {
        let (n, h) = (self.rows() as u64, self.heads);
        let keys = self.start as u64 + n;
        4 * n * h.n_head as u64 * keys * h.head_dim as u64
    }
    fn cpu(&mut self, _be: &CpuBackend) -> Result<()> {
        cpu::decode(self.out, self.qkv, self.kv, self.heads, self.start);
        Ok(())
    }
    fn cuda(&mut self, be: &CudaBackend) -> Result<()> {
        cuda::decode(be, self.out, self.qkv, self.kv, self.heads, self.start)
    }
}
