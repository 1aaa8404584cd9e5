// Greedy sampling on the device: the index of the largest logit (lowest index on ties, as
// torch.argmax), among the first `limit` (or *limit_dev, in a recorded decode step), so only one id
// crosses to the host. Each block reduces a strided share of the logits and writes its best to
// part_v/part_i [gridDim.x]; the last block to finish (a ticket, reset afterwards) reduces those in
// block order. Launch: grid ARGMAX_BLOCKS, block 256.
#include "common/portable.h"

#define ARGMAX_BLOCKS 128

// (v, i) beats (bv, bi): larger value, or the same value at a lower index.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide reduction of each thread's (v, i); thread 0 gets the result.
__device__ __forceinline__ void argmax_block(float& v, int& i) {
    __shared__ float sv[256];
    __shared__ int si[256];
    sv[threadIdx.x] = v;
    si[threadIdx.x] = i;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && argmax_better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    v = sv[0];
    i = si[0];
}

ATLAS_KERNEL void argmax(const float* logits, int n, int limit, const int* limit_dev, float* part_v, int* part_i,
                         int* ticket, int* out) {
    __shared__ int is_last;
    if (limit_dev) limit = *limit_dev;
    const int end = min(n, limit);
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < end; i += gridDim.x * blockDim.x) {
        if (logits[i] > v) {
            v = logits[i];
            idx = i;
        }
    }
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = idx;
        __threadfence();
        is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    v = NEG_INF;
    idx = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        const float bv = ((const volatile float*)part_v)[b];
        const int bi = ((const volatile int*)part_i)[b];
        if (argmax_better(bv, bi, v, idx)) {
            v = bv;
            idx = bi;
        }
    }
    argmax_block(v, idx);
    if (threadIdx.x == 0) {
        out[0] = idx == 0x7fffffff ? 0 : idx;
        *ticket = 0;
    }
}
