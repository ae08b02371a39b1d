// GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise.
// CPU twin: src/ops/gelu/cpu.rs.
//
// Computed as the CPU computes it: 0.5·x·(1 + tanh(u)) written as x·σ(2u), one exponential
// (tk_exp, the CPU's exp) and one division; with --fmad=false the results are bitwise equal
// to the CPU's.

// gelu_value and gelu_grad live in common.cuh (GeGLU's gate uses them too).

template <typename T>
__device__ void gelu_impl(T* out, const T* x, i64 n) {
    TK_FOR_EACH(i, n) store(out, i, gelu_value(load(x, i)));
}

// dx = gelu'(x) · dout (overwrites dx).
template <typename T>
__device__ void gelu_backward_impl(T* dx, const T* x, const T* dout, i64 n) {
    TK_FOR_EACH(i, n) store(dx, i, gelu_grad(load(x, i)) * load(dout, i));
}

#define TK_GELU(T, N)                                                                       \
    extern "C" __global__ void gelu_##N(T* out, const T* x, i64 n) { gelu_impl<T>(out, x, n); } \
    extern "C" __global__ void gelu_backward_##N(T* dx, const T* x, const T* dout, i64 n) { \
        gelu_backward_impl<T>(dx, x, dout, n);                                              \
    }
TK_DTYPES(TK_GELU)
