// Prefill GEMMs on the matrix cores:
//   y[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) (+ residual[t, n]),  f32 accumulation.
// Layout: W [N, K] row-major (nn.Linear.weight): bf16 (gemm_bf16), FP8 E4M3 codes with f32 scales
// [ceil(N/128), ceil(K/128)] (gemm_fp8, see common/fp8.h), or a block format in the device layout
// of common/packed.h (gemm_packed, format id `fmt`; K % 32 == 0); x [T, K] f32; y [T, N] f32; bias [N] f32
// or null; residual [T, N] f32 or null, and may be y itself (each element is read and then written
// by the same thread, and y is read nowhere else). Any N, K, T >= 1.
//
// Launch: grid (ceil(N / GEMM_BN), ceil(T / GEMM_BM), 1) -- x over N, y over T --, block
// GEMM_THREADS, no dynamic shared memory (static: 40 KB). Same shape for every kernel and vendor.
//
// Each block computes a 128x128 tile of y in 32-wide K steps. x (converted to bf16) and W (bf16, or
// decoded in registers to f32 exactly as the CPU does, then rounded to bf16) are staged in a double-buffered shared tile; the next step's
// global loads are issued into registers before the current step's products, so their latency hides
// behind the matrix cores, and one barrier per step suffices. The block's warps split the tile 2 x
// (warps / 2): 64x32 per warp with 32-lane warps, 64x64 with 64-lane ones; per 16-wide k slice a
// warp loads its 4 A and 2 (or 4) B fragments once and reuses each across the others
// (common/mma.h's fragment API: ldmatrix + mma.sync on NVIDIA, WMMA/MFMA on AMD).
#include "common/portable.h"
#include "common/mma.h"
#include "common/fp8.h"
#include "common/packed.h"
#include "common/wgmma.h"

#define GEMM_BM 128      // rows of x / y (tokens) per block
#define GEMM_BN 128      // rows of W / columns of y per block
#define GEMM_THREADS 256
#define GEMM_BK 32
// Shared rows of 40 bf16 (80 bytes): 16-byte aligned for ldmatrix, and 8 consecutive rows fall on
// distinct 16-byte bank groups, so fragment loads are conflict-free.
#define GEMM_LDS (GEMM_BK + 8)
#define GEMM_WARPS (GEMM_THREADS / WARP_SIZE)
#define GEMM_WM 64                                 // warp tile rows (of GEMM_BM)
#define GEMM_WN (GEMM_BN / (GEMM_WARPS / 2))       // warp tile columns: 32 (wave32) or 64 (wave64)
#define GEMM_TM (GEMM_WM / 16)
#define GEMM_TN (GEMM_WN / 16)
#define GEMM_XCH (GEMM_BM * GEMM_BK / 8 / GEMM_THREADS)   // 8-float chunks of x per thread per step
#define GEMM_WCH (GEMM_BN * GEMM_BK / 8 / GEMM_THREADS)   // 8-bf16 chunks of W
#define GEMM_QCH (GEMM_BN * GEMM_BK / 16 / GEMM_THREADS)  // 16-code chunks of FP8 W
// Consecutive blocks sweep N within a band of this many T tiles, so the blocks resident at once
// share their x rows and W rows in L2 instead of streaming all of W once per T tile.
#define GEMM_GROUP_T 8

static_assert(GEMM_BM == 2 * GEMM_WM, "two warp rows");
static_assert(GEMM_XCH >= 1 && GEMM_WCH >= 1 && GEMM_QCH >= 1, "every thread stages whole chunks");
static_assert(FP8_BLOCK % GEMM_BN == 0 && FP8_BLOCK % GEMM_BK == 0, "one FP8 scale per block and step");

#define GEMM_BF16 0
#define GEMM_FP8 1
#define GEMM_PACKED 2

// One K step of x and W in flight in registers.
struct gemm_stage {
    float4 x[GEMM_XCH][2];
    uint4 w[GEMM_WCH];  // FP8 uses the first GEMM_QCH
    float scale;        // FP8 block scale (times 2^120, see fp8_scale)
    PkRaw pk;           // packed: half a run (the K step) of one row
};

