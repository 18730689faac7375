// kernels/stream_read.cu — how fast k blocks (k SMs) can stream bytes from HBM: the floor under
// every schedule of the decode step, measured rather than assumed.
//
//   stream_read_ld     each thread 16-byte loads, SR_UNROLL in flight (the decode GEMVs' way)
//   stream_read_bulk   one thread's 1-D bulk copies (TMA) into a ring of SR_STAGES chunks of
//                      SR_CHUNK bytes in shared memory, the block reading each chunk from there
//
// Why: the decode step reads each weight byte once, so its floor is HBM bandwidth — but only if
// enough SMs keep enough bytes in flight. A persistent kernel, or a layer run by one thread
// block cluster of 16 SMs, is only as fast as what its SMs can stream: at 132 SMs each needs
// ~4.3 TB/s ÷ 132 ≈ 33 GB/s; on 16 SMs each would need ~270 GB/s. tools/bench_sm_stream.py
// times both kernels over grids of 1 … 264 blocks (one per SM up to 132) and reports GB/s in
// all and per block.
//
// Work split: grid = k blocks, block b streams bytes [b · B, (b + 1) · B) of `src` (B =
// bytes_per_block), and every thread adds the 32-bit words it read (modulo 2^32) into one word
// of `out` [k · threads] u32 — a checksum the test compares per thread (thread t reads the
// 16-byte vectors ≡ t modulo the block's threads, in both kernels), and what keeps the compiler
// from dropping the loads. Bytes per launch: k · B read, k · threads · 4 written.
// The limit is what it measures: HBM bandwidth, or the latency × bytes-in-flight of k SMs.
//
// stream_read_ld: thread t of block b reads uint4 i = t, t + T, … (T threads) of the block's
// slice with ld_stream_v4 (L1 no-allocate, L2 evict-first, no prefetch size: ptx/ldst.cuh) in
// batches of SR_UNROLL, the next batch issued before the current one is summed: up to 2 · T ·
// SR_UNROLL · 16 B in flight a block (64 KiB at 256 threads and 8).
// stream_read_bulk: thread 0 keeps SR_STAGES chunks in flight (96 KiB while one of 4 × 32 KiB is
// being read), each one cp.async.bulk completing on its slot's mbarrier; the block's threads
// wait for a slot's phase, sum its words, meet at a __syncthreads, and thread 0 refills the slot
// with the chunk SR_STAGES ahead. Caveat: every byte is also read back from shared memory by the
// block's 128 threads, which may cap a single SM's figure before HBM does. Why this cannot race:
//   - A slot is refilled only after the __syncthreads that follows every thread's last read of
//     it; thread 0 then issues fence.proxy.async (the async proxy's write after the generic
//     proxy's reads) before the copy.
//   - full[s] completes phase r when chunk r · STAGES + s has landed (its one arrival, thread 0's
//     arrive.expect_tx, and the chunk's bytes). Phase r + 1 is armed only after every thread
//     passed its wait on phase r (they all passed the __syncthreads after it), so a 1-bit
//     parity, (c / STAGES) & 1, names the phase each wait means.
//   - The barriers are initialised by thread 0, fenced (fence_mbarrier_init), then one
//     __syncthreads before any use.
//
// Requirements (asserted by the launcher): src 16-byte aligned, B a multiple of 16 (bulk: of
// SR_CHUNK), k · B bytes of src.
#include <cuda_fp16.h>

#include "types.cuh"     // u32, u64
#include "ldst.cuh"      // ld_stream_v4, l2_evict_first_policy
#include "mbarrier.cuh"  // mbarrier_init, fence_mbarrier_init, mbarrier_arrive_expect_tx, mbarrier_wait_parity
#include "tma.cuh"       // bulk_copy_g2s
#include "wgmma.cuh"     // fence_proxy_async_shared

#ifndef SR_UNROLL
#define SR_UNROLL 8            // stream_read_ld: 16-byte loads in flight a thread
#endif
#ifndef SR_STAGES
#define SR_STAGES 4            // stream_read_bulk: chunks in flight a block
#endif
#ifndef SR_CHUNK
#define SR_CHUNK (32 * 1024)   // stream_read_bulk: bytes a bulk copy
#endif
#define SR_LD_THREADS   256
#define SR_BULK_THREADS 128
static_assert(SR_CHUNK % (16 * SR_BULK_THREADS) == 0 && SR_STAGES >= 1,
              "a chunk is whole rounds of the block's 16-byte reads: thread t keeps the vectors ≡ t");
static_assert(SR_STAGES * SR_CHUNK + SR_STAGES * 8 <= 227 * 1024, "the ring fits a block's shared memory");

