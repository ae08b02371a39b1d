// GeGLU's gate over a fused [rows, 2F] projection: the gate in the first F columns, the up
// projection in the last F (Gemma's MLP). CPU twin: src/ops/geglu/cpu.rs.
//
// gelu_value and gelu_grad (common.cuh) compute the tanh GELU as the CPU does; with
// --fmad=false every product rounds as on the CPU, so the results are bitwise equal.

// out[r, i] = gelu(g) · u.
template <typename T>
__device__ void geglu_impl(T* out, const T* gate_up, i64 rows, i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        store(out, idx, gelu_value(g) * u);
    }
}

// dgate = dout · u · gelu'(g), dup = dout · gelu(g), side by side.
template <typename T>
__device__ void geglu_backward_impl(T* dgate_up, const T* dout, const T* gate_up, i64 rows,
                                    i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        const float d = load(dout, idx);
        store(dgate_up, r * 2 * f + i, d * u * gelu_grad(g));
        store(dgate_up, r * 2 * f + f + i, d * gelu_value(g));
    }
}

#define TK_GEGLU(T, N)                                                                      \
    extern "C" __global__ void geglu_##N(T* out, const T* gate_up, i64 rows, i64 f) {       \
        geglu_impl<T>(out, gate_up, rows, f);                                               \
    }                                                                                       \
    extern "C" __global__ void geglu_backward_##N(T* dgate_up, const T* dout,               \
                                                  const T* gate_up, i64 rows, i64 f) {      \
        geglu_backward_impl<T>(dgate_up, dout, gate_up, rows, f);                           \
    }
TK_DTYPES(TK_GEGLU)
