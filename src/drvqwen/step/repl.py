"""The `drvqwen step` read-eval-print loop: commands, aliases, help, history and completion.

Input comes from a terminal (readline: history kept in the cache's state folder, tab completion
of command, launch and buffer names), from a pipe (`printf 'prompt def fib(n):\\nnext 3\\n' |
drvqwen step`) or from `--script FILE`; outside a terminal each command is echoed after the
prompt, so the output reads as a transcript. A bad command prints one line (`error: …`) and the
loop goes on (a script or pipe then ends with exit status 1, so a scripted walk can fail a
check); Ctrl-C stops the running command (the launches already run stay run) and returns to the
prompt; `quit`, `exit` or Ctrl-D end it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from rich.console import Console
from rich.text import Text

from ..errors import DrvqwenError
from ..text_input import checked_arg
from .session import Session

PROMPT = "step> "

# name → (arguments, what it does): the order `help` lists them in.
COMMANDS: dict[str, tuple[str, str]] = {
    "prompt": ("TEXT", "start a sequence with TEXT as typed (\\n for a newline; special tokens such as "
                       "<|im_start|> are parsed): shows its tokens, runs the prefill, shows the first "
                       "token's candidates, stops at the first launch of the next decode step"),
    "chat": ("TEXT", "the same with TEXT as the user message of the chat template"),
    "list": ("[PREFIX]", "the decode step's launches: index, name, kernel, grid × block, shared memory, "
                         "registers, bytes; ▶ marks the next one (PREFIX: only names starting with it, e.g. L3)"),
    "next": ("[N]", "run the next N launches (default 1): time, bytes, GB/s, and every buffer each wrote "
                    "against the reference computed from that launch's own inputs"),
    "until": ("NAME", "run up to launch NAME and stop before it (L5.o_proj; a prefix such as L5.attention "
                      "stops at its first launch; lm_head)"),
    "token": ("", "finish the step: its launches checked, the top candidates (id, text, logit, "
                  "probability), the chosen token, the text so far"),
    "show": ("NAME [SLICE]", "a buffer: shape, dtype, min/max/mean/std, NaN count and values (numpy slice, "
                             "e.g. 0:8 or 2,0:16), the reference beside; NAME is an activation (residual, q, "
                             "attn, h, logits, state …), k_cache[L] / v_cache[L] (by position), or a weight "
                             "(L3.q_proj dequantized, L3.input_layernorm, model.norm.weight)"),
    "kv": ("", "the block table, pages in use and free, where the next page opens, and so which decode "
               "graph replays next"),
    "tmap": ("NAME", "a TMA tensor map's fields: dtype, dims, strides, box, swizzle, interleave (k_cache, v_cache)"),
    "graph": ("", "the two decode graph execs: node counts, which replays next and why"),
    "src": ("NAME", "a launch's kernel: its file's header comment (work split, bytes, limit) and its signature"),
    "gen": ("[N]", "finish the step, then generate N tokens at full speed (default 16; CUDA graphs on "
                   "the GPU), streaming the text, and stop at the next step boundary"),
    "reset": ("", "forget the sequence (pages back to the free list)"),
    "help": ("[CMD]", "list the commands, or explain one"),
    "quit": ("", "leave (also exit, Ctrl-D)"),
}
ALIASES = {"p": "prompt", "c": "chat", "l": "list", "ls": "list", "n": "next", "u": "until", "t": "token",
           "s": "show", "x": "show", "g": "gen", "h": "help", "?": "help", "q": "quit", "exit": "quit"}


class Repl:
    """Dispatches lines to a Session (see the module doc)."""

    def __init__(self, session: Session, out: Console, echo: bool) -> None:
        self.s, self.out, self.echo = session, out, echo
        self.errors = 0         # error lines printed, from any input
        self.failed_lines = 0   # commands from a script or pipe that printed an error

    def help(self, arg: str) -> None:
        arg = arg.strip()
        if arg:
            name = ALIASES.get(arg, arg)
            if name not in COMMANDS:
                raise DrvqwenError(f"no command {arg!r} (`help` lists them)")
            args, text = COMMANDS[name]
            aliases = [a for a, n in ALIASES.items() if n == name]
            self.s.say(Text(f"{name} {args}".rstrip(), style="bold"), f"  {text}")
            if aliases:
                self.s.say(f"  aliases: {', '.join(aliases)}")
            return
        width = max(len(f"{n} {a}") for n, (a, _) in COMMANDS.items())
        for n, (a, text) in COMMANDS.items():
            self.s.say(Text(f"{f'{n} {a}'.strip():<{width}}  ", style="bold") + Text(text.split(":")[0].split(" (")[0]))
        self.s.say("aliases: " + ", ".join(f"{a}={n}" for a, n in ALIASES.items()) + "; `help CMD` explains one")

    def execute(self, line: str) -> bool:
        """Run one command line; False when it asks to quit. Errors print one line."""
        line = line.strip()
        if not line or line.startswith("#"):
            return True
        word, _, arg = line.partition(" ")
        name = ALIASES.get(word, word)
        if name == "quit":
            return False
        try:
            checked_arg(line, "the command line")   # bytes a surrogateescape stdin let through
            if name == "help":
                self.help(arg)
            elif name in COMMANDS:
                getattr(self.s, f"cmd_{name}")(arg.strip() if name not in ("prompt", "chat") else arg)
            else:
                raise DrvqwenError(f"unknown command {word!r} (`help` lists them)")
        except DrvqwenError as e:
            self.error(str(e))
        except KeyboardInterrupt:
            self.error(f"{name} interrupted (the launches already run stay run)")
        except Exception as e:  # noqa: BLE001 - a REPL stays up; the line says what broke
            self.error(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return True

    def error(self, message: str) -> None:
        self.errors += 1
        self.out.print(Text("error: ", style="bold red") + Text(message.replace("\n", " ")), soft_wrap=True)

    def run_lines(self, lines: Iterable[str], count: bool = True) -> bool:
        """Run lines from a script or a pipe, each echoed after the prompt; False if one quit.
        count: a line that printed an error adds to failed_lines (not for lines typed at a
        terminal whose output goes elsewhere)."""
        for raw in lines:
            line = raw.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if self.echo:
                self.out.print(Text(PROMPT + line, style="bold blue"), soft_wrap=True)
            errors = self.errors
            going = self.execute(line)
            self.failed_lines += count and self.errors > errors
            if not going:
                return False
        return True

    def interactive(self) -> None:
        """Read from the terminal with readline (history, completion) until quit or Ctrl-D."""
        history = _setup_readline(self.s)
        try:
            while True:
                try:
                    line = input(PROMPT)
                except EOFError:
                    self.out.print()
                    return
                except KeyboardInterrupt:
                    self.out.print("^C")
                    continue
                if not self.execute(line):
                    return
        finally:
            _save_history(history)


def _setup_readline(session: Session):
    """Tab completion of command names, then of launch and buffer names; the history file.
    Returns the history path (None where readline or the cache is unavailable)."""
    try:
        import readline
    except ImportError:          # not every Python has it; the REPL works without
        return None
    words = sorted(set(COMMANDS) | set(ALIASES))
    names = session.completions()

    def complete(text: str, state: int):
        buf = readline.get_line_buffer()
        pool = words if " " not in buf.lstrip() else names
        hits = [w for w in pool if w.startswith(text)]
        return hits[state] if state < len(hits) else None

    readline.set_completer_delims(" ")
    readline.set_completer(complete)
    readline.parse_and_bind("tab: complete")
    try:
        from ..paths import state_dir

        path = state_dir() / "step_history"
        if path.exists():
            readline.read_history_file(str(path))
        return path
    except (OSError, DrvqwenError):
        return None


def _save_history(path) -> None:
    if path is None:
        return
    try:
        import readline

        readline.set_history_length(1000)
        readline.write_history_file(str(path))
    except OSError:
        pass


def read_script(path: str) -> list[str]:
    """The lines of a `--script` file (UTF-8, read as prompt files are: text_input), each ending
    in "\\n" whatever the file's line ends.

    Raises:
        DrvqwenError: it cannot be read, or is not UTF-8 (one line naming the file and why).
    """
    from ..text_input import read_text_file

    return [line + "\n" for line in read_text_file(path, "the script").splitlines()]


def run(session: Session, out: Console, script: list[str] | None = None) -> int:
    """Run the REPL: the script's lines first (if any, `read_script`), then stdin (a terminal:
    interactively; after a script, only a terminal).

    Returns 0, or 1 when a launch reported MISMATCH or a command of the script or of piped
    input printed an error (so that a scripted run can fail a check; a mistyped command at the
    terminal does not count).
    """
    interactive = sys.stdin.isatty() and out.is_terminal
    repl = Repl(session, out, echo=not interactive or script is not None)
    going = True
    if script is not None:
        going = repl.run_lines(script)
    if going and script is None:
        if interactive:
            repl.help("")
            repl.interactive()
        else:   # a pipe, or a terminal's typing echoed to a file
            repl.run_lines(sys.stdin, count=not sys.stdin.isatty())
    elif going and interactive:
        repl.echo = False
        repl.interactive()
    return 1 if session.mismatches or repl.failed_lines else 0