// Global -> registers for the K step at k0. CHECKED: the tile may cross T, N or K (zero-filled
// there), and K may break the vector loads' alignment. Packed: thread e takes words 2(e % 2) and
// 2(e % 2) + 1 of row e / 2's run (K % 32 == 0: a step is one run).
template <int KIND, bool CHECKED>
__device__ __forceinline__ void gemm_fetch(gemm_stage& s, const void* W, const float* scales, int fmt, const float* x,
                                           int N, int K, int T, int n0, int t0, int k0) {
#pragma unroll
    for (int i = 0; i < GEMM_XCH; i++) {
        const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 8), k = k0 + (e % (GEMM_BK / 8)) * 8;
        const int t = t0 + r;
        const float* src = x + (long)t * K + k;
        if (!CHECKED || (t < T && (K & 3) == 0 && k + 8 <= K)) {
            s.x[i][0] = ((const float4*)src)[0];
            s.x[i][1] = ((const float4*)src)[1];
        } else {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = (t < T && k + j < K) ? src[j] : 0.0f;
            s.x[i][0] = make_float4(v[0], v[1], v[2], v[3]);
            s.x[i][1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
    if (KIND == GEMM_PACKED) {
        static_assert(GEMM_BN * 2 == GEMM_THREADS && GEMM_BK == 32, "two threads a row, one run a step");
        const int n = n0 + threadIdx.x / 2;
        if (!CHECKED || n < N) {
            s.pk = pk_fetch16_any(fmt, (const unsigned char*)W, N, K, (long)n * (K / 32) + k0 / 32, 2 * (threadIdx.x % 2));
        } else {
            s.pk.codes = make_uint2(0u, 0u);
            s.pk.fields = make_uint2(0u, 0u);
            s.pk.meta = make_uint4(0u, 0u, 0u, 0u);
        }
    } else if (KIND == GEMM_BF16) {
#pragma unroll
        for (int i = 0; i < GEMM_WCH; i++) {
            const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 8), k = k0 + (e % (GEMM_BK / 8)) * 8;
            const int n = n0 + r;
            const bf16* src = (const bf16*)W + (long)n * K + k;
            if (!CHECKED || (n < N && (K & 7) == 0 && k + 8 <= K)) {
                s.w[i] = *(const uint4*)src;
            } else {
                unsigned int h[8];
#pragma unroll
                for (int j = 0; j < 8; j++) h[j] = (n < N && k + j < K) ? src[j] : 0u;
                s.w[i] = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < GEMM_QCH; i++) {
            const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 16), k = k0 + (e % (GEMM_BK / 16)) * 16;
            const int n = n0 + r;
            const unsigned char* src = (const unsigned char*)W + (long)n * K + k;
            if (!CHECKED || (n < N && (K & 15) == 0 && k + 16 <= K)) {
                s.w[i] = *(const uint4*)src;
            } else {
                unsigned int b[16];
#pragma unroll
                for (int j = 0; j < 16; j++) b[j] = (n < N && k + j < K) ? src[j] : 0u;
                s.w[i] = make_uint4(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24,
                                    b[8] | b[9] << 8 | b[10] << 16 | b[11] << 24,
                                    b[12] | b[13] << 8 | b[14] << 16 | b[15] << 24);
            }
        }
        const int kblocks = (K + FP8_BLOCK - 1) / FP8_BLOCK;
        s.scale = fp8_scale(scales[(n0 / FP8_BLOCK) * kblocks + k0 / FP8_BLOCK]);
    }
}

// Registers -> shared, as bf16 rows of GEMM_LDS.
template <int KIND>
__device__ __forceinline__ void gemm_stash(const gemm_stage& s, int fmt, int K, int n0, int k0, bf16* xs, bf16* ws) {
#pragma unroll
    for (int i = 0; i < GEMM_XCH; i++) {
        const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 8), k = (e % (GEMM_BK / 8)) * 8;
        *(uint4*)(xs + r * GEMM_LDS + k) =
            make_uint4(bf16x2_pack(s.x[i][0].x, s.x[i][0].y), bf16x2_pack(s.x[i][0].z, s.x[i][0].w),
                       bf16x2_pack(s.x[i][1].x, s.x[i][1].y), bf16x2_pack(s.x[i][1].z, s.x[i][1].w));
    }
    if (KIND == GEMM_PACKED) {
        const int r = threadIdx.x / 2, w0 = 2 * (threadIdx.x % 2);
        float lo[8], hi[8];
        pk_decode16_any(fmt, s.pk, (long)(n0 + r) * (K / 32) + k0 / 32, lo, hi);
        *(uint4*)(ws + r * GEMM_LDS + 4 * w0) = make_uint4(bf16x2_pack(lo[0], lo[1]), bf16x2_pack(lo[2], lo[3]),
                                                           bf16x2_pack(lo[4], lo[5]), bf16x2_pack(lo[6], lo[7]));
        *(uint4*)(ws + r * GEMM_LDS + 16 + 4 * w0) = make_uint4(bf16x2_pack(hi[0], hi[1]), bf16x2_pack(hi[2], hi[3]),
                                                                bf16x2_pack(hi[4], hi[5]), bf16x2_pack(hi[6], hi[7]));
    } else if (KIND == GEMM_BF16) {
#pragma unroll
        for (int i = 0; i < GEMM_WCH; i++) {
            const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 8), k = (e % (GEMM_BK / 8)) * 8;
            *(uint4*)(ws + r * GEMM_LDS + k) = s.w[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < GEMM_QCH; i++) {
            const int e = threadIdx.x + i * GEMM_THREADS, r = e / (GEMM_BK / 16), k = (e % (GEMM_BK / 16)) * 16;
            e4m3x16_to_bf16(s.w[i], s.scale, *(uint4*)(ws + r * GEMM_LDS + k), *(uint4*)(ws + r * GEMM_LDS + k + 8));
        }
    }
}

