"""The decode GEMV's versions (kernels/dev/gemv_int4/) for tools/dev_kernels.py: how each is
launched, what it is checked on, how it is timed.

A version's kernels are production's (kernels/gemv_int4.cu) with a suffix in the name and the
same arguments; a version without one of them is not run there. The runner builds production's
launcher (launchers/gemv_int4.py) with the version's own occupancy — its kernel, its shared
memory — so that the launch shape follows production's rule, and points it at the version's
file. Every version reads its weights through production's Layout (GemvTileMajor), so each gets
them in the device layout (format/int4_tiles.py: q, k and v RoPE-paired by the head dim).

Checks (the cases of tests/test_kernel_gemv_int4.py): against float64 matvecs on the dequantized
weights; the residual kernel on what it adds, gate/up after the RMSNorm of the residual (rounded
to FP16 as the kernel rounds it), qkv_rope on the query and on the K/V cache slot of the position
in a NaN-poisoned paged cache with a shuffled block table, every other slot untouched. At the 7B
shapes and at small ones whose K groups the warps do not split evenly, there on 3 blocks (blocks
owning several tiles). Timed as tools/bench_gemv.py --pdl times the four 7B GEMVs: programmatic
launches back to back in a graph, cycling through enough copies of the weights to miss L2.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from dev_kernels import Outcome, Version, retarget
from drvqwen.launchers.base import Occupancy
from test_kernel_gemv_int4 import EPS, MAX_PAGES, N_PAGES  # the production test's norm eps and paged cache

VERSIONS = [
    Version("production", "gemv_int4"),
    Version("v2_smem_ring", "dev/gemv_int4/v2_smem_ring", suffix="_ring"),
    Version("v2_smem_ring[GEMV_RING=8]", "dev/gemv_int4/v2_smem_ring", (("GEMV_RING", 8),), suffix="_ring"),
    Version("v2_smem_ring[GEMV_RING_L2_PREFETCH=0]", "dev/gemv_int4/v2_smem_ring", (("GEMV_RING_L2_PREFETCH", 0),),
            suffix="_ring"),
    Version("v2_smem_ring[GEMV_RING=8,GEMV_RING_L2_PREFETCH=0]", "dev/gemv_int4/v2_smem_ring",
            (("GEMV_RING", 8), ("GEMV_RING_L2_PREFETCH", 0)), suffix="_ring"),
    Version("v2_smem_ring[GEMV_RING_L2_PREFETCH=0,GEMV_RING_LATE_SCALES=1]", "dev/gemv_int4/v2_smem_ring",
            (("GEMV_RING_L2_PREFETCH", 0), ("GEMV_RING_LATE_SCALES", 1)), suffix="_ring"),
    Version("v2_smem_ring[GEMV_RING=8,GEMV_RING_L2_PREFETCH=0,GEMV_RING_LATE_SCALES=1]", "dev/gemv_int4/v2_smem_ring",
            (("GEMV_RING", 8), ("GEMV_RING_L2_PREFETCH", 0), ("GEMV_RING_LATE_SCALES", 1)), suffix="_ring"),
    Version("v3_flat_split", "dev/gemv_int4/v3_flat_split", suffix="_flat"),
    Version("v4_bulk_ring", "dev/gemv_int4/v4_bulk_ring", suffix="_bulk"),
    Version("v4_bulk_ring[GEMV_BULK_RING=8]", "dev/gemv_int4/v4_bulk_ring", (("GEMV_BULK_RING", 8),), suffix="_bulk"),
    Version("v4_bulk_ring[GEMV_BULK_CHAINS=2]", "dev/gemv_int4/v4_bulk_ring", (("GEMV_BULK_CHAINS", 2),), suffix="_bulk"),
    Version("v4_bulk_ring[GEMV_BULK_CHAINS=4]", "dev/gemv_int4/v4_bulk_ring", (("GEMV_BULK_CHAINS", 4),), suffix="_bulk"),
    Version("v4_bulk_ring[GEMV_BULK_LATE_SCALES=1]", "dev/gemv_int4/v4_bulk_ring", (("GEMV_BULK_LATE_SCALES", 1),),
            suffix="_bulk"),
    Version("v4_bulk_ring[GEMV_BULK_RING=8,GEMV_BULK_LATE_SCALES=1]", "dev/gemv_int4/v4_bulk_ring",
            (("GEMV_BULK_RING", 8), ("GEMV_BULK_LATE_SCALES", 1)), suffix="_bulk"),
    Version("v5_int8_x", "dev/gemv_int4/v5_int8_x", suffix="_i8x"),
    Version("v5_int8_x[I8X_ONE_BLOCK=1]", "dev/gemv_int4/v5_int8_x", (("I8X_ONE_BLOCK", 1),), suffix="_i8x"),
]
RING_KB = 16  # GEMV_RING's default in v2_smem_ring.cu, GEMV_BULK_RING's in v4_bulk_ring.cu
DEV_CONSTANTS = [("dev/gemv_int4/v2_smem_ring", "GEMV_RING", RING_KB),
                 ("dev/gemv_int4/v2_smem_ring", "GEMV_RING_BYTES", RING_KB * 1024),
                 ("dev/gemv_int4/v4_bulk_ring", "GEMV_BULK_RING", RING_KB),
                 ("dev/gemv_int4/v4_bulk_ring", "GEMV_BULK_RING_BYTES", RING_KB * 1024),
                 ("dev/gemv_int4/v5_int8_x", "I8X_SMEM_BYTES(18944)", 18944 * 5 // 4)]
RING_DEFINE = {"dev/gemv_int4/v2_smem_ring": "GEMV_RING", "dev/gemv_int4/v4_bulk_ring": "GEMV_BULK_RING"}
ROPE_THETA = 1e6     # Qwen2.5's rope_theta, as tests/test_kernel_gemv_int4.py


# v5_int8_x: x as int8 codes and a scale and zero sum a 32-input chunk, K·1.25 bytes on top of
# production's shared memory (enough for every K ≤ 19 660: the 7B's down_proj has 18 944), and with
# I8X_ONE_BLOCK=1 as much again as leaves one block resident an SM (the persistent decode step's
# occupancy: 228 KiB an SM, a block's at most 227), unused.
I8X_FILE = "dev/gemv_int4/v5_int8_x"
I8X_STAGE_BYTES = 24 * 1024
I8X_ONE_BLOCK_BYTES = 120 * 1024


def extra_smem_bytes(v: Version, threads: int) -> int:
    """Dynamic shared memory a version needs on top of production's: the rings of v2 and v4, v5's
    int8 x (and its padding to one block an SM)."""
    if v.file == I8X_FILE:
        return I8X_STAGE_BYTES + (I8X_ONE_BLOCK_BYTES if dict(v.defines).get("I8X_ONE_BLOCK") else 0)
    if v.file not in RING_DEFINE:
        return 0
    return threads // 32 * dict(v.defines).get(RING_DEFINE[v.file], RING_KB) * 1024


def int8_x(x: np.ndarray) -> np.ndarray:
    """x fp16 [K] as v5_int8_x.cu multiplies it, float64 [K]: per 32 inputs a = max |x| (FP32),
    q = rint(x · fp32(127 / a)) (0 where a = 0), the value q · fp32(a / 127). The kernel's FP32
    division and round-to-nearest-even, so the reference sees the kernel's own x."""
    xf = x.astype(np.float32).reshape(-1, 32)
    a = np.abs(xf).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(a > 0, np.float32(127) / a, np.float32(0)).astype(np.float32)
    q = np.rint((xf * inv).astype(np.float32))
    return (q.astype(np.float64) * (a / np.float32(127)).astype(np.float32).astype(np.float64)).reshape(-1)


