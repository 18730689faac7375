"""Models by name: `drvqwen pull owner/name[:TAG]` and `--model owner/name[:TAG]` through
`huggingface_hub`, against a loopback hub the test starts (hub_server.py), into the test's
own cache root. The choice of files, the download into the cache root's `hub/`, a dropped
transfer resumed with a Range request, the free-space check before the first byte, a cached
copy used when the hub is unreachable, conversions named after the repo, and every failure
as one line naming the model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from drvqwen import hub, paths
from drvqwen.errors import DrvqwenError

from helpers import TINY, byte_tokenizer_json, random_dense, write_tiny_gguf
from hub_server import TinyHub

pytest.importorskip("huggingface_hub")
pytestmark = pytest.mark.usefixtures("private_cache")
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def served(monkeypatch, rng):
    """A loopback hub with a GGUF repo of two quantizations and a tiny GGUF repo; HF_ENDPOINT
    points at it (for this process and the ones it starts)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    repos = {
        "someone/Coder-GGUF": {"coder-q4_k_m.gguf": rng.bytes(300_000), "coder-q8_0.gguf": rng.bytes(5000),
                               "README.md": b"# a model\n"},
        "someone/Only-GGUF": {"only-f16.gguf": rng.bytes(1000)},
    }
    server = TinyHub(repos)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.close()


def _resolve_gets(server) -> list:
    return [r for r in server.requests if r[0] == "GET" and "/resolve/" in r[1]]


# ---- names and the choice of files --------------------------------------------------------------

def test_parse_name():
    assert hub.parse_name("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m") == \
        hub.ModelName("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", "q4_k_m")
    assert hub.parse_name("Qwen/Qwen2.5-Coder-7B-Instruct") == hub.ModelName("Qwen/Qwen2.5-Coder-7B-Instruct")
    for path_like in ("model.nanoqwen", "dir/model.gguf", "./a/b", "/a/b", "a/b/c", "../x", "a/..", "~/x"):
        assert hub.parse_name(path_like) is None, path_like


def test_choose_files():
    name = hub.ModelName
    many = ["m-q4_k_m.gguf", "m-Q8_0.gguf", "m-f16-00001-of-00002.gguf", "README.md"]
    assert hub.choose_files(name("o/m"), many) == ["m-q4_k_m.gguf"]               # the default
    assert hub.choose_files(name("o/m", "q8_0"), many) == ["m-Q8_0.gguf"]          # any case
    with pytest.raises(DrvqwenError, match=r"^o/m:IQ2_XS: o/m has no IQ2_XS GGUF \(it has Q4_K_M, Q8_0;"):
        hub.choose_files(name("o/m", "IQ2_XS"), many)
    assert hub.choose_files(name("o/m"), ["x-q8_0.gguf"]) == ["x-q8_0.gguf"]        # the only one
    with pytest.raises(DrvqwenError, match=r"no Q4_K_M GGUF and not just one \(it has Q5_0, Q8_0"):
        hub.choose_files(name("o/m"), ["x-q8_0.gguf", "x-q5_0.gguf"])
    with pytest.raises(DrvqwenError, match="split into parts"):
        hub.choose_files(name("o/m"), ["x-q4_k_m-00001-of-00002.gguf"])
    hf = ["config.json", "tokenizer.json", "model-2.safetensors", "model-1.safetensors",
          "model.safetensors.index.json", "README.md", "sub/model.safetensors"]
    assert hub.choose_files(name("o/m"), hf) == ["config.json", "tokenizer.json",
                                                 "model.safetensors.index.json",
                                                 "model-1.safetensors", "model-2.safetensors"]
    with pytest.raises(DrvqwenError, match="neither a GGUF file nor an HF checkpoint"):
        hub.choose_files(name("o/m"), ["config.json", "model.safetensors"])
    with pytest.raises(DrvqwenError, match="o/m has no GGUF file"):
        hub.choose_files(name("o/m", "Q4_K_M"), hf)


# ---- fetching ------------------------------------------------------------------------------------

