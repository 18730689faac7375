"""Resolving a `--model` argument to a validated `.nanoqwen` file, and the conversion cache.

- nothing: the real Qwen2.5-Coder-0.5B-Instruct GGUF (pulled on first use), converted once
- a `.nanoqwen` file: opened and validated as is
- an HF folder or a GGUF file: converted once into the cache root, reused afterwards

The conversion cache is keyed by content: the sha256 of the files the converter reads, the
`.nanoqwen` format version, the weight layout, the quantizer version and the weight policy
the conversion follows (`cache_weights`: a GGUF's own formats, an HF checkpoint's INT4).
Moving or copying the cache (or the source) therefore finds the conversion again, and a new
quantizer, format or default policy converts again: a GGUF's INT4 conversion cached when INT4
was the default is not taken for the conversion in its own formats. A superseded conversion —
an older quantizer's or policy's for the same source, or one of an older file at the same
path — is removed when its successor is written, so the cache does not keep several copies
of one model.

Hashing a 15 GB checkpoint takes ~15 s, so a file's sha256 is remembered, keyed by what
changes whenever its bytes do: (device, inode, size, mtime). `drvqwen run` verifies the
tensor CRCs of a model once and remembers that the same way (`verify_once`), so a flipped
byte is caught before it becomes garbage text, and the check is paid once per file.

A cached conversion that no longer validates (truncated, damaged) is removed and converted
again from its source, with a line saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterable

from .errors import DrvqwenError, FormatError
from .format import quant
from .format import DEFAULT_WEIGHTS, weights_followed
from .format.nanoqwen import MAGIC, VERSION, NanoqwenFile
from .paths import atomic_write_bytes, models_dir, state_dir

# Called with (bytes_done, bytes_total) while hashing or verifying.
Progress = Callable[[int, int], None]
_CHUNK = 8 << 20


def resolve_model(arg: str | None, on_convert: Callable[[Path, Path], object] | None = None, *,
                  verify: Callable[[NanoqwenFile], object] | None = None,
                  say: Callable[[str], None] | None = None,
                  hash_progress: Callable[[Path], Progress | None] | None = None) -> NanoqwenFile:
    """Return the opened `.nanoqwen` for a --model argument (see module doc).

    Args:
        arg: the --model value (None: the default model).
        on_convert: on_convert(src, dst) performs a conversion with progress display; by
            default `convert(src, dst)` runs silently.
        verify: called with the opened file to check its tensor data (e.g. `verify_once`);
            a cached conversion that fails it is converted again.
        say: prints a line for the user (a damaged cached conversion being rebuilt).
        hash_progress: hash_progress(file) returns a progress callback for hashing a source
            file the first time (or None).
    Raises:
        DrvqwenError subclasses for bad input.
    """
    origin = None
    if arg is None:
        from .pull import GGUF_NAME, ensure_default_gguf

        kept = conversion_of_source(models_dir() / GGUF_NAME, models_dir())
        if kept is not None:
            # Its download was removed (drvqwen rm) to save space; the conversion is enough.
            if say is not None:
                say("the default model: using its conversion in the cache (the download was removed; "
                    "drvqwen pull fetches it again)")
            nf = NanoqwenFile(kept)
            if verify is not None:
                verify(nf)
            return nf
        src = ensure_default_gguf(progress=True)
    else:
        src = Path(arg).expanduser()
        if not src.exists():
            from . import hub

            if hub.parse_name(arg) is None:
                raise DrvqwenError(f"{arg}: file not found")   # as typed (Path drops a leading ./)
            kept = conversion_of_name(arg, models_dir())
            if kept is not None:
                # Its download was removed (drvqwen rm) to save space; the conversion is enough.
                if say is not None:
                    say(f"{arg}: using its conversion in the cache (the download was removed; "
                        f"drvqwen pull {arg} fetches it again)")
                nf = NanoqwenFile(kept)
                if verify is not None:
                    verify(nf)
                return nf
            # Not a path here: a Hugging Face repo id, fetched once into the cache.
            src, origin = hub.fetch(arg, progress=True, say=say), arg
        if src.is_file():
            with open(src, "rb") as f:
                head = f.read(8)
            if head == MAGIC or src.suffix == ".nanoqwen":
                nf = NanoqwenFile(src)
                if verify is not None:
                    verify(nf)
                return nf
    mdir = models_dir()
    digest = source_digest(src, hash_progress)
    dst = conversion_path(src, digest, mdir)
    _adopt_older_name(dst, mdir)
    if dst.exists():
        try:
            nf = NanoqwenFile(dst)
            if verify is not None:
                verify(nf)
            return nf
        except FormatError as e:
            # The cache's own file: rebuild it rather than fail the same way on every run.
            if say is not None:
                say(f"cached conversion is damaged ({e}); converting {src} again")
            dst.unlink(missing_ok=True)
    if on_convert is not None:
        on_convert(src, dst)
    else:
        convert(src, dst)
    _record_conversion(dst, src, digest, origin)
    remember_verified(dst)  # just written from the CRCs it carries
    remove_superseded(dst, src, digest, mdir)
    return NanoqwenFile(dst)


def convert(src: Path, dst: Path) -> None:
    """format.convert.convert(src, dst), silently. The converter (and the GGUF and safetensors
    readers it brings) is imported here, when a conversion happens, not with this module, which
    every run imports to find its model."""
    from .format.convert import convert as convert_source

    convert_source(src, dst)


# ---- content keys -------------------------------------------------------------------------------

def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size} {st.st_mtime_ns}"


def _record_path(kind: str, st: os.stat_result) -> Path:
    # Keyed by (device, inode): a rename or a move within one file system keeps the record.
    return state_dir() / f"{kind}-{st.st_dev}-{st.st_ino}"


def _read_record(kind: str, st: os.stat_result) -> str | None:
    try:
        stamp, _, value = _record_path(kind, st).read_text().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return value.strip() if stamp == _stamp(st) else None


def _write_record(kind: str, st: os.stat_result, value: str) -> None:
    try:
        atomic_write_bytes(_record_path(kind, st), f"{_stamp(st)}\n{value}\n".encode())
    except (OSError, DrvqwenError):
        pass  # a record only saves work next time: a read-only cache just repeats the work


def file_sha256(path: Path, progress: Progress | None = None) -> str:
    """sha256 (hex) of a file, remembered by (device, inode, size, mtime): hashed once.

    Raises:
        DrvqwenError: the file cannot be read.
    """
    try:
        st = path.stat()
        known = _read_record("sha256", st)
        if known:
            return known
        h = hashlib.sha256()
        done = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done, st.st_size)
    except OSError as e:
        raise DrvqwenError(f"{path}: cannot read ({e.strerror or e})") from None
    digest = h.hexdigest()
    if path.stat().st_mtime_ns == st.st_mtime_ns:      # not rewritten while we read it
        _write_record("sha256", st, digest)
    return digest


def source_files(src: Path) -> list[Path]:
    """The files a conversion of `src` reads: the GGUF itself, or the HF folder's config,
    generation config, tokenizer, index and shards (format.convert.hf_source_files)."""
    from .format.convert import hf_source_files

    return hf_source_files(src) if src.is_dir() else [src]


def _digest_of(named: Iterable[tuple[str, str]]) -> str:
    """The source digest from each file's (name, sha256), in source_files order."""
    h = hashlib.sha256()
    for name, sha in named:
        h.update(f"{name}:{sha};".encode())
    return h.hexdigest()


