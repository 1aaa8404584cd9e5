// Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers): the causal convolution with state and
// the gated delta rule, recurrent (decode, as the CPU reference computes it: src/backend/cpu/mod.rs;
// the maths in tests/fixtures/HYBRID_NOTES.md §3.3) and chunked (prefill). The gated RMSNorm is in
// norm.hip, the sigmoid gate in elementwise.hip.
#include "common/mma.h"
#include "common/portable.h"

// conv1d_silu: causal depthwise convolution over time, then SiLU, continuing from a state.
// x, out [T, C] f32; weight [C, K] (channel-major, oldest tap first, the last tap on the current
// token); state [K-1, C] (the previous K-1 inputs, oldest first). With the window = the state's
// rows, then x's rows: out[t, c] = silu(Σ_j weight[c, j] · window[t + j, c]), and the state becomes
// the window's last K-1 rows.
// A thread takes one channel over a chunk of CONV_CHUNK tokens, its K-1 previous inputs sliding
// through registers. Only the thread of chunk 0 reads the old state (later chunks start past it,
// as CONV_CHUNK >= K-1, and take their previous inputs from x), and it alone then writes the new
// state of its channel: no other thread touches that channel's state. Needs 1 <= K <= CONV_MAX_K.
// Launch: grid (ceil(C / 256), ceil(T / CONV_CHUNK)), block 256. Decode (T = 1): a thread per channel.
//
// The _rows kernels (conv1d_silu_rows, gated_delta_rule_rows) are the decode step of several
// sequences at once: row r of the inputs and output is one token of sequence r, whose states are
// states.conv[r] and states.delta[r] (at most DN_SEQS rows a launch; grid z = the rows). Each row
// runs the code of a single sequence's launch, so it gets the bits it gets alone.
#define CONV_MAX_K 8
#define CONV_CHUNK 64
#define DN_SEQS 8

// The recurrent states of the sequences of a batched decode step, passed by value
// (src/backend/gpu/runtime.rs lays out the same struct).
struct DnStates {
    float* conv[DN_SEQS];   // [K-1, C] each
    float* delta[DN_SEQS];  // [Hv, dk, dv] each
};

// Channel c over the chunk `chunk` of the tokens.
__device__ __forceinline__ void conv1d_silu_channel(const float* x, const float* weight, float* state, float* out,
                                                    int T, int C, int K, int c, int chunk) {
    if (c >= C) return;
    const int t0 = chunk * CONV_CHUNK, t1 = min(T, t0 + CONV_CHUNK);
    // Window row r is state row r for r < K-1, else x row r - (K-1).
    float taps[CONV_MAX_K], win[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; j++) {
        const int r = t0 + j;
        taps[j] = j < K - 1 ? weight[(long)c * K + j] : 0.0f;
        win[j] = j >= K - 1 ? 0.0f : r < K - 1 ? state[(long)r * C + c] : x[(long)(r - (K - 1)) * C + c];
    }
    const float last_tap = weight[(long)c * K + K - 1];
    for (int t = t0; t < t1; t++) {
        const float xt = x[(long)t * C + c];
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K - 1; j++)
            if (j < K - 1) sum += taps[j] * win[j];
        sum += last_tap * xt;
        out[(long)t * C + c] = sum / (1.0f + expf(-sum));
        // Slide: the oldest input leaves, this token's enters at K-2.
#pragma unroll
        for (int j = 0; j < CONV_MAX_K - 1; j++) win[j] = j + 1 < K - 1 ? win[j + 1] : j + 1 == K - 1 ? xt : 0.0f;
    }
    if (chunk != 0) return;
    // New state row r = window row T + r: the old state row T + r while that is below K-1 (only when
    // T < K-1; rows are written in increasing order and T + r > r, so it is read before it is
    // overwritten), else x row T + r - (K-1).
    for (int r = 0; r < K - 1; r++) {
        const int w = T + r;
        state[(long)r * C + c] = w < K - 1 ? state[(long)w * C + c] : x[(long)(w - (K - 1)) * C + c];
    }
}

ATLAS_KERNEL void conv1d_silu(const float* x, const float* weight, float* state, float* out, int T, int C, int K) {
    conv1d_silu_channel(x, weight, state, out, T, C, K, blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y);
}

// x, out [rows, C]. Launch: grid (ceil(C / 256), 1, rows), block 256.
ATLAS_KERNEL void conv1d_silu_rows(const float* x, const float* weight, DnStates states, float* out, int C, int K) {
    const long row = (long)blockIdx.z * C;
    conv1d_silu_channel(x + row, weight, states.conv[blockIdx.z], out + row, 1, C, K, blockIdx.x * blockDim.x + threadIdx.x, 0);
}

