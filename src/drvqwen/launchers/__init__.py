"""Launchers: one module per kernel file, each knowing its kernels' grids, blocks and buffers.

Names follow one thread through the code base:

    kernels/rmsnorm.cu → `rmsnorm` kernel → launchers/rmsnorm.py `RmsNorm` → `reference.rmsnorm`
                       → tests/test_kernel_rmsnorm.py

| module (kernels/X.cu)   | launchers                                   | writes                               |
|-------------------------|---------------------------------------------|--------------------------------------|
| embedding               | Embedding, EmbeddingRows                    | residual fp32 [D] / [T, D]           |
| rmsnorm                 | RmsNorm                                     | out fp16 [rows, D]                   |
| gemv_int4               | GemvInt4, GemvInt4QkvRope (norm, RoPE, K/V  | y fp16 [N]; q fp16 + this step's K/V |
|                         | write), GemvInt4Residual,                   | cache slots; residual fp32 (+=);     |
|                         | GemvInt4GateUpSwiglu (norm, SwiGLU); the    | h fp16 [F]; with n_tokens=T, [T, …]  |
|                         | last three also for T tokens (n_tokens)     | of each                              |
| rope_kv                 | RopeKvRows (prefill)                        | q fp16, the chunk's K/V cache slots  |
|                         | RopeTableRows (prefill)                     | the chunk's RoPE cos, sin fp32       |
| attention_decode        | AttentionDecode (+ attention_combine)       | split partials, out fp16 [Hq, Dh]    |
| attention_decode_tma    | AttentionDecodeTma (+ attention_combine)    | split partials, out fp16 [Hq, Dh]    |
| attention_decode_cluster | AttentionDecodeCluster (short contexts,    | out fp16 [Hq, Dh]                    |
|                         | one launch: the merge in a cluster)         |                                      |
| gemv_f16                | LmHead                                      | logits fp32 [V], argmax partials     |
| gemv_fmt                | GemvFmt, GemvFmtQkvRope, GemvFmtResidual,   | as gemv_int4's and LmHead's, for     |
|                         | GemvFmtGateUpSwiglu, LmHeadFmt,             | weights in per-tensor formats; the   |
|                         | EmbeddingFmt, EmbeddingFmtRows              | embedding row in its format          |
| argmax                  | ArgmaxFinal, Argmax                         | next_token int32 [1]                 |
| decode_state            | AdvanceState, SetBlockTableEntry            | state int32 [3], block_table entry   |
| decode_persistent       | PersistentDecode (the embedding and every   | what those launches write, and its   |
|                         | layer of the step as one kernel)            | completion counters                  |
| gemm_int4 (prefill)     | GemmInt4, GemmInt4QkvRows,                  | out / qkv fp32, residual fp32 (+=),  |
|                         | GemmInt4ResidualRows, GemmInt4GateUpSwigluRows | h fp16 [M, F]                     |
|                         | GemmInt4QkvRopeRows                         | q fp16 [M, Hq, Dh], K/V cache slots  |
|                         | gemm_kquant.py: GemmQ4k*, GemmQ5k*, GemmQ6k*; | the same outputs, weights in the   |
|                         | gemm_q32.py: GemmQ32* (Q4_0, Q5_0, Q8_0)    | GGUF's K-quant, Q4/5/8_0 bytes       |
| attention_prefill       | AttentionPrefill                            | out fp16 [M, Hq, Dh]                 |
| prefill_state           | PrefillBeginChunk, DecodeResume             | prefill_state int32 [2], state       |
| sampling                | SampleToken, PenalizedSampleToken,          | next_token, host token ring, the     |
|                         | PublishToken                                | repeat-penalty history, logits       |
| timing                  | GpuSleep                                    | (nothing: holds the stream)          |
| stream_read             | StreamRead (tools/bench_sm_stream.py)       | a checksum u32 per thread            |
| l2_prefetch             | L2Prefetch (the decode step's weights ahead | nothing: L2 holds the spans' bytes   |
|                         | asked into L2)                              |                                      |
| weight_layout           | Int4TileMajor, KQuantLaneWords              | an INT4 qweight, a format's codes,   |
|                         | (gpu_weights.py, at load)                   | q4_k/q5_k scales: the device layout  |

base.py holds what they share: planned buffers (`BufferSpec`), `LaunchSpec` (the arguments by
the kernel's parameter names, in its order), the two-step plan → build of a launcher, occupancy
(from the driver, or fixed for plans without a GPU), argument checks that raise `LaunchError`,
and the registry of constants mirrored from the kernel files (checked against them by
tests/test_kernel_constants.py). signatures.py reads the kernels' `extern "C"` declarations,
which tests/test_kernel_signatures.py checks every launcher's argument names against.
"""

