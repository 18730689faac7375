"""The statistics of one `drvqwen run`: the stats line, the `--verbose` phases, `--json-stats`.

Every figure is a wall-clock interval on the host's monotonic clock (time.perf_counter):

    read       resolve the model: find or convert it, open and validate the .nanoqwen header,
               table and config (plus the one-time CRC check when it runs: `verify`)
    load       read + validate + upload to the GPU (or dequantize to float32 on the CPU)
    prompt     prompt tokens, of which `reused` came from the KV cache and were not prefilled
    TTFT       the prompt submitted to the backend → the first token chosen (prefill included)
    prompt-eval  prefilled tokens / TTFT, in tok/s
    decode     tokens after the first / (last token − first token), in tok/s
    total      the command's start → the last token printed

The definitions of TTFT and decode tok/s are generate.GenerationResult's, the ones every figure
in drvqwen quotes; `drvqwen bench` measures the same on the GPU with events.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DrvqwenError


@dataclass
class RunStats:
    """Phase timings of one run, in seconds (`phases`, in order), plus what the run did.

    Attributes:
        t_start: perf_counter() when the command started.
        phases: phase name → seconds (read, verify, tokenize, load, generate).
        backend: the backend's name ("cpu (numpy reference)", "cuda (NVIDIA H200), graph decode").
        seed: the sampler's seed when sampling, else None.
    """

    t_start: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    backend: str = ""
    seed: int | None = None
    total_s: float = 0.0

    def timed(self, phase: str):
        """A context manager adding the time spent inside it to `phases[phase]`."""
        stats = self

        class _Timer:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                stats.phases[phase] = stats.phases.get(phase, 0.0) + time.perf_counter() - self.t0

        return _Timer()

    @property
    def load_s(self) -> float:
        """read + validate + verify + upload/dequantize."""
        return sum(self.phases.get(p, 0.0) for p in ("read", "verify", "load"))

    def finish(self) -> None:
        self.total_s = time.perf_counter() - self.t_start

    def line(self, res) -> str:
        """The stats line: backend, load, the generation's summary, total wall time."""
        return f"{self.backend}: load {self.load_s:.2f} s, {res.summary()}, total {self.total_s:.2f} s"

    def verbose_lines(self, res) -> list[str]:
        """One line per phase (`--verbose`)."""
        names = {"read": "read + validate the model", "verify": "check tensor CRC32s (once per file)",
                 "tokenize": "load the tokenizer, tokenize the prompt", "load": "upload / dequantize the weights",
                 "generate": "prefill + decode"}
        order = [k for k in names if k in self.phases] + [k for k in self.phases if k not in names]
        out = [f"{names.get(k, k):<38} {self.phases[k] * 1e3:10.1f} ms" for k in order]
        if res is not None and (res.tokens or res.stopped_by == "stop token"):
            out.append(f"{'prefill ' + str(res.prefill_tokens) + ' tokens + first token (TTFT)':<38} "
                       f"{res.ttft_s * 1e3:10.1f} ms")
            if len(res.tokens) >= 2:
                out.append(f"{'decode ' + str(len(res.tokens) - 1) + ' tokens':<38} {res.decode_s * 1e3:10.1f} ms")
        return out

    def to_dict(self, res) -> dict:
        """The JSON of `--json-stats` (times in seconds; rates in tok/s, null when unmeasured)."""
        def num(x):
            return None if x != x else round(float(x), 6)       # NaN → null

        timed = res is not None and (bool(res.tokens) or res.stopped_by == "stop token")
        return {
            "backend": self.backend, "seed": self.seed,
            "load_s": num(self.load_s), "phases_s": {k: num(v) for k, v in self.phases.items()},
            "prompt_tokens": res.prompt_tokens if res else 0,
            "reused_tokens": res.reused_tokens if res else 0,
            "generated_tokens": len(res.tokens) if res else 0,
            "stopped_by": res.stopped_by if res else None,
            "ttft_s": num(res.ttft_s) if timed else None,
            "prompt_tok_s": num(res.prompt_tok_s) if timed else None,
            "decode_tok_s": num(res.decode_tok_s) if res else None,
            "total_s": num(self.total_s),
        }


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write `data` as JSON to `path` through a temporary file in the same folder and a rename,
    so a reader sees the old file or the whole new one, never half of it.

    Raises:
        DrvqwenError: the folder does not exist or cannot be written (names the path).
    """
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise DrvqwenError(f"{p}: cannot write the stats ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
