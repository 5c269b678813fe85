"""spanllm: fast LLM inference across GPU nodes.

Parts: `spanllm.comm` (all-reduce library: NVRAR, baselines, selection), `spanllm.engine` (Llama
engine with TP and TP x PP), `spanllm.bench` (benchmarks), `spanllm.perf` (performance model).
"""

__version__ = "0.1.0"

# vLLM's entry points by their names (`from spanllm import LLM, SamplingParams`), imported on first use: `import
# spanllm` alone stays light (no torch)
_LAZY = {
    "LLM": "spanllm.engine.llm",
    "SamplingParams": "spanllm.engine.sampler",
    "EngineConfig": "spanllm.engine.config",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spanllm' has no attribute {name!r}")
