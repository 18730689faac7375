"""Every kernel compiles to an sm_90a cubin without register spills; the cubin cache is sound.

Runs in CI, which has no GPU: NVRTC and ptxas run on the CPU, so a compile break or a
kernel that starts spilling to local memory is caught before anyone spends GPU time
(docs/gpu-workflow.md#ci-every-kernel-compiles-nothing-spills). The kernel list is read from kernels/ and kernels/dev/ (with
its folders) at collection time, so a new kernel file is covered without touching this test (the shared headers, kernels/*.cuh, are
compiled as part of the kernels that include them).

The cache tests build a throw-away tree (kernels/, ptx/) in a temporary folder and compile
from there with a temporary cache, so they never touch the real cache or the real kernels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from drvqwen.cuda.errors import NvrtcError
from drvqwen.cuda.nvrtc import (
    ARCH,
    KernelResources,
    compile_kernel,
    format_resource_table,
    parse_ptxas_report,
)
from drvqwen.cuda.sources import kernels_dir, list_kernels, ptx_dir
from drvqwen.launchers.gemv_fmt import DENSE_ID, GPU_FORMAT_IDS, format_mask

KERNELS = list_kernels()
# The workshop's versions in kernels/dev/ and its folders (a checkout only) must keep compiling too.
DEV_DIR = kernels_dir() / "dev"
DEV_KERNELS = sorted(p.relative_to(kernels_dir()).with_suffix("").as_posix() for p in DEV_DIR.rglob("*.cu"))


def test_kernel_folders_found():
    assert (kernels_dir() / "smoke.cu").is_file(), kernels_dir()
    assert "smoke" in KERNELS
    assert ptx_dir().name == "ptx"


# Builds the launchers ask for besides the default one (kernel file, defines): the T-token GEMVs for
# 9..16 tokens (launchers/gemv_int4.py, tokens_defines), and gemv_fmt.cu compiled for one model's
# formats (launchers/gemv_fmt.py, format_defines) — each format alone, the 7B's in llama.cpp's
# Q4_K_M layout (Q4_K, Q6_K) and the real 0.5B's (Q5_0, Q8_0, Q4_K, Q6_K) — with the fused GEMVs
# at the 2 blocks per SM that format_defines asks for wherever they fit (a dense F16 gate/up does
# not: 1): 128 registers are where these builds spill first, and format_defines only looks at
# the fused kernels. And the persistent decode step at the 7B's head dim 128 (the default build is
# the 0.5B's 64), normal and stress, at the one block per SM it runs at by default
# (launchers/decode_persistent.py; its two-blocks build is a measurement, and spills), and its
# DP_PROBE_SKIP probe leaving the GEMVs out (a measurement too, but one that must build), and its
# builds for a model in per-tensor formats (the format GEMVs as ops: WF_FORMATS of the 7B's Q4_K_M
# layout at head dim 128, of the real 0.5B's at 64, stress too), and
# the streaming load's measurement switches (ptx/ldst.cuh: the 256- and 128-byte prefetch sizes,
# no evict-first hint) in the INT4 GEMVs, and the prefill GEMMs' timing probes (gemm_int4.cu:
# GEMM_PROBE_*) in the 256-token build.
_FMT_SETS = [[f] for f in sorted(GPU_FORMAT_IDS | {DENSE_ID})] + [[10, 12], [5, 9, 10, 12]]
DEFINE_VARIANTS = [("gemv_int4", {"GEMV_TOKENS": 16})] + [
    ("gemv_fmt", {"WF_FORMATS": format_mask(ids), "GF_QKV_MIN_BLOCKS": 2,
                  "GF_GATE_UP_MIN_BLOCKS": 1 if ids == [DENSE_ID] else 2})
    for ids in _FMT_SETS] + [("decode_persistent", {"DP_HEAD_DIM": 128, "DP_STRESS": stress}) for stress in (0, 1)] + [
    ("decode_persistent", {"DP_HEAD_DIM": 128, "DP_PROBE_SKIP": (1 << 2) | (1 << 3) | (1 << 4)})] + [
    ("decode_persistent", {"DP_HEAD_DIM": hd, "DP_STRESS": stress, "WF_FORMATS": format_mask(ids),
                           "GF_QKV_MIN_BLOCKS": 2, "GF_GATE_UP_MIN_BLOCKS": 2})
    for hd, ids in ((128, [10, 12]), (64, [5, 9, 10, 12])) for stress in (0, 1)] + [
    ("gemv_int4", {"LD_STREAM_PREFETCH": 256}), ("gemv_int4", {"LD_STREAM_PREFETCH": 128}),
    ("gemv_int4", {"LD_STREAM_EVICT_FIRST": 0}),
    ("gemm_int4", {"GEMM_BM": 256, "GEMM_PROBE_NO_HIGH_COPY": 1, "GEMM_PROBE_LOW_ONLY": 1,
                   "GEMM_PROBE_SCALES_NO_LOAD": 1})]


@pytest.mark.parametrize("name", KERNELS + DEV_KERNELS)
def test_kernel_compiles_to_sm90a_without_spills(name):
    _check_compiles(name, {})


@pytest.mark.parametrize("name,defines", DEFINE_VARIANTS, ids=[f"{n}-" + ",".join(f"{k}={v}" for k, v in d.items()) for n, d in DEFINE_VARIANTS])
def test_define_variants_compile_without_spills(name, defines):
    _check_compiles(name, defines)


def _check_compiles(name: str, defines: dict) -> None:
    ck = compile_kernel(name, defines=defines)
    table = format_resource_table([ck])
    print(f"\n{name} {defines}: cubin {len(ck.cubin)} B, {'cache hit' if ck.cache_hit else 'compiled'}\n{table}")

    assert ck.cubin[:4] == b"\x7fELF", "a cubin is an ELF image"
    entries = [r for r in ck.resources.values() if r.is_entry]
    assert entries, f"no ptxas report for {name}; log:\n{ck.log}"
    targets = set(re.findall(r"Compiling entry function '[^']+' for '(\w+)'", ck.log))
    assert targets == {ARCH}, f"compiled for {targets}, want {ARCH}"
    spilled = [r for r in ck.resources.values() if r.spills]
    assert not spilled, (
        f"{name}: register spills to local memory in "
        f"{', '.join(r.function for r in spilled)}\n{table}"
    )


# --- the ptxas report parser -------------------------------------------------------------------

# Verbatim from NVRTC 13.0 (sm_90a) on a kernel built to spill, with a non-inlined helper.
SPILLING_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spilly' for 'sm_90a'
ptxas info    : Function properties for spilly
ptxas         .     1536 bytes stack frame, 3112 bytes spill stores, 3248 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1536 bytes cumulative stack size
ptxas info    : Compile time = 277.080 ms
ptxas info    : Function properties for _Z6helperPKfi
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'tiled' for 'sm_90a'
ptxas info    : Function properties for tiled
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0]
"""


