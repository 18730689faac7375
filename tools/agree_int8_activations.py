#!/usr/bin/env python3
"""How far int8 activations would move a model's logits: the numerics case for and against an
integer dot-product decode GEMV.

    PYTHONPATH=src python3 tools/agree_int8_activations.py [--model M] [--blocks 32 16] [--each]
                                                            [--json OUT]

llama.cpp's quantized GEMVs (mmvq) quantize each projection's input to int8 in blocks of 32
(Q8_1: one FP16 scale d = max|x| / 127 a block, x ≈ d · round(x / d)) and then multiply the
weight codes by those int8 values with integer dot products (dp4a): a quarter of the FP16
unpack's instructions, which is what drvqwen's format GEMVs are short of (kernels/gemv_fmt.cu).
Whether drvqwen may do the same is a question of its agreement target — the logits of the GPU
against the reference on the file's own dequantized weights, minimum cosine ≥ 0.9999 over
every position of `drvqwen eval agree`'s prompt set (docs/numerics.md). This tool answers it on
the CPU, with the reference itself: the forward pass with FP16 activations (what the GPU
computes today) and with each projection's input re-encoded as int8 in blocks of B
(reference.Model's projection_inputs), each against the float32 reference, at every position
of every builtin prompt and of AGREE_TEXT (agreement.measure, as `eval agree --device cuda`
measures). With --each, also each matrix product's input alone as int8 in blocks of the first
size (q/k/v, o_proj, gate/up, down_proj in every layer, or the lm_head), the others FP16.

Prints one line a variant and writes the summaries with --json (docs/bench). A few minutes on
two cores for the 0.5B (a float32 copy of the weights: ~4 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from drvqwen import agreement as ag
from drvqwen.errors import DrvqwenError
from drvqwen.models import resolve_model
from drvqwen.paths import atomic_write_bytes
from drvqwen.provenance import source_record
from drvqwen.reference import Model, Weights
from drvqwen.tokenizer import Tokenizer


def int8_blocks(block: int):
    """x [T, K] → the values int8 blocks of `block` inputs along K hold: per block
    d = fp16(max|x| / 127) (1 for an all-zero block), q = clip(round(x / d), −127, 127), x' = q · d
    (llama.cpp's Q8_1 blocks, the scale rounded to FP16 as such a block stores it).
    Returns x' in x's dtype. Raises ValueError when K is not a multiple of `block`."""
    def quantize(x: np.ndarray) -> np.ndarray:
        T, K = x.shape
        if K % block:
            raise ValueError(f"input width {K} is not a multiple of the block ({block})")
        b = x.reshape(T, K // block, block).astype(np.float32)
        amax = np.abs(b).max(axis=-1, keepdims=True)
        d = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(b / d), -127, 127)
        return (q * d).reshape(T, K).astype(x.dtype)
    return quantize


# The matrix products whose inputs Model.projection_inputs sees, in the order it calls it: four
# a layer, then the lm_head.
LAYER_INPUTS = ("qkv", "o_proj", "gate_up", "down_proj")


def only_at(name: str, num_layers: int, encode):
    """A projection_inputs function that applies `encode` to the inputs of product `name`
    (LAYER_INPUTS, or "lm_head") and passes the others on: it counts its calls, 4 a layer and
    one for the lm_head per forward pass of one chunk (the order reference.Model calls it in)."""
    calls = {"n": 0}
    per_pass = 4 * num_layers + 1

    def apply(a: np.ndarray) -> np.ndarray:
        i = calls["n"] % per_pass
        calls["n"] += 1
        here = "lm_head" if i == per_pass - 1 else LAYER_INPUTS[i % 4]
        return encode(a) if here == name else a
    return apply


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .nanoqwen (default: the real Qwen2.5-Coder-0.5B-Instruct)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 16], help="int8 block sizes (inputs)")
    ap.add_argument("--each", action="store_true",
                    help="also each product's input alone as int8 (blocks of the first size)")
    ap.add_argument("--json", help="write the summaries here")
    a = ap.parse_args()
    try:
        for b in a.blocks:
            if b < 1:
                raise DrvqwenError(f"--blocks {b}: a block must hold at least 1 input")
        f = resolve_model(a.model)
        for b in a.blocks:  # before the weights are read (seconds to minutes)
            for k in (f.config.hidden_size, f.config.intermediate_size):
                if k % b:
                    raise DrvqwenError(f"--blocks {b}: does not divide the model's input width {k}")
        tok = Tokenizer.of_model(f)
        prompts = [tok.encode(t) for t in ag.BUILTIN_PROMPTS]
        text = tok.encode(ag.AGREE_TEXT)
        longest = max([len(text)] + [len(p) for p in prompts])
        weights = Weights.from_nanoqwen(f)
    except DrvqwenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reference = ag.forward_fn(weights, longest)   # float32 throughout: the target's reference
    variants = {"fp16": None} | {f"int8_block{b}": int8_blocks(b) for b in a.blocks}
    first = a.blocks[0]
    each = (*LAYER_INPUTS, "lm_head") if a.each else ()
    variants |= {f"int8_block{first}_{n}_only": only_at(n, f.config.num_layers, int8_blocks(first)) for n in each}
    results = {}
    for name, inputs in variants.items():
        # One chunk a forward pass (only_at counts calls per pass): every prompt is shorter.
        model = Model(weights, max_tokens=longest, activations=np.float16, projection_inputs=inputs,
                      chunk=longest)

        def forward(ids, m=model):
            m.reset()
            return m.forward(list(ids))
        res = ag.measure(forward, reference, prompts, text, f.text_vocab, every_position=True)
        results[name] = res
        s = res["every_position"]
        print(f"{name}: every position ({s['positions']}): cosine mean {s['cosine_mean']:.6f} min "
              f"{s['cosine_min']:.6f}, KL mean {s['kl_mean']:.2e} max {s['kl_max']:.2e}, top-1 {s['top1']:.1%}, "
              f"gated top-1 {s['top1_gated']:.1%} of {s['gated_positions']}", flush=True)
    if a.json:
        doc = {"model": f.path.name, "reference": "the model's dequantized weights, float32 throughout",
               "variants": {"fp16": "activations rounded to FP16 where the GPU stores them (docs/numerics.md)",
                            **{f"int8_block{b}": f"fp16, and every projection's input as int8 in blocks of {b} "
                               "with an FP16 scale (llama.cpp's Q8_1 for 32)" for b in a.blocks},
                            **{f"int8_block{first}_{n}_only": f"fp16, and only {n}'s input as int8 in blocks "
                               f"of {first}" for n in each}},
               "prompts": "builtin + AGREE_TEXT, every position", "source": source_record(), **results}
        atomic_write_bytes(Path(a.json), json.dumps(doc, indent=1).encode())
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
