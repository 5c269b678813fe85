"""Engine limits the audit found accepted and ignored, or refused too late: `generate`'s fixed batch against
--max-num-seqs, the summary line of a fixed batch, a serving --tp that is not the world, bench throughput's
lengths against the context and the KV pool (refused before the model loads, naming the flags), a samples file
counted by another tokenizer, a collective timeout without a traceback. In-process through `spanllm.cli.main`."""

from __future__ import annotations

import re

import pytest
from cli_output import one_error_line

import spanllm.commands.bench_throughput
import spanllm.commands.dataset_args
import spanllm.commands.generate
import spanllm.commands.serve
from spanllm.bench.datasets import SampleRequest, SampleSet
from spanllm.bench.sample_file import save_samples
from spanllm.cli import main

TP = ["bench", "throughput", "--model", "tiny"]
RANDOM = TP + ["--dataset-name", "random"]


def _refuse(*args, **kwargs):
    raise AssertionError("work started for bad input")


@pytest.fixture
def no_ranks(monkeypatch):
    for mod in (spanllm.commands.generate, spanllm.commands.bench_throughput, spanllm.commands.serve):
        monkeypatch.setattr(mod, "launch", _refuse, raising=False)
    monkeypatch.setattr("spanllm.launch.launch", _refuse)


@pytest.fixture
def no_sampling(monkeypatch):
    """Sampling a request is a failure of the test (the flags alone must be refused)."""
    for name in ("sample_random", "sample_prefix_repetition", "sample_generated_shared_prefix", "sample_sharegpt"):
        monkeypatch.setattr(spanllm.commands.dataset_args, name, _refuse)


