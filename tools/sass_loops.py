#!/usr/bin/env python3
"""The loops of a kernel's machine code, counted: where a main loop waits and what it spills.

    PYTHONPATH=src python3 tools/sass_loops.py KERNEL [--define NAME=INT ...] [--function SUBSTR]
                                               [--near 32] [--copies] [--json OUT]

KERNEL is a file of kernels/ (without .cu), compiled as the launchers compile it (NVRTC through
the cubin cache, with the defines given). Its SASS comes from `cuobjdump -sass` (CUDA's binary
utilities; not part of drvqwen's dependencies: `pip download nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm`, unpack them and put their bin/ on PATH). For each entry point the tool
prints ptxas's report (registers, spills, stack frame) and then every loop — a backward branch
and the instructions from its target to it — that holds a matrix instruction (HMMA: mma.sync,
HGMMA: wgmma), and with --copies also every loop that holds an asynchronous copy into shared
memory and no MMA (a producer warp's: in gemm_int4.cu the group loop is the one with the group's
16 cp.async and 2 TMA copies):

    instructions, MMAs, asynchronous copies, global loads, local loads and stores (a spill, or an
    array the compiler could not keep in registers), and the loads whose value is first read
    fewer than --near instructions after them, in loop order

The last column is the one that finds a stall: a warp waits for a load at the value's first
use, so a load read a few instructions later makes the warp wait for memory there, and every
load after it in the loop goes out only once it has arrived. (A read by a MOV at the loop's end
is usually the hand-over of a batch to the next iteration — the intended wait.) What it counts
is the instruction stream, not time: the GPU decides what a wait costs.

Exit status 2 with one line when cuobjdump is missing or the kernel does not compile.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"Function : (\S+)")
BRANCH = re.compile(r"\bBRA\b(?:\.\w+)*\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)")
GUARD = re.compile(r"^@!?U?P[T\d]+\s+")
REG = re.compile(r"\bR(\d+)(\.64)?\b")


@dataclass
class Loop:
    """One loop of a function: instructions [start, end] (byte offsets), end the backward branch."""
    start: int
    end: int
    instructions: int
    mma: int
    global_loads: int
    local_ops: int
    near_uses: list[dict] = field(default_factory=list)  # {load, at, distance, reader}
    copies: int = 0  # cp.async (LDGSTS) and bulk / TMA copies (UBLKCP, UTMALDG): a producer's loop


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text → {function: [(offset, instruction without the trailing ';'), …]}."""
    out: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in sass.splitlines():
        m = FUNCTION.search(line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = INSTR.match(line)
        if m and cur is not None:
            out[cur].append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(ins: str) -> str:
    """The mnemonic with its modifiers ("LDG.E.128.CONSTANT"), the predicate guard removed."""
    return GUARD.sub("", ins).split(None, 1)[0]


def is_global_load(op: str) -> bool:
    """A load from global memory into registers: LDG, not LDGSTS (cp.async: global to shared
    memory, no register written) nor LDGDEPBAR."""
    return op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))


def registers(ins: str) -> tuple[set[int], set[int]]:
    """(written, read) general registers of one instruction: the first operand is the
    destination for everything but stores, branches and barriers. A .64 operand is two registers.
    RZ is not a register here."""
    body = GUARD.sub("", ins)
    parts = body.split(None, 1)
    if len(parts) < 2:
        return set(), set()
    op, rest = parts
    operands = [o.strip() for o in rest.split(",")]

    def regs(text: str) -> set[int]:
        out = set()
        for m in REG.finditer(text):
            r = int(m.group(1))
            out.add(r)
            if m.group(2):
                out.add(r + 1)
        return out
    reads = set().union(*(regs(o) for o in operands[1:])) if len(operands) > 1 else set()
    if op.startswith(("ST", "RED", "ATOM", "BRA", "BAR", "EXIT", "RET", "CALL", "SYNCS", "WARPSYNC")):
        return set(), reads | regs(operands[0])
    written = regs(operands[0])
    if op.startswith(("HMMA", "IMMA", "DMMA")) and len(operands) > 3:
        reads |= regs(operands[3])  # the accumulator input
    return written, reads


def is_copy(op: str) -> bool:
    """An asynchronous copy into shared memory: cp.async (LDGSTS), a bulk or TMA copy (UBLKCP,
    UTMALDG)."""
    return op.startswith(("LDGSTS", "UBLKCP", "UTMALDG"))


