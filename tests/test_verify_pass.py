"""The verify pass's host side (verify_pass.py) and the engine's choice of it, without a GPU.

A decode step stand-in (`FakeStep`: the plan made with a fixed occupancy, a `Sequence` over numpy
state and block table) and a pool that hands out addresses without memory let `VerifyPass` be
built on the CPU; its launches and its logits are replaced by recorders. Checked here: which
decode steps a pass exists for; that every T's buffers are the first T rows of the one 16-token
pool (and the shared ones the decode step's); that `run` opens the pages of positions p … p+T-1
before it launches — a chunk that crosses a page boundary, one that ends at the context's last
position — and leaves the sequence at p + T; that bad chunks are refused before anything changes;
which path `GPUBackend.verify` takes; that only a speculating GPUBackend asks for the plain
attention kernel and the verify pass's kernels (the default one's decode step stays as it is).
With graphs: one graph per T, captured on its first pass before the pass's pages are opened and
replayed after, the ids queued ahead of the replay; a failed capture falls back to eager launches
(or raises with fallback=False); graphs=False never captures.
"""

from __future__ import annotations

from collections import deque

import types

import numpy as np
import pytest

from drvqwen import engine, graphs, verify_pass
from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.cuda import DEFAULT_ALIGN_BYTES, CudaError, DeviceArray
from drvqwen.decode import DEFAULT_ATTENTION, plan_decode
from drvqwen.errors import DrvqwenError
from drvqwen.format.recipes import recipe_formats
from drvqwen.generate import DecodeVerify
from drvqwen.kv_cache import PAGE_TOKENS, PageAllocator, n_pages_for
from drvqwen.launchers import FixedOccupancy
from drvqwen.launchers.base import BufferSpec
from drvqwen.sequence import Sequence
from drvqwen.step.machine_cpu import HostArray
from drvqwen.verify_pass import SHARED, VerifyPass, check_chunk, matches_decode
from drvqwen.verify_plan import plan_verify

OCC = FixedOccupancy(132, lambda _k, _t, _s: 2)
MAX_CONTEXT = 128


