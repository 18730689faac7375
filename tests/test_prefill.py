"""GPU prefill (prefill.py) of synthetic models against the numpy reference (docs/numerics.md).

Synthetic models (format/synthetic.py): 2 layers at the 7B widths with the full 152064-row
vocabulary, and the full 24-layer 0.5B shape. Prompts of 1, 15, 16, 17, 100, 511, 512 and 513
tokens (513 runs as two chunks: 512 + 1), prefixes of one random sequence, so a single
reference forward gives every length's last-position logits; pages come from a shuffled free
list. Then: the KV cache prefill writes equals the one token-by-token decode writes, and a
decode step right after prefill (at a page boundary and inside a page) continues correctly.
"""

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.kv_cache import PAGE_TOKENS
from drvqwen.config import QWEN25_CODER_05B, QWEN25_CODER_7B
from drvqwen.format.nanoqwen import NanoqwenFile
from drvqwen.format.synthetic import write_synthetic

from helpers import minimal_tokenizer_json, rel_l2
from kernel_testing import report

pytestmark = pytest.mark.gpu

SHAPES = {"7b-2layers": QWEN25_CODER_7B.with_layers(2), "0.5b": QWEN25_CODER_05B,
          # per-tensor formats (llama.cpp's Q4_K_M recipe): the prefill on the format GEMMs
          "0.5b-q4_k_m": QWEN25_CODER_05B}
LENGTHS = [1, 15, 16, 17, 100, 511, 512, 513]
MAX_CONTEXT = 1024
TOL_LOGITS = 1e-2                 # as the decode step (test_decode_step.py): INT4 GEMMs, FP16 activations


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory):
    """(name, file, reference weights, GPU backend, prompt ids, reference logits of every prefix)."""
    from drvqwen.engine import GPUBackend

    from drvqwen.format.recipes import recipe_formats

    cfg = SHAPES[request.param]
    path = tmp_path_factory.mktemp("syn") / f"{request.param}.nanoqwen"
    recipe = "q4_k_m" if request.param.endswith("q4_k_m") else None
    write_synthetic(path, cfg, seed=1234, tokenizer_json=minimal_tokenizer_json(),
                    formats=recipe_formats(cfg, recipe) if recipe else None)
    f = NanoqwenFile(path)
    rng = np.random.default_rng(4321)
    weights = ref.Weights.from_nanoqwen(f, np.float32)
    ids = rng.integers(0, cfg.vocab_size, max(LENGTHS) + 1).tolist()
    want = ref.Model(weights, max_tokens=MAX_CONTEXT, rng=rng).forward(ids)      # [514, V]
    backend = GPUBackend(f, max_context=MAX_CONTEXT, rng=rng)
    yield request.param, f, weights, backend, ids, want
    backend.close()
    f.close()


