"""Launchers of kernels/prefill_state.cu: the two scalar updates around a prefill.

    PrefillBeginChunk   prefill_state = (start, n_rows)            before each prompt chunk
    DecodeResume        state = (pos, next_token[0], pos + 1)      after the prompt's last chunk
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, check_prefill_state, check_state, i32


class PrefillBeginChunk(Launcher):
    """prefill_state int32 [2] = (start, n_rows), queued on the stream (`set` before `launch`)."""

    def __init__(self, prefill_state, *, stream: Stream | None = None):
        super().__init__(stream)
        check_prefill_state(prefill_state)
        self._add(KernelRef("prefill_state", "prefill_begin_chunk"), (1,), (1,),
                  dict(prefill_state=prefill_state, start=i32(0), n_rows=i32(0)),
                  writes=(prefill_state,), bytes_moved=8)

    def set(self, start: int, n_rows: int) -> PrefillBeginChunk:
        """The chunk's first position and row count, for the next launch."""
        self.set_arg("start", i32(start))
        self.set_arg("n_rows", i32(n_rows))
        return self


class DecodeResume(Launcher):
    """state int32 [3] = (pos, next_token[0], pos + 1): decoding continues after a prefill."""

    def __init__(self, state, next_token, *, stream: Stream | None = None):
        super().__init__(stream)
        check_state(state)
        check_buffer(next_token, "next_token", 1, np.int32)
        self._add(KernelRef("prefill_state", "decode_resume"), (1,), (1,),
                  dict(state=state, next_token=next_token, pos=i32(0)),
                  reads=(next_token,), writes=(state,), bytes_moved=16)

    def set(self, pos: int) -> DecodeResume:
        """The first position to decode, for the next launch."""
        self.set_arg("pos", i32(pos))
        return self
