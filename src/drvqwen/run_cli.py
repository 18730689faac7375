"""`drvqwen run` and `drvqwen chat`: generate from a prompt, or talk in the terminal.

    run    options (gen_options.py) → the prompt's text → open the model (loading.py) → the
           prompt's ids, checked against the context → load the backend (and a speculative
           proposer: --lookup, or --draft's model through the same path) → generate, streaming
           text to stdout (stop strings cut) → the stats line on stderr (--json-stats, -v)
    chat   the same model path, then chat.py's loop over one backend whose KV cache the turns
           share

Generated text goes to stdout and nothing else does; messages, progress bars and statistics
go to stderr.
"""

from __future__ import annotations

import sys

from . import gen_options as go
from . import startup
from .console import make_console
from .errors import DrvqwenError

# `drvqwen chat`'s default context: the CPU reference keeps K/V in float32 (0.5B: 96 KiB per
# token), so the model's whole 32K would take 3 GiB there; --max-context raises it.
CHAT_CONTEXT = 8192


def _say_dim(message: str) -> None:
    make_console(stderr=True).print(message, style="dim", soft_wrap=True)


def _store_tokenizer(tok, tokenizer_json: str, stats) -> None:
    """The tokenizer's cached forms, when this run had to build it: its fast-loading form
    (tokenizer_cache) and the token bytes table (token_bytes_table) that let the next GPU run
    encode in another process (tokenizer_process) — the phase "tokenizer cache" of the first
    run with a tokenizer, after its answer. Nothing when the run never built one: it decoded
    from the token bytes table (and `tokenizers` stays unimported to the end)."""
    from . import token_bytes_table

    if tok is None or isinstance(tok, token_bytes_table.TokenBytesTable):
        return
    from . import tokenizer_cache

    try:
        digest = tokenizer_cache.text_digest(tokenizer_json)
        table_missing = not token_bytes_table.table_path(digest).is_file()
    except DrvqwenError:                # no cache root: the next run builds again
        table_missing = False
    if tok.store_pending or table_missing:
        with stats.timed("tokenizer cache"):
            # A form that could not be written (a read-only cache) leaves the table useless: the
            # worker needs both, so its build is not paid after every answer.
            stored = tok.store_in_cache() if tok.store_pending else True
            if table_missing and stored:
                token_bytes_table.store(digest, tok)


def cmd_run(args) -> int:
    """`drvqwen run`: one prompt, one answer streamed to stdout; 0."""
    from .stats import RunStats

    stats = RunStats()
    with stats.recording():        # every phase below, down to the kernels, is timed into stats
        return _run(args, stats)


