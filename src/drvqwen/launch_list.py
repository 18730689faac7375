"""One decode step's launches as a list: the named launches (`NamedLaunch`) of a step's
(name, launcher) entries, and `LaunchList`, the built list for one way of choosing the token —
what eager mode runs launch by launch and a CUDA graph captures (graphs.py). decode.py plans and
builds them; the prefill (prefill.py) runs a list's sampler step after its own final norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cuda import KernelLaunch
from .launchers import Launcher
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
    """

    name: str
    launchers: list[tuple[str, Launcher]]
    launches: list[NamedLaunch] = field(init=False)

    def __post_init__(self) -> None:
        self.launches = named_launches(self.launchers)

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
