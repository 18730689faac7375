// kernels/dev/gemv_int4/v2_smem_ring.cu — the decode GEMV, version 2: the weights streamed
// through a ring of slots in shared memory per warp (cp.async), instead of the register batches
// of kernels/gemv_int4.cu. Not a production kernel: tools/dev_kernels.py checks it against the
// float64 reference and times it beside kernels/gemv_int4.cu.
//
//   gemv_int4_qkv_rope_ring, gemv_int4_residual_ring, gemv_int4_gate_up_swiglu_ring: the
//   production kernels of the same names without _ring, on the ring engine below.
//
// Source: the block engine of kernels/gemv_int4.cu at commit 8482cf5 (gemv_int4_block there,
// gemv_int4_block_ring here) and its cp_async_16_stream (then in ptx/cp_async.cuh); everything
// else comes from ../../gemv_int4.cu, whose default Layout is the tile-major device layout
// (int4_matmul.cuh) and whose qkv pairs v's rows like q's and k's, as the kernels below do: the
// figures below were measured over layout id 1 (row-major). The kernels below repeat
// production's bodies on purpose: production's engine has a hook for where a lane's words lie
// (Layout), none for how they travel, and its kernels call it by name.
//
// What changes from the production engine: each warp copies its (tile, group) items with
// cp.async straight from L2 into its own ring of GEMV_RING KiB (16 by default; 8 the other
// measured size), keeps R − 1 items in flight while it multiplies one, and refills the slot it
// read last. A lane copies exactly the 16-byte quads it later reads back, so no lane waits for
// another's copies; the copies are L2-only (.cg), L2 evict-first, with a 256 B L2 prefetch. The
// first R − 1 items are requested before griddepcontrol.wait.
// Why it was tried: a register batch holds its bytes from the load until the multiply, so a
// warp keeps only 4–8 KiB in flight and waits a full HBM round trip every batch; the ring keeps
// 7–15 KiB in flight per warp at no register cost (72–90 registers instead of 120–128).
// Why it lost (kernels/gemv_int4.cu's header): the ring's shared memory leaves one or two blocks
// per SM, too few warps to hide the latency of the unpack → MMA chain (8 dependent MMAs per
// item), and the bytes in flight were not the limit.
//
// Measured (kernels/gemv_int4.cu's header: tools/bench_gemv.py --pdl, each GEMV alone, back to
// back in a graph, weights rotated past L2, H200 at 4273 GB/s copy bandwidth; µs per call):
//   | engine                         | qkv_rope | o_proj | gate_up | down  |
//   | production, W = 8 warps        |   8.56   |  4.56  |  22.38  | 15.15 |
//   | this ring, GEMV_RING = 16 KiB  |   9.96   |  5.63  |  26.90  | 18.37 |
//   | this ring, GEMV_RING = 8 KiB   |   7.90   |  5.17  |  25.36  | 14.56 |
// The launch shape those ring rows ran in is not recorded beside them (8482cf5 chose W per GEMV
// with a cost model). The runner launches the ring in production's rule — W = min(8, K/128), G
// spreading the tiles over the blocks resident in one wave — at the ring's shared memory, so its
// figures answer "the ring in today's launch shape".
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v2
// Re-run at b873b61 (docs/bench/2026-12-04_b873b61_h200_dev_gemv_int4_v2.json), µs:
//   production 8.51 / 4.51 / 22.35 / 14.93; ring 16 KiB 9.93 / 5.65 / 26.68 / 18.23;
//   ring 8 KiB 7.61 / 4.83 / 23.51 / 14.56 (qkv_rope / o_proj / gate_up / down)
// — the 8 KiB ring ahead at qkv_rope and down, behind at o_proj and gate_up, as before: taken per
// GEMV, −1.3 µs a layer.
// Without the L2 prefetch size (GEMV_RING_L2_PREFETCH=0), beside production and
// v4_bulk_ring.cu on one H100 (docs/bench/2026-12-06_099023a_h100_dev_gemv_int4_rings.json), µs:
//   production 8.16 / 4.63 / 25.30 / 15.11; ring 16 KiB 10.00 / 5.88 / 27.05 / 19.08, without
//   the prefetch size 9.98 / 5.85 / 27.00 / 18.99; ring 8 KiB 7.32 / 4.96 / 24.45 / 14.98,
//   without it 7.28 / 4.83 / 24.29 / 14.83
// — the prefetch size moves a GEMV alone by ≤ 1 % (it cost the whole step its extra DRAM
// bytes, not a lone launch); the 8 KiB ring runs 3 blocks an SM (64 registers, 73–104 KB) and
// is ahead at qkv_rope (288 blocks, one tile each, against production's 144), gate_up and down.
//
// Shared memory (dynamic): x, K·2 bytes; the rings, W · GEMV_RING KiB; then the warp partials,
// ceil(T/G) · MT · W · 16 · 4 bytes (MT = 2 for gate/up, else 1): at 7B with W = 8 ~135 KB at
// K = 3584 and ~165 KB at K = 18944, one block per SM.
// Requirements: as ../../gemv_int4.cu; GEMV_RING a power of two ≥ 4.
#include "../../gemv_int4.cu"
#include "cp_async.cuh"     // cp_async_commit, cp_async_wait

// The ring: KiB of weights per warp in shared memory, GEMV_RING (tile, group) items of one
// matrix (half as many of gate/up's two). A compile-time knob (-DGEMV_RING=N).
// GEMV_RING_LATE_SCALES=1 keeps an item's two scales as loaded (FP16 bits, gemv_scale) until the
// item is multiplied, as production's GemvBatch does; 0 packs them into a half2 where they are
// loaded — the loads' first use, so the warp waits there for a memory round trip at every issue
// (v4_bulk_ring.cu says how that was found). Measured without the L2 prefetch size
// (tools/dev_kernels.py, one H100; docs/bench/2026-12-06_e8ad914_h100_dev_gemv_int4_late_scales.json), µs
// qkv_rope / o_proj / gate_up / down: 16 KiB 9.53 / 5.67 / 27.26 / 18.69 against 9.96 / 5.82 /
// 27.01 / 19.00, 8 KiB 7.09 / 5.09 / 24.20 / 14.82 against 7.27 / 4.84 / 24.31 / 14.78: within
// a few per cent either way.
#ifndef GEMV_RING_LATE_SCALES
#define GEMV_RING_LATE_SCALES 0
#endif
#ifndef GEMV_RING
#define GEMV_RING 16
#endif
#define GEMV_RING_ITEMS(MT) (GEMV_RING / (MT))
#define GEMV_RING_BYTES (GEMV_RING * 1024)  // per warp: items × MT matrices × 32 lanes × 2 × 16 B

// cp.async.cg.shared.global.L2::cache_hint.L2::256B [dst], [src], 16, policy (PTX ISA,
// "Data Movement and Conversion Instructions: cp.async"): 16 bytes of read-once data (weights)
// from global `src` to shared `dst`, with an L2 cache policy (l2_evict_first_policy,
// ptx/ldst.cuh: a weight line leaves L2 before the KV cache and activations) and a 256-byte L2
// prefetch (a warp walks each weight row front to back, so the next 64-byte pieces come in the
// same DRAM burst).
// GEMV_RING_L2_PREFETCH=0 drops the prefetch size: the measured rows above had it, and with
// evict-first lines it makes a decode step read more than its weights from DRAM (ptx/ldst.cuh).
#ifndef GEMV_RING_L2_PREFETCH
#define GEMV_RING_L2_PREFETCH 1
#endif
__device__ __forceinline__ void cp_async_16_stream(void* dst, const void* src, u64 policy) {
    const u32 dst_smem = static_cast<u32>(__cvta_generic_to_shared(dst));
#if GEMV_RING_L2_PREFETCH
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n"
                 :: "r"(dst_smem), "l"(src), "l"(policy) : "memory");
#else
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n"
                 :: "r"(dst_smem), "l"(src), "l"(policy) : "memory");
#endif
}

