// Mixture of experts: routing on the device, then each token's chosen experts.
//
//   route   per token: softmax over the E router logits, the top_k largest (ties to the lower
//           index), renormalised when asked; ids and weights [T, top_k], by expert id.
//   decode  (one token) moe_gate_up_* and moe_down_* are the GEMVs of linear.hip over the
//           experts the routing chose: blockIdx.y is the slot s (0..top_k), its expert ids[s]
//           read on the device, so only the chosen experts' bytes are read; then moe_combine.
//           A shared expert of the same width (Qwen3.5-MoE) is one more slot, s = top_k, with
//           its own weights; gate/up normalise their input themselves (RMSNorm fused, as in
//           linear.hip). The whole block is then route, gate/up, down, combine: four launches
//           (routing inside every gate/up block, a warp each, measured slower on an H200: the
//           weights cannot stream before it ends).
//   prefill the assignments (token t, slot s) grouped by expert (moe_count, moe_index: stable, in
//           (t, s) order), the inputs gathered in that order (moe_gather), grouped GEMMs
//           (gemm.hip's main loop over each expert's rows and weights): gate and up in one
//           launch, silu_mul (elementwise.hip), down; then moe_combine.
//   combine out[t] += Σ_s weights[t, s] · y[row(t, s)], s = 0..top_k in order (the experts by
//           id, as the CPU reference adds them), plus sigmoid(shared gate) · the shared expert's
//           output when there is one, into the residual stream; one thread per output value: no
//           atomics, the same sum every run.
//
// Expert weights are stacked per projection: gate and up [E, I, H], down [E, H, I], bf16, E4M3
// codes with f32 scales [E, ceil(rows/128), ceil(cols/128)] (common/fp8.h), or a block format in
// common/packed.h's device layout, expert e's planes (NVFP4's factor included) `stride` bytes
// after expert e - 1's.
#include "common/portable.h"
#include "common/mma.h"
#include "common/fp8.h"
#include "linear.hip"
#include "gemm.hip"

#define MOE_MAX_K 32

