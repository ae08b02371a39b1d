// Fused causal attention on the tensor cores, in FlashAttention-2's form, for bf16 and f16
// heads of 64, 80, 96 or 128 columns on sm_80 and later (flash_attention.cu's tiled kernels
// take every other case: f32, other head sizes, older devices, unaligned buffers).
//
// Layouts are flash_attention.cu's (trainkit::device::Heads): qkv [B, T, W], W = (H + 2·KV)·D,
// queries in columns [0, H·D), keys in [H·D, (H+KV)·D), values after; query head h reads
// key and value head h / (H / KV); out and dout [B, T, H·D]; lse and delta [B, H, T] f32
// (lse the natural log of the softmax's denominator). `pos` (u32 [B, T] or null) gives each
// token its position in its document: query i attends keys i − pos[i] ..= i.
//
// How it is fast:
// - tiles move global → shared memory with 16-byte `cp.async` copies, the next tile's copy
//   in flight while the current one is multiplied (K and V in the forward pass, Q and dO in
//   the backward);
// - shared tiles are swizzled (the 16-byte chunk c of row r sits at chunk c ^ (r mod 8)), so
//   `ldmatrix` reads 8 rows without bank conflicts and no padding is needed;
// - fragments come from `ldmatrix` (`.trans` where the operand is read down its columns),
//   the forward's queries once for the whole block, and the probabilities go from the first
//   product's accumulators straight into the second product's operand registers;
// - the softmax runs in base 2 with scale·log2(e) folded into one multiply, on the fast
//   `ex2.approx` (this file's arithmetic is held to the CPU twin by tolerance, not bits);
// - causal tiles past the diagonal (and, with documents, before a tile's first document)
//   are never visited; only tiles the diagonal or a boundary crosses are masked.
// - the backward computes S and dP once per (key tile, query tile) pair, as FlashAttention-2
//   does: dK and dV stay in registers, dQ is added into an f32 workspace atomically, two
//   adjacent columns in one vector reduction on sm_90 (so its summation order, and dQ's
//   last bits, may differ from run to run on a GPU; the emulator runs blocks in order),
//   then scaled and rounded by a last small kernel.
//
// Work split, in the default (wide) tiling; the narrow one (the tiling before, kept to time
// against it) is described above TK_FA2_FWD_WIDE below.
// Forward: blocks of FA2_THREADS = 128 threads (four warps), one per (query tile of 128
// rows, head, batch row), the longest tiles first; each warp holds two 16-row tiles, so
// that every K and V fragment it reads from shared memory feeds two products; steps of 64
// keys (32 for heads over 64 columns, whose output accumulators take twice the registers).
// A warp whose rows all come before a step's keys skips its products.
// Backward: a block per (key tile, key/value head, batch row), the longest first, a warp
// per 16 keys: 128 keys on eight warps at 64 columns (each step's Q and dO then serve twice
// the keys, and dQ gets half the atomic adds), 64 on four above; steps of 64 queries (32
// above 64 columns: as many as the registers hold beside dK and dV) of each query head of
// the group, each step's Q and dO copied while the step before computes (two buffers); a
// warp whose keys all come after a step's queries skips its products.
// Shared memory is dynamic (the backend opts in past 48 KiB: flash_attention/cuda.rs's
// MmaPlan, which flash_attention_mma_plan holds to Fa2Fwd and Fa2Bwd): forward Q, K and V
// tiles (at most 48 KiB), backward K and V, two buffers of Q and dO, dSᵀ and two of the
// steps' statistics (at most 82 KiB), within the 99 KiB every sm_80-and-later card allows.

#define FA2_THREADS 128
#define FA2_LOG2E 1.4426950408889634f
#define FA2_LN2 0.6931471805599453f


// Shared row length (elements) for a head of D columns: a multiple of 64, so that a row
// holds whole groups of eight 16-byte chunks for the swizzle.
template <int D>
struct Fa2Dims {
    static constexpr int SD = (D + 63) / 64 * 64;
    static constexpr int CH = SD / 8;  // 16-byte chunks a shared row holds
    static constexpr int DC = D / 8;   // chunks a head's row fills
    static constexpr int KS = D / 16;  // k-steps of a product over the head
    static constexpr int NT = D / 8;   // n-tiles of 8 columns over the head
};

// A forward block's tiles: MW m-tiles of 16 query rows a warp (each K and V fragment read
// from shared memory feeds MW products), so BM = 64·MW rows a block of four warps; BN keys
// a step; the query fragments kept in registers for the whole block (QREG) or read again
// at each step, as the registers allow without spilling. SHARED: the dynamic shared
// memory of a block, in bytes: Q (BM rows), K and V (BN rows each).
template <int D, int MW, int BN>
struct Fa2Fwd {
    static constexpr int BM = 64 * MW;
    static constexpr bool QREG = MW == 1 || D <= 64;
    static constexpr int SHARED = (BM + 2 * BN) * Fa2Dims<D>::SD * 2;
};

