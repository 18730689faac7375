"""tools/bench_upload.py on the CPU: the variant list, --only and the arguments, the fail-soft
measurement loop, the table and JSON from fake timings, and the host copies' byte coverage.
The GPU test at the end runs every variant on a tiny model."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
from rich.console import Console

from helpers import TINY, load_tool, random_dense, write_model

GROUPS = {"pinned alloc", "page faults", "host copy", "dma", "device alloc", "GPUWeights", "register"}


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_upload")


@pytest.mark.parametrize("threads", [3, 8])
def test_the_variant_list_covers_every_piece(tool, threads):
    v = tool.variant_list(threads=threads)
    names = [x.name for x in v]
    assert len(set(names)) == len(names)
    assert {x.group for x in v} == GROUPS
    copies = [x.name for x in v if x.group == "host copy" and "touched" not in x.name and "by tensor" not in x.name]
    counts = sorted({threads, 1, 2, 4, 8})
    assert copies == [f"host copy {t} thread{'s' * (t > 1)}{' (uploader)' if t == threads else ''}" for t in counts]
    staging = 2 * tool.STAGING_CHUNK_BYTES // 2**20
    assert f"pinned alloc {staging} MiB (staging)" in names
    assert {"GPUWeights defaults", "GPUWeights staging", "GPUWeights staging, one DMA per tensor"} <= set(names)
    knobs = {x.what.split("=")[0] for x in v if x.group == "GPUWeights" and "=" in x.what}
    assert {"chunk_bytes", "copy_threads", "piece_bytes", tool.startup.UPLOAD} <= knobs
    # the defaults are the "GPUWeights defaults" row, not a knob row of their own
    assert f"copy_threads={threads}" not in [x.what for x in v]
    assert any("register" in n and "by tensor" in n for n in names)


def test_only_selects_by_name_case_insensitive(tool):
    v = tool.variant_list(threads=8)
    picked = tool.select(v, ["DMA", "pool"])
    assert [x.name for x in picked] == [x.name for x in v if "dma" in x.name.lower() or "pool" in x.name.lower()]
    assert picked and len(picked) < len(v)
    assert tool.select(v, []) == v


@pytest.mark.parametrize("argv,says", [
    (["--reps", "5"], "--model is needed"),
    (["--model", "m", "--reps", "0"], "--reps 0: at least 1"),
    (["--model", "m", "--only", "nosuchthing"], "--only nosuchthing: no variant"),
    (["--model", "m", "--json", "/nonexistent-folder/x.json"], "--json /nonexistent-folder/x.json: no folder")])
def test_bad_arguments_are_refused_in_one_line(tool, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and says in error[0]


def test_list_needs_no_model_and_no_gpu(tool, capsys):
    assert tool.main(["--list", "--only", "register"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(tool.select(tool.variant_list(), ["register"])) and all("register" in x for x in lines)


def _fake(tool, name, values, fail_at=None, nbytes=1000):
    """A variant whose calls return values[i] seconds (call 0 is the warm-up) and raise at call fail_at."""
    calls = []

    def run(setup):
        calls.append(setup)
        i = len(calls) - 1
        if i == fail_at:
            raise RuntimeError(f"{name} broke\nsecond line")
        return nbytes, {"a": values[i] / 4, "total": values[i]}
    return tool.Variant(name, "g", "w", run), calls


def test_a_failing_variant_says_why_and_the_others_still_run(tool):
    said = []
    ok, ok_calls = _fake(tool, "ok", [99.0, 0.3, 0.1, 0.5, 0.2, 0.4])
    warm_fail, _ = _fake(tool, "warm", [1.0] * 6, fail_at=0)
    late_fail, late_calls = _fake(tool, "late", [1.0] * 6, fail_at=3)
    after, after_calls = _fake(tool, "after", [99.0, 1, 2, 3, 4, 5])
    res = tool.measure([ok, warm_fail, late_fail, after], "SETUP", 5, said.append)
    assert [r.error for r in res] == [None, "RuntimeError: warm broke", "RuntimeError: late broke", None]
    assert len(ok_calls) == 6 and len(late_calls) == 4 and len(after_calls) == 6 and set(ok_calls) == {"SETUP"}
    # the warm-up (99 s) is not among the samples
    assert res[0].samples == [{"a": x / 4, "total": x} for x in [0.3, 0.1, 0.5, 0.2, 0.4]]
    assert res[0].median["total"] == statistics.median([0.3, 0.1, 0.5, 0.2, 0.4])
    assert res[3].median == {"a": float(np.median([1, 2, 3, 4, 5])) / 4, "total": float(np.median([1, 2, 3, 4, 5]))}
    assert said[1] == "warm: failed: RuntimeError: warm broke" and said[2].startswith("late: failed")
    assert all("\n" not in s for s in said) and len(said) == 4


def test_table_and_json_from_fake_timings(tool):
    v = tool.variant_list(threads=8)[:2]
    good = tool.Result(v[0], nbytes=2 * 10**9, samples=[{"alloc": x, "free": x / 2, "total": 1.5 * x}
                                                          for x in (0.2, 0.1, 0.4)])
    bad = tool.Result(v[1], error="CudaError: cuMemHostAlloc failed")
    con = Console(record=True, width=250)
    con.print(tool.table([good, bad], "t"))
    text = con.export_text()
    median_total = float(np.median([s["total"] for s in good.samples]))   # 1.5 × 0.2
    row = next(line for line in text.splitlines() if v[0].name in line)
    assert f"{median_total * 1e3:.2f}" in row and f"{2 * 10**9 / median_total / 1e9:.1f}" in row
    assert f"alloc {0.2e3:.2f}, free {0.1e3:.2f}" in row and f"{0.1 * 1.5e3:.2f}–{0.4 * 1.5e3:.2f}" in row
    assert "failed: CudaError: cuMemHostAlloc failed" in next(line for line in text.splitlines() if v[1].name in line)
    data = json.loads(json.dumps(tool.record([good, bad], {"tool": "x"})))
    assert data["tool"] == "x" and [d["name"] for d in data["variants"]] == [v[0].name, v[1].name]
    assert data["variants"][0]["median_s"] == {"alloc": 0.2, "free": 0.1, "total": median_total}
    assert data["variants"][0]["samples_s"] == good.samples and data["variants"][0]["bytes"] == 2 * 10**9
    assert data["variants"][1]["error"] == bad.error and data["variants"][1]["median_s"] == {}


def test_the_record_names_no_path(tool):
    shown = tool.shown_command(["--model", "/a/b/m.nanoqwen", "--json=/c/out.json", "--reps", "5"], "m.nanoqwen")
    assert shown == ["python", "tools/bench_upload.py", "--model", "m.nanoqwen", "--json=OUT.json", "--reps", "5"]


def _recording_copy(tool, monkeypatch):
    seen = []
    real = tool.parallel_copy

    def copy(dst, src, pool, piece):
        seen.append((dst, np.array(src)))
        real(dst, src, pool, piece)
    monkeypatch.setattr(tool, "parallel_copy", copy)
    return seen


def test_copy_in_chunks_moves_every_byte_into_the_halves(tool, monkeypatch, rng):
    from concurrent.futures import ThreadPoolExecutor

    seen = _recording_copy(tool, monkeypatch)
    region, staging, chunk = rng.integers(0, 256, 10_000, dtype=np.uint8), np.zeros(2 * 3000, np.uint8), 3000
    with ThreadPoolExecutor(2) as pool:
        tool.copy_in_chunks(region, staging, chunk, pool, 700)
    np.testing.assert_array_equal(np.concatenate([s for _, s in seen]), region)
    halves = [0 if np.shares_memory(d, staging[:chunk]) else 1 for d, _ in seen]
    assert halves == [0, 1, 0, 1]
    np.testing.assert_array_equal(staging[chunk:chunk + 1000], region[9000:])   # the last chunk, in half 1
    np.testing.assert_array_equal(staging[:chunk], region[6000:9000])            # the one before, in half 0


def test_copy_by_tensor_copies_each_span_once(tool, monkeypatch, rng):
    seen = _recording_copy(tool, monkeypatch)
    region, staging = rng.integers(0, 256, 20_000, dtype=np.uint8), np.zeros(4096, np.uint8)
    spans = [(0, 100), (256, 5000), (5376, 4096), (9728, 10), (10_000, 9000)]
    tool.copy_by_tensor(region, spans, staging, None, 1024)
    np.testing.assert_array_equal(np.concatenate([s for _, s in seen]),
                                  np.concatenate([region[o:o + n] for o, n in spans]))
    assert all(np.shares_memory(d, staging) and d.size <= staging.size for d, _ in seen)


def test_touch_pages_reads_one_byte_a_page(tool):
    region = np.arange(10_000, dtype=np.uint64).astype(np.uint8)
    assert tool.touch_pages(region, 4096) == int(region[0]) + int(region[4096]) + int(region[8192])


@pytest.mark.gpu
def test_every_variant_runs_on_a_tiny_model(tool, tmp_path, rng):
    model = tmp_path / "tiny.nanoqwen"
    write_model(model, TINY, random_dense(TINY, rng))
    out = tmp_path / "upload.json"
    assert tool.main(["--model", str(model), "--reps", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [v["name"] for v in data["variants"]] == [v.name for v in tool.variant_list()]
    for v in data["variants"]:
        assert v["error"] is None and len(v["samples_s"]) == 5 and v["median_s"]["total"] > 0, v["name"]
    assert data["source"]["digest"] and str(tmp_path) not in out.read_text()


@pytest.fixture
def faked_driver(tool, monkeypatch):
    """The tool's GPU calls replaced by host memory: pinned and device buffers are ctypes arrays,
    a copy is a memmove, GPUWeights records what it was given. Returns the fakes' record."""
    import ctypes
    import os

    seen = {"gpu_weights": [], "registered": [], "devices": []}

    class Host:                       # PinnedHostBuffer and DeviceBuffer alike
        def __init__(self, nbytes, name=None):
            self.nbytes, self._buf = int(nbytes), (ctypes.c_uint8 * int(nbytes))()
            self.ptr = ctypes.addressof(self._buf)
            if name:
                seen["devices"].append(self)

        def view(self):
            return np.frombuffer(self._buf, np.uint8)

        def free(self):
            self.ptr = 0

    class Queue:                      # Stream and Event
        def record(self, stream=None): pass
        def synchronize(self): pass
        def elapsed_ms(self, end): return 0.25
        def close(self): pass

    class Pool:
        def __init__(self, nbytes, name): self.nbytes = nbytes
        def close(self): pass

    class Registered:
        def __init__(self, array, read_only=True):
            self.ptr, self.nbytes = array.ctypes.data, array.nbytes
            seen["registered"].append((self.nbytes, read_only))
        def __enter__(self): return self
        def __exit__(self, *exc): pass

    class Weights:
        def __init__(self, f, staging=None):
            self.nbytes = f.header.data_size
            seen["gpu_weights"].append((staging, os.environ.get(tool.startup.UPLOAD),
                                        os.environ.get(tool.startup.GATHERED_UPLOAD)))
        def close(self): pass

    for name, fake in [("PinnedHostBuffer", Host), ("DeviceBuffer", Host), ("Stream", Queue), ("Event", Queue),
                       ("Pool", Pool), ("RegisteredHostRange", Registered), ("GPUWeights", Weights),
                       ("read_only_register_supported", lambda: True),
                       ("copy_to_device_async", lambda dst, src, n, stream: ctypes.memmove(dst, src, n))]:
        monkeypatch.setattr(tool, name, fake)
    monkeypatch.delenv(tool.startup.GATHERED_UPLOAD, raising=False)
    monkeypatch.delenv(tool.startup.UPLOAD, raising=False)
    return seen


