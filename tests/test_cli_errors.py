"""The command line's own errors, each one line (at most the one-line usage before it) and a non-zero exit:
argparse mistakes, --pg-timeout where no collectives run, `serve MODEL` against --model, a port in use (before
the engine is built), and output cut short by its reader (`spanllm -h | head -3`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import spanllm.commands.generate
import spanllm.commands.serve
import spanllm.launch
from spanllm.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


@pytest.fixture
def no_engine(monkeypatch):
    """Bad input is refused before any rank starts or any engine is built."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks started / engine built for bad input")

    monkeypatch.setattr(spanllm.commands.serve, "_rank", refuse)
    monkeypatch.setattr(spanllm.launch, "launch", refuse)  # serve imports it when it runs
    monkeypatch.setattr(spanllm.commands.generate, "launch", refuse)


def _spanllm(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spanllm.cli", *argv], text=True, env=ENV, timeout=300, **kw)


# --- argparse mistakes: the one-line usage and one error line ----------------------------------------------
@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["generate", "--model", "tiny", "--max-new-tokens", "many"],
            "argument --max-new-tokens: invalid int value: 'many'",
        ),
        (["generate", "--prompt-ids", "1"], "the following arguments are required: --model"),
        (["bench", "serve", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["plan", "--nodes"], "argument --nodes: expected one argument"),
        (
            ["bench", "throughput", "--model", "tiny", "--dataset-name", "x"],
            "argument --dataset-name: invalid choice: 'x' (choose from 'sharegpt', 'random', "
            "'generated-shared-prefix', 'prefix_repetition')",
        ),
    ],
)
def test_argparse_mistake_is_usage_plus_one_line(capsys, argv, line):
    words = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"usage: spanllm {words} [options]   (spanllm {words} --help lists them)",
        f"spanllm: error: {line}",
    ]


def test_argparse_mistake_from_the_console_entry_point():
    out = _spanllm("generate", "--model", "tiny", "--top-k", "x", capture_output=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "usage: spanllm generate [options]   (spanllm generate --help lists them)\n"
        "spanllm: error: argument --top-k: invalid int value: 'x'\n"
    )


# --- --pg-timeout: only where ranks run collectives ----------------------------------------------------------
NO_COLLECTIVES = [
    ["plan"],
    ["perf", "calibrate"],
    ["perf", "validate"],
    ["bench", "serve"],
    ["bench", "gemm"],
    ["bench", "host"],
]


@pytest.mark.parametrize("where", ["before", "after", "after="])
@pytest.mark.parametrize("command", NO_COLLECTIVES, ids=[" ".join(c) for c in NO_COLLECTIVES])
def test_pg_timeout_refused_without_collectives(capsys, command, where):
    argv = (
        ["--pg-timeout", "30", *command]
        if where == "before"
        else [*command, "--pg-timeout", "30"]
        if where == "after"
        else [*command, "--pg-timeout=30"]
    )
    assert main(argv) == 2
    words = " ".join(command)
    assert capsys.readouterr().err == (
        f"spanllm: error: --pg-timeout: `spanllm {words}` starts no ranks, so it has no collectives to time out; "
        "leave it out\n"
    )


def test_pg_timeout_env_is_not_refused(monkeypatch, capsys):
    """The environment variable is for every rank of every job; only the option is refused."""
    monkeypatch.setenv("SPANLLM_PG_TIMEOUT_S", "30")
    assert main(["plan", "--model", "llama3.1-8b", "--nodes", "1", "--top", "1"]) == 0
    assert "llama3.1-8b" in capsys.readouterr().out


# --- tensor-parallel aliases reach the same checks --------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--tp", "--tensor-parallel-size", "-tp"])
def test_tp_aliases_are_checked_as_tp(no_engine, capsys, flag):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2", flag, "0"]) == 2
    assert capsys.readouterr().err == (
        "spanllm: error: --tp 0: must be >= 1 (tensor-parallel degree; leave it out for world size / --pp)\n"
    )