// The warp's 64 x GEMM_WN products for one staged K step.
__device__ __forceinline__ void gemm_step(float (&acc)[GEMM_TM][GEMM_TN][MMA_ACC], const bf16* xs, const bf16* ws) {
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
        mma_frag_t b[GEMM_TN];
#pragma unroll
        for (int j = 0; j < GEMM_TN; j++) mma_load_b(b[j], ws + j * 16 * GEMM_LDS + kk, GEMM_LDS);
#pragma unroll
        for (int i = 0; i < GEMM_TM; i++) {
            mma_frag_t a;
            mma_load_a(a, xs + i * 16 * GEMM_LDS + kk, GEMM_LDS);
#pragma unroll
            for (int j = 0; j < GEMM_TN; j++) mma16_frag(acc[i][j], a, b[j]);
        }
    }
}

template <int KIND, bool CHECKED>
__device__ __forceinline__ void gemm_mainloop(float (&acc)[GEMM_TM][GEMM_TN][MMA_ACC], bf16* xs, bf16* ws,
                                              const void* W, const float* scales, int fmt, const float* x, int N,
                                              int K, int T, int n0, int t0) {
    const int warp = threadIdx.x / WARP_SIZE;
    const int wm = (warp / (GEMM_WARPS / 2)) * GEMM_WM, wn = (warp % (GEMM_WARPS / 2)) * GEMM_WN;
    const int steps = (K + GEMM_BK - 1) / GEMM_BK;
    gemm_stage s;
    gemm_fetch<KIND, CHECKED>(s, W, scales, fmt, x, N, K, T, n0, t0, 0);
    gemm_stash<KIND>(s, fmt, K, n0, 0, xs, ws);
    __syncthreads();
    for (int step = 0; step < steps; step++) {
        const int cur = step & 1;
        const bool more = step + 1 < steps;
        if (more) gemm_fetch<KIND, CHECKED>(s, W, scales, fmt, x, N, K, T, n0, t0, (step + 1) * GEMM_BK);
        gemm_step(acc, xs + cur * GEMM_BM * GEMM_LDS + wm * GEMM_LDS, ws + cur * GEMM_BN * GEMM_LDS + wn * GEMM_LDS);
        // The other buffer was last read in the previous step, before its closing barrier.
        if (more)
            gemm_stash<KIND>(s, fmt, K, n0, (step + 1) * GEMM_BK, xs + (cur ^ 1) * GEMM_BM * GEMM_LDS,
                             ws + (cur ^ 1) * GEMM_BN * GEMM_LDS);
        __syncthreads();
    }
}

