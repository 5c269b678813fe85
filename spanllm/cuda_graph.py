"""CUDA-graph capture, once: the comm library's conformance cases, the timing discipline, the benchmarks.

Capture runs on a side stream (torch's recommendation: the capture must not share a stream with work that
is already queued), after `warmup` eager calls on that same stream, so per-stream state that a first call
creates (cuBLAS workspaces, lazily compiled kernels, communicator buffers) exists before the capture
starts. The current stream then waits for the side stream: `graph.replay()` may follow at once.
Nothing here runs at import time, and it imports nothing of spanllm (any package may use it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture. It matters for memory: the caching allocator reuses a
    freed block only on the stream that allocated it, so graphs sharing a pool but captured on fresh streams
    could not reuse each other's freed intermediates (each kept its own peak: 15.7 GiB for the serving
    engine's ~120 graphs at max_num_seqs 1024), and each warm-up left its memory cached on its own stream."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def capture_graph(
    fn: Callable[[], object],
    device: torch.device | str | None = None,
    *,
    warmup: int = 0,
    pool=None,
    after_warmup: Callable[[], object] | None = None,
    before_capture: Callable[[torch.cuda.CUDAGraph], object] | None = None,
) -> torch.cuda.CUDAGraph:
    """Record `fn()` (any number of kernels) into a new CUDA graph and return it.

    The graph reads and writes the tensors `fn` touched at capture, at the same addresses: change inputs
    in place (`x.copy_(...)`) before `replay()`, never rebind them. The caller owns the graph; `del` it
    before freeing what it captured (a communicator's buffers). `pool` (torch.cuda.graph_pool_handle()) lets
    graphs that never run at the same time share their memory. `after_warmup()` runs after each warm-up call
    (to restore state a call advanced); `before_capture(graph)` runs once before the capture (to register a
    random generator with the graph)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
            if after_warmup is not None:
                after_warmup()
        if before_capture is not None:
            before_capture(graph)
        with torch.cuda.graph(graph, stream=stream, pool=pool):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph
