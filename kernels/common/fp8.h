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

// 2^120 as bits (exponent 247): the factor e4m3_scaled leaves out.
__device__ __forceinline__ float fp8_scale(float scale_inv) { return scale_inv * __uint_as_float(0x7b800000u); }
