// Hopper's warpgroup matrix multiply (wgmma.mma_async, NVIDIA sm_90a only; ATLAS_WGMMA is defined
// where it exists). Four warps (a warpgroup, 128 threads) compute D[64 x 128] (+)= A[64 x 16] ·
// B[128 x 16]ᵀ in f32 from bf16 operands that both lie in shared memory, K-major (k contiguous),
// in tiles of 64 bf16 (128 bytes) a row stored with the 128-byte swizzle: the 16-byte chunk c of
// row r sits at chunk c ^ (r % 8) of that row, and a tile starts on a 1024-byte boundary.
// Accumulators: 64 floats a thread; d[i] is row 16·warp + lane / 4 + 8·((i / 2) % 2), column
// 8·(i / 4) + 2·(lane % 4) + i % 2 of D (warp and lane within the warpgroup).
// Ordering: wg_fence() before the first wgmma that reads accumulators the threads wrote;
// wg_commit() after issuing; wg_wait0() before the accumulators or the operand tiles are touched
// again; wg_proxy_fence() after shared-memory stores that a wgmma will read (then a barrier).
#pragma once
#include "portable.h"

#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATLAS_WGMMA 1

// Byte offset of bf16 element (r, k) in a swizzled tile of 64-wide rows.
__device__ __forceinline__ int wg_swizzle(int r, int k) { return r * 128 + ((((k >> 3) ^ r) & 7) << 4) + (k & 7) * 2; }

// The operand descriptor of the 16-wide k slice at `k` of a swizzled tile starting at `tile`:
// start address, leading offset (unused with this swizzle: 1), stride between 8-row groups (1024
// bytes), layout 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(const void* tile, int k) {
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(tile) + k * 2;
    return (unsigned long long)((addr >> 4) & 0x3FFF) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// Keeps the compiler from moving or copying the accumulators across an asynchronous product (it
// would otherwise serialise the wgmmas).
__device__ __forceinline__ void wg_fence_operands(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A · Bᵀ for one 16-wide k slice; `accumulate` false overwrites d.
__device__ __forceinline__ void wg_mma_64x128x16(float (&d)[64], unsigned long long a, unsigned long long b, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"((int)accumulate));
}
#endif
