// kernels/dev/gemm_int4/v1_mma_sync.cu — the prefill GEMM, version 1: Ampere's warp-level
// mma.sync (m16n8k16) fed by a 4-stage cp.async pipeline. Not a production kernel:
// tools/dev_kernels.py checks it against the float64 reference and times it beside
// kernels/gemm_int4.cu.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu: the outputs and
//   arguments of kernels/gemm_int4.cu's kernels of the same names, except x, a plain pointer
//   here (no TMA tensor map); grid (ceil(rows/64), weight-row blocks), block 128, 96 KiB smem.
//
// Source: kernels/gemm_int4.cu before commit b9fbcca (git show b9fbcca^:kernels/gemm_int4.cu),
// only its include path changed: NVRTC builds the same machine code for all four kernels.
//
// What it is: the straightforward tensor-core GEMM every later version is measured against.
// The weights are the A operand, so one 16-byte load of a weight row feeds 8 MMAs after the
// lop3 unpack (as in the decode GEMV); the activations are B; each 128-input group is summed in
// FP32 from exact INT4 codes and scaled once per group.
// Why it was replaced: mma.sync tops out far below Hopper's tensor-core rate — ~190 TFLOP/s
// measured against the H200's ~990 TFLOP/s dense FP16 peak. Only wgmma (v2 and later) gets
// further.
//
// Measured (H200, M = 512, 7B shapes, graph replay; this file's header at b9fbcca^, and the
// mma.sync column of kernels/gemm_int4.cu's table):
//   | GEMM    | µs    | TFLOP/s |
//   | qkv     | 136.6 | 124     |   (36 weight slices × 8 token tiles = 288 blocks: ~1.1 waves)
//   | o_proj  |  83.1 | 158     |
//   | gate_up | 654.4 | 213     |
//   | down    | 393.5 | 177     |
//   = 1.27 ms per layer, 188 TFLOP/s; 35.6 ms for 28 layers in kernels/gemm_int4.cu's table.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v1
//
// X is FP16 [M, K] row-major (the normed hidden states of the prompt's tokens), W is INT4
// [N, K] with one FP16 scale per 128 inputs (format/quant.py, layout id 1), and every product
// is summed in FP32: the tensor cores multiply the exact INT4 codes by FP16 activations, the
// FP32 sum of each 128-input group is multiplied by its scale once (as the decode GEMV does).
//
// Work split
// ----------
//   block   = 4 warps, a tile of BM = 64 tokens × 8 weight tiles of 16 rows (128 output
//             features; for gate/up 64 features of both matrices). grid = (ceil(M_max/64),
//             n_blocks): x walks the token tiles fastest, so the blocks that share one slice
//             of W run together and read it from L2, not HBM.
//   warp    = 2 weight tiles (32 rows of W) × all 64 tokens: 2 × 8 m16n8k16 MMAs per 16 inputs,
//             A = weights (rows), B = activations (tokens). The weights are the A operand so
//             that one 16-byte load of a weight row feeds 8 MMAs after the lop3 unpack, exactly
//             as in the decode GEMV (int4_matmul.cuh, ptx/mma.cuh: lane (g, t) supplies the k
//             positions {2t, 2t+1, 2t+8, 2t+9} from inputs 32t + 8i … +7 of its row; the
//             activation row of token g is read at the same inputs, so the k order matches).
//   K loop  = one 128-input group per step, GEMM_STAGES = 4 steps in flight through cp.async
//             (ptx/cp_async.cuh): 16 KB of activations (64 tokens × 256 B) and 8 KB of INT4
//             weights (128 rows × 64 B) per step. Each group's MMAs accumulate into a zeroed
//             FP32 tile that is then scaled by the rows' group scales and added to the output
//             accumulators (acc += s · tmp), so no FP16 rounding of the scaled weights.
//   epilogue= each output element is owned by exactly one lane of one block: the residual
//             read-modify-write needs no atomics, and the result is bit-reproducible.
//
// Shared memory: GEMM_STAGES × 24 KB = 96 KB dynamic (2 blocks per SM). Activation rows are
// stored with an XOR swizzle of their 16-byte chunks (gemm_a_chunk) so that the B-fragment
// reads — lanes (g, t) reading chunk 4t + i of token row g — hit 8 different bank groups per
// 8-lane phase; the weight rows (64 B each, lanes reading 16 B quads of consecutive rows) are
// conflict-free as stored.
//
// The row count M is read from device memory (prefill_state[1]): the launch list of a prompt
// chunk is built once per grid size and reused, and token tiles past M return at once. Rows
// of X past M are never read (zero-filled in shared memory) and outputs past M or N are never
// written.
//
// Requirements (asserted by the launchers): K % 128 == 0; for qkv, Nq and Nkv multiples of 16
// (true for every head_dim); any N ≥ 1 (rows past N load row N-1, never stored); pointers
// 16-byte aligned.
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "mma.cuh"          // mma_m16n8k16_f32_f16
#include "cp_async.cuh"     // cp_async_16, cp_async_commit, cp_async_wait
#include "../../int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, int4_a_fragments, int4_segment, swiglu_f16, …

