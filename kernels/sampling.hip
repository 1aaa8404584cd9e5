// Greedy sampling on the device: the index of the largest logit (lowest index on ties, as
// torch.argmax), among the first `limit` (or *limit_dev, in a recorded decode step), so only one id
// crosses to the host. A token mask (a grammar's allowed tokens), when `mask` is given and its
// word count mask[0] is non-zero, leaves out every id i whose bit i % 32 of mask[1 + i / 32] is
// clear, and every id past the mask (top_k below takes the same mask). Each block reduces a strided share of the logits and writes its best to
// part_v/part_i [gridDim.x]; the last block to finish (a ticket, reset afterwards) reduces those in
// block order. Rows of logits [gridDim.y, n] at once (a decode step of several sequences): row y
// has its own part_v/part_i [y * gridDim.x ..], ticket[y] and out[y], and the same result alone.
// Launch: grid (ARGMAX_BLOCKS, rows), block 256.
#include "common/portable.h"

#define ARGMAX_BLOCKS 128

// Whether id i may be chosen under a mask of `count` words (none: null words).
__device__ __forceinline__ bool token_allowed(const unsigned* words, int count, int i) {
    return !words || ((i >> 5) < count && (words[i >> 5] >> (i & 31)) & 1u);
}

// The mask's words and their count, or null when no mask applies (read once per kernel).
__device__ __forceinline__ const unsigned* token_mask_words(const unsigned* mask, int* count) {
    *count = mask ? (int)mask[0] : 0;
    return *count ? mask + 1 : nullptr;
}

// (v, i) beats (bv, bi): larger value, or the same value at a lower index.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide reduction of each thread's (v, i); thread 0 gets the result.
__device__ __forceinline__ void argmax_block(float& v, int& i) {
    __shared__ float sv[256];
    __shared__ int si[256];
    sv[threadIdx.x] = v;
    si[threadIdx.x] = i;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && argmax_better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    v = sv[0];
    i = si[0];
}

// A request's adjustments (sampling::Adjustment), added to the logits before argmax, top_k or
// draw: for each listed id, l += bias; then l = l > 0 ? l / repetition : l * repetition (when
// repetition != 1); then l -= subtract: the host's f32 operations, so both give the same bits.
// `list` holds the count, then the ids (int), biases, repetitions and subtrahends (float), count
// of each. Ids are unique (one entry each). Launch: enough threads for the list's capacity (those
// past the count do nothing).
ATLAS_KERNEL void logit_adjust(float* logits, int n, const int* list) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, count = list[0];
    if (i >= count) return;
    const int id = list[1 + i];
    if (id < 0 || id >= n) return;
    const float* values = (const float*)(list + 1 + count);
    const float bias = values[i], repetition = values[count + i], subtract = values[2 * count + i];
    float l = logits[id] + bias;
    if (repetition != 1.0f) l = l > 0.0f ? __fdiv_rn(l, repetition) : __fmul_rn(l, repetition);
    logits[id] = __fsub_rn(l, subtract);
}

ATLAS_KERNEL void argmax(const float* logits, int n, int limit, const int* limit_dev, const unsigned* mask,
                         float* part_v, int* part_i, int* ticket, int* out) {
    __shared__ int is_last;
    if (limit_dev) limit = *limit_dev;
    const int end = min(n, limit);
    logits += (long)blockIdx.y * n;
    part_v += blockIdx.y * gridDim.x;
    part_i += blockIdx.y * gridDim.x;
    ticket += blockIdx.y;
    out += blockIdx.y;
    int count;
    const unsigned* words = token_mask_words(mask, &count);
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < end; i += gridDim.x * blockDim.x) {
        if (logits[i] > v && token_allowed(words, count, i)) {
            v = logits[i];
            idx = i;
        }
    }
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = idx;
        __threadfence();
        is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    v = NEG_INF;
    idx = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        const float bv = ((const volatile float*)part_v)[b];
        const int bi = ((const volatile int*)part_i)[b];
        if (argmax_better(bv, bi, v, idx)) {
            v = bv;
            idx = bi;
        }
    }
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        out[0] = idx == 0x7fffffff ? 0 : idx;
        *ticket = 0;
    }
}

