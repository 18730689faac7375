"""The persistent decode step (kernels/decode_persistent.cu, launchers/decode_persistent.py).

CPU part (runs in CI):
- each op's argument struct lists its kernel's parameters — names and kinds, in order — so the
  program the host packs with the kernel's parameter layout is what the item functions read;
- the plan: one op per planned launch from the embedding through the last layer, in order; the
  items of each op (the attention's pairs of planned blocks, the L2 prefetches' planned blocks);
  the program's size; a model in per-tensor formats (the format ops, its build's WF_FORMATS);
  the refusals (the TMA attention, INT4 GEMVs in a build for formats and format ops in one
  without).

GPU part (@pytest.mark.gpu): the persistent step in a CUDA graph equals the per-launch step run
eagerly, bit for bit — the fp32 logits of every step and every token — over 600 generated tokens
across ≥ 37 page boundaries, for the 0.5B shape and 2 layers at the 7B widths (head dims 64 and
128), each in INT4 and in llama.cpp's Q4_K_M layout (the format GEMVs as ops), in the normal
build and in the stress build (random delays before every item, so blocks
meet their counters in orders a quiet GPU never shows: racecheck and synccheck do not see the
ordering between blocks, this does). And with the step's L2 prefetches as ops of the program
(test_persistent_with_l2_prefetch, stress build, 40 steps).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import numpy as np
import pytest

from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.cuda.sources import kernels_dir
from drvqwen.decode import plan_decode
from drvqwen.errors import DrvqwenError
from drvqwen.format import weight_formats as wf
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.launchers.base import FixedOccupancy, LaunchError
from drvqwen.launchers.decode_persistent import KINDS, OP_BYTES, arg_struct, program_bytes
from drvqwen.launchers.signatures import _preprocess, kernel_signatures, param_kind

# ---- CPU: argument structs against the kernels' parameter lists --------------------------------

STRUCTS = {  # kernel file, kernel, its argument struct
    ("embedding", "embedding"): "EmbeddingArgs",
    ("gemv_int4", "gemv_int4_qkv_rope"): "GemvInt4QkvRopeArgs",
    ("gemv_int4", "gemv_int4_residual"): "GemvInt4ResidualArgs",
    ("gemv_int4", "gemv_int4_gate_up_swiglu"): "GemvInt4GateUpSwigluArgs",
    ("attention_decode", "attention_decode_hd64"): "AttentionDecodeArgs",
    ("attention_decode", "attention_decode_hd128"): "AttentionDecodeArgs",
    ("attention_decode", "attention_combine"): "AttentionCombineArgs",
    ("l2_prefetch", "l2_prefetch"): "L2PrefetchArgs",
    ("gemv_fmt", "embedding_fmt"): "EmbeddingFmtArgs",
    ("gemv_fmt", "gemv_fmt_qkv_rope"): "GemvFmtQkvRopeArgs",
    ("gemv_fmt", "gemv_fmt_residual"): "GemvFmtResidualArgs",
    ("gemv_fmt", "gemv_fmt_gate_up_swiglu"): "GemvFmtGateUpSwigluArgs",
}


def struct_fields(text: str, name: str) -> list[tuple[str, str]]:
    """(name, kind) of every field of `struct name { … };` in a kernel file's text (declarators
    separated by commas share their type)."""
    m = re.search(rf"struct\s+{name}\s*\{{(.*?)\}};", _preprocess(text), re.DOTALL)
    assert m, f"no struct {name}"
    out = []
    for decl in (d.strip() for d in m.group(1).split(";")):
        if not decl:
            continue
        first = re.fullmatch(r"(.*?)(\w+)\s*(,.*)?", decl, re.DOTALL)
        ctype = " ".join(first.group(1).split())
        names = [first.group(2)] + [n.strip() for n in (first.group(3) or "").split(",") if n.strip()]
        out += [(n, param_kind(ctype)) for n in names]
    return out


def test_every_op_kernel_has_its_struct():
    assert {k for _f, k in STRUCTS} == set(KINDS)


@pytest.mark.parametrize("file,kernel", list(STRUCTS))
def test_argument_struct_lists_the_kernel_parameters(file, kernel):
    text = (kernels_dir() / f"{file}.cu").read_text(encoding="utf-8")
    params = [(p.name, p.kind) for p in kernel_signatures(text)[kernel].params]
    if kernel == "l2_prefetch":  # L2PrefetchArgs is L2Span spans[L2P_SPANS]: span i's fields are <field>i
        from drvqwen.launchers.l2_prefetch import SPANS

        assert re.search(r"struct\s+L2PrefetchArgs\s*\{\s*L2Span\s+spans\[L2P_SPANS\];\s*\};", _preprocess(text))
        fields = [(f"{name}{i}", kind) for i in range(SPANS) for name, kind in struct_fields(text, "L2Span")]
    else:
        fields = struct_fields(text, STRUCTS[file, kernel])
    assert fields == params


def test_arg_struct_has_the_c_layout():
    import ctypes

    st = arg_struct([ctypes.c_int32(1), ctypes.c_uint64(2), ctypes.c_float(3.0), ctypes.c_int32(4)])
    assert [getattr(st, f).offset for f, _t in st._fields_] == [0, 8, 16, 20]
    assert ctypes.sizeof(st) == 24


# ---- CPU: the plan ------------------------------------------------------------------------------


def test_a_combine_of_other_blocks_than_the_persistent_blocks_is_refused():
    """The persistent step runs the combine's planned blocks as its items, so they must be its
    256-thread blocks (C = 4 a head): another split is refused in one line, naming the launch."""
    from drvqwen.launchers import Launcher
    from drvqwen.launchers.attention_decode import combine_launch
    from drvqwen.launchers.base import BufferSpec
    from drvqwen.launchers.decode_persistent import op_shape

    parts = tuple(BufferSpec(n, (n_,), np.float32) for n, n_ in (("po", 64 * 14 * 64), ("ml", 64 * 14), ("es", 64 * 14)))
    for c in (4, 8):
        ln = Launcher()
        combine_launch(ln, BufferSpec("out", (14 * 64,), np.float16), parts, BufferSpec("state", (3,), np.int32),
                       n_splits=64, n_heads=14, head_dim=64, dim_split=c)
        if c == 4:
            assert op_shape(ln.specs[0]) == (KINDS["attention_combine"], 56, 14, 256)
        else:
            with pytest.raises(LaunchError, match="blocks of 128 threads; the persistent step runs"):
                op_shape(ln.specs[0])

OCC = FixedOccupancy(132, lambda _k, _t, _s: 2)


@pytest.mark.parametrize("cfg", [QWEN25_CODER_05B, QWEN25_CODER_7B.with_layers(3)], ids=["0.5b", "7b-3layers"])
def test_plan_one_op_per_launch_before_the_norm(cfg):
    plan = plan_decode(cfg, 4096, attention="plain", occupancy=OCC, persistent=True)
    named = plan.named_specs()
    before_norm = [s for n, s in named[:[n for n, _s in named].index("norm")]]
    p = plan.persistent
    assert p.member_specs == before_norm and len(p.ops) == 1 + 6 * cfg.num_layers
    for spec, (kind, n_items, gx, threads) in zip(before_norm, p.ops):
        assert kind == KINDS[spec.kernel.kernel] and gx == spec.grid[0] and threads == spec.block[0]
        if spec.kernel.kernel.startswith("attention_decode_hd"):
            assert n_items == -(-spec.grid[0] // 2) * spec.grid[1] == -(-spec.grid[0] // 2) * cfg.num_kv_heads
        elif spec.kernel.kernel == "attention_combine":  # a planned block (h, c) an item: C = 4 of 256 threads
            assert n_items == spec.grid[0] * spec.grid[1] == cfg.num_heads * 4 and threads == 256
        else:
            assert n_items == spec.grid[0]
    assert plan.buffers["persistent_program"].shape == (program_bytes(before_norm),)
    assert program_bytes(before_norm) > OP_BYTES * len(p.ops)
    assert plan.buffers["persistent_counters"].shape == (len(p.ops) + 1,)
    assert p.specs[0].grid == (132,) and p.specs[0].smem_bytes == max(s.smem_bytes for s in before_norm)
    assert dict(p.specs[0].kernel.defines)["DP_HEAD_DIM"] == cfg.head_dim
    assert p.trace is None and "persistent_trace" not in plan.buffers
    # Planned for the persistent kernel's one block per SM: every op's items fit its blocks once.
    assert max(n for _k, n, _g, _t in p.ops) <= 132
    # Everything the members read and write, and the counters.
    assert set(p.specs[0].writes) >= {"residual", "q", "attn", "h", "persistent_counters"}


def test_trace_summary_reads_the_records_the_kernel_writes():
    """Records (op << 32 | SM << TRACE_ITEM_BITS | item, start, wait over, release) in ns, unused
    ones zero: per op the times from the first start, the median and slowest item after its wait,
    the SMs, and the most items of the op running on one SM at once (after their wait: the
    starts are ordered otherwise). SM ids and items at the fields' edges, so a wrong width shows."""
    from drvqwen.launchers.decode_persistent import TRACE_ITEM_BITS, most_at_once, trace_summary

    top_item, top_sm = (1 << TRACE_ITEM_BITS) - 1, (1 << (32 - TRACE_ITEM_BITS)) - 1

    def rec(op, sm, item, start, wait, end):
        return [op << 32 | sm << TRACE_ITEM_BITS | item, 10_000 + start, 10_000 + wait, 10_000 + end]

    trace = np.array([
        [rec(3, 131, 0, 0, 100, 1100), rec(37, top_sm, top_item, 1100, 2000, 2500), [0, 0, 0, 0]],
        # op 37's two records on SM top_sm overlap after their waits ([2000, 2500), [2400, 4000));
        # op 3's two on SM 131 overlap from their starts ([0, 1100), [50, 1600)) but not after
        # their waits ([100, 1100), [1100, 1600)).
        [rec(3, 131, 1, 50, 1100, 1600), rec(37, top_sm, 0, 2300, 2400, 4000), [0, 0, 0, 0]],
        [rec(37, 256, 2, 600, 2100, 2600), [0, 0, 0, 0], [0, 0, 0, 0]],
    ], dtype=np.uint64)
    ops = trace_summary(trace, 40)
    assert [o["op"] for o in ops] == [3, 37] and [o["items"] for o in ops] == [2, 3]
    assert ops[0]["start_us"] == 0.0 and ops[0]["end_us"] == 1.6
    assert ops[0]["wait_first_us"] == 0.1 and ops[0]["wait_last_us"] == 1.1
    assert ops[0]["item_median_us"] == 0.75 and ops[0]["item_max_us"] == 1.0
    assert ops[0]["sms"] == 1 and ops[0]["most_on_one_sm"] == 1    # [100, 1100) then [1100, 1600)
    assert ops[1]["sms"] == 2 and ops[1]["most_on_one_sm"] == 2 and ops[1]["item_max_us"] == 1.6
    assert most_at_once(np.array([0, 10]), np.array([10, 20])) == 1  # one ends as the next starts
    assert most_at_once(np.array([5]), np.array([5])) == 0


