"""`spanllm bench throughput --model smollm2-135m-instruct` on this CPU against transformers on the same requests.

    python scripts/cpu_smollm2_throughput.py --out results/cpu_smollm2 --num-prompts 32 --output-len 64

1. samples ShareGPT requests once (vLLM's sampling, spanllm's GGUF tokenizer), saved to OUT/samples.json;
2. spanllm: `spanllm bench throughput --samples-file OUT/samples.json --json OUT/spanllm.json` (TP=1, float32,
   the serving engine: continuous batching over the paged KV cache);
3. transformers: the same GGUF file through `from_pretrained(folder, gguf_file=...)`, float32, `generate` on
   batches of --hf-batch requests (left-padded), each request its own output length (min_new_tokens =
   max_new_tokens = the request's, grouped by length so no request generates past it), sampling at temperature
   1.0 like spanllm's run; OUT/transformers.json.
Both count the requested output tokens; each JSON records the machine, versions, settings and raw timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from spanllm.bench.sample_file import load_samples, save_samples  # noqa: E402
from spanllm.commands.bench_throughput import machine_info  # noqa: E402
from spanllm.commands.dataset_args import get_samples  # noqa: E402
from spanllm.engine.tokenizer import get_tokenizer  # noqa: E402
from spanllm.model.config import resolve_model  # noqa: E402

MODEL = "smollm2-135m-instruct"


def sample(args, path: str) -> None:
    ns = argparse.Namespace(
        dataset_name="sharegpt",
        dataset_path=None,
        num_prompts=args.num_prompts,
        seed=0,
        no_oversample=False,
        sharegpt_output_len=args.output_len,
        output_len=args.output_len,
        input_len=None,
        random_input_len=1024,
        random_output_len=128,
        random_range_ratio=0.0,
        random_prefix_len=0,
    )
    save_samples(get_samples(ns, get_tokenizer(MODEL)), path)


def run_spanllm(args, samples: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "spanllm.cli", "bench", "throughput", "--model", MODEL, "--dtype", "float32"]
    cmd += ["--samples-file", samples, "--num-prompts", str(args.num_prompts), "--json", out]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return json.load(f)


@torch.no_grad()
def run_transformers(args, samples_path: str, out: str) -> dict:
    import transformers

    path = resolve_model(MODEL).checkpoint_dir
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    spl_tok = get_tokenizer(MODEL)
    samples = load_samples(samples_path)
    reqs = [(spl_tok.encode(r.prompt), r.output_len) for r in samples]
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i][1], len(reqs[i][0])))
    batches = [order[i : i + args.hf_batch] for i in range(0, len(order), args.hf_batch)]
    # Same output length inside a batch (sorted by it) so min_new_tokens = max_new_tokens fits every request.
    batches = [b2 for b in batches for b2 in _split_by_len(b, reqs)]
    torch.manual_seed(0)
    out_tokens, prompt_tokens, per_batch = 0, 0, []
    t0 = time.perf_counter()
    for b in batches:
        ids = [reqs[i][0] for i in b]
        n = reqs[b[0]][1]
        width = max(map(len, ids))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        tb = time.perf_counter()
        g = model.generate(
            x, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
            max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
        )  # fmt: skip
        assert g.shape[1] - width == n
        per_batch.append({"requests": len(b), "output_len": n, "prompt_width": width, "s": time.perf_counter() - tb})
        out_tokens += n * len(b)
        prompt_tokens += sum(map(len, ids))
    elapsed = time.perf_counter() - t0
    result = {
        "peer": "transformers generate, batches of equal output length",
        "transformers": transformers.__version__,
        "num_requests": len(reqs),
        "elapsed_time": elapsed,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "output_tokens_per_second": out_tokens / elapsed,
        "requests_per_second": len(reqs) / elapsed,
        "tokens_per_second": (prompt_tokens + out_tokens) / elapsed,
        "batches": per_batch,
        "torch_threads": torch.get_num_threads(),
        "machine": machine_info(torch.device("cpu")),
        "settings": vars(args),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def _split_by_len(batch: list[int], reqs) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in batch:
        groups.setdefault(reqs[i][1], []).append(i)
    return list(groups.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results folder (samples.json, spanllm.json, transformers.json)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64, help="output tokens of every request (ShareGPT prompts)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="spanllm's sequences per step")
    ap.add_argument("--hf-batch", type=int, default=8, help="transformers' generate batch size")
    ap.add_argument("--only", choices=("spanllm", "transformers"), default=None, help="run one side only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    samples = os.path.join(args.out, "samples.json")
    if not os.path.isfile(samples):
        sample(args, samples)
    res = {}
    if args.only in (None, "spanllm"):
        res["spanllm"] = run_spanllm(args, samples, os.path.join(args.out, "spanllm.json"))
    if args.only in (None, "transformers"):
        res["transformers"] = run_transformers(args, samples, os.path.join(args.out, "transformers.json"))
    for k, r in res.items():
        print(
            f"{k}: {r['num_requests']} requests, {r['total_input_tokens']} prompt + {r['total_output_tokens']} output "
            f"tokens in {r['elapsed_time']:.1f} s: {r['output_tokens_per_second']:.1f} output tok/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
