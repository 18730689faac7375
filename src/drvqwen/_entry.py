"""The `drvqwen` command's entry point (and `python -m drvqwen`).

The SIGINT handler (process_exit.py) is installed at import, before `cli` and the heavy modules
it reaches (rich, numpy, tokenizers) start importing: Ctrl-C at any moment ends the process with
one line and status 130 — during the imports through that handler, afterwards through
`cli.main`, which turns KeyboardInterrupt into the same line after the backend has been closed.
(Only the interpreter's own start-up, before any drvqwen code runs, is outside drvqwen's reach.)

Before the command line is imported, `startup.start_for_command` starts what `run` and `chat`
will wait for (the CUDA driver, run's tokenizer worker); whichever way the command ends, the
worker is stopped and waited for if no request took it, and the process waits for the driver's
warm-up thread before it exits.
"""

import signal
import sys

from .process_exit import interrupted_while_starting, leave

signal.signal(signal.SIGINT, interrupted_while_starting)


def main() -> int:
    """Run the command line (`cli.main`) with Ctrl-C handled from the first instruction."""
    signal.signal(signal.SIGINT, interrupted_while_starting)
    from . import STARTED, startup, tokenizer_process
    from .cuda import warmup
    from .stats import process_started

    process_started(STARTED)        # the statistics count this process's start-up and imports
    startup.start_for_command(sys.argv[1:])  # run/chat: the driver (and run's tokenizer worker) start now
    try:
        from .cli import main as cli_main

        try:
            status = cli_main()
        finally:
            tokenizer_process.close_early()   # a worker no request reached: stopped and waited for
        return leave(status)              # Ctrl-C's status 130 leaves at once, through os._exit
    finally:
        warmup.join_started(warmup.EXIT_WAIT_S)  # never end under a thread inside libcuda


if __name__ == "__main__":
    sys.exit(main())
