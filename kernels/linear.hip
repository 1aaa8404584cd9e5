// Linear layers with bf16 weights: y[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]), f32 accumulation.
// Layout: W [N, K] bf16 row-major (nn.Linear.weight), x [T, K] f32, y [T, N] f32, bias [N] f32 or null.
#include "common/portable.h"
#include "common/mma.h"

#define GEMV_MAX_T 8

// Decode, one token: one warp per output row, 16-byte weight loads (8 bf16 per lane), four in
// flight per lane to keep the memory system busy. Launch: grid ceil(N / warps_per_block), block 256.
// Needs K % 8 == 0.
// `residual` (may be y itself) is added to the result: the residual stream's update in one pass.
ATLAS_KERNEL void gemv1_bf16(const bf16* W, const float* x, const float* bias, const float* residual, float* y, int N,
                             int K) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (n >= N) return;
    const uint4* row = (const uint4*)(W + (long)n * K);
    const float4* xv = (const float4*)x;
    const int chunks = K / 8;
    float acc = 0.0f;
    for (int c0 = lane; c0 < chunks; c0 += 4 * WARP_SIZE) {
        uint4 p[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c0 + u * WARP_SIZE;
            p[u] = c < chunks ? row[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c0 + u * WARP_SIZE;
            if (c < chunks) {
                const float4 a = xv[2 * c], b = xv[2 * c + 1];
                acc += __uint_as_float(p[u].x << 16) * a.x + __uint_as_float(p[u].x & 0xffff0000u) * a.y
                     + __uint_as_float(p[u].y << 16) * a.z + __uint_as_float(p[u].y & 0xffff0000u) * a.w
                     + __uint_as_float(p[u].z << 16) * b.x + __uint_as_float(p[u].z & 0xffff0000u) * b.y
                     + __uint_as_float(p[u].w << 16) * b.z + __uint_as_float(p[u].w & 0xffff0000u) * b.w;
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[n] = acc + (bias ? bias[n] : 0.0f) + (residual ? residual[n] : 0.0f);
}

// Decode, one token, the gated MLP's first half: out[n] = silu(x·G[n] + gb[n]) * (x·U[n] + ub[n]).
// One warp per n reads both rows; same launch shape as gemv1_bf16.
ATLAS_KERNEL void gemv1_gate_up_bf16(const bf16* G, const bf16* U, const float* x, const float* gate_bias,
                                     const float* up_bias, float* out, int N, int K) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (n >= N) return;
    const uint4* grow = (const uint4*)(G + (long)n * K);
    const uint4* urow = (const uint4*)(U + (long)n * K);
    const float4* xv = (const float4*)x;
    const int chunks = K / 8;
    float g = 0.0f, u = 0.0f;
    for (int c0 = lane; c0 < chunks; c0 += 2 * WARP_SIZE) {
        uint4 pg[2], pu[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int c = c0 + k * WARP_SIZE;
            pg[k] = c < chunks ? grow[c] : make_uint4(0, 0, 0, 0);
            pu[k] = c < chunks ? urow[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int c = c0 + k * WARP_SIZE;
            if (c < chunks) {
                const float4 a = xv[2 * c], b = xv[2 * c + 1];
                const float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                const unsigned int gw[4] = {pg[k].x, pg[k].y, pg[k].z, pg[k].w};
                const unsigned int uw[4] = {pu[k].x, pu[k].y, pu[k].z, pu[k].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    g += __uint_as_float(gw[j] << 16) * xs[2 * j] + __uint_as_float(gw[j] & 0xffff0000u) * xs[2 * j + 1];
                    u += __uint_as_float(uw[j] << 16) * xs[2 * j] + __uint_as_float(uw[j] & 0xffff0000u) * xs[2 * j + 1];
                }
            }
        }
    }
    g = warp_sum(g) + (gate_bias ? gate_bias[n] : 0.0f);
    u = warp_sum(u) + (up_bias ? up_bias[n] : 0.0f);
    if (lane == 0) out[n] = g / (1.0f + expf(-g)) * u;
}

// Decode, a few tokens (T <= GEMV_MAX_T): as gemv1, each W row read once for all T tokens.
ATLAS_KERNEL void gemv_bf16(const bf16* W, const float* x, const float* bias, float* y, int N, int K, int T) {
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
            if (lane == 0) y[(long)t * N + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
}

// Prefill (T > GEMV_MAX_T, any K): 128x128 output tiles on the matrix cores (common/mma.h). Each
// 32-wide K step stages x (converted to bf16) and W in shared memory; the 64 16x16 tiles of a
// block are shared out among its warps. Launch: grid (ceil(N/128), ceil(T/128)), block 256.
#define GM 128
#define GN 128
#define GK 32
#define GLD (GK + 8)
#define GTHREADS 256
#define TILES_PER_WARP (64 / (GTHREADS / WARP_SIZE))

ATLAS_KERNEL void gemm_bf16(const bf16* W, const float* x, const float* bias, float* y, int N, int K, int T) {
    __shared__ bf16 xs[GM * GLD];
    __shared__ bf16 ws[GN * GLD];
    const int warp = threadIdx.x / WARP_SIZE, warps = GTHREADS / WARP_SIZE;
    const int n0 = blockIdx.x * GN, t0 = blockIdx.y * GM;
    float acc[TILES_PER_WARP][MMA_ACC];
#pragma unroll
    for (int j = 0; j < TILES_PER_WARP; j++)
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) acc[j][i] = 0.0f;

    // Blocks of whole tiles (the usual case) load the next K step into registers with 16-byte loads
    // while the matrix cores work on the current one; edge blocks go element by element.
    const bool full = (K % GK) == 0 && t0 + GM <= T && n0 + GN <= N;
    float4 xr[GM * GK / 4 / GTHREADS];
    uint4 wr[GN * GK / 8 / GTHREADS];
    if (full) {
#pragma unroll
        for (int i = 0; i < GM * GK / 4 / GTHREADS; i++) {
            const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 4), k = (e % (GK / 4)) * 4;
            xr[i] = *(const float4*)(x + (long)(t0 + r) * K + k);
        }
#pragma unroll
        for (int i = 0; i < GN * GK / 8 / GTHREADS; i++) {
            const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 8), k = (e % (GK / 8)) * 8;
            wr[i] = *(const uint4*)(W + (long)(n0 + r) * K + k);
        }
    }
    for (int k0 = 0; k0 < K; k0 += GK) {
        if (full) {
#pragma unroll
            for (int i = 0; i < GM * GK / 4 / GTHREADS; i++) {
                const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 4), k = (e % (GK / 4)) * 4;
                bf16* dst = xs + r * GLD + k;
                dst[0] = f32_to_bf16(xr[i].x);
                dst[1] = f32_to_bf16(xr[i].y);
                dst[2] = f32_to_bf16(xr[i].z);
                dst[3] = f32_to_bf16(xr[i].w);
            }
#pragma unroll
            for (int i = 0; i < GN * GK / 8 / GTHREADS; i++) {
                const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 8), k = (e % (GK / 8)) * 8;
                unsigned int* dst = (unsigned int*)(ws + r * GLD + k);
                dst[0] = wr[i].x;
                dst[1] = wr[i].y;
                dst[2] = wr[i].z;
                dst[3] = wr[i].w;
            }
        } else {
            for (int e = threadIdx.x; e < GM * GK; e += GTHREADS) {
                const int r = e / GK, k = e % GK, t = t0 + r, n = n0 + r, kk = k0 + k;
                xs[r * GLD + k] = (t < T && kk < K) ? f32_to_bf16(x[(long)t * K + kk]) : (bf16)0;
                ws[r * GLD + k] = (n < N && kk < K) ? W[(long)n * K + kk] : (bf16)0;
            }
        }
        __syncthreads();
        if (full && k0 + GK < K) {
#pragma unroll
            for (int i = 0; i < GM * GK / 4 / GTHREADS; i++) {
                const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 4), k = (e % (GK / 4)) * 4;
                xr[i] = *(const float4*)(x + (long)(t0 + r) * K + k0 + GK + k);
            }
#pragma unroll
            for (int i = 0; i < GN * GK / 8 / GTHREADS; i++) {
                const int e = threadIdx.x + i * GTHREADS, r = e / (GK / 8), k = (e % (GK / 8)) * 8;
                wr[i] = *(const uint4*)(W + (long)(n0 + r) * K + k0 + GK + k);
            }
        }
#pragma unroll
        for (int kk = 0; kk < GK; kk += 16) {
#pragma unroll
            for (int j = 0; j < TILES_PER_WARP; j++) {
                const int tile = warp + j * warps, tm = tile / 8, tn = tile % 8;
                mma16(acc[j], xs + tm * 16 * GLD + kk, GLD, ws + tn * 16 * GLD + kk, GLD);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < TILES_PER_WARP; j++) {
        const int tile = warp + j * warps, tm = tile / 8, tn = tile % 8;
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) {
            const int t = t0 + tm * 16 + mma_row(i), n = n0 + tn * 16 + mma_col(i);
            if (t < T && n < N) y[(long)t * N + n] = acc[j][i] + (bias ? bias[n] : 0.0f);
        }
    }
}
