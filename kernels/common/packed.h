// Block-format weights in the device layout of src/quant/packed.rs (read its header first): per
// matrix [N, K], three planes back to back -- codes (16 bytes a run of 32 values: byte i = value i
// | value i + 16 << 4), high bits (HB bits a value, four fields a run), meta (the format's scales,
// unchanged) -- and for NVFP4 an f32 tensor factor. Every format's levels are small integers, so
// one word of codes (+ its high-bit field) decodes to eight levels as biased bytes (level + 128):
// the four of values 4w..4w+3 and the four of 16+4w..16+4w+3. A run's scales give value =
// s * level - o. The f32 path here matches quant::packed::PackedMatrix::dequant_row exactly.
#pragma once
#include "portable.h"

// Format ids: the order of quant::GgmlFormat::ALL.
#define PK_Q8_0 0
#define PK_Q4_0 1
#define PK_Q4_1 2
#define PK_Q4_K 3
#define PK_Q5_K 4
#define PK_Q6_K 5
#define PK_IQ4_NL 6
#define PK_IQ4_XS 7
#define PK_MXFP4 8
#define PK_NVFP4 9
#define PK_ROCMFP4 10
#define PK_ROCMFP4_FAST 11
#define PK_Q5_0 12
#define PK_Q5_1 13

// High bits per value; runs and bytes per meta group; whether levels come from a table.
template <int F> struct PkTraits {
    static constexpr int HB = F == PK_Q8_0 ? 4 : F == PK_Q6_K ? 2 : (F == PK_Q5_K || F == PK_Q5_0 || F == PK_Q5_1) ? 1 : 0;
    static constexpr int MRUNS = (F == PK_Q4_K || F == PK_Q5_K || F == PK_Q6_K || F == PK_IQ4_XS) ? 8 : 1;
    static constexpr int MBYTES = (F == PK_Q4_K || F == PK_Q5_K) ? 16 : F == PK_Q6_K ? 18 : F == PK_IQ4_XS ? 8
                                  : (F == PK_Q4_1 || F == PK_Q5_1) ? 4 : (F == PK_MXFP4 || F == PK_ROCMFP4_FAST) ? 1 : 2;
    static constexpr bool TABLE = F == PK_IQ4_NL || F == PK_IQ4_XS || F == PK_MXFP4 || F == PK_NVFP4 ||
                                  F == PK_ROCMFP4 || F == PK_ROCMFP4_FAST;
    // Table levels as sign (code bit 3) and one of eight magnitudes, each a small integer whose
    // f16 has a zero low byte (E2M1 doubled: 0 1 2 3 4 6 8 12; Codebook10's 10 last).
    static constexpr bool SIGN_MAG = F == PK_MXFP4 || F == PK_NVFP4 || F == PK_ROCMFP4 || F == PK_ROCMFP4_FAST;
    // Added to a code to make its biased level (linear formats): 128 minus the zero point.
    static constexpr unsigned int BIAS = F == PK_Q8_0 ? 0 : F == PK_Q4_0 ? 120 : F == PK_Q5_0 ? 112 : F == PK_Q6_K ? 96 : 128;
};

// The planes of a matrix of `rows` rows of K values.
struct PkPlanes {
    const unsigned char* codes;
    const unsigned char* high;
    const unsigned char* meta;
};
template <int F>
__device__ __forceinline__ PkPlanes pk_planes(const unsigned char* w, long rows, int K) {
    const long runs = rows * (K / 32);
    PkPlanes p;
    p.codes = w;
    p.high = w + runs * 16;
    p.meta = p.high + runs * 4 * PkTraits<F>::HB;
    return p;
}
// NVFP4's tensor factor (after the meta plane), else 1.
template <int F>
__device__ __forceinline__ float pk_factor(const PkPlanes& p, long rows, int K) {
    if (F != PK_NVFP4) return 1.0f;
    const unsigned char* b = p.meta + rows * (K / 32) * 2;  // not always 4-byte aligned
    return __uint_as_float(b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned int)b[3] << 24));
}

