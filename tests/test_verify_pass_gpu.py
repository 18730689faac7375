"""The verify pass on the GPU (verify_pass.py through engine.GPUBackend.verify), bit for bit.

Two backends of the same small synthetic INT4 model, both built to speculate (the decode step
with the plain attention kernel), their pages from differently shuffled free lists: after the
same prompt, A's `verify(tokens)` (one pass) must give, row for row, the very bits of B's
`decode(t)` fed the same tokens one at a time — and of A's own decodes after rolling the pass
back. Chunks of 1, 2, 5, 8 and 16 tokens, one crossing a page boundary (16-token pages), one
ending at the last position of the context; then a rollback to an accepted count and one more
decode, equal on both. Consecutive passes continue from the state the last one left
(advance_state_tokens); more than 16 tokens fall back to decoding; greedy steps queued ahead
(queue_greedy) are the decode steps; and a greedy speculative generation gives plain decoding's
tokens, with and without steps queued ahead. At the real models' widths (two layers), a pass of
16 tokens gives the bits of the same backend's decode steps. A backend's passes replay a CUDA
graph per T (use_graphs, the default): against a use_graphs=False backend's eager passes, the
same bits for T = 1, 8, 16, on a graph's first replay and a later one, passes that open a page
included. The pass's logits buffer is poisoned (NaN bytes) before each pass, so a row it did not
write cannot pass.

Models (format/synthetic.py, large residual channels included): two layers of TINY (width 256,
head_dim 64, GQA 2) and of width 896 at head_dim 128 with GQA 7 (the 7B's grouping), vocabulary
512, a KV cache of 128 positions (8 pages: the split-KV attention in 2 blocks per KV head).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import write_synthetic
from drvqwen.generate import DecodeVerify, generate
from drvqwen.sampler import argmax
from drvqwen.kv_cache import n_pages_for

from helpers import TINY, ScriptedProposer, minimal_tokenizer_json

pytestmark = pytest.mark.gpu

MAX_CONTEXT = 128
CONFIGS = {"hd64": dataclasses.replace(TINY, num_layers=2),
           "hd128-gqa7": dataclasses.replace(TINY, num_layers=2, hidden_size=896, num_heads=7, num_kv_heads=1,
                                             head_dim=128)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(A, B): two GPUBackends of one model with speculative=True, pages shuffled differently."""
    from drvqwen.engine import GPUBackend

    path = tmp_path_factory.mktemp("verify") / f"{request.param}.nanoqwen"
    write_synthetic(path, CONFIGS[request.param], seed=2027, tokenizer_json=minimal_tokenizer_json())
    f = NanoqwenFile(path)
    a = GPUBackend(f, MAX_CONTEXT, rng=np.random.default_rng(1), chunk_rows=64, speculative=True)
    b = GPUBackend(f, MAX_CONTEXT, rng=np.random.default_rng(2), chunk_rows=64, speculative=True)
    assert a.verify_pass is not None and a.decode_step.attention == b.decode_step.attention == "plain"
    yield a, b
    a.close()
    b.close()
    f.close()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def _differing_rows(got: np.ndarray, want: np.ndarray) -> list[int]:
    return [j for j in range(len(want)) if not np.array_equal(_bits(got[j]), _bits(want[j]))]


def _poison(backend) -> None:
    backend.verify_pass.buf["logits"].fill_bytes(0xFF)


def _state(backend) -> list[int]:
    step = backend.decode_step
    return step.buf["state"].download(step.stream).tolist()


def _prefill_both(a, b, prompt) -> None:
    la, lb = a.prefill(prompt), b.prefill(prompt)
    # Not the verify pass's doing if this fails: the two prefills of one prompt differ.
    assert np.array_equal(_bits(la), _bits(lb)), "the two backends' prefills of the same prompt differ"


# (prompt length p, T): positions p … p+T-1. 13+5 and 30+8 cross a page boundary (16, 32),
# 40+16 too (48); 112+16 ends at the context's last position (127) and opens its last page.
CASES = [(20, 1), (21, 2), (13, 5), (30, 8), (40, 16), (MAX_CONTEXT - 16, 16)]


