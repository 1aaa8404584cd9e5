// Causal attention with grouped key/value heads over a bf16 KV cache.
//
// kv_append: writes k, v ([T, kv_width] f32) into the caches ([capacity, kv_width] bf16) at rows
// start_pos..start_pos+T. Launch: grid (ceil(kv_width/256), T), block 256.
//
// `pos_dev`, when not null, holds start_pos on the device (recorded decode steps read it there;
// their grids cover the whole cache and chunks past the visible positions contribute nothing).
//
// attention_partial / attention_combine (split-K "flash decoding"): query row t (position
// start_pos + t) of head h attends to positions 0..start_pos+t. The positions are cut into
// `splits` chunks; each block takes one (head, t, chunk) and keeps an online softmax (running max,
// sum, weighted V) per warp, merges its warps, and writes (max, sum, acc[head_dim]) for the chunk.
// attention_combine merges the chunks in a fixed order. Layout: q [T, heads*head_dim] f32,
// partial [T, heads, splits, head_dim + 2] f32, out [T, heads*head_dim] f32. head_dim <= 256; lane
// l of a warp owns dimensions l, l + WARP_SIZE, ... Launch: partial grid (heads, T, splits), block 128; combine grid
// (heads, T), block head_dim.
#include "common/portable.h"

ATLAS_KERNEL void kv_append(const float* k, const float* v, bf16* kc, bf16* vc, int start_pos, const int* pos_dev,
                            int width) {
    if (pos_dev) start_pos = *pos_dev;
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= width) return;
    const long dst = (long)(start_pos + t) * width + c;
    kc[dst] = f32_to_bf16(k[(long)t * width + c]);
    vc[dst] = f32_to_bf16(v[(long)t * width + c]);
}

#define MAX_DIMS_PER_LANE (256 / WARP_SIZE)

ATLAS_KERNEL void attention_partial(const float* q, const bf16* kc, const bf16* vc, float* partial, int start_pos,
                                    const int* pos_dev, int kv_heads, int head_dim, float scale, int chunk) {
    if (pos_dev) start_pos = *pos_dev;
    __shared__ float wm[32], wl[32];
    __shared__ float wacc[32][256];
    const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
    const int heads = gridDim.x, splits = gridDim.z;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int kvh = h / (heads / kv_heads);
    const int width = kv_heads * head_dim;
    const int visible = start_pos + t + 1;
    const int begin = split * chunk, end = min(visible, begin + chunk);
    const int per_lane = (head_dim + WARP_SIZE - 1) / WARP_SIZE;

    float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
    const float* qh = q + ((long)t * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP_SIZE;
        qv[i] = (i < per_lane && d < head_dim) ? qh[d] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int p = begin + warp; p < end; p += warps) {
        const bf16* kp = kc + (long)p * width + kvh * head_dim;
        const bf16* vp = vc + (long)p * width + kvh * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; i++) {
            const int d = lane + i * WARP_SIZE;
            if (i < per_lane && d < head_dim) s += qv[i] * bf16_to_f32(kp[d]);
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new), e = expf(s - m_new);
        l = l * correction + e;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; i++) {
            const int d = lane + i * WARP_SIZE;
            if (i < per_lane && d < head_dim) acc[i] = acc[i] * correction + e * bf16_to_f32(vp[d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; i++) {
        const int d = lane + i * WARP_SIZE;
        if (i < per_lane && d < head_dim) wacc[warp][d] = acc[i];
    }
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

// The fast path for regular head sizes, same partial layout and combine as above. Scores are
// computed with one position per lane (each lane reads its key row with 16-byte loads), then the
// values are accumulated with the lanes spread over the dimensions, so both phases keep many loads
// in flight. head_dim a multiple of 8 and of WARP_SIZE, at most 256. Launch: grid (heads, T,
// splits), block 128.
ATLAS_KERNEL void attention_partial_wide(const float* q, const bf16* kc, const bf16* vc, float* partial, int start_pos,
                                   const int* pos_dev, int kv_heads, int head_dim, float scale, int chunk) {
    __shared__ float qs[256];
    __shared__ float wm[32], wl[32];
    __shared__ float wacc[32][256];
    if (pos_dev) start_pos = *pos_dev;
    const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, heads = gridDim.x, splits = gridDim.z;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int kvh = h / (heads / kv_heads), width = kv_heads * head_dim;
    const int visible = start_pos + t + 1;
    const int begin = split * chunk, end = min(visible, begin + chunk);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = q[((long)t * heads + h) * head_dim + d] * scale;
    __syncthreads();

    const int per_lane = head_dim / WARP_SIZE;  // value dimensions per lane (>= 1 when head_dim >= WARP_SIZE)
    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; i++) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int base = begin + warp * WARP_SIZE; base < end; base += warps * WARP_SIZE) {
        const int p = base + lane;
        float s = NEG_INF;
        if (p < end) {
            const uint4* kp = (const uint4*)(kc + (long)p * width + kvh * head_dim);
            s = 0.0f;
            // Eight 16-byte loads issued before any is used: the key row arrives in one latency.
            for (int c0 = 0; c0 < head_dim / 8; c0 += 8) {
                uint4 kw[8];
#pragma unroll
                for (int u = 0; u < 8; u++) kw[u] = c0 + u < head_dim / 8 ? kp[c0 + u] : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const uint4 w = kw[u];
                    const float* qc = qs + (c0 + u) * 8;
                    if (c0 + u < head_dim / 8)
                        s += __uint_as_float(w.x << 16) * qc[0] + __uint_as_float(w.x & 0xffff0000u) * qc[1]
                           + __uint_as_float(w.y << 16) * qc[2] + __uint_as_float(w.y & 0xffff0000u) * qc[3]
                           + __uint_as_float(w.z << 16) * qc[4] + __uint_as_float(w.z & 0xffff0000u) * qc[5]
                           + __uint_as_float(w.w << 16) * qc[6] + __uint_as_float(w.w & 0xffff0000u) * qc[7];
                }
            }
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float e = (p < end) ? expf(s - m_new) : 0.0f;
        const float correction = expf(m - m_new);
        l = l * correction + warp_sum(e);
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; i++) acc[i] *= correction;
        const int count = min(WARP_SIZE, end - base);
#pragma unroll 4
        for (int j = 0; j < count; j++) {
            const float ej = shfl(e, j);
            const bf16* vp = vc + (long)(base + j) * width + kvh * head_dim + lane * per_lane;
#pragma unroll
            for (int i = 0; i < MAX_DIMS_PER_LANE; i++)
                if (i < per_lane) acc[i] += ej * bf16_to_f32(vp[i]);
        }
        m = m_new;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; i++)
        if (i < per_lane) wacc[warp][lane * per_lane + i] = acc[i];
    __syncthreads();
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
}
