// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight, over consecutive groups of `group` values
// (a whole hidden row, or one attention head for Qwen3's q/k norms).
// Layout: x, out [rows, cols] f32 row-major, cols a multiple of group; weight [group] f32.
// Launch: one block per group (grid = rows * cols / group); block: a multiple of the warp size,
// ideally group / 4 threads (one float4 each) up to 1024.
#include "common/portable.h"

// Sum of squares of one group with 16-byte loads when the group allows it. Every thread gets it.
__device__ __forceinline__ float group_sum_squares(const float* xg, int group, float* scratch) {
    float ss = 0.0f;
    if (group % 4 == 0) {
        const float4* x4 = (const float4*)xg;
#pragma unroll 4
        for (int i = threadIdx.x; i < group / 4; i += blockDim.x) {
            const float4 v = x4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < group; i += blockDim.x) ss += xg[i] * xg[i];
    }
    return block_sum(ss, scratch);
}

ATLAS_KERNEL void rms_norm(const float* x, const float* weight, float* out, int group, float eps) {
    __shared__ float scratch[32];
    const float* xg = x + (long)blockIdx.x * group;
    float* og = out + (long)blockIdx.x * group;
    const float scale = rsqrtf(group_sum_squares(xg, group, scratch) / group + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < group; i += blockDim.x) og[i] = xg[i] * scale * weight[i];
}

// Qwen3's per-head q/k norm (when `weight` is not null) followed by rotary embedding, in place,
// in one pass: x [T, heads * head_dim], rotate-half layout, row t at position start_pos + t (or
// *pos_dev while a decode step is recorded). Launch: grid (heads, T), block head_dim / 2 rounded up
// to the warp size.
ATLAS_KERNEL void norm_rope(float* x, const float* weight, float eps, const float* inv_freq, int start_pos,
                            const int* pos_dev, int head_dim) {
    __shared__ float scratch[32];
    if (pos_dev) start_pos = *pos_dev;
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, heads = gridDim.x;
    float* h = x + ((long)t * heads + blockIdx.x) * head_dim;
    const float a = i < half ? h[i] : 0.0f, b = i < half ? h[i + half] : 0.0f;
    float scale = 1.0f, wa = 1.0f, wb = 1.0f;
    if (weight) {
        scale = rsqrtf(block_sum(a * a + b * b, scratch) / head_dim + eps);
        if (i < half) {
            wa = weight[i];
            wb = weight[i + half];
        }
    }
    if (i >= half) return;
    const float na = a * scale * wa, nb = b * scale * wb;
    float s, c;
    sincosf((float)(start_pos + t) * inv_freq[i], &s, &c);
    h[i] = na * c - nb * s;
    h[i + half] = nb * c + na * s;
}
