// kernels/dev/gemm_int4_wgmma.cu — experiment: the prefill GEMM Y = X Wᵀ over INT4 (layout id 1)
// weights on Hopper's warpgroup MMA (wgmma) with the activations staged by TMA.
//
//   gemm_int4_wgmma_f32   out fp32[M, N] = X Wᵀ      (the shape of gemm_int4.cu's gemm_int4_f32)
//
// X is FP16 [M, K] row-major, W is INT4 [N, K] (8 nibbles per uint32, NIBBLE_ORDER of
// ptx/int4_unpack.cuh) with one FP16 scale per 128 inputs. The kernel is an experiment under
// kernels/dev/: drvqwen's prefill still runs gemm_int4.cu; tests/dev/test_gemm_int4_wgmma.py
// checks this one against the reference and times it next to gemm_int4_f32.
//
// The limit: tensor-core math. gemm_int4.cu's mma.sync reaches ~190 TFLOP/s at the 7B shapes
// (M = 512); the H200's dense FP16 peak is ~990 TFLOP/s and only wgmma reaches it.
//
// Work split
// ----------
//   block    = 128 weight rows × 128 tokens, 9 warps: two consumer warpgroups (warps 0–3, 4–7),
//              each 64 weight rows × the block's 128 tokens, and one producer warp (warp 8).
//              grid = (ceil(M/128), ceil(N/128)), x fastest: the blocks that read one slice
//              of W run together and share it through L2.
//   producer = one lane issues the TMA copies of X: per 128-input group, two boxes of 128 tokens
//              × 64 inputs (128 B rows, 128-byte swizzle: the layout wgmma reads), 32 KB,
//              into a ring of WGMMA_STAGES stages guarded by mbarriers (full: bytes landed;
//              empty: all 8 consumer warps are done with the stage).
//   consumer = weights A straight from global memory into registers, one 128-input group
//              ahead: lane (g, t) loads the 64 bytes of the group of its rows g and g+8 (the 4
//              lanes of a quad load the same bytes; L1 serves them) and unpacks the nibble pair
//              t of every word: inputs (16s + 2t, 16s + 2t + 1) and (16s + 8 + 2t, +9) of step s —
//              exactly the k positions of the wgmma A fragment (ptx/wgmma.cuh). The exact codes
//              are multiplied by the row's group scale in FP16 (one rounding of the scaled
//              weight, relative 2⁻¹¹: the tensor cores then sum all of K in FP32, with no
//              per-group accumulator to rescale and no wait between groups).
//              Per group: 8 × wgmma m64n128k16 (A: registers, B: the stage through a
//              descriptor), one commit, one wait (see wgmma_group for why not double-buffered
//              A fragments); the two warpgroups interleave, one unpacking while the other's
//              MMAs run.
//   epilogue = lane (g, t) owns rows g, g+8 × tokens 8j + 2t, +1 (j = 0..15): written once,
//              no atomics; tokens ≥ M and rows ≥ N are not written.
//
// Bytes per block and group: 32 KB of X (TMA, from L2: every weight slice's blocks re-read
// X), 8 KB of weights (global loads, L2), 2 × 128 × 128 × 128 × 2 = 8.4 MFLOP.
// Shared memory: WGMMA_STAGES × 32 KB + barriers (+1 KB to align the ring to 1024 B, the
// swizzle atom) → 1 block per SM; registers: 64 accumulators + 32 A fragments + 32 words
// of weights per lane, capped at 224 by __launch_bounds__(288, 1) (65 536 / 288).
//
// Requirements (asserted by the test's launcher): K % 128 == 0; X's rows 16-byte aligned (TMA);
// any M ≥ 1, N ≥ 1 (rows past N read row N-1, never stored; tokens past M read as zero by TMA).
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "tma.cuh"          // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "mbarrier.cuh"     // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "wgmma.cuh"        // wgmma_*, wgmma_desc_sw128
#include "int4_unpack.cuh"  // lop3_and_or, INT4_MASK_LO, FP16X2_1024, FP16X2_1032
#include "../int4_matmul.cuh"  // INT4_GROUP

