"""spanllm.perf: the analytical performance model and planner. Pure Python + numpy; no torch, no GPU.

hardware.py         cluster presets: the one table of constants, each with its source
allreduce_model.py  all-reduce schedules counted as steps and bytes per link -> alpha-beta time
model_shape.py      Llama 3.1 shapes (8B / 70B / 405B)
inference.py        prefill / decode time for TP x PP, memory per GPU
plan.py             `spanllm plan`: rank layouts x all-reduce algorithms
measurements.py     reading results/*.json (all-reduce sweeps, engine runs)
calibrate.py        `spanllm perf calibrate`: fit all-reduce constants to a sweep (--engine: engine constants)
engine_fit.py       engine rows -> the inference model; the fit of the engine constants (EngineCost)
validate.py         `spanllm perf validate`: predicted vs measured, with the error
paper_claims.py     the NVRAR paper's headline numbers as checks on the presets
transport.py        NVSHMEM remote transports (IBGDA vs CPU-proxied IBRC / UCX / libfabric): put + signal costs
uncertainty.py      ranges of predictions from the ranges of the presets' guessed constants
published.py        published multi-node all-reduce figures (published_points.json) priced with the error
"""
