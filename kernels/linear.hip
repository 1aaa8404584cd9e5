// Linear layers for decode: y[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]), f32 accumulation.
// Layout: W [N, K] row-major (nn.Linear.weight), x [T, K] f32, y [T, N] f32, bias [N] f32 or null.
// Prefill (T > GEMV_MAX_T) is in gemm.hip.
#include "common/portable.h"
#include "common/fp8.h"
#include "common/mma.h"
#include "common/packed.h"

#define GEMV_MAX_T 8
// Tokens the FP8 one-token kernels take at once (one per column of an m16n8k16 mma).
#define GEMV1_TOKENS 8

// One-token products (decode): each warp computes GEMV_ROWS output rows, each lane streaming
// 16-byte weight chunks of all of them (two stages of loads in flight), so every x value read is
// used GEMV_ROWS times and the memory system stays busy. Launch: grid
// ceil(rows / (GEMV_ROWS * warps_per_block)), block GEMV_THREADS, dynamic shared memory K * 4 bytes
// when `norm_w` is given (else 0).
//
// `norm_w` (optional) fuses the RMSNorm that precedes these projections: the block stages
// x * norm_w in shared memory once, every warp reads it there, and the dot products are scaled by
// rsqrt(mean(x^2) + eps).
#define GEMV_THREADS 256
#define GEMV_ROWS 2
// Outputs per warp of the several-token bf16 kernels (gemv1_bf16_tokens; gemv1_gate_up_bf16_tokens,
// whose outputs take a gate and an up row each): every x value read serves that many weight rows,
// and each weight chunk is widened to f32 once for every token.
#define GEMV_TOKENS_ROWS 4

// A bf16 weight row: load(c) fetches 16-byte chunk c (8 values), dot() multiplies it with the
// chunk's x values.
struct Bf16Row {
    const uint4* p;
    __device__ __forceinline__ uint4 load(int c) const { return p[c]; }
    __device__ __forceinline__ float dot(uint4 q, const float* xc) const {
        return __uint_as_float(q.x << 16) * xc[0] + __uint_as_float(q.x & 0xffff0000u) * xc[1]
             + __uint_as_float(q.y << 16) * xc[2] + __uint_as_float(q.y & 0xffff0000u) * xc[3]
             + __uint_as_float(q.z << 16) * xc[4] + __uint_as_float(q.z & 0xffff0000u) * xc[5]
             + __uint_as_float(q.w << 16) * xc[6] + __uint_as_float(q.w & 0xffff0000u) * xc[7];
    }
    // The chunk widened to f32 once, for several tokens' dot_wide: the same products and sums
    // as dot, in the same order.
    __device__ __forceinline__ void widen(uint4 q, float (&w)[8]) const {
        w[0] = __uint_as_float(q.x << 16), w[1] = __uint_as_float(q.x & 0xffff0000u);
        w[2] = __uint_as_float(q.y << 16), w[3] = __uint_as_float(q.y & 0xffff0000u);
        w[4] = __uint_as_float(q.z << 16), w[5] = __uint_as_float(q.z & 0xffff0000u);
        w[6] = __uint_as_float(q.w << 16), w[7] = __uint_as_float(q.w & 0xffff0000u);
    }
    static __device__ __forceinline__ float dot_wide(const float (&w)[8], const float* xc) {
        return w[0] * xc[0] + w[1] * xc[1] + w[2] * xc[2] + w[3] * xc[3] + w[4] * xc[4] + w[5] * xc[5]
             + w[6] * xc[6] + w[7] * xc[7];
    }
};
__device__ __forceinline__ Bf16Row bf16_row(const bf16* w, int n, int K) { return Bf16Row{(const uint4*)(w + (long)n * K)}; }

// Calls store(i, v) for every float4 i < K / 4 of x, times norm_w when given, and returns this
// thread's part of the sum of squares of x. Each thread loads four float4 (and their weights) at a
// time, so that their latencies overlap: the staging of the input sits between the previous
// kernel's end and the first product. K % 4 == 0.
template <class Store>
__device__ __forceinline__ float stage_input4(const float* x, const float* norm_w, int K, Store store) {
    const float4* x4 = (const float4*)x;
    const float4* w4 = (const float4*)norm_w;
    float ss = 0.0f;
    for (int base = threadIdx.x; base < K / 4; base += 4 * blockDim.x) {
        float4 v[4], w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = base + j * blockDim.x;
            if (i < K / 4) {
                v[j] = x4[i];
                w[j] = norm_w ? w4[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = base + j * blockDim.x;
            if (i < K / 4) {
                ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
                store(i, make_float4(v[j].x * w[j].x, v[j].y * w[j].y, v[j].z * w[j].z, v[j].w * w[j].w));
            }
        }
    }
    return ss;
}

// The input the warps read: x * norm_w staged in the block's shared memory when norm_w is given
// (the norm's 1 / rms, a scalar, is applied to the dot products afterwards: one pass over x
// computes both), else x itself with scale 1. Every thread of the block must call it (it
// synchronises). K % 4 == 0.
// Several tokens: `tokens` rows of x (stride K), staged one after the other, each exactly as a
// lone token is; scale[n] is token n's.
template <int TOKENS>
__device__ __forceinline__ const float* gemv_input(const float* x, const float* norm_w, float eps, int K, int tokens,
                                                   float (&scale)[TOKENS]) {
    extern __shared__ float gemv_x[];
    __shared__ float scratch[32];
#pragma unroll
    for (int n = 0; n < TOKENS; n++) scale[n] = 1.0f;
    if (!norm_w) return x;
#pragma unroll
    for (int n = 0; n < TOKENS; n++) {
        if (n >= tokens) break;
        float* xn = gemv_x + n * K;
        const float ss = stage_input4(x + (long)n * K, norm_w, K, [&](int i, float4 v) { ((float4*)xn)[i] = v; });
        scale[n] = rsqrtf(block_sum(ss, scratch) / K + eps);  // block_sum's barriers publish gemv_x too
    }
    return gemv_x;
}

// Loads in flight, STAGES deep: stage s of `st` holds step k (fetch(stage, k)) until
// consume(stage, k) takes it, then fills again with the step STAGES strides ahead. Steps run
// first, first + stride, ... < count in that order, so the arithmetic is the same for any
// depth. pipeline_fill issues the first loads (before pdl_wait, so that they overlap the previous
// kernel's end); pipeline_drain consumes and refills.
template <int STAGES, class Stage, class Fetch>
__device__ __forceinline__ void pipeline_fill(Stage (&st)[STAGES], int first, int stride, Fetch fetch) {
#pragma unroll
    for (int s = 0; s < STAGES; s++) fetch(st[s], first + s * stride);
}
template <int STAGES, class Stage, class Fetch, class Consume>
__device__ __forceinline__ void pipeline_drain(Stage (&st)[STAGES], int first, int stride, int count, Fetch fetch,
                                               Consume consume) {
    for (int k0 = first; k0 < count; k0 += STAGES * stride) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            const int k = k0 + s * stride;
            if (k >= count) return;
            consume(st[s], k);
            if (k + STAGES * stride < count) fetch(st[s], k + STAGES * stride);
        }
    }
}

// One lane-strided 16-byte chunk of each of ROWS weight rows: two such stages in flight per lane
// (measured on an H200: one chunk per row per stage beats two, four and eight).
template <int ROWS>
struct GemvStage {
    uint4 p[ROWS];
    __device__ __forceinline__ void fetch(const Bf16Row* rows, int c, int chunks) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) p[r] = c < chunks ? rows[r].load(c) : make_uint4(0, 0, 0, 0);
    }
    // Token n's input starts at x + n * K; acc[r][n] is row r's sum for it.
    template <int TOKENS>
    __device__ __forceinline__ void consume(const Bf16Row* rows, int c, int chunks, const float* x, int K, int tokens,
                                            float (&acc)[ROWS][TOKENS]) const {
        if (c >= chunks) return;
        if constexpr (TOKENS == 1) {
            const float4 lo = ((const float4*)x)[2 * c], hi = ((const float4*)x)[2 * c + 1];
            const float xc[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r][0] += rows[r].dot(p[r], xc);
        } else {
            // Every token's chunk of x in registers, then each weight chunk widened once.
            float xc[TOKENS][8];
#pragma unroll
            for (int n = 0; n < TOKENS; n++) {
                if (n >= tokens) break;
                const float4 lo = ((const float4*)(x + (long)n * K))[2 * c], hi = ((const float4*)(x + (long)n * K))[2 * c + 1];
                xc[n][0] = lo.x, xc[n][1] = lo.y, xc[n][2] = lo.z, xc[n][3] = lo.w;
                xc[n][4] = hi.x, xc[n][5] = hi.y, xc[n][6] = hi.z, xc[n][7] = hi.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                float w[8];
                rows[r].widen(p[r], w);
#pragma unroll
                for (int n = 0; n < TOKENS; n++) {
                    if (n >= tokens) break;
                    acc[r][n] += Bf16Row::dot_wide(w, xc[n]);
                }
            }
        }
    }
};

// acc[r][n] = rows[r] · x[n] (normalised), summed over the warp, for `tokens` (<= TOKENS) rows of
// x: each token's products and sums are those it gets alone. The first two stages' loads are
// issued before waiting for the previous kernel (launched early, the first weights stream in while
// it finishes) and before the input is staged; then each stage is refilled as soon as it is used.
template <int ROWS, int TOKENS>
__device__ __forceinline__ void gemv_rows_dot(const Bf16Row* rows, bool active, const float* x, const float* norm_w,
                                              float eps, int K, int tokens, float (&acc)[ROWS][TOKENS]) {
    const int lane = threadIdx.x % WARP_SIZE, chunks = K / 8, step = WARP_SIZE;
    GemvStage<ROWS> cur, next;
    pdl_launch_dependents();
    if (active) {
        cur.fetch(rows, lane, chunks);
        next.fetch(rows, lane + step, chunks);
    }
    pdl_wait();  // weights are constant; x, the outputs and the residual belong to the previous kernel
    float scale[TOKENS];
    const float* xs = gemv_input<TOKENS>(x, norm_w, eps, K, tokens, scale);
    if (!active) return;
    for (int c0 = lane; c0 < chunks; c0 += 2 * step) {
        cur.consume(rows, c0, chunks, xs, K, tokens, acc);
        if (c0 + 2 * step < chunks) cur.fetch(rows, c0 + 2 * step, chunks);
        if (c0 + step >= chunks) break;
        next.consume(rows, c0 + step, chunks, xs, K, tokens, acc);
        if (c0 + 3 * step < chunks) next.fetch(rows, c0 + 3 * step, chunks);
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int n = 0; n < TOKENS; n++) acc[r][n] = warp_sum(acc[r][n]) * scale[n];
}

// Which of up to four consecutive segments of n0, n1, n2, n3 rows row g lies in, and its row there.
__device__ __forceinline__ void gemv1_segment(int g, int n0, int n1, int n2, int& seg, int& n) {
    seg = g >= n0 + n1 + n2 ? 3 : g >= n0 + n1 ? 2 : g >= n0 ? 1 : 0;
    n = g - (seg == 3 ? n0 + n1 + n2 : seg == 2 ? n0 + n1 : seg == 1 ? n0 : 0);
}

template <typename T>
__device__ __forceinline__ T gemv1_pick(int seg, T a, T b, T c, T d) {
    return seg == 3 ? d : seg == 2 ? c : seg == 1 ? b : a;
}

// Up to four projections of the same input in one launch (q, gate, k and v; a DeltaNet layer's
// four inputs): rows [0, n0) go to y0, the next n1 to y1, and so on. `residual` (may be y0) is
// added to segment 0. K % 8 == 0. The scale arguments are unused (same signature as gemv1_fp8).
// For `tokens` (<= TOKENS) rows of x [tokens, K]: y0..y3 and the residual are [tokens, n_i].
template <int ROWS, int TOKENS>
__device__ __forceinline__ void gemv1_bf16_rows(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3,
                                                const float* b0, const float* b1, const float* b2, const float* b3,
                                                float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2,
                                                int n3, const float* x, const float* norm_w, float eps,
                                                const float* residual, int K, int tokens) {
    const int first = (blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE) * ROWS;
    const int total = n0 + n1 + n2 + n3;
    Bf16Row rows[ROWS];
    int seg[ROWS], n[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        // Rows past the end read row 0 and are not written.
        gemv1_segment(first + r < total ? first + r : 0, n0, n1, n2, seg[r], n[r]);
        rows[r] = bf16_row(gemv1_pick(seg[r], w0, w1, w2, w3), n[r], K);
    }
    float acc[ROWS][TOKENS] = {};
    gemv_rows_dot<ROWS, TOKENS>(rows, first < total, x, norm_w, eps, K, tokens, acc);
    if (threadIdx.x % WARP_SIZE != 0) return;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (first + r >= total) continue;
        const float* bias = gemv1_pick(seg[r], b0, b1, b2, b3);
        float* y = gemv1_pick(seg[r], y0, y1, y2, y3);
        const float* res = seg[r] == 0 ? residual : nullptr;
        const int cols = gemv1_pick(seg[r], n0, n1, n2, n3);
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
            if (t >= tokens) break;
            const long at = (long)t * cols + n[r];
            y[at] = acc[r][t] + (bias ? bias[n[r]] : 0.0f) + (res ? res[at] : 0.0f);
        }
    }
}

