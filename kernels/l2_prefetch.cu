// kernels/l2_prefetch.cu — the weights of the decode step's next launches asked into L2 while the
// launches before them wait on latency, not on HBM.
//
//   l2_prefetch   L2 ← up to L2P_SPANS spans of weights (cp.async.bulk.prefetch.L2); writes nothing
//
// Why: HBM idles through part of every decode layer. qkv_rope is a latency chain (the RMSNorm,
// a few tiles a block, bias, RoPE, the K/V write: gemv_int4.cu's tables, 8.5 µs for 1.9 µs of
// 7B bytes at copy bandwidth); the split-KV attention at a short context reads ~1 MB of K/V per
// 7B layer, and its two launches cost 8.7 µs a layer in the captured step (leaving them out of
// the 7B step at 512 tokens: 2.175 → 1.931 ms, docs/bench/2026-12-04_d4def84_h200_syn7b_decode_ablation.json).
// The launches after them — o_proj, gate_up_swiglu, down_proj — are streams of weights, each
// paying its first bytes' HBM latency and then the bandwidth. Launched right after qkv_rope,
// this kernel has the SMs' TMA units ask for the weights those GEMVs will read first, so that part of
// their bytes comes from L2 (lower latency, and no HBM time left in their critical path).
// Weights are never written by any kernel, so asking for them early is always safe.
//
// What to ask for (the launcher, launchers/l2_prefetch.py, plans it from the GEMVs' own launch
// shapes): a GEMV block owns a contiguous range of 16-row tiles [b·T/G, (b+1)·T/G) and streams
// it front to back (gemv_int4.cu; gemv_fmt.cu splits alike, each stored part of a format row by
// row), so a GEMV ends when its slowest block does. Prefetching a prefix of a matrix would speed
// up the blocks that own the prefix and leave the others as slow; prefetching the first tiles
// of *every* block's range shortens every block's stream by the same bytes. A span is therefore
// "the first head_bytes of each of `parts` balanced parts":
//
//     part p of a span starts at  base + floor(p · units / parts) · unit_bytes
//     and covers                  min(head_bytes, bytes − that offset) bytes
//
// with units = the GEMV's tiles T, parts = its grid G, unit_bytes = one tile's bytes in that
// buffer; a whole buffer is parts = 1, head_bytes = bytes.
//
// Bytes and the limit: it reads nothing into the SM and writes nothing; what it moves is the
// spans' bytes from HBM into L2 (what the launcher plans within its byte budget: the 0.5B's
// o_proj, gate_up and down of a layer whole are 7.2 MB; at 7B, o_proj whole and each gate_up
// block's first tile are 6.6 + 14.0 MB). The
// limits are the HBM time the overlapped launches leave idle (at long contexts attention reads
// its K/V at bandwidth itself, and the prefetch only moves bytes earlier) and the L2 (60 MiB on
// the H200): the spans must still be there when their GEMV reads them, behind gate_up's 70 MB
// stream at 7B — which the GEMVs load with the evict-first policy (ptx/ldst.cuh), so it is their
// own lines that leave first.
//
// Work split: one warp a block, lane 0 issues (bulk_prefetch_l2 takes a uniform address: lanes
// with different ones would be serialised). The spans' parts are cut into chunks of at most
// L2P_CHUNK_BYTES and numbered span by span; block b issues chunks b, b + G, b + 2G, … so the
// TMA units of G SMs share the requests.
//
// Order in the step and why nothing can race: launched as a programmatic dependent of the
// kernel before it (qkv_rope; down_proj for the next layer's q/k/v), it starts once that kernel's
// blocks have all started — they call griddepcontrol.launch_dependents first — so its prefetches
// go out under that kernel's run (qkv_rope's may even overlap the previous down_proj's tail,
// since qkv_rope itself starts early), and only then does it wait (griddepcontrol.wait) for that
// kernel to complete. It never touches a value an earlier kernel wrote, and writes nothing, so
// its early start reads nothing stale. The wait is there for the kernel after it: attention is
// launched without PDL and starts when this grid has completed, and a programmatic dependent
// (qkv_rope) waits for this grid's completion; either way this grid completes only after the
// kernel before it has, so the step's order is the order without it. A prefetch still in flight
// when the grid ends is harmless: it has no destination.
//
// Not to be confused with what lost inside the GEMV (gemv_int4.cu's header: an L2 bulk prefetch
// of the tiles 2 ahead, slower at every 7B GEMV): that asked for bytes the same kernel was about
// to stream at full speed anyway; this asks during launches that leave HBM idle.
//
// Measured (H200, synthetic models, graph ITL at 512 tokens, 64 tokens a row; the step with both
// prefetches, then without the per-layer one, without the q/k/v one, and with both again, in
// turns: tools/bench_decode_ablation.py --l2-prefetch-mb MB --l2-prefetch-qkv --leave-out
// l2_prefetch l2_prefetch_qkv; docs/bench/2026-12-05_e6b8a90_h200_l2_prefetch_ablation_{7b_8mb,
// 7b_24mb,7b_48mb,05b_4mb}.json), ms:
//   | model, budget a layer | both   | without the layer's | without the q/k/v | both again |
//   | 7B, 8 MB              | 2.2207 | 2.1774              | 2.1604            | 2.1799     |
//   | 7B, 24 MB             | 2.1700 | 2.1634              | 2.1169            | 2.1817     |
//   | 7B, 48 MB             | 2.1288 | 2.1532              | 2.1034            | 2.1315     |
//   | 0.5B, 4 MB            | 0.6778 | 0.6568              | 0.6512            | 0.6775     |
// Leaving the q/k/v prefetch out is 1–3 % faster at every budget; leaving the layer's out, faster
// at 8 MB, even at 24, 1 % slower at 48; the 0.5B is 3 % faster without either. What the
// prefetches give does not pay for their launches. The step plans none by
// default (plan_decode's l2_prefetch_bytes = 0); the option stays for measurements, and for the
// persistent step, where an op costs no launch (decode_persistent.cu).
#include "types.cuh"
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents
#include "tma.cuh"      // bulk_prefetch_l2
#include "block_coord.cuh"  // GridDep

