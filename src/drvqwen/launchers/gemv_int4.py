"""Launchers of kernels/gemv_int4.cu: the decode GEMVs over INT4 (layout id 1) weights.

    GemvInt4               y fp16 [N]          = W x
    GemvInt4QkvRope        q fp16 [Hq·Dh], K/V cache slot of state[0]
                                               = rope([Wq; Wk; Wv] rmsnorm(residual) + bias)
    GemvInt4Residual       residual fp32 [N]  += W x                        (o_proj, down_proj)
    GemvInt4GateUpSwiglu   h fp16 [F]          = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)

The last three take `n_tokens=T` (T ≤ 16) for the verify pass of speculative decoding: the
`…_tokens` kernels, every per-token buffer [T, …], token j at position state[0] + j, each token's
outputs bit for bit the single-token kernel's (gemv_int4.cu, "T tokens"). Such a launch has the
single-token launch's grid and block: its W warps split K the same way, and W is the only launch
parameter in the arithmetic.

W is INT4 layout id 1 (format/quant.py) in the device layout: qweight uint32 [ceil(N/16), K/128,
16, 16] tile-major (format/int4_tiles.py; q, k and v RoPE-paired by the head dim, the others
plain) and scales fp16 [N, K/128] as in the file.
Every kernel of the file waits for its predecessor with griddepcontrol.wait (ptx/griddep.cuh),
so the decode step launches them as programmatic dependents (KernelRef.pdl).

The launch shape (`gemv_launch_shape`): the kernel's work is 16-row tiles × K groups, blocks
own contiguous ranges of tiles and their W warps split K. The grid spreads the tiles evenly
over the SMs in one wave, with the resident blocks per SM taken from the occupancy it is given
(the driver's, by default), so it can be evaluated — and tested — without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..cuda import Stream
from ..format.int4_tiles import device_words
from ..format.quant import GROUP_SIZE
from ..kv_cache import PAGE_TOKENS
from .base import (DEFAULT_OCCUPANCY, KernelRef, Launcher, Occupancy, check_buffer, check_state, f32, i32, mirrored,
                   require)

TILE_ROWS = mirrored("gemv_int4", "INT4_TILE_ROWS", 16)   # output rows per tile (M of one MMA)
MAX_WARPS = mirrored("gemv_int4", "GEMV_MAX_WARPS", 8)    # K-split warps per block
mirrored("gemv_int4", "INT4_GROUP", GROUP_SIZE)
MMA_TOKENS = mirrored("gemv_int4", "GEMV_MMA_TOKENS", 8)   # tokens per MMA (its N)
TOKENS_BUILT = mirrored("gemv_int4", "GEMV_TOKENS", 8)     # the T-token kernels' bound, default build
MAX_TOKENS = 2 * MMA_TOKENS                                # the bound of the -DGEMV_TOKENS=16 build
X_TOKEN_PAD_BYTES = 16 * mirrored("gemv_int4", "GEMV_X_TOKEN_PAD", 4)  # after each token's x in shared memory
# Dynamic shared memory a block may opt in to on sm_90 (227 KiB), less 1 KiB for the kernels'
# static shared memory (the RMSNorm sums, 256 B).
MAX_DYNAMIC_SMEM_BYTES = 227 * 1024 - 1024
# qkv_rope's other build: batches of 2 groups (80 registers) instead of GEMV_UNROLL's 4 (128), so
# 3 blocks fit an SM. Where that gives each block fewer tiles (the 7B's 288 tiles one a block, grid
# 288 instead of 144 blocks of two) the GEMV, too small to keep HBM busy, gains warps; where the
# grid stays (the 0.5B's 72 tiles) it only loses bytes in flight, as o_proj and down_proj do
# (tools/bench_gemv.py --pdl --unroll, kernels/gemv_int4.cu's header). qkv_rope_defines picks.
# With the one-pass RMSNorm prologue (rmsnorm.cuh), the 7B's qkv_rope as a programmatic dependent
# on one H100: 6.60 µs in this build at 288 blocks against 7.16 in the default at 144
# (tools/bench_gemv.py --preset 7b --gemv qkv_proj --unroll 2 4 --pdl;
# docs/bench/2026-12-07_3af20d8_h100_bench_gemv_7b_int4_qkv_unroll.json).
# The same W, so the same sums as the persistent step's items; the T-token twins are built and
# launched alike (layer_plan.py: the verify pass's layer is the decode step's).
QKV_ROPE_DEFINES = (("GEMV_UNROLL", 2),)

def tiles(n: int) -> int:
    """16-row tiles covering n rows."""
    return -(-n // TILE_ROWS)


def int4_bytes(n: int, k: int) -> int:
    """Bytes of an INT4 [N, K] matrix with its fp16 group scales."""
    return n * k // 2 + n * (k // GROUP_SIZE) * 2


def gemv_smem_bytes(k: int, tiles_per_block: int, warps: int, mt: int) -> int:
    """Dynamic shared memory of a gemv_int4 block: x in fp16 (2K bytes), then the warps'
    per-row partial sums, tiles_per_block × MT matrices × W warps × 16 rows × fp32."""
    return 2 * k + tiles_per_block * mt * warps * TILE_ROWS * 4


def gemv_tokens_smem_bytes(k: int, tiles_per_block: int, warps: int, mt: int, n_tokens: int,
                           x_staged: bool) -> int:
    """Dynamic shared memory of a T-token gemv_int4 block: x of the T tokens, K·2 bytes each plus
    64 bytes of padding, where the kernel stages it (not gemv_int4_residual_tokens), then the
    partials, tiles_per_block × MT × W × T × 16 rows × fp32."""
    x_bytes = n_tokens * (2 * k + X_TOKEN_PAD_BYTES) if x_staged else 0
    return x_bytes + tiles_per_block * mt * warps * n_tokens * TILE_ROWS * 4


def token_count(n_tokens: int | None, kernel: str = "gemv_int4") -> int:
    """T of a launch: 1 for the single-token kernels (n_tokens None), else n_tokens (the verify
    pass's other T-token kernels share the bound; `kernel` names the caller in the error).

    Raises:
        LaunchError: T outside 1..16.
    """
    if n_tokens is None:
        return 1
    require(1 <= n_tokens <= MAX_TOKENS, f"{kernel}: n_tokens={n_tokens} must be within 1..{MAX_TOKENS}")
    return n_tokens


def tokens_defines(n_tokens: int) -> tuple[tuple[str, int], ...]:
    """The build of the T-token kernels for T tokens (1..16): the default (GEMV_TOKENS = 8) up to
    8, else the GEMV_TOKENS = 16 one."""
    return () if n_tokens <= TOKENS_BUILT else (("GEMV_TOKENS", MAX_TOKENS),)


def gemv_launch_shape(n_tiles: int, k: int, mt: int, blocks_per_sm: Callable[[int, int], int], sm_count: int,
                      warps: int | None = None, blocks: int | None = None,
                      extra_smem: int = 0) -> tuple[int, int, int]:
    """(grid blocks G, threads per block 32·W, dynamic shared memory bytes) of a gemv_int4 kernel.

    Each block owns ceil-or-floor(T/G) consecutive 16-row tiles and its W warps split the K
    groups (gemv_int4.cu). W is the most the kernel allows, min(8, K/128): measured on the H200
    it is the fastest for every 7B GEMV (fewer blocks stage x, more loads in flight per block;
    gemv_int4.cu's table). The resident block count, blocks_per_sm(threads, smem) × sm_count,
    caps G so that all blocks run in one wave; with makespan m = ceil(T / G_max) tiles per
    block, G = ceil(T / m) (no more blocks than the makespan needs). Not always the fastest
    spread of that makespan: the 7B's qkv (T = 288, m = 2, G = 144) took 8.53 µs, and 8.21 /
    8.10 / 8.10 / 8.35 µs with G forced to 168 / 200 / 232 / 264 (`tools/bench_gemv.py --pdl
    --blocks …`, two runs agreeing, docs/bench/2026-12-04_b873b61_h200_gemv_int4_blocks_7b_{1,2}.json),
    while gate_up (T = 1184, m = 5, G = 237) took 22.39 µs and 22.76 µs at 264. (qkv_rope's other
    build, QKV_ROPE_DEFINES, fits three blocks an SM: G = 288, one tile a block; qkv_rope_defines.)

    Args:
        n_tiles: T, 16-row tiles of the output (all matrices stacked, gate/up counted once).
        k: K, a multiple of 128.
        mt: matrices read per tile (2 for gate/up, else 1).
        blocks_per_sm: (threads, dynamic smem bytes) → resident blocks per SM (occupancy).
        sm_count: SMs of the GPU.
        warps, blocks: force W or G (benchmark variants), e.g. blocks=n_tiles for one tile per block.
        extra_smem: dynamic shared memory a block needs besides x and the partials (gemv_fmt's
            per-chunk sums of x).
    Raises:
        LaunchError: `warps` outside 1..min(8, K/128), or a block of W warps cannot run at all.
    """
    if blocks is None:
        resident, threads = gemv_resident_blocks(k, mt, blocks_per_sm, sm_count, warps, extra_smem)
        g = min(n_tiles, resident)
    else:
        threads = 32 * _warps(k, warps)
        g = min(blocks, n_tiles)
    per_block = -(-n_tiles // g)
    if blocks is None:
        g = -(-n_tiles // per_block)
    return g, threads, gemv_smem_bytes(k, per_block, threads // 32, mt) + extra_smem


def qkv_rope_defines(n_tiles: int, k: int, occupancy: Occupancy | None = None, warps: int | None = None,
                     blocks: int | None = None) -> tuple[tuple[str, int], ...]:
    """The build of gemv_int4_qkv_rope for n_tiles tiles of K inputs: QKV_ROPE_DEFINES where its
    occupancy gives each block fewer tiles than the default build's (more blocks of 8 warps for
    the same bytes), else the default (); a forced grid (`blocks`) keeps the default."""
    if blocks is not None:
        return ()
    occ = occupancy or DEFAULT_OCCUPANCY

    def tiles_per_block(defines: tuple) -> int:
        ref = _kernel("gemv_int4_qkv_rope", defines)
        g, _t, _s = gemv_launch_shape(n_tiles, k, 1, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count,
                                      warps=warps)
        return -(-n_tiles // g)

    return QKV_ROPE_DEFINES if tiles_per_block(QKV_ROPE_DEFINES) < tiles_per_block(()) else ()


def _warps(k: int, warps: int | None) -> int:
    groups = k // GROUP_SIZE
    w = min(MAX_WARPS, groups) if warps is None else warps
    require(1 <= w <= min(MAX_WARPS, groups), f"gemv_int4: no launch shape for K={k} with warps={warps}")
    return w


def gemv_resident_blocks(k: int, mt: int, blocks_per_sm: Callable[[int, int], int], sm_count: int,
                         warps: int | None = None, extra_smem: int = 0) -> tuple[int, int]:
    """(blocks resident in one wave, threads per block 32·W) of a gemv_int4-shaped kernel: W as in
    gemv_launch_shape, blocks_per_sm(32·W, smem of a one-tile block) × sm_count (at least 1).

    Raises:
        LaunchError: `warps` outside 1..min(8, K/128), or a block of W warps cannot run at all.
    """
    w = _warps(k, warps)
    occ = blocks_per_sm(32 * w, gemv_smem_bytes(k, 1, w, mt) + extra_smem)
    require(occ >= 1, f"gemv_int4: a block of {w} warps does not fit on an SM (K={k})")
    return max(1, occ * sm_count), 32 * w


def check_qkv_rope_outputs(kernel: str, q_out, k_cache, v_cache, n_heads: int, n_kv_heads: int,
                           head_dim: int, n_tokens: int = 1, head_dim_multiple: int = TILE_ROWS) -> None:
    """The outputs of every launch that writes rotated q and the K/V cache: q fp16 [T, Hq·Dh]
    (T = n_tokens: 1 for a decode GEMV, the chunk's rows in prefill) and one layer's paged K/V
    cache [P, Hkv, 16, Dh], with Dh a multiple of `head_dim_multiple` (the GEMVs' 16-row tile:
    a tile holds 8 RoPE pairs of one head; 2 for the prefill's row kernels, which take any pair).

    Raises:
        LaunchError: naming `kernel` and the buffer.
    """
    why = " (a tile holds 8 RoPE pairs of one head)" if head_dim_multiple == TILE_ROWS else ""
    require(head_dim > 0 and head_dim % head_dim_multiple == 0,
            f"{kernel}: head_dim={head_dim} must be a multiple of {head_dim_multiple}{why}")
    check_buffer(q_out, "q_out", n_tokens * n_heads * head_dim, np.float16)
    for what, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        shape = getattr(c, "shape", None)
        require(shape is None or tuple(shape[1:]) == (n_kv_heads, PAGE_TOKENS, head_dim),
                f"{kernel}: {what} {getattr(c, 'name', '')} is {list(shape or ())}, want one layer "
                f"[P, {n_kv_heads}, {PAGE_TOKENS}, {head_dim}]")


def _kernel(name: str, defines: tuple = ()) -> KernelRef:
    return KernelRef("gemv_int4", name, tuple(defines), pdl=True)


def _check_int4(qweight, scales, what: str, n: int, k: int) -> None:
    """An INT4 weight as the kernels read it: qweight in the device layout (format/int4_tiles.py:
    rows padded to a 16-row tile), scales [n, k/128] as in the file."""
    check_buffer(qweight, f"{what}.qweight", device_words(n, k), np.uint32)
    check_buffer(scales, f"{what}.scales", n * (k // GROUP_SIZE), np.float16)


class _GemvInt4Launcher(Launcher):
    """Shared by the gemv_int4 launchers: the launch shape from the kernel's occupancy.

    Every launcher takes, besides its buffers: occupancy (blocks per SM and SM count for the
    grid; default the driver's), warps / blocks (force the launch shape) and defines
    (compile-time variants such as (("GEMV_UNROLL", 8),)) — the last three for benchmarks.
    """

    def _build_gemv(self, kernel: str, n_tiles: int, k: int, mt: int, args: dict, *, reads, writes,
                    occupancy: Occupancy | None, warps: int | None, blocks: int | None, defines: tuple,
                    n_tokens: int | None = None, x_staged: bool = True, tokens_kernel: str | None = None,
                    weights: tuple = (), weights_rows: int = 0) -> None:
        """Plan `kernel` (n_tokens None) or its `…_tokens` twin for n_tokens tokens (args then get
        n_tokens; `tokens_kernel` names another twin, e.g. the …_x_tokens ones), in the launch shape
        of `kernel`: the same grid and W, so the same sums. `weights`: the (qweight, scales) pairs
        of weights_rows rows read tile by tile in row order (Launcher.weight_tiles; not the
        RoPE-paired qkv tiles)."""
        require(k > 0 and k % GROUP_SIZE == 0, f"gemv_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
        require(n_tiles >= 1, "gemv_int4: N must be >= 1")
        occ = occupancy or DEFAULT_OCCUPANCY
        ref = _kernel(kernel, defines)
        grid, threads, smem = gemv_launch_shape(
            n_tiles, k, mt, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count, warps=warps, blocks=blocks)
        if n_tokens is not None:
            smem = gemv_tokens_smem_bytes(k, -(-n_tiles // grid), threads // 32, mt, n_tokens, x_staged)
            require(smem <= MAX_DYNAMIC_SMEM_BYTES, f"{kernel}_tokens: {n_tokens} tokens at K={k} need {smem} B of "
                                                    f"shared memory per block, more than {MAX_DYNAMIC_SMEM_BYTES}")
            ref = _kernel(tokens_kernel or f"{kernel}_tokens", tuple(defines) + tokens_defines(n_tokens))
            args = dict(args, n_tokens=i32(n_tokens))
        self._add(ref, (grid,), (threads,), args, smem_bytes=smem, reads=reads, writes=writes,
                  bytes_moved=self.bytes_moved)
        if weights:
            self._set_weight_tiles(n_tiles, grid, [(buf, weights_rows) for pair in weights for buf in pair])


class GemvInt4(_GemvInt4Launcher):
    """y fp16 [N] = W x, W INT4 [N, K], x fp16 [K].

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, y, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        check_buffer(y, "y", n, np.float16)
        check_buffer(x, "x", k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        self.bytes_moved = int4_bytes(n, k) + 2 * k + 2 * n
        self._build_gemv("gemv_int4_f16", tiles(n), k, 1,
                         dict(y=y, x=x, qweight=qweight, scales=scales, N=i32(n), K=i32(k)),
                         reads=(x, qweight, scales), writes=(y,), occupancy=occupancy, warps=warps, blocks=blocks,
                         defines=defines, weights=((qweight, scales),), weights_rows=n)


class GemvInt4QkvRope(_GemvInt4Launcher):
    """The attention input of a decode step from the residual stream, in one launch:
    xn = rmsnorm(residual) · norm_weight; [q; k; v] = [Wq; Wk; Wv] xn + bias; q_out fp16 [Hq·Dh]
    = rope(q, pos) and, in one layer's paged cache [P, Hkv, 16, Dh], the slot of pos = state[0]
    gets rope(k, pos) (k_cache) and v (v_cache), the page from block_table int32 [max_pages].

    residual fp32 [D]; norm_weight fp16 [D] (input_layernorm); q/k/v qweight, scales INT4
    [Hq·Dh | Hkv·Dh, D]; biases fp16; inv_freq fp32 [Dh/2] (reference.rope_inv_freq).

    n_tokens=T: T tokens at positions state[0] + j (gemv_int4_qkv_rope_tokens), residual fp32
    [T, D] and q_out fp16 [T, Hq·Dh]; token j's K/V go to the slot of position state[0] + j, its
    page from block_table (entries of a page the chunk opens set before the launch).
    x_normed (with n_tokens): fp16 [T, D], the rows already normalised by an rmsnorm launch
    (gemv_int4_qkv_rope_x_tokens, the same outputs): residual and norm_weight are then not read.

    Raises:
        LaunchError: Dh not a multiple of 16, D not a multiple of 128, T outside 1..16, a buffer of
            the wrong size, dtype or shape, or T tokens' x past the shared memory of a block.
    """

    def __init__(self, q_out, k_cache, v_cache, residual, norm_weight, q_qweight, q_scales, k_qweight, k_scales,
                 v_qweight, v_scales, q_bias, k_bias, v_bias, inv_freq, state, block_table, *, n_heads: int,
                 n_kv_heads: int, head_dim: int, dim: int, eps: float, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple | None = None, n_tokens: int | None = None, x_normed=None):
        super().__init__(stream)
        nt = token_count(n_tokens)
        require(x_normed is None or n_tokens is not None, "gemv_int4_qkv_rope: x_normed needs n_tokens")
        check_qkv_rope_outputs("gemv_int4_qkv_rope", q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim, nt)
        nq, nkv, k = n_heads * head_dim, n_kv_heads * head_dim, dim
        check_buffer(residual, "residual", nt * k, np.float32)
        check_buffer(norm_weight, "norm_weight", k, np.float16)
        _check_int4(q_qweight, q_scales, "q_proj", nq, k)
        _check_int4(k_qweight, k_scales, "k_proj", nkv, k)
        _check_int4(v_qweight, v_scales, "v_proj", nkv, k)
        check_buffer(q_bias, "q_bias", nq, np.float16)
        check_buffer(k_bias, "k_bias", nkv, np.float16)
        check_buffer(v_bias, "v_bias", nkv, np.float16)
        check_buffer(inv_freq, "inv_freq", head_dim // 2, np.float32)
        check_state(state)
        n = nq + 2 * nkv
        self.bytes_moved = int4_bytes(n, k) + 2 * k + nt * (4 * k + 2 * n) + 2 * n
        weights = dict(q_qweight=q_qweight, q_scales=q_scales, k_qweight=k_qweight, k_scales=k_scales,
                       v_qweight=v_qweight, v_scales=v_scales, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
                       inv_freq=inv_freq, state=state, block_table=block_table, Hq=i32(n_heads),
                       Hkv=i32(n_kv_heads), Dh=i32(head_dim), K=i32(k))
        outs = dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache)
        if x_normed is None:
            args, xin = dict(outs, residual=residual, norm_w=norm_weight, **weights, eps=f32(eps)), (residual, norm_weight)
        else:
            check_buffer(x_normed, "x_normed", nt * k, np.float16)
            args, xin = dict(outs, x=x_normed, **weights), (x_normed,)
        # Before the build choice, which needs a launch shape of K (_build_gemv checks it again for
        # every GEMV launcher).
        require(k > 0 and k % GROUP_SIZE == 0,
                f"gemv_int4_qkv_rope: dim={k} must be a positive multiple of {GROUP_SIZE}")
        if defines is None:
            defines = qkv_rope_defines(tiles(nq) + 2 * tiles(nkv), k, occupancy, warps, blocks)
        self._build_gemv("gemv_int4_qkv_rope", tiles(nq) + 2 * tiles(nkv), k, 1, args,
                         reads=(*xin, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                                q_bias, k_bias, v_bias, inv_freq, state, block_table),
                         writes=(q_out, k_cache, v_cache), occupancy=occupancy, warps=warps, blocks=blocks,
                         defines=defines, n_tokens=n_tokens,
                         tokens_kernel=None if x_normed is None else "gemv_int4_qkv_rope_x_tokens")


class GemvInt4Residual(_GemvInt4Launcher):
    """residual fp32 [N] += W x (o_proj, down_proj): the residual add fused into the epilogue.

    n_tokens=T: residual fp32 [T, N] += W x_j per token, x fp16 [T, K] (gemv_int4_residual_tokens,
    which reads x from global memory: nothing staged, any K).

    Raises:
        LaunchError: K not a multiple of 128, T outside 1..16, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, x, qweight, scales, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple = (), n_tokens: int | None = None):
        super().__init__(stream)
        nt = token_count(n_tokens)
        check_buffer(residual, "residual", nt * n, np.float32)
        check_buffer(x, "x", nt * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        self.bytes_moved = int4_bytes(n, k) + nt * (2 * k + 8 * n)
        self._build_gemv("gemv_int4_residual", tiles(n), k, 1,
                         dict(residual=residual, x=x, qweight=qweight, scales=scales, N=i32(n), K=i32(k)),
                         reads=(residual, x, qweight, scales), writes=(residual,), occupancy=occupancy,
                         warps=warps, blocks=blocks, defines=defines, n_tokens=n_tokens, x_staged=False,
                         weights=((qweight, scales),), weights_rows=n)


class GemvInt4GateUpSwiglu(_GemvInt4Launcher):
    """h fp16 [F] = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual fp32 [D]) · norm_weight fp16 [D]
    (post_attention_layernorm): the norm, gate_proj, up_proj and SwiGLU in one launch.

    n_tokens=T: h fp16 [T, F] from residual fp32 [T, D], each token's row normalised on its own
    (gemv_int4_gate_up_swiglu_tokens); or, with x_normed fp16 [T, D], from rows normalised by an
    rmsnorm launch before (gemv_int4_gate_up_swiglu_x_tokens, the same h).

    Raises:
        LaunchError: D not a multiple of 128, T outside 1..16, a buffer of the wrong size or dtype,
            or T tokens' x past the shared memory of a block.
    """

    def __init__(self, h, residual, norm_weight, gate_qweight, gate_scales, up_qweight, up_scales, *, f: int,
                 k: int, eps: float, stream: Stream | None = None, occupancy: Occupancy | None = None,
                 warps: int | None = None, blocks: int | None = None, defines: tuple = (),
                 n_tokens: int | None = None, x_normed=None):
        super().__init__(stream)
        nt = token_count(n_tokens)
        require(x_normed is None or n_tokens is not None, "gemv_int4_gate_up_swiglu: x_normed needs n_tokens")
        check_buffer(h, "h", nt * f, np.float16)
        check_buffer(residual, "residual", nt * k, np.float32)
        check_buffer(norm_weight, "norm_weight", k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        self.bytes_moved = 2 * int4_bytes(f, k) + 2 * k + nt * (4 * k + 2 * f)
        weights = dict(gate_qweight=gate_qweight, gate_scales=gate_scales, up_qweight=up_qweight,
                       up_scales=up_scales, F=i32(f), K=i32(k))
        if x_normed is None:
            args, xin = dict(h=h, residual=residual, norm_w=norm_weight, **weights, eps=f32(eps)), (residual, norm_weight)
        else:
            check_buffer(x_normed, "x_normed", nt * k, np.float16)
            args, xin = dict(h=h, x=x_normed, **weights), (x_normed,)
        self._build_gemv("gemv_int4_gate_up_swiglu", tiles(f), k, 2, args,
                         reads=(*xin, gate_qweight, gate_scales, up_qweight, up_scales), writes=(h,),
                         occupancy=occupancy, warps=warps, blocks=blocks, defines=defines, n_tokens=n_tokens,
                         tokens_kernel=None if x_normed is None else "gemv_int4_gate_up_swiglu_x_tokens",
                         weights=((gate_qweight, gate_scales), (up_qweight, up_scales)), weights_rows=f)