def _last_error(capsys) -> str:
    """The error line (random prompts may warn about their re-encoded lengths first); no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("spanllm: error: "), err
    return line


# --- 1. generate: one fixed batch, never split by --max-num-seqs ----------------------------------------------
@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            [],
            "--max-num-seqs 1: generate runs its 3 prompts as one fixed batch, every decode step 3 sequences at once; "
            "give --max-num-seqs 3 or more, or at most 1 prompt(s)",
        ),
        (
            ["--micro-batches", "2"],
            "--max-num-seqs 1: generate runs its 3 prompts as one fixed batch, every decode step 2 sequences at once "
            "(--micro-batches 2: 2 a step); give --max-num-seqs 2 or more, or at most 2 prompt(s)",
        ),
    ],
)
def test_generate_refuses_a_batch_wider_than_max_num_seqs(no_ranks, capsys, extra, needle):
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--prompt-ids", "6"]
    argv += ["--max-new-tokens", "3", "--max-num-seqs", "1", "--max-num-batched-tokens", "1", *extra]
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


def test_generate_help_says_one_fixed_batch(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the prompts run as one fixed batch, so at least their number" in out  # --max-num-seqs
    assert "every decode step runs all of them, so --max-num-seqs must be at least their number" in out


# --- 2. the summary line names the limits of the executor that runs -------------------------------------------
def test_describe_names_the_fixed_batch_limits_not_the_schedulers():
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM
    from spanllm.engine.sampler import SamplingParams

    llm = LLM("tiny", EngineConfig(max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64))
    try:
        out = llm.generate_batch([list(range(1, 41))], SamplingParams(max_tokens=2, ignore_eos=True))
        assert out.decode_steps == 1 and len(out.token_ids[0]) == 2
        line = llm.describe()
        assert (
            "fixed batch: prefill steps of <= 16 tokens (max_num_batched_tokens), every decode step the whole " in line
        )
        for scheduler_only in ("prefill tokens beside decodes", "one prompt's prefill chunk", "max_num_seqs 4"):
            assert scheduler_only not in line
        # the serving engine, once built, is what runs: its scheduler's limits
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        line = llm.describe()
        assert "max_num_seqs 4, max_num_batched_tokens 16" in line and "one prompt's prefill chunk <= " in line
        assert "fixed batch" not in line and "fixed batch" in llm.describe(fixed_batch=True)
    finally:
        llm.close()


# --- 3. the serving engine is TP only: --tp must be the world --------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        RANDOM + ["--input-len", "16", "--output-len", "4", "--num-prompts", "4"],
        ["serve", "--model", "tiny", "--port", "0"],
    ],
    ids=["bench throughput", "serve"],
)
def test_serving_tp_must_be_the_world(no_ranks, capsys, argv):
    assert main(argv + ["--nprocs", "2", "--tp", "1"]) == 2
    line = one_error_line(capsys)
    assert "--tp 1: the serving engine is tensor-parallel only (no pipeline stages), so --tp must equal the 2 " in line
    assert "(--nprocs 2); give --tp 2 or leave it out, or run 1 rank(s) (--nprocs 1)" in line


# --- 5. bench throughput: lengths against the context and the KV pool, before the model loads ------------------
@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            RANDOM + ["--input-len", "16", "--output-len", "4", "--max-model-len", "10"],
            "--input-len 16 with --output-len 4: 16 + 4 = 20 tokens exceed the context of 10 (--max-model-len)",
        ),
        (
            RANDOM + ["--input-len", "100000000", "--output-len", "2", "--num-prompts", "1", "--dry-run"],
            "--input-len 100000000 with --output-len 2: 100000000 + 2 = 100000002 tokens exceed the context of 4096 "
            "(max_position_embeddings of tiny)",
        ),
        (
            RANDOM
            + ["--random-input-len", "3000", "--random-output-len", "2000", "--random-range-ratio", "0.5"]
            + ["--max-model-len", "2000"],
            "--random-input-len 3000 with --random-output-len 2000 at --random-range-ratio 0.5 (its shortest "
            "requests): 1500 + 1000 = 2500 tokens exceed the context of 2000 (--max-model-len)",
        ),
        (
            TP + ["--dataset-name", "generated-shared-prefix", "--gsp-system-prompt-len", "4000"],
            "--gsp-system-prompt-len 4000 + --gsp-question-len 128 with --gsp-output-len 256: 4128 + 256 = 4384 "
            "tokens exceed the context of 4096",
        ),
        (
            TP + ["--dataset-name", "prefix_repetition", "--prefix-repetition-suffix-len", "4000"],
            "--prefix-repetition-prefix-len 256 + --prefix-repetition-suffix-len 4000 with "
            "--prefix-repetition-output-len 128: 4256 + 128 = 4384 tokens exceed the context of 4096",
        ),
        (TP + ["--output-len", "5000"], "--output-len 5000 (ShareGPT prompts >= 4): 4 + 5000 = 5004 tokens exceed"),
        (
            RANDOM + ["--num-prompts", "100000000", "--dry-run"],
            "--num-prompts 100000000: 100000000 random requests of at least 1024 prompt tokens need at least 872.3 "
            "GiB of host memory to sample",
        ),
    ],
)
def test_dataset_lengths_refused_before_sampling(no_ranks, no_sampling, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


def test_sampled_requests_refused_before_the_model_loads(no_ranks, capsys):
    # the flags fit (16 + 4 <= 20), the sampled prompts do not: re-encoded random bytes come out longer
    argv = RANDOM + ["--input-len", "16", "--output-len", "4", "--num-prompts", "4"]
    assert main(argv + ["--max-model-len", "20"]) == 2
    line = _last_error(capsys)
    assert "the longest request of the sample, #1 (--input-len 16 with --output-len 4): 18 + 4 = 22 tokens " in line
    assert "exceed the context of 20 (--max-model-len)" in line
    assert main(argv + ["--num-kv-blocks", "2"]) == 2
    line = _last_error(capsys)
    assert (
        "--num-kv-blocks 2: the KV pool holds 16 tokens (block 0 is reserved, --block-size 16), and the longest "
        "request of the sample, #1 (--input-len 16 with --output-len 4), needs 22 (18 prompt + 4 output); give "
        "--num-kv-blocks 3 or more" in line
    )


def test_a_long_sampling_says_so(monkeypatch, capsys):
    monkeypatch.setattr(spanllm.commands.bench_throughput, "LONG_SAMPLE_REQUESTS", 3)
    assert main(RANDOM + ["--input-len", "8", "--output-len", "2", "--num-prompts", "4", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "sampling 4 random requests before the engine starts ..." in err
    assert "sampled 4 requests in " in err and "4 requests: mean prompt" in out


# --- 6. a samples file counted by another tokenizer -----------------------------------------------------------
@pytest.mark.parametrize("recorded", [{"tokenizer": "other-tok"}, {}])
def test_samples_file_of_another_tokenizer_is_refused(no_ranks, tmp_path, capsys, recorded):
    path = tmp_path / "s.json"
    reqs = [SampleRequest("hello world", 3, 2), SampleRequest("hi", 3, 2)]  # tiny's bytes: 12 and 3 with BOS
    save_samples(SampleSet(reqs, {"dataset_name": "sharegpt", **recorded}), str(path))
    assert main(TP + ["--samples-file", str(path), "--dry-run"]) == 2
    line = one_error_line(capsys)
    named = " ('other-tok')" if recorded else ""
    assert (
        f"--samples-file {path}: its prompts were counted by another tokenizer{named}: request 0 was saved as 3 "
        "tokens, and --model tiny's tokenizer ('bytes') makes 12 of it (1 of 2 requests differ; mean prompt 3.0 "
        "saved, 7.5 here); run the model it was sampled for, or sample again" in line
    )


def test_saved_samples_name_their_tokenizer_and_read_back(tmp_path, capsys):
    import json

    path = tmp_path / "s.json"
    argv = RANDOM + ["--input-len", "8", "--output-len", "2", "--num-prompts", "3", "--dry-run"]
    assert main(argv + ["--save-samples", str(path)]) == 0
    assert json.loads(path.read_text())["info"]["tokenizer"] == "bytes"
    assert main(TP + ["--samples-file", str(path), "--dry-run"]) == 0  # same tokenizer: same counts
    assert "3 requests: mean prompt" in capsys.readouterr().out


# --- 4. a collective timeout is a known error: its one line, no traceback --------------------------------------
def test_collective_timeout_is_one_line_without_traceback(capfd):
    argv = RANDOM + ["--input-len", "4", "--output-len", "2", "--num-prompts", "2", "--nprocs", "2"]
    assert main(argv + ["--pg-timeout", "0.001"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "--- traceback of rank" not in err, err
    # a timeout that hits while gloo connects its ranks also has torch's and gloo's C++ code log from the rank
    # ("[E1207 04:18:47.151923967 ProcessGroupGloo.cpp:67] ...", "[.../gloo/transport/tcp/debug_logger.cc:9] ERROR
    # failed to connect, ..."): their lines, not spanllm's
    lines = [x for x in err.strip().splitlines() if not re.match(r"\[[^\]]*\.(?:cpp|cc|h):\d+\]", x)]
    assert len(lines) == 1 and lines[0].startswith("spanllm: error: rank"), err
    assert "timed out after 0.001 s" in lines[0] and "raise the timeout with --pg-timeout" in lines[0]
