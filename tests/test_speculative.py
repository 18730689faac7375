"""Speculative decoding is lossless on the CPU backend with tiny synthetic models: greedy output
identical token for token to plain decoding over hundreds of tokens, across KV pages and up to
the context's end, with prompt lookup and with draft models (one close to the target, one
unrelated); the cache afterwards holds what plain decoding leaves, also when a stop token or
a stop string ends the answer inside a verify pass. Plus the proposers' own rules, the
backend's verify and rollback, and the statistics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.generate import CPUBackend, generate
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.sampler import SamplingParams
from drvqwen.speculative import MAX_PROPOSAL, DraftModel, PromptLookup, lookup

from helpers import TINY, ScriptedProposer, byte_tokenizer_json, random_dense, write_model

CTX = 512
CFG = dataclasses.replace(TINY, max_position=CTX)
GREEDY = SamplingParams()
# A repeat penalty keeps the tiny random model's greedy output from settling on one token, so
# that proposals are both accepted and rejected.
PENALIZED = SamplingParams(repeat_penalty=1.3)


def _write(path, dense):
    write_model(path, CFG, dense, tokenizer_json=byte_tokenizer_json())
    return NanoqwenFile(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target; a draft close to it (its weights plus 5 % noise, quantized again); a draft
    of an unrelated seed."""
    d = tmp_path_factory.mktemp("spec")
    dense = random_dense(CFG, np.random.default_rng(11))
    rng = np.random.default_rng(5)
    near = {k: v + (0.05 * v.std() * rng.standard_normal(v.shape)).astype(np.float32) for k, v in dense.items()}
    files = {"target": _write(d / "target.nanoqwen", dense), "near": _write(d / "near.nanoqwen", near),
             "other": _write(d / "other.nanoqwen", random_dense(CFG, np.random.default_rng(99)))}
    yield files
    for f in files.values():
        f.close()


def repeating_prompt(n_parts: int = 4) -> list[int]:
    """A prompt that repeats one random 20-byte piece: what prompt lookup finds."""
    return [int(t) for t in np.random.default_rng(0).integers(0, 256, 20)] * n_parts


def run_both(f, prompt, n, params, speculation, ctx=CTX, **kw):
    """(plain result, speculative result, plain cache ids, speculative cache ids)."""
    plain_b, spec_b = CPUBackend(f, ctx), CPUBackend(f, ctx)
    plain = generate(plain_b, prompt, n, params, **kw)
    spec = generate(spec_b, prompt, n, params, speculation=speculation, **kw)
    return plain, spec, plain_b.cached_ids(), spec_b.cached_ids()


# ---- the proposers' rules --------------------------------------------------------------------
def test_lookup_takes_the_longest_match_and_its_most_recent_full_copy():
    # ... 7 8 9 occurs twice; the suffix 8 9 matches both (2-gram), and 7 8 9 only the second.
    ctx = [1, 8, 9, 4, 4, 7, 8, 9, 5, 6, 2, 3, 7, 8, 9]
    assert lookup(ctx, 2, ngram=3) == [5, 6]
    assert lookup(ctx, 2, ngram=2) == [5, 6]              # 8 9 at 1 and at 6: the most recent full one
    # The most recent occurrence with k tokens after it; else the earliest (most tokens after it).
    assert lookup([5, 1, 2, 3, 4, 5, 1, 2, 3, 5], 2, ngram=1) == [1, 2]
    assert lookup([7, 7, 7, 7, 7], 3, ngram=3) == [7, 7]      # only occurrence of 7 7 7 with room: start 0
    assert lookup([1, 2, 3, 4], 4) == []                      # nothing occurs twice
    assert lookup([3], 4) == []
    # min_ngram: a shorter suffix is not searched for.
    assert lookup([4, 9, 1, 2, 4], 3, ngram=3, min_ngram=2) == []
    assert lookup([4, 9, 1, 2, 4], 3, ngram=3, min_ngram=1) == [9, 1, 2]


