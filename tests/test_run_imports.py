"""What `drvqwen run` on the GPU has imported when its first token is out, caches warm.

Every import before the first token is start-up a person waits for. NVRTC is one they need not
wait for when every cubin is in the cache: `cuda.bindings.nvrtc` pulls in cuda.pathfinder, and
naming the toolchain importlib.metadata — tens of milliseconds that a run with a warm cache
never uses (cuda/toolchain.py). The `tokenizers` library is another, once an earlier run left
the tokenizer's cached forms: the prompt is encoded in the worker process and the answer
decoded from the token bytes table (stream_decoder.py). Nor does `drvqwen run` import the
other commands' code to parse its command line (cli.COMMANDS). The run here is the real one — the entry point, the command
line, the model opened, the device probed, the engine imported, the weight bar drawn, the
prompt encoded and the text streamed — with two stand-ins where this machine has no GPU: the
driver's answers to the device probe (its NVRTC question is asked for real) and GPUBackend
(which compiles its kernel through the cache and yields tokens).

rich is not on the list: the weights' upload bar is drawn before the first token (rich prints a
bar's last state even where stderr is no terminal), so the run needs it there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

SRC = str(Path(__file__).resolve().parents[1] / "src")
pytestmark = pytest.mark.usefixtures("private_cache")

# Modules a GPU run with warm caches must not have imported by its first token.
NOT_BEFORE_FIRST_TOKEN = ("cuda.bindings.nvrtc", "cuda.pathfinder", "importlib.metadata", "tokenizers",
                          "drvqwen.bench", "drvqwen.server.main")

_RUN = """
import json, sys, types
from cuda.bindings import driver
from drvqwen import engine
from drvqwen.cuda import device, nvrtc

WATCHED = {watched!r}
ok, attr = driver.CUresult.CUDA_SUCCESS, driver.CUdevice_attribute
cc = {{attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0}}
# The probe's driver calls, answered as a CUDA 13 driver with one H200 answers them.
device.driver = types.SimpleNamespace(
    CUresult=driver.CUresult, cuInit=lambda flags: (ok,), cuDeviceGetCount=lambda: (ok, 1),
    cuDeviceGet=lambda ordinal: (ok, 0), cuDeviceGetAttribute=lambda a, dev: (ok, cc[a]),
    cuDriverGetVersion=lambda: (ok, 13000))

class StandIn:
    name, decode_mode, last_reused = "cuda (stand-in)", "graph", 0

    def __init__(self, f, max_context, *, progress=None, **_):
        self.max_context = max_context
        assert all(c.cache_hit for c in nvrtc.compile_kernels([("smoke", {{}})]))
        progress(1, 1)

    def token_stream(self, prompt_ids, max_new_tokens, params, reuse=False):
        print("before the first token:", json.dumps([m for m in WATCHED if m in sys.modules]), file=sys.stderr)
        yield from (ord("o"), ord("k"))[:max_new_tokens]

    def close(self):
        pass

engine.GPUBackend = StandIn
sys.argv = ["drvqwen", "run", "--model", {model!r}, "--raw", "--prompt", "hi", "-n", "2", "--ignore-eos"]
from drvqwen._entry import main
sys.exit(main())
"""


def _python(code: str) -> subprocess.CompletedProcess:
    # DRVQWEN_CACHE: the private cache of the test, read at call time.
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _before_first_token(model: Path) -> list[str]:
    out = _python(_RUN.format(watched=NOT_BEFORE_FIRST_TOKEN, model=str(model)))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok\n"
    assert "uploading weights" in out.stderr and "cuda (stand-in)" not in out.stdout
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("before the first token:")]
    return json.loads(line.split(":", 1)[1])


def test_a_gpu_run_with_warm_caches_imports_neither_nvrtc_nor_tokenizers(tmp_path, rng):
    model = tmp_path / "tiny.nanoqwen"
    write_model(model, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    warm = _python("from drvqwen.cuda.nvrtc import compile_kernel; compile_kernel('smoke')")
    assert warm.returncode == 0, warm.stderr
    # The first run builds the tokenizer in this process and leaves its cached forms after the answer.
    assert _before_first_token(model) == ["tokenizers"]
    assert _before_first_token(model) == []


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(subparsers.choices)


def test_a_command_line_imports_the_module_of_its_command_alone():
    """cli.COMMANDS names the module to import for a command line's first word: each module
    registers exactly the commands it is listed with, the parser of such a line has those, and
    any other line gets every command, in the order --help lists them."""
    from drvqwen import cli

    for module, names in cli.COMMANDS:
        parser = argparse.ArgumentParser()
        importlib.import_module(f"drvqwen.{module}").register(parser.add_subparsers())
        assert _commands(parser) == list(names)
        assert _commands(cli.build_parser([names[-1], "--help"])) == list(names)
    every = [name for _module, names in cli.COMMANDS for name in names]
    for argv in (None, [], ["--help"], ["-h", "run"], ["frobnicate"]):
        assert _commands(cli.build_parser(argv)) == every