// A backward block's tiles: KW warps of 16 keys each (BN = 16·KW keys, 32·KW threads), in
// steps of BM queries (as many as the registers hold beside dK and dV), Q, dO and their
// statistics in DB buffers (2: a step's copies are in flight while the step before
// computes; 1: while its dQ product runs). SHARED: the dynamic shared memory of a block,
// in bytes: K and V (BN rows each), DB buffers of Q and dO (BM rows each), dSᵀ (BN × BM),
// then DB buffers of lse, delta and the first key of each of a step's queries (4 bytes
// each).
template <int D, int BM, int DB, int KW>
struct Fa2Bwd {
    static constexpr int SD = Fa2Dims<D>::SD;
    static constexpr int BN = 16 * KW;
    static constexpr int SHARED = (2 * BN * SD + 2 * DB * BM * SD + BN * BM) * 2 + DB * BM * 12;
};

// The element offset of (row r, chunk c) in a swizzled shared tile of CH chunks a row.
template <int CH>
__device__ __forceinline__ int fa2_at(int r, int c) {
    if constexpr (CH >= 8) {
        return r * CH * 8 + ((c & ~7) | ((c ^ r) & 7)) * 8;
    } else {
        return r * CH * 8 + (c ^ (r & (CH - 1))) * 8;
    }
}

