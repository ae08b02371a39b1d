// SwiGLU's gate over a fused [rows, 2F] projection: the gate in the first F columns, the up
// projection in the last F. CPU twin: src/ops/swiglu/cpu.rs.
//
// σ(g) = 1 / (1 + e^(−g)) with tk_exp, the CPU's `simd::exp`; with --fmad=false every
// product rounds as on the CPU, so the results are bitwise equal.

// out[r, i] = silu(g) · u = g · σ(g) · u.
template <typename T>
__device__ void swiglu_impl(T* out, const T* gate_up, i64 rows, i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        const float s = 1.0f / (1.0f + tk_exp(-g));
        store(out, idx, g * s * u);
    }
}

// dgate = dout · u · σ(g) · (1 + g · (1 − σ(g))), dup = dout · g · σ(g), side by side.
template <typename T>
__device__ void swiglu_backward_impl(T* dgate_up, const T* dout, const T* gate_up, i64 rows,
                                     i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        const float d = load(dout, idx);
        const float s = 1.0f / (1.0f + tk_exp(-g));
        store(dgate_up, r * 2 * f + i, d * u * s * (1.0f + g * (1.0f - s)));
        store(dgate_up, r * 2 * f + f + i, d * g * s);
    }
}

#define TK_SWIGLU(T, N)                                                                     \
    extern "C" __global__ void swiglu_##N(T* out, const T* gate_up, i64 rows, i64 f) {      \
        swiglu_impl<T>(out, gate_up, rows, f);                                              \
    }                                                                                       \
    extern "C" __global__ void swiglu_backward_##N(T* dgate_up, const T* dout,              \
                                                   const T* gate_up, i64 rows, i64 f) {     \
        swiglu_backward_impl<T>(dgate_up, dout, gate_up, rows, f);                          \
    }
TK_DTYPES(TK_SWIGLU)