@pytest.mark.parametrize("p,T", CASES, ids=[f"p{p}-T{T}" for p, T in CASES])
def test_pass_rows_are_the_decode_steps_bits(pair, rng, p, T):
    a, b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, p).tolist()
    tokens = rng.integers(0, V, T).tolist()
    _prefill_both(a, b, prompt)
    _poison(a)
    rows = a.verify(tokens)
    assert rows.shape == (T, V) and not np.isnan(rows).any(), "a row the pass did not write"
    want = np.stack([b.decode(t) for t in tokens])
    assert not (bad := _differing_rows(rows, want)), f"rows {bad} differ from B's decode steps"
    # Where both sequences stand: the same ids, position, state and number of pages.
    assert a.cached_ids() == b.cached_ids() == prompt + tokens
    assert a.decode_step.seq.pos == b.decode_step.seq.pos == p + T
    assert _state(a) == _state(b) == [p + T, int(want[-1].argmax()), p + T + 1]
    assert len(a.decode_step.seq.pages.block_table) == len(b.decode_step.seq.pages.block_table) == n_pages_for(p + T)
    # The same bits as A's own decode steps over the same positions (after rolling the pass back).
    a.rollback(p)
    again = np.stack([a.decode(t) for t in tokens])
    assert not (bad := _differing_rows(rows, again)), f"rows {bad} differ from A's own decode steps"
    # The pass's own argmax (what greedy speculation reads back instead of the rows).
    a.rollback(p)
    a.verify_pass.buf["next_token"].fill_bytes(0xFF)
    assert a.verify_greedy(tokens) == [argmax(r) for r in rows]
    # Roll back to an accepted count; the next decode is the same on both.
    keep = p + (T + 1) // 2
    a.rollback(keep)
    b.rollback(keep)
    t = int(rng.integers(0, V))
    la, lb = a.decode(t), b.decode(t)
    assert np.array_equal(_bits(la), _bits(lb)), f"after rollback to {keep}: the next decode differs"
    assert a.cached_ids() == b.cached_ids() == prompt + tokens[:keep - p] + [t]


def test_prenorm_pass_rows_are_the_decode_steps_bits(pair, rng):
    """The pass with the RMSNorms as launches of their own (VerifyPass prenorm: rmsnorm over the
    T rows, then the …_x_tokens GEMVs): the decode steps' rows bit for bit, graph and eager."""
    from drvqwen.verify_pass import VerifyPass

    a, b = pair
    V = a.config.vocab_size
    for graphs in (False, True):
        vp = VerifyPass(a.decode_step, graphs=graphs, fallback=False, prenorm=True)
        try:
            for p, T in ((13, 5), (30, 8), (40, 16)):
                prompt, tokens = rng.integers(0, V, p).tolist(), rng.integers(0, V, T).tolist()
                _prefill_both(a, b, prompt)
                vp.buf["logits"].fill_bytes(0xFF)
                rows = vp.run(tokens)
                want = np.stack([b.decode(t) for t in tokens])
                assert not (bad := _differing_rows(rows, want)), f"graphs={graphs} p={p} T={T}: rows {bad} differ"
        finally:
            vp.close()


def test_consecutive_passes_continue_where_the_last_ended(pair, rng):
    """No rollback between passes (every proposal accepted): each pass starts at the state the
    last one's advance_state_tokens left — 9 → 16 → 32 → 37, across two page boundaries."""
    a, b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, 9).tolist()
    _prefill_both(a, b, prompt)
    for T in (7, 16, 5):
        tokens = rng.integers(0, V, T).tolist()
        _poison(a)
        rows = a.verify(tokens)
        want = np.stack([b.decode(t) for t in tokens])
        assert not (bad := _differing_rows(rows, want)), f"pass of {T}: rows {bad} differ"
        assert _state(a) == _state(b)
    t = int(rng.integers(0, V))
    assert np.array_equal(_bits(a.decode(t)), _bits(b.decode(t)))


def test_more_than_16_tokens_decode_one_by_one(pair, rng):
    a, b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, 10).tolist()
    tokens = rng.integers(0, V, 17).tolist()
    _prefill_both(a, b, prompt)
    rows = a.verify(tokens)
    want = DecodeVerify.verify(b, tokens)
    assert rows.shape == (17, V) and not _differing_rows(rows, want)


