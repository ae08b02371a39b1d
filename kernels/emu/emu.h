// The CUDA programming model on the CPU, for running trainkit's kernels on the host
// (src/device/cuda/emulator.rs compiles every kernel file against this header).
//
// - The qualifiers (__global__, __device__, __forceinline__, ...) compile away;
//   `__shared__` variables are `static thread_local`: a launch runs its blocks one after
//   another on the calling OS thread, so one copy per OS thread is the block's shared
//   memory, and launches from different OS threads do not share it.
// - Every CUDA thread of a block is a fiber with its own stack (emu.cpp), run
//   cooperatively: a thread runs until it reaches a barrier (__syncthreads, a warp
//   collective) or returns. `threadIdx` and friends are the running fiber's.
// - __syncthreads waits for every thread of the block that has not exited (exited threads
//   count as arrived); every waiting thread must be at the same __syncthreads, else the
//   launch fails ("divergent __syncthreads").
// - A warp collective (__shfl_*_sync, __syncwarp, __ballot_sync, __any_sync, __all_sync)
//   completes when every non-exited lane named in its mask has called one with the same
//   mask; then every participant gets its value at once, so consecutive shuffles cannot
//   mix values. Lanes are grouped in segments of `width` as on the device (PTX shfl.sync).
//   Reading a lane that takes no part (not in the mask, exited, past the block's end) is
//   an error, where the device would return an undefined value.
// - When no thread can run and some have not finished, the launch fails with the place
//   every thread waits at (a deadlock), instead of hanging.
// - Arithmetic is the host's IEEE arithmetic; the library is compiled with
//   -ffp-contract=off, as NVRTC's --fmad=false: `a * b + c` rounds twice, fmaf once.
#ifndef TRAINKIT_EMU_H
#define TRAINKIT_EMU_H

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---------------------------------------------------------------------------------------
// Qualifiers.

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

// ---------------------------------------------------------------------------------------
// Built-in variables.

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

#define warpSize 32

