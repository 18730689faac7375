"""The decode step on the CPU: the plan's launch list run by its numpy references.

The plan is made without a GPU (`plan_decode` with a fixed occupancy: an H200's 132 SMs and two
resident blocks per SM, so the grids `list` shows are the ones an H200 would run); every
buffer of the plan is a numpy array of the planned shape and dtype, the K/V pools included
(fp16, NaN where nothing was written), and each launch group is run by its reference
(reference_steps.py), which writes what the kernels write — rounded to the buffer's dtype, as
the GPU stores it. The split-KV partials are the kernel's own scratch: the CPU does not model
them (they stay NaN), and computes the attention output directly.

The prompt goes through the same decode step one token at a time (feeding each prompt token as
the step's input), so that the cache holds exactly what this step list writes. The position,
the pages and the block table change only through a `Sequence` (sequence.py), the one the GPU's
decode step uses, over the numpy state and block table (`HostArray`).
"""

from __future__ import annotations

import time

import numpy as np

from ..decode import DEFAULT_ATTENTION, plan_decode
from ..errors import DrvqwenError
from ..format import quant
from ..format.nanoqwen import NanoqwenFile
from ..kv_cache import PageAllocator
from ..launchers import FixedOccupancy
from ..reference import rope_inv_freq
from ..reference_steps import groups_of
from ..sequence import Sequence
from .machine import LaunchEntry, Machine

# The occupancy a CPU plan is made with: an H200 (132 SMs), two resident blocks of every kernel.
H200_SMS = 132
PLANNED_BLOCKS_PER_SM = 2


