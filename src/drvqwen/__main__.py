"""`python -m drvqwen`: the same as the `drvqwen` command."""

import os
import signal


def _interrupted(signum, frame):
    # The same as process_exit.interrupted_while_starting, installed before even that small
    # module is imported: the first thing `python -m drvqwen` runs of drvqwen's own.
    os.write(2, b"interrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted)

import sys  # noqa: E402

from ._entry import main  # noqa: E402

sys.exit(main())
