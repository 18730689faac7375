"""Speculative decoding in `drvqwen serve`: a request's `speculative_lookup`, and the draft
model given at server start (`--draft`, used by default, `speculative_draft` per request)
answer the text the server answers without them (greedy), report llama.cpp's
timings.draft_n / draft_n_accepted, and bad values are 400s naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from serve_helpers import assert_no_page_leaked, write_tiny

pytest.importorskip("starlette")
pytestmark = pytest.mark.usefixtures("private_cache")

PROMPT = "abcabcabcabc abcabcabcabc"
BODY = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    d = tmp_path_factory.mktemp("serve_spec")
    target, draft = write_tiny(d / "tiny.nanoqwen"), write_tiny(d / "draft.nanoqwen", seed=2)
    with BackgroundServer(NanoqwenFile(target), settings=ServerSettings(port=0), random_seed=lambda: 0,
                          draft=NanoqwenFile(draft), draft_max=3) as srv:
        yield srv


def complete(srv, **fields):
    r = httpx.post(srv.url + "/v1/completions", json={**BODY, **fields}, timeout=120)
    return r


def test_speculation_answers_the_plain_text(served):
    plain = complete(served, speculative_draft=0).json()
    by_lookup = complete(served, speculative_lookup=6).json()
    by_draft = complete(served).json()                       # the server's draft model by default
    for r in (by_lookup, by_draft):
        assert r["choices"][0]["text"] == plain["choices"][0]["text"]
        assert r["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert_no_page_leaked(served.url)


def test_infill_timings_count_proposals(served):
    body = {"input_prefix": "abcabcabcabc\n", "prompt": "abcabc", "input_suffix": "\n", "n_predict": 60,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    answers = {}
    for name, extra in (("plain", {"speculative_draft": 0}), ("lookup", {"speculative_lookup": 6}), ("draft", {})):
        r = httpx.post(served.url + "/infill", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        answers[name] = r.json()
    assert "draft_n" not in answers["plain"]["timings"]
    for name in ("lookup", "draft"):
        t = answers[name]["timings"]
        assert answers[name]["content"] == answers["plain"]["content"]
        assert t["draft_n"] >= t["draft_n_accepted"] >= 0 and t["draft_n"] > 0
    assert answers["lookup"]["timings"]["draft_n_accepted"] > 0


def test_stream_and_stop_string_with_lookup(served):
    whole = complete(served, speculative_lookup=8).json()["choices"][0]["text"]
    cut = whole[10:14]
    r = complete(served, speculative_lookup=8, stop=[cut]).json()
    assert r["choices"][0]["text"] == whole[:whole.index(cut)] and r["choices"][0]["finish_reason"] == "stop"
    assert_no_page_leaked(served.url)


@pytest.mark.parametrize("fields,param", [
    ({"speculative_lookup": 16}, "speculative_lookup"),
    ({"speculative_lookup": -1}, "speculative_lookup"),
    ({"speculative_lookup": "4"}, "speculative_lookup"),
    ({"speculative_draft": 99}, "speculative_draft"),
    ({"speculative_lookup": 4, "speculative_draft": 2}, "speculative_lookup"),
])
def test_bad_speculation_fields_are_400(served, fields, param):
    r = complete(served, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_server_without_a_draft_refuses_speculative_draft():
    from drvqwen.server.validate import RequestParser
    from drvqwen.tokenizer import Tokenizer

    from helpers import byte_tokenizer_json

    tok = Tokenizer.from_json(byte_tokenizer_json(), source="test")
    parser = RequestParser(tok, 256, 256 + 3, random_seed=lambda: 0)
    req = parser.parse("completion", {"prompt": "ab", "speculative_lookup": 5})
    assert (req.lookup, req.draft) == (5, 0)
    assert parser.parse("completion", {"prompt": "ab"}).draft == 0
    from drvqwen.server.api_errors import APIError

    with pytest.raises(APIError, match="no draft model"):
        parser.parse("completion", {"prompt": "ab", "speculative_draft": 2})
    with_draft = RequestParser(tok, 256, 256 + 3, random_seed=lambda: 0, draft_max=4)
    assert with_draft.parse("completion", {"prompt": "ab"}).draft == 4
    assert with_draft.parse("completion", {"prompt": "ab", "speculative_lookup": 2}).draft == 0
    assert np.array([with_draft.parse("completion", {"prompt": "ab", "speculative_draft": k}).draft
                     for k in (0, 1, 15)]).tolist() == [0, 1, 15]
