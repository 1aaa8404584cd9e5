// Matrix cores behind one interface: a warp-wide 16x16x16 bf16 product with f32 accumulation,
//   acc[16x16] += A[16x16] · B[16x16]ᵀ,
// where A (rows m, k contiguous) and B (rows n, k contiguous, like nn.Linear.weight) are bf16 in
// shared memory with leading dimensions lda, ldb (even). The 256 accumulators are spread over the
// warp: MMA_ACC floats per lane, the i-th at (mma_row(i), mma_col(i)) of the tile.
//   NVIDIA sm_80+   mma.sync m16n8k16 (two per tile)
//   RDNA3/3.5       WMMA 16x16x16 (wave32)
//   RDNA4           WMMA 16x16x16, gfx12 layout (wave32)
//   CDNA2/3         MFMA 16x16x16 (wave64)
//   anything else   a plain loop over shared memory (same results up to rounding order)
//
// Fragment API, for kernels that reuse operands across several products (a warp tile of
// TM x TN 16x16 tiles loads TM + TN fragments per 16-wide k step instead of 2 * TM * TN):
//   mma_frag_t f;  mma_load_a(f, A, lda);  mma_load_b(f, B, ldb);  mma16_frag(acc, a, b);
// computes what mma16(acc, A, lda, B, ldb) does, with the same accumulator layout (on AMD and the
// scalar fallback mma16 is exactly that). mma_load_bt(f, Bt, ldbt) loads the same B operand from
// its transpose Bt [k][n] (n contiguous), as A · V with V [k][n] needs. For the fragment API, A and B must be in shared memory
// with 16-byte aligned rows (lda, ldb multiples of 8, 16-byte aligned tile origin): NVIDIA reads
// them with ldmatrix.
//
// f32 operands to near-f32 accuracy: each value split into bf16 hi (x rounded) and lo (the rest,
// rounded; 16 significant bits together), and A·B taken as hi·hi + hi·lo + lo·hi (the lo·lo
// term, under 2^-16 of a product, left out). From f32 in shared memory, any stride:
//   mma_split_t a, b;  mma_split_a(a, A, lda);  mma_split_b(b, B, ldb);  mma16_split(acc, a, b);
// mma_split_at(a, At, ldat) loads A from its transpose At [k][m], mma_split_bt(b, Bt, ldbt) B from
// its transpose Bt [k][n]. Without matrix cores the product
// is the plain f32 loop.
#pragma once
#include "portable.h"

#ifndef __has_builtin
#define __has_builtin(x) 0
#endif

#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MMA_ACC 8
// mma16 reads its operands with 32-bit loads here (no 16-byte row alignment needed).
#define MMA16_NATIVE 1
__device__ __forceinline__ void mma16(float* acc, const bf16* A, int lda, const bf16* B, int ldb) {
    const int lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
    const unsigned a0 = *(const unsigned*)(A + g * lda + c);
    const unsigned a1 = *(const unsigned*)(A + (g + 8) * lda + c);
    const unsigned a2 = *(const unsigned*)(A + g * lda + c + 8);
    const unsigned a3 = *(const unsigned*)(A + (g + 8) * lda + c + 8);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const bf16* Bh = B + (h * 8 + g) * ldb;
        const unsigned b0 = *(const unsigned*)(Bh + c);
        const unsigned b1 = *(const unsigned*)(Bh + c + 8);
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[h * 4 + 0]), "+f"(acc[h * 4 + 1]), "+f"(acc[h * 4 + 2]), "+f"(acc[h * 4 + 3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}
__device__ __forceinline__ int mma_row(int i) { return ((threadIdx.x % 32) >> 2) + ((i & 2) ? 8 : 0); }
__device__ __forceinline__ int mma_col(int i) { return (i >> 2) * 8 + (threadIdx.x % 4) * 2 + (i & 1); }

// Four 8x8 bf16 matrices; matrix j's row addresses come from lanes 8j..8j+7, and lane l receives
// row l/4, columns 2(l%4), +1 of each: the m16n8k16 operand layout.
struct mma_frag_t { unsigned int r[4]; };
__device__ __forceinline__ void mma_ldmatrix_x4(mma_frag_t& f, const bf16* row_addr) {
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(row_addr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(s));
}
// a0..a3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
__device__ __forceinline__ void mma_load_a(mma_frag_t& f, const bf16* A, int lda) {
    const int lane = threadIdx.x % 32;
    mma_ldmatrix_x4(f, A + ((lane & 7) + ((lane >> 3) & 1) * 8) * lda + (lane >> 4) * 8);
}
// b0, b1 = (n 0-7, k 0-7), (n 0-7, k 8-15): the first n8 half's operand; b2, b3 the second's.
__device__ __forceinline__ void mma_load_b(mma_frag_t& f, const bf16* B, int ldb) {
    const int lane = threadIdx.x % 32;
    mma_ldmatrix_x4(f, B + ((lane & 7) + (lane >> 4) * 8) * ldb + ((lane >> 3) & 1) * 8);
}
// The transposed load: matrix j covers k rows 8 * (j & 1).., n columns 8 * (j >> 1)..
__device__ __forceinline__ void mma_load_bt(mma_frag_t& f, const bf16* Bt, int ldbt) {
    const int lane = threadIdx.x % 32;
    const bf16* row = Bt + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldbt + (lane >> 4) * 8;
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(s));
}
__device__ __forceinline__ void mma16_frag(float* acc, const mma_frag_t& a, const mma_frag_t& b) {
#pragma unroll
    for (int h = 0; h < 2; h++)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[h * 4 + 0]), "+f"(acc[h * 4 + 1]), "+f"(acc[h * 4 + 2]), "+f"(acc[h * 4 + 3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]), "r"(b.r[2 * h + 1]));
}
// Register j of an A fragment holds row g + 8 (j & 1), k 8 (j >> 1) + 2t, +1; of a B fragment
// (as mma_load_b gives it) n g + 8 (j >> 1), k 8 (j & 1) + 2t, +1. get(row, k) reads the operand.
#define MMA_SPLIT_NATIVE 1
template <bool IS_B, class Get>
__device__ __forceinline__ void mma_split_fill(mma_frag_t& hi, mma_frag_t& lo, Get get) {
    const int lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int row = g + 8 * (IS_B ? j >> 1 : j & 1), k = c + 8 * (IS_B ? j & 1 : j >> 1);
        const float x0 = get(row, k), x1 = get(row, k + 1);
        hi.r[j] = bf16x2_pack(x0, x1);
        lo.r[j] = bf16x2_pack(x0 - __uint_as_float(hi.r[j] << 16), x1 - __uint_as_float(hi.r[j] & 0xffff0000u));
    }
}

