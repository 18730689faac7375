"""The sequence's one owner (sequence.py): pages opened in order, reserved at once, and rolled back.

On numpy "device" buffers (the CPU step machine's `HostArray`): which decode step opens a page
(exactly at page boundaries, never for a page an earlier step or a prefill already took), a
pool that runs out, and rollback — the pages that hold no position below the rollback point go
back to the front of the free list, the block table and the position shrink, the device state
reads (pos, token, pos + 1), the kept block-table entries stay, and growing again takes the same
pages. Then the CPU step machine (`drvqwen step --device cpu`'s numpy references) rolled back
and run again computes the same logits bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.kv_cache import PAGE_TOKENS, PageAllocator
from drvqwen.sequence import Sequence
from drvqwen.step.machine_cpu import CpuMachine, HostArray

from helpers import TINY, byte_tokenizer_json, random_dense, write_model


def _sequence(n_pages: int, rng=None, max_context: int | None = None) -> tuple[Sequence, np.ndarray, np.ndarray]:
    state, table = np.zeros(3, np.int32), np.full(n_pages, -1, np.int32)
    seq = Sequence(PageAllocator(n_pages, rng), HostArray(state), HostArray(table),
                   max_context or n_pages * PAGE_TOKENS)
    return seq, state, table


def _step(seq: Sequence) -> int | None:
    """One decode step's host side, as the eager step does it: the page it opens recorded."""
    page = seq.open_page()
    if page is not None:
        seq.write_block_table_entry(page)
    seq.advance()
    return page


def test_a_page_opens_exactly_at_page_boundaries(rng):
    n_pages = 12
    seq, state, table = _sequence(n_pages, rng)
    order = list(seq.pages.free)                   # the shuffled free list, popped front first
    seq.start(7)
    assert state.tolist() == [0, 7, 1]
    opened = [_step(seq) for _ in range(n_pages * PAGE_TOKENS)]
    for pos, page in enumerate(opened):
        assert (page is not None) == (pos % PAGE_TOKENS == 0), pos
    assert [p for p in opened if p is not None] == order
    assert seq.pages.block_table == order == table.tolist() and seq.pages.free == []
    with pytest.raises(DrvqwenError, match="context full"):
        seq.open_page()


def test_no_page_opens_where_a_prefill_reserved_one(rng):
    seq, _state, table = _sequence(8, rng)
    seq.reserve(20)                                # a prompt of 20 tokens: pages 0 and 1 at once
    assert table[:2].tolist() == seq.pages.block_table and len(seq.pages.block_table) == 2
    seq.resume(20)
    assert [_step(seq) is not None for _ in range(13)] == [False] * 12 + [True]   # 20 … 31, then 32
    # Restarting inside an allocated range (a rewind to position 16) opens nothing.
    seq.start(5, 16)
    assert seq.open_page() is None
    # A new sequence: all pages back, the first step opens a page again.
    seq.start(5)
    assert sorted(seq.pages.free) == list(range(8)) and seq.open_page() is not None
    with pytest.raises(DrvqwenError, match="exceed the KV cache"):
        seq.reserve(8 * PAGE_TOKENS + 1)


def test_the_pool_runs_out():
    seq, _state, _table = _sequence(2, max_context=1024)
    seq.start(1)
    for _ in range(2 * PAGE_TOKENS):
        _step(seq)
    with pytest.raises(DrvqwenError, match="KV cache full"):
        seq.open_page()


