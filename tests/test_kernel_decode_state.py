"""kernels/decode_state.cu: advance_state, and a captured graph chaining
argmax_final → advance_state → embedding as the decode graph does; advance_state_tokens, the
verify pass's advance by T positions.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


def test_advance_state_and_graph_chain(dev, rng):
    """argmax_final → advance_state → embedding, captured once, replayed: the next step's
    embedding reads the token the previous step chose, with no host round trip."""
    from drvqwen.cuda import Stream, capture
    from drvqwen.launchers import AdvanceState, ArgmaxFinal, Embedding

    v, d, n_part = 300, 128, 4
    table = rng.standard_normal((v, d), dtype=np.float32).astype(np.float16)
    state = dev.upload("state", np.array([7, 123, 8], dtype=np.int32))
    pv = dev.upload("pv", np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32))
    pi = dev.upload("pi", np.array([10, 42, 99, 7], dtype=np.int32))
    token = dev.poisoned("token", (1,), np.int32)
    residual = dev.poisoned("residual", (d,), np.float32)
    steps = [ArgmaxFinal(token, pv, pi, n_partials=n_part), AdvanceState(state, token),
             Embedding(residual, dev.upload("embed", table), state, vocab_size=v, dim=d)]
    with Stream() as stream:
        with capture(stream) as cap:
            for s in steps:
                s.launch(stream)
        exe = cap.graph.instantiate()
        cap.graph.destroy()
        exe.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(state.download(), [8, 42, 9])
        np.testing.assert_array_equal(residual.download(), table[42].astype(np.float32))
        pv.upload(np.array([5.0, 3.0, 3.0, 2.0], dtype=np.float32))  # a new winner: index 10
        exe.launch(stream)
        stream.synchronize()
        exe.destroy()
    np.testing.assert_array_equal(state.download(), [9, 10, 10])
    np.testing.assert_array_equal(residual.download(), table[10].astype(np.float32))


@pytest.mark.parametrize("T", [1, 5, 16])
def test_advance_state_tokens_moves_by_t_and_takes_the_last_choice(dev, rng, T):
    """advance_state_tokens (the verify pass's last launch): state = (pos + T, next_token[T-1],
    seq_len + T), what T advance_state launches leave; next_token is read, never written."""
    from drvqwen.launchers import AdvanceState

    pos = int(rng.integers(0, 1000))
    choices = rng.integers(0, 150000, T).astype(np.int32)
    state = dev.upload("state", np.array([pos, 77, pos + 1], dtype=np.int32))
    next_token = dev.upload("next_token", choices)
    AdvanceState(state, next_token, n_tokens=T).launch()
    np.testing.assert_array_equal(state.download(), [pos + T, choices[-1], pos + 1 + T])
    np.testing.assert_array_equal(next_token.download(), choices)
