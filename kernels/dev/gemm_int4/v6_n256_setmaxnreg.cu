// kernels/dev/gemm_int4/v6_n256_setmaxnreg.cu — the prefill GEMM, version 6: 256 tokens per tile
// (wgmma m64n256k16, 128 accumulators a consumer thread), a producer warpgroup that gives its
// registers to the two consumer warpgroups (setmaxnreg). Not a production kernel:
// tools/dev_kernels.py checks it against the float64 reference and times it beside
// kernels/gemm_int4.cu. Its 12-warp block and its GEMM_BM builds are production's now (with
// split-K and the qkv_rope epilogue, the tile picked per GEMM); it stays as the version the
// tile sizes were first measured on, and for GEMM_A_SMEM=1, which lost (kernels/gemm_int4.cu's
// header: the table of both).
//
// Built with GEMM_BM=128 (production's tile) or GEMM_BM=64 it asks a second question: what the
// 12-warp block and its register moves cost or give at production's tile, and whether GEMMs with
// few tiles (the 0.5B's: its o_proj at 512 tokens is 28 tiles of 128 on 132 SMs) gain from
// tiles of 64 tokens.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu: the outputs of
//   kernels/gemm_int4.cu's kernels of the same names, without split-K (the arguments end at the
//   shapes, as before split-K); block 384, GEMM_SMEM_BYTES of shared memory, grid ≤ the SM count.
//
// The question it answers: is the mainloop limited by the unpack of the weights in the MMA
// warps? The A fragment of a group (one weight row pair's 128 inputs, ~110 instructions a lane to
// load, unpack and scale) feeds 8 MMAs of n tokens each; production's n = 128 gives each
// warpgroup 8 × m64n128k16 (~1024 tensor-core cycles) per unpack. Here n = 256: the same unpack
// feeds twice the MMA work, so if the unpack limits, the 7B's GEMMs at 512 tokens run up to ~2×
// the tensor-core rate per unpacked weight; if they do not speed up, the limit is elsewhere
// (the wait for each group's MMAs, the ring). What it costs: tiles of 256 tokens halve the tiles
// (the 7B's qkv at 512 tokens: 72 tiles on 132 SMs) and 128 accumulators need more than the 168
// registers a 384-thread block's threads get: the producer warpgroup drops to
// GEMM_PRODUCER_REGS, the consumers rise to GEMM_CONSUMER_REGS (ptx/setmaxnreg.cuh).
//
// Built with GEMM_BM=128 GEMM_A_SMEM=1 it asks a third: can a warpgroup overlap its own unpack
// with its MMAs if A comes from shared memory? Each consumer warpgroup stores its unpacked group
// into one of two A buffers (16 KB each: 64 rows × 128 inputs, 128-byte swizzle), fences
// (fence.proxy.async) and meets its four warps at a named barrier, issues 8 × m64n128k16 SS, and
// waits only for the group before (wait_group 1): the next group is unpacked into the other
// buffer while these MMAs run, and a stage's X is released one group late. ptxas keeps the
// HGMMAs back to back there (no C7513: no A registers), one WARPGROUP.DEPBAR.LE gsb0, 1 a group.
// Its cost: 32 STS.32 a lane a group (conflict-free: the swizzle spreads the lanes over the 32
// banks) and the fence (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in SASS); 224 KB of shared memory.
//
// Work split (what differs from kernels/gemm_int4.cu)
// ----------
//   tile     = 256 tokens × 128 weight rows (gate/up: 64 features of both), persistent as there.
//   block    = 12 warps: consumer warpgroups 0 and 1 (64 weight rows × 256 tokens each) and a
//              producer warpgroup whose first warp works as production's producer warp; its
//              other three warps give their registers back and exit.
//   stage    = one 128-input group: X 256 tokens × 128 inputs (two TMA boxes of 256 × 64, 128-byte
//              swizzle, 64 KB) + the 128 weight rows' 64 B (8 KB) = 72 KB; GEMM_STAGES = 3 (216 KB:
//              a fourth does not fit the 227 KB of shared memory).
//   consumer = per group 8 × wgmma m64n256k16 (A: the unpacked weights from registers, as in
//              production; B: the stage's X through a descriptor, 256 K-major rows).
//   epilogue = lane (g, t) owns rows g, g+8 × tokens 8j + 2t, +1, j = 0 … 31.
// The barriers and their protocol are production's (full: 33 arrivals; w_empty: every consumer
// lane after its commit; x_empty: lane 0 of each consumer warp after its wait), and so is the
// argument why they cannot race: only the ring depth (3) and the stage's size differ.
//
// Not a way forward (built, SASS read, no GPU needed): keeping one group's MMAs in flight while
// the next group is unpacked into a second fragment set (the group loop unrolled by two,
// wgmma.wait_group 1) — ptxas then serialises every wgmma (C7513: "non wgmma instructions
// defining input registers of a wgmma between start and end of the pipeline stage"; a
// WARPGROUP.DEPBAR after each HGMMA), even though the registers written are not those the MMAs
// in flight read. With A from registers, a warpgroup cannot unpack while its own MMAs run: the
// overlap has to come from the other warpgroup, or A has to come from shared memory.
//
// Bytes: the weights are read once per 256 tokens (half production's L2 traffic of W); X once per
// 128 weight rows, as there.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v6
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "tma.cuh"          // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "mbarrier.cuh"     // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "wgmma.cuh"        // wgmma_*, wgmma_desc_sw128, wgmma_m64n{64,128,256}k16_rs
#include "setmaxnreg.cuh"   // setmaxnreg_inc, setmaxnreg_dec, block_index, live_rows
#include "cp_async.cuh"     // cp_async_16, cp_async_wait, cp_async_mbarrier_arrive_noinc
#include "int4_unpack.cuh"  // lop3_and_or, INT4_MASK_LO, FP16X2_1024, FP16X2_1032
#include "../../int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, swiglu_f16
#include "griddep.cuh"      // grid_dependency_wait, grid_launch_dependents

