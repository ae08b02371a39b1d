// Causal attention in three materialized steps: scores, softmax, values.
// CPU twin: src/ops/attention/cpu.rs. The fused kernels that never materialize
// [B, H, T, T] are a separate family, flash_attention.cu.
//
// Layouts (trainkit::device::Heads): qkv is [B, T, W] with W = (H + 2·KV)·D: columns
// [0, H·D) hold the queries, [H·D, (H+KV)·D) the keys, the rest the values, head after
// head, D wide each; query head h reads key and value head h / (H / KV). out and dout are
// [B, T, H·D]. Scores, probabilities and their gradients are [B, H, T, T], zero above the
// diagonal.
//
// The products (scores, values and their gradients) are dot products in f32 with fused
// multiply-adds, in index order; the CPU's come from the `gemm` crate, whose order
// differs, so they agree to f32 rounding, not bitwise. Sums run over the causal range
// only (j <= i), where the CPU multiplies whole row blocks by the zeros above the
// diagonal. The softmax and its backward run on a half-warp per row in the CPU's lane
// order and are bitwise equal to the CPU's.

// scores[b, h, i, j] = scale · q_i · k_j for j <= i, else 0. `scale` is 1/sqrt(D),
// computed on the host as the CPU does.
template <typename T>
__device__ void attention_scores_impl(T* scores, const T* qkv, i64 batch, i64 t_len,
                                      i64 n_head, i64 n_kv, i64 hd, float scale) {
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv;
    TK_FOR_EACH(idx, batch * n_head * t_len * t_len) {
        const i64 j = idx % t_len, i = (idx / t_len) % t_len, bh = idx / (t_len * t_len);
        const i64 b = bh / n_head, h = bh % n_head;
        float acc = 0.0f;
        if (j <= i) {
            const i64 q = (b * t_len + i) * w + h * hd;
            const i64 k = (b * t_len + j) * w + (n_head + h / group) * hd;
            for (i64 d = 0; d < hd; ++d) acc = fmaf(load(qkv, q + d), load(qkv, k + d), acc);
            acc = scale * acc;
        }
        store(scores, idx, acc);
    }
}

// Overwrites the q and k blocks of dqkv (the v block is left as it is):
// dq_i = scale · Σ_{j <= i} dscores[i, j] · k_j,  dk_j = scale · Σ_h Σ_{i >= j} dscores_h[i, j] · q_i
// over the query heads h sharing the key head. Entries of dscores above the diagonal are
// never read.
template <typename T>
__device__ void attention_scores_backward_impl(T* dqkv, const T* dscores, const T* qkv,
                                               i64 batch, i64 t_len, i64 n_head, i64 n_kv,
                                               i64 hd, float scale) {
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, cols = (n_head + n_kv) * hd;
    TK_FOR_EACH(idx, batch * t_len * cols) {
        const i64 col = idx % cols, t = (idx / cols) % t_len, b = idx / (cols * t_len);
        float acc = 0.0f;
        if (col < n_head * hd) {
            // dq[t] over keys j <= t.
            const i64 h = col / hd, d = col % hd;
            const T* ds = dscores + (b * n_head + h) * t_len * t_len;
            const i64 k = b * t_len * w + (n_head + h / group) * hd + d;
            for (i64 j = 0; j <= t; ++j) acc = fmaf(load(ds, t * t_len + j), load(qkv, k + j * w), acc);
        } else {
            // dk[t] over queries i >= t of every query head of the group.
            const i64 kh = (col - n_head * hd) / hd, d = col % hd;
            for (i64 h = kh * group; h < (kh + 1) * group; ++h) {
                const T* ds = dscores + (b * n_head + h) * t_len * t_len;
                const i64 q = b * t_len * w + h * hd + d;
                for (i64 i = t; i < t_len; ++i) acc = fmaf(load(ds, i * t_len + t), load(qkv, q + i * w), acc);
            }
        }
        store(dqkv, (b * t_len + t) * w + col, scale * acc);
    }
}