def _run(args, stats) -> int:
    with stats.timed("import"):
        from .generate import GenerationResult, check_prompt_fits, check_prompt_ids, generate, resolve_max_context
        from .loading import load_backend, open_model
        from .paths import check_output
        from .stats import Background, write_json_atomic
        from .stop_strings import StopStrings
        from .text_input import checked_arg
        from . import tokenizer_process
        from .stream_decoder import StreamDecoder

    err = make_console(stderr=True)
    startup.check_switches()
    go.check_prompt_options(args)
    go.check_speculation_options(args)
    params = go.sampling_params(args, say=_say_dim)
    stats.seed = None if params.greedy else params.seed
    if args.json_stats:
        check_output(args.json_stats, "the stats",
                     inputs={"the model": args.model, "the draft model": getattr(args, "draft", None),
                             "the prompt file": None if args.prompt_file in (None, "-") else args.prompt_file})
    # Every piece of user text passes the same UTF-8 check, whichever way it came in.
    for opt in ("prompt", "system", "fim_prefix", "fim_suffix"):
        v = getattr(args, opt)
        if v is not None:
            setattr(args, opt, checked_arg(v, "--" + opt.replace("_", "-")))
    args.stop = [checked_arg(s, "--stop") for s in args.stop]
    stops = StopStrings(args.stop)
    text = go.prompt_text(args)
    generating = args.max_new_tokens > 0
    opened = open_model(args.model, args.device if generating else None,
                        verify=generating and not args.no_verify, stats=stats)
    f = opened.file
    # Building the tokenizer from the file's tokenizer.json takes a few hundred milliseconds for
    # Qwen's 151k tokens and needs no GPU: on the GPU it runs on a thread of its own while the
    # backend loads, whose driver calls, copies and compiles leave the GIL to it. The CPU
    # backend sizes its KV cache from the prompt, so there it is built first, in line.
    on_gpu = generating and opened.device == "cuda"
    # One rule for both devices: the context is the model's, or less, never silently capped.
    max_context = resolve_max_context(args.max_context, f.config.max_position)
    # Where an earlier run left both cached forms, the prompt is encoded in another process
    # (tokenizer_process: its GIL is its own; started at the entry point, or else now) and the
    # answer decoded from the cached token bytes. From here on every way out closes it (the
    # `finally` below).
    remote = tokenizer_process.start_for(f.tokenizer_json, go.prompt_spec(args, text)) if on_gpu else None

    def build():
        # Imported here: where the prompt is encoded in the worker process, the `tokenizers`
        # library is never needed before the first token (stream_decoder.py).
        from .tokenizer import Tokenizer

        return Tokenizer.from_json(f.tokenizer_json, source=str(f.path), cache=True)

    tokenizer = Background("tokenizer", build, thread=on_gpu) if remote is None else None

    def checked(ids: list[int]) -> list[int]:
        check_prompt_fits(len(ids), max_context, str(f.path), f.config.max_position)
        check_prompt_ids(ids, f.config.vocab_size, str(f.path))
        return ids

    def prompt():
        """(what decodes the answer: the Tokenizer or the cached TokenBytesTable, the prompt's ids)."""
        if remote is not None:
            proc, table = remote
            with stats.timed("tokenize"):
                ids = proc.ids()
            if ids is not None:
                stats.counts["tokenizer_cached"] = stats.counts["tokenizer_process"] = 1
                if proc.seconds is not None:
                    stats.background["tokenizer process"] = proc.seconds
                return table, checked(ids)
        tok = tokenizer.result() if tokenizer is not None else Background("tokenizer", build, thread=False).result()
        stats.counts["tokenizer_cached"] = int(tok.from_cache)
        with stats.timed("tokenize"):
            ids = go.prompt_ids(args, tok, text)
        return tok, checked(ids)

    tok = ids = None
    if not on_gpu:
        tok, ids = prompt()
    if not generating:
        # Nothing to generate: the prompt's length is the whole answer; no weights are loaded.
        res = GenerationResult(prompt_tokens=len(ids))
        _store_tokenizer(tok, f.tokenizer_json, stats)
        stats.finish()
        err.print(res.summary(), style="dim", soft_wrap=True)
        if args.json_stats:
            write_json_atomic(args.json_stats, stats.to_dict(res))
        return 0

    # The CPU cache holds only what this run can use: prompt + new tokens.
    cache_tokens = None if ids is None else len(ids) + args.max_new_tokens
    out = sys.stdout
    backend = proposer = None
    try:
        backend = load_backend(opened, max_context, cache_tokens=cache_tokens, eager=args.eager, stats=stats,
                               speculative=go.speculates(args))
        proposer = go.speculation(args, opened, max_context, cache_tokens=cache_tokens, stats=stats)
        if ids is None:
            tok, ids = prompt()
        stream = StreamDecoder(tok)

        def on_token(t: int) -> bool:
            shown, stop = stops.push(stream.push(t))
            if shown:
                out.write(shown)
                out.flush()
                stats.first_output()
            return stop

        with stats.timed("generate"):
            res = generate(backend, ids, args.max_new_tokens, params, f.eog_ids, on_token,
                           ignore_stop=args.ignore_eos, speculation=proposer)
        mode = backend.decode_mode   # read before close(): graph or eager
    finally:
        if proposer is not None:
            proposer.close()
        if remote is not None:
            remote[0].close()
        if backend is not None:
            backend.close()
    tail, _ = stops.push(stream.flush())
    tail += stops.flush()
    out.write(tail + "\n")
    out.flush()
    stats.first_output()
    _store_tokenizer(tok, f.tokenizer_json, stats)  # once per tokenizer, after the answer is out
    stats.finish()
    if stops.stopped and res.stopped_by != "stop string":
        res.stopped_by = "stop string"          # found in the text held back at the end
    if res.stopped_by == "context full":
        err.print(f"warning: the context of {max_context} tokens is full: generation ended after "
                  f"{len(res.tokens)} of --max-new-tokens={args.max_new_tokens} (raise --max-context; "
                  f"the model allows {f.config.max_position})", style="yellow", soft_wrap=True)
    stats.backend = f"{backend.name}, {mode} decode" if mode else backend.name
    if args.verbose:
        for line in stats.verbose_lines(res):
            err.print(line, style="dim", soft_wrap=True)
    err.print(stats.line(res), style="dim", soft_wrap=True)
    if args.json_stats:
        write_json_atomic(args.json_stats, stats.to_dict(res))
    return 0


