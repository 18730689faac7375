"""`drvqwen serve` for editors: the /infill bodies llama.vim sends (autoload/llama.vim: `llama#fim`
and the ring-buffer warm-up), replayed on a tiny model on the CPU, read as llama.cpp's server
reads them — `prompt` is the end of the prefix, `n_predict: 0` generates nothing, a prompt too
long for the context is trimmed (extra chunks first, then the prefix from the left and the
suffix from the right), `n_indent`, `t_max_predict_ms` and `response_fields` act, and the answer
carries `timings`, `tokens_cached` and `truncated`. Also `GET /v1/models/{id}`, and every
OpenAI response and stream chunk checked against the `openai` package's own types."""

from __future__ import annotations

import json
from typing import Literal, Optional

import httpx
import pytest

from serve_helpers import (LLAMA_VIM_FIELDS, llama_vim_chunk, llama_vim_fim_body, llama_vim_ring_body,
                           python_source, run_text, script_answer, wait_idle, write_tiny)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("private_cache")

CTX = 1024                      # the tiny model's context (max_position)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    path = write_tiny(tmp_path_factory.mktemp("serve") / "tiny.nanoqwen")
    with BackgroundServer(NanoqwenFile(path), settings=ServerSettings(port=0), random_seed=lambda: 0) as srv:
        srv.model_path = path
        assert srv.parser.max_context == CTX
        yield srv