def loops(ins: list[tuple[int, str]], near: int = 32, copies: bool = False) -> list[Loop]:
    """Every loop of a function that holds an MMA — with `copies`, also every loop that holds an
    asynchronous copy and no MMA (a producer warp's) — innermost first by length. A load's first
    use is searched in loop order from the load on, around the back edge once; a later write of
    its register before any read ends the search (the value was never read in the loop)."""
    out = []
    for at, text in ins:
        m = BRANCH.search(text)
        if not m or int(m.group(1), 16) > at:
            continue
        start = int(m.group(1), 16)
        body = [(a, t) for a, t in ins if start <= a <= at]
        ops = [opcode(t) for _a, t in body]
        mma = sum(o.startswith(("HMMA", "HGMMA", "IMMA")) for o in ops)
        n_copies = sum(is_copy(o) for o in ops)
        if not mma and not (copies and n_copies):
            continue
        loop = Loop(start, at, len(body), mma, sum(is_global_load(o) for o in ops),
                    sum(o.startswith(("LDL", "STL")) for o in ops), copies=n_copies)
        for i, (a, t) in enumerate(body):
            if not is_global_load(ops[i]):
                continue
            written, _ = registers(t)
            width = 4 if ".128" in ops[i] else 2 if ".64" in ops[i] else 1
            dest = set(range(min(written), min(written) + width)) if written else set()
            for d in range(1, len(body)):
                a2, t2 = body[(i + d) % len(body)]
                w2, r2 = registers(t2)
                if r2 & dest:
                    if d < near:
                        loop.near_uses.append({"load": f"{a:#x} {ops[i]}", "at": f"{a2:#x}", "distance": d,
                                               "reader": GUARD.sub("", t2)})
                    break
                if w2 & dest:
                    break
        out.append(loop)
    return sorted(out, key=lambda lp: lp.instructions)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="a file of kernels/, without .cu")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=INT")
    ap.add_argument("--function", default="", help="only entry points whose name contains this")
    ap.add_argument("--near", type=int, default=32, help="a first use closer than this many instructions is listed")
    ap.add_argument("--copies", action="store_true",
                    help="also the loops with asynchronous copies and no MMA (a producer warp's)")
    ap.add_argument("--json", help="write every count here")
    a = ap.parse_args()
    from drvqwen.bench import parse_defines
    from drvqwen.cuda.errors import NvrtcError
    from drvqwen.cuda.nvrtc import compile_kernel
    from drvqwen.errors import DrvqwenError

    tool = shutil.which("cuobjdump")
    if tool is None:
        print("error: cuobjdump is not on PATH (CUDA's binary utilities: pip download nvidia-cuda-cuobjdump)",
              file=sys.stderr)
        return 2
    try:
        defines = dict(parse_defines(a.define, option="--define"))
        compiled = compile_kernel(a.kernel, defines=defines)
    except DrvqwenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NvrtcError, FileNotFoundError, OSError) as e:
        print(f"error: {a.kernel}: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    report = {}
    for name, ins in functions(sass).items():
        if a.function not in name:
            continue
        res = compiled.resources.get(name)
        found = loops(ins, a.near, a.copies)
        report[name] = {"resources": asdict(res) if res else None, "loops": [asdict(lp) for lp in found]}
        head = (f"{res.registers} registers, {res.spill_stores_bytes} bytes spill stores, "
                f"{res.stack_frame_bytes} bytes stack frame" if res else "no ptxas report")
        print(f"{name}: {head}")
        for lp in found:
            print(f"  loop {lp.start:#x}–{lp.end:#x}: {lp.instructions} instructions, {lp.mma} MMA, "
                  f"{lp.copies} async copies, {lp.global_loads} global loads, {lp.local_ops} local loads/stores, "
                  f"{len(lp.near_uses)} loads read within {a.near}")
            for u in lp.near_uses:
                print(f"      {u['load']} read {u['distance']} later at {u['at']}: {u['reader']}")
    if a.json:
        from drvqwen.cuda.toolchain import toolchain_id
        from drvqwen.paths import atomic_write_bytes
        from drvqwen.provenance import source_record

        version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        doc = {"kernel": a.kernel, "defines": defines, "near": a.near, "copies": a.copies, "toolchain": toolchain_id(),
               "cuobjdump": version[-1] if version else None, "source": source_record(), "functions": report}
        atomic_write_bytes(Path(a.json), json.dumps(doc, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
