#!/usr/bin/env python3
"""Each launch of the decode step against the reference from its own inputs, at chosen positions.

    PYTHONPATH=src python3 tools/launch_errors.py [--preset 0.5b] [--recipe q4_k_m]
        [--prompt-seed 591801706] [--prompt-tokens 20] [--positions 12 13 14 15 16] [--focus 14]
        [--json OUT]

A synthetic model (format/synthetic.py, weights seed 1234 as tests/test_decode_step.py writes it,
in --recipe's per-tensor formats or INT4) and a random prompt of --prompt-tokens ids drawn as that
test draws them from --prompt-seed. For each position p: the prompt's first p tokens are
prefilled, token p is fed, and the step's launches run one at a time as `drvqwen step` runs
them, each output compared with the numpy reference computed from the launch's own GPU inputs
(reference_steps.compare: relative L2). The table lists the outputs whose error at --focus is
largest against their median at the other positions: a kernel that misbehaves for one token
stands out there, while an error that only grows through the layers (a model amplifying the
FP16 rounding of its activations) leaves every launch near its usual error. Needs the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def focus_ratios(errors: dict[str, dict[int, float]], focus: int) -> list[tuple[float, str]]:
    """(error at `focus` / median error at the other positions, output) for each output, largest
    first; an output with no error elsewhere (exact outputs: 0) gets ratio 0 when equal there
    too, inf when not."""
    out = []
    for name, by_pos in errors.items():
        others = [e for p, e in by_pos.items() if p != focus]
        here = by_pos.get(focus, 0.0)
        med = float(np.median(others)) if others else 0.0
        out.append(((here / med) if med > 0 else (0.0 if here == 0 else float("inf")), name))
    return sorted(out, key=lambda r: -r[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="0.5b", choices=("0.5b", "7b-2layers"))
    ap.add_argument("--recipe", default="q4_k_m", help="per-tensor formats (format/recipes.py), or int4")
    ap.add_argument("--prompt-seed", type=int, default=591801706)
    ap.add_argument("--prompt-tokens", type=int, default=20)
    ap.add_argument("--positions", type=int, nargs="+", default=[12, 13, 14, 15, 16])
    ap.add_argument("--focus", type=int, default=14)
    ap.add_argument("--top", type=int, default=12, help="rows to print")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.focus not in a.positions or max(a.positions) >= a.prompt_tokens or min(a.positions) < 1:
        raise SystemExit(f"--positions {a.positions}: need --focus {a.focus} among them, each in 1 … "
                         f"{a.prompt_tokens - 1} (--prompt-tokens)")

    from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic
    from drvqwen.step.machine_gpu import GpuMachine

    cfg = QWEN25_CODER_05B if a.preset == "0.5b" else QWEN25_CODER_7B.with_layers(2)
    errors: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.nanoqwen"
        write_synthetic(path, cfg, seed=1234, tokenizer_json=minimal_tokenizer_json(),
                        formats=None if a.recipe == "int4" else recipe_formats(cfg, a.recipe))
        f = NanoqwenFile(path)
        prompt = np.random.default_rng(a.prompt_seed).integers(0, cfg.vocab_size, a.prompt_tokens).tolist()
        m = GpuMachine(f, 256)
        try:
            for p in a.positions:
                m.start(prompt[:p])
                m.dec.seq.feed(prompt[p])
                for r in m.finish_step():
                    for c in r.comparisons:
                        errors.setdefault(f"{r.entry.name}:{c.name}", {})[p] = c.rel_l2
        finally:
            m.close()
            f.close()
    ratios = focus_ratios(errors, a.focus)
    print(f"{a.preset} {a.recipe}, prompt seed {a.prompt_seed}: position {a.focus} (token {prompt[a.focus]}) "
          f"against positions {[p for p in a.positions if p != a.focus]}; {len(ratios)} outputs")
    for ratio, name in ratios[:a.top]:
        row = " ".join(f"{p}:{errors[name][p]:.2e}" for p in sorted(errors[name]))
        print(f"{ratio:7.2f}  {name:40s} {row}")
    if a.json:
        a.json.write_text(json.dumps({"preset": a.preset, "recipe": a.recipe, "prompt_seed": a.prompt_seed,
                                      "focus": a.focus, "token": prompt[a.focus], "errors": errors,
                                      "largest_ratio": ratios[0][0] if ratios else None}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
