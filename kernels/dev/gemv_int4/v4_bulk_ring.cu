// kernels/dev/gemv_int4/v4_bulk_ring.cu — the decode GEMV, version 4: each warp's weights streamed
// through a ring of whole (tile, group) items in shared memory by bulk copies (the 1-D TMA copy,
// cp.async.bulk) that lane 0 issues, one per item and matrix, each slot's arrival counted by an
// mbarrier. Not a production kernel: tools/dev_kernels.py checks it against the float64
// reference and times it beside kernels/gemv_int4.cu.
//
//   gemv_int4_qkv_rope_bulk, gemv_int4_residual_bulk, gemv_int4_gate_up_swiglu_bulk: the
//   production kernels of the same names without _bulk, on the engine below. Their bodies
//   repeat v2_smem_ring.cu's on purpose, as v2's repeat production's: production's engine has a
//   hook for where a lane's words lie, none for how they travel.
//
// Why: the persistent decode step (kernels/decode_persistent.cu) runs one block of 8 warps per
// SM, where the register batches of kernels/gemv_int4.cu keep 4–8 KiB a warp in flight and the
// warps stall on the first use of each batch (Nsight Compute: gate_up at 2.41 TB/s). A ring keeps
// R − 1 items a warp in flight without registers; v2_smem_ring.cu's ring did that with 64
// cp.async of 16 B a warp per item (two per lane and matrix, each with its address, and the 256 B
// L2 prefetch size that later turned out to make a step read 23 % more than its weights). Here
// an item's 1 KiB is contiguous in the tile-major layout (int4_matmul.cuh), so one instruction
// of one lane moves it, with no L2 prefetch size, and the warp's other lanes only wait on the
// slot's mbarrier and read their two 16-byte words back from shared memory.
//
// Work split, bytes, limit: kernels/gemv_int4.cu's (a block owns contiguous tiles, its W warps
// contiguous K ranges of them; the sums in v2's order).
// Built to be run at one block per SM: the ring's shared memory leaves no room for a second.
//
// The ring of a warp: R = GEMV_BULK_RING / MT slots of MT KiB (one item per matrix); the item
// of the warp's i-th (tile, group) lands in slot i % R, on the slot's mbarrier, phase ⌊i/R⌋.
// Why nothing races:
//   - full: lane 0 arms the slot's mbarrier with expect_tx(MT KiB) (its one arrival: the count
//     is 1) and issues the MT copies that complete those bytes on it; every lane waits for the
//     phase's parity before it reads the slot, so it reads bytes that have landed (the phase
//     completes only when the arrival and all MT KiB are in).
//   - empty: a slot is refilled only by the warp that reads it, for its item i + R, after the
//     warp has read item i from it: the refill is issued after a __syncwarp that every lane
//     reaches after its reads of item i (the shared-memory loads' values are in registers
//     before the barrier), then lane 0 orders those generic-proxy reads before its async-proxy
//     copy with fence.proxy.async.shared::cta.
//   - phases: a slot's phase k completes before its phase k + 1 is armed (the refill follows
//     the wait for phase k in program order), so a waiter on parity k & 1 never sees a phase
//     two ahead.
//   - exit: every issued copy is waited for by the warp before the block's final barrier (each
//     item issued is an item the warp reads), so no copy writes shared memory after the block
//     ends.
// The scales (2 B per row and group, rows K/64 B apart) stay register loads at issue time, as in
// v2: one bulk copy per row would cost more than it moves.
// Measured (tools/dev_kernels.py gemv_int4 --versions v2 v4, 9/9 checks each, one H100 at 3043
// GB/s copy bandwidth; docs/bench/2026-12-06_099023a_h100_dev_gemv_int4_rings.json), µs per call
// qkv_rope / o_proj / gate_up / down, and gate_up's grid:
//   | production (registers, 2 blocks an SM)         |  8.16 / 4.63 / 25.30 / 15.11 | 237 |
//   | this ring, 16 KiB a warp (1 block an SM)       | 11.39 / 6.80 / 30.56 / 23.02 | 132 |
//   | this ring, 8 KiB a warp (2 blocks an SM)       |  8.02 / 4.82 / 25.52 / 16.59 | 237 |
//   | v2's ring, 16 KiB, no L2 prefetch size         |  9.98 / 5.85 / 27.00 / 18.99 | 132 |
//   | v2's ring, 8 KiB, no L2 prefetch size (3 / SM) |  7.28 / 4.83 / 24.29 / 14.83 | 395 |
// Lost to v2's cp.async ring at every shape: at one block an SM 13 % slower at gate_up. The
// bulk copy moves an item with one instruction but adds one lane's fence, arm and copies and a
// warp-wide mbarrier wait to every item, and each warp's items stay in order behind its own lane
// 0. Both rings say where the time is: with 16 KiB a warp in flight (128 KiB an SM) a block of 8
// warps is slower than production's two blocks holding 4–8 KiB a warp — the limit at one block
// an SM is the warps' unpack → MMA chains, not the bytes in flight.
// Two probes of that claim (same tool, one H100, 9/9 checks each;
// docs/bench/2026-12-06_12b2766_h100_dev_gemv_int4_chains.json, …_e8ad914_h100_dev_gemv_int4_late_scales.json),
// µs at 16 KiB:
//   GEMV_BULK_CHAINS=2 / 4 (an item's 8 MMAs in 2 or 4 chains): 11.06 / 11.07, 6.55 / 6.54,
//     30.82 / 30.04, 22.29 / 22.02 against 11.32 / 6.75 / 30.39 / 23.11 — not the chain;
//   GEMV_BULK_LATE_SCALES=1 (the scales kept as loaded until used, where Nsight Compute had put
//     the samples on the pack at issue): 11.06 / 6.50 / 30.40 / 22.37, and at 8 KiB 8.88 / 4.98 /
//     24.82 / 15.98 against 8.00 / 4.82 / 25.55 / 16.63 — the wait moved, the time did not.
// With the scales late, Nsight Compute over gate_up (…_12b2766_h100_gemv_gate_up_ncu_issue.json)
// finds ~164 warp instructions a 1 KiB item at 1.35 a cycle an SM, the samples on fixed-latency
// dependencies, loads and issuing alike: the instructions of an item, not its bytes, at two warps
// a scheduler (kernels/gemv_int4.cu's header).
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v4
//
// Shared memory (dynamic): x, K·2 bytes; the rings, W · GEMV_BULK_RING KiB; then the warp
// partials (as v2). Static: the mbarriers, GEMV_MAX_WARPS · GEMV_BULK_RING · 8 bytes.
// Requirements: as ../../gemv_int4.cu; GEMV_BULK_RING a power of two ≥ 4.
#include "../../gemv_int4.cu"
#include "mbarrier.cuh"  // mbarrier_init, fence_mbarrier_init, mbarrier_arrive_expect_tx, mbarrier_wait_parity
#include "tma.cuh"       // bulk_copy_g2s

