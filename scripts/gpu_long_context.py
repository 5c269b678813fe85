"""Long-context prefill through the engine on one GPU (Llama 3.1 8B preset, random weights): on an idle engine,
the TTFT of a 36,402- and a 111,352-token prompt (16 output tokens) per chunk size (max_num_batched_tokens
8192 / 16384 / 32768, a fresh engine each); the inter-token latency of 64 running decodes while a 111k prompt
prefills; and a kernel trace (torch.profiler) of one 111k prefill, summarized by kernel class.

    python scripts/gpu_long_context.py OUTDIR [--prefill-config OUTDIR0/best_prefill_config.json]
        [--prefill-attention {triton,cudnn-cascade,flash-cascade}] [--quick]

--prefill-config: a PrefillConfig JSON (scripts/gpu_prefill_attention.py's best_prefill_config.json) applied
through EngineConfig.prefill_tiling; the engine's describe() line, recorded per engine, names the tiling that
ran. --prefill-attention: EngineConfig.prefill_attention (the cascade for long-prefix chunks; describe() names
it too). Prompts are random token ids, new ones for every request (no prefix-cache hits). Each stage catches its
own failure, records it in OUTDIR/long_context.json and goes on; past --budget-s the rest are skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

PROMPT_LENS = (36402, 111352)
CHUNKS = (8192, 16384, 32768)
NUM_DECODES = 64
DECODE_PROMPT_LEN = 128
OUTPUT_TOKENS = 16
TIME_BUDGET_S = 420.0
# spanllm.attention.cascade's (checked in a test)
PREFILL_ATTENTION = ("auto", "triton", "cudnn-cascade", "flash-cascade")


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of a non-empty list; None for an empty one."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gaps_in_window(token_times: list[list[float]], t0: float, t1: float) -> list[float]:
    """Inter-token gaps (seconds) of every stream whose later token landed in [t0, t1]: what a client saw while
    the long prompt was prefilling (the gap spanning t0 included: it was stretched by the first chunk)."""
    return [b - a for times in token_times for a, b in zip(times, times[1:]) if t0 <= b <= t1]


def kernel_class(name: str) -> str:
    """A profiler kernel name's class for the step trace summary."""
    n = name.lower()
    if "prefill_kernel" in n or "decode_kernel" in n or "flash" in n or "attention" in n or "fmha" in n:
        return "attention"
    if "rope" in n or "cache" in n or "index_copy" in n or "scatter" in n:
        return "rope_and_cache_write"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "_mm_", "wgmma")):
        return "gemm"
    if "norm" in n:
        return "norm"
    if "silu" in n or "act_and_mul" in n or "swiglu" in n:
        return "activation"
    if "sample" in n or "softmax" in n or "argmax" in n or "topk" in n:
        return "sampling"
    return "other"


def summarize_kernels(rows: list[tuple[str, int, float]], top: int = 25) -> dict:
    """rows: (kernel name, calls, device ms) -> totals per class and the top kernels by time."""
    total = sum(ms for _, _, ms in rows)
    classes: dict[str, float] = {}
    for name, _, ms in rows:
        c = kernel_class(name)
        classes[c] = classes.get(c, 0.0) + ms
    ranked = sorted(rows, key=lambda r: -r[2])[:top]
    return {
        "device_ms_total": total,
        "by_class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "by_class_share": {c: (ms / total if total else None) for c, ms in classes.items()},
        "top_kernels": [
            {"name": n[:200], "calls": c, "device_ms": ms, "class": kernel_class(n)} for n, c, ms in ranked
        ],
    }


# --- the engine -------------------------------------------------------------------------------------------


