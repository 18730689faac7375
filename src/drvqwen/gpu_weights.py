"""The model's weights on the GPU: one pool, one named buffer per `.nanoqwen` tensor.

The file is mmapped and validated first (format/nanoqwen.py); only then is the weight pool
allocated — sized exactly from the tensor table — and each tensor copied by DMA straight from
the mapping, whose pages are registered read-only with the driver for the upload
(cuda/host_dma.py). Where the driver cannot register them, the tensors go through the pinned
double-buffered staging uploader, read from the mapping chunk by chunk. Either way the host
never holds the model twice (the page cache holds what the kernel maps, and no more).

Buffer names are the file's tensor names (HF names: `model.layers.3.mlp.down_proj.qweight`),
so the tests and tools can find any weight by the name HF users know.

A model that runs the INT4 step (every projection INT4 g128: format/tensor_set.py's
default_formats) has its projections' qweight rearranged on the GPU right after the upload into
the device layout the INT4 kernels read (format/int4_tiles.py, kernels/weight_layout.cu; q/k/v
RoPE-paired by the head dim). A model in per-tensor formats has the qweight and qhigh of every
weight whose codes have 4–6 bits (launchers/gemv_fmt.py: tile_major_parts) rearranged the same
way, rows in plain order, and the scales and superscales of every q4_k/q5_k weight made one
plane of lane words, `<prefix>.scales` uint32 [N, K/256, 4] with no `.superscales`
(format/kquant_lanes.py; launchers/gemv_fmt.py: device_tensors); its other tensors stay as
stored. A tile-major array keeps the file's shape ([N, K/8] for a qweight) — the same number of
words, N being a multiple of 16, and the shape the decode and prefill plans check their buffers
against — but holds the words as [N/16, K/128, 16, W] (W = 16 for the codes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Callable

import numpy as np

from . import startup
from .config import QwenConfig
from .cuda import (DEFAULT_ALIGN_BYTES, CudaError, DeviceArray, Pool, RegisteredUploader, StagingUploader,
                   read_only_register_supported)
from .errors import FormatError
from .format import weight_formats as wf
from .format.int4_tiles import GROUP_WORDS, TILE_ROWS
from .format.nanoqwen import NanoqwenFile, TensorInfo
from .format.tensor_set import in_per_tensor_formats, proj_prefix, weight_shapes


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _device_nbytes(info) -> int:
    """Bytes a tensor takes on the GPU (FP32 tensors are stored as FP16 there)."""
    return info.nbytes // 2 if info.dtype == wf.F32 else info.nbytes


def weight_pool_bytes(tensors: Iterable[TensorInfo]) -> int:
    """Bytes of the weight pool that GPUWeights allocates for `tensors` (a NanoqwenFile, or
    some of its TensorInfos): each tensor's device bytes rounded up to the pool's alignment, and
    one alignment more."""
    return sum(_aligned(_device_nbytes(i), DEFAULT_ALIGN_BYTES) for i in tensors) + DEFAULT_ALIGN_BYTES


def tile_major_planes(f: NanoqwenFile, config: QwenConfig | None = None) -> dict[str, tuple[int, int]]:
    """The tensors of `f` that the GPU reads tile-major, each with its (pair_dim, words a row and
    128-input group) (format/int4_tiles.py): an INT4 model's projections' qweight (q/k/v
    RoPE-paired by the head dim), or in a per-tensor model the qweight and qhigh of every
    weight whose codes have 4–6 bits (rows plain; launchers/gemv_fmt.py: tile_major_parts).
    `config`: the model's, or fewer layers of it (GPUWeights' num_layers)."""
    config = config or f.config
    if not in_per_tensor_formats(config, f.formats):
        paired = ("q_proj", "k_proj", "v_proj")
        return {i.name: (config.head_dim if i.name.split(".")[-2] in paired else 0, GROUP_WORDS)
                for i in f if i.name.startswith("model.layers.") and i.name.endswith(".qweight")}
    from .launchers.gemv_fmt import tile_major_parts

    names = {i.name for i in f}
    return {f"{prefix}.{part}": (0, words) for prefix, fid in f.formats.items() if fid != wf.PLAIN
            for part, words in tile_major_parts(wf.FORMATS[fid]).items() if f"{prefix}.{part}" in names}


def lane_word_weights(f: NanoqwenFile) -> list[str]:
    """The weights of `f` (prefixes) whose scales and superscales the GPU holds as lane words:
    those in q4_k or q5_k (launchers/gemv_fmt.py: lane_word_scales; format/kquant_lanes.py)."""
    from .launchers.gemv_fmt import lane_word_scales

    return [prefix for prefix, fid in f.formats.items() if fid in wf.FORMATS and lane_word_scales(wf.FORMATS[fid])]


def gpu_tensors(config: QwenConfig, formats: Mapping[str, int] | None = None) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The tensors GPUWeights holds for a model of `config` with `formats` (tensor_set's
    expected_tensors, the file's set) as name → (dtype, shape): the file's, but for each q4_k/q5_k
    weight one `<prefix>.scales` uint32 [N, K/256, 4] of lane words in place of its scales and
    superscales (launchers/gemv_fmt.py: device_tensors). What the step plans check against."""
    from .format.tensor_set import expected_tensors
    from .launchers.gemv_fmt import device_tensors, lane_word_scales

    out = expected_tensors(config, formats)
    shapes = weight_shapes(config)
    for prefix, fid in (formats or {}).items():
        fmt = wf.FORMATS.get(fid)
        if fmt is None or not lane_word_scales(fmt) or f"{prefix}.scales" not in out:
            continue
        del out[f"{prefix}.superscales"]
        out[f"{prefix}.scales"] = device_tensors(fmt, prefix, *shapes[prefix])[f"{prefix}.scales"]
    return out


