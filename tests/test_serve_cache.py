"""`drvqwen serve` keeps the last sequence's KV cache and reuses its longest common prefix with
the next request's prompt (llama.cpp's `cache_prompt`), on a tiny model on the CPU.

Replayed as editors send them: llama.vim's ring-buffer warm-up (`n_predict: 0`, which fills the
cache) and /infill requests while a line is typed and after an edit in the middle of the file;
chat requests that carry on a conversation. Each answer is checked against a cold server's (the
same request with `cache_prompt: false` on a second server), and the reuse it reports
(`timings.cache_n`, `tokens_cached`, `usage.prompt_tokens_details.cached_tokens`) against the
ids the test works out itself. A request cancelled or failed mid-generation leaves the cache
holding exactly the ids it says it holds."""

from __future__ import annotations

import httpx
import pytest

from helpers import common_prefix
from serve_helpers import (LLAMA_VIM_FIELDS, assert_no_page_leaked, llama_vim_chunk, llama_vim_fim_body,
                           llama_vim_ring_body, python_source, slow_down, wait_idle, write_tiny)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("private_cache")

COMP = "/v1/completions"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(warm, cold): two servers of the same tiny model; the tests send `cache_prompt: false`
    to the cold one, so that each of its answers is computed from scratch."""
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    path = write_tiny(tmp_path_factory.mktemp("serve") / "tiny.nanoqwen")
    with BackgroundServer(NanoqwenFile(path), settings=ServerSettings(port=0), random_seed=lambda: 0) as warm:
        with BackgroundServer(NanoqwenFile(path), settings=ServerSettings(port=0), random_seed=lambda: 0) as cold:
            yield warm, cold


def post(srv, route: str, body: dict) -> dict:
    r = httpx.post(srv.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cold_answer(cold, route: str, body: dict) -> dict:
    got = post(cold, route, {**body, "cache_prompt": False, "response_fields": None})
    if route == "/infill":
        assert got["timings"]["cache_n"] == 0 and got["timings"]["prompt_n"] == got["tokens_evaluated"]
    else:
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return got


def cached_ids(srv) -> list[int]:
    """The ids whose K/V the server's cache holds, once it is idle."""
    wait_idle(srv.worker)
    return srv.worker.model.backend.cached_ids()


def assert_consistent(srv) -> None:
    """/health's tokens_cached is the length of cached_ids(), the KV pages in use hold those
    positions and no more, and the reference's cache holds as many positions."""
    ids = cached_ids(srv)
    assert assert_no_page_leaked(srv.url)["tokens_cached"] == len(ids)
    assert srv.worker.model.backend.model.cache.seq_len == len(ids)


def test_llama_vim_session_prefills_only_what_changed(servers):
    warm, cold = servers
    parse = warm.parser.parse
    chunks = [llama_vim_chunk(python_source(12)[i:i + 6], f"lib_{i}.py") for i in (0, 5)]
    # The ring-buffer warm-up: nothing generated, its whole prompt now in the cache.
    ring = llama_vim_ring_body(chunks)
    assert post(warm, "/infill", ring) == {}
    ring_ids = parse("infill", ring).prompt_ids
    assert cached_ids(warm) == ring_ids
    assert_consistent(warm)
    # Typing line 14, a few characters more each request, then an edit far above the cursor.
    lines = python_source(24)
    at = 14
    typed = lines[at - 1]
    bodies = []
    for k in (5, 7, 10, 13, len(typed)):
        buf = lines[:at - 1] + [typed[:k]] + lines[at:]
        bodies.append(("typing", llama_vim_fim_body(buf, at, k, chunks, n_predict=16, t_max_predict_ms=0)))
    edited = lines[:3] + [lines[3].replace("x - 1", "x - 2")] + lines[4:]
    assert edited != lines
    bodies.append(("edit", llama_vim_fim_body(edited, at, len(typed), chunks, n_predict=16, t_max_predict_ms=0)))
    prev = ring_ids
    for what, body in bodies:
        ids = parse("infill", body).prompt_ids
        reused = common_prefix(prev, ids)
        got = post(warm, "/infill", body)
        assert set(got) == set(LLAMA_VIM_FIELDS)
        assert got["timings/prompt_n"] == len(ids) - reused, what
        assert got["tokens_cached"] == len(cached_ids(warm))
        assert_consistent(warm)
        want = cold_answer(cold, "/infill", body)
        assert got["content"] == want["content"], what
        assert want["tokens_cached"] == len(cached_ids(cold))
        if prev is ring_ids:        # the extra chunks and <|fim_prefix|> came from the warm-up
            assert reused == len(ring_ids) - 2
        elif what == "typing":      # only the cursor's line from the old cursor on, and the suffix
            assert got["timings/prompt_n"] <= len(body["prompt"]) + len(body["input_suffix"]) + 2
        else:                       # from the edited line on
            assert reused == len(ring_ids) - 2 + len("\n".join(lines[:3]) + "\n" + lines[3].split(" - ")[0]) + 3
        prev = ids


def test_a_conversation_that_goes_on_prefills_only_the_new_turn(servers):
    warm, cold = servers
    wc = openai.OpenAI(base_url=warm.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cc = openai.OpenAI(base_url=cold.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that adds two numbers."}]
    kw = dict(model="m", max_tokens=12, temperature=0.7, seed=3)
    prev_ids = None
    for turn, next_message in enumerate(["Now make it subtract.", "And multiply.", "Thanks."]):
        ids = warm.parser.parse("chat", {"messages": msgs}).prompt_ids
        want_reused = common_prefix(cached_ids(warm), ids)
        want = cc.chat.completions.create(messages=msgs, extra_body={"cache_prompt": False}, **kw)
        if turn < 2:
            r = wc.chat.completions.create(messages=msgs, **kw)
            text, usage = r.choices[0].message.content, r.usage
        else:                       # streamed: the usage chunk says it too
            chunks = list(wc.chat.completions.create(messages=msgs, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        assert text == want.choices[0].message.content
        assert want.usage.prompt_tokens_details.cached_tokens == 0
        assert usage.prompt_tokens == len(ids)
        assert usage.prompt_tokens_details.cached_tokens == want_reused
        if prev_ids is not None:    # the whole previous prompt, and its answer as far as it matches
            assert ids[:len(prev_ids)] == prev_ids and want_reused >= len(prev_ids)
        assert_consistent(warm)
        prev_ids = ids
        msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": next_message}]


def test_cache_prompt_false_prefills_the_whole_prompt(servers):
    warm, _ = servers
    body = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
    first = post(warm, COMP, body)
    again = post(warm, COMP, body)
    n = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    opted_out = post(warm, COMP, {**body, "cache_prompt": False})
    assert opted_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == opted_out["choices"][0]["text"]
    fim = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4, "temperature": 0}
    post(warm, "/infill", fim)
    got = post(warm, "/infill", {**fim, "cache_prompt": False})
    assert got["timings"]["cache_n"] == 0 and got["timings"]["prompt_n"] == got["tokens_evaluated"]
    assert_consistent(warm)
    r = httpx.post(warm.url + COMP, json={**body, "cache_prompt": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_prompt"


def test_a_request_cancelled_mid_generation_leaves_the_cache_consistent(servers):
    warm, cold = servers
    prompt = list(range(40, 90))
    undo = slow_down(warm.worker, 0.01)
    try:
        body = {"prompt": prompt, "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", warm.url + COMP, json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
        cached = cached_ids(warm)
    finally:
        undo()
    assert cached[:len(prompt)] == prompt and len(prompt) < len(cached) < len(prompt) + 200
    assert_consistent(warm)
    # Carrying on from where it was cut: all of it is reused, and the answer is a cold one's.
    cont = {"prompt": cached + [7, 8, 9], "max_tokens": 8, "temperature": 0}
    got = post(warm, COMP, cont)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(cached)
    assert got["choices"][0]["text"] == cold_answer(cold, COMP, cont)["choices"][0]["text"]
    assert_consistent(warm)


def test_a_failed_generation_leaves_the_cache_consistent(servers):
    warm, cold = servers
    backend = warm.worker.model.backend
    decode, calls = backend.decode, []

    def failing(token):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return decode(token)

    body = {"prompt": "def sub(a, b):", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    backend.decode = failing
    try:
        r = httpx.post(warm.url + COMP, json=body, timeout=60)
    finally:
        backend.decode = decode
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert_consistent(warm)
    cached = cached_ids(warm)
    got = post(warm, COMP, body)
    ids = warm.parser.parse("completion", body).prompt_ids
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == common_prefix(cached, ids)
    assert got["choices"][0]["text"] == cold_answer(cold, COMP, body)["choices"][0]["text"]
    assert_consistent(warm)
