"""Launcher of kernels/l2_prefetch.cu: the weights of the decode step's next launches asked into L2.

    L2Span            one span: the first head_bytes of each of `parts` balanced parts of a buffer
    gemv_spans        the spans of a GEMV launch: each block's first tiles, or the whole matrix
    l2_prefetch_spans the spans of a list of GEMV launches within a byte budget, in their order
    L2Prefetch        one launch asking L2 for up to SPANS spans (writes nothing)

A GEMV block streams its contiguous range of tiles front to back and the launch ends with its
slowest block (gemv_int4.cu), so what pays to have in L2 is the first tiles of every block, not a
prefix of the matrix (kernels/l2_prefetch.cu says why and how the kernel reads a span).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from ..cuda import Stream
from .base import DEFAULT_OCCUPANCY, NULL, BufferSpec, KernelRef, LaunchError, Launcher, Occupancy, mirrored, require

SPANS = mirrored("l2_prefetch", "L2P_SPANS", 16)
CHUNK_BYTES = mirrored("l2_prefetch", "L2P_CHUNK_BYTES", 64 * 1024)
THREADS = mirrored("l2_prefetch", "L2P_THREADS", 32)
# The launch's parameter buffer as the persistent decode step reads it (L2PrefetchArgs): 32 bytes
# a span, the pointer's alignment padding its five words.
ARGS_BYTES = mirrored("l2_prefetch", "sizeof(L2PrefetchArgs)", 32 * SPANS)
ALIGN = 16  # cp.async.bulk.prefetch: a 16-byte aligned address and a multiple of 16 bytes
# Blocks of a launch by default. Few, so that they find room beside the kernel before them and
# start early: a GEMV block of 8 warps holds 127–128 registers a thread, so an SM running two of
# them has no register left, and only the SMs with one (or none) can take a prefetch block while
# that GEMV runs — 120 of 132 beside the 7B's qkv_rope (144 blocks), 40 beside its down_proj
# (224 blocks). Each block then issues its share of the chunks in a row (they do not wait).
DEFAULT_BLOCKS = 32


def _nbytes(buffer) -> int:
    return int(buffer.nbytes)


@dataclass(frozen=True)
class L2Span:
    """Part p (0 ≤ p < parts) of `buffer` starts at floor(p · units / parts) · unit_bytes and
    covers min(head_bytes, bytes − start) bytes (the kernel's formula); a whole buffer is
    L2Span.whole(buffer).

    Attributes:
        buffer: the weight buffer (BufferSpec or DeviceArray), 16-byte aligned.
        bytes: bytes of it that parts may cover (its size, rounded down to a multiple of 16).
        units, parts: T units (GEMV tiles) shared out in balanced ranges over G parts (blocks).
        unit_bytes: bytes of one unit in this buffer (a multiple of 16).
        head_bytes: bytes asked for at the start of every part (a multiple of 16).
    """

    buffer: object
    bytes: int
    units: int
    parts: int
    unit_bytes: int
    head_bytes: int

    @classmethod
    def whole(cls, buffer) -> L2Span:
        """All of `buffer` (its last bytes past a multiple of 16 left out: a prefetch is a hint)."""
        b = _nbytes(buffer) // ALIGN * ALIGN
        return cls(buffer, b, 1, 1, 0, b)

    def ranges(self) -> list[tuple[int, int]]:
        """(offset, bytes) of every part with bytes > 0, as the kernel computes them."""
        out = []
        for p in range(self.parts):
            off = (p * self.units // self.parts) * self.unit_bytes
            if off < self.bytes:
                out.append((off, min(self.head_bytes, self.bytes - off)))
        return out

    @property
    def n_bytes(self) -> int:
        """Bytes the span asks for."""
        return sum(n for _off, n in self.ranges())

    @property
    def chunks(self) -> int:
        """Prefetch instructions the span's parts are cut into (at most CHUNK_BYTES each)."""
        return self.parts * -(-self.head_bytes // CHUNK_BYTES)

    def check(self) -> None:
        """Raises LaunchError: a size or offset the bulk prefetch cannot take, or a part past the
        buffer (the buffer's own alignment is checked when the launch is built: L2Prefetch.build)."""
        what = f"l2_prefetch: span of {getattr(self.buffer, 'name', 'a buffer')}"
        require(self.parts >= 1 and self.units >= 1, f"{what}: units={self.units}, parts={self.parts}; want ≥ 1")
        require(self.bytes % ALIGN == 0 and self.unit_bytes % ALIGN == 0 and self.head_bytes % ALIGN == 0,
                f"{what}: bytes={self.bytes}, unit_bytes={self.unit_bytes}, head_bytes={self.head_bytes}; each a "
                f"multiple of {ALIGN}")
        require(self.bytes <= _nbytes(self.buffer), f"{what}: {self.bytes} B of a {_nbytes(self.buffer)}-byte buffer")
        require(max(self.bytes, self.head_bytes) < 2**32 and self.units * self.parts < 2**32,
                f"{what}: a field past 32 bits (or units · parts: the kernel's part offsets are 32-bit)")


def gemv_spans(gemv, tiles_per_block: int | None = None) -> list[L2Span]:
    """The spans of a GEMV launcher's weights (Launcher.weight_tiles: gemv_int4's and gemv_fmt's
    o_proj / gate_up / down launchers): the first `tiles_per_block` tiles of every block's range
    in each weight buffer, or (None, or as many as a block owns) every buffer whole."""
    n_tiles, grid, streams = gemv.weight_tiles()
    if tiles_per_block is None or tiles_per_block >= -(-n_tiles // grid):
        return [L2Span.whole(buf) for buf, _tile_bytes in streams]
    require(tiles_per_block >= 1, f"l2_prefetch: tiles_per_block={tiles_per_block}; want ≥ 1")
    return [L2Span(buf, _nbytes(buf) // ALIGN * ALIGN, n_tiles, grid, tile_bytes, tiles_per_block * tile_bytes)
            for buf, tile_bytes in streams]


def l2_prefetch_spans(gemvs: Sequence, budget_bytes: int) -> list[L2Span]:
    """The spans to prefetch for `gemvs` (GEMV launchers with weight_tiles, in the order they run)
    within `budget_bytes` and SPANS spans: each GEMV whole while the budget lasts; then, for the
    first that does not fit, as many first tiles of every block as fit (none if not one); nothing
    after it.

    Whole first, in order, because the next launch reads its weights soonest; the first tiles of
    every block of the one after, because that GEMV ends with its slowest block (module doc).
    """
    spans: list[L2Span] = []
    left = int(budget_bytes)
    for gemv in gemvs:
        whole = gemv_spans(gemv)
        if len(spans) + len(whole) > SPANS:
            break
        cost = sum(s.n_bytes for s in whole)
        if cost <= left:
            spans += whole
            left -= cost
            continue
        n_tiles, grid, streams = gemv.weight_tiles()
        per_tile_row = grid * sum(tile_bytes for _buf, tile_bytes in streams)  # one tile of every block
        k = left // per_tile_row
        if k >= 1:
            spans += gemv_spans(gemv, k)
        break
    return spans


class L2Prefetch(Launcher):
    """Ask L2 for `spans` (at most SPANS of them, L2Span) in one launch of G one-warp blocks,
    G = min(`blocks` (default DEFAULT_BLOCKS), SMs, prefetch instructions); writes nothing
    (kernels/l2_prefetch.cu).

    Raises:
        LaunchError: no span or more than SPANS, or a span the bulk prefetch cannot take.
    """

    def __init__(self, spans: Sequence[L2Span], *, occupancy: Occupancy | None = None, blocks: int | None = None,
                 stream: Stream | None = None):
        super().__init__(stream)
        spans = list(spans)
        require(1 <= len(spans) <= SPANS, f"l2_prefetch: {len(spans)} spans; a launch takes 1 to {SPANS}")
        for s in spans:
            s.check()
        self.spans = spans
        self.bytes_moved = sum(s.n_bytes for s in spans)  # HBM → L2; nothing reaches the SMs
        chunks = sum(s.chunks for s in spans)
        require(blocks is None or blocks >= 1, f"l2_prefetch: blocks={blocks}; want ≥ 1")
        grid = max(1, min(blocks or DEFAULT_BLOCKS, (occupancy or DEFAULT_OCCUPANCY).sm_count, chunks))
        args: dict[str, object] = {}
        for i in range(SPANS):
            s = spans[i] if i < len(spans) else None
            u32 = ctypes.c_uint32
            args.update({f"base{i}": s.buffer if s else NULL, f"bytes{i}": u32(s.bytes if s else 0),
                         f"units{i}": u32(s.units if s else 0), f"parts{i}": u32(s.parts if s else 0),
                         f"unit_bytes{i}": u32(s.unit_bytes if s else 0),
                         f"head_bytes{i}": u32(s.head_bytes if s else 0)})
        self._add(KernelRef("l2_prefetch", "l2_prefetch", pdl=True), (grid,), (THREADS,), args,
                  reads=tuple(s.buffer for s in spans), writes=(), bytes_moved=self.bytes_moved)

    def build(self, resolve=None, stream: Stream | None = None, pdl: bool | None = None):
        """Launcher.build, after checking that every span's buffer, as resolved, is 16-byte
        aligned (the bulk prefetch's rule; the weight pool aligns every tensor far more).

        Raises:
            LaunchError: a misaligned buffer, or as Launcher.build.
        """
        for s in self.spans:
            buf = resolve(s.buffer) if resolve is not None and isinstance(s.buffer, BufferSpec) else s.buffer
            # A planned buffer without a resolver has no address (yet, or after the launches were
            # built once: Launcher.build returns those, or refuses an unbuilt plan itself).
            ptr = getattr(buf, "ptr", None)
            if isinstance(ptr, int) and ptr % ALIGN:  # the message formats ptr: only an address gets here
                raise LaunchError(f"l2_prefetch: {getattr(buf, 'name', 'a buffer')} at {ptr:#x} is not {ALIGN}-byte aligned")
        return super().build(resolve, stream, pdl)
