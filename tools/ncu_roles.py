#!/usr/bin/env python3
"""The decode step's launches under Nsight Compute, by role: each launch alone, its time and the
instructions a warp of it issues — the parts of a step that the step's own figures add together.

    python3 tools/ncu_roles.py NAME=DETAILS.csv [NAME=DETAILS.csv ...] [--json OUT]
    python3 tools/ncu_roles.py --source NAME=SOURCE.csv [NAME=SOURCE.csv ...] [--json OUT]

DETAILS.csv is what `ncu --csv --page details` printed over the launches of `python -m
drvqwen.bench --mode eager` (tools/gpu_check.sh's `profile` stage writes one per model); the lines
that do not start with a quote (ncu's notes, the bench's own table) are skipped. It needs the
sections SpeedOfLight, LaunchStats and SchedulerStats (WarpStateStats adds the cycles per issued
instruction, InstructionStats the instructions executed). NAME labels the file's column in the
table and its entry in the JSON.

Per launch:
  duration      SpeedOfLight's Duration. ncu serialises the launches and by default flushes the
                caches before each, so a launch runs alone, its weights from HBM, with no
                programmatic overlap: the parts of a step, not the step (drvqwen bench times that).
  warp instructions per warp
                = InstructionStats' Executed Instructions ÷ warps launched (grid × block / 32),
                what a warp executed on the mean; without that section, estimated as SM Active
                Cycles × Issued Warp Per Scheduler × 4 schedulers × SMs ÷ warps — too high where a
                block's warps end at different times (the issue rate is per cycle of a scheduler
                that has a warp, so a long tail of one warp, a GEMV's epilogue, counts as if all
                four schedulers issued): "instructions_from" says which. A decode GEMV at the
                0.5B's shapes gives a warp one or two items and waits out each instruction's
                latency, so the instructions on a warp's path are most of the launch.
Roles: the kernel's name, but for the residual GEMVs (gemv_*_residual), which serve o_proj after
the attention's launches and down_proj after gate/up: named by the launch before them
("o_proj", "down_proj"), else "residual". Per (kernel, role): the median duration in µs, the mean
instructions per warp and cycles per issued instruction, grid, block and registers.

--source reads the source page instead (`ncu -i REPORT --page source --csv --print-source sass`,
the stage's profile-source-NAME.csv): per kernel of the report, the warp-level executions of its
SASS ("Instructions Executed") in the regions between the instructions that divide a GEMV's life —
griddepcontrol.wait (ACQBULK), each block barrier (BAR.SYNC) and EXIT — in address order, and the
instructions executed most: where the warp instructions that the details page counts are spent.

Exit status 2 with one line for a file that is not such a page or lacks a metric.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import statistics
import sys
from pathlib import Path

SCHEDULERS_PER_SM = 4  # Hopper: four warp schedulers (SM sub-partitions) per SM

# (section, metric) of each figure read per launch.
DURATION = ("GPU Speed Of Light Throughput", "Duration")
SM_ACTIVE = ("GPU Speed Of Light Throughput", "SM Active Cycles")
ISSUED = ("Scheduler Statistics", "Issued Warp Per Scheduler")
SMS = ("Launch Statistics", "# SMs")
GRID = ("Launch Statistics", "Grid Size")
BLOCK = ("Launch Statistics", "Block Size")
REGISTERS = ("Launch Statistics", "Registers Per Thread")
CPI = ("Warp State Statistics", "Warp Cycles Per Issued Instruction")
EXECUTED = ("Instruction Statistics", "Executed Instructions")
NEEDED = (DURATION, SM_ACTIVE, ISSUED, SMS, GRID, BLOCK, REGISTERS)

# A duration's unit → µs (ncu prints base units with --print-units base, else scales them).
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
              "s": 1e6, "second": 1e6}


class ProfileError(Exception):
    """A file that is not a details page, or lacks a metric: one line naming the file and what."""


def read_launches(path: Path) -> list[dict]:
    """The launches of a details page in ID order: {"id", "kernel", "metrics": {(section, metric):
    (value, unit)}}. Values as floats (ncu's thousands separators removed); text values skipped."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines(keepends=True) if ln.startswith('"')]
    if not lines:
        raise ProfileError(f"{path}: no CSV rows (not the output of ncu --csv --page details)")
    rows = csv.DictReader(io.StringIO("".join(lines)))
    need = {"ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(rows.fieldnames or ()):
        raise ProfileError(f"{path}: columns {sorted(need - set(rows.fieldnames or ()))} missing "
                           "(not the output of ncu --csv --page details)")
    launches: dict[int, dict] = {}
    for r in rows:
        try:
            lid = int(r["ID"])
            value = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        ln = launches.setdefault(lid, {"id": lid, "kernel": r["Kernel Name"], "metrics": {}})
        ln["metrics"][(r["Section Name"], r["Metric Name"])] = (value, r["Metric Unit"])
    return [launches[i] for i in sorted(launches)]


def role_of(kernel: str, previous: str | None) -> str:
    """The step role of a launch: the residual GEMVs by the launch before them, else the kernel."""
    if not kernel.endswith("_residual"):
        return kernel
    if previous and "attention" in previous:
        return "o_proj"
    if previous and "gate_up" in previous:
        return "down_proj"
    return "residual"


def launch_figures(path: Path, ln: dict) -> dict:
    """Duration (µs), warp instructions per warp, cycles per issued instruction, grid, block and
    registers of one launch."""
    m = ln["metrics"]
    for key in NEEDED:
        if key not in m:
            raise ProfileError(f"{path}: launch {ln['id']} ({ln['kernel']}) has no {key[0]} / {key[1]} "
                               "(profile with the sections SpeedOfLight, LaunchStats and SchedulerStats)")
    value, unit = m[DURATION]
    if unit not in TIME_UNITS:
        raise ProfileError(f"{path}: launch {ln['id']}: duration in unknown unit {unit!r}")
    warps = m[GRID][0] * m[BLOCK][0] / 32
    if EXECUTED in m:
        per_warp, source = m[EXECUTED][0] / warps, "executed"
    else:
        per_warp, source = m[SM_ACTIVE][0] * m[ISSUED][0] * SCHEDULERS_PER_SM * m[SMS][0] / warps, "estimate"
    return {"duration_us": value * TIME_UNITS[unit], "instructions_per_warp": per_warp, "instructions_from": source,
            "cpi": m[CPI][0] if CPI in m else None,
            "grid": int(m[GRID][0]), "block": int(m[BLOCK][0]), "registers": int(m[REGISTERS][0])}


def roles(path: Path) -> list[dict]:
    """Per (kernel, role) of a details page, in order of first appearance: launches, the median
    duration, the mean instructions per warp and cycles per issued instruction, grid, block and
    registers (of the first launch)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    previous = None
    for ln in read_launches(path):
        groups.setdefault((ln["kernel"], role_of(ln["kernel"], previous)), []).append(launch_figures(path, ln))
        previous = ln["kernel"]
    out = []
    for (kernel, role), figs in groups.items():
        cpis = [f["cpi"] for f in figs if f["cpi"] is not None]
        out.append({"kernel": kernel, "role": role, "launches": len(figs),
                    "duration_us": round(statistics.median(f["duration_us"] for f in figs), 3),
                    "instructions_per_warp": round(statistics.mean(f["instructions_per_warp"] for f in figs)),
                    "instructions_from": "/".join(sorted({f["instructions_from"] for f in figs})),
                    "cycles_per_issued_instruction": round(statistics.mean(cpis), 2) if cpis else None,
                    "grid": figs[0]["grid"], "block": figs[0]["block"], "registers": figs[0]["registers"]})
    return out


SOURCE_COLUMNS = ("Address", "Source", "Instructions Executed")
SAMPLES = "Warp Stall Sampling (All Samples)"
MARKERS = ("ACQBULK", "BAR.SYNC", "EXIT")  # the region boundaries, by opcode


def _count(text: str) -> float:
    try:
        return float((text or "").replace(",", ""))
    except ValueError:
        return 0.0


def read_source(path: Path) -> dict[str, list[dict]]:
    """The SASS of each kernel of a source page: {kernel: [{"address", "sass", "executed", "samples"}]}
    in address order. A kernel's table starts at a header row holding SOURCE_COLUMNS; the one-cell
    row before it, where there is one, names the kernel (else "kernel N")."""
    rows = list(csv.reader(io.StringIO(path.read_text(errors="replace"))))
    out: dict[str, list[dict]] = {}
    header = None
    for i, row in enumerate(rows):
        if all(c in row for c in SOURCE_COLUMNS):
            header = {c: row.index(c) for c in (*SOURCE_COLUMNS, SAMPLES) if c in row}
            prev = [c for c in rows[i - 1] if c.strip()] if i else []
            name = prev[0].strip() if len(prev) == 1 else f"kernel {len(out) + 1}"
            while name in out:
                name += "'"
            table = out[name] = []
            continue
        if header is None or len(row) <= max(header.values()):
            continue
        address = row[header["Address"]].strip()
        if not address:
            continue
        table.append({"address": address, "sass": row[header["Source"]].strip(),
                      "executed": _count(row[header["Instructions Executed"]]),
                      "samples": _count(row[header[SAMPLES]]) if SAMPLES in header else 0.0})
    if not out:
        raise ProfileError(f"{path}: no table with the columns {', '.join(SOURCE_COLUMNS)} "
                           "(not the output of ncu --page source --csv --print-source sass)")
    return out


def _opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def source_regions(table: list[dict], top: int = 12) -> dict:
    """A kernel's executions split at MARKERS (each region: its first and last address, the
    executions of its instructions, and the marker that ends it), its total, and the `top`
    instructions by executions."""
    regions, cur = [], None
    for ins in table:
        if cur is None:
            cur = {"from": ins["address"], "to": ins["address"], "executed": 0.0, "samples": 0.0, "ends_at": None}
        cur["to"] = ins["address"]
        cur["executed"] += ins["executed"]
        cur["samples"] += ins["samples"]
        op = _opcode(ins["sass"])
        if any(op.startswith(m) for m in MARKERS):
            cur["ends_at"] = op
            regions.append(cur)
            cur = None
    if cur is not None:
        regions.append(cur)
    ranked = sorted(table, key=lambda x: -x["executed"])[:top]
    return {"executed": sum(x["executed"] for x in table), "samples": sum(x["samples"] for x in table),
            "regions": [r for r in regions if r["executed"] or r["samples"]],
            "top": [{"address": x["address"], "sass": x["sass"], "executed": x["executed"]} for x in ranked]}


def _read_pages(pages: list[str], read) -> dict:
    """{NAME: read(path)} for each NAME=FILE argument; ProfileError for a malformed one or a missing file."""
    out = {}
    for item in pages:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ProfileError(f"{item!r} is not NAME=FILE")
        if not Path(path).is_file():
            raise ProfileError(f"{path}: no such file")
        out[name] = read(Path(path))
    return out


def print_roles(out: dict) -> None:
    """One row per role, each file's median µs and instructions per warp side by side (a role is
    matched across files by its name without the weight format's part: gemv_int4_, gemv_fmt_,
    gemv_f16_, _fmt)."""
    def key(r):
        return re.sub(r"_fmt$", "", re.sub(r"^gemv_(int4|fmt|f16)_", "", r["role"]))
    order = list(dict.fromkeys(key(r) for rows in out.values() for r in rows))
    print(f"{'role':32s}" + "".join(f"{n[:24]:>26s}" for n in out))
    for k in order:
        cells = []
        for rows in out.values():
            r = next((r for r in rows if key(r) == k), None)
            cells.append(f"{r['duration_us']:9.2f} µs {r['instructions_per_warp']:6d} i/w" if r else "—")
        print(f"{k[:32]:32s}" + "".join(f"{c:>26s}" for c in cells))


def print_regions(out: dict) -> None:
    """Per file and kernel: its executions, then each region's."""
    for name, kernels in out.items():
        for kernel, s in kernels.items():
            print(f"{name}: {kernel}: {s['executed']:.0f} warp instructions executed")
            for r in s["regions"]:
                print(f"  {r['from']}–{r['to']} {r['executed']:10.0f}  up to {r['ends_at'] or 'the end'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="+", metavar="NAME=FILE", help="DETAILS.csv (SOURCE.csv with --source)")
    ap.add_argument("--json", help="write {NAME: [per role …]} here ({NAME: {kernel: regions}} with --source)")
    ap.add_argument("--source", action="store_true", help="the files are source pages (see above)")
    a = ap.parse_args(argv)
    try:
        if a.source:
            out = _read_pages(a.pages, lambda p: {k: source_regions(t) for k, t in read_source(p).items()})
        else:
            out = _read_pages(a.pages, roles)
    except ProfileError as e:
        print(f"ncu_roles: {e}", file=sys.stderr)
        return 2
    (print_regions if a.source else print_roles)(out)
    if a.json:  # a temporary name, then the rename: never half a file
        tmp = Path(a.json + ".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(a.json)
    return 0

if __name__ == "__main__":
    sys.exit(main())
