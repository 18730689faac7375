"""The GPU layer: the only code in drvqwen that imports `cuda.bindings` (docs/architecture.md#dependency-direction).

Reading order, bottom up:
- errors.py    every driver/NVRTC result checked; exceptions that name the call
- device.py    cuInit, the primary context, device numbers, `gpu_unavailable_reason()`
- sources.py   where kernels/*.cu and ptx/*.cuh are (checkout or installed wheel)
- nvrtc.py     .cu → sm_90a cubin, cached on disk, with the ptxas resource report
- module.py    cuModuleLoadData, kernels by name, dynamic shared memory opt-in
- tensormap.py TMA descriptors (cuTensorMapEncodeTiled)
- launch.py    streams, events, and `KernelLaunch` with parameters packed once
- memory.py    device buffers, the pool, typed arrays, pinned staging uploads
- graph.py     stream capture → graph → replay; GraphInput, a value handed to a graph
- bandwidth.py the device-to-device copy bandwidth (the benchmark's ceiling)

Importing this package never touches the GPU: libcuda is loaded on the first driver call,
so a machine without a GPU can import everything (and compile kernels with NVRTC).
"""

from .device import Device, DeviceInfo, get_device, gpu_unavailable_reason
from .errors import CudaError, DeviceMemoryError, GpuUnavailableError, NvrtcError, check
from .graph import Graph, GraphExec, capture
from .launch import Event, KernelLaunch, Stream
from .memory import (
    DEFAULT_ALIGN_BYTES,
    KV_PAGE_ALIGN_BYTES,
    DeviceArray,
    DeviceBuffer,
    PinnedHostBuffer,
    Pool,
    StagingUploader,
)
from .module import Function, Module, load_kernel_module
from .nvrtc import ARCH, CompiledKernel, KernelResources, compile_kernel
from .sources import kernel_source, list_kernels
from .tensormap import TensorMap, encode_tiled, encode_tiled_2d, encode_tiled_3d

__all__ = [
    "ARCH",
    "DEFAULT_ALIGN_BYTES",
    "KV_PAGE_ALIGN_BYTES",
    "CompiledKernel",
    "CudaError",
    "Device",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceInfo",
    "DeviceMemoryError",
    "Event",
    "Function",
    "GpuUnavailableError",
    "Graph",
    "GraphExec",
    "KernelLaunch",
    "KernelResources",
    "Module",
    "NvrtcError",
    "PinnedHostBuffer",
    "Pool",
    "StagingUploader",
    "Stream",
    "TensorMap",
    "capture",
    "check",
    "compile_kernel",
    "encode_tiled",
    "encode_tiled_2d",
    "encode_tiled_3d",
    "get_device",
    "gpu_unavailable_reason",
    "kernel_source",
    "list_kernels",
    "load_kernel_module",
]
