// FP8 E4M3 ("fn": no infinities, 0x7f/0xff NaN) weights with one f32 scale per 128x128 block, as
// Qwen's FP8 checkpoints store them (weight_scale_inv). The real weight is e4m3(w) * scale.
#pragma once
#include "portable.h"

#define FP8_BLOCK 128

// Placing the 7 magnitude bits of an E4M3 code at the top of an f32's exponent/mantissa gives the
// value times 2^-120 (normal and subnormal codes alike, exactly); callers fold the 2^120 into the
// block scale with fp8_scale(). NaN codes come out as a large finite number (checkpoints have none).
// `top`: a word whose top byte is the code (lower bits ignored). The arithmetic shift puts the
// magnitude in place and spreads the sign over bits 27-31; the mask keeps bit 31 of those.
__device__ __forceinline__ float e4m3_top_scaled(unsigned int top) {
    return __uint_as_float((unsigned int)((int)top >> 4) & 0x87f00000u);
}

__device__ __forceinline__ float e4m3_scaled(unsigned int code) { return e4m3_top_scaled(code << 24); }

// Four codes packed in a 32-bit word, low byte first.
__device__ __forceinline__ void e4m3x4_scaled(unsigned int w, float* out) {
    out[0] = e4m3_top_scaled(w << 24);
    out[1] = e4m3_top_scaled(w << 16);
    out[2] = e4m3_top_scaled(w << 8);
    out[3] = e4m3_top_scaled(w);
}

// Sixteen codes (a uint4, low byte first) times `scale` (an fp8_scale()d block scale) as bf16,
// rounded to nearest even, in two halves of eight: the one rounding every FP8 -> bf16 widening
// uses (the FP8 GEMMs' tiles and dequant_fp8_bf16 must agree bit for bit).
__device__ __forceinline__ void e4m3x16_to_bf16(uint4 q, float scale, uint4& lo, uint4& hi) {
    const unsigned int words[4] = {q.x, q.y, q.z, q.w};
    float f[16];
#pragma unroll
    for (int h = 0; h < 4; h++) e4m3x4_scaled(words[h], f + 4 * h);
    unsigned int p[8];
#pragma unroll
    for (int h = 0; h < 8; h++) p[h] = bf16x2_pack(f[2 * h] * scale, f[2 * h + 1] * scale);
    lo = make_uint4(p[0], p[1], p[2], p[3]);
    hi = make_uint4(p[4], p[5], p[6], p[7]);
}

// 2^120 as bits (exponent 247): the factor e4m3_scaled leaves out.
__device__ __forceinline__ float fp8_scale(float scale_inv) { return scale_inv * __uint_as_float(0x7b800000u); }

// FP8 row products on matrix cores, for one-token linear layers. A unit of 32 lanes takes 16
// weight rows: lane l (g = l % 32 / 4, t = l % 4) passes a word of four E4M3 codes of row g and
// one of row g + 8, both at the same four columns, and those columns' inputs as two f16 pairs
// (x0 | x1 << 16, x2 | x3 << 16). fp8_rows_mma adds row g's products to acc[0] and row g + 8's
// to acc[2] (acc[1] and acc[3] are scratch). On NVIDIA sm_80+ one m16n8k16 f16 mma (f32
// accumulation) sums the quad's 16 columns at once, every column of its B operand being the
// input; elsewhere each lane sums its own four. fp8_quad_total(v) then gives every lane of the
// quad the sum over all the quad's columns. Both paths decode E4M3 exactly.
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// The mma computes 8 columns (all the input, for one token): callers may give each column its own.
#define FP8_ROWS_MMA 1
// Two codes (low byte first) as an f16 pair: one instruction on sm_89+; before, the code's bits go
// under an f16's sign, exponent and mantissa (value times 2^-8, subnormals too) and a multiply
// by 2^8 restores it.
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2(unsigned int pair) {
    unsigned int r;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)pair));
#else
    const unsigned int y = __byte_perm(pair, 0u, 0x1404);  // codes at bits 8-15 and 24-31
    const unsigned int bits = (y & 0x80008000u) | ((y >> 1) & 0x3f803f80u);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(bits), "r"(0x5c005c00u));
#endif
    return r;
}
// One m16n8k16 f16 mma (f32 accumulation) over f16 weight pairs: a0 and a2 of row g (columns 2t, 2t + 1
// and 2t + 8, 2t + 9 of the quad's 16), a1 and a3 of row g + 8; x01, x23 their inputs. Row g's
// products go to acc[0], row g + 8's to acc[2].
__device__ __forceinline__ void f16_rows_mma(float* acc, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                             unsigned int x01, unsigned int x23) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(x01), "r"(x23));
}
__device__ __forceinline__ void fp8_rows_mma(float* acc, unsigned int wg, unsigned int wg8, unsigned int x01,
                                             unsigned int x23) {
    f16_rows_mma(acc, e4m3x2_to_f16x2(wg & 0xffffu), e4m3x2_to_f16x2(wg8 & 0xffffu), e4m3x2_to_f16x2(wg >> 16),
                 e4m3x2_to_f16x2(wg8 >> 16), x01, x23);
}
__device__ __forceinline__ float fp8_quad_total(float v) { return v; }
#else
#define FP8_ROWS_MMA 0
__device__ __forceinline__ void fp8_rows_mma(float* acc, unsigned int wg, unsigned int wg8, unsigned int x01,
                                             unsigned int x23) {
    const float x[4] = {f16_to_f32(x01 & 0xffffu), f16_to_f32(x01 >> 16), f16_to_f32(x23 & 0xffffu),
                        f16_to_f32(x23 >> 16)};
    // The weights restored to their values first, so that no product is scaled by 2^-120.
    float a[4], b[4];
    e4m3x4_scaled(wg, a);
    e4m3x4_scaled(wg8, b);
    const float unscale = fp8_scale(1.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) acc[0] += a[i] * unscale * x[i];
#pragma unroll
    for (int i = 0; i < 4; i++) acc[2] += b[i] * unscale * x[i];
}
__device__ __forceinline__ float fp8_quad_total(float v) {
    v += shfl_xor(v, 1);
    return v + shfl_xor(v, 2);
}
#endif
