"""`drvqwen bench` (bench.py) without a GPU: the figures it derives, the table, the command line.

The measurement itself needs the H200 (tools/gpu_check.sh bench); here the arithmetic of the
protocol is checked on made-up timings: bytes per token, effective bandwidth and its ratio to
the copy bandwidth (read + write convention), ITL median/p99, tok/s, and that a machine without
a GPU gets one line of error before any synthetic model is written.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from drvqwen import bench
from drvqwen.config import QWEN25_CODER_7B
from drvqwen.cuda.bandwidth import CopyBandwidth


def test_kv_bytes_read_7b():
    # 28 layers × (K + V) × 4 KV heads × 128 dims × 2 B = 57344 B per token of context.
    assert bench.kv_bytes_read(QWEN25_CODER_7B, 1) == 57344
    assert bench.kv_bytes_read(QWEN25_CODER_7B, 576) == 576 * 57344


def test_weight_bytes_read_one_embedding_row():
    arr = lambda n: SimpleNamespace(nbytes=n)  # noqa: E731
    dense = SimpleNamespace(config=SimpleNamespace(vocab_size=10), weights=SimpleNamespace(arrays={
        "model.embed_tokens.weight": arr(1000), "lm_head.weight": arr(700), "model.norm.weight": arr(7)}))
    assert bench.weight_bytes_per_token(dense) == 700 + 7 + 1000 // 10
    # An embedding in a quantized format: one row of each of its parts.
    quantized = SimpleNamespace(config=dense.config, weights=SimpleNamespace(arrays={
        "model.embed_tokens.qweight": arr(1000), "model.embed_tokens.scales": arr(200), "lm_head.weight": arr(700)}))
    assert bench.weight_bytes_per_token(quantized) == 700 + 1000 // 10 + 200 // 10


def test_mode_result_figures():
    itl = [2.0] * 50 + [1.0] * 76 + [10.0]          # ms, 127 decode steps
    r = bench.ModeResult("graph", None, itl, list(range(128)), bytes_per_token=4.455e9, copy_gbps=4300.0)
    assert r.itl_median_ms == 1.0
    assert r.itl_p99_ms == pytest.approx(np.percentile(itl, 99))
    assert r.decode_tok_s == pytest.approx(127 / (sum(itl) * 1e-3))
    assert r.effective_gbps == pytest.approx(4455.0)  # 4.455 GB in 1 ms
    assert r.fraction_of_copy == pytest.approx(4455.0 / 4300.0)


def test_copy_bandwidth_counts_read_and_write():
    c = CopyBandwidth(2 * 2**30, (1.0, 0.9, 1.1))
    assert c.gbps == pytest.approx(2 * 2 * 2**30 / 1e-3 / 1e9)


def _result() -> dict:
    cfg = QWEN25_CODER_7B.to_dict()
    mk = lambda m, ms: bench.ModeResult(m, None, [ms] * 127, [1] * 128, 4.5e9, 4300.0)  # noqa: E731
    e, g = mk("eager", 2.4), mk("graph", 1.6)
    from dataclasses import asdict

    return {"device": "GPU 0: fake", "model": "/dev/shm/drvqwen_syn_7b.nanoqwen", "config": cfg,
            "protocol": {"prompt_tokens": 512, "new_tokens": 128}, "launches_per_step": 257,
            "copy_bandwidth": {"GBps": 4300.0}, "modes": {"eager": asdict(e), "graph": asdict(g)},
            "graph": {"mode": "graph", "fallback_reason": None}, "eager_over_graph_itl": 1.5,
            "same_tokens": True}


def test_print_table(capsys):
    from rich.console import Console

    con = Console(width=200, force_terminal=False)
    bench.print_table(_result(), con)
    out = capsys.readouterr().out
    assert "ITL median ms" in out and "eager" in out and "graph gain" in out and "1.50×" in out
    assert "n/a" in out                                # no TTFT without a GPU prefill
    assert "same tokens" in out


def test_register_adds_the_bench_command():
    ap = argparse.ArgumentParser()
    bench.register(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["bench", "--preset", "0.5b", "--json", "x.json", "--mode", "graph"])
    assert args.fn is bench.cmd_bench and args.preset == "0.5b" and args.mode == "graph"
    assert args.prompt_tokens == 512 and args.new_tokens == 128


def test_default_synthetic_path():
    p = bench.default_synthetic_path("7b")
    assert p.name == "drvqwen_syn_7b.nanoqwen"


def test_standalone_module_without_gpu_is_one_line_error(tmp_path):
    from drvqwen.cuda import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: the benchmark would run")
    r = subprocess.run([sys.executable, "-m", "drvqwen.bench", "--preset", "0.5b",
                        "--json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "needs a Hopper GPU" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b.json").exists()


class FakeDecoder:
    """DecodeStep's/GraphDecoder's running interface on the host, counting what it is asked; it
    is its own sequence too (`seq`: start, feed, pos)."""

    def __init__(self, clock=None):
        self.config = QWEN25_CODER_7B
        self.weights = SimpleNamespace(arrays={"lm_head.weight": SimpleNamespace(nbytes=100)})
        self.pos, self.token, self.steps, self.fed = 0, 0, 0, []
        self.idle = True                 # nothing queued since the last sync
        self.clock = clock               # a step takes 1 ms on it, where given

    @property
    def seq(self):
        return self

    def start(self, token, pos=0):
        self.pos, self.token = pos, token

    def decode_token(self):
        self.pos += 1
        self.steps += 1
        self.idle = False
        if self.clock is not None:
            self.clock.now += 1e-3
        self.token = (self.token * 7 + 1) % 1000

    def feed(self, token):
        self.fed.append(token)
        self.token = token

    def sync(self):
        self.idle = True

    def next_token(self):
        return self.token


class FakePrefill:
    """Prefill.run's contract: start = 0 is a new sequence (every page of the previous one given
    back); each call is recorded as (start, ids, whether the decoder was idle when it came).
    With `durations_ms`, the i-th call takes durations_ms[i] on the decoder's clock."""

    def __init__(self, dec, durations_ms=None):
        self.dec, self.runs, self.calls, self.durations_ms = dec, 0, [], durations_ms

    def run(self, ids, start=0):
        self.calls.append((start, list(ids), self.dec.idle))
        if self.durations_ms is not None:
            self.dec.clock.now += self.durations_ms[self.runs] * 1e-3
        self.runs += 1
        self.dec.idle = False
        self.dec.seq.start(ids[-1], len(ids))   # what DecodeResume leaves: decode at position T


