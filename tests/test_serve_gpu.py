"""`drvqwen serve` on the GPU engine and on the real 0.5B: the same client checks as on the CPU.

GPU (Hopper, marked gpu): the real Qwen2.5-Coder-0.5B-Instruct (`DRVQWEN_REAL_MODEL`, the GPU
machines have no network) served from the engine: the chat answer and a seeded sample equal
`drvqwen run --device cuda`'s, a stream equals the whole answer, a client leaving mid-stream
stops within a step and leaves no page held but the cached sequence's, the GPU memory in use
after a concurrent load is within 5% of its value after warm-up, and llama.vim's requests reuse
the KV cache and get the answers of the same requests prefilled whole. Slow (CPU): the real
0.5B served from the numpy reference equals `drvqwen run`.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import common_prefix
from serve_helpers import (assert_no_page_leaked, llama_vim_chunk, llama_vim_fim_body, llama_vim_ring_body,
                           python_source, run_text, wait_idle)

openai = pytest.importorskip("openai")

PROMPT = "Write a Python function is_palindrome(s) that ignores case and punctuation."


def _gpu_memory_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.gpu
def test_serve_on_the_gpu_equals_run(real_nanoqwen, capsys):
    from drvqwen.server.main import BackgroundServer

    path = str(real_nanoqwen.path)
    want_chat = run_text(capsys, path, "--device", "cuda", "--prompt", PROMPT, "--max-new-tokens", "64",
                         "--temperature", "0")
    want_seed = run_text(capsys, path, "--device", "cuda", "--raw", "--prompt", "def quicksort(xs):",
                         "--max-new-tokens", "48", "--temperature", "0.8", "--top-p", "0.95", "--seed", "11")
    with BackgroundServer(real_nanoqwen, "cuda", 4096) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=64,
                                      temperature=0)
        assert r.choices[0].message.content == want_chat
        stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=64, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want_chat
        r = c.completions.create(model="m", prompt="def quicksort(xs):", max_tokens=48, temperature=0.8,
                                 top_p=0.95, seed=11)
        assert r.choices[0].text == want_seed

        worker = srv.worker
        assert_no_page_leaked(srv.url)
        body = {"prompt": "def f():", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i == 20:
                    break
        wait_idle(worker)
        assert assert_no_page_leaked(srv.url)["tokens_cached"] < 200    # it stopped within a step
        assert worker.metrics.cancelled._value.get() == 1

        def client(i: int) -> str:
            own = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            return own.completions.create(model="m", prompt=f"# task {i}\ndef ", max_tokens=32, temperature=0.7,
                                          seed=i).choices[0].text

        with ThreadPoolExecutor(32) as pool:
            alone = list(pool.map(client, range(32)))
        vram_warm = _gpu_memory_used_mib()
        with ThreadPoolExecutor(32) as pool:
            for _ in range(3):
                assert list(pool.map(client, range(32))) == alone
        vram_after = _gpu_memory_used_mib()
        assert abs(vram_after - vram_warm) <= 0.05 * vram_warm, (vram_warm, vram_after)
        print(f"\nVRAM used after warm-up {vram_warm} MiB, after 96 requests {vram_after} MiB")


@pytest.mark.gpu
def test_serve_on_the_gpu_reuses_the_kv_cache(real_nanoqwen):
    """llama.vim's warm-up and /infill requests while a line is typed, then an edit above the
    cursor, on the GPU engine: each prefills only what follows the common prefix with the
    previous prompt (the rest rolled back: Prefill.run → Sequence.keep), no page is left held
    but the cached sequence's, and the answers are those of the same requests prefilled whole
    (`cache_prompt: false`)."""
    from drvqwen.server.main import BackgroundServer

    with BackgroundServer(real_nanoqwen, "cuda", 4096, random_seed=lambda: 0) as srv:
        parse = srv.parser.parse
        chunks = [llama_vim_chunk(python_source(40)[i:i + 20], f"lib_{i}.py") for i in (0, 20)]
        ring = llama_vim_ring_body(chunks)
        r = httpx.post(srv.url + "/infill", json=ring, timeout=120)
        assert r.status_code == 200 and r.json() == {}
        prev = ring_ids = parse("infill", ring).prompt_ids
        wait_idle(srv.worker)
        assert srv.worker.model.backend.cached_ids() == ring_ids
        lines = python_source(120)
        at = 57
        typed = lines[at - 1]
        assert len(typed) > 12
        bodies = [llama_vim_fim_body(lines[:at - 1] + [typed[:k]] + lines[at:], at, k, chunks, n_predict=32,
                                     t_max_predict_ms=0) for k in (5, 8, 12, len(typed))]
        edited = lines[:10] + [lines[10] + "  # edited"] + lines[11:]
        bodies.append(llama_vim_fim_body(edited, at, len(typed), chunks, n_predict=32, t_max_predict_ms=0))
        for body in bodies:
            ids = parse("infill", body).prompt_ids
            reused = common_prefix(prev, ids)
            got = httpx.post(srv.url + "/infill", json={**body, "response_fields": None}, timeout=120).json()
            assert got["timings"]["cache_n"] == reused >= len(ring_ids) - 2
            wait_idle(srv.worker)
            assert got["tokens_cached"] == len(srv.worker.model.backend.cached_ids())
            assert_no_page_leaked(srv.url)
            cold = httpx.post(srv.url + "/infill", json={**body, "response_fields": None, "cache_prompt": False},
                              timeout=120).json()
            assert cold["timings"]["cache_n"] == 0
            assert got["content"] == cold["content"]
            prev = ids


@pytest.mark.slow
def test_serve_real_model_on_the_cpu_equals_run(real_nanoqwen, capsys, private_cache):
    """The real tokenizer's chat template through the server equals run's (short: the CPU
    reference of the 0.5B takes seconds per prompt)."""
    from drvqwen.server.main import BackgroundServer

    path = str(real_nanoqwen.path)
    want = run_text(capsys, path, "--system", "", "--prompt", "def fib", "--max-new-tokens", "4",
                    "--temperature", "0", "--max-context", "64")
    with BackgroundServer(real_nanoqwen, "cpu", 64, warmup=False) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": ""}, {"role": "user", "content": "def fib"}])
    assert r.choices[0].message.content == want and want.strip()
    assert r.usage.prompt_tokens == len(srv.parser.tok.chat("def fib", system=""))