// gated_delta_rule: the recurrent form, token by token (decode, and prefill correctly if slowly).
// qkv [T, 2·Hk·dk + Hv·dv] = q | k | v (each head-major), a and b [T, Hv], a_log and dt_bias [Hv],
// state [Hv, dk, dv] f32 (S of value head h, row i = key dimension i; updated in place), out
// [T, Hv·dv]. Value head h uses key head h / (Hv / Hk). Per token: q and k L2-normalised
// (x / sqrt(Σx² + 1e-6)), q scaled by dk^-1/2, β = sigmoid(b), decay = exp(−exp(A_log) ·
// softplus(a + dt_bias)) (softplus linear above 20); S ← decay·S; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq.
// Columns of S are independent given q and k: block (h, y) takes DN_COLS columns j of value head
// h, DN_SPLIT consecutive threads per column, thread p of a column holding its rows i = p, p +
// DN_SPLIT, ... (at most DN_ROWS) in registers for the whole call; the column's dot products are
// summed over its DN_SPLIT threads by shuffles (within a warp). Each token's raw q and k (and their
// sums of squares per warp) go through shared memory, double-buffered by token parity so one
// barrier per token suffices (a buffer is written again two tokens later, after the next barrier,
// when every thread has finished reading it); the next token's inputs are loaded into registers
// while this one is used. Needs dk <= DN_MAX_DK; dv is any size.
// Launch: grid (Hv, ceil(dv / DN_COLS)), block DN_THREADS.
#define DN_THREADS 128
#define DN_SPLIT 8
#define DN_COLS (DN_THREADS / DN_SPLIT)
#define DN_MAX_DK 256
#define DN_ROWS (DN_MAX_DK / DN_SPLIT)
#define DN_LOADS (DN_MAX_DK / DN_THREADS)
#define DN_MAX_WARPS (DN_THREADS / 32)

// log(decay) of a token: −exp(A_log) · softplus(a + dt_bias), softplus linear above 20. `rate` is
// −exp(A_log), `g_in` is a + dt_bias.
__device__ __forceinline__ float dn_log_decay(float rate, float g_in) {
    return rate * (g_in > 20.0f ? g_in : log1pf(expf(g_in)));
}

// Sum over the DN_SPLIT consecutive threads of one column (aligned groups inside a warp).
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
    for (int m = 1; m < DN_SPLIT; m <<= 1) v += shfl_xor(v, m);
    return v;
}

// Value head h, columns col_block * DN_COLS ..+DN_COLS.
__device__ __forceinline__ void gated_delta_rule_cols(const float* qkv, const float* a, const float* b, const float* a_log,
                                                      const float* dt_bias, float* state, float* out, int T,
                                                      int key_heads, int value_heads, int dk, int dv, int h, int col_block) {
    __shared__ float raw[2][2][DN_MAX_DK];        // [token parity][q, k][dk]
    __shared__ float squares[2][2][DN_MAX_WARPS];  // [token parity][q, k][warp]
    const int tid = threadIdx.x, part = tid % DN_SPLIT;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int j = col_block * DN_COLS + tid / DN_SPLIT;
    const bool has_col = j < dv;
    const int kh = h / (value_heads / key_heads);
    const long width = 2L * key_heads * dk + (long)value_heads * dv;
    const long q_at = (long)kh * dk, k_at = (long)key_heads * dk + q_at, v_at = 2L * key_heads * dk + (long)h * dv + j;

    float* S = state + (long)h * dk * dv;
    float s[DN_ROWS];
#pragma unroll
    for (int m = 0; m < DN_ROWS; m++) {
        const int i = part + m * DN_SPLIT;
        s[m] = has_col && i < dk ? S[(long)i * dv + j] : 0.0f;
    }
    const float q_scale = 1.0f / sqrtf((float)dk);
    const float rate = -expf(a_log[h]), bias = dt_bias[h];

    // A token's inputs as this thread loads them: q and k values tid, tid + DN_THREADS, ...; its v.
    float nq[DN_LOADS], nk[DN_LOADS], nv = 0.0f, na = 0.0f, nb = 0.0f;
    auto fetch = [&](int t) {
        const float* row = qkv + (long)t * width;
#pragma unroll
        for (int u = 0; u < DN_LOADS; u++) {
            const int e = tid + u * DN_THREADS;
            nq[u] = e < dk ? row[q_at + e] : 0.0f;
            nk[u] = e < dk ? row[k_at + e] : 0.0f;
        }
        nv = has_col ? row[v_at] : 0.0f;
        na = a[(long)t * value_heads + h];
        nb = b[(long)t * value_heads + h];
    };
    if (T > 0) fetch(0);
    for (int t = 0; t < T; t++) {
        const int p = t & 1;
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int u = 0; u < DN_LOADS; u++) {
            const int e = tid + u * DN_THREADS;
            if (e < dk) {
                raw[p][0][e] = nq[u];
                raw[p][1][e] = nk[u];
            }
            sq += nq[u] * nq[u];
            sk += nk[u] * nk[u];
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            squares[p][0][warp] = sq;
            squares[p][1][warp] = sk;
        }
        const float v = nv, a_t = na, b_t = nb;
        if (t + 1 < T) fetch(t + 1);
        __syncthreads();

        sq = 0.0f;
        sk = 0.0f;
        for (int w = 0; w < warps; w++) {
            sq += squares[p][0][w];
            sk += squares[p][1][w];
        }
        const float inv_q = 1.0f / sqrtf(sq + 1e-6f), inv_k = 1.0f / sqrtf(sk + 1e-6f);
        const float beta = 1.0f / (1.0f + expf(-b_t));
        const float decay = expf(dn_log_decay(rate, a_t + bias));
        const float* qs = raw[p][0];
        const float* ks = raw[p][1];

        // S ← decay·S, then what S recalls for k: Sᵀk.
        float recalled = 0.0f;
#pragma unroll
        for (int m = 0; m < DN_ROWS; m++) {
            const int i = part + m * DN_SPLIT;
            if (i < dk) {
                s[m] *= decay;
                recalled += ks[i] * inv_k * s[m];
            }
        }
        recalled = column_sum(recalled);
        // S ← S + k ⊗ β(v − Sᵀk), then o = Sᵀq.
        const float delta = v - recalled;
        float o = 0.0f;
#pragma unroll
        for (int m = 0; m < DN_ROWS; m++) {
            const int i = part + m * DN_SPLIT;
            if (i < dk) {
                s[m] += ks[i] * inv_k * beta * delta;
                o += qs[i] * inv_q * q_scale * s[m];
            }
        }
        o = column_sum(o);
        if (has_col && part == 0) out[((long)t * value_heads + h) * dv + j] = o;
    }
