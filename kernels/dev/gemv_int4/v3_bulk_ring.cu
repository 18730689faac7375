// kernels/dev/gemv_int4/v3_bulk_ring.cu — the decode GEMV, version 3: tile-major weights (v1)
// streamed into a shared-memory ring per warp by bulk copies (the 1-D TMA: one instruction moves
// an item's whole kilobyte), instead of the register batches of kernels/gemv_int4.cu or the
// per-lane cp.async of v2. Not a production kernel: tools/dev_kernels.py checks it against the
// float64 reference and times it beside kernels/gemv_int4.cu (the runner stores its weights
// tile-major, as for v1).
//
//   gemv_int4_qkv_rope_bulk, gemv_int4_residual_bulk, gemv_int4_gate_up_swiglu_bulk: the
//   production kernels of the same names without _bulk, on the engine below. A tile-major item
//   holds its tile's 16 rows in MMA-row order: for q and k, whose RoPE pairs dims i and i + Dh/2
//   of a head, those are the rows gemv_tile_rows names (8 of one half, 8 of the other: the
//   runner puts q's and k's rows in that order before storing them tile-major), for the rest
//   rows 16 T … 16 T + 15.
//
// Why: the GEMVs' loads alone reach 77 % of the copy bandwidth at gate_up with two items in
// flight per warp, 86 % with eight — but eight items of registers leave one block per SM and the
// arithmetic loses its latency hiding (kernels/gemv_int4.cu's header). v2 moved the bytes in
// flight out of registers with per-lane cp.async (64 16-byte copies per item and warp) and won at
// qkv_rope and down, lost at o_proj and gate_up. Tile-major makes an item 1 KiB of contiguous
// memory (v1: fewer, longer DRAM bursts; 21.24 against 22.38 µs at gate_up when last run), so one
// lane can move it with one bulk copy: the ring's depth costs neither registers nor issue slots.
//
// Work split: production's (gemv_int4.cu) — tiles of 16 rows per block, the K groups split over
// the block's W warps — with each warp streaming its (tile, group) items through its own ring.
//   ring   = R = GEMV_BULK_RING KiB / (MT KiB) slots per warp; slot s holds MT items of 1 KiB
//            (16 rows × 16 words, tile-major: row r at byte 64 r), and has two mbarriers: full[s]
//            (the copies landed) and empty[s] (every lane has read the slot).
//   issue  = lane 0 waits empty[s] (from the second fill on), arms full[s] with MT KiB of
//            transactions and issues MT bulk copies; every lane loads its two rows' scales of
//            the item into registers (as v2).
//   read   = lane (g, t) reads rows g and g + 8, bytes 16 t … 16 t + 15 of each matrix's item:
//            uint4 4g + t and 4(g + 8) + t of the slot — 32 consecutive uint4 per row half,
//            conflict-free — arrives on empty[s], then production's unpack and MMAs.
// Bytes: production's (the weights once, the scales, x or the residual); the limit is HBM.
// The kernels and the block's final reduction repeat production's (and v2's) bodies on purpose:
// production's engine has a hook for where a lane's words lie (Layout), none for how they
// travel, and its kernels call it by name.
//
// Why nothing races (per warp; no other warp touches its ring or barriers):
//   RAW: a lane reads slot s in round r only after mbarrier_wait_parity(full[s], r & 1) returns,
//        i.e. after the MT copies of round r completed their transactions on full[s].
//   WAR: lane 0 refills slot s for round r + 1 only after empty[s] phase r completed: all 32
//        lanes arrived (release) after their reads of round r had been issued, and the wait
//        (acquire) orders those reads before the copy, as the TMA attention's consumers release
//        their stages (attention_decode_tma.cu) — each lane releasing its own reads, the form
//        racecheck follows (gemm_int4.cu's header: a lane 0 release after __syncwarp is
//        reported).
//   Phases: full[s] completes round r before round r + 1 is armed (lane 0 armed round r + 1
//        after waiting empty[s] phase r, which follows every lane's wait on full[s] phase r), and
//        empty[s] completes round r before lane 0 waits for it again: each is at most one phase
//        ahead of its waiter, so parity names the phase.
//   Exit: every issued item is waited for by the loop, so no copy is in flight when the block
//        leaves; x_smem and the partials are production's (one __syncthreads before the loop
//        after the staging, one after the loop before the reduction).
// Dynamic shared memory: x [K/8] uint4, then the barriers [W][2][R] u64 padded to 128 bytes, then
// the rings [W][R][MT][1 KiB], then the partials (launcher: production's bytes + W · (ring +
// barriers), tools/dev_gemv_int4.py ring_bytes).
// Requirements: as ../../gemv_int4.cu, N % 16 == 0; GEMV_BULK_RING a multiple of MT (KiB).
// Measured: correct (tests/dev on the GPU, and the runner's checks: bits equal twice, within the
// float64 reference's tolerance at every shape) and slower than production at all four 7B GEMVs
// in the one run so far, the 16 KiB ring slower still, while v1 (the same layout with
// production's register batches) ran faster than production at o_proj, gate_up and down in
// the same run. That run's JSON did not come back, so its figures are not quoted here; the
// re-run below gives them. The ring's wait-and-refill per KiB seems to cost more than the
// register batches' latency hiding gives back: tile-major with registers (v1) is the lead.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v1 v3
#define DEVICE_FUNCTIONS_ONLY  // production's kernels are not built into this module: its engine only
#include "../../gemv_int4.cu"
#include "mbarrier.cuh"  // mbarrier_init, fence_mbarrier_init, mbarrier_arrive(_expect_tx), mbarrier_wait_parity
#include "tma.cuh"       // bulk_copy_g2s

#ifndef GEMV_BULK_RING
#define GEMV_BULK_RING 8  // KiB of weights in flight per warp
#endif
// Blocks per SM the registers are sized for: 2 (≤ 128 registers). Without a minimum ptxas gave
// gate/up 80 registers and 8 bytes of spill; with 3 (≤ 85) it spills too.
#ifndef GEMV_BULK_MIN_BLOCKS
#define GEMV_BULK_MIN_BLOCKS 2
#endif
#define GEMV_BULK_ITEM_BYTES (INT4_TILE_ROWS * GEMV_WORDS_PER_GROUP * 4)  // 1 KiB: 16 rows × 64 B
#define GEMV_BULK_BAR_BYTES(W, R) (((W) * (R) * 16 + 127) / 128 * 128)  // full and empty per slot

// The (tile, group) item of tile-major weights [N/16, K/128, 16, 16] uint32: 1 KiB, contiguous.
__device__ __forceinline__ const u32* gemv_tile_major_item(const u32* qweight, int tile, int gi, int K) {
    return qweight + ((u64)tile * (K / INT4_GROUP) + gi) * (INT4_TILE_ROWS * GEMV_WORDS_PER_GROUP);
}

// gemv_int4_block's work with the weights in a bulk-copy ring per warp (header). Order: launch
// dependents, the first R − 1 items issued, griddepcontrol.wait, stage_x, __syncthreads, the
// loop, __syncthreads, then epilogue(seg, tile_in_seg, g, sums[MT][2]) once per (tile, g < 8)
// from one thread. Contains __syncthreads(): call from every thread of the block.
template <int MT, int NSEG, typename Prologue, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block_bulk(const GemvProblem<MT, NSEG>& p, int K, Prologue stage_x,
                                                     Epilogue epilogue) {
    constexpr int R = GEMV_BULK_RING / MT;
    static_assert(R >= 2 && R * MT == GEMV_BULK_RING, "GEMV_BULK_RING: a multiple of MT, at least 2 items");
    extern __shared__ __align__(128) uint4 x_smem[];  // [K/8] x chunks, barriers, rings, partials
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    unsigned char* after_x = reinterpret_cast<unsigned char*>(x_smem + K / 8);
    u64* full = reinterpret_cast<u64*>(after_x) + warp * 2 * R;  // this warp's [R] full barriers
    u64* empty = full + R;                                         // and its [R] empty ones
    unsigned char* rings = after_x + GEMV_BULK_BAR_BYTES(n_warps, R);
    unsigned char* ring = rings + warp * R * MT * GEMV_BULK_ITEM_BYTES;  // [R][MT][1 KiB]
    float* partial = reinterpret_cast<float*>(rings + n_warps * R * MT * GEMV_BULK_ITEM_BYTES);
    const int n_groups = K / INT4_GROUP;
    const int gb = warp * n_groups / n_warps, ge = (warp + 1) * n_groups / n_warps;  // non-empty: W ≤ K/128
    const int n_tiles = p.first_tile[NSEG];
    const int tile_b = blockIdx.x * n_tiles / gridDim.x, tile_e = (blockIdx.x + 1) * n_tiles / gridDim.x;
    const u64 policy = l2_evict_first_policy();

    grid_launch_dependents();  // every block of the grid is resident in one wave

    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < R; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], WARP_SIZE);
        }
        fence_mbarrier_init();
    }
    __syncwarp();

    // Issue the next item into its slot, issued % R (lane 0: the bulk copies; every lane: its
    // scales). `slot` is that slot, as the caller's loop names it.
    u32 scale2[R][MT];  // per slot: the FP16 scales of rows g, g + 8 as one half2
    int is_tile = tile_b, is_gi = gb;
    u32 issued = 0;     // items this warp has issued
    auto issue = [&](int slot) {
        if (is_tile >= tile_e || gb >= ge) return;  // warp-uniform (gb < ge while W ≤ K/128)
        const int seg = int4_segment<NSEG>(p.first_tile, is_tile);
        const int n = gemv_field<NSEG>(seg, p.n), tile = is_tile - gemv_field<NSEG>(seg, p.first_tile);
        if (lane == 0) {
            const u32 fill = issued / R;  // this slot's fill: round `fill` of the ring
            if (fill > 0) mbarrier_wait_parity(&empty[slot], (fill - 1) & 1);
            mbarrier_arrive_expect_tx(&full[slot], MT * GEMV_BULK_ITEM_BYTES);
#pragma unroll
            for (int m = 0; m < MT; ++m)
                bulk_copy_g2s(ring + (slot * MT + m) * GEMV_BULK_ITEM_BYTES,
                              gemv_tile_major_item(gemv_qweight(p, seg, m), tile, is_gi, K), GEMV_BULK_ITEM_BYTES,
                              &full[slot], policy);
        }
        int lo, hi;  // the rows of MMA rows g and g + 8: their scales (row-major, as production's)
        gemv_tile_rows(tile, g, gemv_field<NSEG>(seg, p.rope_dim), lo, hi);
        const u64 r0 = min(lo, n - 1), r1 = min(hi, n - 1);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const __half* sc = gemv_scales(p, seg, m) + is_gi;
            const __half2 s2 = __halves2half2(__ldg(sc + r0 * n_groups), __ldg(sc + r1 * n_groups));
            scale2[slot][m] = *reinterpret_cast<const u32*>(&s2);
        }
        ++issued;
        if (++is_gi == ge) {
            is_gi = gb;
            ++is_tile;
        }
    };

#pragma unroll
    for (int s = 0; s < R - 1; ++s) issue(s);  // weights are never written: safe before the wait
    grid_dependency_wait();
    stage_x(x_smem, K);
    __syncthreads();

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    int c_tile = tile_b, c_gi = gb;
    u32 round = 0;  // completed laps of the ring: the parity of the phase each slot waits for
    while (c_tile < tile_e && gb < ge) {
#pragma unroll
        for (int s = 0; s < R; ++s) {
            if (c_tile >= tile_e) break;  // warp-uniform
            // Refill the slot the previous item was read from (its empty barrier says when: the
            // header's WAR), then wait for this one, read it, release it.
            issue((s + R - 1) % R);
            mbarrier_wait_parity(&full[s], round & 1);
            uint4 rows[MT][2];  // rows g and g + 8 of each matrix's item: this lane's 16 bytes
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4* item = reinterpret_cast<const uint4*>(ring + (s * MT + m) * GEMV_BULK_ITEM_BYTES);
                rows[m][0] = item[4 * g + t];
                rows[m][1] = item[4 * (g + 8) + t];
            }
            mbarrier_arrive(&empty[s]);  // this lane's reads of slot s are done (release)
            const uint4* x_group = x_smem + c_gi * GEMV_CHUNKS_PER_GROUP + t;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4 row_g = rows[m][0], row_g8 = rows[m][1];
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 a_lo[4], a_hi[4];  // inputs 8i + 0..3 and 8i + 4..7 of rows g, g+8
                    int4_a_fragments(row_g, row_g8, i, a_lo, a_hi);
                    const uint4 xi = x_group[4 * i];  // x[128·gi + 32t + 8i … +8]
                    mma_m16n8k16_f32_f16(c, a_lo, xi.x, xi.y);
                    mma_m16n8k16_f32_f16(c, a_hi, xi.z, xi.w);
                }
                const float2 sc = __half22float2(*reinterpret_cast<const __half2*>(&scale2[s][m]));
                acc[m][0] = fmaf(sc.x, c[0], acc[m][0]);
                acc[m][1] = fmaf(sc.y, c[2], acc[m][1]);
            }
            if (++c_gi == ge) {  // the tile's last group: publish its row sums, start the next
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
        ++round;
    }
    __syncthreads();

    // One thread per (tile, g): the W partials of MMA rows g and g + 8 in warp order, then the
    // epilogue (production's order: the same sums).
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

