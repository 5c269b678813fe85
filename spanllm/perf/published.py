"""Published multi-node all-reduce figures (published_points.json) priced by the model, with the error.

Each point was measured (or, role 'model', predicted by NCCL's own tuner) by someone else on a cluster
the presets describe only by their constants. The point names the cluster to price it on: a preset,
with overrides for what differs (GPUs per node, NIC rate, transport), in the cluster-file format
(hardware.cluster_from_dict). Every record carries the prediction's range over that cluster's guessed
constants (spanllm.perf.uncertainty) and whether the figure lies inside it.

Two predictions per point. `published/<role>`: the presets' constants as shipped (NCCL's own tuner figures for
NCCL), no constant fitted to any published point. `published/loso` (role 'check' only): leave one source out --
the hop model below fitted to every other source's points, then used on this source's. A source is one thread
or page (its source_url); a point whose `unexplained` field says why the model is not expected to explain it
(a setup its own reporter found broken) is left out of every fit and reported apart (`published/unexplained`).

The hop model (`HopModel`): NCCL's small-message time is a per-call cost plus a cost per step on the critical
path, the step counts from the schedule NCCL's tuner picks on the point's cluster (allreduce_model.cost_terms):

    t = call_us + nvlink_steps * nvlink_hop_us + net_steps * net_hop_us + wire bytes / link bandwidth

one net_hop_us for every network (InfiniBand, RoCE, EFA: split per fabric, each fabric's constant rests on one or
two sources and the held-out predictions get worse); relative least squares with every source weighing the same,
a negative constant held at 0. A record's range is cross-validated inside the training sources: each of them
predicted by the fit on the others, one median log error per source, and the 80% Student-t prediction interval
of a new source's log error from those (mean +- t(0.90, n-1) * sd * sqrt(1 + 1/n)), turned into the band the
measured value should fall in. Sources, not rows, are the samples: the rows of one source move together.

To add a point: append it to published_points.json with its source, setup and network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spanllm.perf.allreduce_model import allreduce_cost, allreduce_time_us, cost_terms, place, transfer_us
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
    network: str = ""  # the fabric between the nodes ('ib-hdr', 'efa', ...): the sources group by it
    unexplained: str = ""  # why the model is not expected to explain this point (then it is left out of fits)


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
                    network=p.get("network", ""),
                    unexplained=p.get("unexplained", ""),
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

            def f(c: ClusterSpec, nbytes=nbytes, pt=pt) -> float:
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


# --- leave one source out -------------------------------------------------------------------------------------

T_90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 7: 1.415, 8: 1.397, 9: 1.383, 10: 1.372}
"""Student-t 0.90 quantile by degrees of freedom (two-sided 80% interval); above 10, the value at 10 (wider)."""


@dataclass(frozen=True)
class HopModel:
    call_us: float
    nvlink_hop_us: float
    net_hop_us: float

    def predict_us(self, pt: PublishedPoint, nbytes: int) -> float:
        bw, x = hop_features(pt, nbytes)
        return float(x @ np.array(self.vector)) + bw

    @property
    def vector(self) -> list[float]:
        return [self.call_us, self.nvlink_hop_us, self.net_hop_us]


def hop_features(pt: PublishedPoint, nbytes: int) -> tuple[float, np.ndarray]:
    """(the bandwidth time, [1, NVLink steps, network steps]) of the schedule NCCL's tuner picks."""
    variant = allreduce_cost(pt.algo, nbytes, pt.cluster, pt.nodes, pt.ranks_per_node, pt.graph)[1]
    c, pl = pt.cluster, place(pt.cluster, pt.nodes, pt.ranks_per_node)
    terms = cost_terms(variant, nbytes, c, pl)
    eff = c.algo(variant).bw_efficiency
    bw = transfer_us(terms.nvlink_wire_bytes, c.nvlink_GBps * eff) if terms.nvlink_wire_bytes else 0.0
    bw += transfer_us(terms.net_wire_bytes, c.nic_GBps_per_gpu * eff) if terms.net_wire_bytes else 0.0
    return bw, np.array([1.0, terms.nvlink_steps, terms.net_steps])


