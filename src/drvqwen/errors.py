"""User-facing errors, and how their messages show a value.

Every mistake a user can make (a missing file, a corrupt header, a prompt longer than the
context …) raises `DrvqwenError` with a one-line message that names the file, field or value.
The CLI prints that line and exits with a non-zero status; no traceback is shown for them.
Programming errors stay ordinary exceptions, so they keep their tracebacks.
"""

import json


class DrvqwenError(Exception):
    """A user-facing error: the message is one line naming the file, field or value at fault."""


class FormatError(DrvqwenError):
    """A `.nanoqwen` (or source checkpoint) file is malformed; the message names file and field."""


class ConfigError(DrvqwenError):
    """A model configuration is not a Qwen2 configuration drvqwen can run."""


def json_text(value, limit: int = 80) -> str:
    """A value read from JSON (a request's field, a record of a file) as its writer wrote it —
    JSON, not a Python repr: null, not None — cut to `limit` characters, for an error message.
    What UTF-8 cannot carry (a lone surrogate) is shown escaped, so the message can be sent."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