def layout_scratch_bytes(f: NanoqwenFile) -> int:
    """Device bytes GPUWeights borrows while it rearranges the tile-major planes of `f` (one
    scratch buffer, the largest plane's size; 0 if none): for the 7B in Q4_K_M, its Q6_K lm_head's
    codes, uint32 [152064, 448]."""
    planes = tile_major_planes(f)
    return max((f.tensors[n].nbytes for n in planes), default=0)


def check_gpu_formats(f: NanoqwenFile) -> str | None:
    """None if the GPU kernels run every weight of `f` in its format, else a one-line reason
    naming the first weight that they do not (its format and shape), or a layer whose gate_proj
    and up_proj differ in format."""
    from .launchers.gemv_fmt import GPU_FORMAT_IDS, QUAD

    shapes = weight_shapes(f.config)
    for prefix, fid in f.formats.items():
        if fid == wf.PLAIN:
            continue
        fmt = wf.FORMATS.get(fid)
        n, k = shapes[prefix]
        if fmt is None or fid not in GPU_FORMAT_IDS:
            name = fmt.name if fmt is not None else f"id {fid}"
            return f"{f.path}: {prefix} is stored in weight format {name}, which the GPU kernels do not run"
        if k % QUAD:
            return f"{f.path}: {prefix} [{n}, {k}]: the GPU kernels need K a multiple of {QUAD}"
    for name in tile_major_planes(f):   # whole 16-row tiles (format/int4_tiles.py)
        rows = f.tensors[name].shape[0]
        if rows % TILE_ROWS:
            return (f"{f.path}: {name} has {rows} rows; the GPU holds it tile-major and needs a multiple of "
                    f"{TILE_ROWS}")
    for layer in range(f.config.num_layers):   # the fused gate/up GEMV and GEMM read both in one format
        gate, up = (f.formats[proj_prefix(layer, p)] for p in ("gate_proj", "up_proj"))
        if gate != up:
            names = [wf.FORMATS[i].name if i in wf.FORMATS else "dense_fp16" for i in (gate, up)]
            return (f"{f.path}: layer {layer} stores gate_proj in {names[0]} and up_proj in {names[1]}; the GPU's "
                    f"fused gate/up kernels read both in one format")
    return None