// Top-k on the device: the TOPK_MAX (64) best (value desc, id asc) of the first min(n, limit)
// logits (limit = *limit_dev, k = *k_dev when those are given: a recorded decode step), of which
// the first k go to out_v/out_i [k], so only k pairs cross to the host. Order and result are those
// of sorting (value desc, id asc) and taking k; an output slot with no candidate gets (NEG_INF, -1).
// Method: every list is 64 (value, id) pairs sorted descending; the top 64 of two sorted lists is
// max(A[i], B[63 - i]) (a bitonic sequence) followed by a 6-step bitonic merge. Each block takes a
// contiguous share of the candidates, in tiles of up to TOPK_TILE - 64 new logits loaded into shared
// memory behind its running top 64: sorts the tile in 64-runs (bitonic) and folds the runs pairwise
// to one. It writes its sorted 64 to part_v/part_i [blockIdx.x * TOPK_MAX ...]; the last block to
// finish (an atomic ticket, reset afterwards) folds the TOPK_BLOCKS lists the same way. Every step
// is a fixed function of the input: the result does not depend on block scheduling.
// Launch: grid TOPK_BLOCKS (or fewer), block TOPK_THREADS, no dynamic shared memory (32 KB static);
// part_v/part_i hold TOPK_BLOCKS * TOPK_MAX entries; *ticket is 0 before and after the launch.
#define TOPK_MAX 64
#define TOPK_BLOCKS 128
#define TOPK_THREADS 256
#define TOPK_TILE 4096         // shared-memory pairs: a block's tile, or the last block's folded lists
#define TOPK_NO_ID 0x7fffffff  // id of a padding entry (NEG_INF, no candidate): after every real one

#if TOPK_BLOCKS * TOPK_MAX / 2 > TOPK_TILE || (TOPK_BLOCKS & (TOPK_BLOCKS - 1)) != 0
#error "top_k: TOPK_BLOCKS must be a power of two with TOPK_BLOCKS * TOPK_MAX / 2 <= TOPK_TILE"
#endif

