// kernels/dev/gemm_int4/v2_wgmma_cluster2.cu — the prefill GEMM, version 2: Hopper's warpgroup
// MMA (wgmma) with the activations staged by TMA, one block per 128 × 128 tile, and clusters of
// 2 CTAs along the weight rows that share each activation stage through one multicast TMA copy.
// Not a production kernel: tools/dev_kernels.py checks it against the float64 reference and
// times it beside kernels/gemm_int4.cu, built twice: GEMM_CLUSTER=2 (the default) and
// GEMM_CLUSTER=1, the plain form without clusters.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu: the arguments
//   of kernels/gemm_int4.cu's kernels of the same names; grid (ceil(rows/128), weight-row
//   blocks rounded up to a multiple of GEMM_CLUSTER), block 288, smem GEMM_SMEM_BYTES.
//
// Source: kernels/gemm_int4.cu at commit 96e0ea5, with that commit's ptx/cluster.cuh and
// multicast TMA copy in cluster.cuh beside this file; NVRTC builds the same machine code for all
// four kernels as from that commit's tree, with either GEMM_CLUSTER.
//
// What changes from v1: the MMA is wgmma m64n128k16, issued by two consumer warpgroups (64
// weight rows × 128 tokens each) while a producer warp fills a 4-stage mbarrier ring with the
// activations by TMA (128-byte swizzle: the layout wgmma reads from shared memory). The weights
// are wgmma's A operand from registers, unpacked and multiplied by their group scale in FP16
// (one rounding per weight), so the tensor cores sum all of K into one FP32 accumulator; the
// consumers load them straight from global memory, one group ahead. With GEMM_CLUSTER=2 each CTA
// of a cluster loads one of a stage's two 64-input boxes and multicasts it to both, and a
// consumer warp releases the stage on the empty barriers of both CTAs.
// Why clusters: two CTAs that multiply the same 128 tokens by different weight rows read the
// activations through L2 once instead of twice. Why they lost: L2 bandwidth was not the limit,
// and a stage shared by two CTAs can be refilled only when both are done with it: the coupling
// stalls both (kernels/gemm_int4.cu's header).
//
// Measured (H200, the four 7B GEMMs of 28 layers at M = 512, tools/bench_gemm.py of that commit;
// commit 386602b's message and kernels/gemm_int4.cu's header):
//   | GEMM_CLUSTER | 28 layers |
//   | 2            | 24.9 ms   |
//   | 1            | 16.5 ms   |
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v2
//
// X is FP16 [M, K] row-major (the normed hidden states of the prompt's tokens, the attention
// output, or h), W is INT4 [N, K] with one FP16 scale per 128 inputs (format/quant.py, layout
// id 1: 8 nibbles per uint32 in NIBBLE_ORDER, ptx/int4_unpack.cuh).
//
// Work split
// ----------
//   block    = 128 weight rows × 128 tokens (for gate/up: 64 features of both matrices), 9 warps:
//              two consumer warpgroups (warps 0–3, 4–7), each 64 weight rows × the block's 128
//              tokens, and one producer warp (warp 8). grid = (ceil(rows/128), row blocks), x
//              fastest: the blocks that read one slice of W run together and share it in L2.
//   producer = one lane issues the TMA copies of X (tensor map: box 128 tokens × 64 inputs,
//              128-byte swizzle — the layout wgmma reads): per 128-input group two boxes,
//              32 KB, into a ring of GEMM_STAGES stages guarded by mbarriers (full: the bytes
//              landed; empty: all 8 consumer warps are done with the stage).
//   consumer = the weights are wgmma's A operand, from registers: lane (g, t) loads the 64
//              bytes of one group of its rows g and g+8 (one group ahead; the 4 lanes of a quad
//              load the same bytes, L1 serves them) and unpacks nibble pair t of every word:
//              inputs (16s + 2t, +1) and (16s + 8 + 2t, +9) of k step s — exactly the k positions
//              of the A fragment (ptx/wgmma.cuh), because B, the activations, comes from shared
//              memory in its natural order. The exact codes are multiplied by the row's group
//              scale in FP16 (one rounding of each scaled weight, relative ≤ 2⁻¹¹,
//              docs/numerics.md), so the tensor cores sum all of K in FP32 with no per-group
//              rescaling of the accumulators.
//              Per group: 8 × wgmma m64n128k16 (B: the stage, through a descriptor), one commit,
//              one wait; the two warpgroups interleave, one unpacking while the other's MMAs run.
//   epilogue = lane (g, t) owns rows g, g+8 × tokens 8j + 2t, +1 (j = 0..15): each output element
//              is written by exactly one lane (the residual read-modify-write needs no atomics,
//              the result is bit-reproducible); tokens ≥ M and rows ≥ N are not written. For
//              gate/up, row g of a warp's 16 is gate feature f and row g+8 is up feature f, so
//              the SwiGLU happens in registers.
//
// The row count M is read from device memory (prefill_state[1]): the launch list of a prompt
// chunk is built once per row capacity and reused; blocks whose tokens all lie past M return at
// once. The tensor map covers the buffer's capacity rows: tokens past M are read (stale or NaN,
// they are another column of the MMA) but never written; rows past the capacity read as zero.
//
// Shared memory: GEMM_STAGES × 32 KB + 1 KB (to align the ring to the 1024-byte swizzle atom)
// + barriers: 1 block per SM. Registers: 64 accumulators + 32 A fragments + 32 weight words
// per lane (168 in all, ptxas), under the 224 that __launch_bounds__(288, 1) allows.
//
// Requirements (asserted by the launchers): K % 128 == 0; for qkv, Nq and Nkv multiples of 16
// (a warp's 16 rows lie in one matrix); any N ≥ 1 (rows past N read row N-1, never stored);
// X's rows 16-byte aligned (TMA).
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64, WARP_SIZE, QUAD_SIZE
#include "tma.cuh"          // CUtensorMap, tma_load_2d, tma_prefetch_map
#include "mbarrier.cuh"     // mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "cluster.cuh"      // cluster_sync, cluster_ctarank, cluster_map_shared, mbarrier_arrive_cluster
#include "wgmma.cuh"        // wgmma_*, wgmma_desc_sw128
#include "int4_unpack.cuh"  // lop3_and_or, INT4_MASK_LO, FP16X2_1024, FP16X2_1032
#include "../../int4_matmul.cuh"  // INT4_GROUP, INT4_TILE_ROWS, swiglu_f16

