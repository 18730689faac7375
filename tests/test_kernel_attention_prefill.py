"""kernels/attention_prefill.cu (engine "mma") and kernels/attention_prefill_wgmma.cu ("wgmma")
against reference.attention over the gathered paged cache.

Chunks of T queries at positions start … start+T-1 — lengths on and around page (16) and
tile (64) boundaries, a chunk continuing an earlier one, a long context — at the 0.5B
(Dh 64, 14/2 heads) and 7B (Dh 128, 28/4 heads) shapes. Pages come from a shuffled free list;
every slot past the sequence, every unused page and the query rows past T are NaN; the output
is poisoned and rows past T must stay untouched.

Each case runs whole (S = 1) and with its positions split over S = 2, 3, 4 blocks per query tile
(the last split combining the partials): the partials start poisoned (0xFF bytes: NaN), so a
split that combined a partial nobody stored would show, and the counters must be back at zero
after every launch.
"""

import numpy as np
import pytest

from drvqwen import launchers
from drvqwen.launchers.attention_prefill import ENGINES, AttentionSplitScratch, tile_splits_needed
from drvqwen.prefill import ROW_BUCKET
from drvqwen import reference as ref
from drvqwen.kv_cache import PAGE_TOKENS

from kernel_testing import TOL_ATTENTION, assert_same_bits, dev, report  # noqa: F401

pytestmark = pytest.mark.gpu

SHAPES = [(64, 14, 2), (128, 28, 4)]             # (head_dim, Hq, Hkv)
CASES = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 100), (0, 129), (37, 50), (500, 13), (16, 16), (2000, 64)]


# The other GQA groups of the Qwen2.5 family (1.5B: 12/2, 3B: 16/2, 14B and 32B: 40/8) and one
# head per KV head: blocks of 6, 8, 5 and 1 warps stage a tile in uneven row loops.
GROUPS = [(128, 12, 2), (128, 16, 2), (128, 40, 8), (64, 2, 2)]
GROUP_CASES = [(0, 100), (37, 50), (2000, 64)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("splits", [1, 2, 3, 4], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("hd,hq,hkv", SHAPES, ids=["hd64", "hd128"])
@pytest.mark.parametrize("start,t", CASES, ids=[f"start{s}-T{t}" for s, t in CASES])
def test_attention_prefill(dev, rng, hd, hq, hkv, start, t, splits, engine):
    check_attention_prefill(dev, rng, hd, hq, hkv, start, t, splits, engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("hd,hq,hkv", GROUPS, ids=[f"hd{d}-{q}q{k}kv" for d, q, k in GROUPS])
@pytest.mark.parametrize("start,t", GROUP_CASES, ids=[f"start{s}-T{t}" for s, t in GROUP_CASES])
def test_attention_prefill_other_groups(dev, rng, hd, hq, hkv, start, t, splits, engine):
    check_attention_prefill(dev, rng, hd, hq, hkv, start, t, splits, engine)


# The wgmma kernel's measured builds (its header): Q read from shared memory, and with it three
# MMA warpgroups a block (192 packed rows, 12 warps: the partial slots and the grid follow).
# Every build of the wgmma kernel, on both schedules (each engine's own runs in the tests above).
BUILDS = {"wg2": (("APW_WARPGROUPS", 2), ("APW_Q_SMEM", 0)), "q_smem": (("APW_WARPGROUPS", 2), ("APW_Q_SMEM", 1)),
          "wg3": (("APW_WARPGROUPS", 3), ("APW_Q_SMEM", 1))}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("engine", ["wgmma", "wgmma-ranges"])
@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("hd,hq,hkv", SHAPES + GROUPS, ids=["hd64", "hd128"] + [f"hd{d}-{q}q{k}kv" for d, q, k in GROUPS])
@pytest.mark.parametrize("start,t", CASES, ids=[f"start{s}-T{t}" for s, t in CASES])
def test_attention_prefill_builds(dev, rng, hd, hq, hkv, start, t, splits, engine, build):
    check_attention_prefill(dev, rng, hd, hq, hkv, start, t, splits, engine, defines=BUILDS[build])


def check_attention_prefill(dev, rng, hd, hq, hkv, start, t, splits, engine="mma", defines=()):
    """One chunk of t queries at positions start … start + t − 1 against the float64 reference,
    rows past t untouched, the counters back at zero, the same bits when launched again."""
    s_len = start + t
    rows = -(-t // ROW_BUCKET) * ROW_BUCKET
    n_pages = -(-s_len // PAGE_TOKENS) + 3                            # spare pages stay NaN
    block_table = rng.permutation(n_pages).astype(np.int32)
    k_cache = np.full((n_pages, hkv, PAGE_TOKENS, hd), np.nan, np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    k_seq = rng.standard_normal((s_len, hkv, hd)).astype(np.float16)
    v_seq = rng.standard_normal((s_len, hkv, hd)).astype(np.float16)
    ref.write_pages(k_cache, block_table, np.arange(s_len), k_seq)
    ref.write_pages(v_cache, block_table, np.arange(s_len), v_seq)
    q = np.full((rows, hq, hd), np.nan, np.float16)
    q[:t] = (rng.standard_normal((t, hq, hd)) * 1.5).astype(np.float16)  # peaky enough softmax

    out = dev.poisoned("out", (rows, hq, hd), np.float16)
    scratch = None
    if splits > 1:
        scratch = AttentionSplitScratch(dev.array, tile_splits_needed(rows, splits, hq, hkv, engine, defines),
                                        hq, hkv, hd)
        scratch.part_o.fill_bytes(0xFF)
        scratch.part_ml.fill_bytes(0xFF)
    attn = launchers.AttentionPrefill(out, dev.upload("q", q), dev.upload("k", k_cache), dev.upload("v", v_cache),
                              dev.upload("bt", block_table), dev.upload("ps", np.array([start, t], np.int32)),
                              rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=hd, kv_splits=splits, scratch=scratch,
                              engine=engine, defines=defines)
    attn.launch()
    got = out.download()
    want = ref.attention(q[:t].astype(np.float64), k_seq.astype(np.float64), v_seq.astype(np.float64),
                         start + np.arange(t))
    report(f"attention_prefill[{engine}{''.join(f' {k}={v}' for k, v in defines)}] hd{hd} start={start} T={t} "
           f"S={splits}", got[:t], want, TOL_ATTENTION)
    assert np.isnan(got[t:].astype(np.float32)).all(), "rows past n_rows were written"
    if scratch is not None:
        assert not scratch.counters.download().any(), "a split counter was left non-zero"
    attn.launch()
    assert_same_bits("attention_prefill", got, out.download())
