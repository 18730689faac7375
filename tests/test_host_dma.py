"""cuda/host_dma.py: the page cover a registration takes, the refusals before the driver, and (GPU)
a file's read-only mapping registered and copied straight to the device; GPUWeights' `staging`
settings reaching its uploader; NanoqwenFile.data_region."""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import gpu_weights
from drvqwen.cuda import host_dma
from drvqwen.format.nanoqwen import NanoqwenFile
from helpers import TINY, random_dense, write_model


@pytest.mark.parametrize("ptr,n", [(0, 1), (4095, 1), (4095, 2), (4096, 4096), (5000, 10_000), (12_288, 8192)])
def test_page_cover_is_the_pages_the_bytes_touch(ptr, n):
    pages = sorted({b // 4096 for b in range(ptr, ptr + n)})    # every byte's page, counted one by one
    assert host_dma.page_cover(ptr, n, 4096) == (pages[0] * 4096, len(pages) * 4096)
    assert pages == list(range(pages[0], pages[-1] + 1))


@pytest.mark.parametrize("n,page", [(0, 4096), (10, 3000)])
def test_page_cover_refuses_empty_ranges_and_odd_pages(n, page):
    with pytest.raises(ValueError, match="page cover"):
        host_dma.page_cover(0, n, page)


@pytest.mark.parametrize("array", [np.zeros(0, np.uint8), np.zeros((4, 4), np.uint8)[:, 1]])
def test_registration_refuses_empty_or_strided_arrays(array):
    with pytest.raises(ValueError, match="non-empty C-contiguous"):
        host_dma.RegisteredHostRange(array)


@pytest.fixture
def tiny_model(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng))
    return path


def test_data_region_holds_every_tensor_at_its_offset(tiny_model):
    with NanoqwenFile(tiny_model) as f:
        region = f.data_region()
        assert region.size == f.header.data_size and not region.flags.writeable
        for info in f:
            at = info.offset - f.header.data_offset
            assert region[at:at + info.nbytes].tobytes() == np.asarray(f.tensor(info.name)).tobytes()


def test_gpu_weights_hands_its_staging_settings_to_the_uploader(tiny_model, monkeypatch):
    """CPU: the pool and the uploader faked; what GPUWeights gives the uploader is recorded."""
    from drvqwen.cuda import DeviceArray

    made = []

    class Pool:
        def __init__(self, capacity_bytes, name):
            self.base, self.capacity_bytes, self.used = 1 << 20, capacity_bytes, 0

        def alloc(self, name, shape, dtype):
            arr = DeviceArray(name, self.base + self.used, shape, dtype)
            self.used += -(-arr.nbytes // 256) * 256
            return arr

    class Uploader:
        def __init__(self, **kw):
            self.kw, self.uploads = kw, []
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def upload(self, arr, host):
            self.uploads.append(arr.name)

        def finish(self):
            pass

    monkeypatch.setattr(gpu_weights, "Pool", Pool)
    monkeypatch.setattr(gpu_weights, "StagingUploader", Uploader)
    with NanoqwenFile(tiny_model) as f:
        gpu_weights.GPUWeights(f)
        gpu_weights.GPUWeights(f, staging={"chunk_bytes": 1 << 20, "copy_threads": 3, "piece_bytes": 1 << 16})
        names = [i.name for i in f]
        assert made[0].kw.keys() == {"region"}
        assert made[1].kw == {"region": made[0].kw["region"], "chunk_bytes": 1 << 20, "copy_threads": 3,
                              "piece_bytes": 1 << 16}
        assert made[0].uploads == made[1].uploads == names
        assert gpu_weights.weight_pool_bytes(f) == sum(-(-i.nbytes // 256) * 256 for i in f) + 256


@pytest.mark.gpu
def test_a_read_only_file_mapping_is_copied_straight_to_the_device(tmp_path, rng):
    from drvqwen.cuda import Pool, Stream, copy_to_device_async, read_only_register_supported

    if not read_only_register_supported():
        pytest.fail("the H100/H200 register host memory read-only; this device says it cannot")
    data = rng.integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    path = tmp_path / "bytes"
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    part = mapped[100:100 + 2 * 4096 + 7]             # starts and ends inside pages
    with Pool(1 << 16, "dst") as pool, Stream() as stream:
        dst = pool.alloc("dst", (part.size,), np.uint8)
        dst.fill_bytes(0xEE)
        with host_dma.RegisteredHostRange(part) as reg:
            copy_to_device_async(dst.ptr, reg.ptr, reg.nbytes, stream)
            stream.synchronize()
            np.testing.assert_array_equal(dst.download(), data[100:100 + part.size])
        with host_dma.RegisteredHostRange(part):        # unregistered: the same pages can be registered again
            pass