// Block id -> the block's tile (t0, n0) of bn rows of W: column-major within bands of GEMM_GROUP_T
// T tiles (a bijection on the grid).
__device__ __forceinline__ void gemm_tile_of_block(int& t0, int& n0, int bn = GEMM_BN) {
    const int gx = gridDim.x, id = blockIdx.y * gx + blockIdx.x;
    const int first = (id / (GEMM_GROUP_T * gx)) * GEMM_GROUP_T;
    const int rows = min((int)gridDim.y - first, GEMM_GROUP_T);
    const int local = id - first * gx;
    t0 = (first + local % rows) * GEMM_BM;
    n0 = (local / rows) * bn;
}

template <int KIND>
__device__ __forceinline__ void gemm_body(const void* W, const float* scales, int fmt, const float* x, const float* bias,
                                          const float* residual, float* y, int N, int K, int T) {
    // uint4 for 16-byte alignment (vector stores, ldmatrix rows).
    __shared__ uint4 xs_raw[2 * GEMM_BM * GEMM_LDS / 8];
    __shared__ uint4 ws_raw[2 * GEMM_BN * GEMM_LDS / 8];
    bf16* xs = (bf16*)xs_raw;
    bf16* ws = (bf16*)ws_raw;

    int t0, n0;
    gemm_tile_of_block(t0, n0);

    float acc[GEMM_TM][GEMM_TN][MMA_ACC];
#pragma unroll
    for (int i = 0; i < GEMM_TM; i++)
#pragma unroll
        for (int j = 0; j < GEMM_TN; j++)
#pragma unroll
            for (int e = 0; e < MMA_ACC; e++) acc[i][j][e] = 0.0f;

    if ((K % GEMM_BK) == 0 && t0 + GEMM_BM <= T && n0 + GEMM_BN <= N)
        gemm_mainloop<KIND, false>(acc, xs, ws, W, scales, fmt, x, N, K, T, n0, t0);
    else
        gemm_mainloop<KIND, true>(acc, xs, ws, W, scales, fmt, x, N, K, T, n0, t0);

    const int warp = threadIdx.x / WARP_SIZE;
    const int tw = t0 + (warp / (GEMM_WARPS / 2)) * GEMM_WM, nw = n0 + (warp % (GEMM_WARPS / 2)) * GEMM_WN;
#pragma unroll
    for (int i = 0; i < GEMM_TM; i++)
#pragma unroll
        for (int j = 0; j < GEMM_TN; j++)
#pragma unroll
            for (int e = 0; e < MMA_ACC; e++) {
                const int t = tw + i * 16 + mma_row(e), n = nw + j * 16 + mma_col(e);
                if (t < T && n < N) {
                    const long o = (long)t * N + n;
                    y[o] = acc[i][j][e] + (bias ? bias[n] : 0.0f) + (residual ? residual[o] : 0.0f);
                }
            }
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)
    gemm_bf16(const bf16* W, const float* x, const float* bias, const float* residual, float* y, int N, int K, int T) {
    gemm_body<GEMM_BF16>(W, nullptr, 0, x, bias, residual, y, N, K, T);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)
    gemm_fp8(const unsigned char* W, const float* scales, const float* x, const float* bias, const float* residual,
             float* y, int N, int K, int T) {
    gemm_body<GEMM_FP8>(W, scales, 0, x, bias, residual, y, N, K, T);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)
    gemm_packed(const unsigned char* W, int fmt, const float* x, const float* bias, const float* residual, float* y,
                int N, int K, int T) {
    gemm_body<GEMM_PACKED>(W, nullptr, fmt, x, bias, residual, y, N, K, T);
}