def test_proposal_lengths_are_checked():
    for bad in (0, -1, MAX_PROPOSAL + 1, 2.5, True):
        with pytest.raises(DrvqwenError, match="--lookup"):
            PromptLookup(bad)
    with pytest.raises(DrvqwenError, match="--draft-max"):
        DraftModel(object(), MAX_PROPOSAL + 1)
    assert PromptLookup(MAX_PROPOSAL, min_ngram=1).propose([1, 2, 1], 99, GREEDY, 0) == ([2, 1], None)
    # The default proposes on a match of the last 3 tokens only, not of 1 or 2.
    assert PromptLookup(8).propose([1, 2, 1], 99, GREEDY, 0) == ([], None)
    assert PromptLookup(8).propose([5, 7, 9, 4, 7, 9], 99, GREEDY, 0) == ([], None)
    assert PromptLookup(8).propose([5, 7, 9, 4, 5, 7, 9], 99, GREEDY, 0) == ([4, 5, 7, 9], None)
    for lo, hi in ((0, 3), (4, 3)):
        with pytest.raises(DrvqwenError, match=rf"prompt lookup n-grams {lo} … {hi}: need 1 <= min <= max"):
            PromptLookup(4, ngram=hi, min_ngram=lo)


# ---- the backend's verify and rollback ---------------------------------------------------------
def test_verify_rows_are_the_decode_steps_and_rollback_drops_positions(models):
    f = models["target"]
    prompt, tokens = repeating_prompt(2)[:30], [5, 17, 200, 3, 9]      # positions 30 … 34: page 2 opens at 32
    a, b = CPUBackend(f, 64), CPUBackend(f, 64)
    a.prefill(prompt)
    b.prefill(prompt)
    rows = a.verify(tokens)
    assert rows.shape == (len(tokens), CFG.vocab_size) and rows.dtype == np.float32
    for i, t in enumerate(tokens):
        np.testing.assert_array_equal(rows[i], b.decode(t))
    # Roll back the last three positions: decoding other tokens there gives what a backend that
    # never saw the dropped ones gives (the same steps: prefill, then decodes).
    a.rollback(len(prompt) + 2)
    assert a.cached_ids() == prompt + tokens[:2] and a.model.cache.seq_len == len(prompt) + 2
    free_a, total = a.kv_pages()
    assert len(a.model.cache.block_table) == 2 and free_a == total - 2          # page 2 given back
    c = CPUBackend(f, 64)
    c.prefill(prompt)
    c.verify(tokens[:2])
    np.testing.assert_array_equal(a.decode(42), c.decode(42))
    with pytest.raises(DrvqwenError, match="rollback to 99 positions"):
        a.rollback(99)


# ---- lossless: greedy -----------------------------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, PENALIZED], ids=["greedy", "repeat-penalty"])
def test_prompt_lookup_greedy_is_plain_decoding(models, params):
    prompt = repeating_prompt()
    n = 400                                   # 480 positions: 30 pages
    plain, spec, plain_ids, spec_ids = run_both(models["target"], prompt, n, params, PromptLookup(8),
                                                ignore_stop=True)
    assert len(plain.tokens) == n and spec.tokens == plain.tokens
    assert spec_ids == plain_ids == prompt + plain.tokens[:-1]
    s = spec.speculation
    assert s.accepted > 0 and s.verify_passes < n - 1
    # Each pass gives its own token after the proposals it accepted — except a queued greedy
    # step whose choice is the first proposal's check: its one token is both (speculative_loop).
    assert s.verify_passes <= s.pass_tokens <= s.accepted + s.verify_passes
    if params.penalized:
        assert s.pass_tokens == s.accepted + s.verify_passes
    if params.penalized:                      # both ways of a verify pass ending were taken
        assert s.accepted < s.proposed


@pytest.mark.parametrize("params", [GREEDY, PENALIZED], ids=["greedy", "repeat-penalty"])
def test_greedy_without_a_penalty_reads_back_only_each_rows_choice(models, params, monkeypatch):
    """Greedy without a repeat penalty needs each row's argmax only (`verify_greedy`: on the GPU
    T ids instead of T rows); with a penalty the rows themselves (`verify`)."""
    calls = []
    for name in ("verify", "verify_greedy"):
        orig = getattr(CPUBackend, name)
        monkeypatch.setattr(CPUBackend, name, lambda self, t, _o=orig, _n=name: (calls.append(_n), _o(self, t))[1])
    res = generate(CPUBackend(models["target"], CTX), repeating_prompt(), 60, params, ignore_stop=True,
                   speculation=PromptLookup(8))
    assert res.speculation.verify_passes > 0
    assert calls.count("verify_greedy") == (res.speculation.verify_passes if not params.penalized else 0)
    assert calls.count("verify") == res.speculation.verify_passes


