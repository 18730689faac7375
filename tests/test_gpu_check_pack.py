"""tools/gpu_check.sh's PACK=FILE on the CPU, through its `cubins` stage (nothing but the
environment record, env.txt, and what is already in OUTDIR): OUTDIR as one tar at FILE, nested
folders and all but the JUnit XML; a FILE inside OUTDIR or of another kind refused in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("tar", "gzip", "bash")), reason="needs bash, tar, gzip")


def _stage(tmp_path: Path, pack: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "DRVQWEN_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable, "PACK": pack}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "cubins", str(tmp_path / "out" / "v")], env=e,
                          capture_output=True, text=True, timeout=120)


def test_outdir_is_packed_into_one_file_with_its_folders(tmp_path):
    deep = tmp_path / "out" / "v" / "tests-1"   # three folders below where a device command's files come back
    deep.mkdir(parents=True)
    (deep / "tests-gpu.log").write_text("1 passed\n")
    (deep / "tests-gpu.xml").write_text("<testsuite/>\n")
    r = _stage(tmp_path, str(tmp_path / "out" / "v.tgz"))
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "v.tgz") as tar:
        names = set(tar.getnames())
        assert tar.extractfile("v/tests-1/tests-gpu.log").read() == b"1 passed\n"
    assert {"v/env.txt", "v/tests-1/tests-gpu.log"} <= names and "v/tests-1/tests-gpu.xml" not in names, names
    assert not (tmp_path / "out" / "v.tgz.part").exists()


@pytest.mark.parametrize("where,message", [("out/v/inside.tgz", "inside OUTDIR, which it packs"),
                                           ("out/v.zip", "a .tgz or .tar.gz file")])
def test_a_pack_inside_outdir_or_not_a_tgz_is_refused(tmp_path, where, message):
    r = _stage(tmp_path, str(tmp_path / where))
    assert r.returncode == 1 and f"PACK={tmp_path / where}: {message}" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / where).exists()