// One token (the decode step), and up to GEMV1_TOKENS (checking drafts, decoding several
// sequences: each token gets the bits the one-token kernel gives it).
ATLAS_KERNEL void gemv1_bf16(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const float* s0,
                             const float* s1, const float* s2, const float* s3, const float* b0, const float* b1,
                             const float* b2, const float* b3, float* y0, float* y1, float* y2, float* y3, int n0,
                             int n1, int n2, int n3, const float* x, const float* norm_w, float eps,
                             const float* residual, int K) {
    gemv1_bf16_rows<GEMV_ROWS, 1>(w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x, norm_w, eps, residual,
                                  K, 1);
}

ATLAS_KERNEL void gemv1_bf16_tokens(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const float* s0,
                                    const float* s1, const float* s2, const float* s3, const float* b0, const float* b1,
                                    const float* b2, const float* b3, float* y0, float* y1, float* y2, float* y3,
                                    int n0, int n1, int n2, int n3, const float* x, const float* norm_w, float eps,
                                    const float* residual, int K, int tokens) {
    gemv1_bf16_rows<GEMV_TOKENS_ROWS, GEMV1_TOKENS>(w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x,
                                                    norm_w, eps, residual, K, tokens);
}

// The same for up to 4 tokens (checking 3 drafts): room for fewer tokens takes fewer registers
// (ptxas, sm_90: 128 against 197, two blocks an SM against one), and each token the same sums.
ATLAS_KERNEL void gemv1_bf16_tokens4(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const float* s0,
                                     const float* s1, const float* s2, const float* s3, const float* b0, const float* b1,
                                     const float* b2, const float* b3, float* y0, float* y1, float* y2, float* y3,
                                     int n0, int n1, int n2, int n3, const float* x, const float* norm_w, float eps,
                                     const float* residual, int K, int tokens) {
    gemv1_bf16_rows<GEMV_TOKENS_ROWS, 4>(w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x, norm_w, eps,
                                         residual, K, tokens);
}

// The gated MLP's first half: out[n] = silu(x·G[n] + gb[n]) * (x·U[n] + ub[n]), ROWS values of n
// per warp (so 2 * ROWS weight rows), for `tokens` rows of x (out [tokens, N]). K % 8 == 0; sg, su
// unused (as gemv1_gate_up_fp8's).
template <int ROWS, int TOKENS>
__device__ __forceinline__ void gemv1_gate_up_bf16_rows(const bf16* g, const bf16* u, const float* gate_bias,
                                                        const float* up_bias, const float* x, const float* norm_w,
                                                        float eps, float* out, int N, int K, int tokens) {
    const int first = (blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE) * ROWS;
    Bf16Row rows[2 * ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int n = first + r < N ? first + r : 0;
        rows[2 * r] = bf16_row(g, n, K);
        rows[2 * r + 1] = bf16_row(u, n, K);
    }
    float acc[2 * ROWS][TOKENS] = {};
    gemv_rows_dot<2 * ROWS, TOKENS>(rows, first < N, x, norm_w, eps, K, tokens, acc);
    if (threadIdx.x % WARP_SIZE != 0) return;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int n = first + r;
        if (n >= N) continue;
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
            if (t >= tokens) break;
            const float gv = acc[2 * r][t] + (gate_bias ? gate_bias[n] : 0.0f);
            const float uv = acc[2 * r + 1][t] + (up_bias ? up_bias[n] : 0.0f);
            out[(long)t * N + n] = gv / (1.0f + expf(-gv)) * uv;
        }
    }
}

ATLAS_KERNEL void gemv1_gate_up_bf16(const bf16* g, const bf16* u, const float* sg, const float* su,
                                     const float* gate_bias, const float* up_bias, const float* x,
                                     const float* norm_w, float eps, float* out, int N, int K) {
    gemv1_gate_up_bf16_rows<GEMV_ROWS, 1>(g, u, gate_bias, up_bias, x, norm_w, eps, out, N, K, 1);
}

ATLAS_KERNEL void gemv1_gate_up_bf16_tokens(const bf16* g, const bf16* u, const float* sg, const float* su,
                                            const float* gate_bias, const float* up_bias, const float* x,
                                            const float* norm_w, float eps, float* out, int N, int K, int tokens) {
    gemv1_gate_up_bf16_rows<GEMV_TOKENS_ROWS, GEMV1_TOKENS>(g, u, gate_bias, up_bias, x, norm_w, eps, out, N, K, tokens);
}

ATLAS_KERNEL void gemv1_gate_up_bf16_tokens4(const bf16* g, const bf16* u, const float* sg, const float* su,
                                             const float* gate_bias, const float* up_bias, const float* x,
                                             const float* norm_w, float eps, float* out, int N, int K, int tokens) {
    gemv1_gate_up_bf16_rows<GEMV_TOKENS_ROWS, 4>(g, u, gate_bias, up_bias, x, norm_w, eps, out, N, K, tokens);
}

// FP8 block-scaled weights (common/fp8.h) on matrix cores (fp8_rows_mma): a block takes 16 output
// rows as TILES tiles of 16 weight rows (gemv1_fp8: the rows themselves; gemv1_gate_up_fp8: their
// gate rows and their up rows). Its FP8_UNITS units of 32 lanes share the 128-column blocks of K
// (unit u takes blocks u, u + FP8_UNITS, ...); per block, lane (g, t) reads chunks t and t + 4
// (16 bytes each) of the tile's rows g and g + 8, the next block's chunks in flight meanwhile;
// each 128-column block's products are scaled by its row's scale, and the units' sums meet in
// shared memory. The input is staged as f16 (times 2^-FP8_X_SHIFT: inputs up to ±65504 * 2^4 are
// kept, larger ones saturate there; an RMSNorm's 1 / rms is applied to the sums), zero-padded to
// whole blocks: dynamic shared memory ceil(K / 128) * 256 bytes. gemv1_fp8 streams its weights
// through shared memory where it can (Fp8Async below: the same sums, FP8_ASYNC_SLOTS slots more of
// dynamic shared memory). Launch: grid ceil(output rows / 16), block FP8_UNITS * 32. Needs K % 16 == 0.
#define FP8_UNITS 8
#define FP8_X_SHIFT 4

// The two rows a lane reads in one tile, and their lines of the scale grid.
struct Fp8Rows {
    const uint4* w[2];
    const float* scale[2];
    __device__ __forceinline__ void set(int h, const unsigned char* matrix, const float* scales, int n, int K) {
        const int kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK;
        w[h] = (const uint4*)(matrix + (long)n * K);
        scale[h] = scales + (n / FP8_BLOCK) * kblocks;
    }
};

// The block's inputs as f16 in shared memory, four values per uint2: `tokens` rows of x (row
// stride K), each times norm_w when given and times 2^-FP8_X_SHIFT, zero up to a whole number of
// `pad` columns; token n's at element n * fp8_padded(K, pad) / 4. scale[n] gets the factor token
// n's dot products need: 2^FP8_X_SHIFT, times its rsqrt(mean(x^2) + eps) when norm_w is given
// (one pass over x computes both). Each token is staged exactly as a lone token is. Every thread
// of the block must call it (it synchronises). K % 4 == 0.
__device__ __forceinline__ int fp8_padded(int K, int pad) { return (K + pad - 1) / pad * pad; }

// Two inputs as the FP8 kernels take them: an f16 pair of x * 2^-FP8_X_SHIFT, saturated rather
// than overflowing to infinity (a NaN stays a NaN).
__device__ __forceinline__ unsigned int fp8_x_pair(float a, float b) {
    auto f16_range = [](float v) {
        const float shifted = v * (1.0f / (1 << FP8_X_SHIFT));
        return fabsf(shifted) > 65504.0f ? copysignf(65504.0f, shifted) : shifted;
    };
    return f16x2_pack(f16_range(a), f16_range(b));
}

// The 16 inputs of chunk c (columns 16c..16c + 16) of token row x as fp8_gemv_input stages them
// (zeros past K), read in place: the same bits.
__device__ __forceinline__ void fp8_x_chunk(const float* x, int c, int K, uint4& lo, uint4& hi) {
    if (c * 16 >= K) {
        lo = hi = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    const float4* p = (const float4*)(x + c * 16);
    const float4 a = p[0], b = p[1], d = p[2], e = p[3];
    lo = make_uint4(fp8_x_pair(a.x, a.y), fp8_x_pair(a.z, a.w), fp8_x_pair(b.x, b.y), fp8_x_pair(b.z, b.w));
    hi = make_uint4(fp8_x_pair(d.x, d.y), fp8_x_pair(d.z, d.w), fp8_x_pair(e.x, e.y), fp8_x_pair(e.z, e.w));
}

template <int TOKENS>
__device__ __forceinline__ const uint4* fp8_gemv_input(const float* x, const float* norm_w, float eps, int K, int pad,
                                                       int tokens, float (&scale)[TOKENS]) {
    extern __shared__ __attribute__((aligned(16))) uint2 fp8_x[];
    __shared__ float scratch[32];
    const int padded = fp8_padded(K, pad);
#pragma unroll
    for (int n = 0; n < TOKENS; n++) {
        if (n >= tokens) break;
        uint2* xn = fp8_x + n * (padded / 4);
        const float ss = stage_input4(x + (long)n * K, norm_w, K, [&](int i, float4 v) {
            xn[i] = make_uint2(fp8_x_pair(v.x, v.y), fp8_x_pair(v.z, v.w));
        });
        for (int i = K / 4 + threadIdx.x; i < padded / 4; i += blockDim.x) xn[i] = make_uint2(0, 0);
        scale[n] = 1 << FP8_X_SHIFT;
        if (norm_w) scale[n] *= rsqrtf(block_sum(ss, scratch) / K + eps);  // its barriers publish fp8_x too
    }
    if (!norm_w) __syncthreads();
    return (const uint4*)fp8_x;
}

// scale[n] for a token index known only at run time, without indexing the registers.
template <int TOKENS>
__device__ __forceinline__ float fp8_token_scale(const float (&scale)[TOKENS], int n) {
    float s = scale[0];
#pragma unroll
    for (int k = 1; k < TOKENS; k++) s = n == k ? scale[k] : s;
    return s;
}

// One 128-column block of a lane's weights: chunks t and t + 4 of rows g and g + 8 of each tile,
// with the rows' scales for the block.
template <int TILES>
struct Fp8Stage {
    uint4 w[TILES][2][2];  // [tile][row g, g + 8][chunk t, t + 4]
    float scale[TILES][2];
    __device__ __forceinline__ void fetch(const Fp8Rows (&tiles)[TILES], int kb, int kblocks, int chunks, int t) {
#pragma unroll
        for (int i = 0; i < TILES; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                scale[i][h] = kb < kblocks ? tiles[i].scale[h][kb] : 0.0f;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int c = kb * 8 + j * 4 + t;
                    w[i][h][j] = kb < kblocks && c < chunks ? tiles[i].w[h][c] : make_uint4(0, 0, 0, 0);
                }
            }
    }
};

