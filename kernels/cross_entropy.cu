// Softmax cross-entropy over the vocabulary, fused with its gradient.
// CPU twin: src/ops/cross_entropy/cpu.rs.
//
// Layouts: logits is [rows, Vp] (columns from `vocab` on are padding, ignored),
// targets holds `rows` token ids (< vocab, checked on the host, or TK_IGNORE: a position
// left out, which adds 0 to its loss and gets a zero gradient row), losses is [>= rows] f32
// and each row's loss is added to its element: the losses of a step's micro-batches stay
// on the device until `grad_guard` sums them in f64, in row order, as the CPU does.
//
// One block of 256 threads per row, few enough rows in flight (the launch's grid,
// CudaBackend::grid_cached_rows) that a row's second and third readings come from the L2
// cache; each pass unrolled so that several of a thread's loads are in flight. Thread i
// holds 8 consecutive columns of every 2048,
// [2048·k + 8·i, 2048·k + 8·i + 8), read and written in 16-byte accesses when the rows are
// aligned (vp a multiple of 8), element by element otherwise. A sum over the row
// accumulates column c in slot c mod 2048 (thread (c mod 2048) / 8, register c mod 8) in
// order of c, then each thread's 8 slots pairwise at distances 4, 2, 1 and the 256 threads
// pairwise (s[i] += s[i + w], w = 128, ..., 1): the order of the CPU twin's `row_sum`. The
// maximum, the sum of exponentials (tk_exp, the CPU's exp) and the gradient are bitwise
// equal to the CPU's. The loss uses CUDA's logf where the CPU uses the host's `ln`: the
// two may differ in the last bit. Launched with blockDim.x == TK_CE_LANES (any grid).
#define TK_CE_LANES 256
#define TK_CE_SLOTS (8 * TK_CE_LANES)

// losses[row] += ln Σ_j exp(l_j − max) + max − l_target. With `write_grad`, the row is
// overwritten by grad_scale · (softmax − onehot(target)), rounded once, and its padding
// columns by 0; without, logits are only read.
// The target of a position left out of the loss (trainkit's cross_entropy::IGNORE).
#define TK_IGNORE 0xffffffffu

// The pairwise sum of the block's 256 values, in every thread.
__device__ float ce_block_sum(float* s, float x) {
    s[threadIdx.x] = x;
    __syncthreads();
    for (unsigned w = TK_CE_LANES / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + w];
        __syncthreads();
    }
    const float r = s[0];
    __syncthreads();
    return r;
}

// The maximum of the block's 256 values, in every thread (a NaN never enters a partial
// maximum, as on the CPU, so the order does not matter).
__device__ float ce_block_max(float* s, float x) {
    s[threadIdx.x] = x;
    __syncthreads();
    for (unsigned w = TK_CE_LANES / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            const float o = s[threadIdx.x + w];
            s[threadIdx.x] = o > s[threadIdx.x] ? o : s[threadIdx.x];
        }
        __syncthreads();
    }
    const float r = s[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void cross_entropy_impl(T* logits, float* losses, const unsigned* targets,
                                   i64 rows, i64 vp, i64 vocab, float grad_scale,
                                   int write_grad) {
    __shared__ float partial[TK_CE_LANES];
    const int first = 8 * (int)threadIdx.x;
    const int nv = (int)vocab, np = (int)vp;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        T* __restrict__ r = logits + row * vp;
        // Every chunk of 8 that starts inside an aligned row is whole.
        const bool vec = aligned16(r) && np % 8 == 0;
        if (targets[row] == TK_IGNORE) {
            // As the CPU: 0 added, the gradient row zero.
            if (threadIdx.x == 0) losses[row] += 0.0f;
            if (write_grad) {
                const float zero[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                for (int c = first; c < np; c += TK_CE_SLOTS) store8(r, c, np, vec, zero);
            }
            continue;
        }
        const int t = (int)targets[row];
        // Read before any thread overwrites the row (the reductions below wait for all).
        const float target_logit = load(r, t);
        float v[8];
        float m = TK_NEG_INF;
#pragma unroll 4
        for (int c = first; c < nv; c += TK_CE_SLOTS) {
            load8(v, r, c, np, vec);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (c + j < nv) m = v[j] > m ? v[j] : m;
            }
        }
        const float max = ce_block_max(partial, m);
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int c = first; c < nv; c += TK_CE_SLOTS) {
            load8(v, r, c, np, vec);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (c + j < nv) acc[j] += tk_exp(v[j] - max);
            }
        }
        const float mine = ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                           ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        const float sum = ce_block_sum(partial, mine);
        if (threadIdx.x == 0) losses[row] += logf(sum) + max - target_logit;
        if (write_grad) {
            const float k = grad_scale / sum;
#pragma unroll 4
            for (int c = first; c < np; c += TK_CE_SLOTS) {
                load8(v, r, c, np, vec);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float g = 0.0f;
                    if (c + j < nv) {
                        g = tk_exp(v[j] - max) * k;
                        if (c + j == t) g -= grad_scale;
                    }
                    v[j] = g;
                }
                store8(r, c, np, vec, v);
            }
        }
    }
}

#define TK_CROSS_ENTROPY(T, N)                                                              \
    extern "C" __global__ void cross_entropy_##N(T* logits, float* losses,                  \
                                                 const unsigned* targets, i64 rows, i64 vp, \
                                                 i64 vocab, float grad_scale,               \
                                                 int write_grad) {                          \
        cross_entropy_impl<T>(logits, losses, targets, rows, vp, vocab, grad_scale,         \
                              write_grad);                                                  \
    }
TK_DTYPES(TK_CROSS_ENTROPY)
