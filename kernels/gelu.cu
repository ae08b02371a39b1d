// GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise.
// CPU twin: src/ops/gelu/cpu.rs.
//
// Computed as the CPU computes it: 0.5·x·(1 + tanh(u)) written as x·σ(2u), one exponential
// (tk_exp, the CPU's exp) and one division; with --fmad=false the results are bitwise equal
// to the CPU's.

// gelu_value and gelu_grad live in common.cuh (GeGLU's gate uses them too).

// Each thread takes 8 consecutive elements at a time: in 16-byte loads and stores where the
// buffers are aligned and the 8 are whole, else one by one (the same values either way).
template <typename T>
__device__ void gelu_impl(T* __restrict__ out, const T* __restrict__ x, i64 n) {
    const bool vec = aligned16(out) && aligned16(x);
    TK_FOR_EACH(c, (n + 7) / 8) {
        const i64 i = 8 * c;
        if (vec && i + 8 <= n) {
            float v[8];
            load8_vec(v, x + i);
#pragma unroll
            for (int m = 0; m < 8; ++m) v[m] = gelu_value(v[m]);
            store8_vec(out + i, v);
        } else {
            for (i64 j = i; j < n && j < i + 8; ++j) store(out, j, gelu_value(load(x, j)));
        }
    }
}

// dx = gelu'(x) · dout (overwrites dx), 8 elements a thread as above.
template <typename T>
__device__ void gelu_backward_impl(T* __restrict__ dx, const T* __restrict__ x,
                                   const T* __restrict__ dout, i64 n) {
    const bool vec = aligned16(dx) && aligned16(x) && aligned16(dout);
    TK_FOR_EACH(c, (n + 7) / 8) {
        const i64 i = 8 * c;
        if (vec && i + 8 <= n) {
            float v[8], d[8];
            load8_vec(v, x + i);
            load8_vec(d, dout + i);
#pragma unroll
            for (int m = 0; m < 8; ++m) v[m] = gelu_grad(v[m]) * d[m];
            store8_vec(dx + i, v);
        } else {
            for (i64 j = i; j < n && j < i + 8; ++j) {
                store(dx, j, gelu_grad(load(x, j)) * load(dout, j));
            }
        }
    }
}

// d = gelu'(x) · d in place: a product's output carried back through the GELU (the
// composed form of cuBLASLt's DGELU epilogue), 8 elements a thread as above.
template <typename T>
__device__ void gelu_backward_inplace_impl(T* __restrict__ d, const T* __restrict__ x, i64 n) {
    const bool vec = aligned16(d) && aligned16(x);
    TK_FOR_EACH(c, (n + 7) / 8) {
        const i64 i = 8 * c;
        if (vec && i + 8 <= n) {
            float v[8], g[8];
            load8_vec(v, x + i);
            load8_vec(g, d + i);
#pragma unroll
            for (int m = 0; m < 8; ++m) v[m] = gelu_grad(v[m]) * g[m];
            store8_vec(d + i, v);
        } else {
            for (i64 j = i; j < n && j < i + 8; ++j) {
                store(d, j, gelu_grad(load(x, j)) * load(d, j));
            }
        }
    }
}

#define TK_GELU(T, N)                                                                       \
    extern "C" __global__ void gelu_##N(T* out, const T* x, i64 n) { gelu_impl<T>(out, x, n); } \
    extern "C" __global__ void gelu_backward_##N(T* dx, const T* x, const T* dout, i64 n) { \
        gelu_backward_impl<T>(dx, x, dout, n);                                              \
    }                                                                                       \
    extern "C" __global__ void gelu_backward_inplace_##N(T* d, const T* x, i64 n) {         \
        gelu_backward_inplace_impl<T>(d, x, n);                                             \
    }
TK_DTYPES(TK_GELU)
