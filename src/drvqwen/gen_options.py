"""The generation options of `drvqwen run` and `drvqwen chat`: their arguments, the checks that
refuse conflicting ones, the sampling parameters they make, and where the prompt comes from.

Prompt sources of `run`, exactly one of: a positional PROMPT, `-p/--prompt TEXT`,
`--prompt-file FILE` (`-` = stdin), `--fim-prefix/--fim-suffix`, or, when none is given and
stdin is not a terminal, stdin itself (`cat task.txt | drvqwen run`). Two sources at once are
refused with one line instead of one silently winning; so are `--system` with `--raw` (a raw
prompt has no system turn) and `--eager` with `--device cpu` (the CPU has no graphs).

A sampling run (temperature > 0) without `--seed` draws a fresh seed from the OS and prints it,
so any run can be repeated; greedy runs need none.

Speculative decoding (docs/speculative.md): `--lookup N` (prompt lookup) or `--draft MODEL`
(a draft model, `--draft-max K` tokens per verify pass), one proposer at a time.
"""

from __future__ import annotations

import argparse
import sys

from .errors import DrvqwenError
from .sampler import GREEDY_TEMPERATURE, PENALTY_WINDOW, SamplingParams


# What every front door's --model takes (loading.open_model, one path to a model for all).
MODEL_SOURCES = (".nanoqwen file, HF folder, GGUF, a Hugging Face repo id owner/name[:TAG] (as drvqwen pull; "
                 "fetched once) or a name drvqwen list shows")
MODEL_HELP = f"{MODEL_SOURCES} (default: the real Qwen2.5-Coder-0.5B-Instruct)"


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--model, --device, --max-context, --no-verify, --eager (run and chat)."""
    ap.add_argument("-m", "--model", help=MODEL_HELP)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: a Hopper GPU when present, else the numpy reference on the CPU (default: auto)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip the one-time CRC32 check of the model's tensor data (faster first "
                         "start; a damaged file then gives garbage instead of an error)")
    ap.add_argument("--eager", action="store_true",
                    help="GPU: launch the decode kernels one by one instead of replaying CUDA graphs "
                         "(refused with --device cpu)")


def add_sampling_arguments(ap: argparse.ArgumentParser, max_new_default: int) -> None:
    """Sampling options shared by run and chat."""
    ap.add_argument("-n", "--max-new-tokens", type=int, default=max_new_default,
                    help=f"tokens to generate at most (default: {max_new_default})")
    ap.add_argument("-t", "--temperature", "--temp", type=float, default=0.0,
                    help="0 = greedy (default: 0)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1 = off)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="keep tokens at least this likely relative to the most likely one, after "
                         "temperature (default: 0 = off)")
    ap.add_argument("--repeat-penalty", type=float, default=1.0,
                    help=f"llama.cpp's repeat penalty over the last {PENALTY_WINDOW} tokens, prompt "
                         f"included: positive logits divided by it, negative ones multiplied "
                         f"(default: 1 = off; 1.1 is common)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sampler's Philox stream (default: a fresh random seed, printed, "
                         "when sampling)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="do not stop at the model's end-of-generation tokens (drvqwen info lists them)")


def add_speculation_arguments(ap: argparse.ArgumentParser) -> None:
    """--lookup, --draft, --draft-max (run and chat; docs/speculative.md)."""
    from .speculative import MAX_PROPOSAL

    ap.add_argument("--lookup", type=int, metavar="N",
                    help=f"speculative decoding by prompt lookup: propose up to N tokens (1-{MAX_PROPOSAL}) "
                         f"copied from where the latest tokens occurred before, in the prompt or the output")
    add_draft_arguments(ap, "speculative decoding with a draft model: a smaller model of the same tokenizer "
                            "(named as for --model) proposes the tokens")


def add_draft_arguments(ap: argparse.ArgumentParser, draft_help: str, draft_max_help: str = "") -> None:
    """--draft MODEL and --draft-max K (run, chat, serve), with the command's own words."""
    from .speculative import DEFAULT_DRAFT_MAX, MAX_PROPOSAL

    ap.add_argument("--draft", metavar="MODEL", help=draft_help)
    ap.add_argument("--draft-max", type=int, metavar="K",
                    help=f"tokens the draft model proposes per verify pass{draft_max_help} (1-{MAX_PROPOSAL}, "
                         f"default {DEFAULT_DRAFT_MAX})")