// Where async copies exist (common/portable.h), the one-token, one-tile kernel (gemv1_fp8) streams
// its weights through shared memory instead: far more bytes in flight than registers hold, which
// is what an H200 needs to approach its bandwidth (its GEMVs of the Qwen3.6-27B shape alone: 2.5-2.7
// TB/s in registers, 2.9-3.2 so). A slot holds 8 128-column blocks of every tile row (each row's
// 1 KB copied as two 512-byte pieces, one per warp instruction, as DRAM likes them) and their
// scales; SLOTS slots take turns, all but one in flight. Unit u consumes block u of each
// slot: the blocks, and the order, that the register pipeline gives it, so both give the same
// bits. Rows are FP8_SLOT_ROW bytes apart (1 KB + 64) so that lanes reading rows g and g + 1 hit
// different banks. Gate/up takes them as one tile of 8 gate rows and their 8 up rows
// (gemv1_gate_up_paired): two tiles' slots would leave room for one block an SM. Three slots, or two
// for long rows (gemv1_fp8_long): there three slots and the staged input leave room for two blocks
// an SM, and a grid of a little more than a wave of them waits on its last blocks (an H200, the
// Qwen3.6-27B down projection, K 17408: 38.2 us with three slots, 28.9 with two, three blocks an SM).
#define FP8_ASYNC_SLOTS 3
#define FP8_ASYNC_SLOTS_LONG 2
#define FP8_SLOT_ROW 1088
#define FP8_SLOT_SCALES 9  // floats per row (8 used; the ninth spreads rows over banks)
template <int TILES, int SLOTS>
struct Fp8Async {
    static constexpr int ROWS = TILES * 16;
    static constexpr int SLOT_BYTES = ROWS * FP8_SLOT_ROW + ROWS * FP8_SLOT_SCALES * 4;
    unsigned char* slots;               // dynamic shared memory, after the staged input
    const unsigned char* const* rows;   // the tile rows' weights (shared table)
    const float* const* scales;         // and their lines of the scale grid
    int chunks, kblocks;
    // Issues the copies of slot-load `st` (blocks 8 st .. 8 st + 7) and closes its group.
    __device__ __forceinline__ void issue(int st) const {
        unsigned char* slot = slots + (st % SLOTS) * SLOT_BYTES;
        for (int p = threadIdx.x; p < ROWS * 64; p += blockDim.x) {
            const int row = p / 64, piece = p % 64, c = st * 64 + piece;
            async_copy16(slot + row * FP8_SLOT_ROW + piece * 16, rows[row] + (c < chunks ? c * 16 : 0), c < chunks);
        }
        float* s = (float*)(slot + ROWS * FP8_SLOT_ROW);
        for (int p = threadIdx.x; p < ROWS * 8; p += blockDim.x) {
            const int row = p / 8, kb = st * 8 + p % 8;
            async_copy4(s + row * FP8_SLOT_SCALES + p % 8, scales[row] + (kb < kblocks ? kb : 0), kb < kblocks);
        }
        async_commit();
    }
    // Lane (g, t) of unit `unit`: its chunks and scales of slot-load `st`, as Fp8Stage::fetch gives them.
    __device__ __forceinline__ void read(int st, int unit, int g, int t, Fp8Stage<TILES>& out) const {
        const unsigned char* slot = slots + (st % SLOTS) * SLOT_BYTES;
        const float* s = (const float*)(slot + ROWS * FP8_SLOT_ROW);
#pragma unroll
        for (int i = 0; i < TILES; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = i * 16 + g + 8 * h;
                out.scale[i][h] = s[row * FP8_SLOT_SCALES + unit];
#pragma unroll
                for (int j = 0; j < 2; j++) out.w[i][h][j] = *(const uint4*)(slot + row * FP8_SLOT_ROW + unit * 128 + (t + 4 * j) * 16);
            }
    }
};

// One tile's products over a chunk of 16 inputs (lo, hi: 8 f16 pairs): rows g, g + 8 (a, b) into c.
__device__ __forceinline__ void fp8_chunk_mma(float* c, uint4 a, uint4 b, uint4 lo, uint4 hi) {
    const unsigned int xp[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const unsigned int wg[4] = {a.x, a.y, a.z, a.w}, wg8[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int u = 0; u < 4; u++) fp8_rows_mma(c, wg[u], wg8[u], xp[2 * u], xp[2 * u + 1]);
}

// out[i]: row threadIdx.x % 16 of tile i times token threadIdx.x / 16 of the input, summed over K
// (valid in threads below 16 * tokens after the call; tokens <= TOKENS <= GEMV1_TOKENS). Weights
// are read before pdl_wait(): launched early, they stream in while the previous kernel finishes.
//
// Several tokens: on matrix cores the mma's 8 columns take up to 8 tokens (lane (g, t) passes
// token g's inputs and gets columns 2t and 2t + 1); elsewhere each lane sums its columns for every
// token. Either way a token's products and sums are those it gets alone (an mma column is computed
// from its own inputs only), so its result does not depend on the others: decode steps of several
// tokens give each the bits of a single step.
// SLOTS: 0, the register pipeline; else Fp8Async's slots (one tile), after the staged inputs.
template <int TILES, int TOKENS, int SLOTS>
__device__ __forceinline__ void fp8_rows_dot(const Fp8Rows (&tiles)[TILES], const float* x, const float* norm_w,
                                             float eps, int K, int tokens, float (&out)[TILES]) {
    __shared__ float sums[FP8_UNITS][TILES][16][TOKENS];
    __shared__ const unsigned char* row_table[TILES * 16];
    __shared__ const float* scale_table[TILES * 16];
    extern __shared__ __attribute__((aligned(16))) unsigned char fp8_dynamic[];
    const int unit = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK, chunks = K / 16;
    // Both pipelines' state; the one not taken is left unused.
    Fp8Stage<TILES> st[2];
    auto fetch = [&](Fp8Stage<TILES>& stage, int kb) { stage.fetch(tiles, kb, kblocks, chunks, t); };
    // Several tokens without a norm read their inputs in place (the same values as staged): eight
    // staged rows of a long input would fill the shared memory, and their staging would read as
    // many bytes as a block's weights before the first product. With a norm they are staged, so
    // that its sums are those of one token alone; so are gate/up's (always normed: the branch
    // would cost their two tiles registers). The weight slots follow the staged inputs, if any.
    const bool in_place = TOKENS > 1 && TILES == 1 && !norm_w;
    const int staged_bytes = in_place ? 0 : tokens * fp8_padded(K, FP8_BLOCK) * 2;
    const Fp8Async<TILES, SLOTS == 0 ? 2 : SLOTS> async = {fp8_dynamic + staged_bytes, row_table, scale_table, chunks, kblocks};
    const int loads = (kblocks + 7) / 8;
    pdl_launch_dependents();
    if constexpr (SLOTS > 0) {
        if (unit == 0 && t == 0)
#pragma unroll
            for (int i = 0; i < TILES; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    row_table[i * 16 + g + 8 * h] = (const unsigned char*)tiles[i].w[h];
                    scale_table[i * 16 + g + 8 * h] = tiles[i].scale[h];
                }
        __syncthreads();
#pragma unroll
        for (int l = 0; l < SLOTS - 1; l++) {
            if (l < loads) async.issue(l);
            else async_commit();  // an empty group keeps the count async_wait relies on
        }
    } else {
        pipeline_fill(st, unit, FP8_UNITS, fetch);
    }
    pdl_wait();  // weights are constant; x, the outputs and the residual belong to the previous kernel
    float scale[TOKENS];
    const uint4* xs = nullptr;
    if (in_place) {
#pragma unroll
        for (int n = 0; n < TOKENS; n++) scale[n] = 1 << FP8_X_SHIFT;
    } else {
        xs = fp8_gemv_input<TOKENS>(x, norm_w, eps, K, FP8_BLOCK, tokens, scale);
    }
    const int stride = fp8_padded(K, FP8_BLOCK) / 8;  // uint4 per token
    // Chunk c of token n's inputs, staged or in place.
    auto input = [&](int n, int c, uint4& lo, uint4& hi) {
        if (in_place) {
            fp8_x_chunk(x + (long)n * K, c, K, lo, hi);
        } else {
            lo = xs[n * stride + 2 * c];
            hi = xs[n * stride + 2 * c + 1];
        }
    };

#if FP8_ROWS_MMA
    // [tile][row g, g + 8][column 2t, 2t + 1 (only the first for one token: every column is it)];
    // this lane's B column holds token g (token 0 when there are fewer: its column is not read).
    constexpr int COLS = TOKENS > 1 ? 2 : 1;
    float acc[TILES][2][COLS] = {};
    const int token = g < tokens ? g : 0;
    auto consume = [&](const Fp8Stage<TILES>& st, int kb) {
        // A sum per chunk: two shorter chains of dependent products.
        float c[TILES][2][4] = {};
#pragma unroll
        for (int j = 0; j < 2; j++) {
            // The chunk's 16 inputs: 8 f16 pairs.
            const int chunk = kb * 8 + j * 4 + t;
            uint4 lo, hi;
            input(token, chunk, lo, hi);
#pragma unroll
            for (int i = 0; i < TILES; i++) fp8_chunk_mma(c[i][j], st.w[i][0][j], st.w[i][1][j], lo, hi);
        }
#pragma unroll
        for (int i = 0; i < TILES; i++)
#pragma unroll
            for (int col = 0; col < COLS; col++) {
                acc[i][0][col] += (c[i][0][col] + c[i][1][col]) * st.scale[i][0];
                acc[i][1][col] += (c[i][0][2 + col] + c[i][1][2 + col]) * st.scale[i][1];
            }
    };
#else
    // [tile][row g, g + 8][token]: this lane's columns, summed over the quad at the end.
    float acc[TILES][2][TOKENS] = {};
    auto consume = [&](const Fp8Stage<TILES>& st, int kb) {
#pragma unroll
        for (int n = 0; n < TOKENS; n++) {
            if (n >= tokens) break;
            float c[TILES][2][4] = {};
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int chunk = kb * 8 + j * 4 + t;
                uint4 lo, hi;
                input(n, chunk, lo, hi);
#pragma unroll
                for (int i = 0; i < TILES; i++) fp8_chunk_mma(c[i][j], st.w[i][0][j], st.w[i][1][j], lo, hi);
            }
#pragma unroll
            for (int i = 0; i < TILES; i++) {
                acc[i][0][n] += (c[i][0][0] + c[i][1][0]) * st.scale[i][0];
                acc[i][1][n] += (c[i][0][2] + c[i][1][2]) * st.scale[i][1];
            }
        }
    };
#endif
    if constexpr (SLOTS > 0) {
        for (int l = 0; l < loads; l++) {
            async_wait<SLOTS - 2>();  // this thread's copies of load l have landed
            __syncthreads();          // everyone's; and the slot load l - 1 used is free
            if (l + SLOTS - 1 < loads) async.issue(l + SLOTS - 1);
            else async_commit();
            const int kb = l * 8 + unit;
            if (kb < kblocks) {
                // Inputs read in place: the next block's into L1 meanwhile (registers would cost
                // this kernel its third block an SM).
                if (in_place)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const int c = (kb + 8) * 8 + j * 4 + t;
                        if (c < chunks) prefetch_l1(x + (long)(g < tokens ? g : 0) * K + c * 16);
                    }
                async.read(l, unit, g, t, st[0]);
                consume(st[0], kb);
            }
        }
    } else {
        pipeline_drain(st, unit, FP8_UNITS, kblocks, fetch, consume);
    }
#pragma unroll
    for (int i = 0; i < TILES; i++) {
#if FP8_ROWS_MMA
#pragma unroll
        for (int col = 0; col < COLS; col++) {
            const int n = 2 * t + col;
            if (n < tokens && n < TOKENS) {
                sums[unit][i][g][n] = acc[i][0][col];
                sums[unit][i][g + 8][n] = acc[i][1][col];
            }
        }
#else
#pragma unroll
        for (int n = 0; n < TOKENS; n++) {
            const float row_g = fp8_quad_total(acc[i][0][n]), row_g8 = fp8_quad_total(acc[i][1][n]);
            if (t == 0 && n < tokens) {
                sums[unit][i][g][n] = row_g;
                sums[unit][i][g + 8][n] = row_g8;
            }
        }
#endif
    }
    __syncthreads();
    const int r = threadIdx.x % 16, n = threadIdx.x / 16;
    if (n >= tokens) return;
    const float s = fp8_token_scale<TOKENS>(scale, n);
#pragma unroll
    for (int i = 0; i < TILES; i++) {
        float total = 0.0f;
        for (int u = 0; u < FP8_UNITS; u++) total += sums[u][i][r][n];
        out[i] = total * s;
    }
}

// bf16 weights on matrix cores (NVIDIA sm_80+, BF16_ROWS_MMA: the gemv1_*_bf16_mma kernels, which
// engines that decode several sequences together use instead of gemv1_bf16 and friends: as fast
// for eight tokens as for one, where the CUDA-core kernels take about three times as long; about 7 %
// slower for one token on an H200, so single-sequence engines keep those). The FP8 kernels' shape:
// a block takes 16 output rows as TILES tiles of 16 weight rows, its FP8_UNITS units share the
// 64-column blocks of K (unit u takes blocks u, u + FP8_UNITS, ...); per block, lane (g, t) reads
// chunks t and t + 4 (8 values each) of the tile's rows g and g + 8, the next block's in flight
// meanwhile. Each input value goes through the mma as two bf16, x rounded (hi) and the rest rounded
// (lo), in two chains of accumulators: products with 16 significant bits of x, each exact in f32.
// A token's column of the mma is computed from its own inputs only, so one token and several get
// the same bits (a sequence decoded beside others answers as it would alone). The input is read in
// place, times norm_w as it is used, and the norm's sum of squares is taken from the same values on
// the way (each lane its own, then the quad, then the units in order: one token's the same as
// several's); no pass over the input before the products (eight tokens' took as long as a tenth of
// the weights, in every block). Launch: grid ceil(output rows / 16), block FP8_UNITS * 32, dynamic
// shared memory K * 4 bytes when `norm_w` is given (its weights), else none. Needs K % 8 == 0.
#define BF16_MMA_BLOCK 64

