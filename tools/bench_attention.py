"""Decode attention timing: the TMA kernel next to the plain one and the one-launch cluster kernel (7B shape by default).

    PYTHONPATH=src python tools/bench_attention.py [--lengths 512 8192 32768] [--json out.json]

For each KV length: both split-KV launchers (decode + combine; also the split kernel alone, and the
combine alone — as the step runs it, a head's dims over COMBINE_SPLIT blocks, over 8, 16 and 32, and
as one block of 1024 threads a head, all of which must give the same bits) and the cluster kernel (one launch, its own fixed grid: attention_decode_cluster.cu,
built for short contexts: at 32768 tokens each of its warps walks 32 pages; and its build with
clusters of 16 blocks) on the same random
paged cache (shuffled pages), with the grids DecodeStep uses for a
--context-token cache, timed from a captured graph
of --reps back-to-back calls (no Python launch overhead). Reports µs per call, effective
bandwidth = K/V bytes read ÷ time, and its ratio to the device-to-device copy bandwidth measured
in the same run (cuda/bandwidth.py; read + write bytes, the docs/benchmarks.md convention). The two
outputs are compared too (relative L2), as a sanity check — the tests own correctness.

Caveat printed with the table: K/V below the 60 MB L2 stay cached across the back-to-back
replays, so short lengths measure L2, not HBM (that is also what a decode step sees for one
layer's K/V only if nothing evicted it, which the weights' 4 GB stream does).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from drvqwen.kv_cache import layer_view, tensor_map
from drvqwen.launchers import (AttentionDecode, AttentionDecodeCluster, AttentionDecodeTma, Launcher, attention_decode,
                               attention_decode_tma)
from drvqwen.launchers.attention_decode import combine_launch

def cluster16_time_us(launcher, reps: int) -> float | None:
    """graph_time_us of the 16-block cluster build, None (and why, printed) where the GPU cannot
    schedule a cluster of 16 (a non-portable size: it needs 16 free SMs of one GPC)."""
    try:
        return graph_time_us(launcher, reps)
    except CudaError as e:
        print(f"cluster of 16 not run: {e}", file=sys.stderr)
        return None


OTHER_COMBINE_SPLITS = (8, 16, 32)  # the combine's blocks a head timed beside the step's COMBINE_SPLIT
from drvqwen.cuda import DeviceArray, DeviceBuffer, get_device
from drvqwen.cuda.bandwidth import measure_copy_bandwidth
from drvqwen.cuda.errors import CudaError
from drvqwen.cuda.graph import graph_time_us
from drvqwen.provenance import source_record

SHAPES = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
L2_BYTES = 60e6  # H200 L2 (50 MiB usable per partition pair; "fits in L2" is approximate)




class Scratch:
    def __init__(self):
        self.buffers = []

    def array(self, name, shape, dtype, host=None):
        dtype = np.dtype(dtype)
        buf = DeviceBuffer(max(16, int(np.prod(shape)) * dtype.itemsize), name)
        self.buffers.append(buf)
        arr = DeviceArray(name, buf.ptr, tuple(shape), dtype)
        if host is not None:
            arr.upload(np.ascontiguousarray(host, dtype=dtype))
        return arr

    def close(self):
        for b in self.buffers:
            b.free()


def bench_length(rng, model: str, seq_len: int, context: int, reps: int) -> dict:
    hq, hkv, dh = SHAPES[model]
    n_pages = -(-seq_len // 16)
    s = Scratch()
    try:
        pool_shape = (1, n_pages, hkv, 16, dh)
        k = s.array("k", pool_shape, np.float16, rng.standard_normal(pool_shape, np.float32))
        v = s.array("v", pool_shape, np.float16, rng.standard_normal(pool_shape, np.float32))
        bt = np.zeros(-(-context // 16), np.int32)
        bt[:n_pages] = rng.permutation(n_pages)
        common = dict(q=s.array("q", (hq, dh), np.float16, 2 * rng.standard_normal((hq, dh))),
                      bt=s.array("bt", bt.shape, np.int32, bt),
                      state=s.array("state", (3,), np.int32, np.array([seq_len - 1, 0, seq_len])))
        shape = dict(n_heads=hq, n_kv_heads=hkv, head_dim=dh)

        S_plain = attention_decode.blocks_per_kv_head(hkv, context, dh)
        parts = tuple(s.array(n, sh, np.float32) for n, sh in attention_decode.partial_shapes(hq, dh, S_plain).items())
        out_plain = s.array("out_plain", (hq, dh), np.float16)
        plain = AttentionDecode(out_plain, common["q"], layer_view(k, 0), layer_view(v, 0),
                                  common["bt"], common["state"], parts, blocks_per_kv_head=S_plain, **shape)

        S_tma = attention_decode_tma.blocks_per_kv_head(hkv, context, dh)
        tparts = tuple(s.array("t" + n, sh, np.float32) for n, sh in
                       attention_decode.partial_shapes(hq, dh, S_tma, attention_decode_tma.CONSUMERS).items())
        out_tma = s.array("out_tma", (hq, dh), np.float16)
        k_map, v_map = tensor_map(k), tensor_map(v)  # once per pool
        tma = AttentionDecodeTma(out_tma, common["q"], k_map, v_map, common["bt"],
                                   common["state"], tparts, blocks_per_kv_head=S_tma, **shape)

        out_cluster = s.array("out_cluster", (hq, dh), np.float16)
        cluster = AttentionDecodeCluster(out_cluster, common["q"], layer_view(k, 0), layer_view(v, 0), common["bt"],
                                         common["state"], **shape)
        cluster16 = AttentionDecodeCluster(out_cluster, common["q"], layer_view(k, 0), layer_view(v, 0), common["bt"],
                                           common["state"], defines=(("ACL_CLUSTER", 16),), **shape)

        plain.launch()
        tma.launch()
        cluster.launch()
        a, b = out_plain.download().astype(np.float64), out_tma.download().astype(np.float64)
        c = out_cluster.download().astype(np.float64)
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
        kv = plain.bytes_for(seq_len)
        row = {"model": model, "seq_len": seq_len, "kv_bytes": kv, "rel_l2_tma_vs_plain": rel,
               "rel_l2_cluster_vs_plain": float(np.linalg.norm(a - c) / np.linalg.norm(a)),
               "cluster_us": graph_time_us(cluster, reps), "cluster16_us": cluster16_time_us(cluster16, reps),
               "plain_blocks_per_kv_head": S_plain, "tma_blocks_per_kv_head": S_tma,
               "plain_us": graph_time_us(plain, reps), "tma_us": graph_time_us(tma, reps),
               # the split kernel alone (no combine): where the time goes
               "plain_decode_us": graph_time_us(plain.launches[0], reps),
               "tma_decode_us": graph_time_us(tma.launches[0], reps),
               # and the combine alone, over the partials the TMA kernel left (its launch list's last)
               "combine_us": graph_time_us(tma.launches[-1], reps)}
        # The combine as one 1024-thread block a head (the verify pass's kernel at T = 1: the form the
        # step's combine had before its dims were split over COMBINE_SPLIT blocks), on the same
        # partials: its time, and whether it gives the same bits (it must: attention_decode.cu).
        whole = Launcher()
        out_whole = s.array("out_whole", (hq, dh), np.float16)
        combine_launch(whole, out_whole, tparts, common["state"], n_splits=tma.n_splits, n_heads=hq, head_dim=dh,
                       n_tokens=1)
        whole.launch()
        row["combine_whole_head_us"] = graph_time_us(whole, reps)
        outs = [out_tma]
        for c in OTHER_COMBINE_SPLITS:  # and over 8, 16, 32 blocks a head (1024 / C threads each): to choose C
            ln = Launcher()
            outs.append(s.array(f"out_{c}", (hq, dh), np.float16))
            combine_launch(ln, outs[-1], tparts, common["state"], n_splits=tma.n_splits, n_heads=hq, head_dim=dh,
                           dim_split=c)
            row[f"combine_split{c}_us"] = graph_time_us(ln, reps)
        whole_bits = out_whole.download().view(np.uint16)
        row["combine_bits_equal"] = all(bool(np.array_equal(whole_bits, o.download().view(np.uint16))) for o in outs)
        # Fewer, longer splits for the TMA kernel (any S is correct; the combine reads fewer partials).
        row["tma_us_by_blocks"] = {}
        for S in sorted({max(1, S_tma // 2), max(1, S_tma // 4)} - {S_tma}, reverse=True):
            sp = tuple(s.array(f"{n}{S}", sh, np.float32) for n, sh in
                       attention_decode.partial_shapes(hq, dh, S, attention_decode_tma.CONSUMERS).items())
            alt = AttentionDecodeTma(out_tma, common["q"], k_map, v_map, common["bt"], common["state"],
                                       sp, blocks_per_kv_head=S, **shape)
            row["tma_us_by_blocks"][S] = graph_time_us(alt, reps)
        for name in ("plain", "tma", "cluster"):
            row[f"{name}_gbps"] = kv / row[f"{name}_us"] / 1e3
        return row
    finally:
        get_device().synchronize()
        s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(SHAPES), default="7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 8192, 32768])
    ap.add_argument("--context", type=int, default=32768, help="max context the grids are sized for")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)

    dev = get_device()
    copy = measure_copy_bandwidth()
    print(f"{dev.info.summary()}\ncopy bandwidth (D2D, read + write): {copy.gbps:.0f} GB/s")
    rng = np.random.default_rng(a.seed)
    rows = [bench_length(rng, a.model, n, a.context, a.reps) for n in a.lengths]
    print(f"\n{a.model}, decode + combine per call, graph of {a.reps} calls, grids for a {a.context}-token cache")
    print(f"{'KV len':>7} {'K/V MB':>7} | {'plain µs':>9} {'GB/s':>6} {'/copy':>6} | "
          f"{'tma µs':>9} {'GB/s':>6} {'/copy':>6} | {'speedup':>7} {'rel L2':>8}")
    for r in rows:
        l2 = " (L2)" if r["kv_bytes"] < L2_BYTES else ""
        print(f"{r['seq_len']:>7} {r['kv_bytes'] / 1e6:>7.2f} | {r['plain_us']:>9.2f} {r['plain_gbps']:>6.0f} "
              f"{r['plain_gbps'] / copy.gbps:>6.2f} | {r['tma_us']:>9.2f} {r['tma_gbps']:>6.0f} "
              f"{r['tma_gbps'] / copy.gbps:>6.2f} | {r['plain_us'] / r['tma_us']:>6.2f}x {r['rel_l2_tma_vs_plain']:>8.1e}{l2}")
    print("decode kernel alone (no combine), µs: " + ", ".join(
        f"{r['seq_len']}: plain {r['plain_decode_us']:.2f} / tma {r['tma_decode_us']:.2f}" for r in rows))
    print("cluster kernel (one launch, no combine), µs: " + ", ".join(
        f"{r['seq_len']}: {r['cluster_us']:.2f} ({r['cluster_gbps']:.0f} GB/s, rel L2 vs plain {r['rel_l2_cluster_vs_plain']:.1e})"
        for r in rows))
    print("cluster kernel, clusters of 16 blocks (ACL_CLUSTER=16), µs: " + ", ".join(
        f"{r['seq_len']}: " + ("not run" if r['cluster16_us'] is None else f"{r['cluster16_us']:.2f}") for r in rows))
    print("combine alone (the TMA kernel's partials), µs: " + ", ".join(
        f"{r['seq_len']}: {r['combine_us']:.2f}" for r in rows))
    for c in OTHER_COMBINE_SPLITS:
        print(f"combine over {c} blocks a head, µs: " + ", ".join(f"{r['seq_len']}: {r[f'combine_split{c}_us']:.2f}"
                                                                 for r in rows))
    print("combine as one 1024-thread block a head, µs: " + ", ".join(
        f"{r['seq_len']}: {r['combine_whole_head_us']:.2f}{'' if r['combine_bits_equal'] else ' (BITS DIFFER)'}"
        for r in rows))
    print("tma (decode + combine) with fewer blocks per KV head, µs: " + "; ".join(
        f"{r['seq_len']}: " + ", ".join(f"S={S} {us:.2f}" for S, us in r["tma_us_by_blocks"].items()) for r in rows))
    print(f"blocks per KV head: plain {rows[0]['plain_blocks_per_kv_head']}, tma {rows[0]['tma_blocks_per_kv_head']}; "
          f"(L2) = K/V fit in L2 and stay there across replays")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "copy_gbps": copy.gbps, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
