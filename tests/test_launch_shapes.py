"""Launch-shape rules of the bandwidth-bound launchers, evaluated without a GPU (occupancy given)."""

import re

import numpy as np
import pytest

from drvqwen.config import PRESETS
from drvqwen.launchers import FixedOccupancy, LaunchError
from drvqwen.launchers.attention_decode import WARPS, partial_shapes, split_blocks_per_kv_head
from drvqwen.launchers.attention_decode_tma import CONSUMERS
from drvqwen.launchers.gemv_int4 import gemv_launch_shape, tiles


def test_split_grid_fills_the_gpu_but_not_past_the_pages():
    # 7B on an H200: 2 resident blocks per SM × 132 SMs over 4 KV heads → 66 blocks per head.
    assert split_blocks_per_kv_head(4, 32768, 2, WARPS, 132) == 66
    # A short context caps the grid: 64 tokens = 4 pages = one block of 4 split warps.
    assert split_blocks_per_kv_head(4, 64, 2, WARPS, 132) == 1
    assert split_blocks_per_kv_head(2, 16 * 4 * 10, 2, WARPS, 132) == 10
    # More resident blocks per SM, more splits (up to the page count).
    assert split_blocks_per_kv_head(4, 32768, 4, WARPS, 132) == 132
    assert split_blocks_per_kv_head(4, 32768, 0, WARPS, 132) == 33    # occupancy 0 counts as 1


def test_partial_shapes_follow_the_splits_per_block():
    plain = partial_shapes(28, 128, 66)
    tma = partial_shapes(28, 128, 66, CONSUMERS)
    assert plain["partial_out"] == (66 * WARPS, 28, 128) and plain["max_logits"] == (66 * WARPS, 28)
    assert tma["exp_sums"] == (66 * CONSUMERS, 28)


