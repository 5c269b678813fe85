"""Measurement helpers shared by the library's tuner and the benchmarks: one timing discipline
(`timing.time_calls`), the bandwidth definitions and what every result file carries (`report`).

Neutral ground: it imports nothing of spanllm but `spanllm.cuda_graph`, so `comm`, `engine` and `bench` can all use it.
"""
