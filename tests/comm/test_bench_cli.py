"""`spanllm bench allreduce` end to end on 4 local gloo ranks (2 virtual nodes x 2), its size parsing, and the
`spanllm` command table."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from spanllm.cli import COMMANDS, main
from spanllm.comm import registry
from spanllm.commands import bench_allreduce as bench
from spanllm.commands.bench_allreduce import parse_size, sizes_from

SIZES = [8 * 4**k for k in range(10) if 8 * 4**k <= 1 << 20]  # 8, 32, ..., 512 Ki


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    """The acceptance command, run once; (exit code, JSON document, captured stdout)."""
    out = tmp_path_factory.mktemp("bench") / "out.json"
    argv = [
        "bench",
        "allreduce",
        "--nprocs",
        "4",
        "--ranks-per-node",
        "2",
        "-b",
        "8",
        "-e",
        "1M",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "--json",
        str(out),
    ]
    # The table is printed by rank 0, a spawned child writing to the inherited file descriptor 1, so capture
    # at the descriptor (capfd is per test; this fixture runs the command once for the module).
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(1)
        sys.stdout.flush()
        os.dup2(tmp.fileno(), 1)
        try:
            rc = main(argv)
            sys.stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        printed = io.TextIOWrapper(tmp, encoding="utf-8").read()
    with open(out) as f:
        doc = json.load(f)
    return rc, doc, printed


def test_acceptance_exit_code_and_document(acceptance):
    rc, doc, _ = acceptance
    assert rc == 0
    assert doc["kind"] == "allreduce"
    assert {"machine", "versions", "settings", "rows", "created"} <= set(doc)
    assert {"hostname", "cpu_count", "platform"} <= set(doc["machine"])
    assert {"spanllm", "torch", "python"} <= set(doc["versions"])
    s = doc["settings"]
    assert (
        s["world_size"],
        s["ranks_per_node"],
        s["topology"],
        s["dtype"],
        s["graph"],
        s["calls_per_sample"],
        s["iters"],
        s["warmup"],
        s["backend"],
    ) == (4, 2, "2x2", "float", False, 1, 3, 1, "gloo")
    assert s["algos"] == registry.algorithms_for_device("cpu")


def test_acceptance_every_algorithm_at_every_size_exact(acceptance):
    _, doc, _ = acceptance
    rows = doc["rows"]
    algos = registry.algorithms_for_device("cpu")
    assert SIZES == [8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288]
    assert [(r["size"], r["algo"]) for r in rows] == [(s, a) for s in SIZES for a in algos]
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["count"] == r["size"] // 4 and r["type"] == "float" and r["redop"] == "sum"
        assert (r["world_size"], r["ranks_per_node"], r["topology"]) == (4, 2, "2x2")
        assert r["ran"] == ("auto->gloo" if r["algo"] == "auto" else r["algo"])
        assert len(r["samples_us"]) == 3


def test_acceptance_bandwidth_definitions(acceptance):
    _, doc, _ = acceptance
    for r in doc["rows"]:
        assert r["time_us"] == pytest.approx(sorted(r["samples_us"])[1], rel=1e-12)  # median of 3 samples
        assert r["algbw_GBps"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-12)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (4 - 1) / 4, rel=1e-12)


def test_acceptance_printed_table(acceptance):
    _, doc, printed = acceptance
    lines = printed.splitlines()
    header = [ln for ln in lines if ln.startswith("#") and "#wrong" in ln]
    assert len(header) == 1
    assert header[0].split() == [
        "#",
        "size",
        "count",
        "type",
        "redop",
        "|",
        "time(us)",
        "p99(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "algo",
    ]
    table = [ln.split() for ln in lines if not ln.startswith("#") and " | " in ln]
    got = [(int(f[0]), int(f[1]), f[2], f[3], int(f[9]), f[10]) for f in table]
    want = [(r["size"], r["count"], "float", "sum", 0, r["ran"]) for r in doc["rows"]]
    assert got == want
    assert "# Out of bounds values : 0 OK" in lines
    assert (
        "# spanllm bench allreduce: 4 ranks as 2 node(s) x 2, backend gloo, dtype float, eager, "
        "1 calls per sample, 3 samples, 1 warm-up calls" in lines
    )


# --------------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize(
    "text,value",
    [
        ("8", 8),
        ("1K", 1024),
        ("1k", 1024),
        ("16M", 16 << 20),
        ("1G", 1 << 30),
        ("16MB", 16 << 20),
        ("4kb", 4096),
        ("1.5K", 1536),
        (" 2M ", 2 << 20),
        ("0.5M", 512 << 10),
        ("1024", 1024),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "", "M", "1X", "K1"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_sizes_from():
    assert sizes_from(8, 1 << 20, 4) == SIZES
    assert sizes_from(8, 8, 2) == [8]
    assert sizes_from(1, 10, 2) == [1, 2, 4, 8]
    assert sizes_from(1024, 1 << 20, 2) == [1 << k for k in range(10, 21)]
    assert sizes_from(8, 30, 1.5) == [8, 12, 18, 27]


@pytest.mark.parametrize(
    "b,e,f,needle",
    [
        (0, 100, 2, "sizes -b 0 -e 100: need 0 < begin <= end"),
        (-8, 100, 2, "sizes -b -8 -e 100: need 0 < begin <= end"),
        (100, 8, 2, "sizes -b 100 -e 8: need 0 < begin <= end"),
        (8, 100, 1, "-f 1: the size factor must be > 1"),
        (8, 100, 0.5, "-f 0.5: the size factor must be > 1"),
    ],
)
def test_sizes_from_errors(b, e, f, needle):
    with pytest.raises(ValueError) as err:
        sizes_from(b, e, f)
    assert str(err.value) == needle


def _no_spawn(*args, **kwargs):
    raise AssertionError("bench spawned ranks before validating its size arguments")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["-f", "1"], "-f 1.0: the size factor must be > 1"),
        (["-b", "0"], "need 0 < begin <= end"),
        (["-b", "abc"], "abc"),
    ],
)
def test_bad_size_flags_fail_before_spawning(monkeypatch, capsys, flags, needle):
    monkeypatch.setattr(bench, "launch", _no_spawn)
    assert main(["bench", "allreduce", "--nprocs", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanllm: error: ") and needle in err


def test_bad_stepfactor_type_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "allreduce", "-f", "four"])
    assert e.value.code == 2
    assert "argument -f/--stepfactor: invalid float value: 'four'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# the command table


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for words, _, help_ in COMMANDS:
        assert f"  {words}" in out and help_ in out
    assert main([]) == 0
    assert capsys.readouterr().out == out


def test_help_from_the_console_entry_point():
    script = os.path.join(os.path.dirname(sys.executable), "spanllm")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "spanllm.cli"]
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for words, _, _ in COMMANDS:
        assert words in out.stdout
    bad = subprocess.run(cmd + ["frobnicate"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    assert {"bench allreduce", "tune"} <= {w for w, _, _ in COMMANDS}


@pytest.mark.parametrize(
    "argv,line",
    [
        (["frobnicate"], "unknown command 'frobnicate'; `spanllm --help` lists the commands"),
        (["serv"], "unknown command 'serv'; did you mean `spanllm serve`? `spanllm --help` lists the commands"),
        (
            ["bench", "nope"],
            "unknown command 'bench nope'; `spanllm bench` takes one of: allreduce, gemm, batch, study, throughput, "
            "host, attention, serve, multi-turn",
        ),
        (
            ["perf"],
            "`spanllm perf` needs one of: calibrate, validate (e.g. `spanllm perf calibrate --help`)",
        ),
    ],
)
def test_unknown_command_returns_2(capsys, argv, line):
    """The usage line and one error line, not the command table."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "usage: spanllm [--debug] [--pg-timeout S] COMMAND [options]   (spanllm COMMAND --help for its options)",
        f"spanllm: error: {line}",
    ]