def test_plan_with_trace():
    plan = plan_decode(QWEN25_CODER_05B.with_layers(2), 256, attention="plain", occupancy=OCC, persistent=True,
                       persistent_trace=True)
    p = plan.persistent
    # At most ceil(items / grid) records per op and block, 4 stamps each.
    assert p.trace_items == sum(-(-n // p.grid_blocks) for _k, n, _g, _t in p.ops)
    assert plan.buffers["persistent_trace"] is p.trace
    assert p.trace.shape == (p.grid_blocks * p.trace_items * 4,) and p.trace.dtype == np.uint64
    assert p.specs[0].args["trace"] is p.trace and "persistent_trace" in p.specs[0].writes


def test_a_trace_refuses_an_op_its_item_field_cannot_hold(monkeypatch):
    """A trace record packs op << 32 | SM << TRACE_ITEM_BITS | item: a planned trace with an op of
    2^TRACE_ITEM_BITS items or more is refused (here with the field narrowed to 4 bits: the 0.5B's
    GEMVs have more than 16 items); without a trace the same plan builds."""
    import drvqwen.launchers.decode_persistent as dp

    monkeypatch.setattr(dp, "TRACE_ITEM_BITS", 4)
    cfg = QWEN25_CODER_05B.with_layers(2)
    with pytest.raises(LaunchError, match=r"an op of 2\^4 items or more: the trace records hold fewer"):
        plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True, persistent_trace=True)
    assert plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True).persistent is not None