// Tokens per tile (wgmma N): 256 by default; GEMM_BM=128 is production's tile in this block
// (12 warps, setmaxnreg), GEMM_BM=64 a tile for GEMMs with few tokens (the 0.5B's).
#ifndef GEMM_BM
#define GEMM_BM             256
#endif
static_assert(GEMM_BM == 64 || GEMM_BM == 128 || GEMM_BM == 256, "GEMM_BM: 64, 128 or 256");
#define GEMM_CONSUMER_WGS   2
#define GEMM_WG_ROWS        64                                 // weight rows per warpgroup (wgmma M)
#define GEMM_BLOCK_ROWS     (GEMM_CONSUMER_WGS * GEMM_WG_ROWS)  // 128
#define GEMM_CONSUMER_WARPS (GEMM_CONSUMER_WGS * 4)
#define GEMM_THREADS        ((GEMM_CONSUMER_WGS + 1) * 4 * WARP_SIZE)  // + the producer warpgroup: 384
// GEMM_A_SMEM=1: the consumers store each group's unpacked weights into shared memory and issue
// SS wgmma, one group of MMAs in flight while the next is unpacked (below).
#ifndef GEMM_A_SMEM
#define GEMM_A_SMEM         0
#endif
static_assert(!GEMM_A_SMEM || GEMM_BM == 128, "GEMM_A_SMEM: with 128 tokens a tile (the SS wrapper's N)");
#define GEMM_STAGES         (GEMM_BM == 256 ? 3 : 4)           // 3 × 72 KB; 4 × 40 KB; 4 × 24 KB
#define GEMM_BOX_INPUTS     64                                 // 128 B of FP16: one swizzle row
#define GEMM_BOX_BYTES      (GEMM_BM * GEMM_BOX_INPUTS * 2)    // 32 KB at GEMM_BM 256
#define GEMM_X_STAGE_BYTES  (2 * GEMM_BOX_BYTES)               // one 128-input group of X: 64 KB at 256
#define GEMM_W_ROW_BYTES    (INT4_GROUP / 2)                   // one group of one weight row: 64 B
#define GEMM_W_STAGE_BYTES  (GEMM_BLOCK_ROWS * GEMM_W_ROW_BYTES)  // 8 KB
#define GEMM_STAGE_BYTES    (GEMM_X_STAGE_BYTES + GEMM_W_STAGE_BYTES)  // 72 KB at 256 (a multiple of 1024)
#define GEMM_K_STEPS        (INT4_GROUP / 16)                  // 8 wgmma k16 steps per group
#define GEMM_FULL_ARRIVALS  (1 + WARP_SIZE)
// GEMM_A_SMEM: per consumer warpgroup two A buffers of one group (64 rows × 128 inputs FP16 in
// two 128-byte-swizzled boxes of 64 inputs, 16 KB): 64 KB.
#define GEMM_A_BOX_BYTES    (GEMM_WG_ROWS * GEMM_BOX_INPUTS * 2)  // 8 KB
#define GEMM_A_BUF_BYTES    (2 * GEMM_A_BOX_BYTES)                // 16 KB
#define GEMM_A_BYTES        (GEMM_A_SMEM ? GEMM_CONSUMER_WGS * 2 * GEMM_A_BUF_BYTES : 0)
#define GEMM_SMEM_BYTES     (GEMM_STAGES * GEMM_STAGE_BYTES + GEMM_A_BYTES + 1024 + 3 * GEMM_STAGES * 8)
#define GEMM_ACC            (GEMM_BM / 2)                      // accumulators a consumer thread: 128 at 256
// Registers a thread after the moves, balanced at the 168 a thread at launch (384 · 168 =
// 64 512): 2 · 128 · 216 + 128 · 72 at GEMM_BM 256 (128 accumulators), 2 · 128 · 200 + 128 · 104
// at 128 and 64 (the producer then keeps room for the qkv rows it recomputes).
#define GEMM_CONSUMER_REGS  (GEMM_BM == 256 ? 216 : 200)
#define GEMM_PRODUCER_REGS  (GEMM_BM == 256 ? 72 : 104)
static_assert(2 * 128 * GEMM_CONSUMER_REGS + 128 * GEMM_PRODUCER_REGS == GEMM_THREADS * 168, "the moves balance");
static_assert(GEMM_SMEM_BYTES <= 227 * 1024, "shared memory");

