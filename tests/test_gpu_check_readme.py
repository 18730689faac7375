"""tools/gpu_check.sh's `readme` stage on the CPU, with drvqwen.bench replaced by a stand-in that
records its arguments: README's rows, each run's JSON named as docs/bench/ keeps it, a subset by
README_ROWS, and an unknown row refused in one line before anything runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _stage(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # The stand-in interpreter: `-m drvqwen.bench … --json PATH …` writes its arguments to PATH;
    # everything else (the stage's environment record) goes to the real one.
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == drvqwen.bench ]]; then
    shift 2; args="$*"; out=
    while [[ $# -gt 0 ]]; do [[ $1 == --json ]] && out=$2; shift; done
    echo "$args" > "$out"; exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    e = {**os.environ, "PYTHON": str(fake), "DRVQWEN_SOURCE_COMMIT": COMMIT, "DRVQWEN_CACHE": str(tmp_path / "c"),
         "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", **env}
    (tmp_path / "bin").mkdir(exist_ok=True)  # an nvidia-smi that names an H200
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H200'\n")
    smi.chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "readme", str(tmp_path / "out")], env=e,
                          capture_output=True, text=True, timeout=120)


def _runs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted((tmp_path / "out" / "readme").glob("*.json"))}


def test_the_rows_run_in_order_with_their_arguments_and_names(tmp_path):
    r = _stage(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    runs = _runs(tmp_path)
    names = {n: f"{day}_0123456_h200_{n}.json" for n in
             ("syn7b_512_1", "syn7b_512_2", "syn7b_8192_1", "syn05b_512_1", "syn05b_512_2", "syn7b_16384_1",
              "syn7b_32000_1")}
    assert set(runs) == set(names.values()), sorted(runs)
    for name, args in ((n, runs[f]) for n, f in names.items()):
        assert args.startswith("--mode graph --json ") and args.endswith(".json " + {
            "syn7b_512_1": "--preset 7b", "syn7b_512_2": "--preset 7b",
            "syn7b_8192_1": "--preset 7b --prompt-tokens 8192 --new-tokens 8 --prefill-reps 3",
            "syn05b_512_1": "--preset 0.5b", "syn05b_512_2": "--preset 0.5b",
            "syn7b_16384_1": "--preset 7b --prompt-tokens 16384",
            "syn7b_32000_1": "--preset 7b --prompt-tokens 32000 --new-tokens 8 --prefill-reps 2"}[name]), (name, args)
    # One log per row, in README_ORDER.
    order = [line.split(":")[0][4:] for line in r.stdout.splitlines() if line.startswith("=== readme-") and "exit" not in line]
    assert order == ["readme-" + n for n in names], order


def test_readme_rows_narrows_and_an_unknown_row_is_refused(tmp_path):
    r = _stage(tmp_path, README_ROWS="syn05b_512_2 syn7b_8192_1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(n.split("_h200_")[1] for n in _runs(tmp_path)) == ["syn05b_512_2.json", "syn7b_8192_1.json"]
    shutil.rmtree(tmp_path / "out")
    r = _stage(tmp_path, README_ROWS="syn7b_512_1 syn7b_1024_1")
    assert r.returncode == 2 and "README_ROWS: no row syn7b_1024_1" in r.stderr, r.stdout + r.stderr
    assert _runs(tmp_path) == {}