#define GEMM_BM            64                               // tokens per block
#define GEMM_WARPS         4
#define GEMM_THREADS       (GEMM_WARPS * WARP_SIZE)
#define GEMM_WARP_TILES    2                                // 16-row weight tiles per warp
#define GEMM_BLOCK_TILES   (GEMM_WARPS * GEMM_WARP_TILES)   // 8 tiles = 128 weight rows
#define GEMM_TOKEN_TILES   (GEMM_BM / 8)                    // N = 8 tokens per MMA
#define GEMM_STAGES        4
#define GEMM_A_ROW_BYTES   (INT4_GROUP * 2)                 // 128 fp16 inputs of one token
#define GEMM_A_CHUNKS      (GEMM_A_ROW_BYTES / 16)          // 16-byte chunks per token row
#define GEMM_A_STAGE_BYTES (GEMM_BM * GEMM_A_ROW_BYTES)     // 16 KB
#define GEMM_W_ROW_BYTES   (INT4_GROUP / 2)                 // 128 nibbles = 16 words = 64 B
#define GEMM_W_STAGE_BYTES (GEMM_BLOCK_TILES * INT4_TILE_ROWS * GEMM_W_ROW_BYTES)  // 8 KB
#define GEMM_STAGE_BYTES   (GEMM_A_STAGE_BYTES + GEMM_W_STAGE_BYTES)
#define GEMM_SMEM_BYTES    (GEMM_STAGES * GEMM_STAGE_BYTES)  // 96 KB (tools/dev_gemm_int4.py mirrors it)

// Physical 16-byte chunk of logical chunk c (inputs 8c … 8c+7 of the group) in token row `row`.
// A warp's B-fragment read for word i touches chunks 4t + i (t = 0..3) of rows g = 0..7; an
// 8-lane phase is rows {2p, 2p+1} × t. XOR-ing bit 1 with t / 2 and bit 0 with the row's parity
// makes the 8 chunks of a phase land in 8 different 128-byte bank groups (bit 2 is t % 2).
__device__ __forceinline__ int gemm_a_chunk(int row, int c) {
    return c ^ ((c >> 3) << 1) ^ (row & 1);
}

// Up to three matrices stacked along N (q, k, v), or two read in pairs (gate, up).
template <int NSEG>
struct GemmProblem {
    const u32* qweight[NSEG];    // [n_s, K/8] uint32 each, layout id 1
    const __half* scales[NSEG];  // [n_s, K/128] fp16 each
    int n[NSEG];                 // rows of each matrix
    int first_tile[NSEG + 1];    // 16-row tile where each matrix starts (stacked; unused when paired)
};

template <int NSEG>
struct GemmTile {
    const u32* qweight;
    const __half* scales;
    int n;     // rows of the matrix
    int seg;   // which matrix
    int row0;  // first row of the tile within its matrix (may be ≥ n for a tile past the end)
};

// Block tile `bt` (0..7) of this block → its matrix and first row. Stacked: global tile
// blockIdx.y·8 + bt, the matrix found from first_tile. Paired (gate/up): bt = 2·f + m, feature
// tile blockIdx.y·4 + f, matrix m (0 gate, 1 up) — so a warp's two tiles are the same rows
// of gate and up.
template <int NSEG, bool PAIRED>
__device__ __forceinline__ GemmTile<NSEG> gemm_tile(const GemmProblem<NSEG>& p, int bt) {
    GemmTile<NSEG> r;
    if constexpr (PAIRED) {
        r.seg = bt & 1;
        r.row0 = (blockIdx.y * (GEMM_BLOCK_TILES / 2) + bt / 2) * INT4_TILE_ROWS;
    } else {
        const int tile = blockIdx.y * GEMM_BLOCK_TILES + bt;
        const int seg = int4_segment<NSEG>(p.first_tile, tile);
        r.seg = seg;
        const int first = NSEG == 1 ? 0 : int4_pick(seg, p.first_tile[0], p.first_tile[1], p.first_tile[NSEG - 1]);
        r.row0 = (tile - first) * INT4_TILE_ROWS;
    }
    if constexpr (NSEG == 1) {
        r.qweight = p.qweight[0]; r.scales = p.scales[0]; r.n = p.n[0];
    } else {
        r.qweight = int4_pick(r.seg, p.qweight[0], p.qweight[1], p.qweight[NSEG - 1]);
        r.scales = int4_pick(r.seg, p.scales[0], p.scales[1], p.scales[NSEG - 1]);
        r.n = int4_pick(r.seg, p.n[0], p.n[1], p.n[NSEG - 1]);
    }
    return r;
}

