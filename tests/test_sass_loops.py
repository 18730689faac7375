"""tools/sass_loops.py's reading of `cuobjdump -sass` text (no GPU, no cuobjdump): functions,
loops, their counts, and the loads whose value is read soon after them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import sass_loops as sl  # noqa: E402


def _line(offset: int, text: str) -> str:
    # cuobjdump's layout: the offset comment, the instruction, its encoding; a second line with
    # the other half of the encoding.
    return (f"        /*{offset:04x}*/                   {text} ;      /* 0x000fe20000000800 */\n"
            "                                                                /* 0x000fe20000000800 */\n")


def _sass(body: list[str], name: str = "k") -> str:
    text = f"\n\t\tFunction : {name}\n\t.headerflags\t@\"EF_CUDA_SM90\"\n"
    return text + "".join(_line(16 * i, t) for i, t in enumerate(body))


# A loop (offsets 0x10 … 0x90) with: a batch's scale load read at once (the stall), a weight load
# read only by the next iteration's hand-over MOV, a local store and load, one MMA; an MMA-less
# loop after it.
BODY = [
    "MOV R2, RZ",                                            # 0x00
    "LDG.E.U16.CONSTANT R8, desc[UR4][R2.64]",               # 0x10  loop start
    "HADD2.F32 R9, -RZ, R8.H0_H0",                           # 0x20  reads R8: distance 1
    "LDG.E.NA.128.CONSTANT R12, desc[UR4][R4.64]",           # 0x30  R12..R15
    "STL [R1+0x10], R9",                                     # 0x40
    "HMMA.16816.F32 R20, R24, R28, R20",                     # 0x50
    "LDL R9, [R1+0x10]",                                     # 0x60
    "ISETP.NE.AND P0, PT, R2, R3, PT",                       # 0x70
    "@P0 BRA 0x10",                                          # 0x80  back edge (read of R12 next: none)
    "MOV R24, R13",                                          # 0x90  after the loop
    "@!P0 BRA 0x90",                                         # 0xa0  a loop without an MMA
    "EXIT",                                                  # 0xb0
]


def test_functions_and_opcodes():
    f = sl.functions(_sass(BODY, "kern") + _sass(["EXIT"], "other"))
    assert list(f) == ["kern", "other"]
    assert f["kern"][1] == (0x10, "LDG.E.U16.CONSTANT R8, desc[UR4][R2.64]")
    assert sl.opcode("@!P0 BRA 0x90") == "BRA" and sl.opcode("LDG.E.NA.128.CONSTANT R12, [R4.64]") == "LDG.E.NA.128.CONSTANT"


def test_registers_of_an_instruction():
    assert sl.registers("LDG.E.128 R12, desc[UR4][R4.64]") == ({12}, {4, 5})
    assert sl.registers("STL [R1+0x10], R9") == (set(), {1, 9})
    assert sl.registers("HMMA.16816.F32 R20, R24, R28, R20") == ({20}, {24, 28, 20})
    assert sl.registers("@P0 FFMA R5, R40, R36, R5") == ({5}, {40, 36, 5})
    assert sl.registers("MOV R3, RZ") == ({3}, set())


def test_loops_count_and_find_the_early_read():
    (loop,) = sl.loops(sl.functions(_sass(BODY))["k"], near=32)
    assert (loop.start, loop.end, loop.instructions) == (0x10, 0x80, 8)
    assert (loop.mma, loop.global_loads, loop.local_ops) == (1, 2, 2)
    # The scale load is read by the very next instruction; the weight load is never read inside
    # the loop (its MOV lies after the back edge), so it is not listed.
    assert [(u["load"], u["distance"], u["at"]) for u in loop.near_uses] == [("0x10 LDG.E.U16.CONSTANT", 1, "0x20")]
    assert sl.loops(sl.functions(_sass(BODY))["k"], near=1)[0].near_uses == []


def test_a_read_around_the_back_edge_counts_its_distance_in_loop_order():
    body = [
        "HMMA.16816.F32 R20, R24, R28, R20",                # 0x00  loop start: reads R24 (loaded below)
        "LDG.E.128 R24, desc[UR4][R4.64]",                  # 0x10
        "IADD3 R2, R2, 0x1, RZ",                            # 0x20
        "BRA 0x0",                                          # 0x30
    ]
    (loop,) = sl.loops(sl.functions(_sass(body))["k"], near=32)
    assert [(u["distance"], u["at"]) for u in loop.near_uses] == [(3, "0x0")]


def test_a_rewrite_before_any_read_is_not_a_use():
    body = [
        "LDG.E R8, desc[UR4][R2.64]",                       # 0x00
        "MOV R8, RZ",                                       # 0x10  overwritten: the load was dead
        "FADD R9, R8, R8",                                  # 0x20
        "HMMA.16816.F32 R20, R24, R28, R20",                # 0x30
        "BRA 0x0",                                          # 0x40
    ]
    (loop,) = sl.loops(sl.functions(_sass(body))["k"])
    assert loop.near_uses == []


def test_async_copies_to_shared_memory_are_not_loads_into_registers():
    body = [
        "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",       # 0x00  cp.async: R3 is an address
        "IADD3 R3, R3, 0x10, RZ",                           # 0x10
        "LDGDEPBAR",                                        # 0x20
        "HMMA.16816.F32 R20, R24, R28, R20",                # 0x30
        "BRA 0x0",                                          # 0x40
    ]
    (loop,) = sl.loops(sl.functions(_sass(body))["k"])
    assert loop.global_loads == 0 and loop.near_uses == []
    assert sl.is_global_load("LDG.E.128.CONSTANT") and not sl.is_global_load("LDGSTS.E.BYPASS.128")


def test_missing_cuobjdump_and_bad_defines_are_one_line_errors(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))                      # no cuobjdump here
    monkeypatch.setattr(sys, "argv", ["sass_loops.py", "smoke"])
    assert sl.main() == 2
    assert capsys.readouterr().err == ("error: cuobjdump is not on PATH (CUDA's binary utilities: "
                                       "pip download nvidia-cuda-cuobjdump)\n")
    fake = tmp_path / "cuobjdump"                                  # present, never reached
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "argv", ["sass_loops.py", "smoke", "--define", "GEMV_UNROLL"])
    assert sl.main() == 2
    assert capsys.readouterr().err == "error: --define 'GEMV_UNROLL': expected NAME=INTEGER\n"


def test_copies_add_the_producer_loops_without_an_mma():
    """With copies=True a loop holding cp.async (LDGSTS) or a TMA copy (UTMALDG) and no MMA is
    listed with its copy count; without it only the MMA loops are; a loop with neither never is."""
    body = [
        "MOV R2, RZ",                                            # 0x00
        "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",            # 0x10  producer loop start
        "LDGSTS.E.BYPASS.128 [R3+0x400], desc[UR4][R6.64]",      # 0x20
        "UTMALDG.2D [UR8], [UR10]",                              # 0x30
        "IADD3 R2, R2, 0x1, RZ",                                 # 0x40
        "@P0 BRA 0x10",                                          # 0x50  back edge
        "IADD3 R9, R9, 0x1, RZ",                                 # 0x60  a loop with neither
        "@P1 BRA 0x60",                                          # 0x70
        "EXIT",                                                  # 0x80
    ]
    ins = sl.functions(_sass(body))["k"]
    assert sl.loops(ins) == []
    (loop,) = sl.loops(ins, copies=True)
    assert (loop.start, loop.end, loop.instructions, loop.copies, loop.mma) == (0x10, 0x50, 5, 3, 0)
    # An MMA loop counts its copies too, listed either way.
    (mma_loop,) = sl.loops(sl.functions(_sass(BODY))["k"], copies=True)
    assert mma_loop.mma == 1 and mma_loop.copies == 0
