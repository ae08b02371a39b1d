// Softmax cross-entropy over the vocabulary, fused with its gradient.
// CPU twin: src/ops/cross_entropy/cpu.rs.
//
// Layouts: logits is [rows, Vp] (columns from `vocab` on are padding, ignored),
// targets holds `rows` token ids (< vocab, checked on the host, or TK_IGNORE: a position
// left out, which adds 0 to its loss and gets a zero gradient row), losses is [>= rows] f32
// and each row's loss is added to its element: the losses of a step's micro-batches stay
// on the device until `grad_guard` sums them in f64, in row order, as the CPU does.
//
// One block of 256 threads per row: thread i accumulates columns i, i + 256, ... (the CPU's
// 256 interleaved partial sums, in its order), and the block adds the 256 partials
// pairwise as the CPU does (s[i] += s[i + w], w = 128, ..., 1). The maximum, the sum of
// exponentials (tk_exp, the CPU's exp) and the gradient are bitwise equal to the CPU's.
// The loss uses CUDA's logf where the CPU uses the host's `ln`: the two may differ in the
// last bit. Launched with blockDim.x == TK_CE_LANES (any grid).
#define TK_CE_LANES 256

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
    const int lane = threadIdx.x;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 base = row * vp;
        if (targets[row] == TK_IGNORE) {
            // As the CPU: 0 added, the gradient row zero.
            if (lane == 0) losses[row] += 0.0f;
            if (write_grad)
                for (i64 j = lane; j < vp; j += TK_CE_LANES) store(logits, base + j, 0.0f);
            continue;
        }
        const i64 t = targets[row];
        // Read before any thread overwrites the row (the reductions below wait for all).
        const float target_logit = load(logits, base + t);
        float m = TK_NEG_INF;
        for (i64 j = lane; j < vocab; j += TK_CE_LANES) {
            const float v = load(logits, base + j);
            m = v > m ? v : m;
        }
        const float max = ce_block_max(partial, m);
        float acc = 0.0f;
        for (i64 j = lane; j < vocab; j += TK_CE_LANES)
            acc += tk_exp(load(logits, base + j) - max);
        const float sum = ce_block_sum(partial, acc);
        if (lane == 0) losses[row] += logf(sum) + max - target_logit;
        if (write_grad) {
            const float k = grad_scale / sum;
            for (i64 j = lane; j < vp; j += TK_CE_LANES) {
                float g = 0.0f;
                if (j < vocab) {
                    g = tk_exp(load(logits, base + j) - max) * k;
                    if (j == t) g -= grad_scale;
                }
                store(logits, base + j, g);
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