// Row softmax over j <= i (rows of B·H·T, each T wide); 0 above the diagonal. With
// positions (`pos`, u32 [B, T], or null), row i of batch row b runs over its document's
// keys only, first = i − pos[b, i] ..= i, 0 elsewhere; the masked entries add 0 in the
// same lanes, so the sums keep the CPU's order.
// probs[i, j] = exp(s_j − max) · (1 / Σ exp(s − max)), rounded once.
template <typename T>
__device__ void softmax_causal_impl(T* probs, const T* scores, i64 rows, i64 t_len,
                                    i64 n_head, const unsigned* pos) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, rows) {
        const i64 base = row * t_len, i = row % t_len;
        const i64 first = pos ? i - (i64)pos[row / (n_head * t_len) * t_len + i] : 0;
        float m = TK_NEG_INF;
        for (i64 j = lane; j <= i; j += TK_LANES) {
            float v = load(scores, base + j);
            m = (j >= first && v > m) ? v : m;
        }
        const float max = half_max(m);
        float acc = 0.0f;
        for (i64 j = lane; j <= i; j += TK_LANES) {
            acc += j >= first ? tk_exp(load(scores, base + j) - max) : 0.0f;
        }
        const float inv = 1.0f / half_sum(acc);
        for (i64 j = lane; j < t_len; j += TK_LANES) {
            float p = (j <= i && j >= first) ? tk_exp(load(scores, base + j) - max) * inv : 0.0f;
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

// out[b, t, h·D + d] = Σ_{j <= t} probs[b, h, t, j] · v[b, j, (h's value head)·D + d].
template <typename T>
__device__ void attention_values_impl(T* out, const T* probs, const T* qkv, i64 batch,
                                      i64 t_len, i64 n_head, i64 n_kv, i64 hd) {
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, c = n_head * hd;
    TK_FOR_EACH(idx, batch * t_len * c) {
        const i64 col = idx % c, t = (idx / c) % t_len, b = idx / (c * t_len);
        const i64 h = col / hd, d = col % hd;
        const T* p = probs + ((b * n_head + h) * t_len + t) * t_len;
        const i64 v = b * t_len * w + (n_head + n_kv + h / group) * hd + d;
        float acc = 0.0f;
        for (i64 j = 0; j <= t; ++j) acc = fmaf(load(p, j), load(qkv, v + j * w), acc);
        store(out, idx, acc);
    }
}

// dprobs[b, h, i, j] = dout_i · v_j (head h, its value head) for j <= i, 0 above.
template <typename T>
__device__ void attention_values_backward_dprobs_impl(T* dprobs, const T* dout, const T* qkv,
                                                      i64 batch, i64 t_len, i64 n_head,
                                                      i64 n_kv, i64 hd) {
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, c = n_head * hd;
    TK_FOR_EACH(idx, batch * n_head * t_len * t_len) {
        const i64 j = idx % t_len, i = (idx / t_len) % t_len, bh = idx / (t_len * t_len);
        const i64 b = bh / n_head, h = bh % n_head;
        float acc = 0.0f;
        if (j <= i) {
            const i64 g = (b * t_len + i) * c + h * hd;
            const i64 v = (b * t_len + j) * w + (n_head + n_kv + h / group) * hd;
            for (i64 d = 0; d < hd; ++d) acc = fmaf(load(dout, g + d), load(qkv, v + d), acc);
        }
        store(dprobs, idx, acc);
    }
}

// Overwrites the v block of dqkv (q and k are left as they are):
// dv_j = Σ_h Σ_{i >= j} probs_h[i, j] · dout_i (head h), over the query heads h sharing
// the value head.
template <typename T>
__device__ void attention_values_backward_dv_impl(T* dqkv, const T* dout, const T* probs,
                                                  i64 batch, i64 t_len, i64 n_head, i64 n_kv,
                                                  i64 hd) {
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, c = n_head * hd;
    const i64 cols = n_kv * hd;
    TK_FOR_EACH(idx, batch * t_len * cols) {
        const i64 col = idx % cols, j = (idx / cols) % t_len, b = idx / (cols * t_len);
        const i64 kh = col / hd, d = col % hd;
        float acc = 0.0f;
        for (i64 h = kh * group; h < (kh + 1) * group; ++h) {
            const T* p = probs + (b * n_head + h) * t_len * t_len;
            const i64 g = b * t_len * c + h * hd + d;
            for (i64 i = j; i < t_len; ++i) acc = fmaf(load(p, i * t_len + j), load(dout, g + i * c), acc);
        }
        store(dqkv, (b * t_len + j) * w + (n_head + n_kv) * hd + col, acc);
    }
}

#define TK_ATTENTION(T, N)                                                                  \
    extern "C" __global__ void attention_scores_##N(T* scores, const T* qkv, i64 batch,     \
                                                    i64 t_len, i64 n_head, i64 n_kv,        \
                                                    i64 hd, float scale) {                  \
        attention_scores_impl<T>(scores, qkv, batch, t_len, n_head, n_kv, hd, scale);       \
    }                                                                                       \
    extern "C" __global__ void attention_scores_backward_##N(                               \
        T* dqkv, const T* dscores, const T* qkv, i64 batch, i64 t_len, i64 n_head,          \
        i64 n_kv, i64 hd, float scale) {                                                    \
        attention_scores_backward_impl<T>(dqkv, dscores, qkv, batch, t_len, n_head, n_kv,   \
                                          hd, scale);                                       \
    }                                                                                       \
    extern "C" __global__ void softmax_causal_##N(T* probs, const T* scores, i64 rows,      \
                                                  i64 t_len, i64 n_head,                    \
                                                  const unsigned* pos) {                    \
        softmax_causal_impl<T>(probs, scores, rows, t_len, n_head, pos);                    \
    }                                                                                       \
    extern "C" __global__ void softmax_causal_backward_##N(                                 \
        T* dscores, const T* dprobs, const T* probs, i64 rows, i64 t_len) {                 \
        softmax_causal_backward_impl<T>(dscores, dprobs, probs, rows, t_len);               \
    }                                                                                       \
    extern "C" __global__ void attention_values_##N(T* out, const T* probs, const T* qkv,   \
                                                    i64 batch, i64 t_len, i64 n_head,       \
                                                    i64 n_kv, i64 hd) {                     \
        attention_values_impl<T>(out, probs, qkv, batch, t_len, n_head, n_kv, hd);          \
    }                                                                                       \
    extern "C" __global__ void attention_values_backward_dprobs_##N(                        \
        T* dprobs, const T* dout, const T* qkv, i64 batch, i64 t_len, i64 n_head, i64 n_kv, \
        i64 hd) {                                                                           \
        attention_values_backward_dprobs_impl<T>(dprobs, dout, qkv, batch, t_len, n_head,   \
                                                 n_kv, hd);                                 \
    }                                                                                       \
    extern "C" __global__ void attention_values_backward_dv_##N(                            \
        T* dqkv, const T* dout, const T* probs, i64 batch, i64 t_len, i64 n_head, i64 n_kv, \
        i64 hd) {                                                                           \
        attention_values_backward_dv_impl<T>(dqkv, dout, probs, batch, t_len, n_head, n_kv, \
                                             hd);                                           \
    }
