// kernels/weight_layout.cu — an INT4 weight from the file's layout into the device layout, once,
// when a model is loaded; the same for the 4–6-bit codes and the high bits of the per-tensor
// formats (weight_formats.cuh), rows in plain order.
//
//   int4_to_tile_major   dst uint32 [ceil(N/16), K/128, 16, W] = src uint32 [N, K/128 · W] rearranged
//                        (W = 4·group_vecs words a row and group: 16 for 4-bit codes, 4 and 8
//                        for the 5- and 6-bit formats' high bits)
//
// The file stores INT4 weights row-major (layout id 1, format/quant.py); the INT4 kernels read
// them tile-major, each (16-row tile, 128-input group) item 1 KiB of contiguous memory with its
// rows in the MMA rows' order (int4_matmul.cuh: why and the definition; format/int4_tiles.py:
// the same on the host, which the test compares bit for bit). Rearranging on the GPU keeps the
// upload a straight DMA from the file's mapping (gpu_weights.py): the host never touches the bytes.
//
// Work split: one thread per 16-byte vector of dst, in dst's order (consecutive threads write
// consecutive vectors): vector e is vector q = e % V of slot m = (e / V) % 16 of item
// (tile j, group gi) = ((e / 16V) / (K/128), (e / 16V) % (K/128)), V = group_vecs (4 for the
// codes); it reads the same 16 bytes of group gi of the slot's matrix row (gemv_tile_rows: plain
// or RoPE-paired), or writes zeros for a slot past the last row. Block = 256 threads, grid =
// enough blocks for every vector.
// Bytes per call: the plane read once, written once padded to whole tiles (INT4 codes: N·K/2
// and ceil(N/16)·16·K/2, 34 MB each way for a 7B gate_proj), beside the copy into the scratch
// that src is (gpu_weights.py): those bytes cross HBM four times once per model load. The limit
// is HBM bandwidth; the reads are pieces of 16·group_vecs bytes (a row's group), which matters
// once per load.
// No shared memory, no barrier; src and dst never overlap (the launcher's caller passes a
// scratch copy as src).
#include "types.cuh"        // u32, u64
#include "int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, gemv_tile_rows

#define WL_THREADS 256

// grid (ceil(vectors / WL_THREADS)), block (WL_THREADS); vectors = ceil(N/16)·16·group_vecs·K/128.
extern "C" __global__ void __launch_bounds__(WL_THREADS)
int4_to_tile_major(uint4* __restrict__ dst,        // [ceil(N/16), K/128, 16, 4·group_vecs] uint32, out
                   const uint4* __restrict__ src,  // [N, K/128 · 4·group_vecs] uint32 (codes: layout id 1)
                   int N, int K, int pair_dim,     // pair_dim: 0 plain, Dh RoPE-paired (q, k, v)
                   int group_vecs) {               // 16-byte vectors a row and 128-input group: 4, 2 or 1
    const int groups = K / INT4_GROUP, row_vecs = groups * group_vecs;
    // In 32 bits: a plane is under 2^32 words (the launchers' rule), so under 2^30 vectors, and the
    // divisions by the runtime group_vecs stay 32-bit ones.
    const u32 vectors = (u32)int4_tiles(N) * INT4_TILE_ROWS * (u32)row_vecs;
    const u32 e = blockIdx.x * WL_THREADS + threadIdx.x;
    if (e >= vectors) return;
    const int q = (int)(e % (u32)group_vecs), m = (int)((e / (u32)group_vecs) % INT4_TILE_ROWS);
    const u32 item = e / ((u32)group_vecs * INT4_TILE_ROWS);
    const int j = (int)(item / groups), gi = (int)(item % groups);
    int lo, hi;
    gemv_tile_rows(j, m % 8, pair_dim, lo, hi);
    const int row = m < 8 ? lo : hi;
    dst[e] = row < N ? src[(u64)row * row_vecs + gi * group_vecs + q] : make_uint4(0u, 0u, 0u, 0u);
}
