// Writing an f32 update back into bf16 weights that have no f32 master copy (pure bf16).
// CPU twin: src/ops/update_rounding/cpu.rs; bit for bit equal to it.
//
// `expand` widens the weights (plus the Kahan compensation, when there is one) into an
// f32 buffer the optimizer updates; `round` writes the result back: to nearest, or
// stochastically (up with probability equal to the distance from the lower bf16, so the
// expected value is the f32 result), or to nearest with the rounding error kept in the
// bf16 compensation buffer (Kahan-compensated summation). The random bits of element i
// are `tk_counter_bits` (common.cuh) of the launch's `key` (the host's hash of seed, step
// and parameter) and i: no state, the same on every device and thread count, so a
// resumed run draws the same bits.

// master[i] = w[i] + comp[i] (comp null: w[i] alone), in f32.
extern "C" __global__ void update_rounding_expand(float* master, const bf16* w,
                                                  const bf16* comp, i64 n) {
    TK_FOR_EACH(i, n) {
        float v = __bfloat162float(w[i]);
        if (comp) v += __bfloat162float(comp[i]);
        master[i] = v;
    }
}

// mode 0: w = rn(master); 1: stochastic; 2: w = rn(master), comp = rn(master − w)
// (0 where that is not finite).
extern "C" __global__ void update_rounding_round(bf16* w, bf16* comp, const float* master,
                                                 i64 n, i64 mode, i64 key) {
    TK_FOR_EACH(i, n) {
        const float x = master[i];
        bf16 r = __float2bfloat16_rn(x);
        if (mode == 1 && isfinite(x)) {
            const unsigned long long h = tk_counter_bits((unsigned long long)key, i);
            const unsigned bits = __float_as_uint(x) + (unsigned)(h >> 48);
            r = __ushort_as_bfloat16((unsigned short)(bits >> 16));
        }
        w[i] = r;
        if (mode == 2) {
            // Where the weight is not finite the compensation is 0 (not a NaN, whose
            // bits would differ between devices).
            const float d = x - __bfloat162float(r);
            comp[i] = __float2bfloat16_rn(isfinite(d) ? d : 0.0f);
        }
    }
}
