"""drvqwen: an annotated Qwen2.5-Coder inference runtime for NVIDIA Hopper.

Reading order: `reference.py` (the maths) → `format/` (the file and the INT4 layout) →
`kernels/*.cu` with their tests → the engine → the graphs.
"""

import time as _time

# perf_counter() when drvqwen's first line ran: where the `import` phase of a run's statistics
# starts (stats.process_started).
STARTED = _time.perf_counter()

__version__ = "0.1.0"
