"""The model and engine options every command that builds an engine shares (generate, serve, bench throughput,
bench batch / study), their checks before any rank starts, and the one way those commands build their LLM."""

from __future__ import annotations

import argparse

import torch

from spanllm import checks
from spanllm.attention.cascade import CASCADE_DTYPES, DEFAULT_CASCADE_MIN_PREFIX, resolve_prefill_attention
from spanllm.attention.shared_prefix import SHARED_PREFIX_ATTENTION
from spanllm.engine.config import (
    ATTENTION_BACKENDS,
    DECODE_GEMMS,
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    PREFILL_ATTENTION,
    QUANTIZATIONS,
)
from spanllm.engine.core.scheduler import DEFAULT_LONG_PREFILL_ATTENTION_BUDGET, SCHEDULING_POLICIES
from spanllm.errors import UsageError
from spanllm.kernels.pdl import PDL_MODES
from spanllm.launch import launcher_world_size
from spanllm.layers.fp8 import MIN_FP8_CAPABILITY

TP_FLAGS = ("--tp", "--tensor-parallel-size", "-tp")  # vLLM's spellings as aliases
MODEL_HELP = (
    "preset (tiny, llama3.1-8b, llama3.1-70b, llama3.1-405b, NAME:layers=N, smollm2-135m-instruct), "
    "HF checkpoint dir or .gguf file"
)


