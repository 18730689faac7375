// kernels/dev/gemm_int4/v5_every_lane_release.cu — the prefill GEMM, version 5: v3 with a stage
// released by every consumer lane. Not a production kernel: tools/dev_kernels.py checks it
// against the float64 reference and times it beside kernels/gemm_int4.cu.
//
//   gemm_int4_f32, gemm_int4_qkv, gemm_int4_residual, gemm_int4_gate_up_swiglu: as in v3.
//
// Source: variant "C" of docs/bench/2026-12-01_h200_gemm_int4_barrier_protocols.json ("as D, but
// every consumer lane arrives on the one empty barrier (count 256) after wgmma.wait_group 0"),
// written as v3's protocol hook; that variant's own source was not committed.
//
// What changes from v3: empty[s] counts 256 arrivals, one per consumer lane after its warp's
// wgmma.wait_group 0, and there is no __syncwarp: each lane's arrival releases that lane's own
// loads of the weight words (and, after the wait, its warp's MMAs are done reading X).
// Why: every read of the stage is then ordered before the producer's next write by an arrival
// of the reading thread itself — an order compute-sanitizer follows: racecheck, synccheck and
// memcheck are clean, where v3 and v4 have 24 racecheck hazards.
// What kernels/gemm_int4.cu then changed (commit ca115c6): two empty barriers per stage —
// w_empty, released by every lane right after its MMAs are committed (its weight words went into
// the A fragments before the MMAs were issued), and x_empty, released by lane 0 after the wait
// (X is read by the MMAs) — so that the 32 arrivals per warp overlap the MMAs instead of
// following them: 15.0 and 14.8 ms ("H"). Arriving on w_empty before the MMAs instead cost
// 16.5 / 16.5 ms with v4's full arrival ("E") and 15.4 / 15.7 ms with v3's ("F").
//
// Measured (the JSON above, variant "C": tools/bench_gemm.py --reps 20, M = 512, H200, medians
// of 3, two runs, µs):
//   | qkv_proj    | o_proj      | gate_up_swiglu | down_proj     | 28 layers     |
//   | 59.9  60.4  | 35.0  35.1  | 287.1  285.8   | 167.2  169.0  | 15.4  15.4 ms |
// In the same run: v4 ("A") 14.6 and 14.5 ms. "H" ran in another run.
// Re-run: PYTHONPATH=src python3 tools/dev_kernels.py gemm_int4 --versions v3 v5
#include "types.cuh"        // u64, WARP_SIZE
#include "mbarrier.cuh"     // mbarrier_arrive
#include "cp_async.cuh"     // cp_async_mbarrier_arrive_noinc, cp_async_wait

// The hook of v3 (GemmSyncwarpRelease there says what each member is for).
struct GemmEveryLaneRelease {
    static constexpr int FULL_ARRIVALS = 1 + WARP_SIZE;  // lane 0's arrive.expect_tx + one per lane
    static constexpr int RELEASES_PER_WARP = WARP_SIZE;  // every consumer lane
    __device__ static __forceinline__ void weights_issued(u64* full_now, u64* /*full_before*/, int /*it*/) {
        cp_async_mbarrier_arrive_noinc(full_now);
    }
    __device__ static __forceinline__ void producer_exit(u64* /*full_last*/, int /*issued*/) {
        cp_async_wait<0>();
    }
    __device__ static __forceinline__ void stage_read(u64* empty_s, int /*lane*/) {
        mbarrier_arrive(empty_s);
    }
};
#define GEMM_PROTOCOL GemmEveryLaneRelease
#include "v3_syncwarp_release.cu"
