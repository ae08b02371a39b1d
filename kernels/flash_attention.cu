// Fused causal attention ("flash" attention): the scores and probabilities are computed
// tile by tile in on-chip memory and never stored, with an online softmax (a running
// maximum and sum per query row) in the forward pass and the probabilities recomputed from
// the saved log-sum-exp in the backward pass.
//
// Layouts (trainkit::device::Heads): qkv is [B, T, W] with W = (H + 2·KV)·D: columns
// [0, H·D) hold the queries, [H·D, (H+KV)·D) the keys, the rest the values; query head h
// reads key and value head h / (H / KV). out and dout are [B, T, H·D], lse and delta
// [B, H, T] f32. scale = 1/sqrt(D), computed on the host.
//
// Work split. Every kernel runs blocks of FA_THREADS = 128 threads, four warps; each warp
// owns 16 rows of its block's tile (query rows, or key rows in the dK/dV kernel). Head
// dimensions of any size are streamed through shared memory in slices of FA_DS = 32
// columns (zero-filled past D and past T), and each block writes one chunk of output
// columns (FA_FWD_OC or FA_BWD_OC wide), so a wide head is split over several blocks.
//
// Products. Every product is a sequence of 16x8x16 tile products, C[16x8] += A[16x16] ·
// B[16x8], whose accumulators each lane holds in the fragment layout of PTX's
// mma.m16n8k16 (lane = 4·g + t: rows g and g + 8, columns 2t and 2t + 1). In bf16 or f16
// on sm_80 and later the tile product is that tensor-core instruction (16-bit operands, f32
// accumulation); otherwise (f32, older devices) each lane computes its four elements with
// fused multiply-adds in index order. In f32 the scores are then the materialized
// kernels' dot products bit for bit. The probabilities and their gradients enter the
// second products in the dtype of qkv (rounded to bf16 or f16 for the tensor cores).
//
// Documents: `pos` (u32 [B, T], or null for one document per row) gives each token its
// position in its document; query i attends keys i − pos[i] ..= i only. Starts never
// decrease along a row (trainkit::ops::positions checks it), so the key tiles before a
// query tile's first row's document are skipped, and a dK/dV block stops at the first
// query step whose documents all start after its keys.
//
// Backward: `flash_attention_backward_delta` computes delta_i = Σ_d dout_i · out_i;
// `flash_attention_backward_dkv` runs over key tiles (dK and dV summed over the group's
// query heads and the query tiles at or after the key tile); `flash_attention_backward_dq`
// runs over query tiles. No atomics: every output element is written by one thread once.

#define FA_THREADS 128
#define FA_BQ 64        // query rows of a forward or dQ block, key rows of a dK/dV block
#define FA_BK 64        // keys per step of the forward pass
#define FA_BS 32        // keys per step of dQ, queries per step of dK/dV
#define FA_DS 32        // columns of a head per shared-memory slice
#define FA_SP (FA_DS + 4)  // row stride of a slice (and of the backward's P and dS tiles)
#define FA_PP (FA_BK + 4)  // row stride of the forward's P tile
#define FA_FWD_OC 128   // output columns of a forward block
#define FA_BWD_OC 64    // output columns of a backward block
// Blocks of the dK/dV kernel a multiprocessor holds at once: the register budget ptxas
// allocates to (170 a thread). Without it ptxas took 168 registers for the f32 kernel on
// sm_80 all the same, and spilled 32 bytes to reach them.
#define FA_DKV_BLOCKS 3

// Whether T is a 16-bit float the tensor cores take (bf16, f16).
template <typename T>
struct fa_is_half {
    static constexpr bool value = false;
};
template <>
struct fa_is_half<bf16> {
    static constexpr bool value = true;
};
template <>
struct fa_is_half<f16> {
    static constexpr bool value = true;
};

