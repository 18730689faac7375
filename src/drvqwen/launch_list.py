"""One decode step's launches as a list: the named launches (`NamedLaunch`) of a step's
(name, launcher) entries, and `LaunchList`, the built list for one way of choosing the token —
what eager mode runs launch by launch and a CUDA graph captures (graphs.py). decode.py plans and
builds them; the prefill (prefill.py) runs a list's sampler step after its own final norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collections.abc import Callable

import numpy as np

from .cuda import Event, KernelLaunch, Stream
from .launchers import GpuSleep, Launcher
from .launchers.base import LaunchSpec


@dataclass
class NamedLaunch:
    """One entry of the decode step: a name, the pre-packed launch, and what it was planned as.

    Attributes:
        name: e.g. "L3.qkv_proj" (a launcher of two kernels gets ".0", ".1").
        launch: the KernelLaunch.
        spec: the LaunchSpec it was built from (kernel, grid, buffers read and written).
    """

    name: str
    launch: KernelLaunch
    spec: LaunchSpec | None = None

    @property
    def writes(self) -> tuple[str, ...]:
        """Names of every buffer the launch writes."""
        return self.spec.writes if self.spec is not None else ()


def named_launches(steps: list[tuple[str, Launcher]]) -> list[NamedLaunch]:
    """One NamedLaunch per built kernel launch of `steps` (a launcher of several launches gives
    name.0, name.1, …)."""
    out = []
    for name, launcher in steps:
        for i, (ln, spec) in enumerate(zip(launcher.launches, launcher.specs)):
            out.append(NamedLaunch(name if len(launcher.launches) == 1 else f"{name}.{i}", ln, spec))
    return out


@dataclass
class LaunchList:
    """One decode step's built launch list for one way of choosing the token.

    Attributes:
        name: "greedy" (the plan's argmax), or the engine's name of a sampler variant.
        launchers: (name, launcher) in order, from "embedding" to "advance_state".
        launches: one NamedLaunch per kernel launch, in order (what eager mode runs and a
            CUDA graph captures).
        short: the same step with the short-context attention in place of each layer's (the
            decode step's short_attention; None: one list for every length), used for the steps
            whose attention covers at most `short_below` positions (`for_length`). It may have a
            `short` of its own, for still shorter contexts: the step's bands, outermost first
            (`chain`).
        short_below: the longest attention length (positions, the step's own included) that
            runs `short`.
    """

    name: str
    launchers: list[tuple[str, Launcher]]
    short: LaunchList | None = None
    short_below: int = 0
    launches: list[NamedLaunch] = field(init=False)

    def __post_init__(self) -> None:
        self.launches = named_launches(self.launchers)

    def for_length(self, seq_len: int) -> LaunchList:
        """The list a step whose attention covers `seq_len` positions runs: `short`'s choice up
        to short_below positions (its own `short` for shorter ones still), else this one."""
        if self.short is not None and seq_len <= self.short_below:
            return self.short.for_length(seq_len)
        return self

    def chain(self) -> list[LaunchList]:
        """This list and its short-context twins, outermost first: [self, self.short,
        self.short.short, …]."""
        out = [self]
        while out[-1].short is not None:
            out.append(out[-1].short)
        return out

    def index(self, name: str) -> int:
        """Position of the step entry `name` in `launchers`.

        Raises:
            KeyError: no entry of that name.
        """
        for i, (n, _l) in enumerate(self.launchers):
            if n == name:
                return i
        raise KeyError(name)

    def sampler_step(self) -> list[Launcher]:
        """The launchers from "lm_head" up to (not including) "advance_state": logits, the token
        choice and its publishing. The prefill runs them after its own final norm (prefill.py)."""
        return [l for _n, l in self.launchers[self.index("lm_head"):self.index("advance_state")]]


def time_launches(launches: list[NamedLaunch], stream: Stream, n_reps: int, *, before: Callable[[], None],
                  after: Callable[[], None], hold_ms: float = 20.0) -> dict[str, float]:
    """Median GPU time in µs of each launch of `launches` over n_reps eager runs of the list.

    Each run is `before()`, then the list queued behind `gpu_sleep(hold_ms)` (kernels/timing.cu)
    with an event pair around every launch, then a wait and `after()`. Held back by the sleep,
    the host has enqueued every launch and its events before the GPU starts: the kernels then run
    back to back and each event pair brackets the kernel alone, not the host's launch latency.
    Each figure still includes the event pair's own cost (~2 µs on the H200).

    Args:
        before: what a run needs first (a page opened, the ids uploaded); may copy synchronously.
        after: what undoes or advances the run's effect on the sequence (called after the wait).
    Returns:
        {launch name: median µs}, in the list's order.
    """
    hold = GpuSleep(hold_ms, stream=stream)
    ev = [(Event(), Event()) for _ in launches]
    times: dict[str, list[float]] = {nl.name: [] for nl in launches}
    try:
        for _ in range(n_reps):
            before()
            hold.launch()
            for (e0, e1), nl in zip(ev, launches):
                e0.record(stream)
                nl.launch.launch()
                e1.record(stream)
            stream.synchronize()
            after()
            for (e0, e1), nl in zip(ev, launches):
                times[nl.name].append(e0.elapsed_ms(e1) * 1e3)
    finally:
        for e0, e1 in ev:
            e0.close()
            e1.close()
    return {k: float(np.median(v)) for k, v in times.items()}
