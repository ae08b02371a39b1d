// The column blocks a LoRA update adds to inside a fused projection (the query block of
// q/k/v, the gate block of gate/up), and the dropout of an update's input. CPU twin:
// src/ops/lora/cpu.rs.
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
    }
TK_DTYPES(TK_LORA)