class Bench:
    """One engine (one chunk size) and the measurements made on it."""

    def __init__(self, args: argparse.Namespace, chunk: int, tiling, device, rng) -> None:
        from spanllm.engine.config import EngineConfig
        from spanllm.engine.llm import LLM

        self.args, self.chunk, self.rng = args, chunk, rng
        need = max(args.prompt_lens) + args.decodes * (args.decode_prompt_len + args.decode_max_tokens)
        need += 2 * chunk + 4096  # the warm-up prompt and slack
        cfg = EngineConfig(
            max_num_batched_tokens=chunk,
            max_num_seqs=min(256, chunk),
            num_kv_blocks=-(-int(need * 1.25) // 16) + 1 if args.kv_blocks is None else args.kv_blocks,
            prefill_tiling=tiling,
            prefill_attention=args.prefill_attention,
            cascade_min_prefix=args.cascade_min_prefix,
            max_model_len=args.max_model_len,
        )
        self.llm = LLM(args.model, cfg, device=device)
        self.core = self.llm.engine_core
        self.vocab = self.llm.config.vocab_size

    def describe(self) -> str:
        return self.llm.describe()

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(10, self.vocab - 10, size=n).tolist()

    def warm_up(self) -> dict:
        """Untimed: the server's warm-up (spanllm.engine.warmup: compiles, every decode graph, a prompt of two chunks
        plus a tail, the prefill attention at every shape a prompt's chunks meet)."""
        from spanllm.engine.warmup import warm_up

        return warm_up(self.llm)

    def _step_until(self, done, max_steps: int = 20000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.core.step()
        raise RuntimeError(f"not done after {max_steps} engine steps")

    def drain(self) -> None:
        while self.core.has_unfinished():
            self.core.step()

    def ttft(self, n: int) -> dict:
        from spanllm.engine.sampler import SamplingParams

        self._sync()
        steps0 = self.core.stats.steps
        seq = self.core.add_request(self.prompt(n), SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True))
        self.drain()
        return {
            "prompt_tokens": n,
            "ttft_s": seq.first_token - seq.arrival,
            "e2e_s": seq.token_times[-1] - seq.arrival,
            "output_tokens": len(seq.token_times),
            "steps": self.core.stats.steps - steps0,
        }

    def itl_during_prefill(self, n: int) -> dict:
        """NUM_DECODES requests decoding, then an n-token prompt: every decode's token times around it."""
        from spanllm.engine.sampler import SamplingParams

        a = self.args
        decs = [
            self.core.add_request(
                self.prompt(a.decode_prompt_len), SamplingParams(max_tokens=a.decode_max_tokens, ignore_eos=True)
            )
            for _ in range(a.decodes)
        ]
        try:
            self._step_until(lambda: min(len(s.token_times) for s in decs) >= 8)  # all in steady decode
            long = self.core.add_request(self.prompt(n), SamplingParams(max_tokens=4, ignore_eos=True))
            t0 = long.arrival
            self._step_until(lambda: long.first_token is not None)
            t1 = long.first_token
            for _ in range(8):
                self.core.step()
        finally:
            for s in decs:
                self.core.abort_request(s.request_id)
            self.drain()
        times = [list(s.token_times) for s in decs]
        during = gaps_in_window(times, t0, t1)
        before = [b - x for ts in times for x, b in zip(ts, ts[1:]) if b < t0]
        ms = [1e3 * g for g in during]
        return {
            "long_prompt_tokens": n,
            "decodes": len(decs),
            "long_ttft_s": t1 - t0,
            "itl_during_ms": {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms, default=None)},
            "itl_before_ms": {"p50": percentile([1e3 * g for g in before], 50)},
            "tokens_per_decode_during": len(during) / max(1, len(decs)),
            "gaps_during_ms": ms,
        }

    def profile(self, n: int) -> dict:
        """One n-token prefill under torch.profiler: device time per kernel, summarized."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from spanllm.engine.sampler import SamplingParams

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._sync()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            seq = self.core.add_request(self.prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            self.drain()
            self._sync()
        wall = time.perf_counter() - t0
        from torch.autograd import DeviceType

        # the kernels themselves (device events), not the ops that launched them (whose device time repeats them)
        rows = [
            (e.key, int(e.count), _device_us(e) / 1e3)
            for e in prof.key_averages()
            if getattr(e, "device_type", None) == DeviceType.CUDA and _device_us(e) > 0
        ]
        source = "device kernels"
        if not rows and torch.cuda.is_available():  # kernels not told apart here: every event with device time
            rows = [(e.key, int(e.count), _device_us(e) / 1e3) for e in prof.key_averages() if _device_us(e) > 0]
            source = "every event with device time (ops and their kernels: counted twice)"
        if not rows:  # CPU: no device kernels; the ops' self CPU time stands in
            rows = [(e.key, int(e.count), e.self_cpu_time_total / 1e3) for e in prof.key_averages()]
            source = "CPU ops' self time (no device)"
        return {
            "rows_from": source,
            "prompt_tokens": n,
            "wall_s_profiled": wall,
            "ttft_s": seq.first_token - seq.arrival,
            **summarize_kernels(rows),
        }

    def close(self) -> None:
        self.llm.close()
        del self.llm, self.core
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _device_us(e) -> float:
    """A profiler event's self device time (µs): the attribute's name moved across torch versions."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, attr, None)
        if v is not None:
            return float(v)
    return 0.0


