// kernels/sampling.cu — temperature / top-k / top-p / min-p sampling on the GPU, exactly
// `sampler.sample`, and llama.cpp's repeat penalty over a token history in device memory.
//
//   penalize_logits logits[t] /= p (> 0) or *= p (≤ 0) for each distinct t of the history's
//                   last PENALTY_WINDOW tokens (sampler.penalize; p = params.repeat_penalty)
//   sample_token    next_token[0] = the token sampler.sample picks for these logits and
//                   u = uniform(seed, token_index), all read from device memory
//   record_token    history: next_token[0] appended (the ring the next penalize_logits reads)
//   publish_token   host_ring[token_index % ring] = next_token[0]; token_index += 1
//
// penalize_logits and record_token run only in the penalized sampler step (engine.py): the
// history (int32 [1 + PENALTY_WINDOW]: count, then a ring of the last tokens by count % W) is
// filled by the host at each prefill with the sequence's last W ids and appended here after
// every choice, so a replayed CUDA graph needs nothing from the host.
//
// The definition (src/drvqwen/sampler.py, module doc) is built so that a parallel GPU
// computation can agree with numpy bit for bit:
//   - weights e_i = exp2_det(fl32(fl32(l_i − l_max) · s)), s = float32(log2 e / T), from IEEE
//     basic operations only (__fsub_rn / __fmul_rn / __fadd_rn: never contracted into FMA,
//     whose single rounding numpy cannot reproduce), and W_i = floor(e_i · 2^32) as uint64;
//   - every sum is a uint64 sum of W's: exact, so any reduction order gives the same bits;
//   - order: e descending (float bits as a 30-bit key: e ∈ [0, 2)), ties by lower id;
//   - kept set: the first min(top_k, V) of that order, then the shortest prefix of those whose
//     weight reaches R = ceil(C1 · top_p) (one float64 multiply of exact values);
//   - min_p: the kept set shrinks to the tokens with e ≥ float32(min_p) if that is smaller
//     (key ≥ the bits of min_p: both are non-negative floats, whose bits order like them);
//   - pick: the kept tokens in id order, the first whose cumulative weight exceeds
//     floor(x · C / 2^32), x the 32-bit Philox4x32-10 output for counter (token_index, 0, 0, 0)
//     and key (seed lo, seed hi), C the kept weight.
//
// No sort. The kept set is "key > K, plus the first m tokens (by id) with key == K", and K is
// found by a radix select over the 30-bit keys: three passes of 10-bit digits, each a histogram
// (count for top_k, weight for top_p) of the tokens that match the digits found so far and a
// suffix scan of the 1024 bins that finds the bin where the running total crosses the goal.
// Ties need no special case: tokens with one key have one weight, so the tie count m follows by
// arithmetic. The pick is one pass of per-thread id-contiguous chunks (kept weight per chunk),
// an exclusive scan, and a rescan of the single chunk that holds the target.
//
// Work split: one block of 1024 threads (a thread per histogram bin); per pass, thread i reads
// logits i, i + 1024, … (coalesced). Passes over the V logits (608 KB at V = 152064, L2-resident
// after the lm_head wrote them): argmax 1, top_k select 3 (+1 weight sum if top_p too), top_p
// select 3 (+1 total if no top_k), pick 2 — at most 10 passes, ~40 µs; greedy steps do not run
// this kernel (argmax.cu). The limit: one SM's L2 read rate and shared-memory atomics; a
// multi-block first pass is the obvious next step if sampling speed ever matters.
//
// sample_token reads token_index and never advances it; publish_token, the last per-token
// kernel before advance_state, does — so a replayed CUDA graph draws a new number every step.
#include "types.cuh"  // u32, u64, WARP_SIZE, F32_NEG_INF
#include "warp.cuh"   // argmax_better, FULL_WARP_MASK
#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents

#define SAMPLE_THREADS    1024
#define SAMPLE_BINS       1024                  // 10-bit digits; == SAMPLE_THREADS (a thread per bin)
#define SAMPLE_DIGIT_BITS 10
#define SAMPLE_KEY_BITS   30                    // e < 2.0f, whose bits are 0x40000000
#define SAMPLE_NONE       0x7fffffff            // "no candidate yet" in the argmax
#define PENALTY_WINDOW    64                    // sampler.PENALTY_WINDOW: llama.cpp's penalty_last_n

// exp2_det's polynomial (sampler.EXP2_COEFFS, the same hex floats) and its range.
#define SAMPLE_EXP2_C1  0x1.62e42cp-1f
#define SAMPLE_EXP2_C2  0x1.ebfd5ap-3f
#define SAMPLE_EXP2_C3  0x1.c688f0p-5f
#define SAMPLE_EXP2_C4  0x1.3d0c48p-7f
#define SAMPLE_EXP2_C5  0x1.46d2e8p-10f
#define SAMPLE_EXP2_C6  0x1.c546fap-13f
#define SAMPLE_EXP2_MIN (-64.0f)
#define SAMPLE_TWO_POW_32 4294967296.0f         // weight resolution: W = floor(e · 2^32)

// Philox4x32 round constants (Random123; sampler.py _M0 … _W1).
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// The sampler's device-resident parameters (48 bytes; engine.pack_sampler_params writes them).
struct SamplerParams {
    u64 seed;              // Philox key: low 32 bits = key[0], high = key[1]
    double top_p;          // 1.0 = off
    float scale_log2;      // float32(log2(e) / temperature)
    int top_k;             // 0 = off
    u32 token_index;       // generation step of the token being chosen (the Philox counter)
    int greedy;            // nonzero: argmax, no random number used
    float min_p;           // 0 = off
    float repeat_penalty;  // 1 = off (penalize_logits only)
    int reserved[2];       // 0
};
static_assert(sizeof(SamplerParams) == 48, "engine.py packs 48 bytes");

// Philox4x32-10, first output word, for counter (c0, 0, 0, 0) and key (k0, k1).
__device__ __forceinline__ u32 philox4x32_10_first(u32 c0, u32 k0, u32 k1) {
    u32 c1 = 0, c2 = 0, c3 = 0;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        const u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    return c0;
}

// sampler.exp2_det: 2^y for y ≤ 0, each step one correctly rounded IEEE operation.
__device__ __forceinline__ float sample_exp2(float y) {
    if (!(y >= SAMPLE_EXP2_MIN)) return 0.f;  // also NaN
    const float n = floorf(y);
    const float f = __fsub_rn(y, n);
    float p = SAMPLE_EXP2_C6;
    p = __fadd_rn(__fmul_rn(p, f), SAMPLE_EXP2_C5);
    p = __fadd_rn(__fmul_rn(p, f), SAMPLE_EXP2_C4);
    p = __fadd_rn(__fmul_rn(p, f), SAMPLE_EXP2_C3);
    p = __fadd_rn(__fmul_rn(p, f), SAMPLE_EXP2_C2);
    p = __fadd_rn(__fmul_rn(p, f), SAMPLE_EXP2_C1);
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));  // exact: 2^n is a normal float
}

// The ranking key of a logit: the bits of its weight e (monotone in e for e ≥ 0).
__device__ __forceinline__ u32 sample_key(float logit, float l_max, float scale) {
    return __float_as_uint(sample_exp2(__fmul_rn(__fsub_rn(logit, l_max), scale)));
}

// W = floor(e · 2^32): the product is exact (a power-of-two scaling), rz truncates.
__device__ __forceinline__ u64 sample_weight(u32 key) {
    return __float2ull_rz(__fmul_rn(__uint_as_float(key), SAMPLE_TWO_POW_32));
}

// Exclusive prefix sum of one uint64 per thread over the block (thread order); `total` gets
// the block's sum in every thread. Contains __syncthreads(): call from every thread.
__device__ __forceinline__ u64 block_exclusive_scan_u64(u64 v, u64& total, u64* warp_sums /*[32]*/) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    u64 incl = v;
#pragma unroll
    for (int d = 1; d < WARP_SIZE; d <<= 1) {
        const u64 o = __shfl_up_sync(FULL_WARP_MASK, incl, d);
        if (lane >= d) incl += o;
    }
    if (lane == WARP_SIZE - 1) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < n_warps ? warp_sums[lane] : 0ull;
