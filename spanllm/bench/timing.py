"""Moved to `spanllm.measure.timing` (used by the tuner as well as the benchmarks); this name stays for
the modules that import it from here."""

from spanllm.measure.timing import SPIN_CYCLES, Timing, time_calls

__all__ = ["SPIN_CYCLES", "Timing", "time_calls"]
