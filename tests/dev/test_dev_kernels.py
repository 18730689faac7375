"""The kernel workshop (kernels/dev/) and its runner (tools/dev_kernels.py).

GPU: the runner's checks — every version of every op against the float64 reference at the real
and the awkward shapes (NaN-poisoned outputs written in full, nothing else touched, TOL_GEMV,
the same bits twice) — must pass. No timing here: `tools/dev_kernels.py OP` times them.

CPU: the runner's version lists are the files on disk; every version builds (its defines
included) without spills; what the runner assumes of a file (block sizes, shared memory) is
what the file defines; the launch shapes it gives v1 and v2 are those their own launchers gave
(the formulas of `git show b9fbcca^:src/drvqwen/launchers/gemm_int4.py` and of 96e0ea5's); the
GEMV versions get production's launch with their own kernel and shared memory; the GEMM versions
get their weights in the layout their own code reads (layout id 1) and production its device
layout, each launch the arguments its kernel declares.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import dev_gemm_int4  # noqa: E402
import dev_gemv_int4  # noqa: E402
import dev_kernels  # noqa: E402

from drvqwen.cuda.nvrtc import compile_kernel  # noqa: E402
from drvqwen.cuda.sources import kernels_dir  # noqa: E402
from drvqwen.launchers.base import BufferSpec  # noqa: E402
from kernel_testing import int4_specs  # noqa: E402

MODULES = {"gemm_int4": dev_gemm_int4, "gemv_int4": dev_gemv_int4}
ALL = [(op, v) for op, m in MODULES.items() for v in m.VERSIONS]


def test_every_op_has_its_module():
    assert set(MODULES) == set(dev_kernels.OPS)
    assert all(dev_kernels.op_module(op) is m for op, m in MODULES.items())


@pytest.mark.parametrize("op", sorted(MODULES))
def test_versions_are_the_files_on_disk(op):
    on_disk = {p.relative_to(kernels_dir()).with_suffix("").as_posix()
               for p in (kernels_dir() / "dev" / op).glob("*.cu")}
    listed = {v.file for v in MODULES[op].VERSIONS if not v.is_production}
    assert on_disk, f"no versions in kernels/dev/{op}/"
    assert listed == on_disk, f"the runner lists {sorted(listed - on_disk)} not on disk, misses {sorted(on_disk - listed)}"
    names = [v.name for v in MODULES[op].VERSIONS]
    assert len(set(names)) == len(names) and names[0] == "production"
    assert [v.file for v in MODULES[op].VERSIONS if v.is_production] == [op]


def test_every_dev_file_belongs_to_an_op():
    stray = [p.relative_to(kernels_dir()).as_posix() for p in (kernels_dir() / "dev").rglob("*.cu")
             if p.parent.name not in MODULES]
    assert not stray, f"kernel files in kernels/dev/ that no op of tools/dev_kernels.py runs: {stray}"


@pytest.mark.parametrize("op,v", ALL, ids=[f"{op}:{v.name}" for op, v in ALL])
def test_every_version_builds_without_spills(op, v):
    ck = compile_kernel(v.file, defines=dict(v.defines))
    entries = {r.function: r for r in ck.resources.values() if r.is_entry}
    kernels = [k for k in entries if k.endswith(v.suffix)] if v.suffix else list(entries)
    assert kernels, f"{v.file}: no kernel ending in {v.suffix!r}"
    assert not [k for k in kernels if entries[k].spills], f"{v.name} spills: {entries}"


@pytest.mark.parametrize("op", sorted(MODULES))
def test_dev_constants_match_the_files(op):
    from test_kernel_constants import _compile_with

    by_file: dict[str, list] = {}
    for file, expr, value in MODULES[op].DEV_CONSTANTS:
        by_file.setdefault(file, []).append((expr, value))
    for file, checks in by_file.items():
        _compile_with(file, checks)


def test_select():
    vs = dev_gemm_int4.VERSIONS
    assert dev_kernels.select(vs, None) == vs
    assert [v.name for v in dev_kernels.select(vs, ["v2"])] == [
        "production", "v2_wgmma_cluster2", "v2_wgmma_cluster2[GEMM_CLUSTER=1]"]
    assert [v.name for v in dev_kernels.select(vs, ["v1", "v4"])] == [
        "production", "v1_mma_sync", "v4_late_full_arrival"]
    assert [v.name for v in dev_kernels.select(dev_gemv_int4.VERSIONS, ["v4"])] == [
        "production", "v4_bulk_ring", "v4_bulk_ring[GEMV_BULK_RING=8]", "v4_bulk_ring[GEMV_BULK_CHAINS=2]",
        "v4_bulk_ring[GEMV_BULK_CHAINS=4]", "v4_bulk_ring[GEMV_BULK_LATE_SCALES=1]",
        "v4_bulk_ring[GEMV_BULK_RING=8,GEMV_BULK_LATE_SCALES=1]"]
    dev_kernels.check_names(dev_kernels.OPS, ["v4", "v3_flat"])  # v4 of both, v3 of the GEMV
    assert [v.name for v in dev_kernels.select(dev_gemv_int4.VERSIONS, ["v3"])] == ["production", "v3_flat_split"]
    assert [v.name for v in dev_kernels.select(dev_gemv_int4.VERSIONS, ["v5"])] == [
        "production", "v5_int8_x", "v5_int8_x[I8X_ONE_BLOCK=1]"]
    with pytest.raises(SystemExit, match="no version 'v6'.*v5_int8_x"):
        dev_kernels.check_names(("gemv_int4",), ["v6"])
    with pytest.raises(SystemExit, match="no version 'v9'.*v1_mma_sync"):
        dev_kernels.check_names(dev_kernels.OPS, ["v9"])


# --- launch shapes (CPU: planned buffers, no tensor map encoded) -----------------------------

def _gemm(monkeypatch, kind: str, rows: int, **dims):
    """A production gemm_int4 launcher over planned buffers (its tensor map replaced by a
    marker: encoding one needs the driver)."""
    from drvqwen import launchers as K
    from drvqwen.launchers import gemm_int4

    monkeypatch.setattr(gemm_int4, "x_tensor_map", lambda x, rows, k, bm=128: "tensor map")
    k = dims["k"]

    def w(n, tag):
        return int4_specs(tag, n, k)

    x, st = BufferSpec("x", (rows, k), np.float16), BufferSpec("prefill_state", (2,), np.int32)

    def make(max_blocks=None, tile_tokens=None):
        kw = dict(rows=rows, max_blocks=max_blocks, tile_tokens=tile_tokens)
        if kind == "f32":
            return K.GemmInt4(BufferSpec("out", (rows, dims["n"]), np.float32), x, *w(dims["n"], "w"), st,
                              n=dims["n"], k=k, **kw)
        if kind == "qkv":
            nq, nkv = dims["nq"], dims["nkv"]
            return K.GemmInt4QkvRows(BufferSpec("qkv", (rows, nq + 2 * nkv), np.float32), x, *w(nq, "q"), *w(nkv, "k"),
                                     *w(nkv, "v"), st, n_q=nq, n_kv=nkv, k=k, head_dim=dims["hd"], **kw)
        f = dims["f"]
        return K.GemmInt4GateUpSwigluRows(BufferSpec("h", (rows, f), np.float16), x, *w(f, "g"), *w(f, "u"), st,
                                          f=f, k=k, **kw)
    return make, x


def _values(params) -> list:
    """Kernel arguments comparable with ==: ctypes scalars by value."""
    return [getattr(p, "value", p) for p in params]


def _version(name):
    return next(v for v in dev_gemm_int4.VERSIONS if v.name == name)


# (kind, rows, dims, the old launchers' weight-row blocks: ceil(16-row tiles / 8), gate/up / 4)
SHAPES = [("f32", 64, dict(n=333, k=384), -(-21 // 8)), ("f32", 512, dict(n=3584, k=3584), 224 // 8),
          ("qkv", 128, dict(nq=224, nkv=32, hd=32, k=256), -(-18 // 8)),
          ("qkv", 512, dict(nq=3584, nkv=512, hd=128, k=3584), 288 // 8),
          ("gate_up", 64, dict(f=200, k=256), -(-13 // 4)), ("gate_up", 512, dict(f=18944, k=3584), 1184 // 4)]


@pytest.mark.parametrize("kind,rows,dims,blocks_y", SHAPES)
def test_v1_runs_in_its_own_launch_shape(monkeypatch, kind, rows, dims, blocks_y):
    make, x = _gemm(monkeypatch, kind, rows, **dims)
    v = _version("v1_mma_sync")
    (spec,) = dev_gemm_int4._mma_sync_shape(v, lambda mb=None: make(mb, 128), rows, x).specs
    assert (spec.grid, spec.block, spec.smem_bytes) == ((-(-rows // 64), blocks_y), (128,), 96 * 1024)
    assert spec.params[1] is x, "v1 reads x through a pointer, not a tensor map"
    assert (spec.kernel.file, spec.kernel.defines) == (v.file, ())
    assert spec.kernel.kernel == make(0, 128).specs[0].kernel.kernel


@pytest.mark.parametrize("cluster", [2, 1])
@pytest.mark.parametrize("kind,rows,dims,blocks_y", SHAPES)
def test_v2_runs_in_its_own_launch_shape(monkeypatch, kind, rows, dims, blocks_y, cluster):
    make, x = _gemm(monkeypatch, kind, rows, **dims)
    v = _version("v2_wgmma_cluster2" if cluster == 2 else "v2_wgmma_cluster2[GEMM_CLUSTER=1]")
    (spec,) = dev_gemm_int4._cluster_shape(v, lambda mb=None: make(mb, 128), rows, x).specs
    n = {"f32": dims.get("n"), "qkv": dims.get("nq", 0) + 2 * dims.get("nkv", 0), "gate_up": 2 * dims.get("f", 0)}[kind]
    row_blocks = -(-n // 128)  # 96e0ea5: ceil(N / 128) (gate/up: 64 features of both matrices)
    assert spec.grid == (-(-rows // 128), -(-row_blocks // cluster) * cluster)
    assert (spec.block, spec.smem_bytes) == ((288,), 4 * 32 * 1024 + 1024 + 2 * 4 * 8)
    assert spec.params[1] == "tensor map" and spec.kernel.defines == v.defines


V6 = [("v6_n256_setmaxnreg", 256, 3 * 72 * 1024 + 1024 + 72),
      ("v6_n256_setmaxnreg[GEMM_BM=128]", 128, 4 * 40 * 1024 + 1024 + 96),
      ("v6_n256_setmaxnreg[GEMM_BM=64]", 64, 4 * 24 * 1024 + 1024 + 96),
      ("v6_n256_setmaxnreg[GEMM_BM=128,GEMM_A_SMEM=1]", 128, 4 * 40 * 1024 + 64 * 1024 + 1024 + 96)]


@pytest.mark.parametrize("name,bm,smem", V6)
@pytest.mark.parametrize("kind,rows,dims,_blocks", SHAPES)
def test_v6_runs_in_its_own_launch_shape(monkeypatch, kind, rows, dims, _blocks, name, bm, smem):
    """v6: production's arguments, 384 threads, its stages, a persistent grid of min(SMs, its tiles
    of GEMM_BM tokens), and x's tensor map re-encoded with GEMM_BM-row boxes."""
    make, x = _gemm(monkeypatch, kind, rows, **dims)
    monkeypatch.setattr(dev_gemm_int4, "x_map_n256", lambda x, rows, k, bm: ("map", rows, k, bm))
    monkeypatch.setattr(dev_gemm_int4, "sm_count", lambda: 132)
    v = _version(name)
    prod = make(132, 128).specs[0]
    (spec,) = dev_gemm_int4._n256_shape(v, lambda max_blocks=132: make(max_blocks, 128), rows, x).specs
    tiles = -(-rows // bm) * (make(0, 128).specs[0].grid[0] // -(-rows // 128))
    assert (spec.grid, spec.block, spec.smem_bytes) == ((min(132, tiles),), (384,), smem)
    assert spec.args["x_map"] == ("map", rows, dims["k"], bm)
    assert [n for n in spec.args if n != "x_map"] == [n for n in prod.args if n != "x_map"]
    assert (spec.kernel.file, spec.kernel.kernel) == (v.file, prod.kernel.kernel)


def test_nine_warp_gemm_versions_run_in_their_launch_shape(monkeypatch):
    """v3–v5: production's persistent grid and arguments of 128-token tiles (less split-K), in
    their own 9-warp block and 4 stages of 40 KiB — not production's 12 warps."""
    make, x = _gemm(monkeypatch, "f32", 512, n=3584, k=3584)
    prod = make(132, 128).specs[0]  # persistent on 132 SMs
    for name in ("v3_syncwarp_release", "v4_late_full_arrival", "v5_every_lane_release"):
        v = _version(name)
        (spec,) = dev_gemm_int4.version_launcher(v, lambda mb=132, tile_tokens=None: make(mb, tile_tokens), 512, x).specs
        assert (spec.grid, spec.block, spec.smem_bytes) == (prod.grid, (288,), 4 * 40 * 1024 + 1024 + 96)
        split = ("split_partials", "split_counters")
        assert _values(spec.params) == _values([v for n, v in prod.args.items() if n not in split])
        assert (spec.kernel.file, spec.kernel.kernel, spec.kernel.registers) == (v.file, prod.kernel.kernel, 0)


@pytest.mark.parametrize("kind,rows,dims", [s[:3] for s in SHAPES[::2]])
@pytest.mark.parametrize("v", dev_gemm_int4.VERSIONS, ids=[v.name for v in dev_gemm_int4.VERSIONS])
def test_gemm_versions_get_the_arguments_their_kernels_declare(monkeypatch, v, kind, rows, dims):
    """Each version's launch names its kernel's parameters in order, as read from the version's own
    file: the versions predate split-K and end at (…, N, K) — a version handed production's two
    extra arguments fails at launch ("kernel takes 7 parameters, 9 given")."""
    from drvqwen.cuda.sources import kernel_source
    from drvqwen.launchers.signatures import kernel_signatures

    make, x = _gemm(monkeypatch, kind, rows, **dims)
    monkeypatch.setattr(dev_gemm_int4, "x_map_n256", lambda x, rows, k, bm: "tensor map")  # needs the driver
    monkeypatch.setattr(dev_gemm_int4, "sm_count", lambda: 132)

    def signatures(file):  # a version's file and the versions it #includes (v4, v5 build on v3)
        text = kernel_source(file).text.decode()
        out = kernel_signatures(text)
        for inc in re.findall(r'#include\s+"(\w+)\.cu"', text):
            out.update(signatures(file.rsplit("/", 1)[0] + "/" + inc))
        return out

    sigs = signatures(v.file)
    def persistent_on_132(max_blocks=132, tile_tokens=None):  # production's default asks the device for its grid
        return make(max_blocks, tile_tokens)

    for spec in dev_gemm_int4.version_launcher(v, persistent_on_132, rows, x).specs:
        assert list(spec.args) == [p.name for p in sigs[spec.kernel.kernel].params], spec.kernel


@pytest.mark.parametrize("kind", ["qkv", "f32", "gate_up"])
def test_gemm_versions_read_layout_id_1_and_production_the_device_layout(monkeypatch, kind):
    """Every version of kernels/dev/gemm_int4/ addresses its weights itself, row-major
    (`qweight + row · K/8`), and its qkv kernel takes no Dh; production reads the device layout,
    q/k/v paired by the head dim. The runner's inputs hold the weights both ways and each launch
    names its own: production the tile-major words (and Dh), a version the same words in layout
    id 1, then zeros up to the size production's launcher checks."""
    from drvqwen.format.int4_tiles import device_words, from_tile_major
    from drvqwen.launchers import gemm_int4

    monkeypatch.setattr(gemm_int4, "x_tensor_map", lambda x, rows, k, bm=128: "tensor map")
    monkeypatch.setattr(gemm_int4, "persistent_grid", lambda tiles, mb: tiles if mb == 0 else min(tiles, 132))
    monkeypatch.setattr(dev_gemm_int4, "x_map_n256", lambda x, rows, k, bm: "tensor map")
    monkeypatch.setattr(dev_gemm_int4, "sm_count", lambda: 132)
    uploaded = {}

    class Dev:  # DeviceScratch.upload to BufferSpecs, the host arrays kept by name
        def upload(self, name, host):
            uploaded[name] = np.ascontiguousarray(host)
            return BufferSpec(name, uploaded[name].shape, uploaded[name].dtype)

    case = next(c for c in dev_gemm_int4.cases() if c.kind == kind and not c.timed)
    d, k = case.dims, case.dims["k"]
    ns = {"qkv": [d.get("nq"), d.get("nkv"), d.get("nkv")], "f32": [d.get("n")], "gate_up": [d.get("f")] * 2}[kind]
    pair_dim = d["hd"] if kind == "qkv" else 0
    inputs = dev_gemm_int4.Inputs(case, Dev(), np.random.default_rng(0), reference=False)
    launches = {v.name: inputs.launcher(v).specs[0].args for v in dev_gemm_int4.VERSIONS}
    prod = launches["production"]
    names = [name for name in prod if name.endswith("qweight")]
    assert len(names) == len(ns) and ("Dh" in prod) == (kind == "qkv")
    tiles = [uploaded[prod[name].name] for name in names]
    for n, t in zip(ns, tiles):
        assert t.shape == (-(-n // 16), k // 128, 16, 16)
    for v in dev_gemm_int4.VERSIONS[1:]:
        args = launches[v.name]
        assert [name for name in args if name.endswith("qweight")] == names and "Dh" not in args, v.name
        for name, n, t in zip(names, ns, tiles):
            flat = uploaded[args[name].name].reshape(-1)
            assert flat.size == device_words(n, k), (v.name, name)
            rows = from_tile_major(t, n, pair_dim).reshape(-1)
            assert np.array_equal(flat[:rows.size], rows) and not flat[rows.size:].any(), (v.name, name)
            assert not np.array_equal(flat, t.reshape(-1)), "random words: the two layouts differ"


@pytest.mark.parametrize("name", [n for n, _, _ in V6])
def test_v6_builds_with_the_registers_its_setmaxnreg_moves_add_up_to(name):
    """v6's warpgroups move registers (setmaxnreg: producer 72, consumers 216 a thread at 256
    tokens); the moves balance only at 168 a thread at launch. The runner refuses another count
    (it would hang on the GPU): here each build has it, and a build record with another is
    refused."""
    v = _version(name)
    ck = compile_kernel(v.file, defines=dict(v.defines))
    regs = {r.function: r.registers for r in ck.resources.values() if r.is_entry}
    assert set(regs.values()) == {dev_gemm_int4.REGISTERS_AT_LAUNCH[v.name]}, regs
    ok, bad = dev_kernels.Outcome(v), dev_kernels.Outcome(v)
    ok.build, bad.build = {"registers": regs}, {"registers": {**regs, "gemm_int4_f32": 160}}
    assert dev_gemm_int4.launchable(ok) and not ok.checks
    assert not dev_gemm_int4.launchable(bad) and "setmaxnreg" in bad.checks[0]["error"]


@pytest.mark.parametrize("name,extra_per_warp,extra", [("v3_flat_split", 0, 0), ("v2_smem_ring", 16 * 1024, 0),
                                                       ("v2_smem_ring[GEMV_RING=8]", 8 * 1024, 0),
                                                       ("v2_smem_ring[GEMV_RING=8,GEMV_RING_L2_PREFETCH=0]", 8 * 1024, 0),
                                                       ("v4_bulk_ring", 16 * 1024, 0),
                                                       ("v4_bulk_ring[GEMV_BULK_RING=8]", 8 * 1024, 0),
                                                       ("v5_int8_x", 0, 24 * 1024),
                                                       ("v5_int8_x[I8X_ONE_BLOCK=1]", 0, 144 * 1024)])
def test_gemv_versions_take_production_launch_with_their_shared_memory(monkeypatch, name, extra_per_warp, extra):
    from drvqwen.launchers import GemvInt4GateUpSwiglu
    from drvqwen.launchers.base import FixedOccupancy
    from drvqwen.launchers.gemv_int4 import gemv_smem_bytes

    v = next(v for v in dev_gemv_int4.VERSIONS if v.name == name)
    asked = []

    def blocks_per_sm(self, kernel, threads, smem):  # what the driver would be asked, recorded
        asked.append((self.v.kernel_ref(kernel), threads, smem + dev_gemv_int4.extra_smem_bytes(self.v, threads)))
        return 1

    monkeypatch.setattr(dev_gemv_int4.VersionOccupancy, "blocks_per_sm", blocks_per_sm)
    monkeypatch.setattr(dev_gemv_int4.VersionOccupancy, "sm_count", 132)
    f, k = 18944, 3584

    def make(occupancy=None):
        return GemvInt4GateUpSwiglu(BufferSpec("h", (f,), np.float16), BufferSpec("residual", (k,), np.float32),
                                    BufferSpec("norm", (k,), np.float16), *int4_specs("g", f, k),
                                    *int4_specs("u", f, k), f=f, k=k, eps=1e-6,
                                    occupancy=occupancy or FixedOccupancy(132, lambda *a: 1))

    prod = make().specs[0]
    (spec,) = dev_gemv_int4.launcher_for(v, make).specs
    warps = prod.block[0] // 32
    assert (spec.grid, spec.block) == (prod.grid, prod.block)
    assert spec.smem_bytes == prod.smem_bytes + warps * extra_per_warp + extra
    assert (spec.kernel.file, spec.kernel.kernel, spec.kernel.defines, spec.kernel.pdl) == (
        v.file, prod.kernel.kernel + v.suffix, v.defines, True)
    # The occupancy that sized the grid was the version's kernel's, with its shared memory.
    assert asked == [(spec.kernel, prod.block[0], gemv_smem_bytes(k, 1, warps, 2) + warps * extra_per_warp + extra)]


# --- GPU: the runner's checks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checked():
    """{op: {version name: Outcome}} after the runner's checks of every version (one reference
    per case for all versions, as the runner computes it)."""
    seed = int(os.environ.get("DRVQWEN_SEED", secrets.randbelow(2**31)))
    print(f"\n[dev kernels] seed={seed}")
    out = {}
    for op, mod in MODULES.items():
        outcomes = [dev_kernels.Outcome(v) for v in mod.VERSIONS]
        for o in outcomes:
            assert dev_kernels.build(o), o.checks
        mod.check(outcomes, np.random.default_rng(seed), verbose=True)
        out[op] = {o.version.name: o for o in outcomes}
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("op,v", ALL, ids=[f"{op}:{v.name}" for op, v in ALL])
def test_version_passes_the_runners_checks(checked, op, v):
    o = checked[op][v.name]
    failed = [c for c in o.checks if c["error"] is not None]
    assert not failed, "\n".join(f"{c['case']}: {c['error']}" for c in failed)
    assert len(o.checks) >= 5, f"{v.name}: only {len(o.checks)} cases ran: {[c['case'] for c in o.checks]}"
    print(f"  {op}:{v.name}: {len(o.checks)} cases, worst rel err {o.worst_rel_err:.2e}")


def test_gemv_inputs_build_on_the_cpu():
    """The GEMV runner's host inputs (the production test's helpers, imported where they live
    now) for every case, without a GPU: a renamed helper shows here, not only on the GPU."""
    rng = np.random.default_rng(0)
    residual, norm_w, x = dev_gemv_int4._normed(rng, 256)
    assert residual.shape == norm_w.shape == x.shape == (256,)
    assert (residual.dtype, norm_w.dtype, x.dtype) == (np.float32, np.float16, np.float16)
    assert np.abs(residual).max() > 1e3  # Qwen2's few huge channels
    assert np.isfinite(x).all()
