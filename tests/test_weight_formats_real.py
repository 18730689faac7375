"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF converted with `--weights source`: every
tensor kept in the format of its GGUF type (Q5_0, Q8_0, Q4_K, Q6_K, F32), and the reference's
last-position logits on the converted file equal those of the same reference on the GGUF's
dequantized float32 weights."""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref

pytest.importorskip("gguf")

PROMPTS = ("import numpy as np\n", "def fib(n):", "class Stack:\n    def push(self, x):\n")


@pytest.mark.slow
def test_source_formats_keep_the_gguf_forward(real_gguf, tmp_path):
    from drvqwen.format.convert import GGUFSource, convert
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.tokenizer import Tokenizer

    src = GGUFSource(real_gguf)
    report = convert(src, tmp_path / "q05.nanoqwen", weights="source")
    rows = {(r.source_type, r.format_name): r.count for r in report.mapping.values() if r.exact}
    print("mapping:", rows, f"bytes/token {report.bytes_per_token / 1e6:.1f} MB")
    assert rows.get(("Q5_0", "q5_g32")) and rows.get(("Q8_0", "q8_g32")) and rows.get(("Q4_K", "q4_k")) \
        and rows.get(("Q6_K", "q6_k"))
    # The bytes a token reads are the GGUF's own: every tensor but the embedding, one row of it.
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(real_gguf).tensors}
    embd = tensors.pop("token_embd.weight")
    assert report.bytes_per_token <= sum(tensors.values()) + embd // src.config.vocab_size
    f = NanoqwenFile(tmp_path / "q05.nanoqwen")
    tok = Tokenizer.from_json(f.tokenizer_json)
    ours = ref.Model(ref.Weights.from_nanoqwen(f), max_tokens=64)
    dense = ref.Model(ref.Weights.from_dense(src.config, src.get), max_tokens=64)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours.reset()
        dense.reset()
        a = ours.forward(ids, last_only=True)[0].astype(np.float64)
        b = dense.forward(ids, last_only=True)[0].astype(np.float64)
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        print(f"{prompt!r}: cosine {cos:.7f}, top-1 {a.argmax()} vs {b.argmax()}")
        assert cos >= 0.9999 and a.argmax() == b.argmax()


def test_q4_k_m_recipe_gives_each_tensor_the_real_gguf_s_type(real_gguf):
    from drvqwen.format.convert import GGUFSource
    from drvqwen.format.recipes import q4_k_m_types

    src = GGUFSource(real_gguf)
    want = {p: src.type_name(p + ".weight") for p in q4_k_m_types(src.config)}
    assert q4_k_m_types(src.config) == want