#pragma unroll
    for (int m = 0; m < DN_ROWS; m++) {
        const int i = part + m * DN_SPLIT;
        if (has_col && i < dk) S[(long)i * dv + j] = s[m];
    }
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DN_THREADS, 4)
    gated_delta_rule(const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
                     float* state, float* out, int T, int key_heads, int value_heads, int dk, int dv) {
    gated_delta_rule_cols(qkv, a, b, a_log, dt_bias, state, out, T, key_heads, value_heads, dk, dv, blockIdx.x, blockIdx.y);
}

// qkv [rows, 2·Hk·dk + Hv·dv], a and b [rows, Hv], out [rows, Hv·dv].
// Launch: grid (Hv, ceil(dv / DN_COLS), rows), block DN_THREADS.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DN_THREADS, 4)
    gated_delta_rule_rows(const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
                          DnStates states, float* out, int key_heads, int value_heads, int dk, int dv) {
    const int r = blockIdx.z;
    const long width = 2L * key_heads * dk + (long)value_heads * dv;
    gated_delta_rule_cols(qkv + r * width, a + (long)r * value_heads, b + (long)r * value_heads, a_log, dt_bias,
                          states.delta[r], out + (long)r * value_heads * dv, 1, key_heads, value_heads, dk, dv,
                          blockIdx.x, blockIdx.y);
}

// ---- The chunked form (prefill): the same rule over chunks of DC_CHUNK tokens, the work inside a
// chunk as small matrix products that do not wait on each other token by token.
// Within a chunk of L tokens, per value head, with k̂ and q̂ normalised (q̂ scaled by dk^-1/2), β_t,
// γ_t = Σ_{s≤t} log decay_s (from the chunk's start), Γ_t = exp(γ_t), S₀ the state before it:
//   A[t][s] = β_t · exp(γ_t − γ_s) · k̂_t·k̂_s for s < t (0 elsewhere), T = (I + A)⁻¹ (unit lower),
//   W = T · diag(β Γ) · K̂ [L, dk],   Ũ = T · diag(β) · V [L, dv],
//   U = Ũ − W · S₀ (the β-scaled deltas every token writes: u_t = β_t (v_t − S_{t−1}'ᵀ k̂_t)),
//   o_t = Γ_t · S₀ᵀ q̂_t + Σ_{s≤t} exp(γ_t − γ_s) (q̂_t·k̂_s) u_s,
//   S_L = Γ_L · S₀ + Σ_s exp(γ_L − γ_s) k̂_s u_sᵀ.
// Every exp above is of a non-positive number. delta_chunk_prep computes what does not depend on
// the state (every chunk at once); delta_chunk_state then walks the chunks in order per head with
// the state, and delta_chunk_out gives every chunk's outputs at once. All take a slice of the
// sequence (T tokens); their scratch is laid out per slice: qn, kn [Hk, T, dk]; w [Hv, T, dk];
// u [Hv, T, dv]; p [Hv, ceil(T / DC_CHUNK), DC_CHUNK, DC_CHUNK] (P[t][s] = exp(γ_t − γ_s) q̂_t·k̂_s
// for s ≤ t); gam [Hv, T] (γ); hs [Hv, ceil(T / DC_CHUNK), dk, dv]. Needs dk <= DC_MAX_DK.
#define DC_CHUNK 64
#define DC_THREADS 256
#define DC_MAX_DK 128
#define DC_COLS 32
// Row strides of prep's M and of the solve's X blocks: 4 more than a row (rows 4 banks apart),
// so a transposed fragment's 32 reads hit 32 banks and a row-major one's at most two a bank.
#define DC_MP (DC_CHUNK + 4)
#define DC_XS (16 + 4)
#define DC_SS (DC_COLS + 4)
#define DC_WARPS (DC_THREADS / WARP_SIZE)
// 16×16 tiles of a chunk's [DC_CHUNK, DC_COLS] outputs (W·S, o) and of a [DC_CHUNK, DC_CHUNK]
// product (the Gram matrices, a 64-column piece of W or Ũ), and how many a warp takes.
#define DC_OUT_TILES (DC_CHUNK / 16 * DC_COLS / 16)
#define DC_WARP_TILES ((DC_OUT_TILES + DC_WARPS - 1) / DC_WARPS)
#define DC_SQ_TILES (DC_CHUNK / 16 * DC_CHUNK / 16)
#define DC_WARP_SQ_TILES ((DC_SQ_TILES + DC_WARPS - 1) / DC_WARPS)
// Values of a q or k row each lane of delta_chunk_prep holds.
#define DC_LANE_VALUES ((DC_MAX_DK + WARP_SIZE - 1) / WARP_SIZE)

