// Where each row of a decode-shaped step reads and writes its KV cache: the caches and positions
// of up to KV_ROWS sequences, passed by value as one kernel parameter (src/backend/gpu/runtime.rs
// lays out the same struct: `KvRows`). Row t belongs to sequence min(t, count - 1), at that
// sequence's position + (t - its first row): one sequence of T rows (prefill, checking drafts) has
// count 1; a batched step of several sequences one row each.
#pragma once
#include "portable.h"

#define KV_ROWS 8

struct KvRows {
    bf16* keys[KV_ROWS];    // [capacity, kv_heads * head_dim] each
    bf16* values[KV_ROWS];  // the same
    int pos[KV_ROWS];       // each sequence's first row's position
    int count;              // sequences, 1..KV_ROWS
};

__device__ __forceinline__ int kv_row_seq(const KvRows& r, int t) {
    return min(t, r.count - 1);
}

// Row t's position: from `pos_dev` (a recorded step's positions on the device, one per sequence)
// when it is not null, else from the struct.
__device__ __forceinline__ int kv_row_pos(const KvRows& r, const int* pos_dev, int t) {
    const int s = kv_row_seq(r, t);
    return (pos_dev ? pos_dev[s] : r.pos[s]) + t - s;
}
