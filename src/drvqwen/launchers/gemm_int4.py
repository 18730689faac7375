"""Launchers of kernels/gemm_int4.cu: the prefill GEMMs over INT4 (layout id 1) weights, in the
device layout (format/int4_tiles.py: tile-major, q/k/v RoPE-paired) for the INT4 kernels.

    GemmInt4                   out fp32 [M, N]               = x fp16 [M, K] · Wᵀ
    GemmInt4QkvRows            qkv fp32 [M, Nq + 2 Nkv]      = x [Wq; Wk; Wv]ᵀ
    GemmInt4QkvRopeRows        q fp16 [M, Hq, Dh] = rope(x Wqᵀ + bq); K/V cache slots of the chunk's
                               positions = rope(x Wkᵀ + bk), x Wvᵀ + bv   (RoPE in the epilogue)
    GemmInt4ResidualRows       residual fp32 [M, N]         += x Wᵀ              (o_proj, down_proj)
    GemmInt4GateUpSwigluRows   h fp16 [M, F]                 = silu(x Wgᵀ) ⊙ (x Wuᵀ)

M = prefill_state[1] ≤ rows: buffers and grids are sized for a row *capacity* (`rows`), the
kernels read the live row count from prefill_state int32 [2] = (start, n_rows) and write only
rows < n_rows, so one launch list serves every chunk of up to `rows` rows.

The kernel file is built three times, with tiles of 64, 128 and 256 tokens (GEMM_BM: wgmma
m64n64, m64n128, m64n256); a launcher takes the build whose tiles finish its GEMM soonest on
the GPU (`gemm_tiling`, below; `tile_tokens=` forces one).

The kernels read x through a TMA tensor map (box BM tokens × 64 inputs, 128-byte swizzle: the
layout wgmma reads), encoded here from x's address: `x` must be a device array (the prefill
builds its launch lists on the GPU), not a planned BufferSpec.

The kernels are persistent: the grid is at most one block per SM (`max_blocks`, default the
GPU's SM count; `blocks=` forces the count P) and each block takes one contiguous range of the
(tile, 128-input group) work the live M gives — the stream-K schedule of
kernels/gemm_split_k.cuh. Given a `SplitKScratch` a range may end inside a tile (the block
holding the tile's first group adds the others' partials), so every block runs about the same
number of groups; without one the ranges are whole tiles. `gemm_tiling` picks the build and P
together. `max_blocks=0` launches one block per tile at the capacity instead (the plain form,
for comparison: tools/bench_gemm.py runs both).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..cuda import Stream, encode_tiled_2d, get_device
from ..cuda.tensormap import Swizzle
from ..format.quant import GROUP_SIZE
from .base import NULL, KernelRef, Launcher, check_buffer, check_prefill_state, i32, mirrored, require
from .gemv_int4 import _check_int4, int4_bytes
from .rope_kv import check_rows_rope_outputs

BM = mirrored("gemm_int4", "GEMM_BM", 128)                      # tokens per tile (wgmma N) of the default build
TILE_TOKENS = (64, 128, 256)                                    # the builds (GEMM_BM=…) the launchers pick from
# The compile-time defines of each build (the default's none: tests and tools load it plainly).
TILE_DEFINES = {bm: (() if bm == BM else (("GEMM_BM", bm),)) for bm in TILE_TOKENS}
THREADS = mirrored("gemm_int4", "GEMM_THREADS", 384)            # 2 consumer warpgroups + 1 producer warpgroup
REGISTERS = mirrored("gemm_int4", "GEMM_REGS_AT_LAUNCH", 168)   # what the setmaxnreg moves balance at
BLOCK_ROWS = mirrored("gemm_int4", "GEMM_BLOCK_ROWS", 128)      # weight rows per block (gate/up: 64 features × 2)
TILE_ROWS = mirrored("gemm_int4", "INT4_TILE_ROWS", 16)
BOX_INPUTS = mirrored("gemm_int4", "GEMM_BOX_INPUTS", 64)       # inputs per TMA box row (128 B)


def stages(bm: int) -> int:
    """GEMM_STAGES of the build with `bm` tokens a tile: 3 stages of 72 KiB at 256, else 4."""
    return 3 if bm == 256 else 4


def smem_bytes(bm: int) -> int:
    """GEMM_SMEM_BYTES of the build with `bm` tokens a tile: stages × (bm × 128 inputs of FP16
    activations + 128 rows × 64 B of INT4 weights) + 1 KiB of alignment slack + 3 mbarriers a
    stage (above the 48 KiB default: KernelLaunch opts in)."""
    return stages(bm) * (bm * GROUP_SIZE * 2 + BLOCK_ROWS * GROUP_SIZE // 2) + 1024 + 3 * stages(bm) * 8


SMEM_BYTES = mirrored("gemm_int4", "GEMM_SMEM_BYTES", smem_bytes(BM))
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a block may opt in to (Hopper)


def smem_bytes_extra(bm: int, extra_row_bytes: int) -> int:
    """gemm_smem_bytes of a policy whose stage carries `extra_row_bytes` more a weight row and group
    (Q6_K's and Q5_0's high bits, Q8_0's second 64 B) at the build with `bm` tokens a tile:
    gemm_stages — the build's stages where they fit in SMEM_LIMIT, else 2 — of the larger stage,
    1 KiB of alignment slack and 3 mbarriers a stage."""
    stage = bm * GROUP_SIZE * 2 + BLOCK_ROWS * (GROUP_SIZE // 2 + extra_row_bytes)
    n = stages(bm) if stages(bm) * (stage + 24) + 1024 <= SMEM_LIMIT else 2
    return n * (stage + 24) + 1024


def x_tensor_map(x, rows: int, k: int, bm: int = BM):
    """The TMA descriptor of x fp16 [rows, K] the kernels take: box `bm` tokens (the build's
    tile) × 64 inputs, 128-byte swizzle (rows past `rows` read as zero).

    Raises:
        LaunchError: x is not a device array (a planned buffer has no address yet), or bm is
            not one of TILE_TOKENS.
    """
    require(k > 0 and k % GROUP_SIZE == 0, f"gemm_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
    require(bm in TILE_TOKENS, f"gemm_int4: tile of {bm} tokens, want one of {TILE_TOKENS}")
    require(isinstance(getattr(x, "ptr", None), int),
            f"gemm_int4: x must be a device array (its tensor map is encoded at once), got {x!r}")
    return _encode_x_map(x.ptr, rows, k, bm)


@functools.lru_cache(maxsize=256)
def _encode_x_map(ptr: int, rows: int, k: int, bm: int):
    # Every layer's GEMMs read the same few activation buffers (xn, attn, h): one encode each
    # (~60 µs from Python) instead of one per launcher. The map is plain bytes, passed by value.
    return encode_tiled_2d(ptr, np.float16, (rows, k), (bm, BOX_INPUTS), swizzle=Swizzle.CU_TENSOR_MAP_SWIZZLE_128B)


# Split-K (kernels/gemm_split_k.cuh): the consumer threads whose accumulators a block's tail
# stores, and the scratch's slot.
SPLIT_THREADS = mirrored("gemm_int4", "GEMM_SPLIT_THREADS", 256)
SPLIT_UNIT_FLOATS = 64 * SPLIT_THREADS  # one slot of the scratch: a 128-row × 128-token FP32 tile


def unit_floats(bm: int) -> int:
    """FP32 values of one block's partial in a build of `bm` tokens a tile: its 128 × bm tile."""
    return bm // 2 * SPLIT_THREADS


# µs one 128-input group of one tile takes, by tokens a tile, when every SM runs tiles: the
# 7B's gate_up_swiglu at M = 512 (296 row blocks: 592, 1184 and 2368 tiles on 132 SMs) divided
# by its rounds × 28 groups — 233.1, 277.5 and 372.5 µs (H200, tools/dev_kernels.py, this
# kernel as kernels/dev/gemm_int4/v6_n256_setmaxnreg.cu built with GEMM_BM = 256, 128, 64;
# docs/bench/2026-12-02_a3a56cb_h200_dev_kernels_v6.json). Twice the tokens cost ~1.5× the
# time: the unpack of a group's weights is shared by more MMA work.
GROUP_US = {64: 0.739, 128: 1.101, 256: 1.665}

# µs a tile cut by the ranges costs its owner per other block's part it adds (gemm_split_k.cuh):
# the part's 128 × bm FP32 partial read from L2, GEMM_ACC / 32 round trips of 32 KiB a block,
# after the part's block stored it. The estimate: ~1 µs a round trip under load.
SPLIT_TAIL_US = {64: 1.0, 128: 2.0, 256: 4.0}


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    """A launch's plan: the build (tokens a tile), the grid P and whether the stream-K ranges
    cut tiles (then the launch needs a SplitKScratch), with the estimate behind it in µs."""

    tile_tokens: int
    blocks: int
    split: bool
    us: float


def _plan_cost(tiles: int, groups: int, p: int, bm: int, split: bool) -> tuple[float, bool]:
    """(µs, cuts tiles) of `tiles` tiles of `groups` groups on P = p blocks: whole tiles take
    ceil(tiles / P) tiles a block; stream-K ranges ceil(W / P) groups, W = tiles · groups, plus
    the owner's reads of the other parts of its tile (at most ceil((groups − 1) / floor(W / P)) +
    1 blocks share a tile). P dividing the tiles cuts none."""
    if not split or tiles % p == 0:
        return -(-tiles // p) * groups * GROUP_US[bm], False
    w = tiles * groups
    shortest = w // p
    parts = min(p, -(-(groups - 1) // shortest) + 1)
    return -(-w // p) * GROUP_US[bm] + (parts - 1) * SPLIT_TAIL_US[bm], True


# One wave of whole 256-token tiles, not _plan_cost's pick, for the INT4 and K-quant GEMMs with a
# long K (plan_launch's `lockstep`, _plan_builds'): where such a wave fills most of the grid, its
# blocks walk K side by side — the tiles of one token block share each weight group, those of one
# row block each group of x, within the same stretch of time — while stream-K ranges start each
# block elsewhere in K, and a tile cut by them waits for its parts. _plan_cost sees neither.
# Measured on one H100 (tools/bench_gemm.py --preset 7b --rows 1024;
# docs/bench/2026-12-07_28a9d86_h100_gemm7b_m1024.json): the 7B's down_proj (28 row blocks, 148
# groups: 112 whole tiles) 201.1 µs as 112 whole tiles against 237.9 on 132 blocks of ranges, where
# _plan_cost has 246.4 and 217.8 (its gate_up, qkv and o_proj at 1024 rows, and every GEMM at 512,
# keep their picks). The same GEMM in the GGUF's K-quants (gemm_kquant.py, the same mainloop;
# bench_gemm.py --kquant, columns persistent against ranges, one H100 in one run:
# docs/bench/2026-12-07_e77fde8_h100_gemm7b_m1024_kquant.json): Q4_K 253.6 against 296.0 µs, Q5_K
# 275.8 against 294.3, Q6_K (two stages) 261.7 against 286.2, INT4 226.1 against 240.4. The reasons
# were not separated. Only where measured: 256-token tiles, K of LOCKSTEP_MIN_GROUPS groups or more,
# and a wave of at least LOCKSTEP_MIN_FILL of the grid (the 7B's down_proj from 769 rows on).
LOCKSTEP_MIN_GROUPS = 64
LOCKSTEP_MIN_FILL = 0.8


def lockstep_tiling(rows: int, row_blocks: int, groups: int, grid: int) -> GemmTiling | None:
    """The one-wave whole-tile plan (256 tokens a tile, P = the tiles, no cut) where it applies
    (LOCKSTEP_MIN_GROUPS, LOCKSTEP_MIN_FILL), else None."""
    tiles = -(-rows // 256) * row_blocks
    if groups < LOCKSTEP_MIN_GROUPS or not LOCKSTEP_MIN_FILL * grid <= tiles <= grid:
        return None
    return GemmTiling(256, tiles, False, _plan_cost(tiles, groups, tiles, 256, False)[0])


# The builds gemm_tiling weighs, in this order (the first of equal estimates wins).
BUILD_ORDER = (128, 256, 64)


def gemm_tiling(rows: int, row_blocks: int, groups: int, grid: int, *, split: bool = True,
                tile_tokens: int | None = None, blocks: int | None = None, lockstep: bool = False,
                builds: tuple[int, ...] = BUILD_ORDER) -> GemmTiling:
    """The build (TILE_TOKENS), the block count P ≤ `grid` and whether ranges cut tiles that finish a
    GEMM of `rows` token rows, `row_blocks` blocks of 128 weight rows and `groups` 128-input
    groups soonest, by the estimate of _plan_cost (GROUP_US, SPLIT_TAIL_US). Without `split` (no
    scratch) the ranges are whole tiles and P = min(tiles, grid); `builds` are the builds a
    kernel exists in (weighed in that order), `tile_tokens` fixes one, `blocks` the P. Smaller
    tiles waste less of a short prompt; larger ones share each unpacked weight among more
    tokens. What it picks at 512 tokens on 132 SMs: every GEMM of the 7B and the 0.5B on
    (nearly) every SM, ranges cutting tiles; the 7B in 256-token tiles but o_proj (128); the
    0.5B's qkv, o_proj and down_proj in 64, its gate_up in 256. With `lockstep` (the INT4 and
    K-quant GEMMs), a 256-token build and neither the build nor P fixed, lockstep_tiling's one
    wave of whole tiles where it applies, before the estimate: at 1024 rows the 7B's down_proj.

    Raises:
        LaunchError: a tile size not in TILE_TOKENS, or blocks < 1.
    """
    require(blocks is None or (isinstance(blocks, int) and blocks >= 1), f"gemm_int4: blocks={blocks!r} must be >= 1")
    if lockstep and 256 in builds and tile_tokens is None and blocks is None:
        plan = lockstep_tiling(rows, row_blocks, groups, grid)
        if plan is not None:
            return plan
    best = None
    for bm in ((tile_tokens,) if tile_tokens is not None else builds):
        require(bm in TILE_TOKENS, f"gemm_int4: tile of {bm} tokens, want one of {TILE_TOKENS}")
        tiles = -(-rows // bm) * row_blocks
        if blocks is not None:
            candidates = (min(blocks, tiles * groups if split else tiles),)
        elif not split:
            candidates = (min(grid, tiles),)
        else:
            candidates = range(min(grid, tiles * groups), 0, -1)
        for p in candidates:
            us, cut = _plan_cost(tiles, groups, p, bm, split)
            if best is None or us < best.us:
                best = GemmTiling(bm, p, cut, us)
    return best


class SplitKScratch:
    """The buffers of the stream-K GEMMs' cut tiles, shared by every launch of one stream (each
    leaves its counters at zero; the next one touches them only after its griddepcontrol.wait,
    once the one before has completed: kernels/gemm_split_k.cuh):

        partials  fp32 [units, 64 · 256]   slots of one 128 × 128 FP32 tile (a block of a
                                           128-token build takes one, of a 256-token build two,
                                           of a 64-token build half of one)
        counters  int32 [tiles]            one per block, zero between launches

    Allocated by `alloc(name, shape, dtype) -> DeviceArray` (a Pool's `alloc`), the counters
    zeroed by an upload, for up to `units` slots and `tiles` blocks in one launch (`split_k_need`
    sizes them).
    """

    def __init__(self, alloc, units: int, tiles: int):
        self.units, self.tiles = max(1, units), max(1, tiles)
        self.partials = alloc("split_k_partials", (self.units, SPLIT_UNIT_FLOATS), np.float32)
        self.counters = alloc("split_k_counters", (self.tiles,), np.int32)
        self.counters.upload(np.zeros(self.tiles, np.int32))

    @staticmethod
    def nbytes(units: int, tiles: int) -> int:
        """Bytes the two buffers take (before the pool's alignment)."""
        return max(1, units) * SPLIT_UNIT_FLOATS * 4 + max(1, tiles) * 4


def split_k_need(rows: int, row_blocks: int, k: int, grid: int | None = None, *,
                 tile_tokens: int | None = None) -> tuple[int, int]:
    """(units, tiles) of SplitKScratch a wgmma GEMM launch of `rows` rows and `row_blocks` row
    blocks over K = k would use ((0, 0) where its ranges cut no tile), on `grid` blocks at most
    (default: the SM count), in the plan gemm_tiling picks — with the build fixed to
    `tile_tokens` where the launcher fixes it (gemm_fmt_wgmma: 128), else gemm_int4's own pick."""
    t = gemm_tiling(rows, row_blocks, k // GROUP_SIZE, persistent_grid(1 << 30, grid), tile_tokens=tile_tokens)
    return (-(-t.blocks * unit_floats(t.tile_tokens) // SPLIT_UNIT_FLOATS), t.blocks) if t.split else (0, 0)


def split_k_args(split_k: SplitKScratch | None, tiling: GemmTiling, kernel: str) -> dict:
    """The kernels' split-K arguments (split_partials, split_counters) by name: null where the
    plan cuts no tile, else the scratch.

    Raises:
        LaunchError: a plan that cuts tiles without a scratch, or a scratch too small for its P
            blocks' partials and counters.
    """
    if not tiling.split:
        return dict(split_partials=NULL, split_counters=NULL)
    require(split_k is not None, f"{kernel}: {tiling.blocks} blocks cut tiles: that needs a SplitKScratch")
    slots = -(-tiling.blocks * unit_floats(tiling.tile_tokens) // SPLIT_UNIT_FLOATS)
    require(slots <= split_k.units and tiling.blocks <= split_k.tiles,
            f"{kernel}: {tiling.blocks} blocks of {tiling.tile_tokens}-token tiles need a SplitKScratch of "
            f"{slots} units and {tiling.blocks} counters, it has {split_k.units} and {split_k.tiles}")
    return dict(split_partials=split_k.partials, split_counters=split_k.counters)


def plan_launch(rows: int, row_blocks: int, k: int, *, max_blocks: int | None, split_k: SplitKScratch | None,
                blocks: int | None, tile_tokens: int | None, lockstep: bool = False,
                builds: tuple[int, ...] = BUILD_ORDER) -> GemmTiling:
    """A persistent wgmma GEMM's plan (gemm_int4.py's launchers and gemm_fmt_wgmma.py's): the SM
    count (or `max_blocks`) bounds P; max_blocks=0 gives one block per tile (whole tiles, the
    plain form), the tile still chosen as for one block per SM; `blocks` forces P, `tile_tokens`
    the build; ranges cut tiles only with a scratch; `lockstep` (the INT4 and K-quant launchers)
    and `builds`: gemm_tiling's.

    Raises:
        LaunchError: K not a positive multiple of 128, rows or N < 1, max_blocks < 0, blocks < 1,
            more blocks than SMs in a plan that cuts tiles.
    """
    require(k > 0 and k % GROUP_SIZE == 0, f"gemm_int4: K={k} must be a positive multiple of {GROUP_SIZE}")
    require(rows >= 1 and row_blocks >= 1, f"gemm_int4: rows={rows} and N must be >= 1")
    # The SM count (a device query) only where it decides something: the tile, or P.
    chosen = tile_tokens is None or (blocks is None and max_blocks != 0)
    grid = persistent_grid(1 << 30, max_blocks or None) if chosen else (blocks or 1)
    t = gemm_tiling(rows, row_blocks, k // GROUP_SIZE, grid, split=split_k is not None and max_blocks != 0,
                    tile_tokens=tile_tokens, blocks=blocks, lockstep=lockstep and max_blocks != 0, builds=builds)
    tiles = -(-rows // t.tile_tokens) * row_blocks
    if max_blocks == 0 and blocks is None:
        t = GemmTiling(t.tile_tokens, tiles, False, t.us)
    # The kernels cut the ranges in 32-bit arithmetic (gemm_split_k.cuh: gemm_range_start takes
    # b · W in u32, gemm_range_of (x + 1) · P; the unit index x < W is an int).
    work = tiles * (k // GROUP_SIZE)
    require(work < 2**31 and work * t.blocks < 2**32,
            f"gemm_int4: {tiles} tiles × {k // GROUP_SIZE} groups × {t.blocks} blocks overflow the kernels' 32-bit "
            f"range arithmetic")
    # An owner waits for the blocks after it (gemm_split_k.cuh): that ends only if they all run at
    # once — one block of these kernels a SM, so never more blocks than SMs when ranges cut tiles.
    if t.split:
        sms = get_device().info.sm_count
        require(t.blocks <= sms, f"gemm_int4: {t.blocks} blocks cut tiles, but only {sms} (one a SM) run at "
                                 f"once: an owner would wait for a block that never starts")
    return t


def persistent_grid(tiles_at_capacity: int, max_blocks: int | None) -> int:
    """Blocks of a persistent GEMM launch (here and gemm_fmt_wgmma.py): one per SM (`max_blocks`
    None: the GPU's SM count, or `max_blocks`), never more than the tiles at the row capacity;
    `max_blocks=0` gives one block per tile.

    Raises:
        LaunchError: max_blocks < 0.
    """
    require(max_blocks is None or max_blocks >= 0, f"max_blocks={max_blocks} must be >= 0 (0: one block per tile)")
    if max_blocks is None:
        max_blocks = get_device().info.sm_count
    return tiles_at_capacity if max_blocks == 0 else min(tiles_at_capacity, max_blocks)


class _GemmLauncher(Launcher):
    """Shared by the gemm_int4 launchers. `flops` is 2·rows·N·K at full capacity (rows tokens)."""

    flops: int = 0
    tiling: GemmTiling | None = None  # the launch's plan (plan_launch)
    # Compile-time switches added to the build's (a measurement's: gemm_int4.cu's GEMM_PROBE_*,
    # tools/bench_gemm.py --kquant-variant); none in the runtime.
    extra_defines: tuple[tuple[str, int], ...] = ()

    @property
    def tile_tokens(self) -> int:
        """Tokens a tile: the build launched."""
        return self.tiling.tile_tokens

    def _tiling(self, rows: int, n_blocks: int, k: int, *, max_blocks: int | None, split_k: SplitKScratch | None,
                blocks: int | None, tile_tokens: int | None) -> int:
        """Plan the launch (plan_launch); sets self.tiling, returns the build's tile (x's tensor
        map is encoded for it)."""
        self.tiling = plan_launch(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                                  tile_tokens=tile_tokens, lockstep=True)
        return self.tiling.tile_tokens

    def _plan_builds(self, tiles: tuple[int, ...], what: str, rows: int, n_blocks: int, k: int, *,
                     max_blocks: int | None, split_k: SplitKScratch | None, blocks: int | None,
                     tile_tokens: int | None, lockstep: bool = False) -> int:
        """plan_launch over the builds `tiles` a kernel exists in (weighed in that order), or
        `tile_tokens` (one of them); `lockstep` (the K-quant launchers) as for the INT4 ones. Sets
        self.tiling, returns the build's tile.

        Raises:
            LaunchError: `tile_tokens` not one of `tiles` (named as `what`), or plan_launch's.
        """
        require(tile_tokens is None or tile_tokens in tiles, f"{what}: tile of {tile_tokens} tokens, want one of {tiles}")
        self.tiling = plan_launch(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                                  tile_tokens=tile_tokens, lockstep=lockstep, builds=tiles)
        return self.tiling.tile_tokens

    def _build_gemm(self, kernel: str, rows: int, n_blocks: int, k: int, args: dict, dims: dict, *, reads,
                    writes, max_blocks: int | None, split_k: SplitKScratch | None, smem: int | None = None) -> None:
        """args: the kernel's parameters up to prefill_state (x_map encoded for self.tile_tokens,
        set by _tiling), dims: its shape scalars after the split-K pointers (the kernels' order: …,
        prefill_state, split_partials, split_counters, dims…); smem: the dynamic shared memory
        where a kernel's stages are larger than the INT4 ones (gemm_kquant.py's Q6_K)."""
        t = self.tiling
        sk = split_k_args(split_k, t, kernel)
        scratch = (split_k.partials, split_k.counters) if t.split else ()
        self._add(KernelRef("gemm_int4", kernel, TILE_DEFINES[t.tile_tokens] + self.extra_defines, pdl=True,
                            registers=REGISTERS),
                  (t.blocks,), (THREADS,), {**args, **sk, **dims},
                  smem_bytes=smem or smem_bytes(t.tile_tokens), reads=(*reads, *scratch), writes=(*writes, *scratch),
                  bytes_moved=self.bytes_moved)


class GemmInt4(_GemmLauncher):
    """out fp32 [M, N] = x fp16 [M, K] · Wᵀ (W INT4 [N, K]), M = prefill_state[1] ≤ rows.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(out, "out", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 4 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm("gemm_int4_f32", rows, n_blocks, k,
                         dict(out=out, x_map=x_tensor_map(x, rows, k, bm), qweight=qweight, scales=scales,
                              prefill_state=prefill_state), dict(N=i32(n), K=i32(k)),
                         reads=(x, qweight, scales, prefill_state), writes=(out,), max_blocks=max_blocks,
                         split_k=split_k)


class GemmInt4QkvRows(_GemmLauncher):
    """qkv fp32 [M, Nq + 2 Nkv] = x [Wq; Wk; Wv]ᵀ for the rows of a prefill chunk (one launch).
    The weights in the device layout with their rows RoPE-paired by head_dim (format/int4_tiles.py).

    Raises:
        LaunchError: Nq or Nkv not a multiple of head_dim, head_dim not a multiple of 16, K not a
            multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, qkv, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                 prefill_state, *, n_q: int, n_kv: int, k: int, rows: int, head_dim: int, max_blocks: int | None = None,
                 split_k: SplitKScratch | None = None, blocks: int | None = None, tile_tokens: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(head_dim > 0 and head_dim % TILE_ROWS == 0 and n_q % head_dim == 0 and n_kv % head_dim == 0,
                f"gemm_int4_qkv: Nq={n_q} and Nkv={n_kv} must be multiples of head_dim={head_dim}, "
                f"itself a multiple of {TILE_ROWS}")
        check_buffer(qkv, "qkv", rows * (n_q + 2 * n_kv), np.float32)
        _check_qkv_weights(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, n_q=n_q, n_kv=n_kv,
                           k=k, rows=rows)
        check_prefill_state(prefill_state)
        n = n_q + 2 * n_kv
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 4 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm("gemm_int4_qkv", rows, n_blocks, k,
                         dict(qkv=qkv, x_map=x_tensor_map(x, rows, k, bm), q_qweight=q_qweight, q_scales=q_scales,
                              k_qweight=k_qweight, k_scales=k_scales, v_qweight=v_qweight, v_scales=v_scales,
                              prefill_state=prefill_state),
                         dict(Nq=i32(n_q), Nkv=i32(n_kv), K=i32(k), Dh=i32(head_dim)),
                         reads=(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, prefill_state),
                         writes=(qkv,), max_blocks=max_blocks, split_k=split_k)


def check_qkv_rope_outputs(kernel: str, q_out, k_cache, v_cache, q_bias, k_bias, v_bias, rope_cs, *, rows: int,
                           n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """The outputs, biases and RoPE table of a QKV GEMM with the RoPE/cache epilogue
    (gemm_int4_qkv_rope, gemm_q4k_qkv_rope, gemm_q4g32_qkv_rope and the Q5_0 / Q8_0 ones:
    GemmQkvRopeEpilogue in gemm_int4.cu): rope_kv's
    checks, rope_cs fp32 [rows, head_dim / 2, 2], and q_out and each layer cache under 2³¹
    elements (the epilogue's per-token offsets are 32-bit). Returns (n_q, n_kv) = (Hq·Dh, Hkv·Dh).

    Raises:
        LaunchError: a buffer of the wrong size, dtype or shape, or one of 2³¹ elements or more.
    """
    n_q, n_kv = check_rows_rope_outputs(kernel, q_out, q_bias, k_bias, v_bias, k_cache, v_cache,
                                        rows=rows, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    check_buffer(rope_cs, "rope_cs", rows * head_dim, np.float32)
    for what, buf in (("q_out", q_out), ("k_cache", k_cache), ("v_cache", v_cache)):
        shape = getattr(buf, "shape", None)
        require(shape is None or int(np.prod(shape)) < 2**31,
                f"{kernel}: {what} of {list(shape or ())} has 2³¹ elements or more")
    return n_q, n_kv


def _check_qkv_weights(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, *, n_q: int, n_kv: int,
                       k: int, rows: int) -> None:
    check_buffer(x, "x", rows * k, np.float16)
    _check_int4(q_qweight, q_scales, "q_proj", n_q, k)
    _check_int4(k_qweight, k_scales, "k_proj", n_kv, k)
    _check_int4(v_qweight, v_scales, "v_proj", n_kv, k)


class GemmInt4QkvRopeRows(_GemmLauncher):
    """The QKV projection of a prefill chunk with the bias, the RoPE and the FP16 writes in its
    epilogue: q_out fp16 [M, Hq, Dh] = rope(x Wqᵀ + bq), and for each row r < M at position
    p = start + r (prefill_state) the K/V cache slot of p = rope(x Wkᵀ + bk), x Wvᵀ + bv — what
    GemmInt4QkvRows and RopeKvRows compute, bit for bit, in one launch. The rotation's cos and
    sin come from rope_cs fp32 [rows, Dh/2, 2], the chunk's table (RopeTableRows, rope_kv.py).

    The block table must hold a page for every position written; caches are one layer's
    [P, Hkv, 16, Dh] fp16.

    Raises:
        LaunchError: head_dim not a multiple of 16 (the device layout's RoPE pairs), K not a
            multiple of 128, or a buffer of the wrong size, dtype or shape.
    """

    def __init__(self, q_out, k_cache, v_cache, x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales,
                 q_bias, k_bias, v_bias, rope_cs, prefill_state, block_table, *, n_heads: int, n_kv_heads: int,
                 head_dim: int, k: int, rows: int, max_blocks: int | None = None,
                 split_k: SplitKScratch | None = None, blocks: int | None = None, tile_tokens: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        require(head_dim % TILE_ROWS == 0, f"gemm_int4_qkv_rope: head_dim={head_dim} must be a multiple of {TILE_ROWS}")
        n_q, n_kv = check_qkv_rope_outputs("gemm_int4_qkv_rope", q_out, k_cache, v_cache, q_bias, k_bias, v_bias,
                                           rope_cs, rows=rows, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                           head_dim=head_dim)
        _check_qkv_weights(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, n_q=n_q, n_kv=n_kv,
                           k=k, rows=rows)
        check_prefill_state(prefill_state)
        n = n_q + 2 * n_kv
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 2 * rows * n
        # A block holds 64 RoPE pairs: 128 stacked rows (kernel: gemm_int4_qkv_rope).
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm("gemm_int4_qkv_rope", rows, n_blocks, k,
                         dict(q_out=q_out, k_cache=k_cache, v_cache=v_cache, x_map=x_tensor_map(x, rows, k, bm),
                              q_qweight=q_qweight, q_scales=q_scales, k_qweight=k_qweight, k_scales=k_scales,
                              v_qweight=v_qweight, v_scales=v_scales, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
                              rope_cs=rope_cs, prefill_state=prefill_state, block_table=block_table),
                         dict(Hq=i32(n_heads), Hkv=i32(n_kv_heads), Dh=i32(head_dim), K=i32(k)),
                         reads=(x, q_qweight, q_scales, k_qweight, k_scales, v_qweight, v_scales, q_bias, k_bias,
                                v_bias, rope_cs, prefill_state, block_table),
                         writes=(q_out, k_cache, v_cache), max_blocks=max_blocks, split_k=split_k)


class GemmInt4ResidualRows(_GemmLauncher):
    """residual fp32 [M, N] += x fp16 [M, K] · Wᵀ (o_proj, down_proj of a prefill chunk).

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, residual, x, qweight, scales, prefill_state, *, n: int, k: int, rows: int,
                 max_blocks: int | None = None, split_k: SplitKScratch | None = None, blocks: int | None = None,
                 tile_tokens: int | None = None, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(residual, "residual", rows * n, np.float32)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(qweight, scales, "W", n, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * n * k
        self.bytes_moved = int4_bytes(n, k) + 2 * rows * k + 8 * rows * n
        n_blocks = -(-n // BLOCK_ROWS)
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm("gemm_int4_residual", rows, n_blocks, k,
                         dict(residual=residual, x_map=x_tensor_map(x, rows, k, bm), qweight=qweight, scales=scales,
                              prefill_state=prefill_state), dict(N=i32(n), K=i32(k)),
                         reads=(residual, x, qweight, scales, prefill_state), writes=(residual,),
                         max_blocks=max_blocks, split_k=split_k)


class GemmInt4GateUpSwigluRows(_GemmLauncher):
    """h fp16 [M, F] = silu(x Wgᵀ) ⊙ (x Wuᵀ): gate_proj, up_proj and SwiGLU of a prefill chunk.

    Raises:
        LaunchError: K not a multiple of 128, or a buffer of the wrong size or dtype.
    """

    def __init__(self, h, x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state, *,
                 f: int, k: int, rows: int, max_blocks: int | None = None, split_k: SplitKScratch | None = None,
                 blocks: int | None = None, tile_tokens: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(h, "h", rows * f, np.float16)
        check_buffer(x, "x", rows * k, np.float16)
        _check_int4(gate_qweight, gate_scales, "gate_proj", f, k)
        _check_int4(up_qweight, up_scales, "up_proj", f, k)
        check_prefill_state(prefill_state)
        self.flops = 2 * rows * 2 * f * k
        self.bytes_moved = 2 * int4_bytes(f, k) + 2 * rows * k + 2 * rows * f
        # A block holds 64 features of gate and the same 64 of up.
        n_blocks = -(-f // (BLOCK_ROWS // 2))
        bm = self._tiling(rows, n_blocks, k, max_blocks=max_blocks, split_k=split_k, blocks=blocks,
                          tile_tokens=tile_tokens)
        self._build_gemm("gemm_int4_gate_up_swiglu", rows, n_blocks, k,
                         dict(h=h, x_map=x_tensor_map(x, rows, k, bm), gate_qweight=gate_qweight, gate_scales=gate_scales,
                              up_qweight=up_qweight, up_scales=up_scales, prefill_state=prefill_state),
                         dict(F=i32(f), K=i32(k)),
                         reads=(x, gate_qweight, gate_scales, up_qweight, up_scales, prefill_state), writes=(h,),
                         max_blocks=max_blocks, split_k=split_k)
