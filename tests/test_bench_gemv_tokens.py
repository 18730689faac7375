"""tools/bench_gemv.py --tokens on the CPU: the argument, the rows it plans (names, buffers, launch
shapes as the launchers give them for T), the --int4-defines builds reaching the T-token kernels,
and the timing probes of gemv_int4.cu (GEMV_PROBE_*) compiling without spills, in the T-token
kernels only."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from drvqwen.config import PRESETS
from drvqwen.launchers import BufferSpec
from helpers import load_tool
from test_kernel_gemv_int4_tokens import OCCUPANCY, _plans

PROBES = ("GEMV_PROBE_NO_NORM", "GEMV_PROBE_NO_EPILOGUE")
# The kernels each probe changes: the RMSNorm prologue is in the two kernels that normalise.
PROBED = {"GEMV_PROBE_NO_NORM": {"gemv_int4_qkv_rope_tokens", "gemv_int4_gate_up_swiglu_tokens"},
          "GEMV_PROBE_NO_EPILOGUE": {"gemv_int4_qkv_rope_tokens", "gemv_int4_gate_up_swiglu_tokens",
                                     "gemv_int4_residual_tokens", "gemv_int4_qkv_rope_x_tokens",
                                     "gemv_int4_gate_up_swiglu_x_tokens"}}
# bench_gemv's GEMVs → the keys of _plans (one layer's launchers built directly).
PLAN_KEY = {"qkv_proj": "qkv", "o_proj": "o_proj", "gate_up_swiglu": "gate_up", "down_proj": "down"}


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_gemv")


class SpecScratch:
    """bench_gemv.Scratch without a GPU: BufferSpecs, the host contents kept by name."""

    def __init__(self):
        self.host = {}

    def array(self, name, shape, dtype, host=None):
        if host is not None:
            self.host[name] = np.asarray(host)
        return BufferSpec(name, shape, dtype)


def test_tokens_default_and_range(bench):
    assert bench.parse_args([]).tokens is None
    assert bench.parse_args(["--tokens"]).tokens == [1, 2, 4, 8, 16]
    assert bench.parse_args(["--tokens", "1", "16", "--pdl"]).tokens == [1, 16]


@pytest.mark.parametrize("t", ["0", "17", "-3"])
def test_tokens_out_of_range_refused_in_one_line(bench, t):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--tokens", "8", t])
    assert str(e.value) == f"--tokens: T={t} is outside 1..16"


def test_tokens_not_with_formats(bench):
    with pytest.raises(SystemExit, match="does not go with --formats"):
        bench.parse_args(["--tokens", "8", "--formats", "all"])


def test_rows_planned(bench):
    assert bench.plan_rows(["qkv_proj", "down_proj"], [1, 8]) == [
        ("qkv_proj", "qkv_proj", None), ("down_proj", "down_proj", None),
        ("qkv_rope T=1", "qkv_proj", 1), ("down_proj T=1", "down_proj", 1),
        ("qkv_rope T=8", "qkv_proj", 8), ("down_proj T=8", "down_proj", 8)]
    assert bench.plan_rows(["o_proj"], []) == [("o_proj", "o_proj", None)]


@pytest.mark.parametrize("t", [1, 3, 8, 16])
def test_tokens_launch_is_the_launchers(bench, t):
    """Each GEMV of a --tokens row runs the `…_tokens` kernel in the launch shape the launchers
    give for T (grid, block, shared memory, n_tokens), buffers [T, …], the K/V cache and block
    table covering positions 512 … 512 + T − 1."""
    cfg = PRESETS["7b"]
    want = _plans(cfg, t)
    rng = np.random.default_rng(0)
    for name, key in PLAN_KEY.items():
        s = SpecScratch()
        spec = bench.make_launcher(name, s, 0, cfg, rng, t, occupancy=OCCUPANCY).specs[0]
        one = want[key].specs[0]
        assert spec.kernel == one.kernel and spec.kernel.kernel.endswith("_tokens"), name
        assert (spec.grid, spec.block, spec.smem_bytes) == (one.grid, one.block, one.smem_bytes), name
        assert spec.args["n_tokens"].value == t, name
    pages = (512 + t - 1) // 16 + 1
    s = SpecScratch()
    qkv = bench.make_launcher("qkv_proj", s, 0, cfg, rng, t, occupancy=OCCUPANCY).specs[0]
    assert list(s.host["state0"]) == [512, 0, 513]
    assert list(s.host["bt0"]) == list(range(pages))
    assert qkv.args["k_cache"].shape[0] == pages and qkv.args["q_out"].shape == (t, cfg.q_dim)


def test_single_token_rows_unchanged(bench):
    cfg = PRESETS["0.5b"]
    want = _plans(cfg, None)
    for name, key in PLAN_KEY.items():
        spec = bench.make_launcher(name, SpecScratch(), 0, cfg, np.random.default_rng(0), occupancy=OCCUPANCY).specs[0]
        assert spec.kernel == want[key].specs[0].kernel and "n_tokens" not in spec.args, name


@pytest.mark.parametrize("t", [8, 16])
@pytest.mark.parametrize("probe", PROBES)
def test_probe_defines_reach_the_tokens_kernels(bench, probe, t):
    cfg = PRESETS["0.5b"]
    build = {"GEMV_TOKENS": 16} if t > 8 else {}
    for name in PLAN_KEY:
        spec = bench.make_launcher(name, SpecScratch(), 0, cfg, np.random.default_rng(0), t, occupancy=OCCUPANCY,
                                   defines=tuple(bench.parse_defines(f"{probe}=1", "--int4-defines").items())).specs[0]
        assert spec.kernel.kernel.endswith("_tokens") and dict(spec.kernel.defines) == {probe: 1, **build}, name


def _text_sections(cubin: bytes) -> dict[str, bytes]:
    """{kernel: its SASS, the bytes of section .text.<kernel>} of an ELF64 cubin (without the line
    info, which moves with any edit of the source)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]

    def name(off: int) -> str:
        return cubin[names + off:cubin.index(b"\0", names + off)].decode()

    return {name(s[0])[len(".text."):]: cubin[s[4]:s[4] + s[5]] for s in sections if name(s[0]).startswith(".text.")}


