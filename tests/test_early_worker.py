"""The tokenizer worker started at the entry point (startup.py, tokenizer_process.start_early):
it answers the ids the tokenizer of this process gives, it is the worker the run's request goes
to, it ends by itself at EOF, and no `drvqwen run` leaves it (or any other child) behind —
checked on real processes, from a parent that adopts whatever its child leaves orphaned.
The start-up's measurement switches (DRVQWEN_STARTUP_*) are read in one place and refuse bad
values in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from drvqwen import startup, token_bytes_table, tokenizer_cache, tokenizer_process
from drvqwen.errors import DrvqwenError
from drvqwen.tokenizer import Tokenizer, prompt_ids_of

from helpers import TINY, bpe_with_merges_json, random_dense, write_model

pytestmark = pytest.mark.usefixtures("private_cache")

SPEC = {"kind": "chat", "text": "def the fib(n): return n <|im_end|>", "system": None}
TEXT = bpe_with_merges_json()
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def early():
    """Whatever the test leaves of an early worker is closed after it."""
    yield
    tokenizer_process.close_early()


def _both_cached() -> Tokenizer:
    tok = Tokenizer.from_json(TEXT, cache=True)
    assert tok.store_in_cache() and token_bytes_table.store(tokenizer_cache.text_digest(TEXT), tok)
    return tok


def test_the_early_worker_answers_the_ids_of_this_process(early):
    tok = _both_cached()
    assert tokenizer_process.start_early()
    waiting = tokenizer_process._early
    assert waiting is not None and waiting.poll() is None        # imported, and waiting for a request
    proc, _ = tokenizer_process.start_for(TEXT, SPEC)
    assert proc._proc is waiting and tokenizer_process._early is None   # the request went to it
    assert proc.ids() == prompt_ids_of(SPEC, tok)
    assert proc._proc.returncode == 0
    # the next request (none in a run: one per process) starts a worker of its own
    again, _ = tokenizer_process.start_for(TEXT, SPEC)
    assert again._proc is not waiting and again.ids() == prompt_ids_of(SPEC, tok)


def test_an_early_worker_that_ended_is_replaced(early, monkeypatch):
    """A worker that ended before the request (its imports failed) is waited for, and the
    request goes to a new one."""
    tok = _both_cached()
    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda args, **k: real([sys.executable, "-c", "pass"], **k))
    assert tokenizer_process.start_early()
    dead = tokenizer_process._early
    dead.wait(30)
    monkeypatch.setattr(subprocess, "Popen", real)
    proc, _ = tokenizer_process.start_for(TEXT, SPEC)
    assert proc._proc is not dead and proc.ids() == prompt_ids_of(SPEC, tok)


def test_the_early_worker_ends_by_itself_at_eof():
    """This process gone without a word (os._exit on Ctrl-C, a kill): its end of the pipe closes,
    and the worker ends, status 0, writing nothing."""
    proc = tokenizer_process._spawn()
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert proc.stdout.read() == b""
    proc.stdout.close()


def test_close_early_kills_and_waits_for_a_worker_no_request_took(early):
    assert tokenizer_process.start_early()
    proc = tokenizer_process._early
    tokenizer_process.close_early()
    assert proc.returncode is not None and tokenizer_process._early is None
    tokenizer_process.close_early()                    # a second call, or none started: nothing


# A parent that adopts orphans (PR_SET_CHILD_SUBREAPER): it runs `drvqwen`, optionally sends its
# main thread a signal — once drvqwen has a child (the worker, started first thing), or once drvqwen has
# opened FIFO for reading (its prompt file: the command line has taken over) — and prints the
# pids of the processes left as its own children when drvqwen has exited (a worker drvqwen
# waited for is gone; one left running, or ended unwaited, shows here), then which of those
# still run after up to a minute.
PARENT = r"""
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)       # PR_SET_CHILD_SUBREAPER

def children(pid):
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return kids

def until(ready):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(0.01)
    raise SystemExit("timed out")

def writer(fifo):
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)     # ENXIO until a reader has it open
    except OSError:
        return None

