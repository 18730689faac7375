"""The cache and the files drvqwen writes: I/O errors as one line (checked before the work
where possible, nothing half-written), tensor data verified once per file, conversions keyed
by content (found again after a move, superseded ones removed), leftovers of killed processes
removed, damaged cached conversions rebuilt. Every test has its own cache root."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from drvqwen import paths
from drvqwen.errors import DrvqwenError
from drvqwen.format.nanoqwen import NanoqwenFile

from helpers import TINY, byte_tokenizer_json, random_dense, write_model, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("private_cache")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "drvqwen", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _one_error_line(r) -> str:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("error:"), lines
    return lines[0]


@pytest.fixture
def tiny(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    return path


@pytest.fixture
def tiny_gguf(tmp_path, rng):
    pytest.importorskip("gguf")
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf", TINY, random_dense(TINY, rng))


# ---- I/O errors: one line, checked first, nothing half-written ----------------------------------

def test_uncreatable_cache_is_one_line(monkeypatch):
    monkeypatch.setenv("DRVQWEN_CACHE", "/proc/x")
    line = _one_error_line(_cli("pull"))
    assert "/proc/x: cannot create the cache directory" in line and "DRVQWEN_CACHE" in line


def test_a_cache_root_that_is_a_file_says_so(monkeypatch, tmp_path):
    (tmp_path / "f").write_text("x")
    for root in (tmp_path / "f", tmp_path / "f" / "sub"):
        monkeypatch.setenv("DRVQWEN_CACHE", str(root))
        assert _one_error_line(_cli("list")) == (f"error: {root}: not a folder (a file is in the way: set "
                                                 f"DRVQWEN_CACHE to a directory)")
        assert _one_error_line(_cli("pull")) == (f"error: {root}: cannot create the cache directory (a file is in "
                                                 f"the way, not a folder: set DRVQWEN_CACHE to a directory)")


def test_reading_the_cache_creates_no_folder(monkeypatch, tmp_path):
    """list, info and rm only read the cache: a missing cache root reads as empty and is not
    created."""
    root = tmp_path / "nowhere" / "drvqwen"
    monkeypatch.setenv("DRVQWEN_CACHE", str(root))
    r = _cli("list")
    assert r.returncode == 0 and f"no models in the cache ({root})" in r.stderr, r.stderr
    _cli("info", "qwen")
    _cli("rm", "qwen")
    assert not (tmp_path / "nowhere").exists()


def test_rm_with_a_name_and_all_says_not_both(monkeypatch, tmp_path):
    monkeypatch.setenv("DRVQWEN_CACHE", str(tmp_path / "c"))
    assert _one_error_line(_cli("rm", "--all", "foo")) == "error: rm: give NAME (foo) or --all, not both"
    assert "give one NAME" in _one_error_line(_cli("rm"))


def test_read_only_cache_is_refused_before_downloading(monkeypatch, private_cache):
    from drvqwen import pull

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(pull, "_try_hub", lambda *a: pytest.fail("a download started"))
    with pytest.raises(DrvqwenError) as ei:
        pull.pull(progress=False)
    assert f"{private_cache / 'models'}: cannot write the download there (read-only file system" in str(ei.value)


Usage = namedtuple("Usage", "total used free")


def test_full_disk_is_refused_before_the_work(monkeypatch, private_cache, tiny_gguf, tmp_path):
    from drvqwen import pull
    from drvqwen.format.convert import convert

    monkeypatch.setattr(paths.shutil, "disk_usage", lambda d: Usage(10**9, 10**9 - 4096, 4096))
    monkeypatch.setattr(pull, "_try_hub", lambda *a: pytest.fail("a download started"))
    with pytest.raises(DrvqwenError, match=r"downloading qwen2.5-coder-0.5b-instruct-q4_k_m.gguf needs "
                                           r"596.6 MiB free, the disk has 0.0 MiB"):
        pull.pull(progress=False)
    out = tmp_path / "out" / "m.nanoqwen"
    out.parent.mkdir()
    with pytest.raises(DrvqwenError, match=r"converting to m.nanoqwen needs .* free, the disk has 0.0 MiB"):
        convert(tiny_gguf, out)
    assert list(out.parent.iterdir()) == []


def test_disk_full_while_writing_leaves_nothing(monkeypatch, tiny_gguf, tmp_path):
    """ENOSPC in the middle of a conversion (the disk filled up after the check)."""
    import builtins

    from drvqwen.format import nanoqwen_writer
    from drvqwen.format.convert import convert

    class FillsUp:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(memoryview(b).cast("B"))
            if self.n > 200_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(nanoqwen_writer, "open", lambda *a, **k: FillsUp(builtins.open(*a, **k)), raising=False)
    out = tmp_path / "out" / "m.nanoqwen"
    out.parent.mkdir()
    with pytest.raises(DrvqwenError) as ei:
        convert(tiny_gguf, out)
    # out is no cache path: DRVQWEN_CACHE would not move it, so it is not the advice
    assert str(ei.value) == f"{out}: cannot write the model file (no space left on the device: free some space there)"
    assert list(out.parent.iterdir()) == []


def _try_mount_tmpfs(where: Path, opts: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("opts,expect", [("ro,size=1m", "read-only file system"),
                                         ("size=256k", "needs")])
def test_real_small_or_read_only_file_system(tmp_path, tiny_gguf, monkeypatch, opts, expect):
    """On a real tmpfs (where the test may mount one): read-only, or too small to convert into."""
    mnt = tmp_path / "mnt"
    if not _try_mount_tmpfs(mnt, opts):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        r = _cli("convert", str(tiny_gguf), "-o", str(mnt / "m.nanoqwen"))
        assert expect in _one_error_line(r) and str(mnt) in r.stderr
        assert list(mnt.iterdir()) == []
        monkeypatch.setenv("DRVQWEN_CACHE", str(mnt / "cache"))
        if opts.startswith("ro"):
            assert "cannot create the cache directory" in _one_error_line(_cli("pull"))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ---- tensor data verified once per file --------------------------------------------------------

def _flip_lm_head_byte(path: Path) -> None:
    with NanoqwenFile(path) as f:
        off = f.tensors["lm_head.weight"].offset + 1000
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x10
    path.write_bytes(bytes(raw))


RUN = ("--device", "cpu", "--raw", "--prompt", "hi", "--max-new-tokens", "2", "--ignore-eos")


def test_run_refuses_damaged_tensor_data(tiny):
    _flip_lm_head_byte(tiny)
    line = _one_error_line(_cli("run", "--model", str(tiny), *RUN))
    assert f"{tiny}: tensor lm_head.weight: data checksum mismatch" in line
    r = _cli("run", "--model", str(tiny), *RUN, "--no-verify")
    assert r.returncode == 0, r.stderr


def test_verification_is_paid_once_per_file(tiny, monkeypatch):
    from drvqwen.cli import main

    calls = []
    real = NanoqwenFile.verify_data
    monkeypatch.setattr(NanoqwenFile, "verify_data", lambda self, progress=None: calls.append(1) or real(self, progress))
    argv = ["run", "--model", str(tiny), *RUN]
    assert main(argv) == 0 and len(calls) == 1
    assert main(argv) == 0 and len(calls) == 1          # remembered: (device, inode, size, mtime)
    st = tiny.stat()
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert main(argv) == 0 and len(calls) == 2          # the file changed: checked again
    _flip_lm_head_byte(tiny)                             # rewritten: new mtime, checked, refused
    assert main(argv) == 2 and len(calls) == 3


def test_verify_cost_is_shown(tiny, monkeypatch, capsys):
    from drvqwen import cli, loading

    monkeypatch.setattr(loading, "VERIFY_REPORT_MIN_S", 0.0)
    assert cli.main(["run", "--model", str(tiny), *RUN]) == 0
    assert "verified 1 MiB of tensor data in" in capsys.readouterr().err


# ---- the conversion cache: keyed by content ------------------------------------------------------

def _count_conversions(monkeypatch):
    import drvqwen.models as models

    done = []
    real = models.convert
    monkeypatch.setattr(models, "convert", lambda s, d: done.append(d) or real(s, d))
    return done


def test_moved_source_and_cache_reuse_the_conversion(monkeypatch, tiny_gguf, tmp_path, private_cache):
    import drvqwen.models as models

    done = _count_conversions(monkeypatch)
    first = models.resolve_model(str(tiny_gguf)).path
    assert len(done) == 1
    moved = tmp_path / "elsewhere" / "tiny.gguf"
    moved.parent.mkdir()
    tiny_gguf.rename(moved)                                  # same inode: not even hashed again
    hashes = []
    real_sha = models.hashlib.sha256
    monkeypatch.setattr(models.hashlib, "sha256", lambda *a: hashes.append(1) or real_sha(*a))
    assert models.resolve_model(str(moved)).path == first and len(done) == 1
    assert len(hashes) == 2                                  # the source digest and the key only
    # The whole cache moved (a new root): the conversion is found again by content.
    new_root = tmp_path / "moved-cache"
    shutil.move(str(private_cache), str(new_root))
    monkeypatch.setenv("DRVQWEN_CACHE", str(new_root))
    paths._cleaned.clear()
    again = models.resolve_model(str(moved)).path
    assert again.parent == new_root / "models" and again.name == first.name and len(done) == 1
    assert len(list((new_root / "models").glob("*.nanoqwen"))) == 1


def test_superseded_conversions_are_removed(monkeypatch, tiny_gguf, rng):
    import drvqwen.models as models
    from drvqwen.format import quant

    done = _count_conversions(monkeypatch)
    old = models.resolve_model(str(tiny_gguf)).path
    legacy = old.parent / "tiny-0123456789ab.nanoqwen"     # a conversion from before content keys
    shutil.copy(old, legacy)
    monkeypatch.setattr(quant, "QUANTIZER_VERSION", quant.QUANTIZER_VERSION + 1)
    new = models.resolve_model(str(tiny_gguf)).path
    assert new != old and len(done) == 2
    assert sorted(p.name for p in new.parent.glob("*.nanoqwen")) == [new.name]
    # A new file at the same path supersedes the conversion of the old one.
    write_tiny_gguf(tiny_gguf, TINY, random_dense(TINY, rng))
    newer = models.resolve_model(str(tiny_gguf)).path
    assert newer != new and len(done) == 3
    assert sorted(p.name for p in newer.parent.glob("*.nanoqwen")) == [newer.name]


def test_conversions_keyed_by_an_older_file_version_are_redone(monkeypatch, tiny_gguf):
    """A conversion cached by a drvqwen that wrote format version 3 is not reused: the key
    names the version, and the stale file is removed."""
    import drvqwen.models as models

    done = _count_conversions(monkeypatch)
    version = models.VERSION
    monkeypatch.setattr(models, "VERSION", 3)
    old = models.resolve_model(str(tiny_gguf)).path
    monkeypatch.setattr(models, "VERSION", version)
    new = models.resolve_model(str(tiny_gguf)).path
    assert new != old and len(done) == 2 and not old.exists()


def _cache_int4_as_before(monkeypatch, src):
    """The cache's conversion of `src` as a drvqwen whose default policy was INT4 made it (its
    key and record name `int4`); returns its path."""
    import drvqwen.models as models
    from drvqwen.format.convert import convert

    with monkeypatch.context() as m:
        m.setattr(models, "DEFAULT_WEIGHTS", "int4")
        m.setattr(models, "convert", lambda s, d: convert(s, d, weights="int4"))
        return models.resolve_model(str(src)).path


def test_a_gguf_s_int4_conversion_cached_before_gives_way_to_its_own_formats(monkeypatch, tmp_path, rng):
    """A GGUF's INT4 conversion cached when INT4 was the default is not taken for the default
    conversion: the GGUF is converted again in its own formats, the INT4 file removed, and
    `drvqwen list` says which is which."""
    import drvqwen.models as models
    from drvqwen import cache
    from drvqwen.format import weight_formats as wf

    src = write_tiny_gguf(tmp_path / "q8.gguf", TINY, random_dense(TINY, rng), qtype="Q8_0")
    old = _cache_int4_as_before(monkeypatch, src)
    assert NanoqwenFile(old).has_default_formats and models.read_conversion_record(old)["weights"] == "int4"
    assert [e.format for e in cache.entries()] == ["nanoqwen INT4 g128"]
    done = _count_conversions(monkeypatch)
    new = models.resolve_model(str(src))
    assert new.path != old and len(done) == 1 and not old.exists()
    assert {wf.FORMATS[fid].name for p, fid in new.formats.items() if p != "lm_head"} == {"q8_g32"}
    assert models.read_conversion_record(new.path)["weights"] == "source"
    assert [e.format for e in cache.entries()] == ["nanoqwen, GGUF formats"]
    assert models.resolve_model(str(src)).path == new.path and len(done) == 1       # once


def test_an_hf_checkpoint_s_conversion_keeps_its_key(monkeypatch, tmp_path, rng):
    """An HF checkpoint becomes INT4 under either policy: its conversion cached when INT4 was
    the default is the default conversion still (not converted again), and says `int4`."""
    import json

    from safetensors.numpy import save_file

    import drvqwen.models as models

    src = tmp_path / "hf"
    src.mkdir()
    save_file(random_dense(TINY, rng), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    (src / "tokenizer.json").write_text(byte_tokenizer_json())
    old = _cache_int4_as_before(monkeypatch, src)
    monkeypatch.setattr(models, "convert", lambda *a: pytest.fail("converted again"))
    f = models.resolve_model(str(src))
    assert f.path == old and f.has_default_formats
    assert models.read_conversion_record(old)["weights"] == "int4" == models.cache_weights(src)


def test_a_named_model_s_conversion_is_used_without_its_download_under_the_current_policy(tmp_path):
    """`--model NAME` whose download was removed runs its conversion only if that follows the
    policy the cache follows now for its kind: a GGUF's INT4 conversion from before is not it."""
    import json

    import drvqwen.models as models

    mdir = tmp_path / "models"
    mdir.mkdir()
    base = {"format": models.VERSION, "layout": models.quant.LAYOUT_ID, "quantizer": models.quant.QUANTIZER_VERSION}
    gone = tmp_path / "gone"
    # Where hub.fetch put the source: a GGUF's file links to a blob (the record resolves it),
    # a checkpoint is a snapshot folder.
    cases = {"o/gguf-old": (gone / "blobs" / "5e1f", {"weights": "int4"}, False),
             "o/gguf-new": (gone / "blobs" / "5e1f", {"weights": "source"}, True),
             "o/gguf-link": (gone / "snapshots" / "abc" / "m-q4_k_m.gguf", {"weights": "source"}, True),
             "o/hf": (gone / "snapshots" / "abc", {"weights": "int4"}, True),
             "o/hf-unrecorded": (gone / "snapshots" / "abc", {}, True)}    # records before policies
    for i, (name, (source, extra, _)) in enumerate(cases.items()):
        conv = mdir / f"m{i}-0123456789abcdef.nanoqwen"
        conv.write_bytes(b"")
        models._sidecar(conv).write_text(json.dumps(base | extra | {"name": name, "source": str(source)}))
    for i, (name, (_, _, used)) in enumerate(cases.items()):
        assert models.conversion_of_name(name, mdir) == (mdir / f"m{i}-0123456789abcdef.nanoqwen" if used else None), name