// delta_chunk_prep: one block per (value head, chunk); the Gram matrices and the triangular
// products and the triangular solve's off-diagonal blocks on the matrix cores (common/mma.h's split
// products). Dynamic shared memory, in floats: DC_CHUNK·ks (ks = max(dk16, DC_CHUNK) + 4: k̂
// (zero past dk), then 64 columns of V · β at a time) + DC_CHUNK·DC_MP (q̂ staged 64 columns at a
// time, then A, then T in place) + 4·DC_CHUNK (β, γ, βΓ, q's scale) + (DC_CHUNK / 16 − 1)·16·DC_XS
// (the triangular solve's blocks). Only the first value head of each key head writes qn and kn.
// Launch: grid (Hv, ceil(T / DC_CHUNK)), block DC_THREADS.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DC_THREADS, 3)
    delta_chunk_prep(const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
                     float* qn, float* kn, float* w, float* u, float* p, float* gam, int T, int key_heads,
                     int value_heads, int dk, int dv) {
    extern __shared__ __attribute__((aligned(16))) float dc_smem[];
    const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x;
    const int t0 = chunk * DC_CHUNK, L = min(DC_CHUNK, T - t0);
    const int ratio = value_heads / key_heads, kh = h / ratio;
    const bool owner = h % ratio == 0;
    const int dk16 = (dk + 15) / 16 * 16, ks = max(dk16, DC_CHUNK) + 4;
    float* kS = dc_smem;
    float* M = kS + DC_CHUNK * ks;
    float* beta = M + DC_CHUNK * DC_MP;
    float* gm = beta + DC_CHUNK;
    float* bgam = gm + DC_CHUNK;
    float* invq = bgam + DC_CHUNK;
    float* xs = invq + DC_CHUNK;  // the triangular solve's X blocks
    const long width = 2L * key_heads * dk + (long)value_heads * dv;
    const long q_at = (long)kh * dk, k_at = (long)key_heads * dk + q_at, v_at = 2L * key_heads * dk + (long)h * dv;
    const float q_scale = 1.0f / sqrtf((float)dk);
    const float rate = -expf(a_log[h]), bias = dt_bias[h];
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, warps = DC_THREADS / WARP_SIZE;
    for (int idx = tid; idx < DC_CHUNK * ks; idx += DC_THREADS) kS[idx] = 0.0f;  // the columns past dk stay zero
    __syncthreads();

    // 1. k̂ into shared memory (rows past L zero), q̂ and k̂ to the scratch, β and log decays.
    for (int r = warp; r < DC_CHUNK; r += warps) {
        const long t = t0 + r;
        if (r >= L) {
            for (int e = lane; e < dk; e += WARP_SIZE) kS[r * ks + e] = 0.0f;
            if (lane == 0) beta[r] = gm[r] = invq[r] = 0.0f;
            continue;
        }
        // The row's q and k values, read once (lane's e = lane, lane + WARP_SIZE, ...).
        const float* row = qkv + t * width;
        float qv[DC_LANE_VALUES], kv[DC_LANE_VALUES];
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int m = 0; m < DC_LANE_VALUES; m++) {
            const int e = lane + m * WARP_SIZE;
            qv[m] = e < dk ? row[q_at + e] : 0.0f;
            kv[m] = e < dk ? row[k_at + e] : 0.0f;
        }
#pragma unroll
        for (int m = 0; m < DC_LANE_VALUES; m++) {
            sq += qv[m] * qv[m];
            sk += kv[m] * kv[m];
        }
        const float iq = q_scale / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
        for (int m = 0; m < DC_LANE_VALUES; m++) {
            const int e = lane + m * WARP_SIZE;
            if (e >= dk) continue;
            kS[r * ks + e] = kv[m] * ik;
            if (owner) {
                kn[((long)kh * T + t) * dk + e] = kv[m] * ik;
                qn[((long)kh * T + t) * dk + e] = qv[m] * iq;
            }
        }
        if (lane == 0) {
            invq[r] = iq;
            beta[r] = 1.0f / (1.0f + expf(-b[t * value_heads + h]));
            gm[r] = dn_log_decay(rate, a[t * value_heads + h] + bias);
        }
    }
    __syncthreads();
    // 2. γ: the running sum of log decays (rows past L keep the last).
    if (tid == 0) {
        float run = 0.0f;
        for (int r = 0; r < DC_CHUNK; r++) {
            run += gm[r];
            gm[r] = run;
        }
    }
    __syncthreads();
    if (tid < DC_CHUNK) {
        bgam[tid] = beta[tid] * expf(gm[tid]);
        if (tid < L) gam[(long)h * T + t0 + tid] = gm[tid];
    }

    // 3. Gram k̂·k̂ and q̂·k̂, DC_WARP_SQ_TILES tiles of the 64×64 each a warp; q̂ staged through M,
    // 64 columns at a time.
    float ga[DC_WARP_SQ_TILES][MMA_ACC] = {}, pa[DC_WARP_SQ_TILES][MMA_ACC] = {};
    for (int e0 = 0; e0 < dk; e0 += DC_CHUNK) {
        __syncthreads();
        for (int idx = tid; idx < DC_CHUNK * DC_CHUNK; idx += DC_THREADS) {
            const int r = idx / DC_CHUNK, e = e0 + idx % DC_CHUNK;
            M[r * DC_MP + idx % DC_CHUNK] = r < L && e < dk ? qkv[(t0 + r) * width + q_at + e] * invq[r] : 0.0f;
        }
        __syncthreads();
        const int e1 = min(dk16, e0 + DC_CHUNK);
#pragma unroll
        for (int m = 0; m < DC_WARP_SQ_TILES; m++) {
            const int tile = warp + m * DC_WARPS, mt = tile / (DC_CHUNK / 16), nt = tile % (DC_CHUNK / 16);
            if (tile >= DC_SQ_TILES || nt > mt) continue;  // above the diagonal: all zero (s > t)
            for (int e = e0; e < e1; e += 16) {
                mma_split_t ka, qa, kb;
                mma_split_a(ka, kS + mt * 16 * ks + e, ks);
                mma_split_a(qa, M + mt * 16 * DC_MP + e - e0, DC_MP);
                mma_split_b(kb, kS + nt * 16 * ks + e, ks);
                mma16_split(ga[m], ka, kb);
                mma16_split(pa[m], qa, kb);
            }
        }
    }
    __syncthreads();
    float* pc = p + ((long)h * gridDim.y + chunk) * DC_CHUNK * DC_CHUNK;
