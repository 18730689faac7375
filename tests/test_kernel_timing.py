"""kernels/timing.cu: gpu_sleep holds its stream for at least the time asked, so launches
queued behind it wait (what DecodeStep.time_kernels relies on)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu


def _sleep(ms: float) -> tuple[float, float]:
    """(GPU ms between events around one gpu_sleep(ms), host seconds spent queuing it)."""
    from drvqwen.cuda import Event, Stream
    from drvqwen.launchers import GpuSleep

    with Stream() as stream:
        start, end = Event(), Event()
        start.record(stream)
        t0 = time.perf_counter()
        GpuSleep(ms, stream=stream).launch()
        end.record(stream)
        queued_s = time.perf_counter() - t0
        gpu_ms = start.elapsed_ms(end)
        start.close()
        end.close()
    return gpu_ms, queued_s


def test_gpu_sleep_never_shorter_than_asked():
    """The kernel's own promise, which holds under compute-sanitizer too (its instrumentation
    only lengthens launches): the sanitize stage's node for gpu_sleep."""
    gpu_ms, _ = _sleep(2.0)
    assert gpu_ms >= 2.0 * 0.999


@pytest.mark.parametrize("ms", [5.0, 20.0])
def test_gpu_sleep_holds_the_stream(ms):
    gpu_ms, queued_s = _sleep(ms)
    print(f"  gpu_sleep({ms} ms): {gpu_ms:.3f} ms on the GPU, queued in {queued_s * 1e3:.3f} ms")
    assert gpu_ms >= ms * 0.999            # %globaltimer: never shorter than asked
    assert gpu_ms < ms + 5.0               # and not stuck
    assert queued_s * 1e3 < ms             # the host did not wait for it
