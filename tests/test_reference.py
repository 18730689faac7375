"""The numpy reference against Hugging Face `transformers` (Qwen2ForCausalLM) on the CPU,
on exactly the same weights; and the paged cache against a dense computation."""

import numpy as np
import pytest

from drvqwen import reference as ref
from drvqwen.config import QwenConfig

from helpers import TINY, random_dense, rel_l2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(cfg: QwenConfig, state: dict[str, np.ndarray]):
    """A float32 Qwen2ForCausalLM with `state` loaded (eager attention, no sliding window)."""
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "torch_dtype")})
    hf_cfg._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval().to(torch.float32)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                                                 for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def test_tiny_random_model_matches_transformers(rng):
    cfg = TINY
    dense = random_dense(cfg, rng, std=0.05)
    w = ref.Weights.from_dense(cfg, dense.__getitem__)
    hf = hf_model(cfg, w.state_dict())
    ids = rng.integers(0, cfg.vocab_size, size=37).tolist()
    want = hf_logits(hf, ids)

    # Prefill all at once, pages from a shuffled free list.
    m = ref.Model(w, max_tokens=64, rng=rng)
    got = m.forward(ids)
    err = rel_l2(got, want)
    print("prefill rel L2", err)
    assert err <= 1e-4

    # Prefill 20, then decode one token at a time: the last logits must agree too.
    m = ref.Model(w, max_tokens=64, rng=rng)
    rows = [m.forward(ids[:20])]
    rows += [m.forward([t]) for t in ids[20:]]
    err = rel_l2(np.concatenate(rows), want)
    print("incremental rel L2", err)
    assert err <= 1e-4


