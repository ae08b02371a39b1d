// Gated linear units over a fused [rows, 2F] projection: the gate in the first F columns,
// the up projection in the last F. SwiGLU (Llama's MLP, `silu(g) · u`) and GeGLU (Gemma's,
// `gelu(g) · u` with the tanh GELU) share the kernels; a gate is a struct of three device
// functions. Kernels: swiglu_<dtype>, swiglu_backward_<dtype>, geglu_<dtype> and
// geglu_backward_<dtype>. CPU twin: src/ops/glu/cpu.rs.
//
// σ(g) = 1 / (1 + e^(−g)) with tk_exp, the CPU's `simd::exp`; gelu_value and gelu_grad
// (common.cuh) compute the tanh GELU as the CPU does. With --fmad=false every product
// rounds as on the CPU, in the CPU's order, so the results are bitwise equal.

// SwiGLU: act(g) = g · σ(g); dgate = (dout · u) · σ(g) · (1 + g · (1 − σ(g))),
// dup = dout · g · σ(g).
struct SiluGate {
    static __device__ float act(float g) { return g * (1.0f / (1.0f + tk_exp(-g))); }
    static __device__ float dgate(float du, float g) {
        const float s = 1.0f / (1.0f + tk_exp(-g));
        return du * s * (1.0f + g * (1.0f - s));
    }
    static __device__ float dup(float d, float g) {
        const float s = 1.0f / (1.0f + tk_exp(-g));
        return d * g * s;
    }
};

// GeGLU: act(g) = gelu(g); dgate = (dout · u) · gelu'(g), dup = dout · gelu(g).
struct GeluGate {
    static __device__ float act(float g) { return gelu_value(g); }
    static __device__ float dgate(float du, float g) { return du * gelu_grad(g); }
    static __device__ float dup(float d, float g) { return d * gelu_value(g); }
};

// out[r, i] = act(g) · u.
template <typename Gate, typename T>
__device__ void glu_impl(T* out, const T* gate_up, i64 rows, i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        store(out, idx, Gate::act(g) * u);
    }
}

// The gate's and the up projection's gradients, side by side.
template <typename Gate, typename T>
__device__ void glu_backward_impl(T* dgate_up, const T* dout, const T* gate_up, i64 rows,
                                  i64 f) {
    TK_FOR_EACH(idx, rows * f) {
        const i64 r = idx / f, i = idx % f;
        const float g = load(gate_up, r * 2 * f + i), u = load(gate_up, r * 2 * f + f + i);
        const float d = load(dout, idx);
        store(dgate_up, r * 2 * f + i, Gate::dgate(d * u, g));
        store(dgate_up, r * 2 * f + f + i, Gate::dup(d, g));
    }
}

#define TK_GLU(NAME, GATE, T, N)                                                            \
    extern "C" __global__ void NAME##_##N(T* out, const T* gate_up, i64 rows, i64 f) {      \
        glu_impl<GATE, T>(out, gate_up, rows, f);                                           \
    }                                                                                       \
    extern "C" __global__ void NAME##_backward_##N(T* dgate_up, const T* dout,              \
                                                   const T* gate_up, i64 rows, i64 f) {     \
        glu_backward_impl<GATE, T>(dgate_up, dout, gate_up, rows, f);                       \
    }
#define TK_SWIGLU(T, N) TK_GLU(swiglu, SiluGate, T, N)
#define TK_GEGLU(T, N) TK_GLU(geglu, GeluGate, T, N)
TK_DTYPES(TK_SWIGLU)
TK_DTYPES(TK_GEGLU)
