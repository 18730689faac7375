"""The decode step's L2 prefetch as planned (launchers/l2_prefetch.py, no GPU): every span is the
first tiles of every block of the GEMV it is for, inside its buffer and of sizes the bulk prefetch
takes; the budget picks whole GEMVs in order, then every block's first tiles of the next; the
launch sits between each layer's qkv_rope and attention, and the next layer's q/k/v prefetch
after down_proj; what cannot take them is refused in one line. (That the step gives the same bits with it: tests/test_decode_step.py on the GPU.)"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import bench
from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.decode import plan_decode
from drvqwen.errors import DrvqwenError
from drvqwen.launchers import BufferSpec, FixedOccupancy, GemvInt4GateUpSwiglu, GemvInt4Residual, LaunchError
from drvqwen.launchers.l2_prefetch import (CHUNK_BYTES, DEFAULT_BLOCKS, SPANS, L2Prefetch, L2Span, gemv_spans,
                                          l2_prefetch_spans)

OCC = FixedOccupancy(132, lambda _k, _t, _s: 2)


def _int4(name: str, n: int, k: int):
    """(qweight, scales) as the GEMVs read them: qweight in the device layout (format/int4_tiles.py),
    where tile j's 16 rows are 16 · K/2 contiguous bytes from j · 16 · K/2, as in layout id 1."""
    return (BufferSpec(f"{name}.qweight", (-(-n // 16), k // 128, 16, 16), np.uint32),
            BufferSpec(f"{name}.scales", (n, k // 128), np.float16))


def _layer_gemvs(cfg):
    D, F = cfg.hidden_size, cfg.intermediate_size
    res = BufferSpec("residual", (D,), np.float32)
    o = GemvInt4Residual(res, BufferSpec("attn", (cfg.q_dim,), np.float16), *_int4("o", D, cfg.q_dim), n=D,
                         k=cfg.q_dim, occupancy=OCC)
    gu = GemvInt4GateUpSwiglu(BufferSpec("h", (F,), np.float16), res, BufferSpec("w_post", (D,), np.float16),
                              *_int4("gate", F, D), *_int4("up", F, D), f=F, k=D, eps=1e-6, occupancy=OCC)
    d = GemvInt4Residual(res, BufferSpec("h", (F,), np.float16), *_int4("down", D, F), n=D, k=F, occupancy=OCC)
    return o, gu, d


@pytest.mark.parametrize("cfg", [QWEN25_CODER_7B, QWEN25_CODER_05B], ids=["7b", "0.5b"])
@pytest.mark.parametrize("tiles_per_block", [1, 2])
def test_spans_are_every_blocks_first_tiles(cfg, tiles_per_block):
    """Part b of a span is the start of block b's tile range [b·T/G, (b+1)·T/G) (gemv_int4.cu's
    split, from the launch's own grid), tiles_per_block tiles of 16 rows long in the codes
    (16 · K/2 bytes a tile) and in the scales (16 · K/128 fp16), never past the block's range
    nor the buffer, each a multiple of 16 bytes from a multiple of 16."""
    split = 0                                 # GEMVs checked part by part (not whole)
    for gemv in _layer_gemvs(cfg):
        spec = gemv.specs[0]
        G = spec.grid[0]
        n = spec.args["N"].value if "N" in spec.args else spec.args["F"].value
        K = spec.args["K"].value
        T = -(-n // 16)
        spans = gemv_spans(gemv, tiles_per_block)
        weights = [v for name, v in spec.args.items() if name.endswith(("qweight", "scales"))]
        assert [s.buffer for s in spans] == weights
        if tiles_per_block >= -(-T // G):     # as many tiles as the largest block owns: the whole buffers
            assert all(s.parts == 1 and s.n_bytes == s.buffer.nbytes for s in spans)
            continue
        split += 1
        for s in spans:
            row_bytes = K // 2 if s.buffer.name.endswith("qweight") else K // 128 * 2
            ranges = s.ranges()
            assert len(ranges) == G
            for b, (off, size) in enumerate(ranges):
                first, end = b * T // G, (b + 1) * T // G
                assert off == first * 16 * row_bytes
                assert size == min(tiles_per_block, end - first) * 16 * row_bytes or off + size == s.buffer.nbytes
                assert off % 16 == 0 and size % 16 == 0 and off + size <= s.buffer.nbytes
    assert split >= 1 or tiles_per_block > 1  # one tile: gate_up's blocks own more at both sizes


def test_the_budget_takes_whole_gemvs_in_order_then_every_blocks_first_tiles():
    o, gu, d = _layer_gemvs(QWEN25_CODER_7B)
    o_bytes = sum(b.nbytes for b in (o.specs[0].args["qweight"], o.specs[0].args["scales"]))
    assert l2_prefetch_spans([o, gu, d], o_bytes - 16) == []            # o_proj does not fit: nothing
    whole_o = l2_prefetch_spans([o, gu, d], o_bytes)
    assert [s.buffer.name for s in whole_o] == ["o.qweight", "o.scales"] and all(s.parts == 1 for s in whole_o)
    G = gu.specs[0].grid[0]
    one_tile_row = G * 2 * (16 * 3584 // 2 + 16 * 28 * 2)               # one tile of every block, gate and up
    spans = l2_prefetch_spans([o, gu, d], o_bytes + 2 * one_tile_row + one_tile_row // 2)
    assert [s.buffer.name for s in spans] == ["o.qweight", "o.scales", "gate.qweight", "gate.scales", "up.qweight",
                                              "up.scales"]                # down not reached: gate_up did not fit
    assert all(s.parts == G and s.head_bytes // s.unit_bytes == 2 for s in spans[2:])
    assert sum(s.n_bytes for s in spans) <= o_bytes + 2 * one_tile_row + one_tile_row // 2
    everything = l2_prefetch_spans([o, gu, d], 10**9)
    assert len(everything) == 8 <= SPANS and all(s.parts == 1 for s in everything)


def test_plan_puts_it_between_qkv_rope_and_attention_in_every_layer():
    cfg = QWEN25_CODER_05B.with_layers(3)
    plain = plan_decode(cfg, 256, occupancy=OCC)
    plan = plan_decode(cfg, 256, occupancy=OCC, l2_prefetch_bytes=8_000_000)
    names = [n for n, _l in plan.steps]
    assert [n for n in names if not n.endswith("l2_prefetch")] == [n for n, _l in plain.steps]
    for l in range(3):
        assert names[names.index(f"L{l}.qkv_rope") + 1] == f"L{l}.l2_prefetch"
        pf = dict(plan.steps)[f"L{l}.l2_prefetch"]
        assert isinstance(pf, L2Prefetch) and pf.specs[0].writes == ()
        assert {s.buffer.name.split(".")[-2] for s in pf.spans} == {"o_proj", "gate_proj", "up_proj", "down_proj"}
        assert all(s.buffer.name.startswith(f"model.layers.{l}.") for s in pf.spans)
        # Every launch after it is the one without it, launch for launch (grids included).
        steps = dict(plan.steps)
        assert [sp.grid for _n, ln in plain.steps for sp in ln.specs] == \
               [sp.grid for n, ln in plan.steps if not n.endswith("l2_prefetch") for sp in ln.specs]
        assert pf.specs[0].grid[0] <= OCC.sm_count and steps[f"L{l}.l2_prefetch"].specs[0].kernel.pdl
    # The next layer's q/k/v, whole, after down_proj — in every layer but the last.
    plan = plan_decode(cfg, 256, occupancy=OCC, l2_prefetch_qkv=True)
    names = [n for n, _l in plan.steps]
    assert [n for n in names if not n.endswith("l2_prefetch_qkv")] == [n for n, _l in plain.steps]
    for l in range(2):
        assert names[names.index(f"L{l}.down_proj") + 1] == f"L{l}.l2_prefetch_qkv"
        pf = dict(plan.steps)[f"L{l}.l2_prefetch_qkv"]
        assert [s.buffer.name for s in pf.spans] == [f"model.layers.{l + 1}.self_attn.{p}_proj.{t}"
                                                     for p in "qkv" for t in ("qweight", "scales")]
        assert all(s.parts == 1 and s.n_bytes == s.buffer.nbytes for s in pf.spans)
    assert "L2.l2_prefetch_qkv" not in names
    # A budget too small for o_proj's first tiles would plan nothing: refused, saying what it takes.
    with pytest.raises(DrvqwenError, match=r"^l2_prefetch_bytes=1000: below what o_proj's blocks read first \(\d+ B"):
        plan_decode(cfg, 256, occupancy=OCC, l2_prefetch_bytes=1000)


def test_what_cannot_take_it_is_refused():
    cfg = QWEN25_CODER_05B.with_layers(1)
    with pytest.raises(DrvqwenError, match="^l2_prefetch_bytes=-1: want ≥ 0"):
        plan_decode(cfg, 256, occupancy=OCC, l2_prefetch_bytes=-1)
    buf = BufferSpec("w", (4096,), np.uint8)
    with pytest.raises(LaunchError, match=f"{SPANS + 1} spans; a launch takes 1 to {SPANS}$"):
        L2Prefetch([L2Span.whole(buf)] * (SPANS + 1), occupancy=OCC)
    with pytest.raises(LaunchError, match="each a multiple of 16"):
        L2Prefetch([L2Span(buf, 4096, 4, 4, 1024, 1000)], occupancy=OCC)
    with pytest.raises(LaunchError, match="8192 B of a 4096-byte buffer"):
        L2Prefetch([L2Span(buf, 8192, 1, 1, 0, 8192)], occupancy=OCC)
    with pytest.raises(LaunchError, match="not read in row tiles; no weight_tiles"):
        from drvqwen.launchers import GemvInt4QkvRope
        cls = GemvInt4QkvRope.__new__(GemvInt4QkvRope)
        cls.weight_tiles()


def test_the_launch_shares_its_chunks_over_the_sms():
    buf = BufferSpec("w", (10 * CHUNK_BYTES + 4096,), np.uint8)
    one = L2Prefetch([L2Span.whole(buf)], occupancy=OCC)
    assert one.specs[0].grid == (11,) and one.bytes_moved == buf.nbytes
    many = [L2Span(buf, buf.nbytes, 1000, 1000, 16, 16)]
    assert L2Prefetch(many, occupancy=OCC).specs[0].grid == (DEFAULT_BLOCKS,) and DEFAULT_BLOCKS < OCC.sm_count
    assert L2Prefetch(many, occupancy=OCC, blocks=500).specs[0].grid == (OCC.sm_count,)
    assert L2Prefetch(many, occupancy=OCC, blocks=7).specs[0].grid == (7,)
    with pytest.raises(LaunchError, match="blocks=0; want ≥ 1"):
        L2Prefetch(many, occupancy=OCC, blocks=0)
    # plan_decode hands its choice to every prefetch launch.
    plan = plan_decode(QWEN25_CODER_05B.with_layers(2), 256, occupancy=OCC, l2_prefetch_bytes=10**8,
                       l2_prefetch_qkv=True, l2_prefetch_blocks=5)
    assert [ln.specs[0].grid for n, ln in plan.steps if "l2_prefetch" in n] == [(5,)] * 3


@pytest.mark.parametrize("mb", [-1.0, float("nan"), float("inf"), 1e-9])
def test_bench_refuses_a_budget_that_is_not_a_finite_byte_count_before_any_gpu_work(tmp_path, mb):
    """Negative, NaN, infinite, or below a byte (it would plan nothing while the JSON records it)."""
    with pytest.raises(bench.DrvqwenError, match=rf"^--l2-prefetch-mb {mb}: need 0 \(off\) or a finite budget"):
        bench.run_bench(tmp_path / "absent.nanoqwen", l2_prefetch_mb=mb)


def test_bench_budget_in_bytes():
    assert bench.l2_prefetch_budget_bytes(0.0) == 0 and bench.l2_prefetch_budget_bytes(21) == 21_000_000
    assert bench.l2_prefetch_budget_bytes(1e-6) == 1


@pytest.mark.parametrize("cfg", [QWEN25_CODER_7B.with_layers(2), QWEN25_CODER_05B.with_layers(2)], ids=["7b", "0.5b"])
def test_per_tensor_formats_prefetch_every_stored_part(cfg):
    """A model in llama.cpp's Q4_K_M formats: the spans are every stored part of o_proj, gate,
    up and down (codes, high bits, scales, super-scales: up to 4 a weight), each cut in the
    GEMV's own row tiles (16 rows of the part), and the next layer's q/k/v parts whole."""
    from test_kernel_signatures import gguf_like_formats

    plan = plan_decode(cfg, 256, occupancy=OCC, formats=gguf_like_formats(cfg), l2_prefetch_bytes=10**9,
                       l2_prefetch_qkv=True)
    steps = dict(plan.steps)
    pf = steps["L0.l2_prefetch"]
    want = [b for n in ("o_proj", "gate_up_swiglu", "down_proj") for b in steps[f"L0.{n}"].specs[0].args.values()
            if getattr(b, "name", "").startswith(("model.layers.0.mlp.", "model.layers.0.self_attn."))]
    assert [s.buffer for s in pf.spans] == want and len(want) > 8
    assert all(s.parts == 1 and s.n_bytes == s.buffer.nbytes // 16 * 16 for s in pf.spans)
    gu = steps["L0.gate_up_swiglu"]
    T, G, tiles = gu.weight_tiles()
    assert G == gu.specs[0].grid[0] and T == -(-cfg.intermediate_size // 16)
    for buf, tile_bytes in tiles:
        assert tile_bytes * T == buf.nbytes * 16 * T // cfg.intermediate_size and tile_bytes % 16 == 0
    heads = gemv_spans(gu, 1)
    assert all(s.parts == G and s.head_bytes == s.unit_bytes for s in heads) or -(-T // G) == 1
    qkv = steps["L0.l2_prefetch_qkv"]
    assert {s.buffer.name.rsplit(".", 1)[0] for s in qkv.spans} == {f"model.layers.1.self_attn.{p}_proj"
                                                                    for p in "qkv"}


def test_a_misaligned_buffer_is_refused_when_the_launch_is_built():
    from drvqwen.cuda import DeviceArray

    ln = L2Prefetch([L2Span.whole(BufferSpec("w", (4096,), np.uint8))], occupancy=OCC)
    odd = DeviceArray("w", (1 << 20) + 8, (4096,), np.uint8)
    with pytest.raises(LaunchError, match="^l2_prefetch: w at 0x100008 is not 16-byte aligned$"):
        ln.build(lambda _spec: odd)


def test_a_planned_span_without_a_resolver_reaches_launchers_own_check():
    """Launcher.launches calls build() with no resolver (DecodeStep's launch list does, once the
    plan is built, and gets the built launches back): the alignment check must pass a planned
    span, which has no address, on to Launcher.build instead of formatting the missing address;
    an unbuilt plan is then refused with Launcher.build's own message."""
    ln = L2Prefetch([L2Span.whole(BufferSpec("w", (4096,), np.uint8))], occupancy=OCC)
    with pytest.raises(LaunchError, match="build the launcher with a resolver"):
        ln.build()
