"""kernels/prefill_state.cu: the two scalar updates around a prefill, queued on the stream."""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import launchers

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


def test_prefill_state_kernels(dev):
    ps = dev.poisoned("ps", (2,), np.int32)
    launchers.PrefillBeginChunk(ps).set(1536, 513).launch()
    assert ps.download().tolist() == [1536, 513]
    state = dev.poisoned("state", (3,), np.int32)
    launchers.DecodeResume(state, dev.upload("next", np.array([4242], np.int32))).set(100).launch()
    assert state.download().tolist() == [100, 4242, 101]