from .argmax import Argmax, ArgmaxFinal
from .attention_decode import AttentionDecode
from .attention_decode_cluster import AttentionDecodeCluster
from .attention_decode_tma import AttentionDecodeTma
from .attention_prefill import AttentionPrefill
from .base import (DEFAULT_OCCUPANCY, BufferSpec, DriverOccupancy, FixedOccupancy, KernelRef, Launcher, LaunchError,
                   LaunchSpec, Occupancy, TensorMapSpec)
from .decode_persistent import PersistentDecode
from .decode_state import AdvanceState, SetBlockTableEntry
from .embedding import Embedding, EmbeddingRows
from .gemm_int4 import GemmInt4, GemmInt4GateUpSwigluRows, GemmInt4QkvRopeRows, GemmInt4QkvRows, GemmInt4ResidualRows
from .gemv_f16 import LmHead, lm_head_partials
from .gemv_fmt import (EmbeddingFmt, EmbeddingFmtRows, FmtWeight, GemvFmt, GemvFmtGateUpSwiglu, GemvFmtQkvRope,
                       GemvFmtResidual, LmHeadFmt)
from .gemv_int4 import GemvInt4, GemvInt4GateUpSwiglu, GemvInt4QkvRope, GemvInt4Residual, gemv_launch_shape
from .l2_prefetch import L2Prefetch
from .prefill_state import DecodeResume, PrefillBeginChunk
from .rmsnorm import RmsNorm
from .rope_kv import RopeKvRows, RopeTableRows
from .sampling import PenalizedSampleToken, PublishToken, SampleToken
from .stream_read import StreamRead
from .timing import GpuSleep
from .weight_layout import Int4TileMajor, KQuantLaneWords

__all__ = [
    "DEFAULT_OCCUPANCY", "AdvanceState", "Argmax", "ArgmaxFinal", "AttentionDecode", "AttentionDecodeCluster", "AttentionDecodeTma",
    "AttentionPrefill", "BufferSpec", "DecodeResume", "DriverOccupancy", "Embedding", "EmbeddingRows",
    "FixedOccupancy", "GemmInt4", "GemmInt4GateUpSwigluRows", "GemmInt4QkvRopeRows", "GemmInt4QkvRows", "GemmInt4ResidualRows",
    "GemvInt4", "GemvInt4GateUpSwiglu", "GemvInt4QkvRope", "GemvInt4Residual", "GpuSleep", "Int4TileMajor", "KernelRef", "KQuantLaneWords",
    "L2Prefetch",
    "LaunchError", "LaunchSpec", "Launcher", "LmHead", "Occupancy", "PenalizedSampleToken", "PersistentDecode",
    "PrefillBeginChunk",
    "PublishToken",
    "RmsNorm", "RopeKvRows", "RopeTableRows", "SampleToken", "SetBlockTableEntry", "StreamRead", "TensorMapSpec",
    "gemv_launch_shape", "lm_head_partials", "EmbeddingFmt", "EmbeddingFmtRows", "FmtWeight", "GemvFmt",
    "GemvFmtGateUpSwiglu", "GemvFmtQkvRope", "GemvFmtResidual", "LmHeadFmt",
]