#elif defined(ATLAS_HIP) && (defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || \
                             defined(__gfx1103__) || defined(__gfx1150__) || defined(__gfx1151__)) && \
    __has_builtin(__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32)
#define MMA_ACC 8
typedef short short16_t __attribute__((ext_vector_type(16)));
typedef float float8_t __attribute__((ext_vector_type(8)));
// Lane l holds row (l % 16) of A and of B, all 16 k; lanes 16-31 repeat lanes 0-15.
__device__ __forceinline__ int mma_row(int i) { return 2 * i + (threadIdx.x % 32) / 16; }
__device__ __forceinline__ int mma_col(int i) { return threadIdx.x % 16; }

struct mma_frag_t { short16_t v; };
#define MMA_LANE_K0 0
#define MMA_LANE_KN 16
__device__ __forceinline__ void mma_load_a(mma_frag_t& f, const bf16* A, int lda) {
    const int r = threadIdx.x % 16;
#pragma unroll
    for (int k = 0; k < 16; k++) f.v[k] = (short)A[r * lda + k];
}
__device__ __forceinline__ void mma_load_b(mma_frag_t& f, const bf16* B, int ldb) { mma_load_a(f, B, ldb); }
__device__ __forceinline__ void mma_load_bt(mma_frag_t& f, const bf16* Bt, int ldbt) {
    const int n = threadIdx.x % 16;
#pragma unroll
    for (int k = 0; k < 16; k++) f.v[k] = (short)Bt[k * ldbt + n];
}
__device__ __forceinline__ void mma16_frag(float* acc, const mma_frag_t& a, const mma_frag_t& b) {
    float8_t c;
#pragma unroll
    for (int i = 0; i < 8; i++) c[i] = acc[i];
    c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a.v, b.v, c);
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = c[i];
}

#elif defined(ATLAS_HIP) && (defined(__gfx1200__) || defined(__gfx1201__)) && \
    __has_builtin(__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12)
#define MMA_ACC 8
typedef short short8_t __attribute__((ext_vector_type(8)));
typedef float float8_t __attribute__((ext_vector_type(8)));
// Lane l holds row (l % 16) of A and of B, k = 8 * (l / 16) .. +7.
__device__ __forceinline__ int mma_row(int i) { return ((threadIdx.x % 32) / 16) * 8 + i; }
__device__ __forceinline__ int mma_col(int i) { return threadIdx.x % 16; }