@pytest.mark.parametrize("preset", ["7b", "0.5b", "14b"])
def test_gemv_shapes_cover_every_tile_in_one_wave(preset):
    cfg = PRESETS[preset]
    D, F = cfg.hidden_size, cfg.intermediate_size
    cases = {"qkv": (tiles(cfg.q_dim) + 2 * tiles(cfg.kv_dim), D, 1), "o_proj": (tiles(D), cfg.q_dim, 1),
             "gate_up": (tiles(F), D, 2), "down": (tiles(D), F, 1)}
    per_sm = 2
    for name, (n_tiles, k, mt) in cases.items():
        grid, threads, smem = gemv_launch_shape(n_tiles, k, mt, lambda t, s: per_sm, 132)
        warps = threads // 32
        per_block = -(-n_tiles // grid)
        assert 1 <= warps <= min(8, k // 128), (name, warps)
        assert grid * per_block >= n_tiles and (grid - 1) * per_block < n_tiles, (name, grid, per_block)
        assert grid <= per_sm * 132, (name, grid)                       # one wave
        # The kernel's layout (gemv_int4.cu, `x_smem`): K/8 uint4 chunks of x, then the fp32
        # partials [tiles of the block][MT][W][16 rows]; the launch must ask for all of it.
        assert smem == (k // 8) * 16 + per_block * mt * warps * 16 * 4, (name, smem)


def test_qkv_rope_takes_its_two_group_build_only_where_blocks_get_fewer_tiles():
    from drvqwen.launchers.gemv_int4 import QKV_ROPE_DEFINES, qkv_rope_defines

    # Three blocks an SM of the two-group build (80 registers), two of the default (128).
    occ = FixedOccupancy(132, lambda k, t, s: 3 if k.defines == QKV_ROPE_DEFINES else 2)
    assert qkv_rope_defines(288, 3584, occ) == QKV_ROPE_DEFINES        # 7B: 2 tiles a block → 1
    assert qkv_rope_defines(72, 896, occ) == ()                        # 0.5B: 1 tile a block either way
    assert qkv_rope_defines(1000, 3584, occ) == QKV_ROPE_DEFINES       # 4 → 3
    assert qkv_rope_defines(288, 3584, occ, blocks=288) == ()          # a forced grid: the default
    assert qkv_rope_defines(288, 3584, FixedOccupancy(132, lambda k, t, s: 2)) == ()  # no more blocks: default


def test_qkv_rope_refuses_a_dim_no_multiple_of_128_naming_it():
    from drvqwen.format.int4_tiles import device_words
    from drvqwen.launchers import GemvInt4QkvRope
    from drvqwen.launchers.base import BufferSpec

    k, hq, hkv, dh = 96, 2, 1, 32

    def b(name, shape, dtype=np.float16):
        return BufferSpec(name, shape, dtype)

    def w(name, n):  # buffers of the sizes K = 96 would give, so only the K check can refuse
        return b(f"{name}.qweight", (device_words(n, k),), np.uint32), b(f"{name}.scales", (n * (k // 128),))

    with pytest.raises(LaunchError, match=r"^gemv_int4_qkv_rope: dim=96 must be a positive multiple of 128$"):
        GemvInt4QkvRope(b("q", (hq * dh,)), b("k_cache", (4, hkv, 16, dh)), b("v_cache", (4, hkv, 16, dh)),
                        b("residual", (k,), np.float32), b("norm", (k,)), *w("q", hq * dh), *w("k", hkv * dh),
                        *w("v", hkv * dh), b("qb", (hq * dh,)), b("kb", (hkv * dh,)), b("vb", (hkv * dh,)),
                        b("inv_freq", (dh // 2,), np.float32), b("state", (3,), np.int32),
                        b("block_table", (4,), np.int32), n_heads=hq, n_kv_heads=hkv, head_dim=dh, dim=k,
                        eps=1e-6, occupancy=FixedOccupancy(132, lambda *a: 2))


def test_gemv_shape_forced_and_refused():
    assert gemv_launch_shape(100, 1024, 1, lambda t, s: 4, 132)[1] == 256           # W = min(8, K/128)
    assert gemv_launch_shape(100, 896, 1, lambda t, s: 4, 132)[1] == 224            # 7 groups: 7 warps
    assert gemv_launch_shape(100, 1024, 1, lambda t, s: 4, 132, warps=3)[1] == 96
    assert gemv_launch_shape(100, 1024, 1, lambda t, s: 4, 132, blocks=100)[0] == 100
    with pytest.raises(LaunchError, match="K=256"):
        gemv_launch_shape(100, 256, 1, lambda t, s: 4, 132, warps=3)   # 3 warps > 2 groups
    with pytest.raises(LaunchError, match="does not fit"):
        gemv_launch_shape(100, 1024, 1, lambda t, s: 0, 132)


def test_decode_plan_without_a_gpu():
    """The whole decode step plans from the config and a given occupancy, with every launch
    naming the buffers it writes (the split-KV partials and the K/V cache slots included)."""
    from drvqwen.decode import plan_decode

    cfg = PRESETS["0.5b"]
    plan = plan_decode(cfg, 1024, occupancy=FixedOccupancy(132, lambda k, t, s: 2))
    specs = dict(plan.named_specs())
    assert len(specs) == 1 + 6 * cfg.num_layers + 4
    assert specs["L0.qkv_rope"].writes == ("q", "k_cache[0]", "v_cache[0]")
    assert specs["L3.attention.0"].writes == ("partial_out", "max_logits", "exp_sums")
    assert specs["L3.attention.0"].grid == (plan.blocks_per_kv_head, cfg.num_kv_heads)
    assert specs["lm_head"].writes == ("logits", "part_val", "part_idx")
    assert all(s.writes for s in specs.values())


def test_lm_head_gets_the_text_vocabulary():
    """The decode plan passes text_vocab (the rows with text) to the lm_head kernel as its
    n_valid; the padded rows' logits are set to −inf there (kernels/gemv_f16.cu)."""
    from drvqwen.decode import plan_decode
    from drvqwen.launchers import LmHead

    cfg = PRESETS["0.5b"]
    occ = FixedOccupancy(132, lambda k, t, s: 2)
    lm = dict(plan_decode(cfg, 1024, occupancy=occ, text_vocab=151665).named_specs())["lm_head"]
    assert lm.args["n_valid"].value == 151665 and lm.args["V"].value == cfg.vocab_size
    full = dict(plan_decode(cfg, 1024, occupancy=occ).named_specs())["lm_head"]
    assert full.args["n_valid"].value == cfg.vocab_size
    for bad in (0, cfg.vocab_size + 1):
        with pytest.raises(LaunchError, match="text_vocab"):
            LmHead("logits", "pv", "pi", "x", "w", vocab_size=cfg.vocab_size, dim=896, text_vocab=bad)


@pytest.mark.parametrize("kernel", ["gemv_int4_qkv_rope", "gemv_fmt_qkv_rope"])
def test_qkv_rope_launchers_refuse_a_cache_of_another_layout_naming_the_kernel(kernel):
    """Both fused qkv/RoPE launchers check their outputs through one rule (check_qkv_rope_outputs):
    a K cache that is not one layer [P, Hkv, 16, Dh], and a head_dim no multiple of 16."""
    import numpy as np

    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.gemv_int4 import check_qkv_rope_outputs

    hq, hkv, dh = 4, 2, 64
    q = BufferSpec("q", (hq * dh,), np.float16)
    good = BufferSpec("k_cache[0]", (8, hkv, 16, dh), np.float16)
    bad = BufferSpec("k_cache", (3, 8, hkv, 16, dh), np.float16)          # the whole pool, not one layer
    check_qkv_rope_outputs(kernel, q, good, good, hq, hkv, dh)
    with pytest.raises(LaunchError, match=rf"{kernel}: k_cache k_cache is \[3, 8, 2, 16, 64\], want one layer"):
        check_qkv_rope_outputs(kernel, q, bad, good, hq, hkv, dh)
    with pytest.raises(LaunchError, match=rf"{kernel}: head_dim=40 must be a multiple of 16"):
        check_qkv_rope_outputs(kernel, BufferSpec("q", (hq * 40,), np.float16), good, good, hq, hkv, 40)


@pytest.mark.parametrize("kernel", ["rope_kv_rows", "gemm_int4_qkv_rope"])
def test_prefill_rope_launchers_refuse_bad_outputs_naming_the_kernel(kernel):
    """The prefill's row launchers that write rotated q and the cache check through the same rule
    as the GEMVs (check_rows_rope_outputs on check_qkv_rope_outputs), with any even head_dim up to
    2048, q for the chunk's rows and the three biases."""
    import numpy as np

    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.rope_kv import check_rows_rope_outputs

    hq, hkv, dh, rows = 3, 1, 40, 64                                   # 40: not a GEMV head_dim, fine here
    q = BufferSpec("q", (rows * hq * dh,), np.float16)
    b = [BufferSpec(n, (h * dh,), np.float16) for n, h in (("q_bias", hq), ("k_bias", hkv), ("v_bias", hkv))]
    cache = BufferSpec("k_cache[0]", (8, hkv, 16, dh), np.float16)
    kw = dict(rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh)
    assert check_rows_rope_outputs(kernel, q, *b, cache, cache, **kw) == (hq * dh, hkv * dh)
    with pytest.raises(LaunchError, match=rf"{kernel}: v_cache v is \[8, 1, 16, 20\], want one layer"):
        check_rows_rope_outputs(kernel, q, *b, cache, BufferSpec("v", (8, hkv, 16, 20), np.float16), **kw)
    with pytest.raises(LaunchError, match=rf"{kernel}: head_dim=39 must be a multiple of 2"):
        check_rows_rope_outputs(kernel, q, *b, cache, cache, **(kw | dict(head_dim=39)))
    with pytest.raises(LaunchError, match="k_bias"):
        check_rows_rope_outputs(kernel, q, b[0], b[0], b[2], cache, cache, **kw)


def test_qkv_rope_gemm_refuses_a_cache_past_32_bit_offsets():
    """gemm_int4_qkv_rope's epilogue (gemm_q4k_qkv_rope's too) computes per-token offsets in 32
    bits: a layer's cache of 2³¹ elements or more is refused, naming the buffer, before anything
    is encoded."""
    import numpy as np

    from drvqwen.format.int4_tiles import device_words
    from drvqwen.launchers import GemmInt4QkvRopeRows
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.gemm_kquant import GemmQ4kQkvRopeRows

    hq, hkv, dh, rows, k = 4, 2, 128, 64, 256
    buf = lambda n, shape, dt=np.float16: BufferSpec(n, shape, dt)  # noqa: E731
    w = lambda n: (buf(f"{n}.qw", (device_words(n_of[n], k),), np.uint32),  # noqa: E731
                   buf(f"{n}.sc", (n_of[n] * k // 128,)))
    n_of = {"q": hq * dh, "k": hkv * dh, "v": hkv * dh}
    huge = buf("k_cache", (2**31 // (hkv * 16 * dh), hkv, 16, dh))
    with pytest.raises(LaunchError, match=r"gemm_int4_qkv_rope: k_cache of \[.*\] has 2³¹ elements or more"):
        GemmInt4QkvRopeRows(buf("q", (rows * hq * dh,)), huge, huge, buf("x", (rows, k)), *w("q"), *w("k"), *w("v"),
                            buf("bq", (hq * dh,)), buf("bk", (hkv * dh,)), buf("bv", (hkv * dh,)),
                            buf("rope_cs", (rows * dh,), np.float32), buf("ps", (2,), np.int32),
                            buf("bt", (8,), np.int32), n_heads=hq, n_kv_heads=hkv, head_dim=dh, k=k, rows=rows)
    # gemm_q4k_qkv_rope shares the epilogue and its checks, made before any weight is looked at
    with pytest.raises(LaunchError, match=r"gemm_q4k_qkv_rope: k_cache of \[.*\] has 2³¹ elements or more"):
        GemmQ4kQkvRopeRows(buf("q", (rows * hq * dh,)), huge, huge, buf("x", (rows, k)), None, None, None,
                           buf("bq", (hq * dh,)), buf("bk", (hkv * dh,)), buf("bv", (hkv * dh,)),
                           buf("rope_cs", (rows * dh,), np.float32), buf("ps", (2,), np.int32),
                           buf("bt", (8,), np.int32), n_heads=hq, n_kv_heads=hkv, head_dim=dh, k=k, rows=rows)


def test_qkv_blocks_split_by_makespan():
    """gemv_fmt's qkv launch: blocks per q/k/v segment for the smallest makespan that fits one
    wave (7B: 224, 32, 32 tiles), never a small segment rounded onto too few blocks; with tile
    costs (a segment's bytes a tile), a costlier format's segment gets fewer tiles a block."""
    from drvqwen.launchers.gemv_fmt import split_blocks

    assert split_blocks(132, (224, 32, 32)) == (75, 11, 11)     # 3 tiles per block at most
    assert split_blocks(264, (224, 32, 32)) == (112, 16, 16)    # 2
    assert split_blocks(264, (56, 8, 8)) == (56, 8, 8)          # 0.5B: 1
    assert split_blocks(2, (5, 1, 1)) == (1, 1, 1)              # fewer resident than segments: 1 each
    # The 7B's q, k in Q4_K and v in Q6_K (32 256 and 47 040 bytes a 16-row tile at K = 3584):
    # two q tiles a block, one v tile (two would cost 2.9 q tiles).
    q4k, q6k = 16 * 3584 * 9 // 16, 16 * 3584 * 105 // 128
    assert (q4k, q6k) == (32256, 47040)
    assert split_blocks(264, (224, 32, 32), (q4k, q4k, q6k)) == (112, 16, 32)
    assert split_blocks(264, (224, 32, 32), (q4k, q4k, q4k)) == (112, 16, 16)   # equal costs: tiles
    assert split_blocks(132, (224, 32, 32), (q4k, q4k, q6k)) == (75, 11, 16)
    with pytest.raises(ValueError, match="tile_cost"):
        split_blocks(264, (224, 32, 32), (1, 1))
    for resident in range(3, 300, 7):
        for seg in ((224, 32, 32), (56, 8, 8), (3, 1, 1), (100, 100, 1)):
            for cost in ((1, 1, 1), (2, 2, 3), (5, 3, 7), (32256, 32256, 47040)):
                blocks = split_blocks(resident, seg, cost)
                # makespan: the busiest block's cost, its tiles spread as evenly as ceil allows
                m = max(-(-t // b) * c for t, b, c in zip(seg, blocks, cost))
                assert sum(blocks) <= max(resident, 3) and all(b >= 1 for b in blocks)
                # no smaller makespan fits: at m − 1 some segment's tile alone costs more, or the
                # blocks it needs are more than are resident
                if m - 1 >= max(cost):
                    assert sum(-(-t // ((m - 1) // c)) for t, c in zip(seg, cost)) > max(resident, 3)
                if cost == (1, 1, 1):
                    assert blocks == split_blocks(resident, seg)


def test_persistent_gemm_grids(monkeypatch):
    """The wgmma GEMMs' grids (gemm_int4.py and gemm_fmt_wgmma.py, one rule): one block per SM at
    most, never more than the tiles at the row capacity, max_blocks=0 one block per tile (a
    launch of 0 blocks before the rule was shared)."""
    import numpy as np

    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers import gemm_fmt_wgmma
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.gemm_fmt_wgmma import GemmFmtwGateUpSwigluRows, GemmFmtwResidualRows
    from drvqwen.launchers.gemm_int4 import persistent_grid
    from drvqwen.launchers.gemv_fmt import FmtWeight, device_tensors

    assert persistent_grid(7, 132) == 7 and persistent_grid(300, 132) == 132
    assert persistent_grid(300, 0) == 300 and persistent_grid(7, 3) == 3
    with pytest.raises(LaunchError, match="max_blocks=-1"):
        persistent_grid(7, -1)

    rows, n, k = 300, 200, 256                   # 3 token blocks × 2 row blocks (gate/up: 4 of 64 features)
    fmt = wf.EXACT_FOR_GGUF["Q8_0"]
    w = FmtWeight(fmt, {name.rsplit(".", 1)[1]: BufferSpec(name, shape, dt)
                        for name, (dt, shape) in device_tensors(fmt, "w", n, k).items()}, "w")
    # The launchers encode x's TMA tensor map at once, which needs the driver: not the rule tested here.
    monkeypatch.setattr(gemm_fmt_wgmma, "x_tensor_map", lambda x, rows, k: "x_map")
    x = BufferSpec("x", (rows * k,), np.float16)
    ps, res, h = (BufferSpec(nm, (sz,), dt) for nm, sz, dt in
                  (("prefill_state", 2, np.int32), ("residual", rows * n, np.float32), ("h", rows * n, np.float16)))
    for max_blocks, want in ((0, 6), (4, 4), (132, 6)):
        assert GemmFmtwResidualRows(res, x, w, ps, n=n, k=k, rows=rows, max_blocks=max_blocks).specs[0].grid == (want,)
    assert GemmFmtwGateUpSwigluRows(h, x, w, w, ps, f=n, k=k, rows=rows, max_blocks=0).specs[0].grid == (12,)

def test_check_buffer_names_both_sides_of_a_mismatch():
    import numpy as np

    from drvqwen.launchers.base import BufferSpec, NULL, check_buffer

    buf = BufferSpec("x", (4, 8), np.float16)
    check_buffer(buf, "x", 32, np.float16)            # right: nothing
    check_buffer(NULL, "x", 32, np.float16)           # a bare pointer: taken as it is
    with pytest.raises(LaunchError, match=r"x: expected 33 elements of float16, got x float16\[4, 8\]"):
        check_buffer(buf, "x", 33, np.float16)
    with pytest.raises(LaunchError, match=r"x: expected 32 elements of float32, got x float16\[4, 8\]"):
        check_buffer(buf, "x", 32, np.float32)


def test_split_k_arguments_are_refused_with_their_reason():
    """gemm_int4.split_k_args (both wgmma GEMM files' launchers): a plan whose stream-K ranges cut
    no tile passes null pointers; one that cuts tiles needs a scratch holding a partial (its
    tile's 128 × bm FP32: two 128 × 128 slots at 256 tokens, half of one at 64) and a counter for
    each of its P blocks. gemm_tiling refuses a block count below 1."""
    import types

    from drvqwen.launchers.base import NULL
    from drvqwen.launchers.gemm_int4 import GemmTiling, gemm_tiling, split_k_args

    scratch = types.SimpleNamespace(units=12, tiles=8, partials="partials", counters="counters")
    args = split_k_args(None, GemmTiling(128, 7, False, 0.0), "k")
    assert args == dict(split_partials=NULL, split_counters=NULL)
    assert split_k_args(scratch, GemmTiling(128, 7, False, 0.0), "k")["split_partials"] is NULL
    with pytest.raises(LaunchError, match="k: 7 blocks cut tiles: that needs a SplitKScratch"):
        split_k_args(None, GemmTiling(128, 7, True, 0.0), "k")
    args = split_k_args(scratch, GemmTiling(128, 7, True, 0.0), "k")
    assert args == dict(split_partials="partials", split_counters="counters")
    with pytest.raises(LaunchError, match="k: 7 blocks of 256-token tiles need a SplitKScratch of 14 units and "
                                          "7 counters, it has 12 and 8"):
        split_k_args(scratch, GemmTiling(256, 7, True, 0.0), "k")
    with pytest.raises(LaunchError, match="9 blocks of 64-token tiles need a SplitKScratch of 5 units and 9 counters"):
        split_k_args(scratch, GemmTiling(64, 9, True, 0.0), "k")
    assert split_k_args(scratch, GemmTiling(64, 8, True, 0.0), "k")["split_counters"] == "counters"
    with pytest.raises(LaunchError, match="blocks=0 must be >= 1"):
        gemm_tiling(512, 3, 7, 132, blocks=0)


def test_gemm_tiling_picks_the_tile_and_blocks_that_finish_soonest():
    """gemm_int4.gemm_tiling on 132 SMs (an H200) at the layer shapes its docstring lists: every
    GEMM on (nearly) every SM with stream-K ranges cutting tiles; whole tiles without a scratch;
    P dividing the tiles cuts none; a forced tile or P kept (P at most the work); the estimate's
    arithmetic; split_k_need sizing the scratch for the plan it picks."""
    from drvqwen.launchers.gemm_int4 import (GROUP_US, SPLIT_TAIL_US, GemmTiling, _plan_cost, gemm_tiling,
                                             split_k_need)

    sm = 132
    pick = lambda *a, **kw: (lambda t: (t.tile_tokens, t.blocks, t.split))(gemm_tiling(*a, **kw))  # noqa: E731
    # (rows, row blocks, groups): the 7B's qkv, o_proj, gate_up, down_proj at 512 tokens.
    assert [pick(512, rb, g, sm) for rb, g in ((36, 28), (28, 28), (296, 28), (28, 148))] == [
        (256, 132, True), (128, 132, True), (256, 132, True), (256, 132, True)]
    # The 0.5B's.
    assert [pick(512, rb, g, sm) for rb, g in ((9, 7), (7, 7), (76, 7), (7, 38))] == [
        (64, 132, True), (64, 130, True), (256, 132, True), (64, 132, True)]
    # Without a scratch: whole tiles, as many blocks as tiles up to the SMs.
    assert pick(512, 36, 28, sm, split=False) == (256, 72, False)
    assert pick(512, 296, 28, sm, split=False) == (256, 132, False)
    assert pick(512, 33, 28, sm, tile_tokens=128) == (128, 132, False)     # 132 tiles on 132 blocks
    assert pick(512, 3, 27, sm, tile_tokens=128, blocks=5) == (128, 5, True)
    assert pick(64, 1, 2, sm, tile_tokens=64, blocks=10) == (64, 2, True)  # W = 2 groups: 2 blocks
    with pytest.raises(LaunchError, match="tile of 96 tokens"):
        gemm_tiling(512, 7, 7, sm, tile_tokens=96)
    # 592 tiles of 28 groups on 132 blocks: 126 groups the longest range, tiles shared by 2 blocks.
    us, cut = _plan_cost(592, 28, 132, 256, True)
    assert cut and us == pytest.approx(126 * GROUP_US[256] + SPLIT_TAIL_US[256])
    # 56 tiles of 148 groups: ranges of 62–63 groups, a tile shared by up to 4 blocks.
    assert _plan_cost(56, 148, 132, 256, True)[0] == pytest.approx(63 * GROUP_US[256] + 3 * SPLIT_TAIL_US[256])
    assert _plan_cost(592, 28, 132, 256, False) == (5 * 28 * GROUP_US[256], False)
    assert isinstance(gemm_tiling(512, 7, 7, sm), GemmTiling)
    # Scratch: P partials of the plan's tile (64 tokens: half a 128 × 128 slot) and P counters.
    assert split_k_need(512, 7, 38 * 128, sm) == (66, 132)
    assert split_k_need(512, 28, 148 * 128, sm) == (264, 132)
    assert split_k_need(512, 33, 128, sm) == (0, 0)                        # 132 whole 128-token tiles
    # A launcher with one build (gemm_fmt_wgmma: 128 tokens) needs the scratch of that build's plan,
    # which can be more than gemm_int4's own pick: the 7B's o_proj at 64 rows takes 64-token tiles
    # (half a slot a block), but 128-token ones a whole slot.
    free, fixed = split_k_need(64, 28, 28 * 128, sm), split_k_need(64, 28, 28 * 128, sm, tile_tokens=128)
    t = gemm_tiling(64, 28, 28, sm, tile_tokens=128)
    assert fixed == (t.blocks, t.blocks) and t.split and fixed[0] > free[0]


def test_int4_gemms_with_a_long_k_take_one_wave_of_whole_tiles_where_it_fills_the_grid():
    """gemm_int4.lockstep_tiling on 132 SMs: the 7B's down_proj (28 row blocks, 148 groups) at a
    1024-row chunk runs as one wave of 112 whole 256-token tiles, where _plan_cost alone picks
    stream-K ranges on 132 blocks; at 512 rows (56 tiles), for a short K (o_proj, gate_up, qkv) or
    more tiles than blocks it does not apply. plan_launch takes it where asked (lockstep: the INT4
    and K-quant launchers) and a 256-token build is among the builds, not where the build or P is
    forced."""
    from drvqwen.launchers.gemm_int4 import (GROUP_US, LOCKSTEP_MIN_GROUPS, GemmTiling, gemm_tiling, lockstep_tiling,
                                             plan_launch)

    sm = 132
    assert gemm_tiling(1024, 28, 148, sm).split  # _plan_cost alone: stream-K ranges
    assert lockstep_tiling(1024, 28, 148, sm) == GemmTiling(256, 112, False, 148 * GROUP_US[256])
    assert lockstep_tiling(769, 28, 148, sm).blocks == 112
    assert lockstep_tiling(768, 28, 148, sm) is None            # 84 tiles: 64 % of the grid
    assert lockstep_tiling(512, 28, 148, sm) is None            # 56 tiles
    assert lockstep_tiling(1024, 28, 28, sm) is None            # o_proj's K
    assert lockstep_tiling(1024, 36, 28, sm) is None            # qkv: 144 tiles, more than the blocks
    assert lockstep_tiling(1024, 296, 28, sm) is None           # gate_up
    assert lockstep_tiling(1024, 28, LOCKSTEP_MIN_GROUPS - 1, sm) is None
    assert gemm_tiling(1024, 28, 148, sm, lockstep=True) == lockstep_tiling(1024, 28, 148, sm)
    assert gemm_tiling(512, 28, 148, sm, lockstep=True) == gemm_tiling(512, 28, 148, sm)
    assert gemm_tiling(1024, 28, 148, sm, lockstep=True, tile_tokens=128).tile_tokens == 128
    split_k = object()  # only its presence matters to the plan
    t = plan_launch(1024, 28, 148 * 128, max_blocks=sm, split_k=split_k, blocks=None, tile_tokens=None, lockstep=True)
    assert (t.tile_tokens, t.blocks, t.split) == (256, 112, False)
    t = plan_launch(1024, 28, 148 * 128, max_blocks=sm, split_k=None, blocks=None, tile_tokens=128, lockstep=True)
    assert (t.tile_tokens, t.blocks) == (128, 132)              # a forced build stays
    assert gemm_tiling(1024, 28, 148, sm, lockstep=True, builds=(128, 64)).split  # no 256-token build


def test_kquant_gemms_take_the_one_wave_rule_as_the_int4_ones(monkeypatch):
    """The K-quant launchers (gemm_kquant.py) plan a long-K GEMM that fills the grid as one wave of
    whole 256-token tiles, as the INT4 ones do: the 7B's down_proj at a 1024-row chunk (28 row
    blocks, 148 groups) in Q4_K, Q5_K and Q6_K on 112 blocks, where the estimate alone (lockstep
    off) cuts stream-K ranges; at 512 rows, or with the build forced, their plans are the estimate's."""
    import types

    from drvqwen.launchers import gemm_int4
    from drvqwen.launchers import gemm_kquant as kq

    gpu = types.SimpleNamespace(info=types.SimpleNamespace(sm_count=132))
    monkeypatch.setattr(gemm_int4, "get_device", lambda: gpu)
    split_k = object()  # only its presence matters to the plan

    def plan(cls, rows, lockstep=None, tile_tokens=None):
        ln = cls.__new__(cls)  # the planning alone: no buffers, no kernel
        if lockstep is not None:
            ln.lockstep = lockstep
        ln._plan(rows, 28, 148 * 128, max_blocks=None, split_k=split_k, blocks=None, tile_tokens=tile_tokens)
        return ln.tiling

    for cls in (kq.GemmQ4kResidualRows, kq.GemmQ5kResidualRows, kq.GemmQ6kResidualRows):
        t = plan(cls, 1024)
        assert (t.tile_tokens, t.blocks, t.split) == (256, 112, False), cls.__name__
        assert plan(cls, 1024, lockstep=False).split, cls.__name__
        assert plan(cls, 512) == plan(cls, 512, lockstep=False), cls.__name__
        assert plan(cls, 1024, tile_tokens=128) == plan(cls, 1024, lockstep=False, tile_tokens=128), cls.__name__

def test_gemm_int4_launch_names_its_build_and_registers(monkeypatch):
    """The launchers take the build of the tile they pick (GEMM_BM=…, none for the default 128),
    its shared memory and 384 threads, and ask for the 168 registers the kernel's setmaxnreg
    moves balance at: a build with another count is refused before it could hang."""
    import types

    import numpy as np

    from drvqwen.launchers import GemmInt4ResidualRows, gemm_int4
    from drvqwen.launchers.base import BufferSpec, KernelRef

    monkeypatch.setattr(gemm_int4, "x_tensor_map", lambda x, rows, k, bm=128: ("x_map", bm))
    monkeypatch.setattr(gemm_int4, "persistent_grid", lambda tiles, mb: tiles if mb == 0 else min(tiles, 132))
    rows, n, k = 512, 896, 896
    bufs = [BufferSpec("res", (rows * n,), np.float32), BufferSpec("x", (rows * k,), np.float16),
            BufferSpec("qw", (n // 16, k // 128, 16, 16), np.uint32), BufferSpec("sc", (n, k // 128), np.float16),
            BufferSpec("ps", (2,), np.int32)]
    for tile, defines in ((None, (("GEMM_BM", 64),)), (128, ()), (256, (("GEMM_BM", 256),))):
        g = GemmInt4ResidualRows(*bufs, n=n, k=k, rows=rows, tile_tokens=tile)
        (spec,) = g.specs
        bm = tile or 64
        assert (g.tile_tokens, spec.kernel.defines, spec.kernel.registers) == (bm, defines, 168)
        assert (spec.block, spec.smem_bytes, spec.args["x_map"]) == ((384,), gemm_int4.smem_bytes(bm), ("x_map", bm))
        assert spec.grid == (min(132, -(-rows // bm) * 7),)
    fake = types.SimpleNamespace(num_registers=160)
    monkeypatch.setattr("drvqwen.launchers.base.load_kernel_module",
                        lambda file, defines: types.SimpleNamespace(function=lambda name: fake))
    with pytest.raises(LaunchError, match="built with 160 registers a thread, not 168"):
        KernelRef("gemm_int4", "gemm_int4_residual", registers=168).function()
    assert KernelRef("gemm_int4", "gemm_int4_residual").function() is fake


def test_attention_prefill_kv_splits_chosen_and_refused_with_their_reason():
    """launchers/attention_prefill: S = slots // (2 · units) in 1 … MAX_SPLITS (the 0.5B's 512 rows:
    64 units on 2 × 132 slots → 2; the 7B's: 128 units on 132 → 1; short chunks → at most 4), and
    a split launch refused without a scratch, past MAX_SPLITS, or with a scratch too small."""
    import types

    from drvqwen.launchers.attention_prefill import MAX_SPLITS, AttentionPrefill, split_count
    from drvqwen.launchers.base import NULL, BufferSpec

    assert (split_count(64, 264), split_count(128, 132), split_count(16, 264), split_count(0, 1)) == (2, 1, 4, 1)
    rows, hq, hkv, dh = 128, 14, 2, 64
    bufs = [BufferSpec(n, (rows * hq * dh,), np.float16) for n in ("out", "q")]
    bufs += [BufferSpec(n, (4, hkv, 16, dh), np.float16) for n in ("k", "v")]
    bufs += [BufferSpec("bt", (4,), np.int32), BufferSpec("ps", (2,), np.int32)]
    shape = dict(rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh)
    scratch = types.SimpleNamespace(tile_splits=16, heads=(hq, hkv, dh), part_o=BufferSpec("po", (1,), np.float32),
                                    part_ml=BufferSpec("pml", (1,), np.float32),
                                    counters=BufferSpec("c", (1,), np.uint32))
    whole = AttentionPrefill(*bufs, **shape)
    assert whole.specs[0].grid == (8, hkv, 1) and whole.specs[0].args["part_o"] is NULL
    split = AttentionPrefill(*bufs, **shape, kv_splits=2, scratch=scratch)
    assert split.specs[0].grid == (8, hkv, 2) and split.specs[0].args["counters"] is scratch.counters
    with pytest.raises(LaunchError, match="kv_splits=2 over 128 rows needs an AttentionSplitScratch of ≥ 16"):
        AttentionPrefill(*bufs, **shape, kv_splits=2)
    with pytest.raises(LaunchError, match="kv_splits=3 over 128 rows needs an AttentionSplitScratch of ≥ 24"):
        AttentionPrefill(*bufs, **shape, kv_splits=3, scratch=scratch)
    with pytest.raises(LaunchError, match=f"kv_splits={MAX_SPLITS + 1} must be an int in 1..{MAX_SPLITS}"):
        AttentionPrefill(*bufs, **shape, kv_splits=MAX_SPLITS + 1, scratch=scratch)
    other = types.SimpleNamespace(**{**vars(scratch), "heads": (28, 4, 128)})
    with pytest.raises(LaunchError, match="for heads 14/2, Dh 64"):
        AttentionPrefill(*bufs, **shape, kv_splits=2, scratch=other)


def test_attention_prefill_wgmma_engine_tiles_packed_rows_and_sizes_its_splits():
    """The wgmma engine: 128 packed (query, head) rows a block of 8 warps (512 rows × G = 7 heads:
    28 tiles), its swizzled stages' shared memory, S by split_count_wgmma (the 0.5B's 56 units on
    132 slots → 4, the 7B's 112 → 1), and a scratch sized in the mma engine's tile-split unit that
    covers its 8 warps' partials (64 rows at G = 7: 4 tiles × 8 warps > 4 × 7)."""
    import types

    from drvqwen.launchers.attention_prefill import (AttentionPrefill, query_tiles, smem_bytes, split_count_wgmma,
                                                     tile_splits_needed)
    from drvqwen.launchers.base import BufferSpec

    assert query_tiles(512, 28, 4, "wgmma") == 28 and query_tiles(512, 28, 4) == 32
    assert (split_count_wgmma(56, 132), split_count_wgmma(112, 132), split_count_wgmma(8, 132)) == (4, 1, 4)
    assert smem_bytes(128, engine="wgmma") == 4 * 2 * 64 * 256 + 1024
    assert tile_splits_needed(64, 2, 28, 4) == 8 and tile_splits_needed(64, 2, 28, 4, "wgmma") == 10
    for rows in range(64, 1025, 64):  # the scratch covers the kernel's partials (units · S · 8 warps) and counters
        for s in (2, 3, 4):
            need, tiles = tile_splits_needed(rows, s, 28, 4, "wgmma"), query_tiles(rows, 28, 4, "wgmma")
            assert need * 28 >= tiles * 4 * s * 8 and need >= tiles
    rows, hq, hkv, dh = 128, 14, 2, 64
    bufs = [BufferSpec(n, (rows * hq * dh,), np.float16) for n in ("out", "q")]
    bufs += [BufferSpec(n, (4, hkv, 16, dh), np.float16) for n in ("k", "v")]
    bufs += [BufferSpec("bt", (4,), np.int32), BufferSpec("ps", (2,), np.int32)]
    scratch = types.SimpleNamespace(tile_splits=tile_splits_needed(rows, 4, hq, hkv, "wgmma"), heads=(hq, hkv, dh),
                                    part_o=BufferSpec("po", (1,), np.float32),
                                    part_ml=BufferSpec("pml", (1,), np.float32), counters=BufferSpec("c", (1,), np.uint32))
    a = AttentionPrefill(*bufs, rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh, kv_splits=4, scratch=scratch,
                         engine="wgmma")
    spec = a.specs[0]
    assert spec.kernel.kernel == "attention_prefill_wgmma_hd64" and spec.grid == (7, hkv, 4) and spec.block == (256,)
    assert spec.smem_bytes == smem_bytes(64, engine="wgmma")
    with pytest.raises(LaunchError, match="engine='tma'"):
        AttentionPrefill(*bufs, rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh, engine="tma")


def test_attention_prefill_range_schedule_runs_its_own_build_and_defines_replace_it():
    """ENGINE_BUILDS: the range schedule compiles the three-warpgroup build with Q in shared
    memory (384 threads, 192 packed rows a tile, Q's rows in its shared memory, 12 warps'
    partials in the scratch it asks for), the split schedule the two-warpgroup one; a define
    given replaces the engine's own."""
    import types

    from drvqwen.launchers.attention_prefill import (AttentionPrefill, engine_build, query_tiles, smem_bytes,
                                                     tile_splits_needed)
    from drvqwen.launchers.base import BufferSpec

    assert dict(engine_build("wgmma-ranges")) == {"APW_WARPGROUPS": 3, "APW_Q_SMEM": 1}
    assert engine_build("wgmma") == () and engine_build("mma", (("APF_STAGES", 2),)) == (("APF_STAGES", 2),)
    assert dict(engine_build("wgmma-ranges", (("APW_WARPGROUPS", 2), ("APW_STAGES", 5)))) == {
        "APW_WARPGROUPS": 2, "APW_Q_SMEM": 1, "APW_STAGES": 5}
    assert query_tiles(1024, 28, 4, "wgmma-ranges") == 38 and query_tiles(1024, 28, 4, "wgmma") == 56
    assert query_tiles(1024, 28, 4, "wgmma-ranges", (("APW_WARPGROUPS", 2),)) == 56
    for rows in range(64, 1025, 64):  # 12 warps' partials a tile
        need, tiles = tile_splits_needed(rows, 4, 28, 4, "wgmma-ranges"), query_tiles(rows, 28, 4, "wgmma-ranges")
        assert need * 28 >= tiles * 4 * 4 * 12 and need >= tiles
    rows, hq, hkv, dh = 1024, 28, 4, 128
    bufs = [BufferSpec(n, (rows * hq * dh,), np.float16) for n in ("out", "q")]
    bufs += [BufferSpec(n, (64, hkv, 16, dh), np.float16) for n in ("k", "v")]
    bufs += [BufferSpec("bt", (64,), np.int32), BufferSpec("ps", (2,), np.int32)]
    scratch = types.SimpleNamespace(tile_splits=tile_splits_needed(rows, 4, hq, hkv, "wgmma-ranges"),
                                    heads=(hq, hkv, dh), part_o=BufferSpec("po", (1,), np.float32),
                                    part_ml=BufferSpec("pml", (1,), np.float32), counters=BufferSpec("c", (1,), np.uint32))
    occ = FixedOccupancy(132, lambda _k, _t, _s: 1)
    spec = AttentionPrefill(*bufs, rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh, kv_splits=4, scratch=scratch,
                            engine="wgmma-ranges", occupancy=occ).specs[0]
    assert spec.kernel.kernel == "attention_prefill_wgmma_ranges_hd128"
    assert dict(spec.kernel.defines) == {"APW_WARPGROUPS": 3, "APW_Q_SMEM": 1}
    assert spec.block == (384,) and spec.grid == (132, 1, 1)
    assert spec.smem_bytes == smem_bytes(128, engine="wgmma-ranges", q_rows=192) == smem_bytes(128, engine="wgmma") + 192 * 256
    small = types.SimpleNamespace(**{**vars(scratch), "tile_splits": tile_splits_needed(rows, 4, hq, hkv, "wgmma")})
    with pytest.raises(LaunchError, match="tile splits"):  # the two-warpgroup scratch is too small for 12 warps
        AttentionPrefill(*bufs, rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=dh, kv_splits=4, scratch=small,
                         engine="wgmma-ranges", occupancy=occ)


def test_rmsnorm_threads_refused_unless_a_warp_multiple_up_to_the_kernels_block():
    """RmsNorm(threads=) — the prefill's row_threads(D) blocks — must be a multiple of 32 in
    32 … THREADS; row_threads rounds a row's float4 count up to a warp, capped at THREADS."""
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.rmsnorm import THREADS, RmsNorm, row_threads

    assert (row_threads(896), row_threads(3584), row_threads(100), row_threads(16384)) == (224, 896, 32, THREADS)
    args = (BufferSpec("out", (2 * 896,), np.float16), BufferSpec("x", (2 * 896,), np.float32),
            BufferSpec("w", (896,), np.float16))
    assert RmsNorm(*args, dim=896, eps=1e-6, rows=2, threads=224).specs[0].block == (224,)
    assert RmsNorm(*args, dim=896, eps=1e-6, rows=2).specs[0].block == (THREADS,)
    for bad in (100, 16, THREADS + 32):
        with pytest.raises(LaunchError, match=f"rmsnorm: {bad} threads: a multiple of 32 in 32..{THREADS}"):
            RmsNorm(*args, dim=896, eps=1e-6, rows=2, threads=bad)


def test_q32_gemms_refuse_other_formats_k_stacks_and_tiles():
    """The Q4_0 / Q5_0 / Q8_0 prefill GEMMs (gemm_q32.py) take q4_g32, q5_g32 or q8_g32 weights, one format a
    launch, K a multiple of 128, one to three stacked matrices, a tile build that exists; each
    refusal is one line naming the weight, the count or the tile."""
    import numpy as np

    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.gemm_q32 import GemmQ32ResidualRows, GemmQ32StackedRows
    from drvqwen.launchers.gemv_fmt import FmtWeight, device_tensors

    def weight(fmt_name: str, name: str, n: int, k: int) -> FmtWeight:
        fmt = next(f for f in wf.FORMATS.values() if f.name == fmt_name)
        return FmtWeight(fmt, {t.rsplit(".", 1)[1]: BufferSpec(t, shape, dt)
                               for t, (dt, shape) in device_tensors(fmt, name, n, k).items()}, name)

    rows, n, k = 64, 128, 896
    x, ps = BufferSpec("x", (rows, k), np.float16), BufferSpec("ps", (2,), np.int32)
    res = BufferSpec("res", (rows * n,), np.float32)
    w5 = weight("q5_g32", "model.layers.0.self_attn.q_proj", n, k)
    w8 = weight("q8_g32", "model.layers.0.self_attn.v_proj", n, k)
    with pytest.raises(LaunchError, match="o_proj: format q4_k, these kernels read q4_g32, q5_g32, q8_g32, "
                                          "q4_g32_min, q5_g32_min only"):
        GemmQ32ResidualRows(res, BufferSpec("x", (rows, 1024), np.float16),
                            weight("q4_k", "model.layers.0.self_attn.o_proj", n, 1024), ps, n=n, k=1024, rows=rows,
                            max_blocks=132)
    with pytest.raises(LaunchError, match="K=96 must be a positive multiple of 128"):
        GemmQ32ResidualRows(res, BufferSpec("x", (rows, 96), np.float16), weight("q5_g32", "w", n, 96), ps, n=n,
                            k=96, rows=rows, max_blocks=132)
    out = BufferSpec("qkv", (rows * 4 * n,), np.float32)
    with pytest.raises(LaunchError, match="one to three weights with a row count each, got 4 and 4"):
        GemmQ32StackedRows(out, x, [w5] * 4, ps, ns=[n] * 4, k=k, rows=rows, ldo=4 * n, max_blocks=132)
    with pytest.raises(LaunchError, match=r"columns 8 … 263 outside ldo=256"):
        GemmQ32StackedRows(out, x, [w5, w5], ps, ns=[n, n], k=k, rows=rows, ldo=2 * n, col0=8, max_blocks=132)
    with pytest.raises(LaunchError, match="v_proj: format q8_g32, not q5_g32 as model.layers.0.self_attn.q_proj"):
        GemmQ32StackedRows(out, x, [w5, w8], ps, ns=[n, n], k=k, rows=rows, ldo=2 * n, max_blocks=132)
    with pytest.raises(LaunchError, match=r"gemm_q8g32_residual: tile of 96 tokens, want one of \(256, 128, 64\)"):
        GemmQ32ResidualRows(res, x, w8, ps, n=n, k=k, rows=rows, max_blocks=132, tile_tokens=96)


def test_attention_decode_cluster_is_one_launch_of_a_cluster_per_kv_head():
    """AttentionDecodeCluster: grid (CLUSTER, Hkv) — the kernel's __cluster_dims__ along x —,
    block 32 · WARPS, no partials, no combine; it refuses the shapes the split-KV kernels refuse."""
    from drvqwen.launchers import AttentionDecodeCluster
    from drvqwen.launchers.attention_decode_cluster import CLUSTER, N_SPLITS, WARPS
    from drvqwen.launchers.base import BufferSpec

    for hq, hkv, dh in ((28, 4, 128), (14, 2, 64)):
        bufs = [BufferSpec(n, (hq * dh,), np.float16) for n in ("out", "q")]
        bufs += [BufferSpec(n, (8, hkv, 16, dh), np.float16) for n in ("k", "v")]
        bufs += [BufferSpec("bt", (8,), np.int32), BufferSpec("state", (3,), np.int32)]
        a = AttentionDecodeCluster(*bufs, n_heads=hq, n_kv_heads=hkv, head_dim=dh)
        (spec,) = a.specs
        assert spec.kernel.kernel == f"attention_decode_cluster_hd{dh}"
        assert spec.grid == (CLUSTER, hkv)
        assert spec.block == (32 * WARPS,) and a.n_splits == N_SPLITS == CLUSTER * WARPS
        assert a.bytes_for(512) == 512 * 2 * hkv * dh * 2
        c16 = AttentionDecodeCluster(*bufs, n_heads=hq, n_kv_heads=hkv, head_dim=dh, defines=(("ACL_CLUSTER", 16),))
        assert c16.specs[0].grid == (16, hkv) and c16.n_splits == 16 * WARPS
        with pytest.raises(LaunchError, match="ACL_CLUSTER=17"):
            AttentionDecodeCluster(*bufs, n_heads=hq, n_kv_heads=hkv, head_dim=dh, defines=(("ACL_CLUSTER", 17),))
    with pytest.raises(LaunchError, match="head_dim"):
        AttentionDecodeCluster(*[BufferSpec(n, (28 * 96,), np.float16) for n in ("out", "q")],
                               *[BufferSpec(n, (8, 4, 16, 96), np.float16) for n in ("k", "v")],
                               BufferSpec("bt", (8,), np.int32), BufferSpec("state", (3,), np.int32),
                               n_heads=28, n_kv_heads=4, head_dim=96)


def test_attention_prefill_split_count_asks_the_occupancy_of_the_build_it_launches():
    """kv_splits_for sizes the grid by the blocks an SM holds of the build the launch compiles,
    its pipeline stages included (APW_STAGES: K/V tiles of shared memory)."""
    from drvqwen.launchers.attention_prefill import kv_splits_for, smem_bytes

    asked = []
    occ = FixedOccupancy(132, lambda _kernel, _threads, smem: asked.append(smem) or 1)
    for stages in (None, 3):
        kv_splits_for(512, 28, 4, 128, occ, "wgmma", (("APW_STAGES", stages),) if stages else ())
    assert asked == [smem_bytes(128, None, "wgmma"), smem_bytes(128, 3, "wgmma")] and asked[0] != asked[1]


def test_attention_combine_dim_splits_allowed_and_refused():
    """attention_combine over C blocks a head, 1024 / C threads each: every C from
    COMBINE_MIN_SPLIT to COMBINE_MAX_SPLIT dividing Dh; a block below one warp (C = 64 at Dh 64
    or 128: 16 threads) is refused — its lane-strided scan of the splits would miss some and its
    full-warp shuffle read lanes that do not exist — and so is a C not dividing Dh."""
    from drvqwen.launchers import Launcher
    from drvqwen.launchers.attention_decode import COMBINE_MAX_SPLIT, COMBINE_MIN_SPLIT, combine_launch
    from drvqwen.launchers.base import BufferSpec

    assert COMBINE_MAX_SPLIT == 1024 // 32
    for hq, dh in ((28, 128), (14, 64)):
        parts = tuple(BufferSpec(n, (n_, ), np.float32) for n, n_ in
                      (("po", 264 * hq * dh), ("ml", 264 * hq), ("es", 264 * hq)))
        out, state = BufferSpec("out", (hq * dh,), np.float16), BufferSpec("state", (3,), np.int32)
        for c in (4, 8, 16, 32):
            ln = Launcher()
            combine_launch(ln, out, parts, state, n_splits=264, n_heads=hq, head_dim=dh, dim_split=c)
            assert ln.specs[0].grid == (hq, c) and ln.specs[0].block == (1024 // c,)
        for c in (COMBINE_MIN_SPLIT // 2, 64, 6):
            with pytest.raises(LaunchError, match=f"dim_split={c};"):
                combine_launch(Launcher(), out, parts, state, n_splits=264, n_heads=hq, head_dim=dh, dim_split=c)


def test_decode_plan_short_attention_twin_over_the_same_buffers():
    """plan_decode(short_attention="cluster" or a tuple of kernels): for each kernel one cluster
    launcher per layer, keyed by the layer's attention entry, over the buffers that entry's
    launcher uses (attn, q, the layer's K/V views, block table, state) — "cluster16" the same
    kernel built in clusters of 16; refused with the persistent step, as the step's own
    attention, twice, or an unknown kernel."""
    from drvqwen.config import QWEN25_CODER_05B
    from drvqwen.decode import plan_decode
    from drvqwen.errors import DrvqwenError
    from drvqwen.launchers import AttentionDecodeCluster, FixedOccupancy

    occ = FixedOccupancy(132, lambda _k, _t, _s: 2)
    cfg = QWEN25_CODER_05B.with_layers(3)
    assert sorted(plan_decode(cfg, 256, occupancy=occ, short_attention="cluster").short_attention) == ["cluster"]
    plan = plan_decode(cfg, 256, occupancy=occ, short_attention=("cluster", "cluster16"))
    steps = dict(plan.steps)
    assert sorted(plan.short_attention) == ["cluster", "cluster16"]
    for kernel, entries in plan.short_attention.items():
        assert sorted(entries) == [f"L{l}.attention" for l in range(3)]
        for name, short in entries.items():
            assert isinstance(short, AttentionDecodeCluster)
            (spec,) = short.specs
            blocks = 16 if kernel == "cluster16" else 8
            assert spec.grid == (blocks, cfg.num_kv_heads) and short.n_splits == 8 * blocks
            assert spec.kernel.defines == ((("ACL_CLUSTER", 16),) if blocks == 16 else ())
            long_specs = steps[name].specs
            assert spec.args["q"] is long_specs[0].args["q"] and spec.args["out"] is long_specs[-1].args["out"]
            assert spec.args["state"] is long_specs[0].args["state"]
            assert spec.args["block_table"] is long_specs[0].args["block_table"]
            layer = name[1:].split(".")[0]
            assert tuple(spec.reads[1:3]) == (f"k_cache[{layer}]", f"v_cache[{layer}]")
            assert {f"k_cache[{layer}]", f"v_cache[{layer}]"} <= set(long_specs[0].reads)
    assert plan_decode(cfg, 256, occupancy=occ).short_attention == {}
    for bad in (dict(short_attention="cluster", attention="cluster"), dict(short_attention="tma"),
                dict(short_attention="cluster", attention="plain", persistent=True),
                dict(short_attention=("cluster", "cluster"))):
        with pytest.raises(DrvqwenError, match="short_attention="):
            plan_decode(cfg, 256, occupancy=occ, **bad)


def test_default_short_attention_follows_the_head_dim_and_the_attention():
    """decode.default_short_attention: the cluster kernel in clusters of 8 up to one page a split
    (64 splits × 16 tokens = 1024 positions) at head dim 128, two (2048) at 64, then in clusters
    of 16 up to twice that, behind the default attention only: none behind the plain kernel (the
    verify pass's bits), the cluster kernel itself, with the persistent step, or at a head dim it
    was not measured at."""
    from dataclasses import replace

    from drvqwen.config import PRESETS
    from drvqwen.decode import DEFAULT_ATTENTION, default_short_attention
    from drvqwen.launchers.attention_decode_cluster import N_SPLITS

    assert N_SPLITS == 64
    got = {name: default_short_attention(cfg, DEFAULT_ATTENTION, False) for name, cfg in PRESETS.items()}
    want = {name: (("cluster", 1024), ("cluster16", 2048)) if cfg.head_dim == 128 else
            (("cluster", 2048), ("cluster16", 4096)) for name, cfg in PRESETS.items()}
    assert got == want and got["7b"][0] == ("cluster", 1024) and got["0.5b"][-1] == ("cluster16", 4096)
    cfg = PRESETS["7b"]
    assert default_short_attention(cfg, "plain", False) == ()
    assert default_short_attention(cfg, "cluster", False) == ()
    assert default_short_attention(cfg, DEFAULT_ATTENTION, True) == ()
    assert default_short_attention(replace(cfg, head_dim=96), DEFAULT_ATTENTION, False) == ()


def test_the_engine_compiles_the_short_context_attention_where_its_step_runs_it():
    """engine_kernels lists attention_decode_cluster in both of its builds for the default step
    (its short-context bands) and neither for the speculative step, whose decode attention is the
    plain kernel throughout."""
    from drvqwen.config import PRESETS
    from drvqwen.engine import engine_kernels

    cfg = PRESETS["0.5b"]
    builds = {(n, tuple(sorted(dict(d).items()))) for n, d in engine_kernels(cfg)}
    assert {("attention_decode_cluster", ()), ("attention_decode_cluster", (("ACL_CLUSTER", 16),))} <= builds
    assert "attention_decode_cluster" not in {n for n, _d in engine_kernels(cfg, speculative=True)}


def test_launch_list_chain_picks_the_band_of_a_length():
    """LaunchList.for_length over a twin that has a twin of its own: the shortest band up to its
    length, the middle one up to its own, the step's list beyond; chain() lists them outermost
    first."""
    from drvqwen.launch_list import LaunchList

    inner = LaunchList("greedy+cluster", [])
    outer = LaunchList("greedy+cluster16", [], short=inner, short_below=1024)
    main = LaunchList("greedy", [], short=outer, short_below=2048)
    assert main.chain() == [main, outer, inner] and inner.chain() == [inner]
    assert [main.for_length(n).name for n in (1, 1024, 1025, 2048, 2049)] == [
        "greedy+cluster", "greedy+cluster", "greedy+cluster16", "greedy+cluster16", "greedy"]


@pytest.mark.parametrize("kwargs", [dict(short_attention="cluster"), dict(short_below=2048),
                                    dict(short_attention="cluster", short_below=-1)])
def test_decode_step_refuses_half_a_short_context_twin(kwargs):
    """DecodeStep(short_attention=, short_below=) takes both (a kernel and a length ≥ 1), neither
    (None), or the default ("auto" with no length): one line naming both values, before any GPU
    work or file access (here: no file at all)."""
    from drvqwen.decode import DecodeStep
    from drvqwen.errors import DrvqwenError

    want = (f"short_attention={kwargs.get('short_attention', 'auto')!r} with short_below={kwargs.get('short_below', 0)}: "
            "give both (a kernel and a length ≥ 1) or neither")
    with pytest.raises(DrvqwenError, match=f"^{re.escape(want)}$"):
        DecodeStep(None, **kwargs)


def test_stream_read_launch_and_its_refusals():
    """StreamRead: grid (blocks,), the kind's threads, the bulk ring's shared memory; an unknown
    kind, a slice not a whole number of units, or a misaligned source refused in one line."""
    import types

    from drvqwen.launchers import StreamRead
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.stream_read import CHUNK, STAGES, threads_of

    def bufs(blocks, per, kind, ptr=None):
        src = BufferSpec("src", (blocks * per,), np.uint8)
        if ptr is not None:
            src = types.SimpleNamespace(name="src", shape=(blocks * per,), dtype=np.uint8, ptr=ptr)
        return BufferSpec("out", (blocks * threads_of(kind),), np.uint32), src

    ld = StreamRead(*bufs(3, 4096, "ld"), blocks=3, bytes_per_block=4096, kind="ld").specs[0]
    assert ld.grid == (3,) and ld.block == (256,) and ld.smem_bytes == 0 and ld.args["vecs_per_block"].value == 256
    bulk = StreamRead(*bufs(2, 2 * CHUNK, "bulk"), blocks=2, bytes_per_block=2 * CHUNK, kind="bulk").specs[0]
    assert bulk.block == (128,) and bulk.smem_bytes == STAGES * CHUNK + STAGES * 8
    with pytest.raises(LaunchError, match=r"^stream_read: kind='tma', want one of \('ld', 'bulk'\)$"):
        StreamRead(*bufs(1, 4096, "ld"), blocks=1, bytes_per_block=4096, kind="tma")
    with pytest.raises(LaunchError, match=r"^stream_read: 1 blocks of 100 B; want ≥ 1 block and a multiple of 16 B$"):
        StreamRead(*bufs(1, 100, "ld"), blocks=1, bytes_per_block=100)
    with pytest.raises(LaunchError, match=f"a multiple of {CHUNK} B$"):
        StreamRead(*bufs(1, 4096, "bulk"), blocks=1, bytes_per_block=4096, kind="bulk")
    with pytest.raises(LaunchError, match=r"^stream_read: src must be 16-byte aligned$"):
        StreamRead(*bufs(1, 4096, "ld", ptr=8), blocks=1, bytes_per_block=4096)


@pytest.mark.parametrize("head_dim", [8, 24, 40])
def test_int4_qkv_rope_gemm_refuses_a_head_dim_the_device_layout_cannot_pair(head_dim):
    """gemm_int4_qkv_rope finds a row's words by its tile and slot in the INT4 device layout
    (int4_matmul.cuh: int4_pair_row), which pairs RoPE dims within 16-row tiles: a head_dim that
    is even but no multiple of 16 would read other heads' rows, so the launcher refuses it (the
    K-quant and Q4/5/8_0 launchers, on row-major weights, keep any even head_dim)."""
    import numpy as np

    from drvqwen.launchers import GemmInt4QkvRopeRows
    from drvqwen.launchers.base import BufferSpec

    hq, hkv, k, rows = 2, 1, 128, 4
    nq, nkv = hq * head_dim, hkv * head_dim
    b = lambda name, n, dt: BufferSpec(name, (n,), dt)  # noqa: E731
    cache = BufferSpec("k_cache", (4, hkv, 16, head_dim), np.float16)
    with pytest.raises(LaunchError, match=rf"gemm_int4_qkv_rope: head_dim={head_dim} must be a multiple of 16"):
        GemmInt4QkvRopeRows(b("q", rows * nq, np.float16), cache, cache, b("x", rows * k, np.float16),
                            b("qw", nq * k // 8, np.uint32), b("qs", nq * k // 128, np.float16),
                            b("kw", nkv * k // 8, np.uint32), b("ks", nkv * k // 128, np.float16),
                            b("vw", nkv * k // 8, np.uint32), b("vs", nkv * k // 128, np.float16),
                            b("qb", nq, np.float16), b("kb", nkv, np.float16), b("vb", nkv, np.float16),
                            b("cs", rows * head_dim, np.float32), b("ps", 2, np.int32), b("bt", 4, np.int32),
                            n_heads=hq, n_kv_heads=hkv, head_dim=head_dim, k=k, rows=rows)


def test_mixed_format_qkv_splits_its_grid_by_the_parts_tiles():
    """A QKV launch with q, k in a K-quant and v in Q6_K (gemm_kquant.plan_parts): the 7B's parts
    are 32 and 4 row blocks. Stream-K ranges give v its row blocks' share of P; one wave of whole
    tiles gives each part its tiles; where P divides the launch's tiles but not the parts' (2 688
    rows: 11 × 36 = 3 rounds of 132), whole tiles would take 4 rounds in the q/k part, so the plan
    takes ranges where the scratch allows, else the v blocks of the fewest rounds."""
    from dataclasses import replace

    from drvqwen.launchers.gemm_int4 import GemmTiling
    from drvqwen.launchers.gemm_kquant import plan_parts, v_part_blocks

    asked = []

    def fits(answer):
        def ranges_fit():
            asked.append(answer)
            return answer
        return ranges_fit

    ranges = GemmTiling(256, 132, True, 0.0)
    assert plan_parts(ranges, 2, 32, 4, fits(True)) == (ranges, 15) == (ranges, v_part_blocks(132, 32, 4))
    one_wave = GemmTiling(256, 72, False, 0.0)  # 512 rows: 2 × 36 tiles, a block each
    assert plan_parts(one_wave, 2, 32, 4, fits(True)) == (one_wave, 8)
    assert not asked, "no scratch question where the parts' rounds are the launch's"
    rounds3 = GemmTiling(256, 132, False, 0.0)  # 2 688 rows: 396 tiles
    assert plan_parts(rounds3, 11, 32, 4, fits(True)) == (replace(rounds3, split=True), 15)
    whole, v = plan_parts(rounds3, 11, 32, 4, fits(False))
    assert whole == rounds3 and max(-(-352 // (132 - v)), -(-44 // v)) == 4 and asked == [True, False]
    with pytest.raises(LaunchError, match="a plan of 1 block, want 2 or more"):
        plan_parts(GemmTiling(256, 1, False, 0.0), 1, 32, 4, fits(True))


def test_mixed_format_qkv_refuses_pairs_across_a_row_block():
    """With v in Q6_K, q's and k's RoPE pairs must fill whole 64-pair row blocks (no block may hold
    both formats): Hq = 2, Hkv = 1, Dh = 64 gives 96, refused with the count named before anything is
    planned."""
    from drvqwen.format import weight_formats as wf
    from drvqwen.launchers import BufferSpec, FmtWeight
    from drvqwen.launchers.gemm_kquant import GemmQ4kQkvRopeRows
    from drvqwen.launchers.gemv_fmt import device_tensors

    k, hd, rows = 256, 64, 64
    arr = BufferSpec  # (name, shape, dtype): what the checks read of a buffer

    def weight(fmt_name, n, name):
        fmt = next(f for f in wf.FORMATS.values() if f.name == fmt_name)
        return FmtWeight(fmt, {t.rsplit(".", 1)[1]: BufferSpec(t, shape, dt)
                               for t, (dt, shape) in device_tensors(fmt, name, n, k).items()}, name)

    ws = [weight("q4_k", 2 * hd, "wq"), weight("q4_k", hd, "wk"), weight("q6_k", hd, "wv")]
    caches = [arr(n, (4, 1, 16, hd), np.float16) for n in ("k_cache", "v_cache")]
    biases = [arr(f"b{i}", (n,), np.float16) for i, n in enumerate((2 * hd, hd, hd))]
    with pytest.raises(LaunchError, match="96 RoPE pairs must fill whole row blocks of 64"):
        GemmQ4kQkvRopeRows(arr("q", (rows, 2, hd), np.float16), *caches, arr("x", (rows, k), np.float16), *ws,
                              *biases, arr("cs", (rows, hd // 2, 2), np.float32), arr("ps", (2,), np.int32),
                              arr("bt", (4,), np.int32), n_heads=2, n_kv_heads=1, head_dim=hd, k=k, rows=rows)
    # the rule the prefill asks before it picks the launch: the 7B's q/k (3584 + 512 rows) fills
    # 32 row blocks, the 0.5B's (896 + 128) 8, and these 96 pairs do not
    from drvqwen.launchers.gemm_kquant import qk_pairs_fill_row_blocks
    assert qk_pairs_fill_row_blocks(3584, 512) and qk_pairs_fill_row_blocks(896, 128)
    assert not qk_pairs_fill_row_blocks(2 * hd, hd)
