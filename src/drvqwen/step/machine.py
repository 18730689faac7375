"""What `drvqwen step` walks: one decode step's launches, run one at a time, on a device.

A `Machine` holds the step's launch list (the plan's groups, reference_steps.LaunchGroup) and a
cursor into it. `run_next()` runs the launch under the cursor and reports it:

    before a group's first launch   the group's reference is computed from the buffers it
                                    reads, as they are now (so errors never accumulate)
    the launch                      on the GPU: the kernel alone, timed by an event pair;
                                    on the CPU: the reference itself, timed on the host
    after a group's last launch     every buffer the group wrote (its scratch aside) compared
                                    with the reference (GPU), or written from it (CPU)

Two machines share this: `CpuMachine` (machine_cpu.py: numpy buffers, the plan made without a
GPU) and `GpuMachine` (machine_gpu.py: the engine's own DecodeStep, Prefill and graphs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import DrvqwenError
from ..kv_cache import PAGE_TOKENS
from ..reference_steps import Comparison, Expected, LaunchGroup, compare, reference_for


@dataclass
class LaunchEntry:
    """One kernel launch of the step.

    Attributes:
        index: its place in the step (0-based).
        name: e.g. "L3.qkv_rope", "L3.attention.1".
        group: the step entry it belongs to; sub: its index there.
        spec: the LaunchSpec (kernel, grid, block, shared memory, reads, writes, bytes).
    """

    index: int
    name: str
    group: LaunchGroup
    sub: int
    spec: object

    @property
    def first(self) -> bool:
        return self.sub == 0

    @property
    def last(self) -> bool:
        return self.sub == len(self.group.specs) - 1


@dataclass
class LaunchReport:
    """What one launch did.

    Attributes:
        entry: the launch.
        time_us: its time (GPU: events around the kernel; CPU: the host's time for the reference).
        bytes: bytes it moves in device memory (the plan's figure; attention's from seq_len).
        comparisons: one per buffer the group wrote, after its last launch.
        later: scratch buffers written here and compared through the launch that combines them.
        what: one line on what it computes.
        checked: False where no reference exists for the kernel.
    """

    entry: LaunchEntry
    time_us: float
    bytes: int
    comparisons: list[Comparison] = field(default_factory=list)
    later: tuple[str, ...] = ()
    what: str = ""
    checked: bool = True

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)


def entries_of(groups: list[LaunchGroup]) -> list[LaunchEntry]:
    """The flat launch list of the groups, named as DecodeStep.launches names them."""
    out = []
    for g in groups:
        for sub, (name, spec) in enumerate(zip(g.launch_names(), g.specs)):
            out.append(LaunchEntry(len(out), name, g, sub, spec))
    return out


class Machine:
    """The step on one device (see the module doc). Subclasses provide the buffers and the launch.

    Attributes:
        device: "cpu" or "cuda"; label: a line naming it.
        config: the model; plan: the DecodePlan; groups, entries: the launch list.
        cursor: index of the next launch in the step (0 = at a step boundary).
        pos: the position the current (or next) step decodes.
        last_expected: buffer name → (Expected, launch name) of the latest reference.
    """

    device = "cpu"
    label = ""
    compares = True

    def __init__(self, groups: list[LaunchGroup]) -> None:
        self.groups = groups
        self.entries = entries_of(groups)
        self.cursor = 0
        self.last_expected: dict[str, tuple[Expected, str]] = {}
        self._pending: list[Expected] | None = None
        self._pending_us = 0.0
        self.opened_page: int | None = None     # the page the current step took, if any

    # ---- provided by the device -------------------------------------------------------------
    dtype = np.float64

    def array(self, buf) -> np.ndarray:
        raise NotImplementedError

    def int4(self, qweight, scales) -> np.ndarray:
        """A projection's weights dequantized (both devices read them from the file: self.weights,
        a FileWeights the subclass sets)."""
        return self.weights.int4(qweight, scales)

    def dense(self, weight) -> np.ndarray:
        return self.weights.dense(weight)

    def quantized(self, qweight) -> np.ndarray:
        """A weight in a per-tensor format, dequantized (from the file, as int4)."""
        return self.weights.quantized(qweight)

    @property
    def pos(self) -> int:
        raise NotImplementedError

    def _begin_step(self) -> None:
        raise NotImplementedError

    def _end_step(self) -> None:
        raise NotImplementedError

    def _launch(self, e: LaunchEntry) -> float:
        """Run launch `e`; return its time in µs."""
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------
    def find(self, name: str) -> int:
        """Index of the first launch named `name` or starting with `name.` (a prefix such as
        "L5.attention" names its first launch).

        Raises:
            DrvqwenError: no launch has that name.
        """
        for e in self.entries:
            if e.name == name or e.name.startswith(name + "."):
                return e.index
        raise DrvqwenError(f"no launch named {name!r} (`list` shows them)")

    def bytes_of(self, e: LaunchEntry) -> int:
        """Bytes launch `e` moves: the plan's figure, or the K/V read at this sequence length for
        a launch whose bytes depend on it (the split-KV attention)."""
        if e.spec.bytes_moved:
            return int(e.spec.bytes_moved)
        bytes_for = getattr(e.group.launcher, "bytes_for", None)
        if bytes_for is not None and e.first:
            return int(bytes_for(int(self.array("state")[2])))
        return 0

    def run_next(self) -> LaunchReport:
        """Run the launch under the cursor (see the module doc) and advance the cursor.

        Raises:
            DrvqwenError: at a step boundary, the context is full or no page is left.
        """
        e = self.entries[self.cursor]
        if self.cursor == 0:
            self._begin_step()
        ref_fn, what = reference_for(e.group)
        if e.first:
            t0 = time.perf_counter()
            self._pending = ref_fn(e.group, self) if ref_fn is not None else None
            self._pending_us = (time.perf_counter() - t0) * 1e6
        nbytes = self.bytes_of(e)
        us = self._launch(e)
        self.cursor += 1
        report = LaunchReport(e, us, nbytes, what=what, checked=ref_fn is not None)
        if e.last:
            for x in self._pending or ():
                self.last_expected[x.name] = (x, e.name)
                if self.compares:
                    report.comparisons.append(compare(x, self.array(x.name)))
            self._pending = None
        else:
            report.later = tuple(w for w in e.spec.writes if w in e.group.scratch)
        if self.cursor == len(self.entries):
            self.cursor = 0
            self._end_step()
        return report

    def finish_step(self) -> list[LaunchReport]:
        """Run the rest of the current step (all of it at a boundary)."""
        out = [self.run_next()]
        while self.cursor != 0:
            out.append(self.run_next())
        return out

    def next_token(self) -> int:
        return int(self.array("next_token")[0])

    def logits(self) -> np.ndarray:
        return np.asarray(self.array("logits"), np.float32)

    def kv_positions(self, pool: str, layer: int) -> np.ndarray:
        """K or V of one layer for positions 0 … seq_len-1, fp16 [seq_len, Hkv, Dh], through
        the block table (what the attention reads)."""
        from ..reference import gather_pages

        seq_len = self.seq_len()
        return gather_pages(self.array(f"{pool}[{layer}]"), self.array("block_table"), seq_len)

    def seq_len(self) -> int:
        """Positions the cache holds: the state's seq_len at a step's attention, else pos."""
        state = self.array("state")
        return int(state[2]) if self.cursor > 0 and self._past_kv_write() else int(state[0])

    def _past_kv_write(self) -> bool:
        # Once the first QKV launch of this step ran, position pos is in the cache too.
        for e in self.entries[:self.cursor]:
            if any(w.startswith("k_cache") for w in e.spec.writes):
                return True
        return False

    def opens_page_next(self) -> bool:
        """Whether the next step to start takes a new page (position % 16 == 0 on an ordinary run)."""
        return self.pos // PAGE_TOKENS >= len(self.block_table_host())

    def block_table_host(self) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        pass