// 16 bytes global → shared, asynchronously; zeros when `valid` is false (the source is
// then not read).
__device__ __forceinline__ void fa2_cp16(void* smem, const void* gmem, bool valid) {
#if defined(TRAINKIT_EMU_H)
    if (valid) {
        memcpy(smem, gmem, 16);
    } else {
        memset(smem, 0, 16);
    }
#elif TK_HAS_MMA
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void fa2_commit() {
#if !defined(TRAINKIT_EMU_H) && TK_HAS_MMA
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits for every copy this thread issued (each thread then meets the block at a barrier).
__device__ __forceinline__ void fa2_wait_all() {
#if !defined(TRAINKIT_EMU_H) && TK_HAS_MMA
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// dst[0] += a and dst[1] += b in global memory, atomically (8-byte aligned `dst`): one
// vector reduction on sm_90, two scalar ones before it.
__device__ __forceinline__ void fa2_add2(float* dst, float a, float b) {
#if !defined(TRAINKIT_EMU_H) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b)
                 : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// ldmatrix.x4: lane l names row l % 8 of matrix l / 8; register i of every lane gets its
// share of matrix i (row lane / 4, columns 2·(lane % 4) and the next; `.trans`: rows
// 2·(lane % 4) and the next, column lane / 4).
__device__ __forceinline__ void fa2_ldm(unsigned* r, const void* p) {
#if defined(TRAINKIT_EMU_H)
    ::tk_emu::ldmatrix_x4(r, p, false);
#elif TK_HAS_MMA
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}
__device__ __forceinline__ void fa2_ldm_t(unsigned* r, const void* p) {
#if defined(TRAINKIT_EMU_H)
    ::tk_emu::ldmatrix_x4(r, p, true);
#elif TK_HAS_MMA
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}

// Two floats rounded to nearest into one register of 16-bit values, `lo` in the low half.
__device__ __forceinline__ unsigned fa2_pack(float lo, float hi, bf16) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
__device__ __forceinline__ unsigned fa2_pack(float lo, float hi, f16) {
    return (unsigned)__half_as_ushort(__float2half_rn(lo)) |
           ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}

// Two n-tiles of a product's f32 accumulators (16 rows × 16 columns: `lo` the first 8
// columns, `hi` the next) rounded into the A fragment of the next product, whose k-step
// they are: the accumulator layout of mma.m16n8k16 is its A operand's, two columns a
// register.
template <typename T>
__device__ __forceinline__ void fa2_pack_a(unsigned* a, const float* lo, const float* hi) {
    a[0] = fa2_pack(lo[0], lo[1], T());
    a[1] = fa2_pack(lo[2], lo[3], T());
    a[2] = fa2_pack(hi[0], hi[1], T());
    a[3] = fa2_pack(hi[2], hi[3], T());
}

// 2^x on the special function unit (ex2.approx: 2^−∞ = 0).
__device__ __forceinline__ float fa2_exp2(float x) {
#if defined(TRAINKIT_EMU_H)
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Rows [r0, r0 + ROWS) of a row-major matrix (row stride `stride` elements, rows at or past
// `t_len` read as zeros), its first D columns, into a swizzled shared tile. The whole block
// calls it; the copies are asynchronous (commit, then wait).
template <typename T, int D, int ROWS, int THREADS = FA2_THREADS>
__device__ __forceinline__ void fa2_load(T* dst, const T* src, int stride, int r0, int t_len) {
    constexpr int DC = Fa2Dims<D>::DC, CH = Fa2Dims<D>::CH;
    for (int e = threadIdx.x; e < ROWS * DC; e += THREADS) {
        const int r = e / DC, c = e - r * DC, row = r0 + r;
        const bool valid = row < t_len;
        fa2_cp16(dst + fa2_at<CH>(r, c), src + (i64)(valid ? row : 0) * stride + c * 8, valid);
    }
}

// The first key query i attends (< t_len): its document's start, or 0 without positions.
__device__ __forceinline__ int fa2_first(const unsigned* pos, i64 b, int t_len, int i) {
    return (pos && i < t_len) ? i - (int)pos[b * t_len + i] : 0;
}

// ---------------------------------------------------------------------------------------
// Forward: out_i = Σ_j p_ij v_j / l_i, p_ij = 2^(s_ij·scale·log2 e − m_i) with m_i the
// running maximum (base 2) and l_i the running sum; lse_i = (m_i + log2 l_i)·ln 2.

template <typename T, int D, int MW, int BN>
__device__ void fa2_forward_impl(T* out, float* lse, const T* qkv, int batch, int t_len,
                                 int n_head, int n_kv, float scale, const unsigned* pos) {
#if TK_HAS_MMA
    typedef Fa2Dims<D> Dm;
    typedef Fa2Fwd<D, MW, BN> Tl;
    constexpr int SD = Dm::SD, CH = Dm::CH, KS = Dm::KS, NT = Dm::NT;
    constexpr int BM = Tl::BM, QR = Tl::QREG ? KS : 1;
    extern __shared__ __align__(128) unsigned char fa2_smem[];
    T* qs = (T*)fa2_smem;
    T* ks = qs + BM * SD;
    T* vs = ks + BN * SD;

    const int w = (n_head + 2 * n_kv) * D, group = n_head / n_kv;
    const int q_tiles = (t_len + BM - 1) / BM, nbh = batch * n_head;
    const int tile = q_tiles - 1 - (int)(blockIdx.x / nbh), bh = (int)(blockIdx.x % nbh);
    const int b = bh / n_head, h = bh - b * n_head;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int q0 = tile * BM, w0 = q0 + warp * 16 * MW;  // the warp's first row
    const T* base = qkv + (i64)b * t_len * w;
    const T* qg = base + h * D;
    const T* kg = base + (n_head + h / group) * D;
    const T* vg = kg + n_kv * D;
    const float sl2 = scale * FA2_LOG2E;

    // Row (m-tile mt, half r) of this lane, and the first key it attends.
    int row[MW][2], first[MW][2];
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row[mt][r] = w0 + mt * 16 + g + 8 * r;
            first[mt][r] = fa2_first(pos, b, t_len, row[mt][r]);
        }
    const int q_last = (q0 + BM < t_len ? q0 + BM : t_len) - 1;
    const int kt_begin = fa2_first(pos, b, t_len, q0) / BN, kt_end = q_last / BN;

    fa2_load<T, D, BM>(qs, qg, w, q0, t_len);
    fa2_load<T, D, BN>(ks, kg, w, kt_begin * BN, t_len);
    fa2_commit();
    fa2_wait_all();
    __syncthreads();

    // The warp's query rows as A fragments: every k-step of the head kept in registers
    // (QREG), or read from shared memory at each k-step.
    unsigned qf[MW][QR][4];
    auto q_frag = [&](unsigned* r, int mt, int kk) {
        fa2_ldm(r, qs + fa2_at<CH>(warp * 16 * MW + mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                   2 * kk + (lane >> 4)));
    };
    if constexpr (Tl::QREG) {
#pragma unroll
        for (int mt = 0; mt < MW; ++mt)
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) q_frag(qf[mt][kk], mt, kk);
    }

    float o[MW][NT][4];
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[mt][n][i] = 0.0f;
    float m[MW][2], l[MW][2];
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m[mt][r] = TK_NEG_INF;
            l[mt][r] = 0.0f;
        }

    for (int kt = kt_begin; kt <= kt_end; ++kt) {
        const int k0 = kt * BN;
        fa2_load<T, D, BN>(vs, vg, w, k0, t_len);
        fa2_commit();
        // A warp whose rows all come before this tile's keys has nothing to add (its
        // probabilities would all be 0): it only takes part in the copies.
        const bool active = k0 <= w0 + 16 * MW - 1;

        float s[MW][BN / 8][4];
        if (active) {
            // s = q · kᵀ, 16·MW rows × BN keys a warp: each K fragment feeds MW products.
#pragma unroll
            for (int mt = 0; mt < MW; ++mt)
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned qk[MW][4];
                if constexpr (!Tl::QREG) {
#pragma unroll
                    for (int mt = 0; mt < MW; ++mt) q_frag(qk[mt], mt, kk);
                }
#pragma unroll
                for (int np = 0; np < BN / 16; ++np) {
                    unsigned kf[4];
                    fa2_ldm(kf, ks + fa2_at<CH>(np * 16 + (lane & 7) + 8 * (lane >> 4),
                                                2 * kk + ((lane >> 3) & 1)));
#pragma unroll
                    for (int mt = 0; mt < MW; ++mt) {
                        const unsigned* a;
                        if constexpr (Tl::QREG) {
                            a = qf[mt][kk];
                        } else {
                            a = qk[mt];
                        }
                        tk_mma(s[mt][2 * np], a, kf, T());
                        tk_mma(s[mt][2 * np + 1], a, kf + 2, T());
                    }
                }
            }

            // Scale (base 2), mask where the diagonal, a document start or the end crosses.
#pragma unroll
            for (int mt = 0; mt < MW; ++mt) {
                const bool masked = pos != nullptr || k0 + BN - 1 > w0 + mt * 16 || k0 + BN > t_len;
                float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = i >> 1;
                        float x = s[mt][n][i] * sl2;
                        if (masked) {
                            const int j = k0 + n * 8 + 2 * t4 + (i & 1);
                            const bool in = j <= row[mt][r] && j >= first[mt][r] && j < t_len;
                            if (!in) x = TK_NEG_INF;
                        }
                        s[mt][n][i] = x;
                        mx[r] = fmaxf(mx[r], x);
                    }
                float alpha[2], mu[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    mx[r] = tk_quad_max(mx[r]);
                    mu[r] = mx[r] == TK_NEG_INF ? 0.0f : mx[r];
                    alpha[r] = fa2_exp2(m[mt][r] - mu[r]);
                    m[mt][r] = mx[r];
                    l[mt][r] *= alpha[r];
                }
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float p = fa2_exp2(s[mt][n][i] - mu[i >> 1]);
                        s[mt][n][i] = p;
                        l[mt][i >> 1] += p;
                    }
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) o[mt][n][i] *= alpha[i >> 1];
            }
        }

        // V has landed and every warp is done with K: the next K's copy overlaps p · v.
        fa2_wait_all();
        __syncthreads();
        if (kt < kt_end) {
            fa2_load<T, D, BN>(ks, kg, w, k0 + BN, t_len);
            fa2_commit();
        }
        if (active) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned pa[MW][4];
#pragma unroll
                for (int mt = 0; mt < MW; ++mt) {
                    fa2_pack_a<T>(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned vf[4];
                    fa2_ldm_t(vf, vs + fa2_at<CH>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                  2 * np + (lane >> 4)));
#pragma unroll
                    for (int mt = 0; mt < MW; ++mt) {
                        tk_mma(o[mt][2 * np], pa[mt], vf, T());
                        tk_mma(o[mt][2 * np + 1], pa[mt], vf + 2, T());
                    }
                }
            }
        }
        fa2_wait_all();
        __syncthreads();
    }

    const int c = n_head * D;
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = tk_quad_sum(l[mt][r]);
            if (row[mt][r] >= t_len) continue;
            const float inv = 1.0f / sum;
            T* dst = out + ((i64)b * t_len + row[mt][r]) * c + h * D + 2 * t4;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                *(unsigned*)(dst + n * 8) =
                    fa2_pack(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv, T());
            }
            if (t4 == 0) {
                lse[((i64)b * n_head + h) * t_len + row[mt][r]] =
                    (m[mt][r] + log2f(sum)) * FA2_LN2;
            }
        }
