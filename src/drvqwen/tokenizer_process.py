"""The prompt's ids from another process, while this one loads the model onto the GPU.

Why a process: `tokenizers` builds its tokenizer holding Python's GIL (a few hundred
milliseconds for Qwen's 151k tokens even from the cached form, tokenizer_cache.py), so on a
thread it slows down, and is
slowed down by, every line of Python the GPU load runs. `drvqwen run` on the GPU instead hands
the tokenizer's digest and the prompt (gen_options.prompt_spec) to
`python -m drvqwen.tokenizer_worker` (tokenizer_worker.py) as soon as it knows the model, and
collects the ids when the weights are on the GPU; it turns the generated ids back into text
with the cached token bytes (token_bytes_table.py) and never builds the tokenizer itself, nor
imports `tokenizers` before its first token (stream_decoder.py).

The worker is started at the entry point (`start_early`, from startup.py), before this process
imports anything heavy: its interpreter's start and its imports then overlap this process's
instead of following the model's opening. It waits on its stdin for the request; `start_for`
sends it there, or starts a worker then where none was started early (library use, tests,
DRVQWEN_STARTUP_TOKENIZER_WORKER=model). One that no request reaches (the command failed, went
to the CPU, was a first run) is killed and waited for by `close_early` when the command ends,
and ends by itself at EOF on its stdin when this process dies without that.

Only where both cached forms exist (the model ran before): a first run builds the tokenizer in
this process, as before, and writes them after its answer. Anything that goes wrong in the
worker (it cannot start, its answer is not one) gives None, and the caller builds the
tokenizer here after all: the process is a start-up shortcut, never a new way to fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

# Imported by the entry point before anything heavy: tokenizer_cache and token_bytes_table are
# imported where they are used.
if TYPE_CHECKING:
    from .token_bytes_table import TokenBytesTable


class TokenizerProcess:
    """A started tokenizer_worker with one request sent; `ids()` waits for its answer."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self.seconds: float | None = None   # the worker's own time from the request to its answer

    @classmethod
    def start(cls, digest: str, spec: dict) -> "TokenizerProcess | None":
        """Send the worker started early (`start_early`), or else a new one, the request for
        the cached tokenizer of the tokenizer.json of sha256 `digest` and prompt `spec`; None
        when no worker can be started."""
        proc = _take_early() or _spawn()
        if proc is None:
            return None
        # A request larger than the pipe's buffer (a long prompt) waits for the worker's
        # interpreter to start and read it: a thread writes it, so the GPU load goes on. Its
        # failures (the worker died) show as no answer in ids().
        request, proc.stdin = proc.stdin, None      # communicate() then only reads the answer
        data = (json.dumps({"tokenizer": digest, "prompt": spec}) + "\n").encode("utf-8")
        threading.Thread(target=_send, args=(request, data), name="tokenizer-request", daemon=True).start()
        return cls(proc)

    def ids(self, timeout: float = 60.0) -> list[int] | None:
        """The prompt's ids, or None when the worker failed (the caller encodes here instead)."""
        try:
            out, _ = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return None
        try:
            reply = json.loads(out.decode("utf-8").splitlines()[0])
        except (ValueError, IndexError):
            return None
        ids = reply.get("ids") if isinstance(reply, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return None
        seconds = reply.get("seconds")
        self.seconds = float(seconds) if isinstance(seconds, (int, float)) else None
        return ids

    def close(self) -> None:
        """Stop the worker if it still runs (a run that ends before asking for the ids), wait
        for it, and close this end of its pipes."""
        _stop(self._proc)


def _spawn() -> subprocess.Popen | None:
    """A new worker, its stdin and stdout pipes open; None when it cannot be started."""
    # -P: `-m` would put the working directory first on the worker's sys.path, where any
    # json.py or tokenizers/ of the user's project would be imported (and run) instead.
    try:
        return subprocess.Popen([sys.executable, "-P", "-m", "drvqwen.tokenizer_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_worker_env())
    except OSError:
        return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


# The worker start_early started, until a request takes it (_take_early) or close_early ends it.
_early: subprocess.Popen | None = None
_early_lock = threading.Lock()


def start_early() -> bool:
    """Start a worker now, before this process knows its model (the entry point, startup.py);
    the next `TokenizerProcess.start` sends it the request. A call while one waits does
    nothing. Returns whether a worker waits."""
    global _early
    with _early_lock:
        if _early is None:
            _early = _spawn()
        return _early is not None


def _take_early() -> subprocess.Popen | None:
    """The early worker, handed over once, if it still waits (one that ended — its imports
    failed — is waited for, and a new worker takes its place)."""
    global _early
    with _early_lock:
        proc, _early = _early, None
    if proc is not None and proc.poll() is not None:
        _stop(proc)
        return None
    return proc


def close_early() -> None:
    """Kill and wait for the early worker if no request took it (the entry point calls it as
    the command ends, whichever way); a no-op otherwise."""
    proc = _take_early()
    if proc is not None:
        _stop(proc)


def _send(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except OSError:            # the worker is gone (or was killed by close()): ids() gives None
        pass


def _worker_env() -> dict[str, str]:
    """This environment, with the folder this drvqwen was imported from first on PYTHONPATH
    when the worker's interpreter would not look there by itself (a checkout, a test's
    sys.path) — an installed drvqwen's site-packages is on its path already, and placed on
    PYTHONPATH it would come before the standard library."""
    import site

    package_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    found = {str(Path(d).resolve()) for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if package_root not in found:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def start_for(tokenizer_json: str, spec: dict) -> tuple[TokenizerProcess, TokenBytesTable] | None:
    """The worker (the early one, else a new one) sent the digest of tokenizer.json
    `tokenizer_json` and `spec`, and the cached token bytes to decode with; None unless the
    cached forms exist (a first run) and a worker runs.

    Only the table is looked for here: it is written after the tokenizer's own cached form
    (run_cli), and that form's file is named by the `tokenizers` version, which the worker
    knows and this process would have to import the library to learn. A form missing after
    all (a new `tokenizers`) is the worker's error answer, and the caller builds the tokenizer
    here as after any failure of the worker."""
    from . import token_bytes_table, tokenizer_cache

    digest = tokenizer_cache.text_digest(tokenizer_json)
    table = token_bytes_table.load(digest)      # None too where no cache root can be made
    if table is None:
        return None
    proc = TokenizerProcess.start(digest, spec)
    if proc is None:
        return None
    tokenizer_cache.remember_last_used(digest)     # the next run's worker loads it at once
    return proc, table
