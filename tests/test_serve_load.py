"""`drvqwen serve` as a process under load: 32 clients × 2 requests at once, each answer equal to
the one it gets alone, the queue served in arrival order, and the server's RSS after the load
within 5% of its RSS after warm-up; Ctrl-C stops it with one line, also while requests stream;
one log line per request unless --quiet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import assert_no_page_leaked, write_tiny

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("private_cache")

CLIENTS, PER_CLIENT = 32, 2


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class ServerProcess:
    """`drvqwen serve` on the tiny model in a process of its own; its stderr lines are collected
    by a thread (so that the request log never fills the pipe)."""

    def __init__(self, model, *args: str):
        # One BLAS thread: the 32 client threads of this process share the CPU with the server,
        # and spinning BLAS workers would only fight them for it.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "drvqwen", "serve", "--model", str(model), "--device",
                                      "cpu", "--port", "0", "--no-verify", *args],
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url = None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                break
        else:
            pytest.fail("the server did not start: " + "\n".join(self.lines))
        self._reader = threading.Thread(target=lambda: self.lines.extend(l.rstrip("\n") for l in self.proc.stderr),
                                        daemon=True)
        self._reader.start()

    def interrupt(self, timeout_s: float = 30, sig=signal.SIGINT) -> list[str]:
        """Ctrl-C (or `sig`); the stderr lines written after the start line."""
        start = len(self.lines)
        self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout_s)
        return self.lines[start:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(tmp_path):
    """serve(*args) starts a server process with these extra flags."""
    model = write_tiny(tmp_path / "tiny.nanoqwen")
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        started.append(ServerProcess(model, *args))
        return started[-1]

    yield start
    for p in started:
        p.close()


def _ask(client, c: int, k: int) -> str:
    r = client.completions.create(model="tiny", prompt=f"client {c} asks {k}:", max_tokens=4, temperature=0.9,
                                  seed=100 * c + k, extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_concurrent_clients_get_their_own_text_and_memory_stays(serve):
    srv = serve("--queue-size", str(2 * CLIENTS), "--quiet")
    proc, url = srv.proc, srv.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    alone = {(c, k): _ask(client, c, k) for c in range(CLIENTS) for k in range(PER_CLIENT)}
    assert len(set(alone.values())) > CLIENTS        # the requests differ: a mix-up would show

    def one_client(c: int, ks) -> dict:
        own = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return {(c, k): _ask(own, c, k) for k in ks}

    with ThreadPoolExecutor(CLIENTS) as pool:        # warm-up: every connection once
        list(pool.map(lambda c: one_client(c, [0]), range(CLIENTS)))
    rss_warm = _rss_bytes(proc.pid)
    with ThreadPoolExecutor(CLIENTS) as pool:
        got = {}
        for part in pool.map(lambda c: one_client(c, range(PER_CLIENT)), range(CLIENTS)):
            got.update(part)
    rss_after = _rss_bytes(proc.pid)
    assert got == alone
    assert abs(rss_after - rss_warm) <= 0.05 * rss_warm, (rss_warm, rss_after)
    assert assert_no_page_leaked(url)["queue_length"] == 0

    said = srv.interrupt()
    assert proc.returncode == 130 and said == ["interrupted"], said


def test_sigterm_stops_the_server_as_ctrl_c_does(serve):
    """SIGTERM (a service manager's stop) ends the server as Ctrl-C does: one line, 130 — not
    the default handler's silent death with 143."""
    srv = serve("--quiet")
    assert httpx.get(srv.url + "/health").status_code == 200
    said = srv.interrupt(sig=signal.SIGTERM)
    assert srv.proc.returncode == 130 and said == ["interrupted"], said


def test_ctrl_c_while_requests_stream_is_one_line_and_130(serve):
    """Ctrl-C with a whole answer being generated and three streams waiting behind it: the
    server ends them at once — each client gets an error saying the server is shutting down,
    not a broken connection — and prints one line ("interrupted"), exit status 130; the
    request log (on by default) has one line per request."""
    srv = serve()
    long = {"prompt": "abc", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    got: dict[int, list] = {i: [] for i in range(4)}
    waiting = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                waiting[i].set()                       # its response has begun: it is queued
                for line in r.iter_lines():
                    if line:
                        got[i].append(line)
        except httpx.HTTPError as e:
            got[i].append(repr(e))
        waiting[i].set()

    def whole() -> None:
        try:
            r = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)
            got[3].append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            got[3].append(repr(e))

    threads = [threading.Thread(target=whole)] + [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads[0].start()
    end = time.monotonic() + 30
    while not httpx.get(srv.url + "/health").json()["busy"]:        # the whole answer runs
        assert time.monotonic() < end
        time.sleep(0.005)
    for t in threads[1:]:
        t.start()
    for w in waiting:
        assert w.wait(30)
    said = srv.interrupt()
    for t in threads:
        t.join(30)
    assert srv.proc.returncode == 130
    log = [l for l in said if re.match(r"(POST /v1/completions|GET /health) ", l)]
    assert [l for l in said if l not in log] == ["interrupted"], said
    shut = [l for l in log if l.startswith("POST")]
    assert len(shut) == 4 and all(l.endswith("ms: the server is shutting down") for l in shut), log
    assert sorted(l.split()[2] for l in shut) == ["200", "200", "200", "503"]
    for i in range(3):
        assert got[i] and got[i][-1].startswith("data: {\"error\"") and "shutting down" in got[i][-1], got[i][-3:]
    status, body = got[3][-1]
    assert status == 503 and body["error"]["code"] == "shutting_down"


def test_quiet_logs_no_requests(serve):
    srv = serve("--quiet")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": 1}).status_code == 400
    assert srv.interrupt() == ["interrupted"]


def test_queue_is_served_in_arrival_order(tmp_path):
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.server.main import BackgroundServer
    from drvqwen.server.settings import ServerSettings

    from serve_helpers import slow_down

    with BackgroundServer(NanoqwenFile(write_tiny(tmp_path / "tiny.nanoqwen")),
                          settings=ServerSettings(port=0, queue_size=64), warmup=False) as srv:
        worker = srv.worker
        order, run = [], worker._run
        worker._run = lambda job: (order.append((job.seq, job.started_seq)), run(job))
        slow_down(worker, 0.002)
        body = {"prompt": "q", "max_tokens": 3, "temperature": 0}
        barrier = threading.Barrier(16)

        def post(i: int) -> int:
            barrier.wait()
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(post, range(16)))
    assert codes == [200] * 16 and len(order) == 16
    assert [s for s, _ in order] == sorted(s for s, _ in order)     # taken in arrival order
    assert all(seq == started for seq, started in order)


def test_bench_serve_tool_measures_both_paths(tmp_path):
    """tools/bench_serve.py (the GPU stage's overhead figure) on the CPU: both paths run the
    same number of tokens and the JSON holds the medians."""
    import json

    model = write_tiny(tmp_path / "tiny.nanoqwen")
    out = tmp_path / "serve.json"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "tools/bench_serve.py", "--model", str(model), "--device", "cpu",
                    "--prompt-tokens", "24", "--new-tokens", "8", "--runs", "1", "--json", str(out)],
                   check=True, env=env, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["direct"]] == [r["tokens"] for r in res["http"]] == [8]
    assert res["median"]["http_ttft_ms"] > 0 and res["median"]["direct_tok_s"] > 0
