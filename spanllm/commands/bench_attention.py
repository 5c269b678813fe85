"""`spanllm bench attention`: the paged decode attention kernel against its reference and against the
contiguous-cache attention a non-paged engine runs (SDPA over [B, kv_heads, S, d] under a mask).

For every batch size x context length: one decode step's attention for one layer (Llama 3.1 8B heads by
default: 32 query, 8 KV heads of 128), every sequence at the full context, block tables shuffled over the
pool. Triton and contiguous are timed as 20 calls in a CUDA graph (the timing discipline of
spanllm.measure.timing); the reference (a gather + SDPA per sequence) eagerly. Each cell also reports the
largest difference of the Triton output from the reference, and the bytes of K/V read per call with
the bandwidth they imply.

    torchrun --nproc-per-node 1 -m spanllm.cli bench attention --json results/h200/paged_attention.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from spanllm.launch import DistContext, finish, launch
from spanllm.measure.timing import time_calls
from spanllm.output_files import write_json

USES_COLLECTIVES = True  # its ranks join a process group (spanllm.launch): --pg-timeout applies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,4,16,64,256", help="comma-separated sequences per step")
    parser.add_argument(
        "--context-lens", default="128,512,2048,8192", help="comma-separated cached tokens per sequence"
    )
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128, help="channels per head")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of q and the KV cache")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: the paged cache in float8_e4m3fn (the engine's --kv-cache-dtype fp8; the kernel widens each tile); "
        "the contiguous SDPA baseline stays in --dtype",
    )
    parser.add_argument("--reference-max-batch", type=int, default=64, help="time the reference up to this batch")
    parser.add_argument("--json", default=None, help="write settings, machine and every cell here")


def random_decode_inputs(
    b: int,
    n: int,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block_tables, context_lens) of one decode step: b sequences of n cached tokens in
    a pool of blocks of bs tokens, block tables shuffled over the pool (block 0 unused), seeded by (b, n). The cache
    in kv_dtype (default: dtype; float8_e4m3fn: the values in dtype, cast)."""
    per_seq = -(-n // bs)
    nb = b * per_seq + 1
    gen = torch.Generator(device=device).manual_seed(b * 100003 + n)
    k_cache = torch.randn(nb, bs, hkv, d, device=device, dtype=dtype, generator=gen).to(kv_dtype or dtype)
    v_cache = torch.randn(nb, bs, hkv, d, device=device, dtype=dtype, generator=gen).to(kv_dtype or dtype)
    tables = (torch.randperm(nb - 1, device=device, generator=gen) + 1).to(torch.int32).view(b, per_seq)
    ctx = torch.full((b,), n, dtype=torch.int32, device=device)
    q = torch.randn(b, hq, d, device=device, dtype=dtype, generator=gen)
    return q, k_cache, v_cache, tables, ctx


def _cell(b: int, n: int, args, device, dtype, kv_dtype) -> dict:
    from spanllm.attention import reference as pa
    from spanllm.kernels import paged_attention as kt

    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-n // bs)
    q, k_cache, v_cache, tables, ctx = random_decode_inputs(b, n, hq, hkv, d, bs, dtype, device, kv_dtype)
    splits = kt.num_splits_for(b, hkv, device)
    out = {"batch": b, "context": n, "num_splits": splits}
    tri = kt.decode(q, k_cache, v_cache, tables, ctx, splits)
    ref = pa.reference_decode(q, k_cache, v_cache, tables, [n] * b)
    out["max_abs_diff_vs_reference"] = float((tri.float() - ref.float()).abs().max())
    t = time_calls(lambda: kt.decode(q, k_cache, v_cache, tables, ctx, splits), graph=True, device=device, samples=10)
    out["triton_us"] = t.median_us
    kv_bytes = 2 * b * n * hkv * d * kv_dtype.itemsize
    out["kv_bytes"] = kv_bytes
    out["triton_tb_s"] = kv_bytes / (t.median_us * 1e-6) / 1e12
    # A contiguous cache [B, hkv, S, d] (a non-paged engine's), attention over the whole length under a mask.
    kc = k_cache[tables.long()].reshape(b, per_seq * bs, hkv, d)[:, :n].transpose(1, 2).to(dtype).contiguous()
    vc = v_cache[tables.long()].reshape(b, per_seq * bs, hkv, d)[:, :n].transpose(1, 2).to(dtype).contiguous()
    mask = torch.zeros(b, 1, 1, n, device=device, dtype=dtype)
    qg = q.view(b, hkv, hq // hkv, d)
    t = time_calls(
        lambda: F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask), graph=True, device=device, samples=10
    )
    out["contiguous_sdpa_us"] = t.median_us
    if b <= args.reference_max_batch:
        t = time_calls(
            lambda: pa.reference_decode(q, k_cache, v_cache, tables, [n] * b),
            device=device,
            samples=3,
            calls_per_sample=1,
            warmup=1,
        )
        out["reference_us"] = t.median_us
    return out


def _rank(ctx: DistContext, args) -> dict:
    from spanllm.commands.bench_throughput import machine_info
    from spanllm.dtypes import model_dtype as parse_dtype

    dtype = parse_dtype(args.dtype)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for n in [int(x) for x in args.context_lens.split(",")]:
            r = _cell(b, n, args, ctx.device, dtype, kv_dtype)
            rows.append(r)
            print(
                f"B={b:4d} ctx={n:5d} splits={r['num_splits']:2d} triton {r['triton_us']:8.1f} us "
                f"({r['triton_tb_s']:.2f} TB/s)  contiguous SDPA {r['contiguous_sdpa_us']:8.1f} us  reference "
                f"{r.get('reference_us', float('nan')):9.1f} us  max|diff| {r['max_abs_diff_vs_reference']:.2e}",
                flush=True,
            )
            torch.cuda.empty_cache()
    return {"rows": rows, "settings": vars(args), "machine": machine_info(ctx.device)}


def _sizes(flag: str, text: str) -> list[int]:
    from spanllm.errors import UsageError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,16,256") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,16,256")
    return sizes


