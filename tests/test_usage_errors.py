"""The command line's own mistakes — a value of the wrong type, a choice that is not one, an
option that does not exist, one that is missing — are one line on stderr and status 2, as
every other mistake (README): what is wrong, and where the help is. No usage block."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "src")

CASES = [
    (["run", "-t", "abc"], "drvqwen run", "argument -t/--temperature/--temp: invalid float value: 'abc'"),
    (["run", "--device", "gpu"], "drvqwen run", "argument --device: invalid choice: 'gpu'"),
    (["chat", "--top-k", "x"], "drvqwen chat", "argument --top-k: invalid int value: 'x'"),
    (["run", "--no-such-option"], "drvqwen run", "unrecognized arguments: --no-such-option"),
    (["eval", "agree", "--reference", "r.gguf", "x"], "drvqwen eval agree", "unrecognized arguments: x"),
    (["--no-such-option"], "drvqwen", "unrecognized arguments: --no-such-option"),
    (["--no-such-option", "run"], "drvqwen", "unrecognized arguments: --no-such-option"),
    (["run", "-n"], "drvqwen run", "argument -n/--max-new-tokens: expected one argument"),
    (["convert", "x.gguf"], "drvqwen convert", "the following arguments are required: -o/--output"),
    (["serve", "--port", "http"], "drvqwen serve", "argument --port: 'http' is not a port number"),
    (["eval"], "drvqwen eval", "the following arguments are required: {humaneval,agree}"),
    (["eval", "humaneval", "--timeout", "soon"], "drvqwen eval humaneval",
     "argument --timeout: invalid float value: 'soon'"),
    (["frobnicate"], "drvqwen", "argument COMMAND: invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv,prog,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_usage_error_is_one_line_with_a_hint(capsys, argv, prog, message):
    from drvqwen.cli import main

    assert main(argv) == 2
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert out.out == "" and len(lines) == 1, out.err
    assert lines[0].startswith(f"error: {message}") and lines[0].endswith(f"({prog} --help shows the options)")


@pytest.mark.parametrize("module", ["drvqwen", "drvqwen.cli", "drvqwen.bench"])
def test_usage_error_in_a_real_process(module):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    argv = ["--preset", "1b"] if module == "drvqwen.bench" else ["run", "--temperature", "hot"]
    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: argument ") and "--help" in lines[0], r.stderr


@pytest.mark.parametrize("argv,message", [
    (["run", "--model", "", "-p", "hi"], "--model is empty: give a file, a repo id or a name drvqwen list shows"),
    (["info", " "], "info: FILE is empty: give a .nanoqwen file or a name drvqwen list shows"),
    (["rm", ""], "rm: NAME is empty (drvqwen list shows the names; --all removes every entry)"),
    (["eval", "humaneval", "--timeout", "-5"], "--timeout=-5: must be a finite number of seconds > 0"),
    (["eval", "humaneval", "--timeout", "0"], "--timeout=0: must be a finite number of seconds > 0"),
    (["eval", "humaneval", "--timeout", "nan"], "--timeout=nan: must be a finite number of seconds > 0"),
    (["step", "--model", "absent.nanoqwen", "--max-context", "-1"], "--max-context=-1: must be >= 0 (0: the default)"),
    (["run", "--model", "absent.nanoqwen", "--draft", "", "-p", "hi"],
     "--draft is empty: give a file, a repo id or a name drvqwen list shows"),
    (["convert", "", "-o", "out.nanoqwen"], "convert: SOURCE is empty: give a GGUF file or an HF checkpoint folder"),
    (["eval", "agree", "--reference", " "], "--reference is empty: give a GGUF, an HF checkpoint folder or a .nanoqwen"),
    (["run", "--seed", str(2**64), "-p", "hi"],
     f"--seed={2**64}: must be in [-2^63, 2^64 - 1] (taken modulo 2^64; omit it for a fresh random seed)"),
    (["eval", "agree", "--reference", "r.gguf", "--problems", "absent.jsonl"],
     "--problems is for --prompts humaneval (the builtin prompts read no file)"),
], ids=["empty model", "blank info", "empty rm", "negative timeout", "zero timeout", "nan timeout", "step context",
        "empty draft", "empty convert source", "blank reference", "seed out of range", "problems without humaneval"])
def test_empty_names_and_bad_timeouts_are_refused_before_any_work(capsys, private_cache, argv, message):
    """An empty --model, info FILE or rm NAME (an unset shell variable) is refused: Path("") is the
    current folder and "" a prefix of every cache name, so rm "" removed the only model. A
    timeout ≤ 0 would score every HumanEval problem as failed."""
    from drvqwen.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {message}"


@pytest.mark.parametrize("argv, message", [
    (["run", "-f", "./absent-prompt.txt"], "./absent-prompt.txt: cannot read prompt (No such file or directory)"),
    (["run", "-m", "./absent.nanoqwen", "-p", "hi"], "./absent.nanoqwen: file not found"),
], ids=["prompt file", "model"])
def test_missing_files_are_named_as_typed(capsys, private_cache, tmp_path, monkeypatch, argv, message):
    """`-f ./x` was shown as `x` (pathlib drops the ./): the name the user typed is the one to find."""
    from drvqwen.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