def test_accept_greedy_takes_proposals_up_to_the_first_miss():
    from drvqwen.speculative_loop import _accept_greedy

    assert _accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]      # all accepted, then the bonus token
    assert _accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]            # the miss: the target's token, stop
    assert _accept_greedy([4, 6], [5]) == [4]
    assert _accept_greedy([3], []) == [3]                               # nothing proposed: one decode


@pytest.mark.parametrize("draft", ["near", "other"])
def test_draft_model_greedy_is_plain_decoding(models, draft):
    prompt = repeating_prompt()
    proposer = DraftModel(CPUBackend(models[draft], CTX), 6, name=f"draft {draft}")
    plain, spec, plain_ids, spec_ids = run_both(models["target"], prompt, 300, PENALIZED, proposer,
                                                ignore_stop=True)
    assert spec.tokens == plain.tokens and spec_ids == plain_ids
    s = spec.speculation
    assert s.proposed > 0 and s.accepted < s.proposed
    if draft == "near":
        assert s.accepted > 0
    # The draft's cache follows the accepted sequence: it holds a prefix of it plus at most the
    # proposals of the last pass.
    held = proposer.backend.cached_ids()
    common = next((i for i, (x, y) in enumerate(zip(held, prompt + spec.tokens)) if x != y), len(held))
    assert common >= len(held) - 6


def test_up_to_the_context_end(models):
    ctx = 7 * PAGE_TOKENS + 5
    prompt = repeating_prompt()
    for proposer in (PromptLookup(MAX_PROPOSAL), DraftModel(CPUBackend(models["near"], ctx), MAX_PROPOSAL)):
        plain, spec, plain_ids, spec_ids = run_both(models["target"], prompt, 1000, PENALIZED, proposer,
                                                    ctx=ctx, ignore_stop=True)
        assert plain.stopped_by == spec.stopped_by == "context full"
        assert len(spec.tokens) == ctx - len(prompt) and spec.tokens == plain.tokens
        assert spec_ids == plain_ids and len(spec_ids) == ctx - 1


def test_stops_inside_a_verify_pass_leave_the_plain_cache(models):
    prompt = repeating_prompt()
    plain = generate(CPUBackend(models["target"], CTX), prompt, 300, PENALIZED, ignore_stop=True).tokens
    # A stop id that first appears well inside the answer, and a stop string (on_token) there.
    at = next(i for i in range(40, 300) if plain[i] not in plain[:i])
    stop = frozenset({plain[at]})
    p, s, p_ids, s_ids = run_both(models["target"], prompt, 300, PENALIZED, PromptLookup(MAX_PROPOSAL),
                                  stop_ids=stop)
    assert p.stopped_by == s.stopped_by == "stop token" and s.tokens == p.tokens == plain[:at]
    assert s_ids == p_ids
    for cut in (57, 58, 59):
        results, ids = [], []
        for speculation in (None, PromptLookup(MAX_PROPOSAL)):
            b, seen = CPUBackend(models["target"], CTX), []
            results.append(generate(b, prompt, 300, PENALIZED, speculation=speculation,
                                    on_token=lambda t, seen=seen: seen.append(t) or len(seen) == cut))
            ids.append(b.cached_ids())
        p, s = results
        assert s.tokens == p.tokens == plain[:cut] and s.stopped_by == "stop string"
        assert ids[0] == ids[1] == prompt + plain[:cut - 1]


def test_reuse_continues_the_cached_sequence(models):
    """A second turn with reuse (chat, the server) keeps the cached prefix and gives plain
    decoding's tokens."""
    prompt = repeating_prompt()
    plain_b, spec_b = CPUBackend(models["target"], CTX), CPUBackend(models["target"], CTX)
    first = generate(spec_b, prompt, 50, PENALIZED, speculation=PromptLookup(8), reuse=True, ignore_stop=True)
    generate(plain_b, prompt, 50, PENALIZED, reuse=True, ignore_stop=True)
    turn2 = prompt + first.tokens + repeating_prompt(1)
    a = generate(plain_b, turn2, 100, PENALIZED, reuse=True, ignore_stop=True)
    b = generate(spec_b, turn2, 100, PENALIZED, speculation=PromptLookup(8), reuse=True, ignore_stop=True)
    assert b.tokens == a.tokens and b.reused_tokens == a.reused_tokens == len(prompt) + 49