#pragma unroll
    for (int m = 0; m < DC_WARP_SQ_TILES; m++) {
        const int tile = warp + m * DC_WARPS, mt = tile / (DC_CHUNK / 16), nt = tile % (DC_CHUNK / 16);
        if (tile >= DC_SQ_TILES) continue;
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) {
            const int t = mt * 16 + mma_row(i), s = nt * 16 + mma_col(i);
            const bool in = t < L && s <= t;
            const float decay = in ? expf(gm[t] - gm[s]) : 0.0f;
            pc[t * DC_CHUNK + s] = in ? pa[m][i] * decay : 0.0f;
            M[t * DC_MP + s] = in && s < t ? beta[t] * decay * ga[m][i] : 0.0f;
        }
    }
    __syncthreads();

    // 4. T = (I + A)⁻¹ in place (A strictly lower; M keeps T − I), in blocks of 16. Each diagonal
    // block T_bb = (I + A_bb)⁻¹ by forward substitution, a warp a block and a lane a column j
    // (its column of T in registers): T[s][j] = −(A[s][j] + Σ_{j<r<s} A[s][r] T[r][j]). Then block
    // row by block row on the matrix cores, T_ij = −T_ii X_j with X_j = A_ij T_jj + Σ_{j<k<i} A_ik
    // T_kj for j < i, a warp each: every X_j of a row is taken (from the row's A) before any T_ij
    // is written over it.
    {
        const int b = warp, j = lane % 16;
        float tcol[16];
        if (b < DC_CHUNK / 16) {
            const float* Ab = M + 16 * b * DC_MP + 16 * b;
#pragma unroll
            for (int r = 0; r < 16; r++) {
                float v = r == j ? 1.0f : 0.0f;
#pragma unroll
                for (int q = 0; q < r; q++) v -= Ab[r * DC_MP + q] * tcol[q];
                tcol[r] = v;
            }
        }
        __syncthreads();  // every lane has read its block's A
        if (b < DC_CHUNK / 16 && lane < 16) {
#pragma unroll
            for (int r = 0; r < 16; r++)
                if (r > j) M[(16 * b + r) * DC_MP + 16 * b + j] = tcol[r];
        }
        for (int i = 1; i < DC_CHUNK / 16; i++) {
            __syncthreads();  // T's block rows above i are whole
            const bool mine = warp < i;  // block column j = warp
            float x[MMA_ACC];
            if (mine) {
                const float* Aij = M + 16 * i * DC_MP + 16 * warp;
#pragma unroll
                for (int e = 0; e < MMA_ACC; e++) x[e] = Aij[mma_row(e) * DC_MP + mma_col(e)];  // A_ij times T_jj's I
                for (int k = warp; k < i; k++) {
                    mma_split_t a, t;
                    mma_split_a(a, M + 16 * i * DC_MP + 16 * k, DC_MP);
                    mma_split_bt(t, M + 16 * k * DC_MP + 16 * warp, DC_MP);
                    mma16_split(x, a, t);
                }
#pragma unroll
                for (int e = 0; e < MMA_ACC; e++) xs[warp * 16 * DC_XS + mma_row(e) * DC_XS + mma_col(e)] = x[e];
            }
            __syncthreads();  // the row's X are whole, and its A read
            if (mine) {
                mma_split_t a, xb;
                mma_split_a(a, M + 16 * i * DC_MP + 16 * i, DC_MP);
                mma_split_bt(xb, xs + warp * 16 * DC_XS, DC_XS);
                mma16_split(x, a, xb);
#pragma unroll
                for (int e = 0; e < MMA_ACC; e++) M[(16 * i + mma_row(e)) * DC_MP + 16 * warp + mma_col(e)] = -x[e];
            }
        }
    }

    // 5. W = T · diag(βΓ) · K̂ and Ũ = T · diag(β) · V, each X + (T − I)·X for its X, 64 columns
    // at a time on the matrix cores. K̂'s rows are scaled by βΓ in place first; each 64 columns of
    // V · β are staged where k̂ was, once W is done (V's rows lie far apart in qkv: loaded in the
    // loop, every row waited out a memory latency).
    for (int idx = tid; idx < DC_CHUNK * ks; idx += DC_THREADS) kS[idx] *= bgam[idx / ks];
    auto triangular_product = [&](bool is_w, int base) {
        const int n_cols = is_w ? dk : dv, x0 = is_w ? base : 0;  // X's first column in kS
        __syncthreads();  // X is whole
#pragma unroll
        for (int m = 0; m < DC_WARP_SQ_TILES; m++) {
            const int tile = warp + m * DC_WARPS, mt = tile / (DC_CHUNK / 16), nt = tile % (DC_CHUNK / 16);
            // Columns past X's (rounded to 16) are never stored; T − I is zero right of its diagonal block.
            if (tile >= DC_SQ_TILES || base + nt * 16 >= n_cols) continue;
            float acc[MMA_ACC];
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) acc[i] = kS[(mt * 16 + mma_row(i)) * ks + x0 + nt * 16 + mma_col(i)];
            for (int r0 = 0; r0 <= mt * 16; r0 += 16) {
                mma_split_t ta, xb;
                mma_split_a(ta, M + mt * 16 * DC_MP + r0, DC_MP);
                mma_split_bt(xb, kS + r0 * ks + x0 + nt * 16, ks);
                mma16_split(acc, ta, xb);
            }
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) {
                const int t = mt * 16 + mma_row(i), e = base + nt * 16 + mma_col(i);
                if (t >= L || e >= n_cols) continue;
                if (is_w) w[((long)h * T + t0 + t) * dk + e] = acc[i];
                else u[((long)h * T + t0 + t) * dv + e] = acc[i];
            }
        }
    };
    for (int base = 0; base < dk; base += DC_CHUNK) triangular_product(true, base);
    for (int base = 0; base < dv; base += DC_CHUNK) {
        __syncthreads();  // the W product, or the previous piece, is done with kS
        for (int idx = tid; idx < DC_CHUNK * DC_CHUNK; idx += DC_THREADS) {
            const int r = idx / DC_CHUNK, c = idx % DC_CHUNK;
            kS[r * ks + c] = r < L && base + c < dv ? qkv[(t0 + r) * width + v_at + base + c] * beta[r] : 0.0f;
        }
        triangular_product(false, base);
    }
}

