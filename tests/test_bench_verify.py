"""tools/bench_verify.py on the CPU: the arguments, the medians and ratios, the JSON and the
table, with the GPU parts (the backend, the model file, the measurement) faked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from drvqwen.config import QWEN25_CODER_05B

from helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_verify")


@pytest.mark.parametrize("argv,says", [
    (["--reps", "0"], "--reps 0: at least 1"),
    (["--prompt-tokens", "0"], "--prompt-tokens 0: at least 1"),
    (["--max-context", "100", "--prompt-tokens", "90"], "--max-context 100: the protocol needs 106 tokens"),
    (["--preset", "9b"], "invalid choice: '9b'"),
    (["--json", "/nonexistent-folder/x.json"], "--json /nonexistent-folder/x.json: no folder")])
def test_bad_arguments_are_refused_in_one_line(tool, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_defaults(tool):
    a = tool.parse_args([])
    assert (a.preset, a.model, a.prompt_tokens, a.reps, a.max_context, a.json) == ("7b", None, 512, 30, 0, None)
    assert tool.VERIFY_TOKENS == (1, 2, 4, 8, 16)


def _samples(tool) -> dict:
    """Made-up samples: decode median 2.0 ms host / 1.8 ms GPU; a pass of T costs 2 + 0.1 T ms."""
    s = {"decode": {"host_ms": [2.5, 2.0, 1.9], "gpu_ms": [1.8, 1.7, 1.9]}}
    for T in tool.VERIFY_TOKENS:
        s[f"verify{T}"] = {"host_ms": [2 + 0.1 * T, 9.0, 1.0], "gpu_ms": [1.8 + 0.1 * T] * 3}
    return s


def test_medians_and_ratios_to_the_decode_step(tool):
    m = tool.summarize(_samples(tool))
    assert list(m) == ["decode"] + [f"verify{T}" for T in tool.VERIFY_TOKENS]
    assert m["decode"] == {"host_median_ms": 2.0, "gpu_median_ms": 1.8}
    v8 = m["verify8"]
    assert v8["host_median_ms"] == pytest.approx(2.8) and v8["gpu_median_ms"] == pytest.approx(2.6)
    assert v8["host_over_decode"] == pytest.approx(1.4) and v8["gpu_over_decode"] == pytest.approx(2.6 / 1.8)


@pytest.fixture
def faked_gpu(tool, monkeypatch, tmp_path):
    """run()'s GPU parts faked: a GPU present, the synthetic model's path, a backend with a verify
    pass, and measure() returning the made-up samples."""
    import drvqwen.bench
    import drvqwen.cuda
    import drvqwen.engine
    import drvqwen.format.nanoqwen

    made = {}

    class Backend:
        def __init__(self, f, max_context, speculative):
            made.update(max_context=max_context, speculative=speculative, closed=False)
            self.config, self.max_context = QWEN25_CODER_05B, max_context or 32768
            self.verify_pass = SimpleNamespace(mode="graph", prenorm=True)
            self.decode_step = SimpleNamespace(attention="plain",
                                               device=SimpleNamespace(info=SimpleNamespace(summary=lambda: "GPU X")))

        def close(self):
            made["closed"] = True

    def measure(backend, prompt, reps, rng, passes=None):
        made.update(prompt=prompt, reps=reps, passes=passes)
        return _samples(tool)

    monkeypatch.setattr(drvqwen.cuda, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(drvqwen.bench, "ensure_synthetic", lambda preset: tmp_path / f"synthetic-{preset}.nanoqwen")
    monkeypatch.setattr(drvqwen.format.nanoqwen, "NanoqwenFile", lambda p: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(drvqwen.engine, "GPUBackend", Backend)
    monkeypatch.setattr(tool, "measure", measure)
    return made


def test_json_layout(tool, faked_gpu, tmp_path, capsys):
    out = tmp_path / "v.json"
    assert tool.main(["--preset", "0.5b", "--reps", "3", "--prompt-tokens", "40", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"device", "model", "config", "protocol", "target", "samples", "medians", "source"}
    assert res["model"] == "synthetic-0.5b.nanoqwen" and "/" not in res["model"]
    assert res["device"] == "GPU X" and res["config"]["hidden_size"] == QWEN25_CODER_05B.hidden_size
    p = res["protocol"]
    assert (p["prompt_tokens"], p["reps"], p["verify_tokens"], p["verify_mode"], p["attention"]) == (
        40, 3, [1, 2, 4, 8, 16], "graph", "plain")
    assert res["target"] == {"verify_tokens": 8, "max_over_decode": 1.25}
    assert res["samples"] == _samples(tool) and res["medians"] == tool.summarize(_samples(tool))
    assert set(res["source"]) == {"commit", "digest"}      # provenance.source_record, as the benches write it
    assert faked_gpu["speculative"] is True and faked_gpu["closed"] and faked_gpu["reps"] == 3
    assert len(faked_gpu["prompt"]) == 40 and faked_gpu["max_context"] is None
    assert "verify8" in capsys.readouterr().out


def test_a_model_without_a_verify_pass_is_one_line(tool, faked_gpu, monkeypatch, capsys):
    import drvqwen.engine

    class NoPass(drvqwen.engine.GPUBackend):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.verify_pass = None
    monkeypatch.setattr(drvqwen.engine, "GPUBackend", NoPass)
    assert tool.main([]) == 2
    err = capsys.readouterr().err
    assert "no verify pass for this model" in err and faked_gpu["closed"]


def test_no_gpu_is_one_line(tool, monkeypatch, capsys):
    import drvqwen.cuda

    monkeypatch.setattr(drvqwen.cuda, "gpu_unavailable_reason", lambda: "no CUDA driver")
    assert tool.main(["--reps", "1"]) == 2
    assert "bench_verify needs a Hopper GPU: no CUDA driver" in capsys.readouterr().err


def test_table_shows_every_row_and_the_ratios(tool):
    res = {"model": "m.nanoqwen", "protocol": {"prompt_tokens": 512}, "medians": tool.summarize(_samples(tool))}
    con = Console(record=True, width=140)
    tool.print_table(res, con)
    text = con.export_text()
    assert all(f"verify{T}" in text for T in tool.VERIFY_TOKENS) and "decode" in text
    assert "1.40" in text      # verify8's host median over the decode step's


def test_kernels_flag_adds_the_per_role_table(tool, faked_gpu, monkeypatch, tmp_path, capsys):
    per = {"decode": {"qkv_rope": 240.0, "attention": 400.0}, "verify8": {"qkv_rope": 300.0, "attention": 1600.0}}
    seen = {}

    def measure_kernels(backend, reps, rng, passes=None):
        seen["reps"] = reps
        return per
    monkeypatch.setattr(tool, "measure_kernels", measure_kernels)
    out = tmp_path / "v.json"
    assert tool.main(["--reps", "4", "--kernels", "--json", str(out)]) == 0
    assert seen["reps"] == 4 and json.loads(out.read_text())["kernels_us"] == per
    text = capsys.readouterr().out
    assert "1600.0" in text and "1900.0" in text          # a role's µs and the pass's sum


def test_by_role_sums_a_role_over_the_layers():
    from drvqwen.bench import by_role

    per = {"embedding": 3.0, "L0.o_proj": 4.0, "L1.o_proj": 5.0, "L0.attention.0": 6.0, "L0.attention.1": 1.0}
    assert by_role(per) == {"embedding": 3.0, "o_proj": 9.0, "attention.0": 6.0, "attention.1": 1.0}


def test_fused_times_a_second_pass_and_closes_it(tool, faked_gpu, monkeypatch, tmp_path):
    import drvqwen.verify_pass

    made = []

    class Pass:
        def __init__(self, step, graphs, prenorm):
            self.closed = False
            made.append((graphs, prenorm, self))

        def close(self):
            self.closed = True
    monkeypatch.setattr(drvqwen.verify_pass, "VerifyPass", Pass)
    out = tmp_path / "v.json"
    assert tool.main(["--fused", "--reps", "2", "--json", str(out)]) == 0
    assert list(faked_gpu["passes"]) == ["", " fused"] and faked_gpu["passes"][" fused"] is made[0][2]
    assert made[0][:2] == (True, False) and made[0][2].closed
    assert "inside the T-token GEMVs" in json.loads(out.read_text())["protocol"]["fused"]