def check_arguments(args: argparse.Namespace) -> None:
    """The shapes, dtypes and output file, before the GPU is asked for (and any rank starts)."""
    from spanllm import checks
    from spanllm.dtypes import model_dtype
    from spanllm.errors import UsageError

    for flag, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
        checks.at_least(flag, v, 1)
    checks.at_least("--block-size", args.block_size, 1, " (tokens per KV-cache block)")
    checks.at_least("--reference-max-batch", args.reference_max_batch, 0, " (0: never time the reference)")
    if args.heads % args.kv_heads:
        raise UsageError(
            f"--kv-heads {args.kv_heads}: must divide --heads {args.heads} (each KV head serves a group of query "
            "heads), e.g. --heads 32 --kv-heads 8"
        )
    try:
        model_dtype(args.dtype)
    except ValueError as e:
        raise UsageError(f"--dtype {args.dtype!r}: {e}") from None
    checks.output_file("--json", args.json)


def run(args: argparse.Namespace) -> int:
    from spanllm.errors import UsageError

    args.batch_sizes = ",".join(map(str, _sizes("--batch-sizes", args.batch_sizes)))
    args.context_lens = ",".join(map(str, _sizes("--context-lens", args.context_lens)))
    check_arguments(args)
    if not torch.cuda.is_available():  # before any rank starts
        raise UsageError(
            "bench attention times the Triton kernel: run it on a GPU "
            "(torchrun --nproc-per-node 1 -m spanllm.cli bench attention)"
        )
    r = launch(_rank, args)[0]
    if args.json and r is not None:
        write_json("--json", args.json, r, indent=1, default=str)
        print(f"wrote {args.json}")
    return finish(0)
