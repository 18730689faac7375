"""`drvqwen eval`: the sandbox that runs generated programs (sandbox.py), the HumanEval protocol
(humaneval.py) on problems written here (the real data is never in the repository), and the
logit agreement (agreement.py, `eval agree`) on a tiny model."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from drvqwen import humaneval as he
from drvqwen.sandbox import isolation, run_program

from helpers import TINY, random_dense, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("private_cache")


def _live_sandbox_processes() -> list[int]:
    """pids whose command line names a sandbox program (their temporary folder)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"drvqwen-eval-" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


# ---- sandbox ------------------------------------------------------------------------------------

def test_passing_and_failing_programs():
    assert run_program("assert sum([1, 2]) == 3\n").passed
    r = run_program("assert 1 == 2, 'wrong'\n")
    assert not r.passed and r.returncode == 1 and r.error == "AssertionError: wrong"


def test_a_hanging_program_is_killed_and_reported():
    t0 = time.perf_counter()
    r = run_program("while True:\n    pass\n", timeout_s=2)
    assert not r.passed and r.timed_out and "timed out after 2 s" in r.error
    assert time.perf_counter() - t0 < 10
    assert _live_sandbox_processes() == []


def test_a_memory_hungry_program_fails_without_taking_the_memory():
    r = run_program("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", timeout_s=10, memory_bytes=256 << 20)
    assert not r.passed and ("MemoryError" in r.error or "killed" in r.error or r.timed_out), r


def test_a_sleeping_child_left_behind_is_killed():
    r = run_program("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
                    timeout_s=5)
    assert r.passed
    time.sleep(0.2)
    assert _live_sandbox_processes() == []


@pytest.mark.skipif(not isolation()["pids_cgroup"], reason="no pids cgroup on this machine: a fork bomb "
                                                           "would only be stopped by the time limit")
def test_a_fork_bomb_is_contained():
    r = run_program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                    timeout_s=3, max_procs=16)
    assert not r.passed and r.timed_out
    time.sleep(0.2)
    assert _live_sandbox_processes() == []


@pytest.mark.skipif(not isolation()["namespaces"], reason="no network namespace on this machine")
def test_no_network():
    r = run_program("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=3)\n", timeout_s=8)
    assert not r.passed and ("unreachable" in r.error or "OSError" in r.error), r


