"""tools/ncu_roles.py and tools/gpu_check.sh's `profile` stage on the CPU: details pages written
here in ncu's CSV layout (its header, one row per metric, thousands separators, the program's own
lines between), and a stand-in `ncu` for the stage."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import ncu_roles  # noqa: E402

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value", "Rule Name",
          "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup"]


def _launch_rows(lid: int, kernel: str, *, duration=(7416.28, "ns"), sm_active=5000.0, issued=0.25, grid=72,
                 block=224, regs=119, cpi=8.0, executed=None, skip=()) -> list[list[str]]:
    metrics = [("GPU Speed Of Light Throughput", "Duration", duration[1], duration[0]),
               ("GPU Speed Of Light Throughput", "SM Active Cycles", "cycle", sm_active),
               ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", 5.5),
               ("Scheduler Statistics", "Issued Warp Per Scheduler", "", issued),
               ("Launch Statistics", "# SMs", "SM", 132),
               ("Launch Statistics", "Grid Size", "", grid),
               ("Launch Statistics", "Block Size", "", block),
               ("Launch Statistics", "Registers Per Thread", "register/thread", regs),
               ("Launch Statistics", "Cluster Scheduling Policy", "", "Spread"),  # a text value: skipped
               ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", cpi)]
    if executed is not None:
        metrics.append(("Instruction Statistics", "Executed Instructions", "inst", executed))
    return [[str(lid), "1", "python3.12", "127.0.0.1", kernel, "1", "14", f"({block}, 1, 1)", f"({grid}, 1, 1)",
             "0", "9.0", sec, name, unit, f"{value:,}" if isinstance(value, float) else str(value), "", "", "", "", ""]
            for sec, name, unit, value in metrics if name not in skip]


def _page(path: Path, launches: list[list[list[str]]]) -> Path:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    for rows in launches:
        w.writerows(rows)
    path.write_text("==PROF== Connected to process 1\n┃ mode ┃ ITL ┃\n" + buf.getvalue() + "==PROF== Disconnected\n")
    return path


def _step(tmp_path: Path, name: str, fmt: str, slow: float) -> Path:
    """One layer's launches of a step: qkv_rope, attention, o_proj, gate/up, down_proj."""
    k = f"gemv_{fmt}"
    return _page(tmp_path / f"{name}.csv", [
        _launch_rows(0, f"{k}_qkv_rope", duration=(7400.0 * slow, "ns")),
        _launch_rows(1, "attention_decode_cluster_hd64", duration=(6.5, "us")),
        _launch_rows(2, f"{k}_residual", duration=(5400.0 * slow, "ns"), grid=56),
        _launch_rows(3, f"{k}_gate_up_swiglu", duration=(8900.0, "ns"), grid=152),
        _launch_rows(4, f"{k}_residual", duration=(7500.0, "ns"), grid=56, block=256),
        _launch_rows(5, f"{k}_qkv_rope", duration=(7600.0 * slow, "ns")),
        _launch_rows(6, f"{k}_qkv_rope", duration=(0.0072 * slow, "ms")),
    ])


def test_roles_median_and_instructions_per_warp(tmp_path):
    rows = {r["role"]: r for r in ncu_roles.roles(_step(tmp_path, "a", "int4", 1.0))}
    assert list(rows) == ["gemv_int4_qkv_rope", "attention_decode_cluster_hd64", "o_proj", "gemv_int4_gate_up_swiglu",
                          "down_proj"]
    q = rows["gemv_int4_qkv_rope"]
    assert q["launches"] == 3 and q["duration_us"] == pytest.approx(7.4)  # median of 7.4, 7.6, 7.2 µs (ms and ns)
    # 5000 active cycles × 0.25 issued per scheduler × 4 × 132 SMs over 72 × 224 / 32 warps
    assert q["instructions_per_warp"] == round(5000 * 0.25 * 4 * 132 / (72 * 7))
    assert rows["attention_decode_cluster_hd64"]["duration_us"] == pytest.approx(6.5)
    assert rows["o_proj"]["grid"] == 56 and rows["down_proj"]["block"] == 256
    assert rows["down_proj"]["duration_us"] == pytest.approx(7.5)
    assert q["instructions_from"] == "estimate"


def test_executed_instructions_are_used_where_the_page_has_them(tmp_path):
    page = _page(tmp_path / "x.csv", [_launch_rows(0, "gemv_fmt_qkv_rope", executed=504_000.0),
                                      _launch_rows(1, "gemv_fmt_qkv_rope", executed=604_800.0)])
    (r,) = ncu_roles.roles(page)
    assert r["instructions_per_warp"] == round((1000 + 1200) / 2)  # over 72 × 224 / 32 = 504 warps
    assert r["instructions_from"] == "executed"


def test_a_residual_without_its_neighbour_is_named_residual():
    assert ncu_roles.role_of("gemv_fmt_residual", None) == "residual"
    assert ncu_roles.role_of("gemv_fmt_residual", "attention_combine") == "o_proj"
    assert ncu_roles.role_of("gemv_fmt_residual", "gemv_fmt_gate_up_swiglu") == "down_proj"
    assert ncu_roles.role_of("gemv_fmt_qkv_rope", "anything") == "gemv_fmt_qkv_rope"


