"""Launchers of kernels/gemv_fmt.cu: the decode GEMVs and the embedding over weights in their
own per-tensor formats (format/weight_formats.py; kernels/weight_formats.cuh on the GPU).

    GemvFmt               y fp16 [N]          = W x
    GemvFmtQkvRope        q fp16 [Hq·Dh], K/V cache slot of state[0]
                                              = rope([Wq; Wk; Wv] rmsnorm(residual) + bias), each
                                                of q, k, v in its own format
    GemvFmtResidual       residual fp32 [N]  += W x                         (o_proj, down_proj)
    GemvFmtGateUpSwiglu   h fp16 [F]          = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual)
    LmHeadFmt             logits fp32 [V]     = W xn, + per block argmax partials
    EmbeddingFmt          residual fp32 [D]   = embed[state[1]]   (EmbeddingFmtRows: [T, D], prefill)

A weight is a `FmtWeight`: its format and its parts as the GPU holds them (`device_tensors`:
qweight, qhigh, scales, offsets or superscales; q4_k/q5_k's scales and superscales as one plane
of lane words), which the kernels take as four pointers <w>_qweight, <w>_qhigh, <w>_scales,
<w>_aux (null where the format has none) and the format id. The launch shape is gemv_int4's
(`gemv_launch_shape`): tiles of 16 rows spread over one wave of blocks; for qkv the wave is
split between q, k and v by tiles, a block serving one matrix (gemv_fmt.cu says why).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cuda import Stream
from ..format import weight_formats as wf
from ..format.int4_tiles import device_words
from .base import (DEFAULT_OCCUPANCY, NULL, KernelRef, Launcher, Occupancy, check_buffer, check_state, f32, i32,
                   mirrored, require)
from .gemv_int4 import MAX_WARPS, TILE_ROWS, check_qkv_rope_outputs, gemv_launch_shape, gemv_resident_blocks, tiles

mirrored("gemv_fmt", "GF_MAX_WARPS", MAX_WARPS)
QUAD = mirrored("gemv_fmt", "GF_QUAD", 128)            # inputs per item: K must be a multiple
CHUNK = mirrored("gemv_fmt", "WF_CHUNK", 32)           # inputs per chunk (one Σx each)
# Codes of this many bits or fewer (qweight uint32 [N, K/8]: 4–6-bit formats) are tile-major on the
# GPU: format/int4_tiles.py's device layout with rows in plain order (weight_formats.cuh says why).
TILED_BITS = mirrored("gemv_fmt", "WF_TILED_BITS", 6)
EMBEDDING_THREADS = mirrored("gemv_fmt", "EMBEDDING_FMT_THREADS", 128)

# The format ids kernels/weight_formats.cuh reads (WF_* there) of weight_formats.FORMATS.
GPU_FORMAT_IDS = frozenset({1, 2, 3, 5, 6, 9, 10, 11, 12})
# A dense FP16 matrix (a file's format 0, `<prefix>.weight`: a GGUF's F16 projection kept as it
# is) goes to the same kernels under WF_DENSE.
DENSE_ID = mirrored("gemv_fmt", "WF_DENSE", 16)


class DenseF16:
    """A dense FP16 weight as the per-tensor kernels take it: one part, `weight` fp16 [N, K]
    (read as the `qweight` plane: two values per 32-bit word). Shaped like a WeightFormat where
    FmtWeight uses one."""

    id = DENSE_ID
    name = "dense_fp16"
    bits = 16
    superblock = 0      # no K-quant super-blocks
    has_min = False

    @staticmethod
    def fits(k: int) -> bool:
        return k > 0 and k % CHUNK == 0

    @staticmethod
    def tensors(prefix: str, n: int, k: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {f"{prefix}.weight": (np.dtype("<f2"), (n, k))}


DENSE_F16 = DenseF16()

# The fused kernels and the define that sets each one's minimum of resident blocks per SM
# (__launch_bounds__), which format_defines chooses.
FUSED_MIN_BLOCKS = {"gemv_fmt_qkv_rope": "GF_QKV_MIN_BLOCKS", "gemv_fmt_gate_up_swiglu": "GF_GATE_UP_MIN_BLOCKS"}


def format_mask(format_ids: Iterable[int]) -> int:
    """WF_FORMATS of kernels/weight_formats.cuh for these format ids: bit `id` set for each.

    Raises:
        LaunchError: an id without a GPU kernel.
    """
    mask = 0
    for fid in format_ids:
        require(fid in GPU_FORMAT_IDS | {DENSE_ID}, f"weight format id {fid} has no GPU kernel")
        mask |= 1 << fid
    return mask


@functools.lru_cache(maxsize=None)
def _format_defines(format_ids: frozenset[int]) -> tuple[tuple[str, int], ...]:
    from ..cuda.errors import NvrtcError
    from ..cuda.nvrtc import compile_kernel  # NVRTC only when a per-tensor model is planned

    mask = (("WF_FORMATS", format_mask(format_ids)),)
    two = mask + tuple((define, 2) for define in FUSED_MIN_BLOCKS.values())
    try:
        report = compile_kernel("gemv_fmt", defines=dict(two)).resources
    except (NvrtcError, OSError):
        # No NVRTC or no cache to write here: the build that fits any register need. A GPU run
        # meets the same error at its own compile and says so there.
        return mask + tuple((define, 1) for define in FUSED_MIN_BLOCKS.values())
    # Each kernel's registers depend on its own bound only: one compile answers for both.
    return mask + tuple((define, 1 if report[kernel].spills else 2) for kernel, define in FUSED_MIN_BLOCKS.items())


def format_defines(format_ids: Iterable[int]) -> tuple[tuple[str, int], ...]:
    """The defines that compile gemv_fmt.cu and gemm_fmt.cu for one model: WF_FORMATS, the mask
    of its format ids (DENSE_ID for dense FP16 projections), and for each fused GEMV (qkv/RoPE,
    gate/up: FUSED_MIN_BLOCKS) its minimum of resident blocks per SM: 2 where ptxas fits it in
    128 registers (2 blocks of 8 warps) without spilling, else 1.

    Why per model: a kernel's registers are the most that any format it can dispatch to needs;
    compiled for every format, the fused GEMVs need 150–180 and run one block per SM, compiled
    for a model's two to four formats they fit 128 (gemv_fmt.cu). Finding out compiles
    gemv_fmt.cu once through the cubin cache (NVRTC, no GPU), which the model's kernel load then
    finds there; where NVRTC cannot run, both stay at 1.

    Raises:
        LaunchError: an id without a GPU kernel.
    """
    return _format_defines(frozenset(int(f) for f in format_ids))


def compiled_formats(defines) -> frozenset[int] | None:
    """The format ids a kernel compiled with `defines` reads (None: every one, WF_FORMATS unset)."""
    mask = dict(defines).get("WF_FORMATS")
    if mask is None:
        return None
    return frozenset(f for f in GPU_FORMAT_IDS | {DENSE_ID} if mask >> f & 1)


def codes_tile_major(fmt) -> bool:
    """Whether the GPU reads `fmt`'s qweight (and qhigh) tile-major (format/int4_tiles.py,
    pair_dim 0): its codes have 4–6 bits (TILED_BITS). Not the 8-bit codes (32 bytes a chunk: a
    quad of them is already two whole 64-byte pieces of a row) nor a dense matrix."""
    return fmt.bits <= TILED_BITS


def tile_major_parts(fmt) -> dict[str, int]:
    """The stored parts of `fmt` that the GPU holds tile-major, each with its words a row and
    128-input group (to_tile_major's group_words): qweight 16 and, with 5- or 6-bit codes, qhigh
    4 or 8 (weight_formats.cuh); none where not codes_tile_major."""
    if not codes_tile_major(fmt):
        return {}
    high = fmt.bits - 4
    return {"qweight": 16, **({"qhigh": 4 * high} if high > 0 else {})}


def lane_word_scales(fmt) -> bool:
    """Whether the GPU holds `fmt`'s scales and superscales as lane words
    (format/kquant_lanes.py): the K-quants with a min, q4_k and q5_k."""
    return bool(fmt.superblock and fmt.has_min)


def device_tensors(fmt, prefix: str, n: int, k: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The tensors of weight `prefix` [n, k] in `fmt` (a WeightFormat, or DENSE_F16) as the GPU
    holds them: name → (dtype, shape). `fmt.tensors`' but for q4_k and q5_k, whose scales and
    superscales are one plane there, `<prefix>.scales` uint32 [n, k/256, 4] (the lane words,
    kquant_lanes.to_lane_words), and no `.superscales`. The tile-major planes keep the file's shape
    (their rows padded to a whole tile: FmtWeight.check)."""
    tensors = dict(fmt.tensors(prefix, n, k))
    if lane_word_scales(fmt):
        from ..format.kquant_lanes import LANES

        del tensors[f"{prefix}.superscales"]
        tensors[f"{prefix}.scales"] = (np.dtype(np.uint32), (n, k // fmt.superblock, LANES))
    return tensors


def device_parts(fmt, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A weight's stored parts as the GPU reads them: `parts` (name → array in the file's layout,
    weight_formats.random_weight's or a file's) with those of tile_major_parts rearranged
    (to_tile_major, rows padded to a whole tile), q4_k/q5_k's scales and superscales made one
    plane of lane words (kquant_lanes.to_lane_words: `scales` uint32 [N, K/256, 4], no
    `superscales`; device_tensors), the others as they are. What a test or a benchmark uploads; a
    model's weights are rearranged on the GPU (gpu_weights.py)."""
    from ..format.int4_tiles import to_tile_major
    from ..format.kquant_lanes import to_lane_words

    tiled = tile_major_parts(fmt)
    out = {p: to_tile_major(a, group_words=tiled[p]) if p in tiled else a for p, a in parts.items()}
    if lane_word_scales(fmt):
        out["scales"] = to_lane_words(parts["scales"], parts["superscales"])
        del out["superscales"]
    return out


# Which stored part feeds the kernels' `aux` pointer (formats with an offset, or K-quants).
AUX_PARTS = ("offsets", "superscales")
PART_NAMES = ("qweight", "qhigh", "scales") + AUX_PARTS + ("weight",)


@dataclass(frozen=True)
class FmtWeight:
    """One weight [N, K] in a per-tensor format, as the GEMVs take it.

    Attributes:
        fmt: its WeightFormat, or DENSE_F16 for a dense FP16 matrix.
        parts: part name ("qweight", "qhigh", "scales", "offsets", "superscales": those
            `device_tensors` names; "weight" for a dense one) → buffer (DeviceArray or BufferSpec).
        name: the weight's prefix, for messages (`model.layers.3.mlp.down_proj`).
    """

    fmt: Any  # wf.WeightFormat, or DENSE_F16
    parts: dict[str, Any]
    name: str = "W"

    def check(self, n: int, k: int, quad: int = QUAD, defines=()) -> None:
        """Raises LaunchError unless the GPU runs this format at K = k (a multiple of `quad`: the
        GEMVs' 128, the embedding's 32) with N·K under 2^32 (32-bit offsets), the kernel's
        `defines` compile it in (format_defines), and every part is there with the size and
        dtype of the device layout (device_tensors: q4_k/q5_k's lane words; the qweight and qhigh of
        4–6-bit codes tile-major, tile_major_parts, their rows padded to a whole tile)."""
        require(self.fmt.id in GPU_FORMAT_IDS | {DENSE_ID},
                f"{self.name}: weight format {self.fmt.name} has no GPU kernel (it runs on the CPU reference)")
        compiled = compiled_formats(defines)
        if compiled is not None:
            require(self.fmt.id in compiled, f"{self.name}: format {self.fmt.name} is not among the formats the "
                                             f"kernel was compiled for (WF_FORMATS={dict(defines)['WF_FORMATS']:#x})")
        require(n * k < 2**32, f"{self.name}: {n}×{k} weights: the GPU kernels index each stored plane with "
                               f"32-bit element offsets (weight_formats.cuh), so N·K must stay under 2^32")
        if codes_tile_major(self.fmt):   # the tile-major codes come in 128-input quads
            quad = max(quad, QUAD)
        require(k % quad == 0 and self.fmt.fits(k),
                f"{self.name}: format {self.fmt.name} at K={k}: the GPU kernels need K a multiple of {quad} "
                f"and of the format's group")
        for tname, (dt, shape) in device_tensors(self.fmt, self.name, n, k).items():
            part = tname.rsplit(".", 1)[1]
            require(part in self.parts, f"{self.name}: part {part} missing")
            size = int(np.prod(shape))
            words = tile_major_parts(self.fmt).get(part)
            if words:   # tile-major: rows padded to a whole tile
                size = device_words(n, k, words)
            check_buffer(self.parts[part], f"{self.name}.{part}", size, dt)

    def args(self, prefix: str) -> dict:
        """The kernel arguments <prefix>_qweight, _qhigh, _scales, _aux (NULL where absent)."""
        aux = next((self.parts[p] for p in AUX_PARTS if p in self.parts), NULL)
        codes = self.parts["qweight"] if "qweight" in self.parts else self.parts["weight"]   # dense: the values
        return {f"{prefix}_qweight": codes, f"{prefix}_qhigh": self.parts.get("qhigh", NULL),
                f"{prefix}_scales": self.parts.get("scales", NULL), f"{prefix}_aux": aux}

    @property
    def buffers(self) -> tuple:
        """Every stored part (what the launch reads)."""
        return tuple(self.parts[p] for p in PART_NAMES if p in self.parts)

    def nbytes(self, n: int, k: int) -> int:
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for dt, shape in self.fmt.tensors("w", n, k).values())


def fmt_weight(lookup, prefix: str, fmt) -> FmtWeight:
    """The FmtWeight of `prefix` stored in `fmt` (a WeightFormat, or DENSE_F16), its parts (those
    of device_tensors) from lookup(tensor name)."""
    # Which parts the format has does not depend on the shape: ask for any K it fits (1024).
    parts = {name.rsplit(".", 1)[1]: lookup(name) for name in device_tensors(fmt, prefix, 1, 1024)}
    return FmtWeight(fmt, parts, prefix)


def smem_extra(k: int) -> int:
    """Shared memory a gemv_fmt block needs besides gemv_int4's: Σx per 32-input chunk, fp32."""
    return 4 * (k // CHUNK)


def _kernel(name: str, defines: tuple = ()) -> KernelRef:
    return KernelRef("gemv_fmt", name, tuple(defines), pdl=True)


class _GemvFmtLauncher(Launcher):
    """Shared by the gemv_fmt GEMV launchers: the launch shape from the kernel's occupancy.
    occupancy, warps, blocks and defines as for the gemv_int4 launchers."""

    def _shape(self, ref: KernelRef, n_tiles: int, k: int, mt: int, occupancy: Occupancy | None,
               warps: int | None, blocks: int | None) -> tuple[int, int, int]:
        occ = occupancy or DEFAULT_OCCUPANCY
        return gemv_launch_shape(n_tiles, k, mt, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count,
                                 warps=warps, blocks=blocks, extra_smem=smem_extra(k))

    def _build(self, kernel: str, n_tiles: int, k: int, mt: int, args: dict, *, reads, writes, occupancy, warps,
               blocks, defines, weights: tuple = (), weights_rows: int = 0) -> int:
        """Plan `kernel`; `weights`: the FmtWeights of weights_rows rows its blocks read in row
        tiles (gf_tile_range over the whole grid: Launcher.weight_tiles)."""
        ref = _kernel(kernel, defines)
        grid, threads, smem = self._shape(ref, n_tiles, k, mt, occupancy, warps, blocks)
        self._add(ref, (grid,), (threads,), args, smem_bytes=smem, reads=reads, writes=writes,
                  bytes_moved=self.bytes_moved)
        if weights:
            self._set_weight_tiles(n_tiles, grid, [(buf, weights_rows) for w in weights for buf in w.buffers])
        return grid


class GemvFmt(_GemvFmtLauncher):
    """y fp16 [N] = W x, W a FmtWeight [N, K], x fp16 [K].

    Raises:
        LaunchError: a format without a GPU kernel, K not a multiple of 128 (and of the format's
            group), or a buffer of the wrong size or dtype.
    """

    def __init__(self, y, x, w: FmtWeight, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        w.check(n, k, defines=defines)
        check_buffer(y, "y", n, np.float16)
        check_buffer(x, "x", k, np.float16)
        self.bytes_moved = w.nbytes(n, k) + 2 * k + 2 * n
        self._build("gemv_fmt_f16", tiles(n), k, 1,
                    dict(y=y, x=x, **w.args("w"), N=i32(n), K=i32(k), fmt=i32(w.fmt.id)),
                    reads=(x,) + w.buffers, writes=(y,), occupancy=occupancy, warps=warps, blocks=blocks,
                    defines=defines)


class GemvFmtResidual(_GemvFmtLauncher):
    """residual fp32 [N] += W x (o_proj, down_proj), W a FmtWeight [N, K].

    Raises:
        LaunchError: as GemvFmt.
    """

    def __init__(self, residual, x, w: FmtWeight, *, n: int, k: int, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, blocks: int | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        w.check(n, k, defines=defines)
        check_buffer(residual, "residual", n, np.float32)
        check_buffer(x, "x", k, np.float16)
        self.bytes_moved = w.nbytes(n, k) + 2 * k + 8 * n
        self._build("gemv_fmt_residual", tiles(n), k, 1,
                    dict(residual=residual, x=x, **w.args("w"), N=i32(n), K=i32(k), fmt=i32(w.fmt.id)),
                    reads=(residual, x) + w.buffers, writes=(residual,), occupancy=occupancy, warps=warps,
                    blocks=blocks, defines=defines, weights=(w,), weights_rows=n)


def split_blocks(resident: int, seg_tiles: tuple[int, ...], tile_cost: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Blocks per segment (q, k, v) when at most `resident` blocks run in one wave and segment i
    has seg_tiles[i] tiles, each costing tile_cost[i] (its weight bytes; 1 each when None): the
    smallest makespan m (the cost of the busiest block) for which Σ ceil(tᵢ / ⌊m / cᵢ⌋) blocks
    fit, and then that many blocks for segment i (at least 1 each). With equal costs m counts
    tiles.

    Why the makespan and not blocks in proportion to tiles: a block serves one segment, so a
    proportional split rounds a small segment (k, v: 32 tiles at 7B) onto too few blocks, and
    the launch lasts as long as its busiest block (4 tiles where 3 would do at 7B, one block per
    SM). Why a tile's cost: a block serves one format too, and llama.cpp's *_K_M recipes put v
    in Q6_K beside q and k in Q4_K or Q5_K (1.46× and 1.19× the bytes a tile): counted as
    tiles, v's blocks got as many tiles as q's and finished last."""
    n = len(seg_tiles)
    resident = max(resident, n)
    cost = tuple(int(c) for c in tile_cost) if tile_cost is not None else (1,) * n
    if len(cost) != n or min(cost) < 1:
        raise ValueError(f"split_blocks: tile_cost {tile_cost} must hold {n} positive costs")
    # Every makespan worth trying is a whole number of some segment's tiles; the smallest that
    # fits wins (the largest, every segment on one block, always fits: resident ≥ n).
    for m in sorted({k * c for t, c in zip(seg_tiles, cost) for k in range(1, t + 1)}):
        if m < max(cost):
            continue  # a tile of the costliest segment alone costs more
        blocks = tuple(max(1, -(-t // (m // c))) for t, c in zip(seg_tiles, cost))
        if sum(blocks) <= resident:
            return blocks
    return (1,) * n


class GemvFmtQkvRope(_GemvFmtLauncher):
    """GemvInt4QkvRope's launch (rmsnorm, q/k/v GEMVs, bias, RoPE, the K/V cache write) with q, k
    and v each a FmtWeight in its own format.

    Raises:
        LaunchError: Dh not a multiple of 16, a format without a GPU kernel, D not a multiple
            of 128, or a buffer of the wrong size, dtype or shape.
    """

    def __init__(self, q_out, k_cache, v_cache, residual, norm_weight, q: FmtWeight, k: FmtWeight, v: FmtWeight,
                 q_bias, k_bias, v_bias, inv_freq, state, block_table, *, n_heads: int, n_kv_heads: int,
                 head_dim: int, dim: int, eps: float, stream: Stream | None = None,
                 occupancy: Occupancy | None = None, warps: int | None = None, defines: tuple = ()):
        super().__init__(stream)
        check_qkv_rope_outputs("gemv_fmt_qkv_rope", q_out, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
        nq, nkv, K = n_heads * head_dim, n_kv_heads * head_dim, dim
        check_buffer(residual, "residual", K, np.float32)
        check_buffer(norm_weight, "norm_weight", K, np.float16)
        q.check(nq, K, defines=defines)
        k.check(nkv, K, defines=defines)
        v.check(nkv, K, defines=defines)
        check_buffer(q_bias, "q_bias", nq, np.float16)
        check_buffer(k_bias, "k_bias", nkv, np.float16)
        check_buffer(v_bias, "v_bias", nkv, np.float16)
        check_buffer(inv_freq, "inv_freq", head_dim // 2, np.float32)
        check_state(state)
        self.bytes_moved = q.nbytes(nq, K) + k.nbytes(nkv, K) + v.nbytes(nkv, K) + 6 * K + 4 * (nq + 2 * nkv)
        seg_tiles = (tiles(nq), tiles(nkv), tiles(nkv))
        ref = _kernel("gemv_fmt_qkv_rope", defines)
        occ = occupancy or DEFAULT_OCCUPANCY
        resident, threads = gemv_resident_blocks(K, 1, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count,
                                                 warps=warps, extra_smem=smem_extra(K))
        self.seg_blocks = split_blocks(resident, seg_tiles, (q.nbytes(TILE_ROWS, K), k.nbytes(TILE_ROWS, K),
                                                             v.nbytes(TILE_ROWS, K)))
        per_block = max(-(-t // b) for t, b in zip(seg_tiles, self.seg_blocks))
        smem = 2 * K + smem_extra(K) + per_block * (threads // 32) * TILE_ROWS * 4
        args = dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache, residual=residual, norm_w=norm_weight,
                    **q.args("q"), **k.args("k"), **v.args("v"), q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
                    inv_freq=inv_freq, state=state, block_table=block_table, Hq=i32(n_heads), Hkv=i32(n_kv_heads),
                    Dh=i32(head_dim), K=i32(K), eps=f32(eps), q_fmt=i32(q.fmt.id), k_fmt=i32(k.fmt.id),
                    v_fmt=i32(v.fmt.id), q_blocks=i32(self.seg_blocks[0]), k_blocks=i32(self.seg_blocks[1]))
        self._add(ref, (sum(self.seg_blocks),), (threads,), args, smem_bytes=smem,
                  reads=(residual, norm_weight) + q.buffers + k.buffers + v.buffers
                  + (q_bias, k_bias, v_bias, inv_freq, state, block_table),
                  writes=(q_out, k_cache, v_cache), bytes_moved=self.bytes_moved)


class GemvFmtGateUpSwiglu(_GemvFmtLauncher):
    """h fp16 [F] = silu(Wg xn) ⊙ (Wu xn), xn = rmsnorm(residual fp32 [D]) · norm_weight fp16 [D];
    gate and up FmtWeights [F, D] in one format.

    Raises:
        LaunchError: gate and up in different formats, a format without a GPU kernel, D not a
            multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, h, residual, norm_weight, gate: FmtWeight, up: FmtWeight, *, f: int, k: int, eps: float,
                 stream: Stream | None = None, occupancy: Occupancy | None = None, warps: int | None = None,
                 blocks: int | None = None, defines: tuple = ()):
        super().__init__(stream)
        require(gate.fmt.id == up.fmt.id, f"{gate.name} ({gate.fmt.name}) and {up.name} ({up.fmt.name}): the GPU's "
                                          f"fused gate/up GEMV needs both in one format")
        gate.check(f, k, defines=defines)
        up.check(f, k, defines=defines)
        check_buffer(h, "h", f, np.float16)
        check_buffer(residual, "residual", k, np.float32)
        check_buffer(norm_weight, "norm_weight", k, np.float16)
        self.bytes_moved = gate.nbytes(f, k) + up.nbytes(f, k) + 6 * k + 2 * f
        self._build("gemv_fmt_gate_up_swiglu", tiles(f), k, 2,
                    dict(h=h, residual=residual, norm_w=norm_weight, **gate.args("gate"), **up.args("up"), F=i32(f),
                         K=i32(k), eps=f32(eps), fmt=i32(gate.fmt.id)),
                    reads=(residual, norm_weight) + gate.buffers + up.buffers, writes=(h,), occupancy=occupancy,
                    warps=warps, blocks=blocks, defines=defines, weights=(gate, up), weights_rows=f)


def lm_head_fmt_partials(vocab_size: int, dim: int, occupancy: Occupancy | None = None, defines: tuple = ()) -> int:
    """Argmax partials LmHeadFmt writes: one per block of its grid (the one-wave launch shape)."""
    occ = occupancy or DEFAULT_OCCUPANCY
    ref = _kernel("gemv_fmt_lm_head", defines)
    return gemv_launch_shape(tiles(vocab_size), dim, 1, lambda t, s: occ.blocks_per_sm(ref, t, s), occ.sm_count,
                             extra_smem=smem_extra(dim))[0]


class LmHeadFmt(_GemvFmtLauncher):
    """logits fp32 [V] = W x for a FmtWeight lm_head [V, D], rows from text_vocab on −inf (the
    padding past the tokenizer, as LmHead), and one argmax partial per block into part_val /
    part_idx (`lm_head_fmt_partials` entries, `n_partials`; ArgmaxFinal reduces them).

    Raises:
        LaunchError: as GemvFmt, text_vocab outside [1, V], or partial buffers of another size.
    """

    def __init__(self, logits, part_val, part_idx, x, w: FmtWeight, *, vocab_size: int, dim: int,
                 text_vocab: int | None = None, stream: Stream | None = None, occupancy: Occupancy | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        w.check(vocab_size, dim, defines=defines)
        n_valid = vocab_size if text_vocab is None else int(text_vocab)
        require(1 <= n_valid <= vocab_size, f"lm_head: text_vocab={n_valid} must be in [1, {vocab_size}]")
        self.text_vocab = n_valid
        check_buffer(logits, "logits", vocab_size, np.float32)
        check_buffer(x, "x", dim, np.float16)
        ref = _kernel("gemv_fmt_lm_head", defines)
        grid, threads, smem = self._shape(ref, tiles(vocab_size), dim, 1, occupancy, None, None)
        check_buffer(part_val, "part_val", grid, np.float32)   # lm_head_fmt_partials(V, D) entries
        check_buffer(part_idx, "part_idx", grid, np.int32)
        self.n_partials = grid
        self.bytes_moved = w.nbytes(vocab_size, dim) + 2 * dim + 4 * vocab_size
        self._add(ref, (grid,), (threads,),
                  dict(logits=logits, part_val=part_val, part_idx=part_idx, x=x, **w.args("w"), V=i32(vocab_size),
                       K=i32(dim), n_valid=i32(n_valid), fmt=i32(w.fmt.id)),
                  smem_bytes=smem, reads=(x,) + w.buffers, writes=(logits, part_val, part_idx),
                  bytes_moved=self.bytes_moved)


def _embedding_grid_x(dim: int) -> int:
    return -(-(dim // CHUNK) // EMBEDDING_THREADS)


def _check_embedding(w: FmtWeight, vocab_size: int, dim: int, defines: tuple) -> None:
    w.check(vocab_size, dim, quad=CHUNK, defines=defines)  # one thread per 32-input chunk


class EmbeddingFmt(Launcher):
    """residual fp32 [D] = the row state[1] of a FmtWeight embedding [V, D], dequantized as the
    reference dequantizes it (bit for bit).

    Raises:
        LaunchError: a format without a GPU kernel, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, w: FmtWeight, state, *, vocab_size: int, dim: int, stream: Stream | None = None,
                 defines: tuple = ()):
        super().__init__(stream)
        _check_embedding(w, vocab_size, dim, defines)
        check_buffer(residual, "residual", dim, np.float32)
        check_state(state)
        self.bytes_moved = w.nbytes(1, dim) + 4 * dim
        self._add(KernelRef("gemv_fmt", "embedding_fmt", tuple(defines), pdl=True), (_embedding_grid_x(dim),), (EMBEDDING_THREADS,),
                  dict(residual=residual, **w.args("w"), state=state, V=i32(vocab_size), D=i32(dim),
                       fmt=i32(w.fmt.id)),
                  reads=w.buffers + (state,), writes=(residual,), bytes_moved=self.bytes_moved)


class EmbeddingFmtRows(Launcher):
    """residual fp32 [T, D] = rows ids[t] of a FmtWeight embedding [V, D] (prefill).

    Raises:
        LaunchError: as EmbeddingFmt.
    """

    def __init__(self, residual, w: FmtWeight, ids, *, n_rows: int, vocab_size: int, dim: int,
                 stream: Stream | None = None, defines: tuple = ()):
        super().__init__(stream)
        _check_embedding(w, vocab_size, dim, defines)
        check_buffer(residual, "residual", n_rows * dim, np.float32)
        check_buffer(ids, "ids", n_rows, np.int32)
        self.bytes_moved = n_rows * (w.nbytes(1, dim) + 4 * dim)
        self._add(KernelRef("gemv_fmt", "embedding_fmt_rows", tuple(defines)), (_embedding_grid_x(dim), n_rows), (EMBEDDING_THREADS,),
                  dict(residual=residual, **w.args("w"), ids=ids, V=i32(vocab_size), D=i32(dim), fmt=i32(w.fmt.id)),
                  reads=w.buffers + (ids,), writes=(residual,), bytes_moved=self.bytes_moved)