class HostArray:
    """A numpy array behind DeviceArray's two upload calls, so that a `Sequence` can own the CPU
    machine's state and block table as it owns the GPU's (the copies are immediate)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def upload(self, values: np.ndarray) -> None:
        self.array[...] = np.asarray(values, self.array.dtype).reshape(self.array.shape)

    def upload_at(self, start: int, values: np.ndarray, stream=None) -> None:
        values = np.asarray(values, self.array.dtype).reshape(-1)
        if start < 0 or start + values.size > self.array.size:
            raise ValueError(f"elements [{start}, {start + values.size}) outside {list(self.array.shape)}")
        self.array[start:start + values.size] = values


class FileWeights:
    """Weights read from the `.nanoqwen` file, quantized ones (INT4, or a per-tensor format)
    dequantized once and kept."""

    def __init__(self, f: NanoqwenFile) -> None:
        self.file = f
        self._deq: dict[str, np.ndarray] = {}

    def weight(self, name: str) -> np.ndarray:
        return self.file.tensor(name)

    def int4(self, qweight, scales) -> np.ndarray:
        qn, sn = getattr(qweight, "name", qweight), getattr(scales, "name", scales)
        if qn not in self._deq:
            self._deq[qn] = quant.dequantize(np.asarray(self.file.tensor(qn)), np.asarray(self.file.tensor(sn)),
                                             np.float32)
        return self._deq[qn]

    def dense(self, weight) -> np.ndarray:
        name = getattr(weight, "name", weight)
        if name not in self._deq:
            self._deq[name] = np.asarray(self.file.tensor(name), np.float32)
        return self._deq[name]

    def quantized(self, qweight) -> np.ndarray:
        """The matrix behind a per-tensor kernel's weight: its `.qweight` part (dequantized in its
        format) or, for a dense FP16 projection, its `.weight` (converted)."""
        name = getattr(qweight, "name", qweight)
        if name not in self._deq:
            prefix = name[:-len(".qweight")] if name.endswith(".qweight") else name[:-len(".weight")]
            self._deq[name] = self.file.weight(prefix, np.float32)
        return self._deq[name]

    def has(self, name: str) -> bool:
        return name in self.file.tensors


class CpuMachine(Machine):
    """The step on the CPU (see the module doc).

    Args:
        f: the model file.
        max_context: tokens the KV cache holds.
        attention: the decode attention kernel the plan uses ("tma", the default, or "plain").
    Attributes:
        compares: False: the buffers are the reference's own output. Tests set it (and dtype
            to float64) to run the GPU's comparison path on the CPU's buffers.
    Raises:
        DrvqwenError: max_context out of range.
    """

    device = "cpu"
    compares = False
    dtype = np.float32          # as the CPU backend computes

    def __init__(self, f: NanoqwenFile, max_context: int, attention: str = DEFAULT_ATTENTION) -> None:
        cfg = f.config
        self.config = cfg
        occ = FixedOccupancy(H200_SMS, lambda _k, _t, _s: PLANNED_BLOCKS_PER_SM)
        self.plan = plan_decode(cfg, max_context, attention=attention, occupancy=occ, text_vocab=f.text_vocab,
                                formats=f.formats)
        self.max_context = self.plan.max_context
        self.weights = FileWeights(f)
        self.label = (f"cpu (numpy reference; grids planned for an H200: {H200_SMS} SMs, "
                      f"{PLANNED_BLOCKS_PER_SM} blocks per SM)")
        self.buf: dict[str, np.ndarray] = {}
        for name, b in self.plan.buffers.items():
            fill = np.nan if np.issubdtype(b.dtype, np.floating) else 0
            self.buf[name] = np.full(b.shape, fill, b.dtype)
        self.buf["inv_freq"][:] = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        self.pools = {p: np.full(b.shape, np.nan, np.float16) for p, b in self.plan.kv.items()}
        self.seq = Sequence(PageAllocator(self.plan.n_pages), HostArray(self.buf["state"]),
                            HostArray(self.buf["block_table"]), self.max_context)
        super().__init__(groups_of(self.plan.steps))

    # ---- buffers ---------------------------------------------------------------------------
    def array(self, buf) -> np.ndarray:
        name = getattr(buf, "name", buf)
        if name in self.buf:
            return self.buf[name]
        if name in self.pools:
            return self.pools[name]
        if name.endswith("]") and name.split("[")[0] in self.pools:
            pool, layer = name.rstrip("]").split("[")
            return self.pools[pool][int(layer)]
        if self.weights.has(name):
            return self.weights.weight(name)
        raise KeyError(name)

    @property
    def pos(self) -> int:
        return self.seq.pos

    def block_table_host(self) -> list[int]:
        return self.seq.pages.block_table

    # ---- the step ----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self.opened_page = self.seq.open_page()
        if self.opened_page is not None:
            self.seq.write_block_table_entry(self.opened_page)

    def _end_step(self) -> None:
        self.seq.advance()

    def _launch(self, e: LaunchEntry) -> float:
        t0 = time.perf_counter()
        if e.last:
            for x in self._pending or ():
                dst = self.array(x.name)
                vals = np.asarray(x.values).astype(dst.dtype)
                if x.where is None:
                    dst[...] = vals.reshape(dst.shape)
                else:
                    dst[x.where] = vals
        us = (time.perf_counter() - t0) * 1e6
        return us + (self._pending_us if e.first else 0.0)

    # ---- a sequence ---------------------------------------------------------------------------
    def start(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Run the prompt `ids` through the step from position 0, one token per step; return the
        last position's logits fp32 [V] and the chosen token 0 (greedy). The state is then
        (T, token 0, T + 1): the next step decodes token 0 at position T.

        Raises:
            DrvqwenError: the prompt does not fit max_context.
        """
        if len(ids) >= self.max_context:
            raise DrvqwenError(f"prompt of {len(ids)} tokens does not fit --max-context {self.max_context}")
        self.reset()
        self.seq.start(ids[0])
        for i in range(len(ids)):
            if i > 0:
                self.seq.feed(ids[i])
            self.finish_step()
        return self.logits().copy(), self.next_token()

    def gen_step(self) -> tuple[int, str | None]:
        """One whole step (no comparisons to make on the CPU); returns (token, graph it replays)."""
        graph = "opens_page" if self.opens_page_next() else "decode"
        self.finish_step()
        return self.next_token(), graph

    def reset(self) -> None:
        """Forget the sequence: pages back to the free list, cache and activations NaN again."""
        self.seq.reset()
        for a in self.pools.values():
            a.fill(np.nan)
        for name, a in self.buf.items():
            if name != "inv_freq":
                a.fill(np.nan if np.issubdtype(a.dtype, np.floating) else 0)
        self.cursor = 0
        self._pending = None
        self.last_expected.clear()
