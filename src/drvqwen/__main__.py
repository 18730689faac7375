"""`python -m drvqwen`: the same as the `drvqwen` command."""

# The handler goes in before anything else runs: `_signal` (the C module under `signal`) and
# `os` (already loaded by the interpreter's start-up) import without running Python code,
# where `import signal` builds its enum classes first — a few milliseconds in which a Ctrl-C
# would be a traceback out of this file.
import _signal
import os


def _interrupted(signum, frame):
    # The same as process_exit.interrupted_while_starting, installed before even that small
    # module is imported: the first thing `python -m drvqwen` runs of drvqwen's own.
    os.write(2, b"interrupted\n")
    os._exit(130)


_signal.signal(_signal.SIGINT, _interrupted)

import sys  # noqa: E402

from ._entry import main  # noqa: E402

sys.exit(main())