// (v, i) comes before (bv, bi) in the routing order: larger logit first, the lower index on ties.
__device__ __forceinline__ bool moe_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// Launch: grid T, block WARP_SIZE (one warp per token). 1 <= top_k <= min(E, MOE_MAX_K).
// Round r takes the first logit, in the routing order, that comes after round r-1's pick: the
// top_k in order, with no record of what was taken. Softmax is monotonic, so the logits order the
// probabilities (ties included: equal logits have equal probabilities).
ATLAS_KERNEL void moe_route(const float* logits, int E, int top_k, int normalize, int* ids, float* weights) {
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (long)t * E;
    float mx = NEG_INF;
    for (int j = lane; j < E; j += WARP_SIZE) mx = fmaxf(mx, l[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < E; j += WARP_SIZE) sum += expf(l[j] - mx);
    sum = warp_sum(sum);

    int id[MOE_MAX_K];
    float p[MOE_MAX_K];
    float prev_v = __int_as_float(0x7f800000);  // +inf, index -1: everything comes after it
    int prev_i = -1;
    float total = 0.0f;
    for (int r = 0; r < top_k; r++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;  // nothing yet: any logit (even -inf) comes before it
        for (int j = lane; j < E; j += WARP_SIZE) {
            const float v = l[j];
            if (moe_before(prev_v, prev_i, v, j) && moe_before(v, j, bv, bi)) {
                bv = v;
                bi = j;
            }
        }
        // The warp's first in order, the same on every lane.
        for (int m = WARP_SIZE / 2; m > 0; m >>= 1) {
            const float ov = shfl_xor(bv, m);
            const int oi = __float_as_int(shfl_xor(__int_as_float(bi), m));
            if (moe_before(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi >= E) bi = 0;  // only NaN logits left: keep the ids in range
        prev_v = bv;
        prev_i = bi;
        id[r] = bi;
        p[r] = expf(bv - mx) / sum;
        total += p[r];
    }
    if (lane != 0) return;
    // By expert id (insertion sort of a few), renormalised as the CPU does.
    for (int r = 1; r < top_k; r++) {
        const int ki = id[r];
        const float kp = p[r];
        int j = r - 1;
        for (; j >= 0 && id[j] > ki; j--) {
            id[j + 1] = id[j];
            p[j + 1] = p[j];
        }
        id[j + 1] = ki;
        p[j + 1] = kp;
    }
    for (int r = 0; r < top_k; r++) {
        ids[(long)t * top_k + r] = id[r];
        weights[(long)t * top_k + r] = normalize ? p[r] / total : p[r];
    }
}

// ---- Decode: one token, its top_k experts -------------------------------------------------------

// act[s, n] = silu(x · G_e[n]) * (x · U_e[n]) for slot s = blockIdx.y, e = ids[s], n < I; x [H],
// RMS-normalised with norm_w first when norm_w is given. Slot top_k (a grid of top_k + 1 rows)
// is the shared expert: shared_g, shared_u. As gemv1_gate_up_bf16. Launch: grid (ceil(I /
// (GEMV_ROWS * warps)), top_k (+ 1)), block GEMV_THREADS, dynamic shared memory H floats when
// norm_w is given. H % 8 == 0. The experts are the previous kernel's output: nothing is read
// before pdl_wait.
ATLAS_KERNEL void moe_gate_up_bf16(const bf16* gate, const bf16* up, const float* sg, const float* su, const int* ids,
                                   const float* x, const float* norm_w, float eps, const bf16* shared_g,
                                   const bf16* shared_u, const float* shared_sg, const float* shared_su, float* act,
                                   int I, int H, int top_k) {
    pdl_wait();
    const int s = blockIdx.y;
    const bool shared = s == top_k;
    const long e = shared ? 0 : ids[s];
    const bf16* g = shared ? shared_g : gate + e * I * H;
    const bf16* u = shared ? shared_u : up + e * I * H;
    const int first = (blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE) * GEMV_ROWS;
    Bf16Row rows[2 * GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const int n = first + r < I ? first + r : 0;
        rows[2 * r] = bf16_row(g, n, H);
        rows[2 * r + 1] = bf16_row(u, n, H);
    }
    float acc[2 * GEMV_ROWS][1] = {};
    gemv_rows_dot<2 * GEMV_ROWS, 1>(rows, first < I, x, norm_w, eps, H, 1, acc);
    if (threadIdx.x % WARP_SIZE != 0) return;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const int n = first + r;
        if (n < I) {
            const float gv = acc[2 * r][0], uv = acc[2 * r + 1][0];
            act[(long)s * I + n] = gv / (1.0f + expf(-gv)) * uv;
        }
    }
}

// y[s, n] = act[s] · D_e[n] for slot s = blockIdx.y, e = ids[s], n < H (unweighted: moe_combine
// weighs); slot top_k, when launched, is the shared expert (shared_d). Launch: grid (ceil(H /
// (GEMV_ROWS * warps)), top_k (+ 1)), block GEMV_THREADS. I % 8 == 0.
ATLAS_KERNEL void moe_down_bf16(const bf16* down, const float* sd, const int* ids, const float* act,
                                const bf16* shared_d, const float* shared_sd, float* y, int H, int I, int top_k) {
    pdl_wait();
    const int s = blockIdx.y;
    const bf16* d = s == top_k ? shared_d : down + (long)ids[s] * H * I;
    const int first = (blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE) * GEMV_ROWS;
    Bf16Row rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) rows[r] = bf16_row(d, first + r < H ? first + r : 0, I);
    float acc[GEMV_ROWS][1] = {};
    gemv_rows_dot<GEMV_ROWS, 1>(rows, first < H, act + (long)s * I, nullptr, 0.0f, I, 1, acc);
    if (threadIdx.x % WARP_SIZE != 0) return;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
        if (first + r < H) y[(long)s * H + first + r] = acc[r][0];
}

// The same over FP8 weights, as gemv1_gate_up_fp8 / gemv1_fp8: 16 rows (gate/up) or 32 rows (down,
// two tiles: its K = I is small, often fewer 128-column blocks than the block has units, so a
// block's staging of the input and its final sums serve twice the rows) per block. Launch: grid
// (ceil(rows / 16 or 32), top_k (+ 1)), block FP8_UNITS * 32, dynamic shared memory
// ceil(K / 128) * 256 bytes (K = H for gate/up, I for down). K % 16 == 0.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    moe_gate_up_fp8(const unsigned char* gate, const unsigned char* up, const float* sg, const float* su,
                    const int* ids, const float* x, const float* norm_w, float eps, const unsigned char* shared_g,
                    const unsigned char* shared_u, const float* shared_sg, const float* shared_su, float* act, int I,
                    int H, int top_k) {
    pdl_wait();
    const int s = blockIdx.y, lane = threadIdx.x % 32;
    const bool shared = s == top_k;
    const long e = shared ? 0 : ids[s];
    const long grid = (long)((I + FP8_BLOCK - 1) / FP8_BLOCK) * ((H + FP8_BLOCK - 1) / FP8_BLOCK);
    const unsigned char* g = shared ? shared_g : gate + e * I * H;
    const unsigned char* u = shared ? shared_u : up + e * I * H;
    const float* gs = shared ? shared_sg : sg + e * grid;
    const float* us = shared ? shared_su : su + e * grid;
    Fp8Rows tiles[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = blockIdx.x * 16 + lane / 4 + 8 * h;
        const int n = row < I ? row : 0;
        tiles[0].set(h, g, gs, n, H);
        tiles[1].set(h, u, us, n, H);
    }
    float gu[2];
    fp8_rows_dot<2, 1, 0>(tiles, x, norm_w, eps, H, 1, gu);
    const int n = blockIdx.x * 16 + threadIdx.x;
    if (threadIdx.x >= 16 || n >= I) return;
    act[(long)s * I + n] = gu[0] / (1.0f + expf(-gu[0])) * gu[1];
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(FP8_UNITS * 32, 2)
    moe_down_fp8(const unsigned char* down, const float* sd, const int* ids, const float* act,
                 const unsigned char* shared_d, const float* shared_sd, float* y, int H, int I, int top_k) {
    pdl_wait();
    const int s = blockIdx.y, lane = threadIdx.x % 32;
    const bool shared = s == top_k;
    const long e = shared ? 0 : ids[s];
    const long grid = (long)((H + FP8_BLOCK - 1) / FP8_BLOCK) * ((I + FP8_BLOCK - 1) / FP8_BLOCK);
    const unsigned char* d = shared ? shared_d : down + e * H * I;
    const float* ds = shared ? shared_sd : sd + e * grid;
    Fp8Rows tiles[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = blockIdx.x * 32 + 16 * i + lane / 4 + 8 * h;
            tiles[i].set(h, d, ds, row < H ? row : 0, I);
        }
    float out[2];
    fp8_rows_dot<2, 1, 0>(tiles, act + (long)s * I, nullptr, 0.0f, I, 1, out);
    if (threadIdx.x >= 16) return;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int n = blockIdx.x * 32 + 16 * i + threadIdx.x;
        if (n < H) y[(long)s * H + n] = out[i];
    }
}

