"""The GPU layer: the only code in drvqwen that imports `cuda.bindings` (docs/architecture.md#dependency-direction).

Reading order, bottom up:
- errors.py    every driver/NVRTC result checked; exceptions that name the call
- device.py    cuInit, the primary context, device numbers, `gpu_unavailable_reason()`
- sources.py   where kernels/*.cu and ptx/*.cuh are (checkout or installed wheel)
- toolchain.py the NVRTC and CUDA headers the cubin cache's key names, recorded so that a run
               with every cubin cached never loads NVRTC
- nvrtc.py     .cu → sm_90a cubin, cached on disk, with the ptxas resource report
- module.py    cuModuleLoadData, kernels by name, dynamic shared memory opt-in
- tensormap.py TMA descriptors (cuTensorMapEncodeTiled)
- launch.py    streams, events, and `KernelLaunch` with parameters packed once
- memory.py    device buffers, the pool, typed arrays, pinned staging uploads
- host_dma.py  host memory the process holds (a file's mapping) registered for DMA, and the copy
- graph.py     stream capture → graph → replay; GraphInput, a value handed to a graph
- bandwidth.py the device-to-device copy bandwidth (the benchmark's ceiling)
- warmup.py    cuInit and the primary context started in a thread through ctypes, while
               Python imports the rest

Importing this package never touches the GPU: libcuda is loaded on the first driver call,
so a machine without a GPU can import everything (and compile kernels with NVRTC). The names
below are imported from their modules when first used.
"""

import importlib

# Name → the module of this package that defines it. Loaded on first use (PEP 562): importing
# the package costs nothing, so `cuda.warmup` can start the driver in the background before
# numpy and cuda.bindings are imported (drvqwen run's start-up, docs/architecture.md).
_EXPORTS = {
    "Device": "device", "DeviceInfo": "device", "get_device": "device", "gpu_unavailable_reason": "device",
    "CudaError": "errors", "DeviceMemoryError": "errors", "GpuUnavailableError": "errors", "NvrtcError": "errors",
    "check": "errors",
    "Graph": "graph", "GraphExec": "graph", "capture": "graph",
    "Event": "launch", "KernelLaunch": "launch", "Stream": "launch",
    "DEFAULT_ALIGN_BYTES": "memory", "KV_PAGE_ALIGN_BYTES": "memory", "DeviceArray": "memory",
    "DeviceBuffer": "memory", "PinnedHostBuffer": "memory", "Pool": "memory", "StagingUploader": "memory",
    "RegisteredHostRange": "host_dma", "RegisteredUploader": "host_dma", "copy_to_device_async": "host_dma",
    "read_only_register_supported": "host_dma",
    "Function": "module", "Module": "module", "load_kernel_module": "module",
    "ARCH": "nvrtc", "CompiledKernel": "nvrtc", "KernelResources": "nvrtc", "compile_kernel": "nvrtc",
    "kernel_source": "sources", "list_kernels": "sources",
    "TensorMap": "tensormap", "encode_tiled": "tensormap", "encode_tiled_2d": "tensormap",
    "encode_tiled_3d": "tensormap",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
    "RegisteredHostRange",
    "RegisteredUploader",
    "StagingUploader",
    "Stream",
    "TensorMap",
    "capture",
    "check",
    "compile_kernel",
    "copy_to_device_async",
    "encode_tiled",
    "encode_tiled_2d",
    "encode_tiled_3d",
    "get_device",
    "gpu_unavailable_reason",
    "kernel_source",
    "list_kernels",
    "load_kernel_module",
    "read_only_register_supported",
]
