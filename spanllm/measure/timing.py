"""One timing discipline for the CLI, the tuner and the benchmarks.

Warm up; then per sample: reset the input, barrier, time K back-to-back calls, divide by K. On GPU the
K calls are captured once in a CUDA graph (graph mode, the default) or launched eagerly, and timed
with CUDA events; on CPU with perf_counter. Each sample's time is the maximum over ranks (the
collective is as slow as its slowest member); the report is the median and the 99th percentile
over samples. Successive calls on one stream cannot overlap for any of our backends (each waits for
its inputs), so K calls in a graph divided by K is an honest per-call latency.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from spanllm.cuda_graph import capture_graph

SPIN_CYCLES = 100_000  # about 50 us at H200 clocks: longer than the host needs to enqueue a graph replay


@dataclass(frozen=True)
class Timing:
    median_us: float
    p99_us: float
    samples_us: list[float]

    @classmethod
    def from_samples(cls, samples_us: list[float]) -> Timing:
        a = np.asarray(samples_us, dtype=np.float64)
        return cls(float(np.median(a)), float(np.percentile(a, 99)), [float(v) for v in a])


def _max_over_ranks(values: list[float], group, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def time_calls(
    fn: Callable[[], None],
    *,
    reset: Callable[[], None] | None = None,
    samples: int = 20,
    warmup: int = 5,
    calls_per_sample: int = 20,
    graph: bool = False,
    group=None,
    device: torch.device | None = None,
) -> Timing:
    """Per-call time of `fn` (one collective call), max over the ranks of `group`."""
    device = device or torch.device("cpu")
    reset = reset or (lambda: None)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        reset()
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    K = max(1, calls_per_sample)
    graph_obj = None
    if cuda and graph:
        graph_obj = capture_graph(lambda: [fn() for _ in range(K)], device)
        torch.cuda.synchronize(device)
    out = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
        for start, end in events:
            reset()
            dist.barrier(group=group)
            # The barrier leaves the stream idle; a short device spin keeps it busy while the host enqueues
            # the replay, so the launch latency of the graph is not counted inside the sample.
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            if graph_obj is not None:
                graph_obj.replay()
            else:
                for _ in range(K):
                    fn()
            end.record()
        torch.cuda.synchronize(device)
        out = [s.elapsed_time(e) * 1e3 / K for s, e in events]
    else:
        for _ in range(samples):
            reset()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(K):
                fn()
            out.append((time.perf_counter() - t0) * 1e6 / K)
    del graph_obj
    return Timing.from_samples(_max_over_ranks(out, group, device))


def graph_us_per_call(
    fn: Callable[[int], object], calls: int, replays: int = 15, warmup_replays: int = 3
) -> list[float]:
    """One GPU, no group: per-replay microseconds per call of one CUDA graph that runs fn(0), ..., fn(calls - 1)
    back to back (a kernel benchmark walking its weights: a set larger than L2 is read from HBM each call).
    fn(0) runs once before the capture (compiles and autotunes there), the capture warms its stream once."""
    fn(0)
    torch.cuda.synchronize()
    g = capture_graph(lambda: [fn(i) for i in range(calls)], warmup=1)
    for _ in range(warmup_replays):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    del g
    return [a.elapsed_time(b) * 1e3 / calls for a, b in ev]
