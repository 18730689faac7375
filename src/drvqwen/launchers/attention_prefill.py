"""Launcher of kernels/attention_prefill.cu and kernels/attention_prefill_wgmma.cu: causal GQA
attention of a prompt chunk over the paged KV cache.

    AttentionPrefill   out fp16 [rows, Hq, Dh] = causal softmax(q Kᵀ/√Dh) V for the chunk's rows
                       r < n_rows at positions start + r (prefill_state); engine "mma" (a block
                       per 16 queries × the G heads of a KV head, mma.sync), "wgmma" (a block per
                       128 packed (query, head) rows of a KV head, wgmma) or "wgmma-ranges" (the
                       same work on every SM, each block a run of the launch's KV steps)
    AttentionSplitScratch  the partials and counters of a launch whose query tiles split their
                       positions over S blocks (kv_splits > 1)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .attention_decode import check_attention_shapes
from .base import (DEFAULT_OCCUPANCY, NULL, KernelRef, Launcher, Occupancy, check_buffer, check_prefill_state, i32,
                   mirrored, require)

Q_TILE = mirrored("attention_prefill", "APF_QTILE", 16)        # queries per block (M of the MMA)
KV_TILE = mirrored("attention_prefill", "APF_KV_TILE", 64)     # positions per pipeline step (4 pages)
STAGES = mirrored("attention_prefill", "APF_STAGES", 3)
MAX_SPLITS = mirrored("attention_prefill", "APF_MAX_SPLITS", 4)  # KV splits of a query tile at most
ENGINES = ("mma", "wgmma", "wgmma-ranges")
ENGINE_FILES = {"mma": "attention_prefill", "wgmma": "attention_prefill_wgmma",  # kernels/<file>.cu
                "wgmma-ranges": "attention_prefill_wgmma"}
W_ROWS = mirrored("attention_prefill_wgmma", "APW_ROWS", 128)     # packed (query, head) rows a block
W_WARPS = mirrored("attention_prefill_wgmma", "APW_WARPS", 8)     # warps a block: the partials' slots
mirrored("attention_prefill_wgmma", "APW_MAX_SPLITS", MAX_SPLITS)
W_STAGES = mirrored("attention_prefill_wgmma", "APW_STAGES", 4)


# The compile-time build each engine runs (kernels/attention_prefill_wgmma.cu's APW_* defines):
# the range schedule with three MMA warpgroups and Q in shared memory. Measured on the H200
# (tools/bench_attention_prefill.py, the header's "Builds"): the 7B's range launches 3–8 % faster
# (2048:1024 110.8 µs against 114.7, 7168:1024 266.7 against 290.5, 31 744:512 582.2 against
# 634.8), where its split launches at 512 rows lose (20.5 µs against 15.8: 19 blocks a KV head
# instead of 28 on 132 SMs) and so keep the two-warpgroup build.
ENGINE_BUILDS = {"mma": (), "wgmma": (), "wgmma-ranges": (("APW_WARPGROUPS", 3), ("APW_Q_SMEM", 1))}


def engine_build(engine: str, defines=()) -> tuple[tuple[str, int], ...]:
    """The defines a launch of `engine` compiles its kernel with: ENGINE_BUILDS[engine], each
    name in `defines` ((name, value) pairs) replacing its value or added."""
    build = dict(ENGINE_BUILDS[engine])
    build.update((str(k), int(v)) for k, v in defines)
    return tuple(build.items())


def build_warpgroups(engine: str, defines=()) -> int:
    """MMA warpgroups a block of the wgmma kernel has in `engine`'s build with `defines`
    (APW_WARPGROUPS, 2 where unset)."""
    return int(dict(engine_build(engine, defines)).get("APW_WARPGROUPS", 2))


def q_smem_rows(engine: str, defines=()) -> int:
    """Rows of Q a block of the wgmma kernel keeps in shared memory: its packed rows in a build
    with APW_Q_SMEM, else none."""
    if engine == "mma" or not dict(engine_build(engine, defines)).get("APW_Q_SMEM"):
        return 0
    return W_ROWS // 2 * build_warpgroups(engine, defines)


def build_stages(engine: str, defines=()) -> int | None:
    """The K/V pipeline stages of `engine`'s build with `defines` (APF_STAGES / APW_STAGES; None:
    the kernel's default, STAGES / W_STAGES)."""
    return dict(engine_build(engine, defines)).get("APF_STAGES" if engine == "mma" else "APW_STAGES")


