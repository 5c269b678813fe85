"""Where decode time goes: per-op regions (GEMM, attention, all-reduce, pipeline transfer, idle) per step.

The layers call `timers.region("gemm")` etc. around their work. A disabled `Timers` hands back one shared
null context, so the hook costs a method call and nothing is recorded. An enabled one records CUDA events
on GPU (read after the step, one synchronize) and `perf_counter` on CPU. Events can only be placed in
eager code: with the breakdown on, decode does not use CUDA graphs (the report says so).

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


class Timers:
    """Per-op decode timers for one rank. Not thread-safe; one per model."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda"
        self.breakdown = Breakdown()
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
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        else:
            self._step_start = time.perf_counter()

    def step_end(self) -> None:
        """Close a decode step: fold its regions into the breakdown (synchronizes on GPU)."""
        if not self._in_step:
            return
        self._in_step = False
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            total = self._step_start.elapsed_time(end)
            step = {c: 0.0 for c in CATEGORIES}
            for name, s, e in self._events:
                step[name] += s.elapsed_time(e)
            self._events.clear()
        else:
            total = (time.perf_counter() - self._step_start) * 1e3
            step = self._cpu_totals
            self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        b = self.breakdown
        b.steps += 1
        b.total_ms += total
        measured = 0.0
        for c in CATEGORIES[:-1]:
            b.ms[c] += step[c]
            measured += step[c]
        b.ms["other"] += max(total - measured, 0.0)

    def reset(self) -> None:
        self._in_step = False
        self.breakdown = Breakdown()
        self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        self._events.clear()


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