@pytest.mark.parametrize("with_prefill", [False, True])
def test_run_mode_protocol(with_prefill):
    d = FakeDecoder()
    prompt = list(range(1, 21))
    pf = FakePrefill(d) if with_prefill else None
    r = bench.run_mode("graph", d, d, prompt, 8, copy_gbps=4000.0, prefill=pf)
    assert len(r.tokens) == 8 and len(r.itl_ms) == 7
    assert (r.ttft_ms is not None) == with_prefill
    if with_prefill:
        assert pf.runs == bench.PREFILL_REPS and len(r.ttft_runs_ms) == bench.PREFILL_REPS
        assert d.fed == [] and d.steps == bench.WARMUP_TOKENS + 7
    else:
        assert d.fed == prompt[1:] and d.steps == bench.WARMUP_TOKENS + len(prompt) + 7
    # bytes per token: weights but the embedding + the mean KV read over the 7 timed steps
    # (their lengths 21 … 27 after the prompt).
    assert r.bytes_per_token == pytest.approx(100 + bench.kv_bytes_read(QWEN25_CODER_7B, 24))
    assert d.pos == len(prompt) + 7


def test_prefill_repeats_as_new_sequences_and_reports_first_and_median(monkeypatch):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    durations = [9.0, 4.0, 6.5, 5.0, 7.0, 4.5]      # ms per prefill; the first the slowest
    d = FakeDecoder(clock)
    prompt = list(range(1, 21))
    pf = FakePrefill(d, durations)
    r = bench.run_mode("eager", d, d, prompt, 8, copy_gbps=4000.0, prefill=pf, prefill_reps=len(durations))
    # Every rep: the whole prompt as a new sequence (start 0), submitted to an idle GPU.
    assert pf.calls == [(0, prompt, True)] * len(durations)
    assert r.ttft_runs_ms == pytest.approx(durations)
    assert r.ttft_ms == pytest.approx(durations[0])
    assert r.ttft_median_ms == pytest.approx(statistics.median(durations))
    assert (r.ttft_min_ms, r.ttft_max_ms) == pytest.approx((min(durations), max(durations)))
    # Decoding continues from the last prefill; the prefills are not in the ITLs (1 ms a step).
    assert d.pos == len(prompt) + 7 and len(r.tokens) == 8
    assert r.itl_ms == pytest.approx([1.0] * 7)


