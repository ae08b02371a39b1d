//! One matrix product on raw row-major buffers, as the CPU backend's `gemm` crate path and
//! a loaded CBLAS library both run it.

/// One product `dst (+)= scale · op(a) · op(b)` on raw row-major buffers: `op(a)` is
/// `[m, k]` with element `(i, p)` at `a[i·a_rs + p·a_cs]`, `op(b)` is `[k, n]` with
/// element `(p, j)` at `b[p·b_rs + j·b_cs]`, and `dst` is `[m, n]` with row stride
/// `dst_rs` and column stride 1.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: *mut f32,
    pub dst_rs: isize,
    pub accumulate: bool,
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    pub b: *const f32,
    pub b_rs: isize,
    pub b_cs: isize,
    pub scale: f32,
}

// SAFETY: a `Product` only describes memory; whoever runs it guarantees the pointers are
// valid and that products running at once write disjoint `dst` regions.
unsafe impl Send for Product {}
unsafe impl Sync for Product {}

impl Product {
    /// The `[rows, cols]` tile of this product whose first element is `(i0, j0)`.
    ///
    /// # Safety
    /// The tile must lie inside the product.
    pub(super) unsafe fn tile(&self, i0: usize, j0: usize, rows: usize, cols: usize) -> Product {
        Product {
            m: rows,
            n: cols,
            dst: self.dst.offset(i0 as isize * self.dst_rs).add(j0),
            a: self.a.offset(i0 as isize * self.a_rs),
            b: self.b.offset(j0 as isize * self.b_cs),
            ..*self
        }
    }
}