class OracleProposer:
    """Proposes what plain decoding generated next — with its 4th token wrong every other pass —
    so that, whatever the model, passes of up to 9 tokens run, long runs are accepted and some
    proposals are rejected (a rollback inside the pass)."""

    name, max_tokens = "oracle", 8

    def __init__(self, plain: list[int], vocab_size: int):
        self.plain, self.vocab_size, self.passes = plain, vocab_size, 0

    def propose(self, context, k, params, index):
        out = list(self.plain[index:index + k])
        self.passes += 1
        if self.passes % 2 == 0 and len(out) > 3:
            out[3] = (out[3] + 1) % self.vocab_size
        return out, None

    def close(self) -> None:
        pass


def test_greedy_speculation_gives_plain_decodings_tokens(pair, rng):
    """generate() with proposals verified by A's pass against A's own plain token stream (the
    decode graphs of the same plain-attention step): the same tokens."""
    a, _b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, 40).tolist()
    plain = generate(a, prompt, 60).tokens
    spec = generate(a, prompt, 60, speculation=OracleProposer(plain, V))
    assert a.verify_implementation == "VerifyPass.run"
    assert spec.tokens == plain
    s = spec.speculation
    print(f"\n{s.summary()}")
    assert 0 < s.accepted < s.proposed and s.verify_passes < len(plain) - 1


def test_queued_greedy_steps_are_the_decode_steps(pair, rng):
    """queue_greedy / take_greedy (the decode graph, its choice through the host ring): steps
    queued two deep, each consuming the one before's choice on the GPU, across a page boundary
    and around the ring more than once, give B's decode steps' argmax; the cached ids and device
    state follow; nothing else may run while a step is queued."""
    a, b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, 9).tolist()
    _prefill_both(a, b, prompt)
    first = int(rng.integers(0, V))
    a.queue_greedy(first)
    got, want, t = [], [], first
    for _ in range(20):                          # positions 9 … 29: page 1 opens at 16
        a.queue_greedy(None)
        got.append(a.take_greedy())
        t = argmax(b.decode(t))
        want.append(t)
    with pytest.raises(RuntimeError, match="queued greedy steps not taken"):
        a.verify_greedy([1, 2])
    with pytest.raises(RuntimeError, match="queued greedy steps not taken"):
        a.rollback(len(prompt))
    got.append(a.take_greedy())
    want.append(argmax(b.decode(t)))
    assert got == want
    assert a.cached_ids() == b.cached_ids() == prompt + [first] + want[:-1]
    assert _state(a) == _state(b)
    with pytest.raises(RuntimeError, match="consumes the choice of a step queued before it"):
        a.queue_greedy(None)


def test_greedy_lookahead_speculation_gives_plain_tokens(pair, rng):
    """generate() with helpers.ScriptedProposer: decode steps queued ahead while nothing is
    proposed, proposals checked by a queued step, passes after it and from the host's token —
    plain decoding's tokens and cache. Then the stream closed after each count of tokens from
    24 to 33 (after tokens out of queued steps and of passes: the script's period is 9 passes):
    the cache holds every token out but the last, where the plain stream holds the last too
    (the step it had queued ahead consumes it)."""
    from drvqwen.sampler import SamplingParams
    from drvqwen.speculative_loop import SpeculationStats, speculative_tokens

    a, _b = pair
    V = a.config.vocab_size
    prompt = rng.integers(0, V, 40).tolist()
    plain = generate(a, prompt, 80, ignore_stop=True).tokens
    plain_cache = a.cached_ids()
    proposer = ScriptedProposer(plain, V)
    spec = generate(a, prompt, 80, ignore_stop=True, speculation=proposer)
    assert spec.tokens == plain and a.cached_ids() == plain_cache
    s = spec.speculation
    print(f"\n{s.summary()}")
    assert 0 < s.accepted < s.proposed and s.verify_passes < len(plain) - 1
    assert (s.proposed, s.accepted) == (proposer.proposed, proposer.right)
    for at in range(24, 34):
        stream = speculative_tokens(a, prompt, 80, SamplingParams(), ScriptedProposer(plain, V),
                                    SpeculationStats("scripted"))
        got = [t for _i, t in zip(range(at), stream)]
        stream.close()
        assert got == plain[:at] and a.cached_ids() == prompt + plain[:at - 1], at
        stream = a.token_stream(prompt, 80)
        assert [t for _i, t in zip(range(at), stream)] == plain[:at]
        stream.close()
        assert a.cached_ids() == prompt + plain[:at], at