// (v, i) comes before (bv, bi): larger value, or the same value at a lower id.
__device__ __forceinline__ bool topk_before(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Puts the earlier of entries a and b at a.
__device__ __forceinline__ void topk_order(float* sv, int* si, int a, int b) {
    const float va = sv[a], vb = sv[b];
    const int ia = si[a], ib = si[b];
    if (topk_before(vb, ib, va, ia)) {
        sv[a] = vb;
        si[a] = ib;
        sv[b] = va;
        si[b] = ia;
    }
}

// Index of the r-th compare pair at distance t inside a run: the lower entry (bit t clear).
__device__ __forceinline__ int topk_pair(int r, int t) { return ((r & ~(t - 1)) << 1) | (r & (t - 1)); }

// Sorts `runs` bitonic 64-entry runs, starting at s[c * stride], descending (half-cleaners 32..1).
__device__ void topk_clean(float* sv, int* si, int runs, int stride) {
    for (int t = TOPK_MAX / 2; t > 0; t >>= 1) {
        for (int p = threadIdx.x; p < runs * (TOPK_MAX / 2); p += blockDim.x) {
            const int i = (p / (TOPK_MAX / 2)) * stride + topk_pair(p % (TOPK_MAX / 2), t);
            topk_order(sv, si, i, i + t);
        }
        __syncthreads();
    }
}

// s[0 .. len) (len a power of two >= 64) holds sorted 64-runs: folds them pairwise until s[0 .. 64)
// is the sorted top 64 of all.
__device__ void topk_fold(float* sv, int* si, int len) {
    for (int gap = TOPK_MAX; gap < len; gap <<= 1) {
        const int runs = len / (2 * gap);
        for (int p = threadIdx.x; p < runs * TOPK_MAX; p += blockDim.x) {
            const int a = (p / TOPK_MAX) * 2 * gap + p % TOPK_MAX;
            const int b = (p / TOPK_MAX) * 2 * gap + gap + TOPK_MAX - 1 - p % TOPK_MAX;
            if (topk_before(sv[b], si[b], sv[a], si[a])) {
                sv[a] = sv[b];
                si[a] = si[b];
            }
        }
        __syncthreads();
        topk_clean(sv, si, runs, 2 * gap);
    }
}

ATLAS_KERNEL void top_k(const float* logits, int n, int limit, const int* limit_dev, int k, const int* k_dev,
                        const unsigned* mask, float* part_v, int* part_i, int* ticket, float* out_v, int* out_i) {
    __shared__ float sv[TOPK_TILE];
    __shared__ int si[TOPK_TILE];
    __shared__ int is_last;
    if (limit_dev) limit = *limit_dev;
    int mask_words;
    const unsigned* words = token_mask_words(mask, &mask_words);
    const int end = max(0, min(n, limit));
    const int share = (end + (int)gridDim.x - 1) / (int)gridDim.x;
    const int lo = min(end, (int)blockIdx.x * share), hi = min(end, lo + share);

    // The block's top 64 so far lives in s[0 .. 64); each tile's logits go behind it.
    for (int j = threadIdx.x; j < TOPK_MAX; j += blockDim.x) {
        sv[j] = NEG_INF;
        si[j] = TOPK_NO_ID;
    }
    for (int base = lo; base < hi; base += TOPK_TILE - TOPK_MAX) {
        const int count = min(hi - base, TOPK_TILE - TOPK_MAX);
        int len = 2 * TOPK_MAX;
        while (len < count + TOPK_MAX) len <<= 1;
        for (int j = threadIdx.x; j < len - TOPK_MAX; j += blockDim.x) {
            const bool real = j < count && token_allowed(words, mask_words, base + j);
            sv[TOPK_MAX + j] = real ? logits[base + j] : NEG_INF;
            si[TOPK_MAX + j] = real ? base + j : TOPK_NO_ID;
        }
        __syncthreads();
        // Bitonic sort of every 64-run, all descending: the first step of each size compares mirror
        // images within the size (so both halves may be sorted the same way), then half-cleaners.
        for (int size = 2; size <= TOPK_MAX; size <<= 1) {
            for (int t = size / 2; t > 0; t >>= 1) {
                for (int p = threadIdx.x; p < len / 2; p += blockDim.x) {
                    const int i = topk_pair(p, t);
                    topk_order(sv, si, i, t == size / 2 ? i ^ (size - 1) : i + t);
                }
                __syncthreads();
            }
        }
        topk_fold(sv, si, len);
    }

    for (int j = threadIdx.x; j < TOPK_MAX; j += blockDim.x) {
        part_v[blockIdx.x * TOPK_MAX + j] = sv[j];
        part_i[blockIdx.x * TOPK_MAX + j] = si[j];
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // Last block: the first fold happens while loading (list 2q against list 2q + 1, absent lists
    // are padding), then the TOPK_BLOCKS / 2 bitonic runs are sorted and folded to one.
    const volatile float* pv = part_v;
    const volatile int* pi = part_i;
    for (int p = threadIdx.x; p < TOPK_BLOCKS / 2 * TOPK_MAX; p += blockDim.x) {
        const int q = p / TOPK_MAX, j = p % TOPK_MAX;
        const int a = 2 * q * TOPK_MAX + j, b = (2 * q + 1) * TOPK_MAX + TOPK_MAX - 1 - j;
        float v = NEG_INF, bv = NEG_INF;
        int i = TOPK_NO_ID, bi = TOPK_NO_ID;
        if (2 * q < (int)gridDim.x) {
            v = pv[a];
            i = pi[a];
        }
        if (2 * q + 1 < (int)gridDim.x) {
            bv = pv[b];
            bi = pi[b];
        }
        const bool take_b = topk_before(bv, bi, v, i);
        sv[p] = take_b ? bv : v;
        si[p] = take_b ? bi : i;
    }
    __syncthreads();
    topk_clean(sv, si, TOPK_BLOCKS / 2, TOPK_MAX);
    topk_fold(sv, si, TOPK_BLOCKS / 2 * TOPK_MAX);

    if (k_dev) k = *k_dev;
    k = max(0, min(k, TOPK_MAX));
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        out_v[j] = sv[j];
        out_i[j] = si[j] == TOPK_NO_ID ? -1 : si[j];
    }
    if (threadIdx.x == 0) *ticket = 0;
}

// The log-partition of the allowed logits among the first min(n, limit) (the token mask as
// argmax's): out[0] = log sum exp(l * inv_t) (inv_t = 1 / temperature), out[1] = log sum exp(l);
// both -inf when no id is allowed. Top-p and min-p sampling from the top-k candidates need the first
// (the candidates' share of the whole distribution), log-probabilities the second. Each block
// takes a strided share: its max, then both sums relative to it, into part [3 * gridDim.x]; the
// last block to finish (a ticket, reset afterwards) combines them in block order, so every launch
// gives the same bits. Launch: grid LOGZ_BLOCKS (128), block 256; part holds 3 * gridDim.x floats.
#define LOGZ_THREADS 256

ATLAS_KERNEL void log_partition(const float* logits, int n, int limit, const unsigned* mask, float inv_t,
                                float* part, int* ticket, float* out) {
    __shared__ float scratch[LOGZ_THREADS / WARP_SIZE];
    __shared__ int is_last;
    const int end = min(n, limit);
    int count;
    const unsigned* words = token_mask_words(mask, &count);
    float m = NEG_INF;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < end; i += gridDim.x * blockDim.x) {
        if (logits[i] > m && token_allowed(words, count, i)) m = logits[i];
    }
    m = warp_max(m);
    if (threadIdx.x % WARP_SIZE == 0) scratch[threadIdx.x / WARP_SIZE] = m;
    __syncthreads();
    for (int w = 0; w < (int)blockDim.x / WARP_SIZE; w++) m = fmaxf(m, scratch[w]);
    float sum_t = 0.0f, sum_1 = 0.0f;
    if (m > NEG_INF) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < end; i += gridDim.x * blockDim.x) {
            if (token_allowed(words, count, i) && logits[i] > NEG_INF) {
                sum_t += expf((logits[i] - m) * inv_t);
                sum_1 += expf(logits[i] - m);
            }
        }
    }
    sum_t = block_sum(sum_t, scratch);
    sum_1 = block_sum(sum_1, scratch);
    if (threadIdx.x == 0) {
        part[3 * blockIdx.x] = m;
        part[3 * blockIdx.x + 1] = sum_t;
        part[3 * blockIdx.x + 2] = sum_1;
        __threadfence();
        is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return;
    __threadfence();
    const volatile float* p = part;
    float top = NEG_INF;
    for (int b = 0; b < (int)gridDim.x; b++) top = fmaxf(top, p[3 * b]);
    float total_t = 0.0f, total_1 = 0.0f;
    for (int b = 0; b < (int)gridDim.x && top > NEG_INF; b++) {
        if (p[3 * b] == NEG_INF) continue;
        total_t += p[3 * b + 1] * expf((p[3 * b] - top) * inv_t);
        total_1 += p[3 * b + 2] * expf(p[3 * b] - top);
    }
    out[0] = top > NEG_INF ? top * inv_t + logf(total_t) : NEG_INF;
    out[1] = top > NEG_INF ? top + logf(total_1) : NEG_INF;
    *ticket = 0;
}

