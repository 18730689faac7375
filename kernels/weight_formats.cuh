// kernels/weight_formats.cuh — the per-tensor weight formats of a `.nanoqwen` file (version 4,
// format/weight_formats.py), read on the GPU: one chunk of 32 inputs of one row at a time.
//
//   wf_load<F[, QUAD]>(w, row, chunk, K, policy[, quad_lane])
//                                          the chunk's bytes as stored (codes, high bits, scales):
//                                          wf_load_at(wf_addr(w, row, chunk, K[, quad_lane]))
//   wf_addr_quads<F>(at, q), wf_addr_rows<F>(at, step, K)
//                                          the addresses (WfAddr) of the chunk 4q chunks further
//                                          on, or `rows` rows further down, from those of `at`
//   wf_quad_gather<F>(raw, lane)           completes a chunk whose quad shared its scale loads
//                                          (QUAD: q4_k/q5_k's (d, dmin) from the quad's 4 words)
//   wf_pairs<F>(raw, a)                    its 32 codes as 16 half2 of exact FP16 integers
//                                          (c − z, or c for the formats with an offset)
//   wf_pairs_tiny<F>(raw, a)               the same codes c as FP16 subnormals c·2⁻²⁴ (16c·2⁻²⁴ at
//                                          inputs 2, 3, 6, 7 of each 8), z not taken off: no
//                                          f16x2 instruction (gemv_fmt.cu; WfTiny<F> says which)
//   wf_scales<F[, QUAD]>(raw, chunk, s, o) the FP32 scale (and offset) of each scale group in it
//   wf_dequant<F>(raw, chunk, e)           weight e of the chunk in FP32, in the reference's
//                                          order of operations (bit for bit the CPU's value)
//   wf_dequant_pairs<F>(raw, chunk, w)     all 32 of them rounded to FP16, as 16 half2
//   WF_DISPATCH(fmt, F, ...)               the statements with F the compile-time format of a
//                                          runtime id (one instance per format)
//
// Every kernel that reads a format calls these (the decode GEMVs and the embedding rows of
// gemv_fmt.cu, the prefill GEMMs of gemm_fmt.cu and gemm_fmt_wgmma.cu), so a format's bit layout
// is written once: its planes' addresses in wf_addr (their steps along a row and down rows in
// wf_addr_quads and wf_addr_rows), its loads in wf_load_at. A chunk is the unit because it is the
// smallest piece every format splits evenly into: 32 inputs hold whole scale groups of every
// format (16 or 32 inputs) or lie inside one (128 for int4_g128, 256-input super-blocks for the
// K-quants), and its codes are 16 bytes of nibbles (4–6 bits) or 32 bytes (8 bits): one or two
// 16-byte loads.
//
// The formats (w = weight, c = the unsigned b-bit code, per scale group a scale s and maybe an
// offset o; all arithmetic FP32):
//   | id | name       | b | group        | scale, offset                | GGUF |
//   |  1 | int4_g128  | 4 | 128          | fp16 s;  w = (c − 8) s       | –    |
//   |  2 | q4_g32     | 4 | 32           | fp16 s;  w = (c − 8) s       | Q4_0 |
//   |  3 | q4_g32_min | 4 | 32           | fp16 s, o; w = c s + o       | Q4_1 |
//   |  5 | q5_g32     | 5 | 32           | fp16 s;  w = (c − 16) s      | Q5_0 |
//   |  6 | q5_g32_min | 5 | 32           | fp16 s, o; w = c s + o       | Q5_1 |
//   |  9 | q8_g32     | 8 | 32           | fp16 s;  w = (c − 128) s     | Q8_0 |
//   | 10 | q4_k       | 4 | 32 in 256    | w = (d·sc) c − (dmin·m)      | Q4_K |
//   | 11 | q5_k       | 5 | 32 in 256    | w = (d·sc) c − (dmin·m)      | Q5_K |
//   | 12 | q6_k       | 6 | 16 in 256    | w = (d·sc) (c − 32)          | Q6_K |
//   | 16 | dense      |16 | –            | w = the FP16 value itself    | F16  |
// The K-quants keep the GGUF's two levels: fp16 d (and dmin) per 256 inputs, 6-bit (sc, m)
// packed in 12 bytes (q4_k, q5_k) or int8 sc per 16 inputs (q6_k). d·sc has at most 11 + 8
// significant bits, so the FP32 product is exact, and the bytes per weight are the GGUF's.
//
// Planes of a weight [N, K] (row-major but for the 4–6-bit codes; chunk c of a row = inputs
// 32c … 32c+31):
//   qweight u32 [N, K/8]    low 4 bits, layout id 1: word j holds inputs 8j … 8j+7, nibble p
//                           input 8j + ORDER[p], ORDER = 0 2 4 6 1 3 5 7 (ptx/int4_unpack.cuh);
//                           on the GPU tile-major (below): u32 [ceil(N/16), K/128, 16, 16]
//           u32 [N, K/4]    8-bit codes: byte i of word j is input 4j + i
//           u32 [N, K/2]    dense: the FP16 values, two per word (the `.weight` tensor)
//   qhigh   u32 [N, K/32]   5-bit: bit 4p + i of word c = bit 4 of input 32c + 8i + ORDER[p]
//           u32 [N, K/16]   6-bit: bits 4p + 2(i%2) +{0,1} of word 2c + i/2 = bits 4, 5 of it
//                           on the GPU tile-major (below): u32 [ceil(N/16), K/128, 16, 4·HB]
//   scales  fp16 [N, K/g] | uint8 [N, K/256, 12] (q4_k, q5_k) | int8 [N, K/16] (q6_k)
//           q4_k, q5_k on the GPU: uint32 [N, K/256, 4], a super-block's 12 bytes and its (d, dmin)
//           together as four lane words (below)
//   aux     fp16 offsets [N, K/32] (q4_g32_min, q5_g32_min) | fp16 superscales [N, K/256] = d
//           (q6_k) | q4_k, q5_k: fp16 (d, dmin) [N, K/256, 2] in the file, none on the GPU (null)
// The high bits sit at the bit positions of their inputs' nibbles (shifted by i), so they join
// the FP16 magic-number unpack with one lop3 per pair of inputs, no per-input shifts (below).
//
// The device layout of the 4–6-bit codes (Wf<F>::TILED) is the INT4 kernels' tile-major one with
// rows in plain order (format/int4_tiles.py, pair_dim 0; kernels/weight_layout.cu writes it when
// a model is loaded): the 16 rows × 4 chunks of a (16-row tile, 128-input quad) — what one decode
// GEMV item loads, 16 bytes a lane — are 1 KiB of contiguous memory, where the file's rows spread
// them over 16 pieces of 64 B, K/2 bytes apart. Word w of row r's codes sits at
//   (r − r % 16)·K/8 + (w / 16)·256 + (r % 16)·16 + w % 16
// (rows padded to a whole tile). Why: the loads alone of the 7B's q4_k gate_up GEMV ran at 69 % of
// a plain copy's bandwidth with the file's rows and 88 % with the codes at tile-major addresses
// (a timing probe on an H100: docs/bench/2026-12-06_dcc76b7_h100_fmt_tile_probe.json). The high
// bits (qhigh: HB words a chunk) lie the same way, their 16 rows × 4 chunks of an item 4·HB
// words a row, 64·HB words an item: in that probe q5_k's and q6_k's gate_up loads went further
// with them moved too (q6_k: 84 → 94 % of copy). The scales and offsets stay row-major: 2 bytes
// a chunk or less, read through L1 (the quad's lanes and a super-block's chunks share them).
//
// The q4_k/q5_k scales on the GPU: lane words. A super-block's 12 bytes of packed (sc, m) and
// its (d, dmin) — 16 bytes, in the scales and aux planes as the file has them — hold on the GPU
// the same 16 bytes rearranged into four 32-bit lane words, one 16-byte vector a super-block in
// one plane, scales uint32 [N, K/256, 4] (format/kquant_lanes.py; kernels/weight_layout.cu
// writes them when a model is loaded; the aux pointer is null):
//   word t (t < 4) = sc_t | m_t << 6 | sc_{t+4} << 12 | m_{t+4} << 18 | D_t << 24
// where sc_j, m_j are sub-block j's 6-bit values (gguf's get_scale_min_k4) and D_0 … D_3 the
// bytes of (d, dmin) (fp16 d in D_0, D_1). The decode GEMVs' lane t of a quad works on chunk t
// or t + 4 of a super-block (QUAD, below): with the file's packing each lane needed three of
// the 12 bytes, gathered from the quad by 4 shuffles, and a dozen integer ops to unpick its
// (sc, m) from them (get_scale_min_k4's two cases); here it loads word t, finds its (sc, m) in
// it with two shifts and two masks, and (d, dmin) in the quad's four top bytes with 2 shuffles.
// SASS of the 7B's {q4_k, q6_k} build (NVRTC 13.0, tools/sass_loops.py): q4_k gate/up 368 → 318
// instructions an item, residual 431 → 387 for two; the bytes and registers the same
// (docs/bench/2026-12-06_{c0d69c5,7c70cb6}_cpu_sass_gemv_fmt_q4_k_q6_k.json; docs/kernels.md has q5_k's).
// The four words lie together (16 bytes, aligned) because the prefill GEMMs' consumers want all
// four of a row at once (gemm_int4.cu: GemmQ4kScales): one 16-byte load, where words 0–2 in one
// plane and word 3 in another took four loads a row and group — and with the scale loads taken
// out of those GEMMs (a timing probe) the 7B's Q4_K layers at 512 rows ran in 11.13 ms against
// 12.16 (INT4: 10.82; docs/bench/2026-12-07_a86b9cd_h100_gemm7b_scale_probe_m512.json). With the
// one plane, on one H100 beside the two-plane build: Q4_K 12.24 → 11.74 ms, Q5_K 13.03 → 12.60,
// and the Q4_K_M 7B's TTFT(512) 13.5 → 12.8 ms at the same decode ITL (docs/benchmarks.md). A
// decode lane (QUAD) still loads the one word it needs, now at a stride of 16 bytes in every lane.
#pragma once
#include <cuda_fp16.h>