// gemv_int4_block (../../gemv_int4.cu) with the weights streamed through a shared-memory ring:
// its tiles × all K, for MT matrices per tile. Order of work:
// launch_dependents, the first GEMV_RING_ITEMS(MT) - 1 items' weights requested, griddepcontrol.
// wait, then the prologue `stage_x(x_smem, K)` stages x; after the main loop and the block's
// reduction, epilogue(seg, tile_in_seg, g, sums[MT][2]) runs once per (tile, g), g < 8, from one
// thread, with sums[m][0] the row of MMA row g and sums[m][1] that of MMA row g + 8
// (gemv_tile_rows says which rows those are; rows ≥ n must not be stored).
// Contains __syncthreads(): call from every thread of the block.
template <int MT, int NSEG, typename Layout = GemvTileMajor, typename Prologue, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block_ring(const GemvProblem<MT, NSEG>& p, int K,
                                                     Prologue stage_x, Epilogue epilogue) {
    constexpr int R = GEMV_RING_ITEMS(MT);
    extern __shared__ uint4 x_smem[];  // [K/8] x chunks (gemv_x_slot order), ring, partials
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    // This warp's ring: [R slots][MT matrices][2 rows][32 lanes] uint4 — a lane's 16 bytes are
    // lane-contiguous, so each shared-memory read of a slot is conflict-free.
    uint4* ring = x_smem + K / 8 + warp * (R * MT * 2 * WARP_SIZE);
    float* partial = reinterpret_cast<float*>(x_smem + K / 8 + n_warps * (R * MT * 2 * WARP_SIZE));
    const int n_groups = K / INT4_GROUP;
    // This warp's contiguous, balanced share of the groups (non-empty: W ≤ K/128).
    const int gb = warp * n_groups / n_warps, ge = (warp + 1) * n_groups / n_warps;
    // This block's contiguous, balanced share of the tiles.
    const int n_tiles = p.first_tile[NSEG];
    const int tile_b = blockIdx.x * n_tiles / gridDim.x, tile_e = (blockIdx.x + 1) * n_tiles / gridDim.x;
    const u64 policy = l2_evict_first_policy();

    // Every block of this grid is resident in one wave (the launcher sizes G for that), so the
    // next kernel may be scheduled as soon as they have all started.
    grid_launch_dependents();

    // Issues the next (tile, group) item's weights into ring slot `slot` (cp.async: straight to
    // shared memory, no registers held while they travel) and its two rows' scales into
    // registers, then commits one cp.async group — also when no item is left, so that every
    // item is always exactly R - 1 groups behind the newest one.
#if GEMV_RING_LATE_SCALES
    u32 scale_g[R][MT], scale_g8[R][MT];  // per slot: the FP16 bits of rows g, g + 8 as loaded (gemv_scale)
#else
    u32 scale2[R][MT];  // per slot: the FP16 scales of rows g, g + 8 as one half2
#endif
    int is_tile = tile_b, is_gi = gb;
    auto issue = [&](int slot) {
        if (is_tile < tile_e && gb < ge) {  // warp-uniform
            const int seg = int4_segment<NSEG>(p.first_tile, is_tile);
            const int n = gemv_field<NSEG>(seg, p.n), tile = is_tile - gemv_field<NSEG>(seg, p.first_tile);
            int lo, hi;
            gemv_tile_rows(tile, g, gemv_field<NSEG>(seg, p.rope_dim), lo, hi);
            // Rows past n (last tile of a matrix) load the last row and are never stored.
            const u64 r0 = min(lo, n - 1), r1 = min(hi, n - 1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const u32* qw = gemv_qweight(p, seg, m);
                uint4* dst = ring + (slot * MT + m) * 2 * WARP_SIZE + lane;
                cp_async_16_stream(dst, Layout::quad(qw, tile, g, r0, is_gi, K, t), policy);
                cp_async_16_stream(dst + WARP_SIZE, Layout::quad(qw, tile, g + 8, r1, is_gi, K, t), policy);
                const __half* sc = gemv_scales(p, seg, m) + is_gi;
#if GEMV_RING_LATE_SCALES
                scale_g[slot][m] = __ldg(reinterpret_cast<const unsigned short*>(sc + r0 * n_groups));
                scale_g8[slot][m] = __ldg(reinterpret_cast<const unsigned short*>(sc + r1 * n_groups));
#else
                const __half2 s2 = __halves2half2(__ldg(sc + r0 * n_groups), __ldg(sc + r1 * n_groups));
                scale2[slot][m] = *reinterpret_cast<const u32*>(&s2);
#endif
            }
            if (++is_gi == ge) { is_gi = gb; ++is_tile; }
        }
        cp_async_commit();
    };

    // R - 1 items go out before the wait: their latency overlaps the previous kernel's tail
    // and the staging of x (weights are never written by any kernel).
#pragma unroll
    for (int s = 0; s < R - 1; ++s) issue(s);
    grid_dependency_wait();
    stage_x(x_smem, K);
    __syncthreads();

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    int c_tile = tile_b, c_gi = gb;
    while (c_tile < tile_e && gb < ge) {
#pragma unroll
        for (int s = 0; s < R; ++s) {
            if (c_tile >= tile_e) break;  // warp-uniform: every lane takes the same branch
            // Refill the slot the previous item was read from (one slot of slack: those reads
            // are long done), then wait until this item's group has landed.
            issue((s + R - 1) % R);
            cp_async_wait<R - 1>();
            const uint4* x_group = x_smem + c_gi * GEMV_CHUNKS_PER_GROUP + t;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4* src = ring + (s * MT + m) * 2 * WARP_SIZE + lane;
                const uint4 row_g = src[0], row_g8 = src[WARP_SIZE];  // this lane's own copies
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 a_lo[4], a_hi[4];  // inputs 8i + 0..3 and 8i + 4..7 of rows g, g+8
                    int4_a_fragments(row_g, row_g8, i, a_lo, a_hi);
                    const uint4 xi = x_group[4 * i];  // x[128·gi + 32t + 8i … +8]
                    mma_m16n8k16_f32_f16(c, a_lo, xi.x, xi.y);
                    mma_m16n8k16_f32_f16(c, a_hi, xi.z, xi.w);
                }
#if GEMV_RING_LATE_SCALES
                const float2 sc = make_float2(gemv_scale(scale_g[s][m]), gemv_scale(scale_g8[s][m]));
#else
                const float2 sc = __half22float2(*reinterpret_cast<const __half2*>(&scale2[s][m]));
#endif
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
    }
    cp_async_wait<0>();  // no copy may still be writing shared memory when the block exits
    __syncthreads();

    // One thread per (tile, g): the W partials of MMA rows g and g + 8 in warp order, then the
    // epilogue.
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

// gemv_int4_qkv_rope (../../gemv_int4.cu) on the ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_qkv_rope_ring(__half* __restrict__ q_out,           // [Hq·Dh] fp16, out: rotated query
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
    gemv_int4_block_ring(p, K, GemvStageRmsNorm{residual, norm_w, eps},
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

// gemv_int4_residual (../../gemv_int4.cu) on the ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual_ring(float* __restrict__ residual,      // [N] fp32, in/out
                        const __half* __restrict__ x,      // [K] fp16
                        const u32* __restrict__ qweight,   // [N, K/8] uint32
                        const __half* __restrict__ scales, // [N, K/128] fp16
                        int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block_ring(p, K, GemvStageX{x}, [&](int, int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    });
}

// gemv_int4_gate_up_swiglu (../../gemv_int4.cu) on the ring engine: the same arguments, grid and block;
// dynamic smem as there + W · GEMV_RING_BYTES for the rings.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_ring(__half* __restrict__ h,                // [F] fp16, out
                              const float* __restrict__ residual,    // [K] fp32, the residual stream
                              const __half* __restrict__ norm_w,     // [K] fp16, post_attention_layernorm gain
                              const u32* __restrict__ gate_qweight,  // [F, K/8] uint32
                              const __half* __restrict__ gate_scales,// [F, K/128] fp16
                              const u32* __restrict__ up_qweight,    // [F, K/8] uint32
                              const __half* __restrict__ up_scales,  // [F, K/128] fp16
                              int F, int K, float eps) {
    const GemvProblem<2, 1> p = {{{gate_qweight, up_qweight}}, {{gate_scales, up_scales}},
                                 {F}, {0, int4_tiles(F)}, {0}};
    gemv_int4_block_ring(p, K, GemvStageRmsNorm{residual, norm_w, eps},
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
