"""The split-KV decode attention's split rule on the CPU (launchers/attention_decode.py
pages_per_split, the mirror of attention_decode.cuh's attn_pages_per_split): which splits hold
pages, at the lengths it was measured at and over every length up to 64K tokens."""

from __future__ import annotations

import pytest

from drvqwen.launchers.attention_decode import SHORT_MAX_PAGES, SHORT_SPLITS, pages_per_split

NS_7B = 264  # splits per KV head of the 7B on an H200: 66 blocks of 4 warps


@pytest.mark.parametrize("tokens, want", [(512, 1), (4096, 2), (8192, 4), (32000, 8), (16, 1), (2048, 1)])
def test_pages_per_split_at_the_measured_lengths(tokens, want):
    assert pages_per_split(-(-tokens // 16), NS_7B) == want


@pytest.mark.parametrize("n_splits", [1, 8, 66, NS_7B, 1056])
def test_every_page_in_exactly_one_active_split(n_splits):
    for n_pages in range(1, 4097):
        pps = pages_per_split(n_pages, n_splits)
        active = -(-n_pages // pps)
        assert pps >= 1 and active <= n_splits, (n_pages, n_splits, pps)
        assert (active - 1) * pps < n_pages <= active * pps  # the last active split holds a page
        # Never more pages a split than spreading over all splits or the short-context cap asks.
        assert pps == max(1, -(-n_pages // n_splits), min(SHORT_MAX_PAGES, -(-n_pages // SHORT_SPLITS)))