def test_plan_with_l2_prefetch():
    """The L2 prefetches of the per-launch step become ops of the program: an item per planned
    block, in the step's order (after each qkv_rope, and after each down_proj but the last)."""
    cfg = QWEN25_CODER_05B.with_layers(3)
    plan = plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True, l2_prefetch_bytes=8_000_000,
                       l2_prefetch_qkv=True)
    named = plan.named_specs()
    before_norm = [s for n, s in named[:[n for n, _s in named].index("norm")]]
    p = plan.persistent
    assert p.member_specs == before_norm and len(p.ops) == 1 + 6 * 3 + 3 + 2
    pf = [(spec, op) for spec, op in zip(before_norm, p.ops) if spec.kernel.kernel == "l2_prefetch"]
    assert len(pf) == 5 and all(op == (KINDS["l2_prefetch"], spec.grid[0], spec.grid[0], 32) for spec, op in pf)
    assert plan.buffers["persistent_program"].shape == (program_bytes(before_norm),)


def test_l2_prefetch_arguments_pack_as_the_kernel_reads_them():
    """The packed parameters of an L2 prefetch launch (three spans, the rest NULL) are
    L2PrefetchArgs byte for byte: span i at 32·i, its fields at 0, 8, 12, 16, 20, 24."""
    import ctypes

    from drvqwen.launchers import BufferSpec
    from drvqwen.launchers.l2_prefetch import ARGS_BYTES, SPANS, L2Prefetch, L2Span

    bufs = [BufferSpec(f"w{i}", (4096 * (i + 1),), np.uint8) for i in range(3)]
    ln = L2Prefetch([L2Span.whole(b) for b in bufs], occupancy=OCC)
    st = arg_struct(ln.specs[0].params)
    assert ctypes.sizeof(st) == ARGS_BYTES == 32 * SPANS
    offsets = [getattr(st, f).offset for f, _t in st._fields_]
    assert offsets == [32 * i + o for i in range(SPANS) for o in (0, 8, 12, 16, 20, 24)]


