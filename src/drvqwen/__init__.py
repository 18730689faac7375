"""drvqwen: an annotated Qwen2.5-Coder inference runtime for NVIDIA Hopper.

Reading order: `reference.py` (the maths) → `format/` (the file and the INT4 layout) →
`kernels/*.cu` with their tests → the engine → the graphs.
"""

__version__ = "0.1.0"
