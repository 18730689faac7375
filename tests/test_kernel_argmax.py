"""kernels/argmax.cu: the two-pass deterministic argmax over fp32 logits.

Ties (lowest index wins), all-equal, extremes and -inf against np.argmax.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["random", "ties", "all_equal", "last", "first_and_last", "negative", "neg_inf"])
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
    token = dev.poisoned("token", (1,), np.int32)
    ln = Argmax(token, dev.upload("logits", x), dev.poisoned("pv", (n_part,), np.float32),
                dev.poisoned("pi", (n_part,), np.int32), vocab_size=v, n_partials=n_part)
    ln.launch()
    assert int(token.download()[0]) == int(np.argmax(x)), case
    ln.launch()
    assert int(token.download()[0]) == int(np.argmax(x)), case