def test_parse_ptxas_report():
    r = parse_ptxas_report(SPILLING_LOG)
    assert r["spilly"] == KernelResources(
        "spilly", True, registers=32, spill_stores_bytes=3112, spill_loads_bytes=3248, stack_frame_bytes=1536
    )
    assert r["spilly"].spills
    assert r["_Z6helperPKfi"] == KernelResources("_Z6helperPKfi", False)
    assert r["tiled"] == KernelResources("tiled", True, registers=40, static_smem_bytes=4096, barriers=1)
    assert not r["tiled"].spills
    assert parse_ptxas_report("") == {}


# --- the cubin cache ---------------------------------------------------------------------------


def _tree(root: Path) -> tuple[Path, Path]:
    """A tiny kernels/ + ptx/ tree: k.cu includes a.cuh (via -I) and ../ptx/b.cuh, a.cuh includes c.cuh."""
    kdir, pdir = root / "kernels", root / "ptx"
    kdir.mkdir(parents=True)
    pdir.mkdir()
    (pdir / "a.cuh").write_text(
        '#pragma once\n#include "c.cuh"\n__device__ float fa(float x) { return fc(x) * 2.0f; }\n'
    )
    (pdir / "b.cuh").write_text("#pragma once\n__device__ float fb(float x) { return x - 1.0f; }\n")
    (pdir / "c.cuh").write_text("#pragma once\n__device__ float fc(float x) { return x + 1.0f; }\n")
    (kdir / "k.cu").write_text(
        '#include "a.cuh"\n#include "../ptx/b.cuh"\n#include <cuda_fp16.h>\n'
        'extern "C" __global__ void k(float* y) { y[threadIdx.x] = fb(fa(y[threadIdx.x])) + SCALE; }\n'
    )
    return kdir, pdir