@pytest.mark.parametrize("cfg", [QWEN25_CODER_05B.with_layers(2), QWEN25_CODER_7B.with_layers(2)], ids=["0.5b", "7b"])
def test_plan_in_per_tensor_formats(cfg, monkeypatch):
    """A model in llama.cpp's Q4_K_M layout: every op before the norm is a planned launch of the
    per-launch step, its GEMVs and embedding the format kinds (no INT4 GEMV), and the kernel is
    built with the defines of the step's gemv_fmt.cu build (its WF_FORMATS), so the items run
    that build's code."""
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.launchers import gemv_fmt
    from drvqwen.launchers.decode_persistent import FORMAT_KINDS, INT4_GEMV_KINDS

    # format_defines compiles gemv_fmt.cu to choose its blocks per SM: not what is tested here
    monkeypatch.setattr(gemv_fmt, "_format_defines", lambda ids: (("WF_FORMATS", sum(1 << i for i in ids)),))
    formats = recipe_formats(cfg, "q4_k_m")
    plan = plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True, formats=formats)
    named = plan.named_specs()
    before_norm = [s for n, s in named[:[n for n, _s in named].index("norm")]]
    p = plan.persistent
    assert p.member_specs == before_norm and len(p.ops) == 1 + 6 * cfg.num_layers
    kinds = [k for k, _n, _g, _t in p.ops]
    assert kinds[0] == KINDS["embedding_fmt"] and not set(kinds) & INT4_GEMV_KINDS
    assert kinds.count(KINDS["gemv_fmt_residual"]) == 2 * cfg.num_layers
    assert {KINDS["gemv_fmt_qkv_rope"], KINDS["gemv_fmt_gate_up_swiglu"]} <= set(kinds) <= (
        FORMAT_KINDS | {KINDS[f"attention_decode_hd{cfg.head_dim}"], KINDS["attention_combine"]})
    step_fmt = {s.kernel.defines for s in before_norm if s.kernel.file == "gemv_fmt"}
    assert len(step_fmt) == 1
    defines = dict(p.specs[0].kernel.defines)
    assert all(defines[k] == v for k, v in next(iter(step_fmt))) and "WF_FORMATS" in defines
    assert plan.buffers["persistent_program"].shape == (program_bytes(before_norm),)