#endif
}

// ---------------------------------------------------------------------------------------
// Backward, before the main kernel: delta[b, h, i] = Σ_d dout · out over the row (f32,
// [B, H, T]), and the row's dQ accumulators zeroed (f32, [B, T, H·D]). A half-warp per
// (b, i, h) row, 16-byte loads; D a multiple of 8, at most 128.

template <typename T>
__device__ void fa2_backward_prep_impl(float* delta, float* dq_acc, const T* dout, const T* out,
                                       int batch, int t_len, int n_head, int hd) {
    const int lane = lane16();
    TK_FOR_EACH_ROW(row, (i64)batch * t_len * n_head) {
        const int h = (int)(row % n_head);
        const i64 bt = row / n_head, b = bt / t_len, i = bt - b * t_len;
        float acc = 0.0f;
        const int c = lane * 8;
        if (c < hd) {
            const uint4 dv = *(const uint4*)(dout + row * hd + c);
            const uint4 ov = *(const uint4*)(out + row * hd + c);
            const T* dp = (const T*)&dv;
            const T* op = (const T*)&ov;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(load(dp, e), load(op, e), acc);
            float4* z = (float4*)(dq_acc + row * hd + c);
            z[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        acc = half_sum(acc);
        if (lane == 0) delta[(b * n_head + h) * t_len + i] = acc;
    }
}

// The queries' block of dqkv: scale · dQ, rounded, from the f32 accumulators; a thread per
// 8 values.
template <typename T>
__device__ void fa2_backward_dq_impl(T* dqkv, const float* dq_acc, int batch, int t_len,
                                     int n_head, int n_kv, int hd, float scale) {
    const int c = n_head * hd, w = (n_head + 2 * n_kv) * hd, per_row = c / 8;
    TK_FOR_EACH(e, (i64)batch * t_len * per_row) {
        const i64 bt = e / per_row;
        const int k = (int)(e - bt * per_row) * 8;
        const float4 a = *(const float4*)(dq_acc + bt * c + k);
        const float4 z = *(const float4*)(dq_acc + bt * c + k + 4);
        uint4 v;
        v.x = fa2_pack(a.x * scale, a.y * scale, T());
        v.y = fa2_pack(a.z * scale, a.w * scale, T());
        v.z = fa2_pack(z.x * scale, z.y * scale, T());
        v.w = fa2_pack(z.z * scale, z.w * scale, T());
        *(uint4*)(dqkv + bt * w + k) = v;
    }
}

// dK, dV and dQ. A block of KW warps per (key tile of BN = 16·KW keys, key/value head, batch
// row); for each
// query head of the group and each step of BM queries at or after the tile (and in a
// document that can reach it): sᵀ = k · qᵀ, dpᵀ = v · doᵀ, pᵀ = 2^(sᵀ·scale·log2 e −
// lse·log2 e), dsᵀ = pᵀ ∘ (dpᵀ − delta); dv += pᵀ · do, dk += dsᵀ · q in registers, and
// dq += ds · k added into dq_acc. dk is scaled once at the end, dq by the last kernel.
template <typename T, int D, int BM, int DB, int KW>
__device__ void fa2_backward_impl(float* dq_acc, T* dqkv, const T* dout, const float* lse,
                                  const float* delta, const T* qkv, int batch, int t_len,
                                  int n_head, int n_kv, float scale, const unsigned* pos) {
#if TK_HAS_MMA
    typedef Fa2Dims<D> Dm;
    constexpr int SD = Dm::SD, CH = Dm::CH, KS = Dm::KS, NT = Dm::NT;
    constexpr int BN = Fa2Bwd<D, BM, DB, KW>::BN, THREADS = 32 * KW;
    constexpr int CHB = BM / 8;  // chunks a row of the dSᵀ tile holds
    // dQ's split over the warps: RG groups of 16 query rows, each row group's columns in
    // CS parts of whole 16-column pairs.
    constexpr int RG = BM / 16, CS = KW / RG, PAIRS = (NT / 2 + CS - 1) / CS;
    extern __shared__ __align__(128) unsigned char fa2_smem[];
    // Q, dO and the statistics in DB buffers (Fa2Bwd).
    T* ks = (T*)fa2_smem;
    T* vs = ks + BN * SD;
    T* qbuf = vs + BN * SD;
    T* dobuf = qbuf + DB * BM * SD;
    T* dss = dobuf + DB * BM * SD;
    float* lse_buf = (float*)(dss + BN * BM);
    float* delta_buf = lse_buf + DB * BM;
    int* first_buf = (int*)(delta_buf + DB * BM);

    const int w = (n_head + 2 * n_kv) * D, group = n_head / n_kv, c = n_head * D;
    const int nbk = batch * n_kv;
    const int kt = (int)(blockIdx.x / nbk), bk = (int)(blockIdx.x % nbk);
    const int b = bk / n_kv, kvh = bk - b * n_kv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int k0 = kt * BN;
    const T* base = qkv + (i64)b * t_len * w;
    const T* kg = base + (n_head + kvh) * D;
    const T* vg = kg + n_kv * D;
    const T* dbase = dout + (i64)b * t_len * c;
    float* qacc = dq_acc + (i64)b * t_len * c;
    const float sl2 = scale * FA2_LOG2E;
    const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};

    // Whether the step of queries from q0 exists (and reaches this tile's keys).
    auto live = [&](int q0) {
        return q0 < t_len && fa2_first(pos, b, t_len, q0) < k0 + BN;
    };
    // The copies of a step into buffer `buf`: its queries' rows of q and dout, and their
    // statistics.
    auto stage = [&](int buf, int h, int q0) {
        fa2_load<T, D, BM, THREADS>(qbuf + buf * BM * SD, base + h * D, w, q0, t_len);
        fa2_load<T, D, BM, THREADS>(dobuf + buf * BM * SD, dbase + h * D, c, q0, t_len);
        fa2_commit();
        if (threadIdx.x < BM) {
            const int q = q0 + threadIdx.x, at_s = buf * BM + threadIdx.x;
            const i64 at = ((i64)b * n_head + h) * t_len + q;
            lse_buf[at_s] = q < t_len ? lse[at] * FA2_LOG2E : 0.0f;
            delta_buf[at_s] = q < t_len ? delta[at] : 0.0f;
            first_buf[at_s] = fa2_first(pos, b, t_len, q);
        }
    };

    float dv[NT][4], dk[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dv[n][i] = dk[n][i] = 0.0f;

    fa2_load<T, D, BN, THREADS>(ks, kg, w, k0, t_len);
    fa2_load<T, D, BN, THREADS>(vs, vg, w, k0, t_len);
    int h = kvh * group, q0 = k0;
    const int h_end = (kvh + 1) * group;
    int cur = 0;
    if (live(q0)) stage(cur, h, q0);
    while (live(q0)) {
        // This step's copies have landed, and every warp is done with the step before
        // (so its buffers, and dSᵀ, may be written again).
        fa2_wait_all();
        __syncthreads();
        const T* qs = qbuf + cur * BM * SD;
        const T* dos = dobuf + cur * BM * SD;
        const float* lse_s = lse_buf + cur * BM;
        const float* delta_s = delta_buf + cur * BM;
        const int* first_s = first_buf + cur * BM;

        // The next step, whose copies overlap all of this one (two buffers) or its dQ
        // product (one buffer, whose Q and dO are read until then).
        const int done_q0 = q0, done_h = h;
        q0 += BM;
        if (!live(q0) && h + 1 < h_end) {
            ++h;
            q0 = k0;
        }
        if (DB == 2 && live(q0)) stage(cur ^ 1, h, q0);

        // A warp whose keys all come after the step's queries has nothing to add (its
        // probabilities, and its rows of dSᵀ, would all be 0): it skips its products, and
        // the dQ product skips its keys.
        const int last_q = done_q0 + BM - 1;
        const bool active = k0 + warp * 16 <= last_q;

        // sᵀ and dpᵀ: 16 keys × BM queries a warp.
        float st[BM / 8][4], dpt[BM / 8][4];
        if (active) {
#pragma unroll
            for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) st[n][i] = dpt[n][i] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                unsigned kf[4], vf[4];
                const int ar = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                const int ac = 2 * kk + (lane >> 4);
                fa2_ldm(kf, ks + fa2_at<CH>(ar, ac));
                fa2_ldm(vf, vs + fa2_at<CH>(ar, ac));
#pragma unroll
                for (int np = 0; np < BM / 16; ++np) {
                    unsigned qf[4], of[4];
                    const int br = np * 16 + (lane & 7) + 8 * (lane >> 4);
                    const int bc = 2 * kk + ((lane >> 3) & 1);
                    fa2_ldm(qf, qs + fa2_at<CH>(br, bc));
                    fa2_ldm(of, dos + fa2_at<CH>(br, bc));
                    tk_mma(st[2 * np], kf, qf, T());
                    tk_mma(st[2 * np + 1], kf, qf + 2, T());
                    tk_mma(dpt[2 * np], vf, of, T());
                    tk_mma(dpt[2 * np + 1], vf, of + 2, T());
                }
            }
            // pᵀ and dsᵀ.
#pragma unroll
            for (int n = 0; n < BM / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int col = n * 8 + 2 * t4 + (i & 1), q = done_q0 + col, kr = key[i >> 1];
                    const bool in = kr <= q && q < t_len && kr >= first_s[col];
                    const float p = in ? fa2_exp2(st[n][i] * sl2 - lse_s[col]) : 0.0f;
                    st[n][i] = p;
                    dpt[n][i] = p * (dpt[n][i] - delta_s[col]);
                }
            // dv += pᵀ · do, dk += dsᵀ · q (k over the step's queries).
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                unsigned pa[4], da[4];
                fa2_pack_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
                fa2_pack_a<T>(da, dpt[2 * kk], dpt[2 * kk + 1]);
                // dsᵀ into shared memory (rows: keys), for dq.
                *(unsigned*)(dss + fa2_at<CHB>(warp * 16 + g, kk * 2) + 2 * t4) = da[0];
                *(unsigned*)(dss + fa2_at<CHB>(warp * 16 + g + 8, kk * 2) + 2 * t4) = da[1];
                *(unsigned*)(dss + fa2_at<CHB>(warp * 16 + g, kk * 2 + 1) + 2 * t4) = da[2];
                *(unsigned*)(dss + fa2_at<CHB>(warp * 16 + g + 8, kk * 2 + 1) + 2 * t4) = da[3];
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned of[4], qf[4];
                    const int br = kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                    const int bc = 2 * np + (lane >> 4);
                    fa2_ldm_t(of, dos + fa2_at<CH>(br, bc));
                    fa2_ldm_t(qf, qs + fa2_at<CH>(br, bc));
                    tk_mma(dv[2 * np], pa, of, T());
                    tk_mma(dv[2 * np + 1], pa, of + 2, T());
                    tk_mma(dk[2 * np], da, qf, T());
                    tk_mma(dk[2 * np + 1], da, qf + 2, T());
                }
            }
        }
        __syncthreads();
        if (DB == 1 && live(q0)) stage(cur, h, q0);

        // dq[rows of the step] += ds · k over the tile's BN keys: warp = (column part,
        // row group).
        const int rg = warp % RG, cs = warp / RG;
        float acc[PAIRS][2][4];