def test_every_variant_runs_with_the_driver_faked(tool, faked_driver, tmp_path, rng, monkeypatch):
    """CPU: the variants' own code, each repetition, on a tiny model; every DMA variant leaves
    the data region's bytes in the (fake) device buffer."""
    import os

    model = tmp_path / "tiny.nanoqwen"
    write_model(model, TINY, random_dense(TINY, rng))
    monkeypatch.setattr(tool, "STAGING_CHUNK_BYTES", 64 * 1024)      # several chunks of the tiny model
    setup = tool.Setup(str(model))
    variants = tool.variant_list(threads=2)
    said = []
    try:
        results = tool.measure(variants, setup, 5, said.append)
        region = setup.touched.data_region()
        device = faked_driver["devices"][0].view()
        for v in variants:
            # each copy from the file's bytes (not the staging halves' leftovers) lands whole
            if v.group in ("dma", "register") and "halves" not in v.name:
                device[:] = 0
                assert tool.measure([v], setup, 1, said.append)[0].error is None
                assert np.array_equal(device, region), v.name
    finally:
        setup.close()
    assert [r.error for r in results] == [None] * len(variants), said
    assert all(len(r.samples) == 5 and r.samples[0]["total"] >= 0 for r in results)
    assert setup.data_bytes > 3 * 64 * 1024
    calls = faked_driver["gpu_weights"]
    runs = 6                                                         # warm-up and 5
    n_knob_variants = sum(1 for v in variants if v.group == "GPUWeights" and v.what.split("=")[0] in
                          ("chunk_bytes", "copy_threads", "piece_bytes"))
    assert len(calls) == runs * (5 + n_knob_variants)
    # the two defaults rows, the three staging rows (one with the gathered upload off), the knob rows
    assert calls.count((None, None, None)) == 2 * runs
    assert calls.count((None, "staging", None)) == 2 * runs and calls.count((None, "staging", "off")) == runs
    assert sum(1 for st, _, _ in calls if st is not None) == runs * n_knob_variants
    assert os.environ.get(tool.startup.GATHERED_UPLOAD) is None and os.environ.get(tool.startup.UPLOAD) is None
    assert set(faked_driver["registered"]) == {(setup.data_bytes, True)}
    for r in results:
        if r.variant.group in ("dma", "register"):
            assert r.samples[0]["copy engine"] == 0.25 / 1e3
        if r.variant.group == "register":
            assert r.samples[0]["total"] == r.samples[0]["register"] + r.samples[0]["dma"]
