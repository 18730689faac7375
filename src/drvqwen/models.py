"""Resolving a `--model` argument to a validated `.nanoqwen` file.

- nothing: the real Qwen2.5-Coder-0.5B-Instruct GGUF (pulled on first use), converted once
- a `.nanoqwen` file: opened and validated as is
- an HF folder or a GGUF file: converted once into the cache root, reused afterwards
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .errors import DrvqwenError
from .format.convert import cached_path_for, convert
from .format.nanoqwen import MAGIC, NanoqwenFile
from .paths import models_dir


def resolve_model(arg: str | None, on_convert: Callable[[Path, Path], object] | None = None) -> NanoqwenFile:
    """Return the opened `.nanoqwen` for a --model argument (see module doc).

    on_convert(src, dst) is called to perform a conversion with progress display; by default
    `convert(src, dst)` runs silently. Raises DrvqwenError subclasses for bad input.
    """
    if arg is None:
        from .pull import ensure_default_gguf

        src = ensure_default_gguf(progress=True)
    else:
        src = Path(arg).expanduser()
        if not src.exists():
            raise DrvqwenError(f"{src}: file not found")
        if src.is_file():
            with open(src, "rb") as f:
                head = f.read(8)
            if head == MAGIC or src.suffix == ".nanoqwen":
                return NanoqwenFile(src)
    dst = cached_path_for(src, models_dir())
    if not dst.exists():
        if on_convert is not None:
            on_convert(src, dst)
        else:
            convert(src, dst)
    return NanoqwenFile(dst)
