"""The prefill GEMM's versions (kernels/dev/gemm_int4/) for tools/dev_kernels.py: how each is
launched, what it is checked on, how it is timed.

Every version has production's four kernels (gemm_int4_f32, _qkv, _residual, _gate_up_swiglu,
kernels/gemm_int4.cu) with the same outputs. The runner builds production's launcher
(launchers/gemm_int4.py: argument checks, the tensor map of x, the grid) and points it at the
version's file; v1, v2 and v6 also get their own launch shape (LAUNCH_SHAPES).

Weights: production reads INT4 weights in the device layout (format/int4_tiles.py; q, k and v
RoPE-paired by the head dim, which gemm_int4_qkv takes as Dh). Every version computes its
weight addresses itself, row-major (`qweight + row · K/8`: layout id 1 as the file stores it), and
its qkv kernel has no Dh; so the versions get the same words in layout id 1, in a buffer of the
device layout's size (the size production's launcher checks, the words past N·K/8 zero).

Checks (the cases of tests/test_kernel_gemm_int4.py): x fp16 [capacity, K] with the rows past M
NaN, outputs poisoned past M and checked untouched there, against x·Wᵀ in float64 on the
dequantized weights; at M = 1, 16, 17, 100, 300 with N past the 128-row blocks, and at the 7B and
0.5B layers' four GEMMs at M = 512, the shapes the versions are timed at (graph replay of --reps
calls, median of --samples, as tools/bench_gemm.py; 28 (24) layers = 28 (24) × the four).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from dev_kernels import Outcome, Version, retarget
from drvqwen.launchers.base import NULL

VERSIONS = [
    Version("production", "gemm_int4"),
    Version("v1_mma_sync", "dev/gemm_int4/v1_mma_sync"),
    Version("v2_wgmma_cluster2", "dev/gemm_int4/v2_wgmma_cluster2"),
    Version("v2_wgmma_cluster2[GEMM_CLUSTER=1]", "dev/gemm_int4/v2_wgmma_cluster2", (("GEMM_CLUSTER", 1),)),
    Version("v3_syncwarp_release", "dev/gemm_int4/v3_syncwarp_release"),
    Version("v4_late_full_arrival", "dev/gemm_int4/v4_late_full_arrival"),
    Version("v5_every_lane_release", "dev/gemm_int4/v5_every_lane_release"),
    Version("v6_n256_setmaxnreg", "dev/gemm_int4/v6_n256_setmaxnreg"),
    Version("v6_n256_setmaxnreg[GEMM_BM=128]", "dev/gemm_int4/v6_n256_setmaxnreg", (("GEMM_BM", 128),)),
    Version("v6_n256_setmaxnreg[GEMM_BM=64]", "dev/gemm_int4/v6_n256_setmaxnreg", (("GEMM_BM", 64),)),
    Version("v6_n256_setmaxnreg[GEMM_BM=128,GEMM_A_SMEM=1]", "dev/gemm_int4/v6_n256_setmaxnreg",
            (("GEMM_BM", 128), ("GEMM_A_SMEM", 1))),
]

# The launch shapes that differ from production's (kernels/gemm_int4.cu, launchers/gemm_int4.py).
V1_BM, V1_THREADS, V1_SMEM_BYTES = 64, 128, 4 * (64 * 256 + 128 * 64)       # 96 KiB: 4 stages of A | W
V2_BM, V2_SMEM_BYTES = 128, 4 * 32 * 1024 + 1024 + 2 * 4 * 8                 # 4 stages of X + barriers
# v2–v5: 128-token tiles in a block of 9 warps (two consumer warpgroups and a producer warp), 4
# stages of 40 KiB + barriers: the production form before the producer warpgroup and setmaxnreg.
V3_THREADS, V3_SMEM_BYTES = 288, 4 * (128 * 128 * 2 + 128 * 64) + 1024 + 3 * 4 * 8
# v6: 256 tokens a tile (GEMM_BM=128, 64: fewer), 12 warps, 3 stages of (64 KiB of X + 8 KiB of
# weights) + barriers (4 stages at 128 and 64 tokens); GEMM_A_SMEM=1 adds two 16 KiB A buffers
# per consumer warpgroup.
V6_BM, V6_THREADS = 256, 384


def v6_stages(bm: int) -> int:
    return 3 if bm == 256 else 4


def v6_smem_bytes(bm: int, a_smem: bool = False) -> int:
    return (v6_stages(bm) * (bm * 128 * 2 + 128 * 64) + (2 * 2 * 16384 if a_smem else 0) + 1024
            + 3 * v6_stages(bm) * 8)


V6_SMEM_BYTES = v6_smem_bytes(V6_BM)
# (kernel file, C expression, value) for what the runner assumes of a version's file, compiled
# as static_assert lines into it by tests/dev/test_dev_kernels.py (launchers.base.mirrored's check).
DEV_CONSTANTS = [
    ("dev/gemm_int4/v1_mma_sync", "GEMM_BM", V1_BM),
    ("dev/gemm_int4/v1_mma_sync", "GEMM_THREADS", V1_THREADS),
    ("dev/gemm_int4/v1_mma_sync", "GEMM_SMEM_BYTES", V1_SMEM_BYTES),
    ("dev/gemm_int4/v1_mma_sync", "GEMM_BLOCK_TILES * INT4_TILE_ROWS", 128),  # = production's BLOCK_ROWS
    ("dev/gemm_int4/v2_wgmma_cluster2", "GEMM_BM", V2_BM),
    ("dev/gemm_int4/v2_wgmma_cluster2", "GEMM_SMEM_BYTES", V2_SMEM_BYTES),
    ("dev/gemm_int4/v2_wgmma_cluster2", "GEMM_CLUSTER", 2),
    ("dev/gemm_int4/v6_n256_setmaxnreg", "GEMM_BM", V6_BM),
    ("dev/gemm_int4/v6_n256_setmaxnreg", "GEMM_THREADS", V6_THREADS),
    ("dev/gemm_int4/v6_n256_setmaxnreg", "GEMM_SMEM_BYTES", V6_SMEM_BYTES),
    ("dev/gemm_int4/v6_n256_setmaxnreg", "GEMM_BLOCK_ROWS", 128),    # = production's BLOCK_ROWS
    ("dev/gemm_int4/v6_n256_setmaxnreg", "GEMM_BOX_INPUTS", 64),
] + [(f"dev/gemm_int4/{stem}", expr, 1) for stem in
     ("v2_wgmma_cluster2", "v3_syncwarp_release", "v4_late_full_arrival", "v5_every_lane_release")
     for expr in ("GEMM_THREADS == 288", "GEMM_BLOCK_ROWS == 128", "GEMM_BOX_INPUTS == 64",
                  "GEMM_SMEM_BYTES <= 4 * (128 * 128 * 2 + 128 * 64) + 1024 + 3 * 4 * 8")]


def _stem(v: Version) -> str:
    return v.file.rsplit("/", 1)[-1]


def _row_blocks(plain, rows: int) -> int:
    """Weight-row blocks of a production launcher built with one block per tile (max_blocks=0)."""
    return plain.specs[0].grid[0] // -(-rows // 128)


def _mma_sync_shape(v: Version, make, rows: int, x):
    """v1: grid (ceil(rows/64), row blocks), 4 warps, 96 KiB; x a plain pointer, no tensor map."""
    g = make(0)
    retarget(g, v, grid=(-(-rows // V1_BM), _row_blocks(g, rows)), block=(V1_THREADS,), smem_bytes=V1_SMEM_BYTES)
    spec = g.specs[0]
    # v1's second parameter is the activations as a plain pointer, named x (production: x_map).
    spec.args = {("x" if name == "x_map" else name): (x if name == "x_map" else value)
                 for name, value in spec.args.items()}
    return g


def _cluster_shape(v: Version, make, rows: int, x):
    """v2: one block per tile, grid (ceil(rows/128), row blocks rounded up to the cluster size)."""
    cluster = dict(v.defines).get("GEMM_CLUSTER", 2)
    g = make(0)
    rb = -(-_row_blocks(g, rows) // cluster) * cluster
    return retarget(g, v, grid=(-(-rows // V2_BM), rb), block=(V3_THREADS,), smem_bytes=V2_SMEM_BYTES)


def _nine_warp_shape(v: Version, make, rows: int, x):
    """v3–v5: production's persistent grid of 128-token tiles, in their 9-warp block."""
    return retarget(make(), v, block=(V3_THREADS,), smem_bytes=V3_SMEM_BYTES)


