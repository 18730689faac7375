"""What happens between exec of `drvqwen run` and its first token: the statistics' phases
(measured where the work happens, exclusive, in the order they ran, summing to at most the
total), the tokenizer's bytes looked up per id, and the kernels compiled in parallel and only
those the engine launches, each request answered once per process; and tools/bench_startup.py,
which times a run from outside. No timing is asserted, only what the figures must satisfy."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from drvqwen import prefill
from drvqwen.stats import Background, RunStats, phase

from helpers import TINY, byte_tokenizer_json, load_tool, random_dense, write_model

ROOT = Path(__file__).resolve().parents[1]
CFG = dataclasses.replace(TINY, max_position=256)
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(5)), tokenizer_json=byte_tokenizer_json())
    return path


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))


# ---- the phases ----------------------------------------------------------------------------------

def _sleep_phase(name: str, seconds: float, inner=()):
    with phase(name):
        time.sleep(seconds)
        for n, s in inner:
            _sleep_phase(n, s)


def test_a_phase_inside_another_counts_as_its_own():
    s = RunStats()
    t0 = time.perf_counter()
    with s.recording():
        _sleep_phase("outer", 0.02, inner=[("inner", 0.03), ("outer", 0.01)])
        _sleep_phase("inner", 0.01)
    wall = time.perf_counter() - t0
    assert list(s.phases) == ["outer", "inner"]                   # in the order they started
    assert s.phases["outer"] >= 0.03 and s.phases["inner"] >= 0.04   # the sleeps each holds
    assert s.phases["outer"] + s.phases["inner"] <= wall          # never counted twice


def test_phase_records_nothing_outside_a_recorded_run():
    s = RunStats()
    with phase("nowhere"):
        pass
    assert "nowhere" not in s.phases

    def other_thread():
        with phase("elsewhere"):         # a thread of its own records into no run
            pass

    with s.recording():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert "elsewhere" not in s.phases


def test_background_returns_the_value_and_times_only_the_wait():
    s = RunStats()
    with s.recording():
        b = Background("work", lambda: (time.sleep(0.05), 42)[1])
        time.sleep(0.05)                 # the caller's own work, meanwhile
        assert b.result() == 42
    assert s.background["work"] >= 0.05
    assert s.phases["work"] < s.background["work"]      # it waited for less than the work took


def test_background_raises_what_the_work_raised_on_the_caller_thread():
    from drvqwen.errors import DrvqwenError

    def bad():
        raise DrvqwenError("model.nanoqwen: embedded tokenizer.json is invalid (x)")

    for thread in (True, False):
        with pytest.raises(DrvqwenError, match="tokenizer.json is invalid"):
            Background("tokenizer", bad, thread=thread).result()


def test_run_reports_every_phase_in_order_and_within_the_total(tiny, tmp_path, capsys):
    from drvqwen.cli import main

    js = tmp_path / "stats.json"
    rc = main(["run", "-m", str(tiny), "--device", "cpu", "-n", "6", "--ignore-eos", "-v", "--json-stats", str(js),
               "hello"])
    err = capsys.readouterr().err
    assert rc == 0, err
    d = json.loads(js.read_text())
    # In-process (the tests call cli.main), the total starts with the command: no start-up phases.
    assert d["total_from"] == "command" and "start" not in d["phases_s"]
    # The first run with this tokenizer (a cache of the test's own) writes its cached form last.
    assert list(d["phases_s"]) == ["import", "read", "verify", "tokenizer", "tokenize", "load",
                                   "generate", "prefill", "first token", "decode", "tokenizer cache"]
    assert sum(d["phases_s"].values()) <= d["total_s"]
    assert 0 < d["first_output_s"] <= d["total_s"]
    for label in ("read + validate the model", "load the tokenizer", "tokenize the prompt", "prefill",
                  "first token", "(between the phases)", "total, from the command's start",
                  "first text on stdout", "write the tokenizer's cached form (once)"):
        assert label in err


def test_a_process_counts_its_start_up_from_exec(tiny, tmp_path):
    js = tmp_path / "stats.json"
    r = subprocess.run([sys.executable, "-m", "drvqwen", "run", "-m", str(tiny), "--device", "cpu", "-n", "3",
                        "--ignore-eos", "--json-stats", str(js), "hi"], capture_output=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(js.read_text())
    phases = d["phases_s"]
    if sys.platform.startswith("linux"):
        assert d["total_from"] == "exec" and list(phases)[:2] == ["start", "import"]
    else:
        assert d["total_from"] == "command" and list(phases)[0] == "import"
    assert phases["import"] > 0 and sum(phases.values()) <= d["total_s"]


# ---- the tokenizer -------------------------------------------------------------------------------

def test_token_bytes_of_every_id_decode_as_the_tokenizer_decodes_it(real_nanoqwen):
    """Every id's bytes, looked up one by one, against the library's own decode of that id."""
    from drvqwen.tokenizer import Tokenizer

    tok = Tokenizer.from_json(real_nanoqwen.tokenizer_json)
    n = tok.vocab_size
    for i in range(n):
        assert tok.token_bytes(i).decode("utf-8", errors="replace") == tok.decode([i]), i
    for i in (-1, n, n + 300, 10**6):
        assert tok.token_bytes(i) == b"" and tok.decode([i]) == ""


def test_token_bytes_outside_the_byte_alphabet_are_their_utf8():
    """A foreign tokenizer.json's piece with a character the byte alphabet lacks ('é' is in it,
    U+00AD and 'λ' are not): the characters it has become their bytes, the others their UTF-8."""
    import tokenizers
    from tokenizers.models import BPE

    from drvqwen.tokenizer import Tokenizer
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    pieces = ["ab", BYTE_TO_CHAR[0xC3] + BYTE_TO_CHAR[0xA9], "x\u00adλ", "é"]
    tok = Tokenizer(tokenizers.Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[])))
    assert [tok.token_bytes(i) for i in range(4)] == [b"ab", "é".encode(), b"x" + "\u00adλ".encode(), b"\xe9"]


# ---- the kernels ---------------------------------------------------------------------------------

def test_parallel_compiles_give_the_sequential_cubins_in_order(tmp_path):
    from drvqwen.cuda.nvrtc import compile_kernel, compile_kernels

    names = ["decode_state", "prefill_state", "rmsnorm", "embedding"]
    requests = [(n, {}) for n in names]
    got = compile_kernels(requests, cache_dir=tmp_path / "parallel")
    assert [c.name for c in got] == names and not any(c.cache_hit for c in got)
    for c in got:
        assert c.cubin == compile_kernel(c.name, cache_dir=tmp_path / "sequential").cubin
    again = compile_kernels(requests, cache_dir=tmp_path / "parallel")
    assert all(c.cache_hit for c in again) and [c.cubin for c in again] == [c.cubin for c in got]


def test_the_engine_compiles_the_kernel_files_its_launchers_use_and_no_others():
    from drvqwen import engine
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.decode import plan_decode
    from drvqwen.launchers import FixedOccupancy, Launcher

    files = {name for name, _defines in engine.engine_kernels(CFG)}
    plan = plan_decode(CFG, occupancy=FixedOccupancy(132))
    assert {s.kernel.file for _n, s in plan.named_specs()} <= files
    # kernels/X.cu belongs to launchers/X.py: every launcher the prefill and the engine build
    # (gpu_sleep, of timing.cu, only times kernels) names a file that is compiled.
    # launchers/attention_prefill.py launches the file of the prefill's attention engine,
    # launchers/gemm_kquant.py and gemm_q32.py gemm_int4.cu's K-quant, Q4_0, Q5_0 and Q8_0 kernels.
    engine_file = {"attention_prefill": prefill.ATTENTION_FILES[prefill.ATTENTION_ENGINE], "gemm_kquant": "gemm_int4",
                   "gemm_q32": "gemm_int4"}
    used = {engine_file.get(m, m) for m in (v.__module__.rsplit(".", 1)[1] for mod in (prefill, engine)
                                            for v in vars(mod).values()
                                            if isinstance(v, type) and issubclass(v, Launcher) and v is not Launcher)}
    # A model in per-tensor formats (llama.cpp's Q4_K_M recipe) compiles the format kernels instead.
    fmt_files = {name for name, _defines in engine.engine_kernels(CFG, recipe_formats(CFG, "q4_k_m"))}
    assert used - {"timing"} <= files | fmt_files and "sampling" in used
    assert set(prefill.KERNEL_FILES) <= files and set(prefill.KERNEL_FILES_FMT) <= fmt_files
    assert not files & {"gemv_fmt", "gemm_fmt", "timing", "smoke"}   # an INT4 model: no format kernels
    assert {"gemv_fmt", "gemm_fmt"} <= fmt_files and "gemv_int4" not in fmt_files
    # The INT4 model's weights are rearranged at load (gpu_weights.py); the per-tensor ones are not.
    assert "weight_layout" in files and "weight_layout" not in fmt_files
    # ... but gemm_int4.cu's K-quant kernels, in every build (the recipe has Q4_K and Q6_K).
    fmt_builds = {tuple(sorted(d.items())) for name, d in engine.engine_kernels(CFG, recipe_formats(CFG, "q4_k_m"))
                  if name == "gemm_int4"}
    assert fmt_builds == {(), (("GEMM_BM", 64),), (("GEMM_BM", 256),)}
    # Only the projections' formats ask for them: Q4_K / Q6_K in the embedding and lm_head alone,
    # dense FP16 projections (on gemm_fmt_wgmma.cu), compile no gemm_int4.cu.
    from drvqwen.format.weight_formats import PLAIN
    dense = {name: PLAIN if ".layers." in name else fid for name, fid in recipe_formats(CFG, "q4_k_m").items()}
    assert {dense["model.embed_tokens"], dense["lm_head"]} & {10, 12}
    assert "gemm_int4" not in {name for name, _d in engine.engine_kernels(CFG, dense)}
    assert files | fmt_files <= {p.stem for p in (ROOT / "kernels").glob("*.cu")}
    # gemm_int4.cu in every tile size's build: the prefill picks one per GEMM shape and row count.
    builds = {tuple(sorted(d.items())) for name, d in engine.engine_kernels(CFG) if name == "gemm_int4"}
    assert builds == {(), (("GEMM_BM", 64),), (("GEMM_BM", 256),)}


def test_the_engine_compiles_the_prefill_attention_in_every_build_a_long_prompt_launches():
    """A 7B prompt's chunks from prefill.LATE_ATTENTION_FROM on run the range-scheduled attention,
    a build of its own (launchers/attention_prefill.py ENGINE_BUILDS): the engine compiles it
    before the first prompt, not in the middle of the first long one. Head dim 64 never takes it."""
    from drvqwen import engine
    from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
    from drvqwen.launchers import attention_prefill

    def launched(engine_name, head_dim):
        ref = attention_prefill._kernel(engine_name, head_dim)
        return ref.file, tuple(sorted(dict(ref.defines).items()))

    assert prefill.LATE_ATTENTION_FROM is not None and prefill.ATTENTION_ENGINE == "wgmma"
    builds_7b = {(n, tuple(sorted(d.items()))) for n, d in engine.engine_kernels(QWEN25_CODER_7B)}
    assert {launched(prefill.ATTENTION_ENGINE, 128), launched(prefill.LATE_ATTENTION_ENGINE, 128)} <= builds_7b
    builds_05b = {(n, tuple(sorted(d.items()))) for n, d in engine.engine_kernels(QWEN25_CODER_05B)}
    assert launched(prefill.ATTENTION_ENGINE, 64) in builds_05b
    assert {b for b in builds_05b if b[0] == launched(prefill.ATTENTION_ENGINE, 64)[0]} == {
        launched(prefill.ATTENTION_ENGINE, 64)}


def test_a_kernel_request_is_compiled_once_per_process(monkeypatch):
    """load_kernel_module answers a request it has seen from memory: building a model's launch
    lists asks for a kernel once per launch. Module loading (the GPU) is replaced here."""
    from drvqwen.cuda import module, nvrtc
    from drvqwen.launchers import KernelRef

    calls = []

    def counting(name, **kw):
        calls.append(name)
        return nvrtc.compile_kernel(name, **kw)

    class FakeModule:
        def __init__(self, cubin, name):
            self.handle, self.name = object(), name

        def function(self, name):
            return (self.name, name)

    monkeypatch.setattr(module, "compile_kernel", counting)
    monkeypatch.setattr(module, "Module", FakeModule)
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_by_request", {})
    first = module.load_kernel_module("argmax", defines={})
    for _ in range(5):
        assert module.load_kernel_module("argmax") is first
        assert KernelRef("argmax", "argmax_final").function() == ("argmax", "argmax_final")
    assert calls == ["argmax"]
    module.load_kernel_module("argmax", use_cache=False)      # asks for a fresh compile
    assert calls == ["argmax", "argmax"]
    pre = nvrtc.compile_kernel("decode_state")
    assert module.load_kernel_module("decode_state", compiled=pre).name == "decode_state"
    assert calls == ["argmax", "argmax"]                      # handed in: not compiled again


@pytest.mark.gpu
def test_the_gpu_engine_compiles_nothing_after_its_compile_phase(tiny, monkeypatch):
    """Every kernel the engine launches, through the prefill, both decode modes and every way
    of choosing a token, was compiled by `engine.load_kernels`: nothing is compiled later."""
    from drvqwen.cuda import module
    from drvqwen.engine import GPUBackend
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.sampler import SamplingParams

    late = []
    real = module.compile_kernel
    monkeypatch.setattr(module, "_by_request", {})
    monkeypatch.setattr(module, "compile_kernel", lambda name, **kw: late.append(name) or real(name, **kw))
    f = NanoqwenFile(tiny)
    s = RunStats()
    with s.recording():
        gpu = GPUBackend(f, max_context=256)
        try:
            for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=1),
                           SamplingParams(temperature=0.8, seed=1, repeat_penalty=1.2)):
                assert len(list(gpu.token_stream(list(range(1, 40)), 20, params))) == 20
        finally:
            gpu.close()
    assert late == []
    assert s.counts["kernels_compiled"] + s.counts["kernels_cached"] == s.counts["modules_loaded"]
    assert list(s.phases)[:5] == ["context", "compile", "modules", "upload", "prefill"]


# ---- tools/bench_startup.py ----------------------------------------------------------------------

def _tool():
    return load_tool("bench_startup")


def test_bench_startup_times_a_run_from_outside(tiny, tmp_path):
    out = tmp_path / "startup.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--model", str(tiny), "--runs", "1",
                        "--device", "cpu", "--json", str(out)], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "exec → first byte on stdout" in r.stdout and "median" in r.stdout
    d = json.loads(out.read_text())
    (run,) = d["runs"]
    assert run["returncode"] == 0 and 0 < run["first_byte_s"] <= run["exit_s"] and run["stdout_bytes"] > 0
    assert d["median"]["first_byte_s"] == run["first_byte_s"] and not d["cold_cache"]
    assert sum(run["stats"]["phases_s"].values()) <= run["stats"]["total_s"]
    assert set(d["source"]) == {"commit", "digest"} and len(d["source"]["digest"]) == 64
    assert str(tmp_path) not in out.read_text()            # no paths of this machine in the record


def test_bench_startup_runs_with_bytecode_as_installed():
    env = _tool().run_environment("/x/src", {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": "/y", "HOME": "/h"})
    assert env == {"PYTHONPATH": os.pathsep.join(["/x/src", "/y"]), "HOME": "/h"}


def test_bench_startup_cold_cache_root_has_only_the_kernel_cache_empty(tmp_path, monkeypatch, private_cache):
    (private_cache / "models").mkdir(parents=True)
    (private_cache / "state").mkdir()
    (private_cache / "cubin").mkdir()
    (private_cache / "cubin" / "k.cubin").write_bytes(b"\x7fELF")
    root = _tool().cold_cache_root(tmp_path)
    # tokenizer/ is made in the real root if missing, so every cold run reads the cached form
    # the first one wrote.
    assert sorted(p.name for p in root.iterdir()) == ["cubin", "models", "state", "tokenizer"]
    assert list((root / "cubin").iterdir()) == [] and not (root / "cubin").is_symlink()
    for shared in ("models", "state", "tokenizer"):
        assert (root / shared).resolve() == (private_cache / shared).resolve()


def test_the_driver_warmup_starts_before_numpy_and_never_raises():
    """cuda.warmup's thread must start before numpy and cuda.bindings are imported (importing
    drvqwen.cuda loads neither), and it ends quietly with or without a driver."""
    code = ("import sys\n"
            "from drvqwen.cuda.warmup import start_driver\n"
            "early = [m for m in ('numpy', 'cuda.bindings.driver', 'cuda.bindings.nvrtc') if m in sys.modules]\n"
            "t = start_driver(); t.join(30)\n"
            "print(early, t.is_alive())\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False"


def test_the_cuda_package_names_load_on_first_use():
    """drvqwen.cuda's exports resolve to the objects of the modules that define them, and an
    unknown name is an AttributeError (so `from drvqwen.cuda import memory` still finds the module)."""
    import importlib

    import drvqwen.cuda as cuda

    for name in cuda.__all__:
        assert getattr(cuda, name) is getattr(importlib.import_module(f"drvqwen.cuda.{cuda._EXPORTS[name]}"), name)
    assert set(cuda.__all__) == set(cuda._EXPORTS)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cuda.nope  # noqa: B018
    from drvqwen.cuda import memory
    assert memory.StagingUploader is cuda.StagingUploader


def test_the_driver_warmup_gives_its_context_back_once(monkeypatch):
    """A run that goes to the CPU after all releases the primary context the warm-up retained,
    once, however often release() is called."""
    from drvqwen.cuda import warmup

    released = []

    class Lib:
        def cuDevicePrimaryCtxRelease(self, dev):
            released.append(dev)
            return 0

    monkeypatch.setattr(warmup, "_retained", [(Lib(), 3)])
    warmup.release()
    warmup.release()
    assert released == [3]


@pytest.mark.parametrize("argv,starts", [
    (["run", "--prompt", "x"], True), (["chat"], True), (["-v", "run"], True),
    (["run", "--device", "cpu"], False), (["chat", "--device=cpu"], False), (["run", "--device", "cuda"], True),
    (["list"], False), (["eval", "humaneval"], False), ([], False), (["--version"], False),
    # argparse takes an option's unambiguous prefix; --help ends before any model is opened
    (["run", "--dev", "cpu"], False), (["chat", "--devic=cpu"], False), (["run", "--draft", "cpu"], True),
    (["run", "--help"], False), (["chat", "-h"], False)])
def test_the_entry_point_starts_the_driver_for_gpu_runs_only(monkeypatch, argv, starts):
    """`drvqwen run`/`chat` start the driver before anything imports, unless --device cpu; other
    commands (whose default device may be the CPU) leave it to loading.choose_device. The
    tokenizer worker starts for `run` alone (chat builds its tokenizer in its own process)."""
    from drvqwen import startup, tokenizer_process
    from drvqwen.cuda import warmup

    calls, workers = [], []
    monkeypatch.setattr(warmup, "start_driver", lambda ordinal=0: calls.append(ordinal))
    monkeypatch.setattr(tokenizer_process, "start_early", lambda: workers.append(1) or True)
    worker = starts and "chat" not in argv
    assert startup.start_for_command(argv) == (starts, worker)
    assert calls == ([0] if starts else []) and workers == ([1] if worker else [])


def test_the_driver_warmup_starts_once_per_process(monkeypatch):
    from drvqwen.cuda import warmup

    monkeypatch.setattr(warmup, "_started", None)
    monkeypatch.setattr(warmup, "_bring_up", lambda ordinal: None)
    first = warmup.start_driver()
    assert warmup.start_driver() is first
    first.join(5)


def test_a_cpu_run_gives_back_a_context_the_entry_point_retained(monkeypatch):
    """--device cpu after an early warm-up (chat started it, then the model went to the CPU by
    the user's word): choose_device waits for the thread and releases what it retained."""
    import threading

    from drvqwen.cuda import warmup
    from drvqwen.loading import choose_device

    released = []

    class Lib:
        def cuDevicePrimaryCtxRelease(self, dev):
            released.append(dev)
            return 0

    def bring_up():             # the context is retained a moment after choose_device is called
        time.sleep(0.3)
        warmup._retained.append((Lib(), 0))

    monkeypatch.setattr(warmup, "_retained", [])
    monkeypatch.setattr(warmup, "_started", threading.Thread(target=bring_up))
    warmup._started.start()
    assert choose_device("cpu") == ("cpu", "--device cpu")
    assert released == [0]


@pytest.mark.parametrize("value,order", [("", ["engine", "join"]), ("overlapped", ["engine", "join"]),
                                         ("after-driver", ["join", "engine"])])
def test_the_engine_imports_while_the_driver_starts(monkeypatch, value, order):
    """--device auto: the GPU engine is imported before the wait for the driver's warm-up
    (overlapping it), or after it with DRVQWEN_STARTUP_ENGINE_IMPORT=after-driver; either way
    the GPU is chosen, and an engine that cannot be imported sends the run to the CPU."""
    from drvqwen import loading, startup
    from drvqwen.cuda import device, warmup

    seen = []

    class Warming:
        def join(self, timeout=None):
            if "join" not in seen:
                seen.append("join")

    monkeypatch.setenv(startup.ENGINE_IMPORT, value)
    monkeypatch.setattr(warmup, "start_driver", lambda: Warming())
    monkeypatch.setattr(device, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(loading, "_import_engine", lambda: seen.append("engine"))
    assert loading.choose_device("auto") == ("cuda", None)
    assert seen == order
    monkeypatch.setattr(loading, "_import_engine", lambda: ImportError("no module named numpy"))
    monkeypatch.setattr(warmup, "release", lambda: None)
    assert loading.choose_device("auto") == ("cpu", "the GPU engine cannot be imported (no module named numpy)")


def test_a_model_the_gpu_cannot_run_gives_the_context_back(monkeypatch):
    """chat or run on --device auto: the warm-up retained the context, then the model needs the
    CPU (engine.check_gpu_supports refuses it): the run goes there without holding it."""
    from drvqwen import engine, loading
    from drvqwen.cuda import warmup
    from drvqwen.errors import DrvqwenError

    released = []

    class Lib:
        def cuDevicePrimaryCtxRelease(self, dev):
            released.append(dev)
            return 0

    def refuse(f):
        raise DrvqwenError("m.nanoqwen: per-tensor weights")

    monkeypatch.setattr(engine, "check_gpu_supports", refuse)
    monkeypatch.setattr(warmup, "_retained", [(Lib(), 0)])
    assert loading._gpu_or_fallback("auto", "cuda", None, None) == ("cpu", "per-tensor weights")
    assert released == [0]


@pytest.mark.parametrize("argv", [["run", "--no-such-option"], ["run", "--help"], ["list"]])
def test_the_entry_point_ends_only_after_the_warmup_thread(monkeypatch, capsys, argv):
    """A run/chat that ends before opening a model (--help, a bad option, a prompt error, -n 0)
    still has the warm-up thread inside libcuda: the process waits for it rather than exit
    (interpreter finalization, libcuda's own exit handlers) under it."""
    import signal

    from drvqwen import _entry, stats
    from drvqwen.cuda import warmup

    done = []

    def bring_up():
        time.sleep(0.3)
        done.append(True)

    monkeypatch.setattr(stats, "_process_started", stats._process_started)   # restored afterwards
    monkeypatch.setattr(warmup, "_started", threading.Thread(target=bring_up, daemon=True))
    warmup._started.start()
    monkeypatch.setattr(sys, "argv", ["drvqwen", *argv])
    handler = signal.getsignal(signal.SIGINT)
    try:
        try:
            _entry.main()
        except SystemExit:
            pass
    finally:
        signal.signal(signal.SIGINT, handler)
    capsys.readouterr()
    assert done == [True]
