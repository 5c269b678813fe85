"""Round 13 of the CLI audit: flags accepted and then ignored or overridden (an empty --samples-file, --allreduce,
--tokenizer, --label; --host / --port beside --base-url; --max-output-len beside --output-len; an --extra-body key a
flag also sets), seeds that failed inside a rank or numpy, two output flags naming one file, launcher variables
that are not integers, GPU benchmarks that checked their flags only on a GPU, and `bench batch`'s breakdown pass
that outgrew a short run's context after the rows were measured. In-process through `spanllm.cli.main`."""

from __future__ import annotations

import json

import pytest
from cli_output import one_error_line

import spanllm.bench.serve_client
import spanllm.commands.bench_batch
import spanllm.commands.bench_serve
import spanllm.commands.bench_throughput
import spanllm.commands.generate
import spanllm.commands.perf_calibrate
import spanllm.commands.serve
from spanllm.bench.datasets import SampleRequest, SampleSet
from spanllm.bench.sample_file import save_samples
from spanllm.cli import main
from spanllm.model.loader import RANDOM_INIT_SEEDS

GEN = ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
TP = ["bench", "throughput", "--model", "tiny"]
RANDOM = TP + ["--dataset-name", "random", "--input-len", "4", "--output-len", "2", "--num-prompts", "2"]
BATCH = ["bench", "batch", "--model", "tiny", "--batch-sizes", "1", "--prompt-len", "4", "--decode-len", "2"]
SERVE = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
MT = ["bench", "multi-turn", "--model", "m", "--tokenizer", "tiny"]
MT_DRY = ["bench", "multi-turn", "--dry-run", "--tokenizer", "tiny"]
HUGE = "99999999999999999999999"


class _Worked(Exception):
    pass


def _work(*args, **kwargs):
    raise _Worked


@pytest.fixture
def no_work(monkeypatch):
    """Starting a rank, asking a server or reading measurements is a failure of the test (bad input)."""
    for mod in (
        spanllm.commands.generate,
        spanllm.commands.bench_throughput,
        spanllm.commands.bench_batch,
        spanllm.commands.serve,
    ):
        monkeypatch.setattr(mod, "launch", _work, raising=False)
    monkeypatch.setattr("spanllm.launch.launch", _work)
    monkeypatch.setattr(spanllm.commands.bench_serve, "first_model", _work)
    monkeypatch.setattr(spanllm.bench.serve_client, "first_model", _work)
    monkeypatch.setattr(spanllm.commands.perf_calibrate, "load_results", _work)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    save_samples(SampleSet([SampleRequest(f"w {i}", 2, 2) for i in range(4)], {}), str(tmp_path / "s4.json"))
    return tmp_path


