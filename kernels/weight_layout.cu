// kernels/weight_layout.cu — an INT4 weight from the file's layout into the device layout, once,
// when a model is loaded.
//
//   int4_to_tile_major   dst uint32 [ceil(N/16), K/128, 16, 16] = src uint32 [N, K/8] rearranged
//
// The file stores INT4 weights row-major (layout id 1, format/quant.py); the INT4 kernels read
// them tile-major, each (16-row tile, 128-input group) item 1 KiB of contiguous memory with its
// rows in the MMA rows' order (int4_matmul.cuh: why and the definition; format/int4_tiles.py:
// the same on the host, which the test compares bit for bit). Rearranging on the GPU keeps the
// upload a straight DMA from the file's mapping (gpu_weights.py): the host never touches the bytes.
//
// Work split: one thread per 16-byte vector of dst, in dst's order (consecutive threads write
// consecutive vectors): vector e is word quad q = e % 4 of slot m = (e / 4) % 16 of item
// (tile j, group gi) = ((e / 64) / (K/128), (e / 64) % (K/128)); it reads the same 16 bytes of
// group gi of the slot's matrix row (gemv_tile_rows: plain or RoPE-paired), or writes zeros
// for a slot past the last row. Block = 256 threads, grid = enough blocks for every vector.
// Bytes per call: N·K/2 read, ceil(N/16)·16·K/2 written (34 MB each way for a 7B gate_proj),
// beside the copy into the scratch that src is (gpu_weights.py): the weights cross HBM four
// times once per model load. The limit is HBM bandwidth; the reads are 64-byte pieces (a
// row's group), which matters once per load.
// No shared memory, no barrier; src and dst never overlap (the launcher's caller passes a
// scratch copy as src).
#include "types.cuh"        // u32, u64
#include "int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, gemv_tile_rows

#define WL_THREADS 256

// grid (ceil(vectors / WL_THREADS)), block (WL_THREADS); vectors = ceil(N/16)·16·K/32.
extern "C" __global__ void __launch_bounds__(WL_THREADS)
int4_to_tile_major(uint4* __restrict__ dst,        // [ceil(N/16), K/128, 16, 16] uint32, out
                   const uint4* __restrict__ src,  // [N, K/8] uint32, layout id 1
                   int N, int K, int pair_dim) {   // pair_dim: 0 plain, Dh RoPE-paired (q, k, v)
    const int groups = K / INT4_GROUP, row_vecs = K / 32;  // 16-byte vectors of a row: 4 a group
    const u64 vectors = (u64)int4_tiles(N) * INT4_TILE_ROWS * row_vecs;
    const u64 e = (u64)blockIdx.x * WL_THREADS + threadIdx.x;
    if (e >= vectors) return;
    const int q = (int)(e % 4), m = (int)((e / 4) % INT4_TILE_ROWS);
    const u64 item = e / (4 * INT4_TILE_ROWS);
    const int j = (int)(item / groups), gi = (int)(item % groups);
    int lo, hi;
    gemv_tile_rows(j, m % 8, pair_dim, lo, hi);
    const int row = m < 8 ? lo : hi;
    dst[e] = row < N ? src[(u64)row * row_vecs + gi * 4 + q] : make_uint4(0u, 0u, 0u, 0u);
}