@pytest.mark.parametrize("tokens", [8, 16])
@pytest.mark.parametrize("probe", PROBES)
def test_probe_builds_compile_and_touch_only_the_tokens_kernels(probe, tokens):
    """Each probe build compiles without spills; only the T-token kernels the probe is about
    differ from the default build's SASS (the single-token kernels never see a probe)."""
    from drvqwen.cuda.nvrtc import compile_kernel

    build = {} if tokens == 8 else {"GEMV_TOKENS": 16}
    ck = compile_kernel("gemv_int4", defines={**build, probe: 1})
    assert not [r.function for r in ck.resources.values() if r.spills]
    got, ref = _text_sections(ck.cubin), _text_sections(compile_kernel("gemv_int4", defines=build).cubin)
    assert sorted(got) == sorted(ref) and len(ref) == 9
    for kernel in ref:
        assert (got[kernel] != ref[kernel]) == (kernel in PROBED[probe]), kernel


def test_main_times_every_planned_row(bench, monkeypatch, tmp_path):
    """main() without a GPU (timing, device and buffers stubbed): the --tokens rows follow the
    single-token ones in the JSON, with the --int4-defines builds but not --warps."""
    import drvqwen.launchers.gemv_int4 as gemv_int4

    class Scratch(SpecScratch):
        def close(self):
            pass

    dev = SimpleNamespace(info=SimpleNamespace(summary=lambda: "cpu", name="cpu"), synchronize=lambda: None)
    monkeypatch.setattr(gemv_int4, "DEFAULT_OCCUPANCY", OCCUPANCY)
    monkeypatch.setattr(bench, "Scratch", Scratch)
    monkeypatch.setattr(bench, "get_device", lambda: dev)
    monkeypatch.setattr(bench, "measure_copy_bandwidth", lambda: SimpleNamespace(gbps=4000.0))
    monkeypatch.setattr(bench, "source_record", lambda: {})
    monkeypatch.setattr(bench, "time_launchers", lambda launchers, reps, pdl: 10.0)
    out = tmp_path / "rows.json"
    monkeypatch.setattr("sys.argv", ["bench_gemv.py", "--preset", "0.5b", "--gemv", "qkv_proj", "down_proj", "--pdl",
                                     "--warps", "4", "--int4-defines", "GEMV_PROBE_NO_NORM=1", "--tokens", "1", "8",
                                     "--json", str(out)])
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    names = [(r["gemv"], r["tokens"], r["pdl"], r["variant"]) for r in rows]
    probe = {"defines": {"GEMV_PROBE_NO_NORM": 1}}
    single = [(g, None, p, v) for g in ("qkv_proj", "down_proj") for v in ({}, {"warps": 4}, probe) for p in (False, True)]
    tokens = [(f"{g} T={t}", t, p, v) for t in (1, 8) for g in ("qkv_rope", "down_proj") for v in ({}, probe)
              for p in (False, True)]
    assert names == single + tokens
