// RMS normalization over the last dimension (Llama's norm), statistics in f32.
// CPU twin: src/ops/rmsnorm/cpu.rs.
//
// Layouts: x, out, dout, dx are [rows, C]; weight and dweight have C elements; rstd is
// [rows] f32.
//
// The forward's and the input gradient's row sums run on a warp per row (256 slots, the
// CPU's slot order; 16-byte loads where the row allows), so rstd, the
// output and dx are bitwise equal to the CPU's. The weight gradient is common.cuh's column
// sum in two passes: `rmsnorm_backward_params_*` writes the partial sums of each block of
// TK_GRAD_ROW_BLOCK rows to an f32 workspace [blocks, C], and
// `rmsnorm_backward_params_finish_*` adds them to dweight in block order, rounding once:
// the CPU's order, so bitwise equal too.

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x²) + eps); rstd[row] kept. A warp
// per row (common.cuh's warp rows): the sum in the CPU's slot order, the row read in
// 16-byte loads (its second reading mostly from L1).
template <typename T>
__device__ void rmsnorm_impl(T* __restrict__ out, float* __restrict__ rstd_out,
                             const T* __restrict__ x, const T* __restrict__ weight, i64 rows,
                             i64 c64, float eps) {
    const int c = (int)c64;
    const int lane = threadIdx.x & 31;
    const bool vec = c % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(weight);
    TK_FOR_EACH_WARP_ROW(row, rows) {
        const T* xr = x + row * c64;
        T* orow = out + row * c64;
        const float ss = warp_row_reduce(xr, c, vec, [](float v) { return v * v; });
        const float rstd = 1.0f / sqrtf(ss / (float)c + eps);
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], wv[8], o[8];
            load8(xv, xr, i, c, vec);
            load8(wv, weight, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) o[m] = xv[m] * rstd * wv[m];
            store8(orow, i, c, vec, o);
        }
        if (lane == 0) rstd_out[row] = rstd;
    }
}

// dx += rstd * (w·dy − x · k), k = mean(w·dy·x) · rstd². A warp per row (common.cuh's
// warp rows): the sum in the CPU's slot order, the row read in 16-byte loads (its second
// reading mostly from L1).
template <typename T>
__device__ void rmsnorm_backward_dx_impl(T* __restrict__ dx, const T* __restrict__ dout,
                                         const T* __restrict__ x, const T* __restrict__ weight,
                                         const float* __restrict__ rstd, i64 rows, i64 c64) {
    const int c = (int)c64;
    const int lane = threadIdx.x & 31;
    const bool vec = c % 8 == 0 && aligned16(dx) && aligned16(dout) && aligned16(x) &&
                     aligned16(weight);
    TK_FOR_EACH_WARP_ROW(row, rows) {
        const T* xr = x + row * c64;
        const T* dr = dout + row * c64;
        T* dxr = dx + row * c64;
        const float r = rstd[row];
        float acc[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], dv[8], wv[8];
            load8(xv, xr, i, c, vec);
            load8(dv, dr, i, c, vec);
            load8(wv, weight, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if (!vec && i + m >= c) break;  // past the row's end: no term, as on the CPU
                acc[m] += wv[m] * dv[m] * xv[m];
            }
        }
        const float k = warp_row_sum(acc) / (float)c * r * r;
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], dv[8], wv[8], o[8];
            load8(xv, xr, i, c, vec);
            load8(dv, dr, i, c, vec);
            load8(wv, weight, i, c, vec);
            load8(o, dxr, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) o[m] = o[m] + r * (wv[m] * dv[m] - xv[m] * k);
            store8(dxr, i, c, vec, o);
        }
    }
}

// partial[blk, col] = sum over the block's rows of x * rstd * dout, rows in order
// (common.cuh's tk_column_partials).
template <typename T, bool VEC>
__device__ void rmsnorm_params_blocks(float* partial, const T* __restrict__ dout,
                                      const T* __restrict__ x, const float* __restrict__ rstd,
                                      i64 rows, int c) {
    tk_column_partials<1, VEC>(partial, rows, c, [=](float (&acc)[1][8], i64 r, int col) {
        float xv[8], dv[8];
        load8(xv, x + r * c, col, c, VEC);
        load8(dv, dout + r * c, col, c, VEC);
        const float rs = rstd[r];
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[0][m] += xv[m] * rs * dv[m];
    });
}

template <typename T>
__device__ void rmsnorm_backward_params_impl(float* partial, const T* dout, const T* x,
                                             const float* rstd, i64 rows, i64 c) {
    if (c % 8 == 0 && aligned16(dout) && aligned16(x) && aligned16(partial)) {
        rmsnorm_params_blocks<T, true>(partial, dout, x, rstd, rows, (int)c);
    } else {
        rmsnorm_params_blocks<T, false>(partial, dout, x, rstd, rows, (int)c);
    }
}

// dweight += partial[0], partial[1], ..., in block order (common.cuh's `tk_column_total`).
template <typename G>
__device__ void rmsnorm_backward_params_finish_impl(G* dweight, const float* partial,
                                                    i64 blocks, i64 c) {
    TK_FOR_EACH_COLUMN_TOTAL(g, c) {
        const i64 col = 32 * g + (threadIdx.x & 31);
        const float start = col < c ? load(dweight, col) : 0.0f;
        const float total = tk_column_total(partial, blocks, c, g, start);
        if (threadIdx.x < 32 && col < c) store(dweight, col, total);
    }
}

#define TK_RMSNORM(T, N)                                                                    \
    extern "C" __global__ void rmsnorm_##N(T* out, float* rstd, const T* x, const T* weight,\
                                           i64 rows, i64 c, float eps) {                    \
        rmsnorm_impl<T>(out, rstd, x, weight, rows, c, eps);                                \
    }                                                                                       \
    extern "C" __global__ void rmsnorm_backward_dx_##N(T* dx, const T* dout, const T* x,    \
                                                       const T* weight, const float* rstd,  \
                                                       i64 rows, i64 c) {                   \
        rmsnorm_backward_dx_impl<T>(dx, dout, x, weight, rstd, rows, c);                    \
    }                                                                                       \
    extern "C" __global__ void rmsnorm_backward_params_##N(                                 \
        float* partial, const T* dout, const T* x, const float* rstd, i64 rows, i64 c) {    \
        rmsnorm_backward_params_impl<T>(partial, dout, x, rstd, rows, c);                   \
    }                                                                                       \
    extern "C" __global__ void rmsnorm_backward_params_finish_##N(                          \
        T* dweight, const float* partial, i64 blocks, i64 c) {                              \
        rmsnorm_backward_params_finish_impl<T>(dweight, partial, blocks, c);                \
    }
TK_DTYPES(TK_RMSNORM)