class FakePool:
    """Pool's alloc and close without device memory: aligned addresses from a made-up base, the
    capacity enforced as Pool enforces it."""

    def __init__(self, capacity_bytes: int, name: str = "pool") -> None:
        self.capacity_bytes, self.used_bytes, self.base = capacity_bytes, 0, 1 << 32
        self.closed = False

    def alloc(self, name: str, shape, dtype) -> DeviceArray:
        start = -(-self.used_bytes // DEFAULT_ALIGN_BYTES) * DEFAULT_ALIGN_BYTES
        arr = DeviceArray(name, self.base + start, shape, dtype)
        assert start + arr.nbytes <= self.capacity_bytes, f"{name} does not fit the pool"
        self.used_bytes = start + arr.nbytes
        return arr

    def close(self) -> None:
        self.closed = True


class FakeStep:
    """What VerifyPass reads of a DecodeStep: its plan, model, context, sequence and resolver."""

    def __init__(self, cfg=QWEN25_CODER_05B.with_layers(2), max_context=MAX_CONTEXT, attention="plain",
                 formats=None, rng=None):
        self.config, self.text_vocab, self.stream, self.pdl = cfg, cfg.vocab_size - 7, None, True
        self.plan = plan_decode(cfg, max_context, attention=attention, occupancy=OCC, text_vocab=self.text_vocab,
                                formats=formats)
        self.max_context = self.plan.max_context
        self.state, self.table = np.zeros(3, np.int32), np.full(self.plan.n_pages, -1, np.int32)
        self.seq = Sequence(PageAllocator(self.plan.n_pages, rng), HostArray(self.state), HostArray(self.table),
                            self.max_context)

    def resolve(self, spec):
        return ("decode step", spec.name)


@pytest.fixture
def fake_pool(monkeypatch):
    monkeypatch.setattr(verify_pass, "Pool", FakePool)


def _recording_pass(step: FakeStep) -> tuple[VerifyPass, list[dict]]:
    """A VerifyPass on `step` whose launches record what the device would see at that moment."""
    vp = VerifyPass(step, occupancy=OCC)
    launched = []
    vp.launch_list = lambda T: f"verify{T}"
    vp._launch = lambda ids, lst, _exe=None, _ev=None: launched.append(dict(ids=ids.copy(), list=lst, pos=step.seq.pos,
                                                      table=step.table.copy(),
                                                      pages=list(step.seq.pages.block_table)))
    vp._logits = lambda T: np.full((T, step.config.vocab_size), 0.5, np.float32)
    return vp, launched


def _after_prefill(step: FakeStep, n: int) -> None:
    """The sequence as a prefill of n tokens leaves it (Prefill.run's reserve and resume)."""
    step.seq.keep(0)
    step.seq.reserve(n)
    step.seq.resume(n)


# ---- which decode steps have a verify pass ------------------------------------------------------

def test_only_the_int4_step_with_plain_attention_has_a_verify_pass(fake_pool):
    cfg = QWEN25_CODER_05B.with_layers(1)
    assert matches_decode(plan_decode(cfg, MAX_CONTEXT, attention="plain", occupancy=OCC))
    assert not matches_decode(plan_decode(cfg, MAX_CONTEXT, attention="tma", occupancy=OCC))
    assert not matches_decode(plan_decode(cfg, MAX_CONTEXT, attention="plain", occupancy=OCC, persistent=True))
    fmt = recipe_formats(cfg, "q4_k_m")
    assert not matches_decode(plan_decode(cfg, MAX_CONTEXT, attention="plain", occupancy=OCC, formats=fmt))
    for step, what in ((FakeStep(cfg, attention="tma"), "attention='tma'"),
                       (FakeStep(cfg, formats=fmt), "per-tensor formats")):
        with pytest.raises(DrvqwenError, match=what) as e:
            VerifyPass(step, occupancy=OCC)
        assert "\n" not in str(e.value)


# ---- buffers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [QWEN25_CODER_05B.with_layers(2), QWEN25_CODER_7B.with_layers(2)],
                         ids=["0.5b", "7b"])
def test_every_t_runs_on_the_first_t_rows_of_one_16_token_pool(fake_pool, cfg):
    vp = VerifyPass(FakeStep(cfg), occupancy=OCC)
    full = plan_verify(cfg, MAX_CONTEXT, 16, occupancy=OCC)
    assert set(vp.buf) == set(full.buffers) - set(SHARED)
    for name, arr in vp.buf.items():
        assert (arr.shape, arr.dtype) == (full.buffers[name].shape, full.buffers[name].dtype), name
    per_t_pools = 0
    for T in range(1, 17):
        plan = vp.plan(T)
        per_t_pools += plan.activation_bytes
        assert plan.n_tokens == T and plan.blocks_per_kv_head == vp.decode_step.plan.blocks_per_kv_head
        planned = {a.name: a for _n, s in plan.named_specs() for a in s.args.values() if isinstance(a, BufferSpec)}
        for name, spec in planned.items():
            got = vp.resolve(spec)
            if name in vp.buf:
                # Token-major: token j's values are row j, whatever T is.
                assert isinstance(got, DeviceArray) and got.ptr == vp.buf[name].ptr, name
                assert (got.shape, got.dtype) == (spec.shape, spec.dtype) and got.shape[0] == T, name
            else:
                assert got == ("decode step", name), name   # shared buffers, weights, KV cache
        assert {"state", "block_table", "inv_freq"} <= set(planned) - set(vp.buf)
    # One pool for every T: several times less than a pool per T would take.
    assert vp.pool.capacity_bytes <= full.activation_bytes + DEFAULT_ALIGN_BYTES < per_t_pools / 4
    vp.close()
    assert vp.pool.closed


