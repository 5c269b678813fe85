"""What the sampling features cost on a GPU: BatchSampler.sample on [batch, vocab] float32 logits, per call,
for plain batches (greedy; temperature 1, which takes the one-pass race; top-p, which takes the unfused ops)
and for batches where one row or every row asks for penalties, logprobs, logit_bias or min_p. The host->device
copies go through pinned staging (HostStaging), as in the engine.

Per configuration: gpu_ms (CUDA events around each call, the host waiting for each call to finish) and host_ms
(the host's own time inside sample(), measured without waiting: what an async-scheduled step spends there),
raw values and medians, into OUT/sampler_features.json with the machine, versions and settings.

    python scripts/gpu_sampler_features.py --out results/h200/sampler_features
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Req:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def configs(batch: int):
    """name -> one SamplingParams per row."""
    from spanllm.engine.sampler import SamplingParams

    t1 = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    pen = SamplingParams(
        temperature=1.0,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        repetition_penalty=1.1,
    )
    lp20 = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=20)
    bias = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logit_bias={t: 1.0 for t in range(100, 110)})
    min_p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, min_p=0.05)
    every = SamplingParams(
        temperature=1.0,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logprobs=20,
        logit_bias={t: 1.0 for t in range(100, 110)},
        min_p=0.05,
    )
    one = lambda p: [p] + [t1] * (batch - 1)  # noqa: E731
    return {
        "greedy": [SamplingParams(max_tokens=16, ignore_eos=True)] * batch,
        "temperature_1": [t1] * batch,
        "top_p_0.9": [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)] * batch,
        "one_row_penalties": one(pen),
        "all_rows_penalties": [pen] * batch,
        "one_row_logprobs_20": one(lp20),
        "all_rows_logprobs_20": [lp20] * batch,
        "all_rows_logit_bias_10": [bias] * batch,
        "all_rows_min_p": [min_p] * batch,
        "all_rows_everything": [every] * batch,
    }


def measure(params, vocab: int, prompt_len: int, replays: int, device: torch.device) -> dict:
    from spanllm.engine.sampler import BatchSampler
    from spanllm.engine.worker.host_staging import HostStaging

    batch = len(params)
    staging = HostStaging(device, 8 << 20)
    sampler = BatchSampler(device, 0, to_device=staging.tensor)
    g = torch.Generator().manual_seed(0)
    reqs = [Req(f"r{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist()) for i in range(batch)]
    logits = torch.randn(batch, vocab, device=device)
    gpu_ms, host_ms = [], []
    for i in range(5 + replays):
        x = logits.clone()
        staging.begin_step()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        out = sampler.sample(x, params, [()] * batch, [None] * batch, reqs)
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        if out.logprobs is not None:
            out.logprobs.to_host()
        if i >= 5:
            gpu_ms.append(a.elapsed_time(b))
            host_ms.append((t1 - t0) * 1e3)
    return {
        "batch": batch,
        "gpu_ms_median": float(np.median(gpu_ms)),
        "host_ms_median": float(np.median(host_ms)),
        "gpu_ms": gpu_ms,
        "host_ms": host_ms,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results folder (created) for sampler_features.json")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default: Llama 3's)")
    ap.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes (default: 1,64,256)")
    ap.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens per request (repetition penalty)")
    ap.add_argument("--replays", type=int, default=50, help="timed calls per configuration (default: 50)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            f"gpu_sampler_features.py times CUDA kernels: this machine has no CUDA GPU (torch {torch.__version__})"
        )
    from spanllm.measure.report import machine_info, versions

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, params in configs(batch).items():
            r = {"config": name, **measure(params, args.vocab, args.prompt_len, args.replays, device)}
            print(f"batch {batch:4d} {name:24s} gpu {r['gpu_ms_median']:8.3f} ms  host {r['host_ms_median']:8.3f} ms")
            rows.append(r)
    result = {"machine": machine_info(), "versions": versions(), "settings": vars(args), "results": rows}
    path = os.path.join(args.out, "sampler_features.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