def _compile(kdir: Path, pdir: Path, cache: Path, **kw):
    kw.setdefault("defines", {"SCALE": "1.0f"})
    return compile_kernel("k", kernels_dir=kdir, include_dir=pdir, cache_dir=cache, **kw)


def test_cache_hits_on_second_compile(tmp_path):
    kdir, pdir = _tree(tmp_path / "src")
    first = _compile(kdir, pdir, tmp_path / "cache")
    second = _compile(kdir, pdir, tmp_path / "cache")
    assert not first.cache_hit and second.cache_hit
    assert second.cubin == first.cubin and second.cache_key == first.cache_key
    assert second.resources == first.resources and "k" in second.resources
    assert [h.spelled for h in first.headers] == ["a.cuh", "c.cuh", "../ptx/b.cuh"]


@pytest.mark.parametrize("header", ["a.cuh", "b.cuh", "c.cuh"])
def test_changing_an_included_header_changes_the_key(tmp_path, header):
    """Direct (-I), relative-path and nested includes all feed the key."""
    kdir, pdir = _tree(tmp_path / "src")
    cache = tmp_path / "cache"
    before = _compile(kdir, pdir, cache)
    path = pdir / header
    path.write_text(re.sub(r"\d\.0f", "7.0f", path.read_text()))
    after = _compile(kdir, pdir, cache)
    assert after.cache_key != before.cache_key
    assert not after.cache_hit
    assert after.cubin != before.cubin


def test_options_change_the_key(tmp_path):
    kdir, pdir = _tree(tmp_path / "src")
    cache = tmp_path / "cache"
    a = _compile(kdir, pdir, cache)
    b = _compile(kdir, pdir, cache, defines={"SCALE": "2.0f"})
    c = _compile(kdir, pdir, cache, extra_options=["-DUNUSED=1"])
    assert len({a.cache_key, b.cache_key, c.cache_key}) == 3


def test_key_does_not_depend_on_where_the_tree_lies(tmp_path):
    """Only contents are hashed, so a cubin built on a CPU-only machine serves a GPU machine."""
    kdir1, pdir1 = _tree(tmp_path / "one")
    kdir2, pdir2 = _tree(tmp_path / "two" / "deeper")
    a = _compile(kdir1, pdir1, tmp_path / "cache")
    b = _compile(kdir2, pdir2, tmp_path / "cache")
    assert a.cache_key == b.cache_key and b.cache_hit