def check_speculation_options(args) -> None:
    """One proposer at most, and proposal lengths in range (one line each; serve has no --lookup)."""
    from .speculative import check_max_tokens

    lookup = getattr(args, "lookup", None)
    if args.draft is not None and not args.draft.strip():  # before the target's seconds of loading
        raise DrvqwenError("--draft is empty: give a file, a repo id or a name drvqwen list shows")
    if lookup is not None and args.draft is not None:
        raise DrvqwenError("--lookup with --draft: choose one way to propose tokens")
    if args.draft_max is not None and args.draft is None:
        raise DrvqwenError("--draft-max: only with --draft MODEL")
    if lookup is not None:
        check_max_tokens(lookup, "--lookup")
    if args.draft_max is not None:
        check_max_tokens(args.draft_max, "--draft-max")


def speculates(args) -> bool:
    """Whether the options ask for speculative decoding (--lookup or --draft): the target's
    backend is then built for it (loading.build_backend's `speculative`)."""
    return getattr(args, "lookup", None) is not None or getattr(args, "draft", None) is not None


def speculation(args, target, max_context: int, *, cache_tokens: int | None = None, stats=None):
    """The proposer the options ask for, or None: `PromptLookup(--lookup)`, or a `DraftModel` of
    --draft loaded beside the target (`loading.load_draft`: the same path as --model, the
    target's device, the same tokenizer). Commands without --eager or --no-verify (bench) get
    the defaults: CUDA graphs, the CRC check. The caller closes it.

    Raises:
        DrvqwenError: as `loading.load_draft`.
    """
    from .speculative import DEFAULT_DRAFT_MAX, DraftModel, PromptLookup

    if args.lookup is not None:
        return PromptLookup(args.lookup)
    if args.draft is None:
        return None
    from .loading import load_draft

    backend, name = load_draft(args.draft, target, max_context, cache_tokens=cache_tokens,
                               eager=getattr(args, "eager", False), verify=not getattr(args, "no_verify", False),
                               stats=stats)
    return DraftModel(backend, args.draft_max or DEFAULT_DRAFT_MAX, name=f"draft model {name}")