#pragma unroll
        for (int d = 1; d < WARP_SIZE; d <<= 1) {
            const u64 o = __shfl_up_sync(FULL_WARP_MASK, w, d);
            if (lane >= d) w += o;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const u64 base = warp == 0 ? 0ull : warp_sums[warp - 1];
    total = warp_sums[n_warps - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return base + incl - v;
}

// Shared scratch of the sampler block.
struct SampleSmem {
    u64 hist[SAMPLE_BINS];         // count or weight per digit value
    u64 warp_sums[WARP_SIZE];      // block scans
    float warp_val[WARP_SIZE];     // argmax per warp
    int warp_idx[WARP_SIZE];
    u32 bin;                       // radix select: the digit found at this level
    u64 above;                     //               total of the larger keys
    int token;                     // the pick
};

// Σ W over tokens with key > K (or over all tokens), in every thread.
__device__ __forceinline__ u64 sample_weight_above(const float* __restrict__ logits, int V, float l_max,
                                                   float scale, u32 K, bool all, SampleSmem& sm) {
    u64 sum = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const u32 key = sample_key(logits[i], l_max, scale);
        if (all || key > K) sum += sample_weight(key);
    }
    u64 total;
    block_exclusive_scan_u64(sum, total, sm.warp_sums);
    return total;
}

// Radix select, descending: the key K with above < goal ≤ above + (weight of tokens with key K),
// above = Σ weight over keys > K; weight = 1 (by_mass false) or W. Needs 1 ≤ goal ≤ Σ weight.
// Three passes of SAMPLE_DIGIT_BITS; the pass at `level` sees only tokens whose higher digits
// equal those found so far. Contains __syncthreads(): call from every thread.
__device__ __forceinline__ void sample_select(const float* __restrict__ logits, int V, float l_max,
                                              float scale, bool by_mass, u64 goal, SampleSmem& sm,
                                              u32& key_out, u64& above_out) {
    u32 prefix = 0;
    u64 above = 0;
#pragma unroll 1
    for (int level = 0; level < SAMPLE_KEY_BITS / SAMPLE_DIGIT_BITS; ++level) {
        const int shift = SAMPLE_KEY_BITS - SAMPLE_DIGIT_BITS * (level + 1);  // 20, 10, 0
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) sm.hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const u32 key = sample_key(logits[i], l_max, scale);
            if ((key >> (shift + SAMPLE_DIGIT_BITS)) != prefix) continue;
            const u64 add = by_mass ? sample_weight(key) : 1ull;
            if (add) atomicAdd(&sm.hist[(key >> shift) & (SAMPLE_BINS - 1)], add);  // integer: order-free
        }
        __syncthreads();
        // Thread i holds bin BINS-1-i, so the exclusive scan is the total of the larger bins.
        const u32 bin = SAMPLE_BINS - 1 - threadIdx.x;
        const u64 v = sm.hist[bin];
        u64 total;
        const u64 larger = block_exclusive_scan_u64(v, total, sm.warp_sums);
        if (above + larger < goal && goal <= above + larger + v) {  // exactly one bin
            sm.bin = bin;
            sm.above = above + larger;
        }
        __syncthreads();
        prefix = (prefix << SAMPLE_DIGIT_BITS) | sm.bin;
        above = sm.above;
        __syncthreads();  // sm.bin / sm.above are rewritten at the next level
    }
    key_out = prefix;
    above_out = above;
}

