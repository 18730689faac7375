"""The one cache root (docs/architecture.md#the-parts-and-where-they-live).

`$DRVQWEN_CACHE` if set, else `$XDG_CACHE_HOME/drvqwen`, else `~/.cache/drvqwen`. It holds
downloaded models (`models/`), converted `.nanoqwen` files (`models/`) and compiled cubins
(`cubin/`). Tests use the same root, so a model fetched once serves every later run.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Return the cache root directory (created if missing)."""
    env = os.environ.get("DRVQWEN_CACHE")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "drvqwen"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Directory for downloaded and converted models."""
    d = cache_root() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cubin_dir() -> Path:
    """Directory for NVRTC-compiled cubins (keyed by source hash, options, NVRTC version, arch)."""
    d = cache_root() / "cubin"
    d.mkdir(parents=True, exist_ok=True)
    return d