CASES = [
    # 1. an engine seed the generators cannot take: refused before any rank (was: a rank's traceback, exit 1)
    (GEN + ["--seed", HUGE], f"--seed {HUGE}: give an integer in [-9223372036854775808, 9223372036854775807] (int64)"),
    (BATCH + ["--seed", HUGE], f"--seed {HUGE}: give an integer in [-9223372036854775808, 9223372036854775807]"),
    (
        GEN + ["--seed", str(RANDOM_INIT_SEEDS[1] + 1)],
        f"--seed {RANDOM_INIT_SEEDS[1] + 1}: the random weights of tiny draw from seed x 1,000,003 + rank, which "
        f"must fit int64; give a seed in [-9223344366821, {RANDOM_INIT_SEEDS[1]}]",
    ),
    (BATCH + ["--seed", str(2**62)], f"--seed {2**62}: the random weights of tiny draw from seed x 1,000,003"),
    (RANDOM + ["--seed", str(2**62), "--dry-run"], f"--seed {2**62}: the random weights of tiny draw from seed"),
    (["serve", "--model", "tiny", "--seed", str(2**62)], f"--seed {2**62}: the random weights of tiny draw from"),
    # 2. a negative sampling seed: numpy's generator refused it with a traceback
    (
        RANDOM + ["--seed", "-1", "--dry-run"],
        "--seed -1: the request sampling seeds Python's and numpy's generators, which take no negative seed; give a "
        "seed >= 0",
    ),
    # 3. empty values that fell back to the default without a word
    (GEN + ["--allreduce", ""], "--allreduce '': empty; give a registered all-reduce name"),
    (RANDOM + ["--samples-file", ""], "--samples-file '': empty; give a file saved by `bench throughput --save-sampl"),
    (SERVE + ["--model", "tiny", "--samples-file", ""], "--samples-file '': empty"),
    (TP + ["--dataset-path", "", "--dry-run"], "--dataset-path '': empty; give a ShareGPT V3 JSON file"),
    (MT_DRY + ["--dataset-path", ""], "--dataset-path '': empty; give a ShareGPT V3 JSON file"),
    (["bench", "multi-turn", "--dry-run", "--tokenizer", ""], "--tokenizer '': empty; give a value"),
    (SERVE + ["--tokenizer", ""], "--tokenizer '': empty; give a value, or leave --tokenizer out"),
    (SERVE + ["--label", ""], "--label '': empty"),
    (SERVE + ["--percentile-metrics", ""], "--percentile-metrics '': no metric; give comma-separated names from"),
    (["bench", "serve", "--base-url", ""], "--base-url '': give the server's URL with its scheme and host"),
    (["bench", "multi-turn", "--base-url", ""], "--base-url '': empty"),
    (["perf", "calibrate", "--name", ""], "--name '': empty; give the written preset a name"),
    # 4. two output flags (or an output and an input) naming one file: one would overwrite the other
    (
        RANDOM + ["--json", "r.json", "--save-samples", "r.json"],
        "--save-samples r.json and --json r.json name one file, and the run would overwrite one with the other",
    ),
    (TP + ["--samples-file", "s4.json", "--json", "./s4.json"], "--samples-file s4.json and --json ./s4.json name one"),
    (TP + ["--samples-file", "s4.json", "--save-samples", "s4.json"], "--samples-file s4.json and --save-samples s4"),
    (MT + ["--json", "c.json", "--save-conversations", "c.json"], "--save-conversations c.json and --json c.json name"),
    # 5. --host / --port beside --base-url, which names both: they were dropped
    (SERVE + ["--port", "1234"], "--port 1234: the server is --base-url http://127.0.0.1:9, which names its host and"),
    (SERVE + ["--host", "example.org"], "--host example.org: the server is --base-url http://127.0.0.1:9"),
    (MT + ["--base-url", "http://127.0.0.1:9", "--host", "1.2.3.4"], "--host 1.2.3.4: the server is --base-url"),
    (["bench", "serve", "--base-url", "127.0.0.1:9"], "--base-url '127.0.0.1:9': give the server's URL with its sch"),
    (MT + ["--port", "0"], "--port 0: must be in [1, 65535]"),
    (["bench", "serve", "--port", "70000"], "--port 70000: must be in [1, 65535]"),
    (SERVE + ["--endpoint", "v1/completions"], "--endpoint 'v1/completions': an API path, starting with '/'"),
    (SERVE + ["--endpoint", ""], "--endpoint '': an API path, starting with '/'"),
    # 6. a flag another flag overrode
    (
        SERVE + ["--temperature", "0.5", "--extra-body", '{"temperature": 5}'],
        "--temperature 0.5 and --extra-body '{\"temperature\": 5}' both set 'temperature' (the body would win); give",
    ),
    (
        MT_DRY + ["--output-len", "10", "--max-output-len", "5"],
        "--max-output-len 5 caps the ShareGPT answers' lengths, and --output-len 10 sets every answer's length "
        "instead; give one of them",
    ),
    # 7. the GPU benchmarks' own flags, checked before they ask for a GPU (on CPU they named only the GPU)
    (["bench", "attention", "--json", "adir"], "--json adir: is a folder"),
    (["bench", "attention", "--kv-heads", "5"], "--kv-heads 5: must divide --heads 32"),
    (["bench", "attention", "--heads", "0"], "--heads 0: must be >= 1"),
    (["bench", "attention", "--dtype", "bogus"], "--dtype 'bogus': dtype='bogus' is not supported"),
    (["bench", "gemm", "--json", "adir"], "--json adir: is a folder"),
    (["bench", "gemm", "--models", ""], "--models '': nothing to time; give a comma list"),
    (["bench", "gemm", "--layers", ","], "--layers ',': nothing to time"),
    (["bench", "gemm", "--copy-gib", "nan"], "--copy-gib nan: must be a finite size >= 0 GiB"),
    (["bench", "gemm", "--override-gain", "1"], "--override-gain 1.0: a fraction in [0, 1)"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a)[:80] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(no_work, files, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)
    assert not (files / "r.json").exists() and not (files / "c.json").exists()
    assert not (files / "calibrated_cluster.json").exists()
    assert json.loads((files / "s4.json").read_text())  # an input named as an output is left as it was


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': not an integer; under a launcher"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1.5"}, "LOCAL_RANK='1.5': not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 WORLD_SIZE=2: a rank must be in [0, WORLD_SIZE)"),
    ],
)
def test_launcher_variables_that_are_not_a_place_in_the_job(no_work, monkeypatch, capsys, env, needle):
    """They ended in a ValueError traceback from int() (or a rendezvous waiting for a rank that does not exist)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(GEN) == 2
    assert needle in one_error_line(capsys)


def test_a_checkpoint_takes_any_int64_seed(no_work):
    """Only a preset's random weights multiply the seed; a checkpoint's seed is the sampler's alone (int64)."""
    argv = ["generate", "--model", "smollm2-135m-instruct", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    with pytest.raises(_Worked):
        main(argv + ["--seed", str(2**63 - 1)])


def test_good_launcher_variables_and_seeds_reach_the_launch(no_work, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(_Worked):
        main(GEN + ["--seed", str(RANDOM_INIT_SEEDS[1])])
    monkeypatch.delenv("RANK")
    with pytest.raises(_Worked):
        main(GEN + ["--seed", "-1"])  # a negative engine seed stays valid


@pytest.mark.parametrize(
    "extra,url",
    [([], "http://127.0.0.1:8000"), (["--port", "9001"], "http://127.0.0.1:9001"), (["--host", "h"], "http://h:8000")],
)
def test_bench_serve_host_and_port_build_the_url(monkeypatch, capsys, extra, url):
    seen = []

    async def first(session, base_url, *args):
        seen.append(base_url)
        raise _Worked

    monkeypatch.setattr(spanllm.commands.bench_serve, "first_model", first)
    with pytest.raises(_Worked):
        main(["bench", "serve", *extra])
    assert seen == [url]


def test_bench_batch_breakdown_fits_a_short_decode(tmp_path, capsys):
    """--decode-len 2 on a 4-token prompt: the breakdown's untimed warm-up pass asked for 8 + 3 tokens past the
    engine's max_model_len (prompt + decode = 6), so the run failed after its rows were measured."""
    out = tmp_path / "b.json"
    assert main(BATCH + ["--iters", "1", "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["breakdown_steps"] == 1 and rows[0]["breakdown_ms"] is not None
