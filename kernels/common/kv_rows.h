// The KV cache lives in one pool of blocks of KV_BLOCK positions, shared by every sequence
// (src/backend/gpu/kv.rs): keys and values are each [blocks, KV_BLOCK, kv_heads * head_dim] bf16,
// and a sequence's block table lists the block that holds each run of KV_BLOCK positions of one
// layer: position p lies in block table[p / KV_BLOCK], row p % KV_BLOCK.
//
// KvRows: where each row of a decode-shaped step reads and writes its KV cache: the caches and
// positions of up to KV_ROWS sequences, passed by value as one kernel parameter
// (src/backend/gpu/runtime.rs lays out the same struct). Row t belongs to sequence
// min(t, count - 1), at that sequence's position + (t - its first row): one sequence of T rows
// (prefill, checking drafts) has count 1; a batched step of several sequences one row each.
#pragma once
#include "portable.h"

#define KV_ROWS 8
#define KV_BLOCK 64

struct KvRows {
    bf16* keys[KV_ROWS];        // the pool's keys, one pointer per sequence
    bf16* values[KV_ROWS];      // the pool's values
    const int* tables[KV_ROWS]; // each sequence's block table
    int pos[KV_ROWS];           // each sequence's first row's position
    int count;                  // sequences, 1..KV_ROWS
};

// Offset (in values) of position p's row in a pool of rows of `width` values.
__device__ __forceinline__ long kv_offset(const int* table, int p, int width) {
    return ((long)table[p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK) * width;
}

__device__ __forceinline__ int kv_row_seq(const KvRows& r, int t) {
    return min(t, r.count - 1);
}

// Row t's position: from `pos_dev` (a recorded step's positions on the device, one per sequence)
// when it is not null, else from the struct.
__device__ __forceinline__ int kv_row_pos(const KvRows& r, const int* pos_dev, int t) {
    const int s = kv_row_seq(r, t);
    return (pos_dev ? pos_dev[s] : r.pos[s]) + t - s;
}
