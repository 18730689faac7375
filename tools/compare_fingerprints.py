#!/usr/bin/env python3
"""Compare two tools/decode_fingerprint.py results: same greedy tokens? same logit bits? which
launch shapes differ (a different grid can change the order of a reduction, and with it the
last bits of the logits, while the tokens stay the same).

    python3 tools/compare_fingerprints.py BASELINE.json NEW.json

Exit status 1 when any prompt's tokens differ (graph or eager), else 0.
"""

import json
import sys


def shapes(res: dict) -> dict:
    return {(s["name"], s["kernel"]): (s["grid"], s["block"], s["smem"]) for s in res["launch_shapes"]}


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    base, new = (json.load(open(p)) for p in sys.argv[1:3])
    ok = True
    for name, b in base["prompts"].items():
        n = new["prompts"][name]
        same_tokens = b["tokens"] == n["tokens"] and b["eager_tokens"] == n["eager_tokens"]
        ok &= same_tokens
        print(f"{name}: tokens {'same' if same_tokens else 'DIFFERENT'}, logits bits "
              f"{'same' if b['logits_sha256'] == n['logits_sha256'] else 'differ'}")
    sb, sn = shapes(base), shapes(new)
    for key in sorted(set(sb) | set(sn)):
        if sb.get(key) != sn.get(key):
            print(f"launch shape {key[0]} ({key[1]}): baseline {sb.get(key)} -> now {sn.get(key)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
