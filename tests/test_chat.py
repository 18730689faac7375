"""`drvqwen chat` on the CPU reference: the KV cache of earlier turns is reused (only the new
turn is prefilled) and gives the tokens a from-scratch run of the whole conversation gives;
turns are dropped when the context is outgrown; the terminal loop through stdin and a
pseudo-terminal (commands, Ctrl-C stops an answer and not the chat, Ctrl-D ends it)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import pytest

from drvqwen.chat import ChatSession
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.generate import CPUBackend, generate
from drvqwen.tokenizer import Tokenizer

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

CFG = dataclasses.replace(TINY, max_position=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import numpy as np

    path = tmp_path_factory.mktemp("chat") / "tiny.nanoqwen"
    write_model(path, CFG, random_dense(CFG, np.random.default_rng(3)), tokenizer_json=byte_tokenizer_json())
    return path


def _session(path, max_context=512, max_new=12, **kw):
    f = NanoqwenFile(path)
    tok = Tokenizer.from_json(f.tokenizer_json)
    return ChatSession(tok, CPUBackend(f, max_context), f.eog_ids, max_new_tokens=max_new, **kw), f, tok


def test_second_turn_reuses_the_cache_and_matches_a_from_scratch_run(tiny):
    s, f, tok = _session(tiny)
    t1 = s.ask("hello there")
    assert t1.result.reused_tokens == 0 and len(t1.result.tokens) > 0
    cached = s.backend.cached_ids()
    ids2 = s.prompt_ids("and now?")
    # The cache holds the first prompt and the answer's ids except the last (never decoded).
    common = 0
    while common < len(cached) and cached[common] == ids2[common]:
        common += 1
    assert common == len(t1.result.tokens) - 1 + t1.result.prompt_tokens
    # The conversation keeps the generated ids themselves, closed by <|im_end|>.
    assert ids2[t1.result.prompt_tokens:t1.result.prompt_tokens + len(t1.result.tokens)] == t1.result.tokens
    assert ids2[t1.result.prompt_tokens + len(t1.result.tokens)] == tok.control_id("<|im_end|>")
    t2 = s.ask("and now?")
    assert t2.result.reused_tokens == common and t2.result.prefill_tokens == len(ids2) - common
    assert f"({common} reused from the KV cache)" in t2.result.summary()
    # From scratch: a fresh backend, the whole conversation prefilled at once.
    fresh = CPUBackend(f, 512)
    want = generate(fresh, ids2, s.max_new_tokens, stop_ids=f.eog_ids)
    assert want.tokens == t2.result.tokens and want.reused_tokens == 0


def test_reset_and_system_change_keep_what_still_matches(tiny):
    s, f, _ = _session(tiny)
    s.ask("one")
    n_sys = len(s.system_ids())
    s.reset()
    assert s.turns == []
    t = s.ask("two")
    assert t.result.reused_tokens >= n_sys          # the system turn is still cached
    s.set_system("be brief")
    t = s.ask("three")
    assert t.result.reused_tokens < n_sys           # a new system prompt: prefilled again


def test_context_overflow_drops_the_oldest_turns(tiny):
    s, f, _ = _session(tiny, max_context=160, max_new=16, system="sys")
    dropped = 0
    for i in range(8):
        t = s.ask(f"message number {i} with some words")
        dropped += t.dropped_turns
        assert len(s.prompt_ids("x")) <= 160 + 40
        if t.dropped_turns:
            assert t.result.reused_tokens >= len(s.system_ids()) - 1 or t.result.reused_tokens == 0
            assert s.messages()[0] == {"role": "system", "content": "sys"}
    assert dropped > 0 and len(s.turns) < 8
    with pytest.raises(Exception, match="context holds 160"):
        s.ask("x" * 200)


def _env(tmp_path):
    env = dict(os.environ, DRVQWEN_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    return env


def test_scripted_chat_through_stdin(tiny, tmp_path):
    save = tmp_path / "conv.json"
    script = f"hello\n/reset\nfirst\nsecond \\\nline\n/save {save}\n/save ~/home.json\n/bogus\n"
    r = subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu",
                        "-n", "6"], input=script, capture_output=True, text=True,
                       env=dict(_env(tmp_path), HOME=str(tmp_path)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("generated") == 3
    assert "conversation reset" in r.stderr and "unknown command /bogus" in r.stderr
    assert "reused from the KV cache" in r.stderr
    assert json.loads((tmp_path / "home.json").read_text()) == json.loads(save.read_text())  # ~ is home
    msgs = json.loads(save.read_text())["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "first" and msgs[3]["content"] == "second \nline"


def test_piped_message_not_utf8_is_skipped_in_one_line(tiny, tmp_path):
    """A piped line whose bytes are not UTF-8 is one line naming the byte, and the chat goes on
    (it was a traceback from the tokenizer: TypeError, TextInputSequence must be str)."""
    r = subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu", "-n", "2"],
                       input=b"caf\xe9\nhi\n", capture_output=True, env=_env(tmp_path), timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8 (byte 0xe9" in err and err.count("generated") == 1, err


@pytest.mark.parametrize("args, said", [
    (["--max-context", "10"], "--max-context=10: the system prompt and the shortest message take"),
    (["--max-context", "-5"], "--max-context=-5: must be 0 or in [1, "),
    (["-n", "-1"], "--max-new-tokens=-1: a chat answer needs at least 1"),
])
def test_chat_options_refused_before_the_model_loads(tiny, tmp_path, args, said):
    """A context no message fits (the system turn alone fills it) is refused at the start,
    not message by message with exit status 0; --max-context's 0 is chat's own default, which
    the message names; -n below 1 gets chat's reason whatever its sign."""
    r = subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu", *args],
                       input="hi\n", capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr
    if "-5" in args:
        assert "0 = 8192" in lines[0] or "0 = all of it" in lines[0], lines[0]


