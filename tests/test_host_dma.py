"""cuda/host_dma.py: the page cover a registration takes, the refusals before the driver, and (GPU)
a file's read-only mapping registered and copied straight to the device; GPUWeights' choice of
uploader (registered mapping or staging, its settings, the fallback) and (GPU) both giving the
same bytes; NanoqwenFile.data_region."""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import gpu_weights
from drvqwen.errors import DrvqwenError
from drvqwen.cuda import host_dma
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.tensor_set import weight_shapes
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


class _FakePool:
    """The weight pool without a device: allocations at 256-byte steps from a made-up base."""

    def __init__(self, capacity_bytes, name):
        self.base, self.capacity_bytes, self.used = 1 << 20, capacity_bytes, 0

    def alloc(self, name, shape, dtype):
        from drvqwen.cuda import DeviceArray

        arr = DeviceArray(name, self.base + self.used, shape, dtype)
        self.used += -(-arr.nbytes // 256) * 256
        return arr

    def close(self):
        pass


def _fake_uploader(made: list, kind: str, refuse: bool = False):
    """An uploader class that records its arguments and uploads into `made` (one per instance,
    as (kind, kwargs or the registered array, uploaded names)); `refuse`: its constructor raises
    the driver's refusal."""
    from drvqwen.cuda import CudaError

    class Uploader:
        def __init__(self, *args, **kw):
            if refuse:
                raise CudaError("cuMemHostRegister", "CUDA_ERROR_NOT_SUPPORTED", "operation not supported", 801)
            self.args, self.kw, self.uploads = args, kw, []
            made.append((kind, self))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def upload(self, arr, host):
            self.uploads.append(arr.name)

        def finish(self):
            pass

    return Uploader


def _fake_upload(monkeypatch, *, supported: bool, refuse: bool = False) -> list:
    made: list = []
    monkeypatch.setattr(gpu_weights, "Pool", _FakePool)
    monkeypatch.setattr(gpu_weights, "StagingUploader", _fake_uploader(made, "staging"))
    monkeypatch.setattr(gpu_weights, "RegisteredUploader", _fake_uploader(made, "registered", refuse))
    monkeypatch.setattr(gpu_weights, "read_only_register_supported", lambda: supported)
    # The INT4 model's rearrangement into the device layout after the upload launches a kernel
    # (tests/test_kernel_weight_layout.py checks it on the GPU): nothing to do over a fake pool.
    monkeypatch.setattr(gpu_weights.GPUWeights, "_device_layout", lambda self, planes: None)
    return made


def test_gpu_weights_hands_its_staging_settings_to_the_uploader(tiny_model, monkeypatch):
    """CPU: the pool and the uploaders faked; what GPUWeights gives the staging uploader is recorded."""
    made = _fake_upload(monkeypatch, supported=False)
    with NanoqwenFile(tiny_model) as f:
        a = gpu_weights.GPUWeights(f)
        b = gpu_weights.GPUWeights(f, staging={"chunk_bytes": 1 << 20, "copy_threads": 3, "piece_bytes": 1 << 16})
        names = [i.name for i in f]
        assert [k for k, _ in made] == ["staging", "staging"] and a.upload_via == b.upload_via == "staging"
        (_, one), (_, two) = made
        assert one.kw.keys() == {"region"}
        assert two.kw == {"region": one.kw["region"], "chunk_bytes": 1 << 20, "copy_threads": 3,
                          "piece_bytes": 1 << 16}
        assert one.uploads == two.uploads == names
        assert gpu_weights.weight_pool_bytes(f) == sum(-(-i.nbytes // 256) * 256 for i in f) + 256


def test_gpu_weights_uploads_from_the_registered_mapping_by_default(tiny_model, monkeypatch):
    """CPU, uploaders faked: the default registers the file's data region and uploads every
    tensor through it; staging settings, the switch set to staging, a device without read-only
    registration, and a refused registration each take the staging uploader."""
    from drvqwen import startup

    made = _fake_upload(monkeypatch, supported=True)
    with NanoqwenFile(tiny_model) as f:
        names = [i.name for i in f]
        w = gpu_weights.GPUWeights(f)
        assert w.upload_via == "registered" and [k for k, _ in made] == ["registered"]
        up = made[0][1]
        (region,) = up.args
        assert region.ctypes.data == f.data_region().ctypes.data and region.nbytes == f.header.data_size
        assert up.uploads == names

        assert gpu_weights.GPUWeights(f, staging={"copy_threads": 2}).upload_via == "staging"
        monkeypatch.setenv(startup.UPLOAD, "staging")
        assert gpu_weights.GPUWeights(f).upload_via == "staging"
        monkeypatch.setenv(startup.UPLOAD, "pinned")
        with pytest.raises(DrvqwenError, match="DRVQWEN_STARTUP_UPLOAD='pinned'"):
            gpu_weights.GPUWeights(f)
        monkeypatch.delenv(startup.UPLOAD)
        assert [k for k, _ in made] == ["registered", "staging", "staging"]

    made = _fake_upload(monkeypatch, supported=True, refuse=True)
    with NanoqwenFile(tiny_model) as f:
        w = gpu_weights.GPUWeights(f)
        assert w.upload_via == "staging" and [k for k, _ in made] == ["staging"]
        assert made[0][1].uploads == [i.name for i in f]


def test_gpu_weights_reports_progress_against_the_total(tiny_model, monkeypatch):
    _fake_upload(monkeypatch, supported=True)
    seen = []
    with NanoqwenFile(tiny_model) as f:
        gpu_weights.GPUWeights(f, progress=lambda done, total: seen.append((done, total)))
        total = sum(i.nbytes for i in f)
    assert len(seen) == len(list(NanoqwenFile(tiny_model)))
    assert {t for _, t in seen} == {total} and seen[-1][0] == total
    assert all(a < b for (a, _), (b, _) in zip(seen, seen[1:]))


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


@pytest.mark.gpu
def test_registered_and_staged_uploads_give_the_same_device_bytes(tmp_path, rng, monkeypatch):
    """A model in the Q4_K_M layout whose norms and biases are stored FP32 (as a GGUF's are;
    they go up as FP16 through a host copy): the registered mapping's upload and the staging
    upload fill the weight pool with the same bytes, each tensor as the file holds it or, for the
    planes the GPU reads tile-major (gpu_weights.tile_major_planes), to_tile_major of it, and for
    the q4_k weights' scales the lane words (gpu_weights.lane_word_weights) to_lane_words of the
    file's scales and superscales, which have no array of their own."""
    from drvqwen import startup
    from drvqwen.cuda import read_only_register_supported
    from drvqwen.format import weight_formats as wf
    from drvqwen.format.nanoqwen_writer import NanoqwenWriter
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import synthetic_tensor
    from drvqwen.format.int4_tiles import to_tile_major
    from drvqwen.format.kquant_lanes import to_lane_words
    from drvqwen.format.tensor_set import expected_tensors
    from helpers import minimal_tokenizer_json

    if not read_only_register_supported():
        pytest.fail("the H100/H200 register host memory read-only; this device says it cannot")
    formats = recipe_formats(TINY, "q4_k_m")
    shapes = weight_shapes(TINY)
    with NanoqwenWriter(tmp_path / "m.nanoqwen", TINY, minimal_tokenizer_json()) as w:
        for name, (dt, shape) in expected_tensors(TINY, formats).items():
            prefix = wf.weight_prefix(name)
            fid = formats.get(prefix, wf.PLAIN) if prefix else wf.PLAIN
            if fid == wf.PLAIN:
                t = synthetic_tensor(name, dt, shape, rng)
                w.add(name, t.astype(np.float32) if t.ndim == 1 else t, format_id=fid)
            else:
                if name.endswith(".qweight"):
                    parts = wf.random_weight(wf.FORMATS[fid], *shapes[prefix], rng)
                w.add(name, parts[name.rsplit(".", 1)[1]], format_id=fid)
    with NanoqwenFile(tmp_path / "m.nanoqwen") as f:
        assert any(i.dtype == wf.F32 for i in f), "the test needs an F32 tensor (a host-converted upload)"
        got = {}
        for via in ("registered", "staging"):
            monkeypatch.setenv(startup.UPLOAD, via)
            w = gpu_weights.GPUWeights(f)
            try:
                assert w.upload_via == via
                got[via] = {name: arr.download() for name, arr in w.arrays.items()}
            finally:
                w.close()
        tiled = gpu_weights.tile_major_planes(f)
        assert tiled, "the test needs a tile-major plane (a 4–6-bit weight's codes)"
        lanes = {f"{p}.scales": to_lane_words(f.tensor(f"{p}.scales"), f.tensor(f"{p}.superscales"))
                 for p in gpu_weights.lane_word_weights(f)}
        assert lanes, "the test needs a q4_k weight (lane-word scales)"
        in_lanes = {n.replace(".scales", ".superscales") for n in lanes}   # no array of their own
        for info in f:
            want = np.asarray(f.tensor(info.name))
            want = want.astype(np.float16) if info.dtype == wf.F32 else want
            if info.name in tiled:
                want = to_tile_major(want, *tiled[info.name])
            want = lanes.get(info.name, want)
            for via in got:
                if info.name in in_lanes:
                    assert info.name not in got[via], (via, info.name)
                    continue
                assert got[via][info.name].tobytes() == want.tobytes(), (via, info.name)
