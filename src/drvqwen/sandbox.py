"""Running untrusted Python programs (generated code under test): each in its own process, never
in drvqwen's, with limits that keep a hang, a fork bomb, a runaway allocation or a flood of
output from taking the host (or drvqwen itself) down. `drvqwen eval humaneval` runs every
completion through `run_program`.

Per program — the program and every process it starts:
- a fresh temporary directory as the working directory (removed afterwards), a minimal
  environment, `python3 -I` (no user site, no PYTHON* variables), stdin closed;
- rlimits on each process: address space (RLIMIT_AS, default 1 GiB), CPU seconds (RLIMIT_CPU,
  the time limit + 1), file size (16 MiB), no core files — set by util-linux `prlimit` in the
  command line (no Python code runs between fork and exec: the programs start from worker
  threads, where subprocess's preexec_fn is not safe), or by preexec_fn where `prlimit` is
  missing;
- where a cgroup can be created (cgroup v2, or v1's hierarchies; root): a memory cgroup capping
  the program and its children together at the same `memory_bytes` (swap included), and a pids
  cgroup capping its processes at `max_procs` (a fork bomb stops at that count). A `sh` wrapper
  moves itself into the cgroups and then execs the rest, so the program never runs outside
  them. RLIMIT_NPROC is not used: it counts every process of the user and would stop the test
  runner itself. Without a memory cgroup each process is capped alone (RLIMIT_AS), so children
  add up; without a pids cgroup only the time limit ends a fork bomb;
- where the OS allows it (`unshare` from util-linux; root, or unprivileged user namespaces):
  new network and PID namespaces — no network, and killing the namespace's first process
  kills every process the program started;
- output: stdout and stderr are read to their end but only their last TAIL_BYTES are kept, so
  a program printing gigabytes costs drvqwen no memory; a file it writes is capped at 16 MiB
  (the disk as a whole is not);
- a wall-clock limit (default 10 s): on expiry the process group is killed (SIGKILL), and with
  it the namespace and everything left in the cgroups; so is what it leaves running when it
  exits.

`isolation()` says which of these this machine gives; the eval prints it.
"""

from __future__ import annotations

import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MiB = 1 << 20
# The bytes of stdout and of stderr kept per program: the error line comes from the end.
TAIL_BYTES = 64 << 10
# Seconds to read what is left in the pipes once the program has exited.
DRAIN_S = 1.0
CGROUP_FS = Path("/sys/fs/cgroup")
_counter = itertools.count()
_lock = threading.Lock()


@dataclass
class ProgramResult:
    """What one program did: passed (exit 0 in time), the exit status (None on timeout), a
    one-line error (the last line of stderr, "timed out after 10 s", "killed by signal 9" …),
    and the last TAIL_BYTES of its stdout and stderr."""

    passed: bool
    returncode: int | None
    error: str
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""


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


def _limit_files(controller: str, root: Path, max_procs: int, memory_bytes: int) -> list[tuple[str, str, bool]]:
    """(file, value, required) to write in a new cgroup under `root` for `controller`."""
    if controller == "pids":
        return [("pids.max", str(max_procs), True)]
    if (root / "cgroup.controllers").exists():          # v2 (v1 folders have no such file)
        return [("memory.max", str(memory_bytes), True), ("memory.swap.max", "0", False)]
    # v1: the memory+swap limit may only be set once the memory limit is (and exists only with
    # swap accounting).
    return [("memory.limit_in_bytes", str(memory_bytes), True),
            ("memory.memsw.limit_in_bytes", str(memory_bytes), False)]


def _write_limits(path: Path, files: list[tuple[str, str, bool]]) -> None:
    for name, value, required in files:
        f = path / name
        if required or f.exists():
            f.write_text(value)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and under "" its v2 one (/proc/self/cgroup)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


@lru_cache(maxsize=1)
def _cgroup_roots() -> dict[str, Path]:
    """{controller: folder} for "pids" and "memory": where this process may create a child
    cgroup with that limit — in v1 the controller's own hierarchy, in v2 the unified one;
    under this process's own cgroup where it can (so that the limits it lives under still
    count the program), else at the hierarchy's root. A controller it cannot use is left out."""
    own = _own_cgroups()
    roots: dict[str, Path] = {}
    for controller in ("pids", "memory"):
        candidates = []
        for hierarchy, key in ((CGROUP_FS / controller, controller), (CGROUP_FS, "")):
            mine = own.get(key, "/").strip("/")
            candidates += [hierarchy / mine] if mine else []
            candidates.append(hierarchy)
        for root in candidates:
            if not (root / "cgroup.procs").exists():
                continue
            probe = root / f"drvqwen-probe-{os.getpid()}-{controller}"
            try:
                probe.mkdir()
                try:
                    _write_limits(probe, _limit_files(controller, root, 8, 64 * MiB))
                    roots[controller] = root
                    break
                finally:
                    probe.rmdir()
            except OSError:
                continue
    return roots


def isolation() -> dict[str, bool]:
    """Which protections this machine gives beyond the rlimits and the time limit (which
    always apply): namespaces (no network, one kill for all), a pids cgroup (a cap on
    processes) and a memory cgroup (one cap on the program and its children together)."""
    roots = _cgroup_roots()
    return {"namespaces": bool(_unshare_prefix()), "pids_cgroup": "pids" in roots,
            "memory_cgroup": "memory" in roots}


