"""`QwenConfig`: the numbers that shape a Qwen2 model, from any of the three sources.

Sources: a Hugging Face `config.json`, GGUF metadata (`qwen2.*` keys), or a `.nanoqwen`
header (format/nanoqwen.py packs and unpacks it). Nothing in drvqwen hard-codes 3584:
every shape is read from here. Facts for the presets: docs/model.md#qwen25-coder-in-numbers (the models' config.json
on the Hugging Face hub).
"""

from __future__ import annotations

import json
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
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(d.get("num_key_value_heads", n_heads)),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                max_position=int(d.get("max_position_embeddings", 32768)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
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
                max_position=num("qwen2.context_length", default=32768),
                rope_theta=num("qwen2.rope.freq_base", float, default=1e6),
                rms_norm_eps=num("qwen2.attention.layer_norm_rms_epsilon", float, default=1e-6),
                tie_word_embeddings=tied,
            )
        except ConfigError as e:  # a value validate() refused: say which file it came from
            if str(e).startswith(f"{source}:"):
                raise
            raise ConfigError(f"{source}: {e}") from None

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