#define WGMMA_CONSUMER_WGS   2
#define WGMMA_WG_ROWS        64                                // weight rows per warpgroup (wgmma M)
#define WGMMA_BLOCK_ROWS     (WGMMA_CONSUMER_WGS * WGMMA_WG_ROWS)  // 128
#define WGMMA_BN             128                               // tokens per block (wgmma N)
#define WGMMA_CONSUMER_WARPS (WGMMA_CONSUMER_WGS * 4)
#define WGMMA_THREADS        ((WGMMA_CONSUMER_WARPS + 1) * WARP_SIZE)  // + the producer warp
#define WGMMA_STAGES         4
#define WGMMA_BOX_INPUTS     64                                // 128 B of FP16: the swizzle row
#define WGMMA_BOX_BYTES      (WGMMA_BN * WGMMA_BOX_INPUTS * 2)  // 16 KB
#define WGMMA_STAGE_BYTES    (2 * WGMMA_BOX_BYTES)             // one 128-input group: 32 KB
#define WGMMA_K_STEPS        (INT4_GROUP / 16)                 // 8 wgmma k16 steps per group
#define WGMMA_SMEM_BYTES     (WGMMA_STAGES * WGMMA_STAGE_BYTES + 1024 + 2 * WGMMA_STAGES * 8)

// Nibble pair t of word w (inputs 2t, 2t+1 of its 8) → half2 of the exact codes, times the
// scale s2 (both halves the row's group scale). See ptx/int4_unpack.cuh for the magic number.
__device__ __forceinline__ u32 wgmma_int4_pair(u32 w, int shift, u32 s2) {
    const u32 biased = lop3_and_or(w >> shift, INT4_MASK_LO, FP16X2_1024);  // (1024 + v0, 1024 + v1)
    u32 q, out;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(biased), "r"(FP16X2_1032));  // exact codes
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(q), "r"(s2));
    return out;
}

__device__ __forceinline__ u32 wgmma_word(const uint4 (&q)[4], int j) {
    const uint4& v = q[j / 4];
    return (j & 3) == 0 ? v.x : (j & 3) == 1 ? v.y : (j & 3) == 2 ? v.z : v.w;
}

// The A fragments of one group (8 k steps × 4 registers) from the raw words of rows g and g+8.
__device__ __forceinline__ void wgmma_a_fragments(const uint4 (&ra)[4], const uint4 (&rb)[4], int shift,
                                                  __half sa, __half sb, u32 (&frag)[WGMMA_K_STEPS][4]) {
    const __half2 sa2 = __half2half2(sa), sb2 = __half2half2(sb);
    const u32 sa_u = *reinterpret_cast<const u32*>(&sa2), sb_u = *reinterpret_cast<const u32*>(&sb2);
#pragma unroll
    for (int s = 0; s < WGMMA_K_STEPS; ++s) {
        frag[s][0] = wgmma_int4_pair(wgmma_word(ra, 2 * s), shift, sa_u);
        frag[s][1] = wgmma_int4_pair(wgmma_word(rb, 2 * s), shift, sb_u);
        frag[s][2] = wgmma_int4_pair(wgmma_word(ra, 2 * s + 1), shift, sa_u);
        frag[s][3] = wgmma_int4_pair(wgmma_word(rb, 2 * s + 1), shift, sb_u);
    }
}

__device__ __forceinline__ void wgmma_load_group(const uint4* wa, const uint4* wb, int grp,
                                                 uint4 (&ra)[4], uint4 (&rb)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        ra[i] = __ldg(wa + grp * 4 + i);
        rb[i] = __ldg(wb + grp * 4 + i);
    }
}

// One 128-input group of a consumer warp: unpack its weights into the A fragments, prefetch
// the next group's words (plain loads: they are no wgmma operand), wait for the stage, issue
// the 8 MMAs and wait for them. The wait is for all of them (wait_group 0): rewriting A
// registers while an MMA that reads any A register is in flight makes ptxas serialize every
// wgmma of the kernel (its C7513 "Potential Performance Loss"), so the unpack of the next group
// overlaps the other warpgroup's MMAs instead of this one's.
__device__ __forceinline__ void wgmma_group(int grp, int n_groups, int lane, int shift,
                                            const uint4* wa, const uint4* wb,
                                            const __half* sa, const __half* sb,
                                            const unsigned char* smem, u64* full, u64* empty,
                                            uint4 (&ra)[4], uint4 (&rb)[4],
                                            u32 (&frag)[WGMMA_K_STEPS][4], float (&acc)[64]) {
    wgmma_a_fragments(ra, rb, shift, sa[grp], sb[grp], frag);
    if (grp + 1 < n_groups) wgmma_load_group(wa, wb, grp + 1, ra, rb);
    const int s = grp % WGMMA_STAGES;
    mbarrier_wait_parity(&full[s], (grp / WGMMA_STAGES) & 1);
    const unsigned char* st = smem + s * WGMMA_STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < WGMMA_K_STEPS; ++k) {
        const u64 desc = wgmma_desc_sw128(st + (k / 4) * WGMMA_BOX_BYTES + (k % 4) * 32);
        wgmma_m64n128k16_rs(acc, frag[k], desc, 1);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) mbarrier_arrive(&empty[s]);  // this warp is done with the stage
}

