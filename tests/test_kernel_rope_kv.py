"""kernels/rope_kv.cu: QKV bias + rotate-half RoPE + the K/V write into the paged cache, for one
decode token (rope_kv) and for the rows of a prefill chunk (rope_kv_rows).

Against reference.rope_inv_freq / rope_cos_sin / apply_rope in float64 on the kernel's exact
FP32 q/k/v and FP16 biases. The cache starts as NaN (0xFF bytes) and pages come from a
shuffled table: exactly one slot per KV head may change (the one at state[0]), and it must
hold the reference value. Positions up to 32767 check the angle arithmetic (float32(pos) ·
inv_freq, accurate sincosf).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import launchers as K
from drvqwen import reference as ref
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.launchers.gemm_int4 import BM as ROW_BUCKET
from kernel_testing import TOL_GEMV, assert_same_bits, dev, report  # noqa: F401

pytestmark = pytest.mark.gpu

# FP32 inputs, one FP16 rounding of the output: 2^-11 relative per element at worst.
TOL_ROPE = 1e-3

THETA = 1e6
MODELS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
POSITIONS = [0, 1, 15, 16, 17, 1000, 32767]
N_PAGES = 9          # physical pages in the test cache
MAX_PAGES = 32768 // 16


@pytest.mark.parametrize("model", list(MODELS))
def test_rope_kv(dev, rng, model):
    from drvqwen.launchers import RopeKv

    hq, hkv, dh = MODELS[model]
    nq, nkv = hq * dh, hkv * dh
    qkv = (2 * rng.standard_normal(nq + 2 * nkv)).astype(np.float32)
    bq, bk, bv = (rng.standard_normal(n).astype(np.float16) * np.float16(5) for n in (nq, nkv, nkv))
    inv_freq = ref.rope_inv_freq(dh, THETA)
    block_table = rng.integers(0, N_PAGES, size=MAX_PAGES).astype(np.int32)  # shuffled pages

    q_out = dev.poisoned("q", (hq, dh), np.float16)
    k_cache = dev.poisoned("k_cache", (N_PAGES, hkv, 16, dh), np.float16)
    v_cache = dev.poisoned("v_cache", (N_PAGES, hkv, 16, dh), np.float16)
    state = dev.upload("state", np.array([0, 0, 1], dtype=np.int32))
    ln = RopeKv(q_out, k_cache, v_cache, dev.upload("qkv", qkv), dev.upload("bq", bq),
                dev.upload("bk", bk), dev.upload("bv", bv), dev.upload("inv_freq", inv_freq), state,
                dev.upload("block_table", block_table), n_heads=hq, n_kv_heads=hkv, head_dim=dh)

    q64 = (qkv[:nq].astype(np.float64) + bq).reshape(1, hq, dh)
    k64 = (qkv[nq:nq + nkv].astype(np.float64) + bk).reshape(1, hkv, dh)
    v64 = (qkv[nq + nkv:].astype(np.float64) + bv).reshape(hkv, dh)
    for pos in POSITIONS:
        state.upload(np.array([pos, 0, pos + 1], dtype=np.int32))
        q_out.fill_bytes(0xFF)
        k_cache.fill_bytes(0xFF)
        v_cache.fill_bytes(0xFF)
        ln.launch()
        cos, sin = ref.rope_cos_sin(np.array([pos]), dh, THETA)
        q_want = ref.apply_rope(q64, cos.astype(np.float64), sin.astype(np.float64))[0]
        k_want = ref.apply_rope(k64, cos.astype(np.float64), sin.astype(np.float64))[0]
        got_q = q_out.download()
        report(f"{model}.pos{pos}.q", got_q, q_want, TOL_GEMV)
        page, slot = block_table[pos // 16], pos % 16
        for name, cache, want in (("k", k_cache, k_want), ("v", v_cache, v64)):
            got = cache.download()
            report(f"{model}.pos{pos}.{name}", got[page, :, slot, :], want, TOL_GEMV)
            untouched = np.ones(got.shape[:3], dtype=bool)
            untouched[page, :, slot] = False
            bits = got.view(np.uint16)[untouched]
            assert (bits == 0xFFFF).all(), f"{name}_cache: a slot other than pos {pos} was written"
        ln.launch()
        assert_same_bits(f"{model}.pos{pos}.q", got_q, q_out.download())


@pytest.mark.parametrize("hd,hq,hkv", [(64, 14, 2), (128, 28, 4)], ids=["hd64", "hd128"])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 17), (5, 100), (30000, 40)])
def test_rope_kv_rows(dev, rng, hd, hq, hkv, start, n):
    rows = -(-n // ROW_BUCKET) * ROW_BUCKET
    nq, nkv = hq * hd, hkv * hd
    n_pages = -(-(start + n) // PAGE_TOKENS) + 2
    block_table = rng.permutation(n_pages).astype(np.int32)
    qkv = np.full((rows, nq + 2 * nkv), np.nan, np.float32)
    qkv[:n] = rng.standard_normal((n, nq + 2 * nkv)).astype(np.float32)
    bq, bk, bv = (rng.standard_normal(x).astype(np.float16) * np.float16(0.1) for x in (nq, nkv, nkv))
    inv_freq = ref.rope_inv_freq(hd, 1e6)
    q_out = dev.poisoned("q", (rows, hq, hd), np.float16)
    k_cache = dev.poisoned("k", (n_pages, hkv, PAGE_TOKENS, hd), np.float16)
    v_cache = dev.poisoned("v", (n_pages, hkv, PAGE_TOKENS, hd), np.float16)
    K.RopeKvRows(q_out, k_cache, v_cache, dev.upload("qkv", qkv), dev.upload("bq", bq), dev.upload("bk", bk),
                 dev.upload("bv", bv), dev.upload("inv_freq", inv_freq),
                 dev.upload("ps", np.array([start, n], np.int32)), dev.upload("bt", block_table),
                 rows=rows, n_heads=hq, n_kv_heads=hkv, head_dim=hd).launch()

    pos = start + np.arange(n)
    x = qkv[:n].astype(np.float64)
    q = (x[:, :nq] + bq.astype(np.float64)).reshape(n, hq, hd)
    k = (x[:, nq:nq + nkv] + bk.astype(np.float64)).reshape(n, hkv, hd)
    v = (x[:, nq + nkv:] + bv.astype(np.float64)).reshape(n, hkv, hd)
    cos, sin = ref.rope_cos_sin(pos, hd, 1e6)
    got_q = q_out.download()
    report("rope_kv_rows q", got_q[:n], ref.apply_rope(q, cos.astype(np.float64), sin.astype(np.float64)), TOL_ROPE)
    assert np.isnan(got_q[n:].astype(np.float32)).all()
    kc, vc = k_cache.download(), v_cache.download()
    report("rope_kv_rows k", ref.gather_pages(kc, block_table, start + n)[start:],
           ref.apply_rope(k, cos.astype(np.float64), sin.astype(np.float64)), TOL_ROPE)
    report("rope_kv_rows v", ref.gather_pages(vc, block_table, start + n)[start:], v, TOL_ROPE)
    # Nothing else in the cache was touched.
    written = np.zeros(kc.shape[:1] + kc.shape[2:3], bool)          # [page, slot]
    written[block_table[pos // PAGE_TOKENS], pos % PAGE_TOKENS] = True
    for c in (kc, vc):
        assert np.isnan(c.transpose(0, 2, 1, 3)[~written].astype(np.float32)).all()
