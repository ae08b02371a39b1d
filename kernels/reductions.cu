// Reductions over whole tensors. CPU twins: `sum_squares` in src/device/cpu/elementwise.rs,
// `grad_guard` in src/optim/guard/cpu.rs.
//
// Sum of squares for the global gradient norm, in f64 on the device, in two passes
// without atomics: `sum_squares_partial_*` (any grid; blockDim a multiple of 32, at most
// 1024) leaves one f64 partial per block, summed by a grid-stride loop per thread and
// a shuffle tree per block; `sum_squares_finish` (one block of 32 threads) adds the
// partials. The result is deterministic for a given launch configuration. The squares of
// f32 values are exact in f64, so it differs from the CPU's (a fixed-chunk order) only by
// f64 rounding in the order of additions, about 1e-16 relative.

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) v += __shfl_xor_sync(0xffffffffu, v, w);
    return v;
}

template <typename T>
__device__ void sum_squares_partial_impl(double* partial, const T* x, i64 n) {
    __shared__ double warps[32];
    double acc = 0.0;
    TK_FOR_EACH(i, n) {
        double v = (double)load(x, i);
        acc += v * v;
    }
    acc = warp_sum_f64(acc);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warps[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x / 32;
        double v = lane < n_warps ? warps[lane] : 0.0;
        v = warp_sum_f64(v);
        if (lane == 0) partial[blockIdx.x] = v;
    }
}

// out[0] = Σ partial[0 .. n_partial], lane-strided then a shuffle tree (one warp).
extern "C" __global__ void sum_squares_finish(double* out, const double* partial,
                                              i64 n_partial) {
    double acc = 0.0;
    for (i64 i = threadIdx.x; i < n_partial; i += 32) acc += partial[i];
    acc = warp_sum_f64(acc);
    if (threadIdx.x == 0) out[0] = acc;
}

// Many tensors in one launch: `sum_squares_multi_*` leaves, for each of up to
// TK_SQUARES_TENSORS tensors of one dtype, the partials `sum_squares_partial_*` would leave
// with a grid of `grid` blocks, at partial[slot ..]: block b of the launch takes the b-th
// block of the tensors' grids in order, and walks its tensor as that block would (the same
// elements in the same order, the same reduction), so the partials are bitwise the same.
#define TK_SQUARES_TENSORS 32

struct SquaresTensor {
    const void* x;
    i64 n;
    i64 slot;
    i64 grid;
};

struct SquaresTable {
    SquaresTensor t[TK_SQUARES_TENSORS];
    i64 count;
};

// The sum of the block's threads' values in warp 0's lane 0 (the partial kernels' tree).
__device__ __forceinline__ double block_sum_f64(double acc) {
    __shared__ double warps[32];
    acc = warp_sum_f64(acc);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warps[warp] = acc;
    __syncthreads();
    double v = 0.0;
    if (warp == 0) {
        const int n_warps = blockDim.x / 32;
        v = lane < n_warps ? warps[lane] : 0.0;
        v = warp_sum_f64(v);
    }
    return v;
}

template <typename T>
__device__ void sum_squares_multi_impl(double* partial, const SquaresTable& tab) {
    i64 b = blockIdx.x;
    int k = 0;
    for (; k < (int)tab.count; ++k) {
        if (b < tab.t[k].grid) break;
        b -= tab.t[k].grid;
    }
    // The same for every thread of the block: none waits at the barrier alone.
    if (k >= (int)tab.count) return;
    const T* x = static_cast<const T*>(tab.t[k].x);
    const i64 n = tab.t[k].n, stride = tab.t[k].grid * (i64)blockDim.x;
    double acc = 0.0;
    for (i64 i = b * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        double v = (double)load(x, i);
        acc += v * v;
    }
    const double v = block_sum_f64(acc);
    if (threadIdx.x == 0) partial[tab.t[k].slot + b] = v;
}

#define TK_SUM_SQUARES(T, N)                                                                \
    extern "C" __global__ void sum_squares_partial_##N(double* partial, const T* x, i64 n) { \
        sum_squares_partial_impl<T>(partial, x, n);                                         \
    }                                                                                       \
    extern "C" __global__ void sum_squares_multi_##N(double* partial, SquaresTable tab) {   \
        sum_squares_multi_impl<T>(partial, tab);                                            \
    }
TK_DTYPES(TK_SUM_SQUARES)

// The step's gradient guard (CPU twin: src/optim/guard/cpu.rs), one block of 32 threads:
//   norm  = sqrt(Σ partial) / loss_scale        (the gradients' squares, from
//                                                sum_squares_partial_*, one per block)
//   loss  = Σ losses[0 .. n_losses]              (f64, the step's per-row losses)
//   scale = clip(norm) / loss_scale when norm and loss are finite, else NaN, where
//   clip(norm) = min(1, max_norm / (norm + 1e-6)) when max_norm > 0, else 1
//           (PyTorch's clip_grad_norm_ coefficient)
// record = [scale, norm, loss] as f32. AdamW reads record[0] and skips its update when it
// is not finite, so a bad step never reaches the weights and the host does not wait.
extern "C" __global__ void grad_guard(float* record, const double* partial, i64 n_partial,
                                      const float* losses, i64 n_losses, float max_norm,
                                      float loss_scale) {
    double ss = 0.0, loss = 0.0;
    for (i64 i = threadIdx.x; i < n_partial; i += 32) ss += partial[i];
    for (i64 i = threadIdx.x; i < n_losses; i += 32) loss += (double)losses[i];
    ss = warp_sum_f64(ss);
    loss = warp_sum_f64(loss);
    if (threadIdx.x == 0) {
        const double norm = sqrt(ss) / (double)loss_scale;
        float scale = __uint_as_float(0x7fc00000u);
        if (isfinite(norm) && isfinite(loss)) {
            float coef = 1.0f;
            if (max_norm > 0.0f) {
                const double c = (double)max_norm / (norm + 1e-6);
                coef = (float)(c < 1.0 ? c : 1.0);
            }
            scale = coef / loss_scale;
        }
        record[0] = scale;
        record[1] = (float)norm;
        record[2] = (float)loss;
    }
}