def test_a_flood_on_stderr_keeps_drvqwens_memory_bounded(tmp_path):
    """300 MB on stderr (and on stdout) are read to the end but only a tail is kept: the
    runner's own peak RSS stays far below what it read. Measured in a fresh process by its
    VmHWM (getrusage's ru_maxrss would carry the test runner's peak across fork and exec)."""
    import subprocess
    import sys

    script = (
        "from drvqwen.sandbox import run_program\n"
        "src = 'import sys\\nfor _ in range(75):\\n    sys.stderr.write(\"e\" * 4_000_000)\\n"
        "    sys.stdout.write(\"o\" * 4_000_000)\\nsys.stderr.write(\"\\\\nlast line\\\\n\")\\nraise SystemExit(3)\\n'\n"
        "r = run_program(src, timeout_s=60)\n"
        "import json\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(json.dumps([r.returncode, r.error, len(r.stderr), len(r.stdout), int(hwm.split()[1]) // 1024]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.abspath("src")})
    assert out.returncode == 0, out.stderr
    code, error, n_err, n_out, peak_mib = json.loads(out.stdout)
    assert code == 3 and error == "last line"
    assert 0 < n_err <= 64 * 1024 and 0 < n_out <= 64 * 1024
    assert peak_mib < 150, f"the runner's peak RSS was {peak_mib} MiB"


@pytest.mark.skipif(not isolation().get("memory_cgroup"), reason="no memory cgroup on this machine: each "
                                                              "process is capped alone (RLIMIT_AS)")
def test_memory_is_bounded_for_the_whole_program_children_included():
    """Four children of 200 MiB each stay under the per-process address-space limit, but not
    under the program's: the memory cgroup counts them together."""
    src = ("import os, time\n"
           "pids = []\n"
           "for _ in range(4):\n"
           "    pid = os.fork()\n"
           "    if pid == 0:\n"
           "        x = bytearray(200 << 20)\n"
           "        for i in range(0, len(x), 4096):\n"
           "            x[i] = 1\n"
           "        time.sleep(3)\n"
           "        os._exit(0)\n"
           "    pids.append(pid)\n"
           "for pid in pids:\n"
           "    _, status = os.waitpid(pid, 0)\n"
           "    assert status == 0, f'child status {status}'\n")
    assert run_program(src, timeout_s=20, memory_bytes=1024 << 20).passed       # 800 MiB fit in 1 GiB
    r = run_program(src, timeout_s=20, memory_bytes=512 << 20)
    assert not r.passed and ("memory" in r.error or "status 9" in r.error), r
    time.sleep(0.2)
    assert _live_sandbox_processes() == []


def test_isolation_says_what_the_machine_gives():
    iso = isolation()
    assert set(iso) == {"namespaces", "pids_cgroup", "memory_cgroup"} and all(isinstance(v, bool) for v in iso.values())


# ---- HumanEval protocol -------------------------------------------------------------------------

PROBLEMS = [
    {"task_id": "T/0", "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "entry_point": "add",
     "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n"},
    {"task_id": "T/1", "prompt": "def neg(a):\n", "entry_point": "neg",
     "test": "def check(f):\n    assert f(2) == -2\n"},
    {"task_id": "T/2", "prompt": "def spin():\n", "entry_point": "spin", "test": "def check(f):\n    f()\n"},
]


@pytest.fixture
def problems_file(tmp_path):
    p = tmp_path / "problems.jsonl.gz"
    p.write_bytes(gzip.compress("\n".join(json.dumps(d) for d in PROBLEMS).encode()))
    return p


def test_problems_load_and_bad_records_are_named(problems_file, tmp_path):
    assert [p.task_id for p in he.load_problems(problems_file)] == ["T/0", "T/1", "T/2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n{\"task_id\": 1}\n")
    with pytest.raises(Exception, match=r"bad.jsonl: line 2: field 'task_id' must be a string, got 1$"):
        he.load_problems(bad)


_GZ = gzip.compress(b'{"task_id":1}' * 2000)   # a problems file's .gz, to break


@pytest.mark.parametrize("content, said", [
    (b"\xff\xfe\x00garbage\n", "line 1: not UTF-8 (byte 0)"),
    (b"[1, 2]\n", "line 1: not a HumanEval record (a JSON object with task_id, prompt, entry_point, test)"),
    (b"{\"task_id\": \"a\"\n", "line 1: not JSON ("),
    (b'{"task_id": "a", "entry_point": "f", "test": "x"}\n', "line 1: missing field 'prompt'"),
    (b'{"task_id": "a", "prompt": 5, "entry_point": "f", "test": "x"}\n',
     "line 1: field 'prompt' must be a string, got 5"),
    (b'{"task_id": "a", "prompt": " ", "entry_point": "f", "test": "x"}\n', "line 1: field 'prompt' is empty"),
    (b"\x1f\x8bnot gzip", "not a readable .gz ("),
    (_GZ[:12] + b"\x55" + _GZ[13:], "not a readable .gz ("),   # its deflate data broken: zlib.error
    (b"[" * 100000 + b"\n", "line 1: not JSON (nested too deeply)"),
])
def test_a_bad_problems_file_is_one_line_naming_line_and_field(tmp_path, content, said):
    """Every way a problems file can be wrong is one DrvqwenError naming the file, the line and
    the field — never a traceback from deep in the tokenizer or a Python repr."""
    from drvqwen.errors import DrvqwenError

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    with pytest.raises(DrvqwenError) as ei:
        he.load_problems(bad)
    assert str(ei.value).startswith(f"{bad}: {said}") and "\n" not in str(ei.value), str(ei.value)
    with pytest.raises(DrvqwenError, match="is a directory; give the HumanEval problems file"):
        he.load_problems(tmp_path)


def test_raw_completions_are_cut_at_the_stop_strings():
    from drvqwen.tokenizer import Tokenizer
    from helpers import byte_tokenizer_json

    tok = Tokenizer.from_json(byte_tokenizer_json())
    p = he.Problem(**PROBLEMS[0])
    model_text = "    return a + b\n\n\ndef other():\n    pass\n"
    asked = []

    def fake_generate(ids, budget, on_token):
        asked.append((tok.decode(ids), budget))
        for t in tok.encode(model_text):
            if on_token(t):
                return

    got = he.complete(tok, fake_generate, p, "raw")
    assert got == "    return a + b\n\n" and asked == [(p.prompt, he.MAX_NEW_TOKENS)]


def test_chat_answers_give_their_code_block():
    p = he.Problem(**PROBLEMS[0])
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert he.extract_code(answer) == "def add(a, b):\n    return a + b\n"
    assert he.build_program(p, answer, "chat").startswith("def add(a, b):\n    return a + b\n")
    body_only = "```python\n    return a + b\n```"
    assert he.build_program(p, body_only, "chat").startswith(p.prompt + "    return a + b\n")


def test_programs_run_in_parallel_and_fail_by_name():
    probs = [he.Problem(**d) for d in PROBLEMS]
    completions = ["    return a + b\n", "    return a\n", "    while True:\n        pass\n"]
    t0 = time.perf_counter()
    res = he.run_programs(probs, completions, "raw", timeout_s=3, workers=3)
    assert [r.passed for r in res] == [True, False, False]
    assert res[1].error.startswith("AssertionError") and "timed out" in res[2].error
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("exit_early", [
    'if __name__ == "__main__":\n    import unittest\n    unittest.main()\n',
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "exit()\n",
    "raise SystemExit\n",
    "import atexit, os\natexit.register(os._exit, 0)\nraise KeyboardInterrupt\n",
])
def test_a_program_that_exits_before_its_check_does_not_pass(exit_early):
    """A chat answer with its own `unittest.main()` (or any exit) ends the program with status 0
    before `check(entry_point)` runs: only a check that ran and returned counts."""
    p = he.Problem(**PROBLEMS[0])
    answer = f"```python\ndef add(a, b):\n    return a - b\n\n{exit_early}```"
    res = he.run_programs([p], [answer], "chat", timeout_s=10, workers=1)
    assert not res[0].passed and res[0].error, res[0]
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    assert he.run_programs([p], [good], "chat", timeout_s=10, workers=1)[0].passed
    # A check that fails is still a failure, with its message.
    res = he.run_programs([p], ["```python\ndef add(a, b):\n    return a - b\n```"], "chat", timeout_s=10)
    assert not res[0].passed and res[0].error.startswith("AssertionError")


# ---- the commands on a tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalsrc")
    # Every matrix Q8_0 (vectors stay F32): all of it kept exactly by `--weights source`.
    return write_tiny_gguf(d / "tiny.gguf", TINY, random_dense(TINY, np.random.default_rng(5)), qtype="Q8_0")


def test_agree_is_exact_for_source_formats_and_not_for_int4(tiny_source, tmp_path, capsys):
    from drvqwen.cli import main
    from drvqwen.format.convert import convert

    convert(tiny_source, tmp_path / "src.nanoqwen", weights="source")
    convert(tiny_source, tmp_path / "int4.nanoqwen", weights="int4")
    figures = {}
    for name in ("src", "int4"):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "agree", "--model", str(tmp_path / f"{name}.nanoqwen"), "--reference",
                     str(tiny_source), "--limit", "4", "--json", str(out)]) == 0
        figures[name] = json.loads(out.read_text())
    # File names, not paths (a JSON may be committed from another machine), and the code that ran.
    assert figures["src"]["model"] == "src.nanoqwen" and figures["src"]["reference"] == tiny_source.name
    assert set(figures["src"]["source"]) == {"commit", "digest"} and len(figures["src"]["source"]["digest"]) == 64
    said = capsys.readouterr().out
    assert "last position (4): cosine mean" in said and "every position" in said
    s = figures["src"]["every_position"]
    assert s["cosine_min"] > 0.999999 and s["kl_max"] < 1e-9 and s["top1"] == 1.0
    q = figures["int4"]["every_position"]
    assert q["positions"] == s["positions"] > 50 and q["cosine_mean"] < s["cosine_mean"] and q["kl_mean"] > 1e-6


