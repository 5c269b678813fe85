"""Bad input to `bench allreduce`, `tune`, `demo`, `bench host`, `plan` and `perf calibrate / validate`: one line
`spanllm: error: ...` naming the value and the fix, exit code 2, before any rank starts, anything is measured or
any file is written; an option that would have no effect in the run is refused, not ignored. In-process through
`spanllm.cli.main` (local ranks: CPU over gloo)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from cli_output import one_error_line

import spanllm.commands.bench_allreduce
import spanllm.commands.bench_host
import spanllm.commands.demo
import spanllm.commands.perf_calibrate
import spanllm.commands.perf_validate
import spanllm.commands.plan
import spanllm.commands.tune
from spanllm.cli import main
from spanllm.commands.demo import table_sizes
from spanllm.errors import SpanllmError
from spanllm.output_files import write_result
from spanllm.perf.model_shape import get_model

AR = ["bench", "allreduce", "--nprocs", "2"]
TUNE = ["tune", "--out", "t.json"]
HOST = ["bench", "host"]
PLAN = ["plan", "--model", "llama3.1-8b", "--cluster", "h200x2", "--nodes", "1"]
SERVE = PLAN + ["--serve", "--lengths", "8:8"]
VALIDATE = ["perf", "validate", "--results", "res"]
CONTEXT = get_model("llama3.1-8b").max_position_embeddings  # the model config's, 131,072 for Llama 3.1


class _Worked(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Starting a rank, measuring or pricing anything is a failure of the test (bad input) or its end (good)."""

    def work(*args, **kwargs):
        raise _Worked

    for mod in (spanllm.commands.bench_allreduce, spanllm.commands.tune, spanllm.commands.demo):
        monkeypatch.setattr(mod, "launch", work)
    monkeypatch.setattr(spanllm.commands.bench_host, "measure", work)
    monkeypatch.setattr(spanllm.commands.plan, "run_static", work)
    monkeypatch.setattr(spanllm.commands.plan, "run_serve", work)
    monkeypatch.setattr(spanllm.commands.perf_calibrate, "load_results", work)
    monkeypatch.setattr(spanllm.commands.perf_validate, "validate", work)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "res").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "bad.json").write_text("{}")
    return tmp_path


