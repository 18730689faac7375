"""tools/gpu_check.sh's `turns` stage on the CPU, with drvqwen.bench and tools/make_synthetic.py
replaced by a stand-in that records its arguments: every model once a round in TURNS_MODELS'
order, each file written once under the key of the code that writes it, the JSONs named as
docs/bench/ keeps them, a summary line for every run of this stage (none left from an earlier
one), and a bad model list or round count refused in one line before anything runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _stage(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # The stand-in interpreter: `-m drvqwen.bench … --json PATH` writes a bench JSON whose graph
    # ITL counts the runs so far (the order shows in the values), make_synthetic.py appends its
    # arguments to a log and writes its -o file; the rest goes to the real interpreter.
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == drvqwen.bench ]]; then
    [[ -n ${{FAIL_PRESET:-}} && " $* " == *" --preset $FAIL_PRESET "* ]] && exit 1
    shift 2; args="$*"; out=
    while [[ $# -gt 0 ]]; do [[ $1 == --json ]] && out=$2; shift; done
    echo "$args" >> {tmp_path}/bench-calls.txt
    n=$(wc -l < {tmp_path}/bench-calls.txt)
    echo "{{\\"modes\\": {{\\"graph\\": {{\\"itl_median_ms\\": $n, \\"ttft_median_ms\\": 0.5}}}}}}" > "$out"; exit 0
fi
if [[ $1 == tools/make_synthetic.py ]]; then
    echo "$*" >> {tmp_path}/make-calls.txt
    while [[ $# -gt 0 ]]; do [[ $1 == -o ]] && touch "$2"; shift; done
    exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir(exist_ok=True)  # an nvidia-smi that names an H100
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    e = {**os.environ, "PYTHON": str(fake), "DRVQWEN_SOURCE_COMMIT": COMMIT, "DRVQWEN_CACHE": str(tmp_path / "c"),
         "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "TURNS_DIR": str(tmp_path / "shm"), **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "turns", str(tmp_path / "out")], env=e,
                          capture_output=True, text=True, timeout=120)


def _key() -> str:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_commits import synthetic_key
    return synthetic_key(ROOT)[:12]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_every_model_runs_once_a_round_in_order(tmp_path):
    r = _stage(tmp_path, TURNS_MODELS="7b:int4 0.5b:q4_k_m", TURNS_ROUNDS="2", TURNS_BENCH_ARGS="--kernels")
    assert r.returncode == 0, r.stdout + r.stderr
    shm, key = tmp_path / "shm", _key()
    makes = sorted(_lines(tmp_path / "make-calls.txt"))
    assert makes == sorted([f"tools/make_synthetic.py --preset 7b --recipe int4 -o {shm}/syn7b_int4_{key}.nanoqwen",
                            f"tools/make_synthetic.py --preset 0.5b --recipe q4_k_m -o {shm}/syn05b_q4_k_m_{key}.nanoqwen"])
    calls = _lines(tmp_path / "bench-calls.txt")
    models = [(c.split("--preset ")[1].split()[0], c.split("--model ")[1].split()[0]) for c in calls]
    assert models == [("7b", f"{shm}/syn7b_int4_{key}.nanoqwen"), ("0.5b", f"{shm}/syn05b_q4_k_m_{key}.nanoqwen")] * 2, calls
    assert all(c.startswith("--mode graph ") and "--new-tokens 128 --prefill-reps 10 --kernels --json " in c
               for c in calls), calls
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    names = [f"{day}_0123456_h100_{m}_turns_{k}.json" for k in (1, 2) for m in ("syn7b_int4", "syn05b_q4_k_m")]
    assert sorted(p.name for p in (tmp_path / "out" / "turns").glob("*.json")) == sorted(names)
    # The summary reads each JSON: run n of the stand-in wrote ITL n, so the order shows.
    summary = _lines(tmp_path / "out" / "turns-summary.txt")
    assert summary == [f"{n}: graph ITL {i + 1:.4f} ms, TTFT 0.500 ms" for i, n in enumerate(names)]
    # A second run writes no model again: the files are there.
    shutil.rmtree(tmp_path / "out")
    r = _stage(tmp_path, TURNS_MODELS="7b:int4 0.5b:q4_k_m", TURNS_ROUNDS="1")
    assert r.returncode == 0 and len(_lines(tmp_path / "make-calls.txt")) == 2, r.stdout + r.stderr


def test_a_run_again_into_the_same_outdir_reports_its_own_runs_only(tmp_path):
    """The 0.5B's bench fails on the second run: its lines say "no result" (its JSONs of the first
    run are gone, not read as new) and the stage fails; a model file of other code (another key)
    in TURNS_DIR is not used."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "syn7b_int4_000000000000.nanoqwen").touch()   # written by other code
    r = _stage(tmp_path, TURNS_MODELS="7b:int4 0.5b:int4", TURNS_ROUNDS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(_lines(tmp_path / "make-calls.txt")) == 2   # the other key's file did not count
    r = _stage(tmp_path, TURNS_MODELS="7b:int4 0.5b:int4", TURNS_ROUNDS="1", FAIL_PRESET="0.5b")
    assert r.returncode == 1, r.stdout + r.stderr
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert _lines(tmp_path / "out" / "turns-summary.txt") == [
        f"{day}_0123456_h100_syn7b_int4_turns_1.json: graph ITL 3.0000 ms, TTFT 0.500 ms",
        f"{day}_0123456_h100_syn05b_int4_turns_1.json: no result (FileNotFoundError)"]


@pytest.mark.parametrize("env,message", [
    ({"TURNS_MODELS": " "}, "TURNS_MODELS: no model"),
    ({"TURNS_MODELS": "7b:int4 7b:int4"}, "TURNS_MODELS: 7b:int4 twice"),
    ({"TURNS_MODELS": "7b:int4 7b:q3_k"}, "TURNS_MODELS: 7b:q3_k is not PRESET:RECIPE"),
    ({"TURNS_MODELS": "7b"}, "TURNS_MODELS: 7b is not PRESET:RECIPE"),
    ({"TURNS_MODELS": "8b:int4"}, "TURNS_MODELS: 8b:int4 is not PRESET:RECIPE"),
    ({"TURNS_ROUNDS": "three"}, "TURNS_ROUNDS=three: a count of rounds"),
])
def test_a_bad_model_or_round_count_is_refused_before_anything_runs(tmp_path, env, message):
    r = _stage(tmp_path, **env)
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "make-calls.txt").exists() and not (tmp_path / "bench-calls.txt").exists()