# ---- run: pages, sequence, refusals -------------------------------------------------------------

# (prompt length p, T, pages the chunk opens): inside a page; crossing into a new page; starting
# one exactly; ending at the context's last position (MAX_CONTEXT − 1) with a new page.
CHUNKS = [(20, 5, 0), (13, 5, 1), (30, 8, 1), (16, 16, 1), (MAX_CONTEXT - 16, 16, 1), (5, 1, 0)]


@pytest.mark.parametrize("p,T,opens", CHUNKS)
def test_run_opens_the_pages_of_the_chunk_before_it_launches(fake_pool, rng, p, T, opens):
    step = FakeStep(rng=rng)
    vp, launched = _recording_pass(step)
    _after_prefill(step, p)
    before = list(step.seq.pages.block_table)
    tokens = rng.integers(0, step.config.vocab_size, T).tolist()
    rows = vp.run(tokens)
    assert rows.shape == (T, step.config.vocab_size) and rows.dtype == np.float32
    [seen] = launched
    assert seen["list"] == f"verify{T}" and seen["ids"].dtype == np.int32 and seen["ids"].tolist() == tokens
    # At launch, the device block table holds a page for every position p … p+T-1; the pages the
    # prompt had are kept and the chunk's new page (if any) comes after them.
    n = n_pages_for(p + T)
    assert len(seen["pages"]) == n and seen["pages"][:len(before)] == before
    assert seen["table"][:n].tolist() == seen["pages"]
    assert len(seen["pages"]) - len(before) == opens
    assert seen["pos"] == p                       # the sequence moves only after the launch
    assert step.seq.pos == p + T
    # A decode step afterwards opens a page only at a page boundary, as after T decode steps.
    if p + T < MAX_CONTEXT:
        assert (step.seq.open_page() is not None) == ((p + T) % PAGE_TOKENS == 0)


def test_rollback_after_a_pass_gives_back_the_page_it_opened(fake_pool, rng):
    step = FakeStep(rng=rng)
    vp, launched = _recording_pass(step)
    _after_prefill(step, 30)
    kept = list(step.seq.pages.block_table)
    vp.run(rng.integers(0, 100, 8).tolist())      # positions 30 … 37: page 2 opened
    opened = step.seq.pages.block_table[-1]
    assert len(step.seq.pages.block_table) == 3
    assert step.seq.rollback(31, 0) == [opened]   # one proposal accepted: back below page 2
    assert step.seq.pages.block_table == kept and step.state.tolist() == [31, 0, 32]
    vp.run([1, 2])                                # 31, 32: the same page again
    assert step.seq.pages.block_table == kept + [opened] and step.seq.pos == 33


@pytest.mark.parametrize("tokens,pos,match", [([], 20, "verify pass of 0 tokens"),
                                              (list(range(17)), 20, "verify pass of 17 tokens"),
                                              ([1, -1], 20, "token id -1"),
                                              ([1, 10**6], 20, "token id 1000000"),
                                              ([1, 2, 3], MAX_CONTEXT - 2, "past the KV cache")])
def test_bad_chunks_are_refused_before_anything_changes(fake_pool, rng, tokens, pos, match):
    step = FakeStep(rng=rng)
    vp, launched = _recording_pass(step)
    _after_prefill(step, pos)
    pages = list(step.seq.pages.block_table)
    with pytest.raises(DrvqwenError, match=match) as e:
        vp.run(tokens)
    assert "\n" not in str(e.value)
    assert launched == [] and step.seq.pos == pos and step.seq.pages.block_table == pages


def test_check_chunk_takes_the_last_position_of_the_context():
    ids = check_chunk([3, 4], vocab_size=10, pos=6, max_context=8)
    assert ids.dtype == np.int32 and ids.tolist() == [3, 4]
    with pytest.raises(DrvqwenError, match="past the KV cache"):
        check_chunk([3, 4], vocab_size=10, pos=7, max_context=8)


