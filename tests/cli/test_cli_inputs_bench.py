"""Bad input to `bench throughput`, `bench serve` and `bench multi-turn`: one line `spanllm: error: ...` naming the
value and the fix, exit code 2, before any rank starts, any server is asked or any file is written. In-process
through `spanllm.cli.main`."""

from __future__ import annotations

import json

import pytest
from cli_output import one_error_line

import spanllm.bench.serve_client
import spanllm.commands.bench_serve
import spanllm.commands.bench_throughput
from spanllm.bench.datasets import SampleRequest, SampleSet
from spanllm.bench.sample_file import save_samples
from spanllm.cli import main

TP = ["bench", "throughput", "--model", "tiny"]
RANDOM = TP + ["--dataset-name", "random"]
SERVE = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
MT = ["bench", "multi-turn", "--base-url", "http://127.0.0.1:9"]
MT_DRY = ["bench", "multi-turn", "--dry-run"]


@pytest.fixture
def no_work(monkeypatch):
    """Starting a rank or asking a server is a failure of the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started for bad input")

    monkeypatch.setattr(spanllm.commands.bench_throughput, "launch", refuse)
    monkeypatch.setattr(spanllm.commands.bench_serve, "first_model", refuse)
    monkeypatch.setattr(spanllm.bench.serve_client, "first_model", refuse)  # bench multi-turn imports it in run


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "turns.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, 7]}]))
    (tmp_path / "adir").mkdir()
    save_samples(SampleSet([SampleRequest(f"w {i}", 2, 2) for i in range(4)], {}), str(tmp_path / "s4.json"))
    return tmp_path


CASES = [
    # 1. the ShareGPT file's schema, a folder for a file
    (
        TP + ["--dry-run", "--dataset-path", "list.json"],
        'list.json: entry 0 is 1; expected a ShareGPT record, {"conversations": [{"from": "human"',
    ),
    (MT_DRY + ["--tokenizer", "tiny", "--dataset-path", "list.json"], "list.json: entry 0 is 1; expected"),
    (TP + ["--dry-run", "--dataset-path", "turns.json"], 'turns.json: entry 0, turn 1 is 7; expected {"from"'),
    (TP + ["--dataset-path", "adir"], "--dataset-path adir: is a folder; give a ShareGPT V3 JSON file"),
    (MT + ["--dataset-path", "adir"], "--dataset-path adir: is a folder"),
    # 2. --samples-file: before any rank
    (TP + ["--samples-file", "/nonexist"], "--samples-file '/nonexist' is not a saved sample (FileNotFoundError"),
    (TP + ["--samples-file", "list.json"], "--samples-file 'list.json' is not a saved sample (TypeError"),
    (TP + ["--samples-file", "adir"], "--samples-file 'adir' is a folder"),
    (
        TP + ["--samples-file", "s4.json", "--num-prompts", "10", "--dry-run"],
        "spanllm: error: --num-prompts 10: --samples-file s4.json holds 4 requests; give at most 4 or leave "
        "--num-prompts out",
    ),
    (TP + ["--samples-file", "s4.json", "--num-prompts", "5"], "--num-prompts 5: --samples-file s4.json holds 4"),
    (
        SERVE + ["--model", "tiny", "--samples-file", "s4.json", "--num-prompts", "10"],
        "spanllm: error: --num-prompts 10: --samples-file s4.json holds 4 requests; give at most 4 or leave "
        "--num-prompts out",
    ),
    # 3. bench serve: --extra-body a JSON object, --metric-percentiles numbers in (0, 100]
    (SERVE + ["--extra-body", "[1]"], "--extra-body '[1]': a JSON list, merged into a request body it must be an"),
    (SERVE + ["--extra-body", "{x"], "--extra-body '{x': not JSON"),
    (SERVE + ["--metric-percentiles", "abc"], "--metric-percentiles 'abc': 'abc' is not a percentile in (0, 100]"),
    (SERVE + ["--metric-percentiles", "50,nan"], "'nan' is not a percentile in (0, 100]; give comma-separated"),
    (SERVE + ["--metric-percentiles", "0"], "--metric-percentiles '0': '0' is not a percentile in (0, 100]"),
    (SERVE + ["--metric-percentiles", "100.5"], "'100.5' is not a percentile in (0, 100]"),
    # 4. bench multi-turn: lengths and the timeout, before the server is asked
    (MT + ["--output-len", "0"], "--output-len 0: must be >= 1"),
    (MT + ["--max-output-len", "0"], "--max-output-len 0: must be >= 1"),
    (MT + ["--request-timeout", "-1"], "--request-timeout -1.0: must be > 0 seconds"),
    (MT + ["--request-timeout", "nan"], "--request-timeout nan: must be > 0 seconds"),
    (MT + ["--max-turns", "1", "--min-turns", "2"], "--max-turns 1: must be >= --min-turns 2"),
    # 5. output paths, before the work
    (TP + ["--dry-run", "--save-samples", "adir"], "--save-samples adir: is a folder; give a file name inside it"),
    (TP + ["--json", "adir"], "--json adir: is a folder"),
    (TP + ["--json", "list.json/r.json"], "--json list.json/r.json: cannot create its folder"),
    (MT + ["--json", "adir"], "--json adir: is a folder"),
    (MT + ["--save-conversations", "adir"], "--save-conversations adir: is a folder"),
    (SERVE + ["--save-result", "--result-dir", "list.json"], "--result-dir list.json: "),
    (
        SERVE + ["--save-result", "--result-dir", ".", "--result-filename", "adir"],
        "--result-filename ./adir: is a folder",
    ),
    # 6. options accepted and ignored
    (
        RANDOM + ["--sharegpt-output-len", "3"],
        "--sharegpt-output-len 3: an option of --dataset-name sharegpt, and this run samples --dataset-name random; "
        "drop it, or use --dataset-name sharegpt",
    ),
    (RANDOM + ["--gsp-num-groups", "2"], "--gsp-num-groups 2: an option of --dataset-name generated-shared-prefix"),
    (TP + ["--random-input-len", "9"], "--random-input-len 9: an option of --dataset-name random"),
    (TP + ["--input-len", "9"], "--input-len 9: sets --random-input-len, options of --dataset-name random"),
    (TP + ["--dry-run", "--json", "out.json"], "--json out.json: --dry-run starts no engine, so there is no result"),
    (MT_DRY + ["--json", "out.json"], "--json out.json: --dry-run sends no request"),
    (MT + ["--dry-run", "--tokenizer", "tiny"], "--base-url http://127.0.0.1:9: --dry-run only samples conversations"),
    (MT_DRY + ["--tokenizer", "tiny", "--request-rate", "4"], "--request-rate 4.0: --dry-run only samples conver"),
    (SERVE + ["--result-dir", "res"], "--result-dir res: a single-rate run writes its JSON only with --save-result"),
    (SERVE + ["--save-result", "--result-dir", "res", "--result-filename", ""], "--result-filename '': empty"),
    (SERVE + ["--result-filename", "r.json"], "--result-filename shapes the result file, and this run writes none"),
    # 7. values that were silently altered
    (RANDOM + ["--random-output-len", "0"], "--random-output-len 0: must be >= 1"),
    (RANDOM + ["--output-len", "0"], "--output-len 0: must be >= 1"),
    (RANDOM + ["--random-prefix-len", "-1"], "--random-prefix-len -1: must be >= 0"),
    # 8. an alias and its option that disagree
    (
        RANDOM + ["--input-len", "6", "--random-input-len", "9"],
        "--input-len 6 and --random-input-len 9 disagree (--input-len is an alias of --random-input-len)",
    ),
    (RANDOM + ["--output-len", "3", "--random-output-len", "5"], "--output-len 3 and --random-output-len 5 disagree"),
    (TP + ["--output-len", "3", "--sharegpt-output-len", "5"], "--output-len 3 and --sharegpt-output-len 5 disagree"),
    # 9. the dataset's plain values, before any rank starts
    (RANDOM + ["--random-range-ratio", "1.5"], "--random-range-ratio 1.5: must be in [0, 1)"),
    (RANDOM + ["--random-range-ratio", "nan"], "--random-range-ratio nan: must be in [0, 1)"),
    (RANDOM + ["--random-input-len", "0"], "--random-input-len 0: must be >= 1"),
    (TP + ["--dataset-path", "missing.json"], "--dataset-path missing.json: no such file"),
    (
        TP + ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--num-prompts", "5"],
        "--num-prompts 5: generated-shared-prefix sends --gsp-num-groups x --gsp-prompts-per-group = 32 requests",
    ),
    (TP + ["--dataset-name", "prefix_repetition", "--num-prompts", "3"], "--num-prompts 3 is below"),
    (SERVE + ["--dataset-name", "random", "--random-output-len", "0"], "--random-output-len 0: must be in [1,"),
    (SERVE + ["--sharegpt-output-len", "4", "--dataset-name", "random"], "--sharegpt-output-len 4: an option of"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a[1:])[:80] for a, _ in CASES])
def test_bad_bench_input_is_one_line_exit_2(no_work, files, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)
    assert not (files / "out.json").exists() and not (files / "res").exists()


def test_matching_alias_and_own_options_reach_the_launch(files, monkeypatch):
    launched = []
    monkeypatch.setattr(spanllm.commands.bench_throughput, "launch", lambda *a, **k: launched.append(a) or [None])
    argv = RANDOM + ["--input-len", "6", "--random-input-len", "6", "--random-prefix-len", "0", "--num-prompts", "2"]
    assert main(argv) == 0 and len(launched) == 1


def test_dry_run_samples_file_honours_num_prompts(files, capsys):
    saved = files / "s.json"
    argv = RANDOM + ["--dry-run", "--input-len", "6", "--output-len", "2", "--num-prompts", "4"]
    assert main(argv + ["--save-samples", str(saved)]) == 0
    assert main(TP + ["--dry-run", "--samples-file", str(saved), "--num-prompts", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 requests: mean prompt" in out and "dry run: the engine flags were checked against them" in out
    for n in (["--num-prompts", "4"], []):  # the file's count, or left out: every request
        assert main(TP + ["--dry-run", "--samples-file", str(saved), *n]) == 0
        assert "4 requests: mean prompt" in capsys.readouterr().out
