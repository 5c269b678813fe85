"""What `bench serve` prints and draws: vLLM's summary block per run, one rich table and one PNG per sweep."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from spanllm.bench.serve_metrics import percentile_word
from spanllm.output_files import save_figure

_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}


def rate_label(rate: float | str) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{float(rate):g}"


def summary_lines(r: dict[str, Any], percentiles: Sequence[float], percentile_metrics: Sequence[str]) -> list[str]:
    """vLLM's 'Serving Benchmark Result' block, same labels, so the two outputs read side by side."""
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", r["completed"]),
        row("Failed requests:", r["failed"]),
    ]
    if r.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", r["max_concurrency"]))
    if r.get("request_rate", "inf") != "inf":
        lines.append(num("Request rate configured (RPS):", r["request_rate"]))
    lines += [
        num("Benchmark duration (s):", r["duration"]),
        row("Total input tokens:", r["total_input_tokens"]),
        row("Total generated tokens:", r["total_output_tokens"]),
        num("Request throughput (req/s):", r["request_throughput"]),
    ]
    if r.get("request_goodput") is not None:
        lines.append(num("Request goodput (req/s):", r["request_goodput"]))
    lines += [
        num("Output token throughput (tok/s):", r["output_throughput"]),
        num("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]),
        num("Peak concurrent requests:", r["max_concurrent_requests"]),
        num("Total token throughput (tok/s):", r["total_token_throughput"]),
    ]
    for m in percentile_metrics:
        name, header = _HEADERS[m]
        if f"mean_{m}_ms" not in r:
            continue
        lines += [
            "{s:{c}^{n}}".format(s=header, n=50, c="-"),
            num(f"Mean {name} (ms):", r[f"mean_{m}_ms"]),
            num(f"Median {name} (ms):", r[f"median_{m}_ms"]),
        ]
        lines += [num(f"P{percentile_word(p)} {name} (ms):", r[f"p{percentile_word(p)}_{m}_ms"]) for p in percentiles]
    lines.append("=" * 50)
    return lines


def _high_percentile(r: dict[str, Any], metric: str) -> tuple[str, float] | None:
    """The highest pNN_<metric>_ms in a result, e.g. ('p99', 41.2); None when no percentile was asked for."""
    found = []
    for k, v in r.items():
        if k.startswith("p") and k.endswith(f"_{metric}_ms"):
            word = k[1 : -len(f"_{metric}_ms")]
            try:
                found.append((float(word), word, v))
            except ValueError:
                continue
    if not found:
        return None
    _, word, v = max(found)
    return f"p{word}", v


def sweep_table(runs: Sequence[dict[str, Any]], title: str):
    """One row per request rate: counts, throughput, and median / high percentile of TTFT, TPOT, ITL, E2EL."""
    from rich.table import Table

    hi = next((h[0] for r in runs if (h := _high_percentile(r, "ttft"))), None)
    table = Table(title=f"{title}\n(rate and throughputs per second, latencies in ms)")
    cols = ["rate", "ok", "failed", "req/s", "out tok/s", "total tok/s"]
    for m in ("TTFT", "TPOT", "ITL"):
        cols += [f"{m} p50"] + ([f"{m} {hi}"] if hi else [])
    cols += ["E2EL p50"]
    if any(r.get("request_goodput") is not None for r in runs):
        cols.append("goodput req/s")
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for r in runs:
        cells = [
            rate_label(r["request_rate"]),
            str(r["completed"]),
            str(r["failed"]),
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:.1f}",
            f"{r['total_token_throughput']:.1f}",
        ]
        for m in ("ttft", "tpot", "itl"):
            cells.append(f"{r[f'median_{m}_ms']:.2f}")
            if hi:
                cells.append(f"{r.get(f'{hi}_{m}_ms', float('nan')):.2f}")
        cells.append(f"{r['median_e2el_ms']:.1f}")
        if cols[-1] == "goodput req/s":
            g = r.get("request_goodput")
            cells.append("-" if g is None else f"{g:.2f}")
        table.add_row(*cells)
    return table


def plot_sweep(runs: Sequence[dict[str, Any]], path: str, title: str, flag: str = "--result-dir") -> None:
    """TTFT and TPOT (median and the highest percentile asked for) and output throughput against request rate.
    Rates sit at evenly spaced positions (a sweep is usually geometric and ends with inf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [rate_label(r["request_rate"]) for r in runs]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        ax.plot(x, [r[f"median_{metric}_ms"] for r in runs], "o-", label="p50")
        highs = [_high_percentile(r, metric) for r in runs]
        if all(highs):
            ax.plot(x, [h[1] for h in highs], "s--", label=highs[0][0])
        values = [r[f"median_{metric}_ms"] for r in runs] + [h[1] for h in highs if h]
        if min(values) > 0 and max(values) / min(values) > 50:
            ax.set_yscale("log")  # TTFT at rate inf (queueing, seconds) next to ms-scale rates: keep both readable
        ax.set_ylabel(f"{name} (ms{', log scale' if ax.get_yscale() == 'log' else ''})")
        ax.set_title(name)
        ax.legend()
    axes[2].plot(x, [r["output_throughput"] for r in runs], "o-", color="tab:green")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("output throughput")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_figure(flag, path, fig, dpi=120)
    plt.close(fig)
