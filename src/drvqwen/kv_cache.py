"""The paged KV cache: page size, the pool, per-layer views, TMA tensor maps, the page allocator.

Layout (fp16, one pool for K and one for V):

    k_cache, v_cache   [L, P, Hkv, PAGE_TOKENS, Dh]   layer, physical page, KV head, slot, dim
    block_table        int32 [P]                      logical page (pos // PAGE_TOKENS) → physical page

A page holds PAGE_TOKENS = 16 consecutive positions of one layer's K (or V) for every KV
head: 16 × 4 × 128 × 2 B = 16 KiB at the 7B shape, so pages start on 16 KiB boundaries
(KV_PAGE_ALIGN_BYTES) and one KV head of one page — the [16, Dh] box a TMA copy moves — is
4 KiB of contiguous memory. Pages are handed out by the host (`PageAllocator`, a free list);
kernels only ever see the block table, so nothing on the GPU assumes that logical page i is
physical page i (tests shuffle the free list to make sure).

This module owns every fact about that layout: the reference (reference.py), the launchers
and the kernels (kernels/kv_cache.cuh, `PAGE_TOKENS`) all take the page size from here. Its GPU
part (`KVCache`) imports the cuda layer only when used, so the numpy reference can depend on
this module without depending on the GPU layer.
"""

from __future__ import annotations

import math

import numpy as np

from .config import QwenConfig
from .errors import DrvqwenError

PAGE_TOKENS = 16  # positions per KV page (kernels/kv_cache.cuh PAGE_TOKENS; checked by tests/test_kernel_constants.py)


