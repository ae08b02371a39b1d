// The column blocks a LoRA update adds to inside a fused projection (the query block of
// q/k/v, the gate block of gate/up), the dropout of an update's input, and DoRA's column
// norms, scaling and magnitude gradient. CPU twin: src/ops/lora/cpu.rs.
//
// dst and src are row-major: `rows` rows of `cols` (the fused width) and of `width`.
// Arithmetic is f32 with one rounding at the store, bitwise the CPU's.

// dst[r, offset + c] += src[r, c]: an update added to its columns.
template <typename T>
__device__ void lora_add_cols_impl(T* dst, const T* src, i64 rows, i64 cols, i64 offset,
                                   i64 width) {
    TK_FOR_EACH(idx, rows * width) {
        const i64 r = idx / width, c = idx % width;
        const i64 d = r * cols + offset + c;
        store(dst, d, load(dst, d) + load(src, idx));
    }
}

// dst[r, c] = src[r, offset + c]: the gradient of the columns an update added to.
template <typename T>
__device__ void lora_take_cols_impl(T* dst, const T* src, i64 rows, i64 cols, i64 offset,
                                    i64 width) {
    TK_FOR_EACH(idx, rows * width) {
        const i64 r = idx / width, c = idx % width;
        store(dst, idx, load(src, r * cols + offset + c));
    }
}

// dst[i] = keep(i) ? src[i] * scale : 0 (accumulate: dst[i] += that), where keep(i) is
// whether the top 24 bits of `tk_counter_bits(key, i)` (common.cuh) reach `threshold`
// (p · 2^24): a counter-based draw, the same on every device, in
// forward, in its recomputation and in backward.
template <typename T>
__device__ void lora_dropout_impl(T* dst, const T* src, i64 n, i64 key, i64 threshold,
                                  float scale, i64 accumulate) {
    TK_FOR_EACH(i, n) {
        const unsigned long long h = tk_counter_bits((unsigned long long)key, i);
        const float v = (i64)(h >> 40) >= threshold ? load(src, i) * scale : 0.0f;
        store(dst, i, accumulate ? load(dst, i) + v : v);
    }
}

// DoRA's column norms: n[c] = ‖W_c + scale · D_c‖ over the input features, for each of the
// block's `width` output features, W_c being output feature `offset + c` of the base
// weight `w` (`transposed`: w is [out, in], row offset + c; else [in, ldw], column
// offset + c) and D_c row c of d ([width, in], B·A). A thread per feature, its sum of
// squares in f32 in input order, then one square root: bitwise the CPU's.
template <typename T>
__device__ void dora_norm_impl(float* n, const T* w, const T* d, float scale, i64 in,
                               i64 ldw, i64 offset, i64 width, i64 transposed) {
    TK_FOR_EACH(c, width) {
        float acc = 0.0f;
        for (i64 k = 0; k < in; ++k) {
            const i64 at = transposed ? (offset + c) * in + k : k * ldw + offset + c;
            const float v = load(w, at) + scale * load(d, c * in + k);
            acc += v * v;
        }
        n[c] = sqrtf(acc);
    }
}

// DoRA's scaling of a block of output columns: y[r, offset + c] = g · (y − b) + b with
// g = m[c] / n[c] (the magnitude over the detached norm) and b the bias of that column
// (none: y[r, offset + c] = g · y).
template <typename T>
__device__ void dora_scale_cols_impl(T* y, const T* m, const float* n, const T* bias,
                                     i64 rows, i64 cols, i64 offset, i64 width) {
    TK_FOR_EACH(idx, rows * width) {
        const i64 r = idx / width, c = idx % width;
        const i64 at = r * cols + offset + c;
        const float g = load(m, c) / n[c];
        if (bias) {
            const float b = load(bias, offset + c);
            store(y, at, g * (load(y, at) - b) + b);
        } else {
            store(y, at, g * load(y, at));
        }
    }
}

// DoRA's magnitude gradient: out[c] = (Σ_r dy[r, offset + c] · v[r, c]) / n[c], v being the
// block's output before the scaling ([rows, width]). A thread per column, its rows in
// order in f32.
template <typename T>
__device__ void dora_magnitude_grad_impl(float* out, const T* dy, const T* v, const float* n,
                                         i64 rows, i64 cols, i64 offset, i64 width) {
    TK_FOR_EACH(c, width) {
        float acc = 0.0f;
        for (i64 r = 0; r < rows; ++r) {
            acc += load(dy, r * cols + offset + c) * load(v, r * width + c);
        }
        out[c] = acc / n[c];
    }
}

#define TK_LORA(T, N)                                                                       \
    extern "C" __global__ void lora_add_cols_##N(T* dst, const T* src, i64 rows, i64 cols,  \
                                                 i64 offset, i64 width) {                   \
        lora_add_cols_impl<T>(dst, src, rows, cols, offset, width);                         \
    }                                                                                       \
    extern "C" __global__ void lora_take_cols_##N(T* dst, const T* src, i64 rows, i64 cols, \
                                                  i64 offset, i64 width) {                  \
        lora_take_cols_impl<T>(dst, src, rows, cols, offset, width);                        \
    }                                                                                       \
    extern "C" __global__ void lora_dropout_##N(T* dst, const T* src, i64 n, i64 key,       \
                                                i64 threshold, float scale,                 \
                                                i64 accumulate) {                           \
        lora_dropout_impl<T>(dst, src, n, key, threshold, scale, accumulate);               \
    }                                                                                       \
    extern "C" __global__ void dora_norm_##N(float* n, const T* w, const T* d, float scale, \
                                             i64 in, i64 ldw, i64 offset, i64 width,        \
                                             i64 transposed) {                              \
        dora_norm_impl<T>(n, w, d, scale, in, ldw, offset, width, transposed);              \
    }                                                                                       \
    extern "C" __global__ void dora_scale_cols_##N(T* y, const T* m, const float* n,        \
                                                   const T* bias, i64 rows, i64 cols,       \
                                                   i64 offset, i64 width) {                 \
        dora_scale_cols_impl<T>(y, m, n, bias, rows, cols, offset, width);                  \
    }                                                                                       \
    extern "C" __global__ void dora_magnitude_grad_##N(float* out, const T* dy, const T* v, \
                                                       const float* n, i64 rows, i64 cols,  \
                                                       i64 offset, i64 width) {             \
        dora_magnitude_grad_impl<T>(out, dy, v, n, rows, cols, offset, width);              \
    }
TK_DTYPES(TK_LORA)