// The same over packed experts: linear.hip's gemv1_gate_up_packed (8 gate rows and the same 8 up
// rows a block) and gemv1_packed (16 rows a block) on the chosen expert's planes, each expert with
// its own NVFP4 factor. The bf16 kernels' arguments (scale pointers unused), then `stride`.
// Launch: grid (ceil(I / 8) or ceil(H / 16), top_k (+ 1)), block PK_UNITS * 32, dynamic shared
// memory as gemv1_<format>'s for K = H (gate/up) or I (down), whose weight slots they need where
// that kernel has them (the host's packed_slots_unfit).
template <int F>
__device__ __forceinline__ void moe_gate_up_pk(const unsigned char* gate, const unsigned char* up, const int* ids,
                                               const float* x, const float* norm_w, float eps,
                                               const unsigned char* shared_g, const unsigned char* shared_u, float* act,
                                               int I, int H, int top_k, long long stride) {
    pdl_wait();
    const int s = blockIdx.y;
    const bool shared = s == top_k;
    const long long at = shared ? 0 : ids[s] * stride;
    gemv1_gate_up_packed<F, 1, PK_SLOTS(F)>(shared ? shared_g : gate + at, shared ? shared_u : up + at, nullptr, nullptr, x, norm_w, eps,
                               act + (long)s * I, I, H, 1);
}

