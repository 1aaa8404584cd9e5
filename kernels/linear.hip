// Linear layers with bf16 weights: y[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]), f32 accumulation.
// Layout: W [N, K] bf16 row-major (nn.Linear.weight), x [T, K] f32, y [T, N] f32, bias [N] f32 or null.
#include "common/portable.h"

#define GEMV_MAX_T 8

// Decode (T <= GEMV_MAX_T): one warp per output row, each W row read once for all T tokens with
// 16-byte loads (8 bf16 per lane). Launch: grid ceil(N / warps_per_block), block 256. Needs K % 8 == 0.
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

// Prefill (any T, any K): 64x64 output tiles, 32-wide K steps through shared memory, 4x4 outputs
// per thread. Launch: grid (ceil(N/64), ceil(T/64)), block 256.
#define TILE 64
#define TK 32
ATLAS_KERNEL void gemm_bf16(const bf16* W, const float* x, const float* bias, float* y, int N, int K, int T) {
    __shared__ float xs[TK][TILE + 1];
    __shared__ float ws[TK][TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int n0 = blockIdx.x * TILE, t0 = blockIdx.y * TILE;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int i = threadIdx.x; i < TILE * TK; i += blockDim.x) {
            const int r = i / TK, k = i % TK;
            const int t = t0 + r, n = n0 + r, kk = k0 + k;
            xs[k][r] = (t < T && kk < K) ? x[(long)t * K + kk] : 0.0f;
            ws[k][r] = (n < N && kk < K) ? bf16_to_f32(W[(long)n * K + kk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < TK; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                a[i] = xs[k][ty * 4 + i];
                b[i] = ws[k][tx * 4 + i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int t = t0 + ty * 4 + i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int n = n0 + tx * 4 + j;
            if (n < N) y[(long)t * N + n] = acc[i][j] + (bias ? bias[n] : 0.0f);
        }
    }
}
