"""kernels/argmax.cu: the two-pass deterministic argmax over fp32 logits.

Ties (lowest index wins), all-equal, extremes and -inf against np.argmax; NaN against the
CPU's greedy choice (sampler.argmax: a NaN never wins, the same order on both backends).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.sampler import argmax as sampler_argmax

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["random", "ties", "all_equal", "last", "first_and_last", "negative", "neg_inf",
                                  "nan"])
def test_argmax_two_pass(dev, rng, case):
    from drvqwen.launchers import Argmax

    v, n_part = 152064, 264
    x = rng.standard_normal(v).astype(np.float32)
    if case == "ties":
        idx = np.sort(rng.choice(v, size=5, replace=False))
        x[idx] = x.max() + 1.0
    elif case == "all_equal":
        x[:] = 0.25
    elif case == "last":
        x[-1] = x.max() + 1.0
    elif case == "first_and_last":
        x[0] = x[-1] = x.max() + 1.0
    elif case == "negative":
        x = -np.abs(x) - 1.0
    elif case == "neg_inf":
        x[rng.choice(v, size=1000, replace=False)] = -np.inf
    elif case == "nan":
        x[rng.choice(v, size=1000, replace=False)] = np.nan
        x[0] = np.nan
    want = sampler_argmax(x)  # == np.argmax(x) without NaN; a NaN never wins (the CPU's order too)
    token = dev.poisoned("token", (1,), np.int32)
    ln = Argmax(token, dev.upload("logits", x), dev.poisoned("pv", (n_part,), np.float32),
                dev.poisoned("pi", (n_part,), np.int32), vocab_size=v, n_partials=n_part)
    ln.launch()
    assert int(token.download()[0]) == want, case
    ln.launch()
    assert int(token.download()[0]) == want, case


def test_argmax_nan_order_small(dev):
    """[0, 1, 2, NaN, 4, 5] → 5 on the GPU and on the CPU (numpy's np.argmax says 3)."""
    from drvqwen.launchers import Argmax

    for x in (np.array([0, 1, 2, np.nan, 4, 5], np.float32), np.full(7, np.nan, np.float32),
              np.array([np.nan, 3, np.nan, 3], np.float32)):
        token = dev.poisoned("token", (1,), np.int32)
        Argmax(token, dev.upload("logits", x), dev.poisoned("pv", (2,), np.float32),
               dev.poisoned("pi", (2,), np.int32), vocab_size=x.size, n_partials=2).launch()
        assert int(token.download()[0]) == sampler_argmax(x), x
        dev.close()