def test_pull_by_name_lands_in_the_cache_root(served, private_cache):
    from drvqwen import cli

    got = hub.fetch("someone/Coder-GGUF:Q8_0", progress=False)
    assert got.name == "coder-q8_0.gguf" and got.read_bytes() == served.repos["someone/Coder-GGUF"]["coder-q8_0.gguf"]
    assert got.resolve().is_relative_to(private_cache.resolve() / "hub")
    assert [r[1].rsplit("/", 1)[-1] for r in _resolve_gets(served)] == ["coder-q8_0.gguf"]   # nothing else
    # The default quantization, through the command line; a second pull downloads nothing.
    assert cli.main(["pull", "someone/Coder-GGUF"]) == 0
    default = hub.fetch("someone/Coder-GGUF", progress=False)
    assert default.name == "coder-q4_k_m.gguf"
    assert len(_resolve_gets(served)) == 2
    assert hub.fetch("someone/Only-GGUF", progress=False).name == "only-f16.gguf"   # the only one


def test_a_dropped_transfer_is_resumed_with_a_range_request(served, monkeypatch):
    from huggingface_hub import constants

    # The client writes what it received in chunks (10 MiB by default); smaller chunks let a
    # 300 kB file be cut after some of them were written.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16, raising=False)
    data = served.repos["someone/Coder-GGUF"]["coder-q4_k_m.gguf"]
    served.cut_once["coder-q4_k_m.gguf"] = 200_000
    got = hub.fetch("someone/Coder-GGUF:Q4_K_M", progress=False)
    assert hashlib.sha256(got.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    ranges = [r[2] for r in _resolve_gets(served)]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    resumed_at = int(ranges[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= 200_000, ranges            # what was written is not fetched again


def test_free_space_is_checked_before_the_first_byte(served, monkeypatch, private_cache):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda d: Usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(DrvqwenError) as ei:
        hub.fetch("someone/Coder-GGUF", progress=False)
    assert str(ei.value) == (f"{private_cache / 'hub'}: downloading someone/Coder-GGUF needs 0.3 MiB free, "
                             f"the disk has 0.0 MiB (free some space, or set DRVQWEN_CACHE to a disk with room)")
    assert _resolve_gets(served) == []


def test_the_cached_copy_serves_when_the_hub_is_unreachable(served, monkeypatch):
    first = hub.fetch("someone/Coder-GGUF:Q8_0", progress=False)
    served.close()
    said = []
    assert hub.fetch("someone/Coder-GGUF:Q8_0", progress=False, say=said.append) == first
    assert len(said) == 1 and said[0].startswith("someone/Coder-GGUF:Q8_0: the hub is unreachable (")
    with pytest.raises(DrvqwenError, match=rf"^someone/Coder-GGUF:Q4_K_M: cannot be fetched from "
                                           rf"{served.url} \(ConnectError"):
        hub.fetch("someone/Coder-GGUF:Q4_K_M", progress=False)        # not downloaded before


def _one_error_line(r) -> str:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    return lines[0]


def test_unknown_or_unreachable_model_is_one_line(served, monkeypatch):
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_DISABLE_TELEMETRY="1")
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "drvqwen", *a], capture_output=True,
                                         text=True, env=env | kw, timeout=120)
    line = _one_error_line(run("pull", "nobody/nothing"))
    assert line == (f"error: nobody/nothing: cannot be fetched from {served.url} (no such repo, or it "
                    f"is private (log in with hf auth login or HF_TOKEN))")
    line = _one_error_line(run("run", "--model", "someone/Coder-GGUF:Q2_K", "--prompt", "x"))
    assert line.startswith("error: someone/Coder-GGUF:Q2_K: someone/Coder-GGUF has no Q2_K GGUF (it has Q4_K_M, Q8_0;")
    line = _one_error_line(run("pull", "someone/Coder-GGUF", HF_ENDPOINT="http://127.0.0.1:9"))
    assert line.startswith("error: someone/Coder-GGUF: cannot be fetched from http://127.0.0.1:9 (ConnectError")
    line = _one_error_line(run("run", "--model", "no/such.nanoqwen", "--prompt", "x"))
    assert line == "error: no/such.nanoqwen: file not found"


# ---- --model NAME: fetched, converted, named after the source ----------------------------------

