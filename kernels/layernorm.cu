// Layer normalization over the last dimension, statistics in f32.
// CPU twin: src/ops/layernorm/cpu.rs.
//
// Layouts: x, out, dout, dx are [rows, C]; weight, bias, dweight, dbias have C elements;
// stats is [rows, 2] f32 = (mean, rstd).
//
// Row statistics run on a half-warp per row (16 lanes, the CPU's lane order), so mean,
// rstd and the output are bitwise equal to the CPU's. The parameter gradients are summed
// in two passes without atomics: `layernorm_backward_params_*` writes the partial sums of
// each block of TK_LN_ROW_BLOCK rows (the CPU's ROW_BLOCK) to an f32 workspace
// [blocks, 2, C], and `layernorm_backward_params_finish_*` adds them to dweight and dbias
// in block order, rounding once: the CPU's order, so bitwise equal too.

#define TK_LN_ROW_BLOCK 128

// out = (x - mean) * rstd * weight + bias; stats[row] = (mean, rstd).
template <typename T>
__device__ void layernorm_impl(T* out, float* stats, const T* x, const T* weight,
                               const T* bias, i64 rows, i64 c, float eps) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * c;
        float acc = 0.0f;
        for (i64 i = lane; i < c; i += TK_LANES) acc += load(x, base + i);
        const float mean = half_sum(acc) / (float)c;
        acc = 0.0f;
        for (i64 i = lane; i < c; i += TK_LANES) {
            float d = load(x, base + i) - mean;
            acc += d * d;
        }
        const float var = half_sum(acc) / (float)c;
        const float rstd = 1.0f / sqrtf(var + eps);
        for (i64 i = lane; i < c; i += TK_LANES) {
            float v = (load(x, base + i) - mean) * rstd * load(weight, i) + load(bias, i);
            store(out, base + i, v);
        }
        if (lane == 0) {
            stats[2 * row] = mean;
            stats[2 * row + 1] = rstd;
        }
    }
}

// dx += rstd * (dn - mean(dn) - norm * mean(dn * norm)), dn = weight * dout,
// norm = (x - mean) * rstd.
template <typename T>
__device__ void layernorm_backward_dx_impl(T* dx, const T* dout, const T* x, const T* weight,
                                           const float* stats, i64 rows, i64 c) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * c;
        const float mean = stats[2 * row], rstd = stats[2 * row + 1];
        float acc_dn = 0.0f, acc_dnn = 0.0f;
#pragma unroll 4
        for (int i = lane; i < (int)c; i += TK_LANES) {
            float norm = (load(x, base + i) - mean) * rstd;
            float dn = load(weight, i) * load(dout, base + i);
            acc_dn += dn;
            acc_dnn += dn * norm;
        }
        // The CPU sums its 16 accumulators with `simd::sum`, which starts from 0.
        const float mean_dn = half_sum(0.0f + acc_dn) / (float)c;
        const float mean_dn_n = half_sum(0.0f + acc_dnn) / (float)c;
#pragma unroll 4
        for (int i = lane; i < (int)c; i += TK_LANES) {
            float norm = (load(x, base + i) - mean) * rstd;
            float dn = load(weight, i) * load(dout, base + i);
            store(dx, base + i, load(dx, base + i) + rstd * (dn - mean_dn - norm * mean_dn_n));
        }
    }
}

// Adds rows [0, n) of one column (x and dout from `xp` and `dp`, row stride c; stats from
// `sp`) to dw (norm * dout) and db (dout), in row order. The loop is unrolled so that the
// loads of many rows are in flight at once; the sums keep their order.
template <typename T, int UNROLL>
__device__ __forceinline__ void layernorm_params_rows(float& dw, float& db, const T* xp,
                                                      const T* dp, const float* sp, int n,
                                                      i64 c) {
#pragma unroll UNROLL
    for (int r = 0; r < n; ++r) {
        const float norm = (load(xp, r * c) - sp[2 * r]) * sp[2 * r + 1];
        const float d = load(dp, r * c);
        dw += norm * d;
        db += d;
    }
}

// partial[blk, 0, col] = sum over the block's rows of norm * dout, partial[blk, 1, col] =
// sum of dout, rows in order.
template <typename T>
__device__ void layernorm_backward_params_impl(float* partial, const T* dout, const T* x,
                                               const float* stats, i64 rows, i64 c) {
    const i64 blocks = (rows + TK_LN_ROW_BLOCK - 1) / TK_LN_ROW_BLOCK;
    TK_FOR_EACH(i, blocks * c) {
        const i64 blk = i / c, col = i % c, r0 = blk * TK_LN_ROW_BLOCK;
        const int n = (int)(min(rows, r0 + TK_LN_ROW_BLOCK) - r0);
        const T* xp = x + r0 * c + col;
        const T* dp = dout + r0 * c + col;
        const float* sp = stats + 2 * r0;
        float dw = 0.0f, db = 0.0f;
        if (n == TK_LN_ROW_BLOCK) {
            layernorm_params_rows<T, 16>(dw, db, xp, dp, sp, TK_LN_ROW_BLOCK, c);
        } else {
            layernorm_params_rows<T, 1>(dw, db, xp, dp, sp, n, c);
        }
        partial[(2 * blk) * c + col] = dw;
        partial[(2 * blk + 1) * c + col] = db;
    }
}

// dweight += partial[0, 0], partial[1, 0], ... and dbias likewise, in block order.
template <typename G>
__device__ void layernorm_backward_params_finish_impl(G* dweight, G* dbias,
                                                      const float* partial, i64 blocks,
                                                      i64 c) {
    TK_FOR_EACH(col, c) {
        float dw = load(dweight, col), db = load(dbias, col);
        for (i64 blk = 0; blk < blocks; ++blk) {
            dw += partial[(2 * blk) * c + col];
            db += partial[(2 * blk + 1) * c + col];
        }
        store(dweight, col, dw);
        store(dbias, col, db);
    }
}

#define TK_LAYERNORM(T, N)                                                                  \
    extern "C" __global__ void layernorm_##N(T* out, float* stats, const T* x,              \
                                             const T* weight, const T* bias, i64 rows,      \
                                             i64 c, float eps) {                            \
        layernorm_impl<T>(out, stats, x, weight, bias, rows, c, eps);                       \
    }                                                                                       \
    extern "C" __global__ void layernorm_backward_dx_##N(T* dx, const T* dout, const T* x,  \
                                                         const T* weight,                   \
                                                         const float* stats, i64 rows,      \
                                                         i64 c) {                           \
        layernorm_backward_dx_impl<T>(dx, dout, x, weight, stats, rows, c);                 \
    }                                                                                       \
    extern "C" __global__ void layernorm_backward_params_##N(                               \
        float* partial, const T* dout, const T* x, const float* stats, i64 rows, i64 c) {   \
        layernorm_backward_params_impl<T>(partial, dout, x, stats, rows, c);                \
    }                                                                                       \
    extern "C" __global__ void layernorm_backward_params_finish_##N(                        \
        T* dweight, T* dbias, const float* partial, i64 blocks, i64 c) {                    \
        layernorm_backward_params_finish_impl<T>(dweight, dbias, partial, blocks, c);       \
    }
TK_DTYPES(TK_LAYERNORM)
