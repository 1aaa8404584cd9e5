// Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers): the causal convolution with state and
// the recurrent gated delta rule, computed as the CPU reference does (src/backend/cpu/mod.rs;
// the maths in tests/fixtures/HYBRID_NOTES.md §3.3). The gated RMSNorm is in norm.hip, the sigmoid
// gate in elementwise.hip.
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
#define CONV_MAX_K 8
#define CONV_CHUNK 64

ATLAS_KERNEL void conv1d_silu(const float* x, const float* weight, float* state, float* out, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int t0 = blockIdx.y * CONV_CHUNK, t1 = min(T, t0 + CONV_CHUNK);
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
    if (blockIdx.y != 0) return;
    // New state row r = window row T + r: the old state row T + r while that is below K-1 (only when
    // T < K-1; rows are written in increasing order and T + r > r, so it is read before it is
    // overwritten), else x row T + r - (K-1).
    for (int r = 0; r < K - 1; r++) {
        const int w = T + r;
        state[(long)r * C + c] = w < K - 1 ? state[(long)w * C + c] : x[(long)(w - (K - 1)) * C + c];
    }
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

// Sum over the DN_SPLIT consecutive threads of one column (aligned groups inside a warp).
__device__ __forceinline__ float column_sum(float v) {
#pragma unroll
    for (int m = 1; m < DN_SPLIT; m <<= 1) v += shfl_xor(v, m);
    return v;
}

ATLAS_KERNEL void ATLAS_LAUNCH_BOUNDS(DN_THREADS, 4)
    gated_delta_rule(const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
                     float* state, float* out, int T, int key_heads, int value_heads, int dk, int dv) {
    __shared__ float raw[2][2][DN_MAX_DK];        // [token parity][q, k][dk]
    __shared__ float squares[2][2][DN_MAX_WARPS];  // [token parity][q, k][warp]
    const int h = blockIdx.x, tid = threadIdx.x, part = tid % DN_SPLIT;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int j = blockIdx.y * DN_COLS + tid / DN_SPLIT;
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
        const float g_in = a_t + bias;
        const float decay = expf(rate * (g_in > 20.0f ? g_in : log1pf(expf(g_in))));
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