// Plain temperature sampling on the device: the id a uniform u in [0, 1) picks from the softmax
// at temperature 1 / inv_t of the allowed finite logits among the first min(n, limit) (the token
// mask as argmax's), walking the ids in order, as sampling::draw_in_order (the f64 reference)
// does. Each block takes a contiguous share of the ids, each of its threads a contiguous run of
// that share; a block writes its max and its sum of exp((l - max) * inv_t) (the runs' sums added
// in thread order) to part [2 * gridDim.x]. The last block to finish (a ticket, reset afterwards)
// scales the blocks' sums to the largest max, finds the block where the running total passes
// u times the total, sums that block's runs again (the same bits as the first time), finds the
// run, then the id: every launch gives the same id. Rounding that leaves u past everything picks
// the last allowed id. out[0] = the id (0 when none is allowed).
// Launch: grid DRAW_BLOCKS (128), block DRAW_THREADS (256); part holds 2 * gridDim.x floats.
#define DRAW_THREADS 256

__device__ __forceinline__ bool draw_counts(float l) { return l > NEG_INF && l < -NEG_INF; }

// Thread t's run of block b: [*lo, *hi).
__device__ __forceinline__ void draw_run(int end, int b, int t, int* lo, int* hi) {
    const int share = (end + (int)gridDim.x - 1) / (int)gridDim.x;
    const int run = (share + DRAW_THREADS - 1) / DRAW_THREADS;
    const int block_hi = min(end, b * share + share);
    *lo = min(block_hi, b * share + t * run);
    *hi = min(block_hi, *lo + run);
}

__device__ __forceinline__ float draw_weight(const float* logits, const unsigned* words, int count, int i, float m, float inv_t) {
    const float l = logits[i];
    return token_allowed(words, count, i) && draw_counts(l) ? expf(__fmul_rn(__fsub_rn(l, m), inv_t)) : 0.0f;
}

// The sum of thread t's run of block b, in id order.
__device__ float draw_run_sum(const float* logits, const unsigned* words, int count, int end, int b, int t, float m, float inv_t) {
    int lo, hi;
    draw_run(end, b, t, &lo, &hi);
    float s = 0.0f;
    for (int i = lo; i < hi; i++) s += draw_weight(logits, words, count, i, m, inv_t);
    return s;
}