// The ring: KiB of weights per warp, GEMV_BULK_RING items of one matrix (half as many of gate/
// up's two). A compile-time knob (-DGEMV_BULK_RING=N).
#ifndef GEMV_BULK_RING
#define GEMV_BULK_RING 16
#endif
// Dependent MMA chains per item (1, 2, 4 or 8): 1 is one accumulator for the item's 8 MMAs, as
// production's sums; more split the chain (other rounding, within the checks' bound), a probe of
// whether one warp's unpack → MMA chain is what a block of 8 warps waits on (-DGEMV_BULK_CHAINS=N).
#ifndef GEMV_BULK_CHAINS
#define GEMV_BULK_CHAINS 1
#endif
static_assert(GEMV_BULK_CHAINS == 1 || GEMV_BULK_CHAINS == 2 || GEMV_BULK_CHAINS == 4 || GEMV_BULK_CHAINS == 8,
              "GEMV_BULK_CHAINS divides the item's 8 MMAs");
// GEMV_BULK_LATE_SCALES=1 keeps an item's two scales as loaded (FP16 bits, gemv_scale) until the
// item is multiplied, as production's GemvBatch does; 0 packs them into a half2 where they are
// loaded, and that pack is the loads' first use: the warp waits there, at every item's issue,
// for a memory round trip (Nsight Compute: the PRMT after the loads is where the samples are).
#ifndef GEMV_BULK_LATE_SCALES
#define GEMV_BULK_LATE_SCALES 0
#endif
#define GEMV_BULK_SLOTS(MT) (GEMV_BULK_RING / (MT))
#define GEMV_BULK_RING_BYTES (GEMV_BULK_RING * 1024)
#define GEMV_ITEM_BYTES (INT4_ITEM_WORDS * 4)     // 1 KiB: one (tile, group) item
#define GEMV_ITEM_CHUNKS (GEMV_ITEM_BYTES / 16)   // its 16-byte words