#include "types.cuh"        // u32, u64
#include "ldst.cuh"         // ld_stream_v4, ld_nc_noalloc_u32
#include "int4_unpack.cuh"  // lop3_and_or, INT4_MASK_LO/HI, FP16X2_1024, FP16X2_1_16
#include "warp.cuh"         // shfl_xor_i32

#define WF_INT4_G128  1
#define WF_Q4_G32     2
#define WF_Q4_G32_MIN 3
#define WF_Q5_G32     5
#define WF_Q5_G32_MIN 6
#define WF_Q8_G32     9
#define WF_Q4_K       10
#define WF_Q5_K       11
#define WF_Q6_K       12
// A dense FP16 weight (a file's format 0, `<prefix>.weight` fp16 [N, K]: a GGUF's F16 projection
// kept as it is). Not a `.nanoqwen` format id: the kernels' name for a dense matrix.
#define WF_DENSE        16
// WF_FORMATS: the formats a kernel file is compiled for, bit `id` set for each (default: all of
// them). The launchers compile a model's kernels for its own formats only
// (launchers/gemv_fmt.py: format_defines): a kernel's register count is the largest that any
// format it can dispatch to needs, so code for formats the model never runs can cost it half
// its resident warps (gemv_fmt.cu), besides compile time. A kernel asked for a format it was
// not compiled for does nothing (wf_known); the launchers refuse that before a launch.
#ifndef WF_FORMATS
#define WF_FORMATS ((1u << WF_INT4_G128) | (1u << WF_Q4_G32) | (1u << WF_Q4_G32_MIN) | (1u << WF_Q5_G32) | \
                    (1u << WF_Q5_G32_MIN) | (1u << WF_Q8_G32) | (1u << WF_Q4_K) | (1u << WF_Q5_K) |       \
                    (1u << WF_Q6_K) | (1u << WF_DENSE))