#pragma unroll
        for (int p = 0; p < PAIRS; ++p)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[p][j][i] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            if (k0 + kk * 16 > last_q) break;  // this warp's keys and those after: skipped
            unsigned a[4];
            fa2_ldm_t(a, dss + fa2_at<CHB>(kk * 16 + (lane & 7) + 8 * (lane >> 4),
                                           2 * rg + ((lane >> 3) & 1)));
#pragma unroll
            for (int p = 0; p < PAIRS; ++p) {
                const int np = cs + p * CS;
                if (np < NT / 2) {
                    unsigned kf[4];
                    fa2_ldm_t(kf, ks + fa2_at<CH>(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                  2 * np + (lane >> 4)));
                    tk_mma(acc[p][0], a, kf, T());
                    tk_mma(acc[p][1], a, kf + 2, T());
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int q = done_q0 + rg * 16 + g + 8 * r;
            if (q >= t_len) continue;
            float* dst = qacc + (i64)q * c + done_h * D + 2 * t4;
#pragma unroll
            for (int p = 0; p < PAIRS; ++p) {
                const int np = cs + p * CS;
                if (np < NT / 2) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        fa2_add2(dst + (2 * np + j) * 8, acc[p][j][2 * r], acc[p][j][2 * r + 1]);
                    }
                }
            }
        }
        if (DB == 2) cur ^= 1;
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (key[r] >= t_len) continue;
        T* dst = dqkv + ((i64)b * t_len + key[r]) * w + 2 * t4;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            *(unsigned*)(dst + (n_head + kvh) * D + n * 8) =
                fa2_pack(scale * dk[n][2 * r], scale * dk[n][2 * r + 1], T());
            *(unsigned*)(dst + (n_head + n_kv + kvh) * D + n * 8) =
                fa2_pack(dv[n][2 * r], dv[n][2 * r + 1], T());
        }
    }