@pytest.mark.parametrize("back_to", [0, 1, 15, 16, 17, 47, 48, 50])
def test_rollback_returns_the_pages_after_it(rng, back_to):
    seq, state, table = _sequence(6, rng)
    seq.start(3)
    for _ in range(50):                            # positions 0 … 49: four pages
        _step(seq)
    pages = list(seq.pages.block_table)
    free = list(seq.pages.free)
    device_table = table.copy()

    released = seq.rollback(back_to, 42)
    kept = -(-back_to // PAGE_TOKENS)              # pages holding a position below back_to
    assert released == pages[kept:]
    assert seq.pages.block_table == pages[:kept]
    assert seq.pages.free == released + free       # in front, in logical order
    assert seq.pos == back_to and state.tolist() == [back_to, 42, back_to + 1]
    assert np.array_equal(table, device_table)     # no entry rewritten: none past seq_len is read
    # Growing again takes the same pages in the same order and records them again.
    table[kept:] = -1
    for _ in range(back_to, 50):
        _step(seq)
    assert seq.pages.block_table == pages and table[:len(pages)].tolist() == pages


def test_rollback_refuses_positions_it_does_not_hold(rng):
    seq, _state, _table = _sequence(4, rng)
    seq.start(3)
    for _ in range(5):
        _step(seq)
    for bad in (-1, 6):
        with pytest.raises(DrvqwenError, match=f"rollback to position {bad}: the sequence holds positions 0 … 4"):
            seq.rollback(bad, 1)
    assert seq.pos == 5 and len(seq.pages.block_table) == 1


def test_rollback_waits_for_the_stream(rng):
    """Queued page-opening copies may still read the slots of the pages given back."""
    class Stream:
        synced = 0

        def synchronize(self):
            Stream.synced += 1

    state, table = np.zeros(3, np.int32), np.zeros(4, np.int32)
    seq = Sequence(PageAllocator(4, rng), HostArray(state), HostArray(table), 64, Stream())
    seq.resume(20)
    seq.reserve(20)
    before = Stream.synced
    seq.rollback(3, 9)
    assert Stream.synced == before + 1


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 49, 50])
def test_keep_before_a_prefill_that_continues_at_n(rng, n):
    """A prompt that shares its first n ids with the cached sequence: positions < n stay, the
    pages holding none of them go back (n = 0: all of them, the sequence starts again)."""
    seq, state, table = _sequence(6, rng)
    seq.start(3)
    for _ in range(50):                            # positions 0 … 49: four pages
        _step(seq)
    pages, free = list(seq.pages.block_table), list(seq.pages.free)
    kept = -(-n // PAGE_TOKENS)
    assert seq.keep(n) == pages[kept:]
    assert seq.pages.block_table == pages[:kept] and seq.pages.free == pages[kept:] + free
    assert seq.pos == n
    with pytest.raises(DrvqwenError, match=f"rollback to position {n + 1}"):
        seq.keep(n + 1)                            # positions it does not hold
    seq.reserve(n + 20)                            # the prefill's pages: the same ones again
    assert seq.pages.block_table == (pages + free)[:-(-(n + 20) // PAGE_TOKENS)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("seq") / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, np.random.default_rng(7)), byte_tokenizer_json())
    f = NanoqwenFile(path)
    yield f
    f.close()


@pytest.mark.parametrize("back_to", [14, 16, 20])
def test_cpu_step_rolled_back_decodes_the_same_bits(tiny, rng, back_to):
    """The CPU step machine's launch list, run by the numpy references over the sequence's
    pages: decode to position 36, roll back, decode again — the same tokens and logits bits at
    every position, pages included (the pages after the rollback point reopened in order)."""
    m = CpuMachine(tiny, 64)
    prompt = rng.integers(0, 256, 12).tolist()
    _logits, tok = m.start(prompt)
    consumed, want = {len(prompt): tok}, {}
    for pos in range(len(prompt), 36):
        t, _graph = m.gen_step()
        want[pos] = m.logits().copy()
        consumed[pos + 1] = t
    pages = list(m.seq.pages.block_table)
    released = m.seq.rollback(back_to, consumed[back_to])
    assert released == pages[-(-back_to // PAGE_TOKENS):] and m.pos == back_to
    for pos in range(back_to, 36):
        t, graph = m.gen_step()
        assert graph == ("opens_page" if pos % PAGE_TOKENS == 0 else "decode"), pos
        assert m.logits().tobytes() == want[pos].tobytes(), f"position {pos}"
        assert t == consumed[pos + 1]
    assert m.seq.pages.block_table == pages
