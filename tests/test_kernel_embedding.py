"""kernels/embedding.cu: the FP16 row of the token in state[1] (or ids[t]) into the FP32 residual.

Exact (an FP16 → FP32 conversion is exact). A token id outside [0, V) must give NaN, not an
out-of-bounds read.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu

# (label, V, D): the 0.5B table is real-sized; the 7B width with a shorter table (the kernel's
# work does not depend on V, only its bounds check does).
CASES = [("0.5b", 151936, 896), ("7b.d", 4099, 3584), ("odd", 37, 136)]


@pytest.mark.parametrize("label,v,d", CASES, ids=[c[0] for c in CASES])
def test_embedding_decode(dev, rng, label, v, d):
    from drvqwen.launchers import Embedding

    table = rng.standard_normal((v, d), dtype=np.float32).astype(np.float16)
    embed = dev.upload("embed", table)
    state = dev.upload("state", np.array([5, 0, 6], dtype=np.int32))
    out = dev.poisoned("residual", (d,), np.float32)
    ln = Embedding(out, embed, state, vocab_size=v, dim=d)
    for token in (0, v - 1, int(rng.integers(0, v))):
        state.upload(np.array([5, token, 6], dtype=np.int32))
        out.fill_bytes(0xFF)
        ln.launch()
        np.testing.assert_array_equal(out.download(), table[token].astype(np.float32))
    for token in (-1, v):
        state.upload(np.array([5, token, 6], dtype=np.int32))
        ln.launch()
        assert np.isnan(out.download()).all(), f"token {token} out of range must give NaN"


def test_embedding_rows(dev, rng):
    from drvqwen.launchers import EmbeddingRows

    v, d, t = 1000, 896, 7
    table = rng.standard_normal((v, d), dtype=np.float32).astype(np.float16)
    ids = rng.integers(0, v, size=t).astype(np.int32)
    out = dev.poisoned("residual", (t, d), np.float32)
    EmbeddingRows(out, dev.upload("embed", table), dev.upload("ids", ids), n_rows=t, vocab_size=v, dim=d).launch()
    np.testing.assert_array_equal(out.download(), table[ids].astype(np.float32))
