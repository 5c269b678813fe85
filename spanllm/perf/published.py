"""Published multi-node all-reduce figures (published_points.json) priced by the model, with the error.

Each point was measured (or, role 'model', predicted by NCCL's own tuner) by someone else on a cluster
the presets describe only by their constants. The point names the cluster to price it on: a preset,
with overrides for what differs (GPUs per node, NIC rate, transport), in the cluster-file format
(hardware.cluster_from_dict). Every record carries the prediction's range over that cluster's guessed
constants (spanllm.perf.uncertainty) and whether the figure lies inside it.

No constant was fitted to these points (role 'check' or 'model'); `perf validate` reports them under
`published/<role>`. To add a point: append it to published_points.json with its source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import ClusterSpec, cluster_from_dict
from spanllm.perf.uncertainty import predict_range

POINTS_FILE = Path(__file__).with_name("published_points.json")
ROLES = ("check", "model")


class PublishedPointError(ValueError):
    """A published point that does not follow the schema."""


@dataclass(frozen=True)
class PublishedPoint:
    id: str
    source_url: str
    source_title: str
    setup: str
    cluster: ClusterSpec
    algo: str
    nodes: int
    ranks_per_node: int
    graph: bool
    role: str
    rows: tuple[tuple[int, float], ...]  # (bytes, time us)
    timing_note: str = ""


def load_points(path: Path = POINTS_FILE) -> list[PublishedPoint]:
    doc = json.loads(Path(path).read_text())
    out = []
    for i, p in enumerate(doc["points"]):
        try:
            if p["role"] not in ROLES:
                raise ValueError(f"role {p['role']!r} not in {ROLES}")
            out.append(
                PublishedPoint(
                    id=p["id"],
                    source_url=p["source_url"],
                    source_title=p["source_title"],
                    setup=p["setup"],
                    cluster=cluster_from_dict(p["cluster"], source=f"{path}: {p['id']}"),
                    algo=p["algo"],
                    nodes=int(p["nodes"]),
                    ranks_per_node=int(p["ranks_per_node"]),
                    graph=bool(p["graph"]),
                    role=p["role"],
                    rows=tuple((int(b), float(t)) for b, t in p["rows"]),
                    timing_note=p.get("timing_note", ""),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PublishedPointError(f"{path}: point {i} ({p.get('id', '?')}): {e}") from None
    return out


def point_records(points: list[PublishedPoint]) -> list[dict[str, Any]]:
    """One record per published row: predicted (nominal), measured, error, the range and whether it holds the figure."""
    records = []
    for pt in points:
        for nbytes, measured in pt.rows:

            def f(c: ClusterSpec, nbytes=nbytes) -> float:
                return allreduce_time_us(pt.algo, nbytes, c, pt.nodes, pt.ranks_per_node, pt.graph)

            r = predict_range(f, pt.cluster)
            records.append(
                {
                    "category": f"published/{pt.role}",
                    "label": f"{pt.algo} {pt.nodes}x{pt.ranks_per_node} {nbytes} B ({pt.id})",
                    "predicted": r.nominal,
                    "measured": measured,
                    "rel_error": (r.nominal - measured) / measured,
                    "source": pt.source_url,
                    "fitted_on": "none: published point, used only for checking",
                    "range": [r.low, r.high],
                    "in_range": r.holds(measured),
                    "drivers": r.top(3),
                    "setup": pt.setup,
                    "cluster": pt.cluster.name,
                    "timing_note": pt.timing_note,
                }
            )
    return records
