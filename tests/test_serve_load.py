"""`drvqwen serve` as a process under load: 32 clients × 2 requests at once, each answer equal to
the one it gets alone, the queue served in arrival order, and the server's RSS after the load
within 5% of its RSS after warm-up; Ctrl-C stops it with one line."""

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

from serve_helpers import write_tiny

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("private_cache")

CLIENTS, PER_CLIENT = 32, 2


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server_process(tmp_path):
    model = write_tiny(tmp_path / "tiny.nanoqwen")
    # One BLAS thread: the 32 client threads of this process share the CPU with the server, and
    # spinning BLAS workers would only fight them for it.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "drvqwen", "serve", "--model", str(model), "--device", "cpu",
                             "--port", "0", "--no-verify", "--queue-size", str(2 * CLIENTS)],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                break
        else:
            pytest.fail("the server did not start: " + "".join(lines))
        yield proc, m.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ask(client, c: int, k: int) -> str:
    r = client.completions.create(model="tiny", prompt=f"client {c} asks {k}:", max_tokens=4, temperature=0.9,
                                  seed=100 * c + k, extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_concurrent_clients_get_their_own_text_and_memory_stays(server_process):
    proc, url = server_process
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
    h = httpx.get(url + "/health").json()
    assert h["queue_length"] == 0 and h["kv_pages_free"] == h["kv_pages_total"]

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err


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
