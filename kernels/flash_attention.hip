// Prefill attention on the matrix cores (FlashAttention-2 scheme): causal, grouped-query, over the
// bf16 KV cache.
//
//   flash_attention(q, kc, vc, table, out, start_pos, pos_dev, T, heads, kv_heads, head_dim, scale)
//   q   [T, heads*head_dim] f32 (rotary already applied); row t is the query at position start_pos + t
//       (start_pos read from *pos_dev when pos_dev is not null: a recorded decode step's one row,
//       for group sizes attention_decode does not take)
//   kc, vc, table: the KV pool and the sequence's block table (common/kv_rows.h), holding
//       positions 0 .. start_pos+T-1
//   out [T, heads*head_dim] f32, overwritten:
//       out[t, h*head_dim + d] = sum_{p <= start_pos+t} softmax_p(scale * q_t·k_p) v_p[d]
//   query head h reads kv head h / (heads / kv_heads); any head_dim up to 256.
//
// Launch: grid (ceil(T / FA_BQ), heads, 1), block FA_THREADS, dynamic shared memory 0 (static
// shared memory only, under 48 KB). One block = FA_BQ query rows of one query head. The block
// index is remapped inside the kernel (the heaviest query blocks of the causal triangle start
// first, the heads of one KV group run side by side), so any grid of that shape works.
//
// Per block: the Q tile (bf16) stays in shared memory; key/value tiles of BK positions stream
// through it up to the last position any row of the block can see. For each tile:
//   1. K tile -> shared (rows = positions, head dims contiguous, 16-byte stores)
//   2. S = Q·Kᵀ on the matrix cores (mma16), scaled, -> shared (f32); meanwhile the V tile is
//      loaded into registers
//   3. V tile -> shared transposed (rows = head dims, positions contiguous); the next K tile is
//      loaded into registers; online softmax: a few threads per query row apply the causal mask
//      (NEG_INF), take the row's running max m and sum l from shared memory, write P = exp(S - m)
//      as bf16 (over S's own row, in place) and the row's rescale factor alpha
//   4. O = alpha * O + P·V on the matrix cores; O lives in the warps' accumulators throughout
// and finally out = O / l. Three block barriers per tile (four where K and V share a buffer).
// Configurations by head size (the kernel picks one at run time, all under 48 KB):
//   head_dim <= 64   64 rows, 64-position tiles
//   head_dim <= 128  64 rows, 32-position tiles
//   head_dim <= 256  two passes of 32 rows, 32-position tiles, K and Vᵀ sharing one buffer
// A head_dim below its configuration's size is zero-padded (Q and K columns, Vᵀ rows), so the
// matrix-core loops carry no run-time bounds; padded output columns are not written.
// Accumulators are only ever addressed through mma_row / mma_col, so every fragment layout of
// common/mma.h works (and WARP_SIZE 64: a warp then takes twice the tiles).
#include "common/portable.h"
#include "common/mma.h"
#include "common/kv_rows.h"

#define FA_BQ 64
#define FA_THREADS 128
#define FA_WARPS (FA_THREADS / WARP_SIZE)

// On NVIDIA, registers for FA_MIN_BLOCKS blocks per SM (3: 168 registers a thread; shared memory
// allows 4). HIP's second launch-bounds argument means something else, so it gets none.
#define FA_MIN_BLOCKS 3
#if defined(ATLAS_HIP)
#define FA_LAUNCH_BOUNDS __attribute__((amdgpu_flat_work_group_size(1, FA_THREADS)))
#else
#define FA_LAUNCH_BOUNDS __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS)
#endif