// Nibble pair t of word w (inputs 2t, 2t+1 of its 8) → half2 of the exact codes times the scale
// s2 (production's gemm_int4_pair).
__device__ __forceinline__ u32 gemm_int4_pair(u32 w, int shift, u32 s2) {
    const u32 biased = lop3_and_or(w >> shift, INT4_MASK_LO, FP16X2_1024);  // (1024 + v0, 1024 + v1)
    u32 q, out;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(FP16X2_1032));  // exact codes
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
    return out;
}

__device__ __forceinline__ u32 gemm_word(const uint4 (&q)[4], int j) {
    const uint4& v = q[j / 4];
    return (j & 3) == 0 ? v.x : (j & 3) == 1 ? v.y : (j & 3) == 2 ? v.z : v.w;
}

__device__ __forceinline__ void gemm_a_fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], int shift,
                                                  __half sa, __half sb, u32 (&frag)[GEMM_K_STEPS][4]) {
    const __half2 sa2 = __half2half2(sa), sb2 = __half2half2(sb);
    const u32 sa_u = *reinterpret_cast<const u32*>(&sa2), sb_u = *reinterpret_cast<const u32*>(&sb2);
#pragma unroll
    for (int s = 0; s < GEMM_K_STEPS; ++s) {
        frag[s][0] = gemm_int4_pair(gemm_word(ra, 2 * s), shift, sa_u);
        frag[s][1] = gemm_int4_pair(gemm_word(rb, 2 * s), shift, sb_u);
        frag[s][2] = gemm_int4_pair(gemm_word(ra, 2 * s + 1), shift, sa_u);
        frag[s][3] = gemm_int4_pair(gemm_word(rb, 2 * s + 1), shift, sb_u);
    }
}

struct GemmLaneRows {
    const u32* wa;    const u32* wb;      // the rows' INT4 words
    const __half* sa; const __half* sb;   // the rows' group scales
};

__device__ __forceinline__ void gemm_lane_row(const u32* qweight, const __half* scales, int row, int n, int K,
                                              const u32*& w, const __half*& s) {
    const int r = min(row, n - 1);
    w = qweight + (u64)r * (K / 8);
    s = scales + (u64)r * (K / INT4_GROUP);
}