class VersionOccupancy(Occupancy):
    """Blocks per SM of version v's kernel standing in for the production kernel asked about,
    with v's extra shared memory: production's launch-shape rule then sizes v's grid."""

    def __init__(self, v: Version):
        self.v = v

    @property
    def sm_count(self) -> int:
        from drvqwen.cuda import get_device

        return get_device().info.sm_count

    def blocks_per_sm(self, kernel, threads: int, smem_bytes: int) -> int:
        fn = self.v.kernel_ref(kernel).function()
        smem = smem_bytes + extra_smem_bytes(self.v, threads)
        fn.ensure_dynamic_smem(smem)
        return fn.max_active_blocks_per_sm(threads, smem)


def has(o: Outcome, production_kernel: str) -> bool:
    return production_kernel + o.version.suffix in o.build.get("registers", {})


def launcher_for(v: Version, make):
    """make(**variant) → production's launcher; v's launcher of the same problem."""
    if v.is_production:
        return make()
    g = make(occupancy=VersionOccupancy(v))
    return retarget(g, v, smem_bytes=g.specs[0].smem_bytes + extra_smem_bytes(v, g.specs[0].block[0]))


@dataclass(frozen=True)
class Case:
    """One GEMV: `kind` residual (n, k), gate_up (f, k) or qkv_rope (hq, hkv, dh, k, pos);
    `launch`: launcher options (blocks=3 on the small shapes)."""

    label: str
    kind: str
    dims: dict
    launch: dict = field(default_factory=dict)