#endif
}

#define TK_FA2_HEAD(T, N, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(FA2_THREADS)                                 \
        flash_attention_mma_forward_d##D##_##N(T* out, float* lse, const T* qkv, int batch,   \
                                               int t_len, int n_head, int n_kv, float scale,   \
                                               const unsigned* pos) {                          \
        fa2_forward_impl<T, D>(out, lse, qkv, batch, t_len, n_head, n_kv, scale, pos);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(FA2_THREADS)                                 \
        flash_attention_mma_backward_d##D##_##N(                                               \
            float* dq_acc, T* dqkv, const T* dout, const float* lse, const float* delta,       \
            const T* qkv, int batch, int t_len, int n_head, int n_kv, float scale,             \
            const unsigned* pos) {                                                             \
        fa2_backward_impl<T, D>(dq_acc, dqkv, dout, lse, delta, qkv, batch, t_len, n_head,     \
                                n_kv, scale, pos);                                             \
    }

// The kernels are built in two tilings a head size, chosen at launch
// (flash_attention/cuda.rs's MmaPlan): `wide` (the default: 128-row forward blocks; the
// backward double-buffered, 64 queries a step over 128 keys on 8 warps at 64 columns, 32
// queries over 64 keys on 4 warps above) and `narrow` (64-row forward blocks of 64-key
// steps; the backward single-buffered over 64 keys on 4 warps, 64 queries a step at 64
// columns and 16 above), so that one build can time the two side by side.
#define TK_FA2_FWD_WIDE(D) 2, ((D) <= 64 ? 64 : 32)
#define TK_FA2_FWD_NARROW(D) 1, 64
#define TK_FA2_BWD_WIDE_WARPS(D) ((D) <= 64 ? 8 : 4)
#define TK_FA2_BWD_NARROW_WARPS(D) 4
#define TK_FA2_BWD_WIDE(D) ((D) <= 64 ? 64 : 32), 2, TK_FA2_BWD_WIDE_WARPS(D)
#define TK_FA2_BWD_NARROW(D) ((D) <= 64 ? 64 : 16), 1, TK_FA2_BWD_NARROW_WARPS(D)