// The state's walk over the chunks, split in two: delta_chunk_state walks them in order per head,
// DC_COLS value columns of one head per block (columns of S are independent): per chunk it leaves
// S (as the chunk finds it) in hs, turns Ũ into U = Ũ − W·S in place, and moves S on:
// S ← Γ_L·S + K̂ᵀ·(diag(exp(γ_L − γ_s))·U). delta_chunk_out then takes every chunk at once:
// o = Γ ⊙ (q̂·S) + P·U. The products that need only a chunk's own S leave the sequential walk.
// The products run on the matrix cores as tiles of 16×16 (common/mma.h's split products: f32
// operands as bf16 hi + lo, near f32's accuracy), a tile a warp at a time. A block holds a slice
// S [dk16, DC_SS] and U [DC_CHUNK, DC_SS] in shared memory (dk16: dk rounded up to 16, the rows
// past dk zero) and passes W, q̂, P and k̂ through one buffer [DC_CHUNK, bs] (bs = max(dk16,
// DC_CHUNK) + 4; the columns past dk zero), each copied in whole (async copies where the device
// has them) before it is used. Dynamic shared memory, in floats: DC_CHUNK·bs + dk16·DC_SS +
// DC_CHUNK·DC_SS + DC_CHUNK (under 64 KB for dk = 128: AMD's LDS). The strides keep the fragment
// loads of NVIDIA's layout free of bank conflicts (bs ≡ 4 and DC_SS ≡ 4 mod 32 words).
struct DcBlock {
    float* buf;
    float* S;
    float* Us;
    float* g;  // γ
    int bs, dk, dk16, tid, warp;
    __device__ __forceinline__ DcBlock(float* smem, int dk_) : dk(dk_) {
        dk16 = (dk + 15) / 16 * 16;
        bs = max(dk16, DC_CHUNK) + 4;
        buf = smem;
        S = buf + DC_CHUNK * bs;
        Us = S + dk16 * DC_SS;
        g = Us + DC_CHUNK * DC_SS;
        tid = threadIdx.x;
        warp = tid / WARP_SIZE;
        for (int idx = tid; idx < DC_CHUNK * bs; idx += DC_THREADS) buf[idx] = 0.0f;  // the padding stays zero
    }
    // Rows [t0, t0 + L) of a [.., cols] scratch into buf (row stride bs), zeros past L; every
    // thread has written what it had to once this returns, and the block sees it.
    __device__ __forceinline__ void stage(const float* src, int t0, int L, int cols) {
        __syncthreads();  // buf's last readers are done
        if (cols % 4 == 0) {
            const int c4 = cols / 4;
            for (int idx = tid; idx < DC_CHUNK * c4; idx += DC_THREADS) {
                const int r = idx / c4, e = 4 * (idx % c4);
                async_copy16(&buf[r * bs + e], &src[(long)(t0 + min(r, L - 1)) * cols + e], r < L);
            }
        } else {
            for (int idx = tid; idx < DC_CHUNK * cols; idx += DC_THREADS) {
                const int r = idx / cols, e = idx % cols;
                async_copy4(&buf[r * bs + e], &src[(long)(t0 + min(r, L - 1)) * cols + e], r < L);
            }
        }
        async_commit();
        async_wait<0>();
        __syncthreads();
    }
    // S (rows past dk zero) from a [dk, dv] state, columns j0 ..
    __device__ __forceinline__ void load_state(const float* from, int j0, int dv) {
        for (int idx = tid; idx < dk16 * DC_COLS; idx += DC_THREADS) {
            const int i = idx / DC_COLS, c = idx % DC_COLS, j = j0 + c;
            S[i * DC_SS + c] = i < dk && j < dv ? from[(long)i * dv + j] : 0.0f;
        }
    }
    __device__ __forceinline__ void save_state(float* to, int j0, int dv) const {
        for (int idx = tid; idx < dk * DC_COLS; idx += DC_THREADS) {
            const int i = idx / DC_COLS, c = idx % DC_COLS, j = j0 + c;
            if (j < dv) to[(long)i * dv + j] = S[i * DC_SS + c];
        }
    }
    // Columns j0.. of rows [t0, t0 + L) of u [.., dv] into Us (zeros past L and dv), and the
    // chunk's γ (rows past L keep the last); the block sees them after its next barrier.
    __device__ __forceinline__ void load_u(const float* u, const float* gam, int t0, int L, int j0, int dv) {
        if (tid < DC_CHUNK) g[tid] = gam[t0 + min(tid, L - 1)];
        for (int idx = tid; idx < DC_CHUNK * DC_COLS; idx += DC_THREADS) {
            const int r = idx / DC_COLS, c = idx % DC_COLS, j = j0 + c;
            Us[r * DC_SS + c] = r < L && j < dv ? u[(long)(t0 + r) * dv + j] : 0.0f;
        }
    }
    // acc += buf[16 mt.., 0..K) · B[0..K, 16 nt..) for B one of S, Us (row stride DC_SS).
    __device__ __forceinline__ void product(float* acc, int mt, int nt, const float* B, int K) const {
        for (int k0 = 0; k0 < K; k0 += 16) {
            mma_split_t a, b;
            mma_split_a(a, buf + mt * 16 * bs + k0, bs);
            mma_split_bt(b, B + k0 * DC_SS + nt * 16, DC_SS);
            mma16_split(acc, a, b);
        }
    }
};