def add_model_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The model, its dtype and weights, the ranks that run it. positional=True: the model may also come first,
    as in vLLM's `serve MODEL` (model_from_args reconciles the two)."""
    if positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=f"{MODEL_HELP}; or --model")
    parser.add_argument("--model", required=not positional, default=None, help=MODEL_HELP)
    parser.add_argument(
        "--dtype", default="auto", help="bfloat16 | float16 | float32 | auto (bf16 on GPU, fp32 on CPU)"
    )
    parser.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the decoder layers' linear weights quantized at load to float8_e4m3fn with per-channel scales, "
        "activations per token past 16 rows (W8A8 on FP8 tensor cores; W8A16 below, and up to 128 rows where the "
        "measured table says it is faster); embedding and LM head stay "
        "in --dtype. Default: none (weights in --dtype)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random-weight and sampling seed")
    parser.add_argument("--nprocs", type=int, default=1, help="local CPU ranks over gloo (ignored under torchrun)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks per (virtual) node; default LOCAL_WORLD_SIZE"
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly on GPU")
    parser.add_argument(
        "--decode-gemm",
        choices=DECODE_GEMMS,
        default="auto",
        help="weight GEMMs of <= 16 rows (decode): 'torch' = F.linear (cuBLAS), 'skinny' = spanllm's Triton stream "
        "over the weights (GPU + Triton), 'auto' = skinny where its measured table says it is faster, else F.linear",
    )
    parser.add_argument(
        "--pdl",
        choices=PDL_MODES,
        default="auto",
        help="programmatic dependent launch of the forward's Triton kernels (each may start while the one before "
        "it finishes): auto = on where supported (GPU of compute capability >= 9.0), on (refused elsewhere), off",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens one sequence may hold, prompt + generated (default: the model's max_position_embeddings; "
        "more only with SPANLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """The KV cache and the scheduler's limits; with serving=True also the serving loop's own options and the
    parallel layout of a serving engine (TP only)."""
    g = parser.add_argument_group("engine")
    seqs = "sequences per step (largest decode graph bucket)"
    if not serving:  # generate: one fixed batch, never split
        seqs += "; the prompts run as one fixed batch, so at least their number"
    g.add_argument("--max-num-seqs", type=int, default=256, help=seqs)
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokens per step (decodes + prefill chunks)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto = the model dtype; fp8 = float8_e4m3fn (K and V as e4m3 values with scale 1, saturating at +-448, "
        "vLLM's default without KV scales): twice the tokens in the same memory, half the bytes a decode reads. "
        "Needs a GPU with FP8 (compute capability 8.9+) or the CPU",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory for weights, activations and the KV cache (default 0.9; GPU only: on CPU "
        "--num-kv-blocks sizes the cache)",
    )
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks (overrides the memory sizing)")
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="triton on CUDA (auto), torch = the reference (gather + SDPA)",
    )
    g.add_argument(
        "--shared-prefix-attention",
        choices=SHARED_PREFIX_ATTENTION,
        default="auto",
        help="decodes that share cached prompt blocks (prefix caching) read those keys once per group, not once "
        "per sequence: auto = on with the triton attention backend (the only one that has it)",
    )
    g.add_argument(
        "--prefill-tiling",
        default=None,
        metavar="JSON",
        help="the Triton prefill attention kernel's tiling: a PrefillConfig JSON such as the "
        "best_prefill_config.json of scripts/gpu_prefill_attention.py (default: the kernel's own)",
    )
    g.add_argument(
        "--prefill-attention",
        choices=PREFILL_ATTENTION,
        default="auto",
        help="prefill chunks with a long cached prefix (EngineConfig.cascade_min_prefix keys): the Triton kernel, "
        "or a cascade of torch's cuDNN / flash attention over the gathered prefix merged with the chunk's causal "
        "part (in steps without decodes, eagerly; triton backend only); auto: cudnn-cascade on a Hopper GPU, "
        "else triton",
    )
    g.add_argument(
        "--cascade-min-prefix",
        type=int,
        default=None,
        metavar="KEYS",
        help="with a cascade --prefill-attention: the cached keys a chunk needs before it runs the cascade "
        f"(default {DEFAULT_CASCADE_MIN_PREFIX}; 0: every chunk, a prompt's first included)",
    )
    if not serving:
        return
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of prompt prefixes already computed (vLLM's automatic prefix caching)",
    )
    g.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="admission order: fcfs (arrival order), or prefix (longest-prefix-match: requests whose prompt's first "
        "512+ tokens are cached are admitted first, their whole family together, so that their decodes share the "
        "cached blocks; the oldest request goes first once max-num-seqs admissions have overtaken it; needs prefix "
        "caching)",
    )
    g.add_argument(
        "--min-admit",
        type=int,
        default=1,
        help="admission batching: while decoding, admit only once this many slots are free (1 = off)",
    )
    g.add_argument(
        "--long-prefill-attention-budget",
        type=int,
        default=DEFAULT_LONG_PREFILL_ATTENTION_BUDGET,
        metavar="PAIRS",
        help="while decodes run, the query-key pairs a step's prefill chunks may attend, so that a long prompt "
        "does not stall them (0 = no limit)",
    )
    g.add_argument(
        "--prefill-tokens-beside-decodes",
        type=int,
        default=None,
        metavar="N",
        help="while decodes run, the tokens a step's prefill chunks may take together, so that a long prompt "
        "delays the streams by one short step at a time (default: auto, 256 on CPU, no limit on a GPU; 0 = no limit)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="the tokens one prompt's prefill chunk may take in any step (vLLM's flag), so that a long prompt runs "
        "in short steps that admit new requests beside it (default: auto, 256 on CPU, no limit on a GPU; 0 = no limit)",
    )
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="the host waits for each step's tokens before planning the next (default: it plans the next "
        "while the GPU runs, on a GPU at TP=1)",
    )
    g.add_argument(
        *TP_FLAGS, dest="tp", type=int, default=None, help="tensor-parallel degree (default: the world size)"
    )
    g.add_argument("--allreduce", default=None, help="registered all-reduce (default: nccl on GPU, gloo on CPU)")


def model_from_args(args: argparse.Namespace, command: str) -> None:
    """`COMMAND MODEL` or `--model MODEL` (add_model_arguments(positional=True)): one of them, or both alike."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise UsageError(f"the model is given twice, {tag!r} and --model {args.model!r}: give one of them")
    args.model = args.model or tag
    if args.model is None:
        raise UsageError(f"no model: give one, `{command} MODEL` or `{command} --model MODEL` (e.g. tiny)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from spanllm.dtypes import model_dtype

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return model_dtype(name)


def check_seed(seed: int, cfg) -> None:
    """--seed of an engine: the sampler's generator takes an int64; a preset's random weights (no checkpoint) draw
    from a generator seeded by it (spanllm.model.loader.check_random_init_seed)."""
    from spanllm.engine.sampler import INT64_MAX, INT64_MIN
    from spanllm.model.loader import check_random_init_seed

    if not INT64_MIN <= seed <= INT64_MAX:
        raise UsageError(f"--seed {seed}: give an integer in [{INT64_MIN}, {INT64_MAX}] (int64), e.g. --seed 0")
    if cfg.checkpoint_dir is None:
        check_random_init_seed(seed, cfg.name, "--seed ")


def check_model_arguments(args: argparse.Namespace, world: int):
    """The model options, before any rank starts; returns (ModelConfig, Topology, device type)."""
    device = checks.device_type(world)
    checks.engine_dtype(args.dtype)
    cfg = checks.model(args.model)
    check_seed(args.seed, cfg)
    topo = checks.topology(world, args.ranks_per_node)
    checks.decode_gemm(args.decode_gemm, device)
    checks.pdl(args.pdl, device)
    limit = checks.context_limit(cfg, args.max_model_len)
    block = getattr(args, "block_size", None)
    if block is not None and block > max(limit, 16):
        raise UsageError(
            f"--block-size {block}: one KV block would hold more than a sequence's whole context ({limit} tokens); "
            f"give at most {max(limit, 16)} (16 is the usual size)"
        )
    return cfg, topo, device


def check_engine_arguments(args: argparse.Namespace, *, serving: bool = True):
    """The engine's flags, before any rank starts (EngineConfig repeats the rules for API users); for a serving
    engine (TP only) also the model and the heads its TP degree must divide, and returns its ModelConfig."""
    for flag in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        checks.at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    if hasattr(args, "min_admit"):
        checks.at_least("--min-admit", args.min_admit, 1)
    if hasattr(args, "long_prefill_attention_budget"):
        checks.at_least("--long-prefill-attention-budget", args.long_prefill_attention_budget, 0, " (0: no limit)")
    if getattr(args, "prefill_tokens_beside_decodes", None) is not None:
        checks.at_least("--prefill-tokens-beside-decodes", args.prefill_tokens_beside_decodes, 0, " (0: no limit)")
    if getattr(args, "long_prefill_token_threshold", None) is not None:
        checks.at_least("--long-prefill-token-threshold", args.long_prefill_token_threshold, 0, " (0: no limit)")
    checks.at_least("--num-kv-blocks", args.num_kv_blocks, 2, " (block 0 is reserved)")
    if getattr(args, "scheduling_policy", "fcfs") == "prefix" and not getattr(args, "enable_prefix_caching", True):
        raise UsageError(
            "--scheduling-policy prefix admits requests that share a cached prompt prefix together; it needs prefix "
            "caching: drop --no-enable-prefix-caching, or use --scheduling-policy fcfs"
        )
    # where the ranks compute (local spawned ranks are CPU even on a GPU machine): the Triton-only options below
    # are judged by it, never by whether this process sees a GPU
    world = checks.world_size(args.nprocs)
    device = checks.device_type(world)
    if getattr(args, "allreduce", None) is not None:
        checks.not_empty(
            "--allreduce",
            args.allreduce,
            "give a registered all-reduce name (e.g. gloo on CPU ranks), or leave it out for the default",
        )
        checks.allreduce_names([args.allreduce], device, world=world)
    where = "a GPU" if device == "cuda" else "CPU ranks"
    no_triton = args.attention_backend == "torch" or checks.no_triton_gpu(device) is not None
    cascade = getattr(args, "prefill_attention", "auto")
    if cascade not in ("auto", "triton") and no_triton:
        raise UsageError(
            f"--prefill-attention {cascade} is an option of the triton attention backend, but this run uses "
            f"--attention-backend {args.attention_backend} on {where}; leave --prefill-attention auto (the default)"
        )
    checks.engine_dtype(args.dtype)
    compute_dtype = resolve_dtype(args.dtype, torch.device(device))
    if cascade not in ("auto", "triton") and compute_dtype not in CASCADE_DTYPES:
        raise UsageError(
            f"--prefill-attention {cascade} runs torch's fused attention, which takes bf16 or fp16, and --dtype "
            f"{args.dtype} computes in {str(compute_dtype).removeprefix('torch.')}; use --prefill-attention auto "
            "(the Triton kernel there) or --dtype bfloat16"
        )
    if args.kv_cache_dtype in FP8_KV_CACHE_DTYPES and device == "cuda":
        cap = torch.cuda.get_device_capability(0)
        if cap < MIN_FP8_CAPABILITY:
            raise UsageError(
                f"--kv-cache-dtype fp8 needs FP8 conversions on the GPU (compute capability >= 8.9: Ada, Hopper); "
                f"{torch.cuda.get_device_name(0)} has {cap[0]}.{cap[1]}. Use --kv-cache-dtype auto"
            )
    if getattr(args, "shared_prefix_attention", "auto") == "on":
        if no_triton:
            raise UsageError(
                "--shared-prefix-attention on is a feature of the triton attention backend, but this run uses "
                f"--attention-backend {args.attention_backend} on {where}; use auto (on wherever the triton "
                "backend runs) or off"
            )
    min_prefix = getattr(args, "cascade_min_prefix", None)
    checks.at_least("--cascade-min-prefix", min_prefix, 0, " (0: every prefill chunk)")
    if min_prefix is not None:
        if cascade == "triton":
            why, fix = "is triton", "add --prefill-attention cudnn-cascade (or flash-cascade)"
        elif no_triton:  # no Triton backend: no cascade, whatever --prefill-attention says
            if args.attention_backend == "torch":
                why = f"runs none with --attention-backend torch (the reference) on {where}"
                fix = "drop --attention-backend torch" if checks.no_triton_gpu(device) is None else "keep it unset"
            else:  # the ranks lack a GPU or Triton: the Triton backend cannot run
                why = f"runs none on {where}, which have {checks.no_triton_gpu(device)} for the triton backend"
                fix = "run on a GPU with Triton"
        elif cascade == "auto" and resolve_prefill_attention("auto", torch.device(device), compute_dtype) == "triton":
            why = (
                f"is auto, which runs none here (a cascade on a Hopper GPU in bf16 / fp16; this run: "
                f"{str(compute_dtype).removeprefix('torch.')})"
            )
            fix = "name --prefill-attention cudnn-cascade where it can run"
        else:
            why = ""
        if why:
            raise UsageError(
                f"--cascade-min-prefix {min_prefix} chooses the chunks that run a cascade, but --prefill-attention "
                f"{why} (no cascade); {fix}, or drop --cascade-min-prefix"
            )
    if getattr(args, "prefill_tiling", None):
        from spanllm.kernels.prefill_config import load_prefill_config

        try:
            load_prefill_config(args.prefill_tiling)
        except ValueError as e:
            raise UsageError(f"--prefill-tiling {args.prefill_tiling}: {e}") from None
    checks.batched_tokens_cover_seqs(args.max_num_batched_tokens, args.max_num_seqs)
    if hasattr(args, "min_admit") and args.min_admit > args.max_num_seqs:
        raise UsageError(
            f"--min-admit {args.min_admit}: more than --max-num-seqs {args.max_num_seqs} slots can never be free at "
            f"once; give at most {args.max_num_seqs} (1 = off)"
        )
    util = args.gpu_memory_utilization
    if util is not None:
        if not 0.0 < util <= 1.0:
            raise UsageError(f"--gpu-memory-utilization {util}: must be in (0, 1]")
        if device != "cuda":
            raise UsageError(
                f"--gpu-memory-utilization {util} sizes the KV cache on a GPU, and these ranks run on CPU (a fixed "
                "cache, 1 GiB by default); drop it, or give --num-kv-blocks to size the cache"
            )
        if args.num_kv_blocks is not None:
            raise UsageError(
                f"--gpu-memory-utilization {util} and --num-kv-blocks {args.num_kv_blocks} both size the KV cache "
                "(the blocks win); give one of them"
            )
    if args.attention_backend == "triton" and (have := checks.no_triton_gpu(device)):
        raise UsageError(
            f"--attention-backend triton: Triton kernels for CUDA GPUs, and these ranks have {have}; use auto "
            "(triton where it runs, else torch) or torch"
        )
    if args.prefill_tiling is not None and (no_triton or not args.prefill_tiling.strip()):
        why = (
            "is empty: give a PrefillConfig JSON file"
            if not args.prefill_tiling.strip()
            else "tiles the Triton prefill kernel, which this run does not use (--attention-backend "
            f"{args.attention_backend} on {where}); drop it"
        )
        raise UsageError(f"--prefill-tiling {args.prefill_tiling!r} {why}")
    if serving:  # tensor parallel only: every rank in the one TP group
        world = checks.world_size(args.nprocs)
        cfg, topo, _ = check_model_arguments(args, world)
        checks.at_least("--tp", args.tp, 1, " (tensor-parallel degree; leave it out for the world size)")
        if args.tp is not None and args.tp != world:
            local = launcher_world_size() is None
            ranks = f"--nprocs {world}" if local else f"the launcher started {world}"
            run_tp = f" (--nprocs {args.tp})" if local else ""
            raise UsageError(
                f"--tp {args.tp}: the serving engine is tensor-parallel only (no pipeline stages), so --tp must equal "
                f"the {world} ranks of this run ({ranks}); give --tp {world} or leave it out, or run {args.tp} "
                f"rank(s){run_tp}"
            )
        checks.layout(args.tp, 1, world, cfg, topo)
        return cfg
    return None


# The tokenizers check_tokenizer_fits loaded, by checkpoint: build_llm hands a local rank the one it has (no 2nd load)
_CHECKED_TOKENIZERS: dict[str, object] = {}


def check_tokenizer_fits(cfg) -> None:
    """A serving engine's checkpoint tokenizer, loaded before any rank starts (a missing or broken one names itself
    here, not after the weights load), with its BOS / EOS ids inside the model's vocabulary: a tokenizer of another
    model would have the warm-up and every chat prompt send ids the embedding does not have."""
    if cfg.checkpoint_dir is None:
        return
    from spanllm.engine.tokenizer import get_tokenizer

    tok = get_tokenizer(cfg.name, cfg.checkpoint_dir)
    special = [("BOS", tok.bos_token_id), *(("EOS", e) for e in tok.eos_token_ids)]
    bad = [(what, i) for what, i in special if i is not None and not 0 <= i < cfg.vocab_size]
    if bad:
        what, i = bad[0]
        raise UsageError(
            f"--model {cfg.checkpoint_dir}: its tokenizer's {what} token is id {i} ({getattr(tok, 'vocab_size', '?')} "
            f"tokens), outside the model's vocabulary [0, {cfg.vocab_size}) (vocab_size); the tokenizer files belong "
            "to another model: copy the checkpoint's own tokenizer.json and tokenizer_config.json"
        )
    _CHECKED_TOKENIZERS[cfg.checkpoint_dir] = tok


def engine_config_from_args(args: argparse.Namespace, device: torch.device, **overrides):
    from spanllm.engine.config import EngineConfig

    fields = dict(
        dtype=resolve_dtype(args.dtype, device),
        cuda_graphs=not args.no_cuda_graphs,
        seed=args.seed,
        decode_gemm=args.decode_gemm,
        pdl=args.pdl,
        quantization=args.quantization,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        attention_backend=args.attention_backend,
        shared_prefix_attention=getattr(args, "shared_prefix_attention", "auto"),
    )
    if args.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
    if hasattr(args, "min_admit"):
        fields["min_admit"] = args.min_admit
    if hasattr(args, "long_prefill_attention_budget"):
        fields["long_prefill_attention_budget"] = args.long_prefill_attention_budget
    if getattr(args, "prefill_tokens_beside_decodes", None) is not None:
        fields["prefill_tokens_beside_decodes"] = args.prefill_tokens_beside_decodes
    if getattr(args, "long_prefill_token_threshold", None) is not None:
        fields["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    if hasattr(args, "enable_prefix_caching"):
        fields["enable_prefix_caching"] = args.enable_prefix_caching
    if getattr(args, "scheduling_policy", "fcfs") != "fcfs":
        fields["scheduling_policy"] = args.scheduling_policy
    if getattr(args, "no_async_scheduling", False):
        fields["async_scheduling"] = False
    if args.max_model_len:
        fields["max_model_len"] = args.max_model_len
    if hasattr(args, "prefill_attention"):
        fields["prefill_attention"] = args.prefill_attention
    if getattr(args, "cascade_min_prefix", None) is not None:
        fields["cascade_min_prefix"] = args.cascade_min_prefix
    if getattr(args, "prefill_tiling", None):
        from spanllm.kernels.prefill_config import load_prefill_config

        fields["prefill_tiling"] = load_prefill_config(args.prefill_tiling)
    return EngineConfig(**{**fields, **overrides})


def build_llm(ctx, args: argparse.Namespace, *, tp: int | None = None, pp: int = 1, tuning=None, **overrides):
    """This rank's LLM from the command's arguments (collective: every rank calls it), with its tokenizer."""
    from spanllm.engine.llm import LLM
    from spanllm.model.config import resolve_model
    from spanllm.model.parallel_dims import ParallelDims

    tp = tp or getattr(args, "tp", None) or ctx.world_size // pp
    llm = LLM(
        resolve_model(args.model),
        engine_config_from_args(args, ctx.device, **overrides),
        dims=ParallelDims(tp, pp, ctx.world_size),
        allreduce=getattr(args, "allreduce", None) or None,
        device=ctx.device,
        ranks_per_node=args.ranks_per_node,
        tuning=tuning,
    )
    checked = _CHECKED_TOKENIZERS.get(llm.config.checkpoint_dir or "")
    if checked is not None:
        llm.get_tokenizer(loaded=checked)
    return llm