#endif
#define WF_COMPILED(id) ((((WF_FORMATS) >> (id)) & 1u) != 0u)
#define WF_CHUNK      32   // inputs per chunk
#define WF_SUPER      256  // inputs per K-quant super-block
#define WF_TILE_ROWS  16   // rows of a tile of the tile-major codes (int4_matmul.cuh's INT4_TILE_ROWS)
#define WF_TILED_BITS 6    // codes of this many bits or fewer are tile-major on the GPU (Wf<F>::TILED)

// One weight's planes in device memory (null where the format has none).
struct WfWeight {
    const u32* qweight;
    const u32* qhigh;
    const void* scales;
    const void* aux;  // offsets or superscales
};

// Compile-time facts of format F.
template <int F>
struct Wf {
    static constexpr int BITS = F == WF_DENSE ? 16 : F == WF_Q8_G32 ? 8
                              : (F == WF_Q5_G32 || F == WF_Q5_G32_MIN || F == WF_Q5_K) ? 5 : F == WF_Q6_K ? 6 : 4;
    static constexpr bool OFFSET = F == WF_Q4_G32_MIN || F == WF_Q5_G32_MIN || F == WF_Q4_K || F == WF_Q5_K;
    static constexpr bool KQUANT = F == WF_Q4_K || F == WF_Q5_K || F == WF_Q6_K;
    static constexpr int SUBS = F == WF_Q6_K ? 2 : 1;        // scale groups per chunk
    static constexpr int ZERO = OFFSET ? 0 : 1 << (BITS - 1);  // z of w = (c − z) s
    static constexpr int HB = BITS == 5 ? 1 : BITS == 6 ? 2 : 0;  // high bits per input
    static constexpr int CODE_BYTES = BITS >= 8 ? BITS * WF_CHUNK / 8 : 16;  // a chunk's qweight
    static constexpr bool TILED = BITS <= WF_TILED_BITS;  // qweight tile-major on the GPU (above)
};

// A chunk of one row as loaded: registers, most of them unused by any one format (the
// compiler drops those).
struct WfRaw {
    uint4 q0, q1;  // codes: nibbles (q0), or bytes 0–15 and 16–31 (8-bit), or FP16 values 0–15 (dense)
    uint4 q2, q3;  // dense: values 16–31
    u32 h0, h1;    // high bits (h1: 6-bit only)
    u32 s0, s1, s2;  // scale bytes: fp16 s | s, o | q4_k/q5_k: lane words 0–2 (QUAD: s0 this lane's word) | q6_k: 2 int8
    u32 d;         // q6_k: fp16 d | q4_k/q5_k: lane word 3 (QUAD, after wf_quad_gather: fp16 (d, dmin))
};

// Where one chunk's bytes lie: per plane, the address its loads read (null where the format has
// none, or where this chunk reads nothing from the plane).
struct WfAddr {
    const u32* q;   // codes: the chunk's first word (its 16, 32 or 64 bytes start here)
    const u32* h;   // high bits: the chunk's word (5-bit) or its 2 words (6-bit)
    const void* s;  // scales: the chunk's group's fp16 scale | q6_k: the chunk's 2 int8 | q4_k/q5_k:
                    // the super-block's 4 lane words, or with QUAD this lane's word (0–3)
    const void* a;  // aux: the group's fp16 offset | q6_k: the super-block's fp16 d | q4_k/q5_k: none
};

// The addresses of chunk `chunk` of row `row` (wf_load's arguments). Offsets are 32-bit element
// indices (row · plane width + chunk's place), widened once when added to the plane's pointer:
// the launchers keep every plane under 2^32 elements (launchers/gemv_fmt.py: FmtWeight.check),
// and 64-bit index products would cost the GEMVs issue slots, which is what they are short of
// (gemv_fmt.cu).
//
// QUAD: the caller's 4 lanes of a quad (quad_lane = lane % 4) load 4 consecutive chunks
// 4q … 4q+3 of the same row, which lie in one K-quant super-block (8 chunks), lane t chunk
// 4q + t. The q4_k/q5_k lane words are then loaded one per lane (lane t: word t, the one with
// its chunk's (sc, m); the quad's 4 loads one 16-byte piece), and wf_quad_gather collects (d, dmin) from the quad's four just before
// use: each lane holds 1 register of scales while the load is in flight, the margin that lets
// the fused GEMVs fit 128 registers (gemv_fmt.cu). Other formats load as without it.
template <int F, bool QUAD = false>
__device__ __forceinline__ WfAddr wf_addr(const WfWeight& w, u32 row, int chunk, int K, int quad_lane = 0) {
    WfAddr p = {};
    const u32 c = (u32)chunk;
    if constexpr (Wf<F>::BITS == 16) {
        p.q = w.qweight + (row * (u32)(K / 2) + 16u * c);
        return p;  // no scales
    } else if constexpr (Wf<F>::BITS == 8) {
        p.q = w.qweight + (row * (u32)(K / 4) + 8u * c);
    } else {  // tile-major: the tile's first row, the quad, the row in the tile, the chunk in the quad
        p.q = w.qweight + ((row & ~(WF_TILE_ROWS - 1u)) * (u32)(K / 8) + (c >> 2) * 256u +
                           (row & (WF_TILE_ROWS - 1u)) * 16u + 4u * (c & 3u));
    }
    if constexpr (Wf<F>::HB > 0) {  // tile-major as the codes, HB words a chunk
        constexpr u32 HB = Wf<F>::HB;
        p.h = w.qhigh + ((row & ~(WF_TILE_ROWS - 1u)) * (u32)(K / 32) * HB + (c >> 2) * (64u * HB) +
                         (row & (WF_TILE_ROWS - 1u)) * (4u * HB) + HB * (c & 3u));
    }
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        const u32 sb = row * (u32)(K / WF_SUPER) + c / 8u;  // the super-block
        const u32* lw = static_cast<const u32*>(w.scales) + 4u * sb;  // its 4 lane words
        p.s = QUAD ? lw + quad_lane : lw;  // QUAD: this lane's lane word
    } else if constexpr (F == WF_Q6_K) {
        p.s = static_cast<const unsigned short*>(w.scales) + (row * (u32)(K / 32) + c);
        p.a = static_cast<const unsigned short*>(w.aux) + (row * (u32)(K / WF_SUPER) + c / 8u);
    } else {
        constexpr u32 group = F == WF_INT4_G128 ? 128 : 32;
        const u32 at = row * (u32)(K / group) + c * WF_CHUNK / group;
        p.s = static_cast<const unsigned short*>(w.scales) + at;
        if constexpr (Wf<F>::OFFSET) p.a = static_cast<const unsigned short*>(w.aux) + at;
    }
    return p;
}

