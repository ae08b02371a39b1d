// The plain product: what runs when cuBLASLt has no algorithm for a product. Column-major,
// as cuBLASLt takes it (src/device/cuda/ops/matmul.rs):
//
//   D = alpha · op(A) · op(B) + beta · D (+ bias[i] on row i of D)
//
// op(A) is m × k, stored k × m when trans_a (leading dimension lda); op(B) is k × n, stored
// n × k when trans_b. A block of 256 threads computes 16 × 16 tiles of D in a grid-stride
// loop, staging 16 × 16 tiles of op(A) and op(B) in shared memory; each element
// accumulates in f32 with one fused multiply-add per term, in the order of k, and is
// rounded once at the store. Slow beside cuBLASLt, and correct for every shape.
// CPU twin: the CPU backend's product (src/device/cpu/matmul.rs).

#define TK_PLAIN_TILE 16

template <typename TA, typename TD>
__device__ void gemm_plain_impl(int trans_a, int trans_b, i64 m, i64 n, i64 k, const TA* a,
                                i64 lda, const TA* b, i64 ldb, TD* d, i64 ldd, const TD* bias,
                                float alpha, float beta) {
    __shared__ float sa[TK_PLAIN_TILE][TK_PLAIN_TILE + 1];
    __shared__ float sb[TK_PLAIN_TILE][TK_PLAIN_TILE + 1];
    const int tx = threadIdx.x % TK_PLAIN_TILE, ty = threadIdx.x / TK_PLAIN_TILE;
    const i64 tiles_m = (m + TK_PLAIN_TILE - 1) / TK_PLAIN_TILE;
    const i64 tiles = tiles_m * ((n + TK_PLAIN_TILE - 1) / TK_PLAIN_TILE);
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const i64 i0 = (t % tiles_m) * TK_PLAIN_TILE, j0 = (t / tiles_m) * TK_PLAIN_TILE;
        float acc = 0.0f;
        for (i64 l0 = 0; l0 < k; l0 += TK_PLAIN_TILE) {
            // sa[y][x] = op(A)[i0 + x, l0 + y]; sb[y][x] = op(B)[l0 + x, j0 + y].
            const i64 ar = i0 + tx, ac = l0 + ty;
            sa[ty][tx] = (ar < m && ac < k) ? load(a, trans_a ? ac + ar * lda : ar + ac * lda)
                                            : 0.0f;
            const i64 br = l0 + tx, bc = j0 + ty;
            sb[ty][tx] = (br < k && bc < n) ? load(b, trans_b ? bc + br * ldb : br + bc * ldb)
                                            : 0.0f;
            __syncthreads();
            const i64 steps = k - l0 < TK_PLAIN_TILE ? k - l0 : TK_PLAIN_TILE;
            for (i64 l = 0; l < steps; ++l) acc = fmaf(sa[l][tx], sb[ty][l], acc);
            __syncthreads();
        }
        const i64 i = i0 + tx, j = j0 + ty;
        if (i < m && j < n) {
            const i64 at = i + j * ldd;
            float v = alpha * acc;
            if (beta != 0.0f) v += beta * load(d, at);
            if (bias) v += load(bias, i);
            store(d, at, v);
        }
    }
}

#define TK_GEMM_PLAIN(TA, NA, TD, ND)                                                          \
    extern "C" __global__ void gemm_plain_##NA##_##ND(                                         \
        int trans_a, int trans_b, i64 m, i64 n, i64 k, const TA* a, i64 lda, const TA* b,      \
        i64 ldb, TD* d, i64 ldd, const TD* bias, float alpha, float beta) {                    \
        gemm_plain_impl<TA, TD>(trans_a, trans_b, m, n, k, a, lda, b, ldb, d, ldd, bias, alpha, \
                                beta);                                                         \
    }
// The operand and output types cuBLASLt is asked for (src/device/cuda/ops/matmul.rs).
TK_GEMM_PLAIN(float, f32, float, f32)
TK_GEMM_PLAIN(bf16, bf16, bf16, bf16)
TK_GEMM_PLAIN(bf16, bf16, float, f32)
TK_GEMM_PLAIN(f16, f16, f16, f16)
TK_GEMM_PLAIN(f16, f16, float, f32)