struct mma_frag_t { short8_t v; };
#define MMA_LANE_K0 (((threadIdx.x % 32) / 16) * 8)
#define MMA_LANE_KN 8
__device__ __forceinline__ void mma_load_a(mma_frag_t& f, const bf16* A, int lda) {
    const int r = threadIdx.x % 16, k0 = ((threadIdx.x % 32) / 16) * 8;
#pragma unroll
    for (int k = 0; k < 8; k++) f.v[k] = (short)A[r * lda + k0 + k];
}
__device__ __forceinline__ void mma_load_b(mma_frag_t& f, const bf16* B, int ldb) { mma_load_a(f, B, ldb); }
__device__ __forceinline__ void mma_load_bt(mma_frag_t& f, const bf16* Bt, int ldbt) {
    const int n = threadIdx.x % 16, k0 = ((threadIdx.x % 32) / 16) * 8;
#pragma unroll
    for (int k = 0; k < 8; k++) f.v[k] = (short)Bt[(k0 + k) * ldbt + n];
}
__device__ __forceinline__ void mma16_frag(float* acc, const mma_frag_t& a, const mma_frag_t& b) {
    float8_t c;
#pragma unroll
    for (int i = 0; i < 8; i++) c[i] = acc[i];
    c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(a.v, b.v, c);
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = c[i];
}

#elif defined(ATLAS_HIP) && (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
                             defined(__gfx942__) || defined(__gfx950__)) && \
    __has_builtin(__builtin_amdgcn_mfma_f32_16x16x16bf16_1k)
#define MMA_ACC 4
typedef short short4_t __attribute__((ext_vector_type(4)));
typedef float float4_t __attribute__((ext_vector_type(4)));
// Lane l holds row (l % 16) of A and of B, k = 4 * (l / 16) .. +3.
__device__ __forceinline__ int mma_row(int i) { return ((threadIdx.x % 64) / 16) * 4 + i; }
__device__ __forceinline__ int mma_col(int i) { return threadIdx.x % 16; }

struct mma_frag_t { short4_t v; };
#define MMA_LANE_K0 (((threadIdx.x % 64) / 16) * 4)
#define MMA_LANE_KN 4
__device__ __forceinline__ void mma_load_a(mma_frag_t& f, const bf16* A, int lda) {
    const int r = threadIdx.x % 16, k0 = ((threadIdx.x % 64) / 16) * 4;
#pragma unroll
    for (int k = 0; k < 4; k++) f.v[k] = (short)A[r * lda + k0 + k];
}
__device__ __forceinline__ void mma_load_b(mma_frag_t& f, const bf16* B, int ldb) { mma_load_a(f, B, ldb); }
__device__ __forceinline__ void mma_load_bt(mma_frag_t& f, const bf16* Bt, int ldbt) {
    const int n = threadIdx.x % 16, k0 = ((threadIdx.x % 64) / 16) * 4;
#pragma unroll
    for (int k = 0; k < 4; k++) f.v[k] = (short)Bt[(k0 + k) * ldbt + n];
}
__device__ __forceinline__ void mma16_frag(float* acc, const mma_frag_t& a, const mma_frag_t& b) {
    float4_t c;
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = acc[i];
    c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.v, b.v, c, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] = c[i];
}

#else
#define MMA_ACC (256 / WARP_SIZE)
// No matrix cores: lane l computes elements l, l + WARP_SIZE, ... of the tile.
__device__ __forceinline__ int mma_row(int i) { return (threadIdx.x % WARP_SIZE + i * WARP_SIZE) / 16; }
__device__ __forceinline__ int mma_col(int i) { return (threadIdx.x % WARP_SIZE + i * WARP_SIZE) % 16; }

// The "fragment" is just where the tile lies: element (row r, k) at p[r * ld + k * k_step] (k_step
// is 1, or ld of the transpose for mma_load_bt); the product reads shared memory directly.
struct mma_frag_t { const bf16* p; int ld, k_step; };
__device__ __forceinline__ void mma_load_a(mma_frag_t& f, const bf16* A, int lda) { f = {A, lda, 1}; }
__device__ __forceinline__ void mma_load_b(mma_frag_t& f, const bf16* B, int ldb) { f = {B, ldb, 1}; }
__device__ __forceinline__ void mma_load_bt(mma_frag_t& f, const bf16* Bt, int ldbt) { f = {Bt, 1, ldbt}; }
// Each lane's dot products over k; with both operands k-contiguous, read in pairs (lda, ldb even)
// to halve the shared-memory loads.
__device__ __forceinline__ void mma16_frag(float* acc, const mma_frag_t& a, const mma_frag_t& b) {
#pragma unroll
    for (int i = 0; i < MMA_ACC; i++) {
        const int e = threadIdx.x % WARP_SIZE + i * WARP_SIZE, r = e / 16, c = e % 16;
        float s = 0.0f;
        if (a.k_step == 1 && b.k_step == 1) {
            const unsigned int* ar = (const unsigned int*)(a.p + r * a.ld);
            const unsigned int* br = (const unsigned int*)(b.p + c * b.ld);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const unsigned int u = ar[k], v = br[k];
                s += __uint_as_float(u << 16) * __uint_as_float(v << 16);
                s += __uint_as_float(u & 0xffff0000u) * __uint_as_float(v & 0xffff0000u);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 16; k++)
                s += bf16_to_f32(a.p[r * a.ld + k * a.k_step]) * bf16_to_f32(b.p[c * b.ld + k * b.k_step]);
        }
        acc[i] += s;
    }
}
#endif

