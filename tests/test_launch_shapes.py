"""Launch-shape rules of the decode attention launchers, as plain Python (no GPU)."""

from drvqwen import kernels as K


def test_split_grid_fills_the_gpu_but_not_past_the_pages():
    # 7B on an H200: 2 resident blocks per SM × 132 SMs over 4 KV heads → 66 blocks per head.
    assert K.attention_blocks_per_kv_head(4, 32768, 132) == 66
    # A short context caps the grid: 64 tokens = 4 pages = one block of 4 split warps.
    assert K.attention_blocks_per_kv_head(4, 64, 132) == 1
    assert K.attention_blocks_per_kv_head(2, 16 * 4 * 10, 132) == 10
    # Occupancy from registers: 64 registers × 128 threads fits more blocks per SM.
    assert K.attention_blocks_per_kv_head(4, 32768, 132, registers=64) > 66


def test_partial_shapes_follow_the_splits_per_block():
    plain = K.attention_partial_shapes(28, 128, 66)
    tma = K.attention_partial_shapes(28, 128, 66, K.ATMA_CONSUMERS)
    assert plain["o_part"] == (66 * K.ATTN_WARPS, 28, 128) and plain["m_part"] == (66 * K.ATTN_WARPS, 28)
    assert tma["l_part"] == (66 * K.ATMA_CONSUMERS, 28)