TK_DTYPES(TK_ATTENTION)

// ---------------------------------------------------------------------------------------
// Incremental decoding: `n` new query rows (absolute positions start, ..., start + n − 1)
// against a key/value cache `kv` of `[capacity, 2·KV·D]` rows (the keys of every kv head,
// then their values) that already holds the new rows' keys and values. Three launches,
// each a plain loop per thread, so every sum runs in the CPU twin's order (bitwise its
// result): the scores of each (row, head) over keys 0..=position (−∞ past it), the
// softmax of each (row, head), and each output element as the probabilities' sum over the
// values. `p` is f32 scratch `[n·H, keys]`, keys = start + n.

template <typename T>
__device__ void attention_decode_scores_impl(float* p, const T* qkv, const T* kv, i64 n,
                                             i64 start, i64 n_head, i64 n_kv, i64 hd,
                                             float scale) {
    const i64 keys = start + n, qkv_w = (n_head + 2 * n_kv) * hd, kv_w = 2 * n_kv * hd;
    const i64 group = n_head / n_kv;
    TK_FOR_EACH(idx, n * n_head * keys) {
        const i64 j = idx % keys, row = idx / keys, h = row % n_head, i = row / n_head;
        float acc = TK_NEG_INF;
        if (j <= start + i) {
            const i64 q = i * qkv_w + h * hd, k = j * kv_w + (h / group) * hd;
            acc = 0.0f;
            for (i64 d = 0; d < hd; ++d) acc = acc + load(qkv, q + d) * load(kv, k + d);
            acc = acc * scale;
        }
        p[idx] = acc;
    }
}

__device__ void attention_decode_softmax_impl(float* p, i64 rows, i64 keys) {
    TK_FOR_EACH(row, rows) {
        float* r = p + row * keys;
        float m = TK_NEG_INF;
        for (i64 j = 0; j < keys; ++j) m = r[j] > m ? r[j] : m;
        float sum = 0.0f;
        for (i64 j = 0; j < keys; ++j) {
            const float e = r[j] == TK_NEG_INF ? 0.0f : tk_exp(r[j] - m);
            r[j] = e;
            sum = sum + e;
        }
        const float inv = 1.0f / sum;
        for (i64 j = 0; j < keys; ++j) r[j] = r[j] * inv;
    }
}

template <typename T>
__device__ void attention_decode_values_impl(T* out, const float* p, const T* kv, i64 n,
                                             i64 start, i64 n_head, i64 n_kv, i64 hd) {
    const i64 keys = start + n, kv_w = 2 * n_kv * hd, group = n_head / n_kv;
    TK_FOR_EACH(idx, n * n_head * hd) {
        const i64 d = idx % hd, row = idx / hd, h = row % n_head;
        const float* r = p + row * keys;
        const i64 v = n_kv * hd + (h / group) * hd + d;
        float acc = 0.0f;
        for (i64 j = 0; j < keys; ++j) acc = acc + r[j] * load(kv, j * kv_w + v);
        store(out, idx, acc);
    }
}

extern "C" __global__ void attention_decode_softmax(float* p, i64 rows, i64 keys) {
    attention_decode_softmax_impl(p, rows, keys);
}

#define TK_ATTENTION_DECODE(T, N)                                                           \
    extern "C" __global__ void attention_decode_scores_##N(                                 \
        float* p, const T* qkv, const T* kv, i64 n, i64 start, i64 n_head, i64 n_kv,        \
        i64 hd, float scale) {                                                              \
        attention_decode_scores_impl<T>(p, qkv, kv, n, start, n_head, n_kv, hd, scale);     \
    }                                                                                       \
    extern "C" __global__ void attention_decode_values_##N(                                 \
        T* out, const float* p, const T* kv, i64 n, i64 start, i64 n_head, i64 n_kv,        \
        i64 hd) {                                                                           \
        attention_decode_values_impl<T>(out, p, kv, n, start, n_head, n_kv, hd);            \
    }
TK_DTYPES(TK_ATTENTION_DECODE)