// gemv_int4_qkv_rope (../../gemv_int4.cu) on the bulk ring: the same arguments (qweights
// tile-major, q's and k's rows in RoPE-pair order: header), grid and block; dynamic smem as there
// + the barriers and rings (header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, GEMV_BULK_MIN_BLOCKS)
gemv_int4_qkv_rope_bulk(__half* __restrict__ q_out,           // [Hq·Dh] fp16, out: rotated query
                        __half* __restrict__ k_cache,         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
                        __half* __restrict__ v_cache,         // [P, Hkv, 16, Dh] fp16, this layer; slot pos written
                        const float* __restrict__ residual,   // [K] fp32, the residual stream
                        const __half* __restrict__ norm_w,    // [K] fp16, input_layernorm gain
                        const u32* __restrict__ q_qweight,    // [Hq·Dh/16, K/128, 16, 16] uint32
                        const __half* __restrict__ q_scales,  // [Hq·Dh, K/128] fp16
                        const u32* __restrict__ k_qweight,    // [Hkv·Dh/16, K/128, 16, 16] uint32
                        const __half* __restrict__ k_scales,  // [Hkv·Dh, K/128] fp16
                        const u32* __restrict__ v_qweight,    // [Hkv·Dh/16, K/128, 16, 16] uint32
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
                                 {Dh, Dh, 0}};
    gemv_int4_block_bulk(p, K, GemvStageRmsNorm{residual, norm_w, eps},
                         [&](int seg, int tile, int g, const float (&s)[1][2]) {
        const int pos = state[0];
        const u64 slot = kv_offset(block_table[pos / PAGE_TOKENS], 0, pos % PAGE_TOKENS, Hkv, Dh);
        if (seg == 2) {  // v: bias only, plain row order
            gemv_store_rows(tile, g, nkv, s[0], [&](int row, float v) {
                const int head = row / Dh, d = row % Dh;
                v_cache[slot + (u64)head * PAGE_TOKENS * Dh + d] = __float2half_rn(v + __half2float(v_bias[row]));
            });
            return;
        }
        int lo, hi;  // rows of dims i and i + Dh/2 of one head
        gemv_tile_rows(tile, g, Dh, lo, hi);
        const int head = lo / Dh, i = lo % Dh;
        const __half* b = seg == 0 ? q_bias : k_bias;
        float o1, o2;
        rope_rotate(s[0][0] + __half2float(b[lo]), s[0][1] + __half2float(b[hi]), pos, inv_freq[i], o1, o2);
        __half* dst = seg == 0 ? q_out + (u64)head * Dh : k_cache + slot + (u64)head * PAGE_TOKENS * Dh;
        dst[i] = __float2half_rn(o1);
        dst[i + Dh / 2] = __float2half_rn(o2);
    });
}

// gemv_int4_residual (../../gemv_int4.cu) on the bulk ring: the same arguments (qweight
// tile-major), grid and block; dynamic smem as there + the barriers and rings (header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, GEMV_BULK_MIN_BLOCKS)
gemv_int4_residual_bulk(float* __restrict__ residual,      // [N] fp32, in/out
                        const __half* __restrict__ x,      // [K] fp16
                        const u32* __restrict__ qweight,   // [N/16, K/128, 16, 16] uint32
                        const __half* __restrict__ scales, // [N, K/128] fp16
                        int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block_bulk(p, K, GemvStageX{x}, [&](int, int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    });
}

// gemv_int4_gate_up_swiglu (../../gemv_int4.cu) on the bulk ring: the same arguments (qweights
// tile-major), grid and block; dynamic smem as there + the barriers and rings (header).
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE, GEMV_BULK_MIN_BLOCKS)
gemv_int4_gate_up_swiglu_bulk(__half* __restrict__ h,                // [F] fp16, out
                              const float* __restrict__ residual,    // [K] fp32, the residual stream
                              const __half* __restrict__ norm_w,     // [K] fp16, post_attention_layernorm gain
                              const u32* __restrict__ gate_qweight,  // [F/16, K/128, 16, 16] uint32
                              const __half* __restrict__ gate_scales,// [F, K/128] fp16
                              const u32* __restrict__ up_qweight,    // [F/16, K/128, 16, 16] uint32
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
            if (row < F) h[row] = swiglu_f16(s[0][r], s[1][r]);
        }
    });
}
