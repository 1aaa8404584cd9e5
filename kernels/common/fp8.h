// FP8 E4M3 ("fn": no infinities, 0x7f/0xff NaN) weights with one f32 scale per 128x128 block, as
// Qwen's FP8 checkpoints store them (weight_scale_inv). The real weight is e4m3(w) * scale.
#pragma once
#include "portable.h"

#define FP8_BLOCK 128

// Placing the 7 magnitude bits of an E4M3 code at the top of an f32's exponent/mantissa gives the
// value times 2^-120 (normal and subnormal codes alike, exactly); callers fold the 2^120 into the
// block scale with fp8_scale(). NaN codes come out as a large finite number (checkpoints have none).
__device__ __forceinline__ float e4m3_scaled(unsigned int code) {
    return __uint_as_float(((code & 0x80u) << 24) | ((code & 0x7fu) << 20));
}

// Four codes packed in a 32-bit word, low byte first. Each code is moved to the top byte and
// shifted down arithmetically, which puts its magnitude in place and spreads its sign over bits
// 27-31; the mask keeps bit 31 of those.
__device__ __forceinline__ void e4m3x4_scaled(unsigned int w, float* out) {
    out[0] = __uint_as_float((unsigned int)((int)(w << 24) >> 4) & 0x87f00000u);
    out[1] = __uint_as_float((unsigned int)((int)(w << 16) >> 4) & 0x87f00000u);
    out[2] = __uint_as_float((unsigned int)((int)(w << 8) >> 4) & 0x87f00000u);
    out[3] = __uint_as_float((unsigned int)((int)w >> 4) & 0x87f00000u);
}

// 2^120 as bits (exponent 247): the factor e4m3_scaled leaves out.
__device__ __forceinline__ float fp8_scale(float scale_inv) { return scale_inv * __uint_as_float(0x7b800000u); }
