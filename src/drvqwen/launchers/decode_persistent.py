"""Launcher of kernels/decode_persistent.cu: the decode step from the embedding through the last
layer as one persistent kernel (the kernel's header says how, and why that is bit for bit the
per-launch step).

    PersistentDecode   runs the planned launches of a list of launchers (the per-launch step's
                       embedding and layers) as one launch of a program in device memory

The program (`program_bytes`): one 32-byte PersistentOp per planned launch, then each launch's
arguments as the kernel's parameter buffer has them — a C struct of the parameters' types in
order, whose layout ctypes computes as the compiler does (`arg_struct`) — each 16-byte aligned:

    op  kind u32, n_items u32, gx u32, threads u32, args u64 (device address), first u32 (items of
        the ops before), wait u32 (items of the op before)

The counters (uint32 [n_ops + 1]): items finished per op, then blocks finished; zero between
steps (the kernel's last block resets them; they are zeroed once at build).

The trace (optional, uint64 [grid, trace_items, 4]): per block, one record per item it ran —
op << 32 | SM << 20 | item, then %globaltimer at the item's start, when its wait was over, and
after its release (`trace_summary` turns a downloaded trace into per-op times).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ..cuda import Stream
from .attention_decode import COMBINE_THREADS
from .base import (DEFAULT_OCCUPANCY, NULL, BufferSpec, KernelRef, Launcher, LaunchError, LaunchSpec, NullPointer,
                   Occupancy, TensorMapSpec, i32, mirrored, require)

THREADS = mirrored("decode_persistent", "DP_THREADS", 256)
OP_BYTES = mirrored("decode_persistent", "sizeof(PersistentOp)", 32)
ATTENTION_SPLITS_PER_ITEM = 8   # one split per warp of the 8-warp block (kernel header)
ARGS_ALIGN = 16

# Planned kernel → op kind (the kernel's DP_* constants).
KINDS = {
    "embedding": mirrored("decode_persistent", "DP_EMBEDDING", 1),
    "gemv_int4_qkv_rope": mirrored("decode_persistent", "DP_QKV_ROPE", 2),
    "gemv_int4_residual": mirrored("decode_persistent", "DP_RESIDUAL", 3),
    "gemv_int4_gate_up_swiglu": mirrored("decode_persistent", "DP_GATE_UP", 4),
    "attention_decode_hd64": mirrored("decode_persistent", "DP_ATTENTION", 5),
    "attention_decode_hd128": 5,
    "attention_combine": mirrored("decode_persistent", "DP_COMBINE", 6),
    "l2_prefetch": mirrored("decode_persistent", "DP_L2_PREFETCH", 7),
    # the per-tensor formats' (a build with the model's WF_FORMATS: `fmt_defines`)
    "embedding_fmt": mirrored("decode_persistent", "DP_EMBEDDING_FMT", 8),
    "gemv_fmt_qkv_rope": mirrored("decode_persistent", "DP_QKV_ROPE_FMT", 9),
    "gemv_fmt_residual": mirrored("decode_persistent", "DP_RESIDUAL_FMT", 10),
    "gemv_fmt_gate_up_swiglu": mirrored("decode_persistent", "DP_GATE_UP_FMT", 11),
}
# The kinds a build runs: with WF_FORMATS the format ops and no INT4 GEMV (the kernel's switch).
INT4_GEMV_KINDS = frozenset(KINDS[k] for k in ("gemv_int4_qkv_rope", "gemv_int4_residual", "gemv_int4_gate_up_swiglu"))
FORMAT_KINDS = frozenset(KINDS[k] for k in ("embedding_fmt", "gemv_fmt_qkv_rope", "gemv_fmt_residual",
                                            "gemv_fmt_gate_up_swiglu"))


class _Op(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("n_items", ctypes.c_uint32), ("gx", ctypes.c_uint32),
                ("threads", ctypes.c_uint32), ("args", ctypes.c_uint64), ("first", ctypes.c_uint32),
                ("wait", ctypes.c_uint32)]


assert ctypes.sizeof(_Op) == OP_BYTES


def _param_ctype(value) -> type:
    """The ctypes type a planned or packed argument occupies in the parameter buffer."""
    if isinstance(value, TensorMapSpec):
        raise LaunchError("the persistent decode step takes no tensor-map argument (plan the plain attention)")
    if isinstance(value, ctypes._SimpleCData):
        return type(value)
    if isinstance(value, (BufferSpec, NullPointer)) or isinstance(getattr(value, "ptr", None), int):
        return ctypes.c_uint64  # a T* parameter: 8 bytes
    raise LaunchError(f"the persistent decode step cannot pack an argument of type {type(value).__name__}")


def arg_struct(args: Sequence) -> type:
    """A ctypes Structure type with one field per argument, in order: the C layout of a struct of
    the kernel's parameter types (natural alignment), which the kernel's `…Args` struct has."""
    return type("KernelArgs", (ctypes.Structure,), {"_fields_": [(f"a{i}", _param_ctype(a)) for i, a in enumerate(args)]})


def _align(n: int, a: int = ARGS_ALIGN) -> int:
    return -(-n // a) * a


def op_shape(spec: LaunchSpec) -> tuple[int, int, int, int]:
    """(kind, n_items, gx, threads) of one planned launch in the program (kernel header's work split).

    Raises:
        LaunchError: a kernel the persistent step does not run, or a block it cannot hold.
    """
    name = spec.kernel.kernel
    require(name in KINDS, f"the persistent decode step cannot run {spec.kernel}")
    gx = spec.grid[0]
    gy = spec.grid[1] if len(spec.grid) > 1 else 1
    threads = spec.block[0]
    if name.startswith("attention_decode_hd"):
        return KINDS[name], -(-gx * 4 // ATTENTION_SPLITS_PER_ITEM) * gy, gx, threads
    if name == "attention_combine":  # item = one planned block (h, c) of grid (Hq, C), of DP_THREADS threads
        require(threads == THREADS, f"{spec.kernel}: blocks of {threads} threads; the persistent step runs the "
                                    f"combine's blocks of {THREADS} (C = {COMBINE_THREADS // THREADS} blocks a head)")
        return KINDS[name], gx * gy, gx, threads
    require(gy == 1, f"{spec.kernel}: a grid of {spec.grid} (one row of blocks expected)")
    require(threads <= THREADS,
            f"{spec.kernel}: blocks of {threads} threads, the persistent block has {THREADS}")
    return KINDS[name], gx, gx, threads


class CappedOccupancy(Occupancy):
    """`inner`'s occupancy with at most `per_sm` blocks per SM: the persistent step plans its
    launches (GEMV grids, attention splits) for the blocks it runs on, so an op's items fill
    its blocks once instead of spilling into a second round."""

    def __init__(self, inner: Occupancy, per_sm: int):
        self.inner, self.per_sm = inner, int(per_sm)

    @property
    def sm_count(self) -> int:
        return self.inner.sm_count

    def blocks_per_sm(self, kernel: KernelRef, threads: int, smem_bytes: int) -> int:
        return min(self.inner.blocks_per_sm(kernel, threads, smem_bytes), self.per_sm)


def trace_items(ops: Sequence[tuple[int, int, int, int]], grid_blocks: int) -> int:
    """Records per block of the trace: at most ceil(n_items / grid) items of each op."""
    return sum(-(-n // grid_blocks) for _k, n, _g, _t in ops)


TRACE_ITEM_BITS = mirrored("decode_persistent", "DP_TRACE_ITEM_BITS", 20)  # a trace record's item field


def most_at_once(starts: np.ndarray, ends: np.ndarray) -> int:
    """The most of the intervals [start, end) that overlap at one instant (0 for none)."""
    events = sorted([(int(t), 1) for t in starts] + [(int(t), -1) for t in ends], key=lambda e: (e[0], e[1]))
    best = now = 0
    for _t, d in events:
        now += d
        best = max(best, now)
    return best


def trace_summary(trace: np.ndarray, n_ops: int) -> list[dict]:
    """Per op of one traced step (trace: uint64 [grid, trace_items, 4] as the kernel wrote it,
    unused records zero): its items, and in µs from the first item's start: when its first item
    started, when the first and last wait were over, when its last item released; its items'
    median and slowest time after their wait; and where they ran: on how many SMs, and the most
    of them running on one SM at once (past their wait)."""
    rec = trace.reshape(-1, 4)
    rec = rec[rec[:, 1] != 0]
    t0 = int(rec[:, 1].min())
    out = []
    for k in range(n_ops):
        r = rec[(rec[:, 0] >> 32) == k]
        if not len(r):
            continue
        us = lambda v: (int(v) - t0) / 1e3
        sm = (r[:, 0] >> TRACE_ITEM_BITS) & ((1 << (32 - TRACE_ITEM_BITS)) - 1)
        after_wait = (r[:, 3] - r[:, 2]).astype(np.int64)
        out.append({"op": k, "items": int(len(r)), "start_us": us(r[:, 1].min()), "wait_first_us": us(r[:, 2].min()),
                    "wait_last_us": us(r[:, 2].max()), "end_us": us(r[:, 3].max()),
                    "item_median_us": float(np.median(after_wait)) / 1e3, "item_max_us": float(after_wait.max()) / 1e3,
                    "sms": int(len(np.unique(sm))),
                    "most_on_one_sm": max(most_at_once(r[sm == s, 2], r[sm == s, 3]) for s in np.unique(sm))})
    return out


def program_bytes(specs: Sequence[LaunchSpec]) -> int:
    """Bytes of the program for these planned launches (module doc)."""
    return len(specs) * OP_BYTES + sum(_align(ctypes.sizeof(arg_struct(s.params))) for s in specs)


class PersistentDecode(Launcher):
    """The launches of `steps` (built or planned launchers, in order) as one persistent kernel.

    Args:
        steps: (name, launcher) of the per-launch step from "embedding" through the last layer's
            "down_proj" (the plain attention kernel, the INT4 GEMVs or the per-tensor formats'
            (gemv_fmt.cu), and the L2 prefetches where planned: an item per planned block, which
            waits for the op before it too).
        program: uint8 [program_bytes(specs)] device buffer (planned or real) for the program.
        counters: uint32 [n_ops + 1] device buffer for the completion counters.
        head_dim: the attention's head dim (DP_HEAD_DIM: one instantiation per kernel).
        occupancy: resident blocks per SM and SMs (the grid must fit in one wave).
        min_blocks: blocks per SM the kernel's registers are sized for (DP_MIN_BLOCKS).
        stress: the stress build (DP_STRESS: random delays before every item), for tests.
        trace: plan the per-item timestamps: `self.trace` is then the buffer they go to, uint64
            [grid_blocks × trace_items × 4] named "persistent_trace" (for the caller to allocate).
        defines: more compile-time choices of the kernel, (name, value) pairs (DP_SPIN_NS …: the
            kernel header), for measurements.
        fmt_defines: a model in per-tensor formats: the defines its gemv_fmt.cu build has
            (launchers/gemv_fmt.format_defines: WF_FORMATS …), so that the kernel's format ops
            are that build's code; () for the INT4 layers.
    Raises:
        LaunchError: a launch the kernel cannot run, a buffer of the wrong size, or fewer than
            one resident block per SM.
    """

    def __init__(self, steps: Sequence[tuple[str, Launcher]], program, counters, *, head_dim: int,
                 occupancy: Occupancy | None = None, min_blocks: int = 1, stress: bool = False,
                 trace: bool = False, defines: Sequence[tuple[str, int]] = (),
                 fmt_defines: Sequence[tuple[str, int]] = (), stream: Stream | None = None):
        super().__init__(stream)
        self.steps = list(steps)
        self.member_specs = [s for _n, l in self.steps for s in l.specs]
        for s in self.member_specs:
            if s.kernel.kernel.startswith("attention_decode_hd"):
                require(s.kernel.kernel == f"attention_decode_hd{head_dim}" and s.block[0] == 128,
                        f"{s.kernel}: the persistent step is built for head dim {head_dim}")
        self.ops = [op_shape(s) for s in self.member_specs]
        fmt_defines = tuple((str(k), int(v)) for k, v in fmt_defines)
        formats = any(k == "WF_FORMATS" for k, _v in fmt_defines)
        require(not fmt_defines or formats, f"fmt_defines {fmt_defines}: no WF_FORMATS (format_defines gives it)")
        # The formats decide which ops the build runs: they come with the step's gemv_fmt.cu build only.
        require(all(str(k) != "WF_FORMATS" for k, _v in defines),
                "defines: WF_FORMATS goes in fmt_defines (the step's gemv_fmt.cu build), not in the measurement defines")
        for s, (kind, *_rest) in zip(self.member_specs, self.ops):
            require(kind not in (INT4_GEMV_KINDS if formats else FORMAT_KINDS),
                    f"{s.kernel}: the persistent step runs "
                    + ("the per-tensor formats' GEMVs, not INT4 ones, in a build for formats" if formats else
                       "per-tensor formats only in a build for them (fmt_defines)"))
        require(not trace or all(n < 1 << TRACE_ITEM_BITS for _k, n, _g, _t in self.ops),
                f"an op of 2^{TRACE_ITEM_BITS} items or more: the trace records hold fewer")
        n_bytes = program_bytes(self.member_specs)
        require(getattr(program, "shape", (n_bytes,)) == (n_bytes,) and np.dtype(getattr(program, "dtype", np.uint8)) == np.uint8,
                f"program: expected uint8 [{n_bytes}], got {getattr(program, 'name', program)}")
        require(tuple(getattr(counters, "shape", (len(self.ops) + 1,))) == (len(self.ops) + 1,),
                f"counters: expected uint32 [{len(self.ops) + 1}]")
        self.program, self.counters = program, counters
        smem = max([s.smem_bytes for s in self.member_specs] + [0])
        defines = (("DP_HEAD_DIM", int(head_dim)), ("DP_MIN_BLOCKS", int(min_blocks)), ("DP_STRESS", int(stress)),
                   *fmt_defines, *((str(k), int(v)) for k, v in defines))
        kernel = KernelRef("decode_persistent", "decode_persistent", defines)
        occ = occupancy or DEFAULT_OCCUPANCY
        per_sm = occ.blocks_per_sm(kernel, THREADS, smem)
        require(per_sm >= 1, f"{kernel}: no block of {THREADS} threads and {smem} B of shared memory fits an SM")
        self.grid_blocks = per_sm * occ.sm_count
        self.trace_items = trace_items(self.ops, self.grid_blocks)
        self.trace = (BufferSpec("persistent_trace", (self.grid_blocks * self.trace_items * 4,), np.uint64)
                      if trace else None)
        reads = tuple(dict.fromkeys(r for s in self.member_specs for r in s.reads))
        writes = tuple(dict.fromkeys([w for s in self.member_specs for w in s.writes] + [counters.name]
                                     + ([self.trace.name] if self.trace is not None else [])))
        self.bytes_moved = sum(s.bytes_moved for s in self.member_specs)
        self._add(kernel, (self.grid_blocks,), (THREADS,),
                  dict(program=program, counters=counters, trace=self.trace if self.trace is not None else NULL,
                       n_ops=i32(len(self.ops)), trace_items=i32(self.trace_items)),
                  smem_bytes=smem, reads=reads, writes=writes, bytes_moved=self.bytes_moved)

    def pack_program(self, base: int) -> bytes:
        """The program's bytes for device address `base`, from the members' built launches."""
        values = [ln.values for _n, l in self.steps for ln in l.launches]
        head = bytearray(len(self.ops) * OP_BYTES)
        body = bytearray()
        at, first, wait = len(head), 0, 0
        for i, ((kind, n_items, gx, threads), vals) in enumerate(zip(self.ops, values)):
            st = arg_struct(vals)(*[v.value if isinstance(v, ctypes._SimpleCData) else v for v in vals])
            op = _Op(kind, n_items, gx, threads, base + at, first, wait)
            first, wait = first + n_items, n_items
            head[i * OP_BYTES:(i + 1) * OP_BYTES] = bytes(op)
            raw = bytes(st)
            body += raw + bytes(_align(len(raw)) - len(raw))
            at += _align(len(raw))
        return bytes(head + body)

    def build(self, resolve=None, stream: Stream | None = None, pdl: bool | None = None):
        """Build the members (if not yet), write the program and zero the counters, then pack
        the persistent launch (Launcher.build)."""
        if self._launches is not None:
            return self._launches
        for _n, launcher in self.steps:
            launcher.build(resolve, stream, pdl)
        prog = resolve(self.program) if isinstance(self.program, BufferSpec) else self.program
        ctr = resolve(self.counters) if isinstance(self.counters, BufferSpec) else self.counters
        prog.upload(np.frombuffer(self.pack_program(prog.ptr), np.uint8))
        ctr.upload(np.zeros(len(self.ops) + 1, np.uint32))
        return super().build(resolve, stream, False)