// `p` moved on by n steps of `bytes`, a constant: one 64-bit multiply-add (IMAD.WIDE.U32).
template <typename T>
__device__ __forceinline__ const T* wf_advance(const T* p, u32 n, u32 bytes) {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p) + (u64)n * bytes);
}

// The same for a `bytes` known only at run time (a row's bytes: K-dependent). The product is
// written as PTX mul.wide.u32 because, from (u64)n * bytes, the compiler widens a loop-invariant
// `bytes` once, outside the loop, and multiplies in 64 bits, which ptxas completes with an add
// to the high word at every call.
template <typename T>
__device__ __forceinline__ const T* wf_advance_var(const T* p, u32 n, u32 bytes) {
    u64 off;
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(off) : "r"(n), "r"(bytes));
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p) + off);
}

// The addresses of chunk c + 4q of the same row, from those of chunk c (`at`, from wf_addr, with
// or without QUAD: the steps are the same), where c lies in the first half of its super-block (c % 8 < 4):
// the chunk planes move q quads (4 chunks; the tile-major codes and high bits q items of 16 rows
// × 4 chunks), the planes of one entry per super-block (8 chunks) move ⌊q/2⌋ super-blocks. The
// sums equal wf_addr's at chunk c + 4q: wf_addr's 32-bit indices stay below 2^32, so adding in
// 64 bits gives the same addresses.
//
// For the decode GEMVs (gemv_fmt.cu), which are issue-bound: they keep wf_addr of their lane's
// chunk in quad 0 of a tile row (the load cursor) and call this per item: one multiply-add per
// plane and one shift for the super-block planes, where wf_addr per item recomputes the row's offset in every plane, the chunk terms and
// the super-block.
template <int F>
__device__ __forceinline__ WfAddr wf_addr_quads(const WfAddr& at, u32 q) {
    const u32 sbs = q >> 1;  // super-blocks passed
    WfAddr p = at;
    p.q = wf_advance(at.q, q, (Wf<F>::TILED ? WF_TILE_ROWS : 1) * 4 * Wf<F>::CODE_BYTES);
    if constexpr (Wf<F>::BITS == 16) return p;
    if constexpr (Wf<F>::HB > 0) p.h = wf_advance(at.h, q, WF_TILE_ROWS * 4 * 4 * Wf<F>::HB);  // an item: 16 × 4 chunks
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        p.s = wf_advance(at.s, sbs, 16);  // 4 lane words per super-block
    } else if constexpr (F == WF_Q6_K) {
        p.s = wf_advance(at.s, q, 4 * 2);  // 2 int8 per chunk
        p.a = wf_advance(at.a, sbs, 2);    // fp16 d per super-block
    } else {
        constexpr u32 QUAD_BYTES = F == WF_INT4_G128 ? 2 : 4 * 2;  // fp16 per 128 or per 32 inputs
        p.s = wf_advance(at.s, q, QUAD_BYTES);
        if constexpr (Wf<F>::OFFSET) p.a = wf_advance(at.a, q, QUAD_BYTES);
    }
    return p;
}

// A step from row `from` down to row `to` (to ≥ from) of one weight, as wf_addr_rows takes it:
// the rows, and the chunks the tile-major planes move (16 bytes each in the codes, 4·HB in the
// high bits), (to's place − from's place) in wf_addr's terms, which is ≥ 0 for K a multiple of
// 128 (a later tile starts at least 16·K/32 − 60 chunks further on: more than a row of a tile can
// be back; FmtWeight.check holds the kernels to such K). The decode GEMVs make one a tile, when
// they move to it, for every item.
struct WfRowStep {
    u32 rows;
    u32 tiled_chunks;
};

__device__ __forceinline__ WfRowStep wf_row_step(u32 from, u32 to, int K) {
    constexpr u32 TILE = WF_TILE_ROWS - 1u;
    return {to - from, ((to & ~TILE) - (from & ~TILE)) * (u32)(K / 32) + ((to & TILE) - (from & TILE)) * 4u};
}

