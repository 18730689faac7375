"""Launchers of kernels/decode_state.cu: the per-step decode state, advanced on the GPU.

    AdvanceState         state = (pos + 1, next_token, seq_len + 1)      the decode step's last launch
    SetBlockTableEntry   block_table[state[0] // PAGE_TOKENS] = new_page  first launch of a step that
                                                                          opens a KV page (graphs.py)
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_state, i32


class AdvanceState(Launcher):
    """state[1] = next_token[0]; state[0] += 1; state[2] += 1.

    Raises:
        LaunchError: a buffer of the wrong size or dtype.
    """

    def __init__(self, state, next_token, *, stream: Stream | None = None):
        super().__init__(stream)
        check_state(state)
        check_buffer(next_token, "next_token", 1, np.int32)
        self.bytes_moved = 16
        self._add(KernelRef("decode_state", "advance_state", pdl=True), (1,), (1,),
                  dict(state=state, next_token=next_token),
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
