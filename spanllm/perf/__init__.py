"""spanllm.perf: the analytical performance model and planners. Plain functions over numbers (numpy); the
serving replay imports the engine's scheduler (spanllm.engine.core). The commands live in spanllm/commands/
(plan.py, perf_calibrate.py, perf_validate.py).

hardware.py         cluster presets: the one table of constants, each with its source
allreduce_model.py  all-reduce schedules counted as steps and bytes per link -> alpha-beta time
model_shape.py      the sizes perf needs, counted from spanllm.model.config.ModelConfig (Llama 3.1 presets)
inference.py        prefill / decode time of a static batch for TP x PP, memory per GPU
plan.py             rank static-batch layouts x all-reduce algorithms (`spanllm plan`)
step_cost.py        what one serving step costs (H200-measured efficiencies, overheads fitted to a step trace)
serving.py          the scheduler replayed in simulated time on a trace; serving layouts (`spanllm plan --serve`)
roofline.py         the roofline bound of each replayed step (scripts/throughput_bound.py)
measurements.py     reading results/*.json (all-reduce sweeps, engine runs)
calibrate.py        fit all-reduce constants to a sweep (ranges widened to hold the fit)
engine_fit.py       engine rows -> the inference model; the fit of the engine constants (EngineCost)
validate.py         predicted vs measured, with the error
paper_claims.py     the NVRAR paper's headline numbers as checks on the presets
transport.py        NVSHMEM remote transports (IBGDA vs CPU-proxied IBRC / UCX / libfabric): put + signal costs
uncertainty.py      ranges of predictions from the ranges of the presets' guessed constants
published.py        published multi-node all-reduce figures (published_points.json): preset and leave-one-source-out
"""
