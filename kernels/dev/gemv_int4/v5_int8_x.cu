// kernels/dev/gemv_int4/v5_int8_x.cu — the decode GEMV, version 5: x rounded to int8 (one FP32
// scale per 32 inputs) and each weight word multiplied by integer dot products (dp4a) instead of
// an FP16 unpack and tensor-core MMAs. Not a production kernel: tools/dev_kernels.py checks it
// against the float64 reference on the dequantized weights and on x rounded as this file rounds
// it (dev_gemv_int4.py: int8_x), and times it beside kernels/gemv_int4.cu.
//
//   gemv_int4_residual_i8x, gemv_int4_gate_up_swiglu_i8x: the production kernels of the same
//   names without _i8x, same arguments, launch shape and register batches (production's engine
//   with its arithmetic replaced). No qkv_rope: the question below is asked of the large GEMVs.
//
// Why: one block of 8 warps an SM (the persistent decode step, kernels/decode_persistent.cu)
// runs a 1 KiB (tile, group) item in ~161 warp instructions at ~1.35 a cycle an SM (Nsight
// Compute, gemv_int4.cu's header): the instructions of an item, not its bytes, are its time,
// and ~83 of them are the unpack (LOP3, HADD2, HFMA2, shifts) and the 8 MMAs. At the H200's
// copy bandwidth an SM must finish an item every ~62 cycles, 2.6 instructions a cycle at 161.
// This version asks how far fewer instructions an item go: a word of 8 nibbles is two masks
// (w & 0x0f0f0f0f: inputs 0, 4, 1, 5 of its 8; w & 0xf0f0f0f0: inputs 2, 6, 3, 7, times 16)
// and two dp4a against 8 int8 x — 4 instructions for 8 weights, where production's unpack and
// MMAs take ~10. It is llama.cpp's decode arithmetic (its MMVQ kernels round x to Q8_1 and use
// dp4a), and it changes the numerics: x is no longer FP16 (docs/numerics.md), so a decode step
// built on it would be a different model of the weights — which is why this is a measurement.
//
// Arithmetic (lane (g, t) of a quad holds inputs 32t … 32t+31 of a 128-input group of rows g and
// g + 8, as production: int4_matmul.cuh):
//   x:   per 32-input chunk c (group gi = c / 4, lane t = c % 4): a = max |x_i|, s_c = a / 127,
//        q_i = rint(x_i · (127 / a)) in [−127, 127] (a = 0: s_c = 0, q = 0), and z_c = 8 Σ q_i;
//        staged as 8 words a chunk, words 4t+i's inputs in the nibble order of the weight words
//        (ORDER = 0 2 4 6 1 3 5 7, int4_unpack.cuh): lo word i = q at 8i + {0, 4, 1, 5},
//        hi word i = q at 8i + {2, 6, 3, 7}.
//   row: r = Σ_i dp4a(w_i & 0x0f0f0f0f, lo_i) + (Σ_i dp4a(w_i & 0xf0f0f0f0, hi_i) >> 4) − z_c
//        = Σ (c_j − 8) q_j exactly (int32: |Σ| < 32 · 15 · 127 · 16), then
//        acc += float(r) · (s_c · scale_row,gi) in FP32, the quad's 4 lanes added at the tile's end.
// Work split: production's (kernels/gemv_int4.cu's header): a block owns contiguous 16-row tiles,
// its W warps contiguous 128-input group ranges of every one of them, the register batches and
// the block's final sum in warp order the same; the body repeats production's engine on purpose
// (as v2 and v4 do), since the engine has no hook for its arithmetic. Limit: the instructions of
// an item at one or two blocks an SM (above) — what this version exists to measure.
// Why its barriers cannot race (shared memory only; one block, no other block's data): the
// prologue writes x_smem, then __syncthreads; i8x_quantize's threads each read their own chunk's
// x and write only that chunk's xq, xs and xz (disjoint), then __syncthreads; the main loop
// reads xq, xs, xz (written before that barrier, never again) and each lane with t = 0 writes
// its own partial slots [tile][m][warp][row] (no two lanes share one); __syncthreads; then the
// reduction reads the partials. No region is written after a barrier that another thread reads
// it past.
// Bytes: production's weights and scales; x staged as K bytes + 8 bytes a chunk of shared memory
// on top of production's, I8X_SMEM_BYTES(K) (tools/dev_gemv_int4.py: extra_smem_bytes).
// I8X_ONE_BLOCK=1 builds the same machine code; the runner then gives each block 120 KiB more
// shared memory, which it leaves unused, so one block is resident an SM — the occupancy of the
// persistent decode step, where production's engine is slowest (gemv_int4.cu's header: gate_up
// 27.7 µs at one block an SM against 25.6 at two, on an H100).
// SASS (NVRTC 13.0, sm_90a): gate_up's main loop, a batch of 2 items × 2 matrices, 415
// instructions (64 dp4a, 72 LOP3) against production's 546, so ~104 an item and matrix against
// ~136 — a quarter fewer, not the half the unpack alone suggests: the addresses, the batch
// hand-over and the scales stay production's. No spills (124 / 119 registers).
// Measured (tools/dev_kernels.py gemv_int4 --versions v5, 7/7 checks, rel err 2.3e-4 against its
// int8-x reference; then tools/bench_gemv.py --preset 7b --pdl --blocks 132 in the same call,
// one H100 at 3043 GB/s copy; docs/bench/2026-12-08_4bb4fcd_h100_dev_gemv_int4_int8_x.json,
// …_4bb4fcd_h100_bench_gemv_7b_one_block.json), µs at the 7B shapes o_proj / gate_up / down:
//   | production, two blocks an SM (224 / 237 / 224 blocks)      |  4.57 / 24.25 / 14.88 |
//   | this, two blocks an SM (the same grids)                    |  4.31 / 24.15 / 15.54 |
//   | production at one block an SM (132 blocks, PDL)            |  4.70 / 26.14 / 16.36 |
//   | this at one block an SM (I8X_ONE_BLOCK: 112 / 132 / 112)   |  4.47 / 25.33 / 16.14 |
// A quarter fewer instructions an item buy 3 % of gate_up at one block an SM and nothing at two,
// and down loses 4 % at two (its x staging: 592 chunks quantized before the first item). On this
// GPU one block of 8 warps an SM holds gate_up at 88 % of copy bandwidth with production's
// arithmetic (24.25 µs at two blocks is 95 %): the instructions of an item are not what keeps
// the persistent step's GEMV items (gate_up 27.1 µs, down 17.2 in its trace; decode_persistent.cu)
// behind the launches, and a change of the numerics would not pay for itself here. Not wired in.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemv_int4 --versions v5
#include "../../gemv_int4.cu"

