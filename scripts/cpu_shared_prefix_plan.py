"""The host cost of planning shared-prefix decode attention (spanllm.attention.shared_prefix.plan_shared_prefix),
which the Triton backend runs on every decode step before it launches the step: time per call for decode batches
shaped like the workloads that matter, on this machine's CPU.

    python scripts/cpu_shared_prefix_plan.py OUTDIR [--reps 200]

Cases: generated-shared-prefix as it runs (256 decodes over 64 system prompts of 2,048 tokens, each with its own
question and up to 256 generated tokens: ~150 blocks a row), the same with no shared prefix (ShareGPT-like: every
row its own blocks), and long contexts (64 decodes of 32k tokens over 4 shared documents: 2,048 blocks a row).
Writes OUTDIR/shared_prefix_plan.json (machine, versions, per case: rows, table width, groups found, median and p90
microseconds) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

BLOCK = 16
KEY_TILE = 64


def workload(rows: int, families: int, prefix: int, own_max: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Block tables and context lengths: row r shares family r % families' prefix blocks (families 0: none),
    then 1 ... own_max keys of its own."""
    rng = np.random.default_rng(seed)
    next_id = 1
    fam = []
    for _ in range(families):
        fam.append(list(range(next_id, next_id + prefix // BLOCK)))
        next_id += prefix // BLOCK
    tables, ctx = [], []
    for _ in range(rows):
        own = int(rng.integers(1, own_max + 1))
        nb = -(-own // BLOCK)
        pre = fam[int(rng.integers(families))] if families else []
        tables.append(pre + list(range(next_id, next_id + nb)))
        next_id += nb
        ctx.append((prefix if families else 0) + own)
    width = max(map(len, tables))
    t = np.zeros((rows, width), np.int32)
    for r, row in enumerate(tables):
        t[r, : len(row)] = row
    order = rng.permutation(rows)  # the batch's row order is the scheduler's, not the groups'
    return t[order], np.asarray(ctx, np.int32)[order]


CASES = {
    "generated-shared-prefix, 256 decodes": dict(rows=256, families=64, prefix=2048, own_max=128 + 256),
    "no shared prefix (ShareGPT-like), 256 decodes": dict(rows=256, families=0, prefix=0, own_max=800),
    "long documents, 64 decodes of 32k": dict(rows=64, families=4, prefix=32768, own_max=512),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from spanllm.attention.shared_prefix import members_per_group, plan_shared_prefix

    rows = []
    for name, spec in CASES.items():
        tables, ctx = workload(**spec, seed=0)
        plan = None
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            plan = plan_shared_prefix(tables, ctx, BLOCK, KEY_TILE, members=members_per_group(4), target_units=33)
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        row = {
            "case": name,
            **spec,
            "table_width_blocks": int(tables.shape[1]),
            "groups": plan.num_groups,
            "rows_in_groups": plan.shared_rows,
            "stage1_units": int(len(plan.units)),
            "median_us": statistics.median(times),
            "p90_us": times[int(0.9 * (len(times) - 1))],
            "reps": args.reps,
        }
        rows.append(row)
        print(
            f"{name:48s} width {row['table_width_blocks']:5d}  groups {row['groups']:3d} "
            f"({row['rows_in_groups']} rows)  median {row['median_us']:8.1f} us  p90 {row['p90_us']:8.1f} us"
        )
    doc = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count()},
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
        "settings": {"block_size": BLOCK, "key_tile": KEY_TILE, "members": members_per_group(4), "target_units": 33},
        "rows": rows,
    }
    os.makedirs(args.outdir, exist_ok=True)
    path = os.path.join(args.outdir, "shared_prefix_plan.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