#define L2P_SPANS 16                    // spans a launch carries (o_proj, gate, up, down: ≤ 4 buffers each)
#define L2P_CHUNK_BYTES (64 * 1024)     // bytes per prefetch instruction at most
#define L2P_THREADS WARP_SIZE           // one warp a block (lane 0 issues)
// Timing probe (default 0): L2P_PROBE_NO_PREFETCH=1 issues nothing — the launch and its wait
// alone, so that what the launch costs the step can be told from what its prefetches give
// (tools/bench_decode_ablation.py --define l2_prefetch:L2P_PROBE_NO_PREFETCH=1).
#ifndef L2P_PROBE_NO_PREFETCH
#define L2P_PROBE_NO_PREFETCH 0
#endif

// One span of the parameter list (the header's formula). parts = 0: an unused span.
struct L2Span {
    const unsigned char* base;  // 16-byte aligned
    u32 bytes;                  // the buffer's bytes (a multiple of 16): no part reads past them
    u32 units;                  // T, units (tiles) the parts share out
    u32 parts;                  // G, parts (GEMV blocks); units · parts < 2^32
    u32 unit_bytes;             // bytes of one unit (a multiple of 16)
    u32 head_bytes;             // bytes asked for at the start of each part (a multiple of 16)
};
// The launch's parameters as one struct: a span is 32 bytes there (the pointer's alignment pads
// the five words), as here — the persistent decode step reads an op's arguments through it.
static_assert(sizeof(L2Span) == 32, "a span's parameters take 32 bytes of the parameter buffer");
struct L2PrefetchArgs {
    L2Span spans[L2P_SPANS];
};

__device__ __forceinline__ u32 l2p_chunks_per_part(const L2Span& s) {
    return (s.head_bytes + L2P_CHUNK_BYTES - 1) / L2P_CHUNK_BYTES;
}

// Issue the chunks of span `s` that fall to block b of G: chunk numbers first … first + n − 1
// over the whole launch, block b's are ≡ b (mod G).
__device__ __forceinline__ void l2p_issue(const L2Span& s, u32 first, u32 b, u32 G) {
    if (s.parts == 0 || s.head_bytes == 0) return;
    const u32 per_part = l2p_chunks_per_part(s), n = s.parts * per_part;
    // The first j ≥ 0 with first + j ≡ b (mod G).
    for (u32 j = (b + G - first % G) % G; j < n; j += G) {
        const u32 part = j / per_part, chunk = j % per_part;
        const u32 unit = part * s.units / s.parts;  // units · parts < 2^32 (the launcher checks)
        const u64 off = (u64)unit * s.unit_bytes + (u64)chunk * L2P_CHUNK_BYTES;
        if (off >= s.bytes) continue;  // a part past the buffer's end (never planned so; a guard)
        u64 len = min((u64)L2P_CHUNK_BYTES, (u64)s.head_bytes - (u64)chunk * L2P_CHUNK_BYTES);
        len = min(len, (u64)s.bytes - off);
        bulk_prefetch_l2(s.base + off, (u32)len);
    }
}

