"""The device-resident pp=1 decode loop (ModelRunner.start_steps / step) against the per-step path it
replaced (runner.decode + sampler + host-side bookkeeping, still what pipelined stages run), stop-token
handling with the K-step check, and the benchmark's shortened breakdown / warm-up passes."""

from __future__ import annotations

import math

import pytest
import torch
from engine_workers import PROMPTS, engine_config

from spanllm.engine.llm import LLM
from spanllm.engine.sampler import Sampler, SamplingParams
from spanllm.engine.static.pipeline import split_batch

STEPS = 40


def _tiny(**kw) -> LLM:
    return LLM("tiny", engine_config(max_seq_len=128, **kw))


@torch.no_grad()
def per_step_reference(llm: LLM, prompts, params: SamplingParams, micro_batches: int = 1):
    """The previous loop: eager prefill, then per step and micro-batch runner.decode -> sampler -> write
    the token into a [B, steps] tensor; a fresh sampler with the engine's seed (same draw order)."""
    runner, dev = llm.runner, llm.device
    sampler = Sampler(dev, llm.engine.seed)
    lengths_host = [len(p) for p in prompts]
    lengths = torch.tensor(lengths_host, device=dev)
    ids = torch.zeros(len(prompts), max(lengths_host), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    chunks = split_batch(len(prompts), micro_batches)
    out = torch.zeros(len(prompts), params.max_tokens, dtype=torch.int64)
    logits = torch.zeros(params.max_tokens, len(prompts), llm.config.vocab_size)
    for s0, b in chunks:
        y = runner.prefill(ids[s0 : s0 + b, : max(lengths_host[s0 : s0 + b])], lengths[s0 : s0 + b], s0)
        logits[0, s0 : s0 + b] = y
        out[s0 : s0 + b, 0] = sampler(y, params)
    for step in range(1, params.max_tokens):
        for s0, b in chunks:
            y = runner.decode(
                out[s0 : s0 + b, step - 1 : step],
                lengths[s0 : s0 + b] + (step - 1),
                s0,
                max(lengths_host[s0 : s0 + b]) + step,
            )
            logits[step, s0 : s0 + b] = y
            out[s0 : s0 + b, step] = sampler(y, params)
    return out.tolist(), logits


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_loop_equals_per_step_path(micro_batches, temperature):
    params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=STEPS, ignore_eos=True)
    ref_tokens, ref_logits = per_step_reference(_tiny(), PROMPTS, params, micro_batches)
    out = _tiny().generate_static(PROMPTS, params, micro_batches=micro_batches, keep_logits=True)
    assert out.token_ids == ref_tokens
    assert out.decode_steps == STEPS - 1
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=0)