def test_plan_refusals():
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.launchers.decode_persistent import PersistentDecode

    with pytest.raises(DrvqwenError, match="plain attention"):
        plan_decode(QWEN25_CODER_05B, 256, attention="tma", occupancy=OCC, persistent=True)
    # The kinds a build runs: the INT4 GEMVs without WF_FORMATS, the format ops with it.
    cfg = QWEN25_CODER_05B.with_layers(1)
    int4 = plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True).persistent
    with pytest.raises(LaunchError, match="gemv_int4_qkv_rope.*not INT4 ones, in a build for formats"):
        PersistentDecode(int4.steps, int4.program, int4.counters, head_dim=cfg.head_dim, occupancy=OCC,
                         fmt_defines=(("WF_FORMATS", 1 << wf.Q8_G32.id),))
    fmt = plan_decode(cfg, 256, attention="plain", occupancy=OCC, persistent=True,
                      formats=recipe_formats(cfg, "q8_0")).persistent
    with pytest.raises(LaunchError, match="embedding_fmt.*per-tensor formats only in a build for them"):
        PersistentDecode(fmt.steps, fmt.program, fmt.counters, head_dim=cfg.head_dim, occupancy=OCC)
    with pytest.raises(LaunchError, match="no WF_FORMATS"):
        PersistentDecode(fmt.steps, fmt.program, fmt.counters, head_dim=cfg.head_dim, occupancy=OCC,
                         fmt_defines=(("GF_QKV_MIN_BLOCKS", 2),))
    with pytest.raises(LaunchError, match="WF_FORMATS goes in fmt_defines"):
        PersistentDecode(int4.steps, int4.program, int4.counters, head_dim=cfg.head_dim, occupancy=OCC,
                         defines=(("WF_FORMATS", 1 << wf.Q8_G32.id),))


# ---- GPU: persistent graph == per-launch eager, bit for bit --------------------------------------

N_GEN = 600
MAX_CONTEXT = 640
GPU_SHAPES = {"0.5b": QWEN25_CODER_05B, "7b-2layers": QWEN25_CODER_7B.with_layers(2)}
# Each shape in INT4 and in llama.cpp's Q4_K_M layout (format/recipes.py: for the 0.5B the real
# 0.5B's Q5_0, Q8_0, Q4_K and Q6_K; for the 7B Q4_K with Q6_K): the format GEMVs as ops.
GPU_MODELS = [(shape, recipe) for shape in GPU_SHAPES for recipe in ("int4", "q4_k_m")]


@pytest.fixture(scope="module", params=GPU_MODELS, ids=[f"{s}-{r}" for s, r in GPU_MODELS])
def synthetic(request, tmp_path_factory):
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.format.synthetic import write_synthetic

    from helpers import minimal_tokenizer_json

    shape, recipe = request.param
    cfg = GPU_SHAPES[shape]
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else tmp_path_factory.mktemp("syn")
    path = base / f"drvqwen_test_persistent_{os.getpid()}_{shape}_{recipe}.nanoqwen"
    write_synthetic(path, cfg, seed=4321, tokenizer_json=minimal_tokenizer_json(),
                    formats=None if recipe == "int4" else recipe_formats(cfg, recipe))
    f = NanoqwenFile(path)
    try:
        yield f"{shape}-{recipe}", f
    finally:
        f.close()
        path.unlink(missing_ok=True)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


@pytest.mark.gpu
@pytest.mark.parametrize("stress", [False, True], ids=["normal", "stress"])
def test_persistent_graph_equals_per_launch_eager(synthetic, stress):
    from drvqwen.decode import DecodeStep
    from drvqwen.graphs import GraphDecoder

    from helpers import decode_against

    name, f = synthetic
    seed = int(os.environ.get("DRVQWEN_SEED", secrets.randbelow(2**31)))
    rng = np.random.default_rng(seed)
    print(f"\n[{name}, stress={stress}] seed={seed}")
    dec = DecodeStep(f, max_context=MAX_CONTEXT, rng=rng, persistent=True, persistent_stress=stress)
    gd = GraphDecoder(dec, dec.persistent_variant(), fallback=False)
    try:
        assert gd.mode == "graph" and dec.attention == "plain"
        n_prompt = 17
        prompt = rng.integers(0, dec.config.vocab_size, n_prompt).tolist()

        def prompt_eager(shuffle):
            dec.seq.start(prompt[0])
            if shuffle:
                rng.shuffle(dec.seq.pages.free)
            for t in prompt[1:]:
                dec.decode_token()
                dec.seq.feed(t)
            dec.decode_token()

        prompt_eager(False)
        want_tokens, want_logits = [dec.next_token()], []
        for _ in range(N_GEN):
            dec.decode_token()
            want_logits.append(dec.logits())
            want_tokens.append(dec.next_token())

        prompt_eager(True)
        tokens, mismatched = decode_against(gd, want_logits)
        assert not mismatched, (f"{name}: persistent logits differ from the per-launch step's at {len(mismatched)} "
                                f"steps, first at generated step {mismatched[0]}")
        assert tokens == want_tokens
        assert sum(1 for p in range(n_prompt, n_prompt + N_GEN) if p % PAGE_TOKENS == 0) >= 37
        # The counters are back at zero after every step.
        assert not dec.buf["persistent_counters"].download().any()
    finally:
        gd.close()
        dec.close()


