// Decode attention over the bf16 KV cache (prefill attention is in flash_attention.hip).
//
// kv_append: writes k, v ([T, kv_width] f32) into the caches ([capacity, kv_width] bf16) at rows
// start_pos..start_pos+T. Launch: grid (ceil(kv_width/256), T), block 256. (Model layers append
// inside qkv_rope_append, norm.hip; this is the plain form.)
//
// `pos_dev`, when not null, holds start_pos on the device (recorded decode steps read it there;
// their grids cover the whole cache and splits past the visible positions contribute nothing).
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

// Decode (one query row at position `pos`, over positions 0..pos), grouped-query aware: block
// (kv head, split) takes the G = heads / kv_heads query heads that share the kv head, so every key
// and value row is read once. The visible positions are cut into at most `splits` (gridDim.y)
// chunks of a whole number of tiles and at least `min_chunk` positions, sized from `pos` on the
// device, so that a recorded step spreads long contexts over the GPU and keeps short ones in one
// split (which writes its result directly). A split's positions come through shared memory in tiles of
// DEC_TILE rows, the next tile's loads in flight while the current one is used;
// an online softmax per query head (running max and sum) keeps the weighted values in registers.
// Each split writes (max, sum, acc[head_dim]) per head to `partial` [heads, splits, head_dim + 2];
// the last split of a kv head to finish (a ticket from `counters`, reset afterwards) merges them in
// split order into out [heads * head_dim]. Splits past the visible positions exit at once, so a
// recorded step may cover the whole cache. Needs head_dim % 8 == 0, head_dim <= 256,
// G * head_dim <= DEC_MAX_QD, G <= 16. Launch: grid (kv_heads, splits), block DEC_THREADS.
#define DEC_TILE 32
#define DEC_THREADS 256
#define DEC_MAX_QD 2048
#define DEC_LOADS (DEC_TILE * 256 / 8 / DEC_THREADS)