def test_eval_humaneval_command_on_a_tiny_model(tiny_source, problems_file, tmp_path, capsys):
    from drvqwen.cli import main

    out = tmp_path / "he.json"
    assert main(["eval", "humaneval", "--model", str(tiny_source), "--problems", str(problems_file),
                 "--limit", "2", "--device", "cpu", "--timeout", "3", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "HumanEval raw: 0/2 passed" in said
    doc = json.loads(out.read_text())
    assert doc["model"].endswith(".nanoqwen") and "/" not in doc["model"] and doc["device"].startswith("cpu")
    assert set(doc["source"]) == {"commit", "digest"} and len(doc["source"]["digest"]) == 64
    assert doc["total"] == 2 and [r["task_id"] for r in doc["problems"]] == ["T/0", "T/1"]
    assert all(set(r) == {"task_id", "completion", "passed", "error"} for r in doc["problems"])
    # A random tiny model passes nothing: every record says why.
    assert doc["passed"] == 0 and all(r["error"] for r in doc["problems"])


def test_missing_problems_are_one_line(tmp_path, capsys):
    from drvqwen.cli import main

    assert main(["eval", "humaneval", "--problems", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: file not found" in capsys.readouterr().err


def test_agreement_gates_top1_by_the_gap_and_the_rms_error():
    """A near-tie swapped by a last-bit error counts against raw top-1, not against the gated one;
    a swap across a clear gap counts against both."""
    from drvqwen.agreement import Agreement

    rng = np.random.default_rng(3)
    a = Agreement()
    for _ in range(20):
        src = rng.standard_normal(50) * 3
        src[7] = src.max() + 5.0                      # a clear winner
        a.add(src + rng.standard_normal(50) * 1e-3, src)
    tie = rng.standard_normal(50)
    tie[3], tie[4] = 9.0, 9.0 + 1e-4                 # source picks 4 by a hair
    model = tie.copy()
    model[3] += 2e-4                                  # the model picks 3
    a.add(model, tie)
    s = a.summary()
    assert s["top1"] < 1.0 and s["top1_gated"] == 1.0 and s["gated_positions"] == 20
    clear = rng.standard_normal(50)
    clear[1] = 20.0
    wrong = clear.copy()
    wrong[2] = 30.0
    a.add(wrong, clear)
    assert a.summary()["top1_gated"] < 1.0


def test_agree_line_says_when_no_position_passes_the_gate():
    from drvqwen.eval_cli import agree_line

    s = {"positions": 3, "cosine_mean": 0.99, "cosine_min": 0.98, "kl_mean": 1e-3, "kl_max": 2e-3, "top1": 1.0,
         "rms_err": 1.04, "top1_gated": 1.0, "gated_positions": 0}
    assert agree_line("last_position", s).endswith("top-1 where the gap > 6 × RMS error 1.04e+00: no such position")
    assert agree_line("last_position", s | {"gated_positions": 2}).endswith(": 100.0% of 2")


def test_backend_forward_gives_every_position_of_one_pass(tiny_source, tmp_path):
    """The GPU mode's forward (prefill the first id, decode the rest), run here on the CPU
    backend, equals the reference's full forward pass at every position."""
    from drvqwen import agreement as ag
    from drvqwen.format.convert import convert
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.generate import CPUBackend
    from drvqwen.reference import Weights

    convert(tiny_source, tmp_path / "m.nanoqwen", weights="source")
    f = NanoqwenFile(tmp_path / "m.nanoqwen")
    ids = [5, 17, 3, 200, 9, 9, 41]
    got = ag.backend_forward_fn(CPUBackend(f, 32))(ids)
    want = ag.forward_fn(Weights.from_nanoqwen(f), 32)(ids)
    assert got.shape == want.shape == (len(ids), TINY.vocab_size)
    v = f.text_vocab                               # the backend's padded rows are -inf (no text)
    np.testing.assert_allclose(got[:, :v], want[:, :v], rtol=1e-5, atol=1e-5)


def test_agree_takes_a_source_format_nanoqwen_as_the_reference(tiny_source, tmp_path, capsys):
    """A `--weights source` file dequantizes to the GGUF's values bit for bit, so as the reference
    it gives what the GGUF gives (a machine without the `gguf` package can still check a model)."""
    from drvqwen.cli import main
    from drvqwen.format.convert import convert

    convert(tiny_source, tmp_path / "src.nanoqwen", weights="source")
    convert(tiny_source, tmp_path / "int4.nanoqwen", weights="int4")
    figs = {}
    for ref_path in (str(tiny_source), str(tmp_path / "src.nanoqwen")):
        out = tmp_path / "a.json"
        assert main(["eval", "agree", "--model", str(tmp_path / "int4.nanoqwen"), "--reference", ref_path,
                     "--limit", "3", "--json", str(out)]) == 0
        figs[ref_path] = json.loads(out.read_text())["every_position"]
    a, b = figs.values()
    assert a["positions"] == b["positions"] and a["cosine_min"] == b["cosine_min"] and a["kl_max"] == b["kl_max"]


def test_agree_names_a_missing_nanoqwen_reference_in_one_line(tiny_source, tmp_path, capsys):
    """A `.nanoqwen` reference that does not exist: one line naming it, before the model is read."""
    from drvqwen.cli import main

    missing = tmp_path / "nope.nanoqwen"
    assert main(["eval", "agree", "--model", str(tiny_source), "--reference", str(missing)]) != 0
    err = capsys.readouterr().err
    assert f"{missing}: file not found" in err and "Traceback" not in err
    assert "verified" not in err and "converting" not in err       # the model was not read first
