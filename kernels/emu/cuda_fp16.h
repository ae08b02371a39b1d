// Host stand-in for CUDA's <cuda_fp16.h>, for the CPU emulator (kernels/emu/emu.h): the
// half type and the conversions trainkit's kernels use, with the device's semantics.
//
// __float2half_rn rounds to nearest even, to subnormals below 2^-14 and to infinity past
// 65504, and keeps a NaN a NaN (its high mantissa bits and the quiet bit), exactly as the
// CPU backend's `half::f16::from_f32`; widening to f32 is exact.
#ifndef TRAINKIT_EMU_CUDA_FP16_H
#define TRAINKIT_EMU_CUDA_FP16_H

#include <cstdint>
#include <cstring>

struct __half_raw {
    unsigned short x;
};

struct __half;
static inline __half __float2half_rn(float f);
static inline float __half2float(__half h);

// 16 bits, trivially copyable and default-constructible (usable in __shared__ arrays), with
// CUDA's implicit conversions to and from float.
struct __half {
    unsigned short __x;

    __half() = default;
    __half(const __half_raw& r) : __x(r.x) {}
    __half(float f);
    operator __half_raw() const { return __half_raw{__x}; }
    operator float() const;
};

static_assert(sizeof(__half) == 2, "half is 16 bits");

static inline unsigned short tk_emu_f32_to_f16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t exp = (x >> 23) & 0xffu;
    const uint32_t man = x & 0x7fffffu;
    if (exp == 0xffu) {
        // Infinity, or NaN with its high mantissa bits and the quiet bit.
        return (unsigned short)(man == 0 ? (sign | 0x7c00u) : (sign | 0x7e00u | (man >> 13)));
    }
    const int e = (int)exp - 127 + 15;
    if (e >= 31) return (unsigned short)(sign | 0x7c00u);
    if (e <= 0) {
        // A subnormal (or zero) half: the full significand in units of 2^-24.
        const int s = 14 - e;
        if (s > 24) return (unsigned short)sign;
        const uint32_t m = man | 0x800000u;
        uint32_t q = m >> s;
        const uint32_t rem = m & ((1u << s) - 1u), halfway = 1u << (s - 1);
        if (rem > halfway || (rem == halfway && (q & 1u))) q += 1;
        return (unsigned short)(sign | q);
    }
    uint32_t h = ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fffu;
    // A carry into the exponent is the right result (up to infinity).
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;
    return (unsigned short)(sign | h);
}

static inline __half __ushort_as_half(unsigned short bits) {
    __half h;
    h.__x = bits;
    return h;
}
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }

static inline __half __float2half_rn(float f) { return __ushort_as_half(tk_emu_f32_to_f16_bits(f)); }
static inline __half __float2half(float f) { return __float2half_rn(f); }

static inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.__x & 0x8000u) << 16;
    const uint32_t exp = (h.__x >> 10) & 0x1fu;
    const uint32_t man = h.__x & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        // Zero or a subnormal: man · 2^-24, exact in f32.
        float v = (float)man * 5.9604644775390625e-8f;
        std::memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline __half::__half(float f) : __x(tk_emu_f32_to_f16_bits(f)) {}
inline __half::operator float() const { return __half2float(*this); }

#endif  // TRAINKIT_EMU_CUDA_FP16_H