// The plan of each head size and tiling, for the backend's test that its own copy of it
// (MmaPlan) agrees: per head of 64, 80, 96 and 128 columns, wide then narrow, the forward's
// rows a block, its shared bytes, the backward's keys a block and its shared bytes (32
// values; nothing is written into an `out` of fewer, `len`).
template <int D>
__device__ void fa2_plan(int* out) {
    out[0] = Fa2Fwd<D, TK_FA2_FWD_WIDE(D)>::BM;
    out[1] = Fa2Fwd<D, TK_FA2_FWD_WIDE(D)>::SHARED;
    out[2] = Fa2Bwd<D, TK_FA2_BWD_WIDE(D)>::BN;
    out[3] = Fa2Bwd<D, TK_FA2_BWD_WIDE(D)>::SHARED;
    out[4] = Fa2Fwd<D, TK_FA2_FWD_NARROW(D)>::BM;
    out[5] = Fa2Fwd<D, TK_FA2_FWD_NARROW(D)>::SHARED;
    out[6] = Fa2Bwd<D, TK_FA2_BWD_NARROW(D)>::BN;
    out[7] = Fa2Bwd<D, TK_FA2_BWD_NARROW(D)>::SHARED;
}
extern "C" __global__ void flash_attention_mma_plan(int* out, int len) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && len >= 32) {
        fa2_plan<64>(out);
        fa2_plan<80>(out + 8);
        fa2_plan<96>(out + 16);
        fa2_plan<128>(out + 24);
    }
}