#if BF16_ROWS_MMA
// The two rows a lane reads in one tile (`scales` unused: the signature of Fp8Rows::set).
struct Bf16Rows {
    const uint4* w[2];
    __device__ __forceinline__ void set(int h, const bf16* matrix, const float*, int n, int K) {
        w[h] = (const uint4*)(matrix + (long)n * K);
    }
};

// x rounded to bf16 pairs (hi) and what that rounding left, rounded (lo): eight values.
__device__ __forceinline__ void bf16_split8(const float (&x)[8], unsigned int (&hi)[4], unsigned int (&lo)[4]) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        hi[u] = bf16x2_pack(x[2 * u], x[2 * u + 1]);
        lo[u] = bf16x2_pack(x[2 * u] - __uint_as_float(hi[u] << 16), x[2 * u + 1] - __uint_as_float(hi[u] & 0xffff0000u));
    }
}

template <int TILES, int TOKENS, int SLOTS>
__device__ __forceinline__ void rows_dot(const Bf16Rows (&tiles)[TILES], const float* x, const float* norm_w,
                                         float eps, int K, int tokens, float (&out)[TILES]) {
    __shared__ float sums[FP8_UNITS][TILES][16][TOKENS];
    __shared__ float squares[FP8_UNITS][TOKENS];  // each unit's part of each token's sum of squares
    const int unit = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int chunks = K / 8, kblocks = (K + BF16_MMA_BLOCK - 1) / BF16_MMA_BLOCK;
    // One tile: a block of two would spill the registers that prefetching its input takes.
    static_assert(TILES == 1, "bf16 on matrix cores takes one tile a block");
    // [tile][row g, g + 8][chunk t, t + 4] of one 64-column block, and this lane's input there
    // (x[j][half]: its chunks' 8 values), loaded a step ahead as the weights are, once the
    // previous kernel has written it (their L2 latency is otherwise every step's).
    struct Stage {
        uint4 w[TILES][2][2];
        float4 x[2][2];
        __device__ __forceinline__ void fetch(const Bf16Rows (&tiles)[TILES], int kb, int chunks, int t) {
#pragma unroll
            for (int i = 0; i < TILES; i++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const int c = kb * 8 + j * 4 + t;
                        w[i][h][j] = c < chunks ? tiles[i].w[h][c] : make_uint4(0, 0, 0, 0);
                    }
        }
        __device__ __forceinline__ void fetch_x(const float4* xt, int kb, int chunks, int t) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int c = kb * 8 + j * 4 + t;
                x[j][0] = c < chunks ? xt[2 * c] : make_float4(0, 0, 0, 0);
                x[j][1] = c < chunks ? xt[2 * c + 1] : make_float4(0, 0, 0, 0);
            }
        }
    } st[2];
    const float4* xt = nullptr;  // this lane's input row, once the previous kernel has written it
    auto fetch = [&](Stage& stage, int kb) {
        stage.fetch(tiles, kb, chunks, t);
        if (xt) stage.fetch_x(xt, kb, chunks, t);
    };
    pdl_launch_dependents();
    pipeline_fill(st, unit, FP8_UNITS, fetch);
    // The norm's weights, copied into shared memory behind the first weights: read from there,
    // each step's would wait out an L2 latency (the streamed weights evict them from L1).
    extern __shared__ __attribute__((aligned(16))) float4 bf16_norm_w[];
    if (norm_w) {
        for (int i = threadIdx.x; i < K / 4; i += blockDim.x) async_copy16(&bf16_norm_w[i], (const float4*)norm_w + i, true);
        async_commit();
    }
    pdl_wait();  // weights are constant; x, the outputs and the residual belong to the previous kernel
    // This lane's B column holds token g (token 0 when there are fewer: its column is not read).
    xt = (const float4*)(x + (long)(g < tokens ? g : 0) * K);
#pragma unroll
    for (int s = 0; s < 2; s++) st[s].fetch_x(xt, unit + s * FP8_UNITS, chunks, t);
    if (norm_w) {
        async_wait<0>();
        __syncthreads();
    }
    const float4* wt = norm_w ? bf16_norm_w : nullptr;
    float acc[TILES][2][4] = {};  // [tile][hi, lo chain][mma accumulator]
    float ss = 0.0f;              // token g's squares over this lane's values, in the order it meets them
    auto consume = [&](const Stage& st, int kb) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int c = kb * 8 + j * 4 + t;
            float4 a = st.x[j][0], b = st.x[j][1];
            if (wt) {
                const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 8; e++) ss = __fmaf_rn(v[e], v[e], ss);
                if (c < chunks) {
                    const float4 wa = wt[2 * c], wb = wt[2 * c + 1];
                    a = make_float4(a.x * wa.x, a.y * wa.y, a.z * wa.z, a.w * wa.w);
                    b = make_float4(b.x * wb.x, b.y * wb.y, b.z * wb.z, b.w * wb.w);
                }
            }
            const float xc[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            unsigned int hi[4], lo[4];
            bf16_split8(xc, hi, lo);
#pragma unroll
            for (int i = 0; i < TILES; i++) {
                const uint4 rg = st.w[i][0][j], rg8 = st.w[i][1][j];
                bf16_rows_mma(acc[i][0], rg.x, rg8.x, rg.y, rg8.y, hi[0], hi[1]);
                bf16_rows_mma(acc[i][0], rg.z, rg8.z, rg.w, rg8.w, hi[2], hi[3]);
                bf16_rows_mma(acc[i][1], rg.x, rg8.x, rg.y, rg8.y, lo[0], lo[1]);
                bf16_rows_mma(acc[i][1], rg.z, rg8.z, rg.w, rg8.w, lo[2], lo[3]);
            }
        }
    };
    pipeline_drain(st, unit, FP8_UNITS, kblocks, fetch, consume);
    // Lane (g, t) holds columns 2t, 2t + 1 (tokens; for one token every column is it).
#pragma unroll
    for (int i = 0; i < TILES; i++)
#pragma unroll
        for (int col = 0; col < 2; col++) {
            const int n = 2 * t + col;
            if (n < tokens && n < TOKENS) {
                sums[unit][i][g][n] = acc[i][0][col] + acc[i][1][col];
                sums[unit][i][g + 8][n] = acc[i][0][2 + col] + acc[i][1][2 + col];
            }
        }
    // Token g's squares: the quad's four lanes (a sum the same in each), then the units in order.
    ss += shfl_xor(ss, 1);
    ss += shfl_xor(ss, 2);
    if (t == 0 && g < tokens && g < TOKENS) squares[unit][g] = ss;
    __syncthreads();
    const int r = threadIdx.x % 16, n = threadIdx.x / 16;
    if (n >= tokens || n >= TOKENS) return;
    float total = 0.0f;
    for (int u = 0; u < FP8_UNITS; u++) total += squares[u][n];
    const float s = norm_w ? rsqrtf(total / K + eps) : 1.0f;
#pragma unroll
    for (int i = 0; i < TILES; i++) {
        float total = 0.0f;
        for (int u = 0; u < FP8_UNITS; u++) total += sums[u][i][r][n];
        out[i] = total * s;
    }
}
#endif

// The tiled kernels' dot products, by the weights' row type; SLOTS as fp8_rows_dot's (bf16 has none).
template <int TILES, int TOKENS, int SLOTS>
__device__ __forceinline__ void rows_dot(const Fp8Rows (&tiles)[TILES], const float* x, const float* norm_w,
                                         float eps, int K, int tokens, float (&out)[TILES]) {
    fp8_rows_dot<TILES, TOKENS, ASYNC_COPY ? SLOTS : 0>(tiles, x, norm_w, eps, K, tokens, out);
}

// As gemv1_bf16 (up to four projections of one input, the residual added to the first), in tiles of 16 rows: FP8 weights (Rows = Fp8Rows, W = unsigned char) with scale grids
// s0..s3, or bf16 on matrix cores (Bf16Rows, W = bf16; no scales), for `tokens` (1..TOKENS) rows
// of x [tokens, K]: y0..y3 and the residual are [tokens, n_i].
template <class Rows, class W, int TOKENS, int SLOTS = 0>
__device__ __forceinline__ void gemv1_tiled_rows(const W* w0, const W* w1, const W* w2, const W* w3, const float* s0,
                                                 const float* s1, const float* s2, const float* s3, const float* b0,
                                                 const float* b1, const float* b2, const float* b3, float* y0, float* y1,
                                                 float* y2, float* y3, int n0, int n1, int n2, int n3, const float* x,
                                                 const float* norm_w, float eps, const float* residual, int K, int tokens) {
    const int total = n0 + n1 + n2 + n3, lane = threadIdx.x % 32;
    // Row r of the block's tile lies in segment seg at row n of it (rows past the end read row 0).
    auto locate = [&](int r, int& seg, int& n) {
        gemv1_segment(blockIdx.x * 16 + r < total ? blockIdx.x * 16 + r : 0, n0, n1, n2, seg, n);
    };
    Rows tile[1];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int seg, n;
        locate(lane / 4 + 8 * h, seg, n);
        tile[0].set(h, gemv1_pick(seg, w0, w1, w2, w3), gemv1_pick(seg, s0, s1, s2, s3), n, K);
    }
    float out[1];
    rows_dot<1, TOKENS, SLOTS>(tile, x, norm_w, eps, K, tokens, out);
    const int r = threadIdx.x % 16, token = threadIdx.x / 16;
    if (token >= tokens || blockIdx.x * 16 + r >= total) return;
    int seg, n;
    locate(r, seg, n);
    const float* bias = gemv1_pick(seg, b0, b1, b2, b3);
    const long at = (long)token * gemv1_pick(seg, n0, n1, n2, n3) + n;
    float* y = gemv1_pick(seg, y0, y1, y2, y3);
    y[at] = out[0] + (bias ? bias[n] : 0.0f) + (seg == 0 && residual ? residual[at] : 0.0f);
}

// One token (the decode step), and up to GEMV1_TOKENS (checking drafts: each token gets the bits
// the one-token kernel gives it, with 8 KB more of shared memory for the partial sums).
ATLAS_KERNEL void gemv1_fp8(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,
                            const unsigned char* w3, const float* s0, const float* s1, const float* s2,
                            const float* s3, const float* b0, const float* b1, const float* b2, const float* b3,
                            float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3, const float* x,
                            const float* norm_w, float eps, const float* residual, int K) {
    gemv1_tiled_rows<Fp8Rows, unsigned char, 1, FP8_ASYNC_SLOTS>(w0, w1, w2, w3, s0, s1, s2, s3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x, norm_w, eps,
                      residual, K, 1);
}

// The same with FP8_ASYNC_SLOTS_LONG slots (the same bits), for long rows.
ATLAS_KERNEL void gemv1_fp8_long(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,
                                 const unsigned char* w3, const float* s0, const float* s1, const float* s2,
                                 const float* s3, const float* b0, const float* b1, const float* b2, const float* b3,
                                 float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3,
                                 const float* x, const float* norm_w, float eps, const float* residual, int K) {
    gemv1_tiled_rows<Fp8Rows, unsigned char, 1, FP8_ASYNC_SLOTS_LONG>(w0, w1, w2, w3, s0, s1, s2, s3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2,
                                                                       n3, x, norm_w, eps, residual, K, 1);
}

ATLAS_KERNEL void gemv1_fp8_tokens(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,
                                   const unsigned char* w3, const float* s0, const float* s1, const float* s2,
                                   const float* s3, const float* b0, const float* b1, const float* b2, const float* b3,
                                   float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3,
                                   const float* x, const float* norm_w, float eps, const float* residual, int K,
                                   int tokens) {
    gemv1_tiled_rows<Fp8Rows, unsigned char, GEMV1_TOKENS>(w0, w1, w2, w3, s0, s1, s2, s3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x,
                                 norm_w, eps, residual, K, tokens);
}

// As gemv1_gate_up_bf16, in tiles (as gemv1_tiled_rows): FP8 weights with scale grids sg, su, a
// tile of 16 gate rows and one of their 16 up rows, for `tokens` rows of x (out [tokens, N]).
template <class Rows, class W, int TOKENS>
__device__ __forceinline__ void gemv1_gate_up_tiled_rows(const W* g, const W* u, const float* sg, const float* su,
                                                         const float* gate_bias, const float* up_bias, const float* x,
                                                         const float* norm_w, float eps, float* out, int N, int K,
                                                         int tokens) {
    const int lane = threadIdx.x % 32;
    Rows tiles[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = blockIdx.x * 16 + lane / 4 + 8 * h < N ? blockIdx.x * 16 + lane / 4 + 8 * h : 0;
        tiles[0].set(h, g, sg, n, K);
        tiles[1].set(h, u, su, n, K);
    }
    float gu[2];
    rows_dot<2, TOKENS, 0>(tiles, x, norm_w, eps, K, tokens, gu);
    const int n = blockIdx.x * 16 + threadIdx.x % 16, token = threadIdx.x / 16;
    if (token >= tokens || n >= N) return;
    const float gv = gu[0] + (gate_bias ? gate_bias[n] : 0.0f), uv = gu[1] + (up_bias ? up_bias[n] : 0.0f);
    out[(long)token * N + n] = gv / (1.0f + expf(-gv)) * uv;
}