#define I8X_CHUNK 32  // inputs per x scale: one lane's share of a 128-input weight group
#define I8X_SMEM_BYTES(K) ((K) + (K) / I8X_CHUNK * 8)  // xq, xs and xz of K inputs
#ifndef I8X_ONE_BLOCK
#define I8X_ONE_BLOCK 0  // read by the runner only (above)
#endif

// d = c + Σ_{b<4} a.byte[b] · b.byte[b], a's bytes unsigned, b's signed (dp4a.u32.s32): 4
// multiply-adds of 8-bit integers in one instruction, exact in int32. Why unsigned a: the high
// nibbles stay at bits 4–7 of each byte (16c ≤ 240), which signed bytes would read as negative.
__device__ __forceinline__ int dp4a_u8s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// x_smem (FP16, gemv_x_slot order, as staged by the prologue) → per chunk c: xq[2c], xq[2c + 1]
// (the lo and hi words, above), xs[c] = s_c, xz[c] = z_c. One thread a chunk; every thread calls
// it (ends with __syncthreads).
__device__ __forceinline__ void i8x_quantize(const uint4* x_smem, uint4* xq, float* xs, int* xz, int K) {
    for (int c = threadIdx.x; c < K / I8X_CHUNK; c += blockDim.x) {
        const int gi = c / 4, t = c % 4;
        float v[32];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 w = x_smem[gi * GEMV_CHUNKS_PER_GROUP + 4 * i + t];  // inputs 32t + 8i … +8
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[j]));
                v[8 * i + 2 * j] = f.x;
                v[8 * i + 2 * j + 1] = f.y;
            }
        }
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) a = fmaxf(a, fabsf(v[j]));
        const float inv = a > 0.f ? 127.f / a : 0.f;
        int q[32], sum = 0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            q[j] = __float2int_rn(v[j] * inv);
            sum += q[j];
        }
        auto pack = [&](int b, int o0, int o1, int o2, int o3) {
            return (u32)(q[b + o0] & 0xff) | (u32)(q[b + o1] & 0xff) << 8 | (u32)(q[b + o2] & 0xff) << 16 |
                   (u32)(q[b + o3] & 0xff) << 24;
        };
        xq[2 * c] = make_uint4(pack(0, 0, 4, 1, 5), pack(8, 0, 4, 1, 5), pack(16, 0, 4, 1, 5), pack(24, 0, 4, 1, 5));
        xq[2 * c + 1] = make_uint4(pack(0, 2, 6, 3, 7), pack(8, 2, 6, 3, 7), pack(16, 2, 6, 3, 7), pack(24, 2, 6, 3, 7));
        xs[c] = a / 127.f;
        xz[c] = 8 * sum;
    }
    __syncthreads();
}

