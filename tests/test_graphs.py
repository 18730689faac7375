"""CUDA-graph decode (graphs.py): the "decode" / "opens_page" graphs replayed against the eager decode step.

CPU part (runs in CI): the choice between the two graphs and the page hand-over, with the device
parts faked. A fake "GPU" holds the device state, block table and the hand-over scalar; the
real DecodeStep.decode_token, Sequence (sequence.py) and GraphDecoder run over it, and fake
launches act on it (qkv_rope records which physical page each position's K/V went to, and fails
if the block table has no entry yet — exactly what the "opens_page" graph must prevent); fake
capture records launches without running them and a fake exec replays them, as the driver does.
Rolling a sequence back and decoding again gives what the first run gave, pages included.

GPU part (@pytest.mark.gpu): graph decode equals eager decode bit for bit — the same tokens
and the same fp32 logits bits at every step — over 600 generated tokens (≥ 37 page
boundaries) with stop tokens ignored, from prompts of 15, 16 and 17 tokens (ending just before,
on and just after a page boundary), fed one eager step per token; pages come from a shuffled
free list, reshuffled between runs. Models: 2 layers at the 7B widths (full vocabulary) and the
full 0.5B shape, both synthetic. Then: the block table on the device matches the host's, every
page is used once and none leaks; two prompts in a row in one engine give what two fresh
engines give; decoding after the GPU prefill (when it exists) hands over cleanly; a rollback
across a page boundary decodes again what the first run decoded, bit for bit; a capture that
fails falls back to eager with a warning.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from drvqwen import graphs
from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.cuda import CudaError
from drvqwen.decode import DecodeStep, default_short_attention
from drvqwen.launch_list import LaunchList, NamedLaunch
from drvqwen.errors import DrvqwenError
from drvqwen.graphs import GRAPH_DECODE, GRAPH_OPENS_PAGE, SHORT, GraphCaptureError, GraphDecoder
from drvqwen.kv_cache import PAGE_TOKENS, PageAllocator
from drvqwen.sequence import Sequence

from helpers import decode_against

# ================================================================================================
# CPU: the choice between the two graphs and the page hand-over, on a fake GPU
# ================================================================================================
# Work queued on a FakeStream runs when the stream is synchronized (or read from), not when it
# is queued, so a test can let the host run ahead of the "GPU" as the real one does.


class FakeGPU:
    """Device memory of the fake: state [pos, token, seq_len], block table, new_page scalar,
    and what the fake kernels recorded."""

    def __init__(self, n_pages: int, vocab: int = 1000):
        self.state = np.zeros(3, np.int32)
        self.block_table = np.full(n_pages, -1, np.int32)
        self.new_page = np.zeros(1, np.int32)
        self.next_token = np.zeros(1, np.int32)
        self.vocab = vocab
        self.kv_page_of: dict[int, int] = {}     # position → physical page its K/V went to
        self.log: list[str] = []                 # every kernel run, in order


class FakeStream:
    """An in-order queue: `capturing` is the list a capture records into (None when not)."""

    def __init__(self):
        self.capturing: list | None = None
        self.queue: list = []
        self.handle = "stream"

    def enqueue(self, work) -> None:
        self.queue.append(work)

    def synchronize(self) -> None:
        while self.queue:
            self.queue.pop(0)()


class FakeDeviceArray:
    """A FakeGPU array behind DeviceArray's copies, ordered as they are: `upload` is a
    synchronous copy (it waits for the stream, as the legacy stream waits for a blocking one);
    `upload_at` with a stream queues the copy there and waits for it."""

    def __init__(self, name: str, array: np.ndarray, stream: FakeStream):
        self.name, self.array, self.stream = name, array, stream

    def upload(self, values) -> None:
        self.stream.synchronize()
        self.array[...] = values

    def upload_at(self, start: int, values, stream=None) -> None:
        values = np.array(values, self.array.dtype).reshape(-1)

        def copy():
            self.array[start:start + values.size] = values
        if stream is None:
            self.stream.synchronize()
            copy()
        else:
            stream.enqueue(copy)
            stream.synchronize()


class FakeLaunch:
    """A KernelLaunch stand-in: `launch(stream)` queues `fn(gpu)` on the stream (default: the
    one it was built for), or records it when the stream is capturing (as the driver does)."""

    def __init__(self, gpu: FakeGPU, name: str, fn, stream: FakeStream):
        self.gpu, self.name, self.fn, self.stream = gpu, name, fn, stream

    def run(self) -> None:
        self.gpu.log.append(self.name)
        self.fn(self.gpu)

    def launch(self, stream=None):
        stream = stream or self.stream
        if stream.capturing is not None:
            stream.capturing.append(self)
        else:
            stream.enqueue(self.run)


class FakeLauncher:
    """One launch of a fake kernel, as a launch list holds it."""

    def __init__(self, launch: FakeLaunch):
        self.launches, self.specs = [launch], [None]
        self.built_for = None

    def build(self, resolve=None, stream=None, pdl=None):
        self.built_for = (stream, pdl)
        return self.launches


def _rope_kv(g: FakeGPU) -> None:
    pos = int(g.state[0])
    page = int(g.block_table[pos // PAGE_TOKENS])
    assert page >= 0, f"K/V write at position {pos}: no block-table entry yet"
    g.kv_page_of[pos] = page


def _argmax(g: FakeGPU) -> None:
    # A deterministic "model": the next token depends on the input token and the position.
    g.next_token[0] = (int(g.state[1]) * 31 + int(g.state[0]) * 7 + 3) % g.vocab


def _advance_state(g: FakeGPU) -> None:
    g.state[1] = g.next_token[0]
    g.state[0] += 1
    g.state[2] += 1


class FakeDecodeStep(DecodeStep):
    """A DecodeStep over a FakeGPU: its own decode_token, launches and sequence code run; only
    the device (arrays, stream, kernels) is fake."""

    def __init__(self, n_pages: int, rng=None, short_below: int = 0, shorter_below: int = 0):  # no GPU allocations
        self.gpu = FakeGPU(n_pages)
        self.stream = FakeStream()
        self.max_context = n_pages * PAGE_TOKENS
        self.buf = {name: FakeDeviceArray(name, getattr(self.gpu, name), self.stream)
                    for name in ("block_table", "state")}
        self.seq = Sequence(PageAllocator(n_pages, rng), self.buf["state"], self.buf["block_table"],
                            self.max_context, self.stream)
        # A short-context twin (short_below > 0) and a twin of the twin (0 < shorter_below <
        # short_below): each band's attention entry logs "L0.attention_" and the band's name.
        # Each attention checks the device's length (state[2]) is one it is chosen for.
        def long_attention(g):
            assert short_below == 0 or g.state[2] > short_below, f"long attention at length {g.state[2]}"

        def short_attention(g):
            assert shorter_below < g.state[2] <= short_below, f"short attention at length {g.state[2]}"

        def shorter_attention(g):
            assert g.state[2] <= shorter_below, f"shorter attention at length {g.state[2]}"

        def band(name, fn, below):
            return (name, {"L0.attention": FakeLauncher(FakeLaunch(self.gpu, f"L0.attention_{name}", fn,
                                                                   self.stream))}, below)
        self.short_bands = ([band("shorter", shorter_attention, shorter_below)] if shorter_below > 0 else []) + (
            [band("short", short_attention, short_below)] if short_below > 0 else [])
        self.short_below = short_below
        self.launch_list = self._with_short("greedy", [
            (n, FakeLauncher(FakeLaunch(self.gpu, n, fn, self.stream))) for n, fn in (
                ("embedding", lambda g: None), ("L0.qkv_rope", _rope_kv), ("L0.attention", long_attention),
                ("argmax", _argmax), ("advance_state", _advance_state))])

    def next_token(self):
        self.sync()
        return int(self.gpu.next_token[0])

    def logits(self):
        return np.array([self.next_token()], np.float32)


class FakeExec:
    def __init__(self, launches):
        self.launches = launches
        self.destroyed = False

    def launch(self, stream):
        assert not self.destroyed
        for ln in self.launches:
            stream.enqueue(ln.run)

    def upload(self, stream):
        pass

    def destroy(self):
        self.destroyed = True


class FakeGraph:
    def __init__(self, launches):
        self.launches = launches

    def num_nodes(self):
        return len(self.launches)

    def instantiate(self):
        return FakeExec(self.launches)

    def destroy(self):
        pass


@pytest.fixture
def fake_device(monkeypatch):
    """Patch graphs.py's device parts: capture, GraphInput and the set_block_table_entry launcher."""
    from contextlib import contextmanager

    made = {"inputs": [], "execs": []}

    @contextmanager
    def fake_capture(stream):
        class Cap:
            graph = None
        cap = Cap()
        stream.capturing = []
        try:
            yield cap
        finally:
            recorded, stream.capturing = stream.capturing, None
        cap.graph = FakeGraph(recorded)

    class FakeGraphInput:

        def __init__(self, n_slots, dtype, name):
            self.slots = np.zeros(n_slots, dtype)
            self.array = FakeDeviceArray(name, np.zeros(1, dtype), None)
            self.gpu = None
            self.closed = False
            made["inputs"].append(self)

        def set(self, slot, value, stream):
            # An async copy: it reads the host slot when the stream reaches it.
            self.slots[slot] = value
            stream.enqueue(lambda: self.gpu.new_page.__setitem__(0, self.slots[slot]))

        def close(self):
            self.closed = True

    class FakeSetBlockTableEntry:
        def __init__(self, block_table, new_page, state, *, n_pages, stream):
            gi = made["inputs"][-1]
            gi.gpu = made["gpu"]

            def kernel(g):
                g.block_table[g.state[0] // PAGE_TOKENS] = g.new_page[0]
            self.launches = [FakeLaunch(made["gpu"], "set_block_table_entry", kernel, stream)]

    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr(graphs, "GraphInput", FakeGraphInput)
    monkeypatch.setattr(graphs, "SetBlockTableEntry", FakeSetBlockTableEntry)
    return made


def _fake_engine(fake_device, n_pages, rng):
    dec = FakeDecodeStep(n_pages, rng)
    fake_device["gpu"] = dec.gpu
    return dec, GraphDecoder(dec)


def _run(decoder, dec, prompt, n_gen):
    """Prompt one eager step per token, then n_gen steps of `decoder`; the generated tokens."""
    dec.seq.start(prompt[0])
    for t in prompt[1:]:
        dec.decode_token()
        dec.seq.feed(t)
    dec.decode_token()
    out = [decoder.next_token()]
    for _ in range(n_gen):
        decoder.decode_token()
        out.append(decoder.next_token())
    return out


@pytest.mark.parametrize("n_prompt", [1, 15, 16, 17, 31, 32, 33])
def test_fake_graph_decode_matches_eager_and_keeps_pages(fake_device, rng, n_prompt):
    n_pages, n_gen = 12, 150
    dec, gd = _fake_engine(fake_device, n_pages, rng)
    assert gd.mode == "graph" and gd.num_nodes == {GRAPH_DECODE: 5, GRAPH_OPENS_PAGE: 6}
    prompt = rng.integers(0, 1000, n_prompt).tolist()
    want = _run(dec, dec, prompt, n_gen)
    want_pages = dict(dec.gpu.kv_page_of)
    dec.gpu.kv_page_of.clear()
    dec.gpu.block_table[:] = -1                    # what the eager run wrote must not help

    got = _run(gd, dec, prompt, n_gen)
    assert got == want
    n_tokens = n_prompt + n_gen
    n_used = -(-n_tokens // PAGE_TOKENS)
    pages = dec.seq.pages
    # "opens_page" ran exactly at the generated positions that open a page.
    assert gd.steps_by_graph[GRAPH_OPENS_PAGE] == sum(1 for p in range(n_prompt, n_tokens) if p % PAGE_TOKENS == 0)
    assert gd.steps_by_graph[GRAPH_DECODE] == n_gen - gd.steps_by_graph[GRAPH_OPENS_PAGE]
    # Device block table = host block table; every page once; none leaked.
    assert dec.gpu.block_table[:n_used].tolist() == pages.block_table
    assert len(set(pages.block_table)) == n_used
    assert sorted(pages.block_table + pages.free) == list(range(n_pages))
    # Each position's K/V went to the page the block table names (same pages as eager: the
    # freed pages return to the front of the free list in the same order).
    assert {p: pages.block_table[p // PAGE_TOKENS] for p in range(n_tokens)} == dec.gpu.kv_page_of
    assert dec.gpu.kv_page_of == want_pages


@pytest.mark.parametrize("short_below", [1, 16, 17, 40])
def test_fake_short_context_twin_runs_up_to_its_length_eager_and_graph(fake_device, rng, short_below):
    """A step with a short-context twin (LaunchList.short): the steps whose attention covers at most
    short_below positions run the twin — eagerly and from its own pair of graphs — the others the
    step's own list (each fake attention asserts the device's length); the same tokens both ways."""
    n_pages, n_prompt, n_gen = 8, 5, 60
    dec = FakeDecodeStep(n_pages, rng, short_below=short_below)
    fake_device["gpu"] = dec.gpu
    gd = GraphDecoder(dec)
    assert gd.num_nodes == {GRAPH_DECODE: 5, GRAPH_OPENS_PAGE: 6, GRAPH_DECODE + SHORT: 5,
                            GRAPH_OPENS_PAGE + SHORT: 6}
    prompt = rng.integers(0, 1000, n_prompt).tolist()
    want = _run(dec, dec, prompt, n_gen)
    n_steps = n_prompt + n_gen
    short_steps = sum(1 for pos in range(n_steps) if pos + 1 <= short_below)
    assert dec.gpu.log.count("L0.attention_short") == short_steps
    assert dec.gpu.log.count("L0.attention") == n_steps - short_steps
    dec.gpu.log.clear()
    got = _run(gd, dec, prompt, n_gen)             # the prompt eagerly, then graphs
    assert got == want
    graph_short = sum(1 for pos in range(n_prompt, n_steps) if pos + 1 <= short_below)
    assert gd.steps_by_graph[GRAPH_DECODE + SHORT] + gd.steps_by_graph[GRAPH_OPENS_PAGE + SHORT] == graph_short
    assert gd.steps_by_graph[GRAPH_DECODE] + gd.steps_by_graph[GRAPH_OPENS_PAGE] == n_gen - graph_short
    assert dec.gpu.log.count("L0.attention_short") == short_steps
    gd.close()


@pytest.mark.parametrize("shorter_below,short_below", [(1, 16), (16, 17), (17, 40)])
def test_fake_twin_of_a_twin_runs_its_band_eager_and_graph(fake_device, rng, shorter_below, short_below):
    """A step with two short-context bands (LaunchList.chain: the twin's own twin for the
    shortest lengths): each step runs the list of its band — eagerly and from that band's pair of
    graphs ("_short", "_short_short") — and each fake attention asserts the device's length is in
    its band; the same tokens both ways."""
    n_pages, n_prompt, n_gen = 8, 5, 60
    dec = FakeDecodeStep(n_pages, rng, short_below=short_below, shorter_below=shorter_below)
    assert [lst.name for lst in dec.launch_list.chain()] == ["greedy", "greedy+short", "greedy+shorter"]
    fake_device["gpu"] = dec.gpu
    gd = GraphDecoder(dec)
    assert gd.num_nodes == {GRAPH_DECODE: 5, GRAPH_OPENS_PAGE: 6, GRAPH_DECODE + SHORT: 5,
                            GRAPH_OPENS_PAGE + SHORT: 6, GRAPH_DECODE + SHORT * 2: 5, GRAPH_OPENS_PAGE + SHORT * 2: 6}
    prompt = rng.integers(0, 1000, n_prompt).tolist()
    want = _run(dec, dec, prompt, n_gen)
    n_steps = n_prompt + n_gen
    shorter = sum(1 for pos in range(n_steps) if pos + 1 <= shorter_below)
    short = sum(1 for pos in range(n_steps) if shorter_below < pos + 1 <= short_below)
    assert [dec.gpu.log.count(f"L0.attention{s}") for s in ("_shorter", "_short", "")] == [
        shorter, short, n_steps - short - shorter]
    dec.gpu.log.clear()
    got = _run(gd, dec, prompt, n_gen)             # the prompt eagerly, then graphs
    assert got == want
    by_band = [sum(1 for pos in range(n_prompt, n_steps) if lo < pos + 1 <= hi)
               for lo, hi in ((short_below, n_steps), (shorter_below, short_below), (0, shorter_below))]
    assert [gd.steps_by_graph[GRAPH_DECODE + SHORT * d] + gd.steps_by_graph[GRAPH_OPENS_PAGE + SHORT * d]
            for d in range(3)] == by_band
    gd.close()


def test_fake_graph_replays_captured_work_and_closes(fake_device, rng):
    dec, gd = _fake_engine(fake_device, 4, rng)
    gd.sync()
    assert dec.gpu.log == []                       # capture records, it does not run
    gd.seq.start(5)
    assert gd.decode_token() == GRAPH_OPENS_PAGE and gd.decode_token() == GRAPH_DECODE
    gd.sync()
    assert dec.gpu.log == ["set_block_table_entry", "embedding", "L0.qkv_rope", "L0.attention", "argmax",
                           "advance_state"] + ["embedding", "L0.qkv_rope", "L0.attention", "argmax", "advance_state"]
    assert gd.seq is dec.seq and dec.seq.pos == 2 and int(dec.gpu.state[0]) == 2
    gd.close()
    gd.close()                                     # idempotent
    assert fake_device["inputs"][-1].closed
    with pytest.raises(RuntimeError, match="after close"):
        gd.decode_token()


def test_fake_graphs_of_another_launch_list(fake_device, rng):
    """A GraphDecoder captures the launch list it is given (a sampler variant), not the plan's,
    and its eager fallback runs that list too."""
    dec = FakeDecodeStep(4, rng)
    fake_device["gpu"] = dec.gpu
    extra = FakeLauncher(FakeLaunch(dec.gpu, "publish_token", lambda g: None, dec.stream))
    variant = LaunchList("sample", [*dec.launchers[:-1], ("publish_token", extra), dec.launchers[-1]])
    gd = GraphDecoder(dec, variant)
    assert gd.num_nodes == {GRAPH_DECODE: 6, GRAPH_OPENS_PAGE: 7} and len(dec.launches) == 5
    gd.seq.start(1)
    gd.decode_token()
    dec.decode_token(variant)
    gd.sync()
    assert dec.gpu.log.count("publish_token") == 2


def test_sampler_variants_are_lists_of_their_own(rng):
    """A sampler variant is a new list (the chooser in the argmax's place, publish_token before
    advance_state), built on the step's stream; the plan's list stays as it was, so a graph
    captured from it, or from another variant, never changes under it."""
    dec = FakeDecodeStep(4, rng)
    dec.pdl = True
    plan = list(dec.launch_list.launchers)
    fake = {n: FakeLauncher(FakeLaunch(dec.gpu, n, lambda g: None, dec.stream)) for n in ("lm_head", "sample", "publish")}
    dec.launch_list = LaunchList("greedy", [*plan[:3], ("lm_head", fake["lm_head"]), *plan[3:]])
    plan = list(dec.launch_list.launchers)
    names = [n for n, _l in plan]
    sampled = dec.sampler_variant("sample", ("sample", fake["sample"]), fake["publish"])
    greedy = dec.sampler_variant("greedy", None, fake["publish"])
    assert [n for n, _l in sampled.launchers] == [*names[:4], "sample", "publish_token", "advance_state"]
    assert [n for n, _l in greedy.launchers] == [*names[:5], "publish_token", "advance_state"]
    assert [nl.name for nl in sampled.launches] == [n for n, _l in sampled.launchers]
    assert dec.launch_list.launchers == plan and [n for n, _l in dec.launchers] == names
    assert sampled.sampler_step() == [fake["lm_head"], fake["sample"], fake["publish"]]
    assert dec.launch_list.sampler_step() == [fake["lm_head"], plan[4][1]]
    assert fake["sample"].built_for == (dec.stream, True) == fake["publish"].built_for
    # The shared entries are the plan's own launchers (built once), not copies.
    assert all(a is b for (_n, a), (_m, b) in zip(sampled.launchers[:4], plan[:4]))


def test_fake_host_runs_ahead(fake_device, rng):
    """All steps queued before the "GPU" runs any: each "opens_page" graph must still find its own page
    (one pinned slot per logical page)."""
    dec, gd = _fake_engine(fake_device, 12, rng)
    want = _run(dec, dec, [4, 5, 6], 150)
    want_pages = dict(dec.gpu.kv_page_of)
    dec.gpu.kv_page_of.clear()
    gd.seq.start(4)
    for t in (5, 6):
        dec.decode_token()
        dec.seq.feed(t)
    for _ in range(151):
        gd.decode_token()
    assert len(dec.stream.queue) > 150 * len(dec.launches)   # nothing has run yet
    assert gd.next_token() == want[-1]
    assert dec.gpu.kv_page_of == want_pages
    assert dec.gpu.block_table[:len(dec.seq.pages.block_table)].tolist() == dec.seq.pages.block_table


def test_fake_two_sequences_reuse_the_graphs(fake_device, rng):
    dec, gd = _fake_engine(fake_device, 10, rng)
    a = _run(gd, dec, [1, 2, 3], 40)
    b = _run(gd, dec, [7] * 20, 50)
    dec2, gd2 = _fake_engine(fake_device, 10, np.random.default_rng(1))
    assert _run(gd2, dec2, [1, 2, 3], 40) == a
    dec3, gd3 = _fake_engine(fake_device, 10, np.random.default_rng(2))
    assert _run(gd3, dec3, [7] * 20, 50) == b
    assert sorted(dec.seq.pages.block_table + dec.seq.pages.free) == list(range(10))


def _model_tokens(prompt: list[int], n: int) -> list[int]:
    """The tokens the fake model consumes at positions 0 … n-1 from `prompt` (_argmax's rule)."""
    toks = list(prompt)
    while len(toks) < n:
        toks.append((toks[-1] * 31 + (len(toks) - 1) * 7 + 3) % 1000)
    return toks


@pytest.mark.parametrize("again", ["graph", "eager"])
@pytest.mark.parametrize("back_to", [0, 5, 16, 17, 31, 32, 40, 48])
def test_fake_rollback_decodes_again_what_it_decoded(fake_device, rng, back_to, again):
    """Graph steps queued ahead (the host does not wait), a rollback to `back_to`, and graph or
    eager steps again: the pages opened after it are back at the front of the free list, the
    device state reads (back_to, token, back_to + 1), and the second run decodes the first run's
    tokens into the first run's pages — recording each reopened page in the block table again
    (the "opens_page" graph, or the eager step's copy) at the boundaries it crosses again."""
    dec, gd = _fake_engine(fake_device, 6, rng)
    prompt, end = [9, 8, 7], 48                    # positions 0 … 47: three pages
    consumed = _model_tokens(prompt, end + 1)      # consumed[p]: the token decoded at position p
    dec.seq.start(prompt[0])
    for t in prompt[1:]:
        dec.decode_token()
        dec.seq.feed(t)
    for _ in range(len(prompt) - 1, end):
        gd.decode_token()                          # queued, not run
    assert dec.stream.queue
    pages_before = list(dec.seq.pages.block_table)
    opens_before = gd.steps_by_graph[GRAPH_OPENS_PAGE]

    released = gd.seq.rollback(back_to, consumed[back_to])
    assert not dec.stream.queue                    # it waited for the queued steps
    kv_before = dict(dec.gpu.kv_page_of)
    assert sorted(kv_before) == list(range(end)) and int(dec.gpu.next_token[0]) == consumed[end]
    kept = -(-back_to // PAGE_TOKENS)
    assert released == pages_before[kept:]
    assert dec.seq.pages.block_table == pages_before[:kept]
    assert dec.seq.pages.free[:len(released)] == released
    assert sorted(dec.seq.pages.block_table + dec.seq.pages.free) == list(range(6))
    assert dec.seq.pos == back_to
    assert dec.gpu.state.tolist() == [back_to, consumed[back_to], back_to + 1]
    assert dec.gpu.block_table[:kept].tolist() == pages_before[:kept]    # the kept entries are untouched

    dec.gpu.kv_page_of.clear()
    dec.gpu.block_table[kept:] = -1                # a page not recorded again would fail the K/V write
    for pos in range(back_to, end):
        (gd if again == "graph" else dec).decode_token()
        if pos + 1 < len(prompt):
            dec.seq.feed(prompt[pos + 1])          # a rollback into the prompt feeds it again
    dec.sync()
    assert dec.seq.pos == end and dec.seq.pages.block_table == pages_before
    assert dec.gpu.block_table[:len(pages_before)].tolist() == pages_before
    assert dec.gpu.kv_page_of == {p: kv_before[p] for p in range(back_to, end)}
    assert int(dec.gpu.next_token[0]) == consumed[end]
    assert gd.steps_by_graph[GRAPH_OPENS_PAGE] - opens_before == (len(released) if again == "graph" else 0)
    with pytest.raises(DrvqwenError, match="rollback to position"):
        gd.seq.rollback(end + 1, 1)


def test_fake_context_full(fake_device, rng):
    dec, gd = _fake_engine(fake_device, 2, rng)
    gd.seq.start(1)
    for _ in range(2 * PAGE_TOKENS):
        gd.decode_token()
    with pytest.raises(DrvqwenError, match="context full"):
        gd.decode_token()


def test_fake_capture_failure_falls_back_to_eager(fake_device, monkeypatch, rng):
    dec = FakeDecodeStep(6, rng)
    fake_device["gpu"] = dec.gpu

    def refuse(stream=None):
        if stream is not None and stream.capturing is not None:
            raise CudaError("cuLaunchKernel(bad)", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "not permitted")
    monkeypatch.setattr(dec.launches[2].launch, "launch", refuse)
    with pytest.raises(GraphCaptureError, match="graph 'decode' of the decode step failed while recording 'L0.attention'"):
        GraphDecoder(dec, fallback=False)
    assert fake_device["inputs"][-1].closed
    with pytest.warns(RuntimeWarning, match="decoding eagerly"):
        gd = GraphDecoder(dec)
    assert gd.mode == "eager" and "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" in gd.fallback_reason
    gd.seq.start(3)
    assert [gd.decode_token() for _ in range(18)] == [GRAPH_OPENS_PAGE] + [GRAPH_DECODE] * 15 + [GRAPH_OPENS_PAGE,
                                                                                                   GRAPH_DECODE]
    assert dec.gpu.block_table[:2].tolist() == dec.seq.pages.block_table
    gd.close()


# ================================================================================================
# GPU: graph decode equals eager decode, bit for bit
# ================================================================================================

N_GEN = 600                       # generated tokens per run: 37-38 page boundaries
PROMPT_LENGTHS = (15, 16, 17)     # just before, on and just after a page boundary
MAX_CONTEXT = 640                 # 40 pages: 17 + 600 tokens need 39
SHORT_BELOW = 300                 # the engine's short-context twin up to here: every run crosses it
SHAPES = {"7b-2layers": QWEN25_CODER_7B.with_layers(2), "0.5b": QWEN25_CODER_05B,
          "real-0.5b": None,     # the real Qwen2.5-Coder-0.5B-Instruct (conftest.real_nanoqwen)
          "real-0.5b-source": None,   # the same in its GGUF's formats (conftest.real_nanoqwen_source)
          "7b-2layers-q4_k_m": QWEN25_CODER_7B.with_layers(2)}   # llama.cpp's Q4_K_M recipe, synthetic


def _module_seed() -> int:
    return int(os.environ.get("DRVQWEN_SEED", secrets.randbelow(2**31)))


@pytest.fixture(scope="module", params=list(SHAPES))
def gpu_model(request, tmp_path_factory):
    """(name, NanoqwenFile, num_layers) of a synthetic model.

    The 7B widths: the benchmark's synthetic 28-layer 7B is used with its first 2 layers when
    it is already in /dev/shm (bench.default_synthetic_path), saving the ~15 s of writing 2.4 GB.
    """
    from drvqwen.bench import default_synthetic_path
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.synthetic import write_synthetic

    from helpers import minimal_tokenizer_json

    from drvqwen.format.recipes import recipe_formats

    cfg = SHAPES[request.param]
    if cfg is None:
        real = "real_nanoqwen_source" if request.param.endswith("source") else "real_nanoqwen"
        yield request.param, request.getfixturevalue(real), None
        return
    recipe = "q4_k_m" if request.param.endswith("q4_k_m") else None
    if request.param.startswith("7b") and recipe is None and default_synthetic_path("7b").exists():
        f = NanoqwenFile(default_synthetic_path("7b"))
        if f.config.with_layers(cfg.num_layers) == cfg:
            yield request.param, f, cfg.num_layers
            f.close()
            return
        f.close()
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else tmp_path_factory.mktemp("syn")
    path = base / f"drvqwen_test_graphs_{os.getpid()}_{request.param}.nanoqwen"
    write_synthetic(path, cfg, seed=1234, tokenizer_json=minimal_tokenizer_json(),
                    formats=recipe_formats(cfg, recipe) if recipe else None)
    f = NanoqwenFile(path)
    try:
        yield request.param, f, None
    finally:
        f.close()
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def engine(gpu_model):
    """(name, DecodeStep, GraphDecoder, rng) shared by the module's GPU tests: the graphs are
    captured once and serve every prompt, as in the engine. The step runs its short-context
    attention (the cluster kernel, the default at short contexts: decode.default_short_attention)
    up to SHORT_BELOW positions and the default attention beyond, so that the runs below cross
    from one pair of graphs to the other inside the 640 positions they cover."""
    from drvqwen.decode import DecodeStep

    name, f, layers = gpu_model
    seed = _module_seed()
    print(f"\n[{name}] engine seed={seed}")
    rng = np.random.default_rng(seed)
    dec = DecodeStep(f, max_context=MAX_CONTEXT, num_layers=layers, rng=rng, short_attention="cluster",
                     short_below=SHORT_BELOW)
    gd = GraphDecoder(dec, fallback=False)
    yield name, dec, gd, rng
    gd.close()
    dec.close()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def _opened(gd) -> int:
    """Steps replayed so far through a page-opening graph, the short-context twin's included."""
    return gd.steps_by_graph[GRAPH_OPENS_PAGE] + gd.steps_by_graph.get(GRAPH_OPENS_PAGE + SHORT, 0)


def _prompt_eager(dec, prompt, start, shuffle: np.random.Generator | None = None) -> None:
    """Start with `start` (Sequence.start), optionally reshuffle the free list, then feed
    `prompt` one eager decode step per token (no prefill yet); after it, next_token holds the
    first generated token and the state is ready to decode it."""
    start(prompt[0])
    if shuffle is not None:
        shuffle.shuffle(dec.seq.pages.free)            # other physical pages than the last run's
    for t in prompt[1:]:
        dec.decode_token()
        dec.seq.feed(t)
    dec.decode_token()


def _check_pages(dec, n_tokens: int) -> None:
    n_used = -(-n_tokens // PAGE_TOKENS)
    host = dec.seq.pages.block_table
    assert len(host) == n_used and len(set(host)) == n_used, host
    assert sorted(host + dec.seq.pages.free) == list(range(dec.seq.pages.n_pages)), "a page leaked or was duplicated"
    device = dec.buf["block_table"].download()[:n_used].tolist()
    assert device == host, f"device block table {device} != host {host}"


@pytest.mark.gpu
def test_graph_decode_bit_exact_vs_eager(engine):
    name, dec, gd, rng = engine
    assert gd.mode == "graph"
    n_short = len(dec.launch_list.short.launches)
    assert n_short == len(dec.launches) - dec.config.num_layers  # one attention launch a layer instead of two
    assert gd.num_nodes == {GRAPH_DECODE: len(dec.launches), GRAPH_OPENS_PAGE: len(dec.launches) + 1,
                            GRAPH_DECODE + SHORT: n_short, GRAPH_OPENS_PAGE + SHORT: n_short + 1}
    for n_prompt in PROMPT_LENGTHS:
        prompt = rng.integers(0, dec.config.vocab_size, n_prompt).tolist()
        n_tokens = n_prompt + N_GEN
        # Eager reference: every step's logits kept (600 × V fp32: 365 MB at 7B).
        _prompt_eager(dec, prompt, dec.seq.start)
        want_tokens, want_logits = [dec.next_token()], []
        for _ in range(N_GEN):
            dec.decode_token()
            want_logits.append(dec.logits())
            want_tokens.append(dec.next_token())
        _check_pages(dec, n_tokens)
        eager_pages = list(dec.seq.pages.block_table)

        # Graph run, other physical pages: the prompt through eager steps, then both graphs.
        _prompt_eager(dec, prompt, dec.seq.start, shuffle=rng)
        b0, s0 = _opened(gd), gd.steps_by_graph[GRAPH_DECODE + SHORT]
        tokens, mismatched = decode_against(gd, want_logits)
        n_b = _opened(gd) - b0
        # Both pairs of graphs ran: the steps up to SHORT_BELOW positions (the step's own
        # included) on the twin, the rest on the default attention.
        assert 0 < gd.steps_by_graph[GRAPH_DECODE + SHORT] - s0 < N_GEN
        print(f"{name}: prompt {n_prompt}, {N_GEN} graph steps ({n_b} opening a page), pages eager "
              f"{eager_pages[:4]}… graph {dec.seq.pages.block_table[:4]}…")
        assert not mismatched, (f"{name}, prompt {n_prompt}: logits differ from eager at {len(mismatched)} "
                                f"steps, first at generated step {mismatched[0]} (position {n_prompt + mismatched[0]})")
        assert tokens == want_tokens
        assert n_b == sum(1 for p in range(n_prompt, n_tokens) if p % PAGE_TOKENS == 0) >= 37
        _check_pages(dec, n_tokens)

        if n_prompt == PROMPT_LENGTHS[-1]:
            # The host queues all 600 steps without waiting (each opened page's id sits in
            # its own pinned slot until the copy engine reads it): same final bits.
            _prompt_eager(dec, prompt, dec.seq.start, shuffle=rng)
            for _ in range(N_GEN):
                gd.decode_token()
            assert np.array_equal(_bits(gd.logits()), _bits(want_logits[-1]))
            assert gd.next_token() == want_tokens[-1]
            _check_pages(dec, n_tokens)
        del want_logits


def _graph_run(gd, prompt, n_gen):
    """Prompt fed through graph steps (feed + either graph), then n_gen graph steps; tokens, last logits."""
    gd.seq.start(prompt[0])
    for t in prompt[1:]:
        gd.decode_token()
        gd.seq.feed(t)
    gd.decode_token()
    tokens = [gd.next_token()]
    for _ in range(n_gen):
        gd.decode_token()
        tokens.append(gd.next_token())
    return tokens, gd.logits()


@pytest.mark.gpu
def test_two_prompts_in_one_engine_equal_fresh_engines(engine, gpu_model):
    from drvqwen.decode import DecodeStep

    name, dec, gd, rng = engine
    _, f, layers = gpu_model
    prompts = [rng.integers(0, dec.config.vocab_size, n).tolist() for n in (20, 37)]
    reused = [_graph_run(gd, p, 48) for p in prompts]
    for i, p in enumerate(prompts):
        fresh_dec = DecodeStep(f, max_context=MAX_CONTEXT, num_layers=layers, rng=np.random.default_rng(i))
        try:
            with GraphDecoder(fresh_dec, fallback=False) as fresh:
                tokens, logits = _graph_run(fresh, p, 48)
        finally:
            fresh_dec.close()
        assert tokens == reused[i][0], f"{name}: prompt {i} differs between a reused and a fresh engine"
        assert np.array_equal(_bits(logits), _bits(reused[i][1]))


@pytest.mark.gpu
def test_graph_decode_after_gpu_prefill(engine):
    """The hand-off from the GPU prefill (drvqwen.prefill): it reserves the prompt's pages (host
    free list and device block table) and leaves the state at position T. Decoding from there,
    graphs equal eager bit for bit, with the "opens_page" graph at the first page boundary after the prompt
    (at once for T = 32)."""
    prefill_mod = pytest.importorskip("drvqwen.prefill")
    name, dec, gd, rng = engine
    n_gen = 100
    pf = prefill_mod.Prefill(dec)
    try:
        for n_prompt in (32, 37):
            prompt = rng.integers(0, dec.config.vocab_size, n_prompt).tolist()
            runs = []
            for decoder in (dec, gd):
                decoder.sync()                     # a new sequence starts from a drained stream
                pf.run(prompt)
                rng.shuffle(dec.seq.pages.free)        # other pages for the generated tokens
                b0 = _opened(gd)
                tokens, logits = [decoder.next_token()], []
                for _ in range(n_gen):
                    decoder.decode_token()
                    logits.append(decoder.logits())
                    tokens.append(decoder.next_token())
                _check_pages(dec, n_prompt + n_gen)
                runs.append((tokens, logits, _opened(gd) - b0))
            (want, want_logits, _), (got, got_logits, n_b) = runs
            assert n_b == sum(1 for p in range(n_prompt, n_prompt + n_gen) if p % PAGE_TOKENS == 0)
            bad = [i for i, (a, b) in enumerate(zip(got_logits, want_logits)) if not np.array_equal(_bits(a), _bits(b))]
            assert not bad, f"{name}, prefill of {n_prompt}: logits differ from eager from generated step {bad[0]}"
            assert got == want
    finally:
        pf.close()


@pytest.mark.gpu
def test_rollback_decodes_again_bit_for_bit(engine):
    """Graph decode from a 10-token prompt to position 70, then a rollback to a page boundary
    (48) and one inside a page (23), each decoding again to 70: the pages after the rollback
    point come back and are reopened through the "opens_page" graph, and every position's
    logits have the first run's bits (what speculative decoding's rejected tokens rely on)."""
    name, dec, gd, rng = engine
    prompt, end = rng.integers(0, dec.config.vocab_size, 10).tolist(), 70
    _prompt_eager(dec, prompt, dec.seq.start, shuffle=rng)
    consumed, want = {len(prompt): gd.next_token()}, {}
    for pos in range(len(prompt), end):
        gd.decode_token()
        want[pos] = gd.logits()
        consumed[pos + 1] = gd.next_token()
    pages = list(dec.seq.pages.block_table)
    for back_to in (48, 23):
        opens = _opened(gd)
        released = dec.seq.rollback(back_to, consumed[back_to])
        assert released == pages[-(-back_to // PAGE_TOKENS):]
        assert dec.buf["state"].download().tolist() == [back_to, consumed[back_to], back_to + 1]
        bad = []
        for pos in range(back_to, end):
            gd.decode_token()
            if not np.array_equal(_bits(gd.logits()), _bits(want[pos])):
                bad.append(pos)
        assert not bad, f"{name}: after a rollback to {back_to}, logits differ from position {bad[0]}"
        assert gd.next_token() == consumed[end]
        assert _opened(gd) - opens == len(released)
        assert dec.seq.pages.block_table == pages
        _check_pages(dec, end)


@pytest.mark.gpu
def test_default_bands_cross_their_boundaries_graph_equal_to_eager(gpu_model):
    """The default step's short-context bands (decode.default_short_attention: the cluster
    attention in clusters of 8, then of 16, then the default attention): a prompt prefilled to
    just before each band's end, then decoded across it eagerly and through the graphs — the same
    logits bit for bit, and each step replayed from its band's pair of graphs."""
    from collections import Counter

    prefill_mod = pytest.importorskip("drvqwen.prefill")
    name, f, layers = gpu_model
    rng = np.random.default_rng(_module_seed())
    longest = max(below for _k, below in default_short_attention(f.config, "tma", False))
    dec = DecodeStep(f, max_context=longest + 64, num_layers=layers, rng=rng)
    gd = GraphDecoder(dec, fallback=False)
    pf = prefill_mod.Prefill(dec)
    try:
        # An H100 or H200 runs every KV head's cluster at once in both sizes: both bands kept.
        assert [(k, below) for k, _e, below in dec.short_bands] == list(default_short_attention(f.config, "tma", False))
        chain, n_gen = dec.launch_list.chain(), 48
        for _kernel, _entries, below in dec.short_bands:
            n_prompt = below - n_gen // 2
            prompt = rng.integers(0, dec.config.vocab_size, n_prompt).tolist()
            runs = []
            for decoder in (dec, gd):
                decoder.sync()
                pf.run(prompt)
                before = dict(gd.steps_by_graph)
                logits = []
                for _ in range(n_gen):
                    decoder.decode_token()
                    logits.append(decoder.logits())
                runs.append((logits, Counter({k: gd.steps_by_graph[k] - before[k] for k in before})))
            (want, _), (got, counts) = runs
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if not np.array_equal(_bits(a), _bits(b))]
            assert not bad, f"{name}: across {below}, graph logits differ from eager from step {bad[0]}"
            bands = Counter((GRAPH_OPENS_PAGE if pos % PAGE_TOKENS == 0 else GRAPH_DECODE)
                            + SHORT * chain.index(dec.launch_list.for_length(pos + 1))
                            for pos in range(n_prompt, n_prompt + n_gen))
            assert +counts == bands and len({k.count(SHORT) for k in bands}) == 2
    finally:
        pf.close()
        gd.close()
        dec.close()


@pytest.mark.gpu
def test_capture_failure_falls_back_to_eager(engine):
    """A synchronous copy inside the captured list invalidates the capture (GLOBAL mode): the
    decoder warns, runs eagerly, and the stream and context stay usable."""
    name, dec, gd, rng = engine

    class SyncCopy:  # a "launch" that makes a capture-unsafe call
        def launch(self, stream=None):
            dec.buf["next_token"].upload(np.zeros(1, np.int32))

    dec.launches.insert(3, NamedLaunch("sync_copy", SyncCopy(), None))
    try:
        with pytest.raises(GraphCaptureError, match="graph 'decode' of the decode step failed"):
            GraphDecoder(dec, fallback=False)
        with pytest.warns(RuntimeWarning, match="decoding eagerly"):
            fallback = GraphDecoder(dec)
    finally:
        del dec.launches[3]
    assert fallback.mode == "eager"
    prompt = rng.integers(0, dec.config.vocab_size, 5).tolist()
    got, got_logits = _graph_run(fallback, prompt, 20)
    fallback.close()
    want, want_logits = _graph_run(gd, prompt, 20)
    assert got == want and np.array_equal(_bits(got_logits), _bits(want_logits))


@pytest.mark.gpu
def test_set_block_table_entry_in_a_graph(rng):
    """The kernel and the GraphInput hand-over alone, small (also run under the sanitizers).

    One graph — set_block_table_entry, then 16 × advance_state (one page of positions) — is
    replayed once per page with a new page id each time, all queued behind a 20 ms gpu_sleep:
    the host has queued every copy before the GPU runs the first, so each copy must still find
    its own page id in its own pinned slot.
    """
    import ctypes

    from drvqwen.cuda import KernelLaunch, Pool, Stream, capture, load_kernel_module
    from drvqwen.cuda.graph import GraphInput
    from drvqwen.launchers import AdvanceState, SetBlockTableEntry

    n_pages = 9
    with Pool(4096, name="t") as pool, Stream() as stream:
        table = pool.alloc("block_table", (n_pages,), np.int32)
        table.upload(np.full(n_pages, -1, np.int32))
        state = pool.alloc("state", (3,), np.int32)
        state.upload(np.array([0, 0, 1], np.int32))
        token = pool.alloc("next_token", (1,), np.int32)
        token.upload(np.array([42], np.int32))
        gi = GraphInput(n_pages, np.int32, name="new_page")
        try:
            steps = [SetBlockTableEntry(table, gi.array, state, n_pages=n_pages, stream=stream)]
            steps += [AdvanceState(state, token, stream=stream) for _ in range(PAGE_TOKENS)]
            hold = KernelLaunch(load_kernel_module("timing").function("gpu_sleep"), (1,), (1,),
                                [ctypes.c_uint64(20_000_000)], stream=stream)
            with capture(stream) as cap:
                for s in steps:
                    s.launch(stream)
            assert cap.graph.num_nodes() == 1 + PAGE_TOKENS
            exe = cap.graph.instantiate()
            cap.graph.destroy()
            pages = rng.permutation(100)[:n_pages].astype(np.int32)
            hold.launch(stream)
            for logical in range(n_pages):
                gi.set(logical, pages[logical], stream)
                exe.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(table.download(), pages)
            np.testing.assert_array_equal(state.download(), [n_pages * PAGE_TOKENS, 42, n_pages * PAGE_TOKENS + 1])
            exe.destroy()
        finally:
            stream.synchronize()
            gi.close()
