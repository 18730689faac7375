"""What `drvqwen run` and `chat` start before anything heavy imports, and the switches that move it.

The entry point (_entry.py) calls `start_for_command` before the command line is parsed: for a
command that may run on the GPU it starts the CUDA driver (cuda/warmup.py) and, for `run`, the
tokenizer worker (tokenizer_process.start_early), so that both overlap every import of the run
instead of waiting for the model to be open. The decision is a guess from the words of argv
alone; a run that goes to the CPU after all gives the context back and closes the worker unused.

Five measurement switches, environment variables read here and nowhere else, put each of
these back where it was before, so that tools/bench_startup.py can time them against each other
in one run (`--variant`). Each gives the same answer; only the timing differs:

    DRVQWEN_STARTUP_DRIVER_WARMUP     entry (default) | device: the driver's warm-up starts at the
                                      entry point, or when the device is chosen (loading.choose_device)
    DRVQWEN_STARTUP_TOKENIZER_WORKER  entry (default) | model: the tokenizer worker starts at the
                                      entry point, or once the model file is open
    DRVQWEN_STARTUP_ENGINE_IMPORT     overlapped (default) | after-driver: the GPU engine's imports
                                      run while the driver starts, or once it has started
                                      (loading.choose_device)
    DRVQWEN_STARTUP_UPLOAD            registered (default) | staging: the weights copied by DMA
                                      straight from the file's mapping, registered read-only
                                      (cuda.host_dma.RegisteredUploader), or through pinned staging
                                      buffers (cuda.memory.StagingUploader); registered falls back to
                                      staging where the driver refuses the registration
    DRVQWEN_STARTUP_GATHERED_UPLOAD   on (default) | off: with staging, the weights' small tensors
                                      gathered into large copies (StagingUploader's region), or
                                      each copied on its own

Only the standard library is imported at the top: this module runs before numpy or tokenizers.
"""

from __future__ import annotations

import os

from .errors import DrvqwenError

DRIVER_WARMUP = "DRVQWEN_STARTUP_DRIVER_WARMUP"
TOKENIZER_WORKER = "DRVQWEN_STARTUP_TOKENIZER_WORKER"
ENGINE_IMPORT = "DRVQWEN_STARTUP_ENGINE_IMPORT"
UPLOAD = "DRVQWEN_STARTUP_UPLOAD"
GATHERED_UPLOAD = "DRVQWEN_STARTUP_GATHERED_UPLOAD"

# Each switch's values, its default first.
SWITCHES = {
    DRIVER_WARMUP: ("entry", "device"),
    TOKENIZER_WORKER: ("entry", "model"),
    ENGINE_IMPORT: ("overlapped", "after-driver"),
    UPLOAD: ("registered", "staging"),
    GATHERED_UPLOAD: ("on", "off"),
}

# The commands that open a model through loading.choose_device with --device auto by default
# (gen_options.py): their driver start-up is worth beginning before anything else imports.
EARLY_COMMANDS = ("run", "chat")


def switch(name: str) -> str:
    """The value of measurement switch `name` (a key of SWITCHES): its environment variable, or
    the default when unset or empty.

    Raises:
        DrvqwenError: a value the switch does not take (the message names variable and value).
    """
    values = SWITCHES[name]
    value = os.environ.get(name, "") or values[0]
    if value not in values:
        raise DrvqwenError(f"{name}={value!r}: a start-up measurement switch takes {' or '.join(values)} "
                           f"(default {values[0]})")
    return value


def check_switches() -> None:
    """Raise the DrvqwenError of the first switch set to a value it does not take."""
    for name in SWITCHES:
        switch(name)


def gpu_command(argv: list[str]) -> str | None:
    """The command of `argv` (sys.argv[1:]) if it is one of EARLY_COMMANDS that may run on the GPU
    (no --device cpu, no --help), else None."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in EARLY_COMMANDS or "-h" in argv or "--help" in argv:
        return None
    for i, a in enumerate(argv):
        # argparse takes any unambiguous prefix of an option: --dev cpu, --devic=cpu ("--d"
        # would be ambiguous with --draft)
        name, eq, value = a.partition("=")
        if len(name) >= 4 and "--device".startswith(name):
            if (value if eq else argv[i + 1] if i + 1 < len(argv) else None) == "cpu":
                return None
    return words[0]


def start_for_command(argv: list[str]) -> tuple[bool, bool]:
    """At the entry point, before the command line is parsed or anything heavy imported: for a
    `gpu_command`, start the driver's warm-up (run, chat) and the tokenizer worker (run only:
    chat encodes every turn with a tokenizer of its own process), each unless its switch puts
    it later. Returns (the driver started, the worker started). A switch set to a bad value
    starts neither: run and chat then stop on its one-line error (check_switches)."""
    command = gpu_command(argv)
    if command is None:
        return False, False
    try:
        driver = switch(DRIVER_WARMUP) == "entry"
        worker = command == "run" and switch(TOKENIZER_WORKER) == "entry"
    except DrvqwenError:
        return False, False
    if worker:
        from . import tokenizer_process

        worker = tokenizer_process.start_early()
    if driver:
        from .cuda import warmup

        warmup.start_driver()
    return driver, worker
