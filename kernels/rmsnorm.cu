// RMS normalization over the last dimension (Llama's norm), statistics in f32.
// CPU twin: src/ops/rmsnorm/cpu.rs.
//
// Layouts: x, out, dout, dx are [rows, C]; weight and dweight have C elements; rstd is
// [rows] f32.
//
// The forward's row sums run on a half-warp per row (16 lanes, the CPU's lane order) and
// the input gradient's on a warp per row (256 slots, the CPU's slot order), so rstd, the
// output and dx are bitwise equal to the CPU's. The weight gradient is summed in two
// passes without atomics: `rmsnorm_backward_params_*` writes the partial sums of each
// block of TK_RMS_ROW_BLOCK rows (the CPU's ROW_BLOCK) to an f32 workspace [blocks, C], and
// `rmsnorm_backward_params_finish_*` adds them to dweight in block order, rounding once:
// the CPU's order, so bitwise equal too.

#define TK_RMS_ROW_BLOCK 128

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x²) + eps); rstd[row] kept.
template <typename T>
__device__ void rmsnorm_impl(T* out, float* rstd_out, const T* x, const T* weight, i64 rows,
                             i64 c, float eps) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * c;
        float acc = 0.0f;
        for (i64 i = lane; i < c; i += TK_LANES) {
            float v = load(x, base + i);
            acc += v * v;
        }
        const float rstd = 1.0f / sqrtf(half_sum(acc) / (float)c + eps);
        for (i64 i = lane; i < c; i += TK_LANES) {
            store(out, base + i, load(x, base + i) * rstd * load(weight, i));
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

// Adds rows [0, n) of one column (x and dout from `xp` and `dp`, row stride c) to dw, in
// row order, unrolled so that many rows' loads are in flight; the sum keeps its order.
template <typename T, int UNROLL>
__device__ __forceinline__ void rmsnorm_params_rows(float& dw, const T* xp, const T* dp,
                                                    const float* rp, int n, i64 c) {
#pragma unroll UNROLL
    for (int r = 0; r < n; ++r) dw += load(xp, r * c) * rp[r] * load(dp, r * c);
}

// partial[blk, col] = sum over the block's rows of x * rstd * dout, rows in order.
template <typename T>
__device__ void rmsnorm_backward_params_impl(float* partial, const T* dout, const T* x,
                                             const float* rstd, i64 rows, i64 c) {
    const i64 blocks = (rows + TK_RMS_ROW_BLOCK - 1) / TK_RMS_ROW_BLOCK;
    TK_FOR_EACH(i, blocks * c) {
        const i64 blk = i / c, col = i % c, r0 = blk * TK_RMS_ROW_BLOCK;
        const int n = (int)(min(rows, r0 + TK_RMS_ROW_BLOCK) - r0);
        const T* xp = x + r0 * c + col;
        const T* dp = dout + r0 * c + col;
        const float* rp = rstd + r0;
        float dw = 0.0f;
        if (n == TK_RMS_ROW_BLOCK) {
            rmsnorm_params_rows<T, 16>(dw, xp, dp, rp, TK_RMS_ROW_BLOCK, c);
        } else {
            rmsnorm_params_rows<T, 1>(dw, xp, dp, rp, n, c);
        }
        partial[blk * c + col] = dw;
    }
}

// dweight += partial[0], partial[1], ..., in block order.
template <typename G>
__device__ void rmsnorm_backward_params_finish_impl(G* dweight, const float* partial,
                                                    i64 blocks, i64 c) {
    TK_FOR_EACH(col, c) {
        float dw = load(dweight, col);
        const float* p = partial + col;
        // Unrolled so that many blocks' loads are in flight; the sum keeps its order.
#pragma unroll 8
        for (int blk = 0; blk < (int)blocks; ++blk) dw += p[(i64)blk * c];
        store(dweight, col, dw);
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
