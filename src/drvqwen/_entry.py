"""The `drvqwen` command's entry point (and `python -m drvqwen`).

The SIGINT handler is installed by the first statements that run — here at import, and at the
top of `__main__.py` and of `cli.py` run as a script — before the heavy modules (rich, numpy,
tokenizers) start importing: Ctrl-C at any moment ends the process with one line and status
130 — during the imports through this handler, afterwards through `cli.main`, which turns
KeyboardInterrupt into the same line after the backend has been closed. (Only the interpreter's
own start-up, before any drvqwen code runs, is outside drvqwen's reach.)
"""

import os
import signal
import sys

INTERRUPTED_STATUS = 130          # 128 + SIGINT, what a shell reports for Ctrl-C


def interrupted_while_starting(signum, frame) -> None:
    """SIGINT before `cli.main` has taken over: nothing is open yet, so leave at once.

    os._exit, not an exception: a KeyboardInterrupt raised inside an import statement would
    print a traceback from wherever the import happened to be.
    """
    try:
        os.write(2, b"interrupted\n")
    finally:
        os._exit(INTERRUPTED_STATUS)


signal.signal(signal.SIGINT, interrupted_while_starting)


def leave(status: int) -> int:
    """Return `status` for sys.exit — except 130, with which the process leaves at once.

    CPython ends a process whose KeyboardInterrupt passed through an exec() of a string — and
    dataclasses builds every __init__ that way — by re-raising SIGINT at exit, even when the
    exception was caught and handled: the status would be "killed by SIGINT", not 130. So after
    the one line is printed and everything is closed, the streams are flushed and the process
    exits with 130 itself.
    """
    if status != INTERRUPTED_STATUS:
        return status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more to show anyway
            pass
    os._exit(status)


def main() -> int:
    """Run the command line (`cli.main`) with Ctrl-C handled from the first instruction."""
    signal.signal(signal.SIGINT, interrupted_while_starting)
    from .cli import main as cli_main

    return leave(cli_main())


if __name__ == "__main__":
    sys.exit(main())
