// The AdamW update, PyTorch semantics, one fused pass per parameter tensor.
// CPU twin: src/optim/adamw/cpu.rs.
//
// Kernels `adamw_{G}_{C}`: G the gradient's dtype, C the compute copy's (bf16 or f16);
// `adamw_{G}_{C}_bf16m` keep the moments in bf16 (widened when read, rounded to nearest
// even when written, as the CPU twin does). Reads the f32 master value, the gradient and
// the moments, and, when `scale` is not null, a device multiplier of the gradient (the step's
// clipping coefficient over its loss scale, from `grad_guard`): when that is not finite
// the step's loss or gradient norm was not, and the kernel writes nothing at all; writes the
// value and the moments and, when `compute` is not null, the 16-bit compute copy of the weight in the same pass (the cast the precision would run next,
// rounded to nearest even as `cast` rounds).
//
// The host computes the per-step constants as the CPU twin does, in f64 as PyTorch does:
//   step_size = lr / (1 − beta1^step),  bc2_sqrt = sqrt(1 − beta2^step),
//   decay = 1 − lr · weight_decay (f32),
// and the update is then, per element (decoupled decay, eps outside the square root):
//   g = grad · (grad_scale · scale[0])
//   m = beta1 · m + (1 − beta1) · g
//   v = beta2 · v + (1 − beta2) · g · g
//   p = p · decay − step_size · m / (sqrt(v) / bc2_sqrt + eps)
// With --fmad=false and IEEE division and square root this is bitwise the CPU's update.

// Folds the device multiplier `scale` (when not null) into `grad_scale`; false when it is
// not finite, and the update must write nothing.
__device__ __forceinline__ bool adamw_scale(const float* scale, float& grad_scale) {
    if (scale == nullptr) return true;
    const float s = scale[0];
    if (!isfinite(s)) return false;
    grad_scale *= s;
    return true;
}

// One element's update, `g` the gradient already scaled: the moments `m` and `v` (as
// stored: read before, rounded to M after, since the update reads a bf16 moment as stored,
// as the next step will) and the value `p`. Every kernel of this file updates an element
// through it.
template <typename M>
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              float beta1, float beta2, float eps,
                                              float step_size, float bc2_sqrt, float decay) {
    M ms[1], vs[1];
    store(ms, 0, beta1 * m + (1.0f - beta1) * g);
    store(vs, 0, beta2 * v + (1.0f - beta2) * g * g);
    m = load(ms, 0);
    v = load(vs, 0);
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    p = p * decay - step_size * m / denom;
}

template <typename G, typename C, typename M>
__device__ void adamw_impl(float* param, const G* grad, M* m, M* v,
                           const float* scale, C* compute, i64 n, float beta1, float beta2,
                           float eps, float grad_scale, float step_size, float bc2_sqrt,
                           float decay) {
    if (!adamw_scale(scale, grad_scale)) return;
    TK_FOR_EACH(i, n) {
        float p = param[i], mi = load(m, i), vi = load(v, i);
        adamw_element<M>(p, load(grad, i) * grad_scale, mi, vi, beta1, beta2, eps, step_size,
                         bc2_sqrt, decay);
        store(m, i, mi);
        store(v, i, vi);
        param[i] = p;
        if (compute != nullptr) store(compute, i, p);
    }
}

#define TK_ADAMW(G, GN, C, CN, M, MN)                                                       \
    extern "C" __global__ void adamw_##GN##_##CN##MN(                                       \
        float* param, const G* grad, M* m, M* v, const float* scale, C* compute,            \
        i64 n, float beta1, float beta2, float eps, float grad_scale, float step_size,      \
        float bc2_sqrt, float decay) {                                                      \
        adamw_impl<G, C, M>(param, grad, m, v, scale, compute, n, beta1, beta2, eps,       \
                            grad_scale, step_size, bc2_sqrt, decay);                        \
    }
TK_ADAMW(float, f32, bf16, bf16, float, )
TK_ADAMW(float, f32, f16, f16, float, )
TK_ADAMW(bf16, bf16, bf16, bf16, float, )
TK_ADAMW(f16, f16, f16, f16, float, )
TK_ADAMW(float, f32, bf16, bf16, bf16, _bf16m)
TK_ADAMW(bf16, bf16, bf16, bf16, bf16, _bf16m)

// ---------------------------------------------------------------------------------------
// Many tensors in one launch: `adamw_multi_{G}_{C}{M}` updates up to TK_ADAMW_TENSORS
// parameter tensors of the same dtypes, each element exactly as `adamw_*` updates it (the
// same operations in the same order, so bitwise the same). The tensors travel by value in
// the launch's parameters; block b takes the b-th chunk of TK_ADAMW_CHUNK elements, counting
// the tensors' chunks in order, and each thread 8 consecutive elements of it (16-byte loads
// and stores where the tensor's buffers are aligned and the 8 are whole). Each tensor has
// its own decay factor (1 − lr · its weight decay, from the host); `compute` may be null.

