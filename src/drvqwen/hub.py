"""Models by name: a Hugging Face repo id (`owner/name`, `owner/name:Q4_K_M`) fetched into the
cache root through `huggingface_hub`.

What a name means:

- `owner/name:TAG` — the GGUF file of the repo whose name carries the quantization TAG
  (`qwen2.5-coder-7b-instruct-q4_k_m.gguf` for `:Q4_K_M`, case-insensitive).
- `owner/name` — a repo of GGUF files: its Q4_K_M file (DEFAULT_QUANT), else its only GGUF;
  a repo of safetensors: config.json, tokenizer.json, generation_config.json and the index if
  present, and the `*.safetensors` shards — what `drvqwen convert` reads from an HF folder.

The files land in `<cache root>/hub` (`paths.hub_dir`) in the hub client's own layout
(`models--owner--name/{blobs,snapshots,refs}`), so `huggingface_hub`'s tools can read it too.
The client writes each file under a temporary name and renames it into place, and resumes an
interrupted transfer with an HTTP Range request (up to five times per file, within the same
run); a killed `pull` starts that file again on the next run. Free space for the whole
download is checked before the first byte (`paths.ensure_free_space`).

`HF_ENDPOINT` names another hub (a mirror; the tests' loopback server); `HF_TOKEN` or
`hf auth login` give access to gated repos. When the hub cannot be reached, a repo already
downloaded is used as it is, with a line saying so; otherwise the failure is one line naming
the model and why.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import paths
from .errors import DrvqwenError

DEFAULT_QUANT = "Q4_K_M"
DEFAULT_ENDPOINT = "https://huggingface.co"
# Seconds to wait for the hub's answer to one request (the listing, each file's HEAD); the
# client's default is 10 s, and a machine without a route to the hub should learn it quickly.
TIMEOUT_S = 10.0
# A hub temporary untouched this long belongs to a download that was killed (see
# _remove_abandoned_downloads).
ABANDONED_AFTER_S = 3600.0

# owner/name as the hub spells them (letters, digits, '-', '_', '.'; not starting with '.' or
# '-'), then an optional :TAG. A path that exists is never taken for a name (models.py).
_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.-]+))?$")
# Files a name never refers to: such an argument is a path that does not exist.
_FILE_SUFFIXES = (".gguf", ".nanoqwen", ".safetensors", ".json", ".bin")
# A GGUF split into parts (`-00001-of-00003.gguf`): the converter reads one file.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# The files of an HF checkpoint besides its shards (format.convert.hf_source_files reads them).
_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json")


@dataclass(frozen=True)
class ModelName:
    """A parsed model name. Attributes: repo ('owner/name'), tag (a quantization such as
    'Q4_K_M', or None)."""

    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse_name(text: str) -> ModelName | None:
    """The ModelName written in `text`, or None if it is not one (a path, a file name)."""
    m = _NAME.match(text)
    if not m or text.lower().endswith(_FILE_SUFFIXES) or ".." in text:
        return None
    return ModelName(m["repo"], m["tag"])


def quant_of(filename: str) -> str:
    """The quantization a GGUF file name carries, upper-case: the last '-' or '.' separated
    part of the stem ('qwen2.5-coder-7b-instruct-q4_k_m.gguf' → 'Q4_K_M')."""
    stem = Path(filename).name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    return re.split(r"[-.]", stem)[-1].upper()


def choose_files(name: ModelName, files: list[str]) -> list[str]:
    """The files of repo listing `files` that `name` asks for (see module doc).

    Raises:
        DrvqwenError: no file or several fit (the message lists the quantizations there are),
            or the repo holds neither a GGUF nor an HF checkpoint.
    """
    top = [f for f in files if "/" not in f]
    ggufs = sorted(f for f in top if f.lower().endswith(".gguf"))
    whole = [f for f in ggufs if not _SPLIT.search(f)]
    tags = ", ".join(sorted({quant_of(f) for f in whole})) or "none"
    if name.tag is not None or ggufs:
        if not whole:
            split = " (only GGUFs split into parts, which drvqwen cannot read)" if ggufs else ""
            raise DrvqwenError(f"{name}: {name.repo} has no GGUF file{split}")
        want = (name.tag or DEFAULT_QUANT).upper()
        hits = [f for f in whole if quant_of(f) == want]
        if name.tag is None and not hits and len(whole) == 1:
            hits = whole
        if len(hits) == 1:
            return hits
        if not hits:
            how = f"no {want} GGUF" if name.tag else f"no {DEFAULT_QUANT} GGUF and not just one"
            raise DrvqwenError(f"{name}: {name.repo} has {how} (it has {tags}; write {name.repo}:TAG)")
        raise DrvqwenError(f"{name}: several GGUF files of {name.repo} are {want}: {', '.join(hits)}")
    shards = sorted(f for f in top if f.endswith(".safetensors"))
    if shards and "config.json" in top and "tokenizer.json" in top:
        return [f for f in _HF_FILES if f in top] + shards
    raise DrvqwenError(f"{name}: {name.repo} holds neither a GGUF file nor an HF checkpoint "
                       f"(config.json, tokenizer.json, *.safetensors)")


def repo_folder(repo: str) -> Path:
    """The hub client's folder of `repo` under paths.hub_dir() ('models--owner--name')."""
    return paths.hub_dir() / ("models--" + repo.replace("/", "--"))


