"""Shared test fixtures.

- `seed`: a fresh random seed per test, printed so a failure can be replayed
  (`DRVQWEN_SEED=… pytest …`).
- `private_cache`: a cache root of the test's own. Every other test runs in a session cache root
  whose models, hub, cubin and tokenizer folders are the user's and whose state folder
  (verified files, source hashes) is the session's (`_session_cache_state`).
- `real_gguf`: the official Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, fetched once into the
  cache root (`$DRVQWEN_CACHE`) by `drvqwen.pull` and verified by sha256.
- Slow tests carry `@pytest.mark.slow` and skip, saying so, unless DRVQWEN_SLOW=1.
- GPU tests carry `@pytest.mark.gpu`; they skip with the reason when no Hopper GPU is usable,
  and fail instead under `DRVQWEN_REQUIRE_GPU=1` (tools/gpu_check.sh sets it).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def seed(request) -> int:
    s = int(os.environ.get("DRVQWEN_SEED", secrets.randbelow(2**31)))
    print(f"\n[{request.node.name}] seed={s}")
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


# The cache folders a test session shares with the user's cache (links): the real model,
# hub downloads, compiled kernels and tokenizers are found there as before; only `state`
# (records of verified files and source hashes, keyed by device and inode) is the session's own.
SHARED_CACHE_FOLDERS = ("models", "hub", "cubin", "tokenizer")


@pytest.fixture(scope="session", autouse=True)
def _session_cache_state(tmp_path_factory):
    """A cache root for the session ($DRVQWEN_CACHE, also for the processes tests start) whose
    SHARED_CACHE_FOLDERS link to the user's cache root and whose `state` folder is new: the
    records of the throw-away files tests write (a tiny model in a temporary folder, verified
    once) stay out of the user's cache, and the inodes they are keyed by, reused after the
    session, cannot match a record of a file that no longer exists."""
    from drvqwen import paths
    from drvqwen.errors import DrvqwenError

    root = tmp_path_factory.mktemp("session_cache")
    try:
        real = paths.cache_root()
    except DrvqwenError:  # no user cache can be made: the session's root shares nothing
        real = None
    for name in SHARED_CACHE_FOLDERS if real is not None else ():
        try:
            (real / name).mkdir(exist_ok=True)
        except OSError:  # a read-only user cache: that folder is the session's own
            continue
        (root / name).symlink_to(real / name, target_is_directory=True)
    # cache.remove refuses a file whose folder resolves outside the cache root, so no entry of
    # this root can be removed: tests of rm and cache.remove run in `private_cache`.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRVQWEN_CACHE", str(root))
        yield root


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache root of this test's own ($DRVQWEN_CACHE, also for the processes it starts): for
    tests of the cache itself, and CLI tests whose records (verified files, source hashes)
    belong to throw-away models."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DRVQWEN_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def real_gguf():
    from drvqwen.pull import ensure_default_gguf

    return ensure_default_gguf(progress=False)


@pytest.fixture(scope="session")
def real_nanoqwen(request, tmp_path_factory):
    """The real 0.5B converted to INT4 (`convert --weights int4`: not the default, which keeps
    the GGUF's formats: `real_nanoqwen_source`), opened and validated.

    `DRVQWEN_REAL_MODEL=/path/model.nanoqwen` names a file converted elsewhere: the GPU
    machines have no network and no `gguf` package, so the converted file is carried there.
    Otherwise the pulled GGUF is converted once per session.
    """
    from drvqwen.format.nanoqwen import NanoqwenFile

    path = os.environ.get("DRVQWEN_REAL_MODEL")
    if path:
        return NanoqwenFile(path)
    from drvqwen.format.convert import convert

    out = tmp_path_factory.mktemp("real") / "qwen2.5-coder-0.5b-int4.nanoqwen"
    convert(request.getfixturevalue("real_gguf"), out, weights="int4")
    return NanoqwenFile(out)


@pytest.fixture(scope="session")
def real_nanoqwen_source(request, tmp_path_factory):
    """The real 0.5B kept in its GGUF's own formats (the default, `convert --weights source`:
    Q5_0, Q8_0, Q4_K, Q6_K), opened and validated. `DRVQWEN_REAL_MODEL_SOURCE=/path/model.nanoqwen`
    names a file converted elsewhere (carried to a machine without the `gguf` package);
    otherwise the pulled GGUF is converted once per session."""
    from drvqwen.format.nanoqwen import NanoqwenFile

    path = os.environ.get("DRVQWEN_REAL_MODEL_SOURCE")
    if path:
        return NanoqwenFile(path)
    from drvqwen.format.convert import convert

    out = tmp_path_factory.mktemp("real") / "qwen2.5-coder-0.5b-source.nanoqwen"
    convert(request.getfixturevalue("real_gguf"), out, weights="source")
    return NanoqwenFile(out)


def _gpu_unavailable_reason() -> str | None:
    try:
        from drvqwen.cuda.device import gpu_unavailable_reason
    except ImportError as e:  # the GPU layer itself is missing or broken
        return f"drvqwen.cuda not importable: {e}"
    return gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    # Slow tests (minutes of CPU on the real model) run on request: DRVQWEN_SLOW=1.
    if os.environ.get("DRVQWEN_SLOW") != "1":
        for it in items:
            if "slow" in it.keywords:
                it.add_marker(pytest.mark.skip(reason="slow (minutes on the CPU): run with DRVQWEN_SLOW=1"))
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("DRVQWEN_REQUIRE_GPU") == "1":
        for it in gpu_items:
            it.add_marker(pytest.mark.usefixtures("_require_gpu_fail"))
        return
    skip = pytest.mark.skip(reason=f"no usable Hopper GPU: {reason}")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture
def _require_gpu_fail():
    reason = _gpu_unavailable_reason()
    pytest.fail(f"DRVQWEN_REQUIRE_GPU=1 but no usable Hopper GPU: {reason}")


@pytest.fixture(autouse=True)
def _launch_log_marker(request):
    """Under DRVQWEN_LAUNCH_LOG (drvqwen.cuda.launch), a `# node ID` line before each test's
    launches, so tools/check_sanitize_coverage.py can tell which test launched what."""
    path = os.environ.get("DRVQWEN_LAUNCH_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"# node {request.node.nodeid}\n")
    yield
