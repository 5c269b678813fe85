"""CUDA-graph capture, once: the comm library's conformance cases, the timing discipline, the benchmarks.

Capture runs on a side stream (torch's recommendation: the capture must not share a stream with work that
is already queued), after `warmup` eager calls on that same stream, so per-stream state that a first call
creates (cuBLAS workspaces, lazily compiled kernels, communicator buffers) exists before the capture
starts. The current stream then waits for the side stream: `graph.replay()` may follow at once.
Nothing here runs at import time, and it imports nothing of spanllm (any package may use it).
"""

from __future__ import annotations

from typing import Callable

import torch


def capture_graph(fn: Callable[[], object], device: torch.device | str | None = None, *,
                  warmup: int = 0, pool=None) -> "torch.cuda.CUDAGraph":
    """Record `fn()` (any number of kernels) into a new CUDA graph and return it.

    The graph reads and writes the tensors `fn` touched at capture, at the same addresses: change inputs
    in place (`x.copy_(...)`) before `replay()`, never rebind them. The caller owns the graph; `del` it
    before freeing what it captured (a communicator's buffers). `pool` (torch.cuda.graph_pool_handle()) lets
    graphs that never run at the same time share their memory."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph
