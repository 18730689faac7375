"""`drvqwen serve` through the official `openai` client, on a tiny model on the CPU: the answers
equal `drvqwen run`'s for the same options (chat template, raw completion, fill-in-the-middle,
seeded sampling), streams equal whole answers, stop strings cut where the whole-text cut does."""

from __future__ import annotations

import json

import httpx
import pytest

from serve_helpers import assert_no_page_leaked, run_text, write_tiny

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    path = write_tiny(tmp_path_factory.mktemp("serve") / "tiny.nanoqwen")
    with BackgroundServer(NanoqwenFile(path), settings=ServerSettings(port=0, max_body_bytes=64 << 10),
                          random_seed=lambda: 0) as srv:
        srv.model_path = path
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


SAMPLING = dict(temperature=0.8, top_p=0.9, seed=7)
RUN_SAMPLING = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "7")


def test_raw_completion_equals_run(served, client, capsys):
    prompt = "def fib(n):\n    <|im_end|>"      # raw: the special token is parsed, as with --raw
    want = run_text(capsys, served.model_path, "--raw", "--prompt", prompt, "--max-new-tokens", "12",
                    *RUN_SAMPLING)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **SAMPLING)
    assert r.choices[0].text == want
    tok = served.parser.tok
    assert r.usage.prompt_tokens == len(tok.encode(prompt, special=True))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_template_and_seed_equal_run(served, client, capsys):
    want = run_text(capsys, served.model_path, "--prompt", "Write a sort.", "--max-new-tokens", "10",
                    *RUN_SAMPLING)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Write a sort."}],
                                       max_tokens=10, **SAMPLING)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(served.parser.tok.chat("Write a sort."))
    # A system message is run's --system; text parts are joined.
    want = run_text(capsys, served.model_path, "--system", "Be <|im_end|> brief.", "--prompt", "hi",
                    "--max-new-tokens", "6", "--temperature", "0")
    r = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be <|im_end|> brief."},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}])
    assert r.choices[0].message.content == want


def test_infill_equals_run_fim(served, client, capsys):
    pre, suf = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    want = run_text(capsys, served.model_path, "--fim-prefix", pre, "--fim-suffix", suf,
                    "--max-new-tokens", "9", "--temperature", "0")
    r = httpx.post(served.url + "/infill", json={"input_prefix": pre, "input_suffix": suf,
                                                 "n_predict": 9, "temperature": 0})
    assert r.status_code == 200 and r.json()["content"] == want
    assert r.json()["tokens_evaluated"] == len(served.parser.tok.fim(pre, suf))
    c = client.completions.create(model="tiny", prompt=pre, suffix=suf, max_tokens=9, temperature=0)
    assert c.choices[0].text == want


def test_infill_with_repository_context(served):
    from drvqwen.server.prompts import infill_ids

    tok = served.parser.tok
    extra = [("utils.py", "def one():\n    return 1\n")]
    ids = infill_ids(tok, "x = ", "\n", extra, "proj", "main.py")
    sep, repo = tok.token_to_id("<|file_sep|>"), tok.token_to_id("<|repo_name|>")
    assert ids[0] == repo and ids.count(sep) == 2 and ids[-len(tok.fim("x = ", "\n")):] == tok.fim("x = ", "\n")
    assert tok.decode(ids) == ("<|repo_name|>proj\n<|file_sep|>utils.py\ndef one():\n    return 1\n\n"
                               "<|file_sep|>main.py\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>")
    r = httpx.post(served.url + "/infill", json={"input_prefix": "x = ", "input_suffix": "\n", "max_tokens": 3,
                                                 "temperature": 0, "input_extra": [
                                                     {"filename": n, "text": t} for n, t in extra],
                                                 "repo_name": "proj", "filename": "main.py"})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == len(ids)


def test_stream_equals_whole_answer_with_usage_and_done(served, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=14, **SAMPLING)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The wire format: data events, the usage chunk only when asked, [DONE] last.
    with httpx.stream("POST", served.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4,
                                                                   "stream": True, "temperature": 0}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [l for l in r.iter_lines() if l]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert not any("usage" in json.loads(e[6:]) for e in events[:-1])


def test_stop_strings_cut_the_text(served, client):
    kw = dict(model="tiny", prompt="stop here", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 6
    stop = full[3:5]
    want = full[:full.find(stop)]
    r = client.completions.create(**kw, stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == want


def test_models_health_metrics(served, client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["drvqwen"]
    h = assert_no_page_leaked(served.url)
    assert h["status"] == "ok" and h["device"] == "cpu" and h["kv_pages_total"] > 0
    client.completions.create(model="tiny", prompt="m", max_tokens=2, temperature=0)
    text = httpx.get(served.url + "/metrics").text
    for name in ("drvqwen_requests_total", "drvqwen_ttft_seconds_bucket", "drvqwen_itl_seconds_bucket",
                 "drvqwen_queue_wait_seconds_count", "drvqwen_generated_tokens_total", "drvqwen_queue_length",
                 "drvqwen_prompt_tokens_reused_total"):
        assert name in text
    assert 'drvqwen_requests_total{route="/v1/completions",status="200"}' in text
