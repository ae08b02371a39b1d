// Token and position embeddings. CPU twin: src/ops/embedding/cpu.rs.
//
// Layouts: `out` and `dout` are [B, T, C] (rows = B·T), `wte` is [V, C], `wpe` is [P, C],
// `tokens` holds B·T token ids (checked against V on the host).
//
// Backward is deterministic, without atomics: the host groups the rows by token
// (`TokenBuckets` in src/device/cuda/embedding.rs: the distinct tokens, and for each the
// rows that hold it, in row order), and one thread owns each (token, column) of dwte: it
// loads the gradient, adds the rows in row order in f32 and rounds once, which is the
// CPU's order and rounding. dwpe is the same with position p owning rows p, p + T, ...;
// where rows hold several documents (`pos`: each token's position in its document, u32
// [B·T]), the host groups the rows by position instead and dwpe takes the dwte kernel.

// out[row, c] = wte[tokens[row], c] + wpe[p, c] with p = pos[row] (or row % T with pos
// null), or wte[tokens[row], c] alone when has_wpe is 0 (no position embeddings; wpe is
// not read).
template <typename T>
__device__ void embedding_impl(T* out, const unsigned* tokens, const T* wte, const T* wpe,
                               i64 rows, i64 t_len, i64 c, i64 has_wpe, const unsigned* pos) {
    TK_FOR_EACH(i, rows * c) {
        i64 row = i / c, col = i % c;
        i64 tok = tokens[row];
        i64 p = pos ? (i64)pos[row] : row % t_len;
        float v = load(wte, tok * c + col);
        if (has_wpe) v = v + load(wpe, p * c + col);
        store(out, i, v);
    }
}

// dwte[tokens[r]] += dout[r] for every row r, bucket by bucket: bucket b is token
// `bucket_tokens[b]` and rows `bucket_rows[bucket_offsets[b] .. bucket_offsets[b + 1]]`.
template <typename T, typename G>
__device__ void embedding_backward_wte_impl(G* dwte, const T* dout,
                                            const unsigned* bucket_tokens,
                                            const unsigned* bucket_offsets,
                                            const unsigned* bucket_rows, i64 n_buckets,
                                            i64 c) {
    TK_FOR_EACH(i, n_buckets * c) {
        i64 b = i / c, col = i % c;
        i64 at = (i64)bucket_tokens[b] * c + col;
        float acc = load(dwte, at);
        for (unsigned k = bucket_offsets[b]; k < bucket_offsets[b + 1]; ++k) {
            acc += load(dout, (i64)bucket_rows[k] * c + col);
        }
        store(dwte, at, acc);
    }
}

// dwpe[p] += dout[b, p] for b = 0 .. B, in order; dwpe rows from T on are untouched.
template <typename T, typename G>
__device__ void embedding_backward_wpe_impl(G* dwpe, const T* dout, i64 batch, i64 t_len,
                                            i64 c) {
    TK_FOR_EACH(i, t_len * c) {
        i64 pos = i / c, col = i % c;
        float acc = load(dwpe, i);
        for (i64 b = 0; b < batch; ++b) {
            acc += load(dout, (b * t_len + pos) * c + col);
        }
        store(dwpe, i, acc);
    }
}

#define TK_EMBEDDING(T, N)                                                                  \
    extern "C" __global__ void embedding_##N(T* out, const unsigned* tokens, const T* wte,  \
                                             const T* wpe, i64 rows, i64 t_len, i64 c,      \
                                             i64 has_wpe, const unsigned* pos) {            \
        embedding_impl<T>(out, tokens, wte, wpe, rows, t_len, c, has_wpe, pos);             \
    }
TK_DTYPES(TK_EMBEDDING)

#define TK_EMBEDDING_BACKWARD(T, TN, G, GN)                                                 \
    extern "C" __global__ void embedding_backward_wte_##TN##_##GN(                          \
        G* dwte, const T* dout, const unsigned* bucket_tokens,                              \
        const unsigned* bucket_offsets, const unsigned* bucket_rows, i64 n_buckets, i64 c) { \
        embedding_backward_wte_impl<T, G>(dwte, dout, bucket_tokens, bucket_offsets,        \
                                          bucket_rows, n_buckets, c);                       \
    }                                                                                       \
    extern "C" __global__ void embedding_backward_wpe_##TN##_##GN(                          \
        G* dwpe, const T* dout, i64 batch, i64 t_len, i64 c) {                              \
        embedding_backward_wpe_impl<T, G>(dwpe, dout, batch, t_len, c);                     \
    }
TK_EMBEDDING_BACKWARD(float, f32, float, f32)
TK_EMBEDDING_BACKWARD(bf16, bf16, float, f32)
TK_EMBEDDING_BACKWARD(float, f32, bf16, bf16)
TK_EMBEDDING_BACKWARD(bf16, bf16, bf16, bf16)
TK_EMBEDDING_BACKWARD(f16, f16, float, f32)
TK_EMBEDDING_BACKWARD(float, f32, f16, f16)
TK_EMBEDDING_BACKWARD(f16, f16, f16, f16)
