// kernels/weight_layout.cu — an INT4 weight from the file's layout into the device layout, once,
// when a model is loaded; the same for the 4–6-bit codes and the high bits of the per-tensor
// formats (weight_formats.cuh), rows in plain order, and the q4_k/q5_k scales as lane words.
//
//   int4_to_tile_major     dst uint32 [ceil(N/16), K/128, 16, W] = src uint32 [N, K/128 · W] rearranged
//                          (W = 4·group_vecs words a row and group: 16 for 4-bit codes, 4 and 8
//                          for the 5- and 6-bit formats' high bits)
//   kquant_scales_to_lanes lanes uint4 [S] = scales uint32 [S, 3], aux uint32 [S] (S super-blocks:
//                          the 12 packed bytes and (d, dmin) of each) as four lane words each
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

// A q4_k/q5_k weight's scales (S = N·K/256 super-blocks) as the lane words of weight_formats.cuh,
// word t = sc_t | m_t << 6 | sc_{t+4} << 12 | m_{t+4} << 18 | D_t << 24, the four of a super-block
// one 16-byte vector of `lanes` (format/kquant_lanes.py: the same on the host, which the test
// compares bit for bit). The (sc, m) of sub-block j from the 12 bytes q as gguf's
// get_scale_min_k4 (ggml-quants.c) reads them: sc = q[j] & 63, m = q[j + 4] & 63 for j < 4, else
// sc = (q[j + 4] & 15) | (q[j − 4] >> 6) << 4 and m = (q[j + 4] >> 4) | (q[j] >> 6) << 4.
// D_0 … D_3: the bytes of (d, dmin).
// Work split: one thread per super-block, which reads its 16 bytes and writes its vector; no
// shared memory, no barrier; lanes never overlaps scales or aux (the caller passes a scratch copy
// of the file's planes as those, gpu_weights.py). Bytes: 16 a super-block read and 16 written
// (16 of every 144 bytes of a q4_k weight, 16 of 176 of a q5_k one), once per load; the limit is
// HBM bandwidth, which makes it a small part of a load's upload of the same weights.
// grid (ceil(S / WL_THREADS)), block (WL_THREADS).
extern "C" __global__ void __launch_bounds__(WL_THREADS)
kquant_scales_to_lanes(uint4* __restrict__ lanes,        // [S] uint4: the lane words, out
                       const u32* __restrict__ scales,   // [S, 3] uint32: the 12 packed bytes
                       const u32* __restrict__ aux,      // [S] uint32: fp16 (d, dmin)
                       int supers) {                     // S (3·S < 2^31: the launcher's rule)
    const u32 i = blockIdx.x * WL_THREADS + threadIdx.x;
    if (i >= (u32)supers) return;
    const u32 s0 = scales[3u * i], s1 = scales[3u * i + 1u], s2 = scales[3u * i + 2u], dd = aux[i];
    u32 w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const u32 a = (s0 >> (8 * t)) & 0xFFu, b = (s1 >> (8 * t)) & 0xFFu, c = (s2 >> (8 * t)) & 0xFFu;
        const u32 sc_lo = a & 0x3Fu, m_lo = b & 0x3Fu;                          // sub-block t
        const u32 sc_hi = (c & 0xFu) | ((a >> 6) << 4), m_hi = (c >> 4) | ((b >> 6) << 4);  // t + 4
        w[t] = sc_lo | (m_lo << 6) | (sc_hi << 12) | (m_hi << 18) | (((dd >> (8 * t)) & 0xFFu) << 24);
    }
    lanes[i] = make_uint4(w[0], w[1], w[2], w[3]);
}
