"""The speculative row of `drvqwen bench` (`--lookup N`, or `--draft MODEL [--draft-max K]`).

Protocol, on real weights only (`check_real_weights`: synthetic weights repeat one token, which
every proposer guesses, so a figure on them would say nothing):

- the prompt: an edit (edit_prompts.py: EXAMPLE_FUNCTION with "add type hints", in the chat
  template), where the answer copies its input and prompt lookup can work;
- one backend, built as `drvqwen run --lookup/--draft` builds it (loading.load_backend with
  speculative=True: CUDA graphs on the GPU, the verify pass, and the decode step it matches bit
  for bit — the plain attention kernel, so the plain row is that step, not the default one with
  the TMA attention kernel), and the proposer as `run` makes it (gen_options.speculation);
- an untimed warm-up of each kind (WARMUP_TOKENS tokens), then one timed plain greedy
  generation and one timed `generate(…, speculation=proposer)`, each up to `new_tokens` tokens,
  ending at the model's end-of-generation tokens;
- per generation: tokens/s = generated tokens ÷ (t_last − t_first), the host times the first
  and the last token arrived (the edit benchmark's definition, tools/bench_edit.py), and its
  inverse in ms per generated token (the speculative stream hands out a verify pass's tokens
  at once, so its intervals are no ITL); the speculative one adds proposals, acceptance rate
  and tokens per verify pass (speculative_loop.SpeculationStats);
- whether both generated the same tokens: greedy speculation is lossless, so anything else is
  a bug.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from .console import make_console
from .edit_prompts import EXAMPLE_FUNCTION, edit_prompt
from .errors import DrvqwenError

# Tokens of each untimed warm-up generation: the decode graphs captured, every kernel and the
# proposer run once, before anything is timed.
WARMUP_TOKENS = 16
PROMPT_KIND = "edit"
PROMPT_DESCRIPTION = "edit_prompts.EXAMPLE_FUNCTION with the instruction 'type hints', chat template"


@dataclass
class TimedGeneration:
    """One timed greedy generation (times in ms).

    Attributes:
        tokens: the generated ids (a stop id not included).
        stopped_by: generate()'s reason ("max_new_tokens", "stop token", …).
        span_ms: t_last − t_first, host times of the first and last token; None below 2 tokens.
        speculation: SpeculationStats.to_dict() of a speculative run, None for plain decoding.
        generated: len(tokens).
        tok_s: generated ÷ span; None without a span.
        ms_per_token: span ÷ generated; None without a span.
    """

    tokens: list[int]
    stopped_by: str
    span_ms: float | None
    speculation: dict | None = None
    generated: int = field(init=False)
    tok_s: float | None = field(init=False)
    ms_per_token: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.generated = len(self.tokens)
        timed = self.span_ms is not None and self.span_ms > 0
        self.tok_s = self.generated / (self.span_ms * 1e-3) if timed else None
        self.ms_per_token = self.span_ms / self.generated if timed else None


def timed_generation(backend, prompt_ids: list[int], max_new_tokens: int, stop_ids: frozenset[int],
                     proposer=None) -> TimedGeneration:
    """Greedy `generate` of `prompt_ids` on `backend` (speculative with `proposer`), each token's
    arrival timed on the host (time.perf_counter).

    Raises:
        DrvqwenError: the prompt does not fit the backend's context.
    """
    from .generate import generate

    times: list[float] = []
    res = generate(backend, prompt_ids, max_new_tokens, stop_ids=stop_ids,
                   on_token=lambda _t: times.append(time.perf_counter()), speculation=proposer)
    span = (times[-1] - times[0]) * 1e3 if len(times) >= 2 else None
    return TimedGeneration(res.tokens, res.stopped_by, span,
                           res.speculation.to_dict() if res.speculation is not None else None)


def measure(backend, proposer, prompt_ids: list[int], new_tokens: int, stop_ids: frozenset[int],
            warmup_tokens: int = WARMUP_TOKENS) -> dict:
    """The protocol's runs (module doc) on a built backend and proposer.

    Returns:
        {"plain", "speculative": asdict(TimedGeneration), "same_tokens": bool,
         "speculative_over_plain_tok_s": the ratio of their tokens/s, None where one is None}.
    Raises:
        DrvqwenError: the prompt does not fit the backend's context.
    """
    timed_generation(backend, prompt_ids, min(warmup_tokens, new_tokens), stop_ids)
    timed_generation(backend, prompt_ids, min(warmup_tokens, new_tokens), stop_ids, proposer)
    plain = timed_generation(backend, prompt_ids, new_tokens, stop_ids)
    spec = timed_generation(backend, prompt_ids, new_tokens, stop_ids, proposer)
    ratio = spec.tok_s / plain.tok_s if spec.tok_s and plain.tok_s else None
    return {"plain": asdict(plain), "speculative": asdict(spec), "same_tokens": spec.tokens == plain.tokens,
            "speculative_over_plain_tok_s": ratio}


def check_speculative_options(args) -> bool:
    """Whether the parsed bench `args` ask for the speculative row; its options checked as
    `run` checks them (gen_options.check_speculation_options), and --model required.

    Raises:
        DrvqwenError: conflicting or out-of-range options; --lookup/--draft without --model.
    """
    from .gen_options import check_speculation_options

    check_speculation_options(args)
    if args.lookup is None and args.draft is None:
        return False
    if not args.model:
        option = "--lookup" if args.lookup is not None else "--draft"
        raise DrvqwenError(f"{option}: needs --model with real weights; the synthetic --preset models repeat "
                           f"one token, which every proposer guesses, so no speculative figure is measured on them")
    return True


def check_real_weights(f) -> None:
    """Refuse a model that carries the synthetic models' tokenizer (format/synthetic.py: what
    `drvqwen bench` writes for --preset): its weights are random.

    Raises:
        DrvqwenError: names the file.
    """
    from .format.synthetic import minimal_tokenizer_json

    if f.tokenizer_json == minimal_tokenizer_json():
        raise DrvqwenError(f"{f.path}: synthetic weights (it carries the synthetic models' tokenizer); "
                           f"speculative decoding is measured on real weights only")


def run_speculative_row(opened, args, max_context: int, new_tokens: int) -> dict:
    """The speculative row for the model `opened` (loading.OpenedModel) and the parsed bench
    `args` (--lookup, or --draft/--draft-max, checked by gen_options.check_speculation_options).

    Returns:
        The JSON-ready record: `measure`'s keys, the prompt (kind, description, tokens), the
        proposer and its options, the backend, how plain decoding launched its steps and the
        verify implementation.
    Raises:
        DrvqwenError: synthetic weights, a tokenizer without the chat template, a prompt that
            does not fit `max_context`, or as gen_options.speculation / loading.load_backend.
    """
    from .gen_options import speculation
    from .loading import load_backend
    from .tokenizer import Tokenizer

    f = opened.file
    check_real_weights(f)
    prompt = edit_prompt(Tokenizer.of_model(f), EXAMPLE_FUNCTION)
    backend = load_backend(opened, max_context, speculative=True)
    proposer = None
    try:
        proposer = speculation(args, opened, max_context)
        out = {"prompt_kind": PROMPT_KIND, "prompt": PROMPT_DESCRIPTION, "prompt_tokens": len(prompt),
               "new_tokens": new_tokens, "greedy": True, "stop": "the model's end-of-generation tokens",
               "warmup_tokens": WARMUP_TOKENS, "proposer": proposer.name, "lookup": args.lookup,
               "draft": args.draft, "draft_max": proposer.max_tokens if args.draft else None,
               "backend": backend.name,
               "tok_s_convention": "generated tokens / (time of the last token - time of the first), host times"}
        out.update(measure(backend, proposer, prompt, new_tokens, f.eog_ids))
        out["plain_decode_mode"] = backend.decode_mode     # token_stream's: "graph" unless capture failed
        # Whether the verify pass runs the proposals together (GPU: "VerifyPass.run") or one
        # decode step each ("DecodeVerify.verify"): what the tokens/s say depends on it.
        out["verify"] = backend.verify_implementation
        return out
    finally:
        if proposer is not None:
            proposer.close()
        backend.close()


def print_speculative(spec: dict, console: Console | None = None) -> None:
    """The speculative record as a table: plain and speculative greedy decoding of the same
    prompt, then whether their tokens agree."""
    console = console or make_console()
    t = Table(title=f"speculative decoding, {spec['prompt_kind']} prompt ({spec['prompt_tokens']} tokens), "
                    f"up to {spec['new_tokens']} greedy tokens: {spec['proposer']}",
              caption=f"{spec['backend']}; tok/s = generated ÷ (last token − first token); "
                      f"verify: {spec['verify']}")
    for c in ("mode", "generated", "tok/s", "ms per token", "proposed", "accepted", "acceptance",
              "tokens per verify pass"):
        t.add_column(c, justify="left" if c == "mode" else "right")

    def num(x, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    for mode in ("plain", "speculative"):
        r = spec[mode]
        s = r["speculation"] or {}
        t.add_row(mode, str(r["generated"]), num(r["tok_s"], ".1f"), num(r["ms_per_token"], ".3f"),
                  num(s.get("proposed"), "d"), num(s.get("accepted"), "d"), num(s.get("acceptance_rate"), ".1%"),
                  num(s.get("tokens_per_pass"), ".2f"))
    if spec["speculative_over_plain_tok_s"] is not None:
        t.add_row("speculative ÷ plain", "", f"{spec['speculative_over_plain_tok_s']:.2f}×", "", "", "", "", "")
    console.print(t)
    if spec["same_tokens"]:
        console.print("speculative and plain greedy decoding generated the same tokens")
    else:
        console.print("speculative and plain greedy decoding generated DIFFERENT tokens", style="bold red")
