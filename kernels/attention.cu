// Causal multi-head attention in three materialized steps: scores, softmax, values.
// CPU twin: src/device/cpu/attention.rs. A first, simple version; the fused kernel that
// never materializes [B, H, T, T] comes later.
//
// Layouts: qkv is [B, T, 3C]: columns [0, C) hold q, [C, 2C) k, [2C, 3C) v, and head h
// owns columns h·hs .. (h+1)·hs of each block (hs = C / H). out and dout are [B, T, C].
// Scores, probabilities and their gradients are [B, H, T, T], zero above the diagonal.
//
// The products (scores, values and their gradients) are dot products in f32 with fused
// multiply-adds, in index order; the CPU's come from the `gemm` crate, whose order
// differs, so they agree to f32 rounding, not bitwise. Sums run over the causal range
// only (j <= i), where the CPU multiplies whole row blocks by the zeros above the
// diagonal. The softmax and its backward run on a half-warp per row in the CPU's lane
// order and are bitwise equal to the CPU's.

// scores[b, h, i, j] = scale · q_i · k_j for j <= i, else 0. `scale` is 1/sqrt(hs),
// computed on the host as the CPU does.
template <typename T>
__device__ void attention_scores_impl(T* scores, const T* qkv, i64 batch, i64 t_len, i64 c,
                                      i64 n_head, float scale) {
    const i64 hs = c / n_head, c3 = 3 * c;
    TK_FOR_EACH(idx, batch * n_head * t_len * t_len) {
        const i64 j = idx % t_len, i = (idx / t_len) % t_len, bh = idx / (t_len * t_len);
        const i64 b = bh / n_head, h = bh % n_head;
        float acc = 0.0f;
        if (j <= i) {
            const i64 q = (b * t_len + i) * c3 + h * hs;
            const i64 k = (b * t_len + j) * c3 + c + h * hs;
            for (i64 d = 0; d < hs; ++d) acc = fmaf(load(qkv, q + d), load(qkv, k + d), acc);
            acc = scale * acc;
        }
        store(scores, idx, acc);
    }
}

// Overwrites the q and k blocks of dqkv (the v block is left as it is):
// dq_i = scale · Σ_{j <= i} dscores[i, j] · k_j,  dk_j = scale · Σ_{i >= j} dscores[i, j] · q_i.
// Entries of dscores above the diagonal are never read.
template <typename T>
__device__ void attention_scores_backward_impl(T* dqkv, const T* dscores, const T* qkv,
                                               i64 batch, i64 t_len, i64 c, i64 n_head,
                                               float scale) {
    const i64 hs = c / n_head, c3 = 3 * c, c2 = 2 * c;
    TK_FOR_EACH(idx, batch * t_len * c2) {
        const i64 col = idx % c2, t = (idx / c2) % t_len, b = idx / (c2 * t_len);
        const bool is_k = col >= c;
        const i64 cc = is_k ? col - c : col;
        const i64 h = cc / hs;
        const T* ds = dscores + (b * n_head + h) * t_len * t_len;
        float acc = 0.0f;
        if (!is_k) {
            // dq[t] over keys j <= t.
            const i64 k = b * t_len * c3 + c + cc;
            for (i64 j = 0; j <= t; ++j) acc = fmaf(load(ds, t * t_len + j), load(qkv, k + j * c3), acc);
        } else {
            // dk[t] over queries i >= t.
            const i64 q = b * t_len * c3 + cc;
            for (i64 i = t; i < t_len; ++i) acc = fmaf(load(ds, i * t_len + t), load(qkv, q + i * c3), acc);
        }
        store(dqkv, (b * t_len + t) * c3 + col, scale * acc);
    }
}

// Row softmax over j <= i (rows of B·H·T, each T wide); 0 above the diagonal.
// probs[i, j] = exp(s_j − max) · (1 / Σ exp(s − max)), rounded once.
template <typename T>
__device__ void softmax_causal_impl(T* probs, const T* scores, i64 rows, i64 t_len) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * t_len, i = row % t_len;
        float m = TK_NEG_INF;
        for (i64 j = lane; j <= i; j += TK_LANES) {
            float v = load(scores, base + j);
            m = v > m ? v : m;
        }
        const float max = half_max(m);
        float acc = 0.0f;
        for (i64 j = lane; j <= i; j += TK_LANES) acc += tk_exp(load(scores, base + j) - max);
        const float inv = 1.0f / half_sum(acc);
        for (i64 j = lane; j < t_len; j += TK_LANES) {
            float p = j <= i ? tk_exp(load(scores, base + j) - max) * inv : 0.0f;
            store(probs, base + j, p);
        }
    }
}

// dscores = probs · (dprobs − Σ_j probs · dprobs) on j <= i, 0 above.
template <typename T>
__device__ void softmax_causal_backward_impl(T* dscores, const T* dprobs, const T* probs,
                                             i64 rows, i64 t_len) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * t_len, i = row % t_len;
        float acc = 0.0f;
        for (i64 j = lane; j <= i; j += TK_LANES) acc += load(probs, base + j) * load(dprobs, base + j);
        const float dot = half_sum(acc);
        for (i64 j = lane; j < t_len; j += TK_LANES) {
            float v = j <= i ? load(probs, base + j) * (load(dprobs, base + j) - dot) : 0.0f;
            store(dscores, base + j, v);
        }
    }
}

// out[b, t, h·hs + d] = Σ_{j <= t} probs[b, h, t, j] · v[b, j, h·hs + d].
template <typename T>
__device__ void attention_values_impl(T* out, const T* probs, const T* qkv, i64 batch,
                                      i64 t_len, i64 c, i64 n_head) {
    const i64 hs = c / n_head, c3 = 3 * c;
    TK_FOR_EACH(idx, batch * t_len * c) {
        const i64 col = idx % c, t = (idx / c) % t_len, b = idx / (c * t_len);
        const i64 h = col / hs;
        const T* p = probs + ((b * n_head + h) * t_len + t) * t_len;
        const i64 v = b * t_len * c3 + 2 * c + col;
        float acc = 0.0f;
        for (i64 j = 0; j <= t; ++j) acc = fmaf(load(p, j), load(qkv, v + j * c3), acc);
        store(out, idx, acc);
    }
}

// dprobs[b, h, i, j] = dout_i · v_j (head h) for j <= i, 0 above.
template <typename T>
__device__ void attention_values_backward_dprobs_impl(T* dprobs, const T* dout, const T* qkv,
                                                      i64 batch, i64 t_len, i64 c,
                                                      i64 n_head) {
    const i64 hs = c / n_head, c3 = 3 * c;
    TK_FOR_EACH(idx, batch * n_head * t_len * t_len) {
        const i64 j = idx % t_len, i = (idx / t_len) % t_len, bh = idx / (t_len * t_len);
        const i64 b = bh / n_head, h = bh % n_head;
        float acc = 0.0f;
        if (j <= i) {
            const i64 g = (b * t_len + i) * c + h * hs;
            const i64 v = (b * t_len + j) * c3 + 2 * c + h * hs;
            for (i64 d = 0; d < hs; ++d) acc = fmaf(load(dout, g + d), load(qkv, v + d), acc);
        }
        store(dprobs, idx, acc);
    }
}

// Overwrites the v block of dqkv (q and k are left as they are):
// dv_j = Σ_{i >= j} probs[i, j] · dout_i.
template <typename T>
__device__ void attention_values_backward_dv_impl(T* dqkv, const T* dout, const T* probs,
                                                  i64 batch, i64 t_len, i64 c, i64 n_head) {
    const i64 hs = c / n_head, c3 = 3 * c;
    TK_FOR_EACH(idx, batch * t_len * c) {
        const i64 col = idx % c, j = (idx / c) % t_len, b = idx / (c * t_len);
        const i64 h = col / hs;
        const T* p = probs + (b * n_head + h) * t_len * t_len;
        const i64 g = b * t_len * c + col;
        float acc = 0.0f;
        for (i64 i = j; i < t_len; ++i) acc = fmaf(load(p, i * t_len + j), load(dout, g + i * c), acc);
        store(dqkv, (b * t_len + j) * c3 + 2 * c + col, acc);
    }
}

#define TK_ATTENTION(T, N)                                                                  \
    extern "C" __global__ void attention_scores_##N(T* scores, const T* qkv, i64 batch,     \
                                                    i64 t_len, i64 c, i64 n_head,           \
                                                    float scale) {                          \
        attention_scores_impl<T>(scores, qkv, batch, t_len, c, n_head, scale);              \
    }                                                                                       \
    extern "C" __global__ void attention_scores_backward_##N(                               \
        T* dqkv, const T* dscores, const T* qkv, i64 batch, i64 t_len, i64 c, i64 n_head,   \
        float scale) {                                                                      \
        attention_scores_backward_impl<T>(dqkv, dscores, qkv, batch, t_len, c, n_head,      \
                                          scale);                                           \
    }                                                                                       \
    extern "C" __global__ void softmax_causal_##N(T* probs, const T* scores, i64 rows,      \
                                                  i64 t_len) {                              \
        softmax_causal_impl<T>(probs, scores, rows, t_len);                                 \
    }                                                                                       \
    extern "C" __global__ void softmax_causal_backward_##N(                                 \
        T* dscores, const T* dprobs, const T* probs, i64 rows, i64 t_len) {                 \
        softmax_causal_backward_impl<T>(dscores, dprobs, probs, rows, t_len);               \
    }                                                                                       \
    extern "C" __global__ void attention_values_##N(T* out, const T* probs, const T* qkv,   \
                                                    i64 batch, i64 t_len, i64 c,            \
                                                    i64 n_head) {                           \
        attention_values_impl<T>(out, probs, qkv, batch, t_len, c, n_head);                 \
    }                                                                                       \
    extern "C" __global__ void attention_values_backward_dprobs_##N(                        \
        T* dprobs, const T* dout, const T* qkv, i64 batch, i64 t_len, i64 c, i64 n_head) {  \
        attention_values_backward_dprobs_impl<T>(dprobs, dout, qkv, batch, t_len, c,        \
                                                 n_head);                                   \
    }                                                                                       \
    extern "C" __global__ void attention_values_backward_dv_##N(                            \
        T* dqkv, const T* dout, const T* probs, i64 batch, i64 t_len, i64 c, i64 n_head) {  \
        attention_values_backward_dv_impl<T>(dqkv, dout, probs, batch, t_len, c, n_head);   \
    }
TK_DTYPES(TK_ATTENTION)
