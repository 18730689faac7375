"""How the `drvqwen` process ends on Ctrl-C: before the command line takes over, and with 130.

`interrupted_while_starting` is the SIGINT handler of the first statements that run (_entry.py
at import, `__main__.py`, `cli.py` run as a script), installed before the heavy modules (rich,
numpy, tokenizers) start importing; `cli.main` then turns KeyboardInterrupt into the same one
line after the backend has been closed, and `leave` makes sure the status is 130 either way.
This module imports nothing of drvqwen's, so that anything may import it first.
"""

import os
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