def fit_hops(points: list[PublishedPoint]) -> HopModel:
    """HopModel fitted (relative least squares) to every row of `points`; constants with no row that moves them
    stay 0."""
    rows = [(pt, b, t) for pt in points for b, t in pt.rows]
    if not rows:
        raise PublishedPointError("no rows to fit the hop model to")
    feats = [hop_features(pt, b) for pt, b, _ in rows]
    X = np.array([f for _, f in feats])
    bw = np.array([b for b, _ in feats])
    meas = np.array([t for _, _, t in rows])
    y = meas - bw
    per_source = {s: sum(1 for pt, _, _ in rows if pt.source_url == s) for s in {pt.source_url for pt, _, _ in rows}}
    W = 1.0 / meas / np.sqrt([per_source[pt.source_url] for pt, _, _ in rows])  # every source weighs the same
    cols = [j for j in range(X.shape[1]) if np.any(X[:, j])]
    while True:
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, cols] * W[:, None], y * W, rcond=None)
        coef[cols] = sol
        neg = [j for j in cols if coef[j] < 0]
        if not neg:
            break
        cols.remove(min(neg, key=lambda j: coef[j]))
    return HopModel(float(coef[0]), float(coef[1]), float(coef[2]))


def loso_records(points: list[PublishedPoint]) -> list[dict[str, Any]]:
    """Per 'check' row: the hop model fitted to every other source's 'check' points, its prediction and range.
    Points marked `unexplained` are priced with the fit on all the explained sources, under published/unexplained."""
    checks = [p for p in points if p.role == "check"]
    explained = [p for p in checks if not p.unexplained]
    sources = sorted({p.source_url for p in explained})
    records = []
    for pt in checks:
        train = [p for p in explained if p.source_url != pt.source_url]
        if not train:
            continue
        model = fit_hops(train)
        lo_f, hi_f = prediction_band(source_residuals(train))
        for nbytes, measured in pt.rows:
            pred = float(model.predict_us(pt, nbytes))
            lo, hi = pred * lo_f, pred * hi_f
            records.append(
                {
                    "category": "published/unexplained" if pt.unexplained else "published/loso",
                    "label": f"{pt.algo} {pt.nodes}x{pt.ranks_per_node} {nbytes} B ({pt.id})",
                    "predicted": pred,
                    "measured": measured,
                    "rel_error": (pred - measured) / measured,
                    "source": pt.source_url,
                    "network": pt.network,
                    "fitted_on": f"hop model on the {len({p.source_url for p in train})} other sources of "
                    f"{len(sources)}",
                    "range": [lo, hi],
                    "in_range": lo <= measured <= hi,
                    "constants": {
                        "call_us": model.call_us,
                        "nvlink_hop_us": model.nvlink_hop_us,
                        "net_hop_us": model.net_hop_us,
                    },
                    "unexplained": pt.unexplained,
                    "setup": pt.setup,
                }
            )
    return records


def source_residuals(train: list[PublishedPoint]) -> list[float]:
    """Per training source: the median relative error of its rows predicted by the hop model fitted to the others."""
    out = []
    for src in sorted({p.source_url for p in train}):
        rest = [p for p in train if p.source_url != src]
        if not rest:
            continue
        m = fit_hops(rest)
        errs = [(m.predict_us(p, b) - t) / t for p in train if p.source_url == src for b, t in p.rows]
        out.append(float(np.median(errs)))
    return out


def prediction_band(residuals: list[float]) -> tuple[float, float]:
    """(low, high) factors on a prediction that hold a new source's measurement 80% of the time, from the training
    sources' relative errors: measured = predicted / (1 + error), the Student-t prediction interval of
    log(1 + error). Fewer than two sources: (0, inf)."""
    n = len(residuals)
    if n < 2:
        return 0.0, float("inf")
    logs = np.log1p(residuals)
    half = T_90[min(n - 1, 10)] * float(np.std(logs, ddof=1)) * float(np.sqrt(1 + 1 / n))
    mean = float(np.mean(logs))
    return float(np.exp(-mean - half)), float(np.exp(-mean + half))


def per_source(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Residuals of the leave-one-source-out records per source: median error, rows in range, and whether the
    model explains the source (median |error| <= 25%)."""
    out: dict[str, dict[str, Any]] = {}
    for src in sorted({r["source"] for r in records}):
        rs = [r for r in records if r["source"] == src]
        med = float(np.median([r["rel_error"] for r in rs]))
        out[src] = {
            "n": len(rs),
            "network": rs[0]["network"],
            "median_rel_error": med,
            "in_range": sum(r["in_range"] for r in rs),
            "explained": abs(med) <= 0.25 and not rs[0]["unexplained"],
            "note": rs[0]["unexplained"],
        }
    return out