__device__ __forceinline__ float fa_widen(float v) { return v; }
__device__ __forceinline__ float fa_widen(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float fa_widen(f16 v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T fa_narrow(float v);
template <>
__device__ __forceinline__ float fa_narrow<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 fa_narrow<bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ f16 fa_narrow<f16>(float v) { return __float2half_rn(v); }

// Two 16-bit values in one 32-bit register, `lo` in the low half (PTX's packing of
// fragments).
__device__ __forceinline__ unsigned fa_pack(bf16 lo, bf16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned fa_pack(f16 lo, f16 hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

// One 16x8x16 tile product of a warp: c (this lane's four accumulators) += A · B with
// A(r, k) = a[r·ars + k·aks] and B(k, n) = b[k·bks + n·bns], r, k < 16, n < 8. Every lane
// of the warp calls it with the same operands.
template <typename T>
__device__ __forceinline__ void fa_tile(float* c, const T* a, int ars, int aks, const T* b,
                                        int bks, int bns) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if TK_HAS_MMA
    if constexpr (fa_is_half<T>::value) {
        unsigned ra[4], rb[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = g + 8 * (i & 1), k = 2 * t + 8 * (i >> 1);
            ra[i] = fa_pack(a[r * ars + k * aks], a[r * ars + (k + 1) * aks]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int k = 2 * t + 8 * i;
            rb[i] = fa_pack(b[k * bks + g * bns], b[(k + 1) * bks + g * bns]);
        }
        tk_mma(c, ra, rb, T());
    } else
#endif
    {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
            float acc = c[i];
            for (int k = 0; k < 16; ++k) {
                acc = fmaf(fa_widen(a[r * ars + k * aks]), fa_widen(b[k * bks + n * bns]), acc);
            }
            c[i] = acc;
        }
    }
}

// Loads rows [row0, row0 + rows) and columns [col0, col0 + FA_DS) of a row-major matrix
// (row stride `stride`) into a shared slice (row stride FA_SP), zeros past `row_end` and
// `col_end`. Called by the whole block.
template <typename T>
__device__ __forceinline__ void fa_load(T* dst, int rows, const T* src, i64 stride, i64 row0,
                                        i64 row_end, i64 col0, i64 col_end) {
    for (int e = threadIdx.x; e < rows * FA_DS; e += blockDim.x) {
        const int r = e / FA_DS, c = e % FA_DS;
        const i64 gr = row0 + r, gc = col0 + c;
        dst[r * FA_SP + c] = (gr < row_end && gc < col_end) ? src[gr * stride + gc]
                                                            : fa_narrow<T>(0.0f);
    }
}

// The first key query i (< t_len) of batch row b attends: the start of its document, or 0
// without positions.
__device__ __forceinline__ i64 fa_first(const unsigned* pos, i64 b, i64 t_len, i64 i) {
    return (pos && i < t_len) ? i - (i64)pos[b * t_len + i] : 0;
}

// Forward. One block per (b, h, query tile of FA_BQ rows, chunk of FA_FWD_OC output
// columns), the longest query tiles first. out_i = Σ_j p_ij v_j / l_i with
// p_ij = exp(s_ij − m_i), m_i and l_i the running maximum and sum, and lse_i = m_i + ln l_i
// (written by the blocks of the first column chunk).
// Where a block works: blockIdx.x read as (batch row, head, tile, column chunk), the chunk
// varying fastest. `tile` counts from 0; the query-tile kernels run it from the last.
struct FaBlock {
    i64 b, h, tile, chunk;
};

__device__ __forceinline__ FaBlock fa_block(i64 chunks, i64 tiles, i64 heads) {
    i64 blk = blockIdx.x;
    FaBlock at;
    at.chunk = blk % chunks;
    blk /= chunks;
    at.tile = blk % tiles;
    blk /= tiles;
    at.h = blk % heads;
    at.b = blk / heads;
    return at;
}

template <typename T>
__device__ void flash_attention_forward_impl(T* out, float* lse, const T* qkv, i64 batch,
                                             i64 t_len, i64 n_head, i64 n_kv, i64 hd,
                                             float scale, const unsigned* pos) {
    __shared__ T qs[FA_BQ * FA_SP];
    __shared__ T ks[FA_BK * FA_SP];
    __shared__ T vs[FA_BK * FA_SP];
    __shared__ T ps[FA_BQ * FA_PP];
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv;
    const i64 q_tiles = (t_len + FA_BQ - 1) / FA_BQ, chunks = (hd + FA_FWD_OC - 1) / FA_FWD_OC;
    const FaBlock at = fa_block(chunks, q_tiles, n_head);
    const i64 chunk = at.chunk, qt = q_tiles - 1 - at.tile, h = at.h, b = at.b;
    if (b >= batch) return;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const i64 q0 = qt * FA_BQ, c0 = chunk * FA_FWD_OC;
    const T* qg = qkv + b * t_len * w + h * hd;
    const T* kg = qkv + b * t_len * w + (n_head + h / group) * hd;
    const T* vg = kg + n_kv * hd;
    const i64 row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    const i64 first[2] = {fa_first(pos, b, t_len, row[0]), fa_first(pos, b, t_len, row[1])};
    const i64 q_end = q0 + FA_BQ < t_len ? q0 + FA_BQ : t_len;
    const i64 k_begin = fa_first(pos, b, t_len, q0) / FA_BK * FA_BK;

    float o[FA_FWD_OC / 8][4];
#pragma unroll
    for (int n = 0; n < FA_FWD_OC / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    float m[2] = {TK_NEG_INF, TK_NEG_INF}, l[2] = {0.0f, 0.0f};

    for (i64 k0 = k_begin; k0 < q_end; k0 += FA_BK) {
        // s = q · kᵀ over the whole head, slice by slice.
        float s[FA_BK / 8][4];
#pragma unroll
        for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
        for (i64 d0 = 0; d0 < hd; d0 += FA_DS) {
            __syncthreads();
            fa_load(qs, FA_BQ, qg, w, q0, t_len, d0, hd);
            fa_load(ks, FA_BK, kg, w, k0, t_len, d0, hd);
            __syncthreads();
            for (int kk = 0; kk < FA_DS && d0 + kk < hd; kk += 16) {
#pragma unroll
                for (int n = 0; n < FA_BK / 8; ++n) {
                    fa_tile(s[n], qs + warp * 16 * FA_SP + kk, FA_SP, 1, ks + n * 8 * FA_SP + kk,
                            1, FA_SP);
                }
            }
        }
        // The online softmax: rows g and g + 8 of the warp, shared by the lane's quad.
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const i64 j = k0 + n * 8 + 2 * t4 + (i & 1);
                const float v = scale * s[n][i];
                const int r = i >> 1;
                s[n][i] = (j <= row[r] && j >= first[r] && j < t_len) ? v : TK_NEG_INF;
                mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
            }
        float alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = tk_quad_max(mx[r]);
            alpha[r] = m[r] == TK_NEG_INF ? 0.0f : tk_exp(m[r] - mx[r]);
        }
#pragma unroll
        for (int n = 0; n < FA_BK / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i >> 1;
                const float p = s[n][i] == TK_NEG_INF ? 0.0f : tk_exp(s[n][i] - mx[r]);
                const T pt = fa_narrow<T>(p);
                ps[(warp * 16 + g + 8 * r) * FA_PP + n * 8 + 2 * t4 + (i & 1)] = pt;
                rs[r] += fa_widen(pt);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] = l[r] * alpha[r] + tk_quad_sum(rs[r]);
            m[r] = mx[r];
        }
#pragma unroll
        for (int n = 0; n < FA_FWD_OC / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[n][i] *= alpha[i >> 1];
        // o += p · v, one slice of output columns at a time.
#pragma unroll
        for (int vc = 0; vc < FA_FWD_OC / FA_DS; ++vc) {
            const i64 cc = c0 + vc * FA_DS;
            if (cc < hd) {
                __syncthreads();
                fa_load(vs, FA_BK, vg, w, k0, t_len, cc, hd);
                __syncthreads();
                for (int kk = 0; kk < FA_BK; kk += 16) {
#pragma unroll
                    for (int n = 0; n < FA_DS / 8; ++n) {
                        fa_tile(o[vc * (FA_DS / 8) + n], ps + warp * 16 * FA_PP + kk, FA_PP, 1,
                                vs + kk * FA_SP + n * 8, FA_SP, 1);
                    }
                }
            }
        }
    }

    const i64 c = n_head * hd;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (row[r] >= t_len) continue;
        const float inv = 1.0f / l[r];
#pragma unroll
        for (int n = 0; n < FA_FWD_OC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const i64 col = c0 + n * 8 + 2 * t4 + e;
                if (col < hd) store(out, (b * t_len + row[r]) * c + h * hd + col, o[n][2 * r + e] * inv);
            }
        if (chunk == 0 && t4 == 0) lse[(b * n_head + h) * t_len + row[r]] = m[r] + logf(l[r]);
    }
}

// delta[b, h, i] = Σ_d dout[b, i, h·D + d] · out[b, i, h·D + d], a half-warp per row.
template <typename T>
__device__ void flash_attention_backward_delta_impl(float* delta, const T* dout, const T* out,
                                                    i64 batch, i64 t_len, i64 n_head, i64 hd) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, batch * t_len * n_head) {
        const i64 h = row % n_head, bt = row / n_head, b = bt / t_len, i = bt % t_len;
        float acc = 0.0f;
        for (i64 d = lane; d < hd; d += TK_LANES) {
            acc = fmaf(load(dout, row * hd + d), load(out, row * hd + d), acc);
        }
        acc = half_sum(acc);
        if (lane == 0) delta[(b * n_head + h) * t_len + i] = acc;
    }
}

