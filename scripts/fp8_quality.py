"""FP8's quality on the real model, CPU: SmolLM2-135M-Instruct scored on a fixed text in bf16 and with FP8 weights,
with an FP8 KV cache (--kv-cache-dtype fp8, bf16 weights), and, as the yardstick, float32 against bf16 (what bf16
itself changes). Writes OUT (default results/cpu_smollm2/fp8_quality.json).

    PYTHONPATH=. python scripts/fp8_quality.py [OUT]
"""

from __future__ import annotations

import json
import platform
import sys
import time

import torch

from spanllm.bench.quantization_quality import compare

MODEL = "smollm2-135m-instruct"


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "results/cpu_smollm2/fp8_quality.json"
    t0 = time.time()
    fp8 = compare(MODEL, "fp8", torch.bfloat16)
    print("fp8 vs bf16:", json.dumps(fp8["shapes"], indent=1), flush=True)
    fp8_kv = compare(MODEL, None, torch.bfloat16, kv_cache_dtype="fp8")
    print("fp8 KV cache vs bf16:", json.dumps(fp8_kv["shapes"], indent=1), flush=True)
    yardstick = compare(MODEL, None, torch.bfloat16, base_dtype=torch.float32)
    print("bf16 vs fp32:", json.dumps(yardstick["shapes"], indent=1), flush=True)
    doc = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "fp8_vs_bf16": fp8,
        "fp8_kv_vs_bf16": fp8_kv,
        "bf16_vs_fp32": yardstick,
        "seconds": round(time.time() - t0, 1),
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
