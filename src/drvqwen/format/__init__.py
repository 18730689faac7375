"""The `.nanoqwen` file, the INT4 quantizer and its weight layout, and the converters."""

# The weight policies of a conversion (format/convert.py). DEFAULT_WEIGHTS is the policy of
# `drvqwen convert` without --weights and of the model cache's conversions (the cache key names
# the policy a conversion follows, models.conversion_path): a GGUF keeps its tensors in their
# own formats, which the GPU runs and which answer as the file does (docs/quantization.md);
# `int4` re-quantizes on request. Here, not in convert.py, so that the CLI's argument parser
# names them without importing numpy.
WEIGHT_POLICIES = ("int4", "source")
DEFAULT_WEIGHTS = "source"


def weights_followed(weights: str, source_kind: str) -> str:
    """The policy a conversion under `weights` follows for a source of `source_kind` ('gguf' or
    'hf'): `source` keeps a GGUF's blocks; an HF checkpoint (bf16, no blocks to keep) becomes
    INT4 g128 under either policy."""
    return weights if source_kind == "gguf" else "int4"
