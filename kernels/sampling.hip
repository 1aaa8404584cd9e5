// Greedy sampling on the device: the index of the largest logit (lowest index on ties, as
// torch.argmax), so only one id crosses to the host. Launch: one block of 1024 threads.
#include "common/portable.h"

ATLAS_KERNEL void argmax(const float* logits, int n, int limit, int* out) {
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    float v = NEG_INF;
    int idx = 0x7fffffff;
    const int end = min(n, limit);
    for (int i = threadIdx.x; i < end; i += blockDim.x) {
        if (logits[i] > v) {
            v = logits[i];
            idx = i;
        }
    }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = best_i[0];
}