def _without_split_k(g):
    """The versions predate split-K and the device layout: their kernels end at (…, N, K) with no
    split_partials, split_counters, and their qkv kernel has no Dh (it reads q, k and v row-major).
    Production's launcher without a SplitKScratch plans whole tiles (both null), so dropping those
    arguments launches the same GEMM (the versions share the tiles out their own way, block b
    taking tiles b, b + grid, …)."""
    for spec in g.specs:
        assert spec.args["split_partials"] is NULL, f"{spec.kernel}: a version launched with split-K"
        for name in ("split_partials", "split_counters", "Dh"):
            spec.args.pop(name, None)
    return g


def reads_row_major(v: Version) -> bool:
    """Whether v reads its INT4 weights in layout id 1 (its own row addressing) rather than
    production's device layout: every version of kernels/dev/gemm_int4/ does."""
    return not v.is_production


def sm_count() -> int:
    """The GPU's SM count: a persistent grid's most blocks."""
    from drvqwen.cuda import get_device

    return get_device().info.sm_count


def x_map_n256(x, rows: int, k: int, bm: int = V6_BM):
    """v6's tensor map of x fp16 [rows, K]: production's with a box of bm tokens × 64 inputs."""
    from drvqwen.cuda import encode_tiled_2d
    from drvqwen.cuda.tensormap import Swizzle

    return encode_tiled_2d(x.ptr, np.float16, (rows, k), (bm, 64), swizzle=Swizzle.CU_TENSOR_MAP_SWIZZLE_128B)