// The addresses of the same chunk one step (wf_row_step) further down, from those of `at`
// (wf_addr, with or without QUAD, or wf_addr_quads of it): every plane moves by whole rows, the
// tile-major codes and high bits by the step's chunks, one multiply-add each. The sums equal wf_addr's at the step's row, as in
// wf_addr_quads. The decode GEMVs reach the second row of their tile with it, and the next
// tile's rows.
template <int F>
__device__ __forceinline__ WfAddr wf_addr_rows(const WfAddr& at, WfRowStep step, int K) {
    const u32 rows = step.rows;
    WfAddr p = at;
    if constexpr (Wf<F>::TILED) {
        p.q = wf_advance(at.q, step.tiled_chunks, 16);
    } else {
        p.q = wf_advance_var(at.q, rows, (u32)(K / WF_CHUNK) * Wf<F>::CODE_BYTES);
    }
    if constexpr (Wf<F>::BITS == 16) return p;
    if constexpr (Wf<F>::HB > 0) p.h = wf_advance(at.h, step.tiled_chunks, 4 * Wf<F>::HB);
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        p.s = wf_advance_var(at.s, rows, (u32)(K / WF_SUPER) * 16);  // 4 lane words per super-block
    } else if constexpr (F == WF_Q6_K) {
        p.s = wf_advance_var(at.s, rows, (u32)(K / 16));               // 1 int8 per 16 inputs
        p.a = wf_advance_var(at.a, rows, (u32)(K / WF_SUPER) * 2);     // fp16 d per super-block
    } else {
        constexpr u32 group = F == WF_INT4_G128 ? 128 : 32;
        p.s = wf_advance_var(at.s, rows, (u32)(K / group) * 2);
        if constexpr (Wf<F>::OFFSET) p.a = wf_advance_var(at.a, rows, (u32)(K / group) * 2);
    }
    return p;
}

// The chunk's bytes from its addresses (wf_addr, wf_addr_quads, wf_addr_rows). Codes and high
// bits are streamed (read once per token: L1::no_allocate, L2 evict-first); scales go through L1
// (__ldg), as the 4 lanes of a quad and the 8 chunks of a super-block share them. QUAD: as the
// addresses were computed (with QUAD, q4_k/q5_k load one scale word per lane).
template <int F, bool QUAD = false>
__device__ __forceinline__ WfRaw wf_load_at(const WfAddr& p, u64 policy) {
    WfRaw r = {};
    if constexpr (Wf<F>::BITS == 16) {
        const uint4* q = reinterpret_cast<const uint4*>(p.q);
        r.q0 = ld_stream_v4(q, policy);
        r.q1 = ld_stream_v4(q + 1, policy);
        r.q2 = ld_stream_v4(q + 2, policy);
        r.q3 = ld_stream_v4(q + 3, policy);
        return r;  // no scales
    } else if constexpr (Wf<F>::BITS == 8) {
        const uint4* q = reinterpret_cast<const uint4*>(p.q);
        r.q0 = ld_stream_v4(q, policy);
        r.q1 = ld_stream_v4(q + 1, policy);
    } else {
        r.q0 = ld_stream_v4(reinterpret_cast<const uint4*>(p.q), policy);
    }
    if constexpr (Wf<F>::HB == 1) r.h0 = ld_nc_noalloc_u32(p.h);
    if constexpr (Wf<F>::HB == 2) {
        const uint2 h = ld_nc_noalloc_v2(p.h);
        r.h0 = h.x;
        r.h1 = h.y;
    }
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        if constexpr (QUAD) {  // this lane's lane word
            r.s0 = __ldg(static_cast<const u32*>(p.s));
        } else {  // the super-block's 4 lane words, one 16-byte load
            const uint4 lw = __ldg(static_cast<const uint4*>(p.s));
            r.s0 = lw.x;
            r.s1 = lw.y;
            r.s2 = lw.z;
            r.d = lw.w;
        }
    } else if constexpr (F == WF_Q6_K) {
        r.s0 = __ldg(static_cast<const unsigned short*>(p.s));
        r.d = __ldg(static_cast<const unsigned short*>(p.a));
    } else {
        r.s0 = __ldg(static_cast<const unsigned short*>(p.s));
        if constexpr (Wf<F>::OFFSET) r.s1 = __ldg(static_cast<const unsigned short*>(p.a));
    }
    return r;
}

// The prmt selector that puts wf_quad_gather's bytes in order for lane t = lane % 4: byte k of
// the result is D_k, which lane t holds as byte f(k ^ t) of (pair, other), f = 0, 1, 4, 5 for
// k ^ t = 0 … 3 (pair: D_t, D_{t^1}; other: D_{t^2}, D_{t^3}). t = 0 gives 0x5410; t's bit 0
// swaps the bytes within each half (^ 0x1111), bit 1 the halves (^ 0x4444).
__device__ __forceinline__ u32 wf_kq_order(int lane) {
    return 0x5410u ^ ((u32)(lane & 1) * 0x1111u) ^ ((u32)(lane & 2) * 0x2222u);
}

// (d, dmin) of a q4_k/q5_k super-block from its 4 lane words w0 … w3 as loaded without QUAD
// (their top bytes D_0 … D_3).
__device__ __forceinline__ u32 wf_kq_dd(u32 w0, u32 w1, u32 w2, u32 w3) {
    return __byte_perm(__byte_perm(w0, w1, 0x0073u), __byte_perm(w2, w3, 0x0073u), 0x5410u);
}

// Chunk `chunk` of row `row`: its addresses (wf_addr), loaded (wf_load_at).
template <int F, bool QUAD = false>
__device__ __forceinline__ WfRaw wf_load(const WfWeight& w, u32 row, int chunk, int K, u64 policy,
                                         int quad_lane = 0) {
    return wf_load_at<F, QUAD>(wf_addr<F, QUAD>(w, row, chunk, K, quad_lane), policy);
}

// A chunk loaded with QUAD, made whole: q4_k/q5_k's (d, dmin) into r.d from the top bytes
// D_0 … D_3 of the quad's 4 lane words (lane 4⌊lane/4⌋ + t loaded word t), r.s0 left as this
// lane's word. Two butterfly steps: lane t first pairs its D_t with its neighbour's D_{t^1}
// (bytes 0, 1 of `pair`), then takes the other pair's two bytes (D_{t^2}, D_{t^3}) and puts the
// four in order with one prmt whose selector depends on t alone (wf_kq_order). Every lane of
// the warp must call it (a shuffle).
template <int F>
__device__ __forceinline__ WfRaw wf_quad_gather(const WfRaw& r, int lane) {
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        WfRaw out = r;
        const u32 pair = __byte_perm(r.s0, (u32)shfl_xor_i32((int)r.s0, 1), 0x0073u);  // D_t, D_{t^1}
        const u32 other = (u32)shfl_xor_i32((int)pair, 2);                              // D_{t^2}, D_{t^3}
        out.d = __byte_perm(pair, other, wf_kq_order(lane));
        return out;
    } else {
        return r;
    }
}