# --- serve MODEL -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["serve", "tiny", "--model", "llama3.1-8b"],
            "the model is given twice, 'tiny' and --model 'llama3.1-8b': give one of them",
        ),
        (["serve"], "no model: give one, `spanllm serve MODEL` or `spanllm serve --model MODEL` (e.g. tiny)"),
        (
            ["serve", "--port", "0"],
            "no model: give one, `spanllm serve MODEL` or `spanllm serve --model MODEL` (e.g. tiny)",
        ),
    ],
)
def test_serve_model_positional_or_option(no_engine, capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"spanllm: error: {line}\n"


@pytest.mark.parametrize("argv", [["tiny"], ["--model", "tiny"], ["tiny", "--model", "tiny"]])
def test_serve_takes_the_model_either_way(monkeypatch, argv):
    seen = {}

    def fake_rank(ctx, args):
        seen["model"] = args.model

    monkeypatch.setattr(spanllm.commands.serve, "_rank", fake_rank)
    assert main(["serve", *argv, "--port", "0"]) == 0
    assert seen == {"model": "tiny"}


def test_positional_model_is_serve_only(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "tiny", "--prompt-ids", "1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "spanllm: error: the following arguments are required: --model"


# --- port in use: one line, before the engine is built ----------------------------------------------------------
@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use_before_the_engine(no_engine, capsys, busy_port):
    assert main(["serve", "tiny", "--port", str(busy_port)]) == 2
    assert capsys.readouterr().err == (
        f"spanllm: error: --port {busy_port}: 127.0.0.1:{busy_port} is already in use (another server?); stop "
        "that process, or choose another port (--port 0 picks a free one)\n"
    )


def test_port_in_use_from_the_console_entry_point(busy_port):
    out = _spanllm("serve", "--model", "tiny", "--port", str(busy_port), capture_output=True)
    assert out.returncode == 2 and out.stdout == ""  # nothing built: the engine's description is not printed
    assert out.stderr.startswith(f"spanllm: error: --port {busy_port}: 127.0.0.1:{busy_port} is already in use")
    assert out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "host,line",
    [
        (
            "192.0.2.1",  # TEST-NET-1 (RFC 5737): never an address of this machine
            "--host 192.0.2.1: 192.0.2.1 is not an address of this machine; use 127.0.0.1, 0.0.0.0 (every "
            "interface) or one of its own addresses",
        ),
        ("no-such-host.invalid", "--host 'no-such-host.invalid': cannot resolve it"),
    ],
)
def test_host_that_cannot_be_bound(no_engine, capsys, host, line):
    assert main(["serve", "tiny", "--host", host, "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spanllm: error: {line}") and err.count("\n") == 1


def test_port_checked_on_rank_0_only(no_engine, monkeypatch, busy_port):
    """Under a launcher only rank 0 serves: the other ranks neither check nor hold the port."""
    import spanllm.checks

    checked = []
    monkeypatch.setattr(spanllm.checks, "port_free", lambda host, port: checked.append((host, port)))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AssertionError, match="ranks started"):  # got past the checks to the launch
        main(["serve", "tiny", "--port", str(busy_port)])
    assert checked == []
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(AssertionError, match="ranks started"):
        main(["serve", "tiny", "--port", str(busy_port)])
    assert checked == [("127.0.0.1", busy_port)]


# --- output cut short by its reader ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["-h"], ["--version"], ["serve", "-h"], ["bench", "serve", "--help"]])
def test_closed_pipe_ends_quietly_with_141(argv):
    """The reader is gone before the first write (the worst case of `| head`): no traceback, exit 128 + SIGPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        out = _spanllm(*argv, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (141, "")


def test_help_through_head_as_a_user_types_it():
    out = subprocess.run(
        f"{sys.executable} -m spanllm.cli -h | head -3",
        shell=True,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.splitlines() == [
        "usage: spanllm [--debug] [--pg-timeout S] COMMAND [options]   (spanllm COMMAND --help for its options)",
        "",
        "commands:",
    ]