def test_chat_at_the_smallest_context_answers_a_one_token_message(tiny, tmp_path):
    """The context the start-up check names as the least is enough for a message of one token
    and one token of answer: the check and the turn's fit agree."""
    def chat(*args):
        return subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu",
                               "-n", "1", "--system", "", *args], input="a\n", capture_output=True, text=True,
                              env=_env(tmp_path), timeout=120)
    least = int(re.search(r"at least (\d+)", chat("--max-context", "5").stderr).group(1))
    r = chat("--max-context", str(least))
    assert r.returncode == 0 and "generated" in r.stderr and "context holds" not in r.stderr, r.stderr
    assert chat("--max-context", str(least - 1)).returncode == 2


def test_chat_commands_as_typed(tiny, tmp_path):
    """A bare /system shows the prompt in force (it set an empty one); // sends a message that
    begins with /; a tab separates a command from its argument."""
    save = tmp_path / "tab.json"
    script = f"/system\n//etc/hosts?\n/save\t{save}\n"
    r = subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu",
                        "-n", "4", "--system", "be terse"], input=script, capture_output=True, text=True,
                       env=_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "system prompt (8 characters): 'be terse'" in r.stderr and "unknown command" not in r.stderr
    msgs = json.loads(save.read_text())["messages"]
    assert [(m["role"], m["content"]) for m in msgs[:2]] == [("system", "be terse"), ("user", "/etc/hosts?")]


class Terminal:
    """The master side of a pty: `expect` reads until `needle` and consumes the output up to
    and including it (what follows stays for the next `expect`)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def expect(self, needle: bytes, timeout: float = 60.0) -> bytes:
        import select

        end = time.time() + timeout
        while needle not in self.buf:
            if time.time() > end:
                raise AssertionError(f"{needle!r} not seen in {self.buf[-400:]!r}")
            r, _, _ = select.select([self.fd], [], [], 0.5)
            if r:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:            # the child has gone
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the chat ended before {needle!r}: {self.buf[-600:]!r}")
                self.buf += chunk
        i = self.buf.index(needle) + len(needle)
        seen, self.buf = self.buf[:i], self.buf[i:]
        return seen


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_chat_in_a_pseudo_terminal_ctrl_c_stops_the_answer_not_the_chat(tiny, tmp_path):
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal session with the pty as its controlling terminal
        os.execve(sys.executable, [sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device",
                                   "cpu", "-n", "100000", "--ignore-eos", "--max-context", "4096"], _env(tmp_path))
    term = Terminal(fd)
    try:
        term.expect(b">>> ")
        os.write(fd, b"hi\r")
        term.expect(b"hi\r\n")
        term.expect(b"\xef\xbf\xbd", timeout=120)      # the answer (up to 4000 tokens) streams:
        time.sleep(0.2)                                 # this model writes bytes that are not UTF-8
        os.write(fd, b"\x03")                           # Ctrl-C during the answer
        out = term.expect(b"answer stopped")
        term.expect(b">>> ")
        os.write(fd, b"/reset\r")
        term.expect(b"conversation reset")
        term.expect(b">>> ")
        # Not at once: readline prints the prompt before it waits for input (select), and a
        # SIGINT that lands in between is only seen with the next key (CPython's readline).
        time.sleep(0.2)
        os.write(fd, b"\x03")                           # Ctrl-C at the prompt: a fresh line
        term.expect(b">>> ")
        os.write(fd, b"\x04")                           # Ctrl-D: the chat ends
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out[-400:]
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
