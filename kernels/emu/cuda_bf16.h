// Host stand-in for CUDA's <cuda_bf16.h>, for the CPU emulator (kernels/emu/emu.h): the
// bf16 type and the conversions trainkit's kernels use, with the device's semantics.
//
// __float2bfloat16_rn rounds to nearest even and keeps a NaN a NaN (its high mantissa bits
// and the quiet bit), exactly as the CPU backend's `half::bf16::from_f32`; widening to f32
// is exact.
#ifndef TRAINKIT_EMU_CUDA_BF16_H
#define TRAINKIT_EMU_CUDA_BF16_H

#include <cstdint>
#include <cstring>

struct __nv_bfloat16_raw {
    unsigned short x;
};

struct __nv_bfloat16;
static inline __nv_bfloat16 __float2bfloat16_rn(float f);
static inline float __bfloat162float(__nv_bfloat16 b);

// 16 bits, trivially copyable and default-constructible (usable in __shared__ arrays), with
// CUDA's implicit conversions to and from float.
struct __nv_bfloat16 {
    unsigned short __x;

    __nv_bfloat16() = default;
    __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16(float f);
    __nv_bfloat16(double f);
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
    operator float() const;
};

static_assert(sizeof(__nv_bfloat16) == 2, "bf16 is 16 bits");

static inline unsigned short tk_emu_f32_to_bf16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep the high mantissa bits, set the quiet bit.
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    const uint32_t round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
        return (unsigned short)((x >> 16) + 1);
    }
    return (unsigned short)(x >> 16);
}

static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
    __nv_bfloat16 b;
    b.__x = bits;
    return b;
}
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    return __ushort_as_bfloat16(tk_emu_f32_to_bf16_bits(f));
}
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// Round to nearest even from f64, rounding once: to f32 rounding to odd (f32 keeps more
// than two bits beyond bf16's, so the second rounding is then exact), then to bf16.
static inline __nv_bfloat16 __double2bfloat16(double d) {
    if (d != d) return __float2bfloat16_rn((float)d);
    float f = (float)d;
    if ((double)f != d) {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        // Toward zero: step back when the nearest f32 is larger in magnitude.
        if ((f > 0.0f && (double)f > d) || (f < 0.0f && (double)f < d)) bits -= 1;
        bits |= 1u;
        std::memcpy(&f, &bits, 4);
    }
    return __float2bfloat16_rn(f);
}

static inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t x = (uint32_t)b.__x << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

inline __nv_bfloat16::__nv_bfloat16(float f) : __x(tk_emu_f32_to_bf16_bits(f)) {}
inline __nv_bfloat16::__nv_bfloat16(double f) : __x(__double2bfloat16(f).__x) {}
inline __nv_bfloat16::operator float() const { return __bfloat162float(*this); }

#endif  // TRAINKIT_EMU_CUDA_BF16_H
