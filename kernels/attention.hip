// Decode attention over the bf16 KV cache (prefill attention is in flash_attention.hip).
//
// kv_append: writes k, v ([T, kv_width] f32) into a sequence's cache (the pool's keys and values,
// its block table: common/kv_rows.h) at positions start_pos..start_pos+T. Launch: grid (ceil(kv_width/256), T), block 256. (Model layers append
// inside qkv_rope_append, norm.hip; this is the plain form.)
//
// `pos_dev`, when not null, holds the position(s) on the device (recorded decode steps read them
// there; their grids cover the whole cache and splits past the visible positions contribute nothing).
#include "common/portable.h"
#include "common/mma.h"
#include "common/kv_rows.h"

ATLAS_KERNEL void kv_append(const float* k, const float* v, bf16* kc, bf16* vc, const int* table, int start_pos,
                            const int* pos_dev, int width) {
    if (pos_dev) start_pos = *pos_dev;
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= width) return;
    const long dst = kv_offset(table, start_pos + t, width) + c;
    kc[dst] = f32_to_bf16(k[(long)t * width + c]);
    vc[dst] = f32_to_bf16(v[(long)t * width + c]);
}

// Decode: each query row t (blockIdx.z) over its own cache's positions 0..pos (common/kv_rows.h:
// one row of each of several sequences, or a few rows of one), grouped-query aware and on the
// matrix cores (common/mma.h): block (kv head, split, row) takes the G = heads / kv_heads query
// heads that share the kv head as the rows of a 16-row query tile (rows past G are zero), so every
// key and value row is read once. The visible positions are cut into at most `splits` (gridDim.y)
// chunks of a whole number of tiles and at least `min_chunk` positions, sized from `pos` on the
// device, so that a recorded step spreads long contexts over the GPU and keeps short ones in one
// split (which writes its result directly). A split's positions come in tiles of
// DEC_TILE_ELEMS / D16 rows (a multiple of 16, at most DEC_MAX_TILE) through registers into shared
// memory, the next tile's loads in flight while the current one is used. Per tile: scores
// S = Q·Kᵀ (warp w takes positions 16w..16w+15), an online softmax per query head (running max and
// sum) that writes P as bf16, then O += P·V (warp w takes the 16-wide column tiles w, w + warps,
// ...) in registers. Each split writes (max, sum, acc[head_dim]) per head to `partial`
// [rows, heads, splits, head_dim + 2]; the last split of a kv head to finish (a ticket from
// `counters` [rows, kv_heads], reset afterwards) merges them in split order into out
// [rows, heads * head_dim]. Splits past the visible positions exit at once, so a recorded step may
// cover the whole cache. A row's result depends on its query, cache, position and `min_chunk`
// only (the chunk is `min_chunk` whenever the splits cover the positions in such chunks): not on
// the other rows, so a row batched with others gets the bits it gets alone.
// Any head_dim up to 256: the tiles take D16 = head_dim rounded up to 16 columns, those past
// head_dim zero (loaded as zeros, never written out).
// Dynamic shared memory: (2 * tile + 16) * (D16 + 8) + 16 * (tile + 8) bf16, and at least
// G * splits floats (the merge's weights). Needs G <= 16.
// Launch: grid (kv_heads, splits, rows), block DEC_THREADS.
#define DEC_THREADS 256
#define DEC_MAX_TILE 64
#define DEC_TILE_ELEMS 8192
#define DEC_LOADS (DEC_TILE_ELEMS / 8 / DEC_THREADS)
// Output column tiles per warp at head_dim 256.
#define DEC_MAX_NT (256 / 16 / (DEC_THREADS / WARP_SIZE))