template <int F>
__device__ __forceinline__ void moe_down_pk(const unsigned char* down, const int* ids, const float* act,
                                            const unsigned char* shared_d, float* y, int H, int I, int top_k,
                                            long long stride) {
    pdl_wait();
    const int s = blockIdx.y;
    const unsigned char* d = s == top_k ? shared_d : down + ids[s] * stride;
    gemv1_packed<F, 1, PK_SLOTS(F)>(d, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, y + (long)s * H, nullptr, nullptr,
                       nullptr, H, 0, 0, 0, act + (long)s * I, nullptr, 0.0f, nullptr, I, 1);
}

#define MOE_PK_KERNELS(name, F)                                                                                     \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, PK_BLOCKS(F))                                              \
        moe_gate_up_##name(const unsigned char* gate, const unsigned char* up, const float*, const float*,          \
                           const int* ids, const float* x, const float* norm_w, float eps,                          \
                           const unsigned char* shared_g, const unsigned char* shared_u, const float*, const float*, \
                           float* act, int I, int H, int top_k, long long stride) {                                 \
        moe_gate_up_pk<F>(gate, up, ids, x, norm_w, eps, shared_g, shared_u, act, I, H, top_k, stride);             \
    }                                                                                                               \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(PK_UNITS * 32, PK_BLOCKS(F))                                              \
        moe_down_##name(const unsigned char* down, const float*, const int* ids, const float* act,                  \
                        const unsigned char* shared_d, const float*, float* y, int H, int I, int top_k,             \
                        long long stride) {                                                                         \
        moe_down_pk<F>(down, ids, act, shared_d, y, H, I, top_k, stride);                                           \
    }
MOE_PK_KERNELS(q8_0, PK_Q8_0)
MOE_PK_KERNELS(q4_0, PK_Q4_0)
MOE_PK_KERNELS(q4_1, PK_Q4_1)
MOE_PK_KERNELS(q5_0, PK_Q5_0)
MOE_PK_KERNELS(q5_1, PK_Q5_1)
MOE_PK_KERNELS(q4_k, PK_Q4_K)
MOE_PK_KERNELS(q5_k, PK_Q5_K)
MOE_PK_KERNELS(q6_k, PK_Q6_K)
MOE_PK_KERNELS(iq4_nl, PK_IQ4_NL)
MOE_PK_KERNELS(iq4_xs, PK_IQ4_XS)
MOE_PK_KERNELS(mxfp4, PK_MXFP4)
MOE_PK_KERNELS(nvfp4, PK_NVFP4)
MOE_PK_KERNELS(rocmfp4, PK_ROCMFP4)
MOE_PK_KERNELS(rocmfp4_fast, PK_ROCMFP4_FAST)

// ---- Prefill: the assignments grouped by expert ------------------------------------------------

// counts[e] = how many of the `assignments` (T * top_k) ids are e. Launch: grid E, block 256.
ATLAS_KERNEL void moe_count(const int* ids, int assignments, int* counts) {
    __shared__ int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    int mine = 0;
    for (int i = threadIdx.x; i < assignments; i += blockDim.x) mine += ids[i] == (int)blockIdx.x;
    atomicAdd(&total, mine);  // integers: the same total in any order
    __syncthreads();
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// Inclusive prefix sum of v over the block (blockDim.x a multiple of WARP_SIZE, at most
// WARP_SIZE^2); *total gets the block's sum. Every thread must call it. `warp_sums`: shared, one
// int per warp.
__device__ __forceinline__ int moe_block_scan(int v, int* total, int* warp_sums) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    for (int d = 1; d < WARP_SIZE; d <<= 1) {
        const int o = __float_as_int(shfl(__int_as_float(v), lane >= d ? lane - d : lane));
        if (lane >= d) v += o;
    }
    if (lane == WARP_SIZE - 1) warp_sums[warp] = v;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < warps; w++) {
        const int ws = warp_sums[w];
        before += w < warp ? ws : 0;
        all += ws;
    }
    __syncthreads();  // warp_sums is written again by the next call
    *total = all;
    return v + before;
}