// Rows local and local + 8 of a stage's weights, 64 B each (production's loads in gemm_group).
__device__ __forceinline__ void gemm_load_rows(const unsigned char* st, int local, uint4 (&ra)[4], uint4 (&rb)[4]) {
    const uint4* w = reinterpret_cast<const uint4*>(st + GEMM_X_STAGE_BYTES + local * GEMM_W_ROW_BYTES);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        ra[i] = w[i];
        rb[i] = w[8 * GEMM_W_ROW_BYTES / 16 + i];
    }
}

// The tile's MMA: wgmma m64nNk16 with N = GEMM_BM, chosen by the accumulator count.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 b, int acc) { wgmma_m64n64k16_rs(d, a, b, acc); }
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 b, int acc) { wgmma_m64n128k16_rs(d, a, b, acc); }
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const u32 (&a)[4], u64 b, int acc) { wgmma_m64n256k16_rs(d, a, b, acc); }
// The SS form (GEMM_A_SMEM): m64n128k16 only in ptx/wgmma.cuh.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 a, u64 b) { wgmma_m64n128k16_ss(d, a, b, 1); }

#if GEMM_A_SMEM
// GEMM_A_SMEM: the lane's unpacked A values of one group stored where wgmma reads an A tile of 64
// K-major rows in 128-byte-swizzled boxes of 64 inputs (what wgmma_desc_sw128 describes): row r
// at r · 128 B, its 16-byte chunk c at position c ^ (r % 8). Lane (g, t) of warp w holds rows
// 16w + g and 16w + g + 8 (both ≡ g mod 8) and, for k step s, inputs 16s + 2t (+1) and
// 16s + 8 + 2t (+1): chunk 2(s % 4) (and the next) of box s / 4, 4t bytes in. For one store the
// 32 lanes hit 32 different banks (chunk c ^ g, word t).
__device__ __forceinline__ void gemm_a_store(const uint4 (&ra)[4], const uint4 (&rb)[4], int shift, __half sa,
                                             __half sb, unsigned char* a, int wrow, int g, int t) {
    const __half2 sa2 = __half2half2(sa), sb2 = __half2half2(sb);
    const u32 sa_u = *reinterpret_cast<const u32*>(&sa2), sb_u = *reinterpret_cast<const u32*>(&sb2);
    unsigned char* row_a = a + (wrow + g) * 128 + 4 * t;
    unsigned char* row_b = row_a + 8 * 128;
#pragma unroll
    for (int s = 0; s < GEMM_K_STEPS; ++s) {
        const int box = (s / 4) * GEMM_A_BOX_BYTES, c = 2 * (s % 4);
        *reinterpret_cast<u32*>(row_a + box + ((c ^ g) << 4)) = gemm_int4_pair(gemm_word(ra, 2 * s), shift, sa_u);
        *reinterpret_cast<u32*>(row_b + box + ((c ^ g) << 4)) = gemm_int4_pair(gemm_word(rb, 2 * s), shift, sb_u);
        *reinterpret_cast<u32*>(row_a + box + (((c + 1) ^ g) << 4)) = gemm_int4_pair(gemm_word(ra, 2 * s + 1), shift, sa_u);
        *reinterpret_cast<u32*>(row_b + box + (((c + 1) ^ g) << 4)) = gemm_int4_pair(gemm_word(rb, 2 * s + 1), shift, sb_u);
    }
}