def endpoint() -> str:
    """The hub's address: $HF_ENDPOINT, else https://huggingface.co (read at each call, so a
    test or a mirror set after import is honoured)."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def fetch(text: str, progress: bool = True, say: Callable[[str], None] | None = None) -> Path:
    """Download the model called `text` into the cache (once); return what to convert.

    Returns:
        The GGUF file, or the snapshot folder of an HF checkpoint (config.json, tokenizer.json,
        *.safetensors), inside `paths.hub_dir()`.
    Raises:
        DrvqwenError: `text` is not a model name; the hub cannot be reached and nothing is
            cached; the repo does not exist, is gated or has no fitting files; the disk lacks
            room — one line naming the model and why.
    """
    name = parse_name(text)
    if name is None:
        raise DrvqwenError(f"{text}: not a file, and not a model name (owner/name or owner/name:TAG)")
    try:
        import huggingface_hub as hf
    except ImportError:
        raise DrvqwenError(f"{name}: huggingface_hub is not installed (pip install huggingface_hub)") from None
    hub = paths.hub_dir()
    url = endpoint()
    try:
        info = hf.HfApi(endpoint=url).model_info(name.repo, files_metadata=True, timeout=TIMEOUT_S)
    except Exception as e:  # network, HTTP, offline mode: a reason, or the copy already here
        why = _why(e)
        cached = _cached_snapshot(name) if _unreachable(e) else None
        if cached is None:
            raise DrvqwenError(f"{name}: cannot be fetched from {url} ({why})") from None
        if say is not None:
            say(f"{name}: the hub is unreachable ({why}); using the copy in the cache")
        return cached
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    files = choose_files(name, list(sizes))
    revision = info.sha or "main"
    snapshot = repo_folder(name.repo) / "snapshots" / revision
    missing = [f for f in files if not (snapshot / f).exists()]
    if missing:
        need = sum(sizes[f] or 0 for f in missing)
        paths.ensure_writable(hub, "the download")
        paths.ensure_free_space(hub, need, f"downloading {name}")
        _remove_abandoned_downloads(repo_folder(name.repo))
        if say is not None:
            what = missing[0] if len(missing) == 1 else f"{len(missing)} files"
            say(f"downloading {name} from {url}: {what}, {need / 2**20:,.1f} MiB")
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    bars_were_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        for f in files:
            snapshot = Path(_download(hf, name, f, revision, hub, url)).parent
    finally:
        if not progress and not bars_were_disabled:
            enable_progress_bars()
    return snapshot / files[0] if files[0].lower().endswith(".gguf") else snapshot


def _download(hf, name: ModelName, f: str, revision: str, hub: Path, url: str) -> str:
    """hf_hub_download of one file, its failures as one DrvqwenError line."""
    try:
        return hf.hf_hub_download(name.repo, f, revision=revision, cache_dir=hub, endpoint=url,
                                  etag_timeout=TIMEOUT_S)
    except OSError as e:
        if getattr(e, "response", None) is None and e.errno is not None:   # the disk, not the net
            raise paths.io_error(hub, e, f"write {f} of {name}") from None
        raise DrvqwenError(f"{name}: cannot download {f} ({_why(e)})") from None
    except Exception as e:
        raise DrvqwenError(f"{name}: cannot download {f} ({_why(e)})") from None


def _remove_abandoned_downloads(repo_dir: Path) -> None:
    """Delete the hub client's temporaries (`blobs/*.incomplete`) untouched for an hour: a
    download killed with SIGKILL leaves one behind (it carries no pid to ask about), and a live
    transfer writes at least every few seconds or fails within its timeout."""
    import time

    now = time.time()
    for p in (repo_dir / "blobs").glob("*.incomplete"):
        try:
            if now - p.stat().st_mtime > ABANDONED_AFTER_S:
                p.unlink()
        except OSError:
            pass


def _cached_snapshot(name: ModelName) -> Path | None:
    """What `name` means in the newest downloaded snapshot of its repo, if all of it is there."""
    folder = repo_folder(name.repo) / "snapshots"
    try:
        snaps = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                       reverse=True)
    except OSError:
        return None
    for snap in snaps:
        try:
            files = choose_files(name, [p.name for p in snap.iterdir() if p.exists()])
        except DrvqwenError:
            continue
        return snap / files[0] if files[0].lower().endswith(".gguf") else snap
    return None


def _unreachable(e: BaseException) -> bool:
    """True for a failure to reach the hub (network, timeout, offline mode, a 5xx), as
    opposed to the hub's answer that the repo is missing or closed."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status is not None:
        return status >= 500
    return isinstance(e, (OSError, TimeoutError)) or "Connect" in type(e).__name__ \
        or "Timeout" in type(e).__name__


def _why(e: BaseException) -> str:
    """One line saying why a hub call failed, in the user's terms."""
    try:
        from huggingface_hub import errors as he
    except ImportError:              # clients before huggingface_hub.errors: the same names here
        from huggingface_hub import utils as he

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, he.GatedRepoError):
        return "a gated repo: accept its terms on the hub, then log in (hf auth login or HF_TOKEN)"
    if isinstance(e, he.RepositoryNotFoundError):
        return "no such repo, or it is private (log in with hf auth login or HF_TOKEN)"
    if isinstance(e, he.RevisionNotFoundError):
        return "no such revision"
    if isinstance(e, he.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set"
    if status is not None:
        return f"HTTP {status}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
