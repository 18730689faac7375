"""kernels/stream_read.cu (the streaming microbenchmark's kernels) against numpy: every byte of
each block's slice read once by the thread that owns it — each thread's sum of its words
modulo 2^32; the output poisoned first, every word written. Small slices with several
batches (ld) and ring laps (bulk), slices that end inside a batch (ld's tail), and the builds the
tool times (SR_UNROLL 4 / 16, a 6-stage ring of 16 KiB chunks).

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

    host = rng.integers(0, 2**32, blocks * bytes_per_block // 4, dtype=np.uint64).astype(np.uint32)
    src = dev.upload(f"src_{kind}", host.view(np.uint8))
    threads = threads_of(kind)
    out = dev.poisoned(f"out_{kind}", (blocks * threads,), np.uint32)
    ln = StreamRead(out, src, blocks=blocks, bytes_per_block=bytes_per_block, kind=kind, defines=tuple(defines))
    ln.launch()
    got = out.download().reshape(blocks, threads)
    # Thread t of a block reads its 16-byte vectors ≡ t (mod threads) and sums their words modulo
    # 2^32: per thread, a word read twice or missed shows.
    vecs = host.reshape(blocks, -1, 4)
    want = np.zeros((blocks, threads), np.uint64)
    for t in range(threads):
        want[:, t] = vecs[:, t::threads, :].astype(np.uint64).sum(axis=(1, 2))
    want = (want % 2**32).astype(np.uint32)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{kind} {defines}: {len(bad)} threads' sums differ, first (block, thread) {bad[0].tolist()}"


@pytest.mark.parametrize("kind", ["ld", "bulk"])
def test_stream_read(dev, rng, kind):
    for blocks, kib in ((1, 32), (3, 96), (7, 1024)):
        check_stream_read(dev, rng, kind, blocks, kib * 1024)


def test_stream_read_ld_tail(dev, rng):
    """Slices that are not whole batches: the tail loop, and threads with nothing to read."""
    for blocks, nbytes in ((3, 16 * (3 * 2048 + 300)), (2, 16), (4, 16 * 2049)):
        check_stream_read(dev, rng, "ld", blocks, nbytes)


@pytest.mark.parametrize("kind, defines", [("ld", (("SR_UNROLL", 4),)), ("ld", (("SR_UNROLL", 16),)),
                                           ("bulk", (("SR_STAGES", 6), ("SR_CHUNK", 16384)))])
def test_stream_read_builds(dev, rng, kind, defines):
    check_stream_read(dev, rng, kind, 5, 512 * 1024, defines)


@pytest.mark.parametrize("kind", ["ld", "bulk"])
def test_stream_read_small(dev, rng, kind):
    check_stream_read(dev, rng, kind, 2, 160 * 1024)
