"""`drvqwen list` and `drvqwen rm` on a cache of the test's own: every kind of entry listed
with its format, size and source; removal by exact name, by a prefix naming one entry, or
--all; ambiguous and unknown names refused; nothing outside the cache root deleted, even
through a link; temporaries of running writers and a hub download in progress left alone; a
conversion another run has mapped stays readable to it."""

from __future__ import annotations

import os
import time

import pytest

from drvqwen import cache, cli, paths
from drvqwen.pull import DEFAULT_GGUF

from helpers import TINY, random_dense, write_tiny_gguf
from hub_server import TinyHub

pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A cache with the default GGUF (a stand-in of the right name), a conversion of a tiny
    GGUF, and two GGUFs of one hub repo fetched through a loopback hub; built once, copied
    for each test (`filled`)."""
    pytest.importorskip("gguf")
    pytest.importorskip("huggingface_hub")
    import numpy as np
    from huggingface_hub import constants

    from drvqwen import hub, models

    base = tmp_path_factory.mktemp("template")
    rng = np.random.default_rng(0)   # the contents do not matter here, only that they exist
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRVQWEN_CACHE", str(base / "cache"))
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        models_dir = paths.models_dir()
        (models_dir / DEFAULT_GGUF.filename).write_bytes(b"GGUF" + bytes(1000))
        src = write_tiny_gguf(base / "Tiny.gguf", TINY, random_dense(TINY, rng))
        conv = models.resolve_model(str(src)).path
        server = TinyHub({"someone/Coder-GGUF": {"coder-q4_k_m.gguf": rng.bytes(3000),
                                                 "coder-q8_0.gguf": rng.bytes(5000)}})
        mp.setenv("HF_ENDPOINT", server.url)
        try:
            hub.fetch("someone/Coder-GGUF:Q4_K_M", progress=False)
            hub.fetch("someone/Coder-GGUF:Q8_0", progress=False)
        finally:
            server.close()
    return {"cache": base / "cache", "src": src, "conv_name": conv.name}


@pytest.fixture
def filled(template, private_cache):
    """The template cache as this test's own cache root (hub links are relative: they still
    lead to the copied blobs)."""
    import shutil

    shutil.copytree(template["cache"], private_cache, symlinks=True)
    models_dir = paths.models_dir()
    # A conversion being written by a live process: a temporary, not an entry.
    (models_dir / f".x.nanoqwen.tmp-{os.getpid()}").write_bytes(b"half")
    return {"src": template["src"], "conv": models_dir / template["conv_name"]}


def _names() -> list[str]:
    return [e.name for e in cache.entries()]


def test_list_shows_every_entry(filled, capsys):
    conv = filled["conv"]
    by_name = {e.name: e for e in cache.entries()}
    assert sorted(by_name) == sorted([DEFAULT_GGUF.filename, conv.name, "someone/Coder-GGUF:Q4_K_M",
                                      "someone/Coder-GGUF:Q8_0"])
    assert by_name[conv.name].format == "nanoqwen, GGUF formats" and by_name[conv.name].size == conv.stat().st_size
    assert by_name[conv.name].source == f"converted from {filled['src'].resolve()}"
    assert conv.name.startswith("tiny-")
    q8 = by_name["someone/Coder-GGUF:Q8_0"]
    assert (q8.format, q8.size, q8.source) == ("GGUF", 5000, "Hugging Face hub (someone/Coder-GGUF)")
    assert by_name[DEFAULT_GGUF.filename].source.startswith("official Qwen2.5-Coder-0.5B-Instruct GGUF")
    assert abs(by_name[DEFAULT_GGUF.filename].mtime - time.time()) < 600
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for n in by_name:
        assert n in out
    assert "4 entries" in out
    for e in cache.entries()[1:]:
        cache.remove(e)
    assert cli.main(["list"]) == 0
    assert "1 entry," in capsys.readouterr().out


def test_list_of_an_empty_cache(capsys):
    assert cli.main(["list"]) == 0
    assert "no models in the cache" in capsys.readouterr().err


def test_rm_by_name_and_by_prefix(filled, private_cache):
    conv = filled["conv"]
    sidecar = conv.with_name(f".{conv.name}.source.json")
    assert sidecar.exists()
    assert cli.main(["rm", conv.name]) == 0
    assert not conv.exists() and not sidecar.exists()
    assert cli.main(["rm", "someone/coder-gguf:q8"]) == 0             # a prefix, any case
    assert sorted(_names()) == sorted([DEFAULT_GGUF.filename, "someone/Coder-GGUF:Q4_K_M"])
    blobs = private_cache / "hub" / "models--someone--Coder-GGUF" / "blobs"
    assert len(list(blobs.iterdir())) == 1                            # its blob went with it
    assert cli.main(["rm", "someone/"]) == 0                          # now names only one
    assert not (private_cache / "hub" / "models--someone--Coder-GGUF").exists()
    # Temporaries of a live writer are no entry and stay.
    assert (private_cache / "models" / f".x.nanoqwen.tmp-{os.getpid()}").exists()


def test_rm_refuses_ambiguous_unknown_and_malformed(filled, capsys):
    before = _names()
    assert cli.main(["rm", "someone/Coder"]) == 2
    err = capsys.readouterr().err
    assert "someone/Coder: ambiguous, it names 2 entries: someone/Coder-GGUF:Q4_K_M, someone/Coder-GGUF:Q8_0" in err
    assert cli.main(["rm", "nothing-like-it"]) == 2
    assert "nothing-like-it: no such model in the cache" in capsys.readouterr().err
    assert cli.main(["rm"]) == 2 and cli.main(["rm", "x", "--all"]) == 2
    assert cli.main(["rm", "../../etc"]) == 2                         # a name, never a path
    capsys.readouterr()
    # An empty or blank NAME (an unset shell variable) is a prefix of every name: refused, also
    # where it would have named the one entry left.
    for name in ("", " "):
        assert cli.main(["rm", name]) == 2
        assert "rm: NAME is empty" in capsys.readouterr().err
    assert cache.find("") == [] and cache.find("  ") == []
    assert _names() == before
    for e in cache.entries()[1:]:
        cache.remove(e)
    assert len(_names()) == 1 and cli.main(["rm", ""]) == 2 and len(_names()) == 1


def test_rm_all_empties_the_cache_of_models_only(filled, private_cache):
    cubin = paths.cubin_dir() / "k.cubin"
    cubin.write_bytes(b"x")
    assert cli.main(["rm", "--all"]) == 0
    assert _names() == [] and cubin.exists()


def test_nothing_outside_the_cache_root_is_removed(filled, private_cache, tmp_path):
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"keep me")
    snap = next((private_cache / "hub" / "models--someone--Coder-GGUF" / "snapshots").iterdir())
    link = snap / "coder-q8_0.gguf"
    link.unlink()
    link.symlink_to(outside)                                          # a link that leads out
    e = cache.find("someone/Coder-GGUF:Q8_0")[0]
    assert cli.main(["rm", e.name]) == 2
    assert outside.read_bytes() == b"keep me" and link.is_symlink()
    # An entry whose own path lies outside (a hand-made one) is refused before anything goes.
    bad = cache.Entry("x", "GGUF", 1, 0.0, "", [paths.models_dir() / DEFAULT_GGUF.filename, outside])
    with pytest.raises(Exception, match="outside the cache root"):
        cache.remove(bad)
    assert outside.exists() and (paths.models_dir() / DEFAULT_GGUF.filename).exists()


def test_a_symlinked_cache_root_works(filled, private_cache, tmp_path, monkeypatch):
    alias = tmp_path / "alias"
    alias.symlink_to(private_cache)
    monkeypatch.setenv("DRVQWEN_CACHE", str(alias))
    assert cli.main(["rm", "someone/Coder-GGUF:Q8_0"]) == 0
    assert "someone/Coder-GGUF:Q8_0" not in _names()


def test_a_download_in_progress_keeps_its_repo_folder(filled, private_cache):
    repo = private_cache / "hub" / "models--someone--Coder-GGUF"
    (repo / "blobs" / "abc.1234abcd.incomplete").write_bytes(b"growing")
    assert cli.main(["rm", "someone/Coder-GGUF:Q8_0"]) == 0 and cli.main(["rm", "someone/Coder-GGUF"]) == 0
    assert (repo / "blobs" / "abc.1234abcd.incomplete").exists()
    assert not [e for e in cache.entries() if e.name.startswith("someone/")]


def test_a_mapped_conversion_stays_readable_after_rm(filled):
    from drvqwen.format.nanoqwen import NanoqwenFile

    f = NanoqwenFile(filled["conv"])
    before = [bytes(f.tensor(i.name).tobytes()[:64]) for i in f][:3]
    assert cli.main(["rm", filled["conv"].name]) == 0
    assert [bytes(f.tensor(i.name).tobytes()[:64]) for i in f][:3] == before


def test_a_conversion_whose_source_is_gone_says_so(filled):
    import json

    sidecar = filled["conv"].with_name(f".{filled['conv'].name}.source.json")
    rec = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(rec | {"source": str(filled["src"]) + ".moved"}))
    e = cache.find(filled["conv"].name)[0]
    assert e.source == f"converted from {filled['src']}.moved (no longer there)"


def test_info_and_model_take_the_names_list_shows(filled, capsys, monkeypatch):
    """`info NAME` and `--model NAME` take what `drvqwen list` shows, as `rm` does: the name or
    the start of one naming only it; a download is shown through its conversion."""
    import shutil

    from drvqwen import models

    conv = filled["conv"]
    for name in (conv.name, "tiny-", conv.name.upper()[:8]):
        assert cli.main(["info", name]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert str(conv) in out and "tensors by dtype" in out
    # A download in the cache with a conversion made from it: info shows that conversion, and
    # --model runs it by the download's name.
    mine = paths.models_dir() / "mine.gguf"
    shutil.copy(filled["src"], mine)
    made = models.resolve_model(str(mine)).path
    assert cli.main(["info", "mine.gguf"]) == 0
    assert str(made) in capsys.readouterr().out
    # Its record naming the download somewhere else (the cache was moved): info finds the
    # conversion by the download's content, as --model does.
    import json

    sidecar = made.with_name(f".{made.name}.source.json")
    sidecar.write_text(json.dumps(json.loads(sidecar.read_text()) | {"source": "/elsewhere/mine.gguf"}))
    assert cli.main(["info", "mine.gguf"]) == 0
    assert str(made) in capsys.readouterr().out
    for name in (conv.name, "mine.gguf"):
        assert cli.main(["run", "--model", name, "--device", "cpu", "-p", "hi", "-n", "1", "--no-verify"]) == 0
        assert "generated 1" in capsys.readouterr().err
    # One line for what cannot be shown: a download not converted yet, a name naming several,
    # a name naming nothing. A download never hashed is not read to find out (a checkpoint's
    # shards can be tens of GB): info looks it up by record.
    def no_hashing(*a, **k):
        raise AssertionError("info hashed a download")

    monkeypatch.setattr(models, "file_sha256", no_hashing)
    assert cli.main(["info", "someone/Coder-GGUF:Q8_0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: someone/Coder-GGUF:Q8_0: a GGUF download with no conversion in the cache yet "
        "(drvqwen run --model someone/Coder-GGUF:Q8_0 converts it)")
    assert cli.main(["info", "m"]) == 2
    assert capsys.readouterr().err.strip() == f"error: m: ambiguous, it names 2 entries: {made.name}, mine.gguf"
    assert cli.main(["info", "nothing-like-it"]) == 2
    assert capsys.readouterr().err.strip() == ("error: nothing-like-it: no such file, and no model of that name in "
                                               "the cache (drvqwen list shows them; drvqwen pull NAME fetches one)")