class _Cgroups:
    """The cgroups of one program (one folder per hierarchy), with its limits; close() kills
    what is left in them and removes them."""

    def __init__(self, max_procs: int, memory_bytes: int):
        with _lock:
            n = next(_counter)
        self.paths: list[Path] = []
        self.memory: Path | None = None
        try:
            for controller, root in _cgroup_roots().items():
                path = root / f"drvqwen-eval-{os.getpid()}-{n}"
                if path not in self.paths:
                    path.mkdir()
                    self.paths.append(path)
                _write_limits(path, _limit_files(controller, root, max_procs, memory_bytes))
                if controller == "memory":
                    self.memory = path
        except OSError:
            self.close()
            raise

    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the program for the memory limit."""
        if self.memory is None:
            return False
        for name in ("memory.events", "memory.oom_control"):       # v2, v1
            try:
                for line in (self.memory / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
            except (OSError, ValueError):
                continue
        return False

    def kill(self) -> None:
        """SIGKILL every process still in the program's cgroups (one that left its process
        group)."""
        for path in self.paths:
            _kill_cgroup(path)

    def close(self) -> None:
        self.kill()
        for path in self.paths:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:           # processes still being reaped
                    time.sleep(0.02)


def _command(prog: Path, cpu_s: int, memory_bytes: int, procs_files: list[str]) -> tuple[list[str], object]:
    """(argv, preexec_fn or None) that runs `prog` inside the cgroups, namespaces and rlimits."""
    cmd = [*_unshare_prefix(), sys.executable, "-I", str(prog)]
    preexec = None
    prlimit = shutil.which("prlimit")
    if prlimit:
        cmd = [prlimit, f"--as={memory_bytes}", f"--cpu={cpu_s}", f"--fsize={16 * MiB}", "--core=0", "--", *cmd]
    else:
        preexec = _limits(cpu_s, memory_bytes)
    if procs_files:
        # sh writes its own pid into each cgroup.procs, then becomes the program: every process
        # of the program starts inside the cgroups.
        join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 126; shift; n=$((n-1)); done; exec "$@"'
        cmd = ["/bin/sh", "-c", join, "sh", str(len(procs_files)), *procs_files, *cmd]
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

    Args:
        memory_bytes: each process's address space, and where a memory cgroup is available,
            the memory of the program and its children together.
        max_procs: processes at once, where a pids cgroup is available.
    Returns:
        ProgramResult: passed when it exits 0 within timeout_s.
    Never raises for anything the program does; OSError only if no process can be started.
    """
    cgroups = _Cgroups(max_procs, memory_bytes) if _cgroup_roots() else None
    try:
        with tempfile.TemporaryDirectory(prefix="drvqwen-eval-") as d:
            prog = Path(d) / "program.py"
            prog.write_text(source, encoding="utf-8")
            cmd, preexec = _command(prog, int(timeout_s) + 1, memory_bytes,
                                    cgroups.procs_files() if cgroups else [])
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": d, "TMPDIR": d}
            p = subprocess.Popen(cmd, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)

            def leftovers() -> None:          # what it left running: its process group, its cgroups
                _kill(p)
                if cgroups is not None:
                    cgroups.kill()

            try:
                out, err, timed_out = _read_tails(p, timeout_s, leftovers)
            finally:
                leftovers()
                p.stdout.close()
                p.stderr.close()
                p.wait()
            tails = {"stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace")}
            if timed_out:
                return ProgramResult(False, None, f"timed out after {timeout_s:g} s", timed_out=True, **tails)
            if p.returncode == 0:
                return ProgramResult(True, 0, "", **tails)
            lines = tails["stderr"].strip().splitlines()
            if cgroups is not None and cgroups.out_of_memory():
                why = (f"out of memory: the program and its processes used more than "
                       f"{memory_bytes / MiB:g} MiB")
            elif p.returncode < 0:
                why = f"killed by signal {-p.returncode} ({signal.Signals(-p.returncode).name})"
            else:
                why = lines[-1] if lines else f"exit status {p.returncode}"
            return ProgramResult(False, p.returncode, why[:300], **tails)
    finally:
        if cgroups is not None:
            cgroups.close()


def _read_tails(p: subprocess.Popen, timeout_s: float, leftovers) -> tuple[bytes, bytes, bool]:
    """Read p's stdout and stderr to their end, keeping the last TAIL_BYTES of each.

    When p exits, `leftovers()` kills what it left running (which would hold the pipes open)
    and the pipes are drained for at most DRAIN_S. Returns (stdout tail, stderr tail, whether
    the time limit ran out first).
    """
    tails = {p.stdout: bytearray(), p.stderr: bytearray()}
    deadline = time.monotonic() + timeout_s
    drain_until = None
    with selectors.DefaultSelector() as sel:
        for f in tails:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if drain_until is None and p.poll() is not None:
                leftovers()
                drain_until = now + DRAIN_S
            end = deadline if drain_until is None else drain_until
            if now >= end:
                break
            for key, _ in sel.select(min(end - now, 0.05)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = tails[key.fileobj]
                buf += data
                if len(buf) > 2 * TAIL_BYTES:      # trimmed now and then, not on every read
                    del buf[:-TAIL_BYTES]
    if drain_until is None:                        # the pipes closed first: wait for the exit
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return bytes(tails[p.stdout][-TAIL_BYTES:]), bytes(tails[p.stderr][-TAIL_BYTES:]), True
    timed_out = drain_until is None and p.poll() is None
    return bytes(tails[p.stdout][-TAIL_BYTES:]), bytes(tails[p.stderr][-TAIL_BYTES:]), timed_out


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_cgroup(path: Path) -> None:
    """SIGKILL every process still in a cgroup of the program (one that left its process group)."""
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
        time.sleep(0.02)