// ---- Hopper (sm_90a): the same tiles of y with the products on wgmma (common/wgmma.h). They exist
// only where ATLAS_WGMMA does, need N % 128 == 0 and K % 64 == 0 (T is any), and compute what
// gemm_bf16, gemm_fp8 and gemm_packed compute (W decoded and x rounded to bf16 alike; the sums in
// another order, the same for all three). A K step is 64 wide: x and W tiles of 128 rows stored
// with the 128-byte swizzle; each warpgroup (128 threads) owns 64 of the block's 128 tokens and
// issues four m64n128k16 products a step.
// - gemm_wg_bf16 (W bf16) and gemm_wg_fp8 (W FP8 codes + scales as gemm_fp8) take x already in
//   bf16 (xb [T, K]) and stream the tiles with cp.async through GWG_STAGES stages, so the loads
//   of later steps are in flight while a step's products run; FP8 codes land raw and are decoded
//   into one of two bf16 W tiles while the previous step's products run.
//   Dynamic shared memory GEMM_WG_SHARED_BF16 / GEMM_WG_SHARED_FP8.
// - gemm_wg_bf16_wide: gemm_wg_bf16 over tiles of 128 tokens x 256 rows of W (N % 256 == 0),
//   GWW_STAGES stages, one block an SM. A step loads 48 KB for 2 M products where two square
//   blocks load 64 KB (the x tile is read once per 256 rows of W instead of once per 128): less
//   of what L2 delivers for the same products. Each half of the W tile takes the 128-row
//   kernel's products in its order, so both give the same bits. Taken where its grid fills every
//   SM at least once (fewer, larger blocks leave SMs idle on small prefills).
//   Grid (N / 256, ceil(T / 128)); dynamic shared memory GEMM_WG_SHARED_WIDE.
// - gemm_wg_bf16_gate_up: the MLP's first half in one launch, y [T, N] =
//   silu(x gateᵀ + gate_bias) * (x upᵀ + up_bias) for gate and up [N, K] (N % 128 == 0): the wide
//   tile's halves are 128 gate rows and the same 128 up rows, so each output's two sums meet in
//   one thread, each as its own GEMM gives it, and are combined as silu_mul combines them. Grid
//   (N / 128, ceil(T / 128)); shared memory as the wide kernels'.
// - gemm_wg_packed takes gemm_packed's arguments (x f32): each step's runs are decoded in
//   registers (common/packed.h) while the previous step's products run, two stages.
//   Dynamic shared memory GEMM_WG_SHARED_PACKED.
// Launch: as gemm_bf16: grid (N / 128, ceil(T / 128)), block GEMM_THREADS.
#if defined(ATLAS_WGMMA)
#define GWG_BK 64
#define GWG_TILE (GEMM_BM * GWG_BK * 2)  // bytes of one bf16 x or W tile (GEMM_BN == GEMM_BM)
#define GWG_RAW (GEMM_BN * GWG_BK)       // bytes of one tile of FP8 codes
#define GWG_STAGES 3
#define GWW_BN 256
#define GWW_STAGES 4
#define GEMM_WG_SHARED_BF16 (GWG_STAGES * 2 * GWG_TILE + 1024)
#define GEMM_WG_SHARED_WIDE (GWW_STAGES * (1 + GWW_BN / GEMM_BM) * GWG_TILE + 1024)
#define GEMM_WG_SHARED_FP8 ((GWG_STAGES + 2) * GWG_TILE + GWG_STAGES * (GWG_RAW + 16) + 1024)
#define GEMM_WG_SHARED_PACKED (4 * GWG_TILE + 1024)
static_assert(GEMM_BN == GEMM_BM && GEMM_THREADS == 256, "two warpgroups, square tiles");

// The dynamic shared memory, from its first 1024-byte boundary (the swizzle's alignment).
__device__ __forceinline__ unsigned char* gwg_tiles() {
    extern __shared__ unsigned char gwg_raw[];
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(gwg_raw);
    return gwg_raw + ((1024 - (at & 1023)) & 1023);
}

// One step's products of this warpgroup's 64 tokens against the W tile's H halves of 128 rows
// (d[h] for half h): four a half, each half's in k order.
template <int H>
__device__ __forceinline__ void gwg_products(float (&d)[H][64], const unsigned char* xs, const unsigned char* ws) {
    const int group = threadIdx.x / 128;
#pragma unroll
    for (int h = 0; h < H; h++) wg_fence_operands(d[h]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < GWG_BK; kk += 16)
#pragma unroll
        for (int h = 0; h < H; h++) wg_mma_64x128x16(d[h], wg_desc(xs + group * 64 * 128, kk), wg_desc(ws + h * GWG_TILE, kk), true);
    wg_commit();
}