ATLAS_KERNEL void draw_in_order(const float* logits, int n, int limit, const unsigned* mask, float inv_t, float u,
                                float* part, int* ticket, int* out) {
    __shared__ float sums[DRAW_THREADS];
    __shared__ float scratch[DRAW_THREADS / WARP_SIZE];
    __shared__ int is_last, chosen_block;
    __shared__ float block_max, rest_in_block;
    const int end = max(0, min(n, limit));
    int count;
    const unsigned* words = token_mask_words(mask, &count);

    int lo, hi;
    draw_run(end, blockIdx.x, threadIdx.x, &lo, &hi);
    float m = NEG_INF;
    for (int i = lo; i < hi; i++) {
        if (token_allowed(words, count, i) && draw_counts(logits[i])) m = fmaxf(m, logits[i]);
    }
    m = warp_max(m);
    if (threadIdx.x % WARP_SIZE == 0) scratch[threadIdx.x / WARP_SIZE] = m;
    __syncthreads();
    for (int w = 0; w < DRAW_THREADS / WARP_SIZE; w++) m = fmaxf(m, scratch[w]);
    sums[threadIdx.x] = m > NEG_INF ? draw_run_sum(logits, words, count, end, blockIdx.x, threadIdx.x, m, inv_t) : 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int t = 0; t < DRAW_THREADS; t++) s += sums[t];
        part[2 * blockIdx.x] = m;
        part[2 * blockIdx.x + 1] = s;
        __threadfence();
        is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    if (threadIdx.x == 0) {
        const volatile float* p = part;
        float top = NEG_INF;
        for (int b = 0; b < (int)gridDim.x; b++) top = fmaxf(top, p[2 * b]);
        float total = 0.0f;
        for (int b = 0; b < (int)gridDim.x && top > NEG_INF; b++) {
            if (p[2 * b] > NEG_INF) total += p[2 * b + 1] * expf(__fmul_rn(__fsub_rn(p[2 * b], top), inv_t));
        }
        float rest = u * total;
        int chosen = -1, last = -1;
        for (int b = 0; b < (int)gridDim.x && top > NEG_INF; b++) {
            if (p[2 * b] == NEG_INF) continue;
            const float scale = expf(__fmul_rn(__fsub_rn(p[2 * b], top), inv_t)), w = p[2 * b + 1] * scale;
            if (w <= 0.0f) continue;
            last = b;
            if (rest < w) {
                chosen = b;
                rest /= scale;
                break;
            }
            rest -= w;
        }
        if (chosen < 0 && last >= 0) {
            chosen = last;
            rest = -NEG_INF;  // past everything: the block's last allowed id
        }
        chosen_block = chosen;
        block_max = chosen >= 0 ? p[2 * chosen] : NEG_INF;
        rest_in_block = rest;
    }
    __syncthreads();
    if (chosen_block < 0) {
        if (threadIdx.x == 0) {
            out[0] = 0;
            *ticket = 0;
        }
        return;
    }
    sums[threadIdx.x] = draw_run_sum(logits, words, count, end, chosen_block, threadIdx.x, block_max, inv_t);
    __syncthreads();
    if (threadIdx.x != 0) return;
    // Thread 0 walks the runs, then the run u falls in; rounding that leaves u past a run's last
    // weight picks that run's last allowed id, past every run the last run's.
    float rest = rest_in_block;
    int id = -1, last_run = -1;
    for (int t = 0; t < DRAW_THREADS && id < 0; t++) {
        if (sums[t] <= 0.0f) continue;
        if (rest >= sums[t]) {
            rest -= sums[t];
            last_run = t;
            continue;
        }
        draw_run(end, chosen_block, t, &lo, &hi);
        for (int i = lo; i < hi; i++) {
            const float w = draw_weight(logits, words, count, i, block_max, inv_t);
            if (w <= 0.0f) continue;
            id = i;
            if (rest < w) break;
            rest -= w;
        }
    }
    if (id < 0 && last_run >= 0) {
        draw_run(end, chosen_block, last_run, &lo, &hi);
        for (int i = hi - 1; i >= lo && id < 0; i--) {
            if (draw_weight(logits, words, count, i, block_max, inv_t) > 0.0f) id = i;
        }
    }
    out[0] = max(id, 0);
    *ticket = 0;
}
