"""The `drvqwen` command line: the parser of every command, and how a command ends.

Each command lives with its own code and registers itself here (`COMMANDS`): run and chat
(run_cli.py), pull, list and rm (cache_cli.py), convert and info (nanoqwen_cli.py), bench
(bench.py), serve (server/main.py), step (step/), eval (eval_cli.py). A command line that
starts with a command imports that command's module alone: `drvqwen run` waits for no server
or benchmark code before its first token. Those that run a model open it through loading.py;
none of them imports this module, which only the entry point (_entry.py) does.

User errors (DrvqwenError) and I/O errors print one line in red and exit with status 2 — no
traceback; so do the command line's own (arg_parser.py: a bad value, an unknown option). Ctrl-C at any moment prints one line and exits 130 (process_exit.py covers the
imports); a closed stdout (`drvqwen run … | head -c 5`) ends the run quietly with status 141, as
a process killed by SIGPIPE would, after the backend is closed like on Ctrl-C. Long work
(download, conversion, weight loading) shows `rich` progress bars on stderr, so stdout carries
only the generated text; output that is not a terminal is never wrapped (console.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m drvqwen.cli`: Ctrl-C during the imports, as _entry.py does
    import signal as _signal

    from drvqwen.process_exit import interrupted_while_starting as _on_sigint

    _signal.signal(_signal.SIGINT, _on_sigint)

import argparse
import importlib
import os
import signal
import sys

from rich.text import Text

from . import __version__
from .arg_parser import ArgumentParser
from .console import error_line, make_console
from .errors import DrvqwenError

# 128 + SIGPIPE: how a shell reports a writer whose reader went away.
BROKEN_PIPE_STATUS = 141

# Each module of this package whose `register(sub)` adds commands, and the commands it adds, in
# the order `drvqwen --help` lists them.
COMMANDS = (
    ("run_cli", ("run", "chat")),
    ("cache_cli", ("pull", "list", "rm")),
    ("nanoqwen_cli", ("convert", "info")),
    ("bench", ("bench",)),              # TTFT and ITL, eager vs CUDA graphs
    ("server.main", ("serve",)),        # the OpenAI-compatible HTTP server
    ("step", ("step",)),                # the step-through REPL
    ("eval_cli", ("eval",)),            # HumanEval pass@1 and logit agreement
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `drvqwen`: with the commands of every module of COMMANDS, or, when `argv`
    starts with a command, of its module alone — it parses that command line the same way,
    help and errors included, without importing the other commands' code. Anything else first
    (`--help`, `--version`, a word that is no command) gets every command, to list them."""
    ap = ArgumentParser(
        prog="drvqwen", description="Qwen2.5-Coder inference on NVIDIA Hopper, annotated.",
        epilog="Models, converted files and compiled kernels are cached under $DRVQWEN_CACHE "
               "(default ~/.cache/drvqwen).")
    ap.add_argument("--version", action="version", version=f"drvqwen {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    first = argv[0] if argv else None
    for module, _names in [c for c in COMMANDS if first in c[1]] or COMMANDS:
        importlib.import_module(f".{module}", __package__).register(sub)
    return ap


def _help_of(argv: list[str], args, extra: list[str]) -> str:
    """The command whose `--help` lists the options where `extra`, unknown, was given: `drvqwen`
    when it stands before the command word, else the command and its own subcommand (a
    command's subcommands are parsed into `<command>_cmd`, as eval's)."""
    if args.cmd is None or (extra[0] in argv and argv.index(extra[0]) < argv.index(args.cmd)):
        return "drvqwen"
    sub = getattr(args, f"{args.cmd}_cmd", None)
    return " ".join(["drvqwen", args.cmd] + ([sub] if sub else []))


def _say(message) -> None:
    """Print one line on stderr; stay silent if stderr itself is gone."""
    try:
        make_console(stderr=True).print(message, soft_wrap=True)
    except OSError:
        pass


def _os_error_line(e: OSError) -> str:
    """An OSError as one line naming the path and what is needed."""
    from .paths import io_advice

    what = e.strerror or str(e)
    advice = io_advice(e.errno, e.filename)   # DRVQWEN_CACHE only where it would move the file
    hint = f" ({advice})" if advice else ""
    return f"{e.filename}: {what}{hint}" if e.filename else f"{what}{hint}"


def _interrupted() -> int:
    """Ctrl-C: the one line, and exit status 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C cannot cut the line
    _say(Text("interrupted", style="yellow"))
    return 130


def main(argv: list[str] | None = None) -> int:
    """Run one `drvqwen` command; returns the exit status (0 ok, 2 user or I/O error,
    130 interrupted, 141 stdout closed)."""
    prev_sigint = signal.getsignal(signal.SIGINT)
    try:
        # From here on Ctrl-C raises KeyboardInterrupt, so that every `finally` (closing the
        # GPU backend, removing a half-written file) runs before the one line below.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv = sys.argv[1:] if argv is None else argv
        parser = build_parser(argv)
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would name `drvqwen --help`, which does not list a command's options
            raise DrvqwenError(f"unrecognized arguments: {' '.join(extra)} ({_help_of(argv, args, extra)} --help "
                               f"shows the options)")
        if args.cmd is None:
            parser.print_help()
            return 2
        return args.fn(args)
    except DrvqwenError as e:
        _say(error_line(str(e)))
        return 2
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): nothing more can be shown, and Python's
        # final flush of stdout would fail again, so point stdout at /dev/null.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except Exception:  # best effort: stdout may be no file at all (an in-process caller's)
            pass
        return BROKEN_PIPE_STATUS
    except OSError as e:
        _say(error_line(_os_error_line(e)))
        return 2
    except KeyboardInterrupt:
        return _interrupted()
    except RuntimeError as e:
        # Python before 3.12 wraps what a class's __set_name__ raises (a cached_property's,
        # while a module that defines such a class is imported) in a RuntimeError whose cause it
        # is: a Ctrl-C landing there arrives so.
        if isinstance(e.__cause__, KeyboardInterrupt):
            return _interrupted()
        raise
    finally:
        try:
            signal.signal(signal.SIGINT, prev_sigint if prev_sigint is not None else signal.default_int_handler)
        except (ValueError, TypeError):
            pass


if __name__ == "__main__":
    from drvqwen import STARTED
    from drvqwen.process_exit import leave
    from drvqwen.stats import process_started

    process_started(STARTED)
    sys.exit(leave(main()))
