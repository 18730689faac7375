"""The engine's host-side logic, without a GPU: the token-backend path of generate(), stop
tokens, streaming detokenization of characters split across tokens, argument checks, and the
byte layout of the sampler parameters the GPU reads."""

import struct

import numpy as np
import pytest

from drvqwen.engine import check_stream_args, pack_sampler_params
from drvqwen.errors import DrvqwenError
from drvqwen.generate import generate
from drvqwen.sampler import SamplingParams, scale_log2
from drvqwen.stream_decoder import StreamDecoder
from drvqwen.tokenizer import Tokenizer


class StreamingBackend:
    """A token backend (like GPUBackend): yields a script, records how far it ran and whether
    its stream was closed."""

    name = "scripted-stream"

    def __init__(self, script, max_context=100):
        self.script, self.max_context = list(script), max_context
        self.produced = 0
        self.closed = False
        self.calls = []

    last_reused = 0

    def token_stream(self, prompt_ids, max_new_tokens, params, reuse=False):
        self.calls.append((list(prompt_ids), max_new_tokens, params))
        try:
            for i in range(max_new_tokens):
                self.produced += 1
                yield self.script[i % len(self.script)]
        finally:
            self.closed = True

    def prefill(self, ids):  # pragma: no cover - generate() must prefer token_stream
        raise AssertionError("generate() called prefill on a token backend")

    decode = reset = prefill


def test_token_backend_stop_token_closes_the_stream():
    b = StreamingBackend([5, 6, 7, 1, 8])
    r = generate(b, [3, 4], 10, stop_ids=frozenset({1}))
    assert r.tokens == [5, 6, 7] and r.stopped_by == "stop token"
    assert b.closed and b.produced == 4, "the stream must stop at the stop token"
    assert b.calls[0][:2] == ([3, 4], 10)


def test_token_backend_ignore_stop_and_context_cap():
    b = StreamingBackend([5, 1])
    r = generate(b, [3, 4], 6, stop_ids=frozenset({1}), ignore_stop=True)
    assert r.tokens == [5, 1, 5, 1, 5, 1] and r.stopped_by == "max_new_tokens" and b.closed
    b = StreamingBackend([2], max_context=10)
    r = generate(b, list(range(7)), 100)
    assert len(r.tokens) == 3 and b.calls[0][1] == 3           # the backend is asked for 3 only
    assert generate(StreamingBackend([2]), [1], 0).tokens == []


def test_token_backend_params_and_timing():
    b = StreamingBackend([9])
    p = SamplingParams(temperature=0.5, top_k=3, seed=4)
    r = generate(b, [1], 5, p)
    assert b.calls[0][2] == p
    assert r.ttft_s >= 0 and r.decode_s >= 0 and len(r.tokens) == 5


def _byte_tokenizer() -> Tokenizer:
    """A byte-level BPE whose 256 tokens are single bytes (id = byte value): every multi-byte
    UTF-8 character spans several tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from drvqwen.tokenizer_gguf import _bytes_to_unicode

    b2u = _bytes_to_unicode()
    assert set(b2u.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tk = HFTokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return Tokenizer(tk)


def test_streaming_decodes_characters_split_across_tokens():
    tok = _byte_tokenizer()
    text = "def f():\n    return 'héllo — 世界 😀'\n"
    ids = list(text.encode("utf-8"))                          # one token per byte
    b = StreamingBackend(ids)
    stream = StreamDecoder(tok)
    pieces = []

    def on_token(t):
        s = stream.push(t)
        if s:
            pieces.append(s)

    generate(b, [1], len(ids), on_token=on_token)
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces), "a split character was printed as U+FFFD"
    assert "😀" in pieces, "the 4-byte character came out whole, in one piece"


def test_check_stream_args():
    assert check_stream_args(10, 5, 100) == 5
    assert check_stream_args(98, 5, 100) == 2
    with pytest.raises(DrvqwenError, match="empty"):
        check_stream_args(0, 5, 100)
    with pytest.raises(DrvqwenError, match="does not fit"):
        check_stream_args(100, 5, 100)
    with pytest.raises(DrvqwenError, match="max_new_tokens"):
        check_stream_args(10, -1, 100)


def test_pack_sampler_params_layout():
    """The 48 bytes sampling.cu's struct SamplerParams reads."""
    fmt = "<QdfiIiff8x"    # seed, top_p, scale_log2, top_k, token_index, greedy, min_p, repeat_penalty, reserved
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**40 + 5, min_p=0.05, repeat_penalty=1.1)
    raw = pack_sampler_params(p, token_index=17)
    assert raw.dtype == np.uint8 and raw.size == 48
    seed, top_p, scale, top_k, index, greedy, min_p, penalty = struct.unpack(fmt, raw.tobytes())
    assert (seed, top_p, top_k, index, greedy) == (2**40 + 5, 0.9, 40, 17, 0)
    assert np.float32(scale) == scale_log2(0.7)
    assert min_p == np.float32(0.05) and penalty == np.float32(1.1)      # the CPU's float32 values
    assert (p.min_p, p.repeat_penalty) == (min_p, penalty)
    assert raw[40:].tolist() == [0] * 8
    g = struct.unpack(fmt, pack_sampler_params(SamplingParams(seed=-1)).tobytes())
    assert g[0] == 2**64 - 1 and g[5] == 1 and g[2] == 0.0   # greedy: no 1/0 temperature scale
    assert g[6] == 0.0 and g[7] == 1.0                       # min-p and the penalty off


def test_engine_imports_without_gpu():
    import drvqwen.engine as engine

    assert hasattr(engine, "GPUBackend") and engine.TOKEN_RING >= 2