// Launch: grid (Hv, ceil(dv / DC_COLS)), block DC_THREADS.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DC_THREADS, 2)
    delta_chunk_state(const float* kn, const float* w, float* u, const float* gam, float* state, float* hs, int T,
                      int key_heads, int value_heads, int dk, int dv) {
    extern __shared__ __attribute__((aligned(16))) float dc_smem[];
    DcBlock blk(dc_smem, dk);
    const int h = blockIdx.x, j0 = blockIdx.y * DC_COLS;
    const int kh = h / (value_heads / key_heads), chunks = (T + DC_CHUNK - 1) / DC_CHUNK;
    float* Sg = state + (long)h * dk * dv;
    float* uh = u + (long)h * T * dv;
    blk.load_state(Sg, j0, dv);
    for (int t0 = 0, chunk = 0; t0 < T; t0 += DC_CHUNK, chunk++) {
        const int L = min(DC_CHUNK, T - t0);
        __syncthreads();  // the previous chunk is done with U and γ, and S is whole
        blk.load_u(uh, gam + (long)h * T, t0, L, j0, dv);
        blk.save_state(hs + ((long)h * chunks + chunk) * dk * dv, j0, dv);
        blk.stage(w + (long)h * T * dk, t0, L, dk);

        // U = Ũ − W·S, kept for delta_chunk_out; Us then holds exp(γ_L − γ_s) U[s] for the update.
        for (int tile = blk.warp; tile < DC_OUT_TILES; tile += DC_WARPS) {
            const int mt = tile / (DC_COLS / 16), nt = tile % (DC_COLS / 16);
            float acc[MMA_ACC] = {};
            blk.product(acc, mt, nt, blk.S, blk.dk16);
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) {
                const int r = mt * 16 + mma_row(i), c = nt * 16 + mma_col(i);
                const float v = blk.Us[r * DC_SS + c] - acc[i];
                if (r < L && j0 + c < dv) uh[(long)(t0 + r) * dv + j0 + c] = v;
                blk.Us[r * DC_SS + c] = v * expf(blk.g[L - 1] - blk.g[r]);
            }
        }

        // S ← Γ_L · S + K̂ᵀ · Us: each thread its own entries of S.
        blk.stage(kn + (long)kh * T * dk, t0, L, dk);
        const float gamma_l = expf(blk.g[L - 1]);
        for (int tile = blk.warp; tile < blk.dk16 / 16 * (DC_COLS / 16); tile += DC_WARPS) {
            const int it = tile / (DC_COLS / 16), nt = tile % (DC_COLS / 16);
            float acc[MMA_ACC];
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) acc[i] = gamma_l * blk.S[(it * 16 + mma_row(i)) * DC_SS + nt * 16 + mma_col(i)];
            for (int s0 = 0; s0 < DC_CHUNK; s0 += 16) {
                mma_split_t a, b;
                mma_split_at(a, blk.buf + s0 * blk.bs + it * 16, blk.bs);
                mma_split_bt(b, blk.Us + s0 * DC_SS + nt * 16, DC_SS);
                mma16_split(acc, a, b);
            }
#pragma unroll
            for (int i = 0; i < MMA_ACC; i++) blk.S[(it * 16 + mma_row(i)) * DC_SS + nt * 16 + mma_col(i)] = acc[i];
        }
    }
    __syncthreads();
    blk.save_state(Sg, j0, dv);
}

