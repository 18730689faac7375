"""`pip install .` (not only -e) must be able to compile the kernels: build the wheel, unpack
it away from the checkout, and compile a kernel from the installed copy (docs/architecture.md#the-parts-and-where-they-live)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_kernels_and_compiles_them(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("drvqwen-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    shipped = {p.name for p in (site / "drvqwen" / "_kernels").glob("*.cu*")}
    assert shipped == {p.name for p in (ROOT / "kernels").glob("*.cu*")}, "kernels/*.cu and *.cuh"
    assert {p.name for p in (site / "drvqwen" / "_ptx").glob("*.cuh")} == {p.name for p in (ROOT / "ptx").glob("*.cuh")}
    # The command starts in _entry.py, which handles Ctrl-C before the heavy imports.
    (eps,) = site.glob("drvqwen-*.dist-info/entry_points.txt")
    assert "drvqwen = drvqwen._entry:main" in eps.read_text()
    code = ("from drvqwen.cuda.sources import kernels_dir, ptx_dir\n"
            "from drvqwen.cuda.nvrtc import compile_kernel\n"
            "print(kernels_dir()); print(ptx_dir())\n"
            "c = compile_kernel('rope_kv'); print(len(c.cubin))\n")
    env = dict(os.environ, PYTHONPATH=str(site), DRVQWEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    kdir, pdir, n = r.stdout.split()
    assert Path(kdir) == site / "drvqwen" / "_kernels" and Path(pdir) == site / "drvqwen" / "_ptx"
    assert int(n) > 0
