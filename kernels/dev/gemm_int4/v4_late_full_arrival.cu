// kernels/dev/gemm_int4/v4_late_full_arrival.cu — the prefill GEMM, version 4: v3 with the
// producer lanes' arrivals on the full barrier made one group late. Not a production kernel:
// tools/dev_kernels.py checks it against the float64 reference and times it beside
// kernels/gemm_int4.cu.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu: as in v3.
//
// Source: variant "A" of docs/bench/2026-12-01_h200_gemm_int4_barrier_protocols.json ("as D, but
// each producer lane arrives on full (plain arrive) once cp.async.wait_group 1 says its previous
// group's copies landed"), written as v3's protocol hook; that variant's own source was not
// committed.
//
// What changes from v3: after issuing group it's weight copies, a producer lane closes them into
// one cp.async group, waits (cp.async.wait_group 1) until its copies of group it − 1 have landed,
// and only then arrives on group it − 1's full barrier, with an ordinary mbarrier.arrive (release:
// the copies are complete for the lane at the wait, so they are visible to a consumer whose wait
// acquires the phase). After its last group it waits for all its copies and arrives for that
// group. The counts stay 33 (lane 0's arrive.expect_tx for X is not delayed), and the stage is
// released as in v3: lane 0 of each consumer warp after a __syncwarp.
// What it tries: the arrival becomes an instruction in the lane's own program order, ordered by
// the memory model, instead of cp.async.mbarrier.arrive, which the copy hardware performs once it
// has the copies in place. The price: a consumer sees group it only once the producer has issued
// group it + 1 (one stage of the ring's four).
// What it showed: the fastest protocol measured, and still not the one drvqwen runs: its stage
// release is v3's, which racecheck reports (24 hazards), and a protocol the sanitizers cannot
// check is one no later change can be checked against.
//
// Measured (the JSON above, variant "A": tools/bench_gemm.py --reps 20, M = 512, H200, medians
// of 3, two runs, µs):
//   | qkv_proj    | o_proj | gate_up_swiglu | down_proj     | 28 layers     |
//   | 57.5  57.6  | 30.6   | 276.2  277.0   | 157.1  151.6  | 14.6  14.5 ms |
// In the same run: v5 ("C") 15.4 and 15.4 ms, this version with v5's release ("B") 15.3
// and 15.4 ms. v3 ("D") ran in another call: 15.1 and 15.2 ms.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v3 v4
#include "types.cuh"        // u64, WARP_SIZE
#include "mbarrier.cuh"     // mbarrier_arrive
#include "cp_async.cuh"     // cp_async_commit, cp_async_wait

// The hook of v3 (GemmSyncwarpRelease there says what each member is for).
struct GemmLateFullArrival {
    static constexpr int FULL_ARRIVALS = 1 + WARP_SIZE;  // lane 0's arrive.expect_tx + one per lane
    static constexpr int RELEASES_PER_WARP = 1;          // lane 0 of each consumer warp
    __device__ static __forceinline__ void weights_issued(u64* /*full_now*/, u64* full_before, int it) {
        cp_async_commit();                        // group it's copies: one cp.async group
        cp_async_wait<1>();                       // group it − 1's copies (this lane's) landed
        if (it > 0) mbarrier_arrive(full_before);
    }
    __device__ static __forceinline__ void producer_exit(u64* full_last, int issued) {
        cp_async_wait<0>();                       // the last group's copies landed
        if (issued > 0) mbarrier_arrive(full_last);
    }
    __device__ static __forceinline__ void stage_read(u64* empty_s, int lane) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty_s);
    }
};
#define GEMM_PROTOCOL GemmLateFullArrival
#include "v3_syncwarp_release.cu"
