// Vendor portability for Atlas kernels: the few places where HIP (AMD) and CUDA (NVIDIA) differ.
// Kernels include only this header, never a toolkit header, so that NVRTC and hipRTC compile them
// with no include path (a user needs only the driver and the run-time compiler library).
#pragma once

#if defined(__HIPCC__) || defined(__HIPCC_RTC__) || defined(__HIP_DEVICE_COMPILE__)
#define ATLAS_HIP 1
// Wave64 on CDNA (gfx9), wave32 on RDNA (gfx10+) as HIP compiles by default. ROCm 7.2's compiler
// no longer defines __AMDGCN_WAVEFRONT_SIZE (deprecated since 6.3): then the family macros tell.
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__)
#define WARP_SIZE 32
#else
#define WARP_SIZE 64
#endif
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor(v, mask); }
__device__ __forceinline__ float shfl(float v, int src_lane) { return __shfl(v, src_lane); }
#else
#define WARP_SIZE 32
__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
__device__ __forceinline__ float shfl(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
#endif

#define ATLAS_KERNEL extern "C" __global__

// Programmatic dependent launch (NVIDIA sm_90+; nothing elsewhere). A kernel launched with
// Runtime::launch_early may start while the previous kernel runs: it calls pdl_wait() before it
// reads or writes anything the previous kernel touches. pdl_launch_dependents() lets the next
// kernel start now (it still waits for this one's writes in its pdl_wait).
__device__ __forceinline__ void pdl_wait() {
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

typedef unsigned short bf16;

// No math header under the run-time compilers: spell infinity by its bits.
#define NEG_INF __int_as_float(0xff800000)

// bf16 <-> f32 by bit operations: no cuda_bf16.h / hip_bf16.h needed (ROCm 5.2 lacks the latter).
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(((unsigned int)x) << 16); }

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // keep NaN a NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
    return (bf16)(u >> 16);
}

// Eight bf16 values row[c .. c+8) as one 16-byte piece, those at or past `n` read as zero: how the
// attention kernels pad a head whose size is not a multiple of their tiles. With `whole` (row
// 16-byte aligned and n a multiple of 8: every head size but odd ones) a piece is one load.
__device__ __forceinline__ uint4 load8_bf16(const bf16* row, int c, int n, bool whole) {
    if (whole) return c < n ? *(const uint4*)(row + c) : make_uint4(0, 0, 0, 0);
    unsigned int w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const unsigned int lo = c + 2 * j < n ? row[c + 2 * j] : 0u;
        const unsigned int hi = c + 2 * j + 1 < n ? row[c + 2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Two floats to packed bf16 (lo in the low half), rounded to nearest even like f32_to_bf16: one
// instruction on NVIDIA sm_80+, the bit operations elsewhere.
__device__ __forceinline__ unsigned int bf16x2_pack(float lo, float hi) {
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
#endif
}

// f16 <-> f32 (no cuda_fp16.h / hip_fp16.h): two floats to a packed pair (lo in the low half),
// rounded to nearest even (one instruction on NVIDIA sm_80+), and one half back.
__device__ __forceinline__ unsigned int f16x2_pack(float lo, float hi) {
#if defined(ATLAS_HIP)
    return (unsigned int)__builtin_bit_cast(unsigned short, (_Float16)lo) |
           ((unsigned int)__builtin_bit_cast(unsigned short, (_Float16)hi) << 16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;  // one instruction, the same rounding
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    unsigned int r;
    asm("{ .reg .f16 l, h;\n cvt.rn.f16.f32 l, %1;\n cvt.rn.f16.f32 h, %2;\n mov.b32 %0, {l, h}; }"
        : "=r"(r) : "f"(lo), "f"(hi));
    return r;
#endif
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
#if defined(ATLAS_HIP)
    return (float)__builtin_bit_cast(_Float16, h);
#else
    float f;
    asm("{ .reg .f16 t;\n mov.b16 t, %1;\n cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Copies from global to shared memory that land later (cp.async, NVIDIA sm_80+), so that a block
// keeps many more bytes in flight than its registers hold: async_copy16 (16 bytes, both addresses
// 16-byte aligned) and async_copy4 write zeros instead when `valid` is false (then `src` is not
// read); async_commit() closes the copies this thread issued since the last call into a group;
// async_wait<N>() returns once at most N of this thread's groups are still in flight (a barrier
// then shows every thread's copies to the block). Elsewhere the copy is done on the spot and the
// waits have nothing to wait for.
#if !defined(ATLAS_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ASYNC_COPY 1
__device__ __forceinline__ void async_copy16(void* dst, const void* src, bool valid) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void async_copy4(void* dst, const void* src, bool valid) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Asks for the line holding `p` in L1, holding no register (a later load finds it there).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
#else
#define ASYNC_COPY 0
__device__ __forceinline__ void async_copy16(void* dst, const void* src, bool valid) {
    *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ void async_copy4(void* dst, const void* src, bool valid) {
    *(unsigned int*)dst = valid ? *(const unsigned int*)src : 0u;
}
__device__ __forceinline__ void async_commit() {}
template <int N>
__device__ __forceinline__ void async_wait() {}
__device__ __forceinline__ void prefetch_l1(const void*) {}
#endif

// Launch bounds: at most `threads` per block, and on NVIDIA a register budget that lets
// `min_blocks` blocks share an SM (HIP's second argument means something else, so it gets none).
#if defined(ATLAS_HIP)
#define ATLAS_LAUNCH_BOUNDS(threads, min_blocks) __attribute__((amdgpu_flat_work_group_size(1, threads)))
#else
#define ATLAS_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#endif

// Sum over a warp; every lane gets the total. The butterfly order is fixed, so results are
// reproducible run after run.
__device__ __forceinline__ float warp_sum(float v) {
    for (int m = WARP_SIZE / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, shfl_xor(v, m));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of WARP_SIZE, at most 1024); all threads get it.
// `scratch` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; w++) total += scratch[w];
    return total;
}
