"""kernels/stream_read.cu (the streaming microbenchmark's kernels) against numpy: every byte of
each block's slice read once, nothing past it — each block's threads' XOR checksums XOR to the
block's words' XOR; the output poisoned first, every word written. Small slices with several
batches (ld) and ring laps (bulk), a block count that does not divide anything evenly, and the
builds the tool times (SR_UNROLL 4 / 16, a 6-stage ring of 16 KiB chunks).

test_stream_read_small is the case compute-sanitizer runs (tools/sanitize_nodes.txt).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernel_testing import dev  # noqa: F401

pytestmark = pytest.mark.gpu


def check_stream_read(dev, rng, kind, blocks, bytes_per_block, defines=()):
    from drvqwen.launchers import StreamRead
    from drvqwen.launchers.stream_read import threads_of

    # The slice, then a tail the kernel must not read (it would change no checksum, but memcheck
    # sees it: the src buffer is exactly the slices).
    host = rng.integers(0, 2**32, blocks * bytes_per_block // 4, dtype=np.uint64).astype(np.uint32)
    src = dev.upload(f"src_{kind}", host.view(np.uint8))
    threads = threads_of(kind)
    out = dev.poisoned(f"out_{kind}", (blocks * threads,), np.uint32)
    ln = StreamRead(out, src, blocks=blocks, bytes_per_block=bytes_per_block, kind=kind, defines=tuple(defines))
    ln.launch()
    got = out.download().reshape(blocks, threads)
    want = np.bitwise_xor.reduce(host.reshape(blocks, -1), axis=1)
    assert np.array_equal(np.bitwise_xor.reduce(got, axis=1), want), f"{kind} {defines}: a block's checksum differs"


@pytest.mark.parametrize("kind", ["ld", "bulk"])
def test_stream_read(dev, rng, kind):
    for blocks, kib in ((1, 32), (3, 96), (7, 1024)):
        check_stream_read(dev, rng, kind, blocks, kib * 1024)


@pytest.mark.parametrize("kind, defines", [("ld", (("SR_UNROLL", 4),)), ("ld", (("SR_UNROLL", 16),)),
                                           ("bulk", (("SR_STAGES", 6), ("SR_CHUNK", 16384)))])
def test_stream_read_builds(dev, rng, kind, defines):
    check_stream_read(dev, rng, kind, 5, 512 * 1024, defines)


@pytest.mark.parametrize("kind", ["ld", "bulk"])
def test_stream_read_small(dev, rng, kind):
    check_stream_read(dev, rng, kind, 2, 160 * 1024)
