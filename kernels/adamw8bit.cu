// The 8-bit AdamW update: both moments stored block-wise quantized (one u8 code per
// element, one f32 absolute maximum per block of 256), dequantized, updated in f32 as
// adamw.cu updates them, and requantized, in one pass.
// CPU twin: src/optim/adamw8bit/cpu.rs (update) and src/optim/adamw8bit/quantize.rs (codes).
//
// One block of 256 threads per quantization block, one element per thread (a grid-stride
// loop over quantization blocks). Each block first builds the two code tables in shared
// memory with the CPU's formula and f32 operations (`code_value`), so they are the CPU's
// tables bit for bit; then each thread
//   m = beta1 · (signed[m_code] · m_absmax) + (1 − beta1) · g
//   v = beta2 · (unsigned[v_code] · v_absmax) + (1 − beta2) · g · g
//   p = p · decay − step_size · m / (sqrt(v) / bc2_sqrt + eps)
// the block's new maxima of |m| and |v| are reduced in shared memory (a maximum does not
// depend on the order, and every thread starts from max(0, |x|) as the CPU starts from
// 0), and each moment is requantized to its nearest code by the CPU's binary search.
// `scale` (when not null) multiplies the gradient and, when not finite, skips the
// update; `compute` (when not null) receives the bf16 or f16 copy of the updated value
// (kernels `adamw8bit_{G}_{C}`, as `adamw_{G}_{C}`).

typedef unsigned char u8;

#define TK_QBLOCK 256

// The CPU's `decade_value`: the midpoint of step j of n between 0.1 and 1, times 10^(d−6).
__device__ __forceinline__ float decade_value(unsigned d, unsigned j, unsigned n) {
    const float decades[7] = {1e-6f, 1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f};
    return decades[d] * (0.1f + 0.9f * ((float)(2 * j + 1) / (float)(2 * n)));
}

__device__ __forceinline__ unsigned log2_floor(unsigned x) { return 31 - __clz(x); }

// The CPU's `code_value`.
__device__ float code_value(bool is_signed, unsigned i) {
    if (i == 255) return 1.0f;
    if (is_signed) {
        if (i == 127) return 0.0f;
        unsigned r = i > 127 ? i - 128 : 126 - i;
        float sign = i > 127 ? 1.0f : -1.0f;
        unsigned d = log2_floor(r + 1);
        return sign * decade_value(d, r + 1 - (1u << d), 1u << d);
    }
    if (i == 0) return 0.0f;
    unsigned r = i - 1;
    unsigned d = log2_floor(r + 2) - 1;
    return decade_value(d, r + 2 - (2u << d), 2u << d);
}

// The CPU's `quantize`: nearest code, ties to the lower one, a positive value never to
// the unsigned 0.
__device__ __forceinline__ u8 quantize(const float* table, bool is_signed, float x) {
    unsigned lo = 0;
#pragma unroll
    for (unsigned step = 128; step > 0; step >>= 1) {
        if (table[lo + step] <= x) lo += step;
    }
    if (lo < 255 && table[lo + 1] - x < x - table[lo]) lo += 1;
    if (!is_signed && lo == 0 && x > 0.0f) lo = 1;
    return (u8)lo;
}

// The maximum of `x` over the block's 256 threads, in every thread.
__device__ float block_max(float* shared, float x) {
    shared[threadIdx.x] = x;
    __syncthreads();
    for (unsigned w = TK_QBLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + w]);
        __syncthreads();
    }
    float r = shared[0];
    __syncthreads();
    return r;
}

template <typename G, typename C>
__device__ void adamw8bit_impl(float* param, const G* grad, u8* m_codes, float* m_absmax,
                               u8* v_codes, float* v_absmax, const float* scale,
                               C* compute, i64 n, float beta1, float beta2, float eps,
                               float grad_scale, float step_size, float bc2_sqrt,
                               float decay) {
    if (scale != nullptr) {
        const float s = scale[0];
        if (!isfinite(s)) return;
        grad_scale *= s;
    }
    __shared__ float signed_code[256];
    __shared__ float unsigned_code[256];
    __shared__ float reduce[TK_QBLOCK];
    signed_code[threadIdx.x] = code_value(true, threadIdx.x);
    unsigned_code[threadIdx.x] = code_value(false, threadIdx.x);
    __syncthreads();
    const i64 blocks = (n + TK_QBLOCK - 1) / TK_QBLOCK;
    for (i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const i64 i = b * TK_QBLOCK + threadIdx.x;
        const bool live = i < n;
        float mi = 0.0f, vi = 0.0f;
        if (live) {
            float g = load(grad, i) * grad_scale;
            mi = beta1 * (signed_code[m_codes[i]] * m_absmax[b]) + (1.0f - beta1) * g;
            vi = beta2 * (unsigned_code[v_codes[i]] * v_absmax[b]) + (1.0f - beta2) * g * g;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            float p = param[i] * decay - step_size * mi / denom;
            param[i] = p;
            if (compute != nullptr) store(compute, i, p);
        }
        // Every thread has read its block's maxima before thread 0 overwrites them.
        const float m_max = block_max(reduce, fmaxf(0.0f, fabsf(mi)));
        const float v_max = block_max(reduce, fmaxf(0.0f, fabsf(vi)));
        if (live) {
            m_codes[i] = m_max == 0.0f ? (u8)127 : quantize(signed_code, true, mi / m_max);
            v_codes[i] = v_max == 0.0f ? (u8)0 : quantize(unsigned_code, false, vi / v_max);
        }
        if (threadIdx.x == 0) {
            m_absmax[b] = m_max;
            v_absmax[b] = v_max;
        }
    }
}

#define TK_ADAMW8BIT(G, GN, C, CN)                                                           \
    extern "C" __global__ void adamw8bit_##GN##_##CN(                                      \
        float* param, const G* grad, u8* m_codes, float* m_absmax, u8* v_codes,            \
        float* v_absmax, const float* scale, C* compute, i64 n, float beta1, float beta2,   \
        float eps, float grad_scale, float step_size, float bc2_sqrt, float decay) {        \
        adamw8bit_impl<G, C>(param, grad, m_codes, m_absmax, v_codes, v_absmax, scale,     \
                             compute, n, beta1, beta2, eps, grad_scale, step_size,          \
                             bc2_sqrt, decay);                                              \
    }
TK_ADAMW8BIT(float, f32, bf16, bf16)
TK_ADAMW8BIT(float, f32, f16, f16)
TK_ADAMW8BIT(bf16, bf16, bf16, bf16)
TK_ADAMW8BIT(f16, f16, f16, f16)