# --- the run: stages that record their own failures ---------------------------------------------------------


class Run:
    def __init__(self, deadline: float, log=print) -> None:
        self.doc: dict = {"stages": {}, "errors": []}
        self.deadline = deadline
        self.log = log

    def stage(self, name: str, fn):
        """fn() -> dict recorded under stages[name]; an exception or the time budget is recorded instead."""
        if time.monotonic() > self.deadline:
            self.doc["stages"][name] = {"skipped": "time budget"}
            self.log(f"[{name}] skipped: time budget")
            return None
        t0 = time.monotonic()
        try:
            res = fn()
            self.doc["stages"][name] = {**res, "stage_s": round(time.monotonic() - t0, 2)}
            shown = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) or k.startswith("itl")}
            self.log(f"[{name}] {json.dumps(shown, default=str)[:400]}")
            return res
        except Exception as exc:  # noqa: BLE001 (recorded; the next stage runs)
            err = {"error": f"{type(exc).__name__}: {str(exc)[:800]}", "trace": traceback.format_exc()[-3000:]}
            self.doc["stages"][name] = err
            self.doc["errors"].append({"stage": name, "error": err["error"]})
            self.log(f"[{name}] FAILED: {err['error']}")
            return None


def machine_info() -> dict:
    """spanllm.measure.report's host and versions, and the GPU's name (device_name)."""
    import torch

    from spanllm.measure import report

    info = {**report.machine_info(), "versions": report.versions()}
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
    return info


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--prefill-config", default=None, help="PrefillConfig JSON (best_prefill_config.json)")
    ap.add_argument(
        "--prefill-attention",
        choices=PREFILL_ATTENTION,
        default="triton",
        help="EngineConfig.prefill_attention: the Triton kernel, or the cascade for long-prefix chunks",
    )
    ap.add_argument(
        "--cascade-min-prefix",
        type=int,
        default=None,
        help="EngineConfig.cascade_min_prefix (default: the engine's, 4096; 0: every chunk, a prompt's first "
        "included; only with a cascade --prefill-attention)",
    )
    ap.add_argument("--ttft-reps", type=int, default=1, help="TTFT requests per prompt length (fresh prompts each)")
    ap.add_argument("--no-itl", action="store_true", help="skip the decodes-beside-a-long-prefill stage")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled prefill")
    ap.add_argument("--quick", action="store_true", help="chunk 8192 only, the 36k prompt only, 16 decodes")
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--prompt-lens", type=_ints, default=PROMPT_LENS, help="TTFT prompts (comma-separated)")
    ap.add_argument("--chunks", type=_ints, default=CHUNKS, help="max_num_batched_tokens values")
    ap.add_argument("--decodes", type=int, default=NUM_DECODES, help="running decodes in the ITL stage")
    ap.add_argument("--decode-prompt-len", type=int, default=DECODE_PROMPT_LEN)
    ap.add_argument("--decode-max-tokens", type=int, default=1024, help="enough to outlast the long prefill")
    ap.add_argument("--itl-prompt", type=int, default=None, help="the long prompt of the ITL stage (default longest)")
    ap.add_argument("--profile-chunk", type=int, default=None, help="chunk size whose engine is profiled (first)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's positions")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pool blocks (default: sized to the workload)")
    ap.add_argument("--budget-s", type=float, default=TIME_BUDGET_S)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.chunks = args.chunks[:1]
        args.prompt_lens = args.prompt_lens[:1]
        args.decodes = min(args.decodes, 16)
    if args.itl_prompt is None:
        args.itl_prompt = max(args.prompt_lens)
    if args.profile_chunk is None:
        args.profile_chunk = args.chunks[0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch

    from spanllm.kernels.prefill_config import load_prefill_config

    if not torch.cuda.is_available():
        from spanllm.model.config import resolve_model

        cfg = resolve_model(args.model)
        if 12 * cfg.num_layers * cfg.hidden_size**2 > 1e9:  # ~parameters; a real model on CPU: minutes, tens of GB
            print(f"{args.model} needs a CUDA GPU (CPU runs take a small model: --model tiny)", file=sys.stderr)
            return 2
    t_start = time.monotonic()
    run = Run(t_start + args.budget_s, log=lambda s: print(s, flush=True))
    doc = run.doc
    doc["machine"] = machine_info()
    doc["settings"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    os.makedirs(args.outdir, exist_ok=True)
    path = os.path.join(args.outdir, "long_context.json")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiling = None
    if args.prefill_config:
        try:
            tiling = load_prefill_config(args.prefill_config)
            doc["prefill_tiling"] = tiling.to_dict()
            print(f"prefill tiling from {args.prefill_config}: {tiling.label()}", flush=True)
        except Exception as exc:  # noqa: BLE001
            doc["errors"].append({"stage": "prefill_config", "error": f"{type(exc).__name__}: {exc}"})
            print(f"could not load {args.prefill_config} ({exc}): the kernel's default tiling runs", flush=True)
    rng = np.random.default_rng(args.seed)
    for chunk in args.chunks:
        built = run.stage(f"chunk{chunk}/build", lambda c=chunk: {"bench": Bench(args, c, tiling, device, rng)})
        if built is not None:
            engine_stages(run, args, built["bench"], chunk)
        _write(path, doc, t_start)  # after every engine: a later crash keeps what was measured
    _write(path, doc, t_start)
    print(f"wrote {path} in {doc['elapsed_s']} s ({len(doc['errors'])} errors)", flush=True)
    return 0


def engine_stages(run: Run, args: argparse.Namespace, b: Bench, chunk: int) -> None:
    """Every measurement on one engine, each its own stage; the engine is closed whatever happened."""
    tag = f"chunk{chunk}"
    built = run.doc["stages"][f"{tag}/build"]
    built.pop("bench", None)
    built["describe"] = b.describe()
    try:
        run.stage(f"{tag}/warmup", b.warm_up)
        for n in args.prompt_lens:
            for rep in range(args.ttft_reps):  # rep 0 is the first prompt of its length this engine saw
                name = f"{tag}/ttft{n}" + (f"/rep{rep}" if rep else "")
                run.stage(name, lambda n=n: b.ttft(n))
        if not args.no_itl:
            run.stage(f"{tag}/itl_during_prefill{args.itl_prompt}", lambda: b.itl_during_prefill(args.itl_prompt))
        if chunk == args.profile_chunk and not args.no_profile:
            run.stage(f"{tag}/profile{args.itl_prompt}", lambda: b.profile(args.itl_prompt))
    finally:
        run.stage(f"{tag}/close", lambda: (b.close(), _memory())[1])


def _memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
    }


def _write(path: str, doc: dict, t_start: float) -> None:
    doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
