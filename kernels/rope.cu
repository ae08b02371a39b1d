// Rotary position embedding (Hugging Face's rotate-half layout) of the queries and keys of
// a fused projection. CPU twin: src/ops/rope/cpu.rs.
//
// Layouts (trainkit::device::Heads): x and out are [rows, W], W = (H + 2·KV)·D, rows = B·T
// with the position of row r being pos[r] (u32 [B·T], each token's position in its
// document) or, with pos null, r % T; the first (H + KV)·D columns (queries, then
// keys) are turned in heads of D, element i with element i + D/2 by the angle
// pos · inv_freq[i]; the values are copied. `sign` is +1 (forward) or −1 (backward, the
// transpose). The D/2 f32 frequencies travel with the launch, by value (RopeFreqs, up to
// 256 of them: heads up to 512 wide), so a call uploads nothing.
//
// The angle is pos · inv_freq[i] in f32 as on the CPU; sinf and cosf differ from Rust's
// sin and cos in the last bit here and there, so the results agree to f32 rounding. A
// row's heads share their angles: each sine and cosine is computed once per row.

#define TK_ROPE_MAX_PAIRS 256

// The frequencies, passed by value (zero beyond D/2).
struct RopeFreqs {
    float f[TK_ROPE_MAX_PAIRS];
};

// The position of row `row`: pos[row], or without positions row % T.
__device__ __forceinline__ i64 rope_position(const unsigned* pos, i64 row, i64 t_len) {
    return pos ? (i64)pos[row] : row % t_len;
}

// A thread per row and group of 8 pairs (i, i + D/2), i = 8·g .. 8·g + 8: the 8 angles'
// sines and cosines once, then every query and key head of the row turned by them (the
// heads of a row share their angles), in 16-byte loads and stores when VEC (D/2 a multiple
// of 8, W a multiple of 8, x and out 16-byte aligned); then the value columns copied, 8
// at a time.
template <typename T, bool VEC>
__device__ void rope_rows(T* __restrict__ out, const T* __restrict__ x,
                          const float* __restrict__ inv_freq, i64 rows, i64 t_len, i64 w,
                          i64 rotated, int hd, float sign, const unsigned* __restrict__ pos) {
    const int half = hd / 2;
    const int heads = (int)(rotated / hd), groups = (half + 7) / 8;
    TK_FOR_EACH(idx, rows * groups) {
        const i64 row = idx / groups;
        const int i0 = 8 * (int)(idx % groups);
        const float p = (float)rope_position(pos, row, t_len);
        float s[8], c[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const float angle = p * inv_freq[i0 + m];  // zero past D/2
            s[m] = sign * sinf(angle);
            c[m] = cosf(angle);
        }
        const T* xr = x + row * w;
        T* orow = out + row * w;
#pragma unroll 4
        for (int h = 0; h < heads; ++h) {
            float x1[8], x2[8], o1[8], o2[8];
            load8(x1, xr + h * hd, i0, half, VEC);
            load8(x2, xr + h * hd + half, i0, half, VEC);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                o1[m] = x1[m] * c[m] - x2[m] * s[m];
                o2[m] = x2[m] * c[m] + x1[m] * s[m];
            }
            store8(orow + h * hd, i0, half, VEC, o1);
            store8(orow + h * hd + half, i0, half, VEC, o2);
        }
    }
    const int rest = (int)(w - rotated);
    if (rest == 0) return;
    const int chunks = (rest + 7) / 8;
    TK_FOR_EACH(idx, rows * chunks) {
        const i64 at = (idx / chunks) * w + rotated;
        const int i = 8 * (int)(idx % chunks);
        float v[8];
        load8(v, x + at, i, rest, VEC);
        store8(out + at, i, rest, VEC, v);
    }
}

template <typename T>
__device__ void rope_impl(T* out, const T* x, const float* inv_freq, i64 rows, i64 t_len,
                          i64 w, i64 rotated, i64 hd, float sign, const unsigned* pos) {
    if (hd % 16 == 0 && w % 8 == 0 && aligned16(out) && aligned16(x)) {
        rope_rows<T, true>(out, x, inv_freq, rows, t_len, w, rotated, (int)hd, sign, pos);
    } else {
        rope_rows<T, false>(out, x, inv_freq, rows, t_len, w, rotated, (int)hd, sign, pos);
    }
}

#define TK_ROPE(T, N)                                                                       \
    extern "C" __global__ void rope_##N(T* out, const T* x, RopeFreqs freq, i64 rows,       \
                                        i64 t_len, i64 w, i64 rotated, i64 hd, float sign,  \
                                        const unsigned* pos) {                              \
        rope_impl<T>(out, x, freq.f, rows, t_len, w, rotated, hd, sign, pos);               \
    }
TK_DTYPES(TK_ROPE)
