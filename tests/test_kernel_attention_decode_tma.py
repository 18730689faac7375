"""kernels/attention_decode_tma.cu (warp-specialised TMA split-KV decode attention + the plain
kernel's combine) against reference.attention_decode in float64 on the kernel's exact FP16
q, K and V.

KV lengths 1, 2, 15, 16, 17, 127, 128, 129, 511, 512, 513, 4095, 4096, 4097 and 32768 for both
head dims (7B: Hq 28, Hkv 4, Dh 128; 0.5B: Hq 14, Hkv 2, Dh 64). The cache is a 3-layer pool
[3, P, Hkv, 16, Dh] read through one tensor map per pool (as DecodeStep builds them) with the
data in layer 1 (layer_page0 = P): layers 0 and 2, every unwritten page tail (TMA copies the whole
16-row box, so the kernel must mask those slots by select), the spare pages and the block-table
entries past the sequence are NaN / point at an all-NaN page, and pages come from a shuffled
free list. Two grids: the DecodeStep grid for a 32k context (every resident block slot; most
splits idle at short lengths) and one block per KV head (hundreds of pages per consumer warp:
many laps of every ring stage, many 32-entry block-table batches). Every case runs twice and must
give the same bits.

test_attention_tma_small (KV ≤ 2048) is the case compute-sanitizer runs (tools/gpu_check.sh).
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import TOL_ATTENTION, assert_same_bits, dev, report  # noqa: F401

pytestmark = pytest.mark.gpu

MODELS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
LENGTHS = [1, 2, 15, 16, 17, 127, 128, 129, 511, 512, 513, 4095, 4096, 4097, 32768]
SMALL_LENGTHS = [1, 2, 17, 129, 513, 2048]
GRIDS = ["ctx32k", "one_block"]
MAX_CONTEXT = 32768
POOL_LAYERS, LAYER = 3, 1  # the data sits in the middle layer of the pool


def _blocks(grid: str, hkv: int, dh: int) -> int:
    from drvqwen.launchers.attention_decode_tma import blocks_per_kv_head

    return blocks_per_kv_head(hkv, MAX_CONTEXT, dh) if grid == "ctx32k" else 1


def _case(rng, hq, hkv, dh, seq_len):
    """q fp16 [Hq, Dh]; pools fp16 [3, P, Hkv, 16, Dh] (NaN outside the sequence); block table
    int32 [MAX_CONTEXT / 16], entries past the sequence → an all-NaN page."""
    n_pages = -(-seq_len // 16)
    n_phys = n_pages + 3
    free = rng.permutation(n_phys)                              # shuffled free list
    bt = np.full(MAX_CONTEXT // 16, free[n_pages], dtype=np.int32)
    bt[:n_pages] = free[:n_pages]
    k_pool = np.full((POOL_LAYERS, n_phys, hkv, 16, dh), np.nan, dtype=np.float16)
    v_pool = np.full_like(k_pool, np.nan)
    k = rng.standard_normal((seq_len, hkv, dh)).astype(np.float16)
    v = rng.standard_normal((seq_len, hkv, dh)).astype(np.float16)
    ref.write_pages(k_pool[LAYER], bt, np.arange(seq_len), k)
    ref.write_pages(v_pool[LAYER], bt, np.arange(seq_len), v)
    q = (2 * rng.standard_normal((hq, dh))).astype(np.float16)  # sharper than N(0,1) softmax
    return q, k_pool, v_pool, bt


def _check_lengths(dev, rng, model: str, lengths: list[int]) -> None:
    from drvqwen.kv_cache import tensor_map
    from drvqwen.launchers import AttentionDecodeTma
    from drvqwen.launchers.attention_decode import partial_shapes
    from drvqwen.launchers.attention_decode_tma import CONSUMERS

    hq, hkv, dh = MODELS[model]
    grids = {grid: _blocks(grid, hkv, dh) for grid in GRIDS}
    print(f"\n  {model}: blocks per KV head {grids} ({', '.join(f'{g} {b * 4} splits' for g, b in grids.items())})")
    for seq_len in lengths:
        q, k_pool, v_pool, bt = _case(rng, hq, hkv, dh, seq_len)
        want = ref.attention_decode(q.astype(np.float64), k_pool[LAYER].astype(np.float64),
                                    v_pool[LAYER].astype(np.float64), bt, seq_len)
        k_dev, v_dev = dev.upload(f"k{seq_len}", k_pool), dev.upload(f"v{seq_len}", v_pool)
        k_map, v_map = tensor_map(k_dev), tensor_map(v_dev)  # once per pool
        bufs = dict(q=dev.upload(f"q{seq_len}", q), bt=dev.upload(f"bt{seq_len}", bt),
                    state=dev.upload(f"state{seq_len}", np.array([seq_len - 1, 0, seq_len], np.int32)))
        for grid, blocks in grids.items():
            out = dev.poisoned(f"out{seq_len}{grid}", (hq, dh), np.float16)
            parts = {n: dev.poisoned(f"{n}{seq_len}{grid}", sh, np.float32)
                     for n, sh in partial_shapes(hq, dh, blocks, CONSUMERS).items()}
            ln = AttentionDecodeTma(out, bufs["q"], k_map, v_map, bufs["bt"], bufs["state"],
                                    tuple(parts.values()), n_heads=hq,
                                    n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=blocks,
                                    layer_page0=LAYER * k_pool.shape[1])
            ln.launch()
            got = out.download()
            report(f"{model}.{grid}.len{seq_len}", got, want, TOL_ATTENTION)
            out.fill_bytes(0xFF)
            ln.launch()
            assert_same_bits(f"{model}.{grid}.len{seq_len}", got, out.download())


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_tma(dev, rng, model):
    _check_lengths(dev, rng, model, LENGTHS)


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_tma_small(dev, rng, model):
    """KV ≤ 2048: the compute-sanitizer case (memcheck, racecheck, synccheck)."""
    _check_lengths(dev, rng, model, SMALL_LENGTHS)


def test_attention_tma_launcher_checks_maps(dev):
    """A map whose box is not one page of one head is refused before any launch."""
    from drvqwen.cuda import encode_tiled_2d
    from drvqwen.launchers import AttentionDecodeTma, LaunchError

    hq, hkv, dh = MODELS["0.5b"]
    pool = dev.array("pool", (1, 4, hkv, 16, dh), np.float16)
    wrong = encode_tiled_2d(pool.ptr, np.float16, (4 * hkv * 16, dh), (8, dh))
    with pytest.raises(LaunchError, match="box"):
        AttentionDecodeTma(pool, pool, wrong, wrong, pool, pool, (pool, pool, pool), n_heads=hq,
                           n_kv_heads=hkv, head_dim=dh, blocks_per_kv_head=1)