__device__ __forceinline__ void gwg_store(const float (&d)[64], const float* bias, const float* residual, float* y, int N,
                                          int T, int t0, int n0) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, group = threadIdx.x / 128;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        const int t = t0 + group * 64 + 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
        const int n = n0 + 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        if (t < T) {
            const long o = (long)t * N + n;
            y[o] = d[i] + (bias ? bias[n] : 0.0f) + (residual ? residual[o] : 0.0f);
        }
    }
}

// silu(gate) * up of the 64 x 128 outputs gwg_store would write of each, the two sums as those
// of separate GEMMs and silu_mul then give them (the same bits).
__device__ __forceinline__ void gwg_store_gate_up(const float (&g)[64], const float (&u)[64], const float* gate_bias,
                                                  const float* up_bias, float* y, int N, int T, int t0, int n0) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, group = threadIdx.x / 128;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        const int t = t0 + group * 64 + 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
        const int n = n0 + 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        if (t < T) {
            const float gv = g[i] + (gate_bias ? gate_bias[n] : 0.0f) + 0.0f;
            const float uv = u[i] + (up_bias ? up_bias[n] : 0.0f) + 0.0f;
            y[(long)t * N + n] = gv / (1.0f + expf(-gv)) * uv;
        }
    }
}

// BN rows of W a block (bf16: 128 or 256; FP8: 128), STAGES stages. The W tile's half h (of 128
// rows): rows n0 + 128 h ... of W; or, GATE_UP (bf16, BN 256), rows n0 ... of the gate matrix (W)
// for h = 0 and of the up matrix (W2) for h = 1, whose products the block combines as silu_mul
// does (y [T, N], N the matrices' rows; bias: the gate's, bias2: the up's).
template <bool FP8, int BN, int STAGES, bool GATE_UP = false>
__device__ __forceinline__ void gemm_wg_async(const unsigned char* W, const float* scales, const bf16* xb,
                                              const float* bias, const float* residual, float* y, int N, int K, int T,
                                              const unsigned char* W2 = nullptr, const float* bias2 = nullptr) {
    constexpr int H = BN / GEMM_BM;  // W tiles of 128 rows a stage
    static_assert(!FP8 || H == 1, "FP8 decodes one W tile of 128 rows");
    static_assert(!GATE_UP || H == 2, "a gate half and an up half");
    unsigned char* tiles = gwg_tiles();
    int t0, n0;
    gemm_tile_of_block(t0, n0, GATE_UP ? GEMM_BM : BN);
    auto w_row = [&](int r) {  // row r of the W tile
        const long bytes = FP8 ? 1 : 2;
        if (GATE_UP) return (r < GEMM_BM ? W : W2) + (n0 + r % GEMM_BM) * K * bytes;
        return W + (n0 + r) * K * bytes;
    };
    const int steps = K / GWG_BK, tid = threadIdx.x;
    // bf16: stage j is an x tile and H W tiles. FP8: x tiles, then two decoded W tiles (by step
    // parity), then the stages' raw codes and scales.
    auto x_tile = [&](int j) { return tiles + (FP8 ? j : (1 + H) * j) * GWG_TILE; };
    auto w_tile = [&](int j) { return tiles + (FP8 ? STAGES + (j & 1) : (1 + H) * j + 1) * GWG_TILE; };
    unsigned char* raw = tiles + (STAGES + 2) * GWG_TILE;
    float* raw_scale = (float*)(raw + STAGES * GWG_RAW);

    auto issue = [&](int step) {  // one commit group per call, empty past the last step
        if (step < steps) {
            const int j = step % STAGES, k0 = step * GWG_BK;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int e = tid + i * GEMM_THREADS, r = e >> 3, c = 8 * (e & 7), t = t0 + r;
                async_copy16(x_tile(j) + wg_swizzle(r, c), xb + (long)min(t, T - 1) * K + k0 + c, t < T);
            }
            if (!FP8) {
#pragma unroll
                for (int i = 0; i < 4 * H; i++) {
                    const int e = tid + i * GEMM_THREADS, r = e >> 3, c = 8 * (e & 7);
                    async_copy16(w_tile(j) + wg_swizzle(r, c), (const bf16*)w_row(r) + k0 + c, true);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int e = tid + i * GEMM_THREADS, r = e >> 2, c = 16 * (e & 3);
                    async_copy16(raw + j * GWG_RAW + r * GWG_BK + c, w_row(r) + k0 + c, true);
                }
                if (tid == 0)
                    async_copy4(raw_scale + j, scales + (n0 / FP8_BLOCK) * ((K + FP8_BLOCK - 1) / FP8_BLOCK) + k0 / FP8_BLOCK, true);
            }
        }
        async_commit();
    };

    // Every thread's copies of the oldest step not yet waited for have landed, seen by all.
    auto landed = [&]() {
        async_wait<STAGES - 2>();
        wg_proxy_fence();
        __syncthreads();
    };
    // FP8: a step's codes into its decoded W tile.
    auto decode = [&](int step) {
        const int j = step % STAGES;
        const float scale = fp8_scale(raw_scale[j]);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + i * GEMM_THREADS, r = e >> 2, c = 16 * (e & 3);
            e4m3x16_to_bf16(*(const uint4*)(raw + j * GWG_RAW + r * GWG_BK + c), scale,
                            *(uint4*)(w_tile(step) + wg_swizzle(r, c)), *(uint4*)(w_tile(step) + wg_swizzle(r, c + 8)));
        }
        wg_proxy_fence();
        __syncthreads();
    };

    float d[H][64];
