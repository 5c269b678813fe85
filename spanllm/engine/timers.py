"""Where decode time goes: per-op regions (GEMM, attention, all-reduce, pipeline transfer, idle) per step.

Nothing in the layers knows about it: `attach(model)` puts forward hooks on the model's modules (every
column- and row-parallel linear and the LM head: "gemm"; every attention layer: "attention"; a re-armed spin
before each decoder layer) and wraps the TP communicator ("allreduce"). A disabled `Timers` (or one outside a
step) hands back one shared null context, so an attached hook costs a method call and nothing is recorded. An
enabled one records CUDA events on GPU (read after the step, one synchronize) and `perf_counter` on CPU.
Events can only be placed in eager code: with the breakdown on, decode does not use CUDA graphs (the report
says so).

GPU time, not launch gaps (enqueue-ahead)
    In eager decode the host launches ~15-30 small kernels per layer; the GPU drains its queue faster
    than the host fills it, so the interval between two events would measure the host's launch time,
    not the op. (The first GPU runs showed it: an 8B eager step of 167 ms against 5 ms with graphs,
    "attention" 106 ms.) So the stream is held by device spins (`torch.cuda._sleep`) while the host
    enqueues the work behind them: one spin at the start of the step and, with `layer_spins` (pp = 1),
    one before every decoder layer, because a whole step does not fit in the launch queue (~1,000
    entries; an 8B step with its timing events needs more) and a full queue blocks the host. Before
    arming the next spin (and at the end of the step) the host checks that the previous spin is still
    running: if so, the segment behind it was queued before the GPU reached it, and its event intervals
    are GPU time. A step with any segment the host did not get ahead of (a spin too short, or a host
    sync) is "uncovered": it goes to a separate tally. The spins are excluded from the step's total.
    The spin length is fixed (`SPIN_CYCLES`), the same on every rank, so TP ranks stay in step. With
    pp > 1 there is only the step's spin: a layer spin on one stage would show up as the next stage's
    idle time.
Categories: gemm (every linear layer, and the LM head with its logits gather; the row-parallel all-reduce
runs inside a row-parallel linear's forward, the model's one call site of the communicator, and is subtracted),
attention (RoPE, KV-cache write, attention), allreduce (the row-parallel all-reduce: the injected
communicator), pipeline (posting and completing sends of activations / tokens), idle (blocked in a pipeline
receive: the bubble, waiting for the neighbouring stage, including the transfer itself), other = step time
minus all of these (norms, SiLU, residual adds, embedding and its collective, sampling, Python overhead).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

CATEGORIES = ("gemm", "attention", "allreduce", "pipeline", "idle", "other")
_NULL = contextlib.nullcontext()


class _CpuRegion:
    __slots__ = ("timers", "name", "t0")

    def __init__(self, timers: Timers, name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timers._cpu_totals[self.name] += (time.perf_counter() - self.t0) * 1e3


class _CudaRegion:
    __slots__ = ("timers", "name", "start")

    def __init__(self, timers: Timers, name: str) -> None:
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


SPIN_CYCLES = 1 << 23  # ~4 ms at ~2 GHz: the host enqueues one eager layer (~50 launches) in well under that


class Timers:
    """Per-op decode timers for one rank. Not thread-safe; one per model.

    `breakdown` holds the steps whose regions are GPU time (on CPU: every step); `uncovered` the GPU steps
    the host could not enqueue ahead of the device (see the module docstring), kept apart, never mixed in."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False, layer_spins: bool = False) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.layer_spins = layer_spins  # a spin before every decoder layer (pp = 1; see the module docstring)
        self._cuda = self.device.type == "cuda"
        self.breakdown = Breakdown()
        self.uncovered = Breakdown()
        self._spins: list = []  # (start, end) timing events around each spin of the current step
        self._covered = True
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
            self._spins, self._covered = [], True
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
            self._arm()
        else:
            self._step_start = time.perf_counter()

    def _arm(self) -> None:
        """Check that the previous spin still runs (its segment was queued ahead), then hold the stream again."""
        self._check_previous_spin()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(SPIN_CYCLES)
        end.record()
        self._spins.append((start, end))

    def _check_previous_spin(self) -> None:
        if self._spins and self._spins[-1][1].query():  # already finished: the GPU caught up with the host
            self._covered = False

    def layer_begin(self) -> None:
        """Called before each decoder layer: re-arms the spin during a timed GPU step (a no-op otherwise)."""
        if self._in_step and self._cuda and self.layer_spins:
            self._arm()

    def step_end(self) -> None:
        """Close a decode step: fold its regions into the breakdown (synchronizes on GPU)."""
        if not self._in_step:
            return
        self._in_step = False
        covered = True
        if self._cuda:
            self._check_previous_spin()  # the last segment: queued before the last spin ended?
            covered = self._covered
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            spins = sum(a.elapsed_time(b) for a, b in self._spins)
            total = self._step_start.elapsed_time(end) - spins
            step = {c: 0.0 for c in CATEGORIES}
            for name, s, e in self._events:
                step[name] += s.elapsed_time(e)
            self._events.clear()
            self._spins = []
        else:
            total = (time.perf_counter() - self._step_start) * 1e3
            step = self._cpu_totals
            self._cpu_totals = {c: 0.0 for c in CATEGORIES}
        fold_step(self.breakdown if covered else self.uncovered, step, total)

    def attach(self, model) -> Callable[[], None]:
        """Time `model` (a spanllm LlamaForCausalLM stage) through hooks; returns the function that detaches
        them (and restores the communicator)."""
        from spanllm.attention.layer import Attention
        from spanllm.layers.linear import ColumnParallelLinear, RowParallelLinear
        from spanllm.layers.vocab import ParallelLMHead
        from spanllm.model.llama import LlamaDecoderLayer

        handles, open_regions = [], []

        def timed(category: str):
            def pre(module, args):
                r = self.region(category)
                r.__enter__()
                open_regions.append(r)

            def post(module, args, out):
                open_regions.pop().__exit__(None, None, None)

            return pre, post

        for m in model.modules():
            cat = None
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
                cat = "gemm"
            elif isinstance(m, Attention):
                cat = "attention"
            elif isinstance(m, LlamaDecoderLayer):
                handles.append(m.register_forward_pre_hook(lambda module, args: self.layer_begin()))
            if cat is not None:
                pre, post = timed(cat)
                handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        tp = model.tp
        comm = tp.comm
        if comm is not None:
            tp.comm = _TimedCommunicator(comm, self)

        def detach() -> None:
            for h in handles:
                h.remove()
            if comm is not None:
                tp.comm = comm

        return detach

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
    """Add one step's regions to `b`; "other" is the step's time not inside any region (never negative). Every
    all-reduce region lies inside a row-parallel linear's "gemm" region: it is taken out of it."""
    step = dict(step)
    step["gemm"] = max(step["gemm"] - step["allreduce"], 0.0)
    b.steps += 1
    b.total_ms += total_ms
    measured = 0.0
    for c in CATEGORIES[:-1]:
        b.ms[c] += step[c]
        measured += step[c]
    b.ms["other"] += max(total_ms - measured, 0.0)


class _TimedCommunicator:
    """The TP communicator with its all-reduce timed ("allreduce"); everything else passes through."""

    def __init__(self, inner, timers: Timers) -> None:
        self._inner, self._timers = inner, timers

    def all_reduce_(self, x: torch.Tensor):
        with self._timers.region("allreduce"):
            return self._inner.all_reduce_(x)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


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
