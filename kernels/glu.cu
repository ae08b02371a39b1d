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
// dup = dout · g · σ(g), σ(g) computed once for both.
struct SiluGate {
    static __device__ float sigmoid(float g) { return 1.0f / (1.0f + tk_exp(-g)); }
    static __device__ float act(float g) { return g * sigmoid(g); }
    static __device__ void grads(float d, float u, float g, float& dgate, float& dup) {
        const float s = sigmoid(g);
        dgate = (d * u) * s * (1.0f + g * (1.0f - s));
        dup = d * g * s;
    }
};

// GeGLU: act(g) = gelu(g); dgate = (dout · u) · gelu'(g), dup = dout · gelu(g).
struct GeluGate {
    static __device__ float act(float g) { return gelu_value(g); }
    static __device__ void grads(float d, float u, float g, float& dgate, float& dup) {
        dgate = (d * u) * gelu_grad(g);
        dup = d * gelu_value(g);
    }
};

// Each thread takes 8 consecutive columns of a row: 16-byte loads and stores when the rows
// allow (F a multiple of 8, the buffers aligned), element by element otherwise; 32-bit
// index arithmetic where the chunks number fewer than 2^31.
__device__ __forceinline__ void glu_chunk(i64 idx, i64 per_row, bool narrow, i64& row,
                                          int& col) {
    if (narrow) {
        row = (unsigned)idx / (unsigned)per_row;
        col = 8 * (int)((unsigned)idx % (unsigned)per_row);
    } else {
        row = idx / per_row;
        col = 8 * (int)(idx % per_row);
    }
}

// out[r, i] = act(g) · u.
template <typename Gate, typename T>
__device__ void glu_impl(T* out, const T* gate_up, i64 rows, i64 f) {
    const int n = (int)f;
    const i64 per_row = (f + 7) / 8, chunks = rows * per_row;
    const bool narrow = chunks <= 0x7fffffff;
    const bool vec = f % 8 == 0 && aligned16(out) && aligned16(gate_up);
    TK_FOR_EACH(idx, chunks) {
        i64 r;
        int i;
        glu_chunk(idx, per_row, narrow, r, i);
        const T* gu = gate_up + r * 2 * f;
        float g[8], u[8], o[8];
        load8(g, gu, i, n, vec);
        load8(u, gu + f, i, n, vec);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = Gate::act(g[j]) * u[j];
        store8(out + r * f, i, n, vec, o);
    }
}

// The gate's and the up projection's gradients, side by side.
template <typename Gate, typename T>
__device__ void glu_backward_impl(T* dgate_up, const T* dout, const T* gate_up, i64 rows,
                                  i64 f) {
    const int n = (int)f;
    const i64 per_row = (f + 7) / 8, chunks = rows * per_row;
    const bool narrow = chunks <= 0x7fffffff;
    const bool vec =
        f % 8 == 0 && aligned16(dgate_up) && aligned16(dout) && aligned16(gate_up);
    TK_FOR_EACH(idx, chunks) {
        i64 r;
        int i;
        glu_chunk(idx, per_row, narrow, r, i);
        const T* gu = gate_up + r * 2 * f;
        T* dgu = dgate_up + r * 2 * f;
        float g[8], u[8], d[8], dg[8], du[8];
        load8(g, gu, i, n, vec);
        load8(u, gu + f, i, n, vec);
        load8(d, dout + r * f, i, n, vec);
#pragma unroll
        for (int j = 0; j < 8; ++j) Gate::grads(d[j], u[j], g[j], dg[j], du[j]);
        store8(dgu, i, n, vec, dg);
        store8(dgu + f, i, n, vec, du);
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
