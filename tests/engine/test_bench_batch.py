"""bench batch on the one engine: the fixed-batch executor against the serving engine (same tokens), prefill
chunked at the token budget, stop tokens, and the benchmark's shortened breakdown / warm-up passes."""

from __future__ import annotations

import dataclasses

import pytest
from engine_workers import PROMPTS, engine_config

from spanllm.engine.fixed_batch import GenerationError, split_batch
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams


def test_fixed_batch_equals_the_serving_engine():
    """The fixed schedule (one prefill step, then decode steps fed on the device) and continuous batching give
    the same greedy tokens: one worker, one forward."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fixed = LLM("tiny", engine_config()).generate_batch(PROMPTS, params).token_ids
    served = [o.output_ids for o in LLM("tiny", engine_config()).generate(PROMPTS, params)]
    assert fixed == served and all(len(t) == 12 for t in fixed)


@pytest.mark.parametrize("budget,micro_batches", [(4, 1), (5, 2), (64, 3)])
def test_prefill_chunks_and_micro_batches_change_nothing(budget, micro_batches):
    """A token budget smaller than a prompt splits it into chunks that attend to their cached prefix; micro-batches
    cut the batch; the tokens stay those of one unchunked batch."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = LLM("tiny", engine_config()).generate_batch(PROMPTS, params).token_ids
    llm = LLM("tiny", engine_config(max_num_seqs=4, max_num_batched_tokens=max(budget, 4)))
    assert llm.generate_batch(PROMPTS, params, micro_batches=micro_batches).token_ids == ref


def test_stop_tokens_end_a_sequence_unless_ignored():
    llm = LLM("tiny", engine_config())
    full = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    stop = full[0][3]
    llm.config = dataclasses.replace(llm.config, eos_token_ids=(stop,))
    out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=10)).token_ids
    for got, row in zip(out, full):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert got == row[:cut]


def test_fixed_batch_errors():
    llm = LLM("tiny", engine_config(num_kv_blocks=4, block_size=4))
    with pytest.raises(GenerationError, match="need 9 KV blocks of 4 tokens; the cache holds 3"):
        llm.generate_batch(PROMPTS, SamplingParams(max_tokens=5))
    with pytest.raises(GenerationError, match="micro_batches=4 must be between 1 and the batch size 3"):
        LLM("tiny", engine_config()).generate_batch(PROMPTS, SamplingParams(max_tokens=2), micro_batches=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        LLM("tiny", engine_config()).generate_batch([[]])
    with pytest.raises(ValueError, match="seed need the serving engine"):
        LLM("tiny", engine_config()).generate_batch(PROMPTS, SamplingParams(seed=3, temperature=1.0))
    assert split_batch(5, 2) == [(0, 3), (3, 2)]


def test_breakdown_hooks_time_every_category_and_detach():
    llm = LLM("tiny", engine_config())
    with llm.timed_ops():
        out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
    b = out.breakdown
    assert b.steps == 4 == out.decode_steps
    assert b.ms["gemm"] > 0 and b.ms["attention"] > 0 and b.ms["allreduce"] == 0  # TP=1: no all-reduce
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llm.model.modules())
    assert hooks == 0 and not llm.timers.enabled
    out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.breakdown.steps == 0  # timers off outside timed_ops


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


def test_bench_batch_honours_quantization(tmp_path, capfd):
    """--quantization fp8 reaches the engine the study builds (it was once parsed and then dropped): the engine's
    description line (printed by the rank) names FP8 weights, and the report's settings carry it."""
    import json

    from spanllm.cli import main

    js = tmp_path / "q.json"
    argv = ["bench", "batch", "--model", "tiny:layers=2", "--batch-sizes", "1", "--prompt-len", "4"]
    argv += ["--decode-len", "3", "--iters", "1", "--warmup", "0", "--no-breakdown", "--quantization", "fp8"]
    assert main([*argv, "--json", str(js)]) == 0
    out = capfd.readouterr()
    assert "weights fp8 e4m3 per-channel, quantized at load" in out.out + out.err
    assert json.loads(js.read_text())["settings"]["quantization"] == "fp8"
