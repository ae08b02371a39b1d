// Shared by every kernel file: trainkit prepends this to each .cu source before NVRTC
// compiles it (the sources are embedded in the binary, so there is no include directory
// of trainkit's own at run time).
//
// Conventions, the same as the CPU backend in src/device/cpu/:
// - arithmetic is f32; a bf16 or f16 value is widened exactly when loaded and rounded to
//   nearest even only when stored (`store`), at the points where the CPU twin rounds;
// - NVRTC compiles with --fmad=false, so `a * b + c` is two roundings as in Rust; a kernel
//   that wants a fused multiply-add says so with fmaf;
// - reductions that the CPU runs in 16 interleaved lanes (src/device/cpu/simd.rs) run on
//   16 threads of a half-warp: lane i adds elements i, i + 16, i + 32, ... in order, then
//   the lanes are combined pairwise at distances 8, 4, 2, 1, which is the CPU's order, so
//   these sums are bitwise equal to the CPU's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;
typedef long long i64;

// ---------------------------------------------------------------------------------------
// Loads and stores in f32.

__device__ __forceinline__ float load(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ float load(const f16* p, i64 i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(f16* p, i64 i, float v) { p[i] = __float2half_rn(v); }

// ---------------------------------------------------------------------------------------
// Grid-stride loops.

__device__ __forceinline__ i64 global_thread() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ i64 global_threads() { return (i64)gridDim.x * blockDim.x; }

#define TK_FOR_EACH(i, n) for (i64 i = global_thread(); i < (n); i += global_threads())

// ---------------------------------------------------------------------------------------
// Half-warp rows: 16 lanes per row, as the CPU's 16-lane accumulators. Every thread of a
// half-warp runs the same number of loop trips, so the shuffles see all 16 lanes. Kernels
// that use them are launched with blockDim.x a multiple of 32 (any grid).

#define TK_LANES 16

// −∞ (NVRTC has no <cmath>, so no INFINITY): the CPU's starting value of a maximum.
#define TK_NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ int lane16() { return threadIdx.x & 15; }
__device__ __forceinline__ unsigned half_mask() { return 0xffffu << (threadIdx.x & 16); }
__device__ __forceinline__ i64 global_half_warp() { return global_thread() / TK_LANES; }
__device__ __forceinline__ i64 global_half_warps() { return global_threads() / TK_LANES; }

#define TK_FOR_EACH_ROW(row, rows) \
    for (i64 row = global_half_warp(); row < (rows); row += global_half_warps())

// The CPU's `reduce`: a[i] += a[i + w] for w = 8, 4, 2, 1. Lane i < w holds a[i] and
// receives a[i + w], so each addition has the CPU's operands in the CPU's order. Every lane
// ends with the total.
__device__ __forceinline__ float half_sum(float v) {
    const unsigned mask = half_mask();
#pragma unroll
    for (int w = 8; w > 0; w >>= 1) {
        v = v + __shfl_xor_sync(mask, v, w, TK_LANES);
    }
    return v;
}

// Maximum across the 16 lanes (order does not matter for a maximum).
__device__ __forceinline__ float half_max(float v) {
    const unsigned mask = half_mask();
#pragma unroll
    for (int w = 8; w > 0; w >>= 1) {
        float o = __shfl_xor_sync(mask, v, w, TK_LANES);
        v = o > v ? o : v;
    }
    return v;
}

// ---------------------------------------------------------------------------------------
// Warp rows: a warp per row for rows that are read at full bandwidth. Lane l holds 8
// consecutive elements of every 256, [256·t + 8·l, 256·t + 8·l + 8), read in 16-byte loads
// (one for bf16 and f16, two for f32) when the row allows. A sum over the row accumulates
// element e in slot e mod 256 (lane (e mod 256) / 8, register e mod 8) in order of e, then
// combines each lane's 8 slots pairwise at distances 4, 2, 1 and the lanes at distances 16,
// 8, 4, 2, 1: the order of the CPU's `simd::warp_reduce` over 256 slots, so these sums are
// bitwise equal to the CPU's. Kernels that use them are launched with blockDim.x a
// multiple of 32 (any grid).

#define TK_ROW_SLOTS 256

__device__ __forceinline__ i64 global_warp() { return global_thread() / 32; }
__device__ __forceinline__ i64 global_warps() { return global_threads() / 32; }

#define TK_FOR_EACH_WARP_ROW(row, rows) \
    for (i64 row = global_warp(); row < (rows); row += global_warps())

// Whether p is 16-byte aligned.
__device__ __forceinline__ bool aligned16(const void* p) {
    return ((unsigned long long)p & 15ull) == 0;
}

// v = p[0..8) widened to f32, in 16-byte loads (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8_vec(float (&v)[8], const T* __restrict__ p) {
    constexpr int per = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < 8; k += per) {
        const uint4 u = *reinterpret_cast<const uint4*>(p + k);
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int j = 0; j < per; ++j) v[k + j] = load(e, j);
    }
}

