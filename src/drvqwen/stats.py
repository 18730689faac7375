"""The statistics of one `drvqwen run`: the stats line, the `--verbose` phases, `--json-stats`.

Every figure is a wall-clock interval on the host's monotonic clock (time.perf_counter). The
phases are measured where the work happens (`phase(name)`, a no-op outside a recorded run) and
are exclusive: a phase timed inside another is taken out of the outer one, so the phases never
overlap and their sum is at most the total; what no phase covers is shown as the rest. Work on
another thread (the tokenizer, the kernel compiles) is counted as the main thread's wait for it,
its own duration said beside. In the order a GPU run meets them:

    start         exec → drvqwen's first line (the interpreter's own start-up; from /proc, ±10 ms)
    import        importing drvqwen and what it uses
    read          resolve the model: find or convert it, open and validate the .nanoqwen header,
                  table and config
    verify        the one-time CRC check of the tensors
    context       the CUDA driver and the device's primary context (cuInit, the probe, retain)
    compile       NVRTC: the kernels the engine launches, through the cubin cache, in parallel
    modules       cuModuleLoadData of those cubins
    upload        the weights to the GPU
    load          the rest of the backend: KV cache and buffers, launch lists and tensor maps
                  (on the CPU: the weights dequantized to float32)
    tokenizer     the tokenizer: from the cache's fast-loading form (tokenizer_cache.py), or built
                  from the file's tokenizer.json and then cached (on the GPU: on its own thread)
    tokenize      the prompt's token ids
    prefill       the prompt through the model (GPU: the launches queued)
    first token   the first token chosen (GPU: the wait for the prefill and the sampler)
    graph capture the decode graphs, captured after the first token is out
    decode        the tokens after the first (speculative decoding: the verify passes)
    propose       speculative decoding's proposals (the draft model's own steps)
    generate      the rest of generation: detokenizing and printing the text
    tokenizer cache  after the answer, the first run with a tokenizer: its fast-loading form
                  written to the cache (tokenizer_cache.py)

and the summary figures:

    load       read + verify + context + compile + modules + upload + load
    prompt     prompt tokens, of which `reused` came from the KV cache and were not prefilled
    TTFT       the prompt submitted to the backend → the first token chosen (prefill included)
    prompt-eval  prefilled tokens / TTFT, in tok/s
    decode     tokens after the first / (last token − first token), in tok/s
    total      exec of the process (the command's start when run in-process) → the last token
               printed

The definitions of TTFT and decode tok/s are generate.GenerationResult's, the ones every figure
in drvqwen quotes; `drvqwen bench` measures the same on the GPU with events.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import DrvqwenError

# What `-v` calls each phase; phases are listed in the order they first started.
PHASE_NAMES = {
    "start": "Python start-up (exec → drvqwen)", "import": "imports",
    "read": "read + validate the model", "verify": "check tensor CRC32s (once per file)",
    "context": "CUDA driver + context", "compile": "kernel compile", "modules": "module loads",
    "upload": "weight upload", "load": "build the backend (CPU: dequantize)",
    "tokenizer": "load the tokenizer", "tokenizer cache": "write the tokenizer's cached form (once)",
    "tokenize": "tokenize the prompt",
    "prefill": "prefill", "first token": "first token", "graph capture": "graph capture",
    "decode": "decode", "propose": "speculative proposals (prompt lookup, draft model)", "generate": "detokenize + print",
}
# The longest interpreter start-up taken for true (RunStats.__post_init__).
START_UP_MAX_S = 30.0
# The phases the stats line's `load` adds up.
LOAD_PHASES = ("read", "verify", "context", "compile", "modules", "upload", "load")

# perf_counter() when the process's entry point started (`process_started`); None when drvqwen
# runs inside another program (the tests call cli.main), whose start-up is not the command's.
_process_started: float | None = None
_recording: ContextVar["RunStats | None"] = ContextVar("drvqwen_run_stats", default=None)


def process_started(first_line: float) -> None:
    """Called by the entry points (`drvqwen`, `python -m drvqwen`, `python -m drvqwen.cli`) with
    perf_counter() of drvqwen's first line (drvqwen.STARTED): a RunStats made afterwards counts
    the start-up and import phases and its total from the process's exec."""
    global _process_started
    _process_started = first_line