// dK and dV. One block per (b, key/value head, key tile of FA_BQ keys, chunk of FA_BWD_OC
// columns), the longest first. For each query head h of the group and each step of FA_BS
// queries at or after the tile: sᵀ = k · qᵀ, dpᵀ = v · doutᵀ, pᵀ = exp(scale·sᵀ − lse),
// dsᵀ = pᵀ (dpᵀ − delta); dv += pᵀ · dout, dk += dsᵀ · q; dk is scaled once at the end.
template <typename T>
__device__ void flash_attention_backward_dkv_impl(T* dqkv, const T* dout, const float* lse,
                                                  const float* delta, const T* qkv, i64 batch,
                                                  i64 t_len, i64 n_head, i64 n_kv, i64 hd,
                                                  float scale, const unsigned* pos) {
    __shared__ T ks[FA_BQ * FA_SP];
    __shared__ T vs[FA_BQ * FA_SP];
    __shared__ T qs[FA_BS * FA_SP];
    __shared__ T dos[FA_BS * FA_SP];
    __shared__ T pts[FA_BQ * FA_SP];
    __shared__ T dsts[FA_BQ * FA_SP];
    __shared__ float lse_s[FA_BS];
    __shared__ float delta_s[FA_BS];
    __shared__ i64 first_s[FA_BS];
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, c = n_head * hd;
    const i64 k_tiles = (t_len + FA_BQ - 1) / FA_BQ, chunks = (hd + FA_BWD_OC - 1) / FA_BWD_OC;
    const FaBlock at = fa_block(chunks, k_tiles, n_kv);
    const i64 chunk = at.chunk, kt = at.tile, kvh = at.h, b = at.b;
    if (b >= batch) return;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const i64 k0 = kt * FA_BQ, c0 = chunk * FA_BWD_OC;
    const T* kg = qkv + b * t_len * w + (n_head + kvh) * hd;
    const T* vg = kg + n_kv * hd;
    const i64 key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};

    float dv[FA_BWD_OC / 8][4], dk[FA_BWD_OC / 8][4];