# ---- the engine's choice ------------------------------------------------------------------------

def _backend(verify_pass, vocab: int = 50):
    """A GPUBackend without a GPU: only what `verify` reads (its decode a host-side stand-in)."""
    b = object.__new__(engine.GPUBackend)
    b.verify_pass, b._cached, b.decoded, b._queued = verify_pass, [], [], deque()
    b.decode = lambda t: b.decoded.append(t) or b._cached.append(t) or np.full(vocab, float(t), np.float32)
    return b


class _RecordingPass:
    def __init__(self, vocab: int = 50):
        self.runs, self.vocab = [], vocab

    def run(self, tokens):
        self.runs.append(list(tokens))
        return np.stack([np.full(self.vocab, -float(t), np.float32) for t in tokens])


@pytest.mark.parametrize("T", [1, 2, 16])
def test_verify_runs_one_pass_for_up_to_16_tokens(T):
    vp = _RecordingPass()
    b = _backend(vp)
    tokens = list(range(3, 3 + T))
    rows = b.verify(tokens)
    assert vp.runs == [tokens] and b.decoded == [] and b.cached_ids() == tokens
    assert rows.shape == (T, 50) and rows[:, 0].tolist() == [-float(t) for t in tokens]
    assert b.verify_implementation == "VerifyPass.run"


def test_verify_decodes_per_token_past_16_tokens_or_without_a_pass():
    vp = _RecordingPass()
    b = _backend(vp)
    rows = b.verify(list(range(17)))
    assert vp.runs == [] and b.decoded == list(range(17)) and rows[:, 0].tolist() == list(map(float, range(17)))
    b = _backend(None)
    assert b.verify([4, 5]).shape == (2, 50) and b.decoded == [4, 5]
    assert b.verify_implementation == DecodeVerify.verify_implementation == "DecodeVerify.verify"
    with pytest.raises(ValueError, match="at least one token"):
        _backend(_RecordingPass()).verify([])


class _Stop(Exception):
    """Raised by the DecodeStep stand-in: the constructor's arguments are all the test needs."""


@pytest.mark.parametrize("speculative,formats,attention,verify_kernels", [
    (False, None, None, False),           # the default: DecodeStep's own choice (TMA), no verify kernels
    (True, None, "plain", True),
    (False, "q4_k_m", None, False),
    (True, "q4_k_m", None, False),        # per-tensor formats: verify per token, the step unchanged
])
def test_only_a_speculating_int4_backend_decodes_with_plain_attention(monkeypatch, speculative, formats, attention,
                                                                      verify_kernels):
    cfg = QWEN25_CODER_05B
    f = types.SimpleNamespace(config=cfg, formats=recipe_formats(cfg, formats) if formats else None)
    requested = []

    def fake_step(_f, _max_context, **kw):
        raise _Stop(kw)

    monkeypatch.setattr(engine, "check_gpu_supports", lambda _f: None)
    monkeypatch.setattr(engine, "get_device", lambda: None)
    monkeypatch.setattr(engine, "load_kernels", requested.extend)
    monkeypatch.setattr(engine, "DecodeStep", fake_step)
    with pytest.raises(_Stop) as e:
        engine.GPUBackend(f, 256, speculative=speculative)
    assert e.value.args[0]["attention"] == attention
    assert requested == engine.engine_kernels(cfg, f.formats, speculative)
    files = {name for name, _d in requested}
    sixteen_token_gemvs = ("gemv_int4", {"GEMV_TOKENS": 16}) in requested
    assert sixteen_token_gemvs == verify_kernels
    if attention is None and formats is None:
        assert DEFAULT_ATTENTION == "tma" and "attention_decode_tma" in files


