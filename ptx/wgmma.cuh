// ptx/wgmma.cuh — warpgroup-level tensor-core MMA (sm_90a): wgmma.mma_async and its fences.
//
//   wgmma_fence            : wgmma.fence.sync.aligned
//   wgmma_commit_group     : wgmma.commit_group.sync.aligned
//   wgmma_wait_group<N>    : wgmma.wait_group.sync.aligned N
//   wgmma_desc_sw128       : the 64-bit shared-memory matrix descriptor of a K-major operand
//                            stored in 128-byte-swizzled 8-row atoms (what TMA writes with
//                            CU_TENSOR_MAP_SWIZZLE_128B)
//   wgmma_m64n128k16_rs    : wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16, A from
//                            registers, B from shared memory through a descriptor
//   wgmma_m64n128k16_ss    : the same with A from shared memory through a descriptor too
//   wgmma_m64n256k16_rs    : the RS form with 256 columns (128 accumulators a lane)
//   wgmma_m64n64k16_rs     : the RS form with 64 columns (32 accumulators a lane)
//   wgmma_m64n64k16_ss     : the SS form with 64 columns (the prefill attention's QKᵀ with Q in
//                            shared memory)
//   wgmma_desc_sw128_nmajor: the descriptor of an N-major B operand in 128-byte-swizzled atoms
//   wgmma_m64n128k16_rs<1>, wgmma_m64n64k16_rs<1>
//                          : the RS forms with B N-major (imm-trans-b = 1): B[k][n] stored with n
//                            contiguous, as a [token][dim] V tile is for O += P·V
//   fence_proxy_async_shared : fence.proxy.async.shared::cta
//   wgmma_fence_operand    : an empty asm that pins a register in place (no PTX instruction)
//   (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions": wgmma.fence,
//    wgmma.commit_group, wgmma.wait_group, wgmma.mma_async, "Matrix Descriptor Format")
//
// Why wgmma: on Hopper the tensor cores' full rate is reached only by wgmma — four warps (a
// warpgroup, warps 4i … 4i+3) issue one 64 × N × 16 MMA together, B (and optionally A) read
// straight from shared memory by the tensor cores, asynchronously: the warps go on (unpacking
// the next INT4 weights) while the MMAs run. mma.sync, the Ampere instruction, tops out near
// two thirds of that rate and needs every operand in registers.
//
// Why A from registers (the "RS" form): the A operand is the INT4 weights, unpacked to FP16 and
// scaled in registers (ptx/int4_unpack.cuh); from registers they go to the tensor cores with no
// shared-memory round trip. Register fragment layout of A for m64k16 — warp w of the warpgroup
// holds rows 16w … 16w+15, lane (g, t) = (lane / 4, lane % 4), each register a half2 (low half =
// lower k):
//   a[0] = A[16w+g][2t, 2t+1]   a[1] = A[16w+g+8][2t, 2t+1]
//   a[2] = A[16w+g][2t+8, 2t+9] a[3] = A[16w+g+8][2t+8, 2t+9]
// (the same per-warp layout as mma.sync.m16n8k16). The k order is NOT free here, unlike with
// mma.sync: B comes from shared memory in its natural order, so a[] must hold exactly these k.
//
// Accumulator layout for m64nN, f32: lane (g, t) of warp w holds, for each 8-column block j,
//   d[4j+0], d[4j+1] = D[16w+g  ][8j+2t], D[16w+g  ][8j+2t+1]
//   d[4j+2], d[4j+3] = D[16w+g+8][8j+2t], D[16w+g+8][8j+2t+1]
//
// The asynchrony is the programmer's to manage: registers written by ordinary instructions must
// be fenced (wgmma_fence) before a wgmma reads them; the A registers and accumulators of an MMA
// in flight must not be touched until a wgmma_wait_group says its group has completed. The
// compiler does not see that the accumulators change in the background: wgmma_fence_operand on
// each of them keeps it from moving reads or copies of them across the MMA's issue and wait.
#pragma once
#include "types.cuh"

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// Close the group of wgmma.mma_async issued since the last commit (one group per K step here).
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void wgmma_fence_operand(float& r) {
    asm volatile("" : "+f"(r) :: "memory");
}
__device__ __forceinline__ void wgmma_fence_operand(u32& r) {
    asm volatile("" : "+r"(r) :: "memory");
}

// The 64 FP32 accumulators of an m64n128 wgmma as inline-asm operands %0 … %63 (read and
// written): the register list in the instruction text, and the operand list that binds it.
#define WGMMA_D64_REGS                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "     \
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "     \
    "%62, %63}"
