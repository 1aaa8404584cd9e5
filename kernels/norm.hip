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
    pdl_launch_dependents();
    const float* xg = x + (long)blockIdx.x * group;
    float* og = out + (long)blockIdx.x * group;
    const float scale = rsqrtf(group_sum_squares(xg, group, scratch) / group + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < group; i += blockDim.x) og[i] = xg[i] * scale * weight[i];
}

// One head held as pairs (a, b) = (x[i], x[i + head_dim/2]), thread i owning pair i: Qwen3's
// per-head RMSNorm (when `weight` is given), then the rotary embedding at `position` (rotate-half
// layout). Every thread of the block calls it (it synchronises); threads past the pairs pass zeros.
__device__ __forceinline__ void norm_rotate(float& a, float& b, const float* weight, float eps, const float* inv_freq,
                                            int position, int head_dim, float* scratch) {
    const int half = head_dim / 2, i = threadIdx.x;
    if (weight) {
        const float scale = rsqrtf(block_sum(a * a + b * b, scratch) / head_dim + eps);
        a *= scale * (i < half ? weight[i] : 0.0f);
        b *= scale * (i < half ? weight[i + half] : 0.0f);
    }
    if (i >= half) return;
    float s, c;
    sincosf((float)position * inv_freq[i], &s, &c);
    const float na = a * c - b * s, nb = b * c + a * s;
    a = na;
    b = nb;
}

// norm_rotate in place over x [T, heads * head_dim], row t at position start_pos + t (or
// *pos_dev + t while a decode step is recorded). Launch: grid (heads, T), block head_dim / 2
// rounded up to the warp size.
ATLAS_KERNEL void norm_rope(float* x, const float* weight, float eps, const float* inv_freq, int start_pos,
                            const int* pos_dev, int head_dim) {
    __shared__ float scratch[32];
    if (pos_dev) start_pos = *pos_dev;
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, heads = gridDim.x;
    float* h = x + ((long)t * heads + blockIdx.x) * head_dim;
    float a = i < half ? h[i] : 0.0f, b = i < half ? h[i + half] : 0.0f;
    norm_rotate(a, b, weight, eps, inv_freq, start_pos + t, head_dim, scratch);
    if (i < half) {
        h[i] = a;
        h[i + half] = b;
    }
}

// The start of a layer's attention in one launch: norm_rotate of every q head (in place) and k
// head, and the KV-cache append of k and v as bf16 at rows start_pos + t. q [T, heads * head_dim],
// k and v [T, kv_heads * head_dim] f32; caches [capacity, kv_heads * head_dim] bf16. Launch: grid
// (heads + 2 * kv_heads, T): q heads, then k heads, then v heads; block as norm_rope.
ATLAS_KERNEL void qkv_rope_append(float* q, const float* k, const float* v, const float* q_norm, const float* k_norm,
                                  float eps, const float* inv_freq, int start_pos, const int* pos_dev, bf16* kc,
                                  bf16* vc, int heads, int kv_heads, int head_dim) {
    __shared__ float scratch[32];
    if (pos_dev) start_pos = *pos_dev;
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, width = kv_heads * head_dim;
    int h = blockIdx.x;
    if (h < heads) {
        float* x = q + ((long)t * heads + h) * head_dim;
        float a = i < half ? x[i] : 0.0f, b = i < half ? x[i + half] : 0.0f;
        norm_rotate(a, b, q_norm, eps, inv_freq, start_pos + t, head_dim, scratch);
        if (i < half) {
            x[i] = a;
            x[i + half] = b;
        }
        return;
    }
    h -= heads;
    const bool is_key = h < kv_heads;
    if (!is_key) h -= kv_heads;
    const float* x = (is_key ? k : v) + (long)t * width + h * head_dim;
    bf16* dst = (is_key ? kc : vc) + (long)(start_pos + t) * width + h * head_dim;
    float a = i < half ? x[i] : 0.0f, b = i < half ? x[i + half] : 0.0f;
    if (is_key) norm_rotate(a, b, k_norm, eps, inv_freq, start_pos + t, head_dim, scratch);
    if (i < half) {
        dst[i] = f32_to_bf16(a);
        dst[i + half] = f32_to_bf16(b);
    }
}
