"""The `.nanoqwen` file, the INT4 quantizer and its weight layout, and the converters."""

# The weight policies of a conversion (format/convert.py). DEFAULT_WEIGHTS is the policy of
# `drvqwen convert` without --weights and of the model cache's conversions (the cache key names
# it, models.conversion_path); `source` once the GPU runs every format it keeps. Here, not in
# convert.py, so that the CLI's argument parser names them without importing numpy.
WEIGHT_POLICIES = ("int4", "source")
DEFAULT_WEIGHTS = "int4"