def test_the_speculating_engine_compiles_every_kernel_of_every_verify_list():
    cfg = QWEN25_CODER_7B
    wanted = engine.engine_kernels(cfg, speculative=True)
    for T in range(1, 17):
        for _n, s in plan_verify(cfg.with_layers(1), 4096, T, occupancy=OCC).named_specs():
            assert (s.kernel.file, dict(s.kernel.defines)) in wanted, (T, str(s.kernel))
    assert "attention_decode_tma" not in {n for n, _d in wanted}
    # Without speculation: the list it always was (the decode step's own kernels).
    assert engine.engine_kernels(cfg) == engine.engine_kernels(cfg, speculative=False)
    assert not engine.one_pass_verify(cfg, None, False) and engine.one_pass_verify(cfg, None, True)


# ---- CUDA graphs, one per T ---------------------------------------------------------------------

class _Log:
    """What reaches the device, in order: ("ids", [...]), ("eager", T), ("replay", T), with the
    sequence's pages at that moment for captures."""

    def __init__(self) -> None:
        self.events: list[tuple] = []


def _graph_pass(step: FakeStep, monkeypatch, log: _Log, *, graphs_on=True, fallback=True, refuse=()):
    """A VerifyPass on `step` whose lists, captures, replays, ids copy and logits are recorders;
    a capture of a T in `refuse` fails as the driver would refuse it."""
    def capture(stream, name, launches, what):
        T = int(name.removeprefix("verify"))
        log.events.append(("capture", T, len(launches), list(step.seq.pages.block_table)))
        if T in refuse:
            raise graphs.GraphCaptureError(name, launches[0][0], CudaError("cuLaunchKernel", "X", "refused"), what)
        return types.SimpleNamespace(launch=lambda _s: log.events.append(("replay", T)),
                                     destroy=lambda: log.events.append(("destroy", T))), 10 * T

    monkeypatch.setattr(verify_pass, "capture_launches", capture)
    vp = VerifyPass(step, occupancy=OCC, graphs=graphs_on, fallback=fallback)
    ns = types.SimpleNamespace

    def eager(T):
        return ns(launch=lambda _s=None: log.events.append(("eager", T)))
    vp.launch_list = lambda T: ns(name=f"verify{T}", launches=[ns(name=f"k{i}", launch=eager(T)) for i in range(3)])
    vp.buf["ids"] = types.SimpleNamespace(upload_at=lambda _at, ids, _s: log.events.append(("ids", ids.tolist())))
    vp._logits = lambda T: np.zeros((T, step.config.vocab_size), np.float32)
    step.sync = lambda: log.events.append(("sync",))
    return vp


def test_one_graph_per_t_captured_on_first_use_and_replayed_after(fake_pool, monkeypatch, rng):
    step, log = FakeStep(rng=rng), _Log()
    vp = _graph_pass(step, monkeypatch, log)
    _after_prefill(step, 14)
    assert vp.mode == "graph" and vp.num_nodes == {}
    vp.run([5])                        # 14
    pages_before = list(step.seq.pages.block_table)
    vp.run(list(range(1, 9)))          # 15 … 22: opens page 1
    vp.run([7])                        # 23
    vp.run(list(range(16)))            # 24 … 39: opens page 2
    vp.run(list(range(1, 9)))          # 40 … 47: T = 8 again, replayed
    captures = [e for e in log.events if e[0] == "capture"]
    assert [c[1] for c in captures] == [1, 8, 16] and all(c[2] == 3 for c in captures)
    assert vp.num_nodes == {1: 10, 8: 80, 16: 160}
    # Captured before the pass opened its page (reserve's synchronous copy comes after capture).
    assert captures[1][3] == pages_before and len(captures[2][3]) == 2
    device = [e for e in log.events if e[0] in ("ids", "replay", "eager")]
    assert device == [("ids", [5]), ("replay", 1), ("ids", list(range(1, 9))), ("replay", 8), ("ids", [7]),
                      ("replay", 1), ("ids", list(range(16))), ("replay", 16), ("ids", list(range(1, 9))),
                      ("replay", 8)]
    assert step.seq.pos == 48 and len(step.seq.pages.block_table) == 3
    log.events.clear()
    vp.close()
    assert log.events[0] == ("sync",) and sorted(e[1] for e in log.events[1:]) == [1, 8, 16]
    assert vp.pool.closed


