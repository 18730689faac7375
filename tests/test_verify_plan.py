"""The verify pass's launch list (verify_plan.plan_verify), planned without a GPU: launch for launch
the decode step's (plan_decode(attention="plain")) with T tokens — the same names per layer, the
same block and, per token, the same grid and scalar arguments — over [T, …] of the decode
step's buffers."""

import numpy as np
import pytest

from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.decode import plan_decode
from drvqwen.errors import DrvqwenError
from drvqwen.launchers.base import BufferSpec, FixedOccupancy
from drvqwen.launchers.gemv_int4 import tokens_defines
from drvqwen.launchers.attention_decode import COMBINE_SPLIT, COMBINE_THREADS
from drvqwen.verify_plan import plan_verify

OCC = FixedOccupancy(132, lambda _k, _t, _s: 2)
CONFIGS = {"0.5b": QWEN25_CODER_05B, "7b": QWEN25_CODER_7B}
MAX_CONTEXT = 4096
# Launches whose grid gains a token dimension (one single-token grid per token), by the decode
# step's kernel name; every other launch has the decode step's grid.
# (The split-KV attention keeps the decode step's grid: its warps share out the (token, split) pairs.)
PER_TOKEN_GRID = {"embedding"}
# The combine: the decode step's has grid (Hq, C) of COMBINE_THREADS / C threads (each block a
# C-th of the dims), the verify pass's (Hq, T) of COMBINE_THREADS (each block a whole head);
# every (dim, j) virtual thread adds the same splits in the same order in both, so each token's
# output has the same bits (attention_decode.cu; the GPU tests of the verify pass compare them).
COMBINE = "attention_combine"
# Launches of one block per token: grid (1,) in the decode step, (T,) here.
ONE_BLOCK_PER_TOKEN = {"rmsnorm", "argmax_final"}
# The decode step's kernel → the verify pass's.
KERNEL = {"embedding": "embedding_rows", "rmsnorm": "rmsnorm"}


def _tokens_kernel(name: str) -> str:
    if name in KERNEL:
        return KERNEL[name]
    if name.startswith("attention_decode_hd"):
        return name.replace("attention_decode_hd", "attention_decode_tokens_hd")
    return name + "_tokens"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def decode_plan(request):
    cfg = CONFIGS[request.param]
    return cfg, plan_decode(cfg, MAX_CONTEXT, attention="plain", occupancy=OCC, text_vocab=151665)


