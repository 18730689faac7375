"""The GPU layer: errors, parameter packing, pool arithmetic (CPU) and the real thing (GPU).

The tests marked `gpu` need a Hopper GPU; they skip with the reason elsewhere and fail under
DRVQWEN_REQUIRE_GPU=1 (tools/gpu_check.sh). They launch the kernels of kernels/smoke.cu,
which exist only to exercise this layer.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from cuda.bindings import driver, nvrtc

from drvqwen.cuda import memory
from drvqwen.cuda.device import gpu_unavailable_reason
from drvqwen.cuda.errors import CudaError, DeviceMemoryError, NvrtcError, check
from drvqwen.cuda.launch import KernelLaunch, TensorMapParam, pack_param
from drvqwen.cuda.tensormap import validate_tiled
from drvqwen.errors import DrvqwenError

# --- without a GPU -------------------------------------------------------------------------------


def test_gpu_probe_answers_without_raising():
    reason = gpu_unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)
    print(f"\ngpu_unavailable_reason() = {reason!r}")


def test_check_returns_outputs_and_raises_named_errors():
    ok = driver.CUresult.CUDA_SUCCESS
    assert check((ok,), "cuX") is None
    assert check((ok, 7), "cuX") == 7
    assert check((ok, 1, 2), "cuX") == (1, 2)
    with pytest.raises(CudaError) as info:
        check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    assert info.value.call == "cuMemAlloc" and info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "cuMemAlloc" in str(info.value)
    with pytest.raises(NvrtcError, match="NVRTC_ERROR_INVALID_INPUT"):
        check((nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_INPUT,), "nvrtcCreateProgram")


class _FakeArray:
    ptr = 0x7F00_0000_1200


def test_pack_param_kinds():
    f = pack_param(0, ctypes.c_float(1.5))
    assert isinstance(f, ctypes.c_float) and f.value == 1.5
    assert pack_param(0, _FakeArray()).value == _FakeArray.ptr
    assert isinstance(pack_param(0, _FakeArray()), ctypes.c_uint64)
    assert pack_param(0, driver.CUdeviceptr(0x1000)).value == 0x1000
    tm = pack_param(0, driver.CUtensorMap())
    assert isinstance(tm, TensorMapParam) and ctypes.sizeof(tm) == 128

    class Raw:
        def raw_bytes(self):
            return bytes(range(128))

    assert bytes(pack_param(0, Raw())) == bytes(range(128))
    for bad in (3, 2.0, "x", None):
        with pytest.raises(TypeError, match="argument 4"):
            pack_param(4, bad)


class _StubFunction:
    """Stands in for module.Function where no driver exists: it knows its parameter sizes."""

    name = "stub"
    handle = driver.CUfunction()

    def __init__(self, sizes):
        self.param_sizes = tuple(sizes)

    def ensure_dynamic_smem(self, nbytes):
        self.smem = nbytes


def _pointed_bytes(launch: KernelLaunch, i: int, n: int) -> bytes:
    """The bytes the void** array's entry i points at (what the driver would copy)."""
    ptrs = (ctypes.c_void_p * len(launch.values)).from_address(launch.params_address)
    return ctypes.string_at(ptrs[i], n)


def test_params_are_packed_once_into_a_void_pp_array():
    fn = _StubFunction([8, 8, 4, 4, 128])
    tm = bytes(range(128))

    class Raw:
        def raw_bytes(self):
            return tm

    ln = KernelLaunch(
        fn, (4,), (128,), [_FakeArray(), driver.CUdeviceptr(16), ctypes.c_float(2.0), ctypes.c_int32(-5), Raw()],
        smem_bytes=1024,
    )
    assert ln.grid == (4, 1, 1) and ln.block == (128, 1, 1) and fn.smem == 1024
    assert _pointed_bytes(ln, 0, 8) == _FakeArray.ptr.to_bytes(8, "little")
    assert _pointed_bytes(ln, 1, 8) == (16).to_bytes(8, "little")
    assert _pointed_bytes(ln, 2, 4) == np.float32(2.0).tobytes()
    assert _pointed_bytes(ln, 3, 4) == np.int32(-5).tobytes()
    assert _pointed_bytes(ln, 4, 128) == tm

    # set_param rewrites the argument's storage in place: same array, same pointers.
    address = ln.params_address
    entries = list((ctypes.c_void_p * 5).from_address(address))
    ln.set_param(3, ctypes.c_int32(42))
    assert ln.params_address == address
    assert list((ctypes.c_void_p * 5).from_address(address)) == entries
    assert _pointed_bytes(ln, 3, 4) == np.int32(42).tobytes()
    with pytest.raises(TypeError, match="argument 3 was c_int"):
        ln.set_param(3, ctypes.c_float(1.0))