def test_damaged_cache_entry_is_recompiled(tmp_path):
    kdir, pdir = _tree(tmp_path / "src")
    cache = tmp_path / "cache"
    first = _compile(kdir, pdir, cache)
    (cubin_file,) = cache.glob("k-*.cubin")
    cubin_file.write_bytes(first.cubin[: len(first.cubin) // 2])  # a torn write
    again = _compile(kdir, pdir, cache)
    assert not again.cache_hit and again.cubin == first.cubin
    assert _compile(kdir, pdir, cache).cache_hit
    assert not list(cache.glob(".*.tmp")), "temporary files left behind"


def test_compile_error_carries_the_log(tmp_path):
    kdir, pdir = _tree(tmp_path / "src")
    (kdir / "bad.cu").write_text('extern "C" __global__ void bad(float* y) { y[0] = undeclared_name; }\n')
    with pytest.raises(NvrtcError) as info:
        compile_kernel("bad", kernels_dir=kdir, include_dir=pdir, cache_dir=tmp_path / "cache")
    assert info.value.error_name == "NVRTC_ERROR_COMPILATION"
    assert "undeclared_name" in info.value.log and "bad.cu" in str(info.value)


def test_missing_kernel_names_the_ones_that_exist(tmp_path):
    kdir, pdir = _tree(tmp_path / "src")
    with pytest.raises(FileNotFoundError, match="kernels here: k"):
        compile_kernel("nope", kernels_dir=kdir, include_dir=pdir, cache_dir=tmp_path / "cache")


def test_real_kernels_copied_elsewhere_compile(tmp_path):
    """The installed-wheel layout (kernels and ptx in other folders) compiles too."""
    kdir, pdir = tmp_path / "_kernels", tmp_path / "_ptx"
    shutil.copytree(kernels_dir(), kdir)
    shutil.copytree(ptx_dir(), pdir)
    ck = compile_kernel("smoke", kernels_dir=kdir, include_dir=pdir, cache_dir=tmp_path / "cache")
    assert {"smoke_axpb", "smoke_add_f16", "smoke_echo_tensormap"} <= set(ck.resources)


def test_a_cached_log_without_the_report_is_a_miss(tmp_path, monkeypatch):
    """NVRTC can hand back a log without the ptxas report (a hit in its compute cache): the cache
    never hands such an entry out, the next compile runs NVRTC again."""
    from drvqwen.cuda import nvrtc as nv

    kdir, pdir = _tree(tmp_path / "src")
    cache = tmp_path / "cache"
    real = nv._nvrtc_compile
    calls = []

    def lossy(source, options):
        cubin, log = real(source, options)
        calls.append(source.name)
        return cubin, ("" if len(calls) == 1 else log)  # the first compile loses its report

    monkeypatch.setattr(nv, "_nvrtc_compile", lossy)
    first = _compile(kdir, pdir, cache)
    assert len(calls) == 1 and first.resources == {} and not first.cache_hit
    second = _compile(kdir, pdir, cache)  # the report-less entry is a miss: compiled again, complete
    assert len(calls) == 2 and "k" in second.resources and not second.cache_hit
    assert _compile(kdir, pdir, cache).cache_hit  # the complete result was cached

    # An entry cached with an empty log (by an earlier version) is a miss, compiled again.
    (meta_file,) = cache.glob("k-*.json")
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "log": ""}))
    again = _compile(kdir, pdir, cache)
    assert not again.cache_hit and "k" in again.resources


def test_nvrtc_compute_cache_is_off():
    """With it on, a repeated compile comes from NVRTC's cache and its log has no ptxas report."""
    assert os.environ.get("CUDA_CACHE_DISABLE") == "1"


def test_an_empty_log_leaves_the_shared_one_byte_string_alone():
    """An empty NVRTC log is 1 byte (its NUL); read into `b" " * 1`, CPython's shared b" ", it
    would turn every b" " of the process into b"\\0"."""
    from cuda.bindings import nvrtc

    from drvqwen.cuda import nvrtc as nv

    err, prog = nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void k() {}', b"k.cu", 0, [], [])
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [f"--gpu-architecture={ARCH}".encode()])
        assert not err
        assert nv._program_log(prog) == ""
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    assert bytes([32])[0] == 32  # CPython's shared one-byte b" "


# The decode GEMVs' launch shapes count on two 256-thread blocks per SM (docs/kernels.md, "Launch
# shape"; gemv_f16.cu's header): at most 128 registers a thread. Their __launch_bounds__ name the
# threads only, so ptxas may take more without spilling — a slower step with no spill to report
# (zeroing gemv_int4.cu's batches, GEMV_ZERO_BATCHES, takes 134–154).
# (The 16-token build of the verify pass is not one of them: 161–181, one block per SM by design.)
@pytest.mark.parametrize("name", ["gemv_int4", "gemv_f16"])
def test_decode_gemvs_fit_two_blocks_per_sm(name):
    ck = compile_kernel(name)
    over = {f: r.registers for f, r in ck.resources.items() if r.is_entry and r.registers > 128}
    assert not over, f"{name}: more than 128 registers (one 256-thread block per SM): {over}"
    if name == "gemv_int4":  # the check can fail: the zeroed build takes more
        zeroed = compile_kernel(name, defines={"GEMV_ZERO_BATCHES": 1})
        assert any(r.registers > 128 for r in zeroed.resources.values() if r.is_entry)