def build_refusal(defines) -> str | None:
    """Why the wgmma kernel cannot be built with `defines` replacing each engine's build's (the
    kernel's static assertions and its shared memory, asked before anything compiles), or None."""
    for engine in ("wgmma", "wgmma-ranges"):
        build = dict(engine_build(engine, defines))
        wg, q_smem, stages = build.get("APW_WARPGROUPS", 2), build.get("APW_Q_SMEM", 0), build_stages(engine, defines)
        if wg not in (2, 3) or q_smem not in (0, 1) or (wg == 3 and not q_smem):
            return (f"APW_WARPGROUPS={wg}, APW_Q_SMEM={q_smem} ({engine}): want 2 warpgroups, or 3 with Q in "
                    f"shared memory (APW_Q_SMEM=1)")
        if stages is not None and stages < 3:
            return f"APW_STAGES={stages}: want >= 3 (V of the tile before, K of this one, one in flight)"
        smem = smem_bytes(128, stages, "wgmma", q_smem_rows(engine, defines))
        if smem > 227 * 1024:
            return f"{', '.join(f'{k}={v}' for k, v in build.items())} ({engine}): {smem} B of shared memory at Dh 128, past 227 KiB"
    return None


def query_tiles(rows: int, n_heads: int, n_kv_heads: int, engine: str = "mma", defines=()) -> int:
    """Query tiles (gridDim.x) of a launch over `rows` query rows: 16 queries a tile (mma), or
    64 packed rows of rows · G a warpgroup of the build (wgmma: 128 a tile with two)."""
    if engine == "mma":
        return -(-rows // Q_TILE)
    return -(-rows * (n_heads // n_kv_heads) // (W_ROWS // 2 * build_warpgroups(engine, defines)))


def tile_splits_needed(rows: int, kv_splits: int, n_heads: int, n_kv_heads: int, engine: str = "mma",
                       defines=()) -> int:
    """The AttentionSplitScratch (in its `tile_splits` unit: 16-query tiles × splits, each slot of
    Hq warp partials and Hkv counters) a launch of `kv_splits` over `rows` rows needs. The wgmma
    engine's tiles hold 4 warps' partials a warpgroup for G heads' worth of rows, so the same rows
    may need a few slots more (64 rows at G = 7, two warpgroups: 4 tiles × 8 warps against 4 × 7)."""
    tiles = query_tiles(rows, n_heads, n_kv_heads, engine, defines)
    if engine == "mma":
        return tiles * kv_splits
    g = n_heads // n_kv_heads
    return max(tiles, -(-tiles * kv_splits * (W_WARPS // 2 * build_warpgroups(engine, defines)) // g))


def split_count(units: int, slots: int) -> int:
    """KV splits S for `units` (query tile, KV head) pairs on `slots` resident blocks of the GPU:
    the most that leaves every split two slots' worth of room, slots // (2 · units), in
    1 … MAX_SPLITS. Measured on the H200 (kernels/attention_prefill.cu, "KV splits"): the 0.5B's
    64 units on 264 slots run fastest at S = 2 (S = 4 pays more combines than it gains), the 7B's
    128 units on 132 slots at S = 1 (its tiles already fill the GPU)."""
    return max(1, min(MAX_SPLITS, slots // max(1, 2 * units)))


def split_count_wgmma(units: int, slots: int) -> int:
    """KV splits S of the wgmma engine for `units` (query tile, KV head) pairs on `slots` resident
    blocks: none where the units alone fill half the slots, else as many as two waves of slots
    hold, in 1 … MAX_SPLITS. Measured on the H200 (kernels/attention_prefill_wgmma.cu's header):
    the 7B's 112 units at 512 rows on 132 slots run fastest whole (S = 2, 4 add 18–40 % at
    position 0 and ~3 % at 7680); the 0.5B's 56 at S = 4 on long chunks (277 µs at 31 744
    against 347 at S = 2) and within 0.5 µs of the best at position 0."""
    return 1 if 2 * units > slots else max(1, min(MAX_SPLITS, 2 * slots // max(1, units)))


def kv_splits_for(rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  occupancy: Occupancy | None = None, engine: str = "mma", defines: tuple = ()) -> int:
    """S for a launch over `rows` query rows (split_count, or split_count_wgmma, with the
    kernel's occupancy — of the build `defines` names); for wgmma-ranges the pieces a unit may
    be cut into: MAX_SPLITS, the kernel then cuts only where the ranges need it."""
    if engine == "wgmma-ranges":
        return MAX_SPLITS
    occ = occupancy or DEFAULT_OCCUPANCY
    per_sm = occ.blocks_per_sm(_kernel(engine, head_dim, defines),
                               _threads(engine, n_heads, n_kv_heads, build_warpgroups(engine, defines)),
                               smem_bytes(head_dim, build_stages(engine, defines), engine, q_smem_rows(engine, defines)))
    count = split_count if engine == "mma" else split_count_wgmma
    return count(query_tiles(rows, n_heads, n_kv_heads, engine, defines) * n_kv_heads, max(1, per_sm) * occ.sm_count)


def smem_bytes(head_dim: int, stages: int | None = None, engine: str = "mma", q_rows: int = 0) -> int:
    """Dynamic shared memory. mma: stages × (K, V) × 64 token rows of Dh fp16 padded by 16
    bytes; wgmma: stages × (K, V) × 64 unpadded (swizzled) rows, + 1 KiB to align the tiles, +
    `q_rows` rows of Q (the build APW_Q_SMEM: the block's packed rows)."""
    if engine == "mma":
        return (stages or STAGES) * 2 * KV_TILE * (2 * head_dim + 16)
    return (stages or W_STAGES) * 2 * KV_TILE * 2 * head_dim + q_rows * 2 * head_dim + 1024


def _kernel(engine: str, head_dim: int, defines: tuple = ()) -> KernelRef:
    file = ENGINE_FILES[engine]
    ranges = "_ranges" if engine == "wgmma-ranges" else ""
    return KernelRef(file, f"{file}{ranges}_hd{head_dim}", engine_build(engine, defines), pdl=True)


def _threads(engine: str, n_heads: int, n_kv_heads: int, warpgroups: int = 2) -> int:
    return 32 * (n_heads // n_kv_heads) if engine == "mma" else 32 * (W_WARPS // 2 * warpgroups)


mirrored("attention_prefill", "ApfShape<64>::SMEM_BYTES", smem_bytes(64))
mirrored("attention_prefill", "ApfShape<128>::SMEM_BYTES", smem_bytes(128))
mirrored("attention_prefill_wgmma", "ApwShape<64>::SMEM_BYTES", smem_bytes(64, engine="wgmma"))
mirrored("attention_prefill_wgmma", "ApwShape<128>::SMEM_BYTES", smem_bytes(128, engine="wgmma"))


class AttentionSplitScratch:
    """The buffers of KV-split attention launches (kernels/attention_prefill.cu, "KV splits"),
    for launches of up to `tile_splits` = query tiles × S (ceil(rows / 16) · kv_splits); one per
    stream, shared by every layer's launch (each leaves its counters at zero, and the next touches
    them only after its griddepcontrol.wait, once the one before has completed):

        part_o    fp32 [tile_splits · Hq · Dh/8 · 32, 4]   each split's O accumulators, lane-major
        part_ml   fp32 [tile_splits · Hq · 32, 4]          each split's row maxima and sums
        counters  u32  [tile_splits · Hkv]                 one per (query tile, KV head); zero
                                                          between launches

    Allocated by `alloc(name, shape, dtype) -> DeviceArray` (a Pool's `alloc`); the counters are
    zeroed by an upload.
    """

    def __init__(self, alloc, tile_splits: int, n_heads: int, n_kv_heads: int, head_dim: int):
        self.tile_splits, self.heads = tile_splits, (n_heads, n_kv_heads, head_dim)
        units, o_f4, ml_f4 = self.shape(tile_splits, n_heads, n_kv_heads, head_dim)
        self.part_o = alloc("attention_part_o", (o_f4, 4), np.float32)
        self.part_ml = alloc("attention_part_ml", (ml_f4, 4), np.float32)
        self.counters = alloc("attention_counters", (units,), np.uint32)
        self.counters.upload(np.zeros(units, np.uint32))

    @staticmethod
    def shape(tile_splits: int, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """(counters, float4 of part_o, float4 of part_ml)."""
        return tile_splits * n_kv_heads, tile_splits * n_heads * (head_dim // 8) * 32, tile_splits * n_heads * 32

    @classmethod
    def nbytes(cls, tile_splits: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes the three buffers take (before the pool's alignment)."""
        units, o_f4, ml_f4 = cls.shape(tile_splits, n_heads, n_kv_heads, head_dim)
        return 16 * (o_f4 + ml_f4) + 4 * units


class AttentionPrefill(Launcher):
    """out fp16 [rows, Hq, Dh] = causal attention of q fp16 [rows, Hq, Dh] over one layer's
    paged cache [P, Hkv, 16, Dh], rows r < prefill_state[1] at positions prefill_state[0] + r.

    With `kv_splits` S > 1 each query tile's positions are cut into up to S contiguous ranges
    that run on different blocks, the last to finish combining them (`scratch`, of at least
    ceil(rows / 16) · S tile splits, holds the partials); S = 1 needs no scratch. Engine
    "wgmma-ranges" runs a block on every slot of the SMs (`occupancy`), each a run of the
    launch's (query tile, KV head, 64 positions) steps; S caps the pieces a tile is cut into
    (S = 1: whole tiles, a block after another's).
    The kernel is compiled in the engine's build (ENGINE_BUILDS), `defines` replacing or adding
    to its defines (builds to measure: benchmarks).

    Raises:
        LaunchError: unsupported head_dim or GQA group, a buffer of the wrong size or dtype,
            kv_splits outside 1 … MAX_SPLITS, or a split launch without a scratch large enough.
    """

    def __init__(self, out, q, k_cache, v_cache, block_table, prefill_state, *, rows: int, n_heads: int,
                 n_kv_heads: int, head_dim: int, kv_splits: int = 1, scratch: AttentionSplitScratch | None = None,
                 defines: tuple[tuple[str, int], ...] = (), engine: str = "mma", stream: Stream | None = None,
                 occupancy: Occupancy | None = None):
        super().__init__(stream)
        require(engine in ENGINES, f"attention_prefill: engine={engine!r}, want one of {ENGINES}")
        check_attention_shapes("attention_prefill", n_heads, n_kv_heads, head_dim)
        check_buffer(out, "out", rows * n_heads * head_dim, np.float16)
        check_buffer(q, "q", rows * n_heads * head_dim, np.float16)
        check_prefill_state(prefill_state)
        require(isinstance(kv_splits, int) and 1 <= kv_splits <= MAX_SPLITS,
                f"attention_prefill: kv_splits={kv_splits!r} must be an int in 1..{MAX_SPLITS}")
        split = dict(part_o=NULL, part_ml=NULL, counters=NULL)
        if kv_splits > 1:
            need = tile_splits_needed(rows, kv_splits, n_heads, n_kv_heads, engine, defines)
            require(scratch is not None and scratch.tile_splits >= need
                    and scratch.heads == (n_heads, n_kv_heads, head_dim),
                    f"attention_prefill: kv_splits={kv_splits} over {rows} rows needs an AttentionSplitScratch "
                    f"of ≥ {need} tile splits for heads {n_heads}/{n_kv_heads}, Dh {head_dim}")
            split = dict(part_o=scratch.part_o, part_ml=scratch.part_ml, counters=scratch.counters)
        self.n_heads, self.head_dim, self.kv_splits, self.engine = n_heads, head_dim, kv_splits, engine
        stages = build_stages(engine, defines)
        wg = build_warpgroups(engine, defines)
        q_rows = q_smem_rows(engine, defines)
        kernel, threads, smem = (_kernel(engine, head_dim, defines), _threads(engine, n_heads, n_kv_heads, wg),
                                 smem_bytes(head_dim, stages, engine, q_rows))
        args = dict(out=out, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                    prefill_state=prefill_state, Hq=i32(n_heads), Hkv=i32(n_kv_heads))
        if engine == "wgmma-ranges":  # every resident slot; the kernel spreads the steps over them
            occ = occupancy or DEFAULT_OCCUPANCY
            grid = (max(1, occ.blocks_per_sm(kernel, threads, smem)) * occ.sm_count, 1, 1)
            args["max_pieces"] = i32(kv_splits)
        else:
            grid = (query_tiles(rows, n_heads, n_kv_heads, engine, defines), n_kv_heads, kv_splits)
        self._add(kernel, grid, (threads,), dict(args, **split),
                  smem_bytes=smem, reads=(q, k_cache, v_cache, block_table, prefill_state),
                  writes=(out,) + ((scratch.part_o, scratch.part_ml, scratch.counters) if kv_splits > 1 else ()))

    def flops_for(self, start: int, n_rows: int) -> int:
        """QKᵀ and PV multiply-adds actually needed (causal) for a chunk, ×2 FLOPs each."""
        keys = n_rows * start + n_rows * (n_rows + 1) // 2
        return 2 * 2 * self.n_heads * self.head_dim * keys