// A block's one tile is 8 gate rows (as rows g) and the same 8 up rows (as rows g + 8), for
// `tokens` (<= TOKENS) rows of x: FP8's one-token kernel streams them through Fp8Async's SLOTS slots
// as gemv1_fp8's are (the two tiles' slots would leave one block an SM); bf16 on matrix cores
// prefetches the input with the weights, which a block of two tiles has no registers for. A row's
// sum does not depend on the tile row it takes, so each output gets the bits of
// gemv1_gate_up_tiled_rows. Launch: grid ceil(N / 8).
template <class Rows, class W, int TOKENS, int SLOTS>
__device__ __forceinline__ void gemv1_gate_up_paired(const W* g, const W* u, const float* sg, const float* su,
                                                     const float* gate_bias, const float* up_bias, const float* x,
                                                     const float* norm_w, float eps, float* out, int N, int K,
                                                     int tokens) {
    const int mine = blockIdx.x * 8 + threadIdx.x % 32 / 4, n_lane = mine < N ? mine : 0;
    Rows tile[1];
    tile[0].set(0, g, sg, n_lane, K);
    tile[0].set(1, u, su, n_lane, K);
    float sum[1] = {0.0f};
    rows_dot<1, TOKENS, SLOTS>(tile, x, norm_w, eps, K, tokens, sum);
    // Thread 16 token + r holds tile row r of that token: gate row 8 blockIdx.x + r at r < 8, its
    // up row at r + 8 (every lane takes part in the shuffle; only those below 16 tokens hold sums).
    const float up_sum = shfl(sum[0], (threadIdx.x + 8) % 32);
    const int r = threadIdx.x % 16, token = threadIdx.x / 16, n = blockIdx.x * 8 + r;
    if (r >= 8 || token >= tokens || n >= N) return;
    const float gv = sum[0] + (gate_bias ? gate_bias[n] : 0.0f), uv = up_sum + (up_bias ? up_bias[n] : 0.0f);
    out[(long)token * N + n] = gv / (1.0f + expf(-gv)) * uv;
}

#if ASYNC_COPY
// Three blocks an SM, as gemv1_fp8.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 3) gemv1_gate_up_fp8(const unsigned char* g, const unsigned char* u, const float* sg,
                                    const float* su, const float* gate_bias, const float* up_bias, const float* x,
                                    const float* norm_w, float eps, float* out, int N, int K) {
    gemv1_gate_up_paired<Fp8Rows, unsigned char, 1, FP8_ASYNC_SLOTS>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N, K, 1);
}
#else
// Without async copies, two tiles of 16 rows (gate and up) in registers, grid ceil(N / 16). Two
// blocks per SM: the register budget that allows costs a few bytes of spill (two tiles of loads in flight).
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2) gemv1_gate_up_fp8(const unsigned char* g, const unsigned char* u, const float* sg,
                                    const float* su, const float* gate_bias, const float* up_bias, const float* x,
                                    const float* norm_w, float eps, float* out, int N, int K) {
    gemv1_gate_up_tiled_rows<Fp8Rows, unsigned char, 1>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N, K, 1);
}
#endif

// Two slots for long rows, as gemv1_fp8_long (launched only where async copies exist).
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 3) gemv1_gate_up_fp8_long(const unsigned char* g, const unsigned char* u, const float* sg,
                                    const float* su, const float* gate_bias, const float* up_bias, const float* x,
                                    const float* norm_w, float eps, float* out, int N, int K) {
    gemv1_gate_up_paired<Fp8Rows, unsigned char, 1, FP8_ASYNC_SLOTS_LONG>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N,
                                                                      K, 1);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    gemv1_gate_up_fp8_tokens(const unsigned char* g, const unsigned char* u, const float* sg, const float* su,
                             const float* gate_bias, const float* up_bias, const float* x, const float* norm_w, float eps,
                             float* out, int N, int K, int tokens) {
    gemv1_gate_up_tiled_rows<Fp8Rows, unsigned char, GEMV1_TOKENS>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N, K, tokens);
}

