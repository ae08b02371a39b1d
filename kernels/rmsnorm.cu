// RMS normalization over the last dimension (Llama's norm), statistics in f32.
// CPU twin: src/ops/rmsnorm/cpu.rs.
//
// Layouts: x, out, dout, dx are [rows, C]; weight and dweight have C elements; rstd is
// [rows] f32.
//
// Row sums run on a half-warp per row (16 lanes, the CPU's lane order), so rstd, the
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

// dx += rstd * (w·dy − x · k), k = mean(w·dy·x) · rstd².
template <typename T>
__device__ void rmsnorm_backward_dx_impl(T* dx, const T* dout, const T* x, const T* weight,
                                         const float* rstd, i64 rows, i64 c) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * c;
        const float r = rstd[row];
        float acc = 0.0f;
#pragma unroll 4
        for (int i = lane; i < (int)c; i += TK_LANES) {
            acc += load(weight, i) * load(dout, base + i) * load(x, base + i);
        }
        // The CPU sums its 16 accumulators with `simd::sum`, which starts from 0.
        const float k = half_sum(0.0f + acc) / (float)c * r * r;
#pragma unroll 4
        for (int i = lane; i < (int)c; i += TK_LANES) {
            float g = r * (load(weight, i) * load(dout, base + i) - load(x, base + i) * k);
            store(dx, base + i, load(dx, base + i) + g);
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
        for (i64 blk = 0; blk < blocks; ++blk) dw += partial[blk * c + col];
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
