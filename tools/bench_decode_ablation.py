#!/usr/bin/env python3
"""What each op of the decode step costs inside the captured step: graph ITL with launches left out.

    PYTHONPATH=src python3 tools/bench_decode_ablation.py [--preset 7b | --model FILE] [--contexts 512 4096]
        [--leave-out attention o_proj ...] [--define FILE:NAME=INT ...] [--new-tokens 96]
        [--attention tma|plain|cluster] [--l2-prefetch-mb MB] [--l2-prefetch-qkv]
        [--l2-prefetch-blocks N] [--json OUT]

The step's launch list (DecodeStep.launch_list: what `drvqwen bench --mode graph` captures) is
captured once whole and once per --leave-out entry without the launches whose name ends in
`.<entry>` or contains `.<entry>.` (e.g. `attention`: both attention launches of every layer;
`attention.1`: the combine only), then each graph decodes --new-tokens tokens after a GPU prefill
of a --contexts-token random prompt, the way `drvqwen bench` times its ITL (host time between
tokens read back; median). "whole" runs first and last, to show the drift between the two.
A variant's tokens are WRONG by design (an op's output is missing): only its time means
anything. The difference to "whole" is what the op costs the captured step — its own run, its
launch boundaries, and what it does to its neighbours' overlap (programmatic dependent launch):
what `drvqwen bench --kernels` cannot say, since it times each launch eagerly between events.

--define FILE:NAME=INT compiles every kernel of kernels/FILE.cu with -DNAME=INT (a compile-time
variant to measure, e.g. attention_decode:ATTN_SHORT_SPLITS=64; the attention's split rule lives in
attention_decode.cuh, which attention_decode_tma.cu includes too: give both files). The model is
the synthetic --preset file (drvqwen.bench.ensure_synthetic) or --model (e.g. tools/make_synthetic.py
--recipe q4_k_m's file), its KV cache the model's full
context, as `drvqwen bench` sizes it (the split-KV attention's grid depends on it). --attention
builds the step with that decode attention (decode.ATTENTION_KERNELS; default the step's own):
`--attention cluster --leave-out attention` says what the one-launch attention costs the step.
--l2-prefetch-mb builds the step with each layer's L2 prefetch (DecodeStep(l2_prefetch_bytes=…),
kernels/l2_prefetch.cu): `--leave-out l2_prefetch` is then the step without it, in the same run —
and there the variant's tokens are right, since the prefetch changes no value. --l2-prefetch-qkv
adds each layer's prefetch of the next layer's q/k/v weights (`--leave-out l2_prefetch_qkv`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


# Defines the launchers size a launch by (its grid, block, shared memory or scratch) without being
# told of a --define: the constants they mirror (launchers/base.py: mirrored) and the prefill
# attention's build defines (launchers/attention_prefill.py: engine_build; `drvqwen bench
# --prefill-attention-define` builds and sizes them together). A --define of one would launch a
# build with another's shape. The split rule's short-context terms are mirrored for the tools
# only (launchers/attention_decode.py: pages_per_split): a kernel-only rule, free to change.
SIZED_BUILD_DEFINES = {("attention_prefill_wgmma", "APW_WARPGROUPS"), ("attention_prefill_wgmma", "APW_Q_SMEM")}
KERNEL_ONLY_MIRRORED = {("attention_decode", "ATTN_SHORT_SPLITS"), ("attention_decode", "ATTN_SHORT_MAX_PAGES")}


def sizing_defines() -> set[tuple[str, str]]:
    """(kernel file, define) pairs a --define may not change (SIZED_BUILD_DEFINES' comment)."""
    import importlib
    import pkgutil

    import drvqwen.launchers
    from drvqwen.launchers import base

    for m in pkgutil.iter_modules(drvqwen.launchers.__path__):  # every launcher's mirrored constants
        importlib.import_module(f"drvqwen.launchers.{m.name}")
    mirrored = {(file, expr) for file, expr, _value in base.MIRRORED if expr.isidentifier()}
    return (mirrored - KERNEL_ONLY_MIRRORED) | SIZED_BUILD_DEFINES


def parse_define(text: str) -> tuple[str, str, int]:
    """'FILE:NAME=INT' → (file, name, value); a bad one, or one the launchers size launches by,
    exits with one line."""
    try:
        file, rest = text.split(":", 1)
        name, value = rest.split("=", 1)
        parsed = file, name, int(value)
    except ValueError:
        raise SystemExit(f"--define {text!r}: expected FILE:NAME=INT, e.g. attention_decode:ATTN_SHORT_SPLITS=64")
    if (file, name) in sizing_defines():
        raise SystemExit(f"--define {text!r}: the launchers size {file}'s launches by {name}, which a --define "
                         f"would change under them (the prefill attention's builds: drvqwen bench "
                         f"--prefill-attention-define)")
    return parsed


def install_defines(defines: list[tuple[str, str, int]]) -> None:
    """Every KernelRef of the named files compiles with the extra defines (before any launcher is built)."""
    from drvqwen.launchers import base

    extra: dict[str, dict[str, int]] = {}
    for file, name, value in defines:
        extra.setdefault(file, {})[name] = value
    if not extra:
        return
    original = base.KernelRef.function

    def function(self):
        if self.file not in extra:
            return original(self)
        return base.load_kernel_module(self.file, defines={**dict(self.defines), **extra[self.file]}).function(self.kernel)

    base.KernelRef.function = function


def left_out(name: str, entry: str) -> bool:
    """Whether launch `name` (e.g. "L3.attention.1") is one of `entry`'s ("attention", "attention.1")."""
    return name.endswith("." + entry) or f".{entry}." in name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--model", help="a .nanoqwen file to measure instead of the --preset synthetic one")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="prompt tokens before decoding")
    ap.add_argument("--leave-out", nargs="*", default=None,
                    help="launch names (their layer-free tail) to leave out, one variant each (default: "
                         "attention, attention.1 (but with --attention cluster: one launch), o_proj)")
    ap.add_argument("--define", action="append", default=[], metavar="FILE:NAME=INT")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--attention", choices=("tma", "plain", "cluster"), default=None,
                    help="the step's decode attention (default: the step's own)")
    ap.add_argument("--l2-prefetch-mb", type=float, default=0.0,
                    help="the step's L2 prefetch budget a layer, MB (default 0: none)")
    ap.add_argument("--l2-prefetch-qkv", action="store_true",
                    help="also the step's prefetch of the next layer's q/k/v weights after down_proj")
    ap.add_argument("--l2-prefetch-blocks", type=int, default=None,
                    help="blocks of each L2 prefetch launch (default: the launcher's)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.leave_out is None:
        a.leave_out = ["attention", *([] if a.attention == "cluster" else ["attention.1"]), "o_proj"]
    defines = [parse_define(d) for d in a.define]
    install_defines(defines)
    from drvqwen.errors import DrvqwenError
    from drvqwen.launchers import LaunchError

    try:
        return measure(a, defines)
    except (DrvqwenError, LaunchError) as e:  # a refused option (a budget, a block count): one line
        raise SystemExit(f"bench_decode_ablation.py: {e}") from None


def measure(a, defines) -> int:
    """The variants of the parsed arguments `a` timed; the JSON written. Returns 0."""
    from drvqwen.bench import ensure_synthetic, l2_prefetch_budget_bytes, l2_prefetch_layer_bytes, load_prefill, run_mode
    from drvqwen.cuda.bandwidth import measure_copy_bandwidth
    from drvqwen.decode import DecodeStep
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.graphs import GraphDecoder
    from drvqwen.launch_list import LaunchList
    from drvqwen.provenance import source_record

    budget = l2_prefetch_budget_bytes(a.l2_prefetch_mb)
    copy = measure_copy_bandwidth()
    f = NanoqwenFile(a.model or ensure_synthetic(a.preset))
    # One attention at every length (no short-context twin): the variants below are lists of the
    # plan's own steps.
    dec = DecodeStep(f, attention=a.attention, short_attention=None, l2_prefetch_bytes=budget,
                     l2_prefetch_qkv=a.l2_prefetch_qkv, l2_prefetch_blocks=a.l2_prefetch_blocks)
    names = [nl.name for nl in dec.launch_list.launches]
    if a.l2_prefetch_mb or a.l2_prefetch_qkv:
        print(f"L2 prefetch: layer 0 asks for {l2_prefetch_layer_bytes(dec.plan.steps, 0) / 1e6:.2f} MB", flush=True)
    for entry in a.leave_out:
        if not any(left_out(n, entry) for n in names):
            raise SystemExit(f"--leave-out {entry}: no launch of the step is named so (layer 0: "
                             f"{', '.join(n[3:] for n in names if n.startswith('L0.'))})")
    graphs = {}
    for variant in ["whole", *a.leave_out]:
        ll = LaunchList("greedy", list(dec.plan.steps))
        ll.launches = [nl for nl in ll.launches if variant == "whole" or not left_out(nl.name, variant)]
        graphs[variant] = GraphDecoder(dec, ll, fallback=False)
    prefill = load_prefill(dec)
    rows = []
    for ctx in a.contexts:
        prompt = np.random.default_rng(0).integers(0, f.config.vocab_size, ctx).tolist()
        for variant in ["whole", *a.leave_out, "whole"]:
            g = graphs[variant]
            r = run_mode("graph", g, dec, prompt, a.new_tokens, copy.gbps, prefill, 1)
            row = {"context": ctx, "variant": variant, "launches": len(g.launch_list.launches),
                   "itl_median_ms": float(np.median(r.itl_ms))}
            rows.append(row)
            label = Path(a.model).name if a.model else a.preset
            print(f"{label} context {ctx:6d}  {variant:14s} {row['launches']:4d} launches  "
                  f"graph ITL median {row['itl_median_ms']:.4f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "device": dec.device.info.summary(),
                       "preset": None if a.model else a.preset, "model": Path(a.model).name if a.model else None,
                       "defines": [f"{fi}:{n}={v}" for fi, n, v in defines], "new_tokens": a.new_tokens,
                       "attention": dec.attention, "l2_prefetch_mb": a.l2_prefetch_mb or None,
                       "l2_prefetch_qkv": a.l2_prefetch_qkv, "l2_prefetch_blocks": a.l2_prefetch_blocks,
                       "l2_prefetch_layer0_bytes": l2_prefetch_layer_bytes(dec.plan.steps, 0),
                       "blocks_per_kv_head": dec.plan.blocks_per_kv_head, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
