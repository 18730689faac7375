"""drvqwen's argparse parser: the command line's own mistakes as one line, like every other.

argparse answers a bad value (`-t abc`), a choice that is none (`--device gpu`), an unknown or
a missing option with its whole usage block and exits. Here the mistake becomes a
DrvqwenError instead — what is wrong, and which `--help` shows the options — which the command
prints as every other mistake: one line on stderr, status 2 (cli.main, bench.main). The
subcommands' parsers are of this class too (add_subparsers makes its own class by default).
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from .errors import DrvqwenError


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose usage errors raise DrvqwenError (one line, no usage block).

    Raises:
        DrvqwenError: from parse_args, `<argparse's message> (<prog> --help shows the options)`.
    """

    def error(self, message: str) -> NoReturn:
        raise DrvqwenError(f"{message} ({self.prog} --help shows the options)")
