"""kernels/l2_prefetch.cu on the GPU: a launch over awkward spans — parts that end at the buffer's
last bytes, heads of several chunks, a whole buffer, every span of the launch used or one — completes, and
writes nothing: the spans' buffers and a guard buffer after them keep their bytes. (What it is
for, weights found in L2, is a timing: tools/bench_decode_ablation.py --l2-prefetch-mb; that the
decode step gives the same bits with it: tests/test_decode_step.py.)

test_l2_prefetch_writes_nothing is the case compute-sanitizer runs (tools/sanitize_nodes.txt).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


def test_l2_prefetch_writes_nothing(dev, rng):
    from drvqwen.launchers import L2Prefetch
    from drvqwen.launchers.l2_prefetch import CHUNK_BYTES, SPANS, L2Span

    # Byte counts that are multiples of 16 but of nothing larger, one of several chunks.
    sizes = [16 * 1001, 3 * CHUNK_BYTES + 16 * 37, 16 * 5, 16 * 4096 + 16]
    hosts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    bufs = [dev.upload(f"w{i}", h) for i, h in enumerate(hosts)]
    guard = dev.poisoned("guard", (4096,), np.uint8)
    spans = [
        L2Span(bufs[0], sizes[0], 7, 3, 16 * 143, 16 * 200),           # parts of 2–3 units, heads shorter
        L2Span(bufs[1], sizes[1], 1, 1, 0, sizes[1]),                   # whole, 4 chunks (the last short)
        L2Span(bufs[2], sizes[2], 5, 5, 16, 32),                        # heads past the buffer's end: clipped
        L2Span(bufs[3], sizes[3], 4097, 64, 16, 2 * CHUNK_BYTES),       # heads of 2 chunks, past their part
    ]
    for chosen in (spans, spans[1:2], (spans * SPANS)[:SPANS]):
        ln = L2Prefetch(chosen)
        ln.launch()
        assert ln.bytes_moved == sum(s.n_bytes for s in chosen) > 0
    for i, (b, h) in enumerate(zip(bufs, hosts)):
        assert np.array_equal(b.download(), h), f"span buffer {i} changed"
    assert (guard.download() == 0xFF).all(), "the guard buffer changed"