def infill(served, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/infill", json=body, timeout=120)


def fim_parts(tok, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(what precedes <|fim_prefix|>, the prefix, the suffix) of a FIM prompt's ids."""
    pre, suf, mid = (tok.control_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert ids[-1] == mid and ids.count(pre) == ids.count(suf) == 1
    i, j = ids.index(pre), ids.index(suf)
    return ids[:i], ids[i + 1:j], ids[j + 1:-1]


# ---- 1. `prompt` -----------------------------------------------------------------------------------

def test_prompt_is_the_end_of_the_prefix(served, capsys):
    """llama.vim sends the current line left of the cursor as `prompt`: it continues the prefix,
    before <|fim_suffix|>, exactly as if it were the end of input_prefix."""
    lines = ["def add(a, b):", "    return a + b", "", "", "print(add(1, 2)) # adds", "x = add(3, 4)"]
    body = llama_vim_fim_body(lines, 5, 10, n_predict=24)
    assert body["prompt"] == "print(add(" and body["n_indent"] == 0
    want = run_text(capsys, served.model_path, "--fim-prefix", body["input_prefix"] + body["prompt"],
                    "--fim-suffix", body["input_suffix"], "--max-new-tokens", "24", "--temperature", "1",
                    "--top-k", "40", "--top-p", "0.9", "--seed", "0")
    r = infill(served, {**body, "response_fields": []})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == want
    assert r.json()["tokens_evaluated"] == len(served.parser.tok.fim(body["input_prefix"] + body["prompt"],
                                                                     body["input_suffix"]))
    # The same split anywhere gives the same prompt ids.
    ids = served.parser.parse("infill", body).prompt_ids
    for cut in (0, 3, len(body["input_prefix"])):
        whole = body["input_prefix"] + body["prompt"]
        other = served.parser.parse("infill", {**body, "input_prefix": whole[:cut], "prompt": whole[cut:]})
        assert other.prompt_ids == ids


# ---- 2. `n_predict: 0` -----------------------------------------------------------------------------

def test_ring_buffer_warm_up_generates_nothing(served):
    chunks = [llama_vim_chunk(python_source(8), f"lib_{i}.py") for i in range(3)]
    gen0 = served.worker.metrics.generated_tokens._value.get()
    r = infill(served, llama_vim_ring_body(chunks))
    assert r.status_code == 200, r.text
    assert r.json() == {}                            # response_fields [""] names no field
    body = {**llama_vim_ring_body(chunks), "response_fields": None}
    r = infill(served, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == "" and got["tokens_predicted"] == 0 and got["stop"] is True
    assert got["tokens_evaluated"] == len(served.parser.parse("infill", body).prompt_ids)
    assert served.worker.metrics.generated_tokens._value.get() == gen0
    with httpx.stream("POST", served.url + "/infill", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == "" and events[-1]["stop"] is True
    # OpenAI's routes keep their rule: at least one token.
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ---- 3. a prompt too long for the context ---------------------------------------------------------

def test_a_400_line_file_is_trimmed_not_refused(served):
    tok = served.parser.tok
    lines = python_source(400)
    chunks = [llama_vim_chunk(python_source(64), f"mod_{i}.py") for i in range(16)]
    body = llama_vim_fim_body(lines, 300, 4, chunks)
    full_pre, full_suf = tok.encode(body["input_prefix"] + body["prompt"]), tok.encode(body["input_suffix"])
    assert len(full_pre) > CTX and len(full_suf) > CTX // 4
    r = infill(served, {**body, "response_fields": None, "t_max_predict_ms": 0})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["truncated"] is True and got["tokens_evaluated"] + got["tokens_predicted"] <= CTX
    assert got["truncated_input"]["input_extra"] == 16
    assert got["truncated_input"]["input_prefix"] > 0 and got["truncated_input"]["input_suffix"] > 0
    ids = served.parser.parse("infill", body).prompt_ids
    assert len(ids) == got["tokens_evaluated"] == CTX - 128       # n_predict keeps its room
    head, pre, suf = fim_parts(tok, ids)
    assert head == []                                             # every extra chunk dropped
    assert pre == full_pre[len(full_pre) - len(pre):]             # the prefix cut from the left
    assert suf == full_suf[:len(suf)]                             # the suffix from the right
    assert abs(len(pre) - 3 * len(suf)) <= 4                      # to their 3:1 shares
    assert got["truncated_input"]["input_prefix"] == len(full_pre) - len(pre)
    assert got["truncated_input"]["input_suffix"] == len(full_suf) - len(suf)
    # llama.vim asks for its fields only.
    r = infill(served, body)
    assert r.status_code == 200 and set(r.json()) == set(LLAMA_VIM_FIELDS) and r.json()["truncated"] is True


def test_extra_chunks_are_dropped_first_oldest_first(served):
    tok = served.parser.tok
    lines = python_source(12)
    chunks = [llama_vim_chunk(python_source(4), f"mod_{i}.py") for i in range(16)]
    body = llama_vim_fim_body(lines, 8, 4, chunks)
    req = served.parser.parse("infill", body)
    ids = req.prompt_ids
    assert len(ids) <= CTX - 128
    head, pre, suf = fim_parts(tok, ids)
    assert pre == tok.encode(body["input_prefix"] + body["prompt"]) and suf == tok.encode(body["input_suffix"])
    text = tok.decode(head)
    kept = [i for i in range(16) if f"<|file_sep|>mod_{i}.py\n" in text]
    assert 0 < len(kept) < 16 and kept == list(range(16 - len(kept), 16))
    # What is kept is the repository-level prompt of the chunks kept.
    from drvqwen.server.prompts import infill_ids

    extra = [(c["filename"], c["text"]) for c in chunks[16 - len(kept):]]
    assert ids == infill_ids(tok, body["input_prefix"] + body["prompt"], body["input_suffix"], extra)
    r = infill(served, {**body, "response_fields": ["truncated", "truncated_input"]})
    assert r.json() == {"truncated": True, "truncated_input": {"input_extra": 16 - len(kept), "input_prefix": 0,
                                                                 "input_suffix": 0}}


def test_a_prompt_that_fits_but_leaves_less_than_n_predict(served):
    tok = served.parser.tok
    body = llama_vim_fim_body(python_source(50), 48, 4, t_max_predict_ms=0)
    n = len(tok.fim(body["input_prefix"] + body["prompt"], body["input_suffix"]))
    assert CTX - 128 < n < CTX                                    # fits, but not with 128 more
    r = infill(served, {**body, "response_fields": None})
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] is True and r.json()["tokens_evaluated"] == CTX - 128


def test_generation_stops_at_the_end_of_the_context(served):
    r = infill(served, {"input_prefix": "def f(", "input_suffix": "", "n_predict": 5000, "temperature": 0,
                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens_evaluated"] + got["tokens_predicted"] == CTX
    assert got["truncated"] is True and got["stop_type"] == "limit" and got["finish_reason"] == "length"


# ---- 4. llama.vim's controls, timings ---------------------------------------------------------------

INDENTED = ["import sys", "", "def add(a, b):", "    total = a + b", "    x = ", "", "def main():", "    pass"]
# What a model writes at the cursor of INDENTED's line 5: the rest of the block, then more blocks.
ANSWER = ("total * 2\n\n    return x\n\ndef main():\n    print(add(1, 2))\n\n"
          "if __name__ == \"__main__\":\n    main()\n")


def test_n_indent_keeps_the_suggestion_in_its_block(served):
    body = llama_vim_fim_body(INDENTED, 5, 8)
    assert body["n_indent"] == 4 and body["prompt"] == "    x = "
    undo = script_answer(served.worker, ANSWER)
    try:
        r = infill(served, {**body, "response_fields": None})
        with httpx.stream("POST", served.url + "/infill", json={**body, "stream": True, "response_fields": None},
                          timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        wide = infill(served, {**body, "n_indent": 0, "response_fields": ["content"]})
    finally:
        undo()
    assert r.status_code == 200, r.text
    # The block's lines stay, blank ones inside it too; the first line under 4 columns ends it.
    assert r.json()["content"] == "total * 2\n\n    return x\n"
    assert r.json()["stop_type"] == "limit" and r.json()["tokens_predicted"] < len(ANSWER)
    assert "".join(e["content"] for e in events) == r.json()["content"] and events[-1]["stop"] is True
    assert wide.json()["content"] == ANSWER


def test_t_max_predict_ms_returns_what_is_written_by_then_at_a_line_end(served):
    answer = "".join(f"    x{i} = step_{i}(x{i - 1}, 1)\n" for i in range(1, 60))
    undo = script_answer(served.worker, answer, delay_s=0.005)
    try:
        r = infill(served, {"input_prefix": "def f(x0):\n", "input_suffix": "", "n_predict": 2000,
                            "t_max_predict_ms": 300})
    finally:
        undo()
    got = r.json()
    assert r.status_code == 200 and got["stop_type"] == "limit"
    assert got["content"].endswith("\n") and answer.startswith(got["content"]) and got["content"] != answer
    assert got["timings"]["predicted_ms"] >= 300


def test_timings_tokens_cached_and_response_fields(served):
    body = llama_vim_fim_body(python_source(30), 20, 4, n_predict=16, t_max_predict_ms=0)
    r = infill(served, {**body, "response_fields": None})
    assert r.status_code == 200, r.text
    got = r.json()
    t = got["timings"]
    assert t["predicted_n"] == got["tokens_predicted"] > 0
    assert t["prompt_n"] + t["cache_n"] == got["tokens_evaluated"]
    assert t["prompt_ms"] > 0 and t["prompt_per_second"] > 0
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    if t["predicted_n"] > 1:
        assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    # llama.cpp's n_past: what the KV cache holds now, the prompt and the answer's tokens run.
    wait_idle(served.worker)
    cached = served.worker.model.backend.cached_ids()
    assert got["tokens_cached"] == len(cached)
    assert got["tokens_evaluated"] <= len(cached) <= got["tokens_evaluated"] + got["tokens_predicted"]
    assert got["truncated"] is False
    # llama.vim's own list of fields: those and only those, nested ones under "timings/…". The
    # same request again: all of its prompt but the last token comes from the KV cache.
    r = infill(served, body)
    fields = r.json()
    assert set(fields) == set(LLAMA_VIM_FIELDS)
    assert fields["timings/prompt_n"] == 1
    wait_idle(served.worker)
    assert fields["tokens_cached"] == len(served.worker.model.backend.cached_ids())
    assert isinstance(fields["content"], str) and fields["truncated"] is False
    r = infill(served, {**body, "response_fields": ["timings/nothing", "content/x", "tokens_evaluated"]})
    assert r.json() == {"tokens_evaluated": got["tokens_evaluated"]}


def test_bad_editor_fields_are_400_naming_them(served):
    for field, value in (("n_indent", "4"), ("t_max_predict_ms", 1.5), ("response_fields", "content"),
                         ("response_fields", [1]), ("prompt", 3), ("n_predict", -2)):
        r = infill(served, {"input_prefix": "a", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), (field, r.text)


# ---- 5. GET /v1/models/{id} ------------------------------------------------------------------------

def test_models_retrieve(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    m = client.models.retrieve("drvqwen")
    assert m.id == "drvqwen" and m.object == "model"
    openai.types.Model.model_validate(httpx.get(served.url + "/v1/models/drvqwen").json())
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]


# ---- every answer is what the openai package says it is ---------------------------------------------

def _relaxed_completion_chunk():
    """openai's Completion with a null finish_reason allowed: the OpenAI API itself streams
    legacy-completion chunks with `"finish_reason": null` until the last one, though the
    package types the field as required."""
    from openai.types import Completion, CompletionChoice

    class StreamedChoice(CompletionChoice):
        finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None

    class StreamedCompletion(Completion):
        choices: list[StreamedChoice]

    return StreamedCompletion


def _events(served, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served.url + route, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_every_response_and_chunk_validates_against_openai_types(served):
    from openai.types import Completion, CompletionUsage, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    msgs = [{"role": "user", "content": "hello"}]
    for extra in ({}, {"stop": ["a"]}, {"max_tokens": 1}):
        body = {"messages": msgs, "max_tokens": 8, "temperature": 0, **extra}
        ChatCompletion.model_validate(httpx.post(served.url + "/v1/chat/completions", json=body).json())
        chunks = _events(served, "/v1/chat/completions", {**body, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
        assert chunks[-1]["choices"] == [] and CompletionUsage.model_validate(chunks[-1]["usage"])
        body = {"prompt": "def f(", "max_tokens": 8, "temperature": 0, **extra}
        Completion.model_validate(httpx.post(served.url + "/v1/completions", json=body).json())
        chunks = _events(served, "/v1/completions", {**body, "stream": True})
        relaxed = _relaxed_completion_chunk()
        for c in chunks[:-1]:
            relaxed.model_validate(c)
        Completion.model_validate(chunks[-1])                    # the last one says why it ended
    for m in httpx.get(served.url + "/v1/models").json()["data"]:
        Model.model_validate(m)
    wait_idle(served.worker)
