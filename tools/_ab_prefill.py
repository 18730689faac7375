"""Throwaway A/B driver (not committed): drvqwen.bench with the prefill's RMSNorm block size and
the qkv_rope GEMM's tile forced."""
import sys
import drvqwen.prefill as P
import drvqwen.bench as B

args = sys.argv[1:]
nt = int(args.pop(0)); tile = int(args.pop(0))
if nt:
    P.norm_row_threads = lambda d: nt
if tile:
    base = P.GemmInt4QkvRopeRows
    class Forced(base):
        def __init__(self, *a, **kw):
            kw.setdefault("tile_tokens", tile)
            super().__init__(*a, **kw)
    P.GemmInt4QkvRopeRows = Forced
sys.exit(B.main(args))
