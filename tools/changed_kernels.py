#!/usr/bin/env python3
"""Which kernel entry points run different machine code than at another commit?

    python3 tools/changed_kernels.py BASE [--build FILE:NAME=INT,...] [--json OUT]

Compiles the kernel builds below from the checkout's kernels/ and ptx/ and from BASE's
(bench_commits.write_tree: `git archive`, no checkout of it), both with this checkout's NVRTC options, and compares each
extern "C" entry point's code in the two cubins: its `.text.<entry>` section (the SASS, with
every device function inlined into it or called from it by offset) and its relocations, and its
line of the ptxas report (registers, stack, static shared memory, barriers). An entry whose
bytes and resources are equal runs the same instructions; a comment, a renamed local or a
moved helper leaves them equal. (Not `.nv.info.<entry>`: it holds section and symbol indices,
which move when another kernel of the file changes.)

Why: the sanitizers are the slow stage on the GPU (racecheck 10–100× a plain run), and a change
needs them over the nodes of the kernels it touched (tools/sanitize_nodes.txt). The last line
printed is those entry points, space-separated, for `SANITIZE_KERNELS="…" tools/gpu_check.sh
sanitize OUT`, which runs the nodes that launch any of them.

Builds compared: every kernels/*.cu in its default build, and the builds the engine compiles for
the 7B and 0.5B shapes, INT4, with and without the verify pass (engine.engine_kernels); `--build`
adds others (a file, then its defines). An entry point new since BASE, or in a file BASE lacks,
counts as changed. Needs NVRTC (no GPU); the cubins go through the cubin cache.

Prints one line per entry point that differs ("changed" / "new", with its file and build) and the
list; exits 0 (also when nothing changed), 2 on a bad argument, 1 (one line) on a BASE that is
not a commit of this repository.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from bench_commits import resolve, write_tree  # noqa: E402
from drvqwen.bench import parse_defines  # noqa: E402
from drvqwen.config import PRESETS  # noqa: E402
from drvqwen.errors import DrvqwenError  # noqa: E402
from drvqwen.cuda.nvrtc import compile_kernels  # noqa: E402
from drvqwen.engine import engine_kernels  # noqa: E402

STO_CUDA_ENTRY = 0x10   # st_other of an extern "C" __global__ symbol in a CUDA ELF
STT_FUNC = 2
SHT_NOBITS = 8


def entry_code(cubin: bytes) -> dict[str, bytes]:
    """{entry point: its code} of a cubin (ELF64, little-endian): for each symbol that is a
    CUDA entry function, the bytes of `.text.<name>` and `.rela.text.<name>` (whichever exist),
    each after its section's name.

    Raises:
        ValueError: not a 64-bit little-endian ELF.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (a cubin)")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(table_offset: int, at: int) -> str:
        start = table_offset + at
        return cubin[start:cubin.index(b"\0", start)].decode()

    names = [cstr(headers[shstrndx][4], h[0]) for h in headers]
    body = {n: (b"" if h[1] == SHT_NOBITS else cubin[h[4]:h[4] + h[5]]) for n, h in zip(names, headers)}
    symtab = headers[names.index(".symtab")]
    strtab_offset = headers[symtab[6]][4]
    entries = []
    for off in range(symtab[4], symtab[4] + symtab[5], 24):
        st_name, st_info, st_other = struct.unpack_from("<IBB", cubin, off)
        if st_info & 0xF == STT_FUNC and st_other & STO_CUDA_ENTRY:
            entries.append(cstr(strtab_offset, st_name))
    return {e: b"".join(f"{s}:".encode() + body[s] for s in (f".text.{e}", f".rela.text.{e}")
                        if s in body)
            for e in entries}


def builds(extra: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The (kernel file, defines) compared: each file's default build, the engine's builds for
    the 7B and 0.5B, and `extra`; each once."""
    wanted = {(p.stem, ()) for p in (ROOT / "kernels").glob("*.cu")}
    for preset in ("7b", "0.5b"):
        for speculative in (False, True):
            wanted |= {(n, tuple(sorted(d.items()))) for n, d in engine_kernels(PRESETS[preset], speculative=speculative)}
    wanted |= {(n, tuple(sorted(d.items()))) for n, d in extra}
    return [(n, dict(d)) for n, d in sorted(wanted)]


def base_tree(base: str, into: Path) -> Path:
    """BASE's tree (src/, kernels/, ptx/: bench_commits.write_tree, by git archive; nothing
    checked out) under `into`.

    Raises:
        SystemExit: one line, when BASE is not a commit of this repository.
    """
    try:
        commit = resolve([base])[0]
    except SystemExit:
        raise SystemExit(f"changed_kernels: {base}: not a commit of this repository") from None
    return write_tree(commit, into)


def changed(base_root: Path, head_root: Path, requests: list[tuple[str, dict]]) -> list[dict]:
    """[{file, defines, entry, status: "changed" | "new"}] for every entry point of `requests`
    whose code at `head_root` (kernels/, ptx/) differs from `base_root`'s or that base lacks."""
    head = compile_kernels(requests, kernels_dir=head_root / "kernels", include_dir=head_root / "ptx")
    in_base = [(n, d) for n, d in requests if (base_root / "kernels" / f"{n}.cu").is_file()]
    base_out = dict(zip(map(repr, in_base),
                        compile_kernels(in_base, kernels_dir=base_root / "kernels", include_dir=base_root / "ptx")))
    rows = []
    for (name, defines), h in zip(requests, head):
        b = base_out.get(repr((name, defines)))
        old = _entries(b) if b is not None else {}
        for entry, code in sorted(_entries(h).items()):
            if entry not in old:
                rows.append(dict(file=name, defines=defines, entry=entry, status="new"))
            elif old[entry] != code:
                rows.append(dict(file=name, defines=defines, entry=entry, status="changed"))
    return rows


def _entries(compiled) -> dict[str, tuple[bytes, object]]:
    """{entry: (its code, its ptxas report line)} of a CompiledKernel."""
    return {e: (code, compiled.resources.get(e)) for e, code in entry_code(compiled.cubin).items()}


def parse_build(text: str) -> tuple[str, dict]:
    """"FILE:NAME=INT,NAME=INT" (or "FILE") → (file, defines), the defines as bench.parse_defines
    reads them."""
    name, _, rest = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--build {text!r}: no kernel file")
    try:
        return name, dict(parse_defines([d for d in rest.split(",") if d], "--build"))
    except DrvqwenError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit to compare with (anything git rev-parse takes)")
    ap.add_argument("--build", type=parse_build, action="append", default=[], metavar="FILE:NAME=INT,…")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = changed(base_tree(args.base, Path(tmp)), ROOT, builds(args.build))
    for r in rows:
        d = ",".join(f"{k}={v}" for k, v in r["defines"].items())
        print(f"{r['status']:8} {r['file']}{':' + d if d else ''} {r['entry']}")
    entries = sorted({r["entry"] for r in rows})
    if args.json:
        args.json.write_text(json.dumps(dict(base=args.base, rows=rows, entries=entries), indent=1) + "\n")
    print(" ".join(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