// HDP: head_dim rounded up to the configuration's size; BQS rows per pass; BK positions per tile.
template <int HDP, int BQS, int BK, bool ALIAS>
struct fa_cfg {
    static constexpr int LDQ = HDP + 8;   // sQ row (bf16): +8 keeps mma16's fragment loads conflict-free
    static constexpr int LDK = HDP + 8;   // sK row (bf16)
    static constexpr int LDV = BK + 8;    // sVt row (bf16)
    static constexpr int LDS = BK + 4;    // sS row (f32); P (bf16) reuses each row with ld 2*LDS
    static constexpr int LDP = 2 * LDS;
    static constexpr int Q_BYTES = BQS * LDQ * 2;
    static constexpr int K_BYTES = BK * LDK * 2;
    static constexpr int V_BYTES = HDP * LDV * 2;
    static constexpr int S_BYTES = BQS * LDS * 4;
    static constexpr int KV_BYTES = ALIAS ? (K_BYTES > V_BYTES ? K_BYTES : V_BYTES) : K_BYTES + V_BYTES;
    static constexpr int OFF_K = Q_BYTES;
    static constexpr int OFF_V = ALIAS ? OFF_K : OFF_K + K_BYTES;
    static constexpr int OFF_S = OFF_K + KV_BYTES;
    static constexpr int OFF_STAT = OFF_S + S_BYTES;  // m, l, alpha: BQS floats each
    static constexpr int BYTES = OFF_STAT + 3 * BQS * 4;

    static constexpr int MT = BQS / 16;                   // query-row tiles
    static constexpr int S_TILES = MT * (BK / 16) / FA_WARPS;  // S tiles per warp
    static constexpr int O_TILES = MT * (HDP / 16) / FA_WARPS; // O tiles per warp
    static constexpr int K_VECS = BK * HDP / 8 / FA_THREADS;   // uint4 of the K (and V) tile per thread
    static constexpr int V_POS = K_VECS;                  // positions per thread in the V transpose
    static constexpr int TPR = FA_THREADS / BQS;          // threads per row in the softmax
    static constexpr int PER_T = BK / TPR;                // S columns per softmax thread

    static_assert(BQS % 16 == 0 && BK % 16 == 0 && HDP % 16 == 0, "tile sizes");
    static_assert((MT * (BK / 16)) % FA_WARPS == 0 && S_TILES >= 1, "S tiles must split evenly over warps");
    static_assert((MT * (HDP / 16)) % FA_WARPS == 0 && O_TILES >= 1, "O tiles must split evenly over warps");
    static_assert(BK * HDP / 8 % FA_THREADS == 0, "K tile must split evenly over threads");
    static_assert(FA_THREADS % (HDP / 8) == 0 && (FA_THREADS / (HDP / 8)) * V_POS == BK, "V transpose mapping");
    static_assert(V_POS == 2 || V_POS == 4 || V_POS == 8, "V transpose store width");
    static_assert(FA_THREADS % BQS == 0 && WARP_SIZE % TPR == 0 && BK % TPR == 0, "softmax mapping");
    static_assert(OFF_K % 16 == 0 && OFF_V % 16 == 0 && OFF_S % 16 == 0 && OFF_STAT % 16 == 0, "alignment");
    static_assert((LDK * 2) % 16 == 0 && (LDV * 2) % (2 * V_POS) == 0, "row alignment");
};

typedef fa_cfg<64, 64, 64, false> fa_cfg64;
typedef fa_cfg<128, 64, 32, false> fa_cfg128;
typedef fa_cfg<256, 32, 32, true> fa_cfg256;

#define FA_MAX3(a, b, c) ((a) > (b) ? ((a) > (c) ? (a) : (c)) : ((b) > (c) ? (b) : (c)))
#define FA_SMEM_BYTES FA_MAX3(fa_cfg64::BYTES, fa_cfg128::BYTES, fa_cfg256::BYTES)
static_assert(FA_SMEM_BYTES <= 48 * 1024, "flash_attention: static shared memory over 48 KB");
static_assert(FA_BQ % 32 == 0, "the head_dim 256 path runs FA_BQ / 32 passes of 32 rows");

// Loads the K (or V) tile's 16-byte pieces this thread owns: position kb + e / (HDP/8) for K
// (e = threadIdx.x + i*FA_THREADS), head dims (e % (HDP/8))*8 ..+7. For V the positions of a
// thread are consecutive: kb + (threadIdx.x / (HDP/8)) * V_POS + i, dims (threadIdx.x % (HDP/8))*8.
// Positions at or past kv_end and dims past head_dim read as zero. A tile's positions lie in one KV
// block (kb is a multiple of BK, which divides KV_BLOCK): one block-table read a tile.
template <typename C, int HDP>
__device__ __forceinline__ void fa_load_k(uint4* r, const bf16* base, const int* table, int width, int kb, int kv_end,
                                          int head_dim) {
    const bf16* tile = base + kv_offset(table, kb, width);
#pragma unroll
    for (int i = 0; i < C::K_VECS; i++) {
        const int e = threadIdx.x + i * FA_THREADS, p = e / (HDP / 8), dc = e % (HDP / 8);
        const int pos = kb + p;
        r[i] = pos < kv_end ? load8_bf16(tile + (long)p * width, dc * 8, head_dim, head_dim % 8 == 0)
                            : make_uint4(0, 0, 0, 0);
    }
}

