"""`QwenConfig`: the numbers that shape a Qwen2 model, from any of the three sources.

Sources: a Hugging Face `config.json`, GGUF metadata (`qwen2.*` keys), or a `.nanoqwen`
header (format/nanoqwen.py packs and unpacks it). Nothing in drvqwen hard-codes 3584:
every shape is read from here. Facts for the presets: docs/model.md#qwen25-coder-in-numbers (the models' config.json
on the Hugging Face hub).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError

# Special token ids of the Qwen2.5 tokenizer (docs/model.md#the-tokenizer); the same for every size.
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
FIM_PREFIX_ID = 151659
FIM_MIDDLE_ID = 151660
FIM_SUFFIX_ID = 151661


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (Peng et al., "YaRN: Efficient Context Window Extension of Large
    Language Models", 2023), the one Qwen2.5 documents for contexts past 32K (factor 4).

    The inverse frequencies blend interpolation (1 / (factor · base^(2i/d))) and extrapolation
    (1 / base^(2i/d)) along a linear ramp between the dimensions that turn beta_fast and
    beta_slow times over original_max_position; cos and sin are multiplied by
    attention_factor. Exactly `transformers.modeling_rope_utils._compute_yarn_parameters`
    (reference.rope_inv_freq computes it in float32 as torch does).

    Attributes:
        factor: the context extension factor (>= 1).
        original_max_position: the context the model was trained for.
        beta_fast, beta_slow: rotation counts bounding the ramp (defaults 32 and 1).
        attention_factor: the cos/sin scale, resolved when read (default 0.1 ln(factor) + 1).
        truncate: round the ramp's ends to whole dimensions (transformers' default).
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"config field rope_scaling.{name}={v!r}: must be a positive number")
        if self.factor < 1:
            raise ConfigError(f"config field rope_scaling.factor={self.factor!r}: must be >= 1")
        if not isinstance(self.original_max_position, int) or not 0 < self.original_max_position < 1 << 31:
            raise ConfigError(f"config field rope_scaling.original_max_position={self.original_max_position!r}: "
                              f"must be a positive integer")

    @staticmethod
    def default_attention_factor(factor: float, mscale: float | None = None,
                                 mscale_all_dim: float | None = None) -> float:
        """transformers' default: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        when both are given, else get_mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1)."""
        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        return get_mscale(factor)

    @property
    def max_position(self) -> int:
        """The context the scaling extends to: factor × original_max_position."""
        return int(self.factor * self.original_max_position)

    @classmethod
    def from_hf(cls, d: dict[str, Any], max_position_embeddings: int, source: str) -> "RopeScaling | None":
        """The scaling a config.json asks for (`rope_scaling`, or transformers 5's
        `rope_parameters`), None for plain RoPE.

        Raises:
            ConfigError: a scaling type other than YaRN, or a YaRN field out of range — never
                ignored: RoPE without the scaling the model expects gives wrong text past the
                original context.
        """
        rs = d.get("rope_scaling")
        if rs is None:
            rs = d.get("rope_parameters")
        if rs is None:
            return None
        if not isinstance(rs, dict):
            raise ConfigError(f"{source}: rope_scaling={str(rs)[:60]!r}: expected an object")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind in ("default", None) and "factor" not in rs:
            return None
        if kind != "yarn":
            raise ConfigError(f"{source}: rope_scaling type {kind!r}: drvqwen implements YaRN only "
                              f"(remove rope_scaling to run within {max_position_embeddings} tokens)")
        original = rs.get("original_max_position_embeddings", max_position_embeddings)
        factor = rs.get("factor")
        if factor is None:          # transformers: the ratio of the two context lengths
            factor = max_position_embeddings / original
        factor = float(factor)
        af = rs.get("attention_factor")
        if af is None:
            af = cls.default_attention_factor(factor, rs.get("mscale"), rs.get("mscale_all_dim"))
        return cls(factor=factor, original_max_position=int(original),
                   beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                   attention_factor=float(af), truncate=bool(rs.get("truncate", True)))