def add_prompt_arguments(ap: argparse.ArgumentParser) -> None:
    """The prompt sources, template, stop-string and statistics options of `run`."""
    ap.add_argument("prompt_arg", nargs="?", metavar="PROMPT",
                    help="the user message (same as --prompt)")
    ap.add_argument("-p", "--prompt", help="the user message (chat template; encoded as plain text) or the "
                                           "whole prompt with --raw")
    ap.add_argument("-f", "--prompt-file", help="read the prompt from a file (UTF-8, bytes as they are; "
                                                "- = stdin). Without any prompt option, a stdin that is "
                                                "not a terminal is read")
    ap.add_argument("--system", help="system message for the chat template (plain text; \"\" = an "
                                     "empty system turn; default: Qwen's)")
    ap.add_argument("--raw", action="store_true",
                    help="plain completion, no chat template; special tokens written in the prompt "
                         "(<|im_start|> …) ARE parsed as control ids, so you can write your own template")
    ap.add_argument("--fim-prefix", help="fill-in-the-middle: the code before the hole (plain text)")
    ap.add_argument("--fim-suffix", help="fill-in-the-middle: the code after the hole (plain text)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="end the output where STR appears (repeatable; also across tokens; STR is "
                         "not printed)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print the time of every phase (read, validate, load, prefill, decode)")
    ap.add_argument("--json-stats", metavar="FILE",
                    help="write the run's statistics as JSON to FILE (written whole, never half)")


def check_device_options(args) -> None:
    """--eager with --device cpu is refused (one line)."""
    if getattr(args, "eager", False) and args.device == "cpu":
        raise DrvqwenError("--eager: the CPU backend has no CUDA graphs to turn off (drop --eager "
                           "or use --device cuda/auto)")


def check_prompt_options(args) -> None:
    """Refuse conflicting prompt options with one line each (module doc)."""
    if args.prompt_arg is not None:
        if args.prompt is not None:
            raise DrvqwenError("give the prompt once: either PROMPT or --prompt")
        args.prompt = args.prompt_arg
    fim = args.fim_prefix is not None or args.fim_suffix is not None
    given = [name for name, on in (("--prompt", args.prompt is not None),
                                   ("--prompt-file", args.prompt_file is not None),
                                   ("--fim-prefix/--fim-suffix", fim)) if on]
    if len(given) > 1:
        raise DrvqwenError(f"{' and '.join(given)}: give one prompt source")
    if args.system is not None and args.raw:
        raise DrvqwenError("--system with --raw: a raw prompt has no chat template (write the "
                           "system turn into the prompt)")
    if args.system is not None and fim:
        raise DrvqwenError("--system with --fim-prefix/--fim-suffix: a FIM prompt has no system turn")
    if args.raw and fim:
        raise DrvqwenError("--raw with --fim-prefix/--fim-suffix: choose one prompt format")
    check_device_options(args)


def read_stdin(stdin=None) -> str:
    """All of stdin as text (bytes decoded as UTF-8, exactly like a prompt file, a byte-order
    mark at the start dropped).

    Raises:
        DrvqwenError: stdin is not UTF-8 or cannot be read.
    """
    from .text_input import decode_utf8, read_interruptibly, without_bom

    stdin = sys.stdin if stdin is None else stdin
    try:
        data = read_interruptibly(stdin.buffer.read if hasattr(stdin, "buffer") else lambda: stdin.read().encode())
    except OSError as e:
        raise DrvqwenError(f"stdin: cannot read the prompt ({e})") from None
    return without_bom(decode_utf8(data, "stdin"))


def prompt_text(args) -> str | None:
    """The prompt text of `run` (None for a FIM prompt), from the one source given.

    Raises:
        DrvqwenError: no source at all (stdin a terminal), an unreadable file, text not UTF-8.
    """
    from .text_input import read_text_file

    if args.prompt_file == "-":
        return read_stdin()
    if args.prompt_file is not None:
        return read_text_file(args.prompt_file)
    if args.prompt is not None or args.fim_prefix is not None or args.fim_suffix is not None:
        return args.prompt
    stdin = sys.stdin
    if stdin is None or stdin.isatty():
        raise DrvqwenError("give a prompt: PROMPT, --prompt TEXT, --prompt-file FILE (- = stdin), "
                           "--fim-prefix/--fim-suffix, or pipe it on stdin")
    text = read_stdin(stdin)
    if not text:
        raise DrvqwenError("stdin is empty: give a prompt (PROMPT, --prompt, --prompt-file) or pipe one")
    return text


def prompt_spec(args, text: str | None) -> dict:
    """What `run` asks the tokenizer for, as plain data (tokenizer.prompt_ids_of takes it, in
    this process or in tokenizer_worker's): FIM, --raw or the chat template around `text`."""
    if args.fim_prefix is not None or args.fim_suffix is not None:
        return {"kind": "fim", "prefix": args.fim_prefix or "", "suffix": args.fim_suffix or ""}
    if args.raw:
        return {"kind": "raw", "text": text}
    return {"kind": "chat", "text": text, "system": args.system}


def prompt_ids(args, tok, text: str | None) -> list[int]:
    """The ids `run` sends: FIM, --raw or the chat template around `text` (prompt_spec)."""
    from .tokenizer import prompt_ids_of

    return prompt_ids_of(prompt_spec(args, text), tok)


def sampling_params(args, say=None) -> SamplingParams:
    """SamplingParams from the options; a sampling run without --seed gets a fresh seed, shown
    through say(message) so that the run can be repeated with --seed.

    Raises:
        DrvqwenError: a value out of range (names the option's field and value).
    """
    if args.max_new_tokens < 0:
        raise DrvqwenError(f"--max-new-tokens={args.max_new_tokens}: must be >= 0")
    seed = args.seed
    if seed is not None and not -(2**63) <= seed < 2**64:  # the server's bounds (an int64 or a uint64)
        raise DrvqwenError(f"--seed={seed}: must be in [-2^63, 2^64 - 1] (taken modulo 2^64; omit it for a "
                           f"fresh random seed)")
    try:
        probe = SamplingParams(args.temperature, args.top_k, args.top_p, 0, args.min_p, args.repeat_penalty)
        if probe.greedy and say is not None:   # given, and changing nothing: say so rather than ignore them
            unused = [opt for opt, on in (("--top-p", args.top_p != 1.0), ("--min-p", args.min_p != 0.0),
                                          ("--seed", args.seed is not None),
                                          ("--top-k", args.top_k not in (0, 1)))
                      if on]
            if unused and args.temperature < GREEDY_TEMPERATURE:
                say(f"{', '.join(unused)}: no effect at temperature 0 (greedy); give --temperature to sample")
        if seed is None:
            seed = 0
            if not probe.greedy:
                import secrets   # only a sampled run without --seed draws one

                seed = secrets.randbits(63)
                if say is not None:
                    say(f"sampling with --seed {seed}")
        return SamplingParams(args.temperature, args.top_k, args.top_p, seed, args.min_p, args.repeat_penalty)
    except ValueError as e:
        raise DrvqwenError(str(e)) from None
