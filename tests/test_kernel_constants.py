"""Every constant Python mirrors from a kernel file equals the kernel's own (no GPU needed).

The launchers size grids, blocks and shared memory from numbers the kernels define (thread
counts, tiles, stages, shared-memory layouts). Each is declared once on the Python side with
`launchers.base.mirrored(file, C expression, value)`; here NVRTC compiles each kernel file with
`static_assert((expression) == value)` appended, so a kernel edit that changes one of them fails
in CI, on the CPU, before any launch could read or write the wrong bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

import drvqwen.launchers  # noqa: F401  (importing every launcher module registers its constants)
from drvqwen.cuda.errors import NvrtcError
from drvqwen.cuda.nvrtc import _nvrtc_compile, build_options
from drvqwen.cuda.toolchain import cuda_include_dir
from drvqwen.cuda.sources import kernel_source, ptx_dir
from drvqwen.launchers.base import MIRRORED

BY_FILE: dict[str, list[tuple[str, int]]] = defaultdict(list)
for _file, _expr, _value in MIRRORED:
    BY_FILE[_file].append((_expr, _value))


def _compile_with(name: str, checks: list[tuple[str, int]]) -> None:
    source = kernel_source(name)
    asserts = "".join(f'\nstatic_assert(({expr}) == {value}, "Python mirrors {expr} as {value}");'
                      for expr, value in checks)
    checked = replace(source, text=source.text + asserts.encode())
    _nvrtc_compile(checked, [*build_options(), f"-I{ptx_dir()}", f"-I{cuda_include_dir()}"])


def test_every_launcher_module_mirrors_something():
    assert {"embedding", "rmsnorm", "gemv_int4", "attention_decode", "attention_decode_tma",
            "attention_prefill", "gemv_f16", "argmax", "gemm_int4", "sampling", "rope_kv"} <= set(BY_FILE)


@pytest.mark.parametrize("name", sorted(BY_FILE))
def test_mirrored_constants_match_the_kernel(name):
    print(f"\n{name}.cu: " + ", ".join(f"{e} = {v}" for e, v in BY_FILE[name]))
    _compile_with(name, BY_FILE[name])


def test_a_drifted_constant_fails():
    expr, value = BY_FILE["rmsnorm"][0]
    with pytest.raises(NvrtcError, match="Python mirrors"):
        _compile_with("rmsnorm", [(expr, value + 1)])