// fence.proxy.async.shared::cta (PTX ISA, "Memory Consistency Model: proxies"): orders this
// thread's earlier generic-proxy accesses of shared memory (here: ordered after the warp's reads
// of a slot by __syncwarp) before its later async-proxy ones (the bulk copy that refills it).
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// gemv_int4_block (../../gemv_int4.cu) with each warp's weights streamed through its ring: its
// tiles × all K, for MT matrices per tile. Order of work: launch_dependents, the barriers'
// init, the first R − 1 items requested, griddepcontrol.wait, the prologue `stage_x(x_smem, K)`;
// after the main loop and the block's reduction, epilogue(seg, tile_in_seg, g, sums[MT][2]) runs
// once per (tile, g), g < 8, from one thread (rows ≥ n must not be stored).
// Contains __syncthreads(): call from every thread of the block.
template <int MT, int NSEG, typename Prologue, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block_bulk(const GemvProblem<MT, NSEG>& p, int K,
                                                     Prologue stage_x, Epilogue epilogue) {
    constexpr int R = GEMV_BULK_SLOTS(MT);
    extern __shared__ uint4 x_smem[];  // [K/8] x chunks (gemv_x_slot order), rings, partials
    __shared__ __align__(8) u64 full[GEMV_MAX_WARPS][GEMV_BULK_RING];  // per warp and slot
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    // This warp's ring: [R slots][MT matrices] items of 1 KiB, as laid out in global memory
    // (16 rows of 64 B): lane (g, t) reads 16 B at row g and row g + 8, so a warp's read of a
    // row half is 512 contiguous bytes — conflict-free.
    uint4* ring = x_smem + K / 8 + warp * (R * MT * GEMV_ITEM_CHUNKS);
    float* partial = reinterpret_cast<float*>(x_smem + K / 8 + n_warps * (R * MT * GEMV_ITEM_CHUNKS));
    u64* bar = full[warp];
    const int n_groups = K / INT4_GROUP;
    const int gb = warp * n_groups / n_warps, ge = (warp + 1) * n_groups / n_warps;
    const int n_tiles = p.first_tile[NSEG];
    const int tile_b = blockIdx.x * n_tiles / gridDim.x, tile_e = (blockIdx.x + 1) * n_tiles / gridDim.x;
    const u64 policy = l2_evict_first_policy();

    grid_launch_dependents();
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < R; ++s) mbarrier_init(&bar[s], 1);
        fence_mbarrier_init();  // the inits visible to the async proxy before any copy arrives
    }
    __syncwarp();

    // Issues the next (tile, group) item into slot `slot` (lane 0: arm, then MT bulk copies) and
    // loads its two rows' scales into registers (every lane). Nothing when no item is left.
    // Zeros first: a slot past the warp's last item is never loaded, but undefined the compiler
    // keeps it live from the start (gemv_int4.cu: GEMV_ZERO_BATCHES) and spilled some.
#if GEMV_BULK_LATE_SCALES
    u32 scale_g[R][MT] = {}, scale_g8[R][MT] = {};  // FP16 bits of rows g, g + 8 as loaded (gemv_scale)
#else
    u32 scale2[R][MT] = {};
#endif
    int is_tile = tile_b, is_gi = gb;
    auto issue = [&](int slot) {
        if (is_tile < tile_e && gb < ge) {  // warp-uniform
            const int seg = int4_segment<NSEG>(p.first_tile, is_tile);
            const int n = gemv_field<NSEG>(seg, p.n), tile = is_tile - gemv_field<NSEG>(seg, p.first_tile);
            if (lane == 0) {
                fence_proxy_async_smem();
                mbarrier_arrive_expect_tx(&bar[slot], MT * GEMV_ITEM_BYTES);
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    bulk_copy_g2s(ring + (slot * MT + m) * GEMV_ITEM_CHUNKS,
                                  int4_tile_item(gemv_qweight(p, seg, m), tile, is_gi, K), GEMV_ITEM_BYTES,
                                  &bar[slot], policy);
            }
            int lo, hi;
            gemv_tile_rows(tile, g, gemv_field<NSEG>(seg, p.rope_dim), lo, hi);
            const u64 r0 = min(lo, n - 1), r1 = min(hi, n - 1);  // rows past n: never stored
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const __half* sc = gemv_scales(p, seg, m) + is_gi;
#if GEMV_BULK_LATE_SCALES
                scale_g[slot][m] = __ldg(reinterpret_cast<const unsigned short*>(sc + r0 * n_groups));
                scale_g8[slot][m] = __ldg(reinterpret_cast<const unsigned short*>(sc + r1 * n_groups));
#else
                const __half2 s2 = __halves2half2(__ldg(sc + r0 * n_groups), __ldg(sc + r1 * n_groups));
                scale2[slot][m] = *reinterpret_cast<const u32*>(&s2);
#endif
            }
            if (++is_gi == ge) { is_gi = gb; ++is_tile; }
        }
    };

    // R − 1 items before the wait: weights are never written by any kernel.
