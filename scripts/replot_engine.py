"""The stacked-bar PNG of an engine JSON (bench batch / study), redrawn from the file alone: for a run whose
report never ran (cut by a time limit: its rows are in `X.partial.json`), or to redraw a committed one.

    python scripts/replot_engine.py results/h200x2/study_llama3.1-70b_prefill-heavy.json out.png
"""

from __future__ import annotations

import json
import sys

from spanllm.commands.bench_batch import plot_breakdown


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    src, dst = argv
    doc = json.load(open(src))
    rows, s = doc["rows"], doc["settings"]
    if not rows:
        raise SystemExit(f"{src} holds no rows")
    title = (
        f"{doc['kind']}: {rows[0].get('model_label', s['model'])}, world {s.get('world_size', '?')}, {s['workload']}"
    )
    if doc.get("complete") is False:
        title += f" (partial run: {len(rows)} rows)"
    plot_breakdown(rows, dst, title)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
