"""`drvqwen chat`: a multi-turn conversation that reuses the KV cache of earlier turns.

The conversation is kept as token ids, never as text to be tokenized again:

    system turn   <|im_start|>system\\n{system}<|im_end|>\\n
    per turn      <|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n{answer ids}<|im_end|>\\n
    next prompt   … <|im_start|>user\\n{new message}<|im_end|>\\n<|im_start|>assistant\\n

where {answer ids} are exactly the ids the model generated (decoding them to text and encoding
the text again could give other ids: then the cache would no longer match and the model would
see a conversation it did not write). The first turn's ids are `Tokenizer.chat`'s. Each turn's
prompt is the whole conversation; the backend keeps the cached positions it starts with
(generate.reused_prefix) and prefills only the new turn, and the turn says how many it reused.

When the next prompt plus the answer's room (`answer_room`) would pass the context, the oldest
turns are dropped — the system turn stays — and the conversation is prefilled again from the
system turn on; the session says so.

The terminal loop (`chat_loop`): readline history and editing on a terminal; a line ending in
a backslash continues on the next line; `/reset`, `/system TEXT` (alone: shows it), `/save
FILE`, `/quit` (or Ctrl-D) and `/help`; `//…` sends a message that begins with `/`. Ctrl-C
during an answer stops the answer (what was generated stays in the conversation, closed with
<|im_end|>), not the chat; at the input prompt it clears the line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, TextIO

from .errors import DrvqwenError
from .generate import Backend, GenerationResult, generate
from .sampler import SamplingParams
from .speculative import Proposer
from .text_input import checked_arg, without_bom
from .stream_decoder import StreamDecoder
from .tokenizer import DEFAULT_SYSTEM, IM_END, IM_START, Tokenizer

HELP = ("commands: /reset (forget the conversation), /system TEXT (new system prompt; alone: show "
        "it), /save FILE (the conversation as JSON messages), /quit (or Ctrl-D); Ctrl-C stops an "
        "answer; end a line with \\ to continue it; start it with // to send a message beginning with /")


@dataclass
class Turn:
    """One exchange: the user's text and the ids the model answered with (no <|im_end|>)."""

    user: str
    answer_ids: list[int]
    answer_text: str


@dataclass
class TurnResult:
    """What `ChatSession.ask` did: the generation, its text and whether turns were dropped."""

    result: GenerationResult
    text: str
    dropped_turns: int = 0
    interrupted: bool = False


