"""The toolchain the cubin cache's key names (cuda/toolchain.py): named from NVRTC once, then
taken from the cache's record without loading NVRTC while nothing it was read from changed; and
a compile always keys its cubin by the toolchain NVRTC itself names.

CPU only: NVRTC runs without a GPU. Each test has a cache root of its own (its own record) and
starts from a process that has named no toolchain yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drvqwen.cuda import toolchain
from drvqwen.cuda.nvrtc import compile_kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch, private_cache):
    """This process as if it had named no toolchain yet, with the test's own cache root."""
    monkeypatch.setattr(toolchain, "_known", None)
    monkeypatch.setattr(toolchain, "_checked", False)
    monkeypatch.setattr(toolchain, "_record", [])
    for name in toolchain.STEERING_ENV:     # the test's own values, whatever the caller's were
        monkeypatch.delenv(name, raising=False)
    return toolchain


def _in_new_process(code: str) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


_NAME_IT = ("import json, sys\n"
            "from drvqwen.cuda import toolchain\n"
            "tc, major = toolchain.toolchain_id(), toolchain.nvrtc_major()\n"
            "print(json.dumps([tc, major, 'cuda.bindings.nvrtc' in sys.modules]))\n")


def test_the_record_names_the_toolchain_without_loading_nvrtc(private_cache):
    first = _in_new_process(_NAME_IT)
    again = _in_new_process(_NAME_IT)
    assert first[2] is True                     # no record yet: named from NVRTC itself
    assert again == [first[0], first[1], False]  # the record's answer, NVRTC never loaded
    assert first[0].startswith(f"nvrtc={first[1]}.") and "nvidia-cuda-nvrtc=" in first[0]


def test_the_record_holds_until_what_it_was_read_from_changes(fresh, tmp_path, monkeypatch):
    site_dir, library, header = tmp_path / "site-packages", tmp_path / "libnvrtc.so", tmp_path / "cuda_runtime_api.h"
    site_dir.mkdir()
    library.write_bytes(b"\x7fELF")
    header.write_text("#define CUDART_VERSION 13000\n")
    monkeypatch.setattr(toolchain, "_site_dirs", lambda: [str(site_dir)])
    tc = toolchain.Toolchain("nvrtc=13.0;test", (13, 0), str(library), str(header))

    def recorded_after(change) -> toolchain.Toolchain | None:
        fresh._write_record(tc, fresh._surroundings())
        assert fresh._read_record() == tc
        change()
        return fresh._read_record()

    def later(path: Path):
        st = path.stat()
        return lambda: os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    assert recorded_after(lambda: None) == tc
    assert recorded_after(later(site_dir)) is None           # a wheel installed, upgraded or removed
    assert recorded_after(later(library)) is None            # NVRTC replaced in place
    assert recorded_after(lambda: header.write_text("#define CUDART_VERSION 13010\n// another\n")) is None
    assert recorded_after(lambda: monkeypatch.setenv("CUDA_HOME", str(tmp_path))) is None
    monkeypatch.delenv("CUDA_HOME")
    assert recorded_after(library.unlink) is None


def test_a_compile_keys_its_cubin_by_the_toolchain_nvrtc_names(fresh, tmp_path):
    """A record that names another toolchain than the NVRTC loaded (one the evidence could not
    tell apart) decides only where a cubin is looked for first: what is compiled is stored under
    NVRTC's own name, and the record is put right."""
    real = fresh.checked_toolchain_id()
    measured = fresh._known
    wrong = toolchain.Toolchain("nvrtc=0.0;another", (0, 0), measured.library, measured.header)
    fresh._write_record(wrong, fresh._surroundings())
    fresh._known, fresh._checked, fresh._record[:] = None, False, []
    assert fresh.toolchain_id() == wrong.id and fresh.nvrtc_major() == 0   # the record is believed

    cache = tmp_path / "cubins"
    first = compile_kernel("smoke", cache_dir=cache)
    (meta,) = cache.glob("smoke-*.json")
    assert not first.cache_hit and json.loads(meta.read_text())["toolchain"] == real
    assert fresh._read_record() == measured
    again = compile_kernel("smoke", cache_dir=cache)
    assert again.cache_hit and again.cache_key == first.cache_key
