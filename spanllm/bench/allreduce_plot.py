"""Latency vs message size, one line per algorithm and one panel per topology, from bench JSON files
(`spanllm bench allreduce --plot`, scripts/replot_allreduce.py)."""

from __future__ import annotations

from spanllm.output_files import save_figure


def plot_allreduce(docs: list[dict], path: str, title: str | None = None, flag: str = "--plot") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.8), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        rows = doc["rows"]
        for algo in dict.fromkeys(r["algo"] for r in rows):
            mine = sorted((r for r in rows if r["algo"] == algo), key=lambda r: r["size"])
            ax.plot(
                [r["size"] for r in mine],
                [r["time_us"] for r in mine],
                marker="o",
                ms=3,
                ls="--" if algo == "auto" else "-",
                label=algo,
            )
        s = doc.get("settings", {})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per call (us), median, max over ranks")
        ax.set_title(
            f"{s.get('topology', '?')} (nodes x ranks per node), {s.get('dtype', '')}, "
            f"{'CUDA graph' if s.get('graph') else 'eager'}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    gpus = (docs[0].get("machine") or {}).get("gpus") or []
    world = (docs[0].get("settings") or {}).get("world_size", "?")
    where = f"{len(gpus)} x {gpus[0]}" if gpus else f"{world} CPU ranks (gloo)"
    fig.suptitle(title or f"spanllm bench allreduce on {where}")
    fig.tight_layout()
    save_figure(flag, path, fig, dpi=120)
    plt.close(fig)