template <typename C, int HDP>
__device__ __forceinline__ void fa_load_v(uint4* r, const bf16* base, const int* table, int width, int kb, int kv_end,
                                          int head_dim) {
    const int dc = threadIdx.x % (HDP / 8), p0 = (threadIdx.x / (HDP / 8)) * C::V_POS;
    const bf16* tile = base + kv_offset(table, kb, width);
#pragma unroll
    for (int i = 0; i < C::V_POS; i++) {
        const int pos = kb + p0 + i;
        r[i] = pos < kv_end ? load8_bf16(tile + (long)(p0 + i) * width, dc * 8, head_dim, head_dim % 8 == 0)
                            : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ unsigned fa_half(const uint4& v, int e) {
    const unsigned w = (e >> 1) == 0 ? v.x : (e >> 1) == 1 ? v.y : (e >> 1) == 2 ? v.z : v.w;
    return (e & 1) ? (w >> 16) : (w & 0xffffu);
}

// Writes the V pieces transposed: sVt[d][p] for the thread's 8 dims and V_POS positions.
template <typename C, int HDP>
__device__ __forceinline__ void fa_store_vt(bf16* sVt, const uint4* r) {
    const int dc = threadIdx.x % (HDP / 8), p0 = (threadIdx.x / (HDP / 8)) * C::V_POS;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        unsigned w[C::V_POS / 2];
#pragma unroll
        for (int j = 0; j < C::V_POS / 2; j++) w[j] = fa_half(r[2 * j], e) | (fa_half(r[2 * j + 1], e) << 16);
        bf16* dst = sVt + (dc * 8 + e) * C::LDV + p0;
        if constexpr (C::V_POS == 8) {
            *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
        } else if constexpr (C::V_POS == 4) {
            *(uint2*)dst = make_uint2(w[0], w[1]);
        } else {
            *(unsigned*)dst = w[0];
        }
    }
}

// One pass: query rows q0 .. q0+BQS-1 of head h.
template <int HDP, int BQS, int BK, bool ALIAS>
__device__ __forceinline__ void fa_pass(unsigned char* smem, const float* q, const bf16* kc, const bf16* vc, const int* table,
                                        float* out, int start_pos, int T, int heads, int kv_heads, int head_dim,
                                        float scale, int q0, int h) {
    typedef fa_cfg<HDP, BQS, BK, ALIAS> C;
    static_assert(KV_BLOCK % BK == 0, "a key tile lies in one KV block");
    bf16* sQ = (bf16*)smem;
    bf16* sK = (bf16*)(smem + C::OFF_K);
    bf16* sVt = (bf16*)(smem + C::OFF_V);
    float* sS = (float*)(smem + C::OFF_S);
    bf16* sP = (bf16*)(smem + C::OFF_S);
    float* sM = (float*)(smem + C::OFF_STAT);
    float* sL = sM + BQS;
    float* sA = sL + BQS;

    const int tid = threadIdx.x, warp = tid / WARP_SIZE;
    const int kvh = h / (heads / kv_heads), width = kv_heads * head_dim, qwidth = heads * head_dim;
    const int rows = min(BQS, T - q0);        // valid query rows of this pass (>= 1)
    const int kv_end = start_pos + q0 + rows; // positions 0 .. kv_end-1 are visible to some row
    const int ntiles = (kv_end + BK - 1) / BK;
    const int qpos0 = start_pos + q0;         // position of row 0
    const bf16* kbase = kc + (long)kvh * head_dim;
    const bf16* vbase = vc + (long)kvh * head_dim;

    __syncthreads();  // a previous pass may still be reading shared memory

    // Q tile -> bf16, rows past T zero. Running statistics reset.
    for (int e = tid; e < BQS * (HDP / 4); e += FA_THREADS) {
        const int r = e / (HDP / 4), d = (e % (HDP / 4)) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float* qrow = q + (long)(q0 + r) * qwidth + (long)h * head_dim;
        if (r < rows && head_dim % 4 == 0 && d < head_dim) {
            v = *(const float4*)(qrow + d);
        } else if (r < rows) {
            v.x = d < head_dim ? qrow[d] : 0.0f;
            v.y = d + 1 < head_dim ? qrow[d + 1] : 0.0f;
            v.z = d + 2 < head_dim ? qrow[d + 2] : 0.0f;
            v.w = d + 3 < head_dim ? qrow[d + 3] : 0.0f;
        }
        unsigned* dst = (unsigned*)(sQ + r * C::LDQ + d);
        dst[0] = (unsigned)f32_to_bf16(v.x) | ((unsigned)f32_to_bf16(v.y) << 16);
        dst[1] = (unsigned)f32_to_bf16(v.z) | ((unsigned)f32_to_bf16(v.w) << 16);
    }
    for (int r = tid; r < BQS; r += FA_THREADS) {
        sM[r] = NEG_INF;
        sL[r] = 0.0f;
    }

    float o[C::O_TILES][MMA_ACC];
#pragma unroll
    for (int j = 0; j < C::O_TILES; j++)
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) o[j][i] = 0.0f;

    // K and V travel through registers: V_j is loaded while Q·K_j runs, K_{j+1} while P·V_j runs,
    // so at most one of the two sets is in flight at a time.
    uint4 kr[C::K_VECS], vr[C::V_POS];
    fa_load_k<C, HDP>(kr, kbase, table, width, 0, kv_end, head_dim);

    for (int tile = 0; tile < ntiles; tile++) {
        const int kb = tile * BK;
        // 1. K tile -> shared.
#pragma unroll
        for (int i = 0; i < C::K_VECS; i++) {
            const int e = tid + i * FA_THREADS, p = e / (HDP / 8), dc = e % (HDP / 8);
            *(uint4*)(sK + p * C::LDK + dc * 8) = kr[i];
        }
        fa_load_v<C, HDP>(vr, vbase, table, width, kb, kv_end, head_dim);
        __syncthreads();

        // 2. S = scale * Q·Kᵀ -> sS (the mask is applied as the softmax reads it).
        {
            float s[C::S_TILES][MMA_ACC];
#pragma unroll
            for (int j = 0; j < C::S_TILES; j++)
#pragma unroll
                for (int i = 0; i < MMA_ACC; i++) s[j][i] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HDP / 16; kk++) {
#pragma unroll
                for (int j = 0; j < C::S_TILES; j++) {
                    const int idx = warp * C::S_TILES + j, mt = idx / (BK / 16), nt = idx % (BK / 16);
                    mma16(s[j], sQ + mt * 16 * C::LDQ + kk * 16, C::LDQ, sK + nt * 16 * C::LDK + kk * 16, C::LDK);
                }
            }
#pragma unroll
            for (int j = 0; j < C::S_TILES; j++) {
                const int idx = warp * C::S_TILES + j, mt = idx / (BK / 16), nt = idx % (BK / 16);
#pragma unroll
                for (int i = 0; i < MMA_ACC; i++) {
                    sS[(mt * 16 + mma_row(i)) * C::LDS + nt * 16 + mma_col(i)] = s[j][i] * scale;
                }
            }
        }
        __syncthreads();

        // 3. V tile -> shared (transposed); online softmax over the tile's S rows.
        fa_store_vt<C, HDP>(sVt, vr);
        if (tile + 1 < ntiles) fa_load_k<C, HDP>(kr, kbase, table, width, kb + BK, kv_end, head_dim);
        {
            const int r = tid / C::TPR, sub = tid % C::TPR;
            const float m_old = sM[r];
            float x[C::PER_T];
            float mx = m_old;
            // Causal mask: column c (position kb + c) is visible to row r iff kb + c <= qpos0 + r;
            // positions >= kv_end (only rows past T could see them) are masked too.
            const int last = min(qpos0 + r, kv_end - 1) - kb;  // last visible column of this row
#pragma unroll
            for (int k = 0; k < C::PER_T; k++) {
                const int c = sub + k * C::TPR;
                x[k] = c <= last ? sS[r * C::LDS + c] : NEG_INF;
                mx = fmaxf(mx, x[k]);
            }
            // The lanes of a row are adjacent in one warp. Every read of the row (S, m) feeds this
            // exchange, so no lane writes P over S before all have read it.
#pragma unroll
            for (int w = C::TPR / 2; w > 0; w >>= 1) mx = fmaxf(mx, shfl_xor(mx, w));
            const float m_use = mx == NEG_INF ? 0.0f : mx;  // a row with nothing visible yet keeps P = 0
            const float alpha = expf(m_old - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < C::PER_T; k++) {
                const float pk = expf(x[k] - m_use);  // exactly 0 where masked
                sum += pk;
                sP[r * C::LDP + sub + k * C::TPR] = f32_to_bf16(pk);
            }
#pragma unroll
            for (int w = C::TPR / 2; w > 0; w >>= 1) sum += shfl_xor(sum, w);
            if (sub == 0) {
                sM[r] = mx;
                sL[r] = sL[r] * alpha + sum;
                sA[r] = alpha;
            }
        }
        __syncthreads();

        // 4. O = alpha * O + P·V.
#pragma unroll
        for (int j = 0; j < C::O_TILES; j++) {
            const int idx = warp * C::O_TILES + j, mt = idx / (HDP / 16);
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) o[j][i] *= sA[mt * 16 + mma_row(i)];
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
#pragma unroll
            for (int j = 0; j < C::O_TILES; j++) {
                const int idx = warp * C::O_TILES + j, mt = idx / (HDP / 16), nt = idx % (HDP / 16);
                mma16(o[j], sP + mt * 16 * C::LDP + kk * 16, C::LDP, sVt + nt * 16 * C::LDV + kk * 16, C::LDV);
            }
        }
        if (ALIAS) __syncthreads();  // the next K tile overwrites Vᵀ
    }

    // out = O / l for the valid rows and dims (sL was last written before the final barrier).
