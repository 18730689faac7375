"""`drvqwen run` on the CPU, in process, on TINY models: the context rule shared with the GPU,
truthful stop reasons, and what is (not) done for --max-new-tokens 0 and 1."""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.usefixtures("private_cache")

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

SMALL_CTX = dataclasses.replace(TINY, max_position=64)


@pytest.fixture
def ctx64(tmp_path, rng):
    path = tmp_path / "ctx64.nanoqwen"
    write_model(path, SMALL_CTX, random_dense(SMALL_CTX, rng), tokenizer_json=byte_tokenizer_json())
    return path


def _run(capsys, model, *args: str, device: str = "cpu") -> tuple[int, str, str]:
    from drvqwen.cli import main

    rc = main(["run", "--model", str(model), "--device", device, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_max_context_past_the_model_is_refused_as_on_the_gpu(ctx64, capsys):
    rc, _, err = _run(capsys, ctx64, "--raw", "--prompt", "hi", "--max-context", "100")
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1
    assert "--max-context=100: must be 0 or in [1, 64]" in lines[0]


def test_prompt_past_the_models_context_names_the_model(ctx64, capsys):
    rc, _, err = _run(capsys, ctx64, "--raw", "--prompt", "x" * 70)
    assert rc == 2 and f"prompt of 70 tokens does not fit the context of 64 tokens (--max-context; {ctx64} allows 64)" in err


def test_context_full_is_said_and_warned(ctx64, capsys):
    rc, _, err = _run(capsys, ctx64, "--raw", "--prompt", "x" * 60, "--max-new-tokens", "10",
                      "--ignore-eos")
    assert rc == 0
    assert "generated 4 (context full)" in err            # 60 + 4 = the context of 64
    assert "warning: the context of 64 tokens is full" in err
    rc, _, err = _run(capsys, ctx64, "--raw", "--prompt", "x" * 60, "--max-new-tokens", "4",
                      "--ignore-eos")
    assert rc == 0 and "generated 4 (max_new_tokens)" in err and "warning" not in err


def test_zero_new_tokens_loads_nothing(ctx64, capsys, monkeypatch):
    import drvqwen.generate as g

    def no_backend(*a, **k):
        raise AssertionError("the weights were loaded for --max-new-tokens 0")

    monkeypatch.setattr(g, "CPUBackend", no_backend)
    rc, out, err = _run(capsys, ctx64, "--raw", "--prompt", "hello", "--max-new-tokens", "0")
    assert rc == 0 and out == ""
    assert "prompt 5 tokens, generated 0 (max_new_tokens)" in err and "nan" not in err.lower()


def test_one_new_token_reports_no_rate(ctx64, capsys):
    rc, _, err = _run(capsys, ctx64, "--raw", "--prompt", "hello", "--max-new-tokens", "1", "--ignore-eos")
    assert rc == 0 and "generated 1 (max_new_tokens)" in err
    assert "nan" not in err.lower() and "decode" not in err and "TTFT" in err


def test_yarn_model_runs_on_the_cpu_not_the_gpu(tmp_path, rng, capsys, monkeypatch):
    """The GPU kernels do not apply YaRN's attention factor yet: `auto` falls back to the CPU
    with the reason, `--device cuda` refuses with one line."""
    from drvqwen import cli, loading
    from drvqwen.config import RopeScaling

    cfg = dataclasses.replace(TINY, max_position=256,
                              rope_scaling=RopeScaling(factor=4.0, original_max_position=64, attention_factor=1.1))
    path = tmp_path / "yarn.nanoqwen"
    write_model(path, cfg, random_dense(cfg, rng), tokenizer_json=byte_tokenizer_json())
    monkeypatch.setattr(loading, "choose_device", lambda requested: ("cuda", None))
    rc, _, err = _run(capsys, path, "--raw", "--prompt", "x" * 100, "--max-new-tokens", "3", "--ignore-eos",
                      device="auto")
    assert rc == 0 and "YaRN RoPE scaling (factor 4) runs on the CPU backend only" in err
    assert "generated 3" in err
    rc = cli.main(["run", "--model", str(path), "--device", "cuda", "--raw", "--prompt", "x"])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and f"{path}: YaRN RoPE scaling" in lines[0]