def test_two_pages_side_by_side_in_the_json(tmp_path, capsys):
    out = tmp_path / "roles.json"
    rc = ncu_roles.main([f"int4={_step(tmp_path, 'a', 'int4', 1.0)}", f"fmt={_step(tmp_path, 'b', 'fmt', 1.4)}",
                         "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert set(d) == {"int4", "fmt"}
    fq = next(r for r in d["fmt"] if r["role"] == "gemv_fmt_qkv_rope")
    assert fq["duration_us"] == pytest.approx(7.4 * 1.4)
    table = capsys.readouterr().out
    qkv_line = next(ln for ln in table.splitlines() if ln.startswith("qkv_rope"))  # matched across formats
    assert "7.40" in qkv_line and "10.36" in qkv_line


@pytest.mark.parametrize("case", ["missing_metric", "unknown_unit", "not_csv", "bad_argument"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    if case == "missing_metric":
        arg = "x=" + str(_page(tmp_path / "p.csv", [_launch_rows(0, "k", skip=("Issued Warp Per Scheduler",))]))
    elif case == "unknown_unit":
        arg = "x=" + str(_page(tmp_path / "p.csv", [_launch_rows(0, "k", duration=(3.0, "fortnight"))]))
    elif case == "not_csv":
        (tmp_path / "p.csv").write_text("ncu: no kernels were profiled\n")
        arg = f"x={tmp_path / 'p.csv'}"
    else:
        arg = str(tmp_path / "p.csv")
    assert ncu_roles.main([arg]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ncu_roles: ")
    assert {"missing_metric": "Issued Warp Per Scheduler", "unknown_unit": "fortnight", "not_csv": "no CSV rows",
            "bad_argument": "is not NAME=FILE"}[case] in err[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_profile_stage_runs_ncu_per_model_and_writes_the_roles(tmp_path):
    # A stand-in ncu: a details run prints the file it is given as the model (here a details page
    # stands for each model), a run with -o writes the report, -i prints a source page's header;
    # every call is recorded.
    pages = {"int4": _step(tmp_path, "a", "int4", 1.0), "fmt": _step(tmp_path, "b", "fmt", 1.4)}
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    ncu = bin_ / "ncu"
    ncu.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {tmp_path}/ncu-calls.txt
if [[ $1 == -i ]]; then echo '"Address","Source","Instructions Executed"'; exit 0; fi
out=; model=
while [[ $# -gt 0 ]]; do
    [[ $1 == -o ]] && out=$2
    [[ $1 == --model ]] && model=$2
    shift
done
if [[ -n $out ]]; then : > "$out.ncu-rep"; exit 0; fi
cat "$model"
""")
    ncu.chmod(0o755)
    models = " ".join(f"{n}={p}" for n, p in pages.items())  # the pages stand for the models' files
    env = {**os.environ, "PYTHON": sys.executable, "PROFILE_MODELS": models, "DRVQWEN_CACHE": str(tmp_path / "c"),
           "PATH": f"{bin_}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "profile", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert set(d) == {"int4", "fmt"}
    assert {row["role"] for row in d["fmt"]} >= {"gemv_fmt_qkv_rope", "o_proj", "down_proj"}
    calls = (tmp_path / "ncu-calls.txt").read_text().splitlines()
    assert len(calls) == 6  # per model: the details page, the source run, its import
    assert all("--clock-control none" in c for c in calls if not c.startswith("-i"))
    assert (tmp_path / "out" / "profile-source-fmt.csv").read_text().startswith('"Address"')
    assert set(json.loads((tmp_path / "out" / "profile-source.json").read_text())) == {"int4", "fmt"}


def _source_page(path: Path) -> Path:
    """Two kernels' tables as the source page prints them: a one-cell row naming the kernel, the
    header, one row per SASS instruction (executions with thousands separators)."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    cols = ["Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"]
    for kernel, body in (("gemv_fmt_qkv_rope", [("LDG.E.128 R4, [R2]", 504), ("ACQBULK", 504), ("LDG.E R6, [R8]", 504),
                                                 ("BAR.SYNC.DEFER_BLOCKING 0x0", 504), ("HMMA.16816.F32 R0, R4, R6, R0", 504),
                                                 ("@P0 BRA 0x40", 1008), ("BAR.SYNC.DEFER_BLOCKING 0x0", 504),
                                                 ("@P0 EXIT", 504), ("FFMA R1, R2, R3, R1", 1200), ("EXIT", 72)]),
                         ("gemv_fmt_gate_up_swiglu", [("IMAD R1, R2, R3, R4", 2000), ("EXIT", 1000)])):
        w.writerow([kernel])
        w.writerow(cols)
        for i, (sass, n) in enumerate(body):
            w.writerow([f"{0x10 * i:08x}", sass, f"{n:,}", str(n // 100)])
    path.write_text(buf.getvalue())
    return path


def test_source_regions_split_at_the_wait_barriers_and_exits(tmp_path):
    tables = ncu_roles.read_source(_source_page(tmp_path / "s.csv"))
    assert list(tables) == ["gemv_fmt_qkv_rope", "gemv_fmt_gate_up_swiglu"]
    s = ncu_roles.source_regions(tables["gemv_fmt_qkv_rope"], top=2)
    assert s["executed"] == 504 * 7 + 1008 + 1200 + 72
    assert [(r["executed"], r["ends_at"]) for r in s["regions"]] == [
        (1008, "ACQBULK"), (1008, "BAR.SYNC.DEFER_BLOCKING"), (504 + 1008 + 504, "BAR.SYNC.DEFER_BLOCKING"),
        (504, "EXIT"), (1200 + 72, "EXIT")]
    assert [t["sass"] for t in s["top"]] == ["FFMA R1, R2, R3, R1", "@P0 BRA 0x40"]


def test_source_json_and_a_page_without_the_table(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert ncu_roles.main(["--source", f"fmt={_source_page(tmp_path / 's.csv')}", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["fmt"]["gemv_fmt_gate_up_swiglu"]["executed"] == 3000
    (tmp_path / "bad.csv").write_text('"ID","Kernel Name"\n"0","k"\n')
    capsys.readouterr()
    assert ncu_roles.main(["--source", f"x={tmp_path / 'bad.csv'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no table with the columns" in err[0]