def test_launch_refuses_wrong_widths_and_counts():
    with pytest.raises(TypeError, match="argument 1 is c_int"):
        KernelLaunch(_StubFunction([8, 8]), (1,), (32,), [_FakeArray(), ctypes.c_int32(1)])
    with pytest.raises(ValueError, match="takes 2 parameters, 1 given"):
        KernelLaunch(_StubFunction([8, 8]), (1,), (32,), [_FakeArray()])
    with pytest.raises(ValueError, match="block"):
        KernelLaunch(_StubFunction([]), (1,), (0,), [])
    assert KernelLaunch(_StubFunction([]), (1,), (32,), []).params_address == 0


def test_a_kernel_past_the_portable_cluster_size_is_opted_in_and_no_other(monkeypatch):
    """module.Function.allow_its_cluster_size: a kernel whose compile-time cluster (width × height
    × depth, all 0 for a kernel without one) exceeds the portable 8 blocks gets
    NON_PORTABLE_CLUSTER_SIZE_ALLOWED, once; others get nothing."""
    from drvqwen.cuda import module

    fa = driver.CUfunction_attribute
    set_calls = []
    monkeypatch.setattr(module.driver, "cuFuncSetAttribute",
                        lambda handle, attr, value: set_calls.append((handle, attr, value)) or (driver.CUresult.CUDA_SUCCESS,))
    for dims, opted in (((0, 0, 0), False), ((8, 1, 1), False), ((16, 1, 1), True), ((4, 4, 1), True)):
        fn = module.Function(None, "k", f"handle{dims}")
        attrs = {fa.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH: dims[0], fa.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT: dims[1],
                 fa.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH: dims[2]}
        monkeypatch.setattr(fn, "attribute", attrs.__getitem__)
        set_calls.clear()
        fn.allow_its_cluster_size()
        want = [(f"handle{dims}", fa.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)] if opted else []
        assert set_calls == want, dims


def test_pool_alignment_and_overflow(monkeypatch):
    """Pool arithmetic with a fake base address (256 B- but not 16 KiB-aligned, as can happen)."""
    base = 0x7F00_0000_0100
    monkeypatch.setattr(memory, "_alloc_device", lambda nbytes, what: base)
    pool = memory.Pool(1 << 20, "test")
    x = pool.alloc("x", (3, 5), np.float16)
    assert x.ptr == base and x.nbytes == 30 and x.shape == (3, 5) and x.dtype == np.float16
    y = pool.alloc("y", (7,), np.float32)
    assert y.ptr == base + 256
    kv = pool.alloc("kv", (4, 16, 128), np.float16, align=memory.KV_PAGE_ALIGN_BYTES)
    assert kv.ptr % memory.KV_PAGE_ALIGN_BYTES == 0 and kv.ptr > y.ptr
    assert pool["kv"] is kv and "kv" in pool.report()
    with pytest.raises(ValueError, match="already has a buffer named 'x'"):
        pool.alloc("x", (1,), np.float16)
    with pytest.raises(DeviceMemoryError, match="cannot fit 'big'") as info:
        pool.alloc("big", (1 << 20,), np.float16)
    assert isinstance(info.value, DrvqwenError)
    with pytest.raises(ValueError, match="power of two"):
        pool.alloc("odd", (1,), np.float16, align=48)