#pragma unroll
    for (int h = 0; h < H; h++)
#pragma unroll
        for (int i = 0; i < 64; i++) d[h][i] = 0.0f;
    for (int s = 0; s < STAGES - 1; s++) issue(s);
    if (FP8) {
        landed();
        decode(0);
    }
    // K >= 64: at least one step (a path that skipped the loop would make ptxas serialise the
    // products, its zeroed accumulators meeting theirs).
    int step = 0;
    do {
        const int j = step % STAGES;
        if (!FP8) landed();
        gwg_products<H>(d, x_tile(j), FP8 ? w_tile(step) : w_tile(j));
        // The previous step's products are done (this step's may still run): its stage, and for
        // FP8 its decoded W tile, may be refilled once every thread has seen that.
        wg_wait1();
#pragma unroll
        for (int h = 0; h < H; h++) wg_fence_operands(d[h]);
        __syncthreads();
        issue(step + STAGES - 1);
        // FP8 decodes the next step while this one's products run.
        if (FP8 && step + 1 < steps) {
            landed();
            decode(step + 1);
        }
    } while (++step < steps);
    wg_wait0();
#pragma unroll
    for (int h = 0; h < H; h++) wg_fence_operands(d[h]);
    if constexpr (GATE_UP) {
        gwg_store_gate_up(d[0], d[H - 1], bias, bias2, y, N, T, t0, n0);
    } else {
#pragma unroll
        for (int h = 0; h < H; h++) gwg_store(d[h], bias, residual, y, N, T, t0, n0 + h * GEMM_BM);
    }
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)
    gemm_wg_bf16(const bf16* W, const bf16* xb, const float* bias, const float* residual, float* y, int N, int K, int T) {
    gemm_wg_async<false, GEMM_BN, GWG_STAGES>((const unsigned char*)W, nullptr, xb, bias, residual, y, N, K, T);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 1)
    gemm_wg_bf16_wide(const bf16* W, const bf16* xb, const float* bias, const float* residual, float* y, int N, int K, int T) {
    gemm_wg_async<false, GWW_BN, GWW_STAGES>((const unsigned char*)W, nullptr, xb, bias, residual, y, N, K, T);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 1)
    gemm_wg_bf16_gate_up(const bf16* gate, const bf16* up, const bf16* xb, const float* gate_bias, const float* up_bias,
                         float* y, int N, int K, int T) {
    gemm_wg_async<false, GWW_BN, GWW_STAGES, true>((const unsigned char*)gate, nullptr, xb, gate_bias, nullptr, y, N, K, T,
                                                   (const unsigned char*)up, up_bias);
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 2)
    gemm_wg_fp8(const unsigned char* W, const float* scales, const bf16* xb, const float* bias, const float* residual,
                float* y, int N, int K, int T) {
    gemm_wg_async<true, GEMM_BN, GWG_STAGES>(W, scales, xb, bias, residual, y, N, K, T);
}

