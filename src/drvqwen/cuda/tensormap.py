"""TMA descriptors: `cuTensorMapEncodeTiled` for 2-D and 3-D tiles of device memory.

A tensor map tells the TMA unit the shape, strides and element type of a global tensor and
the box (tile) one `cp.async.bulk.tensor` copy moves into shared memory. Kernels take it by
value as `const __grid_constant__ CUtensorMap` (128 bytes, declared in ptx/ because NVRTC
cannot include <cuda.h>); `KernelLaunch` copies `TensorMap.raw_bytes()` into its parameter
storage. Encoding costs ~60 µs from Python (docs/kernels.md#tensor-maps-built-in-python): build each map once per buffer,
never per step.

Shapes here are given row-major, in numpy order (outermost first), like everything else in
drvqwen; CUDA wants innermost first, so they are reversed on the way in. In cuda.bindings the
array arguments must be lists of `cuuint64_t` / `cuuint32_t` objects: plain ints are refused
(docs/kernels.md#tensor-maps-built-in-python).

Constraints checked before the driver is called (CUDA driver API reference,
cuTensorMapEncodeTiled), so a bad descriptor fails with a message instead of
CUDA_ERROR_INVALID_VALUE:
- the global address is 16-byte aligned;
- every stride is a multiple of 16 bytes, below 2^40, and at least the extent it spans;
- every box dimension is 1..256, and the inner box row is a multiple of 16 bytes;
- with a swizzle, the inner box row is at most the swizzle span (32, 64 or 128 bytes);
- element strides are 1..8.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from cuda.bindings import driver

from .device import get_device
from .errors import check

# The size of a CUtensorMap (cuda.h: CU_TENSOR_MAP_NUM_QWORDS = 16 × 8 bytes, 64-byte aligned).
TENSOR_MAP_BYTES = 128
_GLOBAL_ALIGN_BYTES = 16
_STRIDE_MULTIPLE_BYTES = 16
_MAX_STRIDE_BYTES = 2**40
_MAX_BOX_DIM = 256
_MAX_ELEMENT_STRIDE = 8

_DT = driver.CUtensorMapDataType
_DTYPES: dict[str, driver.CUtensorMapDataType] = {
    "float16": _DT.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    "bfloat16": _DT.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,  # ml_dtypes.bfloat16's numpy name
    "float32": _DT.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    "float64": _DT.CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
    "uint8": _DT.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    "int8": _DT.CU_TENSOR_MAP_DATA_TYPE_UINT8,  # TMA moves bytes; signedness is the kernel's business
    "uint16": _DT.CU_TENSOR_MAP_DATA_TYPE_UINT16,
    "uint32": _DT.CU_TENSOR_MAP_DATA_TYPE_UINT32,
    "int32": _DT.CU_TENSOR_MAP_DATA_TYPE_INT32,
    "uint64": _DT.CU_TENSOR_MAP_DATA_TYPE_UINT64,
    "int64": _DT.CU_TENSOR_MAP_DATA_TYPE_INT64,
}

Swizzle = driver.CUtensorMapSwizzle
_SWIZZLE_SPAN_BYTES = {
    Swizzle.CU_TENSOR_MAP_SWIZZLE_32B: 32,
    Swizzle.CU_TENSOR_MAP_SWIZZLE_64B: 64,
    Swizzle.CU_TENSOR_MAP_SWIZZLE_128B: 128,
}
L2Promotion = driver.CUtensorMapL2promotion
OobFill = driver.CUtensorMapFloatOOBfill


class TensorMap:
    """An encoded tensor map and what it describes.

    Attributes:
        handle: the `driver.CUtensorMap` (128 opaque bytes).
        ptr: the global base address.
        dtype: element dtype.
        shape: global shape, row-major (outermost first), in elements.
        strides_bytes: strides of the outer dimensions, row-major, in bytes.
        box: the tile one copy moves, row-major, in elements.
    """

    def __init__(self, handle, ptr, dtype, shape, strides_bytes, box) -> None:
        self.handle = handle
        self.ptr = ptr
        self.dtype = dtype
        self.shape = shape
        self.strides_bytes = strides_bytes
        self.box = box

    @property
    def box_bytes(self) -> int:
        """Bytes one copy of a full box moves: the mbarrier's expected transaction count."""
        return int(np.prod(self.box)) * self.dtype.itemsize

    def raw_bytes(self) -> bytes:
        """The descriptor's 128 bytes, as a kernel receives them by value."""
        return ctypes.string_at(self.handle.getPtr(), TENSOR_MAP_BYTES)

    def __repr__(self) -> str:
        return f"TensorMap({self.dtype}{list(self.shape)}, box={list(self.box)}, 0x{self.ptr:x})"


def _as_ptr(address) -> int:
    ptr = getattr(address, "ptr", address)
    return int(ptr)