#pragma unroll
    for (int s = 0; s < R - 1; ++s) issue(s);
    grid_dependency_wait();
    stage_x(x_smem, K);
    __syncthreads();

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    int c_tile = tile_b, c_gi = gb;
    u32 phase = 0;  // parity of the round through the ring
    while (c_tile < tile_e && gb < ge) {
#pragma unroll
        for (int s = 0; s < R; ++s) {
            if (c_tile >= tile_e) break;  // warp-uniform
            // Refill the slot read by the previous item (its reads are in registers: __syncwarp),
            // then wait for this item's bytes.
            __syncwarp();
            issue((s + R - 1) % R);
            mbarrier_wait_parity(&bar[s], phase);
            const uint4* x_group = x_smem + c_gi * GEMV_CHUNKS_PER_GROUP + t;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4* src = ring + (s * MT + m) * GEMV_ITEM_CHUNKS + g * 4 + t;
                const uint4 row_g = src[0], row_g8 = src[8 * 4];  // rows g and g + 8
                // GEMV_BULK_CHAINS accumulators: MMA j of the item goes to chain j % CHAINS, so
                // the item's 8 MMAs form CHAINS dependent chains of 8 / CHAINS, added in chain order.
                float c[GEMV_BULK_CHAINS][4] = {};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 a_lo[4], a_hi[4];
                    int4_a_fragments(row_g, row_g8, i, a_lo, a_hi);
                    const uint4 xi = x_group[4 * i];
                    mma_m16n8k16_f32_f16(c[(2 * i) % GEMV_BULK_CHAINS], a_lo, xi.x, xi.y);
                    mma_m16n8k16_f32_f16(c[(2 * i + 1) % GEMV_BULK_CHAINS], a_hi, xi.z, xi.w);
                }
#pragma unroll
                for (int ch = 1; ch < GEMV_BULK_CHAINS; ++ch) {
                    c[0][0] += c[ch][0];
                    c[0][2] += c[ch][2];
                }
#if GEMV_BULK_LATE_SCALES
                const float2 sc = make_float2(gemv_scale(scale_g[s][m]), gemv_scale(scale_g8[s][m]));
#else
                const float2 sc = __half22float2(*reinterpret_cast<const __half2*>(&scale2[s][m]));
#endif
                acc[m][0] = fmaf(sc.x, c[0][0], acc[m][0]);
                acc[m][1] = fmaf(sc.y, c[0][2], acc[m][1]);
            }
            if (++c_gi == ge) {
                if (t == 0) {
                    float* dst = partial + (c_tile - tile_b) * MT * n_warps * INT4_TILE_ROWS;
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        dst[(m * n_warps + warp) * INT4_TILE_ROWS + g] = acc[m][0];
                        dst[(m * n_warps + warp) * INT4_TILE_ROWS + g + 8] = acc[m][1];
                    }
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
                c_gi = gb;
                ++c_tile;
            }
        }
        phase ^= 1u;
    }
    __syncthreads();

    for (int o = threadIdx.x; o < (tile_e - tile_b) * 8; o += blockDim.x) {
        const int tl = o / 8, gg = o % 8;
        const int tile = tile_b + tl;
        const int seg = int4_segment<NSEG>(p.first_tile, tile);
        float sums[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* src = partial + ((tl * MT + m) * n_warps) * INT4_TILE_ROWS + gg + 8 * h;
                float s = 0.f;
                for (int w = 0; w < n_warps; ++w) s += src[w * INT4_TILE_ROWS];
                sums[m][h] = s;
            }
        }
        epilogue(seg, tile - gemv_field<NSEG>(seg, p.first_tile), gg, sums);
    }
}

