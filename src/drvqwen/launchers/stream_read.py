"""Launcher of kernels/stream_read.cu: k blocks streaming bytes from HBM, to measure what k SMs
can read (tools/bench_sm_stream.py).

    StreamRead   out u32 [k · threads] = each thread's sum (mod 2^32) of the 32-bit words it read of
                 src u8 [k · bytes_per_block]; kind "ld" (16-byte loads, SR_UNROLL in flight a
                 thread) or "bulk" (1-D bulk copies into a ring of SR_STAGES × SR_CHUNK bytes)
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..cuda import Stream
from .base import KernelRef, Launcher, check_buffer, mirrored, require

LD_THREADS = mirrored("stream_read", "SR_LD_THREADS", 256)
BULK_THREADS = mirrored("stream_read", "SR_BULK_THREADS", 128)
UNROLL = mirrored("stream_read", "SR_UNROLL", 8)
STAGES = mirrored("stream_read", "SR_STAGES", 4)
CHUNK = mirrored("stream_read", "SR_CHUNK", 32 * 1024)
KINDS = ("ld", "bulk")


def threads_of(kind: str) -> int:
    """Threads a block of `kind` (the length of each block's row of `out`)."""
    return LD_THREADS if kind == "ld" else BULK_THREADS


class StreamRead(Launcher):
    """One launch of `blocks` blocks, block b reading bytes [b · bytes_per_block, (b + 1) ·
    bytes_per_block) of src u8 [blocks · bytes_per_block] once and writing out u32 [blocks ·
    threads_of(kind)], each thread's sum (modulo 2^32) of the words it read. `defines`: the kernel's
    compile-time choices (SR_UNROLL, SR_STAGES, SR_CHUNK), to measure.

    Raises:
        LaunchError: an unknown kind, a count below 1, bytes_per_block not a multiple of 16 (bulk:
            of the chunk), src not 16-byte aligned, or a buffer of the wrong size or dtype.
    """

    def __init__(self, out, src, *, blocks: int, bytes_per_block: int, kind: str = "ld",
                 defines: tuple[tuple[str, int], ...] = (), stream: Stream | None = None):
        super().__init__(stream)
        require(kind in KINDS, f"stream_read: kind={kind!r}, want one of {KINDS}")
        d = dict(defines)
        chunk, stages = int(d.get("SR_CHUNK", CHUNK)), int(d.get("SR_STAGES", STAGES))
        unit = 16 if kind == "ld" else chunk
        require(blocks >= 1 and bytes_per_block >= unit and bytes_per_block % unit == 0,
                f"stream_read: {blocks} blocks of {bytes_per_block} B; want ≥ 1 block and a multiple of {unit} B")
        threads = threads_of(kind)
        check_buffer(src, "src", blocks * bytes_per_block, np.uint8)
        require(getattr(src, "ptr", 0) % 16 == 0, "stream_read: src must be 16-byte aligned")
        check_buffer(out, "out", blocks * threads, np.uint32)
        self.bytes = blocks * bytes_per_block
        if kind == "ld":
            args = dict(out=out, src=src, vecs_per_block=ctypes.c_uint64(bytes_per_block // 16))
            smem = 0
        else:
            args = dict(out=out, src=src, bytes_per_block=ctypes.c_uint64(bytes_per_block))
            smem = stages * chunk + stages * 8
        self._add(KernelRef("stream_read", f"stream_read_{kind}", tuple(defines)), (blocks,), (threads,), args,
                  smem_bytes=smem, reads=(src,), writes=(out,), bytes_moved=self.bytes)
