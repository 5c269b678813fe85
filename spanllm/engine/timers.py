"""Where decode time goes: per-op regions (GEMM, attention, all-reduce, pipeline transfer, idle) per step.

The layers call `timers.region("gemm")` etc. around their work. A disabled `Timers` hands back one shared
null context, so the hook costs a method call and nothing is recorded. An enabled one records CUDA events
on GPU (read after the step, one synchronize) and `perf_counter` on CPU. Events can only be placed in
eager code: with the breakdown on, decode does not use CUDA graphs (the report says so).

GPU time, not launch gaps (enqueue-ahead)
    In eager decode the host launches ~15 small kernels per layer; the GPU drains its queue faster than
    the host fills it, so the interval between two events would measure the host's launch time, not the
    op. (The first GPU runs showed it: an 8B eager step of 167 ms against 5 ms with graphs, "attention"
    106 ms.) So every step starts with a device spin (`torch.cuda._sleep`) that holds the stream while
    the host enqueues the whole step behind it; when the host is done it checks that the spin is still
    running. If so, every op was queued before the GPU reached it and each event interval is the op's
    GPU time. If not (spin too short, or something in the step synchronised the host), the step is
    "uncovered": it goes to a separate tally and the spin doubles for the next step. Totals from
    covered steps are GPU busy time per decode step; their sum is lower than a graph step by the graph's
    own per-kernel gaps. Ranks of a TP group start their spins within the host skew of the previous
    step's end (their GPUs leave the previous step together at its last all-reduce), and that skew lands
    in the first all-reduce of the step.

Categories: gemm (every linear layer and the LM head), attention (RoPE, KV-cache write, SDPA),
allreduce (the row-parallel all-reduce: the injected communicator), pipeline (posting and completing
sends of activations / tokens), idle (blocked in a pipeline receive: the bubble, waiting for the
neighbouring stage, including the transfer itself), other = step time minus all of these (norms,
SiLU, residual adds, embedding and its collective, logits gather, sampling, Python overhead).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

CATEGORIES = ("gemm", "attention", "allreduce", "pipeline", "idle", "other")
_NULL = contextlib.nullcontext()


class _CpuRegion:
    __slots__ = ("timers", "name", "t0")

    def __init__(self, timers: "Timers", name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timers._cpu_totals[self.name] += (time.perf_counter() - self.t0) * 1e3


class _CudaRegion:
    __slots__ = ("timers", "name", "start")

    def __init__(self, timers: "Timers", name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def __exit__(self, *exc) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.timers._events.append((self.name, self.start, end))


@dataclass
class Breakdown:
    """Milliseconds per category summed over `steps` decode steps; `per_step()` divides."""

    steps: int = 0
    total_ms: float = 0.0
    ms: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CATEGORIES})

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {c: v / n for c, v in self.ms.items()}


SPIN_START_CYCLES = 1 << 25  # ~17 ms at ~2 GHz: an eager 8B-70B step enqueues in a few ms
SPIN_MAX_CYCLES = (1 << 31) - 1  # torch.cuda._sleep takes an int64, but ~1 s is plenty


class Timers:
    """Per-op decode timers for one rank. Not thread-safe; one per model.

    `breakdown` holds the steps whose regions are GPU time (on CPU: every step); `uncovered` the GPU steps
    the host could not enqueue ahead of the device (see the module docstring), kept apart, never mixed in."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda"
        self.breakdown = Breakdown()
        self.uncovered = Breakdown()
        self.spin_cycles = SPIN_START_CYCLES
        self._spin_done: object = None
        self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._step_start: object = None
        self._in_step = False  # regions record only between step_begin and step_end

    def region(self, name: str):
        """A context manager that adds its duration to category `name` (a no-op when disabled or outside
        a decode step)."""
        if not self._in_step:
            return _NULL
        return _CudaRegion(self, name) if self._cuda else _CpuRegion(self, name)

    def step_begin(self) -> None:
        if not self.enabled:
            return
        self._in_step = True
        if self._cuda:
            torch.cuda._sleep(self.spin_cycles)  # hold the stream while the host enqueues the step
            self._spin_done = torch.cuda.Event()
            self._spin_done.record()
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        else:
            self._step_start = time.perf_counter()

    def step_end(self) -> None:
        """Close a decode step: fold its regions into the breakdown (synchronizes on GPU)."""
        if not self._in_step:
            return
        self._in_step = False
        covered = True
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            # Still spinning now that the whole step is queued -> no interval below contains a launch gap.
            covered = not self._spin_done.query()
            end.synchronize()
            total = self._step_start.elapsed_time(end)
            step = {c: 0.0 for c in CATEGORIES}
            for name, s, e in self._events:
                step[name] += s.elapsed_time(e)
            self._events.clear()
            if not covered:
                self.spin_cycles = min(2 * self.spin_cycles, SPIN_MAX_CYCLES)
        else:
            total = (time.perf_counter() - self._step_start) * 1e3
            step = self._cpu_totals
            self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        fold_step(self.breakdown if covered else self.uncovered, step, total)

    @property
    def steps(self) -> int:
        """Decode steps timed so far, covered or not."""
        return self.breakdown.steps + self.uncovered.steps

    def reset(self) -> None:
        self._in_step = False
        self.breakdown = Breakdown()
        self.uncovered = Breakdown()
        self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        self._events.clear()


def fold_step(b: Breakdown, step: dict[str, float], total_ms: float) -> None:
    """Add one step's regions to `b`; "other" is the step's time not inside any region (never negative)."""
    b.steps += 1
    b.total_ms += total_ms
    measured = 0.0
    for c in CATEGORIES[:-1]:
        b.ms[c] += step[c]
        measured += step[c]
    b.ms["other"] += max(total_ms - measured, 0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WallClock:
    """Phase timestamps (ms since `start()`), device-synchronized so GPU work is included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.t0 = 0.0

    def start(self) -> None:
        sync(self.device)
        self.t0 = time.perf_counter()

    def now_ms(self) -> float:
        sync(self.device)
        return (time.perf_counter() - self.t0) * 1e3