ATLAS_KERNEL void attention_decode(const float* q, KvRows caches, const int* pos_dev, float* partial, int* counters,
                                   float* out, int heads, int kv_heads, int head_dim, float scale, int min_chunk) {
    extern __shared__ __attribute__((aligned(16))) bf16 dec_smem[];
    __shared__ float scores[16 * DEC_MAX_TILE];
    __shared__ float run_m[16], run_l[16], corr[16];
    __shared__ int is_last;
    pdl_launch_dependents();
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y, row = blockIdx.z;
    const int D = head_dim, D16 = (D + 15) / 16 * 16, G = heads / kv_heads, width = kv_heads * D, ld = D16 + 8;
    const int pos = kv_row_pos(caches, pos_dev, row), seq = kv_row_seq(caches, row);
    const bf16* kc = caches.keys[seq];
    const bf16* vc = caches.values[seq];
    const int* table = caches.tables[seq];
    q += (long)row * heads * D;
    out += (long)row * heads * D;
    partial += (long)row * heads * splits * (D + 2);
    counters += row * kv_heads;
    const int tile = min(DEC_MAX_TILE, DEC_TILE_ELEMS / D16 / 16 * 16), ldp = tile + 8;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int visible = pos + 1;
    const int chunk = (max(min_chunk, (visible + splits - 1) / splits) + tile - 1) / tile * tile;
    const int active = (visible + chunk - 1) / chunk;
    if (split >= active) return;
    const int begin = split * chunk, end = min(visible, begin + chunk);
    bf16* ks = dec_smem;        // [tile][ld]
    bf16* vs = ks + tile * ld;  // [tile][ld]
    bf16* qs = vs + tile * ld;  // [16][ld], the scale folded in
    bf16* ps = qs + 16 * ld;    // [16][ldp]

    for (int i = tid; i < 16 * D16; i += blockDim.x) {
        const int r = i / D16, d = i % D16;
        qs[r * ld + d] = r < G && d < D ? f32_to_bf16(q[((long)kvh * G + r) * D + d] * scale) : 0;
    }
    for (int i = tid; i < 16 * ldp; i += blockDim.x) ps[i] = 0;
    if (tid < 16) {
        run_m[tid] = NEG_INF;
        run_l[tid] = 0.0f;
        corr[tid] = 1.0f;
    }
    const int row_chunks = D16 / 8, tile_chunks = tile * row_chunks, col_tiles = D16 / 16;
    float acc[DEC_MAX_NT][MMA_ACC];
#pragma unroll
    for (int j = 0; j < DEC_MAX_NT; j++)
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) acc[j][i] = 0.0f;

    // Rows past `end` load as zeros (finite, with zero probability).
    uint4 kr[DEC_LOADS], vr[DEC_LOADS];
    auto fetch = [&](int p0) {
#pragma unroll
        for (int i = 0; i < DEC_LOADS; i++) {
            const int e = tid + i * DEC_THREADS, p = p0 + e / row_chunks, c = e % row_chunks;
            const bool ok = e < tile_chunks && p < end;
            const long at = ok ? kv_offset(table, p, width) + kvh * D : 0;
            kr[i] = ok ? load8_bf16(kc + at, c * 8, D, D % 8 == 0) : make_uint4(0, 0, 0, 0);
            vr[i] = ok ? load8_bf16(vc + at, c * 8, D, D % 8 == 0) : make_uint4(0, 0, 0, 0);
        }
    };
    fetch(begin);
    for (int p0 = begin; p0 < end; p0 += tile) {
        __syncthreads();  // the previous tile, its scores and probabilities are no longer read
#pragma unroll
        for (int i = 0; i < DEC_LOADS; i++) {
            const int e = tid + i * DEC_THREADS, r = e / row_chunks, c = e % row_chunks;
            if (e < tile_chunks) {
                *(uint4*)(ks + r * ld + c * 8) = kr[i];
                *(uint4*)(vs + r * ld + c * 8) = vr[i];
            }
        }
        __syncthreads();
        if (p0 + tile < end) fetch(p0 + tile);
        const int n = min(tile, end - p0);
        for (int nt = warp; nt < tile / 16; nt += warps) {
            float s[MMA_ACC] = {};
            for (int k = 0; k < D16; k += 16) {
                mma_frag_t a, b;
                mma_load_a(a, qs + k, ld);
                mma_load_b(b, ks + nt * 16 * ld + k, ld);
                mma16_frag(s, a, b);
            }
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) scores[mma_row(i) * tile + nt * 16 + mma_col(i)] = s[i];
        }
        __syncthreads();
        for (int g = warp; g < G; g += warps) {
            const float* sg = scores + g * tile;
            float m = NEG_INF;
            for (int c = lane; c < n; c += WARP_SIZE) m = fmaxf(m, sg[c]);
            const float m_old = run_m[g], m_new = fmaxf(m_old, warp_max(m));
            float sum = 0.0f;
            for (int c = lane; c < tile; c += WARP_SIZE) {
                const float e = c < n ? expf(sg[c] - m_new) : 0.0f;
                ps[g * ldp + c] = f32_to_bf16(e);
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float c = expf(m_old - m_new);
                corr[g] = c;
                run_l[g] = run_l[g] * c + sum;
                run_m[g] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < DEC_MAX_NT; j++) {
            const int nt = warp + j * warps;
            if (nt < col_tiles) {
#pragma unroll
                for (int i = 0; i < MMA_ACC; i++) acc[j][i] *= corr[mma_row(i)];
                for (int k = 0; k < tile; k += 16) {
                    mma_frag_t a, b;
                    mma_load_a(a, ps + k, ldp);
                    mma_load_bt(b, vs + k * ld + nt * 16, ld);
                    mma16_frag(acc[j], a, b);
                }
            }
        }
    }
    __syncthreads();

    const long head0 = (long)kvh * G;
#pragma unroll
    for (int j = 0; j < DEC_MAX_NT; j++) {
        const int nt = warp + j * warps;
        if (nt < col_tiles) {
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) {
                const int g = mma_row(i), d = nt * 16 + mma_col(i);
                if (g >= G || d >= D) continue;
                if (active == 1) out[(head0 + g) * D + d] = acc[j][i] / run_l[g];  // one split: no merge
                else partial[((head0 + g) * splits + split) * (D + 2) + 2 + d] = acc[j][i];
            }
        }
    }
    if (active == 1) return;
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
    // Merge: per head, a warp turns the splits' maxima and sums into weights (kept in the tiles'
    // memory), then every output sums its splits with those weights, loads in parallel.
    float* weight = (float*)dec_smem;  // [G][active]
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
