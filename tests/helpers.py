"""Small helpers shared by tests (not fixtures): tiny configs, random models, error metrics."""

from __future__ import annotations

import numpy as np

from drvqwen.config import QwenConfig
from drvqwen.format import quant
from drvqwen.format.tensor_set import expected_tensors
from drvqwen.format.nanoqwen_writer import NanoqwenWriter
from drvqwen.format.synthetic import QWEN_CONTROL, minimal_tokenizer_json  # noqa: F401  (tests import them from here)

TINY = QwenConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position=1024)


def byte_tokenizer_json(n_control: int = len(QWEN_CONTROL)) -> str:
    """A byte-level tokenizer.json that can encode any text: the 256 bytes at ids 0..255 (no
    merges) and the first `n_control` of QWEN_CONTROL as special tokens at 256, 257, …

    With TINY's 512 rows it leaves ids 256 + n_control … 511 without text, like the padded
    rows of the real Qwen2.5 lm_head."""
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    tk = tokenizers.Tokenizer(BPE(vocab={BYTE_TO_CHAR[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_CONTROL[:n_control]])
    return tk.to_str()


def random_dense(cfg: QwenConfig, rng: np.random.Generator, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for `cfg`: std-0.02 weights, norms near 1, biases ~0.1."""
    out: dict[str, np.ndarray] = {}
    for name, (dt, shape) in expected_tensors(cfg).items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            n, kw = shape
            out[base + ".weight"] = (rng.standard_normal((n, kw * 8)) * std).astype(np.float32)
        elif "norm" in name:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


def write_model(path, cfg: QwenConfig, dense: dict[str, np.ndarray], tokenizer_json: str | None = None):
    """Quantize `dense` and write a `.nanoqwen`; returns {name: stored array}."""
    stored = {}
    with NanoqwenWriter(path, cfg, tokenizer_json or minimal_tokenizer_json()) as w:
        for name, (dt, shape) in expected_tensors(cfg).items():
            if name.endswith(".scales"):
                continue
            if name.endswith(".qweight"):
                base = name[: -len(".qweight")]
                qw, s = quant.quantize_packed(dense[base + ".weight"])
                w.add(name, qw)
                w.add(base + ".scales", s)
                stored[name], stored[base + ".scales"] = qw, s
            else:
                stored[name] = dense[name].astype(np.float16)
                w.add(name, stored[name])
    return stored


def common_prefix(cached: list[int], ids: list[int]) -> int:
    """The KV-cache positions a prompt `ids` may reuse, counted on their own (not by
    generate.reused_prefix, which the tests check): where the cached ids and the prompt agree,
    from the start, but never the prompt's last id (its logits are needed)."""
    n = 0
    while n < min(len(cached), len(ids) - 1) and cached[n] == ids[n]:
        n += 1
    return n


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def write_tiny_gguf(path, cfg: QwenConfig, dense: dict[str, np.ndarray], **kw):
    """A qwen2 GGUF of `cfg` holding `dense` (format.synthetic.write_synthetic_gguf: the 256
    bytes, "ĠĠ" at 256, QWEN_CONTROL from 257 on; tied, big_endian, qtype, n_pad, eos_id)."""
    from drvqwen.format.synthetic import write_synthetic_gguf

    return write_synthetic_gguf(path, cfg, dense, **kw)


def bpe_with_merges_json() -> str:
    """A byte-level BPE with merges and Qwen's control tokens, as a stand-in that needs no model."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    from drvqwen.format.synthetic import QWEN_CONTROL
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    vocab = {BYTE_TO_CHAR[b]: b for b in range(256)}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("d", "e"), ("de", "f"),
                 ("r", "e"), ("re", "t"), ("ret", "u"), ("retu", "r"), ("retur", "n"), ("Ċ", "Ġ")]:
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_CONTROL])
    return tk.to_str()


def load_tool(name: str):
    """tools/<name>.py as a module (registered in sys.modules under `name`, where dataclasses
    look their module up), for the tests of the repo's tools."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def decode_against(decoder, want_logits: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """Run len(want_logits) decode steps with `decoder` (a GraphDecoder, or anything with
    decode_token / logits / next_token) and compare each step's fp32 logits bit for bit with
    want_logits[i]. Returns (tokens: the pending one, then each step's; the steps that differ)."""
    tokens, mismatched = [decoder.next_token()], []
    for i, want in enumerate(want_logits):
        decoder.decode_token()
        if not np.array_equal(decoder.logits().view(np.uint32), want.view(np.uint32)):
            mismatched.append(i)
        tokens.append(decoder.next_token())
    return tokens, mismatched


class ScriptedProposer:
    """A speculation proposer that proposes from a known answer (`plain`: what greedy decoding
    will choose) by a repeating script: nothing, nothing, four right tokens, nothing, a wrong
    first token, one right token, nothing, one right, three right then a wrong one. So greedy
    speculation's lookahead (speculative_loop._greedy_step) takes each of its paths: decode
    steps queued ahead, a proposal arriving while a step is queued (its first token checked by
    that step: a miss, a hit of one token, a hit with a verify pass after it), and passes from
    the host's token."""

    name, max_tokens = "scripted", 8
    SCRIPT = ("none", "none", "four", "none", "wrong", "one", "none", "one", "late-miss")

    def __init__(self, plain: list[int], vocab_size: int):
        self.plain, self.vocab_size, self.calls = plain, vocab_size, 0
        # What a correct speculation loop must count: tokens proposed, and of those the ones
        # greedy decoding chooses (each proposal's longest prefix that agrees with `plain`).
        self.proposed = self.right = 0

    def propose(self, context, k, params, index):
        kind = self.SCRIPT[self.calls % len(self.SCRIPT)]
        self.calls += 1
        right = list(self.plain[index:index + k])
        if kind == "none" or not right:
            out = []
        elif kind == "wrong":
            out = [(right[0] + 1) % self.vocab_size, *right[1:3]]
        elif kind in ("one", "four"):
            out = right[:1 if kind == "one" else 4]
        else:
            out = [*right[:3], (right[3] + 1) % self.vocab_size] if len(right) > 3 else right
        self.proposed += len(out)
        self.right += next((i for i, (x, y) in enumerate(zip(out, right)) if x != y), len(out))
        return out, None

    def close(self) -> None:
        pass
