"""Bad input to `bench batch` and `bench study`: one line `spanllm: error: ...` naming the value, the limit and the
fix, exit code 2, before any rank starts or any file is written; a value that cannot apply (a micro-batch count
without a pipelined layout, a pipeline degree no layout has, more breakdown steps than decode steps) is refused,
not dropped. In-process through `spanllm.cli.main`."""

from __future__ import annotations

import pytest
from cli_output import one_error_line

import spanllm.commands.bench_batch
import spanllm.commands.bench_study
from spanllm.cli import main

SMALL = ["--model", "tiny", "--batch-sizes", "2", "--prompt-len", "8", "--decode-len", "4", "--iters", "1"]
BATCH = ["bench", "batch", *SMALL]
STUDY1 = ["bench", "study", *SMALL, "--nprocs", "1"]
STUDY2 = ["bench", "study", *SMALL, "--nprocs", "2"]


class _Launched(Exception):
    pass


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank is a failure of the test (bad input) or its end (good input)."""

    def launch(*args, **kwargs):
        raise _Launched

    monkeypatch.setattr(spanllm.commands.bench_batch, "launch", launch)
    monkeypatch.setattr(spanllm.commands.bench_study, "launch", launch)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    return tmp_path


CASES = [
    # 1. --json and --plot before the benchmark, each under its own name
    (BATCH + ["--json", "adir"], "--json adir: is a folder; give a file name inside it, e.g. --json adir/out.json"),
    (BATCH + ["--json", "afile/b.json"], "--json afile/b.json: cannot create its folder"),
    (
        BATCH + ["--plot", "p.txt"],
        "--plot p.txt: the plot is a PNG; give a file name ending in .png, e.g. --plot p.png",
    ),
    (BATCH + ["--plot", "adir"], "--plot adir: is a folder"),
    (BATCH + ["--plot", "afile/p.png"], "--plot afile/p.png: cannot create its folder"),
    (STUDY1 + ["--json", "adir"], "--json adir: is a folder"),
    (STUDY1 + ["--plot", "p.txt"], "--plot p.txt: the plot is a PNG; give a file name ending in .png"),
    # 2. --breakdown-steps past the decode steps
    (
        BATCH + ["--breakdown-steps", "100", "--json", "bd.json"],
        "--breakdown-steps 100: at most --decode-len - 1 = 3 (the decode steps after the first token); give at "
        "most 3, raise --decode-len, or leave --breakdown-steps out",
    ),
    (BATCH + ["--breakdown-steps", "4"], "--breakdown-steps 4: at most --decode-len - 1 = 3"),
    (
        ["bench", "batch", "--model", "tiny", "--workload", "prefill-heavy", "--prompt-len", "8"]
        + ["--breakdown-steps", "32"],
        "--breakdown-steps 32: at most decode length (prefill-heavy: 32) - 1 = 31",
    ),
    (
        BATCH + ["--decode-len", "1", "--breakdown-steps", "1"],
        "--breakdown-steps 1: --decode-len 1 leaves no decode step after the first token, so no per-op timing pass",
    ),
    (STUDY1 + ["--breakdown-steps", "9"], "--breakdown-steps 9: at most --decode-len - 1 = 3"),
    # 3. bench study: micro-batch counts without a pipelined layout, pipeline degrees no layout has
    (
        STUDY1 + ["--micro-batches", "9"],
        "--micro-batches 9: applies to pipeline layouts (pp > 1), and this study runs none (TP=1 x PP=1); run more "
        "ranks (--nprocs) for a pipelined layout, or drop --micro-batches",
    ),
    (
        STUDY2 + ["--pp", "1", "--micro-batches", "2"],
        "--micro-batches 2: applies to pipeline layouts (pp > 1), and this study runs none (TP=2 x PP=1); add a "
        "pipeline degree to --pp (e.g. --pp 1,2), or drop --micro-batches",
    ),
    (STUDY2 + ["--pp", "1", "--micro-batches", "1,4"], "--micro-batches 4: applies to pipeline layouts (pp > 1)"),
    (
        STUDY2 + ["--pp", "2,7"],
        "--pp 7: does not divide the 2 ranks; valid layouts: TP=2 x PP=1, TP=1 x PP=2 (drop 7)",
    ),
    (
        ["bench", "study", *SMALL, "--nprocs", "8", "--pp", "2,8"],
        "--pp 8: layout TP=1 x PP=8: pp=8 exceeds the 4 layers of tiny",
    ),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a[1:])[:90] for a, _ in CASES])
def test_bad_batch_input_is_one_line_exit_2(no_ranks, files, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)
    assert sorted(p.name for p in files.iterdir()) == ["adir", "afile"]  # nothing written


@pytest.mark.parametrize(
    "argv",
    [
        BATCH + ["--json", "b.json", "--plot", "b.png", "--breakdown-steps", "3"],
        BATCH + ["--decode-len", "1"],  # the default breakdown steps: capped, not refused
        STUDY1 + ["--micro-batches", "1,pp", "--json", "s.json", "--plot", "s.png"],
        STUDY2 + ["--micro-batches", "2"],
        STUDY2 + ["--pp", "1,2", "--micro-batches", "2"],
        STUDY2 + ["--pp", "1", "--micro-batches", "1"],
    ],
)
def test_good_batch_input_reaches_the_launch(no_ranks, files, argv):
    with pytest.raises(_Launched):
        main(argv)


def test_breakdown_plot_is_saved_under_plot(monkeypatch, tmp_path):
    """A plot that cannot be written names --plot (it once named --json)."""
    pytest.importorskip("matplotlib")
    saved = []
    monkeypatch.setattr(spanllm.commands.bench_batch, "save_figure", lambda flag, path, fig, **kw: saved.append(flag))
    row = {"tp": 1, "pp": 1, "micro_batches": 1, "batch": 2, "allreduce_ran": "none", "tpot_ms": 1.0}
    row["breakdown_ms"] = {"gemm": 0.5, "attention": 0.3}
    spanllm.commands.bench_batch.plot_breakdown([row], str(tmp_path / "p.png"), "title")
    assert saved == ["--plot"]