def test_paged_attention_equals_dense(rng):
    Hq, Hkv, Dh, S = 14, 2, 64, 53
    q = rng.standard_normal((Hq, Dh))
    k = rng.standard_normal((S, Hkv, Dh))
    v = rng.standard_normal((S, Hkv, Dh))
    n_pages = 8
    kc = np.full((n_pages, Hkv, 16, Dh), np.nan)
    vc = np.full((n_pages, Hkv, 16, Dh), np.nan)
    bt = rng.permutation(n_pages)[:4]
    ref.write_pages(kc, bt, np.arange(S), k)
    ref.write_pages(vc, bt, np.arange(S), v)
    got = ref.attention_decode(q, kc, vc, bt, S)
    assert np.isfinite(got).all()                     # NaN tails were never read
    # Dense: head h attends with KV head h // 7, softmax(q k^T / sqrt(Dh)) v.
    want = np.empty_like(q)
    for h in range(Hq):
        s = k[:, h // 7] @ q[h] / np.sqrt(Dh)
        p = np.exp(s - s.max()); p /= p.sum()
        want[h] = p @ v[:, h // 7]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_rope_matches_transformers(rng):
    from transformers.models.qwen2 import modeling_qwen2 as mq

    Dh, theta = 128, 1e6
    pos = np.array([0, 1, 15, 16, 511, 4097, 32767])
    cos, sin = ref.rope_cos_sin(pos, Dh, theta)
    x = rng.standard_normal((len(pos), 3, Dh)).astype(np.float32)
    got = ref.apply_rope(x, cos, sin)
    xt = torch.from_numpy(x).transpose(0, 1)[None]             # [1, H, T, Dh]
    c = torch.from_numpy(cos)[None]; s = torch.from_numpy(sin)[None]
    want, _ = mq.apply_rotary_pos_emb(xt, xt, c, s)
    np.testing.assert_allclose(got, want[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    # The angle tables themselves, as HF's rotary embedding computes them.
    hf_cfg = transformers.Qwen2Config(hidden_size=Dh * 2, num_attention_heads=2, rope_theta=theta)
    rot = mq.Qwen2RotaryEmbedding(hf_cfg)
    hc, hs = rot(torch.zeros(1), torch.from_numpy(pos)[None])
    # How far two float32 computations of the same table may drift apart: torch may round
    # inv_freq one ulp (2^-23 relative) away from ours (it does on some CPUs, in 14 of 64
    # entries), and each side rounds pos * inv_freq once (2^-24 relative each). So the angles
    # differ by up to 4 * 2^-24 * |angle|, and cos/sin (slope ≤ 1) by as much, plus one float32
    # rounding of the result itself. At pos 32767 that is ~2e-3 for the fastest frequency: an
    # absolute tolerance from one machine (2e-6) holds only where both sides round alike.
    angle = np.abs(pos[:, None].astype(np.float64) * ref.rope_inv_freq(Dh, theta).astype(np.float64))
    tol = 4 * 2.0**-24 * np.concatenate([angle, angle], axis=1) + 2.0**-23
    for name, ours, theirs in (("cos", cos, hc[0].numpy()), ("sin", sin, hs[0].numpy())):
        excess = np.abs(ours.astype(np.float64) - theirs) - tol
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess.max() <= 0, (f"{name} table at position {pos[worst[0]]}, entry {worst[1]}: "
                                   f"{ours[worst]!r} vs transformers' {theirs[worst]!r}, tolerance {tol[worst]:.3g}")


# ---- long prompts on the CPU: attention in blocks, the forward pass in chunks --------------------

def _dense_attention(q, k, v, q_pos):
    """Attention the direct way (all Hq × T × S scores at once, K/V repeated per head)."""
    T, Hq, Dh = q.shape
    S, Hkv, _ = k.shape
    g = Hq // Hkv
    kx = np.repeat(k, g, axis=1).transpose(1, 0, 2)
    vx = np.repeat(v, g, axis=1).transpose(1, 0, 2)
    scores = q.transpose(1, 0, 2) @ kx.transpose(0, 2, 1) / np.sqrt(Dh)
    scores = np.where((np.arange(S)[None, :] > np.asarray(q_pos)[:, None])[None], -np.inf, scores)
    return (ref.softmax(scores) @ vx).transpose(1, 0, 2)


@pytest.mark.parametrize("block_bytes", [1, 4096, 1 << 20, 1 << 40])
def test_blocked_attention_equals_dense(rng, block_bytes):
    for T, S, Hq, Hkv in ((37, 37, 6, 2), (5, 80, 4, 4), (1, 23, 7, 1)):
        q = rng.standard_normal((T, Hq, 16))
        k, v = rng.standard_normal((S, Hkv, 16)), rng.standard_normal((S, Hkv, 16))
        q_pos = np.arange(S - T, S)
        got = ref.attention(q, k, v, q_pos, block_bytes=block_bytes)
        np.testing.assert_allclose(got, _dense_attention(q, k, v, q_pos), rtol=1e-12, atol=1e-12)


def test_chunked_forward_equals_one_pass(rng):
    from helpers import random_dense

    cfg = TINY.with_layers(2)
    w = ref.Weights.from_dense(cfg, random_dense(cfg, rng).__getitem__, np.float64)
    ids = rng.integers(0, cfg.vocab_size, 300)
    one = ref.Model(w, max_tokens=400, chunk=1000).forward(ids)
    for chunk in (1, 7, 64):
        m = ref.Model(w, max_tokens=400, chunk=chunk)
        np.testing.assert_allclose(m.forward(ids), one, rtol=1e-10, atol=1e-10)
        m.reset()
        np.testing.assert_allclose(m.forward(ids, last_only=True), one[-1:], rtol=1e-10, atol=1e-10)


def test_long_prompt_memory_is_linear(rng, monkeypatch):
    """A 4096-token prompt through one layer: peak memory far below the T × T scores a direct
    attention holds (4 heads × 4096² × 4 B = 256 MiB); 4 MiB score blocks here."""
    import dataclasses
    import tracemalloc

    from helpers import random_dense

    cfg = dataclasses.replace(TINY, num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                              max_position=8192)
    w = ref.Weights.from_dense(cfg, random_dense(cfg, rng).__getitem__, np.float32)
    T = 4096
    monkeypatch.setattr(ref, "ATTENTION_BLOCK_BYTES", 4 << 20)
    m = ref.Model(w, max_tokens=T)
    ids = rng.integers(0, cfg.vocab_size, T)
    tracemalloc.start()
    logits = m.forward(ids, last_only=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dense_scores = cfg.num_heads * T * T * 4
    print(f"peak {peak / 2**20:.1f} MiB, dense scores {dense_scores / 2**20:.0f} MiB")
    assert np.isfinite(logits).all()
    assert peak < dense_scores / 8


def test_cpu_run_that_cannot_fit_is_refused_up_front(tmp_path, rng):
    from helpers import random_dense, write_model

    from drvqwen.errors import DrvqwenError
    from drvqwen.format.nanoqwen import NanoqwenFile
    from drvqwen.generate import CPUBackend, check_cpu_memory, cpu_memory_needed

    path = tmp_path / "m.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng))
    with NanoqwenFile(path) as f:
        need = cpu_memory_needed(TINY, 1000)
        assert need["kv_cache"] == 2 * TINY.num_layers * 1008 * TINY.num_kv_heads * TINY.head_dim * 4
        check_cpu_memory(f, 1000, available=need["total"])       # exactly enough: accepted
        with pytest.raises(DrvqwenError) as ei:
            check_cpu_memory(f, 1000, available=need["total"] - 1)
        msg = str(ei.value)
        assert str(path) in msg and "the CPU backend needs" in msg and "available" in msg and "\n" not in msg
        import drvqwen.generate as g

        old = g.available_memory
        g.available_memory = lambda: 1 << 20
        try:
            with pytest.raises(DrvqwenError, match="the CPU backend needs"):
                CPUBackend(f, 1000)
        finally:
            g.available_memory = old


# ---- YaRN RoPE scaling (config.json rope_scaling) ----------------------------------------------

YARN_DOC = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}   # Qwen2.5's form


def _yarn_cfg(rope_scaling=YARN_DOC, max_position=64):
    import dataclasses

    d = dataclasses.replace(TINY, max_position=max_position).to_hf_dict()
    d["rope_scaling"] = dict(rope_scaling)
    return QwenConfig.from_hf_dict(d, source="m/config.json"), d


def test_yarn_matches_transformers(rng):
    """YaRN as transformers computes it, past the original context (200 tokens, 64 trained),
    from a config.json in the form Qwen2.5's documentation gives."""
    cfg, d = _yarn_cfg()
    assert cfg.rope_scaling.factor == 4.0 and cfg.max_position == 256     # 4 × 64
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in d.items() if k not in ("architectures", "torch_dtype")})
    from transformers.models.qwen2 import modeling_qwen2 as mq

    rot = mq.Qwen2RotaryEmbedding(hf_cfg)
    assert cfg.rope_scaling.attention_factor == pytest.approx(rot.attention_scaling, rel=1e-15)
    # The frequencies agree to float32 rounding (torch's pow may round one ulp apart).
    np.testing.assert_allclose(ref.rope_inv_freq(TINY.head_dim, cfg.rope_theta, cfg.rope_scaling),
                               rot.inv_freq.numpy(), rtol=2.0**-22, atol=0)
    dense = random_dense(cfg, rng, std=0.05)
    w = ref.Weights.from_dense(cfg, dense.__getitem__)
    hf = hf_model(cfg, w.state_dict())
    ids = rng.integers(0, cfg.vocab_size, size=200).tolist()
    want = hf_logits(hf, ids)
    got = ref.Model(w, max_tokens=256).forward(ids)
    assert rel_l2(got, want) <= 1e-4
    # Plain RoPE on the same weights is far off: the scaling is not ignored.
    import dataclasses

    plain = ref.Model(ref.Weights.from_dense(dataclasses.replace(cfg, rope_scaling=None), dense.__getitem__),
                      max_tokens=256).forward(ids)
    assert rel_l2(plain, want) > 0.05


@pytest.mark.parametrize("rope_scaling,expect", [
    ({"type": "linear", "factor": 2.0}, "rope_scaling type 'linear': drvqwen implements YaRN only"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic'"),
    ({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}, "rope_scaling.factor=0.5: must be >= 1"),
    ({"type": "yarn", "factor": float("nan")}, "rope_scaling.factor=nan"),
])
def test_other_rope_scaling_is_refused(rope_scaling, expect):
    from drvqwen.errors import ConfigError

    with pytest.raises(ConfigError) as ei:
        _yarn_cfg(rope_scaling)
    assert str(ei.value).startswith("m/config.json: ") and expect in str(ei.value) and "\n" not in str(ei.value)


def test_yarn_in_gguf_metadata_and_the_file(tmp_path, rng):
    """GGUF's qwen2.rope.scaling.* keys give the same config; the .nanoqwen header keeps it."""
    from drvqwen.errors import ConfigError
    from drvqwen.format.nanoqwen import NanoqwenFile

    from helpers import write_model

    cfg, _ = _yarn_cfg()
    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": TINY.num_heads,
            "qwen2.attention.head_count_kv": TINY.num_kv_heads, "qwen2.embedding_length": TINY.hidden_size,
            "qwen2.feed_forward_length": TINY.intermediate_size, "qwen2.block_count": TINY.num_layers,
            "qwen2.context_length": 64, "qwen2.rope.freq_base": TINY.rope_theta,
            "qwen2.attention.layer_norm_rms_epsilon": TINY.rms_norm_eps,
            "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 64}

    class Meta(dict):
        def __call__(self, key):
            return self.get(key)

    assert QwenConfig.from_gguf_fields(Meta(meta), "m.gguf", TINY.vocab_size) == cfg
    with pytest.raises(ConfigError, match=r"m.gguf: GGUF metadata key 'qwen2.rope.scaling.yarn_log_multiplier'"):
        QwenConfig.from_gguf_fields(Meta(meta | {"qwen2.rope.scaling.yarn_log_multiplier": 0.1}), "m.gguf",
                                    TINY.vocab_size)
    with pytest.raises(ConfigError, match=r"m.gguf: GGUF metadata key 'qwen2.rope.scaling.type'='linear'"):
        QwenConfig.from_gguf_fields(Meta(meta | {"qwen2.rope.scaling.type": "linear"}), "m.gguf", TINY.vocab_size)
    path = tmp_path / "yarn.nanoqwen"
    write_model(path, cfg, random_dense(cfg, rng))
    with NanoqwenFile(path) as f:
        assert f.config == cfg and f.config.rope_scaling == cfg.rope_scaling


def test_fp16_activations_round_where_the_gpu_stores(rng):
    """activations=np.float16: the K/V cache (q/k/v after RoPE) holds FP16 values, the logits
    move by FP16 rounding (not zero, not much), and activations=None is the plain forward."""
    from helpers import random_dense

    cfg = TINY.with_layers(2)
    w = ref.Weights.from_dense(cfg, random_dense(cfg, rng).__getitem__, np.float32)
    ids = rng.integers(0, cfg.vocab_size, 40)
    plain = ref.Model(w, max_tokens=64).forward(ids)
    assert ref.Model(w, max_tokens=64, activations=None).forward(ids).tobytes() == plain.tobytes()
    m16 = ref.Model(w, max_tokens=64, activations=np.float16)
    got = m16.forward(ids)
    kv = m16.cache.k[:, m16.cache.block_table]
    kv = kv[np.isfinite(kv)]                         # the written slots
    assert kv.size and np.array_equal(kv.astype(np.float16).astype(np.float32), kv)
    err = rel_l2(got, plain)
    assert 1e-6 < err < 1e-2, err