argv, sig, fifo = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
p = subprocess.Popen([sys.executable, "-m", "drvqwen", *argv], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
if sig != "none":
    until((lambda: writer(fifo)) if fifo else (lambda: children(p.pid)))
    # To drvqwen's main thread: a signal sent to the process lands on any thread that does not
    # block it, and one landing on another (numpy's BLAS workers) leaves the main thread's read
    # of the prompt uninterrupted until it returns.
    if ctypes.CDLL(None, use_errno=True).tgkill(p.pid, p.pid, getattr(signal, sig)):
        raise SystemExit("tgkill failed")
rc, err = p.wait(120), p.stderr.read().decode()
left = children(os.getpid())
running = list(left)
deadline = time.monotonic() + 60
while running and time.monotonic() < deadline:
    running = [k for k in running if not os.waitpid(k, os.WNOHANG)[0]]
    time.sleep(0.01)
print(json.dumps({"rc": rc, "err": err, "left": left, "still_running": running}))
"""


def _drvqwen(argv: list[str], sig: str = "none", fifo: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PARENT, json.dumps(argv), sig, fifo], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = dataclasses.replace(TINY, max_position=256)
    path = tmp_path_factory.mktemp("early") / "tiny.nanoqwen"
    write_model(path, cfg, random_dense(cfg, np.random.default_rng(3)), tokenizer_json=TEXT)
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc are Linux's")
@pytest.mark.parametrize("case", ["bad model", "cpu path", "bad option"])
def test_no_child_outlives_drvqwen_run(tiny, tmp_path, case):
    """`drvqwen run` starts the worker first thing (--device auto); whichever way it ends — a
    model path that is not one, the run gone to the CPU (no GPU, or a model it cannot run: no
    request ever reaches the worker), an option argparse refuses — the worker is gone with it."""
    argv = {"bad model": ["run", "--model", str(tmp_path / "none.nanoqwen"), "hi"],
            "cpu path": ["run", "--model", str(tiny), "-n", "2", "hi"],
            "bad option": ["run", "--no-such-option"]}[case]
    r = _drvqwen(argv)
    assert r["still_running"] == []
    assert r["rc"] == (0 if case == "cpu path" else 2), r["err"]
    assert r["left"] == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc are Linux's")
@pytest.mark.parametrize("when", ["reading the prompt", "importing", "killed"])
def test_a_worker_whose_run_is_interrupted_or_killed_ends(tiny, tmp_path, when):
    """Ctrl-C sent to drvqwen alone (not to its process group): once the command line has taken
    over (here: reading the prompt from a FIFO), drvqwen closes the worker and exits 130, leaving
    nothing; during the imports it leaves at once (os._exit), and so does a drvqwen killed
    outright — the orphaned worker then reads EOF and ends by itself."""
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    sig, wait_for = {"reading the prompt": ("SIGINT", str(fifo)), "importing": ("SIGINT", ""),
                     "killed": ("SIGKILL", "")}[when]
    r = _drvqwen(["run", "--model", str(tiny), "--prompt-file", str(fifo)], sig, wait_for)
    assert r["still_running"] == []
    if when == "killed":
        assert r["rc"] == -9 and r["left"]              # the worker was there, orphaned, and ended
    else:
        assert r["rc"] == 130 and r["err"].strip() == "interrupted"
    if when == "reading the prompt":
        assert r["left"] == []


def test_a_ctrl_c_pending_before_a_blocking_read_still_ends_it():
    """A SIGINT that lands just before the prompt's blocking read begins is only pending when
    the read starts (nothing interrupts the system call): `_thread.interrupt_main` makes exactly
    that state while the read blocks on a pipe no one writes to. read_interruptibly raises the
    KeyboardInterrupt within its poll interval; a read on this thread would wait for good."""
    import _thread
    import signal
    import threading
    import time

    from drvqwen.text_input import read_interruptibly

    r, w = os.pipe()
    backstop = threading.Timer(15, os.write, (w, b"y"))   # a read that waits for good ends, late
    backstop.start()
    # As cli.main has it while a command runs (an earlier test may have left SIG_IGN, under
    # which interrupt_main does nothing).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.2, _thread.interrupt_main)
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            read_interruptibly(lambda: os.read(r, 1))
        assert time.monotonic() - start < 10
        timer.join()
        assert read_interruptibly(lambda: b"x" + os.read(r, 0)) == b"x"   # an answer comes back
        with pytest.raises(FileNotFoundError):                                # and so does an error
            read_interruptibly(lambda: Path("/nonexistent/prompt").read_bytes())
    finally:
        signal.signal(signal.SIGINT, before)
        backstop.cancel()
        os.close(w)       # the abandoned reader thread reads EOF and ends
        os.close(r)


def test_the_switches_take_their_values_and_name_a_bad_one(monkeypatch):
    for name, values in startup.SWITCHES.items():
        monkeypatch.delenv(name, raising=False)
        assert startup.switch(name) == values[0]
        for v in values:
            monkeypatch.setenv(name, v)
            assert startup.switch(name) == v
        monkeypatch.setenv(name, "sometimes")
        with pytest.raises(DrvqwenError, match=f"^{name}='sometimes': .* takes {values[0]} or {values[1]}"):
            startup.check_switches()
        monkeypatch.delenv(name)
    startup.check_switches()


@pytest.mark.parametrize("env,started", [({}, (True, True)),
                                         ({startup.DRIVER_WARMUP: "device"}, (False, True)),
                                         ({startup.TOKENIZER_WORKER: "model"}, (True, False)),
                                         ({startup.TOKENIZER_WORKER: "later"}, (False, False))])
def test_the_switches_move_what_the_entry_point_starts(monkeypatch, env, started):
    from drvqwen.cuda import warmup

    for name in startup.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(warmup, "start_driver", lambda ordinal=0: calls.append("driver"))
    monkeypatch.setattr(tokenizer_process, "start_early", lambda: calls.append("worker") or True)
    assert startup.start_for_command(["run", "hi"]) == started
    assert sorted(calls) == sorted(w for w, s in zip(("driver", "worker"), started) if s)


@pytest.mark.parametrize("name", sorted(startup.SWITCHES))
def test_a_bad_switch_stops_run_in_one_line(tiny, capsys, monkeypatch, name):
    from drvqwen.cli import main

    monkeypatch.setenv(name, "1")
    assert main(["run", "--model", str(tiny), "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{name}='1'" in err and " or ".join(startup.SWITCHES[name]) in err
