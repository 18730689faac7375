"""Launchers: one class per kernel family, each knowing its grid, block and shared memory.

A launcher is built once, from the device buffers it reads and writes and the model's shape,
and holds one pre-packed `KernelLaunch` per kernel it runs (`.launches`, in order). The decode
step is the concatenation of the launchers' `.launches`: eager mode calls `launch()` on them,
graph capture records the same calls, and the step-through REPL walks them one by one.

Names follow one thread through the code base (STYLE.md):

    kernels/rmsnorm.cu → `rmsnorm` kernel → `RmsNorm` → `reference.rmsnorm` → tests/test_kernel_rmsnorm.py

| launcher               | kernel(s) (kernels/*.cu)                         | writes                    |
|------------------------|--------------------------------------------------|---------------------------|
| Embedding              | embedding (embedding.cu)                         | residual fp32 [D]         |
| EmbeddingRows          | embedding_rows                                   | residual fp32 [T, D]      |
| RmsNorm                | rmsnorm (rmsnorm.cu)                             | out fp16 [rows, D]        |
| GemvInt4               | gemv_int4_f16 (gemv_int4.cu)                     | y fp16 [N]                |
| GemvInt4Qkv            | gemv_int4_qkv                                    | qkv fp32 [Nq + 2 Nkv]     |
| GemvInt4Residual       | gemv_int4_residual                               | residual fp32 [N] (+=)    |
| GemvInt4GateUpSwiglu   | gemv_int4_gate_up_swiglu                         | h fp16 [F]                |
| (tiled=True)           | gemv_int4_{residual,gate_up_swiglu}_tiled        | (tile-major experiment)   |
| RopeKv                 | rope_kv (rope_kv.cu)                             | q fp16 [Hq, Dh], K/V slot |
| AttentionDecode        | attention_decode_hd{64,128} + attention_combine  | out fp16 [Hq, Dh]         |
| LmHead                 | gemv_f16_lm_head (gemv_f16.cu)                   | logits fp32 [V], partials |
| ArgmaxFinal            | argmax_final (argmax.cu)                         | next_token int32 [1]      |
| Argmax                 | argmax_partial + argmax_final                    | next_token int32 [1]      |
| AdvanceState           | advance_state (decode_state.cu)                  | state int32 [3]           |
| GemmInt4 (prefill)     | gemm_int4_f32 (gemm_int4.cu)                     | out fp32 [M, N]           |
| GemmInt4QkvRows        | gemm_int4_qkv                                    | qkv fp32 [M, Nq + 2 Nkv]  |
| GemmInt4ResidualRows   | gemm_int4_residual                               | residual fp32 [M, N] (+=) |
| GemmInt4GateUpSwigluRows | gemm_int4_gate_up_swiglu                       | h fp16 [M, F]             |
| RopeKvRows             | rope_kv_rows (rope_kv.cu)                        | q fp16 [M, Hq, Dh], K/V   |
| AttentionPrefill       | attention_prefill_hd{64,128}                     | out fp16 [M, Hq, Dh]      |
| PrefillBeginChunk      | prefill_begin_chunk (prefill_state.cu)           | prefill_state int32 [2]   |
| DecodeResume           | decode_resume                                    | state int32 [3]           |
| SampleToken            | sample_token (sampling.cu)                       | next_token int32 [1]      |
| PublishToken           | publish_token                                    | host ring int32 [R]       |

Prefill kernels take the row count M (and the chunk's start position) from a device
`prefill_state` int32 [2] = (start, n_rows), written by PrefillBeginChunk before each chunk:
their grids are sized for a row *capacity* (`rows`), so one launch list serves every chunk of
up to that many rows, and blocks past n_rows return at once.

Buffers are anything `cuda.launch.pack_param` accepts; a buffer that carries `.shape` and
`.dtype` (a `DeviceArray`) is checked against what the kernel expects (element count and
dtype), so a wrong buffer fails here, by name, rather than as a silent wrong read.

Per-step values (position, token, sequence length) are never launch arguments: the kernels
read them from the device `state` array (state[0] = pos, state[1] = token, state[2] = seq_len),
so a captured graph replays unchanged every step (DESIGN.md §7).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np

from .cuda import DeviceArray, KernelLaunch, Stream, get_device, load_kernel_module
from .format.quant import GROUP_SIZE

PAGE_TOKENS = 16  # KV page size in tokens (ptx/kv_cache.cuh KV_PAGE_TOKENS, config.PAGE_SIZE)

# Constants mirrored from the .cu files (each says where it is defined there).
EMBEDDING_THREADS = 256          # embedding.cu
RMSNORM_THREADS = 1024           # rmsnorm.cu
RMSNORM_MAX_DIM = 4 * RMSNORM_THREADS * 4   # rmsnorm.cu: RMSNORM_MAX_CHUNKS float4 per thread
GEMV_TILE_ROWS = 16              # gemv_int4.cu: rows per block (M of one MMA)
GEMV_MAX_WARPS = 8               # gemv_int4.cu: K-split warps per block
ATTN_WARPS = 4                   # attention_decode.cu: warps (= splits) per block
ATTN_MAX_GROUP = 8               # attention_decode.cu: query heads per KV head per warp
ATTN_HEAD_DIMS = (64, 128)       # attention_decode.cu instantiations
ATTN_COMBINE_THREADS = 1024      # attention_decode.cu: attention_combine block
LM_ROWS_PER_BLOCK = 32           # gemv_f16.cu: LM_WARPS * LM_ROWS_PER_WARP
LM_THREADS = 256                 # gemv_f16.cu: LM_WARPS * 32
ARGMAX_THREADS = 1024            # argmax.cu


def _i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def _f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


def _check(buf, name: str, n_elements: int, dtype) -> None:
    """Check a buffer that knows its shape (DeviceArray) against the kernel's expectation."""
    shape, dt = getattr(buf, "shape", None), getattr(buf, "dtype", None)
    if shape is None or dt is None:
        return  # a raw pointer: the caller vouches for it
    if math.prod(shape) != n_elements or np.dtype(dt) != np.dtype(dtype):
        raise ValueError(f"{name}: expected {n_elements} elements of {np.dtype(dtype)}, got "
                         f"{getattr(buf, 'name', '?')} {np.dtype(dt)}{list(shape)}")


def _fn(file: str, kernel: str):
    """The kernel `kernel` of kernels/<file>.cu (compiled through the cubin cache, loaded once)."""
    return load_kernel_module(file).function(kernel)


