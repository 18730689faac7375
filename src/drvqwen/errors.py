"""User-facing errors.

Every mistake a user can make (a missing file, a corrupt header, a prompt longer than the
context …) raises `DrvqwenError` with a one-line message that names the file, field or value.
The CLI prints that line and exits with a non-zero status; no traceback is shown for them.
Programming errors stay ordinary exceptions, so they keep their tracebacks.
"""


class DrvqwenError(Exception):
    """A user-facing error: the message is one line naming the file, field or value at fault."""


class FormatError(DrvqwenError):
    """A `.nanoqwen` (or source checkpoint) file is malformed; the message names file and field."""


class ConfigError(DrvqwenError):
    """A model configuration is not a Qwen2 configuration drvqwen can run."""
