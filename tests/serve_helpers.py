"""Helpers for the server tests: a tiny model served on a free loopback port, `drvqwen run`'s
text for the same options, and a backend slowed down so a generation is still running when the
test acts on it."""

from __future__ import annotations

import time

import numpy as np

from helpers import TINY, byte_tokenizer_json, random_dense, write_model


def write_tiny(path, seed: int = 1):
    """A TINY model with the byte-level tokenizer (any text encodes) at `path`."""
    write_model(path, TINY, random_dense(TINY, np.random.default_rng(seed)), tokenizer_json=byte_tokenizer_json())
    return path


def run_text(capsys, model, *args: str) -> str:
    """stdout of `drvqwen run --device cpu --no-verify` with `args`, without run's final newline."""
    from drvqwen.cli import main

    capsys.readouterr()
    rc = main(["run", "--model", str(model), "--device", "cpu", "--no-verify", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.endswith("\n")
    return out.out[:-1]


def slow_down(worker, seconds: float):
    """Make every decode step of the worker's CPU backend take `seconds` longer; returns undo()."""
    backend = worker.model.backend
    decode = backend.decode

    def slow(token):
        time.sleep(seconds)
        return decode(token)

    backend.decode = slow
    return lambda: setattr(backend, "decode", decode)


def wait_idle(worker, timeout_s: float = 20.0) -> None:
    """Wait until the worker runs nothing and nothing waits."""
    end = time.monotonic() + timeout_s
    while worker.busy or worker.queue_length():
        assert time.monotonic() < end, "the worker did not become idle"
        time.sleep(0.01)