// Launch: grid (Hv, ceil(dv / DC_COLS), ceil(T / DC_CHUNK)), block DC_THREADS.
ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DC_THREADS, 2)
    delta_chunk_out(const float* qn, const float* u, const float* p, const float* gam, const float* hs, float* out,
                    int T, int key_heads, int value_heads, int dk, int dv) {
    extern __shared__ __attribute__((aligned(16))) float dc_smem[];
    DcBlock blk(dc_smem, dk);
    const int h = blockIdx.x, j0 = blockIdx.y * DC_COLS, chunk = blockIdx.z;
    const int kh = h / (value_heads / key_heads), chunks = (T + DC_CHUNK - 1) / DC_CHUNK;
    const int t0 = chunk * DC_CHUNK, L = min(DC_CHUNK, T - t0);
    blk.load_state(hs + ((long)h * chunks + chunk) * dk * dv, j0, dv);
    blk.load_u(u + (long)h * T * dv, gam + (long)h * T, t0, L, j0, dv);

    // o = Γ_t · q̂_t·S, then + Σ_{s≤t} P[t][s] U[s].
    blk.stage(qn + (long)kh * T * dk, t0, L, dk);
    float o[DC_WARP_TILES][MMA_ACC] = {};
#pragma unroll
    for (int m = 0; m < DC_WARP_TILES; m++) {
        const int tile = blk.warp + m * DC_WARPS;
        if (tile >= DC_OUT_TILES) continue;
        const int mt = tile / (DC_COLS / 16), nt = tile % (DC_COLS / 16);
        blk.product(o[m], mt, nt, blk.S, blk.dk16);
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) o[m][i] *= expf(blk.g[mt * 16 + mma_row(i)]);
    }
    blk.stage(p + ((long)h * chunks + chunk) * DC_CHUNK * DC_CHUNK, 0, DC_CHUNK, DC_CHUNK);
#pragma unroll
    for (int m = 0; m < DC_WARP_TILES; m++) {
        const int tile = blk.warp + m * DC_WARPS;
        if (tile >= DC_OUT_TILES) continue;
        const int mt = tile / (DC_COLS / 16), nt = tile % (DC_COLS / 16);
        blk.product(o[m], mt, nt, blk.Us, DC_CHUNK);
#pragma unroll
        for (int i = 0; i < MMA_ACC; i++) {
            const int t = mt * 16 + mma_row(i), c = nt * 16 + mma_col(i);
            if (t < L && j0 + c < dv) out[((long)(t0 + t) * value_heads + h) * dv + j0 + c] = o[m][i];
        }
    }
}