def test_print_table_shows_ttft_first_and_median(capsys):
    from dataclasses import asdict

    from rich.console import Console

    res = _result()
    runs = [17.3, 15.1, 15.6]
    res["modes"]["graph"] = asdict(bench.ModeResult("graph", runs, [1.6] * 127, [1] * 128, 4.5e9, 4300.0))
    res["protocol"]["prefill_reps"] = len(runs)
    bench.print_table(res, Console(width=250, force_terminal=False))
    out = capsys.readouterr().out
    assert "TTFT first ms" in out and "TTFT median ms" in out
    graph_row = next(line for line in out.splitlines() if line.strip("│ ").startswith("graph "))
    assert f"{runs[0]:.1f}" in graph_row and f"{statistics.median(runs):.1f}" in graph_row
    assert "over 3 GPU prefills" in out


def test_prefill_reps_option():
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    assert ap.parse_args([]).prefill_reps == bench.PREFILL_REPS >= 10
    assert ap.parse_args(["--prefill-reps", "3"]).prefill_reps == 3


def test_prefill_mixed_qkv_reaches_the_prefill(monkeypatch):
    """--prefill-mixed-qkv: "one" by default (the prefill's own default), "apart" passed on as mixed_qkv=False."""
    from drvqwen import prefill

    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    assert ap.parse_args([]).prefill_mixed_qkv == "one"
    assert ap.parse_args(["--prefill-mixed-qkv", "apart"]).prefill_mixed_qkv == "apart"
    assert inspect.signature(prefill.Prefill).parameters["mixed_qkv"].default is True
    made = []
    monkeypatch.setattr(prefill, "Prefill", lambda dec, rows, **kw: made.append(kw["mixed_qkv"]))
    bench.load_prefill(object())
    bench.load_prefill(object(), mixed_qkv=False)
    assert made == [True, False]


def test_prefill_chunk_rows_reach_the_prefill(monkeypatch):
    """--prefill-chunk-rows: absent, the prefill's own chunk (DEFAULT_CHUNK_ROWS); given, passed on."""
    from drvqwen import prefill

    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    assert ap.parse_args([]).prefill_chunk_rows is None
    assert ap.parse_args(["--prefill-chunk-rows", "2048"]).prefill_chunk_rows == 2048
    made = []
    monkeypatch.setattr(prefill, "Prefill", lambda dec, rows, **kw: made.append(rows))
    bench.load_prefill(object())
    bench.load_prefill(object(), chunk_rows=2048)
    assert made == [prefill.DEFAULT_CHUNK_ROWS, 2048]
    for bad in (0, -64):  # refused in one line before anything is loaded (the path does not exist)
        with pytest.raises(bench.DrvqwenError, match=rf"^--prefill-chunk-rows {bad}: need >= 1$"):
            bench.run_bench(Path("no-such.nanoqwen"), prefill_chunk_rows=bad)


def test_persistent_defines_parse_and_refuse_in_one_line():
    assert bench.parse_defines(["DP_SPIN_NS=0", "GEMV_UNROLL=2", "X=-1"]) == (("DP_SPIN_NS", 0), ("GEMV_UNROLL", 2),
                                                                              ("X", -1))
    for bad in ("DP_SPIN_NS", "1X=2", "A=two", "=3"):
        with pytest.raises(bench.DrvqwenError, match=rf"^--persistent-define {bad!r}: expected NAME=INTEGER$"):
            bench.parse_defines([bad])


def test_prefill_attention_defines_reach_the_parser_and_name_their_option():
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    assert ap.parse_args([]).prefill_attention_define == []
    args = ap.parse_args(["--prefill-attention-define", "APW_WARPGROUPS=3", "--prefill-attention-define", "APW_Q_SMEM=1"])
    assert bench.parse_defines(args.prefill_attention_define, "--prefill-attention-define") == (
        ("APW_WARPGROUPS", 3), ("APW_Q_SMEM", 1))
    with pytest.raises(bench.DrvqwenError, match=r"^--prefill-attention-define 'APW_Q_SMEM': expected NAME=INTEGER$"):
        bench.parse_defines(["APW_Q_SMEM"], "--prefill-attention-define")