def _exec_time(now: float) -> float | None:
    """perf_counter() of this process's start (Linux: /proc/self/stat's start time, in clock
    ticks since boot, against CLOCK_BOOTTIME), or None where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()   # after "(comm)", which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return now - age if age >= 0 else None


def phase(name: str):
    """A context manager timing its block as phase `name` of the run being recorded on this
    thread (`RunStats.recording`); a no-op when none is (a library caller, the server, another
    thread)."""
    stats = _recording.get()
    return nullcontext() if stats is None else stats.timed(name)


def count(name: str, n: int = 1) -> None:
    """Add `n` to the counter `name` of the run being recorded on this thread (kernels compiled,
    taken from the cache, modules loaded); a no-op when none is."""
    stats = _recording.get()
    if stats is not None:
        stats.counts[name] = stats.counts.get(name, 0) + n


class Background:
    """`fn()` on a thread of its own, started now; `result()` waits for it (the wait timed as
    phase `name` of the recorded run, the thread's own time kept beside it) and returns its value
    or raises its exception, as if it had run on the calling thread. With thread=False, fn()
    runs inside result() instead, timed as the phase.

    The thread is a daemon: a run that fails before it asks for the result does not wait for it.
    It shares the GIL with the calling thread: it overlaps the calling thread's waits, copies and
    driver calls, not its Python.
    """

    def __init__(self, name: str, fn: Callable[[], object], *, thread: bool = True):
        self.name = name
        self._fn = fn
        self._value = self._error = None
        self._seconds = None
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._work, name=f"drvqwen-{name}", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        t0 = time.perf_counter()
        try:
            self._value = self._fn()
        except BaseException as e:   # re-raised by result(), on the caller's thread
            self._error = e
        self._seconds = time.perf_counter() - t0

    def result(self):
        """The value of fn(), after waiting for it; raises what fn raised."""
        with phase(self.name):
            if self._thread is None:
                if self._seconds is None:
                    self._work()
            else:
                self._thread.join()
                stats = _recording.get()
                if stats is not None:
                    stats.background[self.name] = self._seconds
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class RunStats:
    """Phase timings of one run, in seconds (`phases`, in the order they started), plus what the
    run did.

    Attributes:
        t_start: perf_counter() when the command started.
        t_origin: where the total starts: the process's exec when this is the process's own
            command (`process_started`) and /proc tells it, else t_start.
        phases: phase name → seconds, exclusive of the phases timed inside it (module doc).
        background: phase name → seconds its work took on its own thread (`Background`), and
            "tokenizer process": the tokenizer worker's own time (tokenizer_process.py).
        counts: kernels_compiled, kernels_cached, modules_loaded, tokenizer_cached (1: the
            tokenizer came from the cache, 0: it was built from tokenizer.json),
            tokenizer_process (1: the prompt was encoded in another process).
        backend: the backend's name ("cpu (numpy reference)", "cuda (NVIDIA H200), graph decode").
        seed: the sampler's seed when sampling, else None.
        first_output_s: t_origin → the first text written to stdout (`first_output`), or None.
    """

    t_start: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    background: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    backend: str = ""
    seed: int | None = None
    total_s: float = 0.0
    first_output_s: float | None = None
    t_origin: float = field(init=False)
    from_exec: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._open: list[list[float]] = []      # [start, time of the phases inside] per open phase
        self.t_origin = self.t_start
        first_line = _process_started
        if first_line is None or first_line > self.t_start:
            return
        t_exec = _exec_time(time.perf_counter())
        # An interpreter starts in tens of milliseconds: a start-up of more than START_UP_MAX_S
        # means the two clocks disagree (a time namespace), and the exec is not known.
        if t_exec is not None and 0 <= first_line - t_exec < START_UP_MAX_S:
            self.t_origin, self.from_exec = t_exec, True
            self.phases["start"] = first_line - t_exec
        else:
            self.t_origin = first_line
        self.phases["import"] = self.t_start - first_line

    def timed(self, phase: str):
        """A context manager adding the time spent inside it to `phases[phase]`, less the time
        of the phases timed inside it (which count as their own). Main thread only."""
        stats = self

        class _Timer:
            def __enter__(self):
                stats.phases.setdefault(phase, 0.0)
                stats._open.append([time.perf_counter(), 0.0])

            def __exit__(self, *exc):
                t0, inner = stats._open.pop()
                dt = time.perf_counter() - t0
                stats.phases[phase] += dt - inner
                if stats._open:
                    stats._open[-1][1] += dt

        return _Timer()

    def recording(self):
        """A context manager under which `phase()` and `count()` on this thread record into
        these stats."""
        stats = self

        class _Recording:
            def __enter__(self):
                self.token = _recording.set(stats)
                return stats

            def __exit__(self, *exc):
                _recording.reset(self.token)

        return _Recording()

    def first_output(self) -> None:
        """Note that the answer's first text has just been written to stdout (once)."""
        if self.first_output_s is None:
            self.first_output_s = time.perf_counter() - self.t_origin

    @property
    def load_s(self) -> float:
        """The phases of loading the model (LOAD_PHASES)."""
        return sum(self.phases.get(p, 0.0) for p in LOAD_PHASES)

    def finish(self) -> None:
        self.total_s = time.perf_counter() - self.t_origin

    def line(self, res) -> str:
        """The stats line: backend, load, the generation's summary, total wall time."""
        return f"{self.backend}: load {self.load_s:.2f} s, {res.summary()}, total {self.total_s:.2f} s"

    def _label(self, k: str) -> str:
        c = self.counts
        label = PHASE_NAMES.get(k, k)
        if k == "compile" and ("kernels_compiled" in c or "kernels_cached" in c):
            label += f" ({c.get('kernels_compiled', 0)} compiled, {c.get('kernels_cached', 0)} cached)"
        elif k == "modules" and "modules_loaded" in c:
            label += f" ({c['modules_loaded']})"
        elif k == "tokenizer" and "tokenizer_cached" in c:
            label += " (from the cache" if c["tokenizer_cached"] else " (built from tokenizer.json"
            label += f"; wait, {self.background[k] * 1e3:.0f} ms on its thread)" if k in self.background else ")"
        elif k == "tokenize" and c.get("tokenizer_process"):
            seconds = self.background.get("tokenizer process")
            label += " (in another process: wait" + (f"; {seconds * 1e3:.0f} ms there)" if seconds else ")")
        elif k in self.background:
            label += f" (wait; {self.background[k] * 1e3:.0f} ms on its thread)"
        return label

    def verbose_lines(self, res) -> list[str]:
        """One line per phase in the order they started, the rest of the total and the total,
        then when the first text reached stdout, the TTFT and the decode time (`--verbose`)."""
        rows = [(self._label(k), v) for k, v in self.phases.items()]
        rows.append(("(between the phases)", max(0.0, self.total_s - sum(self.phases.values()))))
        rows.append(("total, from " + ("exec" if self.from_exec else "the command's start"), self.total_s))
        if self.first_output_s is not None:
            rows.append(("first text on stdout, from the same start", self.first_output_s))
        if res is not None and (res.tokens or res.stopped_by == "stop token"):
            rows.append((f"prefill {res.prefill_tokens} tokens + first token (TTFT)", res.ttft_s))
            if len(res.tokens) >= 2:
                rows.append((f"decode {len(res.tokens) - 1} tokens", res.decode_s))
        width = max(38, *(len(name) for name, _ in rows))
        return [f"{name:<{width}} {v * 1e3:10.1f} ms" for name, v in rows]

    def to_dict(self, res) -> dict:
        """The JSON of `--json-stats` (times in seconds; rates in tok/s, null when unmeasured)."""
        def num(x):
            return None if x is None or x != x else round(float(x), 6)       # NaN → null

        timed = res is not None and (bool(res.tokens) or res.stopped_by == "stop token")
        return {
            "backend": self.backend, "seed": self.seed,
            "load_s": num(self.load_s), "phases_s": {k: num(v) for k, v in self.phases.items()},
            "background_s": {k: num(v) for k, v in self.background.items()},
            "counts": dict(self.counts),
            "prompt_tokens": res.prompt_tokens if res else 0,
            "reused_tokens": res.reused_tokens if res else 0,
            "generated_tokens": len(res.tokens) if res else 0,
            "stopped_by": res.stopped_by if res else None,
            "ttft_s": num(res.ttft_s) if timed else None,
            "prompt_tok_s": num(res.prompt_tok_s) if timed else None,
            "decode_tok_s": num(res.decode_tok_s) if res else None,
            "first_output_s": num(self.first_output_s),
            "total_s": num(self.total_s),
            "total_from": "exec" if self.from_exec else "command",
            # proposals, acceptance rate and tokens per verify pass (speculative_loop.py)
            "speculation": res.speculation.to_dict() if res is not None and res.speculation else None,
        }


def write_json_atomic(path: str | os.PathLike, data: dict, what: str = "the stats") -> None:
    """Write `data` as JSON to `path` through a temporary file in the same folder and a rename,
    so a reader sees the old file or the whole new one, never half of it. The file gets the
    permissions of any file the user creates (0666 less the umask); the temporary name is
    created afresh, never through a link planted there (paths.open_fresh_temp).

    Raises:
        DrvqwenError: `path` is a folder, or its folder does not exist or cannot be written
            (names the path and `what`).
    """
    from .paths import check_output, open_fresh_temp

    p = check_output(path, what)
    try:
        tmp, fd = open_fresh_temp(p)
    except OSError as e:
        raise DrvqwenError(f"{p}: cannot write {what} ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DrvqwenError(f"{p}: cannot write {what} ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
