"""Loaded cubins (`CUmodule`) and the kernels in them (`CUfunction`).

Kernels are declared `extern "C"` so their symbol is their plain name and
`module.function("rmsnorm")` finds them without C++ name mangling.
"""

from __future__ import annotations

from cuda.bindings import driver

from .device import get_device
from .errors import CudaError, check
from .nvrtc import CompiledKernel, compile_kernel

# A block may use up to 48 KiB of shared memory (static + dynamic) without asking; beyond that it must
# opt in per function with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, up to the
# device's max_smem_per_block_optin_bytes (CUDA C Programming Guide, "Shared Memory",
# compute capability 7.x and later).
DEFAULT_SMEM_PER_BLOCK_BYTES = 48 * 1024
# Blocks per cluster every sm_90 part can co-schedule ("portable"); a kernel compiled with a larger
# __cluster_dims__ (up to 16 on the H100/H200) launches only after opting in per function with
# CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (CUDA C Programming Guide, "Thread Block
# Clusters").
PORTABLE_CLUSTER_BLOCKS = 8

_FA = driver.CUfunction_attribute


class Function:
    """One kernel of a loaded module.

    Attributes:
        name: the kernel's symbol.
        handle: the `CUfunction`.
        module: the `Module` it belongs to (kept alive as long as the function is).
    """

    def __init__(self, module: Module, name: str, handle: driver.CUfunction) -> None:
        self.module = module
        self.name = name
        self.handle = handle
        self._dynamic_smem_limit = 0  # dynamic bytes already known to launch (checked once each)
        self._param_sizes: tuple[int, ...] | None = None

    def attribute(self, attr: driver.CUfunction_attribute) -> int:
        """cuFuncGetAttribute, e.g. CU_FUNC_ATTRIBUTE_NUM_REGS."""
        return int(check(driver.cuFuncGetAttribute(attr, self.handle), "cuFuncGetAttribute"))

    @property
    def num_registers(self) -> int:
        """Registers per thread, as loaded (matches the ptxas report)."""
        return self.attribute(_FA.CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def max_threads_per_block(self) -> int:
        """The largest block this kernel can launch with, given its registers and bounds."""
        return self.attribute(_FA.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)

    def max_active_clusters(self, grid: tuple[int, int, int], threads: int, dynamic_smem_bytes: int = 0) -> int:
        """Clusters of this kernel (its compile-time __cluster_dims__) the device runs at once
        for a launch of `grid` blocks of `threads` threads (cuOccupancyMaxActiveClusters): a
        cluster's blocks share one GPC, so this counts the GPCs with room, not the SM total.
        Past the portable cluster size, call allow_its_cluster_size first (module loading does).
        """
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = int(threads), 1, 1
        cfg.sharedMemBytes = int(dynamic_smem_bytes)
        cfg.numAttrs = 0
        return int(check(driver.cuOccupancyMaxActiveClusters(self.handle, cfg), "cuOccupancyMaxActiveClusters"))

    def max_active_blocks_per_sm(self, threads: int, dynamic_smem_bytes: int = 0) -> int:
        """Resident blocks of this kernel per SM for a block of `threads` threads and
        `dynamic_smem_bytes` of dynamic shared memory, as the driver computes it
        (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory with its per-block
        reservation, the thread and block limits of the SM). 0 if such a block cannot launch.

        Raises:
            CudaError: the driver refused the query (e.g. more threads than the kernel allows).
        """
        return int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.handle, int(threads), int(dynamic_smem_bytes)), "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        """Allow launches with `nbytes` of dynamic shared memory (opt in above 48 KiB).

        Idempotent and cheap after the first call for a given size.

        Raises:
            ValueError: more than the device allows per block (227 KiB on sm_90).
            CudaError: the driver refused the attribute.
        """
        if nbytes <= self._dynamic_smem_limit:
            return
        # The 48 KiB default covers static + dynamic together: a kernel with static shared
        # memory needs the opt-in sooner (its launch is refused with INVALID_VALUE otherwise).
        static = self.attribute(_FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        if static + nbytes <= DEFAULT_SMEM_PER_BLOCK_BYTES:
            self._dynamic_smem_limit = nbytes
            return
        limit = get_device().info.max_smem_per_block_optin_bytes
        if static + nbytes > limit:
            raise ValueError(
                f"kernel {self.name}: {nbytes} B of dynamic + {static} B of static shared memory asked, "
                f"device allows {limit} B"
            )
        check(
            driver.cuFuncSetAttribute(self.handle, _FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        )
        self._dynamic_smem_limit = nbytes

    def allow_its_cluster_size(self) -> None:
        """Opt in to the kernel's own compile-time cluster size where it is past the portable 8
        blocks (PORTABLE_CLUSTER_BLOCKS); nothing for other kernels.

        Raises:
            CudaError: the driver refused the attribute (a device without such clusters).
        """
        blocks = (self.attribute(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH)
                  * max(1, self.attribute(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT))
                  * max(1, self.attribute(_FA.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH)))
        if blocks > PORTABLE_CLUSTER_BLOCKS:
            check(driver.cuFuncSetAttribute(self.handle, _FA.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) of {self.name}")

    @property
    def param_sizes(self) -> tuple[int, ...]:
        """The size in bytes of each kernel parameter, read from the cubin (cuFuncGetParamInfo).

        Used by `KernelLaunch` to refuse a parameter of the wrong width (an int32 where the
        kernel takes a 64-bit pointer) before it turns into a silent wrong read.
        """
        if self._param_sizes is None:
            sizes = []
            while True:
                err, _offset, size = driver.cuFuncGetParamInfo(self.handle, len(sizes))
                if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
                    break  # past the last parameter
                if err:
                    what = f"parameter {len(sizes)} of {self.name}"
                    raise CudaError("cuFuncGetParamInfo", err.name, what, int(err))
                sizes.append(int(size))
            self._param_sizes = tuple(sizes)
        return self._param_sizes

    def __repr__(self) -> str:
        return f"Function({self.name!r})"


class Module:
    """A cubin loaded into the current context.

    Attributes:
        handle: the `CUmodule`.
        name: a label for messages (the kernel file's stem).
    """

    def __init__(self, cubin: bytes, name: str = "<cubin>") -> None:
        """Load `cubin` with cuModuleLoadData.

        Raises:
            GpuUnavailableError: no usable GPU.
            CudaError: the driver refused the image (e.g. CUDA_ERROR_NO_BINARY_FOR_GPU on a
                non-sm_90 device).
        """
        get_device()  # a module needs a current context
        self.name = name
        self.handle = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        """The kernel `name` (its extern "C" symbol), looked up once and cached.

        Raises:
            CudaError: no such kernel in the module (CUDA_ERROR_NOT_FOUND).
        """
        fn = self._functions.get(name)
        if fn is None:
            handle = check(
                driver.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})"
            )
            fn = self._functions[name] = Function(self, name, handle)
            fn.allow_its_cluster_size()
        return fn

    def unload(self) -> None:
        """cuModuleUnload; the module's functions must not be launched afterwards."""
        if self.handle is not None:
            check(driver.cuModuleUnload(self.handle), "cuModuleUnload")
            self.handle = None
            self._functions.clear()

    def __repr__(self) -> str:
        return f"Module({self.name!r})"


# One module per cubin key: loading the same kernel file twice would waste device memory
# and give two handles for one kernel.
_loaded: dict[str, Module] = {}
# The module of each request (name and compile options) this process has loaded: a request is
# made once per launch built (hundreds per model), and compile_kernel's cache look-up — hashing
# the sources, reading and checking the cubin, parsing its report — costs ~1 ms each time.
_by_request: dict[tuple, Module] = {}


def _request_key(name: str, compile_kwargs: dict) -> tuple:
    """(name, the options that shape the cubin, hashable); empty options are left out, so that
    `defines={}` and no defines are the same request."""
    def frozen(v):
        if isinstance(v, dict):
            return tuple(sorted((k, frozen(x)) for k, x in v.items()))
        if isinstance(v, (list, tuple)):
            return tuple(frozen(x) for x in v)
        return str(v)

    return name, tuple(sorted((k, frozen(v)) for k, v in compile_kwargs.items() if v not in (None, {}, (), [])))


def load_kernel_module(name: str, *, compiled: CompiledKernel | None = None, **compile_kwargs) -> Module:
    """Compile (or take from the cache) `kernels/<name>.cu` and load it, once per process.

    Args:
        name: the kernel file's stem, or "dev/NAME" for an experiment in `kernels/dev/`.
        compiled: the kernel already compiled with these options (`nvrtc.compile_kernels`,
            which compiles many at once); None: compiled here.
        **compile_kwargs: passed to `nvrtc.compile_kernel` (defines, extra_options, …).

    Returns:
        The loaded `Module`; the same object for the same source and options. A request seen
        before is answered without looking at the sources again; `use_cache=False` always
        compiles.
    """
    key = _request_key(name, compile_kwargs)
    fresh = compile_kwargs.get("use_cache") is False
    module = None if fresh else _by_request.get(key)
    if module is not None and module.handle is not None:
        return module
    if compiled is None:
        compiled = compile_kernel(name, **compile_kwargs)
    module = _loaded.get(compiled.cache_key)
    if module is None or module.handle is None:
        module = _loaded[compiled.cache_key] = Module(compiled.cubin, name)
    _by_request[key] = module
    return module