// grid (1), block (SAMPLE_THREADS).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_token(int* __restrict__ next_token,            // [1] int32, out: the chosen token
             int* __restrict__ info,                  // [4] int32, out: token, x (Philox bits), kept count, token_index
             const SamplerParams* __restrict__ params,// [1] SamplerParams (32 B)
             const float* __restrict__ logits,        // [V] fp32
             int V) {
    __shared__ SampleSmem sm;
    grid_launch_dependents();
    grid_dependency_wait();  // logits and params (token_index) come from earlier kernels
    const SamplerParams P = *params;
    const int tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;

    // Pass 1: the argmax (greedy answer, and l_max), larger value first, lower id on ties.
    float best_v = F32_NEG_INF;
    int best_i = SAMPLE_NONE;
    for (int i = tid; i < V; i += blockDim.x) {
        const float v = logits[i];
        if (argmax_better(v, i, best_v, best_i)) { best_v = v; best_i = i; }
    }
    warp_argmax(best_v, best_i);
    if (lane == 0) { sm.warp_val[warp] = best_v; sm.warp_idx[warp] = best_i; }
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x / WARP_SIZE); ++w)  // every thread, same order, same answer
        if (argmax_better(sm.warp_val[w], sm.warp_idx[w], best_v, best_i)) {
            best_v = sm.warp_val[w]; best_i = sm.warp_idx[w];
        }
    const int argmax_token = best_i == SAMPLE_NONE ? 0 : best_i;
    const u32 x = philox4x32_10_first(P.token_index, (u32)P.seed, (u32)(P.seed >> 32));

    if (P.greedy || !isfinite(best_v)) {  // block-uniform
        if (tid == 0) {
            next_token[0] = argmax_token;
            info[0] = argmax_token; info[1] = (int)x; info[2] = 1; info[3] = (int)P.token_index;
        }
        return;
    }
    const float l_max = best_v, scale = P.scale_log2;

    // The kept set: key > K, plus the first m tokens (by id) with key == K. Start: everything.
    u32 K = 0;
    u64 m = (u64)V;
    const int n_k = (P.top_k <= 0 || P.top_k >= V) ? V : P.top_k;
    const bool use_top_p = P.top_p < 1.0;
    u64 c1 = 0;  // weight of the top-k set (top_p's reference mass)
    if (n_k < V) {
        u64 above;
        sample_select(logits, V, l_max, scale, false, (u64)n_k, sm, K, above);
        m = (u64)n_k - above;
        if (use_top_p) c1 = sample_weight_above(logits, V, l_max, scale, K, false, sm) + m * sample_weight(K);
    } else if (use_top_p) {
        c1 = sample_weight_above(logits, V, l_max, scale, 0, true, sm);
    }
    if (use_top_p) {
        const u64 goal = (u64)ceil(__dmul_rn((double)c1, P.top_p));  // ≥ 1: c1 ≥ 2^32, top_p > 0
        u64 above;
        sample_select(logits, V, l_max, scale, true, goal, sm, K, above);
        const u64 wk = sample_weight(K);  // > 0: the crossing bin carries weight
        m = (goal - above + wk - 1) / wk;
    }
    // min_p: "key > K, plus m ties" ∩ "key ≥ K_min". When K < K_min the second set is inside
    // the first, and it is "key > K_min − 1 with no ties"; otherwise the first is inside it.
    // min_p is loaded here, where it is used: taken from P at the top and kept live across the
    // selects, it made NVRTC 13.0's ptxas spill 4 bytes (32 registers, 0 spills this way).
    const float min_p = params->min_p;
    if (min_p > 0.f) {  // block-uniform
        const u32 k_min = __float_as_uint(min_p);  // ≤ 1.0f's bits: the maximum (e = 1) stays
        if (K < k_min) { K = k_min - 1; m = 0; }
    }

    // Pick: thread-contiguous chunks in id order.
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int lo = min(V, tid * chunk), hi = min(V, lo + chunk);
    u64 ties = 0, weight_gt = 0, count_gt = 0;
    for (int i = lo; i < hi; ++i) {
        const u32 key = sample_key(logits[i], l_max, scale);
        if (key > K) { weight_gt += sample_weight(key); ++count_gt; }
        else if (key == K) ++ties;
    }
    u64 n_ties, n_kept, kept_weight;
    const u64 tie_base = block_exclusive_scan_u64(ties, n_ties, sm.warp_sums);
    const u64 kept_ties = tie_base >= m ? 0ull : min(ties, m - tie_base);
    const u64 wk = sample_weight(K);
    const u64 weight_here = weight_gt + kept_ties * wk;
    const u64 weight_base = block_exclusive_scan_u64(weight_here, kept_weight, sm.warp_sums);
    block_exclusive_scan_u64(count_gt + kept_ties, n_kept, sm.warp_sums);
    if (tid == 0) sm.token = -1;
    __syncthreads();
    // target = floor(x · C / 2^32) without a 128-bit product: C = C_hi · 2^32 + C_lo.
    const u64 target = (u64)x * (kept_weight >> 32) + (((u64)x * (kept_weight & 0xffffffffull)) >> 32);
    if (weight_base <= target && target < weight_base + weight_here) {  // exactly one thread
        u64 cum = weight_base, rank = tie_base;
        for (int i = lo; i < hi; ++i) {
            const u32 key = sample_key(logits[i], l_max, scale);
            bool kept = key > K;
            if (key == K) kept = rank++ < m;
            if (kept) {
                cum += sample_weight(key);
                if (cum > target) { sm.token = i; break; }
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        // -1 would be a bug (the tests compare info[0] with the reference); fall back to the
        // argmax rather than emit an invalid id.
        const int token = sm.token >= 0 ? sm.token : argmax_token;
        next_token[0] = token;
        info[0] = sm.token; info[1] = (int)x; info[2] = (int)n_kept; info[3] = (int)P.token_index;
    }
}

// grid (1), block (1). host_ring is page-locked host memory, written through its unified
// (UVA) address: the host reads token i from slot i % ring_size once an event recorded after
// this kernel has completed — no device-to-host copy, nothing for a graph to re-parameterise.
// One thread; bytes per call: 4 read + 4 written to host memory over PCIe + 8 of params. Latency only.
extern "C" __global__ void publish_token(int* __restrict__ host_ring,         // [ring_size] int32, host-mapped, out
                                         SamplerParams* __restrict__ params,  // [1] in/out: token_index += 1
                                         const int* __restrict__ next_token,  // [1] int32
                                         int ring_size) {
    grid_launch_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const u32 i = params->token_index;
        host_ring[i % (u32)ring_size] = next_token[0];
        params->token_index = i + 1;
    }
}

