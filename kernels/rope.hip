// Rotary position embedding, "rotate half" layout (Hugging Face), of the first 2 * rot_half values
// of every head of head_dim values: the pair (x[i], x[i + rot_half]), i < rot_half, is rotated by
// angle (start_pos + t) * inv_freq[i]; the values past 2 * rot_half pass through (partial rotary,
// Qwen3.5; rot_half = head_dim / 2 rotates the whole head).
// Layout: x [T, heads * head_dim] f32, rotated in place. Launch: grid (heads, T), rot_half threads.
// `pos_dev`, when not null, holds start_pos on the device (recorded decode steps read it there).
#include "common/portable.h"

ATLAS_KERNEL void rope(float* x, const float* inv_freq, int start_pos, const int* pos_dev, int head_dim, int rot_half) {
    if (pos_dev) start_pos = *pos_dev;
    const int i = threadIdx.x, t = blockIdx.y, heads = gridDim.x;
    if (i >= rot_half) return;
    float* h = x + ((long)t * heads + blockIdx.x) * head_dim;
    const float angle = (float)(start_pos + t) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    const float a = h[i], b = h[i + rot_half];
    h[i] = a * c - b * s;
    h[i + rot_half] = b * c + a * s;
}