def kv_layer_view(cache: DeviceArray, layer: int) -> DeviceArray:
    """One layer of a paged KV cache [L, P, Hkv, 16, Dh] as a [P, Hkv, 16, Dh] DeviceArray view
    (no copy: the layer's base address), the form the KV kernels take."""
    n_layers, *rest = cache.shape
    assert 0 <= layer < n_layers, (layer, n_layers)
    layer_bytes = math.prod(rest) * cache.dtype.itemsize
    return DeviceArray(f"{cache.name}[{layer}]", cache.ptr + layer * layer_bytes, rest, cache.dtype)


class Launcher:
    """Base: a named, ordered list of pre-packed launches.

    Attributes:
        launches: the KernelLaunch objects, in the order they must run.
        bytes_moved: bytes read + written from device memory per call (for GB/s figures).
    """

    launches: list[KernelLaunch]
    bytes_moved: int = 0

    def launch(self, stream: Stream | None = None) -> None:
        """Queue every launch on `stream` (default: each launch's own stream)."""
        for ln in self.launches:
            ln.launch(stream)

    __call__ = launch

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(repr(ln) for ln in self.launches)})"


# --- embedding.cu ---------------------------------------------------------------------------------


class Embedding(Launcher):
    """residual fp32 [D] = embed[state[1]] (decode: the token id is read from device state)."""

    def __init__(self, residual, embed, state, *, vocab_size: int, dim: int,
                 stream: Stream | None = None):
        assert dim % 8 == 0, dim
        _check(residual, "residual", dim, np.float32)
        _check(embed, "embed", vocab_size * dim, np.float16)
        _check(state, "state", 3, np.int32)
        grid = (-(-dim // 8) + EMBEDDING_THREADS - 1) // EMBEDDING_THREADS
        self.launches = [KernelLaunch(_fn("embedding", "embedding"), (grid,), (EMBEDDING_THREADS,),
                                      [residual, embed, state, _i32(vocab_size), _i32(dim)],
                                      stream=stream)]
        self.bytes_moved = dim * (2 + 4)


class EmbeddingRows(Launcher):
    """residual fp32 [T, D] = embed[ids[t]] for T token ids in a device int32 array."""

    def __init__(self, residual, embed, ids, *, n_rows: int, vocab_size: int, dim: int,
                 stream: Stream | None = None):
        assert dim % 8 == 0, dim
        _check(residual, "residual", n_rows * dim, np.float32)
        _check(embed, "embed", vocab_size * dim, np.float16)
        _check(ids, "ids", n_rows, np.int32)
        grid = (-(-dim // 8) + EMBEDDING_THREADS - 1) // EMBEDDING_THREADS
        self.launches = [KernelLaunch(_fn("embedding", "embedding_rows"), (grid, n_rows),
                                      (EMBEDDING_THREADS,),
                                      [residual, embed, ids, _i32(vocab_size), _i32(dim)],
                                      stream=stream)]
        self.bytes_moved = n_rows * dim * (2 + 4)


# --- rmsnorm.cu -----------------------------------------------------------------------------------


class RmsNorm(Launcher):
    """out fp16 [rows, D] = rmsnorm(x fp32 [rows, D]) * w fp16 [D], all in FP32 (reference.rmsnorm)."""

    def __init__(self, out, x, weight, *, dim: int, eps: float, rows: int = 1,
                 stream: Stream | None = None):
        assert dim % 4 == 0 and dim <= RMSNORM_MAX_DIM, dim
        _check(out, "out", rows * dim, np.float16)
        _check(x, "x", rows * dim, np.float32)
        _check(weight, "weight", dim, np.float16)
        self.launches = [KernelLaunch(_fn("rmsnorm", "rmsnorm"), (rows,), (RMSNORM_THREADS,),
                                      [out, x, weight, _i32(dim), _f32(eps)], stream=stream)]
        self.bytes_moved = rows * dim * (4 + 2) + dim * 2


# --- gemv_int4.cu ---------------------------------------------------------------------------------


# sm_90 per-SM limits (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"): registers, resident threads and blocks, shared memory (228 KiB, of which the
# driver reserves 1 KiB per block). Registers are allocated per warp in units of 256.
SM_REGISTERS = 65536
SM_MAX_THREADS = 2048
SM_MAX_BLOCKS = 32
SM_SMEM_BYTES = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
REG_ALLOC_UNIT = 256

# The GEMV cost model (gemv_launch_shape). An "item" is one warp's work on one K group of one
# 16-row tile of one matrix: 32 lanes × 2 rows × 16 B = 1 KiB of INT4 weights.
GEMV_ITEM_BYTES = 1024
# A warp alone keeps one 4-item batch (4 KiB) in flight per HBM round trip (~1 µs loaded):
# ~250 ns per item when bandwidth is not the limit.
GEMV_UNLOADED_NS_PER_ITEM = 250.0
# HBM bytes per ns when it is the limit: 4.3 TB/s, the copy bandwidth measured on the H200
# (KINDS.md).
HBM_BYTES_PER_NS = 4300.0
# Modelled times within 3 % count as equal (the model is coarse: on the H200, down_proj ran
# 17.6 µs with W = 6 and 16.8 µs with W = 8, which the model had 1.3 % apart the other way).
GEMV_TIE_BAND = 1.03


def blocks_per_sm(registers: int, threads: int, smem_bytes: int) -> int:
    """Resident blocks per SM for a kernel using `registers` per thread (occupancy calculator)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = SM_REGISTERS // (regs_per_warp * warps)
    by_threads = SM_MAX_THREADS // (warps * 32)
    by_smem = SM_SMEM_BYTES // (smem_bytes + SMEM_RESERVED_PER_BLOCK)
    return max(0, min(by_regs, by_threads, by_smem, SM_MAX_BLOCKS))


def gemv_smem_bytes(k: int, tiles_per_block: int, warps: int, mt: int) -> int:
    """Dynamic shared memory of a gemv_int4 block: x in FP16, then the warp partials."""
    return 2 * k + tiles_per_block * mt * warps * 16 * 4


def gemv_launch_shape(n_tiles: int, k: int, mt: int, registers: int, sm_count: int,
                      warps: int | None = None, blocks: int | None = None) -> tuple[int, int, int]:
    """(grid blocks G, threads per block 32·W, dynamic smem bytes) for a gemv_int4 kernel.

    Each block owns ceil-or-floor(T/G) consecutive 16-row tiles and its W warps split the K
    groups (gemv_int4.cu). For each W in 1..8 (W ≤ K/128), the resident block count caps G;
    with makespan m = ceil(T / G_max) tiles per block, G = ceil(T / m) (no more blocks than the
    makespan needs). The modelled time is the busiest warp's item count times the time per
    item: max(GEMV_UNLOADED_NS_PER_ITEM, active warps × GEMV_ITEM_BYTES / HBM_BYTES_PER_NS).
    The smallest time wins; within GEMV_TIE_BAND, more warps per block (x staged fewer times,
    more loads in flight). At 7B this picks: gate_up W=7, 237 blocks of 5 tiles; down W=8,
    224 blocks; qkv W=4, 288 blocks; o_proj W=7, 224 blocks (measured: see gemv_int4.cu).

    `warps` / `blocks` force a shape (benchmark variants), e.g. blocks=n_tiles for one tile
    per block.
    """
    groups = k // GROUP_SIZE
    best = None
    for w in range(1, min(GEMV_MAX_WARPS, groups) + 1):
        if warps is not None and w != warps:
            continue
        occ = blocks_per_sm(registers, 32 * w, gemv_smem_bytes(k, 1, w, mt))
        g_max = max(1, occ * sm_count)
        g = min(n_tiles, g_max) if blocks is None else min(blocks, n_tiles)
        per_block = -(-n_tiles // g)
        if blocks is None:
            g = -(-n_tiles // per_block)
        smem = gemv_smem_bytes(k, per_block, w, mt)
        items = per_block * -(-groups // w)
        active = g * w
        t_ns = items * max(GEMV_UNLOADED_NS_PER_ITEM, active * GEMV_ITEM_BYTES / HBM_BYTES_PER_NS)
        if best is None or t_ns < best[0] / GEMV_TIE_BAND or (t_ns <= best[0] * GEMV_TIE_BAND and w > best[1]):
            best = (t_ns, w, g, smem)
    if best is None:
        raise ValueError(f"no GEMV launch shape for K={k} with warps={warps}")
    _, w, g, smem = best
    return g, 32 * w, smem


def _int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * (k // GROUP_SIZE) * 2


def _check_int4(qweight, scales, name: str, n: int, k: int) -> None:
    _check(qweight, f"{name}.qweight", n * k // 8, np.uint32)
    _check(scales, f"{name}.scales", n * (k // GROUP_SIZE), np.float16)


def _tiles(n: int) -> int:
    return -(-n // GEMV_TILE_ROWS)


class _GemvInt4Launcher(Launcher):
    """Shared by the gemv_int4 launchers: picks the launch shape from the kernel's registers."""

    def _build(self, kernel: str, n_tiles: int, k: int, mt: int, params: list, stream, *,
               sm_count: int | None, warps: int | None, blocks: int | None) -> None:
        assert k % GROUP_SIZE == 0 and k > 0, f"K={k} must be a positive multiple of {GROUP_SIZE}"
        assert n_tiles >= 1
        fn = _fn("gemv_int4", kernel)
        if sm_count is None:
            sm_count = get_device().info.sm_count
        grid, threads, smem = gemv_launch_shape(n_tiles, k, mt, fn.num_registers, sm_count,
                                                warps=warps, blocks=blocks)
        self.launches = [KernelLaunch(fn, (grid,), (threads,), params, smem_bytes=smem, stream=stream)]


class GemvInt4(_GemvInt4Launcher):
    """y fp16 [N] = W x, W INT4 layout id 1 [N, K], x fp16 [K]."""

    def __init__(self, y, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 sm_count: int | None = None, warps: int | None = None, blocks: int | None = None):
        _check(y, "y", n, np.float16)
        _check(x, "x", k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        self._build("gemv_int4_f16", _tiles(n), k, 1, [y, x, qweight, scales, _i32(n), _i32(k)],
                    stream, sm_count=sm_count, warps=warps, blocks=blocks)
        self.bytes_moved = _int4_bytes(n, k) + 2 * k + 2 * n


class GemvInt4Qkv(_GemvInt4Launcher):
    """qkv fp32 [Nq + 2 Nkv] = [Wq x; Wk x; Wv x] in one launch (bias and RoPE: RopeKv)."""

    def __init__(self, qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, *,
                 n_q: int, n_kv: int, k: int, stream: Stream | None = None,
                 sm_count: int | None = None, warps: int | None = None, blocks: int | None = None):
        _check(qkv, "qkv", n_q + 2 * n_kv, np.float32)
        _check(x, "x", k, np.float16)
        _check_int4(q_qweight, q_scales, "q_proj", n_q, k)
        _check_int4(k_qweight, k_scales, "k_proj", n_kv, k)
        _check_int4(v_qweight, v_scales, "v_proj", n_kv, k)
        self._build("gemv_int4_qkv", _tiles(n_q) + 2 * _tiles(n_kv), k, 1,
                    [qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                     _i32(n_q), _i32(n_kv), _i32(k)],
                    stream, sm_count=sm_count, warps=warps, blocks=blocks)
        self.bytes_moved = _int4_bytes(n_q + 2 * n_kv, k) + 2 * k + 4 * (n_q + 2 * n_kv)


class GemvInt4Residual(_GemvInt4Launcher):
    """residual fp32 [N] += W x (o_proj, down_proj): the residual add fused into the epilogue.

    tiled=True: the experimental tile-major qweight [N/16, K/128, 16, 16] (gemv_int4.cu, end).
    """

    def __init__(self, residual, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 sm_count: int | None = None, warps: int | None = None, blocks: int | None = None,
                 tiled: bool = False):
        _check(residual, "residual", n, np.float32)
        _check(x, "x", k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        assert not tiled or n % GEMV_TILE_ROWS == 0, n
        self._build("gemv_int4_residual_tiled" if tiled else "gemv_int4_residual", _tiles(n), k, 1,
                    [residual, x, qweight, scales, _i32(n), _i32(k)],
                    stream, sm_count=sm_count, warps=warps, blocks=blocks)
        self.bytes_moved = _int4_bytes(n, k) + 2 * k + 8 * n


class GemvInt4GateUpSwiglu(_GemvInt4Launcher):
    """h fp16 [F] = silu(Wg x) * (Wu x): gate_proj, up_proj and SwiGLU in one launch.

    tiled=True: the experimental tile-major qweight [F/16, K/128, 16, 16] (gemv_int4.cu, end).
    """

    def __init__(self, h, x, gate_qweight, gate_scales, up_qweight, up_scales, *, f: int, k: int,
                 stream: Stream | None = None, sm_count: int | None = None,
                 warps: int | None = None, blocks: int | None = None, tiled: bool = False):
        _check(h, "h", f, np.float16)
        _check(x, "x", k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        assert not tiled or f % GEMV_TILE_ROWS == 0, f
        self._build("gemv_int4_gate_up_swiglu_tiled" if tiled else "gemv_int4_gate_up_swiglu", _tiles(f), k, 2,
                    [h, x, gate_qweight, gate_scales, up_qweight, up_scales, _i32(f), _i32(k)],
                    stream, sm_count=sm_count, warps=warps, blocks=blocks)
        self.bytes_moved = 2 * _int4_bytes(f, k) + 2 * k + 2 * f


# --- rope_kv.cu -----------------------------------------------------------------------------------


class RopeKv(Launcher):
    """Bias + RoPE of q and k, and the write of this step's K/V at state[0] into the paged cache.

    qkv is GemvInt4Qkv's FP32 output; inv_freq the float32 [Dh/2] table of
    `reference.rope_inv_freq(head_dim, theta)`; k_cache/v_cache one layer [P, Hkv, 16, Dh]
    (`kv_layer_view`); block_table int32 [max_pages].
    """

    def __init__(self, q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, state,
                 block_table, *, n_heads: int, n_kv_heads: int, head_dim: int,
                 stream: Stream | None = None):
        assert head_dim % 2 == 0 and head_dim // 2 <= 1024, head_dim
        nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
        _check(q_out, "q_out", nq, np.float16)
        _check(qkv, "qkv", nq + 2 * nkv, np.float32)
        _check(q_bias, "q_bias", nq, np.float16)
        _check(k_bias, "k_bias", nkv, np.float16)
        _check(v_bias, "v_bias", nkv, np.float16)
        _check(inv_freq, "inv_freq", head_dim // 2, np.float32)
        _check(state, "state", 3, np.int32)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            shape = getattr(c, "shape", None)
            if shape is not None:
                assert tuple(shape[1:]) == (n_kv_heads, PAGE_TOKENS, head_dim), (name, shape)
        self.launches = [KernelLaunch(
            _fn("rope_kv", "rope_kv"), (n_heads + 2 * n_kv_heads,), (head_dim // 2,),
            [q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, state, block_table,
             _i32(n_heads), _i32(n_kv_heads), _i32(head_dim)],
            stream=stream)]
        self.bytes_moved = 4 * (nq + 2 * nkv) + 2 * (nq + 2 * nkv) * 2


# --- attention_decode.cu --------------------------------------------------------------------------


# Resident decode-attention blocks per SM when the kernel is not asked (attention_decode_hd128:
# 228 registers × 128 threads → 2 blocks; hd64 fits 4).
ATTN_DEFAULT_BLOCKS_PER_SM = 2


def attention_blocks_per_kv_head(n_kv_heads: int, max_tokens: int, sm_count: int | None = None, *,
                                 head_dim: int | None = None, registers: int | None = None) -> int:
    """S, the decode attention's blocks per KV head (grid (S, Hkv), ATTN_WARPS splits per block).

    Every resident block slot of the GPU gets a block (occupancy from the kernel's registers
    when head_dim or registers is given, else ATTN_DEFAULT_BLOCKS_PER_SM), because a warp's
    page loop is latency-bound (~1–2 µs per page on the H200): more splits, fewer pages per
    warp. No more warps than there are pages at the longest context (they would only idle).
    At 7B on an H200: S = 66 (264 splits per KV head); S = 33 ran 36 µs at 32768 tokens.
    """
    if registers is None and head_dim is not None:
        registers = _fn("attention_decode", f"attention_decode_hd{head_dim}").num_registers
    per_sm = ATTN_DEFAULT_BLOCKS_PER_SM if registers is None else max(1, blocks_per_sm(registers, 32 * ATTN_WARPS, 0))
    return _split_blocks_per_kv_head(n_kv_heads, max_tokens, per_sm, ATTN_WARPS, sm_count)


def _split_blocks_per_kv_head(n_kv_heads: int, max_tokens: int, blocks_per_sm_: int,
                              splits_per_block: int, sm_count: int | None) -> int:
    """The split-KV grid rule both decode attention kernels share: fill every resident block
    slot of the GPU (blocks_per_sm_ × SMs over the KV heads), but give no split less than one
    page at the longest context."""
    if sm_count is None:
        sm_count = get_device().info.sm_count
    max_pages = -(-max_tokens // PAGE_TOKENS)
    by_sms = -(-blocks_per_sm_ * sm_count // n_kv_heads)
    by_pages = -(-max_pages // splits_per_block)
    return max(1, min(by_sms, by_pages))


def attention_partial_shapes(n_heads: int, head_dim: int, blocks_per_kv_head: int,
                             splits_per_block: int = ATTN_WARPS) -> dict[str, tuple]:
    """Shapes of the fp32 scratch buffers of the split-KV decode attention: o_part, m_part,
    l_part (the layout attention_combine reads). splits_per_block: ATTN_WARPS for
    AttentionDecode, ATMA_CONSUMERS for AttentionDecodeTma."""
    n_splits = blocks_per_kv_head * splits_per_block
    return {"o_part": (n_splits, n_heads, head_dim), "m_part": (n_splits, n_heads),
            "l_part": (n_splits, n_heads)}


class AttentionDecode(Launcher):
    """out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2] of a paged cache.

    Two launches: attention_decode_hd{Dh} (per-warp split partials) and attention_combine.
    `blocks_per_kv_head` fixes the grid (graph-friendly); see attention_blocks_per_kv_head.
    o_part/m_part/l_part are fp32 scratch of attention_partial_shapes(...).
    """

    def __init__(self, out, q, k_cache, v_cache, block_table, state, o_part, m_part, l_part, *,
                 n_heads: int, n_kv_heads: int, head_dim: int, blocks_per_kv_head: int,
                 stream: Stream | None = None):
        if head_dim not in ATTN_HEAD_DIMS:
            raise ValueError(f"attention_decode is built for head_dim in {ATTN_HEAD_DIMS}, got {head_dim}")
        assert n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= ATTN_MAX_GROUP, (n_heads, n_kv_heads)
        shapes = attention_partial_shapes(n_heads, head_dim, blocks_per_kv_head)
        _check(out, "out", n_heads * head_dim, np.float16)
        _check(q, "q", n_heads * head_dim, np.float16)
        _check(state, "state", 3, np.int32)
        for name, buf in (("o_part", o_part), ("m_part", m_part), ("l_part", l_part)):
            _check(buf, name, math.prod(shapes[name]), np.float32)
        n_splits = blocks_per_kv_head * ATTN_WARPS
        self.n_splits = n_splits
        self.launches = [
            KernelLaunch(_fn("attention_decode", f"attention_decode_hd{head_dim}"),
                         (blocks_per_kv_head, n_kv_heads), (32 * ATTN_WARPS,),
                         [o_part, m_part, l_part, q, k_cache, v_cache, block_table, state,
                          _i32(n_heads), _i32(n_kv_heads)], stream=stream),
            KernelLaunch(_fn("attention_decode", "attention_combine"), (n_heads,),
                         (ATTN_COMBINE_THREADS,),
                         [out, o_part, m_part, l_part, state, _i32(n_splits), _i32(n_heads),
                          _i32(head_dim)], smem_bytes=2 * 4 * n_splits, stream=stream),
        ]
        self.kv_bytes_per_token = 2 * n_kv_heads * head_dim * 2  # K and V, fp16

    def bytes_for(self, seq_len: int) -> int:
        """KV bytes read at a given length (the partials are L2 traffic, not counted)."""
        return seq_len * self.kv_bytes_per_token


# --- gemv_f16.cu / argmax.cu / decode_state.cu ----------------------------------------------------


def lm_head_partials(vocab_size: int) -> int:
    """Number of (value, index) partials LmHead writes: one per 32 rows."""
    return -(-vocab_size // LM_ROWS_PER_BLOCK)


class LmHead(Launcher):
    """logits fp32 [V] = W x (W fp16 [V, D]) and per-32-row argmax partials (part_val, part_idx)."""

    def __init__(self, logits, part_val, part_idx, x, weight, *, vocab_size: int, dim: int,
                 stream: Stream | None = None):
        assert dim % 8 == 0, dim
        n_part = lm_head_partials(vocab_size)
        _check(logits, "logits", vocab_size, np.float32)
        _check(part_val, "part_val", n_part, np.float32)
        _check(part_idx, "part_idx", n_part, np.int32)
        _check(x, "x", dim, np.float16)
        _check(weight, "weight", vocab_size * dim, np.float16)
        self.n_partials = n_part
        self.launches = [KernelLaunch(_fn("gemv_f16", "gemv_f16_lm_head"), (n_part,), (LM_THREADS,),
                                      [logits, part_val, part_idx, x, weight, _i32(vocab_size), _i32(dim)],
                                      stream=stream)]
        self.bytes_moved = vocab_size * dim * 2 + 2 * dim + 4 * vocab_size


class ArgmaxFinal(Launcher):
    """next_token int32 [1] = the index of the best (value, index) pair (LmHead's partials)."""

    def __init__(self, next_token, part_val, part_idx, *, n_partials: int, stream: Stream | None = None):
        _check(next_token, "next_token", 1, np.int32)
        _check(part_val, "part_val", n_partials, np.float32)
        _check(part_idx, "part_idx", n_partials, np.int32)
        self.launches = [KernelLaunch(_fn("argmax", "argmax_final"), (1,), (ARGMAX_THREADS,),
                                      [next_token, part_val, part_idx, _i32(n_partials)], stream=stream)]
        self.bytes_moved = 8 * n_partials + 4


class Argmax(Launcher):
    """next_token int32 [1] = argmax(logits fp32 [V]) (lowest index on ties), two passes.

    part_val fp32 / part_idx int32 scratch of `n_partials` entries (e.g. 264: two per SM).
    """

    def __init__(self, next_token, logits, part_val, part_idx, *, vocab_size: int, n_partials: int,
                 stream: Stream | None = None):
        chunk = -(-vocab_size // n_partials)
        _check(logits, "logits", vocab_size, np.float32)
        _check(part_val, "part_val", n_partials, np.float32)
        _check(part_idx, "part_idx", n_partials, np.int32)
        _check(next_token, "next_token", 1, np.int32)
        self.launches = [
            KernelLaunch(_fn("argmax", "argmax_partial"), (n_partials,), (ARGMAX_THREADS,),
                         [part_val, part_idx, logits, _i32(vocab_size), _i32(chunk)], stream=stream),
            KernelLaunch(_fn("argmax", "argmax_final"), (1,), (ARGMAX_THREADS,),
                         [next_token, part_val, part_idx, _i32(n_partials)], stream=stream),
        ]
        self.bytes_moved = 4 * vocab_size + 16 * n_partials + 4


class AdvanceState(Launcher):
    """state[1] = next_token[0]; state[0] += 1; state[2] += 1 (the decode graph's last node)."""

    def __init__(self, state, next_token, *, stream: Stream | None = None):
        _check(state, "state", 3, np.int32)
        _check(next_token, "next_token", 1, np.int32)
        self.launches = [KernelLaunch(_fn("decode_state", "advance_state"), (1,), (1,),
                                      [state, next_token], stream=stream)]
        self.bytes_moved = 16


# --- prefill: gemm_int4.cu ------------------------------------------------------------------------

GEMM_BM = 64                     # gemm_int4.cu: tokens per block
GEMM_THREADS = 128               # gemm_int4.cu: 4 warps
GEMM_BLOCK_TILES = 8             # gemm_int4.cu: 16-row weight tiles per block (128 rows)
GEMM_TILE_ROWS = 16
# gemm_int4.cu GEMM_SMEM_BYTES: 4 stages × (64 tokens × 256 B of activations + 128 rows × 64 B
# of INT4 weights) = 96 KiB (above the 48 KiB default: KernelLaunch opts in).
GEMM_SMEM_BYTES = 4 * (GEMM_BM * 256 + GEMM_BLOCK_TILES * GEMM_TILE_ROWS * 64)


def _gemm_grid(rows: int, n_blocks: int) -> tuple[int, int]:
    assert rows >= 1 and n_blocks >= 1
    return (-(-rows // GEMM_BM), n_blocks)


def _check_prefill_state(prefill_state) -> None:
    _check(prefill_state, "prefill_state", 2, np.int32)


class _GemmLauncher(Launcher):
    """Shared by the gemm_int4 launchers. `flops` is 2·rows·N·K at full capacity (rows tokens)."""

    flops: int = 0

    def _build(self, kernel: str, rows: int, n_blocks: int, k: int, params: list, stream) -> None:
        assert k % GROUP_SIZE == 0 and k > 0, f"K={k} must be a positive multiple of {GROUP_SIZE}"
        self.launches = [KernelLaunch(_fn("gemm_int4", kernel), _gemm_grid(rows, n_blocks), (GEMM_THREADS,),
                                      params, smem_bytes=GEMM_SMEM_BYTES, stream=stream)]


class GemmInt4(_GemmLauncher):
    """out fp32 [M, N] = x fp16 [M, K] · Wᵀ (W INT4 layout id 1 [N, K]), M = prefill_state[1] ≤ rows.

    `rows` is the capacity (buffers are [rows, …]); the kernel reads the live row count from
    prefill_state int32 [2] = (start, n_rows) and writes only rows < n_rows.
    """

    def __init__(self, out, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 stream: Stream | None = None):
        _check(out, "out", rows * n, np.float32)
        _check(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        _check_prefill_state(prefill_state)
        self._build("gemm_int4_f32", rows, -(-_tiles(n) // GEMM_BLOCK_TILES), k,
                    [out, x, qweight, scales, prefill_state, _i32(n), _i32(k)], stream)
        self.flops = 2 * rows * n * k
        self.bytes_moved = _int4_bytes(n, k) + 2 * rows * k + 4 * rows * n


class GemmInt4QkvRows(_GemmLauncher):
    """qkv fp32 [M, Nq + 2 Nkv] = x [Wq; Wk; Wv]ᵀ for the rows of a prefill chunk (one launch)."""

    def __init__(self, qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                 prefill_state, *, n_q: int, n_kv: int, k: int, rows: int, stream: Stream | None = None):
        assert n_q % GEMM_TILE_ROWS == 0 and n_kv % GEMM_TILE_ROWS == 0, (n_q, n_kv)
        _check(qkv, "qkv", rows * (n_q + 2 * n_kv), np.float32)
        _check(x, "x", rows * k, np.float16)
        _check_int4(q_qweight, q_scales, "q_proj", n_q, k)
        _check_int4(k_qweight, k_scales, "k_proj", n_kv, k)
        _check_int4(v_qweight, v_scales, "v_proj", n_kv, k)
        _check_prefill_state(prefill_state)
        tiles = _tiles(n_q) + 2 * _tiles(n_kv)
        self._build("gemm_int4_qkv", rows, -(-tiles // GEMM_BLOCK_TILES), k,
                    [qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, prefill_state,
                     _i32(n_q), _i32(n_kv), _i32(k)], stream)
        self.flops = 2 * rows * (n_q + 2 * n_kv) * k
        self.bytes_moved = _int4_bytes(n_q + 2 * n_kv, k) + 2 * rows * k + 4 * rows * (n_q + 2 * n_kv)


class GemmInt4ResidualRows(_GemmLauncher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ (o_proj, down_proj of a prefill chunk)."""

    def __init__(self, residual, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 stream: Stream | None = None):
        _check(residual, "residual", rows * n, np.float32)
        _check(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        _check_prefill_state(prefill_state)
        self._build("gemm_int4_residual", rows, -(-_tiles(n) // GEMM_BLOCK_TILES), k,
                    [residual, x, qweight, scales, prefill_state, _i32(n), _i32(k)], stream)
        self.flops = 2 * rows * n * k
        self.bytes_moved = _int4_bytes(n, k) + 2 * rows * k + 8 * rows * n


class GemmInt4GateUpSwigluRows(_GemmLauncher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ): gate_proj, up_proj and SwiGLU of a prefill chunk."""

    def __init__(self, h, x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state, *,
                 f: int, k: int, rows: int, stream: Stream | None = None):
        _check(h, "h", rows * f, np.float16)
        _check(x, "x", rows * k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        _check_prefill_state(prefill_state)
        # A block holds 8 tiles = the same 4 feature tiles of gate and of up.
        self._build("gemm_int4_gate_up_swiglu", rows, -(-_tiles(f) // (GEMM_BLOCK_TILES // 2)), k,
                    [h, x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state, _i32(f), _i32(k)],
                    stream)
        self.flops = 2 * rows * 2 * f * k
        self.bytes_moved = 2 * _int4_bytes(f, k) + 2 * rows * k + 2 * rows * f


# --- prefill: rope_kv.cu / attention_prefill.cu / prefill_state.cu --------------------------------


class RopeKvRows(Launcher):
    """Bias + RoPE of q and k for the rows of a prefill chunk, and their K/V written into the
    paged cache at positions start … start + n_rows - 1 (prefill_state), as RopeKv does per token.

    q_out fp16 [rows, Hq, Dh]; qkv fp32 [rows, Nq + 2 Nkv] (GemmInt4QkvRows' output); k_cache /
    v_cache one layer [P, Hkv, 16, Dh]; block_table int32 [max_pages] with a page for every
    position written.
    """

    def __init__(self, q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, prefill_state,
                 block_table, *, rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 stream: Stream | None = None):
        assert head_dim % 2 == 0 and head_dim // 2 <= 1024, head_dim
        nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
        _check(q_out, "q_out", rows * nq, np.float16)
        _check(qkv, "qkv", rows * (nq + 2 * nkv), np.float32)
        _check(q_bias, "q_bias", nq, np.float16)
        _check(k_bias, "k_bias", nkv, np.float16)
        _check(v_bias, "v_bias", nkv, np.float16)
        _check(inv_freq, "inv_freq", head_dim // 2, np.float32)
        _check_prefill_state(prefill_state)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            shape = getattr(c, "shape", None)
            if shape is not None:
                assert tuple(shape[1:]) == (n_kv_heads, PAGE_TOKENS, head_dim), (name, shape)
        self.launches = [KernelLaunch(
            _fn("rope_kv", "rope_kv_rows"), (n_heads + 2 * n_kv_heads, rows), (head_dim // 2,),
            [q_out, k_cache, v_cache, qkv, q_bias, k_bias, v_bias, inv_freq, prefill_state, block_table,
             _i32(n_heads), _i32(n_kv_heads), _i32(head_dim)],
            stream=stream)]
        self.bytes_moved = rows * (4 * (nq + 2 * nkv) + 2 * (nq + 2 * nkv))


APF_QTILE = 16                   # attention_prefill.cu: queries per block
APF_KV_TILE = 64                 # attention_prefill.cu: positions per pipeline step
APF_STAGES = 2
APF_MAX_GROUP = 8                # attention_prefill.cu: warps per block (query heads per KV head)


def attention_prefill_smem_bytes(head_dim: int) -> int:
    """attention_prefill.cu ApfShape::SMEM_BYTES: stages × (K, V) × 64 padded token rows."""
    return APF_STAGES * 2 * APF_KV_TILE * (2 * head_dim + 16)


class AttentionPrefill(Launcher):
    """out fp16 [rows, Hq, Dh] = causal softmax(q Kᵀ/√Dh) V for the chunk rows r < n_rows at
    positions start + r (prefill_state), over a layer's paged cache [P, Hkv, 16, Dh]."""

    def __init__(self, out, q, k_cache, v_cache, block_table, prefill_state, *, rows: int, n_heads: int,
                 n_kv_heads: int, head_dim: int, stream: Stream | None = None):
        if head_dim not in ATTN_HEAD_DIMS:
            raise ValueError(f"attention_prefill is built for head_dim in {ATTN_HEAD_DIMS}, got {head_dim}")
        group = n_heads // n_kv_heads
        assert n_heads % n_kv_heads == 0 and 1 <= group <= APF_MAX_GROUP, (n_heads, n_kv_heads)
        _check(out, "out", rows * n_heads * head_dim, np.float16)
        _check(q, "q", rows * n_heads * head_dim, np.float16)
        _check_prefill_state(prefill_state)
        self.launches = [KernelLaunch(
            _fn("attention_prefill", f"attention_prefill_hd{head_dim}"), (-(-rows // APF_QTILE), n_kv_heads),
            (32 * group,), [out, q, k_cache, v_cache, block_table, prefill_state, _i32(n_heads), _i32(n_kv_heads)],
            smem_bytes=attention_prefill_smem_bytes(head_dim), stream=stream)]
        self.n_heads, self.head_dim = n_heads, head_dim

    def flops_for(self, start: int, n_rows: int) -> int:
        """QKᵀ and PV multiply-adds actually needed (causal) for a chunk, ×2 FLOPs each."""
        keys = n_rows * start + n_rows * (n_rows + 1) // 2
        return 2 * 2 * self.n_heads * self.head_dim * keys


class PrefillBeginChunk(Launcher):
    """prefill_state int32 [2] = (start, n_rows), queued on the stream (`set` before `launch`)."""

    def __init__(self, prefill_state, *, stream: Stream | None = None):
        _check_prefill_state(prefill_state)
        self.launches = [KernelLaunch(_fn("prefill_state", "prefill_begin_chunk"), (1,), (1,),
                                      [prefill_state, _i32(0), _i32(0)], stream=stream)]

    def set(self, start: int, n_rows: int) -> "PrefillBeginChunk":
        self.launches[0].set_param(1, _i32(start))
        self.launches[0].set_param(2, _i32(n_rows))
        return self


class DecodeResume(Launcher):
    """state int32 [3] = (pos, next_token[0], pos + 1): decoding continues after a prefill."""

    def __init__(self, state, next_token, *, stream: Stream | None = None):
        _check(state, "state", 3, np.int32)
        _check(next_token, "next_token", 1, np.int32)
        self.launches = [KernelLaunch(_fn("prefill_state", "decode_resume"), (1,), (1,),
                                      [state, next_token, _i32(0)], stream=stream)]

    def set(self, pos: int) -> "DecodeResume":
        self.launches[0].set_param(2, _i32(pos))
        return self


# --- sampling.cu ----------------------------------------------------------------------------------

SAMPLE_THREADS = 1024            # sampling.cu: one block, a thread per histogram bin
SAMPLER_PARAMS_BYTES = 32        # sampling.cu struct SamplerParams
SAMPLE_INFO = 4                  # sampling.cu: info = (token, Philox x, kept count, token_index)


class SampleToken(Launcher):
    """next_token int32 [1] = sampler.sample(logits, params, uniform(seed, token_index)), with the
    parameters and the step in device memory (`params`: SAMPLER_PARAMS_BYTES, engine.pack_sampler_params).

    info int32 [4] gets (token, the 32-bit Philox draw, the kept-set size, token_index) for tests.
    """

    def __init__(self, next_token, info, params, logits, *, vocab_size: int, stream: Stream | None = None):
        _check(next_token, "next_token", 1, np.int32)
        _check(info, "info", SAMPLE_INFO, np.int32)
        _check(params, "params", SAMPLER_PARAMS_BYTES, np.uint8)
        _check(logits, "logits", vocab_size, np.float32)
        self.launches = [KernelLaunch(_fn("sampling", "sample_token"), (1,), (SAMPLE_THREADS,),
                                      [next_token, info, params, logits, _i32(vocab_size)], stream=stream)]
        self.bytes_moved = 10 * 4 * vocab_size  # at most 10 passes over the logits (L2)


class PublishToken(Launcher):
    """host_ring[token_index % ring_size] = next_token[0]; token_index += 1 (params).

    host_ring: page-locked host memory (cuda.PinnedHostBuffer) — the kernel writes it through
    its unified address, so the host reads each token without a device-to-host copy.
    """

    def __init__(self, host_ring, params, next_token, *, ring_size: int, stream: Stream | None = None):
        _check(params, "params", SAMPLER_PARAMS_BYTES, np.uint8)
        _check(next_token, "next_token", 1, np.int32)
        assert ring_size >= 1
        self.launches = [KernelLaunch(_fn("sampling", "publish_token"), (1,), (1,),
                                      [host_ring, params, next_token, _i32(ring_size)], stream=stream)]


__all__: Sequence[str] = (
    "AdvanceState", "Argmax", "ArgmaxFinal", "AttentionDecode", "AttentionPrefill", "DecodeResume",
    "Embedding", "EmbeddingRows", "GemmInt4", "GemmInt4GateUpSwigluRows", "GemmInt4QkvRows",
    "GemmInt4ResidualRows", "GemvInt4", "GemvInt4GateUpSwiglu", "GemvInt4Qkv", "GemvInt4Residual",
    "Launcher", "LmHead", "PrefillBeginChunk", "PublishToken", "RmsNorm", "RopeKv", "RopeKvRows",
    "SampleToken", "attention_blocks_per_kv_head", "attention_partial_shapes",
    "attention_prefill_smem_bytes", "blocks_per_sm", "gemv_launch_shape", "kv_layer_view",
    "lm_head_partials",
)


# --- decode_state.cu: graph B's block-table write (issue 5, CUDA graphs) -------------------------


class SetBlockTableEntry(Launcher):
    """block_table[state[0] // 16] = new_page[0]: graph B's first node (graphs.py).

    The host hands the newly allocated physical page over in the device scalar `new_page`
    (int32 [1]); the logical page comes from the device position, so the launch's parameters
    never change and the captured graph is replayed as is.
    """

    def __init__(self, block_table, new_page, state, *, n_pages: int, stream: Stream | None = None):
        _check(block_table, "block_table", n_pages, np.int32)
        _check(new_page, "new_page", 1, np.int32)
        _check(state, "state", 3, np.int32)
        self.launches = [KernelLaunch(_fn("decode_state", "set_block_table_entry"), (1,), (1,),
                                      [block_table, new_page, state, _i32(n_pages)], stream=stream)]
        self.bytes_moved = 12


__all__ = (*__all__, "SetBlockTableEntry")


# --- attention_decode_tma.cu: warp-specialised TMA decode attention (issue 6) --------------------


ATMA_CONSUMERS = 4               # attention_decode_tma.cu: consumer warps (= splits) per block
ATMA_STAGES = 3                  # attention_decode_tma.cu: ring stages per consumer warp
ATMA_THREADS = 32 * (ATMA_CONSUMERS + 1)   # + the producer warp


def attention_tma_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of attention_decode_tma (AtmaShape::SMEM_BYTES), its whole footprint:
    consumers × stages × (K page + V page) of one head, 16 × Dh fp16 each (96 KiB at Dh = 128,
    48 KiB at Dh = 64), then the consumers' p [16][8] and alpha [8] fp32 and 2 mbarriers per stage."""
    stages = ATMA_CONSUMERS * ATMA_STAGES * 2 * PAGE_TOKENS * head_dim * 2
    return stages + ATMA_CONSUMERS * (PAGE_TOKENS + 1) * ATTN_MAX_GROUP * 4 + 2 * ATMA_CONSUMERS * ATMA_STAGES * 8


def kv_tensor_map(cache: DeviceArray):
    """The TMA descriptor of a whole KV pool [..., 16, Dh] fp16 seen as a [rows, Dh] matrix.

    One box is [16, Dh]: one page of one KV head (row ((layer·P + page)·Hkv + head)·16). Built
    once per pool (cuTensorMapEncodeTiled costs ~60 µs from Python) and kept for the pool's life.
    """
    from .cuda import encode_tiled_2d

    *outer, page_tokens, head_dim = cache.shape
    assert page_tokens == PAGE_TOKENS and np.dtype(cache.dtype) == np.float16, (cache.shape, cache.dtype)
    rows = math.prod(outer) * PAGE_TOKENS
    assert rows < 2**31, f"{rows} rows: TMA coordinates are int32"
    return encode_tiled_2d(cache.ptr, np.float16, (rows, head_dim), (PAGE_TOKENS, head_dim))


def attention_tma_blocks_per_kv_head(n_kv_heads: int, max_tokens: int, head_dim: int,
                                     sm_count: int | None = None) -> int:
    """S, attention_decode_tma's blocks per KV head (grid (S, Hkv), ATMA_CONSUMERS splits each).

    Every resident block slot gets a block (occupancy from the kernel's registers and its
    96/48 KiB of stages: 2 blocks per SM at Dh = 128, 4 at Dh = 64), so every SM keeps
    CONSUMERS × STAGES pages in flight per block; no more warps than pages at the longest
    context. The split count thus follows the SM count (H200: 66 blocks per KV head at 7B).
    """
    registers = _fn("attention_decode_tma", f"attention_decode_tma_hd{head_dim}").num_registers
    per_sm = max(1, blocks_per_sm(registers, ATMA_THREADS, attention_tma_smem_bytes(head_dim)))
    return _split_blocks_per_kv_head(n_kv_heads, max_tokens, per_sm, ATMA_CONSUMERS, sm_count)


class AttentionDecodeTma(Launcher):
    """out fp16 [Hq, Dh] = softmax(q Kᵀ/√Dh) V over positions < state[2] of a paged cache,
    by the warp-specialised TMA kernel (attention_decode_tma.cu).

    Two launches: attention_decode_tma_hd{Dh} (per-consumer-warp split partials) and the plain
    kernel's attention_combine (same partial layout). k_map / v_map are kv_tensor_map(...) of
    the whole K and V pools, encoded once; `layer_page0` = layer × pages per layer selects the
    layer (0 for a one-layer cache). AttentionDecode stays the reference and the fallback.
    """

    def __init__(self, out, q, k_map, v_map, block_table, state, o_part, m_part, l_part, *,
                 n_heads: int, n_kv_heads: int, head_dim: int, blocks_per_kv_head: int,
                 layer_page0: int = 0, stream: Stream | None = None):
        if head_dim not in ATTN_HEAD_DIMS:
            raise ValueError(f"attention_decode_tma is built for head_dim in {ATTN_HEAD_DIMS}, got {head_dim}")
        assert n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= ATTN_MAX_GROUP, (n_heads, n_kv_heads)
        for name, m in (("k_map", k_map), ("v_map", v_map)):
            assert tuple(m.box) == (PAGE_TOKENS, head_dim) and m.dtype == np.float16, (name, m)
            assert (layer_page0 * n_kv_heads + 1) * PAGE_TOKENS <= m.shape[0], (name, layer_page0, m)
        shapes = attention_partial_shapes(n_heads, head_dim, blocks_per_kv_head, ATMA_CONSUMERS)
        _check(out, "out", n_heads * head_dim, np.float16)
        _check(q, "q", n_heads * head_dim, np.float16)
        _check(state, "state", 3, np.int32)
        for name, buf in (("o_part", o_part), ("m_part", m_part), ("l_part", l_part)):
            _check(buf, name, math.prod(shapes[name]), np.float32)
        n_splits = blocks_per_kv_head * ATMA_CONSUMERS
        self.n_splits = n_splits
        self.launches = [
            KernelLaunch(_fn("attention_decode_tma", f"attention_decode_tma_hd{head_dim}"),
                         (blocks_per_kv_head, n_kv_heads), (ATMA_THREADS,),
                         [o_part, m_part, l_part, q, k_map, v_map, block_table, state,
                          _i32(n_heads), _i32(n_kv_heads), _i32(layer_page0)],
                         smem_bytes=attention_tma_smem_bytes(head_dim), stream=stream),
            KernelLaunch(_fn("attention_decode", "attention_combine"), (n_heads,),
                         (ATTN_COMBINE_THREADS,),
                         [out, o_part, m_part, l_part, state, _i32(n_splits), _i32(n_heads),
                          _i32(head_dim)], smem_bytes=2 * 4 * n_splits, stream=stream),
        ]
        self.kv_bytes_per_token = 2 * n_kv_heads * head_dim * 2  # K and V, fp16

    def bytes_for(self, seq_len: int) -> int:
        """KV bytes read at a given length (the partials are L2 traffic, not counted)."""
        return seq_len * self.kv_bytes_per_token


__all__ = (*__all__, "AttentionDecodeTma", "attention_tma_blocks_per_kv_head",
           "attention_tma_smem_bytes", "kv_tensor_map")