KERNEL = {"residual": "gemv_int4_residual", "gate_up": "gemv_int4_gate_up_swiglu", "qkv_rope": "gemv_int4_qkv_rope"}
CASES = [
    Case("residual 7b.o_proj", "residual", dict(n=3584, k=3584)),
    Case("residual 7b.down_proj", "residual", dict(n=3584, k=18944)),
    Case("residual N=80 K=640, 3 blocks", "residual", dict(n=80, k=640), dict(blocks=3)),
    Case("residual N=160 K=1152, 3 blocks", "residual", dict(n=160, k=1152), dict(blocks=3)),
    Case("gate_up 7b", "gate_up", dict(f=18944, k=3584)),
    Case("gate_up F=160 K=256, 3 blocks", "gate_up", dict(f=160, k=256), dict(blocks=3)),
    Case("gate_up F=48 K=1152", "gate_up", dict(f=48, k=1152)),
    Case("qkv_rope 7b pos=1000", "qkv_rope", dict(hq=28, hkv=4, dh=128, k=3584, pos=1000)),
    Case("qkv_rope Hq=3 Hkv=1 Dh=32 K=256 pos=17, 3 blocks", "qkv_rope", dict(hq=3, hkv=1, dh=32, k=256, pos=17),
         dict(blocks=3)),
]


