// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight, over consecutive groups of `group` values
// (a whole hidden row, or one attention head for Qwen3's q/k norms).
// Layout: x, out [rows, cols] f32 row-major, cols a multiple of group; weight [group] f32.
// Launch: one block per group (grid = rows * cols / group); block: a multiple of the warp size,
// ideally group / 4 threads (one float4 each) up to 1024.
#include "common/portable.h"
#include "common/kv_rows.h"

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

// Gated RMSNorm (Qwen3.5's Gated DeltaNet output, one value head per group):
// out = x / sqrt(mean(x^2) + eps) * weight * silu(z). x, z, out [rows, cols] f32, cols a multiple of
// group; weight [group]. Launch: as rms_norm.
ATLAS_KERNEL void gated_rms_norm(const float* x, const float* z, const float* weight, float* out, int group, float eps) {
    __shared__ float scratch[32];
    const long base = (long)blockIdx.x * group;
    const float scale = rsqrtf(group_sum_squares(x + base, group, scratch) / group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float g = z[base + i];
        out[base + i] = x[base + i] * scale * weight[i] * (g / (1.0f + expf(-g)));
    }
}

// One head held as pairs (a, b) = (x[i], x[i + head_dim/2]), thread i owning pair i: Qwen3's
// per-head RMSNorm (when `weight` is given), then the rotary embedding at `position` (rotate-half
// layout) of the head's first 2 * rot_half values: the pairs (x[j], x[j + rot_half]), j < rot_half.
// Full rotary (rot_half = head_dim / 2): those are the threads' own pairs. Partial rotary
// (Qwen3.5): the head goes through `head_smem` (head_dim floats of dynamic shared memory) and the
// values past 2 * rot_half pass through. Every thread of the block calls it (it synchronises);
// threads past the pairs pass zeros.
__device__ __forceinline__ void norm_rotate(float& a, float& b, const float* weight, float eps, const float* inv_freq,
                                            int position, int head_dim, int rot_half, float* scratch,
                                            float* head_smem) {
    const int half = head_dim / 2, i = threadIdx.x;
    if (weight) {
        const float scale = rsqrtf(block_sum(a * a + b * b, scratch) / head_dim + eps);
        a *= scale * (i < half ? weight[i] : 0.0f);
        b *= scale * (i < half ? weight[i + half] : 0.0f);
    }
    if (rot_half == half) {
        if (i >= half) return;
        float s, c;
        sincosf((float)position * inv_freq[i], &s, &c);
        const float na = a * c - b * s, nb = b * c + a * s;
        a = na;
        b = nb;
        return;
    }
    if (i < half) {
        head_smem[i] = a;
        head_smem[i + half] = b;
    }
    __syncthreads();
    if (i < rot_half) {
        float s, c;
        sincosf((float)position * inv_freq[i], &s, &c);
        const float u = head_smem[i], v = head_smem[i + rot_half];
        head_smem[i] = u * c - v * s;
        head_smem[i + rot_half] = v * c + u * s;
    }
    __syncthreads();
    if (i < half) {
        a = head_smem[i];
        b = head_smem[i + half];
    }
}

// norm_rotate in place over x [T, heads * head_dim], row t at position start_pos + t (or
// *pos_dev + t while a decode step is recorded). Launch: grid (heads, T), block head_dim / 2
// rounded up to the warp size; dynamic shared memory head_dim floats for partial rotary, else none.
ATLAS_KERNEL void norm_rope(float* x, const float* weight, float eps, const float* inv_freq, int start_pos,
                            const int* pos_dev, int head_dim, int rot_half) {
    __shared__ float scratch[32];
    extern __shared__ float norm_rope_head[];
    if (pos_dev) start_pos = *pos_dev;
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, heads = gridDim.x;
    float* h = x + ((long)t * heads + blockIdx.x) * head_dim;
    float a = i < half ? h[i] : 0.0f, b = i < half ? h[i + half] : 0.0f;
    norm_rotate(a, b, weight, eps, inv_freq, start_pos + t, head_dim, rot_half, scratch, norm_rope_head);
    if (i < half) {
        h[i] = a;
        h[i + half] = b;
    }
}

// The start of a layer's attention in one launch: norm_rotate of every q head (in place) and k
// head, and the KV-cache append of k and v as bf16, each row t into its sequence's cache at its
// position (common/kv_rows.h). q [T, heads * head_dim], k and v [T, kv_heads * head_dim] f32.
// Launch: grid (heads + 2 * kv_heads, T): q heads, then k heads, then v heads; block and dynamic
// shared memory as norm_rope.
ATLAS_KERNEL void qkv_rope_append(float* q, const float* k, const float* v, const float* q_norm, const float* k_norm,
                                  float eps, const float* inv_freq, KvRows caches, const int* pos_dev, int heads,
                                  int kv_heads, int head_dim, int rot_half) {
    __shared__ float scratch[32];
    extern __shared__ float qkv_rope_head[];
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, width = kv_heads * head_dim;
    const int pos = kv_row_pos(caches, pos_dev, t), seq = kv_row_seq(caches, t);
    int h = blockIdx.x;
    if (h < heads) {
        float* x = q + ((long)t * heads + h) * head_dim;
        float a = i < half ? x[i] : 0.0f, b = i < half ? x[i + half] : 0.0f;
        norm_rotate(a, b, q_norm, eps, inv_freq, pos, head_dim, rot_half, scratch, qkv_rope_head);
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
    bf16* dst = (is_key ? caches.keys[seq] : caches.values[seq]) + kv_offset(caches.tables[seq], pos, width) + h * head_dim;
    float a = i < half ? x[i] : 0.0f, b = i < half ? x[i + half] : 0.0f;
    if (is_key) norm_rotate(a, b, k_norm, eps, inv_freq, pos, head_dim, rot_half, scratch, qkv_rope_head);
    if (i < half) {
        dst[i] = f32_to_bf16(a);
        dst[i + half] = f32_to_bf16(b);
    }
}
