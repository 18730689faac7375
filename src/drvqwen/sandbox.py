"""Running untrusted Python programs (generated code under test): each in its own process, never
in drvqwen's, with limits that keep a hang, a fork bomb or a runaway allocation from taking the
host down. `drvqwen eval humaneval` runs every completion through `run_program`.

Per program:
- a fresh temporary directory as the working directory (removed afterwards), a minimal
  environment, `python3 -I` (no user site, no PYTHON* variables), stdin closed;
- rlimits: address space (RLIMIT_AS, default 1 GiB), CPU seconds (RLIMIT_CPU, the time limit
  + 1), file size (16 MiB), no core files — set by util-linux `prlimit` in the command line
  (no Python code runs between fork and exec: the programs start from worker threads, where
  subprocess's preexec_fn is not safe), or by preexec_fn where `prlimit` is missing;
- where the OS allows it (`unshare` from util-linux; root, or unprivileged user namespaces):
  new network and PID namespaces — no network, and killing the namespace's first process
  kills every process the program started;
- where a pids cgroup can be created (cgroup v2, or v1's pids hierarchy; root): at most
  `max_procs` processes (a fork bomb stops at that count). A `sh` wrapper moves itself into
  the cgroup and then execs the rest, so the program never runs outside it. RLIMIT_NPROC is not used: it counts
  every process of the user and would stop the test runner itself;
- a wall-clock limit (default 10 s): on expiry the process group is killed (SIGKILL), and with
  it the namespace.

`isolation()` says which of these this machine gives; the eval prints it.
"""

from __future__ import annotations

import itertools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MiB = 1 << 20
_counter = itertools.count()
_lock = threading.Lock()


@dataclass
class ProgramResult:
    """What one program did: passed (exit 0 in time), the exit status (None on timeout), and a
    one-line error (the last line of stderr, "timed out after 10 s", "killed by signal 9" …)."""

    passed: bool
    returncode: int | None
    error: str
    timed_out: bool = False


@lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """The `unshare` command line that gives a new network and PID namespace here, or ()."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    base = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")
    for extra in ((), ("--user", "--map-root-user")):
        cmd = (exe, *extra, *base)
        try:
            r = subprocess.run([*cmd, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return cmd
    return ()


@lru_cache(maxsize=1)
def _cgroup_root() -> Path | None:
    """A cgroup folder under which this process may create pids-limited children, or None."""
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if not (root / "cgroup.procs").exists():
            continue
        probe = root / f"drvqwen-probe-{os.getpid()}"
        try:
            probe.mkdir()
            try:
                (probe / "pids.max").write_text("8")
                return root
            finally:
                probe.rmdir()
        except OSError:
            continue
    return None


def isolation() -> dict[str, bool]:
    """Which protections this machine gives: namespaces (no network, one kill for all) and a
    pids cgroup (a cap on processes); rlimits and the time limit always apply."""
    return {"namespaces": bool(_unshare_prefix()), "pids_cgroup": _cgroup_root() is not None}


class _Cgroup:
    """A pids-limited cgroup for one program (removed by close())."""

    def __init__(self, root: Path, max_procs: int):
        with _lock:
            n = next(_counter)
        self.path = root / f"drvqwen-eval-{os.getpid()}-{n}"
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(max_procs))

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:           # processes still being reaped
                threading.Event().wait(0.02)


def _command(prog: Path, cpu_s: int, memory_bytes: int, cgroup: Path | None) -> tuple[list[str], object]:
    """(argv, preexec_fn or None) that runs `prog` inside the cgroup, namespaces and rlimits."""
    cmd = [*_unshare_prefix(), sys.executable, "-I", str(prog)]
    preexec = None
    prlimit = shutil.which("prlimit")
    if prlimit:
        cmd = [prlimit, f"--as={memory_bytes}", f"--cpu={cpu_s}", f"--fsize={16 * MiB}", "--core=0", "--", *cmd]
    else:
        preexec = _limits(cpu_s, memory_bytes)
    if cgroup is not None:
        cmd = ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(cgroup / "cgroup.procs"), *cmd]
    return cmd, preexec


def _limits(cpu_s: int, memory_bytes: int):
    def apply():                      # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * MiB, 16 * MiB))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_program(source: str, timeout_s: float = 10.0, memory_bytes: int = 1024 * MiB,
                max_procs: int = 32) -> ProgramResult:
    """Run the Python program `source` under the limits of the module doc.

    Returns:
        ProgramResult: passed when it exits 0 within timeout_s.
    Never raises for anything the program does; OSError only if no process can be started.
    """
    cg_root = _cgroup_root()
    cg = _Cgroup(cg_root, max_procs) if cg_root is not None else None
    try:
        with tempfile.TemporaryDirectory(prefix="drvqwen-eval-") as d:
            prog = Path(d) / "program.py"
            prog.write_text(source, encoding="utf-8")
            cmd, preexec = _command(prog, int(timeout_s) + 1, memory_bytes, cg.path if cg else None)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": d, "TMPDIR": d}
            p = subprocess.Popen(cmd, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
            try:
                _, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill(p)
                p.communicate()
                return ProgramResult(False, None, f"timed out after {timeout_s:g} s", timed_out=True)
            finally:
                _kill(p)              # anything it left behind in its process group
            lines = err.decode("utf-8", "replace").strip().splitlines()
            if p.returncode == 0:
                return ProgramResult(True, 0, "")
            if p.returncode < 0:
                why = f"killed by signal {-p.returncode} ({signal.Signals(-p.returncode).name})"
            else:
                why = lines[-1] if lines else f"exit status {p.returncode}"
            return ProgramResult(False, p.returncode, why[:300])
    finally:
        if cg is not None:
            _kill_cgroup(cg.path)
            cg.close()


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_cgroup(path: Path) -> None:
    """SIGKILL every process still in the program's cgroup (one that left its process group)."""
    for _ in range(20):
        try:
            pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        threading.Event().wait(0.02)