__device__ __forceinline__ u32 wf_word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

__device__ __forceinline__ float wf_half_lo(u32 v) { return __half2float(__ushort_as_half((unsigned short)(v & 0xFFFFu))); }
__device__ __forceinline__ float wf_half_hi(u32 v) { return __half2float(__ushort_as_half((unsigned short)(v >> 16))); }

// FP16 constants as half2 bit patterns, exact for z ≤ 63 (NEG_HI) and z ≤ 1023 (SUB_LO):
// 1024 + z (0x6400 is 1024, mantissa step 1) and −(64 + z) (0x5400 is 64, step 1/16).
template <int Z> struct WfMagic {
    static constexpr u32 SUB_LO = (0x6400u + Z) | ((0x6400u + Z) << 16);
    static constexpr u32 NEG_HI = (0xD400u + (Z << 4)) | ((0xD400u + (Z << 4)) << 16);
};

// The 16 half2 of a chunk, natural order: a[q] = (c − z) of inputs 2q, 2q+1 (low half first).
//
// 4–6 bits: word i of the chunk unpacks like ptx/int4_unpack.cuh. OR-ing a nibble into bits
// 0–3 of the half 0x6400 gives 1024 + v; into bits 4–7, 1024 + 16v. The high bits h of the
// same inputs sit at the nibble's bit positions in Hi = qhigh >> (HB·i) (the file's layout,
// above), so Hi << 4 puts them at bits 4 (inputs 0,1: +16h) and 8 (inputs 2,3: +16·16h) of
// each half and Hi >> 4 does the same for inputs 4–7: every value 1024 + v + 16h, or
// 1024 + 16(v + 16h) < 2048, is an exact FP16 integer, and one sub or fma removes the magic
// and z. Cost per 8 inputs: 4 lop3 (nibbles) + 2 shifts and 4 lop3 (high bits) + 4 f16x2.
// 8 bits: prmt puts byte b under 0x64 (the half 1024 + b), then one sub.
template <int F>
__device__ __forceinline__ void wf_pairs(const WfRaw& r, u32 (&a)[16]) {
    constexpr int Z = Wf<F>::ZERO, HB = Wf<F>::HB;
    if constexpr (Wf<F>::BITS == 16) {  // already FP16 pairs, in input order
        const uint4 q[4] = {r.q0, r.q1, r.q2, r.q3};
#pragma unroll
        for (int j = 0; j < 16; ++j) a[j] = wf_word(q[j / 4], j % 4);
    } else if constexpr (Wf<F>::BITS == 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 w = wf_word(j < 4 ? r.q0 : r.q1, j % 4);
            const u32 lo = __byte_perm(w, 0x64u, 0x4140), hi = __byte_perm(w, 0x64u, 0x4342);
            asm("sub.f16x2 %0, %1, %2;" : "=r"(a[2 * j]) : "r"(lo), "r"(WfMagic<Z>::SUB_LO));
            asm("sub.f16x2 %0, %1, %2;" : "=r"(a[2 * j + 1]) : "r"(hi), "r"(WfMagic<Z>::SUB_LO));
        }
    } else {
        constexpr u32 HMASK_LO = HB == 2 ? 0x00300030u : 0x00100010u;  // h at bits 4(–5) of each half
        constexpr u32 HMASK_HI = HMASK_LO << 4;                       // h at bits 8(–9)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 w = wf_word(r.q0, i), w8 = w >> 8;
            u32 m_lo0 = FP16X2_1024, m_hi0 = FP16X2_1024, m_lo1 = FP16X2_1024, m_hi1 = FP16X2_1024;
            if constexpr (HB > 0) {
                const u32 h = HB == 1 ? r.h0 >> i : (i < 2 ? r.h0 : r.h1) >> (2 * (i % 2));
                const u32 hs = h << 4, hr = h >> 4;
                m_lo0 = lop3_and_or(hs, HMASK_LO, FP16X2_1024);
                m_hi0 = lop3_and_or(hs, HMASK_HI, FP16X2_1024);
                m_lo1 = lop3_and_or(hr, HMASK_LO, FP16X2_1024);
                m_hi1 = lop3_and_or(hr, HMASK_HI, FP16X2_1024);
            }
            const u32 lo0 = lop3_and_or(w, INT4_MASK_LO, m_lo0), hi0 = lop3_and_or(w, INT4_MASK_HI, m_hi0);
            const u32 lo1 = lop3_and_or(w8, INT4_MASK_LO, m_lo1), hi1 = lop3_and_or(w8, INT4_MASK_HI, m_hi1);
            asm("sub.f16x2 %0, %1, %2;" : "=r"(a[4 * i + 0]) : "r"(lo0), "r"(WfMagic<Z>::SUB_LO));
            asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a[4 * i + 1]) : "r"(hi0), "r"(FP16X2_1_16), "r"(WfMagic<Z>::NEG_HI));
            asm("sub.f16x2 %0, %1, %2;" : "=r"(a[4 * i + 2]) : "r"(lo1), "r"(WfMagic<Z>::SUB_LO));
            asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a[4 * i + 3]) : "r"(hi1), "r"(FP16X2_1_16), "r"(WfMagic<Z>::NEG_HI));
        }
    }
}

// The formats whose decode GEMVs take their codes as FP16 subnormals (wf_pairs_tiny): one scale
// group a chunk, codes of 4, 5 or 8 bits. Not Q6_K (two scale groups a chunk: the z correction
// below would need Σx of every 16 inputs) nor dense FP16 (no codes).
template <int F> struct WfTiny {
    static constexpr bool ON = Wf<F>::SUBS == 1 && (Wf<F>::BITS == 4 || Wf<F>::BITS == 5 || Wf<F>::BITS == 8);
};