extern "C" __global__ void __launch_bounds__(WGMMA_THREADS, 1)
gemm_int4_wgmma_f32(const __grid_constant__ CUtensorMap x_map,  // X fp16 [M, K], box 128 × 64, SW128
                    const u32* __restrict__ qweight,            // [N, K/8] uint32, layout id 1
                    const __half* __restrict__ scales,          // [N, K/128] fp16
                    float* __restrict__ out,                    // [M, N] fp32
                    int M, int N, int K) {
    extern __shared__ unsigned char wgmma_smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<u64>(wgmma_smem_raw) + 1023) & ~u64(1023));  // swizzle atoms: 1024-aligned
    u64* full = reinterpret_cast<u64*>(smem + WGMMA_STAGES * WGMMA_STAGE_BYTES);
    u64* empty = full + WGMMA_STAGES;

    const int n_groups = K / INT4_GROUP;
    const int m0 = blockIdx.x * WGMMA_BN;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    if (threadIdx.x == 0) {
        for (int s = 0; s < WGMMA_STAGES; ++s) {
            mbarrier_init(&full[s], 1);                       // the producer's expect_tx arrival
            mbarrier_init(&empty[s], WGMMA_CONSUMER_WARPS);   // lane 0 of every consumer warp
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the last block-wide barrier: the roles part here

    if (warp == WGMMA_CONSUMER_WARPS) {  // ---- producer ---------------------------------------
        if (lane == 0) {
            tma_prefetch_map(&x_map);
            for (int grp = 0; grp < n_groups; ++grp) {
                const int s = grp % WGMMA_STAGES;
                if (grp >= WGMMA_STAGES) mbarrier_wait_parity(&empty[s], ((grp / WGMMA_STAGES) - 1) & 1);
                unsigned char* st = smem + s * WGMMA_STAGE_BYTES;
                mbarrier_arrive_expect_tx(&full[s], WGMMA_STAGE_BYTES);
                tma_load_2d(st, &x_map, grp * INT4_GROUP, m0, &full[s]);
                tma_load_2d(st + WGMMA_BOX_BYTES, &x_map, grp * INT4_GROUP + WGMMA_BOX_INPUTS, m0, &full[s]);
            }
        }
        return;
    }

    // ---- consumers --------------------------------------------------------------------------
    const int wg = warp / 4, wi = warp % 4;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int row_a = blockIdx.y * WGMMA_BLOCK_ROWS + wg * WGMMA_WG_ROWS + wi * 16 + g;
    const int row_b = row_a + 8;
    const int words_per_row = K / 8, groups_per_row = K / INT4_GROUP;
    const uint4* wa = reinterpret_cast<const uint4*>(qweight + (u64)min(row_a, N - 1) * words_per_row);
    const uint4* wb = reinterpret_cast<const uint4*>(qweight + (u64)min(row_b, N - 1) * words_per_row);
    const __half* sa = scales + (u64)min(row_a, N - 1) * groups_per_row;
    const __half* sb = scales + (u64)min(row_b, N - 1) * groups_per_row;
    const int shift = 4 * t;  // nibble pair t: bits 4t … 4t+3 of each 16-bit half

    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    u32 frag[WGMMA_K_STEPS][4];
    uint4 ra[4], rb[4];
    wgmma_load_group(wa, wb, 0, ra, rb);

#pragma unroll 1
    for (int grp = 0; grp < n_groups; ++grp)
        wgmma_group(grp, n_groups, lane, shift, wa, wb, sa, sb, smem, full, empty, ra, rb, frag, acc);

    // ---- epilogue ---------------------------------------------------------------------------
#pragma unroll
    for (int j = 0; j < WGMMA_BN / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int token = m0 + 8 * j + 2 * t + c;
            if (token >= M) continue;
            if (row_a < N) out[(u64)token * N + row_a] = acc[4 * j + c];
            if (row_b < N) out[(u64)token * N + row_b] = acc[4 * j + 2 + c];
        }
    }
}