// For expert e = blockIdx.x: offsets[e] = Σ_{e' < e} counts[e'] and tiles[e] = Σ_{e' < e}
// ceil(counts[e'] / GEMM_BM) (the last block also writes offsets[E], tiles[E]: the totals);
// rows[offsets[e] + r] = the r-th assignment i = t * top_k + s (in order of i) whose id is e, and
// slot_row[i] = offsets[e] + r, its row. Launch: grid E, block 256.
ATLAS_KERNEL void moe_index(const int* ids, int assignments, const int* counts, int E, int* offsets, int* tiles,
                            int* rows, int* slot_row) {
    __shared__ int base, tile_base;
    __shared__ int warp_sums[32];
    const int e = blockIdx.x;
    if (threadIdx.x == 0) {
        base = 0;
        tile_base = 0;
    }
    __syncthreads();
    int b = 0, tb = 0;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        b += counts[j];
        tb += (counts[j] + GEMM_BM - 1) / GEMM_BM;
    }
    atomicAdd(&base, b);
    atomicAdd(&tile_base, tb);
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[e] = base;
        tiles[e] = tile_base;
        if (e == E - 1) {
            offsets[E] = base + counts[e];
            tiles[E] = tile_base + (counts[e] + GEMM_BM - 1) / GEMM_BM;
        }
    }
    int cursor = base;
    for (int i0 = 0; i0 < assignments; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const int mine = i < assignments && ids[i] == e;
        int chunk;
        const int upto = moe_block_scan(mine, &chunk, warp_sums);
        if (mine) {
            const int row = cursor + upto - 1;
            rows[row] = i;
            slot_row[i] = row;
        }
        cursor += chunk;
    }
}

// xg[r] = x[rows[r] / top_k]: each assignment's token, in grouped order. Launch: grid
// (assignments), block 256.
ATLAS_KERNEL void moe_gather(const float* x, const int* rows, int top_k, int H, float* xg) {
    const long r = blockIdx.x;
    const float* src = x + (long)(rows[r] / top_k) * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) xg[r * H + c] = src[c];
}