#define GEMM_CONSUMER_WGS   2
#define GEMM_WG_ROWS        64                                 // weight rows per warpgroup (wgmma M)
#define GEMM_BLOCK_ROWS     (GEMM_CONSUMER_WGS * GEMM_WG_ROWS)  // 128
#define GEMM_BM             128                                // tokens per block (wgmma N)
#define GEMM_CONSUMER_WARPS (GEMM_CONSUMER_WGS * 4)
#define GEMM_THREADS        ((GEMM_CONSUMER_WARPS + 1) * WARP_SIZE)  // + the producer warp: 288
#define GEMM_STAGES         4
#define GEMM_BOX_INPUTS     64                                 // 128 B of FP16: one swizzle row
#define GEMM_BOX_BYTES      (GEMM_BM * GEMM_BOX_INPUTS * 2)    // 16 KB
#define GEMM_STAGE_BYTES    (2 * GEMM_BOX_BYTES)               // one 128-input group: 32 KB
#define GEMM_K_STEPS        (INT4_GROUP / 16)                  // 8 wgmma k16 steps per group
#define GEMM_SMEM_BYTES     (GEMM_STAGES * GEMM_STAGE_BYTES + 1024 + 2 * GEMM_STAGES * 8)  // tools/dev_gemm_int4.py mirrors it
// CTAs per cluster along grid y (weight-row blocks that share the same 128 tokens): each loads
// one of a stage's two 64-input boxes and multicasts it to both, so the activations cross L2
// once per cluster, not once per block. 1 = no cluster (tools/dev_gemm_int4.py mirrors the value).
#ifndef GEMM_CLUSTER
#define GEMM_CLUSTER 2
#endif
static_assert(GEMM_CLUSTER == 1 || GEMM_CLUSTER == 2, "a stage's two boxes are split among the cluster's CTAs");

// Nibble pair t of word w (inputs 2t, 2t+1 of its 8) → half2 of the exact codes, times the
// scale s2 (both halves the row's group scale). See ptx/int4_unpack.cuh for the magic number.
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

// The A fragments of one group (8 k steps × 4 registers) from the raw words of rows g and g+8.
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