namespace tk_emu {

// The built-in variables of one CUDA thread.
struct Builtins {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

// Those of the thread running now (set by the scheduler before it runs a thread).
extern __thread const Builtins* tls_builtins;

}  // namespace tk_emu

#define threadIdx (::tk_emu::tls_builtins->thread_idx)
#define blockIdx (::tk_emu::tls_builtins->block_idx)
#define blockDim (::tk_emu::tls_builtins->block_dim)
#define gridDim (::tk_emu::tls_builtins->grid_dim)

// ---------------------------------------------------------------------------------------
// Synchronization (emu.cpp). Every function that may switch to another CUDA thread is
// defined in another translation unit, so the compiler cannot keep a shared or global
// value in a register across it.

namespace tk_emu {

enum class Op : int {
    ShflIdx,
    ShflUp,
    ShflDown,
    ShflXor,
    SyncWarp,
    Ballot,
    Any,
    All,
};

enum class BlockOp : int {
    Sync,
    Count,
    And,
    Or,
};

// One warp collective: deposits `value`, waits for the other lanes of `mask`, returns the
// result (a partner's value, or the ballot). `b` and `c` are PTX shfl.sync's operands.
uint64_t warp_collective(Op op, unsigned mask, uint64_t value, int b, int c, int width,
                         const char* file, int line);

// __syncthreads and its counting variants: waits for the block, returns the reduction.
int block_barrier(BlockOp op, int predicate, const char* file, int line);

// Fails the launch with `message` (__trap, bad arguments to a builtin).
[[noreturn]] void fail(const char* what, const char* file, int line);

// The launch's dynamic shared memory (`extern __shared__`): one buffer per OS thread, at a
// fixed address, refilled with a NaN pattern at each block's start.
void* dynamic_shared_memory();

template <class T>
inline T shuffle(Op op, unsigned mask, T var, int b, int width, const char* file, int line) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                  "a shuffle moves a trivially copyable value of at most 8 bytes");
    // PTX's c operand: segment mask in bits 8..12, clamp in bits 0..4 (0 for up).
    const int c = ((32 - width) << 8) | (op == Op::ShflUp ? 0 : 0x1f);
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = warp_collective(op, mask, bits, b, c, width, file, line);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

}  // namespace tk_emu

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::tk_emu::block_barrier(::tk_emu::BlockOp::Sync, 0, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
    return ::tk_emu::block_barrier(::tk_emu::BlockOp::Count, predicate, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
    return ::tk_emu::block_barrier(::tk_emu::BlockOp::And, predicate, file, line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
    return ::tk_emu::block_barrier(::tk_emu::BlockOp::Or, predicate, file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
    ::tk_emu::warp_collective(::tk_emu::Op::SyncWarp, mask, 0, 0, 0x1f, 32, file, line);
}

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::tk_emu::shuffle(::tk_emu::Op::ShflIdx, mask, var, src_lane, width, file, line);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::tk_emu::shuffle(::tk_emu::Op::ShflUp, mask, var, (int)delta, width, file, line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::tk_emu::shuffle(::tk_emu::Op::ShflDown, mask, var, (int)delta, width, file, line);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::tk_emu::shuffle(::tk_emu::Op::ShflXor, mask, var, lane_mask, width, file, line);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return (unsigned)::tk_emu::warp_collective(::tk_emu::Op::Ballot, mask, predicate != 0, 0,
                                               0x1f, 32, file, line);
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return (int)::tk_emu::warp_collective(::tk_emu::Op::Any, mask, predicate != 0, 0, 0x1f,
                                          32, file, line);
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return (int)::tk_emu::warp_collective(::tk_emu::Op::All, mask, predicate != 0, 0, 0x1f,
                                          32, file, line);
}

// Blocks run one after another and threads one at a time: every write is visible to the
// next reader, so the fences have nothing to do.
inline void __threadfence() {}
inline void __threadfence_block() {}

[[noreturn]] inline void __trap(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::tk_emu::fail("__trap()", file, line);
}

// ---------------------------------------------------------------------------------------
// Bit casts and integer intrinsics.

namespace tk_emu {
template <class To, class From>
inline To bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
    To out;
    std::memcpy(&out, &v, sizeof(To));
    return out;
}
}  // namespace tk_emu

inline unsigned int __float_as_uint(float x) { return ::tk_emu::bit_cast<unsigned int>(x); }
inline float __uint_as_float(unsigned int x) { return ::tk_emu::bit_cast<float>(x); }
inline int __float_as_int(float x) { return ::tk_emu::bit_cast<int>(x); }
inline float __int_as_float(int x) { return ::tk_emu::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return ::tk_emu::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return ::tk_emu::bit_cast<double>(x); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }

// ---------------------------------------------------------------------------------------
// min and max as CUDA overloads them: integers in their common type, floating point as
// fminf / fmaxf (a NaN operand yields the other operand).

template <class A, class B,
          typename std::enable_if<std::is_integral<A>::value && std::is_integral<B>::value,
                                  int>::type = 0>
inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B,
          typename std::enable_if<std::is_integral<A>::value && std::is_integral<B>::value,
                                  int>::type = 0>
inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return (C)a < (C)b ? (C)b : (C)a;
}
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------------
// Launches (used by the generated trampolines, one per kernel).

namespace tk_emu {

// Runs `body(ctx)` once per CUDA thread of the grid; 0, or 1 with a message in `err`.
int run_launch(const char* kernel, dim3 grid, dim3 block, unsigned shared_bytes,
               void (*body)(void*), void* ctx, char* err, size_t err_len);

// Writes a launch error (before any thread ran).
int launch_error(const char* kernel, const char* message, char* err, size_t err_len);

template <class... Args>
struct KernelCall {
    void (*kernel)(Args...);
    std::tuple<Args...> args;

    // One CUDA thread: the kernel with its own copies of the arguments.
    static void run(void* self) {
        KernelCall* call = static_cast<KernelCall*>(self);
        std::apply(call->kernel, call->args);
    }
};

template <class... Args, size_t... I>
inline int launch(void (*kernel)(Args...), std::index_sequence<I...>, const char* name,
                  dim3 grid, dim3 block, unsigned shared_bytes, void** params, char* err,
                  size_t err_len) {
    if (sizeof...(Args) > 0) {
        if (params == nullptr) {
            return launch_error(name, "the kernel takes arguments but `params` is null", err,
                                err_len);
        }
        for (size_t i = 0; i < sizeof...(Args); ++i) {
            if (params[i] == nullptr) {
                char message[96];
                std::snprintf(message, sizeof message, "params[%zu] is null", i);
                return launch_error(name, message, err, err_len);
            }
        }
    }
    // cuLaunchKernel's convention: params[i] points to the value of argument i, which is
    // copied at the launch.
    KernelCall<Args...> call{kernel,
                             std::tuple<Args...>(*static_cast<Args*>(params[I])...)};
    return run_launch(name, grid, block, shared_bytes, &KernelCall<Args...>::run, &call, err,
                      err_len);
}

template <class... Args>
inline int launch(void (*kernel)(Args...), const char* name, unsigned gx, unsigned gy,
                  unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared_bytes,
                  void** params, char* err, size_t err_len) {
    return launch(kernel, std::index_sequence_for<Args...>{}, name, dim3(gx, gy, gz),
                  dim3(bx, by, bz), shared_bytes, params, err, err_len);
}

template <class... Args>
constexpr unsigned arity(void (*)(Args...)) {
    return sizeof...(Args);
}

}  // namespace tk_emu

// ---------------------------------------------------------------------------------------
// Vector types and atomics. A launch's blocks run one after another and its threads switch
// only at barriers and warp collectives, so a read-modify-write is atomic here.

struct __align__(16) uint4 {
    unsigned int x, y, z, w;
};
struct __align__(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float atomicAdd(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}

// ---------------------------------------------------------------------------------------
// Tensor cores: PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (and .f16), D = A·B + C for
// a 16x16 A, a 16x8 B and a 16x8 C and D, in the instruction's own fragment layout, so a
// kernel that packs its fragments wrongly gets wrong results here too. Lane 4·g + t holds
// A's registers {(g, 2t..2t+1), (g+8, 2t..2t+1), (g, 2t+8..2t+9), (g+8, 2t+8..2t+9)}
// (row, columns; the lower column in the low half), B's {(2t..2t+1, g), (2t+8..2t+9, g)}
// (rows, column) and C's and D's {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. Every lane
// of the warp must take part (a full-warp __syncwarp). The products of bf16 (or f16)
// values are exact in f32; they are added to C in k order with f32 rounding (the device's order and
// intermediate precision are its own, so results agree with it to rounding).

namespace tk_emu {

// One warp's mma.m16n8k16 with f32 accumulators, its 16-bit operands widened by `widen`.
template <typename Widen>
inline void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, Widen widen,
                         const char* file, int line) {
    struct Fragments {
        unsigned a[4];
        unsigned b[2];
    };
    // One warp's fragments; the fibers of a block share the OS thread.
    static thread_local Fragments lanes[32][32];
    const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned warp = (tid / 32) % 32, lane = tid % 32;
    for (int i = 0; i < 4; ++i) lanes[warp][lane].a[i] = a[i];
    for (int i = 0; i < 2; ++i) lanes[warp][lane].b[i] = b[i];
    warp_collective(Op::SyncWarp, 0xffffffffu, 0, 0, 0x1f, 32, file, line);
    auto half = [&](unsigned reg, int k) {
        return widen((unsigned short)(reg >> (16 * (k & 1))));
    };
    const int g = (int)lane >> 2, t = (int)lane & 3;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) {
            const Fragments& fa = lanes[warp][(r & 7) * 4 + ((k & 7) >> 1)];
            const Fragments& fb = lanes[warp][n * 4 + ((k & 7) >> 1)];
            const float x = half(fa.a[(r >> 3) + 2 * (k >> 3)], k);
            const float y = half(fb.b[k >> 3], k);
            acc = acc + x * y;
        }
        out[i] = acc;
    }
    // Nobody reuses the exchange before every lane has read it.
    warp_collective(Op::SyncWarp, 0xffffffffu, 0, 0, 0x1f, 32, file, line);
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// PTX's ldmatrix.sync.aligned.m8n8.x4.shared.b16 (and .trans): lane l names, in `p`, row
// l % 8 of matrix l / 8 (16 bytes of 16-bit values); register i of lane 4·g + t gets
// matrix i's (row g, columns 2t and 2t + 1), or with `trans` its (rows 2t and 2t + 1,
// column g), the first in the low half. Every lane of the warp must take part.
inline void ldmatrix_x4(unsigned* r, const void* p, bool trans,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static thread_local const unsigned short* rows[32][32];
    const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned warp = (tid / 32) % 32, lane = tid % 32;
    rows[warp][lane] = static_cast<const unsigned short*>(p);
    warp_collective(Op::SyncWarp, 0xffffffffu, 0, 0, 0x1f, 32, file, line);
    const int g = (int)lane >> 2, t = (int)lane & 3;
    unsigned out[4];
    for (int i = 0; i < 4; ++i) {
        unsigned lo, hi;
        if (trans) {
            lo = rows[warp][8 * i + 2 * t][g];
            hi = rows[warp][8 * i + 2 * t + 1][g];
        } else {
            lo = rows[warp][8 * i + g][2 * t];
            hi = rows[warp][8 * i + g][2 * t + 1];
        }
        out[i] = lo | (hi << 16);
    }
    warp_collective(Op::SyncWarp, 0xffffffffu, 0, 0, 0x1f, 32, file, line);
    for (int i = 0; i < 4; ++i) r[i] = out[i];
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32.
inline void mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    mma_m16n8k16(
        d, a, b, [](unsigned short h) { return __bfloat162float(__ushort_as_bfloat16(h)); },
        file, line);
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32.
inline void mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    mma_m16n8k16(
        d, a, b, [](unsigned short h) { return __half2float(__ushort_as_half(h)); }, file,
        line);
}

}  // namespace tk_emu

#endif  // TRAINKIT_EMU_H