class GPUWeights:
    """All tensors of a `.nanoqwen` file in one device pool.

    Attributes:
        config: the model's QwenConfig.
        pool: the weight pool (closed by `close()`).
        arrays: tensor name → DeviceArray (dtype and shape as in the file, but a q4_k/q5_k weight's
            `.scales`: its lane-word plane uint32 [N, K/256, 4], and no `.superscales`; gpu_tensors).
        nbytes: bytes of weight data on the device.
        upload_via: how the bytes went, "registered" (DMA from the file's mapping) or "staging".
    """

    def __init__(self, f: NanoqwenFile, progress: Callable[[int, int], None] | None = None,
                 num_layers: int | None = None, staging: Mapping[str, int] | None = None):
        """Upload `f` (optionally only its first `num_layers` layers, for tests).

        progress(bytes_done, bytes_total) is called after each tensor.
        The bytes go by DMA straight from the file's mapping, registered read-only for the
        upload (cuda.host_dma.RegisteredUploader), or through pinned staging buffers
        (StagingUploader) where the driver cannot register it, DRVQWEN_STARTUP_UPLOAD=staging
        asks for that, or `staging` sets StagingUploader's chunk_bytes / copy_threads /
        piece_bytes in place of its defaults (tools/bench_upload.py times them against each
        other); `upload_via` says which ("registered" or "staging").
        Dense FP32 tensors (a GGUF's norms and biases) are uploaded as FP16, the dtype every
        kernel reads them in (Qwen2.5's are BF16 values, which FP16 holds exactly in their range).

        Raises DeviceMemoryError (a DrvqwenError) before anything is copied if the weights do
        not fit in free device memory, FormatError naming the first weight whose format the
        GPU kernels do not run (`check_gpu_formats`), and DrvqwenError for a bad
        DRVQWEN_STARTUP_UPLOAD, or DRVQWEN_STARTUP_GATHERED_UPLOAD where staging reads it
        (startup.switch; the pool is freed again).
        """
        unsupported = check_gpu_formats(f)
        if unsupported:
            raise FormatError(unsupported)
        self.config: QwenConfig = f.config if num_layers is None else f.config.with_layers(num_layers)
        keep = [i for i in f if not i.name.startswith("model.layers.")
                or int(i.name.split(".")[2]) < self.config.num_layers]
        self.pool = Pool(weight_pool_bytes(keep), name="weights")
        self.arrays: dict[str, DeviceArray] = {}
        self.nbytes = 0
        total = sum(_device_nbytes(i) for i in keep)
        kept = {i.name for i in keep}
        lane_prefixes = [p for p in lane_word_weights(f) if f"{p}.scales" in kept]
        # A q4_k/q5_k weight's scales (12 bytes a super-block) and superscales (4) go to the two
        # ends of its lane-word plane, which _lane_words then writes (the file's planes by name).
        lane_parts = {f"{p}.{part}": p for p in lane_prefixes for part in ("scales", "superscales")}
        file_planes: dict[str, DeviceArray] = {}
        try:
            with self._uploader(f, staging) as up:
                for info in keep:
                    host = np.asarray(f.tensor(info.name))
                    if info.dtype == wf.F32:
                        host = host.astype(np.float16)
                    if info.name in lane_parts:
                        arr = self._file_plane(f, lane_parts[info.name], info, file_planes)
                    else:
                        arr = self.pool.alloc(info.name, info.shape, host.dtype)
                        self.arrays[info.name] = arr
                    up.upload(arr, host)
                    self.nbytes += host.nbytes
                    if progress:
                        progress(self.nbytes, total)
                up.finish()
            planes = tile_major_planes(f, self.config)
            self._device_layout({n: planes[n] for n in planes if n in self.arrays})   # not past num_layers
            self._lane_words(lane_prefixes, file_planes)
        except BaseException:
            self.close()
            raise

    def _device_layout(self, planes: Mapping[str, tuple[int, int]]) -> None:
        """Rearrange each plane uint32 [N, K/128 · W] named in `planes` (name → (pair_dim, W)) in
        place into the tile-major device layout (format/int4_tiles.py): each is copied into one
        scratch buffer (the largest one's size) and kernels/weight_layout.cu writes it back
        tile-major: those bytes are read and written twice (the copy, the kernel), once per load.

        Raises:
            FormatError: a plane of N not a multiple of 16 (no Qwen2 shape has one).
        """
        from .cuda import DeviceBuffer, Stream
        from .launchers.weight_layout import Int4TileMajor

        names = list(planes)
        if not names:
            return
        for n in names:
            if self.arrays[n].shape[0] % TILE_ROWS:
                raise FormatError(f"{n}: {self.arrays[n].shape[0]} rows, the GPU's tile-major planes need a "
                                  f"multiple of {TILE_ROWS}")
        stream = Stream()
        try:
            scratch = DeviceBuffer(max(self.arrays[n].nbytes for n in names), "tile-major layout scratch")
        except BaseException:
            stream.close()
            raise
        try:
            for n in names:
                arr = self.arrays[n]
                pair_dim, words = planes[n]
                rows, k = arr.shape[0], arr.shape[1] * 128 // words
                src = DeviceArray(f"{n} (file layout)", scratch.ptr, arr.shape, arr.dtype)
                src.copy_from(arr, stream)
                Int4TileMajor(arr, src, n=rows, k=k, pair_dim=pair_dim, group_words=words, stream=stream).launch()
            stream.synchronize()
        finally:
            try:
                scratch.free()
            finally:
                stream.close()

    def _file_plane(self, f: NanoqwenFile, prefix: str, info: TensorInfo,
                    file_planes: dict[str, DeviceArray]) -> DeviceArray:
        """Where the upload puts tensor `info`, the scales or superscales of q4_k/q5_k weight
        `prefix`: a view of the weight's lane-word plane `<prefix>.scales` (uint32 [N, K/256, 4],
        allocated with the first of the two), the scales (12 bytes a super-block) at its start and
        the superscales (4) after them. Recorded in file_planes under the tensor's name.

        Raises:
            FormatError: the superscales before the scales in the file. The staging upload
                batches small arrays into one DMA that covers the gaps between them, which is
                safe only where each array lies after the one uploaded before it; every writer
                puts a weight's scales right before its superscales."""
        lanes_name = f"{prefix}.scales"
        if lanes_name not in self.arrays and info.name != lanes_name:
            raise FormatError(f"{info.name}: stored before {lanes_name}; the GPU upload needs a q4_k/q5_k weight's "
                              f"scales first")
        if lanes_name not in self.arrays:
            sc = f.tensors[lanes_name]
            n, supers = sc.shape[0], sc.shape[1]
            self.arrays[lanes_name] = self.pool.alloc(lanes_name, (n, supers, 4), np.uint32)
        lanes = self.arrays[lanes_name]
        offset = 0 if info.name == lanes_name else f.tensors[lanes_name].nbytes
        view = DeviceArray(f"{info.name} (file layout)", lanes.ptr + offset, info.shape, info.dtype)
        file_planes[info.name] = view
        return view

    def _lane_words(self, prefixes: list[str], file_planes: Mapping[str, DeviceArray]) -> None:
        """Write the lane-word plane of each q4_k/q5_k weight in `prefixes` from the file's scales
        and superscales uploaded into it (_file_plane): the plane is copied into one scratch
        buffer (the largest plane's size) and kernels/weight_layout.cu writes the lane words back
        from the copy (format/kquant_lanes.py; 16 bytes a super-block read and written once)."""
        from .cuda import DeviceBuffer, Stream
        from .launchers.weight_layout import KQuantLaneWords

        if not prefixes:
            return
        stream = Stream()
        try:
            scratch = DeviceBuffer(max(self.arrays[f"{p}.scales"].nbytes for p in prefixes), "lane-word scratch")
        except BaseException:
            stream.close()
            raise
        try:
            for p in prefixes:
                lanes = self.arrays[f"{p}.scales"]
                sc, ss = file_planes[f"{p}.scales"], file_planes[f"{p}.superscales"]
                copy = DeviceArray(f"{p}.scales (lane-word scratch)", scratch.ptr, lanes.shape, lanes.dtype)
                copy.copy_from(lanes, stream)
                KQuantLaneWords(lanes, DeviceArray(sc.name, scratch.ptr, sc.shape, sc.dtype),
                                DeviceArray(ss.name, scratch.ptr + sc.nbytes, ss.shape, ss.dtype),
                                supers=sc.nbytes // 12, stream=stream).launch()
            stream.synchronize()
        finally:
            try:
                scratch.free()
            finally:
                stream.close()

    def _uploader(self, f: NanoqwenFile, staging: Mapping[str, int] | None):
        """The uploader for this load, and `upload_via` set to its name: DMA from the file's
        registered mapping (the default: no staging buffer to allocate, no CPU copy), unless
        `staging` settings or DRVQWEN_STARTUP_UPLOAD=staging ask for the staging uploader, or
        the driver cannot register the mapping read-only (then staging, without a word: both
        give the same bytes)."""
        if staging is None and startup.switch(startup.UPLOAD) == "registered" and read_only_register_supported():
            try:
                up = RegisteredUploader(f.data_region())
                self.upload_via = "registered"
                return up
            except CudaError:
                pass
        # The small tensors gathered into large copies through the pool's region, unless the
        # measurement switch turns that off (startup.py).
        gathered = startup.switch(startup.GATHERED_UPLOAD) == "on"
        region = (self.pool.base, self.pool.capacity_bytes) if gathered else None
        self.upload_via = "staging"
        return StagingUploader(region=region, **dict(staging or {}))

    def __getitem__(self, name: str) -> DeviceArray:
        return self.arrays[name]

    def proj(self, layer: int, proj: str) -> tuple[DeviceArray, DeviceArray]:
        """(qweight, scales) of one INT4 projection, e.g. proj(3, "down_proj")."""
        p = proj_prefix(layer, proj)
        return self.arrays[f"{p}.qweight"], self.arrays[f"{p}.scales"]

    def close(self) -> None:
        self.pool.close()
        self.arrays.clear()