def n_pages_for(tokens: int) -> int:
    """Pages needed to hold `tokens` positions."""
    return -(-int(tokens) // PAGE_TOKENS)


def cache_shape(cfg: QwenConfig, n_pages: int) -> tuple[int, int, int, int, int]:
    """[L, P, Hkv, PAGE_TOKENS, Dh]: the shape of the K (and of the V) pool."""
    return (cfg.num_layers, n_pages, cfg.num_kv_heads, PAGE_TOKENS, cfg.head_dim)


def cache_bytes(cfg: QwenConfig, n_pages: int) -> int:
    """Bytes of the K and V pools together (fp16)."""
    return 2 * math.prod(cache_shape(cfg, n_pages)) * 2


def layer_view_name(pool: str, layer: int) -> str:
    """The name of one layer's view of a pool, e.g. "k_cache[3]" (buffers are found by name)."""
    return f"{pool}[{layer}]"


class PageAllocator:
    """The host-owned free list of physical KV pages and one sequence's block table.

    Args:
        n_pages: physical pages in the pool.
        rng: shuffles the free list (tests do, so no kernel can get away with assuming that
            logical page i is physical page i).
    """

    def __init__(self, n_pages: int, rng: np.random.Generator | None = None):
        self.n_pages = n_pages
        self.free = list(range(n_pages))
        if rng is not None:
            rng.shuffle(self.free)
        self.block_table: list[int] = []

    def page_for(self, pos: int) -> tuple[int, bool]:
        """(physical page holding position pos, whether it was newly allocated).

        Raises:
            ValueError: pos skips a page (pages are taken in order).
            DrvqwenError: the pool has no free page left.
        """
        logical = pos // PAGE_TOKENS
        if logical < len(self.block_table):
            return self.block_table[logical], False
        if logical != len(self.block_table):
            raise ValueError(f"position {pos} skips pages (block table has {len(self.block_table)})")
        if not self.free:
            raise DrvqwenError(f"KV cache full: no page left for position {pos}")
        p = self.free.pop(0)
        self.block_table.append(p)
        return p, True

    def opens_page(self, pos: int) -> bool:
        """Whether a step at `pos` needs a page the block table does not hold yet."""
        return pos // PAGE_TOKENS >= len(self.block_table)

    def release_from(self, logical: int) -> list[int]:
        """The pages of logical pages `logical`, `logical` + 1, … back to the free list, in
        front and in order (they are reused first: a sequence that grows again takes the same
        pages in the same order); returns them.

        Raises:
            ValueError: logical < 0.
        """
        if logical < 0:
            raise ValueError(f"logical page {logical} < 0")
        released = self.block_table[logical:]
        self.free = released + self.free
        self.block_table = self.block_table[:logical]
        return released

    def release_all(self) -> None:
        """Every page of the sequence back to the free list (they are reused first)."""
        self.release_from(0)


class KVCache:
    """The K and V pools of one model on the GPU, with their per-layer views and tensor maps.

    Args:
        cfg: the model (layers, KV heads, head_dim).
        n_pages: physical pages per layer (max_context / PAGE_TOKENS, rounded up).
    Attributes:
        k, v: DeviceArray fp16 [L, P, Hkv, PAGE_TOKENS, Dh], each 16 KiB-aligned.
        n_pages: P.
    Raises:
        DeviceMemoryError: the pools do not fit in free device memory.
    """

    def __init__(self, cfg: QwenConfig, n_pages: int):
        from .cuda import KV_PAGE_ALIGN_BYTES, Pool

        self.config, self.n_pages = cfg, n_pages
        shape = cache_shape(cfg, n_pages)
        self.pool = Pool(cache_bytes(cfg, n_pages) + 2 * KV_PAGE_ALIGN_BYTES, name="kv")
        self.k = self.pool.alloc("k_cache", shape, np.float16, align=KV_PAGE_ALIGN_BYTES)
        self.v = self.pool.alloc("v_cache", shape, np.float16, align=KV_PAGE_ALIGN_BYTES)
        self._maps: dict[str, object] = {}

    def layer_view(self, pool: str, layer: int):
        """One layer of the "k_cache" or "v_cache" pool (`layer_view`).

        Raises:
            ValueError: unknown pool or layer out of range.
        """
        if pool not in ("k_cache", "v_cache"):
            raise ValueError(f"no KV pool {pool!r} (k_cache, v_cache)")
        return layer_view(self.k if pool == "k_cache" else self.v, layer)

    def tensor_map(self, pool: str):
        """The TMA descriptor of the "k_cache" or "v_cache" pool (`tensor_map`), encoded on first
        use and kept for the pool's life."""
        if pool not in self._maps:
            self._maps[pool] = tensor_map(self.k if pool == "k_cache" else self.v)
        return self._maps[pool]

    def close(self) -> None:
        """Free both pools."""
        self._maps.clear()
        self.pool.close()


def tensor_map_shape(pool_shape) -> tuple[int, int]:
    """[rows, Dh] of the 2-D view a pool's tensor map gives (rows = every page of every head).

    Raises:
        ValueError: the pool is not [..., PAGE_TOKENS, Dh], or has 2^31 rows or more (TMA
            coordinates are int32).
    """
    *outer, page_tokens, head_dim = pool_shape
    if page_tokens != PAGE_TOKENS:
        raise ValueError(f"KV pool {list(pool_shape)}: pages of {page_tokens} tokens, want {PAGE_TOKENS}")
    rows = math.prod(outer) * PAGE_TOKENS
    if rows >= 2**31:
        raise ValueError(f"KV pool {list(pool_shape)}: {rows} rows, TMA coordinates are int32")
    return rows, head_dim


def layer_view(cache, layer: int):
    """One layer of a pool DeviceArray [L, P, Hkv, 16, Dh] as a DeviceArray [P, Hkv, 16, Dh]
    named layer_view_name(pool, layer) (no copy: the layer's base address).

    Raises:
        ValueError: layer out of range.
    """
    from .cuda import DeviceArray

    n_layers, *rest = cache.shape
    if not 0 <= layer < n_layers:
        raise ValueError(f"{cache.name}: no layer {layer} ({n_layers} layers)")
    layer_bytes = math.prod(rest) * cache.dtype.itemsize
    return DeviceArray(layer_view_name(cache.name, layer), cache.ptr + layer * layer_bytes, rest, cache.dtype)


def tensor_map(cache):
    """The TMA descriptor of a whole pool DeviceArray [..., 16, Dh] fp16, seen as a [rows, Dh]
    matrix with a [16, Dh] box: one page of one KV head, row ((layer·P + page)·Hkv + head)·16.
    cuTensorMapEncodeTiled costs ~60 µs from Python: build it once per pool, never per step.

    Raises:
        ValueError: not fp16, not [..., PAGE_TOKENS, Dh], or 2^31 rows or more.
    """
    from .cuda import encode_tiled_2d

    if np.dtype(cache.dtype) != np.float16:
        raise ValueError(f"{cache.name}: KV pool of {np.dtype(cache.dtype)}, want float16")
    rows, head_dim = tensor_map_shape(cache.shape)
    return encode_tiled_2d(cache.ptr, np.float16, (rows, head_dim), (PAGE_TOKENS, head_dim))