#define TK_ADAMW_TENSORS 32
#define TK_ADAMW_CHUNK 2048

struct AdamWTensor {
    float* param;
    const void* grad;
    void* m;
    void* v;
    void* compute;
    i64 n;
    float decay;
    int unused;
};

struct AdamWTable {
    AdamWTensor t[TK_ADAMW_TENSORS];
    i64 count;
};

// The update of 8 elements held in registers, element by element.
template <typename M>
__device__ __forceinline__ void adamw_elements(float (&p)[8], const float (&g)[8],
                                               float (&m)[8], float (&v)[8], float beta1,
                                               float beta2, float eps, float grad_scale,
                                               float step_size, float bc2_sqrt,
                                               float decay) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        adamw_element<M>(p[j], g[j] * grad_scale, m[j], v[j], beta1, beta2, eps, step_size,
                         bc2_sqrt, decay);
    }
}

template <typename G, typename C, typename M>
__device__ void adamw_multi_impl(const AdamWTable& tab, const float* scale, float beta1,
                                 float beta2, float eps, float grad_scale, float step_size,
                                 float bc2_sqrt) {
    if (!adamw_scale(scale, grad_scale)) return;
    // This block's tensor and chunk.
    i64 b = blockIdx.x;
    int k = 0;
    for (; k < (int)tab.count; ++k) {
        const i64 chunks = (tab.t[k].n + TK_ADAMW_CHUNK - 1) / TK_ADAMW_CHUNK;
        if (b < chunks) break;
        b -= chunks;
    }
    if (k >= (int)tab.count) return;
    const AdamWTensor t = tab.t[k];
    float* __restrict__ param = t.param;
    const G* __restrict__ grad = static_cast<const G*>(t.grad);
    M* __restrict__ mp = static_cast<M*>(t.m);
    M* __restrict__ vp = static_cast<M*>(t.v);
    C* __restrict__ compute = static_cast<C*>(t.compute);
    const float dk = t.decay;
    const i64 i = b * TK_ADAMW_CHUNK + 8 * (i64)threadIdx.x;
    for (i64 base = i; base < min(t.n, (b + 1) * TK_ADAMW_CHUNK);
         base += 8 * (i64)blockDim.x) {
        const bool whole = base + 8 <= t.n;
        const bool vec = whole && aligned16(param + base) && aligned16(grad + base) &&
                         aligned16(mp + base) && aligned16(vp + base) &&
                         (compute == nullptr || aligned16(compute + base));
        float p[8], g[8], m[8], v[8];
        if (vec) {
#pragma unroll
            for (int j = 0; j < 8; j += 4) {
                const float4 q = *reinterpret_cast<const float4*>(param + base + j);
                p[j] = q.x;
                p[j + 1] = q.y;
                p[j + 2] = q.z;
                p[j + 3] = q.w;
            }
            load8_vec(g, grad + base);
            load8_vec(m, mp + base);
            load8_vec(v, vp + base);
            adamw_elements<M>(p, g, m, v, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt,
                              dk);
            store8_vec(mp + base, m);
            store8_vec(vp + base, v);
#pragma unroll
            for (int j = 0; j < 8; j += 4) {
                *reinterpret_cast<float4*>(param + base + j) =
                    make_float4(p[j], p[j + 1], p[j + 2], p[j + 3]);
            }
            if (compute != nullptr) store8_vec(compute + base, p);
        } else {
            const int n = (int)min((i64)8, t.n - base);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const bool in = j < n;
                p[j] = in ? param[base + j] : 0.0f;
                g[j] = in ? load(grad, base + j) : 0.0f;
                m[j] = in ? load(mp, base + j) : 0.0f;
                v[j] = in ? load(vp, base + j) : 0.0f;
            }
            adamw_elements<M>(p, g, m, v, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt,
                              dk);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < n) {
                    store(mp, base + j, m[j]);
                    store(vp, base + j, v[j]);
                    param[base + j] = p[j];
                    if (compute != nullptr) store(compute, base + j, p[j]);
                }
            }
        }
    }
}

#define TK_ADAMW_MULTI(G, GN, C, CN, M, MN)                                                 \
    extern "C" __global__ void adamw_multi_##GN##_##CN##MN(                                 \
        AdamWTable tab, const float* scale, float beta1, float beta2, float eps,            \
        float grad_scale, float step_size, float bc2_sqrt) {                                \
        adamw_multi_impl<G, C, M>(tab, scale, beta1, beta2, eps, grad_scale, step_size,     \
                                  bc2_sqrt);                                                \
    }
TK_ADAMW_MULTI(float, f32, bf16, bf16, float, )
TK_ADAMW_MULTI(float, f32, f16, f16, float, )
TK_ADAMW_MULTI(bf16, bf16, bf16, bf16, float, )
TK_ADAMW_MULTI(f16, f16, f16, f16, float, )
TK_ADAMW_MULTI(float, f32, bf16, bf16, bf16, _bf16m)
TK_ADAMW_MULTI(bf16, bf16, bf16, bf16, bf16, _bf16m)
