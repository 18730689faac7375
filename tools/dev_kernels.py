#!/usr/bin/env python3
"""The kernel workshop's runner: every version of an op in kernels/dev/OP/, checked, then timed.

    PYTHONPATH=src python3 tools/dev_kernels.py OP [--versions NAME ...] [--check-only] [--json FILE]
        OP: gemm_int4 | gemv_int4 | all

For each selected version (a name selects every version it starts, e.g. `v2`; the production
kernel always runs too) the runner
  1. compiles it (NVRTC through the cubin cache) and records its registers and spills;
  2. checks it against the float64 numpy reference (drvqwen.reference and the kernel tests'
     helpers, tests/kernel_testing.py) on fresh inputs from --seed, at the real 7B shapes and at
     awkward small ones: outputs poisoned with NaN must be written in full, nothing past them
     touched, the relative L2 error within the production test's bound (TOL_GEMV), and a second
     launch must give the same bits;
  3. only if every check passed, times it beside the production kernel in the same run the way
     the op's production bench does (tools/bench_gemm.py: graph replay; tools/bench_gemv.py:
     programmatic launches, weights rotated past L2), the median of --samples replays;
and prints one table per op, `version | µs per kernel | TFLOP/s or GB/s | rel err | checks`.
--json writes every figure, every check and each version's cubin key.

The versions and what each one is live in the op modules beside this file (dev_gemm_int4.py,
dev_gemv_int4.py) and in the headers of the kernel files; tests/dev/ runs the checks on the GPU
and keeps the version lists equal to the files on disk. Exit status: 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tools", ROOT / "tests"):  # the op modules; kernel_testing (the tests' helpers)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from drvqwen.launchers.base import KernelRef, Launcher  # noqa: E402

OPS = ("gemm_int4", "gemv_int4")


@dataclass(frozen=True)
class Version:
    """One version of an op.

    Attributes:
        name: what the tables and --versions call it: "production", or the file's stem
            ("v1_mma_sync"), with [DEFINES] when the same file is built another way.
        file: its kernel file below kernels/, without .cu ("gemm_int4", "dev/gemm_int4/v1_mma_sync").
        defines: compile-time definitions ((name, value), ...).
        suffix: its kernels' names are production's + suffix ("_ring" for gemv_int4_residual_ring).
    """

    name: str
    file: str
    defines: tuple[tuple[str, int], ...] = ()
    suffix: str = ""

    @property
    def is_production(self) -> bool:
        return not self.file.startswith("dev/")

    def kernel_ref(self, production: KernelRef) -> KernelRef:
        """This version's kernel standing in for a production kernel."""
        return KernelRef(self.file, production.kernel + self.suffix, self.defines, production.pdl)


def retarget(launcher: Launcher, v: Version, *, grid=None, block=None, smem_bytes=None) -> Launcher:
    """Point every planned launch of a production launcher (not built yet) at version v's kernel:
    same arguments and buffers; grid, block and dynamic shared memory as given, else production's.
    Returns the launcher."""
    for spec in launcher.specs:
        spec.kernel = v.kernel_ref(spec.kernel)
        spec.grid = tuple(grid) if grid is not None else spec.grid
        spec.block = tuple(block) if block is not None else spec.block
        spec.smem_bytes = int(smem_bytes) if smem_bytes is not None else spec.smem_bytes
    return launcher


@dataclass
class Outcome:
    """What the runner found for one version: its build, its checks, its times."""

    version: Version
    build: dict = field(default_factory=dict)   # cache_key, {kernel: registers}, spills
    checks: list = field(default_factory=list)  # {"case", "rel_err", "error"}
    times: dict = field(default_factory=dict)   # kernel label → {"us", "rate"}
    summary: dict = field(default_factory=dict)  # op-specific totals (28 layers ms, …)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["error"] is None for c in self.checks)

    @property
    def worst_rel_err(self) -> float | None:
        errs = [c["rel_err"] for c in self.checks if c["rel_err"] is not None]
        return max(errs) if errs else None

    def check(self, case: str, run, verbose: bool = False) -> None:
        """Run one check: `run()` raises (an assertion, kernel_testing.report's pytest.fail, a
        refused launch) or returns the relative L2 error. The failure is recorded, not raised —
        unless the device no longer synchronizes (a fault poisons the context for every later
        launch): then RuntimeError, naming the version and the case."""
        import pytest

        from drvqwen.cuda import CudaError, get_device

        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rel = float(run())
            self.checks.append({"case": case, "rel_err": rel, "error": None})
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 — Failed is a BaseException
            if isinstance(e, CudaError):
                try:
                    get_device().synchronize()
                except CudaError as fault:
                    raise RuntimeError(f"{self.version.name}, {case}: {e}; the device is unusable: {fault}") from e
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.checks.append({"case": case, "rel_err": None, "error": first})
        if verbose:
            print(out.getvalue(), end="")