def source_digest(src: Path, hash_progress: Callable[[Path], Progress | None] | None = None) -> str:
    """sha256 over the names and contents of `source_files(src)`."""
    return _digest_of((p.name, file_sha256(p, hash_progress(p) if hash_progress else None))
                      for p in source_files(src))


def known_source_digest(src: Path) -> str | None:
    """`source_digest(src)` when every file of it has been hashed before (a sha256 record of
    its device, inode, size and mtime), else None — never reads a source: a lookup that must
    stay instant (`drvqwen info NAME`) uses it where `run` would hash tens of GB.

    Raises:
        DrvqwenError: the source's file list cannot be read (a malformed index).
    """
    named = []
    for p in source_files(src):
        try:
            known = _read_record("sha256", p.stat())
        except OSError:
            return None
        if not known:
            return None
        named.append((p.name, known))
    return _digest_of(named)


def cache_weights(src: Path) -> str:
    """The weight policy the cache's conversion of `src` follows: DEFAULT_WEIGHTS for a GGUF
    file, `int4` for an HF folder (format.weights_followed), so that an HF checkpoint's
    conversion keeps its key whichever the default."""
    return weights_followed(DEFAULT_WEIGHTS, "hf" if src.is_dir() else "gguf")


def _recorded_weights_current(rec: dict) -> bool:
    """Whether the policy in the record of a model fetched by name is the one the cache follows
    now for its kind. Its source may be gone; where it was tells the kind: a checkpoint is a
    hub snapshot folder (`…/snapshots/<revision>`, hub.fetch), a GGUF the file in it or the
    blob that file links to."""
    kind = "hf" if Path(rec.get("source", "")).parent.name == "snapshots" else "gguf"
    return rec.get("weights", "int4") == weights_followed(DEFAULT_WEIGHTS, kind)