#if BF16_ROWS_MMA
// The bf16 kernels on matrix cores (the tiled form above), for engines that decode several
// sequences together: the same launches as gemv1_fp8 and gemv1_gate_up_fp8, and the same
// arguments as gemv1_bf16 and gemv1_gate_up_bf16. Two blocks per SM (register budget).
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    gemv1_bf16_mma(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const float* s0, const float* s1,
                   const float* s2, const float* s3, const float* b0, const float* b1, const float* b2, const float* b3,
                   float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3, const float* x,
                   const float* norm_w, float eps, const float* residual, int K) {
    gemv1_tiled_rows<Bf16Rows, bf16, 1>(w0, w1, w2, w3, s0, s1, s2, s3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x,
                                        norm_w, eps, residual, K, 1);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    gemv1_bf16_mma_tokens(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const float* s0,
                          const float* s1, const float* s2, const float* s3, const float* b0, const float* b1,
                          const float* b2, const float* b3, float* y0, float* y1, float* y2, float* y3, int n0, int n1,
                          int n2, int n3, const float* x, const float* norm_w, float eps, const float* residual, int K,
                          int tokens) {
    gemv1_tiled_rows<Bf16Rows, bf16, GEMV1_TOKENS>(w0, w1, w2, w3, s0, s1, s2, s3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1,
                                                   n2, n3, x, norm_w, eps, residual, K, tokens);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    gemv1_gate_up_bf16_mma(const bf16* g, const bf16* u, const float* sg, const float* su, const float* gate_bias,
                           const float* up_bias, const float* x, const float* norm_w, float eps, float* out, int N,
                           int K) {
    gemv1_gate_up_paired<Bf16Rows, bf16, 1, 0>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N, K, 1);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    gemv1_gate_up_bf16_mma_tokens(const bf16* g, const bf16* u, const float* sg, const float* su,
                                  const float* gate_bias, const float* up_bias, const float* x, const float* norm_w,
                                  float eps, float* out, int N, int K, int tokens) {
    gemv1_gate_up_paired<Bf16Rows, bf16, GEMV1_TOKENS, 0>(g, u, sg, su, gate_bias, up_bias, x, norm_w, eps, out, N, K,
                                                           tokens);
}

#endif

// Several tokens of FP8 on matrix cores, a block for each unit's share of K: the split kernels.
// The tiled kernels above read every token's whole input (f32, from L2) in each block of 16 rows:
// for eight tokens twice the block's FP8 weights. Here block (b, u) takes unit u's share of K (the
// K blocks u, u + FP8_UNITS, ... that unit u of the tiled kernels takes) of SPLIT_TILES tiles, a
// tile a warp, and stages that share of every token's input in shared memory once for all of them,
// as f16. Each warp runs unit u's products in unit u's order, so its sums are the tiled kernels'
// per-unit sums; they go to `part` ([FP8_UNITS][tokens][rows of the grid]), and the last of a row
// group's FP8_UNITS blocks to finish (a ticket, left at zero) adds them in unit order and finishes
// the rows as the tiled kernels do: each token gets the bits of the one-token kernel alone. (bf16
// on matrix cores the same way was slower than its tiled kernels on an H100, whose re-read f32
// inputs cost no more L2 traffic there: docs/benchmarks.md.) Launch: grid (ceil(tile rows / (16
// SPLIT_TILES)), FP8_UNITS), block SPLIT_TILES * 32, dynamic shared memory for each token its
// share of the input as f16 and 16 bytes.
#if FP8_ROWS_MMA
#define SPLIT_TILES 8

// Lane (g, t)'s sums of its warp's tile rows g and g + 8 (row_g, row_g8) for tokens 2t and 2t + 1,
// the unit blockIdx.y's, to `part`; then the row group's ticket: true in the block that finishes
// the group, once every unit's sums (and whatever its threads wrote before) have landed.
__device__ __forceinline__ bool split_publish(const float (&row_g)[2], const float (&row_g8)[2], int tokens, float* part,
                                              int* tickets) {
    __shared__ bool is_last;
    const int unit = blockIdx.y, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int rows = gridDim.x * SPLIT_TILES * 16, row = (blockIdx.x * SPLIT_TILES + threadIdx.x / 32) * 16 + g;
#pragma unroll
    for (int col = 0; col < 2; col++) {
        const int n = 2 * t + col;
        if (n < tokens) {
            part[(long)(unit * tokens + n) * rows + row] = row_g[col];
            part[(long)(unit * tokens + n) * rows + row + 8] = row_g8[col];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&tickets[blockIdx.x], 1) == FP8_UNITS - 1;
    __syncthreads();
    if (!is_last) return false;
    __threadfence();
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
    return true;
}

// Token n's sums of row `row` of the grid, added in unit order (as the one-token kernels add their
// units' sums).
__device__ __forceinline__ float split_sum(const float* part, int tokens, int n, int row) {
    const volatile float* sums = part;
    const int rows = gridDim.x * SPLIT_TILES * 16;
    float total = 0.0f;
    for (int u = 0; u < FP8_UNITS; u++) total += sums[(long)(u * tokens + n) * rows + row];
    return total;
}

// The warp's tile (rows g and g + 8 of lane (g, t)) over unit blockIdx.y's share of K, the input
// staged as fp8_gemv_input stages it (times norm_w, times 2^-FP8_X_SHIFT), the products
// fp8_rows_dot's; leaves the unit's sums in `part` and returns true in the block that finishes the
// row group (after every unit's sums have landed). A norm's scale needs the sum of squares of a
// token's whole input in the one-token kernel's order: block u of each row group takes token u's
// (fp8_gemv_input's stage_input4 and block_sum over as many threads: the same bits) while its first
// weights stream in, and leaves it in norms[row group][u] for the block that finishes the group (a
// launch of its own before cost more than the reading). K % 16 == 0.
static_assert(GEMV1_TOKENS <= FP8_UNITS && SPLIT_TILES == FP8_UNITS, "a unit's block for each token's norm");
__device__ __forceinline__ bool split_dot(const Fp8Rows& tile, const float* x, const float* norm_w, float eps, int K,
                                          int tokens, float* part, int* tickets, float* norms) {
    extern __shared__ __attribute__((aligned(16))) uint4 split_x8[];
    const int unit = blockIdx.y, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK, chunks = K / 16;
    const int share = (kblocks + FP8_UNITS - 1) / FP8_UNITS, stride = share * 16 + 1;  // uint4; +1: tokens over banks
    const Fp8Rows tiles[1] = {tile};
    Fp8Stage<1> st[2];
    auto fetch = [&](Fp8Stage<1>& s, int kb) { s.fetch(tiles, kb, kblocks, chunks, t); };
    pdl_launch_dependents();
    pipeline_fill(st, unit, FP8_UNITS, fetch);
    pdl_wait();  // weights are constant; x, the norms and the outputs belong to the previous kernels
    if (norm_w && unit < tokens) {
        __shared__ float scratch[32];
        const float total = block_sum(stage_input4(x + (long)unit * K, norm_w, K, [](int, float4) {}), scratch);
        if (threadIdx.x == 0) norms[blockIdx.x * GEMV1_TOKENS + unit] = rsqrtf(total / K + eps);
    }
    // Token n's four columns q of share block m (K block unit + FP8_UNITS m) as two f16 pairs.
    uint2* staged = (uint2*)split_x8;
    for (int p = threadIdx.x; p < tokens * share * 32; p += blockDim.x) {
        const int n = p / (share * 32), m = p / 32 % share, q = p % 32, col = (unit + FP8_UNITS * m) * FP8_BLOCK + q * 4;
        uint2 v = make_uint2(0u, 0u);
        if (col < K) {
            float4 a = *(const float4*)(x + (long)n * K + col);
            if (norm_w) {
                const float4 w = *(const float4*)(norm_w + col);
                a = make_float4(a.x * w.x, a.y * w.y, a.z * w.z, a.w * w.w);
            }
            v = make_uint2(fp8_x_pair(a.x, a.y), fp8_x_pair(a.z, a.w));
        }
        staged[n * stride * 2 + m * 32 + q] = v;
    }
    __syncthreads();
    // This lane's B column holds token g (token 0 when there are fewer: its column is not read).
    const uint4* xs = split_x8 + (g < tokens ? g : 0) * stride;
    float acc[2][2] = {};  // [row g, g + 8][column 2t, 2t + 1]
    auto consume = [&](const Fp8Stage<1>& s, int kb) {
        float c[2][4] = {};  // [chunk t, t + 4][mma accumulator]: two shorter chains, as fp8_rows_dot
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const uint4* chunk = xs + kb / FP8_UNITS * 16 + (j * 4 + t) * 2;
            fp8_chunk_mma(c[j], s.w[0][0][j], s.w[0][1][j], chunk[0], chunk[1]);
        }
#pragma unroll
        for (int col = 0; col < 2; col++) {
            acc[0][col] += (c[0][col] + c[1][col]) * s.scale[0][0];
            acc[1][col] += (c[0][2 + col] + c[1][2 + col]) * s.scale[0][1];
        }
    };
    pipeline_drain(st, unit, FP8_UNITS, kblocks, fetch, consume);
    return split_publish(acc[0], acc[1], tokens, part, tickets);
}

// Token n's factor for its sums in the block that finishes its row group: fp8_rows_dot's
// 2^FP8_X_SHIFT, times the norm's scale that split_dot left in `norms` (with a norm).
__device__ __forceinline__ float split_scale(const float* norms, bool normed, int n) {
    float s = 1 << FP8_X_SHIFT;
    if (normed) s *= ((const volatile float*)norms)[blockIdx.x * GEMV1_TOKENS + n];
    return s;
}

// As gemv1_fp8_tokens, split by unit: its arguments, then the partial sums, the tickets and room
// for the norm's scales (GEMV1_TOKENS floats a row group).
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(SPLIT_TILES * 32, 3)
    gemv1_fp8_split(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2, const unsigned char* w3,
                    const float* s0, const float* s1, const float* s2, const float* s3, const float* b0, const float* b1,
                    const float* b2, const float* b3, float* y0, float* y1, float* y2, float* y3, int n0, int n1, int n2,
                    int n3, const float* x, const float* norm_w, float eps, const float* residual, int K, int tokens,
                    float* part, int* tickets, float* norms) {
    const int total = n0 + n1 + n2 + n3, first = (blockIdx.x * SPLIT_TILES + threadIdx.x / 32) * 16;
    Fp8Rows tile;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = first + threadIdx.x % 32 / 4 + 8 * h;
        int seg, n;
        gemv1_segment(r < total ? r : 0, n0, n1, n2, seg, n);
        tile.set(h, gemv1_pick(seg, w0, w1, w2, w3), gemv1_pick(seg, s0, s1, s2, s3), n, K);
    }
    if (!split_dot(tile, x, norm_w, eps, K, tokens, part, tickets, norms)) return;
    const int group_rows = SPLIT_TILES * 16;
    for (int i = threadIdx.x; i < tokens * group_rows; i += blockDim.x) {
        const int token = i / group_rows, r = blockIdx.x * group_rows + i % group_rows;
        if (r >= total) continue;
        int seg, n;
        gemv1_segment(r, n0, n1, n2, seg, n);
        const float* bias = gemv1_pick(seg, b0, b1, b2, b3);
        const long at = (long)token * gemv1_pick(seg, n0, n1, n2, n3) + n;
        const float out = split_sum(part, tokens, token, r) * split_scale(norms, norm_w != nullptr, token);
        gemv1_pick(seg, y0, y1, y2, y3)[at] = out + (bias ? bias[n] : 0.0f) + (seg == 0 && residual ? residual[at] : 0.0f);
    }
}

// As gemv1_gate_up_fp8_tokens, split by unit (the arguments as gemv1_fp8_split's); a warp's tile is
// 8 gate rows (as rows g) and their up rows (as rows g + 8), so a row group holds both halves of
// its 8 SPLIT_TILES outputs (grid ceil(N / 64)).
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(SPLIT_TILES * 32, 3)
    gemv1_gate_up_fp8_split(const unsigned char* g, const unsigned char* u, const float* sg, const float* su,
                            const float* gate_bias, const float* up_bias, const float* x, const float* norm_w, float eps,
                            float* out, int N, int K, int tokens, float* part, int* tickets, float* norms) {
    const int mine = (blockIdx.x * SPLIT_TILES + threadIdx.x / 32) * 8 + threadIdx.x % 32 / 4;
    Fp8Rows tile;
    tile.set(0, g, sg, mine < N ? mine : 0, K);
    tile.set(1, u, su, mine < N ? mine : 0, K);
    if (!split_dot(tile, x, norm_w, eps, K, tokens, part, tickets, norms)) return;
    const int outputs = SPLIT_TILES * 8;
    for (int i = threadIdx.x; i < tokens * outputs; i += blockDim.x) {
        const int token = i / outputs, o = i % outputs, n = blockIdx.x * outputs + o;
        if (n >= N) continue;
        const int row = (blockIdx.x * SPLIT_TILES + o / 8) * 16 + o % 8;  // its gate row; up 8 further
        const float s = split_scale(norms, norm_w != nullptr, token);
        const float gv = split_sum(part, tokens, token, row) * s + (gate_bias ? gate_bias[n] : 0.0f);
        const float uv = split_sum(part, tokens, token, row + 8) * s + (up_bias ? up_bias[n] : 0.0f);
        out[(long)token * N + n] = gv / (1.0f + expf(-gv)) * uv;
    }
}
#endif

// Block formats in the device layout (common/packed.h) on matrix cores, shaped as the FP8 kernels:
// a block takes 16 output rows as TILES tiles; its PK_UNITS units of 32 lanes share the 256-column
// steps of K (unit u takes steps u, u + PK_UNITS, ...); in a step, lane (g, t) takes runs t and
// t + 4 (32 values each) of rows g and g + 8, the next step's in flight meanwhile. Each word of
// codes gives, per row, two f16 pairs of lower values and two of upper ones, scaled in f16
// (s · level − o: one rounding of the exact product), and two m16n8k16 mma take them with their
// inputs; elsewhere each lane sums its own values in f32 (decoded as the CPU does). The input is
// staged as f16 like FP8's, padded to whole steps: dynamic shared memory ceil(K / 256) * 512 bytes.
// The callers multiply by NVFP4's tensor factor. Formats without high bits stream through shared
// memory where they can (PkAsync below), with the same sums: dynamic shared memory grows by its
// slots. Launch: grid ceil(output rows / 16), block PK_UNITS * 32. Needs K % 256 == 0 for the
// k-quants, K % 32 == 0 for the others.
#define PK_UNITS 8
#define PK_STEP 256
// Steps of loads in flight per lane.
#define PK_STAGES 2
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PK_MMA 1
#endif

// The high-bit fields of a run's four words as loaded (HB = 4: one word each; 2: two to a word;
// 1: four to a word); pk_field_of picks word w's.
template <int F>
__device__ __forceinline__ uint4 pk_fields(const unsigned char* high, long run) {
    constexpr int HB = PkTraits<F>::HB;
    if (HB == 4) return *(const uint4*)(high + run * 16);
    if (HB == 2) {
        const uint2 v = *(const uint2*)(high + run * 8);
        return make_uint4(v.x, v.y, 0u, 0u);
    }
    if (HB == 1) return make_uint4(*(const unsigned int*)(high + run * 4), 0u, 0u, 0u);
    return make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ unsigned int pk_word(const uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }

template <int F>
__device__ __forceinline__ unsigned int pk_field_of(const uint4& raw, int w) {
    constexpr int HB = PkTraits<F>::HB;
    if (HB == 4) return pk_word(raw, w);
    if (HB == 2) return ((w < 2 ? raw.x : raw.y) >> (16 * (w & 1))) & 0xffffu;
    if (HB == 1) return (raw.x >> (8 * w)) & 0xffu;
    return 0u;
}

// A lane's two rows of one tile (g and g + 8, which may lie in different matrices): each row's
// planes and first run.
template <int F>
struct PkRows {
    PkPlanes p[2];
    long run0[2];
    __device__ __forceinline__ void set(int h, const unsigned char* w, long rows, int K, int n) {
        p[h] = pk_planes<F>(w, rows, K);
        run0[h] = (long)n * (K / 32);
    }
};

// Runs t and t + 4 of one step for each tile's two rows: codes, high-bit fields, meta words.
template <int F, int TILES>
struct PkStage {
    uint4 codes[TILES][2][2];  // [tile][row g, g + 8][run t, t + 4]
    uint4 fields[TILES][2][2];
    uint4 meta[TILES][2][2];
    __device__ __forceinline__ void fetch(const PkRows<F> (&tiles)[TILES], int step, int steps, int runs, int t) {
#pragma unroll
        for (int i = 0; i < TILES; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int r = step * 8 + j * 4 + t;
                    const bool in = step < steps && r < runs;
                    const long run = tiles[i].run0[h] + (in ? r : 0);
                    codes[i][h][j] = in ? *(const uint4*)(tiles[i].p[h].codes + run * 16) : make_uint4(0u, 0u, 0u, 0u);
                    fields[i][h][j] = in ? pk_fields<F>(tiles[i].p[h].high, run) : make_uint4(0u, 0u, 0u, 0u);
                    // A k-quant step is one meta group: both runs share its words (Q6_K's pk_meta
                    // takes the run's own scale pair).
                    if (j == 0 || PkTraits<F>::MRUNS == 1 || F == PK_Q6_K)
                        meta[i][h][j] = in ? pk_meta<F>(tiles[i].p[h].meta, run) : make_uint4(0u, 0u, 0u, 0u);
                    else
                        meta[i][h][j] = meta[i][h][0];
                }
    }
};

// As Fp8Async, for the packed formats: a slot holds 64 runs (8 steps, one per unit) of each of the
// tile's 16 rows -- codes and meta groups, each copied as it lies -- for the formats without high
// bits (PK_SLOTS), where a row's meta bytes start 4-byte aligned (the host's packed_slot_bytes:
// every shape a model has; it sends the others to the several-token kernel). The others take the
// register pipeline: with their high bits, slots half as large again or more left room for too
// few blocks an SM (on an H200 Q8_0 decoded 267 -> 212 t/s with them, Q6_K 244 -> 210; Q4_K
// gained 325 -> 343). Rows of codes are spaced a sixteenth more than their bytes (lanes reading
// rows g and g + 1 hit other banks). Unit u consumes step u of each slot, as the register pipeline
// has it, so both give the same bits.
#define PK_ASYNC_SLOTS 3
#define PK_SLOTS(F) (ASYNC_COPY && PkTraits<F>::HB == 0)
// Blocks an SM the one-token kernels are built for: with slots three (80 registers; the slots and
// an input of up to 8,192 values fit the shared memory three times), else two.
#define PK_BLOCKS(F) (PK_SLOTS(F) ? 3 : 2)
template <int F>
struct PkAsync {
    typedef PkTraits<F> T;
    static constexpr int CODES_ROW = 1088;
    static constexpr int META_BYTES = 64 / T::MRUNS * T::MBYTES;  // a multiple of 4 for every format
    static constexpr int ROW = CODES_ROW + (META_BYTES + 15) / 16 * 16 + 16;
    static constexpr int SLOT_BYTES = 16 * ROW;
    unsigned char* slots;                          // dynamic shared memory, after the staged input
    const PkPlanes (*planes)[16];                  // each tile row's planes (shared table, an entry a tile)
    const long (*first_run)[16];                   // and its first run
    int runs;                                      // per row
    int loads;                                     // slot-loads per tile
    // Issues the copies of slot-load `st` of the block's sequence (runs 64 l .. 64 l + 63 of every
    // row of tile st / loads, l = st % loads, its rows in table entry `entry`) and closes its group.
    __device__ __forceinline__ void issue(int st, int entry) const {
        unsigned char* slot = slots + (st % PK_ASYNC_SLOTS) * SLOT_BYTES;
        const PkPlanes* plane = planes[entry];
        const long* first = first_run[entry];
        const int r0 = st % loads * 64, valid_runs = runs - r0 < 64 ? runs - r0 : 64;
        for (int p = threadIdx.x; p < 16 * 64; p += blockDim.x) {
            const int row = p / 64, r = p % 64;
            const bool in = r < valid_runs;
            async_copy16(slot + row * ROW + r * 16, plane[row].codes + (first[row] + r0 + (in ? r : 0)) * 16, in);
        }
        const int valid_meta = valid_runs / T::MRUNS * T::MBYTES;  // whole words (packed_slot_bytes)
        for (int p = threadIdx.x; p < 16 * (META_BYTES / 4); p += blockDim.x) {
            const int row = p / (META_BYTES / 4), w = p % (META_BYTES / 4);
            const bool in = w * 4 < valid_meta;
            const long at = (first[row] + r0) / T::MRUNS * T::MBYTES + (in ? w * 4 : 0);
            async_copy4(slot + row * ROW + CODES_ROW + w * 4, plane[row].meta + at, in);
        }
        async_commit();
    }
    // Lane (g, t) of unit `unit`: its part of slot-load `st`, as PkStage::fetch gives it (no
    // high-bit fields: formats that have them do not come here).
    __device__ __forceinline__ void read(int st, int unit, int g, int t, PkStage<F, 1>& out) const {
        const unsigned char* slot = slots + (st % PK_ASYNC_SLOTS) * SLOT_BYTES;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const unsigned char* row = slot + (g + 8 * h) * ROW;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int r = unit * 8 + j * 4 + t;  // run within the slot
                const bool in = st % loads * 64 + r < runs;
                out.codes[0][h][j] = in ? *(const uint4*)(row + r * 16) : make_uint4(0u, 0u, 0u, 0u);
                out.fields[0][h][j] = make_uint4(0u, 0u, 0u, 0u);
                if (j == 0 || T::MRUNS == 1)
                    out.meta[0][h][j] = in ? pk_meta<F>(row + CODES_ROW, r) : make_uint4(0u, 0u, 0u, 0u);
                else
                    out.meta[0][h][j] = out.meta[0][h][0];
            }
        }
    }
};