@pytest.mark.parametrize("T", [1, 2, 8, 16])
def test_launches_are_the_decode_steps_per_token(decode_plan, T):
    cfg, one = decode_plan
    plan = plan_verify(cfg, MAX_CONTEXT, T, occupancy=OCC, text_vocab=151665, prenorm=False)
    single = one.named_specs()
    verify = plan.named_specs()
    assert [n for n, _s in verify] == [n for n, _s in single]
    assert sum(n.startswith("L0.") for n, _s in verify) == 6 and verify[-1][0] == "advance_state"
    for (name, v), (_n, d) in zip(verify, single):
        assert v.kernel.file == d.kernel.file, name
        assert v.kernel.kernel == _tokens_kernel(d.kernel.kernel), name
        if d.kernel.kernel == COMBINE:
            assert d.grid == (cfg.num_heads, COMBINE_SPLIT) and d.block == (COMBINE_THREADS // COMBINE_SPLIT,), name
            assert v.grid == (cfg.num_heads, T) and v.block == (COMBINE_THREADS,), name
        else:
            assert v.block == d.block, name
        # The decode step's compile-time choices (the K-group order among them); more than 8
        # tokens add the 16-token build of the GEMVs.
        extra = tokens_defines(T) if d.kernel.file == "gemv_int4" else ()
        assert v.kernel.defines == d.kernel.defines + extra, name
        if d.kernel.kernel in PER_TOKEN_GRID:
            want = (*d.grid, T)
        elif d.kernel.kernel in ONE_BLOCK_PER_TOKEN:
            assert d.grid == (1,), name
            want = (T,)
        else:
            want = v.grid if d.kernel.kernel == COMBINE else d.grid
        assert v.grid == want, name
        assert v.kernel.pdl == d.kernel.pdl or d.kernel.kernel == "embedding", name
        # Every scalar the arithmetic reads (K, N, eps, Hq, n_splits, n_valid, …) is the decode
        # step's; a T-token kernel adds n_tokens.
        scalars = {k: a.value for k, a in d.args.items() if hasattr(a, "value")}
        vscalars = {k: a.value for k, a in v.args.items() if hasattr(a, "value")}
        assert {k: x for k, x in vscalars.items() if k != "n_tokens"} == scalars, name
        assert vscalars.get("n_tokens", T) == T, name
        # The embedding reads its ids from a buffer of its own, the decode step's from state[1].
        reads = set(d.reads) - {"state"} | {"ids"} if d.kernel.kernel == "embedding" else set(d.reads)
        assert v.writes == d.writes and set(v.reads) == reads, name


@pytest.mark.parametrize("T", [1, 2, 8, 16])
def test_buffers_are_the_decode_steps_with_t_rows(decode_plan, T):
    cfg, one = decode_plan
    plan = plan_verify(cfg, MAX_CONTEXT, T, occupancy=OCC, prenorm=False)
    assert plan.n_tokens == T and plan.blocks_per_kv_head == one.blocks_per_kv_head
    assert set(plan.buffers) == set(one.buffers) | {"ids"}
    assert plan.buffers["ids"] == BufferSpec("ids", (T,), np.int32)
    assert plan.buffers["next_token"] == BufferSpec("next_token", (T,), np.int32)
    for name, b in one.buffers.items():
        v = plan.buffers[name]
        assert v.dtype == b.dtype, name
        if name in ("state", "block_table", "inv_freq"):
            assert v.shape == b.shape, name
        elif name != "next_token":
            assert v.shape == (T, *b.shape), name
    assert plan.weights == one.weights and plan.kv == one.kv
    # Every buffer a launch names is planned with the shape the launch was checked against.
    named = {a.name: a for _n, s in plan.named_specs() for a in s.args.values() if isinstance(a, BufferSpec)}
    for name, b in named.items():
        planned = plan.buffers.get(name) or plan.weights.get(name)
        if planned is not None:
            assert b == planned, name


def test_gemvs_of_more_than_8_tokens_use_the_16_token_build():
    cfg = QWEN25_CODER_05B
    for T, extra in ((8, ()), (9, (("GEMV_TOKENS", 16),))):
        specs = dict(plan_verify(cfg, MAX_CONTEXT, T, occupancy=OCC).named_specs())
        assert specs["L0.down_proj"].kernel.defines == extra


@pytest.mark.parametrize("bad", [0, 17, -1])
def test_token_counts_outside_1_to_16_are_refused_in_one_line(bad):
    with pytest.raises(DrvqwenError, match=rf"n_tokens={bad}.*1\.\.16") as e:
        plan_verify(QWEN25_CODER_05B, MAX_CONTEXT, bad, occupancy=OCC)
    assert "\n" not in str(e.value)


def test_other_attention_kernels_are_refused():
    with pytest.raises(DrvqwenError, match="attention='tma'"):
        plan_verify(QWEN25_CODER_05B, MAX_CONTEXT, 4, occupancy=OCC, attention="tma")


@pytest.mark.parametrize("T", [2, 8])
def test_prenorm_runs_each_rmsnorm_as_its_own_launch(decode_plan, T):
    """With prenorm, each layer's two RMSNorms are rmsnorm launches of T rows into xn, and
    qkv_rope / gate_up_swiglu read xn through their …_x_tokens kernels, in the fused kernels'
    launch shape; everything else is the plain pass's."""
    cfg, _one = decode_plan
    plain = dict(plan_verify(cfg, MAX_CONTEXT, T, occupancy=OCC, text_vocab=151665, prenorm=False).named_specs())
    pre = plan_verify(cfg, MAX_CONTEXT, T, occupancy=OCC, text_vocab=151665).named_specs()
    names = [n for n, _s in pre]
    assert names[:8] == ["embedding", "L0.input_layernorm", "L0.qkv_rope", "L0.attention.0", "L0.attention.1",
                         "L0.o_proj", "L0.post_attention_layernorm", "L0.gate_up_swiglu"]
    assert [n for n in names if not n.endswith("layernorm")] == list(plain)
    for name, spec in pre:
        if name.endswith("layernorm"):
            assert (spec.kernel.kernel, spec.grid, spec.writes) == ("rmsnorm", (T,), ("xn",)), name
            assert "residual" in spec.reads, name
        elif name.endswith(("qkv_rope", "gate_up_swiglu")):
            p = plain[name]
            assert spec.kernel.kernel == p.kernel.kernel.replace("_tokens", "_x_tokens"), name
            assert (spec.grid, spec.block, spec.smem_bytes) == (p.grid, p.block, p.smem_bytes), name
            assert "xn" in spec.reads and "residual" not in spec.reads, name
        else:
            assert (spec.kernel.kernel, spec.grid) == (plain[name].kernel.kernel, plain[name].grid), name