def conversion_path(src: Path, digest: str, mdir: Path) -> Path:
    """Where the conversion of a source with content `digest` lives in the cache:
    `<source name>-<key>.nanoqwen`, the source's name for people (`cache_name`), the key
    (16 hex digits) of its content and of everything that changes the converted bytes
    (format version, layout, quantizer, the weight policy followed: `cache_weights`) for the
    lookup: a conversion by an older drvqwen is never found under a newer key, and is
    converted again."""
    key = hashlib.sha256(f"{digest}:format-{VERSION}:layout-{quant.LAYOUT_ID}:"
                         f"quantizer-{quant.QUANTIZER_VERSION}:weights-{cache_weights(src)}".encode()).hexdigest()[:16]
    return mdir / f"{cache_name(src)}-{key}.nanoqwen"


def cache_name(src: Path) -> str:
    """The readable part of a conversion's file name: the source's name in lower case, without
    `.gguf`, characters other than letters, digits, '.', '_', '-' as '_'
    ('Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf' → 'qwen2.5-coder-0.5b-instruct-q4_k_m'). A
    checkpoint fetched by name lives in a snapshot folder named by its commit: the repo's name
    stands for it ('…/models--Qwen--Qwen2.5-Coder-7B-Instruct/snapshots/<sha>' →
    'qwen2.5-coder-7b-instruct')."""
    if src.parent.name == "snapshots" and src.parent.parent.name.startswith("models--"):
        name = src.parent.parent.name.split("--")[-1]
    else:
        name = _readable_stem(src)
    return re.sub(r"[^a-z0-9._-]", "_", name.lower()).lstrip(".") or "model"


def _stem(src: Path) -> str:
    # The name as conversions were named before cache_name (the legacy pattern below).
    name = src.resolve().name if src.name in ("", ".", "..") else src.name
    return name[:-5] if name.endswith(".gguf") else name


def _readable_stem(src: Path) -> str:
    name = src.resolve().name if src.name in ("", ".", "..") else src.name
    return name[:-5] if name.lower().endswith(".gguf") else name


def _adopt_older_name(dst: Path, mdir: Path) -> None:
    """Rename a conversion with `dst`'s key but another readable name (written when names kept
    the source's case) to `dst`, with its record. A rename: a process that has the file
    mapped keeps its mapping, and of two runs doing it at once one wins, the other finds
    `dst` in place."""
    if dst.exists():
        return
    key = dst.name[-len("0123456789abcdef.nanoqwen"):]
    for old in mdir.glob(f"*-{key}"):
        if old == dst or old.name.startswith("."):
            continue
        try:
            os.replace(old, dst)
        except OSError:
            return
        try:
            os.replace(_sidecar(old), _sidecar(dst))
        except OSError:
            pass
        return


# ---- superseded conversions ---------------------------------------------------------------------

def _sidecar(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}.source.json")