def test_tensormap_constraints_checked_before_the_driver():
    f16 = np.dtype(np.float16)
    ok = dict(ptr=0x1000, dtype=f16, shape=(64, 128), strides_bytes=(256,), box=(16, 64), element_strides=(1, 1),
              swizzle=driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    validate_tiled(**ok)
    bad = [
        (dict(ptr=0x1008), "not 16-byte aligned"),
        (dict(strides_bytes=(200,)), "multiple of 16"),
        (dict(strides_bytes=(128,)), "smaller than"),
        (dict(box=(16, 300)), "1..256"),
        (dict(box=(16, 4)), "multiple of 16"),
        (dict(box=(16, 128)), "swizzle span"),
        (dict(element_strides=(1, 9)), "1..8"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_tiled(**{**ok, **change})


# --- on the GPU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke():
    from drvqwen.cuda.module import load_kernel_module

    return load_kernel_module("smoke")


@pytest.fixture
def pool():
    with memory.Pool(64 << 20, "test") as p:
        yield p


@pytest.mark.gpu
def test_device_info():
    from drvqwen.cuda.device import get_device

    dev = get_device()
    info = dev.info
    print("\n" + info.summary())
    assert info.compute_capability == (9, 0)
    assert info.sm_count > 0 and info.l2_bytes > 0 and info.total_memory_bytes > 0
    assert info.max_smem_per_block_optin_bytes >= 200 * 1024
    free, total = dev.memory_info()
    assert 0 < free <= total


@pytest.mark.gpu
def test_pool_round_trip_and_nan_fill(pool, rng):
    h = rng.standard_normal((33, 77)).astype(np.float16)
    d = pool.alloc("h", h.shape, h.dtype)
    d.upload(h)
    np.testing.assert_array_equal(d.download(), h)
    d.fill_bytes(0xFF)
    assert np.isnan(d.download()).all()
    f = pool.alloc("f", (100,), np.float32)
    f.fill_bytes(0xFF)
    assert np.isnan(f.download()).all()
    f.fill_bytes(0)
    assert not f.download().any()
    with pytest.raises(ValueError, match="host array is float32"):
        d.upload(h.astype(np.float32))


@pytest.mark.gpu
def test_staging_uploader(pool, rng):
    h = rng.integers(0, 2**31, size=(70_001,), dtype=np.int32)  # ~280 KB through 16 KiB halves
    d = pool.alloc("w", h.shape, h.dtype)
    with memory.StagingUploader(chunk_bytes=16 * 1024) as up:
        up.upload(d, h)
        up.finish()
    np.testing.assert_array_equal(d.download(), h)


@pytest.mark.gpu
def test_staging_uploader_with_copy_threads(pool, rng):
    """Chunks filled by several threads in pieces (and a tail shorter than a piece) land whole."""
    h = rng.integers(0, 256, size=(3 * 2**20 + 12_345,), dtype=np.uint8)
    d = pool.alloc("w", h.shape, h.dtype)
    with memory.StagingUploader(chunk_bytes=2**20, copy_threads=4, piece_bytes=2**18) as up:
        up.upload(d, h)
        up.finish()
    np.testing.assert_array_equal(d.download(), h)


def test_parallel_copy_in_pieces(rng):
    """CPU: every byte copied, in pieces across threads, with a short last piece."""
    from concurrent.futures import ThreadPoolExecutor

    src = rng.integers(0, 256, size=10_000_003, dtype=np.uint8)
    with ThreadPoolExecutor(3) as ex:
        for piece in (1_000_000, 4_096, 10_000_003):
            dst = np.zeros_like(src)
            memory.parallel_copy(dst, src, ex, piece_bytes=piece)
            np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match="10 B into 11 B"):
        memory.parallel_copy(np.zeros(10, np.uint8), np.zeros(11, np.uint8), None)


@pytest.mark.gpu
def test_out_of_memory_is_a_clear_error():
    from drvqwen.cuda.device import get_device

    _free, total = get_device().memory_info()
    with pytest.raises(DeviceMemoryError, match="pool 'huge'"):
        memory.Pool(2 * total, "huge")


@pytest.mark.gpu
def test_axpb_launch_and_set_param(smoke, pool, rng):
    n = 10_000  # not a multiple of the block: exercises the bounds check
    x_h = rng.standard_normal(n).astype(np.float32)
    x, y = pool.alloc("x", (n,), np.float32), pool.alloc("y", (n,), np.float32)
    x.upload(x_h)
    y.fill_bytes(0xFF)
    block = 256
    ln = KernelLaunch(
        smoke.function("smoke_axpb"), ((n + block - 1) // block,), (block,),
        [y, x, ctypes.c_float(2.0), ctypes.c_float(-1.0), ctypes.c_int32(n)],
    )
    ln.launch()
    out = y.download()
    assert not np.isnan(out).any(), "not every element was written"
    np.testing.assert_allclose(out, 2.0 * x_h - 1.0, rtol=1e-6, atol=1e-6)

    ln.set_param(2, ctypes.c_float(0.5))
    ln.launch()
    np.testing.assert_allclose(y.download(), 0.5 * x_h - 1.0, rtol=1e-6, atol=1e-6)

    # The cubin's own parameter list catches a wrong width before any launch.
    with pytest.raises(TypeError, match="argument 4 is c_long|argument 4 is c_int64"):
        KernelLaunch(smoke.function("smoke_axpb"), (1,), (32,),
                     [y, x, ctypes.c_float(1), ctypes.c_float(0), ctypes.c_int64(n)])


@pytest.mark.gpu
def test_fp16_add(smoke, pool, rng):
    n = 4097
    a_h = rng.standard_normal(n).astype(np.float16)
    b_h = rng.standard_normal(n).astype(np.float16)
    a, b, z = (pool.alloc(k, (n,), np.float16) for k in "abz")
    a.upload(a_h)
    b.upload(b_h)
    z.fill_bytes(0xFF)
    KernelLaunch(smoke.function("smoke_add_f16"), ((n + 127) // 128,), (128,),
                 [z, a, b, ctypes.c_uint32(n)]).launch()
    expect = (a_h + b_h).astype(np.float32)
    np.testing.assert_allclose(z.download().astype(np.float32), expect, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_tensormap_passed_by_value(smoke, pool):
    from drvqwen.cuda.tensormap import encode_tiled_2d

    src = pool.alloc("tile_src", (64, 128), np.float16)
    tm = encode_tiled_2d(src, np.float16, (64, 128), (16, 64))
    assert tm.box_bytes == 16 * 64 * 2
    out = pool.alloc("echo", (16,), np.uint64)
    out.fill_bytes(0)
    KernelLaunch(smoke.function("smoke_echo_tensormap"), (1,), (32,), [out, tm]).launch()
    assert out.download().tobytes() == tm.raw_bytes()
    assert any(tm.raw_bytes()), "an encoded tensor map is not all zeros"


@pytest.mark.gpu
def test_events_and_launch_overhead(smoke, pool):
    from drvqwen.cuda.launch import Event, Stream

    n = 1024
    y = pool.alloc("y", (n,), np.float32)
    y.fill_bytes(0)
    fn = smoke.function("smoke_axpb")
    args = [y, y, ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_int32(n)]
    reps = 2000
    with Stream() as stream:
        ln = KernelLaunch(fn, (n // 256,), (256,), args, stream=stream)
        start, end = Event(), Event()
        ln.launch()
        stream.synchronize()

        start.record(stream)
        t0 = time.perf_counter()
        for _ in range(reps):
            ln.launch()
        t_packed_us = (time.perf_counter() - t0) / reps * 1e6
        end.record(stream)
        gpu_ms = start.elapsed_ms(end)

        # The tuple form cuda.bindings packs on every call, for comparison (docs/graphs.md#why-graphs).
        values = (int(y.ptr), int(y.ptr), 1.0, 0.0, n)
        types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int)
        t0 = time.perf_counter()
        for _ in range(reps):
            args = (fn.handle, n // 256, 1, 1, 256, 1, 1, 0, stream.handle, (values, types), 0)
            check(driver.cuLaunchKernel(*args), "cuLaunchKernel")
        t_tuple_us = (time.perf_counter() - t0) / reps * 1e6
        stream.synchronize()
        for e in (start, end):
            e.close()
    print(f"\nhost time per launch: pre-packed {t_packed_us:.2f} µs, tuple-packed {t_tuple_us:.2f} µs; "
          f"GPU time of {reps} pre-packed launches {gpu_ms:.3f} ms")
    assert gpu_ms > 0
    assert not np.isnan(y.download()).any()


@pytest.mark.gpu
def test_graph_capture_and_replay(smoke, pool, rng):
    from drvqwen.cuda.graph import capture
    from drvqwen.cuda.launch import Stream

    n = 3000
    y0 = rng.standard_normal(n).astype(np.float32)
    y = pool.alloc("y", (n,), np.float32)
    y.upload(y0)
    with Stream() as stream:
        step = KernelLaunch(smoke.function("smoke_axpb"), ((n + 255) // 256,), (256,),
                            [y, y, ctypes.c_float(2.0), ctypes.c_float(1.0), ctypes.c_int32(n)], stream=stream)
        with capture(stream) as cap:
            for _ in range(3):
                step.launch()
        np.testing.assert_array_equal(y.download(), y0)  # capture records, it does not run
        assert cap.graph.num_nodes() == 3
        exe = cap.graph.instantiate()
        cap.graph.destroy()
        exe.launch(stream)
        exe.launch(stream)
        stream.synchronize()
        exe.destroy()
    expect = y0.astype(np.float64)
    for _ in range(6):
        expect = 2.0 * expect + 1.0
    np.testing.assert_allclose(y.download(), expect, rtol=1e-5)


@pytest.mark.gpu
def test_module_errors_and_dynamic_smem(smoke):
    from drvqwen.cuda.device import get_device

    with pytest.raises(CudaError, match="CUDA_ERROR_NOT_FOUND"):
        smoke.function("no_such_kernel")
    fn = smoke.function("smoke_axpb")
    assert fn.num_registers > 0 and fn.max_threads_per_block >= 256
    assert fn.param_sizes == (8, 8, 4, 4, 4)
    fn.ensure_dynamic_smem(100 * 1024)  # above the 48 KiB default: needs the opt-in
    with pytest.raises(ValueError, match="shared memory asked, device allows"):
        fn.ensure_dynamic_smem(get_device().info.max_smem_per_block_optin_bytes + 1)


class _FakeDevice:
    """Device memory as host bytes, and the DMAs the uploader queued: StagingUploader's logic on
    the CPU (every driver call it makes replaced; the copy of the bytes is what is checked)."""

    def __init__(self, base: int, nbytes: int):
        self.base, self.mem, self.dmas = base, np.full(nbytes, 0xEE, np.uint8), []

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        import ctypes

        from cuda.bindings import driver

        self.mem[dst - self.base:dst - self.base + n] = np.frombuffer(ctypes.string_at(src, n), np.uint8)
        self.dmas.append((dst - self.base, n))
        return (driver.CUresult.CUDA_SUCCESS,)


@pytest.fixture
def fake_upload(monkeypatch):
    import ctypes

    class Pinned(memory.PinnedHostBuffer):
        def __init__(self, nbytes):
            self.nbytes = int(nbytes)
            self._buf = (ctypes.c_uint8 * self.nbytes)()
            self.ptr = ctypes.addressof(self._buf)

        def free(self):
            self.ptr = 0

    class Nothing:
        def __init__(self, *a, **k): pass
        def record(self, *a): pass
        def synchronize(self): pass
        def close(self): pass

    dev = _FakeDevice(0x7000_0000, 1 << 20)
    monkeypatch.setattr(memory, "PinnedHostBuffer", Pinned)
    monkeypatch.setattr(memory, "Event", Nothing)
    monkeypatch.setattr(memory, "Stream", Nothing)
    monkeypatch.setattr(memory, "stream_handle", lambda s: 0)
    monkeypatch.setattr(memory, "driver", dev)
    return dev


def test_small_uploads_of_one_region_share_a_dma(fake_upload, rng):
    """CPU: arrays bound for one allocation, in its order, go in one DMA per chunk (the padding
    between them included, and nothing outside the region written); a large one, one outside the
    region, and one out of order each end the gathering; every byte lands."""
    from drvqwen.cuda import DeviceArray

    dev, region = fake_upload, (0x7000_0000 + 4096, 600_000)
    plan = [(0, 1000), (1024, 4000), (5120, 300), (5632, 200_000), (205_824, 64), (206_080, 4096),
            (5440, 64),                  # behind the last one (in a gap): a new gathering
            (300_000, 10_000), (700_000, 20_000)]   # the last outside the region: its own DMA
    arrays = []
    with memory.StagingUploader(chunk_bytes=64 * 1024, copy_threads=1, region=region) as up:
        for off, n in plan:
            h = rng.integers(0, 256, n, dtype=np.uint8)
            up.upload(DeviceArray(f"a{off}", region[0] + off, (n,), np.uint8), h)
            arrays.append((off, h))
        up.finish()
        dmas = up.dmas
    for off, h in arrays:
        start = region[0] - dev.base + off
        np.testing.assert_array_equal(dev.mem[start:start + len(h)], h)
    # 0 … 5420 gathered (three arrays, two gaps); 200 KB in 64 KiB chunks; 64 B + 4 KB gathered;
    # the out-of-order 64 B; 10 KB (its gathering ended by the array outside the region); 20 KB.
    r0 = region[0] - dev.base
    assert dev.dmas == [(r0, 5420), (r0 + 5632, 65536), (r0 + 5632 + 65536, 65536), (r0 + 5632 + 131072, 65536),
                        (r0 + 5632 + 196608, 3392), (r0 + 205_824, 4352), (r0 + 5440, 64), (r0 + 300_000, 10_000),
                        (r0 + 700_000, 20_000)]
    assert dmas == len(dev.dmas)
    written = np.zeros(len(dev.mem), bool)
    for o, n in dev.dmas:
        written[o:o + n] = True
    assert not written[:r0].any() and not written[r0 + region[1]:r0 + 700_000].any()