// gemv_int4_qkv_rope (../../gemv_int4.cu) on the bulk ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_BULK_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, 1)  // one block per SM: the ring
gemv_int4_qkv_rope_bulk(__half* __restrict__ q_out,           // [Hq·Dh] fp16, out: rotated query
                        __half* __restrict__ k_cache,         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
                        __half* __restrict__ v_cache,         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
                        const float* __restrict__ residual,   // [K] fp32, the residual stream
                        const __half* __restrict__ norm_w,    // [K] fp16, input_layernorm gain
                        const u32* __restrict__ q_qweight,    // [Hq·Dh, K/8] uint32
                        const __half* __restrict__ q_scales,  // [Hq·Dh, K/128] fp16
                        const u32* __restrict__ k_qweight,    // [Hkv·Dh, K/8] uint32
                        const __half* __restrict__ k_scales,  // [Hkv·Dh, K/128] fp16
                        const u32* __restrict__ v_qweight,    // [Hkv·Dh, K/8] uint32
                        const __half* __restrict__ v_scales,  // [Hkv·Dh, K/128] fp16
                        const __half* __restrict__ q_bias,    // [Hq·Dh] fp16
                        const __half* __restrict__ k_bias,    // [Hkv·Dh] fp16
                        const __half* __restrict__ v_bias,    // [Hkv·Dh] fp16
                        const float* __restrict__ inv_freq,   // [Dh/2] fp32 (reference.rope_inv_freq)
                        const int* __restrict__ state,        // [3] int32: pos, token, seq_len (reads [0])
                        const int* __restrict__ block_table,  // [max_pages] int32: logical → physical page
                        int Hq, int Hkv, int Dh, int K, float eps) {
    const int nq = Hq * Dh, nkv = Hkv * Dh, tq = int4_tiles(nq), tkv = int4_tiles(nkv);
    const GemvProblem<1, 3> p = {{{q_qweight}, {k_qweight}, {v_qweight}},
                                 {{q_scales}, {k_scales}, {v_scales}},
                                 {nq, nkv, nkv},
                                 {0, tq, tq + tkv, tq + 2 * tkv},
                                 {Dh, Dh, Dh}};
    gemv_int4_block_bulk(p, K, GemvStageRmsNorm{residual, norm_w, eps},
                         [&](int seg, int tile, int g, const float (&s)[1][2]) {
        const int pos = state[0];
        const u64 slot = kv_offset(block_table[pos / PAGE_TOKENS], 0, pos % PAGE_TOKENS, Hkv, Dh);
        int lo, hi;  // rows of dims i and i + Dh/2 of one head (q, k and v alike, as production)
        gemv_tile_rows(tile, g, Dh, lo, hi);
        const int head = lo / Dh, i = lo % Dh;
        if (seg == 2) {  // v: bias only
            __half* dst = v_cache + slot + (u64)head * PAGE_TOKENS * Dh;
            dst[i] = __float2half_rn(s[0][0] + __half2float(v_bias[lo]));
            dst[i + Dh / 2] = __float2half_rn(s[0][1] + __half2float(v_bias[hi]));
            return;
        }
        const __half* b = seg == 0 ? q_bias : k_bias;
        float o1, o2;
        rope_rotate(s[0][0] + __half2float(b[lo]), s[0][1] + __half2float(b[hi]), pos, inv_freq[i], o1, o2);
        __half* dst = seg == 0 ? q_out + (u64)head * Dh : k_cache + slot + (u64)head * PAGE_TOKENS * Dh;
        dst[i] = __float2half_rn(o1);
        dst[i + Dh / 2] = __float2half_rn(o2);
    });
}

// gemv_int4_residual (../../gemv_int4.cu) on the bulk ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_BULK_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, 1)  // one block per SM: the ring
gemv_int4_residual_bulk(float* __restrict__ residual,      // [N] fp32, in/out
                        const __half* __restrict__ x,      // [K] fp16
                        const u32* __restrict__ qweight,   // [N, K/8] uint32
                        const __half* __restrict__ scales, // [N, K/128] fp16
                        int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block_bulk(p, K, GemvStageX{x}, [&](int, int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    });
}

// gemv_int4_gate_up_swiglu (../../gemv_int4.cu) on the bulk ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_BULK_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, 1)  // one block per SM: the ring
gemv_int4_gate_up_swiglu_bulk(__half* __restrict__ h,                // [F] fp16, out
                              const float* __restrict__ residual,    // [K] fp32, the residual stream
                              const __half* __restrict__ norm_w,     // [K] fp16, post_attention_layernorm gain
                              const u32* __restrict__ gate_qweight,  // [F, K/8] uint32
                              const __half* __restrict__ gate_scales,// [F, K/128] fp16
                              const u32* __restrict__ up_qweight,    // [F, K/8] uint32
                              const __half* __restrict__ up_scales,  // [F, K/128] fp16
                              int F, int K, float eps) {
    const GemvProblem<2, 1> p = {{{gate_qweight, up_qweight}}, {{gate_scales, up_scales}},
                                 {F}, {0, int4_tiles(F)}, {0}};
    gemv_int4_block_bulk(p, K, GemvStageRmsNorm{residual, norm_w, eps},
                         [&](int, int tile, int g, const float (&s)[2][2]) {
        const int lo = tile * INT4_TILE_ROWS + g;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = lo + 8 * r;
            if (row >= F) continue;
                h[row] = swiglu_f16(s[0][r], s[1][r]);
        }
    });
}