// p[0..8) = v rounded to T, in 16-byte stores (p 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store8_vec(T* __restrict__ p, const float (&v)[8]) {
    constexpr int per = 16 / sizeof(T);
#pragma unroll
    for (int k = 0; k < 8; k += per) {
        uint4 u;
        T* e = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int j = 0; j < per; ++j) store(e, j, v[k + j]);
        *reinterpret_cast<uint4*>(p + k) = u;
    }
}

// v = p[i..i + 8) widened to f32, elements at or past n read as 0: in 16-byte loads when
// `vec` (n a multiple of 8 and p 16-byte aligned, so a chunk that starts below n is whole).
template <typename T>
__device__ __forceinline__ void load8(float (&v)[8], const T* __restrict__ p, int i, int n,
                                      bool vec) {
    if (vec) {
        load8_vec(v, p + i);
    } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = i + m < n ? load(p, i + m) : 0.0f;
    }
}

// p[i..i + 8) = v, elements at or past n left alone; 16-byte stores when `vec`.
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, int i, int n, bool vec,
                                      const float (&v)[8]) {
    if (vec) {
        store8_vec(p + i, v);
    } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            if (i + m < n) store(p, i + m, v[m]);
        }
    }
}

// The row sum of slots accumulated as above: the lane's 8 slots pairwise at distances 4,
// 2, 1, then the lanes at 16, 8, 4, 2, 1. Every lane ends with the total.
__device__ __forceinline__ float warp_row_sum(const float (&a)[8]) {
    const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    float v = (b0 + b2) + (b1 + b3);
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, w);
    return v;
}

// Σ f(x) over a row of c elements, accumulated in the warp rows' slots and summed as
// `warp_row_sum` (the CPU's `simd::row_sum` and its kin); every lane ends with the total.
// `vec` as for `load8`.
template <typename T, typename F>
__device__ __forceinline__ float warp_row_reduce(const T* __restrict__ row, int c, bool vec,
                                                 F f) {
    const int lane = threadIdx.x & 31;
    float acc[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) acc[m] = 0.0f;
#pragma unroll 2
    for (int i = 8 * lane; i < c; i += TK_ROW_SLOTS) {
        float v[8];
        load8(v, row, i, c, vec);
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            if (!vec && i + m >= c) break;  // past the row's end: no term, as on the CPU
            acc[m] += f(v[m]);
        }
    }
    return warp_row_sum(acc);
}

// ---------------------------------------------------------------------------------------
// Column sums in two passes (the norms' parameter gradients, the bias gradient), without
// atomics and in the CPU's order, so bitwise equal to it: rows in blocks of
// TK_GRAD_ROW_BLOCK (the CPU's `ROW_BLOCK`), each block's column sums in row order into an
// f32 workspace [blocks, n] (a thread per block and 8 adjacent columns, 16-byte loads
// where the row allows, so a warp reads 256 columns of a row at once); then per column
// the blocks in order from 0 (`tk_column_total`).

#define TK_GRAD_ROW_BLOCK 32
#define TK_FINISH_CHUNK 128