@pytest.mark.parametrize("defines, why", [
    ((("APW_WARPGROUPS", 3),), r"APW_WARPGROUPS=3, APW_Q_SMEM=0 \(wgmma\): want 2 warpgroups, or 3 with Q"),
    ((("APW_WARPGROUPS", 4), ("APW_Q_SMEM", 1)), r"APW_WARPGROUPS=4"),
    ((("APW_Q_SMEM", 2),), r"APW_WARPGROUPS=2, APW_Q_SMEM=2 \(wgmma\)"),
    ((("APW_STAGES", 2),), r"APW_STAGES=2: want >= 3"),
    ((("APW_STAGES", 7),), r".*\(wgmma-ranges\): 279552 B of shared memory at Dh 128, past 227 KiB"),
])
def test_a_prefill_attention_build_the_kernel_cannot_be_is_refused_before_any_gpu_work(monkeypatch, defines, why):
    """The kernel's static assertions and its shared memory, asked of the defines (both schedules'
    builds) before the GPU check or a model — not an NVRTC error after the model has loaded."""
    monkeypatch.setattr("drvqwen.cuda.gpu_unavailable_reason", lambda: pytest.fail("checked the GPU first"))
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    args = ap.parse_args([item for k, v in defines for item in ("--prefill-attention-define", f"{k}={v}")])
    with pytest.raises(bench.DrvqwenError, match=rf"^--prefill-attention-define: {why}"):
        bench.cmd_bench(args)


def test_prefill_attention_builds_the_kernel_can_be_pass():
    from drvqwen.launchers.attention_prefill import build_refusal

    for defines in ((), (("APW_Q_SMEM", 1),), (("APW_WARPGROUPS", 3), ("APW_Q_SMEM", 1)), (("APW_STAGES", 3),),
                    (("APW_WARPGROUPS", 2),)):
        assert build_refusal(defines) is None, defines


def test_decode_attention_option_offers_every_decode_attention_kernel():
    """`--decode-attention` lists its choices literally (the CLI does not import the decode
    module to build its parser): they must be decode.ATTENTION_KERNELS, the default none (the
    step's own)."""
    from drvqwen.decode import ATTENTION_KERNELS

    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    action = next(a for a in ap._actions if a.dest == "decode_attention")
    assert tuple(action.choices) == ATTENTION_KERNELS and ap.parse_args([]).decode_attention is None
    assert ap.parse_args(["--decode-attention", "cluster"]).decode_attention == "cluster"
    assert ap.parse_args([]).short_attention_below is None  # the step's default (decode.default_short_attention)
    assert ap.parse_args(["--short-attention-below", "0"]).short_attention_below == 0
    assert ap.parse_args(["--short-attention-below", "2048"]).short_attention_below == 2048


@pytest.mark.parametrize("below, message", [
    (-1, r"^--short-attention-below -1: need >= 0 \(0: off\)$"),
    (512, r"^--short-attention-below 512: the timed steps start at position 512 \(the prompt's length\), past it; "
          r"give more than --prompt-tokens$")])
def test_short_attention_below_refused_before_any_gpu_work(tmp_path, below, message):
    """A --short-attention-below the timed steps never reach (or a negative one) is one line,
    before the GPU is asked for and before the model is opened (here: a file that does not exist)."""
    with pytest.raises(bench.DrvqwenError, match=message):
        bench.run_bench(tmp_path / "absent.nanoqwen", prompt_tokens=512, short_attention_below=below)


def test_prefill_breakdown_groups_the_layers_and_prints_its_own_table():
    """`bench --kernels` also times the prefill's launches (Prefill.time_kernels) and prints them
    by role in a table of their own; the per-launch figures are kept as measured."""
    from rich.console import Console

    from drvqwen.bench import prefill_breakdown, print_kernels

    class FakePrefill:
        def time_kernels(self, ids):
            assert ids == [1, 2, 3]
            return {"embedding": 2.0, "L0.attention": 5.0, "L1.attention": 7.0, "L0.o_proj": 3.0}

    k = prefill_breakdown(FakePrefill(), [1, 2, 3])
    assert k["by_role_us"] == {"embedding": 2.0, "attention": 12.0, "o_proj": 3.0}
    assert k["sum_ms"] == pytest.approx(0.017) and k["per_launch_us"]["L1.attention"] == 7.0
    console = Console(width=120, record=True)
    print_kernels({"prefill_kernels": k}, console, key="prefill_kernels", what="3-token prefill")
    text = " ".join(console.export_text().split())  # the title wraps over the table's width
    assert "3-token prefill by kernel role (4 launches)" in text and "attention" in text and "17.0" in text


