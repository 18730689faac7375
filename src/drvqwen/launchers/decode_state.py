"""Launchers of kernels/decode_state.cu: the per-step decode state, advanced on the GPU.

    AdvanceState         state = (pos + 1, next_token, seq_len + 1)      the decode step's last launch
                         (n_tokens = T: (pos + T, next_token[T-1], seq_len + T), advance_state_tokens,
                         the verify pass's last launch)
    SetBlockTableEntry   block_table[state[0] // PAGE_TOKENS] = new_page  first launch of a step that
                                                                          opens a KV page (graphs.py)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_state, i32
from .gemv_int4 import token_count  # the verify pass's bound on T, shared with its other kernels


class AdvanceState(Launcher):
    """state[1] = next_token[0]; state[0] += 1; state[2] += 1.

    n_tokens = T (1..16), the verify pass: next_token int32 [T]; state[1] = next_token[T-1],
    state[0] += T, state[2] += T (advance_state_tokens): the state T decode steps leave.

    Raises:
        LaunchError: n_tokens outside 1..16, or a buffer of the wrong size or dtype.
    """

    def __init__(self, state, next_token, *, stream: Stream | None = None, n_tokens: int | None = None):
        super().__init__(stream)
        t = token_count(n_tokens, "advance_state")
        check_state(state)
        check_buffer(next_token, "next_token", t, np.int32)
        self.bytes_moved = 16
        args = dict(state=state, next_token=next_token)
        if n_tokens is not None:
            args["n_tokens"] = i32(t)
        kernel = "advance_state" if n_tokens is None else "advance_state_tokens"
        self._add(KernelRef("decode_state", kernel, pdl=True), (1,), (1,), args,
                  reads=(state, next_token), writes=(state,), bytes_moved=self.bytes_moved)


class SetBlockTableEntry(Launcher):
    """block_table[state[0] // PAGE_TOKENS] = new_page[0].

    The host hands the newly allocated physical page over in the device scalar `new_page`
    (int32 [1]); the logical page comes from the device position, so the launch's parameters
    never change and a captured graph replays it as is.

    Raises:
        LaunchError: a buffer of the wrong size or dtype.
    """

    def __init__(self, block_table, new_page, state, *, n_pages: int, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(block_table, "block_table", n_pages, np.int32)
        check_buffer(new_page, "new_page", 1, np.int32)
        check_state(state)
        self.bytes_moved = 12
        self._add(KernelRef("decode_state", "set_block_table_entry", pdl=True), (1,), (1,),
                  dict(block_table=block_table, new_page=new_page, state=state, n_pages=i32(n_pages)),
                  reads=(new_page, state), writes=(block_table,), bytes_moved=self.bytes_moved)
