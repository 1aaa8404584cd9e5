// Causal attention with grouped key/value heads over a bf16 KV cache.
//
// kv_append: writes k, v ([T, kv_width] f32) into the caches ([capacity, kv_width] bf16) at rows
// start_pos..start_pos+T. Launch: grid (ceil(kv_width/256), T), block 256.
//
// attention_partial / attention_combine (split-K "flash decoding"): query row t (position
// start_pos + t) of head h attends to positions 0..start_pos+t. The positions are cut into
// `splits` chunks; each block takes one (head, t, chunk) and keeps an online softmax (running max,
// sum, weighted V) per warp, merges its warps, and writes (max, sum, acc[head_dim]) for the chunk.
// attention_combine merges the chunks in a fixed order. Layout: q [T, heads*head_dim] f32,
// partial [T, heads, splits, head_dim + 2] f32, out [T, heads*head_dim] f32. head_dim <= 256 and a
// multiple of the warp size. Launch: partial grid (heads, T, splits), block 128; combine grid
// (heads, T), block head_dim.
#include "common/portable.h"

ATLAS_KERNEL void kv_append(const float* k, const float* v, bf16* kc, bf16* vc, int start_pos, int width) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= width) return;
    const long dst = (long)(start_pos + t) * width + c;
    kc[dst] = f32_to_bf16(k[(long)t * width + c]);
    vc[dst] = f32_to_bf16(v[(long)t * width + c]);
}

#define MAX_DIMS_PER_LANE 8  // head_dim <= 8 * WARP_SIZE

ATLAS_KERNEL void attention_partial(const float* q, const bf16* kc, const bf16* vc, float* partial, int start_pos,
                                    int kv_heads, int head_dim, float scale, int chunk) {
    __shared__ float wm[32], wl[32];
    __shared__ float wacc[32][256];
    const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
    const int heads = gridDim.x, T = gridDim.y, splits = gridDim.z;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int kvh = h / (heads / kv_heads);
    const int width = kv_heads * head_dim;
    const int visible = start_pos + t + 1;
    const int begin = split * chunk, end = min(visible, begin + chunk);
    const int per_lane = head_dim / WARP_SIZE;

    float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
    const float* qh = q + ((long)t * heads + h) * head_dim;
    for (int i = 0; i < per_lane; i++) {
        qv[i] = qh[lane * per_lane + i] * scale;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int p = begin + warp; p < end; p += warps) {
        const bf16* kp = kc + (long)p * width + kvh * head_dim + lane * per_lane;
        float s = 0.0f;
        for (int i = 0; i < per_lane; i++) s += qv[i] * bf16_to_f32(kp[i]);
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new), e = expf(s - m_new);
        l = l * correction + e;
        const bf16* vp = vc + (long)p * width + kvh * head_dim + lane * per_lane;
        for (int i = 0; i < per_lane; i++) acc[i] = acc[i] * correction + e * bf16_to_f32(vp[i]);
        m = m_new;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
    for (int i = 0; i < per_lane; i++) wacc[warp][lane * per_lane + i] = acc[i];
    __syncthreads();
    // Merge the warps in order; thread d owns output dimension d.
    float* dst = partial + (((long)t * heads + h) * splits + split) * (head_dim + 2);
    float M = NEG_INF;
    for (int w = 0; w < warps; w++) M = fmaxf(M, wm[w]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < warps; w++)
            if (wl[w] > 0.0f) a += wacc[w][d] * expf(wm[w] - M);
        dst[2 + d] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < warps; w++)
            if (wl[w] > 0.0f) L += wl[w] * expf(wm[w] - M);
        dst[0] = M;
        dst[1] = L;
    }
    (void)T;
}

ATLAS_KERNEL void attention_combine(const float* partial, float* out, int head_dim, int splits) {
    const int h = blockIdx.x, t = blockIdx.y, heads = gridDim.x, d = threadIdx.x;
    const float* src = partial + ((long)t * heads + h) * splits * (head_dim + 2);
    float M = NEG_INF;
    for (int s = 0; s < splits; s++)
        if (src[s * (head_dim + 2) + 1] > 0.0f) M = fmaxf(M, src[s * (head_dim + 2)]);
    float L = 0.0f, a = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float* c = src + s * (head_dim + 2);
        if (c[1] > 0.0f) {
            const float f = expf(c[0] - M);
            L += c[1] * f;
            a += c[2 + d] * f;
        }
    }
    if (d < head_dim) out[((long)t * heads + h) * head_dim + d] = a / L;
}