@pytest.mark.gpu
@pytest.mark.parametrize("stress", [False, True], ids=["normal", "stress"])
def test_persistent_small_equals_per_launch(synthetic, stress):
    """One layer, 40 steps across two page boundaries, each persistent step launched eagerly
    against the per-launch step (itself checked against reference.py by the kernel and engine
    tests), the activations poisoned before each run: small enough for compute-sanitizer
    (tools/sanitize_nodes.txt runs the 0.5B shape's cases)."""
    from drvqwen.decode import DecodeStep

    name, f = synthetic
    rng = np.random.default_rng(7)
    dec = DecodeStep(f, max_context=64, num_layers=1, rng=rng, persistent=True, persistent_stress=stress)
    try:
        pers = dec.persistent_variant()
        prompt = rng.integers(0, dec.config.vocab_size, 3).tolist()
        runs = []
        # What the step writes before it reads, poisoned with NaN before each run: a value the
        # persistent kernel failed to write would show in the logits.
        poisoned = ("residual", "xn", "q", "attn", "h", "logits", "partial_out", "max_logits", "exp_sums")
        for lst in (dec.launch_list, pers):
            for n in poisoned:
                b = dec.buf[n]
                b.upload(np.full(b.shape, np.nan, b.dtype))
            dec.seq.start(prompt[0])
            for t in prompt[1:]:
                dec.decode_token(lst)
                dec.seq.feed(t)
            logits = []
            for _ in range(40):
                dec.decode_token(lst)
                logits.append(_bits(dec.logits()).copy())
            runs.append(logits)
        assert all(np.array_equal(a, b) for a, b in zip(*runs))
        assert not dec.buf["persistent_counters"].download().any()
    finally:
        dec.close()


@pytest.mark.gpu
def test_persistent_with_l2_prefetch(synthetic):
    """The step with its L2 prefetches (after qkv_rope and after down_proj) in the stress build of
    the persistent kernel, whose prefetch items run in any order against their counters: 40 steps
    across two page boundaries, launched eagerly, give the per-launch step's logits bit for bit
    (each run's activations poisoned first); and the persistent graph the same. Small enough for
    compute-sanitizer (tools/sanitize_nodes.txt runs the 0.5B case)."""
    from drvqwen.decode import DecodeStep
    from drvqwen.graphs import GraphDecoder

    name, f = synthetic
    rng = np.random.default_rng(11)
    dec = DecodeStep(f, max_context=64, num_layers=2, rng=rng, persistent=True, persistent_stress=True,
                     l2_prefetch_bytes=21_000_000, l2_prefetch_qkv=True)
    gd = None
    try:
        assert sum("l2_prefetch" in n for n, _l in dec.launchers) == 3
        pers = dec.persistent_variant()
        prompt = rng.integers(0, dec.config.vocab_size, 3).tolist()
        poisoned = ("residual", "xn", "q", "attn", "h", "logits", "partial_out", "max_logits", "exp_sums")

        def run(decode):
            for n in poisoned:
                b = dec.buf[n]
                b.upload(np.full(b.shape, np.nan, b.dtype))
            dec.seq.start(prompt[0])
            for t in prompt[1:]:
                decode()
                dec.seq.feed(t)
            logits = []
            for _ in range(40):
                decode()
                logits.append(_bits(dec.logits()).copy())
            return logits

        want = run(lambda: dec.decode_token(dec.launch_list))
        got = run(lambda: dec.decode_token(pers))
        assert all(np.array_equal(a, b) for a, b in zip(want, got)), f"{name}: persistent eager differs"
        gd = GraphDecoder(dec, pers, fallback=False)
        graph = run(gd.decode_token)
        assert all(np.array_equal(a, b) for a, b in zip(want, graph)), f"{name}: persistent graph differs"
        assert not dec.buf["persistent_counters"].download().any()
    finally:
        if gd is not None:
            gd.close()
        dec.close()
