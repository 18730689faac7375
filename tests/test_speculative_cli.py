"""Speculative decoding through the front doors: `run` and `chat` with --lookup and --draft
(the same text as without, the statistics in the stats line and --json-stats), and the
one-line errors for bad values, a missing draft model and a draft of another tokenizer."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from drvqwen.cli import main

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

CFG = dataclasses.replace(TINY, max_position=256)
PROMPT = "abcdefg " * 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_cli")
    dense = random_dense(CFG, np.random.default_rng(7))
    write_model(d / "target.nanoqwen", CFG, dense, tokenizer_json=byte_tokenizer_json())
    write_model(d / "draft.nanoqwen", CFG, random_dense(CFG, np.random.default_rng(8)),
                tokenizer_json=byte_tokenizer_json())
    # The same byte tokenizer without its control tokens: other ids for <|im_start|> …
    write_model(d / "alien.nanoqwen", CFG, dense, tokenizer_json=byte_tokenizer_json(n_control=2))
    return d


def run(capsys, d, *extra):
    rc = main(["run", "--model", str(d / "target.nanoqwen"), "--device", "cpu", "--raw", "-p", PROMPT, "-n", "60",
               "--repeat-penalty", "1.3", "--ignore-eos", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("extra", [["--lookup", "6"], ["--draft", "draft.nanoqwen", "--draft-max", "3"]],
                         ids=["lookup", "draft"])
def test_run_with_speculation_writes_the_plain_text(files, capsys, extra, tmp_path):
    rc, plain, _ = run(capsys, files)
    assert rc == 0
    extra = [str(files / a) if a.endswith(".nanoqwen") else a for a in extra]
    stats = tmp_path / "stats.json"
    rc, text, err = run(capsys, files, *extra, "--json-stats", str(stats))
    assert rc == 0 and text == plain
    spec = json.loads(stats.read_text())["speculation"]
    line = err.strip().splitlines()[-1]
    assert f"{spec['proposed']} proposed, {spec['accepted']} accepted" in line and spec["verify_passes"] > 0
    assert spec["proposer"] == ("prompt lookup" if "--lookup" in extra else "draft model draft.nanoqwen")


BAD = [
    (["--lookup", "0"], "--lookup=0: must be an integer in [1, 15]"),
    (["--lookup", "16"], "--lookup=16: must be an integer in [1, 15]"),
    (["--lookup", "4", "--draft", "{d}/draft.nanoqwen"], "--lookup with --draft: choose one"),
    (["--draft-max", "4"], "--draft-max: only with --draft MODEL"),
    (["--draft", "{d}/draft.nanoqwen", "--draft-max", "99"], "--draft-max=99: must be an integer in [1, 15]"),
    (["--draft", "{d}/missing.nanoqwen"], "{d}/missing.nanoqwen: file not found"),
    (["--draft", "{d}/alien.nanoqwen"], "{d}/alien.nanoqwen: its tokenizer is not the one of {d}/target.nanoqwen"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_speculation_options_are_one_line(files, capsys, extra, message):
    rc, out, err = run(capsys, files, *[a.format(d=files) for a in extra])
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("dequantizing", "running"))]
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: " + message.format(d=files)), lines[0]


def test_chat_with_prompt_lookup_answers_as_without(files, capsys, monkeypatch):
    answers = []
    for extra in ([], ["--lookup", "5"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("abcabcabc\nabcabc again\n"))
        rc = main(["chat", "--model", str(files / "target.nanoqwen"), "--device", "cpu", "-n", "30",
                   "--repeat-penalty", "1.3", *extra])
        out = capsys.readouterr()
        assert rc == 0
        answers.append((out.out, out.err))
    assert answers[1][0] == answers[0][0]
    assert answers[1][1].count("prompt lookup:") == 2 and "prompt lookup:" not in answers[0][1]


@pytest.mark.parametrize("argv,message", [
    (["--draft-max", "3"], "--draft-max: only with --draft MODEL"),
    (["--draft", "{d}/draft.nanoqwen", "--draft-max", "0"], "--draft-max=0: must be an integer in [1, 15]"),
    (["--draft", "{d}/alien.nanoqwen"], "{d}/alien.nanoqwen: its tokenizer is not the one of {d}/target.nanoqwen"),
])
def test_serve_draft_options_are_checked_before_serving(files, capsys, argv, message):
    pytest.importorskip("starlette")
    rc = main(["serve", "--model", str(files / "target.nanoqwen"), "--device", "cpu", "--port", "0",
               *[a.format(d=files) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: " + message.format(d=files)), err


def test_the_target_is_built_to_speculate_exactly_when_asked(files, capsys, monkeypatch):
    """run and chat build the target with speculative=True (on the GPU: the verify pass and the
    decode step it matches) for --lookup and --draft only, never the draft model; serve for its
    --draft. The CPU backend built is the same either way."""
    from drvqwen import loading
    from drvqwen.generate import CPUBackend

    built = []
    real = loading.build_backend

    def recording(f, device, max_context, **kw):
        built.append((f.path.name, kw.get("speculative", False)))
        b = real(f, device, max_context, **kw)
        assert isinstance(b, CPUBackend) and b.verify_implementation == "DecodeVerify.verify"
        return b

    monkeypatch.setattr(loading, "build_backend", recording)
    target, draft = str(files / "target.nanoqwen"), str(files / "draft.nanoqwen")
    for extra, want in (([], [("target.nanoqwen", False)]),
                        (["--lookup", "4"], [("target.nanoqwen", True)]),
                        (["--draft", draft], [("target.nanoqwen", True), ("draft.nanoqwen", False)])):
        built.clear()
        assert main(["run", "--model", target, "--device", "cpu", "--raw", "-p", PROMPT, "-n", "3", *extra]) == 0
        assert built == want, extra
    built.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\n"))
    assert main(["chat", "--model", target, "--device", "cpu", "-n", "3", "--lookup", "2"]) == 0
    assert built == [("target.nanoqwen", True)]
    capsys.readouterr()
    pytest.importorskip("starlette")
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import loader

    for with_draft, want in ((False, [("target.nanoqwen", False)]),
                             (True, [("target.nanoqwen", True), ("draft.nanoqwen", False)])):
        built.clear()
        f, d = NanoqwenFile(target), NanoqwenFile(draft)
        loaded = loader(f, "cpu", 64, draft=d if with_draft else None)()
        assert built == want
        for b in (loaded.backend, loaded.draft):
            if b is not None:
                b.close()
        f.close()
        d.close()