#ifdef PK_MMA
// Biased levels (four bytes) to two f16 pairs of s · level − o.
__device__ __forceinline__ void pk_scaled_pairs(unsigned int levels, unsigned int s2, unsigned int no2, unsigned int* out) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const unsigned int h = __byte_perm(levels, 0x64646464u, p ? 0x4342 : 0x4140);  // 1024 + biased level
        unsigned int l;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(l) : "r"(h), "r"(0x64806480u));            // exact level
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out[p]) : "r"(l), "r"(s2), "r"(no2));
    }
}

// The same for sign-magnitude levels (PkTraits::SIGN_MAG), straight from the codes: the four values
// whose codes are bits 4-7 of u's bytes, as two f16 pairs of s · level (+0: the bits
// pk_scaled_pairs gives them, -0 codes included). Each pair is one byte permutation of the
// magnitudes' f16 high bytes (index 0, whose byte is zero, fills the low bytes) and one of u's
// bytes in sign-replicating mode for the sign bits.
template <int F>
__device__ __forceinline__ void pk_sign_mag_pairs(unsigned int u, unsigned int s2, unsigned int* out) {
    const unsigned int lo = 0x42403c00u;  // f16 high bytes of 0 1 2 3
    const unsigned int hi = F == PK_ROCMFP4 || F == PK_ROCMFP4_FAST ? 0x49484644u : 0x4a484644u;  // 4 6 8 10|12
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const unsigned int sel = (p ? u >> 16 : u) & 0x7070u;
        unsigned int mag, sign, v;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mag) : "r"(lo), "r"(hi), "r"(sel));
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(sign) : "r"(u), "r"(0u), "r"(p ? 0xbbaau : 0x9988u));
        asm("lop3.b32 %0, %1, %2, %3, 0xf8;" : "=r"(v) : "r"(mag), "r"(sign), "r"(0x80008000u));  // a | (b & c)
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out[p]) : "r"(v), "r"(s2), "r"(0u));
    }
}

// Run j's scales as f16 pairs (pk_scales's values, each in both halves) and its offsets negated.
// NVFP4's and ROCmFP4's scale bytes (pk_ue4m3_half, pk_rocmfp4_scale: exponent bias 8) are placed
// straight into f16 bits 7-13, which gives (1 + man/8) 2^(exp-15) (man 2^-17 for exp 0), and
// scaled by 2^7: exact, so the same bits as packing pk_scales's f32.
template <int F>
__device__ __forceinline__ void pk_pair_scales(const uint4& meta, int j, unsigned int& s_lo, unsigned int& no_lo,
                                               unsigned int& s_hi, unsigned int& no_hi) {
    if constexpr (F == PK_NVFP4 || F == PK_ROCMFP4 || F == PK_ROCMFP4_FAST) {
        const unsigned int b[2] = {meta.x & 0xffu, F == PK_ROCMFP4_FAST ? meta.x & 0xffu : (meta.x >> 8) & 0xffu};
        unsigned int out[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const bool zero = F == PK_NVFP4 ? b[h] == 0x7fu : b[h] >= 0x7fu;
            asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out[h]) : "r"(zero ? 0u : (b[h] & 0x7fu) * 0x00800080u), "r"(0x58005800u));
        }
        s_lo = out[0];
        s_hi = out[1];
        no_lo = no_hi = 0x80008000u;
    } else {
        const PkScales sc = pk_scales<F>(meta, j);
        s_lo = f16x2_pack(sc.s_lo, sc.s_lo);
        no_lo = f16x2_pack(-sc.o_lo, -sc.o_lo);
        s_hi = f16x2_pack(sc.s_hi, sc.s_hi);
        no_hi = f16x2_pack(-sc.o_hi, -sc.o_hi);
    }
}

// A code word's values as scaled f16 pairs: a, values 4w .. 4w + 3; b, 16 + 4w ...
template <int F>
__device__ __forceinline__ void pk_word_pairs(unsigned int c, unsigned int f, const uint4& table, unsigned int s_lo,
                                              unsigned int no_lo, unsigned int s_hi, unsigned int no_hi, unsigned int* a,
                                              unsigned int* b) {
    if constexpr (PkTraits<F>::SIGN_MAG) {
        pk_sign_mag_pairs<F>(c << 4, s_lo, a);
        pk_sign_mag_pairs<F>(c, s_hi, b);
    } else {
        pk_scaled_pairs(pk_levels<F>(c, f, false, table), s_lo, no_lo, a);
        pk_scaled_pairs(pk_levels<F>(c, f, true, table), s_hi, no_hi, b);
    }
}
#endif

// Tiles first, first + every, ... below `count` of 16 rows each, times `tokens` (1..TOKENS) rows
// of x [tokens, K]: rows_of(tile, rows) sets lane (g, t)'s rows g and g + 8 of a tile, and after
// each tile every thread calls finish(tile, value) with row threadIdx.x % 16 times token
// threadIdx.x / 16's input (0 from threads past 16 * tokens). The input is staged once for all of
// a block's tiles. On matrix cores a token is a column of the mma (lane g's column holds token g),
// so each token gets the bits it gets alone; elsewhere each lane sums its own values, token by
// token. SLOTS: the weights stream through PkAsync's slots (PK_SLOTS: one token, a format without
// high bits, where async copies exist; the host sends rows that cannot have them to the
// several-token kernel), one tile's loads after the other's, so that a block the host launches for
// several tiles keeps its copies in flight from one tile to the next; else the register pipeline,
// tile by tile. A kernel holds one of the two, so that the other's registers do not lower its
// blocks an SM. A row's sum does not depend on the tiles its block takes. Several tokens without
// a norm read their inputs in place (the values staging would give), as fp8_rows_dot does.
template <int F, int TOKENS, bool SLOTS, class RowsOf, class Finish>
__device__ __forceinline__ void pk_rows_dot(int first, int every, int count, RowsOf rows_of, const float* x, const float* norm_w,
                                            float eps, int K, int tokens, Finish finish) {
    constexpr int TILES = 1;  // PkStage's tiles at a time
    __shared__ float sums[PK_UNITS][16][TOKENS];
    // The rows of the tiles whose slot-loads are in flight: an entry a tile, three for K <= 2,048.
    __shared__ PkPlanes plane_table[PK_ASYNC_SLOTS][16];
    __shared__ long run_table[PK_ASYNC_SLOTS][16];
    extern __shared__ __attribute__((aligned(16))) unsigned char pk_dynamic[];
    const int unit = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int runs = K / 32, steps = (runs + 7) / 8;
    const int mine = first < count ? (count - 1 - first) / every + 1 : 0;  // this block's tiles
    if (mine == 0) return;
    const uint4 table = pk_table<F>();
    static_assert(!SLOTS || (TOKENS == 1 && PkTraits<F>::HB == 0 && ASYNC_COPY), "slots: one token, no high bits");
    PkRows<F> tiles[TILES];
    PkStage<F, TILES> st[SLOTS ? 1 : PK_STAGES];
    auto fetch = [&](PkStage<F, TILES>& stage, int step) { stage.fetch(tiles, step, steps, runs, t); };
    const int loads = (runs + 63) / 64, all_loads = mine * loads;
    const PkAsync<F> async = {pk_dynamic + fp8_padded(K, PK_STEP) * 2, plane_table, run_table, runs, loads};
    // Unit 0 puts the rows of the tile that slot-load `l` starts into its table entry.
    auto note = [&](int l) {
        if (!SLOTS || unit != 0 || t != 0 || l >= all_loads || l % loads != 0) return;
        PkRows<F> rows;
        rows_of(first + l / loads * every, rows);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            plane_table[l / loads % PK_ASYNC_SLOTS][g + 8 * h] = rows.p[h];
            run_table[l / loads % PK_ASYNC_SLOTS][g + 8 * h] = rows.run0[h];
        }
    };
    auto issue = [&](int l) {
        if (l < all_loads) async.issue(l, l / loads % PK_ASYNC_SLOTS);
        else async_commit();  // an empty group keeps the count async_wait relies on
    };
    pdl_launch_dependents();
    if constexpr (SLOTS) {
        // Loads 0 .. PK_ASYNC_SLOTS - 1 may start as many tiles; the loop issues the last of them.
#pragma unroll
        for (int l = 0; l < PK_ASYNC_SLOTS; l++) note(l);
        __syncthreads();
#pragma unroll
        for (int l = 0; l < PK_ASYNC_SLOTS - 1; l++) issue(l);
    } else {
        rows_of(first, tiles[0]);
        pipeline_fill(st, unit, PK_UNITS, fetch);
    }
    pdl_wait();  // weights are constant; x, the outputs and the residual belong to the previous kernel
    const bool in_place = TOKENS > 1 && !norm_w;
    float scale[TOKENS];
    const uint2* xs = nullptr;
    if (in_place) {
#pragma unroll
        for (int n = 0; n < TOKENS; n++) scale[n] = 1 << FP8_X_SHIFT;
    } else {
        xs = (const uint2*)fp8_gemv_input<TOKENS>(x, norm_w, eps, K, PK_STEP, tokens, scale);
    }
    const int stride = fp8_padded(K, PK_STEP) / 4;  // uint2 per token
    // Inputs 4w.. and 16 + 4w.. of run r of token n, staged or in place (zeros past K).
    auto input = [&](int n, int r, int w, uint2& lo, uint2& hi) {
        if (!in_place) {
            lo = xs[n * stride + r * 8 + w];
            hi = xs[n * stride + r * 8 + 4 + w];
        } else if (r < runs) {
            const float* at = x + (long)n * K + r * 32 + 4 * w;
            const float4 a = *(const float4*)at, b = *(const float4*)(at + 16);
            lo = make_uint2(fp8_x_pair(a.x, a.y), fp8_x_pair(a.z, a.w));
            hi = make_uint2(fp8_x_pair(b.x, b.y), fp8_x_pair(b.z, b.w));
        } else {
            lo = hi = make_uint2(0u, 0u);
        }
    };

#ifdef PK_MMA
    // The lower and the upper values' products in two accumulators: two chains of dependent mma.
    // Fragments: [row g, column 2t], [g, 2t + 1], [g + 8, 2t], [g + 8, 2t + 1]; column n is token n.
    float acc[TILES][4] = {}, acc_hi[TILES][4] = {};
    const int token = g < tokens ? g : 0;
#else
    float acc[TILES][TOKENS][2] = {};  // [tile][token][row g, g + 8]: this lane's sums
#endif
    auto consume = [&](const PkStage<F, TILES>& st, int step) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = step * 8 + j * 4 + t;  // run within the row
#pragma unroll
            for (int i = 0; i < TILES; i++) {
#ifdef PK_MMA
                unsigned int s_lo[2], o_lo[2], s_hi[2], o_hi[2];
#pragma unroll
                for (int h = 0; h < 2; h++)  // rows start meta groups
                    pk_pair_scales<F>(st.meta[i][h][j], r % PkTraits<F>::MRUNS, s_lo[h], o_lo[h], s_hi[h], o_hi[h]);
#else
                PkScales sc[2];
#pragma unroll
                for (int h = 0; h < 2; h++) sc[h] = pk_scales<F>(st.meta[i][h][j], r % PkTraits<F>::MRUNS);  // rows start groups
#endif
#pragma unroll
                for (int w = 0; w < 4; w++) {
#ifdef PK_MMA
                    uint2 xl, xh;  // inputs 4w.. and 16 + 4w.. of this lane's token
                    input(token, r, w, xl, xh);
                    unsigned int a[2][2], b[2][2];  // [row g, g + 8][pair]
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        pk_word_pairs<F>(pk_word(st.codes[i][h][j], w), pk_field_of<F>(st.fields[i][h][j], w), table, s_lo[h],
                                         o_lo[h], s_hi[h], o_hi[h], a[h], b[h]);
                    f16_rows_mma(acc[i], a[0][0], a[1][0], a[0][1], a[1][1], xl.x, xl.y);
                    f16_rows_mma(acc_hi[i], b[0][0], b[1][0], b[0][1], b[1][1], xh.x, xh.y);
#else
                    unsigned int lo[2], hi[2];
                    float vl[2][4], vh[2][4];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const unsigned int c = pk_word(st.codes[i][h][j], w), f = pk_field_of<F>(st.fields[i][h][j], w);
                        lo[h] = pk_levels<F>(c, f, false, table);
                        hi[h] = pk_levels<F>(c, f, true, table);
                    }
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int k = 0; k < 4; k++) {
                            vl[h][k] = sc[h].s_lo * (float)((int)((lo[h] >> (8 * k)) & 0xffu) - 128) - sc[h].o_lo;
                            vh[h][k] = sc[h].s_hi * (float)((int)((hi[h] >> (8 * k)) & 0xffu) - 128) - sc[h].o_hi;
                        }