// The whole GEMM of one block: 64 tokens × 8 weight tiles × all of K, then
//   epilogue(seg, row, token, value)              once per output (not paired), or
//   epilogue(row, token, gate_value, up_value)    once per output feature (paired),
// for rows < n of their matrix and tokens < M only. Contains __syncthreads(): call from
// every thread of the block.
template <int NSEG, bool PAIRED, typename Epilogue>
__device__ __forceinline__ void gemm_int4_block(const GemmProblem<NSEG>& p,
                                                const __half* __restrict__ x,
                                                const int* __restrict__ prefill_state, int K,
                                                Epilogue epilogue) {
    extern __shared__ __align__(128) unsigned char gemm_smem[];  // GEMM_STAGES × (A | W)
    const int M = __ldg(prefill_state + 1);
    const int m0 = blockIdx.x * GEMM_BM;
    if (m0 >= M) return;  // the whole block: no barrier has been reached yet
    const int rows_here = min(GEMM_BM, M - m0);

    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int n_groups = K / INT4_GROUP;
    const int words_per_row = K / 8, groups_per_row = K / INT4_GROUP;

    // ---- what this thread copies each step --------------------------------------------------
    // Activations: chunk a_c of token rows a_r + 8j, j = 0..7 (1024 chunks / 128 threads).
    const int a_c = tid % GEMM_A_CHUNKS, a_r = tid / GEMM_A_CHUNKS;
    const int a_dst = a_r * GEMM_A_ROW_BYTES + gemm_a_chunk(a_r, a_c) * 16;  // + j·8 rows (parity kept)
    const __half* a_src = x + (u64)(m0 + a_r) * K + a_c * 8;
    // Weights: quad w_q (16 B = 4 words) of block rows w_r + 32j, j = 0..3 (512 quads / 128 threads).
    const int w_q = tid % 4, w_r = tid / 4;
    const u32* w_src[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int br = w_r + 32 * j;
        const GemmTile<NSEG> tl = gemm_tile<NSEG, PAIRED>(p, br / INT4_TILE_ROWS);
        // Rows past the matrix load its last row: valid memory, never stored.
        const int row = min(tl.row0 + br % INT4_TILE_ROWS, tl.n - 1);
        w_src[j] = tl.qweight + (u64)row * words_per_row + 4 * w_q;
    }
    auto issue = [&](int grp, int stage) {
        unsigned char* a_st = gemm_smem + stage * GEMM_STAGE_BYTES;
        unsigned char* w_st = a_st + GEMM_A_STAGE_BYTES;
#pragma unroll
        for (int j = 0; j < GEMM_BM / 8; ++j) {
            const bool valid = a_r + 8 * j < rows_here;
            cp_async_16(a_st + a_dst + 8 * j * GEMM_A_ROW_BYTES,
                        valid ? a_src + (u64)8 * j * K + grp * INT4_GROUP : x, valid);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cp_async_16(w_st + (w_r + 32 * j) * GEMM_W_ROW_BYTES + 16 * w_q,
                        w_src[j] + grp * (INT4_GROUP / 8), true);
    };

    // ---- this lane's rows: scales (read straight from global, one group ahead) --------------
    const __half* sc_ptr[GEMM_WARP_TILES][2];
#pragma unroll
    for (int mt = 0; mt < GEMM_WARP_TILES; ++mt) {
        const GemmTile<NSEG> tl = gemm_tile<NSEG, PAIRED>(p, GEMM_WARP_TILES * warp + mt);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            sc_ptr[mt][h] = tl.scales + (u64)min(tl.row0 + g + 8 * h, tl.n - 1) * groups_per_row;
    }
    float sc_next[GEMM_WARP_TILES][2];
#pragma unroll
    for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) sc_next[mt][h] = __half2float(__ldg(sc_ptr[mt][h]));

    float acc[GEMM_WARP_TILES][GEMM_TOKEN_TILES][4];
#pragma unroll
    for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

    // ---- the pipelined K loop ----------------------------------------------------------------
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < n_groups) issue(s, s);
        cp_async_commit();  // possibly empty: keeps the group count per step fixed
    }
    for (int grp = 0; grp < n_groups; ++grp) {
        cp_async_wait<GEMM_STAGES - 2>();  // this thread's copies of step grp have landed
        __syncthreads();                   // everyone's have; everyone is done with step grp-1
        {
            const int ahead = grp + GEMM_STAGES - 1;  // refills the stage step grp-1 used
            if (ahead < n_groups) issue(ahead, ahead % GEMM_STAGES);
            cp_async_commit();
        }
        float sc[GEMM_WARP_TILES][2];
#pragma unroll
        for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                sc[mt][h] = sc_next[mt][h];
                if (grp + 1 < n_groups) sc_next[mt][h] = __half2float(__ldg(sc_ptr[mt][h] + grp + 1));
            }

        const unsigned char* a_st = gemm_smem + (grp % GEMM_STAGES) * GEMM_STAGE_BYTES;
        const unsigned char* w_st = a_st + GEMM_A_STAGE_BYTES;
        uint4 wq[GEMM_WARP_TILES][2];  // words 4t … 4t+3 of rows g and g+8 of each tile