# ---- sampling ----------------------------------------------------------------------------------
def test_prompt_lookup_sampling_keeps_the_seeded_text(models):
    """With a deterministic proposer, the acceptance rule is drawn with the plain sampler's own
    numbers (speculative_accept.py): the seeded text is plain decoding's."""
    params = SamplingParams(temperature=0.8, top_k=3, seed=3)
    plain, spec, plain_ids, spec_ids = run_both(models["target"], repeating_prompt(), 300, params,
                                                PromptLookup(8), ignore_stop=True)
    assert spec.tokens == plain.tokens and spec_ids == plain_ids
    assert 0 < spec.speculation.accepted < spec.speculation.proposed


def test_draft_model_sampling_is_reproducible(models):
    params = SamplingParams(temperature=0.8, top_k=3, seed=3)
    runs = []
    for _ in range(2):
        draft = DraftModel(CPUBackend(models["near"], CTX), 4)
        r = generate(CPUBackend(models["target"], CTX), repeating_prompt(), 200, params, speculation=draft,
                     ignore_stop=True)
        runs.append(r)
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 200
    assert runs[0].speculation == runs[1].speculation and runs[0].speculation.accepted > 0
    assert max(runs[0].tokens) < models["target"].text_vocab


# ---- statistics -----------------------------------------------------------------------------------
def test_statistics_in_the_summary_and_the_json(models):
    from drvqwen.stats import RunStats

    r = generate(CPUBackend(models["target"], CTX), repeating_prompt(), 60, PENALIZED,
                 speculation=PromptLookup(8), ignore_stop=True)
    s = r.speculation
    assert f"prompt lookup: {s.proposed} proposed, {s.accepted} accepted" in r.summary()
    d = RunStats().to_dict(r)["speculation"]
    assert d["proposed"] == s.proposed and d["accepted"] == s.accepted and d["verify_passes"] == s.verify_passes
    assert d["acceptance_rate"] == pytest.approx(s.accepted / s.proposed)
    assert d["tokens_per_pass"] == pytest.approx(s.pass_tokens / s.verify_passes)
    plain = generate(CPUBackend(models["target"], CTX), repeating_prompt(), 5, PENALIZED)
    assert RunStats().to_dict(plain)["speculation"] is None and "proposed" not in plain.summary()


