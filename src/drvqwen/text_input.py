"""The one way user text comes in: command-line strings, files and streams, checked as UTF-8.

Python hands command-line arguments over as `str` with the bytes that are not UTF-8 turned
into lone surrogates (U+DC80…U+DCFF, the "surrogateescape" error handler), which no encoder
accepts later on. Prompt files are code: they are read as bytes and decoded as they are,
without newline translation, so `\\r\\n` reaches the tokenizer as `\\r\\n`. Both go through
`decode_utf8`, so the same bad bytes give the same one-line error wherever they come from.

A file or a stream may start with a UTF-8 byte-order mark (EF BB BF: Notepad and some editors
write one): it marks the encoding and is no text, so it is dropped there (`without_bom`) —
from prompt files, stdin, `drvqwen chat`'s piped messages and step scripts alike — instead of
reaching the model as a token of its own. Anywhere else U+FEFF is text and stays.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from .errors import DrvqwenError


def decode_utf8(data: bytes, where: str) -> str:
    """Decode `data` as UTF-8, strictly.

    Args:
        data: the raw bytes.
        where: what they are, for the message (an option name or a file path).
    Returns:
        The text, every byte kept (no BOM stripping, no newline translation).
    Raises:
        DrvqwenError: the bytes are not valid UTF-8; names `where`, the byte and its offset.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DrvqwenError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
                           f"{e.start}: {e.reason})") from None


def without_bom(text: str) -> str:
    """`text` without the byte-order mark (U+FEFF) it starts with, if any: for the text at the
    start of a file or stream."""
    return text[1:] if text.startswith("\ufeff") else text


def checked_arg(value: str, option: str) -> str:
    """A command-line string (or a line of a stream read with surrogateescape: `chat`'s and
    `step`'s piped input) as text, or a DrvqwenError naming `option` if it is not UTF-8.

    `value` is what argparse gives (the OS bytes decoded with surrogateescape); the original
    bytes are recovered with `os.fsencode` and decoded strictly.
    """
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return decode_utf8(os.fsencode(value), option)


def read_text_file(path: str | os.PathLike, what: str = "prompt") -> str:
    """The text of a prompt file: its bytes decoded as UTF-8, exactly (CRLF stays CRLF), less a
    byte-order mark at the start.

    Raises:
        DrvqwenError: the file cannot be read (names the path and the reason) or is not UTF-8.
    """
    p = Path(path)
    try:
        data = read_interruptibly(p.read_bytes)
    except OSError as e:
        raise DrvqwenError(f"{os.fspath(path)}: cannot read {what} ({e.strerror or e})") from None   # as typed
    return without_bom(decode_utf8(data, os.fspath(path)))


# How often the main thread looks for a Ctrl-C while another thread reads, in seconds.
_SIGNAL_POLL_S = 0.1


def read_interruptibly(read: Callable[[], bytes]) -> bytes:
    """`read()` run on a thread of its own while this one waits for it, so that Ctrl-C ends a
    read that may block for good (a FIFO, a pipe, a terminal) within `_SIGNAL_POLL_S`.

    Python runs its SIGINT handler in the main thread between bytecodes; a signal that lands
    after the last check but before a blocking `read` (or `open` of a FIFO) system call starts
    interrupts nothing, and the read then waits for a writer that may never come, however long
    KeyboardInterrupt stays pending. `Thread.join` with a timeout returns to the interpreter
    every `_SIGNAL_POLL_S`, where a pending Ctrl-C is raised. On Ctrl-C the reading thread
    (a daemon) is left blocked: the process is ending.

    Returns what `read` returns; raises what it raises.
    """
    done: dict[str, object] = {}

    def work() -> None:
        try:
            done["data"] = read()
        except BaseException as e:  # handed to the waiting thread, raised there
            done["error"] = e

    t = threading.Thread(target=work, name="drvqwen-read", daemon=True)
    t.start()
    while t.is_alive():
        t.join(_SIGNAL_POLL_S)
    if "error" in done:
        raise done["error"]
    return done["data"]