// The checksum: a sum modulo 2^32, so a word read twice shows (an XOR would cancel it).
__device__ __forceinline__ u32 sr_sum(uint4 v) { return v.x + v.y + v.z + v.w; }

// grid (k), block (SR_LD_THREADS): out u32 [k · SR_LD_THREADS]; src uint4 [k · vecs_per_block].
extern "C" __global__ void __launch_bounds__(SR_LD_THREADS)
stream_read_ld(u32* __restrict__ out, const uint4* __restrict__ src, unsigned long long vecs_per_block) {
    const uint4* p = src + (u64)blockIdx.x * vecs_per_block;
    const u64 policy = l2_evict_first_policy();
    const u64 step = (u64)SR_LD_THREADS * SR_UNROLL;
    const u64 whole = vecs_per_block / step * step;  // the vectors of whole batches; the tail after
    // Whole batches of SR_UNROLL loads with no bounds check, the next batch issued before the
    // current one is summed (as the GEMVs keep theirs: two batches of registers, one always in
    // flight). A bounds check per load lets ptxas sink the next batch's loads below the current
    // batch's sums (predicated, zero-filled loads): one batch in flight instead of two.
    auto load = [&](uint4 (&v)[SR_UNROLL], u64 i) {
#pragma unroll
        for (int u = 0; u < SR_UNROLL; ++u) v[u] = ld_stream_v4(p + i + (u64)u * SR_LD_THREADS, policy);
    };
    u32 acc = 0;
    if (whole > 0) {
        uint4 cur[SR_UNROLL];
        load(cur, threadIdx.x);
#pragma unroll 1
        for (u64 i = threadIdx.x; i < whole; i += step) {
            uint4 next[SR_UNROLL];
            if (i + step < whole) load(next, i + step);  // block-uniform
#pragma unroll
            for (int u = 0; u < SR_UNROLL; ++u) acc += sr_sum(cur[u]);
#pragma unroll
            for (int u = 0; u < SR_UNROLL; ++u) cur[u] = next[u];
        }
    }
    for (u64 i = whole + threadIdx.x; i < vecs_per_block; i += SR_LD_THREADS) acc += sr_sum(ld_stream_v4(p + i, policy));
    out[(u64)blockIdx.x * SR_LD_THREADS + threadIdx.x] = acc;
}

// grid (k), block (SR_BULK_THREADS), dynamic shared memory SR_STAGES · SR_CHUNK + SR_STAGES · 8:
// the ring, then one mbarrier a slot. out u32 [k · SR_BULK_THREADS]; src [k · bytes_per_block].
extern "C" __global__ void __launch_bounds__(SR_BULK_THREADS)
stream_read_bulk(u32* __restrict__ out, const unsigned char* __restrict__ src, unsigned long long bytes_per_block) {
    extern __shared__ __align__(128) unsigned char sr_ring[];  // [SR_STAGES][SR_CHUNK] bytes, then full[]
    u64* full = reinterpret_cast<u64*>(sr_ring + SR_STAGES * SR_CHUNK);
    const unsigned char* p = src + (u64)blockIdx.x * bytes_per_block;
    const u64 n_chunks = bytes_per_block / SR_CHUNK;
    const u64 policy = l2_evict_first_policy();
    if (threadIdx.x == 0) {
        for (int s = 0; s < SR_STAGES; ++s) mbarrier_init(&full[s], 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u64 c = 0; c < SR_STAGES && c < n_chunks; ++c) {
            mbarrier_arrive_expect_tx(&full[c], SR_CHUNK);
            bulk_copy_g2s(sr_ring + c * SR_CHUNK, p + c * SR_CHUNK, SR_CHUNK, &full[c], policy);
        }
    }
    u32 acc = 0;
    for (u64 c = 0; c < n_chunks; ++c) {
        const int s = (int)(c % SR_STAGES);
        mbarrier_wait_parity(&full[s], (u32)((c / SR_STAGES) & 1));
        const uint4* slot = reinterpret_cast<const uint4*>(sr_ring + s * SR_CHUNK);
        for (int i = threadIdx.x; i < SR_CHUNK / 16; i += SR_BULK_THREADS) acc += sr_sum(slot[i]);
        __syncthreads();  // every thread is done with slot s (and past its wait on this phase)
        if (threadIdx.x == 0 && c + SR_STAGES < n_chunks) {
            fence_proxy_async_shared();  // the generic reads above before the async proxy's write
            mbarrier_arrive_expect_tx(&full[s], SR_CHUNK);
            bulk_copy_g2s(sr_ring + s * SR_CHUNK, p + (c + SR_STAGES) * SR_CHUNK, SR_CHUNK, &full[s], policy);
        }
    }
    out[(u64)blockIdx.x * SR_BULK_THREADS + threadIdx.x] = acc;
}