#pragma unroll
        for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                wq[mt][h] = *reinterpret_cast<const uint4*>(
                    w_st + ((GEMM_WARP_TILES * warp + mt) * INT4_TILE_ROWS + g + 8 * h) * GEMM_W_ROW_BYTES + 16 * t);

        float tmp[GEMM_WARP_TILES][GEMM_TOKEN_TILES][4];
#pragma unroll
        for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) tmp[mt][nt][e] = 0.f;

        // Word i of the lane's quad = inputs 32t + 8i … +7 of its two rows (i unrolled, so
        // the word selection below is resolved at compile time).
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 a_lo[GEMM_WARP_TILES][4], a_hi[GEMM_WARP_TILES][4];
#pragma unroll
            for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
                int4_a_fragments(wq[mt][0], wq[mt][1], i, a_lo[mt], a_hi[mt]);
#pragma unroll
            for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt) {
                if (nt * 8 >= rows_here) break;  // warp-uniform: no MMAs on absent tokens
                const int row = nt * 8 + g;
                const uint4 xb = *reinterpret_cast<const uint4*>(
                    a_st + row * GEMM_A_ROW_BYTES + gemm_a_chunk(row, 4 * t + i) * 16);
#pragma unroll
                for (int mt = 0; mt < GEMM_WARP_TILES; ++mt) {
                    mma_m16n8k16_f32_f16(tmp[mt][nt], a_lo[mt], xb.x, xb.y);  // inputs +0..+3
                    mma_m16n8k16_f32_f16(tmp[mt][nt], a_hi[mt], xb.z, xb.w);  // inputs +4..+7
                }
            }
        }

#pragma unroll
        for (int mt = 0; mt < GEMM_WARP_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt) {
                acc[mt][nt][0] = fmaf(sc[mt][0], tmp[mt][nt][0], acc[mt][nt][0]);
                acc[mt][nt][1] = fmaf(sc[mt][0], tmp[mt][nt][1], acc[mt][nt][1]);
                acc[mt][nt][2] = fmaf(sc[mt][1], tmp[mt][nt][2], acc[mt][nt][2]);
                acc[mt][nt][3] = fmaf(sc[mt][1], tmp[mt][nt][3], acc[mt][nt][3]);
            }
    }

    // ---- epilogue: lane (g, t) holds rows g, g+8 × tokens 2t, 2t+1 of each (tile, token tile)
    if constexpr (PAIRED) {
        const GemmTile<NSEG> tl = gemm_tile<NSEG, PAIRED>(p, GEMM_WARP_TILES * warp);
#pragma unroll
        for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int row = tl.row0 + g + 8 * h, tok = nt * 8 + 2 * t + e;
                    if (row < tl.n && tok < rows_here)
                        epilogue(row, m0 + tok, acc[0][nt][2 * h + e], acc[1][nt][2 * h + e]);
                }
    } else {
#pragma unroll
        for (int mt = 0; mt < GEMM_WARP_TILES; ++mt) {
            const GemmTile<NSEG> tl = gemm_tile<NSEG, PAIRED>(p, GEMM_WARP_TILES * warp + mt);
#pragma unroll
            for (int nt = 0; nt < GEMM_TOKEN_TILES; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int row = tl.row0 + g + 8 * h, tok = nt * 8 + 2 * t + e;
                        if (row < tl.n && tok < rows_here)
                            epilogue(tl.seg, row, m0 + tok, acc[mt][nt][2 * h + e]);
                    }
        }
    }
}

