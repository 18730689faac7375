"""One sequence in the paged KV cache: the one owner of its position, its pages and its block table.

A sequence's state lives on both sides and the two must agree:

    host     pos                     the next position to decode (the K/V written next goes there)
             pages                   kv_cache.PageAllocator: the free list and the block table
    device   state        int32 [3]  (pos, token, seq_len): what every decode kernel reads
             block_table  int32 [P]  logical page → physical page: where K/V is written and read

Nothing else changes them. The eager decode step (decode.py), the graphs (graphs.py), the
prefill (prefill.py), the verify pass (verify_pass.py), the engine (engine.py) and `drvqwen
step`'s machines call a `Sequence`:

    start(token, pos)      begin decoding `token` at `pos`; pos 0 starts a new sequence (every page
                           back to the free list)
    feed(token)            the next step consumes `token` instead of the last one chosen
    reserve(n_tokens)      pages for positions < n_tokens, the block table uploaded at once (prefill,
                           verify pass)
    resume(pos)            after the prefill queued decode_resume, or a verify pass advance_state by
                           its T tokens (the device state at pos)
    open_page()            host side of one decode step: the page its position opens, if any;
                           the caller records it on the device before the step's kernels run —
                           `write_block_table_entry` (eager), or the "opens_page" graph
    advance()              a decode step was queued (the GPU advances its state itself)
    rollback(pos, token)   forget positions ≥ pos: their pages back to the free list, the state
                           (pos, token, pos + 1) — the next step decodes `token` at `pos`
    keep(n)                before a prefill at position n: keep positions < n, forget the rest
                           (n = 0: reset, n < pos: rollback)
    reset()                every page back, position 0

Rollback is what speculative decoding (rejected tokens' K/V) and cache reuse across requests
(a new prompt that shares only a prefix) need. It keeps the pages holding positions < pos and
returns the rest; their block-table entries on the device are left as they are, because no
kernel reads an entry at or past ceil(seq_len / 16) and a page opened again writes its entry
before any kernel reads it (kv-cache.md). It waits for the stream first: a queued
page-opening graph may still read the pinned slot (graphs.py) of a page it gives back.
"""

from __future__ import annotations

import numpy as np

from .errors import DrvqwenError
from .kv_cache import PAGE_TOKENS, PageAllocator, n_pages_for


