"""`drvqwen` as a process, the way people run it: Ctrl-C at any moment (exit 130, one line),
a reader that closes the pipe early (quiet exit 141, the backend closed), and output that is
not a terminal (never wrapped). TINY models, CPU backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

SRC = str(Path(__file__).resolve().parents[1] / "src")
pytestmark = pytest.mark.usefixtures("private_cache")


def _env() -> dict[str, str]:
    # Read at call time: private_cache has set DRVQWEN_CACHE for this test.
    return dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1")


@pytest.fixture
def tiny(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    return path


def _long_run(tiny, entry: str) -> list[str]:
    return [sys.executable, "-m", entry, "run", "--model", str(tiny), "--device", "cpu", "--raw",
            "--prompt", "hello", "--max-new-tokens", "1000", "--ignore-eos", "--temperature", "1"]


# ---- Ctrl-C ---------------------------------------------------------------------------------

@pytest.mark.parametrize("entry,delays", [
    ("drvqwen", (0.03, 0.08, 0.15, 0.3, 0.6, 1.2)),       # the installed command's entry point
    ("drvqwen.cli", (0.05, 0.15, 0.8)),
])
def test_ctrl_c_at_any_moment_is_one_line_and_130(tiny, entry, delays):
    for delay in delays:
        # drvqwen starts as a terminal's foreground command does, with SIGINT at its default. A
        # pytest started in the background of a non-interactive shell (`.ci/run &`) ignores
        # SIGINT, and an ignored signal stays ignored across exec: the child would drop a Ctrl-C
        # landing before __main__.py installs its handler and run to the end. A handled signal
        # is reset to the default by exec, so the child starts with the default action.
        prev = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            p = subprocess.Popen(_long_run(tiny, entry), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 env=_env())
        finally:
            signal.signal(signal.SIGINT, prev)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        err = err.decode("utf-8", "replace")
        if "KeyboardInterrupt" in err and SRC not in err.rsplit("Traceback", 1)[-1]:
            continue   # the interpreter's own start-up (site, runpy): before any drvqwen code ran
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        # Before the interpreter installs its own handler, SIGINT simply ends the process.
        if p.returncode == -signal.SIGINT and err.strip() == "":
            continue
        assert p.returncode == 130, (delay, p.returncode, err)
        assert err.count("interrupted") == 1 and err.strip().endswith("interrupted"), (delay, err)


def test_ctrl_c_while_a_class_sets_up_its_descriptors_is_one_line_and_130(monkeypatch, capsys):
    """A Ctrl-C that lands in a class's __set_name__ (importing a module whose class has a
    cached_property) comes as a RuntimeError caused by KeyboardInterrupt on Python < 3.12, as
    itself on later ones: either way one line and 130. Another RuntimeError is not swallowed."""
    import argparse

    from drvqwen import cli

    class Interrupted:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def define_a_class(args):
        type("Tokenizer", (), {"text_vocab_size": Interrupted()})
        return 0

    def fail(args):
        raise RuntimeError("a bug")

    def parser_running(fn):
        ap = argparse.ArgumentParser(prog="drvqwen")
        ap.set_defaults(cmd="run", fn=fn)
        return lambda argv=None: ap

    monkeypatch.setattr(cli, "build_parser", parser_running(define_a_class))
    assert cli.main([]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted" and "Traceback" not in err
    monkeypatch.setattr(cli, "build_parser", parser_running(fail))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main([])


# ---- a closed stdout --------------------------------------------------------------------------

def test_closed_stdout_ends_quietly(tiny):
    p = subprocess.Popen(_long_run(tiny, "drvqwen"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    first = p.stdout.read(5)             # `| head -c 5`
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    err = err.decode("utf-8", "replace")
    assert len(first) == 5
    assert p.returncode == 141, (p.returncode, err)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("command", [["info", "TINY"], ["info", "TINY", "--tensors"]])
def test_closed_stdout_of_a_table_ends_quietly(tiny, command):
    """rich prints tables (info, list, step): a reader that is gone before they are written gives
    141 and nothing on stderr, not rich's own exit status 1 (`drvqwen info M | true`)."""
    argv = [sys.executable, "-m", "drvqwen", *[str(tiny) if a == "TINY" else a for a in command]]
    r, w = os.pipe()
    os.close(r)                            # the reader left before the first byte
    p = subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, env=_env(), timeout=120)
    os.close(w)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 141, (p.returncode, err)
    assert err == "", err


def test_closed_stdout_closes_the_backend(tiny, monkeypatch):
    import drvqwen.generate as g
    from drvqwen.cli import main

    closed = []
    monkeypatch.setattr(g.CPUBackend, "close", lambda self: closed.append(True))

    class Head:
        """A stdout whose reader leaves after 5 characters."""

        n = 0

        def write(self, s):
            self.n += len(s)
            if self.n > 5:
                raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Head())
    rc = main(["run", "--model", str(tiny), "--device", "cpu", "--raw", "--prompt", "hello",
               "--max-new-tokens", "200", "--ignore-eos", "--temperature", "1"])
    assert rc == 141 and closed == [True]


# ---- output that is not a terminal ------------------------------------------------------------

def test_piped_output_is_never_wrapped(tiny, tmp_path):
    from drvqwen.format.nanoqwen import NanoqwenFile

    r = subprocess.run([sys.executable, "-m", "drvqwen", "info", str(tiny), "--tensors"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    with NanoqwenFile(tiny) as f:
        infos = list(f)
    assert max(len(l) for l in lines) > 80           # rows wider than rich's default 80 columns
    for info in infos:                                # `| grep NAME` finds the whole row
        assert any(info.name in l and str(info.offset) in l and f"{info.nbytes:,}" in l for l in lines), info.name
    # A long path in an error message stays one piece.
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "absent.nanoqwen"
    r = subprocess.run([sys.executable, "-m", "drvqwen", "info", str(deep)], capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert r.returncode == 2 and str(deep) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
