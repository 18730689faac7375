"""kernels/attention_decode_cluster.cu (the splits merged in a thread block cluster, one launch)
against reference.attention_decode in float64 on the kernel's exact FP16 q, K and V.

KV lengths from 1 to 8192 for both head dims (7B: Hq 28, Hkv 4, Dh 128; 0.5B: Hq 14, Hkv 2,
Dh 64): one page (one split, one block active), a partial last page, exactly one page per split
of the 64 (1024), several pages per split. The cache is test_kernel_attention_decode's: pages
from a shuffled free list, every unwritten slot, page tail and spare page NaN, block-table
entries past the sequence pointing at an all-NaN page — a read past seq_len shows as NaN. The
output is poisoned before each launch; every case runs twice and must give the same bits.
Also: the build that fills its merge buffers with NaN first (ACL_POISON_SMEM: a read of shared
memory nothing wrote would show as NaN), and other GQA groups (Hq / Hkv = 5, 8, 6, 1) at a few
lengths.

test_attention_cluster_small is the case compute-sanitizer runs (tools/sanitize_nodes.txt): both builds
the decode step runs, clusters of 8 and of 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from drvqwen import reference as ref
from kernel_testing import TOL_ATTENTION, assert_same_bits, dev, graph_time_us, report  # noqa: F401
from test_kernel_attention_decode import _case  # the poisoned paged cache of the split-KV kernel's test

pytestmark = pytest.mark.gpu

MODELS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
LENGTHS = [1, 2, 15, 16, 17, 255, 256, 257, 513, 1024, 1025, 2048, 3000, 8192]
SMALL_LENGTHS = [1, 17, 513]
GROUPS = {"40q8kv": (40, 8, 128), "16q2kv": (16, 2, 128), "12q2kv": (12, 2, 128), "16q2kv-hd64": (16, 2, 64),
          "4q4kv": (4, 4, 128)}
POISONED = (("ACL_POISON_SMEM", 1),)  # NaN in the merge buffers first: reads of unwritten shared memory show


def check_cluster(dev, rng, label, hq, hkv, dh, lengths, timed=(), defines=()):
    from drvqwen.launchers import AttentionDecodeCluster

    for seq_len in lengths:
        q, k_cache, v_cache, bt = _case(rng, hq, hkv, dh, seq_len)
        out = dev.poisoned(f"out{seq_len}", (hq, dh), np.float16)
        state = dev.upload(f"state{seq_len}", np.array([seq_len - 1, 0, seq_len], dtype=np.int32))
        ln = AttentionDecodeCluster(out, dev.upload(f"q{seq_len}", q), dev.upload(f"k{seq_len}", k_cache),
                                    dev.upload(f"v{seq_len}", v_cache), dev.upload(f"bt{seq_len}", bt), state,
                                    n_heads=hq, n_kv_heads=hkv, head_dim=dh, defines=defines)
        ln.launch()
        got = out.download()
        want = ref.attention_decode(q.astype(np.float64), k_cache.astype(np.float64),
                                    v_cache.astype(np.float64), bt, seq_len)
        report(f"{label}.len{seq_len}", got, want, TOL_ATTENTION)
        out.fill_bytes(0xFF)
        ln.launch()
        assert_same_bits(f"{label}.len{seq_len}", got, out.download())
        if seq_len in timed:
            us = graph_time_us(ln)
            print(f"  {label} len {seq_len}: {us:.2f} µs/call (one launch), KV {ln.bytes_for(seq_len) / 1e6:.2f} MB")


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_cluster(dev, rng, model):
    check_cluster(dev, rng, model, *MODELS[model], LENGTHS, timed=(512 + 1, 2048))


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_cluster_poisoned_shared_memory(dev, rng, model):
    check_cluster(dev, rng, f"{model}.poisoned", *MODELS[model], LENGTHS, defines=POISONED)


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_cluster_of_16_blocks(dev, rng, model):
    """The non-portable cluster size (ACL_CLUSTER=16: 128 splits a KV head), which the module
    loader opts in to; poisoned merge buffers."""
    check_cluster(dev, rng, f"{model}.c16", *MODELS[model], [1, 17, 513, 2048, 2049, 8192], timed=(2048,),
                  defines=POISONED + (("ACL_CLUSTER", 16),))


@pytest.mark.parametrize("group", list(GROUPS))
def test_attention_cluster_groups(dev, rng, group):
    check_cluster(dev, rng, group, *GROUPS[group], [1, 257, 2048], defines=POISONED)


@pytest.mark.parametrize("model", list(MODELS))
def test_attention_cluster_small(dev, rng, model):
    check_cluster(dev, rng, model, *MODELS[model], SMALL_LENGTHS)
    check_cluster(dev, rng, f"{model}.c16", *MODELS[model], SMALL_LENGTHS, defines=(("ACL_CLUSTER", 16),))