@pytest.mark.parametrize("name", ["0.5b", "7b"])
def test_real_widths_pass_equals_its_own_decode_steps(tmp_path, rng, name):
    """The real models' widths (two layers, the full vocabulary), where the T-token GEMVs' shared
    memory and the driver's occupancy choose the grids: a pass of 16 tokens across a page
    boundary gives the bits of the same backend's decode steps over the same positions."""
    from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
    from drvqwen.engine import GPUBackend

    cfg = {"0.5b": QWEN25_CODER_05B, "7b": QWEN25_CODER_7B}[name].with_layers(2)
    path = tmp_path / f"{name}.nanoqwen"
    write_synthetic(path, cfg, seed=31, tokenizer_json=minimal_tokenizer_json())
    f = NanoqwenFile(path)
    a = GPUBackend(f, 256, rng=rng, speculative=True)
    try:
        prompt = rng.integers(0, cfg.vocab_size, 20).tolist()
        tokens = rng.integers(0, cfg.vocab_size, 16).tolist()
        a.prefill(prompt)
        _poison(a)
        rows = a.verify(tokens)                      # positions 20 … 35: opens page 2
        assert not np.isnan(rows).any()
        a.rollback(len(prompt))
        want = np.stack([a.decode(t) for t in tokens])
        assert not (bad := _differing_rows(rows, want)), f"rows {bad} differ from the decode steps"
    finally:
        a.close()
        f.close()


# (prompt length, T): a pass inside a page, one that opens page 1 (positions 10 … 17) and one
# that opens page 2 (18 … 33); each T's graph is captured on its pass here.
GRAPH_CASES = [(9, 1), (10, 8), (18, 16)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_graph_replay_rows_equal_the_eager_pass_bits(tmp_path, rng, config):
    """A's passes replay CUDA graphs (use_graphs=True, one per T), B's launch eagerly
    (use_graphs=False): the same bits for T = 1, 8, 16, passes that open a page included — on the
    first replay of each T's graph and on a later one (after a rollback, the page opened again)."""
    from drvqwen.engine import GPUBackend

    path = tmp_path / f"{config}.nanoqwen"
    write_synthetic(path, CONFIGS[config], seed=2027, tokenizer_json=minimal_tokenizer_json())
    f = NanoqwenFile(path)
    a = GPUBackend(f, MAX_CONTEXT, rng=np.random.default_rng(1), chunk_rows=64, speculative=True)
    b = GPUBackend(f, MAX_CONTEXT, rng=np.random.default_rng(2), chunk_rows=64, speculative=True, use_graphs=False)
    try:
        V = a.config.vocab_size
        prompt = rng.integers(0, V, GRAPH_CASES[0][0]).tolist()
        _prefill_both(a, b, prompt)
        for replay in ("first", "again"):
            for p, T in GRAPH_CASES:
                assert a.decode_step.seq.pos == b.decode_step.seq.pos == p
                tokens = rng.integers(0, V, T).tolist()
                _poison(a)
                _poison(b)
                rows, want = a.verify(tokens), b.verify(tokens)
                assert not np.isnan(rows).any() and not np.isnan(want).any(), "a row a pass did not write"
                assert not (bad := _differing_rows(rows, want)), f"{replay} replay of T={T}: rows {bad} differ"
                assert _state(a) == _state(b) == [p + T, int(want[-1].argmax()), p + T + 1]
            a.rollback(GRAPH_CASES[0][0])    # gives pages 1 and 2 back: the passes open them again
            b.rollback(GRAPH_CASES[0][0])
        assert a.verify_pass.mode == "graph" and sorted(a.verify_pass.num_nodes) == [1, 8, 16]
        assert b.verify_pass.mode == "eager" and b.verify_pass.num_nodes == {}
        t = int(rng.integers(0, V))
        assert np.array_equal(_bits(a.decode(t)), _bits(b.decode(t)))
    finally:
        a.close()
        b.close()
        f.close()