#pragma unroll
                    for (int n = 0; n < TOKENS; n++) {
                        if (n >= tokens) break;
                        uint2 xl, xh;
                        input(n, r, w, xl, xh);
                        const float xlv[4] = {f16_to_f32(xl.x & 0xffffu), f16_to_f32(xl.x >> 16), f16_to_f32(xl.y & 0xffffu), f16_to_f32(xl.y >> 16)};
                        const float xhv[4] = {f16_to_f32(xh.x & 0xffffu), f16_to_f32(xh.x >> 16), f16_to_f32(xh.y & 0xffffu), f16_to_f32(xh.y >> 16)};
#pragma unroll
                        for (int h = 0; h < 2; h++)
#pragma unroll
                            for (int k = 0; k < 4; k++) acc[i][n][h] += vl[h][k] * xlv[k] + vh[h][k] * xhv[k];
                    }
#endif
                }
            }
        }
    };
    // Each unit's sums of the tile into `sums`, then each output's total, and the sums start anew.
    auto tile_done = [&](int tile) {
#ifdef PK_MMA
#pragma unroll
        for (int col = 0; col < (TOKENS > 1 ? 2 : 1); col++) {
            const int n = 2 * t + col;
            if (n < tokens && n < TOKENS) {
                sums[unit][g][n] = acc[0][col] + acc_hi[0][col];
                sums[unit][g + 8][n] = acc[0][2 + col] + acc_hi[0][2 + col];
            }
        }
#pragma unroll
        for (int k = 0; k < 4; k++) acc[0][k] = acc_hi[0][k] = 0.0f;
#else
#pragma unroll
        for (int n = 0; n < TOKENS; n++) {
            const float row_g = fp8_quad_total(acc[0][n][0]), row_g8 = fp8_quad_total(acc[0][n][1]);
            if (t == 0 && n < tokens) {
                sums[unit][g][n] = row_g;
                sums[unit][g + 8][n] = row_g8;
            }
            acc[0][n][0] = acc[0][n][1] = 0.0f;
        }
#endif
        __syncthreads();
        const int r = threadIdx.x % 16, n = threadIdx.x / 16;
        float total = 0.0f;
        if (n < tokens && n < TOKENS) {
            for (int u = 0; u < PK_UNITS; u++) total += sums[u][r][n];
            total *= fp8_token_scale<TOKENS>(scale, n);
        }
        finish(tile, total);
    };
    if constexpr (SLOTS) {
        for (int l = 0; l < all_loads; l++) {
            async_wait<PK_ASYNC_SLOTS - 2>();  // this thread's copies of load l have landed
            __syncthreads();                   // everyone's; the slot load l - 1 used and the sums are free
            issue(l + PK_ASYNC_SLOTS - 1);
            note(l + PK_ASYNC_SLOTS);          // seen by the next iteration's issue, after its barrier
            const int step = l % loads * 8 + unit;
            if (step < steps) {
                async.read(l, unit, g, t, st[0]);
                consume(st[0], step);
            }
            if (l % loads == loads - 1) tile_done(first + l / loads * every);
        }
    } else {
        for (int i = 0; i < mine; i++) {
            if (i > 0) {
                __syncthreads();  // the previous tile's sums are read
                rows_of(first + i * every, tiles[0]);
                pipeline_fill(st, unit, PK_UNITS, fetch);
            }
            pipeline_drain(st, unit, PK_UNITS, steps, fetch, consume);
            tile_done(first + i * every);
        }
    }
}

// As gemv1_fp8 (up to four projections of one input, the residual added to the first) over
// packed weights, for `tokens` rows of x (y0..y3 and the residual [tokens, n_i]); the scale
// pointers are unused. Block b takes the 16-row tiles b, b + gridDim.x, ... (pk_rows_dot).
template <int F, int TOKENS, bool SLOTS>
__device__ __forceinline__ void gemv1_packed(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,
                                             const unsigned char* w3, const float* b0, const float* b1, const float* b2,
                                             const float* b3, float* y0, float* y1, float* y2, float* y3, int n0, int n1,
                                             int n2, int n3, const float* x, const float* norm_w, float eps,
                                             const float* residual, int K, int tokens) {
    const int total = n0 + n1 + n2 + n3;
    auto locate = [&](int tile, int r, int& seg, int& n) {
        gemv1_segment(tile * 16 + r < total ? tile * 16 + r : 0, n0, n1, n2, seg, n);
    };
    auto rows_of = [&](int tile, PkRows<F>& rows) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int seg, n;
            locate(tile, threadIdx.x % 32 / 4 + 8 * h, seg, n);
            rows.set(h, gemv1_pick(seg, w0, w1, w2, w3), gemv1_pick(seg, n0, n1, n2, n3), K, n);
        }
    };
    auto finish = [&](int tile, float out) {
        const int r = threadIdx.x % 16, token = threadIdx.x / 16;
        if (token >= tokens || tile * 16 + r >= total) return;
        int sg, row;
        locate(tile, r, sg, row);
        const float* bias = gemv1_pick(sg, b0, b1, b2, b3);
        float* y = gemv1_pick(sg, y0, y1, y2, y3);
        const int rows = gemv1_pick(sg, n0, n1, n2, n3);
        const long at = (long)token * rows + row;
        const float factor = pk_factor<F>(pk_planes<F>(gemv1_pick(sg, w0, w1, w2, w3), rows, K), rows, K);
        y[at] = out * factor + (bias ? bias[row] : 0.0f) + (sg == 0 && residual ? residual[at] : 0.0f);
    };
    pk_rows_dot<F, TOKENS, SLOTS>(blockIdx.x, gridDim.x, (total + 15) / 16, rows_of, x, norm_w, eps, K, tokens, finish);
}

// As gemv1_gate_up_fp8 over packed weights, but a tile is 8 gate rows (as rows g) and the same 8
// up rows (as rows g + 8): one tile's registers, twice the tiles. Block b takes the tiles b,
// b + gridDim.x, ... of the ceil(N / 8) (pk_rows_dot). Launch: grid ceil(N / 8) or fewer.
template <int F, int TOKENS, bool SLOTS>
__device__ __forceinline__ void gemv1_gate_up_packed(const unsigned char* g, const unsigned char* u, const float* gate_bias,
                                                     const float* up_bias, const float* x, const float* norm_w, float eps,
                                                     float* out, int N, int K, int tokens) {
    auto rows_of = [&](int tile, PkRows<F>& rows) {
        const int n = tile * 8 + threadIdx.x % 32 / 4;
        rows.set(0, g, N, K, n < N ? n : 0);
        rows.set(1, u, N, K, n < N ? n : 0);
    };
    // Thread r + 16 n holds token n's sum of tile row r: the gate rows 8 tile + 0..7 at r < 8,
    // their up rows at r >= 8 (every thread takes part in the shuffle).
    auto finish = [&](int tile, float sum) {
        const float up_sum = shfl(sum, (threadIdx.x + 8) % 32);
        const int r = threadIdx.x % 16, token = threadIdx.x / 16, n = tile * 8 + r;
        if (r >= 8 || token >= tokens || n >= N) return;
        const PkPlanes pg = pk_planes<F>(g, N, K), pu = pk_planes<F>(u, N, K);
        const float gv = sum * pk_factor<F>(pg, N, K) + (gate_bias ? gate_bias[n] : 0.0f);
        const float uv = up_sum * pk_factor<F>(pu, N, K) + (up_bias ? up_bias[n] : 0.0f);
        out[(long)token * N + n] = gv / (1.0f + expf(-gv)) * uv;
    };
    pk_rows_dot<F, TOKENS, SLOTS>(blockIdx.x, gridDim.x, (N + 7) / 8, rows_of, x, norm_w, eps, K, tokens, finish);
}

// The kernels of one format: gemv1_<name> and gemv1_gate_up_<name>, with gemv1_fp8's and
// gemv1_gate_up_fp8's signatures (scale pointers unused), and their _tokens forms (up to
// GEMV1_TOKENS rows of input, the count last), as gemv1_fp8_tokens.
#define PK_GEMV_KERNELS(name, F)                                                                                       \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, PK_BLOCKS(F)) gemv1_##name(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2,           \
                                   const unsigned char* w3, const float*, const float*, const float*, const float*,     \
                                   const float* b0, const float* b1, const float* b2, const float* b3, float* y0,      \
                                   float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3, const float* x,    \
                                   const float* norm_w, float eps, const float* residual, int K) {                     \
        gemv1_packed<F, 1, PK_SLOTS(F)>(w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x, norm_w, eps, residual, K, 1); \
    }                                                                                                                  \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, 2) gemv1_##name##_tokens(const unsigned char* w0, const unsigned char* w1, const unsigned char* w2, \
                                   const unsigned char* w3, const float*, const float*, const float*, const float*,     \
                                   const float* b0, const float* b1, const float* b2, const float* b3, float* y0,      \
                                   float* y1, float* y2, float* y3, int n0, int n1, int n2, int n3, const float* x,    \
                                   const float* norm_w, float eps, const float* residual, int K, int tokens) {         \
        gemv1_packed<F, GEMV1_TOKENS, false>(w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, n0, n1, n2, n3, x, norm_w, eps,  \
                                      residual, K, tokens);                                                            \
    }                                                                                                                  \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, PK_BLOCKS(F))                                                 \
        gemv1_gate_up_##name(const unsigned char* g, const unsigned char* u, const float*, const float*,               \
                             const float* gate_bias, const float* up_bias, const float* x, const float* norm_w,        \
                             float eps, float* out, int N, int K) {                                                    \
        gemv1_gate_up_packed<F, 1, PK_SLOTS(F)>(g, u, gate_bias, up_bias, x, norm_w, eps, out, N, K, 1);                            \
    }                                                                                                                  \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, 2)                                                            \
        gemv1_gate_up_##name##_tokens(const unsigned char* g, const unsigned char* u, const float*, const float*,      \
                                      const float* gate_bias, const float* up_bias, const float* x, const float* norm_w, \
                                      float eps, float* out, int N, int K, int tokens) {                               \
        gemv1_gate_up_packed<F, GEMV1_TOKENS, false>(g, u, gate_bias, up_bias, x, norm_w, eps, out, N, K, tokens);            \
    }
PK_GEMV_KERNELS(q8_0, PK_Q8_0)
PK_GEMV_KERNELS(q4_0, PK_Q4_0)
PK_GEMV_KERNELS(q4_1, PK_Q4_1)
PK_GEMV_KERNELS(q5_0, PK_Q5_0)
PK_GEMV_KERNELS(q5_1, PK_Q5_1)
PK_GEMV_KERNELS(q4_k, PK_Q4_K)
PK_GEMV_KERNELS(q5_k, PK_Q5_K)
PK_GEMV_KERNELS(q6_k, PK_Q6_K)
PK_GEMV_KERNELS(iq4_nl, PK_IQ4_NL)
PK_GEMV_KERNELS(iq4_xs, PK_IQ4_XS)
PK_GEMV_KERNELS(mxfp4, PK_MXFP4)
PK_GEMV_KERNELS(nvfp4, PK_NVFP4)
PK_GEMV_KERNELS(rocmfp4, PK_ROCMFP4)
PK_GEMV_KERNELS(rocmfp4_fast, PK_ROCMFP4_FAST)

// Decode, a few tokens (T <= GEMV_MAX_T): each W row read once for all T tokens; `residual` (may be
// y) is added. Launch: grid ceil(N / warps_per_block), block 256. Needs K % 8 == 0.
ATLAS_KERNEL void gemv_bf16(const bf16* W, const float* x, const float* bias, const float* residual, float* y, int N,
                            int K, int T) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (n >= N) return;
    const uint4* row = (const uint4*)(W + (long)n * K);
    float acc[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.0f;
    for (int c = lane; c < K / 8; c += WARP_SIZE) {
        const uint4 packed = row[c];
        const unsigned int words[4] = {packed.x, packed.y, packed.z, packed.w};
        float w[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            w[2 * j] = __uint_as_float(words[j] << 16);
            w[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
        }
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++) {
            if (t < T) {
                const float4* xv = (const float4*)(x + (long)t * K + c * 8);
                const float4 a = xv[0], b = xv[1];
                acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w
                        + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
            const float s = warp_sum(acc[t]);
            if (lane == 0)
                y[(long)t * N + n] = s + (bias ? bias[n] : 0.0f) + (residual ? residual[(long)t * N + n] : 0.0f);
        }
    }
}