// The 16 signed levels of a table format, four to a word (low byte first).
template <int F>
__device__ __forceinline__ uint4 pk_table() {
    if (F == PK_IQ4_NL || F == PK_IQ4_XS)  // -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113
        return make_uint4(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);
    if (F == PK_MXFP4 || F == PK_NVFP4)  // E2M1 doubled: 0 1 2 3 4 6 8 12, then negated
        return make_uint4(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);
    return make_uint4(0x03020100u, 0x0a080604u, 0xfdfeff00u, 0xf6f8fafcu);  // ROCmFP4 Codebook10
}

// The high bits of one word's values as bytes (lower = values 4w+k, else 16+4w+k), each shifted to
// bit 4 of its byte.
template <int HB>
__device__ __forceinline__ unsigned int pk_high_bytes(unsigned int field, bool upper) {
    if (HB == 4) return upper ? field & 0xf0f0f0f0u : (field & 0x0f0f0f0fu) << 4;
    if (HB == 2) {
        // Nibble k of the 16-bit field to byte k, then its two halves.
        const unsigned int y = (field & 0xffu) | ((field & 0xff00u) << 8);
        const unsigned int z = (y & 0x000f000fu) | ((y & 0x00f000f0u) << 4);
        return (upper ? (z >> 2) & 0x03030303u : z & 0x03030303u) << 4;
    }
    if (HB == 1) {
        // Bit pair k of the 8-bit field to byte k.
        const unsigned int y = (field & 0x0fu) | ((field & 0xf0u) << 12);
        const unsigned int z = (y & 0x00030003u) | ((y & 0x000c000cu) << 6);
        return (upper ? (z >> 1) & 0x01010101u : z & 0x01010101u) << 4;
    }
    return 0u;
}

// Biased levels (level + 128, one byte each) of the four lower (or upper) values of a code word.
template <int F>
__device__ __forceinline__ unsigned int pk_levels(unsigned int codes, unsigned int field, bool upper, const uint4& table) {
    const unsigned int n = upper ? (codes >> 4) & 0x0f0f0f0fu : codes & 0x0f0f0f0fu;
    if (!PkTraits<F>::TABLE) return (n | pk_high_bytes<PkTraits<F>::HB>(field, upper)) + PkTraits<F>::BIAS * 0x01010101u;
    // Four table lookups at once: the codes' low three bits pick a byte of entries 0-7 and of
    // entries 8-15; the codes' bit 3 chooses between them.
    const unsigned int x = (n | (n >> 4)) & 0x00ff00ffu;
    const unsigned int sel = ((x & 0xffu) | (x >> 8)) & 0x7777u;
    const unsigned int a = __byte_perm(table.x, table.y, sel), b = __byte_perm(table.z, table.w, sel);
    const unsigned int m = ((n >> 3) & 0x01010101u) * 0xffu;
    return ((a & ~m) | (b & m)) ^ 0x80808080u;
}

// One run's scale and offset for its lower and its upper 16 values (NVFP4: without the factor).
struct PkScales {
    float s_lo, o_lo, s_hi, o_hi;
};

