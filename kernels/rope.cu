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
// sin and cos in the last bit here and there, so the results agree to f32 rounding.

#define TK_ROPE_MAX_PAIRS 256

// The frequencies, passed by value (zero beyond D/2).
struct RopeFreqs {
    float f[TK_ROPE_MAX_PAIRS];
};

// One thread per pair (i, i + D/2) of one head of one row: one angle and one sine and
// cosine for both elements (they share them), 32-bit index arithmetic where the pairs
// number fewer than 2^31; then the value columns copied.
template <typename T>
__device__ void rope_impl(T* out, const T* x, const float* inv_freq, i64 rows, i64 t_len,
                          i64 w, i64 rotated, i64 hd, float sign, const unsigned* pos) {
    const int half = (int)(hd / 2);
    const i64 per_row = rotated / 2;
    const i64 pairs = rows * per_row;
    const bool narrow = pairs <= 0x7fffffff && t_len <= 0x7fffffff;
    TK_FOR_EACH(idx, pairs) {
        i64 row;
        int k;
        if (narrow) {
            row = (unsigned)idx / (unsigned)per_row;
            k = (int)((unsigned)idx % (unsigned)per_row);
        } else {
            row = idx / per_row;
            k = (int)(idx % per_row);
        }
        const int head = k / half, i = k % half;
        const i64 p = pos ? (i64)pos[row]
                          : (narrow ? (i64)((unsigned)row % (unsigned)t_len) : row % t_len);
        const float angle = (float)p * inv_freq[i];
        const float s = sign * sinf(angle), c = cosf(angle);
        const i64 a = row * w + (i64)head * hd + i, b = a + half;
        const float x1 = load(x, a), x2 = load(x, b);
        store(out, a, x1 * c - x2 * s);
        store(out, b, x2 * c + x1 * s);
    }
    const i64 rest = w - rotated;
    if (rest == 0) return;
    TK_FOR_EACH(idx, rows * rest) {
        const i64 at = (idx / rest) * w + rotated + idx % rest;
        store(out, at, load(x, at));
    }
}

#define TK_ROPE(T, N)                                                                       \
    extern "C" __global__ void rope_##N(T* out, const T* x, RopeFreqs freq, i64 rows,       \
                                        i64 t_len, i64 w, i64 rotated, i64 hd, float sign,  \
                                        const unsigned* pos) {                              \
        rope_impl<T>(out, x, freq.f, rows, t_len, w, rotated, hd, sign, pos);               \
    }
TK_DTYPES(TK_ROPE)
