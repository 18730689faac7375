"""kernels/rope_kv.cu: QKV bias + rotate-half RoPE + the K/V write into the paged cache for the
rows of a prefill chunk (rope_kv_rows; a decode step does this in gemv_int4_qkv_rope, tested
in test_kernel_gemv_int4.py).

Against reference.rope_inv_freq / rope_cos_sin / apply_rope in float64 on the kernel's exact
FP32 q/k/v and FP16 biases. The cache starts as NaN (0xFF bytes) and pages come from a
shuffled table: only the chunk's slots may change, and they must hold the reference values.
Positions up to 30039 check the angle arithmetic (float32(pos) · inv_freq, accurate sincosf).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import launchers
from drvqwen import reference as ref
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.prefill import ROW_BUCKET
from kernel_testing import dev, report  # noqa: F401

pytestmark = pytest.mark.gpu

# FP32 inputs, one FP16 rounding of the output: 2^-11 relative per element at worst.
TOL_ROPE = 1e-3


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
    launchers.RopeKvRows(q_out, k_cache, v_cache, dev.upload("qkv", qkv), dev.upload("bq", bq), dev.upload("bk", bk),
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
