"""What a client can get wrong, and what a client can do to the server: every bad request is a 4xx
OpenAI-style error naming the field; a wrong key is 401; a full queue is 503 with Retry-After; a
client that goes away mid-stream (or mid-wait) stops its generation within a step, and no KV page
stays held but those of the sequence the server keeps cached."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from serve_helpers import assert_no_page_leaked, slow_down, wait_idle, write_tiny

openai = pytest.importorskip("openai")

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from drvqwen.format.nanoqwen import NanoqwenFile

    return NanoqwenFile(write_tiny(tmp_path_factory.mktemp("serve") / "tiny.nanoqwen"))


@pytest.fixture(scope="module")
def served(model):
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    with BackgroundServer(model, settings=ServerSettings(port=0, max_body_bytes=LIMIT, queue_size=1)) as srv:
        yield srv


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [  # (route, body, status, param, words in the message)
    (CHAT, b"{bad json", 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "must be a JSON object, got [1, 2]"),
    (CHAT, b"null", 400, None, "must be a JSON object, got null"),  # JSON's names, not Python's
    (CHAT, b'"\\ud800"', 400, None, 'got "\\ud800"'),    # a lone surrogate shown escaped: still a 400
    (COMP, b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    (COMP, b'{"prompt": "\\ud800"}', 400, "prompt", "surrogate"),
    (COMP, b"[" * 5000 + b"]" * 5000, 400, None, "nested"),
    (CHAT, {"messages": "hi"}, 400, "messages", "list"),
    (CHAT, {"messages": []}, 400, "messages", "non-empty"),
    (CHAT, {}, 400, "messages", "non-empty"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", "string, got null"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", "text"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "number"),
    (CHAT, {"messages": MSG, "temperature": 9}, 400, "temperature", "outside"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", "outside"),
    (CHAT, {"messages": MSG, "top_k": -1}, 400, "top_k", "outside"),
    (CHAT, {"messages": MSG, "seed": 1.5}, 400, "seed", "integer"),
    (CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens", "integer"),
    (CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens", "integer"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "outside"),
    (CHAT, {"messages": MSG, "max_tokens": 10**12}, 400, "max_tokens", "exceed the context"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "exceed"),
    (CHAT, {"messages": MSG, "n": 2}, 400, "n", "n = 1"),
    (CHAT, {"messages": MSG, "n": "x" * 200}, 400, "n", '"' + "x" * 78 + "…: drvqwen generates one"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "true or false"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (CHAT, {"messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "true or false"),       # a nested field by its whole path
    (CHAT, {"messages": MSG, "stop": [1]}, 400, "stop[0]", "string"),
    (CHAT, {"messages": MSG, "stop": ""}, 400, "stop", "characters"),
    (CHAT, {"messages": MSG, "stop": ["a"] * 40}, 400, "stop", "at most"),
    (CHAT, {"messages": MSG, "logprobs": True}, 400, "logprobs", "true is not supported"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools",
     '[{"type": "function"}] is not supported'),             # the value as JSON, not a Python repr
    (CHAT, {"messages": MSG, "model": 5}, 400, "model", "string"),
    (COMP, {"prompt": "x" * 2000}, 400, "prompt", "context"),
    (COMP, {"prompt": "x" * 1000, "max_tokens": 100}, 400, "max_tokens", "at most 24"),
    (COMP, {"prompt": ""}, 400, "prompt", "empty"),
    (COMP, {"prompt": []}, 400, "prompt", "empty"),           # no token ids is an empty prompt
    (COMP, {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    (COMP, {"prompt": [1, 600]}, 400, "prompt", "text vocabulary"),
    (COMP, {"prompt": {"x": 1}}, 400, "prompt", "string"),
    (COMP, {"prompt": "x", "suffix": 3}, 400, "suffix", "string"),
    (COMP, {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
    ("/infill", {"input_prefix": 1}, 400, "input_prefix", "string"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": "f", "text": 2}]}, 400,
     "input_extra[0].text", "string"),
    (COMP, b'{"prompt": "' + b"x" * LIMIT + b'"}', 413, None, "limit"),
]


@pytest.mark.parametrize("route,body,status,param,words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_4xx_naming_the_field(served, route, body, status, param, words):
    json_bytes = {"content": body, "headers": {"Content-Type": "application/json"}}
    kw = json_bytes if isinstance(body, bytes) else {"json": body}
    r = httpx.post(served.url + route, **kw, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    if param:
        assert err["message"].startswith(param)


def test_routes_and_methods(served):
    r = httpx.get(served.url + CHAT)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # Requests are counted by route, not by path: made-up paths and ids add no series.
    for i in range(3):
        httpx.get(served.url + f"/v1/models/made-up-{i}")
        httpx.get(served.url + f"/made/up/{i}")
    text = httpx.get(served.url + "/metrics").text
    assert "made-up" not in text and "/made/up" not in text
    assert 'drvqwen_requests_total{route="/v1/models/{model_id:path}",status="404"} 3.0' in text


def test_the_server_still_answers_after_bad_requests(served):
    r = httpx.post(served.url + COMP, json={"prompt": "ok", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 0


def test_api_key(model):
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    with BackgroundServer(model, settings=ServerSettings(port=0, api_key="s3cret"), warmup=False) as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="m", prompt="x", max_tokens=2)
        for route in ("/v1/models", "/metrics"):
            r = httpx.get(srv.url + route)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.url + COMP, json={"prompt": "x"}, headers={"Authorization": "Basic s3cret"})
        assert r.status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200     # for load balancers
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="m", prompt="x", max_tokens=2, temperature=0).choices


def _pages(srv) -> tuple[int, int]:
    h = httpx.get(srv.url + "/health").json()
    return h["kv_pages_free"], h["kv_pages_total"]


def test_disconnect_mid_stream_stops_within_a_step_and_leaks_no_page(served):
    worker = served.worker
    total = assert_no_page_leaked(served.url)["kv_pages_total"]
    undo = slow_down(worker, 0.005)       # 900 tokens would take 4.5 s
    try:
        gen0, cancelled0 = worker.metrics.generated_tokens._value.get(), worker.metrics.cancelled._value.get()
        body = {"prompt": "abc", "max_tokens": 900, "stream": True, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", served.url + COMP, json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    assert worker.busy and _pages(served)[0] < total    # it holds pages now
                    break
        t0 = time.monotonic()
        wait_idle(worker)
        stopped_s = time.monotonic() - t0
        generated = worker.metrics.generated_tokens._value.get() - gen0
        assert worker.metrics.cancelled._value.get() == cancelled0 + 1
        assert generated < 100 and stopped_s < 2.0, (generated, stopped_s)
        n_prompt = len(served.parser.parse("completion", body).prompt_ids)
        assert assert_no_page_leaked(served.url)["tokens_cached"] <= n_prompt + generated
        # A client waiting for a whole answer that gives up is cancelled too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + COMP, json={**body, "stream": False}, timeout=0.3)
        wait_idle(worker)
        assert worker.metrics.cancelled._value.get() == cancelled0 + 2
        assert_no_page_leaked(served.url)
    finally:
        undo()


def test_full_queue_is_503_with_retry_after(served):
    worker = served.worker
    undo = slow_down(worker, 0.005)
    body = {"prompt": "abc", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    waiting = threading.Thread(target=lambda: httpx.post(served.url + COMP, json={**body, "max_tokens": 2},
                                                          timeout=60))
    try:
        with httpx.stream("POST", served.url + COMP, json={**body, "stream": True}) as running:
            lines = running.iter_lines()               # kept: a dropped iterator closes the response
            next(lines)                                # generating now
            waiting.start()                            # fills the queue of one
            end = time.monotonic() + 10
            while worker.queue_length() < 1:
                assert time.monotonic() < end
                time.sleep(0.005)
            r = httpx.post(served.url + COMP, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
    finally:
        undo()
        waiting.join()
        wait_idle(worker)
    assert_no_page_leaked(served.url)


# ---- what a web page may not do: a loopback server answers only its user's own clients ---------------

BODY = b'{"prompt": "x", "max_tokens": 2, "temperature": 0}'


def test_only_json_bodies_are_read(served):
    """A body that is not declared JSON is 415 before it is read: a web page can POST
    text/plain, form or multipart bodies cross-origin without a CORS preflight."""
    gen0 = served.worker.metrics.generated_tokens._value.get()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/jsonx", "text/json", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        for route in (COMP, CHAT, "/infill"):
            r = httpx.post(served.url + route, content=BODY, headers=headers)
            assert r.status_code == 415, (ctype, route, r.text)
            err = r.json()["error"]
            assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert served.worker.metrics.generated_tokens._value.get() == gen0
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        r = httpx.post(served.url + COMP, content=BODY, headers={"Content-Type": ctype})
        assert r.status_code == 200, (ctype, r.text)


def test_a_foreign_host_is_403(served):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 reaches the
    server with its own name in Host. Only loopback names (and the bound address) are served."""
    port = served.url.rsplit(":", 1)[1]
    gen0 = served.worker.metrics.generated_tokens._value.get()
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example",
                 "0.0.0.0", f"0.0.0.0:{port}", "[::]", "127.0.0.2", ""):
        for method, route in (("POST", COMP), ("POST", "/infill"), ("GET", "/health"), ("GET", "/v1/models"),
                              ("GET", "/metrics"), ("GET", "/nothing")):
            r = httpx.request(method, served.url + route, content=BODY if method == "POST" else None,
                              headers={"Host": host, "Content-Type": "text/plain"})
            assert r.status_code == 403, (host, route, r.text)
            err = r.json()["error"]
            assert err["code"] == "forbidden_host" and err["type"] == "permission_error"
            assert "--allowed-hosts" in err["message"]
    assert served.worker.metrics.generated_tokens._value.get() == gen0
    for host in ("localhost", f"localhost:{port}", "LocalHost.", "127.0.0.1", f"127.0.0.1:{port}", "[::1]",
                 f"[::1]:{port}"):
        r = httpx.post(served.url + COMP, content=BODY, headers={"Host": host, "Content-Type": "application/json"})
        assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_and_a_key_on_a_non_loopback_bind(model):
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    headers = {"Content-Type": "application/json"}
    with BackgroundServer(model, settings=ServerSettings(port=0, allowed_hosts=("box.lan", "10.1.2.3")),
                          warmup=False) as srv:
        for host, status in (("box.lan", 200), ("BOX.LAN:8000", 200), ("10.1.2.3", 200), ("evil.example", 403),
                             ("localhost", 200)):
            r = httpx.post(srv.url + COMP, content=BODY, headers={**headers, "Host": host})
            assert r.status_code == status, (host, r.text)
    # On every interface with a key: the key guards it, whatever name a client uses.
    with BackgroundServer(model, settings=ServerSettings(host="0.0.0.0", port=0, api_key="k"), warmup=False) as srv:
        url = srv.url.replace("0.0.0.0", "127.0.0.1")
        r = httpx.post(url + COMP, content=BODY, headers={**headers, "Host": "gpu-box.lan"})
        assert r.status_code == 401
        r = httpx.post(url + COMP, content=BODY, headers={**headers, "Host": "gpu-box.lan",
                                                          "Authorization": "Bearer k"})
        assert r.status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_non_loopback_bind_needs_allowed_hosts_or_a_key(model, host):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.abspath("src"), "DRVQWEN_API_KEY": ""}
    r = subprocess.run([sys.executable, "-m", "drvqwen", "serve", "--model", str(model.path), "--device", "cpu",
                        "--no-verify", "--host", host, "--port", "0"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allowed-hosts" in lines[0] and "--api-key" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_one_log_line_per_request(model):
    """Every request is one line: method, path, status, tokens (prompt+completion), ms; and an
    error's message, so that a client's 400s are seen."""
    import re

    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    lines: list[str] = []
    with BackgroundServer(model, settings=ServerSettings(port=0), warmup=False, log=lines.append) as srv:
        ok = httpx.post(srv.url + COMP, json={"prompt": "abc", "max_tokens": 3, "temperature": 0,
                                               "ignore_eos": True}).json()
        httpx.post(srv.url + COMP, json={"prompt": "x", "temperature": 9})
        httpx.get(srv.url + "/v1/nothing")
        with httpx.stream("POST", srv.url + CHAT, json={"messages": MSG, "max_tokens": 2, "stream": True,
                                                        "temperature": 0, "ignore_eos": True}) as r:
            list(r.iter_lines())
        httpx.post(srv.url + "/infill", content=BODY, headers={"Content-Type": "text/plain"})
        httpx.get(srv.url + "/health", headers={"Host": "evil.example"})
        wait_idle(srv.worker)
        # A stream whose client leaves mid-way: its line says so (the stream's end never came).
        undo = slow_down(srv.worker, 0.005)
        try:
            with httpx.stream("POST", srv.url + COMP, json={"prompt": "abc", "max_tokens": 900, "stream": True,
                                                             "temperature": 0, "ignore_eos": True}) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 4:
                        break
            wait_idle(srv.worker)
            deadline = time.monotonic() + 5
            while len(lines) < 7 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            undo()
    n_prompt = ok["usage"]["prompt_tokens"]
    want = [rf"POST /v1/completions 200 {n_prompt}\+3 tokens \d+(\.\d+)? ms",
            r"POST /v1/completions 400 \d+(\.\d+)? ms: temperature: 9 is outside \[0, 2\]",
            r"GET /v1/nothing 404 \d+(\.\d+)? ms: no route /v1/nothing",
            r"POST /v1/chat/completions 200 \d+\+2 tokens \d+(\.\d+)? ms",
            r"POST /infill 415 \d+(\.\d+)? ms: .*application/json.*",
            r"GET /health 403 \d+(\.\d+)? ms: .*evil\.example.*",
            r"POST /v1/completions 200 \d+(\.\d+)? ms: cancelled: the client went away"]
    assert len(lines) == len(want), lines
    for line, pattern in zip(lines, want):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_a_port_in_use_is_said_before_the_model_is_read(tmp_path):
    """The port is taken before the model loads: one in use is one line at once, even with a
    --model that would fail (or take seconds) to read."""
    import os
    import socket
    import subprocess
    import sys

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        env = {**os.environ, "PYTHONPATH": os.path.abspath("src")}
        r = subprocess.run([sys.executable, "-m", "drvqwen", "serve", "--model", str(tmp_path / "absent.nanoqwen"),
                            "--device", "cpu", "--port", str(port)], capture_output=True, text=True, timeout=60,
                           env=env)
    finally:
        busy.close()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--port {port}: cannot listen there" in lines[0], r.stderr


def test_a_host_that_does_not_resolve_is_said_as_such():
    """A --host name that does not resolve is "cannot listen there" with the resolver's reason,
    not the advice for servers other machines can reach (which it is not)."""
    from drvqwen.errors import DrvqwenError
    from drvqwen.server.settings import check_bind

    with pytest.raises(DrvqwenError, match=r"^--host no\.such\.host\.invalid: cannot listen there \("):
        check_bind("no.such.host.invalid", (), None)
    with pytest.raises(DrvqwenError, match=r"^--host a\.\.b: cannot listen there \("):   # idna: an empty label
        check_bind("a..b", (), None)
    with pytest.raises(DrvqwenError, match="needs --allowed-hosts"):
        check_bind("0.0.0.0", (), None)
    check_bind("localhost", (), None)
    check_bind("127.0.0.1", (), None)