def _normed(rng, k):
    """(residual fp32 [k] with Qwen2's few huge channels, gain fp16 [k], rmsnorm(residual) · gain
    rounded to FP16 as the kernel feeds it to the MMAs): the production test's inputs."""
    from kernel_testing import massive_residual, normed_fp16

    residual, norm_w = massive_residual(rng, k), (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    return residual, norm_w, normed_fp16(residual, norm_w, EPS)


class Inputs:
    """One case's host inputs and float64 reference (`want`), drawn once; `check(v)` uploads them
    (the weights in the device layout), launches v's kernel on poisoned outputs and compares."""

    def __init__(self, case: Case, rng):
        from drvqwen import reference as ref
        from kernel_testing import matvec64, random_int4

        self.case, d = case, case.dims
        if case.kind == "residual":
            self.w = [random_int4(rng, d["n"], d["k"])]
            self.x = rng.standard_normal(d["k"]).astype(np.float16)
            self.res_in = rng.standard_normal(d["n"]).astype(np.float32)
            self.want = matvec64(*self.w[0], self.x)  # what the kernel adds to the residual
            self.want_i8 = matvec64(*self.w[0], int8_x(self.x))  # v5's, on its int8 x
        elif case.kind == "gate_up":
            self.w = [random_int4(rng, d["f"], d["k"]) for _ in range(2)]
            self.residual, self.norm_w, x = _normed(rng, d["k"])
            self.want = ref.swiglu(*(matvec64(qw, sc, x) for qw, sc in self.w))
            self.want_i8 = ref.swiglu(*(matvec64(qw, sc, int8_x(x)) for qw, sc in self.w))
        else:
            hq, hkv, dh, pos = d["hq"], d["hkv"], d["dh"], d["pos"]
            ns = (hq * dh, hkv * dh, hkv * dh)
            self.w = [random_int4(rng, n, d["k"]) for n in ns]
            self.residual, self.norm_w, x = _normed(rng, d["k"])
            self.biases = [(rng.standard_normal(n) * 0.5).astype(np.float16) for n in ns]
            self.block_table = rng.integers(0, N_PAGES, size=MAX_PAGES).astype(np.int32)  # shuffled pages
            cos, sin = (t.astype(np.float64) for t in ref.rope_cos_sin(np.array([pos]), dh, ROPE_THETA))
            q64, k64, v64 = (matvec64(qw, sc, x) + b.astype(np.float64) for (qw, sc), b in zip(self.w, self.biases))
            self.want = {"q": ref.apply_rope(q64.reshape(1, hq, dh), cos, sin)[0],
                         "k": ref.apply_rope(k64.reshape(1, hkv, dh), cos, sin)[0], "v": v64.reshape(hkv, dh)}

    def _weights(self, dev) -> list:
        """The weights on the device as every version reads them: [qweight, scales, …] in matrix
        order, the qweights in the device layout (q, k and v RoPE-paired by the head dim)."""
        from kernel_testing import upload_int4

        pair_dim = self.case.dims["dh"] if self.case.kind == "qkv_rope" else 0
        return [a for i, (qw, sc) in enumerate(self.w)
                for a in (upload_int4(dev, f"w{i}.qweight", qw, pair_dim), dev.upload(f"w{i}.scales", sc))]

    def check(self, v: Version, dev) -> float:
        """v's kernel on this case: relative L2 error against `want` (raises on a failed check)."""
        from drvqwen import launchers as K
        from drvqwen import reference as ref
        from kernel_testing import TOL_GEMV, assert_same_bits, report

        d, launch, w = self.case.dims, self.case.launch, self._weights(dev)
        # v5 rounds x to int8 (int8_x): its reference multiplies the same x; every other version
        # production's FP16 x
        want = self.want_i8 if v.file == I8X_FILE else self.want
        assert v.file != I8X_FILE or d["k"] * 5 // 4 <= I8X_STAGE_BYTES, "v5's int8 x needs more shared memory"
        if self.case.kind == "residual":
            res = dev.upload("residual", self.res_in)
            g = launcher_for(v, lambda **kw: K.GemvInt4Residual(res, dev.upload("x", self.x), *w, n=d["n"], k=d["k"],
                                                                **launch, **kw))
            g.launch()
            got = res.download()
            rel = report(f"{v.name} {self.case.label}", got.astype(np.float64) - self.res_in, want, TOL_GEMV)
            res.upload(self.res_in)
            g.launch()
            assert_same_bits(v.name, got, res.download())
            return rel
        norm = dev.upload("residual", self.residual), dev.upload("norm_w", self.norm_w)
        if self.case.kind == "gate_up":
            h = dev.poisoned("h", (d["f"],), np.float16)
            g = launcher_for(v, lambda **kw: K.GemvInt4GateUpSwiglu(h, *norm, *w, f=d["f"], k=d["k"], eps=EPS,
                                                                    **launch, **kw))
            g.launch()
            got = h.download()
            rel = report(f"{v.name} {self.case.label}", got, want, TOL_GEMV)
            h.fill_bytes(0xFF)
            g.launch()
            assert_same_bits(v.name, got, h.download())
            return rel
        hq, hkv, dh, pos = d["hq"], d["hkv"], d["dh"], d["pos"]
        q_out = dev.poisoned("q", (hq, dh), np.float16)
        caches = [dev.poisoned(f"{c}_cache", (N_PAGES, hkv, 16, dh), np.float16) for c in "kv"]
        g = launcher_for(v, lambda **kw: K.GemvInt4QkvRope(
            q_out, *caches, *norm, *w, *[dev.upload(f"b{i}", b) for i, b in enumerate(self.biases)],
            dev.upload("inv_freq", ref.rope_inv_freq(dh, ROPE_THETA)),
            dev.upload("state", np.array([pos, 0, pos + 1], np.int32)), dev.upload("block_table", self.block_table),
            n_heads=hq, n_kv_heads=hkv, head_dim=dh, dim=d["k"], eps=EPS, **launch, **kw))
        g.launch()
        got_q = q_out.download()
        rels = [report(f"{v.name} {self.case.label} q", got_q, self.want["q"], TOL_GEMV)]
        page, slot = self.block_table[pos // 16], pos % 16
        for name, cache in zip("kv", caches):
            got = cache.download()
            rels.append(report(f"{v.name} {self.case.label} {name}", got[page, :, slot, :], self.want[name], TOL_GEMV))
            untouched = np.ones(got.shape[:3], dtype=bool)
            untouched[page, :, slot] = False
            assert (got.view(np.uint16)[untouched] == 0xFFFF).all(), \
                f"{v.name} {self.case.label}: {name}_cache slot other than position {pos} written"
        g.launch()
        assert_same_bits(v.name, got_q, q_out.download())
        return max(rels)


def check(outcomes: list[Outcome], rng, verbose: bool) -> None:
    """Every case on every version that has the case's kernel, the reference computed once."""
    from drvqwen.cuda import get_device
    from kernel_testing import DeviceScratch

    for case in CASES:
        inputs = Inputs(case, rng)
        for o in [o for o in outcomes if has(o, KERNEL[case.kind])]:
            dev = DeviceScratch()
            try:
                o.check(case.label, lambda: inputs.check(o.version, dev), verbose)
            finally:
                get_device().synchronize()
                dev.close()


# bench_gemv's four GEMVs → the production kernel each runs.
TIMED = {"qkv_proj": "gemv_int4_qkv_rope", "o_proj": "gemv_int4_residual", "gate_up_swiglu": "gemv_int4_gate_up_swiglu",
         "down_proj": "gemv_int4_residual"}


def time_versions(outcomes: list[Outcome], args) -> None:
    """µs and GB/s of each version at the four 7B GEMVs, as tools/bench_gemv.py --pdl."""
    import bench_gemv as bg
    from drvqwen.config import PRESETS
    from drvqwen.cuda import get_device
    from drvqwen.cuda.bandwidth import measure_copy_bandwidth
    from drvqwen.launchers.gemv_int4 import int4_bytes

    cfg, rng = PRESETS["7b"], np.random.default_rng(args.seed)
    copy_gbps = measure_copy_bandwidth().gbps
    for name, kernel in TIMED.items():
        sh = bg.shapes(cfg)[name]
        nbytes = sum(int4_bytes(n, sh["k"]) for n in sh["n"])
        copies = max(2, -(-2 * bg.L2_BYTES // nbytes))
        reps = -(-max(args.reps, 40) // copies) * copies
        for o in [o for o in outcomes if has(o, kernel)]:
            s = bg.Scratch()
            try:
                lns = [launcher_for(o.version, lambda **kw: bg.make_launcher(name, s, c, cfg, rng, **kw))
                       for c in range(copies)]
                us = statistics.median(bg.time_launchers(lns, reps, True) for _ in range(args.samples))
                o.times[name] = {"us": us, "gbps": nbytes / us / 1e3, "of_copy": nbytes / us / 1e3 / copy_gbps,
                                 "grid": lns[0].specs[0].grid[0], "block": lns[0].specs[0].block[0],
                                 "smem": lns[0].specs[0].smem_bytes}
            finally:
                get_device().synchronize()
                s.close()
    for o in outcomes:
        o.summary["copy_gbps"] = copy_gbps


def print_table(outcomes: list[Outcome], args) -> None:
    copy = next((o.summary["copy_gbps"] for o in outcomes if "copy_gbps" in o.summary), None)
    print(f"\ngemv_int4: the 7B decode GEMVs alone, µs and GB/s per call (PDL, weights rotated past L2, median of "
          f"{args.samples}{f'; copy {copy:.0f} GB/s' if copy else ''}); rel err: the worst relative L2 error of the checks")
    print(f"{'version':28} " + " ".join(f"{n:>16}" for n in TIMED) + f" {'rel err':>9}  checks")
    for o in outcomes:
        cells = [f"{o.times[n]['us']:7.2f} {o.times[n]['gbps']:5.0f}GB/s" if n in o.times else f"{'—':>16}" for n in TIMED]
        rel = f"{o.worst_rel_err:9.1e}" if o.worst_rel_err is not None else f"{'—':>9}"
        ok = sum(c["error"] is None for c in o.checks)
        failed = [c for c in o.checks if c["error"] is not None]
        print(f"{o.version.name:28} " + " ".join(cells) + f" {rel}  {ok}/{len(o.checks)}"
              + (f"  FAILED {failed[0]['case']}: {failed[0]['error']}" if failed else ""))