// out = X Wᵀ in FP32. grid (ceil(M_max/64), ceil(ceil(N/16)/8)), block (128), smem GEMM_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_int4_f32(float* __restrict__ out,              // [M, N] fp32, out
              const __half* __restrict__ x,         // [M, K] fp16
              const u32* __restrict__ qweight,      // [N, K/8] uint32, layout id 1
              const __half* __restrict__ scales,    // [N, K/128] fp16
              const int* __restrict__ prefill_state,// [2] int32: start (unused here), M
              int N, int K) {
    const GemmProblem<1> p = {{qweight}, {scales}, {N}, {0, int4_tiles(N)}};
    gemm_int4_block<1, false>(p, x, prefill_state, K, [&](int, int row, int tok, float v) {
        out[(u64)tok * N + row] = v;
    });
}

// [q | k | v] = X [Wq; Wk; Wv]ᵀ in FP32, one launch for the three (bias, RoPE and the FP16
// rounding happen once, in rope_kv_rows). grid (ceil(M_max/64), ceil((tq + 2·tkv)/8)).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_int4_qkv(float* __restrict__ qkv,               // [M, Nq + 2·Nkv] fp32, out: q | k | v per row
              const __half* __restrict__ x,          // [M, K] fp16 (normed hidden states)
              const u32* __restrict__ q_qweight,     // [Nq, K/8] uint32
              const __half* __restrict__ q_scales,   // [Nq, K/128] fp16
              const u32* __restrict__ k_qweight,     // [Nkv, K/8] uint32
              const __half* __restrict__ k_scales,   // [Nkv, K/128] fp16
              const u32* __restrict__ v_qweight,     // [Nkv, K/8] uint32
              const __half* __restrict__ v_scales,   // [Nkv, K/128] fp16
              const int* __restrict__ prefill_state, // [2] int32: start (unused here), M
              int Nq, int Nkv, int K) {
    const int tq = int4_tiles(Nq), tkv = int4_tiles(Nkv);
    const GemmProblem<3> p = {{q_qweight, k_qweight, v_qweight}, {q_scales, k_scales, v_scales},
                              {Nq, Nkv, Nkv}, {0, tq, tq + tkv, tq + 2 * tkv}};
    const int ld = Nq + 2 * Nkv;
    gemm_int4_block<3, false>(p, x, prefill_state, K, [&](int seg, int row, int tok, float v) {
        qkv[(u64)tok * ld + (seg == 0 ? 0 : seg == 1 ? Nq : Nq + Nkv) + row] = v;
    });
}

// residual += X Wᵀ in FP32 (the residual stream is FP32, docs/numerics.md#the-residual-stream-is-fp32). Each element is read
// and written by one lane: no atomics. grid (ceil(M_max/64), ceil(ceil(N/16)/8)).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_int4_residual(float* __restrict__ residual,          // [M, N] fp32, in/out
                   const __half* __restrict__ x,          // [M, K] fp16
                   const u32* __restrict__ qweight,       // [N, K/8] uint32
                   const __half* __restrict__ scales,     // [N, K/128] fp16
                   const int* __restrict__ prefill_state, // [2] int32: start (unused here), M
                   int N, int K) {
    const GemmProblem<1> p = {{qweight}, {scales}, {N}, {0, int4_tiles(N)}};
    gemm_int4_block<1, false>(p, x, prefill_state, K, [&](int, int row, int tok, float v) {
        residual[(u64)tok * N + row] += v;
    });
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ): a warp's two tiles are the same 16 features of gate_proj and
// up_proj, so the SwiGLU happens in registers (swiglu_f16, as in the decode GEMV).
// grid (ceil(M_max/64), ceil(ceil(F/16)/4)).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
gemm_int4_gate_up_swiglu(__half* __restrict__ h,                // [M, F] fp16, out
                         const __half* __restrict__ x,          // [M, K] fp16 (normed hidden)
                         const u32* __restrict__ gate_qweight,  // [F, K/8] uint32
                         const __half* __restrict__ gate_scales,// [F, K/128] fp16
                         const u32* __restrict__ up_qweight,    // [F, K/8] uint32
                         const __half* __restrict__ up_scales,  // [F, K/128] fp16
                         const int* __restrict__ prefill_state, // [2] int32: start (unused here), M
                         int F, int K) {
    const GemmProblem<2> p = {{gate_qweight, up_qweight}, {gate_scales, up_scales}, {F, F}, {0, 0, 0}};
    gemm_int4_block<2, true>(p, x, prefill_state, K, [&](int row, int tok, float gate, float up) {
        h[(u64)tok * F + row] = swiglu_f16(gate, up);
    });
}
