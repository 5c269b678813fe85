"""Moved to `spanllm.measure.report` (used by the tuner as well as the benchmarks); this name stays for
the modules and scripts that import it from here."""

from spanllm.measure.report import algbw_GBps, allreduce_busbw_GBps, machine_info, versions, write_json

__all__ = ["algbw_GBps", "allreduce_busbw_GBps", "machine_info", "versions", "write_json"]
