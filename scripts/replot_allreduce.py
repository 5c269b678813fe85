"""Redraw the all-reduce latency plot from `spanllm bench allreduce --json` files.

python scripts/replot_allreduce.py results/h200x2/allreduce_*.json -o results/h200x2/allreduce_latency.png
"""

from __future__ import annotations

import argparse
import json
import sys

from spanllm.bench.allreduce_plot import plot_allreduce


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json", nargs="+", help="spanllm bench allreduce --json files")
    ap.add_argument("-o", "--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    docs = []
    for p in args.json:
        with open(p) as f:
            doc = json.load(f)
        if doc.get("kind") != "allreduce":
            raise SystemExit(f"{p}: kind={doc.get('kind')!r}, not an all-reduce benchmark")
        docs.append(doc)
    plot_allreduce(docs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