CASES = [
    # 1. output paths, before any rank or measurement
    (AR + ["-e", "64", "-n", "2", "-w", "1", "--json", "adir"], "--json adir: is a folder; give a file name inside it"),
    (AR + ["--json", "bad.json/x.json"], "--json bad.json/x.json: cannot create its folder"),
    (AR + ["--json", "a.json", "--plot", "adir"], "--plot adir: is a folder"),
    (AR + ["--json", "a.json", "--plot", "p"], "--plot p: the plot is a PNG; give a file name ending in .png"),
    (["demo", "--json", "adir"], "--json adir: is a folder"),
    (HOST + ["--json", "adir"], "--json adir: is a folder"),
    (["tune", "--out", "adir"], "--out adir: is a folder"),
    (["tune", "--out", ""], "--out '': empty; give a file name"),
    (PLAN + ["--json", "adir"], "--json adir: is a folder"),
    (PLAN + ["--json", "bad.json/x.json"], "--json bad.json/x.json: cannot create its folder"),
    (PLAN + ["--plot", "p2"], "--plot p2: the plot is a PNG; give a file name ending in .png, e.g. --plot p2.png"),
    (["perf", "calibrate", "--out", "adir"], "--out adir: is a folder"),
    (VALIDATE + ["--out", "adir"], "--out adir: is a folder"),
    (VALIDATE + ["--out", "v.json", "--plot", "adir"], "--plot adir: is a folder"),
    (VALIDATE + ["--out", "v.json", "--plot", "p"], "--plot p: the plot is a PNG; give a file name ending in .png"),
    (VALIDATE + ["--plot", "p.svg"], "--plot p.svg: the plot is a PNG"),
    (VALIDATE + ["--out", "v.png"], "--out v.png: the report is JSON, its plot goes next to it as .png"),
    # 2. options no algorithm of the run reads (CPU ranks: no nvrar, no symmetric memory); sizes >= 1 byte
    (TUNE + ["--buffer-bytes", "1"], "--buffer-bytes '1': sizes the symmetric buffer of the GPU candidates"),
    (TUNE + ["--blocks", "3"], "--blocks '3': is an nvrar launch parameter, and nvrar does not run on CPU"),
    (TUNE + ["--tiles", "7"], "--tiles '7': is an nvrar launch parameter"),
    (TUNE + ["--protocols", "simple"], "--protocols 'simple': is an nvrar launch parameter"),
    (TUNE + ["--pipelined", "1"], "--pipelined '1': is an nvrar launch parameter"),
    (TUNE + ["--buffer-bytes", "0"], "--buffer-bytes 0: the symmetric buffer must be >= 1 byte"),
    (AR + ["--buffer-bytes", "0"], "--buffer-bytes 0: the symmetric buffer must be >= 1 byte"),
    (AR + ["--buffer-bytes", "1M"], "--buffer-bytes 1M: read by nvrar / torch_one_shot / torch_two_shot only, and"),
    (AR + ["--timeout-s", "5"], "--timeout-s 5.0: read by nvrar only, and these ranks run on CPU"),
    (AR + ["--algos", "gloo", "--tuning", "t.json"], "--tuning t.json: read by auto / nvrar only, and none of them"),
    # 3. the size factor: finite and > 1
    (AR + ["-f", "nan"], "-f nan: the size factor must be a finite number > 1"),
    (AR + ["-f", "inf"], "-f inf: the size factor must be a finite number > 1"),
    (TUNE + ["-f", "nan"], "-f nan: the size factor must be a finite number > 1"),
    # 4. plan: an option of the other mode; --samples-file and --lengths exclusive
    (PLAN + ["--lengths", "100:10"], "--lengths 100:10: an option of serving (--serve); without --serve"),
    (PLAN + ["--gpus", "4"], "--gpus 4: an option of serving (--serve)"),
    (PLAN + ["--max-num-seqs", "8"], "--max-num-seqs 8: an option of serving (--serve)"),
    (SERVE + ["--batch", "7"], "--batch 7: prices the static batch, and --serve plans serving a trace"),
    (SERVE + ["--no-cuda-graphs"], "--no-cuda-graphs: prices the static batch"),
    (SERVE + ["--plot", "p2.png"], "--plot p2.png: draws the static batch's rows (serving has no plot)"),
    (SERVE + ["--samples-file", "bad.json"], "--samples-file 'bad.json' and --lengths '8:8' are exclusive"),
    # plan: sequences past the model's context
    (
        PLAN + ["--prompt", "1000000", "--decode", "5", "--batch", "1"],
        f"--prompt + --decode: 1000000 + 5 = 1000005 tokens exceed the {CONTEXT}-token context of llama3.1-8b "
        f"(max_position_embeddings), which the engine would refuse; give at most {CONTEXT} in all",
    ),
    (PLAN + ["--prompt", str(CONTEXT)], f"--prompt + --decode: {CONTEXT} + 256 = {CONTEXT + 256} tokens exceed"),
    (
        PLAN + ["--serve", "--lengths", "200000:5", "--num-requests", "2"],
        f"--lengths 200000:5: 200000 + 5 = 200005 tokens exceed the {CONTEXT}-token context of llama3.1-8b",
    ),
    (PLAN + ["--serve", "--lengths", f"{CONTEXT}:1"], f"--lengths {CONTEXT}:1: {CONTEXT} + 1 = {CONTEXT + 1} tokens"),
    # 5. bench host
    (HOST + ["--question-len", "5"], "--question-len 5: the tokens after a family's shared prefix, and without"),
    (HOST + ["--families", "2", "--prompt-len", "100"], "--question-len 128 (the default): must be in [1, --prompt"),
    (HOST + ["--temperature", "-1"], "--temperature -1: must be in [0, 100] (0 = greedy)"),
    (HOST + ["--temperature", "nan"], "--temperature nan: must be in [0, 100]"),
    (HOST + ["--max-num-batched-tokens", "1"], "--max-num-batched-tokens 1 is below --max-num-seqs 256"),
    # 6. demo
    (["demo", "--no-engine", "--no-real-model"], "--no-real-model: the real model runs after the engine part"),
    (["demo", "--maxbytes", "4"], "--maxbytes 4: must be >= 8 bytes"),
    (["demo", "--maxbytes", "lots"], "--maxbytes: size 'lots' is not a byte count"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(no_work, files, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)
    assert not any(p.name.endswith(".tmp") for p in files.iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        TUNE,
        AR + ["--algos", "gloo,ref_ring"],
        HOST + ["--families", "2"],
        HOST + ["--families", "2", "--question-len", "5"],
        PLAN + ["--batch", "7", "--no-cuda-graphs", "--plot", "p.png", "--json", "p.json"],
        SERVE + ["--max-num-seqs", "8", "--json", "-"],
        PLAN + ["--prompt", str(CONTEXT - 256)],
        PLAN + ["--serve", "--lengths", f"{CONTEXT - 1}:1"],
        VALIDATE + ["--out", "v.json", "--plot", "p.png"],
    ],
)
def test_good_input_reaches_the_work(no_work, files, argv):
    with pytest.raises(_Worked):
        main(argv)


def test_plan_json_to_stdout_still_draws_the_plot(files, capsys):
    """`--json - --plot P`: the JSON on stdout and the PNG drawn (it was once left out without a word)."""
    argv = PLAN + ["--batch", "4", "--prompt", "256", "--decode", "32", "--json", "-", "--plot", "p.png"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["rows"] and out.err.strip() == "wrote p.png"
    assert (files / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_serve_refuses_a_saved_request_past_the_context(files, capsys, monkeypatch):
    import spanllm.perf.serving

    monkeypatch.setattr(spanllm.perf.serving, "plan_serve", lambda *a, **k: pytest.fail("priced a bad trace"))
    doc = {"requests": [{"prompt": "a", "prompt_len": 10, "output_len": 2}]}
    doc["requests"].append({"prompt": "b", "prompt_len": CONTEXT, "output_len": 3})
    (files / "long.json").write_text(json.dumps(doc))
    assert main(PLAN + ["--serve", "--samples-file", "long.json"]) == 2
    assert one_error_line(capsys) == (
        f"spanllm: error: --samples-file long.json: request 1: {CONTEXT} + 3 = {CONTEXT + 3} tokens exceed the "
        f"{CONTEXT}-token context of llama3.1-8b (max_position_embeddings), which the engine would refuse; drop it "
        "from the file"
    )


def test_write_json_to_a_folder_keeps_the_result_elsewhere_and_leaves_no_tmp_file(tmp_path):
    with pytest.raises(
        SpanllmError, match=r"--json .*: cannot be written \(Is a directory\); the result was saved to (\S+) instead"
    ) as e:
        write_result(str(tmp_path), "allreduce", {"size": 8}, [{"us": 1.5}])
    kept = e.value.args[0].rsplit("saved to ", 1)[1].removesuffix(" instead")
    try:
        doc = json.loads(Path(kept).read_text())
        assert (doc["kind"], doc["settings"], doc["rows"]) == ("allreduce", {"size": 8}, [{"us": 1.5}])
    finally:
        os.remove(kept)
    assert [p.name for p in tmp_path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_demo_table_ends_at_maxbytes():
    assert table_sizes(64) == [8, 32, 64]
    assert table_sizes(1 << 20)[-2:] == [1 << 19, 1 << 20]  # 8 x 4^k up to 512K, then --maxbytes itself
    assert table_sizes(8) == [8] and table_sizes(32) == [8, 32]
    args = argparse.Namespace(maxbytes="64", iters=1, ranks_per_node=2, json=None)
    assert spanllm.commands.demo._bench_args(args).sizes == [8, 32, 64]  # the list bench_rank runs


def test_perf_validate_without_measurements_is_a_usage_error(files, capsys):
    assert main(VALIDATE + ["--out", "v.json"]) == 2
    line = one_error_line(capsys)
    assert "--results 'res': no measurement in it that the model predicts" in line and "nothing written" in line
    assert not (files / "v.json").exists()
