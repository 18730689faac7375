"""`drvqwen step`: one decode step, launch by launch, against the numpy reference.

    machine.py       the launch list and a cursor into it; run one launch, report it
    machine_cpu.py   the step run by its numpy references (reference_steps.py) on the CPU
    machine_gpu.py   the engine's DecodeStep, Prefill and graphs on the GPU, one timed launch at a time
    session.py       the commands that run things: prompt, chat, list, next, until, token, gen, reset
    inspect.py       the commands that look: show, kv, tmap, graph, src
    render.py        tables and lines (rich on a terminal, plain text elsewhere)
    repl.py          the loop: aliases, help, history, completion, scripts, Ctrl-C

docs/step.md walks through a session.
"""

from __future__ import annotations

import argparse

from ..errors import DrvqwenError

# The KV cache of a step-through session: a few pages are plenty to watch, and a small cache
# keeps the CPU's copy and the GPU's downloads of a layer's cache small.
DEFAULT_MAX_CONTEXT = 4096


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `step` command to the CLI's subparsers (cli.build_parser)."""
    from ..gen_options import MODEL_HELP

    p = subparsers.add_parser(
        "step", help="walk one decode step launch by launch against the numpy reference (a REPL)",
        description="An interactive walk through one decode step: every named launch, what it reads and "
                    "writes, its time, its bytes, and its outputs against the numpy reference computed "
                    "from the same inputs. `help` inside lists the commands.")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): a Hopper GPU when present, else the numpy reference on the CPU")
    p.add_argument("--max-context", type=int, default=0,
                   help=f"tokens the KV cache holds (default 0: {DEFAULT_MAX_CONTEXT}, or the model's "
                        f"max_position if smaller; the attention's split grid follows it)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the one-time CRC32 check of the model's tensor data (as for run)")
    p.add_argument("--script", help="run the commands of FILE (one per line, # comments) first, echoed; "
                                    "then stop unless stdin is a terminal; exit status 1 if one of them "
                                    "printed an error")
    p.set_defaults(fn=cmd_step)
    return p


def cmd_step(args) -> int:
    """`drvqwen step`: the model opened as `drvqwen run` opens it (loading.open_model: on the
    GPU when one is usable and runs the file), then the REPL; its status (repl.run)."""
    from ..console import make_console, progress_bar
    from ..loading import open_model
    from ..tokenizer import Tokenizer
    from .repl import read_script, run
    from .session import Session

    if args.max_context < 0:  # the model's bound is checked once it is open (open_machine)
        raise DrvqwenError(f"--max-context={args.max_context}: must be >= 0 (0: the default)")
    script = read_script(args.script) if args.script else None
    opened = open_model(args.model, args.device, verify=not args.no_verify)
    f = opened.file
    if opened.device == "cpu":
        opened.say_cpu("stepping through the numpy reference")
        machine = open_machine(f, "cpu", args.max_context)
    else:  # pragma: no cover - needs a Hopper GPU (tests/test_step_gpu.py)
        with progress_bar(in_bytes=True, transient=True) as p:
            task = p.add_task("uploading weights", total=None)
            machine = open_machine(f, "cuda", args.max_context,
                                   progress=lambda done, n: p.update(task, completed=done, total=n))
    try:
        out = make_console()
        session = Session(machine, Tokenizer.of_model(f), out, f.eog_ids)
        return run(session, out, script)
    finally:
        machine.close()


def open_machine(f, device: str, max_context: int, progress=None):
    """The Machine for `device` ("cpu" or "cuda") over the model file `f`.

    Raises:
        DrvqwenError: max_context out of range, YaRN RoPE scaling (the step follows the GPU's
            decode step, which does not apply it), or the GPU step machine cannot be built.
    """
    from ..generate import resolve_max_context

    max_context = resolve_max_context(max_context, f.config.max_position,
                                      default=min(DEFAULT_MAX_CONTEXT, f.config.max_position))
    if f.config.rope_scaling is not None:
        raise DrvqwenError(f"{f.path}: YaRN RoPE scaling: drvqwen step follows the GPU's decode step, "
                           f"which does not apply it (drvqwen run --device cpu runs such a model)")
    if device == "cuda":
        from .machine_gpu import GpuMachine

        return GpuMachine(f, max_context, progress=progress)
    from .machine_cpu import CpuMachine

    return CpuMachine(f, max_context)
