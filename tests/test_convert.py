"""The converter from an HF checkpoint folder: 2 layers at the 7B widths (d_model 3584,
d_ffn 18944, 28/4 heads × 128), bf16 safetensors with std 0.02. The vocabulary is cut to 4096
rows to keep CI's disk and memory small; it changes no code path (the embedding and lm_head
are plain FP16 copies)."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from drvqwen.config import QWEN25_CODER_7B
from drvqwen.errors import ConfigError
from drvqwen.format import quant
from drvqwen.format.convert import convert
from drvqwen.format.nanoqwen import NanoqwenFile

from helpers import minimal_tokenizer_json, random_dense

CFG = QWEN25_CODER_7B.with_layers(2)
CFG = type(CFG)(**{**CFG.to_dict(), "vocab_size": 4096})


def _hf_folder(tmp_path, rng, cfg=CFG, shards=2):
    dense = random_dense(cfg, rng, std=0.02)
    # A few residual channels of large magnitude in the norms, as real Qwen2 models have.
    dense["model.layers.0.input_layernorm.weight"][[7, 1234]] = [300.0, -120.0]
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in dense.items()}
    names = sorted(bf16)
    for i in range(shards):
        part = {k: bf16[k] for k in names[i::shards]}
        save_file(part, str(tmp_path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / "tokenizer.json").write_text(minimal_tokenizer_json())
    return {k: v.astype(np.float32) for k, v in bf16.items()}  # what the file really holds


def test_hf_folder_at_7b_widths(tmp_path, rng):
    src = tmp_path / "hf"
    src.mkdir()
    dense = _hf_folder(src, rng)
    out = tmp_path / "m.nanoqwen"
    report = convert(src, out)
    assert len(report.errors) == 2 * 7
    with NanoqwenFile(out) as f:
        assert f.config == CFG
        for name, w in dense.items():
            if name.endswith(".weight") and (".self_attn." in name or ".mlp." in name):
                base = name[: -len(".weight")]
                w_hat = quant.dequantize(np.asarray(f.tensor(base + ".qweight")),
                                         np.asarray(f.tensor(base + ".scales")))
                s = np.asarray(f.tensor(base + ".scales"))
                assert (np.abs(w - w_hat) <= quant.error_bound(w, s)).all(), name
                n, k = w.shape
                rms = np.sqrt(np.mean(np.square(w - w_hat).reshape(n, k // 128, 128), axis=2))
                assert (rms <= quant.group_rms_bound(w)).all(), name
            else:
                np.testing.assert_array_equal(np.asarray(f.tensor(name), np.float32),
                                              w.astype(np.float16).astype(np.float32), err_msg=name)
    for e in report.errors:
        print(f"{e.name:40s} rel L2 {e.rel_l2:.4f}  SNR {e.snr_db:.1f} dB")
        assert e.rel_l2 < 0.2


def test_non_qwen2_config_is_refused(tmp_path, rng):
    src = tmp_path / "hf"
    src.mkdir()
    d = CFG.to_hf_dict() | {"model_type": "llama"}
    (src / "config.json").write_text(json.dumps(d))
    (src / "tokenizer.json").write_text(minimal_tokenizer_json())
    out = tmp_path / "m.nanoqwen"
    with pytest.raises(ConfigError, match="model_type='llama'"):
        convert(src, out)
    assert not out.exists()


# ---- sharded checkpoints: the index decides ------------------------------------------------------

def _sharded(tmp_path, rng, cfg):
    from helpers import random_dense

    src = tmp_path / "hf"
    src.mkdir()
    dense = random_dense(cfg, rng)
    names = sorted(dense)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: dense[k] for k in names[i::2]} for i in range(2)}
    for fname, part in shards.items():
        save_file(part, str(src / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (src / "tokenizer.json").write_text(minimal_tokenizer_json())
    return src, dense


def test_index_names_the_shards_and_a_stale_one_is_ignored(tmp_path, rng):
    from helpers import TINY

    src, dense = _sharded(tmp_path, rng, TINY)
    stale = {"model.norm.weight": np.full(TINY.hidden_size, 7.0, np.float32)}
    save_file(stale, str(src / "model-00001-of-00003.safetensors"))   # left by an older download
    convert(src, tmp_path / "m.nanoqwen")
    with NanoqwenFile(tmp_path / "m.nanoqwen") as f:
        np.testing.assert_array_equal(np.asarray(f.tensor("model.norm.weight"), np.float32),
                                      dense["model.norm.weight"].astype(np.float16).astype(np.float32))


def test_tensor_found_twice_is_refused(tmp_path, rng):
    from helpers import TINY

    from drvqwen.errors import FormatError

    src, dense = _sharded(tmp_path, rng, TINY)
    (src / "model.safetensors.index.json").unlink()           # no index: every file is read
    save_file({"model.norm.weight": dense["model.norm.weight"]}, str(src / "extra.safetensors"))
    with pytest.raises(FormatError, match=r"tensor model.norm.weight is stored twice, in "):
        convert(src, tmp_path / "m.nanoqwen")
    assert not (tmp_path / "m.nanoqwen").exists()


@pytest.mark.parametrize("edit,expect", [
    (lambda wm: wm.update({"model.norm.weight": "../elsewhere.safetensors"}), "is not a shard file name"),
    (lambda wm: wm.update({"model.norm.weight": "model-00009-of-00009.safetensors"}), "shard model-00009-of-00009.safetensors named in weight_map is missing"),
    (lambda wm: wm.update({"model.ghost.weight": "model-00001-of-00002.safetensors"}), "tensor model.ghost.weight is not in its shard"),
])
def test_bad_index_is_named(tmp_path, rng, edit, expect):
    from helpers import TINY

    from drvqwen.errors import FormatError

    src, _ = _sharded(tmp_path, rng, TINY)
    ip = src / "model.safetensors.index.json"
    d = json.loads(ip.read_text())
    edit(d["weight_map"])
    ip.write_text(json.dumps(d))
    with pytest.raises(FormatError) as ei:
        convert(src, tmp_path / "m.nanoqwen")
    assert "model.safetensors.index.json" in str(ei.value) and expect in str(ei.value)