// The meta words a run needs (loaded early, decoded by pk_scales): group of run `run` (an index
// over the whole matrix).
template <int F>
__device__ __forceinline__ uint4 pk_meta(const unsigned char* meta, long run) {
    typedef PkTraits<F> T;
    const unsigned char* m = meta + (run / T::MRUNS) * T::MBYTES;
    if (F == PK_Q4_K) return *(const uint4*)m;  // 16-byte groups after 16-byte aligned planes
    if (F == PK_Q5_K) {
        const unsigned int* w = (const unsigned int*)m;  // its high-bits plane leaves 4-byte alignment
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (F == PK_Q6_K) {
        const unsigned short* h = (const unsigned short*)m;
        return make_uint4(h[run % 8], h[8], 0u, 0u);
    }
    if (F == PK_IQ4_XS) {
        const unsigned int* w = (const unsigned int*)m;
        return make_uint4(w[0], w[1], 0u, 0u);
    }
    if (F == PK_Q4_1 || F == PK_Q5_1) return make_uint4(*(const unsigned int*)m, 0u, 0u, 0u);
    if (T::MBYTES == 1) return make_uint4(m[0], 0u, 0u, 0u);
    return make_uint4(*(const unsigned short*)m, 0u, 0u, 0u);
}

__device__ __forceinline__ float pk_f16(unsigned int bits) { return f16_to_f32((unsigned short)(bits & 0xffffu)); }

// quant::fp4's scale bytes, exactly.
__device__ __forceinline__ float pk_e8m0_half(unsigned int e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
__device__ __forceinline__ float pk_ue4m3_half(unsigned int x) {
    const unsigned int exp = (x >> 3) & 15, man = x & 7;
    if (x == 0 || x == 0x7f) return 0.0f;
    if (exp == 0) return (float)man * __uint_as_float(0x3a800000u);  // 2^-10
    return __uint_as_float(((exp + 119) << 23) | (man << 20));       // (1 + man/8) 2^(exp-8)
}
__device__ __forceinline__ float pk_rocmfp4_scale(unsigned int x) {
    const unsigned int exp = x >> 3, man = x & 7;
    if (x >= 0x7f) return 0.0f;
    if (exp == 0) return (float)man * __uint_as_float(0x3a800000u);
    return __uint_as_float(((exp + 119) << 23) | (man << 20));
}

// Run j (0-based in its meta group) of the group whose words pk_meta loaded.
template <int F>
__device__ __forceinline__ PkScales pk_scales(const uint4& r, int j) {
    PkScales s = {0.0f, 0.0f, 0.0f, 0.0f};
    if (F == PK_Q8_0 || F == PK_Q4_0 || F == PK_Q5_0 || F == PK_IQ4_NL) {
        s.s_lo = s.s_hi = pk_f16(r.x);
    } else if (F == PK_Q4_1 || F == PK_Q5_1) {
        s.s_lo = s.s_hi = pk_f16(r.x);
        s.o_lo = s.o_hi = -pk_f16(r.x >> 16);
    } else if (F == PK_Q4_K || F == PK_Q5_K) {
        // ggml's get_scale_min_k4 over the 12 scale bytes (words 1-3 of the group): runs j and
        // j + 4 use byte j & 3 of each word.
        const int shift = 8 * (j & 3);
        const unsigned int b1 = (r.y >> shift) & 0xffu, b2 = (r.z >> shift) & 0xffu, b3 = (r.w >> shift) & 0xffu;
        const unsigned int sc = j < 4 ? b1 & 63 : (b3 & 15) | ((b1 >> 6) << 4);
        const unsigned int mn = j < 4 ? b2 & 63 : (b3 >> 4) | ((b2 >> 6) << 4);
        s.s_lo = s.s_hi = pk_f16(r.x) * (float)sc;
        s.o_lo = s.o_hi = pk_f16(r.x >> 16) * (float)mn;
    } else if (F == PK_Q6_K) {
        const float d = pk_f16(r.y);
        s.s_lo = d * (float)(signed char)(r.x & 0xffu);
        s.s_hi = d * (float)(signed char)((r.x >> 8) & 0xffu);
    } else if (F == PK_IQ4_XS) {
        const unsigned int low = (r.y >> (4 * j)) & 15;  // nibble j of scales_l
        const unsigned int high = ((r.x >> 16) >> (2 * j)) & 3;
        s.s_lo = s.s_hi = pk_f16(r.x) * (float)((int)(low | (high << 4)) - 32);
    } else if (F == PK_MXFP4) {
        s.s_lo = s.s_hi = pk_e8m0_half(r.x);
    } else if (F == PK_NVFP4) {
        s.s_lo = pk_ue4m3_half(r.x & 0xffu);
        s.s_hi = pk_ue4m3_half((r.x >> 8) & 0xffu);
    } else if (F == PK_ROCMFP4) {
        s.s_lo = pk_rocmfp4_scale(r.x & 0xffu);
        s.s_hi = pk_rocmfp4_scale((r.x >> 8) & 0xffu);
    } else {
        s.s_lo = s.s_hi = pk_rocmfp4_scale(r.x);
    }
    return s;
}

// The high-bit field of word w of run `run` (HB bytes).
template <int F>
__device__ __forceinline__ unsigned int pk_field(const unsigned char* high, long run, int w) {
    constexpr int HB = PkTraits<F>::HB;
    const unsigned char* p = high + (run * 4 + w) * HB;
    if (HB == 4) return *(const unsigned int*)p;
    if (HB == 2) return *(const unsigned short*)p;
    if (HB == 1) return *p;
    return 0u;
}

// What 16 values of a run need from memory (words w0 and w0 + 1 of its codes: values 4w0 .. 4w0 + 8
// and 16 + 4w0 ..), loaded by pk_fetch16 ahead of pk_decode16. NVFP4's tensor factor rides in
// meta.y (its meta word is meta.x alone).
struct PkRaw {
    uint2 codes;
    uint2 fields;
    uint4 meta;
};

template <int F>
__device__ __forceinline__ PkRaw pk_fetch16(const unsigned char* w, long rows, int K, long run, int w0) {
    const PkPlanes p = pk_planes<F>(w, rows, K);
    PkRaw r;
    r.codes = *(const uint2*)(p.codes + run * 16 + w0 * 4);
    r.fields = make_uint2(pk_field<F>(p.high, run, w0), pk_field<F>(p.high, run, w0 + 1));
    r.meta = pk_meta<F>(p.meta, run);
    if (F == PK_NVFP4) r.meta.y = __float_as_uint(pk_factor<F>(p, rows, K));
    return r;
}

// The 16 values in f32 (lo[8]: values 4w0 .. 4w0 + 8, hi[8]: 16 + 4w0 ..), exactly as the CPU reference.
template <int F>
__device__ __forceinline__ void pk_decode16(const PkRaw& r, long run, float* lo, float* hi) {
    const uint4 table = pk_table<F>();
    PkScales s = pk_scales<F>(r.meta, (int)(run % PkTraits<F>::MRUNS));
    if (F == PK_NVFP4) {
        s.s_lo *= __uint_as_float(r.meta.y);
        s.s_hi *= __uint_as_float(r.meta.y);
    }
    const unsigned int words[2] = {r.codes.x, r.codes.y}, fields[2] = {r.fields.x, r.fields.y};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const unsigned int l = pk_levels<F>(words[i], fields[i], false, table);
        const unsigned int u = pk_levels<F>(words[i], fields[i], true, table);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            lo[4 * i + k] = s.s_lo * (float)((int)((l >> (8 * k)) & 0xffu) - 128) - s.o_lo;
            hi[4 * i + k] = s.s_hi * (float)((int)((u >> (8 * k)) & 0xffu) - 128) - s.o_hi;
        }
    }
}