// The chunk's codes c as FP16 subnormals, in wf_pairs' order of pairs (a[q]: inputs 2q, 2q+1).
// An FP16 with exponent field 0 is m·2⁻²⁴ for its 10 mantissa bits m, exactly; the tensor cores
// multiply such inputs exactly (products of FP16 inputs are exact, and subnormal inputs are
// not flushed), so the unpack is only the masks of wf_pairs without the magic number 0x6400, and
// its f16x2 fixups (one sub or fma a pair: a third of wf_pairs' instructions at 4 bits) go:
//   a[4i], a[4i+2]    = (v + 16h)·2⁻²⁴       inputs 8i+0, 1 and 8i+4, 5   (v: the nibble, h: high bits)
//   a[4i+1], a[4i+3]  = 16·(v + 16h)·2⁻²⁴    inputs 8i+2, 3 and 8i+6, 7   (the nibble at bits 4–7)
//   8 bits: a[q] = b·2⁻²⁴ (the byte under a zero byte: one prmt a pair)
// all below 1024·2⁻²⁴ (exponent field 0). What the caller owes: the factor 16 of the second kind
// (gemv_fmt.cu gives them MMAs of their own and adds that sum / 16), the 2²⁴ (in the scale) and
// z (−z·s·Σx of the chunk): c is not c − z here.
template <int F>
__device__ __forceinline__ void wf_pairs_tiny(const WfRaw& r, u32 (&a)[16]) {
    static_assert(WfTiny<F>::ON, "wf_pairs_tiny: 4-, 5- or 8-bit codes with one scale group a chunk");
    if constexpr (Wf<F>::BITS == 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 w = wf_word(j < 4 ? r.q0 : r.q1, j % 4);
            a[2 * j] = __byte_perm(w, 0u, 0x4140);
            a[2 * j + 1] = __byte_perm(w, 0u, 0x4342);
        }
    } else {
        constexpr int HB = Wf<F>::HB;
        constexpr u32 HMASK_LO = 0x00100010u, HMASK_HI = HMASK_LO << 4;  // h at bit 4 / bit 8 of each half
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 w = wf_word(r.q0, i), w8 = w >> 8;
            u32 m_lo0 = 0u, m_hi0 = 0u, m_lo1 = 0u, m_hi1 = 0u;
            if constexpr (HB > 0) {
                const u32 h = r.h0 >> i, hs = h << 4, hr = h >> 4;
                m_lo0 = hs & HMASK_LO;
                m_hi0 = hs & HMASK_HI;
                m_lo1 = hr & HMASK_LO;
                m_hi1 = hr & HMASK_HI;
            }
            a[4 * i + 0] = lop3_and_or(w, INT4_MASK_LO, m_lo0);
            a[4 * i + 1] = lop3_and_or(w, INT4_MASK_HI, m_hi0);
            a[4 * i + 2] = lop3_and_or(w8, INT4_MASK_LO, m_lo1);
            a[4 * i + 3] = lop3_and_or(w8, INT4_MASK_HI, m_hi1);
        }
    }
}

// Scale s[j] (and offset o[j]) of scale group j of the chunk (j < Wf<F>::SUBS). Each is one
// FP32 value, computed as the reference computes it (format/weight_formats.py): the K-quants'
// d·sc and dmin·m are single FP32 products (exact); o = −dmin·m, so c·s + o is the reference's
// c·s − dmin·m bit for bit.
// QUAD: `r` from wf_load_at<F, true> completed by wf_quad_gather (q4_k/q5_k: r.s0 the chunk's
// lane word, r.d (d, dmin)); else from wf_load (the super-block's 4 lane words).
template <int F, bool QUAD = false>
__device__ __forceinline__ void wf_scales(const WfRaw& r, int chunk, float (&s)[Wf<F>::SUBS], float (&o)[Wf<F>::SUBS]) {
    if constexpr (F == WF_Q4_K || F == WF_Q5_K) {
        // Sub-block j = chunk % 8 = 4h + t: its (sc, m) are bits 12h … 12h + 11 of lane word t
        // (the lane words, above).
        u32 word = r.s0, dd = r.d;
        if constexpr (!QUAD) {
            const u32 t = chunk & 3;
            word = t == 0 ? r.s0 : t == 1 ? r.s1 : t == 2 ? r.s2 : r.d;
            dd = wf_kq_dd(r.s0, r.s1, r.s2, r.d);
        }
        const u32 v = word >> ((chunk & 4) ? 12 : 0);
        const u32 sc = v & 0x3Fu, m = (v >> 6) & 0x3Fu;
        s[0] = __fmul_rn(wf_half_lo(dd), float(sc));
        o[0] = -__fmul_rn(wf_half_hi(dd), float(m));
    } else if constexpr (F == WF_Q6_K) {
        const float d = wf_half_lo(r.d);
        s[0] = __fmul_rn(d, float((signed char)(r.s0 & 0xFFu)));
        s[1] = __fmul_rn(d, float((signed char)((r.s0 >> 8) & 0xFFu)));
        o[0] = o[1] = 0.f;
    } else if constexpr (F == WF_DENSE) {
        s[0] = 1.f;
        o[0] = 0.f;
    } else {
        s[0] = wf_half_lo(r.s0);
        o[0] = Wf<F>::OFFSET ? wf_half_lo(r.s1) : 0.f;
    }
}