@dataclass
class ChatSession:
    """A conversation over one backend (generate.py's: the CPU reference or the GPU engine).

    Args:
        tok: the model's tokenizer.
        backend: keeps its KV cache between turns (prefill(…, reuse=True) / token_stream(…, reuse=True)).
        stop_ids: end-of-generation ids (NanoqwenFile.eog_ids).
        params: sampling parameters (the same for every turn; token i of each answer uses
            uniform(seed, i)).
        max_new_tokens: tokens per answer at most.
        system: the system prompt ("" = an empty system turn).
        answer_room: tokens kept free for the answer when deciding to drop turns (default:
            min(max_new_tokens, max_context // 4)).
        speculation: a speculative proposer (speculative.py) for every answer, or None.
    """

    tok: Tokenizer
    backend: Backend
    stop_ids: frozenset[int]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 512
    system: str = DEFAULT_SYSTEM
    answer_room: int | None = None
    turns: list[Turn] = field(default_factory=list)
    speculation: Proposer | None = None

    def __post_init__(self):
        self._start, self._end = self.tok.control_id(IM_START), self.tok.control_id(IM_END)
        self._nl = self.tok.encode("\n")
        if self.answer_room is None:
            self.answer_room = max(1, min(self.max_new_tokens, self.backend.max_context // 4))

    # ---- ids ---------------------------------------------------------------------------------
    def system_ids(self) -> list[int]:
        return [self._start, *self.tok.encode(f"system\n{self.system}"), self._end, *self._nl]

    def _user_ids(self, user: str) -> list[int]:
        return [self._start, *self.tok.encode(f"user\n{user}"), self._end, *self._nl,
                self._start, *self.tok.encode("assistant\n")]

    def prompt_ids(self, user: str, turns: list[Turn] | None = None) -> list[int]:
        """The ids of the whole conversation with `user` as the next message, ending where the
        answer begins (module doc)."""
        ids = self.system_ids()
        for t in self.turns if turns is None else turns:
            ids += self._user_ids(t.user) + t.answer_ids + [self._end, *self._nl]
        return ids + self._user_ids(user)

    # ---- commands ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every turn (the system prompt stays; its cached positions are reused)."""
        self.turns = []

    def set_system(self, text: str) -> None:
        """A new system prompt; the turns stay (the next turn prefills the conversation again)."""
        self.system = text

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages ({"role", "content"}), system first: the system
        prompt now in force, which is what the model reads ahead of every kept turn (a new one
        re-prefills the whole conversation under it), so the file replays as the chat stands."""
        out = [{"role": "system", "content": self.system}]
        for t in self.turns:
            out += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer_text}]
        return out

    @staticmethod
    def smallest_context(tok: Tokenizer, system: str) -> int:
        """The context in tokens below which no message fits: the system turn and a user turn of
        one token (a blank line is no message), plus one token of answer (`fit`'s rule)."""
        probe = ChatSession(tok, SimpleNamespace(max_context=1), frozenset(), system=system)
        return len(probe.prompt_ids("")) + 2

    def save(self, path: str) -> None:
        """Write `messages()` as JSON to `path` (temporary file, then rename).

        Raises:
            DrvqwenError: the file cannot be written.
        """
        from .stats import write_json_atomic

        write_json_atomic(path, {"messages": self.messages()}, "the conversation")

    # ---- a turn ------------------------------------------------------------------------------
    def fit(self, user: str) -> tuple[list[int], int]:
        """The prompt ids for `user`, dropping the oldest turns until prompt + answer_room fits
        the context; returns (ids, turns dropped). The turns are dropped from the session.

        Raises:
            DrvqwenError: the system turn and this message alone do not fit.
        """
        limit = self.backend.max_context
        dropped = 0
        ids = self.prompt_ids(user)
        while len(ids) + self.answer_room > limit and self.turns:
            self.turns.pop(0)
            dropped += 1
            ids = self.prompt_ids(user)
        if len(ids) >= limit:
            raise DrvqwenError(f"this message and the system prompt take {len(ids)} tokens; the "
                               f"context holds {limit} (--max-context)")
        return ids, dropped

    def ask(self, user: str, on_text: Callable[[str], None] | None = None) -> TurnResult:
        """Answer `user`: prefill what the cache does not hold yet, generate, keep the ids.

        on_text(text) receives the answer as it streams (whole characters). A KeyboardInterrupt
        during generation stops the answer: what was generated stays in the conversation (a
        turn stopped before its first token is dropped) and the result says `interrupted`.

        Raises:
            DrvqwenError: the message does not fit the context (`fit`).
        """
        ids, dropped = self.fit(user)
        stream = StreamDecoder(self.tok)
        got: list[int] = []
        pieces: list[str] = []
        t_first: list[float] = []

        def on_token(t: int) -> None:
            if not got:
                t_first.append(time.perf_counter())
            got.append(t)
            s = stream.push(t)
            if s:
                pieces.append(s)
                if on_text:
                    on_text(s)

        interrupted = False
        t0 = time.perf_counter()
        try:
            res = generate(self.backend, ids, self.max_new_tokens, self.params, self.stop_ids, on_token,
                           reuse=True, speculation=self.speculation)
        except KeyboardInterrupt:      # the answer so far, timed as generate() would have
            interrupted = True
            t1 = t_first[0] if t_first else time.perf_counter()
            res = GenerationResult(prompt_tokens=len(ids), tokens=list(got), stopped_by="interrupted",
                                   ttft_s=t1 - t0 if got else 0.0, decode_s=time.perf_counter() - t1,
                                   reused_tokens=self.backend.last_reused if got else 0)
        tail = stream.flush()
        if tail:
            pieces.append(tail)
            if on_text:
                on_text(tail)
        text = "".join(pieces)
        res.text = text
        if got or not interrupted:     # an answer stopped before its first token is not kept
            self.turns.append(Turn(user, list(got), text))
        return TurnResult(res, text, dropped, interrupted)


# ---- the terminal ------------------------------------------------------------------------------
def _setup_readline() -> None:
    try:
        import readline  # noqa: F401  (importing it gives input() history and line editing)
    except ImportError:  # pragma: no cover - readline is missing on some platforms
        pass


def read_message(interactive: bool, stdin: TextIO, prompt: str = ">>> ") -> str | None:
    """The next user message (continuation lines joined), or None at end of input.

    A KeyboardInterrupt at the prompt propagates (the loop clears the line and asks again)."""
    lines = []
    while True:
        if interactive:
            line = input(prompt if not lines else "... ")
        else:
            line = stdin.readline()
            if not line:
                if lines:
                    return "\n".join(lines)
                return None
            line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def chat_loop(session: ChatSession, *, say: Callable[[str, str | None], None], out: TextIO | None = None,
              stdin: TextIO | None = None, interactive: bool | None = None,
              on_turn: Callable[[TurnResult], None] | None = None) -> int:
    """Talk on a terminal (or read messages from a non-terminal stdin, one per line; a
    byte-order mark at its start is no text) until end of input or /quit. Answers go to `out`
    (default sys.stdout); notices and per-turn stats to say(text, style) (a rich style name or
    None), which shows `text` as it is: it quotes what the user typed.
    Returns the number of turns answered."""
    out = sys.stdout if out is None else out
    stdin = sys.stdin if stdin is None else stdin
    if interactive is None:
        interactive = stdin.isatty() and out.isatty()
    if interactive:
        _setup_readline()
        say(HELP, "dim")
    answered, at_start = [0], [not interactive]
    while True:
        try:
            if not _one_message(session, say, out, stdin, interactive, answered, on_turn, at_start):
                if interactive:
                    out.write("\n")
                return answered[0]
        except KeyboardInterrupt:      # at the prompt, or between answers: a fresh line
            out.write("\n")
            out.flush()


def _one_message(session: ChatSession, say, out: TextIO, stdin: TextIO, interactive: bool,
                 answered: list[int], on_turn, at_start: list[bool]) -> bool:
    """Read and handle one message or command; False at the end of the chat. at_start[0]: the
    message is the first of a piped stream (text_input.without_bom)."""
    try:
        msg = read_message(interactive, stdin)
        if msg is not None:
            msg = checked_arg(msg, "the message")   # bytes a surrogateescape stdin let through
    except EOFError:
        msg = None
    except UnicodeDecodeError as e:   # a strict stdin: the line is lost, the chat goes on
        say(f"stdin: not valid UTF-8 (byte 0x{e.object[e.start]:02x}); the line is skipped", "red")
        return True
    except DrvqwenError as e:
        say(f"{e}; the message is skipped", "red")
        return True
    if msg is None:
        return False
    if at_start[0]:
        msg, at_start[0] = without_bom(msg), False
    if not msg.strip():
        return True
    if msg.startswith("//"):   # a message that itself starts with "/": typed with one more
        msg = msg[1:]
    elif msg.startswith("/"):
        cmd, arg = (msg.split(None, 1) + [""])[:2]   # a tab separates as a space does
        if cmd in ("/quit", "/exit", "/bye"):
            return False
        if cmd == "/reset":
            session.reset()
            say("conversation reset (the system prompt stays)", "dim")
        elif cmd == "/system" and not arg:   # no TEXT: show the one in force
            say(f"system prompt ({len(session.system)} characters): {session.system!r}; /system TEXT "
                f"sets another", "dim")
        elif cmd == "/system":
            session.set_system(arg)
            say(f"system prompt set ({len(arg)} characters); the next turn prefills again", "dim")
        elif cmd == "/save":
            if not arg.strip():
                say("/save FILE: give a file name", "red")
            else:
                try:
                    path = os.path.expanduser(arg.strip())   # ~/chat.json as a shell would read it
                    session.save(path)
                    n = len(session.messages())
                    say(f"saved {n} message{'s' if n != 1 else ''} to {path}", "dim")
                except (DrvqwenError, OSError) as e:
                    say(str(e), "red")
        elif cmd == "/help":
            say(HELP, "dim")
        else:
            say(f"unknown command {cmd} ({HELP})", "red")
        return True
    try:
        turn = session.ask(msg, on_text=lambda s: (out.write(s), out.flush()))
    except DrvqwenError as e:
        say(str(e), "red")
        return True
    out.write("\n")
    out.flush()
    answered[0] += 1
    if turn.dropped_turns:
        say(f"context full: dropped the oldest {turn.dropped_turns} turn(s) (the system prompt stays) "
            f"and prefilled the conversation again", "yellow")
    if turn.interrupted:
        say("answer stopped (Ctrl-C); it stays in the conversation" if turn.result.tokens else
            "answer stopped (Ctrl-C) before its first token; the message is not kept", "yellow")
    say(turn.result.summary(), "dim")
    if on_turn:
        on_turn(turn)
    return True
