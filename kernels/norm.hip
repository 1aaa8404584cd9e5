// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight, over consecutive groups of `group` values
// (a whole hidden row, or one attention head for Qwen3's q/k norms).
// Layout: x, out [rows, cols] f32 row-major, cols a multiple of group; weight [group] f32.
// Launch: one block per group (grid = rows * cols / group), 256 threads (or fewer for small groups,
// a multiple of the warp size).
#include "common/portable.h"

ATLAS_KERNEL void rms_norm(const float* x, const float* weight, float* out, int group, float eps) {
    __shared__ float scratch[32];
    const float* xg = x + (long)blockIdx.x * group;
    float* og = out + (long)blockIdx.x * group;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) ss += xg[i] * xg[i];
    ss = block_sum(ss, scratch);
    const float scale = rsqrtf(ss / group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) og[i] = xg[i] * scale * weight[i];
}