// grid (1), block (PENALTY_WINDOW): thread j owns history slot j. Each distinct id is
// penalized once (slot j skips an id an earlier slot holds: ≤ 64·63/2 compares, all in L1).
// Bytes: 4 · 65 of history read, ≤ 64 logits read and written (8 B each). Latency only.
extern "C" __global__ void __launch_bounds__(PENALTY_WINDOW)
penalize_logits(float* __restrict__ logits,                 // [V] fp32, in/out
                const SamplerParams* __restrict__ params,   // [1]: repeat_penalty
                const int* __restrict__ history,            // [1 + PENALTY_WINDOW] int32: count, ring
                int V) {
    grid_launch_dependents();
    grid_dependency_wait();  // the logits come from lm_head
    const float p = params->repeat_penalty;
    const int n = min(history[0], PENALTY_WINDOW);
    const int j = threadIdx.x;
    if (p == 1.0f || j >= n) return;
    const int t = history[1 + j];
    for (int k = 0; k < j; ++k)
        if (history[1 + k] == t) return;
    if (t < 0 || t >= V) return;
    const float l = logits[t];
    // llama.cpp: `logit <= 0 ? logit * p : logit / p`; one IEEE rounding each, as numpy.
    logits[t] = l > 0.f ? __fdiv_rn(l, p) : __fmul_rn(l, p);
}

// grid (1), block (1): history gets next_token[0] at slot count % PENALTY_WINDOW, count += 1.
// Bytes: 12. Latency only (it runs after the choice, before publish_token).
extern "C" __global__ void record_token(int* __restrict__ history,          // [1 + PENALTY_WINDOW] int32, in/out
                                        const int* __restrict__ next_token) {  // [1] int32
    grid_launch_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const int n = history[0];
        history[1 + n % PENALTY_WINDOW] = next_token[0];
        history[0] = n + 1;
    }
}