@pytest.mark.parametrize("argv, message", [
    (["--prompt-tokens", "0"], "--prompt-tokens 0: need >= 1"),
    (["--new-tokens", "1"], "--new-tokens 1: need >= 2 (ITL is the time between two tokens)"),
    (["--max-context", "-1"], "--max-context -1: need >= 0 (0: the model's)"),
    (["--seed", "-1"], "--seed -1: need >= 0 (the random prompt's seed)"),
    (["--prefill-reps", "0"], "--prefill-reps 0: need >= 1"),
    (["--prefill-chunk-rows", "-64"], "--prefill-chunk-rows -64: need >= 1"),
    (["--short-attention-below", "-1"], "--short-attention-below -1: need >= 0 (0: off)"),
    (["--trace"], "--trace traces the persistent kernel's ops: give --decode persistent too"),
    (["--json", "{tmp}"], "{tmp}: is a directory; give the output file name"),
], ids=["prompt-tokens", "new-tokens", "max-context", "seed", "prefill-reps", "chunk-rows", "short-attention",
        "trace", "json-folder"])
def test_bench_values_refused_before_the_gpu_check(tmp_path, capsys, argv, message):
    """A value that is wrong whatever the GPU is named first: on a machine without a GPU it was
    'needs a Hopper GPU' for each of these, and on one with a GPU a synthetic 7B written first."""
    from drvqwen.cli import main

    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: " + message.format(tmp=tmp_path), err


def test_a_short_commit_claim_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """With --json the results name their commit: a $DRVQWEN_SOURCE_COMMIT that is not a full hash
    is refused before the GPU check (on a GPU machine: before the run), not when the JSON is written
    after it."""
    from drvqwen.cli import main
    from drvqwen.provenance import SOURCE_COMMIT_ENV

    monkeypatch.setenv(SOURCE_COMMIT_ENV, "416936a")
    assert main(["bench", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: ${SOURCE_COMMIT_ENV}='416936a': not a full 40-digit commit hash", err
    assert not (tmp_path / "r.json").exists()


def test_preset_beside_model_must_be_the_models_shape():
    """`--preset 0.5b --model <a 7B>` measured the 7B under a name that said 0.5b; the preset
    beside a model is checked against the model's shape (one line naming both), equal passes."""
    from drvqwen.bench import check_preset_matches
    from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
    from drvqwen.errors import DrvqwenError

    check_preset_matches(None, QWEN25_CODER_7B, "m.nanoqwen")
    check_preset_matches("7b", QWEN25_CODER_7B, "m.nanoqwen")
    with pytest.raises(DrvqwenError) as e:
        check_preset_matches("0.5b", QWEN25_CODER_7B, "m.nanoqwen")
    assert str(e.value) == ("--preset 0.5b: --model m.nanoqwen is not that shape (hidden 3584, 28 layers: the 7b "
                            "shape); the bench measures the model, leave --preset out")
    with pytest.raises(DrvqwenError, match=r"\(hidden 896, 2 layers\); the bench"):
        check_preset_matches("0.5b", QWEN25_CODER_05B.with_layers(2), "m.nanoqwen")


def test_preset_is_checked_once_the_model_is_open_and_before_any_run(monkeypatch, tmp_path, capsys):
    """The check sits between open_model and run_bench: nothing is measured under a wrong name."""
    import types

    import drvqwen.bench as bench
    import drvqwen.cuda
    import drvqwen.loading
    from drvqwen.cli import main
    from drvqwen.config import QWEN25_CODER_7B

    closed = []
    file = types.SimpleNamespace(path=tmp_path / "m.nanoqwen", config=QWEN25_CODER_7B, close=lambda: closed.append(1))
    monkeypatch.setattr(drvqwen.cuda, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(drvqwen.loading, "open_model", lambda model, device: types.SimpleNamespace(file=file))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("ran under a preset that is not the model's"))
    assert main(["bench", "--model", "m.nanoqwen", "--preset", "0.5b"]) == 2
    assert "--preset 0.5b: --model m.nanoqwen is not that shape" in capsys.readouterr().err
    assert closed == [1]