def read_conversion_record(dst: Path) -> dict:
    """The record written beside a conversion (`.<name>.source.json`: source path, model name
    if fetched by one, digest, versions, the weight policy followed — absent in records written
    before there were two, whose conversions are all `int4`), or {} if there is none or it
    cannot be read."""
    try:
        rec = json.loads(_sidecar(dst).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def conversion_of_name(name: str, mdir: Path) -> Path | None:
    """The newest conversion in `mdir` made from the model called `name` by the current
    format, layout, quantizer and weight policy (`cache_weights` of its source), when the
    download it was made from is no longer in the cache; None otherwise (also when the
    download is there: the ordinary route finds the conversion by content and follows a newer
    revision). A conversion under another policy is not it: the model is fetched again."""
    return _kept_conversion(mdir, lambda rec: rec.get("name") == name)


def conversion_of_source(src: Path, mdir: Path) -> Path | None:
    """As `conversion_of_name`, for the conversion recorded as made from the file `src` (the
    default model's download, which has no name): None while `src` is there."""
    want = str(src.resolve())
    return _kept_conversion(mdir, lambda rec: rec.get("source") == want)


def _kept_conversion(mdir: Path, made_from: Callable[[dict], bool]) -> Path | None:
    """The newest current conversion whose record `made_from` accepts, when its source is gone."""
    best = None
    for p in mdir.glob("*.nanoqwen"):
        rec = read_conversion_record(p)
        if (not made_from(rec) or rec.get("format") != VERSION or rec.get("layout") != quant.LAYOUT_ID
                or rec.get("quantizer") != quant.QUANTIZER_VERSION
                or not _recorded_weights_current(rec)):
            continue
        if Path(rec.get("source", "")).exists():
            return None
        try:
            if best is None or p.stat().st_mtime > best.stat().st_mtime:
                best = p
        except OSError:
            continue
    return best


def _record_conversion(dst: Path, src: Path, digest: str, origin: str | None = None) -> None:
    data = {"source": str(src.resolve()), "digest": digest, "format": VERSION,
            "quantizer": quant.QUANTIZER_VERSION, "layout": quant.LAYOUT_ID, "weights": cache_weights(src)}
    if origin is not None:
        data["name"] = origin
    try:
        atomic_write_bytes(_sidecar(dst), json.dumps(data).encode())
    except OSError:
        pass


def remove_superseded(dst: Path, src: Path, digest: str, mdir: Path) -> list[Path]:
    """Delete the cache's other conversions of this source: same content under an older
    key (older quantizer or format), or an older content at the same path; and conversions
    of the same name from before content keys (`<stem>-<12 hex>.nanoqwen`). Returns them.

    Unlinking a file another process has mapped is safe on POSIX: it keeps its mapping.
    """
    removed = []
    source = str(src.resolve())
    legacy = re.compile(rf"^{re.escape(_stem(src))}-[0-9a-f]{{12}}\.nanoqwen$")
    for p in mdir.glob("*.nanoqwen"):
        if p == dst:
            continue
        try:
            rec = json.loads(_sidecar(p).read_text())
            stale = rec.get("source") == source or rec.get("digest") == digest
        except (OSError, ValueError, AttributeError):
            stale = bool(legacy.match(p.name))
        if stale:
            for q in (p, _sidecar(p)):
                try:
                    q.unlink(missing_ok=True)
                except OSError:
                    pass
            removed.append(p)
    return removed


# ---- verified tensor data -----------------------------------------------------------------------

def remember_verified(path: Path) -> None:
    """Record that `path`'s tensor data matched its CRCs (until its size or mtime change)."""
    try:
        _write_record("verified", path.stat(), "ok")
    except OSError:
        pass


def is_verified(path: Path) -> bool:
    """True if `path` was verified and has not changed since."""
    try:
        return _read_record("verified", path.stat()) == "ok"
    except OSError:
        return False


def verify_once(f: NanoqwenFile, progress: Progress | None = None) -> float | None:
    """Check every tensor's CRC32 unless this very file was checked before.

    Returns:
        The seconds the check took, or None if it was remembered (nothing read).
    Raises:
        FormatError: a tensor's data does not match its CRC32 (names the tensor).
    """
    if is_verified(f.path):
        return None
    total = sum(i.nbytes for i in f)
    done = 0
    t0 = time.perf_counter()

    def step(info) -> None:
        nonlocal done
        done += info.nbytes
        if progress:
            progress(done, total)

    f.verify_data(progress=step)
    remember_verified(f.path)
    return time.perf_counter() - t0