#define WGMMA_D64_OPERANDS(d)                                                                               \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),          \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),    \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The 32 FP32 accumulators of an m64n64 wgmma as operands %0 … %31, as above.
#define WGMMA_D32_REGS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_D32_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// The 128 FP32 accumulators of an m64n256 wgmma as operands %0 … %127, as above.
#define WGMMA_D128_REGS                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define WGMMA_D128_OPERANDS(d)                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// Descriptor of a K-major tile in shared memory, 128-byte swizzle: rows (the N index) of
// 128 bytes = 64 FP16 k values, grouped in 8-row, 1024-byte atoms; `smem` points at the k
// offset to start from inside the first row (0, 32, 64 or 96 bytes for the four k16 steps of a
// 64-wide row) of a 1024-byte-aligned tile. Fields (PTX ISA, "Matrix Descriptor Format"):
//   bits  0–13  start address >> 4
//   bits 16–29  leading-dimension byte offset >> 4: unused for a swizzled K-major operand
//               whose k extent (16 × 2 B) lies inside one swizzle row; 1 by convention
//   bits 32–45  stride-dimension byte offset >> 4: 1024 B from one 8-row atom to the next
//   bits 49–51  base offset: 0 (atoms 1024-byte aligned)
//   bits 62–63  swizzle mode: 1 = 128-byte swizzle
__device__ __forceinline__ u64 wgmma_desc_sw128(const void* smem) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// D[64 × 128] (+)= A[64 × 16] · B[16 × 128]: FP16 × FP16, FP32 accumulate. a: this lane's A
// fragment (layout above); b_desc: B as 128 K-major rows (the N index) of 16 k values;
// accumulate = 0 writes D = A·B (no zeroing of d needed), 1 adds. Scale-a/b = 1 (no negation).
// N_MAJOR_B (imm-trans-b) 0: B K-major; 1: B N-major (b_desc: wgmma_desc_sw128_nmajor), used for
// O += P·V, where P comes out of the previous MMA's accumulators in exactly A's register layout
// and V's tile sits in shared memory as the cache stores it, [token][dim]: token = k, dim = n.
template <int N_MAJOR_B = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4], u64 b_desc,
                                                    int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WGMMA_D64_REGS ", "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
        "}\n"
        : WGMMA_D64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate), "n"(N_MAJOR_B)
        : "memory");
}

// D[64 × 64] (+)= A[64 × 16] · B[16 × 64], A from registers: wgmma_m64n128k16_rs with 64
// columns (b_desc: 64 K-major rows, or N-major with N_MAJOR_B); for GEMMs with few tokens,
// where more, smaller tiles keep more SMs busy, and attention's QKᵀ and P·V at head dim 64.
template <int N_MAJOR_B = 0>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], u64 b_desc,
                                                   int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WGMMA_D32_REGS ", "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
        "}\n"
        : WGMMA_D32_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate), "n"(N_MAJOR_B)
        : "memory");
}

// D[64 × 256] (+)= A[64 × 16] · B[16 × 256], A from registers: wgmma_m64n128k16_rs with 256
// columns (b_desc: 256 K-major rows). Twice the MMA work per A fragment: where A is unpacked in
// the MMA warps (INT4 weights), the unpack per FLOP halves.
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const u32 (&a)[4], u64 b_desc,
                                                    int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        WGMMA_D128_REGS ", "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n"
        "}\n"
        : WGMMA_D128_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate)
        : "memory");
}

// D[64 × 64] (+)= A[64 × 16] · B[16 × 64] with both operands in shared memory, both K-major
// (wgmma_desc_sw128): as wgmma_m64n128k16_ss with 64 columns. The prefill attention's QKᵀ with Q
// read from shared memory (APW_Q_SMEM) instead of a lane's registers.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WGMMA_D32_REGS ", "
        "%32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D32_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate)
        : "memory");
}

// Descriptor of an N-major B operand (B[k][n] with n contiguous) in 128-byte-swizzled atoms:
// each k row holds 64 FP16 n values in 128 bytes, 8 consecutive k rows form a 1024-byte atom
// (swizzled as TMA's CU_TENSOR_MAP_SWIZZLE_128B writes it: 16-byte chunk c of row r at chunk
// c ^ (r % 8)); `smem` points at the atom of the MMA's first k (1024-byte aligned). Fields for
// the N-major swizzled form (PTX ISA, "Matrix Descriptor Format", "Strides"):
//   leading-dimension byte offset: from the first 64 n values (128 bytes of every row) to the
//                                  next 64 — `lbo_bytes`, the distance between two such column
//                                  blocks of the tile (unused where N = 64)
//   stride-dimension byte offset:  from one 8-row (8 k) atom to the next: 1024 B, k16 = 2 atoms
//   base offset 0, swizzle mode 1 (128 B), as wgmma_desc_sw128.
__device__ __forceinline__ u64 wgmma_desc_sw128_nmajor(const void* smem, u32 lbo_bytes) {
    const u32 addr = static_cast<u32>(__cvta_generic_to_shared(smem));
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo_bytes >> 4) & 0x3FFF) << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

// D[64 × 128] (+)= A[64 × 16] · B[16 × 128] with both operands in shared memory (the "SS" form):
// a_desc describes A as 64 K-major rows (the M index) of 16 k values, b_desc B as 128 K-major
// rows, both wgmma_desc_sw128; neither transposed. Used where another warpgroup prepares A in
// shared memory (gemm_fmt_wgmma.cu), so the MMA warps only issue MMAs.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], u64 a_desc, u64 b_desc, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WGMMA_D64_REGS ", "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D64_OPERANDS(d)
        : "l"(a_desc), "l"(b_desc), "r"(accumulate)
        : "memory");
}

// Orders this thread's earlier generic-proxy writes to shared memory (st.shared) before later
// async-proxy reads of it (wgmma operands, TMA stores): a thread that prepares an MMA operand
// runs it after its stores and before the mbarrier arrival that hands the buffer over (PTX ISA,
// "Memory Consistency Model: proxies"; membar/fence: fence.proxy.async).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