// Row blocks of a column reduction over `rows` rows.
__device__ __forceinline__ i64 tk_row_blocks(i64 rows) {
    return (rows + TK_GRAD_ROW_BLOCK - 1) / TK_GRAD_ROW_BLOCK;
}

// Rows in block `blk` of `rows`.
__device__ __forceinline__ int tk_block_rows(i64 blk, i64 rows) {
    return (int)min((i64)TK_GRAD_ROW_BLOCK, rows - blk * TK_GRAD_ROW_BLOCK);
}

// The first pass of K column sums over a [rows, c] matrix (K = 2: a layer norm's weight
// and bias gradients): per row block and 8 adjacent columns, `row(acc, r, col)` adds row
// r's terms of those columns to acc[0 .. K), rows in order (a full block unrolled so that
// many rows' loads are in flight), then partial[K·blk + k, col ..] = acc[k] (16-byte
// stores when VEC). A thread per (row block, 8 columns), grid-stride.
template <int K, bool VEC, typename Row>
__device__ __forceinline__ void tk_column_partials(float* __restrict__ partial, i64 rows,
                                                   int c, Row row) {
    const i64 groups = (c + 7) / 8;
    TK_FOR_EACH(i, tk_row_blocks(rows) * groups) {
        const i64 blk = i / groups, r0 = blk * TK_GRAD_ROW_BLOCK;
        const int col = 8 * (int)(i % groups), n = tk_block_rows(blk, rows);
        float acc[K][8];
#pragma unroll
        for (int k = 0; k < K; ++k) {
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[k][m] = 0.0f;
        }
        if (n == TK_GRAD_ROW_BLOCK) {
#pragma unroll 8
            for (int r = 0; r < TK_GRAD_ROW_BLOCK; ++r) row(acc, r0 + r, col);
        } else {
            for (int r = 0; r < n; ++r) row(acc, r0 + r, col);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) store8(partial + (K * blk + k) * c, col, c, VEC, acc[k]);
    }
}

// The groups of 32 columns of an n-column total, a CUDA block each, grid-stride (the
// same `g` for every thread of a block, as `tk_column_total` needs).
#define TK_FOR_EACH_COLUMN_TOTAL(g, n) \
    for (i64 g = blockIdx.x; g < ((n) + 31) / 32; g += gridDim.x)