__device__ __forceinline__ void gemm_load_group(const uint4* wa, const uint4* wb, int grp,
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
__device__ __forceinline__ void gemm_group(int grp, int n_groups, int lane, int shift,
                                            const uint4* wa, const uint4* wb,
                                            const __half* sa, const __half* sb,
                                            const unsigned char* smem, u64* full, u64* empty,
                                            uint4 (&ra)[4], uint4 (&rb)[4],
                                            u32 (&frag)[GEMM_K_STEPS][4], float (&acc)[64]) {
    gemm_a_fragments(ra, rb, shift, sa[grp], sb[grp], frag);
    if (grp + 1 < n_groups) gemm_load_group(wa, wb, grp + 1, ra, rb);
    const int s = grp % GEMM_STAGES;
    mbarrier_wait_parity(&full[s], (grp / GEMM_STAGES) & 1);
    const unsigned char* st = smem + s * GEMM_STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < GEMM_K_STEPS; ++k) {
        const u64 desc = wgmma_desc_sw128(st + (k / 4) * GEMM_BOX_BYTES + (k % 4) * 32);
        wgmma_m64n128k16_rs(acc, frag[k], desc, 1);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) {  // this warp is done with the stage, in every CTA that received it
        if constexpr (GEMM_CLUSTER == 1) {
            mbarrier_arrive(&empty[s]);
        } else {
#pragma unroll
            for (int c = 0; c < GEMM_CLUSTER; ++c) mbarrier_arrive_cluster(cluster_map_shared(&empty[s], c));
        }
    }
}

// What one consumer lane multiplies: its two weight rows (g and g+8 of its warp's 16), each a
// row of some matrix (clamped into it: rows past the end are read, never stored).
struct GemmLaneRows {
    const uint4* wa;  const uint4* wb;    // the rows' INT4 words (16-byte quads)
    const __half* sa; const __half* sb;   // the rows' group scales
};

__device__ __forceinline__ void gemm_lane_row(const u32* qweight, const __half* scales, int row, int n, int K,
                                              const uint4*& w, const __half*& s) {
    const int r = min(row, n - 1);
    w = reinterpret_cast<const uint4*>(qweight + (u64)r * (K / 8));
    s = scales + (u64)r * (K / INT4_GROUP);
}

// The whole GEMM of one block; RowsOf(local_row 0..127) → the lane's rows is called once per
// consumer lane; then epilogue(acc, m0, M, t) with the lane's 64 accumulators (gemm_each_token
// walks them). Contains the block's only __syncthreads(): call from every thread.
template <typename RowsOf, typename Epilogue>
__device__ __forceinline__ void gemm_int4_block(const CUtensorMap& x_map, const int* __restrict__ prefill_state,
                                                int K, RowsOf rows_of, Epilogue epilogue) {
    extern __shared__ unsigned char gemm_smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<u64>(gemm_smem_raw) + 1023) & ~u64(1023));  // swizzle atoms: 1024-aligned
    u64* full = reinterpret_cast<u64*>(smem + GEMM_STAGES * GEMM_STAGE_BYTES);
    u64* empty = full + GEMM_STAGES;

    const int M = __ldg(prefill_state + 1);
    const int m0 = blockIdx.x * GEMM_BM;
    if (m0 >= M) return;  // the whole block, before any barrier
    const int n_groups = K / INT4_GROUP;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    if (threadIdx.x == 0) {
        for (int s = 0; s < GEMM_STAGES; ++s) {
            mbarrier_init(&full[s], 1);  // the producer's expect_tx arrival
            // lane 0 of every consumer warp of every CTA the stage is multicast to
            mbarrier_init(&empty[s], GEMM_CONSUMER_WARPS * GEMM_CLUSTER);
        }
        fence_mbarrier_init();
    }
    // The block-wide (cluster-wide) barrier after which the roles part: every CTA's barriers
    // are initialised before any copy or arrival of the cluster can reach them.
    if constexpr (GEMM_CLUSTER > 1) cluster_sync(); else __syncthreads();

    if (warp == GEMM_CONSUMER_WARPS) {  // ---- producer ----------------------------------------
        if (lane == 0) {
            tma_prefetch_map(&x_map);
            const int rank = GEMM_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
            for (int grp = 0; grp < n_groups; ++grp) {
                const int s = grp % GEMM_STAGES;
                if (grp >= GEMM_STAGES) mbarrier_wait_parity(&empty[s], ((grp / GEMM_STAGES) - 1) & 1);
                unsigned char* st = smem + s * GEMM_STAGE_BYTES;
                // The whole stage lands here: with a cluster, half of it from the other CTA.
                mbarrier_arrive_expect_tx(&full[s], GEMM_STAGE_BYTES);
                if constexpr (GEMM_CLUSTER == 1) {
                    tma_load_2d(st, &x_map, grp * INT4_GROUP, m0, &full[s]);
                    tma_load_2d(st + GEMM_BOX_BYTES, &x_map, grp * INT4_GROUP + GEMM_BOX_INPUTS, m0, &full[s]);
                } else {  // box `rank` of the stage, into both CTAs
                    tma_load_2d_multicast(st + rank * GEMM_BOX_BYTES, &x_map, grp * INT4_GROUP + rank * GEMM_BOX_INPUTS,
                                          m0, &full[s], (unsigned short)((1u << GEMM_CLUSTER) - 1));
                }
            }
        }
        __syncwarp();
    } else {  // ---- consumers ---------------------------------------------------------------
        const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
        const GemmLaneRows r = rows_of((warp / 4) * GEMM_WG_ROWS + (warp % 4) * INT4_TILE_ROWS + g);
        const int shift = 4 * t;  // nibble pair t: bits 4t … 4t+3 of each 16-bit half

        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        u32 frag[GEMM_K_STEPS][4];
        uint4 ra[4], rb[4];
        gemm_load_group(r.wa, r.wb, 0, ra, rb);
#pragma unroll 1
        for (int grp = 0; grp < n_groups; ++grp)
            gemm_group(grp, n_groups, lane, shift, r.wa, r.wb, r.sa, r.sb, smem, full, empty, ra, rb, frag, acc);
        epilogue(acc, m0, M, t);
    }
    // No CTA leaves while another of its cluster may still copy into its shared memory or
    // arrive on its barriers.
    if constexpr (GEMM_CLUSTER > 1) cluster_sync();
}


