"""The NVRAR kernel's optional phase trace: record layout and its summary (pure, no torch or triton).

With `NvrarAllReduce(trace=True)` every program of a call writes one record of TRACE_WORDS int64s:

    [globaltimer at start (ns), globaltimer at end (ns), total %clock64 cycles, then cycles spent in
     rs_push, rs_wait, inter_send, inter_wait, ag_push, ag_wait]

summed over the program's tiles. "push"/"send" is the time to issue the stores or the NVSHMEM put,
"wait" the time spinning until the peer's tile is there (the peer's skew + the link's latency + its
bandwidth). %clock64 counts SM cycles; the summary converts with the rate implied by all records
together (sum of cycles over sum of globaltimer spans), which is exact enough for microsecond phases
even though %globaltimer itself ticks coarsely on some GPUs.
"""

from __future__ import annotations

import statistics

TRACE_PHASES = ("rs_push", "rs_wait", "inter_send", "inter_wait", "ag_push", "ag_wait")
TRACE_WORDS = 3 + len(TRACE_PHASES)


def summarize(calls: list[list[list[int]]]) -> dict:
    """calls[k][p] = the record of program p in call k -> per-phase medians (over programs and calls) in us,
    the median program time, the median kernel span (first program start to last program end) and the
    clock rate used. Programs that did no work (all zero) are left out."""
    records = [r for call in calls for r in call if any(r)]
    if not records:
        raise ValueError("no trace records: was the communicator built with trace=True and did a call run?")
    for r in records:
        if len(r) != TRACE_WORDS:
            raise ValueError(f"trace record has {len(r)} words, expected {TRACE_WORDS}")
    span_ns = sum(r[1] - r[0] for r in records)
    cycles = sum(r[2] for r in records)
    if span_ns <= 0 or cycles <= 0:
        raise ValueError(f"trace records span {span_ns} ns and {cycles} cycles: cannot derive a clock rate")
    ghz = cycles / span_ns  # cycles per ns
    to_us = lambda c: c / ghz / 1e3
    spans = [
        (max(r[1] for r in call if any(r)) - min(r[0] for r in call if any(r))) / 1e3
        for call in calls
        if any(any(r) for r in call)
    ]
    return {
        "clock_ghz": ghz,
        "programs": len(records) // max(len(spans), 1),
        "calls": len(spans),
        "program_us": statistics.median(to_us(r[2]) for r in records),
        "kernel_span_us": statistics.median(spans),
        "phases_us": {name: statistics.median(to_us(r[3 + i]) for r in records) for i, name in enumerate(TRACE_PHASES)},
    }