def _n256_shape(v: Version, make, rows: int, x):
    """v6: a persistent grid of at most one block per SM and its tiles of GEMM_BM tokens at the
    capacity, 384 threads, its shared memory, and x's tensor map with GEMM_BM-row boxes."""
    bm = dict(v.defines).get("GEMM_BM", V6_BM)
    tiles = -(-rows // bm) * _row_blocks(make(0), rows)
    smem = v6_smem_bytes(bm, bool(dict(v.defines).get("GEMM_A_SMEM", 0)))
    g = retarget(make(), v, grid=(min(sm_count(), tiles),), block=(V6_THREADS,), smem_bytes=smem)
    for spec in g.specs:
        spec.args["x_map"] = x_map_n256(x, rows, x.shape[-1], bm)
    return g


LAUNCH_SHAPES = {"v1_mma_sync": _mma_sync_shape, "v2_wgmma_cluster2": _cluster_shape,
                 "v6_n256_setmaxnreg": _n256_shape}


def version_launcher(v: Version, make, rows: int, x):
    """Version v's launcher: production's `make(max_blocks, tile_tokens)` as it is, or its
    launcher of 128-token tiles (the versions' own tile, v6 sets its own) pointed at v's file in
    v's launch shape with the arguments v's kernels take."""
    if v.is_production:
        return make()
    shape = LAUNCH_SHAPES.get(_stem(v), _nine_warp_shape)
    return _without_split_k(shape(v, lambda *max_blocks: make(*max_blocks, tile_tokens=128), rows, x))


@dataclass(frozen=True)
class Case:
    """One GEMM: `kind` (f32, qkv, residual, gate_up) at M = m; dims n, k (qkv: nq, nkv, hd (the
    head dim), k; gate_up: f, k). `timed`: a layer GEMM of the preset `model` ("7b", "0.5b"), timed
    under this label."""

    label: str
    kind: str
    m: int
    dims: dict
    timed: bool = False
    model: str = "7b"


def cases() -> list[Case]:
    from drvqwen.config import PRESETS

    def layer(model: str, prefix: str) -> list[Case]:
        c = PRESETS[model]
        d, f, nq, nkv = c.hidden_size, c.intermediate_size, c.q_dim, c.kv_dim
        return [Case(prefix + "qkv_proj", "qkv", 512, dict(nq=nq, nkv=nkv, hd=c.head_dim, k=d), True, model),
                Case(prefix + "o_proj", "residual", 512, dict(n=d, k=nq), True, model),
                Case(prefix + "gate_up_swiglu", "gate_up", 512, dict(f=f, k=d), True, model),
                Case(prefix + "down_proj", "residual", 512, dict(n=d, k=f), True, model)]

    return [
        Case("f32 M=1 N=333 K=384", "f32", 1, dict(n=333, k=384)),
        Case("f32 M=17 N=333 K=384", "f32", 17, dict(n=333, k=384)),
        Case("f32 M=100 N=1000 K=1024", "f32", 100, dict(n=1000, k=1024)),
        Case("qkv M=100 Nq=224 Nkv=32 K=256", "qkv", 100, dict(nq=224, nkv=32, hd=32, k=256)),
        Case("residual M=300 N=333 K=384", "residual", 300, dict(n=333, k=384)),
        Case("gate_up M=16 F=200 K=256", "gate_up", 16, dict(f=200, k=256)),
        *layer("7b", ""),
        # The 0.5B's GEMMs at 512 tokens are few tiles (its o_proj: 28 of 128 × 128): where tile
        # size, not the mainloop, sets the time.
        *layer("0.5b", "0.5B "),
    ]


def _row_major(dev, name: str, qweight: np.ndarray):
    """qweight uint32 [N, K/8] (layout id 1) on the device for a version's own row addressing: the
    words as they are, then zeros up to the device layout's size (what production's launcher
    checks the buffer against)."""
    from drvqwen.format.int4_tiles import device_words

    n, kw = qweight.shape
    flat = np.zeros(device_words(n, kw * 8), np.uint32)
    flat[:qweight.size] = qweight.reshape(-1)
    return dev.upload(name, flat)


class Inputs:
    """One case's device buffers and float64 reference. `out` is the output (residual: in/out),
    `fresh()` puts its starting contents back (poison, or the residual and its NaN rows). The
    weights are on the device twice: `w` in production's device layout, `w_rows` in layout id 1
    for the versions (reads_row_major)."""

    def __init__(self, case: Case, dev, rng, reference: bool = True):
        from drvqwen import reference as ref
        from kernel_testing import dequant64, random_int4, upload_int4
        from test_kernel_gemm_int4 import _capacity, _x  # the production test's row capacity and x

        self.case, m, dims = case, case.m, case.dims
        self.rows = rows = _capacity(m)
        k = dims["k"]
        x = _x(rng, m, k)  # fp16 [rows, K], the rows past M NaN
        x64 = x[:m].astype(np.float64)
        ns = {"f32": [dims.get("n")], "residual": [dims.get("n")], "qkv": [dims.get("nq"), dims.get("nkv"), dims.get("nkv")],
              "gate_up": [dims.get("f"), dims.get("f")]}[case.kind]
        ws = [random_int4(rng, n, k) for n in ns]
        cols = sum(ns) if case.kind != "gate_up" else ns[0]
        self.want = None
        if reference:
            prods = [x64 @ dequant64(*w).T for w in ws]  # [m, n] float64 each
            self.want = ref.swiglu(*prods) if case.kind == "gate_up" else np.concatenate(prods, axis=1)
        self.x = dev.upload("x", x)
        pair_dim = dims["hd"] if case.kind == "qkv" else 0
        scales = [dev.upload(f"w{i}.scales", sc) for i, (_qw, sc) in enumerate(ws)]
        self.w = [(upload_int4(dev, f"w{i}.qweight", qw, pair_dim), scales[i]) for i, (qw, _sc) in enumerate(ws)]
        self.w_rows = [(_row_major(dev, f"w{i}.qweight (layout id 1)", qw), scales[i])
                       for i, (qw, _sc) in enumerate(ws)]
        self.state = dev.upload("prefill_state", np.array([0, m], np.int32))
        dtype = np.float16 if case.kind == "gate_up" else np.float32
        self.start = np.full((rows, cols), np.nan, dtype)
        if case.kind == "residual":
            self.start[:m] = rng.standard_normal((m, cols)).astype(np.float32)
        self.out = dev.upload("out", self.start)

    def fresh(self) -> None:
        self.out.upload(self.start)

    def production(self, max_blocks: int | None = None, tile_tokens: int | None = None, row_major: bool = False):
        """kernels/gemm_int4.cu's launcher of this case (persistent unless max_blocks=0; the tile
        gemm_tiling picks unless tile_tokens), whole tiles: no SplitKScratch (the prefill's ranges
        cut tiles); over the weights in layout id 1 with `row_major` (a version's launch), else in
        the device layout."""
        from drvqwen import launchers as K

        d, kind = self.case.dims, self.case.kind
        kw = dict(rows=self.rows, max_blocks=max_blocks, tile_tokens=tile_tokens)
        flat = [a for w in (self.w_rows if row_major else self.w) for a in w]
        if kind == "f32":
            return K.GemmInt4(self.out, self.x, *flat, self.state, n=d["n"], k=d["k"], **kw)
        if kind == "residual":
            return K.GemmInt4ResidualRows(self.out, self.x, *flat, self.state, n=d["n"], k=d["k"], **kw)
        if kind == "qkv":
            return K.GemmInt4QkvRows(self.out, self.x, *flat, self.state, n_q=d["nq"], n_kv=d["nkv"], k=d["k"],
                                     head_dim=d["hd"], **kw)
        return K.GemmInt4GateUpSwigluRows(self.out, self.x, *flat, self.state, f=d["f"], k=d["k"], **kw)

    def launcher(self, v: Version):
        """Version v's launcher of this case, over the weights in the layout v reads."""
        rows = reads_row_major(v)
        return version_launcher(v, lambda *a, **kw: self.production(*a, row_major=rows, **kw), self.rows, self.x)

    def check(self, v: Version) -> float:
        """Launch v once on fresh outputs; the rows < M against the reference (for the residual,
        what was added), the rows past M untouched; a second launch the same bits."""
        from kernel_testing import TOL_GEMV, assert_same_bits, report

        m, g = self.case.m, self.launcher(v)
        self.fresh()
        g.launch()
        got = self.out.download().astype(np.float64)
        start = self.start.astype(np.float64)
        rel = report(f"{v.name} {self.case.label}", got[:m] - (start[:m] if self.case.kind == "residual" else 0),
                     self.want, TOL_GEMV)
        assert np.isnan(got[m:]).all(), f"{v.name} {self.case.label}: rows past M={m} were written"
        first = self.out.download()
        self.fresh()
        g.launch()
        assert_same_bits(f"{v.name} {self.case.label}", first, self.out.download())
        return rel


# Versions whose warpgroups move registers with setmaxnreg: the moves add up only at this
# register count a thread at launch (v6: 2 · 128 · 216 + 128 · 72 = 384 · 168). A build with
# fewer leaves the consumers' setmaxnreg.inc waiting for registers that never come — a hang,
# so such a build is not launched.
REGISTERS_AT_LAUNCH = {v.name: 168 for v in VERSIONS if _stem(v) == "v6_n256_setmaxnreg"}


def launchable(o: Outcome) -> bool:
    """False (and a failed check recorded) where a build's register count would hang it."""
    want = REGISTERS_AT_LAUNCH.get(o.version.name)
    regs = o.build.get("registers", {})
    bad = {k: r for k, r in regs.items() if want is not None and r != want}
    if bad:
        o.checks.append({"case": "registers", "rel_err": None,
                         "error": f"built with {bad} registers, not {want}: setmaxnreg would wait forever"})
    return not bad


def check(outcomes: list[Outcome], rng, verbose: bool) -> None:
    """Every case on every version, the reference computed once per case."""
    from kernel_testing import DeviceScratch

    outcomes = [o for o in outcomes if launchable(o)]
    for case in cases():
        dev = DeviceScratch()
        inputs = Inputs(case, dev, rng)
        for o in outcomes:
            o.check(case.label, lambda: inputs.check(o.version), verbose)
        _close(dev)


def _close(dev) -> None:
    from drvqwen.cuda import get_device

    get_device().synchronize()
    dev.close()


# The summary key of each model's layer sum.
SUMMARY = {"7b": "layers_ms", "0.5b": "layers_ms_05b"}


def time_versions(outcomes: list[Outcome], args) -> None:
    """µs and TFLOP/s of each version at the 7B and 0.5B layers' four GEMMs (M = 512), and the
    layer count × their sum per model; random inputs, graph replay as tools/bench_gemm.py."""
    from drvqwen.config import PRESETS
    from drvqwen.cuda.graph import graph_time_us
    from kernel_testing import DeviceScratch

    rng = np.random.default_rng(args.seed)
    for case in [c for c in cases() if c.timed]:
        dev = DeviceScratch()
        inputs = Inputs(case, dev, rng, reference=False)
        for o in outcomes:
            g = inputs.launcher(o.version)
            g.build()  # compile and load before the capture, as bench_gemv's time_launchers does
            us = statistics.median(graph_time_us(g, reps=args.reps) for _ in range(args.samples))
            o.times[case.label] = {"us": us, "tflops": g.flops / us / 1e6}
        _close(dev)
    for model, key in SUMMARY.items():
        labels = [c.label for c in cases() if c.timed and c.model == model]
        for o in outcomes:
            if all(n in o.times for n in labels):
                o.summary[key] = PRESETS[model].num_layers * sum(o.times[n]["us"] for n in labels) / 1e3


def print_table(outcomes: list[Outcome], args) -> None:
    from drvqwen.config import PRESETS

    for model, key in SUMMARY.items():
        names = [c.label for c in cases() if c.timed and c.model == model]
        layers = f"{PRESETS[model].num_layers} layers"
        print(f"\ngemm_int4: the {model.upper()} layer's prefill GEMMs at M = 512, µs (graph replay of {args.reps} "
              f"calls, median of {args.samples}); rel err: the worst relative L2 error of the checks")
        print(f"{'version':36} " + " ".join(f"{n:>19}" for n in names) + f" {layers:>10} {'rel err':>9}  checks")
        for o in outcomes:
            cells = [f"{o.times[n]['us']:13.1f} {o.times[n]['tflops']:3.0f}TF" if n in o.times else f"{'—':>19}"
                     for n in names]
            ms = f"{o.summary[key]:7.2f} ms" if key in o.summary else f"{'—':>10}"
            rel = f"{o.worst_rel_err:9.1e}" if o.worst_rel_err is not None else f"{'—':>9}"
            ok = sum(c["error"] is None for c in o.checks)
            failed = [c for c in o.checks if c["error"] is not None]
            print(f"{o.version.name:36} " + " ".join(cells) + f" {ms} {rel}  {ok}/{len(o.checks)}"
                  + (f"  FAILED {failed[0]['case']}: {failed[0]['error']}" if failed else ""))
