"""tools/gpu_check.sh's cubin cache hand-over (CUBIN_EXPORT on one machine, CUBIN_SEED on the
next), run on the CPU through its `cubins` stage: what one cache exports, another gains, and
an entry already there is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("tar", "xz", "split", "bash")),
                                reason="needs bash, tar, xz and split")


def _stage(cache: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "DRVQWEN_CACHE": str(cache), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "cubins", str(out)], env=e,
                          capture_output=True, text=True, timeout=120)


def test_an_exported_cache_seeds_another(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "cubin").mkdir(parents=True)
    (second / "cubin").mkdir(parents=True)
    blob = os.urandom(40 << 10)  # incompressible, as a cubin nearly is
    (first / "cubin" / "k-aaaa.cubin").write_bytes(blob)
    (first / "cubin" / "k-aaaa.json").write_text('{"cache_key": "aaaa"}\n')
    (first / "cubin" / "k-bbbb.cubin").write_bytes(b"first's bbbb")
    (second / "cubin" / "k-bbbb.cubin").write_bytes(b"second's own bbbb")

    parts = tmp_path / "parts"
    r = _stage(first, tmp_path / "out1", CUBIN_EXPORT=str(parts))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in parts.iterdir()) == ["cubins.tar.xz.00"], list(parts.iterdir())
    assert "2 cubins written" in r.stdout, r.stdout

    r = _stage(second, tmp_path / "out2", CUBIN_SEED=str(parts))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (second / "cubin" / "k-aaaa.cubin").read_bytes() == blob
    assert (second / "cubin" / "k-aaaa.json").read_text() == '{"cache_key": "aaaa"}\n'
    assert (second / "cubin" / "k-bbbb.cubin").read_bytes() == b"second's own bbbb"  # kept


def test_a_seed_folder_without_parts_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _stage(tmp_path / "cache", tmp_path / "out", CUBIN_SEED=str(tmp_path / "empty"))
    assert r.returncode == 2 and "no cubins.tar.xz.* there" in r.stderr, r.stdout + r.stderr