// bar.sync id, 128: the four warps of one consumer warpgroup (ids 1, 2; 0 is __syncthreads). The
// id an immediate: a register id makes ptxas reserve all 16 named barriers.
__device__ __forceinline__ void warpgroup_bar_sync(int wg) {
    if (wg == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
    else         asm volatile("bar.sync 2, 128;" ::: "memory");
}

// One group of a consumer warp with GEMM_A_SMEM: store the unpacked A into buffer `a`, make the
// warpgroup's stores visible to the tensor cores (each thread's fence.proxy.async, then the
// warpgroup's barrier), issue the 8 SS MMAs, and wait for the group before (wait_group 1) — the
// MMAs of this group run while the next one is unpacked into the other buffer. Returns with
// this group's MMAs in flight; the caller releases the previous stage's X.
// Why it cannot race: buffer a was last read by the MMAs of the group two back, complete since
// this warp's wait_group 1 in the group before this one (the MMA is one operation of the whole
// warpgroup; each warp stores only its own 16 rows of a); the MMAs read a only after every
// thread of the warpgroup has stored and fenced (the barrier). Stricter by the letter of the PTX
// ISA would be a second warpgroup barrier before the stores, so that every warp's wait precedes
// any warp's store: left out, a measured version can add it.
__device__ __forceinline__ void gemm_group_a_smem(int it, int lane, int shift, __half sa, __half sb, int local,
                                                  int wrow, int g, int t, int wg, const unsigned char* smem,
                                                  unsigned char* a, u64* full, u64* w_empty, float (&acc)[GEMM_ACC]) {
    const int s = it % GEMM_STAGES;
    mbarrier_wait_parity(&full[s], (it / GEMM_STAGES) & 1);
    const unsigned char* st = smem + s * GEMM_STAGE_BYTES;
    uint4 ra[4], rb[4];
    gemm_load_rows(st, local, ra, rb);
    gemm_a_store(ra, rb, shift, sa, sb, a, wrow, g, t);
    mbarrier_arrive(&w_empty[s]);  // every lane: its reads of this stage's weights are done
    fence_proxy_async_shared();
    warpgroup_bar_sync(wg);
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < GEMM_K_STEPS; ++k) {
        const u64 a_desc = wgmma_desc_sw128(a + (k / 4) * GEMM_A_BOX_BYTES + (k % 4) * 32);
        const u64 b_desc = wgmma_desc_sw128(st + (k / 4) * GEMM_BOX_BYTES + (k % 4) * 32);
        wgmma_ss(acc, a_desc, b_desc);
    }
    wgmma_commit_group();
    wgmma_wait_group<1>();
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
}

#endif  // GEMM_A_SMEM

// One group of a consumer warp, as production's gemm_group with m64nNk16, N = GEMM_BM.
__device__ __forceinline__ void gemm_group(int it, int local, int lane, int shift, __half sa, __half sb,
                                           const unsigned char* smem, u64* full, u64* x_empty, u64* w_empty,
                                           u32 (&frag)[GEMM_K_STEPS][4], float (&acc)[GEMM_ACC]) {
    const int s = it % GEMM_STAGES;
    mbarrier_wait_parity(&full[s], (it / GEMM_STAGES) & 1);
    const unsigned char* st = smem + s * GEMM_STAGE_BYTES;
    uint4 ra[4], rb[4];
    gemm_load_rows(st, local, ra, rb);
    gemm_a_fragments(ra, rb, shift, sa, sb, frag);
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < GEMM_K_STEPS; ++k) {
        const u64 desc = wgmma_desc_sw128(st + (k / 4) * GEMM_BOX_BYTES + (k % 4) * 32);
        wgmma_rs(acc, frag[k], desc, 1);
    }
    wgmma_commit_group();
    mbarrier_arrive(&w_empty[s]);  // every lane: its reads of this stage's weights are done
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) mbarrier_arrive(&x_empty[s]);  // the warp's MMAs are done reading X
}

// f(token, va, vb) for the lane's tokens < M: acc[4j + c] is (row g, token m0 + 8j + 2t + c),
// acc[4j + 2 + c] (row g+8, the same token), j < GEMM_BM / 8.
template <typename F>
struct GemmEachToken {
    F f;
    __device__ __forceinline__ void operator()(const float (&acc)[GEMM_ACC], int m0, int M, int t) {
#pragma unroll
        for (int j = 0; j < GEMM_BM / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int token = m0 + 8 * j + 2 * t + c;
                if (token < M) f(token, acc[4 * j + c], acc[4 * j + 2 + c]);
            }
    }
};
template <typename F>
__device__ __forceinline__ GemmEachToken<F> gemm_each_token(F f) { return GemmEachToken<F>{f}; }