// Σ (c − 8) q over one lane's 32 inputs of one row: w its 4 weight words, lo / hi its x words.
__device__ __forceinline__ int i8x_row(const uint4& w, const uint4& lo, const uint4& hi, int z) {
    int s_lo = dp4a_u8s8(w.x & 0x0f0f0f0fu, lo.x, 0), s_hi = dp4a_u8s8(w.x & 0xf0f0f0f0u, hi.x, 0);
    s_lo = dp4a_u8s8(w.y & 0x0f0f0f0fu, lo.y, s_lo), s_hi = dp4a_u8s8(w.y & 0xf0f0f0f0u, hi.y, s_hi);
    s_lo = dp4a_u8s8(w.z & 0x0f0f0f0fu, lo.z, s_lo), s_hi = dp4a_u8s8(w.z & 0xf0f0f0f0u, hi.z, s_hi);
    s_lo = dp4a_u8s8(w.w & 0x0f0f0f0fu, lo.w, s_lo), s_hi = dp4a_u8s8(w.w & 0xf0f0f0f0u, hi.w, s_hi);
    return s_lo + (s_hi >> 4) - z;  // s_hi = 16 Σ c q exactly: the shift is exact
}

// production's gemv_int4_engine for one token, Layout GemvTileMajor, with the arithmetic above.
// Shared memory: x as the prologue stages it (K/8 chunks), xq (K/16 chunks), xs and xz (K/32
// floats and ints), then the warp partials [tiles][MT][W][16] fp32.
template <int MT, typename XSource, typename Epilogue>
__device__ __forceinline__ void gemv_int4_block_i8x(const GemvProblem<MT, 1>& p, int K, XSource x_src,
                                                    Epilogue epilogue) {
    constexpr int UNROLL = GEMV_GROUP_UNROLL(MT);
    extern __shared__ uint4 x_smem[];
    uint4* xq = x_smem + x_src.smem_chunks(K);
    float* xs = reinterpret_cast<float*>(xq + K / 16);
    int* xz = reinterpret_cast<int*>(xs + K / I8X_CHUNK);
    float* partial = reinterpret_cast<float*>(xz + K / I8X_CHUNK);

    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / QUAD_SIZE, t = lane % QUAD_SIZE;
    const int warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    const int n_groups = K / INT4_GROUP;
    const int gb = warp * n_groups / n_warps, ge = (warp + 1) * n_groups / n_warps;
    const int n_tiles = p.first_tile[1];
    const int tile_b = blockIdx.x * n_tiles / gridDim.x, tile_e = (blockIdx.x + 1) * n_tiles / gridDim.x;
    const u64 policy = l2_evict_first_policy();
    grid_launch_dependents();

    int ld_tile = tile_b, ld_gi = gb;
    auto load = [&](GemvBatch<MT, UNROLL>& b) {  // production's, one segment
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (ld_tile >= tile_e || gb >= ge) break;  // warp-uniform
            const int n = p.n[0], tile = ld_tile;
            int lo, hi;
            gemv_tile_rows(tile, g, 0, lo, hi);
            const u32 r0 = min(lo, n - 1), r1 = min(hi, n - 1);
            const u32 w_off = GemvTileMajor::quad_offset(tile, g, ld_gi, K, t);
            const u32 s0_off = r0 * (u32)n_groups + (u32)ld_gi, s1_off = r1 * (u32)n_groups + (u32)ld_gi;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const unsigned short* sc = reinterpret_cast<const unsigned short*>(p.scales[0][m]);
                const u32* qw = p.qweight[0][m] + w_off;
                b.w[u][m][0] = ld_stream_v4(qw, policy);
                b.w[u][m][1] = ld_stream_v4(qw + 8 * GEMV_WORDS_PER_GROUP, policy);  // row g + 8
                b.s[u][m][0] = __ldg(sc + s0_off);
                b.s[u][m][1] = __ldg(sc + s1_off);
            }
            if (++ld_gi == ge) { ld_gi = gb; ++ld_tile; }
        }
    };

    GemvBatch<MT, UNROLL> cur, next;
    load(cur);
    grid_dependency_wait();
    x_src(x_smem, K);
    __syncthreads();
    i8x_quantize(x_smem, xq, xs, xz, K);

    float acc[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
    int c_tile = tile_b, c_gi = gb;
    while (c_tile < tile_e && gb < ge) {
        load(next);  // in flight while `cur` is multiplied
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (c_tile >= tile_e) break;  // warp-uniform
            const int c = c_gi * 4 + t;  // this lane's x chunk
            const uint4 lo = xq[2 * c], hi = xq[2 * c + 1];
            const float s_x = xs[c];
            const int z = xz[c];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const int r0 = i8x_row(cur.w[u][m][0], lo, hi, z), r1 = i8x_row(cur.w[u][m][1], lo, hi, z);
                acc[m][0] = fmaf((float)r0, s_x * gemv_scale(cur.s[u][m][0]), acc[m][0]);
                acc[m][1] = fmaf((float)r1, s_x * gemv_scale(cur.s[u][m][1]), acc[m][1]);
            }
            if (++c_gi == ge) {  // the tile's last group of this warp's range: the quad's sum, published
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        acc[m][h] += shfl_xor_f32(acc[m][h], 1);
                        acc[m][h] += shfl_xor_f32(acc[m][h], 2);
                    }
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
        cur = next;
    }
    __syncthreads();

    for (int o = threadIdx.x; o < (tile_e - tile_b) * 8; o += blockDim.x) {
        const int tl = o / 8, gg = o % 8;
        float sums[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* src = partial + ((tl * MT + m) * n_warps) * INT4_TILE_ROWS + gg + 8 * h;
                float s = 0.f;
                for (int w = 0; w < n_warps; ++w) s += src[w * INT4_TILE_ROWS];
                sums[m][h] = s;
            }
        epilogue(tile_b + tl, gg, sums);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_residual_i8x(float* __restrict__ residual,      // [N] fp32, in/out
                       const __half* __restrict__ x,      // [K] fp16
                       const u32* __restrict__ qweight,   // [ceil(N/16), K/128, 16, 16] uint32
                       const __half* __restrict__ scales, // [N, K/128] fp16
                       int N, int K) {
    const GemvProblem<1, 1> p = {{{qweight}}, {{scales}}, {N}, {0, int4_tiles(N)}, {0}};
    gemv_int4_block_i8x(p, K, GemvStageX{x}, [&](int tile, int g, const float (&s)[1][2]) {
        gemv_store_rows(tile, g, N, s[0], [&](int row, float v) { residual[row] += v; });
    });
}

extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * WARP_SIZE)
gemv_int4_gate_up_swiglu_i8x(__half* __restrict__ h,                // [F] fp16, out
                             const float* __restrict__ residual,    // [K] fp32, the residual stream
                             const __half* __restrict__ norm_w,     // [K] fp16, post_attention_layernorm gain
                             const u32* __restrict__ gate_qweight,  // [F/16, K/128, 16, 16] uint32
                             const __half* __restrict__ gate_scales,// [F, K/128] fp16
                             const u32* __restrict__ up_qweight,    // [F/16, K/128, 16, 16] uint32
                             const __half* __restrict__ up_scales,  // [F, K/128] fp16
                             int F, int K, float eps) {
    const GemvProblem<2, 1> p = {{{gate_qweight, up_qweight}}, {{gate_scales, up_scales}},
                                 {F}, {0, int4_tiles(F)}, {0}};
    gemv_int4_block_i8x(p, K, GemvStageRmsNorm{residual, norm_w, eps}, [&](int tile, int g, const float (&s)[2][2]) {
        const int lo = tile * INT4_TILE_ROWS + g;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (lo + 8 * r < F) h[lo + 8 * r] = swiglu_f16(s[0][r], s[1][r]);
    });
}