def test_prefill_last_logits_match_reference(model):
    name, _f, _w, backend, ids, want = model
    errs = {}
    for t in LENGTHS:
        got = backend.prefill(ids[:t])
        assert np.isfinite(got).all(), f"{name} T={t}: non-finite logits"
        errs[t] = rel_l2(got, want[t - 1])
        # The GPU's own greedy choice after prefill is the argmax of the logits it produced.
        assert backend.decode_step.next_token() == int(np.argmax(got)), f"{name} T={t}"
    print(f"{name}: prefill last-position logits rel L2 " + ", ".join(f"T={t}: {e:.2e}" for t, e in errs.items()))
    assert max(errs.values()) <= TOL_LOGITS
    pages = backend.decode_step.seq.pages
    assert sorted(pages.block_table + pages.free) == list(range(pages.n_pages))
    assert len(pages.block_table) == -(-max(LENGTHS) // PAGE_TOKENS)


def test_prefill_in_chunks_matches_reference(model):
    """A prompt longer than a chunk: the default chunk (prefill.DEFAULT_CHUNK_ROWS) holds every
    length above, so a backend of 128-row chunks runs 513 tokens as 5 chunks (4 whole, one row),
    each chunk's attention reading the earlier chunks from the paged cache."""
    from drvqwen.engine import GPUBackend

    name, f, _w, _backend, ids, want = model
    chunked = GPUBackend(f, max_context=MAX_CONTEXT, rng=np.random.default_rng(7), chunk_rows=128)
    try:
        assert chunked.prefill_pass.chunk_rows == 128
        errs = {}
        for t in (129, 513):
            got = chunked.prefill(ids[:t])
            assert np.isfinite(got).all(), f"{name} T={t}: non-finite logits"
            errs[t] = rel_l2(got, want[t - 1])
        print(f"{name}: prefill in 128-row chunks, last-position logits rel L2 "
              + ", ".join(f"T={t}: {e:.2e}" for t, e in errs.items()))
        assert max(errs.values()) <= TOL_LOGITS
    finally:
        chunked.close()


@pytest.mark.parametrize("t", [16, 37])
def test_decode_continues_after_prefill(model, t):
    """Prefill T tokens, then decode token T (position 16: a new page; 37: inside one) and T+1."""
    name, _f, _w, backend, ids, want = model
    backend.prefill(ids[:t])
    for i in (t, t + 1):
        got = backend.decode(ids[i])
        err = rel_l2(got, want[i])
        print(f"{name}: decode at position {i} after a {t}-token prefill: rel L2 {err:.2e}")
        assert err <= TOL_LOGITS


def _cache_sequence(step, n):
    """K and V of positions 0 … n-1, every layer: fp16 [L, n, Hkv, Dh] each."""
    bt = np.asarray(step.seq.pages.block_table)
    k, v = step.k_cache.download(), step.v_cache.download()
    return (np.stack([ref.gather_pages(k[l], bt, n) for l in range(k.shape[0])]),
            np.stack([ref.gather_pages(v[l], bt, n) for l in range(v.shape[0])]))


def test_prefill_kv_cache_equals_decode(model):
    """The cache prefill writes = the cache token-by-token decode writes, within FP16 rounding
    (the GEMM and the GEMV sum the same products in different orders)."""
    name, _f, _w, backend, ids, _want = model
    n = 37
    step = backend.decode_step
    backend.prefill(ids[:n])
    k_pre, v_pre = _cache_sequence(step, n)
    step.seq.start(ids[0])
    for i in range(n):
        if i:
            step.seq.feed(ids[i])
        step.decode_token()
    step.sync()
    k_dec, v_dec = _cache_sequence(step, n)
    assert np.isfinite(k_pre.astype(np.float32)).all() and np.isfinite(v_pre.astype(np.float32)).all()
    report(f"{name} K cache prefill vs decode", k_pre, k_dec.astype(np.float64), 2e-3)
    report(f"{name} V cache prefill vs decode", v_pre, v_dec.astype(np.float64), 2e-3)


def test_per_token_prefill_is_the_decode_step_itself(model):
    """Prefill(mode="per_token") runs the prompt through the decode step's own launches: its last
    logits are bit for bit those of feeding the prompt to decode_token one token at a time, and
    the chunked GEMM prefill agrees with it within TOL_LOGITS."""
    from drvqwen.prefill import Prefill

    name, _f, _w, backend, ids, _want = model
    step, n = backend.decode_step, 37
    gemm = backend.prefill(ids[:n])
    per_token = Prefill(step, mode="per_token")
    try:
        per_token.run(ids[:n])
        step.sync()
        tok_logits = step.logits()
    finally:
        per_token.close()
    step.seq.start(ids[0])
    for i in range(n):
        if i:
            step.seq.feed(ids[i])
        step.decode_token()
    assert step.logits().tobytes() == tok_logits.tobytes(), f"{name}: per-token prefill != decode steps"
    err = rel_l2(gemm, tok_logits)
    print(f"{name}: chunked prefill vs per-token prefill, last logits rel L2 {err:.2e}")
    assert err <= TOL_LOGITS


@pytest.mark.parametrize("gemm", ["mma"])
def test_prefill_gemm_choices_match_reference(model, gemm):
    """The other prefill GEMMs (prefill.FMT_GEMMS) on the same model: "mma" (gemm_fmt.cu for the
    per-tensor formats; an INT4 model keeps gemm_int4.cu) — the same logits as the reference, and
    within FP16 rounding of the default's."""
    from drvqwen.prefill import Prefill

    name, _f, _w, backend, ids, want = model
    step = backend.decode_step
    other = Prefill(step, fmt_gemm=gemm)
    try:
        for t in (17, 513):
            backend.prefill(ids[:t])
            default = step.logits()
            other.run(ids[:t])
            step.sync()
            got = step.logits()
            assert np.isfinite(got).all(), f"{name} {gemm} T={t}: non-finite logits"
            err, gap = rel_l2(got, want[t - 1]), rel_l2(got, default)
            print(f"{name} {gemm} T={t}: rel L2 {err:.2e} against the reference, {gap:.2e} against the default GEMMs")
            assert err <= TOL_LOGITS and gap <= TOL_LOGITS
            assert step.next_token() == int(np.argmax(got))
    finally:
        other.close()


def test_prefill_without_pdl_or_split_k_gives_the_same_bits_and_near_logits(model):
    """Programmatic dependent launch changes when the chunk's kernels start, not what they
    compute: Prefill(pdl=False) writes the same cache and logits bit for bit (a kernel reading
    its predecessor's output before griddepcontrol.wait would differ here). RoPE and the K/V
    writes in the QKV GEMM's epilogue (INT4 weights) do what rope_kv_rows does after an FP32 QKV
    GEMM: Prefill(qkv_rope=False) gives the same bits too. Split-K changes the
    FP32 sums' order only: Prefill(split_k=False) within TOL_LOGITS. 513 tokens: two chunks, the
    second's GEMMs on 1 row (a bucket of 64, where the most GEMMs split)."""
    from drvqwen.prefill import Prefill

    name, _f, _w, backend, ids, want = model
    step = backend.decode_step
    for t in (100, 513):
        backend.prefill(ids[:t])
        default = step.logits()
        k_def, v_def = _cache_sequence(step, t)
        for kw in (dict(pdl=False), dict(qkv_rope=False), dict(split_k=False)):
            other = Prefill(step, **kw)
            try:
                if "qkv_rope" in kw and step.plan.formats is None:
                    names = [n.name for n in other.launches(64)]
                    assert "L0.qkv_proj" in names and "L0.rope_kv" in names and "L0.qkv_rope" not in names
                    assert "L0.qkv_rope" in [n.name for n in backend.prefill_pass.launches(64)]
                other.run(ids[:t])
                step.sync()
                got = step.logits()
                k_got, v_got = _cache_sequence(step, t)
            finally:
                other.close()
            if "split_k" not in kw:
                assert got.tobytes() == default.tobytes(), f"{name} T={t}: logits differ with {kw}"
                assert k_got.tobytes() == k_def.tobytes() and v_got.tobytes() == v_def.tobytes(), \
                    f"{name} T={t}: the KV cache differs with {kw}"
            else:
                err = rel_l2(got, default)
                print(f"{name} T={t}: without split-K, last logits rel L2 {err:.2e} from the default")
                assert err <= TOL_LOGITS and rel_l2(got, want[t - 1]) <= TOL_LOGITS


def test_last_layer_on_the_last_row_matches_all_rows(model):
    """The last layer past its K/V runs on the prompt's last row only (prefill.py, "Why the last
    layer runs one row"): its list stops at the last layer's K/V and the tail runs the decode
    GEMVs on that row. Against Prefill(last_layer="all_rows"): the same cache bit for bit (the
    K/V come from the same launches), the logits within TOL_LOGITS (a GEMV's sums in another order
    than the GEMM's), both against the reference. 513 tokens: the first chunk skips the last
    layer's rest entirely, the second runs it on its one row."""
    from drvqwen.prefill import Prefill

    name, _f, _w, backend, ids, want = model
    step, last = backend.decode_step, backend.config.num_layers - 1
    names = [n.name for n in backend.prefill_pass.launches(64)]
    assert names[-1] in (f"L{last}.qkv_rope", f"L{last}.rope_kv") and f"L{last}.o_proj" not in names
    assert last == 0 or f"L{last - 1}.down_proj" in names
    full = Prefill(step, last_layer="all_rows")
    try:
        assert [n.name for n in full.launches(64)][-1] == f"L{last}.down_proj"
        for t in (1, 100, 513):
            backend.prefill(ids[:t])
            got = step.logits()
            k_got, v_got = _cache_sequence(step, t)
            full.run(ids[:t])
            step.sync()
            ref_logits = step.logits()
            k_full, v_full = _cache_sequence(step, t)
            assert k_got.tobytes() == k_full.tobytes() and v_got.tobytes() == v_full.tobytes(), \
                f"{name} T={t}: the KV cache differs with the last layer on one row"
            err, err_ref = rel_l2(got, ref_logits), rel_l2(got, want[t - 1])
            print(f"{name} T={t}: last layer on the last row: rel L2 {err:.2e} against all rows, "
                  f"{err_ref:.2e} against the reference")
            assert err <= TOL_LOGITS and err_ref <= TOL_LOGITS
            assert np.isfinite(got).all()
    finally:
        full.close()


def test_late_chunks_run_the_range_schedule(model):
    """Chunks from `late_attention_from` on run the attention's range schedule (head dim 128 only,
    prefill.LATE_ATTENTION_FROM): 300 and 513 tokens in chunks of 128, the schedule switched from
    position 128 on, against the split schedule throughout — logits within TOL_LOGITS of each
    other (the same sums split differently) and of the reference."""
    from drvqwen.prefill import Prefill

    name, _f, _w, backend, ids, want = model
    step = backend.decode_step
    late = Prefill(step, max_chunk_rows=128, late_attention_from=128)
    split = Prefill(step, max_chunk_rows=128, late_attention_from=None)
    try:
        if late.late_from is None:
            assert step.config.head_dim != 128, f"{name}: no late schedule at head dim 128"
            return
        names = [n.name for n in late.launches(128, late=True)]
        assert "L0.attention_late" in names and "L0.attention" not in names
        assert "L0.attention" in [n.name for n in late.launches(128)]
        for t in (300, 513):
            late.run(ids[:t])
            step.sync()
            got = step.logits()
            split.run(ids[:t])
            step.sync()
            base = step.logits()
            err, err_ref = rel_l2(got, base), rel_l2(got, want[t - 1])
            print(f"{name} T={t}: late chunks on the range schedule: rel L2 {err:.2e} against the split "
                  f"schedule, {err_ref:.2e} against the reference")
            assert err <= TOL_LOGITS and err_ref <= TOL_LOGITS
    finally:
        late.close()
        split.close()


def test_kquant_register_gemms_match_the_format_gemms(tmp_path):
    """A small model in llama.cpp's Q4_K_M layout with K a multiple of 256 (recipe_formats: Q4_K
    everywhere but v and down of layers 2 and 3, and lm_head, in Q6_K): its prefill with the K-quant
    projections on gemm_int4.cu's register-unpack kernels (`qkv_rope` where q, k, v are all Q4_K,
    and by default where v is Q6_K too, one launch of two parts — with `mixed_qkv=False` that layer
    as `qk_proj` + a Q6_K `v_proj` + `rope_kv`; Q4_K o_proj/gate_up/down, Q6_K down) against the same on gemm_fmt_wgmma.cu
    (`kquant_gemm=False`) and against the reference, at 17 and 300 tokens."""
    check_kquant_register_prefill(tmp_path, "q4_k_m", "gemm_q4k")


def test_q5k_register_gemms_match_the_format_gemms(tmp_path):
    """The same in llama.cpp's Q5_K_M layout: Q5_K where Q4_K_M has Q4_K (gemm_q5k_*)."""
    check_kquant_register_prefill(tmp_path, "q5_k_m", "gemm_q5k")


def check_kquant_register_prefill(tmp_path, recipe: str, kernel: str):
    """test_kquant_register_gemms_match_the_format_gemms for `recipe`, whose base K-quant's kernels
    are named `kernel`_*."""
    from dataclasses import replace

    from drvqwen.engine import GPUBackend
    from drvqwen.format.recipes import recipe_formats
    from drvqwen.prefill import Prefill

    cfg = replace(QWEN25_CODER_7B, vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_layers=4,
                  num_heads=8, num_kv_heads=2, head_dim=128)
    path = tmp_path / f"{recipe}.nanoqwen"
    write_synthetic(path, cfg, seed=77, tokenizer_json=minimal_tokenizer_json(),
                    formats=recipe_formats(cfg, recipe))
    f = NanoqwenFile(path)
    rng = np.random.default_rng(99)
    ids = rng.integers(0, cfg.vocab_size, 301).tolist()
    want = ref.Model(ref.Weights.from_nanoqwen(f, np.float32), max_tokens=512, rng=rng).forward(ids)
    backend = GPUBackend(f, max_context=512, rng=rng)
    step = backend.decode_step
    regs, fmt = Prefill(step, mixed_qkv=False), Prefill(step, kquant_gemm=False)
    one = Prefill(step)  # the default: q, k and a Q6_K v as one launch
    try:
        def roles(pf):  # a layer's launches are named L{l}.{role}; the embedding and the tail have no layer
            return {nl.name.partition(".")[2] for nl in pf.launches(64)}
        assert {"qkv_rope", "qk_proj", "v_proj", "rope_kv"} <= roles(regs), \
            f"q and k should run stacked on the register GEMM where v is Q6_K: {sorted(roles(regs))}"
        assert "qkv_rope" in roles(one) and not {"qk_proj", "v_proj", "rope_kv"} & roles(one), \
            f"by default every layer's q, k and v should run as one qkv_rope launch: {sorted(roles(one))}"
        assert {"q_proj", "k_proj"} <= roles(fmt)
        kernels = {nl.spec.kernel.kernel for nl in regs.launches(64)}
        assert {f"{kernel}_qkv_rope", f"{kernel}_residual", "gemm_q6k_residual", "gemm_q6k_rows"} <= kernels, \
            sorted(kernels)
        assert f"{kernel}_q6k_qkv_rope" in {nl.spec.kernel.kernel for nl in one.launches(64)}
        assert not any(k.startswith("gemm_q") for k in {nl.spec.kernel.kernel for nl in fmt.launches(64)})
        for t in (17, 300):
            regs.run(ids[:t])
            step.sync()
            got = step.logits()
            fmt.run(ids[:t])
            step.sync()
            other = step.logits()
            one.run(ids[:t])
            step.sync()
            fused = step.logits()
            err, gap, gap1 = rel_l2(got, want[t - 1]), rel_l2(got, other), rel_l2(fused, got)
            print(f"{recipe} T={t}: registers rel L2 {err:.2e} against the reference, {gap:.2e} against gemm_fmt_wgmma,"
                  f" {gap1:.2e} between one and three QKV launches")
            assert np.isfinite(got).all() and err <= TOL_LOGITS and gap <= TOL_LOGITS
            assert np.isfinite(fused).all() and rel_l2(fused, want[t - 1]) <= TOL_LOGITS and gap1 <= TOL_LOGITS
    finally:
        regs.close()
        one.close()
        fmt.close()
        backend.close()
        f.close()


def test_q32_register_gemms_match_the_format_gemms(tmp_path):
    """A small model in llama.cpp's Q4_K_M layout whose hidden size is not a multiple of 256 (K =
    896, as the real 0.5B: Q5_0 for q, k, o, gate, up and for v on two layers, Q8_0 for v on the two
    that get more bits, Q4_K / Q6_K down_proj at K = 2304): its prefill with the Q5_0 and Q8_0
    projections on gemm_int4.cu's register-unpack kernels (`qkv_rope` where v is Q5_0 too — or,
    with the RoPE apart, `qkv_proj` — else `qk_proj` + a Q8_0 `v_proj`) against the same on
    gemm_fmt_wgmma.cu (`q32_gemm=False`) and against the reference, at 17 and 300 tokens; the RoPE
    apart gives the same logits bit for bit."""
    check_q32_register_prefill(tmp_path, "q4_k_m", "Q5_0", "q5g32")


def test_q5_1_register_gemms_match_the_format_gemms(tmp_path):
    """The same in llama.cpp's Q5_K_M layout: Q5_1 where Q4_K_M has Q5_0 (gemm_q5g32min_*), Q5_K
    down_proj at K = 2304."""
    check_q32_register_prefill(tmp_path, "q5_k_m", "Q5_1", "q5g32min")


def check_q32_register_prefill(tmp_path, recipe: str, fallback: str, stem: str):
    """test_q32_register_gemms_match_the_format_gemms for `recipe`, whose K = 896 tensors fall back
    to `fallback` (kernels gemm_`stem`_*) and Q8_0."""
    from dataclasses import replace

    from drvqwen.engine import GPUBackend
    from drvqwen.format.recipes import k_m_types, recipe_formats
    from drvqwen.prefill import Prefill

    cfg = replace(QWEN25_CODER_7B, vocab_size=2048, hidden_size=896, intermediate_size=2304, num_layers=4,
                  num_heads=7, num_kv_heads=1, head_dim=128)
    types = k_m_types(cfg, recipe[:2].upper() + "_K")
    assert {types[f"model.layers.{l}.self_attn.v_proj"] for l in range(4)} == {fallback, "Q8_0"}, types
    path = tmp_path / f"{recipe}.nanoqwen"
    write_synthetic(path, cfg, seed=78, tokenizer_json=minimal_tokenizer_json(), formats=recipe_formats(cfg, recipe))
    f = NanoqwenFile(path)
    rng = np.random.default_rng(98)
    ids = rng.integers(0, cfg.vocab_size, 301).tolist()
    want = ref.Model(ref.Weights.from_nanoqwen(f, np.float32), max_tokens=512, rng=rng).forward(ids)
    backend = GPUBackend(f, max_context=512, rng=rng)
    step = backend.decode_step
    regs, fmt, apart = Prefill(step), Prefill(step, q32_gemm=False), Prefill(step, qkv_rope=False)
    try:
        def roles(pf):  # a layer's launches are named L{l}.{role}; the embedding and the tail have no layer
            return {nl.name.partition(".")[2] for nl in pf.launches(64)}
        assert {"qkv_rope", "qk_proj", "v_proj"} <= roles(regs), sorted(roles(regs))
        assert {"qkv_proj", "qk_proj", "v_proj"} <= roles(apart), sorted(roles(apart))
        assert {"q_proj", "k_proj", "v_proj"} <= roles(fmt)
        kernels = {nl.spec.kernel.kernel for nl in regs.launches(64)}
        assert {f"gemm_{stem}_qkv_rope", f"gemm_{stem}_stacked_rows", "gemm_q8g32_stacked_rows",
                f"gemm_{stem}_residual", f"gemm_{stem}_gate_up_swiglu"} <= kernels, sorted(kernels)
        assert not any(k.startswith((f"gemm_{stem}", "gemm_q8g32")) for k in {nl.spec.kernel.kernel
                                                                               for nl in fmt.launches(64)})
        for t in (17, 300):
            regs.run(ids[:t])
            step.sync()
            got = step.logits()
            fmt.run(ids[:t])
            step.sync()
            other = step.logits()
            apart.run(ids[:t])
            step.sync()
            same = step.logits()
            err, gap = rel_l2(got, want[t - 1]), rel_l2(got, other)
            print(f"{stem}/q8_g32 T={t}: registers rel L2 {err:.2e} against the reference, {gap:.2e} against "
                  f"gemm_fmt_wgmma")
            assert np.isfinite(got).all() and err <= TOL_LOGITS and gap <= TOL_LOGITS
            # the RoPE in the epilogue: the same sums as the stacked GEMM, then the same rotation
            assert got.tobytes() == same.tobytes(), "qkv_rope and qkv_proj + rope_kv gave different logits"
    finally:
        regs.close()
        fmt.close()
        apart.close()
        backend.close()
        f.close()
