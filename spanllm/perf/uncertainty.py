"""Ranges of predictions from the ranges of the [assumed] constants (ClusterSpec.ranges).

For a prediction f(cluster) and the K constants a preset marks as guesses, each with (low, high):

  1. nominal   f at the preset's values
  2. one at a time: f with constant k at its low end, then at its high end (others nominal); the
     change |f(k at one end) - nominal| says how much k drives f (`drivers`, largest first)
  3. the range: every constant at the end that lowered f in step 2 (the low corner) and every one at
     the end that raised it (the high corner). For f monotone in each constant -- true of the
     alpha-beta sums here -- no point of the box lies outside [low corner, high corner].

2K + 3 evaluations. Constants that do not move f (a fitted entry no longer built from the guessed link
constant, a link the layout does not use) drop out of `drivers`.

`Scenario`s are the common ground for ranking: the same list of clusters (nominal, each constant at
each end) prices every candidate, so "A beats B in n of m scenarios" compares like with like.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spanllm.perf.hardware import ClusterSpec, constant_value, with_constant


@dataclass(frozen=True)
class Driver:
    path: str  # e.g. 'transport.proxy_us'
    low_value: float
    high_value: float
    delta_at_low: float  # f(constant at low) - nominal
    delta_at_high: float

    @property
    def swing(self) -> float:
        return max(abs(self.delta_at_low), abs(self.delta_at_high))


@dataclass(frozen=True)
class Range:
    nominal: float
    low: float
    high: float
    drivers: tuple[Driver, ...]  # constants that move the prediction, largest swing first

    def holds(self, value: float, rel_tol: float = 0.0) -> bool:
        """Whether `value` lies inside [low, high] (widened by rel_tol on each side)."""
        return self.low * (1 - rel_tol) <= value <= self.high * (1 + rel_tol)

    def top(self, n: int = 2) -> str:
        """'transport.proxy_us +41%, nic_latency_us +12%': the n largest drivers, as a share of the nominal."""
        if not self.nominal:
            return ""
        return ", ".join(
            f"{d.path} {max(d.delta_at_low, d.delta_at_high, key=abs) / self.nominal:+.0%}"
            for d in self.drivers[:n]
            if d.swing / abs(self.nominal) >= 0.005
        )


def assumed(cluster: ClusterSpec) -> dict[str, tuple[float, float]]:
    """The cluster's guessed constants and their ranges (path -> (low, high))."""
    return dict(cluster.ranges)


def scenarios(cluster: ClusterSpec) -> list[tuple[str, ClusterSpec]]:
    """(label, cluster): the nominal cluster, then every guessed constant at its low and at its high end."""
    out = [("nominal", cluster)]
    for path, (lo, hi) in sorted(cluster.ranges.items()):
        out += [(f"{path}=low", with_constant(cluster, path, lo)), (f"{path}=high", with_constant(cluster, path, hi))]
    return out


def corner(cluster: ClusterSpec, ends: dict[str, float]) -> ClusterSpec:
    for path, value in ends.items():
        cluster = with_constant(cluster, path, value)
    return cluster


def predict_range(
    f: Callable[[ClusterSpec], float],
    cluster: ClusterSpec,
    values: dict[str, float] | None = None,
    rel_threshold: float = 1e-9,
) -> Range:
    """The range of f over the box of the cluster's guessed constants (module docstring). `values`: f already
    evaluated on `scenarios(cluster)`, by label (then only the two corners are evaluated here)."""
    if values is None:
        values = {label: f(c) for label, c in scenarios(cluster)}
    nominal = values["nominal"]
    drivers, low_ends, high_ends = [], {}, {}
    for path, (lo, hi) in sorted(cluster.ranges.items()):
        d_lo, d_hi = values[f"{path}=low"] - nominal, values[f"{path}=high"] - nominal
        if max(abs(d_lo), abs(d_hi)) <= rel_threshold * max(abs(nominal), 1.0):
            continue
        drivers.append(Driver(path, lo, hi, d_lo, d_hi))
        low_ends[path], high_ends[path] = (lo, hi) if d_lo <= d_hi else (hi, lo)
    if not drivers:
        return Range(nominal, nominal, nominal, ())
    low = min(nominal, f(corner(cluster, low_ends)))
    high = max(nominal, f(corner(cluster, high_ends)))
    return Range(nominal, low, high, tuple(sorted(drivers, key=lambda d: -d.swing)))


def nominal_value(cluster: ClusterSpec, path: str) -> float:
    return constant_value(cluster, path)