@dataclass(frozen=True)
class QwenConfig:
    """Shape and constants of a Qwen2 decoder-only model.

    Attributes:
        vocab_size: rows of the embedding and of lm_head (152064 for 7B, 151936 for 0.5B).
        hidden_size: d_model.
        intermediate_size: d_ffn of the SwiGLU MLP.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA: num_heads % num_kv_heads == 0).
        head_dim: per-head width; hidden_size == num_heads * head_dim for every Qwen2.5 size.
        max_position: the context length the model was trained for (32768).
        rope_theta: RoPE base (1e6 for Qwen2.5).
        rms_norm_eps: RMSNorm epsilon (1e-6).
        tie_word_embeddings: lm_head shares the embedding matrix (HF 0.5B–3B). A `.nanoqwen`
            file always stores its own lm_head tensor; this flag records where it came from.
        rope_scaling: YaRN RoPE scaling (RopeScaling), or None for plain RoPE. With it,
            max_position is the extended context (factor × original_max_position).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def group_size_gqa(self) -> int:
        """Query heads per KV head (7 for every Qwen2.5-Coder size here)."""
        return self.num_heads // self.num_kv_heads

    def validate(self) -> None:
        """Raise ConfigError naming the field when a value cannot describe a Qwen2 model."""
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position")
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field {name}={v!r}: must be a positive integer")
        if self.vocab_size > 1 << 20:
            raise ConfigError(f"config field vocab_size={self.vocab_size}: implausibly large")
        if self.hidden_size > 1 << 16 or self.intermediate_size > 1 << 18:
            raise ConfigError(f"config hidden_size={self.hidden_size} / intermediate_size="
                              f"{self.intermediate_size}: implausibly large")
        if self.num_layers > 512:
            raise ConfigError(f"config field num_layers={self.num_layers}: implausibly large")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"config num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ConfigError(f"config field head_dim={self.head_dim}: RoPE needs an even head_dim")
        if not (0 < self.rope_theta < float("inf")):
            raise ConfigError(f"config field rope_theta={self.rope_theta!r}: must be positive")
        if not (0 < self.rms_norm_eps < 1):
            raise ConfigError(f"config field rms_norm_eps={self.rms_norm_eps!r}: must be in (0, 1)")

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "QwenConfig":
        """Build from a Hugging Face `config.json` dict of a Qwen2 model.

        Raises:
            ConfigError: the architecture is not Qwen2, a field is missing or out of range.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: not a JSON object")
        arch = d.get("model_type")
        if arch != "qwen2":
            raise ConfigError(f"{source}: model_type={arch!r}, drvqwen runs only 'qwen2' models")
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            if n_heads <= 0:
                raise ConfigError(f"{source}: num_attention_heads={n_heads}: must be a positive integer")
            max_pos = int(d.get("max_position_embeddings", 32768))
            scaling = RopeScaling.from_hf(d, max_pos, source)
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(d.get("num_key_value_heads", n_heads)),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                # The context YaRN extends to (Qwen2.5: 4 × 32768), unless the config says more.
                max_position=max(max_pos, scaling.max_position) if scaling else max_pos,
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r}") from None
        except ConfigError as e:  # a value validate() refused: say which file it came from
            if str(e).startswith(f"{source}:"):
                raise
            raise ConfigError(f"{source}: {e}") from None
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            raise ConfigError(f"{source}: bad value ({e})") from None

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "QwenConfig":
        """Build from an HF `config.json` file. Raises ConfigError/FileNotFoundError-as-ConfigError."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_hf_dict(d, source=str(path))

    @classmethod
    def from_gguf_fields(cls, get, source: str, vocab_size: int, tied: bool = False) -> "QwenConfig":
        """Build from GGUF metadata.

        Args:
            get: callable(key) -> value or None, reading a GGUF metadata key.
            source: file name for error messages.
            vocab_size: rows of the token embedding tensor (GGUF has no vocab_size key).
            tied: the file has no `output.weight` (the embedding is the lm_head).
        """
        arch = get("general.architecture")
        if arch != "qwen2":
            raise ConfigError(f"{source}: general.architecture={arch!r}, drvqwen runs only 'qwen2' models")

        def num(key: str, kind=int, default=None):
            v = get(key)
            if v is None:
                if default is None:
                    raise ConfigError(f"{source}: GGUF metadata key {key!r} missing")
                return default
            try:
                if isinstance(v, (list, tuple, str, bytes)):
                    raise TypeError
                return kind(v)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"{source}: GGUF metadata key {key!r}={str(v)[:40]!r}: not a "
                                  f"single {kind.__name__}") from None

        n_heads = num("qwen2.attention.head_count")
        hidden = num("qwen2.embedding_length")
        scaling = cls._gguf_rope_scaling(get, num, source)
        if n_heads <= 0:
            raise ConfigError(f"{source}: GGUF metadata key 'qwen2.attention.head_count'={n_heads}: "
                              f"must be a positive integer")
        try:
            return cls(
                vocab_size=int(vocab_size),
                hidden_size=hidden,
                intermediate_size=num("qwen2.feed_forward_length"),
                num_layers=num("qwen2.block_count"),
                num_heads=n_heads,
                num_kv_heads=num("qwen2.attention.head_count_kv", default=n_heads),
                head_dim=hidden // n_heads,
                max_position=max(num("qwen2.context_length", default=32768),
                                 scaling.max_position if scaling else 0),
                rope_theta=num("qwen2.rope.freq_base", float, default=1e6),
                rms_norm_eps=num("qwen2.attention.layer_norm_rms_epsilon", float, default=1e-6),
                tie_word_embeddings=tied,
                rope_scaling=scaling,
            )
        except ConfigError as e:  # a value validate() refused: say which file it came from
            if str(e).startswith(f"{source}:"):
                raise
            raise ConfigError(f"{source}: {e}") from None

    # llama.cpp's RoPE scaling keys that describe YaRN as transformers computes it.
    _GGUF_YARN_KEYS = ("type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow",
                       "finetuned")

    @classmethod
    def _gguf_rope_scaling(cls, get, num, source: str) -> RopeScaling | None:
        """`qwen2.rope.scaling.*` of a GGUF as a RopeScaling (None for "none" or absent).

        Raises:
            ConfigError: another scaling type, or a key that changes YaRN in ways drvqwen
                does not compute (attn_factor, yarn_ext_factor, yarn_log_multiplier …).
        """
        kind = get("qwen2.rope.scaling.type")
        if kind in (None, "none"):
            if get("qwen2.rope.scaling.factor") not in (None, 1, 1.0, 0, 0.0):
                raise ConfigError(f"{source}: GGUF metadata key 'qwen2.rope.scaling.factor' without a "
                                  f"scaling type")
            return None
        if kind != "yarn":
            raise ConfigError(f"{source}: GGUF metadata key 'qwen2.rope.scaling.type'={str(kind)[:20]!r}: "
                              f"drvqwen implements YaRN only")
        keys = getattr(get, "keys", None)
        for key in (keys() if callable(keys) else ()):
            if key.startswith("qwen2.rope.scaling.") and key.split(".", 3)[3] not in cls._GGUF_YARN_KEYS:
                raise ConfigError(f"{source}: GGUF metadata key {key!r}: a YaRN variant drvqwen does not compute")
        factor = num("qwen2.rope.scaling.factor", float)
        return RopeScaling(factor=factor, original_max_position=num("qwen2.rope.scaling.original_context_length"),
                           beta_fast=num("qwen2.rope.scaling.yarn_beta_fast", float, default=32.0),
                           beta_slow=num("qwen2.rope.scaling.yarn_beta_slow", float, default=1.0),
                           attention_factor=RopeScaling.default_attention_factor(factor))

    def with_layers(self, num_layers: int) -> "QwenConfig":
        """The same widths with a different layer count (tests use 2–4 layers at 7B widths)."""
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json dict (for building `transformers` models in tests)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            **({"rope_scaling": {"type": "yarn", "factor": self.rope_scaling.factor,
                                 "original_max_position_embeddings": self.rope_scaling.original_max_position,
                                 "beta_fast": self.rope_scaling.beta_fast, "beta_slow": self.rope_scaling.beta_slow,
                                 "attention_factor": self.rope_scaling.attention_factor,
                                 "truncate": self.rope_scaling.truncate}}
               if self.rope_scaling else {}),
            "hidden_act": "silu",
            "use_sliding_window": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": IM_END_ID,
        }


# Presets: the Qwen2.5-Coder family, from each model's config.json (the three small ones tie the
# embedding; vocabularies are 151 936 rows up to 3B and 152 064 from 7B on). Speed does not
# depend on the weights' values, so `drvqwen bench --preset` runs every size on synthetic weights.
QWEN25_CODER_05B = QwenConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                              num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                              tie_word_embeddings=True)
QWEN25_CODER_1_5B = QwenConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                               tie_word_embeddings=True)
QWEN25_CODER_3B = QwenConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                             num_layers=36, num_heads=16, num_kv_heads=2, head_dim=128,
                             tie_word_embeddings=True)
QWEN25_CODER_7B = QwenConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                             num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128)
QWEN25_CODER_14B = QwenConfig(vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                              num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128)
QWEN25_CODER_32B = QwenConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                              num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128)
PRESETS: dict[str, QwenConfig] = {"0.5b": QWEN25_CODER_05B, "1.5b": QWEN25_CODER_1_5B, "3b": QWEN25_CODER_3B,
                                  "7b": QWEN25_CODER_7B, "14b": QWEN25_CODER_14B, "32b": QWEN25_CODER_32B}