// residual[token, row] += acc, the loads of 4 token columns issued together (production's
// GemmResidualAdd over GEMM_BM / 8 columns).
struct GemmResidualAdd {
    float* residual;
    int N;
    const int* ra;
    __device__ __forceinline__ void operator()(const float (&acc)[GEMM_ACC], int m0, int M, int t) {
        const int r0 = *ra, r1 = r0 + 8;
#pragma unroll
        for (int j0 = 0; j0 < GEMM_BM / 8; j0 += 4) {
            float old[4][4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = m0 + 8 * (j0 + jj) + 2 * t + c;
                    const bool live = token < M;
                    old[jj][c] = live && r0 < N ? residual[(u64)token * N + r0] : 0.f;
                    old[jj][2 + c] = live && r1 < N ? residual[(u64)token * N + r1] : 0.f;
                }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int token = m0 + 8 * (j0 + jj) + 2 * t + c;
                    if (token >= M) continue;
                    if (r0 < N) residual[(u64)token * N + r0] = old[jj][c] + acc[4 * (j0 + jj) + c];
                    if (r1 < N) residual[(u64)token * N + r1] = old[jj][2 + c] + acc[4 * (j0 + jj) + 2 + c];
                }
        }
    }
};

// The persistent tile loop (production's gemm_int4_block without split-K). Contains the block's
// only __syncthreads(): call from every thread.
template <typename RowsOf, typename Epilogue>
__device__ __forceinline__ void gemm_n256_block(const CUtensorMap& x_map, const int* __restrict__ prefill_state,
                                                int K, int row_blocks, RowsOf rows_of, Epilogue epilogue) {
    extern __shared__ unsigned char gemm_smem_raw[];
    const u32 raw = static_cast<u32>(__cvta_generic_to_shared(gemm_smem_raw));
    unsigned char* smem = gemm_smem_raw + ((1024u - (raw & 1023u)) & 1023u);
    u64* full = reinterpret_cast<u64*>(smem + GEMM_STAGES * GEMM_STAGE_BYTES + GEMM_A_BYTES);
    u64* x_empty = full + GEMM_STAGES;
    u64* w_empty = x_empty + GEMM_STAGES;

    grid_launch_dependents();
    grid_dependency_wait();
    const int M = __ldcg(prefill_state + 1);
    const int token_blocks = (M + GEMM_BM - 1) / GEMM_BM;
    const int n_units = token_blocks * row_blocks;
    if ((int)blockIdx.x >= n_units) return;  // the whole block, before any barrier
    const int n_groups = K / INT4_GROUP;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;

    if (threadIdx.x == 0) {
        for (int s = 0; s < GEMM_STAGES; ++s) {
            mbarrier_init(&full[s], GEMM_FULL_ARRIVALS);
            mbarrier_init(&x_empty[s], GEMM_CONSUMER_WARPS);
            mbarrier_init(&w_empty[s], GEMM_CONSUMER_WARPS * WARP_SIZE);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    if (warp >= GEMM_CONSUMER_WARPS) {  // ---- producer warpgroup --------------------------------
        setmaxnreg_dec<GEMM_PRODUCER_REGS>();
        if (warp != GEMM_CONSUMER_WARPS) return;  // one warp of the four works
        if (lane == 0) tma_prefetch_map(&x_map);
        const int token_blocks = (live_rows(prefill_state) + GEMM_BM - 1) / GEMM_BM;
        const int n_units = token_blocks * row_blocks;
        int it = 0;
        for (int u = block_index(); u < n_units; u += gridDim.x) {
            const int tb = u % token_blocks, rb = u / token_blocks;
            const int m0 = tb * GEMM_BM;
            for (int grp = 0; grp < n_groups; ++grp, ++it) {
                const int s = it % GEMM_STAGES;
                if (it >= GEMM_STAGES) mbarrier_wait_parity(&w_empty[s], ((it / GEMM_STAGES) - 1) & 1);
                unsigned char* w_st = smem + s * GEMM_STAGE_BYTES + GEMM_X_STAGE_BYTES + g * GEMM_W_ROW_BYTES + 16 * t;
#pragma unroll
                for (int w = 0; w < GEMM_CONSUMER_WARPS; ++w) {
                    // The rows again each group (not held across the loop: the producer has few registers).
                    const GemmLaneRows r = rows_of(rb, w * INT4_TILE_ROWS + g);
                    cp_async_16(w_st + (w * INT4_TILE_ROWS) * GEMM_W_ROW_BYTES, r.wa + grp * (INT4_GROUP / 8) + 4 * t, true);
                    cp_async_16(w_st + (w * INT4_TILE_ROWS + 8) * GEMM_W_ROW_BYTES, r.wb + grp * (INT4_GROUP / 8) + 4 * t, true);
                }
                cp_async_mbarrier_arrive_noinc(&full[s]);
                if (lane == 0) {
                    unsigned char* st = smem + s * GEMM_STAGE_BYTES;
                    if (it >= GEMM_STAGES) mbarrier_wait_parity(&x_empty[s], ((it / GEMM_STAGES) - 1) & 1);
                    mbarrier_arrive_expect_tx(&full[s], GEMM_X_STAGE_BYTES);
                    tma_load_2d(st, &x_map, grp * INT4_GROUP, m0, &full[s]);
                    tma_load_2d(st + GEMM_BOX_BYTES, &x_map, grp * INT4_GROUP + GEMM_BOX_INPUTS, m0, &full[s]);
                }
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }

    // ---- consumers --------------------------------------------------------------------------
    setmaxnreg_inc<GEMM_CONSUMER_REGS>();
    const int M_live = live_rows(prefill_state);
    const int token_blocks_c = (M_live + GEMM_BM - 1) / GEMM_BM;
    const int n_units_c = token_blocks_c * row_blocks;
    const int local = (warp / 4) * GEMM_WG_ROWS + (warp % 4) * INT4_TILE_ROWS + g;
    const int shift = 4 * t;
    int it = 0;
#pragma unroll 1
    for (int u = block_index(); u < n_units_c; u += gridDim.x) {
        const int tb = u % token_blocks_c, rb = u / token_blocks_c;
        const int m0 = tb * GEMM_BM;
        const GemmLaneRows r = rows_of(rb, local);
        float acc[GEMM_ACC];
#pragma unroll
        for (int i = 0; i < GEMM_ACC; ++i) acc[i] = 0.f;
        __half sa = r.sa[0], sb = r.sb[0];
#if GEMM_A_SMEM
        // One group's MMAs stay in flight: the stage of group grp − 1 is released after this
        // group's wait_group 1, the last one after the wait_group 0 below.
        unsigned char* abuf = smem + GEMM_STAGES * GEMM_STAGE_BYTES + (warp / 4) * 2 * GEMM_A_BUF_BYTES;
#pragma unroll 1
        for (int grp = 0; grp < n_groups; ++grp, ++it) {
            const __half na = r.sa[min(grp + 1, n_groups - 1)], nb = r.sb[min(grp + 1, n_groups - 1)];
            gemm_group_a_smem(it, lane, shift, sa, sb, local, (warp % 4) * INT4_TILE_ROWS, g, t, warp / 4, smem,
                              abuf + (grp & 1) * GEMM_A_BUF_BYTES, full, w_empty, acc);
            if (grp > 0 && lane == 0) mbarrier_arrive(&x_empty[(it - 1) % GEMM_STAGES]);
            sa = na;
            sb = nb;
        }
        wgmma_wait_group<0>();
#pragma unroll
        for (int i = 0; i < GEMM_ACC; ++i) wgmma_fence_operand(acc[i]);
        if (n_groups > 0 && lane == 0) mbarrier_arrive(&x_empty[(it - 1) % GEMM_STAGES]);
#else
        u32 frag[GEMM_K_STEPS][4];
#pragma unroll 1
        for (int grp = 0; grp < n_groups; ++grp, ++it) {
            const __half na = r.sa[min(grp + 1, n_groups - 1)], nb = r.sb[min(grp + 1, n_groups - 1)];
            gemm_group(it, local, lane, shift, sa, sb, smem, full, x_empty, w_empty, frag, acc);
            sa = na;
            sb = nb;
        }
#endif
        epilogue(acc, m0, M_live, t);
    }
}

struct GemmOneMatrixRows {
    const u32* qweight;
    const __half* scales;
    int N, K;
    int* ra;
    __device__ __forceinline__ GemmLaneRows operator()(int rb, int local) const {
        GemmLaneRows r;
        *ra = rb * GEMM_BLOCK_ROWS + local;
        gemm_lane_row(qweight, scales, *ra, N, K, r.wa, r.sa);
        gemm_lane_row(qweight, scales, *ra + 8, N, K, r.wb, r.sb);
        return r;
    }
};

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_f32(float* __restrict__ out,                  // [M, N] fp32, out
              const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]: box 256 × 64, 128-B swizzle
              const u32* __restrict__ qweight,          // [N, K/8] uint32, layout id 1
              const __half* __restrict__ scales,        // [N, K/128] fp16
              const int* __restrict__ prefill_state,    // [2] int32: start (unused here), M
              int N, int K) {
    int ra = 0;
    gemm_n256_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmOneMatrixRows{qweight, scales, N, K, &ra}, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * N + ra] = va;
        if (ra + 8 < N) out[(u64)token * N + ra + 8] = vb;
    }));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_qkv(float* __restrict__ qkv,                   // [M, Nq + 2·Nkv] fp32, out
              const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K]: box 256 × 64
              const u32* __restrict__ q_qweight,          // [Nq, K/8] uint32
              const __half* __restrict__ q_scales,        // [Nq, K/128] fp16
              const u32* __restrict__ k_qweight,          // [Nkv, K/8] uint32
              const __half* __restrict__ k_scales,        // [Nkv, K/128] fp16
              const u32* __restrict__ v_qweight,          // [Nkv, K/8] uint32
              const __half* __restrict__ v_scales,        // [Nkv, K/128] fp16
              const int* __restrict__ prefill_state,      // [2] int32: start (unused here), M
              int Nq, int Nkv, int K) {
    const int ld = Nq + 2 * Nkv;
    int ra = 0;
    gemm_n256_block(x_map, prefill_state, K, (ld + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS, [&](int rb, int local) {
        GemmLaneRows r;
        ra = rb * GEMM_BLOCK_ROWS + local;
        const int seg = ra < Nq ? 0 : ra < Nq + Nkv ? 1 : 2;
        const int first = seg == 0 ? 0 : seg == 1 ? Nq : Nq + Nkv;
        const u32* qw = seg == 0 ? q_qweight : seg == 1 ? k_qweight : v_qweight;
        const __half* sc = seg == 0 ? q_scales : seg == 1 ? k_scales : v_scales;
        const int n = seg == 0 ? Nq : Nkv;
        gemm_lane_row(qw, sc, ra - first, n, K, r.wa, r.sa);
        gemm_lane_row(qw, sc, ra + 8 - first, n, K, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < ld) qkv[(u64)token * ld + ra] = va;
        if (ra + 8 < ld) qkv[(u64)token * ld + ra + 8] = vb;
    }));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_residual(float* __restrict__ residual,           // [M, N] fp32, in/out
                   const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]: box 256 × 64
                   const u32* __restrict__ qweight,        // [N, K/8] uint32
                   const __half* __restrict__ scales,      // [N, K/128] fp16
                   const int* __restrict__ prefill_state,  // [2] int32: start (unused here), M
                   int N, int K) {
    int ra = 0;
    gemm_n256_block(x_map, prefill_state, K, (N + GEMM_BLOCK_ROWS - 1) / GEMM_BLOCK_ROWS,
                    GemmOneMatrixRows{qweight, scales, N, K, &ra}, GemmResidualAdd{residual, N, &ra});
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
gemm_int4_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                         const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K]: box 256 × 64
                         const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                         const __half* __restrict__ gate_scales,    // [F, K/128] fp16
                         const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                         const __half* __restrict__ up_scales,      // [F, K/128] fp16
                         const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                         int F, int K) {
    int f = 0;
    constexpr int FB = GEMM_BLOCK_ROWS / 2;
    gemm_n256_block(x_map, prefill_state, K, (F + FB - 1) / FB, [&](int rb, int local) {
        GemmLaneRows r;
        f = rb * FB + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        gemm_lane_row(gate_qweight, gate_scales, f, F, K, r.wa, r.sa);
        gemm_lane_row(up_qweight, up_scales, f, F, K, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u64)token * F + f] = swiglu_f16(gate, up);
    }));
}
