#!/usr/bin/env python3
"""Write a synthetic `.nanoqwen` of a Qwen2.5 shape from a seed (format/synthetic.py).

    PYTHONPATH=src python3 tools/make_synthetic.py --preset 7b --seed 1 -o /tmp/syn7b.nanoqwen
    PYTHONPATH=src python3 tools/make_synthetic.py --preset 7b --layers 2 -o /tmp/syn7b_2l.nanoqwen
    PYTHONPATH=src python3 tools/make_synthetic.py --preset 7b --recipe q4_k_m -o /tmp/syn7b-q4km.nanoqwen

--recipe q4_k_m writes every weight in the format of the GGUF type llama.cpp's Q4_K_M recipe
gives it (format/recipes.py): the layout of the file a 7B user downloads; --recipe q5_k_m the
same with Q5_K in place of Q4_K (llama.cpp's Q5_K_M); --recipe q4_0, q5_0
and q8_0 those of llama.cpp's Q4_0, Q5_0 and Q8_0 presets (every matrix in that type, the output
Q6_K but for Q8_0). The default, int4,
is drvqwen's INT4 g128 projections with FP16 embedding and lm_head.

--tokenizer takes a tokenizer.json or a .nanoqwen to copy the real tokenizer from; without it
a minimal byte-level tokenizer is embedded (enough for speed runs, which ignore the text).
"""

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from drvqwen.config import PRESETS
from drvqwen.format.nanoqwen import MAGIC, NanoqwenFile
from drvqwen.format.recipes import RECIPES, recipe_formats
from drvqwen.format.synthetic import minimal_tokenizer_json, write_synthetic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--layers", type=int, help="override the layer count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipe", choices=RECIPES, default="int4", help="the weight formats (see above)")
    ap.add_argument("--tokenizer", help="tokenizer.json, or a .nanoqwen to take it from")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    cfg = PRESETS[a.preset]
    if a.layers:
        cfg = cfg.with_layers(a.layers)
    tok = minimal_tokenizer_json()
    if a.tokenizer:
        p = Path(a.tokenizer)
        with open(p, "rb") as f:
            tok = NanoqwenFile(p).tokenizer_json if f.read(8) == MAGIC else p.read_text(encoding="utf-8")
    con = Console(stderr=True)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=con) as prog:
        task = prog.add_task("writing", total=None)
        write_synthetic(a.output, cfg, a.seed, tok,
                        progress=lambda n, i, t: prog.update(task, completed=i, total=t),
                        formats=recipe_formats(cfg, a.recipe))
    size = Path(a.output).stat().st_size
    con.print(f"wrote {a.output}: {size / 1e9:.2f} GB, {cfg.num_layers} layers, {a.recipe}, seed {a.seed}, "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
