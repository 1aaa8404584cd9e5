// Elementwise ops on f32 activations, and device copies. Launch: 1-D grid of 256-thread blocks
// covering n unless a kernel says otherwise.
#include "common/portable.h"
#include "common/fp8.h"
#include "common/packed.h"

// out = silu(gate) * up
ATLAS_KERNEL void silu_mul(const float* gate, const float* up, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y
// to_bf16: y = x rounded to bf16 (nearest even), 8 values a thread (n % 8 == 0, 16-byte aligned
// rows): the wgmma GEMMs' input. Launch: grid ceil(n / 8 / 256), block 256.
ATLAS_KERNEL void to_bf16(const float* x, bf16* y, long n) {
    const long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const float4 a = *(const float4*)(x + i), b = *(const float4*)(x + i + 4);
    *(uint4*)(y + i) = make_uint4(bf16x2_pack(a.x, a.y), bf16x2_pack(a.z, a.w), bf16x2_pack(b.x, b.y), bf16x2_pack(b.z, b.w));
}

ATLAS_KERNEL void add_inplace(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x *= sigmoid(gate) for x [n / cols, cols]: gate [n / cols, cols] (gate_cols = cols), or one gate
// per row (gate_cols = 1; Qwen3.5's gated attention output).
ATLAS_KERNEL void sigmoid_gate(float* x, const float* gate, int cols, int gate_cols, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int row = i / cols, col = i % cols;
    x[i] /= 1.0f + expf(-gate[(long)row * gate_cols + (gate_cols == 1 ? 0 : col)]);
}

// out[t, :] = table[tokens[t], :] as f32. Grid: (ceil(cols/256), T).
ATLAS_KERNEL void embed_bf16(const bf16* table, const int* tokens, float* out, int cols) {
    pdl_launch_dependents();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c < cols) out[(long)t * cols + c] = bf16_to_f32(table[(long)tokens[t] * cols + c]);
}

// The same from FP8 block-scaled weights (common/fp8.h); `kblocks` = ceil(cols / 128).
ATLAS_KERNEL void embed_fp8(const unsigned char* table, const float* scales, const int* tokens, float* out, int cols,
                            int kblocks) {
    pdl_launch_dependents();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c >= cols) return;
    const int row = tokens[t];
    const float s = fp8_scale(scales[(row / FP8_BLOCK) * kblocks + c / FP8_BLOCK]);
    out[(long)t * cols + c] = e4m3_scaled(table[(long)row * cols + c]) * s;
}

// The same from a block format in the device layout (common/packed.h, format id `fmt`, `rows` rows
// of `cols` values), decoded exactly as the CPU does. Thread per 16 values (half a run). Launch:
// grid (ceil(cols / 16 / 256), tokens), block 256.
ATLAS_KERNEL void embed_packed(const unsigned char* table, int fmt, int rows, const int* tokens, float* out, int cols) {
    pdl_launch_dependents();
    const int half = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (half >= cols / 16) return;
    const long run = (long)tokens[t] * (cols / 32) + half / 2;
    const int w0 = 2 * (half % 2);
    float lo[8], hi[8];
    pk_decode16_any(fmt, pk_fetch16_any(fmt, table, rows, cols, run, w0), run, lo, hi);
    float* o = out + (long)t * cols + (half / 2) * 32 + 4 * w0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        o[i] = lo[i];
        o[16 + i] = hi[i];
    }
}

