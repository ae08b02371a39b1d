// GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise.
// CPU twin: src/ops/gelu/cpu.rs.
//
// Computed as the CPU computes it: 0.5·x·(1 + tanh(u)) written as x·σ(2u), one exponential
// (tk_exp, the CPU's exp) and one division; with --fmad=false the results are bitwise equal
// to the CPU's.

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