// acc + partial[0, col] + partial[1, col] + ... + partial[blocks - 1, col], in block
// order, for col = 32·g + lane: called by every thread of a block (blockDim.x a multiple
// of 32) with the same g. The warps stage up to TK_FINISH_CHUNK blocks' 32 columns at a
// time in shared memory (coalesced, every load in flight at once), then warp 0 adds them,
// a column a lane; its lanes return the totals (the other warps' results mean nothing).
__device__ __forceinline__ float tk_column_total(const float* __restrict__ partial,
                                                 i64 blocks, i64 n, i64 g, float acc) {
    __shared__ float tile[TK_FINISH_CHUNK][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const i64 col = 32 * g + lane;
    for (i64 b0 = 0; b0 < blocks; b0 += TK_FINISH_CHUNK) {
        const int m = (int)min((i64)TK_FINISH_CHUNK, blocks - b0);
        for (int b = warp; b < m; b += warps) {
            tile[b][lane] = col < n ? partial[(b0 + b) * n + col] : 0.0f;
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll 8
            for (int b = 0; b < m; ++b) acc += tile[b][lane];
        }
        __syncthreads();
    }
    return acc;
}

// ---------------------------------------------------------------------------------------
// Counter-based random bits, as the CPU's `rng::counter_bits`: the (i + 1)-th number of the
// SplitMix64 stream seeded with `key` (its finalizer of key + (i + 1)·γ). No state: the
// same bits on every device and thread count, in a recomputation and after a resume.
__device__ __forceinline__ unsigned long long tk_counter_bits(unsigned long long key, i64 i) {
    unsigned long long z = key + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// ---------------------------------------------------------------------------------------
// exp, the CPU's `simd::exp` operation for operation: the same clamp, the same Cody-Waite
// reduction and degree-7 polynomial, the same constants (hex literals of the CPU's f32
// values). With --fmad=false every step rounds as on the CPU, so the results are equal
// bit for bit; CUDA's own expf differs by an ulp here and there.
__device__ __forceinline__ float tk_exp(float x) {
    // Rust's clamp: NaN stays NaN.
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    const float log2e = 0x1.715476p+0f;
    const float ln2_hi = 0x1.62e400p-1f;
    const float ln2_lo = 0x1.7f7d1cp-20f;
    const float rounder = 0x1.800000p+23f;  // 1.5 * 2^23
    float big = x * log2e + rounder;
    float n = big - rounder;
    float r = (x - n * ln2_hi) - n * ln2_lo;
    float p = 0x1.a01a02p-13f;       // 1/5040
    p = p * r + 0x1.6c16c2p-10f;     // 1/720
    p = p * r + 0x1.111112p-7f;      // 1/120
    p = p * r + 0x1.555556p-5f;      // 1/24
    p = p * r + 0x1.555556p-3f;      // 1/6
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    unsigned bits = ((__float_as_uint(big) - __float_as_uint(rounder)) + 127u) << 23;
    return p * __uint_as_float(bits);
}

// ---------------------------------------------------------------------------------------
// GELU with the tanh approximation (GPT-2's `gelu_new`), as the CPU computes it (see
// gelu.cu): used by gelu.cu and by GeGLU's gate (geglu.cu).

#define TK_SQRT_2_OVER_PI 0x1.988454p-1f  // 0.7978846
#define TK_GELU_COEF 0x1.6e4e26p-5f       // 0.044715
#define TK_GELU_COEF3 0x1.12ba9cp-3f      // 3 · 0.044715, rounded to f32 as the CPU does

__device__ __forceinline__ float gelu_value(float x) {
    float u = TK_SQRT_2_OVER_PI * (x + TK_GELU_COEF * x * x * x);
    return x / (1.0f + tk_exp(-2.0f * u));
}

// With s = σ(2u): s + 2·x·s·(1 − s)·u'(x).
__device__ __forceinline__ float gelu_grad(float x) {
    float x2 = x * x;
    float u = TK_SQRT_2_OVER_PI * (x + TK_GELU_COEF * x2 * x);
    float s = 1.0f / (1.0f + tk_exp(-2.0f * u));
    float du = TK_SQRT_2_OVER_PI * (1.0f + TK_GELU_COEF3 * x2);
    return s + 2.0f * x * s * (1.0f - s) * du;
}

// ---------------------------------------------------------------------------------------
// Tensor cores (the fused attention's two kernel files). TK_HAS_MMA: whether this target
// runs mma.sync with 16-bit operands (sm_80 and later, and the emulator).

#if defined(TRAINKIT_EMU_H) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define TK_HAS_MMA 1
#else
#define TK_HAS_MMA 0
#endif

// d[0..4] += A · B for one warp: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32,
// the operands' type chosen by the last argument (A: four registers, B: two, each two
// 16-bit values, in the instruction's fragment layout). The emulator runs its host model
// of the instruction (kernels/emu/emu.h), which takes the same fragments.
__device__ __forceinline__ void tk_mma(float* d, const unsigned* a, const unsigned* b, bf16) {
#if defined(TRAINKIT_EMU_H)
    ::tk_emu::mma_m16n8k16_bf16(d, a, b);
#elif TK_HAS_MMA
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
__device__ __forceinline__ void tk_mma(float* d, const unsigned* a, const unsigned* b, f16) {
#if defined(TRAINKIT_EMU_H)
    ::tk_emu::mma_m16n8k16_f16(d, a, b);
#elif TK_HAS_MMA
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The maximum and the sum over the four lanes that share a row of an mma fragment.
__device__ __forceinline__ float tk_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float tk_quad_sum(float v) {
    v = v + __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---------------------------------------------------------------------------------------
// Instantiation: each kernel is a template `NAME_impl<...>` and extern "C" wrappers give
// every dtype combination a fixed name, `NAME_<dtype>[_<dtype>...]`, that the Rust side
// loads.

#define TK_DTYPES(X) X(float, f32) X(bf16, bf16) X(f16, f16)