def test_graphs_off_never_capture(fake_pool, monkeypatch, rng):
    step, log = FakeStep(rng=rng), _Log()
    vp = _graph_pass(step, monkeypatch, log, graphs_on=False)
    _after_prefill(step, 3)
    vp.run([1, 2])
    assert vp.mode == "eager" and vp.graph(2) is None
    assert log.events == [("ids", [1, 2])] + [("eager", 2)] * 3
    vp.close()
    assert ("sync",) not in log.events     # nothing to destroy: no wait either


def test_a_failed_capture_falls_back_to_eager_launches(fake_pool, monkeypatch, rng):
    step, log = FakeStep(rng=rng), _Log()
    vp = _graph_pass(step, monkeypatch, log, refuse={4})
    _after_prefill(step, 3)
    vp.run([1])
    with pytest.warns(RuntimeWarning, match="graph 'verify4' of the verify pass failed while recording 'k0'.*eagerly"):
        vp.run([1, 2, 3, 4])
    vp.run([9])                        # eager from now on, T = 1's graph included
    assert vp.mode == "eager" and "refused" in vp.fallback_reason
    device = [e for e in log.events if e[0] in ("replay", "eager")]
    assert device == [("replay", 1)] + [("eager", 4)] * 3 + [("eager", 1)] * 3
    assert step.seq.pos == 3 + 1 + 4 + 1


def test_a_failed_capture_raises_without_fallback(fake_pool, monkeypatch, rng):
    step, log = FakeStep(rng=rng), _Log()
    vp = _graph_pass(step, monkeypatch, log, fallback=False, refuse={2})
    _after_prefill(step, 15)
    with pytest.raises(graphs.GraphCaptureError, match="verify2"):
        vp.run([1, 2])
    # Nothing ran and nothing changed: the capture comes before the pages and the ids.
    assert step.seq.pos == 15 and len(step.seq.pages.block_table) == 1
    assert [e[0] for e in log.events] == ["capture"]


def test_capture_launches_names_the_owner_and_the_launch(monkeypatch):
    from contextlib import contextmanager

    @contextmanager
    def capture(_stream):
        yield types.SimpleNamespace(graph=None)

    def refused(_stream=None):
        raise CudaError("cuLaunchKernel", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "not permitted")

    monkeypatch.setattr(graphs, "capture", capture)
    ok = types.SimpleNamespace(launch=lambda _s=None: None)
    with pytest.raises(graphs.GraphCaptureError, match="graph 'verify3' of the verify pass failed while recording "
                                                         "'L0.attention'") as e:
        graphs.capture_launches(None, "verify3", [("embedding", ok), ("L0.attention",
                                                   types.SimpleNamespace(launch=refused))], what="the verify pass")
    assert e.value.graph == "verify3" and e.value.launch == "L0.attention"


@pytest.mark.parametrize("graphs_on", [True, False])
def test_events_bracket_the_kernels_alone(fake_pool, monkeypatch, rng, graphs_on):
    step, log = FakeStep(rng=rng), _Log()
    vp = _graph_pass(step, monkeypatch, log, graphs_on=graphs_on)
    _after_prefill(step, 3)
    ev = [types.SimpleNamespace(record=lambda _s, n=n: log.events.append((n,))) for n in ("start", "end")]
    vp.run([1, 2], events=ev)
    kernels = [("replay", 2)] if graphs_on else [("eager", 2)] * 3
    assert [e for e in log.events if e[0] != "capture"] == [("ids", [1, 2]), ("start",), *kernels, ("end",)]
