"""The model's weights on the GPU: one pool, one named buffer per `.nanoqwen` tensor.

The file is mmapped and validated first (format/nanoqwen.py); only then is the weight pool
allocated — sized exactly from the tensor table — and each tensor copied through the pinned
double-buffered staging uploader. A tensor is read from the mapping chunk by chunk, so the
host never holds the model twice (the page cache holds what the kernel maps, and no more).

Buffer names are the file's tensor names (HF names: `model.layers.3.mlp.down_proj.qweight`),
so the tests and tools can find any weight by the name HF users know.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .config import QwenConfig
from .cuda import DEFAULT_ALIGN_BYTES, DeviceArray, Pool, StagingUploader
from .errors import FormatError
from .format import weight_formats as wf
from .format.nanoqwen import NanoqwenFile
from .format.tensor_set import proj_prefix


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


class GPUWeights:
    """All tensors of a `.nanoqwen` file in one device pool.

    Attributes:
        config: the model's QwenConfig.
        pool: the weight pool (closed by `close()`).
        arrays: tensor name → DeviceArray (dtype and shape as in the file).
        nbytes: bytes of weight data on the device.
    """

    def __init__(self, f: NanoqwenFile, progress: Callable[[int, int], None] | None = None,
                 num_layers: int | None = None):
        """Upload `f` (optionally only its first `num_layers` layers, for tests).

        progress(bytes_done, bytes_total) is called after each tensor.
        Raises DeviceMemoryError (a DrvqwenError) before anything is copied if the weights do
        not fit in free device memory, and FormatError if the file holds weight formats the
        GPU kernels do not run (anything but INT4 g128 projections and FP16 dense tensors).
        """
        if not f.has_default_formats:
            names = sorted({wf.FORMATS[i].name for i in f.formats.values() if i in wf.FORMATS} - {wf.INT4_G128.name})
            raise FormatError(f"{f.path}: weight formats {', '.join(names) or 'fp32 dense'} run on the CPU "
                              f"reference only (--device cpu); for the GPU convert with --weights int4")
        self.config: QwenConfig = f.config if num_layers is None else f.config.with_layers(num_layers)
        keep = [i for i in f if not i.name.startswith("model.layers.")
                or int(i.name.split(".")[2]) < self.config.num_layers]
        total = sum(_aligned(i.nbytes, DEFAULT_ALIGN_BYTES) for i in keep) + DEFAULT_ALIGN_BYTES
        self.pool = Pool(total, name="weights")
        self.arrays: dict[str, DeviceArray] = {}
        self.nbytes = 0
        done = 0
        with StagingUploader() as up:
            for info in keep:
                arr = self.pool.alloc(info.name, info.shape, info.dtype)
                up.upload(arr, np.asarray(f.tensor(info.name)))
                self.arrays[info.name] = arr
                self.nbytes += info.nbytes
                done += info.nbytes
                if progress:
                    progress(done, self.nbytes)
            up.finish()

    def __getitem__(self, name: str) -> DeviceArray:
        return self.arrays[name]

    def proj(self, layer: int, proj: str) -> tuple[DeviceArray, DeviceArray]:
        """(qweight, scales) of one INT4 projection, e.g. proj(3, "down_proj")."""
        p = proj_prefix(layer, proj)
        return self.arrays[f"{p}.qweight"], self.arrays[f"{p}.scales"]

    def close(self) -> None:
        self.pool.close()
        self.arrays.clear()
