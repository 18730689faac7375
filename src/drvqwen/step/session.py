"""A `drvqwen step` session: the commands, over one Machine (machine.py) and the model's tokenizer.

The session is at a place in the decode step: before any prompt, or at launch `cursor` of the
step that decodes the latest token at position `pos`. `prompt`/`chat` run the prefill and stop
at the first launch of the next decode step; `next`, `until` and `token` run launches; `gen`
finishes the step and runs whole steps at full speed (CUDA graphs on the GPU). Every command
reports through the rich Console it is given; bad input raises DrvqwenError, which the REPL
(repl.py) prints as one line before it reads the next command.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.text import Text

from ..errors import DrvqwenError
from ..generate import check_prompt_ids
from ..tokenizer import Tokenizer
from . import inspect
from . import render as R
from .machine import LaunchReport, Machine

# How many candidates `prompt` and `token` show.
TOP_K = 5


def unescape(text: str) -> str:
    r"""A typed line's escapes: \n newline, \t tab, \\ backslash (a REPL line has no newline)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _count(arg: str, what: str) -> int:
    try:
        n = int(arg)
    except ValueError:
        raise DrvqwenError(f"{what}: {arg!r} is not a number") from None
    if n < 1:
        raise DrvqwenError(f"{what}: {n} must be at least 1")
    return n