ATLAS_KERNEL void attention_decode(const float* q, const bf16* kc, const bf16* vc, float* partial, int* counters,
                                   float* out, int pos, const int* pos_dev, int heads, int kv_heads, int head_dim,
                                   float scale, int min_chunk) {
    __shared__ float qs[DEC_MAX_QD];
    __shared__ __attribute__((aligned(16))) bf16 ks[DEC_TILE * (256 + 8)];
    __shared__ __attribute__((aligned(16))) bf16 vs[DEC_TILE * 256];
    __shared__ float pe[16 * DEC_TILE];
    __shared__ float run_m[16], run_l[16], corr[16];
    __shared__ int is_last;
    pdl_launch_dependents();
    if (pos_dev) pos = *pos_dev;
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int D = head_dim, G = heads / kv_heads, width = kv_heads * D, ldk = D + 8;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int visible = pos + 1;
    const int chunk = max(min_chunk, ((visible + splits - 1) / splits + DEC_TILE - 1) / DEC_TILE * DEC_TILE);
    const int active = (visible + chunk - 1) / chunk;
    if (split >= active) return;
    const int begin = split * chunk, end = min(visible, begin + chunk);

    for (int i = tid; i < G * D; i += blockDim.x) qs[i] = q[(long)kvh * G * D + i] * scale;
    if (tid < G) {
        run_m[tid] = NEG_INF;
        run_l[tid] = 0.0f;
    }
    const int row_chunks = D / 8, tile_chunks = DEC_TILE * row_chunks, pairs = G * D / 2;
    float acc[DEC_MAX_QD / 2 / DEC_THREADS][2];
#pragma unroll
    for (int j = 0; j < DEC_MAX_QD / 2 / DEC_THREADS; j++) acc[j][0] = acc[j][1] = 0.0f;

    uint4 kr[DEC_LOADS], vr[DEC_LOADS];
#pragma unroll
    for (int i = 0; i < DEC_LOADS; i++) {
        const int e = tid + i * DEC_THREADS, p = begin + e / row_chunks, c = e % row_chunks;
        const bool ok = e < tile_chunks && p < end;
        const long at = (long)p * width + kvh * D;
        kr[i] = ok ? ((const uint4*)(kc + at))[c] : make_uint4(0, 0, 0, 0);
        vr[i] = ok ? ((const uint4*)(vc + at))[c] : make_uint4(0, 0, 0, 0);
    }
    for (int p0 = begin; p0 < end; p0 += DEC_TILE) {
        __syncthreads();  // the previous tile is no longer read
#pragma unroll
        for (int i = 0; i < DEC_LOADS; i++) {
            const int e = tid + i * DEC_THREADS, r = e / row_chunks, c = e % row_chunks;
            if (e < tile_chunks) {
                *(uint4*)(ks + r * ldk + c * 8) = kr[i];
                *(uint4*)(vs + r * D + c * 8) = vr[i];
            }
        }
        __syncthreads();
        if (p0 + DEC_TILE < end) {
#pragma unroll
            for (int i = 0; i < DEC_LOADS; i++) {
                const int e = tid + i * DEC_THREADS, p = p0 + DEC_TILE + e / row_chunks, c = e % row_chunks;
                const bool ok = e < tile_chunks && p < end;
                const long at = (long)p * width + kvh * D;
                kr[i] = ok ? ((const uint4*)(kc + at))[c] : make_uint4(0, 0, 0, 0);
                vr[i] = ok ? ((const uint4*)(vc + at))[c] : make_uint4(0, 0, 0, 0);
            }
        }
        const int n = min(DEC_TILE, end - p0);
        // Scores: a warp per query head, a lane per position.
        for (int g = warp; g < G; g += warps) {
            float s = NEG_INF;
            if (lane < n) {
                const uint4* kp = (const uint4*)(ks + lane * ldk);
                const float* qg = qs + g * D;
                // Four independent sums: the dot product is a chain of FMAs otherwise.
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
                for (int c = 0; c < row_chunks; c++) {
                    const uint4 w = kp[c];
                    const float* qc = qg + c * 8;
                    part[c % 4] += __uint_as_float(w.x << 16) * qc[0] + __uint_as_float(w.x & 0xffff0000u) * qc[1]
                                 + __uint_as_float(w.y << 16) * qc[2] + __uint_as_float(w.y & 0xffff0000u) * qc[3]
                                 + __uint_as_float(w.z << 16) * qc[4] + __uint_as_float(w.z & 0xffff0000u) * qc[5]
                                 + __uint_as_float(w.w << 16) * qc[6] + __uint_as_float(w.w & 0xffff0000u) * qc[7];
                }
                s = (part[0] + part[1]) + (part[2] + part[3]);
            }
            const float m_old = run_m[g];
            const float m_new = fmaxf(m_old, warp_max(s));
            const float e = lane < n ? expf(s - m_new) : 0.0f;
            const float sum = warp_sum(e);
            if (lane < DEC_TILE) pe[g * DEC_TILE + lane] = e;
            if (lane == 0) {
                const float c = expf(m_old - m_new);
                corr[g] = c;
                run_l[g] = run_l[g] * c + sum;
                run_m[g] = m_new;
            }
        }
        __syncthreads();
        // Values: a thread per (head, pair of dimensions).
#pragma unroll
        for (int j = 0; j < DEC_MAX_QD / 2 / DEC_THREADS; j++) {
            const int idx = tid + j * DEC_THREADS;
            if (idx < pairs) {
                const int g = idx / (D / 2), d2 = idx % (D / 2);
                const float* pg = pe + g * DEC_TILE;
                // Rows past n hold zero probabilities (and finite values), so the loop runs whole
                // tiles with two independent sums per output.
                float a[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll 8
                for (int p = 0; p < DEC_TILE; p++) {
                    const unsigned int v = ((const unsigned int*)(vs + p * D))[d2];
                    a[p % 2][0] += pg[p] * __uint_as_float(v << 16);
                    a[p % 2][1] += pg[p] * __uint_as_float(v & 0xffff0000u);
                }
                const float c = corr[g];
                acc[j][0] = acc[j][0] * c + (a[0][0] + a[1][0]);
                acc[j][1] = acc[j][1] * c + (a[0][1] + a[1][1]);
            }
        }
    }
    __syncthreads();

    const long head0 = (long)kvh * G;
    if (active == 1) {
        // A short context fits one split: no partials to merge.
#pragma unroll
        for (int j = 0; j < DEC_MAX_QD / 2 / DEC_THREADS; j++) {
            const int idx = tid + j * DEC_THREADS;
            if (idx < pairs) {
                const int g = idx / (D / 2), d2 = idx % (D / 2);
                float* dst = out + (head0 + g) * D + 2 * d2;
                dst[0] = acc[j][0] / run_l[g];
                dst[1] = acc[j][1] / run_l[g];
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < DEC_MAX_QD / 2 / DEC_THREADS; j++) {
        const int idx = tid + j * DEC_THREADS;
        if (idx < pairs) {
            const int g = idx / (D / 2), d2 = idx % (D / 2);
            float* dst = partial + ((head0 + g) * splits + split) * (D + 2);
            dst[2 + 2 * d2] = acc[j][0];
            dst[3 + 2 * d2] = acc[j][1];
        }
    }
    if (tid < G) {
        float* dst = partial + ((head0 + tid) * splits + split) * (D + 2);
        dst[0] = run_m[tid];
        dst[1] = run_l[tid];
    }
    // Publish the partial, then take a ticket: the last split of this kv head merges.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(&counters[kvh], 1) == active - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Merge: per head, a warp turns the splits' maxima and sums into weights (kept in the key
    // tile's memory), then every output sums its splits with those weights, loads in parallel.
    float* weight = (float*)ks;  // [G][active]: G * active <= 16 * 128 floats
    for (int g = warp; g < G; g += warps) {
        const volatile float* src = partial + (head0 + g) * splits * (D + 2);
        float M = NEG_INF;
        for (int s = lane; s < active; s += WARP_SIZE) M = fmaxf(M, src[s * (D + 2)]);
        M = warp_max(M);
        float L = 0.0f;
        for (int s = lane; s < active; s += WARP_SIZE) {
            const float f = expf(src[s * (D + 2)] - M);
            weight[g * active + s] = f;
            L += src[s * (D + 2) + 1] * f;
        }
        L = warp_sum(L);
        if (lane == 0) run_l[g] = L;
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        const volatile float* src = partial + (head0 + g) * splits * (D + 2) + 2 + d;
        const float* wg = weight + g * active;
        float a = 0.0f;
#pragma unroll 8
        for (int s = 0; s < active; s++) a += src[s * (D + 2)] * wg[s];
        out[(head0 + g) * D + d] = a / run_l[g];
    }
    if (tid == 0) counters[kvh] = 0;
}
