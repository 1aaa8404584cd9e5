// Rotary position embedding, "rotate half" layout (Hugging Face): in every head of head_dim
// values, the pair (x[i], x[i + head_dim/2]) is rotated by angle (start_pos + t) * inv_freq[i].
// Layout: x [T, heads * head_dim] f32, rotated in place. Launch: grid (heads, T), head_dim/2 threads.
// `pos_dev`, when not null, holds start_pos on the device (recorded decode steps read it there).
#include "common/portable.h"

ATLAS_KERNEL void rope(float* x, const float* inv_freq, int start_pos, const int* pos_dev, int head_dim) {
    if (pos_dev) start_pos = *pos_dev;
    const int half = head_dim / 2, i = threadIdx.x, t = blockIdx.y, heads = gridDim.x;
    if (i >= half) return;
    float* h = x + ((long)t * heads + blockIdx.x) * head_dim;
    const float angle = (float)(start_pos + t) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    const float a = h[i], b = h[i + half];
    h[i] = a * c - b * s;
    h[i + half] = b * c + a * s;
}
