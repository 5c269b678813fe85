"""spanllm: fast LLM inference across GPU nodes.

Parts: `spanllm.comm` (all-reduce library: NVRAR, baselines, selection), `spanllm.engine` (Llama
engine with TP and TP x PP), `spanllm.bench` (benchmarks), `spanllm.perf` (performance model).
"""

__version__ = "0.1.0"
