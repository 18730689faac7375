"""tools/changed_kernels.py on the CPU (NVRTC, no GPU): an entry point whose machine code changed
or that is new is reported, one whose source changed only in a comment is not; the entry
points are read from the cubin's own symbol table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import changed_kernels as ck  # noqa: E402

from drvqwen.cuda.nvrtc import compile_kernel  # noqa: E402

BASE_K = """#include "h.cuh"
extern "C" __global__ void ka(float* y) { y[threadIdx.x] = twice(y[threadIdx.x]) + 1.0f; }
extern "C" __global__ void kb(float* y) { y[threadIdx.x] *= 3.0f; }
"""


def _tree(root: Path, k_source: str, header: str = "__device__ float twice(float x) { return 2.0f * x; }\n") -> Path:
    (root / "kernels").mkdir(parents=True)
    (root / "ptx").mkdir()
    (root / "ptx" / "h.cuh").write_text("#pragma once\n" + header)
    (root / "kernels" / "k.cu").write_text(k_source)
    return root


def test_the_entry_points_are_read_from_the_cubin(tmp_path):
    t = _tree(tmp_path / "t", BASE_K)
    c = compile_kernel("k", kernels_dir=t / "kernels", include_dir=t / "ptx", cache_dir=tmp_path / "cache")
    code = ck.entry_code(c.cubin)
    assert sorted(code) == ["ka", "kb"] and code["ka"] != code["kb"]
    with pytest.raises(ValueError, match="not a 64-bit"):
        ck.entry_code(b"\x7fELF\x01" + bytes(60))


def test_a_code_change_and_a_new_entry_are_reported_a_comment_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("DRVQWEN_CACHE", str(tmp_path / "cache"))
    base = _tree(tmp_path / "base", BASE_K)
    head_source = (BASE_K.replace("+ 1.0f", "+ 2.0f")                       # ka: other code
               .replace("*= 3.0f; }", "*= 3.0f; /* why three */ }")          # kb: a comment only
               + 'extern "C" __global__ void kc(float* y) { y[0] = 0.0f; }\n')  # kc: new
    head = _tree(tmp_path / "head", head_source)
    rows = ck.changed(base, head, [("k", {})])
    assert [(r["entry"], r["status"]) for r in rows] == [("ka", "changed"), ("kc", "new")]
    assert ck.changed(base, base, [("k", {})]) == []


def test_a_header_change_reaches_the_entries_that_inline_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DRVQWEN_CACHE", str(tmp_path / "cache"))
    base = _tree(tmp_path / "base", BASE_K)
    head = _tree(tmp_path / "head", BASE_K, header="__device__ float twice(float x) { return x + x + 0.5f; }\n")
    assert [r["entry"] for r in ck.changed(base, head, [("k", {})])] == ["ka"]
    # A kernel file the base lacks: all its entries are new.
    (head / "kernels" / "k2.cu").write_text('extern "C" __global__ void kd(float* y) { y[1] = 1.0f; }\n')
    assert [(r["entry"], r["status"]) for r in ck.changed(base, head, [("k2", {})])] == [("kd", "new")]


def test_base_tree_from_git_and_its_refusal(tmp_path):
    tree = ck.base_tree("HEAD", tmp_path / "base")
    assert (tree / "kernels" / "smoke.cu").is_file() and (tree / "ptx").is_dir()
    with pytest.raises(SystemExit, match="^changed_kernels: no-such-ref: not a commit of this repository$"):
        ck.base_tree("no-such-ref", tmp_path / "other")


def test_build_arguments():
    assert ck.parse_build("gemv_int4:GEMV_TOKENS=16") == ("gemv_int4", {"GEMV_TOKENS": 16})
    assert ck.parse_build("attention_prefill_wgmma:APW_WARPGROUPS=3,APW_Q_SMEM=1") == (
        "attention_prefill_wgmma", {"APW_WARPGROUPS": 3, "APW_Q_SMEM": 1})
    assert ck.parse_build("smoke") == ("smoke", {})
    for bad in ("gemv_int4:GEMV_TOKENS", ":A=1", "attention_prefill_wgmma:X=a"):
        with pytest.raises(Exception, match="--build"):
            ck.parse_build(bad)
