// Layer normalization over the last dimension, statistics in f32.
// CPU twin: src/ops/layernorm/cpu.rs.
//
// Layouts: x, out, dout, dx are [rows, C]; weight, bias, dweight, dbias have C elements;
// stats is [rows, 2] f32 = (mean, rstd).
//
// Row statistics and the input gradient run on a warp per row (256 slots, the CPU's slot
// order; 16-byte loads where the row allows), so mean, rstd, the
// output and dx are bitwise equal to the CPU's. The parameter gradients are common.cuh's
// column sums in two passes: `layernorm_backward_params_*` writes the partial sums of
// each block of TK_GRAD_ROW_BLOCK rows to an f32 workspace [blocks, 2, C], and
// `layernorm_backward_params_finish_*` adds them to dweight and dbias in block order,
// rounding once: the CPU's order, so bitwise equal too.

// out = (x - mean) * rstd * weight + bias; stats[row] = (mean, rstd). A warp per row
// (common.cuh's warp rows): the two sums in the CPU's slot order, the row read in 16-byte
// loads (its second and third readings mostly from L1).
template <typename T>
__device__ void layernorm_impl(T* __restrict__ out, float* __restrict__ stats,
                               const T* __restrict__ x, const T* __restrict__ weight,
                               const T* __restrict__ bias, i64 rows, i64 c64, float eps) {
    const int c = (int)c64;
    const int lane = threadIdx.x & 31;
    const bool vec = c % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(weight) &&
                     aligned16(bias);
    TK_FOR_EACH_WARP_ROW(row, rows) {
        const T* xr = x + row * c64;
        T* orow = out + row * c64;
        const float mean = warp_row_reduce(xr, c, vec, [](float v) { return v; }) / (float)c;
        const float var = warp_row_reduce(xr, c, vec, [mean](float v) {
                              const float d = v - mean;
                              return d * d;
                          }) /
                          (float)c;
        const float rstd = 1.0f / sqrtf(var + eps);
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], wv[8], bv[8], o[8];
            load8(xv, xr, i, c, vec);
            load8(wv, weight, i, c, vec);
            load8(bv, bias, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) o[m] = (xv[m] - mean) * rstd * wv[m] + bv[m];
            store8(orow, i, c, vec, o);
        }
        if (lane == 0) {
            stats[2 * row] = mean;
            stats[2 * row + 1] = rstd;
        }
    }
}

// dx += rstd * (dn - mean(dn) - norm * mean(dn * norm)), dn = weight * dout,
// norm = (x - mean) * rstd. A warp per row (common.cuh's warp rows): the two sums in the
// CPU's slot order, the row read in 16-byte loads (its second reading mostly from L1).
template <typename T>
__device__ void layernorm_backward_dx_impl(T* __restrict__ dx, const T* __restrict__ dout,
                                           const T* __restrict__ x,
                                           const T* __restrict__ weight,
                                           const float* __restrict__ stats, i64 rows, i64 c64) {
    const int c = (int)c64;
    const int lane = threadIdx.x & 31;
    const bool vec = c % 8 == 0 && aligned16(dx) && aligned16(dout) && aligned16(x) &&
                     aligned16(weight);
    TK_FOR_EACH_WARP_ROW(row, rows) {
        const T* xr = x + row * c64;
        const T* dr = dout + row * c64;
        T* dxr = dx + row * c64;
        const float mean = stats[2 * row], rstd = stats[2 * row + 1];
        float acc_dn[8], acc_dnn[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) acc_dn[m] = acc_dnn[m] = 0.0f;
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], dv[8], wv[8];
            load8(xv, xr, i, c, vec);
            load8(dv, dr, i, c, vec);
            load8(wv, weight, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if (!vec && i + m >= c) break;  // past the row's end: no term, as on the CPU
                const float norm = (xv[m] - mean) * rstd;
                const float dn = wv[m] * dv[m];
                acc_dn[m] += dn;
                acc_dnn[m] += dn * norm;
            }
        }
        const float mean_dn = warp_row_sum(acc_dn) / (float)c;
        const float mean_dn_n = warp_row_sum(acc_dnn) / (float)c;
#pragma unroll 2
        for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
            float xv[8], dv[8], wv[8], o[8];
            load8(xv, xr, i, c, vec);
            load8(dv, dr, i, c, vec);
            load8(wv, weight, i, c, vec);
            load8(o, dxr, i, c, vec);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const float norm = (xv[m] - mean) * rstd;
                const float dn = wv[m] * dv[m];
                o[m] = o[m] + rstd * (dn - mean_dn - norm * mean_dn_n);
            }
            store8(dxr, i, c, vec, o);
        }
    }
}

// partial[blk, 0, col] = sum over the block's rows of norm * dout, partial[blk, 1, col] =
// sum of dout, rows in order (common.cuh's tk_column_partials).
template <typename T, bool VEC>
__device__ void layernorm_params_blocks(float* partial, const T* __restrict__ dout,
                                        const T* __restrict__ x,
                                        const float* __restrict__ stats, i64 rows, int c) {
    tk_column_partials<2, VEC>(partial, rows, c, [=](float (&acc)[2][8], i64 r, int col) {
        float xv[8], dv[8];
        load8(xv, x + r * c, col, c, VEC);
        load8(dv, dout + r * c, col, c, VEC);
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float norm = (xv[m] - mean) * rstd;
            acc[0][m] += norm * dv[m];
            acc[1][m] += dv[m];
        }
    });
}

template <typename T>
__device__ void layernorm_backward_params_impl(float* partial, const T* dout, const T* x,
                                               const float* stats, i64 rows, i64 c) {
    if (c % 8 == 0 && aligned16(dout) && aligned16(x) && aligned16(partial)) {
        layernorm_params_blocks<T, true>(partial, dout, x, stats, rows, (int)c);
    } else {
        layernorm_params_blocks<T, false>(partial, dout, x, stats, rows, (int)c);
    }
}

// dweight += partial[0, 0], partial[1, 0], ... and dbias likewise, in block order: the
// workspace's [blocks, 2·C] columns totalled by common.cuh's `tk_column_total`.
template <typename G>
__device__ void layernorm_backward_params_finish_impl(G* dweight, G* dbias,
                                                      const float* partial, i64 blocks,
                                                      i64 c) {
    TK_FOR_EACH_COLUMN_TOTAL(g, 2 * c) {
        const i64 col = 32 * g + (threadIdx.x & 31);
        G* out = col < c ? dweight + col : dbias + (col - c);
        const float start = col < 2 * c ? load(out, 0) : 0.0f;
        const float total = tk_column_total(partial, blocks, 2 * c, g, start);
        if (threadIdx.x < 32 && col < 2 * c) store(out, 0, total);
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