class Session:
    """The state of one REPL and its commands (see the module doc).

    Args:
        machine: CpuMachine or GpuMachine.
        tokenizer: the model's tokenizer.
        out: where everything is printed.
        eog_ids: the ids that end `gen`.
    Attributes:
        tokens: the tokens chosen so far (token 0 from the prefill, then one per step).
        mismatches: launches that reported MISMATCH (the GPU), for scripted runs.
    """

    def __init__(self, machine: Machine, tokenizer: Tokenizer, out: Console, eog_ids=frozenset()) -> None:
        self.m, self.tok, self.out = machine, tokenizer, out
        self.eog_ids = frozenset(eog_ids)
        self.prompt_ids: list[int] | None = None
        self.tokens: list[int] = []
        self.mismatches = 0

    # ---- helpers --------------------------------------------------------------------------------
    def say(self, *things) -> None:
        for t in things:
            self.out.print(t if not isinstance(t, str) else Text(t), soft_wrap=True)

    def _need_prompt(self) -> None:
        if self.prompt_ids is None:
            raise DrvqwenError("no sequence yet: start one with `prompt TEXT` or `chat TEXT`")

    @property
    def total(self) -> int:
        return len(self.m.entries)

    def _where(self) -> str:
        m = self.m
        e = m.entries[m.cursor]
        return f"step at position {m.pos} (decodes token {self.tokens[-1]}): next launch [{e.index}] {e.name}"

    def _after(self, r: LaunchReport, lines: Callable[[LaunchReport], None]) -> None:
        """Book-keeping after every launch: count mismatches, note a finished step's token."""
        if self.m.device != "cpu" and r.checked and not r.ok:
            self.mismatches += 1
        lines(r)
        if self.m.cursor == 0:
            t = self.m.next_token()
            self.tokens.append(t)
            self.say(Text(f"      step done: token {t} {R.token_text(self.tok.decode([t]))} chosen; "
                          f"the next step decodes it at position {self.m.pos}", style="bold"))

    def _run(self, n: int, detail: bool) -> list[LaunchReport]:
        out = []
        for _ in range(n):
            r = self.m.run_next()
            out.append(r)
            if detail:
                self._after(r, lambda r: self.say(*R.launch_detail(r, self.total, self.m.device)))
            else:
                self._after(r, lambda r: self.say(R.launch_line(r, self.total, self.m.device)))
        return out

    # ---- commands -------------------------------------------------------------------------------
    def cmd_prompt(self, arg: str) -> None:
        if not arg:
            raise DrvqwenError("prompt: give the text (\\n for a newline)")
        self._start(self.tok.encode(unescape(arg), special=True), "as typed (special tokens parsed)")

    def cmd_chat(self, arg: str) -> None:
        if not arg:
            raise DrvqwenError("chat: give the user message")
        self._start(self.tok.chat(unescape(arg)), "in the chat template")

    def start_ids(self, ids: list[int], how: str = "given as ids") -> None:
        """Start a sequence from token ids (what `prompt` and `chat` do after encoding)."""
        self._start(list(ids), how)

    def _start(self, ids: list[int], how: str) -> None:
        if not ids:
            raise DrvqwenError("the prompt is empty (0 tokens)")
        check_prompt_ids(ids, self.m.config.vocab_size, "the model")
        if len(ids) >= self.m.max_context:
            raise DrvqwenError(f"prompt of {len(ids)} tokens does not fit --max-context {self.m.max_context}")
        t = R.table("pos", "id", "text", title=f"prompt: {len(ids)} tokens {how}", right=("pos", "id"))
        for i, tid in enumerate(ids):
            t.add_row(str(i), str(tid), R.token_text(self.tok.decode([tid])))
        self.say(t)
        t0 = time.perf_counter()
        logits, first = self.m.start(ids)
        ms = (time.perf_counter() - t0) * 1e3
        self.prompt_ids, self.tokens = list(ids), [first]
        what = "batched prefill kernels" if self.m.device == "cuda" else "the CPU step, one token at a time"
        table, _ = R.top_candidates(self.tok, logits, TOP_K)
        table.title = f"prefill of {len(ids)} tokens ({what}): {ms:.1f} ms; first token's candidates"
        self.say(table, Text(f"chosen (greedy): {first} {R.token_text(self.tok.decode([first]))}", style="bold"),
                 self._where())

    def cmd_list(self, arg: str) -> None:
        m = self.m
        if arg and not any(e.name.startswith(arg) for e in m.entries):
            raise DrvqwenError(f"list: no launch name starts with {arg!r} (`list` alone shows them all)")
        regs = inspect.registers
        t = R.table(" ", "#", "name", "kernel", "grid × block", "smem", "regs", "bytes",
                    title=f"the decode step: {self.total} launches ({m.label})", right=("#", "smem", "regs", "bytes"))
        for e in m.entries:
            if arg and not e.name.startswith(arg):
                continue
            s = e.spec
            mark = "▶" if e.index == m.cursor and self.prompt_ids is not None else ""
            t.add_row(mark, str(e.index), e.name, s.kernel.kernel, f"{R.fmt_dims(s.grid)} × {R.fmt_dims(s.block)}",
                      R.fmt_bytes(s.smem_bytes) if s.smem_bytes else "0", regs(s.kernel),
                      R.fmt_bytes(m.bytes_of(e)) if e.first or s.bytes_moved else "—")
        self.say(t)

    def cmd_next(self, arg: str) -> None:
        self._need_prompt()
        self._run(_count(arg, "next") if arg else 1, detail=True)
        if self.m.cursor:
            self.say(self._where())

    def cmd_until(self, arg: str) -> None:
        self._need_prompt()
        if not arg:
            raise DrvqwenError("until: give a launch name (`list` shows them), e.g. L0.o_proj or lm_head")
        target = self.m.find(arg)
        if target == self.m.cursor:
            raise DrvqwenError(f"already at [{target}] {self.m.entries[target].name}: `next` runs it")
        if target < self.m.cursor:
            raise DrvqwenError(f"[{target}] {self.m.entries[target].name} already ran in this step; "
                               f"`token` finishes the step")
        self._run(target - self.m.cursor, detail=False)
        self.say(self._where())

    def cmd_token(self, arg: str) -> None:
        self._need_prompt()
        start = self.m.cursor
        reports = []
        while True:
            reports.append(self.m.run_next())
            if self.m.cursor == 0:
                break
        bad = [r for r in reports if self.m.device != "cpu" and r.checked and not r.ok]
        self.mismatches += len(bad)
        us = sum(r.time_us for r in reports)
        checked = sum(1 for r in reports if r.comparisons)
        if self.m.device == "cpu":
            verdict = Text(f"{len(reports)} launches [{start}…{self.total - 1}] run by the reference in "
                           f"{us / 1e3:.1f} ms (CPU)")
        else:
            verdict = Text(f"{len(reports)} launches [{start}…{self.total - 1}]: {us:.1f} µs of GPU time; "
                           f"{checked} checked: ")
            verdict.append_text(R.styled("all ok" if not bad else f"{len(bad)} MISMATCH"))
        self.say(verdict)
        for r in bad:
            self.say(R.launch_line(r, self.total, self.m.device), *[R.comparison_line(c) for c in r.comparisons])
        t = self.m.next_token()
        self.tokens.append(t)
        table, _ = R.top_candidates(self.tok, self.m.logits(), TOP_K)
        table.title = f"position {self.m.pos - 1}: candidates for the next token"
        self.say(table, Text(f"chosen (greedy, argmax on the {'GPU' if self.m.device == 'cuda' else 'CPU'}): "
                             f"{t} {R.token_text(self.tok.decode([t]))}", style="bold"),
                 Text(f"text so far: {self.tok.decode(self.tokens)!r}"), self._where())

    def cmd_gen(self, arg: str) -> None:
        self._need_prompt()
        n = _count(arg, "gen") if arg else 16
        if self.m.cursor:
            self.say(f"finishing the step first ({self.total - self.m.cursor} launches)")
            self.cmd_token("")
        stream = self.tok.stream_decoder()
        counts = {"decode": 0, "opens_page": 0}
        t0 = time.perf_counter()
        done, why = 0, f"{n} tokens"
        try:
            for _ in range(n):
                if self.m.pos >= self.m.max_context:
                    why = "the context is full"
                    break
                t, graph = self.m.gen_step()
                counts[graph] += 1
                self.tokens.append(t)
                done += 1
                self.out.file.write(stream.push(t))
                self.out.file.flush()
                if t in self.eog_ids:
                    why = "an end-of-generation token"
                    break
        finally:
            self.out.file.write(stream.flush() + "\n")     # Ctrl-C too: the error goes on its own line
        s = time.perf_counter() - t0
        how = ("replayed from the CUDA graphs" if self.m.device == "cuda"
               else "run by the CPU reference; on the GPU they replay the graphs")
        self.say(f"gen: {done} tokens in {s * 1e3:.1f} ms ({done / s:.1f} tok/s, stopped at {why}), {how}: "
                 f"decode ×{counts['decode']}, opens_page ×{counts['opens_page']}", self._where())

    def cmd_reset(self, arg: str) -> None:
        self.m.reset()
        self.prompt_ids, self.tokens = None, []
        self.say("sequence forgotten: every page back on the free list; start with `prompt` or `chat`")

    def cmd_show(self, arg: str) -> None:
        inspect.show(self, arg)

    def cmd_kv(self, arg: str) -> None:
        inspect.kv(self)

    def cmd_tmap(self, arg: str) -> None:
        inspect.tmap(self, arg)

    def cmd_graph(self, arg: str) -> None:
        inspect.graph(self)

    def cmd_src(self, arg: str) -> None:
        inspect.src(self, arg)

    def completions(self) -> list[str]:
        """Launch and buffer names for tab completion."""
        names = {e.name for e in self.m.entries} | {g.name for g in self.m.groups}
        names |= set(self.m.plan.buffers) | {"k_cache", "v_cache"}
        names |= {f"{p}[{l}]" for p in ("k_cache", "v_cache") for l in range(self.m.config.num_layers)}
        return sorted(names)
