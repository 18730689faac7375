"""How fast k SMs stream bytes from HBM: kernels/stream_read.cu over grids of 1 … 264 blocks.

    PYTHONPATH=src python3 tools/bench_sm_stream.py [--blocks 1 2 4 8 16 32 …]
        [--variant NAME:KIND[:DEFINE=INT,…] …] [--mib-per-block 256] [--reps 5] [--json OUT]

Each case is one launch of k blocks, block b reading its own slice of a 4 GiB buffer once (the
slices together ≥ 1 GiB past the 60 MB L2 for k ≥ 4: from HBM), slices of min(--mib-per-block,
4096 / k) MiB, timed as a graph of --reps launches (cuda/graph.py: graph_time_us) — each launch
reads the same slices, but they are far larger than L2. Reports GB/s in all and per block, next
to the device-to-device copy bandwidth of the same run (read + write counted, docs/benchmarks.md's
convention). Up to 132 blocks one block runs per SM (the block scheduler spreads them); 264 puts
two on each for `ld`, and runs `bulk` (128 KiB of ring a block: one per SM) in two waves.

Default variants: `ld` (16-byte loads, 8 a thread in flight, 256 threads), `ld16` (16 in flight),
`bulk` (1-D bulk copies into a 4 × 32 KiB ring, 128 threads) and `bulk3x64k` (a 3 × 64 KiB ring);
--variant adds builds, e.g. `ld4:ld:SR_UNROLL=4` or `bulk2x96k:bulk:SR_STAGES=2,SR_CHUNK=98304`.
What it answers: the bytes a decode-step schedule can expect from k SMs — a persistent kernel's
(132), or a layer run by one thread block cluster of 16 (kernels/attention_decode_cluster.cu's
clusters are 8 or 16 blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from drvqwen.cuda import DeviceArray, get_device
from drvqwen.cuda.bandwidth import measure_copy_bandwidth
from drvqwen.cuda.graph import graph_time_us
from drvqwen.launchers import StreamRead
from drvqwen.launchers.stream_read import CHUNK, KINDS, STAGES, threads_of
from drvqwen.provenance import source_record

BUFFER_MIB = 4096


def parse_variant(text: str) -> tuple[str, str, tuple[tuple[str, int], ...]]:
    """'NAME:KIND[:DEFINE=INT,…]' → (name, kind, defines); a bad one exits with one line."""
    parts = text.split(":")
    try:
        name, kind = parts[0], parts[1]
        defines = tuple((k, int(v)) for k, v in (d.split("=") for d in (parts[2] if len(parts) > 2 else "").split(",")
                                                 if d))
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"variant {text!r}: write NAME:KIND[:DEFINE=INT,…]") from None
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"variant {text!r}: KIND is one of {', '.join(KINDS)}")
    return name, kind, defines


def slice_bytes(blocks: int, mib_per_block: int, unit: int) -> int:
    """Each block's slice: min(mib_per_block, BUFFER_MIB / blocks) MiB, down to a multiple of `unit`."""
    want = min(mib_per_block << 20, (BUFFER_MIB << 20) // blocks)
    return max(unit, want // unit * unit)


MAX_SMEM = 227 * 1024  # shared memory a block may have on an H100/H200


def unit_of(kind: str, defines) -> int:
    """Bytes a block's slice is a multiple of: 16 (`ld`'s loads) or the bulk ring's chunk."""
    return 16 if kind == "ld" else int(dict(defines).get("SR_CHUNK", CHUNK))


def refusal(blocks: list[int], variants, reps: int, samples: int) -> str | None:
    """Why these arguments cannot run (checked before any GPU work), or None: a count below 1, a
    block count whose slices of one unit would already run past the buffer, a bulk ring past a
    block's shared memory."""
    if min(blocks) < 1 or reps < 1 or samples < 1:
        return f"--blocks {' '.join(map(str, blocks))} / --reps {reps} / --samples {samples}: need >= 1"
    for name, kind, defines in variants:
        unit = unit_of(kind, defines)
        if max(blocks) * unit > BUFFER_MIB << 20:
            return (f"--blocks {max(blocks)}: {name}'s slices of at least {unit} B each would run past the "
                    f"{BUFFER_MIB} MiB buffer (at most {(BUFFER_MIB << 20) // unit} blocks)")
        d = dict(defines)
        if kind == "bulk":
            stages = int(d.get("SR_STAGES", STAGES))
            if stages < 1 or unit < 16 or unit % 16 or stages * unit + stages * 8 > MAX_SMEM:
                return (f"variant {name}: a ring of {stages} × {unit} B; want chunks of a multiple of 16 B "
                        f"and at most {MAX_SMEM} B of shared memory")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="block counts (default: 1 2 4 8 16 32, half the SMs, the SMs, twice the SMs)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="NAME:KIND[:DEFINE=INT,…] a build timed beside the defaults (repeatable)")
    ap.add_argument("--mib-per-block", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    variants = [("ld", "ld", ()), ("ld16", "ld", (("SR_UNROLL", 16),)), ("bulk", "bulk", ()),
                ("bulk3x64k", "bulk", (("SR_STAGES", 3), ("SR_CHUNK", 65536))), *a.variant]
    why = refusal(a.blocks or [1], variants, a.reps, a.samples)
    if why is not None:
        raise SystemExit(f"bench_sm_stream.py: {why}")

    from bench_attention import Scratch  # device buffers freed together (tools/ is the script's path)

    dev = get_device()
    copy = measure_copy_bandwidth()
    print(f"{dev.info.summary()}\ncopy bandwidth (D2D, read + write): {copy.gbps:.0f} GB/s")
    sms = dev.info.sm_count
    blocks = a.blocks or [1, 2, 4, 8, 16, 32, sms // 2, sms, 2 * sms]
    s = Scratch()
    rows = []
    try:
        buf = s.array("src", (BUFFER_MIB << 20,), np.uint8)
        buf_host_fill = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        for off in range(0, BUFFER_MIB << 20, 1 << 20):  # not zeros: nothing a compressor could skip
            DeviceArray("fill", buf.ptr + off, (1 << 20,), np.uint8).upload(buf_host_fill)
        out = s.array("out", (max(blocks) * 256,), np.uint32)
        print(f"\n{'variant':>12} {'blocks':>6} {'MiB/block':>9} | {'µs':>9} {'GB/s':>7} {'/copy':>6} {'GB/s/SM':>8}")
        for name, kind, defines in variants:
            unit = unit_of(kind, defines)
            for k in blocks:
                per = slice_bytes(k, a.mib_per_block, unit)
                src = DeviceArray("src", buf.ptr, (k * per,), np.uint8)
                dst = DeviceArray("out", out.ptr, (k * threads_of(kind),), np.uint32)
                ln = StreamRead(dst, src, blocks=k, bytes_per_block=per, kind=kind, defines=defines)
                us = statistics.median(graph_time_us(ln, a.reps) for _ in range(a.samples))
                gbps = k * per / us / 1e3
                per_sm = gbps / min(k, sms)
                rows.append({"variant": name, "kind": kind, "defines": dict(defines), "blocks": k,
                             "bytes_per_block": per, "us": us, "gbps": gbps, "gbps_per_sm": per_sm})
                print(f"{name:>12} {k:>6} {per / 2**20:>9.1f} | {us:>9.1f} {gbps:>7.0f} {gbps / copy.gbps:>6.2f} "
                      f"{per_sm:>8.1f}", flush=True)
    finally:
        dev.synchronize()
        s.close()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"source": source_record(), "device": dev.info.summary(), "copy_gbps": copy.gbps, "sm_count": sms,
                       "buffer_mib": BUFFER_MIB, "reps": a.reps, "samples": a.samples, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