// Weight e (0–31) of the chunk, FP32, in the reference's order: (c − z)·s, or c·s + o (two
// roundings, no FMA contraction: __fmul_rn/__fadd_rn); dense: the value itself.
template <int F>
__device__ __forceinline__ float wf_dequant(const WfRaw& r, int chunk, int e) {
    if constexpr (Wf<F>::BITS == 16) {
        const uint4 q = e < 8 ? r.q0 : e < 16 ? r.q1 : e < 24 ? r.q2 : r.q3;
        const u32 word = wf_word(q, (e % 8) / 2);
        return (e & 1) ? wf_half_hi(word) : wf_half_lo(word);
    }
    u32 code;
    if constexpr (Wf<F>::BITS == 8) {
        code = (wf_word(e < 16 ? r.q0 : r.q1, (e % 16) / 4) >> (8 * (e % 4))) & 0xFFu;
    } else {
        // Input 8i + ORDER[p] sits in nibble p of word i: p = (e % 8) / 2 + 4 (e % 2).
        const int i = e / 8, p = (e % 8) / 2 + 4 * (e % 2);
        code = (wf_word(r.q0, i) >> (4 * p)) & 0xFu;
        if constexpr (Wf<F>::HB == 1) code |= ((r.h0 >> (4 * p + i)) & 1u) << 4;
        if constexpr (Wf<F>::HB == 2) code |= (((i < 2 ? r.h0 : r.h1) >> (4 * p + 2 * (i % 2))) & 3u) << 4;
    }
    float s[Wf<F>::SUBS], o[Wf<F>::SUBS];
    wf_scales<F>(r, chunk, s, o);
    const int j = Wf<F>::SUBS == 2 ? e / 16 : 0;
    if constexpr (Wf<F>::OFFSET) return __fadd_rn(__fmul_rn(float(code), s[j]), o[j]);
    else return __fmul_rn(float(int(code) - Wf<F>::ZERO), s[j]);
}

// The chunk's 32 weights as 16 half2 in natural order (w[q] = weights 2q, 2q+1, low half
// first), each the reference's FP32 value (wf_dequant, bit for bit) rounded once to FP16: the
// exact codes of wf_pairs, then (c − z)·s or c·s + o in FP32 with the chunk's scales computed
// once (wf_scales), where wf_dequant recomputes them per weight — or, for a plain FP16 scale and
// no offset (int4_g128, q4_g32, q5_g32, q8_g32), one FP16 multiply per pair that gives the same
// bits (below). For the prefill GEMMs' shared-memory tiles (gemm_fmt.cu, gemm_fmt_wgmma.cu).
template <int F>
__device__ __forceinline__ void wf_dequant_pairs(const WfRaw& r, int chunk, u32 (&w)[16]) {
    u32 a[16];
    wf_pairs<F>(r, a);
    if constexpr (Wf<F>::BITS == 16) {  // dense: the values themselves
#pragma unroll
        for (int q = 0; q < 16; ++q) w[q] = a[q];
        return;
    }
    if constexpr (!Wf<F>::OFFSET && !Wf<F>::KQUANT) {
        // (c − z)·s with s an FP16 scale: c − z is an integer of at most 8 bits and s has 11
        // significant bits, so the FP32 product is exact and its one rounding to FP16 is the
        // correctly rounded product — what mul.rn.f16x2 computes from the same two values
        // (subnormal results included: FP16 arithmetic keeps subnormals). One instruction per
        // pair instead of two conversions, two FP32 multiplies and a pack; the same bits.
        const u32 s2 = (r.s0 & 0xFFFFu) * 0x10001u;  // (s, s)
#pragma unroll
        for (int q = 0; q < 16; ++q) asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(w[q]) : "r"(a[q]), "r"(s2));
        return;
    }
    float s[Wf<F>::SUBS], o[Wf<F>::SUBS];
    wf_scales<F>(r, chunk, s, o);
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const int j = Wf<F>::SUBS == 2 ? q / 8 : 0;  // q6_k: inputs 0–15 and 16–31 have a scale each
        const float2 c = __half22float2(*reinterpret_cast<const __half2*>(&a[q]));  // exact integers
        float lo = __fmul_rn(c.x, s[j]), hi = __fmul_rn(c.y, s[j]);
        if constexpr (Wf<F>::OFFSET) {
            lo = __fadd_rn(lo, o[j]);
            hi = __fadd_rn(hi, o[j]);
        }
        const __half2 h = __floats2half2_rn(lo, hi);
        w[q] = *reinterpret_cast<const u32*>(&h);
    }
}

// Whether this file reads format id `fmt` and was compiled for it (WF_FORMATS); the launchers
// refuse the others before a launch.
__device__ __forceinline__ bool wf_known(int fmt) {
    return (fmt == WF_INT4_G128 || fmt == WF_Q4_G32 || fmt == WF_Q4_G32_MIN || fmt == WF_Q5_G32 ||
            fmt == WF_Q5_G32_MIN || fmt == WF_Q8_G32 || fmt == WF_Q4_K || fmt == WF_Q5_K || fmt == WF_Q6_K ||
            fmt == WF_DENSE) && WF_COMPILED(fmt);
}

// Runs the statements `...` with F a compile-time constant equal to the runtime id `fmt`
// (block-uniform in every caller): one instance of them per format compiled in (WF_FORMATS),
// chosen once; any other id runs nothing.
#define WF_CASE(ID, F, ...) case ID: if constexpr (WF_COMPILED(ID)) { constexpr int F = ID; __VA_ARGS__; } break;
#define WF_DISPATCH(fmt, F, ...)                              \
    switch (fmt) {                                            \
        WF_CASE(WF_INT4_G128, F, __VA_ARGS__)                 \
        WF_CASE(WF_Q4_G32, F, __VA_ARGS__)                    \
        WF_CASE(WF_Q4_G32_MIN, F, __VA_ARGS__)                \
        WF_CASE(WF_Q5_G32, F, __VA_ARGS__)                    \
        WF_CASE(WF_Q5_G32_MIN, F, __VA_ARGS__)                \
        WF_CASE(WF_Q8_G32, F, __VA_ARGS__)                    \
        WF_CASE(WF_Q4_K, F, __VA_ARGS__)                      \
        WF_CASE(WF_Q5_K, F, __VA_ARGS__)                      \
        WF_CASE(WF_Q6_K, F, __VA_ARGS__)                      \
        WF_CASE(WF_DENSE, F, __VA_ARGS__)                       \
        default: break;                                       \
    }
