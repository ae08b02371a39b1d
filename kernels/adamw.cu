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

template <typename G, typename C, typename M>
__device__ void adamw_impl(float* param, const G* grad, M* m, M* v,
                           const float* scale, C* compute, i64 n, float beta1, float beta2,
                           float eps, float grad_scale, float step_size, float bc2_sqrt,
                           float decay) {
    if (scale != nullptr) {
        const float s = scale[0];
        if (!isfinite(s)) return;
        grad_scale *= s;
    }
    TK_FOR_EACH(i, n) {
        float g = load(grad, i) * grad_scale;
        // A bf16 moment is updated from its stored value and stored rounded: the update
        // reads the moment as stored, as the next step will.
        float mi = beta1 * load(m, i) + (1.0f - beta1) * g;
        float vi = beta2 * load(v, i) + (1.0f - beta2) * g * g;
        store(m, i, mi);
        store(v, i, vi);
        mi = load(m, i);
        vi = load(v, i);
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        float p = param[i] * decay - step_size * mi / denom;
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