def cmd_chat(args) -> int:
    """`drvqwen chat`: the terminal loop (chat.py) until end of input or /quit; 0."""
    from .chat import ChatSession, chat_loop
    from .generate import resolve_max_context
    from .loading import load_backend, open_model
    from .stats import RunStats
    from .text_input import checked_arg
    from .tokenizer import DEFAULT_SYSTEM, Tokenizer

    stats = RunStats()
    startup.check_switches()
    go.check_device_options(args)
    go.check_speculation_options(args)
    if args.max_new_tokens < 1:
        raise DrvqwenError(f"--max-new-tokens={args.max_new_tokens}: a chat answer needs at least 1")
    params = go.sampling_params(args, say=_say_dim)
    system = DEFAULT_SYSTEM if args.system is None else checked_arg(args.system, "--system")
    opened = open_model(args.model, args.device, verify=not args.no_verify, stats=stats)
    f = opened.file
    tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path), cache=True)
    tok.store_in_cache()
    max_context = resolve_max_context(args.max_context, f.config.max_position,
                                      default=min(CHAT_CONTEXT, f.config.max_position))
    least = ChatSession.smallest_context(tok, system)
    if max_context < least:   # every message would be refused: say so before loading
        raise DrvqwenError(f"--max-context={max_context}: the system prompt and the shortest message take "
                           f"{least - 1} tokens; the context must hold at least {least}"
                           + (" (a shorter --system, or none)" if least > f.config.max_position else ""))
    backend = load_backend(opened, max_context, cache_tokens=max_context, eager=args.eager, stats=stats,
                           speculative=go.speculates(args))
    proposer = None
    try:
        proposer = go.speculation(args, opened, max_context, cache_tokens=max_context, stats=stats)
        session = ChatSession(tok, backend, f.eog_ids, params, args.max_new_tokens, system, speculation=proposer)
        _say_dim(f"{backend.name}: loaded in {stats.load_s:.2f} s; context {max_context} tokens")
        err = make_console(stderr=True)
        chat_loop(session, say=lambda m, style=None: err.print(m, style=style, soft_wrap=True))
    finally:
        if proposer is not None:
            proposer.close()
        backend.close()
    return 0


def register(sub) -> None:
    """Add `run` and `chat` to the CLI's subcommands."""
    r = sub.add_parser("run", help="generate text (GPU when a Hopper GPU is present, else the CPU reference)")
    go.add_prompt_arguments(r)
    go.add_model_arguments(r)
    go.add_sampling_arguments(r, max_new_default=256)
    go.add_speculation_arguments(r)
    r.add_argument("--max-context", type=int, default=0,
                   help="context length in tokens, at most the model's max_position (default 0: all of it)")
    r.set_defaults(fn=cmd_run)

    ch = sub.add_parser("chat", help="talk with the model in the terminal; each turn reuses the KV cache "
                                     "of the earlier ones")
    go.add_model_arguments(ch)
    go.add_sampling_arguments(ch, max_new_default=1024)
    go.add_speculation_arguments(ch)
    ch.add_argument("--system", help="system prompt (plain text; \"\" = an empty system turn; default: Qwen's)")
    ch.add_argument("--max-context", type=int, default=0,
                    help=f"context length in tokens; when the conversation outgrows it the oldest turns "
                         f"are dropped (default 0: {CHAT_CONTEXT}, or the model's max_position if smaller)")
    ch.set_defaults(fn=cmd_chat)