def test_device_loop_buckets_are_reused_and_reset():
    llm = _tiny()
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    first = llm.generate_static(PROMPTS, p).token_ids
    assert llm.generate_static(PROMPTS, p).token_ids == first  # same bucket, buffers reset by start_steps
    assert len(llm.runner._steps) == 1
    llm.generate_static(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    llm.generate_static(PROMPTS, p, micro_batches=3)
    assert len(llm.runner._steps) == 5  # (3, 0) greedy and sampled; (1, 0), (1, 1), (1, 2) greedy
    llm.runner.reset_graphs()
    assert not llm.runner._steps and llm.runner.captured_buckets == []
    assert llm.generate_static(PROMPTS, p).token_ids == first


def _expected(reference: list[list[int]], stop_ids: tuple[int, ...], interval: int, steps: int):
    """(tokens through each row's first stop, decode steps the K-step check runs)."""
    firsts = []
    for row in reference:
        hits = [i for i, t in enumerate(row) if t in stop_ids]
        firsts.append(hits[0] if hits else None)
    tokens = [row if f is None else row[: f + 1] for row, f in zip(reference, firsts)]
    if any(f is None for f in firsts):
        return tokens, steps - 1
    needed = max(firsts)  # token i comes from decode step i (token 0 from prefill)
    return tokens, 0 if needed == 0 else min(steps - 1, math.ceil(needed / interval) * interval)


@pytest.mark.parametrize("interval", [1, 5, 16, 64])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_stop_tokens_checked_every_interval(interval, micro_batches):
    reference = _tiny().generate_static(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True)).token_ids
    # One stop token per row, each first reached at a different step (the last one well past step 16).
    picks = [row[len(row) // 4 + 6 * i] for i, row in enumerate(reference)]
    stop_ids = tuple(dict.fromkeys(picks))
    tokens, steps_run = _expected(reference, stop_ids, interval, STEPS)
    assert 16 < max(len(t) for t in tokens) < STEPS  # the batch does stop early, after one 16-step check
    llm = _tiny(eos_check_interval=interval)
    out = llm.executor.generate(PROMPTS, SamplingParams(max_tokens=STEPS), micro_batches, stop_ids)
    assert out.token_ids == tokens
    assert out.decode_steps == steps_run


def test_stop_at_first_token_runs_no_decode_step():
    llm = _tiny()
    reference = llm.generate_static(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids
    out = llm.executor.generate(PROMPTS, SamplingParams(max_tokens=4), 1, tuple({r[0] for r in reference}))
    assert out.token_ids == [r[:1] for r in reference] and out.decode_steps == 0


def test_eos_check_interval_validated():
    with pytest.raises(ValueError, match="eos_check_interval=0 must be >= 1"):
        engine_config(eos_check_interval=0)


def test_bench_batch_reports_breakdown_steps(tmp_path):
    import json

    from spanllm.cli import main

    js = tmp_path / "b.json"
    assert (
        main(
            [
                "bench",
                "batch",
                "--model",
                "tiny:layers=2",
                "--batch-sizes",
                "2",
                "--prompt-len",
                "8",
                "--decode-len",
                "40",
                "--iters",
                "1",
                "--warmup",
                "1",
                "--breakdown-steps",
                "5",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    doc = json.loads(js.read_text())
    (row,) = doc["rows"]
    assert doc["complete"] is True and not (tmp_path / "b.partial.json").exists()  # the partial file is gone
    assert row["breakdown_steps"] == 5 and row["warmup_decode_len"] == 32 and row["decode_len"] == 40
    assert set(row["breakdown_ms"]) == {"gemm", "attention", "allreduce", "pipeline", "idle", "other"}
    assert row["breakdown_step_ms"] > 0
    assert (
        row["breakdown_steps_covered"] == 5
        and row["breakdown_mode"] == "eager pass with per-op timers (host wall clock)"
    )
    assert (
        main(
            [
                "bench",
                "batch",
                "--model",
                "tiny:layers=2",
                "--batch-sizes",
                "1",
                "--prompt-len",
                "4",
                "--decode-len",
                "3",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    (row,) = json.loads(js.read_text())["rows"]
    assert row["breakdown_steps"] == 2 and row["warmup_decode_len"] is None  # capped at decode_len - 1


def test_partial_rows_survive_a_cut_run(tmp_path):
    """Rows land in X.partial.json as they finish (complete=False), so a run stopped by a time limit keeps them."""
    import json

    from spanllm.commands.bench_batch import BenchSettings, PartialRows, partial_path

    s = BenchSettings(
        model="tiny",
        batch_sizes=(1,),
        prompt_len=4,
        decode_len=4,
        workload="decode-heavy",
        allreduce=(),
        warmup=0,
        iters=1,
        breakdown=False,
        dtype="auto",
        seed=0,
        cuda_graphs=False,
        ranks_per_node=None,
        json=str(tmp_path / "study.json"),
    )
    assert partial_path(s.json) == str(tmp_path / "study.partial.json")
    p = PartialRows("study", s, world=2)
    p.add({"batch": 1})
    p.add({"batch": 8})
    doc = json.loads((tmp_path / "study.partial.json").read_text())
    assert doc["kind"] == "study" and doc["complete"] is False and doc["rows"] == [{"batch": 1}, {"batch": 8}]
    assert doc["settings"]["world_size"] == 2 and not (tmp_path / "study.json").exists()