// Grouped GEMM: for each expert e, y[offsets[e] + t, n] = Σ_k x[offsets[e] + t, k] · W_e[n, k] for
// its rows t < counts[e]: gemm.hip's tiles (128 x 128, bf16 operands on the matrix cores, f32
// accumulation), over each expert's own rows and weights (expert e's `stride` bytes after expert
// e - 1's; packed formats: format id `fmt`, K % 32 == 0). blockIdx.z picks (W0, S0, y0) or
// (W1, S1, y1): gate and up in one launch. Launch: grid (ceil(N / GEMM_BN), max_tiles, 1 or 2),
// block GEMM_THREADS, where max_tiles >= tiles[E] (blocks past tiles[E] return at once).
template <int KIND>
__device__ __forceinline__ void moe_gemm_body(const unsigned char* W, const float* scales, int fmt, long long stride,
                                              const float* x, const int* offsets, const int* tiles, int E, float* y,
                                              int N, int K) {
    __shared__ uint4 xs_raw[2 * GEMM_BM * GEMM_LDS / 8];
    __shared__ uint4 ws_raw[2 * GEMM_BN * GEMM_LDS / 8];
    bf16* xs = (bf16*)xs_raw;
    bf16* ws = (bf16*)ws_raw;
    const int tile = blockIdx.y;
    if (tile >= tiles[E]) return;
    // The expert that owns this tile: the last e with tiles[e] <= tile (an empty expert's tiles[e]
    // equals the next one's, so it is never the last).
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tiles[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    const long e = lo;
    const int first = offsets[e], T = offsets[e + 1] - first;
    const int t0 = (tile - tiles[e]) * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    const unsigned char* We = W + e * stride;
    const float* Se = KIND == GEMM_FP8 ? scales + e * ((N + FP8_BLOCK - 1) / FP8_BLOCK) * ((K + FP8_BLOCK - 1) / FP8_BLOCK) : nullptr;
    const float* xe = x + (long)first * K;
    float* ye = y + (long)first * N;

    float acc[GEMM_TM][GEMM_TN][MMA_ACC];
#pragma unroll
    for (int i = 0; i < GEMM_TM; i++)
#pragma unroll
        for (int j = 0; j < GEMM_TN; j++)
#pragma unroll
            for (int v = 0; v < MMA_ACC; v++) acc[i][j][v] = 0.0f;

    if ((K % GEMM_BK) == 0 && t0 + GEMM_BM <= T && n0 + GEMM_BN <= N)
        gemm_mainloop<KIND, false>(acc, xs, ws, We, Se, fmt, xe, N, K, T, n0, t0);
    else
        gemm_mainloop<KIND, true>(acc, xs, ws, We, Se, fmt, xe, N, K, T, n0, t0);

    const int warp = threadIdx.x / WARP_SIZE;
    const int tw = t0 + (warp / (GEMM_WARPS / 2)) * GEMM_WM, nw = n0 + (warp % (GEMM_WARPS / 2)) * GEMM_WN;
#pragma unroll
    for (int i = 0; i < GEMM_TM; i++)
#pragma unroll
        for (int j = 0; j < GEMM_TN; j++)
#pragma unroll
            for (int v = 0; v < MMA_ACC; v++) {
                const int t = tw + i * 16 + mma_row(v), n = nw + j * 16 + mma_col(v);
                if (t < T && n < N) ye[(long)t * N + n] = acc[i][j][v];
            }
}

#define MOE_GEMM_KERNEL(name, KIND)                                                                                  \
    ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)                                                           \
        name(const unsigned char* W0, const float* S0, float* y0, const unsigned char* W1, const float* S1, float* y1, \
             const float* x, const int* offsets, const int* tiles, int E, int N, int K, int fmt, long long stride) {   \
        const bool second = blockIdx.z == 1;                                                                         \
        moe_gemm_body<KIND>(second ? W1 : W0, second ? S1 : S0, fmt, stride, x, offsets, tiles, E, second ? y1 : y0, \
                            N, K);                                                                                   \
    }
MOE_GEMM_KERNEL(moe_gemm_bf16, GEMM_BF16)
MOE_GEMM_KERNEL(moe_gemm_fp8, GEMM_FP8)
MOE_GEMM_KERNEL(moe_gemm_packed, GEMM_PACKED)

// out[t, c] += Σ_s weights[t, s] · y[row, c] (the sum first, then the add), row = slot_row[t * top_k + s] (or t * top_k + s
// when slot_row is null: the decode kernels' [top_k (+ 1), H]), s = 0..top_k in order; then, with
// shared_logit (decode only), + sigmoid(shared_logit[0]) · y[top_k, c], the shared expert's slot.
// Launch: grid (ceil(H / 256), T), block 256.
ATLAS_KERNEL void moe_combine(const float* y, const int* slot_row, const float* weights, const float* shared_logit,
                              int top_k, int H, float* out) {
    const long t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= H) return;
    float acc = 0.0f;
    for (int s = 0; s < top_k; s++) {
        const long i = t * top_k + s;
        const long row = slot_row ? slot_row[i] : i;
        acc += weights[i] * y[row * H + c];
    }
    if (shared_logit) acc += y[(long)top_k * H + c] / (1.0f + expf(-shared_logit[0]));
    out[t * H + c] += acc;
}
