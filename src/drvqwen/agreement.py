"""`drvqwen eval agree`: how closely a converted model's next-token distributions follow its
unquantized source, both computed by drvqwen's numpy reference (reference.py) in float32.

Measured on logits over the ids that have text (below the file's text_vocab):
- cosine of the two logit vectors (float64);
- KL(P_source ‖ P_model) of the softmax distributions, in nats;
- top-1 agreement: both choose the same greedy token;

at the last position of each prompt (the builtin set below, or HumanEval's 164 prompts with
`--prompts humaneval`: the sensitive measure of docs/quantization.md), and at every position
of AGREE_TEXT (one forward pass each); and the top-1 agreement where the source's top-1/top-2
gap exceeds 6× the RMS logit error (docs/numerics.md). With `--device cuda` the model side is
the GPU engine instead of the reference, and every position of every prompt is measured. The source is read with the converter's own readers
(format/sources.py: a GGUF dequantized by the `gguf` package, or an HF folder), so "source"
means exactly the values the conversion started from.

Memory: both models' weights in float32 at once (~4 GB for the 0.5B); a 7B needs ~60 GB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from .errors import DrvqwenError

BUILTIN_PROMPTS = (
    "import numpy as np\n",
    "def fib(n):",
    'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "fn main() {\n    let v: Vec<i32> = ",
    "SELECT name, COUNT(*) FROM orders\n",
    "function debounce(fn, ms) {\n",
    "# Read a CSV file and print the mean of each column\nimport csv\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "<!DOCTYPE html>\n<html>\n<head>\n",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n",
)
AGREE_TEXT = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


if __name__ == "__main__":
    print(merge_sorted([1, 4, 9], [2, 3, 10]))
'''


@dataclass
class Agreement:
    """Cosine, KL and top-1 over a set of logit pairs (one per position), and the top-1 agreement
    gated as docs/numerics.md gates greedy agreement: only where the source's top-1/top-2 gap
    exceeds 6× the RMS logit error measured over all positions (elsewhere a last-bit difference
    may swap a near-tie, and no precision can promise the same choice)."""

    n: int = 0
    cosine: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)      # source's top-1 minus top-2 logit
    sq_err: float = 0.0                                 # Σ (model − source)² over every logit
    n_logits: int = 0

    def add(self, model: np.ndarray, source: np.ndarray) -> None:
        """One position: logits [V'] of the model and of the source (ids with text only)."""
        a, b = np.asarray(model, np.float64), np.asarray(source, np.float64)
        self.cosine.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
        la, lb = a - a.max(), b - b.max()
        la -= np.log(np.exp(la).sum())
        lb -= np.log(np.exp(lb).sum())
        self.kl.append(float(np.exp(lb) @ (lb - la)))
        self.top1.append(bool(a.argmax() == b.argmax()))
        top2 = np.partition(b, -2)[-2:]
        self.gap.append(float(top2[1] - top2[0]))
        self.sq_err += float(((a - b) ** 2).sum())
        self.n_logits += a.size
        self.n += 1

    def summary(self) -> dict[str, float]:
        """mean/min cosine, mean/max KL (nats), top-1 agreement (fraction), the RMS logit error,
        and top-1 agreement where the source's gap exceeds 6× that error (`gated_positions` of
        them; 1.0 when there are none)."""
        if not self.n:
            return {"positions": 0}
        rms = float(np.sqrt(self.sq_err / self.n_logits))
        gated = np.array(self.gap) > 6 * rms
        top1 = np.array(self.top1)
        return {"positions": self.n, "cosine_mean": float(np.mean(self.cosine)),
                "cosine_min": float(np.min(self.cosine)), "kl_mean": float(np.mean(self.kl)),
                "kl_max": float(np.max(self.kl)), "top1": float(np.mean(self.top1)), "rms_err": rms,
                "gated_positions": int(gated.sum()),
                "top1_gated": float(top1[gated].mean()) if gated.any() else 1.0}


def measure(model_forward: Callable[[list[int]], np.ndarray], source_forward: Callable[[list[int]], np.ndarray],
            prompts: Sequence[list[int]], text: list[int], text_vocab: int,
            progress: Callable[[], None] | None = None, every_position: bool = False) -> dict[str, dict]:
    """Agreement at the last position of each prompt and at every position of `text` — and, with
    `every_position`, at every position of every prompt too (the GPU mode: its forward gives
    them all at the cost of the last).

    model_forward / source_forward(ids) → logits float32 [T, V] of a fresh forward pass.
    Returns {"last_position": summary, "every_position": summary} (Agreement.summary).
    """
    last, every = Agreement(), Agreement()
    for ids in prompts:
        a, b = model_forward(ids), source_forward(ids)
        last.add(a[-1, :text_vocab], b[-1, :text_vocab])
        for t in range(len(ids) if every_position else 0):
            every.add(a[t, :text_vocab], b[t, :text_vocab])
        if progress:
            progress()
    if text:
        a, b = model_forward(text), source_forward(text)
        for t in range(len(text)):
            every.add(a[t, :text_vocab], b[t, :text_vocab])
        if progress:
            progress()
    return {"last_position": last.summary(), "every_position": every.summary()}


def backend_forward_fn(backend) -> Callable[[list[int]], np.ndarray]:
    """ids → logits [T, V] at every position from a token backend (the GPU engine): the first id
    prefilled, each later one decoded, so every position's logits come out of one pass."""

    def fwd(ids: list[int]) -> np.ndarray:
        out = [backend.prefill(list(ids[:1]))]
        out += [backend.decode(int(t)) for t in ids[1:]]
        return np.stack(out).astype(np.float32)
    return fwd


def forward_fn(weights, max_tokens: int) -> Callable[[list[int]], np.ndarray]:
    """A fresh full forward pass of reference `weights` per call: ids → logits [T, V]."""
    from .reference import Model

    model = Model(weights, max_tokens=max_tokens)

    def fwd(ids: list[int]) -> np.ndarray:
        model.reset()
        return model.forward(list(ids))
    return fwd


def check_same_model(model_cfg, source_cfg, model: str, source: str) -> None:
    """Refuse to compare two different architectures (names both and the first field)."""
    a, b = asdict(model_cfg), asdict(source_cfg)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim"):
        if a[k] != b[k]:
            raise DrvqwenError(f"{model} and {source} are different models: {k} {a[k]} vs {b[k]}")