// gemm_wg_packed: a step of x (f32) and of W's runs in registers, one run a thread.
struct gwg_stage {
    float4 x[4][2];  // four chunks of 8 values of x
    PkRaw pk[2];     // both halves of one run
};

__device__ __forceinline__ void gwg_fetch(gwg_stage& s, const unsigned char* W, int fmt, const float* x, int N, int K,
                                          int T, int n0, int t0, int k0) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int e = threadIdx.x + i * GEMM_THREADS, r = e >> 3, t = t0 + r;
        const float4* src = (const float4*)(x + (long)t * K + k0 + 8 * (e & 7));
        s.x[i][0] = t < T ? src[0] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        s.x[i][1] = t < T ? src[1] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const long run = (long)(n0 + (threadIdx.x >> 1)) * (K / 32) + k0 / 32 + (threadIdx.x & 1);
    s.pk[0] = pk_fetch16_any(fmt, W, N, K, run, 0);
    s.pk[1] = pk_fetch16_any(fmt, W, N, K, run, 2);
}

__device__ __forceinline__ void gwg_stash(const gwg_stage& s, int fmt, int K, int n0, int k0, unsigned char* xs,
                                          unsigned char* ws) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int e = threadIdx.x + i * GEMM_THREADS;
        *(uint4*)(xs + wg_swizzle(e >> 3, 8 * (e & 7))) =
            make_uint4(bf16x2_pack(s.x[i][0].x, s.x[i][0].y), bf16x2_pack(s.x[i][0].z, s.x[i][0].w),
                       bf16x2_pack(s.x[i][1].x, s.x[i][1].y), bf16x2_pack(s.x[i][1].z, s.x[i][1].w));
    }
    const int r = threadIdx.x >> 1, kb = 32 * (threadIdx.x & 1);
    const long run = (long)(n0 + r) * (K / 32) + k0 / 32 + (threadIdx.x & 1);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float lo[8], hi[8];
        pk_decode16_any(fmt, s.pk[j], run, lo, hi);
        *(uint4*)(ws + wg_swizzle(r, kb + 8 * j)) = make_uint4(bf16x2_pack(lo[0], lo[1]), bf16x2_pack(lo[2], lo[3]),
                                                               bf16x2_pack(lo[4], lo[5]), bf16x2_pack(lo[6], lo[7]));
        *(uint4*)(ws + wg_swizzle(r, kb + 16 + 8 * j)) = make_uint4(bf16x2_pack(hi[0], hi[1]), bf16x2_pack(hi[2], hi[3]),
                                                                    bf16x2_pack(hi[4], hi[5]), bf16x2_pack(hi[6], hi[7]));
    }
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(GEMM_THREADS, 1)
    gemm_wg_packed(const unsigned char* W, int fmt, const float* x, const float* bias, const float* residual, float* y,
                   int N, int K, int T) {
    unsigned char* tiles = gwg_tiles();
    int t0, n0;
    gemm_tile_of_block(t0, n0);
    float d[1][64];
#pragma unroll
    for (int i = 0; i < 64; i++) d[0][i] = 0.0f;
    const int steps = K / GWG_BK;
    gwg_stage s;
    gwg_fetch(s, W, fmt, x, N, K, T, n0, t0, 0);
    gwg_stash(s, fmt, K, n0, 0, tiles, tiles + GWG_TILE);
    wg_proxy_fence();
    __syncthreads();
    for (int step = 0; step < steps; step++) {
        unsigned char* xs = tiles + (step & 1) * 2 * GWG_TILE;
        const bool more = step + 1 < steps;
        if (more) gwg_fetch(s, W, fmt, x, N, K, T, n0, t0, (step + 1) * GWG_BK);
        gwg_products<1>(d, xs, xs + GWG_TILE);
        if (more) {
            // The other stage was last read by the previous step's products, waited for below.
            unsigned char* nx = tiles + ((step + 1) & 1) * 2 * GWG_TILE;
            gwg_stash(s, fmt, K, n0, (step + 1) * GWG_BK, nx, nx + GWG_TILE);
            wg_proxy_fence();
        }
        wg_wait0();
        __syncthreads();
    }
    gwg_store(d[0], bias, residual, y, N, T, t0, n0);
}
#endif