// Calls f(token, va, vb) for the lane's tokens < M: acc[4j + c] is (row g, token m0 + 8j + 2t + c),
// acc[4j + 2 + c] is (row g+8, the same token) — the wgmma accumulator layout (ptx/wgmma.cuh).
template <typename F>
struct GemmEachToken {
    F f;
    __device__ __forceinline__ void operator()(const float (&acc)[64], int m0, int M, int t) {
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

// residual[token, row] += acc for rows ra, ra+8: the loads of 4 token columns (16 values) are
// issued together, then the adds and stores — 4 round trips per lane instead of 64.
struct GemmResidualAdd {
    float* residual;
    int N;
    const int* ra;  // the lane's row g (set by the kernel's rows_of)
    __device__ __forceinline__ void operator()(const float (&acc)[64], int m0, int M, int t) {
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

// out = X Wᵀ in FP32. grid (ceil(rows/128), ceil(N/128)), block 288, smem GEMM_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) __cluster_dims__(1, GEMM_CLUSTER, 1)
gemm_int4_f32(float* __restrict__ out,                  // [M, N] fp32, out
              const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]: box 128 × 64, 128-B swizzle
              const u32* __restrict__ qweight,          // [N, K/8] uint32, layout id 1
              const __half* __restrict__ scales,        // [N, K/128] fp16
              const int* __restrict__ prefill_state,    // [2] int32: start (unused here), M
              int N, int K) {
    const int row0 = blockIdx.y * GEMM_BLOCK_ROWS;
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, [&](int local) {
        GemmLaneRows r;
        ra = row0 + local;
        gemm_lane_row(qweight, scales, ra, N, K, r.wa, r.sa);
        gemm_lane_row(qweight, scales, ra + 8, N, K, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float va, float vb) {
        if (ra < N) out[(u64)token * N + ra] = va;
        if (ra + 8 < N) out[(u64)token * N + ra + 8] = vb;
    }));
}

// [q | k | v] = X [Wq; Wk; Wv]ᵀ in FP32, one launch for the three stacked along N (bias, RoPE
// and the FP16 rounding happen once, in rope_kv_rows). grid (ceil(rows/128), ceil((Nq+2·Nkv)/128)).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) __cluster_dims__(1, GEMM_CLUSTER, 1)
gemm_int4_qkv(float* __restrict__ qkv,                   // [M, Nq + 2·Nkv] fp32, out: q | k | v per row
              const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden states)
              const u32* __restrict__ q_qweight,          // [Nq, K/8] uint32
              const __half* __restrict__ q_scales,        // [Nq, K/128] fp16
              const u32* __restrict__ k_qweight,          // [Nkv, K/8] uint32
              const __half* __restrict__ k_scales,        // [Nkv, K/128] fp16
              const u32* __restrict__ v_qweight,          // [Nkv, K/8] uint32
              const __half* __restrict__ v_scales,        // [Nkv, K/128] fp16
              const int* __restrict__ prefill_state,      // [2] int32: start (unused here), M
              int Nq, int Nkv, int K) {
    const int ld = Nq + 2 * Nkv;
    const int row0 = blockIdx.y * GEMM_BLOCK_ROWS;
    int ra = 0;  // the stacked row (= output column) of the lane's row g; row g+8 is ra + 8
    gemm_int4_block(x_map, prefill_state, K, [&](int local) {
        GemmLaneRows r;
        ra = row0 + local;
        // Nq and Nkv are multiples of 16: rows ra and ra+8 (one warp tile) lie in one matrix.
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

// residual += X Wᵀ in FP32 (the residual stream is FP32, docs/numerics.md#the-residual-stream-is-fp32).
// Each element is read and written by one lane: no atomics. grid (ceil(rows/128), ceil(N/128)).
// The read-modify-write goes through GemmResidualAdd (below), not the per-element epilogue: a
// load of residual after a store to residual may alias it as far as the compiler knows, so
// element-by-element it would wait out 64 dependent global round trips per lane.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) __cluster_dims__(1, GEMM_CLUSTER, 1)
gemm_int4_residual(float* __restrict__ residual,           // [M, N] fp32, in/out
                   const __grid_constant__ CUtensorMap x_map, // X fp16 [rows, K]
                   const u32* __restrict__ qweight,        // [N, K/8] uint32
                   const __half* __restrict__ scales,      // [N, K/128] fp16
                   const int* __restrict__ prefill_state,  // [2] int32: start (unused here), M
                   int N, int K) {
    const int row0 = blockIdx.y * GEMM_BLOCK_ROWS;
    int ra = 0;
    gemm_int4_block(x_map, prefill_state, K, [&](int local) {
        GemmLaneRows r;
        ra = row0 + local;
        gemm_lane_row(qweight, scales, ra, N, K, r.wa, r.sa);
        gemm_lane_row(qweight, scales, ra + 8, N, K, r.wb, r.sb);
        return r;
    }, GemmResidualAdd{residual, N, &ra});
}

// h = silu(X Wgᵀ) ⊙ (X Wuᵀ): in each warp's 16 rows, row g is gate_proj's feature f and row g+8
// is up_proj's feature f, so the SwiGLU happens in registers (swiglu_f16, as in the decode GEMV).
// A block covers 64 features. grid (ceil(rows/128), ceil(F/64)).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) __cluster_dims__(1, GEMM_CLUSTER, 1)
gemm_int4_gate_up_swiglu(__half* __restrict__ h,                    // [M, F] fp16, out
                         const __grid_constant__ CUtensorMap x_map,  // X fp16 [rows, K] (normed hidden)
                         const u32* __restrict__ gate_qweight,      // [F, K/8] uint32
                         const __half* __restrict__ gate_scales,    // [F, K/128] fp16
                         const u32* __restrict__ up_qweight,        // [F, K/8] uint32
                         const __half* __restrict__ up_scales,      // [F, K/128] fp16
                         const int* __restrict__ prefill_state,     // [2] int32: start (unused here), M
                         int F, int K) {
    int f = 0;
    gemm_int4_block(x_map, prefill_state, K, [&](int local) {
        // local = 16·(warp tile) + g for g < 8: feature 8·(warp tile) + g.
        GemmLaneRows r;
        f = blockIdx.y * (GEMM_BLOCK_ROWS / 2) + (local / INT4_TILE_ROWS) * 8 + local % INT4_TILE_ROWS;
        gemm_lane_row(gate_qweight, gate_scales, f, F, K, r.wa, r.sa);
        gemm_lane_row(up_qweight, up_scales, f, F, K, r.wb, r.sb);
        return r;
    }, gemm_each_token([&](int token, float gate, float up) {
        if (f < F) h[(u64)token * F + f] = swiglu_f16(gate, up);
    }));
}