def test_bench_allreduce_help_lists_nccl_tests_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "allreduce", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("-b", "-e", "-f", "-n", "-w", "--json", "--nprocs", "--ranks-per-node", "--algos", "--dtype"):
        assert flag in out


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--rounds", "4", "-n", "3"]])
def test_bad_rounds_fail_before_spawning(monkeypatch, capsys, flags):
    monkeypatch.setattr(bench, "launch", _no_spawn)
    assert main(["bench", "allreduce", "--nprocs", "2", *flags]) == 2
    assert re.search(r"spanllm: error: --rounds \d+: must be between 1 and --iters", capsys.readouterr().err)


def test_rounds_pool_every_sample_into_one_row_per_algorithm(tmp_path):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "allreduce",
                "--nprocs",
                "2",
                "-b",
                "8",
                "-e",
                "32",
                "-f",
                "4",
                "-n",
                "5",
                "-w",
                "1",
                "--rounds",
                "2",
                "--algos",
                "gloo,ref_ring",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["settings"]["rounds"] == 2
    rows = doc["rows"]
    assert [(r["size"], r["algo"]) for r in rows] == [(8, "gloo"), (8, "ref_ring"), (32, "gloo"), (32, "ref_ring")]
    for r in rows:  # 5 samples split 3 + 2 over the rounds, pooled; the row's median is theirs
        assert r["rounds"] == 2 and len(r["samples_us"]) == 5 and r["wrong"] == 0
        assert r["time_us"] == pytest.approx(sorted(r["samples_us"])[2])