class _Recording(CPUBackend):
    """A CPUBackend that records the order of its queue_greedy / take_greedy / verify calls."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []
        self.queueing = False

    def queue_greedy(self, token=None):
        self.calls.append("queue" if token is not None else "queue-ahead")
        self.queueing = True                 # the CPU's queue_greedy runs verify_greedy itself
        try:
            return super().queue_greedy(token)
        finally:
            self.queueing = False

    def take_greedy(self):
        self.calls.append("take")
        return super().take_greedy()

    def verify_greedy(self, tokens):
        if not self.queueing:
            self.calls.append(f"verify{len(tokens)}")
        return super().verify_greedy(tokens)


@pytest.mark.parametrize("stop_at", [None, 46, 47, 78])
def test_greedy_lookahead_gives_plain_decodings_tokens_and_cache(models, stop_at):
    """Greedy without a penalty, every path of the lookahead (helpers.ScriptedProposer): the plain
    tokens and cache, K/V included (the next decode's logits, bit for bit) — also when a stop id
    ends the answer (stop_at: where its first occurrence is, at or after; greedy decoding of
    the unrelated model from this prompt first gives new ids at 46, 47 and 78: so the stop
    falls after tokens that came out of queued steps and of passes)."""
    f = models["other"]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]
    plain_all = generate(CPUBackend(f, CTX), prompt, 120, GREEDY, ignore_stop=True).tokens
    kw = {"ignore_stop": True}
    if stop_at is not None:
        at = next(i for i in range(stop_at, 120) if plain_all[i] not in plain_all[:i])
        kw = {"stop_ids": frozenset({plain_all[at]})}
    plain_b, spec_b = CPUBackend(f, CTX), _Recording(f, CTX)
    plain = generate(plain_b, prompt, 120, GREEDY, **kw)
    proposer = ScriptedProposer(plain_all, CFG.vocab_size)
    spec = generate(spec_b, prompt, 120, GREEDY, speculation=proposer, **kw)
    assert spec.tokens == plain.tokens and spec.stopped_by == plain.stopped_by
    assert spec_b.cached_ids() == plain_b.cached_ids()
    np.testing.assert_array_equal(spec_b.decode(5), plain_b.decode(5))
    calls = " ".join(spec_b.calls)
    # A step queued ahead of the take of the one before it; a proposal checked by a queued
    # step and continued by a pass from its token; passes from the host's token.
    assert "queue queue-ahead take" in calls and "queue-ahead take take verify4" in calls
    assert "queue-ahead take take verify2" in calls       # one proposal, one token: no pass after
    assert "verify1" not in calls            # one token is a queued step, never a pass
    s = spec.speculation
    assert 0 < s.accepted < s.proposed
    assert (s.proposed, s.accepted) == (proposer.proposed, proposer.right)
    assert s.verify_passes <= s.pass_tokens < s.accepted + s.verify_passes
    # Every step taken and every pass counts — but for a step queued ahead of a token the
    # consumer stopped at, taken only to empty the queue; at the budget's end none is queued.
    extra = calls.count("take") + sum(c.startswith("verify") for c in spec_b.calls) - s.verify_passes
    assert extra == 0 if stop_at is None else extra in (0, 1)


def test_queue_greedy_needs_a_queued_step_to_follow(models):
    b = CPUBackend(models["target"], CTX)
    b.prefill(repeating_prompt(1))
    with pytest.raises(RuntimeError, match="queue_greedy\\(None\\)"):
        b.queue_greedy(None)
    with pytest.raises(RuntimeError, match="take_greedy\\(\\) with no step queued"):
        b.take_greedy()
    # Two steps, the second consuming the first's choice: the tokens of two verify_greedy calls.
    c = CPUBackend(models["target"], CTX)
    c.prefill(repeating_prompt(1))
    b.queue_greedy(7)
    b.queue_greedy(None)
    first, second = b.take_greedy(), b.take_greedy()
    assert [first] == c.verify_greedy([7]) and [second] == c.verify_greedy([first])
    assert b.cached_ids() == c.cached_ids()


class _Silent:
    """Proposes nothing, ever: every pass is a decode step queued ahead."""

    name, max_tokens = "silent", 8

    def propose(self, context, k, params, index):
        return [], None

    def close(self) -> None:
        pass


@pytest.mark.parametrize("n", [1, 2, 37])
def test_nothing_proposed_runs_plain_decoding_queued_ahead_to_the_budget(models, n):
    """Nothing proposed: one step queued ahead of each take, none past the budget (the last
    token's step is not queued), the plain tokens and cache."""
    f = models["other"]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]
    plain_b, spec_b = CPUBackend(f, CTX), _Recording(f, CTX)
    plain = generate(plain_b, prompt, n, GREEDY, ignore_stop=True)
    spec = generate(spec_b, prompt, n, GREEDY, ignore_stop=True, speculation=_Silent())
    assert spec.tokens == plain.tokens and spec_b.cached_ids() == plain_b.cached_ids()
    assert spec_b.calls == (["queue", "queue-ahead", "take"] + ["queue-ahead", "take"] * (n - 3) + ["take"]
                            if n > 2 else ["queue", "take"] * (n - 1))
    assert spec.speculation.verify_passes == spec.speculation.pass_tokens == n - 1


def test_an_exception_with_a_step_queued_leaves_nothing_for_the_next_generation(models):
    """A stream that ends by an exception other than its closing (Ctrl-C in a chat) with a
    choice still queued: the next generation — a chat's next turn reuses the cache — gives what
    a fresh backend gives."""
    f = models["other"]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]

    class Interrupted(CPUBackend):
        ahead = 0

        def queue_greedy(self, token=None):
            if token is None:
                self.ahead += 1
                if self.ahead == 5:           # a choice is queued, not taken: interrupted here
                    raise KeyboardInterrupt
            return super().queue_greedy(token)

    b = Interrupted(f, CTX)
    with pytest.raises(KeyboardInterrupt):
        generate(b, prompt, 60, GREEDY, ignore_stop=True, speculation=_Silent())
    stale = list(b.__dict__.get("_greedy_queue", ()))
    assert stale                                 # the state the next generation must not see
    # A next turn whose second token is not the stale choice, so taking that choice shows.
    fresh = CPUBackend(f, CTX)
    rng = np.random.default_rng(5)
    turns = [[int(t) for t in rng.integers(0, 256, 30)] for _ in range(6)]
    want = {i: generate(fresh, nxt, 20, GREEDY, ignore_stop=True).tokens for i, nxt in enumerate(turns)}
    i = next(i for i in want if want[i][1] != stale[0])
    again = generate(b, turns[i], 20, GREEDY, ignore_stop=True, speculation=_Silent(), reuse=True)
    assert again.tokens == want[i]