#pragma unroll
    for (int j = 0; j < C::O_TILES; j++) {
        const int idx = warp * C::O_TILES + j, mt = idx / (HDP / 16), nt = idx % (HDP / 16);
        if (nt * 16 < head_dim) {
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) {
                const int r = mt * 16 + mma_row(i), c = nt * 16 + mma_col(i);
                if (r < rows && c < head_dim) out[(long)(q0 + r) * qwidth + (long)h * head_dim + c] = o[j][i] / sL[r];
            }
        }
    }
}

ATLAS_KERNEL void FA_LAUNCH_BOUNDS flash_attention(const float* q, const bf16* kc, const bf16* vc, const int* table,
                                                   float* out,
                                                   int start_pos, const int* pos_dev, int T, int heads,
                                                   int kv_heads, int head_dim, float scale) {
    __shared__ uint4 fa_smem[(FA_SMEM_BYTES + 15) / 16];
    if (pos_dev) start_pos = *pos_dev;
    unsigned char* smem = (unsigned char*)fa_smem;
    // Heaviest query blocks (the end of the causal triangle) first; the heads of one block index
    // adjacent, so the heads of a KV group read the same keys at about the same time.
    const int nqb = gridDim.x;
    const int lin = blockIdx.y * nqb + blockIdx.x;
    const int qb = nqb - 1 - lin / heads, h = lin % heads;
    const int q0 = qb * FA_BQ;
    if (q0 >= T) return;
    if (head_dim <= 64) {
        fa_pass<64, FA_BQ, 64, false>(smem, q, kc, vc, table, out, start_pos, T, heads, kv_heads, head_dim, scale, q0, h);
    } else if (head_dim <= 128) {
        fa_pass<128, FA_BQ, 32, false>(smem, q, kc, vc, table, out, start_pos, T, heads, kv_heads, head_dim, scale, q0, h);
    } else {
        for (int sub = 0; sub < FA_BQ; sub += 32)
            if (q0 + sub < T)
                fa_pass<256, 32, 32, true>(smem, q, kc, vc, table, out, start_pos, T, heads, kv_heads, head_dim, scale,
                                           q0 + sub, h);
    }
}