#ifndef MMA16_NATIVE
// Where fragments are plain loads, the one-call product is the fragment product.
__device__ __forceinline__ void mma16(float* acc, const bf16* A, int lda, const bf16* B, int ldb) {
    mma_frag_t a, b;
    mma_load_a(a, A, lda);
    mma_load_b(b, B, ldb);
    mma16_frag(acc, a, b);
}
#endif

// The split products (see the top of this file).
#if defined(MMA_SPLIT_NATIVE) || defined(MMA_LANE_KN)
struct mma_split_t { mma_frag_t hi, lo; };
#ifndef MMA_SPLIT_NATIVE
// AMD: lane l holds row l % 16 (of A, or n of B), k MMA_LANE_K0 .. + MMA_LANE_KN, for both operands.
template <bool IS_B, class Get>
__device__ __forceinline__ void mma_split_fill(mma_frag_t& hi, mma_frag_t& lo, Get get) {
    const int r = threadIdx.x % 16, k0 = MMA_LANE_K0;
#pragma unroll
    for (int k = 0; k < MMA_LANE_KN; k++) {
        const float x = get(r, k0 + k);
        const bf16 h = f32_to_bf16(x);
        hi.v[k] = (short)h;
        lo.v[k] = (short)f32_to_bf16(x - bf16_to_f32(h));
    }
}
#endif
__device__ __forceinline__ void mma_split_a(mma_split_t& f, const float* A, int lda) {
    mma_split_fill<false>(f.hi, f.lo, [&](int r, int k) { return A[r * lda + k]; });
}
__device__ __forceinline__ void mma_split_at(mma_split_t& f, const float* At, int ldat) {
    mma_split_fill<false>(f.hi, f.lo, [&](int r, int k) { return At[k * ldat + r]; });
}
__device__ __forceinline__ void mma_split_b(mma_split_t& f, const float* B, int ldb) {
    mma_split_fill<true>(f.hi, f.lo, [&](int n, int k) { return B[n * ldb + k]; });
}
__device__ __forceinline__ void mma_split_bt(mma_split_t& f, const float* Bt, int ldbt) {
    mma_split_fill<true>(f.hi, f.lo, [&](int n, int k) { return Bt[k * ldbt + n]; });
}
__device__ __forceinline__ void mma16_split(float* acc, const mma_split_t& a, const mma_split_t& b) {
    mma16_frag(acc, a.lo, b.hi);
    mma16_frag(acc, a.hi, b.lo);
    mma16_frag(acc, a.hi, b.hi);
}
#else
// No matrix cores: where the operand lies (element (r, k) at p[r * ld + k * k_step]), and the
// product in f32.
struct mma_split_t { const float* p; int ld, k_step; };
__device__ __forceinline__ void mma_split_a(mma_split_t& f, const float* A, int lda) { f = {A, lda, 1}; }
__device__ __forceinline__ void mma_split_at(mma_split_t& f, const float* At, int ldat) { f = {At, 1, ldat}; }
__device__ __forceinline__ void mma_split_b(mma_split_t& f, const float* B, int ldb) { f = {B, ldb, 1}; }
__device__ __forceinline__ void mma_split_bt(mma_split_t& f, const float* Bt, int ldbt) { f = {Bt, 1, ldbt}; }
__device__ __forceinline__ void mma16_split(float* acc, const mma_split_t& a, const mma_split_t& b) {
#pragma unroll
    for (int i = 0; i < MMA_ACC; i++) {
        const int r = mma_row(i), c = mma_col(i);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; k++) s += a.p[r * a.ld + k * a.k_step] * b.p[c * b.ld + k * b.k_step];
        acc[i] += s;
    }
}
#endif

// The rows of a decode GEMV on matrix cores (kernels/linear.hip's bf16 kernels): one m16n8k16 bf16
// mma, f32 accumulation. a0, a2 hold row g's bf16 pairs at k (2t, 2t + 1) and (2t + 8, 2t + 9), a1,
// a3 row g + 8's; b0, b1 column g's at the same k (g = lane / 4, t = lane % 4). acc[0], acc[1] get
// row g at columns 2t, 2t + 1; acc[2], acc[3] row g + 8. NVIDIA sm_80+ only (BF16_ROWS_MMA):
// elsewhere those kernels keep their CUDA-core form.
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define BF16_ROWS_MMA 1
__device__ __forceinline__ void bf16_rows_mma(float* acc, unsigned int a0, unsigned int a1, unsigned int a2,
                                              unsigned int a3, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#else
#define BF16_ROWS_MMA 0
#endif
