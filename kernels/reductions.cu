// Reductions over whole tensors. CPU twin: `sum_squares` in src/device/cpu/elementwise.rs.
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

#define TK_SUM_SQUARES(T, N)                                                                \
    extern "C" __global__ void sum_squares_partial_##N(double* partial, const T* x, i64 n) { \
        sum_squares_partial_impl<T>(partial, x, n);                                         \
    }
TK_DTYPES(TK_SUM_SQUARES)
