// Per-head RMS normalization of the queries and keys inside the fused q/k/v projection
// (Qwen3's q_norm and k_norm), statistics in f32. CPU twin: src/ops/qk_norm/cpu.rs.
//
// Layouts: qkv, out, dout, dx are [tokens, (H + 2·KV)·D]: per token H query heads, KV key
// heads, KV value heads of D values each. A "head row" is one head of one token; rows
// 0 .. tokens·(H + KV) are the query and key heads in token order (rstd is [tokens, H + KV]
// f32), the value heads are copied (their gradient passes through). wq and wk have D
// elements each.
//
// Each head row runs on a half-warp (16 lanes, the CPU's lane order) as rmsnorm.cu's rows,
// so rstd, the output and dx are bitwise equal to the CPU's. A gain's gradient is summed
// over its group's rows (queries: tokens·H rows, t·H + j; keys: tokens·KV rows) per block
// of TK_GRAD_ROW_BLOCK rows into an f32 workspace [blocks, D], then added block after block
// by rmsnorm.cu's `rmsnorm_backward_params_finish_*` (the same second pass).

// Offset of head `j` of token `t`.
__device__ __forceinline__ i64 qk_base(i64 t, i64 j, i64 heads_total, i64 d) {
    return (t * heads_total + j) * d;
}

// out = qkv with every query and key head normalised by its gain; value heads copied.
template <typename T>
__device__ void qk_norm_impl(T* out, float* rstd_out, const T* qkv, const T* wq, const T* wk,
                             i64 tokens, i64 h, i64 kv, i64 d, float eps) {
    const int lane = lane16();
    const i64 qk = h + kv, total = h + 2 * kv;
    TK_FOR_EACH_ROW(row, tokens * total) {
        const i64 t = row / total, j = row % total;
        const i64 base = qk_base(t, j, total, d);
        if (j >= qk) {
            for (i64 i = lane; i < d; i += TK_LANES) store(out, base + i, load(qkv, base + i));
            continue;
        }
        const T* w = j < h ? wq : wk;
        float acc = 0.0f;
        for (i64 i = lane; i < d; i += TK_LANES) {
            float v = load(qkv, base + i);
            acc += v * v;
        }
        const float rstd = 1.0f / sqrtf(half_sum(acc) / (float)d + eps);
        for (i64 i = lane; i < d; i += TK_LANES) {
            store(out, base + i, load(qkv, base + i) * rstd * load(w, i));
        }
        if (lane == 0) rstd_out[t * qk + j] = rstd;
    }
}

// dx += rstd·(w·dy − x·k), k = mean(w·dy·x)·rstd², for query and key heads; dx += dy for
// value heads.
template <typename T>
__device__ void qk_norm_backward_dx_impl(T* dx, const T* dout, const T* qkv, const T* wq,
                                         const T* wk, const float* rstd, i64 tokens, i64 h,
                                         i64 kv, i64 d) {
    const int lane = lane16();
    const i64 qk = h + kv, total = h + 2 * kv;
    TK_FOR_EACH_ROW(row, tokens * total) {
        const i64 t = row / total, j = row % total;
        const i64 base = qk_base(t, j, total, d);
        if (j >= qk) {
            for (i64 i = lane; i < d; i += TK_LANES) {
                store(dx, base + i, load(dx, base + i) + load(dout, base + i));
            }
            continue;
        }
        const T* w = j < h ? wq : wk;
        const float r = rstd[t * qk + j];
        float acc = 0.0f;
        for (i64 i = lane; i < d; i += TK_LANES) {
            acc += load(w, i) * load(dout, base + i) * load(qkv, base + i);
        }
        const float k = half_sum(0.0f + acc) / (float)d * r * r;
        for (i64 i = lane; i < d; i += TK_LANES) {
            float g = r * (load(w, i) * load(dout, base + i) - load(qkv, base + i) * k);
            store(dx, base + i, load(dx, base + i) + g);
        }
    }
}

// partial[blk, col] = Σ over the block's rows of the group (heads first .. first + n) of
// x·rstd·dout, rows r = t·n + (j − first) in order.
template <typename T>
__device__ void qk_norm_backward_params_impl(float* partial, const T* dout, const T* qkv,
                                             const float* rstd, i64 tokens, i64 h, i64 kv,
                                             i64 d, i64 first, i64 n) {
    const i64 qk = h + kv, total = h + 2 * kv, rows = tokens * n;
    const i64 blocks = (rows + TK_GRAD_ROW_BLOCK - 1) / TK_GRAD_ROW_BLOCK;
    TK_FOR_EACH(i, blocks * d) {
        const i64 blk = i / d, col = i % d;
        const i64 end = min(rows, (blk + 1) * TK_GRAD_ROW_BLOCK);
        float dw = 0.0f;
        for (i64 r = blk * TK_GRAD_ROW_BLOCK; r < end; ++r) {
            const i64 t = r / n, j = first + r % n;
            const i64 at = qk_base(t, j, total, d) + col;
            dw += load(qkv, at) * rstd[t * qk + j] * load(dout, at);
        }
        partial[blk * d + col] = dw;
    }
}

#define TK_QK_NORM(T, N)                                                                    \
    extern "C" __global__ void qk_norm_##N(T* out, float* rstd, const T* qkv, const T* wq,  \
                                           const T* wk, i64 tokens, i64 h, i64 kv, i64 d,   \
                                           float eps) {                                     \
        qk_norm_impl<T>(out, rstd, qkv, wq, wk, tokens, h, kv, d, eps);                     \
    }                                                                                       \
    extern "C" __global__ void qk_norm_backward_dx_##N(T* dx, const T* dout, const T* qkv,  \
                                                       const T* wq, const T* wk,            \
                                                       const float* rstd, i64 tokens, i64 h,\
                                                       i64 kv, i64 d) {                     \
        qk_norm_backward_dx_impl<T>(dx, dout, qkv, wq, wk, rstd, tokens, h, kv, d);         \
    }                                                                                       \
    extern "C" __global__ void qk_norm_backward_params_##N(                                 \
        float* partial, const T* dout, const T* qkv, const float* rstd, i64 tokens, i64 h,  \
        i64 kv, i64 d, i64 first, i64 n) {                                                  \
        qk_norm_backward_params_impl<T>(partial, dout, qkv, rstd, tokens, h, kv, d, first,  \
                                        n);                                                 \
    }
TK_DTYPES(TK_QK_NORM)