def select(versions: list[Version], names: list[str] | None) -> list[Version]:
    """Production, then the versions whose names start with one of `names` (all when None)."""
    if not names:
        return list(versions)
    return [v for v in versions if v.is_production or any(v.name.startswith(n) for n in names)]


def check_names(ops: tuple[str, ...], names: list[str] | None) -> None:
    """Every name of --versions selects a version of at least one of `ops`.

    Raises:
        SystemExit: a name that selects nothing (the message lists the versions).
    """
    versions = [v for op in ops for v in op_module(op).VERSIONS]
    for n in names or ():
        if not any(v.name.startswith(n) for v in versions):
            raise SystemExit(f"dev_kernels: no version {n!r}; versions: {', '.join(dict.fromkeys(v.name for v in versions))}")


def build(outcome: Outcome) -> bool:
    """Compile the version's file; record its cubin key, registers and spills. False if the
    compile failed (recorded as a failed check)."""
    from drvqwen.cuda import NvrtcError, compile_kernel

    v = outcome.version
    try:
        ck = compile_kernel(v.file, defines=dict(v.defines))
    except NvrtcError as e:
        outcome.checks.append({"case": "compile", "rel_err": None, "error": str(e).splitlines()[0]})
        return False
    entries = {r.function: r for r in ck.resources.values() if r.is_entry}
    outcome.build = {"cache_key": ck.cache_key,
                     "registers": {k: r.registers for k, r in sorted(entries.items())},
                     "spills": sorted(k for k, r in entries.items() if r.spills)}
    return True


def op_module(op: str):
    """The op's module (dev_gemm_int4 …): VERSIONS, check(outcomes, rng, verbose),
    time_versions(outcomes, args), print_table(outcomes, args)."""
    return importlib.import_module(f"dev_{op}")


def run_op(op: str, args) -> list[Outcome]:
    import numpy as np

    mod = op_module(op)
    outcomes = [Outcome(v) for v in select(mod.VERSIONS, args.versions)]
    built = [o for o in outcomes if build(o)]
    mod.check(built, np.random.default_rng(args.seed), args.verbose)
    if not args.check_only:
        mod.time_versions([o for o in built if o.passed], args)
    mod.print_table(outcomes, args)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=[*OPS, "all"])
    ap.add_argument("--versions", nargs="+", help="versions to run beside production (a prefix selects "
                                                   "every version it starts, e.g. v2); default: all")
    ap.add_argument("--check-only", action="store_true", help="check every version, time none")
    ap.add_argument("--seed", type=int, default=0, help="seed of the checks' inputs (default 0)")
    ap.add_argument("--samples", type=int, default=5, help="timed replays per figure, median taken (default 5)")
    ap.add_argument("--reps", type=int, default=20, help="calls per timed graph (default 20; the GEMV takes "
                                                        "at least 40, as tools/bench_gemv.py)")
    ap.add_argument("--json", help="write every check and figure to this file")
    ap.add_argument("--verbose", action="store_true", help="print each check's report line")
    a = ap.parse_args(argv)

    ops = OPS if a.op == "all" else (a.op,)
    check_names(ops, a.versions)
    from drvqwen.cuda import GpuUnavailableError, get_device

    try:
        dev = get_device()
    except GpuUnavailableError as e:
        print(f"dev_kernels: {e} (every version still compiles without one: tests/test_compile.py)", file=sys.stderr)
        return 2
    from drvqwen.provenance import source_record

    record = {"tool": "tools/dev_kernels.py", "source": source_record(), "device": dev.info.summary(), "seed": a.seed,
              "samples": a.samples, "ops": {}}
    failed = False
    for op in ops:
        outcomes = run_op(op, a)
        failed |= not all(o.passed for o in outcomes)
        record["ops"][op] = {o.version.name: {"file": o.version.file, "defines": dict(o.version.defines),
                                              "build": o.build, "checks": o.checks, "times": o.times,
                                              "summary": o.summary} for o in outcomes}
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