#pragma unroll
    for (int n = 0; n < FA_BWD_OC / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dv[n][i] = dk[n][i] = 0.0f;

    for (i64 h = kvh * group; h < (kvh + 1) * group; ++h) {
        const T* qg = qkv + b * t_len * w + h * hd;
        const T* dog = dout + b * t_len * c + h * hd;
        const float* lse_h = lse + (b * n_head + h) * t_len;
        const float* delta_h = delta + (b * n_head + h) * t_len;
        for (i64 q0 = k0; q0 < t_len; q0 += FA_BS) {
            // These queries' documents, and all later ones, start after this block's keys.
            if (fa_first(pos, b, t_len, q0) >= k0 + FA_BQ) break;
            float s[FA_BS / 8][4], dp[FA_BS / 8][4];
#pragma unroll
            for (int n = 0; n < FA_BS / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[n][i] = dp[n][i] = 0.0f;
            for (i64 d0 = 0; d0 < hd; d0 += FA_DS) {
                __syncthreads();
                fa_load(ks, FA_BQ, kg, w, k0, t_len, d0, hd);
                fa_load(vs, FA_BQ, vg, w, k0, t_len, d0, hd);
                fa_load(qs, FA_BS, qg, w, q0, t_len, d0, hd);
                fa_load(dos, FA_BS, dog, c, q0, t_len, d0, hd);
                if (d0 == 0 && threadIdx.x < FA_BS) {
                    const i64 q = q0 + threadIdx.x;
                    lse_s[threadIdx.x] = q < t_len ? lse_h[q] : 0.0f;
                    delta_s[threadIdx.x] = q < t_len ? delta_h[q] : 0.0f;
                    first_s[threadIdx.x] = fa_first(pos, b, t_len, q);
                }
                __syncthreads();
                for (int kk = 0; kk < FA_DS && d0 + kk < hd; kk += 16) {
#pragma unroll
                    for (int n = 0; n < FA_BS / 8; ++n) {
                        fa_tile(s[n], ks + warp * 16 * FA_SP + kk, FA_SP, 1, qs + n * 8 * FA_SP + kk,
                                1, FA_SP);
                        fa_tile(dp[n], vs + warp * 16 * FA_SP + kk, FA_SP, 1,
                                dos + n * 8 * FA_SP + kk, 1, FA_SP);
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < FA_BS / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = i >> 1, col = n * 8 + 2 * t4 + (i & 1);
                    const i64 q = q0 + col;
                    const float p = (key[r] <= q && key[r] >= first_s[col] && q < t_len)
                                        ? tk_exp(scale * s[n][i] - lse_s[col])
                                        : 0.0f;
                    const int at = (warp * 16 + g + 8 * r) * FA_SP + col;
                    pts[at] = fa_narrow<T>(p);
                    dsts[at] = fa_narrow<T>(p * (dp[n][i] - delta_s[col]));
                }
#pragma unroll
            for (int oc = 0; oc < FA_BWD_OC / FA_DS; ++oc) {
                const i64 cc = c0 + oc * FA_DS;
                if (cc < hd) {
                    __syncthreads();
                    fa_load(dos, FA_BS, dog, c, q0, t_len, cc, hd);
                    fa_load(qs, FA_BS, qg, w, q0, t_len, cc, hd);
                    __syncthreads();
                    for (int kk = 0; kk < FA_BS; kk += 16) {
#pragma unroll
                        for (int n = 0; n < FA_DS / 8; ++n) {
                            fa_tile(dv[oc * (FA_DS / 8) + n], pts + warp * 16 * FA_SP + kk, FA_SP,
                                    1, dos + kk * FA_SP + n * 8, FA_SP, 1);
                            fa_tile(dk[oc * (FA_DS / 8) + n], dsts + warp * 16 * FA_SP + kk,
                                    FA_SP, 1, qs + kk * FA_SP + n * 8, FA_SP, 1);
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (key[r] >= t_len) continue;
        T* row = dqkv + (b * t_len + key[r]) * w;
#pragma unroll
        for (int n = 0; n < FA_BWD_OC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const i64 col = c0 + n * 8 + 2 * t4 + e;
                if (col < hd) {
                    store(row, (n_head + kvh) * hd + col, scale * dk[n][2 * r + e]);
                    store(row, (n_head + n_kv + kvh) * hd + col, dv[n][2 * r + e]);
                }
            }
    }
}

// dQ. One block per (b, h, query tile of FA_BQ rows, chunk of FA_BWD_OC columns), the
// longest first; steps of FA_BS keys: s = q · kᵀ, dp = dout · vᵀ, p = exp(scale·s − lse),
// ds = p (dp − delta); dq += ds · k, scaled once at the end.
template <typename T>
__device__ void flash_attention_backward_dq_impl(T* dqkv, const T* dout, const float* lse,
                                                 const float* delta, const T* qkv, i64 batch,
                                                 i64 t_len, i64 n_head, i64 n_kv, i64 hd,
                                                 float scale, const unsigned* pos) {
    __shared__ T qs[FA_BQ * FA_SP];
    __shared__ T dos[FA_BQ * FA_SP];
    __shared__ T ks[FA_BS * FA_SP];
    __shared__ T vs[FA_BS * FA_SP];
    __shared__ T dss[FA_BQ * FA_SP];
    const i64 w = (n_head + 2 * n_kv) * hd, group = n_head / n_kv, c = n_head * hd;
    const i64 q_tiles = (t_len + FA_BQ - 1) / FA_BQ, chunks = (hd + FA_BWD_OC - 1) / FA_BWD_OC;
    const FaBlock at = fa_block(chunks, q_tiles, n_head);
    const i64 chunk = at.chunk, qt = q_tiles - 1 - at.tile, h = at.h, b = at.b;
    if (b >= batch) return;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const i64 q0 = qt * FA_BQ, c0 = chunk * FA_BWD_OC;
    const T* qg = qkv + b * t_len * w + h * hd;
    const T* kg = qkv + b * t_len * w + (n_head + h / group) * hd;
    const T* vg = kg + n_kv * hd;
    const T* dog = dout + b * t_len * c + h * hd;
    const i64 row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float lse_r[2], delta_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool in = row[r] < t_len;
        lse_r[r] = in ? lse[(b * n_head + h) * t_len + row[r]] : 0.0f;
        delta_r[r] = in ? delta[(b * n_head + h) * t_len + row[r]] : 0.0f;
    }
    const i64 q_end = q0 + FA_BQ < t_len ? q0 + FA_BQ : t_len;
    const i64 first[2] = {fa_first(pos, b, t_len, row[0]), fa_first(pos, b, t_len, row[1])};
    const i64 k_begin = fa_first(pos, b, t_len, q0) / FA_BS * FA_BS;

    float dq[FA_BWD_OC / 8][4];
#pragma unroll
    for (int n = 0; n < FA_BWD_OC / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dq[n][i] = 0.0f;

    for (i64 k0 = k_begin; k0 < q_end; k0 += FA_BS) {
        float s[FA_BS / 8][4], dp[FA_BS / 8][4];
#pragma unroll
        for (int n = 0; n < FA_BS / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = dp[n][i] = 0.0f;
        for (i64 d0 = 0; d0 < hd; d0 += FA_DS) {
            __syncthreads();
            fa_load(qs, FA_BQ, qg, w, q0, t_len, d0, hd);
            fa_load(dos, FA_BQ, dog, c, q0, t_len, d0, hd);
            fa_load(ks, FA_BS, kg, w, k0, t_len, d0, hd);
            fa_load(vs, FA_BS, vg, w, k0, t_len, d0, hd);
            __syncthreads();
            for (int kk = 0; kk < FA_DS && d0 + kk < hd; kk += 16) {
#pragma unroll
                for (int n = 0; n < FA_BS / 8; ++n) {
                    fa_tile(s[n], qs + warp * 16 * FA_SP + kk, FA_SP, 1, ks + n * 8 * FA_SP + kk, 1,
                            FA_SP);
                    fa_tile(dp[n], dos + warp * 16 * FA_SP + kk, FA_SP, 1, vs + n * 8 * FA_SP + kk,
                            1, FA_SP);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < FA_BS / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i >> 1, col = n * 8 + 2 * t4 + (i & 1);
                const i64 j = k0 + col;
                const float p = (j <= row[r] && j >= first[r] && row[r] < t_len)
                                    ? tk_exp(scale * s[n][i] - lse_r[r])
                                    : 0.0f;
                dss[(warp * 16 + g + 8 * r) * FA_SP + col] = fa_narrow<T>(p * (dp[n][i] - delta_r[r]));
            }
#pragma unroll
        for (int oc = 0; oc < FA_BWD_OC / FA_DS; ++oc) {
            const i64 cc = c0 + oc * FA_DS;
            if (cc < hd) {
                __syncthreads();
                fa_load(ks, FA_BS, kg, w, k0, t_len, cc, hd);
                __syncthreads();
                for (int kk = 0; kk < FA_BS; kk += 16) {
#pragma unroll
                    for (int n = 0; n < FA_DS / 8; ++n) {
                        fa_tile(dq[oc * (FA_DS / 8) + n], dss + warp * 16 * FA_SP + kk, FA_SP, 1,
                                ks + kk * FA_SP + n * 8, FA_SP, 1);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (row[r] >= t_len) continue;
#pragma unroll
        for (int n = 0; n < FA_BWD_OC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const i64 col = c0 + n * 8 + 2 * t4 + e;
                if (col < hd) store(dqkv, (b * t_len + row[r]) * w + h * hd + col, scale * dq[n][2 * r + e]);
            }
    }
}

#define TK_FLASH_ATTENTION(T, N)                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_forward_##N(    \
        T* out, float* lse, const T* qkv, i64 batch, i64 t_len, i64 n_head, i64 n_kv,         \
        i64 hd, float scale, const unsigned* pos) {                                           \
        flash_attention_forward_impl<T>(out, lse, qkv, batch, t_len, n_head, n_kv, hd, scale, \
                                        pos);                                                 \
    }                                                                                         \
    extern "C" __global__ void flash_attention_backward_delta_##N(                            \
        float* delta, const T* dout, const T* out, i64 batch, i64 t_len, i64 n_head, i64 hd) { \
        flash_attention_backward_delta_impl<T>(delta, dout, out, batch, t_len, n_head, hd);   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_DKV_BLOCKS)                  \
        flash_attention_backward_dkv_##N(                                                     \
        T* dqkv, const T* dout, const float* lse, const float* delta, const T* qkv,           \
        i64 batch, i64 t_len, i64 n_head, i64 n_kv, i64 hd, float scale,                      \
        const unsigned* pos) {                                                                \
        flash_attention_backward_dkv_impl<T>(dqkv, dout, lse, delta, qkv, batch, t_len,       \
                                             n_head, n_kv, hd, scale, pos);                   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_backward_dq_##N( \
        T* dqkv, const T* dout, const float* lse, const float* delta, const T* qkv,           \
        i64 batch, i64 t_len, i64 n_head, i64 n_kv, i64 hd, float scale,                      \
        const unsigned* pos) {                                                                \
        flash_attention_backward_dq_impl<T>(dqkv, dout, lse, delta, qkv, batch, t_len,        \
                                            n_head, n_kv, hd, scale, pos);                    \
    }
TK_DTYPES(TK_FLASH_ATTENTION)