// The same for a format chosen at run time (the prefill GEMM's staging, the embedding): a uniform
// branch per call.
#define PK_SWITCH(fmt, CALL)        \
    switch (fmt) {                  \
        CALL(PK_Q8_0)               \
        CALL(PK_Q4_0)               \
        CALL(PK_Q4_1)               \
        CALL(PK_Q4_K)               \
        CALL(PK_Q5_K)               \
        CALL(PK_Q6_K)               \
        CALL(PK_IQ4_NL)             \
        CALL(PK_IQ4_XS)             \
        CALL(PK_MXFP4)              \
        CALL(PK_NVFP4)              \
        CALL(PK_ROCMFP4)            \
        CALL(PK_ROCMFP4_FAST)       \
        CALL(PK_Q5_0)               \
        CALL(PK_Q5_1)               \
    }

__device__ __forceinline__ PkRaw pk_fetch16_any(int fmt, const unsigned char* w, long rows, int K, long run, int w0) {
#define PK_FETCH(F) \
    case F: return pk_fetch16<F>(w, rows, K, run, w0);
    PK_SWITCH(fmt, PK_FETCH)
#undef PK_FETCH
    PkRaw none = {make_uint2(0u, 0u), make_uint2(0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    return none;
}

__device__ __forceinline__ void pk_decode16_any(int fmt, const PkRaw& r, long run, float* lo, float* hi) {
#define PK_DECODE(F) \
    case F: pk_decode16<F>(r, run, lo, hi); return;
    PK_SWITCH(fmt, PK_DECODE)
#undef PK_DECODE
    for (int i = 0; i < 8; i++) lo[i] = hi[i] = 0.0f;
}