class Sequence:
    """The position, pages and block table of the one sequence in a KV cache (module doc).

    Args:
        pages: the page allocator of the cache (its block table is this sequence's).
        state: the device state int32 [3] (a DeviceArray, or anything with its `upload` and
            `upload_at`: the CPU step machine's numpy buffers).
        block_table: the device block table int32 [P], likewise.
        max_context: positions the cache holds.
        stream: the stream the decode kernels run on (None: every copy is synchronous).
    Attributes:
        pos: the next position to decode, the host's mirror of state[0].
        pages: the PageAllocator.
    """

    def __init__(self, pages: PageAllocator, state, block_table, max_context: int, stream=None) -> None:
        self.pages = pages
        self.state, self.block_table = state, block_table
        self.max_context = int(max_context)
        self.stream = stream
        self.pos = 0
        self._entry = np.zeros(1, np.int32)   # host copy of one block-table entry (eager page opening)

    def _drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    # ---- a sequence begins, continues, ends -------------------------------------------------
    def start(self, token: int, pos: int = 0) -> None:
        """Begin decoding `token` at position `pos` (the cache must already hold 0 … pos-1);
        pos 0 releases every page of the previous sequence. Waits for queued work first: the
        page slots of the previous sequence may still be read by queued copies until then."""
        self._drain()
        if pos == 0:
            self.pages.release_all()
        self.state.upload(np.array([pos, token, pos + 1], np.int32))
        self.pos = pos

    def feed(self, token: int) -> None:
        """Make the next step consume `token` instead of the previous step's choice (prompt
        tokens fed one at a time; a token chosen on the host). Queued on the stream."""
        self.state.upload_at(1, np.array([token], np.int32), self.stream)

    def reserve(self, n_tokens: int) -> None:
        """Make sure positions < n_tokens have pages, recording new ones in the device block
        table with one synchronous copy (so no step or prefill chunk has to stop for it).

        Raises:
            DrvqwenError: n_tokens exceeds max_context or the pages run out.
        """
        if n_tokens > self.max_context:
            raise DrvqwenError(f"{n_tokens} tokens exceed the KV cache of {self.max_context} (--max-context)")
        before = len(self.pages.block_table)
        for pos in range(before * PAGE_TOKENS, n_tokens, PAGE_TOKENS):
            self.pages.page_for(pos)
        if len(self.pages.block_table) > before:
            self.block_table.upload_at(0, np.asarray(self.pages.block_table, np.int32))

    def resume(self, pos: int) -> None:
        """Host bookkeeping after a prefill that queued decode_resume(pos), or a verify pass
        whose advance_state moved the device state to `pos` (verify_pass.py): the next step
        decodes the device's next_token at `pos`."""
        self.pos = pos

    def reset(self) -> None:
        """Forget the sequence: every page back to the free list, the next position is 0."""
        self.pages.release_all()
        self.pos = 0

    def keep(self, n: int) -> list[int]:
        """Before a prefill that continues the sequence at position n (a prompt that shares its
        first n ids with the cached sequence): keep positions < n and forget the rest. n = 0
        forgets everything (`reset`, as every new sequence); 0 < n < pos rolls back to n
        (`rollback`: pages back to the free list; the state's token is the prefill's to set);
        n = pos keeps everything.

        Returns:
            The physical pages given back, in logical order.
        Raises:
            DrvqwenError: n outside [0, pos].
        """
        if n == 0:
            released = list(self.pages.block_table)
            self.reset()
            return released
        if n == self.pos:
            return []
        return self.rollback(n, 0)

    # ---- one decode step --------------------------------------------------------------------
    def open_page(self) -> int | None:
        """The host side of a decode step at `pos`: the physical page its position opens, taken
        from the free list now, or None when the block table holds its page already. The
        caller records a new page on the device before the step's kernels run.

        Raises:
            DrvqwenError: the context is full, or no free page is left.
        """
        if self.pos >= self.max_context:
            raise DrvqwenError(f"context full: position {self.pos} >= max_context {self.max_context}")
        page, new = self.pages.page_for(self.pos)
        return page if new else None

    def write_block_table_entry(self, page: int) -> None:
        """Queue the copy of `page` into the device block table at pos // 16 (4 bytes, on the
        stream, ahead of the step's kernels): how an eager step records the page it opens."""
        self._entry[0] = page
        self.block_table.upload_at(self.pos // PAGE_TOKENS, self._entry, self.stream)

    def advance(self) -> None:
        """A decode step at `pos` was queued: the next one decodes at pos + 1."""
        self.pos += 1

    # ---- going back -------------------------------------------------------------------------
    def rollback(self, pos: int, token: int) -> list[int]:
        """Forget positions pos, pos + 1, …: the next decode step consumes `token` at `pos`.

        The pages that hold no position below `pos` (logical pages from ceil(pos / 16) on) go
        back to the front of the free list, so the sequence takes the same pages again as it
        grows; the device state becomes (pos, token, pos + 1). Waits for the stream first.

        Returns:
            The physical pages given back, in logical order.
        Raises:
            DrvqwenError: pos outside [0, self.pos].
        """
        if not 0 <= pos <= self.pos:
            raise DrvqwenError(f"rollback to position {pos}: the sequence holds positions 0 … {self.pos - 1}")
        self._drain()
        released = self.pages.release_from(n_pages_for(pos))
        self.state.upload(np.array([pos, token, pos + 1], np.int32))
        self.pos = pos
        return released