def validate_tiled(
    ptr: int,
    dtype: np.dtype,
    shape: Sequence[int],
    strides_bytes: Sequence[int],
    box: Sequence[int],
    element_strides: Sequence[int],
    swizzle: driver.CUtensorMapSwizzle,
) -> None:
    """Check the driver's constraints (module docstring); all arguments row-major.

    Raises:
        ValueError: the first violated constraint, with the offending value.
    """
    rank = len(shape)
    item = dtype.itemsize
    if not 1 <= rank <= 5:
        raise ValueError(f"tensor rank must be 1..5, got {rank}")
    if len(box) != rank or len(element_strides) != rank or len(strides_bytes) != rank - 1:
        raise ValueError(f"rank {rank}: need {rank} box dims and element strides, {rank - 1} strides")
    if ptr % _GLOBAL_ALIGN_BYTES:
        raise ValueError(f"global address 0x{ptr:x} is not {_GLOBAL_ALIGN_BYTES}-byte aligned")
    if any(d < 1 for d in shape):
        raise ValueError(f"shape {list(shape)} has an empty dimension")
    # strides_bytes[i] is the step of dimension i (outer); it must span dimension i+1.
    inner_extent = shape[-1] * item
    for i in reversed(range(rank - 1)):
        s = strides_bytes[i]
        if s % _STRIDE_MULTIPLE_BYTES or not 0 < s < _MAX_STRIDE_BYTES:
            raise ValueError(f"stride {s} B of dimension {i} must be a positive multiple of 16 below 2^40")
        if s < inner_extent:
            raise ValueError(f"stride {s} B of dimension {i} is smaller than the {inner_extent} B it must span")
        inner_extent = s * shape[i]
    if any(not 1 <= b <= _MAX_BOX_DIM for b in box):
        raise ValueError(f"box {list(box)}: each dimension must be 1..{_MAX_BOX_DIM}")
    row_bytes = box[-1] * item
    if row_bytes % 16:
        raise ValueError(f"inner box row {box[-1]} × {item} B = {row_bytes} B is not a multiple of 16 B")
    span = _SWIZZLE_SPAN_BYTES.get(swizzle)
    if span is not None and row_bytes > span:
        raise ValueError(f"inner box row {row_bytes} B exceeds the {span} B swizzle span")
    if any(not 1 <= e <= _MAX_ELEMENT_STRIDE for e in element_strides):
        raise ValueError(f"element strides {list(element_strides)} must be 1..{_MAX_ELEMENT_STRIDE}")


def encode_tiled(
    address,
    dtype,
    shape: Sequence[int],
    box: Sequence[int],
    *,
    strides_bytes: Sequence[int] | None = None,
    element_strides: Sequence[int] | None = None,
    swizzle: driver.CUtensorMapSwizzle = Swizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
    l2_promotion: driver.CUtensorMapL2promotion = L2Promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
    oob_fill: driver.CUtensorMapFloatOOBfill = OobFill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
) -> TensorMap:
    """Encode a tiled tensor map (cuTensorMapEncodeTiled); everything row-major.

    Args:
        address: the global base, an int or anything with `.ptr` (DeviceArray).
        dtype: element dtype (see _DTYPES; int8 travels as UINT8).
        shape: global shape in elements, outermost first.
        box: the tile in elements, outermost first.
        strides_bytes: the rank-1 outer strides in bytes (default: contiguous row-major).
        element_strides: per-dimension traversal strides (default: all 1).
        swizzle: shared-memory bank swizzle (match the kernel's smem layout).
        l2_promotion: L2 sector promotion; NONE unless a kernel has measured otherwise.
        oob_fill: out-of-bounds elements read as zero (NONE) or NaN.

    Returns:
        The `TensorMap`.

    Raises:
        ValueError: a constraint is violated (see `validate_tiled`) or the dtype has no TMA type.
        CudaError: the driver refused the descriptor anyway.
    """
    dt = np.dtype(dtype)
    if dt.name not in _DTYPES:
        raise ValueError(f"no TMA data type for {dt}; known: {', '.join(_DTYPES)}")
    ptr = _as_ptr(address)
    shape = tuple(int(s) for s in shape)
    box = tuple(int(b) for b in box)
    rank = len(shape)
    if strides_bytes is None:
        strides, step = [], dt.itemsize
        for d in reversed(shape[1:]):
            step *= d
            strides.append(step)
        strides_bytes = tuple(reversed(strides))
    strides_bytes = tuple(int(s) for s in strides_bytes)
    element_strides = tuple(int(e) for e in (element_strides or (1,) * rank))
    validate_tiled(ptr, dt, shape, strides_bytes, box, element_strides, swizzle)

    get_device()  # encoding needs the driver
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    handle = check(
        driver.cuTensorMapEncodeTiled(
            _DTYPES[dt.name],
            rank,
            ptr,
            [u64(d) for d in reversed(shape)],
            [u64(s) for s in reversed(strides_bytes)],
            [u32(b) for b in reversed(box)],
            [u32(e) for e in reversed(element_strides)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            l2_promotion,
            oob_fill,
        ),
        "cuTensorMapEncodeTiled",
    )
    return TensorMap(handle, ptr, dt, shape, strides_bytes, box)


def encode_tiled_2d(
    address, dtype, shape: tuple[int, int], box: tuple[int, int], *, row_stride_bytes: int | None = None, **kw
) -> TensorMap:
    """A 2-D map over a [rows, cols] matrix (row stride in bytes, default contiguous).

    Keyword arguments as for `encode_tiled`.
    """
    strides = None if row_stride_bytes is None else (row_stride_bytes,)
    return encode_tiled(address, dtype, shape, box, strides_bytes=strides, **kw)


def encode_tiled_3d(
    address,
    dtype,
    shape: tuple[int, int, int],
    box: tuple[int, int, int],
    *,
    strides_bytes: tuple[int, int] | None = None,
    **kw,
) -> TensorMap:
    """A 3-D map over a [d0, d1, d2] tensor (e.g. KV pages [page, token, head·dim]).

    `strides_bytes` are the strides of d0 and d1 in bytes (default contiguous). Keyword
    arguments as for `encode_tiled`.
    """
    return encode_tiled(address, dtype, shape, box, strides_bytes=strides_bytes, **kw)
