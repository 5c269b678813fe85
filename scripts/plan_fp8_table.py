"""The table of docs/perf_model.md's "FP8 weights" section: Llama 3.1 405B, the best fitting layout of
`spanllm plan` per cluster, workload, weights (bf16 / fp8) and node count, with TPOT and E2E ranges over the presets'
guessed constants. Prints the markdown rows; tests/perf/test_docs_tables.py holds the doc equal to them.

    python scripts/plan_fp8_table.py
"""

from __future__ import annotations

from spanllm.perf.hardware import PRESETS
from spanllm.perf.inference import Workload
from spanllm.perf.model_shape import get_model
from spanllm.perf.plan import best, plan
from spanllm.perf.quantization import BF16, FP8

HEADER = (
    "| cluster | workload | weights | nodes | best layout | GB/GPU | TTFT ms | TPOT ms [range] | E2E ms [range] |\n"
    "|---|---|---|---|---|---|---|---|---|"
)
CASES = [  # (workload name, batch, prompt, decode): the studies' workloads at batch 16 and 64
    ("decode-heavy b16", 16, 128, 512),
    ("prefill-heavy b16", 16, 2048, 32),
    ("decode-heavy b64", 64, 128, 512),
    ("prefill-heavy b64", 64, 2048, 32),
]
RUNS = [(FP8, 1), (BF16, 1), (BF16, 2), (FP8, 2)]  # (weights, nodes): FP8 on one node against bf16 on two


def rows() -> list[str]:
    model = get_model("llama3.1-405b")
    out = []
    for cluster_name in ("dgx-h200", "dgx-h100"):
        cluster = PRESETS[cluster_name]
        for name, batch, prompt, decode in CASES:
            for quant, nodes in RUNS:
                rs = plan(model, cluster, nodes, Workload(batch, prompt, decode), True, True, quant)
                b = best(rs)
                head = f"| {cluster_name} | {name} | {quant.name} | {nodes} |"
                if b is None:
                    least = min(r.estimate.memory.total_GB for r in rs)
                    cap = rs[0].estimate.memory.capacity_GB
                    out.append(f"{head} none fits (least {least:.1f} GB/GPU of {cap:.1f}) | | | | |")
                    continue
                e = b.estimate
                tpot = f"{e.tpot_ms:.2f} [{b.tpot_range.low:.2f}-{b.tpot_range.high:.2f}]"
                e2e = f"{e.e2e_ms:.0f} [{b.e2e_range.low:.0f}-{b.e2e_range.high:.0f}]"
                layout = f"{b.layout} {b.algo}"
                out.append(f"{head} {layout} | {e.memory.total_GB:.1f} | {e.ttft_ms:.0f} | {tpot} | {e2e} |")
    return out


def table() -> str:
    return HEADER + "\n" + "\n".join(rows())


if __name__ == "__main__":
    print(table())