def test_model_by_name_is_converted_and_named_after_it(monkeypatch, rng, tmp_path, private_cache):
    pytest.importorskip("gguf")
    from huggingface_hub import constants
    from safetensors.numpy import save_file

    from drvqwen import models

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    dense = random_dense(TINY, rng)
    gguf = write_tiny_gguf(tmp_path / "tiny-coder-Q4_K_M.gguf", TINY, dense).read_bytes()
    save_file(dense, str(tmp_path / "model.safetensors"))
    hf = {"config.json": json.dumps(TINY.to_hf_dict()).encode(), "tokenizer.json": byte_tokenizer_json().encode(),
          "model.safetensors": (tmp_path / "model.safetensors").read_bytes(), "README.md": b"x"}
    server = TinyHub({"someone/Tiny-Coder-GGUF": {"tiny-coder-Q4_K_M.gguf": gguf}, "someone/Tiny-Coder": hf})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    try:
        f = models.resolve_model("someone/Tiny-Coder-GGUF")
        assert f.path.parent == private_cache / "models" and f.path.name.startswith("tiny-coder-q4_k_m-")
        assert models.read_conversion_record(f.path)["name"] == "someone/Tiny-Coder-GGUF"
        g = models.resolve_model("someone/Tiny-Coder")
        assert g.path.name.startswith("tiny-coder-") and len(g.path.name) == len("tiny-coder-") + 16 + 9
        assert models.read_conversion_record(g.path)["name"] == "someone/Tiny-Coder"
        snapshot = private_cache / "hub" / "models--someone--Tiny-Coder" / "snapshots"
        assert sorted(p.name for p in next(snapshot.iterdir()).iterdir()) == \
            ["config.json", "model.safetensors", "tokenizer.json"]                # no README
        assert models.resolve_model("someone/Tiny-Coder").path == g.path           # once
        # The download removed to save space, the hub gone: the conversion still runs by name.
        from drvqwen import cli

        assert cli.main(["rm", "someone/Tiny-Coder-GGUF:Q4_K_M"]) == 0
        server.close()
        said = []
        assert models.resolve_model("someone/Tiny-Coder-GGUF", say=said.append).path == f.path
        assert said == ["someone/Tiny-Coder-GGUF: using its conversion in the cache (the download was "
                        "removed; drvqwen pull someone/Tiny-Coder-GGUF fetches it again)"]
        with pytest.raises(DrvqwenError, match=r"^someone/Tiny-Coder-GGUF:Q4_K_M: cannot be fetched"):
            models.resolve_model("someone/Tiny-Coder-GGUF:Q4_K_M")               # another name
    finally:
        server.close()


def test_conversions_under_an_older_name_are_found_again(monkeypatch, rng, tmp_path, private_cache):
    pytest.importorskip("gguf")
    from drvqwen import models

    src = write_tiny_gguf(tmp_path / "Tiny Coder.gguf", TINY, random_dense(TINY, rng))
    first = models.resolve_model(str(src)).path
    assert first.name.startswith("tiny_coder-")
    # The same conversion as an older drvqwen named it (the source's case and characters kept).
    older = first.with_name("Tiny Coder-" + first.name.split("-", 1)[1])
    os.replace(first, older)
    monkeypatch.setattr(models, "convert", lambda *a: pytest.fail("converted again"))
    assert models.resolve_model(str(src)).path == first and first.exists() and not older.exists()


def test_what_is_fetched_is_said_and_abandoned_temporaries_go(served, private_cache):
    import time

    hub.fetch("someone/Coder-GGUF:Q8_0", progress=False)
    blobs = private_cache / "hub" / "models--someone--Coder-GGUF" / "blobs"
    old, live = blobs / "dead.1234abcd.incomplete", blobs / "live.5678abcd.incomplete"
    for p in (old, live):
        p.write_bytes(b"part")
    hour_ago = time.time() - hub.ABANDONED_AFTER_S - 60
    os.utime(old, (hour_ago, hour_ago))
    said = []
    hub.fetch("someone/Coder-GGUF:Q4_K_M", progress=False, say=said.append)
    assert said == [f"downloading someone/Coder-GGUF:Q4_K_M from {served.url}: coder-q4_k_m.gguf, 0.3 MiB"]
    assert not old.exists() and live.exists()
    said.clear()
    hub.fetch("someone/Coder-GGUF:Q4_K_M", progress=False, say=said.append)
    assert said == []                                                 # nothing to download