// dequant_packed_bf16: a whole matrix in a block format (device layout, format id `fmt`, `rows`
// rows of `cols` values, cols % 32 == 0) into bf16 [rows, cols], each value decoded exactly (as
// embed_packed) and rounded to nearest even: how long prefills of a packed weight feed the bf16
// wgmma GEMM. Thread per 16 values (half a run). Launch: grid ceil(rows · cols / 16 / 256), block 256.
ATLAS_KERNEL void dequant_packed_bf16(const unsigned char* w, int fmt, int rows, int cols, bf16* out) {
    const long half = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (half >= (long)rows * (cols / 16)) return;
    const long run = half / 2;
    const int w0 = 2 * (int)(half % 2);
    float lo[8], hi[8];
    pk_decode16_any(fmt, pk_fetch16_any(fmt, w, rows, cols, run, w0), run, lo, hi);
    bf16* o = out + run * 32 + 4 * w0;
    *(uint4*)o = make_uint4(bf16x2_pack(lo[0], lo[1]), bf16x2_pack(lo[2], lo[3]), bf16x2_pack(lo[4], lo[5]), bf16x2_pack(lo[6], lo[7]));
    *(uint4*)(o + 16) = make_uint4(bf16x2_pack(hi[0], hi[1]), bf16x2_pack(hi[2], hi[3]), bf16x2_pack(hi[4], hi[5]), bf16x2_pack(hi[6], hi[7]));
}

// dequant_fp8_bf16: FP8 block-scaled weights [rows, cols] (cols % 16 == 0; scales as embed_fp8,
// kblocks = ceil(cols / 128)) into bf16, each value rounded as the FP8 GEMMs round it. Thread per
// 16 values. Launch: grid ceil(rows · cols / 16 / 256), block 256.
ATLAS_KERNEL void dequant_fp8_bf16(const unsigned char* w, const float* scales, int rows, int cols, int kblocks, bf16* out) {
    const long piece = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (piece >= (long)rows * (cols / 16)) return;
    const long at = piece * 16;
    const int row = (int)(at / cols), col = (int)(at % cols);
    const float scale = fp8_scale(scales[(row / FP8_BLOCK) * kblocks + col / FP8_BLOCK]);
    e4m3x16_to_bf16(*(const uint4*)(w + at), scale, *(uint4*)(out + at), *(uint4*)(out + at + 8));
}

// splitmix64 of (seed, i): the hash behind synthetic benchmark weights (CPU twin: quant::synthetic).
__device__ __forceinline__ unsigned long long synthetic_hash(unsigned long long seed, long i) {
    unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Deterministic pseudo-random bf16 weights (synthetic benchmark models): value i is a hash of
// (seed, i) mapped to [-scale, scale). The CPU twin is quant::synthetic.
ATLAS_KERNEL void fill_random_bf16(bf16* w, long n, unsigned long long seed, float scale) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long stride = (long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        const unsigned long long z = synthetic_hash(seed, i);
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        w[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
    }
}

// Synthetic FP8 codes: a random sign and a magnitude code below 0x40 (values up to 1.875, none
// NaN), from the same hash. The scales are set by the caller.
ATLAS_KERNEL void fill_random_fp8(unsigned char* w, long n, unsigned long long seed) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long stride = (long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        const unsigned long long z = synthetic_hash(seed, i);
        w[i] = (unsigned char)(((z >> 56) & 0x80u) | ((z >> 40) & 0x3fu));
    }
}

// Copies spans of device memory (saving and restoring the prefix cache's blocks): span s is
// table[3s] = destination, table[3s + 1] = source, table[3s + 2] = bytes (even). Grid (x, spans),
// blocks of 256 threads striding over their span: 16 bytes a thread a turn where both addresses
// and the length allow it, else 2.
ATLAS_KERNEL void copy_spans(const unsigned long long* table) {
    const unsigned long long* span = table + 3 * (long)blockIdx.y;
    const unsigned long long dst = span[0], src = span[1], bytes = span[2];
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    if (((dst | src | bytes) & 15) == 0) {
        uint4* to = (uint4*)dst;
        const uint4* from = (const uint4*)src;
        for (unsigned long long i = first; i < bytes / 16; i += stride) to[i] = from[i];
    } else {
        unsigned short* to = (unsigned short*)dst;
        const unsigned short* from = (const unsigned short*)src;
        for (unsigned long long i = first; i < bytes / 2; i += stride) to[i] = from[i];
    }
}
