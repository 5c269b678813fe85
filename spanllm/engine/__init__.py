"""Llama-family inference engine: tensor parallelism, TP x PP pipelines, KV cache, CUDA-graph decode, timers.

Entry point: `spanllm.engine.llm.LLM`; configuration: `spanllm.model.config` (ModelConfig, presets,
EngineConfig) and `spanllm.model.parallel_dims.ParallelDims`. Import the submodules directly; this
package imports nothing at load time.
"""
