// Element-wise ops, casts and the bias gradient. CPU twin: src/device/cpu/elementwise.rs.
//
// Every tensor is a flat array of `n` elements. Names carry the dtype of each tensor in
// the order of the op's arguments: `cast_bf16_f32` writes bf16 from f32,
// `axpy_f32_bf16` adds a bf16 x into an f32 y, `add_bf16_f32_f32` is out = a + b with a
// bf16 out. Arithmetic is f32 with one rounding at the store, bitwise the CPU's.

// dst = src, converting (rounding to nearest even when narrowing).
template <typename D, typename S>
__device__ void cast_impl(D* dst, const S* src, i64 n) {
    TK_FOR_EACH(i, n) store(dst, i, load(src, i));
}

// Every element = value (rounded to the tensor's dtype).
template <typename T>
__device__ void fill_impl(T* x, float value, i64 n) {
    TK_FOR_EACH(i, n) store(x, i, value);
}

// out = a + b.
template <typename O, typename A, typename B>
__device__ void add_impl(O* out, const A* a, const B* b, i64 n) {
    TK_FOR_EACH(i, n) store(out, i, load(a, i) + load(b, i));
}

// y += alpha · x (two roundings in f32, as the CPU's `*y += alpha * x`, then one at the
// store).
template <typename Y, typename X>
__device__ void axpy_impl(Y* y, float alpha, const X* x, i64 n) {
    TK_FOR_EACH(i, n) store(y, i, load(y, i) + alpha * load(x, i));
}

// x *= alpha.
template <typename T>
__device__ void scale_impl(T* x, float alpha, i64 n) {
    TK_FOR_EACH(i, n) store(x, i, load(x, i) * alpha);
}

// The bias gradient, common.cuh's column sum in two passes: rows in blocks of
// TK_GRAD_ROW_BLOCK, each block's column sums in row order into an f32 workspace
// [blocks, cols] (a thread per block and 8 adjacent columns, common.cuh's
// tk_column_partials); then per column the blocks in order from 0, and that total added to
// dbias with one rounding.
template <typename T, bool VEC>
__device__ void bias_blocks(float* partial, const T* __restrict__ dout, i64 rows, int c) {
    tk_column_partials<1, VEC>(partial, rows, c, [=](float (&acc)[1][8], i64 r, int col) {
        float dv[8];
        load8(dv, dout + r * c, col, c, VEC);
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[0][m] += dv[m];
    });
}

template <typename T>
__device__ void bias_backward_partial_impl(float* partial, const T* dout, i64 rows, i64 cols) {
    if (cols % 8 == 0 && aligned16(dout) && aligned16(partial)) {
        bias_blocks<T, true>(partial, dout, rows, (int)cols);
    } else {
        bias_blocks<T, false>(partial, dout, rows, (int)cols);
    }
}

template <typename G>
__device__ void bias_backward_finish_impl(G* dbias, const float* partial, i64 blocks,
                                          i64 cols) {
    TK_FOR_EACH_COLUMN_TOTAL(g, cols) {
        const i64 col = 32 * g + (threadIdx.x & 31);
        const float total = tk_column_total(partial, blocks, cols, g, 0.0f);
        if (threadIdx.x < 32 && col < cols) store(dbias, col, load(dbias, col) + total);
    }
}

#define TK_CAST(D, DN, S, SN)                                                               \
    extern "C" __global__ void cast_##DN##_##SN(D* dst, const S* src, i64 n) {             \
        cast_impl<D, S>(dst, src, n);                                                       \
    }
TK_CAST(float, f32, float, f32)
TK_CAST(float, f32, bf16, bf16)
TK_CAST(bf16, bf16, float, f32)
TK_CAST(bf16, bf16, bf16, bf16)
TK_CAST(float, f32, f16, f16)
TK_CAST(f16, f16, float, f32)
TK_CAST(f16, f16, f16, f16)

#define TK_ONE_DTYPE(T, N)                                                                  \
    extern "C" __global__ void fill_##N(T* x, float value, i64 n) { fill_impl<T>(x, value, n); } \
    extern "C" __global__ void scale_##N(T* x, float alpha, i64 n) {                        \
        scale_impl<T>(x, alpha, n);                                                         \
    }                                                                                       \
    extern "C" __global__ void bias_backward_partial_##N(float* partial, const T* dout,     \
                                                         i64 rows, i64 cols) {              \
        bias_backward_partial_impl<T>(partial, dout, rows, cols);                           \
    }                                                                                       \
    extern "C" __global__ void bias_backward_finish_##N(T* dbias, const float* partial,     \
                                                        i64 blocks, i64 cols) {             \
        bias_backward_finish_impl<T>(dbias, partial, blocks, cols);                         \
    }
TK_DTYPES(TK_ONE_DTYPE)

#define TK_AXPY(Y, YN, X, XN)                                                               \
    extern "C" __global__ void axpy_##YN##_##XN(Y* y, float alpha, const X* x, i64 n) {    \
        axpy_impl<Y, X>(y, alpha, x, n);                                                    \
    }
TK_AXPY(float, f32, float, f32)
TK_AXPY(float, f32, bf16, bf16)
TK_AXPY(bf16, bf16, float, f32)
TK_AXPY(bf16, bf16, bf16, bf16)
TK_AXPY(float, f32, f16, f16)
TK_AXPY(f16, f16, float, f32)
TK_AXPY(f16, f16, f16, f16)

#define TK_ADD(O, ON, A, AN, B, BN)                                                         \
    extern "C" __global__ void add_##ON##_##AN##_##BN(O* out, const A* a, const B* b,       \
                                                      i64 n) {                              \
        add_impl<O, A, B>(out, a, b, n);                                                    \
    }
TK_ADD(float, f32, float, f32, float, f32)
TK_ADD(float, f32, float, f32, bf16, bf16)
TK_ADD(float, f32, bf16, bf16, float, f32)
TK_ADD(float, f32, bf16, bf16, bf16, bf16)
TK_ADD(bf16, bf16, float, f32, float, f32)
TK_ADD(bf16, bf16, float, f32, bf16, bf16)
TK_ADD(bf16, bf16, bf16, bf16, float, f32)
TK_ADD(bf16, bf16, bf16, bf16, bf16, bf16)
TK_ADD(float, f32, float, f32, f16, f16)
TK_ADD(float, f32, f16, f16, float, f32)
TK_ADD(float, f32, f16, f16, f16, f16)
TK_ADD(f16, f16, float, f32, float, f32)
TK_ADD(f16, f16, float, f32, f16, f16)
TK_ADD(f16, f16, f16, f16, float, f32)
TK_ADD(f16, f16, f16, f16, f16, f16)
