// kernels/kv_cache.cuh — the paged KV cache layout, shared by rope_kv.cu (writer), the
// attention kernels (readers) and decode_state.cu (page boundaries): the one place the layout
// is written down in C++ (docs/kv-cache.md; the Python side is src/drvqwen/kv_cache.py).
//
//   k_cache, v_cache : fp16 [L, P, Hkv, PAGE_TOKENS, Dh]  (layer, physical page, kv head,
//                      slot in page, dim). Kernels get the layer's base pointer [P, Hkv, 16, Dh].
//   block_table      : int32 [max_pages], logical page → physical page, shared by all layers.
//   Token at position t lives in logical page t / 16, slot t % 16.
//
// One page of one head is 16 · Dh · 2 bytes = 4 KiB at Dh = 128 (2 KiB at Dh = 64),
// contiguous: a warp reads a whole page of K (or V) for one head with 16-byte loads.
#pragma once
#include "types.cuh"

#define PAGE_TOKENS 16

// Element offset of (physical page, kv head, slot, dim 0) in a layer's cache.
__device__ __forceinline__ u64 kv_offset(int page, int kv_head, int slot, int n_kv_heads,
                                         int head_dim) {
    return (((u64)page * n_kv_heads + kv_head) * PAGE_TOKENS + slot) * head_dim;
}

// Elements from one physical page to the next in a layer's cache (kv_offset's page stride).
__device__ __forceinline__ int kv_page_elems(int n_kv_heads, int head_dim) {
    return n_kv_heads * PAGE_TOKENS * head_dim;
}
