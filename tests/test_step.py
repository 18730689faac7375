"""`drvqwen step` on the CPU: the stepwise reference (reference_steps.py) and scripted sessions.

- The decode step run launch by launch by its references (CpuMachine) gives the logits of the
  whole-model reference (reference.Model, float32) to the decode-step bound of
  docs/numerics.md (1e-2 relative L2), teacher-forced on the same tokens: the per-launch
  references are the forward pass, cut where the launches cut it.
- Every launch group of the plan has a reference; the attention's split-KV partials are the
  group's scratch and its output is compared after the combine.
- compare() catches what it must: a perturbed value (with the index), NaN left, a wrong −inf,
  an index that is not a near tie.
- Scripted sessions through the command line (a pipe and --script) and in-process: the prompt's
  token ids, the launch count of the plan, the comparison column ("reference"), the top-k
  probabilities (sum ≤ 1), the page boundary and the graph that replays there, and errors that
  are one line after which the REPL goes on.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from drvqwen import reference as ref
from drvqwen.format import weight_formats as wf
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.reference_steps import Expected, compare
from drvqwen.tokenizer import Tokenizer

from helpers import TINY, byte_tokenizer_json, random_dense, rel_l2, write_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("step") / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, np.random.default_rng(7)), byte_tokenizer_json())
    f = NanoqwenFile(path)
    yield f
    f.close()


@pytest.fixture(scope="module", params=["int4", "q4_k_m", "f16"])
def tiny_any(request, tiny, tmp_path_factory):
    """The tiny model as INT4, in per-tensor formats (llama.cpp's Q4_K_M recipe: the GPU's
    gemv_fmt.cu step, whose launches the stepper checks against the reference too), and an F16
    GGUF kept as it is (`--weights source`: dense FP16 projections, the same kernels)."""
    if request.param == "int4":
        yield tiny
        return
    if request.param == "f16":
        pytest.importorskip("gguf")
        from drvqwen.format.convert import convert
        from helpers import write_tiny_gguf

        d = tmp_path_factory.mktemp("step")
        src = write_tiny_gguf(d / "tiny-f16.gguf", TINY, random_dense(TINY, np.random.default_rng(7)), qtype="F16")
        convert(src, d / "tiny-f16.nanoqwen", weights="source")
        f = NanoqwenFile(d / "tiny-f16.nanoqwen")
        assert set(f.formats.values()) == {wf.PLAIN}        # every matrix dense FP16
        yield f
        f.close()
        return
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic

    path = tmp_path_factory.mktemp("step") / "tiny-q4_k_m.nanoqwen"
    write_synthetic(path, TINY, seed=7, tokenizer_json=byte_tokenizer_json(), formats=recipe_formats(TINY, "q4_k_m"))
    f = NanoqwenFile(path)
    yield f
    f.close()


def _machine(f, max_context=64):
    from drvqwen.step.machine_cpu import CpuMachine

    return CpuMachine(f, max_context)


def _session(f, max_context=64):
    from drvqwen.step.repl import Repl
    from drvqwen.step.session import Session

    buf = io.StringIO()
    out = Console(file=buf, width=1 << 16, soft_wrap=True, highlight=False, color_system=None)
    s = Session(_machine(f, max_context), Tokenizer.from_json(f.tokenizer_json), out, f.eog_ids)
    return s, Repl(s, out, echo=True), buf


def test_stepwise_reference_is_the_forward_pass(tiny_any, rng):
    """Prompt and decode through the CPU step match reference.Model on the same weights."""
    tiny = tiny_any
    m = _machine(tiny)
    prompt = rng.integers(0, 256, 13).tolist()            # ids with text (the byte tokenizer)
    logits, tok = m.start(prompt)
    got, toks = [logits], [tok]
    for _ in range(6):                                    # crosses the page boundary at 16
        t, _graph = m.gen_step()
        got.append(m.logits().copy())
        toks.append(t)
    model = ref.Model(ref.Weights.from_nanoqwen(tiny, np.float32), max_tokens=64)
    want = [model.forward(prompt, last_only=True)[0]]
    for t in toks[:-1]:
        want.append(model.forward([t])[0])
    tv = tiny.text_vocab
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.isinf(g[tv:]).all() and np.isfinite(g[:tv]).all()
        err = rel_l2(g[:tv], w[:tv])
        print(f"step {i}: logits rel L2 {err:.2e}")
        assert err <= 1e-2
        top2 = np.sort(w[:tv])[-2:]
        if top2[1] - top2[0] > 6 * np.sqrt(np.mean((g[:tv] - w[:tv]) ** 2)):
            assert toks[i] == int(np.argmax(w[:tv]))
    assert m.pos == len(prompt) + 6
    assert m.seq.pages.block_table == [0, 1]


@pytest.mark.parametrize("attention", ["tma", "plain", "cluster"])
def test_comparison_path_on_cpu_buffers(tiny_any, rng, attention):
    """The GPU's path (reference from the launch's inputs in float64, then compare() against
    the buffers the launch left) over buffers the CPU wrote in the GPU's dtypes: every group
    compares ok, the split-KV partials only through the combine (the cluster kernel has none)."""
    from drvqwen.step.machine_cpu import CpuMachine

    tiny = tiny_any
    m = CpuMachine(tiny, 64, attention=attention)
    m.start(rng.integers(0, 256, 15).tolist())       # the step at 15; the next opens page 1
    m.compares, m.dtype = True, np.float64
    for _ in range(2):
        reports = m.finish_step()
        assert len(reports) == len(m.entries)
        compared = [c.name for r in reports for c in r.comparisons]
        assert len([r for r in reports if r.comparisons]) == len(m.groups)
        assert "attn" in compared and "partial_out" not in compared and "k_cache[2]" in compared
        bad = [(r.entry.name, c) for r in reports for c in r.comparisons if not c.ok]
        assert not bad, bad
        later = [r for r in reports if r.later]  # the split kernel's launch: checked with its combine
        two_launches = [f"L{l}.attention.0" for l in range(m.config.num_layers)] if attention != "cluster" else []
        assert [r.entry.name for r in later] == two_launches


def test_every_launch_group_has_a_reference(tiny_any):
    from drvqwen.reference_steps import reference_for

    tiny = tiny_any
    m = _machine(tiny)
    assert len(m.entries) == len(m.plan.named_specs())
    for g in m.groups:
        fn, what = reference_for(g)
        assert fn is not None, f"{g.name}: kernel {g.specs[0].kernel.kernel} has no reference"
        assert what
    attn = next(g for g in m.groups if g.name == "L0.attention")
    assert set(attn.scratch) == {"partial_out", "max_logits", "exp_sums"}
    assert attn.outputs == ("attn",)
    qkv = next(g for g in m.groups if g.name == "L1.qkv_rope")
    assert qkv.outputs == ("q", "k_cache[1]", "v_cache[1]")
    kernels = {g.specs[0].kernel.kernel for g in m.groups}
    family = "gemv_fmt" if m.plan.per_tensor else "gemv_int4"
    assert {f"{family}_qkv_rope", f"{family}_residual", f"{family}_gate_up_swiglu"} <= kernels


def test_compare_catches_differences(rng):
    want = rng.standard_normal(100)
    c = compare(Expected("x", want), want * (1 + 1e-5))
    assert c.ok and c.first_diff is None and c.rel_l2 < 1e-4
    bad = want.copy()
    bad[37] += 10.0
    c = compare(Expected("x", want), bad)
    assert not c.ok and c.first_diff == (37,)
    nan = want.copy()
    nan[5] = np.nan
    assert not compare(Expected("x", want), nan).ok
    w_inf = want.copy()
    w_inf[90:] = -np.inf
    assert compare(Expected("x", w_inf), w_inf.copy()).ok
    g_inf = w_inf.copy()
    g_inf[95] = 0.0
    assert not compare(Expected("x", w_inf), g_inf).ok
    # K/V slot: only the written part is compared.
    cache = np.full((4, 2, 16, 8), np.nan)
    slot = (2, slice(None), 5, slice(None))
    vals = rng.standard_normal((2, 8))
    cache[slot] = vals
    assert compare(Expected("k", vals, slot), cache).ok
    # Exact outputs and near-tie indices.
    assert not compare(Expected("s", np.array([3, 1, 4]), exact=True), np.array([3, 1, 5])).ok
    scores = np.array([1.0, 5.0, 5.0 - 1e-6, 0.0])
    assert compare(Expected("i", np.array([1]), scores=scores), np.array([2])).ok
    assert not compare(Expected("i", np.array([1]), scores=scores), np.array([3])).ok


def test_session_commands(tiny):
    s, repl, buf = _session(tiny)
    tok = Tokenizer.from_json(tiny.tokenizer_json)
    text = "def fib(n):"
    ids = tok.encode(text, special=True)
    for line in ["prompt " + text, "list", "next 3", "until L1.o_proj", "show q 0:4", "show residual",
                 "show k_cache[0] 3,0,0:4", "show L0.q_proj 0,0:4", "token"]:
        assert repl.execute(line)
    out = buf.getvalue()
    # The prompt's token table: position, id, text.
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+'", out.split("prefill of")[0], re.MULTILINE)
    assert [int(i) for _, i in rows] == ids
    # list: one row per launch of the plan.
    n = len(s.m.plan.named_specs())
    assert f"the decode step: {n} launches" in out
    listed = re.findall(r"^\s*▶?\s+(\d+)\s+(\S+)\s+(\S+)\s+\S+ × \S+", out.split("step> next 3")[0], re.MULTILINE)
    assert [int(i) for i, *_ in listed] == list(range(n))
    assert [name for _, name, _k in listed] == [e.name for e in s.m.entries]
    # next 3: the embedding, the first QKV GEMV with its three outputs, the split attention.
    assert re.search(r"\[  1/\d+\] L0.qkv_rope", out)
    assert re.search(r"^\s+k_cache\[0\]\s+reference", out, re.MULTILINE)
    assert "checked through what L0.attention.1 makes of it" in out
    assert s.m.entries[s.m.cursor].name in out       # a full step was run by `token`
    # top-k tables: probabilities in [0, 1], summing to at most 1.
    for table in re.findall(r"candidates.*?\n(.*?)\n\n", out, re.DOTALL):
        probs = [float(p) for p in re.findall(r"'\s+-?[\d.]+\s+([\d.]+)\s*$", table, re.MULTILINE)]
        assert probs and all(0 <= p <= 1 for p in probs) and sum(probs) <= 1 + 1e-9
    assert len(s.tokens) == 2 and s.m.pos == len(ids) + 1
    # show: the reference's values beside the buffer (here the CPU's own).
    assert re.search(r"q: float16\[\d+\]", out) and "NaN 0" in out


def test_errors_are_one_line_and_the_repl_goes_on(tiny):
    s, repl, buf = _session(tiny)
    bad = ["bogus", "next", "prompt", "prompt hi", "show nothing", "show q 1:2:3:4", "show q 99999",
           "until nowhere", "next 0", "next x", "tmap zz", "src nope", "help zz", "until embedding",
           "gen -1", "show k_cache[99]", "show L99.q_proj", "list zzz",
           "show q 0:8:0", "prompt caf\udce9", "chat \udcff"]   # a step of 0; bytes not UTF-8 (surrogateescape)
    for line in bad:
        start = len(buf.getvalue())
        assert repl.execute(line)
        said = buf.getvalue()[start:]
        if line == "prompt hi":
            assert "error" not in said
            continue
        errors = [ln for ln in said.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, (line, said)
        assert len(said.strip().splitlines()) == 1, (line, said)
        assert " failed: " not in said, (line, said)   # a message of drvqwen's, not a Python exception's
    assert "byte 0xe9" in buf.getvalue() and "a step of 0" in buf.getvalue()
    assert repl.execute("next 2") and "[  1/" in buf.getvalue()     # the prompt of "prompt hi" goes on
    assert not repl.execute("quit")


def test_show_before_any_step_says_there_is_no_sequence(tiny):
    """An activation before the first prompt (or after reset) holds nothing computed: `show`
    says so, as `next` does, instead of printing the uncomputed buffer; a weight shows."""
    s, repl, buf = _session(tiny)
    for line in ("show q", "show residual 0:4", "show k_cache[0]"):
        start = len(buf.getvalue())
        assert repl.execute(line)
        said = buf.getvalue()[start:].strip()
        assert said.startswith("error: ") and "`prompt TEXT` or `chat TEXT`" in said and "\n" not in said, said
    start = len(buf.getvalue())
    assert repl.execute("show L0.q_proj 0,0:4") and "error" not in buf.getvalue()[start:]


def test_page_boundary_and_graph_switch(tiny):
    s, repl, buf = _session(tiny)
    s.start_ids(list(range(65, 65 + 14)))            # the first step decodes at position 14
    for line in ["kv", "token", "kv", "graph", "gen 3", "kv"]:
        start = len(buf.getvalue())
        repl.execute(line)
        if line == "kv" and s.m.pos == 15:
            assert "so the next step replays 'decode'" in buf.getvalue()[start:]
        if line == "graph":
            said = buf.getvalue()[start:]
            assert re.search(rf"decode\s+{len(s.m.entries)}\s", said)
            assert re.search(rf"opens_page\s+{len(s.m.entries) + 1}\s", said)
    out = buf.getvalue()
    # gen 3 from position 15: 15 (decode), 16 (opens_page), 17 (decode).
    assert "decode ×2, opens_page ×1" in out
    assert re.search(r"^\s+1\s+16–31\s+1\s*$", out, re.MULTILINE)
    assert s.m.pos == 18


def _run_cli(args, stdin: str, env_cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), DRVQWEN_CACHE=str(env_cache))
    return subprocess.run([sys.executable, "-m", "drvqwen", "step", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def test_piped_and_scripted_sessions(tiny, tmp_path):
    cmds = "prompt def fib(n):\\n    return\nnext 2\nbogus\ntoken\nkv\nquit\nnext\n"
    p = _run_cli(["--model", str(tiny.path), "--device", "cpu", "--max-context", "64"], cmds, tmp_path / "cache")
    assert p.returncode == 1, p.stderr               # `bogus` printed an error: a check can fail on it
    out = p.stdout
    assert "\x1b[" not in out                        # no escape codes in a pipe
    assert out.count("step> ") == 6                  # echoed up to quit; nothing after it runs
    assert "error: unknown command 'bogus'" in out
    ids = Tokenizer.from_json(tiny.tokenizer_json).encode("def fib(n):\n    return", special=True)
    assert f"prompt: {len(ids)} tokens" in out
    assert "launches [2…" in out and "text so far" in out
    script = tmp_path / "walk.txt"
    script.write_text("# a comment\nprompt x = 1\nuntil lm_head\ntoken\n")
    p = _run_cli(["--model", str(tiny.path), "--device", "cpu", "--max-context", "64", "--script", str(script)],
                 "", tmp_path / "cache")
    assert p.returncode == 0, p.stderr               # every command ran
    assert "step> until lm_head" in p.stdout and re.search(r"\[\s*\d+/\d+\] norm", p.stdout)
    p = _run_cli(["--model", str(tiny.path), "--device", "cpu", "--script", str(tmp_path / "missing.txt")], "",
                 tmp_path / "cache")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "missing.txt" in p.stderr


@pytest.mark.slow
def test_real_model_session_on_cpu(real_nanoqwen):
    """The real 0.5B on the CPU: 149 launches (1 + 24 × 6 + 4), the prompt's ids, a whole step
    with its candidates; the chosen tokens are the argmax of the logits shown."""
    s, repl, buf = _session(real_nanoqwen, 256)
    assert len(s.m.entries) == 1 + 24 * 6 + 4
    ids = Tokenizer.from_json(real_nanoqwen.tokenizer_json).encode("def fib(n):", special=True)
    for line in ["prompt def fib(n):", "next 2", "token", "show logits 0:4"]:
        assert repl.execute(line)
    out = buf.getvalue()
    assert "error:" not in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+'", out.split("prefill of")[0], re.MULTILINE)
    assert [int(i) for _, i in rows] == ids
    assert "147 launches [2…148] run by the reference" in out
    logits = s.m.logits()
    assert np.isfinite(logits[:real_nanoqwen.text_vocab]).all()
    assert s.tokens[-1] == int(np.argmax(logits))
    tables = re.findall(r"candidates.*?\n(.*?)\n\n", out, re.DOTALL)
    for table in tables:
        probs = [float(p) for p in re.findall(r"'\s+-?[\d.]+\s+([\d.]+)\s*$", table, re.MULTILINE)]
        assert len(probs) == 5 and sum(probs) <= 1 + 1e-9 and probs == sorted(probs, reverse=True)


def test_src_finds_every_kernel_of_the_step(tiny):
    """`src` shows each launch's kernel file header and the kernel's signature (through the
    macro that defines it where a macro instantiates the kernel)."""
    from drvqwen.cuda.sources import kernel_source
    from drvqwen.step.inspect import signature

    s, repl, buf = _session(tiny)
    for kernel in {e.spec.kernel for e in s.m.entries}:
        sig = signature(kernel_source(kernel.file).text.decode(), kernel.kernel)
        assert sig is not None and "__global__" in sig, kernel
    repl.execute("src L0.attention")
    out = buf.getvalue()
    assert "kernels/attention_decode_tma.cu — attention_decode_tma_hd64" in out
    assert out.count("\n// ") > 5 and "attention_decode_tma_hd64, 64)" in out


def test_show_dequantizes_a_weight_in_its_format(tiny_any):
    """`show L0.q_proj` dequantizes the projection in the format the file holds it in, the
    values the reference computes with (NanoqwenFile.weight)."""
    s, repl, buf = _session(tiny_any)
    assert repl.execute("show L0.q_proj 0,0:4")
    fid = tiny_any.formats["model.layers.0.self_attn.q_proj"]
    out = buf.getvalue()
    if fid == wf.PLAIN:
        assert "model.layers.0.self_attn.q_proj.weight (from the model file)" in out
        return
    fmt = wf.FORMATS[fid].name
    assert f"model.layers.0.self_attn.q_proj dequantized ({fmt} → float32)" in out
    want = tiny_any.weight("model.layers.0.self_attn.q_proj")[0, :4]
    assert s.m.weights.quantized("model.layers.0.self_attn.q_proj.qweight")[0, :4].tobytes() == want.tobytes()
