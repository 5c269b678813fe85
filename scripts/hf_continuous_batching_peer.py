"""The peer for `spanllm bench throughput` on the GPU machine: Hugging Face transformers' own continuous
batching (paged cache, `init_continuous_batching`), on the same requests (vLLM's ShareGPT sample, the same
seed, the same per-request output lengths), with random bf16 weights of the same Llama 3.1 preset shape.

    python scripts/hf_continuous_batching_peer.py --model llama3.1-8b --num-prompts 1000 --json out.json

Every request: sampling at temperature 1.0 (top-k off, top-p 1.0, as spanllm's run), max_new_tokens = its
output length, no EOS (eos_token_id unset). The timed region is from the first add_request to the last result.
Which attention implementation ran is recorded (the first of --attn-impls that loads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from spanllm.commands.bench_throughput import machine_info  # noqa: E402
from spanllm.commands.dataset_args import add_dataset_arguments, get_samples  # noqa: E402
from spanllm.engine.tokenizer import get_tokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_checkpoint import init_random_, llama_config  # noqa: E402  (the same config and weights)


def hf_model(name: str, attn: str, device: torch.device):
    from transformers import LlamaForCausalLM

    cfg = llama_config(name, attn_implementation=attn)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    init_random_(model, 0, device)
    # Non-persistent buffers (rotary inv_freq) were left empty by to_empty: rebuild them.
    for m in model.modules():
        if hasattr(m, "rope_init_fn") and hasattr(m, "inv_freq"):
            inv, _ = m.rope_init_fn(m.config, device)
            m.inv_freq = inv
            m.original_inv_freq = inv
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--attn-impls", default="paged|sdpa,sdpa_paged,paged_attention")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="ContinuousBatchingConfig max_batch_tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline-s", type=float, default=200.0, help="stop waiting after this long (partial result)")
    ap.add_argument("--samples-file", default=None, help="requests saved by bench throughput --save-samples")
    add_dataset_arguments(ap)
    args = ap.parse_args()
    import transformers
    from transformers import GenerationConfig

    device = torch.device("cuda")
    tok = get_tokenizer(args.model)
    if args.samples_file:
        from spanllm.bench.sample_file import load_samples

        samples = load_samples(args.samples_file)
    else:
        samples = get_samples(args, tok)
    inputs = [tok.encode(r.prompt) for r in samples]
    errors, model, attn = {}, None, None
    for impl in args.attn_impls.split(","):
        try:
            model = hf_model(args.model, impl, device)
            attn = impl
            break
        except Exception as e:  # noqa: BLE001 - record why each implementation did not load
            errors[impl] = f"{type(e).__name__}: {e}"[:300]
    if model is None:
        print(f"no attention implementation loaded: {errors}", file=sys.stderr)
        return 1
    gc = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max(r.output_len for r in samples),
        eos_token_id=None,
        pad_token_id=0,
    )
    kwargs = {}
    if args.max_batch_tokens:
        gc.max_batch_tokens = args.max_batch_tokens
    manager = model.init_continuous_batching(generation_config=gc, **kwargs)
    manager.start()
    out_tokens, done, progress = 0, 0, []
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, (ids, r) in enumerate(zip(inputs, samples)):
            manager.add_request(input_ids=ids, request_id=f"r{i}", max_new_tokens=r.output_len)
        deadline = t0 + args.deadline_s
        last_print = t0
        while done < len(inputs) and time.perf_counter() < deadline:
            res = manager.get_result(timeout=5)
            now = time.perf_counter()
            if res is not None:
                done += 1
                out_tokens += len(res.generated_tokens)
            if now - last_print > 15:
                progress.append({"t_s": round(now - t0, 1), "completed": done, "output_tokens": out_tokens})
                print(f"  {now - t0:.0f} s: {done} requests done, {out_tokens} output tokens", flush=True)
                last_print = now
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=False)
    prompt_tokens = sum(len(i) for i in inputs)
    complete = done == len(inputs)
    result = {
        "peer": "transformers continuous batching (init_continuous_batching)",
        "attn_implementation": attn,
        "complete": complete,
        "deadline_s": args.deadline_s,
        "progress": progress,
        "note": None
        if complete
        else (
            f"cut at the {args.deadline_s} s deadline: output_tokens_per_second counts "
            "the tokens of completed requests only (a lower bound)"
        ),
        "attn_errors": errors,
        "transformers": transformers.__version__,
        "completed": done,
        "num_requests": len(inputs),
        "elapsed_time": elapsed,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(r.output_len for r in samples),
        "output_tokens_per_second": out_tokens / elapsed,
        "requests_per_second": done / elapsed,
        "tokens_per_second": (prompt_tokens + out_tokens) / elapsed,
        "dataset": samples.info,
        "machine": machine_info(device),
        "settings": vars(args),
    }
    print(
        f"transformers CB ({attn}): {done}/{len(inputs)} requests, {out_tokens} output tokens in {elapsed:.1f} s: "
        f"{out_tokens / elapsed:.0f} output tok/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # the manager's threads must not keep a GPU lease waiting
