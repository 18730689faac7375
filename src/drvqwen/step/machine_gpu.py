"""The decode step on the GPU, launch by launch: the engine's own objects, nothing new below them.

    DecodeStep (decode.py)      the weights, the KV cache, the activations, the sequence and the
                                built launch list (greedy: lm_head → argmax → advance_state); each launch is
                                run eagerly, alone, behind a `gpu_sleep` hold so that its event
                                pair brackets the kernel and not the host's launch latency
                                (as DecodeStep.time_kernels does)
    Prefill (prefill.py)        the prompt in batched kernels, leaving the state at its end
    GraphDecoder (graphs.py)    the two graph execs, captured on first use (`graph`, `gen`)

Buffers are read back with DeviceArray.download on the step's stream; weights are read from the
`.nanoqwen` file the GPU's copy was uploaded from (the same bytes), INT4 dequantized once.
"""

from __future__ import annotations

import numpy as np

from ..decode import DecodeStep
from ..format.nanoqwen import NanoqwenFile
from ..kv_cache import PAGE_TOKENS
from ..launchers import GpuSleep
from ..prefill import Prefill
from ..reference_steps import groups_of
from .machine import LaunchEntry, Machine
from .machine_cpu import FileWeights

# The hold queued before a timed launch: long enough for the host to queue the event pair and
# the launch behind it (a few tens of µs), so that the GPU runs them back to back.
HOLD_MS = 2.0
# Prompt rows per prefill chunk (prefill.py's default).
CHUNK_ROWS = 512


class GpuMachine(Machine):
    """The step on the GPU (see the module doc).

    Args:
        f: the model file.
        max_context: tokens the KV cache holds.
        progress: weight upload progress (bytes_done, bytes_total).
    Raises:
        DrvqwenError: no usable GPU, or the model and its cache do not fit.
    """

    device = "cuda"
    compares = True
    dtype = np.float64          # comparisons in float64, as the kernel tests make them

    def __init__(self, f: NanoqwenFile, max_context: int, progress=None) -> None:
        from ..cuda import Event

        self.file = f
        # One attention at every length: the entries below are the step's launches, fixed here,
        # and the short-context twin (decode.default_short_attention) has one launch where the
        # default attention has two. So the REPL walks the two-launch attention throughout.
        self.dec = DecodeStep(f, max_context, progress=progress, short_attention=None)
        self.config, self.plan, self.max_context = self.dec.config, self.dec.plan, self.dec.max_context
        self.prefill = Prefill(self.dec, CHUNK_ROWS)
        self.weights = FileWeights(f)
        self.graphs = None
        info = self.dec.device.info
        self.label = f"cuda ({info.name}, {info.sm_count} SMs)"
        self._hold = GpuSleep(HOLD_MS, stream=self.dec.stream)
        self._events = (Event(), Event())
        super().__init__(groups_of(self.dec.launchers))
        self._launches = [nl.launch for nl in self.dec.launches]
        assert [nl.name for nl in self.dec.launches] == [e.name for e in self.entries]

    # ---- buffers -----------------------------------------------------------------------------
    def array(self, buf) -> np.ndarray:
        name = getattr(buf, "name", buf)
        dec = self.dec
        if name in dec.buf:
            return dec.buf[name].download(dec.stream)
        if name in ("k_cache", "v_cache"):
            return (dec.kv.k if name == "k_cache" else dec.kv.v).download(dec.stream)
        if name.endswith("]") and name.split("[")[0] in ("k_cache", "v_cache"):
            pool, layer = name.rstrip("]").split("[")
            return dec.kv.layer_view(pool, int(layer)).download(dec.stream)
        if self.weights.has(name):
            return self.weights.weight(name)
        raise KeyError(name)

    @property
    def pos(self) -> int:
        return self.dec.seq.pos

    def block_table_host(self) -> list[int]:
        return self.dec.seq.pages.block_table

    # ---- the step ----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        seq = self.dec.seq
        new = seq.pages.opens_page(seq.pos)
        seq.reserve(seq.pos + 1)         # the page of this position, in the device block table
        self.opened_page = seq.pages.block_table[seq.pos // PAGE_TOKENS] if new else None

    def _end_step(self) -> None:
        self.dec.seq.advance()

    def _launch(self, e: LaunchEntry) -> float:
        e0, e1 = self._events
        stream = self.dec.stream
        self._hold.launch()
        e0.record(stream)
        self._launches[e.index].launch()
        e1.record(stream)
        return e0.elapsed_ms(e1) * 1e3

    # ---- a sequence ---------------------------------------------------------------------------
    def start(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Prefill `ids` from position 0 (batched kernels, the greedy choice of token 0); return
        the last position's logits fp32 [V] and token 0. The next step decodes token 0 at T.

        Raises:
            DrvqwenError: an empty prompt, a bad id, or a prompt beyond max_context.
        """
        self.reset()
        self.prefill.run(list(ids))
        return self.dec.logits(), self.dec.next_token()

    def graph_decoder(self):
        """The GraphDecoder over this step, captured on first use."""
        if self.graphs is None:
            from ..graphs import GraphDecoder

            self.dec.sync()
            self.graphs = GraphDecoder(self.dec)
        return self.graphs

    def gen_step(self) -> tuple[int, str]:
        """One whole step replayed from its graph; returns (token, "decode" or "opens_page")."""
        label = self.graph_decoder().decode_token()
        return self.dec.next_token(), label

    def reset(self) -> None:
        """Forget the sequence (pages back to the free list; the next prompt starts at 0)."""
        self.dec.sync()
        self.dec.seq.reset()
        self.cursor = 0
        self._pending = None
        self.last_expected.clear()

    def close(self) -> None:
        """Graphs first (they replay the step's buffers), then the prefill and the step."""
        self.dec.sync()
        if self.graphs is not None:
            self.graphs.close()
        for e in self._events:
            e.close()
        self.prefill.close()
        self.dec.close()