// Block b of a planned grid of G blocks (a launch of its own, or an item of the persistent decode
// step, block_coord.cuh): its thread 0 issues the block's chunks of every span — weights only,
// before any wait — then every thread waits for the work before (dep.wait(): griddepcontrol.wait,
// or the persistent step's counter), which is what keeps the order transitive (the header).
template <typename Dep>
__device__ __forceinline__ void l2_prefetch_block(const L2PrefetchArgs& a, u32 b, u32 G, Dep dep) {
    dep.launch_dependents();
    if (threadIdx.x == 0 && !L2P_PROBE_NO_PREFETCH) {
        u32 first = 0;  // chunks of the spans before
#pragma unroll
        for (int i = 0; i < L2P_SPANS; ++i) {
            l2p_issue(a.spans[i], first, b, G);
            first += a.spans[i].parts * l2p_chunks_per_part(a.spans[i]);
        }
    }
    dep.wait();
}

#ifndef DEVICE_FUNCTIONS_ONLY  // a file that includes this one for its device functions defines it
// grid (G), block (L2P_THREADS). Parameters: L2P_SPANS spans (L2Span's fields, in order).
extern "C" __global__ void l2_prefetch(const unsigned char* base0, u32 bytes0, u32 units0, u32 parts0, u32 unit_bytes0, u32 head_bytes0,
                                       const unsigned char* base1, u32 bytes1, u32 units1, u32 parts1, u32 unit_bytes1, u32 head_bytes1,
                                       const unsigned char* base2, u32 bytes2, u32 units2, u32 parts2, u32 unit_bytes2, u32 head_bytes2,
                                       const unsigned char* base3, u32 bytes3, u32 units3, u32 parts3, u32 unit_bytes3, u32 head_bytes3,
                                       const unsigned char* base4, u32 bytes4, u32 units4, u32 parts4, u32 unit_bytes4, u32 head_bytes4,
                                       const unsigned char* base5, u32 bytes5, u32 units5, u32 parts5, u32 unit_bytes5, u32 head_bytes5,
                                       const unsigned char* base6, u32 bytes6, u32 units6, u32 parts6, u32 unit_bytes6, u32 head_bytes6,
                                       const unsigned char* base7, u32 bytes7, u32 units7, u32 parts7, u32 unit_bytes7, u32 head_bytes7,
                                       const unsigned char* base8, u32 bytes8, u32 units8, u32 parts8, u32 unit_bytes8, u32 head_bytes8,
                                       const unsigned char* base9, u32 bytes9, u32 units9, u32 parts9, u32 unit_bytes9, u32 head_bytes9,
                                       const unsigned char* base10, u32 bytes10, u32 units10, u32 parts10, u32 unit_bytes10, u32 head_bytes10,
                                       const unsigned char* base11, u32 bytes11, u32 units11, u32 parts11, u32 unit_bytes11, u32 head_bytes11,
                                       const unsigned char* base12, u32 bytes12, u32 units12, u32 parts12, u32 unit_bytes12, u32 head_bytes12,
                                       const unsigned char* base13, u32 bytes13, u32 units13, u32 parts13, u32 unit_bytes13, u32 head_bytes13,
                                       const unsigned char* base14, u32 bytes14, u32 units14, u32 parts14, u32 unit_bytes14, u32 head_bytes14,
                                       const unsigned char* base15, u32 bytes15, u32 units15, u32 parts15, u32 unit_bytes15, u32 head_bytes15) {
    static_assert(L2P_SPANS == 16, "the parameter list spells out L2P_SPANS spans");
    const L2PrefetchArgs a = {{
        {base0, bytes0, units0, parts0, unit_bytes0, head_bytes0}, {base1, bytes1, units1, parts1, unit_bytes1, head_bytes1},
        {base2, bytes2, units2, parts2, unit_bytes2, head_bytes2}, {base3, bytes3, units3, parts3, unit_bytes3, head_bytes3},
        {base4, bytes4, units4, parts4, unit_bytes4, head_bytes4}, {base5, bytes5, units5, parts5, unit_bytes5, head_bytes5},
        {base6, bytes6, units6, parts6, unit_bytes6, head_bytes6}, {base7, bytes7, units7, parts7, unit_bytes7, head_bytes7},
        {base8, bytes8, units8, parts8, unit_bytes8, head_bytes8}, {base9, bytes9, units9, parts9, unit_bytes9, head_bytes9},
        {base10, bytes10, units10, parts10, unit_bytes10, head_bytes10}, {base11, bytes11, units11, parts11, unit_bytes11, head_bytes11},
        {base12, bytes12, units12, parts12, unit_bytes12, head_bytes12}, {base13, bytes13, units13, parts13, unit_bytes13, head_bytes13},
        {base14, bytes14, units14, parts14, unit_bytes14, head_bytes14}, {base15, bytes15, units15, parts15, unit_bytes15, head_bytes15}}};
    l2_prefetch_block(a, blockIdx.x, gridDim.x, GridDep{});
}
#endif  // DEVICE_FUNCTIONS_ONLY