#define TK_FA2_TILED(T, N, D, TILING, FWD, BWD, BWD_WARPS)                                     \
    extern "C" __global__ void __launch_bounds__(FA2_THREADS)                                 \
        flash_attention_mma_forward_d##D##_##TILING##_##N(                                     \
            T* out, float* lse, const T* qkv, int batch, int t_len, int n_head, int n_kv,      \
            float scale, const unsigned* pos) {                                                \
        fa2_forward_impl<T, D, FWD(D)>(out, lse, qkv, batch, t_len, n_head, n_kv, scale, pos); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * BWD_WARPS(D))                           \
        flash_attention_mma_backward_d##D##_##TILING##_##N(                                    \
            float* dq_acc, T* dqkv, const T* dout, const float* lse, const float* delta,       \
            const T* qkv, int batch, int t_len, int n_head, int n_kv, float scale,             \
            const unsigned* pos) {                                                             \
        fa2_backward_impl<T, D, BWD(D)>(dq_acc, dqkv, dout, lse, delta, qkv, batch, t_len,     \
                                        n_head, n_kv, scale, pos);                             \
    }

#define TK_FA2_HEAD(T, N, D)                                                                   \
    TK_FA2_TILED(T, N, D, wide, TK_FA2_FWD_WIDE, TK_FA2_BWD_WIDE, TK_FA2_BWD_WIDE_WARPS)      \
    TK_FA2_TILED(T, N, D, narrow, TK_FA2_FWD_NARROW, TK_FA2_BWD_NARROW, TK_FA2_BWD_NARROW_WARPS)

#define TK_FA2(T, N)                                                                           \
    extern "C" __global__ void flash_attention_mma_backward_prep_##N(                          \
        float* delta, float* dq_acc, const T* dout, const T* out, int batch, int t_len,        \
        int n_head, int hd) {                                                                  \
        fa2_backward_prep_impl<T>(delta, dq_acc, dout, out, batch, t_len, n_head, hd);         \
    }                                                                                          \
    extern "C" __global__ void flash_attention_mma_backward_dq_##N(                            \
        T* dqkv, const float* dq_acc, int batch, int t_len, int n_head, int n_kv, int hd,      \
        float scale) {                                                                         \
        fa2_backward_dq_impl<T>(dqkv, dq_acc, batch, t_len, n_head, n_kv, hd, scale);          \
    }                                                                                          \
    TK_FA2_HEAD(T, N, 64)                                                                      \
    TK_FA2_HEAD(T, N, 80)                                                                      \
    TK_FA2_HEAD(T, N, 96)                                                                      \
    TK_FA2_HEAD(T, N, 128)
TK_FA2(bf16, bf16)
TK_FA2(f16, f16)