def test_hf_conversion_key_follows_the_index(tmp_path, rng, monkeypatch):
    import json

    from safetensors.numpy import save_file

    import drvqwen.models as models

    src = tmp_path / "hf"
    src.mkdir()
    dense = random_dense(TINY, rng)
    save_file(dense, str(src / "model-00001-of-00001.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in dense}}))
    (src / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    (src / "tokenizer.json").write_text(byte_tokenizer_json())
    d1 = models.source_digest(src)
    save_file({"x": dense["model.norm.weight"]}, str(src / "stale.safetensors"))   # not read: same key
    assert models.source_digest(src) == d1
    (src / "config.json").write_text(json.dumps(TINY.to_hf_dict() | {"rms_norm_eps": 1e-5}))
    assert models.source_digest(src) != d1


# ---- leftovers of killed processes --------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_dead_processes_are_removed(tmp_path):
    from drvqwen.format.nanoqwen_writer import NanoqwenWriter

    d = tmp_path / "models"
    d.mkdir()
    dead, live = _dead_pid(), os.getpid()
    names = {
        f"m.gguf.part-{dead}": True, f".m.nanoqwen.tmp-{dead}": True, f".rec.{dead}.tmp": True,
        f".m.gguf.wheels-{dead}-k3j2/": True, f".m.gguf.hub-{dead}-x9/": True,
        f"m.gguf.part-{live}": False, f".m.nanoqwen.tmp-{live}": False,      # a live writer's
        "m.gguf": False, "m-0123.nanoqwen": False, "notes.part-x": False,
    }
    old = time.time() - 3600
    for n in names:
        p = d / n.rstrip("/")
        if n.endswith("/"):
            p.mkdir()
            (p / "part1.whl").write_bytes(b"x" * 100)
        else:
            p.write_bytes(b"x" * 100)
        os.utime(p, (old, old))
    fresh = d / f".n.nanoqwen.tmp-{dead}"           # just written: maybe a writer in another pid namespace
    fresh.write_bytes(b"x")
    removed = {p.name for p in paths.remove_dead_leftovers(d)}
    assert removed == {n.rstrip("/") for n, gone in names.items() if gone}
    assert fresh.exists() and all((d / n.rstrip("/")).exists() for n, gone in names.items() if not gone)
    # The names the writers really use are the ones recognized.
    w = NanoqwenWriter(d / "z.nanoqwen", TINY, byte_tokenizer_json())
    assert paths._LEFTOVER.match(w.tmp.name)
    w.abort()


def test_models_dir_cleans_up_once(private_cache):
    d = private_cache / "models"
    d.mkdir(parents=True)
    left = d / f"m.gguf.part-{_dead_pid()}"
    left.write_bytes(b"x")
    os.utime(left, (time.time() - 3600,) * 2)
    paths._cleaned.discard(d)
    assert paths.models_dir() == d and not left.exists()


# ---- a damaged cached conversion is rebuilt ------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "flipped data byte"])
def test_damaged_cached_conversion_is_rebuilt(monkeypatch, tiny_gguf, damage):
    import drvqwen.models as models

    done = _count_conversions(monkeypatch)
    dst = models.resolve_model(str(tiny_gguf)).path
    if damage == "truncated":
        dst.write_bytes(dst.read_bytes()[:-5000])
    else:
        _flip_lm_head_byte(dst)
    said = []
    f = models.resolve_model(str(tiny_gguf), verify=models.verify_once, say=said.append)
    assert f.path == dst and len(done) == 2 and len(said) == 1
    assert "cached conversion is damaged" in said[0] and str(tiny_gguf) in said[0]
    f.verify_data()


def test_full_disk_advice_names_the_file_and_drvqwen_cache_only_for_cache_paths(tmp_path, private_cache, monkeypatch):
    """`eval … --json /full/a.json` said 'No space left on device (free some space, or set
    DRVQWEN_CACHE …)': no file name, and advice that cannot move a file the user named."""
    import errno
    import os as os_

    from drvqwen import paths
    from drvqwen.cli import _os_error_line

    out = tmp_path / "elsewhere" / "a.json"
    out.parent.mkdir()
    real_fdopen = os_.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(OSError) as ei:
        paths.atomic_write_bytes(out, b"{}")
    assert ei.value.filename == str(out) and list(out.parent.iterdir()) == []   # named, nothing left
    assert _os_error_line(ei.value) == f"{out}: No space left on device (free some space there)"
    inside = private_cache / "models" / "x.nanoqwen"
    assert _os_error_line(OSError(errno.ENOSPC, "No space left on device", str(inside))) == (
        f"{inside}: No space left on device (free some space, or set DRVQWEN_CACHE to a disk with room)")
    assert paths.io_advice(errno.ENOSPC, out) == "free some space there" and paths.in_cache(inside)


def test_the_default_model_s_conversion_runs_without_its_download(private_cache, rng, monkeypatch):
    """`drvqwen rm` of the default GGUF keeps its conversion (README): a run without --model then
    uses that conversion instead of fetching the 491 MB GGUF again; with the GGUF there, the
    ordinary route (by content) is taken."""
    import json

    import drvqwen.models as models
    import drvqwen.pull as pull
    from drvqwen.paths import models_dir

    mdir = models_dir()
    conv = mdir / "qwen2.5-coder-0.5b-instruct-q4_k_m-0123456789abcdef.nanoqwen"
    write_model(conv, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    gguf = mdir / pull.GGUF_NAME
    rec = {"format": models.VERSION, "layout": models.quant.LAYOUT_ID, "quantizer": models.quant.QUANTIZER_VERSION,
           "weights": "source", "source": str(gguf.resolve()), "digest": "x"}
    models._sidecar(conv).write_text(json.dumps(rec))
    monkeypatch.setattr(pull, "ensure_default_gguf", lambda progress=True: pytest.fail("fetched the GGUF again"))
    said = []
    assert models.resolve_model(None, say=said.append).path == conv
    assert said and "the download was removed" in said[0]
    gguf.write_bytes(b"GGUF")   # the download is back: not this shortcut
    assert models.conversion_of_source(gguf, mdir) is None
